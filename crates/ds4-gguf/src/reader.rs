//! GGUF v3 reader: parses header, metadata and tensor infos up front, validates every offset,
//! and hands out tensor data as slices of the mapped file.
//!
//! Layout (all little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64;
//! metadata records (key string, value type u32, value); tensor infos (name string, n_dims u32,
//! dims u64 × n_dims, ggml type u32, offset u64 relative to the data section); padding to
//! `general.alignment`; the data section. A string is a u64 byte length then UTF-8 bytes; an
//! array is an element type u32, a count u64, then the elements.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::GgufError;
use crate::value::{Array, ConvertError, StringArray, Value, ValueType};
use crate::GgmlType;

/// "GGUF" read as a little-endian u32.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The only version this crate reads and writes.
pub const GGUF_VERSION: u32 = 3;
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Key that sets the data-section alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of arrays accepted (an array value at top level is depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// GGUF allows at most 4 dimensions per tensor.
pub const MAX_DIMS: usize = 4;

/// One tensor's description, with its data range resolved to absolute file offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` = ne0 is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file (data section start + stored offset).
    pub offset: u64,
    pub n_bytes: u64,
    pub n_elements: u64,
    /// Byte offset of this tensor's info record (for messages).
    pub info_offset: u64,
}

impl TensorInfo {
    /// Bytes of one row (`ne0` elements).
    pub fn row_bytes(&self) -> u64 {
        // Validated at open: ne0 is a whole number of blocks.
        self.ty.row_bytes(self.dims[0]).unwrap_or(0)
    }

    /// Number of rows (product of dims after ne0).
    pub fn n_rows(&self) -> u64 {
        self.dims[1..].iter().product()
    }
}

/// One metadata record.
#[derive(Clone, Debug, PartialEq)]
pub struct MetadataEntry {
    pub key: String,
    pub value: Value,
    /// Byte offset of the record (its key's length field).
    pub offset: u64,
}

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

