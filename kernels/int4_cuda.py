"""W4A16 projection y[M, N] = x[M, K] @ w[N, K]^T in CUDA C++, on the PackedWeight layout of
engine/quant_pack.py (Q4_0 / Q4_1 / Q4_K / Q8_0), compiled at run time through CuPy (RawModule, NVRTC).

Definition: kernels.int4_gemm.w4a16_linear_ref (x @ unpack_ref(w)^T in fp32, rounded once).

The kernel (the seed's BTG design, CUDA cores, fp32 arithmetic)
  A block of KW = 4 warps owns 32 weight rows (lane l = row n0 + l) and a tile of BT <= BTG = 8 sequences
  (rows of x); more sequences run over the grid, never over registers. Each lane carries BT fp32
  accumulators in registers. The block walks its K range in chunks of CG = 32 groups (1024 weights):
    1. each warp issues the 16-byte loads of its 8 groups' packed words (32 weights per load; a warp
       reads 32 consecutive rows: 512 contiguous bytes) and their scales before anything else;
    2. the block stages x[tile, chunk] once in shared memory as fp32 (and, for Q4_1 / Q4_K, the per-group
       sums of x);
    3. each weight group is turned into its exact integers once (magic-number conversion: shift, lop3,
       fadd) and applied to all BT sequences:
           P_g[b] = sum_k qq_k * x[b, k]          k ascending, fp32 fma     (qq = q - 8 for Q4_0)
           acc[b] = fma(s_g, P_g[b], acc[b])                                (s = d; Q4_K: d * sc)
           acc[b] = fma(c_g, X_g[b], acc[b])       Q4_1: c = m; Q4_K: c = -(dmin * mn); X_g = sum_k x[b, k]
  Warp w takes groups w, w + 4, ... of every chunk; the four warps' sums are added in warp order at the
  end, then (split-K) the splits' fp32 partials in split order by a second kernel, and rounded once.
  Everything that fixes that order (KW, CG, the split count and boundaries) comes from (N, K, fmt) only,
  and each sequence's accumulators are independent of BT, so the kernel is batch-invariant: row m of y
  is bitwise the same whatever M is. (Its bits differ from the Triton kernel's, whose group sums run on
  tensor cores; kernels/int4_dispatch.py keeps one kernel per shape in its batch-invariant policy.)

  Cost model: the weight bytes are read once per BT sequences; the arithmetic is BT fp32 FMAs plus ~3
  dequantization instructions per weight on the CUDA cores, so the kernel is built for B <= 8, where the
  weight stream, not the tensor cores, decides the time. The tensor-core Triton kernel covers larger B.

Interop: no copies. torch tensors are passed as raw device pointers (data_ptr()), and the launch goes to
torch's current stream (cupy.cuda.ExternalStream), so it is CUDA-graph capturable; nothing is allocated
when ``out`` is given and the split-K workspace is reserved (an eager call of the same or a larger
shape, or ``reserve_workspace``).

CuPy stays optional: importing this module never fails. ``available()`` says whether the kernel can
run: CuPy (RawModule/NVRTC) first, else torch's own NVRTC binding (torch.cuda._compile_kernel, a private
API present since torch 2.8; ``ONEPASS_INT4_CUDA_COMPILER=cupy|torch`` forces one). Without either,
kernels/int4_dispatch.py runs the Triton kernel. The source uses no CUDA headers (conversions in inline
PTX), so it compiles the same under both. Kernels are compiled lazily, one per (format, BT, x dtype,
output kind), and cached for the process.
"""
from __future__ import annotations

import functools
import os

import torch

from engine.quant_pack import GROUP, PackedWeight
from kernels.workspace import SplitKWorkspace

try:  # optional dependency
    import cupy as _cupy  # type: ignore
except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
    _cupy = None

NUM_SMS = 132                 # H200; a constant so the split rule (and so the bits) is machine-independent
KW = 4                        # warps per block, splitting each chunk's groups
ROWS = 32                     # weight rows per block (one per lane)
CG = 32                       # groups per chunk staged in shared memory (1024 weights of K)
BTG = 8                       # the largest batch tile: sequences whose accumulators a lane carries
BT_CHOICES = (1, 2, 4, 8)
TARGET_BLOCKS = 4 * NUM_SMS   # split-K until the grid holds ~4 blocks (16 warps) per SM at one batch tile
MAX_SPLIT = 16
MIN_GROUPS_PER_SPLIT = 8
FMT_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q8_0": 3}
_DTYPES = (torch.bfloat16, torch.float16)

