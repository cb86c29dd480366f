"""W4A16 projection for large batches on sm_90's warpgroup MMA, y[M, N] = x[M, K] @ w[N, K]^T, the folded weights
of engine/quant_pack.py (Q4_0 / Q4_1 / Q4_K, and Q8_0 through int4_mma's 32-byte records) kept packed; CUDA C++ compiled at run time for sm_90a (torch's NVRTC
binding; wgmma needs the "a" target, which CuPy's binding does not name).

Definition: x @ unpack_folded(w, x.dtype)^T, fp32 accumulation, like kernels/int4_mma.py's folded form.

Why: from 64 sequences up a projection is bound by the tensor cores, not by HBM, and each weight must be
dequantized once per block of as many sequences as possible. The mma.sync kernel (int4_mma) serves a batch tile
of at most 32 and stages x for a whole split in shared memory, so B = 128 re-reads and re-dequantizes every
weight four times; Triton's W4A16 kernel (int4_gemm) dequantizes once per 128 sequences but sends the tile
through shared memory to reach the wgmma's register layout. Here the weights go from the load straight into
the wgmma's A registers.

The kernel
  Rows: a block is WGS warpgroups, each owning MT m64 tiles of weight rows (64 MT WGS rows per block); in each
  tile warp r of the warpgroup gives rows 16r .. 16r + 15 as mma.m16n8k16's A fragment, which is also its part
  of wgmma's m64 A operand. The fragments are int4_mma's folded ones (quad_word): lane (g, t) loads the whole
  16-byte record of group 4j + t of quad j for rows g and g + 8, and word p of it becomes the A operand of two
  k16 steps (nibble pairs (0,4) (1,5), then (2,6) (3,7)): per pair one packed fma makes the exact integers and
  one more applies the group's scale and offset.
  Sequences: a batch tile of BT (8 .. 128) is the wgmma's N extent: x is the B operand, read by the wgmma
  from shared memory through a descriptor. It streams through a ring of STAGES quads (BT rows x 128 weights of
  K each, two K-major atoms of 64 k with the 128-byte swizzle): cp.async copies each 16-byte piece (row b,
  word p of the quad's group q) to where its k16 step reads it, and the thread that copied it then puts the
  values in the A fragments' k order in
  place (pair_order and a 4 x 4 transpose of its four pieces) -- no other thread touches them.
  Per quad: wait for its copies, reorder, fence.proxy.async, one barrier, refill the ring two quads on (the
  stage the quad before last used: every warpgroup's wgmma_wait<1> has retired those reads by this barrier),
  then per word p one commit group of 2 MT wgmmas (m64 n BT k16, A from registers), waiting for the previous
  word's group only, so the next word's dequantization overlaps the tensor cores.
  Splits: the K range is cut into SPLIT_K splits of whole quads; partials go to int4_cuda's split-K workspace and
  its reduce (or to the consumer, defer=True), in split order.
  Stream-K: with more row tiles than one wave of blocks (34816x5120: 136 tiles of 256 rows on 132 SMs; the LM
  heads), whole tiles in a second wave would leave most SMs idle. Instead TARGET_BLOCKS blocks take equal ranges
  of the tiles' quads, tile-major; a range is at least a tile long, so a tile is shared by at most two blocks,
  which meet through a per-tile ticket: the first leaves its fp32 partial in the workspace, the second adds it
  (one commutative addition) and stores the tile.

Batch invariance: every output element is the chain of its split's k16 steps in quad, word order, then the
splits added in order 0..S-1 (stream-K: the two chains of a shared tile added); the split, the stream-K ranges,
WGS and MT come from (N, K, fmt) alone. M moves only BT (the wgmma's
N extent, whose columns are independent) and the grid, so row m of y is bitwise the same whatever M is (the GPU
tests compare rows across BT; the same assumption as int4_gemm's wgmma tiles).

Where the time goes (H200; kernels/PROBES.md has the measurements): at 64c4aa5 it was the fastest int4 kernel at B = 128
on ten of eleven shapes and at B = 64 on eight, still at 1.3-2.6x bf16 cuBLAS's time; the split decides much of it (a
block runs a whole split, so the splits fill one wave; stream-K where the row tiles exceed one wave). ncu finds its
warps waiting on their own weight loads and on the per-quad barrier, with the tensor pipe a third busy:
kernels/int4_wgmma_ws.py, which feeds both operands through shared memory from a producer warpgroup, took its place from
64 sequences up.
"""
from __future__ import annotations

import functools

import torch

from onepass.engine.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from onepass.kernels import int4_cuda, int4_mma

