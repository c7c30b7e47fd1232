"""The colocated driver loop: reads like a script, one RL step after another.

    shards -> prompt source -> rollout engine -> rewards -> trajectories
    -> micro-batches -> training engine (GRPO loss) -> weight sync -> metrics

The rollout engine and the trainer share one model in this embedded mode, so
the weight sync is a version bump; the seam is the same one vLLM plugs into.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from loomrl.datasets.source import PromptSample, PromptSource
from loomrl.datasets.stream import ShardStream
from loomrl.platform import recipe as R
from loomrl.platform.algorithms.advantages import assign_advantages
from loomrl.platform.algorithms.critic import Critic, ValueHead, build_critic
from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.importance import importance_weights
from loomrl.platform.algorithms.ppo import value_loss
from loomrl.platform.rewards.sources import build_sources, score as score_rewards
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform import faults
from loomrl.platform.backbone.vlm import VLM, build_policy
from loomrl.platform.checkpoint import load_checkpoint, load_extra_model, save_checkpoint
from loomrl.platform.engines.torch_engine import TorchTrainEngine
from loomrl.platform.metrics import MetricsLog, read_metrics
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.trajectory.admission import admit_step, staleness as admission_staleness
from loomrl.platform.trajectory.batch import MicroBatch, Trajectory, micro_batches
from loomrl.platform.trajectory.layout import layout
from loomrl.platform.trajectory.store import TrajectoryStore


@dataclass
class RunResult:
    out: Path
    rows: list[dict]
    goal_met: Optional[bool]
    summary: str


def shard_files(recipe: R.Recipe) -> list[str]:
    """The run's shards; the demo shards are written first when missing and asked for."""
    files = R.expand_pattern(recipe.data.shards)
    if not files:
        demo = recipe.data.demo
        if demo is None:
            raise R.RecipeError(f"data.shards: no files match {recipe.data.shards!r}")
        from loomrl.datasets.demo import write_demo_shards

        directory = str(Path(recipe.data.shards).parent)
        print(f"[data] no shards match {recipe.data.shards}; writing {demo.samples} demo samples "
              f"to {directory}/", flush=True)
        files = write_demo_shards(directory, demo.samples, demo.samples_per_shard, demo.seed)
        if not R.expand_pattern(recipe.data.shards):
            raise R.RecipeError(f"data.shards: demo shards were written to {directory}/ "
                                f"but {recipe.data.shards!r} does not match them")
    return files


def configure_torch(cfg: R.TrainingConfig) -> None:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(cfg.deterministic)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)


def to_prompts(samples: list[PromptSample]) -> list[Prompt]:
    return [Prompt(s.id, s.ids, s.media) for s in samples]


# --------------------------------------------------------------------------- warm-up


def warmup_loss(model: VLM, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    logp, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    n = float(mb.loss_mask.sum())
    return -(logp * mb.loss_mask).sum() / mb.normaliser, {"tokens": n}


def run_warmup(recipe: R.Recipe, model: VLM, tokenizer, source: PromptSource, log: MetricsLog,
               progress: bool) -> None:
    from loomrl.datasets.demo import format_only_answer
    from tqdm import tqdm

    w = recipe.training.warmup
    # Format targets carry no information about the media: train only the language model,
    # so the encoders are not pushed around by gradients that are noise for them.
    params = list(model.language_model.parameters()) if w.target == "format" else None
    engine = TorchTrainEngine(model, recipe.training, lr=w.lr, params=params)
    rng = random.Random(recipe.training.seed + 1)
    bar = tqdm(range(w.steps), desc="warm-up (SFT)", disable=not progress, dynamic_ncols=True)
    for step in bar:
        trajs = []
        for s in source.next(w.batch_size):
            text = s.record["answer"] if w.target == "answer" else format_only_answer(s.record["meta"], rng)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [model.eos_token_id]
            trajs.append(Trajectory(s.id, 0, s.ids, ids, s.media, [0.0] * len(ids), 0.0, 0))
        mbs = micro_batches(trajs, model.pad_token_id, recipe.training.micro_batch_size)
        stats = engine.train_mini_batch(mbs, warmup_loss)
        log.log({"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"]})
        bar.set_postfix(loss=f"{stats['loss']:.3f}")


# --------------------------------------------------------------------------- RL


