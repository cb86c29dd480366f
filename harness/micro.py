"""The seed's two micro-benchmarks on synthetic dimensions (no model load), as harness jobs.

projection_crossover: one batched projection GEMM over B tokens against B separate single-token
GEMMs; the aggregate speedup grows ~B until the GEMM turns compute-bound.
decode_attention: per-slot attention for B slots against one slot; bandwidth reached, and every
slot's output bit-exact with the same slot computed alone.
"""
from __future__ import annotations

import statistics
from typing import Iterator

import torch

from onepass.harness.build import resolve_engine
from onepass.harness.checks import check_micro
from onepass.harness.gdn_bench import TIMED as GDN_TIMED
from onepass.harness.job import RunRecord
from onepass.harness.logs import log
from onepass.harness.noise import CpuWindow, guard
from onepass.harness.spread import check_measure, spread
from onepass.harness.usage import JobUsage
from onepass.kernels.errors import ConfigError


def _bench_graph(fn, reps: int = 20) -> list[float]:
    """Seconds per call of `fn` in each of triton's timed replays of a CUDA graph of it (launch gaps excluded; triton
    warms it up, then times ten replays of many calls each): the repeats whose median and spread are logged."""
    import triton.testing

    return [t / 1e3 for t in triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="all")]


def projection_crossover(m, batch: int, device: torch.device, dtype: torch.dtype, measure=None) -> tuple[dict, str]:
    """(measure is unread: its repeats are triton's timed replays.)"""
    from onepass.kernels.gemm import linear

    if device.type != "cuda":
        raise ConfigError("projection_crossover times GPU kernels; it needs a CUDA device")
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(m.n, m.k, device=device, dtype=dtype, generator=g) * 0.02
    x = torch.randn(batch, m.k, device=device, dtype=dtype, generator=g)
    out = torch.empty(batch, m.n, device=device, dtype=dtype)
    one = torch.empty(1, m.n, device=device, dtype=dtype)
    rows = [x[i:i + 1] for i in range(batch)]
    s_gemm = _bench_graph(lambda: linear(x, w, out=out))
    t_gemm = statistics.median(s_gemm)
    t_gemv = statistics.median(_bench_graph(lambda: linear(rows[0], w, out=one)))
    t_cublas = statistics.median(_bench_graph(lambda: torch.matmul(x, w.t(), out=out)))
    flops, wbytes = 2 * batch * m.n * m.k, m.n * m.k * dtype.itemsize
    metrics = {"gemm_us": t_gemm * 1e6, "gemv_us": t_gemv * 1e6, "cublas_us": t_cublas * 1e6,
               "speedup_vs_separate": batch * t_gemv / t_gemm, "tflops": flops / t_gemm / 1e12,
               "weight_tbps": wbytes / t_gemm / 1e12, "throughput_tok_s": batch / t_gemm, "verify_ok": 1}
    metrics.update(spread("gemm_us", [t * 1e6 for t in s_gemm]))
    # every row of the batched GEMM is bit-exact with that row alone (batch invariance)
    linear(x, w, out=out)
    alone = torch.cat([linear(r, w) for r in rows[: min(batch, 16)]])
    metrics["verify_ok"] = int(torch.equal(out[: alone.shape[0]], alone))
    line = (f"projection {m.n}x{m.k}, B={batch}: batched GEMM {metrics['gemm_us']:.1f} us vs {batch} x "
            f"{metrics['gemv_us']:.1f} us single-token: {metrics['speedup_vs_separate']:.1f}x aggregate; "
            f"{metrics['tflops']:.0f} TFLOP/s, weights at {metrics['weight_tbps']:.2f} TB/s; "
            f"cuBLAS {metrics['cublas_us']:.1f} us")
    return metrics, line


