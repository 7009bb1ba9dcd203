// Hopper warpgroup MMA (wgmma) wrappers: A from registers, B from shared memory by descriptor,
// f16 inputs, f32 accumulators; sm_90a only (GW_HAVE 0 elsewhere: sm_100 has no wgmma, HIP none).
// Users: gemm_wg.cu, gemm_wgd.cu (also their shared MoE tile set-up and store, at the end),
// attn_tc.cu (the indexer's scores).
#pragma once
#include "prelude.cuh"
#include "ptx.cuh"

#if defined(DS4_CUDA) && DS4_ARCH >= 900 && DS4_ARCH < 1000
#define GW_HAVE 1 // wgmma: sm_90a only (not sm_100)
#else
#define GW_HAVE 0
#endif

#define GW_BM 64 // items (pairs) per CTA: the grouping's run (gemm.cu gm_group_*_i32, runs cut at 64)

#if GW_HAVE
template <int N> struct GwAcc {
    float v[N / 2]; // v[4j + e]: row g + 8 (e >> 1), item 8j + 2t + (e & 1) (of the warp's 16 rows)
};

__device__ __forceinline__ void gw_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void gw_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int K> __device__ __forceinline__ void gw_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(K) : "memory");
}
// Keep the compiler from touching accumulators / A registers across the asynchronous wgmma.
template <int N> __device__ __forceinline__ void gw_pin(GwAcc<N>& a) {
#pragma unroll
    for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(a.v[i])::"memory");
}
__device__ __forceinline__ void gw_pin_a(u32* a) {
#pragma unroll
    for (int i = 0; i < 8; i++) asm volatile("" : "+r"(a[i])::"memory");
}
__device__ __forceinline__ void gw_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor, no swizzle: start, leading (K) and stride (8 rows) byte offsets.
__device__ __forceinline__ u64 gw_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void gw_mma(GwAcc<16>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<32>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<48>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<64>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}

// N = 80 .. 128: the wide gate/up (gemm_wg.cu gwg_iq2_xxs_p1_d2_fw, runs of up to 128 items).
__device__ __forceinline__ void gw_mma(GwAcc<80>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, {%40,%41,%42,%43}, %44, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<96>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<112>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, {%56,%57,%58,%59}, %60, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}
__device__ __forceinline__ void gw_mma(GwAcc<128>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}

// N = 128, B MN-major (imm-trans-b 1), always accumulating (attn_tc.cu attn_wg: O += P V, the V
// rows staged as for S = Q K^T in 8 x 8 core matrices of 128 bytes; only the strides differ).
__device__ __forceinline__ void gw_mma_t(GwAcc<128>& acc, const u32* a, u64 desc) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// bf16 inputs, N = 64 (attn_tc.cu index_scores_wg: the indexer's FP4-simulated values, exact in
// bf16 but not in f16's exponent range).
__device__ __forceinline__ void gw_mma_bf16(GwAcc<64>& acc, const u32* a, u64 desc, int sd) {
    float* d = acc.v;
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(sd));
}

// A registers of a chunk's two k-steps (a[4 kk ..]) from the lane's two rows' decoded words w0 (row
// R0), w1 (row R1 = R0 + 8), element pairs 0..3 of its 8 weights: per k-step (R0, R1, R0, R1) x
// pairs (2 kk, 2 kk, 2 kk + 1, 2 kk + 1), the m64nNk16 A fragment's order.
__device__ __forceinline__ void gw_afrag(const u32* w0, const u32* w1, u32* a) {
    a[0] = w0[0], a[1] = w1[0], a[2] = w0[1], a[3] = w1[1];
    a[4] = w0[2], a[5] = w1[2], a[6] = w0[3], a[7] = w1[3];
}