@dataclass
class CriticParts:
    """PPO's value model: a `head` on the policy's hidden states (trained by the policy's
    engine), or a separate `model` with its own `engine`."""
    head: Optional[ValueHead] = None
    model: Optional[Critic] = None
    engine: Optional[TorchTrainEngine] = None


def grpo_loss_fn(recipe: R.Recipe, shared=None, value_head: Optional[ValueHead] = None):
    """The policy's micro-batch loss (GRPO or PPO). shared: a loomrl.encoders.cache.SharedEncodings
    whose encodings of the current mini-batch every micro-batch uses (None: encode per micro-batch).
    value_head: PPO's head on the policy; its value loss is added. The largest importance ratio
    seen is kept in loss_fn.maxima (the engine sums stats)."""
    a, temperature, im = recipe.algorithm, recipe.rollout.temperature, recipe.algorithm.importance
    low = a.clip_eps if a.clip_eps_low is None else a.clip_eps_low
    high = a.clip_eps if a.clip_eps_high is None else a.clip_eps_high
    kl_coef = a.kl_coef if a.kl_placement == "loss" else 0.0
    maxima = {"is_ratio_max": 0.0}

    def loss_fn(model: VLM, mb: MicroBatch):
        encodings = shared.encodings if shared is not None else None
        out = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, temperature, encodings,
                                      return_hidden=value_head is not None)
        logp, entropy = out[0], out[1]
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
        # pi_old under the trainer vs the rollout engine that sampled the tokens
        weights, is_stats = importance_weights(old, mb.rollout_logp, mb.loss_mask, im.mode, im.cap, im.low, im.high)
        maxima["is_ratio_max"] = max(maxima["is_ratio_max"], is_stats.pop("is_ratio_max"))
        normaliser = {"token": mb.normaliser, "sequence": mb.sequences,
                      "constant": mb.sequences * recipe.rollout.max_new_tokens}[a.loss_norm]
        loss, stats = policy_loss(logp, old, mb.advantages, mb.loss_mask, low, normaliser, mb.ref_logp, kl_coef,
                                  high, None if im.mode == "none" else weights, a.loss_norm)
        stats.update(is_stats)
        if value_head is not None:
            vloss, vstats = value_loss(value_head(out[2]), mb.values, mb.returns, mb.loss_mask,
                                       a.ppo.value_clip, mb.normaliser)
            loss = loss + a.ppo.value_coef * vloss
            stats.update(vstats)
        m = mb.loss_mask
        stats["entropy_sum"] = float((entropy.detach() * m).sum())
        # rollout-vs-trainer mismatch of the same tokens under the same weights
        stats["mismatch_sum"] = float(((mb.rollout_logp - logp.detach()).abs() * m).sum())
        stats["tokens"] = float(m.sum())
        return loss, stats

    loss_fn.maxima = maxima
    return loss_fn


def critic_loss_fn(recipe: R.Recipe):
    """The separate critic's micro-batch loss: the clipped value loss."""
    clip = recipe.algorithm.ppo.value_clip

    def loss_fn(critic: Critic, mb: MicroBatch):
        return value_loss(critic(mb), mb.values, mb.returns, mb.loss_mask, clip, mb.normaliser)

    return loss_fn


@torch.no_grad()
def fill_logprobs(model: VLM, mbs: list[MicroBatch], temperature: float, attr: Optional[str],
                  value_head: Optional[ValueHead] = None) -> None:
    """Set mb.<attr> to the model's log-probs; with value_head also mb.values from the same
    forward (attr None: only the values)."""
    model.eval()
    encodings = None
    if model.cfg.encoders.dedup:  # every distinct medium of the step once (cached if the rollout did it)
        encodings = model.encode_media([m for mb in mbs for row in mb.media for m in row])
    for mb in mbs:
        out = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, temperature, encodings,
                                      return_hidden=value_head is not None)
        if attr is not None:
            setattr(mb, attr, out[0])
        if value_head is not None:
            mb.values = value_head(out[2])


@torch.no_grad()
def fill_critic_values(critic: Critic, mbs: list[MicroBatch]) -> None:
    critic.eval()
    for mb in mbs:
        mb.values = critic(mb)


