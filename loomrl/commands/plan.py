"""`loomrl plan`: what a recipe needs per GPU, before a GPU is rented.

What it does: finds the model's config, counts its parameters without allocating them,
and estimates the bytes each training rank holds, by kind, for the recipe's engine and
ranks; then says whether that fits in a GPU of `--gpu-memory` GiB and with what headroom.

The model's config, first found of:
1. `<model.init_from>/config.json` (the checkpoint is on this machine);
2. `recipes/models/<basename of model.init_from>/config.json` in the loomrl folder (the one
   holding `recipes/`: above the recipe file, else above this package), a config shipped
   without weights for recipes whose checkpoint lives on a cluster;
3. no `model.init_from`: the recipe's own sizes (the demo), as loomrl's policy.
A recipe with `model.init_from` but neither config is an error naming both paths. A
checkpoint's config also goes through the recipe's own checks (`recipe.fill_from_checkpoint`),
so a recipe whose sizes disagree with it is refused here as `loomrl run` would refuse it.

Counting: the model is built under `torch.device("meta")` (shapes, no storage, no weights
read): transformers' class for a checkpoint config (Qwen2 / Qwen2-VL / Qwen2.5-VL /
Qwen2-Audio), `backbone.vlm.build_policy` for the recipe's own sizes. Tied weights count
once. Parameter names are mapped to loomrl's policy layout (`visual.`, `audio_tower.`,
`audio_projector.`, `language_model.`), so both kinds of model are classified alike.

Trainable: every parameter, except the vision and audio towers (the vision merger
included) when `model.encoders.frozen` (the audio projector still trains, as in `vlm.VLM`),
and the parts `training.freeze` names (when a recipe has that key): `vision` (the vision
tower less its merger), `merger`, `audio`, `audio_projector`, `language_model` (decoder
layers and final norm), `embeddings` (input embedding and LM head); an entry that is no part
name is a pattern over the policy's parameter names, matching everything under it too.
With `model.lora` (`rank` > 0) the language model's own weights freeze and its adapters train:
rank * (in + out) per targeted linear layer (`lora.targets`: short names such as `q_proj`;
default every linear layer but the head); the embeddings and towers train unless frozen, as in
the trainer (`backbone/lora.py`).

Bytes per rank (P: parameters, T: trainable ones, w: 2 bytes in bf16, else 4 for fp32; the torch
engine's `training.precision: bf16` is autocast: its weights, gradients and optimizer stay fp32, only
the activations take 2 bytes;
world = training.nproc, tp = training.megatron.tensor_parallel for Megatron else 1,
dp = world / tp):
- weights: P * w. DeepSpeed ZeRO-3 divides by dp. Megatron divides the language model's
  linear weights and biases and its (vocab-parallel, padded to a multiple of tp) embedding
  and head by tp; norms, towers and projector are replicated.
- gradients: T * w. ZeRO-2/3 divide by dp; Megatron shards T as it shards P.
- optimizer (AdamW): T * (8 + 4 in bf16): two fp32 moments, plus an fp32 master copy when
  the weights are bf16. ZeRO-1/2/3 divide by dp; `training.deepspeed.offload_optimizer`
  moves it to host memory (reported as cpu bytes, not GPU).
- activations, one micro-batch of b = training.micro_batch_size sequences of s tokens
  (s = rollout.vllm.max_model_len with vLLM rollouts, else rollout.max_new_tokens + 512
  prompt tokens; `--seq-len` overrides), hidden size h, a heads, L decoder layers, vocab v,
  after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", tensor parallel without sequence parallelism, as loomrl's Megatron engine runs):
      per layer  s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) bytes in 16-bit
                 (34 + 5 a s / h at tp = 1), times w / 2 for fp32;
      layers     L * per layer; with activation checkpointing (`training.
                 activation_checkpointing`, when a recipe has it) L * w * s * b * h (each
                 layer's input) + one layer's full activations;
      logits     (w + 4) * s * b * v: the logits and their fp32 log-softmax, which backward
                 keeps (Megatron gathers the full vocabulary: not divided by tp).
  The 5 a s / h term is the attention score matrix; a fused attention kernel (SDPA's
  memory-efficient or flash kernels on a GPU) stores none of it, so the output names it
  separately and `--fused-attention` plans without it. The towers' activations are not
  counted.
- rollout, colocated: vLLM holds its own copy of the language model (rollout.vllm.dtype)
  plus its KV cache (rollout.vllm.kv_cache_gib); the built-in engine holds a KV cache for
  one step's share of rollouts (2 * L * kv_heads * head_dim * s * rows * 4 bytes, rows =
  ceil(prompts_per_step / world) * rollout.n). Disaggregated rollouts hold nothing on the
  trainer ranks.
- policy_copy: DeepSpeed and Megatron train their own copy; the trainer keeps the full
  policy in float32 (P * 4) for the rollouts (its towers encode the media) and loads the
  engine's weights into it after each step. None with the torch engine.
- reference: the frozen reference policy of a KL penalty (algorithm.kl_coef > 0), P * 4.
total = the sum. These are estimates of the tensors loomrl keeps; allocator fragmentation,
CUDA context (~0.5-1 GiB), communication buffers and temporary copies come on top, so a
plan with little headroom may still not fit.

Exit codes of the command: 0 fits, 3 does not fit in --gpu-memory (the plan is still
printed, `fits: false` in --json), 2 a bad recipe, a missing model config or bad options.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS

log = logging.getLogger("loomrl")

GIB = 1 << 30
PROMPT_ALLOWANCE = 512  # prompt tokens assumed without vLLM's max_model_len
TRANSFORMERS_CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
}
# transformers 5.19's module names -> loomrl's policy layout; the longest prefix wins
_HF_PREFIXES = {
    "model.visual.": "visual.",
    "model.audio_tower.": "audio_tower.",
    "model.multi_modal_projector.linear.": "audio_projector.",
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.": "language_model.model.",
}
TOWERS = ("visual.", "audio_tower.")
PROJECTORS = ("audio_projector.",)
VLLM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """A plan cannot be made (no model config, an unreadable one); the message names the file."""


@dataclass
class Counts:
    """Parameters of the policy, by part, from one model config."""

    source: str
    """Where the sizes came from (a config.json, or the recipe's model section)."""
    model_type: str
    total: int
    language_model: int
    lm_tp: int
    """Of the language model: what Megatron's tensor parallelism shards (linear layers, embedding, head)."""
    towers: int
    projector: int
    trainable: int
    trainable_tp: int
    lora: int
    """Adapter parameters added by model.lora (0 without)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied: bool


@dataclass
class Plan:
    """Per-rank bytes of a recipe; `to_json` is what `--json` prints."""

    recipe: str
    engine: str
    engine_desc: str
    ranks: dict
    counts: Counts
    dtype: str
    seq_len: int
    seq_len_from: str
    micro_batch_size: int
    activation_checkpointing: bool
    fused_attention: bool
    per_rank_bytes: dict
    how: dict
    activations_bytes: dict
    cpu_bytes: int
    gpu_memory_bytes: int
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.per_rank_bytes["total"] <= self.gpu_memory_bytes

    def to_json(self) -> dict:
        c = self.counts
        return {
            "recipe": self.recipe,
            "model_config": c.source,
            "model_type": c.model_type,
            "params_total": c.total,
            "params_trainable": c.trainable,
            "params_language_model": c.language_model,
            "params_towers": c.towers,
            "params_projector": c.projector,
            "params_lora": c.lora,
            "engine": self.engine,
            "dtype": self.dtype,
            "ranks": self.ranks,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "fused_attention": self.fused_attention,
            "per_rank_bytes": self.per_rank_bytes,
            "activations_bytes": self.activations_bytes,
            "cpu_bytes": self.cpu_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "fits": self.fits,
            "headroom_bytes": self.gpu_memory_bytes - self.per_rank_bytes["total"],
        }

    def table(self) -> str:
        c = self.counts
        gib = lambda n: f"{n / GIB:10.2f}"  # noqa: E731
        lines = [
            f"plan: {self.recipe}",
            f"model: {c.source} ({c.model_type}): {c.total:,} parameters (language model {c.language_model:,}, "
            f"towers {c.towers:,}"
            + (f", projector {c.projector:,}" if c.projector else "")
            + f"), {c.trainable:,} trainable"
            + (f" (LoRA adapters {c.lora:,})" if c.lora else ""),
            f"engine: {self.engine_desc}; {self.ranks['world']} rank(s) = dp {self.ranks['dp']} x tp "
            f"{self.ranks['tp']}; weights {self.dtype}",
            f"micro-batch: {self.micro_batch_size} sequence(s) x {self.seq_len} tokens ({self.seq_len_from}), "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}, attention scores "
            f"{'not stored (fused kernel)' if self.fused_attention else 'stored'}",
            "",
            f"{'kind':<12} {'GiB/rank':>10}  how",
        ]
        for kind, n in self.per_rank_bytes.items():
            if kind != "total":
                lines.append(f"{kind:<12} {gib(n)}  {self.how[kind]}")
        lines.append(f"{'total':<12} {gib(self.per_rank_bytes['total'])}")
        a = self.activations_bytes
        lines.append(
            f"  activations: decoder layers {a['layers'] / GIB:.2f} GiB (of which attention scores "
            f"{a['attention_scores'] / GIB:.2f} GiB), logits {a['logits'] / GIB:.2f} GiB"
        )
        if self.cpu_bytes:
            lines.append(f"  host memory per rank: {self.cpu_bytes / GIB:.2f} GiB (offloaded optimizer)")
        total, gpu = self.per_rank_bytes["total"], self.gpu_memory_bytes
        if self.fits:
            lines.append(
                f"fits in {gpu / GIB:g} GiB per GPU: headroom {(gpu - total) / GIB:.2f} GiB ({(gpu - total) / gpu:.0%})"
            )
        else:
            biggest = max((k for k in self.per_rank_bytes if k != "total"), key=self.per_rank_bytes.get)
            lines.append(
                f"does NOT fit in {gpu / GIB:g} GiB per GPU: over by {(total - gpu) / GIB:.2f} GiB (largest: {biggest})"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- model config


def loomrl_root(recipe_path: Optional[str | Path]) -> list[Path]:
    """Folders that may hold loomrl's `recipes/`: above the recipe file, then above this package."""
    out: list[Path] = []
    if recipe_path is not None:
        here = Path(recipe_path).resolve().parent
        out += [d for d in (here, *here.parents) if (d / "recipes").is_dir()][:1]
    package_root = Path(__file__).resolve().parents[2]
    if (package_root / "recipes").is_dir() and package_root not in out:
        out.append(package_root)
    return out


def _shown(path: Path) -> str:
    """A path relative to the working directory when under it (shorter in tables), else as is."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def find_model_config(recipe: R.Recipe, recipe_path: Optional[str | Path]) -> Optional[Path]:
    """The config.json describing the recipe's model (None: the recipe's own sizes). PlanError
    when model.init_from is set and no config is found, naming the paths tried."""
    init_from = recipe.model.init_from
    if init_from is None:
        return None
    direct = Path(init_from) / "config.json"
    if direct.is_file():
        return direct
    name = Path(init_from.rstrip("/")).name
    tried = [direct] + [root / "recipes" / "models" / name / "config.json" for root in loomrl_root(recipe_path)]
    for path in tried[1:]:
        if path.is_file():
            return path
    raise PlanError(
        f"model.init_from: {init_from!r} has no config.json on this machine, and loomrl ships none "
        f"for {name!r} (tried {', '.join(str(p) for p in tried)}); copy the checkpoint's config.json "
        f"to recipes/models/{name}/"
    )


def canonical_hf_name(name: str) -> str:
    """A transformers 5.19 parameter name in loomrl's policy layout (`model.visual.x` -> `visual.x`)."""
    prefix = max((p for p in _HF_PREFIXES if name.startswith(p)), key=len, default=None)
    return name if prefix is None else _HF_PREFIXES[prefix] + name[len(prefix) :]


