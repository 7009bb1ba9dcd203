use crate::Module;

/// Hopper wgmma form of the dense Q8_0 prefill products (`gpu/gemm_wq.cu`; CUDA sm_90a only,
/// empty body elsewhere): `gwq_q8_0`, X from `gemm_xt_f32` in the unit layout, 256 weight rows x
/// 16/32/64 tokens per CTA, wgmma m64nNk16 f16 with the int8 weights as A (exact) and the X hi/lo
/// planes as B, the block scale applied per 32-column block in f32.
pub const GEMM_WQ: Module = Module {
    name: "gemm_wq",
    source: include_str!("../gpu/gemm_wq.cu"),
    kernels: &["gwq_q8_0"],
};
