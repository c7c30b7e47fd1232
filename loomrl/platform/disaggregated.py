"""Disaggregated mode: rollout workers and the trainer as separate processes.

`loomrl run RECIPE pipeline.mode=disaggregated` calls `launch`, which runs torchrun
with `training.nproc` trainer processes plus `pipeline.rollout_workers` rollout
workers of this module (the same code on many boxes under a multi-node torchrun):

    global ranks 0 .. nproc-1     the trainer (`trainer.Trainer`, the same loop as a
                                  colocated run): its own process group, which the
                                  training engine (torch, DeepSpeed, Megatron) uses
    global ranks nproc ..         rollout workers: the recipe's rollout engine (torch
                                  or vLLM) on a full copy of the policy

Trainer rank 0 and the workers share a second gloo group, the transport. All its
traffic is point-to-point (`trajectory.transport`: JSON header + raw tensors, no pickle):

    trainer -> worker   weights (after each optimizer step, with the version),
                        work (prompt ids + records + media; features only for media
                        the worker has not been sent before), state / load_state
                        (checkpoints and --resume), stop
    worker -> trainer   one result per group: completions, rollout log-probs, the
                        version that generated it; its state when asked

`WorkerSource` is the trainer's trajectory source here: it owns dispatch, the
`TrajectoryStore` and admission; rewards are scored when a group arrives. Other
trainer ranks get each admitted mini-batch from rank 0 (`sources.LeaderSource`).

Worker death: the trainer declares a worker dead when its connection fails or it
stays silent `pipeline.worker_timeout_s` with work in flight; its in-flight prompts
are re-queued to the others (`continue`) or the run stops with a checkpoint and a
clear error (`stop`). On one box torchrun's agent also stops every process when a
rank dies; the trainer then gets SIGTERM, stops, checkpoints and exits with the error.

Resume: a checkpoint holds every worker's rollout-engine state and sampling generator,
sent back to the workers on `--resume`. Groups generated but not trained when the
checkpoint was written are counted as dropped (`lost_at_resume`) in its books.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from loomrl.logs import setup_logging
from loomrl.platform import faults
from loomrl.platform import recipe as R
from loomrl.platform.algorithms.dynamic_sampling import DynamicBooks, informative
from loomrl.platform.algorithms.overlong import apply_overlong
from loomrl.platform.engines.launch import ONE_NODE, Nodes, torchrun_command
from loomrl.platform.parts import build_policy_parts, configure_torch, sampling_params
from loomrl.platform.rewards.sources import score_parts
from loomrl.platform.rollout import build_rollout_engine
from loomrl.platform.rollout.base import Prompt
from loomrl.platform.trainer import Interrupted, Trainer
from loomrl.platform.trajectory.admission import admit, recipe_quota
from loomrl.platform.trajectory.batch import Trajectory
from loomrl.platform.trajectory.dispatch import Dispatcher, Job
from loomrl.platform.trajectory.layout import media_transfer
from loomrl.platform.trajectory.sources import FollowerSource, LeaderSource, WorkerDied
from loomrl.platform.trajectory.store import TrajectoryStore
from loomrl.platform.trajectory.transport import MAX_MESSAGE_BYTES, Channel, MediaLedger, pack, unpack, unpack_media

EXIT_FILE = "exit_code"
log = logging.getLogger("loomrl")


def launch(recipe: R.Recipe, cli_args: list[str], out: Path, nodes: Nodes = ONE_NODE) -> int:
    """Run the roles under torchrun (this node's share of them); the trainer's exit code (0, 2 =
    stopped, 3 = goal missed, 130 = interrupted). cli_args: the recipe path, overrides and run
    options. On a node other than node 0 (which runs trainer rank 0 and reads its exit code): the
    exit status of this node's ranks."""
    if nodes.rank == 0:
        (out / EXIT_FILE).unlink(missing_ok=True)
    nproc = recipe.training.nproc + recipe.pipeline.rollout_workers
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) * nodes.count // nproc)))
    try:
        rc = subprocess.call(
            torchrun_command(nproc, [*cli_args, "--out", str(out)], "loomrl.platform.disaggregated", nodes), env=env
        )
    except KeyboardInterrupt:
        rc = 130
    if nodes.rank > 0:  # trainer rank 0 runs on node 0, which reads its exit code
        return rc
    code = out / EXIT_FILE
    if code.exists():
        return int(code.read_text())
    log.error("error: disaggregated run failed (torchrun exit %s) before the trainer finished; see above", rc)
    return rc or 1


