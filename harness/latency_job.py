"""The serving-latency benchmark (job=serving_latency): a request trace (harness/traces.py) replayed open loop against a
target, every request entering at its arrival time whatever the target is doing, and the latency of each measured.

Targets (workload.target):
- `inprocess`: the engine's own serving loop, fed by `TraceArrivals` (engine/arrivals.py): the loop takes the
  requests due at each turn and never waits for them while it has rows to run;
- `http`: onepass's OpenAI-compatible server (harness/server.py) started in this job on the same engine, the trace
  replayed over loopback by the HTTP driver (harness/http_driver.py), a client process of its own;
- a URL: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's) serving the same model, replayed the same way;
- `hf`: HF transformers' continuous batching in this process on the same weights, each request added at its time
  from a thread, its token times from transformers' own per-token time stamps (`record_timestamps`); peer.enabled=true
  adds this run after the in-process one, in the same job (in a sweep over targets, in the in-process target's job).

The metrics use the definitions of `vllm bench serve` (vllm/benchmarks/serve.py, calculate_metrics):
- TTFT (time to first token) = first token - arrival, per request;
- TPOT (time per output token) = (E2E - TTFT) / (output tokens - 1), per request of more than one token;
- ITL (inter-token latency) = the gaps between consecutive tokens of a request, pooled over all requests;
- E2E = last token - arrival;
- request_throughput and output_tok_s: completed requests and their output tokens over the run's duration (the first
  arrival to the last token); goodput_req_s: the requests that meet slo.ttft_ms and slo.tpot_ms over the same
  duration (a one-token request meets the TPOT objective, as vllm counts it).
Percentiles are numpy's (linear interpolation), as vllm's. A request's arrival is when it was due, not when the
driver got to it, so a late driver counts in its TTFT. Token times are host times (time.perf_counter): in process when
the loop reads a step's ids, over HTTP when an SSE chunk arrives. The host reads a step's tokens together, and where
the loop runs steps in lockstep or one ahead (or a chunk holds several tokens) several tokens of a request share one
time stamp: their ITL of 0 is real and reported as it is (`itl_zero_frac` says how often); TPOT, an average over the
request, is not affected.

Every run prints `[verify] ... true|false` and logs verify_ok: every request completed, with exactly the tokens it
asked for (workload.ignore_eos), and the greedy outputs of the trace's first VERIFY_SAMPLE distinct prompts equal to
the single-stream greedy output of the same engine (`run_static`); over HTTP onepass's server is asked for each
chunk's token ids (`return_token_ids`: a chunk holds every token a request had ready when its handler looked, and the
driver counts and compares them), another server's streamed text is held against the reference decoded (a model
without a tokenizer streams no text: not compared, said so). Another engine's outputs (a URL, HF) are not judged by
ours; HF's agreement on the sample is logged as `sample_agreement`.
"""
from __future__ import annotations

import csv
import io
import math
import threading
import time
from typing import Iterator

import numpy as np
from omegaconf import OmegaConf

from onepass.engine.arrivals import TraceArrivals
from onepass.engine.scheduler import Request, check_token_budget
from onepass.engine.step import BUCKETS
from onepass.engine.verify import degenerate_reason
from onepass.harness.build import build, resolve_engine, sampling_params
from onepass.harness.checks import check_kv_cache, check_pool
from onepass.harness.http_driver import Timing, replay_http
from onepass.harness.job import RunRecord
from onepass.harness.logs import log
from onepass.harness.noise import CpuWindow, guard
from onepass.harness.serve_job import setup_of
from onepass.harness.spread import check_measure
from onepass.harness.traces import Trace, check_length, check_trace, make_trace
from onepass.harness.usage import JobUsage
from onepass.kernels.errors import ConfigError

TARGETS = ("inprocess", "http", "hf")
VERIFY_SAMPLE = 8          # distinct prompts of the trace checked against the single stream
HF_STALL_S = 600.0         # HF continuous batching returning nothing for this long has stopped


