// Decode MoE (n <= 4 tokens, k slots each): the routed experts at weight bandwidth, two launches.
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
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_iq2_xxs(MOEGU_PARAMS) { moegu_body<T_IQ2_XXS, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_iq2_xxs(MOEGU_PARAMS) { moegu_body<T_IQ2_XXS, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_iq2_xxs(MOEGU_PARAMS) { moegu_body<T_IQ2_XXS, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_q2_k(MOEGU_PARAMS) { moegu_body<T_Q2_K, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_q2_k(MOEGU_PARAMS) { moegu_body<T_Q2_K, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_q2_k(MOEGU_PARAMS) { moegu_body<T_Q2_K, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu1_q4_k(MOEGU_PARAMS) { moegu_body<T_Q4_K, 1, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu2_q4_k(MOEGU_PARAMS) { moegu_body<T_Q4_K, 2, 2>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_THREADS) moegu4_q4_k(MOEGU_PARAMS) { moegu_body<T_Q4_K, 4, 1>(MOEGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_iq2_xxs(MOEDN_PARAMS) { moedn_body<T_IQ2_XXS>(MOEDN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_q2_k(MOEDN_PARAMS) { moedn_body<T_Q2_K>(MOEDN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MOE_LB4) moedn_q4_k(MOEDN_PARAMS) { moedn_body<T_Q4_K>(MOEDN_ARGS); }
