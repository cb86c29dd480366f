"""The operations a model calls, bound to one backend. Models call `ops.x(...)` and never know which ran."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from onepass.engine.errors import ConfigError
from onepass.kernels.attention import attention_ref
from onepass.kernels.rmsnorm import rms_norm_ref
from onepass.kernels.rope import apply_rope_ref
from onepass.kernels.swiglu import swiglu_ref

BACKENDS = ("torch",)


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    apply_rope: Callable
    attention: Callable
    swiglu: Callable


TORCH = Ops("torch", rms_norm_ref, apply_rope_ref, attention_ref, swiglu_ref)


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        return TORCH
    raise ConfigError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