def rl_step(step: int, recipe: R.Recipe, model: VLM, ref_model: Optional[VLM], tokenizer,
            source: PromptSource, rollout: TorchRolloutEngine, engine: TorchTrainEngine,
            reward_fn, generator: torch.Generator, critic: Optional[CriticParts] = None,
            store: Optional[TrajectoryStore] = None) -> dict:
    t_step = time.perf_counter()
    samples = source.next(recipe.training.prompts_per_step)
    faults.maybe_die("rollout")
    ro = recipe.rollout
    params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
    prompts = to_prompts(samples)
    compare_now = (isinstance(rollout, TorchRolloutEngine) and rollout.drafter is not None
                   and ro.drafter.compare_every and step % ro.drafter.compare_every == 0)
    plain_first = compare_now and (step // ro.drafter.compare_every) % 2 == 0

    def plain_run():
        # Same prompts, same weights, no drafter: its tokens are discarded, only timed. The
        # second call of a step finds the media encodings cached, so the order alternates.
        return TorchRolloutEngine(model).generate(prompts, params, torch.Generator().manual_seed(step))

    plain = plain_run() if plain_first else None
    result = rollout.generate(prompts, params, generator)
    if compare_now and plain is None:
        plain = plain_run()
    compare = None
    if plain is not None:
        compare = {"plain_tokens_per_s": plain.tokens / plain.seconds,
                   "drafting_speedup": (result.tokens / result.seconds) / (plain.tokens / plain.seconds),
                   "plain_forwards": plain.forwards, "drafted_forwards": result.forwards}
    for r in result.rollouts:  # NgramRL: finished rollouts feed their prompt's draft history
        rollout.observe(samples[r.prompt_index].id, r.completion_ids)
    # this step's drafting counters (vLLM's health check below generates again and resets them)
    draft_stats = copy.copy(getattr(rollout, "last_stats", None))
    spec_metrics = dict(getattr(rollout, "spec_metrics", {}))

    # reward_fn: the run's reward sources (loomrl.platform.rewards.sources), batched per source
    texts = [tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in result.rollouts]
    totals_r, by_source = score_rewards(reward_fn, texts, [samples[r.prompt_index].record for r in result.rollouts])
    trajs: list[Trajectory] = []
    for r, reward in zip(result.rollouts, totals_r):
        s = samples[r.prompt_index]
        trajs.append(Trajectory(s.id, r.prompt_index, s.ids, r.completion_ids, s.media,
                                r.logprobs, float(reward), rollout.version))
    rewards = torch.tensor([t.reward for t in trajs])
    from loomrl.platform.engines.base import allreduce_max, check_rank_agreement

    ranks_agree = check_rank_agreement(step, trajs)  # training.nproc > 1: every rank's rollouts must be equal
    mismatch = {}
    if recipe.logging.mismatch_every and step % recipe.logging.mismatch_every == 0:
        from loomrl.platform.doctor import mismatch_metrics  # before training moves the weights

        mismatch = mismatch_metrics(model, trajs, ro.temperature)

    t_train = time.perf_counter()
    a, tr = recipe.algorithm, recipe.training
    from loomrl.encoders.cache import SharedEncodings

    enc_before = model.encode_totals.copy()
    # model.encoders.dedup: each mini-batch's distinct media are encoded once and shared by
    # its micro-batches, one encoder backward per mini-batch; off: every copy, every micro-batch.
    shared = (SharedEncodings(engine.model) if model.cfg.encoders.dedup and getattr(engine, "supports_hook", True)
              else None)
    # KnitTrans: the step's groups go through the trajectory store and admission; all are
    # ready at once here, so both policies admit the same mini-batches in the same order.
    store = store if store is not None else TrajectoryStore(ro.n)
    admitted = admit_step(store, recipe, trajs, step)
    layouts = [layout([t for g in groups for t in g.trajectories], model.pad_token_id, tr.micro_batch_size,
                      recipe.pipeline.tokens_per_micro_batch) for groups in admitted]
    all_mbs = [mb for mbs in layouts for mb in mbs]
    head = critic.head if critic is not None else None
    if a.epochs * tr.mini_batches > 1:  # the policy moves before some tokens are trained on
        fill_logprobs(model, all_mbs, ro.temperature, "old_logp", head)
    elif head is not None:
        fill_logprobs(model, all_mbs, ro.temperature, None, head)
    if critic is not None and critic.model is not None:
        fill_critic_values(critic.model, all_mbs)
    if ref_model is not None:
        fill_logprobs(ref_model, all_mbs, ro.temperature, "ref_logp")
    adv_stats = assign_advantages(a, ro.n, rewards, trajs, all_mbs)
    loss_fn = grpo_loss_fn(recipe, shared, head)
    totals: dict[str, float] = {}
    critic_totals: dict[str, float] = {}
    updates = 0
    for _ in range(a.epochs):
        for mbs in layouts:
            stats = engine.train_mini_batch(mbs, loss_fn, shared)
            updates += 1
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            if critic is not None and critic.model is not None:
                for k, v in critic.engine.train_mini_batch(mbs, critic_loss_fn(recipe)).items():
                    critic_totals[k] = critic_totals.get(k, 0.0) + v
    trainer_version = rollout.version  # the version these updates were applied to
    if engine.model is not model:  # DeepSpeed/Megatron train a copy: its full HF-layout weights -> model
        from loomrl.platform.engines.base import load_exported

        load_exported(model, engine.export_weights())
    rollout.update_weights(None, rollout.version + 1)  # colocated: shared module, new version (vLLM: streamed)
    sync_check = None
    if ro.engine == "vllm" and ro.vllm.health_every and step % ro.vllm.health_every == 0:
        from loomrl.platform.rollout.vllm_engine import logprob_gap  # vLLM vs trainer after the sync

        sync_check = logprob_gap(rollout, model, prompts[:2], SamplingParams(n=2, temperature=ro.temperature,
                                 max_new_tokens=ro.max_new_tokens), torch.Generator().manual_seed(step))[0]
    train_s = time.perf_counter() - t_train
    enc = model.encode_totals.since(enc_before)  # the trainer's encoder work this step
    # per consumed trajectory: mini-batch k of epoch e is trained by version trainer_version + e*M + k
    staleness = [s for e in range(a.epochs) for k, groups in enumerate(admitted)
                 for s in admission_staleness(groups, trainer_version + e * len(admitted) + k)]
    for groups in admitted:
        store.mark_trained(groups)

    tokens = max(1.0, totals["tokens"])
    media = [m.hash for s in samples for m in s.media]
    row = {
        "step": step,
        "trajectories": len(trajs),
        "trajectories_admitted": sum(len(g.trajectories) for groups in admitted for g in groups),
        # which prompts this step trained on, so resumed and uninterrupted runs can be compared
        "prompt_digest": hashlib.sha1(" ".join(s.id for s in samples).encode()).hexdigest()[:16],
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "loss": totals["loss"] / updates,
        "entropy": totals["entropy_sum"] / tokens,
        "clip_frac": totals["clipped_tokens"] / tokens,
        "logp_mismatch": totals["mismatch_sum"] / tokens,
        "grad_norm": totals["grad_norm"] / updates,
        "response_len": result.tokens / len(trajs),
        "stop_rate": sum(r.finish_reason == "stop" for r in result.rollouts) / len(trajs),
        "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
        "tokens_per_forward": result.tokens_per_forward,
        "rollout_s": result.seconds,
        "train_s": train_s,
        "step_s": time.perf_counter() - t_step,
        "policy_version": rollout.version,
        "staleness_mean": sum(staleness) / len(staleness),  # 0 only with one mini-batch and one epoch
        "staleness_max": max(staleness),
        "media_total": len(media) * ro.n,
        "media_unique": len(set(media)),
        **enc.as_dict(),  # enc_media_total/unique, enc_calls, enc_bytes_*, enc_*_s, enc_cache_*
        "enc_cache_entries": len(model.encoding_cache),
    }
    if "kl_sum" in totals:
        row["kl"] = totals["kl_sum"] / tokens
    row.update(mismatch)  # mismatch_<setting>_{mean,max,kl}: BF16 trainer forward vs rollout log-probs
    # importance correction: is the run on-policy? (ratio = pi_old under the trainer / pi_rollout)
    is_max = allreduce_max(loss_fn.maxima["is_ratio_max"])  # each rank saw only its micro-batches
    row.update({"is_ratio_mean": totals["is_ratio_sum"] / tokens, "is_ratio_max": is_max,
                "is_clipped_frac": totals["is_clipped"] / tokens, "is_masked_frac": totals["is_masked"] / tokens})
    if len(by_source) > 1 or recipe.algorithm.rewards:
        row.update({f"reward_{name}_mean": sum(v) / len(v) for name, v in by_source.items()})
    row.update(adv_stats)
    if "value_loss_sum" in totals:  # value head: its loss is part of the policy's
        row.update({"value_loss": totals["value_loss_sum"] / tokens,
                    "value_clip_frac": totals["value_clipped_tokens"] / tokens})
    if critic_totals:
        row.update({"value_loss": critic_totals["value_loss_sum"] / tokens,
                    "value_clip_frac": critic_totals["value_clipped_tokens"] / tokens,
                    "critic_grad_norm": critic_totals["grad_norm"] / updates})
    if rollout.drafter is not None:
        ds = draft_stats
        row.update({
            "draft_acceptance": sum(ds.accepted_by_pos) / max(1, sum(ds.drafted_by_pos)),
            "draft_acceptance_by_pos": [round(a, 4) for a in ds.acceptance_by_position()],
            "drafter_lookup_us": 1e6 * ds.lookup_s / max(1, ds.lookups),
            "prefetch_coverage": ds.coverage,
            "drafter_history_tokens": rollout.drafter.history_tokens(),
        })
        if compare:
            row.update(compare)
    row.update(spec_metrics)  # vLLM's own speculative-decoding counters
    if sync_check is not None:
        row["vllm_sync_logp_diff"] = sync_check
    if ranks_agree:
        row["rank_agreement"] = 1  # the ranks' trajectory digests were compared and equal
    return row


def rl_lr(cfg: R.TrainingConfig, step: int) -> float:
    """The learning rate of RL step `step` (0-based): linear warm-up over lr_warmup_steps."""
    if cfg.lr_warmup_steps <= 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.lr_warmup_steps)


