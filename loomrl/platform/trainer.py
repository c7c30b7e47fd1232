"""The trainer: one loop for every pipeline mode, rollout engine, training engine and
algorithm. It owns the run's state and hands work to its parts, with a fixed lifecycle:

    trainer = Trainer(recipe, out)
    trainer.setup()       torch settings, tokenizer and chat format, policy, prompts, validation
                          split, rewards, warm-up (SFT) or a checkpoint, reference model, critic,
                          training engine, and the trajectory source (colocated rollouts or
                          rollout workers)
    trainer.train()       steps until training.steps (or --max-steps), checkpoints
      validate()            every validation.every steps and at the end: greedy completions of
                            the held-out prompts, scored by the run's rewards (`val_*`)
      step(s)               RL: admitted mini-batches from the source -> layout -> old / reference
                            log-probs, values -> advantages -> the engine's optimizer steps
                            (weights to the source after each) -> the step's metrics row
                            SFT (`algorithm.name: sft`): samples with answers -> one optimizer
                            step on the answer tokens (the warm-up before RL runs this code too)
      save(s)               atomic checkpoint of every part's state
    trainer.close()       the source (rollout engine, workers), logs

Where rollouts come from is the source's business (`trajectory/sources.py`): everything
after admission is written once, here. Every phase of a step is timed the same way
(`Phases`) and lands in the row as `<phase>_s`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from loomrl.platform import faults
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.advantages import assign_advantages
from loomrl.platform.algorithms.critic import ValueHead, build_critic
from loomrl.platform.algorithms.losses import critic_loss_fn, policy_loss_fn
from loomrl.platform.checkpoint import blame, check_run_state, load_checkpoint, load_extra_model, save_checkpoint
from loomrl.platform.engines.base import allreduce_max, load_exported, world
from loomrl.platform.engines.torch_engine import autocast
from loomrl.platform.metrics import MetricsLog, read_metrics
from loomrl.platform.parts import configure_torch, shard_files
from loomrl.platform.placement import TRANSFERS, memory_row
from loomrl.platform.run_state import (  # noqa: F401 (re-exported: the trainer's public names)
    Interrupted,
    NoLog,
    Phases,
    RunResult,
    StepTally,
    StopRequest,
    goal_check,
    machine,
    rl_lr,
    scheduled,
    value_metrics,
)
from loomrl.platform.supervised import SupervisedSteps
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory
from loomrl.platform.trajectory.layout import layout
from loomrl.platform.validation import Validation

log = logging.getLogger("loomrl")


@torch.no_grad()
def fill_logprobs(
    model, mbs: list[MicroBatch], temperature: float, attr: Optional[str], value_head: Optional[ValueHead] = None
) -> None:
    """Set mb.<attr> to the model's log-probs; with value_head also mb.values from the same
    forward (attr None: only the values)."""
    model.eval()
    encodings = None
    if model.cfg.encoders.dedup:  # every distinct medium of the batch once (cached if the rollout did it)
        encodings = model.encode_media([m for mb in mbs for row in mb.media for m in row])
    for mb in mbs:
        out = model.sequence_logprobs(
            mb.input_ids, mb.attention_mask, mb.media, temperature, encodings, return_hidden=value_head is not None
        )
        if attr is not None:
            setattr(mb, attr, out[0])
        if value_head is not None:
            mb.values = value_head(out[2]).float()  # FP32 whatever the forward's precision


class Trainer(SupervisedSteps, Validation):
    """One run of a recipe into `out` (see the module docstring for the lifecycle).

    resume_from: a checkpoint folder to continue from exactly. max_steps: stop (with a
    checkpoint) once this many RL steps are done in total. source: the trajectory source of
    a disaggregated run (built by `disaggregated.py`); None builds the colocated one."""

    def __init__(
        self,
        recipe: R.Recipe,
        out: Path,
        resume_from: Optional[Path] = None,
        max_steps: Optional[int] = None,
        source_factory=None,
    ):
        self.recipe, self.out, self.resume_from, self.max_steps = recipe, out, resume_from, max_steps
        self.source_factory = source_factory
        self.rank, self.world = world()
        self.writer = self.rank == 0  # rank 0 alone writes the run folder
        self.step_count = 0  # RL steps done (the next step's index)
        self.version = 0  # optimizer steps applied to the policy
        self.rows: list[dict] = []
        self.base_counts = {"generated": 0, "trained": 0, "dropped": 0, "dropped_by_reason": {}}
        self.ref_model = self.value_head = self.critic = self.critic_engine = None
        self.extra_models: dict = {}
        self.source = None
        self.log = None
        self.stop = StopRequest()  # SIGINT/SIGTERM: finish the step, checkpoint, stop
        self.algorithm = ALGORITHMS.get(recipe.algorithm.name)  # its traits: supervised, advantages
        self.sft = bool(self.algorithm.trait("supervised"))
        self.val_samples: list = []
        self.validations: list[dict] = []  # {"step", "val_*"}: every validation of this run, in order

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        from loomrl.platform.engines import build_engine
        from loomrl.platform.parts import build_policy_parts, prompt_source
        from loomrl.platform.rewards.sources import build_sources

        r, out = self.recipe, self.out
        self.t0 = time.perf_counter()
        configure_torch(r.training)
        files = shard_files(r)
        self.tokenizer, self.chat, self.model = build_policy_parts(r)
        model = self.model
        self.freeze_parts(model)
        model.set_activation_checkpointing(r.training.activation_checkpointing)
        self.prompts = prompt_source(r, files, model, self.tokenizer, self.chat)
        self.prompts.require_answer = self.sft
        self.reward_fn = build_sources(r.algorithm, next(model.parameters()).device)
        self.val_samples = self.validation_split()
        self.describe(files)
        self.progress = r.logging.progress and sys.stderr.isatty()

        ckpt_state = engine_state = None
        warmup_from: Optional[int] = 0  # the warm-up step to start at; None: a checkpoint of the RL stage
        if self.resume_from is not None:
            engine_state, ckpt_state = load_checkpoint(self.resume_from, model)  # verified, or ValueError
            if ckpt_state.get("recipe") != R.to_dict(r):
                raise ValueError(f"{self.resume_from / 'state.json'}: was written by another recipe")
            warmup_from = ckpt_state.get("warmup_step")
        if self.writer:  # only once the checkpoint (if any) was accepted: a refused resume writes nothing
            out.mkdir(parents=True, exist_ok=True)
            (out / "recipe.yaml").write_text(R.dump(r))
            if self.resume_from is None:
                for name in ("metrics.jsonl", "warmup.jsonl"):
                    (out / name).unlink(missing_ok=True)
        if warmup_from is not None and warmup_from < r.training.warmup.steps:
            self.warmup(warmup_from, ckpt_state if self.resume_from is not None else None, engine_state)

        if r.algorithm.kl_coef > 0 and not self.sft:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.algorithm.trait("advantages") == "critic":  # PPO: a value model
            self.build_value_model()
        params = [p for p in model.parameters() if p.requires_grad]
        params += list(self.value_head.parameters()) if self.value_head is not None else []
        self.engine = build_engine(r, model, params)
        if self.sft:
            from loomrl.platform.trajectory.sources import NoRollouts

            self.source = NoRollouts()
        else:
            self.source = self.build_source()
        if ckpt_state is not None and warmup_from is None:
            self.load_state_dict(ckpt_state, engine_state)
        self.log = MetricsLog(out, "metrics.jsonl", r.logging.tensorboard) if self.writer else NoLog()

    def describe(self, files: list) -> None:
        """The run's opening lines: data, model, stages, chat format, mode, folder; parts; validation."""
        r, model = self.recipe, self.model
        n_params = sum(p.numel() for p in model.parameters())
        stages = (
            f"{r.training.steps} SFT steps"
            if self.sft
            else f"{r.training.warmup.steps} warm-up + {r.training.steps} RL steps"
        )
        log.info(
            "[run] %s: %d shard(s), model %.2fM params on %s, %s, %s, %s -> %s",
            r.name,
            len(files),
            n_params / 1e6,
            model.device,
            stages,
            self.chat.describe(),
            r.pipeline.mode,
            self.out,
        )
        log.info(
            "[run] %s%s",
            model.describe_parts(),
            ", activation checkpointing" if r.training.activation_checkpointing else "",
        )
        if self.val_samples:
            log.info(
                "[run] validation: %d held-out prompt(s) from %s, every %d steps and at the end",
                len(self.val_samples),
                r.validation.shards,
                r.validation.every,
            )

    def build_value_model(self) -> None:
        """PPO's value model: a value head trained with the policy by its optimizer, or a separate
        critic (the policy's weights right after set-up, its own engine and optimizer)."""
        from loomrl.platform.backbone.vlm import build_policy
        from loomrl.platform.engines.torch_engine import TorchTrainEngine

        r, model, ppo = self.recipe, self.model, self.recipe.algorithm.ppo
        if ppo.critic == "value_head":
            self.value_head = ValueHead(model.language_model.cfg.hidden_size).to(model.device)
            self.extra_models["value_head"] = self.value_head
            return
        # the critic's weights are the policy's right after: no need to read init_from again
        fresh = dataclasses.replace(r.model, init_from=None)
        self.critic = build_critic(model, lambda: build_policy(fresh, self.tokenizer, r.training.seed).to(model.device))
        self.critic.body.set_activation_checkpointing(r.training.activation_checkpointing)
        self.critic_engine = TorchTrainEngine(self.critic, r.training, lr=ppo.critic_lr)
        self.extra_models["critic"] = self.critic

    def freeze_parts(self, model) -> None:
        """training.freeze on the policy (model.encoders.frozen was applied when it was built): a
        part the model does not have, or nothing left to train, is a RecipeError naming the key."""
        freeze = self.recipe.training.freeze
        try:
            model.freeze(freeze)
        except ValueError as e:
            raise R.RecipeError(str(e)) from None
        if not any(p.requires_grad for p in model.parameters()):
            also = ", with model.encoders.frozen," if self.recipe.model.encoders.frozen else ""
            raise R.RecipeError(
                f"training.freeze: {freeze}{also} freezes every part this model has "
                f"({', '.join(model.parameter_parts())}); nothing would train"
            )

    def build_source(self):
        from loomrl.platform.rollout import build_rollout_engine
        from loomrl.platform.trajectory.sources import ColocatedSource
        from loomrl.platform.trajectory.store import TrajectoryStore

        if self.source_factory is not None:
            return self.source_factory(self)
        generator = torch.Generator(self.model.device).manual_seed(self.recipe.training.seed + 1000 * self.rank)
        return ColocatedSource(
            self.recipe,
            self.model,
            self.tokenizer,
            self.prompts,
            build_rollout_engine(self.recipe, self.model),
            self.reward_fn,
            store=TrajectoryStore(self.recipe.rollout.n),
            generator=generator,
        )

    # ------------------------------------------------------------------ validation

    @torch.no_grad()

    # ------------------------------------------------------------------ one RL step

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
                fill_logprobs(self.model, mbs, ro.temperature, "old_logp", head)
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

    def sync_policy(self) -> None:
        """DeepSpeed / Megatron train their own copy: its full HF-layout weights -> the policy
        the rollouts use (collective on every trainer rank)."""
        if self.engine.model is not self.model:
            load_exported(self.model, self.engine.export_weights())

    def step(self, step: int) -> dict:
        if self.sft:
            return self.sft_step(step)
        from loomrl.encoders.cache import SharedEncodings

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
                        from loomrl.platform.mismatch import mismatch_metrics  # before training moves the weights

                        mismatch = mismatch_metrics(self.model, [t for b in batches for t in b], r.rollout.temperature)
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
        # importance correction: is the run on-policy? (ratio = pi_old under the trainer / pi_rollout)
        is_max = allreduce_max(loss_fn.maxima["is_ratio_max"])  # each rank saw only its micro-batches
        row.update(
            {
                "is_ratio_mean": totals["is_ratio_sum"] / tokens,
                "is_ratio_max": is_max,
                "is_clipped_frac": totals["is_clipped"] / tokens,
                "is_masked_frac": totals["is_masked"] / tokens,
            }
        )
        names = sorted({n for t in trajs for n in t.reward_parts})
        if len(names) > 1 or self.recipe.algorithm.rewards:
            row.update({f"reward_{n}_mean": sum(t.reward_parts[n] for t in trajs) / len(trajs) for n in names})
        row.update(tally.adv_stats)
        row.update(value_metrics(totals, tally.critic_totals, tokens, updates))
        counts = self.counts()
        row.update({f"trajectories_{k}": v for k, v in counts.items() if k != "dropped_by_reason"})
        return row

    # ------------------------------------------------------------------ the run

    def counts(self) -> dict:
        """This run's trajectory books on top of the checkpoint's."""
        acc, base = self.source.accounting(), self.base_counts
        reasons = dict(base["dropped_by_reason"])
        for k, v in acc.get("dropped_by_reason", {}).items():
            reasons[k] = reasons.get(k, 0) + v
        return {
            "generated": base["generated"] + acc["generated"],
            "trained": base["trained"] + acc["trained"],
            "dropped": base["dropped"] + acc["dropped"],
            "pending": acc.get("pending", 0),
            "dropped_by_reason": reasons,
        }

    def train(self) -> RunResult:
        from tqdm import tqdm

        from loomrl.platform.rewards import RewardError
        from loomrl.platform.trajectory.sources import WorkerDied

        r, ck = self.recipe, self.recipe.checkpoint
        # The drafter allocates many small containers per step, which triggers full garbage
        # collections; each would walk every object the imports and the model created (~0.2 s
        # pauses). Freeze those: they live for the whole run.
        gc.collect()
        gc.freeze()
        end = r.training.steps if self.max_steps is None else min(self.max_steps, r.training.steps)
        bar = tqdm(
            range(self.step_count, end), desc=r.algorithm.name.upper(), disable=not self.progress, dynamic_ncols=True
        )
        stop = self.stop
        error = None
        validating = bool(self.val_samples) and self.writer
        # the handlers stay in place while the run settles: a scheduler's (or torchrun's) SIGTERM then
        # finds the final checkpoint being written instead of killing the process half way
        with stop:
            try:
                for step in bar:
                    val = self.validate(step) if validating and step % r.validation.every == 0 else {}
                    row = {**self.step(step), **val}
                    self.step_count = step + 1
                    self.rows.append(row)
                    self.log.log(row)
                    self.show(bar, row, end)
                    if stop.requested:
                        raise Interrupted(step + 1, self.save())
                    if ck.every and self.step_count % ck.every == 0 and self.step_count < end:
                        self.save()
            except (WorkerDied, RewardError) as e:  # the step is abandoned; the run stops with a checkpoint
                error = str(e)
            if error is None:  # the checkpoint holds the rollout side's state, so save before it stops
                path = self.save()
                self.source.finish(None)
            else:  # what is in flight is settled (re-queued, counted) first; dead workers hold no state
                self.source.finish(error)
                path = self.save()
        finished = self.step_count == r.training.steps and error is None
        if finished and validating and not (self.validations and self.validations[-1]["step"] == self.step_count):
            self.validate(self.step_count)  # the policy the run ends with
        goal_met, goal_text = goal_check(self.rows, r.goal, self.validations) if finished else (None, "")
        wall = time.perf_counter() - self.t0
        summary = self.summarize(wall, path, goal_text, error)
        if self.writer:
            (self.out / "summary.json").write_text(
                json.dumps(
                    {
                        "steps": self.step_count,
                        "wall_s": wall,
                        "goal_met": goal_met,
                        "goal": goal_text,
                        "error": error,
                        "machine": machine(),
                        "skipped_samples": self.prompts.state()["skipped"],
                        "trajectories": self.counts(),
                        "validation": self.validations,
                        "checkpoint": str(path),
                        **self.source.report(),
                    },
                    indent=1,
                )
            )
        return RunResult(self.out, self.rows, goal_met, summary, error)

    def show(self, bar, row: dict, end: int) -> None:
        """The progress bar's figures, or (without a terminal) a log line every 10 steps."""
        step, key = row["step"], "loss" if self.sft else "reward_mean"
        recent = self.rows[-10:]
        bar.set_postfix(
            {key.removesuffix("_mean"): f"{row[key]:.3f}", "avg10": f"{sum(x[key] for x in recent) / len(recent):.3f}"}
        )
        if self.progress or not self.writer or not (step % 10 == 0 or step == end - 1):
            return
        if self.sft:
            log.info(
                "[step %4d] loss %.4f  grad norm %.3f  step %.2fs", step, row["loss"], row["grad_norm"], row["step_s"]
            )
            return
        extra = (
            f"  staleness {row['staleness_mean']:.2f} (max {row['staleness_max']})"
            if self.recipe.pipeline.mode == "disaggregated"
            else ""
        )
        log.info(
            "[step %4d] reward %.3f  loss %+.4f  %.0f tok/s  step %.2fs%s",
            step,
            row["reward_mean"],
            row["loss"],
            row.get("tokens_per_s", 0.0),
            row["step_s"],
            extra,
        )

    def run(self) -> RunResult:
        """setup -> train -> close."""
        try:
            self.setup()
            return self.train()
        finally:
            self.close()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.source is not None:
            self.source.close()

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        """Checkpoint at the current RL step (collective: every rank's engine and rollout state)."""
        path = self.out / "checkpoints" / f"step-{self.step_count:06d}"
        counts = self.counts()
        # trajectories not yet trained are lost to a resume from here: its books say so
        lost = counts.pop("pending")
        counts["dropped"] += lost
        if lost:
            counts["dropped_by_reason"]["lost_at_resume"] = counts["dropped_by_reason"].get("lost_at_resume", 0) + lost
        state = {
            "step": self.step_count,
            "version": self.version,
            "data": self.prompts.state(),
            "trajectories": counts,
            "recipe": R.to_dict(self.recipe),
        }
        engine_state = {
            "engine": self.engine.state_dict() or {},
            "torch_rng": torch.get_rng_state(),
            "source": self.source.state_dict(),
        }
        if self.critic_engine is not None:
            engine_state["critic"] = self.critic_engine.state_dict()
        extra = dict(self.extra_models, **({"ref_model": self.ref_model} if self.ref_model is not None else {}))
        if not self.writer:  # the state_dict() calls above were collective; rank 0 saves what it gathered
            return path
        # the rollout copy of the policy is what is saved: sync it from a DeepSpeed/Megatron engine
        return save_checkpoint(
            self.out / "checkpoints",
            self.step_count,
            self.model,
            engine_state,
            state,
            keep_last=self.recipe.checkpoint.keep_last,
            extra_models=extra or None,
        )

    def load_state_dict(self, state: dict, engine_state: dict) -> None:
        """Continue from a checkpoint (weights already loaded into the policy); a saved state that
        does not fit this run is a ValueError naming its file."""
        check_run_state(state, engine_state, self.resume_from, critic=self.critic_engine is not None)
        with blame(self.resume_from / "optimizer.pt"):
            self.engine.load_state_dict(engine_state["engine"])
            torch.set_rng_state(engine_state["torch_rng"])
            self.source.load_state_dict(engine_state["source"])
        with blame(self.resume_from / "state.json"):
            self.prompts.load_state(state["data"])
        self.base_counts = state["trajectories"]
        self.step_count, self.version = state["step"], state["version"]
        if self.ref_model is not None:
            load_extra_model(self.resume_from, "ref_model", self.ref_model)
        for name, m in self.extra_models.items():
            load_extra_model(self.resume_from, name, m)
        if self.critic_engine is not None:
            with blame(self.resume_from / "optimizer.pt"):
                self.critic_engine.load_state_dict(engine_state["critic"])
        # the steps after the checkpoint will be run again: drop their rows
        self.rows = self.rows_before(self.out / "metrics.jsonl", self.step_count)
        self.validations = [
            {"step": row["step"], **{k: v for k, v in row.items() if k.startswith("val_")}}
            for row in self.rows
            if "val_reward_mean" in row
        ]
        log.info("[run] resumed from %s at RL step %d", self.resume_from, self.step_count)

    def rows_before(self, path: Path, step: int) -> list[dict]:
        """The rows of a metrics file below `step`; rank 0 rewrites the file with only those
        (atomically), so a resumed run's file reads as if it had never stopped."""
        rows = [row for row in read_metrics(path) if row["step"] < step] if path.exists() else []
        if self.writer:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
            tmp.replace(path)
        return rows

    # ------------------------------------------------------------------ summary

    def summarize(self, wall: float, ckpt: Path, goal_text: str, error: Optional[str]) -> str:
        r, rows = self.recipe, self.rows
        lines = [
            f"== loomrl run '{r.name}' ({r.pipeline.mode}, {r.rollout.engine} rollouts, "
            f"{r.training.engine} engine x {self.world}) done in {wall:.0f}s =="
        ]
        mean = lambda k: sum(x.get(k, 0.0) for x in rows) / len(rows)  # noqa: E731
        if rows and self.sft:
            lines.append(
                f"SFT steps       {len(rows)}  ({mean('step_s'):.2f}s/step), loss first {rows[0]['loss']:.4f}  "
                f"last {rows[-1]['loss']:.4f}, {mean('answer_tokens'):.0f} answer tokens/step"
            )
        elif rows:
            lines += [
                f"RL steps        {len(rows)}  ({mean('step_s'):.2f}s/step: rollout {mean('rollout_s'):.2f}s, "
                f"train {mean('train_s'):.2f}s)",
                f"reward          first {rows[0]['reward_mean']:.3f}  last {rows[-1]['reward_mean']:.3f}  "
                f"best {max(x['reward_mean'] for x in rows):.3f}",
                f"rollout         {mean('tokens_per_s'):.0f} tokens/s, {mean('response_len'):.1f} tokens/response, "
                f"stop rate {rows[-1].get('stop_rate', 0.0):.2f}",
                f"on-policy       mean |rollout - trainer logp| {mean('logp_mismatch'):.2e}",
                f"staleness       mean {mean('staleness_mean'):.2f}, max {max(x['staleness_max'] for x in rows)}",
            ]
            if rows[-1].get("rollout_ranks", 1) > 1:
                lines.append(
                    f"rollout ranks   {rows[-1]['rollout_ranks']}, each its share of the prompts: "
                    f"{mean('rollout_s'):.2f}s per step (the ranks' generation summed: "
                    f"{mean('rollout_rank_sum_s'):.2f}s)"
                )
        if self.validations:
            shown = sorted({0, *range(max(0, len(self.validations) - 3), len(self.validations))})
            lines.append(
                "validation      reward "
                + "  ".join(
                    f"step {self.validations[i]['step']}: {self.validations[i]['val_reward_mean']:.3f}" for i in shown
                )
            )
        if goal_text:
            lines.append(goal_text)
        skipped = self.prompts.state()["skipped"]
        if skipped:
            lines.append(f"skipped samples {skipped} (see warnings above)")
        c = self.counts()
        if not self.sft:
            lines.append(
                f"trajectories    generated {c['generated']} = trained {c['trained']} + dropped "
                f"{c['dropped']} {c['dropped_by_reason'] or ''}+ pending {c['pending']}"
            )
        lines += self.source.summary_lines()
        tensorboard = "tensorboard/, " if r.logging.tensorboard else ""
        lines += [
            f"outputs         {self.out}/metrics.jsonl, {tensorboard}{ckpt.relative_to(self.out)}",
            f"plot            loomrl report {self.out}",
        ]
        if error:
            lines.append(f"error: {error}; run stopped at step {self.step_count} with checkpoint {ckpt}")
        elif self.step_count < r.training.steps:
            lines.append(
                f"stopped at step {self.step_count} of {r.training.steps} (--max-steps); continue with --resume"
            )
        return "\n".join(lines)
