"""`loomrl bench shards`: `loomrl shards make` throughput by source, side by side in one run: the
same small samples from a JSONL manifest with one image file each, and from a parquet file with
the images' bytes in a column (the layout of verl's and EasyR1's training files).

    loomrl bench shards [--samples 10000] [--workers 4] [--dir DIR]

Each sample: a distinct 32x32 PNG of seeded noise, a prompt with `<image>`, an answer. Both
sources are written to DIR (a new temporary folder by default), then `loomrl shards make SOURCE
--out ... --json` runs on each in its own process, in ABBA order (jsonl, parquet, parquet, jsonl:
a drift of the machine during the run falls on both alike); the seconds are the command's own
(`seconds` in its JSON: reading, checking, writing; not the interpreter's start). Prints each
source's samples and mean seconds per sample, and parquet's speed relative to JSONL + files."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

HERE = Path(__file__).resolve().parents[2]
log = logging.getLogger("loomrl")


def crops(n: int, seed: int = 0) -> list[bytes]:
    """n distinct 32x32 PNGs of seeded noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def write_sources(folder: Path, images: list[bytes]) -> tuple[Path, Path]:
    """folder/jsonl/m.jsonl (+ media/i.png) and folder/parquet/m.parquet of the same samples."""
    media = folder / "jsonl" / "media"
    media.mkdir(parents=True)
    rows = []
    with open(folder / "jsonl" / "m.jsonl", "w") as fh:
        for i, data in enumerate(images):
            (media / f"{i}.png").write_bytes(data)
            line = {"id": f"s{i}", "prompt": "<image> what is in the crop ?", "answer": str(i % 10)}
            fh.write(json.dumps({**line, "image": f"media/{i}.png"}) + "\n")
            rows.append({**line, "image": {"bytes": data, "path": f"{i}.png"}})
    (folder / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), folder / "parquet" / "m.parquet")
    return folder / "jsonl" / "m.jsonl", folder / "parquet" / "m.parquet"


def make(source: Path, out: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "loomrl.cli", "shards", "make", str(source), "--out", f"{out}/s-%06d.tar"]
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    p = subprocess.run([*cmd, "--workers", str(workers), "--json"], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return json.loads(p.stdout)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="loomrl bench shards", description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the sources (default: a temp folder)")
    args = ap.parse_args(argv)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-shards-"))
    sources = dict(zip(("jsonl + files", "parquet bytes"), write_sources(folder, crops(args.samples))))
    per: dict[str, list[float]] = {name: [] for name in sources}
    for i, name in enumerate(["jsonl + files", "parquet bytes", "parquet bytes", "jsonl + files"]):
        r = make(sources[name], folder / f"out-{i}", args.workers)
        per[name].append(r["seconds"] / max(1, r["written"]))
        log.info("[bench] %-14s %d samples in %.2f s", name, r["written"], r["seconds"])
    for name, times in per.items():
        log.info("%-14s %.3f ms per sample (mean of %d)", name, 1e3 * sum(times) / len(times), len(times))
    ratio = sum(per["jsonl + files"]) / sum(per["parquet bytes"])
    log.info("parquet with bytes vs JSONL + files: %.2fx the speed per sample", ratio)
    return 0
