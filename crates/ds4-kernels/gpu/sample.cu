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
    ds4_pdl_enter();
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

// Temperature sampling (temp > 0, top_k != 1) of x[0..n) with the host's draw u (f64 bits)
// in one CTA of SP_THREADS (the whole block calls); p: n f64 of scratch. Writes the token id
// to out[0]. The fallback of sample_finish (a needed bin over SQ_CAP: many equal logits).
__device__ void sp_pick(const float* __restrict__ x, int n, double* p, float temp, int top_k, float top_p, float min_p, long long u_bits, u32* out) {
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

// The single-CTA form as a kernel (DS4_GPU_SAMPLE=onecta: the A/B baseline).
DS4_KERNEL void DS4_BOUNDS(1024) sample_pick(const float* __restrict__ x, int n, double* p, float temp, int top_k, float top_p, float min_p, long long u_bits, u32* out) {
    ds4_pdl_enter();
    sp_pick(x, n, p, temp, top_k, top_p, min_p, u_bits, out);
}

// ---- Multi-CTA temperature sampling: the same pick as sp_pick (and the host's select). ----
// Every element gets d = (l - m) / T (f32, as the host), its weight w = exp(f64(d)) and, in
// fixed point, q = w · 2^qshift (qshift = 63 - ceil(log2 n): any sum fits a u64, so sums are
// exact and order-free). Bins of d (SQ_SCALE per unit, the last bin takes d < -48.7, where q
// is 0) follow the candidates' order: bin b holds the b-th slice of the order, so counting
// and mass sums over bins locate every "first n" and "first whose cumulative mass reaches t"
// to one bin; only that bin's elements (typically tens) are ordered, by one CTA.
//   sample_top:     max key → m (grid + last CTA)
//   sample_hist:    per-bin count and mass, count of w ≥ min_p; last CTA: prefix sums
//   sample_scatter: element ids grouped by bin
//   sample_finish:  one CTA: top-k, min-p, top-p, the pick; a needed bin of more than SQ_CAP
//                   elements (many equal logits) falls back to sp_pick.
// Workspace ws (u32 words; the host zeroes [0, SQ_ZERO) before each pick):
#define SQ_NB 2048
#define SQ_CAP 2048
#define SQ_SCALE 42.0f
#define SQ_TICK1 0
#define SQ_TICK2 1
#define SQ_KMAX 2
#define SQ_CALL 3
#define SQ_CNT 4                          // NB u32
#define SQ_MASS (SQ_CNT + SQ_NB)          // NB u64 (even word offset)
#define SQ_ZERO (SQ_MASS + 2 * SQ_NB)     // 6148
#define SQ_START SQ_ZERO                  // NB u32: exclusive prefix of counts
#define SQ_CURSOR (SQ_START + SQ_NB)      // NB u32: scatter cursors
#define SQ_CMASS (SQ_CURSOR + SQ_NB)      // NB u64: exclusive prefix of masses (even offset)
#define SQ_PART (SQ_CMASS + 2 * SQ_NB)    // 1024 u32: per-CTA max keys
#define SQ_IDS (SQ_PART + 1024)           // n u32: ids by bin (15364)

__device__ __forceinline__ float sq_d(float xi, float m, float temp) { return __fdiv_rn(__fsub_rn(xi, m), temp); }
// Non-decreasing as d falls; NaN: the last bin.
__device__ __forceinline__ int sq_bin(float d) {
    const float f = -d * SQ_SCALE;
    return f < (float)(SQ_NB - 1) ? (int)f : SQ_NB - 1;
}
__device__ __forceinline__ u64 sq_q(float d, int qshift) {
    const double w = exp((double)d);
    return w >= 0.0 ? (u64)(w * (double)(1ull << qshift)) : 0ull; // NaN: 0
}

// Max order key of x over the grid (256 threads a CTA, gridDim ≤ 1024) → ws[SQ_KMAX].
DS4_KERNEL void DS4_BOUNDS(256) sample_top(const float* __restrict__ x, int n, u32* ws) {
    ds4_pdl_enter();
    ds4_pdl_enter();
    __shared__ u32 best;
    __shared__ int last;
    if (threadIdx.x == 0) best = 0;
    __syncthreads();
    u32 k = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 v = sm_key(x[i]);
        k = v > k ? v : k;
    }
    atomicMax(&best, k);
    __syncthreads();
    if (threadIdx.x == 0) {
        ws[SQ_PART + blockIdx.x] = best;
        __threadfence();
        last = atomicAdd(&ws[SQ_TICK1], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) best = 0;
    __syncthreads();
    k = 0;
    for (int j = threadIdx.x; j < (int)gridDim.x; j += blockDim.x) {
        const u32 v = ((volatile u32*)ws)[SQ_PART + j];
        k = v > k ? v : k;
    }
    atomicMax(&best, k);
    __syncthreads();
    if (threadIdx.x == 0) ws[SQ_KMAX] = best;
}

// Per-bin counts and masses, and how many have w ≥ min_p (256 threads a CTA). The last CTA
// writes the exclusive prefix sums (start = cursor, cmass).
DS4_KERNEL void DS4_BOUNDS(256) sample_hist(const float* __restrict__ x, int n, float temp, float min_p, int qshift, u32* ws) {
    ds4_pdl_enter();
    ds4_pdl_enter();
    __shared__ u32 hc[SQ_NB];
    __shared__ u64 hm[SQ_NB];
    __shared__ u32 tc[256];
    __shared__ u64 tm[256];
    __shared__ u32 kept;
    __shared__ int last;
    const int t = threadIdx.x;
    for (int b = t; b < SQ_NB; b += blockDim.x) {
        hc[b] = 0;
        hm[b] = 0;
    }
    if (t == 0) kept = 0;
    __syncthreads();
    const float m = sm_unkey(ws[SQ_KMAX]);
    const double mp = (double)min_p;
    u32 kc = 0;
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x) {
        const float d = sq_d(x[i], m, temp);
        const int b = sq_bin(d);
        const u64 q = sq_q(d, qshift);
        atomicAdd(&hc[b], 1u);
        if (q) atomicAdd(&hm[b], q);
        if (exp((double)d) >= mp) kc++;
    }
    if (kc) atomicAdd(&kept, kc);
    __syncthreads();
    u32* gc = ws + SQ_CNT;
    u64* gm = (u64*)(ws + SQ_MASS);
    for (int b = t; b < SQ_NB; b += blockDim.x) {
        if (hc[b]) atomicAdd(&gc[b], hc[b]);
        if (hm[b]) atomicAdd(&gm[b], hm[b]);
    }
    if (t == 0 && kept) atomicAdd(&ws[SQ_CALL], kept);
    __threadfence(); // every thread's atomics are done device-wide before the ticket
    __syncthreads();
    if (t == 0) last = atomicAdd(&ws[SQ_TICK2], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Thread t owns bins [t·per, (t+1)·per); a scan of the 256 owners' totals.
    const int per = SQ_NB / 256;
    u32 sc = 0;
    u64 sw = 0;
    {
        u32 cv[SQ_NB / 256];
        u64 mv[SQ_NB / 256];
#pragma unroll
        for (int i = 0; i < SQ_NB / 256; i++) { // all loads in flight at once
            cv[i] = ((volatile u32*)gc)[t * per + i];
            mv[i] = ((volatile u64*)gm)[t * per + i];
        }
#pragma unroll
        for (int i = 0; i < SQ_NB / 256; i++) {
            hc[t * per + i] = cv[i];
            hm[t * per + i] = mv[i];
            sc += cv[i];
            sw += mv[i];
        }
    }
    tc[t] = sc;
    tm[t] = sw;
    __syncthreads();
    for (int o = 1; o < 256; o <<= 1) {
        const u32 ac = t >= o ? tc[t - o] : 0u;
        const u64 aw = t >= o ? tm[t - o] : 0ull;
        __syncthreads();
        tc[t] += ac;
        tm[t] += aw;
        __syncthreads();
    }
    u32 c = tc[t] - sc;
    u64 w = tm[t] - sw;
    u64* cm = (u64*)(ws + SQ_CMASS);
    for (int b = t * per; b < (t + 1) * per; b++) {
        ws[SQ_START + b] = c;
        ws[SQ_CURSOR + b] = c;
        cm[b] = w;
        c += hc[b];
        w += hm[b];
    }
}

// Element ids grouped by bin (order inside a bin arbitrary: the finish orders it).
DS4_KERNEL void DS4_BOUNDS(256) sample_scatter(const float* __restrict__ x, int n, float temp, u32* ws) {
    ds4_pdl_enter();
    ds4_pdl_enter();
    const float m = sm_unkey(ws[SQ_KMAX]);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int b = sq_bin(sq_d(x[i], m, temp));
        const u32 pos = atomicAdd(&ws[SQ_CURSOR + b], 1u);
        ws[SQ_IDS + pos] = (u32)i;
    }
}

