"""Checkpoints, written atomically: a temporary folder is filled (weights as
safetensors, optimizer state as a tensors-only torch file, JSON state), every
file fsynced, a manifest of sha256 sums written last, then the folder is
renamed into place as `step-NNNNNN`. Loading checks the manifest and never
unpickles objects (torch.load(weights_only=True)); whatever is wrong with a
checkpoint (a file missing, damaged, or vouched for by a rewritten manifest but
unreadable) is a ValueError naming the file. A policy with LoRA adapters also gets
`adapter.safetensors`: the `*.lora_A` / `*.lora_B` tensors alone, under the policy's names (a
copy, for sharing adapters; loading reads model.safetensors, which holds base and adapters).

Sharded engine state (FSDP2): an engine that declares `save_sharded` writes its optimizer state
from every rank into the staged folder's `engine/` through torch.distributed.checkpoint (each rank
its own shards, `__R_0.distcp`, plus `.metadata`; no gather to rank 0), before rank 0 writes the
rest, the manifest (which lists `engine/...` too) and renames the folder. That needs the run
folder on a filesystem every node sees (docs/multi-node.md). Reading it back stays pickle-free
where it matters: DCP's `.metadata` is a pickle, read here by an unpickler that knows only DCP's
metadata classes (`_MetadataUnpickler`); the shards are read with torch.load(weights_only=True)
by DCP itself, and a state with anything but tensors (DCP's pickled "bytes" items) is refused."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_file, save_model

from loomrl.platform.faults import maybe_die

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "optimizer.pt", "state.json")
SHARDED = "engine"
"""The subfolder of an engine's sharded state (save_sharded)."""
STEP_NAME = re.compile(r"step-(\d{6,})")
"""A checkpoint folder's name (`step-000006`); anything else beside them (`step-000006.bak`, a
`.step-000007.tmp` being written) is not a checkpoint: never picked, never pruned."""


def staging_folder(root: Path, step: int) -> Path:
    """Where step-N is written before its rename."""
    return root / f".step-{step:06d}.tmp"


def stage(root: Path, step: int, writer: bool) -> Path:
    """An empty staging folder for step-N, made by the writing rank; every rank returns once it
    exists (collective when distributed), so every rank can write its shards into it."""
    tmp = staging_folder(root, step)
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return tmp


