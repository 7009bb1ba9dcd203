use crate::Module;

/// Prefill weight products: tensor-core GEMM (mma) with a portable fallback (`gpu/gemm.cu`).
pub const GEMM: Module = Module {
    name: "gemm",
    source: include_str!("../gpu/gemm.cu"),
    kernels: &[],
};
