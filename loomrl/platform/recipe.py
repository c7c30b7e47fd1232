"""The recipe: the single source of truth for a run.

A recipe is a YAML file mapped onto typed dataclasses, plus `key.path=value` overrides from the
command line. Each part declares its own section beside its code (model: platform/backbone/config.py,
towers: encoders/config.py, data: datasets/config.py, rollout: platform/rollout/config.py, algorithm:
platform/algorithms/config.py, training: platform/engines/config.py, pipeline:
platform/trajectory/config.py); this module composes them into `Recipe`, declares the run-level
sections (logging, checkpoint, goal), checks the rules that span parts, and loads a file. Every
field is documented where it is declared, every numeric field with its range (`ranged`). Anything
wrong (unknown key, wrong type, a number outside its range, NaN or infinite, a value outside the
allowed set, sizes that do not fit together, missing file) raises `RecipeError` naming the key path,
before any work starts. The names of every part's config are re-exported here.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch
import yaml

from loomrl.config import schema
from loomrl.config.patterns import MAX_SHARD_PATTERNS, check_pattern, expand_pattern
from loomrl.config.plugins import set_recipe_folder
from loomrl.config.schema import (
    INT_MAX,
    SEED_MAX,
    Range,
    RecipeError,
    apply_override,
    build,
    check_aliases,
    cut,
    dump,
    is_dir,
    is_file,
    ranged,
    show,
    to_dict,
)
from loomrl.datasets.config import DataConfig, DemoDataConfig, ValidationConfig
from loomrl.encoders.config import AudioConfig, EncoderConfig, VisionConfig
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.config import AlgorithmConfig, ImportanceConfig, PPOConfig, validate_algorithm
from loomrl.platform.backbone.config import (
    DEFAULT_ROUNDING,
    LORA_TARGETS,
    ROUNDING_REGIONS,
    LoRAConfig,
    ModelConfig,
    RoundingConfig,
    resolve_rounding,
    validate_model,
)
from loomrl.platform.backbone.hf_config import checkpoint_settings, fill_from_checkpoint
from loomrl.platform.engines import TRAINING_ENGINES
from loomrl.platform.engines.config import (
    ENCODER_PARTS,
    FREEZE_PARTS,
    DeepSpeedConfig,
    MegatronConfig,
    TrainingConfig,
    WarmupConfig,
    frozen_parts,
)
from loomrl.platform.rewards.config import RewardSourceConfig, resolve_callable
from loomrl.platform.rollout import ROLLOUT_ENGINES
from loomrl.platform.rollout.config import DrafterConfig, RolloutConfig, VLLMConfig
from loomrl.platform.trajectory.config import PipelineConfig

__all__ = [  # the parts' configs and the config core, for `from loomrl.platform.recipe import ...`
    "INT_MAX",
    "SEED_MAX",
    "MAX_SHARD_PATTERNS",
    "Range",
    "RecipeError",
    "ranged",
    "apply_override",
    "to_dict",
    "dump",
    "check_pattern",
    "expand_pattern",
    "set_recipe_folder",
    "resolve_callable",
    "checkpoint_settings",
    "fill_from_checkpoint",
    "DataConfig",
    "DemoDataConfig",
    "ValidationConfig",
    "AudioConfig",
    "EncoderConfig",
    "VisionConfig",
    "AlgorithmConfig",
    "ImportanceConfig",
    "PPOConfig",
    "RewardSourceConfig",
    "LORA_TARGETS",
    "DEFAULT_ROUNDING",
    "ROUNDING_REGIONS",
    "ALGORITHMS",
    "ROLLOUT_ENGINES",
    "TRAINING_ENGINES",
    "LoRAConfig",
    "ModelConfig",
    "RoundingConfig",
    "resolve_rounding",
    "ENCODER_PARTS",
    "FREEZE_PARTS",
    "DeepSpeedConfig",
    "MegatronConfig",
    "TrainingConfig",
    "WarmupConfig",
    "DrafterConfig",
    "RolloutConfig",
    "VLLMConfig",
    "PipelineConfig",
    "LoggingConfig",
    "WandbConfig",
    "MLflowConfig",
    "TRACKER_LIBRARIES",
    "validate_trackers",
    "CheckpointConfig",
    "GoalConfig",
    "Recipe",
    "validate",
    "validate_algorithm",
    "validate_model",
    "validate_lora",
    "validate_freeze",
    "file_problems",
    "load_recipe",
    "field_docs",
    "dump_run",
    "run_dict",
    "RUN_PATH_KEYS",
]


WANDB_TAG_MAX = 64
"""W&B refuses a tag longer than this."""


@dataclass
class WandbConfig:
    """Weights & Biases: each metrics row as a wandb history row (rank 0; `loomrl[trackers]`)."""

    enabled: bool = False
    """Log the run's metrics (and its recipe, as the wandb config) to a wandb run."""
    project: str = "loomrl"
    """The wandb project."""
    name: Optional[str] = None
    """The wandb run's display name (null: the run folder's name)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the wandb run."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written under `dir` only (upload later with `wandb sync`); online: streamed to the
    server (needs `wandb login`)."""
    dir: Optional[str] = None
    """The folder wandb writes its `wandb/` folder into (null: the run folder)."""


