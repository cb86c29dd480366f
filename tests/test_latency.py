"""The open-loop serving benchmark (harness/latency_job.py, http_driver.py, latency_report.py): its metrics are vllm
bench serve's, the HTTP driver measures a stand-in server of known timing, the in-process driver serves a trace with
the single stream's outputs, and a rate sweep records through `onepass -m` and regenerates its report from runs.csv."""
import csv
import io
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from onepass.harness import report
from onepass.harness.http_driver import Timing
from onepass.harness.latency_job import latency_metrics, replay_inprocess, requests_csv, verify
from onepass.harness.schema import LengthCfg, SloCfg, WorkloadCfg
from onepass.harness.traces import Trace, TraceRequest, make_trace

ROOT = Path(__file__).resolve().parent.parent
SLO = OmegaConf.structured(SloCfg(ttft_ms=200.0, tpot_ms=30.0))


def test_metrics_are_vllm_bench_serves():
    """TTFT = first token - arrival; TPOT = (E2E - TTFT) / (tokens - 1) for requests of more than one token; ITL = every
    gap between a request's tokens (two tokens read together: a real 0); throughput and goodput over the first arrival
    to the last token; a request that failed counts in none of them. The values below are worked out by hand."""
    timings = [Timing(0, 5, 4, 0.00, [0.100, 0.110, 0.130, 0.130], 0.130, 4),
               Timing(1, 5, 2, 0.05, [0.300, 0.350], 0.350, 2),
               Timing(2, 5, 1, 0.10, [0.400], 0.400, 1),
               Timing(3, 5, 4, 0.12, [], 0.0, 0, error="HTTP 500: overloaded")]
    m = latency_metrics(timings, SLO)
    ttft, tpot, itl, e2e = [100, 250, 300], [10, 50], [10, 20, 0, 50], [130, 300, 300]
    for name, values, qs in (("ttft", ttft, (50, 90, 99)), ("tpot", tpot, (50, 90, 99)), ("itl", itl, (50, 99)),
                             ("e2e", e2e, (50, 99))):
        for q in qs:
            assert m[f"{name}_ms_p{q}"] == pytest.approx(np.percentile(values, q)), (name, q)
    assert m["completed"] == 3 and m["num_requests"] == 4 and m["duration_s"] == pytest.approx(0.4)
    assert m["request_throughput"] == pytest.approx(3 / 0.4) and m["output_tok_s"] == pytest.approx(7 / 0.4)
    # only request 0 meets TTFT <= 200 ms and TPOT <= 30 ms (request 2 has no TPOT, and misses on TTFT)
    assert m["goodput_req_s"] == pytest.approx(1 / 0.4) and m["itl_zero_frac"] == pytest.approx(0.25)
    rows = list(csv.DictReader(io.StringIO(requests_csv(timings))))
    assert [float(r["ttft_ms"]) for r in rows[:3]] == pytest.approx(ttft) and rows[3]["completed"] == "0"
    assert rows[0]["token_ms"].split() == ["100.000", "110.000", "130.000", "130.000"]
    assert rows[3]["error"] == "HTTP 500: overloaded" and rows[1]["arrival_ms"] == "50.000"


# ---- the HTTP driver against a stand-in server of known timing ----

