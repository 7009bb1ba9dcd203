// Hopper wgmma form of the dense Q8_0 prefill products (sm_90a only; the host launches it only
// there, elsewhere the kernel compiles to an empty body):
//
//   Y[t][r] = W[r] · X[t]        (t < n token rows, r < rows weight rows, Part::All)
//
// Arithmetic: a Q8_0 block (34 bytes: f16 d, 32 int8 q) is d·q with q EXACT in f16. X from
// gemm_xt_f32 in the unit layout (unit != 0, no sums): v = x * 2^s per token row as f16 hi/lo.
// Per 32-element block b and row r:
//   acc += d_rb * sum_k q_k (v_hi,k + v_lo,k)       (tensor cores, f32 accumulation)
// then y = acc * 2^-s at the store. Two terms (q·hi, q·lo), exact in the weights (cuBLASLt's
// three-term bf16 form, blas.rs, rounds the weights to bf16 hi + lo).
//
// Tensor cores: wgmma.mma_async m64nNk16 f16 -> f32 with the WEIGHTS AS A (64 weight rows, from
// registers) and X AS B (N token rows from shared memory by descriptor), as gemm_wgd.cu's
// gwd_q2_k (same X unit layout, same core-matrix placement and descriptors). N = 16, 32, 48 or
// 64: the CTA's valid tokens rounded up to 16 (the host's tile bm = 16, 32 or 64 fills the SMs).
// CTA: 4 warpgroups (512 threads), 256 weight rows (warpgroup h: rows 64h..), 1 CTA per SM.
// A fragment (per warp, as mma.m16n8k16): lane (g, t) of warp q holds rows 16q + g (+8) and, in
// the unit layout, the 8 consecutive weights 8t .. 8t+7 of the 32-element block (k-step kk:
// elements 8t + 4kk + {0,1 | 2,3}): 2 q words (one PRMT to realign on even blocks), then per
// pair one PRMT (bytes (q + 128, 0x64): f16 1024 + q + 128) and one HSUB2 (- 1152): exact.
// Per block: 4 wgmma (2 k-steps x hi/lo, the first with scale-d 0: cc = the block's partial),
// commit, decode the next block into the other A register set while they run, wait, acc += d cc
// (d per row: two f16 of the staged raw block).
// Staging: "super-blocks" of 8 Q8_0 blocks (256 columns, 272 bytes = 17 uint4 a row: rows 16-byte
// aligned, host contract) by cp.async 16-byte into 2 raw stages (256 rows x 68 words); X by
// cp.async 16-byte in groups of 4 blocks into 8 slots (a group ahead). One cp.async wait +
// fence.proxy.async + barrier per 4 blocks.
#include "prelude.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

#define GWQ_NX 8  // X block slots: 2 groups of 4 blocks
#define GWQ_RW 68 // raw words per row and stage (8 Q8_0 blocks: 272 bytes)

#if GW_HAVE
// Dynamic shared memory (the host passes sizeof: gemm_wq.rs WQ_SMEM).
struct alignas(16) GwqSmem {
    uint4 x[GWQ_NX][2][64 * 4]; // X block slots: plane (hi, lo), core matrices (gemm_wgd.cu)
    u32 raw[2][256 * GWQ_RW];   // raw super-blocks, row r at 68 r
};
static_assert(sizeof(GwqSmem) == 204800, "gemm_wq.rs WQ_SMEM");

__device__ __forceinline__ void* gwq_gen(u32 a) { return __cvta_shared_to_generic(a); }

// Four signed bytes of v as two f16x2 words: (byte 0, byte 1), (byte 2, byte 3), exact integers.
__device__ __forceinline__ void gwq_i8x4(u32 v, u32& lo, u32& hi) {
    const u32 u = v ^ 0x80808080u; // q + 128
    lo = ds4_hsub2(ds4_prmt(u, 0x64646464u, 0x4140u), 0x64806480u);
    hi = ds4_hsub2(ds4_prmt(u, 0x64646464u, 0x4342u), 0x64806480u);
}

// Weights 8t .. 8t+7 of block P (0..7, a constant once unrolled) of a row's staged super-block
// rb as 4 f16x2 words (elements (0,1), (2,3), (4,5), (6,7)). Block P at byte 34 P: q byte k at
// 34 P + 2 + k (word aligned for odd P; even P: 2 bytes in, realigned by PRMT).
__device__ __forceinline__ void gwq_deq(const u32* rb, int P, int t, u32* w) {
    u32 qa, qb;
    if (P & 1) {
        const int b = (17 * P + 1) / 2 + 2 * t;
        qa = rb[b], qb = rb[b + 1];
    } else {
        const int b = 17 * P / 2 + 2 * t;
        const u32 w0 = rb[b], w1 = rb[b + 1], w2 = rb[b + 2];
        qa = ds4_prmt(w0, w1, 0x5432u), qb = ds4_prmt(w1, w2, 0x5432u);
    }
    gwq_i8x4(qa, w[0], w[1]);
    gwq_i8x4(qb, w[2], w[3]);
}

