"""W4A16 projection for one to a few sequences as a stream-K GEMV: y[M, N] = x[M, K] @ w[N, K]^T on the folded
weights (the dispatch's "cuda_mma_sk"), compiled at run time like kernels/int4_mma.py, whose device code (the quad
loads, the folded A fragments, mma.sync) it shares.

Definition: kernels.int4_gemm.w4a16_linear_ref(x, pw, folded=True), i.e. x @ unpack_folded(w, x.dtype)^T.

Why: a GEMV grid of blocks that each stream a fixed piece of the weight ends in a tail. Its last blocks start when
the others finish and run with few loads in flight of their own, so DRAM idles while they finish; and every block
pays its start (first loads, x staged, partials written). H200 (int4_gemm's method, B = 1, partials deferred, the
folded kernel's default launch against its exact form): over 30720..36864 x 5120 Q4_0 a call takes ~6 / ~13 us
more than its bytes at the marginal rate, the duration of one of their blocks alone (73.7 KB with 18 KB in flight,
36.9 with 4.6); more, smaller blocks lose to their starts (34816x5120 in 5 / 10 / 20 splits: 33.8 / 36.6 / 39.0 us).
Here the grid is what the GPU holds at once (BPS blocks of KW warps per SM), every warp starts at once and streams
an equal share of the weight with its ring of loads running on from one piece to the next, and x is staged once
per block: all warps end together, and there is one start per call.

Work: the units are (16-row tile r, quad j of 4 groups), tile-major; T = ceil(N / 16) * ceil(G / 4) of them. Warp w
(W = NUM_SMS * BPS * KW of them) takes units floor(w T / W) .. floor((w + 1) T / W) - 1, so a tile is shared by the
warps whose ranges meet it. A warp accumulates its units of one tile in quad order (per quad int4_mma's folded
arithmetic: four words, two mmas each, one fp32 accumulation), and where its range leaves the tile it writes the
sum as that tile's partial number (w - the tile's first warp); the warp holding a tile's last quad zeroes the
partials the tile does not use, up to the shape's most, SLOTS. The partials are split-K partials in K order:
int4_cuda's reduce, or the next kernel (defer), adds them in slot order.
x: the batch tile's BT rows, all of K, staged once per block in the order the mmas read (int4_mma's folded
staging); lanes past the batch tile feed zeros. Batches of more than BT rows take the weight again per batch tile.

Batch invariance: the units, W and so each tile's partials come from (N, K, fmt) and the shape's launch alone; BT
only chooses which mma columns are live, and the columns are independent. Row m of y is bitwise the same whatever
M is. The bits differ from the folded kernel's (other K ranges per partial): a variant of its own.
"""
from __future__ import annotations

import functools

import torch

from engine.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from kernels import int4_cuda, int4_mma

FORMATS = int4_mma.FOLD_FORMATS
NUM_SMS = int4_cuda.NUM_SMS
BT_CHOICES = (1, 2, 4, 8)
SMEM_LIMIT = int4_mma.SMEM_LIMIT        # one block's x
SMEM_PER_SM = 220 * 1024                # the BPS blocks' x together (the H200 holds 227 KB a block, 228 an SM)
# launch per shape: KW warps a block, BPS blocks a SM, SMS the SMs the grid is sized for (W = SMS * BPS * KW warps: a
# shape constant, it fixes the bits; SMS is NUM_SMS but in the CPU emulator's tests), U quads of loads in flight a warp
DEFAULTS = {"KW": 8, "BPS": 4, "U": 2, "SMS": NUM_SMS}
MEASURED: dict[tuple[int, int, str], dict] = {}
CONFIG_KEYS = ("KW", "BPS", "U", "SMS")

