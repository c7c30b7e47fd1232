"""`loomrl bench demo`: does the embedded demo learn on every machine?

One run of a tiny RL job is one draw: the floats of a CPU kernel depend on the instruction
set torch picks (oneDNN / MKL choose by CPU), on the thread count that splits a reduction,
and on the seed, and RL amplifies a last-bit difference into another run. So the demo's
claim is a grid, not a run: every cell is `loomrl run RECIPE` with one seed, one
`training.threads` and one CPU capability (`ATEN_CPU_CAPABILITY=avx2` makes torch pick the
kernels an AVX2-only CPU would; `default` is what this CPU gets), and the table shows each
cell's reward over the first RL steps and the last ones, the part of the reward it got least of
at the end (`slot_match`: which slot; a cell that stalls says where), whether the recipe's goal
was met, and the median over the cells.

Cells run as separate processes, as many at once as their threads fit the cores
(`--jobs-cores`); each cell's `wall_s` is its own run time while sharing the machine that way, so
the figure to quote for "run time on 2 cores" is a cell run alone (`--jobs-cores 1`).

    loomrl bench demo                                   # the grid: seeds 0-4 x threads 1,2 x default,avx2
    loomrl bench demo --seeds 0,1 --threads 2 --capabilities default --json
    loomrl bench demo --recipe recipes/demo-ppo.yaml rollout.engine=vllm   # overrides go to every cell

The JSON last line: {"recipe", "overrides", "cells": [{"seed", "threads", "capability",
"kernels" (what torch reported in the cell), "first", "last", "best", "goal_met", "wall_s", "parts":
{name: mean over the last steps} of the reward's parts (`slot_match`: slot_size, slot_color,
slot_pitch; the table names the weakest)},
...], "median_last", "cells_met", "cells_total"}; exit 0 when every cell met the goal, else 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loomrl.platform import recipe as R
from loomrl.platform.parts import shard_files
from loomrl.platform.recipe import RecipeError

log = logging.getLogger("loomrl")


def _cells(seeds: list[int], threads: list[int], caps: list[str]) -> list[dict]:
    """Grouped by thread count, so cells of equal width share the cores without leaving one idle."""
    return [{"seed": s, "threads": t, "capability": c} for t in threads for c in caps for s in seeds]


def _command(recipe: str, cell: dict, out: Path, overrides: list[str]) -> tuple[list[str], dict]:
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        recipe,
        "--out",
        str(out),
        *overrides,
        f"training.seed={cell['seed']}",
        f"training.threads={cell['threads']}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(cell["threads"]), PYTHONUNBUFFERED="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cell["capability"] != "default":
        env["ATEN_CPU_CAPABILITY"] = cell["capability"]
    return cmd, env


def _result(cell: dict, out: Path, rc: int, wall: float, first_n: int, last_n: int) -> dict:
    """The cell's figures from its run folder (metrics.jsonl, summary.json)."""
    rows = []
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    res = dict(
        cell,
        rc=rc,
        wall_s=round(wall, 1),
        steps=len(rewards),
        goal_met=summary.get("goal_met"),
        first=None,
        last=None,
        best=None,
        kernels=summary.get("machine", {}).get("cpu_capability"),
    )
    if rewards:
        res.update(
            first=round(statistics.fmean(rewards[:first_n]), 4),
            last=round(statistics.fmean(rewards[-last_n:]), 4),
            best=round(max(rewards), 4),
        )
    # what the reward is made of over the last steps (reward_<part>_mean: slot_match's slots)
    tail = [r for r in rows if "reward_mean" in r][-last_n:]
    names = sorted({k for r in tail for k in r if k.startswith("reward_") and k.endswith("_mean")} - {"reward_mean"})
    res["parts"] = {
        n[len("reward_") : -len("_mean")]: round(statistics.fmean(r[n] for r in tail if n in r), 4) for n in names
    }
    return res


def weakest(parts: dict) -> str:
    """The part of the reward a cell got least of over its last steps, as `name value`."""
    if not parts:
        return "-"
    name = min(parts, key=lambda n: (parts[n], n))
    return f"{name.removeprefix('slot_')} {parts[name]}"


