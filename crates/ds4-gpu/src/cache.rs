//! On-disk cache of compiled code objects. Key: SHA-256 over the module name and source, every
//! header, the arch, the sorted defines and the compiler's name and version. Location:
//! `$DS4_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ds4/kernels`, else `~/.cache/ds4/kernels`.
//! Entries are written to a temporary file and renamed, so concurrent writers are safe.

use std::path::{Path, PathBuf};

use ds4_kernels::{Module, HEADERS};
use sha2::{Digest, Sha256};

use crate::compiler::Compiler;
use crate::error::{GpuError, Result};

/// The cache folder (not created here). `None` when no location can be derived (no HOME).
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("DS4_KERNEL_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("ds4/kernels")))
        .or_else(|| env("HOME").map(|p| p.join(".cache/ds4/kernels")))
}

/// Hex cache key of one compilation.
pub fn cache_key(
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    compiler: &str,
) -> String {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(module.name.as_bytes());
    field(module.source.as_bytes());
    for (n, t) in HEADERS {
        field(n.as_bytes());
        field(t.as_bytes());
    }
    field(arch.as_bytes());
    let mut d: Vec<_> = defines.to_vec();
    d.sort();
    for (k, v) in &d {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    field(compiler.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Where a compilation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Compiled,
    Cache,
}

/// Return the code object for `module`, from `dir` when present, else compiled (and stored in
/// `dir` when given). A cache that cannot be written is not an error; one that holds an empty
/// file is recompiled.
pub fn compile_cached(
    compiler: &dyn Compiler,
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    dir: Option<&Path>,
) -> Result<(Vec<u8>, Origin)> {
    let key = cache_key(module, arch, defines, &compiler.version());
    let ext = if compiler.name() == "nvrtc" {
        "cubin"
    } else {
        "hsaco"
    };
    let path = dir.map(|d| d.join(format!("{}-{arch}-{key}.{ext}", module.name)));
    if let Some(p) = &path {
        if let Ok(code) = std::fs::read(p) {
            if !code.is_empty() {
                return Ok((code, Origin::Cache));
            }
        }
    }
    let code = compiler.compile(module, arch, defines)?;
    if let (Some(p), Some(d)) = (&path, dir) {
        let _ = store(d, p, &code);
    }
    Ok((code, Origin::Compiled))
}

fn store(dir: &Path, path: &Path, code: &[u8]) -> Result<()> {
    let err = |source| GpuError::Cache {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, code).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}