def _pct(xs, q: float) -> float:
    return float(np.percentile(xs, q))


def latency_metrics(timings: list[Timing], slo) -> dict[str, float]:
    """The run's fixed metrics (vllm bench serve's definitions; the module docstring). A metric with no sample (TPOT
    when every output is one token) is left out."""
    done = [t for t in timings if t.completed]
    out = {"num_requests": float(len(timings)), "completed": float(len(done))}
    if not done:
        return out
    duration = max(max(t.end_s for t in done) - min(t.arrival_s for t in timings), 1e-9)
    ttft = np.array([(t.first_s - t.arrival_s) * 1e3 for t in done])
    e2e = np.array([(t.end_s - t.arrival_s) * 1e3 for t in done])
    many = [i for i, t in enumerate(done) if t.output_tokens > 1]
    tpot = np.array([(e2e[i] - ttft[i]) / (done[i].output_tokens - 1) for i in many])
    itl = np.concatenate([np.diff(t.token_s) * 1e3 for t in done] + [np.zeros(0)])
    tokens = sum(t.output_tokens for t in done)
    tpot_of = dict(zip(many, tpot))
    good = sum(1 for i in range(len(done)) if ttft[i] <= slo.ttft_ms and tpot_of.get(i, 0.0) <= slo.tpot_ms)
    out.update(duration_s=duration, request_throughput=len(done) / duration, output_tok_s=tokens / duration,
               goodput_req_s=good / duration, slo_met_frac=good / len(timings), output_tokens=float(tokens),
               ttft_ms_p50=_pct(ttft, 50), ttft_ms_p90=_pct(ttft, 90), ttft_ms_p99=_pct(ttft, 99),
               ttft_ms_mean=float(ttft.mean()), e2e_ms_p50=_pct(e2e, 50), e2e_ms_p99=_pct(e2e, 99),
               e2e_ms_mean=float(e2e.mean()))
    if len(tpot):
        out.update(tpot_ms_p50=_pct(tpot, 50), tpot_ms_p90=_pct(tpot, 90), tpot_ms_p99=_pct(tpot, 99),
                   tpot_ms_mean=float(tpot.mean()))
    if len(itl):
        out.update(itl_ms_p50=_pct(itl, 50), itl_ms_p99=_pct(itl, 99), itl_ms_mean=float(itl.mean()),
                   itl_zero_frac=float((itl == 0).mean()))
    out["throughput_tok_s"] = out["output_tok_s"]   # the name every job's sweep summary reads
    return out


def requests_csv(timings: list[Timing]) -> str:
    """The per-request table: times in ms from the trace's start (arrival) or from the request's arrival (the rest);
    token_ms holds every token's time, space-separated."""
    t0 = min((t.arrival_s for t in timings), default=0.0)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["rid", "arrival_ms", "prompt_len", "output_len", "output_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
                "completed", "error", "token_ms"])
    for t in timings:
        ok = t.completed
        ttft = (t.first_s - t.arrival_s) * 1e3 if ok else float("nan")
        e2e = (t.end_s - t.arrival_s) * 1e3 if ok else float("nan")
        tpot = (e2e - ttft) / (t.output_tokens - 1) if ok and t.output_tokens > 1 else float("nan")
        w.writerow([t.rid, f"{(t.arrival_s - t0) * 1e3:.3f}", t.prompt_len, t.output_len, t.output_tokens,
                    f"{ttft:.3f}", f"{tpot:.3f}", f"{e2e:.3f}", int(ok), t.error,
                    " ".join(f"{(s - t.arrival_s) * 1e3:.3f}" for s in t.token_s)])
    return buf.getvalue()


