"""A `-m` sweep becomes one MLflow parent run with one child per job.

Before any job starts, every job of the sweep is composed and checked (harness/preflight.py): a mistake in the third
job stops the sweep before the first one measures. The parent is created next (which also creates the SQLite schema
once). The sweep's ids travel inside this callback, which a launcher pickles into every job's process (joblib's loky
workers, submitit's jobs), and reach the job as environment variables when it starts there: a worker left from an
earlier sweep of the same process, or a SLURM job started without the sweep's environment, nests under the right
parent. A job in a process of its own also takes a GPU of the pool there (harness/gpu_pool.py). When the sweep ends the
parent gets the sweep's overrides as params, its multirun.yaml, the table regenerated from its runs (and the plot) as
artifacts, and summary metrics; a store gone by then gets the parent's end through the spool and `onepass-sync`.
"""
from __future__ import annotations

import atexit
import os
import time
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback

from onepass.harness import gpu_pool
from onepass.harness.environment import lock_hash, package_versions
from onepass.harness.logs import log
from onepass.harness.preflight import check_folder, check_launch, check_sweep, refuse, sweep_jobs, sweep_overrides
from onepass.harness.tracking import PARENT_ENV, SWEEP_ENV, SWEPT_ENV, absolute_uri, ensure_store, git_state, \
    new_record, save_record, standard_tags
from onepass.kernels.errors import ConfigError

_interrupted = False


