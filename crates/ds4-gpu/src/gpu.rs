//! The host side the engine uses: a device ([`Gpu`]), its buffers, kernels compiled and loaded
//! on first use (through the disk cache), staged copies, and the ops over `ds4-kernels`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ds4_kernels::Module;
use ds4_quant::GgmlType;

use crate::cache::{cache_dir, compile_cached, Origin};
use crate::cuda::CudaRuntime;
use crate::error::{GpuError, Result};
use crate::hip::HipRuntime;
use crate::runtime::*;

/// Which vendor runtime to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CUDA if a visible NVIDIA device exists, else ROCm.
    Auto,
    Cuda,
    Rocm,
}

impl std::str::FromStr for Backend {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "auto" => Ok(Backend::Auto),
            "cuda" => Ok(Backend::Cuda),
            "rocm" | "hip" => Ok(Backend::Rocm),
            _ => Err(GpuError::Invalid(format!(
                "backend {s:?}: expected auto, cuda or rocm"
            ))),
        }
    }
}

/// What each vendor runtime reports on this machine: the number of visible devices, or why it
/// cannot be used (library missing, symbol missing, driver error). For `--backend auto`
/// diagnostics; loads the libraries but opens no device.
pub fn probe() -> Vec<(Vendor, Result<usize>)> {
    vec![
        (Vendor::Nvidia, CudaRuntime::device_count()),
        (Vendor::Amd, HipRuntime::device_count()),
    ]
}

/// A device allocation, freed on drop.
pub struct DeviceBuffer {
    rt: Arc<dyn Runtime>,
    ptr: DevPtr,
    bytes: usize,
    /// Device memory this buffer frees at drop (false: [`DeviceBuffer::borrowed`]).
    owned: bool,
}

impl DeviceBuffer {
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl DeviceBuffer {
    /// An empty stand-in (address 0, no bytes) after a failed allocation.
    pub fn null(gpu: &Gpu) -> DeviceBuffer {
        DeviceBuffer {
            rt: gpu.rt.clone(),
            ptr: DevPtr(0),
            bytes: 0,
            owned: true,
        }
    }

    /// `bytes` at device address `ptr` that this buffer does not own (nothing freed at drop):
    /// host memory mapped into the device's address space ([`Gpu::mapped_ptr`]), which the
    /// Gpu unregisters when it is dropped.
    pub fn borrowed(gpu: &Gpu, ptr: DevPtr, bytes: usize) -> DeviceBuffer {
        DeviceBuffer {
            rt: gpu.rt.clone(),
            ptr,
            bytes,
            owned: false,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr.0 != 0 && self.owned {
            let _ = self.rt.free(self.ptr);
        }
    }
}

/// FNV-1a: the kernel-name maps are read on every launch; names are short and trusted, so
/// a cheap hash beats the default SipHash.
#[derive(Default, Clone, Copy)]
struct Fnv(u64);
impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
        }
        self.0 = h;
    }
}
type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Fnv>>;

struct Loaded {
    handle: ModuleHandle,
    funcs: FastMap<String, Function>,
}

/// Bytes of each of the two pinned staging buffers used by [`Gpu::upload`].
const STAGING_BYTES: usize = 64 << 20;
/// Chunk of [`Gpu::gather_after`] (and so [`Gpu::upload_after`]), at most [`STAGING_BYTES`].
const GATHER_CHUNK: usize = 8 << 20;

/// Copy `src` into `dst` with all CPU threads (host → pinned staging is the slow half of an
/// upload when done by one thread: ~10 GB/s against the bus's ~50).
fn par_copy(src: &[u8], dst: *mut u8) {
    use rayon::prelude::*;
    const PIECE: usize = 2 << 20;
    let dst = dst as usize;
    src.par_chunks(PIECE).enumerate().for_each(|(i, c)| unsafe {
        std::ptr::copy_nonoverlapping(c.as_ptr(), (dst + i * PIECE) as *mut u8, c.len())
    });
}

/// Bytes `start .. start + len` of the concatenation of `srcs` to `dst` on the rayon pool, in
/// pieces of at most 512 KiB (a staging chunk's share spread over the cores).
fn par_gather(srcs: &[&[u8]], start: usize, len: usize, dst: *mut u8) {
    use rayon::prelude::*;
    const PIECE: usize = 512 << 10;
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new(); // (source, its offset, dst offset)
    let mut at = 0; // where source i starts in the concatenation
    for (i, s) in srcs.iter().enumerate() {
        let (a, b) = (start.max(at), (start + len).min(at + s.len()));
        let mut o = a;
        while o < b {
            pieces.push((i, o - at, o - start));
            o += PIECE.min(b - o);
        }
        at += s.len();
    }
    let dst = dst as usize;
    pieces.par_iter().for_each(|&(i, so, d)| {
        let n = PIECE.min(srcs[i].len() - so).min(len - d);
        unsafe { std::ptr::copy_nonoverlapping(srcs[i][so..].as_ptr(), (dst + d) as *mut u8, n) }
    });
}

struct Staging {
    bufs: [*mut u8; 2],
    done: [Event; 2],
    /// [`Gpu::upload_after`]'s event: recorded on the caller's stream (the copies wait for it),
    /// then after the copies (the caller's stream waits for it).
    ready: Event,
    stream: Stream,
}
unsafe impl Send for Staging {}

/// One GPU: runtime, loaded kernel modules, staging buffers.
pub struct Gpu {
    rt: Arc<dyn Runtime>,
    modules: Mutex<FastMap<&'static str, Loaded>>,
    staging: Mutex<Option<Staging>>,
    cache: Option<PathBuf>,
    /// How each module was obtained the first time (for logs and tests).
    origins: Mutex<Vec<(&'static str, Origin)>>,
    /// Host ranges page-locked by [`Gpu::register_host`] (start, end; page-aligned, disjoint),
    /// unregistered when the Gpu is dropped.
    registered: Mutex<Vec<(usize, usize)>>,
    /// The device's address of each registered range's start where the driver mapped it
    /// (`Runtime::host_device_ptr`): kernels may read those ranges over the bus
    /// ([`Gpu::mapped_ptr`]).
    mapped: Mutex<FastMap<usize, u64>>,
    /// [`Gpu::prefetch_after`]'s copy stream and events, made at its first use.
    aside: Mutex<Option<Aside>>,
}

/// A copy stream of its own for prefetches: `ready` is recorded on the caller's stream (the
/// copies wait for it), `done` after the copies (the caller's stream waits for it at
/// [`Gpu::prefetch_wait`]).
struct Aside {
    stream: Stream,
    ready: Event,
    done: Event,
    /// Copies queued since the last wait.
    pending: bool,
}
unsafe impl Send for Aside {}

/// The host's page size (`sysconf(_SC_PAGESIZE)`: 4 KiB on most x86 Linux hosts, 16 KiB on
/// Apple silicon, often 64 KiB on AArch64 servers such as NVIDIA Grace); 4 KiB where it cannot
/// be read. [`Gpu::register_host`] widens its ranges to whole pages of this size: ranges
/// aligned to a smaller page than the real one are refused by the driver, and the gathers
/// then go through staging (~2.5x slower a host layer).
pub fn host_page() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf reads a constant of the system; no memory is passed.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 && (p as usize).is_power_of_two() {
            return p as usize;
        }
    }
    4096
}

