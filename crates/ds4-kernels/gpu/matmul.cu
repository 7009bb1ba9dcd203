// Weight products beyond one vector: batched matmul (each weight chunk read once per group of up to
// NT token rows), grouped projections, and expert products that read the expert id on the device.
//
// One launch computes, for items t in [0, n) and batch z = blockIdx.z (a group of matmul_grouped):
//   y[t*y_tok + z*y_z + r] = sum_k W_tz[r][k] * x[(t / xdiv)*x_tok + z*x_z + k],   r < rows
//   W_tz = W + z*w_z + (sel ? max(sel[t], 0) * slab : 0)          (bytes; sel: expert of item t)
// Items go to CTAs (blockIdx.y) in groups of NT consecutive ones, or, with `grp`, in runs of one
// expert (see mm_items), so an expert's slab is read once per run of up to NT items.
// A CTA is MM_WARPS warps; `kspl` warps share one row (splitting K inside the CTA, partial sums
// added in a fixed order through shared memory: deterministic, no second pass), so a CTA covers
// MM_WARPS / kspl rows. blockIdx.y is the group of NT consecutive items. With sel, NT = 1.
#include "prelude.cuh"
#include "dequant.cuh"

#define MM_WARPS 8
#define MM_THREADS (MM_WARPS * DS4_WARP)

#define MM_PARAMS                                                                                              \
    const u8 *__restrict__ W, long long w_z, const int *__restrict__ sel, long long slab,                     \
        const float *__restrict__ x, long long x_tok, long long x_z, int xdiv, float *__restrict__ y,          \
        long long y_tok, long long y_z, int rows, int cols, long long row_bytes, int n, int kspl,                \
        const int *__restrict__ grp, int gmax
#define MM_ARGS W, w_z, sel, slab, x, x_tok, x_z, xdiv, y, y_tok, y_z, rows, cols, row_bytes, n, kspl, grp, gmax

// The items of this CTA (blockIdx.y): without grp, NT consecutive ones; with grp (built by
// moe_group_i32: [ngroups, starts[gmax], perm[n]]) group blockIdx.y's run of up to NT items that
// share one expert. it[j] for j >= nt repeats a valid item. False: no such group, leave.
template <int NT>
__device__ __forceinline__ bool mm_items(const int* __restrict__ grp, int gmax, const int* __restrict__ sel, int n,
                                         int* it, int& nt) {
    if (!grp) {
        int t0 = blockIdx.y * NT;
        nt = min(NT, n - t0);
#pragma unroll
        for (int j = 0; j < NT; j++) it[j] = t0 + min(j, nt - 1);
        return true;
    }
    if ((int)blockIdx.y >= grp[0]) return false;
    const int* perm = grp + 1 + gmax;
    int s = grp[1 + blockIdx.y], e = max(sel[perm[s]], 0);
    nt = 0;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        int q = s + j;
        bool ok = nt == j && q < n && max(sel[perm[min(q, n - 1)]], 0) == e;
        if (ok) nt++;
        it[j] = ok ? perm[q] : perm[s];
    }
    return true;
}

