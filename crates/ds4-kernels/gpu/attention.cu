// Attention-state ops: RoPE, row rounding (FP8/FP4/f16), compressors, lightning indexer, sink attention.
// The CPU definitions are ds4-cpu's backend.rs and math.rs; rounding steps here are bit-exact copies
// (uncontracted f32 ops), the rest is bit-near (libm exp/sin differ by an ulp).
#include "prelude.cuh"
#include "ptx.cuh"

#define ds4_add_rn(a, b) __fadd_rn((a), (b))
#define ds4_div_rn(a, b) __fdiv_rn((a), (b))

// Per-step position in device memory (model/mod.rs `GpuBackend::step_pos`): kernels that take a
// position also take `sp`; null: the position argument is absolute (prefill, tests), else it is an
// offset from *sp, the step's first position, written before the step's graph runs, so a replayed
// decode graph keeps the same arguments every step. Read after ds4_pdl_enter.
#define DS4_POS(sp, v) ((v) + ((sp) ? *(sp) : 0LL))

// ---------------------------------------------------------------------------------------------
// RoPE

// Rotate pair p of v (tail offset) by pos·w (mod 2π, in f64); inverse uses −sin.
__device__ __forceinline__ void ds4_rope_pair(float* v, double w, long long pos, int inverse) {
    double theta = fmod((double)pos * w, 6.283185307179586);
    float s = (float)sin(theta), c = (float)cos(theta);
    if (inverse) s = -s;
    float a = v[0], b = v[1];
    v[0] = ds4_sub_rn(ds4_mul_rn(a, c), ds4_mul_rn(b, s));
    v[1] = ds4_add_rn(ds4_mul_rn(a, s), ds4_mul_rn(b, c));
}

// x: [rows, width] with rows = tokens × heads; token i = row / heads sits at position
// pos0 + i·step. One thread per (row, pair) over the last n_rot values.
DS4_KERNEL void DS4_BOUNDS(256) rope_f32(float* __restrict__ x, const double* __restrict__ freqs, long long rows, int heads,
                                         int width, int n_rot, long long pos0, long long step, int inverse,
                                         const long long* __restrict__ sp) {
    ds4_pdl_enter();
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int half = n_rot / 2;
    if (k >= rows * half) return;
    long long row = k / half;
    int p = (int)(k % half);
    long long pos = DS4_POS(sp, pos0) + (row / heads) * step;
    ds4_rope_pair(x + row * width + (width - n_rot) + 2 * p, freqs[p], pos, inverse);
}

// ---------------------------------------------------------------------------------------------
// Row rounding (math.rs: fp8_sim, fp4_hadamard_sim, f16_round)

// Nearest E4M3FN value of x (already clamped to ±448), ties to even. The binade comes from the
// exponent bits: equal to the CPU's floor(log2) wherever the result can differ.
__device__ __forceinline__ float ds4_e4m3(float x) {
    float a = fabsf(x);
    if (a == 0.0f || a != a) return x;
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    if (e < -6) e = -6;
    float quantum = __uint_as_float((u32)(e - 3 + 127) << 23);
    float q = ds4_mul_rn(rintf(ds4_div_rn(a, quantum)), quantum);
    q = fminf(q, 448.0f);
    return copysignf(q, x);
}

// Nearest E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code (callers clamp x to
// ±6): the values are multiples of 0.5 below 2, of 1 in [2, 4], of 2 above, and each tie's even
// code is the even multiple, so it is rint (ties to even) at that spacing; products by powers of
// two are exact. The CPU's search over the eight values (math.rs e2m1: the same results, its
// test e2m1_closed_form_matches_search) took 7 dependent compare steps here: 58% of
// index_qprep_f32's stall samples (bench/results/gpu-index-s28-h200.txt). NaN gives ±0 as the
// search did (ds4_clamp keeps NaN); |x| past 6 is taken as 6.
__device__ __forceinline__ float ds4_e2m1(float x) {
    if (x != x) return copysignf(0.0f, x);
    const float a = fminf(fabsf(x), 6.0f);
    const float k = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
    return copysignf(ds4_mul_rn(rintf(ds4_mul_rn(a, k)), 1.0f / k), x);
}

// f32 -> f16 (round to nearest even, subnormals, overflow to Inf) -> f32.
__device__ __forceinline__ float ds4_f16_round(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ax = x & 0x7fffffffu;
    u16 h;
    if (ax >= 0x7f800000u) {
        h = (u16)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    } else if (ax >= 0x477ff000u) { // rounds to >= 65536: Inf
        h = (u16)(sign | 0x7c00u);
    } else if (ax >= 0x38800000u) { // normal f16
        u32 m = ax + 0xfffu + ((ax >> 13) & 1u); // RNE on the 13 dropped bits
        h = (u16)(sign | ((m - 0x38000000u) >> 13));
    } else if (ax > 0x33000000u) { // subnormal f16 (> 2^-25)
        u32 e = ax >> 23;
        u32 m = (ax & 0x7fffffu) | 0x800000u;
        u32 shift = 126u - e; // 14..24
        u32 q = m >> shift, rem = m & ((1u << shift) - 1u), halfw = 1u << (shift - 1u);
        if (rem > halfw || (rem == halfw && (q & 1u))) q++;
        h = (u16)(sign | q);
    } else {
        h = (u16)sign; // |f| <= 2^-25 rounds to zero (2^-25 itself is a tie to even 0)
    }
    return ds4_h2f(h);
}

// Power-of-two scale 2^ceil(log2(r)), r = amax / lim in f64 as on the CPU, read off r's bits:
// device log2 is not exact at powers of two (CUDA: log2(2^-6) = -5.999999999999999, so ceil gave
// 2^-5 for amax = 448·2^-6). r is normal here (amax >= 1e-4 or 6·FLT_MIN); r = Inf gives Inf.
__device__ __forceinline__ float ds4_pow2_scale(float amax, double lim) {
    long long b = __double_as_longlong((double)amax / lim);
    long long e = (b >> 52) & 0x7ff;              // biased exponent of r (sign is +)
    if ((b & 0xfffffffffffffLL) && e < 0x7ff) e++; // not a power of two: next one up
    return (float)__longlong_as_double(e << 52);  // 2^(e-1023), exact; e = 0x7ff: Inf
}

// Rust's f32::clamp: NaN stays NaN (fminf/fmaxf would turn it into a bound).
__device__ __forceinline__ float ds4_clamp(float v, float lim) {
    return v != v ? v : fminf(fmaxf(v, -lim), lim);
}

// FP8 / Hadamard+FP4 rounding of a row staged in shared memory, by the whole CTA (any blockDim;
// scale_s holds 256 block scales). Ends synchronised.
__device__ __forceinline__ float ds4_warp_absmax(float m) {
#pragma unroll
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) m = fmaxf(m, ds4_shfl_xor(m, o));
    return m;
}

// One warp per scale block (its lanes over the block's values; max is order-free, so the result
// is the same as a serial scan): a decode row is one CTA, so a thread per block would leave most
// of it idle behind long serial loops of correctly rounded operations.
__device__ __forceinline__ void ds4_round_shared(float* row_s, float* scale_s, int width, int fp8_nope, int fp4) {
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP, nw = blockDim.x / DS4_WARP;
    if (fp8_nope > 0) {
        int nb = (fp8_nope + 63) / 64;
        for (int b = warp; b < nb; b += nw) {
            int e = min(b * 64 + 64, fp8_nope);
            float m = 0.0f;
            for (int i = b * 64 + lane; i < e; i += DS4_WARP) m = fmaxf(m, fabsf(row_s[i]));
            m = fmaxf(ds4_warp_absmax(m), 1e-4f);
            float s = ds4_pow2_scale(m, 448.0);
            for (int i = b * 64 + lane; i < e; i += DS4_WARP) {
                float v = ds4_clamp(ds4_div_rn(row_s[i], s), 448.0f);
                row_s[i] = ds4_mul_rn(ds4_e4m3(v), s);
            }
        }
        __syncthreads();
    }
    if (fp4) {
        for (int h = 1; h < width; h *= 2) {
            for (int k = threadIdx.x; k < width / 2; k += blockDim.x) {
                int j = (k / h) * 2 * h + (k % h);
                float a = row_s[j], b = row_s[j + h];
                row_s[j] = ds4_add_rn(a, b);
                row_s[j + h] = ds4_sub_rn(a, b);
            }
            __syncthreads();
        }
        float hs = ds4_div_rn(1.0f, __fsqrt_rn((float)width));
        for (int i = threadIdx.x; i < width; i += blockDim.x) row_s[i] = ds4_mul_rn(row_s[i], hs);
        __syncthreads();
        int nb = (width + 31) / 32;
        for (int b = warp; b < nb; b += nw) {
            int e = min(b * 32 + 32, width);
            float m = 0.0f;
            for (int i = b * 32 + lane; i < e; i += DS4_WARP) m = fmaxf(m, fabsf(row_s[i]));
            m = fmaxf(ds4_warp_absmax(m), 6.0f * 1.17549435e-38f);
            if (lane == 0) scale_s[b % 256] = ds4_pow2_scale(m, 6.0);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            float s = scale_s[(i / 32) % 256];
            float v = ds4_clamp(ds4_div_rn(row_s[i], s), 6.0f);
            row_s[i] = ds4_mul_rn(ds4_e2m1(v), s);
        }
        __syncthreads();
    }
}

// One CTA per row of x [rows, width]; the row is staged in dynamic shared memory (width floats).
// fp8_nope > 0: FP8 of the first fp8_nope values (blocks of 64); fp4: Hadamard (width a power of
// two) + FP4 (blocks of 32); f16: round to f16.
DS4_KERNEL void DS4_BOUNDS(256) round_rows_f32(float* __restrict__ x, int width, int fp8_nope, int fp4, int f16) {
    ds4_pdl_enter();
    extern __shared__ float row_s[];
    __shared__ float scale_s[256];
    float* xr = x + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) row_s[i] = xr[i];
    __syncthreads();
    ds4_round_shared(row_s, scale_s, width, fp8_nope, fp4);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = row_s[i];
        xr[i] = f16 ? ds4_f16_round(v) : v;
    }
}

// round_rows_f32 for width 128, Hadamard + FP4 only (the indexer's rows and queries; DS4_WARP 32):
// a warp per row instead of a CTA with a barrier per butterfly stage. Lane l holds elements
// 4l .. 4l+3: strides 1 and 2 within the lane, 4 .. 64 with lane l ^ (stride/4) (the lower index
// takes a + b, the upper a − b: the same operands as ds4_round_shared), a block of 32 is 8 lanes
// (amax by xor shuffles), then the same scale and rounding (ds4_fp4h128_lane, also used by
// index_qprep_f32). grid ceil(rows / 8), blockDim 256.
__device__ __forceinline__ void ds4_fp4h128_lane(float (&v)[4], int lane, int f16) {
    float t;
    t = v[0], v[0] = ds4_add_rn(t, v[1]), v[1] = ds4_sub_rn(t, v[1]); // stride 1
    t = v[2], v[2] = ds4_add_rn(t, v[3]), v[3] = ds4_sub_rn(t, v[3]);
    t = v[0], v[0] = ds4_add_rn(t, v[2]), v[2] = ds4_sub_rn(t, v[2]); // stride 2
    t = v[1], v[1] = ds4_add_rn(t, v[3]), v[3] = ds4_sub_rn(t, v[3]);
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) { // stride 4m
        const bool hi = lane & m;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float o = ds4_shfl_xor(v[c], m);
            v[c] = hi ? ds4_sub_rn(o, v[c]) : ds4_add_rn(v[c], o);
        }
    }
    const float hs = ds4_div_rn(1.0f, __fsqrt_rn(128.0f));
    float m = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; c++) v[c] = ds4_mul_rn(v[c], hs), m = fmaxf(m, fabsf(v[c]));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, ds4_shfl_xor(m, o)); // the lane's block of 32
    const float s = ds4_pow2_scale(fmaxf(m, 6.0f * 1.17549435e-38f), 6.0);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const float e = ds4_mul_rn(ds4_e2m1(ds4_clamp(ds4_div_rn(v[c], s), 6.0f)), s);
        v[c] = f16 ? ds4_f16_round(e) : e;
    }
}

DS4_KERNEL void DS4_BOUNDS(256) round_fp4h128_f32(float* __restrict__ x, long long rows, int f16) {
    ds4_pdl_enter();
    const int lane = threadIdx.x % DS4_WARP;
    const long long r = (long long)blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP;
    if (r >= rows || DS4_WARP != 32) return;
    float4* xr = (float4*)(x + r * 128) + lane;
    const float4 q = *xr;
    float v[4] = {q.x, q.y, q.z, q.w};
    ds4_fp4h128_lane(v, lane, f16);
    *xr = make_float4(v[0], v[1], v[2], v[3]);
}

// fmod(x, 2π) for x >= 0, exactly (fmod's result is exact, so this is the same value): with n the
// true quotient trunc(x / 2π), x − n·2π is representable and one fma gives it; x · (1/2π) rounded
// may be one off near an integer, which the sign / range checks correct. Instead of fmod's loop
// over the quotient's bits. Quotients past 2^40 (n ± 1 not exact far beyond; never for RoPE angles
// of int positions and frequencies <= 1) take fmod itself. Used by index_qprep_f32 and attend_one.
__device__ __forceinline__ double ds4_mod_2pi(double x) {
    const double y = 6.283185307179586;
    if (!(x < 6.9e12)) return fmod(x, y); // 2^40·2π ≈ 6.9e12
    double n = trunc(x * 0.15915494309189535);
    double r = fma(-n, y, x);
    while (r < 0.0) n -= 1.0, r = fma(-n, y, x);
    while (r >= y) n += 1.0, r = fma(-n, y, x);
    return r;
}

// The indexer query's preparation in one launch (model/attn.rs index_select): the copy of q into
// qr, rope_f32 (pos0 + row / heads, step 1, forward) over the last n_rot values and
// round_fp4h128_f32 (Hadamard + FP4, no f16), the same bits. Rows of width 128, a warp per row
// (lane l: elements 4l .. 4l+3; width − n_rot is even, so a RoPE pair never spans two lanes).
// The (cos, sin) of each pair are computed once per CTA for each token of its 8 rows (<= 8
// tokens; one at decode with 64 heads) into shared memory, from ds4_rope_pair's f64 angle
// (ds4_mod_2pi: fmod's value) and sincos (sin's and cos's values), before the PDL wait: they
// read only the frequencies and the step block, which no kernel writes (mod.rs StepPos: a copy
// queued on the stream before the step's kernels), so they overlap the previous kernel.
// grid ceil(rows / 8), blockDim 256, DS4_WARP 32, n_rot <= 128.
DS4_KERNEL void DS4_BOUNDS(256) index_qprep_f32(const float* __restrict__ q, float* __restrict__ qr, const double* __restrict__ freqs, long long rows, int heads, int n_rot, long long pos0, const long long* __restrict__ sp) {
    DS4_PDL_LATE;
    if (DS4_WARP != 32) {
        ds4_pdl_enter();
        return;
    }
    __shared__ float2 cs_s[256 / 32][64]; // [token − the CTA's first token][pair]: (cos, sin)
    const int lane = threadIdx.x % DS4_WARP, w = threadIdx.x / DS4_WARP;
    const long long r0 = (long long)blockIdx.x * (blockDim.x / DS4_WARP), r = r0 + w;
    const long long rl = min(r0 + (long long)(blockDim.x / DS4_WARP), rows) - 1; // the CTA's last row
    const long long tk0 = r0 / heads, pb = DS4_POS(sp, pos0) + tk0;
    const int half = n_rot / 2, off = 128 - n_rot, nk = (int)(rl / heads - tk0 + 1) * half;
    for (int k = threadIdx.x; k < nk; k += blockDim.x) { // as ds4_rope_pair
        const double theta = ds4_mod_2pi((double)(pb + k / half) * freqs[k % half]);
        double s, c;
        sincos(theta, &s, &c);
        cs_s[k / half][k % half] = make_float2((float)c, (float)s);
    }
    ds4_pdl_enter();
    __syncthreads();
    if (r >= rows) return;
    const float4 x = ((const float4*)(q + r * 128))[lane];
    float v[4] = {x.x, x.y, x.z, x.w};
    const int t = (int)(r / heads - tk0);
#pragma unroll
    for (int c = 0; c < 4; c += 2) {
        const int e = 4 * lane + c;
        if (e >= off) { // ds4_rope_pair's rotation (forward)
            const float2 cs = cs_s[t][(e - off) / 2];
            const float a0 = v[c], b0 = v[c + 1];
            v[c] = ds4_sub_rn(ds4_mul_rn(a0, cs.x), ds4_mul_rn(b0, cs.y));
            v[c + 1] = ds4_add_rn(ds4_mul_rn(a0, cs.y), ds4_mul_rn(b0, cs.x));
        }
    }
    ds4_fp4h128_lane(v, lane, 0);
    ((float4*)(qr + r * 128))[lane] = make_float4(v[0], v[1], v[2], v[3]);
}

