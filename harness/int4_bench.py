"""job=int4_gemm: the W4A16 projection variants against bf16 cuBLAS on the same shape, in the same job.

For every shape N x K of ``micro.shapes`` (weights [N, K], the issue's notation), format of ``micro.fmts``
and B of ``micro.batches`` one run is recorded (params micro.n / micro.k / micro.fmt / batch.size) with:
  <variant>_us      time per call of triton / cuda_mma / cuda_mma_fold / cuda_mma_fold_lat / cuda_wgmma /
                    cuda_wgmma_x2 / cuda_wgmma_ws / cuda_wgmma_ws_t128 (kernels/int4_dispatch.py) and bf16
                    (torch.matmul on the dequantized weight in bf16), each inside one CUDA graph of many calls
                    over rotating copies of the weight (>= 256 MB in all, so every call streams from HBM, not
                    the 60 MB L2); measure.warmup untimed replays, then the timed ones (harness/spread.py): the
                    median, with <variant>_us_p10 / _p90 / _cv beside it (picked_us: the picked variant's)
  <variant>_ok      1 when the variant's output matches w4a16_linear_ref (outputs scaled to ~N(0, 1);
                    |y - ref| <= atol + rtol |ref|, 1e-2 for the CUDA kernels (exact weights), 3e-2 where
                    the weight is rounded to bf16 first: triton (FOLD), the folded CUDA kernels, bf16)
  int4_bytes        the packed weight's bytes (quantized values + scales [+ mins, Q4_K sub-scales])
  effective_tbps    int4_bytes / time of the variant the dispatch picks for an engine of B sequences (MEASURED,
                    else the rule), and <variant>_tbps for each int4 variant
  speedup_vs_bf16   bf16 time / picked variant's time; best_us / best_variant: the fastest that verified
  verify_ok         every variant that ran verified
  host_peak_mb, peak_mem_mb, other_cpu_cores, load_avg: the shape's measurement (harness/usage.py, noise.py); a
                    run whose timed variants vary more than measure.max_cv over their replays is tagged noisy
  pdl               1 when the int4 kernels were launched with programmatic dependent launch (engine.pdl, sm_90+:
                    kernels/pdl.py), so each call's launch overlaps the one before, as in a decode step; torch's
                    bf16 GEMM never is. At B <= pdl.RELEASE_MAX_BATCH the CUDA GEMMs release the next call once
                    their last weight loads are issued, as they do in an engine of that batch (pdl 3)
Tags: int4_pick (the dispatch's choice), int4_best (the fastest measured), cuda_compiler (cupy / torch / none).
The runs of one job share a sweep_id, so the report takes the newest job.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Callable, Iterator

import torch
from omegaconf import OmegaConf

from onepass.engine.engine import EngineSpec
from onepass.harness.build import resolve_engine
from onepass.harness.checks import check_micro
from onepass.harness.job import RunRecord
from onepass.harness.noise import CpuWindow, guard
from onepass.harness.spread import check_measure, timed_us
from onepass.harness.usage import JobUsage
from onepass.kernels.errors import ConfigError
from onepass.kernels.quant_pack import FORMATS, pack, unpack_ref
from onepass.kernels import pdl

ROTATE_BYTES = 256 << 20       # weight copies per timed graph: at least this many bytes in all
CALLS_PER_GRAPH = 48
# exact weights: 1e-2; weights rounded to bf16 first (triton's FOLD, cuda_mma_fold, cuda_wgmma, bf16): 3e-2
TOL = {"triton": 3e-2, "cuda_mma": 1e-2, "cuda_mma_fold": 3e-2, "cuda_mma_fold_lat": 3e-2,
       "cuda_wgmma": 3e-2, "cuda_wgmma_x2": 3e-2,
       "cuda_wgmma_ws": 3e-2, "cuda_wgmma_ws_t128": 3e-2, "bf16": 3e-2}
_QT = {v: k for k, v in FORMATS.items()}
_SCALE_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q8_0": [0]}


def random_packed(fmt: str, N: int, K: int, seed: int, device: torch.device):
    """Random GGUF blocks (random quant bytes, moderate fp16 scales / mins) packed on the device."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_QT[fmt]]
    g = torch.Generator(device=device).manual_seed(seed)
    nb = N * K // block
    raw = torch.randint(0, 256, (nb, size), generator=g, dtype=torch.uint8, device=device)
    for off in _SCALE_FIELDS[fmt]:
        vals = (torch.randn(nb, generator=g, device=device) * 10 ** (torch.rand(nb, generator=g, device=device) - 0.5))
        raw[:, off:off + 2] = vals.half().view(torch.uint8).view(nb, 2)
    return pack(raw.view(-1), _QT[fmt], (N, K))


