use crate::Module;

/// Hopper wgmma form of the MoE's IQ2_XXS gate/up at prefill (`gpu/gemm_wg.cu`; CUDA sm_90a
/// only, empty bodies elsewhere; `gwg_iq2_xxs_p1_d2_f` / `_fw`: the super-block scale folded
/// into the f16 weights, runs of 64 / the wide runs of 128 pairs a CTA): `gwg_x_f32` converts the
/// token rows to scaled f16 hi/lo planes in the kernel's K order (`gwg_x1_f32`: in one pass), `gwg_iq2_xxs` runs gate and up in one launch (256 weight rows x 64 pairs per CTA) (wgmma m64nNk16 f16,
/// integer weights decoded into the A registers, X from shared memory by descriptor);
/// `gwg_iq2_xxs_p1` the same with X's hi plane alone (opt-in `DS4_GPU_GEMM_PLANES=1`).
pub const GEMM_WG: Module = Module {
    name: "gemm_wg",
    source: include_str!("../gpu/gemm_wg.cu"),
    mma_only: &[],
    kernels: &[
        "gwg_iq2_xxs",
        "gwg_iq2_xxs_p1",
        "gwg_iq2_xxs_d2",
        "gwg_iq2_xxs_p1_d2",
        "gwg_iq2_xxs_p1_d2_f",
        "gwg_iq2_xxs_p1_d2_fw",
        "gwg_iq2_xxs_p1_d2_fwp",
        "gwg_x_f32",
        "gwg_x1_f32",
    ],
};
