//! On-disk cache of compiled code objects. Key: SHA-256 over the module name and source, every
//! header, the arch, the sorted defines and the compiler's name and version. Location:
//! `$DS4_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ds4/kernels`, else `~/.cache/ds4/kernels`.
//! Entries are written to a temporary file and renamed, so concurrent writers are safe. Each
//! entry is the code object followed by its SHA-256 and a magic ([`seal`]): a damaged,
//! truncated or foreign file is compiled again and replaced, never handed to the driver; a
//! sound entry that the driver still refuses is compiled again once ([`load_or_rebuild`]).

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

/// The last bytes of a cache entry (after the code's SHA-256): format 1.
const MAGIC: &[u8; 8] = b"ds4kc\x001\n";

/// File-name suffix of entries for NVRTC (`nvidia`) or hipRTC (`cubin` / `hsaco` before the seal: such
/// files are no longer read, and `ds4 kernels --prune` removes them).
pub fn entry_ext(nvidia: bool) -> &'static str {
    if nvidia {
        "cubin.ds4"
    } else {
        "hsaco.ds4"
    }
}

/// A cache entry's file name.
pub fn entry_name(module: &str, arch: &str, key: &str, nvidia: bool) -> String {
    format!("{module}-{arch}-{key}.{}", entry_ext(nvidia))
}

/// A cache entry's bytes: `code`, its SHA-256, [`MAGIC`].
pub fn seal(code: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(code.len() + 40);
    out.extend_from_slice(code);
    out.extend_from_slice(&Sha256::digest(code));
    out.extend_from_slice(MAGIC);
    out
}

/// The code object in a cache entry's bytes; None where they are not a sound entry (too
/// short, another format, or a checksum that does not match: damaged or truncated).
pub fn unseal(entry: &[u8]) -> Option<&[u8]> {
    let body = entry.strip_suffix(MAGIC)?;
    let (code, sum) = body.split_at_checked(body.len().checked_sub(32)?)?;
    (!code.is_empty() && Sha256::digest(code).as_slice() == sum).then_some(code)
}

/// Return the code object for `module`, from `dir` when a sound entry is there, else compiled
/// (and stored in `dir` when given). A cache that cannot be written is not an error; an entry
/// that is empty, truncated or damaged is compiled again and replaced.
pub fn compile_cached(
    compiler: &dyn Compiler,
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    dir: Option<&Path>,
) -> Result<(Vec<u8>, Origin)> {
    let path = entry_path(compiler, module, arch, defines, dir);
    if let Some(mut entry) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        // The entry's own buffer, cut to the code object (no second copy).
        if let Some(n) = unseal(&entry).map(<[u8]>::len) {
            entry.truncate(n);
            return Ok((entry, Origin::Cache));
        }
    }
    Ok((
        compile_store(compiler, module, arch, defines, dir.zip(path.as_deref()))?,
        Origin::Compiled,
    ))
}

/// Compiles `module` (no cache lookup) and stores the result in `dir` when given, replacing
/// what was there: a cached object that the driver refused is rebuilt this way.
pub fn compile_fresh(
    compiler: &dyn Compiler,
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    dir: Option<&Path>,
) -> Result<Vec<u8>> {
    let path = entry_path(compiler, module, arch, defines, dir);
    compile_store(compiler, module, arch, defines, dir.zip(path.as_deref()))
}

/// Compiles `module` and, given `(dir, entry path)`, stores the sealed result there (a cache
/// that cannot be written is not an error).
fn compile_store(
    compiler: &dyn Compiler,
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    at: Option<(&Path, &Path)>,
) -> Result<Vec<u8>> {
    let code = compiler.compile(module, arch, defines)?;
    if let Some((d, p)) = at {
        let _ = store(d, p, &seal(&code));
    }
    Ok(code)
}

/// Where `module`'s entry for this compilation lives in `dir`.
fn entry_path(
    compiler: &dyn Compiler,
    module: &Module,
    arch: &str,
    defines: &[(String, String)],
    dir: Option<&Path>,
) -> Option<std::path::PathBuf> {
    let key = cache_key(module, arch, defines, &compiler.version());
    let nvidia = compiler.name() == "nvrtc";
    dir.map(|d| d.join(entry_name(module.name, arch, &key, nvidia)))
}

/// Loads a code object with `load`; where it came from the cache and the driver refuses it
/// (a driver older than the compiler, say), `rebuild` compiles it again (replacing the entry)
/// and that is loaded instead. `warn` hears about the retry. Returns what loaded and where
/// its code came from.
pub fn load_or_rebuild<T>(
    (code, origin): (Vec<u8>, Origin),
    mut load: impl FnMut(&[u8]) -> Result<T>,
    rebuild: impl FnOnce() -> Result<Vec<u8>>,
    warn: impl FnOnce(&GpuError),
) -> Result<(T, Origin)> {
    match load(&code) {
        Err(e) if origin == Origin::Cache => {
            warn(&e);
            Ok((load(&rebuild()?)?, Origin::Compiled))
        }
        r => Ok((r?, origin)),
    }
}

fn store(dir: &Path, path: &Path, entry: &[u8]) -> Result<()> {
    let err = |source| GpuError::Cache {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, entry).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}
