"""Megatron-core training engine: the language backbone as a tensor-parallel GPTModel.

Layout of the ranks: `training.nproc` ranks = tensor_parallel x data-parallel replicas
(parallel_state.initialize_model_parallel). A replica's TP ranks train the same
micro-batches; the replicas split each mini-batch's micro-batches between them.

What trains where:
- the language model is a megatron-core GPTModel built from a layer spec whose
  RMSNorm, SwiGLU, RoPE and attention call loomrl's rounding regions (backbone/rounding.py,
  modes read from the decoder config at every forward, as the built-in decoder does);
  its weights come from the HF layout (megatron_convert) and go back to it on export;
- the vision and audio towers and the audio projector stay plain torch modules,
  replicated on every rank; their gradients (like every other gradient) are summed
  over the data-parallel replicas in one collective before clipping. TP ranks of a
  replica compute identical tower gradients (the backbone's input gradient is
  all-reduced inside Megatron's column-parallel layers).
- the optimizer is torch AdamW over the local shards (Megatron's distributed
  optimizer assumes CUDA); gradient clipping uses the global norm over all shards.
- frozen parts (training.freeze) carry over: the towers' with the copy, the language
  model's (`language_model`: layers + final norm; `embeddings`: word embedding + untied
  output layer) re-applied to the GPTModel; frozen weights are not optimised.
- training.activation_checkpointing: megatron-core's full recompute of every layer
  (`recompute_granularity="full"`, uniform, one layer per chunk; the rope table is kept
  until the next forward for the recomputation), plus the towers' own checkpointing.

Residual adds stay in Megatron's bias-dropout-add (working dtype); the RMSNorm region
here is the norm itself. In FP32 this computes the same numbers as the built-in
decoder. `training.precision: bf16_params` is Megatron's `--bf16`: every weight BF16, FP32 masters
stepped by AdamW, each micro-batch's gradient added to FP32 main grads (torch_engine.MasterWeights),
which are reduced over the replicas and clipped in FP32.

Rollouts do not run on this module: the trainer keeps an HF-layout copy of the policy
(what vLLM would serve) and loads `export_weights()` into it after every step.
"""

from __future__ import annotations

import copy
import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loomrl.config import RecipeError
from loomrl.platform.backbone import rounding
from loomrl.platform.backbone.decoder import DecoderConfig, rope_cos_sin
from loomrl.platform.backbone.hf_io import refuse_qwen3
from loomrl.platform.engines import megatron_cpu_shims
from loomrl.platform.engines.base import (
    TRAINING_ENGINES,
    LossFn,
    allreduce_grads,
    allreduce_stats,
    gather_rank_states,
    rank_share,
    rank_state,
)
from loomrl.platform.engines.launch import init_distributed
from loomrl.platform.engines.megatron_convert import Dims, hf_to_megatron, megatron_to_hf, padded_vocab
from loomrl.platform.engines.torch_engine import MasterWeights
from loomrl.platform.faults import maybe_die
from loomrl.platform.memory import MemoryTerm, ModelSizes, Precision, TrainingMemory, ceil_div

# --------------------------------------------------------------------------- process groups


def init_parallel(tensor_parallel: int) -> None:
    """Megatron's process groups over the default group (which launch.init_distributed made)."""
    from megatron.core import parallel_state as ps

    megatron_cpu_shims.apply()
    if not dist.is_initialized():
        raise RuntimeError("the Megatron engine needs torch.distributed (loomrl.platform.engines.launch)")
    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"training.megatron.tensor_parallel={tensor_parallel} must divide training.nproc={world}")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tensor_parallel:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


# --------------------------------------------------------------------------- layer spec


class RopeTable:
    """cos/sin of the current forward, shared by every layer's attention (set by MegatronLM
    from the position ids, so left padding and M-RoPE work as in the built-in decoder)."""

    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None


