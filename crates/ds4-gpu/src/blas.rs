//! The vendor's BLAS-Lt library, opened with `dlopen` like the driver and NVRTC: cuBLASLt
//! (`libcublasLt.so.13`/`.12`) on CUDA, hipBLASLt (`libhipblaslt.so.1`/`.0`) on ROCm. Only the
//! calls the dense prefill products need (model/blas.rs): handle, matmul descriptor (compute type,
//! transposes, pointer mode), matrix layouts (strided batches), preference (workspace bytes), the algorithm
//! heuristic, and the product itself. A missing library is no error for the engine: the
//! products then decline with one line ([`decline_line`]) and the built-in GEMM runs.
//!
//! The two libraries share the API's shape but not its enum values: [`Enums`] holds each
//! vendor's, from cublasLt.h / cublas_api.h / library_types.h (CUDA 12/13) and hipblaslt.h /
//! hipblas-common.h (ROCm 6/7). The hipBLASLt table has not run on an AMD GPU here (none was
//! available); it is written from the public headers.

use crate::error::{GpuError, Result};
use crate::loader::{self, Lib};
use crate::runtime::{DevPtr, Stream, Vendor};
use std::ffi::c_void;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::OnceLock;

type H = *mut c_void;
type St = c_int;
type SetAttr = unsafe extern "C" fn(H, c_int, *const c_void, usize) -> St;

/// Enum values that differ between cuBLASLt and hipBLASLt.
#[derive(Clone, Copy, Debug)]
pub struct Enums {
    /// cudaDataType / hipDataType: f32, bf16 and f16 (the same numbers for both vendors).
    pub r_32f: c_int,
    pub r_16bf: c_int,
    pub r_16f: c_int,
    /// cublasComputeType_t / hipblasComputeType_t: f32 compute and accumulation.
    pub compute_32f: c_int,
    /// cublasOperation_t / hipblasOperation_t.
    pub op_n: c_int,
    pub op_t: c_int,
    /// Matmul descriptor attributes.
    pub desc_transa: c_int,
    pub desc_transb: c_int,
    /// Matmul descriptor attribute: pointer mode (int32), and its value for device scalars.
    pub desc_pointer_mode: c_int,
    pub pointer_mode_device: c_int,
    /// Matrix layout attributes (int32 count, int64 element stride).
    pub layout_batch_count: c_int,
    pub layout_batch_stride: c_int,
    /// Preference attribute: uint64 workspace bytes.
    pub pref_max_workspace: c_int,
}

/// cuBLASLt (CUDA 12/13 headers).
pub const CUBLASLT: Enums = Enums {
    r_32f: 0,
    r_16bf: 14,
    r_16f: 2,
    compute_32f: 68,
    op_n: 0,
    op_t: 1,
    desc_transa: 3,
    desc_transb: 4,
    desc_pointer_mode: 2,
    pointer_mode_device: 1,
    layout_batch_count: 5,
    layout_batch_stride: 6,
    pref_max_workspace: 1,
};

/// hipBLASLt (ROCm 6/7 headers: hipblasComputeType_t from hipblas-common.h).
pub const HIPBLASLT: Enums = Enums {
    r_32f: 0,
    r_16bf: 14,
    r_16f: 2,
    compute_32f: 2,
    op_n: 111,
    op_t: 112,
    desc_transa: 0,
    desc_transb: 1,
    desc_pointer_mode: 13,
    pointer_mode_device: 1,
    layout_batch_count: 0,
    layout_batch_stride: 1,
    pref_max_workspace: 1,
};

/// Bytes kept for one heuristic result. cuBLASLt's cublasLtMatmulHeuristicResult_t is 96
/// bytes (a 64-byte algo first), hipBLASLt's 56 (a 24-byte algo first); only one result is
/// asked for, and the algo passed to the product is its start.
const RESULT_WORDS: usize = 16;

