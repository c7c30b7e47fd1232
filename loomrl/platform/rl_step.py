"""One RL step, a part of the Trainer (trainer.py), in its phases, each timed (`Phases`) into the
step's row as `<phase>_s`:

    admit     mini-batches of trajectories from the trajectory source (colocated: generated now;
              disaggregated: waiting for admission)
    prepare   the rollout/trainer mismatch of the first admission (every logging.mismatch_every
              steps, before training moves the weights); each admitted mini-batch laid out in
              micro-batches, then `prepare` on all of them at once: old and reference log-probs,
              values (value head or critic), advantages
    train     `update`: one optimizer step of the policy (and of the separate critic) per mini-batch,
              the epochs repeating the same mini-batches in the same order
    sync      the new weights to the rollout copy (`Trainer.sync_policy`) and to the source, after
              each update or once at the end of the step (the source's `sync_every_update`)

then `metrics_row` assembles the step's metrics.jsonl row. Mixed into `Trainer` (as `SupervisedSteps`
is for the SFT steps), whose state (`self.model`, `self.engine`, `self.source`, `self.version`, ...)
these methods use and whose `step` calls `rl_step` unless the algorithm is supervised."""

from __future__ import annotations

import hashlib
import time
from typing import Optional

import torch

from loomrl.encoders.cache import SharedEncodings
from loomrl.platform import faults
from loomrl.platform.algorithms.advantages import assign_advantages
from loomrl.platform.algorithms.critic import ValueHead
from loomrl.platform.algorithms.losses import critic_loss_fn, policy_loss_fn
from loomrl.platform.engines.base import allreduce_max
from loomrl.platform.engines.torch_engine import autocast
from loomrl.platform.mismatch import mismatch_metrics
from loomrl.platform.placement import TRANSFERS, memory_row
from loomrl.platform.rewards.base import PART
from loomrl.platform.run_state import Phases, StepTally, rl_lr, scheduled, value_metrics
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory
from loomrl.platform.trajectory.layout import layout


@torch.no_grad()
def fill_logprobs(
    model,
    mbs: list[MicroBatch],
    temperature: float,
    attr: Optional[str],
    value_head: Optional[ValueHead] = None,
    top_p: float = 1.0,
) -> None:
    """Set mb.<attr> to the model's log-probs; with value_head also mb.values from the same
    forward (attr None: only the values); with attr old_logp and top_p < 1 also mb.old_nucleus."""
    model.eval()
    encodings = None
    if model.cfg.encoders.dedup:  # every distinct medium of the batch once (cached if the rollout did it)
        encodings = model.encode_media([m for mb in mbs for row in mb.media for m in row])
    nucleus_p = top_p if attr == "old_logp" and temperature > 0 else 1.0
    for mb in mbs:
        out = model.sequence_logprobs(
            mb.input_ids,
            mb.attention_mask,
            mb.media,
            temperature,
            encodings,
            return_hidden=value_head is not None,
            top_p=nucleus_p,
        )
        if attr is not None:
            setattr(mb, attr, out[0])
        if nucleus_p < 1.0:
            mb.old_nucleus = out[-1]
        if value_head is not None:
            mb.values = value_head(out[2]).float()  # FP32 whatever the forward's precision


def reward_part_means(trajs: list, listed_sources: bool) -> dict[str, float]:
    """`reward_<name>_mean` of the step's trajectories: each reward source's score where there are
    several (or `algorithm.rewards` lists them), and every diagnostic part (`part:<name>`, rewards'
    `parts` trait) over the trajectories that have it (`slot_pitch`: the prompts with a sound)."""
    names = sorted({n for t in trajs for n in t.reward_parts})
    sources = [n for n in names if not n.startswith(PART)]
    out = {}
    if len(sources) > 1 or listed_sources:
        out = {f"reward_{n}_mean": sum(t.reward_parts[n] for t in trajs) / len(trajs) for n in sources}
    for n in names:
        if n.startswith(PART):
            have = [t.reward_parts[n] for t in trajs if n in t.reward_parts]
            out[f"reward_{n[len(PART) :]}_mean"] = sum(have) / len(have)
    return out


