//! Run-time kernel compilers: NVRTC (CUDA) and hipRTC (ROCm), loaded with `dlopen`. Neither
//! needs a GPU: both compile for a named arch, which is what the CI portability test uses.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use ds4_kernels::{Module, HEADERS};

use crate::error::{GpuError, Result};
use crate::loader::{self, Lib};

/// A kernel compiler for one vendor.
pub trait Compiler: Send + Sync {
    /// `"nvrtc"` or `"hiprtc"`.
    fn name(&self) -> &'static str;
    /// Version string, part of the kernel cache key.
    fn version(&self) -> String;
    /// Where the library was loaded from.
    fn path(&self) -> PathBuf;
    /// Compile `module` for `arch` (`sm_90a`, `gfx90a`) with `-D` defines; returns the code
    /// object (CUBIN for NVRTC, a HIP code object for hipRTC) that the runtime loads.
    fn compile(&self, module: &Module, arch: &str, defines: &[(String, String)])
        -> Result<Vec<u8>>;
}

type Prog = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type ErrStrFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The common shape of NVRTC and hipRTC (same signatures, different prefixes).
struct RtcApi {
    lib: Lib,
    name: &'static str,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    code_size: SizeFn,
    code: GetFn,
    destroy: DestroyFn,
    version: VersionFn,
    err: ErrStrFn,
    /// How the arch option is spelled.
    arch_flag: &'static str,
    extra_flags: &'static [&'static str],
}

unsafe impl Send for RtcApi {}
unsafe impl Sync for RtcApi {}

impl RtcApi {
    unsafe fn load(lib: Lib, p: &str, code_size: &str, code: &str) -> Result<RtcApiParts> {
        Ok(RtcApiParts {
            create: lib.sym(&format!("{p}CreateProgram"))?,
            compile: lib.sym(&format!("{p}CompileProgram"))?,
            log_size: lib.sym(&format!("{p}GetProgramLogSize"))?,
            log: lib.sym(&format!("{p}GetProgramLog"))?,
            code_size: lib.sym(code_size)?,
            code: lib.sym(code)?,
            destroy: lib.sym(&format!("{p}DestroyProgram"))?,
            version: lib.sym(&format!("{p}Version"))?,
            err: lib.sym(&format!("{p}GetErrorString"))?,
            lib,
        })
    }

    fn status(&self, code: c_int) -> String {
        let s = unsafe { (self.err)(code) };
        if s.is_null() {
            format!("status {code}")
        } else {
            format!(
                "{} ({code})",
                unsafe { CStr::from_ptr(s) }.to_string_lossy()
            )
        }
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(GpuError::Api {
            api: self.name,
            call,
            code: code as i64,
            name: self.status(code),
            message: String::new(),
        })
    }

    fn version_string(&self) -> String {
        let (mut a, mut b) = (0, 0);
        let r = unsafe { (self.version)(&mut a, &mut b) };
        if r == 0 {
            format!("{} {a}.{b}", self.name)
        } else {
            format!("{} (version unknown: {})", self.name, self.status(r))
        }
    }

