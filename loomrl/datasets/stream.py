"""A streaming, resumable reader of prompt shards for training.

Order of one epoch, for one rank:

1. the shards, in name order, or shuffled by (seed, epoch) when the shuffle
   buffer is on;
2. their samples in tar order; sample g of that sequence goes to rank
   g % world_size (an even split even with fewer shards than ranks);
3. a shuffle buffer of `shuffle_buffer` samples (seeded by seed, epoch, rank):
   filled, then each new sample replaces a random one that is emitted; the
   rest is emitted shuffled at the end of the epoch, so every epoch has every
   sample exactly once;
4. DataLoader workers take turns: worker w of W emits items w, w+W, ... of the
   rank's sequence, so a DataLoader with `batch_size=None` (it interleaves
   workers round-robin) yields exactly the single-process order.

The order is a pure function of (files, seed, shuffle_buffer, rank,
world_size) and is computed from tar *headers*: the buffer holds references
(shard, offsets), and data is read only for the samples emitted. That makes
the position a small dict {epoch, index, fingerprint}: resuming replays the
epoch's reference sequence up to `index` from headers alone and goes on with
the next unseen sample, in the order an uninterrupted run would have had.

A sample that cannot be read (a member that fails its sha256, a truncated or
unreadable member, a bad .json) does not end the stream: it comes as a record
{error, source, position} in its place, so the consumer can skip, count and
name it, and the position moves past it like past any sample (a resume does
not meet it again). A shard whose tar headers are damaged part-way (or that
is cut short: it lacks its end-of-archive blocks) gives its samples up to the
damage, then one such record for the rest of the shard; a shard without
samples, or a path that is not a regular file (a FIFO is never opened), is one
such record. That record takes a place in the order like a sample (one rank,
one worker).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import BinaryIO, Iterator, Optional, Union

import torch

from loomrl.config.patterns import expand_pattern
from loomrl.datasets.shards import MAX_MEMBER_BYTES, SampleRef, ShardError, load_sample, open_shard, scan_shard


def buffered_shuffle(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """webdataset-style shuffle buffer, deterministic given `rng`."""
    if size <= 1:
        yield from items
        return
    buf: list = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        k = rng.randrange(size)
        yield buf[k]
        buf[k] = x
    rng.shuffle(buf)
    yield from buf


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little")


def _unreadable(shard: str, key: Optional[str], e: OSError) -> ShardError:
    return ShardError(shard, f"cannot be read ({e.strerror or e})", key=key)


def _error_record(e: ShardError) -> dict:
    """What the stream yields in place of a sample it cannot read."""
    why = e.reason if e.member is None else f"member {e.member} {e.reason}"
    return {"error": why, "source": e.shard if e.key is None else f"{e.shard}:{e.key}"}


class ShardStream(torch.utils.data.IterableDataset):
    """Samples {id, prompt, answer, meta, media: [(kind, sha256, bytes)], source,
    position} streamed from shards, epoch after epoch (forever if `epochs` is None);
    in place of a sample that cannot be read, {error, source, position}.

    In one process, `state()` is the position after the last sample yielded;
    with DataLoader workers, take `state_after(record)` of the last record the
    training loop consumed. Either goes into a checkpoint as is (JSON) and
    comes back through `load_state`."""

    def __init__(
        self,
        shards: Union[str, list[str]],
        *,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        epochs: Optional[int] = None,
        max_member_bytes: int = MAX_MEMBER_BYTES,
    ):

        self.files = expand_pattern(shards) if isinstance(shards, str) else sorted(shards)
        if not self.files:
            raise FileNotFoundError(f"no shards match {shards!r}")
        if rank is None or world_size is None:
            dist = torch.distributed
            ready = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if ready else 0
            world_size = dist.get_world_size() if ready else 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.shuffle_buffer, self.seed, self.rank, self.world_size = shuffle_buffer, seed, rank, world_size
        self.epochs, self.max_member_bytes = epochs, max_member_bytes
        self.epoch, self.index = 0, 0

    # ------------------------------------------------------------------ position

    def fingerprint(self) -> str:
        """What the order depends on; a saved position only fits the same fingerprint."""
        what = [[os.path.basename(f) for f in self.files], self.seed, self.shuffle_buffer, self.rank, self.world_size]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

    def state(self) -> dict:
        """Position of the next unseen sample (single-process iteration)."""
        return {"epoch": self.epoch, "index": self.index, "fingerprint": self.fingerprint()}

    def state_after(self, record: dict) -> dict:
        """Position of the sample after `record` (one this stream yielded)."""
        epoch, index = record["position"]
        return {"epoch": epoch, "index": index + 1, "fingerprint": self.fingerprint()}

    def load_state(self, state: dict) -> None:
        """Continue from a saved position: the next sample is the first one not yet seen."""
        if state.get("fingerprint") != self.fingerprint():
            raise ValueError(
                "saved data position does not fit these shards/settings (files, seed, "
                "shuffle_buffer, rank, world_size differ): "
                f"{state.get('fingerprint')} != {self.fingerprint()}"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    # ------------------------------------------------------------------ order

    def epoch_refs(self, epoch: int) -> Iterator[Union[SampleRef, ShardError]]:
        """This rank's references for one epoch, in emission order (headers only); a shard
        whose headers cannot be read from some point on gives a ShardError there."""
        files = list(self.files)
        if self.shuffle_buffer > 0:
            random.Random(_seed(self.seed, epoch)).shuffle(files)

        def mine() -> Iterator[Union[SampleRef, ShardError]]:
            g = 0
            for f in files:
                try:
                    for ref in scan_shard(f, self.max_member_bytes):
                        if g % self.world_size == self.rank:
                            yield ref
                        g += 1
                except (ShardError, OSError) as e:  # the rest of this shard is lost; the order goes on
                    if g % self.world_size == self.rank:
                        yield e if isinstance(e, ShardError) else _unreadable(f, None, e)
                    g += 1

        rng = random.Random(_seed(self.seed, epoch, self.rank))
        return buffered_shuffle(mine(), self.shuffle_buffer, rng)

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        handles: dict[str, BinaryIO] = {}
        turn = 0  # items since the start of this iteration: worker w takes turns w, w+W, ...
        epoch, start = self.epoch, self.index
        try:
            while self.epochs is None or epoch < self.epochs:
                refs = self.epoch_refs(epoch)
                index = 0
                for ref in refs:
                    if index < start:  # already seen before the saved position
                        index += 1
                        continue
                    mine = turn % workers == worker
                    turn += 1
                    index += 1
                    if not mine:
                        continue
                    if isinstance(ref, ShardError):  # the damaged rest of a shard
                        record = _error_record(ref)
                    else:
                        try:
                            fh = handles.get(ref.shard)
                            if fh is None:
                                if len(handles) >= 8:  # refs cluster in recent shards; few handles suffice
                                    handles.pop(next(iter(handles))).close()
                                fh = handles[ref.shard] = open_shard(ref.shard)  # never a FIFO: it would block
                            record = load_sample(fh, ref)
                        except ShardError as e:  # the sample is lost, not the stream
                            record = _error_record(e)
                        except OSError as e:
                            record = _error_record(_unreadable(ref.shard, ref.key, e))
                    record["position"] = (epoch, index - 1)
                    self.epoch, self.index = epoch, index
                    yield record
                if index == 0 and start == 0:
                    raise ValueError(
                        f"rank {self.rank} of {self.world_size} has no samples in {len(self.files)} shard(s)"
                    )
                epoch, start = epoch + 1, 0
                self.epoch, self.index = epoch, 0
        finally:
            for fh in handles.values():
                fh.close()
