// Hopper wgmma form of the MoE's Q2_K down at prefill (sm_90a only; the host launches it only
// there, elsewhere the kernel compiles to an empty body). Same contract and arguments as
// gemmu_q2_k (gemm.cu GMT_PARAMS) for grouped products without split K:
//
//   Y[item][r] = W[expert][r] · X[item / xdiv]
//
// for the pairs grouped by expert (gm_group_*_i32, runs cut at 64).
//
// Arithmetic (gemmu_q2_k's): per 16-element sub-block j of a 256-element super-block,
//   w = d * [sl_j * q] - dmin * m_j                      (sl_j * q <= 45: exact in f16)
// X from gemm_xt_f32 (unit layout, unit != 0): v = x * 2^s per token row as f16 hi/lo, and per
// super-block the 16 sums S_j / 16 (hi/lo f16). Per super-block and row:
//   acc += d * sum_k (sl q)_k v_k  -  dmin * sum_j (16 m_j) (S_j / 16)
// both sums by tensor cores (f32 accumulation), the row scale 2^-s at the store.
//
// Tensor cores: wgmma.mma_async m64nNk16 f16 -> f32 with the WEIGHTS AS A (64 weight rows, from
// registers) and X AS B (N items from shared memory by descriptor), as gemm_wg.cu's gwg_iq2_xxs.
// N = 16, 32, 48 or 64: the CTA's valid items rounded up to 16. CTA: 4 warpgroups (512 threads),
// 256 weight rows (warpgroup h: rows 64h..), 1 CTA per SM.
// A fragment (per warp, as mma.m16n8k16): lane (g, t) of warp q holds rows 16q + g (+8), columns
// {2t, 2t+1 | 2t+8, 2t+9} of each k-step. gemm_xt_f32's unit layout puts elements 8t + 4kk +
// {0, 1 | 2, 3} of a 32-element chunk at those columns of k-step kk (16-byte unit 4 kk + c, c =
// hi01, hi23, lo01, lo23, word t: component c of the 4 elements 8t + 4kk ..), so each unit is one
// core-matrix row (8 k-values of one item) and each lane decodes the 8 consecutive weights
// 8t .. 8t+7 of a row per chunk: 2 q words and 1 scale byte (one sub-block), sl q by one PRMT
// and one HFMA2 a pair (gemmu's (1024 + q 4^j) (sl 4^-j) - 1024 sl 4^-j, exact).
// X in shared memory (per chunk slot, per plane hi/lo): no-swizzle K-major core matrices of 8 items
// x 8 halves (128 bytes), core (item group ig, k group kg = 2 kk + (c & 1)) at 128 (4 ig + kg):
// descriptor start = plane + 256 kk, LBO 128 bytes (next k group), SBO 512 (next 8 items).
// Sums (per super-block stage, per plane): core (ig, kg = 16-byte piece & 1) at 128 (2 ig + kg):
// LBO 128, SBO 256; the min term is one m64nNk16 pair (hi, lo) with A = 16 m_j (k = j).
// Pipeline (gwg_iq2_xxs's "burst" form): per chunk c the 4 wgmma (2 k-steps x hi/lo into cc, the
// super-block's first with scale-d 0) committed, then wait for chunk c-1's group and decode chunk
// c+1 into the other A register set (the folded wide form at N <= 64: decode first, as gemm_wg.cu). At a super-block's end: wait all, acc += d cc, then the min
// pair into cc (scale-d 0) while the lane decodes the next chunk, wait, acc -= dmin cc (cc reused:
// 2 accumulators, not 3, within the 128 registers of 512 threads). X by cp.async 16-byte in
// groups of 4 chunks (16 slots), raw 84-byte blocks (6 16-byte pieces a row: gw_stage_blocks) and the sums
// of the next super-block by cp.async at the super-block's first chunk into 2 stages; one
// cp.async wait + fence.proxy.async + barrier per group. A deeper form (3 raw / sums stages,
// cp.async.wait_group 1: 8 chunks of X prefetch) measured 1.1-1.4 % slower (routed experts) and
// 0.6 % slower end to end: bench/results/gpu-gemm-e16-h200.txt, code in 11a89c4.
// One-plane form (PL = 1: gwd_q2_k_p1, DS4_GPU_GEMM_PLANES=1, --precision fast): X and the sums as their hi
// planes alone (one f16 rounding, ~2^-11 relative per element and per S_j / 16): 2 wgmma a chunk,
// one for the min term, only the hi units and sums copied (gemm_xt_f32's lo words unread; same
// shared layout). H200, n = 2048 (ncu): 1.67 -> 1.26 ms (bench/results/gpu-gemm-q17-h200.txt).
#include "prelude.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

#define GWD_NX 16 // X chunk slots: 4 groups of 4 chunks
#define GWD_RW 28 // raw words per row and stage: an 84-byte Q2_K block from the 16-byte boundary below it
                  // (96 bytes used; 28, not 24: the 8 rows of a warp's scale loads on 8 banks)
#define GWD_RP 6  // its 16-byte pieces (the block starts at byte o in {0, 4, 8, 12} of them: o + 84 <= 96)

#if GW_HAVE
// Dynamic shared memory of a CTA of BN weight rows (the host passes sizeof: gemm_wgd.rs WGD_SMEM).
template <int BN> struct alignas(16) GwdSmem {
    uint4 x[GWD_NX][2][GW_BM * 4]; // X chunk slots: plane (hi, lo), core matrices (above)
    uint4 s[2][2][GW_BM * 2];      // super-block sums: stage, plane (hi, lo), core matrices
    u32 raw[2][BN * GWD_RW];        // raw super-blocks, row r at 28 r (the block from word o / 4)
};
static_assert(sizeof(GwdSmem<256>) == 196608, "gemm_wgd.rs WGD_SMEM");

// Word of a row's staged block S (a16: the row's address mod 16; 84 S = 4 S mod 16).
__device__ __forceinline__ int gwd_ow(u32 a16, int S) { return (int)(((a16 + 4u * (u32)S) & 15u) >> 2); }

