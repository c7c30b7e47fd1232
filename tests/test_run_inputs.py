"""A run folder stands on its own, and interrupted writes leave nothing that misleads a rerun.

- A run's recipe.yaml holds every path absolute, so `export` and `--resume` work from any directory.
- An export killed midway (SIGKILL) leaves a hidden staging folder; the next export beside it
  removes it (its PID is dead). A shard pattern never reads a `.tmp` shard (a `shards make` killed
  midway) and warns that it matches one.
- `export --out` refuses a folder inside a run folder, the working directory and a mount point;
  follows a link to an empty folder; writes its files 0644 (less the umask).
- A preprocessor_config.json whose min_pixels / max_pixels are out of range is refused when the
  recipe is read, naming the file.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from qwen_checkpoints import _qwen2_vl
from test_qwen_vl_checkpoint import OVERRIDES, PADDED

from loomrl.commands.export import export_checkpoint
from loomrl.config.patterns import expand_pattern
from loomrl.datasets.shards import write_shards
from loomrl.platform import recipe as R
from loomrl.platform.checkpoint import latest_checkpoint, save_checkpoint
from loomrl.platform.parts import build_policy_parts

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "data.demo=null",
    "training.steps=2",
    "training.warmup.steps=0",
    "training.mini_batches=1",
    "training.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "training.threads=1",
    "logging.tensorboard=false",
    "goal=null",
]


def loomrl(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        **env,
    )
    return subprocess.run(
        [sys.executable, "-m", "loomrl.cli", *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A run folder of the demo policy: recipe.yaml and one checkpoint, as the trainer writes them."""
    run = tmp_path_factory.mktemp("inputs") / "run"
    recipe = R.load_recipe(ROOT / "recipes" / "demo.yaml", files=False)
    _, _, model = build_policy_parts(recipe)
    save_checkpoint(run / "checkpoints", 1, model, {"torch_rng": torch.get_rng_state()}, {"step": 1}, keep_last=1)
    (run / "recipe.yaml").write_text(R.dump_run(recipe))
    return run


# --------------------------------------------------------------------------- 6: from any directory


def test_dump_run_makes_every_path_absolute(tmp_path):
    recipe = R.load_recipe(None, files=False)
    recipe.model.tokenizer, recipe.model.init_from = "base", "base"
    recipe.data.shards, recipe.data.source, recipe.data.cache = "d/b-*.tar", "d/m.jsonl", "cache"
    recipe.data.chat_template = "t.jinja"
    recipe.validation.shards, recipe.validation.source = "v/{0..3}.tar", "v.json"
    saved = R.dump_run(recipe, tmp_path)
    data = yaml.safe_load(saved)
    for part, key in R.RUN_PATH_KEYS:
        assert data[part][key].startswith(str(tmp_path.resolve()) + os.sep), (part, key, data[part][key])
    recipe.model.tokenizer, recipe.data.chat_template, recipe.model.init_from = "demo", "auto", None
    data = yaml.safe_load(R.dump_run(recipe, tmp_path))
    assert (data["model"]["tokenizer"], data["data"]["chat_template"], data["model"]["init_from"]) == (
        "demo",
        "auto",
        None,
    )


def test_a_run_is_resumed_and_exported_from_another_directory(tmp_path, demo_shards):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    shutil.copytree(demo_shards[0], start / "shards")
    elsewhere.mkdir()
    first = loomrl(
        start,
        "run",
        str(ROOT / "recipes/demo.yaml"),
        "--out",
        "run",
        "data.shards=shards/*.tar",
        *SMALL,
        "--max-steps",
        "1",
    )
    assert first.returncode == 0, first.stderr[-2000:]
    run = start / "run"
    resumed = loomrl(elsewhere, "run", str(run / "recipe.yaml"), "--out", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    exported = loomrl(elsewhere, "export", str(run), "--out", "m", "--modality", "text")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (elsewhere / "m" / "config.json").is_file()
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["data"]["shards"] == str(start / "shards" / "*.tar")


# --------------------------------------------------------------------------- 7: interrupted writes


def test_an_export_killed_midway_is_cleaned_up_by_the_next(demo_run, tmp_path):
    killed = loomrl(tmp_path, "export", str(demo_run), "--out", "m", "--modality", "text", LOOMRL_KILL_AT="export")
    assert killed.returncode == -9, killed.stderr[-2000:]
    stale = [p.name for p in tmp_path.iterdir()]
    assert len(stale) == 1 and stale[0].startswith(".m.export-"), stale
    assert (tmp_path / stale[0] / "hf" / "model.safetensors").is_file()  # a whole model copy, left behind
    rerun = loomrl(tmp_path, "export", str(demo_run), "--out", "m", "--modality", "text")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_stale_staging_folder_of_a_dead_pid_is_removed_a_live_ones_kept(demo_run, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".other.export-{int(dead.stdout)}"
    live = tmp_path / f".busy.export-{os.getppid()}"
    for folder in (stale, live):
        (folder / "hf").mkdir(parents=True)
        (folder / "hf" / "model.safetensors").write_bytes(b"x" * 100)
    export_checkpoint(demo_run, tmp_path / "m", modality="text")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "m"])


