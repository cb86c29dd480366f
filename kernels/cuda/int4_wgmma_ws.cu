
#define ROWS (64 * MT * CWG)                    /* weight rows per block tile */
#define XQ_BYTES (8 * 256 * NB)                 /* one quad of x for the batch tile (int4_wgmma's stage) */
#define RB (FMT == 3 ? 32 : 16)                 /* one group's record for one row: q8_0 32 bytes, 4-bit 16 */
#define WGRP_BYTES (ROWS * RB + 32)             /* one group's records for the tile's rows, padded (banks) */
#define SROW_BYTES (ROWS * 2 + 16)              /* one row of 16-bit scale words for the tile's rows, padded */
#define NSR (FMT == 1 ? 8 : FMT == 2 ? 6 : 4)   /* per quad: q4_0, q8_0 d[4]; q4_1 d[4] m[4]; q4_k d, dmin, sub[4] */
#define PROW_BYTES (ROWS * 4 + 32)              /* READY_SCALES: one group's ready words for the tile's rows, padded */
#define SC_STAGE (READY_SCALES ? 4 * PROW_BYTES : NSR * SROW_BYTES)   /* a stage's scales */
#define SC_ROW_BYTES (READY_SCALES ? 16 : 2 * NSR)   /* what one row's scales of a quad copy */
#define W_OFF XQ_BYTES
#define S_OFF (W_OFF + 4 * WGRP_BYTES)
#define WS_STAGE ((S_OFF + SC_STAGE + 1023) / 1024 * 1024)   /* x stays 1024-aligned (the swizzle) */
#define BAR_OFF (STAGES * WS_STAGE)
#undef SMEM_TOTAL
#define SMEM_TOTAL (BAR_OFF + 16 * STAGES + 16)  /* + full[STAGES], empty[STAGES], the stream-K ticket */

#ifndef ONEPASS_HOST_EMU
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// the weights' and scales' copies; compiled with WEIGHT_EVICT (a launch of one batch tile, WEIGHT_EVICT_FIRST) they
// enter L2 as evict-first
__device__ __forceinline__ void bulk_copy_w(u32 dst, const void* src, u32 bytes, u32 bar) {
#if defined(WEIGHT_EVICT) && WEIGHT_EVICT
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
#else
    bulk_copy(dst, src, bytes, bar);
#endif
}
template <int R> __device__ __forceinline__ void regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
}
template <int R> __device__ __forceinline__ void regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R));
}
#endif

// x in the ring's image: unit i (row b, word p) of quad qn of batch tile bt, its four pieces in the wgmma's order
// at (bt * Q + qn) * XQ_BYTES + PIECE(b, p, q); rows past M and groups past G are zeros
extern "C" __global__ void __launch_bounds__(256)
wg_stage_x(const u16* __restrict__ x, unsigned char* __restrict__ xs, int sxm, int M, int G, int Q, int units)
{
    pdl_trigger();
    pdl_wait();                                 // x is the kernel before's output
    const int u = blockIdx.x * 256 + threadIdx.x;
    if (u >= units) return;
    const int i = u % (32 * NB), r = u / (32 * NB), qn = r % Q, bt = r / Q;
    const int b = UNIT_ROW(i), p = UNIT_WORD(i), m = bt * BT + b;
    uint4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int g = 4 * qn + q;
        v[q] = m < M && g < G ? *reinterpret_cast<const uint4*>(x + (i64)m * sxm + g * 32 + 8 * p)
                              : make_uint4(0, 0, 0, 0);
    }
    unit_order(v);
    unsigned char* dst = xs + (i64)r * XQ_BYTES;
#pragma unroll
    for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(dst + PIECE(b, p, q)) = v[q];
}

// the block's work: segments (row tile nt, quads q0 .. q1 of K); split-K: one, stream-K: int4_wgmma's ranges
struct Segs { long long it, hi; int Q, n_nt, gps, G; bool left; };
__device__ __forceinline__ Segs block_segs(int pid, int G, int gps, int n_nt) {
    Segs s;
    s.Q = (G + 3) >> 2; s.n_nt = n_nt; s.gps = gps; s.G = G; s.left = true;
#if SK
    const long long T = (long long)n_nt * s.Q;  // gps is the number of workers here
    s.it = T * pid / gps;
    s.hi = T * (pid + 1) / gps;
#else
    s.it = pid; s.hi = 0;
#endif
    return s;
}
__device__ __forceinline__ bool next_seg(Segs& s, int& nt, int& q0, int& q1) {
#if SK
    if (s.it >= s.hi) return false;
    nt = (int)(s.it / s.Q); q0 = (int)(s.it % s.Q);
    q1 = (int)min((long long)s.Q, q0 + (s.hi - s.it));
    s.it += q1 - q0;
    return true;
#else
    if (!s.left) return false;
    s.left = false;
    nt = (int)(s.it % s.n_nt);
    const int g_lo = (int)(s.it / s.n_nt) * s.gps;
    q0 = g_lo >> 2;
    q1 = (min(s.G, g_lo + s.gps) + 3) >> 2;
    return true;
#endif
}

