//! Ahead-of-time kernel compilation into the disk cache (`ds4 kernels`), for a GPU that need not
//! be present: a container image or a build box fills the cache once, and the GPU machine's
//! first start then loads every module instead of compiling it (~60 s on a fresh H200 box).
//! The cache key holds the compiler's version, so the cache only hits where the GPU machine's
//! NVRTC/hipRTC has the same major.minor as the one used here.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::cache::{cache_key, compile_cached, entry_ext, entry_name, Origin};
use crate::compiler::{cuda_arch, cuda_defines, hip_default_warp, hip_defines, Compiler};
use crate::error::{GpuError, Result};
use crate::{Hiprtc, Nvrtc};

/// A compilation target as the runtime would see the device: arch string and defines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `sm_90a`, `sm_80`, `gfx90a`, … (NVIDIA archs normalised the way the runtime names them).
    pub arch: String,
    pub defines: Vec<(String, String)>,
    /// Which compiler builds it.
    pub nvidia: bool,
}

impl Target {
    /// Parse `sm_XY[a]` / `sm_XYZ` (compute capability X.Y, warp 32) or `gfxNNN[:features]`
    /// (wavefront 64 on gfx9 and older, 32 on RDNA; `warp` overrides).
    pub fn parse(s: &str, warp: Option<u32>) -> Result<Target> {
        let bad = || {
            GpuError::Invalid(format!(
            "kernel target `{s}`: expected sm_XY (e.g. sm_80, sm_90a, sm_100) or gfxNNN (e.g. gfx90a, gfx1100)"
        ))
        };
        if let Some(d) = s.strip_prefix("sm_") {
            let n: u32 = d.trim_end_matches('a').parse().map_err(|_| bad())?;
            if !(30..=199).contains(&n) {
                return Err(bad());
            }
            let (major, minor) = (n / 10, n % 10);
            return Ok(Target {
                arch: cuda_arch(major, minor),
                defines: cuda_defines(major, minor, warp.unwrap_or(32)),
                nvidia: true,
            });
        }
        if s.starts_with("gfx") && s.len() > 3 {
            return Ok(Target {
                arch: s.to_string(),
                defines: hip_defines(s, warp.unwrap_or_else(|| hip_default_warp(s))),
                nvidia: false,
            });
        }
        Err(bad())
    }
}

/// One module's outcome.
#[derive(Debug)]
pub struct Compiled {
    pub module: &'static str,
    pub origin: Origin,
    pub bytes: usize,
    pub secs: f64,
}

/// What [`precompile`] did.
#[derive(Debug)]
pub struct Report {
    /// Compiler name and version (part of the cache key).
    pub compiler: String,
    pub compiler_path: PathBuf,
    pub modules: Vec<Compiled>,
    /// Stale entries of this target removed (with `prune`).
    pub pruned: Vec<PathBuf>,
}

/// Compile every module of `ds4_kernels::MODULES` (or those named in `only`) for `target` into
/// `dir` (modules already cached are left as they are), in parallel. With `prune`, also delete
/// this target's entries in `dir` that the current sources no longer produce.
pub fn precompile(target: &Target, dir: &Path, prune: bool, only: &[String]) -> Result<Report> {
    use rayon::prelude::*;
    let compiler: Box<dyn Compiler> = if target.nvidia {
        Box::new(Nvrtc::load()?)
    } else {
        Box::new(Hiprtc::load()?)
    };
    let c = compiler.as_ref();
    std::fs::create_dir_all(dir).map_err(|source| GpuError::Cache {
        path: dir.to_path_buf(),
        source,
    })?;
    if let Some(bad) = only
        .iter()
        .find(|o| !ds4_kernels::MODULES.iter().any(|m| m.name == o.as_str()))
    {
        let names: Vec<&str> = ds4_kernels::MODULES.iter().map(|m| m.name).collect();
        return Err(GpuError::Invalid(format!(
            "no kernel module `{bad}` (modules: {})",
            names.join(", ")
        )));
    }
    let results: Vec<Result<Compiled>> = ds4_kernels::MODULES
        .par_iter()
        .filter(|m| only.is_empty() || only.iter().any(|o| o == m.name))
        .map(|m| {
            let t = Instant::now();
            let (code, origin) = compile_cached(c, m, &target.arch, &target.defines, Some(dir))?;
            Ok(Compiled {
                module: m.name,
                origin,
                bytes: code.len(),
                secs: t.elapsed().as_secs_f64(),
            })
        })
        .collect();
    let modules = results.into_iter().collect::<Result<Vec<_>>>()?;
    let mut pruned = Vec::new();
    if prune {
        let ext = entry_ext(target.nvidia);
        // Entries from before the seal (a bare code object) are no longer read: removed too.
        let old_ext = if target.nvidia { "cubin" } else { "hsaco" };
        let keep: Vec<String> = ds4_kernels::MODULES
            .iter()
            .map(|m| {
                let key = cache_key(m, &target.arch, &target.defines, &c.version());
                entry_name(m.name, &target.arch, &key, target.nvidia)
            })
            .collect();
        let rd = std::fs::read_dir(dir).map_err(|source| GpuError::Cache {
            path: dir.to_path_buf(),
            source,
        })?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = ds4_kernels::MODULES
                .iter()
                .any(|m| name.starts_with(&format!("{}-{}-", m.name, target.arch)))
                && (name.ends_with(&format!(".{ext}")) || name.ends_with(&format!(".{old_ext}")));
            if ours && !keep.contains(&name) && std::fs::remove_file(e.path()).is_ok() {
                pruned.push(e.path());
            }
        }
    }
    Ok(Report {
        compiler: c.version(),
        compiler_path: c.path(),
        modules,
        pruned,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets() {
        let t = Target::parse("sm_90", None).unwrap();
        assert_eq!(t.arch, "sm_90a");
        assert!(t.nvidia);
        assert!(t.defines.contains(&("DS4_ARCH".into(), "900".into())));
        assert_eq!(Target::parse("sm_80", None).unwrap().arch, "sm_80");
        assert_eq!(Target::parse("sm_100a", None).unwrap().arch, "sm_100a");
        let g = Target::parse("gfx90a", None).unwrap();
        assert!(!g.nvidia);
        assert!(g.defines.contains(&("DS4_WARP".into(), "64".into())));
        let r = Target::parse("gfx1100", None).unwrap();
        assert!(r.defines.contains(&("DS4_WARP".into(), "32".into())));
        for bad in ["", "sm_", "sm_x", "sm_9", "gfx", "cuda"] {
            let e = Target::parse(bad, None).unwrap_err().to_string();
            assert!(e.contains("kernel target"), "{bad}: {e}");
        }
    }
}
