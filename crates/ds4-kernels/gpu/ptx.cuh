// PTX wrappers shared by the tensor-core modules (gemm.cu, gemm_i8.cu, attn_tc.cu, moe.cu): byte
// permute, ldmatrix and cp.async. CUDA sm_80+ only; the callers sit under their own `#if`.
#pragma once
#include "prelude.cuh"

#if defined(DS4_CUDA) && DS4_ARCH >= 800
// Bytes of (a, b) picked by the selector's nibbles (selector msb set: sign-replicate that byte).
__device__ __forceinline__ u32 ds4_prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// Four 8x8 b16 matrices from shared memory (row addresses from lanes 8i..8i+7 for matrix i);
// `_t`: transposed.
__device__ __forceinline__ void ds4_ldm4(u32* r, const void* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void ds4_ldm4_t(u32* r, const void* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// Asynchronous copies global -> shared: 16 bytes (zero-filled when !ok, L2 only) or 4 bytes;
// grouped by commit, waited for with at most N groups still in flight.
__device__ __forceinline__ void ds4_cp16(void* dst, const void* src, bool ok) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void ds4_cp4(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void ds4_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void ds4_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif
