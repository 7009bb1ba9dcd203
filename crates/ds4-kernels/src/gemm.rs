use crate::Module;

/// Prefill weight products: tensor-core GEMM (mma) with a portable fallback (`gpu/gemm.cu`).
/// `gemm_<t>`: mma.sync bf16 hi/lo split where compiled for sm_80+, else plain FMA tiles;
/// `gemmw_<t>`: the bf16 form with 128-item tiles (256 threads) for long prompts;
/// `gemmp_<t>`: 3xTF32 mma (more precise; FMA where no mma); `gemmf_<t>`: always the FMA tiles; `gemm_sum_f32`: split-K partial sums;
/// `gm_group_*_i32`: O(n) grouping of MoE (token, slot) pairs by expert (count, scan, scatter).
pub const GEMM: Module = Module {
    name: "gemm",
    source: include_str!("../gpu/gemm.cu"),
    kernels: &[
        "gemm_f32",
        "gemmp_f32",
        "gemmf_f32",
        "gemm_f16",
        "gemmp_f16",
        "gemmf_f16",
        "gemm_bf16",
        "gemmp_bf16",
        "gemmf_bf16",
        "gemm_q8_0",
        "gemmp_q8_0",
        "gemmf_q8_0",
        "gemm_q2_k",
        "gemmp_q2_k",
        "gemmf_q2_k",
        "gemm_q4_k",
        "gemmp_q4_k",
        "gemmf_q4_k",
        "gemm_iq2_xxs",
        "gemmp_iq2_xxs",
        "gemmf_iq2_xxs",
        "gemmw_f32",
        "gemmw_f16",
        "gemmw_bf16",
        "gemmw_q8_0",
        "gemmw_q2_k",
        "gemmw_q4_k",
        "gemmw_iq2_xxs",
        "gemm_sum_f32",
        "gm_group_count_i32",
        "gm_group_scan_i32",
        "gm_group_scatter_i32",
    ],
};
