use crate::Module;

/// Operands of the vendor BLAS-Lt products (`gpu/blas_prep.cu`, host side ds4-gpu model/blas.rs):
/// `blas_w_<t>` dequantises a weight to bf16 hi/lo parts laid along K (`[hi | hi | lo]`),
/// `blas_x_f32` converts activations the same way (`[hi | lo | hi]`), so one bf16 product with
/// f32 accumulation sums the built-in GEMM's three hi/lo terms; `blas_w_q8_0d[i]` does the same from
/// a Q8_0 matrix's decode layout (plain / interleaved); `blas_x_widen` bf16 -> f32. The f16 form (`DS4_GPU_BLAS=f16`):
/// `blas_amax` (partial max|x| and max|d|), `blas_wh_<t>` (W' = f16(W·2^-u)), `blas_xh_f32`
/// (X' = f16(X·2^s), and the library's device-side alpha 2^(u-s)).
pub const BLAS_PREP: Module = Module {
    name: "blas_prep",
    source: include_str!("../gpu/blas_prep.cu"),
    mma_only: &[],
    kernels: &[
        "blas_w_f32",
        "blas_w_f16",
        "blas_w_bf16",
        "blas_w_q8_0",
        "blas_w_q8_0d",
        "blas_w_q8_0di",
        "blas_x_f32",
        "blas_x_widen",
        "blas_amax",
        "blas_wh_f16",
        "blas_wh_q8_0",
        "blas_xh_f32",
    ],
};
