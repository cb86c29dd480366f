"""The noise guard: was a measurement disturbed? Other processes busy on the CPU while it ran (psutil: the machine's
busy CPU time less this process tree's, the load average less this process's own use), other processes or clock
slowdowns on its GPU (NVML, sampled by harness/usage.py), or a spread of its repeats beyond the threshold. A disturbed
run is tagged noisy with the reason; `onepass-report --record` refuses it unless asked."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil


def _busy_s(t) -> float:
    """Seconds of CPU time spent busy (everything but idle and I/O wait) in psutil.cpu_times()."""
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _cpu_s(p: psutil.Process) -> float:
    """CPU seconds of p, and of its children that ended and were waited for (a job's own helper process, such as
    the HTTP benchmark's driver, is the job's work, not contention)."""
    try:
        t = p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0


@dataclass
class Contention:
    """Other processes' CPU use over a window, in cores; the busiest of them by name."""

    other_cores: float
    own_cores: float
    load: float                # the 1-minute load average at the window's end
    cores: int
    busiest: list[tuple[int, str, float]] = field(default_factory=list)   # (pid, name, cores)

    def reasons(self, max_other_cpu: float) -> list[str]:
        out = []
        if self.other_cores > max_other_cpu:
            who = ", ".join(f"{name} (pid {pid}) {c:.1f}" for pid, name, c in self.busiest[:3])
            out.append(f"other processes used {self.other_cores:.1f} of {self.cores} CPU cores"
                       + (f": {who}" if who else ""))
        # the load average counts this job's own threads; what is left above the core count waited for a core
        if self.load - self.own_cores > self.cores:
            out.append(f"load average {self.load:.1f} (this job {self.own_cores:.1f}) above {self.cores} cores")
        return out


class CpuWindow:
    """`with CpuWindow() as w: ...` then w.result: who else used the CPU while the block ran."""

    def __enter__(self) -> CpuWindow:
        self.t0, self.sys0 = time.monotonic(), _busy_s(psutil.cpu_times())
        own = _own()
        self.own0 = {p.pid: _cpu_s(p) for p in own}
        self.others0 = {}
        for p in psutil.process_iter(["name"]):
            if p.pid not in self.own0:
                self.others0[p.pid] = (p.info["name"], _cpu_s(p))
        self.result: Contention | None = None
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.monotonic() - self.t0, 1e-6)
        sys_busy = _busy_s(psutil.cpu_times()) - self.sys0
        own = _own()
        own_s = sum(_cpu_s(p) - self.own0.get(p.pid, 0.0) for p in own)
        own_pids = {p.pid for p in own}
        busiest = []
        for pid, (name, s0) in self.others0.items():
            if pid in own_pids:
                continue
            try:
                used = (_cpu_s(psutil.Process(pid)) - s0) / wall
            except psutil.NoSuchProcess:
                continue
            if used > 0.05:
                busiest.append((pid, name, used))
        busiest.sort(key=lambda b: -b[2])
        self.result = Contention(other_cores=max(sys_busy - own_s, 0.0) / wall, own_cores=own_s / wall,
                                 load=os.getloadavg()[0], cores=psutil.cpu_count() or 1, busiest=busiest)


def noisy_reasons(metrics: dict[str, float], contention: Contention | None, gpu_events: list[str], m,
                  watched: tuple[str, ...] = ("throughput_tok_s", "single_stream_tok_s")) -> list[str]:
    """Why a run's numbers cannot be trusted (empty: they can): the spread of a watched metric over its repeats above
    measure.max_cv, CPU contention above measure.max_other_cpu, and whatever NVML saw on the GPU."""
    out = [f"{k} varies {metrics[f'{k}_cv']:.0%} over its repeats (above measure.max_cv={m.max_cv:.0%})"
           for k in watched if metrics.get(f"{k}_cv", 0.0) > m.max_cv]
    if contention is not None:
        out += contention.reasons(m.max_other_cpu)
    return out + gpu_events


def guard(metrics: dict[str, float], contention: Contention, gpu_events: list[str], m,
          watched: tuple[str, ...] = ("throughput_tok_s", "single_stream_tok_s")) -> dict[str, str]:
    """The guard's verdict on a run as its tags (noisy, noise_reason), said on a [noise] line when it is noisy; the
    CPU contention seen goes into the metrics."""
    from onepass.harness.logs import log

    metrics.update(other_cpu_cores=contention.other_cores, load_avg=contention.load)
    reasons = noisy_reasons(metrics, contention, gpu_events, m, watched)
    if reasons:
        log.warning(f"[noise] this run is noisy: {'; '.join(reasons)}")
    return {"noisy": str(bool(reasons)).lower(), **({"noise_reason": "; ".join(reasons)} if reasons else {})}
