// Prefill sink attention on tensor cores (CUDA sm_80+: mma.sync m16n8k16 f16, f32 accumulate).
// Same result as attend_part_f32 + attend_combine_f32 (attention.cu) for chunks of n > 1 tokens.
//
// DS4 attention is multi-query with K = V: the heads of token t share one list of candidate rows
//   j <  nwin:              raw position first + j (this chunk's kv, else the ring if present)
//   j <  nwin + nsel:       compressed row sel[i][j − nwin] (absent when −1)
//   j <  nwin + nsel + nc:  compressed row j − nwin − nsel (all rows < (t+1)/ratio, no sel)
// so per token S = Q (heads × hd) · Kᵀ and O = P · V are small GEMMs.
//
// CTA = one token × 16 heads, 4 warps; warp w owns head-dim columns [w·hd/4, (w+1)·hd/4): it
// loads that quarter of each 32-row tile (f16 copies of the rows, made once a call by
// atc_rows_f16, 1 KB a row: one batch of 16-byte loads) into shared memory, computes its partial
// S (16 heads × 32 rows over its columns), the four partials are summed through shared memory
// (every warp sums them in the same order, so all hold the same S), each warp runs the same online
// softmax and accumulates O (16 heads × its columns) in registers. Epilogue: the sink, the
// inverse RoPE of the last n_rot columns, f32 stores. The ring is written afterwards by
// ring_store_f32 (other CTAs still read it here).
//
// Rounding: K/V rows are taken as f16 (cvt.rn by atc_rows_f16: exact for rows stored f16-rounded,
// the model's default; otherwise 2^-11 relative per element). Q and P are split into f16 hi + lo (hi = f16_rn(v),
// lo = f16_rn(v − hi)), two mma each (S = Qhi·K + Qlo·K, O = Phi·V + Plo·V): ~2^-22 relative,
// so with f16 rows the result matches the f32 kernels to rounding. The `h` forms use hi only
// (one mma each, P sums of the rounded weights; ~1e-3 relative).
#include "prelude.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

#define ATC_HG 16     // heads per CTA
#define ATC_R 32      // rows per tile
#define ATC_MAXROT 64 // most RoPE pairs (n_rot / 2)

#define ATC_PARAMS                                                                                                  \
    const float *__restrict__ q, const float *__restrict__ kv, const float *__restrict__ raw,                      \
        const int *__restrict__ raw_pos, const float *__restrict__ comp, const int *__restrict__ sel,             \
        const float *__restrict__ sinks, const double *__restrict__ freqs, float *__restrict__ out, long long t0, \
        int heads, int win, int ratio, int top_k, int n_rot, float scale
#define ATC_ARGS q, kv, raw, raw_pos, comp, sel, sinks, freqs, out, t0, heads, win, ratio, top_k, n_rot, scale

#if defined(DS4_CUDA) && DS4_ARCH >= 800
#define ATC_HAVE_MMA 1
#else
#define ATC_HAVE_MMA 0
#endif

// RoPE angle of position t, pair frequency f: fmod(t·f, 2π) in f64; as (cos, −sin) by cos() and
// sin() (the output's inverse RoPE table) and as (sin, cos) by sincos() (the query's, as fused.cu's
// norm_rope): each form's own bits.
__device__ __forceinline__ double atc_theta(long long t, double f) { return fmod((double)t * f, 6.283185307179586); }
__device__ __forceinline__ float2 atc_cos_nsin(double theta) { return make_float2((float)cos(theta), -(float)sin(theta)); }
__device__ __forceinline__ float2 atc_sin_cos(double theta) {
    double sn, cs;
    sincos(theta, &sn, &cs);
    return make_float2((float)sn, (float)cs);
}
// a + ib rotated by (c, s): a' = a·c − b·s, b' = a·s + b·c, each product and sum rounded (no FMA,
// the CPU's RoPE); the inverse RoPE passes s = −sin.
__device__ __forceinline__ void atc_rot(float& a, float& b, float c, float s) {
    const float a2 = ds4_sub_rn(ds4_mul_rn(a, c), ds4_mul_rn(b, s));
    b = __fadd_rn(ds4_mul_rn(a, s), ds4_mul_rn(b, c));
    a = a2;
}

#if ATC_HAVE_MMA

// Candidate j of token t (list above) in the f16 copies, or 0 when absent.
__device__ __forceinline__ const u16* atc_row(long long j, long long t0, long long first, int nwin, int nsel,
                                              const int* seli, const u16* kv, const u16* raw, const int* raw_pos,
                                              const u16* comp, int hd, int win) {
    if (j < nwin) {
        long long p = first + j;
        if (p >= t0) return kv + (p - t0) * hd;
        int slot = (int)(p % win);
        return raw_pos[slot] == (int)p ? raw + (size_t)slot * hd : (const u16*)0;
    }
    j -= nwin;
    if (j < nsel) {
        int c = seli[j];
        return c >= 0 ? comp + (size_t)c * hd : (const u16*)0;
    }
    return comp + (j - nsel) * hd;
}

// Token i's candidate list (list above): its position t, the window's first position, the window,
// selected and listed counts, its selection row (or null).
struct AtgTok {
    long long t, first;
    int nwin, nsel, ncand;
    const int* seli;
};
__device__ __forceinline__ AtgTok atg_tok(long long t0, int i, int win, int ratio, const int* sel, int top_k) {
    AtgTok k;
    k.t = t0 + i;
    k.first = k.t + 1 > win ? k.t + 1 - win : 0;
    k.nwin = (int)(k.t - k.first + 1);
    k.nsel = sel ? top_k : 0;
    const long long ncomp = (sel == 0 && ratio > 0) ? (k.t + 1) / ratio : 0;
    k.ncand = (int)(k.nwin + k.nsel + ncomp);
    k.seli = sel ? sel + (size_t)i * top_k : (const int*)0;
    return k;
}

// Token i's RoPE tables at t: rot_s[p] = (cos, −sin) for the output's inverse RoPE and qsc[p] =
// (sin, cos) for the query's (used by the raw-query forms), from atc_rope_tab's rtab, or rot_s
// computed here (qsc then later, by the threads beside the norm's scales).
__device__ __forceinline__ void atg_rope(float* rot_s, float2* qsc, const float4* __restrict__ rtab,
                                         const double* __restrict__ freqs, long long t, int i, int n_rot) {
    for (int p = threadIdx.x; p < n_rot / 2; p += blockDim.x) {
        if (rtab) {
            const float4 r = rtab[(size_t)i * (n_rot / 2) + p];
            rot_s[2 * p] = r.x, rot_s[2 * p + 1] = r.y;
            qsc[p] = make_float2(r.z, r.w);
        } else {
            const float2 r = atc_cos_nsin(atc_theta(t, freqs[p]));
            rot_s[2 * p] = r.x, rot_s[2 * p + 1] = r.y;
        }
    }
}

