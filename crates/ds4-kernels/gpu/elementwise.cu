// RMSNorm and elementwise ops on f32 vectors (the CPU definitions are ds4-cpu's math.rs).
#include "prelude.cuh"

// y[row] = x[row] / sqrt(mean(x[row]^2) + eps) * w (w may be null). One CTA per row; the sum
// of squares is accumulated in f64 like the CPU reference. blockDim.x is a multiple of DS4_WARP,
// at most 1024.
DS4_KERNEL void DS4_BOUNDS(1024) rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ y, int n, float eps) {
    ds4_pdl_enter();
    __shared__ double part[1024 / 32];
    __shared__ float scale_s;
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = y + (size_t)blockIdx.x * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    ss = ds4_warp_sum_f64(ss);
    int warp = threadIdx.x / DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    if (threadIdx.x % DS4_WARP == 0) part[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < nwarps; i++) t += part[i];
        scale_s = (float)(1.0 / sqrt(t / (double)n + (double)eps));
    }
    __syncthreads();
    float scale = scale_s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] * scale;
        yr[i] = w ? v * w[i] : v;
    }
}

// rmsnorm_f32 for latency (decode: one long row, e.g. the HC norm's N*D = 16384): float4 loads held
// in registers between the two passes (no second read), one CTA per row. The host guarantees
// n % 4 == 0, 16-byte aligned x, y, w, and n <= 4 * 4 * blockDim.x (at most 4 float4 per thread).
// blockDim.x is a multiple of DS4_WARP, at most 1024. Same f64 sum of squares and f32 scaling.
DS4_KERNEL void DS4_BOUNDS(1024) rmsnorm_f32x4(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int n, float eps) {
    ds4_pdl_enter();
    __shared__ double part[1024 / 32]; // one per warp (16 used when DS4_WARP is 64)
    __shared__ float scale_s;
    const int n4 = n >> 2, tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP;
    const float4* xr = (const float4*)(x + (size_t)blockIdx.x * n);
    float4* yr = (float4*)(y + (size_t)blockIdx.x * n);
    const float4* wr = (const float4*)w;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 v[4], g[4];
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < 4; j++) { // all loads (x and w) issued before any use
        const int i = tid + j * blockDim.x;
        v[j] = i < n4 ? xr[i] : zero;
        g[j] = (w && i < n4) ? wr[i] : zero;
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        ss += (double)v[j].x * (double)v[j].x + (double)v[j].y * (double)v[j].y + (double)v[j].z * (double)v[j].z + (double)v[j].w * (double)v[j].w;
    ss = ds4_warp_sum_f64(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    if (warp == 0) { // the first warp sums the per-warp parts
        const int nwarps = blockDim.x / DS4_WARP;
        double t = lane < nwarps ? part[lane] : 0.0;
        t = ds4_warp_sum_f64(t);
        if (lane == 0) scale_s = (float)(1.0 / sqrt(t / (double)n + (double)eps));
    }
    __syncthreads();
    const float s = scale_s;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = tid + j * blockDim.x;
        if (i >= n4) break;
        float4 o = make_float4(v[j].x * s, v[j].y * s, v[j].z * s, v[j].w * s); // x * scale, then * w
        if (w) o.x *= g[j].x, o.y *= g[j].y, o.z *= g[j].z, o.w *= g[j].w;
        yr[i] = o;
    }
}