// ---------------------------------------------------------------------------------------------
// Compressor over a chunk (positions t0 .. t0+n). Frontier: slots × w values and scores.

struct ds4_comp {
    const float* a;      // [n, w] projections of the chunk
    const float* g;      // [n, w] gates of the chunk
    const u8* ape;       // [r rows of w], type ape_ty (0 f32, 1 f16, 2 bf16), row_bytes per row
    const float* fkv;    // old frontier values [slots, w]
    const float* fsc;    // old frontier scores [slots, w]
    long long t0;
    int n, r, coff, w, ape_ty, ape_row_bytes;
};

__device__ __forceinline__ float ds4_ape(const ds4_comp& c, int row, int col) {
    const u8* p = c.ape + (size_t)row * c.ape_row_bytes;
    if (c.ape_ty == 0) return __uint_as_float(ds4_ld_u32(p + 4 * col));
    if (c.ape_ty == 1) return ds4_h2f(ds4_ld_u16(p + 2 * col));
    return ds4_bf2f(ds4_ld_u16(p + 2 * col));
}

// Value and score of position q (>= (t0/r − 1)·r) at column col: from the chunk, else the old
// frontier (window t0/r in its B slots for CSA, window t0/r − 1 in the A slots).
__device__ __forceinline__ void ds4_fetch(const ds4_comp& c, long long q, int col, float* kv, float* sc) {
    if (q >= c.t0) {
        long long i = q - c.t0;
        *kv = c.a[i * c.w + col];
        *sc = ds4_add_rn(c.g[i * c.w + col], ds4_ape(c, (int)(q % c.r), col));
        return;
    }
    long long cw0 = c.t0 / c.r;
    int slot = (int)(q % c.r);
    if (c.coff == 2 && q / c.r == cw0) slot += c.r;
    *kv = c.fkv[(size_t)slot * c.w + col];
    *sc = c.fsc[(size_t)slot * c.w + col];
}

// Candidate i of window wi at channel j (CPU compress_one order: A half slots 0..r, B half r..2r).
__device__ __forceinline__ void ds4_cand(const ds4_comp& c, long long wi, int i, int j, float* kv, float* sc) {
    int d = c.w / c.coff;
    if (c.coff == 2 && i < c.r) {
        if (wi == 0) { // no previous window: whatever the A slots hold
            *kv = c.fkv[(size_t)i * c.w + j];
            *sc = c.fsc[(size_t)i * c.w + j];
        } else {
            ds4_fetch(c, (wi - 1) * c.r + i, j, kv, sc);
        }
    } else if (c.coff == 2) {
        ds4_fetch(c, wi * c.r + (i - c.r), d + j, kv, sc);
    } else {
        ds4_fetch(c, wi * c.r + i, j, kv, sc);
    }
}

// Kernel parameters of the compressor (flattened: launches pass scalars and pointers only).
#define DS4_COMP_PARAMS                                                                               \
    const float *a, const float *g, const u8 *ape, const float *fkv, const float *fsc, long long t0, int n, \
        int r, int coff, int w, int ape_ty, int ape_row_bytes
#define DS4_COMP_MAKE ds4_comp c = {a, g, ape, fkv, fsc, t0, n, r, coff, w, ape_ty, ape_row_bytes}

// Pooled rows of the windows closed in the chunk: out [rows, d], row k = window t0/r + k.
// grid (rows, ceil(d / blockDim)); one thread per channel, candidates in CPU order.
DS4_KERNEL void DS4_BOUNDS(256) compress_pool_f32(DS4_COMP_PARAMS, float* __restrict__ out) {
    ds4_pdl_enter();
    DS4_COMP_MAKE;
    int d = c.w / c.coff;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d) return;
    long long wi = c.t0 / c.r + blockIdx.x;
    int nc = c.coff * c.r;
    float kv, sc, m = DS4_NEG_INF;
    for (int i = 0; i < nc; i++) {
        ds4_cand(c, wi, i, j, &kv, &sc);
        m = fmaxf(m, sc);
    }
    float s = 0.0f;
    for (int i = 0; i < nc; i++) {
        ds4_cand(c, wi, i, j, &kv, &sc);
        s = ds4_add_rn(s, expf(ds4_sub_rn(sc, m)));
    }
    float acc = -0.0f;
    for (int i = 0; i < nc; i++) {
        ds4_cand(c, wi, i, j, &kv, &sc);
        float p = ds4_div_rn(expf(ds4_sub_rn(sc, m)), s);
        acc = ds4_add_rn(acc, ds4_mul_rn(p, kv));
    }
    out[(size_t)blockIdx.x * d + j] = acc;
}

// The tail of a compressed row held in shared memory (row_s, d floats) with ss its f64 sum of
// squares in this thread: rmsnorm (weights norm), RoPE at position pos, rounding, written to o
// (f16-rounded when f16). scale_s (256 floats), part (blockDim / DS4_WARP doubles) and nscale_s
// are the caller's shared scratch. Shared by compress_row_f32 and compress_fin_f32 (same bits).
// obf: o holds bf16 (u16) values, not floats (the indexer's FP4-simulated rows: exact, half the
// bytes; mod.rs GpuComp::bf16).
__device__ __forceinline__ void ds4_comp_finish(float* row_s, float* scale_s, double* part, float* nscale_s, double ss, int d, const float* __restrict__ norm, float eps, const double* __restrict__ freqs, int n_rot, long long pos, int fp8_nope, int fp4, int f16, void* __restrict__ o, int obf) {
    int tid = threadIdx.x;
    ss = ds4_warp_sum_f64(ss);
    int warp = tid / DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    if (tid % DS4_WARP == 0) part[warp] = ss;
    __syncthreads();
    if (tid == 0) {
        double t = 0.0;
        for (int k = 0; k < nwarps; k++) t += part[k];
        *nscale_s = (float)(1.0 / sqrt(t / (double)d + (double)eps));
    }
    __syncthreads();
    float nsc = *nscale_s;
    for (int j = tid; j < d; j += blockDim.x) {
        float v = ds4_mul_rn(row_s[j], nsc);
        row_s[j] = ds4_mul_rn(v, norm[j]);
    }
    __syncthreads();
    for (int p = tid; p < n_rot / 2; p += blockDim.x) ds4_rope_pair(row_s + (d - n_rot) + 2 * p, freqs[p], pos, 0);
    __syncthreads();
    ds4_round_shared(row_s, scale_s, d, fp8_nope, fp4);
    for (int j = tid; j < d; j += blockDim.x) {
        float v = row_s[j];
        v = f16 ? ds4_f16_round(v) : v;
        if (obf)
            ((u16*)o)[j] = ds4_f2bf(v);
        else
            ((float*)o)[j] = v;
    }
}

// compress_pool_f32 + rmsnorm_f32 (weights norm) + RoPE (row k at position pos0 + k·r) +
// rounding in one launch: one CTA per closed row (grid rows, blockDim 256), the row in dynamic
// shared memory (d floats). Pooling as compress_pool_f32 (same order); the norm's f64 sum of
// squares is reduced in another order than rmsnorm_f32's (bit-near). With sp (DS4_POS) the
// rows start at window t0/r: out is the rows' base and pos0 an offset, both moved by t0/r rows.
// obf: out holds bf16 rows (ds4_comp_finish).
DS4_KERNEL void DS4_BOUNDS(256) compress_row_f32(const float *a, const float *g, const u8 *ape, const float *fkv, const float *fsc, long long t0a, int n, int r, int coff, int w, int ape_ty, int ape_row_bytes, void* __restrict__ out, const float* __restrict__ norm, float eps, const double* __restrict__ freqs, int n_rot, long long pos0, int fp8_nope, int fp4, int f16, const long long* __restrict__ sp, int obf) {
    ds4_pdl_enter();
    const long long t0 = DS4_POS(sp, t0a);
    const size_t esz = obf ? 2 : 4; // bytes a stored value
    if (sp) {
        out = (u8*)out + (size_t)(t0 / r) * (size_t)(w / coff) * esz;
        pos0 += (t0 / r) * r;
    }
    DS4_COMP_MAKE;
    extern __shared__ float row_s[];
    __shared__ float scale_s[256];
    __shared__ double part[256 / 32];
    __shared__ float nscale_s;
    int d = c.w / c.coff, tid = threadIdx.x;
    long long wi = c.t0 / c.r + blockIdx.x;
    int nc = c.coff * c.r;
    double ss = 0.0;
    for (int j = tid; j < d; j += blockDim.x) {
        float kv, sc, m = DS4_NEG_INF;
        for (int i = 0; i < nc; i++) {
            ds4_cand(c, wi, i, j, &kv, &sc);
            m = fmaxf(m, sc);
        }
        float s = 0.0f;
        for (int i = 0; i < nc; i++) {
            ds4_cand(c, wi, i, j, &kv, &sc);
            s = ds4_add_rn(s, expf(ds4_sub_rn(sc, m)));
        }
        float acc = -0.0f;
        for (int i = 0; i < nc; i++) {
            ds4_cand(c, wi, i, j, &kv, &sc);
            float p = ds4_div_rn(expf(ds4_sub_rn(sc, m)), s);
            acc = ds4_add_rn(acc, ds4_mul_rn(p, kv));
        }
        row_s[j] = acc;
        ss += (double)acc * (double)acc;
    }
    long long pos = pos0 + (long long)blockIdx.x * c.r;
    ds4_comp_finish(row_s, scale_s, part, &nscale_s, ss, d, norm, eps, freqs, n_rot, pos, fp8_nope, fp4, f16, (u8*)out + (size_t)blockIdx.x * d * esz, obf);
}

// Channels per CTA of compress_pool_sh_f32 (a multiple dividing blockDim; 32 floats = 128 bytes a
// candidate row, coalesced).
#define DS4_CP_CH 32

// The pooling of compress_row_f32 spread over channel chunks, for compress_fin_f32 to finish: at
// ratio 128 (HCA) one CTA a row left 16 CTAs on the GPU for a 2k chunk, each thread walking three
// serial 128-step loops of global loads (~380 us). Here grid (rows, ceil(d / DS4_CP_CH)), blockDim
// 256 (a multiple of DS4_CP_CH), dynamic shared 2·nc·DS4_CP_CH floats ([candidate][channel]).
// All threads load the candidates and take their max (order-free), the exponentials and the
// weighted values p·kv; only the two sums run serially, one thread a channel in the CPU order over
// shared memory, so each pooled value has the bits of compress_row_f32's. Rows (raw, pooled only)
// go to out, moved by t0/r rows with sp as compress_row_f32's.
DS4_KERNEL void DS4_BOUNDS(256) compress_pool_sh_f32(const float *a, const float *g, const u8 *ape, const float *fkv, const float *fsc, long long t0a, int n, int r, int coff, int w, int ape_ty, int ape_row_bytes, float* __restrict__ out, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    const long long t0 = DS4_POS(sp, t0a);
    const int d = w / coff, nc = coff * r;
    if (sp) out += (size_t)(t0 / r) * (size_t)d;
    DS4_COMP_MAKE;
    extern __shared__ float cp_s[];
    float* kv_s = cp_s;                    // [nc][CH] values, then p·kv
    float* e_s = cp_s + nc * DS4_CP_CH;    // [nc][CH] scores, then exponentials
    __shared__ float m_s[256];             // partial maxima [blockDim / CH][CH]
    __shared__ float s_s[DS4_CP_CH];
    const int tid = threadIdx.x, nt = blockDim.x, tot = nc * DS4_CP_CH;
    const int j0 = blockIdx.y * DS4_CP_CH;
    const long long wi = c.t0 / c.r + blockIdx.x;
    // k = i·CH + jj; nt is a multiple of CH, so every k of a thread has its channel jj.
    const int jj = tid % DS4_CP_CH, parts = nt / DS4_CP_CH;
    for (int k = tid; k < tot; k += nt) {
        int i = k / DS4_CP_CH, j = j0 + jj;
        float kv = 0.0f, sc = DS4_NEG_INF;
        if (j < d) ds4_cand(c, wi, i, j, &kv, &sc);
        kv_s[k] = kv;
        e_s[k] = sc;
    }
    __syncthreads();
    float m = DS4_NEG_INF;
    for (int i = tid / DS4_CP_CH; i < nc; i += parts) m = fmaxf(m, e_s[i * DS4_CP_CH + jj]);
    m_s[tid] = m;
    __syncthreads();
    m = DS4_NEG_INF;
    for (int p = 0; p < parts; p++) m = fmaxf(m, m_s[p * DS4_CP_CH + jj]);
    for (int k = tid; k < tot; k += nt) e_s[k] = expf(ds4_sub_rn(e_s[k], m));
    __syncthreads();
    if (tid < DS4_CP_CH) { // the CPU order: candidates 0 .. nc−1
        float s = 0.0f;
#pragma unroll 8
        for (int i = 0; i < nc; i++) s = ds4_add_rn(s, e_s[i * DS4_CP_CH + tid]);
        s_s[tid] = s;
    }
    __syncthreads();
    const float s = s_s[jj];
    for (int k = tid; k < tot; k += nt) kv_s[k] = ds4_mul_rn(ds4_div_rn(e_s[k], s), kv_s[k]);
    __syncthreads();
    if (tid < DS4_CP_CH && j0 + tid < d) {
        float acc = -0.0f;
#pragma unroll 8
        for (int i = 0; i < nc; i++) acc = ds4_add_rn(acc, kv_s[i * DS4_CP_CH + tid]);
        out[(size_t)blockIdx.x * d + j0 + tid] = acc;
    }
}

// compress_row_f32's tail over rows compress_pool_sh_f32 pooled into out: norm, RoPE, rounding in
// place (grid rows, blockDim 256, dynamic shared d floats); the sum of squares in
// compress_row_f32's order, so the two launches give its bits. t0a / sp as compress_row_f32.
DS4_KERNEL void DS4_BOUNDS(256) compress_fin_f32(float* __restrict__ out, int r, int d, long long t0a, const float* __restrict__ norm, float eps, const double* __restrict__ freqs, int n_rot, long long pos0, int fp8_nope, int fp4, int f16, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    const long long t0 = DS4_POS(sp, t0a);
    if (sp) {
        out += (size_t)(t0 / r) * (size_t)d;
        pos0 += (t0 / r) * r;
    }
    extern __shared__ float row_s[];
    __shared__ float scale_s[256];
    __shared__ double part[256 / 32];
    __shared__ float nscale_s;
    float* o = out + (size_t)blockIdx.x * d;
    double ss = 0.0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = o[j];
        row_s[j] = v;
        ss += (double)v * (double)v;
    }
    long long pos = pos0 + (long long)blockIdx.x * r;
    ds4_comp_finish(row_s, scale_s, part, &nscale_s, ss, d, norm, eps, freqs, n_rot, pos, fp8_nope, fp4, f16, o, 0);
}

// The frontier after the chunk, into nkv/nsc [slots, w] (never the old frontier itself).
DS4_KERNEL void DS4_BOUNDS(256) compress_frontier_f32(DS4_COMP_PARAMS, float* __restrict__ nkv, float* __restrict__ nsc) {
    ds4_pdl_enter();
    DS4_COMP_MAKE;
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int slots = c.coff * c.r;
    if (k >= (long long)slots * c.w) return;
    int slot = (int)(k / c.w), col = (int)(k % c.w);
    long long T = c.t0 + c.n, cw = T / c.r;
    int o = (int)(T % c.r);
    long long q = -1;
    if (c.coff == 2 && slot >= c.r) {
        int j = slot - c.r;
        q = j < o ? cw * c.r + j : (cw >= 1 ? (cw - 1) * c.r + j : -1);
    } else if (c.coff == 2) {
        q = cw >= 1 ? (cw - 1) * c.r + slot : -1;
    } else {
        q = slot < o ? cw * c.r + slot : (cw >= 1 ? (cw - 1) * c.r + slot : -1);
    }
    float kv, sc;
    if (q < 0) { // unchanged
        kv = c.fkv[k];
        sc = c.fsc[k];
    } else { // A slots: the window copied at the last close (fetch finds it in the chunk or old slots)
        ds4_fetch(c, q, col, &kv, &sc);
    }
    nkv[k] = kv;
    nsc[k] = sc;
}