// One CTA of 1024: the finish over the bins. Positions are 1-based ranks in the candidates'
// order; cum(j) = mass of the first j.
struct SqFin {
    u64 ck[SQ_CAP]; // the resolved bin: (key << 32) | ~id, larger = earlier
    u64 cq[SQ_CAP];
    int rbin;
    int rb; // a located bin
    u64 r64;
    u32 r32;
};

struct SqCtx {
    const float* x;
    float m, temp;
    int qshift;
    const u32 *cnt, *start, *ids;
    const u64 *mass, *cmass;
    u32 rank[SQ_CAP / 1024]; // owned elements t, t + 1024 of the resolved bin
    u64 pm[SQ_CAP / 1024];   // their mass before them inside the bin
};

// Orders bin b (count ≤ SQ_CAP) into f / c's registers; all threads call.
__device__ void sq_resolve(int b, SqFin& f, SqCtx& c) {
    if (f.rbin == b) return;
    const u32 nb = c.cnt[b], s0 = c.start[b];
    for (u32 e = threadIdx.x; e < nb; e += blockDim.x) {
        const u32 i = c.ids[s0 + e];
        const float xi = c.x[i];
        f.ck[e] = ((u64)sm_key(xi) << 32) | (u64)(0xffffffffu - i);
        f.cq[e] = sq_q(sq_d(xi, c.m, c.temp), c.qshift);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < SQ_CAP / 1024; s++) {
        const u32 e = threadIdx.x + s * 1024;
        u32 r = 0;
        u64 acc = 0;
        if (e < nb) {
            const u64 me = f.ck[e];
            for (u32 g = 0; g < nb; g++) {
                const bool before = f.ck[g] > me;
                r += before;
                acc += before ? f.cq[g] : 0ull;
            }
        }
        c.rank[s] = r;
        c.pm[s] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) f.rbin = b;
    __syncthreads();
}