def checkpoint_folders(root: Path) -> list[Path]:
    """The `step-NNNNNN` folders under root, oldest (lowest step) first."""
    found = [
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := STEP_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found)]


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


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    engine_state: dict,
    state: dict,
    *,
    keep_last: int,
    extra_models: dict | None = None,
    staged: bool = False,
) -> Path:
    """Write step-N/ atomically; extra_models: {name: module} saved as name.safetensors. staged:
    `stage()` made the folder and every rank wrote its shards there already: keep them."""

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = staging_folder(root, step)
    if not staged:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # dedups tied weights
    adapter = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".lora_" in k}
    if adapter:  # LoRA (backbone/lora.py): the adapters alone too, a copy of what model.safetensors holds
        save_file(adapter, str(tmp / "adapter.safetensors"), metadata={"format": "pt"})
    for name, m in (extra_models or {}).items():
        save_model(m, str(tmp / f"{name}.safetensors"))
    maybe_die("checkpoint")
    torch.save(engine_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    files = sorted(f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file())
    for name in files:
        _fsync(tmp / name)
    for folder in {(tmp / name).parent for name in files}:
        _fsync(folder)
    (tmp / MANIFEST).write_text(json.dumps({name: _sha256(tmp / name) for name in files}, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    for old in checkpoint_folders(root)[:-keep_last]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint folder, by step (interrupted writes are .tmp, other names such as a
    `step-000006.bak` copy are not checkpoints: neither is picked)."""
    done = checkpoint_folders(root)
    return done[-1] if done else None


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_extra_model(path: Path, name: str, model: torch.nn.Module) -> None:
    """Load name.safetensors of a checkpoint that load_checkpoint has verified."""
    _load_weights(path / f"{name}.safetensors", model)


def _load_weights(file: Path, model: torch.nn.Module) -> None:
    try:
        load_model(model, str(file))
    except RuntimeError as e:  # names or shapes of another model
        raise ValueError(f"{file}: does not fit this model: {_cut(str(e))}") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own errors: a truncated or damaged file
        raise ValueError(
            f"{file}: not a readable safetensors file (truncated or damaged): {type(e).__name__}: {_cut(str(e))}"
        ) from None


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {_cut(str(e))}") from None


def load_checkpoint(path: Path, model: torch.nn.Module) -> tuple[dict, dict]:
    """Load weights into `model`; return (engine_state, state), both dicts. Raises ValueError
    naming the file on a missing or malformed manifest, a checksum mismatch, a file that does
    not read (even one a rewritten manifest vouches for), a shape mismatch, or an optimizer
    file holding anything but tensors and plain containers (never unpickled)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path}: no {MANIFEST}; the checkpoint is incomplete")
    manifest = _read_json(manifest_path)
    if not isinstance(manifest, dict) or not all(isinstance(v, str) for v in manifest.values()):
        raise ValueError(f"{manifest_path}: not a JSON object of file names and sha256 sums")
    for name in manifest:
        parts = name.split("/")  # a file of the folder, or of its sharded engine state (engine/)
        inner = parts[1:] if len(parts) == 2 and parts[0] == SHARDED else parts
        if len(inner) != 1 or "\\" in name or inner[0] in ("", ".", ".."):
            raise ValueError(f"{manifest_path}: {name[:100]!r} is not a file name of the checkpoint")
    for name in REQUIRED:
        if name not in manifest:
            raise ValueError(f"{manifest_path}: does not list {name}; the checkpoint is incomplete")
    for name, digest in manifest.items():
        try:
            ok = (path / name).is_file() and _sha256(path / name) == digest
        except OSError:
            ok = False
        if not ok:
            raise ValueError(f"{path / name}: missing or corrupt (sha256 differs from the manifest)")
    _load_weights(path / "model.safetensors", model)
    optimizer = path / "optimizer.pt"
    try:
        engine_state = torch.load(optimizer, weights_only=True)
    except pickle.UnpicklingError:  # torch's text suggests weights_only=False: never, for a checkpoint
        raise ValueError(
            f"{optimizer}: holds pickled objects other than tensors and plain containers; "
            f"refused (a checkpoint is never unpickled)"
        ) from None
    except Exception as e:  # noqa: BLE001 - a truncated or damaged zip, not a torch file at all
        raise ValueError(f"{optimizer}: not a readable torch file: {type(e).__name__}: {_cut(str(e))}") from None
    if not isinstance(engine_state, dict):
        raise ValueError(f"{optimizer}: not a mapping of states (got {type(engine_state).__name__})")
    state = _read_json(path / "state.json")
    if not isinstance(state, dict):
        raise ValueError(f"{path / 'state.json'}: not a JSON object (got {type(state).__name__})")
    for key in ("step", "version", "warmup_step"):  # counters, wherever a checkpoint has them
        _check_count(state, key, path / "state.json")
    return engine_state, state


def _check_count(state: dict, key: str, file: Path) -> None:
    v = state.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{file}: {key!r} must be an integer >= 0, got {_cut(repr(v), 100)}")


def check_run_state(state: dict, engine_state: dict, path: Path, critic: bool = False) -> None:
    """The keys and kinds a trainer's checkpoint holds (see Trainer.save): a ValueError naming
    state.json or optimizer.pt for anything missing or of another kind."""

    def fail(file: str, what: str) -> None:
        raise ValueError(f"{path / file}: {what}")

    for key in ("step", "version", "data", "trajectories", "recipe"):
        if key not in state:
            fail("state.json", f"no {key!r}; not a checkpoint of a loomrl run (or damaged)")
    for key in ("step", "version"):
        _check_count(state, key, path / "state.json")
    for key in ("data", "trajectories", "recipe"):
        if not isinstance(state[key], dict):
            fail("state.json", f"{key!r} must be a JSON object, got {type(state[key]).__name__}")
    books = state["trajectories"]
    for key in ("generated", "trained", "dropped", "dropped_by_reason"):
        if key not in books:
            fail("state.json", f"'trajectories' has no {key!r}")
    for key in ("generated", "trained", "dropped"):
        _check_count(books, key, path / "state.json")
    if not isinstance(books["dropped_by_reason"], dict):
        fail("state.json", "'trajectories.dropped_by_reason' must be a JSON object")
    for key in ("engine", "torch_rng", "source") + (("critic",) if critic else ()):
        if key not in engine_state:
            fail("optimizer.pt", f"no {key!r}; not a checkpoint of a loomrl run (or damaged)")
    rng = engine_state["torch_rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
        fail("optimizer.pt", "'torch_rng' is not a torch random-generator state (a uint8 tensor)")


@contextlib.contextmanager
def blame(file: Path) -> Iterator[None]:
    """Restoring state read from `file`: an error that the state's content causes (a key it lacks,
    a value of another kind or size) becomes a ValueError naming the file."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ValueError(f"{file}: does not fit this run: {type(e).__name__}: {_cut(str(e))}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` pickle with only the classes it is made of: DCP's metadata records, torch
    sizes, dtypes and layouts, a path. Anything else (the way a crafted pickle runs code) is refused."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every rank's shards of `tensors` (DTensors and plain tensors; a plain tensor is written once)
    into `folder` through torch.distributed.checkpoint (collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)))


def sharded_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The tensors a save_sharded() folder holds and their full shapes; ValueError naming the file
    for an unreadable or crafted `.metadata`, or a value that is not a tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    file = folder / ".metadata"
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
        items = dict(meta.state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - missing, truncated, crafted: all the same to a resume
        raise ValueError(
            f"{file}: not a readable sharded-checkpoint index: {type(e).__name__}: {_cut(str(e))}"
        ) from None
    bad = [k for k, v in items.items() if not isinstance(v, TensorStorageMetadata)]
    if bad:
        raise ValueError(f"{file}: {bad[0]!r} is not a tensor (a sharded checkpoint holds tensors only)")
    return {k: tuple(v.size) for k, v in items.items()}


def load_sharded(targets: dict[str, torch.Tensor], folder: Path) -> None:
    """Read a save_sharded() folder into `targets` in place (each rank its own shards; collective).
    The caller builds the targets from sharded_shapes(), which has vetted `.metadata`."""
    import torch.distributed.checkpoint as dcp

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                meta = _MetadataUnpickler(f).load()
            meta.storage_meta = meta.storage_meta or dcp.metadata.StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:  # DCP would torch.load(weights_only=False) it
            raise ValueError(f"{folder}: {read_item.dest_index.fqn!r} is not a tensor; refused")

    dcp.load(targets, storage_reader=Reader(str(folder)), planner=Planner())