// Fragment layouts (PTX m16n8k16, g = lane/4, t = lane%4): A a0 (row g, k 2t..2t+1), a1 (g+8, 2t),
// a2 (g, 2t+8), a3 (g+8, 2t+8); B b0 (k 2t..2t+1, col g), b1 (k 2t+8..); C c0,c1 (row g, cols
// 2t, 2t+1), c2,c3 (row g+8). Rows of A / C here are heads.
// Rows are read from rows16 = [ring (win rows) | this chunk's kv (n rows) | compressed rows], f16
// (kv, raw and comp are its f32 sources, not read here).
template <int HD, bool SPLIT> __device__ __forceinline__ void attn_tc_body(ATC_PARAMS, const u16* __restrict__ rows16) {
    constexpr int QW = HD / 4;      // columns per warp
    constexpr int KS = QW / 16;     // k-steps of the S product
    constexpr int NT = QW / 8;      // n-tiles of O
    constexpr int LD = QW + 8;      // halves per shared row (16-byte pad: conflict-free ldmatrix)
    constexpr int E8 = QW / 8;      // 16-byte chunks (8 halves) per row quarter
    constexpr int ITEMS = ATC_R * E8 / 32;
    static_assert(QW % 16 == 0 && ITEMS >= 1, "head width a multiple of 64");
    __shared__ __align__(16) u16 kv_s[4][ATC_R * LD]; // per warp: the tile's rows, its columns, f16
    __shared__ float sp_s[4][16][32];                  // per warp: partial S fragments [value][lane]
    __shared__ float rot_s[ATC_MAXROT][2];             // cos, sin of the RoPE pairs at t
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int h0 = blockIdx.x * ATC_HG, i = blockIdx.y;
    const AtgTok tk = atg_tok(t0, i, win, ratio, sel, top_k);
    const long long first = tk.first, ncand = tk.ncand;
    const int nwin = tk.nwin, nsel = tk.nsel;
    const int* seli = tk.seli;
    const int c0 = w * QW;
    // Inverse RoPE factors (as ds4_rope_pair: f64 angle mod 2π, f32 sin/cos, negated sin).
    atg_rope(&rot_s[0][0], nullptr, nullptr, freqs, tk.t, i, n_rot);
    // Q fragments of heads h0+g, h0+g+8 over this warp's columns (zeros past the heads).
    u32 qh[KS][4], ql[KS][4];
    {
        const int ha = h0 + g, hb = h0 + g + 8;
        const float* qa = q + ((size_t)i * heads + ha) * HD + c0 + 2 * tq;
        const float* qb = q + ((size_t)i * heads + hb) * HD + c0 + 2 * tq;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            float2 z2 = make_float2(0.0f, 0.0f);
            float2 a0 = ha < heads ? *(const float2*)(qa + 16 * ks) : z2;
            float2 a1 = hb < heads ? *(const float2*)(qb + 16 * ks) : z2;
            float2 a2 = ha < heads ? *(const float2*)(qa + 16 * ks + 8) : z2;
            float2 a3 = hb < heads ? *(const float2*)(qb + 16 * ks + 8) : z2;
            ds4_f16x2_split(a0.x, a0.y, qh[ks][0], ql[ks][0]);
            ds4_f16x2_split(a1.x, a1.y, qh[ks][1], ql[ks][1]);
            ds4_f16x2_split(a2.x, a2.y, qh[ks][2], ql[ks][2]);
            ds4_f16x2_split(a3.x, a3.y, qh[ks][3], ql[ks][3]);
        }
    }
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {DS4_NEG_INF, DS4_NEG_INF}, z[2] = {0.0f, 0.0f}; // heads g, g+8; z: this lane's part
    u16* kw = kv_s[w];
    for (long long j0 = 0; j0 < ncand; j0 += ATC_R) {
        // Lane r: candidate j0 + r (pointer halves for the loaders), valid bits of the tile.
        const size_t nk = (size_t)gridDim.y * HD; // rows16: ring, kv, compressed
        const u16* myrow = j0 + lane < ncand ? atc_row(j0 + lane, t0, first, nwin, nsel, seli, rows16 + (size_t)win * HD,
                                                       rows16, raw_pos, rows16 + (size_t)win * HD + nk, HD, win)
                                             : (const u16*)0;
        const u32 valid = __ballot_sync(0xffffffffu, myrow != 0);
        const unsigned long long pr = (unsigned long long)myrow;
        const u32 plo = (u32)pr, phi = (u32)(pr >> 32);
        // This warp's quarter of the 32 rows, 16 bytes a lane (zeros for absent rows).
        uint4 v[ITEMS];
#pragma unroll
        for (int b = 0; b < ITEMS; b++) {
            const int k = b * 32 + lane, r = k / E8, e8 = k % E8;
            const u32 lo = __shfl_sync(0xffffffffu, plo, r), hi = __shfl_sync(0xffffffffu, phi, r);
            const u16* row = (const u16*)(((unsigned long long)hi << 32) | lo);
            v[b] = row ? ((const uint4*)(row + c0))[e8] : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int b = 0; b < ITEMS; b++) {
            const int k = b * 32 + lane, r = k / E8, e8 = k % E8;
            *(uint4*)(kw + r * LD + 8 * e8) = v[b];
        }
        __syncwarp();
        // Partial S: 4 n-tiles of 8 rows; ldmatrix.x4 gives b0,b1 of two n-tiles for one k-step.
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
#pragma unroll
            for (int np = 0; np < 2; np++) {
                u32 b[4];
                const int mi = lane >> 3, rr = lane & 7;
                ds4_ldm4(b, kw + (16 * np + rr + 8 * (mi >> 1)) * LD + 16 * ks + 8 * (mi & 1));
                ds4_mma_f16(s[2 * np], qh[ks], b[0], b[1]);
                ds4_mma_f16(s[2 * np + 1], qh[ks], b[2], b[3]);
                if (SPLIT) {
                    ds4_mma_f16(s[2 * np], ql[ks], b[0], b[1]);
                    ds4_mma_f16(s[2 * np + 1], ql[ks], b[2], b[3]);
                }
            }
        }
        // Sum of the four warps' partials (the buffer is free: every warp passed the read of the
        // previous tile before this barrier).
        __syncthreads();
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) sp_s[w][n * 4 + c][lane] = s[n][c];
        __syncthreads();
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int v = n * 4 + c;
                float a = sp_s[0][v][lane] + sp_s[1][v][lane];
                a += sp_s[2][v][lane];
                a += sp_s[3][v][lane];
                const int row = 8 * n + 2 * tq + (c & 1);
                s[n][c] = (valid >> row) & 1u ? a * scale : DS4_NEG_INF;
            }
        // Online softmax per head (a head's 32 scores sit in the 4 lanes of a quad).
        float cf[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            float mx = m[u];
#pragma unroll
            for (int n = 0; n < 4; n++) mx = fmaxf(mx, fmaxf(s[n][2 * u], s[n][2 * u + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            cf[u] = m[u] == mx ? 1.0f : expf(m[u] - mx); // also −inf == −inf
            m[u] = mx;
        }
        u32 ph[2][4], pl[2][4]; // A fragments of P for the two k-steps (rows 0..15, 16..31)
        float zs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < 4; n++) {
            float p[4];
#pragma unroll
            for (int c = 0; c < 4; c++) p[c] = s[n][c] == DS4_NEG_INF ? 0.0f : expf(s[n][c] - m[c >> 1]);
            u32 h01, l01, h23, l23;
            ds4_f16x2_split(p[0], p[1], h01, l01);
            ds4_f16x2_split(p[2], p[3], h23, l23);
            if (SPLIT) {
                zs[0] += p[0] + p[1];
                zs[1] += p[2] + p[3];
            } else { // the weights the product uses
                zs[0] += ds4_h2f_fast(h01 & 0xffffu) + ds4_h2f_fast(h01 >> 16);
                zs[1] += ds4_h2f_fast(h23 & 0xffffu) + ds4_h2f_fast(h23 >> 16);
            }
            // n-tile n covers k (tile rows) 8n..8n+7: k-step n/2, low (a0,a1) or high (a2,a3) half.
            ph[n >> 1][2 * (n & 1)] = h01;
            ph[n >> 1][2 * (n & 1) + 1] = h23;
            pl[n >> 1][2 * (n & 1)] = l01;
            pl[n >> 1][2 * (n & 1) + 1] = l23;
        }
#pragma unroll
        for (int u = 0; u < 2; u++) z[u] = z[u] * cf[u] + zs[u];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            acc[n][0] *= cf[0];
            acc[n][1] *= cf[0];
            acc[n][2] *= cf[1];
            acc[n][3] *= cf[1];
        }
        // O += P · V: ldmatrix.x4.trans gives b0,b1 of two n-tiles (16 columns) for one k-step.
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                u32 b[4];
                const int mi = lane >> 3, rr = lane & 7;
                ds4_ldm4_t(b, kw + (16 * kk + rr + 8 * (mi & 1)) * LD + 16 * np + 8 * (mi >> 1));
                ds4_mma_f16(acc[2 * np], ph[kk], b[0], b[1]);
                ds4_mma_f16(acc[2 * np + 1], ph[kk], b[2], b[3]);
                if (SPLIT) {
                    ds4_mma_f16(acc[2 * np], pl[kk], b[0], b[1]);
                    ds4_mma_f16(acc[2 * np + 1], pl[kk], b[2], b[3]);
                }
            }
        }
        __syncwarp(); // the next tile's stores overwrite kw
    }
    __syncthreads(); // rot_s
    // out = acc·e^{m−M} / (e^{sink−M} + z·e^{m−M}), M = max(sink, m); then the inverse RoPE.
    float f[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
        float zz = z[u];
        zz += __shfl_xor_sync(0xffffffffu, zz, 1);
        zz += __shfl_xor_sync(0xffffffffu, zz, 2);
        const int h = h0 + g + 8 * u;
        const float sink = h < heads ? sinks[h] : 0.0f;
        const float M = fmaxf(sink, m[u]);
        const float wm = m[u] == DS4_NEG_INF ? 0.0f : expf(m[u] - M);
        f[u] = wm / (expf(sink - M) + zz * wm);
    }
    const int rot0 = HD - n_rot;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int col = c0 + 8 * n + 2 * tq;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int h = h0 + g + 8 * u;
            float a = acc[n][2 * u] * f[u], b = acc[n][2 * u + 1] * f[u];
            if (col >= rot0) {
                const int p = (col - rot0) >> 1;
                atc_rot(a, b, rot_s[p][0], rot_s[p][1]);
            }
            if (h < heads) *(float2*)(out + ((size_t)i * heads + h) * HD + col) = make_float2(a, b);
        }
    }
}
#define ATC_BODY(HD, SPLIT) attn_tc_body<HD, SPLIT>(ATC_ARGS, rows16);

// f16 copies (round to nearest even) of the rows attn_tc<hd>[h]_f32 reads: dst = [raw (nraw4 float4) | kv (nkv4) | comp (the rest of total4)]; grid-stride, float4 a
// thread.
__device__ __forceinline__ void atc_rows_body(const float* __restrict__ raw, const float* __restrict__ kv,
                                              const float* __restrict__ comp, u16* __restrict__ dst, long long nraw4,
                                              long long nkv4, long long total4) {
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total4;
         k += (long long)gridDim.x * blockDim.x) {
        const float4 v = k < nraw4         ? ((const float4*)raw)[k]
                         : k < nraw4 + nkv4 ? ((const float4*)kv)[k - nraw4]
                                            : ((const float4*)comp)[k - nraw4 - nkv4];
        ((uint2*)dst)[k] = make_uint2(ds4_f16x2(v.x, v.y), ds4_f16x2(v.z, v.w));
    }
}
#define ATC_ROWS_BODY atc_rows_body(raw, kv, comp, dst, nraw4, nkv4, total4);
#else
#define ATC_BODY(HD, SPLIT)
#define ATC_ROWS_BODY
#endif

#if ATC_HAVE_MMA
// attn_tc512g_f32: the `h` form (one f16 product for S and for O) with one CTA per token for all
// (at most 64) heads, so each candidate row is read from L2 once per token (the 16-head CTAs above
// read it four times), and absent candidates (sel −1, ring slots overwritten) are dropped before
// the tile loop (at 2k most top-k slots of early tokens are −1: ~384 of 640 rows remain on average).
//   start: the token's present candidates in order → idx (row numbers of rows16, dynamic shared),
//          a block scan of 256 at a time;
//   tiles of R rows, double-buffered in shared memory by cp.async (next tile in flight
//   during this one), 3 barriers a tile:
//   S:  warp w takes heads 32·(w%2) + [0, 32) (two m16 tiles) over columns 128·(w/2) + [0, 128):
//       its Q fragments (64 registers) stay in registers; the four column-quarter partials go to
//       shared memory (part) and are summed in quarter order (as attn_tc512h_f32);
//   softmax: thread (head tid/4, rows R/4·(tid%4) + [0, R/4)): online max over the quad, P rounded to
//       f16 into shared memory (pw), the head's rescale factor into cf;
//   O:  warp w takes columns 64·w + [0, 64) of all 64 heads (4 m-tiles × 8 n-tiles, 128
//       accumulators): P from shared memory (ldmatrix), V the same tile (ldmatrix.trans).
// R = 32 (attn_tc512g_f32) or 64 rows a tile (attn_tc512g64_f32: half the barriers a row, 212 KB
// of shared memory). Dynamic shared memory Atg<R>::SMEM + 4·max candidates (host: attn.rs,
// atg_smem).
#define ATG_LDK 520 // halves per row of a K/V tile: 512 + 8 (1040 B: ldmatrix rows on distinct banks)
// floats per head of a partial-S tile (R + 4: 16-byte rows, the softmax's float4 reads spread),
// halves per head of the P tile (R + 8: ldmatrix rows on distinct banks).
template <int R, bool PIPE = false> struct Atg {
    static constexpr int PS = R + 4, LDP = R + 8, NB = PIPE ? 3 : 2; // NB: K/V tile buffers
    static constexpr int KB = NB * R * ATG_LDK * 2, PB = 4 * 64 * PS * 4, WB = 64 * LDP * 2;
    static constexpr int SMEM = KB + PB + WB + (64 + 64 + 64 + 2 * ATC_MAXROT + 8) * 4;
};

// A token's present candidates (list above), in list order, as row numbers of rows16 = [ring
// (win) | this chunk's kv (n) | comp] into idx (shared); returns their count. 256 threads (wcnt: 8
// ints of shared memory), a block scan of 256 candidates at a time.
__device__ __forceinline__ int atg_list(int* idx, int* wcnt, long long t0, const AtgTok& tk, const int* __restrict__ raw_pos,
                                        int win, int n) {
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const long long first = tk.first;
    const int nwin = tk.nwin, nsel = tk.nsel, ncand = tk.ncand;
    const int* seli = tk.seli;
    int nvalid = 0;
    for (int base = 0; base < ncand; base += 256) {
        const int j = base + tid;
        int row = -1;
        if (j < nwin) {
            const long long p = first + j;
            if (p >= t0) row = win + (int)(p - t0);
            else {
                const int slot = (int)(p % win);
                row = raw_pos[slot] == (int)p ? slot : -1;
            }
        } else if (j < nwin + nsel) {
            const int c = seli[j - nwin];
            row = c >= 0 ? win + n + c : -1;
        } else if (j < ncand) {
            row = win + n + (j - nwin - nsel);
        }
        const u32 b = __ballot_sync(0xffffffffu, row >= 0);
        if (lane == 0) wcnt[w] = __popc(b);
        __syncthreads();
        int off = nvalid, tot = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int c = wcnt[k];
            off += k < w ? c : 0;
            tot += c;
        }
        if (row >= 0) idx[off + __popc(b & ((1u << lane) - 1u))] = row;
        nvalid += tot;
        __syncthreads(); // wcnt reused
    }
    return nvalid;
}