@functools.lru_cache(maxsize=8)
def _meta_checkpoint_model(path: str, digest: str) -> tuple[str, nn.Module]:
    """(model_type, transformers model on the meta device) of a config.json (cached by content)."""
    import transformers

    from loomrl.platform.backbone.hf_io import decoder_config

    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise PlanError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{path}: not a JSON object")
    try:
        decoder_config(cfg, path)  # a model type and language model loomrl can train
    except (ValueError, TypeError, AttributeError) as e:
        raise PlanError(str(e) if path in str(e) else f"{path}: {e}") from None
    cls = getattr(transformers, TRANSFORMERS_CLASSES[cfg["model_type"]])
    try:
        config = cls.config_class.from_pretrained(Path(path).parent, local_files_only=True)
        with torch.device("meta"):
            model = cls(config)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise PlanError(f"{path}: transformers cannot build {cls.__name__} from it: {e}") from None
    return cfg["model_type"], model


def part_of(name: str) -> str:
    """The part (training.freeze's names) of a parameter named in loomrl's policy layout."""
    for prefix, part in (
        ("visual.merger.", "merger"),
        ("visual.", "vision"),
        ("audio_tower.", "audio"),
        ("audio_projector.", "audio_projector"),
        ("language_model.model.embed_tokens.", "embeddings"),
        ("language_model.lm_head.", "embeddings"),
    ):
        if name.startswith(prefix):
            return part
    return "language_model"


