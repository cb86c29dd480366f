"""A `-m` sweep becomes one MLflow parent run with one child per job.

Before any job starts, every job of the sweep is composed and checked (harness/preflight.py): a mistake in the third
job stops the sweep before the first one measures. The parent is created next (which also creates the SQLite schema
once); its id reaches the jobs through an environment variable, so jobs in other processes (joblib, submitit) nest
under it too. When the sweep ends the parent gets the sweep's overrides as params, its multirun.yaml, the table
regenerated from its runs (and the plot) as artifacts, and summary metrics.
"""
from __future__ import annotations

import atexit
import os
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback

from onepass.harness.logs import log
from onepass.harness.preflight import check_folder, check_sweep, refuse, sweep_jobs, sweep_overrides
from onepass.harness.tracking import PARENT_ENV, SWEEP_ENV, SWEPT_ENV, absolute_uri, ensure_store, git_state, \
    standard_tags
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
        except ConfigError as e:
            refuse(str(e))
        os.environ[SWEPT_ENV] = ",".join(expanded[1]) if expanded else ""
        t = config.tracking
        sweep_id = uuid.uuid4().hex[:12]
        os.environ[SWEEP_ENV] = sweep_id
        if not t.enabled:
            return
        try:
            import mlflow
            from mlflow.entities import Param

            uri = absolute_uri(t.uri)
            exp_id = ensure_store(uri, t.experiment)
            client = mlflow.MlflowClient(tracking_uri=uri)
            run = client.create_run(exp_id, run_name=f"sweep {config.table}",
                                    tags={**standard_tags(), "table": config.table, "sweep_id": sweep_id,
                                          "onepass.kind": "sweep", **git_state()})
            overrides = [o.split("=", 1) for o in sweep_overrides(config) if "=" in o]
            client.log_batch(run.info.run_id,
                             params=[Param(k.lstrip("+~"), v[:6000]) for k, v in dict(overrides).items()])
        except Exception as e:  # jobs still run and spool their records
            log.warning(f"[tracking] no parent run for this sweep ({e}); jobs keep their records on disk")
            return
        self.parent, self.uri, self.sweep_id = run.info.run_id, uri, sweep_id
        os.environ[PARENT_ENV] = self.parent
        # on_multirun_end is skipped when a job raises past the sweep (Ctrl-C, or an error outside a job)
        atexit.register(lambda: self._close("KILLED" if _interrupted else "FAILED"))

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if job_return.status.name != "COMPLETED":
            self.failed += 1

    def on_multirun_end(self, config, **kwargs) -> None:
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

        mlflow.MlflowClient(tracking_uri=self.uri).set_terminated(self.parent, status=status)
        self.parent = None
        os.environ.pop(PARENT_ENV, None)