// compress_frontier_f32 in place (one launch, no copy back). The new value of slot pair j (A slot j
// and B slot r+j for CSA, slot j otherwise) at column col depends only on the chunk and the old
// values of that same pair and column (sources sit at slot q % r == j), so the thread owning
// (j, col) reads them all, then writes. grid over r·w threads. Same bits as the copy form.
DS4_KERNEL void DS4_BOUNDS(256) compress_frontier_ip_f32(const float *a, const float *g, const u8 *ape, float *fkv, float *fsc, long long t0a, int n, int r, int coff, int w, int ape_ty, int ape_row_bytes, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    const long long t0 = DS4_POS(sp, t0a);
    ds4_comp c = {a, g, ape, fkv, fsc, t0, n, r, coff, w, ape_ty, ape_row_bytes};
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)r * w) return;
    int j = (int)(k / w), col = (int)(k % w);
    long long T = c.t0 + c.n, cw = T / c.r;
    int o = (int)(T % c.r);
    // Source position of slot j (the single / B slot) and, for CSA, of A slot j; −1: unchanged.
    long long qb = j < o ? cw * c.r + j : (cw >= 1 ? (cw - 1) * c.r + j : -1);
    long long qa = (coff == 2 && cw >= 1) ? (cw - 1) * c.r + j : -1;
    size_t ib = (size_t)(coff == 2 ? r + j : j) * w + col, ia = (size_t)j * w + col;
    float bkv = fkv[ib], bsc = fsc[ib], akv = 0.0f, asc = 0.0f;
    if (qb >= 0) ds4_fetch(c, qb, col, &bkv, &bsc);
    if (qa >= 0) ds4_fetch(c, qa, col, &akv, &asc);
    if (qb >= 0) {
        fkv[ib] = bkv;
        fsc[ib] = bsc;
    }
    if (qa >= 0) {
        fkv[ia] = akv;
        fsc[ia] = asc;
    }
}

// ---------------------------------------------------------------------------------------------
// Lightning indexer

// scores[i][r] = Σ_h (w[i,h]·ws)·max(0, q_ih·row_r) for r < visible(i) (exactly the CPU's order:
// dot with eight partial sums). grid (ceil(max_vis / blockDim), tokens), dynamic shared heads·ihd
// floats; q already rotated/rounded. max_vis is the row stride of scores: at least every token's
// visible count (the host passes the rows' capacity with sp, so that the grid stays put; CTAs
// past the visible rows return). rbf: rows are bf16 (u16) values, not floats (mod.rs GpuComp::bf16:
// the FP4-simulated rows, exact), read as the same f32 values.
__device__ __forceinline__ float ds4_ix_val(const void* __restrict__ rows, long long i, int rbf) {
    return rbf ? ds4_bf2f(((const u16*)rows)[i]) : ((const float*)rows)[i];
}
// Values 4 i4 .. 4 i4 + 3 of the rows (16-byte aligned f32 rows, or 8-byte aligned bf16 rows).
__device__ __forceinline__ float4 ds4_ix_val4(const void* __restrict__ rows, long long i4, int rbf) {
    if (!rbf) return ((const float4*)rows)[i4];
    const uint2 u = ((const uint2*)rows)[i4];
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

DS4_KERNEL void DS4_BOUNDS(256) index_scores_f32(const float* __restrict__ q, const float* __restrict__ w,
                                                 const void* __restrict__ rows, float* __restrict__ scores,
                                                 long long tba, long long max_vis, int heads, int ihd, int ratio,
                                                 float ws, const long long* __restrict__ sp, int rbf) {
    ds4_pdl_enter();
    const long long tb = DS4_POS(sp, tba);
    extern __shared__ float qi[]; // token i's query, heads × ihd
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    long long t = tb + i;
    long long vis = (t + 1) / ratio;
    if ((long long)blockIdx.x * blockDim.x >= vis) return; // whole CTA past the visible rows
    for (int e = threadIdx.x; e < heads * ihd; e += blockDim.x) qi[e] = q[(size_t)i * heads * ihd + e];
    __syncthreads();
    if (r >= vis) return;
    const long long key0 = r * ihd;
    auto key = [&](int e) { return ds4_ix_val(rows, key0 + e, rbf); };
    float total = -0.0f;
    int n8 = ihd / 8 * 8;
    for (int h = 0; h < heads; h++) {
        const float* qh = qi + (size_t)h * ihd;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int e = 0; e < n8; e += 8) {
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] = ds4_add_rn(acc[k], ds4_mul_rn(qh[e + k], key(e + k)));
        }
        float s = -0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) s = ds4_add_rn(s, acc[k]);
        for (int e = n8; e < ihd; e++) s = ds4_add_rn(s, ds4_mul_rn(qh[e], key(e)));
        float dm = s > 0.0f ? s : 0.0f;
        total = ds4_add_rn(total, ds4_mul_rn(ds4_mul_rn(w[(size_t)i * heads + h], ws), dm));
    }
    scores[(size_t)i * max_vis + r] = total;
}

// index_scores_f32 for ihd == 128 (the model's): the thread's row is held in registers (read
// once) instead of re-read from memory for every head; identical operations and order, so the
// same bits. Same grid, block (128) and dynamic shared memory (heads × 128 floats).
#define DS4_IX_HD 128
DS4_KERNEL void DS4_BOUNDS(128) index_scores128_f32(const float* __restrict__ q, const float* __restrict__ w, const void* __restrict__ rows, float* __restrict__ scores, long long tba, long long max_vis, int heads, int ihd, int ratio, float ws, const long long* __restrict__ sp, int rbf) {
    ds4_pdl_enter();
    const long long tb = DS4_POS(sp, tba);
    extern __shared__ float4 qi4[]; // token i's query, heads × DS4_IX_HD floats
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    long long t = tb + i;
    long long vis = (t + 1) / ratio;
    if ((long long)blockIdx.x * blockDim.x >= vis) return; // whole CTA past the visible rows
    const float4* qg = (const float4*)(q + (size_t)i * heads * DS4_IX_HD);
    for (int e = threadIdx.x; e < heads * DS4_IX_HD / 4; e += blockDim.x) qi4[e] = qg[e];
    __syncthreads();
    if (r >= vis) return;
    float key[DS4_IX_HD];
#pragma unroll
    for (int e = 0; e < DS4_IX_HD / 4; e++) {
        float4 v = ds4_ix_val4(rows, r * (DS4_IX_HD / 4) + e, rbf);
        key[4 * e] = v.x;
        key[4 * e + 1] = v.y;
        key[4 * e + 2] = v.z;
        key[4 * e + 3] = v.w;
    }
    const float* wi = w + (size_t)i * heads;
    float total = -0.0f;
    for (int h = 0; h < heads; h++) {
        const float4* qh = qi4 + h * (DS4_IX_HD / 4);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int e = 0; e < DS4_IX_HD; e += 8) {
            float4 a = qh[e / 4], b = qh[e / 4 + 1];
            acc[0] = ds4_add_rn(acc[0], ds4_mul_rn(a.x, key[e]));
            acc[1] = ds4_add_rn(acc[1], ds4_mul_rn(a.y, key[e + 1]));
            acc[2] = ds4_add_rn(acc[2], ds4_mul_rn(a.z, key[e + 2]));
            acc[3] = ds4_add_rn(acc[3], ds4_mul_rn(a.w, key[e + 3]));
            acc[4] = ds4_add_rn(acc[4], ds4_mul_rn(b.x, key[e + 4]));
            acc[5] = ds4_add_rn(acc[5], ds4_mul_rn(b.y, key[e + 5]));
            acc[6] = ds4_add_rn(acc[6], ds4_mul_rn(b.z, key[e + 6]));
            acc[7] = ds4_add_rn(acc[7], ds4_mul_rn(b.w, key[e + 7]));
        }
        float s = -0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) s = ds4_add_rn(s, acc[k]);
        float dm = s > 0.0f ? s : 0.0f;
        total = ds4_add_rn(total, ds4_mul_rn(ds4_mul_rn(wi[h], ws), dm));
    }
    scores[(size_t)i * max_vis + r] = total;
}

// index_scores128_f32 split over heads for latency: a CTA (256 threads) takes DS4_IXH_R rows;
// thread (g = tid / R, row tid % R) computes the terms of heads g, g + G, ... (G = 256 / R) with the
// same operations, into shared [heads][R]; then one thread per row adds them in head order (the
// same bits). grid (ceil(max_vis / R), tokens); dynamic shared heads × (128 + R) floats.
#define DS4_IXH_R 32
DS4_KERNEL void DS4_BOUNDS(256) index_scores128h_f32(const float* __restrict__ q, const float* __restrict__ w, const void* __restrict__ rows, float* __restrict__ scores, long long tba, long long max_vis, int heads, int ihd, int ratio, float ws, const long long* __restrict__ sp, int rbf) {
    ds4_pdl_enter();
    const long long tb = DS4_POS(sp, tba);
    extern __shared__ float4 qh4[];                             // heads × DS4_IX_HD floats
    float* term = (float*)(qh4 + heads * (DS4_IX_HD / 4));      // [heads][DS4_IXH_R]
    int i = blockIdx.y, tid = threadIdx.x;
    long long t = tb + i, vis = (t + 1) / ratio;
    long long r0 = (long long)blockIdx.x * DS4_IXH_R;
    if (r0 >= vis) return; // whole CTA past the visible rows
    const float4* qg = (const float4*)(q + (size_t)i * heads * DS4_IX_HD);
    for (int e = tid; e < heads * DS4_IX_HD / 4; e += blockDim.x) qh4[e] = qg[e];
    __syncthreads();
    int rr = tid % DS4_IXH_R, g = tid / DS4_IXH_R, ng = blockDim.x / DS4_IXH_R;
    long long r = r0 + rr;
    const float* wi = w + (size_t)i * heads;
    if (r < vis) {
        float key[DS4_IX_HD];
#pragma unroll
        for (int e = 0; e < DS4_IX_HD / 4; e++) {
            float4 v = ds4_ix_val4(rows, r * (DS4_IX_HD / 4) + e, rbf);
            key[4 * e] = v.x;
            key[4 * e + 1] = v.y;
            key[4 * e + 2] = v.z;
            key[4 * e + 3] = v.w;
        }
        for (int h = g; h < heads; h += ng) {
            const float4* qh = qh4 + h * (DS4_IX_HD / 4);
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int e = 0; e < DS4_IX_HD; e += 8) {
                float4 a = qh[e / 4], b = qh[e / 4 + 1];
                acc[0] = ds4_add_rn(acc[0], ds4_mul_rn(a.x, key[e]));
                acc[1] = ds4_add_rn(acc[1], ds4_mul_rn(a.y, key[e + 1]));
                acc[2] = ds4_add_rn(acc[2], ds4_mul_rn(a.z, key[e + 2]));
                acc[3] = ds4_add_rn(acc[3], ds4_mul_rn(a.w, key[e + 3]));
                acc[4] = ds4_add_rn(acc[4], ds4_mul_rn(b.x, key[e + 4]));
                acc[5] = ds4_add_rn(acc[5], ds4_mul_rn(b.y, key[e + 5]));
                acc[6] = ds4_add_rn(acc[6], ds4_mul_rn(b.z, key[e + 6]));
                acc[7] = ds4_add_rn(acc[7], ds4_mul_rn(b.w, key[e + 7]));
            }
            float s = -0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) s = ds4_add_rn(s, acc[k]);
            float dm = s > 0.0f ? s : 0.0f;
            term[h * DS4_IXH_R + rr] = ds4_mul_rn(ds4_mul_rn(wi[h], ws), dm);
        }
    }
    __syncthreads();
    if (tid < DS4_IXH_R && r < vis) {
        float total = -0.0f;
        for (int h = 0; h < heads; h++) total = ds4_add_rn(total, term[h * DS4_IXH_R + tid]);
        scores[(size_t)i * max_vis + r] = total;
    }
}

// Order-preserving key of a float (total order, as f32::total_cmp).
__device__ __forceinline__ u32 ds4_fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Top-k of each token's scores (largest, ties to the lower index), written ascending into
// sel[i] (top_k i32, −1 padded). Tokens with visible <= top_k get 0..visible. One CTA per token,
// blockDim 1024 (a multiple of the warp); radix select on the keys, then an ordered compaction.
DS4_KERNEL void DS4_BOUNDS(1024) index_topk(const float* __restrict__ scores, int* __restrict__ sel, long long tba,
                                            long long max_vis, int ratio, int top_k, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    const long long tb = DS4_POS(sp, tba);
    __shared__ u32 hist[256];
    __shared__ u32 prefix_s, want_s;
    __shared__ u32 warp_gt[1024 / 32], warp_eq[1024 / 32];
    __shared__ u32 base_gt, base_eq;
    int i = blockIdx.x;
    long long t = tb + i;
    long long vis = (t + 1) / ratio;
    int* out = sel + (size_t)i * top_k;
    if (vis <= top_k) {
        for (int k = threadIdx.x; k < top_k; k += blockDim.x) out[k] = k < vis ? k : -1;
        return;
    }
    const float* sc = scores + (size_t)i * max_vis;
    // Radix select: the key of the top_k-th largest, 8 bits at a time from the top.
    u32 prefix = 0, mask = 0, want = (u32)top_k; // want: rank among keys matching the prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // Runs of one bin are counted locally first (scores crowd into a few top bins, so
        // this saves most of the same-address shared atomics).
        u32 run_bin = 0, run_n = 0;
        for (long long r = threadIdx.x; r < vis; r += blockDim.x) {
            u32 kk = ds4_fkey(sc[r]);
            if ((kk & mask) != prefix) continue;
            u32 b = (kk >> shift) & 255u;
            if (b != run_bin && run_n > 0) {
                atomicAdd(&hist[run_bin], run_n);
                run_n = 0;
            }
            run_bin = b;
            run_n++;
        }
        if (run_n > 0) atomicAdd(&hist[run_bin], run_n);
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 acc = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (acc + hist[b] >= want) break;
                acc += hist[b];
            }
            prefix_s = prefix | ((u32)b << shift);
            want_s = want - acc;
        }
        __syncthreads();
        prefix = prefix_s;
        want = want_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the threshold key; take all keys > it and the first `want` equal ones by index.
    u32 thr = prefix, need_eq = want;
    if (threadIdx.x == 0) {
        base_gt = 0;
        base_eq = 0;
    }
    __syncthreads();
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP, nw = blockDim.x / DS4_WARP;
    ds4_mask_t below = lane == 0 ? 0 : ((~(ds4_mask_t)0) >> (64 - lane));
    for (long long r0 = 0; r0 < vis; r0 += blockDim.x) {
        long long r = r0 + threadIdx.x;
        u32 kk = r < vis ? ds4_fkey(sc[r]) : 0;
        bool gt = r < vis && kk > thr, eq = r < vis && kk == thr;
        ds4_mask_t bg = ds4_ballot(gt), be = ds4_ballot(eq);
        if (lane == 0) {
            warp_gt[warp] = (u32)__popcll(bg);
            warp_eq[warp] = (u32)__popcll(be);
        }
        __syncthreads();
        u32 pg = base_gt, pe = base_eq; // counts of earlier rows taken
        for (int k = 0; k < warp; k++) {
            pg += warp_gt[k];
            pe += warp_eq[k];
        }
        pe += (u32)__popcll(be & below);
        pg += (u32)__popcll(bg & below);
        bool take = gt || (eq && pe < need_eq);
        if (take) {
            u32 pos = pg + (pe < need_eq ? pe : need_eq); // rows taken before r
            out[pos] = (int)r;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int k = 0; k < nw; k++) {
                base_gt += warp_gt[k];
                base_eq += warp_eq[k];
            }
        }
        __syncthreads();
    }
}