/// `ranges` as (start, end) addresses widened to whole pages of `page` bytes (a power of two),
/// sorted, with overlapping or touching ranges merged; empty ranges dropped.
pub fn page_ranges(ranges: &[&[u8]], page: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| {
            let a = r.as_ptr() as usize;
            (a / page * page, (a + r.len()).div_ceil(page) * page)
        })
        .collect();
    v.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (a, b) in v {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    merged
}

/// `srcs` as copies of (start, length): sources that follow each other in memory (a whole
/// stack's experts in order, a layer's prefetch) are one copy.
pub fn runs(srcs: &[&[u8]]) -> Vec<(*const u8, usize)> {
    let mut out: Vec<(*const u8, usize)> = Vec::new();
    for s in srcs.iter().filter(|s| !s.is_empty()) {
        match out.last_mut() {
            Some((p, n)) if (*p as usize) + *n == s.as_ptr() as usize => *n += s.len(),
            _ => out.push((s.as_ptr(), s.len())),
        }
    }
    out
}

/// Copies queued by [`Gpu::prefetch_after`] on its own stream (process-wide; tests).
pub static PREFETCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Gathers that copied straight from registered host memory (process-wide; tests).
pub static DIRECT_GATHERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Uploads ([`Gpu::upload`]) that copied straight from registered host memory (tests).
pub static DIRECT_UPLOADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How a matrix-vector product is cut: `splits` CTAs along K, each over `cps` chunks of 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecPlan {
    pub splits: u32,
    pub cps: u32,
}

impl MatvecPlan {
    /// f32 scratch elements the split form needs (`splits * rows`; 0 when not split).
    pub fn scratch_elems(&self, rows: usize) -> usize {
        if self.splits > 1 {
            self.splits as usize * rows
        } else {
            0
        }
    }
}

/// The kernel-name suffix of a weight type (`matvec_q8_0`, `mm1_q2_k`, …); None for a type
/// no kernel reads. Every GPU module names its per-type kernels this way.
pub(crate) fn type_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::IQ2_XXS => "iq2_xxs",
        _ => return None,
    })
}

fn quant_suffix(ty: GgmlType) -> Result<&'static str> {
    type_suffix(ty).ok_or_else(|| GpuError::Invalid(format!("no GPU matvec for ggml type {ty}")))
}

fn i32_arg(what: &str, v: usize) -> Result<Arg> {
    i32::try_from(v)
        .map(Arg::I32)
        .map_err(|_| GpuError::Invalid(format!("{what} = {v} exceeds i32")))
}

impl Gpu {
    /// Open visible device `device` of `backend`. With [`Backend::Auto`], CUDA is tried first;
    /// if neither works the error carries both reasons.
    pub fn open(backend: Backend, device: usize) -> Result<Gpu> {
        let rt: Arc<dyn Runtime> = match backend {
            Backend::Cuda => Arc::new(CudaRuntime::new(device)?),
            Backend::Rocm => Arc::new(HipRuntime::new(device)?),
            Backend::Auto => match CudaRuntime::new(device) {
                Ok(c) => Arc::new(c),
                Err(ec) => match HipRuntime::new(device) {
                    Ok(h) => Arc::new(h),
                    Err(eh) => {
                        return Err(GpuError::NoBackend {
                            cuda: Box::new(ec),
                            rocm: Box::new(eh),
                        })
                    }
                },
            },
        };
        Ok(Gpu::from_runtime(rt))
    }

    pub fn from_runtime(rt: Arc<dyn Runtime>) -> Gpu {
        Gpu {
            rt,
            modules: Mutex::new(FastMap::default()),
            staging: Mutex::new(None),
            cache: cache_dir(),
            origins: Mutex::new(Vec::new()),
            registered: Mutex::new(Vec::new()),
            mapped: Mutex::new(FastMap::default()),
            aside: Mutex::new(None),
        }
    }

    /// Page-locks `ranges` of host memory (widened to whole pages, merged; parts already
    /// registered are skipped) so that [`Gpu::gather_after`] and the uploads copy from them by
    /// DMA with no staging memcpy. Returns the bytes registered; at the first failure (the
    /// driver's error: pinned-memory limits, a mapping it cannot lock) releases what this call
    /// registered and returns the error.
    pub fn register_host(&self, ranges: &[&[u8]]) -> Result<usize> {
        let merged = page_ranges(ranges, host_page());
        let mut reg = self.registered.lock().unwrap();
        let (had, mut bytes) = (reg.len(), 0);
        for (a, b) in merged {
            if reg.iter().any(|&(x, y)| a < y && x < b) {
                continue; // overlaps a registered range: the driver would refuse it
            }
            if let Err(e) = unsafe { self.rt.host_register(a as *const u8, b - a) } {
                // All or nothing: this call's ranges are released again (pinned memory that
                // no copy would use).
                for (x, _) in reg.drain(had..) {
                    self.mapped.lock().unwrap().remove(&x);
                    let _ = unsafe { self.rt.host_unregister(x as *const u8) };
                }
                return Err(e);
            }
            reg.push((a, b));
            if let Ok(d) = unsafe { self.rt.host_device_ptr(a as *const u8) } {
                self.mapped.lock().unwrap().insert(a, d.0);
            }
            bytes += b - a;
        }
        Ok(bytes)
    }