// attn_tcg_body's output: warp w's 64 columns of the CTA's heads, O / softmax sum with the sink,
// RoPE of the columns >= rot0 where ROT (rot_s: the token's cos, sin pairs), f32 pairs or (BO)
// bf16 pairs by one cvt (ds4_bf16x2: the bits of ds4_f2bf for finite values). Absent heads (h >=
// heads) are dropped before their columns. The earlier form (RoPE predicated in every warp, a
// branch and ~12 integer instructions a bf16 pair) was 14% / 25% of a ratio-4 / ratio-128 layer's
// stall samples at a 2k prompt (ncu, H100); this one: calls -2.3% / -4.0% on the H200, prefill
// +0.2-0.3% (bench/results/gpu-s55-h200.txt).
template <bool ROT, bool BO>
__device__ __forceinline__ void atg_store(const float (&acc)[4][8][4], float* __restrict__ out, const float* __restrict__ sinks,
                                          const float* m_s, const float* z_s, const float* rot_s, int heads, int i, int w,
                                          int g, int tq, int rot0) {
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int h = 16 * mt + g + 8 * u;
            if (h >= heads) continue;
            const float sink = sinks[h], mm = m_s[h];
            const float M = fmaxf(sink, mm);
            const float wm = mm == DS4_NEG_INF ? 0.0f : expf(mm - M);
            const float f = wm / (expf(sink - M) + z_s[h] * wm);
            const size_t o0 = ((size_t)i * heads + h) * 512 + 64 * w + 2 * tq;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const int col = 64 * w + 8 * nt + 2 * tq;
                float a = acc[mt][nt][2 * u] * f, b = acc[mt][nt][2 * u + 1] * f;
                if (ROT && col >= rot0) {
                    const int p = (col - rot0) >> 1;
                    atc_rot(a, b, rot_s[2 * p], rot_s[2 * p + 1]);
                }
                if constexpr (BO) *(u32*)((u16*)out + o0 + 8 * nt) = ds4_bf16x2(a, b);
                else *(float2*)(out + o0 + 8 * nt) = make_float2(a, b);
            }
        }
}

