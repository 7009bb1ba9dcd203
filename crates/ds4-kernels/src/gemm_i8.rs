use crate::Module;

/// Activation-quantised prefill experts (opt-in `DS4_GPU_ACT=q8k`; `gpu/gemm_i8.cu`):
/// `act_q8k_f32` quantises f32 rows to Q8_K blocks (codes, scales and 16-code sums bit-identical
/// to `ds4_quant::act::QuantizedAct::new(ActFormat::Q8_K, ..)`); `gemmi8_iq2_xxs`: the MoE's
/// IQ2_XXS gate and up (one launch) on int8 tensor cores (mma.sync m16n8k32 s8, CUDA sm_80+),
/// with `ds4_quant::act::dot_row_act`'s per-block f32 combination, 3 groups in flight.
pub const GEMM_I8: Module = Module {
    name: "gemm_i8",
    source: include_str!("../gpu/gemm_i8.cu"),
    mma_only: &[],
    kernels: &["act_q8k_f32", "gemmi8_iq2_xxs"],
};
