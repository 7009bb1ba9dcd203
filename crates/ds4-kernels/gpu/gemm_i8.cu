// Activation-quantised prefill experts (opt-in, DS4_GPU_ACT=q8k): ds4's CPU semantics
// (ds4_quant::act) on int8 tensor cores.
//
// act_q8k_f32: f32 rows -> Q8_K blocks of 256 (ds4_quant QuantizedAct::new(ActFormat::Q8_K, ..)):
// max = the first element of largest |x| (sign kept), iscale = -127 / max (IEEE division),
// q = clamp(rint(iscale * x), -127, 127) (ties to even), d = 1 / iscale; an all-zero block gets
// d = 0 and zero codes. bsums: sums of each 16 consecutive codes (i16). Bit-identical to the CPU.
//
// gemmi8_iq2_xxs: the MoE's IQ2_XXS gate/up for pairs grouped by expert (gm_group_*_i32 with runs
// cut at 64, the grouping of gemmc_iq2_xxs), gate and up in one launch (blockIdx.z), per pair i
// and weight row r
//   y[i][r] = 0.125 * sum_b (d_w[r][b] * d_x[tok(i)][b]) * bsum[i][r][b]       (blocks b in order)
//   bsum = sum_g (2 ls_g + 1) * isum_g,  isum_g = sum over the 32 elements of group g of
//          (grid * sign) * q_x                                                  (exact integers)
// which is ds4_quant::act's IQ2_XXS formula with the same f32 operations in the same order
// (uncontracted: __fmul_rn / __fadd_rn), so the result matches dot_row_act to the bit.
// Weights: grid * sign is an int8 (|v| <= 43); one mma.sync m16n8k32 s8.s8.s32 per 16 items x 8
// rows x one 32-element group (isum_g), the group scale 2 ls + 1 applied by one IMAD per
// accumulator, the block's f32 combination after its 8th group.
// CTA: 128 threads (4 warps), 64 items x 128 weight rows (warp w: rows 32w.., all 64 items as 4
// m-tiles of 16); K step = one 32-element group, 8 a block, unrolled (static ring slots). Thread
// t decodes tile row t's group into 32 int8 (one shared row, double-buffered); the X codes of the
// 64 items (32 bytes each) come by cp.async (16 bytes a thread) into a ring of GI_NS stages and
// the raw weight fields into a ring of GI_NS register slots, GI_NS - 1 groups ahead; one barrier
// per group. Per warp and group: 2 ldmatrix.x4 (B) + 4 (A) for 16 mma (int8 operands: a third of
// gemmc's shared bytes per multiply-add). 217 registers on sm_90a: 2 CTAs per SM.
// H200 (bench/results/gpu-gemm-i13-h200.txt): routed experts q2 at n = 2048 7.21 -> 5.90 ms (this
// gate/up with gemmu_q2_k's down); one group in flight (load latency exposed): 6.29 ms; 8 warps
// on half the items each: 6.81 (6.31 with the ring); their code is in git at the commit the
// results file names.
// CUDA sm_80+ only (the host keeps the exact forms elsewhere); off CUDA the kernel body is empty.
#include "prelude.cuh"
#include "iq2xxs_grid.cuh"
#include "ptx.cuh"

#if defined(DS4_CUDA) && DS4_ARCH >= 800 && DS4_WARP == 32
#define GI_HAVE_MMA 1
#else
#define GI_HAVE_MMA 0
#endif

#define GI_BM 64  // items per CTA (the grouping's run length)
#define GI_BN 128 // weight rows per CTA
#define GI_LD 12  // u32 per shared row (8 used: 32 int8): 48-byte stride, conflict-free ldmatrix and 16-byte stores