// rmsnorm_f32x4 with one block barrier (glue form, the default): each warp's f64 partial goes to
// shared memory once, then every thread sums the partials itself in a fixed order (4 chains, so
// all threads get the same value) instead of a second warp stage and barrier. Same host
// guarantees as rmsnorm_f32x4 (n % 4 == 0, 16-byte aligned x, y, w, n <= 16 * blockDim.x).
DS4_KERNEL void DS4_BOUNDS(1024) rmsnorm_f32g(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int n, float eps) {
    ds4_pdl_enter();
    __shared__ double part[1024 / 32];
    const int n4 = n >> 2, tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP;
    const float4* xr = (const float4*)(x + (size_t)blockIdx.x * n);
    float4* yr = (float4*)(y + (size_t)blockIdx.x * n);
    const float4* wr = (const float4*)w;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 v[4], g[4];
#pragma unroll
    for (int j = 0; j < 4; j++) { // all loads (x and w) issued before any use
        const int i = tid + j * blockDim.x;
        v[j] = i < n4 ? xr[i] : zero;
        g[j] = (w && i < n4) ? wr[i] : zero;
    }
    double s2[2] = {0.0, 0.0}; // two chains
#pragma unroll
    for (int j = 0; j < 4; j++) {
        s2[j & 1] += (double)v[j].x * (double)v[j].x + (double)v[j].y * (double)v[j].y;
        s2[j & 1] += (double)v[j].z * (double)v[j].z + (double)v[j].w * (double)v[j].w;
    }
    const double ss = ds4_warp_sum_f64(s2[0] + s2[1]);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    const int nw = blockDim.x / DS4_WARP;
    double q[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
    for (int i = 0; i < 1024 / 32; i++)
        if (i < nw) q[i & 3] += part[i]; // smem broadcast reads
    const double t = (q[0] + q[1]) + (q[2] + q[3]);
    const float s = (float)(1.0 / sqrt(t / (double)n + (double)eps));
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = tid + j * blockDim.x;
        if (i >= n4) break;
        float4 o = make_float4(v[j].x * s, v[j].y * s, v[j].z * s, v[j].w * s); // x * scale, then * w
        if (w) o.x *= g[j].x, o.y *= g[j].y, o.z *= g[j].z, o.w *= g[j].w;
        yr[i] = o;
    }
}

// rmsnorm_f32x4 for short rows (decode, e.g. the 1024-wide query norm): one warp per row, the row
// in registers (float4 q = k·DS4_WARP + lane, up to 8 per lane), no shared memory or block
// barrier. blockDim a multiple of DS4_WARP (a row each); host: n % 4 == 0, n / 4 <= 8·DS4_WARP,
// 16-byte aligned x, y, w. Same f64 sum of squares and f32 scaling (x · scale, then · w).
DS4_KERNEL void DS4_BOUNDS(256) rmsnorm_f32w(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int n, float eps, int rows) {
    ds4_pdl_enter();
    const int lane = threadIdx.x % DS4_WARP, row = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP;
    if (row >= rows) return; // whole warps
    const int n4 = n >> 2;
    const float4* xr = (const float4*)(x + (size_t)row * n);
    float4* yr = (float4*)(y + (size_t)row * n);
    const float4* wr = (const float4*)w;
    float4 v[8], g[8];
#pragma unroll
    for (int k = 0; k < 8; k++) { // every load first
        const int q = k * DS4_WARP + lane;
        v[k] = q < n4 ? xr[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        g[k] = (w && q < n4) ? wr[q] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < 8; k++)
        ss += (double)v[k].x * (double)v[k].x + (double)v[k].y * (double)v[k].y + (double)v[k].z * (double)v[k].z + (double)v[k].w * (double)v[k].w;
    ss = ds4_warp_sum_f64(ss);
    const float s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = k * DS4_WARP + lane;
        if (q >= n4) break;
        float4 o = make_float4(v[k].x * s, v[k].y * s, v[k].z * s, v[k].w * s);
        if (w) o.x *= g[k].x, o.y *= g[k].y, o.z *= g[k].z, o.w *= g[k].w;
        yr[q] = o;
    }
}

DS4_KERNEL void DS4_BOUNDS(256) add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                                       long long n) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

DS4_KERNEL void DS4_BOUNDS(256) mul_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                                       long long n) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] * b[i];
}

DS4_KERNEL void DS4_BOUNDS(256) scale_f32(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}

// y = silu(min(g, c)) * clamp(u, -c, c) * weight: the clamped SwiGLU of the experts.
DS4_KERNEL void DS4_BOUNDS(256) swiglu_f32(const float* __restrict__ g, const float* __restrict__ u,
                                          float* __restrict__ y, float c, float weight, long long n) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = fminf(g[i], c);
    float uv = fminf(fmaxf(u[i], -c), c);
    float silu = gv * (1.0f / (1.0f + expf(-gv)));
    y[i] = silu * uv * weight;
}

// dst[i] = src[i] over n 32-bit words, grid-stride (device copies inside a recorded step, so
// that every node of its graph is a kernel node).
DS4_KERNEL void DS4_BOUNDS(256) copy_u32(unsigned int* __restrict__ dst, const unsigned int* __restrict__ src, long long n) {
    ds4_pdl_enter();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// Many device copies in one launch (the GPU's state checkpoints: every layer's ring and
// compressor frontiers). list[3 e .. 3 e + 2] = (dst, src, words) of entry e = blockIdx.y; the
// CTAs of a row stride over its 32-bit words, 16 bytes at a time where both ends allow it.
DS4_KERNEL void DS4_BOUNDS(256) copy_list(const unsigned long long* __restrict__ list) {
    ds4_pdl_enter();
    const unsigned long long* e = list + 3 * (size_t)blockIdx.y;
    unsigned int* dst = (unsigned int*)e[0];
    const unsigned int* src = (const unsigned int*)e[1];
    const long long n = (long long)e[2];
    const long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15ull) == 0) {
        const long long n4 = n / 4;
        for (long long i = t0; i < n4; i += step) ((uint4*)dst)[i] = ((const uint4*)src)[i];
        done = 4 * n4;
    }
    for (long long i = done + t0; i < n; i += step) dst[i] = src[i];
}

