// Decode MoE (n <= 4 tokens, k slots each): the routed experts at weight bandwidth, two launches.
// Two forms: v1 (moegu/moedn, below: rows staged in shared memory) and v2 (m2*: direct loads).
//
//   moegu<NT>_<t>: CTA (row block of rb rows, pair p = blockIdx.y). The first pair holding expert
//                  e = sel[p] computes gate and up rows r0..r0+rb of e for every token routed to e
//                  (each distinct expert read once), then h[pp*ff + r] = silu(min(g, c)) *
//                  clamp(u, +-c) * wgt[pp] for every pair pp with sel[pp] == e.
//   moedn_<t>:     CTA (row block of rb output rows): the rows of every distinct expert (in
//                  batches of ub experts), dotted with h of each pair using it, then
//                  out[t*d + r] = sum over slots s in selection order (no atomics: deterministic).
//
// Both stage the CTA's rows (contiguous bytes) in shared memory with 16-byte loads, 8 in flight
// per thread, then decode from shared memory. Thread mapping: a thread owns one "unit" of V
// consecutive 8-element slices of the columns (x in registers) and loops over the staged rows,
// MOE_G row-dots at a time; a warp butterfly (reduce-scatter) then a fixed-order sum over warps.
//
// Weights are decoded to small integers and the block scale applied once per unit. On CUDA the
// integer m is used as the bits of a denormal float (m * 2^-149, exact, one PRMT, signs included)
// with x prescaled by 2^100 (exact), so each weight costs one PRMT + one FMA; totals are scaled
// back by 2^49 (folded into the block scale). HIP converts with (float) and no scaling.
#include "prelude.cuh"
#include "dequant.cuh"
#include "ptx.cuh"

#define MOE_THREADS 256
#define MOE_WARPS (MOE_THREADS / DS4_WARP)
#define MOE_G 8     // row-dots per reduction group
#define MOE_MAXP 32 // most pairs (n * k)
#define MOE_TAB 3072 // bytes of shared tables: IQ2_XXS grid (256 u64) + sign masks (128 u64)
#define MOE_LB4 MOE_THREADS, 4 // at most 64 registers: 4 CTAs per SM

#if defined(DS4_CUDA)
#define MOE_XS __int_as_float(0x71800000) // 2^100
#define MOE_UN __int_as_float(0x58000000) // 2^49
#else
#define MOE_XS 1.0f
#define MOE_UN 1.0f
#endif

// Byte b of v (< 128) as a weight in units (see top).
__device__ __forceinline__ float moe_u(u32 v, int b) {
#if defined(DS4_CUDA)
    return __int_as_float(__byte_perm(v, 0u, 0x4440 | b)); // bytes [v_b, 0, 0, 0]
#else
    return (float)((v >> (8 * b)) & 0xffu);
#endif
}

// Byte b of magnitudes m (< 128) with the sign in bit 7 of byte b of s, in units.
__device__ __forceinline__ float moe_su(u32 m, u32 s, int b) {
#if defined(DS4_CUDA)
    // prmt: bytes [m_b, sign-replicate(m_b) = 0, 0, s_b].
    u32 sel = (u32)b | ((8u | b) << 4) | ((8u | b) << 8) | ((4u + b) << 12), r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(m), "r"(s), "r"(sel));
    return __int_as_float(r);
#else
    float f = (float)((m >> (8 * b)) & 0xffu);
    return ((s >> (8 * b + 7)) & 1u) ? -f : f;
#endif
}

// acc[t] += row (unit u: slices uV .. uV+V) . x[t] for t < NT (x rows past the tokens in use are
// zeros: no guards, so the compiler interleaves the row-dots of a group). xs: x slices prescaled by MOE_XS,
// sx: their plain sums (for the K-quant mins). gs, ss: IQ2_XXS grid and sign masks in shared memory.
template <int T, int V, int NT> struct MoeDot;

// IQ2_XXS (66-byte blocks): slice q of chunk c is run q of group c & 7 (grid entry, 7 sign bits + parity).
template <int V, int NT> struct MoeDot<T_IQ2_XXS, V, NT> {
    static __device__ __forceinline__ void dot(const u8* row, int u, const float (&xs)[V][NT][8], const float (&sx)[V][NT],
                                               const u64* gs, const u64* ss, float (&acc)[NT], int m) {
        int s0 = u * V, c = s0 >> 2, q0 = s0 & 3;
        const u8* b = row + (c >> 3) * 66;
        const u16* g2 = (const u16*)(b + 2 + 8 * (c & 7));
        u32 idx4 = (u32)g2[0] | ((u32)g2[1] << 16);
        u32 aux = (u32)g2[2] | ((u32)g2[3] << 16);
        float db = ds4_mul_rn(ds4_mul_rn(ds4_h2f_fast(*(const u16*)b), 0.5f + (float)(aux >> 28)), 0.25f) * MOE_UN;
        float a[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) a[t] = 0.0f;
#pragma unroll
        for (int v = 0; v < V; v++) {
            int q = q0 + v;
            u64 gr = gs[(idx4 >> (8 * q)) & 0xff], sg = ss[(aux >> (7 * q)) & 127];
            u32 ml = (u32)gr, mh = (u32)(gr >> 32), sl = (u32)sg, sh = (u32)(sg >> 32);
            float w[8];
#pragma unroll
            for (int l = 0; l < 4; l++) w[l] = moe_su(ml, sl, l), w[4 + l] = moe_su(mh, sh, l);
#pragma unroll
            for (int t = 0; t < NT; t++) {
#pragma unroll
                for (int l = 0; l < 8; l++) a[t] = fmaf(w[l], xs[v][t][l], a[t]);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = fmaf(db, a[t], acc[t]);
    }
};

// Q2_K (84-byte blocks): chunk p = c & 7 (h = p/4, j = p%4); slice q holds elements 16i + 8(q&1) ..
// (i = q/2) with 2-bit fields (qs[32h + 8q + l] >> 2j) & 3, scale byte 8h + 2j + i.
template <int V, int NT> struct MoeDot<T_Q2_K, V, NT> {
    static __device__ __forceinline__ void dot(const u8* row, int u, const float (&xs)[V][NT][8], const float (&sx)[V][NT],
                                               const u64* gs, const u64* ss, float (&acc)[NT], int m) {
        int s0 = u * V, c = s0 >> 2, q0 = s0 & 3;
        const u8* b = row + (c >> 3) * 84;
        int p = c & 7, h = p >> 2, j = p & 3;
        u32 dd = *(const u32*)(b + 80);
        float d = ds4_h2f_fast(dd & 0xffff), dmin = ds4_h2f_fast(dd >> 16);
#pragma unroll
        for (int v = 0; v < V; v++) {
            int q = q0 + v;
            u32 s = b[8 * h + 2 * j + (q >> 1)];
            float dl = ds4_mul_rn(d, (float)(s & 15)) * MOE_UN, ml = ds4_mul_rn(dmin, (float)(s >> 4));
            const u32* qs = (const u32*)(b + 16 + 32 * h + 8 * q);
            u32 v0 = (qs[0] >> (2 * j)) & 0x03030303u, v1 = (qs[1] >> (2 * j)) & 0x03030303u;
            float w[8];
#pragma unroll
            for (int l = 0; l < 4; l++) w[l] = moe_u(v0, l), w[4 + l] = moe_u(v1, l);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float a = 0.0f;
#pragma unroll
                for (int l = 0; l < 8; l++) a = fmaf(w[l], xs[v][t][l], a);
                acc[t] = fmaf(dl, a, fmaf(-ml, sx[v][t], acc[t]));
            }
        }
    }
};

// Q4_K (144-byte blocks): chunk p = c & 7 is sub-block p (6-bit scale and min), low (p even) or
// high nibbles of qs[32(p/2) ..]; slice q is bytes 8q .. 8q+8 of those 32.
template <int V, int NT> struct MoeDot<T_Q4_K, V, NT> {
    static __device__ __forceinline__ void dot(const u8* row, int u, const float (&xs)[V][NT][8], const float (&sx)[V][NT],
                                               const u64* gs, const u64* ss, float (&acc)[NT], int m) {
        int s0 = u * V, c = s0 >> 2, q0 = s0 & 3;
        const u8* b = row + (c >> 3) * 144;
        int p = c & 7;
        u32 dd = *(const u32*)b;
        float d = ds4_h2f_fast(dd & 0xffff), dmin = ds4_h2f_fast(dd >> 16);
        const u8* sc = b + 4;
        u32 s, mn;
        if (p < 4) {
            s = sc[p] & 63;
            mn = sc[p + 4] & 63;
        } else {
            s = (sc[p + 4] & 15) | ((sc[p - 4] >> 6) << 4);
            mn = (sc[p + 4] >> 4) | ((sc[p] >> 6) << 4);
        }
        float dl = ds4_mul_rn(d, (float)s) * MOE_UN, ml = ds4_mul_rn(dmin, (float)mn);
        int shift = 4 * (p & 1);
        float a[NT], sxs[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) a[t] = 0.0f, sxs[t] = 0.0f;
#pragma unroll
        for (int v = 0; v < V; v++) {
            const u32* qs = (const u32*)(b + 16 + 32 * (p >> 1) + 8 * (q0 + v));
            u32 v0 = (qs[0] >> shift) & 0x0f0f0f0fu, v1 = (qs[1] >> shift) & 0x0f0f0f0fu;
            float w[8];
#pragma unroll
            for (int l = 0; l < 4; l++) w[l] = moe_u(v0, l), w[4 + l] = moe_u(v1, l);
#pragma unroll
            for (int t = 0; t < NT; t++) {
#pragma unroll
                for (int l = 0; l < 8; l++) a[t] = fmaf(w[l], xs[v][t][l], a[t]);
                sxs[t] += sx[v][t];
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = fmaf(dl, a[t], fmaf(-ml, sxs[t], acc[t]));
    }
};

// IQ2_XXS tables into shared memory (other types: nothing). ss[s7]: byte l = 0x80 when element l
// of a run with sign field s7 is negative (bit 7: parity of s7).
template <int T> __device__ __forceinline__ void moe_tables(u64* gs, u64* ss) {
    if (T != T_IQ2_XXS) return;
    for (int i = threadIdx.x; i < 256; i += MOE_THREADS) gs[i] = ds4_iq2xxs_grid[i];
    for (int i = threadIdx.x; i < 128; i += MOE_THREADS) {
        u32 s8 = (u32)i | ((__popc(i) & 1u) << 7);
        u64 v = 0;
        for (int l = 0; l < 8; l++)
            if ((s8 >> l) & 1u) v |= 0x80ull << (8 * l);
        ss[i] = v;
    }
}

// Copies nv 16-byte vectors from each of the `cnt` sources src(i) to dst(i); 8 loads in flight.
// Item j < cnt * nv: source j / nv, vector j % nv.
template <typename F>
__device__ __forceinline__ void moe_stage(int total, F addr) {
    for (int i0 = 0; i0 < total; i0 += 8 * MOE_THREADS) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = i0 + j * MOE_THREADS + (int)threadIdx.x;
            if (i < total) {
                uint4* d;
                const uint4* s;
                addr(i, s, d);
                v[j] = *s;
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = i0 + j * MOE_THREADS + (int)threadIdx.x;
            if (i < total) {
                uint4* d;
                const uint4* s;
                addr(i, s, d);
                *d = v[j];
            }
        }
    }
}

// x slices of unit u (V slices from column 8uV) of the m rows xr[t], prescaled, and their sums.
template <int V, int NT>
__device__ __forceinline__ void moe_x(const float* const (&xr)[NT], int m, int u, float (&xs)[V][NT][8], float (&sx)[V][NT]) {
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int v = 0; v < V; v++) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
            if (t < m) {
                const float4* p = (const float4*)(xr[t] + 8 * (u * V + v));
                a = p[0], b = p[1];
            }
            sx[v][t] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
            float* o = xs[v][t];
            o[0] = a.x * MOE_XS, o[1] = a.y * MOE_XS, o[2] = a.z * MOE_XS, o[3] = a.w * MOE_XS;
            o[4] = b.x * MOE_XS, o[5] = b.y * MOE_XS, o[6] = b.z * MOE_XS, o[7] = b.w * MOE_XS;
        }
}

// Warp reduce-scatter of the G*NT values v[i][t] (a power of two <= DS4_WARP), value j = i*NT + t:
// returns, in every lane, the warp total of value lane / (DS4_WARP / (G*NT)). Fixed order:
// deterministic.
template <int G, int NT> __device__ __forceinline__ float moe_bfly(float (&v)[G][NT]) {
    constexpr int M = G * NT;
    int lane = threadIdx.x % DS4_WARP;
#pragma unroll
    for (int h = M / 2, o = DS4_WARP / 2; h >= 1; h >>= 1, o >>= 1) {
        bool up = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < h; i++) {
            float lo = v[i / NT][i % NT], hi = v[(i + h) / NT][(i + h) % NT];
            v[i / NT][i % NT] = (up ? hi : lo) + ds4_shfl_xor(up ? lo : hi, o);
        }
    }
    float r = v[0][0];
#pragma unroll
    for (int o = DS4_WARP / (2 * M); o >= 1; o >>= 1) r += ds4_shfl_xor(r, o);
    return r;
}

