"""The server's engine side. One thread runs the serving loop (engine/runner.py) for the server's life over a
`QueueArrivals` (engine/arrivals.py) whose `emit` publishes each request's token count and wakes the HTTP handlers
that have new tokens, with one callback a turn on their event loop; a handler takes every token ready when it looks,
so the per-token work (text, JSON, one SSE event, a socket write) falls on the server's thread, and less of it the
further that thread is behind. Both threads share the interpreter lock, so what the handlers cost a token is what
the loop loses; `python -m onepass.harness.server_bench` measures it. A handler whose client went away cancels its
request, which gives its slot and blocks back at the loop's next turn. The Prometheus metrics read the loop's
scheduler when scraped."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from onepass.engine.arrivals import QueueArrivals
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request
from onepass.engine.serving_setup import ServingSetup
from onepass.kernels.errors import ConfigError

RATE_WINDOW_S = 10.0   # tokens/s is taken over this many recent seconds


@dataclass(eq=False)
class Stream:
    """A request as its HTTP handler sees it. The engine thread publishes how many output tokens are ready and whether
    it is done with the request; the handler, woken on its event loop, takes every token ready since it last looked
    (`take`), so a handler that fell behind catches up in one go instead of one wake-up per token."""
    req: Request
    loop: asyncio.AbstractEventLoop
    ready: int = 0              # output tokens handed over (written by the engine thread)
    done: bool = False          # the engine has finished with it (written by the engine thread, after `ready`)
    error: str = ""             # why it gets no (more) tokens: rejected, or the engine stopped (before `done`)
    flagged: bool = False       # a wake-up for it is on its way to the loop: the engine thread sends no other
    ended: bool = False         # the handler is through with it
    gone: bool = False          # the client went away before the answer was complete
    hung_up: bool = False       # the handler's client disconnected (set on the loop)
    taken: int = 0              # output tokens the handler took
    waiter: asyncio.Future | None = None

    async def take(self) -> tuple[list[int], bool]:
        """Every output token ready since the last take (none only at the end), and whether the engine is done."""
        while True:
            self.flagged = False   # first: a token published from here on sends a wake-up
            done = self.done       # before `ready`: once done, `ready` is final
            ready = self.ready
            if ready > self.taken or done or self.hung_up:
                new = self.req.output[self.taken:ready]   # the scheduler only ever appends to it
                self.taken = ready
                return new, done
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def wake(self) -> None:
        """On the stream's loop: the handler waiting in `take` looks again."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (one per server, so servers in one process
    never share a count)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("onepass_generated_tokens", "Tokens generated", registry=r)
        self.finished = Counter("onepass_requests_finished", "Requests answered to the end", registry=r)
        self.cancelled = Counter("onepass_requests_cancelled", "Requests whose client went away first", registry=r)
        self.rejected = Counter("onepass_requests_rejected", "Requests the scheduler refused", registry=r)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        Gauge("onepass_generated_tokens_per_second", f"Tokens generated per second over the last "
              f"{RATE_WINDOW_S:g} s", registry=r).set_function(self.rate)

    def generated(self, n: int) -> None:
        self.tokens.inc(n)
        with self._lock:
            self._recent.append((time.perf_counter(), n))

    def rate(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            n = sum(k for _, k in self._recent)
        return n / max(min(RATE_WINDOW_S, now - self._t0), 1e-3)

    def watch(self, loop: EngineLoop) -> None:
        """Gauges read from the scheduler at each scrape (a length or a count read across threads)."""
        r, sched = self.registry, loop.runner.sched
        Gauge("onepass_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            lambda: len(sched.waiting) + loop.arrivals.queued)
        Gauge("onepass_requests_running", "Requests holding a slot", registry=r).set_function(
            lambda: len(sched.running))
        if sched.bm is not None:   # a paged pool; block 0 is the scratch block, never lent
            Gauge("onepass_kv_blocks_used", "KV blocks held by requests or pinned", registry=r).set_function(
                lambda: sched.bm.num_used)
            Gauge("onepass_kv_blocks_total", "KV blocks of the pool", registry=r).set(sched.bm.num_blocks - 1)


class StreamingArrivals(QueueArrivals):
    """Requests from HTTP handlers; their tokens back to them, at most one wake-up of each handler loop per step."""

    def __init__(self, metrics: Metrics):
        super().__init__()
        self.metrics = metrics
        self.streams: dict[int, Stream] = {}
        self.failure = ""           # set once the loop died: no request is taken after it
        self._batches: dict[asyncio.AbstractEventLoop, list[Stream]] = {}   # streams to wake, by loop, not yet woken
        self._batch_lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Submitted, not yet taken by the loop."""
        with self._cv:
            return len(self._new)

    def open(self, req: Request, loop: asyncio.AbstractEventLoop) -> Stream:
        stream = Stream(req, loop)
        with self._cv:
            if self.failure:
                raise ConfigError(self.failure)
            self.streams[req.rid] = stream
        self.submit(req)
        return stream

    def open_streams(self) -> list[Stream]:
        with self._cv:
            return list(self.streams.values())

    def emit(self, grown: list[Request], finished: list[Request]) -> None:
        wake, n = [], 0
        with self._cv:
            streams = self.streams
            for req in grown:
                stream = streams.get(req.rid)
                if stream is None:
                    continue
                k = len(req.output)
                n, stream.ready = n + k - stream.ready, k
                if not stream.flagged:
                    stream.flagged = True
                    wake.append(stream)
            ends = [(req, streams.pop(req.rid, None)) for req in finished]
        if n:
            self.metrics.generated(n)
        for req, stream in ends:
            if stream is None:
                continue
            if req.rejection:
                self.metrics.rejected.inc()
            elif stream.gone:
                self.metrics.cancelled.inc()
            else:
                self.metrics.finished.inc()
            stream.error, stream.done = req.rejection, True
            if not stream.flagged:
                stream.flagged = True
                wake.append(stream)
        self._hand_off(wake)

    def fail(self, why: str) -> None:
        """The loop stopped: every open request gets `why`, and no request is taken after it."""
        with self._cv:
            self.failure = why
            streams, self.streams = list(self.streams.values()), {}
        for s in streams:
            s.error, s.done, s.flagged = why, True, True
        self._hand_off(streams)

    def _hand_off(self, streams: list[Stream]) -> None:
        """Wake the streams' handlers: one callback on each of their loops, and none while the last one is still
        queued there (the streams join its batch). So a turn costs one cross-thread wake-up however many streams
        it feeds, and a loop that falls behind gets fewer, larger batches rather than a queue of them."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Stream]] = {}
        for stream in streams:
            by_loop.setdefault(stream.loop, []).append(stream)
        for loop, batch in by_loop.items():
            with self._batch_lock:
                queued = self._batches.get(loop)
                if queued is not None:
                    queued.extend(batch)
                    continue
                self._batches[loop] = batch
            try:
                loop.call_soon_threadsafe(self._wake, loop)
            except RuntimeError:   # that loop has closed: nobody is waiting
                with self._batch_lock:
                    self._batches.pop(loop, None)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._batch_lock:
            batch = self._batches.pop(loop, ())
        for stream in batch:
            stream.wake()


class EngineLoop:
    """The serving loop on a thread of its own, over one engine's serving setup, for as long as the server runs."""

    def __init__(self, engine, setup: ServingSetup, sampling: SamplingParams, sample_on_device: bool = True):
        if setup.prefix == "pinned":
            raise ConfigError("kv_cache.prefix=pinned pins the first queued request's prompt, and a server starts with "
                              "none: use kv_cache.prefix=auto, which caches every shared prefix as it comes")
        if setup.pool_vs_peak > 0:
            raise ConfigError("kv_cache.pool_vs_peak sizes the pool from a known queue, and a server's is not known: "
                              "give kv_cache.num_blocks, or 0 for every slot's whole context")
        self.engine, self.sampling = engine, sampling
        self.runner, _ = setup.build([], sampling, sample_on_device, engine.stop_ids())
        self.ctx = self.runner.sched.ctx
        self.metrics = Metrics()
        self.arrivals = StreamingArrivals(self.metrics)
        self.metrics.watch(self)
        self._rids = itertools.count()
        self.thread = threading.Thread(target=self._serve, name="onepass-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.arrivals.failure

    def _serve(self) -> None:
        try:
            # the collector stays on: the HTTP side makes cycles, and the loop runs for hours beside it
            self.runner.run([], arrivals=self.arrivals, pause_gc=False)
        except BaseException as e:   # every waiting client hears why rather than hanging
            self.arrivals.fail(f"the engine stopped: {type(e).__name__}: {e}")
            raise

    def open(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> Stream:
        """Submit a request, from a handler on its running event loop."""
        req = Request(next(self._rids), prompt, max_tokens, ignore_eos=ignore_eos)
        return self.arrivals.open(req, asyncio.get_running_loop())

    def end(self, stream: Stream, gone: bool) -> None:
        """The handler is through with the stream: an unfinished request is cancelled (gone: its client left)."""
        if stream.ended:
            return
        stream.ended = True
        if stream.done:
            return
        stream.gone = gone
        self.arrivals.cancel(stream.req)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still open, let the loop finish and join its thread."""
        for s in self.arrivals.open_streams():
            self.end(s, gone=True)
        self.arrivals.close()
        self.thread.join(timeout)
