// Row formats shared by attention.cu and attn_tc.cu (index_scores_d prepares the indexer query
// itself): the CPU's rounding steps (ds4-cpu math.rs) as bit-exact, uncontracted f32 operations,
// the RoPE angle's exact fmod, and the per-step position. Included after prelude.cuh.
#pragma once

#define ds4_add_rn(a, b) __fadd_rn((a), (b))
#define ds4_div_rn(a, b) __fdiv_rn((a), (b))

// Per-step position in device memory (model/mod.rs `GpuBackend::step_pos`): kernels that take a
// position also take `sp`; null: the position argument is absolute (prefill, tests), else it is an
// offset from *sp, the step's first position, written before the step's graph runs, so a replayed
// decode graph keeps the same arguments every step. Read after ds4_pdl_enter.
#define DS4_POS(sp, v) ((v) + ((sp) ? *(sp) : 0LL))

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

// Hadamard + FP4 of a width-128 row held by a warp (DS4_WARP 32), lane l holding elements
// 4l .. 4l+3 (round_fp4h128_f32 in attention.cu says how; also index_qprep_f32, index_scores_d).
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

// Forward RoPE of the pairs among a lane's elements 4l .. 4l+3 (a warp's width-128 row) that lie
// at or past off (the rotated tail, off even), pair p's (cos, sin) at cs[p]: ds4_rope_pair's
// operations (index_qprep_f32, index_scores_d).
__device__ __forceinline__ void ds4_rope_lane(float (&v)[4], int lane, int off, const float2* cs) {
#pragma unroll
    for (int c = 0; c < 4; c += 2) {
        const int e = 4 * lane + c;
        if (e >= off) {
            const float2 r = cs[(e - off) / 2];
            const float a0 = v[c], b0 = v[c + 1];
            v[c] = ds4_sub_rn(ds4_mul_rn(a0, r.x), ds4_mul_rn(b0, r.y));
            v[c + 1] = ds4_add_rn(ds4_mul_rn(a0, r.y), ds4_mul_rn(b0, r.x));
        }
    }
}
