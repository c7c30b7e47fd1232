"""Seeded fuzzing of the shard readers (issue 17, acceptance: the data half of the fuzz test).

Random byte mutations of a small valid shard (bit flips, overwritten bytes, truncations,
zeroed ranges, inserted bytes; half of them aimed at tar headers, where the parsing is)
go to `loomrl shards verify` (in-process) and to the training reader (`ShardStream` +
`PromptSource`). Allowed: verify's exit 0 (the mutation broke nothing it checks: then all 4
samples are there) or 1 with every fault naming the shard; the reader's samples or named skips, or its RecipeError for
a shard with no usable sample. Not allowed: any other exception, a case over its time
limit (a hang), or a peak memory growth over a bound.

A tar mutation of a member's bytes is caught by the member's sha256 before any decoder sees it,
so a second test damages the media themselves (PNG and WAV headers and bodies) and writes them
into well-formed shards: the decoders and the tokeniser get the damage. There, a refusal must
come from an exception that decoders raise on bad data (`encoders.media.DATA_ERRORS`); the
tests set LOOMRL_STRICT_DATA_ERRORS=1 (conftest.py), so an IndexError or AttributeError in
loomrl's reading code fails the test instead of passing for a named skip.
"""

import os
import random
import resource
import signal
import tarfile
import time

import pytest

from loomrl.datasets.cli import main
from loomrl.datasets.demo import make_sample
from loomrl.datasets.shards import write_shards

SEEDS = int(os.environ.get("LOOMRL_FUZZ_SEEDS", "250"))  # more for a longer hunt
CASE_SECONDS = 10.0  # one case takes well under 0.5 s; over this it is a hang
PEAK_GROWTH_BYTES = 1 << 30
MAX_MEMBER_BYTES = 1 << 20  # the readers' bound on one member, small here: the shard is small


class Hang(Exception):
    pass


def mutate(raw: bytes, headers: list[int], rng: random.Random, header_span: int = 512) -> tuple[bytes, str]:
    """One to three random mutations of `raw`; positions aimed at a header (the `header_span`
    bytes from an offset in `headers`) half the time. Returns the bytes and a description of
    what was done (for the failure message)."""
    data = bytearray(raw)
    done = []
    for _ in range(rng.randint(1, 3)):
        if not data:
            break
        if headers and rng.random() < 0.5:
            pos = min(rng.choice(headers) + rng.randrange(header_span), len(data) - 1)
        else:
            pos = rng.randrange(len(data))
        kind = rng.choice(["flip", "byte", "truncate", "zero", "insert"])
        if kind == "flip":
            bit = rng.randrange(8)
            data[pos] ^= 1 << bit
            done.append(f"flip bit {bit} at {pos}")
        elif kind == "byte":
            value = rng.choice([0, 0x80, 0xFF, ord("0"), ord("7"), ord(" "), rng.randrange(256)])
            data[pos] = value
            done.append(f"byte {value:#x} at {pos}")
        elif kind == "truncate":
            if rng.random() < 0.5:
                pos -= pos % 512  # at a block boundary: a cut tarfile itself does not notice
            del data[pos:]
            done.append(f"truncate at {pos}")
        elif kind == "zero":
            n = rng.choice([1, 8, 512, 1024, rng.randrange(1, 4096)])
            data[pos : pos + n] = bytes(len(data[pos : pos + n]))
            done.append(f"zero {n} at {pos}")
        else:
            n = rng.choice([1, 7, 512, rng.randrange(1, 2048)])
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(n))
            done.append(f"insert {n} at {pos}")
    return bytes(data), ", ".join(done)


@pytest.fixture()
def shard(tmp_path):
    """A valid shard of 4 demo samples (image, audio, image + audio, image), and its header offsets."""
    rng = random.Random(0)
    (path,) = write_shards([make_sample(i, rng) for i in range(4)], str(tmp_path / "valid-%d.tar"), maxcount=10)
    with tarfile.open(path) as t:
        headers = [m.offset for m in t.getmembers()]
    raw = open(path, "rb").read()
    headers.append(len(raw.rstrip(b"\0")) + -len(raw.rstrip(b"\0")) % 512)  # the end-of-archive blocks
    return raw, headers


