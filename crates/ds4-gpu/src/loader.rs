//! Finding and opening vendor libraries with `dlopen` (libloading). Search order for a library:
//! an explicit override variable, `$CUDA_HOME`/`$CUDA_PATH` or `$ROCM_PATH` (and /usr/local/cuda,
//! /opt/rocm), pip-installed NVIDIA wheels (`site-packages/nvidia/*/lib`), then the system
//! loader's own paths (bare soname). A failure lists every candidate tried.

use std::path::{Path, PathBuf};

use libloading::Library;

use crate::error::{GpuError, Result};

/// An opened library and where it came from.
pub struct Lib {
    pub what: &'static str,
    pub path: PathBuf,
    pub lib: Library,
}

impl Lib {
    /// Resolve `name` as a C function pointer of type `T` (a `unsafe extern "C" fn`).
    ///
    /// # Safety
    /// `T` must be the symbol's true signature.
    pub unsafe fn sym<T: Copy>(&self, name: &str) -> Result<T> {
        let s: libloading::Symbol<T> =
            self.lib
                .get(name.as_bytes())
                .map_err(|_| GpuError::MissingSymbol {
                    library: self.what,
                    path: self.path.clone(),
                    symbol: name.to_string(),
                })?;
        Ok(*s)
    }

    /// Like [`Lib::sym`] but the first of several names that exists (versioned entry points).
    ///
    /// # Safety
    /// `T` must be the true signature of every name.
    pub unsafe fn sym_any<T: Copy>(&self, names: &[&str]) -> Result<T> {
        for n in names {
            if let Ok(s) = self.sym::<T>(n) {
                return Ok(s);
            }
        }
        Err(GpuError::MissingSymbol {
            library: self.what,
            path: self.path.clone(),
            symbol: names.join(" | "),
        })
    }
}

/// Python site-packages folders that may hold NVIDIA wheels: `$DS4_PYTHON_SITE`, the active
/// virtualenv, pyenv versions, the user and system folders, and what `python3` reports.
pub fn site_packages() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("DS4_PYTHON_SITE") {
        out.extend(std::env::split_paths(&v));
    }
    let mut globs: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        globs.push(PathBuf::from(v).join("lib"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        let h = PathBuf::from(h);
        globs.push(h.join(".local/lib"));
        if let Ok(rd) = std::fs::read_dir(h.join(".pyenv/versions")) {
            globs.extend(rd.flatten().map(|e| e.path().join("lib")));
        }
    }
    globs.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    for base in globs {
        if let Ok(rd) = std::fs::read_dir(&base) {
            for e in rd.flatten() {
                let n = e.file_name();
                if n.to_string_lossy().starts_with("python3") {
                    out.push(e.path().join("site-packages"));
                    out.push(e.path().join("dist-packages"));
                }
            }
        }
    }
    // The interpreter on PATH knows its own folders (a venv we could not guess, e.g. /opt/*).
    if let Ok(o) = std::process::Command::new("python3")
        .args(["-c", "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))"])
        .stderr(std::process::Stdio::null())
        .output()
    {
        if o.status.success() {
            out.extend(String::from_utf8_lossy(&o.stdout).lines().map(PathBuf::from));
        }
    }
    let mut seen = Vec::new();
    out.retain(|p| {
        p.is_dir() && !seen.contains(p) && {
            seen.push(p.clone());
            true
        }
    });
    out
}

/// `site/nvidia/*/lib` folders (CUDA 12 wheels use `nvidia/<component>/lib`, CUDA 13 wheels
/// `nvidia/cu13/lib`).
pub fn nvidia_wheel_lib_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for site in site_packages() {
        if let Ok(rd) = std::fs::read_dir(site.join("nvidia")) {
            let mut dirs: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path().join("lib"))
                .filter(|p| p.is_dir())
                .collect();
            dirs.sort();
            out.extend(dirs);
        }
    }
    out
}

/// Try every `dir/name` (dirs in order), and each bare `name` through the system loader (first
/// when `system_first`, e.g. for the driver, which must match the kernel module; else last).
/// `what` names the library in messages.
pub fn open(
    what: &'static str,
    names: &[&str],
    dirs: &[PathBuf],
    system_first: bool,
) -> Result<Lib> {
    let mut searched = Vec::new();
    if system_first {
        if let Some(lib) = open_system(what, names, &mut searched) {
            return Ok(lib);
        }
    }
    for d in dirs {
        for n in names {
            let p = d.join(n);
            if !p.exists() {
                searched.push(format!("{} (absent)", p.display()));
                continue;
            }
            match unsafe { Library::new(&p) } {
                Ok(lib) => return Ok(Lib { what, path: p, lib }),
                Err(e) => searched.push(format!("{}: {e}", p.display())),
            }
        }
    }
    if !system_first {
        if let Some(lib) = open_system(what, names, &mut searched) {
            return Ok(lib);
        }
    }
    Err(GpuError::LibraryNotFound {
        what,
        names: names.iter().map(|s| s.to_string()).collect(),
        searched,
    })
}

fn open_system(what: &'static str, names: &[&str], searched: &mut Vec<String>) -> Option<Lib> {
    for n in names {
        match unsafe { Library::new(n) } {
            Ok(lib) => {
                return Some(Lib {
                    what,
                    path: PathBuf::from(n),
                    lib,
                })
            }
            Err(e) => searched.push(format!(
                "{n} (system loader: LD_LIBRARY_PATH, ld.so.cache, /lib, /usr/lib): {e}"
            )),
        }
    }
    None
}

fn env_dir(var: &str, sub: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(|v| Path::new(&v).join(sub))
}

/// Folders for CUDA libraries: `$CUDA_HOME`, `$CUDA_PATH`, /usr/local/cuda (lib64, lib), the
/// NVIDIA wheels, and the driver's usual places (/usr/local/nvidia/lib64 in containers).
pub fn cuda_dirs() -> Vec<PathBuf> {
    let mut d = Vec::new();
    for v in ["CUDA_HOME", "CUDA_PATH"] {
        d.extend(env_dir(v, "lib64"));
        d.extend(env_dir(v, "lib"));
    }
    d.push(PathBuf::from("/usr/local/cuda/lib64"));
    d.extend(nvidia_wheel_lib_dirs());
    d.push(PathBuf::from("/usr/local/nvidia/lib64"));
    d.retain(|p| p.is_dir());
    d
}

/// Folders for ROCm libraries: `$ROCM_PATH`, `$HIP_PATH`, /opt/rocm (lib).
pub fn rocm_dirs() -> Vec<PathBuf> {
    let mut d = Vec::new();
    for v in ["ROCM_PATH", "HIP_PATH"] {
        d.extend(env_dir(v, "lib"));
    }
    d.push(PathBuf::from("/opt/rocm/lib"));
    d.retain(|p| p.is_dir());
    d
}

/// An explicit file named by an environment variable comes first when set.
pub fn with_override(var: &str, dirs: Vec<PathBuf>, names: &mut Vec<String>) -> Vec<PathBuf> {
    if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if let (Some(parent), Some(file)) = (p.parent(), p.file_name()) {
            names.insert(0, file.to_string_lossy().into_owned());
            let mut d = vec![parent.to_path_buf()];
            d.extend(dirs);
            return d;
        }
    }
    dirs
}
