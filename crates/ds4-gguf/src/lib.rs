//! GGUF v3 container: reader (mmap, zero-copy views) and writer.
//!
//! ```no_run
//! use ds4_gguf::GgufFile;
//! let f = GgufFile::open("model.gguf")?;
//! let layers = f.require_u32("deepseek4.block_count")?;
//! let t = f.tensor("token_embd.weight").expect("tensor");
//! let bytes: &[u8] = f.tensor_data(t); // a slice of the mapping
//! # Ok::<(), ds4_gguf::GgufError>(())
//! ```
mod error;
mod reader;
pub mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{
    GgufFile, MetadataEntry, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC,
    GGUF_VERSION, MAX_ARRAY_DEPTH, MAX_DIMS,
};
pub use types::GgmlType;
pub use value::{Array, ConvertError, StringArray, Value, ValueType};
pub use writer::{GgufWriter, Layout, MAX_TENSOR_NAME};
