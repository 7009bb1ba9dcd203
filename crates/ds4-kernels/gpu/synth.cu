// Random weights generated on the device (file-less full-size benchmarks). Every value comes
// from a counter-based hash of (seed, index), so a tensor is the same whatever the launch shape,
// and the host can reproduce it (ds4-gpu model/synth.rs mirrors `synth_byte`).
#include "prelude.cuh"

// splitmix64 finaliser of z.
__device__ __forceinline__ u64 ds4_mix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Random byte i of the stream `seed` (one hash per 8 bytes).
__device__ __forceinline__ u32 ds4_rbyte(u64 seed, u64 i) {
    return (u32)(ds4_mix64(seed ^ ((i >> 3) * 0xd1b54a32d192ed03ull)) >> ((i & 7) * 8)) & 0xffu;
}

// Uniform [0, 1) for element e (24 bits).
__device__ __forceinline__ float ds4_unif(u64 seed, u64 e) {
    return (float)(u32)(ds4_mix64(seed ^ (e * 0x8cb92ba72f3d8dd7ull)) >> 40) * 5.9604644775390625e-8f;
}

// float -> IEEE half, round to nearest even (subnormals, overflow to Inf).
__device__ __forceinline__ u16 ds4_f2h(float f) {
    u32 x = (u32)__float_as_int(f);
    u32 s = (x >> 16) & 0x8000u, ef = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (ef == 0xffu) return (u16)(s | 0x7c00u | (m ? 0x200u : 0u));
    int e = (int)ef - 112; // half exponent field
    if (e >= 31) return (u16)(s | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (u16)s;
        m |= 0x800000u;
        u32 sh = (u32)(14 - e), h = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (u16)(s | h);
    }
    u32 h = ((u32)e << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; // carries into the exponent correctly
    return (u16)(s | h);
}

// Type codes of synth_quant (host: model/synth.rs QCODE).
#define SQ_Q8_0 1
#define SQ_Q2_K 2
#define SQ_Q4_K 3
#define SQ_IQ2_XXS 4

__device__ __forceinline__ u32 ds4_q4k_sc(u64 seed, u64 base, int j) { return 1u + ds4_rbyte(seed, base + 4 + j) % 8u; }
__device__ __forceinline__ u32 ds4_q4k_m(u64 seed, u64 base, int j) { return (ds4_q4k_sc(seed, base, j) * 15u + 1u) / 2u; }

// Byte i of a stream of random valid blocks with f16 super-block scale `dbits` (and dmin = d).
// Codes are spread so the dequantised mean is ≈ 0 (same recipe as crates/ds4-synth blocks.rs).
__device__ __forceinline__ u32 ds4_synth_byte(int ty, u64 seed, u32 dbits, u64 i) {
    u32 dl = dbits & 0xffu, dh = (dbits >> 8) & 0xffu;
    switch (ty) {
    case SQ_Q8_0: { // d f16, qs i8[32]; -128 avoided (symmetric codes)
        u64 o = i % 34;
        if (o < 2) return o == 0 ? dl : dh;
        u32 r = ds4_rbyte(seed, i);
        return r == 0x80u ? 0x81u : r;
    }
    case SQ_Q2_K: { // scales[16] (scale | min<<4), qs[64], d, dmin
        u64 o = i % 84;
        if (o < 16) {
            u32 sc = 1u + ds4_rbyte(seed, i) % 10u, m = (sc * 3u + 1u) / 2u;
            return sc | (m << 4);
        }
        if (o >= 80) return (o & 1) ? dh : dl;
        return ds4_rbyte(seed, i);
    }
    case SQ_Q4_K: { // d, dmin, scales[12] (6-bit scale/min of 8 sub-blocks), qs[128]
        u64 o = i % 144, base = i - o;
        if (o < 4) return (o & 1) ? dh : dl;
        if (o < 16) {
            int s = (int)o - 4;
            if (s < 4) return ds4_q4k_sc(seed, base, s) | ((ds4_q4k_sc(seed, base, s + 4) >> 4) << 6);
            if (s < 8) return ds4_q4k_m(seed, base, s - 4) | ((ds4_q4k_m(seed, base, s) >> 4) << 6);
            int j = s - 8;
            return (ds4_q4k_sc(seed, base, j + 4) & 15u) | ((ds4_q4k_m(seed, base, j + 4) & 15u) << 4);
        }
        return ds4_rbyte(seed, i);
    }
    default: { // IQ2_XXS: d, then any bits are valid grid indices / signs / scales
        u64 o = i % 66;
        if (o < 2) return o == 0 ? dl : dh;
        return ds4_rbyte(seed, i);
    }
    }
}

// out: n_bytes of blocks of type `ty` (whole blocks). One thread per byte, grid-stride.
DS4_KERNEL void DS4_BOUNDS(256) synth_quant(u8* __restrict__ out, long long n_bytes, int ty, long long seed, u32 dbits) {
    ds4_pdl_enter();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)n_bytes; i += stride)
        out[i] = (u8)ds4_synth_byte(ty, (u64)seed, dbits, i);
}

// out[e] = center + U(-spread, spread), f32.
DS4_KERNEL void DS4_BOUNDS(256) synth_f32(float* __restrict__ out, long long n, long long seed, float center, float spread) {
    ds4_pdl_enter();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < (u64)n; e += stride)
        out[e] = center + (2.0f * ds4_unif((u64)seed, e) - 1.0f) * spread;
}

// The same values stored as f16.
DS4_KERNEL void DS4_BOUNDS(256) synth_f16(u16* __restrict__ out, long long n, long long seed, float center, float spread) {
    ds4_pdl_enter();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < (u64)n; e += stride)
        out[e] = ds4_f2h(center + (2.0f * ds4_unif((u64)seed, e) - 1.0f) * spread);
}

// rows × k i32 expert ids, each row k distinct ids in [0, n_expert) (k <= 32; rejection draws).
DS4_KERNEL void DS4_BOUNDS(256) synth_expert_ids(int* __restrict__ out, long long rows, int k, int n_expert, long long seed) {
    ds4_pdl_enter();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < (u64)rows; t += stride) {
        int ids[32];
        u64 draw = t * 0x9e3779b97f4a7c15ull;
        for (int i = 0; i < k && i < 32; i++) {
            int id;
            bool dup;
            do {
                id = (int)(ds4_mix64((u64)seed ^ draw++) % (u64)n_expert);
                dup = false;
                for (int j = 0; j < i; j++) dup = dup || ids[j] == id;
            } while (dup);
            ids[i] = id;
            out[t * (u64)k + i] = id;
        }
    }
}
