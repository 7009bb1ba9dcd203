use crate::Module;

/// Hopper wgmma form of the MoE's Q2_K down at prefill (`gpu/gemm_wgd.cu`; CUDA sm_90a only,
/// empty body elsewhere): `gwd_q2_k` takes `gemmu_q2_k`'s arguments (X from `gemm_xt_f32` in the
/// unit layout with super-block sums), 256 weight rows x 64 pairs per CTA, wgmma m64nNk16 f16
/// with the integer weights `sl * q` decoded into the A registers and the min term as one more
/// wgmma pair per super-block; `gwd_q2_k_p1` the same with the hi planes of X and the sums alone
/// (opt-in `DS4_GPU_GEMM_PLANES=1`); `gwd_q2_k_p1_fw(p)` the folded wide form, whose runs of at
/// most `smax` pairs `gwds_q2_k` computes beside it (mma.sync, the items as B columns).
pub const GEMM_WGD: Module = Module {
    name: "gemm_wgd",
    source: include_str!("../gpu/gemm_wgd.cu"),
    mma_only: &[],
    kernels: &[
        "gwd_q2_k",
        "gwd_q2_k_p1",
        "gwd_q2_k_p1_fw",
        "gwd_q2_k_p1_fwp",
        "gwds_q2_k",
        "gwds16_q2_k",
    ],
};
