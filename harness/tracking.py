"""MLflow logging that never loses a measurement.

Every run's record (params, metrics, tags, artifacts) is written to disk first. It is then logged to
the tracking store; if the store cannot be reached, the record waits in the spool directory and
`onepass-sync` logs it later.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

from onepass.harness.logs import log

PARENT_ENV = "ONEPASS_PARENT_RUN_ID"
SWEEP_ENV = "ONEPASS_SWEEP_ID"
SWEPT_ENV = "ONEPASS_SWEPT_KEYS"   # the config keys a sweep varies, comma-separated: first in its runs' names
# Fail fast on an unreachable HTTP server instead of retrying for minutes.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class TrackingUnavailable(RuntimeError):
    pass


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = "" if v is None else str(v)[:6000]
    return out


def git_state() -> dict[str, str]:
    """Commit and dirty flag of the source tree. A tree copied without its history (a GPU machine that
    receives the working tree) records "unknown" unless ONEPASS_GIT_COMMIT names the commit."""
    if os.environ.get("ONEPASS_GIT_COMMIT"):
        return {"git_commit": os.environ["ONEPASS_GIT_COMMIT"],
                "git_dirty": os.environ.get("ONEPASS_GIT_DIRTY", "unknown")}
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    if head.returncode != 0 or status.returncode != 0:
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    return {"git_commit": head.stdout.strip(), "git_dirty": str(bool(status.stdout.strip())).lower()}


SQLITE = "sqlite:///"
# how long a process waits for another one creating the same SQLite store's schema
STORE_LOCK_S = 300


def sqlite_file(uri: str) -> Path | None:
    """The database file of a SQLite tracking URI (relative to the working folder where the URI is), else None."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def absolute_uri(uri: str) -> str:
    """uri with a relative SQLite path made absolute against the working folder: a record spooled here and synced from
    another folder still reaches this store."""
    db = sqlite_file(uri)
    return f"{SQLITE}{db.resolve()}" if db is not None and not db.is_absolute() else uri


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold a file lock beside a SQLite store: MLflow creates a fresh store's schema with migrations that two
    processes running at once break ("duplicate column name"), leaving one of them without its runs."""
    db = sqlite_file(uri)
    if db is None or not db.parent.is_dir():
        yield
        return
    lock = FileLock(f"{db}.lock", timeout=STORE_LOCK_S)
    try:
        lock.acquire()
    except Timeout:
        raise TrackingUnavailable(f"{uri}: another process held {db}.lock for {STORE_LOCK_S} s; if none is running, "
                                  f"delete {db}.lock") from None
    try:
        yield
    finally:
        lock.release()


def check_reachable(uri: str) -> None:
    """Raise TrackingUnavailable with the reason when the store cannot take a run."""
    if (db := sqlite_file(uri)) is not None:
        parent = db.parent if str(db.parent) else Path(".")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise TrackingUnavailable(f"{uri}: directory {parent} does not exist or is not writable")
        # SQLite takes an empty file for an empty database and MLflow would give it a schema; an empty file where the
        # store should be is one whose creation was cut short (or a path typed wrong), so it is refused, not filled
        if db.is_file() and db.stat().st_size == 0:
            raise TrackingUnavailable(f"{db.resolve()} is an empty file (0 bytes), not an MLflow store: its creation "
                                      f"was cut short, or the path is wrong. Delete it (rm {db}) to start a new store "
                                      "there, or point tracking.uri (onepass-report --uri) at the store you meant")
        return
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                if r.status != 200:
                    raise TrackingUnavailable(f"{uri}: /health answered {r.status}")
        except OSError as e:
            raise TrackingUnavailable(f"{uri}: cannot connect ({e})") from e


def ensure_store(uri: str, experiment: str) -> str:
    """Create the store's schema and the experiment once; returns the experiment id. The first access of a SQLite
    store (which creates its schema) holds the store's file lock, so sweeps started together each get their runs."""
    import mlflow

    with store_lock(uri):
        check_reachable(uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return client.create_experiment(experiment)
        except Exception:  # another process created it between our look and our create
            return client.get_experiment_by_name(experiment).experiment_id


def new_record(run_name: str, experiment: str, params: dict, tags: dict, live: LiveRun | None = None
               ) -> dict[str, Any]:
    """A run's record; with `live`, the record of the run opened at its job's start (its id and start time)."""
    return {"record_id": live.record_id if live else uuid.uuid4().hex, "run_name": run_name, "experiment": experiment,
            "parent_run_id": os.environ.get(PARENT_ENV), "params": params, "tags": tags, "metrics": {},
            "artifacts": {}, "start_time_ms": live.start_ms if live else int(time.time() * 1000), "status": "RUNNING"}


_STANDARD: dict[str, str] = {}


def standard_tags() -> dict[str, str]:
    """MLflow's own source and git tags (user, entry point, commit, branch, repository), which its UI shows."""
    if not _STANDARD:
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT, MLFLOW_GIT_REPO_URL

        _STANDARD.update(resolve_tags())
        root = Path(__file__).resolve().parents[1]
        for tag, args in ((MLFLOW_GIT_BRANCH, ["rev-parse", "--abbrev-ref", "HEAD"]),
                          (MLFLOW_GIT_REPO_URL, ["config", "--get", "remote.origin.url"])):
            try:
                out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.SubprocessError):
                continue
            if out.returncode == 0 and out.stdout.strip():
                _STANDARD[tag] = out.stdout.strip()
        if (commit := git_state()["git_commit"]) != "unknown":
            _STANDARD[MLFLOW_GIT_COMMIT] = commit
    return dict(_STANDARD)


