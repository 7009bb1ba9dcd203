use crate::Module;

/// Token sampling on the device (`gpu/sample.cu`): greedy argmax over many CTAs with a last-CTA
/// finish, and temperature / top-k / top-p / min-p by radix select in one CTA, so a decode step
/// hands back one token id.
pub const SAMPLE: Module = Module {
    name: "sample",
    source: include_str!("../gpu/sample.cu"),
    kernels: &["sample_argmax", "sample_pick"],
};
