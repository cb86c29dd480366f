"""Run the CUDA sources of kernels/int4_mma.py, kernels/int4_wgmma.py, kernels/int4_wgmma_ws.py and the split-K
reduce of kernels/nvrtc.py on the CPU: the same source text compiled by g++ with a shim (blocks one after another,
each block's threads as std::threads meeting at a std::barrier for __syncthreads, __shared__ as function statics
shared by the block's threads (dynamic shared memory: one buffer of the host's size, checked against the kernel's;
cp.async as an immediate copy), the inline-PTX helpers replaced by bit-exact C++, and mma.sync m16n8k16 as a
warp-wide exchange of fragments through memory, with PTX's fragment layout). It checks the kernels' indexing,
fragment mapping, masking, staging, split-K and reduction order without a GPU; it says nothing about speed, about the
PTX helpers themselves or about the tensor cores' own summation order (the GPU tests do)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define ONEPASS_HOST_EMU 1
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct dim3e { unsigned x; };
static thread_local dim3e threadIdx;
static dim3e blockIdx;
static std::barrier<>* g_bar;
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
using std::min;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
typedef unsigned short u16_;
static inline float h2f(u16_ v) { _Float16 h; std::memcpy(&h, &v, 2); return (float)h; }
static inline float x_to_f32(u16_ v) {
#if X_F16
    return h2f(v);
#else
    unsigned u = ((unsigned)v) << 16; return __int_as_float(u);
#endif
}
static inline u16_ f32_to_x(float f) {
#if X_F16
    _Float16 h = (_Float16)f; u16_ r; std::memcpy(&r, &h, 2); return r;
#else
    unsigned u; std::memcpy(&u, &f, 4); u = u + 0x7FFFu + ((u >> 16) & 1u); return (u16_)(u >> 16);
#endif
}
static inline unsigned and_or(unsigned a, unsigned b, unsigned c) { return (a & b) | c; }
"""

LAUNCH_REDUCE = r"""
extern "C" void launch_reduce(int grid, const float* ws, void* y, int sym, int M, int N, int S) {
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < 256; ++t) { threadIdx.x = t; w4a16_splitk_reduce(ws, y, sym, M, N, S); }
    }
}
"""


# the extra helpers of kernels/int4_mma.py's source
SHIM_MMA = r"""
static inline unsigned ld_word(const unsigned* p) { return *p; }
static unsigned char* g_smem;          // the block's dynamic shared memory
// cp.async as an immediate copy (the emulator cannot check the waits; the GPU tests do)
static inline unsigned smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - g_smem); }
static inline void cp_async16_s(unsigned dst, const void* src, int bytes) {
    if (bytes) std::memcpy(g_smem + dst, src, 16); else std::memset(g_smem + dst, 0, 16);
}
static inline void cp_async_commit() {}
static inline void cp_async_wait_all() {}
static inline uint4 ld_x16(const uint4* p) { return *p; }
static inline uint4 ld_w16(const uint4* p) { return *p; }
static inline unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned char by[8]; std::memcpy(by, &a, 4); std::memcpy(by + 4, &b, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)by[(sel >> (4 * i)) & 7] << (8 * i);
    return r;
}
static inline float h16_to_f(unsigned v) { return x_to_f32((u16_)v); }
static inline unsigned pack2(float f) { const unsigned h = f32_to_x(f); return h | (h << 16); }
static inline unsigned fma2(unsigned a, unsigned b, unsigned c) {
    unsigned lo = f32_to_x(std::fma(h16_to_f(a & 0xFFFFu), h16_to_f(b & 0xFFFFu), h16_to_f(c & 0xFFFFu)));
    unsigned hi = f32_to_x(std::fma(h16_to_f(a >> 16), h16_to_f(b >> 16), h16_to_f(c >> 16)));
    return lo | (hi << 16);
}
struct WarpMma { std::barrier<>* bar; unsigned a[32][4]; unsigned b[32][2]; unsigned addr[32]; };
static WarpMma* g_warps;
// D (+)= A (16 x 16) B (16 x 8): lane (g, t) gives A rows g, g + 8 at k 2t, 2t + 1 (+ 8) and B column g at the
// same k, and gets D rows g, g + 8 at columns 2t, 2t + 1 (PTX ISA, mma.m16n8k16 fragments)
static inline void mma16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    const int lane = threadIdx.x & 31;
    WarpMma& W = g_warps[threadIdx.x >> 5];
    for (int j = 0; j < 4; ++j) W.a[lane][j] = a[j];
    W.b[lane][0] = b[0]; W.b[lane][1] = b[1];
    W.bar->arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
        const int row = g + (j >= 2 ? 8 : 0), col = 2 * t + (j & 1);
        float s = d[j];
        for (int k = 0; k < 16; ++k) {
            const unsigned av = W.a[(row & 7) * 4 + (k & 7) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
            const unsigned bv = W.b[col * 4 + (k & 7) / 2][k >= 8 ? 1 : 0];
            s += h16_to_f((av >> (16 * (k & 1))) & 0xFFFFu) * h16_to_f((bv >> (16 * (k & 1))) & 0xFFFFu);
        }
        d[j] = s;
    }
    W.bar->arrive_and_wait();
}
"""