// QN (attn_tc512gn_f32): q is raw, and each head is normed and rotated here as it loads, with
// fused.cu fu_norm_rope_row's operations (no weight, no rounding): Σx² in f64, the scale
// (float)(1 / sqrt(Σx² / 512 + eps)), RoPE of the last n_rot columns at t by the f64 sincos of
// pos·ω mod 2π rounded to f32, a' = a·cos − b·sin, b' = a·sin + b·cos unfused. Only the order of
// the f64 sum differs (the scale's f32 bits in all but ~1e-9 of heads), and the separate
// norm_rope pass (reading and writing q: 189 us a 2k layer on the H200) goes.
// BO (attn_tc512g[n]_bf): out holds bf16 (ds4_f2bf: round to nearest even, the bits blas_x_f32
// gives the f32 value), the X' of the `fast` output projection (Backend::attend_project): no f32
// o written and converted again (at 2,048 tokens 268 MB written, read and 134 MB written a layer).
template <int R, bool PIPE, bool QN = false, bool BO = false>
__device__ __forceinline__ void attn_tcg_body(ATC_PARAMS, const u16* __restrict__ rows16, float qeps = 0.0f,
                                              const float4* __restrict__ rtab = nullptr) {
    extern __shared__ __align__(16) unsigned char atg_sm[];
    constexpr int PS = Atg<R, PIPE>::PS, LDP = Atg<R, PIPE>::LDP, RT = R / 4; // RT: softmax rows a thread
    u16* ks = (u16*)atg_sm;                                          // [2][R][ATG_LDK]
    float* part = (float*)(atg_sm + Atg<R, PIPE>::KB);                     // [4][64][PS]
    u16* pw = (u16*)(atg_sm + Atg<R, PIPE>::KB + Atg<R, PIPE>::PB);              // [64][LDP]
    float* cf_s = (float*)(atg_sm + Atg<R, PIPE>::KB + Atg<R, PIPE>::PB + Atg<R, PIPE>::WB); // [64]
    float* m_s = cf_s + 64;                                          // [64] final max
    float* z_s = m_s + 64;                                           // [64] final sum
    float* rot_s = z_s + 64;                                         // [ATC_MAXROT][2]
    int* wcnt = (int*)(rot_s + 2 * ATC_MAXROT);                      // [8] scan counts
    int* idx = wcnt + 8;                                             // [max candidates]
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int i = blockIdx.y, n = gridDim.y;
    const AtgTok tk = atg_tok(t0, i, win, ratio, sel, top_k);
    const long long t = tk.t;
    const int hp = w & 1, kg = w >> 1; // Q fragments: heads 32·hp + 16·mt + g (+8), columns 128·kg + [0, 128)
    // The query pairs of m-tile mt, k-step k: heads ha (v[0], v[2]) and hb = ha + 8 (v[1], v[3]),
    // columns 128·kg + 16·k + 2·tq (v[0], v[1]) and + 8 (v[2], v[3]); absent heads read as 0.
    auto q_pairs = [&](int mt, int k, float2(&v)[4]) {
        const int ha = 32 * hp + 16 * mt + g, hb = ha + 8;
        const float* qpa = q + ((size_t)i * heads + ha) * 512 + 128 * kg + 2 * tq + 16 * k;
        const float* qpb = q + ((size_t)i * heads + hb) * 512 + 128 * kg + 2 * tq + 16 * k;
        const float2 z2 = make_float2(0.0f, 0.0f);
        v[0] = ha < heads ? *(const float2*)qpa : z2;
        v[1] = hb < heads ? *(const float2*)qpb : z2;
        v[2] = ha < heads ? *(const float2*)(qpa + 8) : z2;
        v[3] = hb < heads ? *(const float2*)(qpb + 8) : z2;
    };
    // QN: the raw query values (64 a lane), requested first so that their latency overlaps the
    // candidate listing.
    float2 qv[2][8][4];
    if constexpr (QN) {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int k = 0; k < 8; k++) q_pairs(mt, k, qv[mt][k]);
    }
    // QN: (sin, cos) for the query's RoPE, in part (free until the tile loop).
    float2* qsc = (float2*)((double*)part + 4 * 64);
    atg_rope(rot_s, qsc, rtab, freqs, t, i, n_rot);
    // Present candidates, in list order, as row numbers of rows16 = [ring (win) | kv (n) | comp].
    const int nvalid = atg_list(idx, wcnt, t0, tk, raw_pos, win, n);
    const int ntiles = (nvalid + R - 1) / R;
    // Tile loader: chunk c = tid + 256·k (k < R/4) is 16 bytes e = c % 64 of row c / 64.
    auto load_tile = [&](int jt) {
        u16* dst = ks + (jt % Atg<R, PIPE>::NB) * R * ATG_LDK;
#pragma unroll
        for (int k = 0; k < R / 4; k++) {
            const int c = tid + 256 * k, r = c >> 6, e = c & 63, j = jt * R + r;
            const bool ok = j < nvalid;
            const u16* src = rows16 + (ok ? (size_t)idx[j] * 512 + 8 * e : 0);
            ds4_cp16(dst + r * ATG_LDK + 8 * e, src, ok);
        }
        ds4_cp_commit();
    };
    if (ntiles > 0) load_tile(0); // in flight while the Q fragments load
    // Q fragments (f16).
    u32 qa[2][8][4];
    if constexpr (QN) {
        double ss[2][2] = {{0.0, 0.0}, {0.0, 0.0}}; // [mt][head ha, hb]
        // Sum squares per head: this lane's 32 values, its quad, then (after a barrier) the 4
        // column quarters (warps kg) in order, one thread a head, which also takes the scale;
        // the RoPE table at t meanwhile. All in part, free until the tile loop's first barrier.
        double* qss = (double*)part;           // [4 quarters][64 heads]; then qsc [ATC_MAXROT]
        float* qsf = (float*)(qsc + ATC_MAXROT); // [64]: each head's scale
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int k = 0; k < 8; k++)
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const float2 v = qv[mt][k][u];
                    ss[mt][u & 1] += (double)v.x * (double)v.x + (double)v.y * (double)v.y;
                }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                ss[mt][h] += __shfl_xor_sync(0xffffffffu, ss[mt][h], 1);
                ss[mt][h] += __shfl_xor_sync(0xffffffffu, ss[mt][h], 2);
                if (tq == 0) qss[kg * 64 + 32 * hp + 16 * mt + g + 8 * h] = ss[mt][h];
            }
        __syncthreads();
        if (tid < 64) {
            const double tot = ((qss[tid] + qss[64 + tid]) + qss[128 + tid]) + qss[192 + tid];
            qsf[tid] = (float)(1.0 / sqrt(tot / 512.0 + (double)qeps));
        } else if (!rtab && tid < 64 + n_rot / 2) {
            qsc[tid - 64] = atc_sin_cos(atc_theta(t, freqs[tid - 64]));
        }
        __syncthreads();
        const int r0 = 512 - n_rot;
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const float sc[2] = {qsf[32 * hp + 16 * mt + g], qsf[32 * hp + 16 * mt + g + 8]};
#pragma unroll
            for (int k = 0; k < 8; k++)
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const float2 v = qv[mt][k][u];
                    float a = v.x * sc[u & 1], b = v.y * sc[u & 1];
                    const int c = 128 * kg + 16 * k + 2 * tq + 8 * (u >> 1); // even: a pair
                    if (c >= r0) {
                        const float2 tt = qsc[(c - r0) >> 1];
                        atc_rot(a, b, tt.y, tt.x);
                    }
                    qa[mt][k][u] = ds4_f16x2(a, b);
                }
        }
    } else {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float2 v[4];
                q_pairs(mt, k, v);
#pragma unroll
                for (int u = 0; u < 4; u++) qa[mt][k][u] = ds4_f16x2(v[u].x, v[u].y);
            }
    }
    float acc[4][8][4];
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    float m = DS4_NEG_INF, z = 0.0f; // softmax role: head tid/4 (the quad's lanes agree on m)
    const int sh = tid >> 2, sq = tid & 3;
    // The three phases of a tile (kw: its K/V buffer).
    auto s_phase = [&](const u16* kw) {
        // S partial: 2 m-tiles × R/8 n-tiles over this warp's 128 columns, 16 rows (two
        // n-tiles: one ldmatrix.x4 a k-step) at a time (fewer live accumulators).
        {
            const int mi = lane >> 3, rr = lane & 7;
            float* pp = part + kg * 64 * PS;
#pragma unroll
            for (int np = 0; np < R / 16; np++) {
                float s[2][2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    u32 b[4];
                    ds4_ldm4(b, kw + (16 * np + rr + 8 * (mi >> 1)) * ATG_LDK + 128 * kg + 16 * k + 8 * (mi & 1));
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        ds4_mma_f16(s[mt][0], qa[mt][k], b[0], b[1]);
                        ds4_mma_f16(s[mt][1], qa[mt][k], b[2], b[3]);
                    }
                }
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        const int h = 32 * hp + 16 * mt + g, r = 16 * np + 8 * nt + 2 * tq;
                        *(float2*)(pp + h * PS + r) = make_float2(s[mt][nt][0], s[mt][nt][1]);
                        *(float2*)(pp + (h + 8) * PS + r) = make_float2(s[mt][nt][2], s[mt][nt][3]);
                    }
            }
        }
    };
    auto sm_phase = [&](int jt) {
        // Online softmax: head sh, rows RT·sq + [0, RT).
        {
            float s[RT];
#pragma unroll
            for (int u = 0; u < RT / 4; u++) {
                const int o = sh * PS + RT * sq + 4 * u;
                const float4 p0 = *(const float4*)(part + o), p1 = *(const float4*)(part + 64 * PS + o);
                const float4 p2 = *(const float4*)(part + 2 * 64 * PS + o),
                             p3 = *(const float4*)(part + 3 * 64 * PS + o);
                s[4 * u + 0] = ((p0.x + p1.x) + p2.x) + p3.x;
                s[4 * u + 1] = ((p0.y + p1.y) + p2.y) + p3.y;
                s[4 * u + 2] = ((p0.z + p1.z) + p2.z) + p3.z;
                s[4 * u + 3] = ((p0.w + p1.w) + p2.w) + p3.w;
            }
            const int rem = nvalid - jt * R - RT * sq; // rows of this thread present
            float mx = m;
#pragma unroll
            for (int r = 0; r < RT; r++) {
                s[r] = r < rem ? s[r] * scale : DS4_NEG_INF;
                mx = fmaxf(mx, s[r]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float c = m == mx ? 1.0f : expf(m - mx); // also −inf == −inf
            m = mx;
            u32 ph[RT / 2];
            float zs = 0.0f;
#pragma unroll
            for (int r = 0; r < RT / 2; r++) {
                const float e0 = s[2 * r] == DS4_NEG_INF ? 0.0f : expf(s[2 * r] - mx);
                const float e1 = s[2 * r + 1] == DS4_NEG_INF ? 0.0f : expf(s[2 * r + 1] - mx);
                ph[r] = ds4_f16x2(e0, e1);
                zs += ds4_h2f_fast(ph[r] & 0xffffu) + ds4_h2f_fast(ph[r] >> 16); // the weights the product uses
            }
            z = z * c + zs;
#pragma unroll
            for (int u = 0; u < RT / 8; u++)
                *(uint4*)(pw + sh * LDP + RT * sq + 8 * u) = make_uint4(ph[4 * u], ph[4 * u + 1], ph[4 * u + 2], ph[4 * u + 3]);
            if (sq == 0) cf_s[sh] = c;
        }
    };
    auto o_phase = [&](const u16* kw) {
        // O += P · V over this warp's 64 columns.
        {
            // Rescale only where a head's max moved (the factor is exactly 1 otherwise: most tiles
            // after the first few), warp-uniform.
            float cfa[4], cfb[4];
            bool one = true;
#pragma unroll
            for (int mt = 0; mt < 4; mt++) {
                cfa[mt] = cf_s[16 * mt + g];
                cfb[mt] = cf_s[16 * mt + g + 8];
                one = one && cfa[mt] == 1.0f && cfb[mt] == 1.0f;
            }
            if (!__all_sync(0xffffffffu, one)) {
#pragma unroll
                for (int mt = 0; mt < 4; mt++)
#pragma unroll
                    for (int nt = 0; nt < 8; nt++) {
                        acc[mt][nt][0] *= cfa[mt];
                        acc[mt][nt][1] *= cfa[mt];
                        acc[mt][nt][2] *= cfb[mt];
                        acc[mt][nt][3] *= cfb[mt];
                    }
            }
            const int mi = lane >> 3, rr = lane & 7;
#pragma unroll 1
            for (int kk = 0; kk < R / 16; kk++) {
                u32 a[4][4];
#pragma unroll
                for (int mt = 0; mt < 4; mt++)
                    ds4_ldm4(a[mt], pw + (16 * mt + rr + 8 * (mi & 1)) * LDP + 16 * kk + 8 * (mi >> 1));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    u32 b[4];
                    ds4_ldm4_t(b, kw + (16 * kk + rr + 8 * (mi & 1)) * ATG_LDK + 64 * w + 16 * np + 8 * (mi >> 1));
#pragma unroll
                    for (int mt = 0; mt < 4; mt++) {
                        ds4_mma_f16(acc[mt][2 * np], a[mt], b[0], b[1]);
                        ds4_mma_f16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
    };
    if constexpr (!PIPE) {
        for (int jt = 0; jt < ntiles; jt++) {
            ds4_cp_wait<0>();
            __syncthreads(); // tile jt visible; every warp is past tile jt−1 (its buffer, part, pw free)
            if (jt + 1 < ntiles) load_tile(jt + 1);
            const u16* kw = ks + (jt & 1) * R * ATG_LDK;
            s_phase(kw);
            __syncthreads();
            sm_phase(jt);
            __syncthreads();
            o_phase(kw);
        }
    } else {
        // Pipelined (attn_tc512gp_f32): O of tile jt and S of tile jt+1 in one phase, then the
        // softmax of jt+1: 2 barriers a tile; three K/V buffers (jt, jt+1 read, jt+2 loading).
        if (ntiles > 1) load_tile(1);
        else ds4_cp_commit();
        if (ntiles > 0) {
            ds4_cp_wait<1>();
            __syncthreads();
            s_phase(ks);
            __syncthreads();
            sm_phase(0);
        }
        for (int jt = 0; jt < ntiles; jt++) {
            ds4_cp_wait<0>();
            __syncthreads(); // tile jt+1 visible, P and factors of jt written, part read
            if (jt + 2 < ntiles) load_tile(jt + 2); // its buffer last held jt−1 (read before the barrier)
            o_phase(ks + (jt % 3) * R * ATG_LDK);
            if (jt + 1 < ntiles) s_phase(ks + ((jt + 1) % 3) * R * ATG_LDK);
            __syncthreads();
            if (jt + 1 < ntiles) sm_phase(jt + 1);
        }
    }
    // Final max and sum per head (z: this thread's rows, summed over the quad).
    z += __shfl_xor_sync(0xffffffffu, z, 1);
    z += __shfl_xor_sync(0xffffffffu, z, 2);
    if (sq == 0) {
        m_s[sh] = m;
        z_s[sh] = z;
    }
    __syncthreads();
    // The store: see atg_store. RoPE only in warps whose 64 columns hold rotated ones (n_rot =
    // 64: warp 7), warp-uniform.
    const int rot0 = 512 - n_rot;
    if (64 * w + 64 > rot0) atg_store<true, BO>(acc, out, sinks, m_s, z_s, rot_s, heads, i, w, g, tq, rot0);
    else atg_store<false, BO>(acc, out, sinks, m_s, z_s, rot_s, heads, i, w, g, tq, rot0);
}
#define ATG_BODY(R, PIPE) attn_tcg_body<R, PIPE>(ATC_ARGS, rows16);
#define ATGN_BODY attn_tcg_body<32, false, true>(ATC_ARGS, rows16, qeps, rtab);
#define ATGB_BODY attn_tcg_body<32, false, false, true>(ATC_ARGS, rows16);
#define ATGNB_BODY attn_tcg_body<32, false, true, true>(ATC_ARGS, rows16, qeps, rtab);
#else
#define ATG_BODY(R, PIPE)
#define ATGN_BODY
#define ATGB_BODY
#define ATGNB_BODY
#endif

// grid (ceil(heads / 16), n), blockDim 128; q [n, heads, hd], out [n, heads, hd], rows16 the f16
// rows [win + n + visible compressed, hd] by atc_rows_f16 (kv, raw, comp: not read); host checks:
// CUDA sm_80+, 16-byte aligned rows, n_rot even and <= min(hd, 128).
// attn_tc<hd>_f32: hi/lo split of Q and P; attn_tc<hd>h_f32: hi only.
DS4_KERNEL void DS4_BOUNDS(128) attn_tc512_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATC_BODY(512, true) }
DS4_KERNEL void DS4_BOUNDS(128) attn_tc512h_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATC_BODY(512, false) }
// grid (1, n), blockDim 256, dynamic shared Atg<R>::SMEM + 4·(most candidates of a token); heads
// <= 64, hd 512; otherwise as attn_tc512h_f32. R = 32 / 64 rows a tile.
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512g_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATG_BODY(32, false) }
// attn_tc512g_f32 of the raw queries: each head's RMS norm (eps qeps, no weight) and RoPE at
// its token's position applied as Q loads (attn_tcg_body QN).
// rtab: null, or atc_rope_tab's table for the chunk (the f64 angles off the CTA's path).
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512gn_f32(ATC_PARAMS, const u16* __restrict__ rows16, float qeps, const float4* __restrict__ rtab) { ds4_pdl_enter(); ATGN_BODY }
// The same two with bf16 output (attn_tcg_body BO; out: n x heads x 512 bf16).
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512g_bf(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATGB_BODY }
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512gn_bf(ATC_PARAMS, const u16* __restrict__ rows16, float qeps, const float4* __restrict__ rtab) { ds4_pdl_enter(); ATGNB_BODY }
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512g64_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATG_BODY(64, false) }
DS4_KERNEL void DS4_BOUNDS(256) attn_tc512gp_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATG_BODY(32, true) }
DS4_KERNEL void DS4_BOUNDS(128) attn_tc64_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATC_BODY(64, true) }
DS4_KERNEL void DS4_BOUNDS(128) attn_tc64h_f32(ATC_PARAMS, const u16* __restrict__ rows16) { ds4_pdl_enter(); ATC_BODY(64, false) }
// grid-stride (any grid), blockDim 256; rows 16-byte aligned, hd a multiple of 4.
DS4_KERNEL void DS4_BOUNDS(256) atc_rows_f16(const float* __restrict__ raw, const float* __restrict__ kv, const float* __restrict__ comp, u16* __restrict__ dst, long long nraw4, long long nkv4, long long total4) { ds4_pdl_enter(); ATC_ROWS_BODY }
// The RoPE angles of a prompt chunk's tokens for the raw-query kernels, computed as they would:
// tab[i][p] = ((float)cos θ, −(float)sin θ, (float)sin θ, (float)cos θ), θ = fmod((t0 + i)·freqs[p],
// 2π) in f64, the first pair by cos() and sin() (the output's inverse RoPE), the second by sincos()
// (the query's, as fused.cu's norm_rope): the same bits as each CTA computing them itself, off its
// path (one CTA an SM waited ~2 us on the f64 fmod / sincos of 32 threads). grid-stride, 256.
DS4_KERNEL void DS4_BOUNDS(256) atc_rope_tab(const double* __restrict__ freqs, float4* __restrict__ tab, long long t0, int n, int npair) {
    ds4_pdl_enter();
    for (long long k = (long long)blockIdx.x * 256 + threadIdx.x; k < (long long)n * npair; k += (long long)gridDim.x * 256) {
        const long long i = k / npair;
        const int p = (int)(k - i * npair);
        const double theta = atc_theta(t0 + i, freqs[p]);
        const float2 r = atc_cos_nsin(theta), qs = atc_sin_cos(theta);
        tab[k] = make_float4(r.x, r.y, qs.x, qs.y);
    }
}

