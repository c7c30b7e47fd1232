"""A remote reward server: rewards computed by another process or machine (a code sandbox,
a judge model, a verifier service), over plain HTTP(S) with the standard library only.

Protocol: each batch of at most `batch_size` completions is one request

    POST <url>   Content-Type: application/json
    {"completions": ["...", ...], "samples": [{"id": ..., "prompt": ..., "answer": ..., "meta": {...}}, ...]}

answered with status 200 and

    {"rewards": [0.5, ...]}      one finite number per completion, in order.

Guarantees: every request has a deadline of `timeout_s` seconds in total (connecting, sending,
interim 1xx replies, headers and the whole body: a server that trickles bytes or floods
`100 Continue` is cut off at the deadline, however it paces itself) and a reply of at most
MAX_REPLY_BYTES. The exchange runs in a helper thread the caller abandons at the deadline
(its socket shut); the wait polls the run's stop signals (`platform/signals.py`): after a
first SIGINT / SIGTERM no retry starts, a second abandons the request at once; either is a
RewardInterrupted, and the trainer then checkpoints the last whole step. Errors name the
server and the batch's first sample. Connection errors, timeouts and 5xx replies are retried `retries` times
with an exponential backoff (backoff_s, doubling, at most MAX_BACKOFF_S); after the last
one, RemoteRewardError names the URL and the last failure. A reply that is not JSON, has
no `rewards` list of the batch's length, or holds a value that is not a finite number is
an error at once (retrying would not change it), as is a 4xx status. Proxies
(http_proxy ...) are not used: the server is reached directly.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import ssl
import threading
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from loomrl.platform import signals
from loomrl.platform.rewards.base import RewardError

log = logging.getLogger("loomrl")

MAX_REPLY_BYTES = 16 * 2**20
"""A reply longer than this is an error (a batch's rewards take a few KB)."""
MAX_BACKOFF_S = 5.0
"""The longest wait between two attempts."""
POLL_S = 0.05
"""How often a wait on a server reads the clock and the run's stop signals."""


class RemoteRewardError(RewardError):
    """A reward server that could not score a batch: the message names the URL."""


class RewardInterrupted(RemoteRewardError):
    """A request abandoned because the run was told to stop (a second signal, or a first one
    before a retry): the trainer abandons the step and checkpoints the last whole one."""


class _Retryable(Exception):
    """A failure worth another attempt: connection, timeout, 5xx."""


class _Exchange:
    """One HTTP exchange, run in a helper thread (`run`) so the caller can give up on it at the
    deadline: `reply` (status, body) or `error` when it ends; `abort` shuts its socket, which
    wakes a read blocked in it. Each read's socket timeout is the time left before the deadline."""

    def __init__(self, server: "RemoteReward", body: bytes, deadline: float, where: str):
        self.server, self.body, self.deadline, self.where = server, body, deadline, where
        self.reply: Optional[tuple[int, bytes]] = None
        self.error: Optional[BaseException] = None
        self.sock: Optional[socket.socket] = None
        self.aborted = False

    def left(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or self.aborted:
            raise socket.timeout("timed out")
        return remaining

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self) -> None:
        s = self.server
        try:
            self.reply = self._exchange()
        except (socket.timeout, TimeoutError):
            self.error = _Retryable(f"timed out after {s.timeout_s:g} s (no whole reply)")
        except ssl.SSLCertVerificationError as e:  # retrying cannot fix a certificate
            self.error = RemoteRewardError(f"{self.where}: {e}")
        except (OSError, http.client.HTTPException) as e:
            self.error = _Retryable(f"{type(e).__name__}: {str(e)[:200]}")
        except (RemoteRewardError, _Retryable) as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - a reply from outside: whatever it breaks is named, once
            self.error = RemoteRewardError(f"{self.where}: a broken reply: {type(e).__name__}: {str(e)[:200]}")

    def _exchange(self) -> tuple[int, bytes]:
        s = self.server
        cls = http.client.HTTPSConnection if s.https else http.client.HTTPConnection
        conn = cls(s.host, s.port, timeout=self.left())
        try:
            conn.connect()
            self.sock = conn.sock  # the response reads it; getresponse may drop conn.sock (Connection: close)
            if self.aborted:
                raise socket.timeout("timed out")
            self.sock.settimeout(self.left())
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            conn.request("POST", s.path, body=self.body, headers=headers)
            self.sock.settimeout(self.left())
            resp = conn.getresponse()
            chunks, size = [], 0
            while True:
                self.sock.settimeout(self.left())
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise RemoteRewardError(f"{self.where}: reply over {MAX_REPLY_BYTES} bytes")
                chunks.append(chunk)
            self.left()
        finally:
            conn.close()
        if resp.status >= 500:
            raise _Retryable(f"HTTP {resp.status} {str(resp.reason)[:100]}")
        return resp.status, b"".join(chunks)


def check_url(url: str) -> str:
    """`url` when it is an http:// or https:// URL with a host; else ValueError saying why."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as e:
        raise ValueError(f"{url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: only http:// and https:// URLs are accepted")
    if not host:
        raise ValueError(f"{url!r} has no host")
    return url


class RemoteReward:
    """score(completions, samples) -> one float per completion, from the server at `url`."""

    def __init__(
        self, url: str, batch_size: int = 32, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2
    ):
        self.url = check_url(url)
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if batch_size < 1 or timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(
                f"reward server {url}: batch_size >= 1, timeout_s > 0, retries >= 0 and backoff_s >= 0 are needed"
            )
        self.batch_size, self.timeout_s, self.retries, self.backoff_s = batch_size, timeout_s, retries, backoff_s

    def score(self, completions: list[str], samples: list[dict]) -> list[float]:
        if len(completions) != len(samples):
            raise ValueError(f"reward server {self.url}: {len(completions)} completions but {len(samples)} samples")
        out: list[float] = []
        for i in range(0, len(completions), self.batch_size):
            out += self.score_batch(completions[i : i + self.batch_size], samples[i : i + self.batch_size])
        return out

    def score_batch(self, completions: list[str], samples: list[dict]) -> list[float]:
        """One request (with its retries) for at most batch_size completions. After a stop
        signal no retry is started (RewardInterrupted)."""
        where = f"reward server {self.url} on {_samples(samples)}"
        try:
            body = json.dumps({"completions": completions, "samples": samples}).encode()
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"{where}: cannot send the batch as JSON: {e}") from None
        last: Optional[str] = None
        for attempt in range(self.retries + 1):
            if attempt:
                if signals.received():
                    raise RewardInterrupted(f"{where}: {last}; no retry, the run was told to stop")
                wait = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))
                log.warning("%s: %s; retry %d/%d in %.2f s", where, last, attempt, self.retries, wait)
                self._sleep(wait, where)
            try:
                status, reply = self._post(body, where)
            except _Retryable as e:
                last = str(e)
                continue
            return self._rewards(status, reply, len(completions), where)
        raise RemoteRewardError(f"{where}: no answer after {self.retries + 1} attempt(s); last failure: {last}")

    @staticmethod
    def _sleep(seconds: float, where: str) -> None:
        """The backoff before a retry, cut short by a stop signal."""
        end = time.monotonic() + seconds
        with signals.interruptible():
            while (left := end - time.monotonic()) > 0:
                if signals.received():
                    raise RewardInterrupted(f"{where}: no retry, the run was told to stop")
                time.sleep(min(POLL_S, left))

    def _post(self, body: bytes, where: str) -> tuple[int, bytes]:
        """POST `body`; the status and the reply body, all within timeout_s in total (connecting,
        interim 1xx replies, headers, body). The exchange runs in a helper thread (`_Exchange`);
        this thread waits for it against the deadline, polling the run's stop signals: at the
        deadline the socket is shut and the exchange abandoned. 5xx, connection errors and
        timeouts raise _Retryable; a second stop signal raises RewardInterrupted."""
        exchange = _Exchange(self, body, time.monotonic() + self.timeout_s, where)
        worker = threading.Thread(target=exchange.run, name="reward-request", daemon=True)
        worker.start()
        with signals.interruptible():
            while worker.is_alive():
                if signals.received() >= 2:
                    exchange.abort()
                    raise RewardInterrupted(f"{where}: request abandoned on a second stop signal")
                left = exchange.deadline - time.monotonic()
                if left <= 0:
                    exchange.abort()
                    raise _Retryable(f"timed out after {self.timeout_s:g} s (no whole reply)")
                worker.join(min(POLL_S, left))
        if isinstance(exchange.error, BaseException):
            raise exchange.error
        assert exchange.reply is not None
        return exchange.reply

    def _rewards(self, status: int, reply: bytes, n: int, where: str) -> list[float]:
        """The rewards of a reply, checked: status 200, JSON {"rewards": [n finite numbers]}."""
        if status != 200:
            raise RemoteRewardError(f"{where}: HTTP {status}: {_snippet(reply)}")
        try:
            data: Any = json.loads(reply)
        except (ValueError, RecursionError):  # not UTF-8 / not JSON / an integer over 4300 digits / too deep
            raise RemoteRewardError(f"{where}: the reply is not JSON: {_snippet(reply)}") from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise RemoteRewardError(f'{where}: expected {{"rewards": [...]}}, got {_snippet(reply)}')
        if len(rewards) != n:
            raise RemoteRewardError(f"{where}: {len(rewards)} rewards for {n} completions")
        out = []
        for i, r in enumerate(rewards):
            value = None
            if isinstance(r, (int, float)) and not isinstance(r, bool):
                try:
                    value = float(r)
                except OverflowError:
                    value = None
            if value is None or not math.isfinite(value):
                raise RemoteRewardError(f"{where}: reward {i} is {json.dumps(r)[:100]}, not a finite number")
            out.append(value)
        return out


def _samples(samples: list[dict]) -> str:
    """The samples of a batch, as an error names them: the first id, and how many."""
    first = samples[0].get("id") if samples and isinstance(samples[0], dict) else None
    more = f" and {len(samples) - 1} more" if len(samples) > 1 else ""
    return f"sample {str(first)[:100]!r}{more}"


def _snippet(reply: bytes, limit: int = 200) -> str:
    text = reply[:limit].decode("utf-8", "replace")
    return repr(text) + ("..." if len(reply) > limit else "")