// The 2 rb row-dots (gate rows, then up rows) of the staged rows with MT token rows (MT <= NT, a
// power of two; rows past m are zeros), MOE_G at a time; warp totals into red[warp][rd][t < MT].
// FULL: all rb rows present (no guards).
template <int T, int NT, int MT, int V, bool FULL>
__device__ __forceinline__ void moegu_rows(const u8* wsm, int rb, int nr, long long row_bytes, const float* const (&xr)[NT],
                                           int m, int units, const u64* gs, const u64* ss, float* red) {
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    const float* xm[MT];
#pragma unroll
    for (int t = 0; t < MT; t++) xm[t] = xr[t];
    for (int g0 = 0; g0 < 2 * rb; g0 += MOE_G) {
        float acc[MOE_G][MT];
#pragma unroll
        for (int i = 0; i < MOE_G; i++)
#pragma unroll
            for (int t = 0; t < MT; t++) acc[i][t] = 0.0f;
        for (int u = tid; u < units; u += MOE_THREADS) {
            float xs[V][MT][8], sx[V][MT];
            moe_x<V, MT>(xm, m, u, xs, sx);
#pragma unroll
            for (int i = 0; i < MOE_G; i++) {
                int rd = g0 + i, up = rd >= rb, lr = up ? rd - rb : rd;
                if (FULL || lr < nr) MoeDot<T, V, MT>::dot(wsm + (up ? rb : 0) * row_bytes + lr * row_bytes, u, xs, sx, gs, ss, acc[i], m);
            }
        }
        float v = moe_bfly<MOE_G, MT>(acc);
        int idx = lane / (DS4_WARP / (MOE_G * MT));
        if (lane % (DS4_WARP / (MOE_G * MT)) == 0) red[(warp * 2 * rb + g0 + idx / MT) * NT + idx % MT] = v;
    }
}

extern __shared__ uint4 moe_smem[];

// Shared memory: tables (MOE_TAB bytes), red[MOE_WARPS][2 rb][NT] floats, gate rows [rb], up rows [rb].
template <int T, int NT, int V>
__device__ __forceinline__ void moegu_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu, const int* __restrict__ sel,
                                           long long slab, const float* __restrict__ x, int n, int k,
                                           const float* __restrict__ wgt, float clamp, float* __restrict__ h, int rows,
                                           int cols, long long row_bytes, int rb) {
    u64* gs = (u64*)moe_smem;
    u64* ss = gs + 256;
    float* red = (float*)(gs + MOE_TAB / 8);
    u8* wsm = (u8*)(red + MOE_WARPS * 2 * rb * NT);
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    int p = blockIdx.y, pairs = n * k, e = sel[p];
    for (int q = 0; q < p; q++)
        if (sel[q] == e) return; // an earlier pair computes expert e (uniform over the CTA)
    // Tokens routed to e, in order: tok[j], j < m.
    int tok[NT], m = 0;
#pragma unroll
    for (int j = 0; j < NT; j++) tok[j] = 0;
    for (int t = 0; t < n; t++) {
        bool use = false;
        for (int s = 0; s < k; s++) use |= sel[t * k + s] == e;
        if (use) {
#pragma unroll
            for (int j = 0; j < NT; j++)
                if (j == m) tok[j] = t;
            m++;
        }
    }
    int r0 = blockIdx.x * rb, nr = min(rb, rows - r0);
    moe_tables<T>(gs, ss);
    long long base = (long long)max(e, 0) * slab + (long long)r0 * row_bytes;
    int nv = (int)(nr * row_bytes / 16), upv = (int)(rb * row_bytes / 16);
    const uint4 *g4 = (const uint4*)(Wg + base), *u4 = (const uint4*)(Wu + base);
    uint4* w4 = (uint4*)wsm;
    moe_stage(2 * nv, [&](int i, const uint4*& s, uint4*& d) {
        bool up = i >= nv;
        int j = up ? i - nv : i;
        s = (up ? u4 : g4) + j;
        d = w4 + (up ? upv : 0) + j;
    });
    __syncthreads();
    const float* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xr[j] = x + (long long)tok[j] * cols;
    int units = cols / (8 * V);
    if (nr == rb) {
        if (m <= 1)
            moegu_rows<T, NT, 1, V, true>(wsm, rb, nr, row_bytes, xr, m, units, gs, ss, red);
        else if (m == 2)
            moegu_rows<T, NT, (NT >= 2 ? 2 : NT), V, true>(wsm, rb, nr, row_bytes, xr, m, units, gs, ss, red);
        else
            moegu_rows<T, NT, NT, V, true>(wsm, rb, nr, row_bytes, xr, m, units, gs, ss, red);
    } else {
        moegu_rows<T, NT, NT, V, false>(wsm, rb, nr, row_bytes, xr, m, units, gs, ss, red);
    }
    __syncthreads();
    for (int i = tid; i < nr * pairs; i += MOE_THREADS) {
        int lr = i % nr, pp = i / nr;
        if (sel[pp] != e) continue;
        int t = pp / k, j = 0;
#pragma unroll
        for (int jj = 0; jj < NT; jj++)
            if (jj < m && tok[jj] == t) j = jj;
        float gv = 0.0f, uv = 0.0f; // warps in order
        for (int w = 0; w < MOE_WARPS; w++) {
            gv += red[(w * 2 * rb + lr) * NT + j];
            uv += red[(w * 2 * rb + rb + lr) * NT + j];
        }
        gv = fminf(gv, clamp);
        uv = fminf(fmaxf(uv, -clamp), clamp);
        h[(long long)pp * rows + r0 + lr] = gv * (1.0f / (1.0f + expf(-gv))) * uv * wgt[pp];
    }
}

// Shared memory: tables (MOE_TAB), uq/pu (2 MOE_MAXP ints), red[MOE_WARPS][pairs][rb] floats,
// then ub experts' rows [ub][rb]. rb must be MOE_G.
template <int T>
__device__ __forceinline__ void moedn_body(const u8* __restrict__ W, const int* __restrict__ sel, long long slab,
                                           const float* __restrict__ hx, int n, int k, float* __restrict__ out, int rows,
                                           int cols, long long row_bytes, int ub) {
    const int rb = MOE_G;
    u64* gs = (u64*)moe_smem;
    u64* ss = gs + 256;
    int* uq = (int*)(gs + MOE_TAB / 8); // distinct experts in first-use order
    int* pu = uq + MOE_MAXP;            // pair -> index into uq
    float* red = (float*)(pu + MOE_MAXP);
    int pairs = n * k;
    u8* wsm = (u8*)(red + MOE_WARPS * ((pairs * rb + 3) & ~3));
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    __shared__ int nu_s;
    if (tid == 0) {
        int nu = 0;
        for (int p = 0; p < pairs; p++) {
            int e = sel[p], f = -1;
            for (int i = 0; i < nu; i++)
                if (uq[i] == e) f = i;
            if (f < 0) uq[nu] = e, f = nu++;
            pu[p] = f;
        }
        nu_s = nu;
    }
    moe_tables<T>(gs, ss);
    __syncthreads();
    int nu = nu_s;
    int r0 = blockIdx.x * rb, nr = min(rb, rows - r0);
    int nv = (int)(nr * row_bytes / 16), slot = (int)(rb * row_bytes / 16);
    uint4* w4 = (uint4*)wsm;
    int units = cols / 8;
    for (int b0 = 0; b0 < nu; b0 += ub) {
        int nb = min(ub, nu - b0);
        if (b0 > 0) __syncthreads(); // the previous batch's rows are no longer read
        moe_stage(nb * nv, [&](int i, const uint4*& s, uint4*& d) {
            int e = i / nv, j = i - e * nv;
            s = (const uint4*)(W + (long long)max(uq[b0 + e], 0) * slab + (long long)r0 * row_bytes) + j;
            d = w4 + e * slot + j;
        });
        __syncthreads();
        for (int p = 0; p < pairs; p++) {
            int ui = pu[p] - b0;
            if (ui < 0 || ui >= nb) continue; // uniform
            const u8* rows0 = wsm + (long long)ui * rb * row_bytes;
            const float* xr[1] = {hx + (long long)p * cols};
            float acc[MOE_G][1];
#pragma unroll
            for (int i = 0; i < MOE_G; i++) acc[i][0] = 0.0f;
            for (int u = tid; u < units; u += MOE_THREADS) {
                float xs[1][1][8], sx[1][1];
                moe_x<1, 1>(xr, 1, u, xs, sx);
                if (nr == rb) { // no guards: the row-dots interleave
#pragma unroll
                    for (int i = 0; i < MOE_G; i++) MoeDot<T, 1, 1>::dot(rows0 + i * row_bytes, u, xs, sx, gs, ss, acc[i], 1);
                } else {
#pragma unroll
                    for (int i = 0; i < MOE_G; i++)
                        if (i < nr) MoeDot<T, 1, 1>::dot(rows0 + i * row_bytes, u, xs, sx, gs, ss, acc[i], 1);
                }
            }
            float v = moe_bfly<MOE_G, 1>(acc);
            int idx = lane / (DS4_WARP / MOE_G);
            if (lane % (DS4_WARP / MOE_G) == 0) red[warp * ((pairs * rb + 3) & ~3) + p * rb + idx] = v;
        }
    }
    __syncthreads();
    for (int i = tid; i < n * nr; i += MOE_THREADS) {
        int t = i / nr, lr = i % nr;
        float o = 0.0f; // slots in selection order, each the sum of its warps' partials in order
        for (int s = 0; s < k; s++) {
            int p = t * k + s;
            float v = 0.0f;
            for (int w = 0; w < MOE_WARPS; w++) v += red[w * ((pairs * rb + 3) & ~3) + p * rb + lr];
            o += v;
        }
        out[(long long)t * rows + r0 + lr] = o;
    }
}

#define MOEGU_PARAMS                                                                                                   \
    const u8 *__restrict__ Wg, const u8 *__restrict__ Wu, const int *__restrict__ sel, long long slab,                \
        const float *__restrict__ x, int n, int k, const float *__restrict__ wgt, float clamp, float *__restrict__ h,   \
        int rows, int cols, long long row_bytes, int rb
#define MOEGU_ARGS Wg, Wu, sel, slab, x, n, k, wgt, clamp, h, rows, cols, row_bytes, rb
#define MOEDN_PARAMS                                                                                                   \
    const u8 *__restrict__ W, const int *__restrict__ sel, long long slab, const float *__restrict__ hx, int n, int k, \
        float *__restrict__ out, int rows, int cols, long long row_bytes, int ub
#define MOEDN_ARGS W, sel, slab, hx, n, k, out, rows, cols, row_bytes, ub

