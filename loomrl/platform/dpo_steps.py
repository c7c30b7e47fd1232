"""The preference steps of a run (`algorithm.name: dpo`), a part of the Trainer (trainer.py), in the
SFT step's shape (no rollouts): training.prompts_per_step pairs -> micro-batches of whole pairs
(`training.micro_batch_size` pairs each: their chosen rows, then their rejected rows, one forward) ->
the frozen reference's log-probs of every row -> one optimizer step of the run's engine on the DPO
loss (algorithms/dpo.py). Validation adds the held-out pairs' figures (`pair_figures`). Mixed into
`Trainer`, whose state (`self.model`, `self.ref_model`, `self.prompts`, `self.engine`, ...) these
methods use."""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from loomrl.platform import faults
from loomrl.platform.algorithms.dpo import answer_logps
from loomrl.platform.engines.torch_engine import autocast
from loomrl.platform.rl_step import fill_logprobs
from loomrl.platform.run_state import Phases, rl_lr, scheduled
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory, collate, split

log = logging.getLogger("loomrl")


class PreferenceSteps:
    """The Trainer's DPO step and held-out pair figures (see the module docstring)."""

    def answer_trajectory(self, s, text: str) -> Trajectory:
        """The sample's prompt (a multi-turn sample: its whole conversation) then `text` ended by the
        stop token; only the answer's tokens are scored."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.model.eos_token_id]
        return Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0)

    def pair_batches(self, samples: list) -> list[MicroBatch]:
        """Micro-batches of whole pairs, chosen rows first then the rejected rows in the same order;
        each micro-batch's loss is divided by the pairs of the whole list (`mb.sequences`)."""
        model, mbs = self.model, []
        for chunk in split(samples, self.recipe.training.micro_batch_size):
            rows = [self.answer_trajectory(s, s.record[side]) for side in ("chosen", "rejected") for s in chunk]
            mbs.append(collate(rows, model.pad_token_id, model.device))
        tokens = float(max(1, sum(t.trained_tokens() for mb in mbs for t in mb.trajectories)))
        for mb in mbs:
            mb.normaliser, mb.sequences = tokens, len(samples)
        return mbs

    def reference_logprobs(self, mbs: list[MicroBatch], attr: str = "ref_logp", model=None) -> None:
        """mb.<attr>: the frozen reference's per-token log-probs (or `model`'s), in the training
        forward's precision."""
        model = self.ref_model if model is None else model
        with autocast(self.recipe.training.precision, model):
            fill_logprobs(model, mbs, 1.0, attr)

    def dpo_step(self, step: int) -> dict:
        """One DPO step: training.prompts_per_step pairs, the reference's log-probs, one optimizer step
        of the run's engine on their mean DPO loss."""
        tr = self.recipe.training
        phases = Phases()
        t_step = time.perf_counter()
        faults.current_step = step
        if scheduled(tr):
            self.engine.set_lr(rl_lr(tr, step))
        with phases("admit"):
            samples = self.prompts.next(tr.prompts_per_step)
            mbs = self.pair_batches(samples)
        with phases("prepare"):
            self.reference_logprobs(mbs)
        with phases("train"):
            stats = self.engine.train_mini_batch(mbs, self.algorithm.obj(self.recipe.algorithm.dpo))
            self.version += 1
        with phases("sync"):
            self.sync_policy()
        n = max(1.0, stats["pairs"])
        ids = sorted(s.id for s in samples)
        return {
            "step": step,
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "pairs": len(samples),
            "dpo_reward_chosen": stats["reward_chosen_sum"] / n,
            "dpo_reward_rejected": stats["reward_rejected_sum"] / n,
            "dpo_margin": stats["margin_sum"] / n,
            "dpo_accuracy": stats["correct"] / n,
            "logp_chosen": stats["logp_chosen_sum"] / n,
            "logp_rejected": stats["logp_rejected_sum"] / n,
            "answer_tokens": int(stats["tokens"]),
            "prompt_digest": hashlib.sha1(" ".join(ids).encode()).hexdigest()[:16],
            "lr": rl_lr(tr, step),
            **{f"{name}_s": v for name, v in phases.seconds.items()},
            "step_s": time.perf_counter() - t_step,
            "policy_version": self.version,
        }

    @torch.no_grad()
    def pair_figures(self) -> dict[str, float]:
        """The held-out pairs (the validation split) under the current policy and the reference:
        `val_dpo_margin` (mean implicit reward margin beta h), `val_dpo_accuracy` (share of pairs with
        h > 0) and `val_logp_gap` (mean log pi(chosen) - log pi(rejected), the policy alone)."""
        beta, hs, gaps = self.recipe.algorithm.dpo.beta, [], []
        for chunk in split(self.val_samples, self.recipe.validation.batch_size):
            mbs = self.pair_batches(chunk)
            self.reference_logprobs(mbs, "old_logp", self.model)
            self.reference_logprobs(mbs)
            for mb in mbs:
                pi, ref = answer_logps(mb.old_logp, mb.loss_mask), answer_logps(mb.ref_logp, mb.loss_mask)
                k = pi.shape[0] // 2
                gaps.append(pi[:k] - pi[k:])
                hs.append(gaps[-1] - (ref[:k] - ref[k:]))
        h, gap = torch.cat(hs).double(), torch.cat(gaps).double()
        return {
            "val_dpo_margin": float(beta * h.mean()),
            "val_dpo_accuracy": float((h > 0).double().mean()),
            "val_logp_gap": float(gap.mean()),
        }
