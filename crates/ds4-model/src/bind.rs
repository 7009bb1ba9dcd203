//! Weight binding: check every tensor of a file against the schedule of `tensors.rs` and build
//! the weight directory (name → byte range + type) that backends receive. Backends never parse
//! GGUF; they only see `WeightRef`s.

use crate::hparams::HParams;
use crate::tensors::{main_tensors, mtp_tensors, Family, TensorSpec};
use ds4_gguf::{GgmlType, GgufFile};
use std::collections::HashMap;
use std::fmt;

/// Where one weight tensor lives in a mapped file.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightRef {
    pub name: String,
    pub ty: GgmlType,
    /// GGUF dims, ne0 first.
    pub dims: Vec<u64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub n_bytes: u64,
    pub family: Family,
}

/// All problems found while binding, each on its own line in the form
/// `tensor blk.7.attn_q_b.weight: expected Q8_0 [1024, 32768], found F16 [1024, 32768]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BindError {
    pub source: String,
    pub problems: Vec<String>,
}

impl fmt::Display for BindError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} tensor problem{}:",
            self.source,
            self.problems.len(),
            if self.problems.len() == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for BindError {}

/// The bound weights of one file.
#[derive(Clone, Debug)]
pub struct WeightDir {
    pub tensors: Vec<WeightRef>,
    index: HashMap<String, usize>,
    /// Tensors in the file that the schedule does not use (reported, not fatal).
    pub ignored: Vec<String>,
}

impl WeightDir {
    pub fn get(&self, name: &str) -> Option<&WeightRef> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

fn fmt_dims(d: &[u64]) -> String {
    let parts: Vec<String> = d.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn fmt_types(ts: &[GgmlType]) -> String {
    let parts: Vec<&str> = ts.iter().map(|t| t.name()).collect();
    parts.join(" or ")
}

/// What a file holds under one name, as binding needs it (abstracted for tests).
pub struct Found {
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub offset: u64,
    pub n_bytes: u64,
}

/// Check `specs` against a lookup of the file's tensors; `all_names` are every tensor name in
/// the file (to report the unused ones). Pure logic, shared by main and MTP binding.
pub fn bind_specs<'a>(
    source: &str,
    specs: &[TensorSpec],
    lookup: impl Fn(&str) -> Option<Found>,
    all_names: impl Iterator<Item = &'a str>,
    optional_ignored: impl Fn(&str) -> bool,
) -> Result<WeightDir, BindError> {
    let mut problems = Vec::new();
    let mut tensors = Vec::with_capacity(specs.len());
    for spec in specs {
        let Some(f) = lookup(&spec.name) else {
            let published = spec.family.accepted()[0];
            problems.push(format!(
                "tensor {}: missing (expected {} {})",
                spec.name,
                fmt_types(&[published]),
                fmt_dims(&spec.dims)
            ));
            continue;
        };
        let accepted = spec.family.accepted();
        if !accepted.contains(&f.ty) || f.dims != spec.dims {
            problems.push(format!(
                "tensor {}: expected {} {}, found {} {}",
                spec.name,
                fmt_types(accepted),
                fmt_dims(&spec.dims),
                f.ty,
                fmt_dims(&f.dims)
            ));
            continue;
        }
        tensors.push(WeightRef {
            name: spec.name.clone(),
            ty: f.ty,
            dims: f.dims,
            offset: f.offset,
            n_bytes: f.n_bytes,
            family: spec.family,
        });
    }
    let index: HashMap<String, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    // Routed gate and up of one block are read by one fused kernel: same type required.
    for t in &tensors {
        if let Some(prefix) = t.name.strip_suffix("ffn_gate_exps.weight") {
            if let Some(up) = index
                .get(&format!("{prefix}ffn_up_exps.weight"))
                .map(|&i| &tensors[i])
            {
                if up.ty != t.ty {
                    problems.push(format!(
                        "tensor {}: type {} differs from {} type {} (gate and up must match)",
                        up.name, up.ty, t.name, t.ty
                    ));
                }
            }
        }
    }
    let mut ignored = Vec::new();
    for name in all_names {
        if index.contains_key(name) || specs.iter().any(|s| s.name == name) {
            continue;
        }
        if optional_ignored(name) {
            ignored.push(name.to_string());
        } else {
            problems.push(format!("tensor {name}: not part of the DeepSeek V4 layout"));
        }
    }
    if problems.is_empty() {
        Ok(WeightDir {
            tensors,
            index,
            ignored,
        })
    } else {
        Err(BindError {
            source: source.to_string(),
            problems,
        })
    }
}

fn lookup_in(file: &GgufFile) -> impl Fn(&str) -> Option<Found> + '_ {
    move |name| {
        file.tensor(name).map(|t| Found {
            ty: t.ty,
            dims: t.dims.clone(),
            offset: t.offset,
            n_bytes: t.n_bytes,
        })
    }
}

/// Bind the main model file. `exp_probs_b` in hash layers is tolerated and ignored (ds4 does the
/// same: the checkpoint has no gate bias there, some converters write one anyway).
pub fn bind_main(file: &GgufFile, hp: &HParams) -> Result<WeightDir, BindError> {
    let specs = main_tensors(hp);
    let hash_bias: Vec<String> = (0..hp.n_hash_layer)
        .map(|l| format!("blk.{l}.exp_probs_b.bias"))
        .collect();
    bind_specs(
        file.name(),
        &specs,
        lookup_in(file),
        file.tensors().iter().map(|t| t.name.as_str()),
        |n| hash_bias.iter().any(|h| h == n),
    )
}

/// Bind an MTP file (model.md §2.5). Its HC mixers and router may be F16 or F32.
pub fn bind_mtp(file: &GgufFile, hp: &HParams) -> Result<WeightDir, BindError> {
    bind_specs(
        file.name(),
        &mtp_tensors(hp),
        lookup_in(file),
        file.tensors().iter().map(|t| t.name.as_str()),
        |_| false,
    )
}
