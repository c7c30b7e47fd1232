"""`loomrl report DIR`: DIR/report.png with reward (training and validation), loss, entropy,
throughput, time per step and the reward's parts (`reward_<part>_mean`, e.g. slot_match's slots).
A supervised run (`algorithm.name: sft`) has no training reward: its reward panel shows the
validation reward alone.

`loomrl report DIR1 DIR2 ... --out FILE.png`: the runs overlaid, one line per run (its folder's
name) in each panel of `COMPARE` (10-step means): reward, entropy, the rollout/trainer log-prob
mismatch and KL, the largest importance ratio and the share of tokens outside the importance
window, e.g. the same recipe under different rounding settings."""

from __future__ import annotations

import json
from pathlib import Path

from loomrl.platform.metrics import read_metrics


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _number(v) -> bool:
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1e300)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows whose `key` is a number (NaN included: a diverged run shows it)."""
    pts = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def _final_validation(run_dir: Path, rows: list[dict]) -> list[dict]:
    """The validation after the last step, which only summary.json holds (rows carry the ones
    before their step)."""

    try:
        validations = json.loads((run_dir / "summary.json").read_text()).get("validation") or []
        last = validations[-1]
        return [last] if last["step"] > rows[-1]["step"] and _number(last.get("val_reward_mean")) else []
    except (OSError, ValueError, AttributeError, IndexError, KeyError, TypeError):
        return []  # no summary (a run still going), or one from another version: the rows alone


def _rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows; an error naming the file when there are none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a loomrl run folder?)")
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path}: no steps recorded")
    return rows


def write_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(run_dir)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    panels = [
        (axes[0, 0], "reward_mean", "reward (mean per step)"),
        (axes[0, 1], "loss", "loss"),
        (axes[1, 0], "tokens_per_s", "rollout throughput (tokens/s)"),
        (axes[1, 1], None, "time per step (s)"),
        (axes[0, 2], "entropy", "entropy"),
        (axes[1, 2], "parts", "reward by part (10-step mean)"),
    ]
    for ax, key, title in panels:
        # a key a run did not log (an older run folder), or logged as something other than a
        # number, leaves its points out (its panel empty), not a traceback
        if key is None:
            for k in ("rollout_s", "train_s"):
                xs, vals = _series(rows, k)
                if xs:
                    ax.plot(xs, vals, label=k.replace("_s", ""))
            ax.legend()
        elif key == "parts":
            parts = sorted(
                {k for r in rows for k in r if k.startswith("reward_") and k.endswith("_mean")} - {"reward_mean"}
            )
            for k in parts:
                xs, vals = _series(rows, k)
                if xs:
                    ax.plot(xs, _smooth(vals), label=k[len("reward_") : -len("_mean")])
            if parts:
                ax.legend()
            else:
                ax.text(0.5, 0.5, "the reward reports no parts", ha="center", transform=ax.transAxes)
        elif _series(rows, key)[0] or (key == "reward_mean" and _series(rows, "val_reward_mean")[0]):
            xs, vals = _series(rows, key)
            if xs:
                ax.plot(xs, vals, alpha=0.35, label="per step")
                ax.plot(xs, _smooth(vals), label="10-step mean")
            if key == "reward_mean":  # the held-out split, where the run validates (the final one: summary)
                vx, vv = _series(rows + _final_validation(run_dir, rows), "val_reward_mean")
                if vx:
                    ax.plot(vx, vv, "o-", label="validation")
            ax.legend()
        else:
            ax.text(0.5, 0.5, f"{key}: not logged by this run", ha="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    warm = run_dir / "warmup.jsonl"
    subtitle = f"{run_dir.name}: {len(rows)} steps"
    if warm.is_file():
        subtitle += f" after {len(read_metrics(warm))} warm-up steps"
    fig.suptitle(subtitle)
    fig.tight_layout()
    out = run_dir / "report.png"
    tmp = run_dir / ".report.png.tmp"
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


COMPARE = (
    ("reward_mean", "reward (mean per step)"),
    ("entropy", "entropy"),
    ("logp_mismatch", "mean |rollout - trainer logp| (symlog)"),
    ("rollout_kl", "KL(rollout || trainer), k3 (symlog)"),
    ("is_ratio_max", "largest importance ratio"),
    ("is_outside_frac", "share of tokens outside the IS window"),
)
"""The panels of `write_comparison`: (metrics key, title)."""

SYMLOG = {"logp_mismatch": 1e-9, "rollout_kl": 1e-12}
"""Panels whose values span decades down to exactly 0: a symlog y axis, linear below this."""


def write_comparison(run_dirs: list[Path], out: Path) -> Path:
    """The runs' `COMPARE` curves overlaid into `out` (a PNG), written atomically."""
    import matplotlib.pyplot as plt

    fig = comparison_figure(run_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


def comparison_figure(run_dirs: list[Path]):
    """The matplotlib figure of `write_comparison`: a panel per `COMPARE` metric, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(d.name, _rows(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (key, title) in zip(axes.flat, COMPARE):
        for name, rows in runs:
            xs, vals = _series(rows, key)
            if xs:
                ax.plot(xs, _smooth(vals), label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in SYMLOG:
            ax.set_yscale("symlog", linthresh=SYMLOG[key])
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"{key}: not logged by these runs", ha="center", transform=ax.transAxes)
    fig.suptitle(f"{len(runs)} runs, 10-step means")
    fig.tight_layout()
    return fig
