// Prefill weight products: tensor-core GEMM (mma) with a portable fallback.
//   Y[item, r] = W[r] · X[item]   for items (token rows, or (token, slot) pairs of one expert),
// W rows dequantised chunk by chunk (dequant.cuh) into shared memory.
//
// CTA: 128 threads, tile 64 items × GM_BN = 128 weight rows (gemm_/gemmp_/gemmf_), or 256 threads,
// 128 items × 128 rows (gemmw_, bf16 form: twice the items per dequantised weight), K step = one
// 32-element chunk. Thread t dequantises chunk c of tile row t%128 (gemmw: half of it); the X tile
// (items × 32 floats) is staged in shared memory by all threads (float4 loads; host checks 16-byte
// alignment). Register pipeline: chunk c+1's X and weights are loaded after chunk c is in shared
// memory, before its mma, so the loads overlap the tensor-core work (IQ2_XXS, bf16 form: the raw
// block fields are what is in flight, dequantised after the mma: gm_raw_iq2 / gm_deq_iq2).
// gemmc_iq2_xxs (the MoE's IQ2_XXS gate/up): X pre-split into hi/lo bf16 words by gemm_xb_f32,
// exact bf16 weights, two mma per tile (below).
//
// Tensor-core form (CUDA, DS4_ARCH >= 800): mma.sync m16n8k16 bf16 with f32 accumulation. Accuracy:
// each operand v is split into hi = bf16_rn(v) and lo = bf16_rn(v - hi) (~16 significant bits), and
// each tile takes three products Xhi·Whi + Xlo·Whi + Xhi·Wlo (the dropped Xlo·Wlo is < 2^-16 |x w|);
// BF16 weights are exact in hi, so two. Per-term error ~2^-16 (plain bf16: 2^-9). bench/results/gpu-gemm-h200.txt.
// Measured on an H200 (random weights, error |gpu-cpu|/(1+|cpu|)): 1.1e-3 (Q8_0 4096 columns), 2.7e-3 with
// Q4_K, ~10x the FMA form's f32 error. gemmp_<t> (opt-in): 3xTF32, mma.sync m16n8k8 on hi = tf32(v),
// lo = v - hi (~21 bits per operand; expected near f32; not yet run on a GPU when written).
// Warp w owns tile rows 32(w%4).. (4 n-tiles of 8) for items 64(w/4).. (4 m-tiles of 16).
//
// Portable form (gemmf_*, and gemm_*/gemmp_* where no mma): thread t keeps its dequantised chunk in registers
// and accumulates its row for 64 items (X read from shared memory as broadcasts), plain FMA.
//
// Split K: blockIdx.z = z * ks + s; slice s takes chunks [s*kc, min((s+1)*kc, cols/32)) and writes at
// Y + s*y_s (partials, summed by gemm_sum_f32), z is the batch (grouped products: group z).
// Items: grp == null: items by*BM .. (dense, sel null). grp from gm_group_*_i32 (nt = BM):
// [ngroups, starts[gmax], perm[n]]; CTA by takes the run of up to BM pairs of one expert at
// starts[by], expert max(sel, 0), weight W + expert*slab.
#include "prelude.cuh"
#include "dequant.cuh"
#include "ptx.cuh"

#define GM_MT 4 // m-tiles of 16 items per warp (a warp: 32 weight rows × 64 items)
#define GM_BN 128
#define GM_LD 20  // u32 per shared row (16 used): conflict-free fragment loads and 16-byte stores
#define GM_LDF 36 // f32 per shared row (32 used), same property for the TF32 form

#if defined(DS4_CUDA) && DS4_ARCH >= 800
#define GM_HAVE_MMA 1
#else
#define GM_HAVE_MMA 0
#endif

// bf16 round-to-nearest-even of a finite f32 (weights and activations are finite).
__device__ __forceinline__ u32 gm_bf16_rn(float v) {
    u32 u = __float_as_int(v);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Split a pair (v0 at the even k, low half) into packed bf16 hi and lo words.
__device__ __forceinline__ void gm_split2(float v0, float v1, u32& hi, u32& lo) {
#if GM_HAVE_MMA
    // sm_80+: one cvt.rn.bf16x2 per word (same round-to-nearest-even as gm_bf16_rn; the first
    // source goes to the upper half).
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v1), "f"(v0));
    float r0 = v0 - __int_as_float(hi << 16), r1 = v1 - __int_as_float(hi & 0xffff0000u); // exact
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
#else
    u32 h0 = gm_bf16_rn(v0), h1 = gm_bf16_rn(v1);
    float r0 = v0 - __int_as_float(h0 << 16), r1 = v1 - __int_as_float(h1 << 16); // exact
    hi = h0 | (h1 << 16);
    lo = gm_bf16_rn(r0) | (gm_bf16_rn(r1) << 16);
#endif
}

// 3xTF32 split: hi = v rounded to TF32 (10 explicit bits, ties away), lo = v - hi (exact; the
// tensor core reads its top 19 bits, so ~2^-21 |v| is lost).
__device__ __forceinline__ void gm_tf_split(float v, u32& hi, u32& lo) {
    u32 h = (__float_as_int(v) + 0x1000u) & 0xffffe000u;
    hi = h;
    lo = __float_as_int(v - __int_as_float(h));
}

#if GM_HAVE_MMA
__device__ __forceinline__ void gm_mma_tf(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}


#endif

template <int BM> struct alignas(16) GmSmemMma { // 16-byte vector stores
    u32 xh[BM][GM_LD], xl[BM][GM_LD];
    u32 wh[GM_BN][GM_LD], wl[GM_BN][GM_LD];
};
template <int BM> struct alignas(16) GmSmemFma {
    float x[BM][32];
};
template <int BM> struct alignas(16) GmSmemTf { // f32 values; hi/lo split at fragment load
    float x[BM][GM_LDF], w[GM_BN][GM_LDF];
};

// IQ2_XXS chunk c of a row in two steps: gm_raw_iq2 loads its raw fields (kept in registers while
// the previous chunk's mma run), gm_deq_iq2 turns them into the same f32 values as
// deq_chunk<T_IQ2_XXS> (dequant.cuh). Fewer L1 requests than deq_chunk (the bf16 form's gate/up
// were L1-bound on the H200: 85% L1 throughput, one row per lane): d (r[0]) is loaded only when
// `dnew` (first chunk of a slice or of a super-block), the chunk's 8 bytes (4 grid indices, aux) as
// two 32-bit words where 4-byte aligned, else 16 + 32 + 16 bits (r[1..3], joined in gm_deq_iq2), and
// the grid comes from a shared-memory copy `tab`; no int->float conversions (a quarter-rate pipe on
// sm_80/sm_90): grid byte b becomes float(2^23 + b) - 2^23 (exact) from one byte_perm and one add.
__device__ __forceinline__ void gm_raw_iq2(const u8* __restrict__ row, int c, bool dnew, u32* r) {
    const u8* b = row + (size_t)(c >> 3) * 66;
    if (dnew) r[0] = *(const u16*)b;
    const u8* g = b + 2 + 8 * (c & 7); // blocks are 66 bytes: 2-byte aligned
    if (((size_t)g & 3) == 0) {
        r[1] = ((const u32*)g)[0], r[2] = ((const u32*)g)[1], r[3] = 0xffffffffu; // r[3]: aligned mark
    } else {
        r[1] = *(const u16*)g, r[2] = *(const u32*)(g + 2), r[3] = *(const u16*)(g + 6);
    }
}

__device__ __forceinline__ void gm_deq_iq2(const u32* r, const u64* tab, float* w) {
#if GM_HAVE_MMA
    const bool al = r[3] == 0xffffffffu;
    const u32 idx = al ? r[1] : r[1] | (r[2] << 16), aux = al ? r[2] : (r[2] >> 16) | (r[3] << 16);
    float d = ds4_h2f((u16)r[0]);
    float db = ds4_mul_rn(ds4_mul_rn(d, 0.5f + (float)(aux >> 28)), 0.25f);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u64 grid = tab[(idx >> (8 * k)) & 0xff];
        u32 gw[2] = {(u32)grid, (u32)(grid >> 32)};
        u32 s7 = (aux >> (7 * k)) & 127;
        u32 signs = s7 | ((__popc(s7) & 1) << 7);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // bytes (b, 0, 0, 0x4b): the f32 2^23 + b
            float g = __int_as_float(__byte_perm(gw[j >> 2], 0x4b000000u, 0x7540u | (j & 3))) - 8388608.0f;
            float v = ds4_mul_rn(db, g);
            w[8 * k + j] = __int_as_float(__float_as_int(v) ^ ((signs << (31 - j)) & 0x80000000u));
        }
    }
#else
    (void)r, (void)tab;
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = 0.0f; // never used: RAW needs GM_HAVE_MMA
#endif
}

// Items of CTA row by that can be valid (an upper bound; the valid items are a prefix of the tile):
// dense, rows by*bm .. n-1; grouped, the group's run from starts[by] to the next group's start (n for
// the last group). m-tiles of 16 items wholly past it are skipped (skip != 0): an expert's ~48 pairs
// of a 2048-token prompt fill 3 of a 64-item tile's 4 m-tiles.
__device__ __forceinline__ int gm_tile_valid(const int* grp, int n, int by, int bm) {
    int v = grp ? (by + 1 < grp[0] ? grp[2 + by] : n) - grp[1 + by] : n - by * bm;
    return min(max(v, 0), bm);
}

#define GM_PARAMS                                                                                                 \
    const u8 *__restrict__ W, long long w_z, const int *__restrict__ sel, long long slab, const float *__restrict__ X, \
        long long x_tok, long long x_z, int xdiv, float *__restrict__ Y, long long y_tok, long long y_z, long long y_s, \
        int rows, int cols, long long row_bytes, int n, int ks, int kc, const int *__restrict__ grp, int gmax, int skip
#define GM_ARGS W, w_z, sel, slab, X, x_tok, x_z, xdiv, Y, y_tok, y_z, y_s, rows, cols, row_bytes, n, ks, kc, grp, gmax, skip

// F: 0 portable FMA, 1 bf16 hi/lo mma (m16n8k16), 2 3xTF32 mma (m16n8k8); 1 and 2 need GM_HAVE_MMA.
// NW warps (of 32 lanes; the mma forms are CUDA-only): 4 -> 64 items per CTA, 8 -> 128 items
// (bf16 or FMA form only). Warp w: weight rows 32(w%4).., items 64(w/4)... Thread t dequantises
// tile row t%128: all 32 elements of the chunk (NW 4, FMA), or half t/128 (NW 8, mma).
// The CTA's item tile blockIdx.y: items[i] (i < bm) = dense item y·bm + i (−1 past n), or with
// groups (grp: tile count, tile starts, then the pair permutation past gmax + 1) the pairs of
// one expert, its id in *expert. Threads tid < bm set one each; the caller synchronises.
__device__ __forceinline__ void gm_items(int* items, int* expert, int bm, int n, const int* grp, const int* sel,
                                         int gmax) {
    const int tid = threadIdx.x;
    if (tid < bm) {
        int it;
        if (!grp) {
            it = blockIdx.y * bm + tid;
            it = it < n ? it : -1;
        } else {
            const int* perm = grp + 1 + gmax;
            int st = grp[1 + blockIdx.y], e = max(sel[perm[st]], 0), q = st + tid;
            it = (q < n && max(sel[perm[q]], 0) == e) ? perm[q] : -1;
            if (tid == 0) *expert = e;
        }
        items[tid] = it;
    }
}

