"""launch.isolate (issue 64): a job measured in a fresh process of its own, its runs recorded by the job's process as
they come; an exception or a signal in the child said with the job named. And the kernel benchmarks' times (int4_gemm,
gdn_step) under the measure group, each with its spread, timed here by stand-ins on the CPU."""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from onepass.harness.isolate import JobProcessError, isolated_runs
from onepass.harness.job import run_job
from onepass.harness.noise import noisy_reasons
from onepass.kernels.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_harness import cfg_of, tiny  # noqa: E402

MEASURE = SimpleNamespace(warmup=1, repeats=4, min_s=0.0, max_repeats=20, max_cv=0.10, max_other_cpu=0.5)


def stand_in(job: str, name: str, tmp_path, *extra):
    return cfg_of(*tiny(tmp_path, f"job._target_=isolate_jobs.{job}", f"job.name={name}", "tracking.enabled=false",
                        "launch.isolate=true", *extra))


def test_the_job_measures_in_a_process_of_its_own_and_its_runs_and_log_come_back(tmp_path, caplog):
    runs = list(isolated_runs(stand_in("PidJob", "pid", tmp_path), "job pid"))
    assert [r.metrics["i"] for r in runs] == [0.0, 1.0]
    assert len({r.metrics["pid"] for r in runs}) == 1 and runs[0].metrics["pid"] != os.getpid()
    assert runs[0].device.startswith("cpu")          # named in the child: a GPU's name would start CUDA here
    assert f"[stand-in] measuring in pid {int(runs[0].metrics['pid'])}" in caplog.text


@pytest.mark.parametrize("name, error, msg", [
    ("config", ConfigError, r"^job config \(adhoc\) in its own process \(pid \d+\): micro.n=0: give micro.n >= 1$"),
    ("bug", JobProcessError, r"(?s)^job bug \(adhoc\) in its own process \(pid \d+\) raised ValueError: a bug in the "
                             r"job\nthe child's traceback:\n.*isolate_jobs.py.*in run\n.*ValueError: a bug in the job"),
    ("kill", JobProcessError, r"^job kill \(adhoc\) in its own process \(pid \d+\) ended before its job finished: it "
                              r"was killed by signal SIGKILL")])
def test_a_failure_in_the_job_process_reaches_the_parent_with_the_job_named(tmp_path, name, error, msg):
    """Bad input stays bad input (the app's exit status 2, no traceback); a bug carries the child's traceback; a child
    killed by a signal is said so. None hangs or passes for a finished job."""
    with pytest.raises(error, match=msg):
        run_job(stand_in("FailingJob", name, tmp_path), tmp_path / "out")
    assert not (tmp_path / "out" / "run_record.json").exists()


def test_an_isolated_run_records_what_the_in_process_run_records(tmp_path):
    """The tiny model's decode job in process and isolated: the same metrics, the same tokens, the same verdict."""
    records = {}
    for isolate in ("false", "true"):
        cfg = cfg_of(*tiny(tmp_path, "tracking.enabled=false", "measure.warmup=0", "measure.repeats=1",
                           f"launch.isolate={isolate}"))
        assert run_job(cfg, tmp_path / isolate) > 0
        records[isolate] = json.loads((tmp_path / isolate / "run_record.json").read_text())
    here, there = records["false"], records["true"]
    assert set(here["metrics"]) == set(there["metrics"]) and "host_peak_mb" in there["metrics"]
    for k in ("verify_ok", "steps", "generated_tokens", "prompt_len", "kv_cache_mb", "repeats"):
        assert here["metrics"][k] == there["metrics"][k], k
    for k in ("verify", "workload_hash", "model_file", "backend", "dtype", "device"):
        assert here["tags"][k] == there["tags"][k], k
    assert here["artifacts"]["samples.txt"] == there["artifacts"]["samples.txt"]
    assert here["run_name"] == there["run_name"] and here["params"] == there["params"]


def times(*seconds):
    """A stand-in kernel timer: one replay's seconds per call from the list, one call at a time."""
    it = iter(seconds)
    return lambda: next(it)


def test_int4_gemm_times_each_variant_under_the_measure_group_with_its_spread():
    from onepass.harness.int4_bench import derive, timed_variants
    from onepass.harness.spread import timed_us

    us = 1e-6   # warm-up replay first (untimed, any value), then MEASURE.repeats timed ones
    m = {"triton_ok": 1, "cuda_mma_ok": 1, "bf16_ok": 1}
    m.update(timed_us("triton_us", times(99 * us, 10 * us, 11 * us, 10 * us, 12 * us), MEASURE))
    m.update(timed_us("cuda_mma_us", times(99 * us, 5 * us, 5 * us, 5 * us, 5 * us), MEASURE))
    m.update(timed_us("bf16_us", times(99 * us, 20 * us, 20 * us, 21 * us, 20 * us), MEASURE))
    best = derive(m, ["triton", "cuda_mma"], "triton", 10**6, 8)
    assert best == "cuda_mma" and m["triton_us"] == pytest.approx(10.5) and m["cuda_mma_us_cv"] == 0.0
    for name in ("triton_us", "cuda_mma_us", "bf16_us", "picked_us"):
        assert m[f"{name}_p10"] <= m[name] <= m[f"{name}_p90"] and f"{name}_cv" in m, name
    assert m["picked_us_cv"] == m["triton_us_cv"] and m["speedup_vs_bf16"] == pytest.approx(20 / 10.5)
    assert m["best_us"] == pytest.approx(5.0) and m["triton_tbps"] == pytest.approx(1e6 / 10.5e-6 / 1e12)
    assert set(timed_variants(m)) == {"triton_us", "cuda_mma_us", "bf16_us"}
    # the guard watches every timed variant: one that varies past measure.max_cv marks the run noisy
    m.update(timed_us("cuda_mma_us", times(99 * us, 5 * us, 8 * us, 5 * us, 8 * us), MEASURE))
    assert [r.split(" ")[0] for r in noisy_reasons(m, None, [], MEASURE, timed_variants(m))] == ["cuda_mma_us"]


def test_gdn_step_times_ours_and_the_peer_under_the_measure_group_with_their_spread():
    from onepass.harness.gdn_bench import TIMED, step_metrics
    from onepass.harness.micro import WATCHED
    from onepass.harness.spread import timed_us

    us = 1e-6
    t = {**timed_us("our_us", times(1.0, 5 * us, 5.2 * us, 5 * us, 5.1 * us), MEASURE),
         **timed_us("our_bf16_us", times(1.0, 4 * us, 4 * us, 4 * us, 4 * us), MEASURE),
         **timed_us("fla_us", times(1.0, 6 * us, 6 * us, 6 * us, 6 * us), MEASURE)}
    m = step_metrics(t, B=8, state_bytes=6 * 2**20, bw=4e12)
    for name in TIMED:
        assert {name, f"{name}_p10", f"{name}_p90", f"{name}_cv"} <= set(m), name
    assert m["our_us"] == pytest.approx(5.05) and m["speedup"] == pytest.approx(6 / 5.05)
    assert m["throughput_tok_s"] == pytest.approx(8 / 5.05e-6) and m["floor_frac"] == pytest.approx(
        m["floor_us"] / 5.05)
    assert set(TIMED) <= set(WATCHED)       # the micro job's noise guard judges them
    assert "speedup" not in step_metrics({k: v for k, v in t.items() if not k.startswith("fla")}, 8, 2**20, 4e12)
