// Token sampling on the device: a decode step returns one token id instead of the logits.
// Semantics: ds4-backend sample.rs `select` (candidates in total order of the logit, ties: lower
// id first; top-k, weights exp(f64((l - max) / T)), min-p, top-p, then the pick with the host's
// draw u). No sort: every "first n in order" or "first prefix whose mass reaches t" is found by
// a radix select over the 32-bit order key (8 bits a pass, block-wide counts and masses), then
// over the id among equal logits. Masses are fixed point (p · 2^60 in u64): sums are exact and
// independent of the order of the atomics, so a run is deterministic.
#include "prelude.cuh"

// Total order of f32 as Rust's total_cmp: larger key = later in that order.
__device__ __forceinline__ u32 sm_key(float v) {
    u32 b = (u32)__float_as_int(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sm_unkey(u32 k) {
    return __int_as_float((int)((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k));
}

// (v, i) becomes the better of itself and (w, j): larger value, lower id on ties. NaN never wins
// (the host's `>` scan keeps the first maximum and skips NaN past index 0).
__device__ __forceinline__ void sm_better(float& v, u32& i, float w, u32 j) {
    if (w > v || (w == v && j < i)) {
        v = w;
        i = j;
    }
}

// Block-wide better-of; every thread gets the result. sv/si: one slot per warp.
__device__ __forceinline__ void sm_block_best(float& v, u32& i, float* sv, u32* si) {
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) {
        float w = ds4_shfl_xor(v, o);
        u32 j = ds4_shfl_xor(i, o);
        sm_better(v, i, w, j);
    }
    const int lane = threadIdx.x % DS4_WARP, wid = threadIdx.x / DS4_WARP;
    if (lane == 0) {
        sv[wid] = v;
        si[wid] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x / DS4_WARP); k++) sm_better(sv[0], si[0], sv[k], si[k]);
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// Greedy: argmax of x[0..n) (lowest id on ties) over the grid; the last CTA to finish reduces
// the per-CTA results (part_v/part_i, gridDim entries) and writes out[0]. ticket: 0 on entry,
// 0 again on exit.
DS4_KERNEL void DS4_BOUNDS(256) sample_argmax(const float* __restrict__ x, int n, float* part_v, u32* part_i, u32* ticket, u32* out) {
    __shared__ float sv[256 / 32];
    __shared__ u32 si[256 / 32];
    __shared__ int last;
    float v = DS4_NEG_INF;
    u32 i = 0xffffffffu;
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) sm_better(v, i, x[k], (u32)k);
    sm_block_best(v, i, sv, si);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
        __threadfence(); // the partial is visible device-wide before the ticket
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    v = DS4_NEG_INF;
    i = 0xffffffffu;
    for (int k = threadIdx.x; k < (int)gridDim.x; k += blockDim.x)
        sm_better(v, i, ((volatile float*)part_v)[k], ((volatile u32*)part_i)[k]);
    sm_block_best(v, i, sv, si);
    if (threadIdx.x == 0) {
        out[0] = i == 0xffffffffu ? 0u : i; // all NaN: 0, as the host
        *ticket = 0u;
    }
}

#define SP_THREADS 1024
#define SP_ONE 1152921504606846976.0 // 2^60: fixed-point unit of probability

__device__ __forceinline__ u64 sp_q(double p) { return (u64)(p * SP_ONE); }

// Element (key k, id i) is in the set "first elements in order up to (K, I)".
__device__ __forceinline__ bool sp_in(u32 k, u32 i, u32 K, u32 I) { return k > K || (k == K && i <= I); }

struct SpShared {
    u32 cnt[256];
    u64 mass[256];
    u32 pick;
    u64 target;
    u32 u32v;
    u64 u64v;
    double red[SP_THREADS / 32];
};

// Among the elements of the set (K0, I0), in order: the first at which the running weight
// reaches `target` (weight 1 each when p is null: the target-th element; else p·2^60), or the
// set's last when it never does. Returns its key and id (K, I); all threads must call.
__device__ void sp_select(const float* __restrict__ x, const double* p, int n, u32 K0, u32 I0, u64 target, SpShared& s, u32& K, u32& I) {
    const int t = threadIdx.x;
    u32 prefix = 0, mask = 0;
    u64 tgt = target;
    u32 bin = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = t; b < 256; b += blockDim.x) {
            s.cnt[b] = 0;
            s.mass[b] = 0;
        }
        __syncthreads();
        // Runs of one bin are summed in registers first: most logits share the high bytes,
        // and a shared atomic per element on one address serialises the CTA.
        u32 rb = 0xffffffffu, rc = 0;
        u64 rm = 0;
        for (int i = t; i < n; i += blockDim.x) {
            const u32 k = sm_key(x[i]);
            if ((k & mask) == prefix && sp_in(k, (u32)i, K0, I0)) {
                const u32 d = (k >> shift) & 255u;
                if (d != rb) {
                    if (rc) {
                        atomicAdd(&s.cnt[rb], rc);
                        atomicAdd(&s.mass[rb], rm);
                    }
                    rb = d;
                    rc = 0;
                    rm = 0;
                }
                rc++;
                rm += p ? sp_q(p[i]) : 1ull;
            }
        }
        if (rc) {
            atomicAdd(&s.cnt[rb], rc);
            atomicAdd(&s.mass[rb], rm);
        }
        __syncthreads();
        if (t == 0) {
            // Bins from the largest key down; `tgt` becomes the target inside the chosen bin.
            u64 off = 0;
            int chosen = -1, lowest = 0;
            for (int b = 255; b >= 0; b--) {
                if (s.cnt[b] == 0) continue;
                lowest = b;
                if (off + s.mass[b] >= tgt) {
                    chosen = b;
                    break;
                }
                off += s.mass[b];
            }
            if (chosen < 0) {
                chosen = lowest; // never reached: the last one (tgt stays unreachable)
                tgt = ~0ull;
            } else if (tgt != ~0ull) {
                tgt -= off;
            }
            s.pick = (u32)chosen;
            s.target = tgt;
        }
        __syncthreads();
        bin = s.pick;
        tgt = s.target;
        prefix |= bin << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    K = prefix;
    // Ties of key K in the set, ascending id, each of weight w: the j-th reaches the target.
    const u32 c = s.cnt[bin];
    const u64 w = s.mass[bin] / c;
    u64 j = tgt == ~0ull ? c : (w == 0 ? 1 : tgt / w + (tgt % w != 0));
    j = j < 1 ? 1 : (j > c ? c : j);
    __syncthreads();
    if (j == c) { // the last tie (the only one, usually): the largest id
        if (t == 0) s.u32v = 0;
        __syncthreads();
        u32 hi = 0;
        bool any = false;
        for (int i = t; i < n; i += blockDim.x) {
            const u32 k = sm_key(x[i]);
            if (k == K && sp_in(k, (u32)i, K0, I0)) {
                hi = (u32)i; // ascending in this thread
                any = true;
            }
        }
        if (any) atomicMax(&s.u32v, hi);
        __syncthreads();
        I = s.u32v;
        __syncthreads();
        return;
    }
    // The j-th smallest id by radix over the id (n < 2^24).
    u32 ip = 0, im = 0;
    u32 need = (u32)j;
    for (int shift = 16; shift >= 0; shift -= 8) {
        for (int b = t; b < 256; b += blockDim.x) s.cnt[b] = 0;
        __syncthreads();
        u32 rb = 0xffffffffu, rc = 0; // runs, as above (all-equal logits: every id is a tie)
        for (int i = t; i < n; i += blockDim.x) {
            const u32 k = sm_key(x[i]);
            if (k == K && ((u32)i & im) == ip && sp_in(k, (u32)i, K0, I0)) {
                const u32 d = ((u32)i >> shift) & 255u;
                if (d != rb) {
                    if (rc) atomicAdd(&s.cnt[rb], rc);
                    rb = d;
                    rc = 0;
                }
                rc++;
            }
        }
        if (rc) atomicAdd(&s.cnt[rb], rc);
        __syncthreads();
        if (t == 0) {
            u32 acc = 0;
            int b = 0;
            for (; b < 255; b++) {
                if (acc + s.cnt[b] >= need) break;
                acc += s.cnt[b];
            }
            s.pick = (u32)b;
            s.u32v = need - acc;
        }
        __syncthreads();
        ip |= s.pick << shift;
        im |= 255u << shift;
        need = s.u32v;
        __syncthreads();
    }
    I = ip;
}