FORMATS = int4_mma.FOLD_FORMATS   # its loads and fragments are int4_mma's folded form's, Q8_0 included
BT_CHOICES = (8, 16, 32, 64, 128)   # the wgmma's N extent; more sequences run over the grid
NUM_SMS = int4_cuda.NUM_SMS
SMEM_LIMIT = 227 * 1024             # dynamic shared memory per block on sm_90 (opt-in)
MAX_SPLIT = 32
MIN_QUADS_PER_SPLIT = 4             # >= 512 weights of K per split
CONFIG_KEYS = ("WGS", "MT", "U", "STAGES", "MINB", "SWZ", "SK", "SK_HALVE", "SPLIT_K", "TARGET_BLOCKS")
# WGS warpgroups x MT m64 tiles per block; U quads of weight loads in flight per warp; STAGES quads of x in the
# ring (>= 3: a stage is refilled two quads after its wgmmas were issued); MINB blocks per SM the registers must
# allow (0: auto_minb); SWZ: x staged with the 128-byte swizzle. TARGET_BLOCKS: the split reaches this many blocks
# (one batch tile). SK: with more row tiles than TARGET_BLOCKS (and no SPLIT_K named), stream-K: TARGET_BLOCKS
# blocks share the tiles' K steps evenly instead of a second, mostly idle wave of whole tiles. SK_HALVE: where
# tiles of two m64 fill more than half of TARGET_BLOCKS but not all, tiles of one m64 (twice as many) for stream-K.
# The split, the stream-K ranges and so the bits follow from (N, K, fmt, config); MINB, U, STAGES and SWZ do not
# change a bit, so MINB may follow the batch tile.
# H200 sweep (below): two warpgroups of two m64 tiles (256 rows, 255 registers, one block per SM) were the fastest
# or within 5% at B = 128 on all eight shapes.
DEFAULTS = {"WGS": 2, "MT": 2, "U": 1, "STAGES": 4, "MINB": 0, "SWZ": 1, "SK": 1, "SK_HALVE": 0,
            "TARGET_BLOCKS": NUM_SMS}
# per format, over DEFAULTS: Q8_0's ring slot holds twice the bytes of a 4-bit one, so one m64 tile per warpgroup
# keeps the 128-sequence tile's registers (two tiles' accumulators are 128 of its 255)
FORMAT_DEFAULTS = {"q8_0": {"MT": 1}}
MEASURED: dict[tuple[int, int, str], dict] = {}
# No entries: smaller tiles do not rescue the small weights at 32-128 sequences (H200 probe at 290952c, int4_gemm's
# method, WGS 1-2 x MT 1-2 x U 1-2 x STAGES 4 / 6). SmolLM2's Q4_1 3072x576 in 64-row blocks (WGS 1, MT 1: 48 blocks,
# the same bits) took 6.8 / 7.3 / 11.6 us at B = 32 / 64 / 128 against the default's 11.3 / 14.9 / 20.2, yet the
# folded latency launch (5.6 / 6.0 / 8.6) and dequantize + cuBLAS (5.8 / 6.8 / 6.9) were faster still; 576x576,
# 960x576 and 576x1536 alike, and Llama-3.2-1B's 2048x2048 / 3072x2048 Q4_0 stayed behind ws t128. At 128 sequences
# no launch of these shapes took under 11 us, whatever its rows: x's 128 rows pass the ring behind block barriers.
# the dispatch's "cuda_wgmma_x2": two blocks per SM below 128 sequences, splits and stream-K sized for them
# (H200, B = 32 / 64 / 128, us: 5120x17408 Q4_K 33 / 58 / 81 against the default's 49.8 / 63.8 / 74.7; 34816x5120
# in tiles of one m64, stream-K on 264 blocks, 72 / 105 / 193 against 87 / 107 / 145). Different splits: its bits
# differ from the default's, so an engine takes one or the other for every M.
X2 = {"TARGET_BLOCKS": 2 * NUM_SMS, "SK_HALVE": 1}