/// The opened library: function table and its vendor's enum values.
pub struct BlasLt {
    pub vendor: Vendor,
    /// Library name in messages: "cuBLASLt" or "hipBLASLt".
    pub name: &'static str,
    pub lib: Lib,
    pub e: Enums,
    create: unsafe extern "C" fn(*mut H) -> St,
    destroy: unsafe extern "C" fn(H) -> St,
    desc_create: unsafe extern "C" fn(*mut H, c_int, c_int) -> St,
    desc_destroy: unsafe extern "C" fn(H) -> St,
    desc_set: SetAttr,
    layout_create: unsafe extern "C" fn(*mut H, c_int, u64, u64, i64) -> St,
    layout_destroy: unsafe extern "C" fn(H) -> St,
    layout_set: SetAttr,
    pref_create: unsafe extern "C" fn(*mut H) -> St,
    pref_destroy: unsafe extern "C" fn(H) -> St,
    pref_set: SetAttr,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(H, H, H, H, H, H, H, c_int, *mut c_void, *mut c_int) -> St,
    /// cublasLtMatmulAlgoCheck (handle, desc, A, B, C, D, algo, result): whether an algorithm
    /// found for one shape runs another, and its workspace there ([`Handle::plan_like`]).
    /// cuBLASLt only (None on ROCm: hipBLASLt's check is not in its stable C API).
    #[allow(clippy::type_complexity)]
    algo_check: Option<unsafe extern "C" fn(H, H, H, H, H, H, *const c_void, *mut c_void) -> St>,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        H,             // handle
        H,             // matmul descriptor
        *const c_void, // alpha (host f32)
        *const c_void, // A
        H,
        *const c_void, // B
        H,
        *const c_void, // beta
        *const c_void, // C
        H,
        *mut c_void, // D
        H,
        *const c_void, // algo
        *mut c_void,   // workspace
        usize,
        H, // stream
    ) -> St,
}

// Function pointers into a library that stays loaded for the process.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

/// The library's file names, newest first.
fn names(vendor: Vendor) -> &'static [&'static str] {
    match vendor {
        Vendor::Nvidia => &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
        Vendor::Amd => &["libhipblaslt.so.1", "libhipblaslt.so.0", "libhipblaslt.so"],
    }
}

impl BlasLt {
    /// Open the vendor's library: `$DS4_CUBLASLT_LIB` / `$DS4_HIPBLASLT_LIB` (a file), then
    /// as [`BlasLt::open`] searches.
    pub fn load(vendor: Vendor) -> Result<BlasLt> {
        let var = match vendor {
            Vendor::Nvidia => "DS4_CUBLASLT_LIB",
            Vendor::Amd => "DS4_HIPBLASLT_LIB",
        };
        let over = std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Self::open(vendor, over)
    }

    /// Open the library from `file` (when given) first, then CUDA: `$CUDA_HOME`, `$CUDA_PATH`,
    /// /usr/local/cuda, pip wheels (`site-packages/nvidia/*/lib`: nvidia-cublas), the system
    /// loader; ROCm: `$ROCM_PATH`, `$HIP_PATH`, /opt/rocm, the system loader. The error lists
    /// every place searched.
    pub fn open(vendor: Vendor, file: Option<PathBuf>) -> Result<BlasLt> {
        let mut names: Vec<String> = names(vendor).iter().map(|s| s.to_string()).collect();
        let mut dirs = match vendor {
            Vendor::Nvidia => loader::cuda_dirs(),
            Vendor::Amd => loader::rocm_dirs(),
        };
        if let Some(p) = file {
            if let (Some(parent), Some(f)) = (p.parent(), p.file_name()) {
                let f = f.to_string_lossy().into_owned();
                names.retain(|n| *n != f);
                names.insert(0, f);
                dirs.insert(0, parent.to_path_buf());
            }
        }
        let n: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let (what, name, e, pre) = match vendor {
            Vendor::Nvidia => (
                "cuBLASLt (pip nvidia-cublas or the CUDA toolkit)",
                "cuBLASLt",
                CUBLASLT,
                "cublasLt",
            ),
            Vendor::Amd => ("hipBLASLt (ROCm)", "hipBLASLt", HIPBLASLT, "hipblasLt"),
        };
        let lib = loader::open(what, &n, &dirs, false)?;
        let f = |s: &str| format!("{pre}{s}");
        unsafe {
            Ok(BlasLt {
                vendor,
                name,
                e,
                create: lib.sym(&f("Create"))?,
                destroy: lib.sym(&f("Destroy"))?,
                desc_create: lib.sym(&f("MatmulDescCreate"))?,
                desc_destroy: lib.sym(&f("MatmulDescDestroy"))?,
                desc_set: lib.sym(&f("MatmulDescSetAttribute"))?,
                layout_create: lib.sym(&f("MatrixLayoutCreate"))?,
                layout_destroy: lib.sym(&f("MatrixLayoutDestroy"))?,
                layout_set: lib.sym(&f("MatrixLayoutSetAttribute"))?,
                pref_create: lib.sym(&f("MatmulPreferenceCreate"))?,
                pref_destroy: lib.sym(&f("MatmulPreferenceDestroy"))?,
                pref_set: lib.sym(&f("MatmulPreferenceSetAttribute"))?,
                heuristic: lib.sym(&f("MatmulAlgoGetHeuristic"))?,
                algo_check: match vendor {
                    Vendor::Nvidia => lib.sym(&f("MatmulAlgoCheck")).ok(),
                    Vendor::Amd => None,
                },
                matmul: lib.sym(&f("Matmul"))?,
                lib,
            })
        }
    }

