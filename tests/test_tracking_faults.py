"""Tracking under faults (issue 65): a stop while a run is logged, sweeps creating one store at once, a spool synced
from another folder, an empty store file, and bad input that once ended in a traceback."""
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import mlflow
import pytest

from onepass.harness import report, tracking
from onepass.harness.app import interrupted_line


def record(name="r"):
    rec = tracking.new_record(name, "exp", {"batch.size": "4"}, {"table": "t"})
    rec.update(metrics={"verify_ok": 1.0, "throughput_tok_s": 12.5}, status="FINISHED",
               artifacts={"config.yaml": "batch:\n  size: 4\n"})
    return rec


def settings(uri, spool):
    return SimpleNamespace(enabled=True, uri=uri, spool_dir=str(spool))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the interruption points (a fresh SQLite store takes seconds to create)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    tracking.ensure_store(uri, "exp")
    return uri


# the client calls log_record makes, in order: a Ctrl-C may land inside any of them (finish adds environment.txt to
# the record's config.yaml: two log_text)
CALLS = ["create_run", "log_batch", "log_batch", "log_text", "log_text", "set_terminated"]


@pytest.mark.parametrize("stop_at", range(len(CALLS)))
def test_a_stop_while_logging_leaves_the_whole_record_spooled(store, tmp_path, monkeypatch, stop_at):
    """SIGINT inside log_record used to leave a half-logged RUNNING run, no spool file, and a line saying nothing was
    logged. The record is now spooled before it is logged: whichever call the stop lands in, the spool holds it, the
    line names it, and onepass-sync completes the run once."""
    calls = []

    def stopping(name):
        real = getattr(mlflow.MlflowClient, name)

        def call(self, *a, **k):
            calls.append(name)
            if len(calls) - 1 == stop_at:
                raise KeyboardInterrupt
            return real(self, *a, **k)
        return call

    for name in set(CALLS):
        monkeypatch.setattr(mlflow.MlflowClient, name, stopping(name))
    rec, spool = record(), tmp_path / "spool"
    with pytest.raises(KeyboardInterrupt) as stop:
        tracking.finish(rec, settings(store, spool), tmp_path / "out")
    assert calls[stop_at] == CALLS[stop_at]
    spooled = spool / f"{rec['record_id']}.json"
    assert stop.value.spooled == spooled and spooled.is_file()
    line = interrupted_line(stop.value, None)
    assert str(spooled) in line and "onepass-sync" in line and "nothing was logged" not in line
    monkeypatch.undo()

    assert tracking.sync(spool, None) == (1, 0)
    client = mlflow.MlflowClient(tracking_uri=store)
    runs = client.search_runs([tracking.ensure_store(store, "exp")],
                              f"tags.`onepass.record_id` = '{rec['record_id']}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].data.metrics["throughput_tok_s"] == 12.5


def test_a_stop_before_logging_says_nothing_was_logged():
    assert "nothing was logged" in interrupted_line(KeyboardInterrupt(), None)


CREATE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import mlflow
    from onepass.harness.tracking import ensure_store
    uri, go = sys.argv[1], Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.01)
    exp = ensure_store(uri, "onepass")
    mlflow.MlflowClient(tracking_uri=uri).create_run(exp, run_name="sweep " + sys.argv[3])
""")


def test_sweeps_started_together_on_a_fresh_store_each_get_their_run(tmp_path):
    """Three sweeps creating one fresh SQLite store at once raced in MLflow's schema migration ("duplicate column
    name: step") and only one got its parent run; the store's first access now holds a file lock."""
    uri, go = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CREATE, uri, str(go), str(i)], stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    time.sleep(8)             # every process has imported mlflow and waits for the go file
    go.touch()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-1500:] for e in errs)
    mlflow.set_tracking_uri(uri)
    assert sorted(mlflow.search_runs(search_all_experiments=True)["tags.mlflow.runName"]) == [
        "sweep 0", "sweep 1", "sweep 2"]


