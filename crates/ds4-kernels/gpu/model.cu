// Model glue ops: embedding, hyper-connections (split/collapse/post), router. The CPU reference is
// ds4-cpu backend.rs; every f32 operation here is done in the CPU's order with the same roundings
// (no fma contraction: products go through ds4_mul_rn), so results match bit for bit except where
// libm's exp/log1p and the device's differ by an ulp (exp/log1p are taken in f64 and rounded once).
#include "prelude.cuh"
// hc.cuh: ds4_expf_cr, ds4_log1pf_cr, ds4_sigmoid, hc_sinkhorn_thread (shared with fused.cu)
#include "hc.cuh"
// route.cuh: ds4_total_key, ds4_shfl_from, ds4_route_token (shared with matvec.cu), DS4_ROUTE_MAX_*
#include "route.cuh"

#define DS4_HC_MAX 16        // most hyper-connection streams N supported

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
    ds4_pdl_enter();
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
    ds4_pdl_enter();
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
    ds4_pdl_enter();
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
    ds4_pdl_enter();
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

// Router, one token per CTA. logits [n, ne]; p_e = sqrt(softplus(logit_e)). Experts: tid2eid[tok*k ..]
// when given (hash layers), else the top k of p_e + bias_e by total order, ties to the lower id,
// in descending order (each expert's rank = how many experts beat it). sel [n, k] i32, wgt [n, k].
DS4_KERNEL void DS4_BOUNDS(256) moe_route(const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ tid2eid, const int* __restrict__ tokens, int* __restrict__ sel, float* __restrict__ wgt, int ne, int k, float weight_scale) {
    ds4_pdl_enter();
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

// ---- Latency forms for decode (the kernels above stay as the DS4_GPU_MIX=simple fallback). ----

// Columns part of hc_split_fast: z[k4] (float4) = sum_i pre_i X[i][k4] for one token, NM >= N.
// Every lane of the warp must enter (pre is computed on lanes < N and broadcast by shuffles).
template <int NM>
__device__ __forceinline__ void hc_split_cols(const float* __restrict__ mt, const float* __restrict__ scale, const float* __restrict__ base, const float4* __restrict__ xt, float4* __restrict__ zt, int N, int D4, int k4, float eps) {
    const int lane = threadIdx.x % DS4_WARP;
    const bool live = k4 < D4;
    float4 xv[NM];
#pragma unroll
    for (int i = 0; i < NM; i++) // loads first: in flight while pre is computed
        if (i < N) xv[i] = live ? xt[(size_t)i * D4 + k4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float mine = lane < N ? ds4_sigmoid(ds4_mul_rn(mt[lane], scale[0]) + base[lane]) + eps : 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < NM; i++) {
        if (i < N) { // serial in i from 0 like the CPU; products rounded before the add
            const float p = ds4_shfl_from(mine, i);
            acc.x = acc.x + ds4_mul_rn(p, xv[i].x);
            acc.y = acc.y + ds4_mul_rn(p, xv[i].y);
            acc.z = acc.z + ds4_mul_rn(p, xv[i].z);
            acc.w = acc.w + ds4_mul_rn(p, xv[i].w);
        }
    }
    if (live) zt[k4] = acc;
}

// Column normalisation of the N x N matrix held as rows a[] on lanes r < N (other lanes hold
// junk but join the shuffles): a[r][c] /= (serial sum over r of a[r][c]) + eps.
template <int NM>
__device__ __forceinline__ void hc_norm_cols(float (&a)[NM], int N, float eps) {
#pragma unroll
    for (int c = 0; c < NM; c++) {
        if (c < N) {
            float s = 0.0f;
#pragma unroll
            for (int r = 0; r < NM; r++)
                if (r < N) s += ds4_shfl_from(a[c], r);
            a[c] = a[c] / (s + eps);
        }
    }
}

// Sinkhorn part of hc_split_fast on one warp (no block barriers): lane r < N holds row r in
// registers. Writes post [N] and comb [N*N] of one token. Every lane of the warp must enter.
template <int NM>
__device__ __forceinline__ void hc_sinkhorn_warp(const float* __restrict__ mt, const float* __restrict__ scale, const float* __restrict__ base, float* __restrict__ post_t, float* __restrict__ comb_t, int N, int iters, float eps) {
    const int lane = threadIdx.x % DS4_WARP;
    const bool row = lane < N;
    if (row) post_t[lane] = 2.0f * ds4_sigmoid(ds4_mul_rn(mt[N + lane], scale[1]) + base[N + lane]);
    float a[NM];
    float mx = DS4_NEG_INF;
#pragma unroll
    for (int b = 0; b < NM; b++) {
        if (b < N) { // logits of row `lane`
            const int q = 2 * N + lane * N + b;
            a[b] = row ? ds4_mul_rn(mt[q], scale[2]) + base[q] : 0.0f;
            mx = fmaxf(mx, a[b]);
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int b = 0; b < NM; b++)
        if (b < N) {
            a[b] = ds4_expf_cr(a[b] - mx);
            s += a[b];
        }
#pragma unroll
    for (int b = 0; b < NM; b++)
        if (b < N) a[b] = a[b] / s + eps;
    hc_norm_cols<NM>(a, N, eps);
    for (int it = 1; it < iters; it++) {
        float rs = 0.0f; // row normalise: local to the lane
#pragma unroll
        for (int b = 0; b < NM; b++)
            if (b < N) rs += a[b];
        rs += eps;
#pragma unroll
        for (int b = 0; b < NM; b++)
            if (b < N) a[b] /= rs;
        hc_norm_cols<NM>(a, N, eps);
    }
    if (row) {
#pragma unroll
        for (int b = 0; b < NM; b++)
            if (b < N) comb_t[lane * N + b] = a[b];
    }
}

// HC pre, latency form; same outputs as hc_split. Host guarantees D % 4 == 0 and 16-byte aligned
// x, z. Grid: first ns = ceil(n / warps per CTA) Sinkhorn CTAs with one warp per token (first, so
// that in long grids they start early), then n*cc column CTAs (token t = c / cc, float4 columns
// ((c % cc)*blockDim + tid) with c = b - ns); the two kinds run concurrently.
DS4_KERNEL void DS4_BOUNDS(256) hc_split_fast(const float* __restrict__ m, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ x, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, int N, int D, int iters, float eps, int n, int cc) {
    ds4_pdl_enter();
    const int wpb = blockDim.x / DS4_WARP, ns = (n + wpb - 1) / wpb;
    const int b = blockIdx.x, mix = (2 + N) * N, D4 = D >> 2;
    if (b >= ns) {
        const int c = b - ns, t = c / cc, k4 = (c - t * cc) * blockDim.x + threadIdx.x;
        const float* mt = m + (size_t)t * mix;
        const float4* xt = (const float4*)(x + (size_t)t * N * D);
        float4* zt = (float4*)(z + (size_t)t * D);
        if (N <= 4) hc_split_cols<4>(mt, scale, base, xt, zt, N, D4, k4, eps);
        else hc_split_cols<DS4_HC_MAX>(mt, scale, base, xt, zt, N, D4, k4, eps);
    } else {
        const int t = b * wpb + threadIdx.x / DS4_WARP;
        if (t >= n) return; // whole warps
        const float* mt = m + (size_t)t * mix;
        float* pt = post + (size_t)t * N;
        float* ct = comb + (size_t)t * N * N;
        if (N <= 4) hc_sinkhorn_warp<4>(mt, scale, base, pt, ct, N, iters, eps);
        else hc_sinkhorn_warp<DS4_HC_MAX>(mt, scale, base, pt, ct, N, iters, eps);
    }
}

// Head collapse, latency form; same output as hc_collapse (m [n, N]). Host guarantees D % 4 == 0
// and 16-byte aligned x, y. Grid: n*cc CTAs, token t = b / cc, float4 columns as hc_split_fast.
DS4_KERNEL void DS4_BOUNDS(256) hc_collapse_fast(const float* __restrict__ m, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ x, float* __restrict__ y, int N, int D, float eps, int cc) {
    ds4_pdl_enter();
    const int b = blockIdx.x, t = b / cc, k4 = (b - t * cc) * blockDim.x + threadIdx.x, D4 = D >> 2;
    const float* mt = m + (size_t)t * N;
    const float4* xt = (const float4*)(x + (size_t)t * N * D);
    float4* yt = (float4*)(y + (size_t)t * D);
    if (N <= 4) hc_split_cols<4>(mt, scale, base, xt, yt, N, D4, k4, eps);
    else hc_split_cols<DS4_HC_MAX>(mt, scale, base, xt, yt, N, D4, k4, eps);
}

// HC post in place, latency form for N <= 4 (host checks, with D % 4 == 0 and 16-byte aligned
// x, o): one thread per (token, float4 column), every load issued before any store. total4 = n*D/4.
DS4_KERNEL void DS4_BOUNDS(256) hc_post_fast(float* __restrict__ x, const float* __restrict__ o, const float* __restrict__ post, const float* __restrict__ comb, int N, int D, long long total4) {
    ds4_pdl_enter();
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total4) return;
    const int D4 = D >> 2;
    const long long t = g / D4;
    const int k4 = (int)(g - t * D4);
    float4* xt = (float4*)(x + (size_t)t * N * D);
    const float* pt = post + (size_t)t * N;
    const float* ctk = comb + (size_t)t * N * N;
    const float4 ok = ((const float4*)(o + (size_t)t * D))[k4];
    float4 old[4];
    float p[4], c[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (i < N) {
            old[i] = xt[(size_t)i * D4 + k4];
            p[i] = pt[i];
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j < N) c[i][j] = ctk[i * N + j];
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (j < N) { // X'[j] = post_j o + sum_i A[i][j] X[i], serial in i like the CPU
            float4 v = make_float4(ds4_mul_rn(p[j], ok.x), ds4_mul_rn(p[j], ok.y), ds4_mul_rn(p[j], ok.z), ds4_mul_rn(p[j], ok.w));
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (i < N) {
                    v.x = v.x + ds4_mul_rn(c[i][j], old[i].x);
                    v.y = v.y + ds4_mul_rn(c[i][j], old[i].y);
                    v.z = v.z + ds4_mul_rn(c[i][j], old[i].z);
                    v.w = v.w + ds4_mul_rn(c[i][j], old[i].w);
                }
            }
            xt[(size_t)j * D4 + k4] = v;
        }
    }
}