// NT = 1 serves n = 1, NT = 2 n = 2, NT = 4 n = 3, 4 (one slice per unit: fewer x registers).
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_iq2_xxs(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_IQ2_XXS, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_iq2_xxs(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_IQ2_XXS, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_iq2_xxs(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_IQ2_XXS, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_q2_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q2_K, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_q2_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q2_K, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_q2_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q2_K, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_q4_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q4_K, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_q4_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q4_K, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_q4_k(MOEGU_PARAMS) { ds4_pdl_enter(); moegu_body<T_Q4_K, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_iq2_xxs(MOEDN_PARAMS) { ds4_pdl_enter(); moedn_body<T_IQ2_XXS>(MOEDN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_q2_k(MOEDN_PARAMS) { ds4_pdl_enter(); moedn_body<T_Q2_K>(MOEDN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_q4_k(MOEDN_PARAMS) { ds4_pdl_enter(); moedn_body<T_Q4_K>(MOEDN_ARGS); }

// ===================================================================================================
// Form 2 (m2*): no staging of weights. A lane owns one "unit" of 32 columns (4 slices of 8; which
// columns depends on the block format, m2_col) of every row, keeps x of those columns in
// registers and loads its bytes of M2 rows straight from global memory (all loads of a batch
// before any math). A row group of wpg = ceil(units / DS4_WARP) warps covers a row; a CTA has
// rg = warps / wpg groups. IQ2_XXS: grid from shared memory (u64), signs expanded by ALU.
// Gate/up writes h in the order the down kernel's lanes read it (m2_hidx: one coalesced
// 16-byte load per lane and slice half), so the down kernel reads h straight from global memory.
// ===================================================================================================
#define M2_THREADS 256
#define M2_WARPS (M2_THREADS / DS4_WARP)
#define M2_LB2 M2_THREADS, 2 // at most 128 registers: 2 CTAs per SM

// Gate/up output rows per batch (2x row-dots) and down rows per batch, per weight type (more
// spill at 128 registers).
template <int T> struct M2Rb {
    static constexpr int GU = (T == T_Q4_K) ? 2 : 4;
    static constexpr int DN = 4;
};

// First column of slice j (8 columns) of unit u.
template <int T> __device__ __forceinline__ int m2_col(int u, int j) {
    if (T == T_Q2_K) return 256 * (u >> 3) + 128 * ((u >> 2) & 1) + 32 * j + 8 * (u & 3);
    if (T == T_Q4_K) return 256 * (u >> 3) + 64 * ((u >> 1) & 3) + 32 * (j >> 1) + 16 * (u & 1) + 8 * (j & 1);
    return 32 * u + 8 * j;
}

// Inverse of m2_col for layout kind lk (1: Q2_K, 2: Q4_K, else 32 consecutive): column c is
// element e of slice j of unit u.
__device__ __forceinline__ void m2_inv(int lk, int c, int& u, int& j, int& e) {
    int b = c >> 8, r = c & 255;
    e = c & 7;
    if (lk == 1) {
        u = 8 * b + 4 * (r >> 7) + ((r & 31) >> 3);
        j = (r >> 5) & 3;
    } else if (lk == 2) {
        u = 8 * b + 2 * (r >> 6) + ((r >> 4) & 1);
        j = 2 * ((r >> 5) & 1) + ((r >> 3) & 1);
    } else {
        u = c >> 5;
        j = (c >> 3) & 3;
    }
}

// h of one pair in down-lane order: [unit / W][slice j][half][unit % W][4].
__device__ __forceinline__ int m2_hidx(int u, int j, int e) {
    return (((u / DS4_WARP) * 8 + 2 * j + (e >> 2)) * DS4_WARP + (u % DS4_WARP)) * 4 + (e & 3);
}

// Sign bytes (0x80 where negative) of the 8 elements of an IQ2_XXS run with 7-bit field s7
// (element 7: parity of s7): bit l moves to bit 8l + 7 by one multiply.
__device__ __forceinline__ void m2_signs(u32 s7, u32& lo, u32& hi) {
    lo = (s7 * 0x10204080u) & 0x80808080u; // bits 4..6 land on no sign bit and carry nowhere
    hi = (((s7 >> 4) * 0x10204080u) & 0x80808080u) | ((u32)__popc(s7) << 31); // element 7: parity
}

template <int T> struct M2;

// IQ2_XXS unit u = chunk u (group g = u & 7 of block u >> 3): its 8 bytes (4 grid indices, aux)
// at 66b + 2 + 8g (2-byte aligned), read as aligned words and funnel-shifted.
template <> struct M2<T_IQ2_XXS> {
    struct Raw {
        u32 a, b, c, d;
    };
    struct Off {
        int o, od;
        u32 sh;
    };
    static __device__ __forceinline__ Off off(int u) {
        int b = u >> 3, o = 66 * b + 2 + 8 * (u & 7);
        return {o & ~3, 66 * b, (u32)(o & 2) * 8};
    }
    static __device__ __forceinline__ Raw load(const u8* __restrict__ row, const Off& f) {
        const u32* p = (const u32*)(row + f.o);
        Raw r;
        r.a = p[0], r.b = p[1];
        r.c = f.sh ? p[2] : 0u; // not past the row's end when aligned
        r.d = *((const u16*)(row + f.od));
        return r;
    }
    template <int NT>
    static __device__ __forceinline__ void dot(const Raw& r, const Off& f, const float (&x)[NT][32], const float (&sx)[NT][4],
                                               const u64* gs, float (&acc)[NT]) {
        u32 idx4 = (u32)((((u64)r.b << 32) | r.a) >> f.sh), aux = (u32)((((u64)r.c << 32) | r.b) >> f.sh);
        float db = ds4_mul_rn(ds4_mul_rn(ds4_h2f_fast(r.d), 0.5f + (float)(aux >> 28)), 0.25f) * MOE_UN;
        float a[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) a[t] = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            u64 gr = gs[(idx4 >> (8 * q)) & 0xffu];
            u32 sl, sh;
            m2_signs((aux >> (7 * q)) & 127u, sl, sh);
            u32 ml = (u32)gr, mh = (u32)(gr >> 32);
            float w[8];
#pragma unroll
            for (int l = 0; l < 4; l++) w[l] = moe_su(ml, sl, l), w[4 + l] = moe_su(mh, sh, l);
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int l = 0; l < 8; l++) a[t] = fmaf(w[l], x[t][8 * q + l], a[t]);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = fmaf(db, a[t], acc[t]);
    }
};

// Q2_K unit u = (block b, half h, quarter q): elements 128h + 32j + 8q + l of slice j are
// (qs[32h + 8q + l] >> 2j) & 3 with scale byte 8h + 2j + q/2. 5 aligned words.
template <> struct M2<T_Q2_K> {
    struct Raw {
        u32 q0, q1, s0, s1, dd;
    };
    struct Off {
        int oq, os, od;
        u32 i8;
    };
    static __device__ __forceinline__ Off off(int u) {
        int b = u >> 3, h = (u >> 2) & 1, q = u & 3;
        return {84 * b + 16 + 32 * h + 8 * q, 84 * b + 8 * h, 84 * b + 80, (u32)(8 * (q >> 1))};
    }
    static __device__ __forceinline__ Raw load(const u8* __restrict__ row, const Off& f) {
        Raw r;
        const u32 *q = (const u32*)(row + f.oq), *s = (const u32*)(row + f.os);
        r.q0 = q[0], r.q1 = q[1], r.s0 = s[0], r.s1 = s[1];
        r.dd = *((const u32*)(row + f.od));
        return r;
    }
    template <int NT>
    static __device__ __forceinline__ void dot(const Raw& r, const Off& f, const float (&x)[NT][32], const float (&sx)[NT][4],
                                               const u64* gs, float (&acc)[NT]) {
        // d * 2^49 (exact) times the scale rounds as (d * scale) * 2^49.
        float d = ds4_h2f_fast(r.dd & 0xffffu) * MOE_UN, dmin = ds4_h2f_fast(r.dd >> 16);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 sc = ((j < 2 ? r.s0 : r.s1) >> (16 * (j & 1) + f.i8)) & 0xffu;
            float dl = ds4_mul_rn(d, (float)(sc & 15u)), ml = ds4_mul_rn(dmin, (float)(sc >> 4));
            u32 v0 = (r.q0 >> (2 * j)) & 0x03030303u, v1 = (r.q1 >> (2 * j)) & 0x03030303u;
            float w[8];
#pragma unroll
            for (int l = 0; l < 4; l++) w[l] = moe_u(v0, l), w[4 + l] = moe_u(v1, l);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float a = 0.0f;
#pragma unroll
                for (int l = 0; l < 8; l++) a = fmaf(w[l], x[t][8 * j + l], a);
                acc[t] = fmaf(dl, a, fmaf(-ml, sx[t][j], acc[t]));
            }
        }
    }
};

// Scale byte i (0..11) of a K-quant header (x: d, dmin; y, z, w: the 12 scale bytes).
__device__ __forceinline__ u32 m2_sb(const uint4& hd, int i) {
    u32 w = i < 4 ? hd.y : (i < 8 ? hd.z : hd.w);
    return (w >> (8 * (i & 3))) & 0xffu;
}

// Q4_K unit u = (block b, pair k, half hh): the 16 bytes qs[32k + 16hh ..]; low nibbles are
// sub-block 2k (slices 0, 1), high nibbles sub-block 2k + 1 (slices 2, 3). Two 16-byte loads.
template <> struct M2<T_Q4_K> {
    struct Raw {
        uint4 hd, q;
    };
    struct Off {
        int oh, oq, p;
    };
    static __device__ __forceinline__ Off off(int u) {
        int b = u >> 3, k = (u >> 1) & 3;
        return {144 * b, 144 * b + 16 + 32 * k + 16 * (u & 1), 2 * k};
    }
    static __device__ __forceinline__ Raw load(const u8* __restrict__ row, const Off& f) {
        Raw r;
        r.hd = *((const uint4*)(row + f.oh));
        r.q = *((const uint4*)(row + f.oq));
        return r;
    }
    template <int NT>
    static __device__ __forceinline__ void dot(const Raw& r, const Off& f, const float (&x)[NT][32], const float (&sx)[NT][4],
                                               const u64* gs, float (&acc)[NT]) {
        float d = ds4_h2f_fast(r.hd.x & 0xffffu), dmin = ds4_h2f_fast(r.hd.x >> 16);
        u32 qw[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            int p = f.p + hi;
            u32 s, mn;
            if (p < 4) {
                s = m2_sb(r.hd, p) & 63u;
                mn = m2_sb(r.hd, p + 4) & 63u;
            } else {
                s = (m2_sb(r.hd, p + 4) & 15u) | ((m2_sb(r.hd, p - 4) >> 6) << 4);
                mn = (m2_sb(r.hd, p + 4) >> 4) | ((m2_sb(r.hd, p) >> 6) << 4);
            }
            float dl = ds4_mul_rn(d, (float)s) * MOE_UN, ml = ds4_mul_rn(dmin, (float)mn);
            float a[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) a[t] = 0.0f;
#pragma unroll
            for (int wi = 0; wi < 4; wi++) {
                u32 v = (qw[wi] >> (4 * hi)) & 0x0f0f0f0fu;
#pragma unroll
                for (int l = 0; l < 4; l++) {
                    float w = moe_u(v, l);
#pragma unroll
                    for (int t = 0; t < NT; t++) a[t] = fmaf(w, x[t][16 * hi + 4 * wi + l], a[t]);
                }
            }
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = fmaf(dl, a[t], fmaf(-ml, sx[t][2 * hi] + sx[t][2 * hi + 1], acc[t]));
        }
    }
};

// x of a lane's unit for NT tokens (form 2): xs prescaled by MOE_XS, sx slice sums.
template <int NT> struct MX {
    float xs[NT][32], sx[NT][4];
    __device__ __forceinline__ void set(int t, const float (&v)[32]) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float* a = &v[8 * j];
            sx[t][j] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
#pragma unroll
            for (int l = 0; l < 8; l++) xs[t][8 * j + l] = a[l] * MOE_XS;
        }
    }
    template <int T>
    __device__ __forceinline__ void dot(const typename M2<T>::Raw& r, const typename M2<T>::Off& f, const u64* gs,
                                        float (&acc)[NT]) const {
        M2<T>::template dot<NT>(r, f, xs, sx, gs, acc);
    }
};

template <int T> __device__ __forceinline__ void m2_grid(u64* gs) {
    if (T != T_IQ2_XXS) return;
    for (int i = threadIdx.x; i < 256; i += M2_THREADS) gs[i] = ds4_iq2xxs_grid[i];
}

// Gate + up + SwiGLU. CTA (row tile of tr = rg * RB * nb rows, pair p = blockIdx.y); as moegu,
// the first pair holding expert e works for every token routed to e, NT tokens at a time (x of
// those tokens staged once per CTA in shared memory, [NT][8 slice halves][upp units], upp odd:
// no bank conflicts either way). Writes h[pp * hs + m2_hidx(column r in down layout lk)].
// Shared memory: grid (2 KB), red[warps][nb][2 RB][NT], x.
template <int T, int NT>
__device__ __forceinline__ void m2gu_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu, const int* __restrict__ sel,
                                          long long slab, const float* __restrict__ x, int n, int k,
                                          const float* __restrict__ wgt, float clamp, float* __restrict__ h, int rows,
                                          int cols, long long row_bytes, int nb, int lk, int hs) {
    constexpr int RB = M2Rb<T>::GU, G = 2 * RB;
    u64* gs = (u64*)moe_smem;
    float* red = (float*)(gs + 256);
    float4* xsm = (float4*)(red + ((M2_WARPS * nb * G * NT + 3) & ~3));
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    int p = blockIdx.y, e = sel[p];
    for (int q = 0; q < p; q++)
        if (sel[q] == e) return; // an earlier pair computes expert e (uniform over the CTA)
    int tok[4], m = 0;           // tokens routed to e (n <= 4)
    for (int t = 0; t < n; t++) {
        bool use = false;
        for (int s = 0; s < k; s++) use |= sel[t * k + s] == e;
        if (use) {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j == m) tok[j] = t;
            m++;
        }
    }
    int units = cols / 32, wpg = (units + DS4_WARP - 1) / DS4_WARP, rg = M2_WARPS / wpg, upp = units | 1;
    int g = warp / wpg, wig = warp % wpg, u = wig * DS4_WARP + lane;
    bool valid = g < rg && u < units;
    int tr = rg * RB * nb, r0 = blockIdx.x * tr;
    m2_grid<T>(gs);
    typename M2<T>::Off f = M2<T>::off(min(u, units - 1));
    const u8* gb = Wg + (long long)max(e, 0) * slab;
    const u8* ub = Wu + (long long)max(e, 0) * slab;
    typename M2<T>::Raw raw[G];
    auto load_batch = [&](int bi) {
        int rb0 = r0 + (bi * rg + g) * RB;
#pragma unroll
        for (int i = 0; i < G; i++) {
            int r = min(rb0 + (i % RB), rows - 1);
            raw[i] = M2<T>::load((i < RB ? gb : ub) + (long long)r * row_bytes, f);
        }
    };
    if (g < rg) load_batch(0); // in flight while x is staged
    for (int t0 = 0; t0 < m; t0 += NT) {
        if (t0 > 0) __syncthreads(); // the previous group's x and partials are no longer read
        for (int i = tid; i < NT * (cols / 4); i += M2_THREADS) {
            int tt = i / (cols / 4), c = 4 * (i % (cols / 4)), uu, jj, ee;
            m2_inv(T == T_Q2_K ? 1 : (T == T_Q4_K ? 2 : 0), c, uu, jj, ee);
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t0 + tt < m) {
                int t = 0;
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (j == t0 + tt) t = tok[j];
                v = *(const float4*)(x + (long long)t * cols + c);
            }
            xsm[(tt * 8 + 2 * jj + (ee >> 2)) * upp + uu] = v;
        }
        __syncthreads();
        MX<NT> xv;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v[32];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
                if (valid) a = xsm[(t * 8 + j) * upp + u];
                v[4 * j] = a.x, v[4 * j + 1] = a.y, v[4 * j + 2] = a.z, v[4 * j + 3] = a.w;
            }
            xv.set(t, v);
        }
        if (g < rg) {
            for (int bi = 0; bi < nb; bi++) {
                float acc[G][NT];
#pragma unroll
                for (int i = 0; i < G; i++) {
#pragma unroll
                    for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
                    xv.template dot<T>(raw[i], f, gs, acc[i]);
                }
                // The next batch's rows (or the first batch again for the next token group)
                // into the registers just used: their latency overlaps the reduction and x.
                if (bi + 1 < nb || t0 + NT < m) load_batch(bi + 1 < nb ? bi + 1 : 0);
                float v = moe_bfly<G, NT>(acc);
                int per = DS4_WARP / (G * NT);
                if (lane % per == 0) red[(warp * nb + bi) * G * NT + lane / per] = v;
            }
        }
        __syncthreads();
        for (int i = tid; i < tr * NT; i += M2_THREADS) {
            int lr = i % tr, j = i / tr, r = r0 + lr;
            if (t0 + j >= m || r >= rows) continue;
            int bi = lr / (rg * RB), gg = (lr / RB) % rg, ri = lr % RB;
            float gv = 0.0f, uv = 0.0f; // warps of the group in order
            for (int w = 0; w < wpg; w++) {
                const float* rw = red + ((gg * wpg + w) * nb + bi) * G * NT;
                gv += rw[ri * NT + j];
                uv += rw[(RB + ri) * NT + j];
            }
            gv = fminf(gv, clamp);
            uv = fminf(fmaxf(uv, -clamp), clamp);
            float base = gv * (1.0f / (1.0f + expf(-gv))) * uv;
            int t = 0;
#pragma unroll
            for (int jj = 0; jj < 4; jj++)
                if (jj == t0 + j) t = tok[jj];
            int uu, sj, ee;
            m2_inv(lk, r, uu, sj, ee);
            int hi = m2_hidx(uu, sj, ee);
            for (int pp = t * k; pp < t * k + k; pp++)
                if (sel[pp] == e) h[(long long)pp * hs + hi] = base * wgt[pp];
        }
    }
}

