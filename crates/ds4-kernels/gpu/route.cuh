// Router helpers shared by model.cu (moe_route, moe_route_fast) and matvec.cu (mvq_route_f16: the
// router product and the route in one launch). The CPU reference is ds4-cpu backend.rs moe_route.
#pragma once
#include "prelude.cuh"
// hc.cuh: ds4_expf_cr, ds4_log1pf_cr (f32 exp / log1p rounded once from f64)
#include "hc.cuh"

#define DS4_ROUTE_MAX_E 1024 // most experts the router supports
#define DS4_ROUTE_MAX_K 32   // most experts used per token

// f32 -> i32 whose signed order is Rust's f32::total_cmp order.
__device__ __forceinline__ int ds4_total_key(float f) {
    int i = __float_as_int(f);
    return i ^ (int)(((u32)(i >> 31)) >> 1);
}

// v from lane src of this warp: an indexed shuffle spelled as a butterfly whose mask differs per
// lane (lane ^ (lane ^ src) = src). src < DS4_WARP; every lane of the warp must call it.
__device__ __forceinline__ float ds4_shfl_from(float v, int src) {
    return ds4_shfl_xor(v, (int)(threadIdx.x % DS4_WARP) ^ src);
}

// sqrt(softplus(v)), as moe_route computes p_e.
__device__ __forceinline__ float ds4_route_p(float v) {
    float sp = v > 20.0f ? v : ds4_log1pf_cr(ds4_expf_cr(v));
    return sqrtf(sp);
}

// Weights of one token's k experts: lane j < k holds expert e and its p_e (slot j). Every lane
// of the warp must enter. Sum serial in slot order like the CPU.
__device__ __forceinline__ void ds4_route_finish(float pe, int e, int* __restrict__ sel_t, float* __restrict__ wgt_t, int k, float weight_scale) {
    const int lane = threadIdx.x % DS4_WARP;
    float s = 0.0f;
    for (int j = 0; j < k; j++) s += ds4_shfl_from(pe, j);
    const float denom = fmaxf(s, 6.103515625e-05f); // 2^-14
    if (lane < k) {
        sel_t[lane] = e;
        wgt_t[lane] = pe / denom * weight_scale;
    }
}

// Logit e: a plain load, or (CG) one through L2 for logits other CTAs of this launch stored
// (after their fence and this CTA's ticket; CUDA ld.global.cg, HIP volatile).
template <bool CG> __device__ __forceinline__ float ds4_route_logit(const float* lg, int e) {
    if (!CG) return lg[e];
#if defined(DS4_CUDA)
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(lg + e));
    return r;
#else
    return *(const volatile float*)(lg + e);
#endif
}

// One token's route, latency form (moe_route_fast; mvq_route_f16's last CTA). lg: the token's
// ne logits; tok: its id (read on hash layers only). All threads compute p_e and the packed key
// (total-order key, then ~e so that ties go to the lower id) into shared memory, then warp 0 takes
// the k largest in k rounds of a warp max (round j: the largest key below the previous round's).
// Hash layers use warp 0 only. k <= DS4_ROUTE_MAX_K <= DS4_WARP, ne <= DS4_ROUTE_MAX_E. Every
// thread of the CTA must enter (one barrier); the function is the end of the kernel.
template <bool CG>
__device__ __forceinline__ void ds4_route_token(const float* lg, const float* __restrict__ bias, const int* __restrict__ tid2eid, const int* __restrict__ tok, int* __restrict__ sel_t, float* __restrict__ wgt_t, int ne, int k, float weight_scale) {
    __shared__ float p[DS4_ROUTE_MAX_E];
    __shared__ u64 key[DS4_ROUTE_MAX_E];
    const int tid = threadIdx.x, lane = tid % DS4_WARP;
    if (tid2eid) { // hash layer: slot j = tid2eid[tok][j], on lane j
        if (tid >= DS4_WARP) return;
        const int e = lane < k ? tid2eid[(size_t)tok[0] * k + lane] : 0;
        const float pe = lane < k ? ds4_route_p(ds4_route_logit<CG>(lg, e)) : 0.0f;
        ds4_route_finish(pe, e, sel_t, wgt_t, k, weight_scale);
        return;
    }
    for (int e = tid; e < ne; e += blockDim.x) {
        const float pe = ds4_route_p(ds4_route_logit<CG>(lg, e));
        p[e] = pe;
        const u32 hi = (u32)ds4_total_key(pe + bias[e]) ^ 0x80000000u; // signed -> unsigned order
        key[e] = ((u64)hi << 32) | (u64)(~(u32)e);                      // never 0: ~e != 0
    }
    __syncthreads();
    if (tid >= DS4_WARP) return;
    u64 prev = 0;
    int mine = 0;
    for (int j = 0; j < k; j++) {
        u64 best = 0; // keys are distinct, so "below the previous" skips exactly the taken ones
        for (int e = lane; e < ne; e += DS4_WARP) {
            const u64 v = key[e];
            if ((j == 0 || v < prev) && v > best) best = v;
        }
#pragma unroll
        for (int o = DS4_WARP / 2; o > 0; o >>= 1) {
            const u64 other = ds4_shfl_xor(best, o);
            best = other > best ? other : best;
        }
        prev = best;
        if (lane == j) mine = (int)~(u32)best;
    }
    ds4_route_finish(lane < k ? p[mine] : 0.0f, mine, sel_t, wgt_t, k, weight_scale);
}

