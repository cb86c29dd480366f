
// the staging launch lets its GEMM launch at once (kernels/pdl.py): the GEMM's producer then issues its first weight
// copies while x is staged, and its own wait still waits for the staging to complete
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && STAGE_TRIGGER
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// stream-K's combine (int4_wgmma's sk_combine) among the consumers only: the producer never meets them
#define SK_SYNC() consumer_sync()
#define SK_LEADER (threadIdx.x == 128)
#define SK_CTID ((int)threadIdx.x - 128)
#define SK_NCT (32 * RT)                /* the consumer warpgroups (RT / 4 = CWG) */
#ifndef ONEPASS_HOST_EMU
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" :: "n"(128 * CWG) : "memory"); }
// CMMA: four 8 x 8 matrices of 16-bit values from shared memory, lane l naming row l & 7 of matrix l >> 3; register m
// gets matrix m's row (lane >> 2), columns 2 (lane & 3), + 1
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
#endif
