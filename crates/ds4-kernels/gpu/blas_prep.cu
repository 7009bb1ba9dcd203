// Operands for the vendor BLAS-Lt products (ds4-gpu model/blas.rs): weights dequantised and
// activations converted to bf16, split into hi = bf16_rn(v) and lo = bf16_rn(v - hi) and laid
// side by side along K so that ONE bf16 product with f32 accumulation sums the three terms of
// the built-in GEMM's hi/lo form (gemm.cu):
//   W' row r = [W_hi | W_hi | W_lo],  X' row t = [X_hi | X_lo | X_hi]   (parts = 3)
//   W' = [W_hi | W_hi],               X' = [X_hi | X_lo]                (parts = 2: BF16 weights, lo = 0)
//   W' = [W_hi],                      X' = [X_hi]                       (parts = 1: the fast form)
// W' is rows × parts·K bf16 (row-major), X' is n × G × parts·K (G column groups of K each: the
// grouped product's groups, 1 for a dense one). One thread per 8 elements (16-byte stores);
// K is a multiple of 32 (the host checks).
#include "prelude.cuh"
#include "dequant.cuh"

// bf16 round-to-nearest-even of a finite f32.
__device__ __forceinline__ u32 bp_bf16(float v) {
    u32 u = __float_as_int(v);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// 8 values to packed hi and lo bf16 words (element 2i in the low half of word i).
__device__ __forceinline__ void bp_split8(const float* v, uint4& hi, uint4& lo) {
    u32 h[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 h0 = bp_bf16(v[2 * i]), h1 = bp_bf16(v[2 * i + 1]);
        float r0 = v[2 * i] - __int_as_float(h0 << 16), r1 = v[2 * i + 1] - __int_as_float(h1 << 16); // exact
        h[i] = h0 | (h1 << 16);
        l[i] = bp_bf16(r0) | (bp_bf16(r1) << 16);
    }
    hi = make_uint4(h[0], h[1], h[2], h[3]);
    lo = make_uint4(l[0], l[1], l[2], l[3]);
}

// Slice i (8 elements) of W (rows of row_bytes GGUF bytes, K elements), dequantised, in W'
// order: row r = i / (K/8), slice s of the row. False past the end.
template <int T>
__device__ __forceinline__ bool bp_w_slice(const u8* __restrict__ W, long long row_bytes, int K, long long rows, long long i, float (&v)[8]) {
    int per = K / 8;
    if (i >= rows * per) return false;
    long long r = i / per;
    int s = (int)(i - r * per);
    deq_slice<T>(W + r * row_bytes, s >> 2, s & 3, v);
    return true;
}

// Slice i's 8 values v into W' (rows × parts·K bf16). Part p: lo when p == 2, else hi.
__device__ __forceinline__ void bp_w_store(long long i, const float (&v)[8], int K, int parts, uint4* __restrict__ out) {
    uint4 hi, lo;
    bp_split8(v, hi, lo);
    const int per = K / 8;
    uint4* o = out + (i / per) * (parts - 1) * per + i; // row r's parts·per slices, slice s of part p at p·per + s
    for (int p = 0; p < parts; p++) o[p * per] = p == 2 ? lo : hi;
}

// W (rows of row_bytes GGUF bytes, K elements) -> W' (rows × parts·K bf16).
template <int T>
__device__ __forceinline__ void bp_w(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    float v[8];
    if (bp_w_slice<T>(W, row_bytes, K, rows, i, v)) bp_w_store(i, v, K, parts, out);
}

DS4_KERNEL void DS4_BOUNDS(256) blas_w_f32(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_F32>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_f16(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_F16>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_bf16(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_BF16>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_q8_0(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_Q8_0>(W, row_bytes, K, rows, parts, out); }

// Slice i of a Q8_0 matrix in the decode layout (matvec.cu q8_repack / q8_repack_i: quants Q,
// row r at byte r·K, then the f16 scales D, block b of row r at r·K/32 + b; IL: tiles of 512
// columns whose slot s holds in word j the quants of tile columns 128j + 4s .. + 3, the scale of
// tile block 4j + q at D[16·tile + 4q + j]): the 8 values bp_w_slice<T_Q8_0> gives from the GGUF
// blocks (d·q, one rounding), so W' is the same bits from either layout.
template <bool IL>
__device__ __forceinline__ bool bp_wd_slice(const u8* __restrict__ Q, const u16* __restrict__ D, int K, long long rows, long long i, float (&v)[8]) {
    const int per = K / 8;
    if (i >= rows * per) return false;
    const long long e0 = 8 * i; // the slice's first element (row-major: r·K + 8s)
    u32 a, b;
    float d;
    if (IL) {
        const long long t = e0 >> 9; // tiles never straddle rows (K % 512 == 0)
        const int c = (int)(e0 & 511), j = c >> 7, sl = (c & 127) >> 2;
        const u8* tb = Q + t * 512 + 4 * j;
        a = *(const u32*)(tb + 16 * sl); // columns c .. c + 3
        b = *(const u32*)(tb + 16 * (sl + 1)); // c + 4 .. c + 7 (same word j, same block)
        d = ds4_h2f(D[t * 16 + 4 * ((c & 127) >> 5) + j]);
    } else {
        const uint2 q = *(const uint2*)(Q + e0);
        a = q.x, b = q.y;
        d = ds4_h2f(D[e0 >> 5]);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[k] = ds4_mul_rn((float)(signed char)((a >> (8 * k)) & 0xffu), d);
        v[4 + k] = ds4_mul_rn((float)(signed char)((b >> (8 * k)) & 0xffu), d);
    }
    return true;
}

// bp_w from the decode layout (model/blas.rs `blas_w` where the matrix has one).
template <bool IL>
__device__ __forceinline__ void bp_wd(const u8* __restrict__ Q, const u16* __restrict__ D, int K, long long rows, int parts, uint4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    float v[8];
    if (bp_wd_slice<IL>(Q, D, K, rows, i, v)) bp_w_store(i, v, K, parts, out);
}

DS4_KERNEL void DS4_BOUNDS(256) blas_w_q8_0d(const u8* __restrict__ Q, const u16* __restrict__ D, int K, long long rows, int parts, uint4* __restrict__ out) { bp_wd<false>(Q, D, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_q8_0di(const u8* __restrict__ Q, const u16* __restrict__ D, int K, long long rows, int parts, uint4* __restrict__ out) { bp_wd<true>(Q, D, K, rows, parts, out); }

// Slice i (8 elements) of X [n rows, stride x_tok floats; G groups of K], in X' order: row t,
// group g, slice s of the group (i = (t·G + g)·K/8 + s). False past the end.
__device__ __forceinline__ bool bp_x_slice(const float* __restrict__ X, long long x_tok, int K, int G, long long n, long long i, float4& a, float4& b) {
    int per = K / 8;
    long long rg = i / per; // row t * G + group g
    if (rg >= n * G) return false;
    int s = (int)(i - rg * per);
    long long t = rg / G;
    int g = (int)(rg - t * G);
    const float4* src = (const float4*)(X + t * x_tok + (long long)g * K + 8 * s);
    a = src[0], b = src[1];
    return true;
}

// X (n rows, stride x_tok floats; G groups of K) -> X' [n][G][parts·K] bf16. Part p: lo when
// p == 1, else hi.
DS4_KERNEL void DS4_BOUNDS(256) blas_x_f32(const float* __restrict__ X, long long x_tok, int K, int G, long long n, int parts, uint4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    float4 a, b;
    if (!bp_x_slice(X, x_tok, K, G, n, i, a, b)) return;
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint4 hi, lo;
    bp_split8(v, hi, lo);
    const int per = K / 8;
    const long long rg = i / per; // slice s = i - rg·per of row-group rg -> parts·per slices a row-group
    uint4* o = out + rg * (parts - 1) * per + i;
    for (int p = 0; p < parts; p++) o[p * per] = p == 1 ? lo : hi;
}

// bf16 -> f32 (exact): n8 slices of 8 values. The fallback of Backend::attend_project when the
// library declines the product whose X' the attention wrote (model/mod.rs).
DS4_KERNEL void DS4_BOUNDS(256) blas_x_widen(const uint4* __restrict__ in, long long n8, float4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const uint4 v = in[i];
    out[2 * i] = make_float4(__int_as_float(v.x << 16), __int_as_float(v.x & 0xffff0000u), __int_as_float(v.y << 16), __int_as_float(v.y & 0xffff0000u));
    out[2 * i + 1] = make_float4(__int_as_float(v.z << 16), __int_as_float(v.z & 0xffff0000u), __int_as_float(v.w << 16), __int_as_float(v.w & 0xffff0000u));
}

// ---- The f16 form (DS4_GPU_BLAS=f16): ONE product of f16 operands, f32 accumulation ----
// W' = f16(W · 2^-u) (rows × K), X' = f16(X · 2^s) ([n][G][K]), and the library scales by a
// device-side alpha = 2^(u-s), so y = W·X up to one f16 rounding per operand (~2^-11 each).
// s: one power of two per product from max|X|, so max|X|·2^s < 2^15 (f16 max 65504): no
//    overflow whatever the activations, and a product of small values keeps its bits (f16
//    normals end at 2^-14). Values below max|X|·2^-29 of the same product fall in f16's
//    subnormals (absolute error max|X|·2^-40); a per-token scale would need a pass over y.
// u: Q8_0 weights (|q| ≤ 128, d an f16): 128·max|d|·2^-u < 2^15, so u = 0 unless some block's
//    d ≥ 256 (never in real weights; then the whole weight is scaled down instead of producing
//    Inf). F16 weights: u = 0 (already f16).
// blas_amax writes BP_P partial maxima (|x| as f32 bits, |d| as f16 bits: both order like
// their magnitudes as unsigned integers); every consumer block reduces them again (2 KB from
// L2), so no atomics, no memset, deterministic.
#define BP_P 256 // blas_amax's blocks (host: model/blas.rs AMAX_BLOCKS)

#if defined(DS4_CUDA) && DS4_ARCH >= 800
#include "ptx.cuh"
#endif

// Two floats to packed f16 (v0 in the low half), round to nearest even.
__device__ __forceinline__ u32 bp_h2(float v0, float v1) {
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    return ds4_f16x2(v0, v1);
#elif defined(DS4_CUDA)
    unsigned short a, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(v0));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(v1));
    return (u32)a | ((u32)b << 16);
#else
    union { _Float16 h; u16 u; } a, b;
    a.h = (_Float16)v0;
    b.h = (_Float16)v1;
    return (u32)a.u | ((u32)b.u << 16);
#endif
}

__device__ __forceinline__ u32 bp_umax(u32 a, u32 b) { return a > b ? a : b; }

// Max of (a, b) over the block's 256 threads; every thread gets both.
__device__ __forceinline__ void bp_bmax2(u32& a, u32& b) {
    __shared__ u32 sa[256], sb[256];
    int t = threadIdx.x;
    sa[t] = a, sb[t] = b;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if (t < o) sa[t] = bp_umax(sa[t], sa[t + o]), sb[t] = bp_umax(sb[t], sb[t + o]);
        __syncthreads();
    }
    a = sa[0], b = sb[0];
}

// The product's (max|x| bits, max|d| bits) from blas_amax's partials (256-thread blocks).
__device__ __forceinline__ void bp_maxes(const u32* __restrict__ part, u32& mx, u32& md) {
    int t = threadIdx.x;
    mx = t < BP_P ? part[2 * t] : 0u;
    md = t < BP_P ? part[2 * t + 1] : 0u;
    bp_bmax2(mx, md);
}

__device__ __forceinline__ float bp_pow2(int e) { return __int_as_float((127 + e) << 23); } // e in [-126, 127]
// s = 14 - exponent(max|x|), the biased exponent clamped to [27, 254]: s in [-113, 114].
__device__ __forceinline__ int bp_xs(u32 mx) {
    int e = (int)(mx >> 23);
    e = e < 27 ? 27 : (e > 254 ? 254 : e);
    return 141 - e;
}
// u = max(0, exponent(max|d|) - 7) from the f16 biased exponent E (E - 15 - 7): u in [0, 9].
__device__ __forceinline__ int bp_wu(u32 md) {
    int e = (int)(md >> 10);
    return e > 22 ? e - 22 : 0;
}

// Partial maxima over X (n rows of KG floats, stride x_tok) and over the d of a Q8_0 weight
// (rows × nb blocks of 34 bytes; nb = 0: no weight scan). Launched with BP_P blocks of 256.
DS4_KERNEL void DS4_BOUNDS(256) blas_amax(const float* __restrict__ X, long long x_tok, int KG, long long n, const u8* __restrict__ W, long long row_bytes, int nb, long long rows, u32* __restrict__ part) {
    u32 mx = 0, md = 0;
    long long stride = (long long)gridDim.x * blockDim.x, i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long per = KG / 4; // float4 per row
    for (long long i = i0; i < n * per; i += stride) {
        long long t = i / per;
        float4 v = ((const float4*)(X + t * x_tok))[i - t * per];
        u32 a = bp_umax((u32)__float_as_int(v.x) & 0x7fffffffu, (u32)__float_as_int(v.y) & 0x7fffffffu);
        u32 b = bp_umax((u32)__float_as_int(v.z) & 0x7fffffffu, (u32)__float_as_int(v.w) & 0x7fffffffu);
        mx = bp_umax(mx, bp_umax(a, b));
    }
    for (long long i = i0; i < rows * nb; i += stride) {
        long long r = i / nb;
        u16 d = *(const u16*)(W + r * row_bytes + (i - r * nb) * 34); // block = f16 d, 32 × i8
        md = bp_umax(md, (u32)(d & 0x7fffu));
    }
    bp_bmax2(mx, md);
    if (threadIdx.x == 0) part[2 * blockIdx.x] = mx, part[2 * blockIdx.x + 1] = md;
}

// W (rows of row_bytes GGUF bytes, K elements) -> W' = f16(W · 2^-u), rows × K row-major.
template <int T>
__device__ __forceinline__ void bp_wh(const u8* __restrict__ W, long long row_bytes, int K, long long rows, const u32* __restrict__ part, uint4* __restrict__ out) {
    u32 mx, md;
    bp_maxes(part, mx, md);
    float sw = bp_pow2(-bp_wu(md));
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    float v[8];
    if (!bp_w_slice<T>(W, row_bytes, K, rows, i, v)) return;
    out[i] = make_uint4(bp_h2(v[0] * sw, v[1] * sw), bp_h2(v[2] * sw, v[3] * sw), bp_h2(v[4] * sw, v[5] * sw), bp_h2(v[6] * sw, v[7] * sw));
}

DS4_KERNEL void DS4_BOUNDS(256) blas_wh_f16(const u8* __restrict__ W, long long row_bytes, int K, long long rows, const u32* __restrict__ part, uint4* __restrict__ out) { bp_wh<T_F16>(W, row_bytes, K, rows, part, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_wh_q8_0(const u8* __restrict__ W, long long row_bytes, int K, long long rows, const u32* __restrict__ part, uint4* __restrict__ out) { bp_wh<T_Q8_0>(W, row_bytes, K, rows, part, out); }

// X (n rows, stride x_tok floats; G groups of K) -> X' = f16(X · 2^s), [n][G][K]; block 0 also
// writes the library's device-side (alpha, beta) = (2^(u-s), 0) to ab.
DS4_KERNEL void DS4_BOUNDS(256) blas_xh_f32(const float* __restrict__ X, long long x_tok, int K, int G, long long n, const u32* __restrict__ part, float* __restrict__ ab, uint4* __restrict__ out) {
    u32 mx, md;
    bp_maxes(part, mx, md);
    int sh = bp_xs(mx);
    if (blockIdx.x == 0 && threadIdx.x == 0) ab[0] = bp_pow2(bp_wu(md) - sh), ab[1] = 0.0f;
    float sx = bp_pow2(sh);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    float4 a, b;
    if (!bp_x_slice(X, x_tok, K, G, n, i, a, b)) return;
    out[i] = make_uint4(bp_h2(a.x * sx, a.y * sx), bp_h2(a.z * sx, a.w * sx), bp_h2(b.x * sx, b.y * sx), bp_h2(b.z * sx, b.w * sx));
}
