//! AMD: the HIP runtime (libamdhip64) through a hand-written `dlopen` table, kernels compiled by
//! hipRTC. `HIP_VISIBLE_DEVICES` / `ROCR_VISIBLE_DEVICES` are applied by the runtime.
//!
//! Never run on AMD hardware here: loading, symbol resolution and hipRTC compilation are
//! exercised without a GPU; device calls are written against the ROCm 5/6 API and unverified.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};

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
    hipMemGetInfo: unsafe extern "C" fn(*mut usize, *mut usize) -> R,
    hipFree: unsafe extern "C" fn(Ptr) -> R,
    hipHostMalloc: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R,
    hipHostFree: unsafe extern "C" fn(Ptr) -> R,
    hipHostRegister: unsafe extern "C" fn(Ptr, usize, c_uint) -> R,
    hipHostUnregister: unsafe extern "C" fn(Ptr) -> R,
    hipHostGetDevicePointer: unsafe extern "C" fn(*mut u64, Ptr, c_uint) -> R,
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
    /// Graph entry points (None on a runtime without them: graphs off).
    graph: Option<GraphApi>,
}

/// `hipKernelNodeParams` (hip_runtime_api.h).
#[repr(C)]
struct KernelNodeParams {
    block: [c_uint; 3],
    extra: *mut *mut c_void,
    func: Ptr,
    grid: [c_uint; 3],
    params: *mut *mut c_void,
    shared: c_uint,
}

#[allow(non_snake_case)]
struct GraphApi {
    hipStreamBeginCapture: unsafe extern "C" fn(Ptr, c_int) -> R,
    hipStreamEndCapture: unsafe extern "C" fn(Ptr, *mut Ptr) -> R,
    hipGraphInstantiateWithFlags: unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> R,
    hipGraphGetRootNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    hipGraphGetNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    hipGraphNodeGetDependentNodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> R,
    hipGraphNodeGetType: unsafe extern "C" fn(Ptr, *mut c_int) -> R,
    hipGraphExecKernelNodeSetParams: unsafe extern "C" fn(Ptr, Ptr, *const KernelNodeParams) -> R,
    hipGraphLaunch: unsafe extern "C" fn(Ptr, Ptr) -> R,
    hipGraphExecDestroy: unsafe extern "C" fn(Ptr) -> R,
    hipGraphDestroy: unsafe extern "C" fn(Ptr) -> R,
}

impl GraphApi {
    fn load(lib: &Lib) -> Result<GraphApi> {
        unsafe {
            Ok(GraphApi {
                hipStreamBeginCapture: lib.sym("hipStreamBeginCapture")?,
                hipStreamEndCapture: lib.sym("hipStreamEndCapture")?,
                hipGraphInstantiateWithFlags: lib.sym("hipGraphInstantiateWithFlags")?,
                hipGraphGetRootNodes: lib.sym("hipGraphGetRootNodes")?,
                hipGraphGetNodes: lib.sym("hipGraphGetNodes")?,
                hipGraphNodeGetDependentNodes: lib.sym("hipGraphNodeGetDependentNodes")?,
                hipGraphNodeGetType: lib.sym("hipGraphNodeGetType")?,
                hipGraphExecKernelNodeSetParams: lib.sym("hipGraphExecKernelNodeSetParams")?,
                hipGraphLaunch: lib.sym("hipGraphLaunch")?,
                hipGraphExecDestroy: lib.sym("hipGraphExecDestroy")?,
                hipGraphDestroy: lib.sym("hipGraphDestroy")?,
            })
        }
    }
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
/// hipHostRegister flags: portable, mapped, read-only for the device (as CUDA's).
const HIP_HOST_REGISTER_PORTABLE: c_uint = 1;
const HIP_HOST_REGISTER_MAPPED: c_uint = 2;
const HIP_HOST_REGISTER_READ_ONLY: c_uint = 8;
const HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
const HIP_GRAPH_NODE_TYPE_KERNEL: c_int = 0;

/// Ids of runtimes, so a thread can tell whether its current device is already this one's.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
thread_local! {
    /// Id of the runtime that set this thread's device last (0: none).
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

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
                hipMemGetInfo: lib.sym("hipMemGetInfo")?,
                hipFree: lib.sym("hipFree")?,
                hipHostMalloc: lib.sym("hipHostMalloc")?,
                hipHostFree: lib.sym("hipHostFree")?,
                hipHostRegister: lib.sym("hipHostRegister")?,
                hipHostUnregister: lib.sym("hipHostUnregister")?,
                hipHostGetDevicePointer: lib.sym("hipHostGetDevicePointer")?,
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
                graph: GraphApi::load(&lib).ok(),
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
    /// Unique per runtime (see [`CURRENT`]).
    id: u64,
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
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Set the device on this thread unless this runtime already did.
    fn cur(&self) -> Result<()> {
        if CURRENT.with(|c| c.get()) == self.id {
            return Ok(());
        }
        call!(self, hipSetDevice(self.dev))?;
        CURRENT.with(|c| c.set(self.id));
        Ok(())
    }

    fn gapi(&self) -> Result<&GraphApi> {
        self.api
            .graph
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("this HIP runtime has no graph API".into()))
    }