def capture(fns: list) -> Callable[[], float]:
    """The calls (cycled) captured in one CUDA graph; returns the timer of one replay: seconds per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:          # each copy once before the capture: what a kernel makes per weight on its first
            f()                # eager call (int4_wgmma_ws's ready Q4_K words) is not made inside a capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = max(CALLS_PER_GRAPH, len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()

    def replay() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / calls

    return replay   # the graph lives as long as its timer


def timed_variants(m: dict) -> tuple[str, ...]:
    """The timed figures of a row (those with a spread; picked_us is its variant's): what the noise guard watches."""
    return tuple(k.removesuffix("_cv") for k in m if k.endswith("_us_cv") and k != "picked_us_cv")


def derive(m: dict, variants: list[str], pick: str, nbytes: int, B: int) -> str:
    """The figures made from a row's times (in place): each int4 variant's TB/s; the picked variant's time with its
    spread (picked_us), effective TB/s, tok/s and ratio to bf16; the fastest verified variant's. Returns the fastest
    verified variant ("none")."""
    for v in variants:
        if f"{v}_us" in m:
            m[f"{v}_tbps"] = nbytes / (m[f"{v}_us"] / 1e6) / 1e12
    timed = {v: m[f"{v}_us"] for v in variants if f"{v}_us" in m and m.get(f"{v}_ok")}
    best = min(timed, key=timed.get) if timed else "none"
    if pick in timed:
        m.update({f"picked_us{s}": m[f"{pick}_us{s}"] for s in ("", "_p10", "_p90", "_cv") if f"{pick}_us{s}" in m})
        m["effective_tbps"] = nbytes / (timed[pick] / 1e6) / 1e12
        m["speedup_vs_bf16"] = m["bf16_us"] / timed[pick]
        m["throughput_tok_s"] = B / (timed[pick] / 1e6)
    if timed:
        m["best_us"] = timed[best]
        m["best_speedup_vs_bf16"] = m["bf16_us"] / timed[best]
        m["best_tbps"] = nbytes / (timed[best] / 1e6) / 1e12
    return best


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[bool, float]:
    err = (y.float() - ref.float()).abs()
    return bool((err <= tol + tol * ref.float().abs()).all()), float(err.max())


def bench_shape(N: int, K: int, fmt: str, batches: list[int], device: torch.device, dtype: torch.dtype, measure,
                seed: int = 0, pdl_on: bool | None = None) -> list[dict]:
    """One dict of metrics (+ '_tags') per B for this shape and format, each time under the measure group; pdl_on:
    engine.pdl (None: the default)."""
    from onepass.kernels import int4_dispatch as disp, int4_mma, int4_wgmma, int4_wgmma_ws, nvrtc

    pw = random_packed(fmt, N, K, seed, device)
    w32 = unpack_ref(pw)
    scale = 1.0 / (math.sqrt(K) * w32.pow(2).mean().sqrt().item())
    g = torch.Generator(device=device).manual_seed(seed + 1)
    xs = torch.randn(max(batches), K, generator=g, device=device).mul_(scale).to(dtype)
    ref_all = xs.float() @ w32.T                       # the definition, w4a16_linear_ref before rounding
    w16 = w32.to(dtype)
    del w32
    pws = [pw] + [_clone(pw) for _ in range(max(0, math.ceil(ROTATE_BYTES / pw.nbytes) - 1))]
    w16s = [w16] + [w16.clone() for _ in range(max(0, math.ceil(ROTATE_BYTES / (w16.numel() * 2)) - 1))]
    variants = (["triton"]
                + ([v for v in disp.MMA_VARIANTS
                    if int4_mma.available() and int4_mma.supports(fmt, fold=v != "cuda_mma")])
                + (list(disp.WGMMA_CONFIGS) if int4_wgmma.available() and int4_wgmma.supports(fmt) else [])
                + (list(disp.WS_CONFIGS) if int4_wgmma.available() and int4_wgmma_ws.supports(fmt) else []))
    dev = xs.device                                    # with its index: the workspaces are keyed by it
    disp.reserve(dev, dtype, [pw], max(batches))
    rows = []
    for B in batches:
        # the launch policy of an engine of B sequences (no early trigger: not for the Triton GEMM either)
        with pdl.applied(pdl.LaunchPolicy(pdl=pdl_on, release=B <= pdl.RELEASE_MAX_BATCH)):
            x = xs[:B]
            out = torch.empty(B, N, device=dev, dtype=dtype)
            ref = ref_all[:B]
            m: dict = {"int4_bytes": float(pw.nbytes), "bf16_bytes": float(N * K * 2)}
            ok_all = True
            for v in variants:
                try:
                    y = disp.run_variant(v, x, pw)
                    ok, err = _close(y, ref, TOL[v])
                    m[f"{v}_ok"], m[f"{v}_max_err"] = int(ok), err
                    ok_all &= ok
                    m.update(timed_us(f"{v}_us", capture([lambda p=p: disp.run_variant(v, x, p, out) for p in pws]),
                                      measure))
                except Exception as e:  # a variant that fails is reported, the others still run
                    print(f"[error] int4_gemm {N}x{K} {fmt} B={B} {v}: {type(e).__name__}: {e}")
                    m[f"{v}_ok"] = 0
                    ok_all = False
            y = torch.matmul(x, w16.t())
            ok, err = _close(y, ref, TOL["bf16"])
            m["bf16_ok"], m["bf16_max_err"] = int(ok), err
            m.update(timed_us("bf16_us", capture([lambda w=w: torch.matmul(x, w.t(), out=out) for w in w16s]), measure))
            m["bf16_tbps"] = N * K * 2 / (m["bf16_us"] / 1e6) / 1e12
            pick = disp.runnable(disp.choose(B, N, K, fmt, disp.Int4Policy("invariant", B)), x, fmt)
            best = derive(m, variants, pick, pw.nbytes, B)
            m["verify_ok"] = int(ok_all)
            m["pdl"] = pdl.mode(device)
            m["_tags"] = {"int4_pick": pick, "int4_best": best, "cuda_compiler": nvrtc.compiler()}
        rows.append(m)
    return rows


def _clone(pw):
    import dataclasses

    cl = lambda t: None if t is None else t.clone()  # noqa: E731
    return dataclasses.replace(pw, qweight=cl(pw.qweight), scales=cl(pw.scales), mins=cl(pw.mins), sub=cl(pw.sub))


class Int4GemmJob:
    """Every (shape, fmt) in micro.shapes x micro.fmts at every B of micro.batches: one recorded run each."""

    def __init__(self, name: str = "int4_gemm"):
        self.name = name

    def check(self, cfg) -> None:
        check_micro(cfg)   # sizes first: a CPU machine sees the refusal the GPU would
        check_measure(cfg.measure)
        if resolve_engine(cfg.engine)[0].type != "cuda":
            raise ConfigError("int4_gemm times GPU kernels; it needs a CUDA device (engine.device=cuda)")

    def run(self, cfg) -> Iterator[RunRecord]:
        check_micro(cfg)
        yield from int4_gemm_runs(cfg)


def int4_gemm_runs(cfg) -> Iterator[RunRecord]:

    dev, dtype, _ = EngineSpec(device=cfg.engine.device, dtype=cfg.engine.dtype, threads=cfg.engine.threads).resolve()
    if dev.type != "cuda":
        raise ConfigError("int4_gemm times GPU kernels; it needs a CUDA device")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"int4_gemm runs bf16 / fp16 activations, not {dtype}")
    sweep = f"int4_gemm-{uuid.uuid4().hex[:12]}"
    t0, n = time.perf_counter(), 0
    for shape in cfg.micro.shapes:
        try:
            N, K = (int(v) for v in str(shape).lower().split("x"))
        except ValueError:
            raise ConfigError(f"micro.shapes entry {shape!r}: write N x K as e.g. 5120x17408") from None
        for fmt in cfg.micro.fmts:
            if fmt not in _QT:
                raise ConfigError(f"micro.fmts entry {fmt!r}: choose from {sorted(_QT)}")
            if K % (256 if fmt == "q4_k" else 32):
                print(f"[error] int4_gemm: K={K} is not a multiple of {fmt}'s block; skipped")
                continue
            # the noise guard reads the shape's whole measurement: its B share the CPU window and the NVML events
            with CpuWindow() as window, JobUsage(dev) as usage:
                rows = bench_shape(N, K, fmt, list(cfg.micro.batches), dev, dtype, cfg.measure,
                                   pdl_on=bool(cfg.engine.pdl))
            for B, m in zip(cfg.micro.batches, rows):
                m.update(usage.metrics())
                tags = {"dtype": str(dtype).removeprefix("torch."), "sweep_id": sweep, **m.pop("_tags"),
                        **guard(m, window.result, sorted(usage.gpu_events), cfg.measure, timed_variants(m))}
                c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
                c.micro.n, c.micro.k, c.micro.fmt, c.batch.size = N, K, fmt, int(B)
                _print(N, K, fmt, B, m, tags)
                yield RunRecord(f"int4_gemm {N}x{K} {fmt} B={B}", dev, m, tags, {}, cfg=c)
                n += 1
            torch.cuda.empty_cache()
    print(f"[perf] int4_gemm: {n} runs in {time.perf_counter() - t0:.0f} s")


def _print(N, K, fmt, B, m, tags) -> None:
    us = lambda v: f"{m[v + '_us']:.1f}" if v + "_us" in m else "-"  # noqa: E731
    print(f"[verify] int4_gemm {N}x{K} {fmt} B={B}: {str(bool(m['verify_ok'])).lower()}")
    print(f"[perf] int4_gemm {N}x{K} {fmt} B={B}: triton {us('triton')} us, cuda_mma "
          f"{us('cuda_mma')} us, fold {us('cuda_mma_fold')} us, fold lat {us('cuda_mma_fold_lat')} us, wgmma "
          f"{us('cuda_wgmma')} us, wgmma x2 {us('cuda_wgmma_x2')} us, "
          f"wgmma ws {us('cuda_wgmma_ws')} us, ws t128 {us('cuda_wgmma_ws_t128')} us, "
          f"bf16 cuBLAS {us('bf16')} us; pick {tags['int4_pick']} ±{m.get('picked_us_cv', float('nan')):.1%} over "
          f"its replays, {m.get('effective_tbps', float('nan')):.2f} TB/s, "
          f"{m.get('speedup_vs_bf16', float('nan')):.2f}x bf16; "
          f"best {tags['int4_best']}")