    /// The process-wide library for `vendor`, opened once (never unloaded); Err: the line to
    /// print when declining.
    pub fn get(vendor: Vendor) -> std::result::Result<&'static BlasLt, &'static str> {
        static CUDA: OnceLock<std::result::Result<BlasLt, String>> = OnceLock::new();
        static HIP: OnceLock<std::result::Result<BlasLt, String>> = OnceLock::new();
        let cell = match vendor {
            Vendor::Nvidia => &CUDA,
            Vendor::Amd => &HIP,
        };
        cell.get_or_init(|| BlasLt::load(vendor).map_err(|e| decline_line(vendor, &e)))
            .as_ref()
            .map_err(|s| s.as_str())
    }

    fn check(&self, call: &'static str, st: St) -> Result<()> {
        if st == 0 {
            return Ok(());
        }
        Err(GpuError::Api {
            api: self.name,
            call,
            code: st as i64,
            name: status_name(self.vendor, st).to_string(),
            message: String::new(),
        })
    }

    /// A new library handle (the device's context must be current on this thread).
    pub fn handle(&'static self) -> Result<Handle> {
        let mut h: H = std::ptr::null_mut();
        self.check("Create", unsafe { (self.create)(&mut h) })?;
        Ok(Handle { lt: self, h })
    }
}

/// The one line printed when the library is missing (`err` from [`BlasLt::load`]): what was
/// searched, and that the built-in GEMM runs instead.
pub fn decline_line(vendor: Vendor, err: &GpuError) -> String {
    let name = match vendor {
        Vendor::Nvidia => "cuBLASLt",
        Vendor::Amd => "hipBLASLt",
    };
    let searched = match err {
        GpuError::LibraryNotFound { searched, .. } => searched.join("; "),
        e => e.to_string().replace('\n', " "),
    };
    format!(
        "ds4: {name} not found (searched {searched}): dense prefill products use the built-in GEMM"
    )
}

/// cublasStatus_t / hipblasStatus_t names (the common ones).
fn status_name(vendor: Vendor, st: St) -> &'static str {
    match (vendor, st) {
        (Vendor::Nvidia, 1) => "NOT_INITIALIZED",
        (Vendor::Nvidia, 3) => "ALLOC_FAILED",
        (Vendor::Nvidia, 7) => "INVALID_VALUE",
        (Vendor::Nvidia, 8) => "ARCH_MISMATCH",
        (Vendor::Nvidia, 13) => "EXECUTION_FAILED",
        (Vendor::Nvidia, 14) => "INTERNAL_ERROR",
        (Vendor::Nvidia, 15) => "NOT_SUPPORTED",
        (Vendor::Amd, 1) => "NOT_INITIALIZED",
        (Vendor::Amd, 2) => "ALLOC_FAILED",
        (Vendor::Amd, 3) => "INVALID_VALUE",
        (Vendor::Amd, 6) => "EXECUTION_FAILED",
        (Vendor::Amd, 7) => "INTERNAL_ERROR",
        (Vendor::Amd, 8) => "NOT_SUPPORTED",
        _ => "status",
    }
}