// dst[i] = v over n 32-bit words, grid-stride (fills inside a recorded step).
DS4_KERNEL void DS4_BOUNDS(256) fill_u32(unsigned int* __restrict__ dst, unsigned int v, long long n) {
    ds4_pdl_enter();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = v;
}

// L2 prefetch of weights that a decode step reads after some latency-bound ops
// (`Backend::prefetch`, off by default): byte ranges (a[i], n[i]), i < 4, a 16-byte aligned,
// split into 4 KiB chunks over the grid's threads. The bytes are meant to arrive in L2 while the
// ops after it run. In the main chain the next kernel's PDL wait held it until this grid was
// done (session 42: decode -14%); a recorded step runs it on a chain of its own (FLOW_HINT),
// where it ties (session 43). sm_90: one bulk prefetch (TMA) a chunk; older CUDA: one prefetch a
// 128-byte line; HIP: nothing (the host does not launch it there). Results never depend on it.
// Session 59 (H100, bench/results/gpu-s59-h100.txt): a 36 MB product after a hint for its own
// weight reads every byte from DRAM again (ncu: the same DRAM bytes and L2 hit rate; matvec_bench
// q8 pf-same: the pair costs the bytes twice), in this form and by per-line prefetch,
// ::evict_last or loads that complete (a2086cf, a5d2bed, 8ef64e2), though the same product run
// again right after itself reads from L2 (out_a 15.8 -> 10.4 us); an 8.9 MB one does hit the
// hinted lines. Hints of a few MB a call tie end to end (+0.5%, 8 pairs). So it stays off.
DS4_KERNEL void DS4_BOUNDS(128) prefetch_l2(const char* a0, long long n0, const char* a1, long long n1,
                                            const char* a2, long long n2, const char* a3, long long n3) {
    ds4_pdl_enter(); // after the previous product: its streaming would evict these lines
#if defined(DS4_CUDA)
    const char* a[4] = {a0, a1, a2, a3};
    const long long n[4] = {n0, n1, n2, n3};
    const long long chunk = 4096, t = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    long long first = 0; // chunk index where range r starts
    for (int r = 0; r < 4; r++) {
        const long long cnt = (n[r] / 16 * 16 + chunk - 1) / chunk;
        long long c = t - first; // this thread's chunks: global index = t (mod step)
        if (c < 0) c += (-c + step - 1) / step * step;
        for (; c < cnt; c += step) {
            const char* p = a[r] + c * chunk;
            const long long left = n[r] / 16 * 16 - c * chunk;
            const unsigned int bytes = (unsigned int)(left < chunk ? left : chunk);
#if DS4_ARCH >= 900
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
            for (unsigned int o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
        }
        first += cnt;
    }
#else
    (void)a0, (void)n0, (void)a1, (void)n1, (void)a2, (void)n2, (void)a3, (void)n3;
#endif
}

// Probe of a persistent decode step (examples/persist_bench.rs; the engine never launches it).
// Phases p0 .. p0 + phases - 1; in phase p every thread reads its grid-strided 16-byte vectors of
// W's [p vpp, (p + 1) vpp) (four loads in flight, xor-folded into a checksum); between phases all
// CTAs meet at a grid barrier (bar[0] arrivals, bar[1] generation; every CTA must be resident:
// the host launches at most one CTA an SM). `pre` (0..PROBE_PRE) of a thread's vectors of the next
// phase are loaded before that barrier, and those of the first phase before the PDL wait: the
// prefetch a persistent kernel (or a PDL one) can do across an op boundary. One word a CTA to sink.
#define PROBE_PRE 8
DS4_KERNEL void DS4_BOUNDS(256) probe_phases(const uint4* __restrict__ W, long long vpp, int p0, int phases, int pre,
                                             unsigned int* bar, unsigned int* __restrict__ sink) {
    DS4_PDL_LATE;
    const long long stride = (long long)gridDim.x * blockDim.x, t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 held[PROBE_PRE];
    unsigned int acc = 0;
    auto prefetch = [&](int p) {
        const uint4* w = W + (long long)p * vpp;
#pragma unroll
        for (int k = 0; k < PROBE_PRE; k++)
            if (k < pre && t0 + k * stride < vpp) held[k] = w[t0 + k * stride];
    };
    prefetch(p0);
    ds4_pdl_enter();
    for (int p = p0; p < p0 + phases; p++) {
        const uint4* w = W + (long long)p * vpp;
#pragma unroll
        for (int k = 0; k < PROBE_PRE; k++)
            if (k < pre && t0 + k * stride < vpp) acc ^= held[k].x ^ held[k].y ^ held[k].z ^ held[k].w;
        long long i = t0 + (long long)pre * stride;
        for (; i + 3 * stride < vpp; i += 4 * stride) {
            const uint4 a = w[i], b = w[i + stride], c = w[i + 2 * stride], d = w[i + 3 * stride];
            acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
        }
        for (; i < vpp; i += stride) acc ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
        if (p + 1 < p0 + phases) {
            prefetch(p + 1);
            __syncthreads();
            if (threadIdx.x == 0) {
                volatile unsigned int* vb = bar;
                const unsigned int gen = vb[1];
                __threadfence();
                if (atomicAdd(&bar[0], 1u) == gridDim.x - 1) {
                    bar[0] = 0;
                    __threadfence();
                    atomicAdd(&bar[1], 1u);
                } else {
                    while (vb[1] == gen) {
                    }
                }
                __threadfence();
            }
            __syncthreads();
        }
    }
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) acc ^= ds4_shfl_xor(acc, o);
    if (threadIdx.x == 0) sink[blockIdx.x] = acc;
}