PARTS = ("vision", "merger", "audio", "audio_projector", "language_model", "embeddings")


def _freeze_patterns(recipe: R.Recipe) -> list[str]:
    """training.freeze's entries: part names or parameter-name patterns ([] without the key)."""
    freeze = getattr(recipe.training, "freeze", None)
    if freeze is None or freeze is False:
        return []
    if isinstance(freeze, str):
        return [freeze]
    if isinstance(freeze, (list, tuple)) and all(isinstance(p, str) for p in freeze):
        return list(freeze)
    log.warning(
        "plan: training.freeze %r is not a list of parts or parameter-name patterns; counted as nothing frozen", freeze
    )
    return []


def _matches(name: str, pattern: str) -> bool:
    if pattern in PARTS:
        return part_of(name) == pattern
    pattern = pattern.rstrip(".")
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def _lora(recipe: R.Recipe) -> tuple[int, Optional[set[str]]]:
    """(rank, target short names or None for every linear but the head); rank 0: no LoRA."""
    lora = getattr(recipe.model, "lora", None)
    if lora is None or not getattr(lora, "enabled", True):
        return 0, None
    rank = getattr(lora, "rank", 0) or 0
    targets = getattr(lora, "targets", None) or getattr(lora, "target_modules", None)
    if isinstance(targets, str):
        targets = [targets]
    return int(rank), (set(targets) if targets else None)