def test_sync_from_another_folder_logs_into_the_store_the_run_was_made_for(tmp_path, monkeypatch):
    """A record spooled with tracking.uri=sqlite:///mlflow.db, synced from another folder, went into a new
    ./mlflow.db there; the spool now holds the URI made absolute where the run was made."""
    made, elsewhere = tmp_path / "made", tmp_path / "elsewhere"
    made.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(made)
    monkeypatch.setattr(tracking, "log_record", lambda rec, uri, **k: (_ for _ in ()).throw(RuntimeError("down")))
    rec = record()
    assert tracking.finish(rec, settings("sqlite:///mlflow.db", tmp_path / "spool"), tmp_path / "out") is None
    monkeypatch.undo()
    monkeypatch.chdir(elsewhere)
    assert tracking.sync(tmp_path / "spool", None) == (1, 0)
    assert (made / "mlflow.db").is_file() and not (elsewhere / "mlflow.db").exists()


def test_an_empty_store_file_is_refused_not_given_a_schema(tmp_path, monkeypatch, capsys, caplog):
    """A 0-byte mlflow.db (a store whose creation was cut short) was silently given a fresh schema by the next run or
    report. Now a run refuses it, naming the file and the fix, and spools its record; a report says so and reads the
    recorded csv; the file stays as it was."""
    db = tmp_path / "mlflow.db"
    db.touch()
    uri = f"sqlite:///{db}"
    with pytest.raises(tracking.TrackingUnavailable, match=rf"{db} is an empty file \(0 bytes\).*rm {db}"):
        tracking.ensure_store(uri, "exp")
    rec = record()
    assert tracking.finish(rec, settings(uri, tmp_path / "spool"), tmp_path / "out") is None
    assert "empty file (0 bytes)" in caplog.text      # the run's [tracking] warning (harness/logs.py)
    assert (tmp_path / "spool" / f"{rec['record_id']}.json").is_file()
    with pytest.raises(tracking.TrackingUnavailable, match="empty file"):
        report.runs_from_store("static_batching", uri)
    assert report.main(["static_batching", "--uri", uri, "--source", "store", "--out", str(tmp_path / "r")]) == 2
    assert "[error] static_batching: the tracking store cannot be read" in capsys.readouterr().err
    assert db.stat().st_size == 0


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "onepass.harness", *args, "model=tiny-llama", "tracking=off"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache")})


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_output_folder_that_cannot_be_made_is_one_error_line(tmp_path, key):
    (tmp_path / "a_file").touch()
    r = cli(tmp_path, *(["-m"] if "sweep" in key else []), f"{key}={tmp_path}/a_file/out")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"[error] {key}={tmp_path}/a_file/out cannot be written: {tmp_path}/a_file is a file" in r.stderr
    assert "Traceback" not in r.stderr and "[verify]" not in r.stdout


def damaged(text: str) -> dict[str, bytes]:
    head, *rows = text.splitlines()
    cols = head.split(",")
    gone = cols.index("metrics.throughput_tok_s")
    drop = "\n".join(",".join(c for j, c in enumerate(line.split(",")) if j != gone) for line in text.splitlines())
    return {"missing a column": drop.encode(), "a garbage row": (text + "!!! not a run\n").encode(),
            "binary": bytes(range(256)) * 8, "empty": b""}


@pytest.mark.parametrize("case", ["missing a column", "a garbage row", "binary", "empty"])
def test_a_damaged_runs_csv_is_one_error_line(tmp_path, monkeypatch, capsys, case):
    recorded = (report.EXPERIMENTS / "static_batching" / "runs.csv").read_text()
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    csv = tmp_path / "experiments" / "static_batching" / "runs.csv"
    csv.parent.mkdir(parents=True)
    csv.write_bytes(damaged(recorded)[case])
    assert report.main(["static_batching", "--source", "csv", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("[error]") == 1 and "runs.csv" in err and ("record it again" in err or "delete" in err), err
    assert not (tmp_path / "r").exists()
