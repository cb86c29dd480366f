"""Shared by the GEMM kernels: scratch buffers for split-K partial sums (one per device, grown on demand,
never freed while a captured CUDA graph may still point at an older one) and the BLOCK_M pin read from
the environment."""
from __future__ import annotations

import os

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


def block_m_from_env(var: str, choices: tuple[int, ...]) -> int | None:
    """A BLOCK_M pinned through the environment (None when unset), checked against the allowed tiles."""
    v = os.environ.get(var, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) not in choices:
        raise ValueError(f"{var}={v!r}: choose one of {choices}")
    return int(v)