def tally(model: nn.Module, recipe: R.Recipe, source: str, model_type: str, canonical=lambda n: n) -> Counts:
    """Counts of a (meta-device) model under the recipe's freezing / LoRA settings. canonical: maps
    the model's parameter names to loomrl's layout. The sizes (hidden_size, ...) are the caller's to fill."""
    frozen_towers = recipe.model.encoders.frozen
    patterns = _freeze_patterns(recipe)
    lora_rank, lora_targets = _lora(recipe)
    c = dict(total=0, language_model=0, lm_tp=0, towers=0, projector=0, trainable=0, trainable_tp=0, lora=0)
    seen: set[int] = set()
    for mname, module in model.named_modules():
        mcanon = canonical(mname)
        lm = mcanon.startswith("language_model.")
        if lora_rank and lm and isinstance(module, nn.Linear) and not mcanon.endswith("lm_head"):
            short = mcanon.rsplit(".", 1)[-1]
            if lora_targets is None or short in lora_targets:
                c["lora"] += lora_rank * (module.in_features + module.out_features)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: counted where first seen (the embedding)
            seen.add(id(p))
            name = canonical(f"{mname}.{pname}" if mname else pname)
            n = p.numel()
            c["total"] += n
            tp = False
            if name.startswith(TOWERS):
                c["towers"] += n
                trainable = not frozen_towers
            elif name.startswith(PROJECTORS):
                c["projector"] += n
                trainable = True
            else:
                c["language_model"] += n
                tp = isinstance(module, (nn.Linear, nn.Embedding))
                c["lm_tp"] += n if tp else 0
                trainable = True
            # LoRA freezes the language model's own weights, as the trainer does (lora.apply_lora); its
            # embeddings / head and the towers train as the recipe says
            lora_frozen = (
                lora_rank
                and name.startswith("language_model.")
                and not any(k in name for k in ("embed_tokens", "lm_head"))
            )
            if any(_matches(name, pat) for pat in patterns) or lora_frozen:
                trainable = False
            if trainable:
                c["trainable"] += n
                c["trainable_tp"] += n if tp else 0
    if lora_rank:
        c["trainable"] += c["lora"]  # adapters: replicated over tensor-parallel ranks here
    return Counts(
        source=source,
        model_type=model_type,
        hidden_size=0,
        num_layers=0,
        num_heads=0,
        num_kv_heads=0,
        vocab_size=0,
        tied=False,
        **c,
    )


