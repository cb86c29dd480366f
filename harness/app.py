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
        print(f"[error] {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: a job records its run when it ends, so this one has none
        mark_interrupted()
        if hc.mode == RunMode.MULTIRUN:
            print(f"[interrupted] job {hc.job.num} stopped before it was recorded, and the sweep stops: its parent run "
                  "is marked KILLED, the jobs that finished keep their runs", file=sys.stderr)
        else:
            print("[interrupted] the run stopped before it was recorded: nothing was logged", file=sys.stderr)
        sys.exit(128 + (signal.SIGTERM if e.args == ("SIGTERM",) else signal.SIGINT))


if __name__ == "__main__":
    main()
