"""What one job used, measured for the job alone: host memory sampled while it runs (this process and its children,
not the process's lifetime maximum), device memory through torch and NVML, and on the GPU the energy NVML's counter
gives over a timed section. A thread samples every INTERVAL_S; it also notes what NVML sees that disturbs a
measurement (other processes on the card, clock slowdowns) for the noise guard."""
from __future__ import annotations

import threading

import psutil
import torch

from onepass.harness.nvml import Gpu

INTERVAL_S = 0.1


class JobUsage:
    """`with JobUsage(dev) as u: ...` samples until the block ends; `u.metrics()` then gives the peaks."""

    def __init__(self, dev: torch.device):
        self.dev, self.gpu = dev, Gpu.of(dev)
        self.host_peak = self.nvml_peak = 0.0
        self.gpu_events: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True, name="onepass-usage")

    def __enter__(self) -> JobUsage:
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample_loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        me = psutil.Process()
        rss = 0
        for p in (me, *me.children(recursive=True)):
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.host_peak = max(self.host_peak, rss / 2**20)
        if self.gpu is not None:
            self.nvml_peak = max(self.nvml_peak, self.gpu.own_mb() or 0.0)
            if others := self.gpu.others():
                self.gpu_events.add(f"other processes on the GPU (pids {', '.join(map(str, others[:4]))})")
            self.gpu_events.update(f"GPU clocks slowed ({s})" for s in self.gpu.slowdowns())

    def metrics(self) -> dict[str, float]:
        """peak_mem_mb: the device's peak for the job (torch's allocator on a GPU; sampled host memory on the CPU);
        host_peak_mb beside it, and NVML's count of the card's memory held by this process (allocator caches and the
        CUDA context included) where there is one."""
        out = {"host_peak_mb": self.host_peak}
        if self.dev.type == "cuda":
            out["peak_mem_mb"] = torch.cuda.max_memory_allocated(self.dev) / 2**20
            if self.gpu is not None:
                out["gpu_mem_nvml_mb"] = self.nvml_peak
        else:
            out["peak_mem_mb"] = self.host_peak
        return out


class Energy:
    """`with Energy(gpu) as e: ...` then e.joules: the card's energy counter over the block (None without NVML).
    The counter covers the whole card: a run sharing it is marked noisy by the guard."""

    def __init__(self, gpu: Gpu | None):
        self.gpu, self.joules = gpu, None

    def __enter__(self) -> Energy:
        if self.gpu is not None and self.gpu.energy_j() is not None:
            torch.cuda.synchronize()
            self._e0 = self.gpu.energy_j()
        else:
            self._e0 = None
        return self

    def __exit__(self, *exc) -> None:
        if self._e0 is not None:
            torch.cuda.synchronize()
            e1 = self.gpu.energy_j()
            self.joules = None if e1 is None else e1 - self._e0