def count_parameters(recipe: R.Recipe, recipe_path: Optional[str | Path] = None) -> Counts:
    """The policy's parameters for the recipe (see the module docstring for where sizes come from)."""
    from loomrl.platform.backbone.hf_io import decoder_config

    path = find_model_config(recipe, recipe_path)
    if path is not None:
        text = path.read_bytes()
        model_type, model = _meta_checkpoint_model(str(path), hashlib.sha256(text).hexdigest())
        d = decoder_config(json.loads(text), str(path))
        counts = tally(model, recipe, _shown(path), model_type, canonical_hf_name)
    else:
        from loomrl.platform.backbone.tokenizer import load_tokenizer
        from loomrl.platform.backbone.vlm import build_policy

        m = recipe.model
        try:
            tokenizer = load_tokenizer(m.tokenizer)
        except (OSError, ValueError) as e:
            raise PlanError(
                f"model.tokenizer: cannot load {m.tokenizer!r} (the vocabulary sizes the recipe's own model): {e}"
            ) from None
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            # the plain model: `tally` adds model.lora's adapters itself
            plain = dataclasses.replace(m, lora=R.LoRAConfig()) if hasattr(m, "lora") else m
            model = build_policy(plain, tokenizer, recipe.training.seed)
        d = model.language_model.cfg
        counts = tally(model, recipe, "the recipe's model section", "loomrl VLM (demo)")
    counts.hidden_size, counts.num_layers, counts.num_heads = d.hidden_size, d.num_layers, d.num_heads
    counts.num_kv_heads, counts.vocab_size, counts.tied = d.num_kv_heads, d.vocab_size, d.tie_word_embeddings
    return counts


# --------------------------------------------------------------------------- bytes per rank


def _ceil_div(a: float, b: int) -> int:
    return int(math.ceil(a / b))


def _bf16(recipe: R.Recipe) -> bool:
    t = recipe.training
    precision = str(getattr(t, "precision", "") or "").lower()
    if precision in ("bf16", "bfloat16"):
        return True
    if t.engine == "deepspeed":
        return bool(t.deepspeed.bf16)
    return bool(getattr(getattr(t, t.engine, None), "bf16", False))


def sequence_length(recipe: R.Recipe, override: Optional[int] = None) -> tuple[int, str]:
    """(tokens per trained sequence, where that figure comes from)."""
    if override is not None:
        return override, "--seq-len"
    if recipe.rollout.engine == "vllm":
        return recipe.rollout.vllm.max_model_len, "rollout.vllm.max_model_len"
    return (
        PROMPT_ALLOWANCE + recipe.rollout.max_new_tokens,
        f"{PROMPT_ALLOWANCE} prompt tokens + rollout.max_new_tokens; --seq-len to set it",
    )


def activation_bytes(
    c: Counts,
    s: int,
    b: int,
    tp: int,
    w: int,
    checkpointing: bool,
    *,
    vocab_rows: Optional[int] = None,
    fused_attention: bool = False,
) -> dict:
    """{"layers", "attention_scores", "logits", "total"} for one micro-batch (formulas: module docstring);
    fused_attention: the attention kernel stores no score matrix (the 5 a s / h term is 0)."""
    h, a, L = c.hidden_size, c.num_heads, c.num_layers
    v = vocab_rows or c.vocab_size
    scores = 0 if fused_attention else 5 * a * s * s * b / tp * w / 2
    per_layer = s * b * h * (10 + 24 / tp) * w / 2 + scores
    if checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        layers = L * w * s * b * h + per_layer
    else:
        layers, scores = L * per_layer, L * scores
    logits = (w + 4) * s * b * v
    out = {"layers": int(layers), "attention_scores": int(scores), "logits": int(logits)}
    out["total"] = out["layers"] + out["logits"]
    return out