@dataclass
class MLflowConfig:
    """MLflow: each metrics row as MLflow metrics at its step (rank 0; `loomrl[trackers]`)."""

    enabled: bool = False
    """Log the run's metrics (and its recipe, flattened, as params) to an MLflow run."""
    tracking_uri: Optional[str] = None
    """The tracking store (`file:...`, `http://...`, `sqlite:///...`; null: a local file store,
    RUN/mlruns)."""
    experiment: str = "loomrl"
    """The MLflow experiment (created if missing)."""
    run_name: Optional[str] = None
    """The MLflow run's name (null: the run folder's name)."""


@dataclass
class LoggingConfig:
    """What a run writes and shows."""

    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    progress: bool = True
    """Show a progress bar with the live reward."""
    mismatch_every: int = ranged(0, ge=0)
    """Every N RL steps, recompute the step's log-probs with a BF16 copy of the policy under each
    rounding setting (as `loomrl doctor` does) and log the mismatch to the rollout log-probs as
    `mismatch_<setting>_{mean,max,kl}` (0 = off)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)


@dataclass
class CheckpointConfig:
    """Checkpoints: safetensors weights + optimizer state, written atomically."""

    every: int = ranged(0, ge=0)
    """Write a checkpoint every N RL steps (0 = only at the end)."""
    keep_last: int = ranged(2, ge=1)
    """Keep the newest K checkpoints."""


@dataclass
class GoalConfig:
    """A pass/fail check of the reward curve, printed in the run summary."""

    first_steps: int = ranged(5, ge=1)
    """Baseline: mean reward over the first N RL steps."""
    last_steps: int = ranged(10, ge=1)
    """Result: mean reward over the last N RL steps."""
    min_final: float = ranged(0.8)
    """The result must reach this."""
    min_gain: float = ranged(0.3)
    """The result must exceed the baseline by this."""
    metric: Literal["reward_mean", "val_reward_mean"] = "reward_mean"
    """The curve checked: the training reward, or the validation reward (rows that have one)."""


@dataclass
class Recipe:
    """A whole run."""

    name: str = "run"
    """Name of the run (the default output folder is runs/NAME-TIMESTAMP): letters, digits, `.`, `_`, `-`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """KnitTrans trajectory pipeline: colocated or disaggregated roles, admission policy."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """A held-out split scored during the run (`val_*` metrics)."""
    goal: Optional[GoalConfig] = None
    """If set, the summary checks the reward curve and `loomrl run` exits 3 when it misses."""


def validate_lora(r: Recipe) -> None:
    """`model.lora`: each target once and at least one; with rank > 0 the adapters must be able to
    train (language_model not frozen) and the training engine must run the policy's own modules
    (torch / deepspeed; megatron rebuilds the language model from its plain weights)."""
    lo = r.model.lora
    for i, target in enumerate(lo.targets):
        if target in lo.targets[:i]:
            raise RecipeError(f"model.lora.targets[{i}]: {target!r} is listed twice")
    if not lo.rank:
        return
    if not lo.targets:
        raise RecipeError(
            f"model.lora.targets: empty with model.lora.rank={lo.rank}; name at least one of "
            f"{', '.join(LORA_TARGETS)} (or set rank 0)"
        )
    if "language_model" in r.training.freeze:
        raise RecipeError(
            f"training.freeze: language_model freezes the LoRA adapters too "
            f"(model.lora.rank={lo.rank}); with LoRA the base weights are frozen already"
        )
    if not TRAINING_ENGINES.get(r.training.engine).trait("lora"):
        able = " or ".join(n for n in TRAINING_ENGINES.names() if TRAINING_ENGINES.get(n).trait("lora"))
        raise RecipeError(
            f"model.lora.rank: LoRA ({lo.rank}) needs training.engine {able}; "
            f"{r.training.engine} trains its own copy of the plain language model"
        )


def validate_freeze(r: Recipe) -> None:
    """`training.freeze`: each part once, something left to train (with `model.encoders.frozen`),
    and a language model for a format warm-up. Which parts the model has is checked at start."""
    t = r.training
    for i, part in enumerate(t.freeze):
        if part in t.freeze[:i]:
            raise RecipeError(f"training.freeze[{i}]: {part!r} is listed twice")
    frozen = frozen_parts(t.freeze, r.model.encoders.frozen)
    also = " (with model.encoders.frozen: " + ", ".join(ENCODER_PARTS) + ")" if r.model.encoders.frozen else ""
    if frozen >= set(FREEZE_PARTS):
        raise RecipeError(
            f"training.freeze: every part of the policy is frozen{also}; nothing would train "
            f"(parts: {', '.join(FREEZE_PARTS)})"
        )
    if t.warmup.steps and t.warmup.target == "format" and {"language_model", "embeddings"} <= frozen:
        raise RecipeError(
            "training.warmup.target: the format warm-up trains only the language model, and "
            "training.freeze freezes all of it (language_model and embeddings); use target "
            "answer or training.warmup.steps=0"
        )


TRACKER_LIBRARIES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""logging.<tracker> -> (the module it imports, the package that installs it)."""