    /// The device's address of `s` where it lies inside one registered range that the driver
    /// mapped (kernels may read it over the bus), else None.
    pub fn mapped_ptr(&self, s: &[u8]) -> Option<DevPtr> {
        let (a, b) = (s.as_ptr() as usize, s.as_ptr() as usize + s.len());
        let reg = self.registered.lock().unwrap();
        let &(x, _) = reg.iter().find(|&&(x, y)| x <= a && b <= y)?;
        let base = *self.mapped.lock().unwrap().get(&x)?;
        Some(DevPtr(base + (a - x) as u64))
    }

    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.rt
    }

    pub fn info(&self) -> &DeviceInfo {
        self.rt.info()
    }

    /// (free, total) bytes of device memory now.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.rt.mem_info()
    }

    /// Which modules were compiled and which came from the disk cache, in load order.
    pub fn module_origins(&self) -> Vec<(&'static str, Origin)> {
        self.origins.lock().unwrap().clone()
    }

    /// Compile (or fetch from the cache) and load every module of `modules` not loaded yet:
    /// the compilations run in parallel (a first start compiles every kernel of the model —
    /// tens of seconds one by one), then the code objects are loaded in order.
    pub fn load_all(&self, modules: &[Module]) -> Result<()> {
        use rayon::prelude::*;
        let todo: Vec<&Module> = {
            let mods = self.modules.lock().unwrap();
            modules
                .iter()
                .filter(|m| !mods.contains_key(m.name))
                .collect()
        };
        let info = self.rt.info();
        let defines = self.rt.defines();
        let codes: Vec<Result<(Vec<u8>, Origin)>> = todo
            .par_iter()
            .map(|m| {
                compile_cached(
                    self.rt.compiler(),
                    m,
                    &info.arch,
                    &defines,
                    self.cache.as_deref(),
                )
            })
            .collect();
        for (m, code) in todo.into_iter().zip(codes) {
            self.load_code(m, code?)?;
        }
        Ok(())
    }

    /// Compile (or fetch from the cache) and load `module`; resolve all its kernels.
    pub fn load(&self, module: &Module) -> Result<()> {
        if self.modules.lock().unwrap().contains_key(module.name) {
            return Ok(());
        }
        let info = self.rt.info();
        let code = compile_cached(
            self.rt.compiler(),
            module,
            &info.arch,
            &self.rt.defines(),
            self.cache.as_deref(),
        )?;
        self.load_code(module, code)
    }

    fn load_code(&self, module: &Module, code: (Vec<u8>, Origin)) -> Result<()> {
        let mut mods = self.modules.lock().unwrap();
        if mods.contains_key(module.name) {
            return Ok(());
        }
        let info = self.rt.info();
        let (handle, origin) = crate::cache::load_or_rebuild(
            code,
            |c| self.rt.load_module(c),
            || {
                crate::cache::compile_fresh(
                    self.rt.compiler(),
                    module,
                    &info.arch,
                    &self.rt.defines(),
                    self.cache.as_deref(),
                )
            },
            |e| {
                eprintln!(
                    "ds4: the cached kernel module {} did not load ({e}); compiling it again",
                    module.name
                )
            },
        )?;
        let mut funcs = FastMap::default();
        let pdl = if pdl_wanted() {
            ds4_kernels::pdl_kernels(module)
        } else {
            Vec::new()
        };
        // mma-only kernels exist only in code compiled with the mma paths (same defines).
        let mma = ds4_kernels::has_mma(&self.rt.defines());
        for k in module.kernels_for(mma) {
            let f = self
                .rt
                .function(handle, k)?
                .ok_or_else(|| GpuError::NoKernel {
                    module: module.name.to_string(),
                    kernel: k.to_string(),
                })?;
            if pdl.contains(&k) {
                self.rt.set_pdl(f);
            }
            funcs.insert(k.to_string(), f);
        }
        mods.insert(module.name, Loaded { handle, funcs });
        self.origins.lock().unwrap().push((module.name, origin));
        Ok(())
    }

    /// A kernel of `module`, loading the module on first use (one lock and one lookup once
    /// the module is loaded: this is on every launch's path).
    /// `module.kernel` of a loaded function (graph traces), None when not found.
    pub fn kernel_name(&self, f: Function) -> Option<String> {
        let mods = self.modules.lock().unwrap();
        mods.iter().find_map(|(m, l)| {
            l.funcs
                .iter()
                .find(|(_, g)| **g == f)
                .map(|(k, _)| format!("{m}.{k}"))
        })
    }

    pub fn kernel(&self, module: &Module, name: &str) -> Result<Function> {
        {
            let mods = self.modules.lock().unwrap();
            if let Some(m) = mods.get(module.name) {
                return m
                    .funcs
                    .get(name)
                    .copied()
                    .ok_or_else(|| GpuError::NoKernel {
                        module: module.name.to_string(),
                        kernel: name.to_string(),
                    });
            }
        }
        self.load(module)?;
        self.kernel(module, name)
    }

    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let ptr = self.rt.alloc(bytes).map_err(|e| {
            let (free, total) = self.rt.mem_info().ok().unzip();
            GpuError::OutOfMemory {
                bytes: bytes as u64,
                free,
                total,
                source: Box::new(e),
            }
        })?;
        Ok(DeviceBuffer {
            rt: self.rt.clone(),
            ptr,
            bytes,
            owned: true,
        })
    }

    /// Allocate and fill from host bytes.
    pub fn alloc_from(&self, data: &[u8]) -> Result<DeviceBuffer> {
        let b = self.alloc(data.len())?;
        self.upload(b.ptr, data)?;
        Ok(b)
    }

    pub fn alloc_f32(&self, data: &[f32]) -> Result<DeviceBuffer> {
        self.alloc_from(f32_bytes(data))
    }

    fn with_staging<T>(&self, f: impl FnOnce(&Staging) -> Result<T>) -> Result<T> {
        let mut st = self.staging.lock().unwrap();
        if st.is_none() {
            let s = Staging {
                bufs: [
                    self.rt.alloc_pinned(STAGING_BYTES)?,
                    self.rt.alloc_pinned(STAGING_BYTES)?,
                ],
                done: [self.rt.event_create()?, self.rt.event_create()?],
                ready: self.rt.event_create()?,
                stream: self.rt.stream_create()?,
            };
            // Mark both buffers free.
            self.rt.event_record(s.done[0], s.stream)?;
            self.rt.event_record(s.done[1], s.stream)?;
            *st = Some(s);
        }
        f(st.as_ref().unwrap())
    }

    /// Copy host bytes to the device through two pinned staging buffers: filling one while the
    /// other is in flight. Returns when the data is on the device. The copies run on the
    /// staging stream, unordered with work queued on other streams: for memory that queued
    /// kernels may still read or write (pool blocks, state buffers just cleared by a kernel)
    /// use [`Gpu::upload_after`].
    pub fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.upload_with_progress(dst, src, &mut |_| {})
    }

    /// Host bytes to `dst` in stream order on `after`: the copies run after all work queued so
    /// far on `after`, and work queued on `after` from now on runs after them (the staging
    /// stream and `after` wait on each other's events on the device, so the host does not wait
    /// for the device; `src` is copied to pinned staging before this returns). Where the
    /// runtime cannot make a stream wait, the host waits instead, both ways. Without this, a
    /// fill queued on `after` before the upload could land after the copy (a restored state
    /// differing under load: bench/results/gpu-lead-s13-h200.txt).
    pub fn upload_after(&self, dst: DevPtr, src: &[u8], after: Stream) -> Result<()> {
        self.staged_after(dst, &[src], after)
    }

    /// [`Gpu::upload_after`] of the concatenation of `srcs` (routed experts' slabs gathered
    /// into one stack: offload.rs). Sources all in registered memory ([`Gpu::register_host`])
    /// are copied by DMA on `after` itself, in its order, with no staging.
    pub fn gather_after(&self, dst: DevPtr, srcs: &[&[u8]], after: Stream) -> Result<()> {
        if self.copy_registered(dst, srcs, after)? {
            DIRECT_GATHERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(());
        }
        self.staged_after(dst, srcs, after)
    }

    /// The concatenation of `srcs` to `dst` on a copy stream of its own, after the work queued
    /// so far on `after`, so that it runs beside the work queued next there (a layer's experts
    /// cross the bus while the layers before it compute); [`Gpu::prefetch_wait`] orders
    /// `after`'s later work after it. Sources not page-locked are copied as
    /// [`Gpu::gather_after`] does (through staging, in `after`'s order: nothing beside).
    pub fn prefetch_after(&self, dst: DevPtr, srcs: &[&[u8]], after: Stream) -> Result<()> {
        let mut a = self.aside.lock().unwrap();
        if a.is_none() {
            *a = Some(Aside {
                stream: self.rt.stream_create()?,
                ready: self.rt.event_create()?,
                done: self.rt.event_create()?,
                pending: false,
            });
        }
        let a = a.as_mut().unwrap();
        self.rt.event_record(a.ready, after)?;
        self.rt.stream_wait_event(a.stream, a.ready)?;
        if !self.copy_registered(dst, srcs, a.stream)? {
            return self.gather_after(dst, srcs, after);
        }
        PREFETCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.rt.event_record(a.done, a.stream)?;
        a.pending = true;
        Ok(())
    }

    /// Whether copies of [`Gpu::prefetch_after`] are not yet waited for.
    pub fn prefetch_pending(&self) -> bool {
        self.aside
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|a| a.pending)
    }

    /// Orders the work queued on `stream` from now on after every [`Gpu::prefetch_after`]'s
    /// copies so far (nothing where none is pending).
    pub fn prefetch_wait(&self, stream: Stream) -> Result<()> {
        let mut a = self.aside.lock().unwrap();
        match a.as_mut() {
            Some(a) if a.pending => {
                a.pending = false;
                self.rt.stream_wait_event(stream, a.done)
            }
            _ => Ok(()),
        }
    }

    /// Queues the concatenation of `srcs` to `dst` on `stream` by DMA where every source lies
    /// in registered memory ([`Gpu::register_host`]): true. Else nothing is queued: false.
    fn copy_registered(&self, dst: DevPtr, srcs: &[&[u8]], stream: Stream) -> Result<bool> {
        let direct = {
            let reg = self.registered.lock().unwrap();
            let inside = |s: &[u8]| {
                let (a, b) = (s.as_ptr() as usize, s.as_ptr() as usize + s.len());
                reg.iter().any(|&(x, y)| x <= a && b <= y)
            };
            !srcs.is_empty() && srcs.iter().all(|s| !s.is_empty() && inside(s))
        };
        if direct {
            let mut at = 0u64;
            for (ptr, len) in runs(srcs) {
                unsafe { self.rt.copy_h2d_async(dst.offset(at), ptr, len, stream)? };
                at += len as u64;
            }
        }
        Ok(direct)
    }

    /// [`Gpu::gather_after`] through the pinned staging buffers.
    fn staged_after(&self, dst: DevPtr, srcs: &[&[u8]], after: Stream) -> Result<()> {
        self.with_staging(|s| {
            self.rt.event_record(s.ready, after)?;
            if self.rt.stream_wait_event(s.stream, s.ready).is_err() {
                self.rt.event_sync(s.ready)?;
                self.queue_gather(s, dst, srcs)?;
                return self.rt.stream_sync(s.stream);
            }
            self.queue_gather(s, dst, srcs)?;
            // `ready` is re-recorded: a wait takes the event as it is when called.
            self.rt.event_record(s.ready, s.stream)?;
            self.rt.stream_wait_event(after, s.ready)
        })
    }

    /// [`Gpu::upload`], calling `progress(bytes queued so far)` after each staging chunk (for a
    /// progress bar while weights are uploaded).
    pub fn upload_with_progress(
        &self,
        dst: DevPtr,
        src: &[u8],
        progress: &mut dyn FnMut(usize),
    ) -> Result<()> {
        self.with_staging(|s| {
            // Page-locked already (host-memory experts' grouped uploads): one DMA copy.
            if self.copy_registered(dst, &[src], s.stream)? {
                DIRECT_UPLOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                progress(src.len());
            } else {
                self.queue_copies(s, dst, src, progress)?;
            }
            self.rt.stream_sync(s.stream)
        })
    }

    /// Queue the copies of `src` to `dst` on the staging stream, each chunk through one of the
    /// two pinned buffers once its previous copy is done (the host waits only for that).
    fn queue_copies(
        &self,
        s: &Staging,
        dst: DevPtr,
        src: &[u8],
        progress: &mut dyn FnMut(usize),
    ) -> Result<()> {
        for (i, chunk) in src.chunks(STAGING_BYTES).enumerate() {
            let k = i % 2;
            self.rt.event_sync(s.done[k])?;
            par_copy(chunk, s.bufs[k]);
            unsafe {
                self.rt.copy_h2d_async(
                    dst.offset((i * STAGING_BYTES) as u64),
                    s.bufs[k],
                    chunk.len(),
                    s.stream,
                )?;
            }
            self.rt.event_record(s.done[k], s.stream)?;
            progress(i * STAGING_BYTES + chunk.len());
        }
        Ok(())
    }

    /// [`Gpu::queue_copies`] of the concatenation of `srcs` in chunks of [`GATHER_CHUNK`]: the
    /// host fills one staging buffer while the other's copy runs, so a few tens of MB (a decode
    /// step's experts) take about the longer of the two, not their sum.
    fn queue_gather(&self, s: &Staging, dst: DevPtr, srcs: &[&[u8]]) -> Result<()> {
        let total: usize = srcs.iter().map(|x| x.len()).sum();
        let mut start = 0;
        let mut k = 0;
        while start < total {
            let len = (total - start).min(GATHER_CHUNK);
            self.rt.event_sync(s.done[k])?;
            par_gather(srcs, start, len, s.bufs[k]);
            unsafe {
                self.rt
                    .copy_h2d_async(dst.offset(start as u64), s.bufs[k], len, s.stream)?;
            }
            self.rt.event_record(s.done[k], s.stream)?;
            start += len;
            k ^= 1;
        }
        Ok(())
    }

    /// `bytes` device bytes after all queued work on the device (synchronises), handed to `f`
    /// a chunk at a time straight from the pinned staging buffer (chunks of whole 4-byte
    /// words but the last): a caller converting them writes its output once, with no
    /// intermediate copy (fresh pages cost as much as the copy on a slow host core).
    pub fn download_with(&self, src: DevPtr, bytes: usize, mut f: impl FnMut(&[u8])) -> Result<()> {
        self.rt.synchronize()?;
        self.with_staging(|s| {
            let mut done = 0;
            while done < bytes {
                let len = (bytes - done).min(STAGING_BYTES);
                unsafe {
                    self.rt
                        .copy_d2h_async(s.bufs[0], src.offset(done as u64), len, s.stream)?;
                }
                self.rt.stream_sync(s.stream)?;
                f(unsafe { std::slice::from_raw_parts(s.bufs[0], len) });
                done += len;
            }
            Ok(())
        })
    }

    /// Copy device bytes to the host after all queued work on the device (synchronises).
    pub fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        let mut at = 0;
        self.download_with(src, dst.len(), |c| {
            dst[at..at + c.len()].copy_from_slice(c);
            at += c.len();
        })
    }

    pub fn download_f32(&self, src: DevPtr, n: usize) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(n);
        self.download_with(src, n * 4, |c| {
            out.extend(
                c.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            )
        })?;
        Ok(out)
    }

    /// How [`Gpu::matvec`] cuts `rows × cols`: split K until the grid has about two CTAs per
    /// SM, keeping at least one warp-width of chunks per split.
    pub fn matvec_plan(&self, rows: usize, cols: usize) -> MatvecPlan {
        let info = self.rt.info();
        let chunks = (cols / ds4_kernels::CHUNK).max(1);
        let ctas = rows.div_ceil(ds4_kernels::MV_WARPS as usize).max(1);
        let want = (2 * info.sm_count as usize).div_ceil(ctas);
        let max_by_k = (chunks / info.warp as usize).max(1);
        let splits = want.min(max_by_k).clamp(1, 64);
        let cps = chunks.div_ceil(splits);
        MatvecPlan {
            splits: chunks.div_ceil(cps) as u32,
            cps: cps as u32,
        }
    }

    /// `y[r] = Σ_k dequant(W)[r][k] · x[k]` for a `rows × cols` matrix of type `ty` in GGUF row
    /// layout. With `scratch` (at least [`MatvecPlan::scratch_elems`] f32) K is split per
    /// [`Gpu::matvec_plan`] and the partial sums are added by a second kernel; without it one
    /// CTA row covers all of K.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        rows: usize,
        cols: usize,
        scratch: Option<(DevPtr, usize)>,
        stream: Stream,
    ) -> Result<()> {
        let rb = ds4_quant::row_bytes(ty, cols)?;
        if !cols.is_multiple_of(ds4_kernels::CHUNK) {
            return Err(GpuError::Invalid(format!(
                "matvec: cols = {cols} is not a multiple of 32"
            )));
        }
        let mut plan = self.matvec_plan(rows, cols);
        let part = match scratch {
            Some((p, n)) if plan.splits > 1 && n >= plan.scratch_elems(rows) => Some(p),
            _ => None,
        };
        if part.is_none() {
            plan = MatvecPlan {
                splits: 1,
                cps: (cols / ds4_kernels::CHUNK) as u32,
            };
        }
        let f = self.kernel(
            &ds4_kernels::QUANT,
            &format!("matvec_{}", quant_suffix(ty)?),
        )?;
        let warp = self.rt.info().warp;
        let dims = LaunchDims {
            grid: [
                rows.div_ceil(ds4_kernels::MV_WARPS as usize) as u32,
                plan.splits,
                1,
            ],
            block: [ds4_kernels::MV_WARPS * warp, 1, 1],
            shared_bytes: 0,
        };
        let out = part.unwrap_or(y);
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(x),
            Arg::Ptr(out),
            i32_arg("rows", rows)?,
            i32_arg("cols", cols)?,
            Arg::I64(rb as i64),
            Arg::I32(plan.cps as i32),
        ];
        self.rt.launch(f, dims, stream, &args)?;
        if let Some(p) = part {
            let r = self.kernel(&ds4_kernels::QUANT, "reduce_splits_f32")?;
            self.rt.launch(
                r,
                LaunchDims::linear(rows.div_ceil(256) as u32, 256),
                stream,
                &[
                    Arg::Ptr(p),
                    Arg::Ptr(y),
                    i32_arg("rows", rows)?,
                    Arg::I32(plan.splits as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// `out` (`rows × cols` f32) = dequantised `W`, bit-identical to `ds4_quant::dequantize_row`.
    pub fn dequant(
        &self,
        ty: GgmlType,
        w: DevPtr,
        out: DevPtr,
        rows: usize,
        cols: usize,
        stream: Stream,
    ) -> Result<()> {
        let rb = ds4_quant::row_bytes(ty, cols)?;
        if !cols.is_multiple_of(ds4_kernels::CHUNK) {
            return Err(GpuError::Invalid(format!(
                "dequant: cols = {cols} is not a multiple of 32"
            )));
        }
        let f = self.kernel(
            &ds4_kernels::QUANT,
            &format!("dequant_{}", quant_suffix(ty)?),
        )?;
        let total = rows * (cols / ds4_kernels::CHUNK);
        let blocks = u32::try_from(total.div_ceil(256)).map_err(|_| {
            GpuError::Invalid(format!(
                "dequant: {rows} x {cols} is too large for one launch"
            ))
        })?;
        self.rt.launch(
            f,
            LaunchDims::linear(blocks.max(1), 256),
            stream,
            &[
                Arg::Ptr(w),
                Arg::Ptr(out),
                i32_arg("rows", rows)?,
                i32_arg("cols", cols)?,
                Arg::I64(rb as i64),
            ],
        )
    }

    /// RMSNorm of `rows` vectors of `n`: `y = x / sqrt(mean(x²) + eps) · w` (`w` optional).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: DevPtr,
        w: Option<DevPtr>,
        y: DevPtr,
        rows: usize,
        n: usize,
        eps: f32,
        stream: Stream,
    ) -> Result<()> {
        let f = self.kernel(&ds4_kernels::ELEMENTWISE, "rmsnorm_f32")?;
        self.rt.launch(
            f,
            LaunchDims::linear(rows as u32, 256),
            stream,
            &[
                Arg::Ptr(x),
                w.map_or(Arg::Null, Arg::Ptr),
                Arg::Ptr(y),
                i32_arg("n", n)?,
                Arg::F32(eps),
            ],
        )
    }

    fn elementwise(
        &self,
        name: &str,
        ptrs: &[DevPtr],
        scalars: &[f32],
        n: usize,
        stream: Stream,
    ) -> Result<()> {
        let f = self.kernel(&ds4_kernels::ELEMENTWISE, name)?;
        let mut args: Vec<Arg> = ptrs.iter().map(|p| Arg::Ptr(*p)).collect();
        args.extend(scalars.iter().map(|s| Arg::F32(*s)));
        args.push(Arg::I64(n as i64));
        let blocks = u32::try_from(n.div_ceil(256))
            .map_err(|_| GpuError::Invalid(format!("{name}: n = {n} too large")))?;
        self.rt
            .launch(f, LaunchDims::linear(blocks.max(1), 256), stream, &args)
    }

    /// `y = a + b` over `n` f32.
    pub fn add(&self, a: DevPtr, b: DevPtr, y: DevPtr, n: usize, s: Stream) -> Result<()> {
        self.elementwise("add_f32", &[a, b, y], &[], n, s)
    }
    /// `y = a · b` over `n` f32.
    pub fn mul(&self, a: DevPtr, b: DevPtr, y: DevPtr, n: usize, s: Stream) -> Result<()> {
        self.elementwise("mul_f32", &[a, b, y], &[], n, s)
    }
    /// `y = x · scale`.
    pub fn scale(&self, x: DevPtr, y: DevPtr, scale: f32, n: usize, s: Stream) -> Result<()> {
        self.elementwise("scale_f32", &[x, y], &[scale], n, s)
    }
    /// `y = silu(min(g, clamp)) · clamp(u, ±clamp) · weight` (the experts' clamped SwiGLU).
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        g: DevPtr,
        u: DevPtr,
        y: DevPtr,
        clamp: f32,
        weight: f32,
        n: usize,
        s: Stream,
    ) -> Result<()> {
        self.elementwise("swiglu_f32", &[g, u, y], &[clamp, weight], n, s)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.rt.synchronize()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.rt.synchronize();
        for (a, _) in self.registered.lock().unwrap().drain(..) {
            let _ = unsafe { self.rt.host_unregister(a as *const u8) };
        }
        if let Some(a) = self.aside.lock().unwrap().take() {
            let _ = self.rt.event_destroy(a.ready);
            let _ = self.rt.event_destroy(a.done);
            let _ = self.rt.stream_destroy(a.stream);
        }
        if let Some(s) = self.staging.lock().unwrap().take() {
            unsafe {
                let _ = self.rt.free_pinned(s.bufs[0]);
                let _ = self.rt.free_pinned(s.bufs[1]);
            }
            let _ = self.rt.event_destroy(s.done[0]);
            let _ = self.rt.event_destroy(s.done[1]);
            let _ = self.rt.event_destroy(s.ready);
            let _ = self.rt.stream_destroy(s.stream);
        }
        for (_, m) in self.modules.lock().unwrap().drain() {
            let _ = self.rt.unload_module(m.handle);
        }
    }
}

/// Programmatic dependent launch for the kernels that wait first (`ds4_kernels::pdl_kernels`;
/// CUDA sm_90+ only, elsewhere nothing changes). On by default: +2.3% decode on the H200
/// (bench/results/gpu-pdl-h200.txt); `DS4_GPU_PDL=off` launches as before.
fn pdl_wanted() -> bool {
    !std::env::var("DS4_GPU_PDL").is_ok_and(|v| v == "off" || v == "0")
}

/// How decode steps ran as graphs ([`StepGraphs`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured and instantiated (a new sequence of kernels).
    pub captures: u64,
    /// Steps run by launching a graph (captures included).
    pub replays: u64,
    /// Kernel nodes whose arguments or shape were updated before a replay.
    pub patched: u64,
    /// Recorded steps run launch by launch instead (interrupted, or graphs failed).
    pub eager: u64,
    /// Kernel launches recorded in all steps.
    pub calls: u64,
    /// Host µs in replays (compare, updates, graph launch) and in captures (with instantiation).
    pub replay_us: u64,
    pub capture_us: u64,
    /// Recorded steps run as graphs, and host µs from each one's start to its last piece's
    /// graph launch (schedule walk, recording, replays; the device runs earlier pieces
    /// meanwhile), before the host waits for the step's result.
    pub steps: u64,
    pub step_host_us: u64,
    /// Graph launches (captures included) of pieces with a side branch on a second chain
    /// (`ds4_backend::Backend::side_begin`; 0 with `DS4_GPU_BRANCH=off` or where the runtime
    /// captures one stream only).
    pub branched: u64,
}

