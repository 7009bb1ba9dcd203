// Hopper wgmma form of the MoE's IQ2_XXS gate/up at prefill (sm_90a only; the host launches it
// only there, elsewhere the kernels compile to empty bodies).
//
//   Y_z[item][r] = W_z[expert][r] · X[item / xdiv]     z = 0: gate (W0 -> Y0), z = 1: up (W1 -> Y1)
//
// for the (token, slot) pairs grouped by expert (gm_group_*_i32 with runs cut at 64, gemm.cu),
// gate and up in one launch (blockIdx.z).
//
// Arithmetic (the tiled form's, gemm.cu gemmt_*): weights as exact integers in f16,
//   w = (d / 8) * [(2 ls + 1) * grid * sign]          (|integer| <= 31 * 43 = 1333)
// X as two f16 planes hi = f16(v), lo = f16(v - hi) of v = x * 2^s (per token row, max |v| < 2^15;
// gwg_x_f32), products exact, f32 sums; the super-block scale d / 8 is applied once per 256
// columns (acc += D * cc), the row scale 2^-s at the store. Error: weights exact, X ~2^-22.
//
// Tensor cores: wgmma.mma_async m64nNk16 f16 -> f32 with the WEIGHTS AS A (64 weight rows, from
// registers) and X AS B (N items, from shared memory by descriptor): the decoded weights never
// touch shared memory (no decoded-tile stores, no ldmatrix). N = 16, 32, 48 or 64: the CTA's
// valid items rounded up to 16 (an expert's ~48 pairs of a 2048-token prompt: m64n48).
// CTA: NWG = 4 warpgroups (512 threads), 64 items x 64 NWG = 256 weight rows (warpgroup h: rows
// 64h..); 2 warpgroups and 128 rows (2 CTAs per SM) measured slower (results file).
// A fragment (per warp, as mma.m16n8k16): lane (g = lane/4, t = lane%4) of warp q holds rows
// 16q + g and 16q + g + 8, columns {2t, 2t+1, 2t+8, 2t+9} of each 16-wide k-step. K is permuted
// inside each 32-element chunk so that lane t's 8 values of a row over the chunk's two k-steps
// are grid entry t (elements 8t .. 8t+7): k-step kk, column k holds element
//   8 ((k & 7) >> 1) + 4 kk + 2 (k >> 3) + (k & 1)
// so each lane decodes one grid entry per row and chunk (one 8-byte grid lookup, integer
// weights by one PRMT + one HFMA2 a pair, signs by gemmc's PRMT sign replication), and X is
// stored in the same order by gwg_x_f32.
// X in shared memory (per chunk slot, per plane): no-swizzle K-major core matrices of 8 items x
// 8 halves (128 bytes), core (item group ig, k group kg) at 128 (4 ig + kg): descriptor start =
// plane + 256 kk, LBO (next k group) 128 bytes, SBO (next 8 items) 512 bytes.
// Pipeline: per chunk c, the wgmma of chunk c (4 per warpgroup: 2 k-steps x hi/lo into cc; the
// first of a super-block with scale-d 0) committed, then wait until chunk c-1's group is done
// (chunk 7 of a super-block: all, then acc += D cc), then the lane decodes chunk c+1 into the other
// A register set while chunk c's wgmma run (N <= 64: the decode goes before the wait, into spare
// registers, and only their copy into the A set waits: gw_body EARLY). X by cp.async 16-byte in groups of 4 chunks (16 slots
// of 8 KiB: the group in use, the next one in flight or landed, the one after in flight, the
// previous one's slots possibly still read by its last wgmma), one cp.async commit group per 4
// chunks; once per group (every 4th chunk): cp.async.wait_group 1 (this group's chunks landed, the
// next group's may still be in flight: 8 chunks of prefetch), fence.proxy.async (cp.async writes
// are generic-proxy writes that wgmma reads through the async proxy), barrier, then the copies of
// the group after next and, at a super-block's 5th chunk (p = 4), the raw weight blocks of
// super-block S+2 (3 stages of 256 rows x 20 words, stage S % 3, five 16-byte cp.async a row from
// the 16-byte boundary below the 2-byte-aligned 66-byte block): S+1's block then lands by S's p = 4 boundary,
// before its first decode at p = 7. The 2-stage form (wait_group 0: 4 chunks of prefetch, raw S+1
// issued at S's chunk 0) measured 0.3-0.6 % slower (routed experts) and 0.5 % end to end
// (bench/results/gpu-gemm-e16-h200.txt, 11a89c4); the per-chunk form (wait, fence and barrier
// every chunk, 5 slots) 0.5-1.4 % slower end to end (gpu-gemm-w15-h200.txt).
// Warp-specialised forms (2 producer warpgroups decoding into shared A tiles, 4 consumer warpgroups
// issuing SS wgmma) lost (routed experts 8-18 % slower): bench/results/gpu-gemm-w16-h200.txt, 2ef6615.
// One-plane form (PL = 1: gwg_iq2_xxs_p1, DS4_GPU_GEMM_PLANES=1: the engine's --precision fast, its
// default): X as hi = f16(v) alone (~2^-11 relative per element), so 2 wgmma a chunk and only the
// hi plane copied (gwg_x_f32 then skips the lo plane; same shared layout). H200, n = 2048 (ncu):
// 3.61 -> 2.80 ms; tiny-model logits up to 0.16 from the CPU (two planes, --precision exact:
// 1.6e-4) (bench/results/gpu-gemm-q17-h200.txt). 12 chunks of X prefetch in 32 hi-only slots tied there.
// Wide and folded forms (gemm_wg.rs DS4_GPU_GW_WIDE; one plane): runs of up to 128 pairs a CTA (the
// grouping's second section), and/or the super-block scale folded into the f16 weights (gw_body
// FD: one accumulator set). The default _fw (both, 4 warpgroups): H200 prefill +6.9 % (2k) /
// +9.0 % (8k); the unfolded 2-warpgroup runs of 128 lost and were deleted (code in 5a7f2d4;
// bench/results/gpu-p218-h200.txt).
#include "prelude.cuh"
#include "iq2xxs_grid.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

