"""The remote reward client (loomrl/platform/rewards/remote.py) against a real HTTP server
started in the test (127.0.0.1, a free port): batches as configured, retries on 503 and
timeouts with their count checked, clear errors naming the URL, replies that are not JSON /
the wrong length / not finite refused, and a recipe's url source scored through sources.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loomrl.platform.recipe import load_recipe
from loomrl.platform.rewards.remote import RemoteReward, RemoteRewardError
from loomrl.platform.rewards.sources import build_sources, score


class Server:
    """A reward server whose behaviour a test sets: it records every request body; the first
    `fail_first` requests get 503; every request waits `delay_s`; `reply` (a function of the
    request) makes the body, by default a reward per completion: len(completion) / 10. The
    first `slow_first` requests wait `delay_s` first; `trickle_s` > 0 sends the body a byte at a
    time, that many seconds apart."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_first = 0
        self.delay_s = 0.0
        self.slow_first = 10**9
        self.trickle_s = 0.0
        self.status = 200
        self.reply = lambda req: json.dumps({"rewards": [len(c) / 10 for c in req["completions"]]}).encode()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if len(outer.requests) <= outer.slow_first:
                    time.sleep(outer.delay_s)
                if len(outer.requests) <= outer.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                data = outer.reply(body)
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if outer.trickle_s:
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(outer.trickle_s)
                else:
                    self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that timed out and left
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.closed = False

    def close(self):
        if not self.closed:
            self.closed = True
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture()
def server():
    s = Server()
    yield s
    s.close()


COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee"]
SAMPLES = [{"id": f"s{i}", "prompt": "p", "answer": str(i), "meta": {"k": i}} for i in range(5)]


def test_batched_scoring(server):
    rr = RemoteReward(server.url, batch_size=2, timeout_s=5, retries=0)
    assert rr.score(COMPLETIONS, SAMPLES) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert [r["completions"] for r in server.requests] == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]
    assert [[s["id"] for s in r["samples"]] for r in server.requests] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert server.requests[2]["samples"][0] == SAMPLES[4]  # the whole record travels
    assert rr.score([], []) == [] and len(server.requests) == 3  # nothing to score: no request


def test_503_then_success_is_retried(server):
    server.fail_first = 2
    rr = RemoteReward(server.url, batch_size=8, timeout_s=5, retries=2, backoff_s=0.01)
    assert rr.score(COMPLETIONS[:2], SAMPLES[:2]) == [0.1, 0.2]
    assert len(server.requests) == 3  # 503, 503, 200
    assert all(r["completions"] == ["a", "bb"] for r in server.requests)  # the same batch each time


def test_a_server_that_always_fails_is_an_error_naming_the_url(server):
    server.fail_first = 10**6
    rr = RemoteReward(server.url, timeout_s=5, retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError) as e:
        rr.score(COMPLETIONS[:1], SAMPLES[:1])
    assert len(server.requests) == 4  # retries + 1 attempts
    msg = str(e.value)
    assert server.url in msg and "after 4 attempt(s)" in msg and "HTTP 503" in msg


def test_a_slow_server_times_out_then_errors(server):
    server.delay_s = 0.6
    rr = RemoteReward(server.url, timeout_s=0.2, retries=1, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError) as e:
        rr.score(COMPLETIONS[:1], SAMPLES[:1])
    elapsed = time.perf_counter() - t0
    assert "timed out after 0.2 s" in str(e.value) and server.url in str(e.value)
    assert len(server.requests) == 2 and elapsed < 1.0  # two attempts of ~0.2 s, not 2 x 0.6 s
    # only the first request is slow: the retry succeeds
    server.requests.clear()
    server.slow_first = 1
    assert RemoteReward(server.url, timeout_s=0.2, retries=1, backoff_s=0.01).score(["xy"], SAMPLES[:1]) == [0.2]
    assert len(server.requests) == 2


def test_a_trickling_reply_is_cut_at_the_deadline(server):
    server.trickle_s = 0.05  # ~16 bytes: 0.8 s in all, each byte well within the timeout
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError, match="timed out after 0.3 s"):
        RemoteReward(server.url, timeout_s=0.3, retries=0).score(["a"], SAMPLES[:1])
    assert time.perf_counter() - t0 < 0.6


def test_nobody_listening_is_retried_then_an_error(server):
    url = server.url
    server.close()
    with pytest.raises(RemoteRewardError, match=f"reward server {url} on sample 's0': no answer after 2 attempt"):
        RemoteReward(url, timeout_s=1, retries=1, backoff_s=0.01).score(["a"], SAMPLES[:1])


@pytest.mark.parametrize(
    "reply, needle",
    [
        (b"<html>oops</html>", "the reply is not JSON"),
        (b'{"rewards": [0.5, 0.5]}', "2 rewards for 1 completions"),
        (b'{"scores": [0.5]}', 'expected {"rewards": [...]}'),
        (b'{"rewards": [NaN]}', "reward 0 is NaN, not a finite number"),
        (b'{"rewards": [1e999]}', "reward 0 is Infinity, not a finite number"),
        (b'{"rewards": ["0.5"]}', 'reward 0 is "0.5", not a finite number'),
        (b'{"rewards": [true]}', "reward 0 is true, not a finite number"),
    ],
)
def test_bad_replies_are_errors_without_retry(server, reply, needle):
    server.reply = lambda req: reply
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(server.url, retries=3, backoff_s=0.01).score(["a"], SAMPLES[:1])
    assert needle in str(e.value) and server.url in str(e.value)
    assert len(server.requests) == 1  # a wrong reply is not retried


def test_a_4xx_is_an_error_at_once(server):
    server.status = 400
    server.reply = lambda req: b"bad request: no samples"
    with pytest.raises(RemoteRewardError, match="HTTP 400: 'bad request: no samples'"):
        RemoteReward(server.url, retries=3, backoff_s=0.01).score(["a"], SAMPLES[:1])
    assert len(server.requests) == 1


def test_only_http_urls(server):
    for url in ("ftp://127.0.0.1/x", "file:///etc/passwd", "127.0.0.1:8000", "http:///nohost"):
        with pytest.raises(ValueError):
            RemoteReward(url)


def test_a_recipe_url_source_is_scored_through_sources(server, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""
algorithm:
  rewards:
    - {{fn: exact, weight: 1.0}}
    - {{url: '{server.url}', weight: 0.5, batch_size: 2, timeout_s: 2, retries: 1}}
""")
    r = load_recipe(recipe, files=False)
    sources = build_sources(r.algorithm)
    assert [s.name for s in sources] == ["exact", "127.0.0.1"]
    total, by = score(sources, ["0", "wrong"], SAMPLES[:2])
    assert by == {"exact": [1.0, 0.0], "127.0.0.1": [0.1, 0.5]}
    assert total == pytest.approx([1.0 + 0.05, 0.25])
    assert [len(r["completions"]) for r in server.requests] == [2]
