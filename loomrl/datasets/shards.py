"""Writing and reading loomrl prompt shards: plain webdataset tars.

A sample `KEY` is stored as `KEY.json` (id, prompt, answer, meta, and a media
list of {kind, member, sha256}) plus one member per medium (`KEY.img0.png`,
`KEY.aud0.wav`, ...). The sha256 is of the stored bytes: the same content hash
the encoding cache keys on.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

from loomrl.encoders.media import content_hash


def write_shards(samples: Iterable[dict], pattern: str, maxcount: int) -> list[str]:
    """Write samples {id, prompt, answer, meta, media: [(kind, member, bytes)]} to
    tar shards named by `pattern` (printf-style, e.g. dir/name-%06d.tar)."""
    import webdataset as wds

    os.makedirs(os.path.dirname(pattern) or ".", exist_ok=True)
    written: list[str] = []
    # ShardWriter writes into the final names; write to .tmp names, rename at the end,
    # so an interrupted write never leaves a shard that looks complete.
    tmp_pattern = pattern + ".tmp"
    with wds.ShardWriter(tmp_pattern, maxcount=maxcount, verbose=0) as sink:
        for s in samples:
            record = {"__key__": s["id"]}
            media = []
            for kind, member, data in s["media"]:
                record[member] = data
                media.append({"kind": kind, "member": member, "sha256": content_hash(data)})
            header = {k: s[k] for k in ("id", "prompt", "answer", "meta") if k in s}
            record["json"] = json.dumps({**header, "media": media}).encode()
            sink.write(record)
        count = sink.shard
    for i in range(count):
        tmp = tmp_pattern % i
        final = pattern % i
        os.replace(tmp, final)
        written.append(final)
    return written


def read_shards(files: list[str]) -> Iterator[dict]:
    """Samples as {id, prompt, answer, meta, media: [(kind, sha256, bytes)], source}.
    Raises ValueError naming the shard and member on a missing member or hash mismatch."""
    import webdataset as wds

    for f in files:
        for rec in wds.WebDataset(f, shardshuffle=False, empty_check=False):
            where = f"{f}:{rec['__key__']}"
            if "json" not in rec:
                raise ValueError(f"{where}: sample has no .json member")
            header = json.loads(rec["json"])
            media = []
            for m in header.get("media", []):
                data = rec.get(m["member"])
                if data is None:
                    raise ValueError(f"{where}: member {m['member']} is missing")
                if content_hash(data) != m["sha256"]:
                    raise ValueError(f"{where}: member {m['member']} does not match its sha256")
                media.append((m["kind"], m["sha256"], data))
            yield {**header, "media": media, "source": where}