class LoomRMSNorm(nn.Module):
    """Megatron norm slot -> loomrl's RMSNorm region."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, decoder: DecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.decoder = decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rounding.rms_norm(x, self.weight, self.eps, self.decoder.rounding.rmsnorm)[0]


def _swiglu_mlp_class():
    from megatron.core.transformer.mlp import MLP

    class LoomSwiGLUMLP(MLP):
        """Megatron's MLP (fc1 = [gate; up] per TP rank, fc2 row-parallel) with loomrl's SwiGLU region."""

        def __init__(self, config, submodules, *, decoder: DecoderConfig, **kwargs):
            super().__init__(config, submodules, **kwargs)
            self.decoder = decoder

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            fc1, _ = self.linear_fc1(hidden_states)
            gate, up = torch.chunk(fc1, 2, dim=-1)
            return self.linear_fc2(rounding.swiglu(gate, up, self.decoder.rounding.swiglu))

    return LoomSwiGLUMLP


class LoomCoreAttention(nn.Module):
    """Megatron core-attention slot: loomrl's RoPE region on q and k, then its attention region
    with the causal padding mask (GQA by repeating kv heads). Shapes are Megatron's: q [s, b, heads/tp, d],
    k/v [s, b, kv_heads/tp, d] -> [s, b, heads/tp * d].

    Megatron builds it with keyword arguments only (`Attention.__init__`, megatron/core/transformer/
    attention.py: `submodules.core_attention(config=..., layer_number=..., ...)`) and calls it with
    q, k, v and the mask positional, the rest by keyword (`Attention.forward`: `apply_module(
    self.core_attention)(query, key, value, attention_mask, attn_mask_type=..., ...)`), as its
    `CoreAttentionBuilder` / `CoreAttention` protocols declare: the optional arguments are keyword-only."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        *,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        rope: RopeTable,
        decoder: DecoderConfig,
    ):
        super().__init__()
        self.rope, self.decoder = rope, decoder

    def forward(
        self, query, key, value, attention_mask, *, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        mode, mrope = self.decoder.rounding.rope, self.decoder.mrope_section is not None
        cos, sin = self.rope.cos[:, None], self.rope.sin[:, None]  # [B, 1, T, D]: broadcast over heads
        q = rounding.apply_rope(query.permute(1, 2, 0, 3), cos, sin, mode, mrope)
        k = rounding.apply_rope(key.permute(1, 2, 0, 3), cos, sin, mode, mrope)
        v = value.permute(1, 2, 0, 3)
        rep = q.shape[1] // k.shape[1]
        out = rounding.attention(
            q,
            k.repeat_interleave(rep, dim=1),
            v.repeat_interleave(rep, dim=1),
            attention_mask,
            self.decoder.rounding.attention,
        )
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def layer_spec(decoder: DecoderConfig, rope: RopeTable):
    """A TransformerLayer spec: Megatron's parallel linears, loomrl's rounding regions."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = ModuleSpec(module=LoomRMSNorm, params={"decoder": decoder})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=functools.partial(LoomCoreAttention, rope=rope, decoder=decoder),
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=_swiglu_mlp_class(),
                params={"decoder": decoder},
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


class MegatronLM(nn.Module):
    """Stands in for backbone.decoder.Decoder inside the policy (same `embed` / forward seam),
    with a megatron-core GPTModel inside. Training forwards only (no KV cache)."""

    def __init__(self, cfg: DecoderConfig, tensor_parallel: int, recompute: bool = False):
        """recompute: megatron-core's full activation recompute of every layer in the backward
        (training.activation_checkpointing)."""
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        if cfg.intermediate_size % tensor_parallel:
            raise ValueError(
                f"training.megatron.tensor_parallel={tensor_parallel} must divide "
                f"model.intermediate_size={cfg.intermediate_size}"
            )
        self.cfg = cfg
        self.rope = RopeTable()
        config = TransformerConfig(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_heads,
            num_query_groups=cfg.num_kv_heads,
            kv_channels=cfg.head_dim,
            ffn_hidden_size=cfg.intermediate_size,
            layernorm_epsilon=cfg.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            tensor_model_parallel_size=tensor_parallel,
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=torch.float32,
            **(
                {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                if recompute
                else {}
            ),
        )
        self.gpt = GPTModel(
            config,
            layer_spec(cfg, self.rope),
            vocab_size=padded_vocab(cfg.vocab_size, tensor_parallel),
            max_sequence_length=cfg.max_position_embeddings,
            parallel_output=False,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="none",
        )
        # loomrl's RMSNorm region for the final norm too (the block builds Megatron's own).
        self.gpt.decoder.final_layernorm = LoomRMSNorm(config, cfg.hidden_size, cfg.rms_norm_eps, decoder=cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt.embedding.word_embeddings(input_ids)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The vocabulary-sized weights (the `embeddings` part): the word embedding and, when
        untied, the output layer."""
        head = getattr(self.gpt, "output_layer", None)
        head = None if head is None else head.weight
        word = self.gpt.embedding.word_embeddings.weight
        return [word] + ([] if head is None or head is word else [head])

    def forward(self, inputs_embeds, position_ids, key_mask, cache=None):
        if cache is not None:
            raise ValueError("the Megatron engine only trains; rollouts run on the HF-layout copy")
        b, t, _ = inputs_embeds.shape
        device = inputs_embeds.device
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        mask = causal[None, None] & key_mask[:, None, None, :]
        mask = (
            mask | torch.eye(t, dtype=torch.bool, device=device)[None, None]
        )  # as the built-in decoder: no empty rows
        self.rope.cos, self.rope.sin = rope_cos_sin(
            position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section
        )
        hidden = inputs_embeds.transpose(0, 1).contiguous()
        recompute = self.gpt.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()
        if recompute and not hidden.requires_grad:
            # Megatron's recompute is reentrant: without an input that requires grad (frozen
            # embeddings, no trained tower's media) the layers would get no gradient at all.
            hidden.requires_grad_(True)
        logits = self.gpt(input_ids=None, position_ids=None, attention_mask=mask, decoder_input=hidden)
        if not recompute:  # a recomputed layer reads the table again in the backward: kept until the next forward
            self.rope.cos = self.rope.sin = None
        return logits[..., : self.cfg.vocab_size], []

    def local_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.gpt.state_dict().items() if not k.endswith("_extra_state")}


