
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
