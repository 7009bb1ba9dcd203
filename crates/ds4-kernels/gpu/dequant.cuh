// Shared dequantisation of one 32-element chunk for the GGUF block formats (model.md §5), used by
// quant.cu (matvec/dequant) and matmul.cu (batched and expert products). Loads are as wide as the
// block layout allows (weight buffers are 256-byte aligned and every row/slab offset is a whole
// number of rows): f32/f16/bf16 16 bytes, Q4_K 16 bytes, Q2_K 4 bytes, Q8_0/IQ2_XXS 2 bytes.
#pragma once
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
    const float4* p = (const float4*)(row + (size_t)c * 128); // 128-byte chunks, 16-byte aligned
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = p[i];
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
}

template <> __device__ __forceinline__ void deq_chunk<T_F16>(const u8* __restrict__ row, int c, float* w) {
    const uint4* p = (const uint4*)(row + (size_t)c * 64); // 64-byte chunks
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = p[i];
        u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) w[8 * i + 2 * j] = ds4_h2f((u16)u[j]), w[8 * i + 2 * j + 1] = ds4_h2f((u16)(u[j] >> 16));
    }
}

template <> __device__ __forceinline__ void deq_chunk<T_BF16>(const u8* __restrict__ row, int c, float* w) {
    const uint4* p = (const uint4*)(row + (size_t)c * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = p[i];
        u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) w[8 * i + 2 * j] = __int_as_float(u[j] << 16), w[8 * i + 2 * j + 1] = __int_as_float(u[j] & 0xffff0000u);
    }
}

// Q8_0, 34 bytes: d f16, qs i8[32]. w = q * d.
template <> __device__ __forceinline__ void deq_chunk<T_Q8_0>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)c * 34;
    const u16* q = (const u16*)b; // blocks are 34 bytes: 2-byte aligned
    float d = ds4_h2f(q[0]);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 v = q[1 + i];
        w[2 * i] = ds4_mul_rn((float)(signed char)(v & 0xff), d);
        w[2 * i + 1] = ds4_mul_rn((float)(signed char)(v >> 8), d);
    }
}

// Q2_K, 84 bytes: scales u8[16], qs u8[64], d f16, dmin f16. Element k = 128h + 32j + 16i + l
// is (qs[32h + 16i + l] >> 2j) & 3 with scale byte 8h + 2j + i (low nibble scale, high min).
// Chunk p (0..8) of the block is h = p/4, j = p%4.
template <> __device__ __forceinline__ void deq_chunk<T_Q2_K>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 84;
    int p = c & 7, h = p >> 2, j = p & 3;
    u32 dd = *(const u32*)(b + 80); // blocks are 84 bytes: 4-byte aligned
    float d = ds4_h2f((u16)dd), dmin = ds4_h2f((u16)(dd >> 16));
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 s = b[8 * h + 2 * j + i];
        float dl = ds4_mul_rn(d, (float)(s & 15)), ml = ds4_mul_rn(dmin, (float)(s >> 4));
        const u32* q = (const u32*)(b + 16 + 32 * h + 16 * i);
#pragma unroll
        for (int l4 = 0; l4 < 4; l4++) {
            u32 v = q[l4] >> (2 * j);
#pragma unroll
            for (int l = 0; l < 4; l++)
                w[16 * i + 4 * l4 + l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((v >> (8 * l)) & 3)), ml);
        }
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
    const uint4* q = (const uint4*)(b + 16 + 32 * (p >> 1)); // blocks are 144 bytes: 16-byte aligned
    int shift = 4 * (p & 1);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = q[i];
        u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int l = 0; l < 4; l++)
                w[16 * i + 4 * j + l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((u[j] >> (8 * l + shift)) & 15)), ml);
    }
}

// IQ2_XXS, 66 bytes: d f16, then 8 groups of (4 grid indices u8, aux u32). Chunk p is group p:
// scale (d * (0.5 + aux>>28)) * 0.25; 4 runs of 8 grid magnitudes, each with a 7-bit sign field
// (aux >> 7k) whose 8th bit is its parity (ggml's ksigns_iq2xs, computed instead of tabled).
template <> __device__ __forceinline__ void deq_chunk<T_IQ2_XXS>(const u8* __restrict__ row, int c, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 66;
    const u16* g2 = (const u16*)(b + 2 + 8 * (c & 7)); // blocks are 66 bytes: 2-byte aligned
    float d = ds4_h2f(*(const u16*)b);
    u32 i01 = g2[0], i23 = g2[1];
    u8 g[4] = {(u8)i01, (u8)(i01 >> 8), (u8)i23, (u8)(i23 >> 8)};
    u32 aux = (u32)g2[2] | ((u32)g2[3] << 16);
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


// Dequantise slice q (0..3) of chunk c: elements 32c + 8q .. +8 into w[8], with the same f32
// operations as deq_chunk (so the same values). Four lanes share a chunk in the coalesced products.
template <int T> __device__ __forceinline__ void deq_slice(const u8* __restrict__ row, int c, int q, float* w);

template <> __device__ __forceinline__ void deq_slice<T_F32>(const u8* __restrict__ row, int c, int q, float* w) {
    const float4* p = (const float4*)(row + (size_t)c * 128 + q * 32);
    float4 a = p[0], b = p[1];
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}

template <> __device__ __forceinline__ void deq_slice<T_F16>(const u8* __restrict__ row, int c, int q, float* w) {
    uint4 v = *(const uint4*)(row + (size_t)c * 64 + q * 16);
    u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) w[2 * j] = ds4_h2f((u16)u[j]), w[2 * j + 1] = ds4_h2f((u16)(u[j] >> 16));
}

