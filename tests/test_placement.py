"""Device placement (loomrl/platform/placement.py): the device choice, the refusal of a CUDA
recipe on a machine without CUDA (at --dry-run as at run time), the host <-> device copy
counter, and a run whose every step reports its copies and keeps every micro-batch, medium
and rollout tensor on the model's device."""

import json
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform import placement
from loomrl.platform import recipe as R
from loomrl.platform.placement import TRANSFERS, choose_device, to_device, to_host

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_and_cpu_choose_the_cpu_here_and_a_bad_setting_names_the_key():
    if not torch.cuda.is_available():
        assert choose_device("auto") == torch.device("cpu")
    assert choose_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="training.device"):
        choose_device("tpu")


@no_cuda
def test_cuda_without_cuda_is_refused_naming_the_key(tmp_path, capsys):
    with pytest.raises(ValueError, match="training.device: 'cuda'"):
        choose_device("cuda")
    # a run refuses before it starts (exit 2, naming the key) ...
    assert main(["run", str(ROOT / "recipes/demo.yaml"), "--out", str(tmp_path / "r"), "training.device=cuda"]) == 2
    assert "training.device: 'cuda'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # ... and --dry-run names it as what this machine lacks (the recipe itself is fine for a GPU box)
    assert main(["run", str(ROOT / "recipes/demo.yaml"), "--dry-run", "training.device=cuda"]) == 0
    assert "not on this machine: training.device: 'cuda'" in capsys.readouterr().err
    with pytest.raises(R.RecipeError, match="training.device"):
        R.load_recipe(ROOT / "recipes/demo.yaml", ["training.device=gpu"])


def test_copies_between_host_and_device_are_counted_and_moves_within_one_are_not():
    TRANSFERS.take()
    x = torch.zeros(4, 8)  # 128 bytes on the host
    assert to_device(x, torch.device("cpu")) is x  # same device: no copy, nothing counted
    moved = to_device(x, torch.device("meta"))  # "meta" stands for an accelerator here
    assert moved.device.type == "meta" and moved.shape == x.shape
    to_device(torch.zeros(2, dtype=torch.int64), torch.device("meta"), torch.int32)
    assert to_host(x) is x
    row = TRANSFERS.take()
    assert row == {"h2d_copies": 2, "h2d_mb": (128 + 16) / 2**20, "d2h_copies": 0, "d2h_mb": 0.0}
    assert TRANSFERS.take()["h2d_copies"] == 0  # take() starts the next step's count


def test_a_run_keeps_its_tensors_on_the_models_device_and_reports_its_copies(tmp_path, demo_shards, monkeypatch):
    """Every tensor that reaches the model goes through the placement helpers with the model's
    device as the target: recorded here for the rollout, the layout and the towers of a run."""
    targets = []
    real = placement.to_device

    def recording(t, device, dtype=None):
        targets.append(torch.device(device))
        return real(t, device, dtype)

    for module in (
        "loomrl.platform.trajectory.batch",
        "loomrl.platform.rollout.torch_engine",
        "loomrl.platform.backbone.vlm",
        "loomrl.platform.algorithms.advantages",
    ):
        monkeypatch.setattr(f"{module}.to_device", recording)
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                str(ROOT / "recipes/demo.yaml"),
                "--out",
                str(out),
                f"data.shards={demo_shards[0]}/*.tar",
                "data.demo=null",
                "training.device=cpu",
                "training.steps=2",
                "training.warmup.steps=1",
                "training.prompts_per_step=4",
                "training.mini_batches=1",
                "goal=null",
                "checkpoint.every=0",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:  # nothing crosses on a CPU run; the keys are there for a GPU run to fill
        assert (row["h2d_copies"], row["h2d_mb"], row["d2h_copies"], row["d2h_mb"]) == (0, 0.0, 0, 0.0)
    # prompts, step tokens, media pixels, micro-batches and advantages all went to the model's device
    assert len(targets) > 20 and set(targets) == {torch.device("cpu")}
