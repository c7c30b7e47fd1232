"""`loomrl bench staleness`: train-batch vs mini-batch admission on one simulated
disaggregated workload, same seed, side by side.

The clock is simulated; everything else is the real pipeline code: trajectories
go into `TrajectoryStore`, `admission.admit` decides what trains when, the
`Dispatcher` hands prompts to workers and re-queues a dead worker's prompts,
and `layout.media_transfer` counts the bytes each admitted mini-batch moves.

Assumptions (what the figures depend on):
- `workers` rollout workers; each generates one group (n samples of a prompt)
  at a time, with the newest weights the trainer has published when it starts.
  A group takes (longest sample's tokens) x (time per decode step); response
  lengths are log-normal (median `median_len`, sigma `sigma`, capped at
  `max_len`), the long tail of real RL responses.
- One trainer; an optimizer step takes (mini-batch tokens) / (trainer token
  rate), the rate being `trainer_speed` times the whole rollout fleet's token
  rate (a training forward+backward processes a sequence in parallel, decoding
  is sequential). Publishing weights is instantaneous.
- Workers never wait for the trainer (disaggregated), except that at most one
  train batch of finished groups may wait in the store (back-pressure).
- staleness = (policy version the trajectory's optimizer step applies to) -
  (version that generated it); the trainer version counts optimizer steps.
Under `train_batch` mini-batch k of a train batch is at least k steps stale, so
the mean grows with `mini_batches`; under `mini_batch` staleness comes only from
groups in flight while the trainer steps, about (workers + groups started during
a step) / groups per mini-batch. Fewer mini-batches per train batch, or more
workers in flight per mini-batch, shrink the gap.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from dataclasses import dataclass

import torch

from loomrl.encoders.media import Medium
from loomrl.platform.trajectory.admission import Quota, admit, staleness
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.dispatch import Dispatcher, Job
from loomrl.platform.trajectory.layout import media_transfer
from loomrl.platform.trajectory.store import TrajectoryStore


@dataclass
class Workload:
    workers: int = 4
    n: int = 8  # samples per prompt (group size)
    groups_per_mini_batch: int = 32
    mini_batches: int = 16  # per train batch (train batch = 512 prompts)
    train_batches: int = 4  # measured after one warm-up train batch
    prompt_len: int = 256
    median_len: float = 400.0
    sigma: float = 1.0
    max_len: int = 8192
    trainer_speed: float = 6.0  # trainer token rate / rollout fleet token rate
    image_bytes: int = 1024 * 1176 * 4  # a 448x448 image as Qwen2-VL patches (fp32)


def _lengths(rng: random.Random, w: Workload) -> list[int]:
    return [max(1, min(w.max_len, int(rng.lognormvariate(0.0, w.sigma) * w.median_len))) for _ in range(w.n)]


def _fleet_token_rate(w: Workload, seed: int) -> float:
    """Tokens per time unit the whole rollout fleet generates (decode step = 1 time unit)."""
    rng = random.Random(seed + 999)
    groups = [_lengths(rng, w) for _ in range(4000)]
    return w.workers * sum(sum(g) for g in groups) / sum(max(g) for g in groups)


def simulate(policy: str, w: Workload, seed: int = 0, deaths: dict[int, float] | None = None) -> dict:
    """Run the workload under one admission policy. deaths: worker -> simulated time it dies
    (its in-flight prompt is re-queued). Returns metrics plus the store and dispatcher."""
    rng = random.Random(seed)
    deaths = deaths or {}
    store = TrajectoryStore(w.n)
    disp = Dispatcher()
    quota = Quota(w.groups_per_mini_batch, w.mini_batches)
    train_rate = w.trainer_speed * _fleet_token_rate(w, seed)
    image = torch.zeros(1).expand(w.image_bytes // 4)  # its size counts, no memory behind it
    serial = iter(range(10**9))
    target_steps = w.mini_batches * (w.train_batches + 1)
    cap = w.groups_per_mini_batch * w.mini_batches  # finished groups allowed to wait

    def fresh(k: int) -> list[Job]:
        out = []
        for _ in range(k):
            i = next(serial)
            out.append(Job(f"p{i}", (f"prompt-{i}", Medium("image", f"img-{i}", image))))
        return out

    events: list = []  # (time, order, kind, payload)
    order = iter(range(10**12))
    version = 0
    now = 0.0
    idle_workers: list[int] = []

    def start(worker: int) -> None:
        if worker in disp.dead:
            return
        if len(store.ready) + disp.outstanding >= cap:
            idle_workers.append(worker)
            return
        job = disp.next_jobs(1, fresh)[0]
        disp.assign(worker, [job])
        lengths = _lengths(rng, w)
        heapq.heappush(events, (now + max(lengths), next(order), "done", (worker, job, lengths, version)))

    for wk in range(w.workers):
        start(wk)
    for wk, t in deaths.items():
        heapq.heappush(events, (t, next(order), "death", wk))

    trainer_busy_until = 0.0
    queue: list = []  # admitted mini-batches waiting for the trainer
    steps = 0
    measured_from = None  # time the first measured step starts
    busy = 0.0
    stale: list[int] = []
    waits: list[float] = []
    bytes_dedup: list[int] = []
    bytes_naive: list[int] = []

    def train_next() -> None:
        nonlocal trainer_busy_until, busy, measured_from
        groups = queue.pop(0)
        tokens = sum(g.tokens for g in groups)
        dt = tokens / train_rate
        measured = steps >= w.mini_batches
        if measured:
            if measured_from is None:
                measured_from = now
            busy += dt
            stale.extend(staleness(groups, version))
            waits.extend(g.admitted_at - g.ready_at for g in groups)
            trajs = [t for g in groups for t in g.trajectories]
            mt = media_transfer(trajs)
            token_bytes = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs) * 12  # ids + logp
            bytes_dedup.append(mt.bytes_dedup + token_bytes)
            bytes_naive.append(mt.bytes_naive + token_bytes)
        trainer_busy_until = now + dt
        heapq.heappush(events, (trainer_busy_until, next(order), "trained", groups))

    while steps < target_steps:
        if not events:
            raise RuntimeError("simulation stalled: every worker is dead")
        now, _, kind, payload = heapq.heappop(events)
        if kind == "done":
            worker, job, lengths, gen_version = payload
            if worker in disp.dead:
                continue  # it died before finishing; the prompt was re-queued
            disp.complete(worker, job.key)
            prompt_id, medium = job.prompt
            for L in lengths:
                store.put(
                    Trajectory(prompt_id, 0, [0] * w.prompt_len, [0] * L, [medium], [], 0.0, gen_version), job.key, now
                )
            start(worker)
        elif kind == "death":
            disp.worker_died(payload, "injected")
            for wk in list(idle_workers):
                idle_workers.remove(wk)
                start(wk)
        elif kind == "trained":
            store.mark_trained(payload)
            version += 1
            steps += 1
            for wk in list(idle_workers):  # back-pressure released
                idle_workers.remove(wk)
                start(wk)
        if now >= trainer_busy_until and not queue:
            queue += admit(store, policy, quota, version, now)
        if now >= trainer_busy_until and queue:
            train_next()
    total = now - measured_from
    return {
        "mean_staleness": sum(stale) / len(stale),
        "max_staleness": max(stale),
        "trainer_idle_frac": 1.0 - busy / total,
        "admission_wait_mean": sum(waits) / len(waits),
        "optimizer_steps": steps,
        "sim_time": now,
        "bytes_per_mini_batch": sum(bytes_dedup) / len(bytes_dedup),
        "bytes_per_mini_batch_no_dedup": sum(bytes_naive) / len(bytes_naive),
        "prompts_created": next(serial),
        "store": store,
        "dispatcher": disp,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="loomrl bench staleness", description=__doc__.split("\n\n")[0])
    w = Workload()
    for k, v in vars(w).items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    w = Workload(**{k: getattr(args, k) for k in vars(w)})
    res = {}
    for policy in ("train_batch", "mini_batch"):
        r = simulate(policy, w, args.seed)
        r["store"].check()
        r["dispatcher"].check()
        res[policy] = {k: v for k, v in r.items() if k not in ("store", "dispatcher")}
    tb, mb = res["train_batch"], res["mini_batch"]
    out = {
        "train_batch": {
            k: round(tb[k], 4) for k in ("mean_staleness", "max_staleness", "trainer_idle_frac", "admission_wait_mean")
        },
        "mini_batch": {
            k: round(mb[k], 4) for k in ("mean_staleness", "max_staleness", "trainer_idle_frac", "admission_wait_mean")
        },
        "staleness_reduction": round(1.0 - mb["mean_staleness"] / max(tb["mean_staleness"], 1e-12), 4),
        "bytes_per_mini_batch": {
            "dedup": round(mb["bytes_per_mini_batch"]),
            "no_dedup": round(mb["bytes_per_mini_batch_no_dedup"]),
            "ratio": round(mb["bytes_per_mini_batch_no_dedup"] / mb["bytes_per_mini_batch"], 2),
        },
    }
    if not args.json:
        print(
            f"workload: {w.workers} rollout workers, 1 trainer; train batch {w.groups_per_mini_batch * w.mini_batches} "
            f"prompts x {w.n} samples = {w.mini_batches} mini-batches of {w.groups_per_mini_batch} prompts; "
            f"response lengths log-normal (median {w.median_len:.0f}, sigma {w.sigma}, cap {w.max_len}); "
            f"trainer {w.trainer_speed}x the fleet's token rate; seed {args.seed}"
        )
        print(f"{'':14}{'train_batch':>14}{'mini_batch':>14}")
        for k in ("mean_staleness", "max_staleness", "trainer_idle_frac", "admission_wait_mean"):
            print(f"{k:<22}{tb[k]:>10.3f}{mb[k]:>14.3f}")
        print("(admission wait in simulated decode steps)")
        print(f"staleness reduction   {100 * out['staleness_reduction']:.1f}% (mini_batch vs train_batch)")
        b = out["bytes_per_mini_batch"]
        print(
            f"bytes per mini-batch  {b['dedup'] / 1e6:.1f} MB with media dedup, {b['no_dedup'] / 1e6:.1f} MB "
            f"without ({b['ratio']}x)"
        )
    print(json.dumps(out))
    return 0
