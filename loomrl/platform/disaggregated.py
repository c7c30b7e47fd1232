"""Disaggregated mode: rollout roles and the trainer role as separate processes.

`loomrl run RECIPE pipeline.mode=disaggregated` calls `launch`, which runs torchrun
with 1 + `pipeline.rollout_workers` processes of this module: rank 0 is the
trainer, ranks 1.. are rollout workers (gloo on CPU; the same code on many boxes
under a multi-node torchrun). All traffic is point-to-point
(`trajectory.transport`: JSON header + raw tensors, no pickle):

    trainer -> worker   weights (after each optimizer step, with the version),
                        work (prompt ids + records + media; features only for media
                        the worker has not been sent before), stop
    worker -> trainer   one result per group: completions, rollout log-probs, the
                        version that generated it (media by reference only)

The trainer owns the prompt source, the `TrajectoryStore`, the `Dispatcher` and
admission; rewards are scored when a group arrives. A trained RL step is
`training.mini_batches` optimizer steps over `training.prompts_per_step` prompts,
admitted as `pipeline.admission` says.

Worker death: the trainer declares a worker dead when its connection fails or it
stays silent `pipeline.worker_timeout_s` with work in flight; its in-flight prompts
are re-queued to the others (`continue`) or the run stops with a checkpoint and a
clear error (`stop`). On one box torchrun's agent also stops every process when a
rank dies (it does not keep survivors); the trainer then gets SIGTERM, re-queues
what was in flight for the books, writes its checkpoint and accounting, and exits
with the error. Resuming a disaggregated run is not supported yet.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loomrl.platform import faults
from loomrl.platform.engines.launch import torchrun_command
from loomrl.platform import recipe as R
from loomrl.platform.trajectory.transport import (MAX_MESSAGE_BYTES, Channel, MediaLedger, pack, unpack,
                                                  unpack_media)

EXIT_FILE = "exit_code"


def launch(recipe_path: str, overrides: list[str], out: Path) -> int:
    """Run the roles under torchrun; the trainer's exit code (0, 2 = stopped, 3 = goal missed)."""
    recipe = R.load_recipe(recipe_path, overrides)
    unsupported = {"algorithm.name": (recipe.algorithm.name, "grpo"), "rollout.engine": (recipe.rollout.engine, "torch"),
                   "training.engine": (recipe.training.engine, "torch")}
    for key, (value, ok) in unsupported.items():
        if value != ok:
            raise R.RecipeError(f"{key}: {value!r} is not supported with pipeline.mode=disaggregated yet (only {ok!r})")
    if recipe.algorithm.kl_coef > 0:
        raise R.RecipeError("algorithm.kl_coef: a KL reference is not supported with pipeline.mode=disaggregated yet")
    if recipe.algorithm.epochs != 1:
        raise R.RecipeError(f"algorithm.epochs: {recipe.algorithm.epochs} is not supported with "
                            "pipeline.mode=disaggregated yet (only 1)")
    if recipe.logging.mismatch_every:
        raise R.RecipeError("logging.mismatch_every: the rounding mismatch probe is not supported with "
                            "pipeline.mode=disaggregated yet (only 0)")
    # rollout.drafter.compare_every is ignored here: workers time no plain reference run
    out.mkdir(parents=True, exist_ok=True)
    (out / EXIT_FILE).unlink(missing_ok=True)
    cmd = torchrun_command(1 + recipe.pipeline.rollout_workers, [recipe_path, *overrides, "--out", str(out)],
                           module="loomrl.platform.disaggregated")
    rc = subprocess.call(cmd)
    code = out / EXIT_FILE
    if code.exists():
        return int(code.read_text())
    print(f"error: disaggregated run failed (torchrun exit {rc}) before the trainer finished; see above",
          file=sys.stderr)
    return rc or 1


# --------------------------------------------------------------------------- rollout role


