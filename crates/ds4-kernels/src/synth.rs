use crate::Module;

/// Random weights written on the device: valid quantised blocks, f16/f32 values, expert-id
/// tables (`gpu/synth.cu`; file-less full-size models).
pub const SYNTH: Module = Module {
    name: "synth",
    source: include_str!("../gpu/synth.cu"),
    mma_only: &[],
    kernels: &["synth_quant", "synth_f32", "synth_f16", "synth_expert_ids"],
};
