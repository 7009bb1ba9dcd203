// RMSNorm and elementwise ops on f32 vectors (the CPU definitions are ds4-cpu's math.rs).
#include "prelude.cuh"

// y[row] = x[row] / sqrt(mean(x[row]^2) + eps) * w (w may be null). One CTA per row; the sum
// of squares is accumulated in f64 like the CPU reference. blockDim.x is a multiple of DS4_WARP,
// at most 1024.
DS4_KERNEL void DS4_BOUNDS(1024) rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                             float* __restrict__ y, int n, float eps) {
    __shared__ double part[1024 / 32];
    __shared__ float scale_s;
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = y + (size_t)blockIdx.x * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    ss = ds4_warp_sum_f64(ss);
    int warp = threadIdx.x / DS4_WARP, nwarps = blockDim.x / DS4_WARP;
    if (threadIdx.x % DS4_WARP == 0) part[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < nwarps; i++) t += part[i];
        scale_s = (float)(1.0 / sqrt(t / (double)n + (double)eps));
    }
    __syncthreads();
    float scale = scale_s;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] * scale;
        yr[i] = w ? v * w[i] : v;
    }
}

DS4_KERNEL void DS4_BOUNDS(256) add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                                       long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

DS4_KERNEL void DS4_BOUNDS(256) mul_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                                       long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] * b[i];
}

DS4_KERNEL void DS4_BOUNDS(256) scale_f32(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}

// y = silu(min(g, c)) * clamp(u, -c, c) * weight: the clamped SwiGLU of the experts.
DS4_KERNEL void DS4_BOUNDS(256) swiglu_f32(const float* __restrict__ g, const float* __restrict__ u,
                                          float* __restrict__ y, float c, float weight, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = fminf(g[i], c);
    float uv = fminf(fmaxf(u[i], -c), c);
    float silu = gv * (1.0f / (1.0f + expf(-gv)));
    y[i] = silu * uv * weight;
}