// the producer's copies of quad qn's weights and scales for the tile at row n0t (rows valid rows) into stage st
__device__ __forceinline__ void copy_weights(u32 st, u32 bar, const u32* __restrict__ qw, const u16* __restrict__ sc,
                                             const u16* __restrict__ mn, const u16* __restrict__ sub, int N, int G,
                                             int n0t, int rows, int qn)
{
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const i64 e = (i64)min(4 * qn + q, G - 1) * N + n0t;   // past K (the last quad): a valid group, x is zero
        bulk_copy_w(st + W_OFF + q * WGRP_BYTES, qw + (RB / 4) * e, rows * RB, bar);
#if READY_SCALES
        bulk_copy_w(st + S_OFF + q * PROW_BYTES, reinterpret_cast<const u32*>(sub) + e, rows * 4, bar);
#elif FMT == 2
        bulk_copy_w(st + S_OFF + (2 + q) * SROW_BYTES, sub + e, rows * 2, bar);
#else
        bulk_copy_w(st + S_OFF + q * SROW_BYTES, sc + e, rows * 2, bar);
#if FMT == 1
        bulk_copy_w(st + S_OFF + (4 + q) * SROW_BYTES, mn + e, rows * 2, bar);
#endif
#endif
    }
#if FMT == 2 && !READY_SCALES
    const i64 so = (i64)(min(4 * qn, G - 1) >> 3) * N + n0t;   // a quad lies in one super-group of 8
    bulk_copy_w(st + S_OFF, sc + so, rows * 2, bar);
    bulk_copy_w(st + S_OFF + SROW_BYTES, mn + so, rows * 2, bar);
#endif
}

// a consumer lane's quad from its stage: rows ra (and ra + 8) of each of its MT tiles, group t of the quad
__device__ __forceinline__ void stage_quad(QSlot& sl, const unsigned char* st, int ra0, int t) {
    const u16* s = reinterpret_cast<const u16*>(st + S_OFF);
#define SROW(k) (s + (k) * (SROW_BYTES / 2))
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = ra0 + 64 * mt, rb = ra + 8;
        sl.wa[mt] = *reinterpret_cast<const uint4*>(st + W_OFF + t * WGRP_BYTES + ra * RB);
        sl.wb[mt] = *reinterpret_cast<const uint4*>(st + W_OFF + t * WGRP_BYTES + rb * RB);
#if FMT == 3
        sl.wa2[mt] = *reinterpret_cast<const uint4*>(st + W_OFF + t * WGRP_BYTES + ra * RB + 16);
        sl.wb2[mt] = *reinterpret_cast<const uint4*>(st + W_OFF + t * WGRP_BYTES + rb * RB + 16);
#endif
#if READY_SCALES
        const u32* pr = reinterpret_cast<const u32*>(st + S_OFF + t * PROW_BYTES);
        sl.ra[mt][0] = pr[ra]; sl.rb[mt][0] = pr[rb];
#elif FMT == 2
        sl.ra[mt][0] = SROW(0)[ra]; sl.rb[mt][0] = SROW(0)[rb];
        sl.ra[mt][1] = SROW(1)[ra]; sl.rb[mt][1] = SROW(1)[rb];
        sl.ra[mt][2] = SROW(2 + t)[ra]; sl.rb[mt][2] = SROW(2 + t)[rb];
#else
        sl.ra[mt][0] = SROW(t)[ra]; sl.rb[mt][0] = SROW(t)[rb];
#if FMT == 1
        sl.ra[mt][1] = SROW(4 + t)[ra]; sl.rb[mt][1] = SROW(4 + t)[rb];
#endif
#endif
    }
#undef SROW
}

