"""Requests that enter a running serving loop at their own times (open-loop serving).

`Runner.run(requests, arrivals=...)` asks its arrival source once per loop turn for the requests that have arrived
since, and hands back the ones whose client went away. The loop never waits for a source while it has rows to run;
with nothing to run it sleeps in `wait` until the next request is due. Two sources:
- `TraceArrivals`: a fixed trace, each request due at its offset from the loop's start (a benchmark's arrivals);
- `QueueArrivals`: requests submitted from other threads (an HTTP server), cancelled by them, closed when done.
Times are `time.perf_counter()` seconds; a request's `arrival_s` is when it was due or submitted, so the time it
waited for the loop to notice it counts in its time to first token.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from onepass.engine.scheduler import Request


class TraceArrivals:
    def __init__(self, trace: list[tuple[float, Request]], clock=time.perf_counter):
        """trace: (seconds after the loop's first poll, request) pairs."""
        self.pending = deque(sorted(trace, key=lambda tr: (tr[0], tr[1].rid)))
        self.clock = clock
        self.t0: float | None = None

    @property
    def exhausted(self) -> bool:
        return not self.pending

    def poll(self, now: float) -> list[Request]:
        if self.t0 is None:
            self.t0 = now
        out = []
        while self.pending and self.t0 + self.pending[0][0] <= now:
            offset, req = self.pending.popleft()
            req.arrival_s = self.t0 + offset
            out.append(req)
        return out

    def cancelled(self) -> list[Request]:
        return []

    def wait(self) -> None:
        """Sleep until the next request is due."""
        if self.pending and self.t0 is not None:
            time.sleep(max(0.0, self.t0 + self.pending[0][0] - self.clock()))

    def emit(self, grown: list[Request], finished: list[Request]) -> None:
        pass


class QueueArrivals:
    """Thread-safe: `submit` and `cancel` from any thread, the loop polls. `close()` ends the loop once every
    submitted request has finished. Subclass `emit` to stream tokens out (it runs on the loop's thread)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._new: deque[Request] = deque()
        self._gone: list[Request] = []
        self._closed = False

    @property
    def exhausted(self) -> bool:
        with self._cv:
            return self._closed and not self._new

    def submit(self, req: Request) -> None:
        with self._cv:
            req.arrival_s = time.perf_counter()
            self._new.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            self._gone.append(req)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def poll(self, now: float) -> list[Request]:
        with self._cv:
            out = list(self._new)
            self._new.clear()
            return out

    def cancelled(self) -> list[Request]:
        with self._cv:
            out, self._gone = self._gone, []
            return out

    def wait(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._new or self._gone or self._closed, timeout=1.0)

    def emit(self, grown: list[Request], finished: list[Request]) -> None:
        pass
