//! GGUF files as a metadata source for hyper-parameters, and the tokenizer arrays they carry.

use crate::hparams::MetaSource;
use ds4_gguf::{GgufError, GgufFile};

/// Absent key → `Ok(None)`; present with a wrong type → the reader's message (key, expected,
/// found, byte offset).
fn opt<T>(
    f: &GgufFile,
    key: &str,
    get: impl FnOnce(&GgufFile) -> Result<T, GgufError>,
) -> Result<Option<T>, String> {
    if f.get(key).is_none() {
        return Ok(None);
    }
    get(f).map(Some).map_err(|e| e.to_string())
}

impl MetaSource for GgufFile {
    fn source_name(&self) -> String {
        self.name().to_string()
    }
    fn u32(&self, key: &str) -> Result<Option<u32>, String> {
        opt(self, key, |f| f.require_u32(key))
    }
    fn u64(&self, key: &str) -> Result<Option<u64>, String> {
        opt(self, key, |f| f.require_u64(key))
    }
    fn f32(&self, key: &str) -> Result<Option<f32>, String> {
        opt(self, key, |f| f.require_f32(key))
    }
    fn bool(&self, key: &str) -> Result<Option<bool>, String> {
        opt(self, key, |f| f.require_bool(key))
    }
    fn str(&self, key: &str) -> Result<Option<String>, String> {
        opt(self, key, |f| f.require_str(key).map(str::to_string))
    }
    fn u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, String> {
        opt(self, key, |f| f.require_u32_array(key))
    }
    fn f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, String> {
        opt(self, key, |f| f.require_f32_array(key))
    }
}

/// `tokenizer.ggml.tokens` and `tokenizer.ggml.merges` (merges may be absent: a byte-level
/// vocabulary without merges is valid).
pub fn vocab(f: &GgufFile) -> Result<(Vec<String>, Vec<String>), GgufError> {
    let tokens = f.require_strings("tokenizer.ggml.tokens")?.to_vec();
    let merges = match f.get("tokenizer.ggml.merges") {
        None => Vec::new(),
        Some(_) => f.require_strings("tokenizer.ggml.merges")?.to_vec(),
    };
    Ok((tokens, merges))
}
