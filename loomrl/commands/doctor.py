"""`loomrl doctor`: measure the rollout/trainer log-prob mismatch instead of trusting it.

A rollout engine generates completions and reports the log-prob of every
sampled token. The trainer then recomputes those log-probs with its own
forward on a BF16 copy of the same weights, once per rounding setting:
all regions native, each region (rope, swiglu, rmsnorm, attention) aligned
alone, all aligned, and all "vllm" (vLLM-CPU's own arithmetic,
docs/vllm-cpu-numerics.md). Every setting splices in the same media encodings:
the policy's own, computed once for the batch as a rollout engine computes
them (vLLM gets them in FP32 and rounds them to BF16 on entry; so does the
copy), so the settings differ only in how the language model rounds.
Per setting it reports, over every completion token:

- mean and max |trainer logp - rollout logp|;
- the token-level KL(rollout || trainer), estimated on the sampled tokens with
  the non-negative k3 estimator  E[r - 1 - log r],  r = p_trainer / p_rollout.

Engines are a small table, `ENGINES`: a name -> a function
`fn(model, prompts, params, generator) -> list[Rollout]` that samples from the
(FP32) policy `model` and returns completions with the engine's own log-probs.
`register_engine("vllm", fn)` adds one.

    torch         the built-in engine (KV-cached incremental decoding) on a BF16
                  copy of the policy, every region aligned: how an inference
                  engine with fused kernels rounds.
    transformers  the same tokens, scored by transformers' Qwen2ForCausalLM
                  (the policy's language model exported to a BF16 HF folder, the
                  media embeddings spliced in): the transformers reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from loomrl.commands.doctor_trace import trace_table, trace_vllm
from loomrl.platform import recipe as R
from loomrl.platform.backbone.hf_io import export_language_model, load_policy, refuse_qwen3
from loomrl.platform.backbone.rounding import SETTINGS
from loomrl.platform.checkpoint import load_checkpoint
from loomrl.platform.mismatch import (  # noqa: F401
    DTYPE,
    MICRO_BATCH,
    completion_logprobs,
    low_precision_copy,
    measure,
    mismatch,
    mismatch_metrics,
    policy_encodings,
    trainer_logprobs,
    trajectories,
)
from loomrl.platform.parts import build_policy_parts, configure_torch, prompt_source, shard_files, to_prompts
from loomrl.platform.rollout.base import ROLLOUT_ENGINES, Prompt, Rollout, SamplingParams
from loomrl.platform.rollout.config import VLLMConfig
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine
from loomrl.platform.trajectory.batch import micro_batches

EngineFn = Callable[..., list[Rollout]]


def torch_engine(
    model, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
) -> list[Rollout]:
    """The built-in engine on a BF16 copy, every region aligned (an inference engine's rounding)."""

    engine_model = low_precision_copy(model, SETTINGS["aligned"])
    return TorchRolloutEngine(engine_model).generate(prompts, params, generator).rollouts


@torch.no_grad()
def transformers_engine(
    model, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
) -> list[Rollout]:
    """Tokens from the built-in engine, log-probs from transformers' Qwen2ForCausalLM in BF16
    (the policy's language model exported with hf_io; the policy's media encodings,
    `policy_encodings`, rounded to BF16 and spliced into inputs_embeds)."""
    from transformers import Qwen2ForCausalLM

    rollouts = torch_engine(model, prompts, params, generator)
    policy = low_precision_copy(model, SETTINGS["native"])
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_language_model(policy.language_model, Path(tmp) / "lm", DTYPE)
        hf = Qwen2ForCausalLM.from_pretrained(str(folder), dtype=DTYPE, attn_implementation="sdpa").eval()
    trajs = trajectories(prompts, rollouts)
    encodings = policy_encodings(model, trajs)  # what `measure` splices in
    scored: list[list[float]] = []
    temperature = params.temperature if params.temperature > 0 else 1.0
    for mb in micro_batches(trajs, policy.pad_token_id, MICRO_BATCH, device=policy.device):
        embeds = policy.embed(mb.input_ids, mb.media, encodings)
        logits = hf(inputs_embeds=embeds, attention_mask=mb.attention_mask).logits
        logp = policy.token_logprobs(logits[:, :-1], temperature)
        logp = logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
        scored.extend(completion_logprobs(logp, mb))
    return [
        Rollout(r.prompt_index, r.sample_index, r.completion_ids, s, r.finish_reason) for r, s in zip(rollouts, scored)
    ]


def vllm_engine(
    model, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
) -> list[Rollout]:
    """vLLM (vllm-cpu on CPU) serving the policy's language model in BF16; media embeddings from
    the policy's towers as prompt embeddings; log-probs are vLLM's own (post-temperature)."""

    engine = VLLMRolloutEngine(model, VLLMConfig(dtype="bfloat16"))
    try:
        return engine.generate(prompts, params, generator).rollouts
    finally:
        engine.shutdown()


ENGINES: dict[str, EngineFn] = {"torch": torch_engine, "transformers": transformers_engine, "vllm": vllm_engine}


def register_engine(name: str, fn: EngineFn) -> None:
    """Make `loomrl doctor --engine NAME` (and the metrics) use `fn` as a rollout engine."""
    ENGINES[name] = fn


# --------------------------------------------------------------------------- the command


def run_doctor(
    recipe,
    engine: str = "torch",
    num_prompts: int = 8,
    checkpoint: Optional[Path] = None,
    hf: Optional[Path] = None,
    trace: bool = False,
) -> dict:
    """Build the recipe's policy (optionally a run checkpoint or an HF folder loaded into it),
    generate rollouts for `num_prompts` prompts with `engine`, and measure every setting.
    trace (engine vllm): also trace one sequence region by region (`doctor_trace`)."""

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: not one of {sorted(ENGINES)}")
    if trace and engine != "vllm":
        raise ValueError(f"--trace: traces vLLM's forward; --engine is {engine!r}")
    configure_torch(recipe.training)
    tokenizer, chat, model = build_policy_parts(recipe)
    if checkpoint is not None:
        load_checkpoint(checkpoint, model)
    if hf is not None:
        load_policy(model, hf)
    model.eval()
    prompts = to_prompts(prompt_source(recipe, shard_files(recipe), model, tokenizer, chat).next(num_prompts))
    ro = recipe.rollout
    params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
    rollouts = ENGINES[engine](model, prompts, params, torch.Generator(model.device).manual_seed(recipe.training.seed))
    trajs = trajectories(prompts, rollouts)
    settings = measure(model, trajs, ro.temperature, top_p=ro.top_p)
    report = {
        "engine": engine,
        "dtype": str(DTYPE).removeprefix("torch."),
        "tokens": sum(len(t.completion_ids) for t in trajs),
        "settings": settings,
        # the setting to train with against this engine, and what `model.rounding: auto` picks for it
        "closest": min(settings, key=lambda name: settings[name]["mean_abs_dlogp"]),
        "auto": ROLLOUT_ENGINES.get(engine).trait("rounding") if engine in ROLLOUT_ENGINES else None,
    }
    if trace:
        report["trace"] = trace_vllm(model, prompts, rollouts)
    return report


def table(report: dict) -> str:
    lines = [
        f"engine {report['engine']}, trainer forward in {report['dtype']}, {report['tokens']} tokens",
        "",
        "| setting | mean abs dlogp | max abs dlogp | token KL |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in report["settings"].items():
        lines.append(f"| {name} | {row['mean_abs_dlogp']:.3e} | {row['max_abs_dlogp']:.3e} | {row['kl']:.3e} |")
    lines.append("")
    lines.append(
        f"closest: {report['closest']}"
        + (
            f"; model.rounding: auto picks {report['auto']} for rollout.engine {report['engine']}"
            if report.get("auto")
            else f" ({report['engine']} is not a rollout engine: set model.rounding by hand)"
        )
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:

    ap = argparse.ArgumentParser(
        prog="loomrl doctor",
        description="Measure the rollout/trainer log-prob mismatch per rounding setting (BF16 trainer forward).",
    )
    ap.add_argument("recipe", nargs="?", default="recipes/demo.yaml", help="YAML recipe (default recipes/demo.yaml)")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--engine", default="torch", help=f"rollout engine to compare against: {', '.join(ENGINES)}")
    ap.add_argument("--prompts", type=int, default=8, help="prompts to sample (each rollout.n times)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path, help="a run checkpoint folder (DIR/checkpoints/step-N)")
    src.add_argument("--hf", type=Path, help="a local Hugging Face checkpoint folder to load into the policy")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="with --engine vllm: run one sequence through vLLM and the trainer and print, per layer "
        "and region, where their outputs first differ",
    )
    ap.add_argument("--json", action="store_true", help="print the table, then one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.engine not in ENGINES:
        ap.error(f"--engine {args.engine!r}: not one of {sorted(ENGINES)}")
    if args.trace and args.engine != "vllm":
        ap.error("--trace traces vLLM's forward: add --engine vllm")
    if args.prompts <= 0:
        ap.error("--prompts: must be positive")
    try:
        recipe = R.load_recipe(args.recipe, args.overrides)
        refuse_qwen3(recipe, "loomrl doctor")
        report = run_doctor(recipe, args.engine, args.prompts, args.checkpoint, args.hf, args.trace)
    except (R.RecipeError, ValueError, OSError, KeyError) as e:  # a damaged checkpoint: ValueError naming the file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(report), flush=True)
    if "trace" in report:
        print("\n" + trace_table(report["trace"]), flush=True)
    if args.json:
        if not all(math.isfinite(v) for row in report["settings"].values() for v in row.values()):
            print("warning: non-finite mismatch values", file=sys.stderr)
        print(json.dumps(report))
    return 0
