"""The experiment trackers (loomrl/platform/trackers.py): wandb (offline) and MLflow (file store)
hold exactly the numeric values of metrics.jsonl and warmup.jsonl, read back with each library's
own reader (`wandb leet inspect --json` on the run's .wandb logs; `MlflowClient`), a resumed run
logs into the same wandb and MLflow run, and an enabled tracker whose library is missing is a
recipe error at `--dry-run`. Nothing contacts a server (WANDB_MODE=offline, a local file store)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loomrl.cli import main
from loomrl.platform import recipe as R
from loomrl.platform.metrics import MetricsLog, read_metrics
from loomrl.platform.trackers import IDS_FILE, Trackers

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "recipes" / "demo.yaml")

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """wandb never goes online and keeps its settings and caches in the test's folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def numeric(row: dict, prefix: str = "") -> dict:
    """What a tracker must hold of a metrics row: its numbers (booleans and lists are not)."""
    return {prefix + k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def expected_rows(out: Path) -> list[dict]:
    """The run's rows in the order they were written: the warm-up's (prefixed), then the RL stage's."""
    warmup = read_metrics(out / "warmup.jsonl") if (out / "warmup.jsonl").exists() else []
    return [numeric(r, "warmup/") for r in warmup] + [numeric(r) for r in read_metrics(out / "metrics.jsonl")]


def same(a, b) -> bool:
    """Equal numbers (NaN equals NaN), key for key."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def wandb_logs(out: Path, run_id: str) -> list[Path]:
    """The .wandb logs of one run id, oldest first (an offline resume writes another one)."""
    return sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def wandb_records(path: Path) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def wandb_history(out: Path, run_id: str) -> list[dict]:
    """wandb's history rows of the run (its own `_` fields left out), every log in order."""
    logs = wandb_logs(out, run_id)
    assert logs, f"no .wandb log of run {run_id} under {out}"
    rows = []
    for path in logs:
        for rec in wandb_records(path):
            assert rec["type"] != "run" or rec["run"]["run_id"] == run_id
            if rec["type"] == "history":
                rows.append({k: v for k, v in rec["history"]["item"].items() if not k.startswith("_")})
    return rows


def mlflow_history(out: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    keys = client.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


def expected_mlflow(out: Path) -> dict[str, list[tuple[int, float]]]:
    want: dict[str, list] = {}
    for row in expected_rows(out):
        step = row.get("step", row.get("warmup/step"))
        for k, v in row.items():
            if k not in ("step", "warmup/step"):
                want.setdefault(k, []).append((step, float(v)))
    return want


def check_trackers(out: Path) -> dict:
    """Both trackers hold exactly the run folder's rows; their run ids (RUN/trackers.json)."""
    ids = json.loads((out / IDS_FILE).read_text())
    rows = expected_rows(out)
    assert rows
    assert same(wandb_history(out, ids["wandb"]), rows)
    got, want = mlflow_history(out, ids["mlflow"]), expected_mlflow(out)
    assert got.keys() == want.keys()
    for key in want:
        assert same(sorted(got[key]), want[key]), key
    return ids


def logging_config(**wandb) -> R.LoggingConfig:
    return R.LoggingConfig(
        tensorboard=False, wandb=R.WandbConfig(enabled=True, **wandb), mlflow=R.MLflowConfig(enabled=True)
    )


def write(out: Path, trackers: Trackers, warmup: list[dict], rows: list[dict]) -> None:
    """Rows through MetricsLog, as the trainer writes them (the warm-up's first)."""
    for name, prefix, batch in (("warmup.jsonl", "warmup/", warmup), ("metrics.jsonl", "", rows)):
        metrics = MetricsLog(out, name, tensorboard=False, prefix=prefix, trackers=trackers)
        for row in batch:
            metrics.log(row)
        metrics.close()


def test_rows_reach_both_trackers_and_a_resume_continues_their_runs(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    recipe = {"name": "t", "training": {"lr": 0.001, "freeze": ["vision"]}, "logging": {"wandb": {"tags": ["a"]}}}
    first = Trackers(logging_config(tags=["a"]), out, recipe)
    warmup = [{"step": s, "loss": 2.0 / (s + 1), "grad_norm": 0.5 + s} for s in range(3)]
    rows = [
        {"step": 0, "reward_mean": 0.125, "loss": -0.25, "tokens": 96, "ok": True, "by_reason": {"x": 1}},
        {"step": 1, "reward_mean": 1 / 3, "loss": 1e-12, "tokens": 80, "ok": False, "lens": [1, 2]},
    ]
    write(out, first, warmup, rows)
    first.close()
    ids = json.loads((out / IDS_FILE).read_text())
    assert check_trackers(out) == ids

    second = Trackers(logging_config(tags=["a"]), out, recipe, resume=True)
    assert {t.name: t.id for t in second.active} == ids  # the same wandb and MLflow runs
    write(out, second, [], [{"step": 2, "reward_mean": 0.75, "loss": 0.5, "tokens": 64}])
    second.close()
    assert json.loads((out / IDS_FILE).read_text()) == ids
    assert len(wandb_logs(out, ids["wandb"])) == 2  # offline: one log per process, one run id
    check_trackers(out)

    from mlflow.tracking import MlflowClient

    run = MlflowClient((out / "mlruns").resolve().as_uri()).get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    assert run.data.params["training.lr"] == "0.001" and run.data.params["training.freeze"] == '["vision"]'
    config = next(r for r in wandb_records(wandb_logs(out, ids["wandb"])[0]) if r["type"] == "run")["run"]
    assert config["config"]["update"]["training"] == recipe["training"] and config["tags"] == ["a"]


def test_a_new_run_starts_new_tracker_runs(tmp_path):
    """Without resume the ids in the folder are not reused (a run started over is a new run)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / IDS_FILE).write_text(json.dumps({"wandb": "oldrun01", "mlflow": "0" * 32}))
    trackers = Trackers(logging_config(), out, {"name": "t"})
    trackers.close()
    ids = json.loads((out / IDS_FILE).read_text())
    assert ids["wandb"] != "oldrun01" and ids["mlflow"] != "0" * 32


@pytest.mark.parametrize("tracker, package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_a_missing_library_is_refused_at_dry_run(tracker, package, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, tracker, None)  # as if it were not installed
    assert main(["run", DEMO, "--dry-run", f"logging.{tracker}.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert f"logging.{tracker}.enabled: {tracker} is not installed; pip install {package}" in err, err
    R.load_recipe(DEMO, [f"logging.{tracker}.enabled=false"], files=False)  # off: not needed


def test_tracker_settings_are_checked():
    with pytest.raises(R.RecipeError, match=r"logging\.wandb\.mode"):
        R.load_recipe(DEMO, ["logging.wandb.mode=cloud"], files=False)
    with pytest.raises(R.RecipeError, match=r"logging\.wandb\.tags\[1\]"):
        R.load_recipe(DEMO, ["logging.wandb.tags=[a, '']"], files=False)
    with pytest.raises(R.RecipeError, match=r"logging\.mlflow\.experiment"):
        R.load_recipe(DEMO, ["logging.mlflow.experiment= "], files=False)
    R.load_recipe(DEMO, ["logging.wandb.enabled=true", "logging.mlflow.enabled=true"], files=False)


def cli(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        DEMO,
        "--out",
        str(tmp / "run"),
        f"data.shards={tmp}/shards/demo-*.tar",
        "data.demo.samples=48",
        "data.shuffle_buffer=20",
        "training.steps=4",
        "training.warmup.steps=2",
        "training.warmup.batch_size=4",
        "training.mini_batches=1",
        "training.prompts_per_step=4",
        "rollout.n=4",
        "logging.tensorboard=false",
        "logging.wandb.enabled=true",
        "logging.wandb.tags=[test]",
        "logging.mlflow.enabled=true",
        "goal=null",
        *extra,
    ]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_and_its_resume_log_the_metrics_files_to_both_trackers(tmp_path):
    first = cli(tmp_path, "--max-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "run"
    ids = check_trackers(out)
    assert len(read_metrics(out / "metrics.jsonl")) == 2 and len(read_metrics(out / "warmup.jsonl")) == 2

    rest = cli(tmp_path, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert check_trackers(out) == ids  # the same runs, holding all four steps
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert len(wandb_logs(out, ids["wandb"])) == 2

    recipe = yaml.safe_load((out / "recipe.yaml").read_text())  # the run's recipe: wandb config, MLflow params
    first_log = wandb_records(wandb_logs(out, ids["wandb"])[0])
    config = next(r for r in first_log if r["type"] == "run")["run"]["config"]["update"]
    assert {k: v for k, v in config.items() if k != "_wandb"} == recipe

    def leaves(d: dict, prefix: str = "") -> dict:
        return {
            k2: v2
            for k, v in d.items()
            for k2, v2 in (leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k: v}).items()
        }

    from mlflow.tracking import MlflowClient

    params = MlflowClient((out / "mlruns").resolve().as_uri()).get_run(ids["mlflow"]).data.params
    assert len(params) > 100 and params.keys() == leaves(recipe).keys()  # more than one batch of 100
    assert params["training.steps"] == "4" and params["name"] == recipe["name"]