    /// The code object and the compiler's log (ptxas notes with `--ptxas-options=-v` in `extra`).
    fn compile(
        &self,
        module: &Module,
        arch: &str,
        defines: &[(String, String)],
        extra: &[&str],
    ) -> Result<(Vec<u8>, String)> {
        let cstr =
            |s: &str| CString::new(s).map_err(|_| GpuError::Invalid(format!("NUL byte in {s:?}")));
        let src = cstr(module.source)?;
        let file = cstr(&format!("{}.cu", module.name))?;
        let hdr_src: Vec<CString> = HEADERS.iter().map(|h| cstr(h.1)).collect::<Result<_>>()?;
        let hdr_name: Vec<CString> = HEADERS.iter().map(|h| cstr(h.0)).collect::<Result<_>>()?;
        let hs: Vec<*const c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
        let hn: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
        let mut opts: Vec<CString> = vec![cstr(&format!("{}{arch}", self.arch_flag))?];
        for f in self.extra_flags {
            opts.push(cstr(f)?);
        }
        for (k, v) in defines {
            opts.push(cstr(&format!("-D{k}={v}"))?);
        }
        for f in extra {
            opts.push(cstr(f)?);
        }
        let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        unsafe {
            self.check(
                "CreateProgram",
                (self.create)(
                    &mut prog,
                    src.as_ptr(),
                    file.as_ptr(),
                    hs.len() as c_int,
                    hs.as_ptr(),
                    hn.as_ptr(),
                ),
            )?;
            let st = (self.compile)(prog, op.len() as c_int, op.as_ptr());
            let mut n = 0usize;
            let mut log = String::new();
            if (self.log_size)(prog, &mut n) == 0 && n > 1 {
                let mut buf = vec![0u8; n];
                if (self.log)(prog, buf.as_mut_ptr() as *mut c_char) == 0 {
                    log = String::from_utf8_lossy(&buf[..n - 1]).into_owned();
                }
            }
            if st != 0 {
                (self.destroy)(&mut prog);
                return Err(GpuError::Compile {
                    compiler: self.version_string(),
                    module: module.name.to_string(),
                    arch: arch.to_string(),
                    status: format!("{} with options {:?}", self.status(st), opts),
                    log,
                });
            }
            let mut sz = 0usize;
            let r = (self.code_size)(prog, &mut sz);
            if r != 0 {
                (self.destroy)(&mut prog);
                return self
                    .check("GetCodeSize", r)
                    .map(|_| (Vec::new(), String::new()));
            }
            let mut code = vec![0u8; sz];
            let r = (self.code)(prog, code.as_mut_ptr() as *mut c_char);
            (self.destroy)(&mut prog);
            self.check("GetCode", r)?;
            if code.is_empty() {
                return Err(GpuError::Compile {
                    compiler: self.version_string(),
                    module: module.name.to_string(),
                    arch: arch.to_string(),
                    status: "empty code object".into(),
                    log,
                });
            }
            Ok((code, log))
        }
    }
}

struct RtcApiParts {
    lib: Lib,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    code_size: SizeFn,
    code: GetFn,
    destroy: DestroyFn,
    version: VersionFn,
    err: ErrStrFn,
}

impl RtcApiParts {
    fn finish(
        self,
        name: &'static str,
        arch_flag: &'static str,
        extra_flags: &'static [&'static str],
    ) -> RtcApi {
        RtcApi {
            lib: self.lib,
            name,
            create: self.create,
            compile: self.compile,
            log_size: self.log_size,
            log: self.log,
            code_size: self.code_size,
            code: self.code,
            destroy: self.destroy,
            version: self.version,
            err: self.err,
            arch_flag,
            extra_flags,
        }
    }
}

/// NVRTC, compiling to CUBIN for a real arch (`sm_80`, `sm_90a`, `sm_100`).
pub struct Nvrtc(RtcApi);

impl Nvrtc {
    /// Load libnvrtc: `$DS4_NVRTC_LIB`, `$CUDA_HOME`, /usr/local/cuda, pip wheels
    /// (`nvidia-cuda-nvrtc`), then the system paths; CUDA 13 before 12.
    pub fn load() -> Result<Nvrtc> {
        let mut names: Vec<String> = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
            .map(String::from)
            .to_vec();
        let dirs = loader::with_override("DS4_NVRTC_LIB", loader::cuda_dirs(), &mut names);
        let n: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let lib = loader::open(
            "NVRTC (pip nvidia-cuda-nvrtc or the CUDA toolkit)",
            &n,
            &dirs,
            false,
        )?;
        let parts = unsafe { RtcApi::load(lib, "nvrtc", "nvrtcGetCUBINSize", "nvrtcGetCUBIN")? };
        Ok(Nvrtc(parts.finish(
            "nvrtc",
            "--gpu-architecture=",
            &["--std=c++17", "-lineinfo"],
        )))
    }
}