def goal_check(rows: list[dict], goal: Optional[R.GoalConfig]) -> tuple[Optional[bool], str]:
    if goal is None or not rows:
        return None, ""
    first = sum(r["reward_mean"] for r in rows[:goal.first_steps]) / min(goal.first_steps, len(rows))
    last_rows = rows[-goal.last_steps:]
    last = sum(r["reward_mean"] for r in last_rows) / len(last_rows)
    ok = last >= goal.min_final and last - first >= goal.min_gain
    text = (f"reward: first {goal.first_steps} RL steps {first:.3f} -> last {goal.last_steps} {last:.3f} "
            f"(gain {last - first:+.3f}); goal: last >= {goal.min_final} and gain >= {goal.min_gain}: "
            + ("MET" if ok else "NOT MET"))
    return ok, text


def run(recipe: R.Recipe, out: Path, resume_from: Optional[Path] = None,
        max_steps: Optional[int] = None) -> RunResult:
    """A whole run into `out`. resume_from: a checkpoint folder to continue from exactly.
    max_steps: stop (with a checkpoint) once this many RL steps are done in total."""
    t0 = time.perf_counter()
    configure_torch(recipe.training)
    files = shard_files(recipe)
    tokenizer = load_tokenizer(recipe.model.tokenizer)
    model = build_policy(recipe.model, tokenizer, recipe.training.seed)
    # every rank reads the same prompts and generates the same rollouts (same seeds); the
    # training engine splits each mini-batch's micro-batches between the ranks
    stream = ShardStream(files, shuffle_buffer=recipe.data.shuffle_buffer, seed=recipe.data.seed,
                         rank=0, world_size=1)
    source = PromptSource(stream, model, tokenizer, recipe.model)
    # reward models run on the trainer's device
    reward_fn = build_sources(recipe.algorithm, next(model.parameters()).device)
    from loomrl.platform.engines.base import world

    # only rank 0 writes the run folder: its checkpoints hold every rank's engine state
    writer = world()[0] == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(R.dump(recipe))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[run] {recipe.name}: {len(files)} shard(s), "
          f"model {n_params / 1e6:.2f}M params, {recipe.training.warmup.steps} warm-up + "
          f"{recipe.training.steps} RL steps -> {out}", flush=True)
    progress = recipe.logging.progress and sys.stderr.isatty()

    ckpt_state = None
    if resume_from is not None:
        engine_state, ckpt_state = load_checkpoint(resume_from, model)  # verified, or ValueError
    else:
        # a resume without a checkpoint starts over
        for name in ("metrics.jsonl", "warmup.jsonl") if writer else ():
            (out / name).unlink(missing_ok=True)
        if recipe.training.warmup.steps > 0:
            wlog = (MetricsLog(out, "warmup.jsonl", recipe.logging.tensorboard, prefix="warmup/") if writer
                    else NoLog())
            run_warmup(recipe, model, tokenizer, source, wlog, progress)
            wlog.close()

    ref_model = None
    if recipe.algorithm.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if recipe.rollout.engine == "vllm":
        from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine

        ro = recipe.rollout
        rollout = VLLMRolloutEngine(model, ro.vllm, ro.drafter, ro.temperature, ro.vllm.max_model_len,
                                    recipe.training.seed)
        print(f"[run] vLLM rollout engine started in {rollout.start_s:.1f}s"
              + (f"; drafting off: {rollout.drafting_note}" if rollout.drafting_note else ""), flush=True)
    else:
        rollout = TorchRolloutEngine(model, recipe.rollout.drafter)
    critic, extra_models = None, {}
    if recipe.algorithm.name == "ppo":
        ppo = recipe.algorithm.ppo
        if ppo.critic == "value_head":  # trained with the policy, by the policy's optimizer
            critic = CriticParts(head=ValueHead(recipe.model.hidden_size))
            extra_models["value_head"] = critic.head
        else:
            # the critic's weights are the policy's right after: no need to read init_from again
            fresh = dataclasses.replace(recipe.model, init_from=None)
            body = build_critic(model, lambda: build_policy(fresh, tokenizer, recipe.training.seed))
            critic = CriticParts(model=body, engine=TorchTrainEngine(body, recipe.training, lr=ppo.critic_lr))
            extra_models["critic"] = critic.model
    params = [p for p in model.parameters() if p.requires_grad]
    if recipe.training.engine == "torch":
        engine = TorchTrainEngine(model, recipe.training,
                                  params=params + (list(critic.head.parameters()) if critic and critic.head else []))
    else:  # DeepSpeed / Megatron train their own copy; `model` stays the full rollout copy
        from loomrl.platform.engines import build_engine

        engine = build_engine(recipe, model)
    generator = torch.Generator().manual_seed(recipe.training.seed)
    counters = {"generated": 0, "trained": 0, "dropped": 0}
    rows: list[dict] = []
    if ckpt_state is not None:
        if ckpt_state.get("recipe") != R.to_dict(recipe):
            raise ValueError(f"{resume_from / 'state.json'}: was written by another recipe")
        engine.load_state_dict(engine_state)
        generator.set_state(engine_state["generator"])
        torch.set_rng_state(engine_state["torch_rng"])
        source.load_state(ckpt_state["data"])
        rollout.load_state_dict(ckpt_state["rollout"])
        counters = ckpt_state["trajectories"]
        if ref_model is not None:
            load_extra_model(resume_from, "ref_model", ref_model)
        for name, m in extra_models.items():
            load_extra_model(resume_from, name, m)
        if critic is not None and critic.engine is not None:
            critic.engine.load_state_dict(engine_state["critic"])
        # the steps after the checkpoint will be run again: drop their rows
        if (out / "metrics.jsonl").exists():
            rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] < ckpt_state["step"]]
        if writer:
            tmp = out / ".metrics.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(out / "metrics.jsonl")
        print(f"[run] resumed from {resume_from} at RL step {ckpt_state['step']}", flush=True)
    start = ckpt_state["step"] if ckpt_state is not None else len(rows)
    store, base = TrajectoryStore(recipe.rollout.n), dict(counters)
    # The drafter allocates many small containers per step, which triggers full garbage
    # collections; each would walk every object the imports and the model created (~0.2 s
    # pauses). Freeze those: they live for the whole run.
    gc.collect()
    gc.freeze()
    log = MetricsLog(out, "metrics.jsonl", recipe.logging.tensorboard) if writer else NoLog()
    from tqdm import tqdm

    end = recipe.training.steps if max_steps is None else min(max_steps, recipe.training.steps)
    bar = tqdm(range(start, end), desc=recipe.algorithm.name.upper(), disable=not progress, dynamic_ncols=True)
    ck = recipe.checkpoint

    def checkpoint(step: int) -> Path:
        state = {"step": step, "data": source.state(), "rollout": rollout.state_dict(),
                 "trajectories": counters, "recipe": R.to_dict(recipe)}
        engine_state = dict(engine.state_dict() or {}, generator=generator.get_state(), torch_rng=torch.get_rng_state())
        if critic is not None and critic.engine is not None:
            engine_state["critic"] = critic.engine.state_dict()
        extra = dict(extra_models, **({"ref_model": ref_model} if ref_model is not None else {})) or None
        if not writer:  # engine.state_dict() above was collective; rank 0 saves what it gathered
            return out / "checkpoints" / f"step-{step:06d}"
        return save_checkpoint(out / "checkpoints", step, model, engine_state, state, ck.keep_last, extra)

    path = None
    stop = StopRequest()
    try:
        with stop:
            for step in bar:
                faults.current_step = step
                if recipe.training.lr_warmup_steps:  # a function of the step, so a resume sets it again
                    engine.set_lr(rl_lr(recipe.training, step))
                row = rl_step(step, recipe, model, ref_model, tokenizer, source, rollout, engine, reward_fn,
                              generator, critic, store)
                acc = store.accounting()  # this process's store on top of the checkpoint's counts
                counters = {k: base[k] + acc[k] for k in ("generated", "trained", "dropped")}
                row.update({f"trajectories_{k}": v for k, v in counters.items()})
                rows.append(row)
                log.log(row)
                recent = rows[-10:]
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}",
                                avg10=f"{sum(r['reward_mean'] for r in recent) / len(recent):.3f}")
                if not progress and (step % 10 == 0 or step == end - 1):
                    print(f"[step {step:4d}] reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}  "
                          f"{row['tokens_per_s']:.0f} tok/s  step {row['step_s']:.2f}s", flush=True)
                if stop.requested:
                    raise Interrupted(step + 1, checkpoint(step + 1))
                if ck.every and (step + 1) % ck.every == 0 and step + 1 < end:
                    checkpoint(step + 1)
            path = checkpoint(len(rows))
    finally:
        log.close()
        rollout.shutdown()
    finished = len(rows) == recipe.training.steps
    goal_met, goal_text = goal_check(rows, recipe.goal) if finished else (None, "")
    wall = time.perf_counter() - t0
    summary = summarize(recipe, out, rows, wall, path, goal_text, source, counters)
    if not finished:
        summary += f"\nstopped at RL step {len(rows)} of {recipe.training.steps} (--max-steps); continue with --resume"
    if writer:
        (out / "summary.json").write_text(json.dumps({
            "steps": len(rows), "wall_s": wall, "goal_met": goal_met, "goal": goal_text,
            "skipped_samples": source.state()["skipped"], "trajectories": counters}, indent=1))
    return RunResult(out, rows, goal_met, summary)


