"""`loomrl bench encoders`: the naive and the dedup encoding path, side by side in one run.

A GRPO mini-batch of G groups x n samples on the demo model, by default the demo
recipe's shape (32 prompts x 8 samples, micro-batches of 64): prompts are demo
prompts (a third image only, a third audio only, a third both), each sampled n
times with its answer as the completion, cut into micro-batches of M samples
(gradient accumulation), so every medium sits in n samples across several
micro-batches.

- naive: every micro-batch runs its samples' media through the towers (every
  copy), and the backward of that micro-batch runs through the towers again.
- dedup: the mini-batch's distinct media are encoded once; each micro-batch's
  gradient for them is summed; one backward runs through the towers.

Encoder time is measured with the same per-placement output gradients for both
paths (random, fixed seed), so the towers' work is isolated from the backbone's;
the encoder parameter gradients of the two paths are compared as a check. The
whole mini-batch (towers + backbone + GRPO loss, the training engine's path) is
timed too. Repeats alternate naive and dedup; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from loomrl.datasets.demo import make_sample
from loomrl.encoders.base import load_medium
from loomrl.encoders.cache import SharedEncodings
from loomrl.encoders.media import Medium
from loomrl.platform.algorithms.losses import policy_loss_fn
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.recipe import ModelConfig, Recipe, TrainingConfig
from loomrl.platform.trajectory.batch import Trajectory, micro_batches


def build_mini_batch(model, tokenizer, groups: int, n: int, micro_batch_size: int, seed: int) -> list:
    """Micro-batches of one GRPO mini-batch of demo prompts (see the module docstring)."""

    rng = random.Random(seed)
    trajs = []
    for g in range(groups):
        rec = make_sample(g, rng)
        media = [load_medium(kind, data, model.cfg) for kind, _, data in rec["media"]]
        ids = model.prompt_ids(tokenizer, rec["prompt"], media)
        answer = tokenizer(rec["answer"], add_special_tokens=False)["input_ids"] + [model.eos_token_id]
        for _ in range(n):
            trajs.append(
                Trajectory(rec["id"], g, ids, answer, media, [0.0] * len(answer), 0.0, 0, advantage=rng.gauss(0.0, 1.0))
            )
    return micro_batches(trajs, model.pad_token_id, micro_batch_size, device=model.device)


def count_tower_inputs(model) -> dict[str, int]:
    """Media actually entering each tower, counted by forward hooks on the towers."""
    counts = {"image": 0, "audio": 0}

    def images(module, args, kwargs):
        counts["image"] += len(kwargs["grid_thw"])

    def clips(module, args):
        counts["audio"] += args[0].shape[0]

    if model.visual is not None:
        model.visual.register_forward_pre_hook(images, with_kwargs=True)
    if model.audio_tower is not None:
        model.audio_tower.register_forward_pre_hook(clips)
    return counts


def encoder_pass(model, mbs: list, cotangents: list[list[torch.Tensor]], dedup: bool) -> tuple[float, float]:
    """Towers forward + backward for one mini-batch, given each placement's output gradient.
    Returns (forward seconds, backward seconds); parameter gradients accumulate."""
    fwd = bwd = 0.0
    if not dedup:
        for mb, grads in zip(mbs, cotangents):
            media = [m for row in mb.media for m in row]
            t0 = time.perf_counter()
            encodings, _ = model.encode(media, dedup=False)
            t1 = time.perf_counter()
            torch.autograd.backward(encodings, grads)
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
        return fwd, bwd
    media = [m for mb in mbs for row in mb.media for m in row]
    t0 = time.perf_counter()
    encodings, _ = model.encode(media)
    t1 = time.perf_counter()
    summed: dict = {}
    for m, g in zip(media, [g for grads in cotangents for g in grads]):
        summed[m.key] = summed[m.key] + g if m.key in summed else g
    keys = list(encodings)
    torch.autograd.backward([encodings[k] for k in keys], [summed[k] for k in keys])
    return t1 - t0, time.perf_counter() - t1


def encoder_grads(model) -> dict[str, torch.Tensor]:
    towers = ("visual.", "audio_tower.", "audio_projector.")
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith(towers) and p.grad is not None}


def train_pass(model, engine, mbs: list, loss_factory, dedup: bool) -> float:
    """One mini-batch through the training engine (towers + backbone + loss + step)."""
    model.cfg.encoders.dedup = dedup
    shared = SharedEncodings(model) if dedup else None
    t0 = time.perf_counter()
    engine.train_mini_batch(mbs, loss_factory(shared), shared)
    return time.perf_counter() - t0


def run(groups: int, n: int, micro_batch_size: int, repeats: int, seed: int) -> dict:

    tokenizer = load_tokenizer("demo")
    model = build_policy(ModelConfig(), tokenizer, seed)
    mbs = build_mini_batch(model, tokenizer, groups, n, micro_batch_size, seed)
    placements: list[Medium] = [m for mb in mbs for row in mb.media for m in row]
    unique = {m.key: m for m in placements}
    gen = torch.Generator().manual_seed(seed)
    cotangents = [
        [torch.randn(model.media_tokens(m), model.cfg.hidden_size, generator=gen) for row in mb.media for m in row]
        for mb in mbs
    ]
    counts = count_tower_inputs(model)

    calls, grads, enc_times, grad_diff = {}, {}, {"naive": [], "dedup": []}, 0.0
    for rep in range(repeats + 1):  # repeat 0 warms up and is not timed
        for path in ("naive", "dedup"):
            model.zero_grad(set_to_none=True)
            counts.update(image=0, audio=0)
            fwd, bwd = encoder_pass(model, mbs, cotangents, dedup=path == "dedup")
            calls[path] = counts["image"] + counts["audio"]
            grads[path] = encoder_grads(model)
            if rep:
                enc_times[path].append((fwd, bwd))
        scale = max(float(g.abs().max()) for g in grads["naive"].values())
        grad_diff = max(
            grad_diff, max(float((grads["naive"][k] - grads["dedup"][k]).abs().max()) for k in grads["naive"]) / scale
        )

    # lr 0: every repeat trains the same weights
    engine = TorchTrainEngine(model, TrainingConfig(lr=0.0))
    train_times = {"naive": [], "dedup": []}
    for rep in range(repeats + 1):
        for path in ("naive", "dedup"):
            t = train_pass(model, engine, mbs, lambda shared: policy_loss_fn(Recipe(), shared), path == "dedup")
            if rep:
                train_times[path].append(t)

    def median(path: str, part: int | None = None) -> float:
        values = [f + b if part is None else (f, b)[part] for f, b in enc_times[path]]
        return statistics.median(values)

    result = {
        "groups": groups,
        "n": n,
        "micro_batch_size": micro_batch_size,
        "micro_batches": len(mbs),
        "samples": sum(len(mb.media) for mb in mbs),
        "repeats": repeats,
        "media_total": len(placements),
        "media_unique": len(unique),
        "images_unique": sum(m.kind == "image" for m in unique.values()),
        "audio_unique": sum(m.kind == "audio" for m in unique.values()),
        "calls_naive": calls["naive"],
        "calls_dedup": calls["dedup"],
        "calls_ratio": calls["naive"] / max(1, calls["dedup"]),
        "bytes_naive": sum(m.nbytes for m in placements),
        "bytes_dedup": sum(m.nbytes for m in unique.values()),
        "encoder_fwd_s_naive": median("naive", 0),
        "encoder_fwd_s_dedup": median("dedup", 0),
        "encoder_bwd_s_naive": median("naive", 1),
        "encoder_bwd_s_dedup": median("dedup", 1),
        "encoder_s_naive": median("naive"),
        "encoder_s_dedup": median("dedup"),
        "train_s_naive": statistics.median(train_times["naive"]),
        "train_s_dedup": statistics.median(train_times["dedup"]),
        "encoder_grad_max_rel_diff": grad_diff,
        "target_encoder_speedup": 0.8 * n,
    }
    result["bytes_ratio"] = result["bytes_naive"] / max(1, result["bytes_dedup"])
    result["encoder_speedup"] = result["encoder_s_naive"] / result["encoder_s_dedup"]
    result["train_speedup"] = result["train_s_naive"] / result["train_s_dedup"]
    result["calls_ok"] = calls["naive"] == n * calls["dedup"] and calls["dedup"] == len(unique)
    result["speedup_ok"] = result["encoder_speedup"] >= result["target_encoder_speedup"]
    return result


def table(r: dict) -> str:
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    rows = [
        (
            "encoder calls (media through a tower)",
            str(r["calls_naive"]),
            str(r["calls_dedup"]),
            f"{r['calls_ratio']:.2f}x",
        ),
        ("feature bytes moved to the towers", mb(r["bytes_naive"]), mb(r["bytes_dedup"]), f"{r['bytes_ratio']:.2f}x"),
        (
            "encoder forward (ms)",
            ms(r["encoder_fwd_s_naive"]),
            ms(r["encoder_fwd_s_dedup"]),
            f"{r['encoder_fwd_s_naive'] / r['encoder_fwd_s_dedup']:.2f}x",
        ),
        (
            "encoder backward (ms)",
            ms(r["encoder_bwd_s_naive"]),
            ms(r["encoder_bwd_s_dedup"]),
            f"{r['encoder_bwd_s_naive'] / r['encoder_bwd_s_dedup']:.2f}x",
        ),
        (
            "encoder forward+backward (ms)",
            ms(r["encoder_s_naive"]),
            ms(r["encoder_s_dedup"]),
            f"{r['encoder_speedup']:.2f}x",
        ),
        (
            "mini-batch train step, all model (ms)",
            ms(r["train_s_naive"]),
            ms(r["train_s_dedup"]),
            f"{r['train_speedup']:.2f}x",
        ),
    ]
    w = max(len(x[0]) for x in rows)
    lines = [
        f"encoders bench: {r['groups']} groups x {r['n']} samples = {r['samples']} samples, "
        f"{r['micro_batches']} micro-batches of <= {r['micro_batch_size']}, median of {r['repeats']} repeats",
        f"media: {r['media_total']} placements, {r['media_unique']} distinct "
        f"({r['images_unique']} images, {r['audio_unique']} clips)",
        f"{'':{w}}  {'naive':>10}  {'dedup':>10}  {'ratio':>7}",
        *[f"{a:{w}}  {b:>10}  {c:>10}  {d:>7}" for a, b, c, d in rows],
        f"calls ratio = group size ({r['n']}): {'yes' if r['calls_ok'] else 'NO'}; "
        f"encoder speedup {r['encoder_speedup']:.2f}x vs target >= {r['target_encoder_speedup']:.1f}x: "
        f"{'met' if r['speedup_ok'] else 'NOT met'}",
        f"encoder gradients, naive vs dedup: max |diff| / max |grad| = {r['encoder_grad_max_rel_diff']:.1e}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loomrl bench encoders", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--groups",
        type=int,
        default=32,
        help="prompts (GRPO groups) in the mini-batch (default 32, the demo's prompts_per_step)",
    )
    p.add_argument("--n", type=int, default=8, help="samples per group (default 8, the demo's rollout.n)")
    p.add_argument(
        "--micro-batch", type=int, default=64, help="samples per micro-batch (default 64, the demo's micro_batch_size)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per path (default 5)")
    p.add_argument("--seed", type=int, default=0)
    # The demo towers are tiny: extra intra-op threads add little but make timings on a
    # shared machine swing; both paths always run with the same setting.
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = p.parse_args(argv)
    if min(args.groups, args.n, args.micro_batch, args.repeats) < 1:
        p.error("--groups, --n, --micro-batch and --repeats must be >= 1")
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        r = run(args.groups, args.n, args.micro_batch, args.repeats, args.seed)
    finally:
        torch.set_num_threads(threads)  # when called in-process (tests), leave torch as it was
    print(table(r))
    if args.json:
        print(json.dumps(r))
    # Timing is machine-dependent and only reported; wrong call counts or gradients are errors.
    return 0 if r["calls_ok"] and r["encoder_grad_max_rel_diff"] < 1e-4 else 1
