"""How much of an engine loop's token rate reaches HTTP clients (issue 62), measured on any host with a stand-in engine.

    python -m onepass.harness.server_bench --streams 128 --requests 300 --rate 256 --device-ms 4 --host-ms 1

`FakeRunner` stands in for engine/runner.py's serving loop: each turn it does `host_ms` of Python work holding the
interpreter lock (scheduling, launching the next step), waits `device_ms` with the lock free (as the host waits for a
step's ids), and gives every running request one token, up to `streams` requests at once. The same trace (log-normal
prompts and outputs, as conf/workload/trace_lognormal.yaml, Poisson at `rate`) runs through it twice: in process
(`TraceArrivals`, no server) and behind the real server (harness/server.py: EngineLoop, uvicorn, SSE) driven by the
real HTTP driver in a process of its own (harness/http_driver.py). It prints both output tok/s (latency_job's
definition) and their ratio; the CPU the HTTP thread spent a token and the driver's process; and the engine thread's
turn: its host work's wall time, how late it got the lock back after the device wait, the hand-off to the server
(emit), and how long it waited for a core at all (on a host short of cores that, not the lock, is most of the
lateness).
"""
from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass
from types import SimpleNamespace

from onepass.engine.arrivals import TraceArrivals
from onepass.engine.scheduler import Request

LETTERS = "abcdefghijklmnopqrstuvwxyz "


def byte_tokenizer():
    """A byte-level tokenizer of every byte and one merge (as tests/test_server.py's model has), so streamed text
    is decoded as a real model's."""
    from tokenizers.pre_tokenizers import ByteLevel

    from onepass.engine.tokenizer import Tokenizer

    tokens = sorted(ByteLevel.alphabet()) + ["Ġt"]
    return Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                    "tokenizer.ggml.merges": ["Ġ t"]}, source="server_bench")


def work_units(seconds: float) -> int:
    """Iterations of `spin` that take `seconds` on this host with the lock and a core to itself (the best of a few
    tries: a shared host's other work only ever makes one slower)."""
    n = 20_000
    while True:
        took = min(_timed(spin, n) for _ in range(5))
        if took > 0.02:
            return max(1, int(n * seconds / took))
        n *= 2


def _timed(f, *args) -> float:
    t = time.perf_counter()
    f(*args)
    return time.perf_counter() - t


def spin(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i & 7
    return acc


def schedstat(tid: int | str = "thread-self") -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of a thread of this process (Linux; 0 elsewhere)."""
    path = "/proc/thread-self/schedstat" if tid == "thread-self" else f"/proc/self/task/{tid}/schedstat"
    try:
        with open(path) as f:
            on, waiting = f.read().split()[:2]
        return int(on) / 1e9, int(waiting) / 1e9
    except OSError:
        return 0.0, 0.0


def run_delay() -> float:
    return schedstat()[1]


@dataclass
class TurnStats:
    turns: int = 0
    host_s: float = 0.0          # the host work's wall time (its fixed work, plus waits for the lock)
    late_s: float = 0.0          # the device wait's overshoot: getting the lock back after it
    emit_s: float = 0.0          # arrivals.emit: the hand-off to the server
    busy_s: float = 0.0          # the turns' wall time (not the idle waits for a request)
    queued_s: float = 0.0        # runnable but waiting for a core (Linux schedstat): a busy host, not the lock

    def line(self) -> str:
        n = max(self.turns, 1)
        return (f"{self.turns} turns, {self.busy_s / n * 1e3:.2f} ms a turn: host work {self.host_s / n * 1e3:.2f} ms, "
                f"lock back late {self.late_s / n * 1e3:.2f} ms, emit {self.emit_s / n * 1e3:.3f} ms; waiting for "
                f"a core {self.queued_s / n * 1e3:.2f} ms")


class FakeRunner:
    """engine/runner.py's `run` with arrivals, for a stand-in engine: every running request gets a token a turn."""

    def __init__(self, streams: int, device_s: float, units: int, vocab: list[int], ctx: int):
        self.streams, self.device_s, self.units, self.vocab = streams, device_s, units, vocab
        self.sched = SimpleNamespace(ctx=ctx, waiting=[], running={}, bm=None, finished=[])
        self.stats = TurnStats()

    def run(self, requests, progress: bool = False, arrivals=None, pause_gc: bool = True):
        sched, st = self.sched, self.stats
        waiting, running = sched.waiting, sched.running
        queued = run_delay()
        while waiting or running or not arrivals.exhausted:
            waiting.extend(arrivals.poll(time.perf_counter()))
            gone = [r for r in arrivals.cancelled() if not r.retired]
            for r in gone:
                r.retired = r.cancelled = True
                running.pop(r.rid, None)
                if r in waiting:
                    waiting.remove(r)
            if gone:
                arrivals.emit([], gone)
            while waiting and len(running) < self.streams:
                r = waiting.pop(0)
                running[r.rid] = r
            if not running:
                arrivals.wait()
                continue
            t0 = time.perf_counter()
            spin(self.units)            # the host's part of a turn (schedule, launch the next step): holds the lock
            t1 = time.perf_counter()
            time.sleep(self.device_s)   # waiting for the step's ids: the lock is free
            t2 = time.perf_counter()
            grown, done = list(running.values()), []
            for r in grown:
                r.output.append(self.vocab[(r.rid + len(r.output)) % len(self.vocab)])
                r.token_s.append(t2)
                if len(r.output) >= r.max_new_tokens:
                    r.retired, r.finished_step = True, st.turns
                    done.append(running.pop(r.rid))
            sched.finished += done
            arrivals.emit(grown, done)
            t3 = time.perf_counter()
            st.turns += 1
            st.host_s += t1 - t0
            st.late_s += t2 - t1 - self.device_s
            st.emit_s += t3 - t2
            st.busy_s += t3 - t0
        st.queued_s = run_delay() - queued


class FakeSetup:
    """What EngineLoop asks of a ServingSetup, building a FakeRunner."""

    prefix, pool_vs_peak = "none", 0

    def __init__(self, make_runner):
        self.make_runner = make_runner

    def build(self, requests, sampling, sample_on_device, stop_ids):
        return self.make_runner(), None


def fake_engine(tokenizer, vocab_size: int):
    return SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(vocab_size=vocab_size), stop_ids=lambda: ())