// Probes of a dataflow-flag product (examples/overlap_bench.rs; the engine never launches them):
// can a product stage its weights in shared memory while a chain of dependent glue ops runs, then
// wait for its input on a flag instead of a kernel boundary?
//
// probe_idx: idx[i] = a hash of i mod words (a random map: chains of dependent loads over it).
DS4_KERNEL void DS4_BOUNDS(256) probe_idx(u32* __restrict__ idx, u32 words) {
    ds4_pdl_enter();
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
        u32 h = i * 2654435761u;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        idx[i] = h % words;
    }
}

// The xor of v over the CTA (blockDim.x <= 256; red: 256 / 32 words of shared memory), in
// thread 0 (other threads: 0); every thread must call it.
__device__ __forceinline__ u32 probe_cta_xor(u32 v, u32* red) {
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) v ^= ds4_shfl_xor(v, o);
    if (threadIdx.x % DS4_WARP == 0) red[threadIdx.x / DS4_WARP] = v;
    __syncthreads();
    u32 t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x / DS4_WARP); w++) t ^= red[w];
    return t;
}

// probe_glue: one latency-bound glue op. Every thread follows `chase` dependent loads through idx
// from a start that depends on the previous op's result io[0]; the CTAs' xors meet in io[1] and
// the last CTA (ticket) moves io[1] to io[0] and, when flag is non-null, releases *flag = 1: the
// signal a dataflow consumer waits for (its input complete and visible). st (optional): st[0] the
// op's start (CTA 0 past the PDL wait), st[1] its end (the last CTA's release).
DS4_KERNEL void DS4_BOUNDS(256) probe_glue(const u32* __restrict__ idx, u32 words, int chase, u32* io, u32* ticket,
                                           u32* flag, unsigned long long* st) {
    ds4_pdl_enter();
    if (st && blockIdx.x == 0 && threadIdx.x == 0) st[0] = ds4_now();
    __shared__ u32 red[256 / 32];
    u32 j = (((volatile u32*)io)[0] + blockIdx.x * blockDim.x + threadIdx.x) * 2654435761u % words;
    for (int k = 0; k < chase; k++) j = idx[j];
    const u32 v = probe_cta_xor(j, red);
    if (threadIdx.x == 0) {
        atomicXor(&io[1], v);
        __threadfence();
        if (atomicAdd(ticket, 1u) == gridDim.x - 1) {
            *ticket = 0;
            io[0] = atomicExch(&io[1], 0u);
            __threadfence();
            if (flag) atomicExch(flag, 1u);
            if (st) st[1] = ds4_now();
        }
    }
}

