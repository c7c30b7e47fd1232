"""The Qwen-VL-style policy: vision tower + audio tower + projector + Qwen2 decoder.

Prompts carry `<image>` / `<audio>` markers; `prompt_ids` expands each marker
into as many placeholder tokens as the medium's encoding has, and `embed`
splices the encodings into those positions (row-major, as transformers'
Qwen2-VL does with masked_scatter), so gradients reach the encoders.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loomrl.encoders.audio import build_audio_tower, encode_audio, num_audio_tokens
from loomrl.encoders.media import Medium
from loomrl.encoders.vision import build_vision_tower, encode_images, num_image_tokens
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig, KVCache
from loomrl.platform.backbone.tokenizer import AUDIO_MARKER, IMAGE_MARKER
from loomrl.platform.recipe import ModelConfig


class VLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tokenizer):
        super().__init__()
        self.cfg = cfg
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_MARKER)
        self.audio_token_id = tokenizer.convert_tokens_to_ids(AUDIO_MARKER)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        # Never generated, by the rollout engine and in the trainer's log-probs alike, so
        # both see the same distribution: padding, unknown and media placeholders.
        banned = {self.pad_token_id, tokenizer.unk_token_id, self.image_token_id, self.audio_token_id}
        self.register_buffer("banned_token_ids", torch.tensor(sorted(i for i in banned if i is not None)),
                             persistent=False)
        self.visual = build_vision_tower(cfg.vision, cfg.hidden_size, cfg.init_std)
        self.audio_tower = build_audio_tower(cfg.audio, cfg.init_std)
        # Qwen2-Audio's multi_modal_projector.linear: audio width -> backbone width.
        self.audio_projector = nn.Linear(cfg.audio.d_model, cfg.hidden_size)
        self.language_model = Decoder(DecoderConfig(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            intermediate_size=cfg.intermediate_size, rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings))
        for m in [self.audio_projector, *self.language_model.modules()]:
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ inputs

    def media_tokens(self, m: Medium) -> int:
        if m.kind == "image":
            return num_image_tokens(m.grid, self.cfg.vision)
        return num_audio_tokens(self.cfg.audio)

    def prompt_ids(self, tokenizer, text: str, media: list[Medium]) -> list[int]:
        """Token ids of a prompt with each marker expanded to its medium's token count."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        markers = [i for i in ids if i in (self.image_token_id, self.audio_token_id)]
        kinds = ["image" if i == self.image_token_id else "audio" for i in markers]
        if kinds != [m.kind for m in media]:
            raise ValueError(f"prompt markers {kinds} do not match its media {[m.kind for m in media]}")
        out, k = [], 0
        for i in ids:
            if i in (self.image_token_id, self.audio_token_id):
                out.extend([i] * self.media_tokens(media[k]))
                k += 1
            else:
                out.append(i)
        return out

    # ------------------------------------------------------------------ encoders

    def encode_media(self, media: list[Medium]) -> dict[str, torch.Tensor]:
        """Encodings [tokens, hidden] by content hash; each distinct medium encoded once."""
        unique: dict[str, Medium] = {}
        for m in media:
            unique.setdefault(m.hash, m)
        out: dict[str, torch.Tensor] = {}
        images = [m for m in unique.values() if m.kind == "image"]
        if images:
            enc = encode_images(self.visual, torch.cat([m.features for m in images]),
                                torch.stack([m.grid for m in images]))
            for m, e in zip(images, enc.split([self.media_tokens(m) for m in images])):
                out[m.hash] = e
        clips = [m for m in unique.values() if m.kind == "audio"]
        if clips:
            enc = self.audio_projector(encode_audio(self.audio_tower, torch.stack([m.features for m in clips])))
            for m, e in zip(clips, enc):
                out[m.hash] = e
        return out

    def embed(self, input_ids: torch.Tensor, row_media: list[list[Medium]],
              encodings: dict[str, torch.Tensor]) -> torch.Tensor:
        """Token embeddings with media encodings spliced into the placeholder positions."""
        is_media = (input_ids == self.image_token_id) | (input_ids == self.audio_token_id)
        embeds = self.language_model.embed(input_ids)
        flat = [encodings[m.hash] for row in row_media for m in row]
        if not flat:
            return embeds
        flat = torch.cat(flat).to(embeds.dtype)
        if flat.shape[0] != int(is_media.sum()):
            raise ValueError(f"{int(is_media.sum())} media placeholders but {flat.shape[0]} media tokens")
        return embeds.masked_scatter(is_media[..., None], flat)

    # ------------------------------------------------------------------ forward

    def forward_embeds(self, embeds: torch.Tensor, attention_mask: torch.Tensor,
                       cache: KVCache | None = None, past_len: torch.Tensor | None = None):
        """Logits for embeddings. attention_mask covers past + new tokens; positions
        count only real tokens, so left padding does not shift RoPE."""
        t = embeds.shape[1]
        positions = attention_mask.long().cumsum(-1)[:, -t:] - 1
        return self.language_model(embeds, positions.clamp(min=0), attention_mask.bool(), cache)

    def sequence_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          row_media: list[list[Medium]], temperature: float = 1.0,
                          encodings: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of input_ids[:, 1:] under logits / temperature, and the
        entropy of that distribution; both [B, T-1]."""
        if encodings is None:
            encodings = self.encode_media([m for row in row_media for m in row])
        logits, _ = self.forward_embeds(self.embed(input_ids, row_media, encodings), attention_mask)
        logp_all = self.token_logprobs(logits[:, :-1], temperature)
        targets = input_ids[:, 1:]
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        # Positions that predict a banned token (padding, media placeholders) are never
        # trained on; give them 0 instead of -inf so masked sums stay finite.
        logp = logp.masked_fill(torch.isin(targets, self.banned_token_ids), 0.0)
        entropy = -(logp_all.exp() * logp_all.clamp(min=-1e30)).sum(-1)
        return logp, entropy

    def token_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """log softmax(logits / temperature) in fp32 with the banned tokens removed."""
        logits = logits.float() / temperature
        logits = logits.index_fill(-1, self.banned_token_ids, float("-inf"))
        return F.log_softmax(logits, dim=-1)


def build_policy(cfg: ModelConfig, tokenizer, seed: int) -> VLM:
    torch.manual_seed(seed)
    return VLM(cfg, tokenizer)