// Bias values of the experts e = threadIdx.x + i * blockDim.x (i < NB) for ds4_route_token_rank,
// 0 past ne or without a bias (hash layers). A weight: may be read before the PDL wait.
template <int NB> __device__ __forceinline__ void ds4_route_bias(const float* __restrict__ bias, int ne, float (&bv)[NB]) {
#pragma unroll
    for (int i = 0; i < NB; i++) {
        const int e = threadIdx.x + i * blockDim.x;
        bv[i] = bias && e < ne ? bias[e] : 0.0f;
    }
}

// ds4_route_token (the same selections, slots and weights, bit for bit) with the top k by ranks
// instead of k rounds of a warp max, and the bias values bv already in registers
// (ds4_route_bias; NB * blockDim.x >= ne). Keys (distinct, never 0) in groups of DS4_WARP
// experts, group g = experts g * DS4_WARP .. (key 0 past ne) held by warp g % nwarps, lane e %
// DS4_WARP: each lane counts the keys of its group above its own (broadcast shared reads); count
// c < k: the group's c-th largest, candidate slot g * k + c (slots of absent ranks: 0). Then each
// candidate counts the candidates above it: count c < k is the c-th largest overall, which is the
// key round c of ds4_route_token picks (every key of the top k is in its group's top k). ne >= k
// keys above 0, so no 0 candidate ranks below k. Every thread of the CTA must enter (two
// barriers); the function is the end of the kernel.
template <bool CG, int NB>
__device__ __forceinline__ void ds4_route_token_rank(const float* lg, const float (&bv)[NB], const int* __restrict__ tid2eid, const int* __restrict__ tok, int* __restrict__ sel_t, float* __restrict__ wgt_t, int ne, int k, float weight_scale) {
    __shared__ float p[DS4_ROUTE_MAX_E];
    __shared__ u64 key[DS4_ROUTE_MAX_E];
    __shared__ u64 cand[DS4_ROUTE_MAX_E];
    __shared__ int top_e[DS4_ROUTE_MAX_K];
    const int tid = threadIdx.x, lane = tid % DS4_WARP;
    if (tid2eid) { // hash layer: as ds4_route_token
        if (tid >= DS4_WARP) return;
        const int e = lane < k ? tid2eid[(size_t)tok[0] * k + lane] : 0;
        const float pe = lane < k ? ds4_route_p(ds4_route_logit<CG>(lg, e)) : 0.0f;
        ds4_route_finish(pe, e, sel_t, wgt_t, k, weight_scale);
        return;
    }
    const int groups = (ne + DS4_WARP - 1) / DS4_WARP;
    // Thread tid holds experts tid + i * blockDim.x: group (tid + i * blockDim.x) / DS4_WARP, one
    // of its own warp's (blockDim.x is a multiple of DS4_WARP), so a warp ranks the groups whose
    // keys it stored itself (a __syncwarp, no CTA barrier).
#pragma unroll
    for (int i = 0; i < NB; i++) {
        const int e = tid + i * blockDim.x;
        if (e < groups * DS4_WARP) {
            u64 kv = 0;
            if (e < ne) {
                const float pe = ds4_route_p(ds4_route_logit<CG>(lg, e));
                p[e] = pe;
                const u32 hi = (u32)ds4_total_key(pe + bv[i]) ^ 0x80000000u;
                kv = ((u64)hi << 32) | (u64)(~(u32)e);
            }
            key[e] = kv;
        }
    }
    ds4_syncwarp();
#pragma unroll
    for (int i = 0; i < NB; i++) {
        const int e = tid + i * blockDim.x, g = e / DS4_WARP;
        if (g < groups) { // warp-uniform
            const u64 mine = key[e];
            const u64* kg = key + g * DS4_WARP;
            int c = 0;
#pragma unroll 8
            for (int j = 0; j < DS4_WARP; j++) c += kg[j] > mine;
            const int nv = min(DS4_WARP, ne - g * DS4_WARP); // valid keys of the group: ranks 0..nv-1
            if (lane < nv && c < k) cand[g * k + c] = mine;
            if (lane >= nv && lane < k) cand[g * k + lane] = 0; // ranks the group lacks
        }
    }
    __syncthreads();
    const int nc = groups * k;
    for (int t = tid; t < nc; t += blockDim.x) {
        const u64 mine = cand[t];
        int c = 0;
        for (int j = 0; j < nc; j++) c += cand[j] > mine;
        if (c < k) top_e[c] = (int)~(u32)mine;
    }
    __syncthreads();
    if (tid >= DS4_WARP) return;
    const int e = lane < k ? top_e[lane] : 0;
    ds4_route_finish(lane < k ? p[e] : 0.0f, e, sel_t, wgt_t, k, weight_scale);
}
