"""`loomrl bench attention`: the `vllm` attention region with vLLM's own kernel called
(`backbone/vllm_kernels.py`, the default where vLLM is installed) against its torch arithmetic
alone (`LOOMRL_VLLM_KERNELS=0`), side by side in one process.

`model.rounding: auto` with vLLM rollouts is `vllm`, so the kernel call is on by default and must not
make the trainer slower. A decoder in BF16 under the `vllm` setting runs the trainer's two kinds of
forward on one padded batch (rows left- and right-padded as the trainer lays them out):

  no-grad           the old and reference log-probs: the kernel replaces the torch arithmetic
  forward+backward  the loss: the kernel's values forward, the torch arithmetic beside it for the
                    gradient, so this costs the kernel call on top of what it did before

Rounds alternate kernel / torch (after one warm-up each); the figures are medians and
`torch / kernel` (above 1: the kernel is faster). Shapes: `demo` (the demo's decoder and batch) and
`qwen2-0.5b` (Qwen2-0.5B's attention shapes, 2 layers, 8 rows of 256 tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from loomrl.platform.backbone import vllm_kernels
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig
from loomrl.platform.backbone.rounding import SETTINGS

log = logging.getLogger(__name__)

SHAPES = {
    # name: (rows, tokens, hidden, layers, heads, kv heads, intermediate)
    "demo": (64, 40, 64, 2, 2, 1, 128),
    "qwen2-0.5b": (8, 256, 896, 2, 14, 2, 4864),
}


def _batch(rows: int, tokens: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    real = torch.ones(rows, tokens, dtype=torch.bool)
    for r in range(rows):  # prompts left-padded, completions right-padded, by different amounts
        real[r, : r % 9] = False
        real[r, tokens - r % 5 :] = False
    return ids, (real.long().cumsum(-1) - 1).clamp(min=0), real


def measure(shape: str, rounds: int) -> dict:
    rows, tokens, hidden, layers, heads, kv, inter = SHAPES[shape]
    if vllm_kernels.attention_isa(hidden // heads) is None:
        raise SystemExit("loomrl bench attention: vLLM's CPU attention kernel does not load here (vLLM not installed?)")
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=256, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, intermediate_size=inter
    )
    dec = Decoder(cfg).to(torch.bfloat16)
    dec.cfg.rounding = SETTINGS["vllm"]
    ids, pos, real = _batch(rows, tokens, 256)
    kernel = vllm_kernels.attention

    def once(use_kernel: bool, grad: bool) -> float:
        vllm_kernels.attention = kernel if use_kernel else (lambda *a: None)
        try:
            t0 = time.perf_counter()
            if grad:
                dec.zero_grad()
                dec(dec.embed(ids), pos, real)[0].float().sum().backward()
            else:
                with torch.no_grad():
                    dec(dec.embed(ids), pos, real)
            return time.perf_counter() - t0
        finally:
            vllm_kernels.attention = kernel

    out = {"shape": shape, "isa": vllm_kernels.attention_isa(hidden // heads), "rounds": rounds}
    for name, grad in (("no_grad", False), ("forward_backward", True)):
        once(True, grad), once(False, grad)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for use in (True, False):
                times[use].append(once(use, grad))
        k, t = statistics.median(times[True]), statistics.median(times[False])
        out[name] = {"kernel_ms": round(k * 1e3, 3), "torch_ms": round(t * 1e3, 3)}
        out[name]["torch_over_kernel"] = round(t / k, 3)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="loomrl bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.rounds < 1:
        print(f"loomrl bench attention: unknown shape {unknown} or --rounds < 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = [measure(s, args.rounds) for s in shapes]
    for r in results:
        for name in ("no_grad", "forward_backward"):
            m = r[name]
            log.info(
                "%-11s %-16s kernel %8.2f ms  torch %8.2f ms  torch/kernel %.2f  (%s, %d rounds)",
                r["shape"], name, m["kernel_ms"], m["torch_ms"], m["torch_over_kernel"], r["isa"], r["rounds"],
            )  # fmt: skip
    if args.json:
        print(json.dumps(results))
    return 0