def validate_trackers(lg: LoggingConfig) -> None:
    """`logging.wandb` / `logging.mlflow`: an enabled tracker's library is installed (at load, so
    `--dry-run` says so), and its names are usable."""
    for key, (module, package) in TRACKER_LIBRARIES.items():
        if getattr(lg, key).enabled and importlib.util.find_spec(module) is None:
            raise RecipeError(
                f"logging.{key}.enabled: {module} is not installed; pip install {package} "
                f"(or the trackers extra: pip install -e '.[trackers]')"
            )
    for i, tag in enumerate(lg.wandb.tags):
        if not tag or len(tag) > WANDB_TAG_MAX:
            raise RecipeError(f"logging.wandb.tags[{i}]: {show(tag)} must be 1 to {WANDB_TAG_MAX} characters")
    for key, value in (
        ("logging.wandb.project", lg.wandb.project),
        ("logging.mlflow.experiment", lg.mlflow.experiment),
    ):
        if not value.strip():
            raise RecipeError(f"{key}: must not be empty")


def check_engine(r: Recipe) -> None:
    """What the training engine's registered traits refuse: process count, a value model, BF16 weights."""
    t = r.training
    engine, algorithm = TRAINING_ENGINES.get(t.engine), ALGORITHMS.get(r.algorithm.name)
    most = engine.trait("processes_max")
    if most is not None and t.nproc > most:
        more = " or ".join(
            n for n in TRAINING_ENGINES.names() if TRAINING_ENGINES.get(n).trait("processes_max") is None
        )
        raise RecipeError(
            f"training.nproc: the {t.engine} engine runs in "
            f"{'one process' if most == 1 else f'at most {most} processes'}; use training.engine "
            f"{more} for more"
        )
    if algorithm.trait("advantages") == "critic" and not engine.trait("value_model"):
        able = " or ".join(n for n in TRAINING_ENGINES.names() if TRAINING_ENGINES.get(n).trait("value_model"))
        raise RecipeError(
            f"algorithm.name: {r.algorithm.name} trains a value model (value head or separate critic) "
            f"with the {able} engine only; training.engine={t.engine!r} trains the policy alone "
            f"(use grpo, or training.engine={able})"
        )
    if t.precision == "bf16_params" and not engine.trait("master_weights"):
        able = " or ".join(n for n in TRAINING_ENGINES.names() if TRAINING_ENGINES.get(n).trait("master_weights"))
        raise RecipeError(
            f"training.precision: bf16_params (BF16 weights, FP32 masters) runs on training.engine={able}; "
            f"training.engine={t.engine!r} has its own BF16 setting (docs/engines.md)"
        )
    tp = t.megatron.tensor_parallel
    if t.nproc % tp:
        raise RecipeError(f"training.megatron.tensor_parallel: {tp} must divide training.nproc={t.nproc}")


