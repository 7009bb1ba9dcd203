//! The collective library of expert parallelism (`ds4_backend::shard`): NCCL on NVIDIA, RCCL
//! on AMD (the same C API under another file name), opened with `dlopen` at run time like
//! every vendor library here. One process drives all ranks (one device each, one host thread
//! each per call: `ds4_model::sharded`); the communicators come from `ncclCommInitAll`.
//! Only the float sum all-reduce is used: the MoE outputs of the ranks.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{GpuError, Result};
use crate::loader::{self, Lib};
use crate::runtime::{DevPtr, Stream, Vendor};

type R = c_int; // ncclResult_t: 0 = ncclSuccess
type Comm = *mut c_void; // ncclComm_t
const NCCL_FLOAT32: c_int = 7; // ncclFloat32
const NCCL_SUM: c_int = 0; // ncclSum

/// The opened library.
pub struct Ccl {
    pub vendor: Vendor,
    pub path: PathBuf,
    version: c_int,
    _lib: Lib,
    get_version: unsafe extern "C" fn(*mut c_int) -> R,
    init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> R,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> R,
    destroy: unsafe extern "C" fn(Comm) -> R,
    error_string: unsafe extern "C" fn(R) -> *const c_char,
}

// The function pointers are plain C entry points; NCCL is thread-safe across communicators.
unsafe impl Send for Ccl {}
unsafe impl Sync for Ccl {}

/// File names of the library per vendor.
fn names(vendor: Vendor) -> &'static [&'static str] {
    match vendor {
        Vendor::Nvidia => &["libnccl.so.2", "libnccl.so"],
        Vendor::Amd => &["librccl.so.1", "librccl.so"],
    }
}

impl Ccl {
    /// Open NCCL (`$DS4_NCCL_LIB`, `$CUDA_HOME`, /usr/local/cuda, pip wheels such as
    /// nvidia-nccl-cu13 under `site-packages/nvidia/*/lib`, the system loader) or RCCL
    /// (`$DS4_RCCL_LIB`, `$ROCM_PATH`, /opt/rocm, the system loader). The error lists every
    /// place searched.
    pub fn open(vendor: Vendor) -> Result<Ccl> {
        let (var, what, dirs) = match vendor {
            Vendor::Nvidia => (
                "DS4_NCCL_LIB",
                "NCCL (pip nvidia-nccl-cu13, or the CUDA toolkit's libnccl)",
                loader::cuda_dirs(),
            ),
            Vendor::Amd => ("DS4_RCCL_LIB", "RCCL (ROCm)", loader::rocm_dirs()),
        };
        let mut n: Vec<String> = names(vendor).iter().map(|s| s.to_string()).collect();
        let dirs = loader::with_override(var, dirs, &mut n);
        let n: Vec<&str> = n.iter().map(|s| s.as_str()).collect();
        let lib = loader::open(what, &n, &dirs, false)?;
        let mut c = unsafe {
            Ccl {
                vendor,
                path: lib.path.clone(),
                version: 0,
                get_version: lib.sym("ncclGetVersion")?,
                init_all: lib.sym("ncclCommInitAll")?,
                all_reduce: lib.sym("ncclAllReduce")?,
                destroy: lib.sym("ncclCommDestroy")?,
                error_string: lib.sym("ncclGetErrorString")?,
                _lib: lib,
            }
        };
        let mut v: c_int = 0;
        c.check("ncclGetVersion", unsafe { (c.get_version)(&mut v) })?;
        c.version = v;
        Ok(c)
    }

    /// `2.28.9` from NCCL's `22809` (RCCL reports NCCL's numbering too).
    pub fn version(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
        }
    }

    fn check(&self, what: &str, r: R) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let s = unsafe { (self.error_string)(r) };
        let msg = if s.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(GpuError::Invalid(format!(
            "{what} ({}): error {r}: {msg}",
            self.path.display()
        )))
    }

    /// One communicator per device of `devices` (their ordinals as the vendor runtime numbers
    /// them), rank r on `devices[r]`. Two ranks may not share a device (NCCL refuses).
    pub fn init_all(self: &Arc<Self>, devices: &[usize]) -> Result<Vec<CclComm>> {
        if devices.is_empty() {
            return Err(GpuError::Invalid("a communicator of no devices".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(GpuError::Invalid(format!(
                    "device {d} named twice: expert parallelism runs one rank per device"
                )));
            }
        }
        let list: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        self.check("ncclCommInitAll", unsafe {
            (self.init_all)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr())
        })?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| CclComm {
                ccl: self.clone(),
                comm,
                rank,
                n_ranks: devices.len(),
            })
            .collect())
    }
}

/// One rank's communicator.
pub struct CclComm {
    ccl: Arc<Ccl>,
    comm: Comm,
    pub rank: usize,
    pub n_ranks: usize,
}

// A communicator is used by one thread at a time (its rank's); NCCL allows that from any thread.
unsafe impl Send for CclComm {}
unsafe impl Sync for CclComm {}

impl CclComm {
    /// `buf[..len] = Σ over ranks` of f32 values, in place, queued on `stream` (the caller's
    /// context current on this thread).
    pub fn all_reduce_f32(&self, buf: DevPtr, len: usize, stream: Stream) -> Result<()> {
        let p = buf.0 as *mut c_void;
        self.ccl.check("ncclAllReduce", unsafe {
            (self.ccl.all_reduce)(
                p,
                p,
                len,
                NCCL_FLOAT32,
                NCCL_SUM,
                self.comm,
                stream.0 as *mut c_void,
            )
        })
    }

    pub fn library(&self) -> &Ccl {
        &self.ccl
    }
}

impl Drop for CclComm {
    fn drop(&mut self) {
        unsafe {
            (self.ccl.destroy)(self.comm);
        }
    }
}