# --------------------------------------------------------------------------- engine


def check_recipe(r) -> None:
    """Megatron's own rules: FP32 training, and a tensor-parallel size that divides the processes,
    the KV heads and the MLP width."""
    refuse_qwen3(r, "training.engine=megatron (use training.engine=torch, deepspeed or fsdp2)")
    t = r.training
    if t.precision == "bf16":
        raise RecipeError(
            "training.precision: training.engine=megatron has no autocast; its BF16 is Megatron's own "
            "(BF16 weights, FP32 main grads and masters): training.precision=bf16_params"
        )
    tp = t.megatron.tensor_parallel
    if r.model.num_kv_heads % tp or r.model.intermediate_size % tp:
        raise RecipeError(
            f"training.megatron.tensor_parallel: {tp} must divide model.num_kv_heads="
            f"{r.model.num_kv_heads} and model.intermediate_size={r.model.intermediate_size}"
        )


def tensor_parallel_size(training) -> int:
    """The ranks one copy of the language model is split over: `training.megatron.tensor_parallel`."""
    return training.megatron.tensor_parallel


def training_memory(sizes: ModelSizes, prec: Precision, training, *, dp: int, tp: int) -> TrainingMemory:
    """Its bytes per rank (`loomrl plan`): the language model's linear weights and biases and its
    vocab-parallel embedding and head (the vocabulary padded to a multiple of tp) divided by tp,
    the rest (norms, towers, projector) replicated; gradients and optimizer as the weights."""
    w, opt_per, P, T = prec.weight, prec.optimizer, sizes.params, sizes.trainable
    pad = (padded_vocab(sizes.vocab_size, tp) - sizes.vocab_size) * sizes.hidden_size * (1 if sizes.tied else 2)
    sharded, rest = sizes.tp_split + pad, P - sizes.tp_split
    t_sharded, t_rest = sizes.tp_split_trainable, T - sizes.tp_split_trainable
    return TrainingMemory(
        weights=MemoryTerm(
            (rest + ceil_div(sharded, tp)) * w,
            f"({rest:,} replicated + {sharded:,} language-model linear/embedding / {tp} (TP)) x {w} B",
        ),
        gradients=MemoryTerm(
            (t_rest + ceil_div(t_sharded, tp)) * w, f"({t_rest:,} + {t_sharded:,} / {tp}) trainable x {w} B"
        ),
        optimizer=MemoryTerm(
            (t_rest + ceil_div(t_sharded, tp)) * opt_per,
            f"({t_rest:,} + {t_sharded:,} / {tp}) trainable x {opt_per} B ({prec.optimizer_what})",
        ),
        cpu_bytes=0,
        desc=f"megatron TP {tp}",
        policy_copy=True,
    )


