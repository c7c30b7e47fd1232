"""`loomrl plan`: what a recipe needs per GPU, before a GPU is rented.

What it does: finds the model's config, counts its parameters without allocating them,
and estimates the bytes each training rank holds, by kind, for the recipe's engine and
ranks; then says whether that fits in a GPU of `--gpu-memory` GiB and with what headroom.

Three modules, one way (this one imports the other two, plan_bytes imports plan_params):
- plan_params.py: where the model's sizes come from (a checkpoint's config.json, one shipped
  under recipes/models/, or the recipe's own), and its parameters by part, trainable or not;
- plan_bytes.py: the bytes per rank of each kind (weights, gradients, optimizer, activations,
  rollout, policy copy, reference), the formulas in its docstring, one phase per function;
- this module: `make_plan` runs those phases in order into a `Plan` (its table and its JSON),
  `plan_recipe` loads a recipe and checks a shipped config against it, `report` prints.
The names the command line and the tests use are importable from here.

Exit codes of the command: 0 fits, 3 does not fit in --gpu-memory (the plan is still
printed, `fits: false` in --json), 2 a bad recipe, a missing model config or bad options.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from loomrl.commands.plan_bytes import (
    GIB,
    MemoryTerm,
    activation_bytes,
    activations,
    kept_copies,
    micro_batch_of,
    plan_notes,
    precision_of,
    ranks_of,
    rollout_term,
    sequence_length,
    training_state,
    vocab_rows,
)
from loomrl.commands.plan_params import (
    PARTS,
    PROJECTORS,
    TOWERS,
    TRANSFORMERS_CLASSES,
    Counts,
    PlanError,
    canonical_hf_name,
    count_parameters,
    find_model_config,
    loomrl_root,
    part_of,
    tally,
)
from loomrl.platform import recipe as R

__all__ = [
    "GIB",
    "PARTS",
    "PROJECTORS",
    "TOWERS",
    "TRANSFORMERS_CLASSES",
    "Counts",
    "Plan",
    "PlanError",
    "activation_bytes",
    "canonical_hf_name",
    "count_parameters",
    "find_model_config",
    "loomrl_root",
    "make_plan",
    "part_of",
    "plan_recipe",
    "report",
    "sequence_length",
    "tally",
]

log = logging.getLogger("loomrl")


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


def make_plan(
    recipe: R.Recipe,
    recipe_path: Optional[str | Path] = None,
    gpu_memory_gib: float = 80.0,
    seq_len: Optional[int] = None,
    fused_attention: bool = False,
) -> Plan:
    """The per-rank memory plan of a loaded recipe: the phases of plan_bytes.py (its docstring has the
    formulas) in order, over the parameters plan_params.py counts."""
    c = count_parameters(recipe, recipe_path)
    ranks = ranks_of(recipe)
    prec = precision_of(recipe, ranks.engine)
    vocab = vocab_rows(c, ranks)
    state = training_state(c, recipe, ranks, prec)
    mb = micro_batch_of(recipe, seq_len, fused_attention)
    act = activations(c, mb, prec, tp=ranks.tp, vocab=vocab)
    terms = {
        "weights": state.weights,
        "gradients": state.gradients,
        "optimizer": state.optimizer,
        "activations": MemoryTerm(act.bytes["total"], act.how),
        "rollout": rollout_term(c, recipe, world=ranks.world, seq_len=mb.seq_len),
        **kept_copies(c, recipe, policy_copy=state.policy_copy),
    }
    per_rank = {kind: term.bytes for kind, term in terms.items()}
    per_rank["total"] = sum(per_rank.values())
    return Plan(
        fused_attention=fused_attention,
        recipe=recipe.name,
        engine=ranks.engine,
        engine_desc=f"{state.desc}, {prec.dtype}",
        ranks=ranks.as_dict(),
        counts=c,
        dtype=prec.dtype,
        seq_len=mb.seq_len,
        seq_len_from=mb.seq_len_from,
        micro_batch_size=mb.size,
        activation_checkpointing=mb.checkpointing,
        per_rank_bytes=per_rank,
        how={kind: term.how for kind, term in terms.items()},
        activations_bytes=act.bytes,
        cpu_bytes=state.cpu_bytes,
        gpu_memory_bytes=int(gpu_memory_gib * GIB),
        notes=plan_notes(act.bytes, fused_attention),
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
