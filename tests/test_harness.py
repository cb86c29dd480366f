"""The Hydra app, MLflow logging, sweeps, offline spool and reports, on tiny synthetic models."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from onepass.harness import report
from onepass.harness.app import CONF_DIR
from onepass.harness.job import run_job

ROOT = Path(__file__).resolve().parent.parent
FIXED_METRICS = {"throughput_tok_s", "per_stream_tok_s", "step_ms_p50", "step_ms_p90", "steps", "verify_ok",
                 "peak_mem_mb", "ready_scales_mb"}
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def tiny(tmp_path, *extra):
    return ("model=tiny-llama", "batch.size=2", "workload.max_new_tokens=8", "progress=false",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.spool_dir={tmp_path}/spool", *extra)


def cli(tmp_path, *args):
    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "onepass.harness", *args, f"hydra.run.dir={tmp_path}/out",
                           f"hydra.sweep.dir={tmp_path}/multirun"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    """Every experiment file names a report table: its own name, or a table it shares with siblings
    (verified_fresh_static and verified_fresh_serving both record into verified_fresh)."""
    from onepass.harness.report import TABLES

    cfg = cfg_of(f"experiment={name}")
    assert cfg.table in TABLES and name.startswith(cfg.table)


def test_misspelled_experiment_is_refused_not_run_as_the_default():
    """experiment is a required-if-given group: a name with no file is an error listing the files, never a silent
    default job (an optional group would skip the missing file and run the default model)."""
    with pytest.raises(ConfigCompositionException, match="experiment/hybrid_27b_q5"):
        cfg_of("experiment=hybrid_27b_q5")
    assert cfg_of().model.name == "smollm2-135m"          # no experiment: the default job still composes


def test_engine_ready_scales_sets_its_launch_policy(tmp_path):
    """engine.ready_scales=false reaches the engine's launch policy (kernels/pdl.py), which its step puts in force
    around its launches; the default keeps the ready words; nothing process-wide changes."""
    from onepass.harness.build import build
    from onepass.kernels import pdl

    assert build(cfg_of(*tiny(tmp_path, "engine.ready_scales=false"))).launch.ready_scales is False
    assert build(cfg_of(*tiny(tmp_path))).launch.ready_scales is True
    assert pdl.current() == pdl.LaunchPolicy()


def test_a_plus_key_outside_the_schema_is_refused(tmp_path):
    """`+batch.sise=4` used to pass composition, run the default batch and log the typo as a parameter."""
    from onepass.kernels.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown setting batch\.sise"):
        run_job(cfg_of(*tiny(tmp_path, "+batch.sise=4")), tmp_path / "out")


def test_misspelled_override_names_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        cfg_of("batch.sise=4")
    assert "sise" in str(e.value.__cause__ or e.value)
    with pytest.raises(ConfigCompositionException):
        cfg_of("batch.size=many")  # wrong type


def test_run_logs_fixed_metrics_and_report_regenerates(tmp_path, monkeypatch):
    cfg = cfg_of(*tiny(tmp_path, "table=static_batching"))
    tput = run_job(cfg, tmp_path / "out")
    assert tput > 0
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(search_all_experiments=True)
    assert len(df) == 1
    assert FIXED_METRICS <= {c.removeprefix("metrics.") for c in df.columns if c.startswith("metrics.")}
    row = df.iloc[0]
    assert row["metrics.verify_ok"] == 1.0 and row["params.batch.size"] == "2"
    assert row["params.engine.ready_scales"] == "True" and row["metrics.ready_scales_mb"] == 0.0   # CPU: none made
    for tag in ("git_commit", "git_dirty", "device", "torch_version", "triton_version", "workload_hash"):
        assert row[f"tags.{tag}"]
    artifacts = {a.path for a in mlflow.MlflowClient(uri).list_artifacts(row["run_id"])}
    assert {"config.yaml", "samples.txt", "step_times.json"} <= artifacts
    assert json.loads((tmp_path / "out" / "run_record.json").read_text())["status"] == "FINISHED"

    # report from the store, record runs.csv, then regenerate from the CSV alone
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    # a loaded test machine may make the run noisy: recording it is the point here (the guard: tests/test_records.py)
    assert report.main(["static_batching", "--uri", uri, "--record", "--allow-noisy",
                        "--out", str(tmp_path / "r1")]) == 0
    csv = tmp_path / "experiments" / "static_batching" / "runs.csv"
    assert "metrics.throughput_tok_s" in pd.read_csv(csv).columns
    assert report.main(["static_batching", "--source", "csv", "--out", str(tmp_path / "r2")]) == 0
    table = (tmp_path / "r2" / "static_batching.md").read_text()
    assert "| B |" in table.replace("|   B |", "| B |") and "✓" in table
    # --merge needs the table's row key: refused, and runs.csv left as it was
    before = csv.read_text()
    assert report.main(["static_batching", "--uri", uri, "--record", "--merge", "--allow-noisy",
                        "--out", str(tmp_path / "r3")]) == 1
    assert csv.read_text() == before


def test_record_merge_replaces_only_the_rerun_rows():
    """A partial rerun (two of four int4_gemm rows) replaces those rows and keeps the others; the store's numbers
    ("5120.0") and the CSV's text ("5120") are one key; of two reruns of one row the newest wins."""
    def runs(rows, t0):
        return pd.DataFrame([{"run_id": f"r{t0}{i}", "start_time": f"2026-11-29 1{t0}:00:0{i}", "params.micro.n": n,
                              "params.micro.k": "17408", "params.micro.fmt": "q4_0", "params.batch.size": b,
                              "metrics.us": us} for i, (n, b, us) in enumerate(rows)])
    recorded = runs([("5120", "1", 21.4), ("5120", "16", 32.8), ("4096", "1", 7.5), ("4096", "16", 12.1)], 0)
    new = runs([(5120.0, 1.0, 20.0), (5120.0, 1.0, 19.6), (4096.0, 16.0, 11.0)], 1)
    merged = report.merge_runs("int4_gemm", recorded, new)
    got = {(str(n).removesuffix(".0"), str(b).removesuffix(".0")): us for n, b, us in
           zip(merged["params.micro.n"], merged["params.batch.size"], merged["metrics.us"])}
    assert got == {("5120", "1"): 19.6, ("5120", "16"): 32.8, ("4096", "1"): 7.5, ("4096", "16"): 11.0}
    assert len(merged) == 4
    with pytest.raises(ValueError, match="ROW_KEYS"):
        report.merge_runs("static_batching", recorded, new)
    with pytest.raises(ValueError, match="params.batch.size"):
        report.merge_runs("int4_gemm", recorded, new.drop(columns=["params.batch.size"]))