@TRAINING_ENGINES.register(
    "megatron",
    distributed=True,
    value_model=False,
    lora=False,
    check=check_recipe,
    master_weights=True,
    tensor_parallel=tensor_parallel_size,
    padded_vocab=padded_vocab,
    memory=training_memory,
)
class MegatronTrainEngine:
    supports_hook = True  # plain autograd: the encoding-cache hook's single encoder backward works

    @classmethod
    def from_recipe(cls, recipe, policy: nn.Module, params=None) -> "MegatronTrainEngine":
        """Trains its own megatron-core copy of `policy`'s language model (and the towers as they are)."""

        init_distributed()
        return cls(policy, recipe.training)

    def __init__(self, policy: nn.Module, cfg, lr: float | None = None):
        """policy: the HF-layout VLM (its weights are copied; it is not trained here).
        cfg: the recipe's TrainingConfig (uses lr, weight_decay, grad_clip, megatron)."""
        from megatron.core import parallel_state as ps

        tp = cfg.megatron.tensor_parallel
        init_parallel(tp)
        self.cfg = cfg
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), tp
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        hf_lm = policy.language_model
        self.dims = Dims.of(hf_lm.cfg)
        policy.language_model = None  # copy the towers, not the HF decoder
        try:
            model = copy.deepcopy(policy)
        finally:
            policy.language_model = hf_lm
        lm = MegatronLM(hf_lm.cfg, tp, recompute=cfg.activation_checkpointing)
        shard = hf_to_megatron({k: v.detach() for k, v in hf_lm.state_dict().items()}, self.dims, self.tp_rank, tp)
        missing, unexpected = lm.gpt.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"HF -> Megatron conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.language_model = lm
        model.apply_frozen()  # the policy's frozen parts (copied with it) on the Megatron language model too
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        split = tp_split_params(lm)
        # bf16_params (Megatron's --bf16): BF16 weights in every forward, FP32 masters with FP32 main grads
        self.masters = MasterWeights(model, self.params) if cfg.precision == "bf16_params" else None
        self.stepped = self.masters.fp32 if self.masters is not None else self.params
        self._split = {id(s) for p, s in zip(self.params, self.stepped) if id(p) in split}
        self.optimizer = torch.optim.AdamW(self.stepped, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train_mini_batch(self, micro_batches: list, loss_fn: LossFn, hook=None) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # equal shares: every rank then reports the same stats keys
        mine = rank_share(micro_batches, self.dp_rank, self.dp_size, equal=True)
        if hook is not None:
            hook.begin([mb for mb, _ in mine])
        totals: dict[str, float] = {"loss": 0.0}
        masters = self.masters
        if masters is not None:
            masters.zero_grad()
        for mb, counts in mine:
            loss, stats = loss_fn(self.model, mb)
            if not counts:
                loss, stats = loss * 0.0, {k: 0.0 for k in stats}
            loss.float().backward()
            if masters is not None:
                masters.accumulate()  # each micro-batch's BF16 gradient into the FP32 main grads
            totals["loss"] += float(loss.detach())
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        if hook is not None:
            hook.finish()
            if masters is not None:
                masters.accumulate()
        allreduce_grads(self.stepped, self.dp_group)
        norm = self._clip()

        maybe_die("optimizer")
        self.optimizer.step()
        if masters is not None:
            masters.publish()
        self.model.zero_grad(set_to_none=True)
        totals = allreduce_stats(totals, self.dp_group) if self.tp_rank == 0 else totals
        if self.tp_size > 1:  # every TP rank reports what its replica's rank 0 summed
            totals = _broadcast_stats(totals, self.tp_group)
        totals["grad_norm"] = norm
        return totals

    def _clip(self) -> float:
        """Global gradient norm over all shards (TP-split parameters summed over the TP group,
        replicated ones counted once), then clip like torch.nn.utils.clip_grad_norm_."""
        split = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        grads = [p for p in self.stepped if p.grad is not None]
        for p in grads:
            sq = p.grad.double().pow(2).sum()
            if id(p) in self._split:
                split += sq
            else:
                replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(split, group=self.tp_group)
        norm = float((split + replicated).sqrt())
        if self.cfg.grad_clip > 0:
            coef = min(1.0, self.cfg.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                for p in grads:
                    p.grad.mul_(coef)
        return norm

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-layout tensors under the policy's names (collective over the TP group)."""
        lm: MegatronLM = self.model.language_model
        local = lm.local_state()
        if self.tp_size == 1:
            shards = [local]
        else:
            shards = [dict() for _ in range(self.tp_size)]
            for k in sorted(local):
                parts = [torch.empty_like(local[k]) for _ in range(self.tp_size)]
                dist.all_gather(parts, local[k].contiguous(), group=self.tp_group)
                for s, part in zip(shards, parts):
                    s[k] = part
        for k, v in megatron_to_hf(shards, self.dims).items():
            yield f"language_model.{k}", v
        for k, v in self.model.state_dict().items():
            if not k.startswith("language_model."):
                yield k, v

    def state_dict(self) -> Optional[dict]:
        """Every rank's AdamW state (and bf16_params' FP32 masters), gathered on rank 0 (None on the
        others); collective."""
        local: dict = {"optimizer": self.optimizer.state_dict()}
        if self.masters is not None:
            local["masters"] = [m.detach().clone() for m in self.masters.fp32]
        return gather_rank_states(local)

    def load_state_dict(self, state: dict) -> None:
        local = rank_state(state, "megatron engine state")
        self.optimizer.load_state_dict(local["optimizer"])
        if self.masters is not None:
            self.masters.load(local.get("masters"))


def tp_split_params(lm: MegatronLM) -> set[int]:
    """ids of the parameters split across TP ranks (the parallel linears' weights, the
    column-parallel biases, the vocab-parallel embedding); the rest are replicated. Read from
    the module types: Megatron sets its `tensor_model_parallel` attribute only when it
    initialises the weights itself, and here they are loaded."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    split = set()
    for m in lm.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            split.add(id(m.weight))
        if isinstance(m, ColumnParallelLinear) and m.bias is not None:
            split.add(id(m.bias))
    return split


def _broadcast_stats(stats: dict[str, float], group) -> dict[str, float]:
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return dict(zip(keys, t.tolist()))
