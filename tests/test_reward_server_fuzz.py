"""Reward servers from outside, hostile ones included: a raw socket server (socketserver in a
thread) replies to each request with a scripted sequence of bytes and pauses: mutated status
lines and headers, 1xx floods, trickled headers, huge Content-Length, chunked garbage,
slowloris bodies, non-JSON, NaN. The client (rewards/remote.py) must end every case cleanly,
with a score or a RemoteRewardError naming the server and the sample, within its total
deadline plus slack. The seeded fuzz runs its cases in parallel, each under a hang guard."""

import random
import socketserver
import threading
import time

import pytest

from loomrl.platform.rewards import remote
from loomrl.platform.rewards.remote import RemoteReward, RemoteRewardError

SLACK_S = 1.5
VALID = b'{"rewards": [0.5]}'


def reply(body: bytes, status: bytes = b"HTTP/1.1 200 OK", extra: bytes = b"") -> bytes:
    return status + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body) + extra + b"\r\n" + body


class ScriptServer:
    """A server whose reply to a request on path /<key> is SCRIPTS[key]: (bytes, pause) steps;
    a generator step list is read lazily (floods that never end)."""

    def __init__(self):
        self.scripts: dict = {}
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = self.request.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    key = data.split(b" ", 2)[1].decode().lstrip("/")
                    for out, pause in outer.scripts[key]():
                        if outer.stop.is_set():
                            return
                        if out:
                            self.request.sendall(out)
                        if pause:
                            outer.stop.wait(pause)
                except OSError:
                    pass

        socketserver.ThreadingTCPServer.daemon_threads = True
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/{key}"

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server():
    s = ScriptServer()
    yield s
    s.close()


def forever(step: bytes, pause: float, head: bytes = b""):
    def script():
        yield head, 0
        while True:
            yield step, pause

    return script


def steps(*pairs):
    return lambda: iter(pairs)


def run_case(server, key: str, script, timeout_s: float, retries: int = 0):
    """(outcome, seconds, bound): outcome a list of scores or the RemoteRewardError, under a
    hang guard; anything else fails the test."""
    server.scripts[key] = script
    client = RemoteReward(server.url(key), batch_size=4, timeout_s=timeout_s, retries=retries, backoff_s=0.01)
    result: dict = {}

    def call():
        t0 = time.monotonic()
        try:
            result["out"] = client.score(["x"], [{"id": f"{key}-0", "prompt": "p"}])
        except RemoteRewardError as e:
            result["out"] = e
        except BaseException as e:  # noqa: BLE001 - reported as a failure below
            result["out"] = ("unclean", e)
        result["s"] = time.monotonic() - t0

    bound = (retries + 1) * timeout_s + retries * 0.02 + SLACK_S
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(bound + 5)
    assert not worker.is_alive(), f"{key}: hung past {bound + 5:.1f} s"
    out = result["out"]
    assert not isinstance(out, tuple), f"{key}: {out[1]!r}"
    if isinstance(out, RemoteRewardError):
        assert server.url(key) in str(out) and f"'{key}-0'" in str(out), str(out)
    else:
        assert out == [0.5], (key, out)
    return out, result["s"], bound


def test_a_100_continue_flood_is_cut_at_the_deadline(server):
    """The hostile pass: `100 Continue` every second hung a run for 13 minutes (timeout_s bound
    each socket read, not the request). Before the fix this case hung past its guard."""
    out, seconds, bound = run_case(server, "flood", forever(b"HTTP/1.1 100 Continue\r\n\r\n", 0.2), 1.0)
    assert isinstance(out, RemoteRewardError) and "timed out after 1 s" in str(out)
    assert seconds < bound


def test_trickled_headers_are_cut_at_the_deadline(server):
    """One header line every 0.3 s (timeout_s 1): before the fix each read waited anew (100
    header lines: 30 s); now the request ends at its deadline."""
    script = forever(b"X-Slow: 1\r\n", 0.3, head=b"HTTP/1.1 200 OK\r\n")
    out, seconds, bound = run_case(server, "trickle", script, 1.0)
    assert isinstance(out, RemoteRewardError) and seconds < bound