// ---- Q8_K activation quantiser: one CTA (256 threads) per block of 256 elements ----
// blockIdx.x = block b < K/256, blockIdx.y = row t; X row stride x_tok (elements); q [rows][K],
// d [rows][K/256], bs [rows][K/16]. Thread i takes element i. The maximum: a tree over keys
// (|x| bits << 32 | 255 - i), so the largest |x| and, among equal ones, the first element win.
DS4_KERNEL void DS4_BOUNDS(256) act_q8k_f32(const float* __restrict__ X, long long x_tok, int K, signed char* __restrict__ q,
                                            float* __restrict__ d, short* __restrict__ bs) {
    __shared__ u64 key[256];
    __shared__ int code[256];
    const int i = threadIdx.x, b = blockIdx.x;
    const long long t = blockIdx.y;
    const float* xb = X + t * x_tok + 256 * b;
    const float v = xb[i];
    key[i] = ((u64)(__float_as_uint(v) & 0x7fffffffu) << 32) | (u32)(255 - i);
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (i < s) key[i] = key[i] > key[i + s] ? key[i] : key[i + s];
        __syncthreads();
    }
    const u64 k = key[0];
    int c = 0;
    float dd = 0.0f;
    if ((k >> 32) != 0) {
        const float mx = xb[255 - (int)(k & 0xffu)];
        const float iscale = __fdiv_rn(-127.0f, mx);
        c = __float2int_rn(__fmul_rn(iscale, v)); // round half to even, as round_ties_even
        c = min(max(c, -127), 127);
        dd = __fdiv_rn(1.0f, iscale);
    }
    q[t * K + 256 * b + i] = (signed char)c;
    code[i] = c;
    __syncthreads();
    if (i < 16) {
        int s = 0;
#pragma unroll
        for (int j = 0; j < 16; j++) s += code[16 * i + j];
        bs[t * (K / 16) + 16 * b + i] = (short)s;
    }
    if (i == 0) d[t * (K / 256) + b] = dd;
}

#if GI_HAVE_MMA
// c = a·b (int8, zero accumulator in): 16 items x 8 rows x 32 k.
__device__ __forceinline__ void gi_mma0(int* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// Raw fields of group c of a row (66-byte blocks, 2-byte aligned): r[0] the block's d (f16 bits,
// loaded when dnew), r[1] the 4 grid indices, r[2] aux (4 x 7 sign bits, 4-bit scale).
__device__ __forceinline__ void gi_raw(const u8* __restrict__ row, int c, bool dnew, u32* r) {
    const u8* b = row + (size_t)(c >> 3) * 66;
    if (dnew) r[0] = *(const u16*)b;
    const u8* g = b + 2 + 8 * (c & 7);
    if (((size_t)g & 3) == 0) {
        r[1] = ((const u32*)g)[0], r[2] = ((const u32*)g)[1];
    } else {
        const u32 lo = *(const u16*)g, mid = *(const u32*)(g + 2), hi = *(const u16*)(g + 6);
        r[1] = lo | (mid << 16), r[2] = (mid >> 16) | (hi << 16);
    }
}

// Group from its raw fields: 8 words of int8 grid * sign (elements in order, 4 a word).
// Signs of grid entry k: 7 bits + parity (bit 7, even popcount: ksigns_iq2xs); sign bit e moved to
// the msb of byte e%4 by (4 bits) * 0x10204080 (partial products never meet: no carries), spread
// to 0xff / 0x00 bytes by a sign-replicating PRMT (selector nibbles 8..b), then -g = (g ^ 0xff) + 1
// per byte (g >= 8: no carry leaves a byte).
__device__ __forceinline__ void gi_deq(const u32* r, const u64* tab, u32* o) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u64 grid = tab[(r[1] >> (8 * k)) & 0xff];
        const u32 s7 = (r[2] >> (7 * k)) & 127;
        const u32 v0 = (s7 & 15u) * 0x10204080u, v1 = ((s7 >> 4) | ((__popc(s7) & 1u) << 3)) * 0x10204080u;
        const u32 m0 = ds4_prmt(v0, 0u, 0xba98u), m1 = ds4_prmt(v1, 0u, 0xba98u);
        o[2 * k] = ((u32)grid ^ m0) + (m0 & 0x01010101u);
        o[2 * k + 1] = ((u32)(grid >> 32) ^ m1) + (m1 & 0x01010101u);
    }
}
#endif

#define GI_NS 4 // groups in flight + 1 (X stages of the cp.async ring, raw-weight register slots); divides 8
struct alignas(16) GiSmem {
    u32 x[GI_NS][GI_BM][GI_LD]; // activation codes of group c, stage c % GI_NS
    u32 w[2][GI_BN][GI_LD];     // weight codes grid * sign, stage c & 1
    int ls[2][GI_BN];           // 2 ls + 1 of the group per row, stage c & 1
    float dw[2][GI_BN];         // weight d of the block per row, stage b & 1
    float dx[2][GI_BM];         // activation d of the block per item, stage b & 1
};

