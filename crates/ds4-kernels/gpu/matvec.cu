// Decode-time weight products (n <= 4 token rows), bound by weight bandwidth.
//
// Layout: a lane owns one 8-element slice (chunk c = 32 elements, quarter q = lane & 3), so a warp
// step covers MV_CPW = DS4_WARP / 4 consecutive chunks: x loads are contiguous across lanes (two
// float4 per token) and weight loads of one warp instruction fall in one short span of the row.
// The x slice stays in registers while the warp runs its MV_R rows (x read once per MV_R rows);
// `kspl` warps of a CTA split the column steps of the same rows (partials added in a fixed order
// through shared memory: deterministic, no second pass). A CTA is MV_WARPS warps and covers
// (MV_WARPS / kspl) * MV_R rows.
//
// Products (semantics: ds4-cpu backend.rs):
//   mv<NT>_<t>:    y[t*y_tok + z*y_z + r] = W_z[r] . x[t*x_tok + z*x_z ..], t < n <= NT, z = blockIdx.z
//   mvgu_<t>:      routed gate+up+SwiGLU for pair p = blockIdx.y (token p / k):
//                  h[p*ff + r] = silu(min(g, c)) * clamp(u, -c, c) * wgt[p]
//   mvdown_<t>:    routed down + slot sum for token t = blockIdx.y:
//                  out[t*d + r] = sum over slots s in order of down_{sel[t*k+s]}[r] . h[(t*k+s)*ff ..]
// Quantised slices are decoded with exact small-int -> float conversions (0x4B000000 | b is
// 2^23 + b) and the block scale is applied once per slice (sum(q*x) * d): the same function as
// the CPU up to f32 rounding of the sums.
#include "prelude.cuh"
#include "dequant.cuh"
// route.cuh: ds4_route_token (mvq_route_f16's last CTA; shared with model.cu moe_route_fast)
#include "route.cuh"

#define MV_WARPS 8
#define MV_THREADS (MV_WARPS * DS4_WARP)
#define MV_R 4             // rows per warp
#define MV_CPW (DS4_WARP / 4) // chunks per warp step
#define MV_MAXK 8          // slots per token in mvdown

// Byte b (0..3) of v minus `off`, exact: the float with bits 0x4B0000bb is 2^23 + bb.
__device__ __forceinline__ float mv_byte(u32 v, int b, float off = 0.0f) {
#if defined(DS4_CUDA)
    u32 f = __byte_perm(v, 0x4B000000u, 0x7440u | b); // one PRMT: bytes [v_b, 0, 0, 0x4B]
#else
    u32 f = 0x4B000000u | ((v >> (8 * b)) & 0xffu);
#endif
    return __int_as_float(f) - (8388608.0f + off);
}

// acc[t] += W_row[chunk c, slice q] . xs[t][0..8] for t < NT; sx[t] = sum of xs[t]; gs: the
// IQ2_XXS grid in shared memory (other types ignore it).
template <int T, int NT> struct MvSlice {
    static __device__ __forceinline__ void dot(const u8* __restrict__ row, int c, int q, const float (&xs)[NT][8],
                                               const float (&sx)[NT], const u64* gs, float (&acc)[NT]) {
        float w[8];
        deq_slice<T>(row, c, q, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float a = acc[t];
#pragma unroll
            for (int i = 0; i < 8; i++) a = fmaf(w[i], xs[t][i], a);
            acc[t] = a;
        }
    }
};

// F16: one 16-byte load, 8 conversions (ds4_h2f's branches made F16 ALU-bound).
template <int NT> struct MvSlice<T_F16, NT> {
    static __device__ __forceinline__ void dot(const u8* __restrict__ row, int c, int q, const float (&xs)[NT][8],
                                               const float (&sx)[NT], const u64* gs, float (&acc)[NT]) {
        uint4 v = *(const uint4*)(row + (size_t)c * 64 + q * 16);
        u32 u[4] = {v.x, v.y, v.z, v.w};
        float w[8];
#pragma unroll
        for (int j = 0; j < 4; j++) w[2 * j] = ds4_h2f_fast(u[j] & 0xffffu), w[2 * j + 1] = ds4_h2f_fast(u[j] >> 16);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float a = acc[t];
#pragma unroll
            for (int i = 0; i < 8; i++) a = fmaf(w[i], xs[t][i], a);
            acc[t] = a;
        }
    }
};

// Q8_0 (34-byte blocks: d f16, qs i8[32]): the slice's 8 quants are bytes 2 + 8q .. of block c,
// read as two words (+ a halfword when they start 2 bytes past a word: rows are 2-byte aligned).
template <int NT> struct MvSlice<T_Q8_0, NT> {
    static __device__ __forceinline__ void dot(const u8* __restrict__ row, int c, int q, const float (&xs)[NT][8],
                                               const float (&sx)[NT], const u64* gs, float (&acc)[NT]) {
        const u8* b = row + (size_t)c * 34;
        float d = ds4_h2f(*(const u16*)b);
        const u8* a = b + 2 + 8 * q;
        bool odd = ((size_t)a & 2) != 0; // a = 4k + 2: bytes straddle three words
        const u32* p = (const u32*)(a - (odd ? 2 : 0));
        u32 w0 = p[0], w1 = p[1];
        u32 e = *(const u16*)(odd ? (const u8*)p + 8 : (const u8*)p + 4); // in bounds either way
        u32 lo = odd ? (w0 >> 16) | (w1 << 16) : w0;
        u32 hi = odd ? (w1 >> 16) | (e << 16) : w1;
        lo ^= 0x80808080u, hi ^= 0x80808080u; // i8 -> u8 + 128
        float g[8];
#pragma unroll
        for (int i = 0; i < 4; i++) g[i] = mv_byte(lo, i, 128.0f), g[4 + i] = mv_byte(hi, i, 128.0f);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) s = fmaf(g[i], xs[t][i], s);
            acc[t] = fmaf(d, s, acc[t]);
        }
    }
};

// Q2_K (84-byte blocks per 256): slice q of chunk p = c & 7 (h = p/4, j = p%4) is elements
// 16i + l0 .. +8 (i = q/2, l0 = 8(q&1)): 2-bit fields (qs[32h + 16i + l0 + l] >> 2j) & 3, one
// scale byte 8h + 2j + i. Sum (dl*v - ml) * x = dl * sum(v*x) - ml * sum(x).
template <int NT> struct MvSlice<T_Q2_K, NT> {
    static __device__ __forceinline__ void dot(const u8* __restrict__ row, int c, int q, const float (&xs)[NT][8],
                                               const float (&sx)[NT], const u64* gs, float (&acc)[NT]) {
        const u8* b = row + (size_t)(c >> 3) * 84;
        int p = c & 7, h = p >> 2, j = p & 3, i = q >> 1;
        u32 dd = *(const u32*)(b + 80);
        float d = ds4_h2f((u16)dd), dmin = ds4_h2f((u16)(dd >> 16));
        u32 s = b[8 * h + 2 * j + i];
        float dl = ds4_mul_rn(d, (float)(s & 15)), ml = ds4_mul_rn(dmin, (float)(s >> 4));
        const u32* qs = (const u32*)(b + 16 + 32 * h + 8 * q);
        u32 v0 = (qs[0] >> (2 * j)) & 0x03030303u, v1 = (qs[1] >> (2 * j)) & 0x03030303u;
        float g[8];
#pragma unroll
        for (int l = 0; l < 4; l++) g[l] = mv_byte(v0, l), g[4 + l] = mv_byte(v1, l);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float a = 0.0f;
#pragma unroll
            for (int l = 0; l < 8; l++) a = fmaf(g[l], xs[t][l], a);
            acc[t] = fmaf(dl, a, fmaf(-ml, sx[t], acc[t]));
        }
    }
};

// IQ2_XXS (66-byte blocks per 256): slice q of chunk c is run q of group c & 7: 8 grid
// magnitudes (entry g[q], from shared memory) with 7 sign bits (aux >> 7q) + parity, times db.
template <int NT> struct MvSlice<T_IQ2_XXS, NT> {
    static __device__ __forceinline__ void dot(const u8* __restrict__ row, int c, int q, const float (&xs)[NT][8],
                                               const float (&sx)[NT], const u64* gs, float (&acc)[NT]) {
        const u8* b = row + (size_t)(c >> 3) * 66;
        const u16* g2 = (const u16*)(b + 2 + 8 * (c & 7));
        float d = ds4_h2f(*(const u16*)b);
        u32 idx = g2[q >> 1];
        u32 aux = (u32)g2[2] | ((u32)g2[3] << 16);
        float db = ds4_mul_rn(ds4_mul_rn(d, 0.5f + (float)(aux >> 28)), 0.25f);
        u64 grid = gs[(idx >> (8 * (q & 1))) & 0xff];
        u32 s7 = (aux >> (7 * q)) & 127;
        u32 signs = s7 | ((__popc(s7) & 1) << 7);
        u32 lo = (u32)grid, hi = (u32)(grid >> 32);
        float g[8];
#pragma unroll
        for (int l = 0; l < 8; l++) {
            float m = mv_byte(l < 4 ? lo : hi, l & 3);
            g[l] = __int_as_float(__float_as_int(m) ^ (((signs >> l) & 1u) << 31));
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float a = 0.0f;
#pragma unroll
            for (int l = 0; l < 8; l++) a = fmaf(g[l], xs[t][l], a);
            acc[t] = fmaf(db, a, acc[t]);
        }
    }
};

// The IQ2_XXS grid copied into shared memory (other types: nothing); all threads must call it.
template <int T> __device__ __forceinline__ const u64* mv_grid(u64* sg) {
    if (T != T_IQ2_XXS) return sg;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sg[i] = ds4_iq2xxs_grid[i];
    __syncthreads();
    return sg;
}

// x slice of chunk c, quarter q for NT tokens (t >= n repeats token n - 1) and its sums.
template <int NT>
__device__ __forceinline__ void mv_x(const float* __restrict__ xb, long long x_tok, int n, int c, int q, float (&xs)[NT][8],
                                     float (&sx)[NT]) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float4* xv = (const float4*)(xb + (long long)min(t, n - 1) * x_tok + (long long)c * 32 + 8 * q);
        float4 a = xv[0], b = xv[1];
        xs[t][0] = a.x, xs[t][1] = a.y, xs[t][2] = a.z, xs[t][3] = a.w;
        xs[t][4] = b.x, xs[t][5] = b.y, xs[t][6] = b.z, xs[t][7] = b.w;
        sx[t] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
    }
}

// Adds this warp's columns of rows rp[0..R] times x (chunks c0 = ks*MV_CPW, step kspl*MV_CPW).
// U > 1: U column steps per iteration while all of them are whole (every load of the U steps
// issued before the first use), then single guarded steps; same per-lane order of the sums.
template <int T, int NT, int R, int U = 1>
__device__ __forceinline__ void mv_rows(const u8* const (&rp)[R], const float* __restrict__ xb, long long x_tok, int n,
                                        int chunks, int ks, int kspl, const u64* gs, float (&acc)[R][NT]) {
    int lane = threadIdx.x % DS4_WARP, q = lane & 3, stride = kspl * MV_CPW;
    int c0 = ks * MV_CPW;
    if (U > 1) {
        for (; c0 + (U - 1) * stride + MV_CPW <= chunks; c0 += U * stride) { // warp-uniform
            float xs[U][NT][8], sx[U][NT];
#pragma unroll
            for (int u = 0; u < U; u++) mv_x<NT>(xb, x_tok, n, c0 + u * stride + lane / 4, q, xs[u], sx[u]);
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int i = 0; i < R; i++) MvSlice<T, NT>::dot(rp[i], c0 + u * stride + lane / 4, q, xs[u], sx[u], gs, acc[i]);
        }
    }
    for (; c0 < chunks; c0 += stride) {
        int c = c0 + lane / 4;
        if (c < chunks) {
            float xs[NT][8], sx[NT];
            mv_x<NT>(xb, x_tok, n, c, q, xs, sx);
#pragma unroll
            for (int i = 0; i < R; i++) MvSlice<T, NT>::dot(rp[i], c, q, xs, sx, gs, acc[i]);
        }
    }
}