// Weights 8t .. 8t+7 of chunk P (a constant once the chunk loop is unrolled) of a row's staged
// block rb as 4 f16x2 words (elements (0,1), (2,3), (4,5), (6,7)), each the exact integer sl * q.
__device__ __forceinline__ void gwd_deq(const u32* rb, int P, int t, u32* w) {
    const int n = P >> 2, j = P & 3;
    const u32 e1 = (u32)(15 - 2 * j) << 10;                           // f16 4^-j
    const u32 sl = (rb[P >> 1] >> (8 * (2 * (P & 1) + (t >> 1)))) & 15u; // scale byte 2P + t/2
    const u32 s2 = ds4_hmul2(ds4_hsub2((sl | (sl << 16)) | 0x64006400u, 0x64006400u), e1 | (e1 << 16)); // sl 4^-j
    const u32 c2 = ds4_hmul2(s2, 0xe400e400u);                                                       // -1024 sl 4^-j
    const u32 msk = 0x03030303u << (2 * j);
    const u32 qa = rb[4 + 8 * n + 2 * t] & msk, qb = rb[5 + 8 * n + 2 * t] & msk; // bytes 8t .. 8t+7 of qs[32n ..]
    // bytes (b, 0x64): f16 1024 + q 4^j; times sl 4^-j minus 1024 sl 4^-j = sl q exactly
    w[0] = ds4_hfma2(ds4_prmt(qa, 0x64646464u, 0x4140u), s2, c2);
    w[1] = ds4_hfma2(ds4_prmt(qa, 0x64646464u, 0x4342u), s2, c2);
    w[2] = ds4_hfma2(ds4_prmt(qb, 0x64646464u, 0x4140u), s2, c2);
    w[3] = ds4_hfma2(ds4_prmt(qb, 0x64646464u, 0x4342u), s2, c2);
}

// 16 m_j of sub-blocks (2t, 2t+1) (h = 0) or (2t+8, 2t+9) (h = 1) of a row's staged block as f16x2.
__device__ __forceinline__ u32 gwd_min(const u32* rb, int t, int h) {
    const u32 v = (rb[2 * h + (t >> 1)] >> (16 * (t & 1))) & 0xffffu;
    return ds4_hsub2(((v & 0xf0u) | ((v & 0xf000u) << 8)) | 0x64006400u, 0x64006400u);
}

// One CTA's product with N (16, 32, 48, 64) item columns; items[] (-1: none) and the expert set
// by the caller. Rows r0 + 64 h + 16 q + g (+8) per lane (warpgroup h, warp q of it).
template <int N, int PL>
__device__ __forceinline__ void gwd_body(GwdSmem<256>& sm, const int* items, int expert, const u8* __restrict__ W,
                                         long long slab, const u32* __restrict__ XT, const u32* __restrict__ XS,
                                         const float* xs, long long x_tok, int xdiv,
                                         float* __restrict__ Y, long long y_tok, int rows, int cols,
                                         long long row_bytes, int bx) {
    constexpr int NT = 512, BN = 256;
    const int tid = threadIdx.x, h = tid >> 7, q = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = bx * BN;
    const u8* wbase = W + (long long)expert * slab;
    const int nl = cols / 32, nsb = nl / 8;
    const u32 sx = (u32)__cvta_generic_to_shared(&sm.x[0][0][0]);
    const u32 ss = (u32)__cvta_generic_to_shared(&sm.s[0][0][0]);
    const u32 sr = (u32)__cvta_generic_to_shared(&sm.raw[0][0]);
    // X copies: thread -> item xm = tid / 8, unit u = tid % 8 (= 4 kk + c) of the item's chunk to
    // plane c / 2, k group 2 kk + c % 2, row xm % 8 of item group xm / 8 (PL == 1: c < 2 only).
    const int xm = tid >> 3, xu = tid & 7;
    const int xit = xm < N ? items[xm] : -1;
    // An absent item reads nothing (src-size 0) at row 0's address (in bounds: 32 c + 4 xu < cols).
    const u32* xsrc = XT + (long long)(xit >= 0 ? xit / xdiv : 0) * x_tok + 4 * xu;
    const int xn = xit >= 0 ? 16 : 0;
    const u32 xdst = sx + (u32)(((xu >> 1) & 1) * 4096 + ((4 * (xm >> 3) + 2 * (xu >> 2) + (xu & 1)) * 8 + (xm & 7)) * 16);
    // Chunks c0 .. c0 + 3 (c0 % 4 == 0, nl % 8 == 0: all below nl or none; 4 consecutive slots).
    auto issue_x4 = [&](int c0) {
        if (c0 < nl && xm < N && (PL == 2 || !(xu & 2))) {
            const u32 so = xdst + (u32)(c0 % GWD_NX) * 8192u;
#pragma unroll
            for (int i = 0; i < 4; i++) ds4_cp16n(so + 8192u * (u32)i, xsrc + 32LL * (c0 + i), xn);
        }
    };
    // Sums copies: thread < 4 N -> item sm_ = tid / 4, 16-byte piece sp = tid % 4 (plane sp / 2,
    // k group sp % 2) of the item's 16 sum words of super-block S (PL == 1: sp < 2 only).
    const int sm_ = tid >> 2, sp = tid & 3;
    const int sit = sm_ < N ? items[sm_] : -1;
    const u32* ssrc = XS + (long long)(sit >= 0 ? sit / xdiv : 0) * (x_tok / 16) + 4 * sp; // absent: row 0, 0 bytes
    const u32 sdst = ss + (u32)((sp >> 1) * 2048 + ((2 * (sm_ >> 3) + (sp & 1)) * 8 + (sm_ & 7)) * 16);
    // Raw super-block S of each of the BN rows (rows past `rows` repeat the last) and its sums
    // into stage S % 2.
    auto issue_raw = [&](int S) {
        if (S < nsb) {
            gw_stage_blocks<BN, NT, 84, GWD_RW, GWD_RP>(sr + (u32)(S & 1) * (u32)(BN * GWD_RW * 4), wbase, r0, rows, row_bytes, S);
            if (sm_ < N && (PL == 2 || sp < 2)) ds4_cp16n(sdst + (u32)(S & 1) * 4096u, ssrc + 16LL * S, sit >= 0 ? 16 : 0);
        }
    };
    const int R0 = 64 * h + 16 * q + g, R1 = R0 + 8;
    const u32 a16_0 = (u32)((size_t)(wbase + (long long)min(r0 + R0, rows - 1) * row_bytes) & 15);
    const u32 a16_1 = (u32)((size_t)(wbase + (long long)min(r0 + R1, rows - 1) * row_bytes) & 15);
    // A registers of chunk p of super-block S: k-step kk at a[4kk ..]: (R0, R1, R0, R1) x element
    // pairs (8t + 4kk, +1), (+2, +3).
    auto decode = [&](int P, int S, u32* a) {
        u32 w0[4], w1[4];
        gwd_deq(&sm.raw[S & 1][GWD_RW * R0 + gwd_ow(a16_0, S)], P, t, w0);
        gwd_deq(&sm.raw[S & 1][GWD_RW * R1 + gwd_ow(a16_1, S)], P, t, w1);
        gw_afrag(w0, w1, a);
    };
    const u64 xd0 = gw_desc(sx, 128u, 512u); // X slot 0: LBO next k group, SBO next 8 items

    GwAcc<N> acc, cc;
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc.v[i] = 0.0f, cc.v[i] = 0.0f;
    u32 a0[8], a1[8];
    // raw 0 and X groups 0, 1 (chunks 0..7); raw 1 and group 2 at chunk 0
    issue_raw(0);
    issue_x4(0);
    issue_x4(4);
    ds4_cp_commit();
    ds4_cp_wait<0>();
    gw_proxy_fence();
    __syncthreads();
    decode(0, 0, a0);

    for (int S = 0; S < nsb; S++) {
        const u32* rb0 = &sm.raw[S & 1][GWD_RW * R0 + gwd_ow(a16_0, S)];
        const u32* rb1 = &sm.raw[S & 1][GWD_RW * R1 + gwd_ow(a16_1, S)];
#pragma unroll
        for (int p = 0; p < 8; p++) {
            const int c = 8 * S + p;
            u32* a = (p & 1) ? a1 : a0;  // this chunk's A registers
            u32* an = (p & 1) ? a0 : a1; // the next chunk's
            const u64 xd = gw_xdesc(xd0, c % GWD_NX); // this chunk's X slot
            if ((p & 3) == 0) { // group boundary: the next group has landed (nothing else in flight)
                ds4_cp_wait<0>();
                gw_proxy_fence();
                __syncthreads();
                issue_x4(c + 8); // the group after next
                if (p == 0) issue_raw(S + 1);                  // into super-block S - 1's stage
                ds4_cp_commit();
            }
            gw_chunk<N, PL>(cc, a, xd, p);
            if (p == 7) { // end of the super-block: acc += d cc, then the min pair into cc
                gw_wait<0>();
                gw_pin(cc);
                gw_pin_a(a);
                gw_pin_a(an);
                const u32 dd0 = rb0[20], dd1 = rb1[20]; // (d, dmin) of rows R0, R1
#pragma unroll
                for (int i = 0; i < N / 2; i++) acc.v[i] = fmaf(ds4_h2f_fast(((i & 2) ? dd1 : dd0) & 0xffffu), cc.v[i], acc.v[i]);
                u32 am[8] = {gwd_min(rb0, t, 0), gwd_min(rb1, t, 0), gwd_min(rb0, t, 1), gwd_min(rb1, t, 1), 0u, 0u, 0u, 0u}; // A = 16 m_j (4 used; 8 for gw_pin_a)
                const u32 sb = ss + (u32)(S & 1) * 4096u;
                gw_pin(cc);
                gw_fence();
                gw_mma(cc, am, gw_desc(sb, 128u, 256u), 0);         // hi sums (zeroes cc)
                if (PL == 2) gw_mma(cc, am, gw_desc(sb + 2048u, 128u, 256u), 1); // lo sums
                gw_commit();
                gw_pin(cc);
                if (S + 1 < nsb) decode(0, S + 1, an);
                gw_wait<0>();
                gw_pin(cc);
                gw_pin_a(am);
                gw_pin_a(an);
#pragma unroll
                for (int i = 0; i < N / 2; i++) acc.v[i] = fmaf(-ds4_h2f_fast(((i & 2) ? dd1 : dd0) >> 16), cc.v[i], acc.v[i]);
            } else {
                gw_wait<1>(); // chunk c - 1's group (registers an, X slot (c - 1) % NX) is done
                gw_pin_a(an);
                decode(p + 1, S, an);
            }
        }
    }
    ds4_cp_wait<0>();
    gw_store<N>(acc, items, xs, t, r0 + R0, rows, Y, y_tok); // R1 = R0 + 8
}
#endif