// Router, latency form; same outputs as moe_route. One CTA per token: ds4_route_token (route.cuh;
// top k by warp 0). k <= DS4_ROUTE_MAX_K <= DS4_WARP.
DS4_KERNEL void DS4_BOUNDS(256) moe_route_fast(const float* __restrict__ logits, const float* __restrict__ bias, const int* __restrict__ tid2eid, const int* __restrict__ tokens, int* __restrict__ sel, float* __restrict__ wgt, int ne, int k, float weight_scale) {
    ds4_pdl_enter();
    const int t = blockIdx.x;
    ds4_route_token<false>(logits + (size_t)t * ne, bias, tid2eid, tokens + t, sel + (size_t)t * k, wgt + (size_t)t * k, ne, k, weight_scale);
}

// ---- Glue forms (default; DS4_GPU_MIX=fast keeps the latency forms above): N <= 4 Sinkhorn in
// one thread's registers per token, no shuffles, no barriers. ----

// (hc_sinkhorn_thread<NN>, the Sinkhorn of one token on one thread, is in hc.cuh.)

// HC pre, glue form for N <= 4 (host checks, with D % 4 == 0 and 16-byte aligned x, z); same
// outputs as hc_split. Grid: ns = ceil(n / blockDim) Sinkhorn CTAs (one thread per token), then
// n*cc column CTAs as hc_split_fast (cc = ceil(D/4 / blockDim)); the two kinds run concurrently.
DS4_KERNEL void DS4_BOUNDS(256) hc_split_glue(const float* __restrict__ m, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ x, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, int N, int D, int iters, float eps, int n, int cc) {
    ds4_pdl_enter();
    const int ns = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    const int b = blockIdx.x, mix = (2 + N) * N;
    if (b >= ns) {
        const int c = b - ns, t = c / cc, k4 = (c - t * cc) * blockDim.x + threadIdx.x;
        const float4* xt = (const float4*)(x + (size_t)t * N * D);
        float4* zt = (float4*)(z + (size_t)t * D);
        hc_split_cols<4>(m + (size_t)t * mix, scale, base, xt, zt, N, D >> 2, k4, eps);
        return;
    }
    const int t = b * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* mt = m + (size_t)t * mix;
    float* pt = post + (size_t)t * N;
    float* ct = comb + (size_t)t * N * N;
    switch (N) {
    case 1: hc_sinkhorn_thread<1>(mt, scale, base, pt, ct, iters, eps); break;
    case 2: hc_sinkhorn_thread<2>(mt, scale, base, pt, ct, iters, eps); break;
    case 3: hc_sinkhorn_thread<3>(mt, scale, base, pt, ct, iters, eps); break;
    default: hc_sinkhorn_thread<4>(mt, scale, base, pt, ct, iters, eps); break;
    }
}