// index_topk with the bin choice of each radix pass as a parallel suffix scan (no serial
// 256-step pass by one thread); same selection. Same launch.
// Top-k of each token's scores (largest, ties to the lower index), written ascending into
// sel[i] (top_k i32, −1 padded). Tokens with visible <= top_k get 0..visible. One CTA per token,
// blockDim 1024 (a multiple of the warp); radix select on the keys, then an ordered compaction.
DS4_KERNEL void DS4_BOUNDS(1024) index_topk_ps(const float* __restrict__ scores, int* __restrict__ sel, long long tba, long long max_vis, int ratio, int top_k, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    const long long tb = DS4_POS(sp, tba);
    __shared__ u32 hist[256];
    __shared__ u32 prefix_s, want_s;
    __shared__ u32 warp_gt[1024 / 32], warp_eq[1024 / 32];
    __shared__ u32 base_gt, base_eq;
    int i = blockIdx.x;
    long long t = tb + i;
    long long vis = (t + 1) / ratio;
    int* out = sel + (size_t)i * top_k;
    if (vis <= top_k) {
        for (int k = threadIdx.x; k < top_k; k += blockDim.x) out[k] = k < vis ? k : -1;
        return;
    }
    const float* sc = scores + (size_t)i * max_vis;
    // Radix select: the key of the top_k-th largest, 8 bits at a time from the top.
    u32 prefix = 0, mask = 0, want = (u32)top_k; // want: rank among keys matching the prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // Runs of one bin are counted locally first (scores crowd into a few top bins, so
        // this saves most of the same-address shared atomics).
        u32 run_bin = 0, run_n = 0;
        for (long long r = threadIdx.x; r < vis; r += blockDim.x) {
            u32 kk = ds4_fkey(sc[r]);
            if ((kk & mask) != prefix) continue;
            u32 b = (kk >> shift) & 255u;
            if (b != run_bin && run_n > 0) {
                atomicAdd(&hist[run_bin], run_n);
                run_n = 0;
            }
            run_bin = b;
            run_n++;
        }
        if (run_n > 0) atomicAdd(&hist[run_bin], run_n);
        __syncthreads();
        // Suffix sums suf[b] = Σ hist[b..256) (Hillis-Steele, 8 steps); the chosen bin is the
        // largest b with suf[b] >= want (0 if none), the rank left is want − suf[b + 1].
        u32 v = threadIdx.x < 256 ? hist[threadIdx.x] : 0u;
        for (int o = 1; o < 256; o *= 2) {
            u32 add = (threadIdx.x < 256 && threadIdx.x + o < 256) ? hist[threadIdx.x + o] : 0u;
            __syncthreads();
            if (threadIdx.x < 256) hist[threadIdx.x] = v += add;
            __syncthreads();
        }
        if (threadIdx.x < 256) {
            int b = threadIdx.x;
            u32 next = b < 255 ? hist[b + 1] : 0u;
            if (next < want && (b == 0 || v >= want)) {
                prefix_s = prefix | ((u32)b << shift);
                want_s = want - next;
            }
        }
        __syncthreads();
        prefix = prefix_s;
        want = want_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the threshold key; take all keys > it and the first `want` equal ones by index.
    u32 thr = prefix, need_eq = want;
    if (threadIdx.x == 0) {
        base_gt = 0;
        base_eq = 0;
    }
    __syncthreads();
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP, nw = blockDim.x / DS4_WARP;
    ds4_mask_t below = lane == 0 ? 0 : ((~(ds4_mask_t)0) >> (64 - lane));
    for (long long r0 = 0; r0 < vis; r0 += blockDim.x) {
        long long r = r0 + threadIdx.x;
        u32 kk = r < vis ? ds4_fkey(sc[r]) : 0;
        bool gt = r < vis && kk > thr, eq = r < vis && kk == thr;
        ds4_mask_t bg = ds4_ballot(gt), be = ds4_ballot(eq);
        if (lane == 0) {
            warp_gt[warp] = (u32)__popcll(bg);
            warp_eq[warp] = (u32)__popcll(be);
        }
        __syncthreads();
        u32 pg = base_gt, pe = base_eq; // counts of earlier rows taken
        for (int k = 0; k < warp; k++) {
            pg += warp_gt[k];
            pe += warp_eq[k];
        }
        pe += (u32)__popcll(be & below);
        pg += (u32)__popcll(bg & below);
        bool take = gt || (eq && pe < need_eq);
        if (take) {
            u32 pos = pg + (pe < need_eq ? pe : need_eq); // rows taken before r
            out[pos] = (int)r;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int k = 0; k < nw; k++) {
                base_gt += warp_gt[k];
                base_eq += warp_eq[k];
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// Top-k with the keys in registers (index_topk_r; index_topk_l1 + index_topk_l2 for more
// candidates than one CTA holds). Same selection as index_topk: the top_k largest keys (ties to
// the lower position), written in ascending position.

#define DS4_TK_T 1024                  // threads per CTA (launch blockDim)
#define DS4_TK_E 16                    // most keys per thread
#define DS4_TK_N (DS4_TK_T * DS4_TK_E) // most keys one CTA selects from (16384)

struct ds4_tk_smem {
    u32 hist[2][2048]; // digit counts; two, so that a pass zeroes the next one's while it counts
    u32 wsum[32];      // per-warp totals (DS4_TK_T / DS4_WARP <= 32 <= DS4_WARP)
    u32 red[2][32];    // per-warp min and max key
    u32 pick[3];       // the chosen bin, the rank left in it, its count
};

// Keys per thread for n keys: thread t holds positions t·e .. t·e+e−1, e a multiple of 4 (16-byte
// loads) and as small as covers n with all threads (every thread takes a share of the atomics).
__device__ __forceinline__ int ds4_tk_e(int n) {
    const int e = ((n + DS4_TK_T - 1) / DS4_TK_T + 3) & ~3;
    return e < DS4_TK_E ? e : DS4_TK_E;
}

// Inclusive prefix (pre) or suffix (suf) sum over the warp's lanes with xor shuffles only.
__device__ __forceinline__ void ds4_tk_scan(u32 v, int lane, u32* pre, u32* suf, u32* tot) {
    u32 p = v, s = v, t = v;
#pragma unroll
    for (int o = 1; o < DS4_WARP; o <<= 1) {
        const u32 y = ds4_shfl_xor(t, o);
        if (lane & o) p += y;
        else s += y;
        t += y;
    }
    *pre = p, *suf = s, *tot = t;
}

// Select among the block's keys kk (thread t: positions t·e + j, j < e, valid when < n) and
// return the rule: take key > *thr, and key == *thr while its rank among the equal keys (by
// position) is < *need. Radix select from the highest bit where the keys differ (the common
// prefix of the minimum and maximum is skipped), digits of up to 11 bits, each pass a shared
// histogram and a block suffix scan (three barriers); it stops once the chosen bin is taken whole.
// All threads call it (barriers inside).
__device__ __forceinline__ void ds4_tk_select(const u32 (&kk)[DS4_TK_E], int n, int e, int top_k, ds4_tk_smem& sm,
                                              u32* thr_out, u32* need_out) {
    const int tid = threadIdx.x, lane = tid % DS4_WARP, warp = tid / DS4_WARP, nw = DS4_TK_T / DS4_WARP;
    const int base = tid * e;
    if (n <= top_k) { // everything (keys > 0 or == 0 with rank < top_k >= n)
        *thr_out = 0u, *need_out = (u32)top_k;
        return;
    }
    u32 lo = 0xffffffffu, hi = 0u;
#pragma unroll
    for (int j = 0; j < DS4_TK_E; j++)
        if (j < e && base + j < n) lo = min(lo, kk[j]), hi = max(hi, kk[j]);
#pragma unroll
    for (int o = 1; o < DS4_WARP; o <<= 1) lo = min(lo, (u32)ds4_shfl_xor(lo, o)), hi = max(hi, (u32)ds4_shfl_xor(hi, o));
    if (lane == 0) sm.red[0][warp] = lo, sm.red[1][warp] = hi;
    sm.hist[0][2 * tid] = 0u, sm.hist[0][2 * tid + 1] = 0u;
    __syncthreads();
    lo = lane < nw ? sm.red[0][lane] : 0xffffffffu, hi = lane < nw ? sm.red[1][lane] : 0u;
#pragma unroll
    for (int o = 1; o < DS4_WARP; o <<= 1) lo = min(lo, (u32)ds4_shfl_xor(lo, o)), hi = max(hi, (u32)ds4_shfl_xor(hi, o));
    if (lo == hi) { // all equal: the first top_k
        *thr_out = lo, *need_out = (u32)top_k;
        return;
    }
    int p = 31 - __clz(lo ^ hi);                      // highest differing bit
    u32 mask = ~((2u << p) - 1u), prefix = hi & mask; // bits above p (none when p = 31)
    u32 want = (u32)top_k;                            // rank left among keys matching prefix
    for (int pass = 0;; pass++) {
        const int width = p + 1 < 11 ? p + 1 : 11, shift = p + 1 - width;
        const u32 dm = (1u << width) - 1u;
        u32* h = sm.hist[pass & 1];
        u32* hn = sm.hist[(pass + 1) & 1];
        hn[2 * tid] = 0u, hn[2 * tid + 1] = 0u;
#pragma unroll
        for (int j = 0; j < DS4_TK_E; j++)
            if (j < e && base + j < n && (kk[j] & mask) == prefix) atomicAdd(&h[(kk[j] >> shift) & dm], 1u);
        __syncthreads();
        // Thread t owns bins 2t, 2t+1: suffix sums over the block, the chosen bin is the
        // largest b with suffix(b) >= want.
        const u32 a = h[2 * tid], b = h[2 * tid + 1];
        u32 pre, suf, tot;
        ds4_tk_scan(a + b, lane, &pre, &suf, &tot);
        if (lane == 0) sm.wsum[warp] = tot;
        __syncthreads();
        const u32 after = ds4_warp_sum_u32(lane < nw && lane > warp ? sm.wsum[lane] : 0u); // later warps
        const u32 s0 = after + suf, s1 = s0 - a; // suffix sums from bins 2t and 2t+1
        if (s1 >= want && s1 - b < want) sm.pick[0] = 2 * tid + 1, sm.pick[1] = want - (s1 - b), sm.pick[2] = b;
        else if (s0 >= want && s1 < want) sm.pick[0] = 2 * tid, sm.pick[1] = want - s1, sm.pick[2] = a;
        __syncthreads();
        const u32 bin = sm.pick[0], left = sm.pick[1], cnt = sm.pick[2];
        prefix |= bin << shift;
        mask |= dm << shift;
        want = left;
        if (shift == 0) {
            *thr_out = prefix, *need_out = want;
            return;
        }
        if (cnt == want && prefix != 0u) { // the whole bin is taken: every key >= prefix
            *thr_out = prefix - 1u, *need_out = 0u;
            return;
        }
        p = shift - 1;
    }
}

// The positions taken under (thr, need), each with its output slot (taken positions before it):
// EMIT runs with slot, j and r_ (the position) in ascending position. Two barriers.
#define DS4_TK_EMIT(kk, n, e, thr, need, sm, EMIT)                                                 \
    {                                                                                              \
        const int tid_ = threadIdx.x, lane_ = tid_ % DS4_WARP, warp_ = tid_ / DS4_WARP;            \
        const int base_ = tid_ * (e);                                                              \
        u32 g_ = 0, e_ = 0;                                                                        \
        _Pragma("unroll") for (int j = 0; j < DS4_TK_E; j++) if (j < (e) && base_ + j < (n)) {     \
            g_ += kk[j] > (thr);                                                                   \
            e_ += kk[j] == (thr);                                                                  \
        }                                                                                          \
        /* counts <= 16384: greater-than in the high half, equal in the low half */               \
        u32 pre_, suf_, tot_;                                                                      \
        ds4_tk_scan((g_ << 16) | e_, lane_, &pre_, &suf_, &tot_);                                  \
        __syncthreads(); /* wsum's last readers (the select) are done */                           \
        if (lane_ == 0) (sm).wsum[warp_] = tot_;                                                   \
        __syncthreads();                                                                           \
        u32 before_ = pre_ - ((g_ << 16) | e_) +                                                   \
                      ds4_warp_sum_u32(lane_ < warp_ ? (sm).wsum[lane_] : 0u); /* earlier warps */      \
        u32 gb_ = before_ >> 16, eb_ = before_ & 0xffffu;                                          \
        _Pragma("unroll") for (int j = 0; j < DS4_TK_E; j++) if (j < (e) && base_ + j < (n)) {     \
            const int r_ = base_ + j;                                                              \
            if (kk[j] > (thr)) {                                                                   \
                const u32 slot = gb_ + (eb_ < (need) ? eb_ : (need));                              \
                EMIT;                                                                              \
                gb_++;                                                                             \
            } else if (kk[j] == (thr)) {                                                           \
                if (eb_ < (need)) {                                                                \
                    const u32 slot = gb_ + eb_;                                                    \
                    EMIT;                                                                          \
                }                                                                                  \
                eb_++;                                                                             \
            }                                                                                      \
            (void)r_;                                                                              \
        }                                                                                          \
    }

// Keys of scores src[0 .. n) into kk (thread t: positions t·e ..); 16-byte loads when aligned.
__device__ __forceinline__ void ds4_tk_load(const float* __restrict__ src, int n, int e, u32 (&kk)[DS4_TK_E]) {
    const int base = threadIdx.x * e;
    if (((size_t)src & 15) == 0 && base + e <= n) {
#pragma unroll
        for (int j = 0; j < DS4_TK_E; j += 4) {
            if (j >= e) break;
            const float4 v = *(const float4*)(src + base + j);
            kk[j] = ds4_fkey(v.x), kk[j + 1] = ds4_fkey(v.y), kk[j + 2] = ds4_fkey(v.z), kk[j + 3] = ds4_fkey(v.w);
        }
    } else {
#pragma unroll
        for (int j = 0; j < DS4_TK_E; j++) kk[j] = j < e && base + j < n ? ds4_fkey(src[base + j]) : 0u;
    }
}

// index_topk_ps for rows of at most DS4_TK_N candidates (host: max_vis <= DS4_TK_N): one CTA
// per token (blockDim DS4_TK_T), its scores read once into registers. Same launch and selection.
DS4_KERNEL void DS4_BOUNDS(1024) index_topk_r(const float* __restrict__ scores, int* __restrict__ sel, long long tba, long long max_vis, int ratio, int top_k, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    __shared__ ds4_tk_smem sm;
    const int i = blockIdx.x;
    const long long vis = (DS4_POS(sp, tba) + i + 1) / ratio;
    int* out = sel + (size_t)i * top_k;
    if (vis <= top_k || vis > DS4_TK_N) {
        for (int k = threadIdx.x; k < top_k; k += blockDim.x) out[k] = k < vis ? k : -1;
        return;
    }
    const int n = (int)vis, e = ds4_tk_e(n);
    u32 kk[DS4_TK_E];
    ds4_tk_load(scores + (size_t)i * max_vis, n, e, kk);
    u32 thr, need;
    ds4_tk_select(kk, n, e, top_k, sm, &thr, &need);
    DS4_TK_EMIT(kk, n, e, thr, need, sm, out[slot] = r_)
}

// Two levels for rows of more than DS4_TK_N candidates (decode and prompt batches; host: top_k <= N <= DS4_TK_N and
// G·top_k <= DS4_TK_N). Level 1, grid (G, tokens): CTA c takes positions [c·N, c·N + N) of its token and
// writes its own top min(top_k, count) (keys and positions, ascending) to slot c of the token's
// G·top_k survivors. The token's top_k are among the survivors (a key beaten by fewer than top_k
// keys overall is beaten by fewer than top_k in its chunk), and the survivors lie contiguous and
// in position order: every chunk before the last non-empty one is full (N >= top_k survivors).
DS4_KERNEL void DS4_BOUNDS(1024) index_topk_l1(const float* __restrict__ scores, u32* __restrict__ skey, int* __restrict__ spos, long long tba, long long max_vis, int ratio, int top_k, int G, int N, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    __shared__ ds4_tk_smem sm;
    const int c = blockIdx.x, i = blockIdx.y;
    const long long vis = (DS4_POS(sp, tba) + i + 1) / ratio, c0 = (long long)c * N;
    if (vis <= top_k || c0 >= vis) return; // level 2 writes the trivial selection
    const int n = (int)min(vis - c0, (long long)N), e = ds4_tk_e(n);
    u32 kk[DS4_TK_E];
    ds4_tk_load(scores + (size_t)i * max_vis + c0, n, e, kk);
    u32 thr, need;
    ds4_tk_select(kk, n, e, top_k, sm, &thr, &need);
    const size_t o = ((size_t)i * G + c) * top_k;
    DS4_TK_EMIT(kk, n, e, thr, need, sm, (skey[o + slot] = kk[j], spos[o + slot] = (int)c0 + r_))
}

// Level 2, grid tokens: the top_k of the token's survivors (count G' · top_k + min(top_k, rest)),
// ties to the lower survivor slot (= the lower position), written ascending to sel.
DS4_KERNEL void DS4_BOUNDS(1024) index_topk_l2(const u32* __restrict__ skey, const int* __restrict__ spos, int* __restrict__ sel, long long tba, int ratio, int top_k, int G, int N, const long long* __restrict__ sp) {
    ds4_pdl_enter();
    __shared__ ds4_tk_smem sm;
    const int i = blockIdx.x;
    const long long vis = (DS4_POS(sp, tba) + i + 1) / ratio;
    int* out = sel + (size_t)i * top_k;
    if (vis <= top_k) {
        for (int k = threadIdx.x; k < top_k; k += blockDim.x) out[k] = k < vis ? k : -1;
        return;
    }
    const long long full = vis / N, rest = vis % N;
    const int n = (int)min(full * top_k + min(rest, (long long)top_k), (long long)G * top_k), e = ds4_tk_e(n);
    const u32* ks = skey + (size_t)i * G * top_k;
    const int* ps = spos + (size_t)i * G * top_k;
    const int base = threadIdx.x * e;
    u32 kk[DS4_TK_E];
#pragma unroll
    for (int j = 0; j < DS4_TK_E; j++) kk[j] = j < e && base + j < n ? ks[base + j] : 0u;
    u32 thr, need;
    ds4_tk_select(kk, n, e, top_k, sm, &thr, &need);
    DS4_TK_EMIT(kk, n, e, thr, need, sm, out[slot] = ps[r_])
}

// ---------------------------------------------------------------------------------------------
// Sink attention

#define DS4_ATT_THREADS 256
#define DS4_ATT_MAXLIST 2048
#define DS4_ATT_MAXHD 1024
#define DS4_ATT_RPW 4 // rows per warp in one tile

// Row j of a token's attention list: listed raw position (−(p+1)) or compressed row, then the
// contiguous compressed rows after the list.
__device__ __forceinline__ const float* ds4_att_row(long long j, const int* list, int n_list, const float* kv,
                                                    const float* raw, const float* comp, long long t0, int hd,
                                                    int win) {
    if (j >= n_list) return comp + (j - n_list) * hd;
    int c = list[j];
    if (c >= 0) return comp + (size_t)c * hd;
    long long p = -(long long)c - 1;
    return p >= t0 ? kv + (p - t0) * hd : raw + (p % win) * hd;
}

// out[i, h] = Σ softmax(q·row/√hd with the sink) · row over token t = t0+i's rows: raw positions
// max(0,t−W+1)..=t present in the ring (or this chunk), then the selected compressed rows (sel) or
// all rows < (t+1)/ratio. grid (heads, n), blockDim 256. The ring is read, not written.
DS4_KERNEL void DS4_BOUNDS(256) attend_f32(const float* __restrict__ q, const float* __restrict__ kv,
                                           const float* __restrict__ raw, const int* __restrict__ raw_pos,
                                           const float* __restrict__ comp, const int* __restrict__ sel,
                                           const float* __restrict__ sinks, float* __restrict__ out, long long t0,
                                           int heads, int hd, int win, int ratio, int top_k, float scale) {
    ds4_pdl_enter();
    __shared__ int list[DS4_ATT_MAXLIST]; // >= 0: compressed row; < 0: raw position −(p+1)
    __shared__ int flag[DS4_ATT_MAXLIST];
    __shared__ float q_s[DS4_ATT_MAXHD];
    __shared__ float tile_s[DS4_ATT_THREADS / 32 * DS4_ATT_RPW];
    __shared__ int n_list_s;
    int h = blockIdx.x, i = blockIdx.y;
    long long t = t0 + i;
    long long first = t + 1 > win ? t + 1 - win : 0;
    int nwin = (int)(t - first + 1);
    const float* qh = q + ((size_t)i * heads + h) * hd;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) q_s[e] = qh[e];
    // Raw rows present, in position order.
    for (int k = threadIdx.x; k < nwin; k += blockDim.x) {
        long long p = first + k;
        flag[k] = p >= t0 || raw_pos[p % win] == (int)p;
    }
    int nsel = sel ? top_k : 0;
    for (int k = threadIdx.x; k < nsel; k += blockDim.x) flag[nwin + k] = sel[(size_t)i * top_k + k];
    __syncthreads();
    if (threadIdx.x == 0) {
        int m = 0;
        for (int k = 0; k < nwin; k++)
            if (flag[k]) list[m++] = -(int)(first + k) - 1;
        for (int k = 0; k < nsel; k++)
            if (flag[nwin + k] >= 0) list[m++] = flag[nwin + k];
        n_list_s = m;
    }
    __syncthreads();
    int n_list = n_list_s;
    long long n_all = n_list + ((sel == 0 && ratio > 0) ? (t + 1) / ratio : 0);
    int lane = threadIdx.x % DS4_WARP, warp = threadIdx.x / DS4_WARP, nw = blockDim.x / DS4_WARP;
    float m = sinks[h], z = 1.0f;
    float acc[DS4_ATT_MAXHD / DS4_ATT_THREADS] = {0, 0, 0, 0};
    int tile = nw * DS4_ATT_RPW;
    for (long long j0 = 0; j0 < n_all; j0 += tile) {
        // Scores of the tile's rows, DS4_ATT_RPW rows per warp.
        for (int rr = 0; rr < DS4_ATT_RPW; rr++) {
            int k = warp + rr * nw;
            long long j = j0 + k;
            if (j < n_all) {
                const float* row = ds4_att_row(j, list, n_list, kv, raw, comp, t0, hd, win);
                float s = 0.0f;
                for (int e = lane; e < hd; e += DS4_WARP) s += q_s[e] * row[e];
                s = ds4_warp_sum(s);
                if (lane == 0) tile_s[k] = s * scale;
            }
        }
        __syncthreads();
        int nt = (int)(n_all - j0 < tile ? n_all - j0 : tile);
        float mn = m;
        for (int k = 0; k < nt; k++) mn = fmaxf(mn, tile_s[k]);
        float cf = expf(m - mn);
        z *= cf;
#pragma unroll
        for (int u = 0; u < DS4_ATT_MAXHD / DS4_ATT_THREADS; u++) acc[u] *= cf;
        for (int k = 0; k < nt; k++) {
            const float* row = ds4_att_row(j0 + k, list, n_list, kv, raw, comp, t0, hd, win);
            float e_ = expf(tile_s[k] - mn);
            z += e_;
#pragma unroll
            for (int u = 0; u < DS4_ATT_MAXHD / DS4_ATT_THREADS; u++) {
                int e = threadIdx.x + u * DS4_ATT_THREADS;
                if (e < hd) acc[u] += e_ * row[e];
            }
        }
        m = mn;
        __syncthreads();
    }
    float* oh = out + ((size_t)i * heads + h) * hd;
#pragma unroll
    for (int u = 0; u < DS4_ATT_MAXHD / DS4_ATT_THREADS; u++) {
        int e = threadIdx.x + u * DS4_ATT_THREADS;
        if (e < hd) oh[e] = acc[u] / z;
    }
}

// ---------------------------------------------------------------------------------------------
// Sink attention, split over rows (flash-decoding). DS4 attention is multi-query: every head of a
// token reads the same rows, so one CTA takes DS4_AP_HG heads of one token and a range of its
// candidate rows; each row is loaded once (a tile of DS4_AP_R rows in shared memory) and used by
// all its heads. Candidates of token t (no compaction; absent ones are skipped):
//   j <  nwin:              raw position first + j (this chunk's kv, else the ring if present)
//   j <  nwin + nsel:       compressed row sel[i][j − nwin] (skipped when −1)
//   j <  nwin + nsel + nc:  compressed row j − nwin − nsel (all rows < (t+1)/ratio, no sel)
// attend_part_f32 writes per (token, split, head) the running max m, sum z and unnormalised
// accumulator; attend_combine_f32 merges the splits with the sink, undoes the RoPE and stores the
// ring (the part kernel has finished reading it by then).

#define DS4_AP_THREADS 256
#define DS4_AP_HG 16                                  // heads per CTA
#define DS4_AP_R 4                                    // rows per tile
#define DS4_AP_MAXHD 512                              // largest head width (host checks)
#define DS4_AP_COLS (DS4_AP_MAXHD / DS4_AP_THREADS)   // accumulator columns per thread
#define DS4_AP_MAXSPLIT 256                           // most splits per token (host checks)

// Row of candidate j of token t (see above), or 0 when absent.
__device__ __forceinline__ const float* ds4_ap_row(long long j, long long t0, long long first, int nwin, int nsel,
                                                   const int* seli, const float* kv, const float* raw,
                                                   const int* raw_pos, const float* comp, int hd, int win) {
    if (j < nwin) {
        long long p = first + j;
        if (p >= t0) return kv + (p - t0) * hd;
        int slot = (int)(p % win);
        return raw_pos[slot] == (int)p ? raw + (size_t)slot * hd : (const float*)0;
    }
    j -= nwin;
    if (j < nsel) {
        int c = seli[j];
        return c >= 0 ? comp + (size_t)c * hd : (const float*)0;
    }
    return comp + (j - nsel) * hd;
}

// grid (splits, ceil(heads / HG), n), blockDim DS4_AP_THREADS; hd <= 512, hd % 4 == 0 (float4
// loads). Split s covers candidates [s·chunk, min((s+1)·chunk, ncand)) (chunk a multiple of R).
// part_o [n, splits, heads, hd]; part_mz [n, splits, heads, 2] = (max of scaled scores, Σ exp).
// Latency is what matters at decode (a split is a few tiles): the next tile's rows are loaded
// into registers while this one is used, and each warp's 2 heads × R row scores are reduced by a
// reduce-scatter (9 shuffles instead of 40) whose lanes then run the online softmax in parallel.
DS4_KERNEL void DS4_BOUNDS(256) attend_part_f32(const float* __restrict__ q, const float* __restrict__ kv, const float* __restrict__ raw, const int* __restrict__ raw_pos, const float* __restrict__ comp, const int* __restrict__ sel, float* __restrict__ part_o, float* __restrict__ part_mz, long long t0, int heads, int hd, int win, int ratio, int top_k, int chunk, int splits, float scale) {
    ds4_pdl_enter();
    // float4 arrays for 16-byte alignment.
    __shared__ float4 q_s4[DS4_AP_HG * DS4_AP_MAXHD / 4];   // 32 KiB: the CTA's heads [HG][hd]
    __shared__ float4 rows_s4[DS4_AP_R * DS4_AP_MAXHD / 4]; // 8 KiB: the tile's rows [R][hd]
    __shared__ float4 p_s4[DS4_AP_HG * DS4_AP_R / 4];       // [HG][R] exp weights
    float* rows_s = (float*)rows_s4;
    float* p_s = (float*)p_s4;
    __shared__ float m_s[DS4_AP_HG], z_s[DS4_AP_HG], cf_s[DS4_AP_HG];
    __shared__ int ok_s[DS4_AP_R];
    int s = blockIdx.x, h0 = blockIdx.y * DS4_AP_HG, i = blockIdx.z;
    int nhg = min(DS4_AP_HG, heads - h0);
    int tid = threadIdx.x;
    long long t = t0 + i;
    long long first = t + 1 > win ? t + 1 - win : 0;
    int nwin = (int)(t - first + 1);
    int nsel = sel ? top_k : 0;
    long long ncomp = (sel == 0 && ratio > 0) ? (t + 1) / ratio : 0;
    long long ncand = nwin + nsel + ncomp;
    long long jb = (long long)s * chunk;
    long long je = jb + chunk < ncand ? jb + chunk : ncand;
    const int* seli = sel ? sel + (size_t)i * top_k : (const int*)0;
    int hd4 = hd / 4;
    // Queries of heads h0 .. h0+nhg (zeros past them).
    const float4* q4 = (const float4*)(q + ((size_t)i * heads + h0) * hd);
    for (int k = tid; k < DS4_AP_HG * hd4; k += blockDim.x) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k / hd4 < nhg) v = q4[k];
        q_s4[k] = v;
    }
    if (tid < DS4_AP_HG) {
        m_s[tid] = DS4_NEG_INF;
        z_s[tid] = 0.0f;
    }
    float acc[DS4_AP_HG][DS4_AP_COLS];
#pragma unroll
    for (int hh = 0; hh < DS4_AP_HG; hh++)
#pragma unroll
        for (int c = 0; c < DS4_AP_COLS; c++) acc[hh][c] = 0.0f;
    int lane = tid % DS4_WARP, warp = tid / DS4_WARP, nw = blockDim.x / DS4_WARP;
    // This thread's share of a tile: float4 k = tid + u·THREADS of the R × hd4 tile. Row
    // addresses are resolved up front for up to DS4_AP_PTRS rows (one dependent load each, all
    // in parallel), so a tile is a single round of loads; two tiles are kept in flight in
    // registers (the next and the one after) while a third is used from shared memory.
#define DS4_AP_LD ((DS4_AP_R * DS4_AP_MAXHD / 4 + DS4_AP_THREADS - 1) / DS4_AP_THREADS)
#define DS4_AP_PTRS 64
    __shared__ const float* ptr_s[DS4_AP_PTRS];
    float4 na[DS4_AP_LD], nb[DS4_AP_LD];
    int oka[DS4_AP_LD], okb[DS4_AP_LD];
    // Loads of the tile whose first row is ptr_s[r0] (rows past cn are absent).
#define DS4_AP_FETCH(dst, okd, r0)                                                                 \
    _Pragma("unroll") for (int u = 0; u < DS4_AP_LD; u++) {                                        \
        int k = tid + u * DS4_AP_THREADS;                                                          \
        dst[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);                                              \
        okd[u] = 0;                                                                                \
        int rr = (r0) + k / hd4;                                                                   \
        if (k < DS4_AP_R * hd4 && rr < cn) {                                                       \
            const float* row = ptr_s[rr];                                                          \
            if (row) {                                                                             \
                dst[u] = ((const float4*)row)[k % hd4];                                            \
                okd[u] = 1;                                                                        \
            }                                                                                      \
        }                                                                                          \
    }
    for (long long c0 = jb; c0 < je; c0 += DS4_AP_PTRS) {
    int cn = (int)(je - c0 < DS4_AP_PTRS ? je - c0 : DS4_AP_PTRS);
    __syncthreads(); // the previous block of rows is no longer read
    if (tid < DS4_AP_PTRS)
        ptr_s[tid] = tid < cn ? ds4_ap_row(c0 + tid, t0, first, nwin, nsel, seli, kv, raw, raw_pos, comp, hd, win)
                              : (const float*)0;
    __syncthreads();
    DS4_AP_FETCH(na, oka, 0)
    DS4_AP_FETCH(nb, okb, DS4_AP_R)
    for (int r0 = 0; r0 < cn; r0 += DS4_AP_R) {
        // The oldest prefetched tile into shared memory, then the loads of the tile after next.
#pragma unroll
        for (int u = 0; u < DS4_AP_LD; u++) {
            int k = tid + u * DS4_AP_THREADS;
            if (k < DS4_AP_R * hd4) {
                rows_s4[k] = na[u];
                if (k % hd4 == 0) ok_s[k / hd4] = oka[u];
            }
            na[u] = nb[u];
            oka[u] = okb[u];
        }
        __syncthreads();
        if (r0 + 2 * DS4_AP_R < cn) {
            DS4_AP_FETCH(nb, okb, r0 + 2 * DS4_AP_R)
        }
        // Scores: one warp job = 2 heads × the R rows, lanes over the width.
        for (int job = warp; job < DS4_AP_HG / 2; job += nw) {
            // float4 lanes: 6 shared loads per 32 FMAs (the kernel is issue-bound).
            const float4* qa = q_s4 + (2 * job) * hd4;
            const float4* qb = qa + hd4;
            float v[2 * DS4_AP_R]; // v[u·R + r]: head 2·job + u, row r
#pragma unroll
            for (int r = 0; r < 2 * DS4_AP_R; r++) v[r] = 0.0f;
            for (int e4 = lane; e4 < hd4; e4 += DS4_WARP) {
                float4 a = qa[e4], b = qb[e4];
#pragma unroll
                for (int r = 0; r < DS4_AP_R; r++) {
                    float4 x = rows_s4[r * hd4 + e4];
                    v[r] += a.x * x.x + a.y * x.y + a.z * x.z + a.w * x.w;
                    v[DS4_AP_R + r] += b.x * x.x + b.y * x.y + b.z * x.z + b.w * x.w;
                }
            }
#if DS4_AP_R != 4
#error "the reduce-scatter below splits 8 = 2 heads x 4 rows over lane bits 4, 3, 2"
#endif
#if DS4_WARP > 32
#pragma unroll
            for (int r = 0; r < 8; r++) v[r] += ds4_shfl_xor(v[r], 32);
#endif
            // Reduce-scatter: after xor 16/8/4 each lane keeps one of the 8 sums (index
            // 4·bit4 + 2·bit3 + bit2 of its lane id), then xor 2/1 finish it.
            int b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1;
            float k4[4], k2[2];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                float keep = b4 ? v[4 + x] : v[x], send = b4 ? v[x] : v[4 + x];
                k4[x] = keep + ds4_shfl_xor(send, 16);
            }
#pragma unroll
            for (int x = 0; x < 2; x++) {
                float keep = b3 ? k4[2 + x] : k4[x], send = b3 ? k4[x] : k4[2 + x];
                k2[x] = keep + ds4_shfl_xor(send, 8);
            }
            float sc = (b2 ? k2[1] : k2[0]) + ds4_shfl_xor(b2 ? k2[0] : k2[1], 4);
            sc += ds4_shfl_xor(sc, 2);
            sc += ds4_shfl_xor(sc, 1);
            // Lane holds head hh = 2·job + b4, row r = 2·b3 + b2. Online softmax of each head
            // over its 4 rows: the lanes of one head differ in bits 3 and 2.
            int hh = 2 * job + b4, r = 2 * b3 + b2;
            float m = m_s[hh], zo = z_s[hh];
            sc = ok_s[r] ? sc * scale : DS4_NEG_INF;
            float mn = fmaxf(m, sc);
            mn = fmaxf(mn, ds4_shfl_xor(mn, 8));
            mn = fmaxf(mn, ds4_shfl_xor(mn, 4));
            float cf = m == mn ? 1.0f : expf(m - mn); // m == mn also covers −inf == −inf
            float p = sc == DS4_NEG_INF ? 0.0f : expf(sc - mn);
            float zs = p + ds4_shfl_xor(p, 8);
            zs += ds4_shfl_xor(zs, 4);
            if ((lane & 3) == 0) {
                p_s[hh * DS4_AP_R + r] = p;
                if (r == 0) {
                    m_s[hh] = mn;
                    z_s[hh] = zo * cf + zs;
                    cf_s[hh] = cf;
                }
            }
        }
        __syncthreads();
        // acc[h][e] = acc[h][e]·cf[h] + Σ_r p[h][r]·row_r[e]; thread owns columns tid + c·THREADS.
        float x[DS4_AP_COLS][DS4_AP_R];
#pragma unroll
        for (int c = 0; c < DS4_AP_COLS; c++) {
            int e = tid + c * DS4_AP_THREADS;
#pragma unroll
            for (int r = 0; r < DS4_AP_R; r++) x[c][r] = e < hd ? rows_s[r * hd + e] : 0.0f;
        }
#pragma unroll
        for (int hh = 0; hh < DS4_AP_HG; hh++) {
            float4 p = p_s4[hh];
            float cf = cf_s[hh];
#pragma unroll
            for (int c = 0; c < DS4_AP_COLS; c++) {
                float a = acc[hh][c] * cf;
                a += p.x * x[c][0];
                a += p.y * x[c][1];
                a += p.z * x[c][2];
                a += p.w * x[c][3];
                acc[hh][c] = a; // columns past hd stay 0 and are never written
            }
        }
        __syncthreads();
    }
    }
