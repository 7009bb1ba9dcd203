// ds4 kernel prelude: the only place where CUDA (NVRTC) and HIP (hipRTC) spellings differ.
// No toolkit header is included; the host passes these defines:
//   DS4_CUDA=1 or DS4_HIP=1   which compiler/runtime
//   DS4_WARP=32|64            the device's warp (wavefront) width; nothing assumes 32
//   DS4_ARCH=<int>            CUDA: 100*major + 10*minor (900 = sm_90); AMD: 0 (see DS4_GFX)
//   DS4_GFX=0x<digits>        AMD only: gfx90a -> 0x90a, gfx1030 -> 0x1030
#pragma once
#if !defined(DS4_WARP) || (DS4_WARP != 32 && DS4_WARP != 64)
#error "the host must pass -DDS4_WARP=32 or -DDS4_WARP=64"
#endif
#if defined(DS4_CUDA) == defined(DS4_HIP)
#error "the host must pass exactly one of -DDS4_CUDA=1, -DDS4_HIP=1"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef u64 ds4_mask_t; // lane masks are 64-bit so wave64 fits

#if defined(DS4_HIP)
// HIP has no *_sync shuffles (ROCm 5); a wavefront executes in lockstep.
#define ds4_shfl_xor(v, o) __shfl_xor((v), (o), DS4_WARP)
#define ds4_shfl_up(v, o) __shfl_up((v), (o), DS4_WARP)
#define ds4_ballot(p) ((ds4_mask_t)__ballot(p))
#else
#define ds4_shfl_xor(v, o) __shfl_xor_sync(0xffffffffu, (v), (o), DS4_WARP)
#define ds4_shfl_up(v, o) __shfl_up_sync(0xffffffffu, (v), (o), DS4_WARP)
#define ds4_ballot(p) ((ds4_mask_t)__ballot_sync(0xffffffffu, (p)))
#endif

// The warp's shared-memory stores visible to its lanes. HIP: a wavefront barrier with fences
// (ROCm 5 has no __syncwarp; a wavefront runs in lockstep, the fences order its LDS accesses).
#if defined(DS4_HIP)
#define ds4_syncwarp()                                                                                         \
    do {                                                                                                       \
        __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");                                                 \
        __builtin_amdgcn_wave_barrier();                                                                       \
        __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");                                                 \
    } while (0)
#else
#define ds4_syncwarp() __syncwarp()
#endif

#define DS4_BOUNDS(threads) __launch_bounds__(threads)
#define DS4_KERNEL extern "C" __global__
#define DS4_INF __int_as_float(0x7f800000)
#define DS4_NEG_INF __int_as_float(0xff800000u)

// Uncontracted f32 ops: dequantisation must round exactly like the CPU reference (a*b - c, never
// an fma). Both compilers provide these intrinsics without headers.
#define ds4_mul_rn(a, b) __fmul_rn((a), (b))
#define ds4_sub_rn(a, b) __fsub_rn((a), (b))

// IEEE half -> float by bit manipulation (exact for every input, incl. subnormals, Inf, NaN),
// so no cuda_fp16.h / hip_fp16.h is needed.
__device__ __forceinline__ float ds4_h2f(u16 h) {
    u32 s = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; // m * 2^-24, exact
        return __int_as_float(__float_as_int(v) | s);
    }
    if (e == 31) return __int_as_float(s | 0x7f800000u | (m << 13));
    return __int_as_float(s | ((e + 112u) << 23) | (m << 13));
}

// The same conversion (low 16 bits of h) by the hardware instruction where there is one (CUDA:
// cvt.f32.f16, also exact); ds4_h2f's branches make F16-heavy inner loops ALU-bound.
__device__ __forceinline__ float ds4_h2f_fast(u32 h) {
#if defined(DS4_CUDA)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#else
    return ds4_h2f((u16)h);
#endif
}

__device__ __forceinline__ float ds4_bf2f(u16 h) { return __int_as_float((u32)h << 16); }

// float -> bf16 bits, round to nearest even (NaN kept quiet). Exact for values with at most 8
// significant bits, such as the FP4-simulated indexer rows (e2m1 · 2^k).
__device__ __forceinline__ u16 ds4_f2bf(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Little-endian loads from byte pointers of any alignment.
__device__ __forceinline__ u16 ds4_ld_u16(const u8* p) { return (u16)(p[0] | (p[1] << 8)); }
__device__ __forceinline__ u32 ds4_ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// Sum over the lanes of one warp; every lane gets the total.
__device__ __forceinline__ float ds4_warp_sum(float v) {
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) v += ds4_shfl_xor(v, o);
    return v;
}
__device__ __forceinline__ double ds4_warp_sum_f64(double v) {
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) v += ds4_shfl_xor(v, o);
    return v;
}
__device__ __forceinline__ u32 ds4_warp_sum_u32(u32 v) {
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) v += ds4_shfl_xor(v, o);
    return v;
}

// The MoE's SwiGLU of one element (gate g, up u, clamp, route weight w): matmul.cu
// moe_swiglu_f32 and gemm.cu gemm_xt_swiglu_f32 share it, so both give the same bits.
__device__ __forceinline__ float ds4_moe_swiglu(float g, float u, float clamp, float w) {
    float gv = fminf(g, clamp), uv = fminf(fmaxf(u, -clamp), clamp);
    return gv * (1.0f / (1.0f + expf(-gv))) * uv * w;
}

// A probe's time stamp: CUDA %globaltimer (ns), HIP clock64 (ticks). Probes only (fused.cu
// hc_post_pre_norm_p, attention.cu attend_one_p / _tc*p, elementwise.cu probe_*).
__device__ __forceinline__ u64 ds4_now() {
#if defined(DS4_CUDA)
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return (u64)clock64();
#endif
}

// Programmatic dependent launch (CUDA, sm_90+). A kernel whose body STARTS with
// `ds4_pdl_enter();` may be launched with the PDL attribute (the host finds these kernels by
// that text: ds4_kernels::pdl_kernels): it is then scheduled while the previous kernel still
// runs, and the wait holds it, before any memory access, until every earlier kernel of the
// stream has finished and its writes are visible. The trigger then lets the next PDL kernel be
// scheduled while this one runs. Without the attribute, and on HIP or older GPUs, a no-op.
// (Kernels with a grid barrier stay safe: a dependent launches only after every CTA of its
// predecessor has passed this point, so all of them are resident.)
__device__ __forceinline__ void ds4_pdl_enter() {
#if defined(DS4_CUDA) && DS4_ARCH >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Named CTA barrier `id` (1..15; 0 is __syncthreads) of n threads (a multiple of the warp width,
// whole warps): CUDA bar.sync. Called only on CUDA paths (a no-op elsewhere). Users: fused.cu
// (the HC epilogue's warps), attn_tc.cu (index_scores_wg's per-warpgroup term tiles).
__device__ __forceinline__ void ds4_bar_named(int id, int n) {
#if defined(DS4_CUDA)
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
#else
    (void)id, (void)n;
#endif
}

// A kernel body starting `DS4_PDL_LATE;` is also launched with PDL (ds4_kernels::pdl_kernels) but
// calls ds4_pdl_enter() itself, after loads of weights only (nothing an earlier kernel writes):
// those loads then overlap the previous kernel's tail.
#define DS4_PDL_LATE \
    do {             \
    } while (0)
