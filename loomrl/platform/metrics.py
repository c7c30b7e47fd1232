"""Per-step metrics: metrics.jsonl (one JSON object per line, flushed each step),
TensorBoard event files, and the run's experiment trackers (wandb, MLflow: trackers.py), which
get each row as it is written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

# What two runs of one seed may differ in, and comparisons of their rows leave out: timings (seconds
# and microseconds by their unit suffix: the phase timers are named `<phase>_s`; by name the two
# ratios of timings) and counters of one process (a resumed run's process starts them at 0; its
# encoding cache starts empty, so it encodes what the uninterrupted run served from its cache).
# Every other field, algorithm statistics such as clip_frac included, must be equal.
TIMING_UNITS = ("_s", "_us")
TIMING_RATIOS = ("trainer_idle_frac", "drafting_speedup")
PER_PROCESS = (
    "transport_bytes_sent",
    "transport_bytes_received",
    "media_bytes_sent_to_workers",
    "media_bytes_naive_to_workers",
    "vllm_sync_logp_diff",
    "enc_calls",
    "enc_bytes_moved",
    "enc_cache_hits",
    "enc_cache_misses",
    "enc_cache_entries",
)


def comparable(row: dict) -> dict:
    """A metrics row without its timings and per-process counters (see above)."""
    return {k: v for k, v in row.items() if not k.endswith(TIMING_UNITS) and k not in TIMING_RATIOS + PER_PROCESS}


class MetricsLog:
    """A metrics file of the run folder, with its TensorBoard copy and the run's trackers (the
    caller owns and closes `trackers`: the warm-up and the RL log share them)."""

    def __init__(
        self, out: Path, filename: str = "metrics.jsonl", tensorboard: bool = True, prefix: str = "", trackers=None
    ):
        self.path = out / filename
        self.prefix = prefix
        self.trackers = trackers
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(self.prefix + k, v, row["step"])
        if self.trackers is not None:
            self.trackers.log(row, self.prefix)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class MetricsError(ValueError):
    """A metrics file that cannot be read as rows of steps: the message names the file and line."""


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics file: JSON objects with an integer `step`. A last line without its
    newline that does not parse is what a run killed while writing it leaves: it is dropped with
    a warning (the `loomrl` logger). Anything else unreadable is a MetricsError naming path:line."""
    rows = []
    try:
        with open(path, "rb") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:  # not JSON, not UTF-8
                    if not line.endswith(b"\n"):  # the last line, cut by a kill in the middle of a write
                        logging.getLogger("loomrl").warning(
                            "warning: %s:%d: an incomplete last line (the run stopped while writing it); dropped",
                            path,
                            i,
                        )
                        break
                    raise MetricsError(f"{path}:{i}: not a JSON line: {e}") from None
                if not isinstance(row, dict):
                    raise MetricsError(f"{path}:{i}: not a JSON object (got {type(row).__name__})")
                step = row.get("step")
                if isinstance(step, bool) or not isinstance(step, int):
                    raise MetricsError(f"{path}:{i}: no integer 'step' (got {str(step)[:40]!r})")
                rows.append(row)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None
    return rows