CUDA_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

// FMT 0 q4_0, 1 q4_1, 2 q4_k, 3 q8_0; BT batch tile; X_F16 x (and 16-bit y) is fp16 (else bf16);
// OUT32: y is fp32 (the split-K workspace, or an fp32 output); KW, CG: as the Python module says.
#define WPG (FMT == 3 ? 8 : 4)          /* int32 words per (row, group) */
#define VPG (WPG / 4)                   /* 16-byte vectors per (row, group) */
#define UPW (CG / KW)                   /* groups per warp per chunk */

#ifndef ONEPASS_HOST_EMU   /* tests/cuda_emu.py compiles this source for the CPU with its own helpers */
__device__ __forceinline__ float x_to_f32(u16 v) {
#if X_F16
    float f; asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v)); return f;
#else
    return __int_as_float(((u32)v) << 16);
#endif
}

__device__ __forceinline__ u16 f32_to_x(float f) {
    u16 r;
#if X_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}

__device__ __forceinline__ float h2f(u16 v) {   // fp16 scale / min (the file's bits)
    float f; asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v)); return f;
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {   // weights: read once, keep L1 for x
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
#endif

// nibble s (0..7) of w as a float q exactly: 2^23 + q - 2^23 (- 8 for q4_0)
__device__ __forceinline__ float nib(u32 w, int s) {
    return __int_as_float(0x4B000000u | ((w >> (4 * s)) & 0xFu)) - (FMT == 0 ? 8388616.0f : 8388608.0f);
}
// byte s (0..3) of w (already XOR 0x80808080) as the signed int8 q exactly: 2^23 + (q + 128) - (2^23 + 128)
__device__ __forceinline__ float sbyte(u32 wx, int s) {
    return __int_as_float(0x4B000000u | ((wx >> (8 * s)) & 0xFFu)) - 8388736.0f;
}

extern "C" __global__ void __launch_bounds__(KW * 32)
w4a16_cuda(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
           const u16* __restrict__ mn, const u8* __restrict__ sub, void* __restrict__ y,
           int sxm, int sym, int sys, int M, int N, int G, int gps, int n_bt, int n_nt)
{
    __shared__ __align__(16) float xs[BT][CG * 32];
    __shared__ float xsum[BT][CG];
    __shared__ float red[KW > 1 ? KW - 1 : 1][BT][32];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int nt = pid % n_nt;
    const int s = pid / n_nt;
    const int n = nt * 32 + lane;
    const i64 nr = n < N ? n : N - 1;           // rows past N re-read a valid row; never stored
    const int m0 = bt * BT;
    const int g_lo = s * gps;
    const int g_hi = min(G, g_lo + gps);
    const i64 N64 = N;

    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.0f;

    for (int gc = g_lo; gc < g_hi; gc += CG) {
        const int ng = min(CG, g_hi - gc);
        // 1. this warp's weights and scales for the chunk, all loads in flight before any use
        uint4 wv[UPW][VPG];
        float scl[UPW];
        float cmn[UPW];
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
            const int gi = warp + u * KW;
            const i64 g = gc + (gi < ng ? gi : 0);
#pragma unroll
            for (int v = 0; v < VPG; ++v)
                wv[u][v] = gi < ng ? ld_stream(qw + (g * N64 + nr) * VPG + v) : make_uint4(0u, 0u, 0u, 0u);
#if FMT == 2
            const float d = h2f(sc[(g >> 3) * N64 + nr]);
            const float dmin = h2f(mn[(g >> 3) * N64 + nr]);
            scl[u] = d * (float)sub[(g * N64 + nr) * 2];
            cmn[u] = -(dmin * (float)sub[(g * N64 + nr) * 2 + 1]);
#elif FMT == 1
            scl[u] = h2f(sc[g * N64 + nr]);
            cmn[u] = h2f(mn[g * N64 + nr]);
#else
            scl[u] = h2f(sc[g * N64 + nr]);
            cmn[u] = 0.0f;
#endif
        }
        // 2. x[m0 .. m0+BT, 32*gc .. 32*(gc+ng)) -> fp32 in shared memory (zeros past M and past the chunk)
        __syncthreads();                        // the previous chunk is consumed
        for (int i = threadIdx.x; i < BT * CG * 16; i += KW * 32) {   // two x values per item
            const int b = i / (CG * 16), e = i - b * (CG * 16);
            const int m = m0 + b;
            float v0 = 0.0f, v1 = 0.0f;
            if (m < M && e < ng * 16) {
                const u16* px = x + (i64)m * sxm + (i64)gc * 32 + 2 * e;
                v0 = x_to_f32(px[0]);
                v1 = x_to_f32(px[1]);
            }
            xs[b][2 * e] = v0;
            xs[b][2 * e + 1] = v1;
        }
        __syncthreads();
#if FMT == 1 || FMT == 2
        for (int i = threadIdx.x; i < BT * CG; i += KW * 32) {         // group sums of x, k ascending
            const int b = i / CG, gi = i - b * CG;
            float t = 0.0f;
#pragma unroll 8
            for (int k = 0; k < 32; ++k) t += xs[b][gi * 32 + k];
            xsum[b][gi] = t;
        }
        __syncthreads();
#endif
        // 3. dequantize each group once, apply it to every sequence of the tile
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
            const int gi = warp + u * KW;
            if (gi < ng) {
                float p[BT];
#pragma unroll
                for (int b = 0; b < BT; ++b) p[b] = 0.0f;
#if FMT == 3
                const u32 words[8] = {wv[u][0].x ^ 0x80808080u, wv[u][0].y ^ 0x80808080u, wv[u][0].z ^ 0x80808080u,
                                      wv[u][0].w ^ 0x80808080u, wv[u][VPG - 1].x ^ 0x80808080u,
                                      wv[u][VPG - 1].y ^ 0x80808080u, wv[u][VPG - 1].z ^ 0x80808080u,
                                      wv[u][VPG - 1].w ^ 0x80808080u};
#pragma unroll
                for (int j = 0; j < 8; ++j) {            // word j holds k = 4j .. 4j + 3
                    const float q0 = sbyte(words[j], 0), q1 = sbyte(words[j], 1);
                    const float q2 = sbyte(words[j], 2), q3 = sbyte(words[j], 3);
#pragma unroll
                    for (int b = 0; b < BT; ++b) {
                        const float4 xv = *reinterpret_cast<const float4*>(&xs[b][gi * 32 + 4 * j]);
                        p[b] = __fmaf_rn(q0, xv.x, p[b]);
                        p[b] = __fmaf_rn(q1, xv.y, p[b]);
                        p[b] = __fmaf_rn(q2, xv.z, p[b]);
                        p[b] = __fmaf_rn(q3, xv.w, p[b]);
                    }
                }
#else
                const u32 words[4] = {wv[u][0].x, wv[u][0].y, wv[u][0].z, wv[u][0].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {            // word j holds k = 8j .. 8j + 7, nibble s = k - 8j
                    float q[8];
#pragma unroll
                    for (int t = 0; t < 8; ++t) q[t] = nib(words[j], t);
#pragma unroll
                    for (int b = 0; b < BT; ++b) {
                        const float4 xa = *reinterpret_cast<const float4*>(&xs[b][gi * 32 + 8 * j]);
                        const float4 xb = *reinterpret_cast<const float4*>(&xs[b][gi * 32 + 8 * j + 4]);
                        p[b] = __fmaf_rn(q[0], xa.x, p[b]);
                        p[b] = __fmaf_rn(q[1], xa.y, p[b]);
                        p[b] = __fmaf_rn(q[2], xa.z, p[b]);
                        p[b] = __fmaf_rn(q[3], xa.w, p[b]);
                        p[b] = __fmaf_rn(q[4], xb.x, p[b]);
                        p[b] = __fmaf_rn(q[5], xb.y, p[b]);
                        p[b] = __fmaf_rn(q[6], xb.z, p[b]);
                        p[b] = __fmaf_rn(q[7], xb.w, p[b]);
                    }
                }
#endif
#pragma unroll
                for (int b = 0; b < BT; ++b) {
                    acc[b] = __fmaf_rn(scl[u], p[b], acc[b]);
#if FMT == 1 || FMT == 2
                    acc[b] = __fmaf_rn(cmn[u], xsum[b][gi], acc[b]);
#endif
                }
            }
        }
    }

    // the warps' partial sums, added in warp order by warp 0
#if KW > 1
    __syncthreads();
    if (warp > 0) {
#pragma unroll
        for (int b = 0; b < BT; ++b) red[warp - 1][b][lane] = acc[b];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int w = 0; w < KW - 1; ++w) {
#pragma unroll
        for (int b = 0; b < BT; ++b) acc[b] += red[w][b][lane];
    }
#endif
    if (n >= N) return;
#pragma unroll
    for (int b = 0; b < BT; ++b) {
        const int m = m0 + b;
        if (m < M) {
#if OUT32
            reinterpret_cast<float*>(y)[(i64)s * sys + (i64)m * sym + n] = acc[b];
#else
            reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc[b]);
#endif
        }
    }
}