SK_KERNEL = r"""
#undef SMEM_TOTAL
#define SMEM_TOTAL (BT * ((G + 3) >> 2) * 256)     /* x: BT rows x quads x 16 items of 16 bytes */
// staged item e = 16 j + 4 t + p (word p of group 4 j + t) sits at 16 j + 4 p + t: the order apply_unit reads
#define XSLOT(e) (((e) & ~15) | (((e) & 3) << 2) | (((e) >> 2) & 3))

struct Unit { int r, j; };                         // 16-row tile r, quad j
__device__ __forceinline__ void next_unit(Unit& v, int Q) {
    if (++v.j == Q) { v.j = 0; ++v.r; }
}
// the unit's loads for lane (g8, t): rows 16 r + g8 and + 8 (rows past N re-read row N - 1), group 4 j + t
__device__ __forceinline__ void load_unit(QSlot& sl, QCursor& c, const Unit& v, int N, int G, int g8, int t) {
    const int na = min(16 * v.r + g8, N - 1);
    c.na[0] = na;
    c.db[0] = min(16 * v.r + g8 + 8, N - 1) - na;
    c.g = 4 * v.j + t;
    load_quad(sl, c, N, G);
}
// quad j of a tile into acc: per word two mmas, x's fragment from the staged row (zeros past the batch tile)
__device__ __forceinline__ void apply_unit(float (&acc)[4], const QSlot& sl, const u32* xr, bool live, int j, int t) {
    const QScales q = quad_scales(sl);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a_lo[4], a_hi[4];
        quad_word(sl, q, p, 0, a_lo, a_hi);
        const uint4 xv = live ? *reinterpret_cast<const uint4*>(xr + ((4 * j + p) * 4 + t) * 4) : make_uint4(0, 0, 0, 0);
        const u32 b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
        mma16816(acc, a_lo, b_lo);
        mma16816(acc, a_hi, b_hi);
    }
}
// the warp that owns unit u: lo(w) <= u < lo(w + 1), lo(w) = floor(w T / W)
__device__ __forceinline__ int unit_owner(i64 u, i64 T, int W) { return (int)(((u + 1) * W - 1) / T); }

// the warp's sum over tile r's quads of its range -> partial slot (of `slots`); the tile's last quad: zeros in the
// slots after it. Lane (g8, t) holds rows g8, g8 + 8 x columns 2t, 2t + 1.
__device__ __forceinline__ void store_partial(void* y, const float (&acc)[4], int slot, int zero_to, int r, int m0,
                                              int M, int N, int sym, int sys, int g8, int t) {
    for (int s = slot; s < zero_to; ++s) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = 16 * r + g8 + (e >= 2 ? 8 : 0), b = 2 * t + (e & 1), m = m0 + b;
            if (n < N && b < BT && m < M) {
                const float v = s == slot ? acc[e] : 0.0f;
#if OUT32
                reinterpret_cast<float*>(y)[(i64)s * sys + (i64)m * sym + n] = v;
#else
                reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(v);
#endif
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(RT * 32, MINB)
w4a16_sk(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
         const u16* __restrict__ mn, const u16* __restrict__ sub, void* __restrict__ y,
         int sxm, int sym, int sys, int M, int N, int G, int W, int n_bt, int slots)
{
#ifdef ONEPASS_HOST_EMU
    unsigned char* smem = g_smem;
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    u32* xs = reinterpret_cast<u32*>(smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t = lane & 3;
    const int Q = (G + 3) >> 2, R = (N + 15) >> 4, xw = Q * 64;     // xw: u32 words of a staged row
    const i64 T = (i64)R * Q;
    const int w = blockIdx.x * RT + warp;
    const i64 lo = T * w / W;
    const int nu = (int)(T * (w + 1) / W - lo);
    const Unit v0 = {(int)(lo / Q), (int)(lo % Q)};

    // 1. the ring's first U units, before the PDL wait (the weights are constant)
    QCursor cur;
    cur.w = reinterpret_cast<const uint4*>(qw);
    cur.s = sc; cur.m = mn; cur.u = sub;
    QSlot ring[U];
    Unit lu = v0;                                  // the next unit to load
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < nu) { load_unit(ring[u], cur, lu, N, G, g8, t); next_unit(lu, Q); }
    }
    pdl_wait();

    for (int bt = 0; bt < n_bt; ++bt) {
        const int m0 = bt * BT;
        if (bt > 0) {                              // the next batch tile: the weights again
            __syncthreads();                       // every warp is done reading the last tile's x
            lu = v0;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u < nu) { load_unit(ring[u], cur, lu, N, G, g8, t); next_unit(lu, Q); }
            }
        }
        // 2. x rows m0 .. m0 + BT - 1, all of K: item e = 16 j + 4 t + p (word p of group 4 j + t) to slot
        //    16 j + 4 p + t, every 16 bytes copied at once, then reordered in place by the thread that copied it
        const int row_items = Q * 16, items = BT * row_items;
        for (int i = threadIdx.x; i < items; i += RT * 32) {
            const int b = i / row_items, e = i - b * row_items;
            const bool live = m0 + b < M && (e >> 2) < G;
            const u16* src = x + (i64)(live ? m0 + b : 0) * sxm + (live ? e * 8 : 0);
            cp_async16_s(smem_addr(xs + b * xw + XSLOT(e) * 4), src, live ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait_all();
        for (int i = threadIdx.x; i < items; i += RT * 32) {
            const int b = i / row_items, e = i - b * row_items;
            uint4* slot = reinterpret_cast<uint4*>(xs + b * xw + XSLOT(e) * 4);
            *slot = pair_order(*slot);
        }
        __syncthreads();

        // 3. the warp's units in order, the ring refilled as it goes; a partial where a tile's range ends
        const bool live = g8 < BT;
        const u32* xr = xs + (live ? g8 : 0) * xw;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        Unit v = v0;
        int i = 0;
#define SK_UNIT(q)                                                                                    \
        {                                                                                             \
            apply_unit(acc, ring[q], xr, live, v.j, t);                                               \
            if (i + (q) + U < nu) { load_unit(ring[q], cur, lu, N, G, g8, t); next_unit(lu, Q); }     \
            if (v.j == Q - 1 || i + (q) == nu - 1) {                                                  \
                const int first = unit_owner((i64)v.r * Q, T, W);                                     \
                store_partial(y, acc, w - first, v.j == Q - 1 ? slots : w - first + 1, v.r, m0, M, N,  \
                              sym, sys, g8, t);                                                       \
                acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;                                             \
            }                                                                                         \
            next_unit(v, Q);                                                                          \
        }
        for (; i + U <= nu; i += U) {
#pragma unroll
            for (int q = 0; q < U; ++q) SK_UNIT(q)
        }
        if (bt == n_bt - 1) pdl_release();         // every weight load issued
#pragma unroll
        for (int q = 0; q < U; ++q) {
            if (i + q < nu) SK_UNIT(q)
        }
#undef SK_UNIT
    }
}
"""
SK_SOURCE = int4_mma.MMA_COMMON + SK_KERNEL