def standin_app(received: dict):
    """An OpenAI-style completions stream whose timing the prompt sets: its first token `prompt[0]` ms after the
    request came in and each next one `prompt[1]` ms after that, on a fixed schedule (sleeps do not add up); prompt[2]
    tokens fewer than asked; prompt[3] > 1 sends that many tokens a chunk, as token ids without text. When each request
    came in goes into `received`, by prompt[4]."""
    import asyncio
    import json

    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()   # the host's monotonic clock, as the client process's
        body = await request.json()
        first, gap, short, per, rid = body["prompt"][:5]
        received[rid] = t0
        n = body["max_tokens"] - short

        async def events():
            sent = 0
            while sent < n:
                k = min(max(per, 1), n - sent)
                due = t0 + (first + (sent + k - 1) * gap) / 1e3
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                choice = ({"text": "", "token_ids": list(range(sent, sent + k))} if per > 1 else {"text": "x"})
                yield f"data: {json.dumps({'choices': [{'index': 0, **choice, 'finish_reason': None}]})}\n\n"
                sent += k
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def standin():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    received = {}
    server = uvicorn.Server(uvicorn.Config(standin_app(received), log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", received
    server.should_exit = True
    th.join(10)


def test_http_driver_measures_a_server_of_known_timing(standin):
    """16 requests, several in flight at once, each with its own first-token delay (40-120 ms) and token gap (10-30
    ms), from a client process of its own: the driver's percentiles equal the ones those delays imply, counted from
    each request's arrival, and its arrival is when the trace made it due. A request's trip to the server is part of
    its TTFT; the stand-in says when each came in, so what is implied is that trip + its delays. Tolerances (delivery
    and sleeps waking late on a shared 2-core machine): TTFT and E2E from 1 ms below to 20 ms above; TPOT and the ITL
    median within 4 ms (the stand-in's schedule is fixed from its start, so only the first and last token's lateness
    enters a TPOT, spread over 3 or more gaps); request throughput within 10%."""
    from onepass.harness.http_driver import replay_http

    url, received = standin
    rng = random.Random(3)
    reqs = [TraceRequest(0.03 * (i // 2), [rng.randint(40, 120), rng.randint(10, 30), 0, 1, i], rng.randint(4, 8))
            for i in range(16)]
    timings = replay_http(url, Trace(reqs, "standin"), "standin")
    m = latency_metrics(timings, SLO)
    assert m["completed"] == 16 and all(t.output_tokens == r.output_len for t, r in zip(timings, reqs))
    t0 = timings[0].arrival_s
    assert [t.arrival_s - t0 for t in timings] == pytest.approx([r.offset_s for r in reqs], abs=1e-9)
    trip = np.array([(received[i] - t.arrival_s) * 1e3 for i, t in enumerate(timings)])
    assert (trip > 0).all()
    first = np.array([r.prompt[0] for r in reqs]) + trip
    gap = np.array([r.prompt[1] for r in reqs], dtype=float)
    n = np.array([r.output_len for r in reqs])
    e2e = first + (n - 1) * gap
    for q in (50, 90, 99):
        assert np.percentile(first, q) - 1 <= m[f"ttft_ms_p{q}"] <= np.percentile(first, q) + 20, q
        assert m[f"tpot_ms_p{q}"] == pytest.approx(np.percentile(gap, q), abs=4), q
    for q in (50, 99):
        assert np.percentile(e2e, q) - 1 <= m[f"e2e_ms_p{q}"] <= np.percentile(e2e, q) + 20, q
    assert m["itl_ms_p50"] == pytest.approx(np.percentile(np.repeat(gap, n - 1), 50), abs=4)
    span = max(r.offset_s + e / 1e3 for r, e in zip(reqs, e2e))
    assert m["request_throughput"] == pytest.approx(16 / span, rel=0.1)
    for t, r in zip(timings, reqs):   # each token on its own chunk, in order, after the request's arrival
        assert len(t.token_s) == r.output_len and t.token_s == sorted(t.token_s) and t.token_s[0] > t.arrival_s


def test_http_driver_counts_chunks_of_several_tokens_and_checks_the_counts(standin):
    """A chunk of two token ids is two tokens with one time stamp (an ITL of 0, reported as it is); a server that
    returns fewer tokens than asked fails the verdict, naming the request."""
    from onepass.harness.http_driver import replay_http

    reqs = [TraceRequest(0.0, [10, 5, 0, 2, 100], 6), TraceRequest(0.0, [10, 5, 1, 1, 101], 4)]
    pairs, short = replay_http(standin[0], Trace(reqs, "standin"), "standin")
    assert len(pairs.token_s) == 6 and pairs.output == list(range(6))
    assert list(np.diff(pairs.token_s)[::2]) == [0.0, 0.0, 0.0]
    assert short.output_tokens == 3 and short.completed
    ok, line, reason, _ = verify([pairs, short], {}, counts=True, judge=True)
    assert not ok and "request 1: 3 of 4" in reason and line.endswith(f"false ({reason})")
    assert verify([pairs], {}, counts=True, judge=True)[0]


def test_http_driver_reports_a_server_that_fails(standin):
    """A request the server refuses (here: no such endpoint) is a failed request with the server's answer, never a
    measured one."""
    from onepass.harness.http_driver import replay_http

    (t,) = replay_http(standin[0] + "/nowhere", Trace([TraceRequest(0.0, [10, 5, 0, 1, 102], 3)], "x"), "standin")
    assert not t.completed and t.error.startswith("HTTP 404")
    ok, line, _, _ = verify([t], {}, counts=True, judge=True)
    assert not ok and "0/1 requests completed" in line


# ---- the in-process driver on a tiny model ----

def workload(**kw):
    w = OmegaConf.structured(WorkloadCfg(name="t", prompt="", **kw))
    w.prompt_len = OmegaConf.structured(LengthCfg(dist="uniform", low=3, high=12))
    w.output_len = OmegaConf.structured(LengthCfg(dist="uniform", low=2, high=8))
    return w


@pytest.fixture(scope="module")
def tiny_engine(tiny_ggufs):
    import torch

    from onepass.engine.engine import Engine

    # a tiny model's steps on one torch thread: two threads fighting over a shared CPU take ten times as long
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_gguf(tiny_ggufs["llama"], device="cpu", batch=2, ctx=64)
    torch.set_num_threads(threads)


def test_inprocess_driver_serves_the_trace_with_the_single_streams_outputs(tiny_engine):
    """A Poisson trace and the same requests all at once through the serving loop (2 slots, paged KV, prefix cache,
    chunked prefill): every request completes with its single-stream greedy output; every token comes after its
    request's arrival, in order; all at once, a request beyond the first two gets its first token only after as
    many requests before it have finished as it waited for slots."""
    from onepass.engine.sampler import SamplingParams
    from onepass.engine.serving_setup import ServingSetup
    from onepass.harness.latency_job import references

    setup = ServingSetup(tiny_engine, mode="continuous", prefill="chunked", layout="paged", block_size=4,
                         prefix="auto", token_budget=32)
    greedy = SamplingParams()
    refs = None
    for rate in (100.0, math.inf):
        trace = make_trace(workload(num_requests=10, rate=rate, shared_prefix=0.25, seed=2), 256, None, 64)
        timings, res, _ = replay_inprocess(setup, trace, greedy, True, ())
        if refs is None:   # every request's reference (the rates replay the same requests)
            refs = dict(references(tiny_engine, trace, greedy, ()))
            refs.update({i: (tiny_engine.run_static([r.prompt], r.output_len, greedy, (), "token").outputs[0],
                             True) for i, r in enumerate(trace.requests) if i not in refs})
        ok, line, reason, _ = verify(timings, refs, counts=True, judge=True)
        assert ok, line
        assert all(t.output == refs[t.rid][0] for t in timings)
        t0 = min(t.arrival_s for t in timings)
        for t, r in zip(timings, trace.requests):
            assert t.arrival_s == pytest.approx(t0 + r.offset_s)
            assert t.arrival_s < t.token_s[0] and t.token_s == sorted(t.token_s) and t.end_s == t.token_s[-1]
        m = latency_metrics(timings, SLO)
        assert m["completed"] == 10 and m["ttft_ms_p50"] > 0 and m["e2e_ms_p99"] >= m["ttft_ms_p99"]
    # all at once: FIFO through 2 slots
    ends = []
    for j, t in enumerate(timings):
        if j >= 2:
            assert t.token_s[0] >= sorted(ends)[j - 2], j
        ends.append(t.end_s)


def test_hf_peer_replays_the_trace_with_its_own_token_times(tiny_ggufs):
    """HF transformers' continuous batching on the same trace (requests added at their times from a thread): every
    request completes with the tokens asked for, each token time-stamped by transformers after the request's arrival,
    and the greedy outputs equal ours (the peer is built from the same weights)."""
    import torch

    from onepass.engine.engine import Engine
    from onepass.engine.sampler import SamplingParams
    from onepass.harness.latency_job import replay_hf
    from onepass.harness.peers import hf_model

    engine = Engine.from_gguf(tiny_ggufs["qwen3"], device="cpu", batch=2, ctx=64)
    trace = make_trace(workload(num_requests=6, rate=50.0, seed=4), 256, None, 64)
    hf = hf_model(engine.cfg, engine.weights, torch.device("cpu"), torch.float32)
    timings = replay_hf(hf, trace, slots=2, ctx=64)
    ok, line, _, detail = verify(timings, {}, counts=True, judge=False)
    assert ok, line
    for t, r in zip(timings, trace.requests):
        assert len(t.token_s) == r.output_len and t.arrival_s < t.token_s[0] and t.token_s == sorted(t.token_s)
        assert t.output == engine.run_static([r.prompt], r.output_len, SamplingParams(), (), "token").outputs[0]


# ---- the report ----

def runs(rows):
    keys = ("target", "rate", "ttft99", "tpot99", "ok")
    out = []
    for i, r in enumerate(rows):
        r = dict(zip(keys, r))
        out.append({"run_id": f"r{i}", "start_time": f"2026-12-06 10:00:{i:02d}", "tags.device": "NVIDIA H200",
                    "params.model.name": "llama-3.2-1b", "params.batch.size": "128", "params.workload.name": "t",
                    "params.workload.target": r["target"], "params.workload.rate": r["rate"],
                    "params.slo.ttft_ms": "500.0", "params.slo.tpot_ms": "50.0",
                    "metrics.ttft_ms_p99": r["ttft99"], "metrics.tpot_ms_p99": r["tpot99"],
                    "metrics.request_throughput": 1.0, "metrics.output_tok_s": 100.0, "metrics.goodput_req_s": 1.0,
                    "metrics.verify_ok": r["ok"]})
    return pd.DataFrame(out)


def test_report_marks_each_targets_saturation_point():
    """The saturation point is the highest offered rate whose verified run met both SLOs (p99 TTFT <= 500 ms and p99
    TPOT <= 50 ms here): 64 for onepass (128 missed on TPOT), 4 for HF (its 8 met them but did not verify); a target
    that met them all at once is not saturated, one that met them nowhere saturates below the lowest rate."""
    df = runs([("inprocess", "16.0", 40, 10, 1), ("inprocess", "64.0", 90, 20, 1), ("inprocess", "128.0", 300, 70, 1),
               ("inprocess", "inf", 9000, 90, 1), ("hf", "4.0", 200, 30, 1), ("hf", "8.0", 300, 40, 0),
               ("hf", "16.0", 4000, 45, 1), ("http://peer:8000", "16.0", 900, 60, 1),
               ("http", "16.0", 50, 20, 1), ("http", "inf", 400, 40, 1)])
    md, fig = report.TABLES["serving_latency"](df)
    head = md.split(report.ROWS)[0]
    assert ("onepass in-process 64 req/s; onepass over HTTP not reached (all at once met the SLOs); HF continuous "
            "batching 4 req/s; http://peer:8000 below 16 req/s (no rate met the SLOs)") in head, head
    lines = [line for line in head.splitlines() if line.startswith("|")]
    assert len(lines[0].split("|")) - 2 <= report.HEADLINE_MAX_COLUMNS
    assert len(lines) - 2 == len(df)                                 # every (target, rate) once, newest row
    hf8 = next(line for line in lines if "HF" in line and "|               8 |" in line)
    assert "✗" in hf8 and "missed" not in hf8                        # met, but did not verify
    assert "all at once" in md and head.count("missed |") == 4
    assert fig is not None and len(fig.plot_digest) == 12
    appendix = md.split(report.ROWS)[1]
    assert sum(line.startswith("| NVIDIA") or line.startswith("| H200") for line in appendix.splitlines()) == len(df)


# ---- the job's settings ----

@pytest.mark.parametrize("overrides, msg", [
    (["scheduler=static"], r"scheduler.mode=static: job=serving_latency serves a trace through the serving loop"),
    (["workload.target=htp"], r"workload.target='htp'; choose inprocess, http, hf, or the URL"),
    (["slo.tpot_ms=0"], r"slo.ttft_ms=60.0, slo.tpot_ms=0.0"),
    (["workload.rate=-1"], r"workload.rate=-1.0: requests a second, above 0"),
    (["workload.output_len.dist=zipf"], r"workload.output_len.dist='zipf'"),
    (["kv_cache.ctx=16"], r"raise kv_cache.ctx to 35"),
    (["speculative=ngram", "speculative.k=2"], r"measures serving without drafts; set speculative=off"),
    (["peer.enabled=true", "sampling=temp0.7"], r"HF transformers peer decodes greedily here"),
    (["peer.enabled=true", "model=tiny-qwen35"], r"built for llama and qwen3 models.*is qwen35")])
def test_bad_settings_are_refused_before_the_model_loads(tmp_path, monkeypatch, overrides, msg):
    from hydra import compose, initialize_config_dir

    from onepass.harness import latency_job
    from onepass.harness.app import CONF_DIR
    from onepass.harness.job import run_job
    from onepass.kernels.errors import ConfigError

    monkeypatch.setattr(latency_job, "build", lambda cfg: pytest.fail("the model was built before the check"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=serving_latency_cpu", "workload.rate=10",
                                                       f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                                       f"tracking.spool_dir={tmp_path}/spool", *overrides])
    with pytest.raises(ConfigError, match=msg):
        run_job(cfg, tmp_path / "out")


# ---- the sweep through the real entry point ----

FIXED = {"ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "itl_ms_p50",
         "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "request_throughput", "output_tok_s", "goodput_req_s", "verify_ok"}


def test_rate_and_target_sweep_records_and_its_report_regenerates(tmp_path, monkeypatch):
    """`onepass -m experiment=serving_latency_cpu` over two rates and two targets (in process, and onepass's own HTTP
    server started in the job): one parent run with four children, each verified, with the fixed metrics, the trace's
    hash and the per-request table; every child replays the same requests; the parent gets the table; the report and
    its plot regenerate from the recorded runs.csv alone."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "onepass.harness", "-m", "experiment=serving_latency_cpu",
                        "workload.rate=100,inf", "workload.target=inprocess,http", "progress=false",
                        f"tracking.uri={uri}", f"tracking.spool_dir={tmp_path}/spool",
                        f"hydra.sweep.dir={tmp_path}/multirun"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("[verify]") == 4 and r.stdout.count(": true") == 4, r.stdout[-3000:]
    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(search_all_experiments=True)
    parent = df[df["tags.onepass.kind"] == "sweep"]
    children = df[df["tags.mlflow.parentRunId"].notna()]
    assert len(parent) == 1 and len(children) == 4 and set(children["status"]) == {"FINISHED"}
    assert FIXED <= {c.removeprefix("metrics.") for c in children.columns if c.startswith("metrics.")}
    assert set(children["metrics.verify_ok"]) == {1.0}
    assert sorted(children["params.workload.target"]) == ["http", "http", "inprocess", "inprocess"]
    assert children["tags.trace_requests_hash"].nunique() == 1 and children["tags.trace_hash"].nunique() == 2
    client = mlflow.MlflowClient(uri)
    child = children.iloc[0]["run_id"]
    assert "requests.csv" in {a.path for a in client.list_artifacts(child)}
    table = pd.read_csv(client.download_artifacts(child, "requests.csv", str(tmp_path)))
    assert len(table) == 16 and (table["ttft_ms"] >= 0).all() and table["completed"].all()
    assert "report/serving_latency.md" in {a.path for a in client.list_artifacts(parent.iloc[0]["run_id"], "report")}

    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    assert report.main(["serving_latency", "--uri", uri, "--record", "--allow-noisy",
                        "--out", str(tmp_path / "r1")]) == 0
    assert report.main(["serving_latency", "--source", "csv", "--out", str(tmp_path / "r2")]) == 0
    md = (tmp_path / "r2" / "serving_latency.md").read_text()
    assert "onepass over HTTP" in md and "onepass in-process" in md and "Saturation" in md
    assert (tmp_path / "r2" / "serving_latency.png").is_file() and "![serving_latency](serving_latency.png)" in md