def rollout_role(recipe: R.Recipe, rank: int) -> None:
    from loomrl.platform.backbone.tokenizer import load_tokenizer
    from loomrl.platform.backbone.vlm import build_policy
    from loomrl.platform.rollout.base import Prompt, SamplingParams
    from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
    from loomrl.platform.runner import configure_torch

    configure_torch(recipe.training)
    model = build_policy(recipe.model, load_tokenizer(recipe.model.tokenizer), recipe.training.seed)
    engine = TorchRolloutEngine(model, recipe.rollout.drafter)
    ro = recipe.rollout
    params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, max_new_tokens=ro.max_new_tokens)
    generator = torch.Generator().manual_seed(recipe.training.seed + 1000 * rank)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ch = Channel(MAX_MESSAGE_BYTES + weight_bytes)  # the trainer's weights come as one message
    known: dict = {}  # media this worker was sent, by key
    kill_here = os.environ.get("LOOMRL_KILL_RANK", str(rank)) == str(rank)
    # fault injection for the tests: this rank's first result carries a tensor whose shape
    # does not match its bytes
    corrupt = os.environ.get("LOOMRL_BAD_MESSAGE_RANK") == str(rank)
    while True:
        meta, tensors = unpack(ch.recv(0))
        if meta["kind"] == "stop":
            break
        if meta["kind"] == "weights":
            engine.update_weights(tensors.items(), meta["version"])
            continue
        faults.current_step = meta["step"]
        if kill_here:
            faults.maybe_die("rollout")  # dies with this work in flight
        jobs = meta["jobs"]
        prompts = [Prompt(j["id"], j["ids"], unpack_media(j["media"], tensors, known)) for j in jobs]
        result = engine.generate(prompts, params, generator)
        for r in result.rollouts:
            engine.observe(prompts[r.prompt_index].id, r.completion_ids)
        for i, j in enumerate(jobs):
            rows = [r for r in result.rollouts if r.prompt_index == i]
            buf = pack({"kind": "result", "key": j["key"], "version": engine.version,
                        "seconds": result.seconds / len(jobs),
                        "rollouts": [{"ids": r.completion_ids, "logp": r.logprobs, "finish": r.finish_reason}
                                     for r in rows]}, {"bad": torch.zeros(3)} if corrupt else None)
            if corrupt:  # same header length: shape [3] -> [4]
                corrupt = False
                buf = pack_tampered(buf, b'"bad", "float32", [3]', b'"bad", "float32", [4]')
            ch.send(buf, 0)
        ch.flush()
    ch.flush()
    engine.shutdown()


def pack_tampered(buf: torch.Tensor, old: bytes, new: bytes) -> torch.Tensor:
    """A packed message with `old` replaced by `new` (same length) in its bytes (fault injection)."""
    raw = bytes(buf.tolist()).replace(old, new, 1)
    assert len(new) == len(old) and raw != bytes(buf.tolist()), "pack_tampered: nothing replaced"
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# --------------------------------------------------------------------------- trainer role


class WorkerDied(RuntimeError):
    pass


def _bad_result(meta: dict) -> str:
    """What is wrong with a worker's result header ('' = nothing)."""
    if meta.get("kind") != "result" or not isinstance(meta.get("key"), str):
        return f"kind/key {meta.get('kind')!r}/{meta.get('key')!r} is not a result"
    if not isinstance(meta.get("version"), int) or not isinstance(meta.get("rollouts"), list):
        return f"result {meta['key']!r} lacks an integer 'version' or a 'rollouts' list"
    for i, r in enumerate(meta["rollouts"]):
        ok = isinstance(r, dict) and isinstance(r.get("ids"), list) and isinstance(r.get("logp"), list)
        if not ok or len(r["ids"]) != len(r["logp"]) or not all(isinstance(t, int) for t in r["ids"]):
            return f"result {meta['key']!r}: rollouts[{i}] needs token 'ids' and as many 'logp'"
    return ""


