
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#ifndef PDL_RELEASE
#define PDL_RELEASE 0
#endif
// The late release (gemm_release): this block has issued its last weight load, so the next kernel may launch and
// its blocks take the SM slots this grid's blocks leave (its own first weight loads overlap this grid's tail).
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && PDL_RELEASE
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
