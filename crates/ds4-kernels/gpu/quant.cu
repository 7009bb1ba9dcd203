// Dequantisation and matrix-vector products for the GGUF block formats of model.md §5.
// A weight matrix is `rows` rows of `cols` elements, each row `row_bytes` bytes of whole blocks
// (the GGUF layout). Work is cut into *chunks* of 32 consecutive elements of a row: one Q8_0
// block, or 1/8 of a 256-element K/IQ super-block (one Q4_K sub-block pair half, one IQ2_XXS
// group), so every type shares one loop shape.
#include "prelude.cuh"
#include "iq2xxs_grid.cuh"

#define T_F32 0
#define T_F16 1
#define T_BF16 2
#define T_Q8_0 3
#define T_Q2_K 4
#define T_Q4_K 5
#define T_IQ2_XXS 6

// Dequantise chunk `c` (elements 32c..32c+32) of one row into w[32], with exactly the CPU
// reference's f32 operations (ds4-quant portable.rs) so the result is bit-identical.
template <int T> __device__ __forceinline__ void deq_chunk(const u8* __restrict__ row, int c, float* w);

template <> __device__ __forceinline__ void deq_chunk<T_F32>(const u8* __restrict__ row, int c, float* w) {
    const float* p = (const float*)(row + (size_t)c * 128); // rows of f32 are 4-byte aligned
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = p[i];
}

template <> __device__ __forceinline__ void deq_chunk<T_F16>(const u8* __restrict__ row, int c, float* w) {
    const u16* p = (const u16*)(row + (size_t)c * 64);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = ds4_h2f(p[i]);
}

template <> __device__ __forceinline__ void deq_chunk<T_BF16>(const u8* __restrict__ row, int c, float* w) {
    const u16* p = (const u16*)(row + (size_t)c * 64);
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = ds4_bf2f(p[i]);
}

// Q8_0, 34 bytes: d f16, qs i8[32]. w = q * d.
template <> __device__ __forceinline__ void deq_chunk<T_Q8_0>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)c * 34;
    float d = ds4_h2f(ds4_ld_u16(b));
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = ds4_mul_rn((float)(signed char)b[2 + i], d);
}

// Q2_K, 84 bytes: scales u8[16], qs u8[64], d f16, dmin f16. Element k = 128h + 32j + 16i + l
// is (qs[32h + 16i + l] >> 2j) & 3 with scale byte 8h + 2j + i (low nibble scale, high min).
// Chunk p (0..8) of the block is h = p/4, j = p%4.
template <> __device__ __forceinline__ void deq_chunk<T_Q2_K>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 84;
    int p = c & 7, h = p >> 2, j = p & 3;
    float d = ds4_h2f(ds4_ld_u16(b + 80)), dmin = ds4_h2f(ds4_ld_u16(b + 82));
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 s = b[8 * h + 2 * j + i];
        float dl = ds4_mul_rn(d, (float)(s & 15)), ml = ds4_mul_rn(dmin, (float)(s >> 4));
        const u8* q = b + 16 + 32 * h + 16 * i;
#pragma unroll
        for (int l = 0; l < 16; l++)
            w[16 * i + l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((q[l] >> (2 * j)) & 3)), ml);
    }
}

// Q4_K, 144 bytes: d f16, dmin f16, scales u8[12] (6-bit scale/min pairs), qs u8[128].
// Chunk p is sub-block p: low (p even) or high (p odd) nibbles of qs[32(p/2) ..+32].
template <> __device__ __forceinline__ void deq_chunk<T_Q4_K>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 144;
    int p = c & 7;
    float d = ds4_h2f(ds4_ld_u16(b)), dmin = ds4_h2f(ds4_ld_u16(b + 2));
    const u8* sc = b + 4;
    u32 s, m;
    if (p < 4) {
        s = sc[p] & 63;
        m = sc[p + 4] & 63;
    } else {
        s = (sc[p + 4] & 15) | ((sc[p - 4] >> 6) << 4);
        m = (sc[p + 4] >> 4) | ((sc[p] >> 6) << 4);
    }
    float dl = ds4_mul_rn(d, (float)s), ml = ds4_mul_rn(dmin, (float)m);
    const u8* q = b + 16 + 32 * (p >> 1);
    int shift = 4 * (p & 1);
#pragma unroll
    for (int l = 0; l < 32; l++) w[l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((q[l] >> shift) & 15)), ml);
}

