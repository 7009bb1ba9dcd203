//! AMD: the HIP runtime (libamdhip64) through a hand-written `dlopen` table, kernels compiled by
//! hipRTC. `HIP_VISIBLE_DEVICES` / `ROCR_VISIBLE_DEVICES` are applied by the runtime.
//!
//! Never run on AMD hardware here: loading, symbol resolution and hipRTC compilation are
//! exercised without a GPU; device calls are written against the ROCm 5/6 API and unverified.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use crate::compiler::{hip_default_warp, hip_defines, Compiler, Hiprtc};
use crate::error::{GpuError, Result};
use crate::loader::{self, Lib};
use crate::runtime::*;

type Ptr = *mut c_void;
type R = c_int;

#[allow(non_snake_case)]
struct Api {
    _lib: Lib,
    hipInit: unsafe extern "C" fn(c_uint) -> R,
    hipRuntimeGetVersion: unsafe extern "C" fn(*mut c_int) -> R,
    hipGetDeviceCount: unsafe extern "C" fn(*mut c_int) -> R,
    hipSetDevice: unsafe extern "C" fn(c_int) -> R,
    hipDeviceGetName: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> R,
    hipDeviceGetAttribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> R,
    hipDeviceTotalMem: unsafe extern "C" fn(*mut usize, c_int) -> R,
    hipGetDeviceProperties: unsafe extern "C" fn(*mut c_void, c_int) -> R,
    hipDeviceSynchronize: unsafe extern "C" fn() -> R,
    hipModuleLoadData: unsafe extern "C" fn(*mut Ptr, *const c_void) -> R,
    hipModuleUnload: unsafe extern "C" fn(Ptr) -> R,
    hipModuleGetFunction: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> R,
    #[allow(clippy::type_complexity)]
    hipModuleLaunchKernel: unsafe extern "C" fn(
        Ptr,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Ptr,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> R,
    hipMalloc: unsafe extern "C" fn(*mut Ptr, usize) -> R,
    hipFree: unsafe extern "C" fn(Ptr) -> R,
    hipHostMalloc: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R,
    hipHostFree: unsafe extern "C" fn(Ptr) -> R,
    hipMemcpyHtoDAsync: unsafe extern "C" fn(Ptr, Ptr, usize, Ptr) -> R,
    hipMemcpyDtoHAsync: unsafe extern "C" fn(Ptr, Ptr, usize, Ptr) -> R,
    hipMemcpyDtoDAsync: unsafe extern "C" fn(Ptr, Ptr, usize, Ptr) -> R,
    hipMemsetD32Async: unsafe extern "C" fn(Ptr, c_int, usize, Ptr) -> R,
    hipStreamCreateWithFlags: unsafe extern "C" fn(*mut Ptr, c_uint) -> R,
    hipStreamDestroy: unsafe extern "C" fn(Ptr) -> R,
    hipStreamSynchronize: unsafe extern "C" fn(Ptr) -> R,
    hipEventCreate: unsafe extern "C" fn(*mut Ptr) -> R,
    hipEventDestroy: unsafe extern "C" fn(Ptr) -> R,
    hipEventRecord: unsafe extern "C" fn(Ptr, Ptr) -> R,
    hipEventSynchronize: unsafe extern "C" fn(Ptr) -> R,
    hipEventElapsedTime: unsafe extern "C" fn(*mut f32, Ptr, Ptr) -> R,
    hipGetErrorName: unsafe extern "C" fn(R) -> *const c_char,
    hipGetErrorString: unsafe extern "C" fn(R) -> *const c_char,
}

// hipDeviceAttribute_t values (hip_runtime_api.h, ROCm 5.x and 6.x numbering).
const ATTR_L2_CACHE_SIZE: c_int = 19;
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 56;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
const ATTR_SHARED_PER_BLOCK: c_int = 74;
const ATTR_WARP_SIZE: c_int = 87;
const HIP_ERROR_NOT_FOUND: c_int = 500;
const HIP_STREAM_NON_BLOCKING: c_uint = 1;
const HIP_HOST_MALLOC_PORTABLE: c_uint = 1;

impl Api {
    fn load() -> Result<Api> {
        let mut names: Vec<String> = ["libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"]
            .map(String::from)
            .to_vec();
        let dirs = loader::with_override("DS4_HIP_LIB", loader::rocm_dirs(), &mut names);
        let n: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let lib = loader::open("HIP runtime (libamdhip64, from ROCm)", &n, &dirs, false)?;
        unsafe {
            Ok(Api {
                hipInit: lib.sym("hipInit")?,
                hipRuntimeGetVersion: lib.sym("hipRuntimeGetVersion")?,
                hipGetDeviceCount: lib.sym("hipGetDeviceCount")?,
                hipSetDevice: lib.sym("hipSetDevice")?,
                hipDeviceGetName: lib.sym("hipDeviceGetName")?,
                hipDeviceGetAttribute: lib.sym("hipDeviceGetAttribute")?,
                hipDeviceTotalMem: lib.sym("hipDeviceTotalMem")?,
                // ROCm 6 renamed the struct-returning call; both fill a struct whose first 256
                // bytes are the name, and which holds gcnArchName further on.
                hipGetDeviceProperties: lib
                    .sym_any(&["hipGetDevicePropertiesR0600", "hipGetDeviceProperties"])?,
                hipDeviceSynchronize: lib.sym("hipDeviceSynchronize")?,
                hipModuleLoadData: lib.sym("hipModuleLoadData")?,
                hipModuleUnload: lib.sym("hipModuleUnload")?,
                hipModuleGetFunction: lib.sym("hipModuleGetFunction")?,
                hipModuleLaunchKernel: lib.sym("hipModuleLaunchKernel")?,
                hipMalloc: lib.sym("hipMalloc")?,
                hipFree: lib.sym("hipFree")?,
                hipHostMalloc: lib.sym("hipHostMalloc")?,
                hipHostFree: lib.sym("hipHostFree")?,
                hipMemcpyHtoDAsync: lib.sym("hipMemcpyHtoDAsync")?,
                hipMemcpyDtoHAsync: lib.sym("hipMemcpyDtoHAsync")?,
                hipMemcpyDtoDAsync: lib.sym("hipMemcpyDtoDAsync")?,
                hipMemsetD32Async: lib.sym("hipMemsetD32Async")?,
                hipStreamCreateWithFlags: lib.sym("hipStreamCreateWithFlags")?,
                hipStreamDestroy: lib.sym("hipStreamDestroy")?,
                hipStreamSynchronize: lib.sym("hipStreamSynchronize")?,
                hipEventCreate: lib.sym("hipEventCreate")?,
                hipEventDestroy: lib.sym("hipEventDestroy")?,
                hipEventRecord: lib.sym("hipEventRecord")?,
                hipEventSynchronize: lib.sym("hipEventSynchronize")?,
                hipEventElapsedTime: lib.sym("hipEventElapsedTime")?,
                hipGetErrorName: lib.sym("hipGetErrorName")?,
                hipGetErrorString: lib.sym("hipGetErrorString")?,
                _lib: lib,
            })
        }
    }