def test_a_pattern_never_reads_a_temporary_shard_and_warns(tmp_path, caplog):
    code = (
        "import sys; from loomrl.datasets.shards import write_shards\n"
        "s = [{'id': f's{i}', 'prompt': 'p', 'answer': 'a', 'meta': {}, 'media': []} for i in range(3)]\n"
        "write_shards(s, sys.argv[1], maxcount=1)\n"
    )
    env = dict(os.environ, LOOMRL_KILL_AT="shards", PYTHONPATH=str(ROOT))
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b-%06d.tar")], env=env, timeout=120)
    assert killed.returncode == -9
    assert [p.name for p in tmp_path.iterdir()] == ["b-000000.tar.tmp"]  # a whole shard, under its .tmp name
    write_shards([{"id": "k", "prompt": "p", "answer": "a", "meta": {}, "media": []}], str(tmp_path / "b-1%05d.tar"), 1)
    with caplog.at_level(logging.WARNING, logger="loomrl"):
        files = expand_pattern(str(tmp_path / "b-*"), "data.shards")
    assert files == [str(tmp_path / "b-100000.tar")]
    assert "data.shards" in caplog.text and "b-000000.tar.tmp" in caplog.text and "interrupted" in caplog.text


def test_an_export_into_a_run_folder_is_refused(demo_run, tmp_path):
    run = shutil.copytree(demo_run, tmp_path / "run")
    for out in (run / "checkpoints" / "step-000999", run / "hf"):
        with pytest.raises(ValueError, match="lies in the loomrl run folder"):
            export_checkpoint(run, out, modality="text")
        assert not out.exists()
    assert latest_checkpoint(run / "checkpoints").name == "step-000001"


# --------------------------------------------------------------------------- 8: smaller


def test_export_refuses_the_working_directory_clearly(demo_run, tmp_path):
    (tmp_path / "old.txt").write_text("x")
    refused = loomrl(tmp_path, "export", str(demo_run), "--out", ".", "--overwrite", "--modality", "text")
    assert refused.returncode == 2
    assert "current directory" in refused.stderr and "Errno" not in refused.stderr, refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]


def test_exported_files_are_0644_under_umask_022(demo_run, tmp_path):
    old = os.umask(0o022)
    try:
        export_checkpoint(demo_run, tmp_path / "m", modality="text")
    finally:
        os.umask(old)
    files = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in files and set(files.values()) == {0o644}, files
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755


def test_an_export_out_may_be_a_link_to_an_empty_folder(demo_run, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    export_checkpoint(demo_run, tmp_path / "link", modality="text")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "model.safetensors").is_file()


def test_a_run_out_may_be_a_link_to_an_empty_folder(tmp_path, demo_shards):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    done = loomrl(
        tmp_path,
        "run",
        str(ROOT / "recipes/demo.yaml"),
        "--out",
        "link",
        f"data.shards={demo_shards[0]}/*.tar",
        *SMALL,
        "--max-steps",
        "1",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "target" / "recipe.yaml").is_file()


@pytest.mark.parametrize("value", [10_000_000_000, 1e10])
def test_preprocessor_pixels_out_of_range_are_refused_naming_the_file(tmp_path, value):
    _qwen2_vl(str(tmp_path), "qwen2_vl", vocab_size=PADDED)
    pre = tmp_path / "preprocessor_config.json"
    config = json.loads(pre.read_text()) if pre.is_file() else {}
    pre.write_text(json.dumps({**config, "min_pixels": value, "max_pixels": value, "size": {}}))
    overrides = [o for o in OVERRIDES if "pixels" not in o] + [f"model.init_from={tmp_path}"]
    with pytest.raises(R.RecipeError, match="preprocessor_config.json") as e:
        R.load_recipe(None, overrides, files=False)
    assert "min_pixels" in str(e.value)
