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
import math
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from loomrl.platform import faults
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.advantages import assign_advantages
from loomrl.platform.algorithms.critic import ValueHead, build_critic
from loomrl.platform.algorithms.losses import critic_loss_fn, policy_loss_fn, sft_loss
from loomrl.platform.checkpoint import blame, check_run_state, load_checkpoint, load_extra_model, save_checkpoint
from loomrl.platform.engines.base import allreduce_max, load_exported, world
from loomrl.platform.engines.torch_engine import autocast
from loomrl.platform.metrics import MetricsLog, read_metrics
from loomrl.platform.parts import configure_torch, shard_files
from loomrl.platform.placement import TRANSFERS, memory_row
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory, micro_batches
from loomrl.platform.trajectory.layout import layout

log = logging.getLogger("loomrl")


@dataclass
class RunResult:
    out: Path
    rows: list[dict]
    goal_met: Optional[bool]
    summary: str
    error: Optional[str] = None


class Phases:
    """Wall-clock seconds per named phase of a step: `with phases("train"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def rl_lr(cfg: R.TrainingConfig, step: int) -> float:
    """The learning rate of RL step `step` (0-based): linear warm-up over lr_warmup_steps, then
    constant or a half cosine down to lr x lr_min_ratio at the last step."""
    warm = cfg.lr_warmup_steps
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    t = min(1.0, (step - warm) / max(1, cfg.steps - 1 - warm))
    return cfg.lr * (cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


def scheduled(cfg: R.TrainingConfig) -> bool:
    """Whether the RL learning rate changes from step to step (then each step sets it, a resume too)."""
    return cfg.lr_warmup_steps > 0 or cfg.lr_schedule != "constant"


def machine() -> dict:
    """What a bit-identical rerun needs to match: the CPU kernels torch picked (by instruction set,
    or ATEN_CPU_CAPABILITY) and the threads; runs agree bit for bit only where these do."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def goal_check(rows: list[dict], goal: Optional[R.GoalConfig],
               validations: Optional[list[dict]] = None) -> tuple[Optional[bool], str]:
    """The goal on the training reward (mean of the first / last N steps), or on the validation
    reward (`goal.metric: val_reward_mean`: the first validation, before training, against the last,
    after it)."""
    if goal is None:
        return None, ""
    if goal.metric == "val_reward_mean":
        if not validations:
            return None, ""
        first, last = validations[0]["val_reward_mean"], validations[-1]["val_reward_mean"]
        what = f"validation reward: step {validations[0]['step']} {first:.3f} -> step {validations[-1]['step']}"
    else:
        if not rows:
            return None, ""
        first = sum(r["reward_mean"] for r in rows[:goal.first_steps]) / min(goal.first_steps, len(rows))
        last_rows = rows[-goal.last_steps:]
        last = sum(r["reward_mean"] for r in last_rows) / len(last_rows)
        what = f"reward: first {goal.first_steps} RL steps {first:.3f} -> last {goal.last_steps}"
    ok = last >= goal.min_final and last - first >= goal.min_gain
    text = (f"{what} {last:.3f} (gain {last - first:+.3f}); goal: last >= {goal.min_final} and gain >= "
            f"{goal.min_gain}: " + ("MET" if ok else "NOT MET"))
    return ok, text


@torch.no_grad()
def fill_logprobs(model, mbs: list[MicroBatch], temperature: float, attr: Optional[str],
                  value_head: Optional[ValueHead] = None) -> None:
    """Set mb.<attr> to the model's log-probs; with value_head also mb.values from the same
    forward (attr None: only the values)."""
    model.eval()
    encodings = None
    if model.cfg.encoders.dedup:  # every distinct medium of the batch once (cached if the rollout did it)
        encodings = model.encode_media([m for mb in mbs for row in mb.media for m in row])
    for mb in mbs:
        out = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, temperature, encodings,
                                      return_hidden=value_head is not None)
        if attr is not None:
            setattr(mb, attr, out[0])
        if value_head is not None:
            mb.values = value_head(out[2]).float()  # FP32 whatever the forward's precision


