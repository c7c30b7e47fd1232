"""loomrl's log output: progress to stdout, warnings and errors to stderr, no prefixes. Every
entry point (the `loomrl` command, a disaggregated role's process) calls `setup_logging` once."""

from __future__ import annotations

import logging
import sys


class _StdHandler(logging.Handler):
    """Writes to whatever sys.stdout / sys.stderr is at the time of the record (a test harness or
    a redirect may swap them after logging was set up)."""

    def __init__(self, stream: str, level: int = logging.NOTSET):
        super().__init__(level)
        self.stream_name = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def setup_logging() -> None:
    """loomrl's messages: progress to stdout, warnings and errors to stderr, no prefixes."""
    logger = logging.getLogger("loomrl")
    if any(isinstance(h, _StdHandler) for h in logger.handlers):
        return
    out = _StdHandler("stdout")
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = _StdHandler("stderr", logging.WARNING)
    for h in (out, err):
        h.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False
