"""Sweeps whose jobs run in other processes (hydra/launcher=joblib), logging to a real MLflow server on PostgreSQL
(issue 63): one parent run, one child per job with every metric and artifact of its record, nothing twice; and the
same when the server goes away mid-sweep, once `onepass-sync` has logged what was spooled."""
import json
import os
import subprocess
import sys
import time

import mlflow
import pytest

from onepass.harness import tracking
from onepass.harness.environment import package_versions
from tests.tracking_server import TrackingServer, Unavailable

JOBS = ("1", "2", "3", "4")   # batch sizes: one job each, two at a time


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        srv = TrackingServer(tmp_path_factory.mktemp("mlflow-server") / "artifacts")
    except Unavailable as e:
        pytest.skip(f"no PostgreSQL for the tracking server: {e}")
    try:
        try:
            srv.start_database()
        except Unavailable as e:
            pytest.skip(f"no PostgreSQL for the tracking server: {e}")
        srv.start()
        yield srv
    finally:
        srv.close()


def sweep(tmp_path, server, experiment) -> subprocess.Popen:
    """A joblib sweep of tiny-model jobs, two workers, logging to the server through tracking=server."""
    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI": server.uri,
           "PYTHONUNBUFFERED": "1"}
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=tiny-llama",
            f"batch.size={','.join(JOBS)}", "workload.max_new_tokens=8", "measure.repeats=1", "progress=false",
            "tracking=server", f"tracking.experiment={experiment}", f"tracking.spool_dir={tmp_path}/spool",
            f"hydra.sweep.dir={tmp_path}/multirun"]
    return subprocess.Popen([sys.executable, "-m", "onepass.harness", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(p: subprocess.Popen) -> str:
    """The sweep's output, once it exited 0 with every job verified."""
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert out.count("[verify]") == len(JOBS), out[-2000:]
    return out + err


def runs_of(server, experiment):
    exp = mlflow.MlflowClient(server.uri).get_experiment_by_name(experiment)
    return mlflow.MlflowClient(server.uri).search_runs([exp.experiment_id], max_results=1000)


def check_store(server, experiment, tmp_path) -> list:
    """Exactly one parent, FINISHED; one FINISHED child per job, nested under it, holding every metric and artifact
    of the job's record on disk (environment.txt and lock_hash among them), no record twice."""
    runs = runs_of(server, experiment)
    parents = [r for r in runs if r.data.tags.get("onepass.kind") == "sweep"]
    children = [r for r in runs if r not in parents]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [(r.info.run_name, r.info.status) for r in runs]
    parent = parents[0]
    assert sorted(r.data.params["batch.size"] for r in children) == list(JOBS)
    assert {r.data.tags.get("mlflow.parentRunId") for r in children} == {parent.info.run_id}
    assert {r.data.tags["sweep_id"] for r in runs} == {parent.data.tags["sweep_id"]}
    ids = [r.data.tags["onepass.record_id"] for r in runs]
    assert len(set(ids)) == len(ids) == len(JOBS) + 1
    client = mlflow.MlflowClient(server.uri)
    records = {}
    for path in (tmp_path / "multirun").glob("*/run_record.json"):   # each job's record, beside its outputs
        rec = json.loads(path.read_text())
        records[rec["record_id"]] = rec
    assert len(records) == len(JOBS)
    for run in children:
        rec = records[run.data.tags["onepass.record_id"]]
        assert run.info.status == "FINISHED"
        assert {k: tracking.shown(v) for k, v in rec["metrics"].items()} == \
            {k: run.data.metrics[k] for k in rec["metrics"]}
        assert run.data.metrics["verify_ok"] == 1.0
        assert "lock_hash" in run.data.tags and run.data.tags["lock_hash"] == rec["tags"]["lock_hash"]
        logged = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert set(rec["artifacts"]) | {"step_times.png"} <= logged, logged
        assert client.download_artifacts(run.info.run_id, "environment.txt", str(tmp_path / run.info.run_id))
        assert (tmp_path / run.info.run_id / "environment.txt").read_text() == package_versions()
    assert {"environment.txt", "multirun.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    return runs


def test_a_parallel_sweep_logs_to_the_server_once(server, tmp_path):
    finished(sweep(tmp_path, server, "parallel"))
    check_store(server, "parallel", tmp_path)
    assert not list((tmp_path / "spool").glob("*.json"))


def test_a_server_gone_mid_sweep_gets_every_run_once_through_sync(server, tmp_path):
    """The server stops once the sweep's first job is logged and comes back after the sweep: the jobs after the stop,
    and the end of the parent run, wait in the spool (and in each job's folder), and onepass-sync logs each once; a
    second sync adds nothing."""
    p = sweep(tmp_path, server, "gone")
    deadline = time.monotonic() + 240
    while not any(r.info.status == "FINISHED" and "mlflow.parentRunId" in r.data.tags
                  for r in (runs_of(server, "gone") if mlflow.MlflowClient(server.uri).get_experiment_by_name("gone")
                            else [])):
        assert p.poll() is None and time.monotonic() < deadline, "no job was logged before the sweep ended"
        time.sleep(0.3)
    server.stop()
    output = finished(p)
    spooled = sorted((tmp_path / "spool").glob("*.json"))
    assert len(spooled) >= 2, output[-3000:]   # a job's record at least, and the parent's end
    assert "could not end the sweep's parent run" in output
    assert len(list((tmp_path / "multirun").glob("*/run_record.json"))) == len(JOBS)

    server.start()
    assert tracking.sync_main(["--spool", str(tmp_path / "spool")]) == 0
    runs = check_store(server, "gone", tmp_path)
    assert not list((tmp_path / "spool").glob("*.json"))
    assert tracking.sync_main(["--spool", str(tmp_path / "spool")]) == 0
    again = runs_of(server, "gone")
    assert sorted((r.info.run_id, r.info.status, r.info.end_time) for r in again) == \
        sorted((r.info.run_id, r.info.status, r.info.end_time) for r in runs)
