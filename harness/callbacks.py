"""A `-m` sweep becomes one MLflow parent run with one child per job.

The parent is created before any job starts (which also creates the SQLite schema once, before
parallel jobs could race on it); its id reaches the jobs through an environment variable, so jobs in
other processes (joblib, submitit) nest under it too.
"""
from __future__ import annotations

import atexit
import os
import sys
import uuid

from hydra.experimental.callback import Callback

from onepass.harness.tracking import PARENT_ENV, SWEEP_ENV, ensure_store, git_state


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

    def on_multirun_start(self, config, **kwargs) -> None:
        t = config.tracking
        sweep_id = uuid.uuid4().hex[:12]
        os.environ[SWEEP_ENV] = sweep_id
        if not t.enabled:
            return
        try:
            import mlflow

            exp_id = ensure_store(t.uri, t.experiment)
            client = mlflow.MlflowClient(tracking_uri=t.uri)
            run = client.create_run(exp_id, run_name=f"sweep {config.table}",
                                    tags={"table": config.table, "sweep_id": sweep_id, "onepass.kind": "sweep",
                                          **git_state()})
        except Exception as e:  # jobs still run and spool their records
            print(f"[tracking] no parent run for this sweep ({e}); jobs keep their records on disk", file=sys.stderr)
            return
        self.parent, self.uri = run.info.run_id, t.uri
        os.environ[PARENT_ENV] = self.parent
        # on_multirun_end is skipped when a job raises past the sweep (Ctrl-C, or an error outside a job)
        atexit.register(lambda: self._close("KILLED" if _interrupted else "FAILED"))

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if job_return.status.name != "COMPLETED":
            self.failed += 1

    def on_multirun_end(self, config, **kwargs) -> None:
        self._close("FAILED" if self.failed else "FINISHED")

    def _close(self, status: str) -> None:
        if self.parent is None:
            return
        import mlflow

        mlflow.MlflowClient(tracking_uri=self.uri).set_terminated(self.parent, status=status)
        self.parent = None
        os.environ.pop(PARENT_ENV, None)
