"""Trajectory sources: where the trainer loop's admitted mini-batches come from.

The trainer (`loomrl.platform.trainer.Trainer`) runs one loop for every pipeline mode;
only its source differs:

    ColocatedSource     in-process generation. Every rank reads the step's prompts,
                        rolls out its own share (whole groups, prompts rank::world),
                        scores them, and the ranks exchange the trajectories so each
                        holds the whole step; then store + admission.
    WorkerSource        (disaggregated.py) rollout workers over the transport; the
                        trainer's rank 0 dispatches, receives, admits.
    FollowerSource      the other trainer ranks of a disaggregated run: rank 0
                        broadcasts each admitted mini-batch to them.

A source hands out admitted mini-batches (lists of trajectories, whole groups
contiguous, in training order): `admit` returns at least one, and every one it can
form now (the colocated source: the whole step). After each optimizer step the
trainer calls `weights_updated` (the disaggregated source sends weights at once);
`end_step` closes the step (the colocated source syncs its engine there) and returns
the rollout metrics of the step's row.

Exchanges between ranks carry JSON and raw tensors (`transport.pack`), never pickle.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from loomrl.encoders.media import Medium
from loomrl.platform import faults
from loomrl.platform.algorithms.dynamic_sampling import DynamicBooks, informative, next_round_prompts, split_groups
from loomrl.platform.algorithms.overlong import apply_overlong
from loomrl.platform.engines.base import check_rank_agreement, gather_rank_states, rank_state, world
from loomrl.platform.parts import sampling_params, to_prompts
from loomrl.platform.rewards.sources import score_parts
from loomrl.platform.trajectory.admission import admit_step
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.transport import pack, unpack


class WorkerDied(RuntimeError):
    """The source cannot go on (a rollout worker died, or the run was told to stop)."""


class TrajectorySource(Protocol):
    sync_every_update: bool
    """True: the trainer hands over its weights after every optimizer step (rollout workers);
    False: once per RL step, in end_step (colocated: nothing generates meanwhile)."""

    def admit(self, step: int, version: int) -> list[list[Trajectory]]:
        """Admitted mini-batches (>= 1) for the trainer at policy `version`, in training order."""

    def weights_updated(self, version: int) -> None:
        """The trainer's policy (its full rollout copy) now holds `version`."""

    def end_step(self, step: int, version: int) -> dict:
        """The step's rollout metrics (its row's rollout_s, tokens_per_s, ...)."""

    def accounting(self) -> dict:
        """Trajectory books: generated = trained + dropped + pending."""

    def state_dict(self) -> dict:
        """State for a checkpoint: plain values and tensors (collective)."""

    def load_state_dict(self, state: dict) -> None: ...

    def finish(self, error: Optional[str]) -> None:
        """The run is over (error: why it stopped early): settle what is in flight, close the books."""

    def report(self) -> dict:
        """Facts for summary.json (e.g. the dispatch books)."""

    def summary_lines(self) -> list[str]:
        """Lines for the run's summary."""

    def close(self) -> None: ...


# --------------------------------------------------------------------------- exchanges