def test_int4_gemm_table_rounds_every_time_and_ratio():
    """Each numeric column of the int4_gemm table gets its own format (times to 0.1 us, TB/s and ratios to 0.01):
    no raw float reaches the markdown."""
    variants = ["triton", "cuda", "cuda_mma", "cuda_mma_fold", "cuda_mma_fold_lat", "cuda_wgmma", "cuda_wgmma_x2",
                "cuda_wgmma_ws", "cuda_wgmma_ws_t128", "dequant_cublas", "bf16"]
    row = {"params.micro.n": "5120", "params.micro.k": "17408", "params.micro.fmt": "q4_0", "params.batch.size": "1",
           "metrics.effective_tbps": 2.778180152025168, "metrics.speedup_vs_bf16": 2.751486782197134,
           "metrics.verify_ok": 1.0, "metrics.pdl": 3.0, "tags.int4_pick": "cuda_mma_fold",
           "tags.int4_best": "cuda_mma_fold"}
    row.update({f"metrics.{v}_us": 100.0 + i + 0.123456789 for i, v in enumerate(variants)})
    md, _ = report.TABLES["int4_gemm"](pd.DataFrame([row]))
    assert "109.1" in md and "2.78" in md and "2.75" in md, md
    assert not re.search(r"\d\.\d{3,}", md), md


def test_record_merge_int4_e2e_keys_on_model_weights_and_batch():
    """A rerun of one model's rows replaces those and keeps the other model's (the int4_e2e table's row key)."""
    def runs(rows, t0):
        return pd.DataFrame([{"run_id": f"e{t0}{i}", "start_time": f"2026-11-29 1{t0}:00:0{i}", "params.model.name": m,
                              "params.engine.weights": w, "params.batch.size": b, "metrics.tok_s": v}
                             for i, (m, w, b, v) in enumerate(rows)])
    recorded = runs([("smollm2-135m", "packed", "1", 10.0), ("llama-3.2-1b-q4_0", "packed", "1", 20.0),
                     ("llama-3.2-1b-q4_0", "dequant", "1", 30.0)], 0)
    merged = report.merge_runs("int4_e2e", recorded, runs([("llama-3.2-1b-q4_0", "packed", 1.0, 21.0)], 1))
    assert sorted(merged["metrics.tok_s"]) == [10.0, 21.0, 30.0]


def test_sweep_makes_parent_and_children(tmp_path):
    r = cli(tmp_path, "-m", *tiny(tmp_path, "table=static_batching"), "batch.size=1,3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("[verify]") == 2 and r.stdout.count(": true") >= 2
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    df = mlflow.search_runs(search_all_experiments=True)
    parents = df[df["tags.onepass.kind"] == "sweep"]
    children = df[df["tags.mlflow.parentRunId"].notna()]
    assert len(parents) == 1 and len(children) == 2
    assert set(children["tags.mlflow.parentRunId"]) == set(parents["run_id"])
    assert parents.iloc[0]["status"] == "FINISHED"
    assert sorted(children["params.batch.size"]) == ["1", "3"]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_sweep_and_marks_its_parent_killed(tmp_path, stop):
    """Ctrl-C (or SIGTERM, as `kill` and batch schedulers stop a job) in a job: one line that says what was kept
    instead of a traceback, exit status 128 + the signal, and the sweep's parent run closed as KILLED (Ctrl-C left it
    FAILED, as if a job had raised; SIGTERM left it RUNNING)."""
    import signal

    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    args = ["-m", *tiny(tmp_path, "table=static_batching", "workload.max_new_tokens=200000", "kv_cache.ctx=200100"),
            "batch.size=1,2", f"hydra.sweep.dir={tmp_path}/multirun"]
    # SIGINT back to its default in the child: a test run started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    p = subprocess.Popen([sys.executable, "-m", "onepass.harness", *args], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in p.stdout:   # the job is decoding once it has printed its workload
        if line.startswith("[workload]"):
            break
    sig = getattr(signal, stop)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-3000:]
    assert "[interrupted] job 0 stopped before it was recorded" in err and "Traceback" not in err
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    df = mlflow.search_runs(search_all_experiments=True)   # the sweep's parent, and the run its job opened at start
    assert list(df["status"]) == ["KILLED", "KILLED"] and list(df["tags.onepass.kind"].fillna("")) == ["", "sweep"]
    assert "its run is marked KILLED" in err


