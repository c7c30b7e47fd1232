"""Tokenizers: the demo's word-level tokenizer (built in code, no download) or a
local Hugging Face tokenizer folder, and how each medium is written into a prompt.

Shard prompts mark media with loomrl's markers `<image>` / `<audio>`, whatever the
tokenizer. `media_layout` says which tokens replace a marker: the demo (and any
tokenizer with no checkpoint config) has `<image>` / `<audio>` tokens of its own;
a Qwen2-VL / Qwen2.5-VL checkpoint writes an image as `<|vision_start|>`, its
placeholders (`image_token_id`), `<|vision_end|>`; Qwen2-Audio writes a clip as
`<|audio_bos|>`, its placeholders (`audio_token_index`), `<|audio_eos|>`.

A tokenizer folder is input from outside: before transformers reads it, every file it would
read is checked for size (TOKENIZER_FILE_LIMITS) and every JSON file for nesting depth
(MAX_JSON_DEPTH, counted without recursion), and any failure of the loader itself (a
RecursionError included) is a ValueError naming the folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from loomrl.datasets.demo import vocabulary
from loomrl.encoders.base import TEXT_CHECKPOINTS, MediaTokens, checkpoint_towers, modalities, token_id

# The demo tokenizer's vocabulary starts with these (their ids are fixed: a new modality does
# not shift the demo's words; the demo reads images and audio)
MEDIA_SPECIALS = ["<image>", "<audio>"]
SPECIALS = ["<pad>", "<eos>", "<unk>", *MEDIA_SPECIALS]


def build_word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over `words`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(words) - set(SPECIALS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces, as written
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=MEDIA_SPECIALS,
    )


_MB = 1 << 20
TOKENIZER_FILE_LIMITS = {
    "tokenizer.json": 256 * _MB,
    "vocab.json": 128 * _MB,
    "vocab.txt": 128 * _MB,
    "merges.txt": 128 * _MB,
    "tokenizer.model": 128 * _MB,
    "tokenizer_config.json": 16 * _MB,
    "special_tokens_map.json": 16 * _MB,
    "added_tokens.json": 16 * _MB,
    "chat_template.json": _MB,
    "chat_template.jinja": _MB,
    "config.json": 16 * _MB,
    "processor_config.json": 16 * _MB,
    "preprocessor_config.json": 16 * _MB,
}
"""The largest file of each name a tokenizer folder may hold (Qwen's tokenizer.json: 7 MB)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of a tokenizer JSON file (real ones: under 10)."""
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(data: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of JSON text (strings skipped), counted without recursion; stops
    counting once past `limit` (returns limit + 1)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_JSON_STRING.sub(b'""', data)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def check_tokenizer_files(folder: Path) -> None:
    """Every file transformers would read from a tokenizer folder within its size limit, and
    every JSON one within MAX_JSON_DEPTH; else a ValueError naming the file."""
    for name, limit in TOKENIZER_FILE_LIMITS.items():
        path = folder / name
        try:
            if not path.is_file():
                continue
            size = path.stat().st_size
            if size > limit:
                raise ValueError(f"{path}: {size} bytes, over the {limit} a tokenizer file may have")
            if name.endswith(".json") and json_depth(path.read_bytes()) > MAX_JSON_DEPTH:
                raise ValueError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        except OSError as e:
            raise ValueError(f"{path}: cannot read: {e}") from None


def load_tokenizer(spec: str):
    """The demo tokenizer, or the tokenizer folder `spec`, checked first (check_tokenizer_files);
    a folder that does not load is an OSError or ValueError naming it."""
    if spec == "demo":
        return build_word_tokenizer(vocabulary())
    from transformers import AutoTokenizer

    folder = Path(spec)
    if folder.is_dir():
        check_tokenizer_files(folder)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - a folder from outside: any failure of the loader is the folder's
        raise ValueError(f"{folder}: the tokenizer fails to load: {type(e).__name__}: {str(e)[:300]}") from None


def media_layout(
    tokenizer, hf_config: Optional[dict] = None, where: str = "config.json"
) -> dict[str, Optional[MediaTokens]]:
    """MediaTokens for each modality (encoders/base.py); None for a medium the model cannot read.

    hf_config: the checkpoint's config.json (model.init_from). Its `image_token_id`
    (+ `vision_start_token_id` / `vision_end_token_id`) or `audio_token_index` (+ the
    tokenizer's `<|audio_bos|>` / `<|audio_eos|>`) decide; a checkpoint without a medium's
    key cannot read that medium. Without a config (or a text-only Qwen2 one), the
    tokenizer's own `<image>` / `<audio>` tokens are the placeholders."""
    n = len(tokenizer)

    def checked(key: str, i) -> int:
        if not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{where}: {key} = {i!r} is not a token of the tokenizer ({n} tokens)")
        return i

    if hf_config is not None and hf_config.get("model_type") not in TEXT_CHECKPOINTS:
        return {m.name: m.checkpoint_tokens(tokenizer, hf_config, checked) for m in modalities()}
    out: dict[str, Optional[MediaTokens]] = {}
    for m in modalities():
        i = token_id(tokenizer, m.marker)
        out[m.name] = None if i is None else MediaTokens(i)
    if not any(out.values()):
        markers = [m.marker for m in modalities()]
        raise ValueError(
            f"tokenizer has none of the tokens {', '.join(markers)}, and model.init_from "
            "names no checkpoint whose config.json gives the media tokens"
        )
    return out


def readable_media(
    tokenizer, hf_config: Optional[dict] = None, where: str = "config.json"
) -> dict[str, Optional[MediaTokens]]:
    """What a policy reads: each modality's MediaTokens when the model has its tower and its
    tokens (the demo: every tower; a checkpoint: the towers of its model type), else None (a
    prompt with that medium is refused, a sample with it skipped)."""
    kinds = [m.name for m in modalities()] if hf_config is None else checkpoint_towers(hf_config, where)
    layout = media_layout(tokenizer, hf_config, where) if kinds else {}
    return {m.name: layout.get(m.name) if m.name in kinds else None for m in modalities()}