def verify(timings: list[Timing], refs: dict[int, tuple[list[int], bool]], counts: bool, judge: bool,
           decode=None) -> tuple[bool, str, str, dict[str, float]]:
    """(ok, the [verify] line, why it failed, detail metrics): every request completed; with `counts`, each made the
    tokens it asked for; the sampled requests' outputs (token ids, else text against `decode(reference)`) equal their
    single-stream greedy references (refs: request -> (reference, its logits were finite)), judged only with `judge`
    (another engine's are counted, not judged)."""
    n = len(timings)
    failed = [t for t in timings if not t.completed]
    reasons = []
    if failed:
        reasons.append(f"{len(failed)} of {n} requests did not complete (first, request {failed[0].rid}: "
                       f"{failed[0].error or 'no end'})")
    if counts:
        off = [t for t in timings if t.completed and t.output_tokens != t.output_len]
        if off:
            reasons.append(f"{len(off)} requests made another number of tokens than asked (first, request "
                           f"{off[0].rid}: {off[0].output_tokens} of {off[0].output_len})")
    compared, same = [], []
    for rid, (ref, _) in refs.items():
        t = timings[rid]
        if not t.completed or (t.output is None and decode is None):
            continue
        compared.append(rid)
        if (t.output == ref) if t.output is not None else (t.text == decode(ref)):
            same.append(rid)
    if judge and compared:
        differ = [rid for rid in compared if rid not in same]
        if differ:
            reasons.append(f"{len(differ)} of {len(compared)} sampled requests differ from the single-stream greedy "
                           f"reference (first, request {differ[0]})")
        if all(degenerate_reason(*refs[rid]) for rid in compared):
            reasons.append("every sampled reference repeats one token or had non-finite logits, so agreement with it "
                           "proves nothing")
    ok = not reasons
    parts = [f"{n - len(failed)}/{n} requests completed" + (", each with the tokens it asked for" if counts else "")]
    if compared:
        parts.append(f"{len(same)}/{len(compared)} sampled prompts equal to the single-stream greedy reference"
                     + ("" if judge else " (another engine: counted, not judged)"))
    elif refs:
        parts.append("outputs not compared (" + ("the server streams text, and the model has no tokenizer to decode "
                                                 "the references with" if judge else "another engine's") + ")")
    line = ", ".join(parts) + f": {str(ok).lower()}" + (f" ({'; '.join(reasons)})" if reasons else "")
    detail = {"sample_compared": float(len(compared))}
    if compared:
        detail["sample_agreement"] = len(same) / len(compared)
    return ok, line, "; ".join(reasons), detail


_REFS: dict = {}   # the last references made, with their engine: a sweep's jobs replay the same requests


def references(engine, trace, sampling, stop_ids: tuple[int, ...]) -> dict[int, tuple[list[int], bool]]:
    """The single-stream greedy output of the trace's first VERIFY_SAMPLE distinct prompts, by request (prompts fed a
    token a step, as serve_job's reference; kept for the next job of a sweep on the same engine)."""
    key = (trace.requests_digest, sampling, tuple(stop_ids))
    if _REFS.get("engine") is engine and _REFS.get("key") == key:
        return _REFS["refs"]
    out = {}
    for i in trace.distinct(VERIFY_SAMPLE):
        r = trace.requests[i]
        single = engine.run_static([r.prompt], r.output_len, sampling, stop_ids, "token", max_len=None)
        out[i] = (single.outputs[0], single.logits_finite)
    _REFS.clear()
    _REFS.update(engine=engine, key=key, refs=out)
    return out


def warm_trace(trace, n: int):
    """The trace's first n requests, all at once: a warm-up (first calls' one-off costs kept out of the timed run)."""

    reqs = [type(r)(0.0, r.prompt, r.output_len) for r in trace.requests[:n]]
    return Trace(reqs, "warm-up")


