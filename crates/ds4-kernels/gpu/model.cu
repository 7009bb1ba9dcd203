// Model glue ops: embedding, hyper-connections (split/collapse/post), router. The CPU reference is
// ds4-cpu backend.rs; every f32 operation here is done in the CPU's order with the same roundings
// (no fma contraction: products go through ds4_mul_rn), so results match bit for bit except where
// libm's exp/log1p and the device's differ by an ulp (exp/log1p are taken in f64 and rounded once).
#include "prelude.cuh"

#define DS4_HC_MAX 16        // most hyper-connection streams N supported
#define DS4_ROUTE_MAX_E 1024 // most experts the router supports
#define DS4_ROUTE_MAX_K 32   // most experts used per token

// f32 exp / log1p rounded once from f64: correctly rounded in nearly every case, like glibc.
__device__ __forceinline__ float ds4_expf_cr(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float ds4_log1pf_cr(float x) { return (float)log1p((double)x); }

// 1 / (1 + e^-x), as math.rs sigmoid.
__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / (1.0f + ds4_expf_cr(-x)); }

// Element k of a weight row of type ty (0 f32, 1 f16, 2 bf16, 3 q8_0), as ds4-quant dequantises it.
__device__ __forceinline__ float ds4_row_elem(const u8* __restrict__ row, int k, int ty) {
    switch (ty) {
    case 0: return __int_as_float((int)ds4_ld_u32(row + (size_t)k * 4));
    case 1: return ds4_h2f(ds4_ld_u16(row + (size_t)k * 2));
    case 2: return ds4_bf2f(ds4_ld_u16(row + (size_t)k * 2));
    default: { // q8_0: 34-byte blocks of d f16 + 32 i8
        const u8* b = row + (size_t)(k >> 5) * 34;
        return ds4_mul_rn((float)(signed char)b[2 + (k & 31)], ds4_h2f(ds4_ld_u16(b)));
    }
    }
}

// out[(i*copies + c)*d + k] = W[tok[i]][k]. Grid: n CTAs (one per token).
DS4_KERNEL void DS4_BOUNDS(256) embed_rows(const u8* __restrict__ W, const int* __restrict__ tok, float* __restrict__ out, int copies, int d, long long row_bytes, int ty) {
    const int i = blockIdx.x;
    const u8* row = W + (size_t)tok[i] * (size_t)row_bytes;
    float* o = out + (size_t)i * copies * d;
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        float v = ds4_row_elem(row, k, ty);
        for (int c = 0; c < copies; c++) o[(size_t)c * d + k] = v;
    }
}

// HC pre for one token per CTA. m [n, (2+N)N], x [n, N, D] -> z [n, D], post [n, N], comb [n, N*N].
// The N x N Sinkhorn runs on N threads (a row or a column each, serial sums like the CPU).
DS4_KERNEL void DS4_BOUNDS(256) hc_split(const float* __restrict__ m, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ x, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, int N, int D, int iters, float eps) {
    __shared__ float A[DS4_HC_MAX * DS4_HC_MAX];
    __shared__ float pre[DS4_HC_MAX];
    const int t = blockIdx.x, tid = threadIdx.x, mix = (2 + N) * N;
    const float* mt = m + (size_t)t * mix;
    if (tid < N) {
        pre[tid] = ds4_sigmoid(ds4_mul_rn(mt[tid], scale[0]) + base[tid]) + eps;
        post[(size_t)t * N + tid] = 2.0f * ds4_sigmoid(ds4_mul_rn(mt[N + tid], scale[1]) + base[N + tid]);
        // Row tid: logits, softmax (max, exp, serial sum, divide), + eps.
        float* r = A + tid * N;
        float mx = DS4_NEG_INF;
        for (int b = 0; b < N; b++) {
            r[b] = ds4_mul_rn(mt[2 * N + tid * N + b], scale[2]) + base[2 * N + tid * N + b];
            mx = fmaxf(mx, r[b]);
        }
        float s = 0.0f;
        for (int b = 0; b < N; b++) {
            r[b] = ds4_expf_cr(r[b] - mx);
            s += r[b];
        }
        for (int b = 0; b < N; b++) r[b] = r[b] / s + eps;
    }
    __syncthreads();
    for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
        if (it > 0) { // row normalise (the first pass only normalises columns)
            if (tid < N) {
                float* r = A + tid * N;
                float s = 0.0f;
                for (int b = 0; b < N; b++) s += r[b];
                s += eps;
                for (int b = 0; b < N; b++) r[b] /= s;
            }
            __syncthreads();
        }
        if (tid < N) { // column tid
            float s = 0.0f;
            for (int r = 0; r < N; r++) s += A[r * N + tid];
            s += eps;
            for (int r = 0; r < N; r++) A[r * N + tid] /= s;
        }
        __syncthreads();
    }
    for (int k = tid; k < N * N; k += blockDim.x) comb[(size_t)t * N * N + k] = A[k];
    // z = sum_i pre_i X[i], serial in i from 0 like the CPU.
    const float* xt = x + (size_t)t * N * D;
    for (int k = tid; k < D; k += blockDim.x) {
        float v = 0.0f;
        for (int i = 0; i < N; i++) v += ds4_mul_rn(pre[i], xt[(size_t)i * D + k]);
        z[(size_t)t * D + k] = v;
    }
}