# MLflow's system metrics (CPU, memory, disk, network, GPU) while a job runs, a point a second (a job of seconds
# still gets its curve; MLflow batches the writes)
SYSTEM_SAMPLE_S, SYSTEM_SAMPLES_PER_LOG = 1.0, 1


class LiveRun:
    """A job's run in the store from the job's start, so the run's times are the job's and MLflow's system metrics
    are sampled while it runs. The job's record is logged into it once measured (log_record finds it by its
    `onepass.record_id`); a job stopped or failed before that closes it KILLED or FAILED."""

    def __init__(self, uri: str, run_id: str, record_id: str, start_ms: int, monitor):
        self.uri, self.run_id, self.record_id, self.start_ms, self.monitor = uri, run_id, record_id, start_ms, monitor

    @classmethod
    def open(cls, tracking_cfg, name: str, tags: dict[str, str], start_ms: int) -> LiveRun | None:
        """The run of a job that started at start_ms. None where tracking is off or the store cannot be reached: the
        record is then logged (or spooled) when measured, as a run of its measuring time alone."""
        if not tracking_cfg.enabled:
            return None
        import mlflow
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        from onepass.harness.environment import lock_hash

        uri, record_id = absolute_uri(tracking_cfg.uri), uuid.uuid4().hex
        tags = {**standard_tags(), "onepass.record_id": record_id, "lock_hash": lock_hash(), **tags}
        if os.environ.get(PARENT_ENV):
            tags[MLFLOW_PARENT_RUN_ID] = os.environ[PARENT_ENV]
        try:
            exp = ensure_store(uri, tracking_cfg.experiment)
            run = mlflow.MlflowClient(tracking_uri=uri).create_run(exp, start_time=start_ms, run_name=name, tags=tags)
        except Exception as e:
            log.warning(f"[tracking] no run opened at the job's start ({e}); its record is logged or spooled when "
                        "measured")
            return None
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)   # its start and stop lines are noise
        monitor = SystemMetricsMonitor(run.info.run_id, sampling_interval=SYSTEM_SAMPLE_S,
                                       samples_before_logging=SYSTEM_SAMPLES_PER_LOG, tracking_uri=uri)
        monitor.start()
        return cls(uri, run.info.run_id, record_id, run.info.start_time, monitor)

    def stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None

    def discard(self) -> None:
        """Delete a run whose job was refused once under way: bad input is not a run, and no table should count it."""
        import mlflow

        self.stop_monitor()
        try:
            mlflow.MlflowClient(tracking_uri=self.uri).delete_run(self.run_id)
        except Exception as e:
            log.warning(f"[tracking] could not delete run {self.run_id} of a refused job ({e})")

    def close(self, status: str) -> None:
        """End a run that got no record (the job was stopped or failed before it measured)."""
        import mlflow

        self.stop_monitor()
        try:
            mlflow.MlflowClient(tracking_uri=self.uri).set_terminated(self.run_id, status=status)
        except Exception as e:   # the store went away: the run stays RUNNING there, nothing measured is lost
            log.warning(f"[tracking] could not mark run {self.run_id} {status} ({e})")


def with_environment(record: dict) -> dict:
    """The record with what it was made with: every package's version (environment.txt), the lock file's hash, and
    the GPU its process was given where a sweep's launcher gave it one (harness/gpu_pool.py)."""
    from onepass.harness.environment import lock_hash, package_versions

    record["tags"].setdefault("lock_hash", lock_hash())
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        record["tags"].setdefault("cuda_visible_devices", os.environ["CUDA_VISIBLE_DEVICES"])
    record["artifacts"].setdefault("environment.txt", package_versions())
    return record


def save_record(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)


