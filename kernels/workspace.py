"""Shared by the GEMM kernels: scratch buffers for split-K partial sums and stream-K flags (one per device, grown on
demand, never freed while a captured CUDA graph may still point at an older one) and the BLOCK_M pin read from
the environment."""
from __future__ import annotations

import functools
import os

import torch


class SplitKWorkspace:
    """fp32 scratch by default; zeroed=True (with an integer dtype): flags the kernels leave zero when they end."""

    def __init__(self, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._make = functools.partial(torch.zeros if zeroed else torch.empty, dtype=dtype)

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements (a fresh one on the CPU, for the interpreter)."""
        if device.type != "cuda":
            return self._make(numel, device=device)
        ws = self._buffers.get(device)
        if ws is None or ws.numel() < numel:
            if ws is not None:
                self._retired.append(ws)  # a captured graph may still point at it
            ws = self._make(numel, device=device)
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