// probe_pre: a product streaming W's vpp 16-byte vectors (CTA b owns the contiguous slice
// [b per, (b + 1) per), one CTA an SM, xor-folded into sink[b]). The first `pre` vectors of the
// slice are copied to shared memory first (cp.async on CUDA sm_80+, else plain loads); then,
// when flag is non-null, thread 0 waits until *flag != 0 (traps after 2e7 polls, seconds, instead
// of hanging: a flag that never comes is a schedule bug) — only then does the kernel read what the flag
// guards (here: nothing; a real product's x) and the rest of its slice. flag null: the PDL wait
// instead, after the staging (the serial form: staged while the previous op drains). pre = 0,
// flag null: a plain streaming product. st (optional): 4 stamps a CTA: start, past the wait,
// streaming done, end. pace > 0: the staging paced, round r (blockDim.x vectors) not issued before
// r * pace ns after the start (a burst of staging slows latency-bound glue beside it).
DS4_KERNEL void DS4_BOUNDS(256) probe_pre(const uint4* __restrict__ W, long long vpp, int pre, u32* flag,
                                          u32* __restrict__ sink, unsigned long long* st, int pace) {
    DS4_PDL_LATE;
    unsigned long long* sb = st ? st + 4 * blockIdx.x : nullptr;
    if (sb && threadIdx.x == 0) sb[0] = ds4_now();
    extern __shared__ uint4 stage[];
    const long long per = (vpp + gridDim.x - 1) / gridDim.x;
    const long long s0 = (long long)blockIdx.x * per;
    const long long s1 = s0 + per < vpp ? s0 + per : vpp;
    const int np = (int)(s1 - s0 < (long long)pre ? (s1 > s0 ? s1 - s0 : 0) : pre);
    const unsigned long long t_s = pace > 0 ? ds4_now() : 0;
    for (int i = threadIdx.x, r = 0; i < np; i += blockDim.x, r++) {
        if (pace > 0)
            while (ds4_now() < t_s + (unsigned long long)r * (unsigned long long)pace) {
#if defined(DS4_CUDA) && DS4_ARCH >= 700
                asm volatile("nanosleep.u32 64;");
#endif
            }
#if defined(DS4_CUDA) && DS4_ARCH >= 800
        const u32 d = (u32)__cvta_generic_to_shared(&stage[i]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(W + s0 + i) : "memory");
#else
        stage[i] = W[s0 + i];
#endif
    }
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
    if (flag) {
        if (threadIdx.x == 0) {
            long long spins = 0;
            while (*(volatile u32*)flag == 0) {
#if defined(DS4_CUDA) && DS4_ARCH >= 700
                asm volatile("nanosleep.u32 128;");
#endif
                if (++spins > 20000000LL) {
#if defined(DS4_CUDA)
                    __trap();
#else
                    __builtin_trap();
#endif
                }
            }
            __threadfence();
        }
        __syncthreads();
    } else {
        ds4_pdl_enter();
    }
    if (sb && threadIdx.x == 0) sb[1] = ds4_now();
    // The staged part is read while the first round of global loads is in flight (a thread
    // reads back only its own copies, so its own wait suffices: no barrier).
    u32 acc = 0;
    long long i = s0 + np + threadIdx.x;
    const long long stride = blockDim.x;
    {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (i + k * stride < s1) v[k] = W[i + k * stride];
#if defined(DS4_CUDA) && DS4_ARCH >= 800
        asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
        for (int k = threadIdx.x; k < np; k += blockDim.x) acc ^= stage[k].x ^ stage[k].y ^ stage[k].z ^ stage[k].w;
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (i + k * stride < s1) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
        i += 8 * stride;
    }
    for (; i + 7 * stride < s1; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = W[i + k * stride];
#pragma unroll
        for (int k = 0; k < 8; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < s1; i += stride) acc ^= W[i].x ^ W[i].y ^ W[i].z ^ W[i].w;
    if (sb && threadIdx.x == 0) sb[2] = ds4_now();
    __shared__ u32 red[256 / 32];
    const u32 v = probe_cta_xor(acc, red);
    if (threadIdx.x == 0) {
        sink[blockIdx.x] = v;
        if (sb) sb[3] = ds4_now();
    }
}

// probe_join: the consumer after both chains: resets the flag for the next replay.
DS4_KERNEL void DS4_BOUNDS(32) probe_join(u32* flag) {
    ds4_pdl_enter();
    if (threadIdx.x == 0 && blockIdx.x == 0) *flag = 0;
}