#define GW_NX 16  // X chunk slots: 4 groups of 4 chunks (pipeline below)
#define GW_RW 20  // raw words per row and stage: a 66-byte block from the 16-byte boundary below it
#define GW_RP 5   // its 16-byte pieces (the block starts at byte o <= 14 of them: o + 66 <= 80)
#define GW_NS 3   // raw stages: super-blocks S (in use), S+1 (landed or in flight), S+2 (in flight)
// Copies of the f16 grid (DQ 2): entry e of copy j at 16-byte unit 8 e + j, lane l reading copy
// l % 8. A 16-byte shared load is served 8 lanes at a time (32 banks = 8 units), and the 8 lanes
// of a phase then always hit 8 different bank groups, whatever their entries; with one copy 8
// data-dependent entries almost always collided (ncu: 112 M bank conflicts for 114 M shared-memory
// instructions of a 2048-token gate/up launch). 32 KiB.
#define GW_GHC 8

#if GW_HAVE
// Dynamic shared memory of a CTA of BN weight rows (the host passes sizeof: gemm_wg.rs WG_SMEM).
template <int BN> struct alignas(16) GwSmem {
    uint4 x[GW_NX][2][GW_BM * 4];   // X chunk slots: plane (hi, lo), core matrices (above)
    u32 raw[GW_NS][BN * GW_RW + 4]; // raw super-blocks, row r at 20 r (+4: the decode's 3rd word)
    u64 grid[256];                  // IQ2_XXS grid (bytes: DQ 0)
    uint4 gh[256 * GW_GHC];         // the grid as 4 f16x2 words per entry, GW_GHC copies (DQ 2)
};
static_assert(sizeof(GwSmem<256>) == 227376, "gemm_wg.rs WG_SMEM");

// Sign masks of a grid entry's 7 sign bits s7 (bit 7: their parity): word q has bit 2q of s8 at
// bit 15 and bit 2q + 1 at bit 31 (the f16x2 sign bits of elements 2q, 2q + 1), other bits junk
// (the caller masks with 0x80008000). s8 * (0x8001 << k), k = 15 - 2q: s8 << k spans bits
// k .. k + 7, its copy << 15 bits k + 15 .. k + 22, disjoint (no carries), so bit 15 = s8 bit 2q
// and bit 31 = s8 bit 16 - k = 2q + 1.
__device__ __forceinline__ u32 gw_s8(u32 s7) { return s7 | ((__popc(s7) & 1u) << 7); }
__device__ __forceinline__ u32 gw_sgn(u32 s8, int q) { return s8 * (0x8001u << (15 - 2 * q)); }

