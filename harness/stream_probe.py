"""Probe: how fast one program an SM can stream a weight through a small-row product (Y[R, N] = X[R, K] @ W[N, K]^T,
bf16, R <= 16), by the form of its loop: the question behind the persistent step's GEMM phases (kernels/PROBES.md).

    python -m onepass.harness.stream_probe --rows 1,16

Forms: `hand` (each item's K loop double-buffered in registers, the persistent step's default), `pipe` (each item's K
loop left to Triton's pipeliner), `flat` (one pipelined loop over all of a program's (item, K chunk) pairs) and `tma`
(the flat loop reading W through a tensor descriptor made on the device, so chunks land in shared memory by the copy
engine instead of registers). Prints each form's time and rate against the card's copy rate, per weight shape
(Llama-3.2-1B's q|k|v, gate|up, down), and checks every product against torch's.
"""
from __future__ import annotations

import argparse

import torch

from onepass.harness.roofline import copy_bandwidth
from onepass.kernels.triton_compat import tl, triton

SHAPES = {"qkv": (3072, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
BR = 16


@triton.jit
def _store(y, acc, t, R, N, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BR)
    cols = t * BN + tl.arange(0, BN)
    tl.store(y + rows[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty), mask=rows[:, None] < R)


@triton.jit
def _hand(x, w, y, R, N, K, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, BR)
    ks = tl.arange(0, BK)
    rm = rows[:, None] < R
    for t in range(pid, N // BN, nprog):
        cols = t * BN + tl.arange(0, BN)
        xp = x + rows[:, None] * K
        wp = w + cols[:, None].to(tl.int64) * K
        xv = tl.load(xp + ks[None, :], mask=rm, other=0.0, cache_modifier=".cg")
        wv = tl.load(wp + ks[None, :], eviction_policy="evict_first")
        acc = tl.zeros([BR, BN], tl.float32)
        for k0 in range(0, K, BK):
            kn = k0 + BK + ks
            xn = tl.load(xp + kn[None, :], mask=rm & (kn[None, :] < K), other=0.0, cache_modifier=".cg")
            wn = tl.load(wp + kn[None, :], mask=kn[None, :] < K, other=0.0, eviction_policy="evict_first")
            acc += tl.dot(xv, tl.trans(wv))
            xv = xn
            wv = wn
        _store(y, acc, t, R, N, BR, BN)


@triton.jit
def _chunk(x, w, desc, t, k0, R, K, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """Item t's product over K chunk k0: X[:, k0:k0+BK] @ W[t*BN:(t+1)*BN, k0:k0+BK]^T, W through desc when TMA."""
    rows = tl.arange(0, BR)
    ks = k0 + tl.arange(0, BK)
    xv = tl.load(x + rows[:, None] * K + ks[None, :], mask=rows[:, None] < R, other=0.0)
    if TMA:
        wv = desc.load([t * BN, k0])
    else:
        cols = t * BN + tl.arange(0, BN)
        wv = tl.load(w + cols[:, None].to(tl.int64) * K + ks[None, :], eviction_policy="evict_first")
    return tl.dot(xv, tl.trans(wv))


@triton.jit
def _pipe(x, w, y, R, N, K, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    for t in range(pid, N // BN, nprog):
        acc = tl.zeros([BR, BN], tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            acc += _chunk(x, w, None, t, k0, R, K, BR, BN, BK, False)
        _store(y, acc, t, R, N, BR, BN)


@triton.jit
def _flat(x, w, y, R, N, K, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
          TMA: tl.constexpr = False):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    if TMA:
        desc = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        desc = None
    kch = K // BK
    acc = tl.zeros([BR, BN], tl.float32)
    for i in tl.range(0, (N // BN - pid + nprog - 1) // nprog * kch, num_stages=STAGES):
        t = pid + (i // kch) * nprog
        acc += _chunk(x, w, desc, t, (i % kch) * BK, R, K, BR, BN, BK, TMA)
        if i % kch == kch - 1:
            _store(y, acc, t, R, N, BR, BN)
            acc = tl.zeros_like(acc)


# each form: its kernel and the constexprs it adds
KERNELS = {"hand": (_hand, {}), "pipe": (_pipe, {}), "flat": (_flat, {}), "tma": (_flat, {"TMA": True})}
DEFAULT_FORMS = ("hand:16:512:8:0;pipe:16:256:4:4;pipe:32:256:4:3;pipe:64:128:4:4;flat:16:256:4:4;flat:32:256:4:4;"
                 "tma:16:256:4:4;tma:16:256:4:6;tma:32:256:4:4;tma:64:256:4:3;tma:64:128:4:6")


def main(argv=None) -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--forms", default=DEFAULT_FORMS, help="kind:BN:BK:warps:stages, ';' between forms")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    bw = copy_bandwidth(dev)
    print(f"[stream] {torch.cuda.get_device_name(dev)}: {nsm} programs, copy rate {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device=dev).manual_seed(0)
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        floor = w.numel() * 2 / bw * 1e6
        for R in (int(r) for r in args.rows.split(",")):
            x = torch.randn(R, K, generator=g, device=dev).to(torch.bfloat16)
            ref = x.float() @ w.float().T
            y = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
            base = triton.testing.do_bench_cudagraph(lambda: torch.mm(x, w.T, out=y), rep=20) * 1e3
            print(f"[stream] {name} [{N}x{K}] R={R}: floor {floor:.1f} us; torch.mm {base:.1f} us "
                  f"({floor / base:.0%} of the copy rate)")
            for form in args.forms.split(";"):
                kind, bn, bk, warps, stages = form.split(":")
                bn, bk, warps, stages = int(bn), int(bk), int(warps), int(stages)
                if N % bn or K % bk:
                    continue
                y.zero_()

                def run():
                    kernel, extra = KERNELS[kind]
                    kernel[(nsm,)](x, w, y, R, N, K, BR=BR, BN=bn, BK=bk, STAGES=stages, num_warps=warps, **extra)
                try:
                    run()
                    err = (y.float() - ref).abs().max().item()
                    us = triton.testing.do_bench_cudagraph(run, rep=20) * 1e3
                except Exception as e:  # a form that does not compile on this card is reported, the others go on
                    print(f"[stream]   {form:18s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                print(f"[stream]   {form:18s} {us:8.1f} us  {floor / us:5.0%} of the copy rate  "
                      f"x torch.mm {base / us:5.2f}  max err {err:.3g}")


if __name__ == "__main__":
    main()
