"""A checkpoint folder (`model.init_from`) is outside input, bounded before anything is built:
config.json's sizes typed and ranged naming the key, the model's parameters against this
machine's memory, the weight files' safetensors headers checked against the files (regular files
only), the files' tensor names and shapes against what config.json builds; `loomrl run` and
`--dry-run` refuse the same folders, as one line (exit 2), never a traceback."""

import json
import os
import shutil
import signal
import struct

import pytest
from qwen_checkpoints import _qwen2_vl

from loomrl.cli import main
from loomrl.encoders.safetensors_check import WeightsError, read_header
from loomrl.platform.backbone.hf_weights import check_checkpoint
from loomrl.platform.parts import build_policy_parts
from loomrl.platform.recipe import RecipeError, load_recipe

DEMO = "recipes/demo.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-vl")
    _qwen2_vl(str(folder), "qwen2_vl")
    return folder


@pytest.fixture
def hang_guard():
    """A hang (a FIFO opened for reading waits for a writer) fails the test instead of stalling it."""

    def fail(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def copy(tiny, tmp_path, text=None, vision=None):
    """A copy of the tiny folder with config.json's text_config / vision_config keys replaced."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"].update(text or {})
    cfg["vision_config"].update(vision or {})
    if "num_hidden_layers" in (text or {}):
        cfg["text_config"].pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def refuses(folder, capsys, *names) -> str:
    """`loomrl run --dry-run` exits 2 with one error line naming each of `names`."""
    assert main(["run", DEMO, "--dry-run", f"model.init_from={folder}", f"data.shards={folder}/none-*.tar"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "recipe OK" not in err, err
    for name in names:
        assert str(name) in err, (name, err)
    return err


# 1. config sizes bounded before allocation: before, num_hidden_layers 1e6 built layers until
# killed (17 GB and growing), vocab_size 1e9 likewise (23.7 GB), vision embed_dim 1e9 and
# intermediate_size 1e12 a "can't allocate" traceback, vocab_size -1 a traceback, hidden_size
# "64" and num_attention_heads 0 an exit 2 saying TypeError / ZeroDivisionError but no key.
@pytest.mark.parametrize(
    "text, vision, says",
    [
        ({"num_hidden_layers": 1000000}, None, "num_hidden_layers 1000000 is out of range"),
        ({"vocab_size": 1000000000}, None, "vocab_size 1000000000 is out of range"),
        ({"vocab_size": -1}, None, "vocab_size -1 is out of range"),
        ({"intermediate_size": 10**12}, None, "intermediate_size 1000000000000 is out of range"),
        (None, {"embed_dim": 10**9}, "vision_config.embed_dim 1000000000 is out of range"),
        (None, {"hidden_size": 10**9}, "vision_config.hidden_size 1000000000 is out of range"),
        ({"hidden_size": "64"}, None, "hidden_size '64' is not an integer"),
        ({"num_attention_heads": 0}, None, "num_attention_heads 0 is out of range"),
        ({"num_key_value_heads": 3}, None, "num_key_value_heads 3 must divide num_attention_heads"),
    ],
)
def test_config_sizes_are_bounded_naming_the_key(tiny, tmp_path, capsys, text, vision, says):
    folder = copy(tiny, tmp_path, text, vision)
    with pytest.raises(RecipeError, match=says.replace("(", r"\(")) as e:
        load_recipe(DEMO, [f"model.init_from={folder}"])
    assert f"{folder}/config.json" in str(e.value)
    refuses(folder, capsys, f"{folder}/config.json", says)


def test_a_model_over_this_machines_memory_is_refused_with_the_figure(tiny, tmp_path, capsys):
    text = {"vocab_size": 1 << 24, "hidden_size": 8192}
    folder = copy(tiny, tmp_path, text, {"hidden_size": 8192})
    with pytest.raises(ValueError, match="vocab_size 16777216, hidden_size 8192") as e:
        check_checkpoint(folder)
    assert "more than this machine's" in str(e.value) and "GB of memory" in str(e.value)
    refuses(folder, capsys, "vocab_size 16777216", "to build (fp32) and load")
    with pytest.raises(ValueError, match="more than this machine's 0.0 GB"):  # the tiny one, on a tiny machine
        check_checkpoint(tiny, memory=1000)


# 1 and 5. More layers configured than the files hold: before, the model was built first (1.5 GB
# for 3000 layers), then load_policy raised a ValueError: a traceback from `loomrl run` (exit 1),
# and `--dry-run` said "recipe OK". Now refused from the headers, before anything is built.
def test_configured_layers_the_weights_lack_are_refused_before_building(tiny, tmp_path, capsys):
    folder = copy(tiny, tmp_path, {"num_hidden_layers": 3})
    recipe = load_recipe(DEMO, [f"model.init_from={folder}", f"data.shards={folder}/none-*.tar"], files=False)
    with pytest.raises(RecipeError, match=r"language model's tensors .* do not fit .*missing 12: model\.layers\.2\."):
        build_policy_parts(recipe)
    refuses(folder, capsys, f"{folder}/config.json", "missing 12: model.layers.2.")
    out = tmp_path / "run"
    assert main(["run", DEMO, f"model.init_from={folder}", "--out", str(out), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "missing 12: model.layers.2." in err
    assert not (out / "checkpoints").exists()


def test_weights_of_other_shapes_are_refused_naming_the_tensor(tiny, tmp_path, capsys):
    folder = copy(tiny, tmp_path, {"intermediate_size": 96})
    refuses(folder, capsys, "other shapes", "mlp.down_proj.weight [64, 128] (config.json: [64, 96])")


def _safetensors(tiny) -> tuple[bytes, int, dict]:
    raw = (tiny / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return raw, n, json.loads(raw[8 : 8 + n])


# 2 and 5. Damaged weight files: before, a SafetensorError traceback (exit 1) from the run and
# "recipe OK" from the dry run; no *.safetensors a FileNotFoundError traceback; a FIFO hung.
@pytest.mark.parametrize("damage", ["length", "garbage", "offsets", "truncated", "size", "none", "fifo"])
def test_damaged_weight_files_are_refused_naming_the_file(tiny, tmp_path, capsys, hang_guard, damage):
    folder = copy(tiny, tmp_path)
    file = folder / "model.safetensors"
    raw, n, header = _safetensors(tiny)
    name = next(k for k in header if k != "__metadata__")
    if damage == "length":
        file.write_bytes(struct.pack("<Q", 2**60) + raw[8:])
    elif damage == "garbage":
        file.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n :])
    elif damage in ("offsets", "size"):
        header[name]["data_offsets"] = [0, 10**12] if damage == "offsets" else [0, 4]
        text = json.dumps(header).encode()
        file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    elif damage == "truncated":
        file.write_bytes(raw[: len(raw) // 2])
    else:
        file.unlink()
        if damage == "fifo":
            os.mkfifo(file)
    says = {"none": "no *.safetensors files", "fifo": "is a FIFO"}.get(damage, str(file))
    if damage not in ("none", "fifo"):
        with pytest.raises(WeightsError, match=str(file)):
            read_header(file)
    refuses(folder, capsys, says)
    recipe = load_recipe(DEMO, [f"model.init_from={folder}"], files=False)
    with pytest.raises(RecipeError, match=says.replace("*", r"\*")):
        build_policy_parts(recipe)