template <> __device__ __forceinline__ void deq_slice<T_BF16>(const u8* __restrict__ row, int c, int q, float* w) {
    uint4 v = *(const uint4*)(row + (size_t)c * 64 + q * 16);
    u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) w[2 * j] = __int_as_float(u[j] << 16), w[2 * j + 1] = __int_as_float(u[j] & 0xffff0000u);
}

template <> __device__ __forceinline__ void deq_slice<T_Q8_0>(const u8* __restrict__ row, int c, int q, float* w) {
    const u16* b = (const u16*)(row + (size_t)c * 34);
    float d = ds4_h2f(b[0]);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = b[1 + 4 * q + i];
        w[2 * i] = ds4_mul_rn((float)(signed char)(v & 0xff), d);
        w[2 * i + 1] = ds4_mul_rn((float)(signed char)(v >> 8), d);
    }
}

// Q2_K: chunk element 16i + l (l < 16) uses scale byte 8h + 2j + i and qs[32h + 16i + l].
template <> __device__ __forceinline__ void deq_slice<T_Q2_K>(const u8* __restrict__ row, int c, int q, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 84;
    int p = c & 7, h = p >> 2, j = p & 3, i = q >> 1, l0 = 8 * (q & 1);
    u32 dd = *(const u32*)(b + 80);
    float d = ds4_h2f((u16)dd), dmin = ds4_h2f((u16)(dd >> 16));
    u32 s = b[8 * h + 2 * j + i];
    float dl = ds4_mul_rn(d, (float)(s & 15)), ml = ds4_mul_rn(dmin, (float)(s >> 4));
    const u32* qs = (const u32*)(b + 16 + 32 * h + 16 * i + l0);
#pragma unroll
    for (int l4 = 0; l4 < 2; l4++) {
        u32 v = qs[l4] >> (2 * j);
#pragma unroll
        for (int l = 0; l < 4; l++) w[4 * l4 + l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((v >> (8 * l)) & 3)), ml);
    }
}

template <> __device__ __forceinline__ void deq_slice<T_Q4_K>(const u8* __restrict__ row, int c, int q, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 144;
    int p = c & 7;
    u32 dd = *(const u32*)b;
    float d = ds4_h2f((u16)dd), dmin = ds4_h2f((u16)(dd >> 16));
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
    const u32* qs = (const u32*)(b + 16 + 32 * (p >> 1) + 8 * q);
    int shift = 4 * (p & 1);
#pragma unroll
    for (int l4 = 0; l4 < 2; l4++) {
        u32 v = qs[l4] >> shift;
#pragma unroll
        for (int l = 0; l < 4; l++) w[4 * l4 + l] = ds4_sub_rn(ds4_mul_rn(dl, (float)((v >> (8 * l)) & 15)), ml);
    }
}

// IQ2_XXS: slice q is run q of the chunk's group (grid index g[q], sign field aux >> 7q).
template <> __device__ __forceinline__ void deq_slice<T_IQ2_XXS>(const u8* __restrict__ row, int c, int q, float* w) {
    const u8* b = row + (size_t)(c >> 3) * 66;
    const u16* g2 = (const u16*)(b + 2 + 8 * (c & 7));
    float d = ds4_h2f(*(const u16*)b);
    u32 idx = g2[q >> 1];
    u32 aux = (u32)g2[2] | ((u32)g2[3] << 16);
    float db = ds4_mul_rn(ds4_mul_rn(d, 0.5f + (float)(aux >> 28)), 0.25f);
    u64 grid = ds4_iq2xxs_grid[(idx >> (8 * (q & 1))) & 0xff];
    u32 s7 = (aux >> (7 * q)) & 127;
    u32 signs = s7 | ((__popc(s7) & 1) << 7);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float v = ds4_mul_rn(db, (float)((grid >> (8 * j)) & 0xff));
        w[j] = __int_as_float(__float_as_int(v) ^ (((signs >> j) & 1) << 31));
    }
}