// d of block P of a row's staged super-block as f32.
__device__ __forceinline__ float gwq_d(const u32* rb, int P) {
    return ds4_h2f_fast((P & 1) ? rb[(17 * P - 1) / 2] >> 16 : rb[17 * P / 2] & 0xffffu);
}

// One CTA's product with N (16, 32, 48, 64) token columns starting at token t0 (tokens >= n:
// zero X, not stored). Rows r0 + 64 h + 16 q + g (+8) per lane (warpgroup h, warp q of it).
template <int N>
__device__ __forceinline__ void gwq_body(GwqSmem& sm, int t0, const u8* __restrict__ W, const u32* __restrict__ XT,
                                         const float* __restrict__ xinv, float* __restrict__ Y, int rows, int cols,
                                         long long row_bytes, int n) {
    constexpr int NT = 512, BN = 256;
    const int tid = threadIdx.x, h = tid >> 7, q = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * BN;
    const int nl = cols / 32, nsb = nl / 8;
    const u32 sx = (u32)__cvta_generic_to_shared(&sm.x[0][0][0]);
    const u32 sr = (u32)__cvta_generic_to_shared(&sm.raw[0][0]);
    // X copies (gemm_wgd.cu's map): thread -> token xm = tid / 8, unit u = tid % 8 (= 4 kk + c)
    // of the token's block to plane c / 2, k group 2 kk + c % 2, row xm % 8 of token group xm / 8.
    const int xm = tid >> 3, xu = tid & 7;
    const bool xok = xm < N && t0 + xm < n;
    const u32* xsrc = XT + (long long)(xok ? t0 + xm : 0) * cols + 4 * xu;
    const u32 xdst = sx + (u32)(((xu >> 1) & 1) * 4096 + ((4 * (xm >> 3) + 2 * (xu >> 2) + (xu & 1)) * 8 + (xm & 7)) * 16);
    auto issue_x = [&](int c) {
        if (c < nl && xm < N) ds4_cp16(gwq_gen(xdst + (u32)(c % GWQ_NX) * 8192u), xok ? xsrc + 32LL * c : XT, xok);
    };
    // Raw super-block S (17 uint4 a row; rows past `rows` repeat the last) into stage S % 2.
    auto issue_raw = [&](int S) {
        if (S < nsb) {
            const u32 so = sr + (u32)(S & 1) * (u32)(BN * GWQ_RW * 4);
            for (int i = tid; i < BN * 17; i += NT) {
                const int r = i / 17, w = i - r * 17;
                ds4_cp16(gwq_gen(so + 16u * (u32)i), (const uint4*)(W + (long long)min(r0 + r, rows - 1) * row_bytes + 272LL * S) + w, true);
            }
        }
    };
    const int R0 = 64 * h + 16 * q + g, R1 = R0 + 8;
    // A registers of block P of the super-block in stage st: k-step kk at a[4kk ..]: (R0, R1,
    // R0, R1) x element pairs (8t + 4kk, +1), (+2, +3).
    auto decode = [&](int P, int st, u32* a) {
        u32 w0[4], w1[4];
        gwq_deq(&sm.raw[st][GWQ_RW * R0], P, t, w0);
        gwq_deq(&sm.raw[st][GWQ_RW * R1], P, t, w1);
        a[0] = w0[0], a[1] = w1[0], a[2] = w0[1], a[3] = w1[1];
        a[4] = w0[2], a[5] = w1[2], a[6] = w0[3], a[7] = w1[3];
    };
    constexpr u32 lbo = 128u, sbo = 512u; // X: next k group, next 8 tokens

    GwAcc<N> acc, cc;
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc.v[i] = 0.0f, cc.v[i] = 0.0f;
    u32 a0[8], a1[8];
    issue_raw(0); // raw 0 and X blocks 0..3; raw 1 and blocks 4..7 at block 0
#pragma unroll
    for (int i = 0; i < 4; i++) issue_x(i);
    ds4_cp_commit();
    ds4_cp_wait<0>();
    gw_proxy_fence();
    __syncthreads();
    decode(0, 0, a0);

    for (int S = 0; S < nsb; S++) {
        const int st = S & 1;
        const u32* rb0 = &sm.raw[st][GWQ_RW * R0];
        const u32* rb1 = &sm.raw[st][GWQ_RW * R1];
#pragma unroll
        for (int p = 0; p < 8; p++) {
            const int c = 8 * S + p;
            u32* a = (p & 1) ? a1 : a0;  // this block's A registers
            u32* an = (p & 1) ? a0 : a1; // the next block's
            const u32 xs = sx + (u32)(c % GWQ_NX) * 8192u;
            if ((p & 3) == 0) { // group boundary: blocks c .. c+3 (and at p = 4 raw S + 1) landed
                ds4_cp_wait<0>();
                gw_proxy_fence();
                __syncthreads(); // every warpgroup is done with blocks < c (slots of c + 4 ..)
#pragma unroll
                for (int i = 4; i < 8; i++) issue_x(c + i); // the next group
                if (p == 0) issue_raw(S + 1);               // into super-block S - 1's stage
                ds4_cp_commit();
            }
            gw_pin(cc);
            gw_fence();
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                gw_mma(cc, a + 4 * kk, gw_desc(xs + 256u * kk, lbo, sbo), kk); // hi (zeroes cc first)
                gw_mma(cc, a + 4 * kk, gw_desc(xs + 4096u + 256u * kk, lbo, sbo), 1); // lo
            }
            gw_commit();
            gw_pin(cc);
            const float d0 = gwq_d(rb0, p), d1 = gwq_d(rb1, p);
            if (p < 7)
                decode(p + 1, st, an);
            else if (S + 1 < nsb)
                decode(0, st ^ 1, an); // raw S + 1 landed at the p = 4 boundary
            gw_wait<0>();
            gw_pin(cc);
            gw_pin_a(a);
            gw_pin_a(an);
#pragma unroll
            for (int i = 0; i < N / 2; i++) acc.v[i] = fmaf((i & 2) ? d1 : d0, cc.v[i], acc.v[i]);
        }
    }
    ds4_cp_wait<0>();
    // acc.v[4j + e]: row R0 + 8 (e >> 1), token t0 + 8j + 2t + (e & 1); y = acc * 2^-s.
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const int tok = t0 + 8 * (i >> 2) + 2 * t + (i & 1), r = r0 + ((i & 2) ? R1 : R0);
        if (tok < n && r < rows) Y[(long long)tok * rows + r] = acc.v[i] * xinv[tok];
    }
}
#endif