// The bin holding position j ∈ [1, n]: the one nonempty b with start < j ≤ start + cnt. Each
// thread tests SQ_NB / 1024 bins (one round of loads, not a chain of dependent ones).
__device__ int sq_bin_of_pos(u32 j, SqFin& f, const SqCtx& c) {
#pragma unroll
    for (int s = 0; s < SQ_NB / 1024; s++) {
        const int b = threadIdx.x + s * 1024;
        const u32 st = c.start[b];
        if (st < j && st + c.cnt[b] >= j) f.rb = b;
    }
    __syncthreads();
    const int b = f.rb;
    __syncthreads();
    return b;
}

// The bin where cum first reaches tg ∈ [0, total]: 0 for tg = 0, else the one b with
// cmass < tg ≤ cmass + mass (it has mass).
__device__ int sq_bin_of_mass(u64 tg, SqFin& f, const SqCtx& c) {
    if (tg == 0) return 0;
#pragma unroll
    for (int s = 0; s < SQ_NB / 1024; s++) {
        const int b = threadIdx.x + s * 1024;
        const u64 cm = c.cmass[b];
        if (cm < tg && cm + c.mass[b] >= tg) f.rb = b;
    }
    __syncthreads();
    const int b = f.rb;
    __syncthreads();
    return b;
}

// cum(j), j ≥ 1; false: the bin is too large.
__device__ bool sq_mass_at(u32 j, SqFin& f, SqCtx& c, u64& out) {
    const int b = sq_bin_of_pos(j, f, c);
    const u32 r = j - c.start[b];
    if (r >= c.cnt[b] || c.mass[b] == 0) {
        out = c.cmass[b] + (r >= c.cnt[b] ? c.mass[b] : 0ull);
        return true;
    }
    if (c.cnt[b] > SQ_CAP) return false;
    sq_resolve(b, f, c);
#pragma unroll
    for (int s = 0; s < SQ_CAP / 1024; s++) {
        const u32 e = threadIdx.x + s * 1024;
        if (e < c.cnt[b] && c.rank[s] == r - 1) f.r64 = c.pm[s] + f.cq[e];
    }
    __syncthreads();
    out = c.cmass[b] + f.r64;
    __syncthreads();
    return true;
}

