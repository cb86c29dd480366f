"""Where a graphed decode step's time goes, kernel by kernel: `python -m onepass.harness.step_profile OVERRIDES...
[--batches 1,32] [--steps 8] [--top 24] [--csv PATH]`.

A step's kernels overlap under PDL (each is launched ahead and waits for the one before) and on the side stream, so
their durations add up to more than the step; and a kernel's duration counts the time it sat resident waiting. What
the step pays for a kernel is how much later the step's work ends because of it: ordered by end time, each kernel
is charged the time from the previous kernel's end to its own (the first from the step's first start); these
charges add up to the step's span. A kernel that runs beside the chain (a side stream) and ends inside it takes
the charge of the stretch it ends: charges say where the step's time goes, a skip probe what a kernel costs.
Printed per kernel kind (its name and grid, which tells a GEMM's shapes apart) and batch: calls a step, charged us
a step and per call, and the mean duration per call.

One model is built (Hydra overrides as for `onepass`, e.g. experiment=hybrid_27b_q4_0), then per batch size a
static batch of 4 tokens compiles the kernels, then a static batch of --steps decode steps is traced with the
torch profiler (CUPTI). Kernels are grouped into steps by the graph launch that ran them. A probe: nothing is logged.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import statistics
import sys
import tempfile

import torch
from hydra.errors import ConfigCompositionException

from onepass.kernels.errors import ConfigError


def kernel_kind(event: dict) -> str:
    """A kernel's name without its template arguments, and its grid (GEMMs of other shapes have other grids)."""
    name = event["name"].split("<")[0].split("(")[0]
    name = name.rsplit("::", 1)[-1]
    grid = event.get("args", {}).get("grid")
    return f"{name} {'x'.join(str(g) for g in grid)}" if grid else name


def charge_steps(kernels: list[dict]) -> list[dict[str, list[float]]]:
    """Per step (kernels of one graph launch, keyed by its correlation id), kind -> [charged us, duration us] per
    call. Ordered by end time, each kernel is charged from the previous end to its own (the first from the step's
    first start), so a step's charges add up to its span. (A graph's kernels report the streams its replay ran
    them on, not the ones they were captured on, so streams are not told apart: a side-stream kernel that ends
    inside the chain takes the charge of the stretch it ends, which the chain's kernel would take without it.)"""
    by_launch: dict[int, list[dict]] = collections.defaultdict(list)
    for k in kernels:
        by_launch[k["args"].get("correlation", -1)].append(k)
    steps = []
    for launch in sorted(by_launch, key=lambda c: min(k["ts"] for k in by_launch[c])):
        ks = sorted(by_launch[launch], key=lambda k: k["ts"] + k["dur"])
        prev_end = min(k["ts"] for k in ks)
        per_kind: dict[str, list[list[float]]] = collections.defaultdict(list)
        for k in ks:
            end = k["ts"] + k["dur"]
            per_kind[kernel_kind(k)].append([max(0.0, end - prev_end), k["dur"]])
            prev_end = max(prev_end, end)
        steps.append(per_kind)
    return steps


def summarize(steps: list[dict], B: int) -> list[dict]:
    """Rows per kernel kind, averaged over the steps: calls a step, charged us a step and per call, duration per
    call. Launches of one kernel (eager work: the prefill, copies) and steps with another kernel count than the
    most common one (a launch that was not a decode step) are left out."""
    steps = [s for s in steps if sum(len(v) for v in s.values()) > 1]
    sizes = collections.Counter(sum(len(v) for v in s.values()) for s in steps)
    usual = sizes.most_common(1)[0][0]
    steps = [s for s in steps if sum(len(v) for v in s.values()) == usual]
    kinds = sorted({k for s in steps for k in s})
    rows = []
    for kind in kinds:
        calls = [len(s.get(kind, [])) for s in steps]
        charged = [sum(c for c, _ in s.get(kind, [])) for s in steps]
        durs = [d for s in steps for _, d in s.get(kind, [])]
        n, c = statistics.mean(calls), statistics.median(charged)
        rows.append({"B": B, "kernel": kind, "calls": n, "charged_us": c, "charged_per_call_us": c / n if n else 0.0,
                     "duration_per_call_us": statistics.mean(durs) if durs else 0.0})
    rows.sort(key=lambda r: -r["charged_us"])
    span = sum(r["charged_us"] for r in rows)
    for r in rows:
        r["share"] = r["charged_us"] / span if span else 0.0
    return rows


def profile_batch(built, cfg, B: int, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from onepass.harness.build import sampling_params
    from onepass.harness.workload import prompt_ids

    ids = prompt_ids(cfg.workload, built.tokenizer, built.cfg.vocab_size)
    sampling = sampling_params(cfg)
    built.run_static([ids] * B, 4, sampling, (), cfg.scheduler.prefill)   # compile every kernel once
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        built.run_static([ids] * B, steps + 1, sampling, (), cfg.scheduler.prefill)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "args" in e]
    if not kernels:
        raise ConfigError("the profiler recorded no kernels (no CUDA, or CUPTI unavailable)")
    return summarize(charge_steps(kernels), B)


def print_rows(rows: list[dict], top: int, out=print) -> None:
    span = sum(r["charged_us"] for r in rows)
    B = rows[0]["B"] if rows else "?"
    out(f"[profile] B={B}: step span {span / 1e3:.3f} ms, {sum(r['calls'] for r in rows):.0f} kernels")
    out(f"[profile] {'kernel (grid)':<58} {'calls':>6} {'charged us':>11} {'share':>6} {'us/call':>8} {'dur/call':>9}")
    for r in rows[:top]:
        out(f"[profile] {r['kernel'][:58]:<58} {r['calls']:>6.0f} {r['charged_us']:>11.1f} {r['share']:>6.1%} "
            f"{r['charged_per_call_us']:>8.2f} {r['duration_per_call_us']:>9.2f}")
    rest = rows[top:]
    if rest:
        out(f"[profile] {'(the other ' + str(len(rest)) + ' kinds)':<58} {sum(r['calls'] for r in rest):>6.0f} "
            f"{sum(r['charged_us'] for r in rest):>11.1f} {sum(r['share'] for r in rest):>6.1%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepass.harness.step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for onepass (e.g. experiment=hybrid_27b_q4_0)")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--steps", type=int, default=8, help="decode steps traced per batch size (default 8)")
    p.add_argument("--top", type=int, default=24, help="kernel kinds printed per batch size (default 24)")
    p.add_argument("--csv", default=None, help="also write every row to this CSV file")
    a = p.parse_args(argv)
    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR
    from onepass.harness.build import build

    try:
        batches = [int(b) for b in a.batches.split(",") if b.strip()]
    except ValueError:
        print(f"[error] --batches {a.batches!r}: comma-separated integers, e.g. 1,32", file=sys.stderr)
        return 2
    try:
        if not batches or a.steps < 1:
            raise ConfigError(f"--batches {a.batches!r} --steps {a.steps}: need a batch size and at least one step")
        if not torch.cuda.is_available():
            raise ConfigError("step_profile traces CUDA graphs: it needs a GPU")
        rows = []
        for B in batches:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=[*a.overrides, f"batch.size={B}", "progress=false"])
            if cfg.engine.backend == "torch":
                raise ConfigError("step_profile traces the fused GPU decoder: use engine.backend=triton (or auto)")
            built = build(cfg)
            got = profile_batch(built, cfg, B, a.steps)
            print_rows(got, a.top)
            rows.extend(got)
    except (ConfigError, ConfigCompositionException) as e:
        print(f"[error] {e}", file=sys.stderr)
        return 2
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