def hostile_script(rng: random.Random):
    """(kind, script) of one fuzz case."""
    kind = rng.choice(
        ["ok", "status", "1xx", "headers", "length", "chunked", "slowloris", "body", "mutate", "close", "big"]
    )
    if kind == "ok":
        return kind, steps((reply(VALID, extra=b"X-A: b\r\n"), 0))
    if kind == "status":
        status = rng.choice(
            [b"HTTP/1.1 503 Busy", b"HTTP/1.0 404 No", b"HTTP/9.9 200 OK", b"garbage", b"HTTP/1.1 99999 x",
             b"", b"HTTP/1.1 103 Early", b"HTTP/1.1 200", b"HTTP/1.1 -1 x", b"\xff\xfe" * 40]
        )  # fmt: skip
        return kind, steps((reply(VALID, status), 0))
    if kind == "1xx":
        code = rng.choice([b"100 Continue", b"102 Processing", b"103 Early Hints"])
        return kind, forever(b"HTTP/1.1 " + code + b"\r\n\r\n", rng.uniform(0.0, 0.2))
    if kind == "headers":
        line = rng.choice([b"X-Slow: 1\r\n", b"X: " + b"a" * 70000 + b"\r\n", b"no colon\r\n"])
        return kind, forever(line, rng.uniform(0.0, 0.2), head=b"HTTP/1.1 200 OK\r\n")
    if kind == "length":
        n = rng.choice([10**12, 2**63, -5, 10**30])
        return kind, steps((b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + VALID, 2.0))
    if kind == "chunked":
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        return kind, steps((head + rng.choice([junk, b"ffffffffffff\r\n" + junk, b"5\r\nab"]), 0))
    if kind == "slowloris":
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
        return kind, forever(b"{", rng.uniform(0.05, 0.2), head=head)
    if kind == "body":
        body = rng.choice(
            [b"not json", b'{"rewards": [NaN]}', b'{"rewards": [Infinity]}', b'{"rewards": [1e999]}',
             b'{"rewards": [true]}', b'{"rewards": ["1"]}', b'{"rewards": [1, 2]}', b"[" * 100000,
             b'{"rewards": [' + b"9" * 5000 + b"]}", b"\xff\xfe", b"{}", b""]
        )  # fmt: skip
        return kind, steps((reply(body), 0))
    if kind == "mutate":
        raw = bytearray(reply(VALID))
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return kind, steps((bytes(raw), 0.3))
    if kind == "close":
        return kind, steps((b"", 0))
    return kind, steps((reply(b" " * (remote.MAX_REPLY_BYTES + 10) + VALID), 0))


def test_seeded_fuzz_of_hostile_servers(server, monkeypatch):
    monkeypatch.setattr(remote, "MAX_REPLY_BYTES", 64 * 1024)  # "big": over the cap without 16 MB each
    rng = random.Random(20261202)
    cases = [(f"fuzz{i}", *hostile_script(rng)) for i in range(96)]
    failures: list[str] = []
    kinds: dict = {}
    t0 = time.monotonic()

    def one(case):
        key, kind, script = case
        try:
            out, seconds, bound = run_case(server, key, script, timeout_s=0.6, retries=rng_retries[key])
            assert seconds < bound, f"{key} ({kind}): {seconds:.2f} s over {bound:.2f}"
            kinds.setdefault(kind, []).append("score" if isinstance(out, list) else "error")
        except AssertionError as e:
            failures.append(f"{key} ({kind}): {e}")

    rng_retries = {key: (i % 3 == 0) * 1 for i, (key, _, _) in enumerate(cases)}
    for start in range(0, len(cases), 16):  # 16 cases at a time, each with its own guard
        threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in cases[start : start + 16]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    elapsed = time.monotonic() - t0
    print(f"reward server fuzz: {len(cases)} cases in {elapsed:.1f} s: {sorted((k, len(v)) for k, v in kinds.items())}")
    assert not failures, "\n".join(failures)
    assert sum(len(v) for v in kinds.values()) == len(cases)
    assert "score" in kinds["ok"] and elapsed < 15


def test_stop_signals_during_a_request(server):
    """A first stop signal: the request runs to its deadline but no retry starts; a second one
    abandons it at once. Both are RewardInterrupted (the trainer checkpoints the last whole step
    and exits 130); the handler raises nothing inside the wait. Before: the wait could not be
    interrupted, and a second signal raised KeyboardInterrupt wherever the run was."""
    import os
    import signal

    from loomrl.platform import signals
    from loomrl.platform.rewards.remote import RewardInterrupted
    from loomrl.platform.run_state import StopRequest

    server.scripts["sig"] = forever(b"HTTP/1.1 100 Continue\r\n\r\n", 0.2)
    client = RemoteReward(server.url("sig"), timeout_s=30.0, retries=3, backoff_s=0.01)
    stop = StopRequest()
    with stop:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match=r"sig.*'s-0'.*second stop signal"):
            client.score(["x"], [{"id": "s-0"}])
        assert time.monotonic() - t0 < 3 and signals.received() == 2 and stop.requested
    server.scripts["sig1"] = forever(b"HTTP/1.1 100 Continue\r\n\r\n", 0.2)
    client = RemoteReward(server.url("sig1"), timeout_s=1.0, retries=3, backoff_s=0.01)
    with StopRequest():
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match="no retry, the run was told to stop"):
            client.score(["x"], [{"id": "s-0"}])
        assert 0.9 < time.monotonic() - t0 < 3