// Down + slot sum. CTA: tr = RB * nbr output rows of every distinct expert; items (distinct
// expert, batch of RB rows) are split among the row groups; for each item, the pairs using the expert,
// NT at a time (x = their h, read straight from global memory). Warp totals into
// red[wig][pair][tr]; then out = sum over slots in selection order of the sum over the warps of
// the group in order (deterministic). Shared memory: grid, uq/pu/plist/pst (4 MAXP + 1 ints), red.
template <int T, int NT>
__device__ __forceinline__ void m2dn_body(const u8* __restrict__ W, const int* __restrict__ sel, long long slab,
                                          const float* __restrict__ hx, int n, int k, float* __restrict__ out, int rows,
                                          int cols, long long row_bytes, int nbr, int hs) {
    constexpr int RB = M2Rb<T>::DN;
    u64* gs = (u64*)moe_smem;
    int* uq = (int*)(gs + 256); // distinct experts, first-use order
    int* pu = uq + MOE_MAXP;     // pair -> distinct index
    int* pl = pu + MOE_MAXP;     // pairs grouped by distinct expert (stable)
    int* pst = pl + MOE_MAXP;    // [MOE_MAXP + 1] group starts
    float* red = (float*)(pst + MOE_MAXP + 4);
    int pairs = n * k, tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    __shared__ int nu_s;
    if (tid == 0) {
        int nu = 0;
        for (int p = 0; p < pairs; p++) {
            int e = sel[p], fi = -1;
            for (int i = 0; i < nu; i++)
                if (uq[i] == e) fi = i;
            if (fi < 0) uq[nu] = e, fi = nu++;
            pu[p] = fi;
        }
        int c = 0;
        for (int i = 0; i < nu; i++) {
            pst[i] = c;
            for (int p = 0; p < pairs; p++)
                if (pu[p] == i) pl[c++] = p;
        }
        pst[nu] = c;
        nu_s = nu;
    }
    m2_grid<T>(gs);
    __syncthreads();
    int nu = nu_s;
    int units = cols / 32, wpg = (units + DS4_WARP - 1) / DS4_WARP, rg = M2_WARPS / wpg;
    int g = warp / wpg, wig = warp % wpg, u = wig * DS4_WARP + lane;
    bool valid = u < units;
    int tr = RB * nbr, r0 = blockIdx.x * tr;
    typename M2<T>::Off f = M2<T>::off(min(u, units - 1));
    // Each group takes a contiguous range of items, so x (h of the expert's pairs) mostly stays
    // in registers from one item to the next; the next item's rows load into the registers the
    // dots just freed.
    int items = nu * nbr, per = (items + rg - 1) / rg, it0 = g * per, it1 = min(it0 + per, items);
    typename M2<T>::Raw raw[RB];
    auto load_item = [&](int it) {
        const u8* wb = W + (long long)max(uq[it / nbr], 0) * slab;
        int rb0 = r0 + (it % nbr) * RB;
#pragma unroll
        for (int ri = 0; ri < RB; ri++) raw[ri] = M2<T>::load(wb + (long long)min(rb0 + ri, rows - 1) * row_bytes, f);
    };
    if (g < rg && it0 < it1) {
        load_item(it0);
        MX<NT> xv;
        int xi = -1, xq = -1;
        for (int it = it0; it < it1; it++) {
            int i = it / nbr, bi = it % nbr;
            for (int q0 = pst[i]; q0 < pst[i + 1]; q0 += NT) {
                if (i != xi || q0 != xq) {
                    xi = i, xq = q0;
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        bool ok = valid && q0 + t < pst[i + 1];
                        const float4* hp = (const float4*)(hx + (long long)pl[min(q0 + t, pst[i + 1] - 1)] * hs) + wig * 8 * DS4_WARP + lane;
                        float v[32];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
                            if (ok) a = hp[j * DS4_WARP];
                            v[4 * j] = a.x, v[4 * j + 1] = a.y, v[4 * j + 2] = a.z, v[4 * j + 3] = a.w;
                        }
                        xv.set(t, v);
                    }
                }
                float acc[RB][NT];
#pragma unroll
                for (int ri = 0; ri < RB; ri++) {
#pragma unroll
                    for (int t = 0; t < NT; t++) acc[ri][t] = 0.0f;
                    xv.template dot<T>(raw[ri], f, gs, acc[ri]);
                }
                if (q0 + NT < pst[i + 1])
                    ; // the same rows again for the expert's next pairs
                else if (it + 1 < it1)
                    load_item(it + 1);
                float v = moe_bfly<RB, NT>(acc);
                int pr = DS4_WARP / (RB * NT), vi = lane / pr, t = vi % NT;
                if (lane % pr == 0 && q0 + t < pst[i + 1]) red[(wig * pairs + pl[q0 + t]) * tr + bi * RB + vi / NT] = v;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < n * tr; i += M2_THREADS) {
        int t = i / tr, lr = i % tr;
        if (r0 + lr >= rows) continue;
        float o = 0.0f; // slots in selection order, each the sum of its group's warps in order
        for (int s = 0; s < k; s++) {
            float v = 0.0f;
            for (int w = 0; w < wpg; w++) v += red[(w * pairs + t * k + s) * tr + lr];
            o += v;
        }
        out[(long long)t * rows + r0 + lr] = o;
    }
}

#define M2GU_PARAMS                                                                                                    \
    const u8 *__restrict__ Wg, const u8 *__restrict__ Wu, const int *__restrict__ sel, long long slab,                \
        const float *__restrict__ x, int n, int k, const float *__restrict__ wgt, float clamp, float *__restrict__ h,   \
        int rows, int cols, long long row_bytes, int nb, int lk, int hs
#define M2GU_ARGS Wg, Wu, sel, slab, x, n, k, wgt, clamp, h, rows, cols, row_bytes, nb, lk, hs
#define M2DN_PARAMS                                                                                                    \
    const u8 *__restrict__ W, const int *__restrict__ sel, long long slab, const float *__restrict__ hx, int n, int k, \
        float *__restrict__ out, int rows, int cols, long long row_bytes, int nbr, int hs
#define M2DN_ARGS W, sel, slab, hx, n, k, out, rows, cols, row_bytes, nbr, hs