def _prepare(recipe: str, overrides: list[str]) -> tuple[int, int]:
    """Check the recipe and write the demo shards once, before cells that would all try to; the
    goal's (first, last) step counts, which the table averages over."""

    loaded = R.load_recipe(recipe, overrides)
    shard_files(loaded)
    return (loaded.goal.first_steps, loaded.goal.last_steps) if loaded.goal is not None else (5, 10)


def run_grid(
    recipe: str, cells: list[dict], overrides: list[str], workdir: Path, cores: int, *, first_n: int, last_n: int
) -> list[dict]:
    """Run every cell (as many at once as fit `cores` by their threads); their results in order."""
    todo = list(enumerate(cells))
    running: list[tuple[int, subprocess.Popen, Path, float, object]] = []
    results: dict[int, dict] = {}
    while todo or running:
        busy = sum(cells[i]["threads"] for i, *_ in running)
        while todo and (not running or busy + todo[0][1]["threads"] <= cores):
            i, cell = todo.pop(0)
            out = workdir / f"seed{cell['seed']}-t{cell['threads']}-{cell['capability']}"
            cmd, env = _command(recipe, cell, out, overrides)
            logf = open(workdir / f"{out.name}.log", "w")
            running.append(
                (
                    i,
                    subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT),
                    out,
                    time.perf_counter(),
                    logf,
                )
            )
            busy += cell["threads"]
        time.sleep(0.5)
        for item in list(running):
            i, proc, out, t0, logf = item
            if proc.poll() is None:
                continue
            logf.close()
            running.remove(item)
            results[i] = _result(cells[i], out, proc.returncode, time.perf_counter() - t0, first_n, last_n)
            r = results[i]
            log.info(
                "[bench demo] seed %d threads %d %-7s  %s -> %s  goal %s  %.0f s",
                r["seed"],
                r["threads"],
                r["capability"],
                r["first"],
                r["last"],
                {True: "MET", False: "NOT MET"}.get(r["goal_met"], f"rc {r['rc']}"),
                r["wall_s"],
            )
    return [results[i] for i in range(len(cells))]


def table(results: list[dict]) -> str:
    lines = [
        "| seed | threads | CPU kernels | reward first -> last | best | weakest part | goal | run s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        goal = {True: "met", False: "NOT MET"}.get(r["goal_met"], f"failed (exit {r['rc']})")
        lines.append(
            f"| {r['seed']} | {r['threads']} | {r['kernels'] or r['capability']} | {r['first']} -> {r['last']} | "
            f"{r['best']} | {weakest(r.get('parts', {}))} | {goal} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="loomrl bench demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every cell (key=value)")
    ap.add_argument("--recipe", default="recipes/demo.yaml")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument(
        "--capabilities",
        default="default,avx2",
        help="comma-separated: default (this CPU's) and/or ATEN_CPU_CAPABILITY values (avx2, ...)",
    )
    ap.add_argument(
        "--jobs-cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores the cells may use at once (a cell takes its thread count); 1 runs them one by one",
    )
    ap.add_argument("--out", help="keep the cells' run folders here (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = ap.parse_args(argv)
    cells = _cells(_ints(args.seeds), _ints(args.threads), [c for c in args.capabilities.split(",") if c])
    if not cells:
        ap.error("no cells: give --seeds, --threads and --capabilities")

    try:  # what every cell would refuse is refused once, before any cell runs
        first_n, last_n = _prepare(args.recipe, args.overrides)
    except RecipeError as e:
        log.error("error: %s", e)
        return 2
    with tempfile.TemporaryDirectory(prefix="loomrl-bench-demo-") as tmp:
        workdir = Path(args.out) if args.out else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_grid(args.recipe, cells, args.overrides, workdir, args.jobs_cores, first_n=first_n, last_n=last_n)
    lasts = [r["last"] for r in results if r["last"] is not None]
    met = sum(r["goal_met"] is True for r in results)
    median = round(statistics.median(lasts), 4) if lasts else None
    print(table(results))
    print(f"\n{met} of {len(results)} cells met the goal; median reward over the last steps {median}")
    if args.json:
        print(
            json.dumps(
                {
                    "recipe": args.recipe,
                    "overrides": args.overrides,
                    "cells": results,
                    "median_last": median,
                    "cells_met": met,
                    "cells_total": len(results),
                }
            )
        )
    return 0 if met == len(results) else 3