def replay_inprocess(setup, trace, sampling, sample_on_device: bool, stop_ids: tuple[int, ...],
                     progress: bool = False):
    """The trace through the engine's serving loop on a fresh setup, each request handed over when due
    (TraceArrivals). Returns (timings, the loop's ServeResult, the runner)."""

    reqs = [Request(i, list(r.prompt), r.output_len) for i, r in enumerate(trace.requests)]
    # the setup sizes its pool (pool_vs_peak) and attention grid from the requests it will see; the loop starts empty
    runner, _ = setup.build(reqs, sampling, sample_on_device, stop_ids)
    res = runner.run([], progress=progress,
                     arrivals=TraceArrivals([(r.offset_s, q) for r, q in zip(trace.requests, reqs)]))
    finished = {id(r) for r in res.finished}
    timings = []
    for q in reqs:
        error = q.rejection or ("cancelled" if q.cancelled else "" if id(q) in finished else "never finished")
        timings.append(Timing(q.rid, len(q.prompt), q.max_new_tokens, q.arrival_s, list(q.token_s),
                              q.token_s[-1] if q.token_s else 0.0, len(q.output), error, list(q.output)))
    return timings, res, runner


def replay_hf(model, trace, slots: int, ctx: int, warm: int = 0) -> list[Timing]:
    """The trace through HF transformers' continuous batching (greedy, no stop token), each request added at its
    arrival time from a thread; token times from transformers' per-token time stamps (record_timestamps). Like ours,
    it runs at most `slots` requests at once in a cache that lets each of them reach `ctx` positions."""
    import inspect

    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig") or "record_timestamps" not in inspect.signature(
            transformers.ContinuousBatchingManager.add_request).parameters:
        raise ConfigError(f"the HF peer's token times come from transformers' own per-token time stamps, which "
                          f"transformers {transformers.__version__} does not record: pip install -U transformers "
                          "(5.x), or set peer.enabled=false")
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in trace.requests),
                                        eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig()
    page = getattr(cb, "page_size", None) or cb.block_size    # transformers < 5.25 names it block_size only
    cb.max_requests_per_batch, cb.num_blocks = slots, slots * math.ceil(ctx / page)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        # its cache is made on the generation thread when it starts: not inside the trace's time
        while getattr(manager, "batch_processor", None) is None and manager.is_running():
            time.sleep(0.01)
        if warm:
            _hf_collect(manager, warm_trace(trace, warm), "w", time.perf_counter())
        return _hf_collect(manager, trace, "t", time.perf_counter() + 0.2)
    finally:
        manager.stop(block=True)


def _hf_collect(manager, trace, tag: str, t0: float) -> list[Timing]:
    timings = [Timing(i, len(r.prompt), r.output_len, t0 + r.offset_s) for i, r in enumerate(trace.requests)]
    order = sorted(range(len(timings)), key=lambda i: (timings[i].arrival_s, i))

    def feed():
        for i in order:
            time.sleep(max(0.0, timings[i].arrival_s - time.perf_counter()))
            r = trace.requests[i]
            manager.add_request(r.prompt, request_id=f"{tag}{i}", max_new_tokens=r.output_len,
                                record_timestamps=True)

    feeder = threading.Thread(target=feed, daemon=True, name="onepass-hf-arrivals")
    feeder.start()
    pending = set(range(len(timings)))
    while pending:
        out = manager.get_result(timeout=HF_STALL_S)
        if out is None:
            raise RuntimeError(f"HF continuous batching returned {len(timings) - len(pending)} of {len(timings)} "
                               f"requests, then nothing for {HF_STALL_S:.0f} s")
        if not out.request_id.startswith(tag) or not out.is_finished():
            continue
        i = int(out.request_id[len(tag):])
        t = timings[i]
        t.output = list(out.generated_tokens)
        t.output_tokens = len(t.output)
        t.token_s = list(out.timestamps or [])
        t.end_s = t.token_s[-1] if t.token_s else 0.0
        t.error = out.error or ("" if t.token_s else "transformers returned no token time stamps")
        pending.discard(i)
    feeder.join()
    return timings


