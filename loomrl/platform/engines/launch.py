"""Multi-process runs: torchrun, gloo on CPU, gloo + NCCL on GPU.

`loomrl run` re-executes itself under torchrun when a recipe asks for more than one
training process (`training.nproc`), so the user types one command. Every rank
then runs the same driver loop; `init_distributed` joins the process group that
torchrun's environment describes, or makes a one-process group when a
distributed engine (DeepSpeed, Megatron) runs in a single process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist


def launched() -> bool:
    """True inside a torchrun (or deepspeed-launcher) worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, cli_args: list[str], module: str = "loomrl.cli") -> list[str]:
    """The command that runs `python -m <module> <cli_args>` on nproc local processes
    (torchrun's default: no restarts)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *cli_args,
    ]


def launch(nproc: int, cli_args: list[str]) -> int:
    """Run `loomrl <cli_args>` under torchrun; the exit status of the job (first failing rank).
    Each rank gets an equal share of the cores unless OMP_NUM_THREADS is set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["LOOMRL_NPROC_CHILD"] = "1"  # the launcher already refused an existing run folder
    try:
        return subprocess.call(torchrun_command(nproc, cli_args), env=env)
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
