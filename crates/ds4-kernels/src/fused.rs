use crate::Module;

/// Fused decode glue (`gpu/fused.cu`): HC pre with the sublayer norm in one launch (split-K
/// mixer products, then a last-CTA epilogue), the same after an in-place HC post, and RMSNorm +
/// RoPE (+ FP8/f16 rounding) of attention rows (prefill: `norm_rope_pair_w`, a warp a row); the
/// prefill HC pre (`hcp_mix`, or on tensor cores `hcp_mix_tc` / `hcp_post_mix_tc` with the HC
/// post inside: mixer partials of token tiles; then `hcp_finish`, a CTA a token, the epilogue). `hc_post_pre_norm_p` is a
/// probe of the HC kernels (phase stamps, early stops) for `examples/hc_bench.rs`.
pub const FUSED: Module = Module {
    name: "fused",
    source: include_str!("../gpu/fused.cu"),
    mma_only: &[],
    kernels: &[
        "hc_pre_norm_f32",
        "hc_post_pre_norm_f32",
        "norm_rope_f32",
        "hc_pre_norm_l",
        "hc_post_pre_norm_l",
        "hc_post_pre_norm_p",
        "norm_rope_g",
        "norm_rope_pair_g",
        "norm_rope_pair_gl",
        "norm_rope_pair_w",
        "hcp_mix",
        "hcp_mix_tc",
        "hcp_post_mix_tc",
        "hcp_post_mix_tc4",
        "hcp_post_mix_tc4p",
        "hcp_finish",
    ],
};
