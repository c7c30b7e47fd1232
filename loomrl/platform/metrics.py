"""Per-step metrics: metrics.jsonl (one JSON object per line, flushed each step)
and TensorBoard event files."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, out: Path, filename: str = "metrics.jsonl", tensorboard: bool = True, prefix: str = ""):
        self.path = out / filename
        self.prefix = prefix
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(self.prefix + k, v, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line: {e}") from None
    return rows
