"""The harness's messages go through `logging` (logger "onepass"), so Hydra's per-job log file holds them as well as
the terminal: conf/hydra/job_logging/onepass.yaml prints them plain (information on stdout, warnings and errors on
stderr) and writes them with their time to <output dir>/<job>.log."""
from __future__ import annotations

import logging

log = logging.getLogger("onepass")


class BelowWarning(logging.Filter):
    """Lets through what goes to stdout: records below WARNING (the rest go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING
