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
      step(s)               RL (`rl_step.py`): admitted mini-batches from the source -> layout ->
                            old / reference log-probs, values -> advantages -> the engine's
                            optimizer steps (weights to the source after each) -> the step's
                            metrics row
                            SFT (`supervised.py`, `algorithm.name: sft`): samples with answers ->
                            one optimizer step on the answer tokens (the warm-up before RL runs
                            this code too)
                            DPO (`dpo_steps.py`, `algorithm.name: dpo`): preference pairs -> the
                            frozen reference's log-probs -> one optimizer step on the DPO loss
      save(s)               atomic checkpoint of every part's state
    trainer.close()       the source (rollout engine, workers), logs

Where rollouts come from is the source's business (`trajectory/sources.py`): everything
after admission is written once, in `rl_step.py`. Every phase of a step is timed the same
way (`Phases`) and lands in the row as `<phase>_s`. The Trainer is assembled from mixins, one
idea each: `SupervisedSteps` (supervised.py), `PreferenceSteps` (dpo_steps.py), `RLSteps`
(rl_step.py), `Validation` (validation.py); the run's bookkeeping types are in run_state.py.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.critic import ValueHead, build_critic
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.checkpoint import (
    SHARDED,
    blame,
    check_run_state,
    load_checkpoint,
    load_extra_model,
    save_checkpoint,
    stage,
)
from loomrl.platform.dpo_steps import PreferenceSteps
from loomrl.platform.engines import build_engine
from loomrl.platform.engines.base import load_exported, world
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.metrics import MetricsLog, read_metrics
from loomrl.platform.parts import build_policy_parts, check_pairs, configure_torch, prompt_source, shard_files
from loomrl.platform.rewards import RewardError
from loomrl.platform.rewards.remote import RewardInterrupted
from loomrl.platform.rewards.sources import build_sources
from loomrl.platform.rl_step import RLSteps
from loomrl.platform.rollout import build_rollout_engine
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
from loomrl.platform.trackers import Trackers
from loomrl.platform.trajectory.sources import ColocatedSource, NoRollouts, WorkerDied
from loomrl.platform.trajectory.store import TrajectoryStore
from loomrl.platform.validation import Validation

log = logging.getLogger("loomrl")