def validate(r: Recipe) -> None:
    """Checks across fields and of the shard pattern (each field's range is checked at load)."""

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", r.name):
        raise RecipeError(
            f"name: {show(r.name)} must be letters, digits, '.', '_' or '-' (at most 100, not "
            f"starting with '.' or '-'): it names the default run folder runs/NAME-TIME"
        )
    t = r.training
    # what the chosen parts are, and what they refuse, is their registered traits
    engine, rollout = TRAINING_ENGINES.get(t.engine), ROLLOUT_ENGINES.get(r.rollout.engine)
    algorithm = ALGORITHMS.get(r.algorithm.name)
    check_engine(r)
    if engine.trait("check") is not None:
        engine.trait("check")(r)
    resolve_rounding(r.model.rounding, rollout.trait("rounding"))
    validate_model(r.model)
    validate_freeze(r)
    validate_lora(r)
    if rollout.trait("check") is not None:
        rollout.trait("check")(r)
    least = algorithm.trait("min_samples", 1)
    if r.rollout.n < least:
        raise RecipeError(f"rollout.n: {r.algorithm.name.upper()} needs at least {least} samples per prompt")
    if r.algorithm.dynamic_sampling.enabled and (algorithm.trait("advantages") != "group" or r.rollout.n < 2):
        raise RecipeError(
            "algorithm.dynamic_sampling.enabled: dynamic sampling drops groups whose rewards are all alike; it needs "
            f"a group-advantage algorithm (not {r.algorithm.name}) and rollout.n >= 2 (got {r.rollout.n})"
        )
    batch = r.training.prompts_per_step * r.rollout.n
    if r.training.prompts_per_step % r.training.mini_batches:  # a GRPO group is never split
        raise RecipeError(
            f"training.mini_batches: {r.training.prompts_per_step} prompts per step "
            f"({batch} trajectories) do not split into {r.training.mini_batches} "
            f"mini-batches of whole groups"
        )
    check_data_and_validation(r)
    validate_trackers(r.logging)
    if algorithm.trait("supervised"):
        name = f"algorithm.name={r.algorithm.name}"
        if r.pipeline.mode != "colocated":
            raise RecipeError(f"pipeline.mode: {name} has no rollouts to disaggregate; use colocated")
        if t.warmup.steps:
            raise RecipeError(
                f"training.warmup.steps: {name} is the supervised stage itself; set its steps with training.steps"
            )
        if r.algorithm.kl_coef:
            raise RecipeError(f"algorithm.kl_coef: the KL penalty is an RL term; {name} has none")
        if r.goal is not None and r.goal.metric == "reward_mean":
            raise RecipeError(
                f"goal.metric: {name} has no training reward; check val_reward_mean (with validation.shards)"
            )
    resolve_callable(r.algorithm.reward)
    validate_algorithm(r.algorithm)


def check_data_and_validation(r: Recipe) -> None:
    """The rules between the data, the rollouts and the validation split."""
    check_pattern(r.data.shards, "data.shards")
    if r.validation.shards is not None:
        check_pattern(r.validation.shards, "validation.shards")
    if r.algorithm.overlong.buffer >= r.rollout.max_new_tokens:
        raise RecipeError(
            f"algorithm.overlong.buffer: {r.algorithm.overlong.buffer} must be below rollout.max_new_tokens "
            f"({r.rollout.max_new_tokens}): the penalty starts that many tokens before the cap"
        )
    if r.validation.samples_per_prompt > 1 and r.validation.temperature == 0:
        raise RecipeError(
            f"validation.samples_per_prompt: {r.validation.samples_per_prompt} greedy completions of a prompt "
            f"are all the same; set validation.temperature above 0 for pass@k"
        )
    no_validation = r.validation.shards is None and r.validation.source is None
    if r.goal is not None and r.goal.metric.startswith("val_") and no_validation:
        raise RecipeError(f"goal.metric: {r.goal.metric} needs a validation split (validation.shards or .source)")


def sources(r: Recipe) -> dict[str, str]:
    """The data the recipe names as the user has it (recipe key -> path): its shards are made
    once into data.cache (datasets/cache.py) and read in place of data.shards / validation.shards."""
    named = {"data.source": r.data.source, "validation.source": r.validation.source}
    return {key: path for key, path in named.items() if path is not None}