# --------------------------------------------------------------------------- rollout worker


def rollout_role(recipe: R.Recipe, rank: int, ch: Channel, trainer: int = 0) -> None:
    """A rollout worker: weights in, rollouts out, until told to stop."""

    configure_torch(recipe.training)
    _, _, model = build_policy_parts(recipe)
    engine = build_rollout_engine(recipe, model)
    params = sampling_params(recipe)
    generator = torch.Generator(model.device).manual_seed(recipe.training.seed + 1000 * rank)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ch.max_message_bytes = MAX_MESSAGE_BYTES + weight_bytes  # the trainer's weights come as one message
    known: dict = {}  # media this worker was sent, by key
    while True:
        meta, tensors = unpack(ch.recv(trainer))
        kind = meta["kind"]
        if kind == "stop":
            break
        if kind == "weights":
            model.load_state_dict(tensors)
            engine.update_weights(None, meta["version"])  # torch: shared module; vLLM: streamed
            continue
        if kind == "state":
            ch.send(
                pack({"kind": "state", "rollout": engine.state_dict()}, {"generator": generator.get_state()}), trainer
            )
            continue
        if kind == "load_state":
            engine.load_state_dict(meta["rollout"])
            generator.set_state(tensors["generator"])
            continue
        faults.current_step = meta["step"]
        faults.maybe_die("rollout", rank)  # dies with this work in flight (fault injection: faults.py)
        jobs = meta["jobs"]
        prompts = [Prompt(j["id"], j["ids"], unpack_media(j["media"], tensors, known)) for j in jobs]
        result = engine.generate(prompts, params, generator)
        for r in result.rollouts:
            engine.observe(prompts[r.prompt_index].id, r.completion_ids)
        for i, j in enumerate(jobs):
            rows = [r for r in result.rollouts if r.prompt_index == i]
            buf = pack(
                {
                    "kind": "result",
                    "key": j["key"],
                    "version": engine.version,
                    "seconds": result.seconds / len(jobs),
                    "seq_forwards": result.seq_forwards / len(jobs),
                    "rollouts": [
                        {"ids": r.completion_ids, "logp": r.logprobs, "finish": r.finish_reason} for r in rows
                    ],
                },
            )
            ch.send(faults.maybe_corrupt(buf, rank), trainer)  # fault injection (faults.py)
        ch.flush()
    ch.flush()
    engine.shutdown()


def _bad_result(meta: dict) -> str:
    """What is wrong with a worker's result header ('' = nothing)."""
    if meta.get("kind") == "state":
        return "" if isinstance(meta.get("rollout"), dict) else "state reply without a 'rollout' mapping"
    if meta.get("kind") != "result" or not isinstance(meta.get("key"), str):
        return f"kind/key {meta.get('kind')!r}/{meta.get('key')!r} is not a result"
    if not isinstance(meta.get("version"), int) or not isinstance(meta.get("rollouts"), list):
        return f"result {meta['key']!r} lacks an integer 'version' or a 'rollouts' list"
    for i, r in enumerate(meta["rollouts"]):
        ok = isinstance(r, dict) and isinstance(r.get("ids"), list) and isinstance(r.get("logp"), list)
        if not ok or len(r["ids"]) != len(r["logp"]) or not all(isinstance(t, int) for t in r["ids"]):
            return f"result {meta['key']!r}: rollouts[{i}] needs token 'ids' and as many 'logp'"
    return ""


# --------------------------------------------------------------------------- trainer side