impl Compiler for Nvrtc {
    fn name(&self) -> &'static str {
        "nvrtc"
    }
    fn version(&self) -> String {
        self.0.version_string()
    }
    fn path(&self) -> PathBuf {
        self.0.lib.path.clone()
    }
    fn compile(
        &self,
        module: &Module,
        arch: &str,
        defines: &[(String, String)],
    ) -> Result<Vec<u8>> {
        self.0.compile(module, arch, defines, &[]).map(|r| r.0)
    }
}

impl Nvrtc {
    /// A compile with extra options, returning the log too: `--ptxas-options=-v` makes ptxas
    /// report each kernel's registers, spills and (sm_90a) wgmma serialisation, which the
    /// compile test checks without a GPU.
    pub fn compile_logged(
        &self,
        module: &Module,
        arch: &str,
        defines: &[(String, String)],
        extra: &[&str],
    ) -> Result<(Vec<u8>, String)> {
        self.0.compile(module, arch, defines, extra)
    }
}

/// hipRTC, compiling to a HIP code object for one `gfx` target.
pub struct Hiprtc {
    api: RtcApi,
    /// The `gfx` targets the code-object manager (libamd_comgr, which hipRTC compiles through)
    /// knows, when it could be asked. ROCm 5.2's hipRTC aborts the process (a bad free in
    /// comgr) on an unknown target, so targets are checked against this list first.
    targets: Option<Vec<String>>,
}

/// Ask libamd_comgr for its ISA names (`amdgcn-amd-amdhsa--gfx90a[:features]`) and return the
/// distinct `gfx` targets; `None` when comgr cannot be loaded or queried. Asked once per
/// process, and comgr stays loaded: unloading it and letting hipRTC load it again re-runs its
/// LLVM option registrations, which aborts ("Option ... registered more than once").
fn comgr_targets() -> Option<Vec<String>> {
    static TARGETS: std::sync::OnceLock<Option<Vec<String>>> = std::sync::OnceLock::new();
    TARGETS.get_or_init(query_comgr_targets).clone()
}

fn query_comgr_targets() -> Option<Vec<String>> {
    type CountFn = unsafe extern "C" fn(*mut usize) -> c_int;
    type NameFn = unsafe extern "C" fn(usize, *mut *const c_char) -> c_int;
    let names = ["libamd_comgr.so.3", "libamd_comgr.so.2", "libamd_comgr.so"];
    let lib = loader::open("libamd_comgr", &names, &loader::rocm_dirs(), false).ok()?;
    let lib: &'static Lib = Box::leak(Box::new(lib)); // never unloaded, see above
    unsafe {
        let count: CountFn = lib.sym("amd_comgr_get_isa_count").ok()?;
        let name: NameFn = lib.sym("amd_comgr_get_isa_name").ok()?;
        let mut n = 0usize;
        if count(&mut n) != 0 {
            return None;
        }
        let mut out: Vec<String> = Vec::new();
        for i in 0..n {
            let mut p: *const c_char = std::ptr::null();
            if name(i, &mut p) != 0 || p.is_null() {
                return None;
            }
            let full = CStr::from_ptr(p).to_string_lossy();
            let isa = full.rsplit("--").next().unwrap_or("");
            let base = isa.split(':').next().unwrap_or("").to_string();
            if base.starts_with("gfx") && !out.contains(&base) {
                out.push(base);
            }
        }
        Some(out)
    }
}

