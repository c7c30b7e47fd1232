"""Settings of one reward source (`algorithm.rewards[i]`); `check_parameters`, which checks a source's
reward parameters against its reward's registry entry (`REWARDS`, base.py); and `resolve_callable`,
which turns a reward name or `module:function` into the callable."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from loomrl.config.plugins import import_beside_recipe
from loomrl.config.schema import RecipeError, cut, ranged, show
from loomrl.platform.rewards.base import REWARDS, build_reward


@dataclass
class RewardSourceConfig:
    """One reward source: a callable, a learned reward model or a remote reward server, with
    its weight."""

    fn: Optional[str] = None
    """A reward callable: registry name (exact, numeric, choice, math, iou, regex, ...; see
    loomrl.platform.rewards) or `module:function` (on the Python path, or `module.py` beside the
    recipe). Set exactly one of `fn`, `model` and `url`."""
    model: Optional[str] = None
    """A local folder of a transformers sequence-classification model (safetensors
    weights + tokenizer; nothing is downloaded), run on the trainer's device."""
    url: Optional[str] = None
    """An http:// or https:// reward server: each batch is POSTed as {"completions": [...],
    "samples": [...]} and answered with {"rewards": [...]} (loomrl/platform/rewards/remote.py)."""
    weight: float = ranged(1.0)
    """Weight of this source in the summed reward."""
    name: Optional[str] = None
    """Name in the metrics (`reward_<name>_mean`); default: the function or folder name, or the
    server's host."""
    batch_size: int = ranged(32, ge=1)
    """Completions per reward-model forward, or per request to a reward server."""
    max_length: int = ranged(512, ge=1)
    """Reward-model input tokens (prompt + completion, truncated)."""
    label: int = ranged(0, ge=0)
    """Which logit of the reward model's head is the reward."""
    with_prompt: bool = True
    """Score the (prompt text, completion) pair; false: the completion alone."""
    timeout_s: float = ranged(30.0, gt=0)
    """Reward server: seconds one request may take (connect, send, whole reply)."""
    retries: int = ranged(2, ge=0)
    """Reward server: further attempts after a connection error, a timeout or a 5xx reply
    (short exponential backoff); then the run stops with an error naming the URL."""
    tolerance: float = ranged(1e-4, ge=0)
    """`numeric` and `math`: relative tolerance of a number match (plus 1e-9 absolute)."""
    pattern: Optional[str] = None
    """`regex` (needed there, used nowhere else): the regular expression the stripped completion
    must fully match (re.fullmatch, DOTALL: `.` matches newlines)."""

    def source_name(self) -> str:
        """The name in the metrics: `name`, else the function's, the folder's or the server's host name."""
        if self.name:
            return self.name
        if self.fn:
            return self.fn.split(":")[-1]
        if self.url:
            try:
                return urlsplit(self.url).hostname or self.url
            except ValueError:
                return self.url
        return Path(self.model).resolve().name


NEEDS = {"pattern": "the regular expression a completion must fully match"}
"""What a required reward parameter is, as the message for a source without it says."""


def check_parameters(source: RewardSourceConfig, key: str) -> None:
    """The reward parameters of `source` (a callable's, `key` = algorithm.rewards[i]) against its
    registry entry: a `pattern` only for a reward that takes one, and compiling; each parameter the
    reward requires set. RecipeError naming `key`'s field otherwise."""
    entry = REWARDS.get(source.fn) if source.fn in REWARDS else None
    if source.pattern is not None:
        if entry is None or "pattern" not in entry.trait("params", ()):
            takers = [n for n in REWARDS.names() if "pattern" in REWARDS.get(n).trait("params", ())]
            raise RecipeError(
                f"{key}.pattern: only the {' / '.join(takers)} reward takes a pattern (fn: {' or '.join(takers)})"
            )
        try:
            re.compile(source.pattern, re.DOTALL)
        except (re.error, RecursionError, OverflowError, ValueError) as e:
            raise RecipeError(
                f"{key}.pattern: {show(source.pattern)} is not a valid regular expression: {cut(str(e), 200)}"
            ) from None
    for p in entry.trait("required", ()) if entry is not None else ():
        if getattr(source, p, None) is None:
            raise RecipeError(f"{key}.{p}: fn: {source.fn} needs a {p} ({NEEDS.get(p, 'a value')})")


def resolve_callable(spec: str, key: str = "algorithm.reward", source: Optional[RewardSourceConfig] = None) -> Any:
    """A reward (or other) function from a registry name or `module:function`; errors name `key`.
    A registry reward gets its parameters (`tolerance`, `pattern`) from `source` (None: defaults).
    A module that is not importable is also looked for beside the recipe (`set_recipe_folder`)."""
    if spec in REWARDS:
        try:
            return build_reward(spec, source)
        except ValueError as e:  # a required parameter missing (`regex` without a pattern)
            raise RecipeError(f"{key}: {e}") from None
    if ":" not in spec:
        raise RecipeError(
            f"{key}: {show(spec)} is neither a registered reward ({', '.join(REWARDS.names())}) nor module:function"
        )
    mod, fn = spec.split(":", 1)
    if not mod.strip() or mod.startswith(".") or not fn:
        raise RecipeError(f"{key}: {show(spec)}: expected module:function with an absolute module name")
    try:
        obj = getattr(import_beside_recipe(mod, spec, key), fn)
    except RecipeError:
        raise
    except Exception as e:  # noqa: BLE001 - importing a module runs its code: any error is the recipe's
        raise RecipeError(f"{key}: cannot load {show(spec)}: {type(e).__name__}: {cut(str(e), 300)}") from None
    if not callable(obj):
        raise RecipeError(f"{key}: {show(spec)} is not callable")
    return obj