// ---------------------------------------------------------------------------------------------
// Lightning-indexer scores on tensor cores (prefill and decode): the contract and the bits of
// index_scores128h_f32 (attention.cu), scores[i][r] = Σ_h (w[i,h]·ws)·max(0, q_ih·row_r) for
// r < (t+1)/ratio, when queries and rows are FP4-simulated (fp4sim(H(v)), model.md; index_select
// rounds the queries and the compressor the rows when the indexer's fp4 flag is set, the host
// takes this kernel only then). Every element is then e2m1·2^k: exact in bf16, each product
// exact in f32, and (the four block scales of a row lie within a few powers of two) every partial
// sum of a 128-term dot is exact as well, so the dot does not depend on the order of its
// additions (mma here, eight partial sums on the CPU). The head terms and their sum in head order
// are the CPU's f32 operations.
//
// CTA = IXT_TOK tokens × 64 heads (M = 256), 8 warps: warp w takes token w/2 and heads
// (w%2)·32 + [0, 32) as two m16 tiles, its Q fragments (bf16, 64 registers) loaded once; warps of
// absent tokens (decode: 1 token) only help stage the rows. The CTA
// walks rb rows (a multiple of 32) from blockIdx.x·rb in tiles of 32: the tile is copied into
// shared memory (row stride IXT_BS halves: the B fragment reads hit 32 banks), the next tile's
// loads are in flight during the mma, each warp computes its 32 heads × 32 rows, the terms go to
// shared [token][head][row], then 128 threads (token, row) add the 64 heads in order.
// grid (ceil(max_vis / rb), ceil(ntok / IXT_TOK)), blockDim 256; heads 64, ihd 128;
// q [ntok, 64, 128], w [ntok, 64], rows [≥ max_vis, 128] bf16 (the indexer's rows as the
// compressor stores them when FP4-simulated: exact; mod.rs GpuComp::bf16), 16-byte aligned;
// scores [ntok, max_vis].
#define IXT_TOK 4
#define IXT_BS 136 // bf16 per row of the B tile: 128 + 8 (row g at bank 4g + t)
#define IXT_TS 36  // floats per head of the term tile: 32 rows + 4

#if ATC_HAVE_MMA
// bf16x2 of (lo, hi): lo in bits 0..15, round to nearest even (exact for e2m1·2^k).
__device__ __forceinline__ u32 ixt_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The bf16 A fragments (as mma.m16n8k16) of 16 heads × 128 of one token's FP4-simulated query:
// qh = the lane's first element (head g of the 16, column 2t); k-step ks: heads g, g + 8 at
// columns 16 ks + 2t (+1) and + 8. index_scores_tc (per 16-head tile) and index_scores_wg.
__device__ __forceinline__ void ixt_qfrag(const float* __restrict__ qh, u32 (&a)[8][4]) {
#pragma unroll
    for (int ks = 0; ks < 8; ks++) {
        const float2 x0 = *(const float2*)(qh + ks * 16), x1 = *(const float2*)(qh + 8 * 128 + ks * 16);
        const float2 x2 = *(const float2*)(qh + ks * 16 + 8), x3 = *(const float2*)(qh + 8 * 128 + ks * 16 + 8);
        a[ks][0] = ixt_pack(x0.x, x0.y);
        a[ks][1] = ixt_pack(x1.x, x1.y);
        a[ks][2] = ixt_pack(x2.x, x2.y);
        a[ks][3] = ixt_pack(x3.x, x3.y);
    }
}


__device__ __forceinline__ void index_scores_tc_body(const float* __restrict__ q, const float* __restrict__ w,
                                                     const u16* __restrict__ rows, float* __restrict__ scores,
                                                     long long tb, long long max_vis, int ntok, int ratio, float ws, int rb) {
    __shared__ __align__(16) u16 bs[32 * IXT_BS];        // B tile: 32 rows × 128 bf16 (8.5 KB)
    __shared__ __align__(16) float term[IXT_TOK * 64 * IXT_TS]; // [token][head][row] (36 KB)
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
    const int i0 = blockIdx.y * IXT_TOK, ntk = min(IXT_TOK, ntok - i0);
    const long long vmax = (tb + i0 + ntk) / ratio; // rows the CTA's last token sees
    const long long r_begin = (long long)blockIdx.x * rb;
    if (r_begin >= vmax) return; // whole CTA past the visible rows
    const long long r_end = min(r_begin + (long long)rb, vmax);
    const int tw = warp / 2, hw = (warp % 2) * 32;
    const bool act = tw < ntk;            // warps of absent tokens (a ragged last group) only stage rows
    const int ti = i0 + min(tw, ntk - 1); // (their fragments: a copy, never used)
    u32 a[2][8][4];
    float wh[2][2];
#pragma unroll
    for (int mt = 0; mt < 2 && act; mt++) {
        ixt_qfrag(q + ((size_t)ti * 64 + hw + mt * 16 + g) * 128 + 2 * tq, a[mt]);
#pragma unroll
        for (int u = 0; u < 2; u++) wh[mt][u] = __fmul_rn(w[(size_t)ti * 64 + hw + mt * 16 + g + 8 * u], ws);
    }
    // Thread's share of a tile: 2 pieces of 8 bf16 (row e/16, piece e%16 for e = tid + 256·j).
    uint4 v[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int e = tid + 256 * j;
        const long long row = min(r_begin + e / 16, vmax - 1);
        v[j] = *((const uint4*)(rows + row * 128) + e % 16);
    }
    for (long long r0 = r_begin; r0 < r_end; r0 += 32) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int e = tid + 256 * j;
            *(uint4*)(bs + (e / 16) * IXT_BS + (e % 16) * 8) = v[j];
        }
        __syncthreads();
        if (r0 + 32 < r_end) { // warp-uniform; the next tile's loads overlap the mma
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int e = tid + 256 * j;
                const long long row = min(r0 + 32 + e / 16, vmax - 1);
                v[j] = *((const uint4*)(rows + row * 128) + e % 16);
            }
        }
        if (!act) { // the same barriers; its summing share below (token = warp >= 2·ntk) is absent too
            __syncthreads();
            continue;
        }
        float c[2][4][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int k = 0; k < 4; k++) c[mt][nt][k] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const u16* bp = bs + (nt * 8 + g) * IXT_BS + ks * 16 + 2 * tq;
                const u32 b0 = *(const u32*)bp, b1 = *(const u32*)(bp + 8);
                ds4_mma_bf16(c[0][nt], a[0][ks], b0, b1);
                ds4_mma_bf16(c[1][nt], a[1][ks], b0, b1);
            }
        }
        float* tt = term + tw * 64 * IXT_TS;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const float s0 = c[mt][nt][2 * u], s1 = c[mt][nt][2 * u + 1];
                    const float d0 = s0 > 0.0f ? s0 : 0.0f, d1 = s1 > 0.0f ? s1 : 0.0f;
                    *(float2*)(tt + (hw + mt * 16 + g + 8 * u) * IXT_TS + nt * 8 + 2 * tq) =
                        make_float2(__fmul_rn(wh[mt][u], d0), __fmul_rn(wh[mt][u], d1));
                }
        __syncthreads();
        if (tid < IXT_TOK * 32) {
            const int tk = tid / 32, rr = tid % 32;
            const long long row = r0 + rr, t = tb + i0 + tk;
            if (tk < ntk && row < (t + 1) / ratio) {
                const float* tp = term + tk * 64 * IXT_TS + rr;
                float total = -0.0f;
#pragma unroll 8
                for (int h = 0; h < 64; h++) total = __fadd_rn(total, tp[h * IXT_TS]);
                scores[(size_t)(i0 + tk) * max_vis + row] = total;
            }
        }
    }
}
#define IXT_BODY index_scores_tc_body(q, w, rows, scores, tba + (sp ? *sp : 0LL), max_vis, ntok, ratio, ws, rb);
#else
#define IXT_BODY
#endif

DS4_KERNEL void DS4_BOUNDS(256) index_scores_tc(const float* __restrict__ q, const float* __restrict__ w, const u16* __restrict__ rows, float* __restrict__ scores, long long tba, long long max_vis, int ntok, int rb, int ratio, float ws, const long long* __restrict__ sp) { ds4_pdl_enter(); IXT_BODY }

// ---------------------------------------------------------------------------------------------
// Decode's indexer scores (steps of 1-4 tokens; attn.rs index_select): the contract, arguments
// and bits of index_scores_tc, one token a CTA (blockIdx.y). index_scores_tc serves four tokens
// a CTA, so at one token 6 of its 8 warps only stage rows, and at 218 registers one CTA fits an
// SM (ncu, 64k context: 12.5% occupancy, 84% of issue slots with no eligible warp, the rows
// read at ~0.6 TB/s). Here every warp computes: warp w takes heads 16 (w & 3) .. + 16 (its A
// fragments, 32 registers) and rows 16 (w >> 2) .. + 16 of each 32-row tile; the tiles come
// as bf16 rows (index_scores_tc's) by cp.async, IXD_NS - 1 ahead, and each warp reads its B
// fragments from them. Terms go to a [head][row] tile (two, taking
// turns) and one warp a tile, in rotation, adds a row's 64 heads in head order while the others
// go on: one barrier a tile. At most 80 registers: 3 CTAs an SM (IXD_SMEM each). H200
// (bench/results/gpu-index-s35-h200.txt): a tie with index_scores_tc up to 256k of context (both
// wait on the same chain: PDL wait, the first tiles' DRAM latency, the head sums), decode +1.5%
// at 512k and +2.5% at 1M (bytes in flight start to matter: 134 MB of f32 rows a layer at 1M).
// The rows stored as bf16 (67 MB; session 36, bench/results/gpu-bf16ix-s36-h200.txt): decode
// +4.1% / +4.5% more at 512k / 1M; from any row count (DS4_GPU_IXD_MIN=0) a tie at 2k / 8k.
// Preparing the query here too (no index_qprep_f32 launch) lost 1.3-2.0%: every CTA redid it.
// The host takes it from 16,384 score rows (attn.rs IXD_MIN_ROWS), where it was measured.
// grid (ceil(max_vis / rb), ntok), blockDim 256, dynamic shared IXD_SMEM; rb a multiple of 32.
#define IXD_RS 136 // bf16 a staged row: 128 + 8 (a warp's u32 fragment loads hit 32 banks)
#define IXD_NS 4   // row tile stages (3 in flight: 24 KB, as the f32 form's 2 held 32 KB)
#define IXD_LB 256, 3 // at most 80 registers: 3 CTAs an SM
#define IXD_SMEM (IXD_NS * 32 * IXD_RS * 2 + 2 * 64 * IXT_TS * 4) // 53,248 (attn.rs IXD_SMEM)