#define STAGERS 96                              /* X_IN_GEMM: the producer warpgroup's warps 1-3 */
#if X_IN_GEMM
// quad qn of x for the batch tile at row m0 into a stage: the units wg_stage_x writes, each stager thread its share
__device__ __forceinline__ void stage_x_quad(unsigned char* st, const u16* __restrict__ x, int sxm, int M, int G,
                                             int m0, int qn) {
    for (int u = threadIdx.x - 32; u < 32 * NB; u += STAGERS) {
        const int b = UNIT_ROW(u), p = UNIT_WORD(u), m = m0 + b;
        uint4 v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int g = 4 * qn + q;
            v[q] = m < M && g < G ? *reinterpret_cast<const uint4*>(x + (i64)m * sxm + g * 32 + 8 * p)
                                  : make_uint4(0, 0, 0, 0);
        }
        // unit_order's pieces one at a time (piece 0 / 1: the words x, z of each group's pair_order; 2 / 3: y, w),
        // so few registers are live: the stagers run on PRODUCER_REGS
        *reinterpret_cast<uint4*>(st + PIECE(b, p, 0)) = make_uint4(
            prmt(v[0].x, v[0].z, 0x5410u), prmt(v[1].x, v[1].z, 0x5410u), prmt(v[2].x, v[2].z, 0x5410u),
            prmt(v[3].x, v[3].z, 0x5410u));
        *reinterpret_cast<uint4*>(st + PIECE(b, p, 1)) = make_uint4(
            prmt(v[0].x, v[0].z, 0x7632u), prmt(v[1].x, v[1].z, 0x7632u), prmt(v[2].x, v[2].z, 0x7632u),
            prmt(v[3].x, v[3].z, 0x7632u));
        *reinterpret_cast<uint4*>(st + PIECE(b, p, 2)) = make_uint4(
            prmt(v[0].y, v[0].w, 0x5410u), prmt(v[1].y, v[1].w, 0x5410u), prmt(v[2].y, v[2].w, 0x5410u),
            prmt(v[3].y, v[3].w, 0x5410u));
        *reinterpret_cast<uint4*>(st + PIECE(b, p, 3)) = make_uint4(
            prmt(v[0].y, v[0].w, 0x7632u), prmt(v[1].y, v[1].w, 0x7632u), prmt(v[2].y, v[2].w, 0x7632u),
            prmt(v[3].y, v[3].w, 0x7632u));
    }
}
#endif