def mutated_tar(tmp_path, shard):
    """Each seed's case: the valid shard's bytes, mutated."""
    raw, headers = shard

    def case(seed: int) -> tuple[str, str]:
        data, what = mutate(raw, headers, random.Random(seed))
        path = str(tmp_path / f"m-{seed:04d}.tar")
        with open(path, "wb") as f:
            f.write(data)
        return path, f"seed {seed} ({what})"

    return case


def damaged_media(tmp_path):
    """Each seed's case: a well-formed shard of the 4 demo samples, one to three of whose media
    were mutated before writing (the first 64 bytes, where the format's header is, 70% of the time)."""

    def case(seed: int) -> tuple[str, str]:
        rng = random.Random(seed)
        samples = [make_sample(i, random.Random(1000 + i)) for i in range(4)]
        done = []
        for _ in range(rng.randint(1, 3)):
            sample = rng.choice(samples)
            j = rng.randrange(len(sample["media"]))
            kind, member, data = sample["media"][j]
            data, what = mutate(data, [0] if rng.random() < 0.7 else [], rng, header_span=64)
            sample["media"][j] = (kind, member, data)
            done.append(f"{sample['id']} {member}: {what}")
        (path,) = write_shards(samples, str(tmp_path / f"d-{seed:04d}-%d.tar"), maxcount=10)
        return path, f"seed {seed} ({'; '.join(done)})"

    return case


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="the hang guard needs SIGALRM")
@pytest.mark.parametrize("damage", ["tar", "media"])
def test_mutated_shards_get_only_clean_refusals(tmp_path, shard, model, tokenizer, capsys, loomrl_log, damage):
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform.recipe import ModelConfig, RecipeError

    make_case = mutated_tar(tmp_path, shard) if damage == "tar" else damaged_media(tmp_path)
    seeds = SEEDS if damage == "tar" else SEEDS // 2  # a media case writes a shard: dearer
    cfg = ModelConfig()

    def on_alarm(signum, frame):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    outcomes = {"verify ok": 0, "verify fault": 0, "samples": 0, "skips": 0, "no usable sample": 0}
    t0 = time.perf_counter()
    try:
        for seed in range(seeds):
            path, case = make_case(seed)
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                # verify: exit 0, or 1 with every fault naming this shard
                rc = main(["verify", path, "--max-member-bytes", str(MAX_MEMBER_BYTES)])
                out, err = capsys.readouterr()
                assert rc in (0, 1), f"{case}: verify exit {rc}"
                faults = [line for line in err.splitlines() if line.startswith("FAULT ")]
                assert all(line.startswith(f"FAULT {path}") for line in faults), f"{case}: {err}"
                assert (rc == 1) == bool(faults) and "Traceback" not in err, f"{case}: {err}"
                # "OK" is only for a whole shard: a cut or damaged one passed for a shorter whole one before
                assert rc == 1 or "verified 4 samples in 1 shard(s): OK" in out, f"{case}: {out}"
                outcomes["verify fault" if rc else "verify ok"] += 1

                # training: samples and named skips, or a RecipeError naming data.shards
                loomrl_log.clear()
                source = PromptSource(
                    ShardStream([path], shuffle_buffer=0, max_member_bytes=MAX_MEMBER_BYTES), model, tokenizer, cfg
                )
                try:
                    got = source.next(3)
                except RecipeError as e:
                    assert str(e).startswith("data.shards: no usable sample") and path in str(e), f"{case}: {e}"
                    outcomes["no usable sample"] += 1
                else:
                    assert len(got) == 3 and all(s.ids for s in got), case
                    outcomes["samples"] += 1
                assert all(where.startswith(path) for where, _ in source.skipped), f"{case}: {source.skipped}"
                outcomes["skips"] += len(source.skipped)
            except Hang:
                pytest.fail(f"{case}: over {CASE_SECONDS} s (a hang)")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            os.remove(path)
    finally:
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - t0
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    print(f"{seeds} mutated shards ({damage}) in {seconds:.1f} s, peak memory growth {growth / 1e6:.0f} MB: {outcomes}")
    assert growth < PEAK_GROWTH_BYTES, f"peak memory grew by {growth / 1e6:.0f} MB"
    # the mutations reached both outcomes of each reader: the test exercises what it claims to
    assert outcomes["verify ok"] and outcomes["verify fault"] and outcomes["skips"] and outcomes["samples"]