// Grid entry t of chunk p of a row's staged block (rb: 20 words; sh: the block's byte offset in
// them, even, <= 14) as 4 f16x2 words: elements (0,1), (2,3), (4,5), (6,7) of the entry, each the exact
// integer (2 ls + 1) * grid * sign (|.| <= 31 * 43 = 1333 < 2048: exact in f16 whatever the form).
// DQ (decode form, gemm_wg.rs DS4_GPU_GW_DQ; both give the same bits):
//   0: grid bytes by PRMT into f16 1024 + b, one HFMA2 (1024 + b) m - 1024 m, signs by gemmc's
//      PRMT sign replication; m by IMAD/LOP3/HSUB2; the row's words addressed per chunk;
//   2 (default): the row's words from the per-super-block row state (gw_deq_h), the grid as f16
//      values (sm.gh, one 16-byte lookup): one HMUL2 b * m a pair, m = 2 ls + 1 as one IMAD + one
//      HFMA2, signs by one IMAD a pair (gw_sgn). 28% fewer instructions a chunk than 0 (N = 48,
//      sm_90a SASS); H200, one plane, with the lean conversions (gemm_wg.rs LEAN_X, -1.1% of it
//      alone): routed experts -5.9% (2k) / -7.4% (8k) against 0, prefill +4.0% / +3.8%
//      (bench/results/gpu-gemm-r17-h200.txt). Tried there and not kept: the row state alone
//      (DQ 1: -4.4%, part of 2 now); sign masks from a 2 KiB table (DQ 3: fewer instructions but
//      twice the shared-memory bank conflicts: +8.9%).
// DQ 2 takes the sub-block's 8 bytes as (rw, fs): rw the word holding byte 2 of the block (its
// first grid byte) rounded down, fs 16 or 0 its bit offset (gw_body's per-super-block row state:
// no per-chunk row addressing), chunk p's bytes at words 2p .. 2p + 2 of rw.
// FD (the folded form, DQ 2 only): the sub-block's multiplier m times dm (f16x2 of 16 d, the row's
// super-block scale: gw_dm), so w = f16(f16(m 16 d) b) ~ 128 x the weight, two f16 roundings.
template <int DQ, int FD = 0>
__device__ __forceinline__ void gw_deq_w(u32 idx, u32 aux, int t, const u64* grid, const uint4* gh, u32* w, u32 dm = 0);
template <int DQ>
__device__ __forceinline__ void gw_deq(const u32* rb, u32 sh, int p, int t, const u64* grid, const uint4* gh, u32* w) {
    const u32 o = sh + 2 + 8 * p, wi = o >> 2, fs = (o & 3) * 8;
    const u32 A = rb[wi], B = rb[wi + 1], C = rb[wi + 2];
    gw_deq_w<DQ>(__funnelshift_r(A, B, fs), __funnelshift_r(B, C, fs), t, grid, gh, w);
}
template <int DQ, int FD = 0>
__device__ __forceinline__ void gw_deq_h(const u32* rw, u32 fs, int p, int t, const u64* grid, const uint4* gh, u32* w,
                                         u32 dm = 0) {
    const u32 A = rw[2 * p], B = rw[2 * p + 1], C = rw[2 * p + 2];
    gw_deq_w<DQ, FD>(__funnelshift_r(A, B, fs), __funnelshift_r(B, C, fs), t, grid, gh, w, dm);
}
// The decode of a sub-block's 4 grid bytes idx and its signs/scale word aux (above).
template <int DQ, int FD>
__device__ __forceinline__ void gw_deq_w(u32 idx, u32 aux, int t, const u64* grid, const uint4* gh, u32* w, u32 dm) {
    static_assert(FD == 0 || DQ == 2, "the folded form: decode form 2");
    const u32 e = (idx >> (8 * t)) & 0xff, s7 = (aux >> (7 * t)) & 127u;
    if (DQ == 0) {
        const u64 gv = grid[e];
        const u32 m = 2 * (aux >> 28) + 1;
        const u32 m2 = ds4_hsub2((m | (m << 16)) | 0x64006400u, 0x64006400u); // f16x2 (m, m)
        const u32 c2 = ds4_hmul2(m2, 0xe400e400u);                               // -1024 m
        // sign bit e of the 8 (bit 7: parity) at the msb of byte e % 4 of v[e / 4] (gemmc's trick)
        const u32 v[2] = {(s7 & 15u) * 0x10204080u, ((s7 >> 4) | ((__popc(s7) & 1u) << 3)) * 0x10204080u};
        const u32 gw2[2] = {(u32)gv, (u32)(gv >> 32)};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            // bytes (b, 0x64): f16 1024 + b; (1024 + b) m - 1024 m = b m exactly (one rounding)
            const u32 u = ds4_prmt(gw2[q >> 1], 0x64646464u, (q & 1) ? 0x4342u : 0x4140u);
            const u32 mk = ds4_prmt(v[q >> 1], 0u, (q & 1) ? 0xb0a0u : 0x9080u);
            w[q] = ds4_hfma2(u, m2, c2) ^ (mk & 0x80008000u);
        }
    } else {
        // (ls | 0x6400) in both halves: f16 1024 + ls; 2 (1024 + ls) - 2047 = 2 ls + 1 exactly
        u32 m2 = ds4_hfma2((aux >> 28) * 0x10001u + 0x64006400u, 0x40004000u, 0xe7ffe7ffu);
        if (FD) m2 = ds4_hmul2(m2, dm); // (2 ls + 1) 16 d, rounded to f16
        const u32 s8 = gw_s8(s7);
        u32 sw[4];
#pragma unroll
        for (int q = 0; q < 4; q++) sw[q] = gw_sgn(s8, q);
        // f16x2 (b_2q, b_2q+1): b * m exact (gh: this lane's copy). Byte t of idx by one PRMT and the
        // address by one LEA (the shift-and-mask form took 5 instructions: sm_90a SASS).
        const u32 eb = ds4_prmt(idx, 0u, 0x4440u | (u32)t);
        const uint4 g = *(const uint4*)((const u8*)gh + eb * (16u * GW_GHC));
        const u32 gq[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
        for (int q = 0; q < 4; q++) w[q] = ds4_hmul2(gq[q], m2) ^ (sw[q] & 0x80008000u);
    }
}

