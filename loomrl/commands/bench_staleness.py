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

The code: `simulate` runs one `Simulation`, whose methods are the event loop's steps (a worker
starts a group, a group finishes, a worker dies, the trainer admits, trains and measures a
mini-batch); `main` runs both policies on one workload and prints them side by side.
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


class Simulation:
    """One run of the workload under one admission policy: the event loop's state and its steps.

    Events are (time, order, kind, payload) on a heap: "done" (a worker finished a group),
    "death" (a worker dies, its prompt re-queued), "trained" (an optimizer step ended). After
    each, the trainer, when free, admits and trains the next mini-batch."""

    def __init__(self, policy: str, w: Workload, seed: int, deaths: dict[int, float]) -> None:
        self.policy, self.w = policy, w
        self.rng = random.Random(seed)
        self.store = TrajectoryStore(w.n)
        self.disp = Dispatcher()
        self.quota = Quota(w.groups_per_mini_batch, w.mini_batches)
        self.train_rate = w.trainer_speed * _fleet_token_rate(w, seed)
        self.image = torch.zeros(1).expand(w.image_bytes // 4)  # its size counts, no memory behind it
        self.serial = iter(range(10**9))
        self.target_steps = w.mini_batches * (w.train_batches + 1)
        self.cap = w.groups_per_mini_batch * w.mini_batches  # finished groups allowed to wait
        self.events: list = []  # (time, order, kind, payload)
        self.order = iter(range(10**12))
        self.version = 0
        self.now = 0.0
        self.idle_workers: list[int] = []
        for wk in range(w.workers):
            self._start(wk)
        for wk, t in deaths.items():
            heapq.heappush(self.events, (t, next(self.order), "death", wk))
        self.trainer_busy_until = 0.0
        self.queue: list = []  # admitted mini-batches waiting for the trainer
        self.steps = 0
        self.measured_from: float | None = None  # time the first measured step starts
        self.busy = 0.0
        self.stale: list[int] = []
        self.waits: list[float] = []
        self.bytes_dedup: list[int] = []
        self.bytes_naive: list[int] = []

    def _fresh(self, k: int) -> list[Job]:
        out = []
        for _ in range(k):
            i = next(self.serial)
            out.append(Job(f"p{i}", (f"prompt-{i}", Medium("image", f"img-{i}", self.image))))
        return out

    def _start(self, worker: int) -> None:
        """The worker takes the next prompt, unless it is dead or back-pressure holds it idle."""
        if worker in self.disp.dead:
            return
        if len(self.store.ready) + self.disp.outstanding >= self.cap:
            self.idle_workers.append(worker)
            return
        job = self.disp.next_jobs(1, self._fresh)[0]
        self.disp.assign(worker, [job])
        lengths = _lengths(self.rng, self.w)
        event = (worker, job, lengths, self.version)
        heapq.heappush(self.events, (self.now + max(lengths), next(self.order), "done", event))

    def _restart_idle(self) -> None:
        for wk in list(self.idle_workers):
            self.idle_workers.remove(wk)
            self._start(wk)

    def _train_next(self) -> None:
        groups = self.queue.pop(0)
        tokens = sum(g.tokens for g in groups)
        dt = tokens / self.train_rate
        if self.steps >= self.w.mini_batches:  # measured: after the warm-up train batch
            self._measure(groups, dt)
        self.trainer_busy_until = self.now + dt
        heapq.heappush(self.events, (self.trainer_busy_until, next(self.order), "trained", groups))

    def _measure(self, groups: list, dt: float) -> None:
        if self.measured_from is None:
            self.measured_from = self.now
        self.busy += dt
        self.stale.extend(staleness(groups, self.version))
        self.waits.extend(g.admitted_at - g.ready_at for g in groups)
        trajs = [t for g in groups for t in g.trajectories]
        mt = media_transfer(trajs)
        token_bytes = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs) * 12  # ids + logp
        self.bytes_dedup.append(mt.bytes_dedup + token_bytes)
        self.bytes_naive.append(mt.bytes_naive + token_bytes)

    def _handle(self, kind: str, payload) -> bool:
        """Apply one event; False: a group finished by a worker that had died (nothing changed)."""
        if kind == "done":
            worker, job, lengths, gen_version = payload
            if worker in self.disp.dead:
                return False  # it died before finishing; the prompt was re-queued
            self.disp.complete(worker, job.key)
            prompt_id, medium = job.prompt
            for L in lengths:
                traj = Trajectory(prompt_id, 0, [0] * self.w.prompt_len, [0] * L, [medium], [], 0.0, gen_version)
                self.store.put(traj, job.key, self.now)
            self._start(worker)
        elif kind == "death":
            self.disp.worker_died(payload, "injected")
            self._restart_idle()
        elif kind == "trained":
            self.store.mark_trained(payload)
            self.version += 1
            self.steps += 1
            self._restart_idle()  # back-pressure released
        return True

    def run(self) -> dict:
        while self.steps < self.target_steps:
            if not self.events:
                raise RuntimeError("simulation stalled: every worker is dead")
            self.now, _, kind, payload = heapq.heappop(self.events)
            if not self._handle(kind, payload):
                continue
            if self.now >= self.trainer_busy_until and not self.queue:
                self.queue += admit(self.store, self.policy, self.quota, self.version, self.now)
            if self.now >= self.trainer_busy_until and self.queue:
                self._train_next()
        return self._result()

    def _result(self) -> dict:
        total = self.now - self.measured_from
        return {
            "mean_staleness": sum(self.stale) / len(self.stale),
            "max_staleness": max(self.stale),
            "trainer_idle_frac": 1.0 - self.busy / total,
            "admission_wait_mean": sum(self.waits) / len(self.waits),
            "optimizer_steps": self.steps,
            "sim_time": self.now,
            "bytes_per_mini_batch": sum(self.bytes_dedup) / len(self.bytes_dedup),
            "bytes_per_mini_batch_no_dedup": sum(self.bytes_naive) / len(self.bytes_naive),
            "prompts_created": next(self.serial),
            "store": self.store,
            "dispatcher": self.disp,
        }


def simulate(policy: str, w: Workload, seed: int = 0, deaths: dict[int, float] | None = None) -> dict:
    """Run the workload under one admission policy. deaths: worker -> simulated time it dies
    (its in-flight prompt is re-queued). Returns metrics plus the store and dispatcher."""
    return Simulation(policy, w, seed, deaths or {}).run()


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