impl Hiprtc {
    /// Load hipRTC: `$DS4_HIPRTC_LIB`, `$ROCM_PATH`, /opt/rocm, then the system paths. ROCm 6
    /// ships it as libhiprtc.so.6; ROCm 5 (Debian's libamdhip64-5) inside libamdhip64.so.5.
    pub fn load() -> Result<Hiprtc> {
        let mut names: Vec<String> = [
            "libhiprtc.so.6",
            "libhiprtc.so",
            "libamdhip64.so.6",
            "libamdhip64.so.5",
            "libamdhip64.so",
        ]
        .map(String::from)
        .to_vec();
        let dirs = loader::with_override("DS4_HIPRTC_LIB", loader::rocm_dirs(), &mut names);
        let n: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let lib = loader::open(
            "hipRTC (ROCm, or Debian libamdhip64-5 + libhiprtc-builtins5)",
            &n,
            &dirs,
            false,
        )?;
        let parts = unsafe { RtcApi::load(lib, "hiprtc", "hiprtcGetCodeSize", "hiprtcGetCode")? };
        Ok(Hiprtc {
            api: parts.finish("hiprtc", "--offload-arch=", &["-O3", "-std=c++17"]),
            targets: comgr_targets(),
        })
    }

    /// The `gfx` targets this hipRTC can compile for, when known.
    pub fn targets(&self) -> Option<&[String]> {
        self.targets.as_deref()
    }

    /// Whether `arch` (e.g. `gfx90a`, `gfx90a:xnack-`) is a known target; `true` when unknown.
    pub fn supports(&self, arch: &str) -> bool {
        let base = arch.split(':').next().unwrap_or(arch);
        self.targets
            .as_ref()
            .is_none_or(|t| t.iter().any(|x| x == base))
    }
}

