//! Errors. Every reader error names the file and the byte offset of the record at fault, and
//! the key or tensor where there is one.

use crate::GgmlType;

/// Everything that can go wrong reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{file}: not a GGUF file: the first bytes are {found:02x?}, expected \"GGUF\" [47, 47, 55, 46]")]
    BadMagic { file: String, found: Vec<u8> },

    #[error("{file}: GGUF version {version} is not supported (only version 3)")]
    UnsupportedVersion { file: String, version: u32 },

    /// A fixed-size field runs past the end of the file.
    #[error("{file}: {what} at byte {offset} needs {need} bytes but the file has {file_size} bytes (truncated?)")]
    UnexpectedEof {
        file: String,
        what: String,
        offset: u64,
        need: u64,
        file_size: u64,
    },

    /// A tensor, metadata or array-element count that the rest of the file could not hold.
    #[error("{file}: {what} (count at byte {offset}) is {count}, but the {remaining} bytes left in the file hold at most {max}")]
    CountTooLarge {
        file: String,
        what: String,
        offset: u64,
        count: u64,
        remaining: u64,
        max: u64,
    },

    #[error("{file}: {what}: string length {len} (at byte {offset}) runs past the end of the file ({remaining} bytes left)")]
    StringPastEof {
        file: String,
        what: String,
        offset: u64,
        len: u64,
        remaining: u64,
    },

    #[error("{file}: {what} (string at byte {offset}) is not valid UTF-8: {bytes}")]
    InvalidUtf8 {
        file: String,
        what: String,
        offset: u64,
        /// The first bytes, escaped.
        bytes: String,
    },

    #[error("{file}: metadata key {key} (record at byte {offset}): unknown value type id {type_id} at byte {at}")]
    UnknownValueType {
        file: String,
        key: String,
        offset: u64,
        type_id: u32,
        at: u64,
    },

    #[error("{file}: metadata key {key} (record at byte {offset}): bool byte at {at} is {byte}, expected 0 or 1")]
    InvalidBool {
        file: String,
        key: String,
        offset: u64,
        byte: u8,
        at: u64,
    },

    #[error("{file}: metadata key {key} (record at byte {offset}): arrays nested deeper than {max} levels")]
    NestingTooDeep {
        file: String,
        key: String,
        offset: u64,
        max: usize,
    },

    #[error(
        "{file}: duplicate metadata key {key} (record at byte {offset}; first at byte {first})"
    )]
    DuplicateKey {
        file: String,
        key: String,
        offset: u64,
        first: u64,
    },

    #[error("{file}: general.alignment (record at byte {offset}) is {found}; it must be a non-zero power of two u32")]
    BadAlignment {
        file: String,
        offset: u64,
        found: String,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}): unknown ggml type id {type_id}")]
    UnknownGgmlType {
        file: String,
        tensor: String,
        offset: u64,
        type_id: u32,
    },

    #[error(
        "{file}: tensor {tensor} (info at byte {offset}): n_dims is {n_dims}, expected 1 to 4"
    )]
    BadDimCount {
        file: String,
        tensor: String,
        offset: u64,
        n_dims: u32,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}): dims {dims:?} overflow (element or byte count above 2^63)")]
    DimsOverflow {
        file: String,
        tensor: String,
        offset: u64,
        dims: Vec<u64>,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}): row length ne0 = {ne0} is not a multiple of the {ty} block size {block}")]
    RowNotWholeBlocks {
        file: String,
        tensor: String,
        offset: u64,
        ne0: u64,
        ty: GgmlType,
        block: u64,
    },

    #[error(
        "{file}: duplicate tensor name {tensor} (info at byte {offset}; first at byte {first})"
    )]
    DuplicateTensor {
        file: String,
        tensor: String,
        offset: u64,
        first: u64,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}): data offset {data_offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        file: String,
        tensor: String,
        offset: u64,
        data_offset: u64,
        alignment: u64,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}): data ends at byte {end} but the file has {file_size} bytes (truncated?)")]
    TensorPastEof {
        file: String,
        tensor: String,
        offset: u64,
        end: u64,
        file_size: u64,
    },

    #[error("{file}: tensor {tensor} (info at byte {offset}) data bytes {start}..{end} overlap tensor {other} (bytes {other_start}..{other_end})")]
    TensorOverlap {
        file: String,
        tensor: String,
        offset: u64,
        start: u64,
        end: u64,
        other: String,
        other_start: u64,
        other_end: u64,
    },

    #[error("{file}: metadata key {key} is missing")]
    MissingKey { file: String, key: String },

    #[error(
        "{file}: metadata key {key} (record at byte {offset}): expected {expected}, found {found}"
    )]
    WrongType {
        file: String,
        key: String,
        offset: u64,
        expected: String,
        found: String,
    },

    /// The writer was given something it cannot encode.
    #[error("GGUF writer: {what}: {reason}")]
    Write { what: String, reason: String },
}

impl GgufError {
    pub(crate) fn write(what: impl Into<String>, reason: impl Into<String>) -> GgufError {
        GgufError::Write {
            what: what.into(),
            reason: reason.into(),
        }
    }
}
