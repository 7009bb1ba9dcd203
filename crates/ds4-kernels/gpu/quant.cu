// Dequantisation and matrix-vector products for the GGUF block formats of model.md §5.
// A weight matrix is `rows` rows of `cols` elements, each row `row_bytes` bytes of whole blocks
// (the GGUF layout). Work is cut into *chunks* of 32 consecutive elements of a row: one Q8_0
// block, or 1/8 of a 256-element K/IQ super-block (one Q4_K sub-block pair half, one IQ2_XXS
// group), so every type shares one loop shape.
#include "prelude.cuh"
#include "dequant.cuh"

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
                                                    int cols, long long row_bytes) { ds4_pdl_enter();                        \
        dequant_rows<T>(W, out, rows, cols, row_bytes);                                                    \
    }                                                                                                      \
    DS4_KERNEL void DS4_BOUNDS(DS4_MV_WARPS* DS4_WARP)                                                     \
        matvec_##name(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y, int rows, \
                      int cols, long long row_bytes, int cps) { ds4_pdl_enter();                                            \
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
    ds4_pdl_enter();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float s = 0.0f;
    for (int i = 0; i < nsplit; i++) s += part[(size_t)i * rows + r];
    y[r] = s;
}
