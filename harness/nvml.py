"""What NVML tells about the job's GPU (pynvml, from nvidia-ml-py): the energy counter, this process's memory, other
processes on the card and throttling. Every reading is None (or empty) where there is no NVML: a CPU machine, a
driver without it, a card too old for the energy counter."""
from __future__ import annotations

import os

import torch

# clock-event reasons that slow a card for reasons outside the job (NVML's "throttle reasons")
_SLOWDOWNS = {"nvmlClocksEventReasonHwSlowdown": "hardware slowdown",
              "nvmlClocksEventReasonSwThermalSlowdown": "software thermal slowdown",
              "nvmlClocksEventReasonHwThermalSlowdown": "hardware thermal slowdown",
              "nvmlClocksEventReasonHwPowerBrakeSlowdown": "power brake"}


class Gpu:
    """NVML's handle of a torch CUDA device (found by UUID, so CUDA_VISIBLE_DEVICES does not matter)."""

    def __init__(self, handle, nvml):
        self.handle, self.nvml = handle, nvml

    @classmethod
    def of(cls, dev: torch.device) -> Gpu | None:
        if dev.type != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
            return cls(pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), pynvml)
        except Exception:   # no pynvml, no driver library, or a device NVML cannot name
            return None

    def energy_j(self) -> float | None:
        """The card's energy counter in joules (Volta and newer), None where it has none."""
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3
        except Exception:
            return None

    def processes(self) -> dict[int, float]:
        """Compute processes on the card: pid -> MiB of device memory (0 where NVML does not say)."""
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return {}
        return {p.pid: (p.usedGpuMemory or 0) / 2**20 for p in procs}

    def own_mb(self) -> float | None:
        """Device memory this process holds, as NVML counts it (the CUDA context and every allocator's memory)."""
        return self.processes().get(os.getpid())

    def others(self) -> list[int]:
        return sorted(pid for pid in self.processes() if pid != os.getpid())

    def slowdowns(self) -> list[str]:
        """The card's current clock slowdowns from outside the job (thermal, hardware, power brake)."""
        read = (getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)   # the older bindings' name:
                or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        try:
            reasons = read(self.handle)
        except Exception:
            return []
        return [text for name, text in _SLOWDOWNS.items()
                if reasons & getattr(self.nvml, name, getattr(self.nvml, name.replace("Event", "Throttle"), 0))]