struct CachedGraph {
    key: u64,
    /// Which piece of a step (see [`StepGraphs::run`]).
    tag: u64,
    /// The calls the executable graph holds now.
    calls: Vec<KernelCall>,
    exec: GraphExec,
    /// Captured with a side branch on a second chain.
    branched: bool,
}

/// Most graphs kept (least recently used dropped first): decode cycles through a few kernel
/// sequences (which compressors emit a row at this position).
const GRAPH_CACHE: usize = 64;

/// Runs recorded steps as device graphs. A step is a list of [`KernelCall`]s; a cached graph
/// with the same kernels in the same order is updated where this step differs (pool addresses
/// or buffers that moved; positions come from device memory, model/mod.rs `StepPos`, so steady
/// decode steps update nothing) and launched; otherwise the step is captured
/// on a side stream, instantiated and launched. Same kernels, same arguments, same order as
/// launching one by one, so the results are bit-identical.
#[derive(Default)]
pub struct StepGraphs {
    cap: Option<Stream>,
    /// The side branch's capture stream and the fork and join events (branched captures).
    side: Option<(Stream, Event, Event)>,
    /// The hints' chain ([`FLOW_HINT`]): its stream and fork and join events.
    hint: Option<(Stream, Event, Event)>,
    /// A branched capture failed: steps are captured as one chain from then on.
    one_chain: bool,
    graphs: Vec<CachedGraph>,
    pub stats: GraphStats,
    /// Print the first captures and replays to stderr (`DS4_GPU_GRAPH_TRACE=1`).
    pub trace: bool,
    /// With `trace`: each node updated since the last [`StepGraphs::take_diffs`] (kernel,
    /// bit i set when argument slot i changed, bit 31 when the grid or block changed).
    pub diffs: Vec<(Function, u32)>,
}

