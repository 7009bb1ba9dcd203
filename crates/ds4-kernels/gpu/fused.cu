// Fused decode glue: HC pre + the sublayer norm in one launch (split-K mixer products with a
// last-CTA epilogue), and RMSNorm + RoPE (+ FP8/f16 rounding) of attention rows in one launch.
// References: ds4-cpu backend.rs (rms_norm, hc_split, rope, round_rows) and math.rs. The order of
// the f32 operations follows the CPU where it is cheap to; the mixer dot products are summed in
// another order (and scaled after the sum), so results are close, not bit-equal.
#include "prelude.cuh"
// hc.cuh: ds4_sigmoid and the Sinkhorn (hc_sinkhorn_by_warp), shared with model.cu
#include "hc.cuh"

#define FU_PART 32 // doubles per (token, split) partial: the (2+N)·N dots, then the sum of squares

// Four mixer weights at float4 column c4 of a row (ty: 0 f32, 1 f16, 2 bf16).
__device__ __forceinline__ float4 fu_w4(const u8* __restrict__ row, int c4, int ty) {
    if (ty == 0) return ((const float4*)row)[c4];
    const uint2 u = ((const uint2*)row)[c4];
    if (ty == 1)
        return make_float4(ds4_h2f_fast(u.x & 0xffffu), ds4_h2f_fast(u.x >> 16), ds4_h2f_fast(u.y & 0xffffu),
                           ds4_h2f_fast(u.y >> 16));
    return make_float4(ds4_bf2f((u16)(u.x & 0xffffu)), ds4_bf2f((u16)(u.x >> 16)), ds4_bf2f((u16)(u.y & 0xffffu)),
                       ds4_bf2f((u16)(u.y >> 16)));
}

// Sum of a double over the CTA (any blockDim multiple of DS4_WARP, <= 1024); every thread gets
// it. red: DS4-sized shared scratch of 32 doubles. Starts and ends with a barrier.
__device__ __forceinline__ double fu_block_sum(double v, double* red) {
    const int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP, nw = blockDim.x / DS4_WARP;
    v = ds4_warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < nw; i++) t += red[i]; // fixed order: the same value everywhere
    return t;
}

// float4 load that sees other CTAs' stores of this launch (after their fence and our ticket):
// CUDA ld.global.cg (L2, not the SM's L1); HIP volatile loads.
__device__ __forceinline__ float4 fu_ld_cg(const float4* p) {
#if defined(DS4_CUDA)
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
#else
    const volatile float* q = (const volatile float*)p;
    return make_float4(q[0], q[1], q[2], q[3]);
#endif
}

// One float4 column of the collapse z = Σ_i pre_i X[i] (the CPU's order, uncontracted) from the
// N streams' values v; its squares added to zz (f64).
template <int NN>
__device__ __forceinline__ float4 fu_collapse(const float* pre, const float4 (&v)[NN], double& zz) {
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < NN; i++) {
        const float p = pre[i];
        o.x += ds4_mul_rn(p, v[i].x), o.y += ds4_mul_rn(p, v[i].y);
        o.z += ds4_mul_rn(p, v[i].z), o.w += ds4_mul_rn(p, v[i].w);
    }
    zz += (double)o.x * (double)o.x + (double)o.y * (double)o.y + (double)o.z * (double)o.z + (double)o.w * (double)o.w;
    return o;
}

// The CTA's MIX dot products and Σx² (this split's columns) to part[t, s], then the token's
// arrival ticket. True in the token's last CTA, which then holds the sums over all splits in
// dsum[0 .. MIX] (dot products) and dsum[MIX] (Σx²), and has reset the ticket.
template <int MIX>
__device__ __forceinline__ bool fu_arrive(const float* acc, double ss, double* part, u32* tickets, int t, int s, int S,
                                          double* dsum) {
    __shared__ double wred[32][MIX + 1];
    __shared__ int last_s;
    const int tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP, nw = blockDim.x / DS4_WARP;
#pragma unroll
    for (int r = 0; r < MIX; r++) {
        const float v = ds4_warp_sum(acc[r]);
        if (lane == 0) wred[warp][r] = (double)v;
    }
    ss = ds4_warp_sum_f64(ss);
    if (lane == 0) wred[warp][MIX] = ss;
    __syncthreads();
    if (tid <= MIX) {
        double v = 0.0;
        for (int w = 0; w < nw; w++) v += wred[w][tid];
        part[((size_t)t * S + s) * FU_PART + tid] = v;
        __threadfence(); // the partial is visible device-wide before the ticket
    }
    __syncthreads();
    if (tid == 0) last_s = atomicAdd(&tickets[t], 1u) == (u32)(S - 1);
    __syncthreads();
    if (!last_s) return false;
    __threadfence();
    if (tid <= MIX) { // the splits' partials in split order
        const volatile double* pv = part + (size_t)t * S * FU_PART;
        double v = 0.0;
        for (int j = 0; j < S; j++) v += pv[(size_t)j * FU_PART + tid];
        dsum[tid] = v;
    }
    __syncthreads();
    if (tid == 0) tickets[t] = 0u; // ready for the next launch (graph replays too)
    return true;
}

// The finish's first steps, CTA-wide: m = the dots · the N·D row's RMS scale into m_s (MIX
// values), then pre = sigmoid(m·scale + base) + hc_eps into pre_s (N).
template <int NN>
__device__ __forceinline__ void fu_m_pre(const double* dsum, const float* __restrict__ scale, const float* __restrict__ base,
                                         int D, float hc_eps, float eps, float* m_s, float* pre_s) {
    constexpr int MIX = (2 + NN) * NN;
    const int tid = threadIdx.x;
    if (tid < MIX) {
        const float sc = (float)(1.0 / sqrt(dsum[MIX] / (double)(NN * D) + (double)eps));
        m_s[tid] = (float)dsum[tid] * sc;
    }
    __syncthreads();
    if (tid < NN) pre_s[tid] = ds4_sigmoid(ds4_mul_rn(m_s[tid], scale[0]) + base[tid]) + hc_eps;
    __syncthreads();
}

// Epilogue of the token's last CTA: m = dots · rms scale of the N·D row, pre; then warp 0
// runs split + Sinkhorn (post, comb) while the other warps collapse z = Σ pre_i X[i] (CPU
// order, uncontracted); then rms_norm(z, norm) over D by all. CG: X was written by other CTAs
// of this launch (read through L2). blockDim >= 2 warps.
template <int NN, bool CG>
__device__ __forceinline__ void fu_finish(const double* dsum, const float4* xt, const float* __restrict__ scale,
                                          const float* __restrict__ base, const float* __restrict__ norm,
                                          float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, int t,
                                          int D, int iters, float hc_eps, float eps) {
    constexpr int MIX = (2 + NN) * NN;
    __shared__ double red[32];
    __shared__ float m_s[MIX], pre_s[NN];
    const int tid = threadIdx.x;
    fu_m_pre<NN>(dsum, scale, base, D, hc_eps, eps, m_s, pre_s);
    const int D4 = D / 4;
    float4* zt = (float4*)(z + (size_t)t * D);
    double zz = 0.0;
    if (tid < DS4_WARP) {
        hc_sinkhorn_by_warp<NN>(m_s, scale, base, post + (size_t)t * NN, comb + (size_t)t * NN * NN, iters, hc_eps);
    } else {
        const int step = blockDim.x - DS4_WARP;
        for (int c0 = tid - DS4_WARP; c0 < D4; c0 += 2 * step) { // two columns in flight
            const int c1 = c0 + step;
            float4 v[2][NN];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = u ? c1 : c0;
                if (c < D4) {
#pragma unroll
                    for (int i = 0; i < NN; i++) v[u][i] = CG ? fu_ld_cg(xt + i * D4 + c) : xt[i * D4 + c];
                }
            }
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = u ? c1 : c0;
                if (c >= D4) break;
                zt[c] = fu_collapse<NN>(pre_s, v[u], zz);
            }
        }
    }
    zz = fu_block_sum(zz, red); // also orders the z stores before the reads below
    const float zs = (float)(1.0 / sqrt(zz / (double)D + (double)eps));
    const float4* nr = (const float4*)norm;
    for (int c4 = tid; c4 < D4; c4 += blockDim.x) {
        const float4 o = zt[c4], g = nr[c4];
        zt[c4] = make_float4(o.x * zs * g.x, o.y * zs * g.y, o.z * zs * g.z, o.w * zs * g.w);
    }
}

