use crate::Module;

/// Token sampling on the device (`gpu/sample.cu`): greedy argmax over many CTAs with a last-CTA
/// finish; temperature / top-k / top-p / min-p over many CTAs (max, a histogram of d = (l-m)/T
/// in bins that follow the candidates' order, ids grouped by bin) and one CTA that orders only
/// the few bins a boundary falls in (`sample_pick`: the single-CTA radix-select form, also the
/// finish's fallback), so a decode step hands back one token id.
pub const SAMPLE: Module = Module {
    name: "sample",
    source: include_str!("../gpu/sample.cu"),
    mma_only: &[],
    kernels: &[
        "sample_argmax",
        "sample_pick",
        "sample_top",
        "sample_hist",
        "sample_scatter",
        "sample_finish",
    ],
};