/// Which of `new`'s argument slots (bit i) and shape (bit 31) differ from `old`'s.
pub fn call_diff(old: &KernelCall, new: &KernelCall) -> u32 {
    let mut m = 0u32;
    for (i, (a, b)) in old.args().iter().zip(new.args()).enumerate() {
        if a != b && i < 31 {
            m |= 1 << i;
        }
    }
    if old.dims != new.dims || old.n != new.n {
        m |= 1 << 31;
    }
    m
}

impl StepGraphs {
    /// Empty; `DS4_GPU_GRAPH_TRACE=1` turns tracing on.
    pub fn new() -> StepGraphs {
        StepGraphs {
            trace: std::env::var("DS4_GPU_GRAPH_TRACE").is_ok_and(|v| v == "1"),
            ..StepGraphs::default()
        }
    }

    fn key(calls: &[KernelCall]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        calls.len().hash(&mut h);
        for c in calls {
            c.f.0.hash(&mut h);
            c.flow.hash(&mut h);
        }
        h.finish()
    }

    /// Run `calls` on `stream` as a graph. `tag` tells pieces of a step apart (piece i of a
    /// step split in pieces is only matched with piece i of another). On an error nothing of
    /// these calls has run (the caller launches them one by one).
    pub fn run(
        &mut self,
        rt: &dyn Runtime,
        calls: &[KernelCall],
        stream: Stream,
        tag: u64,
    ) -> Result<()> {
        self.stats.calls += calls.len() as u64;
        let key = Self::key(calls);
        let hit = self.graphs.iter().position(|g| {
            g.key == key
                && g.tag == tag
                && g.calls.len() == calls.len()
                && g.calls
                    .iter()
                    .zip(calls)
                    .all(|(a, b)| a.f == b.f && a.flow == b.flow)
        });
        let t = std::time::Instant::now();
        if let Some(i) = hit {
            let mut g = self.graphs.remove(i);
            let mut patched = 0;
            let mut ok = true;
            for (j, (old, new)) in g.calls.iter_mut().zip(calls).enumerate() {
                if old != new {
                    if self.trace {
                        self.diffs.push((new.f, call_diff(old, new)));
                    }
                    if rt.graph_set(&g.exec, j, new).is_err() {
                        ok = false;
                        break;
                    }
                    *old = *new;
                    patched += 1;
                }
            }
            if ok {
                self.stats.patched += patched;
                rt.graph_launch(&g.exec, stream)?;
                self.stats.replays += 1;
                self.stats.branched += g.branched as u64;
                self.stats.replay_us += t.elapsed().as_micros() as u64;
                if self.trace && self.stats.replays <= 40 {
                    eprintln!(
                        "ds4 graph: replay tag {tag}: {} nodes, {patched} updated, {} us",
                        calls.len(),
                        t.elapsed().as_micros()
                    );
                }
                self.graphs.push(g);
                return Ok(());
            }
            // The driver refused an update: capture afresh.
            rt.graph_destroy(&g.exec);
        }
        let cap = match self.cap {
            Some(s) => s,
            None => {
                let s = rt.stream_create()?;
                self.cap = Some(s);
                s
            }
        };
        let mut branched = !self.one_chain
            && rt.branches_supported()
            && calls
                .iter()
                .any(|c| c.flow == FLOW_SIDE || c.flow == FLOW_HINT);
        if self.trace && self.stats.captures < 40 {
            eprintln!(
                "ds4 graph: capturing tag {tag}: {} launches{}",
                calls.len(),
                if branched { ", branched" } else { "" }
            );
        }
        let mut exec = None;
        if branched {
            match self.capture_branched(rt, calls, cap) {
                Ok(x) => exec = Some(x),
                Err(e) => {
                    // One chain instead (same calls, same order: the same results).
                    eprintln!("ds4: GPU graph branches turned off: {e}");
                    self.one_chain = true;
                    branched = false;
                }
            }
        }
        let exec = if let Some(x) = exec {
            x
        } else {
            rt.capture_begin(cap)?;
            let mut r = Ok(());
            for c in calls {
                r = rt.launch_call(c, cap);
                if r.is_err() {
                    break;
                }
            }
            let exec = rt.capture_end(cap);
            if let (Err(e), Ok(x)) = (&r, &exec) {
                rt.graph_destroy(x);
                return Err(GpuError::Invalid(format!("graph capture: {e}")));
            }
            r?;
            exec?
        };
        if exec.nodes.len() != calls.len() {
            rt.graph_destroy(&exec);
            return Err(GpuError::Invalid(format!(
                "graph capture: {} nodes for {} launches",
                exec.nodes.len(),
                calls.len()
            )));
        }
        if let Err(e) = rt.graph_launch(&exec, stream) {
            rt.graph_destroy(&exec);
            return Err(e);
        }
        self.stats.captures += 1;
        self.stats.replays += 1;
        self.stats.branched += branched as u64;
        self.stats.capture_us += t.elapsed().as_micros() as u64;
        if self.trace && self.stats.captures <= 40 {
            eprintln!(
                "ds4 graph: captured tag {tag}: {} nodes in {} us",
                calls.len(),
                t.elapsed().as_micros()
            );
        }
        if self.graphs.len() >= GRAPH_CACHE {
            let old = self.graphs.remove(0);
            rt.graph_destroy(&old.exec);
        }
        self.graphs.push(CachedGraph {
            key,
            tag,
            calls: calls.to_vec(),
            exec,
            branched,
        });
        Ok(())
    }