#if ATC_HAVE_MMA
__device__ __forceinline__ void index_scores_d_body(const float* __restrict__ q, const float* __restrict__ w,
                                                    const u16* __restrict__ rows, float* __restrict__ scores,
                                                    long long tb, long long max_vis, int ntok, int ratio, float ws, int rb) {
    extern __shared__ __align__(16) u8 ixd_dyn[];
    u16* stg = (u16*)ixd_dyn;                                     // [IXD_NS][32 rows][IXD_RS]
    float* term = (float*)(ixd_dyn + IXD_NS * 32 * IXD_RS * 2); // [2][64 heads][IXT_TS]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
    const int ti = blockIdx.y;
    if (ti >= ntok) return;
    const long long vis = (tb + ti + 1) / ratio; // rows this token sees
    const long long r_begin = (long long)blockIdx.x * rb;
    if (r_begin >= vis) return; // CTA-uniform
    const long long r_end = min(r_begin + (long long)rb, vis);
    const int ntl = (int)((r_end - r_begin + 31) / 32);
    // Copies of tile i into stage i % IXD_NS: 32 rows x 16 16-byte pieces, 2 a thread (row e / 16,
    // piece e % 16 for e = tid + 256 j); rows past the visible ones repeat the last (never stored).
    auto issue = [&](int i) {
        if (i < ntl) {
            u16* d = stg + (i % IXD_NS) * 32 * IXD_RS;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int e = tid + 256 * j;
                const long long row = min(r_begin + 32LL * i + e / 16, r_end - 1);
                ds4_cp16(d + (e / 16) * IXD_RS + (e % 16) * 8, rows + row * 128 + (e % 16) * 8, true);
            }
        }
        ds4_cp_commit(); // (empty groups past the last tile keep the wait count uniform)
    };
#pragma unroll
    for (int i = 0; i < IXD_NS - 1; i++) issue(i);
    const int mt = warp & 3, nh = warp >> 2;
    u32 a[8][4];
    ixt_qfrag(q + ((size_t)ti * 64 + mt * 16 + g) * 128 + 2 * tq, a);
    const float wh0 = __fmul_rn(w[(size_t)ti * 64 + mt * 16 + g], ws);
    const float wh1 = __fmul_rn(w[(size_t)ti * 64 + mt * 16 + g + 8], ws);
    // Row sums of tile i (its terms in term[i & 1]) by the lanes of one warp, in head order.
    auto sum_tile = [&](int i) {
        const long long row = r_begin + 32LL * i + lane;
        if (row < r_end) {
            const float* tp = term + (i & 1) * 64 * IXT_TS + lane;
            float total = -0.0f;
#pragma unroll 16
            for (int h = 0; h < 64; h++) total = __fadd_rn(total, tp[h * IXT_TS]);
            scores[(size_t)ti * max_vis + row] = total;
        }
    };
    for (int i = 0; i < ntl; i++) {
        ds4_cp_wait<IXD_NS - 2>(); // this thread's copies of tile i have landed
        __syncthreads();           // everyone's; tile i - 1's stage is free, its terms complete
        issue(i + IXD_NS - 1);
        if (i > 0 && warp == (i - 1) % 8) sum_tile(i - 1);
        const u16* bt = stg + (i % IXD_NS) * 32 * IXD_RS + (16 * nh + g) * IXD_RS + 2 * tq;
        float c[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int k = 0; k < 4; k++) c[nt][k] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const u16* bp = bt + nt * 8 * IXD_RS + ks * 16;
                ds4_mma_bf16(c[nt], a[ks], *(const u32*)bp, *(const u32*)(bp + 8));
            }
        }
        // Terms w_h max(0, s) of heads 16 mt + g (+ 8), rows 16 nh + 8 nt + 2 tq (+ 1). Buffer
        // i & 1 was last read by tile i - 2's sums, before this iteration's barrier.
        float* tt = term + (i & 1) * 64 * IXT_TS + (mt * 16 + g) * IXT_TS + 16 * nh + 2 * tq;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const float s0 = c[nt][0], s1 = c[nt][1], s2 = c[nt][2], s3 = c[nt][3];
            *(float2*)(tt + nt * 8) = make_float2(__fmul_rn(wh0, s0 > 0.0f ? s0 : 0.0f), __fmul_rn(wh0, s1 > 0.0f ? s1 : 0.0f));
            *(float2*)(tt + 8 * IXT_TS + nt * 8) =
                make_float2(__fmul_rn(wh1, s2 > 0.0f ? s2 : 0.0f), __fmul_rn(wh1, s3 > 0.0f ? s3 : 0.0f));
        }
    }
    __syncthreads();
    if (warp == (ntl - 1) % 8) sum_tile(ntl - 1);
}
#define IXD_BODY index_scores_d_body(q, w, rows, scores, tba + (sp ? *sp : 0LL), max_vis, ntok, ratio, ws, rb);
#else
#define IXD_BODY
#endif

DS4_KERNEL void DS4_BOUNDS(IXD_LB) index_scores_d(const float* __restrict__ q, const float* __restrict__ w, const u16* __restrict__ rows, float* __restrict__ scores, long long tba, long long max_vis, int ntok, int rb, int ratio, float ws, const long long* __restrict__ sp) { ds4_pdl_enter(); IXD_BODY }

// ---------------------------------------------------------------------------------------------
// The same scores on Hopper warpgroup MMA (sm_90a; prefill batches of more than IXT_FEW tokens,
// attn.rs; the contract and bits of index_scores_tc). H200, the 4th 8192-token chunk of a 32k
// prompt: index_scores_tc took 6.68 ms a layer at one 218-register CTA an SM, a quarter of its
// stall samples at the two CTA barriers a 32-row tile that wait on 128 threads' head sums.
// CTA = 4 warpgroups, one token each (IXW_TOK), over rows [rb · row block, + rb) in tiles of 64:
//   S = Q_t (64 heads × 128: bf16 A fragments in registers, loaded once) · R_tileᵀ
// by 8 wgmma m64n64k16 (B: the tile's 64 rows × 128 bf16 in shared memory, K-major core
// matrices of 8 rows × 16 bytes, core (row group, k group kg) at 128 (16 group + kg): LBO 128,
// SBO 2048, k-step kk at + 256 kk). Rows are the stored bf16 rows (index_scores_tc's),
// staged by cp.async IXW_NS - 2 tiles ahead. Two accumulator sets: tile i + 1's wgmma run while
// tile i's terms w_h max(0, s) go to the warpgroup's [row][head] tile (two, alternating) and 64
// of its threads add a row's 64 heads in head order (the CPU's f32 sum); a warpgroup barrier,
// no CTA barrier, waits on a sum. Exactness: as index_scores_tc (every partial sum of a dot
// exact; same terms, same head order).
#define IXW_TOK 4   // tokens a CTA: one a warpgroup
#define IXW_N 64    // rows a tile
#define IXW_NS 4    // row tile stages
#define IXW_TS 68   // floats a row of a term tile: 64 heads + 4 (conflict-free stores and float4 loads)
#define IXW_STAGE (IXW_N * 256)                 // bytes a stage: 64 rows × 128 bf16
#define IXW_TERM (IXW_N * IXW_TS * 4)           // bytes a term tile
#define IXW_SMEM (IXW_NS * IXW_STAGE + 2 * IXW_TOK * IXW_TERM) // 204,800 (attn.rs IXW_SMEM)

#if GW_HAVE
// Tile S = Q · Rᵀ of one warpgroup: the 8 k-steps into acc (the first with scale-d 0), one group.
__device__ __forceinline__ void ixw_mma(GwAcc<64>& acc, const u32 (&a)[8][4], u64 d) {
    gw_pin(acc);
    gw_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++) gw_mma_bf16(acc, a[kk], d + 16u * kk, kk);
    gw_commit();
    gw_pin(acc);
}

__device__ __forceinline__ void index_scores_wg_body(const float* __restrict__ q, const float* __restrict__ w,
                                                     const u16* __restrict__ rows16, float* __restrict__ scores,
                                                     long long tb, long long max_vis, int ntok, int ratio, float ws, int rb, int tfirst) {
    extern __shared__ __align__(128) u8 ixw_dyn[];
    const int tid = threadIdx.x, wg = tid >> 7, lt = tid & 127, qw = lt >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // tfirst: token groups along x (consecutive CTAs share a row block: read from DRAM once while
    // they run, then from L2), else row blocks along x.
    const int tg = tfirst ? blockIdx.x : blockIdx.y, rblk = tfirst ? blockIdx.y : blockIdx.x;
    const int i0 = tg * IXW_TOK, ntk = min(IXW_TOK, ntok - i0);
    const long long vmax = (tb + i0 + ntk) / ratio; // rows the CTA's last token sees
    const long long r_begin = (long long)rblk * rb;
    if (r_begin >= vmax) return; // whole CTA past the visible rows
    const long long r_end = min(r_begin + (long long)rb, vmax);
    const int ntiles = (int)((r_end - r_begin + IXW_N - 1) / IXW_N);
    // Absent tokens (a ragged last group) run the wgmma and terms on a copy of the last token's
    // fragments and store no score: wgmma, or a read of their accumulators, under a
    // thread-dependent branch makes ptxas serialize them (C7518).
    const bool act = wg < ntk;
    const int ti = i0 + min(wg, ntk - 1);
    const long long vis = min((tb + ti + 1) / ratio, r_end); // rows this token stores, from r_begin
    const u32 sb = (u32)__cvta_generic_to_shared(ixw_dyn);
    float* term = (float*)(ixw_dyn + IXW_NS * IXW_STAGE) + wg * 2 * (IXW_TERM / 4);

    // A fragments (as mma.m16n8k16, warp qw's 16 heads): heads 16 qw + g (+8), k 16 kk + 2t (+1, +8, +9).
    u32 a[8][4];
    float wh[2];
    {
        ixt_qfrag(q + ((size_t)ti * 64 + 16 * qw + g) * 128 + 2 * t, a);
#pragma unroll
        for (int u = 0; u < 2; u++) wh[u] = __fmul_rn(w[(size_t)ti * 64 + 16 * qw + g + 8 * u], ws);
    }
    // Tile j's rows into stage j % IXW_NS: 1024 pieces of 16 bytes, two a thread: piece p is row
    // 8 (p >> 7) + (p & 7), k group (p >> 3) & 15, so its core-matrix slot is simply 16 p: 8
    // lanes store 128 consecutive bytes (a warp reads 8 rows x 64 bytes). (Rows by 16 lanes, k
    // groups 128 bytes apart, made each store an 8-way bank conflict: ncu, run D.) Rows at or
    // past r_end are zero-filled (read nothing).
    int pn[2];
    const u16* psrc[2];
#pragma unroll
    for (int jj = 0; jj < 2; jj++) {
        const int p = tid + 512 * jj;
        pn[jj] = 8 * (p >> 7) + (p & 7);
        psrc[jj] = rows16 + (r_begin + pn[jj]) * 128 + 8 * ((p >> 3) & 15);
    }
    const int nrows = (int)(r_end - r_begin); // <= rb
    auto stage = [&](int j) {
        if (j < ntiles) {
            const u32 so = sb + (u32)(j % IXW_NS) * IXW_STAGE + 16u * (u32)tid;
            const int lim = nrows - IXW_N * j;
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
                const bool ok = pn[jj] < lim;
                ds4_cp16n(so + 8192u * jj, ok ? psrc[jj] + (size_t)(IXW_N * 128) * (u32)j : rows16, ok ? 16 : 0);
            }
        }
        ds4_cp_commit(); // one group a tile, empty past the last
    };
    const u64 d0 = gw_desc(sb, 128u, 2048u);
    auto desc = [&](int j) { return d0 + (u64)((u32)(j % IXW_NS) * (IXW_STAGE / 16)); };
    // Tile j's terms from acc into term tile j % 2, then the head sums of its rows.
    auto sums = [&](const GwAcc<64>& acc, int j) {
        float* tt = term + (j & 1) * (IXW_TERM / 4);
        // v[4 jn + e]: row 8 jn + 2t + (e & 1), head 16 qw + g + 8 (e >> 1): the lane's part of the
        // address once, the rest constant (one store a term, no address arithmetic).
        float* tl = tt + 2 * t * IXW_TS + 16 * qw + g;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const float s = acc.v[i], dd = s > 0.0f ? s : 0.0f;
            tl[(8 * (i >> 2) + (i & 1)) * IXW_TS + 8 * ((i >> 1) & 1)] = __fmul_rn(wh[(i >> 1) & 1], dd);
        }
        ds4_bar_named(1 + wg, 128);
        // The sums run on two of the warpgroup's warps: 0 and 1 in even warpgroups, 2 and 3 in
        // odd ones, so every scheduler (warp % 4) gets two of a CTA's eight summing warps (all
        // on schedulers 0 and 1 before).
        const int sr = lt & (IXW_N - 1);
        const long long row = r_begin + (long long)IXW_N * j + sr;
        if (act && (lt >> 6) == (wg & 1) && row < vis) {
            const float4* tp = (const float4*)(tt + sr * IXW_TS);
            float total = -0.0f;
#pragma unroll
            for (int h4 = 0; h4 < 16; h4++) {
                const float4 f = tp[h4];
                total = __fadd_rn(total, f.x);
                total = __fadd_rn(total, f.y);
                total = __fadd_rn(total, f.z);
                total = __fadd_rn(total, f.w);
            }
            scores[(size_t)ti * max_vis + row] = total;
        }
    };

