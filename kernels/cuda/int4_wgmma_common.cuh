
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
