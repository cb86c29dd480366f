// The split-K reduce every CUDA W4A16 kernel's partials go through (kernels/nvrtc.py: run_packed).
// X_F16: a 16-bit y is fp16 (else bf16); OUT32: y is fp32.
typedef unsigned short u16;
typedef long long i64;

#ifndef ONEPASS_HOST_EMU   /* tests/cuda_emu.py compiles this source for the CPU with its own helpers */
__device__ __forceinline__ u16 f32_to_x(float f) {
    u16 r;
#if X_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
#endif

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