    fn check(&self, call: &'static str, r: R) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let text = |p: *const c_char| {
            if p.is_null() {
                "?".to_string()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        Err(GpuError::Api {
            api: "HIP",
            call,
            code: r as i64,
            name: text(unsafe { (self.hipGetErrorName)(r) }),
            message: text(unsafe { (self.hipGetErrorString)(r) }),
        })
    }
}

/// The `gfx...` target name inside a device-properties struct: the first NUL-terminated
/// `gfx<alnum>[:features]` string after the 256-byte name field (its offset differs between
/// ROCm versions, the string does not).
pub fn find_gcn_arch(props: &[u8]) -> Option<String> {
    let mut i = 256;
    while i + 4 < props.len() {
        if &props[i..i + 3] == b"gfx" && (i == 0 || props[i - 1] == 0) {
            let end = props[i..].iter().position(|&b| b == 0).map(|e| i + e)?;
            let s = std::str::from_utf8(&props[i..end]).ok()?;
            let base = s.split(':').next()?;
            if base.len() > 3 && base[3..].bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Some(base.to_string());
            }
        }
        i += 1;
    }
    None
}

/// One AMD device and hipRTC.
pub struct HipRuntime {
    api: Api,
    hiprtc: Hiprtc,
    dev: c_int,
    info: DeviceInfo,
}

unsafe impl Send for HipRuntime {}
unsafe impl Sync for HipRuntime {}

macro_rules! call {
    ($s:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        $s.api.check(stringify!($f), unsafe { ($s.api.$f)($($a),*) })
    };
}

impl HipRuntime {
    /// Number of visible AMD devices (loads and initialises the runtime).
    pub fn device_count() -> Result<usize> {
        let api = Api::load()?;
        api.check("hipInit", unsafe { (api.hipInit)(0) })?;
        let mut n = 0;
        api.check("hipGetDeviceCount", unsafe {
            (api.hipGetDeviceCount)(&mut n)
        })?;
        Ok(n.max(0) as usize)
    }

