"""`loomrl bench sync`: host memory (RSS) of the rollout weight sync from a sharded engine, the
whole model gathered at once against the weights streamed one tensor at a time, side by side.

After every optimizer step a DeepSpeed / Megatron / FSDP2 engine hands its full weights to the
policy the rollouts use (`Trainer.sync_policy`: `load_exported(policy, engine.export_weights())`).
The engines shard their weights over the ranks; the sync gathers them. Two ways, each run in its
own torchrun launch of `nproc` gloo ranks training a decoder of about `--hidden` x `--layers`
(~100M parameters by default) with the FSDP2 engine:

  full       the whole model gathered into a dict, then loaded (`load_state_dict`): a second
             full copy of the model lives beside the policy for the sync's length
  streamed   `load_exported`: each tensor all-gathered from its shards, copied into the policy
             and freed before the next (the engine's export is a generator)

Each rank resets its peak RSS (Linux: `/proc/self/clear_refs` 5) right before the sync and reads
VmHWM right after it: the figure is the peak over the sync minus the RSS before it, the most of
the ranks. Linux only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loomrl.platform import recipe as R
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.engines.base import load_exported
from loomrl.platform.engines.fsdp2_engine import FSDP2TrainEngine
from loomrl.platform.engines.launch import finish

log = logging.getLogger("loomrl")

MODES = ("full", "streamed")


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _worker(mode: str, hidden: int, layers: int, out: Path) -> None:
    """One rank of a torchrun launch: build the policy and an FSDP2 engine, sync once, write the
    figures (rank 0)."""
    torch.set_num_threads(1)
    r = R.Recipe()
    m = r.model
    m.hidden_size, m.num_layers, m.intermediate_size = hidden, layers, 4 * hidden
    m.num_heads, m.num_kv_heads = max(1, hidden // 64), max(1, hidden // 256)
    policy = build_policy(m, load_tokenizer(m.tokenizer), seed=0)
    r.training.engine, r.training.nproc = "fsdp2", int(os.environ["WORLD_SIZE"])
    engine = FSDP2TrainEngine(policy, r.training)
    del engine.optimizer  # nothing trains here
    params = sum(p.numel() for p in policy.parameters())
    decoder = sum(p.numel() for p in policy.language_model.parameters())
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    if mode == "full":
        state = dict(engine.export_weights())
        policy.load_state_dict(state, strict=False)
        del state
    else:
        load_exported(policy, engine.export_weights())
    peak = _status_kib("VmHWM") - before
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"params": params, "decoder": decoder, "peak_kib": max(peaks)}))
    finish()


def _launch(mode: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += ["-m", "loomrl.commands.bench_sync", "--worker", mode, str(out), str(args.hidden), str(args.layers)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"bench sync ({mode}) failed:\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="loomrl bench sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768, help="decoder width (default 768)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (default 12: ~100M parameters)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (gloo, default 2)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = ap.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        log.error("loomrl bench sync: needs Linux's /proc/self/clear_refs to reset the peak RSS")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        res = {mode: _launch(mode, args, Path(tmp) / f"{mode}.json") for mode in MODES}
    mib = {mode: res[mode]["peak_kib"] / 1024 for mode in MODES}
    model_mib = res["full"]["params"] * 4 / 2**20
    log.info(
        "[bench sync] %d ranks, %s parameters (decoder %s), FP32 %.0f MiB",
        args.nproc,
        f"{res['full']['params']:,}",
        f"{res['full']['decoder']:,}",
        model_mib,
    )
    for mode in MODES:
        share = mib[mode] / model_mib
        log.info("%-9s sync peak RSS over the policy: %7.1f MiB (%.2fx the model)", mode, mib[mode], share)
    log.info("streamed / full: %.3f", mib["streamed"] / max(mib["full"], 1e-9))
    if args.json:
        print(json.dumps({"model_mib": model_mib, **{f"{m}_peak_mib": mib[m] for m in MODES}, **res["full"]}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[3]))
    else:
        sys.exit(main(sys.argv[1:]))