// The super-block scale d / 8 of a row's staged block (f16 d at byte sh, even).
__device__ __forceinline__ float gw_dscale(const u32* rb, u32 sh) { return ds4_h2f_fast((rb[sh >> 2] >> (8 * (sh & 3))) & 0xffffu) * 0.125f; }
// The folded form's multiplier: f16x2 (16 d, 16 d) (exact: a power of two; 16 d (2 ls + 1) grid
// stays below f16's 65504 for |d| < 3, normal for |d| >= 2^-18), undone by 2^-7 at the store.
__device__ __forceinline__ u32 gw_dm(const u32* rb, u32 sh) { return ds4_hmul2(((rb[sh >> 2] >> (8 * (sh & 3))) & 0xffffu) * 0x10001u, 0x4c004c00u); }
// One CTA's product with N (16, 32, 48, 64; BM = 128: up to 128) item columns; items[] (-1: none)
// and the expert set by the caller. Rows r0 + 64 h + 16 q + g (+8) per lane (warpgroup h, warp q
// of it). BM: the CTA's item run, 64, or 128 for the wide form (PL == 1 alone: its 128 items' hi
// plane fills the 8 KiB chunk slot that holds 64 items' hi and lo planes, item group ig at
// 512 ig as before, so items 64.. sit where the lo plane was).
// FD (the folded form, PL 1 and DQ 2): the super-block scale folded into the decoded weights
// (gw_deq_w: f16(f16((2 ls + 1) 16 d) grid), two f16 roundings, ~2^-11 relative each), so the
// wgmma accumulate into acc across super-blocks: no cc (N / 2 registers fewer), no wait for all
// groups and acc += D cc every 8 chunks; acc times 2^-7 at the store.
template <int N, int NWG, int PL, int DQ, int BM = GW_BM, int FD = 0>
__device__ __forceinline__ void gw_body(GwSmem<64 * NWG>& sm, const int* items, int expert, const u8* __restrict__ W, float* __restrict__ Y,
                                        const u32* __restrict__ XW, const float* xs, int xdiv, long long slab,
                                        long long y_tok, int rows, int cols, long long row_bytes, int bx,
                                        u32* ctr = nullptr, int* s_tile = nullptr) {
    static_assert(BM == GW_BM || (BM == 2 * GW_BM && PL == 1), "wide runs: one plane");
    static_assert(FD == 0 || (PL == 1 && DQ == 2), "folded: one plane, decode form 2");
    // X pieces (16 bytes) of a chunk per item (hi and lo, or the wide form's hi alone), per
    // thread, threads per item
    constexpr int NT = 128 * NWG, BN = 64 * NWG, PPI = BM == GW_BM ? 8 : 4, PP = PPI * BM / NT, TPI = PPI / PP;
    static_assert(PP >= 1 && PP * TPI == PPI && NT / TPI == BM, "X pieces");
    const int tid = threadIdx.x, h = tid >> 7, q = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = bx * BN;
    const u8* wbase = W + (long long)expert * slab;
    const int nl = cols / 32, nsb = nl / 8;
    const u32 sx = (u32)__cvta_generic_to_shared(&sm.x[0][0][0]);
    const u32 sr = (u32)__cvta_generic_to_shared(&sm.raw[0][0]);
    // X copies: thread -> item xm = tid / TPI, 16-byte pieces j = PP (tid % TPI) + jj (0..3 hi, 4..7
    // lo), piece j of item m to plane j / 4, core (m / 8, j % 4), row m % 8; PL == 1: hi only
    // (BM = 128: j < 4, items 64.. at core 4 (m / 8) + j from 4096 bytes on).
    const int xm = tid / TPI;
    const int xit = xm < N ? items[xm] : -1;
    // An absent item reads nothing (src-size 0) at row 0's address (in bounds: 32 c + 4 j < cols).
    const u32* xsrc = XW + (long long)(xit >= 0 ? xit / xdiv : 0) * cols + 4 * PP * (tid % TPI);
    const int xn = xit >= 0 ? 16 : 0;
    u32 xdst[PP];
#pragma unroll
    for (int jj = 0; jj < PP; jj++) {
        const int j = PP * (tid % TPI) + jj;
        xdst[jj] = sx + (u32)((j >> 2) * 4096 + ((4 * (xm >> 3) + (j & 3)) * 8 + (xm & 7)) * 16);
    }
    constexpr int NX = GW_NX;
    // The copies of a group of 4 chunks c0 .. c0 + 3 (c0 % 4 == 0; nl % 8 == 0, so all four are
    // below nl or none): one test and one slot base a group, not a chunk.
    auto issue_x4 = [&](int c0) {
        if (c0 < nl && xm < N) {
            const u32 so = (u32)(c0 % NX) * 8192u; // the 4 slots are consecutive (NX % 4 == 0)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < PP; jj++) {
                    if (PL == 1 && PP * (tid % TPI) + jj >= 4) continue; // a lo piece
                    ds4_cp16n(xdst[jj] + so + 8192u * (u32)i, xsrc + 32LL * (c0 + i) + 4 * jj, xn);
                }
        }
    };
    // Raw super-block S (the 66-byte block S of each of the BN rows) into stage S % 3: 5 pieces of
    // 16 bytes a row at words 20 r + 4 k (wgmma.cuh gw_stage_blocks).
    auto issue_raw = [&](int S) {
        if (S < nsb)
            gw_stage_blocks<BN, NT, 66, GW_RW, GW_RP>(sr + (u32)(S % GW_NS) * (u32)((BN * GW_RW + 4) * 4), wbase, r0, rows,
                                                      row_bytes, S);
    };
    const int R0 = 64 * h + 16 * q + g, R1 = R0 + 8;
    const uint4* ghl = sm.gh + (lane & (GW_GHC - 1)); // this lane's copy of the f16 grid
    // Byte offset of super-block 0 of each row in its staged piece (super-block S: + 66 S = + 2 S
    // mod 16): sh(S) below.
    const u32 a16_0 = (u32)((size_t)(wbase + (long long)min(r0 + R0, rows - 1) * row_bytes) & 15);
    const u32 a16_1 = (u32)((size_t)(wbase + (long long)min(r0 + R1, rows - 1) * row_bytes) & 15);
    auto sh0f = [&](int S) { return (a16_0 + 2u * (u32)S) & 15u; };
    auto sh1f = [&](int S) { return (a16_1 + 2u * (u32)S) & 15u; };
    // A registers of chunk 8S + p: k-step kk at a[4kk ..]: (R0, R1, R0, R1) x element pairs
    // (2kk, 2kk, 2kk + 1, 2kk + 1) of grid entry t.
    // (x: the block's byte offset by S % 2; its stage S % 3.)
    // DQ 2: the row state of super-block S (rw: word b of the row in stage S % 3, b = the
    // block's byte offset (sh ^ 2 (S % 2)) / 2; fs = 16 (1 - b): gw_deq_h), set once per S.
    const u32 *rw0 = nullptr, *rw1 = nullptr;
    u32 fs0 = 0, fs1 = 0;
    auto rows_of = [&](int S) {
        const u32 o0 = sh0f(S) + 2u, o1 = sh1f(S) + 2u; // the block's byte 2 (its first grid byte)
        rw0 = &sm.raw[S % GW_NS][GW_RW * R0 + (o0 >> 2)];
        rw1 = &sm.raw[S % GW_NS][GW_RW * R1 + (o1 >> 2)];
        fs0 = (o0 & 3u) * 8u, fs1 = (o1 & 3u) * 8u;
    };
    u32 dm0 = 0, dm1 = 0; // FD: the rows' f16x2 16 d of the super-block being decoded
    auto decode = [&](int S, int p, u32* a) {
        u32 w0[4], w1[4];
        if (DQ == 0) {
            const int st = S % GW_NS;
            gw_deq<DQ>(&sm.raw[st][GW_RW * R0], sh0f(S), p, t, sm.grid, ghl, w0);
            gw_deq<DQ>(&sm.raw[st][GW_RW * R1], sh1f(S), p, t, sm.grid, ghl, w1);
        } else {
            gw_deq_h<DQ, FD>(rw0, fs0, p, t, sm.grid, ghl, w0, dm0);
            gw_deq_h<DQ, FD>(rw1, fs1, p, t, sm.grid, ghl, w1, dm1);
        }
        gw_afrag(w0, w1, a);
    };
    const u64 xd0 = gw_desc(sx, 128u, 512u); // X slot 0: LBO next k group, SBO next 8 items

    GwAcc<N> acc, cc;
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc.v[i] = 0.0f, cc.v[i] = 0.0f;
    u32 a0[8], a1[8];
    // one group of raw 0 and chunks 0..3, one of raw 1 and chunks 4..7; wait for the first; group 2
    // (chunks 8..11) at chunk 0, raw 2 at chunk 4
    issue_raw(0);
    issue_x4(0);
    ds4_cp_commit();
    issue_raw(1);
    issue_x4(4);
    ds4_cp_commit();
    ds4_cp_wait<1>();
    gw_proxy_fence();
    __syncthreads();
    if (DQ >= 1) rows_of(0);
    if (FD) dm0 = gw_dm(&sm.raw[0][GW_RW * R0], sh0f(0)), dm1 = gw_dm(&sm.raw[0][GW_RW * R1], sh1f(0));
    decode(0, 0, a0);
    float D0 = gw_dscale(&sm.raw[0][GW_RW * R0], sh0f(0)), D1 = gw_dscale(&sm.raw[0][GW_RW * R1], sh1f(0));

    for (int S = 0; S < nsb; S++) {
#pragma unroll
        for (int p = 0; p < 8; p++) {
            const int c = 8 * S + p;
            u32* a = (p & 1) ? a1 : a0;  // this chunk's A registers
            u32* an = (p & 1) ? a0 : a1; // the next chunk's
            const u64 xd = gw_xdesc(xd0, c % NX); // this chunk's X slot
            if ((p & 3) == 0) { // group boundary: this group (chunks c .. c+3) has landed
                ds4_cp_wait<1>(); // chunks c+4 .. c+7 (and at p = 0 raw S+1) may stay in flight
                gw_proxy_fence();
                __syncthreads();
                issue_x4(c + 8); // the group after next, into group c/4 - 2's slots
                if (p == 4) issue_raw(S + 2);                  // into super-block S - 1's stage
                ds4_cp_commit();
            }
            gw_chunk<N, PL>(FD ? acc : cc, a, xd, FD ? c : p); // FD: zeroed at chunk 0 alone
            // The decode of chunk c + 1 (the next super-block's at p = 7).
            auto next = [&](u32* dst) {
                const int S1 = p == 7 ? S + 1 : S;
                if (DQ >= 1 && p == 7) rows_of(S1);
                if (FD && p == 7) {
                    dm0 = gw_dm(&sm.raw[S1 % GW_NS][GW_RW * R0], sh0f(S1));
                    dm1 = gw_dm(&sm.raw[S1 % GW_NS][GW_RW * R1], sh1f(S1));
                }
                decode(S1, (p + 1) & 7, dst);
                if (p == 7 && !FD) {
                    D0 = gw_dscale(&sm.raw[S1 % GW_NS][GW_RW * R0], sh0f(S1));
                    D1 = gw_dscale(&sm.raw[S1 % GW_NS][GW_RW * R1], sh1f(S1));
                }
            };
            // EARLY: chunk c + 1 is decoded into nx before the wait for chunk c - 1's wgmma (whose A
            // registers an it goes to), so the decode's load chains overlap that wgmma instead of
            // following it. 8 more live registers: below N = 80 (<= 128 a thread with N = 128's acc;
            // the unfolded forms' cc too: N <= 48, N = 64 spilled). Past the last chunk it decodes
            // stale stage words, never used (no branch, no selects).
            constexpr bool EARLY = N <= (FD ? 64 : 48);
            const bool sb_end = p == 7 && !FD;
            u32 nx[8];
            if (EARLY && !sb_end) next(nx);
            if (sb_end) { // end of the super-block: acc += (d / 8) cc
                gw_wait<0>();
                gw_pin(cc);
                gw_pin_a(a);
                gw_pin_a(an);
#pragma unroll
                for (int i = 0; i < N / 2; i++) acc.v[i] = fmaf((i & 2) ? D1 : D0, cc.v[i], acc.v[i]);
            } else {
                gw_wait<1>(); // chunk c - 1's group (registers an, X slot (c - 1) % NX) is done
                gw_pin_a(an);
            }
            if (EARLY && !sb_end) {
#pragma unroll
                for (int i = 0; i < 8; i++) an[i] = nx[i];
            } else if (c + 1 < nl) {
                next(an);
            }
        }
    }
    ds4_cp_wait<0>();
    if (FD) {
        gw_wait<0>();
        gw_pin(acc);
#pragma unroll
        for (int i = 0; i < N / 2; i++) acc.v[i] *= 0x1p-7f; // the weights were 128 x (16 d vs d / 8)
    }
    gw_store<N>(acc, items, xs, t, r0 + R0, rows, Y, y_tok, ctr, s_tile); // R1 = R0 + 8
}
#endif

