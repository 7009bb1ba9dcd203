//! GGUF v3 writer. The header (metadata + tensor infos) is built in memory; tensor data is
//! written by the caller at the offsets [`GgufWriter::layout`] returns, so huge files can be
//! filled in parallel with positioned writes, or by [`GgufWriter::write_to_path`] for small ones.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_ARRAY_DEPTH, MAX_DIMS,
};
use crate::value::{Array, Value};
use crate::GgmlType;

/// ggml's `GGML_MAX_NAME`: llama.cpp rejects tensor names of 64 bytes or more.
pub const MAX_TENSOR_NAME: usize = 63;

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    n_bytes: u64,
}

/// Where everything goes in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Everything before the data section, zero-padded to the alignment.
    pub header: Vec<u8>,
    /// Absolute offset of each tensor's data, in `add_tensor` order.
    pub offsets: Vec<u64>,
    /// Byte size of each tensor's data.
    pub sizes: Vec<u64>,
    /// File length: the end of the last tensor rounded up to the alignment.
    pub total_len: u64,
}

/// Collects metadata and tensor descriptions, then lays out a GGUF v3 file.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
    tensor_index: HashMap<String, usize>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` (replacing an earlier value in place, so order is first-set order).
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        let key = key.into();
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// The value set for `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Declares a tensor with GGUF-order `dims` (`dims[0]` = row length); returns its index.
    /// Checks the dims count (1–4), that the row is a whole number of `ty` blocks, that sizes fit
    /// in i64, and that the name is new, non-empty and shorter than 64 bytes.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
    ) -> Result<usize, GgufError> {
        let name = name.into();
        let bad = |reason: String| GgufError::write(format!("tensor {name}"), reason);
        if name.is_empty() || name.len() > MAX_TENSOR_NAME {
            return Err(bad(format!(
                "name is {} bytes, expected 1 to {MAX_TENSOR_NAME}",
                name.len()
            )));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(bad(format!(
                "{} dims, expected 1 to {MAX_DIMS}",
                dims.len()
            )));
        }
        if dims[0] % ty.block_elems() != 0 {
            return Err(bad(format!(
                "row length {} is not a multiple of the {ty} block size {}",
                dims[0],
                ty.block_elems()
            )));
        }
        let n_bytes = dims
            .iter()
            .try_fold(1u64, |a, &d| {
                a.checked_mul(d).filter(|_| d <= i64::MAX as u64)
            })
            .filter(|&n| n <= i64::MAX as u64)
            .and_then(|n| (n / ty.block_elems()).checked_mul(ty.block_bytes()))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("dims {dims:?} overflow")))?;
        if self.tensor_index.contains_key(&name) {
            return Err(bad("added twice".into()));
        }
        let index = self.tensors.len();
        self.tensor_index.insert(name.clone(), index);
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            n_bytes,
        });
        Ok(index)
    }

    /// Number of tensors added so far.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The data alignment: `general.alignment` if set (must be a power-of-two u32), else 32.
    pub fn alignment(&self) -> Result<u64, GgufError> {
        match self.get(ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok((*a).into()),
            Some(v) => Err(GgufError::write(
                ALIGNMENT_KEY,
                format!(
                    "is {} {v}; it must be a non-zero power of two u32",
                    v.type_name()
                ),
            )),
        }
    }

    /// Serialises the header and computes every tensor's offset. `general.alignment` is written
    /// (appended as u32 32 when not set).
    pub fn layout(&self) -> Result<Layout, GgufError> {
        let alignment = self.alignment()?;
        let mut h = Vec::with_capacity(4096);
        h.extend_from_slice(&GGUF_MAGIC);
        put_u32(&mut h, GGUF_VERSION);
        put_u64(&mut h, self.tensors.len() as u64);
        let add_alignment = self.get(ALIGNMENT_KEY).is_none();
        put_u64(
            &mut h,
            self.metadata.len() as u64 + u64::from(add_alignment),
        );
        for (key, value) in &self.metadata {
            put_str(&mut h, key);
            put_u32(&mut h, value.value_type().id());
            put_value(&mut h, value, key, 0)?;
        }
        if add_alignment {
            put_str(&mut h, ALIGNMENT_KEY);
            put_u32(&mut h, crate::ValueType::U32.id());
            put_u32(&mut h, DEFAULT_ALIGNMENT as u32);
        }
        // Offsets relative to the data section, each rounded up to the alignment.
        let mut rel = Vec::with_capacity(self.tensors.len());
        let mut cursor = 0u64;
        for t in &self.tensors {
            let start = cursor.div_ceil(alignment) * alignment;
            rel.push(start);
            cursor = start
                .checked_add(t.n_bytes)
                .ok_or_else(|| GgufError::write(format!("tensor {}", t.name), "file too large"))?;
        }
        for (t, &off) in self.tensors.iter().zip(&rel) {
            put_str(&mut h, &t.name);
            put_u32(&mut h, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut h, d);
            }
            put_u32(&mut h, t.ty.id());
            put_u64(&mut h, off);
        }
        let header_len = (h.len() as u64).div_ceil(alignment) * alignment;
        h.resize(header_len as usize, 0);
        let total_len = header_len
            .checked_add(cursor.div_ceil(alignment) * alignment)
            .ok_or_else(|| GgufError::write("file", "too large"))?;
        Ok(Layout {
            header: h,
            offsets: rel.iter().map(|r| header_len + r).collect(),
            sizes: self.tensors.iter().map(|t| t.n_bytes).collect(),
            total_len,
        })
    }

    /// Writes the whole file to `path` through a temporary file in the same directory that is
    /// renamed into place once complete (so `path` never holds a partial file). `fill(i, buf)`
    /// receives tensor `i`'s zeroed data buffer to fill. Errors from `fill` are returned as is
    /// and the temporary file is removed.
    pub fn write_to_path<E, F>(&self, path: impl AsRef<Path>, mut fill: F) -> Result<(), E>
    where
        F: FnMut(usize, &mut [u8]) -> Result<(), E>,
        E: From<GgufError>,
    {
        let path = path.as_ref();
        let layout = self.layout()?;
        let tmp = temp_path(path);
        let io = |file: &Path| {
            let file = file.display().to_string();
            move |source| GgufError::Io { file, source }
        };
        let result = (|| -> Result<(), E> {
            let f = File::create(&tmp).map_err(io(&tmp))?;
            let mut w = BufWriter::with_capacity(1 << 20, &f);
            w.write_all(&layout.header).map_err(io(&tmp))?;
            let mut pos = layout.header.len() as u64;
            let mut buf = Vec::new();
            for (i, (&off, &size)) in layout.offsets.iter().zip(&layout.sizes).enumerate() {
                write_zeros(&mut w, off - pos).map_err(io(&tmp))?;
                let size = usize::try_from(size).map_err(|_| {
                    GgufError::write(format!("tensor {}", self.tensors[i].name), "too large")
                })?;
                buf.clear();
                buf.resize(size, 0);
                fill(i, &mut buf)?;
                w.write_all(&buf).map_err(io(&tmp))?;
                pos = off + size as u64;
            }
            write_zeros(&mut w, layout.total_len - pos).map_err(io(&tmp))?;
            w.flush().map_err(io(&tmp))?;
            drop(w);
            f.sync_all().map_err(io(&tmp))?;
            std::fs::rename(&tmp, path).map_err(io(path))?;
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// The whole file in memory (for tests and small fixtures); `fill` as in
    /// [`GgufWriter::write_to_path`].
    pub fn to_bytes<E, F>(&self, mut fill: F) -> Result<Vec<u8>, E>
    where
        F: FnMut(usize, &mut [u8]) -> Result<(), E>,
        E: From<GgufError>,
    {
        let layout = self.layout()?;
        let total = usize::try_from(layout.total_len)
            .map_err(|_| GgufError::write("file", "too large for memory"))?;
        let mut out = vec![0u8; total];
        out[..layout.header.len()].copy_from_slice(&layout.header);
        for (i, (&off, &size)) in layout.offsets.iter().zip(&layout.sizes).enumerate() {
            fill(i, &mut out[off as usize..(off + size) as usize])?;
        }
        Ok(out)
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "out.gguf".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn write_zeros(w: &mut impl Write, mut n: u64) -> std::io::Result<()> {
    const Z: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(Z.len() as u64) as usize;
        w.write_all(&Z[..k])?;
        n -= k as u64;
    }
    Ok(())
}

fn put_u32(h: &mut Vec<u8>, x: u32) {
    h.extend_from_slice(&x.to_le_bytes());
}

fn put_u64(h: &mut Vec<u8>, x: u64) {
    h.extend_from_slice(&x.to_le_bytes());
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    put_u64(h, s.len() as u64);
    h.extend_from_slice(s.as_bytes());
}

/// Value bytes (without the type id, which the caller writes).
fn put_value(h: &mut Vec<u8>, v: &Value, key: &str, depth: usize) -> Result<(), GgufError> {
    match v {
        Value::U8(x) => h.push(*x),
        Value::I8(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => h.push(u8::from(*x)),
        Value::String(s) => put_str(h, s),
        Value::Array(a) => put_array(h, a, key, depth + 1)?,
    }
    Ok(())
}

/// Array bytes: element type, count, elements. `depth` counts this array.
fn put_array(h: &mut Vec<u8>, a: &Array, key: &str, depth: usize) -> Result<(), GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::write(
            format!("metadata key {key}"),
            format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
        ));
    }
    put_u32(h, a.elem_type().id());
    put_u64(h, a.len() as u64);
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                h.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => h.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => h.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v.iter() {
                put_str(h, s);
            }
        }
        Array::Array(v) => {
            for inner in v {
                put_array(h, inner, key, depth + 1)?;
            }
        }
    }
    Ok(())
}