    /// Capture `calls` on `cap` with their side branches on a second stream: at a run of
    /// [`FLOW_SIDE`] calls the side stream waits for the main stream (an event: a graph edge
    /// from the main chain's last node), the side calls chain on it, and at the next
    /// [`FLOW_JOIN`] call (or the end) the main stream waits for the side stream. The nodes
    /// are taken after each launch ([`Runtime::capture_node`]), so node i is call i for the
    /// updates by index. A branch's first call and a join launch without PDL: their edges
    /// (the fork, the join) stay full dependencies; PDL stays within each chain.
    /// [`FLOW_HINT`] calls go to a third stream: each forks from the main chain at its place
    /// (after the hint stream's previous call), and that stream is joined at the end.
    fn capture_branched(
        &mut self,
        rt: &dyn Runtime,
        calls: &[KernelCall],
        cap: Stream,
    ) -> Result<GraphExec> {
        let (side, fork, join) = match self.side {
            Some(x) => x,
            None => {
                let x = chain(rt)?;
                self.side = Some(x);
                x
            }
        };
        let (hint, hfork, hjoin) = match self.hint {
            Some(x) => x,
            None => {
                let x = chain(rt)?;
                self.hint = Some(x);
                x
            }
        };
        rt.capture_begin(cap)?;
        let mut nodes = Vec::with_capacity(calls.len());
        let mut open = false; // side calls captured since the last join
        let mut in_side = false; // the previous call was a side call
        let mut hinted = false; // hint calls captured
        let mut r: Result<()> = Ok(());
        for c in calls {
            r = (|| {
                if c.flow == FLOW_HINT {
                    rt.event_record(hfork, cap)?;
                    rt.stream_wait_event(hint, hfork)?;
                    rt.launch_call_plain(c, hint)?;
                    hinted = true;
                    nodes.push(rt.capture_node(hint)?);
                } else if c.flow == FLOW_SIDE {
                    let first = !in_side;
                    if first {
                        if open {
                            // A second side branch before a join: join the first one.
                            rt.event_record(join, side)?;
                            rt.stream_wait_event(cap, join)?;
                        }
                        rt.event_record(fork, cap)?;
                        rt.stream_wait_event(side, fork)?;
                        rt.launch_call_plain(c, side)?;
                    } else {
                        rt.launch_call(c, side)?;
                    }
                    open = true;
                    in_side = true;
                    nodes.push(rt.capture_node(side)?);
                } else {
                    in_side = false;
                    if c.flow == FLOW_JOIN && open {
                        rt.event_record(join, side)?;
                        rt.stream_wait_event(cap, join)?;
                        open = false;
                        rt.launch_call_plain(c, cap)?;
                    } else {
                        rt.launch_call(c, cap)?;
                    }
                    nodes.push(rt.capture_node(cap)?);
                }
                Ok(())
            })();
            if r.is_err() {
                break;
            }
        }
        // The capture ends joined: a side branch still open at the end of a piece, the hints.
        for (on, s, e) in [(open, side, join), (hinted, hint, hjoin)] {
            if on {
                let j = rt
                    .event_record(e, s)
                    .and_then(|_| rt.stream_wait_event(cap, e));
                if r.is_ok() {
                    r = j;
                }
            }
        }
        let exec = rt.capture_end_nodes(cap, nodes);
        match (r, exec) {
            (Ok(()), Ok(x)) => Ok(x),
            (Err(e), Ok(x)) => {
                rt.graph_destroy(&x);
                Err(GpuError::Invalid(format!("branched graph capture: {e}")))
            }
            (Err(e), Err(_)) | (Ok(()), Err(e)) => {
                Err(GpuError::Invalid(format!("branched graph capture: {e}")))
            }
        }
    }

