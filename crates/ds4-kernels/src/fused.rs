use crate::Module;

/// Fused decode glue (`gpu/fused.cu`): HC pre with the sublayer norm in one launch (split-K
/// mixer products, then a last-CTA epilogue or, the grid forms, a grid barrier after which every
/// CTA finishes its own columns), the same after an in-place HC post, and RMSNorm + RoPE
/// (+ FP8/f16 rounding) of attention rows.
pub const FUSED: Module = Module {
    name: "fused",
    source: include_str!("../gpu/fused.cu"),
    kernels: &[
        "hc_pre_norm_f32",
        "hc_post_pre_norm_f32",
        "norm_rope_f32",
        "hc_pre_norm_w",
        "hc_post_pre_norm_w",
        "hc_pre_norm_g",
        "hc_post_pre_norm_g",
        "norm_rope_g",
    ],
};