#undef DS4_AP_FETCH
#undef DS4_AP_LD
#undef DS4_AP_PTRS
    size_t base = ((size_t)i * splits + s) * heads + h0;
#pragma unroll
    for (int hh = 0; hh < DS4_AP_HG; hh++) {
        if (hh < nhg) {
#pragma unroll
            for (int c = 0; c < DS4_AP_COLS; c++) {
                int e = tid + c * DS4_AP_THREADS;
                if (e < hd) part_o[(base + hh) * hd + e] = acc[hh][c];
            }
        }
    }
    if (tid < nhg) {
        part_mz[(base + tid) * 2] = m_s[tid];
        part_mz[(base + tid) * 2 + 1] = z_s[tid];
    }
}

// out[i, h] = (Σ_s e^{m_s − M}·o_s) / (e^{sink − M} + Σ_s e^{m_s − M}·z_s), M = max(sink, m_s),
// then the inverse RoPE of the last n_rot values at position t0 + i. CTAs of head 0 also store
// token i's row in the ring when it is among the chunk's last min(n, W). grid (heads, n),
// blockDim DS4_AP_THREADS; hd <= 512, splits <= DS4_AP_MAXSPLIT. Every loop over the splits
// issues its loads independently (no loop-carried load chain: this kernel is latency-bound).
DS4_KERNEL void DS4_BOUNDS(256) attend_combine_f32(const float* __restrict__ part_o, const float* __restrict__ part_mz, const float* __restrict__ sinks, const double* __restrict__ freqs, float* __restrict__ out, const float* __restrict__ kv, float* __restrict__ raw, int* __restrict__ raw_pos, long long t0, int n, int heads, int hd, int win, int splits, int n_rot) {
    ds4_pdl_enter();
    __shared__ float w_s[DS4_AP_MAXSPLIT];
    __shared__ float o_s[DS4_AP_MAXHD];
    __shared__ float red_s[DS4_AP_THREADS / 32];
    __shared__ float zt_s;
    int h = blockIdx.x, i = blockIdx.y, tid = threadIdx.x;
    int lane = tid % DS4_WARP, warp = tid / DS4_WARP, nw = blockDim.x / DS4_WARP;
    long long t = t0 + i;
    const float* mz = part_mz + ((size_t)i * splits * heads + h) * 2; // split s at + s·heads·2
    float sink = sinks[h];
    // Each thread owns splits tid, tid + THREADS (splits <= 256 = THREADS: one at most).
    float m = tid < splits ? mz[(size_t)tid * heads * 2] : DS4_NEG_INF;
    float zp = tid < splits ? mz[(size_t)tid * heads * 2 + 1] : 0.0f;
    float M = m;
    for (int o = DS4_WARP / 2; o > 0; o >>= 1) M = fmaxf(M, ds4_shfl_xor(M, o));
    if (lane == 0) red_s[warp] = M;
    __syncthreads();
    M = sink;
    for (int w = 0; w < nw; w++) M = fmaxf(M, red_s[w]);
    float wt = m == DS4_NEG_INF ? 0.0f : expf(m - M);
    if (tid < splits) w_s[tid] = wt;
    float z = ds4_warp_sum(wt * zp);
    __syncthreads(); // red_s is reused
    if (lane == 0) red_s[warp] = z;
    __syncthreads();
    if (tid == 0) {
        float zt = expf(sink - M);
        for (int w = 0; w < nw; w++) zt += red_s[w];
        zt_s = zt;
    }
    __syncthreads();
    float zt = zt_s;
    const float* po = part_o + ((size_t)i * splits * heads + h) * hd; // split s at + s·heads·hd
    size_t sstride = (size_t)heads * hd;
    for (int e = tid; e < hd; e += blockDim.x) {
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        int s = 0;
        for (; s + 4 <= splits; s += 4) {
            float v0 = po[(size_t)s * sstride + e], v1 = po[(size_t)(s + 1) * sstride + e];
            float v2 = po[(size_t)(s + 2) * sstride + e], v3 = po[(size_t)(s + 3) * sstride + e];
            a0 += w_s[s] * v0;
            a1 += w_s[s + 1] * v1;
            a2 += w_s[s + 2] * v2;
            a3 += w_s[s + 3] * v3;
        }
        for (; s < splits; s++) a0 += w_s[s] * po[(size_t)s * sstride + e];
        o_s[e] = ((a0 + a1) + (a2 + a3)) / zt;
    }
    __syncthreads();
    for (int p = tid; p < n_rot / 2; p += blockDim.x)
        ds4_rope_pair(o_s + (hd - n_rot) + 2 * p, freqs[p], t, 1);
    __syncthreads();
    float* oh = out + ((size_t)i * heads + h) * hd;
    for (int e = tid; e < hd; e += blockDim.x) oh[e] = o_s[e];
    int keep = n < win ? n : win;
    if (h == 0 && i >= n - keep) {
        for (int e = tid; e < hd; e += blockDim.x) raw[(t % win) * hd + e] = kv[(size_t)i * hd + e];
        if (tid == 0) raw_pos[t % win] = (int)t;
    }
}