#if defined(DS4_CUDA)
#define GWQ_B4 512, 1 // DS4_BOUNDS(GWQ_B4) = __launch_bounds__(512, 1): <= 128 registers
#else
#define GWQ_B4 512
#endif

// Y[t * rows + r] = W[r] · X[t] for t < n, r < rows: grid (rows / 256 rounded up, n / bm rounded
// up), 512 threads, dynamic shared memory sizeof(GwqSmem) (200 KiB). W: Q8_0 rows row_bytes apart
// (16-byte aligned base and row_bytes; cols / 32 blocks of 34 bytes); XT, xinv: gemm_xt_f32 of the
// token rows (unit layout, x_tok = cols). Token tile bm = 16, 32 or 64 (the CTA runs N = the valid
// tokens rounded up to 16). Host contract: cols % 256 == 0. H200: bench/results/gpu-gemm-f16-h200.txt.
DS4_KERNEL void DS4_BOUNDS(GWQ_B4) gwq_q8_0(const u8* __restrict__ W, const u32* __restrict__ XT, const float* __restrict__ xinv,
                                             float* __restrict__ Y, int rows, int cols, long long row_bytes, int n, int bm) {
#if GW_HAVE
    extern __shared__ uint4 gwq_dyn[];
    GwqSmem& sm = *reinterpret_cast<GwqSmem*>(gwq_dyn);
    const int t0 = blockIdx.y * bm, nv = min(n - t0, bm); // valid tokens of the tile (> 0)
    if (nv <= 16)
        gwq_body<16>(sm, t0, W, XT, xinv, Y, rows, cols, row_bytes, n);
    else if (nv <= 32)
        gwq_body<32>(sm, t0, W, XT, xinv, Y, rows, cols, row_bytes, n);
    else if (nv <= 48)
        gwq_body<48>(sm, t0, W, XT, xinv, Y, rows, cols, row_bytes, n);
    else
        gwq_body<64>(sm, t0, W, XT, xinv, Y, rows, cols, row_bytes, n);
#else
    (void)W, (void)XT, (void)xinv, (void)Y, (void)rows, (void)cols, (void)row_bytes, (void)n, (void)bm;
#endif
}