#pragma unroll
    for (int j = 0; j < IXW_NS - 1; j++) stage(j);
    ds4_cp_wait<IXW_NS - 2>(); // tile 0 landed
    gw_proxy_fence();
    __syncthreads();
    GwAcc<64> acc0, acc1;
#pragma unroll
    for (int i = 0; i < 32; i++) acc0.v[i] = 0.0f, acc1.v[i] = 0.0f;
    ixw_mma(acc0, a, desc(0));
    // Tile i: tile i + 1's rows landed (groups issued: up to tile i + IXW_NS - 2), its wgmma
    // issued into acc1, tile i + IXW_NS - 1 staged into tile i - 1's stage (every warpgroup
    // waited for the wgmma of tiles <= i before this barrier), tile i's sums from acc0 while tile
    // i + 1's wgmma run, then acc1 copied into acc0. ptxas serializes the wgmma (tests/compile.rs)
    // when the two sets swap roles instead (C7514) or when a wgmma or an accumulator read sits
    // in a branch or after a loop that may not run (C7518), so the last pass issues the wgmma of
    // a tile ntiles that does not exist (a stale stage, never read: 1 / 32 of a CTA of 2048 rows).
#pragma unroll 1
    for (int i = 0; i < ntiles; i++) {
        ds4_cp_wait<IXW_NS - 3>();
        gw_proxy_fence();
        __syncthreads();
        ixw_mma(acc1, a, desc(i + 1));
        stage(i + IXW_NS - 1);
        gw_wait<1>();
        gw_pin(acc0);
        sums(acc0, i);
        gw_wait<0>();
        gw_pin(acc1);
#pragma unroll
        for (int k = 0; k < 32; k++) acc0.v[k] = acc1.v[k];
    }
    gw_wait<0>();
    ds4_cp_wait<0>();
}
#define IXW_BODY index_scores_wg_body(q, w, rows16, scores, tba, max_vis, ntok, ratio, ws, rb, tfirst);
#else
#define IXW_BODY (void)q, (void)w, (void)rows16, (void)scores, (void)tba, (void)max_vis, (void)ntok, (void)rb, (void)ratio, (void)ws, (void)tfirst;
#endif

// grid (ceil(ntok / IXW_TOK), ceil(max_vis / rb)) with tfirst, else (ceil(max_vis / rb),
// ceil(ntok / IXW_TOK)); blockDim 512, dynamic shared IXW_SMEM; rb a multiple of IXW_N; rows16:
// rows [0, max_vis) as bf16 (index_scores_tc's), 16-byte aligned; the rest as index_scores_tc
// (no step block: prefill only).
DS4_KERNEL void DS4_BOUNDS(512) index_scores_wg(const float* __restrict__ q, const float* __restrict__ w, const u16* __restrict__ rows16, float* __restrict__ scores, long long tba, long long max_vis, int ntok, int rb, int ratio, float ws, int tfirst) { ds4_pdl_enter(); IXW_BODY }

// ---------------------------------------------------------------------------------------------
// Prompt attention on Hopper warpgroup MMA (sm_90a): the contract and rounding of
// attn_tc512g[n]_f32 (a CTA a token for all <= 64 heads, head width 512, absent candidates
// dropped; K/V rows f16, Q and P one f16 product each; `n`: the raw queries normed and rotated as
// they load), another summation order. CTA = 2 warpgroups; warpgroup h owns columns 256 h + [0, 256):
//   S_h = Q[:, cols h] · K_tileᵀ by 16 wgmma m64n32k16: A = the token's 64 heads (warp qw: heads
//         16 qw + [0, 16)) as f16 fragments held in registers (64 a thread, built once), B = the
//         tile's 32 rows in shared memory (K-major);
//   S = S_0 + S_1 through shared memory (the same bits in both warpgroups: + commutes); both run
//         the same online softmax (a quad's lanes share a head) and keep P (f16) in registers as
//         the A fragments of
//   O_h += P · V_tile[:, cols h] by 4 wgmma m64n128k16 (2 k-steps x 2 column halves), B = the same
//         staged rows read MN-major (imm-trans-b); 128 accumulators a thread.
// Rows are staged by cp.async AWG_NS - 2 tiles ahead as 8 x 8 core matrices (8 rows x 16 bytes, 128
// contiguous bytes): core (row group rg, column group cg) at 128 (64 rg + cg); so S's B (K-major)
// has LBO 128 (columns) and SBO 8192 (rows), O's B (MN-major) LBO 8192 (rows: its K) and SBO 128.
// One CTA barrier a tile (the S exchange); it also orders stage reuse: a stage is refilled after
// both warpgroups waited for the O that read it (the wait for the next tile's S).
#define AWG_N 32                        // candidate rows a tile
#define AWG_NS 4                        // tile stages
#define AWG_STAGE (AWG_N * 1024)        // bytes a stage: 32 rows x 512 f16
#define AWG_XB (2 * 2 * 4 * 128 * 16)   // S exchange: [tile parity][warpgroup][4 float4][128 threads]
// + sums of squares (2 x 64 f64), scales (64), RoPE (sin, cos) and (cos, −sin) tables, scan counts;
// the candidate list follows (attn.rs awg_smem).
#define AWG_SMEM (AWG_NS * AWG_STAGE + AWG_XB + 2 * 64 * 8 + (64 + 4 * ATC_MAXROT + 8) * 4)

#if GW_HAVE
template <bool QN>
__device__ __forceinline__ void attn_wg_body(ATC_PARAMS, const u16* __restrict__ rows16, float qeps,
                                             const float4* __restrict__ rtab) {
    extern __shared__ __align__(128) u8 awg_sm[];
    const int tid = threadIdx.x, h = tid >> 7, lt = tid & 127, qw = lt >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const u32 sb = (u32)__cvta_generic_to_shared(awg_sm);
    float4* xb = (float4*)(awg_sm + AWG_NS * AWG_STAGE);              // [2][2][4][128]
    double* qss = (double*)(awg_sm + AWG_NS * AWG_STAGE + AWG_XB);    // [2 halves][64 heads]
    float* qsf = (float*)(qss + 2 * 64);                              // [64] each head's scale
    float2* qsc = (float2*)(qsf + 64);                                // [ATC_MAXROT] (sin, cos) at t
    int* wcnt = (int*)(qsc + ATC_MAXROT);                             // [8] scan counts
    float* rot_s = (float*)(wcnt + 8);                                // [ATC_MAXROT][2] (cos, −sin)
    int* idx = (int*)(rot_s + 2 * ATC_MAXROT);                        // [candidates]
    const int i = blockIdx.y, n = gridDim.y;
    const AtgTok tk = atg_tok(t0, i, win, ratio, sel, top_k);
    const long long t = tk.t;
    const int ha = 16 * qw + g, hb = ha + 8; // this thread's heads (rows of S, P and O)
    // Query values of k-step kk: (ha, columns c, c + 1), (hb, c), (ha, c + 8), (hb, c + 8) at
    // c = 256 h + 16 kk + 2 tq, absent heads 0; requested first (their latency overlaps the listing).
    float2 qv[16][4];
    {
        const float2 z2 = make_float2(0.0f, 0.0f);
        const float* qpa = q + ((size_t)i * heads + ha) * 512 + 256 * h + 2 * tq;
        const float* qpb = qpa + 8 * 512;
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            qv[kk][0] = ha < heads ? *(const float2*)(qpa + 16 * kk) : z2;
            qv[kk][1] = hb < heads ? *(const float2*)(qpb + 16 * kk) : z2;
            qv[kk][2] = ha < heads ? *(const float2*)(qpa + 16 * kk + 8) : z2;
            qv[kk][3] = hb < heads ? *(const float2*)(qpb + 16 * kk + 8) : z2;
        }
    }
    atg_rope(rot_s, qsc, rtab, freqs, t, i, n_rot);
    const int nvalid = atg_list(idx, wcnt, t0, tk, raw_pos, win, n);
    const int ntiles = (nvalid + AWG_N - 1) / AWG_N; // >= 1: the token's own row
    // Tile j into stage j % AWG_NS: 2048 pieces of 16 bytes, piece p = tid + 256 m at byte 16 p
    // (row 8 (m / 2) + tid % 8, column group tid / 8 + 32 (m % 2)): 8 lanes fill one core matrix.
    // Rows past the present ones are zero-filled.
    auto stage = [&](int j) {
        if (j < ntiles) {
            const u32 so = sb + (u32)(j % AWG_NS) * AWG_STAGE + 16u * (u32)tid;
#pragma unroll
            for (int kg = 0; kg < 4; kg++) {
                const int r = AWG_N * j + 8 * kg + (tid & 7);
                const bool ok = r < nvalid;
                const u16* src = rows16 + (ok ? (size_t)idx[r] * 512 + 8 * (tid >> 3) : 0);
                ds4_cp16n(so + 8192u * kg, src, ok ? 16 : 0);
                ds4_cp16n(so + 8192u * kg + 4096u, src + (ok ? 256 : 0), ok ? 16 : 0);
            }
        }
        ds4_cp_commit(); // one group a tile, empty past the last
    };
