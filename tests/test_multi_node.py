"""Jobs over several machines (`loomrl run --nnodes N --node-rank R --master-addr --master-port`):
two node agents on 127.0.0.1 run the same job as one node with as many processes, bit for bit
(timings aside): colocated data-parallel (DeepSpeed), FSDP2 sharded over the nodes, and
disaggregated with the rollout worker on the second node; a job whose second node is lost (its
agent's process group killed) resumes on both nodes and ends equal to the uninterrupted one. The
CLI refuses what cannot be spread over the nodes, by --dry-run too."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_compose import command, rows

from loomrl.cli import main
from loomrl.platform.engines.launch import Nodes, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["training.steps=3", "training.prompts_per_step=2", "training.mini_batches=1", "checkpoint.every=1"]
COLOCATED = ["training.engine=deepspeed", "training.nproc=2", *SMALL]
FSDP2 = ["training.engine=fsdp2", "training.nproc=2", *SMALL]
DISAGGREGATED = ["pipeline.mode=disaggregated", "pipeline.rollout_workers=1", *SMALL]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: Path, shards: Path, extra: list[str], *options: str) -> subprocess.Popen:
    """A node agent (or a one-node job) in its own process group, so a test can kill the node whole."""
    args, env = command(out, shards, extra, *options)
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def two_nodes(out: Path, shards: Path, extra: list[str], *options: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = str(free_port())
    nodes = [
        start(out, shards, extra, "--nnodes", "2", "--node-rank", str(r), "--master-port", port, *options)
        for r in (0, 1)
    ]
    return nodes[0], nodes[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def lose_node(agent: subprocess.Popen) -> None:
    """The node goes down: its launcher, its torchrun agent and its ranks, all at once."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(*procs: subprocess.Popen) -> list[str]:
    """Each process's output once it exited with 0 (the test fails with its output otherwise)."""
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-6000:]
        outs.append(out)
    return outs


def test_torchrun_is_told_the_nodes_and_the_static_rendezvous():
    one = torchrun_command(2, ["run", "x.yaml"])
    assert "--standalone" in one and "--nproc-per-node=2" in one
    two = torchrun_command(4, ["run", "x.yaml"], nodes=Nodes(2, 1, "10.0.0.5", 29400))
    assert "--standalone" not in two
    for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--master-addr=10.0.0.5"):
        assert flag in two
    assert "--master-port=29400" in two and "--nproc-per-node=2" in two  # 4 processes over 2 nodes


@pytest.mark.parametrize(
    "extra, options, message",
    [
        ([], ["--nnodes", "2"], "training.engine=torch runs in one process"),
        (["training.engine=deepspeed", "training.nproc=3"], ["--nnodes", "2"], "3 processes do not split evenly"),
        (["training.engine=deepspeed", "training.nproc=2"], ["--nnodes", "2", "--node-rank", "2"], "not in 0..1"),
        (["training.engine=deepspeed", "training.nproc=2"], ["--nnodes", "0"], "at least one node"),
    ],
)
def test_what_cannot_spread_over_the_nodes_is_refused_by_a_dry_run(extra, options, message, capsys):
    assert main(["run", "recipes/demo.yaml", *extra, "--dry-run", *options]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("job", [COLOCATED, FSDP2], ids=["deepspeed", "fsdp2"])
def test_colocated_training_over_two_nodes_equals_one_node_and_survives_a_lost_node(tmp_path, demo_shards, job):
    """DeepSpeed data-parallel, or FSDP2 sharded over the two nodes; one rank per node. The second
    node is lost (its launcher, agent and rank killed at once, as a machine going down) after
    step 1; both nodes resume from the checkpoint."""
    d, _ = demo_shards
    one = start(tmp_path / "one", d, job)
    node0, node1 = two_nodes(tmp_path / "two", d, job)
    metrics = tmp_path / "two" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        assert node0.poll() is None and node1.poll() is None, "a node ended before step 1"
        time.sleep(0.2)
    lose_node(node1)
    out0, _ = node0.communicate(timeout=300)
    assert node0.returncode != 0, out0[-3000:]  # node 0 notices the lost peer and stops: no hang
    node1.communicate(timeout=60)
    finish(one)
    assert (tmp_path / "two" / "checkpoints").is_dir()
    node0, node1 = two_nodes(tmp_path / "two", d, job, "--resume")
    out0, _ = finish(node0, node1)
    assert "resumed from" in out0
    want, got = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["step"] for r in got] == [0, 1, 2] and len({r["loss"] for r in want}) > 1
    for a, b in zip(want, got, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


@pytest.mark.slow
def test_disaggregated_with_the_rollout_worker_on_the_second_node_equals_one_node(tmp_path, demo_shards):
    d, _ = demo_shards
    one = start(tmp_path / "one", d, DISAGGREGATED)
    node0, node1 = two_nodes(tmp_path / "two", d, DISAGGREGATED)
    finish(one, node0, node1)
    want, got = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["step"] for r in got] == [0, 1, 2] and len({r["loss"] for r in want}) > 1
    for a, b in zip(want, got, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    books = summary["trajectories"]
    assert books["generated"] == books["trained"] + books["dropped"] + books["pending"]