/// A parsed GGUF file. Tensor data is not copied: [`GgufFile::tensor_data`] returns slices of
/// the mapping. (As with any mmap, another process truncating the file while it is mapped can
/// crash this one; GGUF files are not expected to change while in use.)
pub struct GgufFile {
    name: String,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<MetadataEntry>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("name", &self.name)
            .field("file_size", &self.file_size())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` read-only and parses it. Errors are labelled with `path` as given.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| GgufError::Io {
            file: name.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        let len = meta.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: read-only mapping; the file must not be truncated while mapped (see the
            // type's documentation). Every access is bounds-checked against the mapped length.
            Storage::Mmap(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        Self::parse(name, storage)
    }

    /// Parses a file held in memory; `name` labels error messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::parse(name.to_owned(), Storage::Owned(bytes))
    }

    fn parse(name: String, storage: Storage) -> Result<GgufFile, GgufError> {
        let bytes: &[u8] = match &storage {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        };
        let p = Parser::new(&name, bytes).parse()?;
        Ok(GgufFile {
            name,
            storage,
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            metadata: p.metadata,
            meta_index: p.meta_index,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
        })
    }

    /// The label used in messages (the path given to `open`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }

    /// Whether the bytes are a mapping of the file (pages the OS may read in or drop), not a
    /// copy held in this process's memory ([`GgufFile::from_bytes`]).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mmap(_))
    }

    /// Asks the OS to read `len` bytes at `offset` of a mapped file into the page cache in the
    /// background (`madvise(MADV_WILLNEED)`), so that later reads of them (host-memory experts'
    /// first decode steps) find them cached. Best effort: a file held in memory, or a system
    /// without the call, does nothing; a range outside the file is an error.
    pub fn will_need(&self, offset: usize, len: usize) -> std::io::Result<()> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.bytes().len())
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{}: bytes {offset}..+{len} are outside the file ({} bytes)",
                    self.name,
                    self.bytes().len()
                ),
            ));
        }
        match &self.storage {
            #[cfg(unix)]
            Storage::Mmap(m) if len > 0 => m.advise_range(memmap2::Advice::WillNeed, offset, len),
            _ => Ok(()),
        }
    }

    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Metadata records in file order.
    pub fn metadata(&self) -> &[MetadataEntry] {
        &self.metadata
    }

    /// The record for `key`.
    pub fn entry(&self, key: &str) -> Option<&MetadataEntry> {
        self.meta_index.get(key).map(|&i| &self.metadata[i])
    }

    /// The value for `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entry(key).map(|e| &e.value)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of `info`, a slice of the mapping.
    ///
    /// # Panics
    /// If `info` does not come from this file and its range lies outside it.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let bytes = self.bytes();
        let end = info.offset.checked_add(info.n_bytes);
        let range = usize::try_from(info.offset)
            .ok()
            .zip(end.and_then(|e| usize::try_from(e).ok()))
            .and_then(|(s, e)| bytes.get(s..e));
        match range {
            Some(r) => r,
            None => panic!(
                "{}: tensor {} range {}+{} is outside the file ({} bytes): TensorInfo from another file?",
                self.name,
                info.name,
                info.offset,
                info.n_bytes,
                bytes.len()
            ),
        }
    }

    /// The data of the tensor called `name`.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    // ---- typed metadata access; errors name the file, key, expectation and record offset ----

    /// The value for `key`, or a "missing key" error.
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            file: self.name.clone(),
            key: key.to_owned(),
        })
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        f: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let v = self.require(key)?;
        f(v).ok_or_else(|| self.wrong_type(key, expected, describe(v)))
    }

    fn wrong_type(&self, key: &str, expected: &str, found: String) -> GgufError {
        GgufError::WrongType {
            file: self.name.clone(),
            key: key.to_owned(),
            offset: self.entry(key).map_or(0, |e| e.offset),
            expected: expected.to_owned(),
            found,
        }
    }

    /// An integer that fits in u32.
    pub fn require_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "an integer that fits in u32", Value::as_u32)
    }

    /// An integer that fits in u64.
    pub fn require_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "an integer that fits in u64", Value::as_u64)
    }

    /// An integer that fits in i64.
    pub fn require_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.typed(key, "an integer that fits in i64", Value::as_i64)
    }

    /// f32, f64, u32 or i32 (see [`Value::as_f32`]).
    pub fn require_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "a number (f32, f64, u32 or i32)", Value::as_f32)
    }

    pub fn require_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "bool", Value::as_bool)
    }

    pub fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    /// An array of numbers, each converted as [`Value::as_f32`].
    pub fn require_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.typed(key, "array of f32 (or f64/u32/i32)", |v| {
            v.as_array().and_then(Array::to_f32_vec)
        })
    }

    /// An array of u32, or of other integers whose every element fits (e.g. non-negative i32).
    pub fn require_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        const EXPECTED: &str = "array of u32 (or non-negative i32)";
        let v = self.require(key)?;
        let Some(a) = v.as_array() else {
            return Err(self.wrong_type(key, EXPECTED, describe(v)));
        };
        a.to_u32_vec().map_err(|e| match e {
            ConvertError::WrongType => self.wrong_type(key, EXPECTED, describe(v)),
            ConvertError::OutOfRange { index } => self.wrong_type(
                key,
                EXPECTED,
                format!(
                    "{} whose element {index} is {}",
                    a.type_name(),
                    a.get(index).map_or_else(String::new, |x| x.to_string())
                ),
            ),
        })
    }

    /// A string array, without copying the strings.
    pub fn require_strings(&self, key: &str) -> Result<&StringArray, GgufError> {
        self.typed(key, "array of string", |v| {
            v.as_array().and_then(Array::as_strings)
        })
    }

    /// A string array as `&str`s.
    pub fn require_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        Ok(self.require_strings(key)?.iter().collect())
    }
}

/// A value's type plus, for scalars, the value itself ("string \"abc\"", "i32 -1").
fn describe(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("{} with {} elements", a.type_name(), a.len()),
        Value::String(s) if s.chars().count() > 40 => {
            format!("string {:?}...", s.chars().take(40).collect::<String>())
        }
        v => format!("{} {}", v.type_name(), v),
    }
}

/// First bytes of a string, escaped, for messages about bad strings.
fn escaped_prefix(b: &[u8]) -> String {
    let mut s: String = b
        .iter()
        .take(32)
        .flat_map(|&c| std::ascii::escape_default(c))
        .map(char::from)
        .collect();
    if b.len() > 32 {
        s.push_str("...");
    }
    format!("\"{s}\"")
}

/// A short read: `need` bytes wanted at `offset`.
struct Short {
    offset: u64,
    need: u64,
}

struct Parsed {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<MetadataEntry>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

struct Parser<'a> {
    file: &'a str,
    b: &'a [u8],
    pos: usize,
}

/// Where a value lives, for messages.
#[derive(Clone, Copy)]
struct Ctx<'k> {
    key: &'k str,
    rec: u64,
}

