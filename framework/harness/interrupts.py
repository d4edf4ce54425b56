"""SIGINT and SIGTERM held back while a run's state is between two consistent points, then acting as they would have.

Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is: inside an engine step it would leave requests
half moved between the scheduler's queues and the allocator's blocks, and after a finished request's record was kept
but before its row was written it would leave the summary and ``requests.csv`` disagreeing. Main thread only (where
Python runs handlers); masking the signals would not do, another thread would take them.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def act(signum: int, handler: Any) -> None:
    """What ``signum`` would have done under ``handler`` (installed again by the caller): a Python handler is called
    (Python's Ctrl-C one raises KeyboardInterrupt), the default action taken, an ignored signal dropped."""
    if callable(handler):
        handler(signum, None)
    elif handler != signal.SIG_IGN:
        signal.raise_signal(signum)


class Hold:
    """While ``held`` (a plain flag, so a step pays nothing to set it), SIGINT and SIGTERM wait; ``release`` acts on
    the first that came. Installed for a ``with`` block on the main thread; elsewhere it holds nothing."""

    def __init__(self) -> None:
        self.held = False
        self._pending: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Hold:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous, self.held = {}, False
        if self._pending is not None:  # held when the block left (an error, say): it acts now, as it would have
            signum, self._pending = self._pending, None
            act(signum, signal.getsignal(signum))

    def _handle(self, signum: int, frame: Any) -> None:
        if self.held:
            if self._pending is None:
                self._pending = signum
            return
        handler = self._previous[signum]
        if callable(handler):
            handler(signum, frame)
        else:  # the default action (or none): taken with the handler this hold replaced
            signal.signal(signum, handler)
            act(signum, handler)

    def release(self) -> None:
        """Stop holding; a signal that came meanwhile acts now."""
        self.held = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            self._handle(signum, None)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then act as they would have."""
    with Hold() as hold:
        hold.held = True
        yield
