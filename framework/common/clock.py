"""Time as the engine sees it: wall time for real execution, virtual time for simulation."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    """Seconds since the clock started. ``wait_until`` returns once ``now() >= t``."""

    @abstractmethod
    def now(self) -> float: ...

    @abstractmethod
    def wait_until(self, t: float) -> None: ...


class WallClock(Clock):
    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock(Clock):
    """Advanced explicitly (by a simulated executor, or by waiting for the next arrival)."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"a clock cannot go backwards (dt={dt})")
        self._t += dt

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)


class CPUClock(Clock):
    """Wall time as a dedicated machine would see it: this process's CPU time plus the waits that
    ``wait_until`` skips instead of sleeping, so real runs time reproducibly on shared cores. It
    counts every thread's CPU time: use it with one compute thread."""

    def __init__(self) -> None:
        self._t0 = time.process_time()
        self._skipped = 0.0

    def now(self) -> float:
        return time.process_time() - self._t0 + self._skipped

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            self._skipped += delay