#if CMMA
// CMMA: a quad on the warp's own mma.sync instead of the warpgroup's wgmma: the same A fragments (quad_word), the
// same k16 steps of x from the same stage image, read into mma.m16n8k16's B fragments by ldmatrix (matrix m of word
// p: k16 step 2p + (m >> 1), k half m & 1, i.e. piece m of the unit; the swizzle keeps each 8-row phase on distinct
// banks). Every product and the order of the k16 steps per element are the wgmma's. No warpgroup-wide fence, commit
// or wait: each warp issues and waits on its own.
__device__ __forceinline__ void apply_quad_mma(float (&acc)[MT][4 * NB], const QSlot& sl, u32 xbase, int lane) {
    const QScales q = quad_scales(sl);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a_lo[MT][4], a_hi[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) quad_word(sl, q, p, mt, a_lo[mt], a_hi[mt]);
#pragma unroll
        for (int c = 0; c < NB; ++c) {
            u32 b[4];
            ldsm_x4(b, xbase + PIECE(8 * c + (lane & 7), p, lane >> 3));
            const u32 b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float (&ac)[4] = *reinterpret_cast<float (*)[4]>(acc[mt] + 4 * c);
                mma16816(ac, a_lo[mt], b_lo);
                mma16816(ac, a_hi[mt], b_hi);
            }
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(128 * (CWG + 1), 1)
w4a16_wgmma_ws(const u16* __restrict__ xs16, const u32* __restrict__ qw, const u16* __restrict__ sc,
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
    const u32 sbase = smem_addr(smem);
    const u32 full0 = sbase + BAR_OFF, empty0 = full0 + 8 * STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1 + (X_IN_GEMM ? STAGERS : 0));   // the producer's arrive (with the stage's
                                                                        // bytes), and each stager's
            mbar_init(empty0 + 8 * s, CMMA ? 4 * CWG : CWG);   // one arrive per consumer warpgroup (CMMA: warp)
        }
        mbar_init_fence();
    }
    __syncthreads();
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int m0 = bt * BT;
    Segs segs = block_segs(pid, G, gps, n_nt);
    int nt, q0, q1;

    if (threadIdx.x < 128) {                    // the producer warpgroup: one thread issues every copy
        regs_dec<PRODUCER_REGS>();
#if X_IN_GEMM
        if (threadIdx.x >= 32) {                // the stagers: x, once the kernel before is done
            pdl_wait();
            int i = 0;
            while (next_seg(segs, nt, q0, q1)) {
                for (int qn = q0; qn < q1; ++qn, ++i) {
                    const int s = i % STAGES;
                    if (i >= STAGES) mbar_wait(empty0 + 8 * s, ((i / STAGES) + 1) & 1);
                    stage_x_quad(smem + s * WS_STAGE, xs16, sxm, M, G, m0, qn);
                    fence_proxy_async();        // ordinary stores, read by the wgmmas (the async proxy)
                    mbar_arrive(full0 + 8 * s);
                }
            }
            return;
        }
#endif
        if (threadIdx.x != 0) return;           // thread 0: every bulk copy (X_IN_GEMM: weights only, no PDL wait)
#if !X_IN_GEMM
        const unsigned char* xb = reinterpret_cast<const unsigned char*>(xs16) + (i64)bt * segs.Q * XQ_BYTES;
        int pend[STAGES];                       // the first stages' quads: their x after the PDL wait
#endif
        int i = 0;
        while (next_seg(segs, nt, q0, q1)) {
            const int n0t = nt * ROWS, rows = min(ROWS, N - n0t);
            const u32 wbytes = 4 * rows * RB + SC_ROW_BYTES * rows;
            for (int qn = q0; qn < q1; ++qn, ++i) {
                const int s = i % STAGES;
                const u32 st = sbase + s * WS_STAGE, full = full0 + 8 * s;
#if !X_IN_GEMM
                if (i == STAGES) {              // the ring is full of weights: now x, once the kernel before is done
                    pdl_wait();
                    for (int k = 0; k < STAGES; ++k)
                        bulk_copy(sbase + k * WS_STAGE, xb + (i64)pend[k] * XQ_BYTES, XQ_BYTES, full0 + 8 * k);
                }
#endif
                if (i >= STAGES) mbar_wait(empty0 + 8 * s, ((i / STAGES) + 1) & 1);
#if X_IN_GEMM
                mbar_expect_tx(full, wbytes);
                copy_weights(st, full, qw, sc, mn, sub, N, G, n0t, rows, qn);
#else
                mbar_expect_tx(full, wbytes + XQ_BYTES);
                copy_weights(st, full, qw, sc, mn, sub, N, G, n0t, rows, qn);
                if (i < STAGES) pend[i] = qn;
                else bulk_copy(st, xb + (i64)qn * XQ_BYTES, XQ_BYTES, full);
#endif
            }
        }
#if !X_IN_GEMM
        if (i <= STAGES) {                      // the whole K loop fit in the ring
            pdl_wait();
            for (int k = 0; k < i; ++k)
                bulk_copy(sbase + k * WS_STAGE, xb + (i64)pend[k] * XQ_BYTES, XQ_BYTES, full0 + 8 * k);
        }
#endif
        pdl_release();                          // every copy issued
        return;
    }

    regs_inc<CONSUMER_REGS>();
    pdl_wait();                                 // y, the workspace and the stream-K flags: after the kernel before
    const int cw = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31, t = lane & 3;
    const int r0 = (cw >> 2) * 64 * MT + 16 * (cw & 3);    // this warp's first row in the tile
#if !CMMA
    const bool leader = (threadIdx.x & 127) == 0;
#endif
    float acc[MT][4 * NB];
    int i = 0;
    while (next_seg(segs, nt, q0, q1)) {
        const int n0 = nt * ROWS + r0;
#if !FRESH_WRITE
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) acc[mt][j] = 0.0f;
        }
#endif
        for (int qn = q0; qn < q1; ++qn, ++i) {
            const int s = i % STAGES;
            mbar_wait(full0 + 8 * s, (i / STAGES) & 1);
            QSlot sl;
            stage_quad(sl, smem + s * WS_STAGE, r0 + (lane >> 2), t);
#if CMMA
            apply_quad_mma(acc, sl, sbase + s * WS_STAGE, lane);
            __syncwarp();                       // every lane's reads of the stage are done: the warp gives it back
            if (lane == 0) mbar_arrive(empty0 + 8 * s);
#else
            apply_quad_wg(acc, sl, DESC0(sbase + s * WS_STAGE), FRESH_WRITE && qn == q0);
            // the wgmmas of quad i - 1 are done (apply_quad_wg waits for all but its last group): its stage is free
            if (i > 0 && leader) mbar_arrive(empty0 + 8 * ((i - 1) % STAGES));
#endif
        }
#if !CMMA
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) fence_operand(acc[mt][j]);
        }
#endif
#if SK
        if (q0 == 0 && q1 == segs.Q) store_acc(acc, y, 0, sym, M, N, n0, m0);
        else sk_combine(acc, smem + BAR_OFF + 16 * STAGES, y, ws, flags, bt * n_nt + nt, sym, M, N, n0, m0);
#else
        store_acc(acc, y, (i64)(pid / n_nt) * sys, sym, M, N, n0, m0);
#endif
    }
}