// After the chunk: ring slots of the last min(n, W) tokens get their rows and positions.
DS4_KERNEL void DS4_BOUNDS(256) ring_store_f32(const float* __restrict__ kv, float* __restrict__ raw,
                                               int* __restrict__ raw_pos, long long t0, int n, int hd, int win) {
    ds4_pdl_enter();
    int keep = n < win ? n : win;
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)keep * hd) return;
    int i = n - keep + (int)(k / hd), e = (int)(k % hd);
    long long t = t0 + i;
    raw[(t % win) * hd + e] = kv[(size_t)i * hd + e];
    if (e == 0) raw_pos[t % win] = (int)t;
}

// ---------------------------------------------------------------------------------------------
// Decode attention in one launch (attend_one_f32): the split over rows of attend_part_f32, then a
// grid-wide barrier, then the merge of the splits (attend_combine_f32's arithmetic), the inverse
// RoPE and the ring store, all in the same kernel. The grid is at most one CTA per SM (the host
// checks), so every CTA is resident at once and the barrier cannot wait on an unscheduled CTA.
//
// Part phase: CTA = (token i, group of HG heads, split s of the candidates). 32-lane group vw
// (8 of them) owns heads 4·(vw/2) .. +4 of the group and half vw%2 of the head width: lane vl
// holds float4 columns f = half·64 + vl + 32k (k = 0, 1) of its 4 queries in registers. A tile of
// R rows sits in shared memory; each lane computes 4 heads × R rows of partial dots over its 8
// columns (32 values), a 5-step reduce-scatter leaves lane vl with value vl, the two halves are
// added in shared memory, 128 threads run the online softmax (8 lanes per head), and each group
// accumulates p·row for its 4 heads × its columns (the same layout as its queries).
// attend_one_tc (CUDA sm_80+, hd 512): the same phases with the tile loop on tensor cores
// (ds4_ao_part_tc below: tiles of 16 rows as f16 hi/lo, S and O by mma.sync); the partials'
// layout is the same, so the barrier, the merge and the ring store are shared.
//
// Combine phase: one 32-lane group per (token, head, 128 columns), unit u on warp u / grid of
// CTA u % grid (every CTA loads a share of the partials: 1.3 us a call less than the first
// units / 8 CTAs loading all of them): weights e^{m_s − M} over the splits (M includes the sink),
// Σ w_s·o_s / (e^{sink − M} + Σ w_s·z_s), inverse RoPE of the pairs in its float4s by the
// (cos, sin) table that threads 64.. fill at kernel start (while 0..63 list the first row
// pointers; 1.1 us a call less than the f64 fmod / sin / cos at the end), store. CTAs b < min(n, W)
// then store token n − keep + b in the ring. tk[0]: the barrier's arrival word (ds4_ao_grid_flip;
// its low 31 bits 0 on entry and exit, the top bit flips each launch, graph replays included).

#define DS4_AO_THREADS 256
#define DS4_AO_HG 16 // heads per CTA
#define DS4_AO_R 8   // rows per tile
#define DS4_AO_PTRS 64
#define DS4_AO_LD (DS4_AO_R * DS4_AP_MAXHD / 4 / DS4_AO_THREADS) // float4 loads per thread per tile

// Loads from L2 (not L1): values other CTAs of this launch wrote.
__device__ __forceinline__ float4 ds4_ld_l2_f4(const float4* p) {
#if defined(DS4_CUDA)
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
#else
    const volatile float* f = (const volatile float*)p;
    return make_float4(f[0], f[1], f[2], f[3]);
#endif
}

__device__ __forceinline__ float ds4_dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Every CTA arrives, then waits until all `total` have: cooperative groups' grid barrier. One
// fence by the CTA's thread 0 after the CTA barrier (cumulative over the CTA's stores), no sleep
// in the poll, and no reset: CTA 0 adds 2^31 − (total − 1), the others 1, so the word's top bit
// flips once all have arrived and its low 31 bits (0 from allocation) come back unchanged -- no
// exit counter, no atomic with a return at the end of the kernel (0.4 us a call less than a
// counter reset by the last CTA out). Waits until the top bit differs from the one seen on arrival.
__device__ __forceinline__ void ds4_ao_grid_flip(u32* tk, u32 total) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const u32 old = atomicAdd(tk, blockIdx.x == 0 ? 0x80000000u - (total - 1u) : 1u);
        while (((old ^ *(volatile u32*)tk) & 0x80000000u) == 0u) {
        }
        __threadfence();
    }
    __syncthreads();
}

// Inverse RoPE of pair v by a precomputed (cos, sin): ds4_rope_pair's arithmetic, same bits.
__device__ __forceinline__ void ds4_rope_inv_cs(float* v, float2 cs) {
    float s = -cs.y, c = cs.x;
    float a = v[0], b = v[1];
    v[0] = ds4_sub_rn(ds4_mul_rn(a, c), ds4_mul_rn(b, s));
    v[1] = ds4_add_rn(ds4_mul_rn(a, s), ds4_mul_rn(b, c));
}

// One reduce-scatter step over lane bit o: keep one half of the nv values, add the partner's.
#define DS4_AO_RS(o, nv)                                                                           \
    {                                                                                              \
        bool up = (vl & (o)) != 0;                                                                 \
        _Pragma("unroll") for (int x = 0; x < (nv) / 2; x++) {                                     \
            float keep = up ? v[x + (nv) / 2] : v[x], send = up ? v[x] : v[x + (nv) / 2];          \
            v[x] = keep + ds4_shfl_xor(send, (o));                                                 \
        }                                                                                          \
    }

#define DS4_AO_PARAMS                                                                                      \
    const float *__restrict__ q, const float *__restrict__ kv, float *raw, int *raw_pos,                    \
        const float *__restrict__ comp, const int *__restrict__ sel, const float *__restrict__ sinks,       \
        const double *__restrict__ freqs, float *__restrict__ out, float *part_o, float *part_mz, u32 *tk, \
        long long t0, int n, int heads, int hd, int win, int ratio, int top_k, int chunk, int splits,     \
        int n_rot, float scale, const long long *__restrict__ sp
#define DS4_AO_ARGS                                                                                        \
    q, kv, raw, raw_pos, comp, sel, sinks, freqs, out, part_o, part_mz, tk, t0, n, heads, hd, win, ratio, top_k, \
        chunk, splits, n_rot, scale, sp

// grid (n · ceil(heads / HG) · splits) ≤ SMs, blockDim 256; hd ≤ 512, hd % 4 == 0 (float4 rows),
// splits ≤ 256, chunk a multiple of R. part_o [n, splits, heads, hd], part_mz [n, splits, heads, 2].
// chunk == 0 (decode graphs, with sp): `splits` is the most the grid holds and the kernel picks
// chunk and splits from the candidates of the last token as attn.rs `attend_one` does on the host
// (same values, same bits); CTAs past n · groups · splits only join the barrier and the merge.
// Probe stamps (attend_one_p only; compiled out of attend_one_f32): thread 0 of each CTA writes
// the time at phase k to stamps[blockIdx.x·DS4_AO_NST + k] (CUDA %globaltimer ns, HIP clock64):
// 0 entry (after the PDL wait), 1 first row pointers listed, 2 first tile in shared memory,
// 3 tile loop done, 4 partials stored, 5 past the grid barrier, 6 merge done, 7 exit.
#define DS4_AO_NST 8
#define DS4_AO_STAMP(k)                                                                                     \
    do {                                                                                                    \
        if (PROBE && tid == 0) stamps[(size_t)blockIdx.x * DS4_AO_NST + (k)] = ds4_now();               \
    } while (0)

#define DS4_AO_NCS 256 // (cos, sin) entries in shared memory: n · n_rot / 2 at most, else inline