#if defined(DS4_CUDA)
#define GW_B4 512, 1 // DS4_BOUNDS(GW_B4) = __launch_bounds__(512, 1): <= 128 registers
#else
#define GW_B4 512
#endif

#if GW_HAVE
// The grid as bytes and as f16 (bytes (b, 0x64) = f16 1024 + b, minus 1024: b exactly), the
// latter in GW_GHC copies (entry e of copy j at 8 e + j). Every thread; a barrier follows (gw_items).
template <int BN> __device__ __forceinline__ void gw_tables(GwSmem<BN>& sm) {
    for (int i = threadIdx.x; i < 256 * GW_GHC; i += blockDim.x) {
        const int e = i / GW_GHC;
        const u64 gv = ds4_iq2xxs_grid[e];
        if (i % GW_GHC == 0) sm.grid[e] = gv;
        const u32 lo = (u32)gv, hi = (u32)(gv >> 32);
        sm.gh[i] = make_uint4(ds4_hsub2(ds4_prmt(lo, 0x64646464u, 0x4140u), 0x64006400u),
                              ds4_hsub2(ds4_prmt(lo, 0x64646464u, 0x4342u), 0x64006400u),
                              ds4_hsub2(ds4_prmt(hi, 0x64646464u, 0x4140u), 0x64006400u),
                              ds4_hsub2(ds4_prmt(hi, 0x64646464u, 0x4342u), 0x64006400u));
    }
}
// One tile: item run by (BM: 64, or the wide runs of 128), row tile bx, gate (z 0) or up (1),
// the product with N = the run's valid items rounded up to 16. FD: gw_body's folded form.
template <int NWG, int PL, int DQ, int BM, int FD>
__device__ __forceinline__ void gw_tile(GwSmem<64 * NWG>& sm, int* items, float* xs, int* expert, int bx, int by, int z,
                                        const u8* __restrict__ W0, const u8* __restrict__ W1, long long slab,
                                        const int* __restrict__ sel, const u32* __restrict__ XW,
                                        const float* __restrict__ xinv, int xdiv, float* __restrict__ Y0,
                                        float* __restrict__ Y1, long long y_tok, int rows, int cols, long long row_bytes,
                                        int n, const int* __restrict__ grp, int gmax, int smax, u32* ctr = nullptr,
                                        int* s_tile = nullptr) {
    // Runs of at most smax pairs belong to moe.cu's m3gus_iq2_xxs (launched beside): skipped here. The
    // persistent form draws its next tile (after a barrier: the loop's reads of s_tile are done).
    if (smax > 0 && gw_run_len<BM>(grp, n, gmax, by) <= smax) {
        if (ctr) {
            __syncthreads();
            if (threadIdx.x == 0) *s_tile = (int)atomicAdd(ctr, 1u);
        }
        return;
    }
    const int nv = gw_items<BM>(grp, sel, n, gmax, items, expert, xinv, xdiv, xs, by); // valid items (a prefix of the tile)
    const int ex = *expert;
    const u8* W = z ? W1 : W0;
    float* Y = z ? Y1 : Y0;
#define GW_BODY(NN) gw_body<NN, NWG, PL, DQ, BM, FD>(sm, items, ex, W, Y, XW, xs, xdiv, slab, y_tok, rows, cols, row_bytes, bx, ctr, s_tile)
    if (BM > GW_BM && nv > 64) {
        if (nv <= 80) GW_BODY(80);
        else if (nv <= 96) GW_BODY(96);
        else if (nv <= 112) GW_BODY(112);
        else GW_BODY(128);
    } else if (nv <= 16) GW_BODY(16);
    else if (nv <= 32) GW_BODY(32);
    else if (nv <= 48) GW_BODY(48);
    else GW_BODY(64);
#undef GW_BODY
}
// The kernels' shared part: one tile a CTA (blockIdx: row tile, run, gate / up).
template <int NWG, int PL, int DQ, int BM = GW_BM, int FD = 0>
__device__ __forceinline__ void gw_kernel(const u8* __restrict__ W0, const u8* __restrict__ W1, long long slab,
                                          const int* __restrict__ sel, const u32* __restrict__ XW,
                                          const float* __restrict__ xinv, int xdiv, float* __restrict__ Y0,
                                          float* __restrict__ Y1, long long y_tok, int rows, int cols, long long row_bytes,
                                          int n, const int* __restrict__ grp, int gmax, int smax) {
    extern __shared__ uint4 gw_dyn[];
    GwSmem<64 * NWG>& sm = *reinterpret_cast<GwSmem<64 * NWG>*>(gw_dyn);
    __shared__ int items[BM];
    __shared__ float xs[BM]; // the items' row scales (gw_items)
    __shared__ int expert;
    if ((int)blockIdx.y >= (BM == GW_BM ? grp[0] : grp[1 + gmax + n])) return; // uniform over the CTA (wide: ngroups2)
    gw_tables(sm);
    gw_tile<NWG, PL, DQ, BM, FD>(sm, items, xs, &expert, blockIdx.x, blockIdx.y, blockIdx.z, W0, W1, slab, sel, XW, xinv,
                                 xdiv, Y0, Y1, y_tok, rows, cols, row_bytes, n, grp, gmax, smax);
}
// The persistent form of the folded wide gate/up (wgmma.cuh gw_first_tile): tiles t < ngroups2 * 2 * TX
// (TX = the row tiles): run t / (2 TX), then gate (z 0) or up of row tile t % TX, so the gate
// and up tiles of a run follow each other (its X rows stay in L2).
__device__ __forceinline__ void gw_kernel_p(const u8* __restrict__ W0, const u8* __restrict__ W1, long long slab,
                                            const int* __restrict__ sel, const u32* __restrict__ XW,
                                            const float* __restrict__ xinv, int xdiv, float* __restrict__ Y0,
                                            float* __restrict__ Y1, long long y_tok, int rows, int cols, long long row_bytes,
                                            int n, const int* __restrict__ grp, int gmax, int smax, u32* ctr) {
    extern __shared__ uint4 gw_dyn[];
    GwSmem<256>& sm = *reinterpret_cast<GwSmem<256>*>(gw_dyn);
    __shared__ int items[2 * GW_BM];
    __shared__ float xs[2 * GW_BM];
    __shared__ int expert, s_tile;
    const int tx = (rows + 255) / 256, tiles = grp[1 + gmax + n] * 2 * tx;
    gw_tables(sm);
    gw_first_tile(ctr, &s_tile);
    for (;;) {
        __syncthreads(); // s_tile drawn; the previous tile's reads of items / xs / the stages done
        const int tt = s_tile;
        if (tt >= tiles) break; // uniform over the CTA
        const int r = tt % (2 * tx);
        gw_tile<4, 1, 2, 2 * GW_BM, 1>(sm, items, xs, &expert, r % tx, tt / (2 * tx), r / tx, W0, W1, slab, sel, XW, xinv,
                                       xdiv, Y0, Y1, y_tok, rows, cols, row_bytes, n, grp, gmax, smax, ctr, &s_tile);
    }
    gw_leave(ctr);
}
#endif