def decode_attention_bench(m, batch: int, device: torch.device, dtype: torch.dtype, measure=None
                           ) -> tuple[dict, str]:
    """(measure is unread: its repeats are triton's timed replays.)"""
    from onepass.kernels.attention import attention_ref
    from onepass.kernels.decode_attention import decode_attention, make_workspace

    if device.type != "cuda":
        raise ConfigError("decode_attention times GPU kernels; it needs a CUDA device")
    g = torch.Generator(device=device).manual_seed(0)
    H, KVH, D, L = m.n_heads, m.kv_heads, m.head_dim, m.ctx
    k = torch.randn(batch, L, KVH, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch, L, KVH, D, device=device, dtype=dtype, generator=g)
    q = torch.randn(batch, H, D, device=device, dtype=dtype, generator=g)
    slots = torch.arange(batch, device=device)
    pos = torch.full((batch,), L - 1, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ws, out = make_workspace(batch, H, D, L, sms, device, kv_heads=KVH), torch.empty_like(q)
    s_attn = _bench_graph(lambda: decode_attention(q, k, v, slots, pos, out=out, workspace=ws, num_sms=sms, max_len=L))
    t = statistics.median(s_attn)
    t1 = statistics.median(_bench_graph(lambda: decode_attention(q[:1], k, v, slots[:1], pos[:1], workspace=ws,
                                                                 num_sms=sms, max_len=L)))
    kv_bytes = 2 * batch * L * KVH * D * dtype.itemsize
    decode_attention(q, k, v, slots, pos, out=out, workspace=ws, num_sms=sms, max_len=L)
    alone = torch.cat([decode_attention(q[i:i + 1], k, v, slots[i:i + 1], pos[i:i + 1], num_sms=sms, max_len=L)
                       for i in range(min(batch, 8))])
    ref = attention_ref(q.unsqueeze(1), k, v, pos.view(-1, 1)).squeeze(1)
    err = (out.float() - ref.float()).abs().max().item()
    ok = torch.equal(out[: alone.shape[0]], alone) and err < 2e-2
    metrics = {"attn_us": t * 1e6, "attn_one_slot_us": t1 * 1e6, "kv_tbps": kv_bytes / t / 1e12,
               "speedup_vs_one_slot": batch * t1 / t, "max_abs_err": err, "verify_ok": int(ok),
               "throughput_tok_s": batch / t, **spread("attn_us", [s * 1e6 for s in s_attn])}
    line = (f"decode attention {H}/{KVH} heads x {D}, ctx {L}, B={batch}: {metrics['attn_us']:.1f} us "
            f"({metrics['kv_tbps']:.2f} TB/s of KV) vs one slot {metrics['attn_one_slot_us']:.1f} us: "
            f"{metrics['speedup_vs_one_slot']:.1f}x aggregate; bit-exact per slot and |err| {err:.1e} vs reference: "
            f"{str(ok).lower()}")
    return metrics, line


MICRO = {"projection_crossover": projection_crossover, "decode_attention": decode_attention_bench}


def _gdn_step(m, batch, device, dtype, measure):
    from onepass.harness.gdn_bench import gdn_step

    return gdn_step(m, batch, device, dtype, measure)


MICRO["gdn_step"] = _gdn_step  # the fused GDN decode step vs flash-linear-attention (harness/gdn_bench.py)
# the timed figures whose spread over their repeats the noise guard judges
WATCHED = ("gemm_us", "attn_us", *GDN_TIMED)


class MicroJob:
    """One micro-benchmark on synthetic dimensions (`micro`), no model load: `name` is one of MICRO."""

    # the config a micro-benchmark reads: its params
    sections = ("micro", "batch", "engine", "measure", "job", "table")

    def __init__(self, name: str):
        if name not in MICRO:
            raise ConfigError(f"job={name!r}: a micro-benchmark is one of {', '.join(sorted(MICRO))}")
        self.name = name

    def check(self, cfg) -> None:
        check_micro(cfg)   # sizes first: a CPU machine sees the refusal the GPU would
        check_measure(cfg.measure)
        if resolve_engine(cfg.engine)[0].type != "cuda":
            raise ConfigError(f"{self.name} times GPU kernels; it needs a CUDA device (engine.device=cuda)")

    def run(self, cfg) -> Iterator[RunRecord]:
        check_micro(cfg)
        dev, dtype, _ = resolve_engine(cfg.engine)
        with CpuWindow() as window, JobUsage(dev) as usage:
            metrics, line = MICRO[self.name](cfg.micro, cfg.batch.size, dev, dtype, cfg.measure)
        metrics.update(usage.metrics())
        log.info(f"[verify] {self.name}: {bool(metrics['verify_ok'])}".lower())
        log.info(f"[perf] {line}")
        tags = {"dtype": str(dtype).removeprefix("torch."),
                **guard(metrics, window.result, sorted(usage.gpu_events), cfg.measure, WATCHED)}
        yield RunRecord(f"B={cfg.batch.size} {cfg.table}", dev, metrics, tags)
