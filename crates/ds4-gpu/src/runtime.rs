//! The vendor trait: the few driver operations the engine needs, implemented by
//! [`crate::cuda::CudaRuntime`] and [`crate::hip::HipRuntime`]. Handles are opaque integers
//! (driver pointers); all calls take `&self` and make the device's context current first, so a
//! runtime may be used from any thread.

use std::fmt;

use crate::compiler::Compiler;
use crate::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Vendor {
    Nvidia,
    Amd,
}

impl fmt::Display for Vendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Vendor::Nvidia => "cuda",
            Vendor::Amd => "rocm",
        })
    }
}

/// What the host needs to know about a device to compile and size kernels.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub vendor: Vendor,
    /// Index among the visible devices (after `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`).
    pub index: usize,
    pub name: String,
    /// Compiler target: `sm_90a`, `gfx90a`, ...
    pub arch: String,
    /// Warp (wavefront) width: 32 or 64.
    pub warp: u32,
    /// Streaming multiprocessors (compute units).
    pub sm_count: u32,
    pub total_mem: u64,
    /// CUDA compute capability (major, minor); (0, 0) on AMD.
    pub cc: (u32, u32),
    pub max_threads_per_block: u32,
    /// Shared memory a block may opt in to, bytes.
    pub max_shared_per_block: u32,
    pub l2_bytes: u32,
    /// Driver/runtime version as the vendor reports it.
    pub driver: String,
}

/// A device allocation's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: u64) -> DevPtr {
        DevPtr(self.0 + bytes)
    }
}

/// A stream (queue of device work). `Stream::DEFAULT` is the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(pub u64);
impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event(pub u64);
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleHandle(pub u64);
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Function(pub u64);