#pragma unroll
    for (int j = 0; j < AWG_NS - 1; j++) stage(j);
    // Q fragments (f16): qa[kk] = the A fragment of k-step kk.
    u32 qa[16][4];
    if constexpr (QN) {
        // Sums of squares (f64): the lane's 64 values a head, its quad, then the two halves.
        double ss[2] = {0.0, 0.0};
#pragma unroll
        for (int kk = 0; kk < 16; kk++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                ss[u & 1] += (double)qv[kk][u].x * (double)qv[kk][u].x + (double)qv[kk][u].y * (double)qv[kk][u].y;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], 1);
            ss[u] += __shfl_xor_sync(0xffffffffu, ss[u], 2);
        }
        if (tq == 0) qss[64 * h + ha] = ss[0], qss[64 * h + hb] = ss[1];
        __syncthreads();
        if (tid < 64) {
            qsf[tid] = (float)(1.0 / sqrt((qss[tid] + qss[64 + tid]) / 512.0 + (double)qeps));
        } else if (!rtab && tid < 64 + n_rot / 2) {
            qsc[tid - 64] = atc_sin_cos(atc_theta(t, freqs[tid - 64]));
        }
        __syncthreads();
        const float sc[2] = {qsf[ha], qsf[hb]};
        const int r0 = 512 - n_rot;
#pragma unroll
        for (int kk = 0; kk < 16; kk++)
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float a = qv[kk][u].x * sc[u & 1], b = qv[kk][u].y * sc[u & 1];
                const int c = 256 * h + 16 * kk + 2 * tq + 8 * (u >> 1); // even: a pair
                if (c >= r0) {
                    const float2 tt = qsc[(c - r0) >> 1];
                    atc_rot(a, b, tt.y, tt.x);
                }
                qa[kk][u] = ds4_f16x2(a, b);
            }
    } else {
        (void)qeps;
#pragma unroll
        for (int kk = 0; kk < 16; kk++)
#pragma unroll
            for (int u = 0; u < 4; u++) qa[kk][u] = ds4_f16x2(qv[kk][u].x, qv[kk][u].y);
    }
    ds4_cp_wait<AWG_NS - 2>(); // tile 0 landed (this thread's copies)
    gw_proxy_fence();
    __syncthreads();
    GwAcc<128> o0, o1; // columns 256 h + [0, 128) and + [128, 256)
    GwAcc<32> sa;
#pragma unroll
    for (int k = 0; k < 64; k++) o0.v[k] = 0.0f, o1.v[k] = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; k++) sa.v[k] = 0.0f;
    u32 pa[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}}; // P as A fragments (k-steps of 16 rows)
    float m[2] = {DS4_NEG_INF, DS4_NEG_INF}, z[2] = {0.0f, 0.0f}; // heads ha, hb (the quad agrees)
    const u64 dk = gw_desc(sb + 4096u * (u32)h, 128u, 8192u);
    const u64 dv = gw_desc(sb + 4096u * (u32)h, 8192u, 128u);
    // S of the tile at stage s16 (in 16-byte units) into acc.
    auto s_issue = [&](GwAcc<32>& acc, u32 s16) {
        gw_pin(acc);
        gw_fence();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) gw_mma(acc, qa[kk], dk + s16 + 16u * kk, kk);
        gw_commit();
    };
    // Online softmax of tile j from S (this half's partial + the partner's, the same bits in both
    // warpgroups) into P (pn) and the factors c of the two heads.
    auto softmax = [&](const GwAcc<32>& own, const float4* oth, int j, u32 (&pn)[2][4], float (&c)[2]) {
        float s[16];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float4 f = oth[128 * u];
            s[4 * u] = own.v[4 * u] + f.x;
            s[4 * u + 1] = own.v[4 * u + 1] + f.y;
            s[4 * u + 2] = own.v[4 * u + 2] + f.z;
            s[4 * u + 3] = own.v[4 * u + 3] + f.w;
        }
        // s[4 jn + e]: head ha (e < 2) or hb, row 8 jn + 2 tq + (e & 1) of the tile.
        const int rem = nvalid - AWG_N * j - 2 * tq;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int e = 0; e < 16; e++) {
            const int r = 8 * (e >> 2) + (e & 1);
            s[e] = r < rem ? s[e] * scale : DS4_NEG_INF;
            mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            c[hh] = m[hh] == mx[hh] ? 1.0f : expf(m[hh] - mx[hh]); // also −inf == −inf
            m[hh] = mx[hh];
        }
        float zs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int jn = 0; jn < 4; jn++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const float v0 = s[4 * jn + 2 * hh], v1 = s[4 * jn + 2 * hh + 1];
                const float e0 = v0 == DS4_NEG_INF ? 0.0f : expf(v0 - mx[hh]);
                const float e1 = v1 == DS4_NEG_INF ? 0.0f : expf(v1 - mx[hh]);
                const u32 ph = ds4_f16x2(e0, e1);
                zs[hh] += ds4_h2f_fast(ph & 0xffffu) + ds4_h2f_fast(ph >> 16); // the weights the product uses
                // k-step jn / 2: a0 (ha, rows 2 tq ..), a1 (hb), a2 (ha, + 8), a3 (hb, + 8).
                pn[jn >> 1][2 * (jn & 1) + hh] = ph;
            }
#pragma unroll
        for (int hh = 0; hh < 2; hh++) z[hh] = z[hh] * c[hh] + zs[hh];
    };
    // O += P · V of the tile at stage s16, after the rescale by c (only where a head's max moved:
    // most tiles after the first few keep factors of exactly 1; warp-uniform).
    auto o_issue = [&](const float (&c)[2], u32 s16) {
        if (!__all_sync(0xffffffffu, c[0] == 1.0f && c[1] == 1.0f)) {
#pragma unroll
            for (int k = 0; k < 64; k++) {
                o0.v[k] *= c[(k >> 1) & 1];
                o1.v[k] *= c[(k >> 1) & 1];
            }
        }
        gw_fence();
#pragma unroll
        for (int k2 = 0; k2 < 2; k2++) {
            gw_mma_t(o0, pa[k2], dv + s16 + 1024u * k2);
            gw_mma_t(o1, pa[k2], dv + s16 + 1024u * k2 + 128u);
        }
        gw_commit();
        gw_pin(o0);
        gw_pin(o1);
    };
    auto stage16 = [](int j) { return (u32)(j % AWG_NS) * (AWG_STAGE / 16); };
    // A do-while: ptxas serializes wgmma whose accumulators are read after a loop that may not
    // run (C7518); ntiles >= 1.
    int j = 0;
    do {
        const u32 s16 = stage16(j);
        s_issue(sa, s16);
        gw_wait<0>(); // this S, and the previous tile's O
        gw_pin(sa);
        gw_pin(o0);
        gw_pin(o1);
        gw_pin_a(&pa[0][0]);
        float4* mine = xb + ((j & 1) * 2 + h) * 512 + lt;
#pragma unroll
        for (int u = 0; u < 4; u++) mine[128 * u] = make_float4(sa.v[4 * u], sa.v[4 * u + 1], sa.v[4 * u + 2], sa.v[4 * u + 3]);
        ds4_cp_wait<AWG_NS - 3>(); // tile j + 1 landed (groups issued: up to j + AWG_NS - 2)
        gw_proxy_fence();
        __syncthreads();
        float c[2];
        softmax(sa, xb + ((j & 1) * 2 + (h ^ 1)) * 512 + lt, j, pa, c);
        o_issue(c, s16);
        // Tile j + AWG_NS - 1 into the stage of tile j - 1, whose O both warpgroups waited for
        // before the barrier above; here its index loads and address arithmetic overlap the O
        // (right after the barrier they stalled the softmax: ncu, bench/results).
        stage(j + AWG_NS - 1);
    } while (++j < ntiles);
    gw_wait<0>();
    gw_pin(o0);
    gw_pin(o1);
    gw_pin_a(&pa[0][0]);
    ds4_cp_wait<0>(); // (empty groups only)
    // Epilogue: the sink, 1 / the sum, the inverse RoPE of the last n_rot columns, f32 stores.
    float f[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        z[hh] += __shfl_xor_sync(0xffffffffu, z[hh], 1);
        z[hh] += __shfl_xor_sync(0xffffffffu, z[hh], 2);
        const int hd_ = hh ? hb : ha;
        const float sink = hd_ < heads ? sinks[hd_] : 0.0f, M = fmaxf(sink, m[hh]);
        const float wm = m[hh] == DS4_NEG_INF ? 0.0f : expf(m[hh] - M);
        f[hh] = wm / (expf(sink - M) + z[hh] * wm);
    }
    const int rot0 = 512 - n_rot;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const GwAcc<128>& o = half ? o1 : o0;
#pragma unroll
        for (int jn = 0; jn < 16; jn++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int hd_ = hh ? hb : ha, col = 256 * h + 128 * half + 8 * jn + 2 * tq;
                float a = o.v[4 * jn + 2 * hh] * f[hh], b = o.v[4 * jn + 2 * hh + 1] * f[hh];
                if (col >= rot0) {
                    const int p = (col - rot0) >> 1;
                    atc_rot(a, b, rot_s[2 * p], rot_s[2 * p + 1]);
                }
                if (hd_ < heads) *(float2*)(out + ((size_t)i * heads + hd_) * 512 + col) = make_float2(a, b);
            }
    }
}
#define AWG_BODY(QN) attn_wg_body<QN>(ATC_ARGS, rows16, qeps, rtab);
#else
#define AWG_BODY(QN) (void)q, (void)kv, (void)raw, (void)raw_pos, (void)comp, (void)sel, (void)sinks, (void)freqs, (void)out, (void)t0, (void)heads, (void)win, (void)ratio, (void)top_k, (void)n_rot, (void)scale, (void)rows16, (void)qeps, (void)rtab;
#endif

// grid (1, n), blockDim 256, dynamic shared AWG_SMEM + 4·(most candidates of a token); heads <= 64,
// head width 512, n_rot <= 2·ATC_MAXROT; rows16 as attn_tc512g_f32 (16-byte aligned). sm_90a;
// elsewhere the kernels exist and do nothing (the host takes them only where wgmma is).
DS4_KERNEL void DS4_BOUNDS(256) attn_wg512_f32(ATC_PARAMS, const u16* __restrict__ rows16, float qeps, const float4* __restrict__ rtab) { ds4_pdl_enter(); AWG_BODY(false) }
// The raw queries' form (attn_tc512gn_f32's QN): each head's RMS norm (eps qeps) and RoPE as Q loads.
DS4_KERNEL void DS4_BOUNDS(256) attn_wg512n_f32(ATC_PARAMS, const u16* __restrict__ rows16, float qeps, const float4* __restrict__ rtab) { ds4_pdl_enter(); AWG_BODY(true) }