#if GW_HAVE
// ---- Folded wide form (gwd_q2_k_p1_fw; gemm_wgd.rs DS4_GPU_GWD_WIDE, one plane only) ----
// Runs of up to 128 pairs of one expert a CTA (the grouping's wide runs, as gwg_iq2_xxs_p1_d2_fw)
// with ONE accumulator set: the super-block scales are folded into the f16 weights,
//   w' = f16(q s2),  s2 = f16(sl (F d))      (two f16 roundings, ~2^-11 relative each; F = 4)
// by one PRMT + one HFMA2 a pair: the PRMT builds f16 2^(10-2j) + q from the masked byte q 4^j
// (exponent byte 0x64 - 8 j: the byte's bits land 2j places lower than gwd_deq's 1024 + q 4^j),
// and (2^(10-2j) + q) s2 - 2^(10-2j) s2 = q s2 with the bias term exact (a power-of-two multiple
// of s2). The min term's A = f16(16 m_j (-F dmin)) (one rounding), so the min wgmma accumulates
// into acc too: no cc, no wait-for-all and acc += d cc / acc -= dmin cc per super-block, and N up
// to 128 fits 4 warpgroups in 128 registers (acc 64). acc / F at the store. Range: s2 is a normal
// f16 for |d| >= 2^-14 / F = 1.5e-5 (smaller d: subnormal s2, coarser weights, never inf), and
// 1024 s2 < 65504 for |d| < 64 / (15 F) = 1.07 and 16 m F |dmin| < 65504 for |dmin| < 68 (real
// Q2_K blocks of a model's weights: |d| ~ 1e-3..1e-2). Three raw / sums stages (not two): the min
// wgmma of super-block S is waited one chunk later (the pipeline's wait_group 1), so the stage it
// reads is refilled only at S + 2's first chunk, behind a barrier.
#define GWD_F 4.0f
#define GWD_NSW 3
template <int BN> struct alignas(16) GwdSmemW {
    uint4 x[GWD_NX][2][GW_BM * 4]; // X chunk slots: 128 items' hi units (items 64.. where lo was)
    uint4 s[GWD_NSW][GW_BM * 4];   // super-block sums, hi plane, 128 items (core (ig, kg) at 128 (2 ig + kg))
    u32 raw[GWD_NSW][BN * GWD_RW]; // raw super-blocks, row r at 28 r (the block from word o / 4)
};
static_assert(sizeof(GwdSmemW<256>) == 229376, "gemm_wgd.rs WGD_SMEM_W");

