"""The commands the docs show run as written: every `bash` block of docs/own-task.md and the README's
own-task block, in order, in a folder holding what the page says the user has (the manifest lines
it shows, as train.jsonl and val.jsonl, with real photos at the paths they name; a tiny Qwen2-VL
checkpoint with a chat template where the recipe's `model.init_from` points) and the recipes of
its `yaml` blocks, saved under the name in their first line. The one change: `loomrl run ... --out`
gets `--max-steps 2` (a documented flag), so a 500-step recipe is a test. A documented command
that fails at step 2 (as `shards make val.jsonl` once did) fails here."""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from PIL import Image
from qwen_checkpoints import CHAT_TEMPLATE, _qwen2_vl

from loomrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
WORDS = ["system", "user", "assistant", "What", "animal", "is", "this", "How", "many", "birds", "are", "there", "cat"]


def blocks(page: str, lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall((ROOT / page).read_text()) if kind == lang]


def commands(block: str) -> list[str]:
    """The block's `loomrl` command lines, comments dropped (`make` lines are CI's own)."""
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [" ".join(map(shlex.quote, argv)) for argv in lines if argv and argv[0] == "loomrl"]


def user_folder(tmp_path: Path) -> None:
    """What docs/own-task.md says the user has: its manifest lines, their photos, the checkpoint
    its recipes name, and the recipes."""
    (manifest,) = blocks("docs/own-task.md", "json")
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text(manifest)
    import skimage.data

    for i, line in enumerate(manifest.splitlines()):
        path = tmp_path / yaml.safe_load(line)["image"]
        path.parent.mkdir(parents=True, exist_ok=True)
        photo = (skimage.data.chelsea, skimage.data.coffee)[i % 2]()
        Image.fromarray(photo).convert("RGB").resize((56, 56)).save(path)
    for block in blocks("docs/own-task.md", "yaml"):
        name = block.splitlines()[0].lstrip("# ").strip()
        (tmp_path / name).write_text(block)
    init_from = yaml.safe_load((tmp_path / "sft.yaml").read_text())["model"]["init_from"]
    _qwen2_vl(str(tmp_path / init_from), words=WORDS, chat_template=CHAT_TEMPLATE)


def run(command: str) -> None:
    argv = shlex.split(command)[1:]
    if argv[0] == "run" and "--out" in argv:
        argv += ["--max-steps", "2"]
    assert main(argv) == 0, f"`{command}` failed"


@pytest.mark.parametrize("page", ["docs/own-task.md", "README.md"])
def test_the_own_task_commands_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user_folder(tmp_path)
    if page == "README.md":  # its own-task block (the one that makes shards)
        todo = [c for b in blocks(page, "bash") if "shards make" in b for c in commands(b)]
    else:
        todo = [c for b in blocks(page, "bash") for c in commands(b)]
    assert any(c.startswith("loomrl export") for c in todo) and len(todo) >= 5, todo
    for command in todo:
        run(command)
    assert (tmp_path / "models" / "my-grpo" / "config.json").is_file()
