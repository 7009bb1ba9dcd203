use crate::Module;

/// Prefill weight products: tensor-core GEMM (mma) with a portable fallback (`gpu/gemm.cu`).
/// `gemm_<t>`: mma.sync bf16 hi/lo split (sm_80+ only; elsewhere the host takes `gemmf_<t>`);
/// `gemmw_<t>`: the bf16 form with 128-item tiles (256 threads) for long prompts;
/// `gemmp_<t>`: 3xTF32 mma (more precise; sm_80+ only); `gemmf_<t>`: always the FMA tiles; `gemm_sum_f32`: split-K partial sums;
/// `gemmh<BM>_<t>`: one f16 mma per tile on X pre-scaled and rounded by `gemm_xh_f32` (opt-in, sm_80+);
/// `gemmt_<t>`: tiled integer-weight form (CUDA sm_80+; default for Q4_K, opt-in Q8_0/IQ2_XXS:
/// raw blocks and X staged by cp.async, scales per super-block, two f16 mma per tile on X from
/// `gemm_xt_f32`);
/// `gemmu_q2_k`: the tiled form for Q2_K with the weights decoded once per CTA (X in the unit layout);
/// `gemmc_iq2_xxs`: exact bf16 weights, two mma per tile, on X split into hi/lo once per product by `gemm_xb_f32` (the MoE's
/// IQ2_XXS gate/up, CUDA sm_80+);
/// `gm_group_*_i32`: O(n) grouping of MoE (token, slot) pairs by expert (count, scan, scatter).
pub const GEMM: Module = Module {
    name: "gemm",
    source: include_str!("../gpu/gemm.cu"),
    // gemm_/gemmp_/gemmw_ are mma.sync forms; without mma (HIP, sm < 80) they are not compiled
    // (three copies of the FMA tiles cost most of the module's HIP compile time) and the host
    // takes gemmf_ with 64-item tiles.
    mma_only: &[
        "gemm_f32",
        "gemm_f16",
        "gemm_bf16",
        "gemm_q8_0",
        "gemm_q2_k",
        "gemm_q4_k",
        "gemm_iq2_xxs",
        "gemmp_f32",
        "gemmp_f16",
        "gemmp_bf16",
        "gemmp_q8_0",
        "gemmp_q2_k",
        "gemmp_q4_k",
        "gemmp_iq2_xxs",
        "gemmw_f32",
        "gemmw_f16",
        "gemmw_bf16",
        "gemmw_q8_0",
        "gemmw_q2_k",
        "gemmw_q4_k",
        "gemmw_iq2_xxs",
    ],
    kernels: &[
        "gemmf_f32",
        "gemmf_f16",
        "gemmf_bf16",
        "gemmf_q8_0",
        "gemmf_q2_k",
        "gemmf_q4_k",
        "gemmc_iq2_xxs",
        "gemm_xb_f32",
        "gemmf_iq2_xxs",
        "gemm_sum_f32",
        "gm_group_count_i32",
        "gm_group_scan_i32",
        "gm_group_scatter_i32",
        "gemmh64_f16",
        "gemmh128_f16",
        "gemmh256_f16",
        "gemmh64_q8_0",
        "gemmh128_q8_0",
        "gemmh256_q8_0",
        "gemmh64_q2_k",
        "gemmh128_q2_k",
        "gemmh256_q2_k",
        "gemmh64_q4_k",
        "gemmh128_q4_k",
        "gemmh256_q4_k",
        "gemmh64_iq2_xxs",
        "gemmh128_iq2_xxs",
        "gemmh256_iq2_xxs",
        "gemm_xh_f32",
        "gemmt_q8_0",
        "gemmt_q4_k",
        "gemmt_iq2_xxs",
        "gemmu_q2_k",
        "gemm_xt_f32",
        "gemm_xt_swiglu_f32",
    ],
};