// gwd_deq with the super-block scale folded (above): s2 = f16(sl fd), fd = f16x2 (F d) (exact).
__device__ __forceinline__ void gwd_deq_f(const u32* rb, int P, int t, u32 fd, u32* w) {
    const int n = P >> 2, j = P & 3;
    const u32 sl = (rb[P >> 1] >> (8 * (2 * (P & 1) + (t >> 1)))) & 15u; // scale byte 2P + t/2
    const u32 s2 = ds4_hmul2(ds4_hsub2((sl | (sl << 16)) | 0x64006400u, 0x64006400u), fd); // sl F d, one rounding
    const u32 eb = 0x64u - 8u * (u32)j, bias = eb * 0x01010101u;                          // f16 2^(10-2j) + q
    const u32 c2 = ds4_hmul2(s2, (((0x80u | eb) << 8) | ((0x80u | eb) << 24)));          // -2^(10-2j) s2: exact
    const u32 msk = 0x03030303u << (2 * j);
    const u32 qa = rb[4 + 8 * n + 2 * t] & msk, qb = rb[5 + 8 * n + 2 * t] & msk;
    w[0] = ds4_hfma2(ds4_prmt(qa, bias, 0x4140u), s2, c2);
    w[1] = ds4_hfma2(ds4_prmt(qa, bias, 0x4342u), s2, c2);
    w[2] = ds4_hfma2(ds4_prmt(qb, bias, 0x4140u), s2, c2);
    w[3] = ds4_hfma2(ds4_prmt(qb, bias, 0x4342u), s2, c2);
}
// f16x2 (F d, F d) and (-F dmin, -F dmin) of a row's staged block (word 20: d, dmin); F = 4.
__device__ __forceinline__ u32 gwd_fd(const u32* rb) { return ds4_hmul2((rb[20] & 0xffffu) * 0x10001u, 0x44004400u); }
__device__ __forceinline__ u32 gwd_fm(const u32* rb) { return ds4_hmul2((rb[20] >> 16) * 0x10001u, 0xc400c400u); }