LAUNCH_MMA = r"""
extern "C" int launch_mma(int grid, int block, const u16* x, const u32* qw, const u16* sc, const u16* mn,
                           const u16* sub, void* y, int sxm, int sym, int sys, int M, int N, int G, int gps,
                           int n_bt, int n_nt, int smem_bytes, unsigned seed, float* ws, int* flags) {
    if (smem_bytes != SMEM_TOTAL) return -1;          // the host's shared-memory size must be the kernel's
    const int nw = block / 32;
    std::vector<uint4> smem((SMEM_TOTAL + 15) / 16);
    g_smem = reinterpret_cast<unsigned char*>(smem.data());
    std::vector<int> order(grid);                      // blocks in a seeded random order: results must not care
    for (int i = 0; i < grid; ++i) order[i] = i;
    for (int i = grid - 1; i > 0; --i) {
        seed = seed * 1664525u + 1013904223u; std::swap(order[i], order[seed % (i + 1)]);
    }
    for (int ob = 0; ob < grid; ++ob) {
        const int b = order[ob];
        blockIdx.x = b;
        std::barrier<> bar(block);
        g_bar = &bar;
        std::vector<std::unique_ptr<std::barrier<>>> wbars;
        std::vector<WarpMma> warps(nw);
        for (int w = 0; w < nw; ++w) { wbars.emplace_back(new std::barrier<>(32)); warps[w].bar = wbars[w].get(); }
        g_warps = warps.data();
#ifdef ONEPASS_EMU_WG
        std::vector<WgMma> wgs(block / 128);           // a warpgroup's 128 threads meet at its own barrier
        for (auto& wg : wgs) { wbars.emplace_back(new std::barrier<>(128)); wg.bar = wbars.back().get(); }
        g_wgs = wgs.data();
#endif
#ifdef ONEPASS_EMU_WS
        std::barrier<> cbar(block - 128);              // the consumer warpgroups' named barrier
        g_cbar = &cbar;
        g_mbars.clear();
#endif
        std::vector<std::thread> ts;
        for (int t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx.x = t; KERNEL(x, qw, sc, mn, sub, y, sxm, sym, sys, M, N, G, gps, n_bt, n_nt
#if SK
                                                          , ws, flags
#endif
                                                          ); });
        for (auto& t : ts) t.join();
    }
    return 0;
}
"""