/// A library handle (destroyed on drop).
pub struct Handle {
    lt: &'static BlasLt,
    h: H,
}

unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        unsafe { (self.lt.destroy)(self.h) };
    }
}

/// Shape of one strided-batched product in column-major terms, as the BLAS sees it:
/// `D[m × n] = A^T · B` per batch, A `k × m` (bf16, or f16 with `f16`; leading dimension `lda`),
/// B `k × n` (the same type, `ldb`), D `m × n` (f32, `ldd`), batch b at element offsets `b·a_stride`, `b·b_stride`,
/// `b·d_stride`. A row-major weight `[m][k]` is A with lda = k; row-major activations `[n][k]`
/// are B; row-major outputs `[n][m]` are D with ldd = m.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: i64,
    pub ldb: i64,
    pub ldd: i64,
    pub batch: i32,
    pub a_stride: i64,
    pub b_stride: i64,
    pub d_stride: i64,
    /// f16 inputs and a device-side scale: `D = alpha · A^T·B` with alpha (f32) and beta (0.0)
    /// read from device memory when the product runs ([`Handle::matmul`]'s `scale`).
    pub f16: bool,
}

/// Descriptors and the chosen algorithm for one [`Shape`] (destroyed on drop).
pub struct Plan {
    lt: &'static BlasLt,
    desc: H,
    a: H,
    b: H,
    d: H,
    algo: [u64; RESULT_WORDS],
    /// Workspace bytes the algorithm needs (at most the workspace given to [`Handle::plan`]).
    pub workspace: usize,
}

unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    (self.lt.layout_destroy)(l);
                }
            }
            if !self.desc.is_null() {
                (self.lt.desc_destroy)(self.desc);
            }
        }
    }
}