/// One kernel argument, passed by value as the kernel's C signature declares it.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(DevPtr),
    /// A null pointer (optional inputs).
    Null,
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The value in an 8-byte slot, little-endian from the first byte (what the driver reads
    /// for a parameter of the kernel's declared size).
    pub(crate) fn slot(&self) -> u64 {
        match *self {
            Arg::Ptr(p) => p.0,
            Arg::Null => 0,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Grid and block shape of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

impl LaunchDims {
    pub fn linear(grid: u32, block: u32) -> LaunchDims {
        LaunchDims {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_bytes: 0,
        }
    }
}

/// Most arguments a [`KernelCall`] holds (the widest kernels: attend_one_f32 24, its probe 25).
pub const MAX_ARGS: usize = 32;

/// One launch as plain data: the kernel, its shape and its argument slots (each argument in an
/// 8-byte slot, see [`Arg`]). What the graph recorder stores and compares between steps.
#[derive(Debug, Clone, Copy)]
pub struct KernelCall {
    pub f: Function,
    pub dims: LaunchDims,
    pub n: u8,
    /// Where the call sits in a step with two branches ([`FLOW_MAIN`], [`FLOW_SIDE`],
    /// [`FLOW_JOIN`]; `ds4_backend::Backend::side_begin`).
    pub flow: u8,
    pub slots: [u64; MAX_ARGS],
}

/// A call of the main chain (after the previous call of the main chain).
pub const FLOW_MAIN: u8 = 0;
/// A call of the side branch: a run of side calls forks from the main chain's state before its
/// first call and may run concurrently with the main calls after it, up to the next
/// [`FLOW_JOIN`] call (or the end of the graph).
pub const FLOW_SIDE: u8 = 1;
/// A main call that waits for the side branch too (the first consumer after the join).
pub const FLOW_JOIN: u8 = 2;
/// A hint (`Backend::prefetch`) on a chain of its own: it forks from the main chain's state
/// at its place and nothing waits for it before the end of the graph, so the main chain's
/// next call does not wait for it.
pub const FLOW_HINT: u8 = 3;

/// Equal kernel, shape, place in the branches and used argument slots (the graph recorder
/// compares ~800 calls a decode step: the unused slots, always zero, are not read).
impl PartialEq for KernelCall {
    fn eq(&self, o: &Self) -> bool {
        self.f == o.f
            && self.dims == o.dims
            && self.n == o.n
            && self.flow == o.flow
            && self.slots[..self.n as usize] == o.slots[..o.n as usize]
    }
}

impl Eq for KernelCall {}

impl KernelCall {
    /// None when `args` has more than [`MAX_ARGS`] entries.
    pub fn new(f: Function, dims: LaunchDims, args: &[Arg]) -> Option<KernelCall> {
        if args.len() > MAX_ARGS {
            return None;
        }
        let mut slots = [0u64; MAX_ARGS];
        for (s, a) in slots.iter_mut().zip(args) {
            *s = a.slot();
        }
        Some(KernelCall {
            f,
            dims,
            n: args.len() as u8,
            flow: FLOW_MAIN,
            slots,
        })
    }
    pub fn args(&self) -> &[u64] {
        &self.slots[..self.n as usize]
    }
}

/// An instantiated graph: driver handles of the executable and of the graph it came from
/// (kept alive: its node handles address the executable's nodes), and its kernel nodes in
/// capture order.
#[derive(Debug)]
pub struct GraphExec {
    pub exec: u64,
    pub graph: u64,
    pub nodes: Vec<u64>,
}

/// The vendor runtime: device info, code loading, launches, memory, streams and events.
pub trait Runtime: Send + Sync {
    fn info(&self) -> &DeviceInfo;
    /// The compiler for this device's code objects.
    fn compiler(&self) -> &dyn Compiler;
    /// `-D` defines every module gets on this device (vendor, warp width, arch).
    fn defines(&self) -> Vec<(String, String)>;

    fn load_module(&self, code: &[u8]) -> Result<ModuleHandle>;
    fn unload_module(&self, m: ModuleHandle) -> Result<()>;
    /// Look up an `extern "C"` kernel; `None` when the module has no such symbol.
    fn function(&self, m: ModuleHandle, name: &str) -> Result<Option<Function>>;
    fn launch(&self, f: Function, dims: LaunchDims, stream: Stream, args: &[Arg]) -> Result<()>;
    /// [`Runtime::launch`] of a recorded call.
    fn launch_call(&self, c: &KernelCall, stream: Stream) -> Result<()>;

    /// Whether the graph calls below work here (driver entry points present).
    fn graphs_supported(&self) -> bool {
        false
    }
    /// Start capturing the work queued on `s` (a created stream, not [`Stream::DEFAULT`]) into
    /// a graph instead of running it (capture mode: this thread only).
    fn capture_begin(&self, _s: Stream) -> Result<()> {
        Err(crate::error::GpuError::Invalid(
            "graphs are not supported here".into(),
        ))
    }
    /// End the capture on `s`, instantiate it, and list its nodes in order (the capture must
    /// be a chain of kernel nodes: one stream, kernels only).
    fn capture_end(&self, _s: Stream) -> Result<GraphExec> {
        Err(crate::error::GpuError::Invalid(
            "graphs are not supported here".into(),
        ))
    }
    /// Replace node `i`'s kernel, shape and arguments in the executable graph (later launches
    /// see them; launches already queued do not).
    fn graph_set(&self, _g: &GraphExec, _i: usize, _c: &KernelCall) -> Result<()> {
        Err(crate::error::GpuError::Invalid(
            "graphs are not supported here".into(),
        ))
    }
    /// Queue one run of the graph on `s`.
    fn graph_launch(&self, _g: &GraphExec, _s: Stream) -> Result<()> {
        Err(crate::error::GpuError::Invalid(
            "graphs are not supported here".into(),
        ))
    }
    fn graph_destroy(&self, _g: &GraphExec) {}
    /// Whether a capture may fork onto a second stream ([`Runtime::stream_wait_event`],
    /// [`Runtime::capture_node`], [`Runtime::capture_end_nodes`]); where not, steps with two
    /// branches are captured as one chain.
    fn branches_supported(&self) -> bool {
        false
    }
    /// Make `s` wait for the work recorded by `e` (in a capture: a graph edge; a stream not
    /// capturing yet joins the capture).
    fn stream_wait_event(&self, _s: Stream, _e: Event) -> Result<()> {
        Err(crate::error::GpuError::Invalid(
            "branched graphs are not supported here".into(),
        ))
    }
    /// The node just captured on `s` (its one capture dependency: the last launch on it).
    fn capture_node(&self, _s: Stream) -> Result<u64> {
        Err(crate::error::GpuError::Invalid(
            "branched graphs are not supported here".into(),
        ))
    }
    /// End the capture on `s` (the other streams of the capture joined into it) and
    /// instantiate it; `nodes` are its kernel nodes in launch order ([`Runtime::capture_node`]
    /// after each launch), checked against the graph's node count.
    fn capture_end_nodes(&self, _s: Stream, _nodes: Vec<u64>) -> Result<GraphExec> {
        Err(crate::error::GpuError::Invalid(
            "branched graphs are not supported here".into(),
        ))
    }
    /// [`Runtime::launch_call`] without programmatic dependent launch (a branch's first call
    /// and a join: their edges stay full dependencies).
    fn launch_call_plain(&self, c: &KernelCall, s: Stream) -> Result<()> {
        self.launch_call(c, s)
    }
    /// Open (`true`) or close a profiler capture range (`cuProfilerStart/Stop`: ncu
    /// `--profile-from-start off`, nsys `--capture-range=cudaProfilerApi`). No-op elsewhere.
    fn profiler(&self, _on: bool) {}
    /// Launch `f` from now on with programmatic dependent launch (it may be scheduled while
    /// the previous kernel runs; `f` must wait first: prelude.cuh `ds4_pdl_enter`). False where
    /// the runtime or device has no PDL (HIP, CUDA before sm_90): launches stay as they were.
    fn set_pdl(&self, _f: Function) -> bool {
        false
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    fn free(&self, p: DevPtr) -> Result<()>;
    /// Page-locked host memory (for staging copies).
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8>;
    /// # Safety
    /// `p` must come from [`Runtime::alloc_pinned`] of this runtime and not be used afterwards.
    unsafe fn free_pinned(&self, p: *mut u8) -> Result<()>;
    /// Page-lock `bytes` host bytes at `p` (page-aligned) for the device to read by DMA
    /// (read-only: a file's mapping may be registered).
    ///
    /// # Safety
    /// The range must stay mapped until [`Runtime::host_unregister`] of `p`.
    unsafe fn host_register(&self, p: *const u8, bytes: usize) -> Result<()>;
    /// # Safety
    /// `p` must be the start of a range registered by [`Runtime::host_register`].
    unsafe fn host_unregister(&self, p: *const u8) -> Result<()>;
    /// The device's address of registered host memory at `p` (registered mapped: kernels may
    /// read it over the bus), or an error where the driver cannot map it.
    ///
    /// # Safety
    /// `p` must lie in a range registered by [`Runtime::host_register`].
    unsafe fn host_device_ptr(&self, p: *const u8) -> Result<DevPtr>;
    /// Queue a copy of `bytes` bytes from host `src` to `dst`.
    ///
    /// # Safety
    /// `src` must stay valid and unchanged until the stream has passed this copy (pinned
    /// memory for a truly asynchronous copy).
    unsafe fn copy_h2d_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        s: Stream,
    ) -> Result<()>;
    /// # Safety
    /// `dst` must stay valid and unread until the stream has passed this copy.
    unsafe fn copy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> Result<()>;
    fn copy_d2d_async(&self, dst: DevPtr, src: DevPtr, bytes: usize, s: Stream) -> Result<()>;
    /// Fill `count` 32-bit words at `p` with `value`.
    fn memset_u32_async(&self, p: DevPtr, value: u32, count: usize, s: Stream) -> Result<()>;
    /// (free, total) bytes of device memory, as the driver reports them now.
    fn mem_info(&self) -> Result<(u64, u64)>;
    /// Make this device current on the calling thread (before a call into another vendor
    /// library that queues work on its streams: NCCL / RCCL).
    fn make_current(&self) -> Result<()>;

    fn stream_create(&self) -> Result<Stream>;
    fn stream_destroy(&self, s: Stream) -> Result<()>;
    fn stream_sync(&self, s: Stream) -> Result<()>;
    fn event_create(&self) -> Result<Event>;
    fn event_destroy(&self, e: Event) -> Result<()>;
    fn event_record(&self, e: Event, s: Stream) -> Result<()>;
    fn event_sync(&self, e: Event) -> Result<()>;
    /// Milliseconds between two recorded, completed events.
    fn event_elapsed_ms(&self, start: Event, end: Event) -> Result<f32>;
    /// Wait for all work on the device.
    fn synchronize(&self) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_calls_compare_kernel_shape_and_used_arguments() {
        let d = LaunchDims::linear(4, 256);
        let a = KernelCall::new(Function(1), d, &[Arg::I32(3), Arg::Ptr(DevPtr(64))]).unwrap();
        assert_eq!(a, a);
        let b = KernelCall::new(Function(1), d, &[Arg::I32(3), Arg::Ptr(DevPtr(72))]).unwrap();
        assert_ne!(a, b);
        assert_ne!(
            a,
            KernelCall::new(Function(2), d, &[Arg::I32(3), Arg::Ptr(DevPtr(64))]).unwrap()
        );
        assert_ne!(a, KernelCall::new(Function(1), d, &[Arg::I32(3)]).unwrap());
        let d2 = LaunchDims::linear(8, 256);
        assert_ne!(
            a,
            KernelCall::new(Function(1), d2, &[Arg::I32(3), Arg::Ptr(DevPtr(64))]).unwrap()
        );
        // The widest kernels fit; one argument more than MAX_ARGS does not.
        assert!(KernelCall::new(Function(1), d, &[Arg::I32(0); MAX_ARGS]).is_some());
        assert!(KernelCall::new(Function(1), d, &[Arg::I32(0); MAX_ARGS + 1]).is_none());
    }
}