// The 2 PL wgmma of one 32-element chunk, committed as one group: k-steps kk = 0, 1 of the A
// registers a[4 kk ..] times the X planes hi (chunk slot descriptor d = gw_desc of its shared
// address) and, when PL == 2, lo (4096 bytes on), into cc; the super-block's first (p == 0,
// kk == 0) with scale-d 0 (zeroes cc first). PL == 1 (DS4_GPU_GEMM_PLANES=1): X as its f16
// rounding alone, ~2^-11 per element.
// Descriptors are added to, not rebuilt: the start field is address / 16 (< 2^14 below 256 KiB
// of shared memory, so + 256 bytes = + 16 never carries out of it); a chunk's descriptor as
// gw_xdesc(base, slot) costs one uniform add where gw_desc took ~10 instructions a chunk.
template <int N, int PL> __device__ __forceinline__ void gw_chunk(GwAcc<N>& cc, const u32* a, u64 d, int p) {
    static_assert(PL == 1 || PL == 2, "X planes: hi, or hi and lo");
    gw_pin(cc);
    gw_fence();
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        gw_mma(cc, a + 4 * kk, d + 16u * kk, (p | kk) != 0);              // hi
        if (PL == 2) gw_mma(cc, a + 4 * kk, d + 256u + 16u * kk, 1); // lo
    }
    gw_commit();
    gw_pin(cc);
}
// The descriptor of X chunk slot `slot` (8 KiB apart from the slot-0 descriptor d0).
__device__ __forceinline__ u64 gw_xdesc(u64 d0, int slot) { return d0 + 512u * (u32)slot; }

// ---- The MoE tile's set-up and store, shared by gemm_wg.cu and gemm_wgd.cu ----

// Raw super-block S (BLK bytes a row at offset BLK S) of a CTA's BN weight rows (rows past `rows`
// repeat the last) into the stage at shared address so: RP pieces of 16 bytes a row from the
// 16-byte boundary below the block, piece k of row r at words RW r + 4 k; the last piece reads only
// up to the block's end (ds4_cp16n: the rest zero-filled), so nothing past the weights is read. A
// few 16-byte copies a row instead of BLK / 4 copies of 4 bytes and their address arithmetic
// (gemm_wg.cu: ~9% of the gate/up's instructions). The block of a row at address A then starts at
// byte (A + BLK S) % 16 of its staged row.
// Thread -> row tid / TPR, pieces tid % TPR + TPR j (TPR = NT / BN threads a row): one row address
// a call, then one add a piece (a piece-major split cost ~25 instructions a piece: its own row,
// division by RP, 64-bit multiply; sm_90a SASS).
template <int BN, int NT, int BLK, int RW, int RP>
__device__ __forceinline__ void gw_stage_blocks(u32 so, const u8* wbase, int r0, int rows, long long row_bytes, int S) {
    // A block starts at byte <= 14 of its first piece (2-byte aligned blocks), <= 12 (4-byte).
    static_assert(RP * 16 >= BLK + (BLK % 4 ? 14 : 12) && RW >= 4 * RP, "pieces cover the block");
    static_assert(NT % BN == 0, "whole threads a row");
    constexpr int TPR = NT / BN;
    const int r = threadIdx.x / TPR, k0 = threadIdx.x % TPR;
    const u8* a = wbase + (long long)min(r0 + r, rows - 1) * row_bytes + (long long)BLK * S;
    const u8* b = (const u8*)((size_t)a & ~(size_t)15);
    const int end = (int)((size_t)a & 15) + BLK; // the block's end, in bytes from b
    const u32 d = so + 4u * (u32)(RW * r);
#pragma unroll
    for (int j = 0; j < (RP + TPR - 1) / TPR; j++) {
        const int k = k0 + TPR * j;
        if (k < RP) ds4_cp16n(d + 16u * (u32)k, b + 16 * k, min(end - 16 * k, 16)); // >= 2 bytes
    }
}

