"""Shards made from the data a recipe names directly (`data.source`, `validation.source`).

A recipe may point at a dataset as the user has it (a JSONL manifest, a .json list, parquet, a
Hugging Face `datasets` folder, or a folder of them: sources.py) instead of at shards. The run
then makes the shards once, with `make_shards` and its default limits, into a folder of
`data.cache` named after the source and the sha256 of its bytes (every regular file of a folder
source, with its path inside it), and every later run of that source reads them again:

    data/cache/train-3f2a9c01d4e5b6a7/shard-000000.tar ...
    data/cache/train-3f2a9c01d4e5b6a7/shard-rejected.jsonl  (the samples left out, with the reason)
    data/cache/train-3f2a9c01d4e5b6a7/made.json          (the make's summary; written last)

The folder is made under a temporary name and renamed when whole (`made.json` inside), so an
interrupted make is never reused, and two processes making the same source at once both end
with the same shards. The key covers the source's own files, not the media files a manifest
points at: after changing those, delete the folder (the log names it). `loomrl shards make`
stays the way to control limits, `--field` mappings and shard sizes, for large or shared corpora.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile

from loomrl.config.schema import RecipeError
from loomrl.datasets.prepare import MakeResult, RejectionEcho, make_shards
from loomrl.datasets.sources import SourceError

log = logging.getLogger(__name__)

CACHE_FORMAT = "loomrl-shards-1"
"""Part of every key: a change of the shard layout or of how sources are read bumps it."""
CHUNK = 1 << 20


def source_files(source: str) -> list[str]:
    """The regular files whose bytes make up `source` (itself, or every file under a folder,
    in path order; symbolic links are not followed)."""
    if os.path.isfile(source):
        return [source]
    out = []
    for top, dirs, files in os.walk(source):
        dirs.sort()
        out += [os.path.join(top, f) for f in sorted(files) if os.path.isfile(os.path.join(top, f))]
    return out


def source_key(source: str) -> str:
    """sha256 of the cache format, then each file's path inside the source, size and bytes."""
    h = hashlib.sha256(CACHE_FORMAT.encode())
    for path in source_files(source):
        h.update(f"\0{os.path.relpath(path, source)}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()


def cached_shards(source: str, cache: str, key: str) -> str:
    """The shard pattern of `source`'s shards in `cache`, made first when they are not there.
    RecipeError naming `key` (the recipe key) when the source cannot be read or no sample of it
    passes validation."""
    if not os.path.exists(source):
        raise RecipeError(f"{key}: {source!r} does not exist")
    try:
        name = os.path.splitext(os.path.basename(os.path.normpath(source)))[0] or "source"
        folder = os.path.join(cache, f"{name}-{source_key(source)[:16]}")
        if os.path.isfile(os.path.join(folder, "made.json")):
            log.info("[data] %s: shards made before, in %s/", key, folder)
        else:
            make_into(source, folder, key)
    except OSError as e:
        raise RecipeError(f"{key}: {e.filename or source}: {e.strerror or e}") from None
    return os.path.join(folder, "shard-*.tar")


def make_into(source: str, folder: str, key: str) -> MakeResult:
    """Make the shards of `source` in a temporary folder beside `folder`, then rename it to `folder`."""
    os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}-", dir=os.path.dirname(folder) or ".")
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the shards from the other users of the cache
    log.info("[data] %s: making shards of %s in %s/ (once; later runs reuse them)", key, source, folder)
    echo = RejectionEcho()
    try:
        result = make_shards(source, os.path.join(tmp, "shard-%06d.tar"), on_reject=echo, progress=sys.stderr.isatty())
        echo.close()
        if result.samples == 0:
            raise RecipeError(f"{key}: no sample of {source} passed validation: {result.summary()}")
        summary = result.summary()  # (reads the shards' sizes: before they move)
        with open(os.path.join(tmp, "made.json"), "w") as fh:
            json.dump({"source": os.path.abspath(source), **result.to_json()}, fh, indent=1)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made the same source first: its shards are the same
            if not os.path.isfile(os.path.join(folder, "made.json")):
                raise
    except RecipeError:
        raise
    except (SourceError, ValueError) as e:
        raise RecipeError(f"{key}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("[data] %s: %s", key, summary)
    return result
