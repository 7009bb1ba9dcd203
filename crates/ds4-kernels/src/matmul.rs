use crate::Module;

/// Weight products beyond one vector: batched matmul, expert-indexed products (`gpu/matmul.cu`).
pub const MATMUL: Module = Module {
    name: "matmul",
    source: include_str!("../gpu/matmul.cu"),
    kernels: &[],
};
