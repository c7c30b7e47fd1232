"""A remote reward server: rewards computed by another process or machine (a code sandbox,
a judge model, a verifier service), over plain HTTP(S) with the standard library only.

Protocol: each batch of at most `batch_size` completions is one request

    POST <url>   Content-Type: application/json
    {"completions": ["...", ...], "samples": [{"id": ..., "prompt": ..., "answer": ..., "meta": {...}}, ...]}

answered with status 200 and

    {"rewards": [0.5, ...]}      one finite number per completion, in order.

Guarantees: every request has a deadline of `timeout_s` seconds (connecting, sending and
reading the whole reply: a server that trickles bytes is cut off too) and a reply of at most
MAX_REPLY_BYTES. Connection errors, timeouts and 5xx replies are retried `retries` times
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
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from loomrl.platform.rewards.base import RewardError

log = logging.getLogger("loomrl")

MAX_REPLY_BYTES = 16 * 2**20
"""A reply longer than this is an error (a batch's rewards take a few KB)."""
MAX_BACKOFF_S = 5.0
"""The longest wait between two attempts."""


class RemoteRewardError(RewardError):
    """A reward server that could not score a batch: the message names the URL."""


class _Retryable(Exception):
    """A failure worth another attempt: connection, timeout, 5xx."""


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
        """One request (with its retries) for at most batch_size completions."""
        try:
            body = json.dumps({"completions": completions, "samples": samples}).encode()
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"reward server {self.url}: cannot send the batch as JSON: {e}") from None
        last: Optional[str] = None
        for attempt in range(self.retries + 1):
            if attempt:
                wait = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))
                log.warning("reward server %s: %s; retry %d/%d in %.2f s", self.url, last, attempt, self.retries, wait)
                time.sleep(wait)
            try:
                status, reply = self._post(body)
            except _Retryable as e:
                last = str(e)
                continue
            return self._rewards(status, reply, len(completions))
        raise RemoteRewardError(
            f"reward server {self.url}: no answer after {self.retries + 1} attempt(s); last failure: {last}"
        )

    def _post(self, body: bytes) -> tuple[int, bytes]:
        """POST `body`; the status and the reply body, all within timeout_s. 5xx, connection
        errors and timeouts raise _Retryable."""
        deadline = time.monotonic() + self.timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("timed out")
            return remaining

        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request(
                "POST", self.path, body=body, headers={"Content-Type": "application/json", "Accept": "application/json"}
            )
            sock = conn.sock  # the response reads it; getresponse may drop conn.sock (Connection: close)
            sock.settimeout(left())
            resp = conn.getresponse()
            chunks, size = [], 0
            while True:
                sock.settimeout(left())
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise RemoteRewardError(f"reward server {self.url}: reply over {MAX_REPLY_BYTES} bytes")
                chunks.append(chunk)
            left()
        except (socket.timeout, TimeoutError):
            raise _Retryable(f"timed out after {self.timeout_s:g} s") from None
        except ssl.SSLCertVerificationError as e:  # retrying cannot fix a certificate
            raise RemoteRewardError(f"reward server {self.url}: {e}") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if resp.status >= 500:
            raise _Retryable(f"HTTP {resp.status} {resp.reason}")
        return resp.status, b"".join(chunks)

    def _rewards(self, status: int, reply: bytes, n: int) -> list[float]:
        """The rewards of a reply, checked: status 200, JSON {"rewards": [n finite numbers]}."""
        where = f"reward server {self.url}"
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


def _snippet(reply: bytes, limit: int = 200) -> str:
    text = reply[:limit].decode("utf-8", "replace")
    return repr(text) + ("..." if len(reply) > limit else "")