fn set<T>(lt: &BlasLt, f: SetAttr, call: &'static str, h: H, attr: c_int, v: &T) -> Result<()> {
    lt.check(call, unsafe {
        f(
            h,
            attr,
            v as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    })
}

impl Handle {
    /// Descriptors for `s` with `from`'s algorithm (found for another shape of the same
    /// operands, e.g. another number of token rows) when the library's check accepts it for `s`
    /// within `workspace` bytes: no heuristic query, and the kernel `from` loaded. Ok(None):
    /// not accepted, or no check in this library (the caller asks the heuristic).
    pub fn plan_like(&self, s: &Shape, from: &Plan, workspace: usize) -> Result<Option<Plan>> {
        let lt = self.lt;
        let Some(check) = lt.algo_check else {
            return Ok(None);
        };
        let mut p = self.descs(s)?;
        p.algo = from.algo;
        let mut res = [0u64; RESULT_WORDS];
        let st = unsafe {
            check(
                self.h,
                p.desc,
                p.a,
                p.b,
                p.d,
                p.d,
                p.algo.as_ptr() as *const c_void,
                res.as_mut_ptr() as *mut c_void,
            )
        };
        // cuBLASLt's result: workspaceSize at byte 64 (the algo's 64 bytes come first).
        if st != 0 || res[8] as usize > workspace {
            return Ok(None);
        }
        p.workspace = res[8] as usize;
        Ok(Some(p))
    }

    /// The matmul descriptor and the three layouts of `s` (algorithm not chosen yet).
    fn descs(&self, s: &Shape) -> Result<Plan> {
        let lt = self.lt;
        let e = lt.e;
        let mut p = Plan {
            lt,
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: [0; RESULT_WORDS],
            workspace: 0,
        };
        unsafe {
            lt.check(
                "MatmulDescCreate",
                (lt.desc_create)(&mut p.desc, e.compute_32f, e.r_32f),
            )?;
            let ds = lt.desc_set;
            set(
                lt,
                ds,
                "MatmulDescSetAttribute",
                p.desc,
                e.desc_transa,
                &e.op_t,
            )?;
            set(
                lt,
                ds,
                "MatmulDescSetAttribute",
                p.desc,
                e.desc_transb,
                &e.op_n,
            )?;
            if s.f16 {
                set(
                    lt,
                    ds,
                    "MatmulDescSetAttribute",
                    p.desc,
                    e.desc_pointer_mode,
                    &e.pointer_mode_device,
                )?;
            }
            let ab = if s.f16 { e.r_16f } else { e.r_16bf };
            let layout = |out: &mut H, ty: c_int, rows: u64, cols: u64, ld: i64, stride: i64| {
                lt.check(
                    "MatrixLayoutCreate",
                    (lt.layout_create)(out, ty, rows, cols, ld),
                )?;
                if s.batch > 1 {
                    let ls = lt.layout_set;
                    let c = "MatrixLayoutSetAttribute";
                    set(lt, ls, c, *out, e.layout_batch_count, &s.batch)?;
                    set(lt, ls, c, *out, e.layout_batch_stride, &stride)?;
                }
                Ok::<(), GpuError>(())
            };
            layout(&mut p.a, ab, s.k, s.m, s.lda, s.a_stride)?;
            layout(&mut p.b, ab, s.k, s.n, s.ldb, s.b_stride)?;
            layout(&mut p.d, e.r_32f, s.m, s.n, s.ldd, s.d_stride)?;
        }
        Ok(p)
    }

    /// Descriptors for `s` and the heuristic's first algorithm within `workspace` bytes;
    /// Ok(None) when the library has no algorithm for it.
    pub fn plan(&self, s: &Shape, workspace: usize) -> Result<Option<Plan>> {
        let lt = self.lt;
        let e = lt.e;
        let mut p = self.descs(s)?;
        unsafe {
            let mut pref: H = std::ptr::null_mut();
            lt.check("MatmulPreferenceCreate", (lt.pref_create)(&mut pref))?;
            let ws = workspace as u64;
            let r = set(
                lt,
                lt.pref_set,
                "MatmulPreferenceSetAttribute",
                pref,
                e.pref_max_workspace,
                &ws,
            );
            let mut found: c_int = 0;
            let h = r.and_then(|_| {
                lt.check(
                    "MatmulAlgoGetHeuristic",
                    (lt.heuristic)(
                        self.h,
                        p.desc,
                        p.a,
                        p.b,
                        p.d,
                        p.d,
                        pref,
                        1,
                        p.algo.as_mut_ptr() as *mut c_void,
                        &mut found,
                    ),
                )
            });
            (lt.pref_destroy)(pref);
            match h {
                Ok(()) if found >= 1 => {}
                // NOT_SUPPORTED: no algorithm for this shape/alignment.
                Ok(()) => return Ok(None),
                Err(GpuError::Api { code, .. })
                    if status_name(lt.vendor, code as St) == "NOT_SUPPORTED" =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e),
            }
        }
        // workspaceSize follows the algo: byte 64 (cuBLASLt) or 24 (hipBLASLt).
        p.workspace = match lt.vendor {
            Vendor::Nvidia => p.algo[8] as usize,
            Vendor::Amd => p.algo[3] as usize,
        };
        Ok(Some(p))
    }

    /// Queue `D = A^T·B` of `plan` on `stream` (f32 alpha 1, beta 0; C is D), or with `acc`
    /// `D = A^T·B + D` (beta 1: the sum in the library's epilogue). A plan of an `f16`
    /// shape takes `scale`: a device pointer to (alpha, beta) f32, read when the product runs
    /// (None for the others; `acc` is then ignored). No allocation and no synchronisation: the
    /// workspace is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        plan: &Plan,
        a: DevPtr,
        b: DevPtr,
        d: DevPtr,
        scale: Option<DevPtr>,
        acc: bool,
        workspace: DevPtr,
        workspace_bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, if acc { 1.0f32 } else { 0.0f32 });
        let lt = self.lt;
        let ptr = |p: DevPtr| p.0 as *mut c_void;
        let (pa, pb) = match scale {
            Some(p) => (ptr(p) as *const c_void, ptr(p.offset(4)) as *const c_void),
            None => (
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
            ),
        };
        lt.check("Matmul", unsafe {
            (lt.matmul)(
                self.h,
                plan.desc,
                pa,
                ptr(a),
                plan.a,
                ptr(b),
                plan.b,
                pb,
                ptr(d),
                plan.d,
                ptr(d),
                plan.d,
                plan.algo.as_ptr() as *const c_void,
                ptr(workspace),
                workspace_bytes,
                stream.0 as *mut c_void,
            )
        })
    }
}