def test_unreachable_tracking_keeps_the_record_and_syncs_later(tmp_path):
    r = cli(tmp_path, *tiny(tmp_path), "tracking.uri=http://127.0.0.1:9")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "could not log to http://127.0.0.1:9" in r.stderr and "[verify]" in r.stdout
    spooled = list((tmp_path / "spool").glob("*.json"))
    assert len(spooled) == 1
    from onepass.harness.tracking import sync

    assert sync(tmp_path / "spool", f"sqlite:///{tmp_path}/late.db") == (1, 0)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/late.db")
    df = mlflow.search_runs(search_all_experiments=True)
    assert len(df) == 1 and df.iloc[0]["metrics.verify_ok"] == 1.0
    assert not list((tmp_path / "spool").glob("*.json"))


def test_a_record_reaches_the_store_once(tmp_path, capsys):
    """log_record after a partial log of the same record (its run created, never terminated) replaces that run, and a
    second log of a complete record adds nothing; sync says so when its spool folder is missing and logs the good
    records beside one it cannot read, which stays for a look."""
    from onepass.harness import tracking

    uri = f"sqlite:///{tmp_path}/store.db"
    rec = tracking.new_record("r", "exp", {"batch.size": "4"}, {"table": "t"})
    rec.update(metrics={"verify_ok": 1.0}, status="FINISHED")
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = tracking.ensure_store(uri, "exp")
    client.create_run(exp, tags={"onepass.record_id": rec["record_id"]})   # cut short before it terminated
    rid = tracking.log_record(rec, uri)
    assert tracking.log_record(rec, uri) == rid
    runs = client.search_runs([exp])
    assert [r.info.run_id for r in runs] == [rid] and runs[0].info.status == "FINISHED"

    spool = tmp_path / "spool"
    assert tracking.sync(spool, uri) == (0, 0) and "no spool folder" in capsys.readouterr().err
    other = tracking.new_record("r2", "exp", {}, {})
    other["status"] = "FINISHED"
    tracking.save_record(other, spool / f"{other['record_id']}.json")
    (spool / "broken.json").write_text("{")
    assert tracking.sync(spool, uri) == (1, 1)
    assert "broken.json: not a readable run record" in capsys.readouterr().err
    assert [p.name for p in spool.glob("*.json")] == ["broken.json"] and len(client.search_runs([exp])) == 2


def test_prompt_longer_than_ctx_fails_cleanly(tmp_path):
    r = cli(tmp_path, *tiny(tmp_path), "kv_cache.ctx=16")
    assert r.returncode == 2
    assert "[error]" in r.stderr and "kv_cache.ctx=16" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "run_record.json").exists()
    # the run opened when the job started is deleted: the store holds no run of a refused job
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    assert mlflow.search_runs(search_all_experiments=True).empty


def test_misspelled_override_on_the_command_line(tmp_path):
    r = cli(tmp_path, *tiny(tmp_path), "workload.max_new_tokenz=4")
    assert r.returncode != 0 and "max_new_tokenz" in r.stderr


@pytest.mark.parametrize("model,kv,sched", [("tiny-llama", "contiguous", "continuous"),
                                            ("tiny-llama", "paged", "continuous"),
                                            ("tiny-qwen35", "contiguous", "continuous"),
                                            ("tiny-qwen35", "paged", "continuous"),
                                            ("tiny-qwen35", "contiguous", "continuous_chunked"),
                                            ("tiny-qwen35", "paged", "continuous_chunked")])
def test_serving_run_verifies_and_logs(tmp_path, model, kv, sched):
    """Continuous serving, also of the hybrid model (its slots' recurrent state restarts at position 0, or from the
    pinned prefix's state snapshot), with its prompts token by token or in chunks (ragged runs through the GDN
    layers)."""
    prefix = ("off" if kv != "paged" else "auto" if model == "tiny-llama" else "pinned" if sched == "continuous"
              else "off")
    extra = [f"scheduler={sched}", f"kv_cache={kv}", "workload.num_requests=6", "workload.min_new_tokens=2",
             "kv_cache.block_size=4", "kv_cache.ctx=64", f"kv_cache.prefix={prefix}"]
    cfg = cfg_of(*tiny(tmp_path, "table=serving_paged", *extra), f"model={model}", "batch.size=3")
    assert run_job(cfg, tmp_path / "out") > 0
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    row = mlflow.search_runs(search_all_experiments=True).iloc[0]
    assert row["metrics.verify_ok"] == 1.0 and row["metrics.steps"] > 0
    assert row["metrics.prefill_tokens"] > 0
    if kv == "paged":
        assert row["metrics.peak_blocks"] > 0
    assert (row["metrics.pinned_prefix_tokens"] > 0) == (prefix == "pinned")


