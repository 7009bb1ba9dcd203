//! NVIDIA: the CUDA driver API (libcuda) through a hand-written `dlopen` table, kernels compiled
//! by NVRTC. The device index is among the devices `CUDA_VISIBLE_DEVICES` leaves visible (the
//! driver applies it; nothing here overrides it).

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

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
    cuMemGetInfo: unsafe extern "C" fn(*mut usize, *mut usize) -> R,
    cuMemFree: unsafe extern "C" fn(u64) -> R,
    cuMemHostAlloc: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R,
    cuMemFreeHost: unsafe extern "C" fn(Ptr) -> R,
    cuMemHostRegister: unsafe extern "C" fn(Ptr, usize, c_uint) -> R,
    cuMemHostUnregister: unsafe extern "C" fn(Ptr) -> R,
    cuMemHostGetDevicePointer: unsafe extern "C" fn(*mut u64, Ptr, c_uint) -> R,
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
    /// `cuFuncSetAttribute` (a kernel's dynamic shared memory past 48 KiB; None: not raised).
    cuFuncSetAttribute: Option<unsafe extern "C" fn(Ptr, c_int, c_int) -> R>,
    /// `cuLaunchKernelEx` (CUDA 12+; None: no programmatic dependent launch).
    cuLaunchKernelEx: Option<
        unsafe extern "C" fn(*const LaunchConfig, Ptr, *mut *mut c_void, *mut *mut c_void) -> R,
    >,
    /// Graph entry points (None on a driver without them: graphs off).
    graph: Option<GraphApi>,
    /// `cuProfilerStart` / `cuProfilerStop` (profiler capture ranges, `DS4_GPU_CUPROFILE`).
    profiler: Option<(unsafe extern "C" fn() -> R, unsafe extern "C" fn() -> R)>,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (cuda.h, CUDA 12); the v1 entry points read its first 56 bytes,
/// which are the v1 struct.
#[repr(C)]
struct KernelNodeParams {
    func: Ptr,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    kern: Ptr,
    ctx: Ptr,
}

/// `CUlaunchAttribute` (cuda.h): id, 4 bytes of padding, a 64-byte value union.
#[repr(C)]
struct LaunchAttr {
    id: c_uint,
    pad: [u8; 4],
    value: [u8; 64],
}

/// `CUlaunchConfig` (cuda.h).
#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: Ptr,
    attrs: *const LaunchAttr,
    num_attrs: c_uint,
}

