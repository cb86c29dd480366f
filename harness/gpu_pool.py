"""Which GPU a sweep's job runs on when jobs run side by side (hydra/launcher=joblib, submitit_local).

The pool is `launch.gpus`, else the GPUs the sweep's process sees (CUDA_VISIBLE_DEVICES, else every card NVML counts);
on a machine without a GPU it is empty and nothing is set. A job running in a process of its own takes one device of
the pool before anything initialises CUDA and sets CUDA_VISIBLE_DEVICES to it. The device is held by a file lock for
the life of the process: a joblib (loky) worker runs several jobs and its CUDA context stays on the card its first job
took, so the claim is the worker's, not the job's; the lock goes when the process ends, however it ends. Two processes
never hold one device unless launch.share_gpus=true, and then only when every device is held.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from filelock import FileLock, Timeout

from onepass.harness.logs import log
from onepass.kernels.errors import ConfigError

LOCK_ENV = "ONEPASS_GPU_LOCK_DIR"   # where the devices' lock files live; one folder per host (default: the temp dir)
WAIT_S = 2.0                        # how often a job that found every device held looks again

_held: tuple[str, FileLock | None] | None = None   # this process's device and its lock (None: shared, not held)


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_ENV) or Path(tempfile.gettempdir()) / "onepass-gpus")


def pool(gpus) -> list[str]:
    """The devices jobs are given, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    if gpus:
        devices = [str(g).strip() for g in gpus]
        for d in devices:
            if not d or "," in d:
                raise ConfigError(f"launch.gpus has the entry {d!r}; give one device per entry, as "
                                  "CUDA_VISIBLE_DEVICES names it: launch.gpus=[0,1] or launch.gpus=[GPU-<uuid>,...]")
        if len(set(devices)) < len(devices):
            raise ConfigError(f"launch.gpus={devices} names a device twice: two jobs would share it; list each once "
                              "(launch.share_gpus=true lets jobs share when there are more jobs than devices)")
        return devices
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:   # CUDA stops at the first entry it cannot use ("-1" or "" hide every GPU)
        out = []
        for d in (d.strip() for d in visible.split(",")):
            if not d or d.startswith("-"):
                break
            out.append(d)
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:   # no pynvml or no driver: a machine without a GPU
        return []


def _lock(device: str) -> FileLock:
    folder = lock_dir()
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        try:   # one folder for every user's jobs on the host; sticky, so none removes another's lock files
            folder.chmod(0o1777)
        except OSError:
            pass
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
    return FileLock(folder / f"gpu-{name}.lock", timeout=0, mode=0o666)


def claim(devices: list[str], job_num: int, share: bool) -> str | None:
    """Take a device of `devices` for this process and set CUDA_VISIBLE_DEVICES to it; the device, or None when the
    pool is empty. Tried from the job's own turn (job_num modulo the pool) so jobs spread over the pool. With every
    device held: share=True takes the job's own turn without a lock; else the job waits until a device is free."""
    global _held
    if _held is not None:   # a worker's later job: its CUDA context (if any) is on this device already
        return _held[0]
    if not devices:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.warning("[launch] CUDA was initialised in this process before its job took a device: "
                    "CUDA_VISIBLE_DEVICES set now has no effect")
    turn = job_num % len(devices)
    order = devices[turn:] + devices[:turn]
    waiting = False
    while True:
        for device in order:
            lock = _lock(device)
            try:
                lock.acquire()
            except Timeout:
                continue
            _held = (device, lock)
            break
        else:
            if share:
                _held = (order[0], None)
            elif not waiting:
                log.info(f"[launch] job {job_num} waits for a GPU: every device of the pool ({','.join(devices)}) is "
                         f"held by another job (lock files in {lock_dir()}); launch.share_gpus=true would share one")
                waiting = True
        if _held is not None:
            break
        time.sleep(WAIT_S)
    os.environ["CUDA_VISIBLE_DEVICES"] = _held[0]
    how = "shared with another job" if _held[1] is None else "its own"
    log.info(f"[launch] job {job_num} runs on GPU {_held[0]} ({how}): CUDA_VISIBLE_DEVICES={_held[0]}")
    return _held[0]