def log_record(record: dict, uri: str, ends_now: bool = False) -> str:
    """Log one finished record as an MLflow run (child of its sweep's parent when it has one). ends_now: the record
    is its job's last act, and the run ends when it is logged (else at the record's end time)."""
    import mlflow
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    exp_id = ensure_store(uri, record["experiment"])
    client = mlflow.MlflowClient(tracking_uri=uri)
    # logging is several calls: one cut short (the store went away, the process was killed) leaves a run that never
    # terminated, and the record is logged again later. A complete run of this record is kept and not repeated; an
    # incomplete one (the run opened at the job's start, or one cut short) is completed, and any other deleted, so
    # the store never holds the record twice (a table would show its row twice)
    runs = client.search_runs([exp_id], f"tags.`onepass.record_id` = '{record['record_id']}'")
    for old in runs:
        if old.info.status == record["status"] and old.info.end_time:
            return old.info.run_id
    for old in runs[1:]:
        client.delete_run(old.info.run_id)
    tags = {MLFLOW_RUN_NAME: record["run_name"], "onepass.record_id": record["record_id"], **record["tags"]}
    if record.get("parent_run_id"):
        tags[MLFLOW_PARENT_RUN_ID] = record["parent_run_id"]
    if runs:
        rid, have = runs[0].info.run_id, runs[0].data
        client.log_batch(rid, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    else:
        rid = client.create_run(exp_id, start_time=record["start_time_ms"], tags=tags,
                                run_name=record["run_name"]).info.run_id
        have = None
    now = int(time.time() * 1000)
    params = [Param(k, v) for k, v in record["params"].items() if have is None or k not in have.params]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    metrics = [Metric(k, shown(v), now, 0) for k, v in record["metrics"].items()
               if have is None or k not in have.metrics]
    client.log_batch(rid, metrics=metrics)
    for name, content in record["artifacts"].items():
        if isinstance(content, str):
            client.log_text(rid, content, name)
        else:
            client.log_dict(rid, content, name)
    from onepass.harness.figures import step_times_figure

    if (fig := step_times_figure(record)) is not None:   # the per-step times read better as a plot
        client.log_figure(rid, fig, "step_times.png")
    end = int(time.time() * 1000) if ends_now else record.get("end_time_ms", now)
    client.set_terminated(rid, status=record["status"], end_time=end)
    return rid


def shown(v) -> float:
    """A metric as the store shows it: 5 significant digits (the run record on disk keeps every digit)."""
    v = float(v)
    return float(f"{v:.5g}") if v == v and abs(v) != float("inf") else v


def finish(record: dict, tracking_cfg, out_dir: Path, live: LiveRun | None = None) -> str | None:
    """Persist the record beside the run's outputs and in the spool, log it, and only then take it out of the spool:
    a run cut short while it is logged (Ctrl-C, the store gone) leaves its whole record for `onepass-sync`, which
    replaces the partial run. A Ctrl-C here carries `.spooled` (the spool file, or None) for the message."""
    if live is not None:   # its system metrics end with the job
        live.stop_monitor()
    record.setdefault("end_time_ms", int(time.time() * 1000))
    with_environment(record)
    spooled = None
    try:
        save_record(record, out_dir / "run_record.json")
        if not tracking_cfg.enabled:
            return None
        record["tracking_uri"] = absolute_uri(tracking_cfg.uri)
        path = Path(tracking_cfg.spool_dir) / f"{record['record_id']}.json"
        save_record(record, path)
        spooled = path
        try:
            rid = log_record(record, record["tracking_uri"], ends_now=live is not None)
        except Exception as e:
            log.warning(f"[tracking] could not log to {tracking_cfg.uri}: {e}\n"
                        f"[tracking] the run's record is kept at {spooled}; log it later with: onepass-sync")
            return None
        spooled.unlink(missing_ok=True)
        spooled = None
    except KeyboardInterrupt as e:
        e.spooled = spooled
        raise
    log.info(f"[tracking] logged run {rid} to {tracking_cfg.uri} (experiment {record['experiment']})")
    return rid


def sync(spool_dir: Path, uri: str | None) -> tuple[int, int]:
    """Log every spooled record; each one logged is removed from the spool. Returns (logged, left)."""
    logged = left = 0
    if not spool_dir.is_dir():
        print(f"[sync] no spool folder at {spool_dir}: nothing to log (runs spool to tracking.spool_dir)",
              file=sys.stderr)
        return 0, 0
    for path in sorted(spool_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:   # one unreadable file must not keep the others from the store
            print(f"[sync] {path.name}: not a readable run record ({e}); left in place", file=sys.stderr)
            left += 1
            continue
        target = uri or record.get("tracking_uri")
        try:
            rid = log_record(record, target)
        except Exception as e:
            print(f"[sync] {path.name}: still cannot log to {target}: {e}", file=sys.stderr)
            left += 1
            continue
        path.unlink()
        logged += 1
        print(f"[sync] {path.name} -> run {rid} in {target}")
    return logged, left


def sync_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Log run records that could not reach the tracking store.")
    ap.add_argument("--spool", default=".onepass/spool")
    ap.add_argument("--uri", default=None, help="tracking URI (default: the one each record was meant for)")
    args = ap.parse_args(argv)
    logged, left = sync(Path(args.spool), args.uri)
    print(f"[sync] logged {logged}, left {left}")
    return 1 if left else 0