WG_COMMON = r"""
// SWZ 1: the stage as two K-major atoms of 64 k with the 128-byte swizzle (row b's 16-byte chunk c at
// (c ^ (b & 7)) * 16); SWZ 0: no swizzle, each k16 step's core matrices [2 k halves][NB][8 rows][16 B]
#if SWZ
#define PIECE(b, p, q) (((p) >> 1) * NB * 1024 + (b) * 128 + (((4 * ((p) & 1) + (q)) ^ ((b) & 7)) << 4))
#else
#define PIECE(b, p, q) ((((4 * (p) + (q)) * NB) + ((b) >> 3)) * 128 + ((b) & 7) * 16)
#endif

#ifndef ONEPASS_HOST_EMU
#if X_F16
#define WG_T "f16"
#else
#define WG_T "bf16"
#endif
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory");
}
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}
// x reordered by ordinary stores, then read by the wgmma (the async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// keeps the compiler from reading an accumulator before the wait that completes its wgmmas
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
/*WGMMA_RS*/
#endif

// unit i of a stage (its four pieces q = 0..3) is row b, word p: a warp's units are 8 rows x 4 words, so each
// quarter-warp's 16-byte accesses cover 128 contiguous bytes of shared memory (no bank conflicts; with the words
// of a row in one quarter-warp they were 8 KB apart, four-way conflicts) and each row's 64 contiguous bytes of x
#define UNIT_ROW(i) ((((i) >> 5) << 3) | ((i) & 7))
#define UNIT_WORD(i) (((i) >> 3) & 3)

// one unit's four pieces (row b, word p of groups q = 0..3 of a quad) in the A fragments' k order: core matrix (step
// 2p + h, half kh) row b takes from each group q (lane t = q's two k slots) the pair nib_pair(word p, 2h + kh) makes
// of the weights
__device__ __forceinline__ void unit_order(uint4 (&v)[4]) {
    uint4 o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) o[q] = pair_order(v[q]);
    v[0] = make_uint4(o[0].x, o[1].x, o[2].x, o[3].x);
    v[1] = make_uint4(o[0].y, o[1].y, o[2].y, o[3].y);
    v[2] = make_uint4(o[0].z, o[1].z, o[2].z, o[3].z);
    v[3] = make_uint4(o[0].w, o[1].w, o[2].w, o[3].w);
}

// no-swizzle K-major descriptor of a stage's k16 step 0 (address, leading-dimension offset = between the k halves,
// stride-dimension offset = between 8-row blocks; 16 B units); step s is s * 256 NB bytes on
__device__ __forceinline__ unsigned long long x_desc0(u32 base) {
    return (unsigned long long)((base >> 4) & 0x3FFFu) | ((unsigned long long)((NB * 128u) >> 4) << 16)
           | ((unsigned long long)(128u >> 4) << 32);
}
#if SWZ
// 128-byte swizzle, K-major: 8-row blocks 1024 B apart (stride-dimension offset), layout type 1 (bits 62-63); k16
// step s starts 32 B into its atom per step (the swizzle is applied to the address bits, atoms 1024-byte aligned)
__device__ __forceinline__ unsigned long long x_desc0_swz(u32 base) {
    return (unsigned long long)((base >> 4) & 0x3FFFu) | (1ull << 16) | ((unsigned long long)(1024u >> 4) << 32)
           | (1ull << 62);
}
#define X_DESC(desc0, s) ((desc0) + (unsigned long long)(((s) >> 2) * NB * 64 + ((s) & 3) * 2))
#define DESC0(base) x_desc0_swz(base)
#else
#define X_DESC(desc0, s) ((desc0) + (unsigned long long)((s) * 16 * NB))
#define DESC0(base) x_desc0(base)
#endif

// one quad on the warpgroup's tensor cores: per word, the A fragments of every tile, then one commit group of their
// wgmmas; waiting for the word before only, so the next word's fragments are made while this one runs. With
// WG_STEP_GROUPS one commit group per k16 step instead (the same wgmmas in the same order: the same bits): only one
// step's fragments are held for a wgmma in flight, which is what lets ptxas keep the wgmmas pipelined in 112
// registers at 128 sequences (with a word's two steps per group it serializes them there, its warning C7512).
// fresh: the quad starts a K range, so its first wgmma per tile writes acc (scale-d 0) instead of adding to it: no
// instruction but a wgmma defines an accumulator inside the K loop (zeroing acc there makes ptxas serialize every
// wgmma of the kernel, its warning C7515)
#ifndef WG_STEP_GROUPS
#define WG_STEP_GROUPS 0
#endif
__device__ __forceinline__ void apply_quad_wg(float (&acc)[MT][4 * NB], const QSlot& sl, unsigned long long desc0,
                                              bool fresh = false) {
    const QScales q = quad_scales(sl);
#if WG_STEP_GROUPS
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) quad_half(sl, q, s >> 1, mt, s & 1, a[mt]);
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) wgmma_rs(acc[mt], a[mt], X_DESC(desc0, s), s > 0 || !fresh);
        wgmma_commit();
        wgmma_wait<1>();
    }
#else
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a_lo[MT][4], a_hi[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) quad_word(sl, q, p, mt, a_lo[mt], a_hi[mt]);
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            wgmma_rs(acc[mt], a_lo[mt], X_DESC(desc0, 2 * p), p > 0 || !fresh);
            wgmma_rs(acc[mt], a_hi[mt], X_DESC(desc0, 2 * p + 1), 1);
        }
        wgmma_commit();
        wgmma_wait<1>();
    }
#endif
}

// lane (g, t) holds rows g, g + 8 of each of its tiles x sequences 8c + 2t, + 1: element j of tile mt
#define ACC_ROW(mt, j) (n0 + 64 * (mt) + (lane >> 2) + (((j) & 3) >= 2 ? 8 : 0))
#define ACC_SEQ(j) (m0 + 8 * ((j) >> 2) + 2 * (lane & 3) + ((j) & 1))

template <bool CHECKED>
__device__ __forceinline__ void store_tile(const float (&acc)[MT][4 * NB], void* __restrict__ y, i64 off, int sym,
                                           int M, int N, int n0, int m0)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) {
            const int n = ACC_ROW(mt, j), m = ACC_SEQ(j);
            if (!CHECKED || (n < N && m < M)) {
#if OUT32
                reinterpret_cast<float*>(y)[off + (i64)m * sym + n] = acc[mt][j];
#else
                reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc[mt][j]);
#endif
            }
        }
    }
}
// a warp whose rows and sequences all lie inside y (every full tile) stores without a test per element: the tests
// made ptxas branch around each store (a BSSY / BSYNC pair per element, ~3,200 instructions a thread at 128
// sequences). The element-wise stores fill half a sector each (8 lanes, 16 bytes of one sequence), yet whole
// sectors do not pay: a probe at 4ed6ace that handed each lane four consecutive rows of one sequence through three
// shuffles per 8 sequences (8-byte stores, every sector whole; the same bits) was slower, 34816x5120 Q4_K ws B = 32
// 51.6-51.8 -> 53.0-53.3 us, B = 128 82.7-83.3 -> 87.7-88.7 (H200, int4_gemm's method): what the final stores cost
// is the epilogue's instructions, not the memory system's sectors.
__device__ __forceinline__ void store_acc(const float (&acc)[MT][4 * NB], void* __restrict__ y, i64 off, int sym,
                                          int M, int N, int n0, int m0)
{
    if (n0 + 64 * (MT - 1) + 16 <= N && m0 + 8 * NB <= M) store_tile<false>(acc, y, off, sym, M, N, n0, m0);
    else store_tile<true>(acc, y, off, sym, M, N, n0, m0);
}

#if SK
// a tile whose K range two blocks share (stream-K): the first to finish (ticket 0) leaves its fp32 partial in ws
// and raises the tile's ready flag; the other waits for the flag (the first is running: it holds its ticket), adds
// the partial to its own (one fp32 addition, commutative: the same bits whichever came first), stores the tile and
// resets both flags for the next launch. smem: a free int of shared memory; SK_SYNC / SK_LEADER: the threads
// holding accumulators meet / one of them (the whole block unless the source says otherwise); SK_CTID / SK_NCT:
// this thread's index among them / their number.
// The partial lies in the tile's own slice of ws in the threads' order (float4 i of thread c at i * SK_NCT + c): the
// two blocks of a tile run the same threads on the same elements, so each thread writes and reads its accumulators
// with 16-byte accesses that a warp makes contiguous, and needs no bounds test. H200 probe against the earlier form
// (scalar partials at [m, n] of an M x N workspace, a bounds test per element; the same bits), ws kernel, us per call
// old / new: 34816x5120 Q4_K B = 32 52.7 / 51.5, B = 64 64.1 / 61.5, B = 128 89.9 / 83.3; 17408x5120 Q4_0 B = 128
// 50.4 / 45.7; the split-K shapes (no partial exchange) unchanged. What is left at 34816x5120 B = 128 (outputs wrong):
// without the final bf16 stores 75.6 us, without them and the partials 68.2, without the fence ~0.5 us less.
// The ticket costs little: a probe at 4ed6ace with fixed roles (a tile's tail block always writes, its head block
// always waits; safe only with every block resident) gained 0.1-0.9 us a call on 34816x5120 and 17408x5120 (B = 16
// to 128; the LM head within its noise) and 0.1-0.2% of the 27B hybrid's step at B = 32 and 128, so the ticket's
// symmetric form stays.
#ifndef SK_SYNC
#define SK_SYNC() __syncthreads()
#define SK_LEADER (threadIdx.x == 0)
#define SK_CTID ((int)threadIdx.x)
#define SK_NCT (32 * RT)                 /* the block: RT / 4 warpgroups */
#endif
__device__ __forceinline__ void sk_combine(float (&acc)[MT][4 * NB], unsigned char* smem, void* __restrict__ y,
                                           float* __restrict__ ws, int* __restrict__ flags, int tile, int sym, int M,
                                           int N, int n0, int m0)
{
    volatile int* s_ticket = reinterpret_cast<volatile int*>(smem);
    float4* part = reinterpret_cast<float4*>(ws) + (i64)tile * (SK_NCT * MT * NB) + SK_CTID;
    if (SK_LEADER) *s_ticket = atomicAdd(&flags[2 * tile], 1);
    SK_SYNC();
    const int ticket = *s_ticket;
    SK_SYNC();                                  // read by all before the ticket word is reused
    if (ticket == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int c = 0; c < NB; ++c)
                __stcg(part + (mt * NB + c) * SK_NCT, make_float4(acc[mt][4 * c], acc[mt][4 * c + 1],
                                                                  acc[mt][4 * c + 2], acc[mt][4 * c + 3]));
        }
        __threadfence();
        SK_SYNC();
        if (SK_LEADER) atomicExch(&flags[2 * tile + 1], 1);
        return;
    }
    if (SK_LEADER) {
        while (atomicAdd(&flags[2 * tile + 1], 0) == 0) {}
        flags[2 * tile] = 0;
        flags[2 * tile + 1] = 0;
    }
    SK_SYNC();
    __threadfence();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int c = 0; c < NB; ++c) {
            const float4 p = __ldcg(part + (mt * NB + c) * SK_NCT);
            acc[mt][4 * c] += p.x; acc[mt][4 * c + 1] += p.y; acc[mt][4 * c + 2] += p.z; acc[mt][4 * c + 3] += p.w;
        }
    }
    store_acc(acc, y, 0, sym, M, N, n0, m0);
}
#endif
"""

