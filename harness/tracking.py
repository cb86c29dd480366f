"""MLflow logging that never loses a measurement.

Every run's record (params, metrics, tags, artifacts) is written to disk first. It is then logged to
the tracking store; if the store cannot be reached, the record waits in the spool directory and
`onepass-sync` logs it later.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

PARENT_ENV = "ONEPASS_PARENT_RUN_ID"
SWEEP_ENV = "ONEPASS_SWEEP_ID"
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


def check_reachable(uri: str) -> None:
    """Raise TrackingUnavailable with the reason when the store cannot take a run."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        parent = db.parent if str(db.parent) else Path(".")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise TrackingUnavailable(f"{uri}: directory {parent} does not exist or is not writable")
        return
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                if r.status != 200:
                    raise TrackingUnavailable(f"{uri}: /health answered {r.status}")
        except OSError as e:
            raise TrackingUnavailable(f"{uri}: cannot connect ({e})") from e


def ensure_store(uri: str, experiment: str) -> str:
    """Create the store's schema and the experiment once; returns the experiment id.

    Called before a sweep's jobs start: parallel jobs racing on a fresh SQLite schema all fail.
    """
    import mlflow

    check_reachable(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(experiment)
    except Exception:  # another process created it between our look and our create
        return client.get_experiment_by_name(experiment).experiment_id


def new_record(run_name: str, experiment: str, params: dict, tags: dict) -> dict[str, Any]:
    return {"record_id": uuid.uuid4().hex, "run_name": run_name, "experiment": experiment,
            "parent_run_id": os.environ.get(PARENT_ENV), "params": params, "tags": tags, "metrics": {},
            "artifacts": {}, "start_time_ms": int(time.time() * 1000), "status": "RUNNING"}


def save_record(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)


def log_record(record: dict, uri: str) -> str:
    """Log one finished record as an MLflow run (child of its sweep's parent when it has one)."""
    import mlflow
    from mlflow.entities import Metric, Param
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    exp_id = ensure_store(uri, record["experiment"])
    client = mlflow.MlflowClient(tracking_uri=uri)
    # logging is several calls: one cut short (the store went away, the process was killed) leaves a run that never
    # terminated, and the record is logged again later. A complete run of this record is kept and not repeated; a
    # partial one is deleted, so the store never holds the record twice (a table would show its row twice)
    for old in client.search_runs([exp_id], f"tags.`onepass.record_id` = '{record['record_id']}'"):
        if old.info.status == record["status"] and old.info.end_time:
            return old.info.run_id
        client.delete_run(old.info.run_id)
    tags = {MLFLOW_RUN_NAME: record["run_name"], "onepass.record_id": record["record_id"], **record["tags"]}
    if record.get("parent_run_id"):
        tags[MLFLOW_PARENT_RUN_ID] = record["parent_run_id"]
    run = client.create_run(exp_id, start_time=record["start_time_ms"], tags=tags, run_name=record["run_name"])
    rid = run.info.run_id
    now = int(time.time() * 1000)
    params = [Param(k, v) for k, v in record["params"].items()]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in record["metrics"].items()])
    for name, content in record["artifacts"].items():
        if isinstance(content, str):
            client.log_text(rid, content, name)
        else:
            client.log_dict(rid, content, name)
    client.set_terminated(rid, status=record["status"], end_time=record.get("end_time_ms", now))
    return rid


def finish(record: dict, tracking_cfg, out_dir: Path) -> str | None:
    """Persist the record beside the run's outputs, then log it; spool it if the store is unreachable."""
    record.setdefault("end_time_ms", int(time.time() * 1000))
    save_record(record, out_dir / "run_record.json")
    if not tracking_cfg.enabled:
        return None
    try:
        check_reachable(tracking_cfg.uri)
        rid = log_record(record, tracking_cfg.uri)
        print(f"[tracking] logged run {rid} to {tracking_cfg.uri} (experiment {record['experiment']})")
        return rid
    except Exception as e:
        spooled = Path(tracking_cfg.spool_dir) / f"{record['record_id']}.json"
        record["tracking_uri"] = tracking_cfg.uri
        save_record(record, spooled)
        print(f"[tracking] could not log to {tracking_cfg.uri}: {e}\n"
              f"[tracking] the run's record is kept at {spooled}; log it later with: onepass-sync --uri <store>",
              file=sys.stderr)
        return None


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