// The run of one expert's pairs starting at starts[by] (gemm.cu gm_items; by: blockIdx.y, or the
// persistent forms' tile's run): items[m] = pair index or -1, *expert set; every thread of the
// CTA calls it (one barrier). Returns the valid items
// (a prefix of the tile): up to the next run's start. grp = [ngroups, starts[gmax], perm[n]] (runs
// of GW_BM), followed by the wide runs' [ngroups2, starts2[]] (runs of 2 GW_BM, gm_group_scan_i32):
// BM == 2 GW_BM reads those (the wide gate/up), the CTA then needs >= BM threads.
// xs[m] = xinv[items[m] / xdiv], the item's row scale for gw_store, by a 4-byte cp.async left
// uncommitted: it joins the body's first commit group, which every body waits for (and then
// passes a barrier) before its first decode. The store then reads the scale from shared memory:
// it loaded xinv and divided by xdiv per stored value before (ncu, 2k prompt: the N = 128
// form's epilogue alone was 6.6% of the gate/up's stall samples, its FMULs waiting on xinv).
// Pairs in run `by` (< ngroups) of the runs of BM (64, or the wide runs of 128), at most BM.
template <int BM = GW_BM> __device__ __forceinline__ int gw_run_len(const int* __restrict__ grp, int n, int gmax, int by) {
    const int* gs = BM == GW_BM ? grp : grp + 1 + gmax + n; // [ngroups, starts[]]
    return min(max((by + 1 < gs[0] ? gs[2 + by] : n) - gs[1 + by], 0), BM);
}
template <int BM = GW_BM>
__device__ __forceinline__ int gw_items(const int* __restrict__ grp, const int* __restrict__ sel, int n, int gmax,
                                        int* items, int* expert, const float* __restrict__ xinv, int xdiv, float* xs,
                                        int by) {
    static_assert(BM == GW_BM || BM == 2 * GW_BM, "runs of 64 or (wide) 128");
    const int tid = threadIdx.x;
    const int* perm = grp + 1 + gmax;
    const int* gs = BM == GW_BM ? grp : perm + n; // [ngroups, starts[]] of the runs of BM
    if (tid < BM) {
        const int st = gs[1 + by], e = max(sel[perm[st]], 0), qq = st + tid;
        const int it = (qq < n && max(sel[perm[qq]], 0) == e) ? perm[qq] : -1;
        items[tid] = it;
        if (it >= 0) ds4_cp4(&xs[tid], xinv + it / xdiv);
        if (tid == 0) *expert = e;
    }
    __syncthreads();
    return gw_run_len<BM>(grp, n, gmax, by);
}

// Persistent forms (_fwp): a CTA an SM takes tiles from a launch-wide counter ctr[0] until they
// run out (tiles in run-major order: tile t is run t / TX, TX tiles a run), so the per-CTA set-up
// (grid tables) is paid once an SM, no CTA launches for absent runs (the grid is not sized by the
// worst case), and a CTA that drew short runs takes more of them. The last CTA to leave resets
// ctr[0] and its leave counter ctr[1] for the next launch (graph replays too); every thread calls
// both; the tile is read after a barrier (s_tile: shared).
// The next tile is drawn by thread 0 in the current tile's store (gw_store ctr, s_tile), so the
// atomic's round trip overlaps the stores instead of preceding the next set-up; the first by
// gw_first_tile. H200 (bench/results/gpu-moe-s27-h200.txt): the gate/up -2.2% a call, the down
// +4-5% either way: ptxas serializes the down's wgmma in its persistent form for want of
// registers (C7512; not the default: gemm_wg.rs DS4_GPU_GW_PERSIST; tests/compile.rs).
__device__ __forceinline__ void gw_first_tile(u32* ctr, int* s_tile) {
    if (threadIdx.x == 0) *s_tile = (int)atomicAdd(ctr, 1u);
}
__device__ __forceinline__ void gw_leave(u32* ctr) {
    if (threadIdx.x == 0) {
        __threadfence(); // this CTA's last draw of ctr[0] precedes its leave
        if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
            atomicExch(ctr, 0u);
            atomicExch(ctr + 1, 0u);
        }
    }
}

// Store of a lane's accumulators: acc.v[4j + e] is row rr0 + 8 (e >> 1) (rr0 = the CTA's first row
// + the lane's first), item 8j + 2t + (e & 1); y = acc * 2^-s of the item's token (xs: gw_items).
// Persistent forms: ctr, s_tile (else null): thread 0 draws the next tile into s_tile meanwhile.
template <int N>
__device__ __forceinline__ void gw_store(const GwAcc<N>& acc, const int* items, const float* xs, int t, int rr0, int rows,
                                         float* __restrict__ Y, long long y_tok, u32* ctr = nullptr, int* s_tile = nullptr) {
    u32 nxt = 0;
    if (ctr && threadIdx.x == 0) nxt = atomicAdd(ctr, 1u);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const int m = 8 * (i >> 2) + 2 * t + (i & 1);
        const int it = items[m], r = rr0 + ((i & 2) ? 8 : 0);
        if (it >= 0 && r < rows) Y[(long long)it * y_tok + r] = acc.v[i] * xs[m];
    }
    if (ctr && threadIdx.x == 0) *s_tile = (int)nxt;
}
#endif
