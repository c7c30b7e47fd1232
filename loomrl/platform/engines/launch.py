"""Multi-process runs: torchrun, gloo on CPU, gloo + NCCL on GPU.

`loomrl run` re-executes itself under torchrun when a recipe asks for more than one
training process (`training.nproc`), so the user types one command. Every rank
then runs the same driver loop; `init_distributed` joins the process group that
torchrun's environment describes, or makes a one-process group when a
distributed engine (DeepSpeed, Megatron) runs in a single process.

More than one machine (`Nodes`, from `loomrl run --nnodes N --node-rank R --master-addr HOST
--master-port PORT`, docs/multi-node.md): the same command on every node starts one torchrun agent
there, which joins the others through torchrun's static rendezvous at HOST:PORT (a c10d TCPStore
that node 0 serves). Static, not c10d's dynamic rendezvous, because roles are placed by node:
node R runs global ranks R x P .. R x P + P - 1 (P = processes per node), so trainer rank 0 is on
node 0, and in a disaggregated run the rollout workers (the last ranks) are on the last nodes; the
dynamic rendezvous orders nodes by host name and pid instead. The recipe is the same on every
node and describes the whole job (`training.nproc` trainer ranks in all), so a job on two nodes is
the same job as on one node with as many processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


def launched() -> bool:
    """True inside a torchrun (or deepspeed-launcher) worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Nodes:
    """The machines of a job (`loomrl run --nnodes --node-rank --master-addr --master-port`)."""

    count: int = 1
    rank: int = 0  # this node's
    master_addr: str = "127.0.0.1"  # node 0's address, where the rendezvous store listens
    master_port: int = 29500

    def per_node(self, processes: int, what: str) -> int:
        """Processes each node runs; ValueError naming `what` when they do not split evenly."""
        if self.count < 1:
            raise ValueError(f"--nnodes {self.count}: a job needs at least one node")
        if not 0 <= self.rank < self.count:
            raise ValueError(f"--node-rank {self.rank} is not in 0..{self.count - 1} (--nnodes {self.count})")
        if processes % self.count:
            raise ValueError(
                f"{what}: {processes} processes do not split evenly over --nnodes {self.count}; "
                f"give every node the same number"
            )
        return processes // self.count


ONE_NODE = Nodes()


def torchrun_command(nproc: int, cli_args: list[str], module: str = "loomrl.cli", nodes: Nodes = ONE_NODE) -> list[str]:
    """The command that runs `python -m <module> <cli_args>` on nproc processes in all, spread over
    `nodes` (torchrun's default: no restarts)."""
    if nodes.count == 1:
        where = ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        where = [
            f"--nnodes={nodes.count}",
            f"--node-rank={nodes.rank}",
            "--rdzv-backend=static",
            f"--master-addr={nodes.master_addr}",
            f"--master-port={nodes.master_port}",
            f"--nproc-per-node={nproc // nodes.count}",
        ]
    return [sys.executable, "-m", "torch.distributed.run", *where, "-m", module, *cli_args]


def launch(nproc: int, cli_args: list[str], nodes: Nodes = ONE_NODE) -> int:
    """Run `loomrl <cli_args>` under torchrun (this node's share of nproc ranks); the exit status of
    the job (first failing rank). Each rank gets an equal share of the cores unless OMP_NUM_THREADS
    is set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) * nodes.count // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["LOOMRL_NPROC_CHILD"] = "1"  # the launcher already refused an existing run folder
    try:
        return subprocess.call(torchrun_command(nproc, cli_args, nodes=nodes), env=env)
    except KeyboardInterrupt:  # torchrun forwards the signal; the ranks checkpoint and exit
        return 130


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join the default process group: from torchrun's environment, or a one-process group."""
    if dist.is_initialized():
        return
    # The engines' own collectives (stats, gradient sums, state gathers, Megatron's norm)
    # use CPU tensors, which NCCL refuses: on GPU machines CPU tensors go through gloo.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # NCCL's collectives run on this rank's GPU (placement.choose_device's)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if launched():
        dist.init_process_group(backend)
    else:  # one process: the environment a launcher would give it (DeepSpeed reads LOCAL_RANK)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def finish() -> None:
    """Leave the process group cleanly (without the barrier, gloo ranks sometimes abort at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
