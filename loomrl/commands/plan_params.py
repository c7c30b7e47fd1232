"""Where `loomrl plan` gets the model's sizes, and how many parameters it has, by part.

One half of `loomrl plan` (loomrl/commands/plan.py assembles the plan; plan_bytes.py turns these
counts into bytes per rank). Nothing here allocates: the model is built on the meta device.

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
Qwen2-Audio / Qwen3-VL), `backbone.vlm.build_policy` for the recipe's own sizes. Tied weights count
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
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import transformers
from torch import nn

from loomrl.platform import recipe as R
from loomrl.platform.backbone.hf_io import decoder_config
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy

log = logging.getLogger("loomrl")

TRANSFORMERS_CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
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
    head_dim: int = 0
    """A head's width (Qwen3's is its own; 0 before the caller fills it)."""


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


# --------------------------------------------------------------------------- parameter counts


def part_of(name: str) -> str:
    """The part (training.freeze's names) of a parameter named in loomrl's policy layout."""
    for prefix, part in (
        ("visual.merger.", "merger"),
        ("visual.deepstack_merger_list.", "merger"),  # Qwen3-VL's DeepStack mergers
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
    path = find_model_config(recipe, recipe_path)
    if path is not None:
        text = path.read_bytes()
        model_type, model = _meta_checkpoint_model(str(path), hashlib.sha256(text).hexdigest())
        d = decoder_config(json.loads(text), str(path))
        counts = tally(model, recipe, _shown(path), model_type, canonical_hf_name)
    else:
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
    counts.head_dim = d.head_dim
    return counts