#if defined(DS4_CUDA) && DS4_ARCH >= 800
#define DS4_AOT_HAVE 1
#else
#define DS4_AOT_HAVE 0
#endif
#define DS4_AOT_R 16                                   // rows per tile (tensor-core form): the k16 of O = P·V
#define DS4_AOT_LD (DS4_AP_MAXHD + 8)                  // halves per shared row (16-byte pad: ldmatrix conflict-free)
#define DS4_AOT_PLD 24                                 // halves per row of P in shared memory (same reason)
#define DS4_AOT_TILE (2 * DS4_AOT_R * DS4_AOT_LD * 2) // bytes: the tile's f16 hi and lo planes

// Threads 64.. fill cs_s (ds4_rope_pair's angle, ds4_mod_2pi: fmod's value, and roundings)
// while 0..63 list the first row pointers (the first block skips the barrier before that); uses
// use_cs, n, nh2, t0, freqs, cs_s and tid of the caller.
#define DS4_AO_FILL_CS()                                                                                   \
    do {                                                                                                   \
        if (use_cs)                                                                                        \
            for (int k = tid - DS4_AO_PTRS; k >= 0 && k < n * nh2; k += DS4_AO_THREADS - DS4_AO_PTRS) {      \
                double theta = ds4_mod_2pi((double)(t0 + k / nh2) * freqs[k % nh2]);                       \
                cs_s[k] = make_float2((float)cos(theta), (float)sin(theta));                               \
            }                                                                                              \
    } while (0)

// Every thread fills cs_s (the kernels that do it before the PDL wait, V & 4).
#define DS4_AO_FILL_CS_ALL()                                                                               \
    do {                                                                                                   \
        if (use_cs)                                                                                        \
            for (int k = tid; k < n * nh2; k += DS4_AO_THREADS) {                                          \
                double theta = ds4_mod_2pi((double)(t0 + k / nh2) * freqs[k % nh2]);                       \
                cs_s[k] = make_float2((float)cos(theta), (float)sin(theta));                               \
            }                                                                                              \
    } while (0)

#if DS4_AOT_HAVE
// Part phase on tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate), hd == 512: the same
// contract as the f32 loop (partials o, m, z of the CTA's 16 heads over rows jb..je).
// Tiles of DS4_AOT_R = 16 rows, each stored in shared memory as f16 hi = f16(v) and lo =
// f16(v − hi) (~22 bits of the f32 row: rows need not be f16-exact). Warp w owns head-dim columns
// [64w, 64w + 64): its Q fragments (hi and lo, 32 registers) are loaded once; per tile it computes
// its partial S (16 heads × 16 rows) as Qhi·Khi + Qlo·Khi + Qhi·Klo (the lo·lo term, ~2^-22, is
// dropped), the 8 partials go through shared memory (ws_s: the merge's weights, free until the
// barrier) and thread (head tid/16, row tid%16) adds them in warp order, runs the online softmax
// and stores p as f16 hi/lo; then each warp accumulates O (16 heads × its 64 columns, 32 f32 a
// lane) += Phi·Vhi + Plo·Vhi + Phi·Vlo. Fragments (PTX m16n8k16, g = lane/4, t = lane%4): A a0
// (row g, k 2t..2t+1), a1 (g+8), a2 (g, k+8), a3 (g+8, k+8); B b0 (k 2t.., col g), b1 (k+8); C
// c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8). Rows of A / C are heads.
template <bool PROBE, int V>
__device__ __forceinline__ void ds4_ao_part_tc(DS4_AO_PARAMS, u64* stamps, unsigned char* tile_s, u16* pt_s, float* ws_s,
                                               const float** ptr_s, float* m_s, float* z_s, float* cf_s, float2* cs_s,
                                               bool use_cs, int i, int s, int h0, int nhg, long long first, int nwin,
                                               int nsel, long long jb, long long je, const int* seli, bool pre) {
    constexpr int HD = DS4_AP_MAXHD, LD = DS4_AOT_LD, RT = DS4_AOT_R;
    constexpr int LDT = RT * HD / 4 / DS4_AO_THREADS; // float4 loads per thread per tile (8)
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int c0 = w * 64, nh2 = n_rot / 2;
    u16* th = (u16*)tile_s; // hi plane [RT][LD]
    u16* tl = th + RT * LD; // lo plane
    u16* ph_s = pt_s;       // P hi [HG][PLD]
    u16* pl_s = pt_s + DS4_AO_HG * DS4_AOT_PLD;
    // Q fragments of heads h0+g, h0+g+8 over this warp's columns (zeros past the group's heads):
    // loaded here; split into hi/lo here (V 0), or (V & 1) once the first row pointers are listed,
    // so that threads 0..63 list them without waiting for the query loads (a17's probe: the
    // split here lists them 0.6-0.9 us later than the f32 form). Same values either way.
    u32 qh[4][4], ql[4][4];
    float2 qr[4][4];
    {
        const float* qa = q + ((size_t)i * heads + h0 + g) * HD + c0 + 2 * tq;
        const float* qb = qa + (size_t)8 * HD;
        const bool va = g < nhg, vb = g + 8 < nhg;
        const float2 z2 = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            qr[ks][0] = va ? *(const float2*)(qa + 16 * ks) : z2;
            qr[ks][1] = vb ? *(const float2*)(qb + 16 * ks) : z2;
            qr[ks][2] = va ? *(const float2*)(qa + 16 * ks + 8) : z2;
            qr[ks][3] = vb ? *(const float2*)(qb + 16 * ks + 8) : z2;
        }
    }
#define DS4_AOT_QSPLIT()                                                                                   \
    _Pragma("unroll") for (int ks = 0; ks < 4; ks++) _Pragma("unroll") for (int x = 0; x < 4; x++)       \
        ds4_f16x2_split(qr[ks][x].x, qr[ks][x].y, qh[ks][x], ql[ks][x]);
    if ((V & 1) == 0) {
        DS4_AOT_QSPLIT()
    }
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    if (tid < DS4_AO_HG) {
        m_s[tid] = DS4_NEG_INF;
        z_s[tid] = 0.0f;
    }
    if ((V & 4) == 0) DS4_AO_FILL_CS(); // after the query loads are issued (V & 4: before the wait)
    const int mi = lane >> 3, rr = lane & 7;
    float4 nx[LDT];
    for (long long b0 = jb; b0 < je; b0 += DS4_AO_PTRS) {
        const int cn = (int)(je - b0 < DS4_AO_PTRS ? je - b0 : DS4_AO_PTRS);
        if (b0 != jb) __syncthreads(); // the previous block's rows are no longer read
        if (tid < DS4_AO_PTRS && !(pre && b0 == jb))
            ptr_s[tid] = tid < cn ? ds4_ap_row(b0 + tid, t0, first, nwin, nsel, seli, kv, raw, raw_pos, comp, hd, win) : (const float*)0;
        __syncthreads();
        if (b0 == jb) DS4_AO_STAMP(1);
        if ((V & 1) != 0 && b0 == jb) {
            DS4_AOT_QSPLIT()
        }
        // Loads of the tile starting at ptr_s[r0]: element k = row·128 + float4 column (absent rows: zeros).
#define DS4_AOT_FETCH(r0)                                                                                  \
    _Pragma("unroll") for (int u = 0; u < LDT; u++) {                                                      \
        const int k = tid + u * DS4_AO_THREADS, r = (r0) + (k >> 7);                                       \
        nx[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);                                                       \
        if (r < cn) {                                                                                      \
            const float* row = ptr_s[r];                                                                   \
            if (row) nx[u] = ((const float4*)row)[k & 127];                                                \
        }                                                                                                  \
    }
        DS4_AOT_FETCH(0)
        for (int r0 = 0; r0 < cn; r0 += RT) {
            __syncthreads(); // the last tile's products are done
#pragma unroll
            for (int u = 0; u < LDT; u++) {
                const int k = tid + u * DS4_AO_THREADS, o = (k >> 7) * LD + 4 * (k & 127);
                u32 h01, l01, h23, l23;
                ds4_f16x2_split(nx[u].x, nx[u].y, h01, l01);
                ds4_f16x2_split(nx[u].z, nx[u].w, h23, l23);
                *(uint2*)(th + o) = make_uint2(h01, h23);
                *(uint2*)(tl + o) = make_uint2(l01, l23);
            }
            __syncthreads();
            if (b0 == jb && r0 == 0) DS4_AO_STAMP(2);
            if (r0 + RT < cn) DS4_AOT_FETCH(r0 + RT)
            // Partial S over this warp's columns: n-tiles of rows 0..7 and 8..15; ldmatrix.x4 gives
            // b0, b1 of both for one k-step.
            float sc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                const int o = (rr + 8 * (mi >> 1)) * LD + c0 + 16 * ks + 8 * (mi & 1);
                u32 bh[4], bl[4];
                ds4_ldm4(bh, th + o);
                ds4_ldm4(bl, tl + o);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    ds4_mma_f16(sc[nt], qh[ks], bh[2 * nt], bh[2 * nt + 1]);
                    ds4_mma_f16(sc[nt], ql[ks], bh[2 * nt], bh[2 * nt + 1]);
                    ds4_mma_f16(sc[nt], qh[ks], bl[2 * nt], bl[2 * nt + 1]);
                }
            }
            // ws_s [warp][head][row]
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                *(float2*)(ws_s + w * 256 + g * 16 + 8 * nt + 2 * tq) = make_float2(sc[nt][0], sc[nt][1]);
                *(float2*)(ws_s + w * 256 + (g + 8) * 16 + 8 * nt + 2 * tq) = make_float2(sc[nt][2], sc[nt][3]);
            }
            __syncthreads();
            // Online softmax: thread (head tid / 16, row tid % 16); a head's 16 rows in 16 lanes.
            {
                const int h = tid >> 4, r = tid & 15;
                float a = ws_s[tid];
#pragma unroll
                for (int x = 1; x < 8; x++) a += ws_s[x * 256 + tid];
                const bool ok = r0 + r < cn && ptr_s[r0 + r] != 0;
                const float sv = ok ? a * scale : DS4_NEG_INF;
                float tm = fmaxf(sv, ds4_shfl_xor(sv, 8));
                tm = fmaxf(tm, ds4_shfl_xor(tm, 4));
                tm = fmaxf(tm, ds4_shfl_xor(tm, 2));
                tm = fmaxf(tm, ds4_shfl_xor(tm, 1));
                const float mo = m_s[h], mn = fmaxf(mo, tm);
                const float cf = mo == mn ? 1.0f : expf(mo - mn); // also −inf == −inf
                const float p = ok ? expf(sv - mn) : 0.0f;
                float zs = p + ds4_shfl_xor(p, 8);
                zs += ds4_shfl_xor(zs, 4);
                zs += ds4_shfl_xor(zs, 2);
                zs += ds4_shfl_xor(zs, 1);
                const float pn = ds4_shfl_xor(p, 1);
                if ((r & 1) == 0) {
                    u32 hi, lo;
                    ds4_f16x2_split(p, pn, hi, lo);
                    *(u32*)(ph_s + h * DS4_AOT_PLD + r) = hi;
                    *(u32*)(pl_s + h * DS4_AOT_PLD + r) = lo;
                }
                if (r == 0) {
                    m_s[h] = mn;
                    z_s[h] = z_s[h] * cf + zs;
                    cf_s[h] = cf;
                }
            }
            __syncthreads();
            // O = O·cf + P·V over this warp's 64 columns (8 n-tiles); ldmatrix.x4.trans gives b0, b1
            // of two n-tiles.
            {
                const float ca = cf_s[g], cb = cf_s[g + 8];
#pragma unroll
                for (int nt = 0; nt < 8; nt++) {
                    acc[nt][0] *= ca;
                    acc[nt][1] *= ca;
                    acc[nt][2] *= cb;
                    acc[nt][3] *= cb;
                }
                u32 pa[4], pb[4]; // A fragments of P hi, lo: matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15)
                const int po = (rr + 8 * (mi & 1)) * DS4_AOT_PLD + 8 * (mi >> 1);
                ds4_ldm4(pa, ph_s + po);
                ds4_ldm4(pb, pl_s + po);
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    const int o = (rr + 8 * (mi & 1)) * LD + c0 + 16 * np + 8 * (mi >> 1);
                    u32 bh[4], bl[4];
                    ds4_ldm4_t(bh, th + o);
                    ds4_ldm4_t(bl, tl + o);
#pragma unroll
                    for (int x = 0; x < 2; x++) {
                        ds4_mma_f16(acc[2 * np + x], pa, bh[2 * x], bh[2 * x + 1]);
                        ds4_mma_f16(acc[2 * np + x], pb, bh[2 * x], bh[2 * x + 1]);
                        ds4_mma_f16(acc[2 * np + x], pa, bl[2 * x], bl[2 * x + 1]);
                    }
                }
            }
        }
#undef DS4_AOT_FETCH
    }
#undef DS4_AOT_QSPLIT
    __syncthreads(); // m_s / z_s final (or as initialised when the split has no rows)
    DS4_AO_STAMP(3);
    const size_t base = ((size_t)i * splits + s) * heads + h0;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const int col = c0 + 8 * nt + 2 * tq;
        if (g < nhg) *(float2*)(part_o + (base + g) * HD + col) = make_float2(acc[nt][0], acc[nt][1]);
        if (g + 8 < nhg) *(float2*)(part_o + (base + g + 8) * HD + col) = make_float2(acc[nt][2], acc[nt][3]);
    }
    if (tid < nhg) {
        part_mz[(base + tid) * 2] = m_s[tid];
        part_mz[(base + tid) * 2 + 1] = z_s[tid];
    }
}
#endif