class NoLog:
    """The metrics log of ranks > 0: rank 0 alone writes the run's metrics."""

    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Interrupted(Exception):
    """SIGINT/SIGTERM: the current step finished and a checkpoint was written."""

    def __init__(self, step: int, path: Path):
        super().__init__(f"interrupted after RL step {step}; checkpoint {path}")
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
        print(f"\n[run] signal {signum}: finishing this step, then writing a checkpoint "
              f"(signal again to stop now)", file=sys.stderr, flush=True)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def summarize(recipe: R.Recipe, out: Path, rows: list[dict], wall: float, ckpt: Path,
              goal_text: str, source: PromptSource, counters: dict) -> str:
    lines = [f"== loomrl run '{recipe.name}' done in {wall:.0f}s =="]
    if rows:
        mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
        lines += [
            f"RL steps        {len(rows)}  ({mean('step_s'):.2f}s/step: rollout {mean('rollout_s'):.2f}s, "
            f"train {mean('train_s'):.2f}s)",
            f"reward          first {rows[0]['reward_mean']:.3f}  last {rows[-1]['reward_mean']:.3f}  "
            f"best {max(r['reward_mean'] for r in rows):.3f}",
            f"rollout         {mean('tokens_per_s'):.0f} tokens/s, {mean('response_len'):.1f} tokens/response, "
            f"stop rate {rows[-1]['stop_rate']:.2f}",
            f"on-policy       mean |rollout - trainer logp| {mean('logp_mismatch'):.2e}",
        ]
    if goal_text:
        lines.append(goal_text)
    skipped = source.state()["skipped"]
    if skipped:
        lines.append(f"skipped samples {skipped} (see warnings above)")
    lines.append(f"trajectories    generated {counters['generated']} = trained {counters['trained']} "
                 f"+ dropped {counters['dropped']} + pending 0")
    lines += [f"outputs         {out}/metrics.jsonl, tensorboard/, {ckpt.relative_to(out)}",
              f"plot            loomrl report {out}"]
    return "\n".join(lines)
