// Hyper-connection helpers shared by model.cu (the separate HC ops) and fused.cu (the fused decode
// glue): f32 exp/sigmoid rounded once from f64, and the Sinkhorn of one token's mixer row. The
// CPU reference is ds4-cpu backend.rs hc_split (operation order and roundings follow it).
#pragma once
#include "prelude.cuh"

// f32 exp / log1p rounded once from f64: correctly rounded in nearly every case, like glibc.
__device__ __forceinline__ float ds4_expf_cr(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float ds4_log1pf_cr(float x) { return (float)log1p((double)x); }

// 1 / (1 + e^-x), as math.rs sigmoid.
__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / (1.0f + ds4_expf_cr(-x)); }

// Sinkhorn of one token for exactly NN streams on this thread, from its mixer row mt
// ((2+NN)·NN values, pre-scale): post [NN], comb [NN·NN]. The CPU's operations in its order,
// all NN·NN values in registers.
template <int NN>
__device__ __forceinline__ void hc_sinkhorn_thread(const float* mt, const float* __restrict__ scale, const float* __restrict__ base, float* __restrict__ post_t, float* __restrict__ comb_t, int iters, float eps) {
    float pl[NN], a[NN][NN];
    const float s1 = scale[1], s2 = scale[2];
#pragma unroll
    for (int i = 0; i < NN; i++) pl[i] = ds4_mul_rn(mt[NN + i], s1) + base[NN + i];
#pragma unroll
    for (int r = 0; r < NN; r++)
#pragma unroll
        for (int b = 0; b < NN; b++) a[r][b] = ds4_mul_rn(mt[2 * NN + r * NN + b], s2) + base[2 * NN + r * NN + b];
#pragma unroll
    for (int i = 0; i < NN; i++) post_t[i] = 2.0f * ds4_sigmoid(pl[i]);
#pragma unroll
    for (int r = 0; r < NN; r++) { // row softmax + eps (the rows are independent chains)
        float mx = DS4_NEG_INF;
#pragma unroll
        for (int b = 0; b < NN; b++) mx = fmaxf(mx, a[r][b]);
        float s = 0.0f;
#pragma unroll
        for (int b = 0; b < NN; b++) {
            a[r][b] = ds4_expf_cr(a[r][b] - mx);
            s += a[r][b];
        }
#pragma unroll
        for (int b = 0; b < NN; b++) a[r][b] = a[r][b] / s + eps;
    }
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        if (it > 0) { // row normalise (the first pass only normalises columns)
#pragma unroll
            for (int r = 0; r < NN; r++) {
                float s = 0.0f;
#pragma unroll
                for (int b = 0; b < NN; b++) s += a[r][b];
                s += eps;
#pragma unroll
                for (int b = 0; b < NN; b++) a[r][b] /= s;
            }
        }
#pragma unroll
        for (int c = 0; c < NN; c++) { // column normalise
            float s = 0.0f;
#pragma unroll
            for (int r = 0; r < NN; r++) s += a[r][c];
            s += eps;
#pragma unroll
            for (int r = 0; r < NN; r++) a[r][c] /= s;
        }
    }
#pragma unroll
    for (int r = 0; r < NN; r++)
#pragma unroll
        for (int b = 0; b < NN; b++) comb_t[r * NN + b] = a[r][b];
}

// hc_sinkhorn_thread for NN = 4 by the 16 first lanes of a warp (the whole warp calls it): lane
// e holds A[e / 4][e % 4]; its row and column mates come by xor shuffles and are summed in index
// order, as the CPU sums. Same values as hc_sinkhorn_thread<4>.
__device__ __forceinline__ void hc_sinkhorn4_warp(const float* m, const float* __restrict__ scale, const float* __restrict__ base, float* __restrict__ post_t, float* __restrict__ comb_t, int iters, float eps) {
    const int l = threadIdx.x % DS4_WARP, e = l & 15, r = e >> 2, b = e & 3;
    if (l < 4) post_t[l] = 2.0f * ds4_sigmoid(ds4_mul_rn(m[4 + l], scale[1]) + base[4 + l]);
    float a = ds4_mul_rn(m[8 + e], scale[2]) + base[8 + e];
    // Value of index k of the row: lane xor (b ^ k); of row k of the column: lane xor 4·(r ^ k).
#define HC_PICK(o, v0, v1, v2, v3) ((o) == 0 ? (v0) : (o) == 1 ? (v1) : (o) == 2 ? (v2) : (v3))
#define HC_SUM4(s, i, v0, v1, v2, v3)                                        \
    {                                                                        \
        s = HC_PICK(i, v0, v1, v2, v3) + HC_PICK((i) ^ 1, v0, v1, v2, v3);   \
        s = s + HC_PICK((i) ^ 2, v0, v1, v2, v3);                            \
        s = s + HC_PICK((i) ^ 3, v0, v1, v2, v3);                            \
    }
    { // row softmax + eps
        const float x1 = ds4_shfl_xor(a, 1), x2 = ds4_shfl_xor(a, 2), x3 = ds4_shfl_xor(a, 3);
        const float mx = fmaxf(fmaxf(a, x1), fmaxf(x2, x3));
        a = ds4_expf_cr(a - mx);
        const float y1 = ds4_shfl_xor(a, 1), y2 = ds4_shfl_xor(a, 2), y3 = ds4_shfl_xor(a, 3);
        float s;
        HC_SUM4(s, b, a, y1, y2, y3);
        a = a / s + eps;
    }
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        float s;
        if (it > 0) { // rows (the first pass normalises columns only)
            const float x1 = ds4_shfl_xor(a, 1), x2 = ds4_shfl_xor(a, 2), x3 = ds4_shfl_xor(a, 3);
            HC_SUM4(s, b, a, x1, x2, x3);
            a /= s + eps;
        }
        const float c1 = ds4_shfl_xor(a, 4), c2 = ds4_shfl_xor(a, 8), c3 = ds4_shfl_xor(a, 12);
        HC_SUM4(s, r, a, c1, c2, c3);
        a /= s + eps;
    }