impl Compiler for Hiprtc {
    fn name(&self) -> &'static str {
        "hiprtc"
    }
    fn version(&self) -> String {
        // ROCm 5's hiprtcVersion does not follow the ROCm release; add the HIP runtime's
        // version when the same library exports it, so the cache key changes with ROCm.
        type RtVer = unsafe extern "C" fn(*mut c_int) -> c_int;
        let mut v = self.api.version_string();
        if let Ok(f) = unsafe { self.api.lib.sym::<RtVer>("hipRuntimeGetVersion") } {
            let mut n = 0;
            if unsafe { f(&mut n) } == 0 {
                v.push_str(&format!(" (HIP runtime {n})"));
            }
        }
        v
    }
    fn path(&self) -> PathBuf {
        self.api.lib.path.clone()
    }
    fn compile(
        &self,
        module: &Module,
        arch: &str,
        defines: &[(String, String)],
    ) -> Result<Vec<u8>> {
        if !self.supports(arch) {
            return Err(GpuError::Compile {
                compiler: self.version(),
                module: module.name.to_string(),
                arch: arch.to_string(),
                status: "target not supported by this ROCm's code-object manager (libamd_comgr)"
                    .into(),
                log: format!(
                    "supported targets: {}",
                    self.targets.as_deref().unwrap_or(&[]).join(" ")
                ),
            });
        }
        // One hipRTC compile at a time in the process: ROCm 5's code-object manager (comgr)
        // is not thread-safe (ROCm-CompilerSupport#27; newer ones lock inside, so nothing is
        // lost there). Two concurrent compiles hung a CI run for over an hour.
        let _one = HIPRTC_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let now = HIPRTC_BUSY.fetch_add(1, Ordering::SeqCst) + 1;
        HIPRTC_MOST.fetch_max(now, Ordering::SeqCst);
        let r = self.api.compile(module, arch, defines, &[]).map(|r| r.0);
        HIPRTC_BUSY.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

impl Hiprtc {
    /// The most hipRTC compiles that ran at the same time in this process so far (tests: 1).
    pub fn most_at_once() -> usize {
        HIPRTC_MOST.load(Ordering::SeqCst)
    }
}

/// Serialises [`Hiprtc::compile`] process-wide (see there); compiles running, and the most so far.
static HIPRTC_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
static HIPRTC_BUSY: AtomicUsize = AtomicUsize::new(0);
static HIPRTC_MOST: AtomicUsize = AtomicUsize::new(0);

/// The defines every module gets on an NVIDIA device of compute capability `major.minor`.
pub fn cuda_defines(major: u32, minor: u32, warp: u32) -> Vec<(String, String)> {
    let mut d = vec![
        ("DS4_CUDA".into(), "1".into()),
        ("DS4_WARP".into(), warp.to_string()),
        ("DS4_ARCH".into(), (100 * major + 10 * minor).to_string()),
    ];
    // DS4_GPU_M3D_R32=0 (read at each module compile): the one-token routed down m3dn1ip_q2_k
    // with 16 rows a CTA as before session 58 (moe.cu DS4_M3D_R16; the host launches d / 16).
    if !m3d_r32(major, minor) {
        d.push(("DS4_M3D_R16".into(), "1".into()));
    }
    d
}

/// Whether `m3dn1ip_q2_k` takes 32 rows a CTA on compute capability `major.minor` (moe.cu
/// `m3dn2_body`; decode +2.0% at 2k on the H200, session 58): Hopper and datacenter Blackwell
/// only. Its 148 KB of shared memory exceed the 99 KB of sm_86 / sm_89 / sm_120 cards, and its
/// d / 32 = 128 CTAs (one an SM) would leave an A100's 108 SMs a second wave. DS4_GPU_M3D_R32=0
/// keeps 16 rows everywhere (a define, so the kernel cache keeps both; model/moe.rs launches d /
/// 32 or d / 16 CTAs to match).
pub fn m3d_r32(major: u32, _minor: u32) -> bool {
    (major == 9 || major == 10) && !std::env::var("DS4_GPU_M3D_R32").is_ok_and(|v| v.trim() == "0")
}

/// The NVRTC arch for compute capability `major.minor`: the arch-specific `a` variant from 9.0
/// on (wgmma and friends; the CUBIN runs only on that exact major.minor, which is the device).
pub fn cuda_arch(major: u32, minor: u32) -> String {
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// The defines every module gets on an AMD device `gfx` (e.g. `gfx90a`, `gfx1030`).
pub fn hip_defines(gfx: &str, warp: u32) -> Vec<(String, String)> {
    let digits = gfx
        .trim_start_matches("gfx")
        .split(':')
        .next()
        .unwrap_or("");
    vec![
        ("DS4_HIP".into(), "1".into()),
        ("DS4_WARP".into(), warp.to_string()),
        ("DS4_ARCH".into(), "0".into()),
        ("DS4_GFX".into(), format!("0x{digits}")),
    ]
}

/// Default wavefront width of HIP code for a `gfx` target: 64 on GCN/CDNA (gfx9xx and older),
/// 32 on RDNA (gfx10xx and newer).
pub fn hip_default_warp(gfx: &str) -> u32 {
    let d = gfx.trim_start_matches("gfx");
    if d.len() >= 4 {
        32
    } else {
        64
    }
}

#[cfg(test)]
mod m3d_form_tests {
    use super::*;

    /// The 32-row routed down (148 KB of shared memory, one CTA an SM) only where it fits and
    /// was measured to pay: Hopper and datacenter Blackwell; 16 rows on Ampere / Ada / sm_120.
    #[test]
    fn m3d_rows_follow_the_arch() {
        if std::env::var("DS4_GPU_M3D_R32").is_ok() {
            eprintln!("skipped: DS4_GPU_M3D_R32 is set in the environment");
            return;
        }
        let r16 = |ma, mi| {
            cuda_defines(ma, mi, 32)
                .iter()
                .any(|(k, _)| k == "DS4_M3D_R16")
        };
        for (ma, mi) in [(8, 0), (8, 6), (8, 9), (12, 0)] {
            assert!(r16(ma, mi) && !m3d_r32(ma, mi), "sm_{ma}{mi}: 16 rows");
        }
        for (ma, mi) in [(9, 0), (10, 0)] {
            assert!(!r16(ma, mi) && m3d_r32(ma, mi), "sm_{ma}{mi}: 32 rows");
        }
    }
}