def test_prefix_cache_needs_paged_kv(tmp_path):
    from onepass.kernels.errors import ConfigError

    cfg = cfg_of(*tiny(tmp_path, "scheduler=continuous", "workload.num_requests=2", "kv_cache.prefix=auto"))
    with pytest.raises(ConfigError, match="layout=paged"):
        run_job(cfg, tmp_path / "out")


def test_chunked_budget_beyond_the_graph_buckets_is_refused_before_loading(tmp_path, monkeypatch):
    from onepass.kernels.errors import ConfigError
    from onepass.harness import decode_job

    monkeypatch.setattr(decode_job, "build",
                        lambda cfg: pytest.fail("the model was built before the budget was checked"))
    cfg = cfg_of(*tiny(tmp_path, "scheduler=continuous_chunked", "workload.num_requests=2",
                       "scheduler.token_budget=1024"))
    with pytest.raises(ConfigError, match="token_budget=1024.*512 or less"):
        run_job(cfg, tmp_path / "out")


@pytest.mark.parametrize("overrides, msg", [
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.layout=paged", "kv_cache.block_size=0"],
     "block_size=0"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.layout=pagd"], "layout='pagd'"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.layout=paged", "kv_cache.num_blocks=1"],
     "num_blocks=1.*scratch"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.layout=paged", "kv_cache.pool_vs_peak=-2"],
     "pool_vs_peak=-2"),
    (["engine.threads=-3"], "engine.threads=-3"),
    (["scheduler=continuous", "workload.num_requests=2", "workload.min_new_tokens=100"], "min_new_tokens=100"),
    (["workload.num_requests=-1"], "num_requests=-1"),
    (["scheduler=continuous", "workload.num_requests=0"], "num_requests=0 gives none.*workload=serve_p_short"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.prefix=on"], "prefix='on'.*off, pinned, auto"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache.prefix=auto"], "prefix=auto.*layout=paged"),
    (["scheduler=continuous", "workload.num_requests=2", "kv_cache=paged", "kv_cache.pool_vs_peak=1.5",
      "workload.ignore_eos=false"], "pool_vs_peak.*ignore_eos=true"),
    (["scheduler=continuous_chunked", "workload.num_requests=2", "scheduler.token_budget=1"],
     "token_budget=1 is below the 2 decode rows.*>= 2"),
    (["workload.max_new_tokens=0"], "max_new_tokens=0.*>= 1")])
def test_bad_kv_cache_and_threads_are_refused_before_loading(tmp_path, monkeypatch, overrides, msg):
    """Before, a paged block size of 0 divided by zero, one block raised a bare ValueError after the model loaded, and a
    negative pool multiple or thread count ran as if they were 0; a serving job without requests, a prefix mode it
    could not run, a peak-sized pool without fixed lengths, a chunk budget below the batch and no new tokens were
    refused only after the model was built."""
    from onepass.kernels.errors import ConfigError
    from onepass.harness import decode_job

    monkeypatch.setattr(decode_job, "build",
                        lambda cfg: pytest.fail("the model was built before the settings were checked"))
    with pytest.raises(ConfigError, match=msg):
        run_job(cfg_of(*tiny(tmp_path, *overrides)), tmp_path / "out")


