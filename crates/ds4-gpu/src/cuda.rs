//! NVIDIA: the CUDA driver API (libcuda) through a hand-written `dlopen` table, kernels compiled
//! by NVRTC. The device index is among the devices `CUDA_VISIBLE_DEVICES` leaves visible (the
//! driver applies it; nothing here overrides it).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;

use crate::compiler::{cuda_arch, cuda_defines, Compiler, Nvrtc};
use crate::error::{GpuError, Result};
use crate::loader::{self, Lib};
use crate::runtime::*;

type Ptr = *mut c_void;
type R = c_int;

/// Driver entry points, resolved once.
#[allow(non_snake_case)]
struct Api {
    _lib: Lib,
    cuInit: unsafe extern "C" fn(c_uint) -> R,
    cuDriverGetVersion: unsafe extern "C" fn(*mut c_int) -> R,
    cuDeviceGetCount: unsafe extern "C" fn(*mut c_int) -> R,
    cuDeviceGet: unsafe extern "C" fn(*mut c_int, c_int) -> R,
    cuDeviceGetName: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> R,
    cuDeviceGetAttribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> R,
    cuDeviceTotalMem: unsafe extern "C" fn(*mut usize, c_int) -> R,
    cuDevicePrimaryCtxRetain: unsafe extern "C" fn(*mut Ptr, c_int) -> R,
    cuDevicePrimaryCtxRelease: unsafe extern "C" fn(c_int) -> R,
    cuCtxSetCurrent: unsafe extern "C" fn(Ptr) -> R,
    cuCtxSynchronize: unsafe extern "C" fn() -> R,
    cuModuleLoadData: unsafe extern "C" fn(*mut Ptr, *const c_void) -> R,
    cuModuleUnload: unsafe extern "C" fn(Ptr) -> R,
    cuModuleGetFunction: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> R,
    #[allow(clippy::type_complexity)]
    cuLaunchKernel: unsafe extern "C" fn(
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
    cuMemAlloc: unsafe extern "C" fn(*mut u64, usize) -> R,
    cuMemFree: unsafe extern "C" fn(u64) -> R,
    cuMemHostAlloc: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R,
    cuMemFreeHost: unsafe extern "C" fn(Ptr) -> R,
    cuMemcpyHtoDAsync: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> R,
    cuMemcpyDtoHAsync: unsafe extern "C" fn(*mut c_void, u64, usize, Ptr) -> R,
    cuMemcpyDtoDAsync: unsafe extern "C" fn(u64, u64, usize, Ptr) -> R,
    cuMemsetD32Async: unsafe extern "C" fn(u64, c_uint, usize, Ptr) -> R,
    cuStreamCreate: unsafe extern "C" fn(*mut Ptr, c_uint) -> R,
    cuStreamDestroy: unsafe extern "C" fn(Ptr) -> R,
    cuStreamSynchronize: unsafe extern "C" fn(Ptr) -> R,
    cuEventCreate: unsafe extern "C" fn(*mut Ptr, c_uint) -> R,
    cuEventDestroy: unsafe extern "C" fn(Ptr) -> R,
    cuEventRecord: unsafe extern "C" fn(Ptr, Ptr) -> R,
    cuEventSynchronize: unsafe extern "C" fn(Ptr) -> R,
    cuEventElapsedTime: unsafe extern "C" fn(*mut f32, Ptr, Ptr) -> R,
    cuGetErrorName: unsafe extern "C" fn(R, *mut *const c_char) -> R,
    cuGetErrorString: unsafe extern "C" fn(R, *mut *const c_char) -> R,
}

// CUdevice_attribute values (cuda.h).
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_WARP_SIZE: c_int = 10;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_L2_CACHE_SIZE: c_int = 38;
const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;
const ATTR_MAX_SHARED_PER_BLOCK_OPTIN: c_int = 97;
const CUDA_ERROR_NOT_FOUND: c_int = 500;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;

impl Api {
    fn load() -> Result<Api> {
        let mut names: Vec<String> = ["libcuda.so.1", "libcuda.so"].map(String::from).to_vec();
        let dirs = loader::with_override(
            "DS4_CUDA_LIB",
            [
                "/usr/local/nvidia/lib64",
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib64",
                "/usr/lib/wsl/lib",
            ]
            .map(PathBuf::from)
            .into_iter()
            .filter(|p| p.is_dir())
            .collect(),
            &mut names,
        );
        let n: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let lib = loader::open(
            "CUDA driver (libcuda, from the NVIDIA driver)",
            &n,
            &dirs,
            true,
        )?;
        unsafe {
            Ok(Api {
                cuInit: lib.sym("cuInit")?,
                cuDriverGetVersion: lib.sym("cuDriverGetVersion")?,
                cuDeviceGetCount: lib.sym("cuDeviceGetCount")?,
                cuDeviceGet: lib.sym("cuDeviceGet")?,
                cuDeviceGetName: lib.sym("cuDeviceGetName")?,
                cuDeviceGetAttribute: lib.sym("cuDeviceGetAttribute")?,
                cuDeviceTotalMem: lib.sym("cuDeviceTotalMem_v2")?,
                cuDevicePrimaryCtxRetain: lib.sym("cuDevicePrimaryCtxRetain")?,
                cuDevicePrimaryCtxRelease: lib
                    .sym_any(&["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"])?,
                cuCtxSetCurrent: lib.sym("cuCtxSetCurrent")?,
                cuCtxSynchronize: lib.sym("cuCtxSynchronize")?,
                cuModuleLoadData: lib.sym("cuModuleLoadData")?,
                cuModuleUnload: lib.sym("cuModuleUnload")?,
                cuModuleGetFunction: lib.sym("cuModuleGetFunction")?,
                cuLaunchKernel: lib.sym("cuLaunchKernel")?,
                cuMemAlloc: lib.sym("cuMemAlloc_v2")?,
                cuMemFree: lib.sym("cuMemFree_v2")?,
                cuMemHostAlloc: lib.sym("cuMemHostAlloc")?,
                cuMemFreeHost: lib.sym("cuMemFreeHost")?,
                cuMemcpyHtoDAsync: lib.sym("cuMemcpyHtoDAsync_v2")?,
                cuMemcpyDtoHAsync: lib.sym("cuMemcpyDtoHAsync_v2")?,
                cuMemcpyDtoDAsync: lib.sym("cuMemcpyDtoDAsync_v2")?,
                cuMemsetD32Async: lib.sym("cuMemsetD32Async")?,
                cuStreamCreate: lib.sym("cuStreamCreate")?,
                cuStreamDestroy: lib.sym_any(&["cuStreamDestroy_v2", "cuStreamDestroy"])?,
                cuStreamSynchronize: lib.sym("cuStreamSynchronize")?,
                cuEventCreate: lib.sym("cuEventCreate")?,
                cuEventDestroy: lib.sym_any(&["cuEventDestroy_v2", "cuEventDestroy"])?,
                cuEventRecord: lib.sym("cuEventRecord")?,
                cuEventSynchronize: lib.sym("cuEventSynchronize")?,
                cuEventElapsedTime: lib
                    .sym_any(&["cuEventElapsedTime_v2", "cuEventElapsedTime"])?,
                cuGetErrorName: lib.sym("cuGetErrorName")?,
                cuGetErrorString: lib.sym("cuGetErrorString")?,
                _lib: lib,
            })
        }
    }