template <int T, int NT> __device__ __forceinline__ void mm_body(MM_PARAMS) {
    __shared__ float red[MM_WARPS][NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, z = blockIdx.z;
    int it[NT], nt;
    if (!mm_items<NT>(grp, gmax, sel, n, it, nt)) return;
    bool live = r < rows;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;
    if (live) {
        long long wo = (long long)z * w_z;
        if (sel) wo += (long long)max(sel[it[0]], 0) * slab;
        const u8* row = W + wo + (long long)r * row_bytes;
        const float* xb = x + (long long)z * x_z;
        int chunks = cols / 32;
        for (int c = ks * DS4_WARP + lane; c < chunks; c += kspl * DS4_WARP) {
            float w[32];
            deq_chunk<T>(row, c, w);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                if (j < nt) {
                    const float4* xv = (const float4*)(xb + (long long)(it[j] / xdiv) * x_tok + (long long)c * 32);
                    float a = acc[j];
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 v = xv[i];
                        a += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
                    }
                    acc[j] = a;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = ds4_warp_sum(acc[j]);
    int tl = it[0]; // this lane's item (lane < nt) for the output
#pragma unroll
    for (int j = 1; j < NT; j++)
        if (lane == j) tl = it[j];
    if (kspl == 1) {
        if (live && lane < nt) {
            float v = acc[0];
#pragma unroll
            for (int j = 1; j < NT; j++)
                if (lane == j) v = acc[j];
            y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++) red[warp][j] = acc[j];
    }
    __syncthreads();
    if (live && ks == 0 && lane < nt) {
        float v = 0.0f;
        for (int s = 0; s < kspl; s++) v += red[warp + s][lane];
        y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
    }
}

// Coalesced form: four lanes share a chunk (8 elements each), so a warp reads DS4_WARP/4
// consecutive chunks of weights and x per step (x loads are contiguous across lanes).
template <int T, int NT> __device__ __forceinline__ void mmc_body(MM_PARAMS) {
    __shared__ float red[MM_WARPS][NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, z = blockIdx.z;
    int it[NT], nt;
    if (!mm_items<NT>(grp, gmax, sel, n, it, nt)) return;
    bool live = r < rows;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;
    if (live) {
        long long wo = (long long)z * w_z;
        if (sel) wo += (long long)max(sel[it[0]], 0) * slab;
        const u8* row = W + wo + (long long)r * row_bytes;
        const float* xb = x + (long long)z * x_z;
        int chunks = cols / 32;
        constexpr int CPW = DS4_WARP / 4; // chunks per warp step: 4 lanes per chunk, 8 elements each
        int q = lane & 3;
        for (int c = ks * CPW + lane / 4; c < chunks; c += kspl * CPW) {
            float w[8];
            deq_slice<T>(row, c, q, w);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                if (j < nt) {
                    const float4* xv = (const float4*)(xb + (long long)(it[j] / xdiv) * x_tok + (long long)c * 32 + 8 * q);
                    float4 v0 = xv[0], v1 = xv[1];
                    acc[j] += w[0] * v0.x + w[1] * v0.y + w[2] * v0.z + w[3] * v0.w + w[4] * v1.x + w[5] * v1.y +
                              w[6] * v1.z + w[7] * v1.w;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = ds4_warp_sum(acc[j]);
    int tl = it[0]; // this lane's item (lane < nt) for the output
#pragma unroll
    for (int j = 1; j < NT; j++)
        if (lane == j) tl = it[j];
    if (kspl == 1) {
        if (live && lane < nt) {
            float v = acc[0];
#pragma unroll
            for (int j = 1; j < NT; j++)
                if (lane == j) v = acc[j];
            y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++) red[warp][j] = acc[j];
    }
    __syncthreads();
    if (live && ks == 0 && lane < nt) {
        float v = 0.0f;
        for (int s = 0; s < kspl; s++) v += red[warp + s][lane];
        y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
    }
}

// Routed experts, gate and up fused: for pair p (token p / k, slot p % k) and row r < ff,
//   h[p*ff + r] = silu(min(g, c)) * clamp(u, -c, c) * wgt[p],  g/u = gate/up row r of expert sel[p] · z[p/k].
// Same CTA shape as mm_body with NT = 1; blockIdx.y = p.
#define GU_PARAMS                                                                                              \
    const u8 *__restrict__ Wg, const u8 *__restrict__ Wu, const int *__restrict__ sel, long long slab,         \
        const float *__restrict__ x, int k, const float *__restrict__ wgt, float clamp, float *__restrict__ h,  \
        int rows, int cols, long long row_bytes, int kspl
#define GU_ARGS Wg, Wu, sel, slab, x, k, wgt, clamp, h, rows, cols, row_bytes, kspl

template <int T> __device__ __forceinline__ void gateup_body(GU_PARAMS) {
    __shared__ float red[MM_WARPS][2];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, p = blockIdx.y;
    bool live = r < rows;
    float ag = 0.0f, au = 0.0f;
    if (live) {
        long long wo = (long long)max(sel[p], 0) * slab + (long long)r * row_bytes;
        const u8 *rg = Wg + wo, *ru = Wu + wo;
        const float* xb = x + (long long)(p / k) * cols;
        int chunks = cols / 32;
        for (int c = ks * DS4_WARP + lane; c < chunks; c += kspl * DS4_WARP) {
            float wg[32], wu[32];
            deq_chunk<T>(rg, c, wg);
            deq_chunk<T>(ru, c, wu);
            const float4* xv = (const float4*)(xb + (long long)c * 32);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 v = xv[i];
                ag += wg[4 * i] * v.x + wg[4 * i + 1] * v.y + wg[4 * i + 2] * v.z + wg[4 * i + 3] * v.w;
                au += wu[4 * i] * v.x + wu[4 * i + 1] * v.y + wu[4 * i + 2] * v.z + wu[4 * i + 3] * v.w;
            }
        }
    }
    ag = ds4_warp_sum(ag);
    au = ds4_warp_sum(au);
    if (kspl > 1) {
        if (lane == 0) red[warp][0] = ag, red[warp][1] = au;
        __syncthreads();
        if (ks != 0) return;
        ag = 0.0f, au = 0.0f;
        for (int s = 0; s < kspl; s++) ag += red[warp + s][0], au += red[warp + s][1];
    }
    if (live && lane == 0) {
        float gv = fminf(ag, clamp), uv = fminf(fmaxf(au, -clamp), clamp);
        h[(long long)p * rows + r] = gv * (1.0f / (1.0f + expf(-gv))) * uv * wgt[p];
    }
}

// ---- Tiled form (weights whose row, slab and base offsets are 16-byte multiples): each warp
// copies a tile of its row (TCH chunks, contiguous bytes) into shared memory with coalesced
// 16-byte loads, all issued before any use, then each lane dequantises its chunks from there.
// Same arithmetic as the direct form; only the order of the partial sums differs.

// Coalesced form of gateup_body (see mmc_body).
template <int T> __device__ __forceinline__ void gateupc_body(GU_PARAMS) {
    __shared__ float red[MM_WARPS][2];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, p = blockIdx.y;
    bool live = r < rows;
    float ag = 0.0f, au = 0.0f;
    if (live) {
        long long wo = (long long)max(sel[p], 0) * slab + (long long)r * row_bytes;
        const u8 *rg = Wg + wo, *ru = Wu + wo;
        const float* xb = x + (long long)(p / k) * cols;
        int chunks = cols / 32;
        constexpr int CPW = DS4_WARP / 4; // as mmc_body: 4 lanes per chunk, 8 elements each
        int q = lane & 3;
        for (int c = ks * CPW + lane / 4; c < chunks; c += kspl * CPW) {
            float wg[8], wu[8];
            deq_slice<T>(rg, c, q, wg);
            deq_slice<T>(ru, c, q, wu);
            const float4* xv = (const float4*)(xb + (long long)c * 32 + 8 * q);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float4 v = xv[i];
                ag += wg[4 * i] * v.x + wg[4 * i + 1] * v.y + wg[4 * i + 2] * v.z + wg[4 * i + 3] * v.w;
                au += wu[4 * i] * v.x + wu[4 * i + 1] * v.y + wu[4 * i + 2] * v.z + wu[4 * i + 3] * v.w;
            }
        }
    }
    ag = ds4_warp_sum(ag);
    au = ds4_warp_sum(au);
    if (kspl > 1) {
        if (lane == 0) red[warp][0] = ag, red[warp][1] = au;
        __syncthreads();
        if (ks != 0) return;
        ag = 0.0f, au = 0.0f;
        for (int s = 0; s < kspl; s++) ag += red[warp + s][0], au += red[warp + s][1];
    }
    if (live && lane == 0) {
        float gv = fminf(ag, clamp), uv = fminf(fmaxf(au, -clamp), clamp);
        h[(long long)p * rows + r] = gv * (1.0f / (1.0f + expf(-gv))) * uv * wgt[p];
    }
}

// ---- Tiled form (weights whose row, slab and base offsets are 16-byte multiples): each warp
// copies a tile of its row (TCH chunks, contiguous bytes) into shared memory with coalesced
// 16-byte loads, all issued before any use, then each lane dequantises its chunks from there.
// Same arithmetic as the direct form; only the order of the partial sums differs.

// Bytes of 8 chunks (one K/IQ super-block; 256 elements) and chunks per tile.
template <int T> __device__ constexpr int mm_sb_bytes() {
    return T == T_F32 ? 1024 : (T == T_F16 || T == T_BF16) ? 512 : T == T_Q8_0 ? 272 : T == T_Q2_K ? 84 : T == T_Q4_K ? 144 : 66;
}
template <int T> __device__ constexpr int mm_tile_chunks() { return T == T_F32 ? 16 : (T == T_F16 || T == T_BF16) ? 32 : 64; }

// Copy tile `tt` (bytes tt*TB .. of `row`, clipped to row_bytes) into `dst` (TB/16 uint4).
template <int T>
__device__ __forceinline__ void mm_load_tile(const u8* __restrict__ row, long long row_bytes, int tt, uint4* dst, int lane) {
    constexpr int TB = mm_tile_chunks<T>() / 8 * mm_sb_bytes<T>(), V = TB / 16, PER = (V + DS4_WARP - 1) / DS4_WARP;
    const uint4* src = (const uint4*)(row + (long long)tt * TB);
    int vb = (int)min((long long)V, (row_bytes - (long long)tt * TB) / 16);
    uint4 v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        int i = lane + j * DS4_WARP;
        if (i < vb) v[j] = src[i];
    }
#pragma unroll
    for (int j = 0; j < PER; j++) {
        int i = lane + j * DS4_WARP;
        if (i < vb) dst[i] = v[j];
    }
}

template <int T, int NT> __device__ __forceinline__ void mm_tile_body(MM_PARAMS) {
    constexpr int TCH = mm_tile_chunks<T>(), V = TCH / 8 * mm_sb_bytes<T>() / 16;
    __shared__ uint4 tile[MM_WARPS][V];
    __shared__ float red[MM_WARPS][NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, z = blockIdx.z;
    int it[NT], nt;
    if (!mm_items<NT>(grp, gmax, sel, n, it, nt)) return;
    bool live = r < rows;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.0f;
    if (live) {
        long long wo = (long long)z * w_z;
        if (sel) wo += (long long)max(sel[it[0]], 0) * slab;
        const u8* row = W + wo + (long long)r * row_bytes;
        const float* xb = x + (long long)z * x_z;
        int chunks = cols / 32, ntiles = (chunks + TCH - 1) / TCH;
        for (int tt = ks; tt < ntiles; tt += kspl) {
            mm_load_tile<T>(row, row_bytes, tt, tile[warp], lane);
            ds4_syncwarp();
            int cn = min(TCH, chunks - tt * TCH);
            for (int cc = lane; cc < cn; cc += DS4_WARP) {
                float w[32];
                deq_chunk<T>((const u8*)tile[warp], cc, w);
                int c = tt * TCH + cc;
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    if (j < nt) {
                        const float4* xv = (const float4*)(xb + (long long)(it[j] / xdiv) * x_tok + (long long)c * 32);
                        float a = acc[j];
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            float4 v = xv[i];
                            a += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
                        }
                        acc[j] = a;
                    }
                }
            }
            ds4_syncwarp();
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = ds4_warp_sum(acc[j]);
    int tl = it[0]; // this lane's item (lane < nt) for the output
#pragma unroll
    for (int j = 1; j < NT; j++)
        if (lane == j) tl = it[j];
    if (kspl == 1) {
        if (live && lane < nt) {
            float v = acc[0];
#pragma unroll
            for (int j = 1; j < NT; j++)
                if (lane == j) v = acc[j];
            y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++) red[warp][j] = acc[j];
    }
    __syncthreads();
    if (live && ks == 0 && lane < nt) {
        float v = 0.0f;
        for (int s = 0; s < kspl; s++) v += red[warp + s][lane];
        y[(long long)tl * y_tok + (long long)z * y_z + r] = v;
    }
}

template <int T> __device__ __forceinline__ void gateup_tile_body(GU_PARAMS) {
    constexpr int TCH = mm_tile_chunks<T>(), V = TCH / 8 * mm_sb_bytes<T>() / 16;
    __shared__ uint4 tg[MM_WARPS][V], tu[MM_WARPS][V];
    __shared__ float red[MM_WARPS][2];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int rpc = MM_WARPS / kspl, ks = warp % kspl;
    int r = blockIdx.x * rpc + warp / kspl, p = blockIdx.y;
    bool live = r < rows;
    float ag = 0.0f, au = 0.0f;
    if (live) {
        long long wo = (long long)max(sel[p], 0) * slab + (long long)r * row_bytes;
        const u8 *rg = Wg + wo, *ru = Wu + wo;
        const float* xb = x + (long long)(p / k) * cols;
        int chunks = cols / 32, ntiles = (chunks + TCH - 1) / TCH;
        for (int tt = ks; tt < ntiles; tt += kspl) {
            mm_load_tile<T>(rg, row_bytes, tt, tg[warp], lane);
            mm_load_tile<T>(ru, row_bytes, tt, tu[warp], lane);
            ds4_syncwarp();
            int cn = min(TCH, chunks - tt * TCH);
            for (int cc = lane; cc < cn; cc += DS4_WARP) {
                float wg[32], wu[32];
                deq_chunk<T>((const u8*)tg[warp], cc, wg);
                deq_chunk<T>((const u8*)tu[warp], cc, wu);
                const float4* xv = (const float4*)(xb + (long long)(tt * TCH + cc) * 32);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 v = xv[i];
                    ag += wg[4 * i] * v.x + wg[4 * i + 1] * v.y + wg[4 * i + 2] * v.z + wg[4 * i + 3] * v.w;
                    au += wu[4 * i] * v.x + wu[4 * i + 1] * v.y + wu[4 * i + 2] * v.z + wu[4 * i + 3] * v.w;
                }
            }
            ds4_syncwarp();
        }
    }
    ag = ds4_warp_sum(ag);
    au = ds4_warp_sum(au);
    if (kspl > 1) {
        if (lane == 0) red[warp][0] = ag, red[warp][1] = au;
        __syncthreads();
        if (ks != 0) return;
        ag = 0.0f, au = 0.0f;
        for (int s = 0; s < kspl; s++) ag += red[warp + s][0], au += red[warp + s][1];
    }
    if (live && lane == 0) {
        float gv = fminf(ag, clamp), uv = fminf(fmaxf(au, -clamp), clamp);
        h[(long long)p * rows + r] = gv * (1.0f / (1.0f + expf(-gv))) * uv * wgt[p];
    }
}

DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_f32(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F32, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_f32(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F32, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_f32(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F32, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_f16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_f16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_f16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_F16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_BF16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_BF16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_BF16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q8_0, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q8_0, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q8_0, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q2_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q2_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q2_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q4_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q4_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_Q4_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm1_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_IQ2_XXS, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm4_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_IQ2_XXS, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mm8_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_body<T_IQ2_XXS, 8>(MM_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_f32(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_F32>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_f16(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_F16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_bf16(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_BF16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_q8_0(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_Q8_0>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_q2_k(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_Q2_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_q4_k(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_Q4_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateup_iq2_xxs(GU_PARAMS) { ds4_pdl_enter(); gateup_body<T_IQ2_XXS>(GU_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_f32(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F32, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_f32(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F32, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_f32(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F32, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_f16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_f16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_f16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_F16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_BF16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_BF16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_bf16(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_BF16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q8_0, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q8_0, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_q8_0(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q8_0, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q2_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q2_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_q2_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q2_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q4_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q4_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_q4_k(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_Q4_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt1_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_IQ2_XXS, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt4_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_IQ2_XXS, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmt8_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mm_tile_body<T_IQ2_XXS, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_f32(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_F32>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_f16(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_F16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_bf16(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_BF16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_q8_0(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_Q8_0>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_q2_k(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_Q2_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_q4_k(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_Q4_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupt_iq2_xxs(GU_PARAMS) { ds4_pdl_enter(); gateup_tile_body<T_IQ2_XXS>(GU_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_f32(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F32, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_f32(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F32, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_f32(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F32, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_f16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_f16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_f16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_F16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_bf16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_BF16, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_bf16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_BF16, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_bf16(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_BF16, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_q8_0(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q8_0, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_q8_0(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q8_0, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_q8_0(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q8_0, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_q2_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q2_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_q2_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q2_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_q2_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q2_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_q4_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q4_K, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_q4_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q4_K, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_q4_k(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_Q4_K, 8>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc1_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_IQ2_XXS, 1>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc4_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_IQ2_XXS, 4>(MM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) mmc8_iq2_xxs(MM_PARAMS) { ds4_pdl_enter(); mmc_body<T_IQ2_XXS, 8>(MM_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_f32(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_F32>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_f16(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_F16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_bf16(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_BF16>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_q8_0(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_Q8_0>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_q2_k(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_Q2_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_q4_k(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_Q4_K>(GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MM_THREADS) gateupc_iq2_xxs(GU_PARAMS) { ds4_pdl_enter(); gateupc_body<T_IQ2_XXS>(GU_ARGS); }

// Separate-type fallback of gateup: h[p*ff + r] = silu(min(g, c)) * clamp(u, -c, c) * wgt[p].
DS4_KERNEL void DS4_BOUNDS(256) moe_swiglu_f32(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h, const float* __restrict__ wgt, float clamp, int ff, long long total) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    h[i] = ds4_moe_swiglu(g[i], u[i], clamp, wgt[i / ff]);
}

// out[i*d + j] = sum over slots s = 0..k-1 (in order) of part[(i*k + s)*d + j], skipping slots of
// route weight exactly 0 where wgt is given (they add nothing, and the grouped products drop them:
// gemm.cu gm_bucket, their part rows are never written).
DS4_KERNEL void DS4_BOUNDS(256) moe_sum_f32(const float* __restrict__ part, const float* __restrict__ wgt, float* __restrict__ out,
                                            int k, int d, long long total) {
    ds4_pdl_enter();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    long long i = idx / d, j = idx % d;
    float s = 0.0f;
    for (int q = 0; q < k; q++)
        if (!wgt || wgt[i * k + q] != 0.0f) s += part[(i * k + q) * d + j];
    out[idx] = s;
}

// moe_sum_f32 four columns a thread (host: d % 4 == 0, part and out 16-byte aligned): the same
// sums in the same order (same bits), 16-byte loads and stores, a batch of up to 8 slots' loads in
// flight before the adds. H200, 2k prompt: 60 us a layer (3.3 TB/s) against the scalar form's 89.
DS4_KERNEL void DS4_BOUNDS(256) moe_sum4_f32(const float* __restrict__ part, const float* __restrict__ wgt, float* __restrict__ out,
                                             int k, int d, long long total4) {
    ds4_pdl_enter();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total4) return;
    const int d4 = d >> 2;
    const long long i = idx / d4;
    const float4* p = (const float4*)part + i * k * d4 + (idx - i * d4);
    const float* w = wgt ? wgt + i * k : nullptr;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int q0 = 0; q0 < k; q0 += 8) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int q = q0 + u;
            const bool on = q < k && (!w || w[q] != 0.0f);
            v[u] = on ? p[(long long)q * d4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int q = q0 + u;
            if (q < k && (!w || w[q] != 0.0f)) s.x += v[u].x, s.y += v[u].y, s.z += v[u].z, s.w += v[u].w;
        }
    }
    ((float4*)out)[idx] = s;
}

// Groups (token, slot) pairs by expert for the mm kernels' `grp` (one CTA; O(pairs^2 / threads),
// meant for prefill-sized pairs): perm = pairs stably sorted by expert max(sel, 0); runs of one
// expert cut every nt items; grp = [ngroups, starts[gmax], perm[pairs]]; flag: pairs ints scratch.
DS4_KERNEL void DS4_BOUNDS(256) moe_group_i32(const int* __restrict__ sel, int pairs, int nt, int gmax, int* __restrict__ grp, int* __restrict__ flag) {
    ds4_pdl_enter();
    int* starts = grp + 1;
    int* perm = grp + 1 + gmax;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int e = max(sel[p], 0), pos = 0;
        for (int q = 0; q < pairs; q++) {
            int eq = max(sel[q], 0);
            pos += eq < e || (eq == e && q < p);
        }
        perm[pos] = p;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        int e = max(sel[perm[i]], 0), lo = 0; // lo: first sorted position of expert e
        for (int q = 0; q < pairs; q++) lo += max(sel[q], 0) < e;
        flag[i] = (i - lo) % nt == 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        if (!flag[i]) continue;
        int g = 0;
        for (int q = 0; q < i; q++) g += flag[q];
        starts[g] = i;
    }
    if (threadIdx.x == 0) {
        int g = 0;
        for (int q = 0; q < pairs; q++) g += flag[q];
        grp[0] = g;
    }
}