class Trainer(SupervisedSteps, PreferenceSteps, RLSteps, Validation):
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
        self.trackers: Optional[Trackers] = None  # rank 0's wandb / MLflow runs (shared by the warm-up and RL logs)
        self.stop = StopRequest()  # SIGINT/SIGTERM: finish the step, checkpoint, stop
        self.algorithm = ALGORITHMS.get(recipe.algorithm.name)  # its traits: supervised, advantages
        self.sft = bool(self.algorithm.trait("supervised"))  # no rollouts: SFT or DPO
        self.preference = bool(self.algorithm.trait("preference"))  # DPO: pairs and a frozen reference
        self.val_samples: list = []
        self.validations: list[dict] = []  # {"step", "val_*"}: every validation of this run, in order

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:

        r, out = self.recipe, self.out
        self.t0 = time.perf_counter()
        configure_torch(r.training)
        files = shard_files(r)
        if self.preference:
            check_pairs(r)  # shards without a single pair are refused before anything is built
        self.tokenizer, self.chat, self.model = build_policy_parts(r)
        model = self.model
        self.freeze_parts(model)
        model.set_activation_checkpointing(r.training.activation_checkpointing)
        self.prompts = prompt_source(r, files, model, self.tokenizer, self.chat)
        self.prompts.require_answer = self.sft and not self.preference
        self.prompts.require_pair = self.preference
        self.reward_fn = build_sources(r.algorithm, next(model.parameters()).device)
        self.val_samples = self.validation_split()
        self.describe(files)
        self.progress = r.logging.progress and sys.stderr.isatty()

        ckpt_state = engine_state = None
        warmup_from: Optional[int] = 0  # the warm-up step to start at; None: a checkpoint of the RL stage
        if self.resume_from is not None:
            engine_state, ckpt_state = load_checkpoint(self.resume_from, model)  # verified, or ValueError
            if ckpt_state.get("recipe") != R.run_dict(r):
                raise ValueError(f"{self.resume_from / 'state.json'}: was written by another recipe")
            warmup_from = ckpt_state.get("warmup_step")
        if self.writer:  # only once the checkpoint (if any) was accepted: a refused resume writes nothing
            out.mkdir(parents=True, exist_ok=True)
            (out / "recipe.yaml").write_text(R.dump_run(r))  # paths absolute: readable from anywhere
            if self.resume_from is None:
                for name in ("metrics.jsonl", "warmup.jsonl"):
                    (out / name).unlink(missing_ok=True)
            self.trackers = Trackers(r.logging, out, R.run_dict(r), resume=self.resume_from is not None)
        if warmup_from is not None and warmup_from < r.training.warmup.steps:
            self.warmup(warmup_from, ckpt_state if self.resume_from is not None else None, engine_state)

        if (r.algorithm.kl_coef > 0 and not self.sft) or self.preference:  # DPO's reference: the policy now
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.algorithm.trait("advantages") == "critic":  # PPO: a value model
            self.build_value_model()
        params = [p for p in model.parameters() if p.requires_grad]
        params += list(self.value_head.parameters()) if self.value_head is not None else []
        self.engine = build_engine(r, model, params)
        if r.training.precision == "bf16_params":  # the engine's weights are BF16 now: so are the policy the
            model.to(torch.bfloat16)  # rollouts and old log-probs use (an engine's own copy's sync target)
            if self.ref_model is not None:  # and the reference
                self.ref_model.to(torch.bfloat16)
        if self.sft:
            self.source = NoRollouts()
        else:
            self.source = self.build_source()
        if ckpt_state is not None and warmup_from is None:
            self.load_state_dict(ckpt_state, engine_state)
        self.log = (
            MetricsLog(out, "metrics.jsonl", r.logging.tensorboard, trackers=self.trackers) if self.writer else NoLog()
        )

    def describe(self, files: list) -> None:
        """The run's opening lines: data, model, stages, chat format, mode, folder; parts; validation."""
        r, model = self.recipe, self.model
        n_params = sum(p.numel() for p in model.parameters())
        stages = (
            f"{r.training.steps} {r.algorithm.name.upper()} steps"
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

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict:
        """One step of the run: DPO (`dpo_step`, dpo_steps.py), supervised (`sft_step`, supervised.py)
        or RL (`rl_step`, rl_step.py)."""
        if self.preference:
            return self.dpo_step(step)
        return self.sft_step(step) if self.sft else self.rl_step(step)

    def sync_policy(self) -> None:
        """DeepSpeed / Megatron / FSDP2 train their own copy: its full HF-layout weights -> the policy
        the rollouts use (collective on every trainer rank)."""
        if self.engine.model is not self.model:
            load_exported(self.model, self.engine.export_weights())

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
        error, interrupted = None, False
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
            except RewardInterrupted as e:  # a stop signal during a reward request: the step is abandoned
                error, interrupted = str(e), True
            except (WorkerDied, RewardError) as e:  # the step is abandoned; the run stops with a checkpoint
                error = str(e)
            if error is None:  # the checkpoint holds the rollout side's state, so save before it stops
                path = self.save()
                self.source.finish(None)
            else:  # what is in flight is settled (re-queued, counted) first; dead workers hold no state
                self.source.finish(error)
                path = self.save()
            if interrupted:
                log.warning("[run] %s", error)
                raise Interrupted(self.step_count, path)
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
        status = "failed"
        try:
            self.setup()
            result = self.train()
            status = "finished" if result.error is None else "failed"
            return result
        except Interrupted:
            status = "killed"
            raise
        finally:
            self.close(status)

    def close(self, status: str = "finished") -> None:
        """The logs, the trackers' runs (status: finished, failed or killed), the source."""
        if self.log is not None:
            self.log.close()
        if self.trackers is not None:
            self.trackers.close(status)
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
            "recipe": R.run_dict(self.recipe),
        }
        root, sharded = self.out / "checkpoints", hasattr(self.engine, "save_sharded")
        if sharded:  # FSDP2: every rank writes its own optimizer shards into the staged folder
            self.engine.save_sharded(stage(root, self.step_count, self.writer) / SHARDED)
        engine_state = {
            "engine": {"sharded": SHARDED} if sharded else self.engine.state_dict() or {},
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
            root,
            self.step_count,
            self.model,
            engine_state,
            state,
            keep_last=self.recipe.checkpoint.keep_last,
            extra_models=extra or None,
            staged=sharded,
        )

    def load_state_dict(self, state: dict, engine_state: dict) -> None:
        """Continue from a checkpoint (weights already loaded into the policy); a saved state that
        does not fit this run is a ValueError naming its file."""
        check_run_state(state, engine_state, self.resume_from, critic=self.critic_engine is not None)
        with blame(self.resume_from / "optimizer.pt"):
            if hasattr(self.engine, "load_sharded"):
                if engine_state["engine"] != {"sharded": SHARDED}:
                    raise ValueError("holds no sharded engine state: written by another training.engine")
                self.engine.load_sharded(self.resume_from / SHARDED)
            else:
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
        if rows and self.preference:
            lines.append(
                f"DPO steps       {len(rows)}  ({mean('step_s'):.2f}s/step), loss first {rows[0]['loss']:.4f}  "
                f"last {rows[-1]['loss']:.4f}, margin last {rows[-1]['dpo_margin']:+.4f}, accuracy last "
                f"{rows[-1]['dpo_accuracy']:.2f}"
            )
        elif rows and self.sft:
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
        if self.validations and self.preference:
            first, last = self.validations[0], self.validations[-1]
            lines.append(
                f"held-out pairs  margin step {first['step']}: {first['val_dpo_margin']:+.4f} -> step {last['step']}: "
                f"{last['val_dpo_margin']:+.4f}, accuracy {first['val_dpo_accuracy']:.2f} -> "
                f"{last['val_dpo_accuracy']:.2f}, logp gap {first['val_logp_gap']:+.3f} -> {last['val_logp_gap']:+.3f}"
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
        lines += self.trackers.summary_lines() if self.trackers is not None else []
        if error:
            lines.append(f"error: {error}; run stopped at step {self.step_count} with checkpoint {ckpt}")
        elif self.step_count < r.training.steps:
            lines.append(
                f"stopped at step {self.step_count} of {r.training.steps} (--max-steps); continue with --resume"
            )
        return "\n".join(lines)