WG_KERNEL = r"""
#define WGS (RT / 4)                        /* warpgroups per block */
#define STAGE_BYTES (8 * 256 * NB)          /* one quad of x: 128 k x 8 NB rows x 2 B */
#define SMEM_TOTAL (STAGES * STAGE_BYTES)
#define UPT ((BT * 4 + RT * 32 - 1) / (RT * 32))     /* units per thread */


// this thread's units, fixed for the whole K loop: where each reads x (the split's first quad), its row b and word
// p; live: a row below M (else its pieces are zeros)
struct XUnits {
    const u16* src[UPT];
    int b[UPT], p[UPT];
    bool has[UPT], live[UPT];
};

__device__ __forceinline__ XUnits x_units(const u16* __restrict__ x, int sxm, int M, int m0, int g_lo) {
    XUnits u;
#pragma unroll
    for (int k = 0; k < UPT; ++k) {
        const int i = threadIdx.x + k * RT * 32, b = UNIT_ROW(i), p = UNIT_WORD(i);
        u.has[k] = i < BT * 4;
        u.live[k] = u.has[k] && m0 + b < M;
        u.src[k] = x + (u.live[k] ? (i64)(m0 + b) * sxm + (i64)g_lo * 32 + 8 * p : 0);
        u.b[k] = b;
        u.p[k] = p;
    }
    return u;
}

// quad qn of the split (gq of its groups inside it) into the stage at dst: piece (b, p, q) holds the k of k16 step
// 2p + (q >> 1), k half q & 1, row b (PIECE)
__device__ __forceinline__ void stage_copy(u32 dst, const XUnits& u, int qn, int gq) {
#pragma unroll
    for (int k = 0; k < UPT; ++k) {
        if (u.has[k]) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const bool live = u.live[k] && q < gq;
                cp_async16_s(dst + PIECE(u.b[k], u.p[k], q), u.src[k] + (live ? qn * 128 + q * 32 : 0), live ? 16 : 0);
            }
        }
    }
}

// the same thread's pieces, in place, in the A fragments' k order (unit_order)
__device__ __forceinline__ void stage_order(unsigned char* st, const XUnits& u) {
#pragma unroll
    for (int k = 0; k < UPT; ++k) {
        if (u.has[k]) {
            uint4 v[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = *reinterpret_cast<const uint4*>(st + PIECE(u.b[k], u.p[k], q));
            unit_order(v);
#pragma unroll
            for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(st + PIECE(u.b[k], u.p[k], q)) = v[q];
        }
    }
}

// one segment: the block's MT WGS m64 tiles of rows (this warp's first row n0) times the batch tile at m0, over the
// groups g_lo .. g_lo + ng of K, into acc (zeroed here); the smem ring is free when it starts and when it returns
__device__ __forceinline__ void k_segment(float (&acc)[MT][4 * NB], unsigned char* smem, const u16* __restrict__ x,
                                          const u32* __restrict__ qw, const u16* __restrict__ sc,
                                          const u16* __restrict__ mn, const u16* __restrict__ sub, int sxm, int M,
                                          int N, int n0, int m0, int g_lo, int ng)
{
    const int lane = threadIdx.x & 31, g8 = lane >> 2, t = lane & 3;
    const int nq = (ng + 3) >> 2;               // quads (only a segment ending at K may end in a partial one)
    QCursor cur;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int na = min(n0 + 64 * mt + g8, N - 1);
        cur.na[mt] = na;
        cur.db[mt] = min(n0 + 64 * mt + g8 + 8, N - 1) - na;      // rows past N re-read a valid row
    }
    cur.g = g_lo + t;
    cur.w = reinterpret_cast<const uint4*>(qw);
    cur.s = sc; cur.m = mn; cur.u = sub;

    QSlot ring[U];                              // the weights first: constant, so in flight before the PDL wait
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < nq) load_quad(ring[u], cur, N, g_lo + ng);
    }
    pdl_wait();                                 // x, the outputs and the stream-K flags: after the kernel before

    const u32 sbase = smem_addr(smem);
    const XUnits xu = x_units(x, sxm, M, m0, g_lo);
#pragma unroll
    for (int q = 0; q < STAGES - 2; ++q) {
        if (q < nq) stage_copy(sbase + q * STAGE_BYTES, xu, q, min(4, ng - 4 * q));
        cp_async_commit();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) acc[mt][j] = 0.0f;
    }

    int st = 0, sn = STAGES - 2;                // the stages of quad i and of quad i + STAGES - 2
    for (int i0 = 0; i0 < nq; i0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u;
            if (i < nq) {
                cp_async_wait<STAGES - 3>();                          // this thread's pieces of quad i
                stage_order(smem + st * STAGE_BYTES, xu);
                fence_proxy_async();
                __syncthreads();
                const int qn = i + STAGES - 2;                        // into the stage of quad i - 2
                if (qn < nq) stage_copy(sbase + sn * STAGE_BYTES, xu, qn, min(4, ng - 4 * qn));
                cp_async_commit();
                apply_quad_wg(acc, ring[u], DESC0(sbase + st * STAGE_BYTES));
                if (i + U < nq) load_quad(ring[u], cur, N, g_lo + ng);
                st = st == STAGES - 1 ? 0 : st + 1;
                sn = sn == STAGES - 1 ? 0 : sn + 1;
            }
        }
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) fence_operand(acc[mt][j]);
    }
    __syncthreads();                            // every warpgroup's wgmmas are done with the ring
}



extern "C" __global__ void __launch_bounds__(RT * 32, MINB)
w4a16_wgmma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
            const u16* __restrict__ mn, const u16* __restrict__ sub, void* __restrict__ y,
            int sxm, int sym, int sys, int M, int N, int G, int gps, int n_bt, int n_nt
#if SK
            , float* __restrict__ ws, int* __restrict__ flags
#endif
            )
{
#ifdef ONEPASS_HOST_EMU
    unsigned char* smem = g_smem;
#else
    extern __shared__ __align__(1024) unsigned char smem[];
#endif
    const int warp = threadIdx.x >> 5;
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int m0 = bt * BT;
    float acc[MT][4 * NB];
#if SK
    // stream-K: the n_nt x Q (tile, quad) steps of K, tile-major, cut into gps equal ranges, one per block of this
    // batch tile; a range covers whole tiles and at most one tile's tail (first) and one tile's head (last), each
    // shared with one other block (gps <= n_nt: a range is at least a tile long)
    const int Q = (G + 3) >> 2;
    const i64 T = (i64)n_nt * Q;
    i64 it = T * pid / gps;
    const i64 hi = T * (pid + 1) / gps;
    while (it < hi) {
        const int nt = (int)(it / Q), q0 = (int)(it % Q);
        const int q1 = (int)min((i64)Q, q0 + (hi - it));
        const int n0 = (nt * WGS + (warp >> 2)) * 64 * MT + 16 * (warp & 3);
        k_segment(acc, smem, x, qw, sc, mn, sub, sxm, M, N, n0, m0, 4 * q0, min(G, 4 * q1) - 4 * q0);
        if (it + (q1 - q0) >= hi) pdl_release();          // the block's last segment: every weight load issued
        if (q0 == 0 && q1 == Q) store_acc(acc, y, 0, sym, M, N, n0, m0);
        else sk_combine(acc, smem, y, ws, flags, bt * n_nt + nt, sym, M, N, n0, m0);   // the ring is free here
        it += q1 - q0;
    }
#else
    const int nt = pid % n_nt;
    const int s = pid / n_nt;
    const int n0 = (nt * WGS + (warp >> 2)) * 64 * MT + 16 * (warp & 3);    // this warp's rows of its first tile
    const int g_lo = s * gps;
    k_segment(acc, smem, x, qw, sc, mn, sub, sxm, M, N, n0, m0, g_lo, min(G, g_lo + gps) - g_lo);
    pdl_release();                              // every weight load issued
    store_acc(acc, y, (i64)s * sys, sym, M, N, n0, m0);
#endif
}
"""