def trainer_role(recipe: R.Recipe, out: Path, workers: list[int]) -> int:
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.encoders.cache import SharedEncodings
    from loomrl.platform.algorithms.advantages import assign_advantages
    from loomrl.platform.backbone.tokenizer import load_tokenizer
    from loomrl.platform.backbone.vlm import build_policy
    from loomrl.platform.checkpoint import save_checkpoint
    from loomrl.platform.engines.torch_engine import TorchTrainEngine
    from loomrl.platform.metrics import MetricsLog
    from loomrl.platform.rewards.sources import build_sources, score
    from loomrl.platform.runner import configure_torch, goal_check, grpo_loss_fn, run_warmup, shard_files
    from loomrl.platform.trajectory.admission import admit, recipe_quota, staleness
    from loomrl.platform.trajectory.batch import Trajectory
    from loomrl.platform.trajectory.dispatch import Dispatcher, Job
    from loomrl.platform.trajectory.layout import Prefetcher, media_transfer
    from loomrl.platform.trajectory.store import TrajectoryStore

    t0 = time.perf_counter()
    configure_torch(recipe.training)
    tokenizer = load_tokenizer(recipe.model.tokenizer)
    model = build_policy(recipe.model, tokenizer, recipe.training.seed)
    # rank 0 of the gloo group, but the only reader of the prompts: it must see every sample
    source = PromptSource(ShardStream(shard_files(recipe), shuffle_buffer=recipe.data.shuffle_buffer,
                                      seed=recipe.data.seed, rank=0, world_size=1), model, tokenizer, recipe.model)
    reward_sources = build_sources(recipe.algorithm)
    (out / "recipe.yaml").write_text(R.dump(recipe))
    for name in ("metrics.jsonl", "warmup.jsonl"):
        (out / name).unlink(missing_ok=True)
    if recipe.training.warmup.steps > 0:
        wlog = MetricsLog(out, "warmup.jsonl", recipe.logging.tensorboard, prefix="warmup/")
        run_warmup(recipe, model, tokenizer, source, wlog, False)
        wlog.close()
    engine = TorchTrainEngine(model, recipe.training)
    pl, tr, ro, a = recipe.pipeline, recipe.training, recipe.rollout, recipe.algorithm
    quota = recipe_quota(recipe)
    store, disp, ledger, ch = TrajectoryStore(ro.n), Dispatcher(), MediaLedger(), Channel()
    prefetch = Prefetcher(model.pad_token_id, tr.micro_batch_size, pl.tokens_per_micro_batch, pl.prefetch)
    log = MetricsLog(out, "metrics.jsonl", recipe.logging.tensorboard)
    stop_signal: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: stop_signal.append(s))
    version, step, serial = 0, 0, 0
    live = list(workers)
    rejected: list[int] = []  # workers declared failed for a bad message (still running)
    by_source: dict[str, dict[str, list[float]]] = {}  # group key -> reward source -> scores
    last_heard = {w: time.monotonic() for w in workers}
    for w in workers:
        ch.receive_in_background(w)
    cap = tr.prompts_per_step  # finished + in-flight groups not yet admitted (back-pressure)

    def send_weights() -> None:
        buf = pack({"kind": "weights", "version": version}, dict(model.state_dict()))
        for w in live:
            ch.send(buf, w)

    def fresh(k: int) -> list[Job]:
        nonlocal serial
        jobs = []
        for s in source.next(k):
            jobs.append(Job(f"g{serial}", s))
            serial += 1
        return jobs

    def dispatch(w: int) -> None:
        if disp.busy(w) or len(store.ready) + disp.outstanding >= cap:
            return
        jobs = disp.next_jobs(pl.prompts_per_request, fresh)
        disp.assign(w, jobs)
        payload, tensors = [], {}
        for j in jobs:
            refs, t = ledger.pack_media(w, j.prompt.media)
            tensors.update(t)
            payload.append({"key": j.key, "id": j.prompt.id, "ids": j.prompt.ids, "media": refs})
        ch.send(pack({"kind": "work", "step": step, "jobs": payload}, tensors), w)
        last_heard[w] = time.monotonic()

    def receive(w: int, buf: torch.Tensor) -> dict:
        """A worker's result into the store; ValueError when the message is malformed."""
        meta, _ = unpack(buf)
        why = _bad_result(meta)
        if why:
            raise ValueError(f"transport: {why}")
        job = disp.complete(w, meta["key"])
        s = job.prompt
        texts = [tokenizer.decode(r["ids"], skip_special_tokens=True) for r in meta["rollouts"]]
        rewards, by_source[job.key] = score(reward_sources, texts, [s.record] * len(texts))
        now = time.perf_counter()
        for r, reward in zip(meta["rollouts"], rewards):
            store.put(Trajectory(s.id, 0, s.ids, r["ids"], s.media, r["logp"], float(reward), meta["version"]),
                      job.key, now)
        return meta

    def worker_died(w: int, why: str) -> None:
        jobs = disp.worker_died(w, why)
        live.remove(w)
        print(f"[trainer] rollout worker rank {w} died ({why}); {len(jobs)} in-flight prompt(s) re-queued",
              file=sys.stderr, flush=True)
        if pl.on_worker_death == "stop" or not live:
            raise WorkerDied(f"rollout worker rank {w} died ({why})")

    def bad_message(w: int, e: ValueError) -> None:
        """A malformed message: the worker is treated as failed (and told to stop at the end)."""
        rejected.append(w)
        worker_died(w, f"sent a bad message: {str(e).splitlines()[0][:200]}")

    def poll(wait_s: float = 0.0) -> list[dict]:
        """Results that arrived (waiting up to wait_s for the first); dead workers handled."""
        got = []
        while True:
            try:
                w, msg = ch.inbox.get(timeout=wait_s) if wait_s and not got else ch.inbox.get_nowait()
            except queue.Empty:
                break
            if w not in live:
                continue
            if isinstance(msg, ValueError):  # Channel.recv refused the declared size
                bad_message(w, msg)
                continue
            if isinstance(msg, Exception):
                worker_died(w, f"connection failed: {str(msg).splitlines()[0][:120]}")
                continue
            try:
                got.append(receive(w, msg))
            except ValueError as e:
                bad_message(w, e)
                continue
            last_heard[w] = time.monotonic()
        for w in list(live):
            if disp.busy(w) and time.monotonic() - last_heard[w] > pl.worker_timeout_s:
                worker_died(w, f"silent for {pl.worker_timeout_s:.0f} s with work in flight")
        if stop_signal:
            raise WorkerDied(f"signal {stop_signal[0]} (torchrun stops every rank when one fails)")
        return got

    def checkpoint() -> tuple[Path, dict]:
        """Weights, optimizer and the books at the current RL step (resume is not supported yet)."""
        state = {"step": step, "data": source.state(), "trajectories": store.accounting(),
                 "recipe": R.to_dict(recipe),
                 "dispatch": {"dispatched": disp.dispatched, "completed": disp.completed,
                              "requeued": disp.requeue_count, "waiting": len(disp.requeued)}}
        return save_checkpoint(out / "checkpoints", step, model, engine.state_dict(), state,
                               recipe.checkpoint.keep_last), state

    rows: list[dict] = []
    error = None
    send_weights()
    try:
        ready_q: list = []
        laid_out = None  # the admitted mini-batch whose layout the prefetcher is building
        while step < tr.steps:
            t_step = time.perf_counter()
            idle = 0.0
            st: list[int] = []
            waits: list[float] = []
            totals: dict[str, float] = {}
            results: list[dict] = []
            rewards_seen: list[float] = []
            source_scores: dict[str, list[float]] = {}
            prompt_ids: list[str] = []
            bytes_dedup = bytes_naive = 0
            for k in range(tr.mini_batches):
                while not ready_q:  # wait for admission, generating meanwhile
                    for w in live:
                        dispatch(w)
                    t_wait = time.perf_counter()
                    results += poll()
                    ready_q += admit(store, pl.admission, quota, version, time.perf_counter())
                    if not ready_q:
                        results += poll(0.005)
                    idle += time.perf_counter() - t_wait
                groups = ready_q.pop(0)
                trajs = [t for g in groups for t in g.trajectories]
                if laid_out is None:  # not prefetched: lay it out now
                    prefetch.submit(trajs)
                mbs = prefetch.get()
                if not ready_q:  # is the next mini-batch (trained by version + 1) ready already?
                    results += poll()
                    ready_q += admit(store, pl.admission, quota, version + 1, time.perf_counter())
                laid_out = ready_q[0] if ready_q else None
                if laid_out is not None:  # its layout overlaps this mini-batch's training
                    prefetch.submit([t for g in laid_out for t in g.trajectories])
                assign_advantages(a, ro.n, torch.tensor([t.reward for t in trajs]), trajs, mbs)
                shared = SharedEncodings(model) if model.cfg.encoders.dedup else None
                faults.current_step = step
                stats = engine.train_mini_batch(mbs, grpo_loss_fn(recipe, shared), shared)
                st += staleness(groups, version)
                waits += [g.admitted_at - g.ready_at for g in groups]
                rewards_seen += [t.reward for t in trajs]
                prompt_ids += [g.trajectories[0].prompt_id for g in groups]
                for g in groups:
                    for name, v in by_source.pop(g.key, {}).items():
                        source_scores.setdefault(name, []).extend(v)
                mt = media_transfer(trajs)
                bytes_dedup, bytes_naive = bytes_dedup + mt.bytes_dedup, bytes_naive + mt.bytes_naive
                for key, v in stats.items():
                    totals[key] = totals.get(key, 0.0) + v
                store.mark_trained(groups)
                version += 1
                send_weights()
            acc = store.accounting()
            step_s = time.perf_counter() - t_step
            tokens = max(1.0, totals.get("tokens", 1.0))
            row = {
                "step": step, "policy_version": version,
                "reward_mean": sum(rewards_seen) / len(rewards_seen),
                "loss": totals["loss"] / tr.mini_batches, "grad_norm": totals["grad_norm"] / tr.mini_batches,
                "entropy": totals.get("entropy_sum", 0.0) / tokens,
                "logp_mismatch": totals.get("mismatch_sum", 0.0) / tokens,
                "staleness_mean": sum(st) / len(st), "staleness_max": max(st),
                "admission_wait_s": sum(waits) / len(waits),
                "trainer_idle_frac": idle / step_s, "step_s": step_s,
                "rollout_s": sum(r["seconds"] for r in results) / max(1, len(results)),
                "media_bytes_dedup": bytes_dedup, "media_bytes_naive": bytes_naive,
                "transport_bytes_sent": ch.bytes_sent, "transport_bytes_received": ch.bytes_received,
                "media_bytes_sent_to_workers": ledger.bytes_sent, "media_bytes_naive_to_workers": ledger.bytes_naive,
                "rollout_workers_live": len(live), "prompts_requeued": disp.requeue_count,
                **{f"trajectories_{k}": v for k, v in acc.items() if k != "dropped_by_reason"},
                "prompt_ids": sorted(prompt_ids),  # the prompts trained this step (admission order varies)
            }
            if len(source_scores) > 1 or a.rewards:
                row.update({f"reward_{name}_mean": sum(v) / len(v) for name, v in source_scores.items()})
            rows.append(row)
            log.log(row)
            print(f"[step {step:4d}] reward {row['reward_mean']:.3f}  staleness {row['staleness_mean']:.2f} "
                  f"(max {row['staleness_max']})  trainer idle {row['trainer_idle_frac']:.2f}  "
                  f"step {step_s:.2f}s", flush=True)
            step += 1
            if recipe.checkpoint.every and step % recipe.checkpoint.every == 0 and step < tr.steps:
                checkpoint()
        # drain: results still in flight are received (and accounted) before the workers stop
        deadline = time.monotonic() + pl.worker_timeout_s
        while disp.outstanding and live and time.monotonic() < deadline:
            poll(0.005)
    except WorkerDied as e:
        error = str(e)
        for w in list(live):  # what the stopped workers held goes back to the queue, counted
            disp.worker_died(w, "run stopped")
    finally:
        prefetch.close()
        log.close()
    for w in live + rejected:
        ch.send(pack({"kind": "stop"}), w)
    store.drop_all("run_stopped" if error else "run_ended")
    store.check()
    acc = store.accounting()
    path, state = checkpoint()
    goal_met, goal_text = goal_check(rows, recipe.goal) if not error else (None, "")
    summary = {"steps": step, "wall_s": time.perf_counter() - t0, "goal_met": goal_met, "goal": goal_text,
               "error": error, "trajectories": acc, "dispatch": state["dispatch"], "checkpoint": str(path)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"== loomrl disaggregated run '{recipe.name}': {step} RL steps, {len(workers)} rollout workers, "
          f"{pl.admission} admission ==")
    if rows:
        print(f"staleness       mean {sum(r['staleness_mean'] for r in rows) / len(rows):.2f}, "
              f"max {max(r['staleness_max'] for r in rows)}")
    print(f"trajectories    generated {acc['generated']} = trained {acc['trained']} + dropped {acc['dropped']} "
          f"{acc['dropped_by_reason']} + pending {acc['pending']}")
    print(f"prompts         re-queued {disp.requeue_count}, waiting to be re-sent {len(disp.requeued)}")
    if goal_text:
        print(goal_text)
    if error:
        print(f"error: {error}; run stopped at RL step {step} with checkpoint {path}", file=sys.stderr)
        return 2
    ch.flush()
    return 3 if goal_met is False else 0


# --------------------------------------------------------------------------- entry point (torchrun)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loomrl.platform.disaggregated")
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    recipe = R.load_recipe(args.recipe, args.overrides)
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(60.0, recipe.pipeline.worker_timeout_s)))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    if rank == 0:
        code = trainer_role(recipe, out, list(range(1, world)))
        (out / EXIT_FILE).write_text(str(code))
    else:
        rollout_role(recipe, rank)
    # Exit without a collective: a dead peer would make destroy_process_group wait.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