def all_gather_json(obj, group=None) -> list:
    """Every rank's JSON-able `obj`, in rank order (collective)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = dist.get_world_size(group)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: data.numel()] = data
    bufs = [torch.zeros_like(buf) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(k)].tolist()).decode()) for b, k in zip(bufs, sizes)]


def broadcast_message(buf: Optional[torch.Tensor], src: int = 0, group=None) -> torch.Tensor:
    """A packed message (`transport.pack`) from rank `src` to every rank of `group`."""
    n = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    if buf is None:
        buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return buf


def pack_batches(batches: list[list[Trajectory]], meta: Optional[dict] = None) -> torch.Tensor:
    """Admitted mini-batches with their media (each distinct medium's features once)."""
    tensors: dict[str, torch.Tensor] = {}
    rows = []
    for b in batches:
        row = []
        for t in b:
            refs = []
            for m in t.media:
                name = f"{m.hash}:{m.prep}"
                refs.append([m.kind, m.hash, m.prep, m.seconds_per_grid])
                tensors.setdefault(name + "/features", m.features)
                if m.grid is not None:
                    tensors.setdefault(name + "/grid", m.grid)
            row.append(
                {
                    "prompt_id": t.prompt_id,
                    "group": t.group,
                    "prompt_ids": t.prompt_ids,
                    "completion_ids": t.completion_ids,
                    "logp": t.rollout_logprobs,
                    "reward": t.reward,
                    "version": t.version,
                    "parts": t.reward_parts,
                    "mask": t.completion_mask,
                    "media": refs,
                }
            )
        rows.append(row)
    return pack(dict(meta or {}, batches=rows), tensors)


def unpack_batches(buf: torch.Tensor) -> tuple[list[list[Trajectory]], dict]:
    meta, tensors = unpack(buf)
    media: dict[str, Medium] = {}

    def medium(kind: str, h: str, prep: str, seconds_per_grid: float = 0.0) -> Medium:
        name = f"{h}:{prep}"
        if name not in media:
            features, grid = tensors[name + "/features"], tensors.get(name + "/grid")
            media[name] = Medium(kind, h, features, grid, prep, seconds_per_grid)
        return media[name]

    batches = [
        [
            Trajectory(
                r["prompt_id"],
                r["group"],
                r["prompt_ids"],
                r["completion_ids"],
                [medium(*x) for x in r["media"]],
                r["logp"],
                r["reward"],
                r["version"],
                reward_parts=r["parts"],
                completion_mask=r.get("mask"),
            )
            for r in row
        ]
        for row in meta.pop("batches")
    ]
    return batches, meta


class NoRollouts:
    """A source with no rollouts of its own and nothing to account for: a supervised run
    (`algorithm.name: sft`), and the base of `FollowerSource`."""

    sync_every_update = False

    def admit(self, step: int, version: int) -> list[list[Trajectory]]:
        raise RuntimeError("this trajectory source has no rollouts")

    def weights_updated(self, version: int) -> None:
        pass

    def end_step(self, step: int, version: int) -> dict:
        return {}

    def accounting(self) -> dict:
        return {"generated": 0, "trained": 0, "dropped": 0, "pending": 0, "dropped_by_reason": {}}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def finish(self, error: Optional[str]) -> None:
        pass

    def report(self) -> dict:
        return {}

    def summary_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class FollowerSource(NoRollouts):
    """Trainer ranks > 0 of a disaggregated run: rank 0 (`LeaderSource`) broadcasts what
    it admits; a broadcast carrying `stop` ends the run here too. The books are rank 0's."""

    sync_every_update = True  # rank 0 sends weights after every update: the export is collective

    def __init__(self, group=None):
        self.group = group

    def admit(self, step: int, version: int) -> list[list[Trajectory]]:
        batches, meta = unpack_batches(broadcast_message(None, 0, self.group))
        if meta.get("stop"):
            raise WorkerDied(meta["stop"])
        return batches


class LeaderSource:
    """Trainer rank 0 of a disaggregated run with more than one trainer rank: what `inner`
    admits is broadcast to the others (`FollowerSource`)."""

    def __init__(self, inner, group=None):
        self.inner, self.group = inner, group

    def admit(self, step: int, version: int) -> list[list[Trajectory]]:
        try:
            batches = self.inner.admit(step, version)
        except Exception as e:
            broadcast_message(pack_batches([], {"stop": str(e) or type(e).__name__}), 0, self.group)
            raise
        broadcast_message(pack_batches(batches), 0, self.group)
        return batches

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- colocated


@dataclass
class Round:
    """One generation round of a colocated step (`ColocatedSource._round`): its samples and prompts,
    every rank's scored rows, their trajectories (sorted prompt by prompt), what each rank reported."""

    samples: list
    prompts: list
    trajs: list[Trajectory]
    rows: list["RolloutRow"]
    gathered: list[dict]
    draft_stats: object
    spec_metrics: dict
    compare: Optional[dict]

    def group_rewards(self) -> list[list[float]]:
        """Each prompt's rewards, in prompt order."""
        groups: dict[int, list[float]] = {}
        for t in self.trajs:
            groups.setdefault(t.group, []).append(t.reward)
        return [groups[k] for k in sorted(groups)]


@dataclass
class RolloutRow:
    """One scored rollout as the ranks exchange it (JSON): the prompt's index in the step, the
    sample's index in its group, the completion, its rollout log-probs and rewards."""

    prompt: int
    sample: int
    completion_ids: list
    logprobs: list
    reward: float
    finish_reason: str
    reward_parts: dict


class ColocatedSource:
    """In-process rollouts. Every rank reads the same `training.prompts_per_step` prompts,
    generates its share (prompts rank, rank + world, ...: whole groups), scores them, and
    the ranks all-gather the trajectories (token ids, log-probs, rewards: media are local,
    as every rank read the same prompts). A per-step digest check confirms every rank holds
    the same step."""

    sync_every_update = False

    def __init__(self, recipe, model, tokenizer, prompts, rollout, reward_fn, *, store, generator: torch.Generator):

        self.recipe, self.model, self.tokenizer = recipe, model, tokenizer
        self.prompts, self.rollout, self.reward_fn, self.store = prompts, rollout, reward_fn, store
        self.generator = generator
        self.params = sampling_params(recipe)
        self.rank, self.world = world()
        self.metrics: dict = {}
        self.last_prompts: list = []
        self.books = DynamicBooks()  # dynamic sampling's counts of the step

    def admit(self, step: int, version: int) -> list[list[Trajectory]]:
        """The step's rollouts (with dynamic sampling: as many rounds as it takes, up to its bound),
        scored, exchanged, into the store, and admitted as the step's mini-batches."""
        wanted = self.recipe.training.prompts_per_step
        ds = self.recipe.algorithm.dynamic_sampling
        rounds = [self._round(step, wanted, 0)]
        while ds.enabled and len(rounds) <= ds.max_rounds:
            so_far = [g for rd in rounds for g in rd.group_rewards()]
            kept = sum(informative(g, ds) for g in so_far)
            if kept >= wanted:
                break
            count = next_round_prompts(wanted, kept, len(so_far))
            count = -(-count // self.world) * self.world  # every rank generates its share
            rounds.append(self._round(step, count, len(so_far)))
        first = rounds[0]
        samples = [s for rd in rounds for s in rd.samples]
        trajs = [t for rd in rounds for t in rd.trajs]
        ranks_agree = check_rank_agreement(step, trajs)  # the exchange gave every rank the same step
        per_rank = [
            {k: sum(rd.gathered[i][k] for rd in rounds) for k in ("tokens", "seconds", "seq_forwards")}
            for i in range(len(first.gathered))
        ]
        rows = [row for rd in rounds for row in rd.rows]
        self.metrics = self._rollout_metrics(samples, trajs, rows, per_rank, ranks_agree)
        if self.rollout.drafter is not None:  # drafting figures of the step's first round
            self.metrics.update(self._drafting_metrics(first.draft_stats))
            if first.compare:
                self.metrics.update(first.compare)
        self.metrics.update(first.spec_metrics)  # vLLM's own speculative-decoding counters
        drops: dict[int, str] = {}
        if ds.enabled:
            rewards = [g for rd in rounds for g in rd.group_rewards()]
            _, drops = split_groups(rewards, ds, wanted, self.books)
            self.books.extra_rounds = len(rounds) - 1
            self.metrics.update(self.books.row())
        self.last_prompts = first.prompts
        admitted = admit_step(self.store, self.recipe, trajs, step, drops)
        batches = [[t for g in groups for t in g.trajectories] for groups in admitted]
        for groups in admitted:
            self.store.mark_trained(groups)
        return batches

    def _round(self, step: int, count: int, base: int) -> "Round":
        """One generation round: `count` more prompts of the step, this rank's share generated and
        scored, every rank's rows exchanged; their groups are numbered from `base` in the step."""
        samples = self.prompts.next(count)
        faults.maybe_die("rollout")
        prompts = to_prompts(samples)
        mine = list(range(self.rank, len(prompts), self.world))
        local = [prompts[i] for i in mine]
        self.generated_here = [p.id for p in local]  # this rank's share of the step's prompts
        result, compare = self._generate(step, local, first=base == 0)
        for r in result.rollouts:  # NgramRL: finished rollouts feed their prompt's draft history
            self.rollout.observe(local[r.prompt_index].id, r.completion_ids)
        draft_stats = copy.copy(self.rollout.last_stats)
        spec_metrics = dict(self.rollout.spec_metrics)
        gathered = all_gather_json(
            {
                "rows": [dataclasses.asdict(row) for row in self._scored_rows(result, samples, mine)],
                "tokens": result.tokens,
                "seconds": result.seconds,
                "seq_forwards": result.seq_forwards,
            }
        )
        rows = sorted((RolloutRow(**row) for g in gathered for row in g["rows"]), key=lambda r: (r.prompt, r.sample))
        trajs = [
            Trajectory(
                samples[row.prompt].id,
                base + row.prompt,
                samples[row.prompt].ids,
                row.completion_ids,
                samples[row.prompt].media,
                row.logprobs,
                row.reward,
                self.rollout.version,
                reward_parts=row.reward_parts,
            )
            for row in rows
        ]
        for t, row in zip(trajs, rows):  # DAPO's length shaping and truncation filter, when set
            apply_overlong(t, row.finish_reason, self.recipe.rollout.max_new_tokens, self.recipe.algorithm.overlong)
        return Round(samples, prompts, trajs, rows, gathered, draft_stats, spec_metrics, compare)

    def _generate(self, step: int, local: list, first: bool = True):
        """This rank's rollouts of its prompts; every `rollout.drafter.compare_every` steps (in the
        step's first round) the same
        prompts and weights also go through without drafting, timed (the order alternates, as the
        second call of a step finds the media encodings cached). Returns (result, comparison or None)."""
        every = self.recipe.rollout.drafter.compare_every
        compare_now = first and bool(every) and step % every == 0 and self.rollout.drafter is not None
        plain_first = compare_now and (step // every) % 2 == 0

        def plain_run():
            return self.rollout.generate_plain(local, self.params, torch.Generator(self.model.device).manual_seed(step))

        plain = plain_run() if plain_first else None
        result = self.rollout.generate(local, self.params, self.generator)
        if compare_now and not plain_first:
            plain = plain_run()
        if plain is None:
            return result, None
        return result, {
            "plain_tokens_per_s": plain.tokens / plain.seconds,
            "drafting_speedup": (result.tokens / result.seconds) / (plain.tokens / plain.seconds),
            "plain_forwards": plain.forwards,
            "drafted_forwards": result.forwards,
        }

    def _scored_rows(self, result, samples: list, mine: list[int]) -> list["RolloutRow"]:
        """This rank's rollouts, scored by the reward sources, as rows to exchange."""

        texts = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in result.rollouts]
        records = [samples[mine[r.prompt_index]].record for r in result.rollouts]
        totals, parts = score_parts(self.reward_fn, texts, records)
        return [
            RolloutRow(
                mine[r.prompt_index], r.sample_index, r.completion_ids, r.logprobs, float(reward), r.finish_reason, p
            )
            for r, reward, p in zip(result.rollouts, totals, parts)
        ]

    def _rollout_metrics(self, samples, trajs, rows, gathered, ranks_agree: bool) -> dict:
        """The step's rollout metrics over every rank's rollouts."""
        n = self.recipe.rollout.n
        tokens = sum(g["tokens"] for g in gathered)
        seconds = max(g["seconds"] for g in gathered)  # the ranks generate side by side
        metrics = {
            "trajectories": len(trajs),
            "response_len": tokens / len(trajs),
            "stop_rate": sum(row.finish_reason == "stop" for row in rows) / len(trajs),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "tokens_per_forward": tokens / max(1, sum(g["seq_forwards"] for g in gathered)),
            "rollout_s": seconds,
            "rollout_rank_sum_s": sum(g["seconds"] for g in gathered),
            "rollout_ranks": self.world,
            "media_total": sum(len(s.media) for s in samples) * n,
            "media_unique": len({m.hash for s in samples for m in s.media}),
        }
        if ranks_agree:
            metrics["rank_agreement"] = 1  # the ranks' trajectory digests were compared and equal
        return metrics

    def _drafting_metrics(self, ds) -> dict:
        return {
            "draft_acceptance": sum(ds.accepted_by_pos) / max(1, sum(ds.drafted_by_pos)),
            "draft_acceptance_by_pos": [round(a, 4) for a in ds.acceptance_by_position()],
            "drafter_lookup_us": 1e6 * ds.lookup_s / max(1, ds.lookups),
            "prefetch_coverage": ds.coverage,
            "drafter_history_tokens": self.rollout.drafter.history_tokens(),
        }

    def weights_updated(self, version: int) -> None:
        pass  # the engine is synced once per step, before it generates again (end_step)

    def end_step(self, step: int, version: int) -> dict:
        """Sync the rollout engine to the trained policy (colocated torch: shared module, a
        version bump; vLLM: streamed), then check vLLM against the trainer when asked."""
        self.rollout.update_weights(None, version)
        health = getattr(self.rollout, "sync_health", None)  # e.g. vLLM against the trainer after the sync
        if health is not None:
            self.metrics.update(health(step, self.model, self.last_prompts, self.params))
        return self.metrics

    def accounting(self) -> dict:
        return self.store.accounting()

    def state_dict(self) -> dict:
        """Every rank's rollout engine and sampling generator (collective); rank 0 gets them all."""

        local = {"rollout": self.rollout.state_dict(), "generator": self.generator.get_state()}
        return {"ranks": (gather_rank_states(local) or {}).get("ranks")}

    def load_state_dict(self, state: dict) -> None:

        mine = rank_state(state, "rollout state")
        self.rollout.load_state_dict(mine["rollout"])
        self.generator.set_state(mine["generator"])

    def finish(self, error: Optional[str]) -> None:
        self.store.check()

    def report(self) -> dict:
        return {}

    def summary_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        self.rollout.shutdown()
