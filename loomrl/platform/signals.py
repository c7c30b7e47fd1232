"""The run's stop signals as state any part can poll: how many SIGINT / SIGTERM arrived since
the run's handlers were put in place, and whether the main thread is in a wait that polls them.

Design: `run_state.StopRequest` owns the handlers and counts each signal here (`note`). The
first asks the loop to finish its step; a second stops at once. "At once" is safe only where
the code is waiting on something outside (a reward server): such a wait runs inside
`interruptible()` and polls `received()`, and abandons what it waits for by raising its own
error, so the step is abandoned whole and the run still writes the checkpoint of its last
whole step. Outside such a wait the second signal raises `StopNow` from the handler (the run
stops without a new checkpoint). This module imports nothing of loomrl, so any part can use it.
"""

from __future__ import annotations

from contextlib import contextmanager


class StopNow(BaseException):
    """A second SIGINT / SIGTERM outside an interruptible wait: stop at once, no new checkpoint.
    A BaseException, so no `except Exception` on the way swallows it."""


class _State:
    received = 0
    waiting = 0


def received() -> int:
    """Signals received since `reset()` (the run's handlers being put in place)."""
    return _State.received


def note() -> None:
    """A signal arrived (called by the handler)."""
    _State.received += 1


def reset() -> None:
    _State.received = 0


def waiting() -> bool:
    """Whether the main thread is in an interruptible wait (a second signal is left to it)."""
    return _State.waiting > 0


@contextmanager
def interruptible():
    """A wait that polls `received()` itself: a second signal does not raise inside it."""
    _State.waiting += 1
    try:
        yield
    finally:
        _State.waiting -= 1