#define GW_PARAMS                                                                                                    \
    const u8 *__restrict__ W0, const u8 *__restrict__ W1, long long slab, const int *__restrict__ sel,              \
        const u32 *__restrict__ XW, const float *__restrict__ xinv, int xdiv, float *__restrict__ Y0,                \
        float *__restrict__ Y1, long long y_tok, int rows, int cols, long long row_bytes, int n,                     \
        const int *__restrict__ grp, int gmax, int smax
#define GW_ARGS W0, W1, slab, sel, XW, xinv, xdiv, Y0, Y1, y_tok, rows, cols, row_bytes, n, grp, gmax, smax
#if GW_HAVE
#define GW_RUN(PL, DQ) gw_kernel<4, PL, DQ>(GW_ARGS)
#define GW_RUN_F(BM) gw_kernel<4, 1, 2, BM, 1>(GW_ARGS)
#else
#define GW_RUN_F(BM) GW_RUN(1, 2)
#define GW_RUN(PL, DQ) (void)W0, (void)W1, (void)slab, (void)sel, (void)XW, (void)xinv, (void)xdiv, (void)Y0, (void)Y1, \
    (void)y_tok, (void)rows, (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax, (void)smax
#endif

// gate (blockIdx.z 0: W0 -> Y0) and up (1: W1 -> Y1) of the grouped pairs: grid (rows / 256, gmax,
// 2), 512 threads (4 warpgroups, 256 weight rows: 1 CTA per SM), dynamic shared memory
// sizeof(GwSmem<256>) (222 KiB). W_z + expert * slab: the expert's rows (row_bytes apart, cols /
// 256 blocks of 66 bytes); XW, xinv: gwg_x_f32 of the token rows (pair i reads token i / xdiv);
// Y_z[i * y_tok + r]. grp: gm_group_*_i32 with runs of at most 64 ([ngroups, starts[gmax],
// perm[n]]). cols % 256 == 0. H200: bench/results/gpu-gemm-w15-h200.txt.
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs(GW_PARAMS) { GW_RUN(2, 0); }
// The same with X's hi plane alone (one f16 rounding of v, ~2^-11 per element; the lo plane of
// gwg_x_f32 unread or unwritten): DS4_GPU_GEMM_PLANES=1 (gemm_wg.rs; --precision fast).
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_p1(GW_PARAMS) { GW_RUN(1, 0); }
// Decode form 2 (gw_deq; same bits as 0), the default (gemm_wg.rs DS4_GPU_GW_DQ).
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_d2(GW_PARAMS) { GW_RUN(2, 2); }
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_p1_d2(GW_PARAMS) { GW_RUN(1, 2); }
// Folded forms (DS4_GPU_GW_WIDE=3, 4; gw_body FD: the super-block scale in the f16 weights, one
// accumulator set): 4 warpgroups, 256 weight rows, grid and shared memory as gwg_iq2_xxs_p1_d2;
// _f the runs of 64, _fw the wide runs of 128 (N up to 128 in <= 128 registers: acc alone).
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_p1_d2_f(GW_PARAMS) { GW_RUN_F(GW_BM); }
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_p1_d2_fw(GW_PARAMS) { GW_RUN_F(2 * GW_BM); }
// Its persistent form (gw_kernel_p; gemm_wg.rs DS4_GPU_GW_PERSIST): grid (CTAs, 1, 1), one an SM;
// ctr: two words, zero between launches (the kernel leaves them so).
DS4_KERNEL void DS4_BOUNDS(GW_B4) gwg_iq2_xxs_p1_d2_fwp(GW_PARAMS, u32* ctr) {
#if GW_HAVE
    gw_kernel_p(GW_ARGS, ctr);
#else
    GW_RUN(1, 2), (void)ctr;
#endif
}

// X rows for gwg_iq2_xxs: one CTA (128 threads) per token row t < gridDim.x; width % 32 == 0, X
// 16-byte aligned, x_tok % 4 == 0. v = x * 2^s (s as gemm_xt_f32: max |v| < 2^15), xinv[t] = 2^-s;
// chunk c (32 elements) of row t -> the 32 words xw[t * width + 32 c ..]: hi plane words 0..15, lo
// plane 16..31 (lo = f16(v - hi)); word 4 kg + w of a plane = f16x2 of elements (8w + 2kg, +1),
// i.e. 16-byte piece kg holds the k group kg of the wgmma K order (header). lo == 0: the lo plane
// is not written (the one-plane kernels never read it).
// ONE (gwg_x1_f32, the default: gemm_wg.rs DS4_GPU_GWX_ONE): rows of at most 128 chunks (the
// model's 4096) in one pass, thread c's chunk loaded once into registers for both the maximum
// and the conversion; the two-pass form (gwg_x_f32) reads the row twice (38 us a 2k call on an
// H100, 1.28 TB/s: bench/results/gpu-s52-h100.txt run B; one pass: 31.0 against 40.1 us under
// ncu, with hcp_finish's one-pass z prefill +0.3% / +0.2% at 2k / 8k: gpu-s57-h100.txt). The
// maximum is order-free: same bits.
template <bool ONE>
__device__ __forceinline__ void gwg_x_body(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xw,
                                           float* __restrict__ xinv, int lo) {
#if GW_HAVE
    __shared__ float red[128 / DS4_WARP];
    const int tid = threadIdx.x;
    const float4* p = (const float4*)(X + (long long)blockIdx.x * x_tok);
    const bool one = ONE && width / 32 <= 128;
    float4 f[8];
    float m = 0.0f;
    if (one) {
        if (tid < width / 32) {
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = p[8 * tid + i];
#pragma unroll
            for (int i = 0; i < 8; i++)
                m = fmaxf(m, fmaxf(fmaxf(fabsf(f[i].x), fabsf(f[i].y)), fmaxf(fabsf(f[i].z), fabsf(f[i].w))));
        }
    } else {
        for (int i = tid; i < width / 4; i += 128) {
            const float4 v = p[i];
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    }
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
    if (tid % DS4_WARP == 0) red[tid / DS4_WARP] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < 128 / DS4_WARP; i++) m = fmaxf(m, red[i]);
    const int e = (int)((__float_as_int(m) >> 23) & 0xff) - 126;
    const int sh = min(max(15 - e, -126), 126);
    const float sc = __int_as_float((sh + 127) << 23);
    if (tid == 0) xinv[blockIdx.x] = __int_as_float((127 - sh) << 23);
    u32* o = xw + (long long)blockIdx.x * width;
    for (int c = tid; c < width / 32; c += 128) { // one pass: c = tid, one round
        float v[32];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float4 g = one ? f[i] : p[8 * c + i];
            v[4 * i] = g.x * sc, v[4 * i + 1] = g.y * sc, v[4 * i + 2] = g.z * sc, v[4 * i + 3] = g.w * sc; // exact
        }
        u32 hw[16], lw[16];
#pragma unroll
        for (int qq = 0; qq < 16; qq++) { // elements 2qq, 2qq + 1 = (8w + 2kg, +1): w = qq / 4, kg = qq % 4
            const float a = v[2 * qq], b = v[2 * qq + 1];
            const int k = 4 * (qq & 3) + (qq >> 2);
            ds4_f16x2_split(a, b, hw[k], lw[k]);
        }
        uint4* d = (uint4*)(o + 32 * c);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            d[i] = make_uint4(hw[4 * i], hw[4 * i + 1], hw[4 * i + 2], hw[4 * i + 3]);
            if (lo) d[4 + i] = make_uint4(lw[4 * i], lw[4 * i + 1], lw[4 * i + 2], lw[4 * i + 3]);
        }
    }
#else
    (void)X, (void)x_tok, (void)width, (void)xw, (void)xinv, (void)lo;
#endif
}
DS4_KERNEL void DS4_BOUNDS(128) gwg_x_f32(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xw,
                                          float* __restrict__ xinv, int lo) {
    gwg_x_body<false>(X, x_tok, width, xw, xinv, lo);
}
DS4_KERNEL void DS4_BOUNDS(128) gwg_x1_f32(const float* __restrict__ X, long long x_tok, int width, u32* __restrict__ xw,
                                           float* __restrict__ xinv, int lo) {
    gwg_x_body<true>(X, x_tok, width, xw, xinv, lo);
}