// Warp sums of acc; then the first warp of each kspl group holds, in lane j < R*NT, the total
// of value j = (row j / NT, token j % NT) over its kspl warps (returned; other lanes/warps: junk).
// red: MV_WARPS * R * NT floats. Every thread of the CTA must call it.
template <int NT, int R = MV_R> __device__ __forceinline__ float mv_reduce(float (&acc)[R][NT], int kspl, float* red) {
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = ds4_warp_sum(acc[i][t]);
            if (lane == i * NT + t) v = s;
        }
    if (kspl == 1) return v;
    if (lane < R * NT) red[warp * R * NT + lane] = v;
    __syncthreads();
    if (warp % kspl == 0 && lane < R * NT) {
        v = 0.0f;
        for (int s = 0; s < kspl; s++) v += red[(warp + s) * R * NT + lane];
    }
    return v;
}

template <int T, int NT, int R = MV_R, int U = 1>
__device__ __forceinline__ void mv_body(const u8* __restrict__ W, long long w_z, const float* __restrict__ x, long long x_tok,
                                        long long x_z, float* __restrict__ y, long long y_tok, long long y_z, int rows, int cols,
                                        long long row_bytes, int n, int kspl) {
    __shared__ u64 sg[T == T_IQ2_XXS ? 256 : 1];
    __shared__ float red[MV_WARPS * R * NT];
    const u64* gs = mv_grid<T>(sg);
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, z = blockIdx.z;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    if (r0 < rows) { // warp-uniform
        const u8* rp[R];
#pragma unroll
        for (int i = 0; i < R; i++) rp[i] = W + (long long)z * w_z + (long long)min(r0 + i, rows - 1) * row_bytes;
        mv_rows<T, NT, R, U>(rp, x + (long long)z * x_z, x_tok, n, cols / 32, warp % kspl, kspl, gs, acc);
    }
    float v = mv_reduce<NT, R>(acc, kspl, red);
    int r = r0 + lane / NT, t = lane % NT;
    if (warp % kspl == 0 && lane < R * NT && r < rows && t < n) y[(long long)t * y_tok + (long long)z * y_z + r] = v;
}

// Staged form (mvs<NT>_<t>, the default for n = 1..4): a CTA owns a tile of `rc` consecutive rows
// × the byte range [kb0, kb0 + kbytes) of each (the whole row when ks = gridDim.y = 1). It first
// copies the tile into shared memory with coalesced 16-byte loads, all issued before the first
// store (up to MVS_STAGE bytes in flight per CTA, several CTAs per SM), then computes from shared
// memory in the slice layout above: warp w takes row group g = w / ksi (rows g, g + wg, ..., wg =
// MV_WARPS / ksi) and column steps w % ksi, w % ksi + ksi, ..., its x slices in registers across
// its rows. Partials of the ksi warps of a row are added in warp order; with ks > 1 the CTA
// writes part[((kz * n + t) * zs + z) * rows + r] and mvs_sum_f32 adds the ks tiles in order.
// Needs: row_bytes and tile_bytes multiples of 16, tiles of whole blocks (host: matvec.rs).
#define MVS_STAGE 17408 // 16 rows of Q8_0 x 1024, 4 of 4096, 2 of 8192; 8 rows of F16 x 1024
#define MVS_V4 (MVS_STAGE / 16)
#define MVS_LD ((MVS_V4 + MV_THREADS - 1) / MV_THREADS)

template <int T, int NT>
__device__ __forceinline__ void mvs_body(const u8* __restrict__ W, long long w_z, const float* __restrict__ x,
                                         long long x_tok, long long x_z, float* __restrict__ y, long long y_tok,
                                         long long y_z, float* __restrict__ part, int rows, int chunks,
                                         long long row_bytes, int tile_bytes, int tile_chunks, int n, int rc, int ksi) {
    constexpr int R = 16 / NT; // rows per warp at most (R * NT accumulators)
    __shared__ uint4 stage[MVS_V4];
    __shared__ float red[MV_WARPS * 16];
    __shared__ u64 sg[T == T_IQ2_XXS ? 256 : 1];
    const u64* gs = mv_grid<T>(sg);
    int tid = threadIdx.x, warp = tid / DS4_WARP, lane = tid % DS4_WARP;
    int kz = blockIdx.y, z = blockIdx.z;
    int r0 = blockIdx.x * rc, nr = min(rc, rows - r0);
    long long kb0 = (long long)kz * tile_bytes;
    int kbytes = (int)min((long long)tile_bytes, row_bytes - kb0);
    int w16 = kbytes >> 4, total = nr * w16;
    const u8* base = W + (long long)z * w_z + (long long)r0 * row_bytes + kb0;
    uint4 v[MVS_LD];
#pragma unroll
    for (int j = 0; j < MVS_LD; j++) {
        int i = tid + j * MV_THREADS;
        if (i < total) {
            int rr = i / w16;
            v[j] = *(const uint4*)(base + (long long)rr * row_bytes + 16 * (i - rr * w16));
        }
    }
#pragma unroll
    for (int j = 0; j < MVS_LD; j++) {
        int i = tid + j * MV_THREADS;
        if (i < total) stage[i] = v[j];
    }
    __syncthreads();
    int wg = MV_WARPS / ksi, g = warp / ksi, q = lane & 3;
    int kc0 = kz * tile_chunks, tc = min(tile_chunks, chunks - kc0);
    const u8* sm = (const u8*)stage;
    const float* xb = x + (long long)z * x_z + (long long)kc0 * 32;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    for (int c0 = (warp % ksi) * MV_CPW; c0 < tc; c0 += ksi * MV_CPW) { // warp-uniform
        int c = c0 + lane / 4;
        if (c < tc) {
            float xs[NT][8], sx[NT];
            mv_x<NT>(xb, x_tok, n, c, q, xs, sx);
#pragma unroll
            for (int i = 0; i < R; i++)
                if (g + wg * i < nr) MvSlice<T, NT>::dot(sm + (g + wg * i) * kbytes, c, q, xs, sx, gs, acc[i]);
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++)
        if (g + wg * i < nr) // warp-uniform
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float a = ds4_warp_sum(acc[i][t]);
                if (lane == i * NT + t) s = a;
            }
    if (lane < R * NT) red[warp * 16 + lane] = s;
    __syncthreads();
    if (tid < rc * NT) {
        int lr = tid / NT, t = tid % NT, gg = lr % wg, i = lr / wg;
        if (lr < nr && t < n && i < R) {
            float o = 0.0f;
            for (int k = 0; k < ksi; k++) o += red[(gg * ksi + k) * 16 + i * NT + t];
            int r = r0 + lr;
            if (gridDim.y == 1)
                y[(long long)t * y_tok + (long long)z * y_z + r] = o;
            else
                part[(((long long)kz * n + t) * gridDim.z + z) * rows + r] = o;
        }
    }
}

template <int T>
__device__ __forceinline__ void mvgu_body(const u8* __restrict__ Wg, const u8* __restrict__ Wu, const int* __restrict__ sel,
                                          long long slab, const float* __restrict__ x, int k, const float* __restrict__ wgt,
                                          float clamp, float* __restrict__ h, int rows, int cols, long long row_bytes, int kspl) {
    __shared__ u64 sg[T == T_IQ2_XXS ? 256 : 1];
    __shared__ float red[MV_WARPS * MV_R * 2];
    const u64* gs = mv_grid<T>(sg);
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, p = blockIdx.y;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * MV_R;
    // acc[i][0]: gate row r0 + i, acc[i][1]: up row r0 + i (one token each).
    float acc[MV_R][2];
#pragma unroll
    for (int i = 0; i < MV_R; i++) acc[i][0] = 0.0f, acc[i][1] = 0.0f;
    if (r0 < rows) {
        long long wo = (long long)max(sel[p], 0) * slab;
        const float* xb = x + (long long)(p / k) * cols;
        int chunks = cols / 32, q = lane & 3;
        const u8 *rg[MV_R], *ru[MV_R];
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
            long long o = wo + (long long)min(r0 + i, rows - 1) * row_bytes;
            rg[i] = Wg + o, ru[i] = Wu + o;
        }
        for (int c0 = (warp % kspl) * MV_CPW; c0 < chunks; c0 += kspl * MV_CPW) {
            int c = c0 + lane / 4;
            if (c < chunks) {
                float xs[1][8], sx[1];
                mv_x<1>(xb, cols, 1, c, q, xs, sx);
#pragma unroll
                for (int i = 0; i < MV_R; i++) {
                    float ag[1] = {acc[i][0]}, au[1] = {acc[i][1]};
                    MvSlice<T, 1>::dot(rg[i], c, q, xs, sx, gs, ag);
                    MvSlice<T, 1>::dot(ru[i], c, q, xs, sx, gs, au);
                    acc[i][0] = ag[0], acc[i][1] = au[0];
                }
            }
        }
    }
    float v = mv_reduce<2>(acc, kspl, red); // lane 2i: gate row r0+i, lane 2i+1: up
    float u = ds4_shfl_xor(v, 1);
    int r = r0 + lane / 2;
    if (warp % kspl == 0 && lane < 2 * MV_R && (lane & 1) == 0 && r < rows) {
        float gv = fminf(v, clamp), uv = fminf(fmaxf(u, -clamp), clamp);
        h[(long long)p * rows + r] = gv * (1.0f / (1.0f + expf(-gv))) * uv * wgt[p];
    }
}

template <int T>
__device__ __forceinline__ void mvdown_body(const u8* __restrict__ W, const int* __restrict__ sel, long long slab,
                                            const float* __restrict__ hx, int k, float* __restrict__ out, int rows, int cols,
                                            long long row_bytes, int kspl) {
    __shared__ u64 sg[T == T_IQ2_XXS ? 256 : 1];
    __shared__ float red[MV_MAXK][MV_WARPS * MV_R];
    const u64* gs = mv_grid<T>(sg);
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, tok = blockIdx.y;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * MV_R;
    for (int s = 0; s < k; s++) {
        float acc[MV_R][1];
#pragma unroll
        for (int i = 0; i < MV_R; i++) acc[i][0] = 0.0f;
        int pr = tok * k + s;
        if (r0 < rows) {
            const u8* rp[MV_R];
#pragma unroll
            for (int i = 0; i < MV_R; i++)
                rp[i] = W + (long long)max(sel[pr], 0) * slab + (long long)min(r0 + i, rows - 1) * row_bytes;
            mv_rows<T, 1, MV_R>(rp, hx + (long long)pr * cols, cols, 1, cols / 32, warp % kspl, kspl, gs, acc);
        }
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
            float t = ds4_warp_sum(acc[i][0]);
            if (lane == i) v = t;
        }
        if (lane < MV_R) red[s][warp * MV_R + lane] = v;
    }
    __syncthreads();
    int r = r0 + lane;
    if (warp % kspl == 0 && lane < MV_R && r < rows) {
        float o = 0.0f; // slots in selection order, each the sum of its kspl partials
        for (int s = 0; s < k; s++) {
            float v = 0.0f;
            for (int j = 0; j < kspl; j++) v += red[s][(warp + j) * MV_R + lane];
            o += v;
        }
        out[(long long)tok * rows + r] = o;
    }
}

#define MV_PARAMS                                                                                                      \
    const u8 *__restrict__ W, long long w_z, const float *__restrict__ x, long long x_tok, long long x_z,              \
        float *__restrict__ y, long long y_tok, long long y_z, int rows, int cols, long long row_bytes, int n, int kspl
#define MV_ARGS W, w_z, x, x_tok, x_z, y, y_tok, y_z, rows, cols, row_bytes, n, kspl
#define MVGU_PARAMS                                                                                                    \
    const u8 *__restrict__ Wg, const u8 *__restrict__ Wu, const int *__restrict__ sel, long long slab,                \
        const float *__restrict__ x, int k, const float *__restrict__ wgt, float clamp, float *__restrict__ h, int rows, \
        int cols, long long row_bytes, int kspl