def file_problems(r: Recipe) -> list[str]:
    """What this machine lacks for the recipe: the shards, the tokenizer, the checkpoint the
    policy starts from, and CUDA where `training.device` is `cuda`. `loomrl run --dry-run` reports
    these as notes, so a recipe for another machine (a GPU cluster) still validates here."""
    problems = [f"{key}: {show(path)} does not exist" for key, path in sources(r).items() if not os.path.exists(path)]
    if r.data.source is None and r.data.demo is None and not expand_pattern(r.data.shards, "data.shards"):
        problems.append(
            f"data.shards: no files match {show(r.data.shards)} (and data.demo is null, so none will be generated)"
        )
    if (
        r.validation.source is None
        and r.validation.shards is not None
        and not expand_pattern(r.validation.shards, "validation.shards")
    ):
        problems.append(f"validation.shards: no files match {show(r.validation.shards)}")
    if r.data.chat_template not in ("auto", "none") and not is_file(r.data.chat_template):
        problems.append(f"data.chat_template: {show(r.data.chat_template)} is not 'auto', 'none' nor a file")
    if r.model.tokenizer != "demo" and not is_dir(r.model.tokenizer):
        problems.append(f"model.tokenizer: {show(r.model.tokenizer)} is not 'demo' nor a tokenizer folder")
    if r.training.device == "cuda":
        if not torch.cuda.is_available():
            problems.append(f"training.device: 'cuda' but torch {torch.__version__} sees no CUDA device here")
    if r.model.init_from is not None and not is_file(str(Path(r.model.init_from) / "config.json")):
        problems.append(
            f"model.init_from: {show(r.model.init_from)} is not a local HF checkpoint folder (no config.json)"
        )
    return problems


RUN_PATH_KEYS = (
    ("model", "init_from"),
    ("model", "tokenizer"),
    ("data", "shards"),
    ("data", "source"),
    ("data", "cache"),
    ("data", "chat_template"),
    ("validation", "shards"),
    ("validation", "source"),
)
"""The path-valued keys of a recipe; a run's recipe.yaml holds them absolute (`dump_run`)."""
_NOT_PATHS = {("model", "tokenizer"): ("demo",), ("data", "chat_template"): ("auto", "none")}


def run_dict(r: Recipe, cwd: Optional[str | Path] = None) -> dict:
    """The recipe as a run keeps it (RUN/recipe.yaml, a checkpoint's state.json): `to_dict` with
    every relative path of RUN_PATH_KEYS made absolute against `cwd` (None: the working
    directory), so `export`, `report`, `doctor` and `--resume` read the same files from any
    directory. Names that are not paths ('demo', 'auto', 'none') stay as they are."""
    base = Path(cwd if cwd is not None else os.getcwd()).resolve()
    data = schema.to_dict(r)
    for part, key in RUN_PATH_KEYS:
        value = data.get(part, {}).get(key)
        keep = _NOT_PATHS.get((part, key), ())
        if isinstance(value, str) and value and value not in keep and not os.path.isabs(os.path.expanduser(value)):
            data[part][key] = os.path.normpath(str(base / value))
    return data


def dump_run(r: Recipe, cwd: Optional[str | Path] = None) -> str:
    """RUN/recipe.yaml: `run_dict` as YAML."""
    return yaml.safe_dump(run_dict(r, cwd), sort_keys=False)


def load_recipe(path: str | Path | None, overrides: list[str] = (), files: bool = True) -> Recipe:
    """Read a YAML recipe, apply overrides, take the model's settings from model.init_from's
    checkpoint when its config.json is here (`fill_from_checkpoint`), type-check and validate it
    (files=False: skip the checks against this machine's file system, see `file_problems`)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML: {e}") from None
        except RecursionError:
            raise RecipeError(f"{path}: nested too deeply") from None
        except (ValueError, OverflowError, OSError) as e:  # not UTF-8, a YAML int over 4300 digits, ...
            raise RecipeError(f"{path}: cannot read it: {cut(str(e), 200)}") from None
        check_aliases(data, str(path))
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: the top level must be a mapping")
    for o in overrides:
        apply_override(data, o)
    recipe = build(Recipe, data)
    # the checkpoint decides the model's sizes wherever it is readable, dry runs included
    fill_from_checkpoint(recipe.model, data.get("model"))
    set_recipe_folder(path.parent if path is not None else None)  # `module:function` rewards beside it
    validate(recipe)
    problems = file_problems(recipe) if files else []
    if problems:
        raise RecipeError(problems[0])
    return recipe


def field_docs(cls: type = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every field of the recipe (or of `cls`), read from the
    docstrings beside each part's config; used to print the recipe reference."""
    return schema.field_docs(Recipe if cls is None else cls, prefix)