    pub fn new(index: usize) -> Result<HipRuntime> {
        let api = Api::load()?;
        api.check("hipInit", unsafe { (api.hipInit)(0) })?;
        let mut count = 0;
        api.check("hipGetDeviceCount", unsafe {
            (api.hipGetDeviceCount)(&mut count)
        })?;
        if index >= count.max(0) as usize {
            return Err(GpuError::NoDevice {
                backend: "ROCm",
                index,
                count: count.max(0) as usize,
            });
        }
        let dev = index as c_int;
        api.check("hipSetDevice", unsafe { (api.hipSetDevice)(dev) })?;
        let attr = |a: c_int| -> Result<u32> {
            let mut v = 0;
            api.check("hipDeviceGetAttribute", unsafe {
                (api.hipDeviceGetAttribute)(&mut v, a, dev)
            })?;
            Ok(v.max(0) as u32)
        };
        let mut name = [0 as c_char; 256];
        api.check("hipDeviceGetName", unsafe {
            (api.hipDeviceGetName)(name.as_mut_ptr(), 256, dev)
        })?;
        let mut mem = 0usize;
        api.check("hipDeviceTotalMem", unsafe {
            (api.hipDeviceTotalMem)(&mut mem, dev)
        })?;
        let mut ver = 0;
        api.check("hipRuntimeGetVersion", unsafe {
            (api.hipRuntimeGetVersion)(&mut ver)
        })?;
        // Larger than any version of the struct (R0600 is 1472 bytes).
        let mut props = vec![0u64; 1024];
        api.check("hipGetDeviceProperties", unsafe {
            (api.hipGetDeviceProperties)(props.as_mut_ptr() as *mut c_void, dev)
        })?;
        let bytes: Vec<u8> = props.iter().flat_map(|w| w.to_le_bytes()).collect();
        let arch = find_gcn_arch(&bytes).ok_or_else(|| {
            GpuError::Invalid(format!(
                "HIP device {index}: no gfx arch name in its properties"
            ))
        })?;
        // The attribute, cross-checked against the family default (a mismatch means the
        // attribute numbering differs from the one assumed here).
        let warp = match attr(ATTR_WARP_SIZE) {
            Ok(w @ (32 | 64)) => w,
            _ => hip_default_warp(&arch),
        };
        let info = DeviceInfo {
            vendor: Vendor::Amd,
            index,
            name: unsafe { CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
            arch,
            warp,
            sm_count: attr(ATTR_MULTIPROCESSOR_COUNT)?,
            total_mem: mem as u64,
            cc: (0, 0),
            max_threads_per_block: attr(ATTR_MAX_THREADS_PER_BLOCK)?,
            max_shared_per_block: attr(ATTR_SHARED_PER_BLOCK)?,
            l2_bytes: attr(ATTR_L2_CACHE_SIZE)?,
            driver: format!(
                "HIP runtime {}.{}.{}",
                ver / 10_000_000,
                (ver / 100_000) % 100,
                ver % 100_000
            ),
        };
        let hiprtc = Hiprtc::load()?;
        Ok(HipRuntime {
            api,
            hiprtc,
            dev,
            info,
        })
    }

    fn cur(&self) -> Result<()> {
        call!(self, hipSetDevice(self.dev))
    }
}

fn p(v: u64) -> Ptr {
    v as usize as Ptr
}

impl Runtime for HipRuntime {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn compiler(&self) -> &dyn Compiler {
        &self.hiprtc
    }
    fn defines(&self) -> Vec<(String, String)> {
        hip_defines(&self.info.arch, self.info.warp)
    }
    fn load_module(&self, code: &[u8]) -> Result<ModuleHandle> {
        self.cur()?;
        let mut m: Ptr = std::ptr::null_mut();
        call!(
            self,
            hipModuleLoadData(&mut m, code.as_ptr() as *const c_void)
        )?;
        Ok(ModuleHandle(m as usize as u64))
    }
    fn unload_module(&self, m: ModuleHandle) -> Result<()> {
        self.cur()?;
        call!(self, hipModuleUnload(p(m.0)))
    }
    fn function(&self, m: ModuleHandle, name: &str) -> Result<Option<Function>> {
        self.cur()?;
        let c =
            CString::new(name).map_err(|_| GpuError::Invalid(format!("kernel name {name:?}")))?;
        let mut f: Ptr = std::ptr::null_mut();
        let r = unsafe { (self.api.hipModuleGetFunction)(&mut f, p(m.0), c.as_ptr()) };
        if r == HIP_ERROR_NOT_FOUND {
            return Ok(None);
        }
        self.api.check("hipModuleGetFunction", r)?;
        Ok(Some(Function(f as usize as u64)))
    }
    fn launch(&self, f: Function, d: LaunchDims, s: Stream, args: &[Arg]) -> Result<()> {
        self.cur()?;
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        call!(
            self,
            hipModuleLaunchKernel(
                p(f.0),
                d.grid[0],
                d.grid[1],
                d.grid[2],
                d.block[0],
                d.block[1],
                d.block[2],
                d.shared_bytes,
                p(s.0),
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        )
    }
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        self.cur()?;
        let mut d: Ptr = std::ptr::null_mut();
        call!(self, hipMalloc(&mut d, bytes.max(1)))?;
        Ok(DevPtr(d as usize as u64))
    }
    fn free(&self, d: DevPtr) -> Result<()> {
        self.cur()?;
        call!(self, hipFree(p(d.0)))
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(
            self,
            hipHostMalloc(&mut h, bytes.max(1), HIP_HOST_MALLOC_PORTABLE)
        )?;
        Ok(h as *mut u8)
    }
    unsafe fn free_pinned(&self, h: *mut u8) -> Result<()> {
        self.cur()?;
        call!(self, hipHostFree(h as Ptr))
    }
    unsafe fn copy_h2d_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        s: Stream,
    ) -> Result<()> {
        self.cur()?;
        call!(
            self,
            hipMemcpyHtoDAsync(p(dst.0), src as Ptr, bytes, p(s.0))
        )
    }
    unsafe fn copy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> Result<()> {
        self.cur()?;
        call!(
            self,
            hipMemcpyDtoHAsync(dst as Ptr, p(src.0), bytes, p(s.0))
        )
    }
    fn copy_d2d_async(&self, dst: DevPtr, src: DevPtr, bytes: usize, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, hipMemcpyDtoDAsync(p(dst.0), p(src.0), bytes, p(s.0)))
    }
    fn memset_u32_async(&self, d: DevPtr, value: u32, count: usize, s: Stream) -> Result<()> {
        self.cur()?;
        call!(
            self,
            hipMemsetD32Async(p(d.0), value as c_int, count, p(s.0))
        )
    }
    fn stream_create(&self) -> Result<Stream> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(
            self,
            hipStreamCreateWithFlags(&mut h, HIP_STREAM_NON_BLOCKING)
        )?;
        Ok(Stream(h as usize as u64))
    }
    fn stream_destroy(&self, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, hipStreamDestroy(p(s.0)))
    }
    fn stream_sync(&self, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, hipStreamSynchronize(p(s.0)))
    }
    fn event_create(&self) -> Result<Event> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(self, hipEventCreate(&mut h))?;
        Ok(Event(h as usize as u64))
    }
    fn event_destroy(&self, e: Event) -> Result<()> {
        self.cur()?;
        call!(self, hipEventDestroy(p(e.0)))
    }
    fn event_record(&self, e: Event, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, hipEventRecord(p(e.0), p(s.0)))
    }
    fn event_sync(&self, e: Event) -> Result<()> {
        self.cur()?;
        call!(self, hipEventSynchronize(p(e.0)))
    }
    fn event_elapsed_ms(&self, a: Event, b: Event) -> Result<f32> {
        self.cur()?;
        let mut ms = 0f32;
        call!(self, hipEventElapsedTime(&mut ms, p(a.0), p(b.0)))?;
        Ok(ms)
    }
    fn synchronize(&self) -> Result<()> {
        self.cur()?;
        call!(self, hipDeviceSynchronize())
    }
}