#define MVGU_ARGS Wg, Wu, sel, slab, x, k, wgt, clamp, h, rows, cols, row_bytes, kspl
#define MVDOWN_PARAMS                                                                                                  \
    const u8 *__restrict__ W, const int *__restrict__ sel, long long slab, const float *__restrict__ hx, int k,       \
        float *__restrict__ out, int rows, int cols, long long row_bytes, int kspl
#define MVDOWN_ARGS W, sel, slab, hx, k, out, rows, cols, row_bytes, kspl

// NT = 1 serves n = 1; NT = 2 serves n = 2; NT = 4 serves n = 3, 4.
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_f32(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F32, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_f32(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F32, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_f32(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F32, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_f16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F16, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_f16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F16, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_f16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_F16, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_bf16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_BF16, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_bf16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_BF16, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_bf16(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_BF16, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv2_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv4_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 4>(MV_ARGS); }

#define MVS_PARAMS                                                                                                     \
    const u8 *__restrict__ W, long long w_z, const float *__restrict__ x, long long x_tok, long long x_z,              \
        float *__restrict__ y, long long y_tok, long long y_z, float *__restrict__ part, int rows, int chunks,        \
        long long row_bytes, int tile_bytes, int tile_chunks, int n, int rc, int ksi
#define MVS_ARGS W, w_z, x, x_tok, x_z, y, y_tok, y_z, part, rows, chunks, row_bytes, tile_bytes, tile_chunks, n, rc, ksi

DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_f32(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F32, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_f32(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F32, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_f32(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F32, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_f16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F16, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_f16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F16, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_f16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_F16, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_bf16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_BF16, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_bf16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_BF16, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_bf16(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_BF16, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_q8_0(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q8_0, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_q8_0(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q8_0, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_q8_0(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q8_0, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_q2_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q2_K, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_q2_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q2_K, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_q2_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q2_K, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_q4_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q4_K, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_q4_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q4_K, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_q4_k(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_Q4_K, 4>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs1_iq2_xxs(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_IQ2_XXS, 1>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs2_iq2_xxs(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_IQ2_XXS, 2>(MVS_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvs4_iq2_xxs(MVS_PARAMS) { ds4_pdl_enter(); mvs_body<T_IQ2_XXS, 4>(MVS_ARGS); }

// ks > 1 tiles of mvs*: y[t*y_tok + z*y_z + r] = sum over k < ks in order of part[k][t][z][r];
// i = (t * zs + z) * rows + r < total = n * zs * rows.
DS4_KERNEL void DS4_BOUNDS(256) mvs_sum_f32(const float* __restrict__ part, int ks, long long total, int zs, int rows,
                                            float* __restrict__ y, long long y_tok, long long y_z) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float o = 0.0f;
    for (int k = 0; k < ks; k++) o += part[(long long)k * total + i];
    long long r = i % rows, tz = i / rows;
    y[(tz / zs) * y_tok + (tz % zs) * y_z + r] = o;
}

// Opt-in n = 1 variants (GpuBackend::set_matvec_variant; not yet measured): v1 one row per warp,
// 4 column steps per iteration; v2 two rows, 2 steps; v3 the default shape (4 rows, 1 step) held
// to 4 CTAs per SM (at most 64 registers with warp 32: one wave for 16384 rows).
#define MV_LB4 MV_THREADS, 4
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v1_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 1, 1, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v2_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 1, 2, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_LB4) mv1v3_q8_0(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q8_0, 1, 4, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v1_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 1, 1, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v2_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 1, 2, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_LB4) mv1v3_q2_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q2_K, 1, 4, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v1_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 1, 1, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v2_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 1, 2, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_LB4) mv1v3_q4_k(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_Q4_K, 1, 4, 1>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v1_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 1, 1, 4>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mv1v2_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 1, 2, 2>(MV_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_LB4) mv1v3_iq2_xxs(MV_PARAMS) { ds4_pdl_enter(); mv_body<T_IQ2_XXS, 1, 4, 1>(MV_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_f32(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_F32>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_f16(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_F16>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_bf16(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_BF16>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_q8_0(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_Q8_0>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_q2_k(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_Q2_K>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_q4_k(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_Q4_K>(MVGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvgu_iq2_xxs(MVGU_PARAMS) { ds4_pdl_enter(); mvgu_body<T_IQ2_XXS>(MVGU_ARGS); }

DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_f32(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_F32>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_f16(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_F16>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_bf16(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_BF16>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_q8_0(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_Q8_0>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_q2_k(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_Q2_K>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_q4_k(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_Q4_K>(MVDOWN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvdown_iq2_xxs(MVDOWN_PARAMS) { ds4_pdl_enter(); mvdown_body<T_IQ2_XXS>(MVDOWN_ARGS); }

// ---- One-row products with every load of U column steps × R rows issued before any math
// (mvq_r<R>u<U>_<t>, n = 1; Q8_0 and F16). Lanes as in mv_body (chunk c = step + lane / 4,
// 8-element slice q = lane & 3); the raw words of U steps × R rows stay in registers (Q8_0:
// U * R * 272 bytes per warp in flight, F16: U * R * 512) and are decoded only after all were
// asked for; the x slice of a step (read through L1) serves its R rows. Each lane adds its slices
// in step order, then warp sums and the kspl partials in warp order (deterministic).
// y[z*y_z + r] = W_z[r] . x[z*x_z ..] for r < rows, z = blockIdx.z.
// H200: r2u4 (544 B x 4 = 2.2 KB per warp) reaches 2.9 TB/s on the Q8_0 head, 2.1-2.4 on the
// 8-34 MB products (mmc1_q8_0: 1.4-2.1); F16 3.6 TB/s (4096 -> 16384).
template <int T> struct MvqRaw;

// Q8_0: the scale halfword and the slice's 8 quants (2 words, + a halfword when they start 2 bytes
// past a word); decoded as MvSlice<T_Q8_0>, the scale by cvt.
template <> struct MvqRaw<T_Q8_0> {
    u32 d, w0, w1, e;
    bool odd;
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int q) {
        const u8* b = row + (size_t)c * 34;
        const u8* a = b + 2 + 8 * q;
        odd = ((size_t)a & 2) != 0;
        const u32* p = (const u32*)(a - (odd ? 2 : 0));
        d = *(const u16*)b;
        w0 = p[0];
        w1 = p[1];
        e = odd ? (u32)(*(const u16*)((const u8*)p + 8)) : 0u; // in bounds: the slice's last 2 bytes
    }
    __device__ __forceinline__ float dot(const float4& xa, const float4& xb, float acc) const {
        u32 lo = odd ? (w0 >> 16) | (w1 << 16) : w0;
        u32 hi = odd ? (w1 >> 16) | (e << 16) : w1;
        lo ^= 0x80808080u, hi ^= 0x80808080u; // i8 -> u8 + 128
        float s = mv_byte(lo, 0, 128.0f) * xa.x;
        s = fmaf(mv_byte(lo, 1, 128.0f), xa.y, s);
        s = fmaf(mv_byte(lo, 2, 128.0f), xa.z, s);
        s = fmaf(mv_byte(lo, 3, 128.0f), xa.w, s);
        s = fmaf(mv_byte(hi, 0, 128.0f), xb.x, s);
        s = fmaf(mv_byte(hi, 1, 128.0f), xb.y, s);
        s = fmaf(mv_byte(hi, 2, 128.0f), xb.z, s);
        s = fmaf(mv_byte(hi, 3, 128.0f), xb.w, s);
        return fmaf(ds4_h2f_fast(d), s, acc);
    }
};

// F16: one 16-byte load per slice, 8 conversions by cvt.
template <> struct MvqRaw<T_F16> {
    uint4 v;
    __device__ __forceinline__ void load(const u8* __restrict__ row, int c, int q) {
        v = *(const uint4*)(row + (size_t)c * 64 + q * 16);
    }
    __device__ __forceinline__ float dot(const float4& xa, const float4& xb, float acc) const {
        acc = fmaf(ds4_h2f_fast(v.x & 0xffffu), xa.x, acc);
        acc = fmaf(ds4_h2f_fast(v.x >> 16), xa.y, acc);
        acc = fmaf(ds4_h2f_fast(v.y & 0xffffu), xa.z, acc);
        acc = fmaf(ds4_h2f_fast(v.y >> 16), xa.w, acc);
        acc = fmaf(ds4_h2f_fast(v.z & 0xffffu), xb.x, acc);
        acc = fmaf(ds4_h2f_fast(v.z >> 16), xb.y, acc);
        acc = fmaf(ds4_h2f_fast(v.w & 0xffffu), xb.z, acc);
        acc = fmaf(ds4_h2f_fast(v.w >> 16), xb.w, acc);
        return acc;
    }
};

// LATE (a kernel started with DS4_PDL_LATE): ds4_pdl_enter() after the warp's first round of
// weight loads, as mvq_cta; the same sums either way. IL (F16 only): W in the interleaved F16
// layout (f16_repack_i), so slice (c, q) holds the columns of x float4s 64(c / 8) + s and + 32,
// s = 4(c % 8) + q.
template <int T, int R, int U, bool LATE = false, bool IL = false>
__device__ __forceinline__ void mvq_body(const u8* __restrict__ W, long long w_z, const float* __restrict__ x,
                                         long long x_z, float* __restrict__ y, long long y_z, int rows, int cols,
                                         long long row_bytes, int kspl) {
    __shared__ float red[MV_WARPS * R];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, z = blockIdx.z;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][1];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i][0] = 0.0f;
    bool wait = LATE; // ds4_pdl_enter() still to come
    if (r0 < rows) { // warp-uniform
        const u8* rp[R];
#pragma unroll
        for (int i = 0; i < R; i++) rp[i] = W + (long long)z * w_z + (long long)min(r0 + i, rows - 1) * row_bytes;
        const float* xb = x + (long long)z * x_z;
        int q = lane & 3, stride = kspl * MV_CPW, chunks = cols / 32;
        // U steps per round (the last one guarded per lane): every load of a round is issued
        // before its math, so a warp with s steps waits ceil(s / U) memory latencies.
        for (int c0 = (warp % kspl) * MV_CPW; c0 < chunks; c0 += U * stride) {
            MvqRaw<T> raw[U][R];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = c0 + u * stride + lane / 4;
                if (c < chunks)
#pragma unroll
                    for (int i = 0; i < R; i++) raw[u][i].load(rp[i], c, q);
            }
            if (LATE && wait) {
                ds4_pdl_enter();
                wait = false;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = c0 + u * stride + lane / 4;
                if (c < chunks) {
                    float4 xa, xc;
                    if (IL) {
                        const float4* xv = (const float4*)xb + (long long)(c >> 3) * 64 + 4 * (c & 7) + q;
                        xa = xv[0], xc = xv[32];
                    } else {
                        const float4* xv = (const float4*)(xb + (long long)c * 32 + 8 * q);
                        xa = xv[0], xc = xv[1];
                    }
#pragma unroll
                    for (int i = 0; i < R; i++) acc[i][0] = raw[u][i].dot(xa, xc, acc[i][0]);
                }
            }
        }
    }
    if (LATE && wait) ds4_pdl_enter();
    float v = mv_reduce<1, R>(acc, kspl, red);
    int r = r0 + lane;
    if (warp % kspl == 0 && lane < R && r < rows) y[(long long)z * y_z + r] = v;
}

#define MVQ_PARAMS                                                                                                     \
    const u8 *__restrict__ W, long long w_z, const float *__restrict__ x, long long x_z, float *__restrict__ y,       \
        long long y_z, int rows, int cols, long long row_bytes, int kspl
#define MVQ_ARGS W, w_z, x, x_z, y, y_z, rows, cols, row_bytes, kspl

DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r2u4_q8_0(MVQ_PARAMS) { ds4_pdl_enter(); mvq_body<T_Q8_0, 2, 4>(MVQ_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r1u4_q8_0(MVQ_PARAMS) { ds4_pdl_enter(); mvq_body<T_Q8_0, 1, 4>(MVQ_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r2u4_f16(MVQ_PARAMS) { ds4_pdl_enter(); mvq_body<T_F16, 2, 4>(MVQ_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r1u4_f16(MVQ_PARAMS) { ds4_pdl_enter(); mvq_body<T_F16, 1, 4>(MVQ_ARGS); }
// The F16 forms with their weights' first round of loads before the PDL wait (DS4_GPU_MVQ_LATE).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r2u4_f16l(MVQ_PARAMS) { DS4_PDL_LATE; mvq_body<T_F16, 2, 4, true>(MVQ_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r1u4_f16l(MVQ_PARAMS) { DS4_PDL_LATE; mvq_body<T_F16, 1, 4, true>(MVQ_ARGS); }

// ---- The interleaved F16 layout ("i", DS4_GPU_F16_IL; f16_repack_i, a second copy made at
// upload): rows cut into tiles of 256 columns (32 slots of 16 bytes); slot s holds columns 4s ..
// 4s + 3, then 128 + 4s .. + 3, so the lane of a warp step that loads slot s reads its x as the
// float4s s and 32 + s of the tile: each x load of a warp step is 512 contiguous bytes (plain:
// lane stride 32 bytes, 8 lines a load instruction, half of each used). Per lane the sum runs
// over those 8 columns in that order (another f32 rounding order than the plain layout).
// f16_repack_i: slot i (i < n_slots = rows * cols / 8, cols % 256 == 0) of dst from src.
DS4_KERNEL void DS4_BOUNDS(256) f16_repack_i(const u8* __restrict__ src, long long n_slots, u8* __restrict__ dst) {
    ds4_pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_slots) return;
    const uint2* t = (const uint2*)(src + (i >> 5) * 512); // the tile: 64 groups of 4 columns
    const int s = (int)(i & 31);
    const uint2 a = t[s], b = t[32 + s];
    ((uint4*)dst)[i] = make_uint4(a.x, a.y, b.x, b.y);
}
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r2u4_f16i(MVQ_PARAMS) { ds4_pdl_enter(); mvq_body<T_F16, 2, 4, false, true>(MVQ_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_r2u4_f16il(MVQ_PARAMS) { DS4_PDL_LATE; mvq_body<T_F16, 2, 4, true, true>(MVQ_ARGS); }

// ---- Q8_0 in the decode layout (GpuWeight::Mat `dec`, written at upload by q8_repack from the
// GGUF blocks, which stay for the GEMM unless the matrix is held in this layout only): quants Q[g * cols + k] (i8, g = global row: rows are
// cols bytes, 16-byte aligned) then scales D[g * (cols / 32) + b] (f16). One row product
// (mvr_r<R>u<U>_q8_0, n = 1): a lane owns a half block (16 quants: one 16-byte load + its
// scale halfword), a warp step covers DS4_WARP half blocks of a row (512 columns with warp 32),
// the warps of a row group split its steps (kspl, as mvq_body); U steps × R rows of loads are
// issued before any math. Each lane adds d * sum(16 q·x) per half block in step order, then warp
// sums and the kspl partials in warp order (deterministic).
// y[z*y_z + r] = W[z*rows + r] . x[z*x_z ..] for r < rows, z = blockIdx.z (groups of rows).

// q8_repack: block b (34 bytes at src + 34b) -> Q[32b .. 32b + 32], D[b]; b < nb.
DS4_KERNEL void DS4_BOUNDS(256) q8_repack(const u8* __restrict__ src, long long nb, u8* __restrict__ Q, u16* __restrict__ D) {
    ds4_pdl_enter();
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nb) return;
    const u16* s = (const u16*)(src + b * 34); // 2-byte aligned: 34b is even
    D[b] = s[0];
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = (u32)s[1 + 2 * i] | ((u32)s[2 + 2 * i] << 16);
    uint4* o = (uint4*)(Q + b * 32);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// ---- The interleaved decode layout ("i", DS4_GPU_Q8_IL; rows of cols % 512 == 0): a row is cut
// into tiles of 512 columns (32 slots of 16 bytes, 16 scale halfwords). Slot s (0..31) of a tile
// holds in its 32-bit word j (0..3) the quants of columns 128j + 4s .. 128j + 4s + 3, so the
// lane that loads slot s reads its x as the float4s 32j + s of the tile: the four x loads of a
// warp step are each 512 contiguous bytes (the plain layout's 16 consecutive columns a lane are
// 16 cache lines an x load instruction: L1/TEX ~80% busy). Those columns lie in blocks 4j + s/8
// of the tile; their scales are the tile's halfwords 4(s/8) + j (one 8-byte load a slot). Per
// lane the sum is d_j * (4 q.x) for j = 0..3 in slot order (the plain layout: d * (16 q.x)).
// q8_repack_i: block b (34 bytes at src + 34b; 16 blocks a tile, tiles never straddle rows)
// -> its 8 words into slots 8(b%4) + i, word (b%16)/4, and its scale.
DS4_KERNEL void DS4_BOUNDS(256) q8_repack_i(const u8* __restrict__ src, long long nb, u8* __restrict__ Q, u16* __restrict__ D) {
    ds4_pdl_enter();
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nb) return;
    const u16* s = (const u16*)(src + b * 34);
    long long t = b >> 4;
    int bt = (int)(b & 15), j = bt >> 2, q = bt & 3;
    D[t * 16 + 4 * q + j] = s[0];
    u32* o = (u32*)(Q + t * 512);
#pragma unroll
    for (int i = 0; i < 8; i++) o[4 * (8 * q + i) + j] = (u32)s[1 + 2 * i] | ((u32)s[2 + 2 * i] << 16);
}

// acc + d * sum over 16 quants of v (i8) times xa..xd (16 floats).
__device__ __forceinline__ float mvr_dot(uint4 v, u32 d, const float4& xa, const float4& xb, const float4& xc,
                                         const float4& xd, float acc) {
    u32 a = v.x ^ 0x80808080u, b = v.y ^ 0x80808080u, c = v.z ^ 0x80808080u, e = v.w ^ 0x80808080u; // u8 + 128
    float s = mv_byte(a, 0, 128.0f) * xa.x;
    s = fmaf(mv_byte(a, 1, 128.0f), xa.y, s);
    s = fmaf(mv_byte(a, 2, 128.0f), xa.z, s);
    s = fmaf(mv_byte(a, 3, 128.0f), xa.w, s);
    s = fmaf(mv_byte(b, 0, 128.0f), xb.x, s);
    s = fmaf(mv_byte(b, 1, 128.0f), xb.y, s);
    s = fmaf(mv_byte(b, 2, 128.0f), xb.z, s);
    s = fmaf(mv_byte(b, 3, 128.0f), xb.w, s);
    s = fmaf(mv_byte(c, 0, 128.0f), xc.x, s);
    s = fmaf(mv_byte(c, 1, 128.0f), xc.y, s);
    s = fmaf(mv_byte(c, 2, 128.0f), xc.z, s);
    s = fmaf(mv_byte(c, 3, 128.0f), xc.w, s);
    s = fmaf(mv_byte(e, 0, 128.0f), xd.x, s);
    s = fmaf(mv_byte(e, 1, 128.0f), xd.y, s);
    s = fmaf(mv_byte(e, 2, 128.0f), xd.z, s);
    s = fmaf(mv_byte(e, 3, 128.0f), xd.w, s);
    return fmaf(ds4_h2f_fast(d), s, acc);
}

// mvr_dot in two parts, for products of several token rows (mvrn_acc, mvx_run NT > 1): a slot's
// 16 quants converted once, then each token's dot; the same values and fma chain, so the same bits.
__device__ __forceinline__ void mvr_cvt16(uint4 v, float (&w)[16]) {
    const u32 q[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u}; // u8 + 128
#pragma unroll
    for (int k = 0; k < 16; k++) w[k] = mv_byte(q[k / 4], k % 4, 128.0f);
}
__device__ __forceinline__ float mvr_dotw(const float (&w)[16], u32 d, const float4 (&x)[4], float acc) {
    float s = w[0] * x[0].x;
#pragma unroll
    for (int k = 1; k < 16; k++) {
        const float4& xq = x[k / 4];
        s = fmaf(w[k], k % 4 == 0 ? xq.x : k % 4 == 1 ? xq.y : k % 4 == 2 ? xq.z : xq.w, s);
    }
    return fmaf(ds4_h2f_fast(d), s, acc);
}

// The interleaved layout's slot: word j of v times xj (x columns 128j + 4s ..), scale j of d
// (halfwords d.x lo, d.x hi, d.y lo, d.y hi).
__device__ __forceinline__ float mvr_dot4(u32 w, u32 d, const float4& x, float acc) {
    u32 a = w ^ 0x80808080u;
    float s = mv_byte(a, 0, 128.0f) * x.x;
    s = fmaf(mv_byte(a, 1, 128.0f), x.y, s);
    s = fmaf(mv_byte(a, 2, 128.0f), x.z, s);
    s = fmaf(mv_byte(a, 3, 128.0f), x.w, s);
    return fmaf(ds4_h2f_fast(d), s, acc);
}
__device__ __forceinline__ float mvr_dot_i(uint4 v, uint2 d, const float4& xa, const float4& xb, const float4& xc,
                                           const float4& xd, float acc) {
    acc = mvr_dot4(v.x, d.x & 0xffffu, xa, acc);
    acc = mvr_dot4(v.y, d.x >> 16, xb, acc);
    acc = mvr_dot4(v.z, d.y & 0xffffu, xc, acc);
    return mvr_dot4(v.w, d.y >> 16, xd, acc);
}

// Scale registers of a slot: one halfword (plain layout), four (interleaved: IL).
template <bool IL> struct MvrD { typedef u32 T; };
template <> struct MvrD<true> { typedef uint2 T; };

// The loads of one round (U steps from h0, guarded per lane) of decode-layout rows qp/dp.
// IL: the interleaved layout (the slot's four scales: 8 bytes at halfword 4 (h / 8)).
template <int R, int U, bool IL = false>
__device__ __forceinline__ void mvr_ld(const uint4* const (&qp)[R], const u16* const (&dp)[R], int h0, int hb,
                                       int stride, uint4 (&v)[U][R], typename MvrD<IL>::T (&d)[U][R]) {
    int lane = threadIdx.x % DS4_WARP;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int h = h0 + u * stride + lane;
        if (h < hb)
#pragma unroll
            for (int i = 0; i < R; i++) {
                v[u][i] = qp[i][h];
                if constexpr (IL) d[u][i] = ((const uint2*)dp[i])[h >> 3];
                else d[u][i] = dp[i][h >> 1];
            }
    }
}

// acc[i] += lane's half blocks of decode-layout rows qp[i]/dp[i] times x (xv: x as float4),
// steps ks*DS4_WARP, + kspl*DS4_WARP, ... of hb half blocks; U steps of loads before the math.
// The first round's loads (weights only: 2 KB a warp for R = U = 2) are issued before the PDL
// wait (ds4_pdl_enter here; the caller makes warps without rows call it too), so they run
// while the previous kernel drains; x is read after it.
// IL: the interleaved layout (slot h: x float4s 4 (h - h % 32) + h % 32 + 32j, coalesced).
// PIPE: the next round's loads of step u issued right after step u's math (registers freed one
// step at a time, as mvx_run) instead of after the whole round's math; the same sums.
template <int R, int U, bool IL = false, bool PIPE = false>
__device__ __forceinline__ void mvr_acc(const uint4* const (&qp)[R], const u16* const (&dp)[R],
                                        const float4* __restrict__ xv, int hb, int ks, int kspl, float (&acc)[R][1]) {
    int lane = threadIdx.x % DS4_WARP, stride = kspl * DS4_WARP;
    int h0 = ks * DS4_WARP;
    uint4 v[U][R];
    typename MvrD<IL>::T d[U][R];
    mvr_ld<R, U, IL>(qp, dp, h0, hb, stride, v, d);
    ds4_pdl_enter();
    for (; h0 < hb; h0 += U * stride) { // round: the math of its loads, then the next round's loads
#pragma unroll
        for (int u = 0; u < U; u++) {
            int h = h0 + u * stride + lane;
            if (h < hb) {
                if constexpr (IL) {
                    const float4* xt = xv + 4 * (h & ~31) + (h & 31);
                    float4 xa = xt[0], xb = xt[32], xc = xt[64], xd = xt[96];
#pragma unroll
                    for (int i = 0; i < R; i++) acc[i][0] = mvr_dot_i(v[u][i], d[u][i], xa, xb, xc, xd, acc[i][0]);
                } else {
                    float4 xa = xv[4 * h], xb = xv[4 * h + 1], xc = xv[4 * h + 2], xd = xv[4 * h + 3];
#pragma unroll
                    for (int i = 0; i < R; i++) acc[i][0] = mvr_dot(v[u][i], d[u][i], xa, xb, xc, xd, acc[i][0]);
                }
            }
            if (PIPE && h + U * stride < hb) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    v[u][i] = qp[i][h + U * stride];
                    if constexpr (IL) d[u][i] = ((const uint2*)dp[i])[(h + U * stride) >> 3];
                    else d[u][i] = dp[i][(h + U * stride) >> 1];
                }
            }
        }
        if (!PIPE && h0 + U * stride < hb) mvr_ld<R, U, IL>(qp, dp, h0 + U * stride, hb, stride, v, d); // warp-uniform
    }
}

// ADD (mvra): y[r] += W[r] . x (y read after the PDL wait, one write per row: deterministic).
template <int R, int U, bool ADD = false, bool IL = false, bool PIPE = false>
__device__ __forceinline__ void mvr_body(const u8* __restrict__ Q, const u16* __restrict__ D, const float* __restrict__ x,
                                         long long x_z, float* __restrict__ y, long long y_z, int rows, int cols,
                                         int kspl) {
    __shared__ float red[MV_WARPS * R];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, z = blockIdx.z;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][1];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i][0] = 0.0f;
    if (r0 < rows) { // warp-uniform
        const uint4* qp[R];
        const u16* dp[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            long long g = (long long)z * rows + min(r0 + i, rows - 1);
            qp[i] = (const uint4*)(Q + g * cols);
            dp[i] = D + g * (cols / 32);
        }
        mvr_acc<R, U, IL, PIPE>(qp, dp, (const float4*)(x + (long long)z * x_z), cols / 16, warp % kspl, kspl, acc);
    } else {
        ds4_pdl_enter();
    }
    float v = mv_reduce<1, R>(acc, kspl, red);
    int r = r0 + lane;
    if (warp % kspl == 0 && lane < R && r < rows) {
        float* yr = y + (long long)z * y_z + r;
        *yr = ADD ? *yr + v : v;
    }
}

#define MVR_PARAMS                                                                                                     \
    const u8 *__restrict__ Q, const u16 *__restrict__ D, const float *__restrict__ x, long long x_z,                  \
        float *__restrict__ y, long long y_z, int rows, int cols, int kspl
#define MVR_ARGS Q, D, x, x_z, y, y_z, rows, cols, kspl

// The first round's weight loads before the PDL wait (H200, 2k decode: 126.0 against 123.7
// tok/s with the wait first; bench/results/gpu-prefetch-f7-h200.txt).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvr_r4u2_q8_0(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<4, 2>(MVR_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvr_r2u2_q8_0(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<2, 2>(MVR_ARGS); }
// y += W . x (decode: the shared expert's down product added into the routed experts' sum, which
// ran as mvr_r2u2_q8_0 into a scratch row + add_f32 before).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvra_r2u2_q8_0(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<2, 2, true>(MVR_ARGS); }
// The same on the interleaved layout (q8_repack_i; suffix i).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvr_r4u2_q8_0i(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<4, 2, false, true>(MVR_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvr_r2u2_q8_0i(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<2, 2, false, true>(MVR_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvra_r2u2_q8_0i(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<2, 2, true, true>(MVR_ARGS); }
// The same with the loads pipelined step by step (PIPE; DS4_GPU_MVR_PIPE=1).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvr_r2u2_q8_0ip(MVR_PARAMS) { DS4_PDL_LATE; mvr_body<2, 2, false, true, true>(MVR_ARGS); }

// ---- n = 2..4 token rows on the decode layout (mvrn<NT>_r2u2_q8_0[i]: speculative verify steps):
// as mvr_r2u2_q8_0[i], the weights loaded once (the first round before the PDL wait) and each
// slot's 16 quants converted once, then per token t < NT (t >= n repeats token n - 1 and is not
// stored) the n = 1 kernel's sums in its order: every token row gets the bits mvr gives it alone.
// y[t*y_tok + z*y_z + r] = W[z*rows + r] . x[t*x_tok + z*x_z ..].
template <int R, int U, int NT, bool IL>
__device__ __forceinline__ void mvrn_acc(const uint4* const (&qp)[R], const u16* const (&dp)[R],
                                         const float4* __restrict__ xv, long long x_tok4, int n, int hb, int ks,
                                         int kspl, float (&acc)[R][NT]) {
    int lane = threadIdx.x % DS4_WARP, stride = kspl * DS4_WARP;
    int h0 = ks * DS4_WARP;
    uint4 v[U][R];
    typename MvrD<IL>::T d[U][R];
    mvr_ld<R, U, IL>(qp, dp, h0, hb, stride, v, d);
    ds4_pdl_enter();
    for (; h0 < hb; h0 += U * stride) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int h = h0 + u * stride + lane;
            if (h < hb) {
                float w[R][16]; // every row's 16 quants converted once, then each token's x loaded once
#pragma unroll
                for (int i = 0; i < R; i++) mvr_cvt16(v[u][i], w[i]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const float4* xt = xv + (long long)min(t, n - 1) * x_tok4;
                    float4 x4[4];
                    if constexpr (IL) {
                        xt += 4 * (h & ~31) + (h & 31);
                        x4[0] = xt[0], x4[1] = xt[32], x4[2] = xt[64], x4[3] = xt[96];
                    } else {
                        xt += 4 * h;
                        x4[0] = xt[0], x4[1] = xt[1], x4[2] = xt[2], x4[3] = xt[3];
                    }
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        if constexpr (IL) { // mvr_dot_i: scale j per word j
#pragma unroll
                            for (int j = 0; j < 4; j++) {
                                float s = w[i][4 * j] * x4[j].x;
                                s = fmaf(w[i][4 * j + 1], x4[j].y, s);
                                s = fmaf(w[i][4 * j + 2], x4[j].z, s);
                                s = fmaf(w[i][4 * j + 3], x4[j].w, s);
                                const u32 dj = (j < 2 ? d[u][i].x : d[u][i].y) >> (16 * (j & 1));
                                acc[i][t] = fmaf(ds4_h2f_fast(dj & 0xffffu), s, acc[i][t]);
                            }
                        } else { // mvr_dot: one scale per 16
                            acc[i][t] = mvr_dotw(w[i], d[u][i], x4, acc[i][t]);
                        }
                    }
                }
            }
        }
        if (h0 + U * stride < hb) mvr_ld<R, U, IL>(qp, dp, h0 + U * stride, hb, stride, v, d); // warp-uniform
    }
}

template <int R, int U, int NT, bool IL, bool ADD = false>
__device__ __forceinline__ void mvrn_body(const u8* __restrict__ Q, const u16* __restrict__ D, const float* __restrict__ x,
                                          long long x_z, float* __restrict__ y, long long y_z, int rows, int cols,
                                          int kspl, long long x_tok, long long y_tok, int n) {
    __shared__ float red[MV_WARPS * R * NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP, z = blockIdx.z;
    int r0 = (blockIdx.x * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    if (r0 < rows) { // warp-uniform
        const uint4* qp[R];
        const u16* dp[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            long long g = (long long)z * rows + min(r0 + i, rows - 1);
            qp[i] = (const uint4*)(Q + g * cols);
            dp[i] = D + g * (cols / 32);
        }
        mvrn_acc<R, U, NT, IL>(qp, dp, (const float4*)(x + (long long)z * x_z), x_tok / 4, n, cols / 16, warp % kspl,
                               kspl, acc);
    } else {
        ds4_pdl_enter();
    }
    float v = mv_reduce<NT, R>(acc, kspl, red);
    int r = r0 + lane / NT, t = lane % NT;
    if (warp % kspl == 0 && lane < R * NT && r < rows && t < n) {
        float* yr = y + (long long)t * y_tok + (long long)z * y_z + r;
        *yr = ADD ? *yr + v : v; // ADD (mvran): y += W . x, as mvra
    }
}

#define MVRN_PARAMS MVR_PARAMS, long long x_tok, long long y_tok, int n
#define MVRN_ARGS MVR_ARGS, x_tok, y_tok, n
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn2_r2u2_q8_0(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 2, false>(MVRN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn2_r2u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 2, true>(MVRN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn4_r2u2_q8_0(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 4, false>(MVRN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn4_r2u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 4, true>(MVRN_ARGS); }
// y += W . x for n token rows (the shared expert's down added into the routed sum of a verify
// step; each token's bits as mvra_r2u2_q8_0i alone).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvran2_r2u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 2, true, true>(MVRN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvran4_r2u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<2, 2, 4, true, true>(MVRN_ARGS); }
// One row a warp (R = 1: 16 converted quants a lane, not 32; the host keeps kspl as r2u2 plans it,
// so every row's sums, and each token's bits, are unchanged; the default, DS4_GPU_MVRN_R=2 for two rows).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn2_r1u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<1, 2, 2, true>(MVRN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrn4_r1u2_q8_0i(MVRN_PARAMS) { DS4_PDL_LATE; mvrn_body<1, 2, 4, true>(MVRN_ARGS); }

// ---- Several n = 1 products of one x in one launch (decode: q_a + kv, the compressor and
// indexer projections): matrices m < 4 (mvrm) or 5 (mvqm; kernels take at most 24 arguments) of
// the same cols, matrix m takes CTAs c_m .. c_{m+1} - 1 (c_0 = 0; c_m = 0x7fffffff for absent m), each CTA as one CTA of the single-matrix form at
// blockIdx.x - c_m (rows per CTA (MV_WARPS / kspl) * R). Per-lane order of the sums as there.
//   mvrm_r2u2_q8_0: Q8_0 decode layout (Q_m, D_m: q8_repack) as mvr_r2u2_q8_0;
//   mvqm_r2u4_<t>:  rows of W_m (row_bytes rb) as mvq_r2u4_<t>.
//   mvrgu_r2u2_q8_0: the shared expert's gate and up (decode layout) with the clamped SwiGLU:
//   h[r] = silu(min(g, c)) * clamp(u, -c, c), g = Wg[r] . x, u = Wu[r] . x; a warp (or kspl
//   warps) per row pair r, as swiglu_f32 with weight 1.

// Matrix of this CTA: the number of c_1..c_4 at or below blockIdx.x (c4 = INT_MAX for mvrm).
__device__ __forceinline__ int mvm_pick(int c1, int c2, int c3, int c4) {
    int b = blockIdx.x;
    return (b >= c1) + (b >= c2) + (b >= c3) + (b >= c4);
}

// One CTA (index bx) of y[r] = W[r] . x, W in the decode layout (Q, D), r < rows.
template <int R, int U, bool IL = false>
__device__ __forceinline__ void mvr_cta(const u8* __restrict__ Q, const u16* __restrict__ D, const float* __restrict__ x,
                                        float* __restrict__ y, int rows, int cols, int kspl, int bx) {
    __shared__ float red[MV_WARPS * R];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int r0 = (bx * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][1];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i][0] = 0.0f;
    if (r0 < rows) { // warp-uniform
        const uint4* qp[R];
        const u16* dp[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            long long g = min(r0 + i, rows - 1);
            qp[i] = (const uint4*)(Q + g * cols);
            dp[i] = D + g * (cols / 32);
        }
        mvr_acc<R, U, IL>(qp, dp, (const float4*)x, cols / 16, warp % kspl, kspl, acc);
    } else {
        ds4_pdl_enter();
    }
    float v = mv_reduce<1, R>(acc, kspl, red);
    int r = r0 + lane;
    if (warp % kspl == 0 && lane < R && r < rows) y[r] = v;
}

// One CTA (index bx) of y[r] = W[r] . x, W rows of row_bytes (GGUF blocks or F16), r < rows.
// LATE (a kernel started with DS4_PDL_LATE): ds4_pdl_enter() after the warp's first round of
// weight loads (x is read after it); the same sums either way.
template <int T, int R, int U, bool LATE = false, int NT = 1>
__device__ __forceinline__ void mvq_cta(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                        int rows, int cols, long long row_bytes, int kspl, int bx, long long x_tok = 0,
                                        long long y_tok = 0, int n = 1) {
    __shared__ float red[MV_WARPS * R * NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int r0 = (bx * (MV_WARPS / kspl) + warp / kspl) * R;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    bool wait = LATE; // ds4_pdl_enter() still to come
    if (r0 < rows) { // warp-uniform
        const u8* rp[R];
#pragma unroll
        for (int i = 0; i < R; i++) rp[i] = W + (long long)min(r0 + i, rows - 1) * row_bytes;
        int q = lane & 3, stride = kspl * MV_CPW, chunks = cols / 32;
        for (int c0 = (warp % kspl) * MV_CPW; c0 < chunks; c0 += U * stride) {
            MvqRaw<T> raw[U][R];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = c0 + u * stride + lane / 4;
                if (c < chunks)
#pragma unroll
                    for (int i = 0; i < R; i++) raw[u][i].load(rp[i], c, q);
            }
            if (LATE && wait) {
                ds4_pdl_enter();
                wait = false;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = c0 + u * stride + lane / 4;
                if (c < chunks) {
#pragma unroll
                    for (int t = 0; t < NT; t++) { // NT > 1: token t's x at x_tok floats (t >= n: token n - 1)
                        const float4* xv = (const float4*)(x + (NT > 1 ? (long long)min(t, n - 1) * x_tok : 0) +
                                                           (long long)c * 32 + 8 * q);
                        float4 xa = xv[0], xc = xv[1];
#pragma unroll
                        for (int i = 0; i < R; i++) acc[i][t] = raw[u][i].dot(xa, xc, acc[i][t]);
                    }
                }
            }
        }
    }
    if (LATE && wait) ds4_pdl_enter();
    float v = mv_reduce<NT, R>(acc, kspl, red);
    int r = r0 + lane / NT, t = lane % NT;
    if (warp % kspl == 0 && lane < R * NT && r < rows && t < n) y[(NT > 1 ? (long long)t * y_tok : 0) + r] = v;
}

#define MVM_SEL(a0, a1, a2, a3, a4) (m == 0 ? (a0) : m == 1 ? (a1) : m == 2 ? (a2) : m == 3 ? (a3) : (a4))

#define MVRM_ONE(i) const u8 *__restrict__ Q##i, const u16 *__restrict__ D##i, float *__restrict__ y##i, int rows##i
#define MVRM_PARAMS                                                                                                    \
    MVRM_ONE(0), MVRM_ONE(1), MVRM_ONE(2), MVRM_ONE(3), const float *__restrict__ x, int cols, int kspl, int c1, int c2, \
        int c3

#define MVRM_BODY(IL)                                                                                            \
    int m = mvm_pick(c1, c2, c3, 0x7fffffff);                                                                          \
    mvr_cta<2, 2, IL>(MVM_SEL(Q0, Q1, Q2, Q3, Q3), MVM_SEL(D0, D1, D2, D3, D3), x, MVM_SEL(y0, y1, y2, y3, y3),      \
                        MVM_SEL(rows0, rows1, rows2, rows3, rows3), cols, kspl, (int)blockIdx.x - MVM_SEL(0, c1, c2, c3, c3));
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrm_r2u2_q8_0(MVRM_PARAMS) { DS4_PDL_LATE; MVRM_BODY(false) }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrm_r2u2_q8_0i(MVRM_PARAMS) { DS4_PDL_LATE; MVRM_BODY(true) }

#define MVQM_ONE(i) const u8 *__restrict__ W##i, float *__restrict__ y##i, int rows##i
#define MVQM_PARAMS                                                                                                    \
    MVQM_ONE(0), MVQM_ONE(1), MVQM_ONE(2), MVQM_ONE(3), MVQM_ONE(4), const float *__restrict__ x, int cols,            \
        long long row_bytes, int kspl, int c1, int c2, int c3, int c4
#define MVQM_BODY(T, LATE)                                                                                             \
    int m = mvm_pick(c1, c2, c3, c4);                                                                                  \
    mvq_cta<T, 2, 4, LATE>(MVM_SEL(W0, W1, W2, W3, W4), x, MVM_SEL(y0, y1, y2, y3, y4),                                \
                     MVM_SEL(rows0, rows1, rows2, rows3, rows4), cols, row_bytes, kspl,                                \
                     (int)blockIdx.x - MVM_SEL(0, c1, c2, c3, c4));

DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvqm_r2u4_f16(MVQM_PARAMS) { ds4_pdl_enter(); MVQM_BODY(T_F16, false) }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvqm_r2u4_q8_0(MVQM_PARAMS) { ds4_pdl_enter(); MVQM_BODY(T_Q8_0, false) }
// mvqm_r2u4_f16 with the weights' first round of loads before the PDL wait (DS4_GPU_MVQ_LATE).
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvqm_r2u4_f16l(MVQM_PARAMS) { DS4_PDL_LATE; MVQM_BODY(T_F16, true) }

// Arrival ticket after a CTA's stores: true in the launch's last CTA to arrive (whose threads may
// then read every CTA's stores), which has reset *ticket to 0 for the next launch.
__device__ __forceinline__ bool mvq_last_cta(u32* ticket) {
    __shared__ int last_s;
    __syncthreads(); // every store of this CTA precedes thread 0's fence
    if (threadIdx.x == 0) {
        __threadfence(); // release: the stores are visible device-wide before the ticket
        const bool l = atomicAdd(ticket, 1u) == gridDim.x - 1;
        if (l) __threadfence(); // acquire: the other CTAs' stores are read after it
        last_s = l;
    }
    __syncthreads();
    if (!last_s) return false;
    if (threadIdx.x == 0) *ticket = 0u; // ready for the next launch
    return true;
}

// Decode router (n = 1): logits y = W·x as mvq_r2u4_f16 (the same CTAs, kspl and per-lane order of
// the sums: the same bits), the weights' first loads before the PDL wait; then the last CTA to
// finish (arrival ticket: the CTA's stores, a barrier, thread 0's fence and ticket, as fused.cu
// fl_hc) routes the token as moe_route_fast (ds4_route_token, the logits read through L2) into
// sel [k], wgt [k]. rows = the experts (<= DS4_ROUTE_MAX_E), k <= DS4_ROUTE_MAX_K <= DS4_WARP;
// bias (top k) or tid2eid + tok (hash layers). *ticket is 0 between launches: the last CTA resets
// it (graph replays too). (acq_rel fences and redux.sync warp maxima tied this on the H200:
// bench/results/gpu-route-r12-h200.txt.)
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_route_f16(const u8* __restrict__ W, const float* __restrict__ x, float* y, int rows, int cols,
                                                     long long row_bytes, int kspl, const float* __restrict__ bias,
                                                     const int* __restrict__ tid2eid, const int* __restrict__ tok, int* __restrict__ sel,
                                                     float* __restrict__ wgt, int k, float weight_scale, u32* ticket) {
    DS4_PDL_LATE; // mvq_cta<LATE> waits after the first round of weight loads
    mvq_cta<T_F16, 2, 4, true>(W, x, y, rows, cols, row_bytes, kspl, blockIdx.x);
    if (!mvq_last_cta(ticket)) return;
    ds4_route_token<true>(y, bias, tid2eid, tok, sel, wgt, rows, k, weight_scale);
}

// mvq_route_f16 with the bias values loaded before the PDL wait (a weight; in registers through
// the product) and the last CTA's top k by ranks (ds4_route_token_rank: the same selections,
// slots and weights, bit for bit). DS4_GPU_ROUTE=rank.
#define MVQ_ROUTE_NB (DS4_ROUTE_MAX_E / MV_THREADS) // bias values a thread holds
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_route_f16r(const u8* __restrict__ W, const float* __restrict__ x, float* y, int rows, int cols,
                                                      long long row_bytes, int kspl, const float* __restrict__ bias,
                                                      const int* __restrict__ tid2eid, const int* __restrict__ tok, int* __restrict__ sel,
                                                      float* __restrict__ wgt, int k, float weight_scale, u32* ticket) {
    DS4_PDL_LATE; // mvq_cta<LATE> waits after the first round of weight loads
    float bv[MVQ_ROUTE_NB];
    ds4_route_bias(bias, rows, bv);
    mvq_cta<T_F16, 2, 4, true>(W, x, y, rows, cols, row_bytes, kspl, blockIdx.x);
    if (!mvq_last_cta(ticket)) return;
    ds4_route_token_rank<true>(y, bv, tid2eid, tok, sel, wgt, rows, k, weight_scale);
}

// mvq_route_f16r for n <= NT token rows (speculative verify steps): the router read once for all
// (mvq_cta NT: token t's x at cols floats, its logits at y + t rows, each token's sums as
// mvq_cta's alone), then the last CTA routes token t < n after token t - 1 (one barrier between:
// the route's shared arrays) into sel / wgt + t k.
template <int NT>
__device__ __forceinline__ void mvq_route_n(const u8* __restrict__ W, const float* __restrict__ x, float* y, int rows, int cols,
                                            long long row_bytes, int kspl, const float* __restrict__ bias,
                                            const int* __restrict__ tid2eid, const int* __restrict__ tok, int* __restrict__ sel,
                                            float* __restrict__ wgt, int k, float weight_scale, u32* ticket, int n) {
    float bv[MVQ_ROUTE_NB];
    ds4_route_bias(bias, rows, bv);
    mvq_cta<T_F16, 2, 4, true, NT>(W, x, y, rows, cols, row_bytes, kspl, blockIdx.x, cols, rows, n);
    if (!mvq_last_cta(ticket)) return;
    for (int t = 0; t < n; t++) {
        if (t > 0) __syncthreads();
        ds4_route_token_rank<true>(y + (long long)t * rows, bv, tid2eid, tok + t, sel + (long long)t * k,
                                   wgt + (long long)t * k, rows, k, weight_scale);
    }
}
#define MVQ_ROUTE_PARAMS                                                                                               \
    const u8 *__restrict__ W, const float *__restrict__ x, float *y, int rows, int cols, long long row_bytes, int kspl, \
        const float *__restrict__ bias, const int *__restrict__ tid2eid, const int *__restrict__ tok,                  \
        int *__restrict__ sel, float *__restrict__ wgt, int k, float weight_scale, u32 *ticket, int n
#define MVQ_ROUTE_ARGS W, x, y, rows, cols, row_bytes, kspl, bias, tid2eid, tok, sel, wgt, k, weight_scale, ticket, n
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_route2_f16r(MVQ_ROUTE_PARAMS) { DS4_PDL_LATE; mvq_route_n<2>(MVQ_ROUTE_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvq_route4_f16r(MVQ_ROUTE_PARAMS) { DS4_PDL_LATE; mvq_route_n<4>(MVQ_ROUTE_ARGS); }

template <bool IL>
__device__ __forceinline__ void mvrgu_body(const u8* __restrict__ Qg, const u16* __restrict__ Dg, const u8* __restrict__ Qu,
                                           const u16* __restrict__ Du, const float* __restrict__ x, float* __restrict__ h,
                                           int rows, int cols, float clamp, int kspl) {
    __shared__ float red[MV_WARPS * 2];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int r = blockIdx.x * (MV_WARPS / kspl) + warp / kspl;
    float acc[2][1] = {{0.0f}, {0.0f}}; // gate row r, up row r
    if (r < rows) { // warp-uniform
        long long o = (long long)r * cols, od = (long long)r * (cols / 32);
        const uint4* qp[2] = {(const uint4*)(Qg + o), (const uint4*)(Qu + o)};
        const u16* dp[2] = {Dg + od, Du + od};
        mvr_acc<2, 2, IL>(qp, dp, (const float4*)x, cols / 16, warp % kspl, kspl, acc);
    } else {
        ds4_pdl_enter();
    }
    float v = mv_reduce<1, 2>(acc, kspl, red); // lane 0: gate, lane 1: up (first warp of a group)
    float u = ds4_shfl_xor(v, 1);
    if (warp % kspl == 0 && lane == 0 && r < rows) {
        float gv = fminf(v, clamp), uv = fminf(fmaxf(u, -clamp), clamp);
        float silu = gv * (1.0f / (1.0f + expf(-gv)));
        h[r] = silu * uv;
    }
}
#define MVRGU_PARAMS                                                                                                   \
    const u8 *__restrict__ Qg, const u16 *__restrict__ Dg, const u8 *__restrict__ Qu, const u16 *__restrict__ Du,     \
        const float *__restrict__ x, float *__restrict__ h, int rows, int cols, float clamp, int kspl
#define MVRGU_ARGS Qg, Dg, Qu, Du, x, h, rows, cols, clamp, kspl
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrgu_r2u2_q8_0(MVRGU_PARAMS) { DS4_PDL_LATE; mvrgu_body<false>(MVRGU_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrgu_r2u2_q8_0i(MVRGU_PARAMS) { DS4_PDL_LATE; mvrgu_body<true>(MVRGU_ARGS); }

// mvrgu_r2u2_q8_0i for n <= NT token rows (speculative verify steps): x rows cols floats apart, h
// rows `rows` apart; each gate / up row read once for every token (mvrn_acc: token t >= n repeats
// token n - 1 and is not stored), each token's sums, SwiGLU and bits as mvrgu's alone.
template <int NT>
__device__ __forceinline__ void mvrgun_body(const u8* __restrict__ Qg, const u16* __restrict__ Dg, const u8* __restrict__ Qu,
                                            const u16* __restrict__ Du, const float* __restrict__ x, float* __restrict__ h,
                                            int rows, int cols, float clamp, int kspl, int n) {
    __shared__ float red[MV_WARPS * 2 * NT];
    int warp = threadIdx.x / DS4_WARP, lane = threadIdx.x % DS4_WARP;
    int r = blockIdx.x * (MV_WARPS / kspl) + warp / kspl;
    float acc[2][NT]; // gate row r, up row r; per token
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    if (r < rows) { // warp-uniform
        long long o = (long long)r * cols, od = (long long)r * (cols / 32);
        const uint4* qp[2] = {(const uint4*)(Qg + o), (const uint4*)(Qu + o)};
        const u16* dp[2] = {Dg + od, Du + od};
        mvrn_acc<2, 2, NT, true>(qp, dp, (const float4*)x, cols / 4, n, cols / 16, warp % kspl, kspl, acc);
    } else {
        ds4_pdl_enter();
    }
    float v = mv_reduce<NT, 2>(acc, kspl, red); // lane t: gate of token t, lane NT + t: its up
    float u = ds4_shfl_xor(v, NT);
    if (warp % kspl == 0 && lane < n && r < rows) {
        float gv = fminf(v, clamp), uv = fminf(fmaxf(u, -clamp), clamp);
        float silu = gv * (1.0f / (1.0f + expf(-gv)));
        h[(long long)lane * rows + r] = silu * uv;
    }
}
#define MVRGUN_PARAMS MVRGU_PARAMS, int n
#define MVRGUN_ARGS MVRGU_ARGS, n
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrgun2_r2u2_q8_0i(MVRGUN_PARAMS) { DS4_PDL_LATE; mvrgun_body<2>(MVRGUN_ARGS); }
DS4_KERNEL void DS4_BOUNDS(MV_THREADS) mvrgun4_r2u2_q8_0i(MVRGUN_PARAMS) { DS4_PDL_LATE; mvrgun_body<4>(MVRGUN_ARGS); }

// ---- One-row products with x staged once per CTA in shared memory (mvx*_r4u2_<t>, n = 1): the
// default for Q8_0 decode-layout products of <= 1024 columns (attn q_b: 12.9 against 15.0 us by
// mvr_r2u2 on the H200) and merged F16 sets of >= 2048 rows (CSA compressor + indexer: 8.9
// against 10.6 us by mvqm); elsewhere the x staging (cols * 4 bytes per CTA batch) and the
// k-slice barriers cost more than they save (bench/results/gpu-q8-q-h200.txt). The CTA copies x
// (cols <= MVX_MAXC floats) into shared memory, float4 slot i at mvx_sw(i) so that the 16-byte x
// reads of a quarter warp (lane stride 64 bytes: Q8_0, 32: F16) hit distinct banks; each lane
// then reads x from there once per slot for R rows (before: 64 bytes of x through L1 per 16
// weight bytes of each row pair, L1 81-87% busy). A slot is one 16-byte load of a row: a Q8_0
// half block (16 quants + its scale halfword) or 8 F16 values. Warp w of a CTA takes k-slice
// w % ks of the slots (ks = 1, 2, 4, 8, whole warp steps) of row group w / ks (R rows); a CTA
// batch is (MV_WARPS / ks) * R rows, CTA c takes batches c, c + gridDim.x, ... (a persistent
// grid when the host caps it). Rounds of U warp steps × R rows: the loads of round j + 1 (the
// next batch's rows when j ends one) are issued slot by slot as round j's math frees the
// registers, and round 0's before x is staged. Per lane the sums run in slot order, then the
// warp sum, then the ks partials in k order (deterministic; a double-buffered partial array,
// one barrier per batch when ks > 1).
#define MVX_MAXC 8192
#define MVX_LB MV_THREADS, 3

__device__ __forceinline__ int mvx_sw(int i) { return i ^ ((i >> 3) & 3); }

// Row i of a batch: its 16-byte slots at q + qo, (Q8_0) its scales at d + dof (32-bit offsets:
// fewer registers than pointers; q in 16-byte units).
struct MvxRow {
    const uint4* q;
    const u16* d;
    u32 qo, dof;
};

template <int T> struct MvxT;
template <> struct MvxT<T_Q8_0> {
    static constexpr int C = 16; // columns per slot
    static __device__ __forceinline__ void load(const MvxRow& r, int h, uint4& v, u32& d) {
        v = r.q[r.qo + h];
        d = r.d[r.dof + (h >> 1)];
    }
    static __device__ __forceinline__ void xload(const float4* xs, int h, float4 (&xv)[4]) {
#pragma unroll
        for (int j = 0; j < 4; j++) xv[j] = xs[mvx_sw(4 * h + j)];
    }
    static __device__ __forceinline__ float dot(uint4 v, u32 d, const float4 (&xv)[4], float acc) {
        return mvr_dot(v, d, xv[0], xv[1], xv[2], xv[3], acc);
    }
    // mvx_run NT > 1: a slot's quants converted once for every token (mvr_cvt16 / mvr_dotw).
    static __device__ __forceinline__ void cvt(uint4 v, float (&w)[16]) { mvr_cvt16(v, w); }
    static __device__ __forceinline__ float dotw(const float (&w)[16], u32 d, const float4 (&xv)[4], float acc) {
        return mvr_dotw(w, d, xv, acc);
    }
};
template <> struct MvxT<T_F16> {
    static constexpr int C = 8;
    static __device__ __forceinline__ void load(const MvxRow& r, int h, uint4& v, u32& d) {
        v = r.q[r.qo + h];
        d = 0u;
    }
    static __device__ __forceinline__ void xload(const float4* xs, int h, float4 (&xv)[4]) {
        xv[0] = xs[mvx_sw(2 * h)];
        xv[1] = xs[mvx_sw(2 * h + 1)];
    }
    static __device__ __forceinline__ float dot(uint4 v, u32 d, const float4 (&xv)[4], float acc) {
        acc = fmaf(ds4_h2f_fast(v.x & 0xffffu), xv[0].x, acc);
        acc = fmaf(ds4_h2f_fast(v.x >> 16), xv[0].y, acc);
        acc = fmaf(ds4_h2f_fast(v.y & 0xffffu), xv[0].z, acc);
        acc = fmaf(ds4_h2f_fast(v.y >> 16), xv[0].w, acc);
        acc = fmaf(ds4_h2f_fast(v.z & 0xffffu), xv[1].x, acc);
        acc = fmaf(ds4_h2f_fast(v.z >> 16), xv[1].y, acc);
        acc = fmaf(ds4_h2f_fast(v.w & 0xffffu), xv[1].z, acc);
        acc = fmaf(ds4_h2f_fast(v.w >> 16), xv[1].w, acc);
        return acc;
    }
};

// The loads of one slot column (slot h of rows 0..R-1 of batch cb, group gi); none when h >= he.
template <int T, int R, class Src>
__device__ __forceinline__ void mvx_fetch(const Src& src, int cb, int gi, int h, int he, uint4 (&v)[R], u32 (&d)[R]) {
    if (h < he) {
#pragma unroll
        for (int i = 0; i < R; i++) MvxT<T>::load(src.row(cb, gi, i), h, v[i], d[i]);
    }
}

// src.row(cb, gi, i): row i (< R) of row group gi of CTA batch cb (rows past the end clamped to
// a real one); snk.put(cb, gi, v, t): called by every lane of the first warp of each group, lane
// i < R holding the total of row i for token t. x: cols floats (cols a multiple of 16 for Q8_0, 8
// for F16, <= MVX_MAXC). ncb: CTA batches of this z. NORM (mvxn): the product of the RMSNorm of x
// weighted by nw (x * s * nw[i], s = 1 / sqrt(mean(x^2) + eps), the sum of squares in double as
// rmsnorm_f32w): x * nw is staged, every CTA computes s itself from the cols floats it stages (a
// 1024 row: 4 KB, cheaper than the rmsnorm launch it replaces) and scales each row total by s
// (W . (x s nw) = s W . (x nw)); CTA (0, 0) also writes the normed row to xn (when not null) for
// the later readers of the normed x.
// NT > 1 (speculative verify steps: mvxn2 / mvxn4): n <= NT token rows of x at x_tok floats apart
// (token t >= n repeats token n - 1 and is not stored), each staged at t * cols / 4 (host: NT cols
// <= MVX_MAXC, cols % 128 == 0, so the slot swizzle of every token's copy is the one-token
// copy's), each weight slot loaded once for all of them; each token's sums, s and normed row
// (xn + t cols) in the one-token kernel's order: every token gets the bits it gets alone.
template <int T, int R, int U, class Src, class Snk, bool NORM = false, int NT = 1>
__device__ __forceinline__ void mvx_run(const float* __restrict__ x, int cols, int ks_n, int ncb, const Src& src,
                                        const Snk& snk, const float* __restrict__ nw = nullptr, float eps = 0.0f,
                                        float* __restrict__ xn = nullptr, long long x_tok = 0, int n = 1) {
    __shared__ float4 xs[MVX_MAXC / 4];
    __shared__ float part[2][MV_WARPS][R * NT];
    constexpr int W = DS4_WARP, C = MvxT<T>::C;
    int warp = threadIdx.x / W, lane = threadIdx.x % W;
    int ks = warp % ks_n, gi = warp / ks_n;
    int hb = cols / C;
    int hw = ((hb + ks_n - 1) / ks_n + W - 1) / W * W; // slots of a k-slice: whole warp steps
    int hs = ks * hw, he = min(hs + hw, hb);
    int spr = (hw + U * W - 1) / (U * W); // rounds per batch
    int nmine = (int)blockIdx.x < ncb ? (ncb - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
    int total = nmine * spr; // CTA-uniform
    uint4 v[U][R];
    u32 d[U][R];
    if (total > 0) {
#pragma unroll
        for (int u = 0; u < U; u++) mvx_fetch<T, R>(src, blockIdx.x, gi, hs + u * W + lane, he, v[u], d[u]);
    }
    ds4_pdl_enter(); // round 0's weight loads in flight across the wait; x after it
    float sc[NT]; // NORM: each token's row scale s, applied to its row totals
#pragma unroll
    for (int t = 0; t < NT; t++) {
        const float4* xg = (const float4*)(x + (NT > 1 ? (long long)min(t, n - 1) * x_tok : 0));
        float4* xst = xs + t * (cols / 4);
        sc[t] = 1.0f;
        if (NORM) {
            // x * nw staged in one load round (x and nw together); the sum of squares rides the
            // staging barrier.
            __shared__ double nred[NT][MV_WARPS];
            const float4* wg = (const float4*)nw;
            double ss = 0.0;
            for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
                float4 a = xg[i], g = wg[i];
                ss += (double)a.x * (double)a.x + (double)a.y * (double)a.y + (double)a.z * (double)a.z +
                      (double)a.w * (double)a.w;
                xst[mvx_sw(i)] = make_float4(a.x * g.x, a.y * g.y, a.z * g.z, a.w * g.w);
            }
            ss = ds4_warp_sum_f64(ss);
            if (lane == 0) nred[t][warp] = ss;
            __syncthreads();
            ss = 0.0;
            for (int k = 0; k < (int)blockDim.x / W; k++) ss += nred[t][k]; // warp order: every CTA the same s
            sc[t] = (float)(1.0 / sqrt(ss / (double)cols + (double)eps));
            if (xn != nullptr && blockIdx.x == 0 && blockIdx.z == 0 && t < n) // the normed row as rmsnorm_f32w
                for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
                    float4 a = xg[i], g = wg[i];
                    ((float4*)(xn + (long long)t * cols))[i] =
                        make_float4(a.x * sc[t] * g.x, a.y * sc[t] * g.y, a.z * sc[t] * g.z, a.w * sc[t] * g.w);
                }
        } else {
            for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) xst[mvx_sw(i)] = xg[i];
            __syncthreads();
        }
    }
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[i][t] = 0.0f;
    int cb = blockIdx.x, s = 0, p = 0;
    for (int j = 0; j < total; j++) {
        // Round j + 1: step s + 1 of batch cb, or step 0 of the next batch.
        int s1 = s + 1 == spr ? 0 : s + 1, cb1 = s + 1 == spr ? cb + (int)gridDim.x : cb;
        bool more = j + 1 < total;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int h = hs + (s * U + u) * W + lane;
            if (h < he) {
                if constexpr (NT == 1 || T != T_Q8_0) { // F16: converting again per token is cheap
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        float4 xv[4];
                        MvxT<T>::xload(xs + t * (cols / 4), h, xv);
#pragma unroll
                        for (int i = 0; i < R; i++) acc[i][t] = MvxT<T>::dot(v[u][i], d[u][i], xv, acc[i][t]);
                    }
                } else { // Q8_0: each row's quants converted once, then every token's x loaded once
                    float w[R][16];
#pragma unroll
                    for (int i = 0; i < R; i++) MvxT<T>::cvt(v[u][i], w[i]);
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        float4 xv[4];
                        MvxT<T>::xload(xs + t * (cols / 4), h, xv);
#pragma unroll
                        for (int i = 0; i < R; i++) acc[i][t] = MvxT<T>::dotw(w[i], d[u][i], xv, acc[i][t]);
                    }
                }
            }
            if (more) mvx_fetch<T, R>(src, cb1, gi, hs + (s1 * U + u) * W + lane, he, v[u], d[u]);
        }
        if (s1 == 0) { // batch cb done (CTA-uniform)
            float tv[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                tv[t] = 0.0f;
#pragma unroll
                for (int i = 0; i < R; i++) {
                    float a = ds4_warp_sum(acc[i][t]);
                    if (lane == i) tv[t] = a;
                    acc[i][t] = 0.0f;
                }
            }
            if (ks_n > 1) {
                if (lane < R)
#pragma unroll
                    for (int t = 0; t < NT; t++) part[p][warp][t * R + lane] = tv[t];
                __syncthreads();
                if (ks == 0) {
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        tv[t] = 0.0f;
                        if (lane < R)
                            for (int k = 0; k < ks_n; k++) tv[t] += part[p][warp + k][t * R + lane];
                    }
                }
                p ^= 1;
            }
            if (ks == 0)
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (NT == 1 || t < n) snk.put(cb, gi, NORM ? tv[t] * sc[t] : tv[t], t);
        }
        s = s1, cb = cb1;
    }
}

// Single matrix (z groups of `rows` consecutive rows, x of group z at z*x_z, y at z*y_z).
template <int T, int R> struct MvxOne {
    const u8* W;
    const u16* D;
    long long g0; // first row of group z
    int rows, cols, groups;
    __device__ __forceinline__ MvxRow row(int cb, int gi, int i) const {
        u32 g = (u32)g0 + min((cb * groups + gi) * R + i, rows - 1);
        if (T == T_Q8_0) return MvxRow{(const uint4*)W, D, g * (u32)(cols / 16), g * (u32)(cols / 32)};
        return MvxRow{(const uint4*)W, D, g * (u32)(cols / 8), 0u};
    }
};
template <int R> struct MvxPut {
    float* y;
    int rows, groups;
    long long y_tok; // token t's row at y + t y_tok (NT > 1)
    __device__ __forceinline__ void put(int cb, int gi, float v, int t) const {
        int lane = threadIdx.x % DS4_WARP, r = (cb * groups + gi) * R + lane;
        if (lane < R && r < rows) y[(long long)t * y_tok + r] = v;
    }
};

// y[z*y_z + r] = W[z*rows + r] . x[z*x_z ..], r < rows; Q8_0: W = Q (decode layout), D its scales;
// F16: W rows of cols halfs (D unused). ks: k-slices per row group.
// NORM: the product of x normed (mvx_run; nw the norm weight, xn the normed row or null).
// NT > 1: n token rows (x at x_tok, y at y_tok floats apart; mvx_run).
template <int T, int R, int U, bool NORM = false, int NT = 1>
__device__ __forceinline__ void mvx_body(const u8* __restrict__ W, const u16* __restrict__ D, const float* __restrict__ x,
                                         long long x_z, float* __restrict__ y, long long y_z, int rows, int cols,
                                         int ks, const float* __restrict__ nw = nullptr, float eps = 0.0f,
                                         float* __restrict__ xn = nullptr, long long x_tok = 0, long long y_tok = 0,
                                         int n = 1) {
    int groups = MV_WARPS / ks, z = blockIdx.z;
    int ncb = (rows + groups * R - 1) / (groups * R);
    MvxOne<T, R> src{W, D, (long long)z * rows, rows, cols, groups};
    MvxPut<R> snk{y + (long long)z * y_z, rows, groups, y_tok};
    mvx_run<T, R, U, MvxOne<T, R>, MvxPut<R>, NORM, NT>(x + (long long)z * x_z, cols, ks, ncb, src, snk, nw, eps, xn,
                                                         x_tok, n);
}

#define MVX_PARAMS                                                                                                     \
    const u8 *__restrict__ W, const u16 *__restrict__ D, const float *__restrict__ x, long long x_z,                  \
        float *__restrict__ y, long long y_z, int rows, int cols, int ks
#define MVX_ARGS W, D, x, x_z, y, y_z, rows, cols, ks

DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvx_r4u2_q8_0(MVX_PARAMS) { DS4_PDL_LATE; mvx_body<T_Q8_0, 4, 2>(MVX_ARGS); }
// The same with the query's low-rank RMSNorm folded in (decode q_b: rmsnorm_f32w + mvx before):
// y = W . (x * s * nw) for one row x (zs = 1); xn (or null) receives the normed row.
DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvxn_r4u2_q8_0(MVX_PARAMS, const float* __restrict__ nw, float eps, float* __restrict__ xn) {
    DS4_PDL_LATE;
    mvx_body<T_Q8_0, 4, 2, true>(MVX_ARGS, nw, eps, xn);
}
// mvxn_r4u2_q8_0 for n <= NT token rows (speculative verify steps; zs = 1): x and xn rows cols
// floats apart, y rows `rows` apart; each token's y and xn the bits mvxn gives it alone (a row's
// sums depend on the k-slices ks, which the host plans as for mvxn, not on the rows a warp
// takes: R = 2 at NT = 2 and 1 at NT = 4 here, R = 4 spilled at 80 registers).
DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvxn2_r4u2_q8_0(MVX_PARAMS, const float* __restrict__ nw, float eps, float* __restrict__ xn, int n) {
    DS4_PDL_LATE;
    mvx_body<T_Q8_0, 2, 2, true, 2>(MVX_ARGS, nw, eps, xn, cols, rows, n);
}
DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvxn4_r4u2_q8_0(MVX_PARAMS, const float* __restrict__ nw, float eps, float* __restrict__ xn, int n) {
    DS4_PDL_LATE;
    mvx_body<T_Q8_0, 1, 2, true, 4>(MVX_ARGS, nw, eps, xn, cols, rows, n);
}

// Several matrices of one x (equal cols; the CSA compressor and indexer projections): matrix m
// takes CTA batches c_m .. c_{m+1} - 1 (c_0 = 0, absent m: INT_MAX), its rows in batch order as
// mvx_body's. Q8_0: W_m/D_m the decode layout; F16: W_m rows (no D_m; m < 5: a launch takes
// at most 24 arguments).
template <class X> __device__ __forceinline__ X mvx_at(int m, const X (&a)[5]) {
    return m == 0 ? a[0] : m == 1 ? a[1] : m == 2 ? a[2] : m == 3 ? a[3] : a[4];
}
template <int T, int R> struct MvxMulti {
    const u8* W[5];
    const u16* D[5];
    float* y[5];
    int rows[5];
    int c[5]; // c[0] = 0
    int cols, groups;
    __device__ __forceinline__ int pick(int cb) const {
        return (cb >= c[1]) + (cb >= c[2]) + (cb >= c[3]) + (cb >= c[4]);
    }
    __device__ __forceinline__ MvxRow row(int cb, int gi, int i) const {
        int m = pick(cb);
        u32 g = min(((cb - mvx_at(m, c)) * groups + gi) * R + i, mvx_at(m, rows) - 1);
        return MvxRow{(const uint4*)mvx_at(m, W), mvx_at(m, D), g * (u32)(cols / MvxT<T>::C), g * (u32)(cols / 32)};
    }
    __device__ __forceinline__ void put(int cb, int gi, float v, int t) const {
        int m = pick(cb), lane = threadIdx.x % DS4_WARP, r = ((cb - mvx_at(m, c)) * groups + gi) * R + lane;
        // token t's row of matrix m at y_m + t rows_m (NT > 1)
        if (lane < R && r < mvx_at(m, rows)) mvx_at(m, y)[r + (long long)t * mvx_at(m, rows)] = v;
    }
};

#define MVXMF_ONE(i) const u8 *__restrict__ W##i, float *__restrict__ y##i, int rows##i
#define MVXMF_PARAMS                                                                                                   \
    MVXMF_ONE(0), MVXMF_ONE(1), MVXMF_ONE(2), MVXMF_ONE(3), MVXMF_ONE(4), const float *__restrict__ x, int cols, int ks, \
        int c1, int c2, int c3, int c4, int ncb
#define MVXM_BODY                                                                                                \
    MvxMulti<T_F16, 4> mm{{W0, W1, W2, W3, W4}, {nullptr, nullptr, nullptr, nullptr, nullptr}, {y0, y1, y2, y3, y4},     \
                          {rows0, rows1, rows2, rows3, rows4}, {0, c1, c2, c3, c4}, cols, MV_WARPS / ks};             \
    mvx_run<T_F16, 4, 2, MvxMulti<T_F16, 4>, MvxMulti<T_F16, 4>>(x, cols, ks, ncb, mm, mm);
DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvxm_r4u2_f16(MVXMF_PARAMS) { DS4_PDL_LATE; MVXM_BODY }
// mvxm_r4u2_f16 for n <= 2 token rows (a verify step's compressor + indexer projections: each F16
// row read once for both tokens; x rows cols floats apart, matrix m's y rows rows_m apart; each
// token's bits as mvxm alone). Host: 2 cols <= MVX_MAXC, cols % 128 == 0.
DS4_KERNEL void DS4_BOUNDS(MVX_LB) mvxm2_r4u2_f16(MVXMF_PARAMS, int n) {
    DS4_PDL_LATE;
    MvxMulti<T_F16, 4> mm{{W0, W1, W2, W3, W4}, {nullptr, nullptr, nullptr, nullptr, nullptr}, {y0, y1, y2, y3, y4},
                          {rows0, rows1, rows2, rows3, rows4}, {0, c1, c2, c3, c4}, cols, MV_WARPS / ks};
    mvx_run<T_F16, 4, 2, MvxMulti<T_F16, 4>, MvxMulti<T_F16, 4>, false, 2>(x, cols, ks, ncb, mm, mm, nullptr, 0.0f, nullptr,
                                                                          cols, n);
}