def make_plan(
    recipe: R.Recipe,
    recipe_path: Optional[str | Path] = None,
    gpu_memory_gib: float = 80.0,
    seq_len: Optional[int] = None,
    fused_attention: bool = False,
) -> Plan:
    """The per-rank memory plan of a loaded recipe (see the module docstring)."""
    from loomrl.platform.engines.megatron_convert import padded_vocab

    c = count_parameters(recipe, recipe_path)
    t = recipe.training
    engine = t.engine
    world = t.nproc
    tp = t.megatron.tensor_parallel if engine == "megatron" else 1
    dp = world // tp
    bf16 = _bf16(recipe)
    # the torch engine's bf16 is autocast: FP32 weights, gradients and optimizer, BF16 activations;
    # DeepSpeed's keeps BF16 weights and gradients beside an FP32 master copy
    bf16_weights = bf16 and engine != "torch"
    w = 2 if bf16_weights else 4
    act_w = 2 if bf16 else 4
    dtype = "bf16" if bf16_weights else ("fp32, bf16 autocast" if bf16 else "fp32")
    opt_per = 8 + (4 if bf16_weights else 0)
    opt_what = "fp32 master + 2 fp32 moments" if bf16_weights else "2 fp32 moments"
    P, T = c.total + c.lora, c.trainable
    notes: list[str] = []
    cpu = 0
    how: dict[str, str] = {}
    vocab_rows = c.vocab_size
    if engine == "deepspeed":
        z = t.deepspeed.zero_stage
        shard_w, shard_g, shard_o = (dp if z >= 3 else 1), (dp if z >= 2 else 1), (dp if z >= 1 else 1)
        weights = _ceil_div(P * w, shard_w)
        grads = _ceil_div(T * w, shard_g)
        opt = _ceil_div(T * opt_per, shard_o)
        desc = f"deepspeed ZeRO-{z}"
        how["weights"] = f"{P:,} params x {w} B" + (f" / {dp} (ZeRO-3)" if shard_w > 1 else "")
        how["gradients"] = f"{T:,} trainable x {w} B" + (f" / {dp} (ZeRO-2+)" if shard_g > 1 else "")
        how["optimizer"] = f"{T:,} trainable x {opt_per} B ({opt_what})" + (f" / {dp} (ZeRO-1+)" if shard_o > 1 else "")
        if t.deepspeed.offload_optimizer:
            cpu, opt = opt, 0
            how["optimizer"] = f"offloaded to host memory ({cpu / GIB:.2f} GiB per rank)"
            desc += ", optimizer offloaded"
    elif engine == "megatron":
        vocab_rows = padded_vocab(c.vocab_size, tp)
        pad = (vocab_rows - c.vocab_size) * c.hidden_size * (1 if c.tied else 2)
        sharded, rest = c.lm_tp + pad, P - c.lm_tp
        t_sharded, t_rest = c.trainable_tp, T - c.trainable_tp
        weights = (rest + _ceil_div(sharded, tp)) * w
        grads = (t_rest + _ceil_div(t_sharded, tp)) * w
        opt = (t_rest + _ceil_div(t_sharded, tp)) * opt_per
        desc = f"megatron TP {tp}"
        how["weights"] = f"({rest:,} replicated + {sharded:,} language-model linear/embedding / {tp} (TP)) x {w} B"
        how["gradients"] = f"({t_rest:,} + {t_sharded:,} / {tp}) trainable x {w} B"
        how["optimizer"] = f"({t_rest:,} + {t_sharded:,} / {tp}) trainable x {opt_per} B ({opt_what})"
    else:
        weights, grads, opt = P * w, T * w, T * opt_per
        desc = "torch (one process)"
        how["weights"] = f"{P:,} params x {w} B"
        how["gradients"] = f"{T:,} trainable x {w} B"
        how["optimizer"] = f"{T:,} trainable x {opt_per} B ({opt_what})"

    s, s_from = sequence_length(recipe, seq_len)
    b = t.micro_batch_size
    checkpointing = bool(getattr(t, "activation_checkpointing", False))
    act = activation_bytes(c, s, b, tp, act_w, checkpointing, vocab_rows=vocab_rows, fused_attention=fused_attention)
    terms = ["10 + 24/tp" if tp > 1 else "34"] + ([] if fused_attention else ["5*a*s/(h*tp)" if tp > 1 else "5*a*s/h"])
    layer_formula = " + ".join(terms)
    scale = "" if act_w == 2 else " x 2 (fp32)"
    layer = "s*b*h x " + (f"({layer_formula})" if "+" in layer_formula else layer_formula) + scale
    how["activations"] = (
        f"{f'{c.num_layers} x w*s*b*h + 1 x {layer}' if checkpointing else f'{c.num_layers} x {layer}'}"
        f" + ({act_w}+4)*s*b*v logits; s={s}, b={b}, h={c.hidden_size}, a={c.num_heads}, "
        f"v={vocab_rows}"
    )

    r = recipe.rollout
    head_dim = c.hidden_size // c.num_heads
    if recipe.pipeline.mode == "disaggregated":
        rollout = 0
        how["rollout"] = "disaggregated: the rollout workers hold the rollout engine, not the trainer ranks"
    elif r.engine == "vllm":
        vb = VLLM_BYTES[r.vllm.dtype]
        rollout = c.language_model * vb + r.vllm.kv_cache_gib * GIB
        how["rollout"] = (
            f"vLLM: {c.language_model:,} language-model params x {vb} B ({r.vllm.dtype}) + "
            f"KV cache {r.vllm.kv_cache_gib} GiB (rollout.vllm.kv_cache_gib)"
        )
    else:
        rows = math.ceil(t.prompts_per_step / world) * r.n
        rollout = 2 * c.num_layers * c.num_kv_heads * head_dim * s * rows * 4
        how["rollout"] = (
            f"built-in engine KV cache: 2 x {c.num_layers} layers x {c.num_kv_heads} kv heads x "
            f"{head_dim} x {s} tokens x {rows} rows x 4 B (weights: the policy's)"
        )
    per_rank = {
        "weights": weights,
        "gradients": grads,
        "optimizer": opt,
        "activations": act["total"],
        "rollout": rollout,
    }
    if engine != "torch":
        per_rank["policy_copy"] = c.total * 4
        how["policy_copy"] = (
            f"{c.total:,} params x 4 B: the trainer's float32 policy the rollouts use "
            f"(reloaded from the engine after each step)"
        )
    if recipe.algorithm.kl_coef > 0 and not ALGORITHMS.get(recipe.algorithm.name).trait("supervised"):
        per_rank["reference"] = c.total * 4
        how["reference"] = f"{c.total:,} params x 4 B: the frozen reference policy (algorithm.kl_coef > 0)"
    per_rank["total"] = sum(per_rank.values())
    if fused_attention:
        notes.append(
            "--fused-attention: no attention score matrix is stored (SDPA's memory-efficient or flash kernel on a GPU)"
        )
    elif act["attention_scores"] > act["total"] / 2:
        notes.append(
            f"most activation bytes are attention scores ({act['attention_scores'] / GIB:.1f} GiB), which "
            f"a fused attention kernel does not store (--fused-attention plans with one); activation "
            f"checkpointing, a smaller training.micro_batch_size or shorter sequences also cut them"
        )
    notes.append(
        "the towers' activations, the CUDA context, communication buffers and allocator fragmentation are not counted"
    )
    return Plan(
        fused_attention=fused_attention,
        recipe=recipe.name,
        engine=engine,
        engine_desc=f"{desc}, {dtype}",
        ranks={"world": world, "dp": dp, "tp": tp},
        counts=c,
        dtype=dtype,
        seq_len=s,
        seq_len_from=s_from,
        micro_batch_size=b,
        activation_checkpointing=checkpointing,
        per_rank_bytes=per_rank,
        how=how,
        activations_bytes=act,
        cpu_bytes=cpu,
        gpu_memory_bytes=int(gpu_memory_gib * GIB),
        notes=notes,
    )