SOURCE_DEFINES = 15


def _wgmma_rs_text(nb: int) -> str:
    """wgmma_rs(d, a, desc, add): d[4 nb] = (add ? d : 0) + A (64 x 16; this warp's 16 rows in a, mma.m16n8k16's A
    layout) times the 16 x 8nb slice of x that desc names: one warpgroup-wide wgmma.mma_async m64n(8nb)k16, A from
    registers, scale-d = add, B K-major."""
    n = 4 * nb
    d = ", ".join(f"%{i}" for i in range(n))
    a = ", ".join(f"%{n + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, %{n + 5}, 0; wgmma.mma_async.sync.aligned.m64n{8 * nb}k16.f32.\" WG_T "
           f"\".\" WG_T \" {{{d}}}, {{{a}}}, %{n + 4}, p, 1, 1, 0; }}")
    return (f"__device__ __forceinline__ void wgmma_rs(float (&d)[{n}], const u32 (&a)[4], unsigned long long desc, "
            f"int add) {{\n"
            f'    asm volatile("{asm}"\n'
            f"                 : {outs}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(add));\n}}\n')


def source(fmt: str, bt: int, x_f16: bool, out32: bool, wgs: int, mt: int, u: int, stages: int, minb: int = 1,
           swz: int = 1, sk: bool = False) -> str:
    """The full source of one instantiation: SOURCE_DEFINES #define lines, then int4_mma's common device code
    (the folded form's loads and fragments), WG_COMMON and WG_KERNEL."""
    head = (f"#define FMT {int4_mma.FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n"
            f"#define OUT32 {int(out32)}\n#define RT {4 * wgs}\n#define P 1\n#define U {u}\n#define GMAX 32\n"
            f"#define N16 1\n#define FOLD 1\n#define MINB {minb}\n#define MT {mt}\n#define STAGES {stages}\n"
            f"#define SWZ {swz}\n#define SK {int(sk)}\n")
    assert head.count("\n") == SOURCE_DEFINES
    return head + int4_mma.MMA_COMMON + common_text(bt) + WG_KERNEL


def common_text(bt: int) -> str:
    """WG_COMMON with its wgmma for a batch tile of bt (kernels/int4_wgmma_ws.py builds on it too)."""
    return WG_COMMON.replace("/*WGMMA_RS*/", _wgmma_rs_text(_cdiv(bt, 8)))


def available() -> bool:
    """Whether the kernel can run here: an sm_90 device (wgmma needs the sm_90a target) and torch's NVRTC
    binding (it names the target exactly)."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and hasattr(torch.cuda, "_compile_kernel"))


def supports(fmt: str) -> bool:
    return fmt in FORMATS


@functools.lru_cache(maxsize=None)
def _kernel(fmt: str, bt: int, x_f16: bool, out32: bool, wgs: int, mt: int, u: int, stages: int, minb: int,
            swz: int, sk: bool, device: torch.device):
    if not available():
        raise RuntimeError("int4_wgmma: needs an sm_90 GPU and torch.cuda._compile_kernel")
    return int4_cuda._Kernel(source(fmt, bt, x_f16, out32, wgs, mt, u, stages, minb, swz, sk), "w4a16_wgmma", "torch",
                             device, arch="90a")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_config(N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """DEFAULTS, then MEASURED[(N, K, fmt)], then config (int4_cuda.layered_config), checked."""
    out = int4_cuda.layered_config("int4_wgmma", (N, K, fmt), DEFAULTS,
                                   (FORMAT_DEFAULTS.get(fmt), MEASURED.get((N, K, fmt)), config), CONFIG_KEYS)
    if out["WGS"] not in (1, 2) or out["MT"] not in (1, 2) or not 1 <= out["U"] <= 4 or not 3 <= out["STAGES"] <= 6 \
            or not 0 <= out["MINB"] <= 4 or out["SWZ"] not in (0, 1) or out["SK"] not in (0, 1) \
            or out["SK_HALVE"] not in (0, 1) \
            or out.get("TARGET_BLOCKS", 1) < 1:
        raise ValueError(f"int4_wgmma: config {out} for {(N, K, fmt)}: need WGS and MT in (1, 2), 1 <= U <= 4, "
                         f"3 <= STAGES <= 6, 0 <= MINB <= 4, SWZ, SK and SK_HALVE in (0, 1), TARGET_BLOCKS >= 1")
    return out


def smem_bytes(bt: int, stages: int) -> int:
    """The block's dynamic shared memory (the kernel's SMEM_TOTAL): STAGES quads of x for 8 * ceil(BT / 8) rows."""
    return stages * 8 * 256 * _cdiv(bt, 8)


def split(G: int, n_nt: int, c: dict) -> tuple[int, int]:
    """(S, groups per split): SPLIT_K splits if named, else the most (each >= MIN_QUADS_PER_SPLIT quads) whose
    n_nt * S blocks still fit in TARGET_BLOCKS, one wave of the blocks the SMs hold at once: a block runs a
    whole split, so a second wave of a few blocks costs as much as the first (at e516e01 the rule was "the fewest
    reaching TARGET_BLOCKS": 5120x17408 took 7 splits, 140 blocks on 132 SMs). Splits of whole quads."""
    Q = _cdiv(G, 4)
    if c.get("SPLIT_K"):
        S = max(1, min(int(c["SPLIT_K"]), Q))
    else:
        S = 1
        while (S < MAX_SPLIT and n_nt * (S + 1) <= c["TARGET_BLOCKS"]
               and _cdiv(Q, S + 1) >= MIN_QUADS_PER_SPLIT):
            S += 1
    gps = _cdiv(Q, S) * 4
    return _cdiv(G, gps), gps


def auto_minb(bt: int, target_blocks: int) -> int:
    """MINB 0: blocks per SM the registers must allow, by batch tile (bit-neutral). Two at tiles of up to 32,
    whose accumulators leave room (H200, B = 32: 5120x17408 Q4_K 45.9 against 49.8 us, 34816x5120 79 against 87);
    at 64 only when the launch has two blocks per SM to hide the cap (one block capped at 128 registers: 5120x17408
    81.8 against 63.8 us); one at 128 (capped, its 128 accumulators spill: 399 us)."""
    if bt <= 32:
        return 2
    return 2 if bt == 64 and target_blocks >= 2 * NUM_SMS else 1


def wg_config(M: int, N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """The launch for x [M, K]: the split (or stream-K) from (N, K, fmt) and config only; BT the smallest of
    BT_CHOICES holding M (128, over the grid, above). Stream-K ("workers" > 0): that many blocks per batch tile
    share the row tiles' K steps, a partial tile's fp32 sum through the workspace (a slice of rows x BT floats per
    tile) and two flags per tile ("flag_ints")."""
    c = shape_config(N, K, fmt, config)
    target = c.get("TARGET_BLOCKS", NUM_SMS)
    n_nt = _cdiv(N, 64 * c["MT"] * c["WGS"])
    stream_k = c["SK"] and not c.get("SPLIT_K")
    if stream_k and c["SK_HALVE"] and c["MT"] == 2 and target // 2 < n_nt <= target:
        c["MT"] = 1
        n_nt = _cdiv(N, 64 * c["WGS"])
    G = K // GROUP
    workers = target if stream_k and n_nt > target else 0
    S, gps = (1, _cdiv(G, 4) * 4) if workers else split(G, n_nt, c)
    bt = next((b for b in BT_CHOICES if M <= b), BT_CHOICES[-1])
    smem = smem_bytes(bt, c["STAGES"])
    if smem > SMEM_LIMIT:
        raise ValueError(f"int4_wgmma: BT={bt} STAGES={c['STAGES']} needs {smem} B of shared memory (limit {SMEM_LIMIT})")
    n_bt = _cdiv(M, bt)
    minb = c["MINB"] or auto_minb(bt, target)
    return {"BT": bt, "WGS": c["WGS"], "MT": c["MT"], "U": c["U"], "STAGES": c["STAGES"], "MINB": minb, "SWZ": c["SWZ"],
            "SPLIT_K": S, "groups_per_split": gps, "workers": workers,
            "grid": n_bt * (workers or n_nt * S), "block": 128 * c["WGS"], "n_bt": n_bt, "n_nt": n_nt,
            "smem": smem,
            "workspace_floats": n_bt * n_nt * 64 * c["MT"] * c["WGS"] * bt if workers else (S * M * N if S > 1 else 0),
            "flag_ints": 2 * n_bt * n_nt if workers else 0}


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None) -> None:
    """Size the split-K workspace (shared with int4_cuda) for up to max_rows rows of these (N, K, fmt)."""
    int4_cuda.reserve_splits(device, [s for s in shapes if supports(s[2])], max_rows,
                             lambda M, N, K, fmt: wg_config(M, N, K, fmt, config))


def w4a16_wgmma(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
                config: dict | None = None, defer: bool = False):
    """y = x @ unpack_folded(w, x.dtype)^T for a packed Q4_0 / Q4_1 / Q4_K / Q8_0 weight (module docstring). x [M, K] bf16 /
    fp16; out [M, N] of x's dtype or float32 (unit column stride), allocated when None. defer: split-K partials
    returned as a kernels.splitk.SplitSums."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt):
        raise ValueError(f"w4a16_wgmma: format {pw.fmt} not supported (only {FORMATS}); use the Triton kernel")
    return int4_cuda.run_packed(
        "w4a16_wgmma", x, pw, out,
        plan=lambda M, N, K, fmt: wg_config(M, N, K, fmt, config),
        kernel=lambda cfg, x_f16, out32, dev: _kernel(pw.fmt, cfg["BT"], x_f16, out32, cfg["WGS"], cfg["MT"], cfg["U"],
                                                      cfg["STAGES"], cfg["MINB"], cfg["SWZ"], cfg["workers"] > 0, dev),
        # x is read in 16-byte pieces: unit column stride, rows 16-byte aligned
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16,
        words_per_pair=WORDS_PER_GROUP[pw.fmt], defer=defer)


__all__ = ["w4a16_wgmma", "available", "supports", "wg_config", "shape_config", "reserve_workspace", "source",
           "MEASURED", "FORMATS", "WG_COMMON", "WG_KERNEL", "common_text"]