// Head collapse, one token per CTA: y[t] = sum_i (sigmoid(m[t,i]*scale0 + base_i) + eps) X[t,i].
DS4_KERNEL void DS4_BOUNDS(256) hc_collapse(const float* __restrict__ m, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ x, float* __restrict__ y, int N, int D, float eps) {
    __shared__ float pre[DS4_HC_MAX];
    const int t = blockIdx.x, tid = threadIdx.x;
    if (tid < N) pre[tid] = ds4_sigmoid(ds4_mul_rn(m[(size_t)t * N + tid], scale[0]) + base[tid]) + eps;
    __syncthreads();
    const float* xt = x + (size_t)t * N * D;
    for (int k = tid; k < D; k += blockDim.x) {
        float v = 0.0f;
        for (int i = 0; i < N; i++) v += ds4_mul_rn(pre[i], xt[(size_t)i * D + k]);
        y[(size_t)t * D + k] = v;
    }
}

// HC post in place: X'[j] = post_j o + sum_i A[i][j] X[i]. One thread per (token, k) column reads
// all N old values before writing any. total = n*D.
DS4_KERNEL void DS4_BOUNDS(256) hc_post(float* __restrict__ x, const float* __restrict__ o, const float* __restrict__ post, const float* __restrict__ comb, int N, int D, long long total) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total) return;
    const long long t = g / D;
    const int k = (int)(g - t * D);
    float* xt = x + (size_t)t * N * D;
    const float* p = post + (size_t)t * N;
    const float* c = comb + (size_t)t * N * N;
    const float ok = o[(size_t)t * D + k];
    float old[DS4_HC_MAX];
    for (int i = 0; i < N; i++) old[i] = xt[(size_t)i * D + k];
    for (int j = 0; j < N; j++) {
        float v = ds4_mul_rn(p[j], ok);
        for (int i = 0; i < N; i++) v += ds4_mul_rn(c[i * N + j], old[i]);
        xt[(size_t)j * D + k] = v;
    }
}

// f32 -> i32 whose signed order is Rust's f32::total_cmp order.
__device__ __forceinline__ int ds4_total_key(float f) {
    int i = __float_as_int(f);
    return i ^ (int)(((u32)(i >> 31)) >> 1);
}

// Router, one token per CTA. logits [n, ne]; p_e = sqrt(softplus(logit_e)). Experts: tid2eid[tok*k ..]
// when given (hash layers), else the top k of p_e + bias_e by total order, ties to the lower id,
// in descending order (each expert's rank = how many experts beat it). sel [n, k] i32, wgt [n, k].
DS4_KERNEL void DS4_BOUNDS(256) moe_route(const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ tid2eid, const int* __restrict__ tokens, int* __restrict__ sel, float* __restrict__ wgt, int ne, int k, float weight_scale) {
    __shared__ float p[DS4_ROUTE_MAX_E];
    __shared__ int key[DS4_ROUTE_MAX_E];
    __shared__ int s_sel[DS4_ROUTE_MAX_K];
    const int t = blockIdx.x, tid = threadIdx.x;
    const float* lg = logits + (size_t)t * ne;
    for (int e = tid; e < ne; e += blockDim.x) {
        float v = lg[e];
        float sp = v > 20.0f ? v : ds4_log1pf_cr(ds4_expf_cr(v));
        p[e] = sqrtf(sp);
        if (!tid2eid) key[e] = ds4_total_key(p[e] + bias[e]);
    }
    __syncthreads();
    if (tid2eid) {
        const int tok = tokens[t];
        for (int j = tid; j < k; j += blockDim.x) s_sel[j] = tid2eid[(size_t)tok * k + j];
    } else {
        for (int e = tid; e < ne; e += blockDim.x) {
            const int ke = key[e];
            int rank = 0;
            for (int f = 0; f < ne; f++) {
                const int kf = key[f];
                rank += (kf > ke) | ((kf == ke) & (f < e));
            }
            if (rank < k) s_sel[rank] = e;
        }
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += p[s_sel[j]];
        const float denom = fmaxf(s, 6.103515625e-05f); // 2^-14
        for (int j = 0; j < k; j++) {
            const int e = s_sel[j];
            sel[(size_t)t * k + j] = e;
            wgt[(size_t)t * k + j] = p[e] / denom * weight_scale;
        }
    }
}
