"""Stand-in jobs (no model) for tests/test_isolate.py, in a module of their own: the job's process imports this, not
the test module and everything it imports."""
import os
import signal

import torch

from onepass.harness.job import RunRecord
from onepass.harness.logs import log
from onepass.kernels.errors import ConfigError


class PidJob:
    """Two runs carrying the pid of the process that measured them, and a warning logged there."""

    def __init__(self, name: str = "pid"):
        self.name = name

    def run(self, cfg):
        log.warning(f"[stand-in] measuring in pid {os.getpid()}")
        for i in range(2):
            yield RunRecord(f"pid {i}", torch.device("cpu"), {"pid": float(os.getpid()), "i": float(i)})


class FailingJob:
    """Fails as its name says: bad input (config), a bug, or killed by a signal (kill)."""

    def __init__(self, name: str):
        self.name = name

    def run(self, cfg):
        if self.name == "config":
            raise ConfigError("micro.n=0: give micro.n >= 1")
        if self.name == "bug":
            raise ValueError("a bug in the job")
        os.kill(os.getpid(), signal.SIGKILL)
        yield
