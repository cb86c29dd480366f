"""Repeated timing: warm-up runs, then timed repeats (a count, or until a minimum time), and each metric as the median
of the repeats with its spread beside it under the same name: `x`, `x_p10`, `x_p90`, `x_cv`."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import numpy as np

from onepass.kernels.errors import ConfigError

T = TypeVar("T")


def check_measure(m) -> None:
    """The measure group, before anything loads."""
    if m.warmup < 0 or m.repeats < 1 or m.max_repeats < m.repeats or m.min_s < 0:
        raise ConfigError(f"measure.warmup={m.warmup}, repeats={m.repeats}, max_repeats={m.max_repeats}, "
                          f"min_s={m.min_s}: give warmup >= 0, 1 <= repeats <= max_repeats and min_s >= 0")
    if m.max_cv <= 0 or m.max_other_cpu < 0:
        raise ConfigError(f"measure.max_cv={m.max_cv}, max_other_cpu={m.max_other_cpu}: the noise thresholds are a "
                          "spread > 0 and a CPU use >= 0 (in cores)")


def repeat(run: Callable[[], T], m, warm: Callable[[], object] | None = None) -> list[T]:
    """`warm` (default: `run`) m.warmup times untimed, then `run` at least m.repeats times and on until the timed runs
    add up to m.min_s seconds (at most m.max_repeats): every result, in order."""
    for _ in range(m.warmup):
        (warm or run)()
    out: list[T] = []
    spent = 0.0
    while len(out) < m.repeats or (spent < m.min_s and len(out) < m.max_repeats):
        t0 = time.perf_counter()
        out.append(run())
        spent += time.perf_counter() - t0
    return out


def spread(name: str, values) -> dict[str, float]:
    """The median of values as `name`, their 10th and 90th percentiles and coefficient of variation beside it."""
    v = np.asarray(list(values), dtype=np.float64)
    mean = float(v.mean())
    cv = float(v.std(ddof=1) / mean) if len(v) > 1 and mean else 0.0
    return {name: float(np.median(v)), f"{name}_p10": float(np.percentile(v, 10)),
            f"{name}_p90": float(np.percentile(v, 90)), f"{name}_cv": cv}


def timed_us(name: str, once: Callable[[], float], m) -> dict[str, float]:
    """A kernel timer under the measure group: `once` times one replay (seconds per call), run m.warmup times untimed
    and then as repeat() says; `name` in microseconds as their median, with its spread beside it."""
    return spread(name, [s * 1e6 for s in repeat(once, m)])


def spreads(per_repeat: list[dict[str, float]]) -> dict[str, float]:
    """Every metric of the repeats (dicts of one repeat's figures) as its median and spread."""
    out: dict[str, float] = {}
    for key in per_repeat[0]:
        out.update(spread(key, [r[key] for r in per_repeat]))
    return out