def plan_recipe(
    path: str | Path,
    overrides: list[str] = (),
    gpu_memory_gib: float = 80.0,
    seq_len: Optional[int] = None,
    fused_attention: bool = False,
) -> Plan:
    """Load a recipe (no file checks: it may be for another machine) and plan it. A shipped model
    config (recipes/models/...) is checked against the recipe as a present checkpoint would be.
    RecipeError / PlanError name the key or file."""
    recipe = R.load_recipe(path, list(overrides), files=False)
    config = find_model_config(recipe, path)
    if (
        config is not None
        and recipe.model.init_from is not None
        and config != Path(recipe.model.init_from) / "config.json"
    ):
        # as `loomrl run` would see it on the machine with the checkpoint: its sizes checked against the recipe's
        try:
            R.load_recipe(path, [*overrides, f"model.init_from={json.dumps(str(config.parent))}"], files=False)
        except R.RecipeError as e:
            shown = str(config.resolve())
            raise R.RecipeError(
                str(e) if shown in str(e) else f"{e} (with {shown} as model.init_from's config)"
            ) from None
    return make_plan(recipe, path, gpu_memory_gib, seq_len, fused_attention)


def report(plan: Plan, as_json: bool = False) -> None:
    """The plan as a table on the `loomrl` logger (stdout), then with as_json one JSON line, the last."""
    log.info("%s", plan.table())
    if as_json:
        log.info("%s", json.dumps(plan.to_json(), sort_keys=True))
