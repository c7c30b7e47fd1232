"""Transport between roles refuses malformed messages with a ValueError naming what is wrong:
a tensor whose shape does not match its bytes, and a message larger than the receiver's cap
(checked before anything is allocated, over a real 2-rank gloo group)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loomrl.platform.faults import tamper as pack_tampered
from loomrl.platform.trajectory.transport import Channel, pack, unpack


def test_unpack_round_trip_and_shape_bytes_mismatch():
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    meta, tensors = unpack(pack({"kind": "weights", "version": 3}, {"w": w}))
    assert meta == {"kind": "weights", "version": 3} and torch.equal(tensors["w"], w)
    bad = pack_tampered(pack({}, {"w": w}), b'"w", "float32", [2, 3]', b'"w", "float32", [3, 3]')
    with pytest.raises(ValueError, match="tensor 'w' of shape \\[3, 3\\].*needs 36 bytes.*gives 24"):
        unpack(bad)
    neg = pack_tampered(pack({}, {"w": w}), b'"w", "float32", [2, 3]', b'"w", "float32", [-2,3]')
    with pytest.raises(ValueError, match="tensor 'w'"):
        unpack(neg)
    with pytest.raises(ValueError, match="no header length"):
        unpack(torch.zeros(3, dtype=torch.uint8))


def _peer(rank: int, init: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if rank == 1:
        ch = Channel()
        ch.send(pack({"kind": "result"}, {"x": torch.zeros(64)}), 0)  # 256 bytes of tensor + header
        ch.send(pack({"kind": "small"}), 0)
        ch.flush()
    else:
        ch = Channel(max_message_bytes=200)
        try:
            ch.recv(1)
            text = "accepted"
        except ValueError as e:
            text = str(e)
        with open(result, "w") as f:
            f.write(text)
    os._exit(0)  # no collective: rank 1's second send is never received


def test_channel_refuses_a_message_over_its_cap(tmp_path):
    init, result = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "result.txt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_peer, args=(r, init, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    text = open(result).read()
    assert "rank 1 declared a message of" in text and "accepted: 0..200" in text, text
