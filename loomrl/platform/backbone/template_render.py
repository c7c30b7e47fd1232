"""Chat templates rendered under bounds: a template is a program from outside (a checkpoint's
`chat_template.jinja`, `data.chat_template`), so its rendering is stopped when it runs too long
or writes too much, and the stop is a TemplateLimit (the caller names the template).

Design: the template is compiled by transformers' own `_compile_jinja_template`, so the
environment is the one `apply_chat_template` uses (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, the `generation` tag, `tojson`, `raise_exception`, `strftime_now`):
sandbox escapes are refused as before and a normal template renders byte for byte as
`tokenizer.apply_chat_template(..., tokenize=False)` would. The variables are the same too
(the tokenizer's special tokens, `messages`, `tools`, `documents`, `add_generation_prompt`), with
one more: `range`, which shadows the sandbox's (that caps one range at 100000 items but not
nested loops) with one that counts every item of every range of the render against
MAX_RANGE_ITEMS and checks the deadline as it goes. The text is produced with
`Template.generate()`, chunk by chunk: over MAX_RENDER_CHARS, or past the deadline between two
chunks, the render stops. A loop that writes nothing and iterates no range (over a long string,
say) is stopped by a watchdog: one thread that, at a render's deadline, raises an exception in
the rendering thread (`PyThreadState_SetAsyncExc`, delivered at the next bytecode; the
watchdog's lock makes sure it never lands after the render has returned). What no bound
catches: one C-level operation that is itself huge (`"x" * 10**10`, which Jinja even folds at compile time) runs
until it fails (a MemoryError, named) or ends, and is stopped then.
"""

from __future__ import annotations

import ctypes
import threading
import time

MAX_RENDER_CHARS = 1 << 20
"""The most text one render may produce (a prompt is a few KB)."""
MAX_RENDER_S = 2.0
"""The longest one render may take (a normal template takes well under a millisecond)."""
MAX_RANGE_ITEMS = 100_000
"""The most items all the `range()` calls of one render may yield together."""


class TemplateLimit(Exception):
    """A render stopped by a bound: the message says which."""


class _Deadline(Exception):
    """Raised in the rendering thread by the watchdog."""


class _Budget:
    """The deadline and the range items left for one render."""

    def __init__(self, max_s: float, max_items: int):
        self.deadline = time.monotonic() + max_s
        self.max_s, self.items = max_s, max_items
        self.max_items = max_items

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took over {self.max_s:g} s")

    def range(self, *args):
        """A counted `range`: every item spends the budget; the clock is read every 1024 items."""
        for n, i in enumerate(range(*args)):
            self.items -= 1
            if self.items < 0:
                raise TemplateLimit(f"its loops run over {self.max_items} range() items in one render")
            if n % 1024 == 1023:
                self.check_time()
            yield i


def compile_template(source: str):
    """The template compiled as transformers compiles it (cached by its source)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source)


def render_bounded(
    tokenizer,
    source: str,
    messages: list[dict],
    add_generation_prompt: bool,
    max_chars: int = MAX_RENDER_CHARS,
    max_s: float = MAX_RENDER_S,
) -> str:
    """`tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
    add_generation_prompt=...)`, stopped by TemplateLimit past `max_chars` or `max_s`.
    Any other failure of the template propagates as it is."""
    budget = _Budget(max_s, MAX_RANGE_ITEMS)
    variables = {**tokenizer.special_tokens_map, "range": budget.range}

    def render() -> str:
        template = compile_template(source)  # under the watchdog: Jinja folds constant expressions
        chunks, size = [], 0
        for chunk in template.generate(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        ):
            size += len(chunk)
            if size > max_chars:
                raise TemplateLimit(f"it writes over {max_chars} characters for one prompt")
            chunks.append(chunk)
            budget.check_time()
        return "".join(chunks)

    return _with_watchdog(render, max_s)


class _Watchdog:
    """One daemon thread for every render: `arm` a deadline for the calling thread, `disarm` when
    done; a deadline that passes while armed raises _Deadline in that thread. Under the condition's
    lock a disarmed render can no longer be hit (one already hit is within the caller's try)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.armed: dict[int, float] = {}  # thread id -> deadline
        self.thread: threading.Thread | None = None

    def arm(self, max_s: float) -> None:
        with self.cond:
            self.armed[threading.get_ident()] = time.monotonic() + max_s
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._watch, name="template-watchdog", daemon=True)
                self.thread.start()
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.armed.pop(threading.get_ident(), None)

    def _watch(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                for tid, deadline in list(self.armed.items()):
                    if deadline <= now:
                        del self.armed[tid]
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Deadline))
                nearest = min(self.armed.values(), default=now + 60.0)
                self.cond.wait(max(0.0, nearest - now))


_WATCHDOG = _Watchdog()


def _with_watchdog(fn, max_s: float) -> str:
    """fn() in this thread; past `max_s` the watchdog raises _Deadline in it (-> TemplateLimit)."""
    try:
        _WATCHDOG.arm(max_s)
        try:
            return fn()
        finally:
            _WATCHDOG.disarm()
    except _Deadline:
        raise TemplateLimit(f"rendering took over {max_s:g} s") from None
