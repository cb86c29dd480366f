"""onepass engine: GGUF models, their reference and fused decode steps, static batching and serving.

    from onepass.engine import Engine, Request, SamplingParams
    engine = Engine.from_gguf(path, batch=8)
"""
from __future__ import annotations

_EXPORTS = {"Engine": "engine", "EngineSpec": "engine", "Request": "scheduler", "SamplingParams": "sampler",
            "ServeResult": "runner"}


def __getattr__(name: str):
    # imported on first use, so `import onepass.engine.config` does not load the kernels
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"onepass.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'onepass.engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