def trace_of(n: int, rate: float, seed: int = 0):
    from omegaconf import OmegaConf

    from onepass.harness.schema import LengthCfg, WorkloadCfg
    from onepass.harness.traces import make_trace

    w = OmegaConf.structured(WorkloadCfg(name="server_bench", prompt="", num_requests=n, seed=seed, rate=rate))
    w.prompt_len = OmegaConf.structured(LengthCfg(dist="lognormal", median=256, sigma=0.5, low=16, high=1024))
    w.output_len = OmegaConf.structured(LengthCfg(dist="lognormal", median=128, sigma=0.5, low=8, high=512))
    return make_trace(w, 256)


def inprocess(trace, make_runner):
    """The trace through the stand-in loop alone; (timings, turn stats)."""
    from onepass.harness.http_driver import Timing

    runner = make_runner()
    reqs = [Request(i, list(r.prompt), r.output_len) for i, r in enumerate(trace.requests)]
    runner.run([], arrivals=TraceArrivals([(r.offset_s, q) for r, q in zip(trace.requests, reqs)]))
    return [Timing(q.rid, len(q.prompt), q.max_new_tokens, q.arrival_s, list(q.token_s), q.token_s[-1],
                   len(q.output)) for q in reqs], runner.stats


def over_http(trace, make_runner, tokenizer, vocab_size: int):
    """The trace through the real server over the stand-in loop, from the HTTP driver's process."""
    from onepass.engine.sampler import SamplingParams
    from onepass.harness.http_driver import replay_http
    from onepass.harness.server import OpenAIServer

    server = OpenAIServer(fake_engine(tokenizer, vocab_size), FakeSetup(make_runner), SamplingParams(), "bench",
                          max_tokens=16, drain_s=5.0)
    url = server.start()
    t, mine, child = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    http = schedstat(server.thread.native_id)
    try:
        timings = replay_http(url, trace, "bench", token_ids=True)
        http = [b - a for a, b in zip(http, schedstat(server.thread.native_id))]
    finally:
        server.stop()
    took = time.perf_counter() - t
    tokens = sum(t.output_tokens for t in timings)
    print(f"[cpu] over {took:.1f} s: this process {_cpu(resource.RUSAGE_SELF) - mine:.1f} s, of which the HTTP "
          f"thread {http[0]:.2f} s ({http[0] / max(tokens, 1) * 1e6:.1f} us a token); the driver's process "
          f"{_cpu(resource.RUSAGE_CHILDREN) - child:.1f} s")
    return timings, server.runner.stats


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from onepass.harness.latency_job import latency_metrics
    from onepass.harness.schema import SloCfg

    p = argparse.ArgumentParser(prog="python -m onepass.harness.server_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=128, help="requests decoded at once (the batch)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=256.0, help="offered requests/s (Poisson)")
    p.add_argument("--device-ms", type=float, default=4.0, help="a turn's wait for the device, the lock free")
    p.add_argument("--host-ms", type=float, default=1.0, help="a turn's Python work, holding the lock")
    p.add_argument("--text", action="store_true", help="a byte-level tokenizer: tokens decoded to text (default: "
                   "none, as a synthetic model's server streams)")
    p.add_argument("--only", choices=("inprocess", "http"), default=None)
    a = p.parse_args(argv)
    tok = byte_tokenizer() if a.text else None
    vocab = [tok.encode(c)[0] for c in LETTERS] if tok else list(range(32, 128))
    units = work_units(a.host_ms / 1e3)
    make = lambda: FakeRunner(a.streams, a.device_ms / 1e3, units, vocab, 4096)  # noqa: E731
    trace = trace_of(a.requests, a.rate)
    slo = OmegaConf.structured(SloCfg())
    rates = {}
    for target in ("inprocess", "http"):
        if a.only not in (None, target):
            continue
        timings, st = inprocess(trace, make) if target == "inprocess" else over_http(trace, make, tok, 257)
        m = latency_metrics(timings, slo)
        rates[target] = m.get("output_tok_s", 0.0)
        print(f"[{target}] {int(m['completed'])}/{len(timings)} completed, {m.get('request_throughput', 0):.1f} req/s, "
              f"{rates[target]:,.0f} output tok/s, TPOT p50 {m.get('tpot_ms_p50', float('nan')):.2f} ms; engine "
              f"thread: {st.line()}", flush=True)
    if len(rates) == 2:
        print(f"[ratio] http / inprocess output tok/s: {rates['http'] / rates['inprocess']:.3f}")


if __name__ == "__main__":
    main()