impl<'a> Parser<'a> {
    fn new(file: &'a str, b: &'a [u8]) -> Self {
        Parser { file, b, pos: 0 }
    }

    fn remaining(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], Short> {
        if n > self.remaining() {
            return Err(Short {
                offset: self.pos as u64,
                need: n,
            });
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let s = self.take(N as u64)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, Short> {
        self.arr().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, Short> {
        self.arr().map(u64::from_le_bytes)
    }

    fn eof(&self, s: Short, what: impl FnOnce() -> String) -> GgufError {
        GgufError::UnexpectedEof {
            file: self.file.to_owned(),
            what: what(),
            offset: s.offset,
            need: s.need,
            file_size: self.b.len() as u64,
        }
    }

    /// A count at the current position that must fit the remaining bytes at `min_each` each.
    fn count(&mut self, min_each: u64, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        let at = self.pos as u64;
        let n = self.u64().map_err(|s| self.eof(s, what))?;
        let remaining = self.remaining();
        let max = remaining / min_each.max(1);
        if n > max {
            return Err(GgufError::CountTooLarge {
                file: self.file.to_owned(),
                what: what(),
                offset: at,
                count: n,
                remaining,
                max,
            });
        }
        Ok(n)
    }

    /// A length-prefixed UTF-8 string borrowed from the file.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<&'a str, GgufError> {
        let at = self.pos as u64;
        let len = self
            .u64()
            .map_err(|s| self.eof(s, || format!("{}: string length", what())))?;
        if len > self.remaining() {
            return Err(GgufError::StringPastEof {
                file: self.file.to_owned(),
                what: what(),
                offset: at,
                len,
                remaining: self.remaining(),
            });
        }
        let bytes = self.take(len).map_err(|s| self.eof(s, what))?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            file: self.file.to_owned(),
            what: what(),
            offset: at,
            bytes: escaped_prefix(bytes),
        })
    }

