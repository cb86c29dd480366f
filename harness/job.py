"""What the app does with a composed config: check it whole, make the job its `job` node names (`_target_`), and
record every run the job yields, each as soon as it is measured."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import torch

from onepass.harness import tracking
from onepass.harness.isolate import isolated_runs
from onepass.harness.preflight import check_job
from onepass.harness.record import record_run, run_name, sweep_tags
from onepass.kernels.errors import ConfigError


@dataclass
class RunRecord:
    """One measured run: what the store gets besides the config."""

    name: str
    device: torch.device    # or its name (record.device_name), as a run measured in a process of its own comes
    metrics: dict
    tags: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)
    cfg: object = None      # the config logged as its params, where it is not the job's (int4_gemm: one per shape)


class Job(Protocol):
    """A job: `run` yields its measured runs. It may also have `check(cfg)` (what the config alone can refuse, run
    before any model loads) and `sections` (the config sections it reads, logged as its runs' params)."""

    def run(self, cfg) -> Iterator[RunRecord]: ...


def run_job(cfg, out_dir: Path) -> float:
    """Run the job `cfg.job` names and record its runs; returns the last run's throughput (the sweep's value). The
    config is checked whole first (harness/preflight.py); the job's run in the store opens when the job starts. With
    launch.isolate the job measures in a fresh process of its own (harness/isolate.py), and its runs are recorded
    here as they come."""
    start_ms = int(time.time() * 1000)
    job = check_job(cfg)
    if cfg.progress and not sys.stderr.isatty():   # a progress bar in a log file is noise
        cfg.progress = False
    name = run_name(cfg, cfg.table)
    live = tracking.LiveRun.open(cfg.tracking, name, sweep_tags(cfg), start_ms)
    last = 0.0
    runs = isolated_runs(cfg, f"job {cfg.job.name} ({name})") if cfg.launch.isolate else job.run(cfg)
    try:
        for r in runs:
            record_run(r.cfg if r.cfg is not None else cfg, r.name, r.device, r.metrics, r.tags, r.artifacts, out_dir,
                       live, getattr(job, "sections", None) if r.cfg is None else None)
            live = None   # a job's later runs are logged as runs of their own
            last = float(r.metrics.get("throughput_tok_s", last))
    except KeyboardInterrupt as e:
        if live is not None:
            live.close("KILLED")
            e.killed_run = live.run_id
        raise
    except ConfigError:   # bad input found once the job was under way (a prompt longer than ctx): not a run
        if live is not None:
            live.discard()
        raise
    except BaseException:
        if live is not None:
            live.close("FAILED")
        raise
    if live is not None:   # the job measured nothing
        live.close("FAILED")
    return last
