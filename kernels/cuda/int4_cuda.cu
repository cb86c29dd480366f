
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

// FMT 0 q4_0, 1 q4_1, 2 q4_k, 3 q8_0; BT batch tile; X_F16 x (and 16-bit y) is fp16 (else bf16);
// OUT32: y is fp32 (the split-K workspace, or an fp32 output); KW, CG: as the Python module says.
#define WPG (FMT == 3 ? 8 : 4)          /* int32 words per (row, group) */
#define VPG (WPG / 4)                   /* 16-byte vectors per (row, group) */
#define UPW (CG / KW)                   /* groups per warp per chunk: the warp's register slots */
#define NRAW (FMT == 2 ? 3 : FMT == 1 ? 2 : 1)   /* raw scale words per slot (below) */
#if CG % KW != 0
#error "CG must be a multiple of KW"
#endif

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

__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {   // (a & b) | c in one LOP3 (C gives two)
    u32 r; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
#endif

// Exact small integers as floats without a shift per value: bits [lo, lo + n) of w, OR-ed into the
// exponent of 2^(23 - lo) (where their unit is 1), minus that power (and the format's offset) is the
// integer exactly. Fields at bit 16 and up come from w >> 16 (one shift per word).
// 4-bit: nibble s (0..3) of w is the unsigned q (q4_0: returned as q - 8)
__device__ __forceinline__ float nib(u32 w, int s) {
    const float off = FMT == 0 ? 8.0f : 0.0f;
    const float bias = s == 0 ? 8388608.0f + off : s == 1 ? 524288.0f + off : s == 2 ? 32768.0f + off : 2048.0f + off;
    return __int_as_float(and_or(w, 0xFu << (4 * s), (150u - 4u * s) << 23)) - bias;
}
// Q8_0: byte s (0..1) of wx (a word XOR 0x80808080: q + 128 unsigned) as the signed int8 q
__device__ __forceinline__ float sbyte(u32 wx, int s) {
    return __int_as_float(and_or(wx, 0xFFu << (8 * s), (150u - 8u * s) << 23)) - (s == 0 ? 8388736.0f : 32896.0f);
}

// Issue the loads of group g (row nr) into one register slot: the packed words and the scales' raw bits,
// converted only when the slot is consumed (a chunk later), so nothing here waits on memory.
//   raw: q4_0 / q8_0 {d}; q4_1 {d, m}; q4_k {d, dmin, sc | mn << 8} (fp16 bits; the 6-bit pair)
__device__ __forceinline__ void load_group(uint4 (&w)[VPG], u32 (&raw)[NRAW], const uint4* __restrict__ qw,
                                           const u16* __restrict__ sc, const u16* __restrict__ mn,
                                           const u8* __restrict__ sub, int g, int nr, int N) {
    const int gn = g * N + nr;                  // (group, row) index: G * N < 2^31 (the host checks)
#pragma unroll
    for (int v = 0; v < VPG; ++v) w[v] = ld_stream(qw + (i64)gn * VPG + v);
#if FMT == 2
    raw[0] = sc[(g >> 3) * N + nr];
    raw[1] = mn[(g >> 3) * N + nr];
    raw[2] = reinterpret_cast<const u16*>(sub)[gn];    // 2-byte aligned (the host checks)
#elif FMT == 1
    raw[0] = sc[gn];
    raw[1] = mn[gn];
#else
    raw[0] = sc[gn];
#endif
}

extern "C" __global__ void __launch_bounds__(KW * 32)
w4a16_cuda(const u16* __restrict__ x, const uint4* __restrict__ qw, const u16* __restrict__ sc,
           const u16* __restrict__ mn, const u8* __restrict__ sub, void* __restrict__ y,
           int sxm, int sym, int sys, int M, int N, int G, int gps, int n_bt, int n_nt)
{
    __shared__ __align__(16) float xs[BT][CG * 32];
    __shared__ float xsum[BT][CG];
    __shared__ float red[KW > 1 ? KW - 1 : 1][BT][32];
    pdl_wait();                                 // kernels/pdl.py: x and y belong to the kernels around this one

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int nt = pid % n_nt;
    const int s = pid / n_nt;
    const int n = nt * 32 + lane;
    const int nr = n < N ? n : N - 1;           // rows past N re-read a valid row; never stored
    const int m0 = bt * BT;
    const int g_lo = s * gps;
    const int g_hi = min(G, g_lo + gps);

    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.0f;

    // 1. the weight stream, one chunk ahead: slot u holds group warp + u * KW of the chunk being computed
    //    and is refilled with the same group of the next chunk once that group is applied, so a chunk's
    //    loads are in flight during the previous chunk's arithmetic and the x staging, in the registers
    //    of one chunk. Here: the first chunk.
    uint4 wv[UPW][VPG];
    u32 raw[UPW][NRAW];
#pragma unroll
    for (int u = 0; u < UPW; ++u) {
        const int gi = warp + u * KW;
        if (gi < g_hi - g_lo) load_group(wv[u], raw[u], qw, sc, mn, sub, g_lo + gi, nr, N);
    }

    for (int gc = g_lo; gc < g_hi; gc += CG) {
        const int ng = min(CG, g_hi - gc);
        const int ng_next = min(CG, g_hi - gc - CG);     // <= 0: this is the last chunk
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
        // 3. per slot: dequantize the group once, apply it to every sequence of the tile, refill the slot
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
            const int gi = warp + u * KW;
            if (gi < ng) {
                const uint4 w0 = wv[u][0], w1 = wv[u][VPG - 1];
#if FMT == 2
                const float scl = h2f((u16)raw[u][0]) * (float)(raw[u][2] & 0xFFu);
                const float cmn = -(h2f((u16)raw[u][1]) * (float)(raw[u][2] >> 8));
#elif FMT == 1
                const float scl = h2f((u16)raw[u][0]), cmn = h2f((u16)raw[u][1]);
#else
                const float scl = h2f((u16)raw[u][0]);
#endif
                float p[BT];
#pragma unroll
                for (int b = 0; b < BT; ++b) p[b] = 0.0f;
#if FMT == 3
                const u32 words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int j = 0; j < 8; ++j) {            // word j holds k = 4j .. 4j + 3
                    const u32 lo = words[j] ^ 0x80808080u, hi = lo >> 16;
                    const float q0 = sbyte(lo, 0), q1 = sbyte(lo, 1);
                    const float q2 = sbyte(hi, 0), q3 = sbyte(hi, 1);
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
                const u32 words[4] = {w0.x, w0.y, w0.z, w0.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {            // word j holds k = 8j .. 8j + 7, nibble s = k - 8j
                    const u32 lo = words[j], hi = lo >> 16;
                    float q[8];
#pragma unroll
                    for (int t = 0; t < 4; ++t) {
                        q[t] = nib(lo, t);
                        q[t + 4] = nib(hi, t);
                    }
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
                    acc[b] = __fmaf_rn(scl, p[b], acc[b]);
#if FMT == 1 || FMT == 2
                    acc[b] = __fmaf_rn(cmn, xsum[b][gi], acc[b]);
#endif
                }
                // refill after the arithmetic: before it, ptxas copies the live words out of the slot
                if (gi < ng_next) load_group(wv[u], raw[u], qw, sc, mn, sub, gc + CG + gi, nr, N);
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
    pdl_release();                              // no weights: the next GEMM may start on its own at once
    pdl_wait();
    const i64 idx = (i64)blockIdx.x * 256 + threadIdx.x;
    const i64 total = (i64)M * N;
    if (idx >= total) return;
    const int m = (int)(idx / N), n = (int)(idx - (i64)m * N);
    // loads eight (then four) splits ahead of their adds: one memory round trip per eight splits, not per split
    float acc = ws[idx];
    int s = 1;
    for (; s + 8 <= S; s += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = ws[(i64)(s + j) * total + idx];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += v[j];
    }
    if (s + 4 <= S) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = ws[(i64)(s + j) * total + idx];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc += v[j];
        s += 4;
    }
    for (; s < S; ++s) acc += ws[(i64)s * total + idx];
#if OUT32
    reinterpret_cast<float*>(y)[(i64)m * sym + n] = acc;
#else
    reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc);
#endif
}
