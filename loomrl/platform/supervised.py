"""The supervised steps of a run, a part of the Trainer (trainer.py): the SFT warm-up before RL
(`training.warmup`) and an SFT run's step (`algorithm.name: sft`): samples with answers -> one
optimizer step on the answer tokens. Mixed into `Trainer`, whose state (`self.model`, `self.prompts`,
`self.engine`, ...) these methods use."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from loomrl.datasets.demo import format_only_answer
from loomrl.platform import faults
from loomrl.platform import recipe as R
from loomrl.platform.algorithms.losses import sft_loss
from loomrl.platform.checkpoint import blame, save_checkpoint
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.metrics import MetricsLog
from loomrl.platform.run_state import Interrupted, NoLog, Phases, rl_lr, scheduled
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory, micro_batches

log = logging.getLogger("loomrl")


class SupervisedSteps:
    """The Trainer's supervised steps (see the module docstring)."""

    def warmup(self, start: int = 0, state: Optional[dict] = None, engine_state: Optional[dict] = None) -> None:
        """Supervised warm-up (SFT): `training.warmup.steps` optimizer steps on reference or
        format-only answers, before RL. A signal finishes the current step and writes a
        checkpoint of the warm-up (resumed from `start` with its `state`), as during RL."""

        r, model = self.recipe, self.model
        w = r.training.warmup
        # Format targets carry no information about the media: train only the language model,
        # so the encoders are not pushed around by gradients that are noise for them.
        params = [p for p in model.language_model.parameters() if p.requires_grad] if w.target == "format" else None
        engine = TorchTrainEngine(model, r.training, lr=w.lr, params=params)
        rng = random.Random(r.training.seed + 1)
        if state is not None:  # resumed inside the warm-up
            with blame(self.resume_from / "optimizer.pt"):
                engine.load_state_dict(engine_state["warmup_engine"])
                torch.set_rng_state(engine_state["torch_rng"])
            with blame(self.resume_from / "state.json"):
                self.prompts.load_state(state["data"])
                version, internal, gauss = state["warmup_rng"]
                rng.setstate((version, tuple(internal), gauss))
            self.rows_before(self.out / "warmup.jsonl", start)  # the steps after the checkpoint run again
            log.info("[run] resumed the warm-up from %s at step %d", self.resume_from, start)
        wlog = (
            MetricsLog(self.out, "warmup.jsonl", r.logging.tensorboard, prefix="warmup/", trackers=self.trackers)
            if self.writer
            else NoLog()
        )
        bar = tqdm(range(start, w.steps), desc="warm-up (SFT)", disable=not self.progress, dynamic_ncols=True)
        self.prompts.require_answer = w.target == "answer"
        try:
            with self.stop:
                for step in bar:
                    samples = self.prompts.next(w.batch_size)
                    targets = [
                        s.record["answer"] if w.target == "answer" else format_only_answer(s.record["meta"], rng)
                        for s in samples
                    ]
                    stats = engine.train_mini_batch(self.sft_batch(samples, targets), sft_loss)
                    wlog.log({"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"]})
                    bar.set_postfix(loss=f"{stats['loss']:.3f}")
                    if self.stop.requested:
                        raise Interrupted(step + 1, self.save_warmup(step + 1, engine, rng), "warm-up")
        finally:
            wlog.close()
            self.prompts.require_answer = self.sft and not self.preference

    def sft_batch(self, samples: list, targets: list[str]) -> list[MicroBatch]:
        """Micro-batches teaching each sample's target text, ended by the stop token (the chat
        template's end-of-turn, else EOS); the loss covers only these tokens, not the prompt. A
        multi-turn sample also teaches its earlier assistant turns (`multi_turn_trajectory`)."""
        model, trajs = self.model, []
        for s, text in zip(samples, targets):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [model.eos_token_id]
            if s.reply_mask is not None:
                trajs.append(self.multi_turn_trajectory(s, ids))
            else:
                trajs.append(Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0))
        return micro_batches(trajs, model.pad_token_id, self.recipe.training.micro_batch_size, device=model.device)

    @staticmethod
    def multi_turn_trajectory(s, target: list[int]) -> Trajectory:
        """A multi-turn sample as one sequence: its prompt (the rendered conversation) then `target`;
        the loss on every earlier assistant reply (`PromptSample.reply_mask`) and on `target`, the
        template's text and the user turns between the replies are context."""
        first = s.reply_mask.index(1)
        completion, trained = s.ids[first:] + target, s.reply_mask[first:] + [1] * len(target)
        return Trajectory(
            s.id, 0, s.ids[:first], completion, s.media, [0.0] * len(completion), 0.0, 0, completion_mask=trained
        )

    def sft_step(self, step: int) -> dict:
        """One supervised step (`algorithm.name: sft`): training.prompts_per_step samples with answers,
        one optimizer step of the run's engine on their answer tokens."""
        tr = self.recipe.training
        phases = Phases()
        t_step = time.perf_counter()
        faults.current_step = step
        if scheduled(tr):
            self.engine.set_lr(rl_lr(tr, step))
        with phases("admit"):
            samples = self.prompts.next(tr.prompts_per_step)
            mbs = self.sft_batch(samples, [s.record["answer"] for s in samples])
        with phases("train"):
            stats = self.engine.train_mini_batch(mbs, sft_loss)
            self.version += 1
        with phases("sync"):
            self.sync_policy()
        tokens = sum(int(mb.loss_mask.sum()) for mb in mbs)
        return {
            "step": step,
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "samples": len(samples),
            "answer_tokens": tokens,
            **{f"{name}_s": v for name, v in phases.seconds.items()},
            "step_s": time.perf_counter() - t_step,
            "policy_version": self.version,
        }

    def save_warmup(self, step: int, engine, rng) -> Path:
        """A checkpoint inside the warm-up: the policy, the warm-up optimizer, the data position."""
        state = {
            "step": 0,
            "version": 0,
            "warmup_step": step,
            "data": self.prompts.state(),
            "warmup_rng": list(rng.getstate()),
            "recipe": R.run_dict(self.recipe),
            "trajectories": {"generated": 0, "trained": 0, "dropped": 0, "dropped_by_reason": {}},
        }
        engine_state = {"warmup_engine": engine.state_dict(), "torch_rng": torch.get_rng_state()}
        if not self.writer:
            return self.out / "checkpoints" / "step-000000"
        return save_checkpoint(
            self.out / "checkpoints", 0, self.model, engine_state, state, keep_last=self.recipe.checkpoint.keep_last
        )