# kernels/int4_wgmma.py's helpers: a warpgroup's 128 threads exchange their A fragments, B comes from the block's
# shared memory through the descriptor (PTX ISA: start address, leading-dimension offset = between the two k halves'
# core matrices, stride-dimension offset = between 8-row blocks, each core matrix 8 rows x 16 B; 16 B units, no
# swizzle; or the 128-byte swizzle, layout type 1), each k16 step summed in k order like mma16816; fences and waits
# are no-ops here
SHIM_WG = r"""
#define ONEPASS_EMU_WG 1
struct WgMma { std::barrier<>* bar; unsigned a[128][4]; };
static WgMma* g_wgs;
static inline void wgmma_fence() {}
static inline void wgmma_commit() {}
template <int PENDING> static inline void wgmma_wait() {}
template <int PENDING> static inline void cp_async_wait() {}
static inline void fence_proxy_async() {}
static inline void fence_operand(float&) {}
// stream-K: only thread 0 touches the flags and blocks run one after another, so plain reads and writes do
static inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
static inline int atomicExch(int* p, int v) { const int o = *p; *p = v; return o; }
static inline void __threadfence() {}
static inline float __ldcg(const float* p) { return *p; }
static inline float4 __ldcg(const float4* p) { return *p; }
static inline void __stcg(float4* p, float4 v) { *p = v; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
template <int NN>
static inline void wgmma_rs(float (&d)[NN], const unsigned (&a)[4], unsigned long long desc, int add) {
    const int tid = threadIdx.x & 127, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    WgMma& W = g_wgs[threadIdx.x >> 7];
    for (int j = 0; j < 4; ++j) W.a[tid][j] = a[j];
    W.bar->arrive_and_wait();
    const unsigned start = (unsigned)(desc & 0x3FFFu) << 4, lbo = (unsigned)((desc >> 16) & 0x3FFFu) << 4,
                   sbo = (unsigned)((desc >> 32) & 0x3FFFu) << 4;
    const unsigned swz = (unsigned)(desc >> 62);      // 0: no swizzle, 1: 128-byte swizzle (the two the kernel uses)
    for (int c = 0; c < NN / 4; ++c) {
        for (int j = 0; j < 4; ++j) {
            const int row = g + (j >= 2 ? 8 : 0), col = 8 * c + 2 * t + (j & 1);
            float s = add ? d[4 * c + j] : 0.0f;            // scale-d 0: the accumulator is not read
            for (int k = 0; k < 16; ++k) {
                const unsigned av = W.a[w * 32 + (row & 7) * 4 + (k & 7) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
                u16_ bv;
                unsigned addr;
                if (swz)    // 128-byte swizzle, K-major: rows 128 B apart, address bits 4-6 ^= bits 7-9
                    addr = start + (col >> 3) * sbo + (col & 7) * 128 + (k >> 3) * 16 + (k & 7) * 2,
                    addr ^= ((addr >> 7) & 7u) << 4;
                else
                    addr = start + (col >> 3) * sbo + (k >> 3) * lbo + (col & 7) * 16 + (k & 7) * 2;
                std::memcpy(&bv, g_smem + addr, 2);
                s += h16_to_f((av >> (16 * (k & 1))) & 0xFFFFu) * h16_to_f(bv);
            }
            d[4 * c + j] = s;
        }
    }
    W.bar->arrive_and_wait();
}
"""


def available() -> bool:
    return shutil.which("g++") is not None


FULL = os.environ.get("ONEPASS_FULL_EMULATION") == "1"


def wider(*cases) -> list:
    """Emulation cases that CI leaves to `make test-full` (ONEPASS_FULL_EMULATION=1): each costs seconds of CPU and
    repeats features the cases CI runs cover, in other combinations (shape, format, ring depth, consumer count)."""
    skip = pytest.mark.skipif(not FULL, reason="a wider emulation case: make test-full runs it "
                                               "(ONEPASS_FULL_EMULATION=1)")
    return [pytest.param(c, marks=skip) for c in cases]


FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-pthread"]
# the standard headers every emulated source includes, parsed once as a precompiled header: about half of each of the
# test suite's ~250 compiles is spent parsing them
STD_HEADERS = ("algorithm", "barrier", "cmath", "cstring", "map", "memory", "mutex", "thread", "vector")