def mark_interrupted() -> None:
    """A job was stopped by Ctrl-C: the sweep's parent run closes as KILLED, not FAILED."""
    global _interrupted
    _interrupted = True


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent: str | None = None
        self.uri: str | None = None
        self.failed = 0
        self.pid: int | None = None     # the sweep's process; None outside a sweep
        self.sweep_dir: Path | None = None
        self.sweep_id = self.swept = ""

    def on_run_start(self, config, **kwargs) -> None:
        # Hydra makes the run folder before the job starts, and a folder it cannot make was a traceback
        try:
            check_folder("hydra.run.dir", config.hydra.run.dir)
        except ConfigError as e:
            refuse(str(e))

    def on_multirun_start(self, config, **kwargs) -> None:
        try:
            expanded = sweep_jobs(config)
        except Exception:   # overrides Hydra cannot parse: its sweeper reports them, as it would without this check
            expanded = None
        try:
            check_folder("hydra.sweep.dir", config.hydra.sweep.dir)
            if expanded is not None:
                check_sweep(config, expanded[0])
            check_launch(config, len(expanded[0]) if expanded is not None else 1 << 30)
        except ConfigError as e:
            refuse(str(e))
        self.pid, self.sweep_dir = os.getpid(), Path(config.hydra.sweep.dir).absolute()
        self.swept = os.environ[SWEPT_ENV] = ",".join(expanded[1]) if expanded else ""
        t = config.tracking
        sweep_id = self.sweep_id = os.environ[SWEEP_ENV] = uuid.uuid4().hex[:12]
        if not t.enabled:
            return
        try:
            import mlflow
            from mlflow.entities import Param

            uri = absolute_uri(t.uri)
            exp_id = ensure_store(uri, t.experiment)
            client = mlflow.MlflowClient(tracking_uri=uri)
            # a record id as a job's run has, so that onepass-sync can end the parent when the store is gone by then
            record_id = uuid.uuid4().hex
            run = client.create_run(exp_id, run_name=f"sweep {config.table}",
                                    tags={**standard_tags(), "table": config.table, "sweep_id": sweep_id,
                                          "onepass.kind": "sweep", "onepass.record_id": record_id,
                                          "lock_hash": lock_hash(), **git_state()})
            overrides = [o.split("=", 1) for o in sweep_overrides(config) if "=" in o]
            client.log_batch(run.info.run_id,
                             params=[Param(k.lstrip("+~"), v[:6000]) for k, v in dict(overrides).items()])
            client.log_text(run.info.run_id, package_versions(), "environment.txt")
        except Exception as e:  # jobs still run and spool their records
            log.warning(f"[tracking] no parent run for this sweep ({e}); jobs keep their records on disk")
            return
        self.parent, self.uri, self.record_id = run.info.run_id, uri, record_id
        self.experiment, self.spool_dir, self.run_name = t.experiment, t.spool_dir, f"sweep {config.table}"
        self.start_ms = run.info.start_time
        os.environ[PARENT_ENV] = self.parent
        # on_multirun_end is skipped when a job raises past the sweep (Ctrl-C, or an error outside a job)
        atexit.register(lambda: self._close("KILLED" if _interrupted else "FAILED"))

    def on_job_start(self, config, **kwargs) -> None:
        """In the job's process, before the job: the sweep's ids from this callback, and a GPU of the pool where the
        job runs in a process of its own (a SLURM job has its GPUs from the scheduler)."""
        if self.pid is None:   # a single run
            return
        os.environ[SWEEP_ENV], os.environ[SWEPT_ENV] = self.sweep_id, self.swept
        if self.parent is not None:
            os.environ[PARENT_ENV] = self.parent
        else:
            os.environ.pop(PARENT_ENV, None)
        if self.uri is not None and self.uri.startswith(("http://", "https://")):
            # tracking=server reads MLFLOW_TRACKING_URI, which a job started elsewhere may lack
            os.environ.setdefault("MLFLOW_TRACKING_URI", self.uri)
        if self.uri is not None and config.tracking.enabled and (mine := absolute_uri(config.tracking.uri)) != self.uri:
            log.warning(f"[tracking] this job logs to {mine}, but its sweep's parent run is in {self.uri}: its run "
                        "will not nest under the parent; give every job the sweep's tracking.uri")
        if os.getpid() != self.pid and not os.environ.get("SLURM_JOB_ID") and config.engine.device != "cpu":
            gpu_pool.claim(gpu_pool.pool(config.launch.gpus), config.hydra.job.num, config.launch.share_gpus)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        # this runs in the job's process: a failure is told to the sweep's process by a file in the sweep's folder
        if job_return.status.name != "COMPLETED" and self.pid is not None:
            marks = self._failed_dir()
            marks.mkdir(parents=True, exist_ok=True)
            (marks / f"{self.sweep_id}.{config.hydra.job.num}").write_text(" ".join(job_return.overrides) + "\n")

    def _failed_dir(self) -> Path:
        return self.sweep_dir / ".failed_jobs"

    def on_multirun_end(self, config, **kwargs) -> None:
        self.failed = len(list(self._failed_dir().glob(f"{self.sweep_id}.*")))
        if self.parent is not None:
            try:
                self._summarize(config)
            except Exception as e:   # the runs are in the store whatever happens to the summary
                log.warning(f"[tracking] the sweep's parent run got no summary ({e})")
        self._close("FAILED" if self.failed else "FINISHED")

    def _summarize(self, config) -> None:
        """The sweep's outcome on its parent run: summary metrics, multirun.yaml, the regenerated table and plot."""
        import mlflow
        import pandas as pd
        from mlflow.entities import Metric

        from onepass.harness import report

        client = mlflow.MlflowClient(tracking_uri=self.uri)
        mlflow.set_tracking_uri(self.uri)
        runs = mlflow.search_runs(search_all_experiments=True,
                                  filter_string=f"tags.mlflow.parentRunId = '{self.parent}'")
        done = runs[runs["status"] == "FINISHED"] if not runs.empty else runs
        col = lambda name: pd.to_numeric(done[name], errors="coerce") if name in done else pd.Series(dtype=float)  # noqa: E731
        verified = done[col("metrics.verify_ok") == 1]
        summary = {"runs_finished": len(done), "runs_failed": self.failed,
                   "runs_verified": len(verified),
                   "runs_noisy": int((done["tags.noisy"] == "true").sum()) if "tags.noisy" in done else 0}
        if "metrics.throughput_tok_s" in verified and verified["metrics.throughput_tok_s"].notna().any():
            summary["best_throughput_tok_s"] = float(pd.to_numeric(verified["metrics.throughput_tok_s"]).max())
        client.log_batch(self.parent, metrics=[Metric(k, float(v), 0, 0) for k, v in summary.items()])
        sweep_dir = Path(config.hydra.sweep.dir)
        if (sweep_dir / "multirun.yaml").is_file():
            client.log_artifact(self.parent, str(sweep_dir / "multirun.yaml"))
        table = config.table
        if table in report.TABLES and not done.empty:
            df = report.runs_from_store(table, self.uri, sweep_id=self.sweep_id)
            if not df.empty:
                path = report.write_report(table, df, f"sweep {self.sweep_id} in {self.uri}", sweep_dir / "report")
                for made in (path, path.with_suffix(".png")):
                    if made.is_file():
                        client.log_artifact(self.parent, str(made), "report")
                log.info(f"[report] the sweep's table: {path}")

    def _close(self, status: str) -> None:
        if self.parent is None:
            return
        import mlflow

        parent, self.parent = self.parent, None
        os.environ.pop(PARENT_ENV, None)
        try:
            mlflow.MlflowClient(tracking_uri=self.uri).set_terminated(parent, status=status)
        except Exception as e:   # the store went away during the sweep
            path = self._spool_end(status)
            log.warning(f"[tracking] could not end the sweep's parent run {parent} ({e}): it stays RUNNING until "
                        f"`onepass-sync` logs its end, kept at {path} (its summary and table are not logged)")

    def _spool_end(self, status: str) -> Path:
        """The parent's end as a record in the spool: log_record finds the parent by its record id and ends it."""
        record = new_record(self.run_name, self.experiment, {}, {})
        record.update(record_id=self.record_id, parent_run_id=None, start_time_ms=self.start_ms, status=status,
                      end_time_ms=int(time.time() * 1000), tracking_uri=self.uri)
        if (self.sweep_dir / "multirun.yaml").is_file():
            record["artifacts"]["multirun.yaml"] = (self.sweep_dir / "multirun.yaml").read_text()
        path = Path(self.spool_dir) / f"{self.record_id}.json"
        save_record(record, path)
        return path
