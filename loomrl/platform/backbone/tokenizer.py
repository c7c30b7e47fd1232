"""Tokenizers: the demo's word-level tokenizer (built in code, no download) or a
local Hugging Face tokenizer folder."""
from __future__ import annotations

from pathlib import Path

IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"
SPECIALS = ["<pad>", "<eos>", "<unk>", IMAGE_MARKER, AUDIO_MARKER]


def build_word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over `words`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(words) - set(SPECIALS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces, as written
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=[IMAGE_MARKER, AUDIO_MARKER])


def load_tokenizer(spec: str):
    if spec == "demo":
        from loomrl.datasets.demo import vocabulary

        return build_word_tokenizer(vocabulary())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(spec), local_files_only=True)
    for marker in (IMAGE_MARKER, AUDIO_MARKER):
        if tok.convert_tokens_to_ids(marker) in (None, tok.unk_token_id):
            raise ValueError(f"tokenizer {spec}: has no {marker} token")
    return tok