template <int T, int F, int NW> __device__ __forceinline__ void gemm_body(GM_PARAMS) {
    constexpr int BM = 16 * NW;
    static_assert(NW == 4 || (NW == 8 && F != 2), "128-item tiles: bf16 or FMA form");
    constexpr bool HALF = NW == 8 && F == 1; // each thread dequantises half a row chunk
    // RAW (IQ2_XXS, bf16 form): the raw weight fields are what is in flight across the mma
    // (4 registers, not 32 floats), dequantised at the top of the next iteration (gm_raw_iq2).
    constexpr bool RAW = T == T_IQ2_XXS && F == 1 && !HALF && GM_HAVE_MMA;
    __shared__ int items[BM];
    __shared__ int expert;
    __shared__ u64 gtab[RAW ? 256 : 1]; // IQ2_XXS grid (RAW)
    __shared__ union {
        GmSmemMma<BM> m;
        GmSmemFma<BM> f;
        GmSmemTf<BM> t;
    } sm;
    const int tid = threadIdx.x, trow = tid & (GM_BN - 1), part = tid >> 7;
    const int z = blockIdx.z / ks, s = blockIdx.z % ks;
    const int r0 = blockIdx.x * GM_BN;
    if (grp && (int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    if (RAW)
        for (int e = tid; e < 256; e += 32 * NW) gtab[e] = ds4_iq2xxs_grid[e];
    gm_items(items, &expert, BM, n, grp, sel, gmax);
    __syncthreads();
    long long wo = (long long)z * w_z + (grp ? (long long)expert * slab : 0);
    const int row = r0 + trow;
    const u8* wrow = W + wo + (long long)min(row, rows - 1) * row_bytes;
    const bool live = row < rows;
    // X staging: thread -> item tid/2, floats 16(tid%2) .. +16 of the chunk.
    const int xi = tid >> 1, xq = tid & 1;
    const int xit = items[xi];
    const float* xrow = xit >= 0 ? X + (long long)(xit / xdiv) * x_tok + (long long)z * x_z : X;
    const int nch = cols / 32, c0 = s * kc, c1 = min(nch, c0 + kc);
    // mma forms: m-tiles of this warp (items 64(w/4) + 16mt ..) holding any valid item.
    const int nmt = skip ? min(max((gm_tile_valid(grp, n, blockIdx.y, BM) - 64 * (tid >> 7) + 15) >> 4, 0), GM_MT) : GM_MT;

    float acc[64]; // mma: 4 per (m-tile, n-tile); FMA: one per item 64*part + j
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;

    // Register pipeline: chunk c's X and dequantised W are in registers when the loop body
    // starts; after the stores to shared memory the next chunk's loads are issued before the mma.
    float4 xv[4];
    float w[32];
    u32 wr[4] = {0u, 0u, 0u, 0u};
    auto load = [&](int c) {
#pragma unroll
        for (int i = 0; i < 4; i++) xv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (xit >= 0) {
            const float4* p = (const float4*)(xrow + 32 * c + 16 * xq);
#pragma unroll
            for (int i = 0; i < 4; i++) xv[i] = p[i];
        }
        if (live && HALF) {
            deq_slice<T>(wrow, c, 2 * part, w);
            deq_slice<T>(wrow, c, 2 * part + 1, w + 8);
        } else if (RAW) {
            if (live) gm_raw_iq2(wrow, c, c == c0 || (c & 7) == 0, wr); // dead rows: d = 0, zeros
        } else if (live) {
            deq_chunk<T>(wrow, c, w);
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) w[i] = 0.0f;
        }
    };
    if (c0 < c1) load(c0);
    for (int c = c0; c < c1; c++) {
        if (F == 1) {
            if (RAW) gm_deq_iq2(wr, gtab, w);
            uint4 h, l;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float4 xa = xv[2 * i], xb = xv[2 * i + 1];
                gm_split2(xa.x, xa.y, h.x, l.x);
                gm_split2(xa.z, xa.w, h.y, l.y);
                gm_split2(xb.x, xb.y, h.z, l.z);
                gm_split2(xb.z, xb.w, h.w, l.w);
                *(uint4*)&sm.m.xh[xi][8 * xq + 4 * i] = h;
                *(uint4*)&sm.m.xl[xi][8 * xq + 4 * i] = l;
            }
#pragma unroll
            for (int v = 0; v < (HALF ? 2 : 4); v++) {
                gm_split2(w[8 * v], w[8 * v + 1], h.x, l.x);
                gm_split2(w[8 * v + 2], w[8 * v + 3], h.y, l.y);
                gm_split2(w[8 * v + 4], w[8 * v + 5], h.z, l.z);
                gm_split2(w[8 * v + 6], w[8 * v + 7], h.w, l.w);
                const int col = (HALF ? 8 * part : 0) + 4 * v;
                *(uint4*)&sm.m.wh[trow][col] = h;
                *(uint4*)&sm.m.wl[trow][col] = l;
            }
            __syncthreads();
            if (c + 1 < c1) load(c + 1);
#if GM_HAVE_MMA
            const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                // Fragments by ldmatrix.x4 (8x8 b16 matrices; lane L gives the row address of matrix
                // L/8). A (items m0.., k 16kk..): matrices (rows +0|+8) x (k +0|+8) = a0..a3.
                // B (weight rows n.., k): matrices (n-tile nt|nt+1) x (k +0|+8) = b[nt][0..1], b[nt+1][0..1].
                // B for the whole kk step first, then A one m-tile at a time (24 fragment
                // registers live instead of 48: 3 CTAs per SM at <= 168 registers).
                u32 bh[4][2], bl[4][2];
                const int lr = lane & 7, lm = lane >> 3;
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    int r = 32 * (warp & 3) + 16 * np + 8 * (lm >> 1) + lr, k = 8 * kk + 4 * (lm & 1);
                    u32 q[4];
                    ds4_ldm4(q, &sm.m.wh[r][k]);
                    bh[2 * np][0] = q[0], bh[2 * np][1] = q[1], bh[2 * np + 1][0] = q[2], bh[2 * np + 1][1] = q[3];
                    if (T != T_BF16) {
                        ds4_ldm4(q, &sm.m.wl[r][k]);
                        bl[2 * np][0] = q[0], bl[2 * np][1] = q[1], bl[2 * np + 1][0] = q[2], bl[2 * np + 1][1] = q[3];
                    }
                }
#pragma unroll
                for (int mt = 0; mt < GM_MT; mt++) {
                    if (mt >= nmt) continue; // warp-uniform
                    u32 ah[4], al[4];
                    int m = 64 * (warp >> 2) + 16 * mt + lr + 8 * (lm & 1), k = 8 * kk + 4 * (lm >> 1);
                    ds4_ldm4(ah, &sm.m.xh[m][k]);
                    ds4_ldm4(al, &sm.m.xl[m][k]);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        float* cc = acc + 4 * (4 * mt + nt);
                        ds4_mma_bf16(cc, ah, bh[nt]);
                        ds4_mma_bf16(cc, al, bh[nt]);
                        if (T != T_BF16) ds4_mma_bf16(cc, ah, bl[nt]); // bf16 weights: lo = 0
                    }
                }
            }
#endif
            __syncthreads();
        } else if (F == 2) {
#pragma unroll
            for (int i = 0; i < 4; i++) *(float4*)&sm.t.x[xi][16 * xq + 4 * i] = xv[i];
#pragma unroll
            for (int v = 0; v < 8; v++) *(float4*)&sm.t.w[trow][4 * v] = make_float4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
            __syncthreads();
            if (c + 1 < c1) load(c + 1);
#if GM_HAVE_MMA
            const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const int k0 = 8 * kk + t; // m16n8k8 tf32: A (g|g+8, t|t+4), B (k t|t+4, n g)
                u32 ah[GM_MT][4], al[GM_MT][4], bh[4][2], bl[4][2];
#pragma unroll
                for (int mt = 0; mt < GM_MT; mt++) {
                    int m = 64 * (warp >> 2) + 16 * mt + g;
                    gm_tf_split(sm.t.x[m][k0], ah[mt][0], al[mt][0]);
                    gm_tf_split(sm.t.x[m + 8][k0], ah[mt][1], al[mt][1]);
                    gm_tf_split(sm.t.x[m][k0 + 4], ah[mt][2], al[mt][2]);
                    gm_tf_split(sm.t.x[m + 8][k0 + 4], ah[mt][3], al[mt][3]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    int r = 32 * (warp & 3) + 8 * nt + g;
                    gm_tf_split(sm.t.w[r][k0], bh[nt][0], bl[nt][0]);
                    gm_tf_split(sm.t.w[r][k0 + 4], bh[nt][1], bl[nt][1]);
                }
#pragma unroll
                for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        float* cc = acc + 4 * (4 * mt + nt);
                        gm_mma_tf(cc, ah[mt], bh[nt]);
                        gm_mma_tf(cc, al[mt], bh[nt]);
                        gm_mma_tf(cc, ah[mt], bl[nt]);
                    }
            }
#endif
            __syncthreads();
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) *(float4*)&sm.f.x[xi][16 * xq + 4 * i] = xv[i];
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 64; j++) { // acc stays in registers: full unroll
                float a = acc[j];
#pragma unroll
                for (int k = 0; k < 32; k++) a = fmaf(w[k], sm.f.x[64 * part + j][k], a);
                acc[j] = a;
            }
            __syncthreads();
            if (c + 1 < c1) load(c + 1); // w is live in the FMAs above: load after them
        }
    }

    float* yb = Y + (long long)z * y_z + (long long)s * y_s;
    if (F != 0) {
        // acc[4*(4*mt+nt) + e]: item 64(w/4) + 16mt + g + 8(e/2), tile row 32(w%4) + 8nt + 2t + e%2.
        const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                int it = items[64 * (warp >> 2) + 16 * mt + g + 8 * e2];
                if (it < 0) continue;
                float* yr = yb + (long long)it * y_tok;
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e1 = 0; e1 < 2; e1++) {
                        int r = r0 + 32 * (warp & 3) + 8 * nt + 2 * t + e1;
                        if (r < rows) yr[r] = acc[4 * (4 * mt + nt) + 2 * e2 + e1];
                    }
            }
    } else if (live) {
#pragma unroll
        for (int j = 0; j < 64; j++) {
            int it = items[64 * part + j];
            if (it >= 0) yb[(long long)it * y_tok + row] = acc[j];
        }
    }
}

