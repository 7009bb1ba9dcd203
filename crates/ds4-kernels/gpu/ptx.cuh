// PTX wrappers shared by the tensor-core modules (gemm.cu, gemm_i8.cu, gemm_wg.cu, attn_tc.cu,
// moe.cu): byte permute, f16x2 arithmetic, mma, ldmatrix and cp.async. CUDA sm_80+ only; the
// callers sit under their own `#if`.
#pragma once
#include "prelude.cuh"

#if defined(DS4_CUDA) && DS4_ARCH >= 800
// Bytes of (a, b) picked by the selector's nibbles (selector msb set: sign-replicate that byte).
__device__ __forceinline__ u32 ds4_prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// f16x2 arithmetic, round to nearest even. The callers keep every result exact (small integers or
// exact products): the reason is beside each call.
__device__ __forceinline__ u32 ds4_hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 ds4_hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 ds4_hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// f16x2 of (v0 low half, v1 high half), round to nearest even.
__device__ __forceinline__ u32 ds4_f16x2(float v0, float v1) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(v1), "f"(v0));
    return r;
}
// bf16x2 of (v0 low half, v1 high half), round to nearest even: for finite values the bits of
// prelude.cuh ds4_f2bf (and blas_prep.cu bp_bf16) in one instruction instead of ~12 a pair; a NaN
// becomes the canonical 0x7fff.
__device__ __forceinline__ u32 ds4_bf16x2(float v0, float v1) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(v1), "f"(v0));
    return r;
}
// A pair as hi = f16(v) and lo = f16(v - hi) (the difference is exact in f32): ~22 bits of v in
// two f16, the hi/lo operands of the exact-weight products.
__device__ __forceinline__ void ds4_f16x2_split(float v0, float v1, u32& hi, u32& lo) {
    hi = ds4_f16x2(v0, v1);
    lo = ds4_f16x2(v0 - ds4_h2f_fast(hi & 0xffffu), v1 - ds4_h2f_fast(hi >> 16));
}

// mma.sync m16n8k16 with f32 accumulators c[0..3] += A (a[0..3]) * B (b0, b1): f16 or bf16 inputs.
__device__ __forceinline__ void ds4_mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ds4_mma_f16(float* c, const u32* a, const u32* b) { ds4_mma_f16(c, a, b[0], b[1]); }
__device__ __forceinline__ void ds4_mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ds4_mma_bf16(float* c, const u32* a, const u32* b) { ds4_mma_bf16(c, a, b[0], b[1]); }
// mma.sync m16n8k32 s8 x s8 with int32 accumulators c[0..3] += A (a[0..3]) * B (b0, b1).
__device__ __forceinline__ void ds4_mma_s8(int* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
// 16 bytes to the shared address dst reading only the first n (0..16) source bytes, the rest
// zero-filled (a block that ends inside the copy: nothing past it is read).
__device__ __forceinline__ void ds4_cp16n(u32 dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// The same at a generic pointer to shared memory: all 16 bytes, or none (zero-filled) when !ok.
__device__ __forceinline__ void ds4_cp16(void* dst, const void* src, bool ok) {
    ds4_cp16n((u32)__cvta_generic_to_shared(dst), src, ok ? 16 : 0);
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
