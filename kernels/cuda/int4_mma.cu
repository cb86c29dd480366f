
#if FOLD
// quad j: the weights q * s + c (scale and offset rounded to x's dtype, one packed fma per pair), then per word p
// and 8-column block two mmas per row tile accumulating straight into acc (the tiles share each x fragment read
// from shared memory); no fp32 scaling, no group sums of x
__device__ __forceinline__ void apply_quad(float (&acc)[MT][4 * NB], const QSlot& sl, const u32* const (&xr)[NB],
                                           int j, int t) {
    const QScales q = quad_scales(sl);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a_lo[MT][4], a_hi[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) quad_word(sl, q, p, mt, a_lo[mt], a_hi[mt]);
#pragma unroll
        for (int c = 0; c < NB; ++c) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xr[c] + ((4 * j + p) * 4 + t) * 4);
            const u32 b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
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

#if FOLD
#define APPLY(acc, sl, j) apply_quad(acc, sl, xr, j, t)
#define LOAD(sl) load_quad(sl, cur, N, g_lo + ng)
#define XSLOT(e) (((e) & ~15) | (((e) & 3) << 2) | (((e) >> 2) & 3))
#else
#define APPLY(acc, sl, gi) apply_slot(acc, sl, xr, xs2, gi, t)
#define LOAD(sl) load_slot(sl, cur, N)
#define XSLOT(e) (e)
#endif

extern "C" __global__ void __launch_bounds__(KW * 32, MIN_BLOCKS)
w4a16_mma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
          const u16* __restrict__ mn, const u16* __restrict__ sub, void* __restrict__ y,
          int sxm, int sym, int sys, int M, int N, int G, int gps, int n_bt, int n_nt)
{
#ifdef ONEPASS_HOST_EMU
    unsigned char* smem = g_smem;
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    u32 (*xs)[XROW] = reinterpret_cast<u32 (*)[XROW]>(smem);
#if XSUMS
    float (*xpart)[GMAX][4] = reinterpret_cast<float (*)[GMAX][4]>(smem + XS_BYTES);
    float (*xsum)[GMAX] = reinterpret_cast<float (*)[GMAX]>(smem + XS_BYTES + BT * GMAX * 16);
#endif
#if P > 1
    float (*red)[RT][32][MT * 4 * NB] = reinterpret_cast<float (*)[RT][32][MT * 4 * NB]>(smem + XS_BYTES + XP_BYTES);
#endif

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t = lane & 3;
    const int rt = warp % RT, ph = warp / RT;
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int nt = pid % n_nt;
    const int s = pid / n_nt;
    const int m0 = bt * BT;
    const int n0 = (nt * RT + rt) * 16 * MT;             // the warp's MT tiles of 16 rows
    const int g_lo = s * gps;
    const int ng = min(G, g_lo + gps) - g_lo;   // groups of this split
#if FOLD
    const int nu = (ng + 3) >> 2;               // quads of this split (only a last split may end in a partial one)
#else
    const int nu = ng;
#endif
    const int ni = nu > ph ? (nu - ph + P - 1) / P : 0;   // units (groups, or quads) of this warp: ph + i * P

    // 1. the first U units' loads, before x is staged
#if FOLD
    QCursor cur;
    {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int na = min(n0 + 16 * mt + g8, N - 1);
            cur.na[mt] = na;
            cur.db[mt] = min(n0 + 16 * mt + g8 + 8, N - 1) - na;    // rows past N re-read a valid row
        }
        cur.g = g_lo + 4 * ph + t;
        cur.w = reinterpret_cast<const uint4*>(qw);
        cur.s = sc; cur.m = mn; cur.u = sub;
    }
    QSlot ring[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < ni) load_quad(ring[u], cur, N, g_lo + ng);
    }
#else
    Cursor cur;
    {
        const int g0 = g_lo + ph, na = min(n0 + g8, N - 1);
        const i64 ia = (i64)g0 * N + na;
        cur.w = qw + ia * 4 + t;
        cur.g = g0;
#if FMT == 2
        cur.s = sc + na; cur.m = mn + na; cur.u = sub + ia;
#else
        cur.s = sc + ia; cur.m = FMT == 1 ? mn + ia : nullptr; cur.u = nullptr;
#endif
#if !N16
        const int nb = min(n0 + g8 + 8, N - 1);                    // rows past N re-read a valid row
        const i64 ib = (i64)g0 * N + nb;
        cur.wb = qw + ib * 4 + t;
#if FMT == 2
        cur.sb = sc + nb; cur.mb = mn + nb; cur.ub = sub + ib;
#else
        cur.sb = sc + ib; cur.mb = FMT == 1 ? mn + ib : nullptr; cur.ub = nullptr;
#endif
#endif
    }
    Slot ring[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < ni) load_slot(ring[u], cur, N);
    }
#endif

    // PDL: the weights above are constant, so they may load before the kernel before this one has flushed; x and
    // the outputs wait for it
    pdl_wait();

    // 2. x[m0 .. m0 + BT, split's K range) -> shared memory, 8 values per item: every item's 16 bytes copied
    //    at once (cp.async: in flight together, no registers held beside the weight ring; rows past M and the
    //    zero row b = BT are zero-filled), then each thread puts its own items in the mma's k-slot order
    //    Folded: item e = 16j + 4t + p (word p of group 4j + t) goes to slot 16j + 4p + t, the order the quads'
    //    mmas read; a partial last quad's missing groups are zero.
    const int items = XR * nu * (FOLD ? 16 : 4), row_items = nu * (FOLD ? 16 : 4);
    {
        int b = 0, e = threadIdx.x;                                // item i = b * row_items + e
        for (int i = threadIdx.x; i < items; i += KW * 32) {
            while (e >= row_items) { e -= row_items; ++b; }
            const bool live = b < BT && m0 + b < M && (e >> 2) < ng;
            const u16* src = x + (i64)(live ? m0 + b : 0) * sxm + (i64)g_lo * 32 + (live ? e * 8 : 0);
            cp_async16_s(smem_addr(&xs[b][XSLOT(e) * 4]), src, live ? 16 : 0);
            e += KW * 32;
        }
        cp_async_commit();
        cp_async_wait_all();
    }
    {
        int b = 0, e = threadIdx.x;
        for (int i = threadIdx.x; i < items; i += KW * 32) {
            while (e >= row_items) { e -= row_items; ++b; }
            uint4* slot = reinterpret_cast<uint4*>(&xs[b][XSLOT(e) * 4]);
            const uint4 v = *slot;
            *slot = pair_order(v);
#if XSUMS
            // the item's 8 values summed in k order; the group's 4 items are added in word order below
            float p = x_to_f32(v.x & 0xFFFFu);
            p += x_to_f32(v.x >> 16);
            p += x_to_f32(v.y & 0xFFFFu);
            p += x_to_f32(v.y >> 16);
            p += x_to_f32(v.z & 0xFFFFu);
            p += x_to_f32(v.z >> 16);
            p += x_to_f32(v.w & 0xFFFFu);
            p += x_to_f32(v.w >> 16);
            if (b < BT) xpart[b][e >> 2][e & 3] = p;
#endif
            e += KW * 32;
        }
    }
    __syncthreads();
#if XSUMS
    for (int i = threadIdx.x; i < XR * ng; i += KW * 32) {
        const int b = i / ng, gi = i - b * ng;
        xsum[b][gi] = b < BT ? ((xpart[b][gi][0] + xpart[b][gi][1]) + xpart[b][gi][2]) + xpart[b][gi][3] : 0.0f;
    }
    __syncthreads();
#endif

    // 3. the warp's groups in order: full rounds of the ring (each slot refilled right after use), then the
    //    last partial round from the loads already in flight
    float acc[MT][4 * NB];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) acc[mt][j] = 0.0f;
    }
    const u32* xr[NB];
    const float* xs2[2 * NB];
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        const int b = 8 * c + g8;                                  // the lane's B column
        xr[c] = &xs[b < BT ? b : BT][0];
#pragma unroll
        for (int h = 0; h < 2; ++h) {                              // the lane's D columns
            const int bd = 8 * c + 2 * t + h;
#if XSUMS
            xs2[2 * c + h] = &xsum[bd < BT ? bd : BT][0];
#else
            xs2[2 * c + h] = nullptr;                              // no min term
#endif
        }
    }
    int i = 0;
    for (; i + U <= ni; i += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            APPLY(acc, ring[u], ph + (i + u) * P);
            if (i + u + U < ni) LOAD(ring[u]);                    // warp-uniform
        }
    }
    pdl_release();                              // every weight load issued
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (i + u < ni) APPLY(acc, ring[u], ph + (i + u) * P);
    }

    // 4. the phases' sums in phase order, by phase 0; lane (g, t) holds rows g, g + 8 of each tile x sequences
    //    8c + 2t, + 1
#if P > 1
    if (ph > 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) red[ph - 1][rt][lane][mt * 4 * NB + j] = acc[mt][j];
        }
    }
    __syncthreads();
    if (ph != 0) return;
#pragma unroll
    for (int q = 0; q < P - 1; ++q) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) acc[mt][j] += red[q][rt][lane][mt * 4 * NB + j];
        }
    }
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) {
            const int n = n0 + 16 * mt + g8 + ((j & 3) >= 2 ? 8 : 0), b = 8 * (j >> 2) + 2 * t + (j & 1), m = m0 + b;
            if (n < N && b < BT && m < M) {
#if OUT32
                reinterpret_cast<float*>(y)[(i64)s * sys + (i64)m * sym + n] = acc[mt][j];
#else
                reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc[mt][j]);
#endif
            }
        }
    }
}