// W0/Y0: gate (blockIdx.z 0), W1/Y1: up (1); expert e's rows at W + e * slab. q/xd: the Q8_K codes
// and scales of the token rows (act_q8k_f32, row length cols); pair i reads token i / xdiv.
// Y[i * y_tok + r]. grp from gm_group_*_i32 with runs cut at GI_BM; CTA row blockIdx.y takes run
// blockIdx.y (none past grp[0]); m-tiles of 16 items wholly past the run are skipped.
#define GI_PARAMS                                                                                                  \
    const u8 *__restrict__ W0, const u8 *__restrict__ W1, long long slab, const int *__restrict__ sel,             \
        const signed char *__restrict__ q, const float *__restrict__ xd, int xdiv, float *__restrict__ Y0,          \
        float *__restrict__ Y1, long long y_tok, int rows, int cols, long long row_bytes, int n, const int *__restrict__ grp, int gmax
DS4_KERNEL void DS4_BOUNDS(128) gemmi8_iq2_xxs(GI_PARAMS) {
#if GI_HAVE_MMA
    __shared__ int items[GI_BM];
    __shared__ int expert;
    __shared__ u64 gtab[256];
    __shared__ GiSmem sm;
    constexpr int NS = GI_NS;
    constexpr int MT = 4; // m-tiles of 16 items per warp
    const int tid = threadIdx.x;
    if ((int)blockIdx.y >= grp[0]) return; // uniform over the CTA
    for (int e = tid; e < 256; e += 128) gtab[e] = ds4_iq2xxs_grid[e];
    if (tid < GI_BM) { // the run's pairs (one expert), -1 past it
        const int* perm = grp + 1 + gmax;
        const int st = grp[1 + blockIdx.y], e = max(sel[perm[st]], 0), qq = st + tid;
        items[tid] = (qq < n && max(sel[perm[qq]], 0) == e) ? perm[qq] : -1;
        if (tid == 0) expert = e;
    }
    __syncthreads();
    const bool up = blockIdx.z != 0;
    const int r0 = blockIdx.x * GI_BN, row = r0 + tid;
    const u8* wrow = (up ? W1 : W0) + (long long)expert * slab + (long long)min(row, rows - 1) * row_bytes;
    const bool live = row < rows;
    const int nch = cols / 32, nbk = cols / 256;
    const int warp = tid >> 5, lane = tid & 31, lr = lane & 7, lm = lane >> 3, g = lane >> 2, t4 = lane & 3;
    const int run = (blockIdx.y + 1 < (u32)grp[0] ? grp[2 + blockIdx.y] : n) - grp[1 + blockIdx.y];
    const int nmt = min(max((min(run, GI_BM) + 15) >> 4, 0), MT); // uniform

    // X: thread t copies 16-byte half (t & 1) of item t / 2's 32 codes; xo: byte offset, -1 none.
    const int xit = items[tid >> 1];
    const long long xo = xit >= 0 ? (long long)(xit / xdiv) * cols + 16 * (tid & 1) : -1;
    // Block scale of the item tid (tid < 64) for the next block.
    const int dit = tid < GI_BM ? items[tid] : -1;
    const float* xdp = dit >= 0 ? xd + (long long)(dit / xdiv) * nbk : nullptr;

    float acc[MT][4][4];
    int icc[MT][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.0f, icc[mt][nt][e] = 0;
    u32 wr[NS][3]; // raw fields of groups c .. c + NS - 2 in flight (ring slot c % NS)
#pragma unroll
    for (int j = 0; j < NS; j++) wr[j][0] = wr[j][1] = wr[j][2] = 0u;
    float dxn = 0.0f;
    // Group c (none past the row: an empty commit keeps the wait_group count uniform): X by
    // cp.async into stage c % NS, raw weights into r, d_x of the block to dxn.
    auto issue = [&](int c, u32* r) {
        if (c < nch) {
            ds4_cp16(&sm.x[c % NS][tid >> 1][4 * (tid & 1)], q + (xo >= 0 ? xo + 32 * c : 0), xo >= 0);
            if (live) gi_raw(wrow, c, (c & 7) == 0, r); // dead rows: zeros (d = 0)
            if ((c & 7) == 0 && tid < GI_BM) dxn = xdp ? xdp[c >> 3] : 0.0f;
        }
        ds4_cp_commit();
    };
#pragma unroll
    for (int j = 0; j < NS - 1; j++) issue(j, wr[j]);
    for (int cb = 0; cb < nch; cb += 8) { // one block (8 groups, unrolled: static ring slots)
        const int bst = (cb >> 3) & 1;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int c = cb + j, st = j & 1, xs = j % NS; // cb % 8 == 0: c & 1, c % NS
            u32* r = wr[j % NS];
            u32 o[8];
            gi_deq(r, gtab, o);
            *(uint4*)&sm.w[st][tid][0] = make_uint4(o[0], o[1], o[2], o[3]);
            *(uint4*)&sm.w[st][tid][4] = make_uint4(o[4], o[5], o[6], o[7]);
            sm.ls[st][tid] = 2 * (int)(r[2] >> 28) + 1;
            if (j == 0) sm.dw[bst][tid] = ds4_h2f_fast(r[0]);
            if (j == 0 && tid < GI_BM) sm.dx[bst][tid] = dxn;
            ds4_cp_wait<NS - 2>(); // group c landed (c + 1 .. c + NS - 2 may be in flight)
            __syncthreads();
            issue(c + NS - 1, wr[(j + NS - 1) % NS]); // the slot group c - 1 used
            u32 b[4][2];
#pragma unroll
            for (int np = 0; np < 2; np++) {
                u32 f[4];
                ds4_ldm4(f, &sm.w[st][32 * warp + 16 * np + 8 * (lm >> 1) + lr][4 * (lm & 1)]);
                b[2 * np][0] = f[0], b[2 * np][1] = f[1], b[2 * np + 1][0] = f[2], b[2 * np + 1][1] = f[3];
            }
            int2 ls[4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) ls[nt] = *(const int2*)&sm.ls[st][32 * warp + 8 * nt + 2 * t4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (mt >= nmt) continue; // uniform
                u32 a[4];
                ds4_ldm4(a, &sm.x[xs][16 * mt + lr + 8 * (lm & 1)][4 * (lm >> 1)]);
                int cc[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; nt++) gi_mma0(cc[nt], a, b[nt]);
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    icc[mt][nt][0] += ls[nt].x * cc[nt][0];
                    icc[mt][nt][1] += ls[nt].y * cc[nt][1];
                    icc[mt][nt][2] += ls[nt].x * cc[nt][2];
                    icc[mt][nt][3] += ls[nt].y * cc[nt][3];
                }
            }
        }
        // End of the block: acc += (d_w d_x) bsum, in block order (act.rs combine_iq2).
        float2 dw[4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) dw[nt] = *(const float2*)&sm.dw[bst][32 * warp + 8 * nt + 2 * t4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if (mt >= nmt) continue;
            const float x0 = sm.dx[bst][16 * mt + g], x1 = sm.dx[bst][16 * mt + g + 8];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                acc[mt][nt][0] = __fadd_rn(acc[mt][nt][0], __fmul_rn(__fmul_rn(dw[nt].x, x0), (float)icc[mt][nt][0]));
                acc[mt][nt][1] = __fadd_rn(acc[mt][nt][1], __fmul_rn(__fmul_rn(dw[nt].y, x0), (float)icc[mt][nt][1]));
                acc[mt][nt][2] = __fadd_rn(acc[mt][nt][2], __fmul_rn(__fmul_rn(dw[nt].x, x1), (float)icc[mt][nt][2]));
                acc[mt][nt][3] = __fadd_rn(acc[mt][nt][3], __fmul_rn(__fmul_rn(dw[nt].y, x1), (float)icc[mt][nt][3]));
#pragma unroll
                for (int e = 0; e < 4; e++) icc[mt][nt][e] = 0;
            }
        }
    }

    // acc[mt][nt][e]: item items[16 mt + g + 8 (e / 2)], row r0 + 32 warp + 8 nt + 2 t4 + e % 2.
    float* Y = up ? Y1 : Y0;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            const int it = items[16 * mt + g + 8 * e2];
            if (it < 0) continue;
            float* yr = Y + (long long)it * y_tok;
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e1 = 0; e1 < 2; e1++) {
                    const int r = r0 + 32 * warp + 8 * nt + 2 * t4 + e1;
                    if (r < rows) yr[r] = __fmul_rn(acc[mt][nt][2 * e2 + e1], 0.125f);
                }
        }
#else
    (void)W0, (void)W1, (void)slab, (void)sel, (void)q, (void)xd, (void)xdiv, (void)Y0, (void)Y1, (void)y_tok, (void)rows;
    (void)cols, (void)row_bytes, (void)n, (void)grp, (void)gmax;
#endif
}