def target_label(target: str) -> str:
    return {"inprocess": "onepass in-process", "http": "onepass over HTTP", "hf": "HF transformers continuous "
            "batching"}.get(target, target)


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


class LatencyJob:
    """A trace replayed open loop against workload.target at workload.rate: one run (and the HF peer's after it with
    peer.enabled=true), with the latency metrics, the per-request table and the verdict."""

    sections = ("model", "batch", "kv_cache", "scheduler", "sampling", "workload", "engine", "verify", "peer",
                "measure", "slo", "job", "table")

    def __init__(self, name: str = "serving_latency"):
        self.name = name

    def check(self, cfg) -> None:
        """What the config alone can refuse, before any model loads (harness/preflight.py)."""

        w, sc, B, kvc = cfg.workload, cfg.scheduler, cfg.batch.size, cfg.kv_cache
        backend = resolve_engine(cfg.engine)[2]
        if B < 1:
            raise ConfigError(f"batch.size={B}; need at least one slot")
        if sc.mode not in ("continuous", "wave"):
            raise ConfigError(f"scheduler.mode={sc.mode}: job=serving_latency serves a trace through the serving "
                              "loop; use scheduler=continuous or continuous_chunked (or wave)")
        check_token_budget(sc.prefill, sc.token_budget, B)
        if sc.prefill == "chunked" and sc.token_budget > BUCKETS[-1]:
            raise ConfigError(f"scheduler.token_budget={sc.token_budget}: a step runs at most {BUCKETS[-1]} rows "
                              f"(the largest CUDA-graph bucket); set it to {BUCKETS[-1]} or less")
        check_kv_cache(kvc, backend)
        if kvc.layout == "paged" and kvc.pool_vs_peak > 0 and not w.ignore_eos:
            raise ConfigError("kv_cache.pool_vs_peak sizes the pool from a dry run with fixed output lengths; "
                              "set workload.ignore_eos=true or give kv_cache.num_blocks")
        check_trace(w, kvc.ctx)
        check_pool(check_length("workload.prompt_len", w.prompt_len)[1]
                   + check_length("workload.output_len", w.output_len)[1] - 1, kvc, B)
        if cfg.speculative.method != "off":
            raise ConfigError("job=serving_latency measures serving without drafts; set speculative=off")
        sampling = sampling_params(cfg)
        check_measure(cfg.measure)
        if not (cfg.slo.ttft_ms > 0 and cfg.slo.tpot_ms > 0):
            raise ConfigError(f"slo.ttft_ms={cfg.slo.ttft_ms}, slo.tpot_ms={cfg.slo.tpot_ms}: the objectives a "
                              "request meets, in ms above 0")
        if w.target not in TARGETS and not is_url(w.target):
            raise ConfigError(f"workload.target={w.target!r}; choose {', '.join(TARGETS)}, or the URL of an "
                              "OpenAI-compatible server (http://host:port)")
        if w.target == "hf" or (cfg.peer.enabled and w.target == "inprocess"):
            if cfg.engine.weights != "dequant":
                raise ConfigError("the HF transformers peer is built from dense weights: set engine.weights=dequant "
                                  "(or peer.enabled=false)")
            if not sampling.greedy:
                raise ConfigError("the HF transformers peer decodes greedily here: use sampling=greedy (or "
                                  "peer.enabled=false)")
            synth = cfg.model.synthetic
            if synth is not None and not cfg.model.path and not cfg.model.package and synth.arch == "qwen35":
                raise ConfigError(f"the HF transformers peer is built for llama and qwen3 models (harness/peers.py), "
                                  f"and model={cfg.model.name} is qwen35: set peer.enabled=false")

    def run(self, cfg) -> Iterator[RunRecord]:
        self.check(cfg)
        w = cfg.workload
        with JobUsage(resolve_engine(cfg.engine)[0]) as usage:
            built = build(cfg)
            trace = make_trace(w, built.cfg.vocab_size, built.tokenizer, cfg.kv_cache.ctx)
            sampling = sampling_params(cfg)
            stop_ids = () if w.ignore_eos else built.stop_ids()
            prompts = [len(r.prompt) for r in trace.requests]
            outputs = [r.output_len for r in trace.requests]
            arrive = ("every request at once" if trace.span_s == 0
                      else f"{w.arrival} arrivals over {trace.span_s:.1f} s" if w.arrival == "file"
                      else f"{w.arrival} arrivals at {w.rate:g} req/s over {trace.span_s:.1f} s")
            log.info(f"[workload] {w.name}: {len(trace.requests)} requests, {arrive}; prompts "
                     f"{min(prompts)}-{max(prompts)} tokens (median "
                     f"{int(np.median(prompts))}), outputs {min(outputs)}-{max(outputs)} (median "
                     f"{int(np.median(outputs))}); trace {trace.digest}")
            # the single-stream reference of the sample (greedy only: a sampled request's seed is its own)
            refs = references(built, trace, sampling, stop_ids) if sampling.greedy and not is_url(w.target) else {}
            if w.target != "hf":
                yield self._measure(cfg, built, trace, refs, sampling, stop_ids, usage, w.target)
            # peer.enabled: the HF peer beside the in-process run (a sweep over targets runs it once, in that job)
            if w.target == "hf" or (cfg.peer.enabled and w.target == "inprocess"):
                yield self._measure(cfg, built, trace, refs, sampling, stop_ids, usage, "hf")

    def _measure(self, cfg, built, trace, refs, sampling, stop_ids, usage, target: str):
        """One target's run of the trace (after measure.warmup untimed replays of its first requests), verified and
        made a record."""
        w, B = cfg.workload, cfg.batch.size
        warm = min(len(trace.requests), B)
        extra: dict[str, float] = {}
        decode = None
        with CpuWindow() as window:
            if target == "inprocess":
                setup = setup_of(cfg, built)
                for _ in range(cfg.measure.warmup):
                    replay_inprocess(setup, warm_trace(trace, warm), sampling, cfg.sampling.on_device, stop_ids)
                timings, res, runner = replay_inprocess(setup, trace, sampling, cfg.sampling.on_device, stop_ids,
                                                        cfg.progress)
                bm = runner.sched.bm
                extra.update(steps=float(res.steps), wall_s=res.wall_s, prefill_tokens=float(res.prefill_rows),
                             preemptions=float(sum(r.preemptions for r in res.finished)),
                             kv_pool_mb=runner.kv.nbytes / 2**20)
                if bm is not None:
                    extra.update(kv_blocks=float(bm.num_blocks), peak_blocks=float(bm.peak_used))
                times = "host time of each step's ids (engine loop)"
            elif target == "hf":
                from onepass.harness.peers import hf_model

                hf = hf_model(built.cfg, built.weights, built.device, built.dtype)
                timings = replay_hf(hf, trace, B, cfg.kv_cache.ctx, warm if cfg.measure.warmup else 0)
                del hf
                if built.device.type == "cuda":   # its weights and cache go before the next job's runs
                    import torch

                    torch.cuda.empty_cache()
                times = "transformers' per-token time stamps (record_timestamps)"
            else:
                times = "SSE chunk arrival at the client"
                if target == "http":
                    timings = self._own_server(cfg, built, trace, sampling, warm)
                    if built.tokenizer is not None:
                        decode = lambda ids: built.tokenizer.decode(ids, skip_special=True)  # noqa: E731
                else:
                    ask = (w.served_model or cfg.model.name, sampling.temperature, w.ignore_eos)
                    for _ in range(cfg.measure.warmup):
                        replay_http(target, warm_trace(trace, warm), *ask)
                    timings = replay_http(target, trace, *ask)
        judge = target in ("inprocess", "http")
        ok, line, reason, detail = verify(timings, refs, w.ignore_eos, judge, decode)
        metrics = {**latency_metrics(timings, cfg.slo), **extra, **detail, "verify_ok": float(ok), **usage.metrics()}
        if trace.span_s > 0:
            metrics["offered_req_s"] = (len(trace.requests) - 1) / trace.span_s   # the drawn trace's own rate
        label = target_label(target)
        log.info(f"[verify] {label}: {line}")
        m = metrics
        offered = ("all at once" if trace.span_s == 0 else f"{w.rate:g} req/s offered" if w.arrival != "file"
                   else f"{metrics['offered_req_s']:.2f} req/s offered (the file's times)")
        perf = f"[perf] {label}, {len(timings)} requests, {offered}: "
        if m.get("completed"):
            perf += (f"{m['request_throughput']:.2f} req/s, {m['output_tok_s']:,.1f} output tok/s, goodput "
                     f"{m['goodput_req_s']:.2f} req/s (TTFT <= {cfg.slo.ttft_ms:g} ms, TPOT <= {cfg.slo.tpot_ms:g} "
                     f"ms); TTFT p50/p99 {m['ttft_ms_p50']:.1f}/{m['ttft_ms_p99']:.1f} ms, TPOT p50/p99 "
                     f"{m.get('tpot_ms_p50', math.nan):.2f}/{m.get('tpot_ms_p99', math.nan):.2f} ms, ITL p50/p99 "
                     f"{m.get('itl_ms_p50', math.nan):.2f}/{m.get('itl_ms_p99', math.nan):.2f} ms, E2E p50/p99 "
                     f"{m['e2e_ms_p50']:.0f}/{m['e2e_ms_p99']:.0f} ms")
        else:
            perf += "no request completed"
        log.info(perf)
        # trace_hash: this trace; trace_requests_hash: its prompts and lengths, the same at every rate of a sweep
        tags = {"trace_hash": trace.digest, "trace_requests_hash": trace.requests_digest, "workload_hash": trace.digest,
                "target": target, "token_times": times,
                "model_file": built.source.name, "backend": built.backend,
                "dtype": str(built.dtype).removeprefix("torch."), "verify": line,
                **({"verify_reason": reason} if reason else {}),
                **guard(metrics, window.result, sorted(usage.gpu_events), cfg.measure, watched=())}
        samples = "\n".join(f"request {t.rid} ({t.output_tokens} tokens): "
                            f"{t.output if t.output is not None else repr(t.text)}" for t in timings[:4]) + "\n"
        artifacts = {"requests.csv": requests_csv(timings), "samples.txt": samples}
        run_cfg = None
        if target != cfg.workload.target:   # the peer's run in the same job: its own target among its params
            run_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
            run_cfg.workload.target = target
        # as harness/record.py run_name writes a swept setting, so a sweep's names do not say it twice
        rate = "arrival=file" if w.arrival == "file" else f"rate={w.rate}"
        return RunRecord(f"target={target} {rate} {cfg.model.name} B={B}", built.device, metrics, tags, artifacts,
                         cfg=run_cfg)

    def _own_server(self, cfg, built, trace, sampling, warm: int) -> list[Timing]:
        """The trace over HTTP against onepass's own server, started here on the job's engine and stopped after."""
        try:
            from onepass.harness.server import start_server
        except ImportError as e:
            raise ConfigError(f"workload.target=http starts onepass's server (harness/server.py), which cannot be "
                              f"imported here ({e}); install the serve extra (pip install -e '.[serve]') or give "
                              "workload.target the URL of a running server") from None
        base, stop = start_server(built, setup_of(cfg, built), sampling, cfg.model.name,
                                  sample_on_device=cfg.sampling.on_device)
        ask = (cfg.model.name, sampling.temperature, cfg.workload.ignore_eos, True)   # with each chunk's token ids
        try:
            for _ in range(cfg.measure.warmup):
                replay_http(base, warm_trace(trace, warm), *ask)
            return replay_http(base, trace, *ask)
        finally:
            stop()