    fn check(&self, call: &'static str, r: R) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let (mut n, mut m): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
        let text = |p: *const c_char| {
            if p.is_null() {
                "?".to_string()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        unsafe {
            (self.cuGetErrorName)(r, &mut n);
            (self.cuGetErrorString)(r, &mut m);
        }
        Err(GpuError::Api {
            api: "CUDA driver",
            call,
            code: r as i64,
            name: text(n),
            message: text(m),
        })
    }
}

/// One NVIDIA device (its primary context) and NVRTC.
pub struct CudaRuntime {
    api: Api,
    nvrtc: Nvrtc,
    dev: c_int,
    ctx: Ptr,
    info: DeviceInfo,
}

// The driver API is thread-safe; every call first makes `ctx` current on the calling thread.
unsafe impl Send for CudaRuntime {}
unsafe impl Sync for CudaRuntime {}

macro_rules! call {
    ($s:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        $s.api.check(stringify!($f), unsafe { ($s.api.$f)($($a),*) })
    };
}

impl CudaRuntime {
    /// Number of visible NVIDIA devices (loads and initialises the driver).
    pub fn device_count() -> Result<usize> {
        let api = Api::load()?;
        api.check("cuInit", unsafe { (api.cuInit)(0) })?;
        let mut n = 0;
        api.check("cuDeviceGetCount", unsafe {
            (api.cuDeviceGetCount)(&mut n)
        })?;
        Ok(n.max(0) as usize)
    }

    /// Open visible device `index`: driver, primary context, NVRTC.
    pub fn new(index: usize) -> Result<CudaRuntime> {
        let api = Api::load()?;
        api.check("cuInit", unsafe { (api.cuInit)(0) })?;
        let mut count = 0;
        api.check("cuDeviceGetCount", unsafe {
            (api.cuDeviceGetCount)(&mut count)
        })?;
        if index >= count.max(0) as usize {
            return Err(GpuError::NoDevice {
                backend: "CUDA",
                index,
                count: count.max(0) as usize,
            });
        }
        let mut dev = 0;
        api.check("cuDeviceGet", unsafe {
            (api.cuDeviceGet)(&mut dev, index as c_int)
        })?;
        let mut ctx: Ptr = std::ptr::null_mut();
        api.check("cuDevicePrimaryCtxRetain", unsafe {
            (api.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
        })?;
        api.check("cuCtxSetCurrent", unsafe { (api.cuCtxSetCurrent)(ctx) })?;
        let attr = |a: c_int| -> Result<u32> {
            let mut v = 0;
            api.check("cuDeviceGetAttribute", unsafe {
                (api.cuDeviceGetAttribute)(&mut v, a, dev)
            })?;
            Ok(v.max(0) as u32)
        };
        let mut name = [0 as c_char; 256];
        api.check("cuDeviceGetName", unsafe {
            (api.cuDeviceGetName)(name.as_mut_ptr(), 256, dev)
        })?;
        let mut mem = 0usize;
        api.check("cuDeviceTotalMem_v2", unsafe {
            (api.cuDeviceTotalMem)(&mut mem, dev)
        })?;
        let mut drv = 0;
        api.check("cuDriverGetVersion", unsafe {
            (api.cuDriverGetVersion)(&mut drv)
        })?;
        let cc = (attr(ATTR_CC_MAJOR)?, attr(ATTR_CC_MINOR)?);
        let info = DeviceInfo {
            vendor: Vendor::Nvidia,
            index,
            name: unsafe { CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
            arch: cuda_arch(cc.0, cc.1),
            warp: attr(ATTR_WARP_SIZE)?,
            sm_count: attr(ATTR_MULTIPROCESSOR_COUNT)?,
            total_mem: mem as u64,
            cc,
            max_threads_per_block: attr(ATTR_MAX_THREADS_PER_BLOCK)?,
            max_shared_per_block: attr(ATTR_MAX_SHARED_PER_BLOCK_OPTIN)?,
            l2_bytes: attr(ATTR_L2_CACHE_SIZE)?,
            driver: format!("CUDA driver {}.{}", drv / 1000, (drv % 1000) / 10),
        };
        let nvrtc = Nvrtc::load()?;
        Ok(CudaRuntime {
            api,
            nvrtc,
            dev,
            ctx,
            info,
        })
    }

    fn cur(&self) -> Result<()> {
        call!(self, cuCtxSetCurrent(self.ctx))
    }
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        unsafe {
            (self.api.cuDevicePrimaryCtxRelease)(self.dev);
        }
    }
}

fn p(v: u64) -> Ptr {
    v as usize as Ptr
}

impl Runtime for CudaRuntime {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn compiler(&self) -> &dyn Compiler {
        &self.nvrtc
    }
    fn defines(&self) -> Vec<(String, String)> {
        cuda_defines(self.info.cc.0, self.info.cc.1, self.info.warp)
    }

    fn load_module(&self, code: &[u8]) -> Result<ModuleHandle> {
        self.cur()?;
        let mut m: Ptr = std::ptr::null_mut();
        call!(
            self,
            cuModuleLoadData(&mut m, code.as_ptr() as *const c_void)
        )?;
        Ok(ModuleHandle(m as usize as u64))
    }
    fn unload_module(&self, m: ModuleHandle) -> Result<()> {
        self.cur()?;
        call!(self, cuModuleUnload(p(m.0)))
    }
    fn function(&self, m: ModuleHandle, name: &str) -> Result<Option<Function>> {
        self.cur()?;
        let c =
            CString::new(name).map_err(|_| GpuError::Invalid(format!("kernel name {name:?}")))?;
        let mut f: Ptr = std::ptr::null_mut();
        let r = unsafe { (self.api.cuModuleGetFunction)(&mut f, p(m.0), c.as_ptr()) };
        if r == CUDA_ERROR_NOT_FOUND {
            return Ok(None);
        }
        self.api.check("cuModuleGetFunction", r)?;
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
            cuLaunchKernel(
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
        let mut d = 0u64;
        call!(self, cuMemAlloc(&mut d, bytes.max(1)))?;
        Ok(DevPtr(d))
    }
    fn free(&self, d: DevPtr) -> Result<()> {
        self.cur()?;
        call!(self, cuMemFree(d.0))
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(
            self,
            cuMemHostAlloc(&mut h, bytes.max(1), CU_MEMHOSTALLOC_PORTABLE)
        )?;
        Ok(h as *mut u8)
    }
    unsafe fn free_pinned(&self, h: *mut u8) -> Result<()> {
        self.cur()?;
        call!(self, cuMemFreeHost(h as Ptr))
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
            cuMemcpyHtoDAsync(dst.0, src as *const c_void, bytes, p(s.0))
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
            cuMemcpyDtoHAsync(dst as *mut c_void, src.0, bytes, p(s.0))
        )
    }
    fn copy_d2d_async(&self, dst: DevPtr, src: DevPtr, bytes: usize, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, cuMemcpyDtoDAsync(dst.0, src.0, bytes, p(s.0)))
    }
    fn memset_u32_async(&self, d: DevPtr, value: u32, count: usize, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, cuMemsetD32Async(d.0, value, count, p(s.0)))
    }

    fn stream_create(&self) -> Result<Stream> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(self, cuStreamCreate(&mut h, CU_STREAM_NON_BLOCKING))?;
        Ok(Stream(h as usize as u64))
    }
    fn stream_destroy(&self, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, cuStreamDestroy(p(s.0)))
    }
    fn stream_sync(&self, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, cuStreamSynchronize(p(s.0)))
    }
    fn event_create(&self) -> Result<Event> {
        self.cur()?;
        let mut h: Ptr = std::ptr::null_mut();
        call!(self, cuEventCreate(&mut h, 0))?;
        Ok(Event(h as usize as u64))
    }
    fn event_destroy(&self, e: Event) -> Result<()> {
        self.cur()?;
        call!(self, cuEventDestroy(p(e.0)))
    }
    fn event_record(&self, e: Event, s: Stream) -> Result<()> {
        self.cur()?;
        call!(self, cuEventRecord(p(e.0), p(s.0)))
    }
    fn event_sync(&self, e: Event) -> Result<()> {
        self.cur()?;
        call!(self, cuEventSynchronize(p(e.0)))
    }
    fn event_elapsed_ms(&self, a: Event, b: Event) -> Result<f32> {
        self.cur()?;
        let mut ms = 0f32;
        call!(self, cuEventElapsedTime(&mut ms, p(a.0), p(b.0)))?;
        Ok(ms)
    }
    fn synchronize(&self) -> Result<()> {
        self.cur()?;
        call!(self, cuCtxSynchronize())
    }
}
