use crate::Module;

/// Decode-time weight products (a few token rows): bandwidth-bound matvec kernels (`gpu/matvec.cu`).
pub const MATVEC: Module = Module {
    name: "matvec",
    source: include_str!("../gpu/matvec.cu"),
    kernels: &[],
};
