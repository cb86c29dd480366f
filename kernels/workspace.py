"""Scratch buffers for split-K partial sums: one per device, grown on demand, never freed while a
captured CUDA graph may still point at an older one."""
from __future__ import annotations

import torch


class SplitKWorkspace:
    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        """An fp32 buffer of at least `numel` elements (a fresh one on the CPU, for the interpreter)."""
        if device.type != "cuda":
            return torch.empty(numel, dtype=torch.float32, device=device)
        ws = self._buffers.get(device)
        if ws is None or ws.numel() < numel:
            if ws is not None:
                self._retired.append(ws)  # a captured graph may still point at it
            ws = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffers[device] = ws
        return ws
