#!/usr/bin/env python3
"""`loomrl shards make` throughput by source: the same small samples from a JSONL manifest with
one image file each, and from a parquet file with the images' bytes in a column.

    .venv/bin/python tools/bench_sources.py [--samples 10000] [--workers 4] [--dir DIR]

Each sample: a distinct 32x32 PNG crop of a scikit-image photo, a prompt with `<image>`, an
answer. Both sources are written to DIR (a new temporary folder by default), then
`loomrl shards make SOURCE --out ... --json` runs on each in its own process; the seconds are
the command's own (`seconds` in its JSON: reading, checking, writing; not the interpreter's
start). Prints one line per source: samples written, seconds, seconds per sample."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

HERE = Path(__file__).resolve().parent.parent


def crops(n: int) -> list[bytes]:
    """n distinct 32x32 PNGs cut from scikit-image's astronaut and coffee photos."""
    import skimage.data as sk

    photos = [np.asarray(sk.astronaut()), np.asarray(sk.coffee())]
    out = []
    for i in range(n):
        photo = photos[i % 2]
        h, w = photo.shape[0] - 32, photo.shape[1] - 32
        y, x = (i * 7919) % h, (i * 104729) % w
        buf = io.BytesIO()
        Image.fromarray(photo[y : y + 32, x : x + 32]).save(buf, format="PNG")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the sources (default: a temp folder)")
    args = ap.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-sources-"))
    jsonl, parquet = write_sources(folder, crops(args.samples))
    for name, source in (("jsonl + files", jsonl), ("parquet bytes", parquet)):
        r = make(source, folder / f"out-{source.suffix[1:]}", args.workers)
        per = r["seconds"] / max(1, r["written"])
        print(f"{name:14s} {r['written']} samples in {r['seconds']:.2f} s: {per * 1e3:.3f} ms per sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())
