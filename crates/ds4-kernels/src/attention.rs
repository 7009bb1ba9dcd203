use crate::Module;

/// Attention-state ops: RoPE, row rounding (FP8/FP4/f16), compressors, lightning indexer, sink attention (`gpu/attention.cu`).
pub const ATTENTION: Module = Module {
    name: "attention",
    source: include_str!("../gpu/attention.cu"),
    kernels: &[],
};