/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` (value: int programmaticStreamSerializationAllowed).
const CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: c_uint = 6;

/// `CUgraphEdgeData` (cuda.h, CUDA 12.3): from_port, to_port, type, 5 reserved bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct EdgeData([u8; 8]);

#[allow(non_snake_case)]
struct GraphApi {
    cuStreamBeginCapture: unsafe extern "C" fn(Ptr, c_int) -> R,
    cuStreamEndCapture: unsafe extern "C" fn(Ptr, *mut Ptr) -> R,
    cuGraphInstantiateWithFlags: unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> R,
    cuGraphGetRootNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    cuGraphGetNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    cuGraphNodeGetDependentNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    /// With edge data (CUDA 12.3+): the v1 query refuses (CUDA_ERROR_LOSSY_QUERY) the
    /// programmatic edges that PDL launches leave in a captured graph.
    cuGraphNodeGetDependentNodes_v2:
        Option<unsafe extern "C" fn(Ptr, *mut Ptr, *mut EdgeData, *mut usize) -> R>,
    cuGraphNodeGetType: unsafe extern "C" fn(Ptr, *mut c_int) -> R,
    cuGraphExecKernelNodeSetParams: unsafe extern "C" fn(Ptr, Ptr, *const KernelNodeParams) -> R,
    cuGraphLaunch: unsafe extern "C" fn(Ptr, Ptr) -> R,
    cuGraphExecDestroy: unsafe extern "C" fn(Ptr) -> R,
    cuGraphDestroy: unsafe extern "C" fn(Ptr) -> R,
    /// Branched captures (two streams joined by events; `Runtime::branches_supported`).
    cuStreamWaitEvent: Option<unsafe extern "C" fn(Ptr, Ptr, c_uint) -> R>,
    /// The node a capturing stream's next launch will follow (CUDA 11.3+): stream, status,
    /// id, graph, dependencies, count.
    cuStreamGetCaptureInfo_v2: Option<
        unsafe extern "C" fn(Ptr, *mut c_int, *mut u64, *mut Ptr, *mut *const Ptr, *mut usize) -> R,
    >,
    /// The same with edge data (CUDA 12.3+; the form CUDA 13 keeps).
    cuStreamGetCaptureInfo_v3: Option<
        unsafe extern "C" fn(
            Ptr,
            *mut c_int,
            *mut u64,
            *mut Ptr,
            *mut *const Ptr,
            *mut *const EdgeData,
            *mut usize,
        ) -> R,
    >,
}

impl GraphApi {
    fn load(lib: &Lib) -> Result<GraphApi> {
        unsafe {
            Ok(GraphApi {
                cuStreamBeginCapture: lib.sym("cuStreamBeginCapture_v2")?,
                cuStreamEndCapture: lib.sym("cuStreamEndCapture")?,
                cuGraphInstantiateWithFlags: lib.sym("cuGraphInstantiateWithFlags")?,
                cuGraphGetRootNodes: lib.sym("cuGraphGetRootNodes")?,
                cuGraphGetNodes: lib.sym("cuGraphGetNodes")?,
                cuGraphNodeGetDependentNodes: lib.sym("cuGraphNodeGetDependentNodes")?,
                cuGraphNodeGetDependentNodes_v2: lib.sym("cuGraphNodeGetDependentNodes_v2").ok(),
                cuGraphNodeGetType: lib.sym("cuGraphNodeGetType")?,
                cuGraphExecKernelNodeSetParams: lib.sym_any(&[
                    "cuGraphExecKernelNodeSetParams_v2",
                    "cuGraphExecKernelNodeSetParams",
                ])?,
                cuGraphLaunch: lib.sym("cuGraphLaunch")?,
                cuGraphExecDestroy: lib.sym("cuGraphExecDestroy")?,
                cuGraphDestroy: lib.sym("cuGraphDestroy")?,
                cuStreamWaitEvent: lib.sym("cuStreamWaitEvent").ok(),
                cuStreamGetCaptureInfo_v2: lib.sym("cuStreamGetCaptureInfo_v2").ok(),
                cuStreamGetCaptureInfo_v3: lib.sym("cuStreamGetCaptureInfo_v3").ok(),
            })
        }
    }
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
/// cuMemHostRegister flags: every context may use it, mapped into the device's address space
/// (kernels may read it over the bus); the device only reads it (what a read-only file mapping
/// needs).
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;
const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 8;
const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
const CU_GRAPH_NODE_TYPE_KERNEL: c_int = 0;

/// Ids of runtimes, so a thread can tell whether its current context is already this one's.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
thread_local! {
    /// Id of the runtime whose context this thread made current last (0: none).
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

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
                cuMemGetInfo: lib.sym("cuMemGetInfo_v2")?,
                cuMemFree: lib.sym("cuMemFree_v2")?,
                cuMemHostAlloc: lib.sym("cuMemHostAlloc")?,
                cuMemFreeHost: lib.sym("cuMemFreeHost")?,
                cuMemHostRegister: lib.sym("cuMemHostRegister_v2")?,
                cuMemHostUnregister: lib.sym("cuMemHostUnregister")?,
                cuMemHostGetDevicePointer: lib.sym("cuMemHostGetDevicePointer_v2")?,
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
                cuFuncSetAttribute: lib.sym("cuFuncSetAttribute").ok(),
                cuLaunchKernelEx: lib.sym("cuLaunchKernelEx").ok(),
                graph: GraphApi::load(&lib).ok(),
                profiler: lib
                    .sym("cuProfilerStart")
                    .and_then(|a| Ok((a, lib.sym("cuProfilerStop")?)))
                    .ok(),
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
    /// Unique per runtime (see [`CURRENT`]).
    id: u64,
    /// Kernels launched with programmatic dependent launch ([`Runtime::set_pdl`]).
    pdl: std::sync::RwLock<std::collections::HashSet<u64>>,
    /// `pdl` is not empty (skips the lookup on every launch otherwise).
    pdl_any: std::sync::atomic::AtomicBool,
    /// Dynamic shared memory each function was opted in to past the default 48 KiB.
    smem_optin: std::sync::RwLock<std::collections::HashMap<u64, u32>>,
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
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            pdl: Default::default(),
            smem_optin: Default::default(),
            pdl_any: Default::default(),
        })
    }

    /// Make the context current on this thread unless this runtime already did (one
    /// thread-local compare on the launch path instead of a driver call).
    fn cur(&self) -> Result<()> {
        if CURRENT.with(|c| c.get()) == self.id {
            return Ok(());
        }
        call!(self, cuCtxSetCurrent(self.ctx))?;
        CURRENT.with(|c| c.set(self.id));
        Ok(())
    }

    fn gapi(&self) -> Result<&GraphApi> {
        self.api
            .graph
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("this CUDA driver has no graph API".into()))
    }

    /// End the capture on `s`, list its kernel nodes in launch order with `nodes` (given the
    /// graph and its node count) and instantiate it; on any error the graph is destroyed.
    fn end_capture(
        &self,
        s: Stream,
        nodes: impl FnOnce(&GraphApi, Ptr, usize) -> Result<Vec<u64>>,
    ) -> Result<GraphExec> {
        let g = self.gapi()?;
        self.cur()?;
        let mut graph: Ptr = std::ptr::null_mut();
        self.api.check("cuStreamEndCapture", unsafe {
            (g.cuStreamEndCapture)(p(s.0), &mut graph)
        })?;
        let destroy = |e: GpuError| {
            unsafe { (g.cuGraphDestroy)(graph) };
            e
        };
        let mut total = 0usize;
        self.api
            .check("cuGraphGetNodes", unsafe {
                (g.cuGraphGetNodes)(graph, std::ptr::null_mut(), &mut total)
            })
            .map_err(destroy)?;
        let nodes = nodes(g, graph, total).map_err(destroy)?;
        let mut exec: Ptr = std::ptr::null_mut();
        self.api
            .check("cuGraphInstantiateWithFlags", unsafe {
                (g.cuGraphInstantiateWithFlags)(&mut exec, graph, 0)
            })
            .map_err(destroy)?;
        Ok(GraphExec {
            exec: exec as usize as u64,
            graph: graph as usize as u64,
            nodes,
        })
    }

    fn launch_slots(
        &self,
        f: Function,
        d: LaunchDims,
        s: Stream,
        slots: &[u64],
        pdl: bool,
    ) -> Result<()> {
        self.cur()?;
        if d.shared_bytes > 48 * 1024 {
            // More than the default 48 KiB of dynamic shared memory: the function's opt-in
            // (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), raised once per function and size.
            let done = self
                .smem_optin
                .read()
                .unwrap()
                .get(&f.0)
                .is_some_and(|&b| b >= d.shared_bytes);
            if let (false, Some(set)) = (done, self.api.cuFuncSetAttribute) {
                const MAX_DYNAMIC_SHARED: c_int = 8;
                self.api.check("cuFuncSetAttribute", unsafe {
                    set(p(f.0), MAX_DYNAMIC_SHARED, d.shared_bytes as c_int)
                })?;
                self.smem_optin.write().unwrap().insert(f.0, d.shared_bytes);
            }
        }
        // Fixed arrays: no allocation per launch.
        let mut vals = [0u64; MAX_ARGS];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        if slots.len() > MAX_ARGS {
            return Err(GpuError::Invalid(format!(
                "{} kernel arguments",
                slots.len()
            )));
        }
        vals[..slots.len()].copy_from_slice(slots);
        for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()) {
            *p = v as *mut u64 as *mut c_void;
        }
        if pdl && self.pdl_any.load(Ordering::Relaxed) && self.pdl.read().unwrap().contains(&f.0) {
            if let Some(ex) = self.api.cuLaunchKernelEx {
                let mut attr = LaunchAttr {
                    id: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                    pad: [0; 4],
                    value: [0; 64],
                };
                attr.value[..4].copy_from_slice(&1i32.to_ne_bytes());
                let cfg = LaunchConfig {
                    grid: d.grid,
                    block: d.block,
                    shared: d.shared_bytes,
                    stream: p(s.0),
                    attrs: &attr,
                    num_attrs: 1,
                };
                return self.api.check("cuLaunchKernelEx", unsafe {
                    ex(&cfg, p(f.0), ptrs.as_mut_ptr(), std::ptr::null_mut())
                });
            }
        }
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
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        CURRENT.with(|c| {
            if c.get() == self.id {
                c.set(0)
            }
        });
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
        if args.len() > MAX_ARGS {
            return Err(GpuError::Invalid(format!(
                "{} kernel arguments",
                args.len()
            )));
        }
        let mut slots = [0u64; MAX_ARGS];
        for (v, a) in slots.iter_mut().zip(args) {
            *v = a.slot();
        }
        self.launch_slots(f, d, s, &slots[..args.len()], true)
    }
    fn launch_call(&self, c: &KernelCall, s: Stream) -> Result<()> {
        self.launch_slots(c.f, c.dims, s, c.args(), true)
    }
    fn launch_call_plain(&self, c: &KernelCall, s: Stream) -> Result<()> {
        self.launch_slots(c.f, c.dims, s, c.args(), false)
    }

    fn graphs_supported(&self) -> bool {
        self.api.graph.is_some()
    }
    fn capture_begin(&self, s: Stream) -> Result<()> {
        let g = self.gapi()?;
        self.cur()?;
        self.api.check("cuStreamBeginCapture_v2", unsafe {
            (g.cuStreamBeginCapture)(p(s.0), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })
    }
    fn capture_end(&self, s: Stream) -> Result<GraphExec> {
        // The nodes in order: the capture of one stream is a chain from its one root.
        self.end_capture(s, |g, graph, total| {
            let mut nodes: Vec<u64> = Vec::with_capacity(total);
            let mut next: Ptr = std::ptr::null_mut();
            let mut cnt = 1usize;
            self.api.check("cuGraphGetRootNodes", unsafe {
                (g.cuGraphGetRootNodes)(graph, &mut next, &mut cnt)
            })?;
            let mut have = cnt;
            while have == 1 && nodes.len() < total {
                let mut ty = -1;
                self.api.check("cuGraphNodeGetType", unsafe {
                    (g.cuGraphNodeGetType)(next, &mut ty)
                })?;
                if ty != CU_GRAPH_NODE_TYPE_KERNEL {
                    break;
                }
                nodes.push(next as usize as u64);
                let cur = next;
                let mut c = 1usize;
                let mut edge = EdgeData::default();
                self.api.check("cuGraphNodeGetDependentNodes", unsafe {
                    match g.cuGraphNodeGetDependentNodes_v2 {
                        Some(v2) => v2(cur, &mut next, &mut edge, &mut c),
                        None => (g.cuGraphNodeGetDependentNodes)(cur, &mut next, &mut c),
                    }
                })?;
                have = c;
            }
            if nodes.len() != total || have != 0 {
                return Err(GpuError::Invalid(format!(
                    "captured graph is not a chain of {total} kernel nodes"
                )));
            }
            Ok(nodes)
        })
    }
    fn branches_supported(&self) -> bool {
        self.api.graph.as_ref().is_some_and(|g| {
            g.cuStreamWaitEvent.is_some()
                && (g.cuStreamGetCaptureInfo_v2.is_some() || g.cuStreamGetCaptureInfo_v3.is_some())
        })
    }
    fn stream_wait_event(&self, s: Stream, e: Event) -> Result<()> {
        let w = self
            .gapi()?
            .cuStreamWaitEvent
            .ok_or_else(|| GpuError::Invalid("no cuStreamWaitEvent".into()))?;
        self.cur()?;
        self.api
            .check("cuStreamWaitEvent", unsafe { w(p(s.0), p(e.0), 0) })
    }
    fn capture_node(&self, s: Stream) -> Result<u64> {
        let g = self.gapi()?;
        self.cur()?;
        let mut status: c_int = 0;
        let mut deps: *const Ptr = std::ptr::null();
        let mut n = 0usize;
        let r = unsafe {
            match (g.cuStreamGetCaptureInfo_v3, g.cuStreamGetCaptureInfo_v2) {
                (Some(v3), _) => {
                    let mut edges: *const EdgeData = std::ptr::null();
                    v3(
                        p(s.0),
                        &mut status,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        &mut deps,
                        &mut edges,
                        &mut n,
                    )
                }
                (None, Some(v2)) => v2(
                    p(s.0),
                    &mut status,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut deps,
                    &mut n,
                ),
                (None, None) => return Err(GpuError::Invalid("no cuStreamGetCaptureInfo".into())),
            }
        };
        self.api.check("cuStreamGetCaptureInfo", r)?;
        // CU_STREAM_CAPTURE_STATUS_ACTIVE = 1; after a launch the stream's one dependency is
        // that launch's node.
        if status != 1 || n != 1 || deps.is_null() {
            return Err(GpuError::Invalid(format!(
                "capture info: status {status}, {n} dependencies after a launch"
            )));
        }
        Ok(unsafe { *deps } as usize as u64)
    }
    fn capture_end_nodes(&self, s: Stream, nodes: Vec<u64>) -> Result<GraphExec> {
        // Event records and waits between the streams became edges: the graph holds the
        // launches' kernel nodes only.
        self.end_capture(s, |_, _, total| {
            if total != nodes.len() {
                return Err(GpuError::Invalid(format!(
                    "branched capture: {total} nodes for {} launches",
                    nodes.len()
                )));
            }
            Ok(nodes)
        })
    }
    fn graph_set(&self, ge: &GraphExec, i: usize, c: &KernelCall) -> Result<()> {
        let g = self.gapi()?;
        self.cur()?;
        let mut vals = c.slots;
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()) {
            *p = v as *mut u64 as *mut c_void;
        }
        let prm = KernelNodeParams {
            func: p(c.f.0),
            grid: c.dims.grid,
            block: c.dims.block,
            shared: c.dims.shared_bytes,
            params: ptrs.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        self.api.check("cuGraphExecKernelNodeSetParams", unsafe {
            (g.cuGraphExecKernelNodeSetParams)(p(ge.exec), p(ge.nodes[i]), &prm)
        })
    }
    fn graph_launch(&self, ge: &GraphExec, s: Stream) -> Result<()> {
        let g = self.gapi()?;
        self.cur()?;
        self.api.check("cuGraphLaunch", unsafe {
            (g.cuGraphLaunch)(p(ge.exec), p(s.0))
        })
    }
    fn profiler(&self, on: bool) {
        if let (Some((start, stop)), Ok(())) = (self.api.profiler, self.cur()) {
            unsafe {
                if on {
                    start()
                } else {
                    stop()
                }
            };
        }
    }

    fn set_pdl(&self, f: Function) -> bool {
        if self.api.cuLaunchKernelEx.is_none() || self.info.cc.0 < 9 {
            return false;
        }
        self.pdl.write().unwrap().insert(f.0);
        self.pdl_any.store(true, Ordering::Relaxed);
        true
    }

    fn graph_destroy(&self, ge: &GraphExec) {
        if let Ok(g) = self.gapi() {
            if self.cur().is_ok() {
                unsafe {
                    (g.cuGraphExecDestroy)(p(ge.exec));
                    (g.cuGraphDestroy)(p(ge.graph));
                }
            }
        }
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
    unsafe fn host_register(&self, p: *const u8, bytes: usize) -> Result<()> {
        self.cur()?;
        // Mapped first (kernels may then read it: `host_device_ptr`), then unmapped (DMA only);
        // read-only first (a file's read-only mapping needs it): a device without read-only
        // registration (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) refuses the
        // flag, and writable memory registers without it.
        let (pt, m, ro) = (
            CU_MEMHOSTREGISTER_PORTABLE,
            CU_MEMHOSTREGISTER_DEVICEMAP,
            CU_MEMHOSTREGISTER_READ_ONLY,
        );
        let mut r = Ok(());
        for flags in [pt | m | ro, pt | m, pt | ro, pt] {
            r = call!(self, cuMemHostRegister(p as Ptr, bytes, flags));
            if r.is_ok() {
                break;
            }
        }
        r
    }
    unsafe fn host_unregister(&self, p: *const u8) -> Result<()> {
        self.cur()?;
        call!(self, cuMemHostUnregister(p as Ptr))
    }
    unsafe fn host_device_ptr(&self, p: *const u8) -> Result<DevPtr> {
        self.cur()?;
        let mut d = 0u64;
        call!(self, cuMemHostGetDevicePointer(&mut d, p as Ptr, 0))?;
        Ok(DevPtr(d))
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
    fn make_current(&self) -> Result<()> {
        self.cur()
    }
    fn mem_info(&self) -> Result<(u64, u64)> {
        self.cur()?;
        let (mut free, mut total) = (0usize, 0usize);
        call!(self, cuMemGetInfo(&mut free, &mut total))?;
        Ok((free as u64, total as u64))
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
