"""Messages between roles over torch.distributed point-to-point (gloo on CPU, NCCL-
capable tensors), without pickle.

A message is one uint8 tensor: an 8-byte header length, a JSON header (the
message's metadata and, for each tensor, name, dtype, shape and byte offset), then
the tensors' raw bytes. It crosses as two sends: its length (one int64), then the
bytes. Decoding only reads JSON and raw bytes of an allowed dtype, so a hostile
peer can send wrong numbers, never code.

A receiver allocates at most `max_message_bytes` for one message (default
`MAX_MESSAGE_BYTES`), and `unpack` checks every tensor's shape against its byte
count before viewing it; both raise ValueError, which the trainer handles as a
worker failure (reported, its prompts re-queued).

Media cross once per content key: `MediaLedger` remembers which media a peer
already holds, and `pack_media` sends the features of only the new ones.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

from loomrl.encoders.media import Medium

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}

MAX_MESSAGE_BYTES = 1 << 28
"""Largest message (bytes) a `Channel` accepts by default: 256 MiB, far above a result
(completions + log-probs) or a work message; a receiver of weights passes its own cap."""


def pack(meta: dict, tensors: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
    entries, chunks, offset = [], [], 0
    for name, t in (tensors or {}).items():
        t = t.detach().to("cpu").contiguous()
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()])
        chunks.append(raw)
        offset += raw.numel()
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    size = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size, torch.frombuffer(bytearray(header), dtype=torch.uint8), *chunks])


def unpack(buf: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    if buf.numel() < 8:
        raise ValueError(f"transport: a message of {buf.numel()} bytes has no header length")
    n = int(buf[:8].clone().view(torch.int64)[0])
    if not 0 <= n <= buf.numel() - 8:
        raise ValueError(f"transport: bad header length {n} in a message of {buf.numel()} bytes")
    header = json.loads(bytes(buf[8 : 8 + n].tolist()).decode())
    body = buf[8 + n :]
    tensors = {}
    for name, dtype, shape, offset, nbytes in header["tensors"]:
        if dtype not in DTYPES:
            raise ValueError(f"transport: tensor {name!r} has a dtype that is not allowed: {dtype}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"transport: tensor {name!r} has a bad shape: {shape!r}")
        if (
            not isinstance(offset, int)
            or not isinstance(nbytes, int)
            or offset < 0
            or nbytes < 0
            or offset + nbytes > body.numel()
        ):
            raise ValueError(f"transport: tensor {name!r} lies outside the message")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if want != nbytes:
            raise ValueError(
                f"transport: tensor {name!r} of shape {shape} and dtype {dtype} needs {want} bytes, "
                f"the message gives {nbytes}"
            )
        raw = body[offset : offset + nbytes].clone()
        tensors[name] = raw.view(DTYPES[dtype]).view(shape) if nbytes else torch.empty(shape, dtype=DTYPES[dtype])
    return header["meta"], tensors


class Channel:
    """Sends and receives messages with byte counters. Sends are asynchronous (a peer that
    is busy generating does not block the trainer); `flush()` waits for them.

    pg: the process group to talk over (ranks are its own), e.g. a gloo group of the trainer
    and its rollout workers made beside the trainer's group; None: the default group."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES, pg=None):
        self.max_message_bytes = max_message_bytes
        self.pg = pg
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pending: list = []
        self.inbox: queue.Queue = queue.Queue()

    def _isend(self, t: torch.Tensor, dst: int):
        return self.pg.send([t], dst, 0) if self.pg is not None else dist.isend(t, dst)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        if self.pg is not None:
            self.pg.recv([t], src, 0).wait()
        else:
            dist.recv(t, src)

    def send(self, buf: torch.Tensor, dst: int) -> None:
        size = torch.tensor([buf.numel()], dtype=torch.int64)
        self._pending += [(self._isend(size, dst), size), (self._isend(buf, dst), buf)]
        self.bytes_sent += buf.numel() + 8
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def flush(self) -> None:
        for w, _ in self._pending:
            w.wait()
        self._pending = []

    def recv(self, src: int) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        self._recv(size, src)
        n = int(size[0])
        if not 0 <= n <= self.max_message_bytes:  # before allocating what the peer declares
            raise ValueError(
                f"transport: rank {src} declared a message of {n} bytes (accepted: 0..{self.max_message_bytes})"
            )
        buf = torch.empty(n, dtype=torch.uint8)
        self._recv(buf, src)
        self.bytes_received += buf.numel() + 8
        return buf

    def receive_in_background(self, src: int) -> None:
        """Receive src's messages in a thread into `inbox` as (src, message), or (src, the
        exception) once its connection fails. (gloo's irecv reports completion only from
        wait(), so a posted receive cannot be polled.)"""

        def loop():
            while True:
                try:
                    buf = self.recv(src)
                except Exception as e:  # the peer is gone
                    self.inbox.put((src, e))
                    return
                self.inbox.put((src, buf))

        threading.Thread(target=loop, name=f"recv-{src}", daemon=True).start()


class MediaLedger:
    """Which media (by Medium.key) each peer already holds."""

    def __init__(self):
        self.sent: dict[int, set] = {}
        self.bytes_sent = 0
        self.bytes_naive = 0

    def pack_media(self, peer: int, media: list[Medium]) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """References for every medium, features only for the ones the peer lacks."""
        have = self.sent.setdefault(peer, set())
        refs, tensors = [], {}
        for m in media:
            name = f"{m.hash}:{m.prep}"
            refs.append({"kind": m.kind, "hash": m.hash, "prep": m.prep, "seconds_per_grid": m.seconds_per_grid})
            self.bytes_naive += m.nbytes
            if m.key not in have and name + "/features" not in tensors:
                tensors[name + "/features"] = m.features
                if m.grid is not None:
                    tensors[name + "/grid"] = m.grid
                self.bytes_sent += m.nbytes
        have.update(m.key for m in media)
        return refs, tensors


def unpack_media(refs: list[dict], tensors: dict[str, torch.Tensor], known: dict) -> list[Medium]:
    """Media from references, using features that came with the message or earlier ones (`known`)."""
    out = []
    for r in refs:
        key = (r["hash"], r["prep"])
        name = f"{r['hash']}:{r['prep']}"
        if name + "/features" in tensors:
            features, grid = tensors[name + "/features"], tensors.get(name + "/grid")
            known[key] = Medium(r["kind"], r["hash"], features, grid, r["prep"], r.get("seconds_per_grid", 0.0))
        if key not in known:
            raise ValueError(f"transport: medium {name} was referenced but never sent")
        out.append(known[key])
    return out