    fn parse(mut self) -> Result<Parsed, GgufError> {
        let file = self.file;
        let magic = self.take(4).map_err(|_| GgufError::BadMagic {
            file: file.to_owned(),
            found: self.b[..self.b.len().min(4)].to_vec(),
        })?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                file: file.to_owned(),
                found: magic.to_vec(),
            });
        }
        let version = self
            .u32()
            .map_err(|s| self.eof(s, || "header: version".into()))?;
        if version != GGUF_VERSION {
            return Err(GgufError::UnsupportedVersion {
                file: file.to_owned(),
                version,
            });
        }
        // Smallest tensor info: empty name (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
        const MIN_TENSOR_INFO: u64 = 32;
        // Smallest metadata record: empty key (8) + type (4) + a u8 value (1).
        const MIN_KV: u64 = 13;
        let n_tensors = self.count(MIN_TENSOR_INFO, &|| "header: tensor count".into())?;
        let n_kv = self.count(MIN_KV, &|| "header: metadata count".into())?;

        // Metadata.
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let rec = self.pos as u64;
            let key = self.string(&|| format!("metadata record {i} (at byte {rec}): key"))?;
            let ctx = Ctx { key, rec };
            let ty = self.value_type(ctx)?;
            let value = self.value(ty, ctx, 0)?;
            if let Some(&first) = meta_index.get(key) {
                let first: &MetadataEntry = &metadata[first];
                return Err(GgufError::DuplicateKey {
                    file: file.to_owned(),
                    key: key.to_owned(),
                    offset: rec,
                    first: first.offset,
                });
            }
            meta_index.insert(key.to_owned(), metadata.len());
            metadata.push(MetadataEntry {
                key: key.to_owned(),
                value,
                offset: rec,
            });
        }

        let alignment = match meta_index.get(ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let e: &MetadataEntry = &metadata[i];
                match e.value.as_u32() {
                    Some(a) if a.is_power_of_two() => a.into(),
                    _ => {
                        return Err(GgufError::BadAlignment {
                            file: file.to_owned(),
                            offset: e.offset,
                            found: describe(&e.value),
                        })
                    }
                }
            }
        };

        // Tensor infos.
        if n_tensors > self.remaining() / MIN_TENSOR_INFO {
            return Err(GgufError::CountTooLarge {
                file: file.to_owned(),
                what: "header: tensor count".into(),
                offset: 8,
                count: n_tensors,
                remaining: self.remaining(),
                max: self.remaining() / MIN_TENSOR_INFO,
            });
        }
        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        let mut rel_offsets = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let rec = self.pos as u64;
            let name = self.string(&|| format!("tensor info {i} (at byte {rec}): name"))?;
            let (t, rel) = self.tensor_info(name, rec)?;
            if let Some(&first) = tensor_index.get(name) {
                let first: &TensorInfo = &tensors[first];
                return Err(GgufError::DuplicateTensor {
                    file: file.to_owned(),
                    tensor: name.to_owned(),
                    offset: rec,
                    first: first.info_offset,
                });
            }
            tensor_index.insert(name.to_owned(), tensors.len());
            tensors.push(t);
            rel_offsets.push(rel);
        }

        // The data section starts at the end of the infos rounded up to the alignment.
        let data_offset = (self.pos as u64).div_ceil(alignment) * alignment;
        let file_size = self.b.len() as u64;
        for (t, &rel) in tensors.iter_mut().zip(&rel_offsets) {
            if rel % alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    file: file.to_owned(),
                    tensor: t.name.clone(),
                    offset: t.info_offset,
                    data_offset: rel,
                    alignment,
                });
            }
            let start = data_offset.checked_add(rel);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_size => t.offset = s,
                _ => {
                    return Err(GgufError::TensorPastEof {
                        file: file.to_owned(),
                        tensor: t.name.clone(),
                        offset: t.info_offset,
                        end: end.unwrap_or(u64::MAX),
                        file_size,
                    })
                }
            }
        }

        // Overlaps: sort non-empty ranges by start; each must end before the next begins.
        let mut order: Vec<usize> = (0..tensors.len())
            .filter(|&i| tensors[i].n_bytes > 0)
            .collect();
        order.sort_by_key(|&i| (tensors[i].offset, tensors[i].info_offset));
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if b.offset < a.offset + a.n_bytes {
                // Name the later record as the culprit.
                let (x, y) = if a.info_offset > b.info_offset {
                    (a, b)
                } else {
                    (b, a)
                };
                return Err(GgufError::TensorOverlap {
                    file: file.to_owned(),
                    tensor: x.name.clone(),
                    offset: x.info_offset,
                    start: x.offset,
                    end: x.offset + x.n_bytes,
                    other: y.name.clone(),
                    other_start: y.offset,
                    other_end: y.offset + y.n_bytes,
                });
            }
        }

        Ok(Parsed {
            version,
            alignment,
            data_offset,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    /// The rest of a tensor info after its name; returns the info (offset not yet resolved)
    /// and the stored offset relative to the data section.
    fn tensor_info(&mut self, name: &str, rec: u64) -> Result<(TensorInfo, u64), GgufError> {
        let file = self.file;
        let what = |field: &str| format!("tensor {name} (info at byte {rec}): {field}");
        let n_dims = self.u32().map_err(|s| self.eof(s, || what("n_dims")))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadDimCount {
                file: file.to_owned(),
                tensor: name.to_owned(),
                offset: rec,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(
                self.u64()
                    .map_err(|s| self.eof(s, || what(&format!("dim {d}"))))?,
            );
        }
        let type_id = self.u32().map_err(|s| self.eof(s, || what("ggml type")))?;
        let rel = self.u64().map_err(|s| self.eof(s, || what("offset")))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownGgmlType {
            file: file.to_owned(),
            tensor: name.to_owned(),
            offset: rec,
            type_id,
        })?;
        let overflow = || GgufError::DimsOverflow {
            file: file.to_owned(),
            tensor: name.to_owned(),
            offset: rec,
            dims: dims.clone(),
        };
        // ggml stores dims and sizes as int64: keep each dim, the product and the byte count
        // below 2^63 (a zero dim must not hide a huge one).
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| {
                acc.checked_mul(d).filter(|_| d <= i64::MAX as u64)
            })
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(overflow)?;
        let block = ty.block_elems();
        if dims[0] % block != 0 {
            return Err(GgufError::RowNotWholeBlocks {
                file: file.to_owned(),
                tensor: name.to_owned(),
                offset: rec,
                ne0: dims[0],
                ty,
                block,
            });
        }
        let n_bytes = (n_elements / block)
            .checked_mul(ty.block_bytes())
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(overflow)?;
        let info = TensorInfo {
            name: name.to_owned(),
            dims,
            ty,
            offset: 0,
            n_bytes,
            n_elements,
            info_offset: rec,
        };
        Ok((info, rel))
    }

    fn value_type(&mut self, ctx: Ctx) -> Result<ValueType, GgufError> {
        let at = self.pos as u64;
        let id = self.u32().map_err(|s| {
            self.eof(s, || {
                format!(
                    "metadata key {} (record at byte {}): value type",
                    ctx.key, ctx.rec
                )
            })
        })?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            file: self.file.to_owned(),
            key: ctx.key.to_owned(),
            offset: ctx.rec,
            type_id: id,
            at,
        })
    }

    fn short_value(&self, s: Short, ctx: Ctx) -> GgufError {
        self.eof(s, || {
            format!(
                "metadata key {} (record at byte {}): value",
                ctx.key, ctx.rec
            )
        })
    }

    fn bool(&self, byte: u8, at: u64, ctx: Ctx) -> Result<bool, GgufError> {
        match byte {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(GgufError::InvalidBool {
                file: self.file.to_owned(),
                key: ctx.key.to_owned(),
                offset: ctx.rec,
                byte,
                at,
            }),
        }
    }

    /// A value of type `ty`; `depth` is how many arrays enclose it.
    fn value(&mut self, ty: ValueType, ctx: Ctx, depth: usize) -> Result<Value, GgufError> {
        macro_rules! scalar {
            ($t:ty, $v:ident) => {{
                let a = self.arr().map_err(|s| self.short_value(s, ctx))?;
                Value::$v(<$t>::from_le_bytes(a))
            }};
        }
        Ok(match ty {
            ValueType::U8 => scalar!(u8, U8),
            ValueType::I8 => scalar!(i8, I8),
            ValueType::U16 => scalar!(u16, U16),
            ValueType::I16 => scalar!(i16, I16),
            ValueType::U32 => scalar!(u32, U32),
            ValueType::I32 => scalar!(i32, I32),
            ValueType::U64 => scalar!(u64, U64),
            ValueType::I64 => scalar!(i64, I64),
            ValueType::F32 => scalar!(f32, F32),
            ValueType::F64 => scalar!(f64, F64),
            ValueType::Bool => {
                let at = self.pos as u64;
                let [b] = self.arr().map_err(|s| self.short_value(s, ctx))?;
                Value::Bool(self.bool(b, at, ctx)?)
            }
            ValueType::String => Value::String(
                self.string(&|| format!("metadata key {} (record at byte {})", ctx.key, ctx.rec))?
                    .to_owned(),
            ),
            ValueType::Array => Value::Array(self.array(ctx, depth + 1)?),
        })
    }

    /// An array (element type, count, elements); `depth` counts this array.
    fn array(&mut self, ctx: Ctx, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                file: self.file.to_owned(),
                key: ctx.key.to_owned(),
                offset: ctx.rec,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let ty = self.value_type(ctx)?;
        let n = self.count(ty.min_encoded_len(), &|| {
            format!(
                "metadata key {} (record at byte {}): array length",
                ctx.key, ctx.rec
            )
        })?;
        macro_rules! fixed {
            ($t:ty, $v:ident) => {{
                const W: usize = std::mem::size_of::<$t>();
                // `count` checked that n * W bytes remain.
                let raw = self
                    .take(n * W as u64)
                    .map_err(|s| self.short_value(s, ctx))?;
                Array::$v(
                    raw.chunks_exact(W)
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or([0; W])))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            ValueType::U8 => fixed!(u8, U8),
            ValueType::I8 => fixed!(i8, I8),
            ValueType::U16 => fixed!(u16, U16),
            ValueType::I16 => fixed!(i16, I16),
            ValueType::U32 => fixed!(u32, U32),
            ValueType::I32 => fixed!(i32, I32),
            ValueType::U64 => fixed!(u64, U64),
            ValueType::I64 => fixed!(i64, I64),
            ValueType::F32 => fixed!(f32, F32),
            ValueType::F64 => fixed!(f64, F64),
            ValueType::Bool => {
                let at = self.pos as u64;
                let raw = self.take(n).map_err(|s| self.short_value(s, ctx))?;
                let mut v = Vec::with_capacity(raw.len());
                for (i, &b) in raw.iter().enumerate() {
                    v.push(self.bool(b, at + i as u64, ctx)?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut a = StringArray::with_capacity(n as usize, 0);
                for i in 0..n {
                    a.push(self.string(&|| {
                        format!(
                            "metadata key {} (record at byte {}): element {i}",
                            ctx.key, ctx.rec
                        )
                    })?);
                }
                Array::String(a)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.array(ctx, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}