// hcp_finish's form of fu_finish<NN, false>: where each collapse thread holds at most 2 KEEP float4
// columns of z (D 4096 at 256 threads: KEEP 3), they stay in registers until the rms scale is
// known and z is written once, normalised, instead of written, read back and written again. The
// same operations in the same order (the same bits); other shapes take fu_finish. Run first in
// session 57 with gwg_x1_f32 (prefill +0.3% / +0.2% at 2k / 8k on an H100: gpu-s57-h100.txt).
template <int NN, int KEEP>
__device__ __forceinline__ void fu_finish_keep(const double* dsum, const float4* xt, const float* __restrict__ scale,
                                               const float* __restrict__ base, const float* __restrict__ norm,
                                               float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb,
                                               int t, int D, int iters, float hc_eps, float eps) {
    constexpr int MIX = (2 + NN) * NN;
    const int tid = threadIdx.x, D4 = D / 4, step = blockDim.x - DS4_WARP;
    if (D4 > 2 * KEEP * step) { // CTA-uniform
        fu_finish<NN, false>(dsum, xt, scale, base, norm, z, post, comb, t, D, iters, hc_eps, eps);
        return;
    }
    __shared__ double red[32];
    __shared__ float m_s[MIX], pre_s[NN];
    fu_m_pre<NN>(dsum, scale, base, D, hc_eps, eps, m_s, pre_s);
    float4* zt = (float4*)(z + (size_t)t * D);
    double zz = 0.0;
    float4 ko[2 * KEEP]; // column tid - DS4_WARP + step k of z, unnormalised
    if (tid < DS4_WARP) {
        hc_sinkhorn_by_warp<NN>(m_s, scale, base, post + (size_t)t * NN, comb + (size_t)t * NN * NN, iters, hc_eps);
    } else {
#pragma unroll
        for (int it = 0; it < KEEP; it++) { // fu_finish's passes: columns c0, c0 + step in flight
            const int c0 = tid - DS4_WARP + 2 * step * it;
            float4 v[2][NN];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = c0 + u * step;
                if (c < D4) {
#pragma unroll
                    for (int i = 0; i < NN; i++) v[u][i] = xt[i * D4 + c];
                }
            }
#pragma unroll
            for (int u = 0; u < 2; u++) {
                ko[2 * it + u] = c0 + u * step < D4 ? fu_collapse<NN>(pre_s, v[u], zz) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    }
    zz = fu_block_sum(zz, red);
    const float zs = (float)(1.0 / sqrt(zz / (double)D + (double)eps));
    const float4* nr = (const float4*)norm;
    if (tid >= DS4_WARP) {
#pragma unroll
        for (int k = 0; k < 2 * KEEP; k++) {
            const int c = tid - DS4_WARP + step * k;
            if (c < D4) {
                const float4 o = ko[k], g = nr[c];
                zt[c] = make_float4(o.x * zs * g.x, o.y * zs * g.y, o.z * zs * g.z, o.w * zs * g.w);
            }
        }
    }
}

// One (token t, split s) CTA of hc_pre_norm_f32 (NN streams, MIX = (2+NN)·NN mixer rows).
template <int NN>
__device__ __forceinline__ void fu_hc_pre(const float* __restrict__ x, const u8* __restrict__ mixer, long long row_bytes, int wty,
                                          const float* __restrict__ scale, const float* __restrict__ base,
                                          const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post,
                                          float* __restrict__ comb, double* part, u32* tickets, int D, int S, int iters,
                                          float hc_eps, float eps) {
    constexpr int MIX = (2 + NN) * NN;
    __shared__ double dsum[MIX + 1];
    const int t = blockIdx.x / S, s = blockIdx.x % S;
    const int W4 = NN * D / 4, per = (W4 + S - 1) / S;
    const int lo = s * per, hi = min(W4, lo + per);
    const float4* xt = (const float4*)(x + (size_t)t * NN * D);
    // This split's columns of the N·D row: the MIX dot products with the raw streams, Σx² (f64).
    float acc[MIX];
#pragma unroll
    for (int r = 0; r < MIX; r++) acc[r] = 0.0f;
    double ss = 0.0;
    for (int c4 = lo + (int)threadIdx.x; c4 < hi; c4 += blockDim.x) {
        const float4 v = xt[c4];
        ss += (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z + (double)v.w * (double)v.w;
#pragma unroll
        for (int r = 0; r < MIX; r++) {
            const float4 w = fu_w4(mixer + (size_t)r * row_bytes, c4, wty);
            acc[r] += w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w;
        }
    }
    if (!fu_arrive<MIX>(acc, ss, part, tickets, t, s, S, dsum)) return;
    fu_finish<NN, false>(dsum, xt, scale, base, norm, z, post, comb, t, D, iters, hc_eps, eps);
}

// HC pre + norm for n tokens (decode): grid n·S CTAs (token-major), split s takes float4
// columns [s·per, (s+1)·per) of the N·D row, per = ceil(N·D/4 / S). The host guarantees
// 1 <= N <= 4, D % 4 == 0, 16-byte aligned x, z, norm; mixer rows (2+N)·N of row_bytes
// (8-byte aligned for f16/bf16, 16 for f32); part holds n·S·FU_PART doubles; tickets[t] is 0 on
// entry and is left 0. blockDim a multiple of DS4_WARP, <= 1024.
DS4_KERNEL void DS4_BOUNDS(1024) hc_pre_norm_f32(const float* __restrict__ x, const u8* __restrict__ mixer, long long row_bytes, int wty, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, double* part, u32* tickets, int N, int D, int S, int iters, float hc_eps, float eps) {
    ds4_pdl_enter();
    switch (N) {
    case 1: fu_hc_pre<1>(x, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    case 2: fu_hc_pre<2>(x, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    case 3: fu_hc_pre<3>(x, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    default: fu_hc_pre<4>(x, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    }
}

// One (token t, split s) CTA of hc_post_pre_norm_f32: HC post of this split's columns in
// place (X'[j] = post_j·o + Σ_i A[i][j]·X[i], the CPU's order), then as fu_hc_pre on X'.
// Thread (j, c) = (tid / cpc, tid % cpc), cpc = blockDim / NN, takes stream j of float4 column
// s·cpc + c (the host sets S = ceil(D/4 / cpc): one column each).
template <int NN>
__device__ __forceinline__ void fu_hc_post_pre(float* x, const float* __restrict__ o, const float* __restrict__ post_in,
                                               const float* __restrict__ comb_in, const u8* __restrict__ mixer,
                                               long long row_bytes, int wty, const float* __restrict__ scale,
                                               const float* __restrict__ base, const float* __restrict__ norm,
                                               float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb,
                                               double* part, u32* tickets, int D, int S, int iters, float hc_eps, float eps) {
    constexpr int MIX = (2 + NN) * NN;
    __shared__ double dsum[MIX + 1];
    const int t = blockIdx.x / S, s = blockIdx.x % S, tid = threadIdx.x;
    const int cpc = blockDim.x / NN, j = tid / cpc, D4 = D / 4, c4 = s * cpc + tid % cpc;
    float4* xt = (float4*)(x + (size_t)t * NN * D);
    const float4* ot = (const float4*)(o + (size_t)t * D);
    float acc[MIX];
#pragma unroll
    for (int r = 0; r < MIX; r++) acc[r] = 0.0f;
    double ss = 0.0;
    const bool mine = j < NN && c4 < D4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (mine) {
        const float pj = post_in[(size_t)t * NN + j];
        float4 old[NN];
#pragma unroll
        for (int i = 0; i < NN; i++) old[i] = xt[i * D4 + c4];
        const float4 ov = ot[c4];
        v = make_float4(ds4_mul_rn(pj, ov.x), ds4_mul_rn(pj, ov.y), ds4_mul_rn(pj, ov.z), ds4_mul_rn(pj, ov.w));
#pragma unroll
        for (int i = 0; i < NN; i++) {
            const float a = comb_in[(size_t)t * NN * NN + i * NN + j]; // A[i][j]: column j of the comb
            v.x += ds4_mul_rn(a, old[i].x), v.y += ds4_mul_rn(a, old[i].y);
            v.z += ds4_mul_rn(a, old[i].z), v.w += ds4_mul_rn(a, old[i].w);
        }
        ss = (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z + (double)v.w * (double)v.w;
#pragma unroll
        for (int r = 0; r < MIX; r++) {
            const float4 w = fu_w4(mixer + (size_t)r * row_bytes, j * D4 + c4, wty);
            acc[r] = w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w;
        }
    }
    __syncthreads(); // every old value of this split is read before any is overwritten
    if (mine) {
        xt[j * D4 + c4] = v;
        __threadfence(); // X' visible device-wide before this CTA's ticket
    }
    if (!fu_arrive<MIX>(acc, ss, part, tickets, t, s, S, dsum)) return;
    fu_finish<NN, true>(dsum, xt, scale, base, norm, z, post, comb, t, D, iters, hc_eps, eps);
}

// HC post of a sublayer's output o ([n, D], with its post [n, N] and comb [n, N·N]) into x in
// place, then HC pre + norm of the next sublayer on the new x (outputs z, post, comb as
// hc_pre_norm_f32). Grid n·S CTAs, S = ceil(D/4 / (blockDim / N)). Host: as hc_pre_norm_f32,
// plus 16-byte aligned o.
DS4_KERNEL void DS4_BOUNDS(1024) hc_post_pre_norm_f32(float* x, const float* __restrict__ o, const float* __restrict__ post_in, const float* __restrict__ comb_in, const u8* __restrict__ mixer, long long row_bytes, int wty, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, double* part, u32* tickets, int N, int D, int S, int iters, float hc_eps, float eps) {
    ds4_pdl_enter();
    switch (N) {
    case 1: fu_hc_post_pre<1>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    case 2: fu_hc_post_pre<2>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    case 3: fu_hc_post_pre<3>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    default: fu_hc_post_pre<4>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps); break;
    }
}

// ---------------------------------------------------------------------------------------------
// Latency forms of the two HC kernels above (the default; DS4_GPU_FUSE_FORM=v1 keeps those): many
// small splits so that a token's mixer is read by ~one CTA per SM. Split s of token t takes
// C = DS4_WARP / NN float4 columns of d; lane p of every warp is the pair (stream j = p / C,
// column s·C + p % C); warp g takes mixer rows g, g + nw, ... of all its pairs (one warp sum per
// row, no cross-warp sums). Partials are stored row-major (part[(t·FU_PART + r)·S + s]) so that
// the last CTA reads each row's splits contiguously. The serial path after the mixer loads is
// kept short (H200: 6.6 us a call back to back against 11.1 for the session-6 `_w` kernels,
// now deleted; bench/results/gpu-hc-h-h200.txt):
// - the mixer (and scale, base) loaded before the PDL wait (DS4_PDL_LATE);
// - one fence and one ticket per CTA (the CTA's stores, a barrier, then thread 0 fences and takes
//   the ticket: the cooperative-groups grid-sync pattern), acq_rel fences;
// - the last CTA's partial loads all in flight at once (8 threads a row, 16 splits each, then
//   8-lane xor sums: the same value on every lane, whichever CTA is last), then its first columns
//   of X' for the collapse;
// - pre, post and the comb's exps by one thread each at once (f32 expf), then the Sinkhorn on one
//   warp, every lane iterating on all N·N values in registers with pairwise sums and reciprocal
//   multiplies (no shuffles, no divisions in the 2·20 dependent steps); results ~1e-6 from the
//   CPU's, not bit-equal;
// - z (the collapse, Σz², the RMS scale) on the warps beside the Sinkhorn's, ending before it
//   (fl_hc).

#define FW_ZR 8    // most float4 columns of z per collapse thread in the epilogue
#define FW_T 256   // threads of a CTA (the host launches exactly this many)
#define FW_NW (FW_T / DS4_WARP)

// Probe stamps (hc_post_pre_norm_p only; compiled out of the other kernels): thread 0 of each CTA
// writes the time at phase k to stamps[blockIdx.x·FP_NST + k] (prelude.cuh ds4_now).
#define FP_NST 12
#define FP_STAMP(k)                                                                            \
    do {                                                                                       \
        if (PROBE && threadIdx.x == 0) stamps[(size_t)blockIdx.x * FP_NST + (k)] = ds4_now();  \
    } while (0)

#define FL_SUB 8 // threads summing one partial row
#define FL_PF 6  // collapse columns a thread loads before the partial sums (D/4 <= 6·192: one round)


// The epilogue's z columns c0 + k·step < D4 (float4s) of one token: q · zs · norm weight.
template <int NN>
__device__ __forceinline__ void fl_store_z(float* zrow, const float4 (&xv)[FW_ZR][NN], const float4 (&gr)[FW_ZR], float zs, int c0, int step, int D4) {
    float4* zt = (float4*)zrow;
#pragma unroll
    for (int k = 0; k < FW_ZR; k++) {
        const int c = c0 + k * step;
        if (c < D4) {
            const float4 q = xv[k][0], w = gr[k];
            zt[c] = make_float4(q.x * zs * w.x, q.y * zs * w.y, q.z * zs * w.z, q.w * zs * w.w);
        }
    }
}

// Release / acquire fence at device scope for the arrival ticket (CUDA fence.acq_rel.gpu,
// lighter than __threadfence's fence.sc; HIP __threadfence).
__device__ __forceinline__ void fl_fence() {
#if defined(DS4_CUDA) && DS4_ARCH >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}

// f64 load through L2 (other CTAs' partials of this launch; CUDA ld.global.cg, HIP volatile).
__device__ __forceinline__ double fu_ld_cg_f64(const double* p) {
#if defined(DS4_CUDA)
    double r;
    asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(r) : "l"(p));
    return r;
#else
    return *(const volatile double*)p;
#endif
}

// One (token t, split s) CTA; POST: apply the HC post to the pairs first (X' in place). PROBE
// (hc_post_pre_norm_p): stamps, and a return at `stop`. LATE: the kernel started with
// DS4_PDL_LATE; wait for the previous kernels after the weights' loads (mixer, scale, base).
// The last CTA's z is off the Sinkhorn's path: the collapse runs on the warps that share no
// scheduler with warp 0's Sinkhorn (warp w is on SM sub-partition w % 4: all but 0 and
// FW_NW / 2), and on CUDA Σz², the RMS scale and z's stores on those warps alone (named barrier
// 1), so the CTA ends when the longer of the two ends, not after both (H200: 5.6 us a call back
// to back against 6.5; bench/results/gpu-hc-h15-h200.txt); HIP keeps the CTA-wide Σz².
template <int NN, bool POST, bool PROBE, bool LATE>
__device__ __forceinline__ void fl_hc(float* x, const float* __restrict__ o, const float* __restrict__ post_in,
                                      const float* __restrict__ comb_in, const u8* __restrict__ mixer, long long row_bytes,
                                      int wty, const float* __restrict__ scale, const float* __restrict__ base,
                                      const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post,
                                      float* __restrict__ comb, double* part, u32* tickets, int D, int S, int iters,
                                      float hc_eps, float eps, int stop, u64* stamps) {
    constexpr int MIX = (2 + NN) * NN, C = DS4_WARP / NN, RW = (MIX + FW_NW - 1) / FW_NW, ROWS = MIX + 1;
    static_assert(ROWS * FL_SUB <= FW_T, "one pass of partial rows");
    __shared__ float4 v_s[DS4_WARP];
    __shared__ double dsum[ROWS], red[32];
    __shared__ float e_s[NN * NN], pre_s[NN], prm_s[MIX + 3]; // prm_s: base [MIX], then scale [3]
    __shared__ int last_s;
    const int t = blockIdx.x / S, s = blockIdx.x % S, tid = threadIdx.x;
    const int lane = tid % DS4_WARP, g = tid / DS4_WARP, nw = FW_NW;
    const int D4 = D >> 2, j = lane / C, c4 = s * C + lane % C, col = j * D4 + c4; // float4 of the N·D row
    const bool mine = j < NN && c4 < D4;
    float4* xt = (float4*)(x + (size_t)t * NN * D);
    FP_STAMP(0);
    // This warp's mixer rows at this pair's column, and the epilogue's parameters, loaded first.
    uint4 raw[RW];
#pragma unroll
    for (int k = 0; k < RW; k++) {
        const int r = g + k * nw;
        raw[k] = make_uint4(0u, 0u, 0u, 0u);
        if (r < MIX && mine) {
            const u8* row = mixer + (size_t)r * row_bytes;
            if (wty == 0) raw[k] = ((const uint4*)row)[col];
            else {
                const uint2 u = ((const uint2*)row)[col];
                raw[k] = make_uint4(u.x, u.y, 0u, 0u);
            }
        }
    }
    const float prm = tid < MIX ? base[tid] : tid < MIX + 3 ? scale[tid - MIX] : 0.0f;
    const double inv_nd = 1.0 / (double)(NN * D); // the RMS's division off the last CTA's path
    if (LATE) ds4_pdl_enter(); // x, o, post_in, comb_in and part are read after it
    // Warp 0: the pair's value (X' = post_j·o + Σ_i A[i][j]·X[i] in the CPU's order, or X) and Σv².
    double ss = 0.0;
    if (g == 0) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (mine && POST) {
            const float pj = post_in[(size_t)t * NN + j];
            float4 old[NN];
            float a[NN];
#pragma unroll
            for (int i = 0; i < NN; i++) {
                old[i] = xt[i * D4 + c4];
                a[i] = comb_in[(size_t)t * NN * NN + i * NN + j]; // A[i][j]: column j of the comb
            }
            const float4 ov = ((const float4*)(o + (size_t)t * D))[c4];
            v = make_float4(ds4_mul_rn(pj, ov.x), ds4_mul_rn(pj, ov.y), ds4_mul_rn(pj, ov.z), ds4_mul_rn(pj, ov.w));
#pragma unroll
            for (int i = 0; i < NN; i++) {
                v.x += ds4_mul_rn(a[i], old[i].x), v.y += ds4_mul_rn(a[i], old[i].y);
                v.z += ds4_mul_rn(a[i], old[i].z), v.w += ds4_mul_rn(a[i], old[i].w);
            }
        } else if (mine) {
            v = xt[col];
        }
        ss = (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z + (double)v.w * (double)v.w;
        v_s[lane] = v;
    }
    __syncthreads(); // v_s complete; every old X of this split is read (warp 0) before the stores
    FP_STAMP(1);
    if (PROBE && stop == 1) return;
    if (POST && g == 0 && mine) xt[col] = v_s[lane];
    const float4 v = v_s[lane];
    double* pt = part + (size_t)t * FU_PART * S + s;
#pragma unroll
    for (int k = 0; k < RW; k++) {
        const int r = g + k * nw;
        if (r >= MIX) break; // warp-uniform
        float4 w;
        if (wty == 0) w = make_float4(__uint_as_float(raw[k].x), __uint_as_float(raw[k].y), __uint_as_float(raw[k].z), __uint_as_float(raw[k].w));
        else if (wty == 1) w = make_float4(ds4_h2f_fast(raw[k].x & 0xffffu), ds4_h2f_fast(raw[k].x >> 16), ds4_h2f_fast(raw[k].y & 0xffffu), ds4_h2f_fast(raw[k].y >> 16));
        else w = make_float4(ds4_bf2f((u16)(raw[k].x & 0xffffu)), ds4_bf2f((u16)(raw[k].x >> 16)), ds4_bf2f((u16)(raw[k].y & 0xffffu)), ds4_bf2f((u16)(raw[k].y >> 16)));
        const float d = ds4_warp_sum(w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w); // idle pairs: w = 0
        if (lane == 0) pt[(size_t)r * S] = (double)d;
    }
    if (g == 0) {
        ss = ds4_warp_sum_f64(ss);
        if (lane == 0) pt[(size_t)MIX * S] = ss;
    }
    __syncthreads(); // every store of this CTA (X', partials) precedes thread 0's fence
    FP_STAMP(2);
    if (PROBE && stop == 2) return;
    if (tid == 0) {
        fl_fence(); // release: the CTA's stores are visible device-wide before the ticket
        const bool l = atomicAdd(&tickets[t], 1u) == (u32)(S - 1);
        if (l) fl_fence(); // acquire: the other CTAs' stores are read after it
        last_s = l;
    }
    __syncthreads();
    FP_STAMP(3);
    if (!last_s) return;
    if (PROBE && stop == 3) {
        if (tid == 0) tickets[t] = 0u;
        return;
    }
    // Last CTA. Row pr_r = tid / FL_SUB of the partials over the S splits: FL_SUB threads, the
    // first 16 splits each loaded now (before the collapse's loads, which queue behind them).
    const int pr_r = tid / FL_SUB, q0 = tid % FL_SUB;
    const double* pr = part + ((size_t)t * FU_PART + pr_r) * S;
    double u[16];
#pragma unroll
    for (int k = 0; k < 16; k++) u[k] = pr_r < ROWS && q0 + k * FL_SUB < S ? fu_ld_cg_f64(pr + q0 + k * FL_SUB) : 0.0;
    // Collapse warps (cw; ci-th of NCW): the collapse columns c0 + k·step, the first PF loaded
    // now (X' of other CTAs through L2), in flight while the partials are summed.
    constexpr int NCW = FW_NW - 2, PF = FL_PF;
    const bool cw = g != 0 && g != FW_NW / 2;
    const int ci = g - 1 - (g > FW_NW / 2 ? 1 : 0);
    const int step = NCW * DS4_WARP, c0 = ci * DS4_WARP + lane;
    float4 xv[FW_ZR][NN], gr[FW_ZR];
    const float4* nr = (const float4*)norm;
    if (cw) {
#pragma unroll
        for (int k = 0; k < PF; k++) {
            const int c = c0 + k * step;
            if (c < D4) {
                gr[k] = nr[c];
#pragma unroll
                for (int i = 0; i < NN; i++) xv[k][i] = POST ? fu_ld_cg(xt + i * D4 + c) : xt[i * D4 + c];
            }
        }
    }
    { // the partial sums in a fixed order (16 splits at a time, then xor sums over the FL_SUB)
        double a = 0.0;
#pragma unroll
        for (int k = 0; k < 16; k++) a += u[k];
        for (int q = q0 + 16 * FL_SUB; pr_r < ROWS && q < S; q += 16 * FL_SUB) { // S > 16·FL_SUB
#pragma unroll
            for (int k = 0; k < 16; k++) u[k] = q + k * FL_SUB < S ? fu_ld_cg_f64(pr + q + k * FL_SUB) : 0.0;
#pragma unroll
            for (int k = 0; k < 16; k++) a += u[k];
        }
#pragma unroll
        for (int o = 1; o < FL_SUB; o <<= 1) a += ds4_shfl_xor(a, o); // the same sum on every lane
        if (pr_r < ROWS && q0 == 0) dsum[pr_r] = a;
        if (tid < MIX + 3) prm_s[tid] = prm;
    }
    __syncthreads();
    if (tid == 0) tickets[t] = 0u; // ready for the next launch (graph replays too)
    FP_STAMP(4);
    if (PROBE && stop == 4) return;
    // Thread e < MIX: m_e = dot_e · rms scale of the N·D row, its logit m_e·scale[k] + base[e],
    // then (all at once) pre (e < N), post (e < 2N) or the exp of a comb logit less its row's max.
    if (tid < MIX) {
        const float sc = (float)rsqrt(dsum[MIX] * inv_nd + (double)eps);
        const float sk = prm_s[MIX + (tid < NN ? 0 : tid < 2 * NN ? 1 : 2)];
        const float lg = ds4_mul_rn((float)dsum[tid] * sc, sk) + prm_s[tid];
        if (tid < NN) pre_s[tid] = hc_sigmoid_f(lg) + hc_eps;
        else if (tid < 2 * NN) post[(size_t)t * NN + tid - NN] = 2.0f * hc_sigmoid_f(lg);
        else {
            const int r0 = 2 * NN + (tid - 2 * NN) / NN * NN; // the row's first logit
            float mx = DS4_NEG_INF;
#pragma unroll
            for (int b = 0; b < NN; b++) mx = fmaxf(mx, ds4_mul_rn((float)dsum[r0 + b] * sc, sk) + prm_s[r0 + b]);
            e_s[tid - 2 * NN] = expf(lg - mx);
        }
    }
    __syncthreads();
    FP_STAMP(5);
    // Warp 0: split + Sinkhorn (post, comb); the collapse warps: z = Σ pre_i X[i] (CPU order,
    // uncontracted) into registers; then rms_norm(z).
    double zz = 0.0;
    if (g == 0) {
        const long long c_0 = PROBE ? clock64() : 0;
        if (!(PROBE && stop == 5))
            hc_sinkhorn_regs<NN>(e_s, comb + (size_t)t * NN * NN, iters, hc_eps);
        if (PROBE && lane == 0) {
            stamps[(size_t)blockIdx.x * FP_NST + 6] = ds4_now();
            stamps[(size_t)blockIdx.x * FP_NST + 10] = (u64)(clock64() - c_0);
        }
    } else if (cw && !(PROBE && stop == 6)) {
        const long long c_0 = PROBE ? clock64() : 0;
#pragma unroll
        for (int k = PF; k < FW_ZR; k++) { // columns past the prefetched ones (D/4 > PF·step)
            const int c = c0 + k * step;
            if (c < D4) {
                gr[k] = nr[c];
#pragma unroll
                for (int i = 0; i < NN; i++) xv[k][i] = POST ? fu_ld_cg(xt + i * D4 + c) : xt[i * D4 + c];
            }
        }
#pragma unroll
        for (int k = 0; k < FW_ZR; k++) {
            const int c = c0 + k * step;
            xv[k][0] = c < D4 ? fu_collapse<NN>(pre_s, xv[k], zz) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (PROBE && tid == DS4_WARP) {
            stamps[(size_t)blockIdx.x * FP_NST + 7] = ds4_now();
            stamps[(size_t)blockIdx.x * FP_NST + 11] = (u64)(clock64() - c_0);
        }
#if defined(DS4_CUDA)
        { // Σz² over the collapse warps only (fixed order), then z = q·zs·norm
            const double w = ds4_warp_sum_f64(zz);
            if (lane == 0) red[ci] = w;
            ds4_bar_named(1, NCW * DS4_WARP);
            double t2 = 0.0;
            for (int i = 0; i < NCW; i++) t2 += red[i];
            if (PROBE && tid == DS4_WARP) stamps[(size_t)blockIdx.x * FP_NST + 8] = ds4_now();
            fl_store_z(z + (size_t)t * D, xv, gr, (float)(1.0 / sqrt(t2 / (double)D + (double)eps)), c0, step, D4);
            if (PROBE && tid == DS4_WARP) stamps[(size_t)blockIdx.x * FP_NST + 9] = ds4_now();
        }
#endif
    }
#if defined(DS4_CUDA)
    return; // warp 0 after its Sinkhorn, warp FW_NW / 2 at once, the others after z
#else
    zz = fu_block_sum(zz, red);
    FP_STAMP(8);
    const float zs = (float)(1.0 / sqrt(zz / (double)D + (double)eps));
    if (cw && !(PROBE && stop == 6)) fl_store_z(z + (size_t)t * D, xv, gr, zs, c0, step, D4);
    FP_STAMP(9);
#endif
}

// Latency hc_pre_norm_f32: same arguments, outputs and host guarantees, except: grid n·S CTAs with
// S = ceil(D/4 / (DS4_WARP / N)); part holds n·FU_PART·S doubles; blockDim = FW_T with
// D/4 <= FW_ZR·(FW_T - 2·DS4_WARP) (the epilogue's collapse warps).
DS4_KERNEL void DS4_BOUNDS(FW_T) hc_pre_norm_l(const float* __restrict__ x, const u8* __restrict__ mixer, long long row_bytes, int wty, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, double* part, u32* tickets, int N, int D, int S, int iters, float hc_eps, float eps) {
    DS4_PDL_LATE; // fl_hc waits after the mixer loads
    float* xm = (float*)x; // not written (POST = false)
    switch (N) {
    case 1: fl_hc<1, false, false, true>(xm, nullptr, nullptr, nullptr, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    case 2: fl_hc<2, false, false, true>(xm, nullptr, nullptr, nullptr, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    case 3: fl_hc<3, false, false, true>(xm, nullptr, nullptr, nullptr, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    default: fl_hc<4, false, false, true>(xm, nullptr, nullptr, nullptr, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    }
}

// Latency hc_post_pre_norm_f32: same arguments and outputs; grid and part as hc_pre_norm_l.
DS4_KERNEL void DS4_BOUNDS(FW_T) hc_post_pre_norm_l(float* x, const float* __restrict__ o, const float* __restrict__ post_in, const float* __restrict__ comb_in, const u8* __restrict__ mixer, long long row_bytes, int wty, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, double* part, u32* tickets, int N, int D, int S, int iters, float hc_eps, float eps) {
    DS4_PDL_LATE; // fl_hc waits after the mixer loads
    switch (N) {
    case 1: fl_hc<1, true, false, true>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    case 2: fl_hc<2, true, false, true>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    case 3: fl_hc<3, true, false, true>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    default: fl_hc<4, true, false, true>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, 0, nullptr); break;
    }
}

// Probe of hc_post_pre_norm_l at N = 4 (crates/ds4-gpu/examples/hc_bench.rs): form 0 waits for
// the previous kernel first, 1 after the mixer loads (as _l); %globaltimer stamps per CTA in
// stamps[CTA·FP_NST + k] (0 entry, 1 pair values, 2 partials stored, 3 ticket; last CTA:
// 4 partial sums, 5 m/pre, 6 Sinkhorn end, 7 collapse end, 8 Σz², 9 end of z (on CUDA apart
// from the Sinkhorn's end); 10 and 11 the Sinkhorn's and the collapse's clock64 cycles) and a
// stop: 1..4 return after that phase (the ticket left right), 5 skips the Sinkhorn, 6 the
// collapse. Arguments as hc_post_pre_norm_l plus form, stop, stamps.
DS4_KERNEL void DS4_BOUNDS(FW_T) hc_post_pre_norm_p(float* x, const float* __restrict__ o, const float* __restrict__ post_in, const float* __restrict__ comb_in, const u8* __restrict__ mixer, long long row_bytes, int wty, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, double* part, u32* tickets, int N, int D, int S, int iters, float hc_eps, float eps, int form, int stop, u64* stamps) {
    DS4_PDL_LATE; // form 0 waits here, 1 in fl_hc
    if (form == 0) {
        ds4_pdl_enter();
        fl_hc<4, true, true, false>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, stop, stamps);
    } else {
        fl_hc<4, true, true, true>(x, o, post_in, comb_in, mixer, row_bytes, wty, scale, base, norm, z, post, comb, part, tickets, D, S, iters, hc_eps, eps, stop, stamps);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm + RoPE (+ FP8 of the first fp8_nope values, + f16) of attention rows.

// RoPE of one pair by pos·w (mod 2π in f64), as attention.cu's rope_f32 (uncontracted).
__device__ __forceinline__ void fu_rope_pair(float* v, double w, long long pos) {
    const double theta = fmod((double)pos * w, 6.283185307179586);
    const float s = (float)sin(theta), c = (float)cos(theta);
    const float a = v[0], b = v[1];
    v[0] = __fsub_rn(ds4_mul_rn(a, c), ds4_mul_rn(b, s));
    v[1] = __fadd_rn(ds4_mul_rn(a, s), ds4_mul_rn(b, c));
}

// Nearest E4M3FN value of x (|x| <= 448), ties to even, as math.rs fp8_sim (and attention.cu).
__device__ __forceinline__ float fu_e4m3(float x) {
    const float ax = fabsf(x);
    if (ax == 0.0f || ax != ax) return x;
    int e = (int)((__float_as_uint(ax) >> 23) & 0xffu) - 127; // floor(log2|x|) for normal x
    if (e < -6) e = -6;                                      // subnormal E4M3 step 2^-9
    const float step = __int_as_float((u32)(e - 3 + 127) << 23);
    const float q = rintf(__fdiv_rn(ax, step));
    return copysignf(fminf(ds4_mul_rn(q, step), 448.0f), x);
}

// 2^ceil(log2(amax / lim)) from the bits of the f64 ratio (exact at powers of two).
__device__ __forceinline__ float fu_pow2_scale(float amax, double lim) {
    const long long b = __double_as_longlong((double)amax / lim);
    long long e = (b >> 52) & 0x7ff;
    if ((b & 0xfffffffffffffLL) && e < 0x7ff) e++;
    return (float)__longlong_as_double(e << 52);
}

// f32 -> f16 (nearest even, subnormals, Inf) -> f32.
__device__ __forceinline__ float fu_f16_round(float f) {
    const u32 x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    u16 h;
    if (ax >= 0x7f800000u) {
        h = (u16)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    } else if (ax >= 0x477ff000u) {
        h = (u16)(sign | 0x7c00u);
    } else if (ax >= 0x38800000u) {
        const u32 m = ax + 0xfffu + ((ax >> 13) & 1u);
        h = (u16)(sign | ((m - 0x38000000u) >> 13));
    } else if (ax > 0x33000000u) {
        const u32 e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
        u32 q = m >> shift;
        const u32 rem = m & ((1u << shift) - 1u), halfw = 1u << (shift - 1u);
        if (rem > halfw || (rem == halfw && (q & 1u))) q++;
        h = (u16)(sign | q);
    } else {
        h = (u16)sign;
    }
    return ds4_h2f(h);
}

// One CTA per row of x [rows, width] (rows = tokens × heads; token i = row / heads at position
// pos0 + i): rms_norm (w optional), RoPE of the last n_rot values, FP8 round trip of the first
// fp8_nope values (blocks of 64), f16 rounding when f16. The row is staged in dynamic shared
// memory (width floats). Host: n_rot even, n_rot <= width, fp8_nope <= width. sp: the step's
// position in device memory (attention.cu DS4_POS: pos0 is then an offset from *sp), or null.
DS4_KERNEL void DS4_BOUNDS(256) norm_rope_f32(float* __restrict__ x, const float* __restrict__ w, const double* __restrict__ freqs, int heads, int width, int n_rot, long long pos0, float eps, int fp8_nope, int f16, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    extern __shared__ float row_s[];
    __shared__ double red[32];
    const int tid = threadIdx.x;
    float* xr = x + (size_t)blockIdx.x * width;
    double ss = 0.0;
    for (int i = tid; i < width; i += blockDim.x) {
        const float v = xr[i];
        row_s[i] = v;
        ss += (double)v * (double)v;
    }
    ss = fu_block_sum(ss, red); // ends after a barrier: row_s is complete
    const float sc = (float)(1.0 / sqrt(ss / (double)width + (double)eps));
    for (int i = tid; i < width; i += blockDim.x) {
        const float v = row_s[i] * sc;
        row_s[i] = w ? v * w[i] : v;
    }
    __syncthreads();
    const long long pos = pos0 + (sp ? *sp : 0LL) + blockIdx.x / heads;
    for (int p = tid; p < n_rot / 2; p += blockDim.x) fu_rope_pair(row_s + (width - n_rot) + 2 * p, freqs[p], pos);
    __syncthreads();
    // FP8 of blocks of 64: a warp per block, amax by shuffles (max is order-free).
    const int nb = (fp8_nope + 63) / 64, lane = tid % DS4_WARP, nw = blockDim.x / DS4_WARP;
    for (int b = tid / DS4_WARP; b < nb; b += nw) {
        const int e = min(b * 64 + 64, fp8_nope);
        float m = 0.0f;
        for (int i = b * 64 + lane; i < e; i += DS4_WARP) m = fmaxf(m, fabsf(row_s[i]));
#pragma unroll
        for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
        m = fmaxf(m, 1e-4f);
        const float s = fu_pow2_scale(m, 448.0);
        for (int i = b * 64 + lane; i < e; i += DS4_WARP) {
            const float v = __fdiv_rn(row_s[i], s);
            const float c = v != v ? v : fminf(fmaxf(v, -448.0f), 448.0f);
            row_s[i] = ds4_mul_rn(fu_e4m3(c), s);
        }
    }
    __syncthreads();
    for (int i = tid; i < width; i += blockDim.x) {
        const float v = row_s[i];
        xr[i] = f16 ? fu_f16_round(v) : v;
    }
}

// norm_rope in registers (the default form; v1, and rows past NG_K·256 float4, take
// norm_rope_f32; H200 decode: 4.4 us a call against 6.6): a CTA per row, the row in registers
// (float4 q = k·blockDim + tid, k < NG_K). The RoPE angles do not depend on
// the row: each thread starts its pairs' f64 sin/cos (into shared memory) while its loads are in
// flight, so only the sum of squares and the rounding remain on the critical path. FP8 blocks of
// 64 values are 16 float4 = 16 aligned lanes (amax by xor shuffles within them). Same operations
// as norm_rope_f32. Host: width % 4 == 0, width / 4 <= NG_K·blockDim, blockDim a multiple of
// DS4_WARP, 16-byte aligned x and w, n_rot even, n_rot and fp8_nope <= width; dynamic shared
// memory n_rot / 2 float2.
#define NG_K 4
// The row body of norm_rope_g and norm_rope_pair_g: row `row` of x (token `tok` of the chunk, at
// pos0 + *sp + tok); sc_s: the kernel's n_rot / 2 float2 of dynamic shared memory, red: its
// fu_block_sum scratch. Called block-uniformly (it has barriers). LATE (a kernel started with
// DS4_PDL_LATE): the weight loads and the f64 (sin, cos) of the pairs first, then ds4_pdl_enter(),
// then the row's loads -- those read only weights, the RoPE table and the step block (mod.rs
// StepPos queues its copy before the step's kernels; index_qprep_f32 reads it early too), so under
// PDL they overlap the previous kernel's tail; same operations, same bits.
template <bool LATE = false>
__device__ __forceinline__ void fu_norm_rope_row(float* __restrict__ x, const float* __restrict__ w, const double* __restrict__ freqs, int row, int tok, int width, int n_rot, long long pos0, float eps, int fp8_nope, int f16, const long long* __restrict__ sp, float2* sc_s, double* red) {
    const int tid = threadIdx.x, T = blockDim.x, w4 = width >> 2, r0 = width - n_rot;
    float4* xr = (float4*)(x + (size_t)row * width);
    const float4* wr = (const float4*)w;
    float4 e[NG_K], gw[NG_K];
#pragma unroll
    for (int k = 0; k < NG_K; k++) { // every load first
        const int q = k * T + tid;
        if (!LATE) e[k] = q < w4 ? xr[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        gw[k] = (w && q < w4) ? wr[q] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    }
    const long long pos = pos0 + (sp ? *sp : 0LL) + tok; // sp: as norm_rope_f32
    for (int p = tid; p < n_rot / 2; p += T) { // pos·ω mod 2π in f64, as fu_rope_pair
        const double theta = fmod((double)pos * freqs[p], 6.283185307179586);
        double sn, cs;
        sincos(theta, &sn, &cs);
        sc_s[p] = make_float2((float)sn, (float)cs);
    }
    if (LATE) {
        ds4_pdl_enter();
#pragma unroll
        for (int k = 0; k < NG_K; k++) {
            const int q = k * T + tid;
            e[k] = q < w4 ? xr[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < NG_K; k++)
        ss += (double)e[k].x * (double)e[k].x + (double)e[k].y * (double)e[k].y + (double)e[k].z * (double)e[k].z +
              (double)e[k].w * (double)e[k].w;
    ss = fu_block_sum(ss, red); // its barriers also publish sc_s
    const float sc = (float)(1.0 / sqrt(ss / (double)width + (double)eps));
#pragma unroll
    for (int k = 0; k < NG_K; k++) {
        const int q = k * T + tid;
        if (k * T >= w4) break; // block-uniform
        float v[4] = {e[k].x * sc, e[k].y * sc, e[k].z * sc, e[k].w * sc};
        if (w) v[0] = v[0] * gw[k].x, v[1] = v[1] * gw[k].y, v[2] = v[2] * gw[k].z, v[3] = v[3] * gw[k].w;
#pragma unroll
        for (int h = 0; h < 2; h++) { // the pair at columns 4q + 2h, 4q + 2h + 1 (r0 is even)
            const int c = 4 * q + 2 * h;
            if (q < w4 && c >= r0) {
                const float2 t = sc_s[(c - r0) >> 1];
                const float a = v[2 * h], b = v[2 * h + 1];
                v[2 * h] = __fsub_rn(ds4_mul_rn(a, t.y), ds4_mul_rn(b, t.x));
                v[2 * h + 1] = __fadd_rn(ds4_mul_rn(a, t.x), ds4_mul_rn(b, t.y));
            }
        }
        if (k * T * 4 < fp8_nope) { // block-uniform: FP8 of this k's 64-value blocks
            float m = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (4 * q + i < fp8_nope) m = fmaxf(m, fabsf(v[i]));
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) m = fmaxf(m, ds4_shfl_xor(m, o)); // over the 64-value block
            m = fmaxf(m, 1e-4f);
            const float s = fu_pow2_scale(m, 448.0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (4 * q + i < fp8_nope) {
                    const float d = __fdiv_rn(v[i], s);
                    const float c = d != d ? d : fminf(fmaxf(d, -448.0f), 448.0f);
                    v[i] = ds4_mul_rn(fu_e4m3(c), s);
                }
            }
        }
        if (q < w4) {
            if (f16) {
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = fu_f16_round(v[i]);
            }
            xr[q] = make_float4(v[0], v[1], v[2], v[3]);
        }
    }
}

DS4_KERNEL void DS4_BOUNDS(256) norm_rope_g(float* __restrict__ x, const float* __restrict__ w, const double* __restrict__ freqs, int heads, int width, int n_rot, long long pos0, float eps, int fp8_nope, int f16, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    extern __shared__ float2 sc_s[]; // (sin, cos) of pair p
    __shared__ double red[32];
    fu_norm_rope_row(x, w, freqs, blockIdx.x, blockIdx.x / heads, width, n_rot, pos0, eps, fp8_nope, f16, sp, sc_s, red);
}

// Two norm_rope_g row sets of one width, RoPE table and positions in one launch (decode: the
// query's 64 head rows and the shared KV row of a layer, 65 CTAs for two launches' 64 + 1):
// CTA c < rows_a takes row c of a, the others row c - rows_a of b, each with its own weight,
// heads, FP8 and f16 rounding. Same host conditions as norm_rope_g for both sets; bit-identical.
DS4_KERNEL void DS4_BOUNDS(256) norm_rope_pair_g(float* __restrict__ xa, const float* __restrict__ wa, int heads_a, int fp8_a, int f16_a, int rows_a, float* __restrict__ xb, const float* __restrict__ wb, int heads_b, int fp8_b, int f16_b, const double* __restrict__ freqs, int width, int n_rot, long long pos0, float eps, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    extern __shared__ float2 sc_s[]; // (sin, cos) of pair p
    __shared__ double red[32];
    const bool a = (int)blockIdx.x < rows_a; // block-uniform
    const int row = a ? (int)blockIdx.x : (int)blockIdx.x - rows_a, heads = a ? heads_a : heads_b;
    fu_norm_rope_row(a ? xa : xb, a ? wa : wb, freqs, row, row / heads, width, n_rot, pos0, eps, a ? fp8_a : fp8_b,
                     a ? f16_a : f16_b, sp, sc_s, red);
}

// norm_rope_pair_g with the weights and the RoPE (sin, cos) before the PDL wait (fu_norm_rope_row
// LATE); same bits. model/mix.rs `DS4_GPU_NRLATE=off` keeps norm_rope_pair_g.
DS4_KERNEL void DS4_BOUNDS(256) norm_rope_pair_gl(float* __restrict__ xa, const float* __restrict__ wa, int heads_a, int fp8_a, int f16_a, int rows_a, float* __restrict__ xb, const float* __restrict__ wb, int heads_b, int fp8_b, int f16_b, const double* __restrict__ freqs, int width, int n_rot, long long pos0, float eps, const long long* __restrict__ sp) {
    DS4_PDL_LATE; // fu_norm_rope_row<true> waits after the weight loads and the (sin, cos)
    extern __shared__ float2 sc_s[]; // (sin, cos) of pair p
    __shared__ double red[32];
    const bool a = (int)blockIdx.x < rows_a; // block-uniform
    const int row = a ? (int)blockIdx.x : (int)blockIdx.x - rows_a, heads = a ? heads_a : heads_b;
    fu_norm_rope_row<true>(a ? xa : xb, a ? wa : wb, freqs, row, row / heads, width, n_rot, pos0, eps,
                           a ? fp8_a : fp8_b, a ? f16_a : f16_b, sp, sc_s, red);
}

// Prefill form of norm_rope_pair_g (DS4_GPU_NRW; n > 4 tokens): a warp a row instead of a CTA a
// row (H200, n 2048 x 64 + 1 rows of 512: the CTA form moves 536 MB in ~283 us, ~1.9 TB/s; a
// 128-thread CTA a row is mostly latency: its f64 RoPE angles and two barriers per 2 KB).
// Warp g takes rows g·NW_R .. + NW_R of the pair's row space (a's rows, then b's), every load
// of its rows issued first; lane l holds float4 columns q = k·DS4_WARP + l (k < NW_K). The
// bits of norm_rope_pair_g wherever its CTA holds one float4 a thread (width / 4 <= 256): Σx² is
// summed per k over the warp (k = the CTA form's warp index) by the same xor butterfly, then the
// k sums in k order from 0 (fu_block_sum's order); a lane computes the f64 sin/cos of the pairs
// in its own columns (the same expression as fu_norm_rope_row), again only when the row's token
// changes; FP8 blocks of 64 are 16 aligned lanes, as there. Host: width % 4 == 0,
// width / 4 <= NW_K·DS4_WARP, 16-byte aligned rows and weights, n_rot even, n_rot and fp8_nope
// <= width; no dynamic shared memory.
#define NW_K 4
#define NW_R 2
DS4_KERNEL void DS4_BOUNDS(256) norm_rope_pair_w(float* __restrict__ xa, const float* __restrict__ wa, int heads_a, int fp8_a, int f16_a, int rows_a, float* __restrict__ xb, const float* __restrict__ wb, int heads_b, int fp8_b, int f16_b, const double* __restrict__ freqs, int width, int n_rot, long long pos0, float eps, const long long* __restrict__ sp, int rows) {
    ds4_pdl_enter();
    const int lane = threadIdx.x % DS4_WARP, w4 = width >> 2, r0 = width - n_rot;
    const int g0 = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / DS4_WARP) * NW_R;
    if (g0 >= rows) return; // warp-uniform
    float4 e[NW_R][NW_K];
#pragma unroll
    for (int i = 0; i < NW_R; i++) { // every load of the warp's rows first
        const int g = g0 + i;
        const bool a = g < rows_a;
        const float4* xr = (const float4*)((a ? xa : xb) + (size_t)(a ? g : g - rows_a) * width);
#pragma unroll
        for (int k = 0; k < NW_K; k++) {
            const int q = k * DS4_WARP + lane;
            e[i][k] = (g < rows && q < w4) ? xr[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    const long long base = pos0 + (sp ? *sp : 0LL);
    float2 sc[NW_K][2]; // (sin, cos) of the pairs at columns 4q, 4q + 2 (where >= r0)
    int tok_sc = -1;
#pragma unroll
    for (int i = 0; i < NW_R; i++) {
        const int g = g0 + i;
        if (g >= rows) break; // warp-uniform
        const bool a = g < rows_a;
        const int row = a ? g : g - rows_a, heads = a ? heads_a : heads_b;
        const int tok = a ? row / heads : rows_a + row / heads; // a's and b's tokens apart
        float4* xr = (float4*)((a ? xa : xb) + (size_t)row * width);
        const float4* wr = (const float4*)(a ? wa : wb);
        const int fp8_nope = a ? fp8_a : fp8_b, f16 = a ? f16_a : f16_b;
        if (tok != tok_sc) { // warp-uniform; the same angles as fu_norm_rope_row's sc_s
            tok_sc = tok;
            const long long pos = base + row / heads;
#pragma unroll
            for (int k = 0; k < NW_K; k++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int c = 4 * (k * DS4_WARP + lane) + 2 * h;
                    if (c >= r0 && c < width) {
                        const double theta = fmod((double)pos * freqs[(c - r0) >> 1], 6.283185307179586);
                        double sn, cs;
                        sincos(theta, &sn, &cs);
                        sc[k][h] = make_float2((float)sn, (float)cs);
                    }
                }
            }
        }
        double ss = 0.0; // Σ over k of the warp sums: fu_block_sum's order
#pragma unroll
        for (int k = 0; k < NW_K; k++) {
            if (k * DS4_WARP >= w4) break; // warp-uniform
            const float4 v = e[i][k];
            double s = 0.0;
            s += (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z +
                 (double)v.w * (double)v.w;
            ss += ds4_warp_sum_f64(s);
        }
        const float rs = (float)(1.0 / sqrt(ss / (double)width + (double)eps));
#pragma unroll
        for (int k = 0; k < NW_K; k++) {
            const int q = k * DS4_WARP + lane;
            if (k * DS4_WARP >= w4) break; // warp-uniform
            const float4 x4 = e[i][k];
            float v[4] = {x4.x * rs, x4.y * rs, x4.z * rs, x4.w * rs};
            if (wr && q < w4) {
                const float4 gw = wr[q];
                v[0] = v[0] * gw.x, v[1] = v[1] * gw.y, v[2] = v[2] * gw.z, v[3] = v[3] * gw.w;
            }
#pragma unroll
            for (int h = 0; h < 2; h++) { // the pair at columns 4q + 2h, 4q + 2h + 1 (r0 is even)
                const int c = 4 * q + 2 * h;
                if (q < w4 && c >= r0) {
                    const float2 t = sc[k][h];
                    const float p = v[2 * h], b = v[2 * h + 1];
                    v[2 * h] = __fsub_rn(ds4_mul_rn(p, t.y), ds4_mul_rn(b, t.x));
                    v[2 * h + 1] = __fadd_rn(ds4_mul_rn(p, t.x), ds4_mul_rn(b, t.y));
                }
            }
            if (k * DS4_WARP * 4 < fp8_nope) { // warp-uniform: FP8 of this k's 64-value blocks
                float m = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (4 * q + j < fp8_nope) m = fmaxf(m, fabsf(v[j]));
#pragma unroll
                for (int o = 1; o < 16; o <<= 1) m = fmaxf(m, ds4_shfl_xor(m, o)); // over the 64-value block
                m = fmaxf(m, 1e-4f);
                const float s = fu_pow2_scale(m, 448.0);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (4 * q + j < fp8_nope) {
                        const float d = __fdiv_rn(v[j], s);
                        const float c = d != d ? d : fminf(fmaxf(d, -448.0f), 448.0f);
                        v[j] = ds4_mul_rn(fu_e4m3(c), s);
                    }
                }
            }
            if (q < w4) {
                if (f16) {
#pragma unroll
                    for (int j = 0; j < 4; j++) v[j] = fu_f16_round(v[j]);
                }
                xr[q] = make_float4(v[0], v[1], v[2], v[3]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill form of the HC pre + norm (n > the decode kernels' 4 tokens; the host's FUSE_HC_MAX_N;
// the HC post before it stays a separate op): two launches that read X twice instead of the
// composed ops' copy, rms_norm, bf16 operand copies, GEMM and hc_split (H200, n 2048, N 4, D 4096:
// 148 us a call against 378; bench/results/gpu-hc-x10-h200.txt).
// (1) hcp_mix: HP_L adjacent lanes a token (HP_T / HP_L tokens a CTA, tile = CTA / S; lane sub
//     takes columns sub, sub + HP_L, ...: HP_L·16 contiguous bytes of a row a load), split s of S
//     takes float4 columns [s·per, (s+1)·per) of d in all N streams: per column a lane loads the
//     N streams' float4, adds Σx² (f64) and the (2+N)·N mixer dot products (f32) of the raw X.
//     The mixer's columns are staged in shared memory HP_QC at a time as f32 (w_s[r][j][qq]): a
//     warp reads HP_L of them at once (broadcasts), so one staged chunk serves HP_T / HP_L
//     tokens. The next column's loads are issued before this one's arithmetic; a token's lanes
//     add their sums by xor shuffles at the end. Partials go to part[(t·S + s)·FU_PART + r]
//     (r < MIX dots, r = MIX Σx²), no atomics.
// (2) hcp_finish: a CTA a token sums its S partials in split order and runs the decode v1
//     epilogue (fu_finish: m = dots · rms scale, pre, split + Sinkhorn on warp 0, the collapse
//     on the others, rms_norm of z).
// Measured and deleted (same file): a lane per token (HP_L 1, 157 us for the mix alone; 4: 118),
// the HC post fused into hcp_mix (385-816 us a post + pre call: stores of 16-32 bytes a lane), and
// a tiled form (hct_mix: X through shared memory in 128-byte row segments, 32 tokens a CTA, 136-177
// registers: 181-193 us a pre call, 221-237 us post + pre).

#define HP_T 256 // threads of a hcp_mix CTA
#define HP_L 2   // adjacent lanes a token (one 32-byte sector of a row a lane pair)
#define HP_QC 16 // float4 columns of d a staged mixer chunk (all N streams): 24·4·16 float4 = 24 KB
#define HP_WS (24 * 4 * HP_QC) // float4 of the staged chunk at N = 4

// The N streams' float4 at column q of token row xt.
template <int NN>
__device__ __forceinline__ void hp_load(const float4* xt, int D4, int q, float4 (&v)[NN]) {
#pragma unroll
    for (int i = 0; i < NN; i++) v[i] = xt[i * D4 + q];
}

template <int NN>
__device__ __forceinline__ void hp_mix(const float* x, const u8* __restrict__ mixer, long long row_bytes,
                                       int wty, double* __restrict__ part, int n, int D, int S, int per, float4* w_s) {
    constexpr int MIX = (2 + NN) * NN, L = HP_L;
    const int s = blockIdx.x % S, tid = threadIdx.x, sub = tid % L;
    const int t = (blockIdx.x / S) * (HP_T / L) + tid / L;
    const bool live = t < n;
    const int D4 = D >> 2, lo = s * per, hi = min(D4, lo + per);
    const float4* xt = (const float4*)(x + (size_t)(live ? t : 0) * NN * D);
    float acc[MIX];
#pragma unroll
    for (int r = 0; r < MIX; r++) acc[r] = 0.0f;
    double ss = 0.0;
    float4 cv[NN];
    if (live && lo + sub < hi) hp_load<NN>(xt, D4, lo + sub, cv);
    for (int q0 = lo; q0 < hi; q0 += HP_QC) {
        const int qn = min(HP_QC, hi - q0);
        __syncthreads(); // the previous chunk's reads are done
        for (int e = tid; e < MIX * NN * HP_QC; e += HP_T) {
            const int qq = e % HP_QC, rj = e / HP_QC, r = rj / NN, j = rj % NN;
            if (qq < qn) w_s[e] = fu_w4(mixer + (size_t)r * row_bytes, j * D4 + q0 + qq, wty);
        }
        __syncthreads();
        for (int qq = sub; qq < qn; qq += L) { // this lane's columns q0 + sub + L·m
            const int q = q0 + qq;
            float4 nv[NN];
            if (live && q + L < hi) hp_load<NN>(xt, D4, q + L, nv); // in flight meanwhile
#pragma unroll
            for (int j = 0; j < NN; j++) {
                const float4 v = cv[j];
                ss += (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z +
                      (double)v.w * (double)v.w;
#pragma unroll
                for (int r = 0; r < MIX; r++) {
                    const float4 w = w_s[(r * NN + j) * HP_QC + qq]; // L addresses a warp: broadcasts
                    acc[r] += w.x * v.x + w.y * v.y + w.z * v.z + w.w * v.w;
                }
            }
#pragma unroll
            for (int j = 0; j < NN; j++) cv[j] = nv[j];
        }
    }
    // The token's L lanes (adjacent, in one warp) add their partials: xor sums, fixed order.
#pragma unroll
    for (int m = 1; m < L; m <<= 1) {
#pragma unroll
        for (int r = 0; r < MIX; r++) acc[r] += ds4_shfl_xor(acc[r], m);
        ss += ds4_shfl_xor(ss, m);
    }
    if (!live || sub != 0) return;
    double* pt = part + ((size_t)t * S + s) * FU_PART;
#pragma unroll
    for (int r = 0; r < MIX; r++) pt[r] = (double)acc[r];
    pt[MIX] = ss;
}

// Mixer partials of the HC pre for n tokens (prefill): grid ceil(n / (HP_T / HP_L))·S CTAs of
// HP_T threads; split s = CTA % S takes float4 columns [s·per, min(D/4, (s+1)·per)) of each
// stream (S = ceil(D/4 / per)). Host: 1 <= N <= 4, D % 4 == 0, 16-byte aligned x; mixer rows
// (2+N)·N of row_bytes (8-byte aligned for f16/bf16, 16 for f32); part holds n·S·FU_PART doubles.
DS4_KERNEL void DS4_BOUNDS(HP_T) hcp_mix(const float* x, const u8* __restrict__ mixer, long long row_bytes, int wty, double* __restrict__ part, int n, int N, int D, int S, int per) {
    ds4_pdl_enter();
    __shared__ float4 ws[HP_WS]; // the staged mixer chunk: w_s[(r·N + j)·HP_QC + qq]
    switch (N) {
    case 1: hp_mix<1>(x, mixer, row_bytes, wty, part, n, D, S, per, ws); break;
    case 2: hp_mix<2>(x, mixer, row_bytes, wty, part, n, D, S, per, ws); break;
    case 3: hp_mix<3>(x, mixer, row_bytes, wty, part, n, D, S, per, ws); break;
    default: hp_mix<4>(x, mixer, row_bytes, wty, part, n, D, S, per, ws); break;
    }
}

// hcp_mix on tensor cores (DS4_GPU_HCP_TC; CUDA sm_80+, N = 4, F16 or BF16 mixer: the 24 mixer
// rows are exact in tf32): the same partials (24 dots, Σx²) for part, read by hcp_finish.
// A warp takes 16 tokens (rows g = lane / 4 and g + 8 of mma.m16n8k8), a CTA HT_W warps, split
// s of S the float4 columns [s·per, (s+1)·per) of every stream, in chunks of 4 float4 columns
// (16 values; all N streams' loads of a chunk in flight together): lane (g, t) loads float4
// column t of the chunk for both its tokens (a token row's 64 bytes by 4 lanes) and the
// mixer's float4 at the same column for rows r = 8·nt + g (nt < 3: the B fragments, n = mixer
// row; read through L1). The K order inside a chunk is permuted (mma k t <- value 4t + 2h,
// k t + 4 <- 4t + 2h + 1 in step h; the same map for A and B), so a float4 feeds two k8 steps
// with no shuffles. X = hi + lo, two tf32 terms (hi = tf32(x), lo = tf32(x - hi): ~2^-22 of x
// left out), each an mma into the same f32 accumulators; Σx² in f64 from the same registers.
// POST (hcp_post_mix_tc): the HC post first, X' = post_j·o + Σ_i comb[i][j]·X[i] with
// hc_post_fast's operations (the same bits), X' stored in place and mixed: the post's own
// launch and one read of X' go (the earlier fused post, hcp_post_mix with 1-2 lanes a token,
// lost to its 16-32-byte stores; here 4 lanes store a row's 64 bytes).
// Arithmetic differs from hcp_mix (the dots summed by the tensor cores, f32 accumulation per
// split, X to ~22 bits): tests/ops_mix.rs hc_prefill_precision holds both to the CPU.
#define HT_W 4 // warps of a hcp_mix_tc CTA (16 tokens each)
#if defined(DS4_CUDA) && DS4_ARCH >= 800
// mma.sync m16n8k8 tf32 x tf32 with f32 accumulators c[0..3] += A (a0..a3) * B (b0, b1). (Here,
// not in ptx.cuh: every header is part of every module's kernel cache key.)
__device__ __forceinline__ void ds4_mma_tf32(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// f32 -> tf32 (nearest, ties away; the low 13 bits zero), as the b32 mma operand.
__device__ __forceinline__ u32 ds4_tf32(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}
#endif
#if defined(DS4_CUDA) && DS4_ARCH >= 800
// A float4 load that asks L2 to fetch the whole 256-byte block around it (PTX L2::256B): the
// lane's next three chunks of a row segment then come from L2 instead of DRAM (hp_mix_tc PF).
__device__ __forceinline__ float4 fu_ld_pf(const float4* p) {
    float4 r;
    asm volatile("ld.global.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}
#endif
// PF (hcp_post_mix_tc4p): X and o loaded by fu_ld_pf (same values, same bits).
template <bool POST, bool PF = false>
__device__ __forceinline__ void hp_mix_tc(float* x, const float* __restrict__ o, const float* __restrict__ post,
                                          const float* __restrict__ comb, const u8* __restrict__ mixer, long long row_bytes,
                                          int wty, double* __restrict__ part, int n, int D, int S, int per) {
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    constexpr int NN = 4, MIX = (2 + NN) * NN, NT = MIX / 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const int s = blockIdx.x % S;
    const int t0 = (blockIdx.x / S) * (HT_W * 16) + (threadIdx.x >> 5) * 16;
    const int tk[2] = {t0 + g, t0 + g + 8};
    const bool live[2] = {tk[0] < n, tk[1] < n};
    const int D4 = D >> 2, lo = s * per, hi = min(D4, lo + per);
    float4* xr[2];
    const float4* orow[2];
    float pj[2][NN], cij[2][NN][NN];
#pragma unroll
    for (int m = 0; m < 2; m++) {
        const size_t t = live[m] ? tk[m] : 0;
        xr[m] = (float4*)(x + t * NN * D);
        orow[m] = (const float4*)(o + (POST ? t * D : 0));
        if (POST) {
#pragma unroll
            for (int i = 0; i < NN; i++) {
                pj[m][i] = post[t * NN + i];
#pragma unroll
                for (int j = 0; j < NN; j++) cij[m][i][j] = comb[t * NN * NN + i * NN + j];
            }
        }
    }
    float c[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
    double ss[2] = {0.0, 0.0};
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int q0 = lo + tg; q0 < hi; q0 += 4) { // this lane's float4 column of each chunk (host: (hi - lo) % 4 == 0)
        float4 v[2][NN], ov[2];
#pragma unroll
        for (int m = 0; m < 2; m++) { // the chunk's loads first
#pragma unroll
            for (int j = 0; j < NN; j++) v[m][j] = live[m] ? (PF ? fu_ld_pf(xr[m] + j * D4 + q0) : xr[m][j * D4 + q0]) : zero;
            if (POST) ov[m] = live[m] ? (PF ? fu_ld_pf(orow[m] + q0) : orow[m][q0]) : zero;
        }
        if (POST) {
#pragma unroll
            for (int m = 0; m < 2; m++) {
                float4 old[NN];
#pragma unroll
                for (int i = 0; i < NN; i++) old[i] = v[m][i];
#pragma unroll
                for (int j = 0; j < NN; j++) { // X'[j] = post_j o + sum_i A[i][j] X[i], serial in i (hc_post_fast)
                    const float p = pj[m][j];
                    float4 w = make_float4(ds4_mul_rn(p, ov[m].x), ds4_mul_rn(p, ov[m].y), ds4_mul_rn(p, ov[m].z), ds4_mul_rn(p, ov[m].w));
#pragma unroll
                    for (int i = 0; i < NN; i++) {
                        const float a = cij[m][i][j];
                        w.x = w.x + ds4_mul_rn(a, old[i].x);
                        w.y = w.y + ds4_mul_rn(a, old[i].y);
                        w.z = w.z + ds4_mul_rn(a, old[i].z);
                        w.w = w.w + ds4_mul_rn(a, old[i].w);
                    }
                    v[m][j] = w;
                    if (live[m]) xr[m][j * D4 + q0] = w;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NN; j++) {
            const int q = j * D4 + q0;
            float4 w[NT];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) w[nt] = fu_w4(mixer + (size_t)(nt * 8 + g) * row_bytes, q, wty);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const float4 a = v[m][j];
                ss[m] += (double)a.x * (double)a.x + (double)a.y * (double)a.y + (double)a.z * (double)a.z + (double)a.w * (double)a.w;
            }
#pragma unroll
            for (int h = 0; h < 2; h++) { // k8 step h: values 4t + 2h (k t) and 4t + 2h + 1 (k t + 4)
                const float a0 = h ? v[0][j].z : v[0][j].x, a1 = h ? v[0][j].w : v[0][j].y;
                const float b0 = h ? v[1][j].z : v[1][j].x, b1 = h ? v[1][j].w : v[1][j].y;
                const u32 ha0 = ds4_tf32(a0), ha1 = ds4_tf32(a1), hb0 = ds4_tf32(b0), hb1 = ds4_tf32(b1);
                const u32 la0 = ds4_tf32(a0 - __uint_as_float(ha0)), la1 = ds4_tf32(a1 - __uint_as_float(ha1));
                const u32 lb0 = ds4_tf32(b0 - __uint_as_float(hb0)), lb1 = ds4_tf32(b1 - __uint_as_float(hb1));
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const u32 w0 = __float_as_uint(h ? w[nt].z : w[nt].x), w1 = __float_as_uint(h ? w[nt].w : w[nt].y);
                    // A rows: g (token tk[0]), g + 8 (token tk[1]); the low term first.
                    ds4_mma_tf32(c[nt], la0, lb0, la1, lb1, w0, w1);
                    ds4_mma_tf32(c[nt], ha0, hb0, ha1, hb1, w0, w1);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < 2; m++) { // Σx² over the quad (the 4 lanes of a token pair), fixed order
        ss[m] += ds4_shfl_xor(ss[m], 1);
        ss[m] += ds4_shfl_xor(ss[m], 2);
    }
    // C: c[nt][0..1] token tk[0], mixer rows 8nt + 2t, + 1; c[nt][2..3] token tk[1].
#pragma unroll
    for (int m = 0; m < 2; m++) {
        if (!live[m]) continue;
        double* pt = part + ((size_t)tk[m] * S + s) * FU_PART;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            pt[nt * 8 + 2 * tg] = (double)c[nt][2 * m];
            pt[nt * 8 + 2 * tg + 1] = (double)c[nt][2 * m + 1];
        }
        if (tg == 0) pt[MIX] = ss[m];
    }
#endif
}

// Grid ceil(n / (16·HT_W))·S CTAs of 32·HT_W threads (split s = CTA % S, float4 columns
// [s·per, min(D/4, (s+1)·per)) of each stream); hcp_mix's arguments. Host: CUDA sm_80+, N = 4
// (the argument is not read), wty 1 or 2, D % 16
// == 0, per % 4 == 0, 16-byte aligned x (and o); part holds n·S·FU_PART doubles.
DS4_KERNEL void DS4_BOUNDS(HT_W * 32) hcp_mix_tc(const float* x, const u8* __restrict__ mixer, long long row_bytes, int wty, double* __restrict__ part, int n, int N, int D, int S, int per) {
    ds4_pdl_enter();
    hp_mix_tc<false>((float*)x, nullptr, nullptr, nullptr, mixer, row_bytes, wty, part, n, D, S, per);
}

// hcp_mix_tc after the HC post of (o [n, D], post [n, N], comb [n, N·N]) into x, in place.
DS4_KERNEL void DS4_BOUNDS(HT_W * 32) hcp_post_mix_tc(float* x, const float* __restrict__ o, const float* __restrict__ post, const float* __restrict__ comb, const u8* __restrict__ mixer, long long row_bytes, int wty, double* __restrict__ part, int n, int N, int D, int S, int per) {
    ds4_pdl_enter();
    hp_mix_tc<true>(x, o, post, comb, mixer, row_bytes, wty, part, n, D, S, per);
}
// The same kernel held to 128 registers (4 CTAs an SM, the occupancy the host's splits aim at;
// unbounded, ptxas takes 157 on sm_90a: 3 CTAs an SM, and a 2k prompt's 512 CTAs take 1.3 waves).
// ncu (H200, 2k prompt): 137 us at 2.1 TB/s, 78% of its stalls on global loads, 4 warps a
// scheduler. Lost (session 31, code in 0ba4675): the lane's next chunk staged by cp.async into
// 40 KB of shared memory a CTA (no spills, the same bits) took 194-198 us: the shared memory
// leaves L1 too small for the mixer rows it rereads (bench/results/gpu-s31-h200.txt run G).
#define HT_LB4 HT_W * 32, 4
DS4_KERNEL void DS4_BOUNDS(HT_LB4) hcp_post_mix_tc4(float* x, const float* __restrict__ o, const float* __restrict__ post, const float* __restrict__ comb, const u8* __restrict__ mixer, long long row_bytes, int wty, double* __restrict__ part, int n, int N, int D, int S, int per) {
    ds4_pdl_enter();
    hp_mix_tc<true>(x, o, post, comb, mixer, row_bytes, wty, part, n, D, S, per);
}
// hcp_post_mix_tc4 with X and o loaded by fu_ld_pf (256-byte L2 fetches; the default,
// DS4_GPU_HCP_PF=off the plain loads): the same bits. H200, a 2k prompt (ncu): 123-128 against
// 134-138 us a call (DRAM reads 169 -> 218 MB: blocks past a split's end are fetched too, yet
// the lane's next chunks wait on L2, not DRAM; ptxas also drops the 40-byte spill), prefill
// +0.3% at 2k / 8k / 32k in alternating runs (bench/results/gpu-s31-h200.txt run H).
DS4_KERNEL void DS4_BOUNDS(HT_LB4) hcp_post_mix_tc4p(float* x, const float* __restrict__ o, const float* __restrict__ post, const float* __restrict__ comb, const u8* __restrict__ mixer, long long row_bytes, int wty, double* __restrict__ part, int n, int N, int D, int S, int per) {
    ds4_pdl_enter();
    hp_mix_tc<true, true>(x, o, post, comb, mixer, row_bytes, wty, part, n, D, S, per);
}

template <int NN>
__device__ __forceinline__ void hp_finish(const float* __restrict__ x, const double* __restrict__ part,
                                          const float* __restrict__ scale, const float* __restrict__ base,
                                          const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post,
                                          float* __restrict__ comb, int D, int S, int iters, float hc_eps, float eps,
                                          int keep) {
    constexpr int MIX = (2 + NN) * NN;
    __shared__ double dsum[MIX + 1];
    const int t = blockIdx.x, tid = threadIdx.x;
    if (tid <= MIX) { // the splits' partials in split order
        const double* pt = part + (size_t)t * S * FU_PART + tid;
        double v = 0.0;
        for (int s = 0; s < S; s++) v += pt[(size_t)s * FU_PART];
        dsum[tid] = v;
    }
    __syncthreads();
    const float4* xt = (const float4*)(x + (size_t)t * NN * D);
    if (keep) fu_finish_keep<NN, 3>(dsum, xt, scale, base, norm, z, post, comb, t, D, iters, hc_eps, eps);
    else fu_finish<NN, false>(dsum, xt, scale, base, norm, z, post, comb, t, D, iters, hc_eps, eps);
}

// The HC pre's epilogue after hcp_mix: grid n CTAs (a token each), blockDim a multiple of
// DS4_WARP, >= 2 warps, <= 256 (the host: 256; bounded so that fu_finish_keep's columns fit in
// registers without spills); keep: fu_finish_keep (DS4_GPU_HCP_KEEP), else fu_finish; x as the
// mix read it, part from it; outputs z [n, D] (normalised by norm), post [n, N], comb [n, N·N] as
// hc_pre_norm_f32.
// Host: 16-byte aligned x, z, norm.
DS4_KERNEL void DS4_BOUNDS(256) hcp_finish(const float* __restrict__ x, const double* __restrict__ part, const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm, float* __restrict__ z, float* __restrict__ post, float* __restrict__ comb, int N, int D, int S, int iters, float hc_eps, float eps, int keep) {
    ds4_pdl_enter();
    switch (N) {
    case 1: hp_finish<1>(x, part, scale, base, norm, z, post, comb, D, S, iters, hc_eps, eps, keep); break;
    case 2: hp_finish<2>(x, part, scale, base, norm, z, post, comb, D, S, iters, hc_eps, eps, keep); break;
    case 3: hp_finish<3>(x, part, scale, base, norm, z, post, comb, D, S, iters, hc_eps, eps, keep); break;
    default: hp_finish<4>(x, part, scale, base, norm, z, post, comb, D, S, iters, hc_eps, eps, keep); break;
    }
}