def available() -> bool:
    """Whether the kernel can run here (int4_mma's requirements: mma.sync bf16 and an NVRTC binding)."""
    return int4_mma.available()


def supports(fmt: str) -> bool:
    return fmt in FORMATS


def source(fmt: str, bt: int, x_f16: bool, out32: bool, kw: int, u: int, bps: int, n16: bool) -> str:
    """One instantiation: int4_mma's SOURCE_DEFINES define lines (RT = the block's warps, MINB = its blocks per SM,
    the folded form, one tile per warp), then SK_SOURCE."""
    head = (f"#define FMT {int4_mma.FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n#define OUT32 {int(out32)}\n"
            f"#define RT {kw}\n#define P 1\n#define U {u}\n#define GMAX {int4_mma.GMAX}\n#define N16 {int(n16)}\n"
            f"#define FOLD 1\n#define MINB {bps}\n#define MT 1\n")
    return head + SK_SOURCE


SOURCE_DEFINES = int4_mma.SOURCE_DEFINES


@functools.lru_cache(maxsize=None)
def _kernel(fmt: str, bt: int, x_f16: bool, out32: bool, kw: int, u: int, bps: int, n16: bool, device: torch.device):
    how = int4_cuda._compiler()
    if how is None:
        raise RuntimeError("int4_mma_sk: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return int4_cuda._Kernel(source(fmt, bt, x_f16, out32, kw, u, bps, n16), "w4a16_sk", how, device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def slots(N: int, K: int, warps: int) -> int:
    """The most warps whose ranges meet one tile: the partials a call writes per output element."""
    Q, R = _cdiv(K // GROUP, 4), _cdiv(N, 16)
    T = R * Q
    owner = lambda u: ((u + 1) * warps - 1) // T  # noqa: E731
    return max((owner(r * Q + Q - 1) - owner(r * Q) + 1 for r in range(R)), default=1)


def shape_config(N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    out = int4_cuda.layered_config("int4_mma_sk", (N, K, fmt), dict(DEFAULTS), (MEASURED.get((N, K, fmt)), config),
                                   CONFIG_KEYS)
    if not (1 <= out["KW"] <= 32 and 1 <= out["BPS"] <= 32 and 1 <= out["U"] <= 8 and out["SMS"] >= 1):
        raise ValueError(f"int4_mma_sk: config {out} for {(N, K, fmt)}: need 1 <= KW <= 32, 1 <= BPS <= 32, "
                         "1 <= U <= 8, SMS >= 1")
    return out


def batch_tile(M: int, K: int, bps: int) -> int:
    """The smallest of BT_CHOICES holding M, else the largest whose x (BT rows of K) fits a block and the BPS
    blocks an SM. Bit-neutral: the mma's columns are independent."""
    fits = [b for b in BT_CHOICES if b * K * 2 <= SMEM_LIMIT and bps * b * K * 2 <= SMEM_PER_SM] or [1]
    return next((b for b in fits if M <= b), fits[-1])


def sk_config(M: int, N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """The launch for x [M, K]: the grid of the shape's W warps, the batch tile, the partial slots (SPLIT_K, as
    int4_cuda.run_packed reads it; the kernel's `gps` argument carries W, its `n_nt` the slots)."""
    c = shape_config(N, K, fmt, config)
    W = c["SMS"] * c["BPS"] * c["KW"]
    S = slots(N, K, W)
    bt = batch_tile(M, K, c["BPS"])
    n_bt = max(1, _cdiv(M, bt))
    return {"BT": bt, "KW": c["KW"], "BPS": c["BPS"], "U": c["U"], "SPLIT_K": S, "groups_per_split": W,
            "n_bt": n_bt, "n_nt": S, "grid": c["SMS"] * c["BPS"], "block": 32 * c["KW"],
            "smem": bt * _cdiv(K // GROUP, 4) * 256, "workspace_floats": S * M * N if S > 1 else 0}


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None) -> None:
    """Size the shared split-K workspace for up to max_rows rows of these (N, K, fmt)."""
    int4_cuda.reserve_splits(device, [s for s in shapes if supports(s[2])], max_rows,
                             lambda M, N, K, fmt: sk_config(M, N, K, fmt, config))


def w4a16_mma_sk(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *, config: dict | None = None,
                 defer: bool = False):
    """y = x @ unpack_folded(w)^T for a packed Q4_0 / Q4_1 / Q4_K / Q8_0 weight (module docstring). x [M, K] bf16 /
    fp16; out [M, N] of x's dtype or float32, allocated when None. defer: the partials returned unreduced
    (int4_cuda.run_packed)."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt):
        raise ValueError(f"w4a16_mma_sk: format {pw.fmt} not supported (only {FORMATS})")
    return int4_cuda.run_packed(
        "w4a16_mma_sk", x, pw, out,
        plan=lambda M, N, K, fmt: sk_config(M, N, K, fmt, config),
        kernel=lambda cfg, x_f16, out32, dev: _kernel(pw.fmt, cfg["BT"], x_f16, out32, cfg["KW"], cfg["U"],
                                                      cfg["BPS"], pw.N % 16 == 0, dev),
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16,
        words_per_pair=WORDS_PER_GROUP[pw.fmt], defer=defer)


__all__ = ["w4a16_mma_sk", "available", "supports", "sk_config", "slots", "shape_config", "reserve_workspace",
           "source", "SK_SOURCE", "MEASURED", "FORMATS"]
