"""Experiment trackers: the run's metrics rows, fanned out to Weights & Biases and MLflow.

`metrics.jsonl` is the run's record; a tracker is a second copy of it for a dashboard. Each
enabled tracker (`logging.wandb`, `logging.mlflow`) gets every row `MetricsLog` writes, in the same
order, as numeric scalars under the same keys (a warm-up row's keys under `warmup/`), and the
run's recipe (RUN/recipe.yaml's dict) once: as the wandb config, and flattened into MLflow params.

- wandb: a row is one history row holding `step` (warm-up: `warmup/step`), declared as the
  x-axis of each of the row's metrics (`define_metric`, key by key, without `step_sync`, which
  would add keys to rows): wandb's own `_step` must only grow, and the warm-up and the RL stage
  each count their steps from 0. Offline by default (nothing leaves the machine;
  `wandb sync` uploads later); console capture, system stats, git and code saving are off.
- MLflow: a row is a batch of metrics at the row's step, through `MlflowClient` (no global active
  run). The default store is a local file store, RUN/mlruns; MLflow 3 refuses file stores unless
  MLFLOW_ALLOW_FILE_STORE is set, so it is set (when unset) for `file:` URIs.

Resume: the trackers' run ids are kept in RUN/trackers.json; a run resumed from a checkpoint
logs into the same wandb run (`resume="allow"`) and the same MLflow run. Only rank 0 (the
process that writes the run folder) starts trackers. Starting a tracker that fails (no login
for wandb online, a tracking server that does not answer) stops the run before it trains; a
failure while logging warns once and turns that tracker off, since metrics.jsonl holds the rows.
The libraries are imported when a tracker starts, so loomrl needs neither unless it is enabled
(`recipe.validate_trackers` refuses an enabled one that is not installed)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("loomrl")

IDS_FILE = "trackers.json"
"""RUN/trackers.json: {"wandb": run id, "mlflow": run id} of the trackers a run started."""


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The row's numeric scalars (not booleans, not lists or mappings), keys prefixed."""
    return {prefix + k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    """A nested mapping as {"a.b.c": leaf}: how a recipe becomes MLflow params."""
    out: dict[str, object] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_ids(out: Path) -> dict:
    """The tracker run ids kept in the run folder ({} when none, or unreadable)."""
    try:
        data = json.loads((out / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class WandbTracker:
    """One wandb run (see the module docstring)."""

    name = "wandb"

    def __init__(self, cfg, out: Path, config: dict, run_id: Optional[str]):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        settings = wandb.Settings(
            console="off",
            silent=True,
            disable_git=True,
            disable_code=True,
            save_code=False,
            x_disable_stats=True,
            x_save_requirements=False,
        )
        folder = Path(cfg.dir) if cfg.dir is not None else out
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name or out.resolve().name,
            tags=list(cfg.tags),
            mode=cfg.mode,
            dir=str(folder),
            config=config,
            id=run_id,
            resume="allow",
            settings=settings,
        )
        self.id = self.run.id
        self.defined: set[str] = set()

    def log(self, row: dict, prefix: str) -> None:
        values = scalars(row, prefix)
        x = prefix + "step"
        for key in sorted(values.keys() - self.defined):  # each metric's x-axis, once, when it first appears
            if key != x:  # per key: a glob ("*") would also match the warm-up's keys; no step_sync: it adds keys
                self.run.define_metric(key, step_metric=x, step_sync=False)
            self.defined.add(key)
        self.run.log(values)

    def where(self) -> str:
        if self.run.offline:
            return f"run {self.id}, offline in {Path(self.run.dir).parent} (upload: wandb sync FOLDER)"
        return f"run {self.id}: {self.run.url}"

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


_PARAM_KEY = re.compile(r"[^\w./ :-]")


class MLflowTracker:
    """One MLflow run (see the module docstring)."""

    name = "mlflow"

    def __init__(self, cfg, out: Path, config: dict, run_id: Optional[str]):
        uri = cfg.tracking_uri or (out.resolve() / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores otherwise
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        self.uri = uri
        run = self.existing(run_id)
        if run is None:
            found = self.client.get_experiment_by_name(cfg.experiment)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(cfg.experiment)
            run = self.client.create_run(experiment, run_name=cfg.run_name or out.resolve().name)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.id = run.info.run_id
        self.log_params(config, set(run.data.params))

    def existing(self, run_id: Optional[str]):
        """The run of `run_id` in this store (None: no id, or the store does not have it)."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException:
            log.warning("warning: logging.mlflow: run %s is not in %s; starting a new MLflow run", run_id, self.uri)
            return None

    def log_params(self, config: dict, present: set) -> None:
        """The recipe, flattened, as params (within MLflow's key and value lengths and batch size);
        on resume the params the run holds already are left as they are (params cannot change)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = []
        for key, value in flatten(config).items():
            key = _PARAM_KEY.sub("_", key)[:MAX_ENTITY_KEY_LENGTH]
            if key in present:
                continue
            text = value if isinstance(value, str) else json.dumps(value)
            params.append(Param(key, text[:MAX_PARAM_VAL_LENGTH]))
            present.add(key)
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, row: dict, prefix: str) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        stamp, step = int(time.time() * 1000), int(row["step"])
        values = scalars(row, prefix)
        values.pop(prefix + "step", None)  # the x-axis of the others
        metrics = [Metric(k, float(v), stamp, step) for k, v in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])

    def where(self) -> str:
        return f"run {self.id} in {self.uri}"

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, status=status.upper())


TRACKERS = {"wandb": WandbTracker, "mlflow": MLflowTracker}


class Trackers:
    """The enabled trackers of a run (none: every call does nothing). `resume`: log into the
    run ids kept in the run folder (a run resumed from a checkpoint); else start new runs."""

    def __init__(self, logging_cfg, out: Path, config: dict, resume: bool = False):
        self.out = out
        self.active: list = []
        ids = read_ids(out) if resume else {}
        try:
            for key, cls in TRACKERS.items():
                cfg = getattr(logging_cfg, key)
                if cfg.enabled:
                    self.active.append(cls(cfg, out, config, ids.get(key)))
                    log.info("[run] logging to %s (run %s)", key, self.active[-1].id)
        except BaseException:
            self.close("failed")
            raise
        if self.active:
            ids.update({t.name: t.id for t in self.active})
            (out / IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, row: dict, prefix: str = "") -> None:
        for tracker in list(self.active):
            try:
                tracker.log(row, prefix)
            except Exception as e:  # the row is in metrics.jsonl: the dashboard's copy stops, the run goes on
                log.warning("warning: logging.%s: %s; not logging to it for the rest of the run", tracker.name, e)
                self.active.remove(tracker)
                self.stop(tracker, "failed")

    def summary_lines(self) -> list[str]:
        """Where each tracker's run is, for the run summary."""
        return [f"{t.name:<16}{t.where()}" for t in self.active]

    def close(self, status: str = "finished") -> None:
        """Finish every tracker's run (flushing its files); called at the end and on errors.
        status: finished, failed (an error), or killed (stopped by a signal, with a checkpoint)."""
        active, self.active = self.active, []
        for tracker in active:
            self.stop(tracker, status)

    @staticmethod
    def stop(tracker, status: str) -> None:
        try:
            tracker.close(status)
        except Exception as e:
            log.warning("warning: logging.%s: closing its run failed: %s", tracker.name, e)