def test_hybrid_prefix_cache_is_refused_from_the_header_before_loading(tmp_path, monkeypatch):
    """A hybrid model's prefix refusal needs its architecture, read from the GGUF header alone: before, it came after
    every tensor had loaded (minutes on the 27B shapes)."""
    from onepass.kernels.errors import ConfigError
    from onepass.engine import engine

    monkeypatch.setattr(engine, "load_gguf", lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
    cfg = cfg_of(*tiny(tmp_path, "model=tiny-qwen35", "scheduler=continuous", "kv_cache=paged",
                       "workload.num_requests=2", "kv_cache.prefix=auto"))
    with pytest.raises(ConfigError,
                       match="prefix=auto: automatic prefix caching is not supported for the hybrid qwen35"):
        run_job(cfg, tmp_path / "out")


def test_paged_pool_that_fits_no_request_is_refused_with_the_size_that_would(tmp_path):
    """A hand-sized pool smaller than one request used to reject every request, one line each, and log a run that
    served nothing; the job now stops before serving and names the pool that would hold the request."""
    from onepass.kernels.errors import ConfigError

    cfg = cfg_of(*tiny(tmp_path, "scheduler=continuous", "kv_cache=paged", "workload.num_requests=2",
                       "kv_cache.block_size=4", "kv_cache.num_blocks=3"))
    need = cfg.workload.synthetic_prompt_len + cfg.workload.max_new_tokens - 1   # tiny-llama has no tokenizer
    with pytest.raises(ConfigError, match=f"num_blocks=3 leaves 2 blocks.*needs {need} KV positions.*"
                                          f"num_blocks >= {-(-need // 4) + 1}"):
        run_job(cfg, tmp_path / "out")


def test_default_paged_pool_holds_a_request_of_the_whole_context(tmp_path):
    """kv_cache.num_blocks=0 sizes the pool so every slot reaches kv_cache.ctx: with a ctx that is not a whole number
    of blocks the pool once rounded down and rejected the requests that reached the last, partial block."""
    cfg = cfg_of(*tiny(tmp_path, "scheduler=continuous", "kv_cache=paged", "workload.num_requests=2", "batch.size=1",
                       "kv_cache.block_size=4", "workload.ignore_eos=true", "workload.min_new_tokens=0"))
    ctx = cfg.workload.synthetic_prompt_len + cfg.workload.max_new_tokens - 1   # tiny-llama has no tokenizer
    assert ctx % 4, "the request should end inside a block"
    cfg.kv_cache.ctx = ctx
    assert run_job(cfg, tmp_path / "out") > 0
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    row = mlflow.search_runs(search_all_experiments=True).iloc[0]
    assert row["metrics.verify_ok"] == 1.0 and row["metrics.rejected"] == 0
    assert row["metrics.kv_blocks"] == -(-ctx // 4) + 1


@pytest.mark.parametrize("overrides, msg", [
    (["job=int4_gemm", "micro.batches=[1,0]"], r"micro.batches=\[1, 0\]"),
    (["job=decode_attention", "micro.kv_heads=5"], "multiple of micro.kv_heads=5"),
    (["job=gdn_step", "micro.gdn_dim=0"], "micro.gdn_dim=0"),
    (["job=gdn_step", "micro.gdn_v_heads=40", "micro.gdn_k_heads=16"], "gdn_v_heads=40"),
    (["job=projection_crossover", "batch.size=0"], "batch.size=0")])
def test_bad_micro_sizes_are_refused_before_the_device(tmp_path, overrides, msg):
    """Checked before the jobs' own CUDA check, so a CPU machine sees the same refusal as the GPU would."""
    from onepass.kernels.errors import ConfigError

    with pytest.raises(ConfigError, match=msg):
        run_job(cfg_of(*tiny(tmp_path, *overrides)), tmp_path / "out")


def test_workload_has_no_shared_prefix_len_key():
    """Every request of a serving job is the same prompt, so the shared prefix is the whole prompt (pinned mode pins its
    block-aligned part); a shared_prefix_len key that changed nothing is gone, and setting it is a composition error."""
    with pytest.raises(ConfigCompositionException, match="shared_prefix_len"):
        cfg_of("workload.shared_prefix_len=16")


def test_paged_block_size_for_the_triton_kernels():
    """The Triton paged attention reads power-of-two blocks of 16+ positions; the torch reference takes any size."""
    from types import SimpleNamespace

    from onepass.kernels.errors import ConfigError
    from onepass.harness.checks import check_kv_cache

    kv = lambda bs: SimpleNamespace(layout="paged", block_size=bs, num_blocks=0, pool_vs_peak=0.0, prefix="off")  # noqa: E731
    for bs in (4, 24, 8):
        with pytest.raises(ConfigError, match="power of two >= 16"):
            check_kv_cache(kv(bs), "triton")
        check_kv_cache(kv(bs), "torch")
    check_kv_cache(kv(32), "triton")
    check_kv_cache(SimpleNamespace(layout="contiguous", block_size=4, num_blocks=0, pool_vs_peak=0.0, prefix="off"),
                   "triton")


def test_misspelled_int4_policy_is_refused_whatever_the_weights(tmp_path):
    """engine.int4 names the packed projections' kernel policy; with dense weights it does nothing, yet a typo there
    is refused (before the model loads) rather than run as if it had been accepted."""
    from onepass.kernels.errors import ConfigError
    from onepass.harness.build import resolve_engine

    for weights in ("dequant", "packed"):
        cfg = cfg_of(*tiny(tmp_path, "engine.int4=invariantt", f"engine.weights={weights}"))
        with pytest.raises(ConfigError, match="engine.int4='invariantt'"):
            resolve_engine(cfg.engine)
    assert resolve_engine(cfg_of(*tiny(tmp_path, "engine.int4=cuda_mma_fold")).engine)[0].type in ("cpu", "cuda")
    with pytest.raises(ConfigError, match="engine.int4=fastest was removed"):     # the policy users typed
        resolve_engine(cfg_of(*tiny(tmp_path, "engine.int4=fastest")).engine)


@pytest.mark.parametrize("override, msg", [("sampling.temperature=-1", "0 for greedy"),
                                            ("sampling.top_p=0", r"\(0, 1\]"),
                                            ("sampling.top_k=-5", "whole vocabulary")])
def test_bad_sampling_is_refused_before_loading(tmp_path, monkeypatch, override, msg):
    from onepass.kernels.errors import ConfigError
    from onepass.harness import decode_job

    monkeypatch.setattr(decode_job, "build", lambda cfg: pytest.fail("the model was built before sampling was checked"))
    with pytest.raises(ConfigError, match=msg):
        run_job(cfg_of(*tiny(tmp_path, override)), tmp_path / "out")


def test_report_from_a_missing_store_creates_none(tmp_path, monkeypatch):
    """onepass-report reads the default store ./mlflow.db first; where there is none it used to create an empty one in
    whatever folder it ran from. It now reads the recorded csv and leaves the folder as it was."""
    monkeypatch.chdir(tmp_path)
    assert report.runs_from_store("static_batching", "sqlite:///mlflow.db").empty
    assert report.main(["static_batching", "--out", str(tmp_path / "reports")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]


def test_store_reads_the_newest_sweep_unless_told_all(tmp_path):
    """runs_from_store: the newest sweep per experiment file by default (a rerun replaces the old one); every
    finished run with newest=False (two jobs of one commit recorded into one table, e.g. int4_gemm's Q4_0
    and Q4_K sweeps)."""
    uri = f"sqlite:///{tmp_path}/store.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("t")
    for sweep, value in (("s1", 1.0), ("s2", 2.0), ("s2", 3.0)):
        with mlflow.start_run(tags={"table": "tbl", "sweep_id": sweep, "experiment_file": "tbl.yaml"}):
            mlflow.log_metric("v", value)
    newest = report.runs_from_store("tbl", uri)
    assert sorted(newest["metrics.v"]) == [2.0, 3.0]
    assert sorted(report.runs_from_store("tbl", uri, newest=False)["metrics.v"]) == [1.0, 2.0, 3.0]


def test_hybrid_report_opens_with_the_targets_from_the_newest_rows():
    """The hybrid_27b report's first table: per B the newest packed Q4 (invariant) row of each mode and state, an
    unverified row marked, dequantized-weight rows left out, the static fp32-state rows against the targets."""
    def row(i, B, tok, state="float32", mode="static", weights="packed", ok=1.0, t=0):
        return {"start_time": f"2026-11-30 1{t}:00:{i:02d}", "tags.device": "NVIDIA H200",
                "params.engine.weights": weights,
                "params.engine.int4": "invariant", "params.kv_cache.state_dtype": state, "params.scheduler.mode": mode,
                "params.scheduler.prefill": "token", "params.engine.pdl": "True", "params.batch.size": str(B),
                "metrics.throughput_tok_s": tok, "metrics.verify_ok": ok, "metrics.pdl": 4.0}
    df = pd.DataFrame([row(0, 32, 2000.0), row(1, 32, 2767.0, t=1), row(2, 32, 2964.0, state="bfloat16"),
                       row(3, 32, 1638.0, mode="continuous", ok=0.0), row(4, 32, 9999.0, weights="dequant", t=2),
                       row(5, 1, 150.2), row(6, 8, 993.0)])
    md, _ = report.TABLES["hybrid_27b"](df)
    headline, standing = md.split("### Every recorded row")[0].split("### Where the targets stand")
    assert headline.startswith("### Headline")          # the report opens with its headline, then the targets
    line32 = next(l for l in standing.splitlines() if l.startswith("|  32 "))
    assert "2,767" in line32 and "2,000" not in line32 and "9,999" not in line32, line32
    assert "2,964" in line32 and "1,638 ✗" in line32 and "3,000" in line32 and "92.2%" in line32, line32
    line8 = next(l for l in standing.splitlines() if l.startswith("|   8 "))
    assert "993" in line8 and "%" not in line8, line8          # no target at B = 8
    assert "75.1%" in next(l for l in standing.splitlines() if l.startswith("|   1 "))
    # the newest row stands whole: a newer run without a throughput does not borrow the older run's
    df = pd.concat([df, pd.DataFrame([row(7, 8, float("nan"), ok=0.0, t=3)])], ignore_index=True)
    standing = report.TABLES["hybrid_27b"](df)[0].split("### Every recorded row")[0]
    line8 = next(l for l in standing.splitlines() if l.startswith("|   8 "))
    assert "— ✗" in line8 and "993" not in line8, line8
    # another Q4 block type gets its own column and its own "reached"; Q4_K stays the one the targets name
    q40 = dict(row(8, 32, 2952.0, t=4), **{"params.model.synthetic.weight_type": "q4_0"})
    md = report.TABLES["hybrid_27b"](pd.concat([df, pd.DataFrame([q40])], ignore_index=True))[0]
    head, line32 = (next(l for l in md.splitlines() if l.startswith(p)) for p in ("|   B ", "|  32 "))
    assert "static, fp32 state, Q4_0" in head and "reached (Q4_0)" in head, head
    assert "2,767" in line32 and "92.2%" in line32 and "2,952" in line32 and "98.4%" in line32, line32
    assert "| q4_0 " in md and "| q4_k " in md
    # a row just short of its target reads short, rounded down: 2,998.9 of 3,000 is 99.9%, not 100%
    short = dict(row(9, 32, 2998.9, t=5))
    line32 = next(l for l in report.TABLES["hybrid_27b"](pd.concat([df, pd.DataFrame([short])], ignore_index=True))[0]
                  .splitlines() if l.startswith("|  32 "))
    assert "99.9%" in line32 and "100" not in line32.split("3,000")[1], line32


def test_hybrid_rows_keyed_and_labelled_by_ready_scales():
    """engine.ready_scales is part of a hybrid_27b row's key (rows recorded before it count as off) and shown for
    packed Q4_K rows: a rerun with the setting on does not replace the recorded row without it."""
    def row(t, ready=None, kind="q4_k"):
        r = {"run_id": f"r{t}", "start_time": f"2026-12-03 1{t}:00:00", "tags.device": "NVIDIA H200",
             "params.engine.weights": "packed",
             "params.model.synthetic.weight_type": kind, "params.engine.int4": "invariant",
             "params.kv_cache.state_dtype": "float32", "metrics.state_writeback": 4.0,
             "params.scheduler.mode": "static",
             "params.scheduler.prefill": "batched", "params.engine.pdl": "True", "params.batch.size": "32",
             "metrics.throughput_tok_s": 2987.0 + t, "metrics.verify_ok": 1.0, "metrics.pdl": 4.0}
        return r if ready is None else {**r, "params.engine.ready_scales": ready}
    recorded = pd.DataFrame([row(0), row(1, kind="q4_0")])
    merged = report.merge_runs("hybrid_27b", recorded, pd.DataFrame([row(2, "True")]))
    assert sorted(merged["run_id"]) == ["r0", "r1", "r2"]
    merged = report.merge_runs("hybrid_27b", merged, pd.DataFrame([row(3, "False")]))
    assert sorted(merged["run_id"]) == ["r1", "r2", "r3"]                     # off replaces the row from before it
    md, _ = report.TABLES["hybrid_27b"](merged)
    head, _, *lines = [[c.strip() for c in l.split("|")[1:-1]]
                       for l in md.split("### Every recorded row")[1].splitlines() if l.startswith("|")]
    col = head.index("Q4_K scales")
    assert sorted((r[head.index("type")], r[col]) for r in lines) == [("q4_0", "—"), ("q4_k", "file"),
                                                                      ("q4_k", "ready")]


def test_hybrid_rows_of_another_card_stand_beside_the_targets_card(tmp_path, monkeypatch):
    """A rerun on another card is recorded beside the rows it re-measures (the device is part of every row key), the
    table names each row's card, and the standing gives that card's rows columns of their own with no "reached"
    against the H200's targets. A table without a device column refuses runs of several cards."""
    def row(t, tok, device, kind="q4_0"):
        return {"run_id": f"r{t}", "start_time": f"2026-12-05 1{t}:00:00", "tags.device": device,
                "params.engine.weights": "packed", "params.model.synthetic.weight_type": kind,
                "params.engine.int4": "invariant", "params.kv_cache.state_dtype": "float32",
                "metrics.state_writeback": 4.0, "params.scheduler.mode": "static",
                "params.scheduler.prefill": "batched",
                "params.engine.pdl": "True", "params.batch.size": "128", "metrics.throughput_tok_s": tok,
                "metrics.verify_ok": 1.0, "metrics.pdl": 4.0}
    recorded = pd.DataFrame([row(0, 6114.0, "NVIDIA H200"), row(1, 5987.0, "NVIDIA H200", kind="q4_k")])
    merged = report.merge_runs("hybrid_27b", recorded, pd.DataFrame([row(2, 5524.0, "NVIDIA H100 80GB HBM3")]))
    assert sorted(merged["run_id"]) == ["r0", "r1", "r2"]
    md, _ = report.TABLES["hybrid_27b"](merged)
    standing, rows = md.split("### Every recorded row")
    head, line = (next(l for l in standing.splitlines() if l.startswith(p)) for p in ("|   B ", "| 128 "))
    cols = [c.strip() for c in head.split("|")[1:-1]]
    cells = dict(zip(cols, (c.strip() for c in line.split("|")[1:-1])))
    assert cells["static, fp32 state, Q4_0"] == "6,114" and cells["reached (Q4_0)"] == "101.9%", cells
    assert cells["H100 80GB HBM3: static, fp32 state, Q4_0"] == "5,524", cells
    assert not any("H100" in c and "reached" in c for c in cols), cols
    assert "| H100 80GB HBM3 |" in rows and "| H200 " in rows
    # static_batching shows no device: a store holding two cards' runs is refused before anything is recorded
    uri = f"sqlite:///{tmp_path}/store.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("t")
    for device, tok in (("NVIDIA H200", 151.0), ("NVIDIA H100 80GB HBM3", 137.0)):
        with mlflow.start_run(tags={"table": "static_batching", "device": device}):
            mlflow.log_params({"batch.size": 1})
            mlflow.log_metrics({"throughput_tok_s": tok, "per_stream_tok_s": tok, "speedup_vs_single": 1.0,
                                "step_ms_p50": 1e3 / tok, "verify_ok": 1.0})
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    assert report.main(["static_batching", "--uri", uri, "--record", "--out", str(tmp_path / "r")]) == 1
    assert not (tmp_path / "experiments").exists() and not (tmp_path / "r").exists()
    mixed = report.runs_from_store("static_batching", uri)
    with pytest.raises(ValueError, match="2 devices.*DEVICE_TABLES"):
        report.check_one_device("static_batching", mixed)
    report.check_one_device("hybrid_27b", mixed)


def test_int4_report_opens_with_the_targets_from_the_rows():
    """The int4_gemm report's first table: B = 1 TB/s and the bf16 ratios of the fastest verified variant, met or
    short, and every row where each int4 kernel that verified is slower than dequantize + cuBLAS (a faster kernel
    that failed verification does not count)."""
    def row(n, k, fmt, B, tbps=1.0, vs=1.0, best="cuda_mma_fold", fold=10.0, ws=None, ws_ok=1.0, deq=20.0):
        r = {"params.micro.n": str(n), "params.micro.k": str(k), "params.micro.fmt": fmt, "params.batch.size": str(B),
             "metrics.best_tbps": tbps, "metrics.best_us": fold, "metrics.best_speedup_vs_bf16": vs,
             "tags.int4_best": best, "metrics.cuda_mma_fold_us": fold, "metrics.cuda_mma_fold_ok": 1.0,
             "metrics.dequant_cublas_us": deq, "metrics.verify_ok": 1.0, "metrics.pdl": 3.0}
        if ws is not None:
            r.update({"metrics.cuda_wgmma_ws_us": ws, "metrics.cuda_wgmma_ws_ok": ws_ok})
        return r
    df = pd.DataFrame([row(5120, 17408, "q4_0", 1, tbps=3.1, vs=3.2, fold=18.0),
                       row(17408, 5120, "q4_0", 1, vs=2.9), row(5120, 12288, "q4_0", 1, vs=3.0),
                       row(5120, 17408, "q4_0", 16, vs=2.6), row(17408, 5120, "q4_0", 16, vs=2.5),
                       row(5120, 12288, "q4_0", 16, vs=2.7),
                       row(2048, 2048, "q4_0", 128, fold=11.7, ws=9.0, ws_ok=0.0, deq=10.8),
                       row(576, 576, "q4_1", 64, fold=6.0, ws=5.0, deq=5.8)])
    df["start_time"] = "2026-11-30 12:00:00"
    older = pd.DataFrame([row(5120, 17408, "q4_0", 1, tbps=2.0, vs=2.0, fold=28.0)]).assign(start_time="2026-11-29")
    df = pd.concat([df, older], ignore_index=True)     # recorded earlier, listed last: the newer row stands
    md, _ = report.TABLES["int4_gemm"](df)
    standing = md.split("### Every recorded row")[0]
    lines = {l.split("|")[1].strip()[:8]: l for l in standing.splitlines() if l.startswith("| ")}
    assert "3.10 TB/s" in lines["B = 1, 5"] and lines["B = 1, 5"].rstrip(" |").endswith("met")
    assert "2.90x" in lines["B = 1: >"] and lines["B = 1: >"].rstrip(" |").endswith("short")
    assert lines["B = 16: "].rstrip(" |").endswith("met")
    never = lines["every B "]
    assert "slower at 1 of 8 rows" in never and "2048x2048 q4_0 B = 128 (11.7 against 10.8 us)" in never, never
    assert "576x576" not in never and never.rstrip(" |").endswith("short")


def test_provenance_names_the_workload_only_where_runs_have_one():
    base = {"tags.device": ["NVIDIA H200"], "tags.torch_version": ["2.11"], "tags.triton_version": ["3.6"],
            "tags.git_commit": ["abcdef0123456789"]}
    micro = report.provenance(pd.DataFrame(base))
    assert "workload" not in micro and micro.endswith("commit abcdef0123; 1 runs.")
    served = report.provenance(pd.DataFrame({**base, "tags.workload_hash": ["9f28"]}))
    assert "workload 9f28; 1 runs." in served


def test_load_time_leaves_out_writing_a_synthetic_file(tmp_path, monkeypatch):
    """load_s (the load time every run reports) times reading the GGUF into the engine, not making the synthetic
    file a model without a path writes on first use (that can take longer than the load)."""
    import time

    from onepass.harness import build as run_mod

    real = run_mod.resolve_gguf

    def slow_resolve(model_cfg, progress=True):
        time.sleep(1.0)                                   # stands for writing the file
        return real(model_cfg, progress=progress)

    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(run_mod, "resolve_gguf", slow_resolve)
    built = run_mod.build(cfg_of(*tiny(tmp_path), "engine.device=cpu"))
    assert 0 < built.load_s < 1.0


def test_output_folders_differ_for_runs_started_in_the_same_second():
    """Two sweeps started in the same second used one multirun folder and overwrote each other's records: the
    folders carry the process id after the time."""
    import os

    import re

    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    for node in (cfg.hydra.run, cfg.hydra.sweep):
        stamp = rf"\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d-{os.getpid()}"
        assert re.fullmatch(rf"(outputs|multirun)/adhoc/{stamp}", node.dir), node.dir
