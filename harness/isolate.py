"""launch.isolate=true: a job measured in a fresh process of its own, as optimum-benchmark runs each benchmark, so that
one job's allocator caches, compiled kernels, CUDA context and peak-memory counters never carry into the next job of a
sweep, and the job's host memory (harness/usage.py) is its process's alone.

The child is a new interpreter (this one, `python -c`), not a fork (which would inherit this process's CUDA context
and allocator) nor multiprocessing's "spawn" (which runs the caller's main script again in the child: a script without
an `if __name__ == "__main__"` guard would start its sweep there). It gets this process's sys.path and the config over
a socket, makes the job and runs it; each run it yields comes back as soon as it is measured, and this process records
it as it records a run measured in process (harness/job.py). Its log records come back too (Hydra's handlers, the
job's log file among them, are this process's). An exception in the child comes back with its traceback and the job
named; a child that ends without a word (a signal: the out-of-memory killer's SIGKILL) is said as such; this process
stopped (Ctrl-C, SIGTERM, a failed recording) stops the child first.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Iterator

from omegaconf import OmegaConf

from onepass.kernels.errors import OnepassError

STOP_S = 10.0   # how long a child told to stop may take before it is killed


class JobProcessError(RuntimeError):
    """A job's own process failed: an exception in it (its traceback in the message) or an end without one."""


def isolated_runs(cfg, job: str) -> Iterator:
    """The runs (RunRecord) of the job `cfg.job` names, measured in a fresh process; `job` names it in errors."""
    mine, theirs = socket.socketpair()
    conn = Connection(mine.detach())
    with theirs:   # closed here once the child has it: the child's end, however it comes, ends the socket
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    where = f"{job} in its own process (pid {child.pid})"
    done = False
    try:
        conn.send(sys.path)   # first, alone: unpickling the config may import what only this path finds
        conn.send((_resolved(cfg), _levels()))
        while not done:
            try:
                kind, value = conn.recv()
            except EOFError:
                break
            if kind == "run":
                yield value
            elif kind == "log":
                logging.getLogger(value.name).handle(value)
            elif kind == "error":
                raise _raised(value, where)
            else:
                done = True
    except ConnectionError:   # it ended before it took its config, or with a message half sent
        pass
    finally:   # finished, failed, or stopped here (Ctrl-C, or the recording failed): no child outlives its job
        _end(child, wait=done)
        conn.close()
    if not done:
        raise JobProcessError(f"{where} ended before its job finished: {_how(child.returncode)}")


def _resolved(cfg):
    """The config with every interpolation resolved here: ${hydra:...} has no Hydra in the child."""
    cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(cfg)
    return cfg


def _levels() -> dict[str, int]:
    """The levels this process's loggers are set at (Hydra's job_logging): the child drops what they would."""
    loggers = logging.root.manager.loggerDict.items()
    return {"": logging.root.level, **{name: lg.level for name, lg in loggers
                                        if isinstance(lg, logging.Logger) and lg.level}}


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        why = " (SIGKILL is also how the out-of-memory killer ends a process)" if -code == signal.SIGKILL else ""
        return f"it was killed by signal {name}{why}"
    return f"it exited with status {code} without a result"


def _raised(payload: dict, where: str) -> BaseException:
    """The child's exception as this process raises it: a Ctrl-C as a Ctrl-C, bad input (OnepassError) as its own
    class with the job named, anything else as a JobProcessError holding the child's traceback."""
    try:
        e = pickle.loads(payload["pickled"]) if payload["pickled"] else None
    except Exception:   # an exception class that does not unpickle: its text still comes through
        e = None
    if isinstance(e, KeyboardInterrupt):
        return e
    if isinstance(e, OnepassError):
        try:
            return type(e)(f"{where}: {e}")
        except Exception:   # an error class made with other arguments than its message
            pass
    return JobProcessError(f"{where} raised {payload['type']}: {payload['message']}\n"
                           f"the child's traceback:\n{payload['traceback']}")


def _end(child: subprocess.Popen, wait: bool) -> None:
    """Wait for a child that said it is done; stop one that is not (SIGTERM, then SIGKILL after STOP_S)."""
    for stop in ((lambda: None) if wait else child.terminate, child.terminate, child.kill):
        if child.poll() is not None:
            return
        stop()
        try:
            child.wait(STOP_S)
        except subprocess.TimeoutExpired:
            pass


class _Forward(logging.Handler):
    """The child's log records, sent to the parent whole (their text made here: their args may not pickle)."""

    def __init__(self, send):
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record = copy.copy(record)
            record.msg, record.args = self.format(record), None
            record.exc_info = record.exc_text = record.stack_info = None
            self.send("log", record)
        except Exception:
            self.handleError(record)


CHILD = "from onepass.harness.isolate import child_main; child_main()"


def child_main() -> None:
    """The job's process (`python -c CHILD <socket fd>`): every run its job yields sent as it comes, then "done"; or
    the exception that stopped it."""
    conn = Connection(int(sys.argv[1]))
    lock = threading.Lock()   # the usage sampler's thread may log while a run is sent

    def send(kind: str, value) -> None:
        with lock:
            conn.send((kind, value))

    for stream in (sys.stdout, sys.stderr):   # a job's prints in order with the parent's lines, even into a pipe
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    logging.root.handlers[:] = [_Forward(send)]
    try:
        sys.path[:] = conn.recv()
        cfg, levels = conn.recv()
        for name, level in levels.items():
            logging.getLogger(name or None).setLevel(level)
        from hydra.utils import instantiate

        from onepass.harness.record import device_name

        for r in instantiate(cfg.job).run(cfg):
            # the device named here: a GPU's name would start CUDA in the parent
            send("run", dataclasses.replace(r, device=device_name(r.device)))
        send("done", None)
    except BaseException as e:   # a Ctrl-C too: the parent raises it as its own
        try:
            pickled = pickle.dumps(e)
        except Exception:
            pickled = None
        send("error", {"type": type(e).__name__, "message": str(e), "pickled": pickled,
                       "traceback": "".join(traceback.format_exception(e))})
    finally:
        conn.close()