// gemm_<t>: bf16 tensor cores; gemmp_<t>: 3xTF32 tensor cores (more precise, opt-in); both exist
// only where mma is compiled in (Module::mma_only): elsewhere they would be two more copies of the
// FMA tiles, and the host takes gemmf_<t> (always portable) instead.
// CUDA: gemm_<t> held to <= 168 registers (3 CTAs of 128 threads per SM; the m-tile skip raised
// sm_90a ptxas's free choice from 168 to 191, i.e. 2 CTAs per SM; 4 CTAs at <= 128 registers
// spilled and lost on the H200: bench/results/gpu-gemm-e8-h200.txt).
#if defined(DS4_CUDA)
#define GM_B3 128, 3 // DS4_BOUNDS(GM_B3) = __launch_bounds__(128, 3)
#else
#define GM_B3 128 // HIP's second launch-bounds argument means something else
#endif
DS4_KERNEL void DS4_BOUNDS(128) gemmf_f32(GM_PARAMS) { gemm_body<T_F32, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_f16(GM_PARAMS) { gemm_body<T_F16, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_bf16(GM_PARAMS) { gemm_body<T_BF16, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_q8_0(GM_PARAMS) { gemm_body<T_Q8_0, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_q2_k(GM_PARAMS) { gemm_body<T_Q2_K, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_q4_k(GM_PARAMS) { gemm_body<T_Q4_K, 0, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmf_iq2_xxs(GM_PARAMS) { gemm_body<T_IQ2_XXS, 0, 4>(GM_ARGS); }
#if GM_HAVE_MMA
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_f32(GM_PARAMS) { gemm_body<T_F32, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_f32(GM_PARAMS) { gemm_body<T_F32, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_f16(GM_PARAMS) { gemm_body<T_F16, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_f16(GM_PARAMS) { gemm_body<T_F16, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_bf16(GM_PARAMS) { gemm_body<T_BF16, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_bf16(GM_PARAMS) { gemm_body<T_BF16, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_q8_0(GM_PARAMS) { gemm_body<T_Q8_0, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_q8_0(GM_PARAMS) { gemm_body<T_Q8_0, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_q2_k(GM_PARAMS) { gemm_body<T_Q2_K, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_q2_k(GM_PARAMS) { gemm_body<T_Q2_K, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_q4_k(GM_PARAMS) { gemm_body<T_Q4_K, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_q4_k(GM_PARAMS) { gemm_body<T_Q4_K, 2, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemm_iq2_xxs(GM_PARAMS) { gemm_body<T_IQ2_XXS, 1, 4>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmp_iq2_xxs(GM_PARAMS) { gemm_body<T_IQ2_XXS, 2, 4>(GM_ARGS); }
#endif

// ---- gemmc_iq2_xxs: the MoE's IQ2_XXS gate/up with exact bf16 weights (CUDA sm_80+) ----
// IQ2_XXS w = db * (g * sign), db = d (0.5 + s) / 4 per row and 32-element chunk, g a grid byte
// (8, 25 or 43): g * sign is exact in bf16, so the weight needs no lo word and a tile takes two
// mma (Xhi·G + Xlo·G, X from gemm_xb_f32) instead of three; each warp sums a chunk's two k-steps
// per m-tile in cc (16 registers) and adds db·cc to acc. Error: weights exact (the bf16 form
// rounds them to ~16 bits), X ~16 bits, f32 sums. Same CTA shape, raw-field register pipeline
// (gm_raw_iq2) and m-tile skip as the bf16 form (gemm_body); X copied by whole 128-byte lines.
// Thread t decodes chunk c of tile row t: grid bytes to bf16 128 + g by one PRMT a pair, 128
// removed by one bf16x2 FMA, signs by a sign-replicating PRMT of the sign bits spread to byte
// msbs (one IMAD per 4) and one LOP3. H200 (bench/results/gpu-gemm-e9-h200.txt): routed experts
// q2 n = 2048 9.33 -> 8.25 ms with gemmt's down, 8.95 -> 7.98 with gemmu_q2_k's (ncu 3.07 ms vs
// 3.76 for the hi/lo form); a grid table replicated 8x (fewer bank conflicts) tied or lost.
#if GM_HAVE_MMA
__device__ __forceinline__ u32 gm_fma_bf2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// mma with a zero accumulator in (the first product of a chunk).
__device__ __forceinline__ void gm_mma0(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}

// Chunk of one row from its raw fields (gm_raw_iq2): 16 bf16x2 words g*sign (element pairs in
// order) and db.
__device__ __forceinline__ float gm_deq_iq2_exact(const u32* r, const u64* tab, u32* o) {
    const bool al = r[3] == 0xffffffffu;
    const u32 idx = al ? r[1] : r[1] | (r[2] << 16), aux = al ? r[2] : (r[2] >> 16) | (r[3] << 16);
    const float d = ds4_h2f_fast(r[0]); // exact, as ds4_h2f
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u64 grid = tab[(idx >> (8 * k)) & 0xff];
        const u32 s7 = (aux >> (7 * k)) & 127;
        // sign bit e of the 8 (bit 7: parity) to the msb of byte e%4 of v[e/4]: (4 bits) * 0x10204080
        // puts bit e at 7 + 8e and nothing else on a byte msb (partial products never overlap).
        const u32 v[2] = {(s7 & 15u) * 0x10204080u, ((s7 >> 4) | ((__popc(s7) & 1u) << 3)) * 0x10204080u};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const u32 gw = q < 2 ? (u32)grid : (u32)(grid >> 32);
            // bytes (b, 0x43): bf16 128 + b (b <= 43 < 128); minus 128 exactly
            const u32 u = ds4_prmt(gw, 0x43434343u, (q & 1) ? 0x4342u : 0x4140u);
            const u32 g = gm_fma_bf2(u, 0x3f803f80u, 0xc300c300u);
            // sign-replicated bytes e, e+1 of v into bytes 1, 3: bits 15, 31
            const u32 m = ds4_prmt(v[q >> 1], 0u, (q & 1) ? 0xb0a0u : 0x9080u);
            o[4 * k + q] = g ^ (m & 0x80008000u);
        }
    }
    return ds4_mul_rn(ds4_mul_rn(d, 0.5f + (float)(aux >> 28)), 0.25f);
}
#endif

struct alignas(16) GcSmem { // 16-byte stores, ldmatrix rows
    u32 xh[64][GM_LD], xl[64][GM_LD], wt[GM_BN][GM_LD];
    float dbs[GM_BN]; // db of each tile row for the chunk
};

__device__ __forceinline__ void gemmc_body(GM_PARAMS) {
#if GM_HAVE_MMA
    constexpr int BM = 64;
    __shared__ int items[BM];
    __shared__ int expert;
    __shared__ u64 gtab[256];
    __shared__ GcSmem sm;
    u32(&xh)[BM][GM_LD] = sm.xh;
    u32(&xl)[BM][GM_LD] = sm.xl;
    u32(&wt)[GM_BN][GM_LD] = sm.wt;
    float* dbs = sm.dbs;
    const int tid = threadIdx.x, trow = tid;
    const int z = blockIdx.z / ks, s = blockIdx.z % ks;
    const int r0 = blockIdx.x * GM_BN;
    if (grp && (int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    for (int e = tid; e < 256; e += 128) gtab[e] = ds4_iq2xxs_grid[e];
    gm_items(items, &expert, BM, n, grp, sel, gmax);
    __syncthreads();
    const long long wo = (long long)z * w_z + (grp ? (long long)expert * slab : 0);
    const int row = r0 + trow;
    const u8* wrow = W + wo + (long long)min(row, rows - 1) * row_bytes;
    const bool live = row < rows;
    const int nch = cols / 32, c0 = s * kc, c1 = min(nch, c0 + kc);
    const int warp = tid >> 5, lane = tid & 31, lr = lane & 7, lm = lane >> 3;
    const int nmt = skip ? min(max((gm_tile_valid(grp, n, blockIdx.y, BM) + 15) >> 4, 0), GM_MT) : GM_MT;

    float acc[GM_MT][4][4];
#pragma unroll
    for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.0f;
    // X: thread t copies 16-byte piece t%8 (hi words 0..15, lo 16..31) of items 16i + t/8 (each
    // warp load 4 whole 128-byte lines; xo: element offsets, -1 no item; host: below 2^31).
    float4 xv[4];
    u32 wr[4] = {0u, 0u, 0u, 0u};
    int xo[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int it = items[16 * i + (tid >> 3)];
        xo[i] = it >= 0 ? (int)((long long)(it / xdiv) * x_tok + (long long)z * x_z) : -1;
    }
    auto load = [&](int c) {
#pragma unroll
        for (int i = 0; i < 4; i++) xv[i] = xo[i] >= 0 ? ((const float4*)(X + xo[i] + 32 * c))[tid & 7] : make_float4(0.f, 0.f, 0.f, 0.f);
        if (live) gm_raw_iq2(wrow, c, c == c0 || (c & 7) == 0, wr); // dead rows: d = 0
    };
    if (c0 < c1) load(c0);
    for (int c = c0; c < c1; c++) {
        {
            u32 o[16];
            dbs[trow] = gm_deq_iq2_exact(wr, gtab, o);
#pragma unroll
            for (int v = 0; v < 4; v++) *(uint4*)&wt[trow][4 * v] = make_uint4(o[4 * v], o[4 * v + 1], o[4 * v + 2], o[4 * v + 3]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int m = 16 * i + (tid >> 3), j = tid & 7;
                float4 a = xv[i];
                *(uint4*)((j < 4 ? xh[m] : xl[m]) + 4 * (j & 3)) = make_uint4(__float_as_int(a.x), __float_as_int(a.y), __float_as_int(a.z), __float_as_int(a.w));
            }
        }
        __syncthreads();
        if (c + 1 < c1) load(c + 1);
        // B (weight rows 32 warp + 8 nt.., both k-steps), then per m-tile: 2 k-steps x (hi, lo) x
        // 4 n-tiles into cc (hi products of the 4 n-tiles first: independent mma back to back).
        u32 b[2][4][2];
#pragma unroll
        for (int kk = 0; kk < 2; kk++)
#pragma unroll
            for (int np = 0; np < 2; np++) {
                int r = 32 * warp + 16 * np + 8 * (lm >> 1) + lr, k = 8 * kk + 4 * (lm & 1);
                u32 q[4];
                ds4_ldm4(q, &wt[r][k]);
                b[kk][2 * np][0] = q[0], b[kk][2 * np][1] = q[1], b[kk][2 * np + 1][0] = q[2], b[kk][2 * np + 1][1] = q[3];
            }
        float2 db[4]; // rows 32 warp + 8 nt + 2t + (0, 1)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) db[nt] = *(const float2*)&dbs[32 * warp + 8 * nt + 2 * (lane & 3)];
#pragma unroll
        for (int mt = 0; mt < GM_MT; mt++) {
            if (mt >= nmt) continue; // uniform
            float cc[4][4];
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                u32 ah[4], al[4];
                int m = 16 * mt + lr + 8 * (lm & 1), k = 8 * kk + 4 * (lm >> 1);
                ds4_ldm4(ah, &xh[m][k]);
                ds4_ldm4(al, &xl[m][k]);
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    if (kk == 0) gm_mma0(cc[nt], ah, b[kk][nt]);
                    else ds4_mma_bf16(cc[nt], ah, b[kk][nt]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; nt++) ds4_mma_bf16(cc[nt], al, b[kk][nt]);
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                acc[mt][nt][0] = fmaf(db[nt].x, cc[nt][0], acc[mt][nt][0]);
                acc[mt][nt][1] = fmaf(db[nt].y, cc[nt][1], acc[mt][nt][1]);
                acc[mt][nt][2] = fmaf(db[nt].x, cc[nt][2], acc[mt][nt][2]);
                acc[mt][nt][3] = fmaf(db[nt].y, cc[nt][3], acc[mt][nt][3]);
            }
        }
        __syncthreads();
    }

    // acc[mt][nt][e]: item 16mt + g + 8(e/2), tile row 32 warp + 8nt + 2t + e%2.
    float* yb = Y + (long long)z * y_z + (long long)s * y_s;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            int it = items[16 * mt + g + 8 * e2];
            if (it < 0) continue;
            float* yr = yb + (long long)it * y_tok;
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    int r = r0 + 32 * warp + 8 * nt + 2 * t + e1;
                    if (r < rows) yr[r] = acc[mt][nt][2 * e2 + e1];
                }
        }
#endif
}
DS4_KERNEL void DS4_BOUNDS(GM_B3) gemmc_iq2_xxs(GM_PARAMS) { gemmc_body(GM_ARGS); }

// gemmw_<t>: 128-item tiles (256 threads), bf16 tensor cores (mma only; the host keeps 64-item
// tiles elsewhere).
#if GM_HAVE_MMA
DS4_KERNEL void DS4_BOUNDS(256) gemmw_f32(GM_PARAMS) { gemm_body<T_F32, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_f16(GM_PARAMS) { gemm_body<T_F16, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_bf16(GM_PARAMS) { gemm_body<T_BF16, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_q8_0(GM_PARAMS) { gemm_body<T_Q8_0, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_q2_k(GM_PARAMS) { gemm_body<T_Q2_K, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_q4_k(GM_PARAMS) { gemm_body<T_Q4_K, 1, 8>(GM_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmw_iq2_xxs(GM_PARAMS) { gemm_body<T_IQ2_XXS, 1, 8>(GM_ARGS); }
#endif

// ---- f16 single-product form (gemmh<BM>_<t>, default for quantised/F16 weights on sm_80+) ----
// X is first converted once per product by gemm_xh_f32: each token row t scaled by an exact power
// of two 2^s_t (max |x| * 2^s_t < 2^15, so no f16 overflow and small rows keep 11 bits) and rounded
// to f16; xinv[t] = 2^-s_t. Weights are dequantised (same f32 values as deq_chunk) and rounded to
// f16 once; one mma.sync m16n8k16 f16 (f32 accumulate) per tile instead of three, f16 X read with
// 16-byte loads (half the bytes, no split). Per-term error ~2^-11 relative (both operands rounded).
// CTA: NW warps (NW = 4, 8, 16 -> BM = 64, 128, 256 items) × GM_BN = 128 weight rows, 2·BM threads;
// db != 0 (BM 64/128): shared tiles double-buffered, one barrier per 32-element K step instead of two;
// thread t stages X of item t/2 (16 halves), dequantises 32/NP elements of tile row t%128
// (NP = 2·BM/128 parts per row chunk). Warp w: rows 32(w%4).., items 64(w/4)...
// Without mma (HIP, sm < 80) the kernels write NaN: the host never launches them there.
#define GMH_PARAMS                                                                                                \
    const u8 *__restrict__ W, long long w_z, const int *__restrict__ sel, long long slab, const u16 *__restrict__ X,  \
        const float *__restrict__ xinv, long long x_tok, long long x_z, int xdiv, float *__restrict__ Y, long long y_tok, \
        long long y_z, long long y_s, int rows, int cols, long long row_bytes, int n, int ks, int kc, const int *__restrict__ grp, int gmax, int skip, int db
#define GMH_ARGS W, w_z, sel, slab, X, xinv, x_tok, x_z, xdiv, Y, y_tok, y_z, y_s, rows, cols, row_bytes, n, ks, kc, grp, gmax, skip, db

// Pack (v0 low half, v1 high half) as f16x2, round to nearest even.
__device__ __forceinline__ u32 gm_h2(float v0, float v1) {
#if GM_HAVE_MMA
    return ds4_f16x2(v0, v1);
#else
    (void)v0, (void)v1; // never launched without mma
    return 0u;
#endif
}


template <int BM, int NB> struct alignas(16) GmSmemH { // NB buffers
    u32 x[NB][BM][GM_LD], w[NB][GM_BN][GM_LD];
};

template <int T, int NW> __device__ __forceinline__ void gemmh_body(GMH_PARAMS) {
    constexpr int BM = 16 * NW, NT = 32 * NW, NP = NT / GM_BN, WE = 32 / NP; // WE: weight elements per thread
    static_assert(NP == 1 || NP == 2 || NP == 4, "NW: 4, 8 or 16");
    __shared__ int items[BM];
    __shared__ int expert;
    constexpr int NB = NW == 16 ? 1 : 2; // 256 items: one buffer (static shared memory < 48 KB)
    __shared__ GmSmemH<BM, NB> sm;       // f16x2: 16 used per row (32 k)
    const int tid = threadIdx.x, trow = tid & (GM_BN - 1), part = tid / GM_BN;
    const int z = blockIdx.z / ks, s = blockIdx.z % ks;
    const int r0 = blockIdx.x * GM_BN;
    if (grp && (int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    gm_items(items, &expert, BM, n, grp, sel, gmax);
    __syncthreads();
    const long long wo = (long long)z * w_z + (grp ? (long long)expert * slab : 0);
    const int row = r0 + trow;
    const u8* wrow = W + wo + (long long)min(row, rows - 1) * row_bytes;
    const bool live = row < rows;
    const int xi = tid >> 1, xq = tid & 1; // X staging: item xi, halves 16xq.. of the chunk
    const int xit = items[xi];
    const u16* xrow = xit >= 0 ? X + (long long)(xit / xdiv) * x_tok + (long long)z * x_z : X;
    const int nch = cols / 32, c0 = s * kc, c1 = min(nch, c0 + kc);

    float acc[64]; // 4 per (m-tile, n-tile)
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;

    uint4 xv[2];
    u32 wp[WE / 2]; // dequantised weights, f16x2
    auto load = [&](int c) {
        xv[0] = xv[1] = make_uint4(0u, 0u, 0u, 0u);
        if (xit >= 0) {
            const uint4* p = (const uint4*)(xrow + 32 * c + 16 * xq);
            xv[0] = p[0], xv[1] = p[1];
        }
        float w[32]; // WE used (deq_chunk's 32 only when NP == 1)
        if (!live) {
#pragma unroll
            for (int i = 0; i < WE; i++) w[i] = 0.0f;
        } else if (NP == 1) {
            deq_chunk<T>(wrow, c, w);
        } else {
#pragma unroll
            for (int q = 0; q < WE / 8; q++) deq_slice<T>(wrow, c, (WE / 8) * part + q, w + 8 * q);
        }
#pragma unroll
        for (int i = 0; i < WE / 2; i++) wp[i] = gm_h2(w[2 * i], w[2 * i + 1]);
    };
    if (c0 < c1) load(c0);
    const bool dbuf = NB == 2 && db; // double buffer: one barrier per chunk (see the end of the loop)
    for (int c = c0; c < c1; c++) {
        const int bi = dbuf ? (c - c0) & 1 : 0;
        auto& sx = sm.x[bi];
        auto& sw = sm.w[bi];
        *(uint4*)&sx[xi][8 * xq] = xv[0];
        *(uint4*)&sx[xi][8 * xq + 4] = xv[1];
#pragma unroll
        for (int v = 0; v < WE / 8; v++)
            *(uint4*)&sw[trow][(WE / 2) * part + 4 * v] = make_uint4(wp[4 * v], wp[4 * v + 1], wp[4 * v + 2], wp[4 * v + 3]);
        __syncthreads();
        if (c + 1 < c1) load(c + 1);
#if GM_HAVE_MMA
        const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            // ldmatrix.x4 fragments as in gemm_body (A: rows +0|+8 x k +0|+8; B: n-tiles x k halves).
            u32 a[GM_MT][4], b[4][2];
            const int lr = lane & 7, lm = lane >> 3;
#pragma unroll
            for (int mt = 0; mt < GM_MT; mt++) {
                int m = 64 * (warp >> 2) + 16 * mt + lr + 8 * (lm & 1), k = 8 * kk + 4 * (lm >> 1);
                ds4_ldm4(a[mt], &sx[m][k]);
            }
#pragma unroll
            for (int np = 0; np < 2; np++) {
                int r = 32 * (warp & 3) + 16 * np + 8 * (lm >> 1) + lr, k = 8 * kk + 4 * (lm & 1);
                u32 q[4];
                ds4_ldm4(q, &sw[r][k]);
                b[2 * np][0] = q[0], b[2 * np][1] = q[1], b[2 * np + 1][0] = q[2], b[2 * np + 1][1] = q[3];
            }
#pragma unroll
            for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) ds4_mma_f16(acc + 4 * (4 * mt + nt), a[mt], b[nt]);
        }
#endif
        // Double buffer: the next store goes to the other buffer, and the one after it (to this
        // buffer) follows the next barrier, which every thread reaches after this mma.
        if (!dbuf) __syncthreads();
    }

    float* yb = Y + (long long)z * y_z + (long long)s * y_s;
    // acc[4*(4*mt+nt) + e]: item 64(w/4) + 16mt + g + 8(e/2), tile row 32(w%4) + 8nt + 2t + e%2.
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < GM_MT; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            int it = items[64 * (warp >> 2) + 16 * mt + g + 8 * e2];
            if (it < 0) continue;
            float* yr = yb + (long long)it * y_tok;
            const float sc = GM_HAVE_MMA ? xinv[it / xdiv] : __int_as_float(0x7fc00000); // NaN: no mma here
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    int r = r0 + 32 * (warp & 3) + 8 * nt + 2 * t + e1;
                    if (r < rows) yr[r] = acc[4 * (4 * mt + nt) + 2 * e2 + e1] * sc;
                }
        }
}

// gemmh<BM>_<t>: BM = 64, 128, 256 items (128, 256, 512 threads).
DS4_KERNEL void DS4_BOUNDS(128) gemmh64_f16(GMH_PARAMS) { gemmh_body<T_F16, 4>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmh128_f16(GMH_PARAMS) { gemmh_body<T_F16, 8>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(512) gemmh256_f16(GMH_PARAMS) { gemmh_body<T_F16, 16>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmh64_q8_0(GMH_PARAMS) { gemmh_body<T_Q8_0, 4>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmh128_q8_0(GMH_PARAMS) { gemmh_body<T_Q8_0, 8>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(512) gemmh256_q8_0(GMH_PARAMS) { gemmh_body<T_Q8_0, 16>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmh64_q2_k(GMH_PARAMS) { gemmh_body<T_Q2_K, 4>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmh128_q2_k(GMH_PARAMS) { gemmh_body<T_Q2_K, 8>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(512) gemmh256_q2_k(GMH_PARAMS) { gemmh_body<T_Q2_K, 16>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmh64_q4_k(GMH_PARAMS) { gemmh_body<T_Q4_K, 4>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmh128_q4_k(GMH_PARAMS) { gemmh_body<T_Q4_K, 8>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(512) gemmh256_q4_k(GMH_PARAMS) { gemmh_body<T_Q4_K, 16>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmh64_iq2_xxs(GMH_PARAMS) { gemmh_body<T_IQ2_XXS, 4>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(256) gemmh128_iq2_xxs(GMH_PARAMS) { gemmh_body<T_IQ2_XXS, 8>(GMH_ARGS); }
DS4_KERNEL void DS4_BOUNDS(512) gemmh256_iq2_xxs(GMH_PARAMS) { gemmh_body<T_IQ2_XXS, 16>(GMH_ARGS); }

// X rows to scaled f16 for gemmh: one CTA per token row t < gridDim.x; elements j < width
// (multiple of 4; X 16-byte aligned, x_tok multiple of 4): xh[t*x_tok + j] = f16_rn(x * 2^s_t),
// xinv[t] = 2^-s_t, s_t = 15 - e_t where max |x| < 2^e_t (clamped to [-126, 126]).
// Without mma (never launched there) the row is zeroed.
DS4_KERNEL void DS4_BOUNDS(256) gemm_xh_f32(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xh, float* __restrict__ xinv) {
    __shared__ float red[256 / DS4_WARP];
    const float4* p = (const float4*)(X + (long long)blockIdx.x * x_tok);
    float m = 0.0f;
    for (int i = threadIdx.x; i < width / 4; i += 256) {
        float4 v = p[i];
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
    if (threadIdx.x % DS4_WARP == 0) red[threadIdx.x / DS4_WARP] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < 256 / DS4_WARP; i++) m = fmaxf(m, red[i]);
    // m = f * 2^e, f in [0.5, 1) for normal m: e = biased exponent - 126 (subnormal/zero: -126).
    int e = (int)((__float_as_int(m) >> 23) & 0xff) - 126;
    int sh = min(max(15 - e, -126), 126);
    float sc = __int_as_float((sh + 127) << 23);
    if (threadIdx.x == 0) xinv[blockIdx.x] = __int_as_float((127 - sh) << 23);
    u32* o = xh + ((long long)blockIdx.x * x_tok >> 1);
    for (int i = threadIdx.x; i < width / 4; i += 256) {
        float4 v = p[i];
        o[2 * i] = gm_h2(v.x * sc, v.y * sc);
        o[2 * i + 1] = gm_h2(v.z * sc, v.w * sc);
    }
}

// X rows split once for gemmc_iq2_xxs: one CTA per token row t < gridDim.x; elements j < width
// (multiple of 32; X 16-byte aligned, x_tok multiple of 32). Chunk c (32 elements) of row t becomes
// words xb[t*x_tok + 32c + i] = bf16x2 hi of elements (2i, 2i+1), xb[.. + 16 + i] = their lo
// (gm_split2: the words gemm_body's bf16 form would store).
DS4_KERNEL void DS4_BOUNDS(256) gemm_xb_f32(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xb) {
    const float4* p = (const float4*)(X + (long long)blockIdx.x * x_tok);
    u32* o = xb + (long long)blockIdx.x * x_tok;
    for (int h = threadIdx.x; h < width / 16; h += 256) { // 16 elements: half h&1 of chunk h/2
        uint4 hi[2], lo[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float4 a = p[4 * h + 2 * i], b = p[4 * h + 2 * i + 1];
            gm_split2(a.x, a.y, hi[i].x, lo[i].x);
            gm_split2(a.z, a.w, hi[i].y, lo[i].y);
            gm_split2(b.x, b.y, hi[i].z, lo[i].z);
            gm_split2(b.z, b.w, hi[i].w, lo[i].w);
        }
        uint4* q = (uint4*)(o + 32 * (h >> 1) + 8 * (h & 1));
        q[0] = hi[0], q[1] = hi[1], q[4] = lo[0], q[5] = lo[1];
    }
}

// Split-K partials: y[i] = sum over s < ks (in order) of part[s*total + i].
DS4_KERNEL void DS4_BOUNDS(256) gemm_sum_f32(const float* __restrict__ part, float* __restrict__ y, int ks, long long total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float a = 0.0f;
    for (int s = 0; s < ks; s++) a += part[(long long)s * total + i];
    y[i] = a;
}

// ---- MoE pair grouping, O(pairs), deterministic (same order as a stable sort by expert) ----
// Output grp = [ngroups, starts[gmax], perm[pairs]]: perm lists the pairs by expert, ascending pair
// index within an expert; each expert's run is cut every nt pairs, starts[g] = first position of
// group g. Expert of pair p: clamp(sel[p], 0, ne-1). Then the wide runs (cut every 2 nt pairs,
// the same perm; gemm_wg.cu's wide gate/up): [ngroups2, starts2[gmax2]] at grp + 1 + gmax + pairs.
// With wgt (else null), a pair of route weight exactly 0 adds nothing (Backend::moe_experts: an
// expert-parallel rank's slots of experts it does not hold) and is dropped: such pairs come first
// in perm, in no run, so the runs end where they did (the last one at `pairs`). Buckets: 0 the
// dropped pairs, 1 + e expert e (ne + 1 of them).
// Three launches over blocks of 256 pairs:
//   gm_group_count_i32  (nb CTAs): cnt[b*nk + k] = pairs of block b in bucket k (nk = ne + 1)
//   gm_group_scan_i32   (1 CTA):   cnt[b*nk + k] -> first perm position of those pairs; starts
//   gm_group_scatter_i32 (nb CTAs): perm[cnt[b*nk + k] + rank of the pair within its block's k]
#define GM_MAXE 1024 // most experts (host checks); GM_MAXE + 1 buckets

__device__ __forceinline__ int gm_bucket(const int* __restrict__ sel, const float* __restrict__ wgt, int p, int ne) {
    if (wgt && wgt[p] == 0.0f) return 0;
    return 1 + min(max(sel[p], 0), ne - 1);
}

DS4_KERNEL void DS4_BOUNDS(256) gm_group_count_i32(const int* __restrict__ sel, const float* __restrict__ wgt, int pairs, int ne,
                                                   int* __restrict__ cnt) {
    __shared__ int h[GM_MAXE + 1];
    const int nk = ne + 1;
    for (int e = threadIdx.x; e < nk; e += blockDim.x) h[e] = 0;
    __syncthreads();
    int p = blockIdx.x * 256 + threadIdx.x;
    if (p < pairs) atomicAdd(&h[gm_bucket(sel, wgt, p, ne)], 1); // counts only: order-free
    __syncthreads();
    for (int e = threadIdx.x; e < nk; e += blockDim.x) cnt[(long long)blockIdx.x * nk + e] = h[e];
}

// Inclusive sum over the CTA's 256 threads (8 warps of 32, or 4 wavefronts of 64) of v; tmp: 8
// ints. Every thread of the CTA must call it.
__device__ __forceinline__ int gm_cta_scan(int v, int* tmp) {
    const int lane = threadIdx.x % DS4_WARP, w = threadIdx.x / DS4_WARP;
#pragma unroll
    for (int o = 1; o < DS4_WARP; o <<= 1) {
        int u = ds4_shfl_up(v, o);
        if (lane >= o) v += u;
    }
    if (lane == DS4_WARP - 1) tmp[w] = v;
    __syncthreads();
    for (int q = 0; q < w; q++) v += tmp[q];
    __syncthreads(); // tmp is free again
    return v;
}

// Counts per (block, bucket) -> first perm positions, and the run starts. Thread t owns the
// buckets of one contiguous range (per = ceil(nk / 256) of them): their totals over the blocks
// (the loads GM_SB at a time, all in flight before the adds: the old one-bucket-a-thread loop
// waited on each block's count in turn: 45 us a 2k layer on the H200, now 9), a CTA scan of the range
// sums, then each bucket's block offsets written in a second pass. Integer sums: the same
// output whatever the order.
#define GM_SB 16
DS4_KERNEL void DS4_BOUNDS(256) gm_group_scan_i32(int* __restrict__ cnt, int nb, int ne, int nt, int gmax, int* __restrict__ grp,
                                                  int pairs, int gmax2) {
    __shared__ int tot[GM_MAXE + 1], tmp[8];
    const int nt2 = 2 * nt, nk = ne + 1, t = threadIdx.x;
    int* grp2 = grp + 1 + gmax + pairs; // the wide runs' [ngroups2, starts2[gmax2]]
    // 1. Bucket totals over the blocks (coalesced: threads read consecutive buckets of a block).
    for (int e = t; e < nk; e += 256) {
        int s = 0;
        for (int b0 = 0; b0 < nb; b0 += GM_SB) {
            int c[GM_SB];
#pragma unroll
            for (int u = 0; u < GM_SB; u++) c[u] = b0 + u < nb ? cnt[(long long)(b0 + u) * nk + e] : 0;
#pragma unroll
            for (int u = 0; u < GM_SB; u++) s += c[u];
        }
        tot[e] = s;
    }
    __syncthreads();
    // 2. Exclusive scans over the buckets in order: pair positions (all buckets) and run indices
    // (buckets >= 1; bucket 0, the dropped pairs, has no runs), by ranges of per buckets.
    const int per = (nk + 255) / 256, e0 = min(t * per, nk), e1 = min(e0 + per, nk);
    int s = 0, g = 0, g2 = 0;
    for (int e = e0; e < e1; e++) {
        s += tot[e];
        if (e > 0) g += (tot[e] + nt - 1) / nt, g2 += (tot[e] + nt2 - 1) / nt2;
    }
    const int si = gm_cta_scan(s, tmp), gi = gm_cta_scan(g, tmp), g2i = gm_cta_scan(g2, tmp);
    if (t == 255) grp[0] = gi, grp2[0] = g2i;
    int sb = si - s, gbe = gi - g, gb2e = g2i - g2; // this range's first position / runs
    for (int e = e0; e < e1; e++) {
        const int te = tot[e];
        tot[e] = sb; // now the bucket's first perm position (read by pass 3 only through sb)
        if (e > 0) {
            const int ng = (te + nt - 1) / nt, ng2 = (te + nt2 - 1) / nt2;
            for (int j = 0; j < ng && gbe + j < gmax; j++) grp[1 + gbe + j] = sb + j * nt;
            for (int j = 0; j < ng2 && gb2e + j < gmax2; j++) grp2[1 + gb2e + j] = sb + j * nt2;
            gbe += ng, gb2e += ng2;
        }
        sb += te;
    }
    __syncthreads();
    // 3. Each (block, bucket) count -> the perm position of its first pair.
    for (int e = t; e < nk; e += 256) {
        int run = tot[e];
        for (int b0 = 0; b0 < nb; b0 += GM_SB) {
            int c[GM_SB];
#pragma unroll
            for (int u = 0; u < GM_SB; u++) c[u] = b0 + u < nb ? cnt[(long long)(b0 + u) * nk + e] : 0;
#pragma unroll
            for (int u = 0; u < GM_SB; u++)
                if (b0 + u < nb) {
                    cnt[(long long)(b0 + u) * nk + e] = run;
                    run += c[u];
                }
        }
    }
}

DS4_KERNEL void DS4_BOUNDS(256) gm_group_scatter_i32(const int* __restrict__ sel, const float* __restrict__ wgt, int pairs, int ne,
                                                     const int* __restrict__ off, int gmax, int* __restrict__ grp) {
    __shared__ int se[256];
    int t = threadIdx.x, p = blockIdx.x * 256 + t;
    int e = p < pairs ? gm_bucket(sel, wgt, p, ne) : -1;
    se[t] = e;
    __syncthreads();
    if (p >= pairs) return;
    int r = 0; // earlier pairs of this block in the same bucket (broadcast reads)
    for (int j = 0; j < 256; j++) r += (j < t) & (se[j] == e);
    grp[1 + gmax + off[(long long)blockIdx.x * (ne + 1) + e] + r] = p;
}

// ---- Integer quants as f16 (tiled form) ----
// f16x2 of the two signed bytes in the low 16 bits of v (exact: 1024 + (q+128) - 1152).
__device__ __forceinline__ u32 gq_i8x2(u32 v) {
#if GM_HAVE_MMA
    return ds4_hsub2(__byte_perm(v ^ 0x8080u, 0x64646464u, 0x4140), 0x64806480u);
#else
    (void)v;
    return 0u;
#endif
}

// f16x2 of two integers in [0, 1024) given as (a | b << 16) (exact: (1024 + a) - 1024).
__device__ __forceinline__ u32 gq_u10x2(u32 ab) {
#if GM_HAVE_MMA
    return ds4_hsub2(ab | 0x64006400u, 0x64006400u);
#else
    (void)ab;
    return 0u;
#endif
}

// ---- Tiled integer-weight form (gemmt_<t>, CUDA sm_80+; default for Q4_K, opt-in for Q8_0/IQ2_XXS;
// Q2_K takes gemmu_q2_k below, same arithmetic) ----
// Weights as exact integers in f16, activations as two f16 planes hi/lo (~22 significant bits),
// two m16n8k16 f16 mma per tile, f32 accumulation; the scales are applied per scale group:
// the super-block (256 elements) for the K-quants and IQ2_XXS, the chunk for Q8_0:
//   IQ2_XXS  w = (d/8) * [(1 + 2s) * grid * sign]   (integer <= 31 * 43 = 1333, exact in f16)
//   Q2_K     w = d * [sl * q] - dmin * m            (sl * q <= 45; m per 16 elements)
//   Q4_K     w = d * [s * q] - dmin * m             (s * q <= 945; m per 32 elements)
//   Q8_0     w = d * [q]                            (per 32 elements)
// The min terms are one more (pair of) mma per super-block: A' = the 16 sums of 16 activations
// (hi/lo f16, scaled by 1/16), B' = the integer mins. Per scale group: acc += D * cc - Dm * cm.
// Staging: X converted once per product by gemm_xt_f32 (per token row: scaled by 2^s like gemm_xh_f32,
// each 4 elements as one 16-byte group {hi01, hi23, lo01, lo23}, 16-element sums per super-block),
// copied by cp.async 16-byte (NXS chunk slots, X of the next chunks in flight); raw weight blocks of
// the tile (64 rows x one stage: a super-block, or 4 Q8_0 chunks) by cp.async 4-byte into a 2-stage
// ring, a stage ahead. Each warp decodes its B fragments straight from the raw blocks (no dequantised
// tile, no ldmatrix): K is permuted inside each 16-wide mma step so that lane t of a fragment row holds
// elements 8t..8t+7 of the 32-element chunk (one IQ2_XXS grid entry, two Q2_K/Q4_K words), and the X
// groups are stored in the same order. One barrier per 32-element chunk.
// CTA: 128 threads, 64 items x GT_BN = 64 weight rows; warp w: items 32(w/2).., rows 32(w%2)...
// Error: weights exact; activations ~2^-22 relative; products exact, f32 sums (H200 ops_gemm worst
// 2.3e-4 relative to 1 + |cpu|, vs 2e-3 allowed for the bf16 hi/lo form).
// H200 (bench/results/gpu-gemm-p-h200.txt, 4096->16384, n = 2048): Q2_K 76 vs 68 TFLOP/s for the
// bf16 hi/lo form, Q4_K 74 vs 55, IQ2_XXS 65 vs 78 (slower: opt-in), routed experts q2 51.5 vs 57.4.
#define GT_BM 64
#define GT_BN 64

#if GM_HAVE_MMA
// Zero an accumulator set of the tiled forms.
template <int MT, int NT> __device__ __forceinline__ void gt_zero(float (&a)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) a[mt][nt][e] = 0.0f;
}

// End of a super-block in the tiled forms with mins: acc += d·cc − dmin·cm (per row: e & 1),
// cc cleared for the next one.
template <int MT, int NT>
__device__ __forceinline__ void gt_apply(float (&acc)[MT][NT][4], float (&cc)[MT][NT][4], const float (&cm)[MT][NT][4],
                                         const float (&D)[NT][2], const float (&Dm)[NT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float a = fmaf(D[nt][e & 1], cc[mt][nt][e], acc[mt][nt][e]);
                acc[mt][nt][e] = fmaf(-Dm[nt][e & 1], cm[mt][nt][e], a);
                cc[mt][nt][e] = 0.0f;
            }
}

// Tiled forms' epilogue: acc[mt][nt][e] is item items[32 wm + 16 mt + g + 8 (e/2)], row
// r0 + RW wn + 8 nt + 2 t + e%2; y[item][row] = acc times the item's inverse x scale.
template <int MT, int NT, int RW>
__device__ __forceinline__ void gt_store(const float (&acc)[MT][NT][4], const int* items, float* yb, long long y_tok,
                                         const float* xinv, int xdiv, int r0, int rows, int wm, int wn, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            int it = items[32 * wm + 16 * mt + g + 8 * e2];
            if (it < 0) continue;
            float* yr = yb + (long long)it * y_tok;
            const float sc = xinv[it / xdiv];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    int r = r0 + RW * wn + 8 * nt + 2 * t + e1;
                    if (r < rows) yr[r] = acc[mt][nt][2 * e2 + e1] * sc;
                }
        }
}

#endif

// Per type: SB raw bytes per row and stage, SC chunks per stage, GC chunks per scale group,
// NXS X chunk slots, MIN: K-quant min terms.
template <int T> struct Gt;
template <> struct Gt<T_IQ2_XXS> {
    static constexpr int SB = 66, SC = 8, GC = 8, NXS = 3;
    static constexpr bool MIN = false;
};
template <> struct Gt<T_Q4_K> {
    static constexpr int SB = 144, SC = 8, GC = 8, NXS = 2;
    static constexpr bool MIN = true;
};
template <> struct Gt<T_Q8_0> {
    static constexpr int SB = 4 * 34, SC = 4, GC = 1, NXS = 3;
    static constexpr bool MIN = false;
};

template <int T> struct alignas(16) GtSmem {
    static constexpr int NWM = (Gt<T>::SB + 6) / 4, RW = NWM | 1; // words per row copy (odd stride)
    uint4 x[Gt<T>::NXS][GT_BM][8];                                  // X chunk slots, groups swizzled
    u32 s[Gt<T>::MIN ? 2 : 1][Gt<T>::MIN ? GT_BM : 1][16];          // sums: hi 8 words, lo 8 words
    uint4 grid[T == T_IQ2_XXS ? 256 : 1];                           // IQ2_XXS grid as f16x2
    uint4 sign[T == T_IQ2_XXS ? 128 : 1];                           // IQ2_XXS sign masks per 7-bit field
    u32 raw[2][GT_BN][RW];                                          // raw blocks of a stage, per row
    int rlo[GT_BN];                                                 // row base address & 3
};

// Integer weights of elements 8t..8t+7 of chunk p of the stage at blk, as four f16x2 words.
template <int T> __device__ __forceinline__ void gt_deq(const u8* blk, int p, int t, u32* w, const GtSmem<T>& sm);

#if GM_HAVE_MMA
template <> __device__ __forceinline__ void gt_deq<T_IQ2_XXS>(const u8* blk, int p, int t, u32* w, const GtSmem<T_IQ2_XXS>& sm) {
    const u16* g2 = (const u16*)(blk + 2 + 8 * p);
    u32 idx = (g2[t >> 1] >> (8 * (t & 1))) & 0xff;
    u32 aux = (u32)g2[2] | ((u32)g2[3] << 16);
    u32 m = 1 + 2 * (aux >> 28);
    u32 m2 = gq_u10x2(m | (m << 16));
    uint4 gv = sm.grid[idx], sg = sm.sign[(aux >> (7 * t)) & 127];
    w[0] = ds4_hmul2(gv.x, m2) ^ sg.x;
    w[1] = ds4_hmul2(gv.y, m2) ^ sg.y;
    w[2] = ds4_hmul2(gv.z, m2) ^ sg.z;
    w[3] = ds4_hmul2(gv.w, m2) ^ sg.w;
}

// Q4_K 6-bit scale and min of sub-block p (scale bytes at sc).
__device__ __forceinline__ void gt_q4k_sm(const u8* sc, int p, u32& s, u32& m) {
    if (p < 4) {
        s = sc[p] & 63;
        m = sc[p + 4] & 63;
    } else {
        s = (sc[p + 4] & 15) | ((sc[p - 4] >> 6) << 4);
        m = (sc[p + 4] >> 4) | ((sc[p] >> 6) << 4);
    }
}

template <> __device__ __forceinline__ void gt_deq<T_Q4_K>(const u8* blk, int p, int t, u32* w, const GtSmem<T_Q4_K>&) {
    u32 s, m;
    gt_q4k_sm(blk + 4, p, s, m);
    const u32* qs = (const u32*)(blk + 16 + 32 * (p >> 1) + 8 * t);
    int shift = 4 * (p & 1);
#pragma unroll
    for (int l4 = 0; l4 < 2; l4++) {
        u32 v = (qs[l4] >> shift) & 0x0f0f0f0fu;
        w[2 * l4] = gq_u10x2(__byte_perm(v, 0u, 0x7170) * s); // s*q <= 945 < 1024
        w[2 * l4 + 1] = gq_u10x2(__byte_perm(v, 0u, 0x7372) * s);
    }
}

template <> __device__ __forceinline__ void gt_deq<T_Q8_0>(const u8* blk, int p, int t, u32* w, const GtSmem<T_Q8_0>&) {
    const u16* b = (const u16*)(blk + 34 * p);
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = gq_i8x2(b[1 + 4 * t + i]);
}

// Scale-group factors of one row: D (main term) and Dm (min term, times 16: the sums are /16).
template <int T> __device__ __forceinline__ void gt_scale(const u8* blk, int p, float& D, float& Dm) {
    if (T == T_IQ2_XXS) {
        D = ds4_h2f(*(const u16*)blk) * 0.125f, Dm = 0.0f;
    } else if (T == T_Q8_0) {
        D = ds4_h2f(*(const u16*)(blk + 34 * p)), Dm = 0.0f;
    } else {
        const u16* dd = (const u16*)(blk + (T == T_Q2_K ? 80 : 0));
        D = ds4_h2f(dd[0]), Dm = ds4_h2f(dd[1]) * 16.0f;
    }
}

// Min-term B' fragment of one row (k' = 2t, 2t+1 | 2t+8, 2t+9: the super-block's 16-element sub-blocks).
template <int T> __device__ __forceinline__ void gt_minb(const u8* blk, int t, u32* b) {
    if (T == T_Q2_K) {
        u32 v0 = *(const u16*)(blk + 2 * t), v1 = *(const u16*)(blk + 2 * t + 8);
        b[0] = gq_u10x2(((v0 >> 4) & 15) | ((v0 >> 12) << 16));
        b[1] = gq_u10x2(((v1 >> 4) & 15) | ((v1 >> 12) << 16));
    } else { // Q4_K: sub-blocks 2t, 2t+1 are chunk t (min m_t), 2t+8, 2t+9 chunk t+4
        u32 s, m0, m1;
        gt_q4k_sm(blk + 4, t, s, m0);
        gt_q4k_sm(blk + 4, t + 4, s, m1);
        b[0] = gq_u10x2(m0 | (m0 << 16));
        b[1] = gq_u10x2(m1 | (m1 << 16));
    }
}
#endif

#define GMT_PARAMS                                                                                                  \
    const u8 *__restrict__ W, long long w_z, const int *__restrict__ sel, long long slab, const u32 *__restrict__ XT, \
        const u32 *__restrict__ XS, const float *__restrict__ xinv, long long x_tok, long long x_z, int xdiv,          \
        float *__restrict__ Y, long long y_tok, long long y_z, long long y_s, int rows, int cols, long long row_bytes, \
        int n, int ks, int kc, const int *__restrict__ grp, int gmax, int skip
#define GMT_ARGS W, w_z, sel, slab, XT, XS, xinv, x_tok, x_z, xdiv, Y, y_tok, y_z, y_s, rows, cols, row_bytes, n, ks, kc, grp, gmax, skip

// Host contract: cols % 256 == 0, kc % 8 == 0, x_tok and x_z multiples of 16 (XT words = elements,
// XS: x_tok/16 words per token row), K-quant rows 4-byte aligned.
template <int T> __device__ __forceinline__ void gemmt_body(GMT_PARAMS) {
#if GM_HAVE_MMA
    using C = Gt<T>;
    constexpr int NXS = C::NXS, SC = C::SC, NWM = GtSmem<T>::NWM;
    __shared__ int items[GT_BM];
    __shared__ int expert;
    __shared__ GtSmem<T> sm;
    const int tid = threadIdx.x;
    const int z = blockIdx.z / ks, s = blockIdx.z % ks;
    const int r0 = blockIdx.x * GT_BN;
    if (grp && (int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    gm_items(items, &expert, GT_BM, n, grp, sel, gmax);
    if (T == T_IQ2_XXS) {
        for (int e = tid; e < 256; e += 128) {
            u64 gv = ds4_iq2xxs_grid[e];
            u32 lo = (u32)gv, hi = (u32)(gv >> 32);
            sm.grid[e] = make_uint4(gq_u10x2(__byte_perm(lo, 0u, 0x7170)), gq_u10x2(__byte_perm(lo, 0u, 0x7372)),
                                    gq_u10x2(__byte_perm(hi, 0u, 0x7170)), gq_u10x2(__byte_perm(hi, 0u, 0x7372)));
        }
        if (tid < 128) {
            u32 sg = tid | ((__popc(tid) & 1) << 7), m[4];
#pragma unroll
            for (int k = 0; k < 4; k++) m[k] = (((sg >> (2 * k)) & 1u) << 15) | (((sg >> (2 * k + 1)) & 1u) << 31);
            sm.sign[tid] = make_uint4(m[0], m[1], m[2], m[3]);
        }
    }
    __syncthreads();
    const long long wo = (long long)z * w_z + (grp ? (long long)expert * slab : 0);
    const u8* wbase = W + wo;
    if (tid < GT_BN) sm.rlo[tid] = (int)((size_t)(wbase + (long long)min(r0 + tid, rows - 1) * row_bytes) & 3);
    // X staging: item xi, groups 4(tid&1)..+4 of each chunk; sums: words 8(tid&1)..+8 of each super-block.
    const int xi = tid >> 1, xh = tid & 1;
    const int xit = items[xi];
    const long long xtok = xit >= 0 ? (long long)(xit / xdiv) : 0;
    const u32* xsrc = XT + xtok * x_tok + (long long)z * x_z;
    const u32* ssrc = C::MIN ? XS + xtok * (x_tok / 16) + (long long)z * (x_z / 16) : XS;
    const int nch = cols / 32, c0 = s * kc, c1 = min(nch, c0 + kc), nl = max(c1 - c0, 0);
    auto stage_off = [&](int cs) -> long long { return T == T_Q8_0 ? (long long)cs * 34 : (long long)(cs / 8) * C::SB; };
    auto issue_x = [&](int i) {
        if (i < nl) {
            uint4* dst = sm.x[i % NXS][xi];
            const u32* src = xsrc + 32LL * (c0 + i);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int j = 4 * xh + q;
                ds4_cp16(&dst[j ^ (xi & 1)], xit >= 0 ? src + 4 * j : XT, xit >= 0);
            }
        }
    };
    auto issue_raw = [&](int S) {
        if (SC * S < nl) {
            const int buf = S & 1, cs = c0 + SC * S;
            const long long boff = stage_off(cs);
            for (int idx = tid; idx < GT_BN * NWM; idx += 128) {
                int r = idx / NWM, w = idx - r * NWM;
                const u8* a = wbase + (long long)min(r0 + r, rows - 1) * row_bytes + boff;
                int sh = (int)((size_t)a & 3), nw = (sh + C::SB + 3) >> 2;
                if (w < nw) ds4_cp4(&sm.raw[buf][r][w], (const u32*)(a - sh) + w);
            }
            if (C::MIN) {
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    int j = 2 * xh + q; // 16-byte quarter j of the item's 64 sum bytes
                    ds4_cp16(&sm.s[buf][xi][4 * j], xit >= 0 ? ssrc + 16LL * (cs / 8) + 4 * j : XT, xit >= 0);
                }
            }
        }
    };
    issue_raw(0);
    issue_x(0);
    ds4_cp_commit();
#pragma unroll
    for (int j = 1; j < NXS - 1; j++) {
        issue_x(j);
        ds4_cp_commit();
    }

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    constexpr int MT = 2, NT = 4, RW = 8 * NT; // m-tiles, n-tiles, rows per warp
    const int wm = warp >> 1, wn = warp & 1;
    // m-tiles of this warp (items 32wm + 16mt ..) holding any valid item.
    const int nmt = skip ? min(max((gm_tile_valid(grp, n, blockIdx.y, GT_BM) - 32 * wm + 15) >> 4, 0), MT) : MT;
    float acc[MT][NT][4], cc[MT][NT][4];
    gt_zero<MT, NT>(acc);
    gt_zero<MT, NT>(cc);

    for (int i = 0; i < nl; i++) {
        ds4_cp_wait<NXS - 2>();
        __syncthreads();
        issue_x(i + NXS - 1);
        if (i % SC == 0) issue_raw(i / SC + 1);
        ds4_cp_commit();
        const int S = i / SC, p = i % SC, buf = S & 1;
        const int bsh = (int)(stage_off(c0 + SC * S) & 3);
        const uint4(*xs)[8] = sm.x[i % NXS];
        if (nmt == 0) continue; // warp-uniform: no valid item (no flush needed: acc stays 0)
        u32 bq[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            int r = RW * wn + 8 * nt + g;
            const u8* blk = (const u8*)sm.raw[buf][r] + ((sm.rlo[r] + bsh) & 3);
            gt_deq<T>(blk, p, t, bq[nt], sm);
        }
#pragma unroll
        for (int kk = 0; kk < 2; kk++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (mt >= nmt) continue;
                const int m0 = 32 * wm + 16 * mt + g, j = (2 * t + kk) ^ (g & 1);
                uint4 v0 = xs[m0][j], v1 = xs[m0 + 8][j];
                u32 ah[4] = {v0.x, v1.x, v0.y, v1.y}, al[4] = {v0.z, v1.z, v0.w, v1.w};
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    u32 b[2] = {bq[nt][2 * kk], bq[nt][2 * kk + 1]};
                    ds4_mma_f16(cc[mt][nt], ah, b);
                    ds4_mma_f16(cc[mt][nt], al, b);
                }
            }
        if ((p + 1) % C::GC == 0) {
            float D[NT][2], Dm[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    int r = RW * wn + 8 * nt + 2 * t + e1;
                    gt_scale<T>((const u8*)sm.raw[buf][r] + ((sm.rlo[r] + bsh) & 3), p, D[nt][e1], Dm[nt][e1]);
                }
            if (C::MIN) {
                float cm[MT][NT][4];
                u32 bm[NT][2];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    int r = RW * wn + 8 * nt + g;
                    gt_minb<T>((const u8*)sm.raw[buf][r] + ((sm.rlo[r] + bsh) & 3), t, bm[nt]);
                }
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) cm[mt][nt][e] = 0.0f;
                    if (mt >= nmt) continue;
                    const int m0 = 32 * wm + 16 * mt + g;
                    const u32* s0 = sm.s[buf][m0];
                    const u32* s1 = sm.s[buf][m0 + 8];
                    u32 ah[4] = {s0[t], s1[t], s0[t + 4], s1[t + 4]}, al[4] = {s0[8 + t], s1[8 + t], s0[12 + t], s1[12 + t]};
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        ds4_mma_f16(cm[mt][nt], ah, bm[nt]);
                        ds4_mma_f16(cm[mt][nt], al, bm[nt]);
                    }
                }
                gt_apply<MT, NT>(acc, cc, cm, D, Dm);
            } else {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            acc[mt][nt][e] = fmaf(D[nt][e & 1], cc[mt][nt][e], acc[mt][nt][e]);
                            cc[mt][nt][e] = 0.0f;
                        }
            }
        }
    }
    ds4_cp_wait<0>();

    gt_store<MT, NT, RW>(acc, items, Y + (long long)z * y_z + (long long)s * y_s, y_tok, xinv, xdiv, r0, rows, wm, wn, g, t);
#endif
}

// gemmt_<t>: 64 items x 64 rows, 128 threads (CUDA sm_80+; elsewhere empty: never launched there).
DS4_KERNEL void DS4_BOUNDS(128) gemmt_q8_0(GMT_PARAMS) { gemmt_body<T_Q8_0>(GMT_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmt_q4_k(GMT_PARAMS) { gemmt_body<T_Q4_K>(GMT_ARGS); }
DS4_KERNEL void DS4_BOUNDS(128) gemmt_iq2_xxs(GMT_PARAMS) { gemmt_body<T_IQ2_XXS>(GMT_ARGS); }

// gemmu_q2_k's shared-memory accesses on 32-bit shared addresses computed once per thread (the
// compiler recomputed them from the thread id in every chunk: ~380 instructions a warp and chunk
// for 32 mma), volatile so that equal addresses of different chunks stay separate loads.
#if GM_HAVE_MMA
__device__ __forceinline__ u32 gu_lds(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ u32 gu_lds16(u32 a) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ void gu_sts4(u32 a, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
__device__ __forceinline__ void gu_ldm4(u32* r, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void gu_cp16(u32 d, const void* src, int sz) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(sz) : "memory");
}
// A value the compiler cannot see through (kept in a register instead of recomputed from the
// thread id in every chunk).
__device__ __forceinline__ u32 gu_keep(u32 v) {
    asm volatile("mov.b32 %0, %0;" : "+r"(v));
    return v;
}
__device__ __forceinline__ void gu_cp4(u32 d, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
#endif

// ---- gemmu_q2_k: the tiled form for Q2_K with each B element decoded once per CTA ----
// Same arithmetic and staging as gemmt_<t> (weights sl*q exact in f16, X hi/lo f16 from
// gemm_xt_f32, d / dmin and the min mma per super-block), but the chunk's 64 x 32 weights are
// decoded once by the 128 threads into a shared tile (gemmt: each B fragment by the two warps
// of a row half, in registers) and read by ldmatrix; chunk c + 1 is decoded while chunk c's mma
// run (two tile buffers, one barrier per chunk). Thread t decodes row t/2, k-step t%2: the
// 16 elements 8u + 8(t%2) .. +3, u < 4 (4 q words); sl*q as one fused f16x2 FMA a pair:
// (1024 + q 4^j) * (sl 4^-j) - 1024 sl 4^-j (q's bits in place, j the chunk's shift; exact).
// Tile row: 4 groups of 16 bytes, group (k-step kk, pair h) = words t = 0..3 of the
// m16n8k16 B fragment register h of step kk (elements 8t + 4kk + 2h, +1, the gemmt K order),
// stored at group index (2kk + h) ^ ((row >> 1) & 3) (conflict-free 16-byte stores and
// ldmatrix rows). Sums single-buffered (issued at the super-block's first chunk; static
// shared memory < 48 KB). Min term: B' = 16 m (exact in f16), so dmin needs no x16.
// X in gemm_xt_f32's unit layout (unit != 0): per 32-element chunk, 16-byte unit 4 kk + c (kk:
// k-step, c: hi01, hi23, lo01, lo23) holds component c of the groups 2t + kk, t = 0..3 (word t),
// so the A fragment of an m-tile and k-step is two ldmatrix.x4 (rows +0 | +8 x unit c = hi01 |
// hi23, then lo) instead of gemmt's 16-byte loads regrouped by register moves; unit u of item m
// at slot position u ^ (m & 7) (conflict-free ldmatrix rows).
// Instruction economy (bench/results/gpu-gemm-e10-h200.txt): the chunk loop unrolled over a
// super-block (8 chunks: the decode's sub-block and shift, the tile buffer and the super-block
// epilogue are compile-time; cc starts each super-block as a zero accumulator), every shared
// address a per-thread base + a constant (or XOR a constant inside a 128-byte-aligned row),
// raw rows copied by a fixed (row, word) map per thread (6 rows x 21 words per 126 threads, 11
// steps), raw rows 22 words apart (conflict-free decode loads), the chunk's 12 ldmatrix issued
// before its 32 mma (3 CTAs per SM). H200 ncu (routed experts q2, n = 2048): 728 M instructions
// instead of 1614 M, 2.97 ms instead of 4.02. Host contract as gemmt (rows 4-byte aligned: Q2_K
// rows are 84-byte multiples).
struct alignas(128) GuSmem { // x rows (128 bytes) and w rows (64 bytes) on 128-byte boundaries: a
                             // swizzled 16-byte unit's address is the row's address XOR 16 * unit
    uint4 x[3][GT_BM][8];  // X chunk slots, unit u of item m at position u ^ (m & 7)
    u32 s[GT_BM][16];      // sums of the current super-block: hi 8 words, lo 8 words
    u32 raw[2][GT_BN][23]; // raw super-blocks (84 bytes) at a stride of 22 words (RSW; 23 as measured)
    uint4 w[2][GT_BN][4];  // decoded chunk tiles
};

__device__ __forceinline__ void gemmu_body(GMT_PARAMS) {
#if GM_HAVE_MMA
    constexpr int NXS = 3, SC = 8, SB = 84, NWM = SB / 4;
    constexpr u32 RSW = 22; // raw row stride in words: rows 2i, 2i + 1 of a warp's decode loads on other banks
    constexpr u32 XSL = GT_BM * 8 * 16, RBUF = GT_BN * RSW * 4, WBUF = GT_BN * 4 * 16, RST = RSW * 4;
    __shared__ GuSmem sm;
    __shared__ int items[GT_BM];
    __shared__ int expert;
    const int tid = threadIdx.x;
    const int z = blockIdx.z / ks, s = blockIdx.z % ks;
    const int r0 = blockIdx.x * GT_BN;
    if (grp && (int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    gm_items(items, &expert, GT_BM, n, grp, sel, gmax);
    __syncthreads();
    const long long wo = (long long)z * w_z + (grp ? (long long)expert * slab : 0);
    const u8* wbase = W + wo;
    const u32 sx = (u32)__cvta_generic_to_shared(&sm.x[0][0][0]), sS = (u32)__cvta_generic_to_shared(&sm.s[0][0]);
    const u32 sr = (u32)__cvta_generic_to_shared(&sm.raw[0][0][0]), sw = (u32)__cvta_generic_to_shared(&sm.w[0][0][0]);
    const int nch = cols / 32, c0 = s * kc, c1 = min(nch, c0 + kc), nl = max(c1 - c0, 0);

    // X and sums copies: thread (item xi, half xh) copies units 4xh..4xh+3 of the item's chunk
    // (to positions (4xh ^ (xi & 7)) ^ q) and sum words 8xh..8xh+7 of a super-block.
    const int xi = tid >> 1, xh = tid & 1;
    const int xit = items[xi];
    const bool xok = xit >= 0;
    const long long xtok = xok ? (long long)(xit / xdiv) : 0;
    const int xsz = xok ? 16 : 0, xstep = xok ? 128 : 0, sstep = xok ? 64 : 0;
    const char* xsrc = xok ? (const char*)(XT + xtok * x_tok + (long long)z * x_z + 32LL * c0 + 16 * xh) : (const char*)XT;
    const char* ssrc = xok ? (const char*)(XS + xtok * (x_tok / 16) + (long long)z * (x_z / 16) + 16LL * (c0 / 8) + 8 * xh)
                           : (const char*)XT;
    const u32 xdst = gu_keep(sx + 128 * xi + 16 * ((4 * xh) ^ (xi & 7))), sdst = sS + 64 * xi + 32 * xh;
    const char* xnext = xsrc; // chunk of the next issue_x
    auto issue_x = [&](int i, u32 slot) {
        if (i < nl) {
#pragma unroll
            for (int q = 0; q < 4; q++) gu_cp16((xdst + slot) ^ (16 * q), xnext + 16 * q, xsz);
            xnext += xstep;
        }
    };
    auto issue_sums = [&](int S) {
        const char* src = ssrc + (long long)S * sstep;
#pragma unroll
        for (int q = 0; q < 2; q++) gu_cp16(sdst + 16 * q, src + 16 * q, xsz);
    };
    // Raw copies: thread t < 126 copies word t % 21 of rows t / 21 + 6k, k < 11 (rows past the
    // last clamp to it).
    const int rr = tid / NWM, rw = tid - rr * NWM, rb = (int)row_bytes, rlast = rows - 1 - r0;
    const u8* rsrc = wbase + (long long)r0 * row_bytes + 4 * rw;
    const u32 rdst = sr + RST * rr + 4 * rw;
    auto issue_raw = [&](int S) {
        if (tid < 6 * NWM) {
            const u8* a = rsrc + (long long)((c0 + SC * S) / 8) * SB;
            const u32 d = rdst + (S & 1) * RBUF;
#pragma unroll
            for (int k = 0; k < 11; k++) {
                const int r = rr + 6 * k;
                if (k < 10 || r < GT_BN) gu_cp4(d + 6 * RST * k, a + min(r, rlast) * rb);
            }
        }
    };
    // Decode: thread (row dr, k-step dk) of chunk p (compile-time) of the stage in raw buffer
    // rbuf into tile buffer (p & 1) (layout: above).
    const int dr = tid >> 1, dk = tid & 1;
    const u32 drow = sr + RST * dr, dst0 = sw + 64 * dr + 16 * ((2 * dk) ^ ((dr >> 1) & 3));
    // 0x64646464 in a register (blockDim.x = 128: the OR adds nothing, but the compiler cannot fold
    // it into the PRMTs), so that their byte selectors are the immediates (else ~10 moves a chunk).
    const u32 k64 = 0x64646464u | (blockDim.x >> 8);
    auto decode = [&](int p, u32 rbuf, u32 wbuf) {
        const int h = p >> 2, j = p & 3;
        const u32 row = drow + rbuf;
        const u32 e1 = (u32)(15 - 2 * j) << 10, e2 = 0x8000u | ((u32)(25 - 2 * j) << 10);
        const u32 k1 = e1 | (e1 << 16), k2 = e2 | (e2 << 16);
        const u32 slp = gu_lds16(row + 8 * h + 2 * j) & 0x0f0fu; // sl of sub-blocks 0, 1
        const u32 ss = ds4_hfma2(__byte_perm(slp, k64, 0x4140), k1, k2); // (sl0, sl1) * 4^-j
        const u32 sc[2] = {__byte_perm(ss, 0u, 0x1010), __byte_perm(ss, 0u, 0x3232)};
        u32 cm[2];
#pragma unroll
        for (int u = 0; u < 2; u++) cm[u] = ds4_hmul2(sc[u], 0xe400e400u); // * -1024
        const u32 msk = 0x03030303u << (2 * j);
        u32 o[2][4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const u32 v = gu_lds(row + 4 * dk + 16 + 32 * h + 8 * u) & msk;
            const u32 lo = __byte_perm(v, k64, 0x4140), hi = __byte_perm(v, k64, 0x4342);
            o[0][u] = ds4_hfma2(lo, sc[u >> 1], cm[u >> 1]);
            o[1][u] = ds4_hfma2(hi, sc[u >> 1], cm[u >> 1]);
        }
        gu_sts4(dst0 + wbuf, o[0][0], o[0][1], o[0][2], o[0][3]);
        gu_sts4((dst0 ^ 16) + wbuf, o[1][0], o[1][1], o[1][2], o[1][3]);
    };
    const int nS = nl / SC; // host contract: kc % 8 == 0, cols % 256 == 0
    if (nS > 0) {
        issue_raw(0);
        issue_sums(0);
        issue_x(0, 0);
        ds4_cp_commit();
        issue_x(1, XSL);
        ds4_cp_commit();
        ds4_cp_wait<1>(); // stage 0
        __syncthreads();
        decode(0, 0, 0);
    }

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, lr = lane & 7, lm = lane >> 3;
    constexpr int MT = 2, NT = 4, RW = 8 * NT;
    const int wm = warp >> 1, wn = warp & 1;
    const int nmt = skip ? min(max((gm_tile_valid(grp, n, blockIdx.y, GT_BM) - 32 * wm + 15) >> 4, 0), MT) : MT;
    // B (ldmatrix.x4, matrices (n-tile 2np | 2np+1) x (register 0 | 1)): lane L gives row
    // RW wn + 8 (2np + (L/8)/2) + L%8, group (2kk + (L/8)%2) ^ ((row >> 1) & 3) = that of kk = 0 XOR 2kk;
    // np: +16 rows. A (matrices (rows +0 | +8) x (hi01 | hi23), then lo): item 32 wm + 16 mt +
    // 8 ((L/8)%2) + L%8, unit ((L/8)/2 ^ L%8) XOR (4kk + 2 lo); mt: +16 items.
    const u32 bA = gu_keep(sw + 64 * (RW * wn + 8 * (lm >> 1) + lr) + 16 * ((lm & 1) ^ ((lr >> 1) & 3)));
    const u32 bA1 = gu_keep(bA ^ 32);
    const u32 aA = gu_keep(sx + 128 * (32 * wm + 8 * (lm & 1) + lr) + 16 * ((lm >> 1) ^ lr));
    // Epilogue rows: d/dmin of rows RW wn + 8nt + 2t + e1, mins of rows RW wn + 8nt + g (bytes 2t
    // and 2t + 8), sums of items 32 wm + 16 mt + g (+8).
    const u32 eD = sr + RST * (RW * wn + 2 * t) + 80, eM = sr + RST * (RW * wn + g) + 2 * t;
    const u32 eS = sS + 64 * (32 * wm + g) + 4 * t;
    float acc[MT][NT][4], cc[MT][NT][4];
    gt_zero<MT, NT>(acc);

    u32 xo = 0; // X slot of chunk i (i % 3)
    for (int S = 0; S < nS; S++) {
        const u32 rbuf = (S & 1) * RBUF;
#pragma unroll
        for (int p = 0; p < SC; p++) {
            const int i = SC * S + p;
            ds4_cp_wait<NXS - 2>();
            __syncthreads();
            const u32 xn = xo == 0 ? 2 * XSL : xo - XSL; // slot of chunk i + 2
            issue_x(i + 2, xn);
            if (p == 0) {
                if (S + 1 < nS) issue_raw(S + 1);
                if (S > 0) issue_sums(S);
            }
            ds4_cp_commit();
            if (p + 1 < SC)
                decode(p + 1, rbuf, ((p + 1) & 1) * WBUF);
            else if (S + 1 < nS)
                decode(0, RBUF - rbuf, 0);
            if (p == 0) gt_zero<MT, NT>(cc); // a zero accumulator for the first mma
            if (nmt > 0) { // warp-uniform: no valid item (acc stays 0)
                const u32 wb = (p & 1) * WBUF, xa = aA + xo;
                { // every fragment of the chunk first (12 ldmatrix), then the 32 mma
                    u32 b[2][NT][2], a[2][MT][2][4];
#pragma unroll
                    for (int kk = 0; kk < 2; kk++) {
#pragma unroll
                        for (int np = 0; np < 2; np++) {
                            u32 q[4];
                            gu_ldm4(q, (kk ? bA1 : bA) + wb + 1024 * np);
                            b[kk][2 * np][0] = q[0], b[kk][2 * np][1] = q[1], b[kk][2 * np + 1][0] = q[2], b[kk][2 * np + 1][1] = q[3];
                        }
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            if (mt >= nmt) continue;
                            gu_ldm4(a[kk][mt][0], (xa ^ (64 * kk)) + 2048 * mt);
                            gu_ldm4(a[kk][mt][1], (xa ^ (64 * kk + 32)) + 2048 * mt);
                        }
                    }
#pragma unroll
                    for (int kk = 0; kk < 2; kk++)
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            if (mt >= nmt) continue;
#pragma unroll
                            for (int hl = 0; hl < 2; hl++)
#pragma unroll
                                for (int nt = 0; nt < NT; nt++) ds4_mma_f16(cc[mt][nt], a[kk][mt][hl], b[kk][nt]);
                        }
                }
                if (p == SC - 1) {
                    float D[NT][2], Dm[NT][2];
                    u32 bm[NT][2];
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                        for (int e1 = 0; e1 < 2; e1++) {
                            const u32 dd = gu_lds(eD + rbuf + RST * (8 * nt + e1));
                            D[nt][e1] = ds4_h2f_fast(dd), Dm[nt][e1] = ds4_h2f_fast(dd >> 16);
                        }
                        // 16 m (exact in f16): the products times 16, exactly as gemmt's dmin x 16
                        const u32 v0 = gu_lds16(eM + rbuf + RST * 8 * nt), v1 = gu_lds16(eM + rbuf + RST * 8 * nt + 8);
                        bm[nt][0] = gq_u10x2((v0 & 0xf0u) | ((v0 & 0xf000u) << 8));
                        bm[nt][1] = gq_u10x2((v1 & 0xf0u) | ((v1 & 0xf000u) << 8));
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        if (mt >= nmt) continue;
                        const u32 sa = eS + 1024 * mt;
                        u32 ah[4] = {gu_lds(sa), gu_lds(sa + 512), gu_lds(sa + 16), gu_lds(sa + 528)};
                        u32 al[4] = {gu_lds(sa + 32), gu_lds(sa + 544), gu_lds(sa + 48), gu_lds(sa + 560)};
                        float cm[NT][4];
#pragma unroll
                        for (int nt = 0; nt < NT; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++) cm[nt][e] = 0.0f;
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) ds4_mma_f16(cm[nt], ah, bm[nt]);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) ds4_mma_f16(cm[nt], al, bm[nt]);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const float a = fmaf(D[nt][e & 1], cc[mt][nt][e], acc[mt][nt][e]);
                                acc[mt][nt][e] = fmaf(-Dm[nt][e & 1], cm[nt][e], a);
                            }
                    }
                }
            }
            xo = xo == 2 * XSL ? 0 : xo + XSL;
        }
    }
    ds4_cp_wait<0>();

    gt_store<MT, NT, RW>(acc, items, Y + (long long)z * y_z + (long long)s * y_s, y_tok, xinv, xdiv, r0, rows, wm, wn, g, t);
#endif
}
// <= 168 registers: 3 CTAs per SM (all fragments of a chunk in flight; 128 registers and 4 CTAs
// per SM: 3.04 vs 2.97 ms ncu, bench/results/gpu-gemm-e10-h200.txt).
#if defined(DS4_CUDA)
#define GU_B3 128, 3
#else
#define GU_B3 128
#endif
DS4_KERNEL void DS4_BOUNDS(GU_B3) gemmu_q2_k(GMT_PARAMS) { gemmu_body(GMT_ARGS); }

// X rows for gemmt: one CTA per token row; elements j < width (multiple of 256; X 16-byte aligned,
// x_tok multiple of 16). v = x * 2^s_t (s_t as gemm_xh_f32), xinv[t] = 2^-s_t; each 4 elements
// 4q..4q+3 as words xt[t*x_tok + 4q ..+4] = {f16x2 hi(v0,v1), hi(v2,v3), lo(v0,v1), lo(v2,v3)}
// (lo = f16(v - hi)); xs (may be null): per super-block b (256 elements) 16 words at
// t*x_tok/16 + 16b: halves 0..15 = hi of S_k/16, halves 16..31 = lo, S_k the f32 sum of v over
// elements 16k..16k+15 of the super-block. Without mma (never launched there) nothing.
// unit != 0: the unit layout of gemmu_q2_k instead (per 32-element chunk, word 4 (4 kk + c) + t =
// component c of the group 2t + kk above). lo == 0 (unit layout only: the one-plane gwd_q2_k_p1,
// which reads neither): the lo components (units 4 kk + 2, 4 kk + 3) and the lo sums not written.
#if GM_HAVE_MMA // the f16 split helpers exist only there
// gemm_xt_f32's output for group g (16 elements v, unscaled) of one row: row = xt + t·x_tok,
// so = the row's sums (u16 view; null: none), sc = 2^s. Shared with gemm_xt_swiglu_f32.
__device__ __forceinline__ void gm_xt_group(const float4 (&v)[4], float sc, int g, u32* __restrict__ row, u16* __restrict__ so, int unit, int lo) {
    float sum = 0.0f;
    uint4 wq[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float a = v[i].x * sc, b = v[i].y * sc, c = v[i].z * sc, d = v[i].w * sc; // exact (power of two)
        u32 h0, h1, l0, l1;
        ds4_f16x2_split(a, b, h0, l0);
        ds4_f16x2_split(c, d, h1, l1);
        wq[i] = make_uint4(h0, h1, l0, l1);
        sum += (a + b) + (c + d);
    }
    if (!unit) {
        uint4* o = (uint4*)row;
#pragma unroll
        for (int i = 0; i < 4; i++) o[4 * g + i] = wq[i];
    } else { // groups 4(g%2) + i of chunk g/2: words t = 2(g%2), +1 of unit (kk = i%2, c)
        uint2* u2 = (uint2*)(row + 32 * (g >> 1) + 2 * (g & 1));
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const uint4 a = wq[kk], b = wq[2 + kk];
            u2[2 * (4 * kk + 0)] = make_uint2(a.x, b.x);
            u2[2 * (4 * kk + 1)] = make_uint2(a.y, b.y);
            if (lo) {
                u2[2 * (4 * kk + 2)] = make_uint2(a.z, b.z);
                u2[2 * (4 * kk + 3)] = make_uint2(a.w, b.w);
            }
        }
    }
    if (so) {
        float v = sum * 0.0625f; // exact
        u32 hv = gm_h2(v, 0.0f);
        float lv = v - ds4_h2f_fast(hv);
        int b = g >> 4, k = g & 15;
        so[32 * b + k] = (u16)hv;
        if (lo || !unit) so[32 * b + 16 + k] = (u16)gm_h2(lv, 0.0f);
    }
}

// The row scale of gemm_xt_f32 from the row's max |x| m: returns 2^s (s = 15 − e, clamped), and
// thread 0 stores 2^−s to xinv[t].
__device__ __forceinline__ float gm_xt_scale(float m, float* __restrict__ xinv, long long t) {
    int e = (int)((__float_as_int(m) >> 23) & 0xff) - 126;
    int sh = min(max(15 - e, -126), 126);
    if (threadIdx.x == 0) xinv[t] = __int_as_float((127 - sh) << 23);
    return __int_as_float((sh + 127) << 23);
}
#endif

DS4_KERNEL void DS4_BOUNDS(256) gemm_xt_f32(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xt, u32* __restrict__ xs, float* __restrict__ xinv, int unit, int lo) {
#if GM_HAVE_MMA
    __shared__ float red[256 / DS4_WARP];
    const float4* p = (const float4*)(X + (long long)blockIdx.x * x_tok);
    float m = 0.0f;
    for (int i = threadIdx.x; i < width / 4; i += 256) {
        float4 v = p[i];
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
    if (threadIdx.x % DS4_WARP == 0) red[threadIdx.x / DS4_WARP] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < 256 / DS4_WARP; i++) m = fmaxf(m, red[i]);
    const float sc = gm_xt_scale(m, xinv, blockIdx.x);
    u32* row = xt + (long long)blockIdx.x * x_tok;
    u16* so = xs ? (u16*)(xs + (long long)blockIdx.x * (x_tok / 16)) : nullptr;
    for (int g = threadIdx.x; g < width / 16; g += 256) { // 16 elements per step
        float4 v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = p[4 * g + i];
        gm_xt_group(v, sc, g, row, so, unit, lo);
    }
#endif
}

// moe_swiglu_f32 + gemm_xt_f32 in one pass, for the MoE down's X: row p (pair; one CTA) of
// h = ds4_moe_swiglu(gate, up, clamp, wgt[p]) (moe_swiglu_f32's bits) converted as gemm_xt_f32
// converts rows of h (x_tok = width), without h in memory (reads gate and up once, writes only
// the converted row, in any of gemm_xt_f32's layouts). Each thread holds one 16-element
// group in registers: blockDim a multiple of DS4_WARP, ≥ width / 16, ≤ 256 (width ≤ 4096, a
// multiple of 256). The row max is order-free, so the scale and every word are gemm_xt_f32's.
DS4_KERNEL void DS4_BOUNDS(256) gemm_xt_swiglu_f32(const float* __restrict__ G, const float* __restrict__ U, const float* __restrict__ wgt, float clamp, int width, u32* __restrict__ xt, u32* __restrict__ xs, float* __restrict__ xinv, int unit, int lo) {
    ds4_pdl_enter();
#if GM_HAVE_MMA
    __shared__ float red[256 / DS4_WARP];
    const long long t = blockIdx.x;
    const int g = threadIdx.x;
    const bool on = g < width / 16;
    float4 v[4];
    float m = 0.0f;
    if (on) {
        const float w = wgt[t];
        const float4* gp = (const float4*)(G + t * width) + 4 * g;
        const float4* up = (const float4*)(U + t * width) + 4 * g;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 a = gp[i], b = up[i];
            v[i] = make_float4(ds4_moe_swiglu(a.x, b.x, clamp, w), ds4_moe_swiglu(a.y, b.y, clamp, w),
                               ds4_moe_swiglu(a.z, b.z, clamp, w), ds4_moe_swiglu(a.w, b.w, clamp, w));
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w))));
        }
    }
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
    if (threadIdx.x % DS4_WARP == 0) red[threadIdx.x / DS4_WARP] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < (int)blockDim.x / DS4_WARP; i++) m = fmaxf(m, red[i]);
    const float sc = gm_xt_scale(m, xinv, t);
    if (on) gm_xt_group(v, sc, g, xt + t * width, xs ? (u16*)(xs + t * (width / 16)) : nullptr, unit, lo);
#endif
}