// <1>: one token per expert at a time (x in 32 registers), <2>: two.
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2gu1_iq2_xxs(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_IQ2_XXS, 1>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2gu2_iq2_xxs(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_IQ2_XXS, 2>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2gu1_q2_k(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_Q2_K, 1>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2gu2_q2_k(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_Q2_K, 2>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2gu1_q4_k(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_Q4_K, 1>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2gu2_q4_k(M2GU_PARAMS) { ds4_pdl_enter(); m2gu_body<T_Q4_K, 2>(M2GU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2dn1_iq2_xxs(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_IQ2_XXS, 1>(M2DN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2dn2_iq2_xxs(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_IQ2_XXS, 2>(M2DN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2dn1_q2_k(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_Q2_K, 1>(M2DN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2dn2_q2_k(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_Q2_K, 2>(M2DN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_LB2) m2dn1_q4_k(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_Q4_K, 1>(M2DN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(M2_THREADS) m2dn2_q4_k(M2DN_PARAMS) { ds4_pdl_enter(); m2dn_body<T_Q4_K, 2>(M2DN_ARGS); }

// ===================================================================================================
// Form 3 (m3*, "v3d", n = 1; n = 2..4 as n one-token products, CUDA sm_80+): gate + up of IQ2_XXS experts (m3gu1) and the Q2_K
// down (m3dn1, below) on tensor cores, exact in the weights. Gate / up: mma.sync m16n8k16 f16 x f16 -> f32: A = 16 weight rows (rows 0-7: gate rows r..r+7,
// rows 8-15: the same up rows, so one lane ends with gate and up of its row), B column 0 = x_hi,
// column 1 = x_lo (x * 2^sigma split in two f16: ~22 bits; sigma puts max |x| in [2^14, 2^15)),
// the other columns unused; C column 0 + column 1 = the dot. K is permuted inside each 128-column
// chunk (4 sub-blocks of 32, 8 mma steps): lane (gid = lane / 4, tig = lane % 4) holds sub-block
// tig of the chunk, step j = its elements 4j..4j+3 (grid entry j / 2), and B is stored in the same
// order. A weight element is sign * grid * (2 ls + 1) (an integer <= 1333), as the f16 subnormal
// value * 2^-24 (one PRMT builds a half2 from grid and sign bytes, one HMUL2 scales it; both exact;
// HMMA keeps f16 subnormal inputs: ops_moe on the H200). One fresh mma chain per 256-column
// block, then acc += d * (c0 + c1) (times 2^24 / 8 / 2^sigma at the end). The normal-integer
// variant (bias 1024 + HFMA2, sign by XOR) was slower (bench/results/gpu-moe-m8-h200.txt).
// Rows staged by cp.async 16-byte copies: a stage is 16 rows x 2048 columns (528 bytes a row, at a
// 544-byte stride: fewer bank conflicts), 3 stages in flight; warp w decodes block w of a stage.
// CTA: nb tiles of 8 output rows of expert e = sel[blockIdx.y] (first pair holding e, as v2);
// h in plain order [pair][ff] and mx[pair][CTA] = the CTA's max |h| (the down kernel's x scale).
// Shared memory: grid (2 KB), x fragments (cols * 4 bytes), red[8 warps][16], 3 stages
// (3 * 16 * 544 bytes). Session 9 (bench/results/gpu-moe-m9-h200.txt): raw words by two aligned
// loads and B loaded only by the lanes that use it (m3gu_dec) took shared-memory wavefronts from
// 80% to 69% of peak and the kernel from 35.6 to 34.3 us; the kernel is then latency-bound
// (stalls: short scoreboard, barrier, math pipe throttle at 58% issue). Lost there (code in
// 90d531e): the grid as 4-byte nibble codes expanded by PRMT from a register pool (half the
// lookup wavefronts, but 14% more instructions: 36.9 us), two interleaved mma chains (no faster,
// another summation order), x staged by all 512 down threads (more instructions). Session 15
// (bench/results/gpu-moe-i15-h200.txt; code in daf853e): the gate/up on int8 tensor cores (mma
// m16n8k32 s8 -> s32, one k step = one sub-block, its scale by one IMAD on the int32 result, x as
// 4 int8 limbs per 256-column super-block) lost: the 4 lanes of a quad share a row's sub-block,
// so each loads and decodes the sub-block's scale and signs itself, which ate the saved HMUL2 /
// PRMT; best form 37.5 us under ncu against 35.4, a tie end to end.
// ===================================================================================================
#define M3_THREADS 256
#define M3_SROW 544 // staged row stride (528 used)
#define M3_STAGE (16 * M3_SROW)
#define M3_LB4 M3_THREADS, 4 // at most 64 registers: 4 CTAs per SM (shared memory allows 4)

#if defined(DS4_CUDA) && DS4_ARCH >= 800
__device__ __forceinline__ void m3_cp16(void* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// Eight floats as f16 pairs hi = f16(v) and lo = f16(v - hi) (the differences are exact): x to
// ~22 bits as two B columns of one mma.
__device__ __forceinline__ void m3_split8(const float (&v)[8], uint4& hi, uint4& lo) {
    u32 h[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) ds4_f16x2_split(v[2 * i], v[2 * i + 1], h[i], l[i]);
    hi = make_uint4(h[0], h[1], h[2], h[3]);
    lo = make_uint4(l[0], l[1], l[2], l[3]);
}
// ds4_mma_f16 with the A fragment as four values (rows 0-7 and 8-15 built separately here).
__device__ __forceinline__ void m3_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    ds4_mma_f16(c, a, b0, b1);
}

// Half2 words w[0..3] (element pairs 01, 23, 45, 67) of grid entry gr with sign bytes (0x80 where
// negative) sl (elements 0-3), sh (4-7), times the sub-block factor m2 (f16x2 of 2 ls + 1).
__device__ __forceinline__ void m3_entry(u64 gr, u32 sl, u32 sh, u32 m2, u32 (&w)[4]) {
    u32 ml = (u32)gr, mh = (u32)(gr >> 32);
    // bytes [g0, s0, g1, s1]: the f16 subnormals +-g * 2^-24, then * (2 ls + 1): exact.
    w[0] = ds4_hmul2(ds4_prmt(ml, sl, 0x5140), m2);
    w[1] = ds4_hmul2(ds4_prmt(ml, sl, 0x7362), m2);
    w[2] = ds4_hmul2(ds4_prmt(mh, sh, 0x5140), m2);
    w[3] = ds4_hmul2(ds4_prmt(mh, sh, 0x7362), m2);
}

// Sub-block words of one staged row (4-byte aligned): the 8 bytes at byte o (even) as idx4 (4 grid
// indices) and aux (4 x 7 sign bits, 4-bit scale), from the 12 aligned bytes at o & ~3. A8: that
// address is 8-byte aligned (LDS.64 + LDS.32), else it is 4 mod 8 (LDS.32 + LDS.64); uniform over
// a warp (o mod 8 depends on the warp's block only). Two loads instead of three LDS.32, which
// also had 2-way bank conflicts (rows at a 544-byte stride).
template <bool A8> __device__ __forceinline__ void m3_sub(const u8* row, int o, u32& idx4, u32& aux) {
    const u32* q = (const u32*)(row + (o & ~3));
    u32 a, b, c;
    if (A8) {
        uint2 v = *(const uint2*)q;
        a = v.x, b = v.y, c = q[2];
    } else {
        uint2 v = *(const uint2*)(q + 1);
        a = q[0], b = v.x, c = v.y;
    }
    u32 sh = (u32)(o & 2) * 8u;
    idx4 = __funnelshift_r(a, b, sh);
    aux = __funnelshift_r(b, c, sh);
}

// Sign bytes (0x80 where negative) of the 8 elements of a run with 7-bit field s7 (element 7:
// parity): bit l to bit 8l + 7 by one multiply each half (the shifted copies do not overlap).
__device__ __forceinline__ void m3_signs(u32 s7, u32& lo, u32& hi) {
    lo = (s7 * 0x10204080u) & 0x80808080u;                            // bits 0-3 -> 7, 15, 23, 31
    hi = ((s7 * 0x00020408u) & 0x00808080u) | ((u32)__popc(s7) << 31); // bits 4-6 -> 7, 15, 23
}

// One stage of a warp: block bw of the staged gate rows rg and up rows ru, times x, into c4. A8: see
// m3_sub. B: lanes gid 0 / 1 load x_hi / x_lo; the others keep zeros in bx (never loaded: C
// columns 2-7 are never read, and a column of C depends on its column of B only). A 16-byte LDS
// costs a wavefront per 8 lanes even where lanes repeat addresses, so the old duplicate loads
// of lanes 8-31 cost 4 instead of 1 (ncu: L1/TEX 80% -> 69%). bx: two fragments in turn.
// ITEMS (m3gus_iq2_xxs): the 8 columns are 8 items' x (one f16 plane), every lane loads its item
// gid's fragment (xf: [chunk][entry][item][tig]).
template <bool A8, bool ITEMS = false>
__device__ __forceinline__ void m3gu_dec(const u8* rg, const u8* ru, const u64* gs, const uint4* xf, int warp, int tig,
                                         int lane, int bw, float (&c4)[4], uint4 (&bx)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        int sb = 4 * hh + tig, c = 2 * bw + hh, o = 66 * warp + 2 + 8 * sb;
        u32 ig, xg, iu, xu;
        m3_sub<A8>(rg, o, ig, xg);
        m3_sub<A8>(ru, o, iu, xu);
        u32 mg = 1u + 2u * (xg >> 28), mu = 1u + 2u * (xu >> 28);
        const u32 b1k = 0x64006400u;
        u32 m2g = ds4_hsub2((mg | (mg << 16)) | b1k, b1k), m2u = ds4_hsub2((mu | (mu << 16)) | b1k, b1k);
        const uint4* xb = ITEMS ? xf + (c * 4) * 32 + lane : xf + (c * 4) * 8 + (lane & 7);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            if (ITEMS)
                bx[q & 1] = xb[q * 32];
            else if (lane < 8)
                bx[q & 1] = xb[q * 8];
            u32 slg, shg, slu, shu;
            m3_signs((xg >> (7 * q)) & 127u, slg, shg);
            m3_signs((xu >> (7 * q)) & 127u, slu, shu);
            u32 wg[4], wu[4];
            m3_entry(gs[(ig >> (8 * q)) & 0xffu], slg, shg, m2g, wg);
            m3_entry(gs[(iu >> (8 * q)) & 0xffu], slu, shu, m2u, wu);
            m3_mma(c4, wg[0], wu[0], wg[1], wu[1], bx[q & 1].x, bx[q & 1].y);
            m3_mma(c4, wg[2], wu[2], wg[3], wu[3], bx[q & 1].z, bx[q & 1].w);
        }
    }
}

// The row stages of m3gu_body and m3gus_iq2_xxs (a macro, not a struct or a function: the two
// kernels' SASS stays the one that was tested and timed; a struct changed ptxas's allocation of
// m3gu1_iq2_xxs, 84f49a9): this thread's copy offsets of a stage (item i = tid + 256 m of 16 rows
// x 33 vectors: item 0 is a gate row, item 2 an up row) and issue(), which stages the next (tile,
// 2048 columns kq) in order into buffer is_b of 3 and commits a group (an empty one past the
// last). Reads the caller's tid, row_bytes, ntl, r0c, ks_n, stg, gb, ub.
#define M3GU_STAGES \
    int R1 = (tid + M3_THREADS) / 33, R0 = tid / 33;                                                                                   \
    int so0 = R0 * (int)row_bytes + 16 * (tid - 33 * R0), do0 = R0 * M3_SROW + 16 * (tid - 33 * R0);                                   \
    int so1 = (R1 & 7) * (int)row_bytes + 16 * (tid + M3_THREADS - 33 * R1), do1 = R1 * M3_SROW + 16 * (tid + M3_THREADS - 33 * R1);   \
    int so2 = 7 * (int)row_bytes + 16 * (tid + 2 * M3_THREADS - 33 * 15), do2 = 15 * M3_SROW + 16 * (tid + 2 * M3_THREADS - 33 * 15);  \
    int is_t = 0, is_k = 0, is_b = 0; /* next stage to issue: tile, kq, buffer */                                                      \
    auto issue = [&]() {                                                                                                               \
        if (is_t < ntl) {                                                                                                              \
            long long to = (long long)(r0c + 8 * is_t) * row_bytes + 528 * is_k;                                                       \
            u8* dst = stg + is_b * M3_STAGE;                                                                                           \
            m3_cp16(dst + do0, gb + to + so0);                                                                                         \
            m3_cp16(dst + do1, (R1 < 8 ? gb : ub) + to + so1);                                                                         \
            if (tid < 16 * 33 - 2 * M3_THREADS) m3_cp16(dst + do2, ub + to + so2);                                                     \
            if (++is_k == ks_n) is_k = 0, is_t++;                                                                                      \
            is_b = is_b == 2 ? 0 : is_b + 1;                                                                                           \
        }                                                                                                                              \
        ds4_cp_commit();                                                                                                               \
    };

__device__ __forceinline__ void m3gu_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu, const int* __restrict__ sel,
                                          long long slab, const float* __restrict__ x, int n, int k,
                                          const float* __restrict__ wgt, float clamp, float* __restrict__ h, int rows,
                                          int cols, long long row_bytes, int nb, int lk, int hs, float* __restrict__ mx) {
    u64* gs = (u64*)moe_smem;
    uint4* xf = (uint4*)(gs + 256);             // [cols / 128 chunks][4 entries][2 parts][4 tig]
    float* red = (float*)(xf + cols / 4);       // [8 warps][16 rows]
    float* wmax = red + 8 * 16;                 // [8 warps]
    u8* stg = (u8*)(wmax + 8);                  // 3 stages (16-byte aligned: see the host)
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    // Pair p = (token p / k, slot p % k); n tokens (speculative verify steps: n <= 4, n k <= 32)
    // are n independent one-token products: each token's pairs as n = 1 runs them (same bits).
    int p = blockIdx.y, e = sel[p], q0 = p - p % k;
    for (int q = q0; q < p; q++)
        if (sel[q] == e) return; // an earlier pair of the token computes expert e (CTA-uniform)
    u32 pmask = 0;               // the token's pairs holding e (bit = pair index, < 32)
    for (int q = p; q < q0 + k; q++)
        if (sel[q] == e) pmask |= 1u << q;
    x += (long long)(p / k) * cols;
    int ks_n = cols / 2048, r0c = blockIdx.x * nb * 8;
    int ntl = min(nb, (rows - r0c + 7) / 8), S = ntl * ks_n;
    const u8* gb = Wg + (long long)max(e, 0) * slab;
    const u8* ub = Wu + (long long)max(e, 0) * slab;
    // Stages in order (tile, columns 2048 kq ..), counters instead of divisions. Staged row R =
    // gate (R < 8) or up row r0 + (R & 7); rows % 8 == 0: no row past the end.
    M3GU_STAGES
    issue();
    issue();
    m2_grid<T_IQ2_XXS>(gs);
    // sigma from max |x| (exact power of two; max is order-free: deterministic).
    float am = 0.0f;
    for (int i = tid; i < cols / 4; i += M3_THREADS) {
        float4 v = ((const float4*)x)[i];
        am = fmaxf(am, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    if (lane == 0) wmax[warp] = am;
    __syncthreads();
    am = wmax[0];
    for (int w = 1; w < 8; w++) am = fmaxf(am, wmax[w]);
    int ex = (int)((__float_as_uint(am) >> 23) & 255u) - 127, sig = min(max(14 - ex, -100), 100);
    float xsc = __uint_as_float((u32)(127 + sig) << 23);
    // Final factor: 2^24 (subnormal unit) / 8 / 2^sigma.
    float fin = __uint_as_float((u32)(127 + 21 - sig) << 23);
    // x fragments: entry q = (chunk c, entry jj, tig) = x[128c + 32 tig + 8 jj ..] as hi and lo.
    for (int q = tid; q < cols / 8; q += M3_THREADS) {
        int c = q >> 4, jj = (q >> 2) & 3, t = q & 3;
        const float4* src = (const float4*)(x + 128 * c + 32 * t + 8 * jj);
        float4 a = src[0], b = src[1];
        float v[8] = {a.x * xsc, a.y * xsc, a.z * xsc, a.w * xsc, b.x * xsc, b.y * xsc, b.z * xsc, b.w * xsc};
        uint4 hi, lo;
        m3_split8(v, hi, lo);
        xf[((c * 4 + jj) * 2 + 0) * 4 + t] = hi;
        xf[((c * 4 + jj) * 2 + 1) * 4 + t] = lo;
    }
    float ag = 0.0f, au = 0.0f, hmax = 0.0f;
    int kq = 0, tl = 0, bs = 0; // this stage: columns 2048 kq .., tile, buffer
    uint4 bx[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)}; // see m3gu_dec
    const bool al8 = ((66 * warp + 2) & 4) == 0; // this warp's (o & ~3) % 8 == 0 (m3_sub)
    for (int s = 0; s < S; s++) {
        ds4_cp_wait<1>(); // this thread's copies of stage s have landed
        __syncthreads(); // everyone's; stage s - 1 is no longer read
        issue();
        int bw = 8 * kq + warp; // this warp's block of the row
        const u8* rg = stg + bs * M3_STAGE + gid * M3_SROW;
        const u8* ru = rg + 8 * M3_SROW;
        float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (al8)
            m3gu_dec<true>(rg, ru, gs, xf, warp, tig, lane, bw, c4, bx);
        else
            m3gu_dec<false>(rg, ru, gs, xf, warp, tig, lane, bw, c4, bx);
        float dg = ds4_h2f_fast(*(const u16*)(rg + 66 * warp)), du = ds4_h2f_fast(*(const u16*)(ru + 66 * warp));
        ag = fmaf(dg, c4[0] + c4[1], ag);
        au = fmaf(du, c4[2] + c4[3], au);
        bs = bs == 2 ? 0 : bs + 1;
        if (++kq == ks_n) { // tile done: warps' partials (lanes tig 0: column 0 + 1) -> h
            kq = 0;
            if (tig == 0) red[warp * 16 + gid] = ag, red[warp * 16 + 8 + gid] = au;
            ag = 0.0f, au = 0.0f;
            __syncthreads();
            // Threads < 64: row tid / 8, warp tid % 8; sums over the 8 warps by a fixed tree.
            int r = r0c + 8 * tl + (tid >> 3);
            tl++;
            float gv = 0.0f, uv = 0.0f;
            if (tid < 64) {
                gv = red[(tid & 7) * 16 + (tid >> 3)], uv = red[(tid & 7) * 16 + 8 + (tid >> 3)];
#pragma unroll
                for (int o = 1; o < 8; o <<= 1)
                    gv += __shfl_xor_sync(0xffffffffu, gv, o), uv += __shfl_xor_sync(0xffffffffu, uv, o);
            }
            if (tid < 64 && (tid & 7) == 0 && r < rows) {
                gv *= fin, uv *= fin;
                gv = fminf(gv, clamp);
                uv = fminf(fmaxf(uv, -clamp), clamp);
                float base = gv * (1.0f / (1.0f + expf(-gv))) * uv;
                hmax = fmaxf(hmax, fabsf(base));
                for (u32 m = pmask; m != 0; m &= m - 1) {
                    int pp = __ffs(m) - 1;
                    h[(long long)pp * hs + r] = base * wgt[pp];
                }
            }
        }
    }
    // mx[pp][blockIdx.x] = max |h| of the CTA's rows (for the m3 down kernel's x scale).
    if (warp < 2) {
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) hmax = fmaxf(hmax, __shfl_xor_sync(0xffffffffu, hmax, o));
        if (lane == 0) wmax[warp] = hmax; // wmax last read before the stage loop
    }
    __syncthreads();
    if (tid == 0)
        for (u32 m = pmask; m != 0; m &= m - 1) {
            int pp = __ffs(m) - 1;
            mx[pp * gridDim.x + blockIdx.x] = fmaxf(wmax[0], wmax[1]) * fabsf(wgt[pp]);
        }
}
#endif

// Down (a token a grid row, Q2_K, 2048 columns = 8 blocks a row): out[r] = sum over slots s in order of row r
// of expert sel[s] . h[s]. CTA: 16 output rows (mma rows), 16 warps: warp w = block w / 2,
// 128-column chunk w % 2 (lane tig: elements 32 j + 8 tig .. + 8 of the chunk's 32-column group
// j, step 2 j + i: 4 i .. 4 i + 3 of them; weights q * scale <= 45, as f16 bits the subnormal
// value * 2^-24: PRMT + IMAD a pair, exact). Mins: one more mma a block (warps of chunk 0):
// A' = the 16 integer mins of the block's 16-column groups, B' = their x sums / 16 (hi / lo).
// x = h of the slot, scaled by 2^sigma from the gate/up kernel's maxima mx[s][ngu] (converted
// by the CTA once per slot, double-buffered); one cp.async stage (16 rows x 672 bytes at a
// 688-byte stride) per slot, NST - 1 ahead (NST = 2: one). Sums: per lane over slots in order,
// then over warps in order (deterministic). Shared memory: xf[2][cols / 4 uint4], sx[2][8
// blocks][2][16] u16, red[16][16], scale[2][32], NST stages. Issue-bound (~300 instructions a
// warp and slot at IPC 2.4; the largest stall: the slot barrier): bench/results/gpu-moe-m9-h200.txt.
// I8 (m3dn1ip, session 16, the n = 1 default; m3dn1 = the f16 form, DS4_GPU_MOE_FORM=v3d): the
// same CTA, slot loop, mins and sums, but the weights on int8 tensor cores (mma.sync m16n8k32
// s8 -> s32): a Q2_K weight's integer sc * q <= 45 is one byte, so
// ((qs word >> 2j) & 0x03030303) * sc builds four A entries with one IMAD (no carry between bytes;
// f16: PRMT + IMAD a pair). Step j (32 columns: the 8 of lane tig as in the f16 form, a0 / a2 =
// its columns 0-3 / 4-7) is one mma; one fresh int32 chain per warp and slot (128 columns,
// |sum| <= 128 * 45 * 128 < 2^31). x: X = rint(v 2^15) (v = x 2^sigma as the f16 form: |X| < 2^30)
// as four signed int8 limbs in B columns 0-3 (column n: weight 2^8n; bytes of (X + 0x80808080)
// ^ 0x80 each, exact), so C columns 2 tig, 2 tig + 1 of lanes tig 0, 1 are the limb sums: each
// lane scales its two by 2^(8n - 39) (the f16 form's units), the mins term (f16 mma as above) goes
// to tig 0, and the slot totals of tig 0 and 1 are added once at the end (fixed order).
// x limbs: [2][16 chunk-groups q][4 limbs, XOR-swizzled by q & 3][4 tig] uint2 (b0, b1 words).
// Also M3D_DEEP stages (5 slots' rows in flight, 2 x 85 KB of shared memory an SM), the first 5
// requested before the PDL wait (DS4_PDL_LATE). H200 (bench/results/gpu-moe-i16-h200.txt): the
// routed experts 39.1 -> 38.5 us a call, 2k decode +0.8% (3 pairs); alone under ncu (no PDL
// overlap) the int8 down with 2 stages was 19.9 -> 19.4 us, with 6 stages 21.3 us (the deep and
// the int8-only forms, m3dn1p / m3dn1i, tied in moe_bench; deleted, code in 5f2b52a).
#define M3D_THREADS 512
#define M3D_SROW 688
#define M3D_LB2 M3D_THREADS, 2 // at most 64 registers: 2 CTAs per SM
// Stages of the int8 form (m3dn1ip): NST - 1 slots' rows in flight, not one.
#define M3D_DEEP 6

#if defined(DS4_CUDA) && DS4_ARCH >= 800
// c += a.b: mma.sync m16n8k32 s8 x s8 -> s32 (A rows gid / gid + 8 in a0, a2 / a1, a3; B column
// gid: k 4 tig .. + 3 in b0, 16 + 4 tig .. in b1).
__device__ __forceinline__ void m3_mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    ds4_mma_s8(c, a, b0, b1);
}
// The four signed int8 limbs of four integers |X| < 2^30: word n = byte n of each (X + 0x80808080)
// ^ 0x80 (byte i of word n from X[i]); X = sum over n of 2^8n limb n.
__device__ __forceinline__ void m3_limbs4(int x0, int x1, int x2, int x3, u32 (&l)[4]) {
    u32 y0 = (u32)x0 + 0x80808080u, y1 = (u32)x1 + 0x80808080u, y2 = (u32)x2 + 0x80808080u, y3 = (u32)x3 + 0x80808080u;
    u32 a = ds4_prmt(y0, y1, 0x5140), b = ds4_prmt(y0, y1, 0x7362); // y0.b0 y1.b0 y0.b1 y1.b1 | bytes 2, 3
    u32 c = ds4_prmt(y2, y3, 0x5140), d = ds4_prmt(y2, y3, 0x7362);
    l[0] = ds4_prmt(a, c, 0x5410) ^ 0x80808080u;
    l[1] = ds4_prmt(a, c, 0x7632) ^ 0x80808080u;
    l[2] = ds4_prmt(b, d, 0x5410) ^ 0x80808080u;
    l[3] = ds4_prmt(b, d, 0x7632) ^ 0x80808080u;
}
// The down's x scale per slot (16 warps): sigma from the gate/up CTAs' maxima mx[s][ngu] (max
// is order-free: deterministic); scl[s] = 2^(sigma + e), scl[32 + s] = 2^(24 - sigma). The first
// 128 of a slot requested at once (ngu = 86 at the model shape; a loop that waited on each in turn
// had its two FMNMX on long scoreboard at 13% of m3dn1ip's stall samples under ncu).
__device__ __forceinline__ void m3d_sigma(const float* __restrict__ mx, int k, int ngu, int warp, int lane, int e,
                                          float* scl) {
    for (int s = warp; s < k; s += 16) {
        float mv[4];
#pragma unroll
        for (int j = 0; j < 4; j++) mv[j] = lane + 32 * j < ngu ? mx[s * ngu + lane + 32 * j] : 0.0f;
        float am = fmaxf(fmaxf(0.0f, mv[0]), fmaxf(mv[1], fmaxf(mv[2], mv[3])));
        for (int i = lane + 128; i < ngu; i += 32) am = fmaxf(am, mx[s * ngu + i]);
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        int ex = (int)((__float_as_uint(am) >> 23) & 255u) - 127, sig = min(max(14 - ex, -100), 100);
        if (lane == 0) scl[s] = __uint_as_float((u32)(127 + e + sig) << 23), scl[32 + s] = __uint_as_float((u32)(127 + 24 - sig) << 23);
    }
}

// A warp's 128-column half of a Q2_K block for 16 rows (gate-named rows gid, up-named gid + 8;
// qs words q0 / q1 and scale words s0 / s1 of each) on int8 tensor cores: 4 mma into c. B: limb
// gid & 3 of x (xp: this half's limbs, lane tig).
__device__ __forceinline__ void m3d_half_i8(int (&c)[4], const uint2* xp, int gid, int tig, u32 q0g, u32 q1g, u32 q0u,
                                            u32 q1u, u32 s0g, u32 s1g, u32 s0u, u32 s1u) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint2 b = xp[j * 16 + 4 * ((gid & 3) ^ j)];
        int sh = 8 * (2 * (j & 1) + (tig >> 1));
        u32 mg = ((j < 2 ? s0g : s1g) >> sh) & 15u, mu = ((j < 2 ? s0u : s1u) >> sh) & 15u;
        u32 v0g = (q0g >> (2 * j)) & 0x03030303u, v1g = (q1g >> (2 * j)) & 0x03030303u;
        u32 v0u = (q0u >> (2 * j)) & 0x03030303u, v1u = (q1u >> (2 * j)) & 0x03030303u;
        // Four bytes q * scale <= 45 each (no carry): the int8 weights.
        m3_mma_s8(c, v0g * mg, v0u * mu, v1g * mg, v1u * mu, b.x, b.y);
    }
}
template <bool I8>
__device__ __forceinline__ void m3dn_body(const u8* __restrict__ W, const int* __restrict__ sel, long long slab,
                                          const float* __restrict__ hx, int n, int k, float* __restrict__ out, int rows,
                                          int cols, long long row_bytes, int hs, const float* __restrict__ mx, int ngu) {
    constexpr int NST = I8 ? M3D_DEEP : 2;
    constexpr bool LATE = I8; // the caller starts with DS4_PDL_LATE
    uint4* xf = (uint4*)moe_smem;                 // [2][cols / 128 chunks][4 groups][2 parts][4 tig]
    u16* sxh = (u16*)(xf + 2 * 512);              // [2][8 blocks][2 parts][16 groups]
    float* red = (float*)(sxh + 2 * 8 * 2 * 16); // [16 warps][16 rows]
    float* scl = red + 16 * 16;                   // [2][32]: x scale, final factor per slot
    u8* stg = (u8*)(scl + 64);                    // NST stages
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    int r0 = blockIdx.x * 16;
    // This thread's copies of a stage (fixed: item i = tid + 512 m of 16 rows x 42 vectors).
    int ci0 = tid / 42, cj0 = tid - 42 * ci0, ci1 = (tid + M3D_THREADS) / 42, cj1 = tid + M3D_THREADS - 42 * ci1;
    long long co0 = (long long)min(r0 + ci0, rows - 1) * row_bytes + 16 * cj0;
    long long co1 = (long long)min(r0 + ci1, rows - 1) * row_bytes + 16 * cj1;
    // The slots' expert ids in lanes (k <= 32), taken by a shuffle when a stage is issued (a
    // global load there stalled every warp right after the slot's barrier).
    int selr = lane < k ? sel[lane] : 0;
    auto issue = [&](int s) {
        int es = __shfl_sync(0xffffffffu, selr, s & 31);
        if (s < k) {
            const u8* wb = W + (long long)max(es, 0) * slab;
            u8* dst = stg + (s % NST) * 16 * M3D_SROW;
            m3_cp16(dst + ci0 * M3D_SROW + 16 * cj0, wb + co0);
            if (tid + M3D_THREADS < 16 * 42) m3_cp16(dst + ci1 * M3D_SROW + 16 * cj1, wb + co1);
        }
        ds4_cp_commit();
    };
#pragma unroll
    for (int i = 0; i < NST - 1; i++) issue(i);
    // LATE (DS4_PDL_LATE kernels): the rows above were requested before the wait for the gate/up
    // kernel (they read only weights and sel, whose writer, the router, finished before any
    // gate/up CTA passed its own wait, hence before this grid started).
    if (LATE) ds4_pdl_enter();
    // x of slot s in registers (threads < 256: entry q = (chunk c, group j, tig): h[128c + 32j + 8tig ..]).
    float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa;
    auto xload = [&](int s) {
        if (tid < 256 && s < k) {
            int c = tid >> 4, jj = (tid >> 2) & 3, t = tid & 3;
            const float4* src = (const float4*)(hx + (long long)s * hs + 128 * c + 32 * jj + 8 * t);
            xa = src[0], xb = src[1];
        }
    };
    // Slot 0's x (written by the gate/up kernel) requested now, in flight with the maxima: the
    // two load latencies overlap instead of following each other (xstore(0) below converts it).
    xload(0);
    m3d_sigma(mx, k, ngu, warp, lane, 0, scl);
    __syncthreads();
    auto xstore = [&](int s) {
        if (tid < 256 && s < k) {
            int c = tid >> 4, jj = (tid >> 2) & 3, t = tid & 3, buf = s & 1;
            float xsc = scl[s];
            float v[8] = {xa.x * xsc, xa.y * xsc, xa.z * xsc, xa.w * xsc, xb.x * xsc, xb.y * xsc, xb.z * xsc, xb.w * xsc};
            if constexpr (I8) {
                u32 lo[4], hi[4];
                m3_limbs4(__float2int_rn(v[0] * 32768.0f), __float2int_rn(v[1] * 32768.0f),
                          __float2int_rn(v[2] * 32768.0f), __float2int_rn(v[3] * 32768.0f), lo);
                m3_limbs4(__float2int_rn(v[4] * 32768.0f), __float2int_rn(v[5] * 32768.0f),
                          __float2int_rn(v[6] * 32768.0f), __float2int_rn(v[7] * 32768.0f), hi);
                uint2* xd = (uint2*)(xf + buf * 512) + (c * 4 + jj) * 16 + t;
#pragma unroll
                for (int n = 0; n < 4; n++) xd[4 * (n ^ jj)] = make_uint2(lo[n], hi[n]);
            } else {
                uint4* xd = xf + buf * 512 + (c * 4 + jj) * 8 + t;
                m3_split8(v, xd[0], xd[4]);
            }
            // 16-column group sums (this thread's 8 and its neighbour's, lower tig first) / 16.
            float sm = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            float ot = __shfl_xor_sync(0xffffffffu, sm, 1);
            float g = ((t & 1) ? ot + sm : sm + ot) * 0.0625f;
            if ((t & 1) == 0) {
                u16* sd = sxh + ((buf * 8 + (c >> 1)) * 2) * 16 + 8 * (c & 1) + 2 * jj + (t >> 1);
                u32 gh = ds4_f16x2(g, 0.0f) & 0xffffu;
                sd[0] = (u16)gh;
                sd[16] = (u16)(ds4_f16x2(g - ds4_h2f_fast(gh), 0.0f) & 0xffffu);
            }
        }
    };
    xstore(0);
    int blk = warp >> 1, hh = warp & 1, c = 2 * blk + hh;
    float og = 0.0f, ou = 0.0f;
    for (int s = 0; s < k; s++) {
        ds4_cp_wait<NST - 2>(); // this thread's copies of stage s have landed
        __syncthreads(); // everyone's, and x of slot s; stage s - 1 and x of slot s - 1 are free
        issue(s + NST - 1);
        xload(s + 1); // in flight during the math
        const u8* bg = stg + (s % NST) * 16 * M3D_SROW + 84 * blk + gid * M3D_SROW;
        const u8* bu = bg + 8 * M3D_SROW;
        const u32* qg = (const u32*)(bg + 16 + 32 * hh + 8 * tig);
        const u32* qu = (const u32*)(bu + 16 + 32 * hh + 8 * tig);
        const u32* sg = (const u32*)(bg + 8 * hh);
        const u32* su = (const u32*)(bu + 8 * hh);
        u32 q0g = qg[0], q1g = qg[1], q0u = qu[0], q1u = qu[1];
        u32 s0g = sg[0], s1g = sg[1], s0u = su[0], s1u = su[1];
        float sg2, su2; // the chunk's weight sums in f16-form units (before d)
        if constexpr (I8) {
            // B: limb gid & 3 (lanes gid >= 4 duplicate 0-3 into C columns never read).
            const uint2* xp = (const uint2*)(xf + (s & 1) * 512) + (c * 4) * 16 + tig;
            int ci[4] = {0, 0, 0, 0};
            m3d_half_i8(ci, xp, gid, tig, q0g, q1g, q0u, q1u, s0g, s1g, s0u, s1u);
            // Columns 2 tig, 2 tig + 1 = limbs of weight 2^(16 tig), 2^(16 tig + 8); times 2^-39.
            float f0 = tig ? 0x1p-23f : 0x1p-39f, f1 = tig ? 0x1p-15f : 0x1p-31f;
            sg2 = fmaf((float)ci[1], f1, (float)ci[0] * f0);
            su2 = fmaf((float)ci[3], f1, (float)ci[2] * f0);
        } else {
            // B: lanes gid >= 2 duplicate gid 0 / 1 into C columns that are never read (as m3gu).
            const uint4* xp = xf + (s & 1) * 512 + (c * 4) * 8 + (lane & 7);
            float cc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint4 b = xp[j * 8];
                int sh = 8 * (2 * (j & 1) + (tig >> 1));
                u32 mg = ((j < 2 ? s0g : s1g) >> sh) & 15u, mu = ((j < 2 ? s0u : s1u) >> sh) & 15u;
                u32 v0g = (q0g >> (2 * j)) & 0x03030303u, v1g = (q1g >> (2 * j)) & 0x03030303u;
                u32 v0u = (q0u >> (2 * j)) & 0x03030303u, v1u = (q1u >> (2 * j)) & 0x03030303u;
                // [q0, 0, q1, 0] * scale: two u16 integers <= 45 = the f16 subnormals (exact).
                m3_mma(cc, ds4_prmt(v0g, 0u, 0x7170) * mg, ds4_prmt(v0u, 0u, 0x7170) * mu, ds4_prmt(v0g, 0u, 0x7372) * mg,
                       ds4_prmt(v0u, 0u, 0x7372) * mu, b.x, b.y);
                m3_mma(cc, ds4_prmt(v1g, 0u, 0x7170) * mg, ds4_prmt(v1u, 0u, 0x7170) * mu, ds4_prmt(v1g, 0u, 0x7372) * mg,
                       ds4_prmt(v1u, 0u, 0x7372) * mu, b.z, b.w);
            }
            sg2 = cc[0] + cc[1], su2 = cc[2] + cc[3];
        }
        u32 ddg = *(const u32*)(bg + 80), ddu = *(const u32*)(bu + 80);
        float ag = ds4_h2f_fast(ddg & 0xffffu) * sg2, au = ds4_h2f_fast(ddu & 0xffffu) * su2;
        if (hh == 0) { // mins: k' = 2 tig, 2 tig + 1 | 2 tig + 8, 2 tig + 9 (the block's groups)
            u32 m0g = *(const u16*)(bg + 2 * tig), m1g = *(const u16*)(bg + 2 * tig + 8);
            u32 m0u = *(const u16*)(bu + 2 * tig), m1u = *(const u16*)(bu + 2 * tig + 8);
            auto mins = [](u32 v) { return ((v >> 4) & 15u) | ((v >> 12) << 16); };
            const u32* sp = (const u32*)(sxh + (((s & 1) * 8 + blk) * 2 + (gid & 1)) * 16);
            u32 b0 = sp[tig], b1 = sp[tig + 4];
            float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            m3_mma(cm, mins(m0g), mins(m0u), mins(m1g), mins(m1u), b0, b1);
            // I8: the mins once, in lane tig 0 (tig 1's columns 2, 3 repeat 0, 1).
            float mf = I8 && tig != 0 ? 0.0f : -16.0f;
            ag = fmaf(mf * ds4_h2f_fast(ddg >> 16), cm[0] + cm[1], ag);
            au = fmaf(mf * ds4_h2f_fast(ddu >> 16), cm[2] + cm[3], au);
        }
        float fin = scl[32 + s];
        og = fmaf(fin, ag, og);
        ou = fmaf(fin, au, ou);
        xstore(s + 1); // slot s + 1's x into the other buffer (last read in stage s - 1)
    }
    if (I8) { // limbs 0, 1 (tig 0) + limbs 2, 3 (tig 1)
        og += __shfl_xor_sync(0xffffffffu, og, 1);
        ou += __shfl_xor_sync(0xffffffffu, ou, 1);
    }
    if (tig == 0) red[warp * 16 + gid] = og, red[warp * 16 + 8 + gid] = ou;
    __syncthreads();
    if (tid < 16 && r0 + tid < rows) {
        float o = 0.0f; // warps in order
        for (int w = 0; w < 16; w++) o += red[w * 16 + tid];
        out[r0 + tid] = o;
    }
}
#endif

#if defined(DS4_CUDA) && DS4_ARCH >= 800
// m3dn1ip with 32 rows a CTA (the default; DS4_GPU_M3D_R32=0 defines DS4_M3D_R16, m3dn_body's 16;
// the host launches d / 32 CTAs, one an SM): warp w takes row tile w / 8 and a whole block w % 8 (both 128-column halves
// in turn, kept in separate sums so that the warps' order of m3dn_body stays: same bits), so a
// slot's barrier, stage issue, x limbs and x-fragment loads serve twice the weights. Every
// thread converts 4 values of x (not 256 threads 8): each warp the same work. Stage: 32 rows x
// 688 bytes, M3D_DEEP of them (132 KB); red: [2 tiles][16 (block, half)][16 rows].
#define M3D2_ROWS 32
__device__ __forceinline__ void m3dn2_body(const u8* __restrict__ W, const int* __restrict__ sel, long long slab,
                                           const float* __restrict__ hx, int k, float* __restrict__ out, int rows,
                                           long long row_bytes, int hs, const float* __restrict__ mx, int ngu) {
    constexpr int NST = M3D_DEEP;
    uint4* xf = (uint4*)moe_smem;                 // [2][cols / 128 chunks][4 groups][4 limbs][4 tig] uint2
    u16* sxh = (u16*)(xf + 2 * 512);              // [2][8 blocks][2 parts][16 groups]
    float* red = (float*)(sxh + 2 * 8 * 2 * 16); // [2 tiles][16][16 rows]
    float* scl = red + 2 * 16 * 16;               // [2][32]: x scale (with the limbs' 2^15), final factor
    u8* stg = (u8*)(scl + 64);                    // NST stages of 32 rows
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    int r0 = blockIdx.x * M3D2_ROWS;
    // This thread's copies of a stage: items tid + 512 m (m < 3) of 32 rows x 42 vectors.
    int cd[3];
    long long co[3];
#pragma unroll
    for (int m = 0; m < 3; m++) {
        int it = min(tid + M3D_THREADS * m, M3D2_ROWS * 42 - 1), r = it / 42, v = it - 42 * r;
        cd[m] = r * M3D_SROW + 16 * v;
        co[m] = (long long)min(r0 + r, rows - 1) * row_bytes + 16 * v;
    }
    const bool c2 = tid + 2 * M3D_THREADS < M3D2_ROWS * 42;
    int selr = lane < k ? sel[lane] : 0;
    int ib = 0;
    auto issue = [&](int s) {
        int es = __shfl_sync(0xffffffffu, selr, s & 31);
        u8* dst = stg + ib * (M3D2_ROWS * M3D_SROW);
        ib = ib == NST - 1 ? 0 : ib + 1;
        if (s < k) {
            const u8* wb = W + (long long)max(es, 0) * slab;
            m3_cp16(dst + cd[0], wb + co[0]);
            m3_cp16(dst + cd[1], wb + co[1]);
            if (c2) m3_cp16(dst + cd[2], wb + co[2]);
        }
        ds4_cp_commit();
    };
#pragma unroll
    for (int i = 0; i < NST - 1; i++) issue(i);
    ds4_pdl_enter(); // the rows above read only weights and sel (see m3dn_body's LATE)
    // x: thread tid holds 4 values, quad tid of the 8-value entries q = tid / 2 of m3dn_body
    // (entry q = (chunk c, group jj, tig t): h[128c + 32jj + 8t ..]; half tid & 1).
    const int xq = tid >> 1, xh = tid & 1, xc = xq >> 4, xj = (xq >> 2) & 3, xt = xq & 3;
    float4 xa = make_float4(0.f, 0.f, 0.f, 0.f);
    auto xload = [&](int s) {
        if (s < k) xa = *(const float4*)(hx + (long long)s * hs + 128 * xc + 32 * xj + 8 * xt + 4 * xh);
    };
    xload(0);
    m3d_sigma(mx, k, ngu, warp, lane, 15, scl); // sigma per slot, with the limbs' 2^15
    __syncthreads();
    // Slot s's x as limbs (m3dn_body's values: v = x 2^(sigma + 15)) and its 16-column group
    // sums: a = this thread's 4, a + the other half's 4 (commutative: the same sum as m3dn_body's
    // 8), + the neighbour entry's (lower tig first) / 16.
    auto xstore = [&](int s) {
        if (s < k) {
            int buf = s & 1;
            float xsc = scl[s];
            float v[4] = {xa.x * xsc, xa.y * xsc, xa.z * xsc, xa.w * xsc};
            u32 l[4];
            m3_limbs4(__float2int_rn(v[0]), __float2int_rn(v[1]), __float2int_rn(v[2]), __float2int_rn(v[3]), l);
            u32* xd = (u32*)((uint2*)(xf + buf * 512) + (xc * 4 + xj) * 16 + xt) + xh;
#pragma unroll
            for (int n = 0; n < 4; n++) xd[8 * (n ^ xj)] = l[n];
            float a = (v[0] + v[1]) + (v[2] + v[3]);
            float o = __shfl_xor_sync(0xffffffffu, a, 1);
            float sm = xh ? o + a : a + o;
            float ot = __shfl_xor_sync(0xffffffffu, sm, 2);
            float g = ((xt & 1) ? ot + sm : sm + ot) * 0x1p-19f;
            if ((xt & 1) == 0 && xh == 0) {
                u16* sd = sxh + ((buf * 8 + (xc >> 1)) * 2) * 16 + 8 * (xc & 1) + 2 * xj + (xt >> 1);
                u32 gh = ds4_f16x2(g, 0.0f) & 0xffffu;
                sd[0] = (u16)gh;
                sd[16] = (u16)(ds4_f16x2(g - ds4_h2f_fast(gh), 0.0f) & 0xffffu);
            }
        }
    };
    xstore(0);
    const int rt = warp >> 3, blk = warp & 7;
    float og[2] = {0.0f, 0.0f}, ou[2] = {0.0f, 0.0f}; // per half (m3dn_body's warps 2 blk + hh)
    const u8* bg0 = stg + (16 * rt + gid) * M3D_SROW + 84 * blk;
    int cb = 0;
    for (int s = 0; s < k; s++) {
        ds4_cp_wait<NST - 2>();
        __syncthreads();
        issue(s + NST - 1);
        xload(s + 1);
        const u8* bg = bg0 + cb * (M3D2_ROWS * M3D_SROW);
        const u8* bu = bg + 8 * M3D_SROW;
        cb = cb == NST - 1 ? 0 : cb + 1;
        const float fin = scl[32 + s];
        const u32 ddg = *(const u32*)(bg + 80), ddu = *(const u32*)(bu + 80);
        const float dg = ds4_h2f_fast(ddg & 0xffffu), du = ds4_h2f_fast(ddu & 0xffffu);
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int c = 2 * blk + hh;
            const u32* qg = (const u32*)(bg + 16 + 32 * hh + 8 * tig);
            const u32* qu = (const u32*)(bu + 16 + 32 * hh + 8 * tig);
            u32 q0g = qg[0], q1g = qg[1], q0u = qu[0], q1u = qu[1];
            u32 s0g = *(const u32*)(bg + 8 * hh), s1g = *(const u32*)(bg + 8 * hh + 4);
            u32 s0u = *(const u32*)(bu + 8 * hh), s1u = *(const u32*)(bu + 8 * hh + 4);
            const uint2* xp = (const uint2*)(xf + (s & 1) * 512) + (c * 4) * 16 + tig;
            int cc[4] = {0, 0, 0, 0};
            m3d_half_i8(cc, xp, gid, tig, q0g, q1g, q0u, q1u, s0g, s1g, s0u, s1u);
            float f0 = tig ? 0x1p-23f : 0x1p-39f, f1 = tig ? 0x1p-15f : 0x1p-31f;
            float ag = dg * fmaf((float)cc[1], f1, (float)cc[0] * f0);
            float au = du * fmaf((float)cc[3], f1, (float)cc[2] * f0);
            if (hh == 0) { // the block's mins (m3dn_body's hh = 0 warp)
                u32 m0g = *(const u16*)(bg + 2 * tig), m1g = *(const u16*)(bg + 2 * tig + 8);
                u32 m0u = *(const u16*)(bu + 2 * tig), m1u = *(const u16*)(bu + 2 * tig + 8);
                auto mins = [](u32 v) { return ((v >> 4) & 15u) | ((v >> 12) << 16); };
                const u32* sp = (const u32*)(sxh + (((s & 1) * 8 + blk) * 2 + (gid & 1)) * 16);
                u32 b0 = sp[tig], b1 = sp[tig + 4];
                float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                m3_mma(cm, mins(m0g), mins(m0u), mins(m1g), mins(m1u), b0, b1);
                float mf = tig != 0 ? 0.0f : -16.0f;
                ag = fmaf(mf * ds4_h2f_fast(ddg >> 16), cm[0] + cm[1], ag);
                au = fmaf(mf * ds4_h2f_fast(ddu >> 16), cm[2] + cm[3], au);
            }
            og[hh] = fmaf(fin, ag, og[hh]);
            ou[hh] = fmaf(fin, au, ou[hh]);
        }
        xstore(s + 1);
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float a = og[hh] + __shfl_xor_sync(0xffffffffu, og[hh], 1);
        float b = ou[hh] + __shfl_xor_sync(0xffffffffu, ou[hh], 1);
        if (tig == 0) red[(rt * 16 + 2 * blk + hh) * 16 + gid] = a, red[(rt * 16 + 2 * blk + hh) * 16 + 8 + gid] = b;
    }
    __syncthreads();
    if (tid < M3D2_ROWS && r0 + tid < rows) {
        float o = 0.0f; // m3dn_body's warps in order
        for (int w = 0; w < 16; w++) o += red[((tid >> 4) * 16 + w) * 16 + (tid & 15)];
        out[r0 + tid] = o;
    }
}
#endif

// The v2 gate/up parameters (lk unused: h in plain order) and mx. HIP and sm < 80: no body (the
// host launches these only on CUDA sm_80+).
#define M3GU_PARAMS M2GU_PARAMS, float *__restrict__ mx
#define M3GU_ARGS M2GU_ARGS, mx
DS4_KERNEL void DS4_BOUNDS(M3_LB4) m3gu1_iq2_xxs(M3GU_PARAMS) {
    ds4_pdl_enter();
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    m3gu_body(M3GU_ARGS);
#endif
}
// ---- Small runs of the prompt MoE (m3gus_iq2_xxs; gemm_wg.rs DS4_GPU_GW_SMALL) ----
// The grouping's wide runs of at most min(smax, 8) pairs (gemm.rs group_pairs; the folded wide
// wgmma gate/up skips them): m3gu's decode (lane tig holds a whole sub-block of a row: one aux
// word, scale and sign set per 32 weights, where the wgmma K order pays them per 8) with the
// run's items as the 8 B columns (one f16 plane: x 2^sigma rounded once, sigma per item as m3gu;
// weights exact; f32 sums). Gate rows as A rows 0-7 and the same up rows as 8-15, so a CTA
// writes both. CTA: nb tiles of 8 rows, stages of 16 rows x 2048 columns as m3gu_body (warp w:
// block w of a stage, partials summed over the warps by a fixed tree a tile). Shared: the grid,
// the items' x fragments ([cols / 128][4 entries][8 items][4 tig] uint4: cols x 16 bytes), red
// [8 warps][16 rows][8 items], the 3 stages. cols % 2048 == 0, rows % 8 == 0 (the host checks).
// It shares m3gu_dec (ITEMS) and the stages (M3GU_STAGES) with m3gu_body; with them both
// kernels' SASS is byte for byte the one the tests and timings ran (sm_90a, session 54).
#define M3S_LB2 M3_THREADS, 2 // two CTAs an SM (shared memory: ~96 KiB each at cols 4096)
// Grid (rows / (8 nb), wide runs, 1), 256 threads, dynamic shared memory 2048 + 16 cols + 4096 +
// 64 + 3 * 16 * 544 bytes (gemm_wg.rs). z: token rows [.][cols] (pair i reads row i / xdiv);
// gy / uy[pair * y_tok + r]; grp: [ngroups, starts[gmax], perm[n], ngroups2, starts2[]].
DS4_KERNEL void DS4_BOUNDS(M3S_LB2) m3gus_iq2_xxs(const u8* __restrict__ Wg, const u8* __restrict__ Wu, long long slab,
                                                  const int* __restrict__ sel, const float* __restrict__ z, int xdiv,
                                                  float* __restrict__ gy, float* __restrict__ uy, long long y_tok,
                                                  int rows, int cols, long long row_bytes, int n,
                                                  const int* __restrict__ grp, int gmax, int smax, int nb) {
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    const int* perm = grp + 1 + gmax;
    const int* g2 = perm + n; // [ngroups2, starts2[]]
    const int by = blockIdx.y;
    if (by >= g2[0]) return; // uniform over the CTA
    const int st = g2[1 + by], len = min(max((by + 1 < g2[0] ? g2[2 + by] : n) - st, 0), 128);
    if (len == 0 || len > min(smax, 8)) return;
    const int e = max(sel[perm[st]], 0);
    u64* gs = (u64*)moe_smem;
    uint4* xf = (uint4*)(gs + 256);
    float* red = (float*)(xf + cols); // [8 warps][16 rows][8 items]
    float* fin = red + 8 * 16 * 8;    // [8 items]: 2^(21 - sigma)
    float* tmax = fin + 8;            // [8 items]: max |x|
    u8* stg = (u8*)(tmax + 8);        // 3 stages (16-byte aligned: 2048 + 16 cols + 4096 + 64)
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
    const int ks_n = cols / 2048, r0c = blockIdx.x * nb * 8;
    const int ntl = min(nb, (rows - r0c + 7) / 8), S = ntl * ks_n;
    const u8* gb = Wg + (long long)e * slab;
    const u8* ub = Wu + (long long)e * slab;
    M3GU_STAGES // as m3gu_body (rows % 8 == 0: no row past the end)
    issue();
    issue();
    m2_grid<T_IQ2_XXS>(gs);
    // Item m (< len): pair perm[st + m], token row perm[st + m] / xdiv. Warp m: its max |x|.
    auto xrow = [&](int m) { return z + (long long)(perm[st + m] / xdiv) * cols; };
    {
        float am = 0.0f;
        if (warp < len) {
            const float4* xr = (const float4*)xrow(warp);
            for (int i = lane; i < cols / 4; i += 32) {
                float4 v = xr[i];
                am = fmaxf(am, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        if (lane == 0) tmax[warp] = am;
    }
    __syncthreads();
    if (tid < 8) {
        int ex = (int)((__float_as_uint(tmax[tid]) >> 23) & 255u) - 127, sig = min(max(14 - ex, -100), 100);
        fin[tid] = __uint_as_float((u32)(127 + 21 - sig) << 23);
    }
    // x fragments: entry q = ((chunk c, entry jj, item m), tig t) = x_m[128 c + 32 t + 8 jj ..] in f16.
    for (int q = tid; q < cols; q += M3_THREADS) {
        const int t = q & 3, m = (q >> 2) & 7, jj = (q >> 5) & 3, c = q >> 7;
        uint4 hv = make_uint4(0u, 0u, 0u, 0u);
        if (m < len) {
            int ex = (int)((__float_as_uint(tmax[m]) >> 23) & 255u) - 127, sig = min(max(14 - ex, -100), 100);
            const float xsc = __uint_as_float((u32)(127 + sig) << 23);
            const float4* src = (const float4*)(xrow(m) + 128 * c + 32 * t + 8 * jj);
            const float4 a = src[0], b = src[1];
            hv = make_uint4(ds4_f16x2(a.x * xsc, a.y * xsc), ds4_f16x2(a.z * xsc, a.w * xsc), ds4_f16x2(b.x * xsc, b.y * xsc),
                            ds4_f16x2(b.z * xsc, b.w * xsc));
        }
        xf[q] = hv;
    }
    float ag0 = 0.0f, ag1 = 0.0f, au0 = 0.0f, au1 = 0.0f;
    int kq = 0, tl = 0, bs = 0;
    uint4 bx[2]; // m3gu_dec's B fragments (ITEMS: every lane loads its own)
    const bool al8 = ((66 * warp + 2) & 4) == 0;
    for (int s = 0; s < S; s++) {
        ds4_cp_wait<1>();
        __syncthreads(); // stage s landed for all; stage s - 1 (and red, at a tile's end) no longer read
        issue();
        int bw = 8 * kq + warp;
        const u8* rg = stg + bs * M3_STAGE + gid * M3_SROW;
        const u8* ru = rg + 8 * M3_SROW;
        float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (al8)
            m3gu_dec<true, true>(rg, ru, gs, xf, warp, tig, lane, bw, c4, bx);
        else
            m3gu_dec<false, true>(rg, ru, gs, xf, warp, tig, lane, bw, c4, bx);
        float dg = ds4_h2f_fast(*(const u16*)(rg + 66 * warp)), du = ds4_h2f_fast(*(const u16*)(ru + 66 * warp));
        // c4: gate row gid of items 2 tig, 2 tig + 1; up row gid of the same
        ag0 = fmaf(dg, c4[0], ag0), ag1 = fmaf(dg, c4[1], ag1);
        au0 = fmaf(du, c4[2], au0), au1 = fmaf(du, c4[3], au1);
        bs = bs == 2 ? 0 : bs + 1;
        if (++kq == ks_n) { // tile done: red[warp][row][item], then sums over the warps in order
            kq = 0;
            float* rw = red + (warp * 16 + gid) * 8 + 2 * tig;
            rw[0] = ag0, rw[1] = ag1, rw[64] = au0, rw[65] = au1; // + 8 rows = + 64
            ag0 = ag1 = au0 = au1 = 0.0f;
            __syncthreads();
            if (tid < 128) {
                const int rr = tid >> 3, m = tid & 7; // rows 0-7 gate, 8-15 up
                float v = 0.0f;
                for (int w = 0; w < 8; w++) v += red[(w * 16 + rr) * 8 + m];
                const int r = r0c + 8 * tl + (rr & 7);
                if (m < len && r < rows) (rr < 8 ? gy : uy)[(long long)perm[st + m] * y_tok + r] = v * fin[m];
            }
            tl++;
        }
    }
    ds4_cp_wait<0>();
#else
    (void)Wg, (void)Wu, (void)slab, (void)sel, (void)z, (void)xdiv, (void)gy, (void)uy, (void)y_tok, (void)rows, (void)cols,
        (void)row_bytes, (void)n, (void)grp, (void)gmax, (void)smax, (void)nb;
#endif
}

// cols = 2048 only (see m3dn_body); h in plain order, mx from m3gu. Token t = blockIdx.y (grid y
// = n <= 4): its k slots, h and maxima, its output row -- the one-token product (same bits).
#define M3DN_TOK(I8)                                                                                      \
    const long long t_ = blockIdx.y;                                                                      \
    m3dn_body<I8>(W, sel + t_ * k, slab, hx + t_ * k * hs, n, k, out + t_ * rows, rows, cols, row_bytes, hs, \
                  mx + t_ * k * ngu, ngu);
DS4_KERNEL void DS4_BOUNDS(M3D_LB2) m3dn1_q2_k(M2DN_PARAMS, const float* __restrict__ mx, int ngu) {
    ds4_pdl_enter();
#if defined(DS4_CUDA) && DS4_ARCH >= 800
    M3DN_TOK(false)
#endif
}
// The same on int8 tensor cores, 6 stages, the weights' loads before the PDL wait
// (m3dn_body<true>: see there).
// One definition (the kernel lists are read from the sources): 32 rows a CTA, one CTA an SM
// (m3dn2_body), or with DS4_M3D_R16 m3dn_body's 16 rows, two CTAs an SM.
#if !defined(DS4_M3D_R16)
#define M3D_IP_LB M3D_THREADS
#else
#define M3D_IP_LB M3D_LB2
#endif
DS4_KERNEL void DS4_BOUNDS(M3D_IP_LB) m3dn1ip_q2_k(M2DN_PARAMS, const float* __restrict__ mx, int ngu) {
    DS4_PDL_LATE;
#if defined(DS4_CUDA) && DS4_ARCH >= 800
#if !defined(DS4_M3D_R16)
    const long long t_ = blockIdx.y;
    m3dn2_body(W, sel + t_ * k, slab, hx + t_ * k * hs, k, out + t_ * rows, rows, row_bytes, hs, mx + t_ * k * ngu, ngu);
#else
    M3DN_TOK(true)
#endif
#endif
}

// Expert parallelism (ds4_backend::shard::localize, the host rule these values must equal): the
// router's [n, k] global selections and weights of a rank holding experts e0 .. e0 + count.
// A local selection becomes e - e0; any other gets weight 0 and the token's first local
// selection (or local 0 where it has none), so kernels that compute each distinct expert of a
// token once do no extra work for it. One thread per token.
DS4_KERNEL void DS4_BOUNDS(128) moe_localize(int* __restrict__ sel, float* __restrict__ wgt, int n, int k, int e0, int count) {
    ds4_pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int* s = sel + (long long)i * k;
    float* w = wgt + (long long)i * k;
    int first = -1;
    for (int j = 0; j < k; j++)
        if (first < 0 && s[j] >= e0 && s[j] < e0 + count) first = s[j] - e0;
    if (first < 0) first = 0;
    for (int j = 0; j < k; j++) {
        const int e = s[j];
        if (e >= e0 && e < e0 + count) {
            s[j] = e - e0;
        } else {
            s[j] = first;
            w[j] = 0.0f;
        }
    }
}