// Block-wide f64 sum in a fixed order (deterministic); every thread gets it.
__device__ __forceinline__ double sp_sum(double v, SpShared& s) {
    v = ds4_warp_sum_f64(v);
    const int lane = threadIdx.x % DS4_WARP, wid = threadIdx.x / DS4_WARP;
    if (lane == 0) s.red[wid] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0;
        for (int k = 0; k < (int)(blockDim.x / DS4_WARP); k++) a += s.red[k];
        s.red[0] = a;
    }
    __syncthreads();
    v = s.red[0];
    __syncthreads();
    return v;
}

// Temperature sampling (temp > 0, top_k != 1) of x[0..n) with the host's draw u (f64 bits):
// one CTA of SP_THREADS; p: n f64 of scratch. Writes the token id to out[0].
DS4_KERNEL void DS4_BOUNDS(1024) sample_pick(const float* __restrict__ x, int n, double* p, float temp, int top_k, float top_p, float min_p, long long u_bits, u32* out) {
    __shared__ SpShared s;
    const int t = threadIdx.x;
    // The first candidate: the largest key (lowest id among equals); m = its logit.
    if (t == 0) s.u64v = 0;
    __syncthreads();
    {
        u64 best = 0;
        for (int i = t; i < n; i += blockDim.x) {
            const u64 v = ((u64)sm_key(x[i]) << 32) | (u64)(0xffffffffu - (u32)i);
            best = v > best ? v : best;
        }
        atomicMax(&s.u64v, best);
    }
    __syncthreads();
    const u32 kmax = (u32)(s.u64v >> 32);
    const float m = sm_unkey(kmax);
    __syncthreads();
    // Top-k: the set is the first k (else everything).
    u32 K0 = 0, I0 = 0xffffffffu;
    u32 size = (u32)n;
    if (top_k > 0 && top_k < n) {
        sp_select(x, nullptr, n, 0, 0xffffffffu, (u64)top_k, s, K0, I0);
        size = (u32)top_k;
    }
    // Weights over the set, their total, then probabilities (the host's f32 then f64 steps).
    double acc = 0.0;
    for (int i = t; i < n; i += blockDim.x) {
        double w = 0.0;
        const float xi = x[i];
        if (sp_in(sm_key(xi), (u32)i, K0, I0)) w = exp((double)__fdiv_rn(__fsub_rn(xi, m), temp));
        p[i] = w;
        acc += w;
    }
    const double total = sp_sum(acc, s);
    if (t == 0) s.u32v = 0;
    __syncthreads();
    // min-p floor = p_best · min_p, p_best = exp(0) / total.
    const double floor = (1.0 / total) * (double)min_p;
    u32 kept = 0;
    for (int i = t; i < n; i += blockDim.x) {
        const double pi = p[i] / total;
        p[i] = pi; // same thread, same index in every pass: no fence needed
        if (min_p > 0.0f && pi >= floor && sp_in(sm_key(x[i]), (u32)i, K0, I0)) kept++;
    }
    if (min_p > 0.0f) atomicAdd(&s.u32v, kept);
    __syncthreads();
    if (min_p > 0.0f) {
        u32 k = s.u32v < 1 ? 1 : s.u32v;
        if (k < size) {
            sp_select(x, nullptr, n, K0, I0, (u64)k, s, K0, I0);
            size = k;
        }
    }
    __syncthreads();
    // Top-p: the shortest prefix whose mass reaches top_p.
    if (top_p < 1.0f) sp_select(x, p, n, K0, I0, sp_q((double)top_p), s, K0, I0);
    // The pick: the first whose cumulative mass reaches u × (mass kept).
    if (t == 0) s.u64v = 0;
    __syncthreads();
    u64 part = 0;
    for (int i = t; i < n; i += blockDim.x)
        if (sp_in(sm_key(x[i]), (u32)i, K0, I0)) part += sp_q(p[i]);
    atomicAdd(&s.u64v, part);
    __syncthreads();
    const double u = __longlong_as_double(u_bits);
    const u64 target = (u64)(u * (double)s.u64v);
    __syncthreads();
    u32 K, I;
    sp_select(x, p, n, K0, I0, target, s, K, I);
    if (t == 0) out[0] = I;
}