    fn launch_slots(&self, f: Function, d: LaunchDims, s: Stream, slots: &[u64]) -> Result<()> {
        self.cur()?;
        if slots.len() > MAX_ARGS {
            return Err(GpuError::Invalid(format!(
                "{} kernel arguments",
                slots.len()
            )));
        }
        let mut vals = [0u64; MAX_ARGS];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        vals[..slots.len()].copy_from_slice(slots);
        for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()) {
            *p = v as *mut u64 as *mut c_void;
        }
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
        self.launch_slots(f, d, s, &slots[..args.len()])
    }
    fn launch_call(&self, c: &KernelCall, s: Stream) -> Result<()> {
        self.launch_slots(c.f, c.dims, s, c.args())
    }

    // Graphs: the same chain-of-kernels scheme as cuda.rs; compiled, never run on AMD.
    fn graphs_supported(&self) -> bool {
        self.api.graph.is_some()
    }
    fn capture_begin(&self, s: Stream) -> Result<()> {
        let g = self.gapi()?;
        self.cur()?;
        self.api.check("hipStreamBeginCapture", unsafe {
            (g.hipStreamBeginCapture)(p(s.0), HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })
    }
    fn capture_end(&self, s: Stream) -> Result<GraphExec> {
        let g = self.gapi()?;
        self.cur()?;
        let mut graph: Ptr = std::ptr::null_mut();
        self.api.check("hipStreamEndCapture", unsafe {
            (g.hipStreamEndCapture)(p(s.0), &mut graph)
        })?;
        let destroy = |e: GpuError| {
            unsafe { (g.hipGraphDestroy)(graph) };
            e
        };
        let mut total = 0usize;
        self.api
            .check("hipGraphGetNodes", unsafe {
                (g.hipGraphGetNodes)(graph, std::ptr::null_mut(), &mut total)
            })
            .map_err(destroy)?;
        let mut nodes: Vec<u64> = Vec::with_capacity(total);
        let mut next: Ptr = std::ptr::null_mut();
        let mut cnt = 1usize;
        self.api
            .check("hipGraphGetRootNodes", unsafe {
                (g.hipGraphGetRootNodes)(graph, &mut next, &mut cnt)
            })
            .map_err(destroy)?;
        let mut have = cnt;
        while have == 1 && nodes.len() < total {
            let mut ty = -1;
            self.api
                .check("hipGraphNodeGetType", unsafe {
                    (g.hipGraphNodeGetType)(next, &mut ty)
                })
                .map_err(destroy)?;
            if ty != HIP_GRAPH_NODE_TYPE_KERNEL {
                break;
            }
            nodes.push(next as usize as u64);
            let cur = next;
            let mut c = 1usize;
            self.api
                .check("hipGraphNodeGetDependentNodes", unsafe {
                    (g.hipGraphNodeGetDependentNodes)(cur, &mut next, &mut c)
                })
                .map_err(destroy)?;
            have = c;
        }
        if nodes.len() != total || have != 0 {
            return Err(destroy(GpuError::Invalid(format!(
                "captured graph is not a chain of {total} kernel nodes"
            ))));
        }
        let mut exec: Ptr = std::ptr::null_mut();
        self.api
            .check("hipGraphInstantiateWithFlags", unsafe {
                (g.hipGraphInstantiateWithFlags)(&mut exec, graph, 0)
            })
            .map_err(destroy)?;
        Ok(GraphExec {
            exec: exec as usize as u64,
            graph: graph as usize as u64,
            nodes,
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
            block: c.dims.block,
            extra: std::ptr::null_mut(),
            func: p(c.f.0),
            grid: c.dims.grid,
            params: ptrs.as_mut_ptr(),
            shared: c.dims.shared_bytes,
        };
        self.api.check("hipGraphExecKernelNodeSetParams", unsafe {
            (g.hipGraphExecKernelNodeSetParams)(p(ge.exec), p(ge.nodes[i]), &prm)
        })
    }
    fn graph_launch(&self, ge: &GraphExec, s: Stream) -> Result<()> {
        let g = self.gapi()?;
        self.cur()?;
        self.api.check("hipGraphLaunch", unsafe {
            (g.hipGraphLaunch)(p(ge.exec), p(s.0))
        })
    }
    fn graph_destroy(&self, ge: &GraphExec) {
        if let Ok(g) = self.gapi() {
            if self.cur().is_ok() {
                unsafe {
                    (g.hipGraphExecDestroy)(p(ge.exec));
                    (g.hipGraphDestroy)(p(ge.graph));
                }
            }
        }
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
    unsafe fn host_register(&self, p: *const u8, bytes: usize) -> Result<()> {
        self.cur()?;
        // As CUDA's: mapped and read-only first, then without what the runtime refuses.
        let (pt, m, ro) = (
            HIP_HOST_REGISTER_PORTABLE,
            HIP_HOST_REGISTER_MAPPED,
            HIP_HOST_REGISTER_READ_ONLY,
        );
        let mut r = Ok(());
        for flags in [pt | m | ro, pt | m, pt | ro, pt] {
            r = call!(self, hipHostRegister(p as Ptr, bytes, flags));
            if r.is_ok() {
                break;
            }
        }
        r
    }
    unsafe fn host_unregister(&self, p: *const u8) -> Result<()> {
        self.cur()?;
        call!(self, hipHostUnregister(p as Ptr))
    }
    unsafe fn host_device_ptr(&self, p: *const u8) -> Result<DevPtr> {
        self.cur()?;
        let mut d = 0u64;
        call!(self, hipHostGetDevicePointer(&mut d, p as Ptr, 0))?;
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
    fn make_current(&self) -> Result<()> {
        self.cur()
    }
    fn mem_info(&self) -> Result<(u64, u64)> {
        self.cur()?;
        let (mut free, mut total) = (0usize, 0usize);
        call!(self, hipMemGetInfo(&mut free, &mut total))?;
        Ok((free as u64, total as u64))
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