    /// Destroy every graph and the capture stream (the device must be idle or the graphs'
    /// launches finished).
    pub fn clear(&mut self, rt: &dyn Runtime) {
        for g in self.graphs.drain(..) {
            rt.graph_destroy(&g.exec);
        }
        if let Some(s) = self.cap.take() {
            let _ = rt.stream_destroy(s);
        }
        for (s, a, b) in [self.side.take(), self.hint.take()].into_iter().flatten() {
            let _ = rt.stream_destroy(s);
            let _ = rt.event_destroy(a);
            let _ = rt.event_destroy(b);
        }
    }
}

/// A stream and two events (a fork and a join) for a chain of a branched capture.
fn chain(rt: &dyn Runtime) -> Result<(Stream, Event, Event)> {
    let s = rt.stream_create()?;
    match rt.event_create().and_then(|a| Ok((a, rt.event_create()?))) {
        Ok((a, b)) => Ok((s, a, b)),
        Err(e) => {
            let _ = rt.stream_destroy(s);
            Err(e)
        }
    }
}

/// View f32s as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // f32 has no padding or invalid bit patterns; x86-64 and aarch64 are little-endian.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    /// Every window of the concatenation, across source boundaries and 1 MiB pieces.
    #[test]
    fn par_gather_copies_windows_of_the_concatenation() {
        let srcs: Vec<Vec<u8>> = [3usize, (1 << 20) + 7, 0, (2 << 20) + 1, 5]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7) as u8).collect())
            .collect();
        let refs: Vec<&[u8]> = srcs.iter().map(|v| v.as_slice()).collect();
        let all: Vec<u8> = srcs.concat();
        for (start, len) in [
            (0, all.len()),
            (0, 3),
            (2, 5),
            (3, 1 << 20),
            ((1 << 20) + 9, (2 << 20) + 3),
            (all.len() - 4, 4),
        ] {
            let mut out = vec![0xAAu8; len];
            super::par_gather(&refs, start, len, out.as_mut_ptr());
            assert!(out == all[start..start + len], "window {start} + {len}");
        }
    }
}