// IQ2_XXS, 66 bytes: d f16, then 8 groups of (4 grid indices u8, aux u32). Chunk p is group p:
// scale (d * (0.5 + aux>>28)) * 0.25; 4 runs of 8 grid magnitudes, each with a 7-bit sign field
// (aux >> 7k) whose 8th bit is its parity (ggml's ksigns_iq2xs, computed instead of tabled).
template <> __device__ __forceinline__ void deq_chunk<T_IQ2_XXS>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 66;
    const u8* g = b + 2 + 8 * (c & 7);
    float d = ds4_h2f(ds4_ld_u16(b));
    u32 aux = ds4_ld_u32(g + 4);
    float db = ds4_mul_rn(ds4_mul_rn(d, 0.5f + (float)(aux >> 28)), 0.25f);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u64 grid = ds4_iq2xxs_grid[g[k]];
        u32 s7 = (aux >> (7 * k)) & 127;
        u32 signs = s7 | ((__popc(s7) & 1) << 7);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float v = ds4_mul_rn(db, (float)((grid >> (8 * j)) & 0xff));
            w[8 * k + j] = __int_as_float(__float_as_int(v) ^ (((signs >> j) & 1) << 31));
        }
    }
}

// out[r * cols + k] = dequant(W)[r][k]. One thread per chunk.
template <int T>
__device__ __forceinline__ void dequant_rows(const u8* __restrict__ W, float* __restrict__ out, int rows, int cols,
                                             long long row_bytes) {
    long long chunks = (long long)(cols / 32), idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= chunks * rows) return;
    int r = (int)(idx / chunks), c = (int)(idx % chunks);
    float w[32];
    deq_chunk<T>(W + r * row_bytes, c, w);
    float4* o = (float4*)(out + (size_t)r * cols + (size_t)c * 32);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = make_float4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

// y = W x. One warp per row, DS4_MV_WARPS rows per CTA (blockIdx.x); blockIdx.y is the K split:
// split s covers chunks [s*cps, min((s+1)*cps, cols/32)). Without splitting (gridDim.y == 1)
// the warp writes y[r]; otherwise it writes the partial sum to y[s * rows + r] and
// reduce_splits_f32 adds the splits in order (deterministic, no atomics).
#define DS4_MV_WARPS 4
template <int T>
__device__ __forceinline__ void matvec_rows(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                            int rows, int cols, long long row_bytes, int cps) {
    int lane = threadIdx.x % DS4_WARP, r = blockIdx.x * DS4_MV_WARPS + threadIdx.x / DS4_WARP;
    if (r >= rows) return; // whole warps leave together: r is uniform across a warp
    int chunks = cols / 32, c0 = blockIdx.y * cps, c1 = min(c0 + cps, chunks);
    const u8* row = W + r * row_bytes;
    float acc = 0.0f;
    for (int c = c0 + lane; c < c1; c += DS4_WARP) {
        float w[32];
        deq_chunk<T>(row, c, w);
        const float4* xv = (const float4*)(x + (size_t)c * 32);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = xv[i];
            acc += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
        }
    }
    acc = ds4_warp_sum(acc);
    if (lane == 0) y[(size_t)blockIdx.y * rows + r] = acc;
}

#define DS4_QUANT_KERNELS(name, T)                                                                         \
    DS4_KERNEL void DS4_BOUNDS(256) dequant_##name(const u8* __restrict__ W, float* __restrict__ out, int rows, \
                                                    int cols, long long row_bytes) {                        \
        dequant_rows<T>(W, out, rows, cols, row_bytes);                                                    \
    }                                                                                                      \
    DS4_KERNEL void DS4_BOUNDS(DS4_MV_WARPS* DS4_WARP)                                                     \
        matvec_##name(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, \
                      int cols, long long row_bytes, int cps) {                                            \
        matvec_rows<T>(W, x, y, rows, cols, row_bytes, cps);                                               \
    }

DS4_QUANT_KERNELS(f32, T_F32)
DS4_QUANT_KERNELS(f16, T_F16)
DS4_QUANT_KERNELS(bf16, T_BF16)
DS4_QUANT_KERNELS(q8_0, T_Q8_0)
DS4_QUANT_KERNELS(q2_k, T_Q2_K)
DS4_QUANT_KERNELS(q4_k, T_Q4_K)
DS4_QUANT_KERNELS(iq2_xxs, T_IQ2_XXS)

// y[r] = sum over s of part[s * rows + r], in split order.
DS4_KERNEL void DS4_BOUNDS(256) reduce_splits_f32(const float* __restrict__ part, float* __restrict__ y, int rows,
                                                 int nsplit) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float s = 0.0f;
    for (int i = 0; i < nsplit; i++) s += part[(size_t)i * rows + r];
    y[r] = s;
}