template <int N>
__device__ __forceinline__ void gwd_body_fw(GwdSmemW<256>& sm, const int* items, int expert, const u8* __restrict__ W,
                                            long long slab, const u32* __restrict__ XT, const u32* __restrict__ XS,
                                            const float* xs, long long x_tok, int xdiv,
                                            float* __restrict__ Y, long long y_tok, int rows, int cols,
                                            long long row_bytes, int bx, u32* ctr = nullptr, int* s_tile = nullptr) {
    constexpr int NT = 512, BN = 256;
    const int tid = threadIdx.x, h = tid >> 7, q = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = bx * BN;
    const u8* wbase = W + (long long)expert * slab;
    const int nl = cols / 32, nsb = nl / 8;
    const u32 sx = (u32)__cvta_generic_to_shared(&sm.x[0][0][0]);
    const u32 ss = (u32)__cvta_generic_to_shared(&sm.s[0][0]);
    const u32 sr = (u32)__cvta_generic_to_shared(&sm.raw[0][0]);
    // X copies: thread -> item xm = tid / 4, hi unit xu = 4 (v >> 1) + (v & 1) (v = tid % 4: units
    // 0, 1, 4, 5 = hi01 / hi23 of k-steps 0, 1) to core (4 (xm / 8) + 2 kk + c), row xm % 8: the
    // hi plane of 128 items fills the 8 KiB slot (SBO 512 spans 16 item groups).
    const int xm = tid >> 2, xv = tid & 3, xu = 4 * (xv >> 1) + (xv & 1);
    const int xit = xm < N ? items[xm] : -1;
    const u32* xsrc = XT + (long long)(xit >= 0 ? xit / xdiv : 0) * x_tok + 4 * xu; // absent: row 0, read 0 bytes
    const int xn = xit >= 0 ? 16 : 0;
    const u32 xdst = sx + (u32)(((4 * (xm >> 3) + 2 * (xu >> 2) + (xu & 1)) * 8 + (xm & 7)) * 16);
    auto issue_x4 = [&](int c0) { // as gwd_body's
        if (c0 < nl && xm < N) {
            const u32 so = xdst + (u32)(c0 % GWD_NX) * 8192u;
#pragma unroll
            for (int i = 0; i < 4; i++) ds4_cp16n(so + 8192u * (u32)i, xsrc + 32LL * (c0 + i), xn);
        }
    };
    // Sums copies: thread < 2 N -> item sm_ = tid / 2, hi piece sp = tid % 2 (k group) of the item's
    // sums of super-block S.
    const int sm_ = tid >> 1, sp = tid & 1;
    const int sit = sm_ < N ? items[sm_] : -1;
    const u32* ssrc = XS + (long long)(sit >= 0 ? sit / xdiv : 0) * (x_tok / 16) + 4 * sp; // absent: row 0, 0 bytes
    const u32 sdst = ss + (u32)(((2 * (sm_ >> 3) + sp) * 8 + (sm_ & 7)) * 16);
    auto issue_raw = [&](int S) {
        if (S < nsb) {
            const int st = S % GWD_NSW;
            gw_stage_blocks<BN, NT, 84, GWD_RW, GWD_RP>(sr + (u32)st * (u32)(BN * GWD_RW * 4), wbase, r0, rows, row_bytes, S);
            if (sm_ < N) ds4_cp16n(sdst + (u32)st * 4096u, ssrc + 16LL * S, sit >= 0 ? 16 : 0);
        }
    };
    const int R0 = 64 * h + 16 * q + g, R1 = R0 + 8;
    const u32 a16_0 = (u32)((size_t)(wbase + (long long)min(r0 + R0, rows - 1) * row_bytes) & 15);
    const u32 a16_1 = (u32)((size_t)(wbase + (long long)min(r0 + R1, rows - 1) * row_bytes) & 15);
    u32 fd0 = 0, fd1 = 0; // the rows' f16x2 F d of the super-block being decoded
    auto decode = [&](int P, int S, u32* a) {
        u32 w0[4], w1[4];
        const int st = S % GWD_NSW;
        gwd_deq_f(&sm.raw[st][GWD_RW * R0 + gwd_ow(a16_0, S)], P, t, fd0, w0);
        gwd_deq_f(&sm.raw[st][GWD_RW * R1 + gwd_ow(a16_1, S)], P, t, fd1, w1);
        gw_afrag(w0, w1, a);
    };
    const u64 xd0 = gw_desc(sx, 128u, 512u); // X slot 0 (as gwd_body)

    GwAcc<N> acc;
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc.v[i] = 0.0f;
    u32 a0[8], a1[8], am[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    // One group of raw / sums 0 and X chunks 0..7, one of raw / sums 1; wait for the first (the
    // second by super-block 0's chunk 0 boundary, before its first use at chunk 7)
    issue_raw(0);
    issue_x4(0);
    issue_x4(4);
    ds4_cp_commit();
    issue_raw(1);
    ds4_cp_commit();
    ds4_cp_wait<1>();
    gw_proxy_fence();
    __syncthreads();
    fd0 = gwd_fd(&sm.raw[0][GWD_RW * R0 + gwd_ow(a16_0, 0)]), fd1 = gwd_fd(&sm.raw[0][GWD_RW * R1 + gwd_ow(a16_1, 0)]);
    decode(0, 0, a0);

    for (int S = 0; S < nsb; S++) {
        const int st = S % GWD_NSW;
        const u32* rb0 = &sm.raw[st][GWD_RW * R0 + gwd_ow(a16_0, S)];
        const u32* rb1 = &sm.raw[st][GWD_RW * R1 + gwd_ow(a16_1, S)];
#pragma unroll
        for (int p = 0; p < 8; p++) {
            const int c = 8 * S + p;
            u32* a = (p & 1) ? a1 : a0;
            u32* an = (p & 1) ? a0 : a1;
            const u64 xd = gw_xdesc(xd0, c % GWD_NX); // this chunk's X slot
            if ((p & 3) == 0) { // group boundary: everything issued so far has landed
                ds4_cp_wait<0>();
                gw_proxy_fence();
                __syncthreads();
                issue_x4(c + 8);
                if (p == 0 && S > 0) issue_raw(S + 1); // into S - 2's stage (its min wgmma waited at S - 1's chunk 0)
                ds4_cp_commit();
            }
            if (p < 7) {
                gw_chunk<N, 1>(acc, a, xd, c); // zeroes acc at chunk 0 alone
            } else { // the chunk and the super-block's min term, one group
                const u32 m0 = gwd_fm(rb0), m1 = gwd_fm(rb1);
                am[0] = ds4_hmul2(gwd_min(rb0, t, 0), m0), am[1] = ds4_hmul2(gwd_min(rb1, t, 0), m1);
                am[2] = ds4_hmul2(gwd_min(rb0, t, 1), m0), am[3] = ds4_hmul2(gwd_min(rb1, t, 1), m1);
                gw_pin(acc);
                gw_pin_a(am);
                gw_fence();
#pragma unroll
                for (int kk = 0; kk < 2; kk++) gw_mma(acc, a + 4 * kk, xd + 16u * kk, 1);
                gw_mma(acc, am, gw_desc(ss + (u32)st * 4096u, 128u, 256u), 1);
                gw_commit();
                gw_pin(acc);
            }
            // The decode of chunk c + 1 (the next super-block's at p = 7; its stage landed by this
            // super-block's p = 4 wait).
            auto next = [&](u32* dst) {
                if (p == 7) {
                    const int s1 = (S + 1) % GWD_NSW;
                    fd0 = gwd_fd(&sm.raw[s1][GWD_RW * R0 + gwd_ow(a16_0, S + 1)]);
                    fd1 = gwd_fd(&sm.raw[s1][GWD_RW * R1 + gwd_ow(a16_1, S + 1)]);
                    decode(0, S + 1, dst);
                } else {
                    decode(p + 1, S, dst);
                }
            };
            // EARLY (as gemm_wg.cu gw_body): below N = 80 chunk c + 1 is decoded into nx before the
            // wait for chunk c - 1's group, whose A registers an it goes to (past the last chunk:
            // stale stage words, never used).
            constexpr bool EARLY = N <= 64;
            u32 nx[8];
            if (EARLY) next(nx);
            gw_wait<1>(); // chunk c - 1's group (registers an; at p = 0 also S - 1's am) is done
            gw_pin_a(an);
            gw_pin_a(am);
            if (EARLY) {
#pragma unroll
                for (int i = 0; i < 8; i++) an[i] = nx[i];
            } else if (c + 1 < nl) {
                next(an);
            }
        }
    }
    ds4_cp_wait<0>();
    gw_wait<0>();
    gw_pin(acc);
    gw_pin_a(am);
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc.v[i] *= 1.0f / GWD_F;
    gw_store<N>(acc, items, xs, t, r0 + R0, rows, Y, y_tok, ctr, s_tile);
}
#endif

#if defined(DS4_CUDA)
#define GWD_B4 512, 1 // DS4_BOUNDS(GWD_B4) = __launch_bounds__(512, 1): <= 128 registers
#else
#define GWD_B4 512
#endif

#define GWD_PARAMS                                                                                                   \
    const u8 *__restrict__ W, long long w_z, const int *__restrict__ sel, long long slab, const u32 *__restrict__ XT, \
        const u32 *__restrict__ XS, const float *__restrict__ xinv, long long x_tok, long long x_z, int xdiv,          \
        float *__restrict__ Y, long long y_tok, long long y_z, long long y_s, int rows, int cols, long long row_bytes, \
        int n, int ks, int kc, const int *__restrict__ grp, int gmax, int smax

// The kernels' shared part (PL: X planes): the CTA's item run, then the product with N = its
// valid items rounded up to 16.
template <int PL> __device__ __forceinline__ void gwd_kernel(GWD_PARAMS) {
    (void)w_z, (void)x_z, (void)y_z, (void)y_s, (void)ks, (void)kc, (void)smax;
#if GW_HAVE
    extern __shared__ uint4 gwd_dyn[];
    GwdSmem<256>& sm = *reinterpret_cast<GwdSmem<256>*>(gwd_dyn);
    __shared__ int items[GW_BM];
    __shared__ float xs[GW_BM]; // the items' row scales (gw_items)
    __shared__ int expert;
    const int by = blockIdx.y;
    if (by >= grp[0]) return; // uniform over the CTA
    const int nv = gw_items(grp, sel, n, gmax, items, &expert, xinv, xdiv, xs, by); // valid items (a prefix of the tile)
    if (nv <= 16)
        gwd_body<16, PL>(sm, items, expert, W, slab, XT, XS, xs, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, blockIdx.x);
    else if (nv <= 32)
        gwd_body<32, PL>(sm, items, expert, W, slab, XT, XS, xs, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, blockIdx.x);
    else if (nv <= 48)
        gwd_body<48, PL>(sm, items, expert, W, slab, XT, XS, xs, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, blockIdx.x);
    else
        gwd_body<64, PL>(sm, items, expert, W, slab, XT, XS, xs, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, blockIdx.x);
#else
    (void)W, (void)sel, (void)slab, (void)XT, (void)XS, (void)xinv, (void)x_tok, (void)xdiv, (void)Y, (void)y_tok;
    (void)rows, (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax;
#endif
}
#if GW_HAVE
// The folded wide form's tile: wide run by (up to 128 pairs), row tile bx; N = the run's valid
// items rounded up to 16.
__device__ __forceinline__ void gwd_tile_fw(GwdSmemW<256>& sm, int* items, float* xs, int* expert, int bx, int by,
                                            u32* ctr, int* s_tile, GWD_PARAMS) {
    (void)w_z, (void)x_z, (void)y_z, (void)y_s, (void)ks, (void)kc;
    // Runs of at most smax pairs belong to gwds_q2_k (launched beside): skipped here, as gemm_wg.cu
    // gw_tile (the persistent form draws its next tile after a barrier).
    if (smax > 0 && gw_run_len<2 * GW_BM>(grp, n, gmax, by) <= smax) {
        if (ctr) {
            __syncthreads();
            if (threadIdx.x == 0) *s_tile = (int)atomicAdd(ctr, 1u);
        }
        return;
    }
    const int nv = gw_items<2 * GW_BM>(grp, sel, n, gmax, items, expert, xinv, xdiv, xs, by);
    const int ex = *expert;
#define GWD_FW(NN) gwd_body_fw<NN>(sm, items, ex, W, slab, XT, XS, xs, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, bx, ctr, s_tile)
    if (nv <= 16) GWD_FW(16);
    else if (nv <= 32) GWD_FW(32);
    else if (nv <= 48) GWD_FW(48);
    else if (nv <= 64) GWD_FW(64);
    else if (nv <= 80) GWD_FW(80);
    else if (nv <= 96) GWD_FW(96);
    else if (nv <= 112) GWD_FW(112);
    else GWD_FW(128);
#undef GWD_FW
}
#endif
#define GWD_ARGS W, w_z, sel, slab, XT, XS, xinv, x_tok, x_z, xdiv, Y, y_tok, y_z, y_s, rows, cols, row_bytes, n, ks, kc, grp, gmax, smax
// The folded wide form's kernel part: one tile a CTA (blockIdx: row tile, wide run).
__device__ __forceinline__ void gwd_kernel_fw(GWD_PARAMS) {
    (void)w_z, (void)x_z, (void)y_z, (void)y_s, (void)ks, (void)kc, (void)smax;
#if GW_HAVE
    extern __shared__ uint4 gwd_dyn[];
    GwdSmemW<256>& sm = *reinterpret_cast<GwdSmemW<256>*>(gwd_dyn);
    __shared__ int items[2 * GW_BM];
    __shared__ float xs[2 * GW_BM]; // the items' row scales (gw_items)
    __shared__ int expert;
    if ((int)blockIdx.y >= grp[1 + gmax + n]) return; // the wide runs' count (uniform over the CTA)
    gwd_tile_fw(sm, items, xs, &expert, blockIdx.x, blockIdx.y, nullptr, nullptr, GWD_ARGS);
#else
    (void)W, (void)sel, (void)slab, (void)XT, (void)XS, (void)xinv, (void)x_tok, (void)xdiv, (void)Y, (void)y_tok;
    (void)rows, (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax;
#endif
}
// Its persistent form (wgmma.cuh gw_first_tile): tiles t < ngroups2 * TX, wide run t / TX, row
// tile t % TX.
__device__ __forceinline__ void gwd_kernel_fwp(GWD_PARAMS, u32* ctr) {
    (void)w_z, (void)x_z, (void)y_z, (void)y_s, (void)ks, (void)kc, (void)smax;
#if GW_HAVE
    extern __shared__ uint4 gwd_dyn[];
    GwdSmemW<256>& sm = *reinterpret_cast<GwdSmemW<256>*>(gwd_dyn);
    __shared__ int items[2 * GW_BM];
    __shared__ float xs[2 * GW_BM];
    __shared__ int expert, s_tile;
    const int tx = (rows + 255) / 256, tiles = grp[1 + gmax + n] * tx;
    gw_first_tile(ctr, &s_tile);
    for (;;) {
        __syncthreads(); // s_tile drawn; the previous tile's reads of items / xs / the stages done
        const int tt = s_tile;
        if (tt >= tiles) break; // uniform over the CTA
        gwd_tile_fw(sm, items, xs, &expert, tt % tx, tt / tx, ctr, &s_tile, GWD_ARGS);
    }
    gw_leave(ctr);
#else
    (void)W, (void)sel, (void)slab, (void)XT, (void)XS, (void)xinv, (void)x_tok, (void)xdiv, (void)Y, (void)y_tok;
    (void)rows, (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax, (void)ctr;
#endif
}

// The Q2_K down of the grouped pairs (gemmu_q2_k's arguments, gemm.cu GMT_PARAMS): grid (rows /
// 256, gmax, 1), 512 threads (4 warpgroups, 256 weight rows: 1 CTA per SM), dynamic shared memory
// sizeof(GwdSmem<256>) (192 KiB). W + expert * slab: the expert's rows (row_bytes apart, 4-byte
// aligned, cols / 256 blocks of 84 bytes); XT, XS, xinv: gemm_xt_f32 of the token rows (unit
// layout, sums); pair i reads token i / xdiv; Y[i * y_tok + r]. grp: gm_group_*_i32 with runs of
// at most 64. Host contract: cols % 256 == 0, x_tok % 256 == 0, gridDim.z == 1 (w_z, x_z, y_z,
// y_s, ks, kc and skip unused). H200: bench/results/gpu-gemm-d16-h200.txt.
DS4_KERNEL void DS4_BOUNDS(GWD_B4) gwd_q2_k(GWD_PARAMS) { gwd_kernel<2>(GWD_ARGS); }
// The same with the hi planes of X and the sums alone (one f16 rounding, ~2^-11 per element; the
// lo words unread or unwritten): DS4_GPU_GEMM_PLANES=1 (gemm_wgd.rs; --precision fast).
DS4_KERNEL void DS4_BOUNDS(GWD_B4) gwd_q2_k_p1(GWD_PARAMS) { gwd_kernel<1>(GWD_ARGS); }
// The folded wide form (above: runs of up to 128 pairs, one accumulator set, X and sums hi planes
// alone): DS4_GPU_GWD_WIDE (gemm_wgd.rs), --precision fast only. Grid (rows / 256, the wide runs'
// bound, 1), 512 threads, dynamic shared memory sizeof(GwdSmemW<256>) (224 KiB).
DS4_KERNEL void DS4_BOUNDS(GWD_B4) gwd_q2_k_p1_fw(GWD_PARAMS) { gwd_kernel_fw(GWD_ARGS); }
// Its persistent form (gemm_wgd.rs DS4_GPU_GW_PERSIST): grid (CTAs, 1, 1), one an SM; ctr: two
// words, zero between launches (the kernel leaves them so).
DS4_KERNEL void DS4_BOUNDS(GWD_B4) gwd_q2_k_p1_fwp(GWD_PARAMS, u32* ctr) { gwd_kernel_fwp(GWD_ARGS, ctr); }

// ---- Small runs (gwds_q2_k; gemm_wgd.rs DS4_GPU_GWD_SMALL) ----
// The grouping's wide runs of at most min(smax, 16) pairs (the folded wide form above skips them):
// a wgmma CTA pays its 256 rows' whole decode however few its pairs, so these take mma.sync
// m16n8k16 with the run's items as B columns (NI = 8 or 16: one or two n8 tiles a k-step, the A
// fragment decoded once for both) and the decode of the one-token down (moe.cu m3dn1, f16 form):
// a lane holds weights 8t .. 8t+7 of a 32-column chunk for rows g and g + 8, the integers
// sl q <= 45 as f16 subnormals (value 2^-24 sl q: one PRMT and one IMAD a pair, exact), X the
// same hi plane of gemm_xt_f32's unit layout as the folded form (v = x 2^s, one f16 rounding),
// f32 sums. Per super-block a fresh chain cc over its 8 chunks, acc += d cc, then the min term as
// one more mma an n8 tile (A: the integer mins m_j as subnormals, k = j; B: the sums S_j / 16) and
// acc -= 16 dmin cm; y = acc 2^24 2^-s. Exact in the weights (the folded form rounds them twice):
// bits differ from it, bound as the folded form's (ops_gemm).
// CTA: 8 warps, nb tiles of 16 rows of the run's expert; a tile is one cp.async stage (16 rows x
// row_bytes at a stride of srw words, srw / 4 odd: each lane's two q words of rows g = 0..7 fall
// on 2 lanes a bank at most), 3 stages, 2 in flight; warp w takes super-blocks w, w + 8, .. of a
// tile, the 8 warps' partials summed in order by a fixed tree. Shared (dynamic; gemm_wgd.rs
// small_smem), with nx = 8 or 16 item slots (the host's bound): stages 3 x 16 x 4 srw, X
// [cols / 32 chunks][nx items][4 t] uint4 (the hi words of k-steps 0 and 1: b0, b1 of each), sums
// [cols / 256][nx][4] uint2, red [8 warps][16 rows][nx].
#define GWDS_LB3 256, 3 // at most 85 registers: 3 CTAs an SM (~70 KiB of shared memory each at cols 2048, nx 8)
#define GWDS_LB2 256, 2 // at most 128 registers: 2 CTAs an SM (~109 KiB at nx 16)
__device__ __forceinline__ int gwds_srw(long long row_bytes) {
    const int w = (int)((row_bytes + 15) / 16) * 4; // words, a multiple of 4 (16-byte copies)
    return ((w / 4) & 1) ? w : w + 4;
}
#if GW_HAVE
template <int NI>
__device__ __forceinline__ void gwds_body(const u8* __restrict__ wb, const u32* __restrict__ XT, const u32* __restrict__ XS,
                                          const int* __restrict__ perm, int st, int len, int nx, const float* __restrict__ xinv,
                                          long long x_tok, int xdiv, float* __restrict__ Y, long long y_tok, int rows,
                                          int cols, long long row_bytes, int nb, int* items, float* xs) {
    constexpr int NT = NI / 8; // n8 tiles
    extern __shared__ uint4 gwd_dyn[];
    const int nsb = cols / 256, srw = gwds_srw(row_bytes);
    u8* stg = (u8*)gwd_dyn;                       // 3 stages of 16 rows
    uint4* xf = (uint4*)(stg + 3 * 16 * 4 * srw); // [cols / 32][nx][4]
    uint2* xsum = (uint2*)(xf + cols / 8 * nx);   // [nsb][nx][4]
    float* red = (float*)(xsum + 4 * nx * nsb);   // [8][16][nx]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0c = blockIdx.x * nb * 16, ntl = min(nb, (rows - r0c + 15) / 16);
    const int rv = (int)(row_bytes / 16); // 16-byte pieces a row (row_bytes % 16 == 0: the host)
    int is_t = 0;                         // next tile to stage
    auto issue = [&]() {
        if (is_t < ntl) {
            u8* dst = stg + (is_t % 3) * 16 * 4 * srw;
            for (int i = tid; i < 16 * rv; i += 256) {
                const int R = i / rv, v = i - R * rv;
                const long long r = min(r0c + 16 * is_t + R, rows - 1); // rows past the end: computed, not stored
                ds4_cp16n((u32)__cvta_generic_to_shared(dst + R * 4 * srw + 16 * v), wb + r * row_bytes + 16 * v, 16);
            }
            is_t++;
        }
        ds4_cp_commit();
    };
    issue();
    issue();
    if (tid < NI) {
        const int it = tid < len ? perm[st + tid] : -1;
        items[tid] = it;
        xs[tid] = it >= 0 ? xinv[it / xdiv] : 0.0f;
    }
    // X and the sums of item m (< len; the others zero up to NI): its token row perm[st + m] / xdiv.
    for (int q = tid; q < cols / 8 * NI; q += 256) {
        const int tq = q & 3, m = (q >> 2) % NI, c = (q >> 2) / NI;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < len) {
            const u32* src = XT + (long long)(perm[st + m] / xdiv) * x_tok + 32 * c + tq; // units 0, 1, 4, 5: hi01 / hi23 of k-steps 0, 1
            v = make_uint4(src[0], src[4], src[16], src[20]);
        }
        xf[(c * nx + m) * 4 + tq] = v;
    }
    for (int q = tid; q < 4 * NI * nsb; q += 256) {
        const int tq = q & 3, m = (q >> 2) % NI, S = (q >> 2) / NI;
        uint2 v = make_uint2(0u, 0u);
        if (m < len) {
            const u32* src = XS + (long long)(perm[st + m] / xdiv) * (x_tok / 16) + 16 * S + tq; // hi pieces: j 0-7, 8-15
            v = make_uint2(src[0], src[4]);
        }
        xsum[(S * nx + m) * 4 + tq] = v;
    }
    for (int tl = 0; tl < ntl; tl++) {
        ds4_cp_wait<1>();
        __syncthreads(); // tile tl's stage landed for all (and X at the first); tile tl - 1's stage and red free
        issue();
        const u32* s0 = (const u32*)(stg + (tl % 3) * 16 * 4 * srw) + g * srw; // row g
        const u32* s1 = s0 + 8 * srw;                                          // row g + 8
        float acc[NT][4];                                                      // rows g, g (items 8h + 2t, +1), g + 8, g + 8
#pragma unroll
        for (int h = 0; h < NT; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
        for (int S = warp; S < nsb; S += 8) {
            const u32* rb0 = s0 + 21 * S; // the super-block's 84 bytes
            const u32* rb1 = s1 + 21 * S;
            const uint4* xb = xf + 8 * S * 4 * nx + lane; // chunk 8 S, item g, t
            float cc[NT][4];
#pragma unroll
            for (int h = 0; h < NT; h++) cc[h][0] = cc[h][1] = cc[h][2] = cc[h][3] = 0.0f;
#pragma unroll
            for (int P = 0; P < 8; P++) {
                const int nn = P >> 2, j = P & 3, sh = 8 * (2 * (P & 1) + (t >> 1));
                const u32 l0 = (rb0[P >> 1] >> sh) & 15u, l1 = (rb1[P >> 1] >> sh) & 15u; // scale of weights 8t .. of chunk P
                const u32 msk = 0x03030303u;
                const u32 qa0 = (rb0[4 + 8 * nn + 2 * t] >> (2 * j)) & msk, qb0 = (rb0[5 + 8 * nn + 2 * t] >> (2 * j)) & msk;
                const u32 qa1 = (rb1[4 + 8 * nn + 2 * t] >> (2 * j)) & msk, qb1 = (rb1[5 + 8 * nn + 2 * t] >> (2 * j)) & msk;
                // [q0, 0, q1, 0] * scale: the f16 subnormals 2^-24 sl q (no carry: sl q <= 45)
                const u32 a0[4] = {ds4_prmt(qa0, 0u, 0x7170) * l0, ds4_prmt(qa1, 0u, 0x7170) * l1,
                                   ds4_prmt(qa0, 0u, 0x7372) * l0, ds4_prmt(qa1, 0u, 0x7372) * l1};
                const u32 a1[4] = {ds4_prmt(qb0, 0u, 0x7170) * l0, ds4_prmt(qb1, 0u, 0x7170) * l1,
                                   ds4_prmt(qb0, 0u, 0x7372) * l0, ds4_prmt(qb1, 0u, 0x7372) * l1};
#pragma unroll
                for (int h = 0; h < NT; h++) {
                    const uint4 b = xb[(4 * P * nx) + 32 * h];
                    ds4_mma_f16(cc[h], a0, b.x, b.y);
                    ds4_mma_f16(cc[h], a1, b.z, b.w);
                }
            }
            const u32 dd0 = rb0[20], dd1 = rb1[20]; // (d, dmin) of rows g, g + 8
            const float d0 = ds4_h2f_fast(dd0 & 0xffffu), d1 = ds4_h2f_fast(dd1 & 0xffffu);
            const float m0 = -16.0f * ds4_h2f_fast(dd0 >> 16), m1 = -16.0f * ds4_h2f_fast(dd1 >> 16);
            // Mins of sub-blocks 2t, 2t + 1 (k 2t, 2t + 1) and 2t + 8, 2t + 9: scale bytes' high nibbles.
            auto mins = [&](const u32* rb, int hh) {
                const u32 v = (rb[2 * hh + (t >> 1)] >> (16 * (t & 1))) & 0xffffu;
                return ((v >> 4) & 15u) | ((v >> 12) << 16);
            };
            const u32 am[4] = {mins(rb0, 0), mins(rb1, 0), mins(rb0, 1), mins(rb1, 1)};
#pragma unroll
            for (int h = 0; h < NT; h++) {
                acc[h][0] = fmaf(d0, cc[h][0], acc[h][0]), acc[h][1] = fmaf(d0, cc[h][1], acc[h][1]);
                acc[h][2] = fmaf(d1, cc[h][2], acc[h][2]), acc[h][3] = fmaf(d1, cc[h][3], acc[h][3]);
                const uint2 sb = ((const uint2*)xsum)[S * 4 * nx + 32 * h + lane];
                float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                ds4_mma_f16(cm, am, sb.x, sb.y);
                acc[h][0] = fmaf(m0, cm[0], acc[h][0]), acc[h][1] = fmaf(m0, cm[1], acc[h][1]);
                acc[h][2] = fmaf(m1, cm[2], acc[h][2]), acc[h][3] = fmaf(m1, cm[3], acc[h][3]);
            }
        }
        // red[warp][row][item]; then thread (row rr, item m) sums the 8 warps in order.
#pragma unroll
        for (int h = 0; h < NT; h++) {
            float* rw = red + (warp * 16 + g) * nx + 8 * h + 2 * t;
            rw[0] = acc[h][0], rw[1] = acc[h][1], rw[8 * nx] = acc[h][2], rw[8 * nx + 1] = acc[h][3]; // + 8 rows
        }
        __syncthreads();
        if (tid < 16 * NI) {
            const int rr = tid / NI, m = tid % NI, r = r0c + 16 * tl + rr;
            float v = 0.0f;
            for (int w = 0; w < 8; w++) v += red[(w * 16 + rr) * nx + m];
            if (m < len && r < rows) Y[(long long)items[m] * y_tok + r] = v * 0x1p24f * xs[m];
        }
    }
    ds4_cp_wait<0>();
}
#endif
// The kernels' shared part: run blockIdx.y if it holds 1 .. min(smax, NMAX) pairs, on the body
// for its size.
template <int NMAX> __device__ __forceinline__ void gwds_kernel(GWD_PARAMS, int nb) {
    (void)w_z, (void)x_z, (void)y_z, (void)y_s, (void)ks, (void)kc;
#if GW_HAVE // launched only beside the folded wide form (sm_90a)
    const int* perm = grp + 1 + gmax;
    const int* g2 = perm + n; // [ngroups2, starts2[]]
    const int by = blockIdx.y;
    if (by >= g2[0]) return; // uniform over the CTA
    const int len = gw_run_len<2 * GW_BM>(grp, n, gmax, by);
    if (len == 0 || len > min(smax, NMAX)) return;
    const int st = g2[1 + by];
    const u8* wb = W + (long long)max(sel[perm[st]], 0) * slab;
    __shared__ int items[NMAX];
    __shared__ float xs[NMAX];
    if (NMAX == 8 || len <= 8)
        gwds_body<8>(wb, XT, XS, perm, st, len, NMAX, xinv, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, nb, items, xs);
    else
        gwds_body<NMAX>(wb, XT, XS, perm, st, len, NMAX, xinv, x_tok, xdiv, Y, y_tok, rows, cols, row_bytes, nb, items, xs);
#else
    (void)W, (void)sel, (void)slab, (void)XT, (void)XS, (void)xinv, (void)x_tok, (void)xdiv, (void)Y, (void)y_tok;
    (void)rows, (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax, (void)smax, (void)nb;
#endif
}
// Runs of at most min(smax, 8) pairs (nx = 8 item slots); grid (rows / (16 nb), the wide runs'
// bound, 1), 256 threads, dynamic shared memory gemm_wgd.rs small_smem (~70 KiB at cols 2048).
DS4_KERNEL void DS4_BOUNDS(GWDS_LB3) gwds_q2_k(GWD_PARAMS, int nb) { gwds_kernel<8>(GWD_ARGS, nb); }
// Runs of at most min(smax, 16) (nx = 16: two n8 tiles for the runs of 9 .. 16; ~109 KiB).
DS4_KERNEL void DS4_BOUNDS(GWDS_LB2) gwds16_q2_k(GWD_PARAMS, int nb) { gwds_kernel<16>(GWD_ARGS, nb); }