def _run_gxx(args: list[str]) -> None:
    r = subprocess.run(["g++", *FLAGS, *args], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(f"g++ failed:\n{r.stderr[-4000:]}")


@functools.lru_cache(maxsize=None)
def _std_header(d: Path) -> Path:
    """The precompiled standard headers (g++ uses header.gch in place of header where the flags match), built once per
    directory; written under a temporary name and renamed, so parallel test workers never read a partial one."""
    text = "".join(f"#include <{h}>\n" for h in STD_HEADERS)
    header = d / f"std_{hashlib.sha256((text + ' '.join(FLAGS)).encode()).hexdigest()[:12]}.h"
    if not (d / f"{header.name}.gch").exists():
        header.write_text(text)
        part = d / f"{header.name}.{os.getpid()}.gch"
        _run_gxx(["-x", "c++-header", str(header), "-o", str(part)])
        part.replace(d / f"{header.name}.gch")
    return header


@functools.lru_cache(maxsize=None)
def _lib(src: str) -> ctypes.CDLL:
    d = Path(tempfile.gettempdir()) / "onepass_cuda_emu"
    d.mkdir(exist_ok=True)
    h = hashlib.sha256(src.encode()).hexdigest()[:16]
    so = d / f"k{h}.so"
    if not so.exists():
        cpp = d / f"k{h}.cpp"
        cpp.write_text(src)
        part = d / f"k{h}.{os.getpid()}.so"
        _run_gxx(["-shared", "-include", str(_std_header(d)), "-o", str(part), str(cpp)])
        part.replace(so)
    return ctypes.CDLL(str(so))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def splitk_reduce_emulated(ws: torch.Tensor, out32: bool = False) -> torch.Tensor:
    """kernels/nvrtc.py's split-K reduce kernel on the CPU: ws [S, M, N] fp32 partials -> y [M, N] (fp32, or bf16
    rounded once)."""
    from onepass.kernels import nvrtc

    S, M, N = ws.shape
    h, body = _split_defines(nvrtc.reduce_source(False, out32), nvrtc.REDUCE_DEFINES)
    lib = _lib(h + "\n" + SHIM + body + LAUNCH_REDUCE)
    y = torch.zeros((M, N), dtype=torch.float32 if out32 else torch.bfloat16)
    ws = ws.contiguous()
    lib.launch_reduce(ctypes.c_int(-(-M * N // 256)), _ptr(ws), _ptr(y), ctypes.c_int(N), ctypes.c_int(M),
                      ctypes.c_int(N), ctypes.c_int(S))
    return y


def _run_tensor_core(x: torch.Tensor, pw, cfg: dict, head_and_body: list[str], shims: str, kernel: str,
                     out32: bool, seed: int, shape: tuple[int, int] | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """One launch of int4_mma's or int4_wgmma's source (its defines, then the emulator's shims, then the body) with
    the arguments run_packed gives it; split-K partials added in split order (nvrtc's reduce kernel's order).
    Stream-K (cfg["workers"]): the workspace (a guard past its planned size must stay untouched) and zeroed flags
    too, which the kernel must leave zero. shape, dtype:
    x's [M, K] and dtype where x is a staged image rather than the matrix."""
    from onepass.kernels.quant_pack import GROUP

    M, K = shape or x.shape
    dtype = dtype or x.dtype
    N, S, workers = pw.N, cfg["SPLIT_K"], cfg.get("workers", 0)
    c = pw.mins if pw.mins is not None else pw.scales
    sub = pw.sub if pw.sub is not None else pw.scales
    o32 = out32 or S > 1
    h, body = head_and_body
    lib = _lib(h + "\n" + SHIM + SHIM_MMA + shims + f"#define KERNEL {kernel}\n#ifndef SK\n#define SK 0\n#endif\n"
               + body + LAUNCH_MMA)
    y = torch.zeros((S, M, N) if o32 else (M, N), dtype=torch.float32 if o32 else dtype)
    n_ws = max(1, cfg.get("workspace_floats", 0))
    ws = torch.full((2 * n_ws + 4096,), float("nan"))     # past n_ws: a guard the kernel must leave untouched
    flags = torch.zeros(max(1, cfg.get("flag_ints", 0)), dtype=torch.int32)
    ints = lambda *a: [ctypes.c_int(int(v)) for v in a]  # noqa: E731
    rc = lib.launch_mma(*ints(cfg["grid"], cfg["block"]), _ptr(x.view(torch.int16)), _ptr(pw.qweight),
                        _ptr(pw.scales), _ptr(c), _ptr(sub), _ptr(y),
                        *ints(K, N, M * N, M, N, K // GROUP, workers or cfg["groups_per_split"], cfg["n_bt"],
                              cfg["n_nt"], cfg["smem"]),
                        ctypes.c_uint(seed), _ptr(ws), _ptr(flags))
    assert rc == 0, f"{kernel}: the host's smem_bytes gives {cfg['smem']} B, the kernel's SMEM_TOTAL differs"
    assert not flags.any(), f"{kernel}: stream-K flags left set: {flags.nonzero().flatten().tolist()}"
    assert ws[n_ws:].isnan().all(), f"{kernel}: wrote past the {n_ws} workspace floats its plan reserves"
    if not o32:
        return y
    acc = y[0].clone()
    for s in range(1, S):
        acc += y[s]
    return acc if out32 else acc.to(dtype)


def _split_defines(src: str, n: int) -> list[str]:
    h = src.split("\n", n)
    return ["\n".join(h[:n]), h[n]]


def w4a16_mma_emulated(x: torch.Tensor, pw, out32: bool = False, config: dict | None = None,
                       fold: bool = False, seed: int = 0) -> torch.Tensor:
    """kernels.int4_mma.w4a16_mma's launch (same config, same arguments) on the CPU, its blocks in a random order
    (seed); split-K partials are added in split order as nvrtc's reduce kernel does."""
    from onepass.kernels import int4_mma

    x = x.contiguous()
    M, K = x.shape
    cfg = int4_mma.mma_config(M, pw.N, K, pw.fmt, config, fold)
    src = int4_mma.source(pw.fmt, cfg["BT"], x.dtype == torch.float16, out32 or cfg["SPLIT_K"] > 1, cfg["RT"], cfg["P"],
                          cfg["U"], pw.N % 16 == 0, fold, cfg["MINB"], cfg["MT"])
    return _run_tensor_core(x, pw, cfg, _split_defines(src, int4_mma.SOURCE_DEFINES), "", "w4a16_mma", out32, seed)


def w4a16_wgmma_emulated(x: torch.Tensor, pw, out32: bool = False, config: dict | None = None,
                         seed: int = 0) -> torch.Tensor:
    """kernels.int4_wgmma.w4a16_wgmma's launch (same config, same arguments) on the CPU, its blocks in a random
    order (seed); split-K partials added in split order."""
    from onepass.kernels import int4_wgmma

    x = x.contiguous()
    M, K = x.shape
    cfg = int4_wgmma.wg_config(M, pw.N, K, pw.fmt, config)
    src = int4_wgmma.source(pw.fmt, cfg["BT"], x.dtype == torch.float16, out32 or cfg["SPLIT_K"] > 1, cfg["WGS"],
                            cfg["MT"], cfg["U"], cfg["STAGES"], cfg["MINB"], cfg["SWZ"], cfg["workers"] > 0)
    return _run_tensor_core(x, pw, cfg, _split_defines(src, int4_wgmma.SOURCE_DEFINES), SHIM_WG, "w4a16_wgmma", out32,
                            seed)


# kernels/int4_wgmma_ws.py's helpers: mbarriers as (expected arrivals, pending bytes, completed phases) under a lock,
# a bulk copy as an immediate copy that then completes its bytes, the consumers' named barrier as a std::barrier;
# setmaxnreg is a no-op. The waits spin on the phase parity as try_wait.parity does, so the producer really runs
# ahead of the consumers by the ring's depth and the ring's hand-over order is exercised.
SHIM_WS = r"""
#define ONEPASS_EMU_WS 1
#include <map>
#include <mutex>
struct EmuBar { int count, pending, tx, phase; };
static std::mutex g_mbar_mx;
static std::map<unsigned, EmuBar> g_mbars;
static std::barrier<>* g_cbar;
static inline void consumer_sync() { g_cbar->arrive_and_wait(); }
static inline void emu_bar_step(EmuBar& b) { if (b.pending == 0 && b.tx == 0) { b.phase ^= 1; b.pending = b.count; } }
static inline void mbar_init(unsigned bar, unsigned count) {
    std::lock_guard<std::mutex> l(g_mbar_mx); g_mbars[bar] = {(int)count, (int)count, 0, 0};
}
static inline void mbar_init_fence() {}
static inline void mbar_expect_tx(unsigned bar, unsigned bytes) {
    std::lock_guard<std::mutex> l(g_mbar_mx); EmuBar& b = g_mbars.at(bar);
    b.tx += bytes; b.pending -= 1; emu_bar_step(b);
}
static inline void mbar_arrive(unsigned bar) {
    std::lock_guard<std::mutex> l(g_mbar_mx); EmuBar& b = g_mbars.at(bar); b.pending -= 1; emu_bar_step(b);
}
static inline void mbar_wait(unsigned bar, unsigned parity) {      // the phase of this parity has completed
    for (;;) {
        { std::lock_guard<std::mutex> l(g_mbar_mx); if (g_mbars.at(bar).phase != (int)parity) return; }
        std::this_thread::yield();
    }
}
static inline void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    if (bytes % 16 || dst % 16 || (reinterpret_cast<unsigned long long>(src) & 15)) std::abort();   // PTX's rules
    std::memcpy(g_smem + dst, src, bytes);
    std::lock_guard<std::mutex> l(g_mbar_mx); EmuBar& b = g_mbars.at(bar); b.tx -= bytes; emu_bar_step(b);
}
static inline void bulk_copy_w(unsigned dst, const void* src, unsigned bytes, unsigned bar) {   // no L2 to hint
    bulk_copy(dst, src, bytes, bar);
}
template <int R> static inline void regs_dec() {}
template <int R> static inline void regs_inc() {}
// ldmatrix .x4: the warp's 32 row addresses exchanged; register m of lane l: matrix m's row l >> 2,
// 4 bytes at 4 (l & 3)
static inline void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    const int lane = threadIdx.x & 31;
    WarpMma& W = g_warps[threadIdx.x >> 5];
    W.addr[lane] = addr;
    W.bar->arrive_and_wait();
    for (int m = 0; m < 4; ++m) std::memcpy(&r[m], g_smem + W.addr[8 * m + (lane >> 2)] + 4 * (lane & 3), 4);
    W.bar->arrive_and_wait();
}
static inline void __syncwarp() { g_warps[threadIdx.x >> 5].bar->arrive_and_wait(); }
"""

LAUNCH_STAGE = r"""
extern "C" void launch_stage(int grid, const u16* x, unsigned char* xs, int sxm, int M, int G, int Q, int units) {
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < 256; ++t) { threadIdx.x = t; wg_stage_x(x, xs, sxm, M, G, Q, units); }
    }
}
"""


def w4a16_wgmma_ws_emulated(x: torch.Tensor, pw, out32: bool = False, config: dict | None = None,
                            seed: int = 0, staged_only: bool = False) -> torch.Tensor:
    """kernels.int4_wgmma_ws.w4a16_wgmma_ws's two launches (x staged into the ring's image, then the GEMM reading
    it; same config, same arguments) on the CPU, the GEMM's blocks in a random order (seed). staged_only: the
    staging launch alone; returns its image (int16, x_staged / 2 elements; the config must stage x)."""
    from onepass.kernels.quant_pack import GROUP
    from onepass.kernels import int4_wgmma_ws as ws

    x = x.contiguous()
    M, K = x.shape
    cfg = ws.ws_config(M, pw.N, K, pw.fmt, config)
    src = ws.source(pw.fmt, cfg["BT"], x.dtype == torch.float16, out32 or cfg["SPLIT_K"] > 1, cfg["STAGES"], 1,
                    cfg["workers"] > 0, cfg["WG_MT"], cfg["CWG"], cfg["x_in_gemm"], bool(cfg["MMA"]),
                    ready=bool(cfg["ready"]))
    if cfg["ready"]:                           # the kernel's sub argument: the ready scale words, as on the GPU
        pw = dataclasses.replace(pw, sub=ws.ready_words(pw, x.dtype).view(torch.uint8))
    head, body = _split_defines(src, ws.SOURCE_DEFINES)
    if cfg["x_in_gemm"]:                       # one launch: the GEMM stages x itself
        return _run_tensor_core(x, pw, cfg, [head, body], SHIM_WG + SHIM_WS, "w4a16_wgmma_ws", out32, seed)
    lib = _lib(head + "\n" + SHIM + SHIM_MMA + SHIM_WG + SHIM_WS + body + LAUNCH_STAGE)
    units = cfg["stage_units"]
    xs = torch.full((cfg["x_staged"] // 2,), -1, dtype=torch.int16)      # every byte is written
    lib.launch_stage(ctypes.c_int(-(-units // 256)), _ptr(x.view(torch.int16)), _ptr(xs),
                     *[ctypes.c_int(v) for v in (K, M, K // GROUP, cfg["quads"], units)])
    if staged_only:
        return xs
    return _run_tensor_core(xs.view(1, -1), pw, cfg, [head, body], SHIM_WG + SHIM_WS, "w4a16_wgmma_ws", out32, seed,
                            shape=(M, K), dtype=x.dtype)


__all__ = ["available", "w4a16_mma_emulated", "w4a16_wgmma_emulated", "w4a16_wgmma_ws_emulated",
           "splitk_reduce_emulated", "np"]