// y[m, n] = ((ws[0] + ws[1]) + ...) rounded once: the splits in order
extern "C" __global__ void __launch_bounds__(256)
w4a16_splitk_reduce(const float* __restrict__ ws, void* __restrict__ y, int sym, int M, int N, int S)
{
    const i64 idx = (i64)blockIdx.x * 256 + threadIdx.x;
    const i64 total = (i64)M * N;
    if (idx >= total) return;
    const int m = (int)(idx / N), n = (int)(idx - (i64)m * N);
    float acc = ws[idx];
    for (int s = 1; s < S; ++s) acc += ws[(i64)s * total + idx];
#if OUT32
    reinterpret_cast<float*>(y)[(i64)m * sym + n] = acc;
#else
    reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc);
#endif
}
"""


def _compiler() -> str | None:
    """Which NVRTC binding compiles the kernels: "cupy", "torch" or None (the CUDA path is off)."""
    if not torch.cuda.is_available():
        return None
    want = os.environ.get("ONEPASS_INT4_CUDA_COMPILER", "").strip().lower()
    has_torch = hasattr(torch.cuda, "_compile_kernel")
    if want == "cupy":
        return "cupy" if _cupy is not None else None
    if want == "torch":
        return "torch" if has_torch else None
    if want in ("off", "none", "0"):
        return None
    if _cupy is not None:
        return "cupy"
    return "torch" if has_torch else None


def available() -> bool:
    """Whether the CUDA kernel can run here (a CUDA device and an NVRTC binding)."""
    return _compiler() is not None


def compiler() -> str:
    return _compiler() or "none"


def source(fmt: str, bt: int, x_f16: bool, out32: bool) -> str:
    """The full source for one instantiation (the #defines, then CUDA_SOURCE)."""
    head = (f"#define FMT {FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n#define OUT32 {int(out32)}\n"
            f"#define KW {KW}\n#define CG {CG}\n")
    return head + CUDA_SOURCE


class _Kernel:
    """One compiled kernel, launched on torch's current stream with raw pointers."""

    def __init__(self, src: str, name: str, how: str, device: torch.device):
        self.how, self.name = how, name
        if how == "cupy":
            with _cupy.cuda.Device(device.index or 0):
                mod = _cupy.RawModule(code=src, options=("--std=c++14",))
                self.fn = mod.get_function(name)
            self._mod = mod
            self._streams: dict[int, object] = {}
        else:
            with torch.cuda.device(device):
                self.fn = torch.cuda._compile_kernel(src, name)

    def __call__(self, grid: int, block: int, args: list, device: torch.device) -> None:
        stream = torch.cuda.current_stream(device)
        if self.how == "cupy":
            import numpy as np

            ptr = stream.cuda_stream
            ext = self._streams.get(ptr)
            if ext is None:
                ext = self._streams[ptr] = _cupy.cuda.ExternalStream(ptr, device.index or 0)
            cargs = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else np.int32(a) for a in args)
            with _cupy.cuda.Device(device.index or 0), ext:
                self.fn((grid,), (block,), cargs)
        else:
            self.fn(grid=(grid, 1, 1), block=(block, 1, 1), args=list(args), stream=stream)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, fmt: str, bt: int, x_f16: bool, out32: bool, device: torch.device) -> _Kernel:
    how = _compiler()
    if how is None:
        raise RuntimeError("int4_cuda: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return _Kernel(source(fmt, bt, x_f16, out32), name, how, device)


# --------------------------------------------------------------------------------------------------
# configuration: everything that fixes the bits comes from (N, K, fmt) alone

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def split_rule(N: int, K: int, fmt: str) -> tuple[int, int]:
    """(splits, groups per split): the smallest S <= MAX_SPLIT whose grid (one batch tile) reaches
    TARGET_BLOCKS, keeping >= MIN_GROUPS_PER_SPLIT groups per split; S recomputed so no split is empty."""
    G = K // GROUP
    n_nt = _cdiv(N, ROWS)
    S = 1
    while S < MAX_SPLIT and n_nt * S < TARGET_BLOCKS and _cdiv(G, S + 1) >= MIN_GROUPS_PER_SPLIT:
        S += 1
    gps = _cdiv(G, S)
    return _cdiv(G, gps), gps


def batch_tile(M: int) -> int:
    """BT: the smallest of 1/2/4/8 holding M (8 above: more tiles over the grid)."""
    return next((b for b in BT_CHOICES if M <= b), BTG)


def cuda_config(M: int, N: int, K: int, fmt: str) -> dict:
    S, gps = split_rule(N, K, fmt)
    bt = batch_tile(M)
    n_bt, n_nt = _cdiv(M, bt), _cdiv(N, ROWS)
    return {"BT": bt, "SPLIT_K": S, "groups_per_split": gps, "grid": n_bt * n_nt * S, "block": KW * 32,
            "n_bt": n_bt, "n_nt": n_nt, "workspace_floats": S * M * N if S > 1 else 0}


_SPLITK = SplitKWorkspace()


def reserve_workspace(device: torch.device | str, shapes, max_rows: int) -> None:
    """Size the split-K workspace for up to max_rows rows of every (N, K, fmt) in shapes (before capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    need = max([cuda_config(max_rows, n, k, f)["workspace_floats"] for n, k, f in shapes], default=0)
    if need:
        _SPLITK.get(device, need)


# --------------------------------------------------------------------------------------------------
# host entry point

def w4a16_cuda(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w^T for a packed weight with the CUDA kernel (module docstring). x [M, K] bf16/fp16 with
    unit column stride; out [M, N] (unit column stride) of x's dtype or float32, allocated when None."""
    assert isinstance(pw, PackedWeight), f"w4a16_cuda: pw must be a PackedWeight, got {type(pw).__name__}"
    assert x.dim() == 2 and x.shape[1] == pw.K, f"w4a16_cuda: x {tuple(x.shape)} vs weight [{pw.N}, {pw.K}]"
    assert x.dtype in _DTYPES, f"w4a16_cuda: x dtype {x.dtype} not supported (bf16 / fp16)"
    assert x.is_cuda and pw.qweight.device == x.device, "w4a16_cuda: x and the weight must be on one CUDA device"
    M, K = x.shape
    N = pw.N
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.dtype in (x.dtype, torch.float32), \
        f"w4a16_cuda: out {tuple(out.shape)} {out.dtype}, expected {(M, N)} {x.dtype} or float32"
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if x.stride(1) != 1 or M > 1 and x.stride(0) < K:
        x = x.contiguous()
    if out.stride(1) != 1:
        return out.copy_(w4a16_cuda(x, pw))
    cfg = cuda_config(M, N, K, pw.fmt)
    x_f16 = x.dtype == torch.float16
    out32 = out.dtype == torch.float32
    G = K // GROUP
    c = pw.mins if pw.mins is not None else pw.scales
    sub = pw.sub if pw.sub is not None else pw.scales
    S, dev = cfg["SPLIT_K"], x.device
    sxm = x.stride(0) if M > 1 else K
    sym = out.stride(0) if M > 1 else N
    if S == 1:
        k = _kernel("w4a16_cuda", pw.fmt, cfg["BT"], x_f16, out32, dev)
        k(cfg["grid"], cfg["block"], [x, pw.qweight, pw.scales, c, sub, out, sxm, sym, 0, M, N, G,
                                     cfg["groups_per_split"], cfg["n_bt"], cfg["n_nt"]], dev)
        return out
    ws = _SPLITK.get(dev, S * M * N)
    k = _kernel("w4a16_cuda", pw.fmt, cfg["BT"], x_f16, True, dev)
    k(cfg["grid"], cfg["block"], [x, pw.qweight, pw.scales, c, sub, ws, sxm, N, M * N, M, N, G,
                                 cfg["groups_per_split"], cfg["n_bt"], cfg["n_nt"]], dev)
    r = _kernel("w4a16_splitk_reduce", "q4_0", 1, x_f16, out32, dev)   # format-free
    r(_cdiv(M * N, 256), 256, [ws, out, sym, M, N, S], dev)
    return out


__all__ = ["w4a16_cuda", "available", "compiler", "cuda_config", "split_rule", "reserve_workspace", "CUDA_SOURCE",
           "source", "BTG"]