#undef HC_SUM4
#undef HC_PICK
    if (l < 16) comb_t[e] = a;
}

// Sinkhorn of one token (post, comb) by warp-cooperative (NN = 4) or one-thread (NN < 4) code;
// the whole warp calls it. m: the token's mixer row (shared or global memory).
template <int NN>
__device__ __forceinline__ void hc_sinkhorn_by_warp(const float* m, const float* __restrict__ scale, const float* __restrict__ base, float* __restrict__ post_t, float* __restrict__ comb_t, int iters, float eps) {
    if (NN == 4) hc_sinkhorn4_warp(m, scale, base, post_t, comb_t, iters, eps);
    else if (threadIdx.x % DS4_WARP == 0) hc_sinkhorn_thread<NN>(m, scale, base, post_t, comb_t, iters, eps);
}

// Sum of the first NN of four values, pairwise for NN = 4 (a shorter dependent chain than the
// CPU's serial order; ~1 ulp apart).
template <int NN>
__device__ __forceinline__ float hc_sum4(float v0, float v1, float v2, float v3) {
    return NN == 4 ? (v0 + v1) + (v2 + v3) : NN == 3 ? (v0 + v1) + v2 : NN == 2 ? v0 + v1 : v0;
}

// 1 / x to ~1 ulp in one MUFU op (CUDA), for the Sinkhorn's normalisations (sums near 1).
__device__ __forceinline__ float hc_rcp(float x) {
#if defined(DS4_CUDA)
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#else
    return __fdividef(1.0f, x);
#endif
}

// σ(x) with the f32 expf (~1 ulp; ds4_sigmoid rounds an f64 exp: ~10x the latency).
__device__ __forceinline__ float hc_sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// a[·][c] *= 1 / (Σ_r a[r][c] + eps) for the NN columns.
template <int NN>
__device__ __forceinline__ void hc_cols_rcp(float (&a)[4][4], float eps) {
#pragma unroll
    for (int c = 0; c < NN; c++) {
        const float i = hc_rcp(hc_sum4<NN>(a[0][c], a[1][c], a[2][c], a[3][c]) + eps);
#pragma unroll
        for (int r = 0; r < NN; r++) a[r][c] *= i;
    }
}

// Sinkhorn iterations of one token (NN <= 4) for latency, by a whole warp (lane 0 stores):
// e [NN·NN] (shared memory) holds exp(logit - its row's max); every lane loads all of them and
// runs the row softmax + eps and the iterations in registers, with pairwise sums and
// reciprocal multiplies (no shuffle, no division in the 2·iters dependent steps). The CPU's
// operations (hc_split) up to the sums' order and the reciprocals: ~1e-6 apart, not bit-equal.
template <int NN>
__device__ __forceinline__ void hc_sinkhorn_regs(const float* e, float* __restrict__ comb_t, int iters, float eps) {
    float a[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int b = 0; b < 4; b++) a[r][b] = r < NN && b < NN ? e[r * NN + b] : 0.0f;
#pragma unroll
    for (int r = 0; r < NN; r++) { // row softmax + eps
        const float i = hc_rcp(hc_sum4<NN>(a[r][0], a[r][1], a[r][2], a[r][3]));
#pragma unroll
        for (int b = 0; b < NN; b++) a[r][b] = a[r][b] * i + eps;
    }
    hc_cols_rcp<NN>(a, eps); // the first pass normalises columns only
    for (int it = 1; it < iters; it++) {
#pragma unroll
        for (int r = 0; r < NN; r++) { // rows
            const float i = hc_rcp(hc_sum4<NN>(a[r][0], a[r][1], a[r][2], a[r][3]) + eps);
#pragma unroll
            for (int b = 0; b < NN; b++) a[r][b] *= i;
        }
        hc_cols_rcp<NN>(a, eps);
    }
    if (threadIdx.x % DS4_WARP == 0) {
#pragma unroll
        for (int r = 0; r < NN; r++)
#pragma unroll
            for (int b = 0; b < NN; b++) comb_t[r * NN + b] = a[r][b];
    }
}
