//! GGUF v3 container: reader (mmap, zero-copy views) and writer.
pub mod types;
pub use types::GgmlType;