// V (the tensor-core form's A/B bits, attn.rs `DS4_GPU_AOTC`): 1 the queries' hi/lo split after the
// first row-pointer listing (ds4_ao_part_tc), 4 the (cos, sin) table and a first block's row
// pointers before the PDL wait (kernels started DS4_PDL_LATE); the same bits as V 0. (Bit 2, a
// combine with all 8 warps loading partials, lost: bench/results/gpu-a119-h200.txt.)
template <bool PROBE, bool TC, int V = 0> __device__ __forceinline__ void ds4_attend_one(DS4_AO_PARAMS, u64* stamps) {
    // The tile: f32 [R][hd] (16 KiB), or (TC) f16 hi then lo [DS4_AOT_R][DS4_AOT_LD] (32.5 KiB).
    __shared__ __align__(16) unsigned char tile_s[TC ? DS4_AOT_TILE : DS4_AO_R * DS4_AP_MAXHD * 4];
    float4* rows_s4 = (float4*)tile_s;
    __shared__ __align__(16) u16 pt_s[TC ? 2 * DS4_AO_HG * DS4_AOT_PLD : 8]; // (TC) P hi, lo [HG][PLD]
    __shared__ float sp_s[2][DS4_AO_HG][DS4_AO_R];           // half-width scores
    __shared__ float4 p_s4[DS4_AO_HG][DS4_AO_R / 4];         // exp weights [HG][R]
    __shared__ float m_s[DS4_AO_HG], z_s[DS4_AO_HG], cf_s[DS4_AO_HG];
    __shared__ const float* ptr_s[DS4_AO_PTRS];
    __shared__ float w_s[DS4_AO_THREADS / 32][DS4_AP_MAXSPLIT]; // combine weights per group
    __shared__ float2 cs_s[DS4_AO_NCS];                         // (cos, sin) of token i's pair p at i·n_rot/2 + p
    const int tid = threadIdx.x, vl = tid % 32, vw = tid / 32;
    const int hd4 = hd / 4;
    const int groups = (heads + DS4_AO_HG - 1) / DS4_AO_HG;
    t0 = DS4_POS(sp, t0);
    const int nh2 = n_rot / 2;
    const bool use_cs = n * nh2 <= DS4_AO_NCS;
    if (chunk == 0) { // attn.rs `candidates` and `attend_one`, splits = the most
        const long long RT = TC ? DS4_AOT_R : DS4_AO_R; // chunks are whole tiles
        const long long tl = t0 + n - 1;
        const long long mc = (tl + 1 < win ? tl + 1 : win) + (sel ? top_k : 0) + ((sel == 0 && ratio > 0) ? (tl + 1) / ratio : 0);
        long long sp1 = (mc + RT - 1) / RT;
        sp1 = sp1 < splits ? sp1 : splits;
        sp1 = sp1 > 1 ? sp1 : 1;
        long long ch = (mc + sp1 - 1) / sp1;
        ch = (ch + RT - 1) / RT * RT;
        ch = ch > RT ? ch : RT;
        long long s2 = (mc + ch - 1) / ch;
        chunk = (int)ch;
        splits = (int)(s2 > 1 ? s2 : 1);
    }
    DS4_AO_STAMP(0);
    if ((long long)blockIdx.x < (long long)n * groups * splits) {
        const int b = blockIdx.x;
        const int s = b % splits, g = (b / splits) % groups, i = b / (splits * groups);
        const int h0 = g * DS4_AO_HG, nhg = min(DS4_AO_HG, heads - h0);
        const long long t = t0 + i;
        const long long first = t + 1 > win ? t + 1 - win : 0;
        const int nwin = (int)(t - first + 1);
        const int nsel = sel ? top_k : 0;
        const long long ncomp = (sel == 0 && ratio > 0) ? (t + 1) / ratio : 0;
        const long long ncand = nwin + nsel + ncomp;
        const long long jb = (long long)s * chunk;
        const long long je = jb + chunk < ncand ? jb + chunk : ncand;
        const int* seli = sel ? sel + (size_t)i * top_k : (const int*)0;
        bool pre = false; // (V & 4) the first block's row pointers listed before the PDL wait
        if (V & 4) {
            // Before the wait (the kernel starts DS4_PDL_LATE): the (cos, sin) table, and the first
            // block's row pointers unless it holds selected rows (sel is the previous kernels'
            // output; raw_pos of positions before the chunk only this kernel's earlier launches
            // write, and window rows of the chunk and compressed rows are pointer arithmetic).
            DS4_AO_FILL_CS_ALL();
            const long long be = je < jb + DS4_AO_PTRS ? je : jb + DS4_AO_PTRS;
            pre = be <= nwin || jb >= (long long)nwin + nsel;
            if (pre && tid < DS4_AO_PTRS)
                ptr_s[tid] = jb + tid < be ? ds4_ap_row(jb + tid, t0, first, nwin, nsel, seli, kv, raw, raw_pos, comp, hd, win) : (const float*)0;
            ds4_pdl_enter();
        }
        if (TC) {
#if DS4_AOT_HAVE
            ds4_ao_part_tc<PROBE, V>(DS4_AO_ARGS, stamps, tile_s, pt_s, &w_s[0][0], ptr_s, m_s, z_s, cf_s, cs_s, use_cs,
                                  i, s, h0, nhg, first, nwin, nsel, jb, je, seli, pre);
#endif
        } else {
            const int hq = vw >> 1, half = vw & 1;
            int f[2];
            bool fv[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                f[k] = half * 64 + vl + 32 * k;
                fv[k] = f[k] < hd4;
            }
            // This group's 4 queries at its columns (zeros past the heads or the width).
            float4 qv[4][2], acc[4][2];
            const float4* q4 = (const float4*)q;
#pragma unroll
            for (int hh = 0; hh < 4; hh++) {
                int h = hq * 4 + hh;
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    qv[hh][k] = (h < nhg && fv[k]) ? q4[((size_t)i * heads + h0 + h) * hd4 + f[k]] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    acc[hh][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            if (tid < DS4_AO_HG) {
                m_s[tid] = DS4_NEG_INF;
                z_s[tid] = 0.0f;
            }
            DS4_AO_FILL_CS(); // after the query loads are issued
            float4 nx[DS4_AO_LD];
            for (long long c0 = jb; c0 < je; c0 += DS4_AO_PTRS) {
                const int cn = (int)(je - c0 < DS4_AO_PTRS ? je - c0 : DS4_AO_PTRS);
                if (c0 != jb) __syncthreads(); // the previous block's rows are no longer read
                if (tid < DS4_AO_PTRS)
                    ptr_s[tid] = tid < cn ? ds4_ap_row(c0 + tid, t0, first, nwin, nsel, seli, kv, raw, raw_pos, comp, hd, win) : (const float*)0;
                __syncthreads();
                if (c0 == jb) DS4_AO_STAMP(1);
                // Loads of the tile starting at ptr_s[r0] (absent rows: zeros).
#define DS4_AO_FETCH(dst, r0)                                                                              \
    _Pragma("unroll") for (int u = 0; u < DS4_AO_LD; u++) {                                                \
        int k = tid + u * DS4_AO_THREADS, rr = (r0) + k / hd4;                                             \
        dst[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);                                                      \
        if (k < DS4_AO_R * hd4 && rr < cn) {                                                               \
            const float* row = ptr_s[rr];                                                                  \
            if (row) dst[u] = ((const float4*)row)[k % hd4];                                               \
        }                                                                                                  \
    }
                DS4_AO_FETCH(nx, 0)
                for (int r0 = 0; r0 < cn; r0 += DS4_AO_R) {
                    __syncthreads(); // the last tile's products are done
#pragma unroll
                    for (int u = 0; u < DS4_AO_LD; u++) {
                        int k = tid + u * DS4_AO_THREADS;
                        if (k < DS4_AO_R * hd4) rows_s4[k] = nx[u];
                    }
                    __syncthreads();
                    if (c0 == jb && r0 == 0) DS4_AO_STAMP(2);
                    if (r0 + DS4_AO_R < cn) DS4_AO_FETCH(nx, r0 + DS4_AO_R)
                    // Partial scores: v[hh·R + r] over this lane's columns.
                    float v[4 * DS4_AO_R];
#pragma unroll
                    for (int r = 0; r < DS4_AO_R; r++) {
                        float4 x0 = fv[0] ? rows_s4[r * hd4 + f[0]] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        float4 x1 = fv[1] ? rows_s4[r * hd4 + f[1]] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                        for (int hh = 0; hh < 4; hh++) v[hh * DS4_AO_R + r] = ds4_dot4(qv[hh][0], x0) + ds4_dot4(qv[hh][1], x1);
                    }
#if DS4_AO_R != 8
#error "the reduce-scatter below spreads 4 heads x 8 rows = 32 values over 32 lanes"
#endif
                    DS4_AO_RS(16, 32)
                    DS4_AO_RS(8, 16)
                    DS4_AO_RS(4, 8)
                    DS4_AO_RS(2, 4)
                    DS4_AO_RS(1, 2)
                    sp_s[half][hq * 4 + (vl >> 3)][vl & 7] = v[0]; // lane vl holds value vl
                    __syncthreads();
                    // Online softmax: thread (head tid / 8, row tid % 8).
                    if (tid < DS4_AO_HG * DS4_AO_R) {
                        int h = tid >> 3, r = tid & 7;
                        bool ok = r0 + r < cn && ptr_s[r0 + r] != 0;
                        float sc = ok ? (sp_s[0][h][r] + sp_s[1][h][r]) * scale : DS4_NEG_INF;
                        float tm = fmaxf(sc, ds4_shfl_xor(sc, 4));
                        tm = fmaxf(tm, ds4_shfl_xor(tm, 2));
                        tm = fmaxf(tm, ds4_shfl_xor(tm, 1));
                        float mo = m_s[h], mn = fmaxf(mo, tm);
                        float cf = mo == mn ? 1.0f : expf(mo - mn); // also −inf == −inf
                        float p = ok ? expf(sc - mn) : 0.0f;
                        float zs = p + ds4_shfl_xor(p, 4);
                        zs += ds4_shfl_xor(zs, 2);
                        zs += ds4_shfl_xor(zs, 1);
                        ((float*)p_s4)[h * DS4_AO_R + r] = p;
                        if (r == 0) {
                            m_s[h] = mn;
                            z_s[h] = z_s[h] * cf + zs;
                            cf_s[h] = cf;
                        }
                    }
                    __syncthreads();
                    // acc = acc·cf + Σ_r p_r·row_r for the group's 4 heads at its columns.
#pragma unroll
                    for (int hh = 0; hh < 4; hh++) {
                        float cf = cf_s[hq * 4 + hh];
#pragma unroll
                        for (int k = 0; k < 2; k++) {
                            acc[hh][k].x *= cf;
                            acc[hh][k].y *= cf;
                            acc[hh][k].z *= cf;
                            acc[hh][k].w *= cf;
                        }
                    }
#pragma unroll
                    for (int r4 = 0; r4 < DS4_AO_R / 4; r4++) {
                        float4 pr[4];
#pragma unroll
                        for (int hh = 0; hh < 4; hh++) pr[hh] = p_s4[hq * 4 + hh][r4];
#pragma unroll
                        for (int rq = 0; rq < 4; rq++) {
                            int r = r4 * 4 + rq;
                            float4 x0 = fv[0] ? rows_s4[r * hd4 + f[0]] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                            float4 x1 = fv[1] ? rows_s4[r * hd4 + f[1]] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                            for (int hh = 0; hh < 4; hh++) {
                                float p = rq == 0 ? pr[hh].x : rq == 1 ? pr[hh].y : rq == 2 ? pr[hh].z : pr[hh].w;
                                acc[hh][0].x += p * x0.x;
                                acc[hh][0].y += p * x0.y;
                                acc[hh][0].z += p * x0.z;
                                acc[hh][0].w += p * x0.w;
                                acc[hh][1].x += p * x1.x;
                                acc[hh][1].y += p * x1.y;
                                acc[hh][1].z += p * x1.z;
                                acc[hh][1].w += p * x1.w;
                            }
                        }
                    }
                }
#undef DS4_AO_FETCH
            }
            __syncthreads(); // m_s / z_s final (or as initialised when the split has no rows)
            DS4_AO_STAMP(3);
            const size_t base = ((size_t)i * splits + s) * heads + h0;
            float4* po4 = (float4*)part_o;
#pragma unroll
            for (int hh = 0; hh < 4; hh++) {
                int h = hq * 4 + hh;
#pragma unroll
                for (int k = 0; k < 2; k++)
                    if (h < nhg && fv[k]) po4[(base + h) * hd4 + f[k]] = acc[hh][k];
            }
            if (tid < nhg) {
                part_mz[(base + tid) * 2] = m_s[tid];
                part_mz[(base + tid) * 2 + 1] = z_s[tid];
            }
        }
    } else if (V & 4) { // CTAs past the used splits
        DS4_AO_FILL_CS_ALL();
        ds4_pdl_enter();
    } else {
        DS4_AO_FILL_CS(); // CTAs past the used splits
    }
    DS4_AO_STAMP(4);
    const u32 total = gridDim.x;
    ds4_ao_grid_flip(tk, total);
    DS4_AO_STAMP(5);
    // Combine: 32-lane group per (token, head, 128-column block).
    {
        const int nblk = (hd4 + 31) / 32, ngrp = blockDim.x / 32;
        const long long units = (long long)n * heads * nblk;
        const size_t hstride = (size_t)heads * 2; // part_mz: split s of (i, h) at + s·heads·2
        for (long long u = (long long)vw * gridDim.x + blockIdx.x; u < units; u += (long long)gridDim.x * ngrp) {
            const int blk = (int)(u % nblk);
            const long long ih = u / nblk;
            const int h = (int)(ih % heads), i = (int)(ih / heads);
            const long long t = t0 + i;
            const float* mz = part_mz + ((size_t)i * splits * heads + h) * 2;
            const float sink = sinks[h];
            float M = sink;
            for (int s = vl; s < splits; s += 32) M = fmaxf(M, *(const volatile float*)(mz + s * hstride));
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, ds4_shfl_xor(M, o));
            float zp = 0.0f;
            for (int s = vl; s < splits; s += 32) {
                float m = *(const volatile float*)(mz + s * hstride);
                float z = *(const volatile float*)(mz + s * hstride + 1);
                float w = m == DS4_NEG_INF ? 0.0f : expf(m - M);
                w_s[vw][s] = w;
                zp += w * z;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) zp += ds4_shfl_xor(zp, o);
            const float zt = expf(sink - M) + zp;
            ds4_syncwarp();
            const int fc = blk * 32 + vl;
            if (fc < hd4) {
                const float4* po = (const float4*)part_o + ((size_t)i * splits * heads + h) * hd4 + fc;
                const size_t sstride = (size_t)heads * hd4;
                float4 a[4];
#pragma unroll
                for (int x = 0; x < 4; x++) a[x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                int s = 0;
                for (; s + 4 <= splits; s += 4) {
                    float4 o4[4];
#pragma unroll
                    for (int x = 0; x < 4; x++) o4[x] = ds4_ld_l2_f4(po + (size_t)(s + x) * sstride);
#pragma unroll
                    for (int x = 0; x < 4; x++) {
                        float w = w_s[vw][s + x];
                        a[x].x += w * o4[x].x;
                        a[x].y += w * o4[x].y;
                        a[x].z += w * o4[x].z;
                        a[x].w += w * o4[x].w;
                    }
                }
                for (; s < splits; s++) {
                    float4 o4 = ds4_ld_l2_f4(po + (size_t)s * sstride);
                    float w = w_s[vw][s];
                    a[0].x += w * o4.x;
                    a[0].y += w * o4.y;
                    a[0].z += w * o4.z;
                    a[0].w += w * o4.w;
                }
                float ov[4] = {((a[0].x + a[1].x) + (a[2].x + a[3].x)) / zt, ((a[0].y + a[1].y) + (a[2].y + a[3].y)) / zt,
                               ((a[0].z + a[1].z) + (a[2].z + a[3].z)) / zt, ((a[0].w + a[1].w) + (a[2].w + a[3].w)) / zt};
                const int rot0 = hd - n_rot;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    int e = 4 * fc + 2 * j;
                    if (e >= rot0) {
                        if (use_cs)
                            ds4_rope_inv_cs(ov + 2 * j, cs_s[i * nh2 + (e - rot0) / 2]);
                        else
                            ds4_rope_pair(ov + 2 * j, freqs[(e - rot0) / 2], t, 1);
                    }
                }
                ((float4*)out)[((size_t)i * heads + h) * hd4 + fc] = make_float4(ov[0], ov[1], ov[2], ov[3]);
            }
            ds4_syncwarp(); // w_s is rewritten by the group's next unit
        }
    }
    if (PROBE) __syncthreads(); // stamp 6: every warp's units merged
    DS4_AO_STAMP(6);
    // The ring after the chunk (every CTA has read it by now).
    const int keep = n < win ? n : win;
    for (int b = blockIdx.x; b < keep; b += gridDim.x) {
        int i = n - keep + b;
        long long t = t0 + i;
        for (int e = tid; e < hd; e += blockDim.x) raw[(t % win) * hd + e] = kv[(size_t)i * hd + e];
        if (tid == 0) raw_pos[t % win] = (int)t;
    }
    DS4_AO_STAMP(7);
}

DS4_KERNEL void DS4_BOUNDS(256) attend_one_f32(DS4_AO_PARAMS) { ds4_pdl_enter(); ds4_attend_one<false, false>(DS4_AO_ARGS, (u64*)0); }

// Probe of attend_one_f32 (crates/ds4-gpu/examples/attn_bench.rs): the same plus stamps.
DS4_KERNEL void DS4_BOUNDS(256) attend_one_p(DS4_AO_PARAMS, u64* stamps) { ds4_pdl_enter(); ds4_attend_one<true, false>(DS4_AO_ARGS, stamps); }

// The tile loop on tensor cores (ds4_ao_part_tc): CUDA sm_80+, hd == 512, 32-lane warps (the host
// checks; elsewhere the part phase is empty and the host keeps attend_one_f32). attend_one_tcp: its probe.
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tc(DS4_AO_PARAMS) { ds4_pdl_enter(); ds4_attend_one<false, true>(DS4_AO_ARGS, (u64*)0); }
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tcp(DS4_AO_PARAMS, u64* stamps) { ds4_pdl_enter(); ds4_attend_one<true, true>(DS4_AO_ARGS, stamps); }
// The A/B forms of attend_one_tc (attn.rs `DS4_GPU_AOTC`; V bits at ds4_attend_one) and their probes;
// V & 4 waits for the previous kernels itself (after the table and the first pointers).
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tc1(DS4_AO_PARAMS) { ds4_pdl_enter(); ds4_attend_one<false, true, 1>(DS4_AO_ARGS, (u64*)0); }
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tc1p(DS4_AO_PARAMS, u64* stamps) { ds4_pdl_enter(); ds4_attend_one<true, true, 1>(DS4_AO_ARGS, stamps); }
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tc5(DS4_AO_PARAMS) { DS4_PDL_LATE; ds4_attend_one<false, true, 5>(DS4_AO_ARGS, (u64*)0); }
DS4_KERNEL void DS4_BOUNDS(256) attend_one_tc5p(DS4_AO_PARAMS, u64* stamps) { DS4_PDL_LATE; ds4_attend_one<true, true, 5>(DS4_AO_ARGS, stamps); }
