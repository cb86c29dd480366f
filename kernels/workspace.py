"""Shared by the step kernels: scratch buffers for split-K partial sums, stream-K flags and row tickets (one per device
and lane, grown on demand, never freed while a captured CUDA graph may still point at an older one), the lanes
themselves, and the BLOCK_M pin read from the environment.

A lane is a set of scratch buffers for one chain of kernels. A step that runs two micro-batches on two streams at once
(engine/runner.py) runs each in a lane of its own, so their GEMMs' partials, flags and tickets never meet; one chain
at a time needs only lane 0."""
from __future__ import annotations

import contextlib
import functools
import os

import torch

_lane = 0


@contextlib.contextmanager
def lane(index: int):
    """Kernels launched inside take their scratch buffers from lane `index` (0: the default)."""
    global _lane
    if index < 0:
        raise ValueError(f"lane {index}: lanes count from 0")
    saved, _lane = _lane, int(index)
    try:
        yield
    finally:
        _lane = saved


def current_lane() -> int:
    return _lane


class SplitKWorkspace:
    """fp32 scratch by default; zeroed=True (with an integer dtype): flags the kernels leave zero when they end."""

    def __init__(self, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> None:
        self._buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._make = functools.partial(torch.zeros if zeroed else torch.empty, dtype=dtype)

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        """A buffer of at least `numel` elements in the current lane (a fresh one on the CPU, for the interpreter)."""
        if device.type != "cuda":
            return self._make(numel, device=device)
        key = (device, _lane)
        ws = self._buffers.get(key)
        if ws is None or ws.numel() < numel:
            if ws is not None:
                self._retired.append(ws)  # a captured graph may still point at it
            ws = self._make(numel, device=device)
            self._buffers[key] = ws
        return ws


def block_m_from_env(var: str, choices: tuple[int, ...]) -> int | None:
    """A BLOCK_M pinned through the environment (None when unset), checked against the allowed tiles."""
    v = os.environ.get(var, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) not in choices:
        raise ValueError(f"{var}={v!r}: choose one of {choices}")
    return int(v)
