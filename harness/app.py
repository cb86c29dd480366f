"""The Hydra app: `onepass [overrides]` (or `python -m onepass.harness`), `onepass -m ...` for a sweep."""
from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from onepass.kernels.errors import OnepassError
from onepass.harness.callbacks import mark_interrupted
from onepass.harness.logs import log
from onepass.harness.schema import register

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the checkout's conf/, or the installed onepass/conf
register()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg) -> float:
    from onepass.harness.job import run_job

    # SIGTERM (kill, a batch scheduler's stop) ends a job as Ctrl-C does: the sweep's parent run is closed as KILLED
    # and the finished jobs keep their runs; left at its default it would kill the process with the parent RUNNING
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
    hc = HydraConfig.get()
    try:
        return run_job(cfg, Path(hc.runtime.output_dir))
    except OnepassError as e:
        if hc.mode == RunMode.MULTIRUN:
            raise  # the sweep reports it for this job and runs the others
        log.error(f"[error] {e}")
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        mark_interrupted()
        log.error(interrupted_line(e, hc.job.num if hc.mode == RunMode.MULTIRUN else None))
        sys.exit(128 + (signal.SIGTERM if e.args == ("SIGTERM",) else signal.SIGINT))


def interrupted_line(e: KeyboardInterrupt, job: int | None) -> str:
    """What a stop left behind, said as it is: a stop while a measured run was being logged leaves its whole record
    in the spool (harness/tracking.py finish sets `spooled`), and maybe a partial run that `onepass-sync` replaces."""
    sweep = (" and the sweep stops: its parent run is marked KILLED, the jobs that finished keep their runs"
             if job is not None else "")
    what = "the run" if job is None else f"job {job}"
    spooled = getattr(e, "spooled", None)
    if spooled is not None:
        return (f"[interrupted] {what} stopped while its measured run was being logged{sweep}; its whole record is "
                f"kept at {spooled}, and `onepass-sync` logs it (replacing the partly logged run, if the store holds "
                "one)")
    killed = getattr(e, "killed_run", None)   # the job's run, opened when it started (harness/job.py)
    if job is not None:
        marked = "; its run is marked KILLED" if killed else ""
        return f"[interrupted] {what} stopped before it was recorded{marked}{sweep}"
    if killed:
        return (f"[interrupted] the run stopped before it was recorded: its run {killed} in the store is marked "
                "KILLED, with nothing measured")
    return "[interrupted] the run stopped before it was recorded: nothing was logged"


if __name__ == "__main__":
    main()
