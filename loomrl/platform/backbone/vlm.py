"""The Qwen-VL-style policy: vision tower + audio tower + projector + Qwen2 decoder.

Which towers exist: the demo (no `model.init_from`) has both; a checkpoint has its own
(Qwen2-VL / Qwen2.5-VL: vision; Qwen2-Audio: audio + projector; Qwen2: none), so a policy
started from it has the checkpoint's parameters and no random extras. An absent tower is
None, and a prompt with its medium is refused.

Prompts carry `<image>` / `<audio>` markers; `prompt_ids` expands each marker into the model's media
tokens (`tokenizer.media_layout`: the demo's own marker token, or a checkpoint's `<|vision_start|>`
+ placeholders + `<|vision_end|>`) with as many placeholder tokens as the medium's encoding has, and
`embed` splices the encodings into those positions (row-major, as transformers' Qwen2-VL does with
masked_scatter), so gradients reach the encoders.

With `model.init_from` the vocabulary is the checkpoint's (its embedding may have
more rows than the tokenizer has tokens; those rows are never sampled nor scored),
and a decoder with M-RoPE gets (t, h, w) positions for image tokens (`mrope.py`).

`encode` runs the towers once per distinct medium (loomrl.encoders.cache): requests without a
gradient through a tower (rollouts, old/reference log-probs, a tower with no trainable weight) are
served from and stored in a bounded LRU keyed by content hash, preprocessing, tower identity and
weights version. The cache holds raw tower output: for images the vision merger's output (the merger
is part of the tower, so a trainable merger keeps images out of the cache), for clips the audio
tower's output before the projector (which may train either way).

Freezing (`freeze`, by part: vision, merger, audio, audio_projector, language_model,
embeddings; `parameter_parts` says which weights each holds): a frozen part's weights
get requires_grad False, so no engine optimises them. `model.encoders.frozen` freezes
vision, merger and audio (those the model has). A tower with no trainable weight runs in
eval mode (deterministic, cacheable across steps). `set_activation_checkpointing`
recomputes decoder layers and the blocks of trained towers in the backward.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from loomrl.encoders.base import MODALITIES, Modality, checkpoint_towers, modalities, modality
from loomrl.encoders.cache import EncodeStats, EncodingCache, Encodings, encode_distinct, encode_every_copy
from loomrl.encoders.hf_checkpoint import read_config
from loomrl.encoders.media import Medium, settings_fingerprint
from loomrl.platform.backbone.config import DEFAULT_ROUNDING, ROUNDING_REGIONS, ModelConfig
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig, KVCache
from loomrl.platform.backbone.hf_io import decoder_config, load_policy
from loomrl.platform.backbone.lora import apply_lora
from loomrl.platform.backbone.mrope import rope_index
from loomrl.platform.backbone.rounding import Regions
from loomrl.platform.backbone.tokenizer import readable_media
from loomrl.platform.engines.config import ENCODER_PARTS, FREEZE_PARTS, frozen_parts
from loomrl.platform.placement import to_device, to_host

# Encodings for `embed`: by Medium.key (deduplicated), or one per media placement, row-major (naive).
MediaEncodings = Union[Encodings, list[torch.Tensor]]
DeepStack = tuple[torch.Tensor, list[torch.Tensor]]
"""Qwen3-VL's DeepStack inputs: the media positions bool [B, T] and one [N, hidden] per level."""


def weights_version(module: nn.Module) -> int:
    """A number that grows whenever any weight of `module` is written in place (every
    optimizer step, every load_state_dict): the sum of the tensors' version counters."""
    return sum(t._version for t in module.parameters()) + sum(t._version for t in module.buffers())


class VLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tokenizer, hf_config: Optional[dict] = None):
        """hf_config: config.json of the checkpoint the weights will come from (model.init_from):
        it gives the vocabulary size, the media tokens and which towers exist (Qwen2-VL /
        Qwen2.5-VL: the vision tower, of the checkpoint's class and config; Qwen2-Audio: the
        audio tower + projector; Qwen2: none). Without it (the demo) both towers are built from
        cfg.vision / cfg.audio. An absent tower is None, and so is its medium's entry in
        `media_tokens_of`: a prompt with that medium is refused."""
        super().__init__()
        self.cfg = cfg
        where = f"{cfg.init_from}/config.json"
        # kind -> MediaTokens | None (None: the model cannot read that medium; a prompt using it is refused)
        self.media_tokens_of = readable_media(tokenizer, hf_config, where)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        vocab_size, checkpoint = len(tokenizer), None
        if hf_config is not None:
            checkpoint = decoder_config(hf_config, where)
            vocab_size = checkpoint.vocab_size
            if vocab_size < len(tokenizer):
                raise ValueError(
                    f"{where}: vocab_size {vocab_size} is smaller than the tokenizer "
                    f"{cfg.tokenizer!r} ({len(tokenizer)} tokens)"
                )
        # Never generated, by the rollout engine and in the trainer's log-probs alike, so
        # both see the same distribution: padding, unknown, media placeholders, and the
        # embedding rows a checkpoint pads its vocabulary with (no token has them). Never
        # end-of-sequence, which Qwen tokenizers may also use as padding.
        banned = {
            self.pad_token_id,
            tokenizer.unk_token_id,
            *self.placeholder_ids(),
            *range(len(tokenizer), vocab_size),
        } - {self.eos_token_id}
        self.register_buffer(
            "banned_token_ids", torch.tensor(sorted(i for i in banned if i is not None)), persistent=False
        )
        # Each modality's modules (`visual`; `audio_tower`, `audio_projector`): None when absent.
        for m in modalities():
            for attr in m.tower_attrs:
                setattr(self, attr, None)
            if hf_config is None:  # the demo: every tower, from the recipe's sizes
                m.build_demo(self, cfg)
            elif m.name in checkpoint_towers(hf_config, where):
                m.build_from_checkpoint(self, hf_config, where)
        self.language_model = Decoder(language_model_config(cfg, vocab_size, checkpoint))
        for module in [*(x for m in modalities() for x in m.reinitialised(self)), *self.language_model.modules()]:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        self.frozen: set[str] = set()  # parts frozen by name (freeze); apply_frozen re-applies them
        self.apply_frozen()
        self.encoding_cache = EncodingCache(cfg.encoders.cache_size)
        self.encode_totals = EncodeStats()  # all encoder work of this model, for per-step metrics
        # Weights loaded with assign=True are new tensors with fresh version counters.
        self.register_load_state_dict_post_hook(lambda module, keys: module.encoding_cache.clear())

    def train(self, mode: bool = True) -> "VLM":
        super().train(mode)
        for tower in self.tower_modules():  # a frozen tower is an inference module: deterministic, cacheable
            if not any(p.requires_grad for p in tower.parameters()):
                tower.eval()
        return self

    # ------------------------------------------------------------------ parts

    def parameter_parts(self) -> dict[str, list[nn.Parameter]]:
        """The weights of each part the model has (FREEZE_PARTS order; an absent tower's parts are
        left out): vision (the vision tower less its merger), merger, audio (the audio tower),
        audio_projector, language_model (decoder layers and final norm), embeddings (input
        embedding and LM head). Every parameter is in exactly one part."""
        parts: dict[str, list[nn.Parameter]] = {}
        for m in modalities():
            parts.update(m.parameter_parts(self))
        embeddings = self.language_model.embedding_parameters()
        parts["language_model"] = [p for p in self.language_model.parameters() if not any(p is q for q in embeddings)]
        parts["embeddings"] = embeddings
        return {name: parts[name] for name in FREEZE_PARTS if name in parts}

    def freeze(self, parts: Iterable[str], key: str = "training.freeze") -> None:
        """Freeze `parts` (FREEZE_PARTS names): their weights stop requiring grad, and a tower
        left with no trainable weight goes to eval mode. A part this model does not have is a
        ValueError naming it and `key`."""
        parts = list(parts)
        have = self.parameter_parts()
        for part in parts:
            if part not in FREEZE_PARTS:
                raise ValueError(f"{key}: unknown part {part!r}; parts: {', '.join(FREEZE_PARTS)}")
            if part not in have:
                raise ValueError(
                    f"{key}: the model has no {part!r} to freeze (model.init_from="
                    f"{self.cfg.init_from!r}; its parts: {', '.join(have)})"
                )
        self.frozen.update(parts)
        self.apply_frozen()

    def frozen_parts(self) -> set[str]:
        """The parts the recipe freezes: those named to `freeze` and, with model.encoders.frozen, the towers."""
        return frozen_parts(self.frozen, self.cfg.encoders.frozen)

    def apply_frozen(self) -> None:
        """(Re)apply `frozen_parts` (requires_grad off); called again when a tower is replaced
        (encoders.hf_checkpoint.attach_towers)."""
        parts = self.parameter_parts()
        for part in self.frozen_parts() & parts.keys():
            for p in parts[part]:
                p.requires_grad_(False)
        self.train(self.training)

    def part_counts(self) -> dict[str, tuple[int, int]]:
        """(trainable, frozen) parameter counts of each part the model has."""
        return {
            part: (
                sum(p.numel() for p in params if p.requires_grad),
                sum(p.numel() for p in params if not p.requires_grad),
            )
            for part, params in self.parameter_parts().items()
        }

    def describe_parts(self) -> str:
        """One line: each part's trainable / frozen parameter counts, e.g. `vision 0/175.2K`."""

        def size(n: int) -> str:
            for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
                if n >= scale:
                    return f"{n / scale:.1f}{unit}"
            return str(n)

        counts = self.part_counts()
        trainable = sum(t for t, _ in counts.values())
        frozen = sum(f for _, f in counts.values())
        parts = ", ".join(f"{part} {size(t)}/{size(f)}" for part, (t, f) in counts.items())
        return f"trainable/frozen params: {parts}; total {size(trainable)} trainable, {size(frozen)} frozen"

    def set_activation_checkpointing(self, on: bool) -> None:
        """Recompute activations in the backward (training.activation_checkpointing): each decoder
        layer, and the blocks of the vision / audio tower when they train (transformers'
        gradient checkpointing, non-reentrant; call after freezing). Only forwards in train mode
        with grad enabled recompute; a frozen tower runs in eval mode and never does."""
        self.language_model.activation_checkpointing = on
        for m in modalities():
            tower = m.tower(self)
            if tower is None:
                continue
            parts = m.parameter_parts(self)
            if not parts:  # a medium read by another modality's tower (video: the vision tower)
                continue
            own = next(iter(parts.values()))  # the tower's own part (vision less its merger)
            if on and any(p.requires_grad for p in own):
                tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            elif tower.gradient_checkpointing:
                tower.gradient_checkpointing_disable()

    def tower_modules(self) -> list[nn.Module]:
        """The towers this model has (vision, audio; an absent one is left out)."""
        towers: list[nn.Module] = []
        for t in (m.tower(self) for m in modalities()):  # video shares the vision tower: listed once
            if t is not None and not any(t is u for u in towers):
                towers.append(t)
        return towers

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (`training.device`, see loomrl/platform/placement.py)."""
        return self.banned_token_ids.device

    def tower_of(self, kind: str) -> nn.Module:
        """The tower that encodes `kind`; a ValueError naming the checkpoint when the model has none."""
        m = modality(kind)
        tower = m.tower(self)
        if tower is None:
            raise ValueError(
                f"the model has no {m.tower_name} tower for {kind!r} media (model.init_from={self.cfg.init_from!r})"
            )
        return tower

    def placeholder_ids(self) -> list[int]:
        """The placeholder token of each medium the model reads."""
        return [t.placeholder for t in self.media_tokens_of.values() if t is not None]

    @property
    def image_token_id(self) -> Optional[int]:
        """The image placeholder (M-RoPE places image tokens by it); None without a vision tower."""
        tokens = self.media_tokens_of.get("image")
        return tokens.placeholder if tokens else None

    @property
    def audio_token_id(self) -> Optional[int]:
        tokens = self.media_tokens_of.get("audio")
        return tokens.placeholder if tokens else None

    def set_stop_token(self, token_id: int) -> None:
        """Completions end at `token_id` (a chat template's end-of-turn) instead of the tokenizer's
        EOS. Padding is then never generated, even where it doubles as that EOS (Qwen's base
        tokenizers), in rollouts and the trainer's log-probs alike."""
        banned = set(self.banned_token_ids.tolist()) | ({self.pad_token_id} - {None})
        banned.discard(token_id)
        self.eos_token_id = token_id
        self.banned_token_ids = torch.tensor(sorted(banned), device=self.banned_token_ids.device)

    # ------------------------------------------------------------------ inputs

    def media_tokens(self, m: Medium) -> int:
        return modality(m.kind).num_tokens(m, self.cfg)

    def prompt_ids(self, tokenizer, text: str, media: list[Medium]) -> list[int]:
        """Token ids of a prompt with each `<image>` / `<audio>` marker replaced by the model's
        tokens for that medium, placeholders repeated to the medium's token count. The text
        between markers is tokenized piece by piece, as around any special token."""
        by_marker = {m.marker: m.name for m in modalities()}
        pieces = re.split("(" + "|".join(map(re.escape, by_marker)) + ")", text)
        kinds = [by_marker[p] for p in pieces[1::2]]
        if kinds != [m.kind for m in media]:
            raise ValueError(f"prompt markers {kinds} do not match its media {[m.kind for m in media]}")
        for kind in dict.fromkeys(kinds):
            if self.media_tokens_of[kind] is None:
                readers = ", ".join(modality(kind).checkpoint_types)
                raise ValueError(
                    f"the prompt has {kind} but the model has no {kind} token "
                    f"(model.init_from={self.cfg.init_from!r}, model.tokenizer={self.cfg.tokenizer!r}; "
                    f"checkpoints that read {kind}: {readers})"
                )
        out: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                m = media[k // 2]
                out += modality(m.kind).prompt_tokens(m, self.media_tokens_of[m.kind], tokenizer, self.cfg)
            elif piece:
                out += tokenizer(piece, add_special_tokens=False)["input_ids"]
        return out

    # ------------------------------------------------------------------ encoders

    def towers(self, media: list[Medium]) -> list[torch.Tensor]:
        """Raw tower outputs, one per item of `media` (images in one vision call, clips in
        one audio call): [tokens, hidden] for images, [tokens, audio d_model] for clips."""
        if any(m.kind not in MODALITIES for m in media):
            raise ValueError(f"unknown medium kinds {sorted({m.kind for m in media})}")
        out: list[torch.Tensor | None] = [None] * len(media)
        for m, where in self._by_modality(media):
            items = [media[i] for i in where]
            inputs = tuple(to_device(t, self.device) for t in m.batch(items))
            for i, e in zip(where, m.encode(self.tower_of(m.name), inputs, items, self.cfg)):
                out[i] = e
        return out

    @staticmethod
    def _by_modality(media: list[Medium]) -> list[tuple[type[Modality], list[int]]]:
        """(modality, the indices of its items in `media`) for each modality `media` has, in order."""
        out = [(m, [i for i, x in enumerate(media) if x.kind == m.name]) for m in modalities()]
        return [(m, where) for m, where in out if where]

    def project(self, media: list[Medium], raw: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tower outputs -> backbone width. Images: the vision merger already did it; clips:
        Qwen2-Audio's projector (trainable even when the towers are frozen, so never cached)."""
        out = list(raw)
        for m, where in self._by_modality(media):
            for i, e in zip(where, m.project(self, [raw[i] for i in where])):
                out[i] = e
        return out

    def tower_identity(self, kind: str) -> tuple:
        """What decides the tower output for `kind` besides the weights: the tower's class,
        config, dtype, device, train/eval mode and the autocast in force (a BF16 run's loss and
        reference forwards encode under autocast, its rollouts without: neither serves the other)."""
        tower = self.tower_of(kind)
        p = next(tower.parameters())
        dev = p.device.type
        autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        return (
            kind,
            type(tower).__name__,
            settings_fingerprint(tower.config.to_dict()),
            str(p.dtype),
            str(p.device),
            tower.training,
            autocast,
        )

    def encode(self, media: list[Medium], dedup: bool = True) -> tuple[MediaEncodings, EncodeStats]:
        """Encodings ready to splice ([tokens, hidden] each) and the work it took.

        dedup: each distinct medium encoded once, returned by Medium.key; requests without a
        gradient through the towers are served from and stored in the LRU. Otherwise the
        naive path: every item of `media` encoded, one encoding per item, in order."""
        if not dedup:
            raw, stats = encode_every_copy(media, self.towers)
            self.encode_totals.add(stats)
            return self.project(media, raw), stats
        identity = {kind: self.tower_identity(kind) for kind in {m.kind for m in media}}
        # A tower with a trainable weight (a merger counts: it is part of the vision tower) needs a
        # graph when grad is on: its media bypass the cache. The cache holds one weights version
        # for all towers, so a frozen tower's entries outlive a step only when no tower trains.
        graph = {
            kind: torch.is_grad_enabled() and any(p.requires_grad for p in self.tower_of(kind).parameters())
            for kind in identity
        }
        version = tuple(weights_version(t) for t in self.tower_modules())
        # towers the recipe freezes (not requires_grad: a reference copy decides alike) keep their entries
        # past the step, so each is encoded alone (a matmul's bits depend on its rows): a resume recomputes them
        lasting = set(ENCODER_PARTS) <= self.frozen_parts()

        def cache_key(m: Medium) -> tuple[tuple, tuple]:
            return (m.hash, m.prep, identity[m.kind]), version

        encoder = (lambda ms: [self.towers([m])[0] for m in ms]) if lasting else self.towers
        raw, stats = encode_distinct([m for m in media if not graph[m.kind]], encoder, self.encoding_cache, cache_key)
        fresh, fresh_stats = encode_distinct([m for m in media if graph[m.kind]], self.towers)
        raw.update(fresh)
        stats.add(fresh_stats)
        by_key = {m.key: m for m in media}
        keys = list(raw)
        projected = self.project([by_key[k] for k in keys], [raw[k] for k in keys])
        self.encode_totals.add(stats)
        return dict(zip(keys, projected)), stats

    def encode_media(self, media: list[Medium]) -> Encodings:
        """Encodings [tokens, hidden] by Medium.key; each distinct medium encoded once."""
        return self.encode(media)[0]

    def embed(self, input_ids: torch.Tensor, row_media: list[list[Medium]], encodings: MediaEncodings) -> torch.Tensor:
        """Token embeddings with media encodings spliced into the placeholder positions (a model
        without DeepStack: a Qwen3-VL prompt with media needs `embed_inputs`)."""
        embeds, deepstack = self.embed_inputs(input_ids, row_media, encodings)
        if deepstack is not None:
            raise ValueError(
                "this policy's vision tower adds DeepStack features to the first decoder layers (Qwen3-VL): "
                "its media prompts go through embed_inputs and forward_embeds(deepstack=...)"
            )
        return embeds

    def embed_inputs(
        self, input_ids: torch.Tensor, row_media: list[list[Medium]], encodings: MediaEncodings
    ) -> tuple[torch.Tensor, Optional[DeepStack]]:
        """Token embeddings with media encodings spliced into the placeholder positions, and
        Qwen3-VL's DeepStack features at those positions (`encode_images` keeps them after each
        token's encoding in the same row; None for other models and for prompts without media)."""
        is_media = self.is_placeholder(input_ids)
        embeds = self.language_model.embed(input_ids)
        if isinstance(encodings, list):
            flat = encodings
        else:
            flat = [encodings[m.key] for row in row_media for m in row]
        if not flat:
            return embeds, None
        flat = torch.cat(flat).to(embeds.dtype)
        if flat.shape[0] != int(is_media.sum()):
            raise ValueError(f"{int(is_media.sum())} media placeholders but {flat.shape[0]} media tokens")
        hidden = embeds.shape[-1]
        embeds = embeds.masked_scatter(is_media[..., None], flat[:, :hidden])
        if flat.shape[1] == hidden:
            return embeds, None
        return embeds, (is_media, list(flat[:, hidden:].split(hidden, dim=-1)))

    def is_placeholder(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where input_ids holds a media placeholder token (bool, same shape)."""
        ids = self.placeholder_ids()
        return torch.isin(input_ids, torch.tensor(ids, dtype=input_ids.dtype, device=input_ids.device))

    # ------------------------------------------------------------------ forward

    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_media: list[list[Medium]]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Positions of whole sequences and the per-row offset [B] that tokens appended later
        add to their count (None without M-RoPE). Plain RoPE: [B, T], counting only real
        tokens, so left padding does not shift it. M-RoPE (the decoder has mrope_section):
        [3, B, T], image tokens at their (t, h, w) grid positions (transformers' get_rope_index)."""
        if self.language_model.cfg.mrope_section is None or self.image_token_id is None:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0), None
        # Qwen2.5-VL spaces a clip's temporal patches by their time (vision_config.tokens_per_second
        # positions a second); Qwen2-VL by one position a patch; Qwen3-VL frames each patch alone
        per_second = getattr(self.visual.config, "tokens_per_second", None)
        grids = []
        for row in row_media:
            runs = []
            for m in row:
                if m.kind in ("image", "video"):
                    for grid, seconds in modality(m.kind).rope_grids(m, self.media_tokens_of[m.kind]):
                        runs.append((grid, seconds * per_second if seconds is not None and per_second else 1.0))
            grids.append(runs)
        placeholders = {self.media_tokens_of[k].placeholder for k in ("image", "video") if self.media_tokens_of[k]}
        # a walk over each row's tokens: on the host, then the positions to the model's device
        positions, deltas = rope_index(
            to_host(input_ids), to_host(attention_mask), grids, placeholders, self.cfg.vision.spatial_merge_size
        )
        return to_device(positions, input_ids.device), to_device(deltas, input_ids.device)

    def forward_embeds(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache | None = None,
        positions: Optional[torch.Tensor] = None,
        rope_deltas: Optional[torch.Tensor] = None,
        *,
        tree: Optional[tuple] = None,
        deepstack: Optional[DeepStack] = None,
    ):
        """Logits for embeddings. attention_mask covers past + new tokens. positions: from
        `position_ids` (whole sequences); otherwise each new token's index among its row's
        real tokens, plus rope_deltas [B] (`position_ids`' offset, for M-RoPE decoding).
        tree: (depth [B, T], block_mask [B, T, T]) for a draft tree appended after the cache: new
        token i sits at the past's real tokens + depth[i] and sees the new tokens block_mask[i].
        deepstack: Qwen3-VL's DeepStack inputs of these embeddings (`embed_inputs`)."""
        t = embeds.shape[1]
        block_mask = None
        if tree is not None:
            depth, block_mask = tree
            positions = attention_mask[:, :-t].long().sum(-1, keepdim=True) + depth
        elif positions is None:
            positions = (attention_mask.long().cumsum(-1)[:, -t:] - 1).clamp(min=0)
        if positions.dim() == 2 and rope_deltas is not None:
            positions = positions + rope_deltas[:, None]
        if deepstack is not None:
            return self.language_model(embeds, positions, attention_mask.bool(), cache, block_mask, deepstack)
        if block_mask is None:  # (a Megatron-built language model takes no block mask: no trees there)
            return self.language_model(embeds, positions, attention_mask.bool(), cache)
        return self.language_model(embeds, positions, attention_mask.bool(), cache, block_mask)

    def sequence_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        row_media: list[list[Medium]],
        temperature: float = 1.0,
        encodings: MediaEncodings | None = None,
        *,
        return_hidden: bool = False,
        top_p: float = 1.0,
    ):
        """Per-token log-probs of input_ids[:, 1:] under logits / temperature, and the
        entropy of that distribution; both [B, T-1]. Without `encodings` the media of
        these rows are encoded here (deduplicated unless model.encoders.dedup is off).
        return_hidden: also return the final (normed) hidden states [B, T, H], the input
        of the LM head, for a value head. top_p < 1: also return, last, the log of the
        probability mass of each position's top-p nucleus (`nucleus_log_mass`, no gradient):
        log-prob minus it is the log-prob under the distribution a top-p rollout samples from."""
        if encodings is None:
            encodings, _ = self.encode([m for row in row_media for m in row], self.cfg.encoders.dedup)
        hidden: list[torch.Tensor] = []
        hook = (
            self.language_model.lm_head.register_forward_pre_hook(lambda m, args: hidden.append(args[0]))
            if return_hidden
            else None
        )
        try:
            positions, _ = self.position_ids(input_ids, attention_mask, row_media)
            embeds, deepstack = self.embed_inputs(input_ids, row_media, encodings)
            logits, _ = self.forward_embeds(embeds, attention_mask, positions=positions, deepstack=deepstack)
        finally:
            if hook is not None:
                hook.remove()
        logp_all = self.token_logprobs(logits[:, :-1], temperature)
        targets = input_ids[:, 1:]
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        # Positions that predict a banned token (padding, media placeholders) are never
        # trained on; give them 0 instead of -inf so masked sums stay finite.
        logp = logp.masked_fill(torch.isin(targets, self.banned_token_ids), 0.0)
        entropy = -(logp_all.exp() * logp_all.clamp(min=-1e30)).sum(-1)
        out = (logp, entropy, hidden[-1]) if return_hidden else (logp, entropy)
        if top_p < 1.0:
            with torch.no_grad():
                out = (*out, nucleus_log_mass(logp_all.detach(), top_p))
        return out

    def token_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """log softmax(logits / temperature) in fp32 (fp64 stays fp64) with the banned tokens removed."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        logits = logits.index_fill(-1, self.banned_token_ids, float("-inf"))
        return F.log_softmax(logits, dim=-1)


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of each distribution (last dim), as the rollout engines sample from it:
    the probabilities sorted in descending order, each kept while the mass before it is below
    top_p (the first always; vLLM's rule too), the others zeroed. Returns (kept sorted probs, order)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return sorted_p * keep, order


def nucleus_log_mass(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """log of each distribution's top-p nucleus mass: a top-p sample's log-prob is logp - this."""
    kept, _ = nucleus(logp.exp(), top_p)
    return kept.sum(-1).log()


def language_model_config(
    cfg: ModelConfig, vocab_size: int, checkpoint: Optional[DecoderConfig] = None
) -> DecoderConfig:
    """The language model's settings from the model section, the rounding profile's `auto` regions
    resolved to the built-in's (a recipe resolves `auto` by its rollout engine before this).
    checkpoint: the model.init_from checkpoint's, whose layer structure (Qwen3's head width, biases,
    q/k norms, M-RoPE) the decoder is built with; the recipe's sizes match it (`fill_from_checkpoint`)."""
    structure: dict = {"head_size": cfg.head_dim}
    if checkpoint is not None:
        names = ("head_size", "qkv_bias", "o_bias", "qk_norm", "mrope_section", "mrope_interleaved")
        structure = {name: getattr(checkpoint, name) for name in names}
    return DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **structure,
        rounding=Regions(
            **{
                region: DEFAULT_ROUNDING if getattr(cfg.rounding, region) == "auto" else getattr(cfg.rounding, region)
                for region in ROUNDING_REGIONS
            }
        ),
    )


def build_policy(cfg: ModelConfig, tokenizer, seed: int) -> VLM:
    """The policy: randomly initialised from `seed`, then loaded from `cfg.init_from` if set;
    then, with `cfg.lora.rank` > 0, LoRA adapters on the language model (`lora.apply_lora`: its
    base weights frozen; the adapters are drawn after the base weights, which are thus the same
    as without LoRA)."""
    torch.manual_seed(seed)
    if cfg.init_from is None:
        model = VLM(cfg, tokenizer)
    else:
        model = VLM(cfg, tokenizer, read_config(cfg.init_from))
        load_policy(model, cfg.init_from)
    apply_lora(model.language_model, cfg.lora)
    return model
