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

// W (rows of row_bytes GGUF bytes, K elements) -> W' (rows × parts·K bf16). Part p: lo when
// p == 2, else hi.
template <int T>
__device__ __forceinline__ void bp_w(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    int per = K / 8;
    if (i >= rows * per) return;
    long long r = i / per;
    int s = (int)(i - r * per);
    float v[8];
    deq_slice<T>(W + r * row_bytes, s >> 2, s & 3, v);
    uint4 hi, lo;
    bp_split8(v, hi, lo);
    uint4* o = out + r * parts * per + s;
    for (int p = 0; p < parts; p++) o[p * per] = p == 2 ? lo : hi;
}

DS4_KERNEL void DS4_BOUNDS(256) blas_w_f32(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_F32>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_f16(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_F16>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_bf16(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_BF16>(W, row_bytes, K, rows, parts, out); }
DS4_KERNEL void DS4_BOUNDS(256) blas_w_q8_0(const u8* __restrict__ W, long long row_bytes, int K, long long rows, int parts, uint4* __restrict__ out) { bp_w<T_Q8_0>(W, row_bytes, K, rows, parts, out); }

// X (n rows, stride x_tok floats; G groups of K) -> X' [n][G][parts·K] bf16. Part p: lo when
// p == 1, else hi.
DS4_KERNEL void DS4_BOUNDS(256) blas_x_f32(const float* __restrict__ X, long long x_tok, int K, int G, long long n, int parts, uint4* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; // 8-element slice
    int per = K / 8;
    long long rg = i / per; // row t * G + group g
    if (rg >= n * G) return;
    int s = (int)(i - rg * per);
    long long t = rg / G;
    int g = (int)(rg - t * G);
    const float4* src = (const float4*)(X + t * x_tok + (long long)g * K + 8 * s);
    float4 a = src[0], b = src[1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint4 hi, lo;
    bp_split8(v, hi, lo);
    uint4* o = out + rg * parts * per + s;
    for (int p = 0; p < parts; p++) o[p * per] = p == 1 ? lo : hi;
}