// The first position whose cum reaches tg (tg ≤ the total mass) and its id; false: the bin
// is too large.
__device__ bool sq_pos_of_mass(u64 tg, SqFin& f, SqCtx& c, u32& out, u32& id) {
    const int b = sq_bin_of_mass(tg, f, c);
    if (c.cnt[b] == 1) {
        out = c.start[b] + 1;
        id = c.ids[c.start[b]];
        return true;
    }
    if (c.cnt[b] > SQ_CAP) return false;
    sq_resolve(b, f, c);
    const u64 tr = tg - c.cmass[b];
#pragma unroll
    for (int s = 0; s < SQ_CAP / 1024; s++) {
        const u32 e = threadIdx.x + s * 1024;
        if (e < c.cnt[b] && (c.pm[s] < tr || c.rank[s] == 0) && c.pm[s] + f.cq[e] >= tr) {
            f.r32 = c.rank[s];
            f.r64 = 0xffffffffu - (u32)f.ck[e];
        }
    }
    __syncthreads();
    out = c.start[b] + f.r32 + 1;
    id = (u32)f.r64;
    __syncthreads();
    return true;
}

// The id at position j; false: the bin is too large.
__device__ bool sq_id_at(u32 j, SqFin& f, SqCtx& c, u32& out) {
    const int b = sq_bin_of_pos(j, f, c);
    if (c.cnt[b] == 1) {
        out = c.ids[c.start[b]];
        return true;
    }
    if (c.cnt[b] > SQ_CAP) return false;
    sq_resolve(b, f, c);
    const u32 r = j - c.start[b];
#pragma unroll
    for (int s = 0; s < SQ_CAP / 1024; s++) {
        const u32 e = threadIdx.x + s * 1024;
        if (e < c.cnt[b] && c.rank[s] == r - 1) f.r32 = 0xffffffffu - (u32)f.ck[e];
    }
    __syncthreads();
    out = f.r32;
    __syncthreads();
    return true;
}

// The pick (host select's steps on positions and cum): W = cum(k) over the top-k set; min-p
// keeps the first max(1, min(k, #w ≥ min_p)); top-p the first whose cum reaches top_p · W
// (within those); the pick is the first whose cum reaches u · cum(n2).
DS4_KERNEL void DS4_BOUNDS(1024) sample_finish(const float* __restrict__ x, int n, double* p, float temp, int top_k, float top_p, float min_p, long long u_bits, int qshift, const u32* __restrict__ ws, u32* out) {
    ds4_pdl_enter();
    ds4_pdl_enter();
    __shared__ SqFin f;
    const u32 kmax = ws[SQ_KMAX];
    const float m = sm_unkey(kmax);
    bool ok = ((u32)__float_as_int(m) & 0x7f800000u) != 0x7f800000u; // m finite
    SqCtx c;
    c.x = x;
    c.m = m;
    c.temp = temp;
    c.qshift = qshift;
    c.cnt = ws + SQ_CNT;
    c.start = ws + SQ_START;
    c.ids = ws + SQ_IDS;
    c.mass = (const u64*)(ws + SQ_MASS);
    c.cmass = (const u64*)(ws + SQ_CMASS);
    if (threadIdx.x == 0) f.rbin = -1;
    __syncthreads();
    const u32 nn = (u32)n;
    const u32 k = top_k > 0 && (u32)top_k < nn ? (u32)top_k : nn;
    u64 wk = 0, w2 = 0;
    u32 n1 = k, n2 = k, j = 1, id = 0;
    if (ok) ok = sq_mass_at(k, f, c, wk);
    if (min_p > 0.0f) {
        const u32 ca = ws[SQ_CALL];
        n1 = ca < k ? ca : k;
        n1 = n1 < 1 ? 1 : n1;
    }
    n2 = n1;
    w2 = wk;
    if (ok && n1 != k) ok = sq_mass_at(n1, f, c, w2);
    if (ok && top_p < 1.0f) {
        const u64 tp = top_p > 0.0f ? (u64)((double)top_p * (double)wk) : 0ull;
        if (tp <= w2) {
            ok = sq_pos_of_mass(tp, f, c, n2, id);
            if (ok) ok = sq_mass_at(n2, f, c, w2);
        }
    }
    if (ok) {
        const double u = __longlong_as_double(u_bits);
        u64 tg = (u64)(u * (double)w2);
        tg = tg > w2 ? w2 : tg;
        ok = sq_pos_of_mass(tg, f, c, j, id);
        if (ok && j > n2) ok = sq_id_at(n2, f, c, id); // never: tg ≤ cum(n2)
    }
    if (!ok) {
        sp_pick(x, n, p, temp, top_k, top_p, min_p, u_bits, out);
        return;
    }
    if (threadIdx.x == 0) out[0] = id;
}