class RLSteps:
    """The Trainer's RL step (see the module docstring)."""

    @torch.no_grad()  # nothing prepared here needs gradients
    def prepare(self, queue: list[tuple[list[Trajectory], list[MicroBatch]]]) -> dict:
        """Old and reference log-probs, values and advantages of every mini-batch the source
        admitted together, before any of them is trained (the colocated source admits the
        whole step: pi_old is then the policy that generated it)."""
        a, ro = self.recipe.algorithm, self.recipe.rollout
        trajs = [t for ts, _ in queue for t in ts]
        mbs = [mb for _, m in queue for mb in m]
        head = self.value_head
        # the training forward's precision (training.precision), so ratios and KL compare like with like
        with autocast(self.recipe.training.precision, self.model):
            if a.epochs > 1 or len(queue) > 1:  # the policy moves before some tokens are trained on
                fill_logprobs(self.model, mbs, ro.temperature, "old_logp", head, ro.top_p)
            elif head is not None:
                fill_logprobs(self.model, mbs, ro.temperature, None, head)
            if self.critic is not None:
                with torch.no_grad():
                    self.critic.eval()
                    for mb in mbs:
                        mb.values = self.critic(mb).float()
            if self.ref_model is not None:
                fill_logprobs(self.ref_model, mbs, ro.temperature, "ref_logp")
        rewards = torch.tensor([t.reward for t in trajs])
        return assign_advantages(a, ro.n, rewards, trajs, mbs)

    def update(self, mbs: list[MicroBatch], loss_fn, shared, totals: dict, critic_totals: dict) -> None:
        """One optimizer step of the policy (and the separate critic) on a mini-batch."""
        for k, v in self.engine.train_mini_batch(mbs, loss_fn, shared).items():
            totals[k] = totals.get(k, 0.0) + v
        if self.critic_engine is not None:
            for k, v in self.critic_engine.train_mini_batch(mbs, critic_loss_fn(self.recipe)).items():
                critic_totals[k] = critic_totals.get(k, 0.0) + v
        self.version += 1

    def rl_step(self, step: int) -> dict:
        """One RL step (the module docstring): admit -> layout -> prepare -> train -> sync -> the row."""
        r, a, tr = self.recipe, self.recipe.algorithm, self.recipe.training
        phases = Phases()
        t_step = time.perf_counter()
        TRANSFERS.take()  # count this step's copies from here
        faults.current_step = step
        if scheduled(tr):  # a function of the step, so a resume sets it again
            self.engine.set_lr(rl_lr(tr, step))
        shared = (
            SharedEncodings(self.engine.model) if self.model.cfg.encoders.dedup and self.engine.supports_hook else None
        )
        loss_fn = policy_loss_fn(r, shared, self.value_head)
        tally = StepTally(phases)
        held: list[tuple[list[Trajectory], list[MicroBatch]]] = []
        queue: list[tuple[list[Trajectory], list[MicroBatch]]] = []
        mismatch: dict[str, float] = {}  # mismatch_<setting>_{mean,max,kl}: BF16 trainer forward vs rollout
        sync_each = self.source.sync_every_update
        while len(held) < tr.mini_batches:
            if not queue:
                with phases("admit"):  # colocated: generation; disaggregated: waiting for admission
                    batches = self.source.admit(step, self.version)
                if not held:  # the encoder work counted below is the trainer's, not the rollouts'
                    tally.enc_before = self.model.encode_totals.copy()
                if not 1 <= len(batches) <= tr.mini_batches - len(held):
                    raise RuntimeError(
                        f"RL step {step}: the trajectory source admitted {len(batches)} mini-batches "
                        f"where {tr.mini_batches - len(held)} remain to be trained"
                    )
                with phases("prepare"):
                    if r.logging.mismatch_every and step % r.logging.mismatch_every == 0 and not held:
                        # before training moves the weights
                        mismatch = mismatch_metrics(
                            self.model, [t for b in batches for t in b], r.rollout.temperature, r.rollout.top_p
                        )
                    queue = [
                        (
                            b,
                            layout(
                                b,
                                self.model.pad_token_id,
                                tr.micro_batch_size,
                                r.pipeline.tokens_per_micro_batch,
                                self.model.device,
                            ),
                        )
                        for b in batches
                    ]
                    for k, v in self.prepare(queue).items():
                        tally.adv_stats[k] = tally.adv_stats.get(k, 0.0) + v / tr.mini_batches * len(queue)
            trajs, mbs = queue.pop(0)
            with phases("train"):
                tally.staleness += [self.version - t.version for t in trajs]
                self.update(mbs, loss_fn, shared, tally.totals, tally.critic_totals)
            held.append((trajs, mbs))
            tally.trained.append(trajs)
            if sync_each:
                with phases("sync"):
                    self.sync_policy()
                    self.source.weights_updated(self.version)
        for _ in range(a.epochs - 1):  # PPO epochs: the same mini-batches again, same order
            for trajs, mbs in held:
                with phases("train"):
                    tally.staleness += [self.version - t.version for t in trajs]
                    self.update(mbs, loss_fn, shared, tally.totals, tally.critic_totals)
                if sync_each:
                    with phases("sync"):
                        self.sync_policy()
                        self.source.weights_updated(self.version)
        with phases("sync"):
            if not sync_each:
                self.sync_policy()
            tally.rollout_metrics = dict(self.source.end_step(step, self.version), **mismatch)
        return self.metrics_row(step, tally, loss_fn, time.perf_counter() - t_step)

    def metrics_row(self, step: int, tally: "StepTally", loss_fn, step_s: float) -> dict:
        """The step's metrics.jsonl row: what it trained on, the algorithm's statistics (summed over
        the mini-batches in `tally`), phase timings, encoder work, the source's rollout metrics."""
        trajs = [t for b in tally.trained for t in b]
        totals, phases, staleness = tally.totals, tally.phases, tally.staleness
        updates = self.recipe.training.mini_batches * self.recipe.algorithm.epochs
        rewards = torch.tensor([t.reward for t in trajs])
        tokens = max(1.0, totals["tokens"])
        prompt_ids = sorted({t.prompt_id for t in trajs})
        enc = self.model.encode_totals.since(tally.enc_before)  # the trainer's encoder work this step
        row = {
            "step": step,
            "trajectories_admitted": len(trajs),
            # which prompts this step trained on, so resumed and uninterrupted runs can be compared
            "prompt_digest": hashlib.sha1(" ".join(prompt_ids).encode()).hexdigest()[:16],
            "prompt_ids": prompt_ids,  # sorted: the admission order may vary between runs
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "loss": totals["loss"] / updates,
            "entropy": totals["entropy_sum"] / tokens,
            "clip_frac": totals["clipped_tokens"] / tokens,
            "logp_mismatch": totals["mismatch_sum"] / tokens,
            "grad_norm": totals["grad_norm"] / updates,
            "lr": rl_lr(self.recipe.training, step),
            **{f"{name}_s": s for name, s in phases.seconds.items()},  # admit_s, prepare_s, train_s, sync_s
            "step_s": step_s,
            "policy_version": self.version,
            "staleness_mean": sum(staleness) / len(staleness),  # 0 only with one mini-batch and one epoch
            "staleness_max": max(staleness),
            **enc.as_dict(),  # enc_media_total/unique, enc_calls, enc_bytes_*, enc_*_s, enc_cache_*
            "enc_cache_entries": len(self.model.encoding_cache),
            **TRANSFERS.take(),  # h2d_copies, h2d_mb, d2h_copies, d2h_mb: this step's host <-> device copies
            **memory_row(self.model.device),  # device_peak_mb on a GPU
        }
        row.update(tally.rollout_metrics)  # the source's: rollout_s (generation), tokens_per_s, drafting, ...
        if "trainer_idle_s" in row:  # disaggregated: the share of the step spent waiting for admission
            row["trainer_idle_frac"] = min(1.0, row["trainer_idle_s"] / max(step_s, 1e-9))
        if "kl_sum" in totals:
            row["kl"] = totals["kl_sum"] / tokens
        if "entropy_floor_sum" in totals:  # how far below algorithm.entropy_floor.target, token-weighted
            row["entropy_floor_gap"] = totals["entropy_floor_sum"] / tokens
        # importance correction: is the run on-policy? (ratio = pi_old under the trainer / pi_rollout)
        is_max = allreduce_max(loss_fn.maxima["is_ratio_max"])  # each rank saw only its micro-batches
        row.update(
            {
                "is_ratio_mean": totals["is_ratio_sum"] / tokens,
                "is_ratio_max": is_max,
                "is_clipped_frac": totals["is_clipped"] / tokens,
                "is_masked_frac": totals["is_masked"] / tokens,
                "is_outside_frac": totals["is_outside"] / tokens,  # outside [low, high], whatever the mode
                "rollout_kl": totals["is_kl"] / tokens,  # KL(rollout || trainer), k3 on the sampled tokens
            }
        )
        row.update(reward_part_means(trajs, bool(self.recipe.algorithm.rewards)))
        row.update(tally.adv_stats)
        row.update(value_metrics(totals, tally.critic_totals, tokens, updates))
        counts = self.counts()
        row.update({f"trajectories_{k}": v for k, v in counts.items() if k != "dropped_by_reason"})
        return row