class WorkerSource:
    """The trainer's trajectory source in disaggregated mode (trainer rank 0): dispatches
    prompts to the workers, receives their groups into the store, admits mini-batches.
    Worker ranks are the transport's (1..W); `names` maps them to global ranks for messages."""

    sync_every_update = True  # the workers get new weights after every optimizer step

    def __init__(self, trainer, ch: Channel, workers: list[int], names: dict[int, int]):

        self.trainer, self.recipe, self.ch, self.names = trainer, trainer.recipe, ch, names
        self.quota = recipe_quota(self.recipe)
        self.store, self.disp, self.ledger = TrajectoryStore(self.recipe.rollout.n), Dispatcher(), MediaLedger()
        self.live = list(workers)
        self.rejected: list[int] = []  # workers declared failed for a bad message (still running)
        self.last_heard = {w: time.monotonic() for w in workers}
        self.states: dict[int, tuple[dict, dict]] = {}  # worker -> its state reply
        self.serial = 0
        self.step = 0
        self.weights_sent = -1
        self.pending_states: Optional[dict] = None  # worker states to send back (--resume)
        self.books = DynamicBooks()  # dynamic sampling's counts of the step
        self.reset_metrics()
        for w in workers:
            ch.receive_in_background(w)

    def reset_metrics(self) -> None:
        self.m = {
            "waits": [],
            "idle": 0.0,
            "seconds": [],
            "tokens": 0,
            "seq_forwards": 0.0,
            "stop": 0,
            "n": 0,
            "bytes_dedup": 0,
            "bytes_naive": 0,
        }

    # ------------------------------------------------------------------ messages

    def send(self, w: int, buf: torch.Tensor) -> bool:
        """A message to worker w. A connection the worker closed (gloo raises at once: the process
        is gone) is that worker's death: re-queued or WorkerDied, as pipeline.on_worker_death says."""
        try:
            self.ch.send(buf, w)
            return True
        except RuntimeError as e:
            self.worker_died(w, f"connection failed: {str(e).splitlines()[0][:200]}")
            return False

    def send_weights(self, version: int) -> None:
        buf = pack({"kind": "weights", "version": version}, dict(self.trainer.model.state_dict()))
        for w in list(self.live):
            self.send(w, buf)
        self.weights_sent = version

    def fresh(self, k: int):

        jobs = []
        for s in self.trainer.prompts.next(k):
            jobs.append(Job(f"g{self.serial}", s))
            self.serial += 1
        return jobs

    def dispatch(self, w: int) -> None:
        # finished + in-flight groups not yet admitted stay within one train batch (back-pressure)
        if self.disp.busy(w) or len(self.store.ready) + self.disp.outstanding >= self.recipe.training.prompts_per_step:
            return
        jobs = self.disp.next_jobs(self.recipe.pipeline.prompts_per_request, self.fresh)
        self.disp.assign(w, jobs)
        payload, tensors = [], {}
        for j in jobs:
            refs, t = self.ledger.pack_media(w, j.prompt.media)
            tensors.update(t)
            payload.append({"key": j.key, "id": j.prompt.id, "ids": j.prompt.ids, "media": refs})
        if self.send(w, pack({"kind": "work", "step": self.step, "jobs": payload}, tensors)):
            self.last_heard[w] = time.monotonic()

    def receive(self, w: int, buf: torch.Tensor) -> None:
        """A worker's message into the store (or the state replies); ValueError when malformed."""

        meta, tensors = unpack(buf)
        why = _bad_result(meta)
        if why:
            raise ValueError(f"transport: {why}")
        if meta["kind"] == "state":
            self.states[w] = (meta, tensors)
            return
        job = self.disp.complete(w, meta["key"])
        s = job.prompt
        texts = [self.trainer.tokenizer.decode(r["ids"], skip_special_tokens=True) for r in meta["rollouts"]]
        rewards, all_parts = score_parts(self.trainer.reward_fn, texts, [s.record] * len(texts))
        now = time.perf_counter()
        for r, reward, parts in zip(meta["rollouts"], rewards, all_parts):
            traj = Trajectory(
                s.id, 0, s.ids, r["ids"], s.media, r["logp"], float(reward), meta["version"], reward_parts=parts
            )
            rc = self.trainer.recipe
            apply_overlong(traj, r.get("finish", "stop"), rc.rollout.max_new_tokens, rc.algorithm.overlong)
            self.store.put(traj, job.key, now)
            self.m["tokens"] += len(r["ids"])
            self.m["stop"] += r.get("finish") == "stop"
            self.m["n"] += 1
        self.filter_group(job.key)
        self.m["seconds"].append(float(meta.get("seconds", 0.0)))
        self.m["seq_forwards"] += float(meta.get("seq_forwards", 0.0))

    def filter_group(self, key: str) -> None:
        """Dynamic sampling (algorithms/dynamic_sampling.py): a finished group without reward spread
        is dropped, while the step's budget of max_rounds x prompts_per_step drops lasts; the
        dispatcher's back-pressure then sends another prompt in its place."""
        ds, per_step = self.recipe.algorithm.dynamic_sampling, self.recipe.training.prompts_per_step
        group = next((g for g in self.store.ready if g.key == key), None)
        if not ds.enabled or group is None:
            return
        self.books.groups += 1
        if informative([t.reward for t in group.trajectories], ds):
            return
        if self.books.dropped < ds.max_rounds * per_step:
            self.store.drop(group, "zero_variance")
            self.books.dropped += 1
            self.books.extra_rounds = self.books.dropped / per_step
        else:
            self.books.zero_var_trained += 1

    def worker_died(self, w: int, why: str) -> None:
        jobs = self.disp.worker_died(w, why)
        self.live.remove(w)
        log.error(
            "[trainer] rollout worker rank %d died (%s); %d in-flight prompt(s) re-queued",
            self.names[w],
            why,
            len(jobs),
        )
        if self.recipe.pipeline.on_worker_death == "stop" or not self.live:
            raise WorkerDied(f"rollout worker rank {self.names[w]} died ({why})")

    def poll(self, wait_s: float = 0.0) -> None:
        """Handle the messages that arrived (waiting up to wait_s for the first); dead workers too."""
        got = 0
        while True:
            try:
                w, msg = self.ch.inbox.get(timeout=wait_s) if wait_s and not got else self.ch.inbox.get_nowait()
            except queue.Empty:
                break
            if w not in self.live:
                continue
            if isinstance(msg, ValueError):  # Channel.recv refused the declared size
                self.rejected.append(w)
                self.worker_died(w, f"sent a bad message: {str(msg).splitlines()[0][:200]}")
                continue
            if isinstance(msg, Exception):
                self.worker_died(w, f"connection failed: {str(msg).splitlines()[0][:120]}")
                continue
            try:
                self.receive(w, msg)
            except ValueError as e:  # a malformed message: the worker is treated as failed
                self.rejected.append(w)
                self.worker_died(w, f"sent a bad message: {str(e).splitlines()[0][:200]}")
                continue
            got += 1
            self.last_heard[w] = time.monotonic()
        timeout = self.recipe.pipeline.worker_timeout_s
        for w in list(self.live):
            if self.disp.busy(w) and time.monotonic() - self.last_heard[w] > timeout:
                self.worker_died(w, f"silent for {timeout:.0f} s with work in flight")
        if self.trainer.stop.requested:
            raise WorkerDied("stop signal (on one box torchrun stops every rank when one fails)")

    # ------------------------------------------------------------------ the source

    def admit(self, step: int, version: int) -> list:

        self.step = step
        if self.pending_states is not None:  # --resume: the workers continue where they were
            self.load_workers(self.pending_states)
            self.pending_states = None
        if self.weights_sent != version:
            self.send_weights(version)
        admitted: list = []
        while not admitted:
            for w in self.live:
                self.dispatch(w)
            t_wait = time.perf_counter()
            self.poll()
            admitted = admit(self.store, self.recipe.pipeline.admission, self.quota, version, time.perf_counter())
            if not admitted:
                self.poll(0.005)
            self.m["idle"] += time.perf_counter() - t_wait
        batches = []
        for groups in admitted:
            trajs = [t for g in groups for t in g.trajectories]
            self.m["waits"] += [g.admitted_at - g.ready_at for g in groups]
            mt = media_transfer(trajs)
            self.m["bytes_dedup"] += mt.bytes_dedup
            self.m["bytes_naive"] += mt.bytes_naive
            self.store.mark_trained(groups)
            batches.append(trajs)
        return batches

    def weights_updated(self, version: int) -> None:
        self.send_weights(version)

    def end_step(self, step: int, version: int) -> dict:
        m = self.m
        seconds = sum(m["seconds"])
        row = {
            "trajectories": m["n"],
            "rollout_s": seconds / max(1, len(m["seconds"])),  # per group, on its worker
            "tokens_per_s": m["tokens"] / max(seconds, 1e-9),  # per worker
            "tokens_per_forward": m["tokens"] / max(1.0, m["seq_forwards"]),
            "response_len": m["tokens"] / max(1, m["n"]),
            "stop_rate": m["stop"] / max(1, m["n"]),
            "admission_wait_s": sum(m["waits"]) / max(1, len(m["waits"])),
            "trainer_idle_s": m["idle"],
            "media_bytes_dedup": m["bytes_dedup"],
            "media_bytes_naive": m["bytes_naive"],
            "transport_bytes_sent": self.ch.bytes_sent,
            "transport_bytes_received": self.ch.bytes_received,
            "media_bytes_sent_to_workers": self.ledger.bytes_sent,
            "media_bytes_naive_to_workers": self.ledger.bytes_naive,
            "rollout_workers_live": len(self.live),
            "prompts_requeued": self.disp.requeue_count,
        }
        if self.recipe.algorithm.dynamic_sampling.enabled:
            row.update(self.books.row())
        self.reset_metrics()
        return row

    def accounting(self) -> dict:
        return self.store.accounting()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Every live worker's rollout-engine state and generator (asked over the transport)."""
        self.states = {}
        for w in list(self.live):
            self.send(w, pack({"kind": "state"}))
        deadline = time.monotonic() + self.recipe.pipeline.worker_timeout_s
        while any(w not in self.states for w in self.live) and time.monotonic() < deadline:
            self.poll(0.05)
        missing = [self.names[w] for w in self.live if w not in self.states]
        if missing:
            raise WorkerDied(f"rollout worker rank(s) {missing} did not send their state for the checkpoint")
        return {
            "serial": self.serial,
            "workers": {
                str(self.names[w]): {"rollout": meta["rollout"], "generator": t["generator"]}
                for w, (meta, t) in self.states.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.serial = state["serial"]
        self.pending_states = state["workers"]

    def load_workers(self, states: dict) -> None:
        if not states:
            log.warning(
                "[trainer] the checkpoint holds no rollout-worker state (it was written after the run "
                "stopped on an error): the workers start with fresh drafters and generators"
            )
            return
        have = sorted(int(k) for k in states)
        if have != sorted(self.names[w] for w in self.live):
            raise ValueError(
                f"the checkpoint holds rollout workers {have}, this run has "
                f"{sorted(self.names[w] for w in self.live)}; resume with the same "
                f"pipeline.rollout_workers and training.nproc"
            )
        for w in list(self.live):
            st = states[str(self.names[w])]
            self.send(w, pack({"kind": "load_state", "rollout": st["rollout"]}, {"generator": st["generator"]}))

    # ------------------------------------------------------------------ the end

    def finish(self, error: Optional[str]) -> None:
        """Receive what is still in flight (accounted), stop the workers, close the books."""
        if error is None:
            deadline = time.monotonic() + self.recipe.pipeline.worker_timeout_s
            try:
                while self.disp.outstanding and self.live and time.monotonic() < deadline:
                    self.poll(0.005)
            except WorkerDied as e:
                error = str(e)
        if error is not None:
            for w in list(self.live):  # what the stopped workers held goes back to the queue, counted
                self.disp.worker_died(w, "run stopped")
        self.store.drop_all("run_stopped" if error else "run_ended")
        self.store.check()
        self.close()

    def report(self) -> dict:
        d = self.disp
        return {
            "dispatch": {
                "dispatched": d.dispatched,
                "completed": d.completed,
                "requeued": d.requeue_count,
                "waiting": len(d.requeued),
            }
        }

    def summary_lines(self) -> list[str]:
        return [f"prompts         re-queued {self.disp.requeue_count}, waiting to be re-sent {len(self.disp.requeued)}"]

    def close(self, wait_s: float = 10.0) -> None:
        """Stop workers still running (the run ended on an exception before `finish`). A worker
        that died meanwhile (torchrun SIGTERMs every rank when one dies) never takes its stop
        message, so the wait is bounded: the trainer must still write its exit code."""
        for w in self.live + self.rejected:
            try:
                self.ch.send(pack({"kind": "stop"}), w)
            except RuntimeError:  # gone already (its connection closed): nothing to stop
                log.info("[trainer] rollout worker rank %d is gone; no stop message sent", self.names.get(w, w))
        self.live, self.rejected = [], []
        flushing = threading.Thread(target=self._flush_quietly, name="stop-workers", daemon=True)
        flushing.start()
        flushing.join(wait_s)
        if flushing.is_alive():
            log.warning("[trainer] a rollout worker did not take its stop message within %.0f s (gone)", wait_s)

    def _flush_quietly(self) -> None:
        try:
            self.ch.flush()
        except RuntimeError as e:  # a worker that closed its connection meanwhile
            log.info("[trainer] a stop message was not delivered (%s)", str(e).splitlines()[0][:200])


# --------------------------------------------------------------------------- entry point (torchrun)


def main(argv: list[str] | None = None) -> int:
    """One process of a disaggregated run (under torchrun): a trainer rank or a rollout worker."""

    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m loomrl.platform.disaggregated")
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume-from")
    ap.add_argument("--max-steps", type=int)
    args = ap.parse_args(argv)
    recipe = R.load_recipe(args.recipe, args.overrides)
    trainers, workers = recipe.training.nproc, recipe.pipeline.rollout_workers
    timeout = timedelta(seconds=max(60.0, recipe.pipeline.worker_timeout_s))
    store, grank, gworld = next(dist.rendezvous("env://", timeout=timeout))
    assert gworld == trainers + workers, (gworld, trainers, workers)
    # the transport: trainer rank 0 (transport rank 0) and the workers (1..W)
    names = {1 + i: trainers + i for i in range(workers)}  # transport rank -> global rank
    trank = 0 if grank == 0 else (grank - trainers + 1 if grank >= trainers else None)
    pg = None
    if trank is not None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("loomrl-transport", store), trank, workers + 1, timeout)
    out = Path(args.out)
    if grank >= trainers:
        rollout_role(recipe, grank, Channel(pg=pg), trainer=0)
        code = None
    else:
        # the trainer ranks' own group: the training engine sees only them
        os.environ.update(
            RANK=str(grank), WORLD_SIZE=str(trainers), LOCAL_RANK=str(grank), LOCAL_WORLD_SIZE=str(trainers)
        )
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore("loomrl-trainers", store), rank=grank, world_size=trainers, timeout=timeout
        )
        code = trainer_role(recipe, out, args, grank, pg, names)
    # Exit without a collective: a dead peer would make destroy_process_group wait.
    sys.stdout.flush()
    sys.stderr.flush()
    if code is not None and grank == 0:
        (out / EXIT_FILE).write_text(str(code))
    os._exit(0)


def trainer_role(recipe: R.Recipe, out: Path, args, grank: int, pg, names: dict[int, int]) -> int:

    def source(trainer):
        if grank != 0:
            return FollowerSource()
        inner = WorkerSource(trainer, Channel(pg=pg), sorted(names), names)
        return LeaderSource(inner) if recipe.training.nproc > 1 else inner

    # Outside the RL loop (whose own handler checkpoints first) a SIGTERM from torchrun, sent when a
    # worker dies, must not kill the trainer before it has settled its books and written its exit code.
    signal.signal(signal.SIGTERM, lambda signum, frame: log.warning("[trainer] signal %d: settling the run", signum))
    resume_from = Path(args.resume_from) if args.resume_from else None
    trainer = Trainer(recipe, out, resume_from, args.max_steps, source)
    try:
        result = trainer.run()
    except Interrupted as e:
        log.warning("[run] %s", e)
        return 130
    except ValueError as e:  # a checkpoint that does not fit (or another recipe's)
        if resume_from is None:
            raise
        log.error("error: cannot resume from %s: %s", resume_from, e)
        return 2
    if grank == 0:
        log.info("%s", result.summary)
    if result.error:
        return 2
    return 3 if result.goal_met is False else 0


if __name__ == "__main__":
    main()