class Trainer:
    """One run of a recipe into `out` (see the module docstring for the lifecycle).

    resume_from: a checkpoint folder to continue from exactly. max_steps: stop (with a
    checkpoint) once this many RL steps are done in total. source: the trajectory source of
    a disaggregated run (built by `disaggregated.py`); None builds the colocated one."""

    def __init__(self, recipe: R.Recipe, out: Path, resume_from: Optional[Path] = None,
                 max_steps: Optional[int] = None, source_factory=None):
        self.recipe, self.out, self.resume_from, self.max_steps = recipe, out, resume_from, max_steps
        self.source_factory = source_factory
        self.rank, self.world = world()
        self.writer = self.rank == 0  # rank 0 alone writes the run folder
        self.step_count = 0           # RL steps done (the next step's index)
        self.version = 0              # optimizer steps applied to the policy
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
        from loomrl.platform.backbone.vlm import build_policy
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
        n_params = sum(p.numel() for p in model.parameters())
        stages = (f"{r.training.steps} SFT steps" if self.sft
                  else f"{r.training.warmup.steps} warm-up + {r.training.steps} RL steps")
        log.info("[run] %s: %d shard(s), model %.2fM params on %s, %s, %s, %s -> %s", r.name, len(files),
                 n_params / 1e6, model.device, stages, self.chat.describe(), r.pipeline.mode, out)
        log.info("[run] %s%s", model.describe_parts(),
                 ", activation checkpointing" if r.training.activation_checkpointing else "")
        if self.val_samples:
            log.info("[run] validation: %d held-out prompt(s) from %s, every %d steps and at the end",
                     len(self.val_samples), r.validation.shards, r.validation.every)
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
            ppo = r.algorithm.ppo
            if ppo.critic == "value_head":  # trained with the policy, by the policy's optimizer
                self.value_head = ValueHead(model.language_model.cfg.hidden_size).to(model.device)
                self.extra_models["value_head"] = self.value_head
            else:
                from loomrl.platform.engines.torch_engine import TorchTrainEngine

                # the critic's weights are the policy's right after: no need to read init_from again
                fresh = dataclasses.replace(r.model, init_from=None)
                self.critic = build_critic(model, lambda: build_policy(fresh, self.tokenizer, r.training.seed)
                                           .to(model.device))
                self.critic.body.set_activation_checkpointing(r.training.activation_checkpointing)
                self.critic_engine = TorchTrainEngine(self.critic, r.training, lr=ppo.critic_lr)
                self.extra_models["critic"] = self.critic
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
            raise R.RecipeError(f"training.freeze: {freeze}{also} freezes every part this model has "
                                f"({', '.join(model.parameter_parts())}); nothing would train")

    def build_source(self):
        from loomrl.platform.rollout import build_rollout_engine
        from loomrl.platform.trajectory.sources import ColocatedSource
        from loomrl.platform.trajectory.store import TrajectoryStore

        if self.source_factory is not None:
            return self.source_factory(self)
        generator = torch.Generator(self.model.device).manual_seed(self.recipe.training.seed + 1000 * self.rank)
        return ColocatedSource(self.recipe, self.model, self.tokenizer, self.prompts,
                               build_rollout_engine(self.recipe, self.model), self.reward_fn,
                               TrajectoryStore(self.recipe.rollout.n), generator)

    def warmup(self, start: int = 0, state: Optional[dict] = None, engine_state: Optional[dict] = None) -> None:
        """Supervised warm-up (SFT): `training.warmup.steps` optimizer steps on reference or
        format-only answers, before RL. A signal finishes the current step and writes a
        checkpoint of the warm-up (resumed from `start` with its `state`), as during RL."""
        import random

        from tqdm import tqdm

        from loomrl.datasets.demo import format_only_answer
        from loomrl.platform.engines.torch_engine import TorchTrainEngine

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
        wlog = (MetricsLog(self.out, "warmup.jsonl", r.logging.tensorboard, prefix="warmup/") if self.writer
                else NoLog())
        bar = tqdm(range(start, w.steps), desc="warm-up (SFT)", disable=not self.progress, dynamic_ncols=True)
        self.prompts.require_answer = w.target == "answer"
        try:
            with self.stop:
                for step in bar:
                    samples = self.prompts.next(w.batch_size)
                    targets = [s.record["answer"] if w.target == "answer" else format_only_answer(s.record["meta"], rng)
                               for s in samples]
                    stats = engine.train_mini_batch(self.sft_batch(samples, targets), sft_loss)
                    wlog.log({"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"]})
                    bar.set_postfix(loss=f"{stats['loss']:.3f}")
                    if self.stop.requested:
                        raise Interrupted(step + 1, self.save_warmup(step + 1, engine, rng), "warm-up")
        finally:
            wlog.close()
            self.prompts.require_answer = self.sft

    def sft_batch(self, samples: list, targets: list[str]) -> list[MicroBatch]:
        """Micro-batches teaching each sample's target text, ended by the stop token (the chat
        template's end-of-turn, else EOS); the loss covers only these tokens, not the prompt."""
        model, trajs = self.model, []
        for s, text in zip(samples, targets):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [model.eos_token_id]
            trajs.append(Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0))
        return micro_batches(trajs, model.pad_token_id, self.recipe.training.micro_batch_size, device=model.device)

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
        return {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "samples": len(samples),
                "answer_tokens": tokens, **{f"{name}_s": v for name, v in phases.seconds.items()},
                "step_s": time.perf_counter() - t_step, "policy_version": self.version}

    # ------------------------------------------------------------------ validation

    def validation_split(self) -> list:
        """The held-out prompts (validation.shards): the first validation.samples usable ones, in
        shard order, the same at every validation."""
        from loomrl.platform.parts import prompt_source

        r = self.recipe
        if r.validation.shards is None:
            return []
        files = R.expand_pattern(r.validation.shards, "validation.shards")
        if not files:
            raise R.RecipeError(f"validation.shards: no files match {r.validation.shards!r}")
        source = prompt_source(r, files, self.model, self.tokenizer, self.chat, one_pass=True)
        samples = source.take(r.validation.samples)
        if not samples:
            raise R.RecipeError(f"validation.shards: no usable sample in {len(files)} shard(s) "
                                f"({len(source.skipped)} skipped, see the warnings above)")
        if len(samples) < r.validation.samples:
            log.warning("[run] validation.samples: %d asked for, the split has %d usable", r.validation.samples,
                        len(samples))
        from loomrl.platform.rewards import RewardError

        records = [s.record for s in samples]
        for source in self.reward_fn:  # what each reward reads (the answer) is there, before any training
            if source.fn is not None:
                try:
                    source.score([""] * len(records), records)
                except RewardError as e:
                    raise R.RecipeError(f"validation.shards: {e}") from None
        return samples

    @torch.no_grad()
    def validate(self, step: int) -> dict:
        """Completions of the held-out prompts by the current policy (the built-in engine on the
        trainer's weights, greedy unless validation.temperature > 0), scored by the run's rewards.
        Rank 0 alone runs it (other ranks go on to the next step's collectives)."""
        from loomrl.platform.parts import to_prompts
        from loomrl.platform.rewards.sources import score
        from loomrl.platform.rollout.base import SamplingParams
        from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

        v, ro = self.recipe.validation, self.recipe.rollout
        t0 = time.perf_counter()
        engine = TorchRolloutEngine(self.model, None)
        params = SamplingParams(n=1, temperature=v.temperature, top_p=ro.top_p if v.temperature > 0 else 1.0,
                                max_new_tokens=v.max_new_tokens or ro.max_new_tokens)
        # the same draws at every validation
        generator = torch.Generator(self.model.device).manual_seed(self.recipe.training.seed + 7919)
        texts, lengths, stops = [], [], 0
        for i in range(0, len(self.val_samples), v.batch_size):
            chunk = self.val_samples[i:i + v.batch_size]
            result = engine.generate(to_prompts(chunk), params, generator)
            for rollout in result.rollouts:
                texts.append(self.tokenizer.decode(rollout.completion_ids, skip_special_tokens=True))
                lengths.append(len(rollout.completion_ids))
                stops += rollout.finish_reason == "stop"
        totals, by_source = score(self.reward_fn, texts, [s.record for s in self.val_samples])
        n = len(texts)
        out = {"val_reward_mean": sum(totals) / n, "val_response_len": sum(lengths) / n, "val_stop_rate": stops / n}
        if len(by_source) > 1:
            out.update({f"val_reward_{name}_mean": sum(xs) / n for name, xs in by_source.items()})
        out["val_s"] = time.perf_counter() - t0
        self.validations.append({"step": step, **out})
        log.info("[val] step %d: reward %.3f on %d held-out prompts, %.1f tokens/response (%.1fs)", step,
                 out["val_reward_mean"], n, out["val_response_len"], out["val_s"])
        return out

    def save_warmup(self, step: int, engine, rng) -> Path:
        """A checkpoint inside the warm-up: the policy, the warm-up optimizer, the data position."""
        state = {"step": 0, "version": 0, "warmup_step": step, "data": self.prompts.state(),
                 "warmup_rng": list(rng.getstate()), "recipe": R.to_dict(self.recipe),
                 "trajectories": {"generated": 0, "trained": 0, "dropped": 0, "dropped_by_reason": {}}}
        engine_state = {"warmup_engine": engine.state_dict(), "torch_rng": torch.get_rng_state()}
        if not self.writer:
            return self.out / "checkpoints" / "step-000000"
        return save_checkpoint(self.out / "checkpoints", 0, self.model, engine_state, state,
                               self.recipe.checkpoint.keep_last)

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
        shared = SharedEncodings(self.engine.model) if self.model.cfg.encoders.dedup and self.engine.supports_hook \
            else None
        loss_fn = policy_loss_fn(r, shared, self.value_head)
        totals: dict[str, float] = {}
        critic_totals: dict[str, float] = {}
        staleness: list[int] = []
        trained: list[list[Trajectory]] = []
        held: list[tuple[list[Trajectory], list[MicroBatch]]] = []
        adv_stats: dict[str, float] = {}
        queue: list[tuple[list[Trajectory], list[MicroBatch]]] = []
        mismatch: dict[str, float] = {}  # mismatch_<setting>_{mean,max,kl}: BF16 trainer forward vs rollout
        sync_each = self.source.sync_every_update
        while len(held) < tr.mini_batches:
            if not queue:
                with phases("admit"):  # colocated: generation; disaggregated: waiting for admission
                    batches = self.source.admit(step, self.version)
                if not held:  # the encoder work counted below is the trainer's, not the rollouts'
                    enc_before = self.model.encode_totals.copy()
                if not 1 <= len(batches) <= tr.mini_batches - len(held):
                    raise RuntimeError(f"RL step {step}: the trajectory source admitted {len(batches)} mini-batches "
                                       f"where {tr.mini_batches - len(held)} remain to be trained")
                with phases("prepare"):
                    if r.logging.mismatch_every and step % r.logging.mismatch_every == 0 and not held:
                        from loomrl.platform.mismatch import mismatch_metrics  # before training moves the weights

                        mismatch = mismatch_metrics(self.model, [t for b in batches for t in b], r.rollout.temperature)
                    queue = [(b, layout(b, self.model.pad_token_id, tr.micro_batch_size,
                                        r.pipeline.tokens_per_micro_batch, self.model.device)) for b in batches]
                    for k, v in self.prepare(queue).items():
                        adv_stats[k] = adv_stats.get(k, 0.0) + v / tr.mini_batches * len(queue)
            trajs, mbs = queue.pop(0)
            with phases("train"):
                staleness += [self.version - t.version for t in trajs]
                self.update(mbs, loss_fn, shared, totals, critic_totals)
            held.append((trajs, mbs))
            trained.append(trajs)
            if sync_each:
                with phases("sync"):
                    self.sync_policy()
                    self.source.weights_updated(self.version)
        for _ in range(a.epochs - 1):  # PPO epochs: the same mini-batches again, same order
            for trajs, mbs in held:
                with phases("train"):
                    staleness += [self.version - t.version for t in trajs]
                    self.update(mbs, loss_fn, shared, totals, critic_totals)
                if sync_each:
                    with phases("sync"):
                        self.sync_policy()
                        self.source.weights_updated(self.version)
        with phases("sync"):
            if not sync_each:
                self.sync_policy()
            rollout_metrics = self.source.end_step(step, self.version)
        rollout_metrics = dict(rollout_metrics, **mismatch)
        return self.metrics_row(step, trained, totals, critic_totals, adv_stats, staleness, loss_fn,
                                enc_before, phases, rollout_metrics, time.perf_counter() - t_step)

    def metrics_row(self, step, trained, totals, critic_totals, adv_stats, staleness, loss_fn, enc_before,
                    phases, rollout_metrics, step_s) -> dict:
        trajs = [t for b in trained for t in b]
        updates = self.recipe.training.mini_batches * self.recipe.algorithm.epochs
        rewards = torch.tensor([t.reward for t in trajs])
        tokens = max(1.0, totals["tokens"])
        prompt_ids = sorted({t.prompt_id for t in trajs})
        enc = self.model.encode_totals.since(enc_before)  # the trainer's encoder work this step
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
        row.update(rollout_metrics)  # the source's: rollout_s (generation), tokens_per_s, drafting, ...
        if "trainer_idle_s" in row:  # disaggregated: the share of the step spent waiting for admission
            row["trainer_idle_frac"] = min(1.0, row["trainer_idle_s"] / max(step_s, 1e-9))
        if "kl_sum" in totals:
            row["kl"] = totals["kl_sum"] / tokens
        # importance correction: is the run on-policy? (ratio = pi_old under the trainer / pi_rollout)
        is_max = allreduce_max(loss_fn.maxima["is_ratio_max"])  # each rank saw only its micro-batches
        row.update({"is_ratio_mean": totals["is_ratio_sum"] / tokens, "is_ratio_max": is_max,
                    "is_clipped_frac": totals["is_clipped"] / tokens, "is_masked_frac": totals["is_masked"] / tokens})
        names = sorted({n for t in trajs for n in t.reward_parts})
        if len(names) > 1 or self.recipe.algorithm.rewards:
            row.update({f"reward_{n}_mean": sum(t.reward_parts[n] for t in trajs) / len(trajs) for n in names})
        row.update(adv_stats)
        if "value_loss_sum" in totals:  # value head: its loss is part of the policy's
            row.update({"value_loss": totals["value_loss_sum"] / tokens,
                        "value_clip_frac": totals["value_clipped_tokens"] / tokens})
        if critic_totals:
            row.update({"value_loss": critic_totals["value_loss_sum"] / tokens,
                        "value_clip_frac": critic_totals["value_clipped_tokens"] / tokens,
                        "critic_grad_norm": critic_totals["grad_norm"] / updates})
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
        return {"generated": base["generated"] + acc["generated"], "trained": base["trained"] + acc["trained"],
                "dropped": base["dropped"] + acc["dropped"], "pending": acc.get("pending", 0),
                "dropped_by_reason": reasons}

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
        bar = tqdm(range(self.step_count, end), desc=r.algorithm.name.upper(), disable=not self.progress,
                   dynamic_ncols=True)
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
            (self.out / "summary.json").write_text(json.dumps({
                "steps": self.step_count, "wall_s": wall, "goal_met": goal_met, "goal": goal_text, "error": error,
                "machine": machine(),
                "skipped_samples": self.prompts.state()["skipped"], "trajectories": self.counts(),
                "validation": self.validations, "checkpoint": str(path), **self.source.report()}, indent=1))
        return RunResult(self.out, self.rows, goal_met, summary, error)

    def show(self, bar, row: dict, end: int) -> None:
        """The progress bar's figures, or (without a terminal) a log line every 10 steps."""
        step, key = row["step"], "loss" if self.sft else "reward_mean"
        recent = self.rows[-10:]
        bar.set_postfix({key.removesuffix("_mean"): f"{row[key]:.3f}",
                         "avg10": f"{sum(x[key] for x in recent) / len(recent):.3f}"})
        if self.progress or not self.writer or not (step % 10 == 0 or step == end - 1):
            return
        if self.sft:
            log.info("[step %4d] loss %.4f  grad norm %.3f  step %.2fs", step, row["loss"], row["grad_norm"],
                     row["step_s"])
            return
        extra = (f"  staleness {row['staleness_mean']:.2f} (max {row['staleness_max']})"
                 if self.recipe.pipeline.mode == "disaggregated" else "")
        log.info("[step %4d] reward %.3f  loss %+.4f  %.0f tok/s  step %.2fs%s", step, row["reward_mean"],
                 row["loss"], row.get("tokens_per_s", 0.0), row["step_s"], extra)

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
        state = {"step": self.step_count, "version": self.version, "data": self.prompts.state(),
                 "trajectories": counts, "recipe": R.to_dict(self.recipe)}
        engine_state = {"engine": self.engine.state_dict() or {}, "torch_rng": torch.get_rng_state(),
                        "source": self.source.state_dict()}
        if self.critic_engine is not None:
            engine_state["critic"] = self.critic_engine.state_dict()
        extra = dict(self.extra_models, **({"ref_model": self.ref_model} if self.ref_model is not None else {}))
        if not self.writer:  # the state_dict() calls above were collective; rank 0 saves what it gathered
            return path
        # the rollout copy of the policy is what is saved: sync it from a DeepSpeed/Megatron engine
        return save_checkpoint(self.out / "checkpoints", self.step_count, self.model, engine_state, state,
                               self.recipe.checkpoint.keep_last, extra or None)

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
        self.validations = [{"step": row["step"], **{k: v for k, v in row.items() if k.startswith("val_")}}
                            for row in self.rows if "val_reward_mean" in row]
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
        lines = [f"== loomrl run '{r.name}' ({r.pipeline.mode}, {r.rollout.engine} rollouts, "
                 f"{r.training.engine} engine x {self.world}) done in {wall:.0f}s =="]
        mean = lambda k: sum(x.get(k, 0.0) for x in rows) / len(rows)  # noqa: E731
        if rows and self.sft:
            lines.append(f"SFT steps       {len(rows)}  ({mean('step_s'):.2f}s/step), loss first {rows[0]['loss']:.4f}  "
                         f"last {rows[-1]['loss']:.4f}, {mean('answer_tokens'):.0f} answer tokens/step")
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
                lines.append(f"rollout ranks   {rows[-1]['rollout_ranks']}, each its share of the prompts: "
                             f"{mean('rollout_s'):.2f}s per step (the ranks' generation summed: "
                             f"{mean('rollout_rank_sum_s'):.2f}s)")
        if self.validations:
            shown = sorted({0, *range(max(0, len(self.validations) - 3), len(self.validations))})
            lines.append("validation      reward " + "  ".join(
                f"step {self.validations[i]['step']}: {self.validations[i]['val_reward_mean']:.3f}" for i in shown))
        if goal_text:
            lines.append(goal_text)
        skipped = self.prompts.state()["skipped"]
        if skipped:
            lines.append(f"skipped samples {skipped} (see warnings above)")
        c = self.counts()
        if not self.sft:
            lines.append(f"trajectories    generated {c['generated']} = trained {c['trained']} + dropped "
                         f"{c['dropped']} {c['dropped_by_reason'] or ''}+ pending {c['pending']}")
        lines += self.source.summary_lines()
        tensorboard = "tensorboard/, " if r.logging.tensorboard else ""
        lines += [f"outputs         {self.out}/metrics.jsonl, {tensorboard}{ckpt.relative_to(self.out)}",
                  f"plot            loomrl report {self.out}"]
        if error:
            lines.append(f"error: {error}; run stopped at step {self.step_count} with checkpoint {ckpt}")
        elif self.step_count < r.training.steps:
            lines.append(f"stopped at step {self.step_count} of {r.training.steps} (--max-steps); "
                         f"continue with --resume")
        return "\n".join(lines)


class NoLog:
    """The metrics log of ranks > 0: rank 0 alone writes the run's metrics."""

    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Interrupted(Exception):
    """SIGINT/SIGTERM: the current step finished and a checkpoint was written."""

    def __init__(self, step: int, path: Path, stage: str = "RL"):
        super().__init__(f"interrupted after {stage} step {step}; checkpoint {path}")
        self.step, self.path = step, path


class StopRequest:
    """While active, SIGINT and SIGTERM ask the loop to stop after the current step
    (a second signal stops at once)."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("[run] signal %d: finishing this step, then writing a checkpoint (signal again to stop now)",
                    signum)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False
