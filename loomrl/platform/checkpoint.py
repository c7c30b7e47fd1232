"""Checkpoints, written atomically: a temporary folder is filled (weights as
safetensors, optimizer state as a tensors-only torch file, JSON state), every
file fsynced, a manifest of sha256 sums written last, then the folder is
renamed into place. Loading checks the manifest and never unpickles objects
(torch.load(weights_only=True))."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "optimizer.pt", "state.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, engine_state: dict,
                    state: dict, keep_last: int, extra_models: dict | None = None) -> Path:
    """Write step-N/ atomically; extra_models: {name: module} saved as name.safetensors."""
    from loomrl.platform.faults import maybe_die

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # dedups tied weights
    for name, m in (extra_models or {}).items():
        save_model(m, str(tmp / f"{name}.safetensors"))
    maybe_die("checkpoint")
    torch.save(engine_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync(tmp / name)
    (tmp / MANIFEST).write_text(json.dumps({name: _sha256(tmp / name) for name in files}, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    for old in sorted(root.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder (interrupted writes are .tmp and never picked)."""
    done = sorted(root.glob("step-*")) if root.is_dir() else []
    return done[-1] if done else None


def load_extra_model(path: Path, name: str, model: torch.nn.Module) -> None:
    """Load name.safetensors of a checkpoint that load_checkpoint has verified."""
    load_model(model, str(path / f"{name}.safetensors"))


def load_checkpoint(path: Path, model: torch.nn.Module) -> tuple[dict, dict]:
    """Load weights into `model`; return (engine_state, state). Raises ValueError naming
    the file on a missing manifest, a checksum mismatch or a shape mismatch."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path}: no {MANIFEST}; the checkpoint is incomplete")
    manifest = json.loads(manifest_path.read_text())
    for name in REQUIRED:
        if name not in manifest:
            raise ValueError(f"{manifest_path}: does not list {name}; the checkpoint is incomplete")
    for name, digest in manifest.items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise ValueError(f"{path / name}: missing or corrupt (sha256 differs from the manifest)")
    try:
        load_model(model, str(path / "model.safetensors"))
    except RuntimeError as e:
        raise ValueError(f"{path / 'model.safetensors'}: does not fit this model: {e}") from None
    engine_state = torch.load(path / "optimizer.pt", weights_only=True)
    return engine_state, json.loads((path / "state.json").read_text())
