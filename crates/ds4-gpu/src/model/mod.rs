//! The resident GPU backend: every op of [`ds4_backend::Backend`] as kernels on one device
//! (CUDA or ROCm — the same code, the runtime decides). Weights are uploaded once; session
//! state (raw ring, compressor frontiers and rows) lives on the device; activations come from
//! a stream-ordered pool, so nothing waits for the device inside a step except reading the
//! logits (and, for now, the MoE selection in `matmul.rs`).
//!
//! Errors are sticky, as in the CUDA model: the first failing call is recorded, later ops
//! become no-ops, and [`Backend::check`] hands the error to the schedule at the end of a step.
//!
//! Files: `mod.rs` memory, weights, state and the trait; `attn.rs` RoPE, rounding,
//! compressors, indexer, attention; `mix.rs` embedding, hyper-connections, router,
//! elementwise; `matmul.rs` weight products; `switch.rs` the `DS4_GPU_*` environment switches.

mod arena;
mod attn;
mod blas;
mod gemm;
mod gemm_i8;
mod gemm_wg;
mod gemm_wgd;
mod matmul;
mod matvec;
mod mix;
mod moe;
mod precision;
mod prof;
mod sample;
mod switch;
pub mod synth;

pub use precision::Precision;

use crate::error::Result;
pub(crate) use crate::gpu::type_suffix;
use crate::gpu::{DeviceBuffer, Gpu, GraphStats, StepGraphs};
use crate::runtime::{
    Arg, DevPtr, KernelCall, LaunchDims, Runtime, Stream, Vendor, FLOW_HINT, FLOW_JOIN, FLOW_SIDE,
};
use ds4_backend::rope::RopeTables;
use ds4_backend::{
    AttnSpec, Backend, CompDims, CompressSpec, GgmlType, HcDims, HostCompState, HostLayerState,
    IndexSpec, LayerDims, MoeSpec, Part, RopeKind, RowRounding, WeightSrc, Which,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most tokens per step recorded as a graph (decode and short verify batches; prefill chunks
/// are long enough that launches cost little).
const GRAPH_MAX_N: usize = 4;

/// Launches per graph piece by default. H200, full-q2 decode at 2k context: one graph per step
/// 58.4 tok/s, pieces of 256 61.1 (launches one by one 54.7); tiny model: 994 vs 1184 with
/// pieces of 64 (bench/results/gpu-graph-h200.txt).
const GRAPH_SPLIT: usize = 256;

/// Launches in a step's first piece by default: the device is idle from the previous step's
/// result until the first piece is recorded (~1 µs a launch on the host). H200, full-q2 decode
/// at 2k: 32 gave 112.6 / 112.0 tok/s against 109.9 / 110.5 with 256 (64: 111.3 / 110.6;
/// bench/results/gpu-lead-s7-h200.txt).
const GRAPH_FIRST: usize = 32;

/// Graph replay of decode steps (`DS4_GPU_GRAPH=off` disables): between
/// [`Backend::graph_begin`] and the first host read (or [`Backend::graph_end`]) launches are
/// recorded instead of issued, then run as one graph ([`StepGraphs`]). The schedule still runs
/// on the host every step, so host bookkeeping (row counts, ring positions) is unchanged; only
/// the driver calls are batched. What the kernels see of the position comes from device memory
/// ([`StepPos`]), so a cached graph replays unchanged from one step to the next. Anything else that touches memory outside the stream
/// (uploads, allocations that free, snapshots, marks) first runs what was recorded.
#[derive(Default)]
struct GraphState {
    enabled: bool,
    calls: Vec<KernelCall>,
    graphs: StepGraphs,
    /// Run a step as graphs of this many launches each (0: one graph per step), so that the
    /// device runs piece i while the host records piece i + 1 (`DS4_GPU_GRAPH_SPLIT`, default
    /// [`GRAPH_SPLIT`]).
    split: usize,
    /// Launches in a step's first piece (`DS4_GPU_GRAPH_FIRST`, default [`GRAPH_FIRST`]): the
    /// device idles from the previous step's result until that piece is recorded and launched.
    first: usize,
    /// Pieces of this step run so far.
    piece: u64,
    /// When this step's recording began (for [`GraphStats::step_host_us`]).
    began: Option<std::time::Instant>,
    /// Record side branches ([`Backend::side_begin`]) for a graph of two chains
    /// (`DS4_GPU_BRANCH=off`: one chain, the calls in issue order).
    branch: bool,
    /// A side branch was begun and not joined yet (a piece is not cut meanwhile).
    open: bool,
    /// Between `side_begin` and `side_end`: calls are [`FLOW_SIDE`].
    in_side: bool,
    /// Joined: the next call is [`FLOW_JOIN`].
    pending_join: bool,
    /// The next call is a hint on its own chain ([`FLOW_HINT`], `Backend::prefetch`).
    hint: bool,
}

/// Two-chain decode steps (`Backend::side_begin`; the MoE's shared gate/up beside the router and
/// routed experts, the compressors beside the query path): on unless `DS4_GPU_BRANCH=off`.
fn branch_wanted() -> bool {
    !std::env::var("DS4_GPU_BRANCH").is_ok_and(|v| v == "off" || v == "0")
}

/// Pinned source slots of the step position (a ring, so that the host never rewrites a slot
/// whose copy may still be queued; see [`StepPos`]).
const POS_RING: usize = 256;

/// The per-step block in device memory: the first position of the current decode step (one
/// i64). Kernels of steps of up to [`GRAPH_MAX_N`] tokens read their position from it
/// (attention.cu `DS4_POS`) instead of taking it as an argument, so a replayed step graph needs
/// no node updates for the position. The host writes a new value into the next slot of a
/// pinned ring and queues a copy to `dev` on the stream (outside any graph: between the pieces
/// already launched and the one being recorded, whose kernels are the first to read it).
/// H200, full-q2 decode at 2k: 0 node updates per steady step instead of 258 (positions as
/// arguments), replay host time 34 instead of 215 µs a step, the same tok/s (the device bounds
/// it); bench/results/gpu-graph-d8-h200.txt.
struct StepPos {
    dev: DeviceBuffer,
    /// [`POS_RING`] pinned i64 slots.
    host: *mut i64,
    next: usize,
    /// The value the last queued copy writes.
    last: Option<i64>,
    /// Recorded after the last copy out of each half of the ring; waited on before that half
    /// is written again (long done in practice: a decode step reads its result).
    done: [Option<crate::runtime::Event>; 2],
    /// A copy was queued during the step being recorded now.
    in_step: bool,
}

// SAFETY: `host` is pinned memory owned by this struct, only touched under the backend's mutex.
unsafe impl Send for StepPos {}

/// Blocks of at least this many bytes come from [`arena::Arenas`] (shared by every size),
/// smaller ones from size classes (a decode step's blocks: the same addresses every step).
/// `DS4_GPU_POOL_ARENA_MIN` overrides (bytes; tests run every block through the arenas).
const ARENA_MIN: usize = 4 << 20;
/// The least a new arena region takes (a first prompt step's blocks then share one or two).
const REGION_MIN: u64 = 512 << 20;
/// Bytes past a region's usable end, never handed out: a small read past a block's end (vector
/// loads of a last partial tile) stays inside the allocation.
const REGION_SLACK: u64 = 2 << 20;

fn arena_min() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_usize("DS4_GPU_POOL_ARENA_MIN").unwrap_or(ARENA_MIN))
}

/// Device memory for activations: blocks under [`ARENA_MIN`] reused by size class (powers of
/// two from 256 bytes), larger ones suballocated from a few big regions ([`arena::Arenas`]). All
/// work runs on one stream, so a block freed by a dropped buffer is safe to hand out again:
/// its next user is ordered after its last. The exception, a recorded step's two branches
/// (`Backend::side_begin` to `join`), holds freed blocks back until the join ([`Pool::defer`]).
/// Byte counts (of whole blocks) say what a prompt step needs ([`StepMemory`]).
pub(crate) struct Pool {
    rt: Arc<dyn Runtime>,
    free: Mutex<HashMap<usize, Vec<DevPtr>>>,
    arenas: Mutex<arena::Arenas>,
    /// Blocks freed while a recorded step has two branches open (from `side_begin` to `join`):
    /// kept out of the free lists until the join, since the two branches are not ordered (a
    /// block freed in one must not be handed to the other).
    deferred: Mutex<Option<Vec<(usize, DevPtr)>>>,
    /// Sticky error shared with the backend (an allocation can fail inside an op).
    err: Arc<Mutex<Option<String>>>,
    /// Bytes of blocks handed out and not yet back (deferred ones included).
    in_use: AtomicU64,
    /// Most of `in_use` since [`Pool::reset_peak`].
    peak: AtomicU64,
    /// Bytes the pool holds that nothing uses: free class blocks and free arena ranges.
    cached: AtomicU64,
}

impl Pool {
    fn new(rt: Arc<dyn Runtime>, err: Arc<Mutex<Option<String>>>) -> Pool {
        Pool {
            rt,
            free: Mutex::new(HashMap::new()),
            arenas: Mutex::new(arena::Arenas::default()),
            deferred: Mutex::new(None),
            err,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            cached: AtomicU64::new(0),
        }
    }

    fn class(bytes: usize) -> usize {
        bytes.max(256).next_power_of_two()
    }

    /// What a block of `bytes` takes from the pool.
    fn held(bytes: usize) -> u64 {
        if bytes >= arena_min() {
            arena::Arenas::len_for(bytes as u64)
        } else {
            Self::class(bytes) as u64
        }
    }

    fn get(&self, bytes: usize) -> DevPtr {
        let p = if bytes >= arena_min() {
            self.take_large(bytes as u64)
        } else {
            self.take(Self::class(bytes))
        };
        if p.0 != 0 {
            let h = Self::held(bytes);
            let now = self.in_use.fetch_add(h, Ordering::Relaxed) + h;
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    fn take(&self, c: usize) -> DevPtr {
        if let Some(p) = self.free.lock().unwrap().get_mut(&c).and_then(|v| v.pop()) {
            self.cached.fetch_sub(c as u64, Ordering::Relaxed);
            return p;
        }
        match self.rt.alloc(c) {
            Ok(p) => p,
            Err(e) => {
                // Return everything idle to the device and try once more.
                self.trim();
                self.rt
                    .alloc(c)
                    .unwrap_or_else(|_| self.failed(c as u64, e))
            }
        }
    }

    /// A block of `bytes` from the arenas; a new region where none has a free range that long
    /// ([`REGION_MIN`] or more, else just this block's; idle memory returned first if need be).
    fn take_large(&self, bytes: u64) -> DevPtr {
        let len = arena::Arenas::len_for(bytes);
        let mut ar = self.arenas.lock().unwrap();
        if let Some(s) = ar.take(bytes) {
            self.cached.fetch_sub(len, Ordering::Relaxed);
            return DevPtr(s);
        }
        let region = |ar: &mut arena::Arenas, usable: u64| -> crate::error::Result<()> {
            let p = self.rt.alloc((usable + REGION_SLACK) as usize)?;
            ar.add_region(p.0, usable);
            self.cached.fetch_add(usable, Ordering::Relaxed);
            Ok(())
        };
        let mut made = region(&mut ar, len.max(REGION_MIN));
        if made.is_err() {
            made = region(&mut ar, len);
        }
        if made.is_err() {
            drop(ar);
            self.trim();
            ar = self.arenas.lock().unwrap();
            made = region(&mut ar, len);
        }
        match made {
            Ok(()) => {
                let s = ar.take(bytes).expect("a fresh region holds the block");
                self.cached.fetch_sub(len, Ordering::Relaxed);
                DevPtr(s)
            }
            Err(e) => self.failed(len + REGION_SLACK, e),
        }
    }

    fn failed(&self, bytes: u64, e: crate::error::GpuError) -> DevPtr {
        let mut err = self.err.lock().unwrap();
        err.get_or_insert_with(|| format!("device memory: {bytes} bytes: {e}"));
        DevPtr(0)
    }

    /// Start a new peak at what is in use now.
    fn reset_peak(&self) -> u64 {
        let now = self.in_use.load(Ordering::Relaxed);
        self.peak.store(now, Ordering::Relaxed);
        now
    }

    fn put(&self, bytes: usize, p: DevPtr) {
        if p.0 == 0 {
            return;
        }
        if let Some(d) = self.deferred.lock().unwrap().as_mut() {
            d.push((bytes, p));
            return;
        }
        let h = Self::held(bytes);
        if bytes >= arena_min() {
            let given = self.arenas.lock().unwrap().give(p.0);
            debug_assert_eq!(given, Some(h), "an arena block returns with its own length");
        } else {
            self.free
                .lock()
                .unwrap()
                .entry(h as usize)
                .or_default()
                .push(p);
        }
        self.in_use.fetch_sub(h, Ordering::Relaxed);
        self.cached.fetch_add(h, Ordering::Relaxed);
    }

    /// Hold freed blocks back (`on`), or return those held to the free lists (in the order
    /// they were freed) and stop holding.
    fn defer(&self, on: bool) {
        let held = {
            let mut d = self.deferred.lock().unwrap();
            if on {
                d.get_or_insert_with(Vec::new);
                return;
            }
            d.take()
        };
        for (bytes, p) in held.into_iter().flatten() {
            self.put(bytes, p);
        }
    }

    /// Put every free list in address order (lowest handed out first). Called at the start of
    /// a recorded step: the same schedule then gets the same addresses every step, so a graph
    /// replays with few updates (drop order would otherwise permute the lists). (Arena ranges
    /// are best fit by address: the same sequence from the same free ranges, the same addresses.)
    fn canonical(&self) {
        for v in self.free.lock().unwrap().values_mut() {
            v.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
        }
    }

    /// Returns every idle block and arena region to the device (after the device is idle);
    /// whether anything was returned.
    fn trim(&self) -> bool {
        let _ = self.rt.synchronize();
        let mut any = false;
        for (c, v) in self.free.lock().unwrap().drain() {
            for p in v {
                let _ = self.rt.free(p);
                self.cached.fetch_sub(c as u64, Ordering::Relaxed);
                any = true;
            }
        }
        for (base, usable) in self.arenas.lock().unwrap().take_idle_regions() {
            let _ = self.rt.free(DevPtr(base));
            self.cached.fetch_sub(usable, Ordering::Relaxed);
            any = true;
        }
        any
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.defer(false);
        self.trim();
    }
}

/// What prompt steps hold of the scratch pool, measured: the pool's peak over a step less what
/// was in use when it began (its outputs included). Steps hold nearly the same per token
/// whatever their length (rows of every activation), a little more as the context grows
/// (attention's per-query rows over the compressed keys), so the most per token seen so far
/// (with a margin, `auto_chunk`) sizes the next step.
#[derive(Default)]
struct StepMemory {
    /// The step being issued: its tokens and the pool's bytes in use at its start.
    open: Option<(usize, u64)>,
    /// Most pool bytes a token of a step of [`StepMemory::LEARN_MIN`] tokens or more held.
    per_token: Option<u64>,
    /// The prompt step in use (`Backend::prefill_chunk`): set at the first prompt, only shortened.
    step: Option<usize>,
}

impl StepMemory {
    /// Shorter steps are not measured (fixed costs would dominate their per-token figure).
    const LEARN_MIN: usize = 256;

    fn learn(&mut self, n: usize, held: u64) {
        let t = held.div_ceil(n.max(1) as u64);
        self.per_token = Some(self.per_token.map_or(t, |p| p.max(t)));
    }
}

/// An activation buffer of `len` 4-byte values (f32 for [`GpuBuf`], i32 for the index form).
pub struct GpuBuf {
    pub(crate) ptr: DevPtr,
    pub(crate) len: usize,
    pool: Arc<Pool>,
    /// A view into another buffer ([`GpuBuf::view`]): dropping it frees nothing.
    view: bool,
}

impl GpuBuf {
    /// `len` values from value `off` of this buffer, as a buffer that frees nothing when
    /// dropped. For ops queued at once (one token of a step's rows): the parent must outlive
    /// their recording; the stream orders any reuse of its block after them.
    pub(crate) fn view(&self, off: usize, len: usize) -> GpuBuf {
        GpuBuf {
            ptr: self.ptr.offset((off * 4) as u64),
            len,
            pool: self.pool.clone(),
            view: true,
        }
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        if !self.view {
            self.pool.put(self.len * 4, self.ptr);
        }
    }
}

/// i32 values on the device (token ids, selections).
pub struct GpuIBuf(pub(crate) GpuBuf);

/// A weight on the device. Matrices keep their GGUF block bytes (`rows` rows of `row_bytes`
/// per expert slab); vectors are f32; tables i32.
pub enum GpuWeight {
    Mat {
        buf: DeviceBuffer,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        experts: usize,
        row_bytes: usize,
        /// A second copy in the decode layout (matvec.rs `q8_decode_copy`: Q8_0 single-slab
        /// matrices; None otherwise or with `DS4_GPU_Q8_REPACK=off`). `buf` stays the GGUF blocks
        /// for the GEMM and everything else (`mat_parts`); the copy costs the same bytes again
        /// (~6 GiB for the q2 mix: its attention, shared-expert and head matrices). With
        /// [`GpuBackend::set_q8_decode_only`] it is the weight's only layout (`buf` null:
        /// [`GpuWeight::blocks`]).
        dec: Option<DeviceBuffer>,
        /// `dec` is in the interleaved layout (matvec.rs `Q8_IL`, kernels `*_q8_0i`), fixed at
        /// upload.
        dec_il: bool,
        /// An F16 copy in the interleaved F16 layout (matvec.rs `f16_il_copy`, `DS4_GPU_F16_IL`:
        /// the n = 1 `mvq_r2u4_f16i*` products of F16 single-slab matrices of >= 4096 rows and
        /// <= 2048 columns, the indexer's q_b; None otherwise), fixed at upload.
        f16i: Option<DeviceBuffer>,
        /// The bf16 operand of the dense prefill products (blas.rs `blas_w_*` output, made at
        /// the first product that needs it and kept, `DS4_GPU_BF16_CACHE`); dropped with the
        /// weight, so a later weight at the same address never sees it.
        bf: blas::BfSlot,
    },
    F32 {
        buf: DeviceBuffer,
        len: usize,
    },
    I32 {
        buf: DeviceBuffer,
        len: usize,
    },
}

impl GpuWeight {
    /// A matrix of GGUF blocks in `buf` with no copies in other layouts (expert slots, a table
    /// read from host memory).
    fn plain_mat(
        buf: DeviceBuffer,
        ty: GgmlType,
        [cols, rows, experts]: [usize; 3],
        row_bytes: usize,
    ) -> GpuWeight {
        GpuWeight::Mat {
            buf,
            ty,
            cols,
            rows,
            experts,
            row_bytes,
            dec: None,
            dec_il: false,
            f16i: None,
            bf: Default::default(),
        }
    }

    pub(crate) fn ptr(&self) -> DevPtr {
        match self {
            GpuWeight::Mat { buf, .. }
            | GpuWeight::F32 { buf, .. }
            | GpuWeight::I32 { buf, .. } => buf.ptr(),
        }
    }

    /// A single-slab matrix's W' slot (blas.rs); None for expert stacks, vectors and tables.
    pub(crate) fn bf_slot(&self) -> Option<&blas::BfSlot> {
        match self {
            GpuWeight::Mat { bf, experts: 1, .. } => Some(bf),
            _ => None,
        }
    }

    /// False for a Q8_0 matrix held in the decode layout only ([`GpuBackend::set_q8_decode_only`]:
    /// `buf` is then a null buffer and `dec` the weight); true for every other weight.
    pub(crate) fn blocks(&self) -> bool {
        !matches!(self, GpuWeight::Mat { buf, dec: Some(_), .. } if buf.ptr().0 == 0)
    }

    /// A Q8_0 matrix's decode layout (matvec.rs `q8_decode_copy`) and whether it is
    /// interleaved; None where it has none.
    pub(crate) fn dec_parts(&self) -> Option<(DevPtr, bool)> {
        match self {
            GpuWeight::Mat {
                ty: GgmlType::Q8_0,
                dec: Some(d),
                dec_il,
                ..
            } => Some((d.ptr(), *dec_il)),
            _ => None,
        }
    }

    /// A matrix's (pointer, type, cols, rows, row_bytes); None for vectors and tables. The
    /// pointer is null where [`GpuWeight::blocks`] is false.
    pub(crate) fn mat_parts(&self) -> Option<(DevPtr, GgmlType, usize, usize, usize)> {
        match self {
            GpuWeight::Mat {
                buf,
                ty,
                cols,
                rows,
                row_bytes,
                ..
            } => Some((buf.ptr(), *ty, *cols, *rows, *row_bytes)),
            _ => None,
        }
    }
}

/// A compressor's device state: frontier (`slots × width` values and scores) and the emitted
/// rows (`n_rows` of `d`, capacity `cap`, grown by doubling).
pub struct GpuComp {
    pub(crate) dims: CompDims,
    pub(crate) front_kv: DeviceBuffer,
    pub(crate) front_score: DeviceBuffer,
    pub(crate) rows: DeviceBuffer,
    /// Rows `rows` holds: doubles as rows arrive, stopping at `limit` (64 first).
    pub(crate) cap: usize,
    /// The rows of the session's whole context rounded up to [`ROW_ALIGN`]
    /// ([`Backend::bound_state`]; `usize::MAX` unbounded): a 600k context holds 600k tokens'
    /// rows, not 1M's. Only growth past it (a state longer than its context) doubles again.
    /// A restored state holds its rows rounded up to ROW_ALIGN until it grows.
    pub(crate) limit: usize,
    pub(crate) n_rows: usize,
    /// Rows stored as bf16, not f32: the indexer's when FP4-simulated ([`LayerDims::index_fp4`];
    /// exact, half the bytes its scores read: 67 instead of 134 MB a layer at 1M tokens). Written
    /// by `compress_row_f32`, read by every `index_scores*` kernel; the host form stays f32.
    pub(crate) bf16: bool,
}

impl GpuComp {
    /// Bytes a stored value.
    pub(crate) fn elem(&self) -> usize {
        row_elem(self.bf16)
    }
}

/// Row capacities are multiples of this: the decode scores use the capacity as their row
/// stride, and the top-k reads them as float4 (a multiple of 4 keeps them 16-byte aligned).
pub(crate) const ROW_ALIGN: usize = 64;

/// The capacity that holds `rows` rows: the next power of two, or `limit` where that is
/// smaller and holds them; a multiple of [`ROW_ALIGN`].
fn grown_cap(rows: usize, limit: usize) -> usize {
    let cap = rows.next_power_of_two();
    let cap = if rows <= limit { cap.min(limit) } else { cap };
    cap.next_multiple_of(ROW_ALIGN)
}

/// [`GpuComp::limit`] for a context of `tokens` positions at one row per `ratio`.
fn row_limit(tokens: usize, ratio: usize) -> usize {
    (tokens / ratio.max(1)).max(1).next_multiple_of(ROW_ALIGN)
}

/// Bytes a stored row value: 2 for bf16 rows, 4 for f32.
fn row_elem(bf16: bool) -> usize {
    if bf16 {
        2
    } else {
        4
    }
}

/// One layer's device state. `raw` is the ring (`window × head_dim` f32, position p in slot
/// p mod window); `raw_pos` the position each slot holds (i32, −1 empty).
pub struct GpuLayerState {
    pub(crate) dims: LayerDims,
    pub(crate) raw: DeviceBuffer,
    pub(crate) raw_pos: DeviceBuffer,
    pub(crate) comp: Option<GpuComp>,
    pub(crate) index: Option<GpuComp>,
}

impl GpuLayerState {
    pub(crate) fn comp_mut(&mut self, w: Which) -> Option<&mut GpuComp> {
        match w {
            Which::Attn => self.comp.as_mut(),
            Which::Index => self.index.as_mut(),
        }
    }

    /// Rows the compressed and the indexer row buffers hold room for (tests, diagnostics).
    pub fn row_capacity(&self) -> [Option<usize>; 2] {
        [self.comp.as_ref(), self.index.as_ref()].map(|c| c.map(|c| c.cap))
    }
}

/// A layer's state at a checkpoint: copies of byte ranges of its buffers (pooled scratch: a
/// speculative step's checkpoint allocates nothing once warm) and the compressed row counts.
/// A whole mark ([`Backend::mark_all`]) keeps the ring, its positions and each compressor's
/// frontier; a slot mark ([`Backend::mark_slots_all`]) what one token writes: its ring row and
/// position, its frontier slots (with the previous window's where it closes a CSA window) and
/// whether it pooled a row. The compressed rows themselves are append-only: rows past the count
/// are simply overwritten later.
pub struct GpuMark {
    /// (buffer, byte offset in it, the copy, bytes).
    saved: Vec<(Field, usize, GpuBuf, usize)>,
    /// The attention compressor's and the indexer's row counts to return to.
    n_rows: [Rows; 2],
}

/// A compressor's row count at a rollback.
#[derive(Clone, Copy)]
enum Rows {
    Keep,
    /// A whole mark's count.
    To(usize),
    /// One less: a slot mark's token pooled a row (the batch's earlier rows stay).
    DropLast,
}

/// A state buffer of a layer, as [`GpuMark`] names it (resolved at rollback).
#[derive(Clone, Copy)]
enum Field {
    Raw,
    RawPos,
    /// Frontier `state_kv` / `state_score` of the attention compressor (0) or the indexer's (1).
    Kv(usize),
    Score(usize),
}

impl GpuLayerState {
    fn field(&self, f: Field) -> DevPtr {
        let comp = |i: usize| {
            [&self.comp, &self.index][i]
                .as_ref()
                .expect("a mark names only compressors the layer has")
        };
        match f {
            Field::Raw => self.raw.ptr(),
            Field::RawPos => self.raw_pos.ptr(),
            Field::Kv(i) => comp(i).front_kv.ptr(),
            Field::Score(i) => comp(i).front_score.ptr(),
        }
    }
    fn n_rows(&self) -> [Rows; 2] {
        [&self.comp, &self.index].map(|c| c.as_ref().map_or(Rows::Keep, |c| Rows::To(c.n_rows)))
    }
}

pub struct GpuBackend {
    pub(crate) gpu: Gpu,
    pub(crate) stream: Stream,
    pub(crate) pool: Arc<Pool>,
    err: Arc<Mutex<Option<String>>>,
    /// Pair frequencies ω_p (f64) of the two RoPE tables: [Swa, Comp].
    pub(crate) rope_freqs: [DeviceBuffer; 2],
    /// Bytes of weights uploaded so far.
    weight_bytes: Mutex<u64>,
    /// Bytes of the weights' copies in other layouts made so far ([`GpuBackend::layout_copy_bytes`]).
    layout_bytes: Mutex<u64>,
    /// Whether uploads make those copies ([`GpuBackend::set_layout_copies`]; default on).
    layout_copies: std::sync::atomic::AtomicBool,
    /// Whether uploads keep Q8_0 matrices in the decode layout only, their GGUF blocks dropped
    /// ([`GpuBackend::set_q8_decode_only`]; `DS4_GPU_Q8_DEC_ONLY=1` forces it).
    q8_dec_only: std::sync::atomic::AtomicBool,
    /// `DS4_GPU_POISON=1`: new activation buffers are filled with NaN instead of left as they
    /// are (tests use it to prove every op writes its whole output).
    poison: bool,
    /// `DS4_GPU_PROFILE=1`: per-op device time (prof.rs).
    prof: Option<prof::Prof>,
    /// Launches are being recorded (see [`GraphState`]).
    recording: AtomicBool,
    graph: Mutex<GraphState>,
    /// Arrival counters of the kernels that finish in their last CTA, zero between launches
    /// (`TICKET_WORDS` u32 words): words below `mix::FUSE_TICKETS` the fused HC (by token),
    /// `attn::AO_TICKET` and the next word decode attention, `mix::ROUTE_TICKET` the fused
    /// router. The two chains of a branched step run concurrently: a kernel between
    /// `side_begin` and `join` must not use a word that the other branch uses (today only the
    /// router, on the main branch, uses one there).
    pub(crate) tickets: DeviceBuffer,
    /// Vendor BLAS-Lt state for dense prefill products (blas.rs), opened on first use.
    pub(crate) blas: blas::BlasSlot,
    /// The step position in device memory ([`StepPos`]); None where it could not be set up
    /// (positions are then kernel arguments).
    step: Mutex<Option<StepPos>>,
    /// What prompt steps have needed of the scratch pool (each prompt step's size is chosen
    /// from it and the memory available then: gemm.rs `auto_chunk`).
    step_mem: Mutex<StepMemory>,
    /// Compressor row buffers replaced by larger ones ([`GpuBackend::reserve_rows`]), freed at
    /// the next point where the host waits for the device anyway ([`GpuBackend::free_retired`]).
    retired: Mutex<Vec<DeviceBuffer>>,
    /// This rank's all-reduce where the model is split by experts (`ds4_backend::shard`).
    comm: Option<GpuComm>,
}

/// How an expert-parallel rank adds the ranks' MoE sums ([`Backend::all_reduce_sum`]).
pub enum GpuComm {
    /// NCCL / RCCL, one device a rank (ccl.rs): queued on the stream, graphs kept.
    Ccl(crate::ccl::CclComm),
    /// Through host memory (`ds4_backend::HostComm`): waits for the device, so decode steps run
    /// without graphs. For ranks that share a device (tests: NCCL refuses those).
    Host {
        rank: usize,
        comm: Arc<ds4_backend::HostComm>,
    },
}

/// Kernels never launched (`DS4_GPU_SKIP=name,name,..`, exact kernel names, read once, or
/// [`GpuBackend::set_skip`]): a knock-out for timing experiments only. What such a kernel would
/// have written keeps whatever the buffer held, so every result after it is wrong; the step's
/// time less the full step's is then what that kernel costs where it runs (in the decode graph,
/// with its overlap), which Nsight Compute's one-kernel-at-a-time times do not show. Kernels
/// whose outputs are indices (the router's selection, the indexer's top-k) can make the run fail:
/// stale indices may read out of bounds (index_topk_r does on the H200). Printed once per name
/// on stderr.
/// Each entry: the name, and whether it was printed yet.
static SKIP: Mutex<Option<Vec<(String, bool)>>> = Mutex::new(None);
/// Whether [`SKIP`] is known empty (1) or not (2); 0 before it is read.
static SKIP_ANY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The `DS4_GPU_SKIP` list: comma-separated names, blanks trimmed, empty items dropped.
fn skip_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// Whether `name` is knocked out (see [`SKIP`]); says so on stderr the first time.
fn knocked_out(name: &str) -> bool {
    // 0: not read yet, 1: empty list (the launch path's only cost: this load), 2: a list.
    if SKIP_ANY.load(Ordering::Relaxed) == 1 {
        return false;
    }
    let mut g = SKIP.lock().unwrap();
    let list = g.get_or_insert_with(|| {
        let v = std::env::var("DS4_GPU_SKIP").unwrap_or_default();
        skip_list(&v).into_iter().map(|n| (n, false)).collect()
    });
    SKIP_ANY.store(if list.is_empty() { 1 } else { 2 }, Ordering::Relaxed);
    let Some((_, told)) = list.iter_mut().find(|(k, _)| k == name) else {
        return false;
    };
    if !*told {
        eprintln!("ds4: DS4_GPU_SKIP: {name} is not launched (timing experiments only: results are wrong)");
        *told = true;
    }
    true
}

/// `copy_list` launches (process-wide; [`GpuBackend::copy_list_launches`]).
static COPY_LISTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `DS4_GPU_DEFER_FREE` (unset: on; `0` off): [`GpuBackend::reserve_rows`] keeps the old rows
/// buffer until the next host wait instead of freeing it at once. cuMemFree waits for the
/// device (session 8's driver-call timer: 20 such frees of ~38 ms each in a 2k prompt, one per
/// compressor that grows: every CSA layer of a new session's first prompt), so the device ran
/// dry and then waited for the host's next launches; deferred, the free costs nothing (the
/// device is idle then). Old form: `0`.
static DEFER_FREE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(switch::UNSET);

/// `DS4_GPU_PREFETCH=MB` (`off` / `0`: none): the most bytes, in MiB, that one
/// [`Backend::prefetch`] hint moves into L2 (the first bytes of its weights, in order; the
/// kernel `prefetch_l2`, CUDA only, decode steps of <= 4 tokens). Unset: [`PREFETCH_MB`].
static PREFETCH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(switch::UNSET);

/// The default budget of a prefetch hint, MiB (an H200's L2 is 50 MiB; 0: off). Off: as one
/// kernel in the decode graph's main chain the hints cost 14-18% of decode on an H200 (24 MiB:
/// 162 -> 139 tokens/s at 2k, 160 -> 136 at 32k; `bench/results/gpu-s42-h200.txt` run C): the
/// next kernel waited for the prefetch grid. On a chain of their own (FLOW_HINT, session 43)
/// they cost nothing and gain nothing: 34 layers on an H100, 180.9 / 182.7 -> 181.3 / 181.8
/// tokens/s at 2k, 180.6 / 179.2 -> 180.3 / 179.5 at 32k (`gpu-s43-h100.txt` run C; there too
/// the next layer's query weights hinted ahead, evict-last, lost 3-4%, and the selected
/// experts' down rows hinted during the gate/up tied; both forms were dropped).
const PREFETCH_MB: u8 = 0;

/// `prefetch_l2` launches (process-wide; [`GpuBackend::prefetch_launches`]).
static PREFETCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Words of [`GpuBackend::tickets`].
pub(crate) const TICKET_WORDS: usize = 128;

impl Drop for GpuBackend {
    fn drop(&mut self) {
        self.flush(false);
        self.prof_collect();
        self.prof_report();
        if self.prof.is_some() {
            // The bf16 operands of the library's products (blas.rs): conversions queued in
            // this process, copies kept by this backend's weights.
            let ((w, x), (bytes, copies, declined)) =
                (GpuBackend::blas_conversions(), self.bf16_cache_stats());
            eprintln!(
                "# BLAS bf16 operands: {w} W' and {x} X' conversions; {copies} W' copies kept \
                 ({:.2} GiB), {declined} declined",
                bytes as f64 / (1u64 << 30) as f64
            );
        }
        let _ = self.gpu.synchronize();
        let rt = self.gpu.runtime().clone();
        let mut g = self.graph.lock().unwrap();
        if std::env::var("DS4_GPU_GRAPH_STATS").is_ok_and(|v| v == "1") {
            eprintln!("# GPU graphs (DS4_GPU_GRAPH_STATS=1): {:?}", g.graphs.stats);
        }
        g.graphs.clear(rt.as_ref());
        if let Some(sp) = self.step.lock().unwrap().take() {
            for e in sp.done.into_iter().flatten() {
                let _ = rt.event_destroy(e);
            }
            // SAFETY: allocated by alloc_pinned in `step_setup`; the device is idle.
            let _ = unsafe { rt.free_pinned(sp.host as *mut u8) };
        }
    }
}

fn env_usize(key: &str) -> Option<usize> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    crate::gpu::f32_bytes(v)
}

impl GpuBackend {
    /// A backend on `gpu` for a model with these RoPE tables.
    pub fn new(gpu: Gpu, ropes: &RopeTables) -> Result<GpuBackend> {
        let err = Arc::new(Mutex::new(None));
        let pool = Arc::new(Pool::new(gpu.runtime().clone(), err.clone()));
        // DS4_GPU_MATVEC=off|on|v1|v2|v3: matvec.rs off, on for one-row products too (default:
        // only 2..4 rows), or an n = 1 variant.
        match std::env::var("DS4_GPU_MATVEC").as_deref() {
            Ok("off") => GpuBackend::set_matvec(false),
            Ok("on") => GpuBackend::set_matvec(true),
            Ok(v) if v.len() == 2 && v.starts_with('v') => {
                GpuBackend::set_matvec(true);
                GpuBackend::set_matvec_variant(v[1..].parse().unwrap_or(0))
            }
            _ => {}
        }
        // DS4_GPU_MATMUL=direct|tiles|coalesced picks the weight-product kernel form (matmul.rs).
        match std::env::var("DS4_GPU_MATMUL").as_deref() {
            Ok("tiles") => GpuBackend::set_matmul_tiles(true),
            Ok("coalesced") => GpuBackend::set_matmul_coalesced(true),
            Ok("direct") => {
                GpuBackend::set_matmul_tiles(false);
                GpuBackend::set_matmul_coalesced(false);
            }
            _ => {}
        }
        // Every kernel now, in parallel (cached on disk after the first start), so the first
        // request does not wait for the compiler.
        gpu.load_all(ds4_kernels::MODULES)?;
        let f64s = |v: &[f64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let rope_freqs = [
            gpu.alloc_from(&f64s(&ropes.swa.freqs))?,
            gpu.alloc_from(&f64s(&ropes.comp.freqs))?,
        ];
        let tickets = gpu.alloc_from(&[0u8; 4 * TICKET_WORDS])?;
        let step = Mutex::new(Self::step_setup(&gpu));
        Ok(GpuBackend {
            step,
            step_mem: Mutex::new(StepMemory::default()),
            retired: Mutex::new(Vec::new()),
            comm: None,
            tickets,
            blas: Default::default(),
            stream: Stream::DEFAULT,
            gpu,
            pool,
            err,
            rope_freqs,
            weight_bytes: Mutex::new(0),
            layout_bytes: Mutex::new(0),
            layout_copies: std::sync::atomic::AtomicBool::new(true),
            q8_dec_only: std::sync::atomic::AtomicBool::new(
                std::env::var("DS4_GPU_Q8_DEC_ONLY").is_ok_and(|v| v == "1" || v == "on"),
            ),
            poison: std::env::var("DS4_GPU_POISON").is_ok_and(|v| v == "1"),
            prof: std::env::var("DS4_GPU_PROFILE")
                .is_ok_and(|v| v == "1")
                .then(prof::Prof::default),
            recording: AtomicBool::new(false),
            graph: Mutex::new(GraphState {
                enabled: !std::env::var("DS4_GPU_GRAPH").is_ok_and(|v| v == "off" || v == "0"),
                graphs: StepGraphs::new(),
                split: env_usize("DS4_GPU_GRAPH_SPLIT").unwrap_or(GRAPH_SPLIT),
                first: env_usize("DS4_GPU_GRAPH_FIRST").unwrap_or(GRAPH_FIRST),
                branch: branch_wanted(),
                ..GraphState::default()
            }),
        }
        .blas_started()) // the BLAS-Lt library now, not inside the first prompt (blas.rs)
    }

    /// This backend as a rank of an expert-parallel group (`ds4_backend::shard`).
    pub fn with_comm(mut self, comm: GpuComm) -> GpuBackend {
        if matches!(comm, GpuComm::Host { .. }) {
            self.set_graph(false);
        }
        self.comm = Some(comm);
        self
    }

    /// What joins this rank to its group, if anything.
    pub fn comm(&self) -> Option<&GpuComm> {
        self.comm.as_ref()
    }

    /// Inside a recorded step: run what was recorded as the step's next graph piece and go on
    /// recording (a collective is then queued between two pieces: graphs hold kernels only).
    fn cut_piece(&self) {
        if !self.recording.load(Ordering::Acquire) {
            return;
        }
        let g = self.graph.lock().unwrap();
        if g.calls.is_empty() {
            return;
        }
        if g.open || !g.enabled {
            drop(g);
            self.flush(true);
            return;
        }
        self.run_piece(g);
    }

    /// The recorded calls as the step's next graph piece, recording going on (graph replay
    /// off for good, and the calls launched one by one, if the driver refuses it).
    fn run_piece(&self, mut g: std::sync::MutexGuard<'_, GraphState>) {
        let calls = std::mem::take(&mut g.calls);
        let piece = g.piece;
        let rt = self.gpu.runtime().clone();
        match g.graphs.run(rt.as_ref(), &calls, self.stream, piece) {
            Ok(()) => {
                g.piece += 1;
                g.calls = calls;
                g.calls.clear();
            }
            Err(e) => {
                eprintln!("ds4: GPU graph replay turned off: {e}");
                g.enabled = false;
                g.calls = calls;
                drop(g);
                self.flush(false);
            }
        }
    }

    /// The step position block ([`StepPos`]), None when pinned memory is refused.
    fn step_setup(gpu: &Gpu) -> Option<StepPos> {
        let rt = gpu.runtime();
        let dev = gpu.alloc_from(&[0u8; 8]).ok()?;
        let host = rt.alloc_pinned(POS_RING * 8).ok()? as *mut i64;
        Some(StepPos {
            dev,
            host,
            next: 0,
            last: None,
            done: [None, None],
            in_step: false,
        })
    }

    /// The device address holding `t0` for the kernels of a step of `n` tokens at `t0`, or None
    /// (prefill chunks; no pinned memory): the kernels then take the position as an argument. A new value is queued on the stream here (see [`StepPos`]); kernels given the
    /// address take positions relative to it (0 for the step's first token).
    pub(crate) fn step_pos(&self, t0: usize, n: usize) -> Option<DevPtr> {
        if n == 0 || n > GRAPH_MAX_N || self.failed() {
            return None;
        }
        let v = t0 as i64;
        let mut guard = self.step.lock().unwrap();
        let sp = guard.as_mut()?;
        if sp.last == Some(v) {
            return Some(sp.dev.ptr());
        }
        if sp.in_step && self.recording.load(Ordering::Acquire) {
            // A second position within one recorded step: launches recorded so far read the
            // old value, so they run first (does not happen in the model's schedule).
            drop(guard);
            self.interrupt();
            guard = self.step.lock().unwrap();
        }
        let sp = guard.as_mut()?;
        let rt = self.gpu.runtime();
        let slot = sp.next;
        let half = slot / (POS_RING / 2);
        if slot % (POS_RING / 2) == 0 {
            if let Some(e) = sp.done[half] {
                self.note(rt.event_sync(e))?;
            }
        }
        // SAFETY: slot < POS_RING inside the pinned allocation; the copies that read this slot
        // before have completed (the event above).
        unsafe { sp.host.add(slot).write(v) };
        let r = unsafe {
            rt.copy_h2d_async(sp.dev.ptr(), sp.host.add(slot) as *const u8, 8, self.stream)
        };
        self.note(r)?;
        if (slot + 1) % (POS_RING / 2) == 0 {
            let e = match sp.done[half] {
                Some(e) => e,
                None => self.note(rt.event_create())?,
            };
            sp.done[half] = Some(e);
            self.note(rt.event_record(e, self.stream))?;
        }
        sp.next = (slot + 1) % POS_RING;
        sp.last = Some(v);
        sp.in_step = true;
        Some(sp.dev.ptr())
    }

    /// Turn graph replay of decode steps on or off for this backend (default on unless
    /// `DS4_GPU_GRAPH=off`; profiling turns it off).
    pub fn set_graph(&self, on: bool) {
        self.flush(false);
        self.graph.lock().unwrap().enabled = on;
    }

    /// Run a recorded step as graphs of `calls` launches each (0: one graph per step).
    pub fn set_graph_split(&self, calls: usize) {
        self.flush(false);
        let mut g = self.graph.lock().unwrap();
        g.split = calls;
        g.first = calls;
    }

    /// Record decode steps' side branches as a second chain of their graphs (default on unless
    /// `DS4_GPU_BRANCH=off`), or keep one chain.
    pub fn set_branch(&self, on: bool) {
        self.flush(false);
        self.graph.lock().unwrap().branch = on;
    }

    /// Whether decode steps run as graphs.
    pub fn graph_on(&self) -> bool {
        self.prof.is_none()
            && self.graph.lock().unwrap().enabled
            && self.gpu.runtime().graphs_supported()
    }

    /// Most scratch-pool bytes a token of a prompt step has held so far (steps of 256 tokens
    /// or more; None before the first), which sizes the next steps (`Backend::prefill_chunk`).
    pub fn step_scratch_per_token(&self) -> Option<u64> {
        self.step_mem.lock().unwrap().per_token
    }

    /// Bytes of scratch-pool blocks handed out now and held idle in the pool.
    pub fn pool_bytes(&self) -> (u64, u64) {
        (
            self.pool.in_use.load(Ordering::Relaxed),
            self.pool.cached.load(Ordering::Relaxed),
        )
    }

    /// Counts of graph captures, replays and node updates so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graph.lock().unwrap().graphs.stats
    }

    /// Stop recording and run what was recorded: as a graph (`as_graph`, the end of a step),
    /// or launch by launch (the step was interrupted by something outside the stream).
    pub(crate) fn flush(&self, as_graph: bool) {
        if !self.recording.swap(false, Ordering::AcqRel) {
            return;
        }
        let mut g = self.graph.lock().unwrap();
        let calls = std::mem::take(&mut g.calls);
        // A branch still open ends here: what follows (eager launches, or the next step's
        // recording) is one chain after these calls. The pool holds blocks back until the join.
        g.open = false;
        g.in_side = false;
        g.pending_join = false;
        if calls.is_empty() || self.failed() {
            return;
        }
        let rt = self.gpu.runtime().clone();
        if as_graph && g.enabled {
            let piece = g.piece;
            match g.graphs.run(rt.as_ref(), &calls, self.stream, piece) {
                Ok(()) => {
                    g.calls = calls; // keep the allocation
                    g.calls.clear();
                    // The step's last piece is queued: the host's share of the step ends here.
                    if let Some(t) = g.began.take() {
                        g.graphs.stats.steps += 1;
                        g.graphs.stats.step_host_us += t.elapsed().as_micros() as u64;
                        if g.graphs.trace {
                            let diffs = std::mem::take(&mut g.graphs.diffs);
                            let steps = g.graphs.stats.steps;
                            drop(g);
                            self.trace_step(steps, &diffs);
                        }
                    }
                    return;
                }
                Err(e) => {
                    eprintln!("ds4: GPU graph replay turned off: {e}");
                    g.enabled = false;
                }
            }
        }
        g.graphs.stats.eager += 1;
        if g.graphs.trace && g.graphs.stats.eager <= 40 {
            eprintln!(
                "ds4 graph: {} recorded launches run one by one",
                calls.len()
            );
        }
        g.graphs.stats.calls += calls.len() as u64;
        drop(g);
        for c in &calls {
            if let Err(e) = rt.launch_call(c, self.stream) {
                self.note::<()>(Err(e));
                break;
            }
        }
    }

    /// `DS4_GPU_GRAPH_TRACE=1`: one line per graphed step naming the kernel nodes updated
    /// before its replays, grouped by kernel and changed argument slots (`g` = grid/block).
    fn trace_step(&self, step: u64, diffs: &[(crate::runtime::Function, u32)]) {
        let mut groups: Vec<((u64, u32), usize)> = Vec::new();
        for &(f, m) in diffs {
            match groups.iter_mut().find(|(k, _)| *k == (f.0, m)) {
                Some((_, c)) => *c += 1,
                None => groups.push(((f.0, m), 1)),
            }
        }
        let mut line = format!("ds4 graph step {step}: {} updated", diffs.len());
        for ((f, m), c) in groups {
            let name = self
                .gpu
                .kernel_name(crate::runtime::Function(f))
                .unwrap_or_else(|| format!("{f:#x}"));
            let slots: Vec<String> = (0..32)
                .filter(|i| m & (1 << i) != 0)
                .map(|i| if i == 31 { "g".into() } else { i.to_string() })
                .collect();
            line += &format!(" | {name}[{}]x{c}", slots.join(","));
        }
        eprintln!("{line}");
    }

    /// Before an action outside the stream (allocations that free, snapshots, marks): run
    /// what was recorded so far, launch by launch, and stop recording this step.
    /// `DS4_GPU_CUPROFILE=K`: a profiler capture range around the K-th decode step (n = 1,
    /// counted from 1) of this process, for `ncu --profile-from-start off` or
    /// `nsys --capture-range=cudaProfilerApi`: one step's kernels, not the load and prefill.
    fn profiler_range(&self, n: usize) {
        static STEP: AtomicU64 = AtomicU64::new(0);
        static TARGET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let k = *TARGET.get_or_init(|| {
            std::env::var("DS4_GPU_CUPROFILE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        });
        if k == 0 || n != 1 {
            return;
        }
        let step = STEP.fetch_add(1, Ordering::Relaxed) + 1;
        if step == k || step == k + 1 {
            self.flush(true);
            self.gpu.runtime().profiler(step == k);
        }
    }

    /// The device address that a gather of `slabs` into `slots` copies to, after checking that
    /// they fit (else the error is noted: None), with the recorded calls so far launched (the
    /// copies are ordered after them).
    fn slots_for(&self, slots: &GpuWeight, slabs: &[&[u8]]) -> Option<crate::runtime::DevPtr> {
        let GpuWeight::Mat {
            buf,
            rows,
            row_bytes,
            experts,
            ..
        } = slots
        else {
            return None;
        };
        let slab = rows * row_bytes;
        if slabs.len() > *experts || slabs.iter().any(|s| s.len() != slab) {
            self.note::<()>(Err(crate::error::GpuError::Invalid(format!(
                "gather of {} experts into {experts} slots of {slab} bytes",
                slabs.len()
            ))));
            return None;
        }
        self.interrupt();
        (!self.failed()).then(|| buf.ptr())
    }

    pub(crate) fn interrupt(&self) {
        if self.recording.load(Ordering::Acquire) {
            self.flush(false);
        }
    }

    /// Before an upload: as [`GpuBackend::interrupt`], except that at the very start of a
    /// recorded step (nothing recorded yet: the token ids) recording goes on.
    fn before_upload(&self) {
        if self.recording.load(Ordering::Acquire) {
            let g = self.graph.lock().unwrap();
            let started = !g.calls.is_empty() || g.piece > 0;
            drop(g);
            if started {
                self.flush(false);
            }
        }
    }

    /// Record `f` (true) when recording, else false (launch it now).
    fn record(&self, f: crate::runtime::Function, dims: LaunchDims, args: &[Arg]) -> bool {
        if !self.recording.load(Ordering::Acquire) {
            return false;
        }
        match KernelCall::new(f, dims, args) {
            Some(mut c) => {
                let mut g = self.graph.lock().unwrap();
                if g.hint {
                    c.flow = FLOW_HINT;
                    g.hint = false;
                } else if g.in_side {
                    c.flow = FLOW_SIDE;
                } else if g.pending_join {
                    c.flow = FLOW_JOIN;
                    g.pending_join = false;
                }
                g.calls.push(c);
                let piece_len = if g.piece == 0 && g.first > 0 {
                    g.first
                } else {
                    g.split
                };
                if g.split > 0 && g.calls.len() >= piece_len && !g.open {
                    // This piece now, as a graph; keep recording the next.
                    self.run_piece(g);
                }
                true
            }
            None => {
                self.flush(false);
                false
            }
        }
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Device bytes held by weights (their own bytes; the layout copies are
    /// [`GpuBackend::layout_bytes`]).
    pub fn weight_bytes(&self) -> u64 {
        *self.weight_bytes.lock().unwrap()
    }

    /// Device bytes held by the weights' copies in other layouts (decode-layout Q8_0 and
    /// interleaved F16 copies, made at upload).
    pub fn layout_bytes(&self) -> u64 {
        *self.layout_bytes.lock().unwrap()
    }

    /// Whether weights uploaded from now on get their layout copies (off: less device memory,
    /// the one-token products then read the GGUF blocks; the engine turns them off for a model
    /// that does not fit with them).
    pub fn set_layout_copies(&self, on: bool) {
        self.layout_copies
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn layout_copies(&self) -> bool {
        self.layout_copies
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether Q8_0 matrices uploaded from now on are held in the decode layout only (matvec.rs
    /// `q8_decode_copy`'s layout, made from the GGUF blocks, which are then dropped): the same
    /// device bytes as the blocks alone, and the one-token products as fast as with both. The
    /// engine turns it on where the layout copies do not fit beside the blocks (an 80 GB card
    /// with the q2 mix, one H200 with q4). Every product of such a matrix runs from that layout:
    /// n <= 4 tokens by the decode kernels, prompts by the vendor BLAS (its bf16 operand
    /// converted from the decode layout, blas.rs); a path that would need the blocks (the
    /// built-in GEMM, `DS4_GPU_BLAS=off`) is refused with an error naming the weight's layout
    /// (matmul.rs `mat`). `DS4_GPU_Q8_REPACK=off` (no decode layout at all) wins over it.
    pub fn set_q8_decode_only(&self, on: bool) {
        self.q8_dec_only
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// A backend whose weights fit only without the layout copies (the engine's plan): none are
    /// made, and the Q8_0 matrices keep the decode layout alone where the vendor BLAS runs the
    /// prompt products (the built-in GEMM reads blocks: without the library they stay blocks).
    pub fn without_layout_copies(&self) {
        self.set_layout_copies(false);
        self.set_q8_decode_only(self.blas_runs_prompts());
    }

    pub fn q8_decode_only(&self) -> bool {
        self.q8_dec_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn count_layout_copy(&self, bytes: usize) {
        *self.layout_bytes.lock().unwrap() += bytes as u64;
    }

    pub(crate) fn rope_ptr(&self, k: RopeKind) -> DevPtr {
        match k {
            RopeKind::Swa => self.rope_freqs[0].ptr(),
            RopeKind::Comp => self.rope_freqs[1].ptr(),
        }
    }

    /// Record `r`'s error if it is the first one.
    pub(crate) fn note<T>(&self, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.err
                    .lock()
                    .unwrap()
                    .get_or_insert_with(|| e.to_string());
                None
            }
        }
    }

    /// Whether an error has been recorded (ops then do nothing).
    pub(crate) fn failed(&self) -> bool {
        self.err.lock().unwrap().is_some()
    }

    /// A scratch buffer of `len` values (contents undefined).
    pub(crate) fn scratch(&self, len: usize) -> GpuBuf {
        GpuBuf {
            ptr: self.pool.get(len.max(1) * 4),
            len,
            pool: self.pool.clone(),
            view: false,
        }
    }

    /// Launch kernel `name` of `module` on the backend's stream (or record it, see
    /// [`GraphState`]); not at all where `DS4_GPU_SKIP` names it ([`knocked_out`]).
    pub(crate) fn launch(
        &self,
        module: &ds4_kernels::Module,
        name: &str,
        dims: LaunchDims,
        args: &[Arg],
    ) -> Result<()> {
        if knocked_out(name) {
            return Ok(());
        }
        let f = self.gpu.kernel(module, name)?;
        if self.record(f, dims, args) {
            return Ok(());
        }
        self.gpu.runtime().launch(f, dims, self.stream, args)
    }

    /// Knock kernels out by name, as `DS4_GPU_SKIP` (which this replaces; an empty list launches
    /// everything again). Process-wide; timing experiments and their test only: results after a
    /// knocked-out kernel are wrong.
    pub fn set_skip(names: &[&str]) {
        let list: Vec<(String, bool)> = names.iter().map(|s| (s.to_string(), false)).collect();
        SKIP_ANY.store(if list.is_empty() { 1 } else { 2 }, Ordering::Relaxed);
        *SKIP.lock().unwrap() = Some(list);
    }

    /// Launch and record any error (the form ops use).
    pub(crate) fn run(
        &self,
        module: &ds4_kernels::Module,
        name: &str,
        dims: LaunchDims,
        args: &[Arg],
    ) {
        if !self.failed() {
            let r = self.launch(module, name, dims, args);
            self.note(r);
        }
    }

    /// `n` 32-bit words as a kernel launch (copy_u32 / fill_u32) while recording, so that
    /// every node of a step's graph is a kernel node the replay can update.
    fn words_kernel(&self, name: &str, args: &[Arg], n: usize) -> bool {
        if !self.recording.load(Ordering::Acquire) {
            return false;
        }
        let blocks = n.div_ceil(256).min(65535) as u32; // grid-stride loop in the kernel
        self.run(
            &ds4_kernels::ELEMENTWISE,
            name,
            LaunchDims::linear(blocks.max(1), 256),
            args,
        );
        true
    }

    pub(crate) fn warp(&self) -> u32 {
        self.gpu.info().warp
    }

    fn zero(&self, p: DevPtr, words: usize) {
        if words > 0 && p.0 != 0 {
            if self.words_kernel(
                "fill_u32",
                &[Arg::Ptr(p), Arg::U32(0), Arg::I64(words as i64)],
                words,
            ) {
                return;
            }
            let r = self
                .gpu
                .runtime()
                .memset_u32_async(p, 0, words, self.stream);
            self.note(r);
        }
    }

    fn fill(&self, p: DevPtr, value: u32, words: usize) {
        if words > 0 {
            if self.words_kernel(
                "fill_u32",
                &[Arg::Ptr(p), Arg::U32(value), Arg::I64(words as i64)],
                words,
            ) {
                return;
            }
            let r = self
                .gpu
                .runtime()
                .memset_u32_async(p, value, words, self.stream);
            self.note(r);
        }
    }

    pub(crate) fn d2d(&self, dst: DevPtr, src: DevPtr, bytes: usize) {
        if bytes > 0 && !self.failed() {
            if bytes.is_multiple_of(4)
                && self.words_kernel(
                    "copy_u32",
                    &[Arg::Ptr(dst), Arg::Ptr(src), Arg::I64((bytes / 4) as i64)],
                    bytes / 4,
                )
            {
                return;
            }
            self.interrupt();
            let r = self
                .gpu
                .runtime()
                .copy_d2d_async(dst, src, bytes, self.stream);
            self.note(r);
        }
    }

    fn dev(&self, bytes: usize) -> Option<DeviceBuffer> {
        let r = match self.gpu.alloc(bytes.max(4)) {
            // The scratch pool's idle blocks back to the device, then once more.
            Err(_) if self.pool.trim() => self.gpu.alloc(bytes.max(4)),
            r => r,
        };
        self.note(r)
    }

    /// Host bytes into device memory that kernels queued on the backend's stream may still
    /// touch (pool blocks, state just cleared): the copy lands after them.
    fn upload_ordered(&self, dst: DevPtr, data: &[u8]) -> Result<()> {
        self.gpu.upload_after(dst, data, self.stream)
    }

    fn upload_bytes(&self, data: &[u8]) -> Option<DeviceBuffer> {
        self.interrupt();
        self.note(self.gpu.alloc_from(data))
    }

    fn download_bytes(&self, p: DevPtr, bytes: usize) -> Vec<u8> {
        self.download_map(p, bytes, 1, |b| b[0])
    }

    /// `n` device values of `size` bytes each, converted by `conv` as they leave the staging
    /// buffer (one pass over fresh host memory; zeros after a failure).
    fn download_map<T: Default + Clone>(
        &self,
        p: DevPtr,
        n: usize,
        size: usize,
        conv: impl Fn(&[u8]) -> T,
    ) -> Vec<T> {
        self.flush(true); // a host read ends a recorded step
        let mut out = Vec::with_capacity(n);
        if n > 0 && !self.failed() {
            let r = self.gpu.download_with(p, n * size, |c| {
                out.extend(c.chunks_exact(size).map(&conv));
            });
            if r.is_ok() {
                self.free_retired(); // the download waited for the stream
            }
            self.note(r);
        }
        out.resize(n, T::default());
        out
    }

    fn download_f32s(&self, p: DevPtr, n: usize) -> Vec<f32> {
        self.download_map(p, n, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn new_comp(&self, c: &CompDims, bf16: bool) -> Option<GpuComp> {
        let n = c.slots() * c.width();
        let front_kv = self.dev(n * 4)?;
        let front_score = self.dev(n * 4)?;
        self.zero(front_kv.ptr(), n);
        self.fill(front_score.ptr(), f32::NEG_INFINITY.to_bits(), n);
        let cap = ROW_ALIGN;
        Some(GpuComp {
            dims: *c,
            front_kv,
            front_score,
            rows: self.dev(cap * c.d * row_elem(bf16))?,
            cap,
            limit: usize::MAX,
            n_rows: 0,
            bf16,
        })
    }

    /// Make room for `rows` rows in `c`: the capacity doubles (the old rows are copied), up
    /// to the limit the session's context sets ([`GpuComp::limit`]).
    pub(crate) fn reserve_rows(&self, c: &mut GpuComp, rows: usize) {
        if rows <= c.cap {
            return;
        }
        self.resize_rows(c, grown_cap(rows, c.limit));
    }

    /// Move `c`'s rows into a buffer of `cap` rows (at least the rows held).
    fn resize_rows(&self, c: &mut GpuComp, cap: usize) {
        debug_assert!(cap >= c.n_rows);
        // The old rows are freed below: what was recorded must run first.
        self.interrupt();
        if let Some(nb) = self.dev(cap * c.dims.d * c.elem()) {
            self.d2d(nb.ptr(), c.rows.ptr(), c.n_rows * c.dims.d * c.elem());
            let old = std::mem::replace(&mut c.rows, nb);
            c.cap = cap;
            if switch::switch_on(&DEFER_FREE, "DS4_GPU_DEFER_FREE") {
                // Queued work (the copy above, earlier steps) may still read it.
                self.retired.lock().unwrap().push(old);
            } // else freed here: cuMemFree waits for the device
        }
    }

    /// Free the buffers [`GpuBackend::reserve_rows`] retired; only where the device is idle
    /// (after a synchronisation), so the frees wait for nothing.
    fn free_retired(&self) {
        let old = std::mem::take(&mut *self.retired.lock().unwrap());
        drop(old);
    }

    fn upload_comp(&self, c: &CompDims, h: &HostCompState, bf16: bool) -> Option<GpuComp> {
        self.interrupt();
        let n_rows = h.rows.len() / c.d;
        let mut g = self.new_comp(c, bf16)?;
        // Room for the rows held and no more (a fresh state's capacity is within any context's
        // bound; growth from here doubles up to it).
        if n_rows > g.cap {
            self.resize_rows(&mut g, n_rows.next_multiple_of(ROW_ALIGN));
        }
        self.note(self.upload_ordered(g.front_kv.ptr(), f32_bytes(&h.front_kv)));
        self.note(self.upload_ordered(g.front_score.ptr(), f32_bytes(&h.front_score)));
        if bf16 {
            // Round to nearest even: exact for the FP4-simulated rows a state holds.
            let b: Vec<u8> = h
                .rows
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect();
            self.note(self.upload_ordered(g.rows.ptr(), &b));
        } else {
            self.note(self.upload_ordered(g.rows.ptr(), f32_bytes(&h.rows)));
        }
        g.n_rows = n_rows;
        Some(g)
    }

    /// Copies of `(field, byte offset, bytes)` ranges of each layer's buffers into pooled
    /// scratch, one `copy_list` launch: a [`GpuMark`] a layer, with its row-count rule.
    fn save_ranges(
        &self,
        sts: &[GpuLayerState],
        ranges: impl Iterator<Item = (Vec<(Field, usize, usize)>, [Rows; 2])>,
    ) -> Vec<GpuMark> {
        let mut copies = Vec::new();
        let marks = sts
            .iter()
            .zip(ranges)
            .map(|(st, (r, n_rows))| GpuMark {
                saved: r
                    .into_iter()
                    .map(|(f, off, n)| {
                        let b = self.scratch(n.div_ceil(4));
                        copies.push((b.ptr, st.field(f).offset(off as u64), n));
                        (f, off, b, n)
                    })
                    .collect(),
                n_rows,
            })
            .collect();
        self.copy_many(&copies);
        marks
    }

    fn download_comp(&self, c: &GpuComp) -> HostCompState {
        let n = c.dims.slots() * c.dims.width();
        let rows = if c.bf16 {
            // bf16 is an f32's high half.
            self.download_map(c.rows.ptr(), c.n_rows * c.dims.d, 2, |b| {
                f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
            })
        } else {
            self.download_f32s(c.rows.ptr(), c.n_rows * c.dims.d)
        };
        HostCompState {
            front_kv: self.download_f32s(c.front_kv.ptr(), n),
            front_score: self.download_f32s(c.front_score.ptr(), n),
            rows,
        }
    }

    /// `(dst, src, bytes)` device copies as one `copy_list` launch on the stream (the list
    /// uploaded in order before it); byte counts not a multiple of 4 and unusable kernels fall
    /// back to one copy each.
    fn copy_many(&self, copies: &[(DevPtr, DevPtr, usize)]) {
        let copies: Vec<_> = copies.iter().filter(|c| c.2 > 0).copied().collect();
        if copies.is_empty() || self.failed() {
            return;
        }
        let (whole, odd): (Vec<_>, Vec<_>) = copies.iter().partition(|c| c.2 % 4 == 0);
        for &(d, s, n) in &odd {
            self.d2d(d, s, n);
        }
        let Some(longest) = whole.iter().map(|c| c.2 / 4).max() else {
            return;
        };
        let list: Vec<u64> = whole
            .iter()
            .flat_map(|&(d, s, n)| [d.0, s.0, (n / 4) as u64])
            .collect();
        let bytes: Vec<u8> = list.iter().flat_map(|v| v.to_le_bytes()).collect();
        let dev = self.scratch(bytes.len().div_ceil(4));
        if self.note(self.upload_ordered(dev.ptr, &bytes)).is_none() {
            return;
        }
        // Up to 16-byte vectors of 256 threads: enough CTAs a row for the longest copy.
        let ctas = (longest.div_ceil(4 * 256)).clamp(1, 64) as u32;
        let dims = LaunchDims {
            grid: [ctas, whole.len() as u32, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
        };
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "copy_list",
            dims,
            &[Arg::Ptr(dev.ptr)],
        );
        COPY_LISTS.fetch_add(1, Ordering::Relaxed);
    }

    /// A 2-4-token step's op as its one-token form once per token: `one(t)` queues token t's
    /// (on views of the token rows) or says false, which only token 0 may (nothing queued: the
    /// caller's general path runs); the others have its shapes and alignments. `label`: the
    /// op profile's name for the rest.
    fn per_token(&self, n: usize, label: &str, mut one: impl FnMut(usize) -> bool) -> bool {
        if !(2..=4).contains(&n) || self.failed() || !one(0) {
            return false;
        }
        let _p = self.prof(|| label.to_string());
        for t in 1..n {
            one(t);
        }
        true
    }

    /// Sets the budget of a [`Backend::prefetch`] hint in MiB (0: off) for the process,
    /// overriding `DS4_GPU_PREFETCH` (tests, A/B benchmarks).
    pub fn set_prefetch_mb(mb: u8) {
        PREFETCH.store(mb.min(254), Ordering::Relaxed);
    }

    /// `prefetch_l2` launches (recorded into graphs included) so far in this process.
    pub fn prefetch_launches() -> u64 {
        PREFETCHES.load(Ordering::Relaxed)
    }

    /// `copy_list` launches so far in this process (tests: a checkpoint is one launch).
    pub fn copy_list_launches() -> u64 {
        COPY_LISTS.load(Ordering::Relaxed)
    }

    fn weight_src(&self, src: &WeightSrc) -> Option<DeviceBuffer> {
        *self.weight_bytes.lock().unwrap() += src.n_bytes as u64;
        self.upload_bytes(src.bytes())
    }
}

impl Backend for GpuBackend {
    type Buf = GpuBuf;
    type IBuf = GpuIBuf;
    type Weight = GpuWeight;
    type LayerState = GpuLayerState;
    type Mark = GpuMark;

    fn name(&self) -> String {
        let i = self.gpu.info();
        format!("{} ({} {})", i.vendor, i.name, i.arch)
    }

    fn weight_copy_bytes(&self) -> u64 {
        self.bf16_cache_bytes()
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        self.gpu.mem_info().ok()
    }

    fn prefetch(&self, ws: &[&GpuWeight], n: usize) {
        let mb = switch::code(&PREFETCH, "DS4_GPU_PREFETCH", |v| match v {
            None => PREFETCH_MB,
            Some("off") => 0,
            Some(v) => v.parse::<u8>().map_or(PREFETCH_MB, |m| m.min(254)),
        });
        if mb == 0 || n > 4 || self.failed() || self.gpu.info().vendor != Vendor::Nvidia {
            return;
        }
        // The bytes the products of <= 4 tokens read: the decode-layout copy where there is one.
        let mut left = (mb as usize) << 20;
        let mut ranges: Vec<(DevPtr, usize)> = Vec::new();
        for w in ws {
            let GpuWeight::Mat { buf, dec, f16i, .. } = w else {
                continue;
            };
            let b = dec.as_ref().or(f16i.as_ref()).unwrap_or(buf);
            let take = b.bytes().min(left) / 16 * 16;
            if take > 0 && ranges.len() < 4 {
                ranges.push((b.ptr(), take));
                left -= take;
            }
        }
        if ranges.is_empty() {
            return;
        }
        let chunks: usize = ranges.iter().map(|r| r.1.div_ceil(4096)).sum();
        let mut args = Vec::with_capacity(9);
        for i in 0..4 {
            match ranges.get(i) {
                Some(&(p, b)) => args.extend([Arg::Ptr(p), Arg::I64(b as i64)]),
                None => args.extend([Arg::Null, Arg::I64(0)]),
            }
        }
        let blocks = chunks.div_ceil(128).min(65535) as u32; // one 4 KiB chunk a thread
        PREFETCHES.fetch_add(1, Ordering::Relaxed);
        // In a step's graph, off the main chain (FLOW_HINT): in the main chain the next
        // kernel's PDL wait held it until its grid was done (session 42: decode -14%).
        if self.recording.load(Ordering::Acquire) {
            let mut g = self.graph.lock().unwrap();
            g.hint = g.branch;
        }
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "prefetch_l2",
            LaunchDims::linear(blocks, 128),
            &args,
        );
        self.graph.lock().unwrap().hint = false; // also where nothing was recorded
    }

    /// The first prompt's step is the longest that fits the memory free then (plus the pool's
    /// idle blocks); later steps keep it (the same steps for the same prompt: the same logits)
    /// unless what fits before a step is shorter, as the session state grows with the context
    /// or other sessions take memory: then the shorter one from there on.
    fn prefill_chunk(&self) -> usize {
        gemm::prefill_chunk(|| {
            let avail = self
                .gpu
                .mem_info()
                .ok()
                .map(|(free, _)| free + self.pool.cached.load(Ordering::Relaxed));
            let mut sm = self.step_mem.lock().unwrap();
            let fit = gemm::auto_chunk(avail, sm.per_token);
            let step = sm.step.map_or(fit, |s| s.min(fit));
            if sm.step.is_some_and(|s| s > step) {
                // Said once a shortening: prompts go slower from here (every step reads each
                // expert's weights once).
                eprintln!(
                    "ds4: prompt steps shortened to {step} tokens ({:.2} GiB of device memory \
                     available beside the weights and session state)",
                    avail.unwrap_or(0) as f64 / (1u64 << 30) as f64
                );
            }
            sm.step = Some(step);
            step
        })
    }

    fn graph_begin(&self, n: usize) {
        self.profiler_range(n);
        if n >= StepMemory::LEARN_MIN {
            self.step_mem.lock().unwrap().open = Some((n, self.pool.reset_peak()));
        }
        if n == 0 || n > GRAPH_MAX_N || self.prof.is_some() || self.failed() {
            return;
        }
        self.flush(true);
        let mut g = self.graph.lock().unwrap();
        if !g.enabled || !self.gpu.runtime().graphs_supported() {
            return;
        }
        g.calls.clear();
        g.piece = 0;
        g.began = Some(std::time::Instant::now());
        g.open = false;
        g.in_side = false;
        g.pending_join = false;
        self.pool.defer(false);
        if let Some(sp) = self.step.lock().unwrap().as_mut() {
            sp.in_step = false;
        }
        self.pool.canonical();
        self.recording.store(true, Ordering::Release);
    }

    fn graph_end(&self) {
        self.flush(true);
        let mut sm = self.step_mem.lock().unwrap();
        if let Some((n, base)) = sm.open.take() {
            let held = self.pool.peak.load(Ordering::Relaxed).saturating_sub(base);
            sm.learn(n, held);
            if std::env::var_os("DS4_GPU_STEP_LOG").is_some() {
                let free = self.gpu.mem_info().map_or(0, |m| m.0);
                eprintln!(
                    "ds4: prompt step of {n} tokens: {:.1} MiB of scratch ({:.0} KiB a token); \
                     {:.2} GiB free, {:.2} GiB idle in the pool",
                    held as f64 / (1u64 << 20) as f64,
                    held as f64 / n as f64 / 1024.0,
                    free as f64 / (1u64 << 30) as f64,
                    self.pool.cached.load(Ordering::Relaxed) as f64 / (1u64 << 30) as f64
                );
            }
        }
    }

    /// A recorded step's side branch: its calls become a second chain of the step's graph
    /// (gpu.rs `StepGraphs::capture_branched`). Only while recording (eager launches and
    /// prefill chunks stay one stream), and not nested.
    fn side_begin(&self) {
        if !self.recording.load(Ordering::Acquire) {
            return;
        }
        let mut g = self.graph.lock().unwrap();
        if !g.branch || g.open {
            return;
        }
        g.open = true;
        g.in_side = true;
        g.pending_join = false;
        drop(g);
        self.pool.defer(true);
    }

    fn side_end(&self) {
        self.graph.lock().unwrap().in_side = false;
    }

    fn join(&self) {
        let mut g = self.graph.lock().unwrap();
        if g.open {
            g.open = false;
            g.in_side = false;
            g.pending_join = true;
        }
        drop(g);
        self.pool.defer(false);
    }

    fn finish(&self) -> std::result::Result<(), String> {
        self.flush(false);
        match self.gpu.synchronize() {
            Ok(()) => self.free_retired(),
            Err(e) => {
                let mut err = self.err.lock().unwrap();
                err.get_or_insert_with(|| format!("waiting for the device: {e}"));
            }
        }
        self.check()
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.flush(true);
        self.prof_collect();
        match self.err.lock().unwrap().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn matrix(&self, src: &WeightSrc) -> std::result::Result<GpuWeight, String> {
        let row_bytes = src.ty.row_bytes(src.cols() as u64).ok_or_else(|| {
            format!(
                "{} columns do not fill whole {:?} blocks",
                src.cols(),
                src.ty
            )
        })? as usize;
        let buf = self
            .weight_src(src)
            .ok_or_else(|| self.check().unwrap_err())?;
        let experts = src.dims.get(2).copied().unwrap_or(1) as usize;
        let f16i = self.f16_il_copy(&buf, src.ty, src.cols(), src.rows(), experts);
        let (buf, dec, dec_il) = self.q8_layouts(buf, src.ty, src.cols(), src.rows(), experts);
        Ok(GpuWeight::Mat {
            f16i,
            buf,
            ty: src.ty,
            cols: src.cols(),
            rows: src.rows(),
            experts,
            row_bytes,
            dec,
            dec_il,
            bf: Default::default(),
        })
    }

    fn host_matrix(&self, src: &WeightSrc) -> Option<std::result::Result<GpuWeight, String>> {
        let row_bytes = src.ty.row_bytes(src.cols() as u64)? as usize;
        // Page-locked and mapped into the device's address space: kernels read its rows over
        // the bus (no copy on the device). The Gpu unregisters it when dropped.
        if let Err(e) = self.gpu.register_host(&[src.bytes()]) {
            return Some(Err(format!("host memory not page-locked ({e})")));
        }
        let Some(ptr) = self.gpu.mapped_ptr(src.bytes()) else {
            return Some(Err(
                "the driver did not map page-locked host memory into the device's address space"
                    .into(),
            ));
        };
        let experts = src.dims.get(2).copied().unwrap_or(1) as usize;
        Some(Ok(GpuWeight::plain_mat(
            DeviceBuffer::borrowed(&self.gpu, ptr, src.n_bytes),
            src.ty,
            [src.cols(), src.rows(), experts],
            row_bytes,
        )))
    }

    fn expert_slots(
        &self,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        capacity: usize,
    ) -> Option<std::result::Result<GpuWeight, String>> {
        let Some(row_bytes) = ty.row_bytes(cols as u64) else {
            return Some(Err(format!(
                "{cols} columns do not fill whole {ty:?} blocks"
            )));
        };
        let row_bytes = row_bytes as usize;
        let buf = match self.dev(capacity * rows * row_bytes) {
            Some(b) => b,
            None => return Some(Err(self.check().unwrap_err())),
        };
        Some(Ok(GpuWeight::plain_mat(
            buf,
            ty,
            [cols, rows, capacity],
            row_bytes,
        )))
    }

    fn register_host(&self, ranges: &[&[u8]]) -> u64 {
        match self.gpu.register_host(ranges) {
            Ok(b) => b as u64,
            Err(e) => {
                eprintln!("ds4: host-memory experts not page-locked ({e})");
                0
            }
        }
    }

    fn gather_experts(&self, slots: &GpuWeight, slabs: &[&[u8]]) {
        if let Some(dst) = self.slots_for(slots, slabs) {
            self.note(self.gpu.gather_after(dst, slabs, self.stream));
        }
    }

    fn prefetch_experts(&self, slots: &GpuWeight, slabs: &[&[u8]]) {
        if let Some(dst) = self.slots_for(slots, slabs) {
            self.note(self.gpu.prefetch_after(dst, slabs, self.stream));
        }
    }

    fn await_experts(&self) {
        // Nothing pending (decode steps): nothing to do, and a recorded step goes on.
        if self.gpu.prefetch_pending() {
            self.interrupt();
            if !self.failed() {
                self.note(self.gpu.prefetch_wait(self.stream));
            }
        }
    }

    fn vector(&self, src: &WeightSrc) -> std::result::Result<GpuWeight, String> {
        let mut v = vec![0f32; src.elems()];
        ds4_quant::dequantize_row(src.ty, src.bytes(), &mut v).map_err(|e| e.to_string())?;
        let buf = self
            .upload_bytes(f32_bytes(&v))
            .ok_or_else(|| self.check().unwrap_err())?;
        Ok(GpuWeight::F32 { buf, len: v.len() })
    }

    fn random(
        &self,
        kind: ds4_backend::WeightKind,
        ty: GgmlType,
        dims: &[u64],
        fill: ds4_backend::Fill,
        seed: u64,
    ) -> std::result::Result<GpuWeight, String> {
        self.interrupt();
        self.op_random(kind, ty, dims, fill, seed)
    }

    fn read_weight(&self, w: &GpuWeight, out: &mut [u8]) -> std::result::Result<(), String> {
        let GpuWeight::Mat {
            buf,
            rows,
            experts,
            row_bytes,
            ..
        } = w
        else {
            return Err("read_weight: not a matrix".into());
        };
        if !w.blocks() {
            return Err("read_weight: the matrix is held in the decode layout only".into());
        }
        let n = row_bytes * rows * experts.max(&1);
        if out.len() != n {
            return Err(format!(
                "read_weight: {} bytes asked of a {n}-byte matrix",
                out.len()
            ));
        }
        self.flush(true);
        let r = self.gpu.download(buf.ptr(), out);
        let ok = r.is_ok();
        self.note(r);
        if ok {
            Ok(())
        } else {
            Err(self.check().err().unwrap_or_default())
        }
    }

    fn table(&self, src: &WeightSrc) -> std::result::Result<GpuWeight, String> {
        if src.ty != GgmlType::I32 {
            return Err(format!("expected I32, found {:?}", src.ty));
        }
        let buf = self
            .weight_src(src)
            .ok_or_else(|| self.check().unwrap_err())?;
        Ok(GpuWeight::I32 {
            buf,
            len: src.elems(),
        })
    }

    fn alloc(&self, len: usize) -> GpuBuf {
        let b = self.scratch(len);
        if self.poison {
            self.fill(b.ptr, 0x7fc0_0000, len); // NaN: catches an op that reads before writing
        }
        b
    }

    fn upload(&self, data: &[f32]) -> GpuBuf {
        self.before_upload();
        let b = self.scratch(data.len());
        if b.ptr.0 != 0 {
            self.note(self.upload_ordered(b.ptr, f32_bytes(data)));
        }
        b
    }

    fn upload_i32(&self, data: &[i32]) -> GpuIBuf {
        self.before_upload();
        let b = self.scratch(data.len());
        if b.ptr.0 != 0 {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.note(self.upload_ordered(b.ptr, &bytes));
        }
        GpuIBuf(b)
    }

    fn alloc_i32(&self, len: usize) -> GpuIBuf {
        GpuIBuf(self.alloc(len))
    }

    fn download(&self, b: &GpuBuf, len: usize) -> Vec<f32> {
        self.download_f32s(b.ptr, len)
    }

    fn sample(&self, logits: &GpuBuf, vocab: usize, p: &ds4_backend::SampleParams, u: f64) -> u32 {
        self.op_sample(logits, vocab, p, u)
    }

    fn sample_rows(
        &self,
        logits: &GpuBuf,
        vocab: usize,
        p: &ds4_backend::SampleParams,
        draws: &[f64],
    ) -> Vec<u32> {
        self.op_sample_rows(logits, vocab, p, draws)
    }

    fn download_i32(&self, b: &GpuIBuf, len: usize) -> Vec<i32> {
        self.download_map(b.0.ptr, len, 4, |c| {
            i32::from_le_bytes([c[0], c[1], c[2], c[3]])
        })
    }

    fn copy(&self, src: &GpuBuf, so: usize, dst: &mut GpuBuf, d0: usize, len: usize) {
        self.d2d(
            dst.ptr.offset(d0 as u64 * 4),
            src.ptr.offset(so as u64 * 4),
            len * 4,
        );
    }

    fn new_layer_state(&self, dims: &LayerDims) -> GpuLayerState {
        self.interrupt();
        let w = dims.window;
        let raw = self.dev(w * dims.head_dim * 4);
        let raw_pos = self.dev(w * 4);
        if let (Some(r), Some(p)) = (&raw, &raw_pos) {
            self.zero(r.ptr(), w * dims.head_dim);
            self.fill(p.ptr(), u32::MAX, w); // −1
        }
        let nb = |b: Option<DeviceBuffer>| b.unwrap_or_else(|| DeviceBuffer::null(&self.gpu));
        GpuLayerState {
            dims: *dims,
            raw: nb(raw),
            raw_pos: nb(raw_pos),
            comp: dims.comp.as_ref().and_then(|c| self.new_comp(c, false)),
            index: dims
                .index
                .as_ref()
                .and_then(|c| self.new_comp(c, dims.index_fp4)),
        }
    }

    fn state_to_host(&self, st: &GpuLayerState) -> HostLayerState {
        self.interrupt();
        let d = &st.dims;
        let raw = self.download_f32s(st.raw.ptr(), d.window * d.head_dim);
        let raw_pos = self.download_map(st.raw_pos.ptr(), d.window, 4, |c| {
            i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64
        });
        HostLayerState {
            raw,
            raw_pos,
            comp: st.comp.as_ref().map(|c| self.download_comp(c)),
            index: st.index.as_ref().map(|c| self.download_comp(c)),
        }
    }

    fn bound_state(&self, st: &mut GpuLayerState, tokens: usize) {
        // Capacities are never past the bound here: fresh states hold ROW_ALIGN rows, restored
        // ones their rows rounded up (upload_comp).
        for c in [st.comp.as_mut(), st.index.as_mut()].into_iter().flatten() {
            c.limit = row_limit(tokens, c.dims.ratio);
        }
    }

    fn state_from_host(&self, dims: &LayerDims, h: &HostLayerState) -> GpuLayerState {
        self.interrupt();
        let st = self.new_layer_state(dims);
        self.note(self.upload_ordered(st.raw.ptr(), f32_bytes(&h.raw)));
        let pos: Vec<u8> = h
            .raw_pos
            .iter()
            .flat_map(|&p| (p as i32).to_le_bytes())
            .collect();
        self.note(self.upload_ordered(st.raw_pos.ptr(), &pos));
        GpuLayerState {
            comp: match (&dims.comp, &h.comp) {
                (Some(c), Some(hc)) => self.upload_comp(c, hc, false),
                _ => None,
            },
            index: match (&dims.index, &h.index) {
                (Some(c), Some(hc)) => self.upload_comp(c, hc, dims.index_fp4),
                _ => None,
            },
            ..st
        }
    }

    fn mark(&self, st: &GpuLayerState) -> GpuMark {
        self.mark_all(std::slice::from_ref(st))
            .pop()
            .expect("one mark")
    }

    fn rollback(&self, st: &mut GpuLayerState, m: GpuMark) {
        self.rollback_all(std::slice::from_mut(st), vec![m]);
    }

    /// Every layer's copies in one launch (`copy_list`) into pooled buffers.
    fn mark_all(&self, sts: &[GpuLayerState]) -> Vec<GpuMark> {
        self.interrupt();
        let whole = |st: &GpuLayerState| {
            let mut r = vec![
                (Field::Raw, 0, st.raw.bytes()),
                (Field::RawPos, 0, st.raw_pos.bytes()),
            ];
            for (i, c) in [&st.comp, &st.index].into_iter().enumerate() {
                if let Some(c) = c {
                    r.push((Field::Kv(i), 0, c.front_kv.bytes()));
                    r.push((Field::Score(i), 0, c.front_score.bytes()));
                }
            }
            (r, st.n_rows())
        };
        self.save_ranges(sts, sts.iter().map(whole))
    }

    /// One ring row with its position and the frontier slots a compressor that the token at
    /// the slots' position writes, a layer each (a few KB a layer; 4 more slots where it closes
    /// a CSA window), and the row counts; one `copy_list` launch.
    fn mark_slots_all(
        &self,
        sts: &[GpuLayerState],
        slots: &[ds4_backend::TokenSlots],
    ) -> Option<Vec<GpuMark>> {
        self.interrupt();
        let ranges = sts.iter().zip(slots).map(|(st, t)| {
            let hd = st.dims.head_dim;
            let mut r = vec![
                (Field::Raw, 4 * t.ring * hd, 4 * hd),
                (Field::RawPos, 4 * t.ring, 4),
            ];
            for (i, f) in [t.comp, t.index].into_iter().enumerate() {
                let Some(f) = f else { continue };
                for &(s0, n) in f.ranges.iter().filter(|r| r.1 > 0) {
                    r.push((Field::Kv(i), 4 * s0 * f.width, 4 * n * f.width));
                    r.push((Field::Score(i), 4 * s0 * f.width, 4 * n * f.width));
                }
            }
            let rows = [t.comp, t.index].map(|f| match f {
                Some(f) if f.pooled > 0 => Rows::DropLast,
                _ => Rows::Keep,
            });
            (r, rows)
        });
        Some(self.save_ranges(sts, ranges))
    }

    fn rollback_all(&self, sts: &mut [GpuLayerState], ms: Vec<GpuMark>) {
        self.interrupt();
        let mut copies = Vec::new();
        for (st, m) in sts.iter_mut().zip(&ms) {
            for (f, off, b, n) in &m.saved {
                copies.push((st.field(*f).offset(*off as u64), b.ptr, *n));
            }
            for (c, n) in [&mut st.comp, &mut st.index].into_iter().zip(m.n_rows) {
                if let Some(c) = c.as_mut() {
                    match n {
                        Rows::Keep => {}
                        Rows::To(n) => c.n_rows = n,
                        Rows::DropLast => c.n_rows -= 1,
                    }
                }
            }
        }
        self.copy_many(&copies);
        drop(ms); // back to the pool, ordered after the copies that read them
    }

    fn embed(
        &self,
        table: &GpuWeight,
        tokens: &GpuIBuf,
        n: usize,
        copies: usize,
        d: usize,
        out: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "embed".to_string());

        self.op_embed(table, tokens, n, copies, d, out)
    }

    fn matmul(&self, w: &GpuWeight, part: Part, x: &GpuBuf, n: usize, y: &mut GpuBuf) {
        let _p = self.prof(|| match w {
            GpuWeight::Mat { ty, rows, cols, .. } => format!(
                "matmul {ty:?} {cols}->{rows}{} n{}",
                if matches!(part, Part::Expert(_)) {
                    " expert"
                } else {
                    ""
                },
                if n == 1 { "=1" } else { ">1" }
            ),
            _ => "matmul".into(),
        });

        self.op_matmul(w, part, x, n, y)
    }

    fn matmul_multi(&self, ws: &[&GpuWeight], x: &GpuBuf, n: usize, ys: &mut [&mut GpuBuf]) {
        // One launch at n = 1 where matvec.rs takes it, else the products in order.
        if !ws.iter().all(|w| self.product_width_ok(w)) {
            return;
        }
        if (n == 1 || (n == 2 && matvec::mvn_on())) && !self.failed() {
            let _p = self.prof(|| format!("matmul_multi x{} n={n}", ws.len()));
            if self.mv_multi(ws, x, n, ys) {
                return;
            }
        }
        // n = 2..4 F16 sets (the compressors' and indexer's projections of a verify step): the
        // one-launch n = 1 form once per token (2 x 11.9 us against ~37 us of separate n = 2
        // products for the CSA set on the H200, bench/results/gpu-spec-s33-h200.txt).
        let dims = |w: &GpuWeight| match w.mat_parts() {
            Some((_, GgmlType::F16, cols, rows, _)) => Some((cols, rows)),
            _ => None,
        };
        let shapes: Option<Vec<(usize, usize)>> = ws.iter().map(|w| dims(w)).collect();
        if let Some(shapes) = shapes.filter(|v| !v.is_empty() && v.iter().all(|d| d.0 == v[0].0)) {
            let label = format!("matmul_multi x{} n>1 per token", ws.len());
            let cols = shapes[0].0;
            if self.per_token(n, &label, |t| {
                let mut views: Vec<GpuBuf> = ys
                    .iter()
                    .zip(&shapes)
                    .map(|(y, &(_, r))| y.view(t * r, r))
                    .collect();
                let mut refs: Vec<&mut GpuBuf> = views.iter_mut().collect();
                self.mv_multi(ws, &x.view(t * cols, cols), 1, &mut refs)
            }) {
                return;
            }
        }
        // One bf16 conversion of x for the library's products (blas.rs X' sharing).
        let _x = self.blas_x_scope();
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.matmul(w, Part::All, x, n, y);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &self,
        x: &mut GpuBuf,
        n: usize,
        cols: usize,
        norm: Option<&GpuWeight>,
        eps: f32,
        w: &GpuWeight,
        y: &mut GpuBuf,
    ) {
        // n = 1, and n = 2..4 (verify steps) in one launch: the norm folded into the product
        // where matvec.rs takes it.
        if n <= 4 && self.product_width_ok(w) && self.mv_norm_matmul(x, n, cols, norm, eps, w, y) {
            return;
        }
        // n = 2..4 otherwise (`DS4_GPU_MVXN_TOK=off`): the one-token form once per token, each
        // token's normed row copied into one buffer that then replaces `x` (rms_norm + a 2-token
        // q_b product otherwise). (The gather buffer only for such steps: a prompt's rows never
        // come here.)
        let step = (2..=4).contains(&n) && self.product_width_ok(w);
        if let (true, Some((_, _, _, rows, _))) = (step, w.mat_parts()) {
            let normed = self.scratch(n * cols);
            if self.per_token(n, "rms_norm_matmul n>1 per token", |t| {
                let mut xt = x.view(t * cols, cols);
                let mut yt = y.view(t * rows, rows);
                let ran = self.mv_norm_matmul(&mut xt, 1, cols, norm, eps, w, &mut yt);
                if ran {
                    // xt is now token t's normed row (its own scratch buffer).
                    self.d2d(normed.ptr.offset((t * cols * 4) as u64), xt.ptr, cols * 4);
                }
                ran
            }) {
                *x = normed;
                return;
            }
        }
        self.rms_norm(x, n, cols, norm, eps);
        self.matmul(w, Part::All, x, n, y);
    }

    fn matmul_add(&self, w: &GpuWeight, x: &GpuBuf, n: usize, rows: usize, y: &mut GpuBuf) {
        // n = 1, and n = 2..4 (verify steps) in one launch: the add in the product's epilogue
        // where matvec.rs takes it.
        if n <= 4 && self.product_width_ok(w) && self.mv_matmul_add(w, x, n, y) {
            return;
        }
        // n = 2..4 otherwise: the n = 1 form once per token (2 x ~5 us against a separate
        // product + add_f32 for the shared expert's down).
        if let (true, Some((_, _, cols, _, _))) = (self.product_width_ok(w), w.mat_parts()) {
            if self.per_token(n, "matmul_add n>1 per token", |t| {
                let mut yt = y.view(t * rows, rows);
                self.mv_matmul_add(w, &x.view(t * cols, cols), 1, &mut yt)
            }) {
                return;
            }
        }
        // n > 4: the add in the BLAS product's epilogue (beta 1; same bits) where it takes it.
        if n > 4 && self.product_width_ok(w) && !self.failed() && self.blas_matmul_add(w, x, n, y) {
            return;
        }
        let mut t = self.alloc(n * rows);
        self.matmul(w, Part::All, x, n, &mut t);
        self.add(y, &t, n * rows);
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_gateup(
        &self,
        g: &GpuWeight,
        u: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        ff: usize,
        h: &mut GpuBuf,
        clamp: f32,
    ) {
        if !self.product_width_ok(g) || !self.product_width_ok(u) {
            return;
        }
        if (n == 1 || (n <= 4 && matvec::mvn_on())) && !self.failed() {
            let _p = self.prof(|| format!("matmul_gateup n={}", if n == 1 { "1" } else { ">1" }));
            if self.mv_gateup(g, u, x, n, ff, h, clamp) {
                return;
            }
        }
        // n = 2..4 (verify steps) otherwise: the fused n = 1 form once per token (two products
        // and a SwiGLU launch otherwise).
        if let Some((_, _, cols, _, _)) = g.mat_parts() {
            if self.per_token(n, "matmul_gateup n>1 per token", |t| {
                let mut ht = h.view(t * ff, ff);
                self.mv_gateup(g, u, &x.view(t * cols, cols), 1, ff, &mut ht, clamp)
            }) {
                return;
            }
        }
        let mut t = self.alloc(n * ff);
        {
            let _x = self.blas_x_scope(); // one bf16 conversion of x (blas.rs X' sharing)
            self.matmul(g, Part::All, x, n, h);
            self.matmul(u, Part::All, x, n, &mut t);
        }
        self.swiglu(h, &t, n * ff, clamp);
    }

    fn matmul_grouped(&self, w: &GpuWeight, groups: usize, x: &GpuBuf, n: usize, y: &mut GpuBuf) {
        let _p = self.prof(|| "matmul_grouped".to_string());

        self.op_matmul_grouped(w, groups, x, n, y)
    }

    fn add(&self, y: &mut GpuBuf, x: &GpuBuf, len: usize) {
        let _p = self.prof(|| "add".to_string());

        self.op_add(y, x, len)
    }

    fn rms_norm(&self, x: &mut GpuBuf, rows: usize, width: usize, w: Option<&GpuWeight>, eps: f32) {
        let _p = self.prof(|| "rms_norm".to_string());

        self.op_rms_norm(x, rows, width, w, eps)
    }

    fn rope(
        &self,
        x: &mut GpuBuf,
        n: usize,
        heads: usize,
        width: usize,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        inverse: bool,
    ) {
        let _p = self.prof(|| "rope".to_string());

        self.op_rope(x, n, heads, width, n_rot, t0, kind, inverse)
    }

    fn round_rows(&self, x: &mut GpuBuf, rows: usize, width: usize, r: RowRounding) {
        let _p = self.prof(|| "round_rows".to_string());

        self.op_round_rows(x, rows, width, r)
    }

    fn hc_split(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "hc_split".to_string());

        self.op_hc_split(hc, m, scale, base, x, n, z, post, comb)
    }

    fn hc_collapse(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "hc_collapse".to_string());

        self.op_hc_collapse(hc, m, scale, base, x, n, y)
    }

    fn hc_post(
        &self,
        hc: HcDims,
        x: &mut GpuBuf,
        o: &GpuBuf,
        post: &GpuBuf,
        comb: &GpuBuf,
        n: usize,
    ) {
        let _p = self.prof(|| "hc_post".to_string());

        self.op_hc_post(hc, x, o, post, comb, n)
    }

    fn compress(
        &self,
        st: &mut GpuLayerState,
        which: Which,
        spec: &CompressSpec,
        ape: &GpuWeight,
        norm: &GpuWeight,
        a: &GpuBuf,
        g: &GpuBuf,
        n: usize,
        t0: usize,
    ) {
        let _p = self.prof(|| "compress".to_string());

        self.op_compress(st, which, spec, ape, norm, a, g, n, t0)
    }

    fn index_select(
        &self,
        st: &GpuLayerState,
        spec: &IndexSpec,
        q: &GpuBuf,
        w: &GpuBuf,
        n: usize,
        t0: usize,
        sel: &mut GpuIBuf,
    ) {
        let _p = self.prof(|| "index_select".to_string());

        self.op_index_select(st, spec, q, w, n, t0, sel)
    }

    fn attend(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
    ) {
        let _p = self.prof(|| attend_label(spec, n, ""));

        self.op_attend_to(st, spec, q, None, kv, sinks, sel, n, t0, out, false)
    }

    fn attend_norms_q(&self, spec: &AttnSpec, n: usize) -> bool {
        self.attn_norms_q(spec, n)
    }

    fn attend_qnorm(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        eps: f32,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
    ) {
        let _p = self.prof(|| attend_label(spec, n, "raw q "));
        self.op_attend_to(st, spec, q, Some(eps), kv, sinks, sel, n, t0, out, false)
    }

    fn attend_project(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        qeps: Option<f32>,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        w: &GpuWeight,
        groups: usize,
        y: &mut GpuBuf,
    ) {
        let len = n * spec.n_head * spec.head_dim;
        let raw = if qeps.is_some() { "raw q " } else { "" };
        // `fast` prompt steps: the one-CTA-a-token attention writes the product's one-term bf16
        // X' itself (attn.rs `ATTN_BF16`: the same bits as f32 o converted by blas_x_f32; at
        // 2,048 tokens 402 MB less traffic a layer), and o is never stored in f32.
        if n > GRAPH_MAX_N
            && len.is_multiple_of(8)
            && !self.failed()
            && self.product_width_ok(w)
            && self.blas_fast_x_ok(w, groups, n)
            && self.attn_bf16_form(st, spec, q, kv, sel.is_some(), n, t0)
        {
            let mut xb = self.alloc(len / 2); // len bf16 values
            {
                let _p = self.prof(|| attend_label(spec, n, raw));
                self.op_attend_to(st, spec, q, qeps, kv, sinks, sel, n, t0, &mut xb, true);
            }
            let _p = self.prof(|| "matmul_grouped".to_string());
            if self.failed()
                || (!attn::attn_bf16_fallback() && self.blas_grouped_pre(w, groups, &xb, n, y))
            {
                return;
            }
            // The library declined after all (no algorithm, or it failed): o from its bf16
            // values (exact), then the product's other forms (under `fast` the same bits: the
            // library's X' of bf16 values is those values).
            let mut o = self.scratch(len);
            self.blas_widen(&xb, len, &mut o);
            self.op_matmul_grouped(w, groups, &o, n, y);
            return;
        }
        let mut o = self.alloc(len);
        match qeps {
            Some(eps) => self.attend_qnorm(st, spec, q, eps, kv, sinks, sel, n, t0, &mut o),
            None => self.attend(st, spec, q, kv, sinks, sel, n, t0, &mut o),
        }
        self.matmul_grouped(w, groups, &o, n, y);
    }

    fn moe_route(
        &self,
        spec: &MoeSpec,
        logits: &GpuBuf,
        bias: Option<&GpuWeight>,
        tid2eid: Option<&GpuWeight>,
        tokens: &GpuIBuf,
        n: usize,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "moe_route".to_string());

        self.op_moe_route(spec, logits, bias, tid2eid, tokens, n, sel, wgt)
    }

    fn matmul_route(
        &self,
        spec: &MoeSpec,
        router: &GpuWeight,
        z: &GpuBuf,
        n: usize,
        logits: &mut GpuBuf,
        bias: Option<&GpuWeight>,
        tid2eid: Option<&GpuWeight>,
        tokens: &GpuIBuf,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
    ) {
        // n = 1..4: one launch where mix.rs takes it, else the two calls.
        if (n == 1 || (n <= 4 && matvec::mvn_on()))
            && self.product_width_ok(router)
            && !self.failed()
        {
            let _p = self.prof(|| format!("matmul_route n={}", if n == 1 { "1" } else { ">1" }));
            if self.op_route_fused(spec, router, z, n, logits, bias, tid2eid, tokens, sel, wgt) {
                return;
            }
        }
        self.matmul(router, Part::All, z, n, logits);
        self.moe_route(spec, logits, bias, tid2eid, tokens, n, sel, wgt);
    }

    fn moe_experts(
        &self,
        spec: &MoeSpec,
        gate: &GpuWeight,
        up: &GpuWeight,
        down: &GpuWeight,
        z: &GpuBuf,
        sel: &GpuIBuf,
        wgt: &GpuBuf,
        n: usize,
        out: &mut GpuBuf,
    ) {
        let _p = self.prof(|| format!("moe_experts n{}", if n == 1 { "=1" } else { ">1" }));

        self.op_moe_experts(spec, gate, up, down, z, sel, wgt, n, out)
    }

    fn hc_pre_norm(
        &self,
        hc: HcDims,
        mixer: &GpuWeight,
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "hc_pre_norm".to_string());
        self.op_hc_pre_norm(hc, mixer, scale, base, norm, x, n, eps, z, post, comb)
    }

    fn hc_post_pre_norm(
        &self,
        hc: HcDims,
        x: &mut GpuBuf,
        o: &GpuBuf,
        post_in: &GpuBuf,
        comb_in: &GpuBuf,
        mixer: &GpuWeight,
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let _p = self.prof(|| "hc_post_pre_norm".to_string());
        self.op_hc_post_pre_norm(
            hc, x, o, post_in, comb_in, mixer, scale, base, norm, n, eps, z, post, comb,
        )
    }

    fn norm_rope(
        &self,
        x: &mut GpuBuf,
        n: usize,
        heads: usize,
        width: usize,
        w: Option<&GpuWeight>,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        round: Option<RowRounding>,
    ) {
        let _p = self.prof(|| "norm_rope".to_string());
        self.op_norm_rope(x, n, heads, width, w, eps, n_rot, t0, kind, round)
    }

    fn norm_rope_pair(
        &self,
        a: &mut GpuBuf,
        heads_a: usize,
        w_a: Option<&GpuWeight>,
        round_a: Option<RowRounding>,
        b: &mut GpuBuf,
        heads_b: usize,
        w_b: Option<&GpuWeight>,
        round_b: Option<RowRounding>,
        n: usize,
        width: usize,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
    ) {
        let _p = self.prof(|| "norm_rope_pair".to_string());
        self.op_norm_rope_pair(
            a, heads_a, w_a, round_a, b, heads_b, w_b, round_b, n, width, eps, n_rot, t0, kind,
        )
    }

    fn swiglu(&self, g: &mut GpuBuf, u: &GpuBuf, len: usize, clamp: f32) {
        let _p = self.prof(|| "swiglu".to_string());

        self.op_swiglu(g, u, len, clamp)
    }

    fn moe_localize(
        &self,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
        n: usize,
        k: usize,
        e0: usize,
        count: usize,
    ) {
        let _p = self.prof(|| "moe_localize".to_string());
        if n == 0 {
            return;
        }
        self.run(
            &ds4_kernels::MOE,
            "moe_localize",
            LaunchDims::linear(n.div_ceil(128) as u32, 128),
            &[
                Arg::Ptr(sel.0.ptr),
                Arg::Ptr(wgt.ptr),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(e0 as i32),
                Arg::I32(count as i32),
            ],
        );
    }

    fn all_reduce_sum(&self, y: &mut GpuBuf, len: usize) {
        let _p = self.prof(|| "all_reduce_sum".to_string());
        match &self.comm {
            None => {}
            Some(GpuComm::Ccl(c)) => {
                // Every rank queues the same collectives in the same order, failed or not (a
                // rank that skipped one would leave the others waiting in it).
                self.cut_piece();
                let rt = self.gpu.runtime();
                let r = rt
                    .make_current()
                    .and_then(|_| c.all_reduce_f32(y.ptr, len, self.stream));
                self.note(r);
            }
            Some(GpuComm::Host { rank, comm }) => {
                let mut v = self.download(y, len);
                comm.all_reduce(*rank, &mut v);
                self.note(self.upload_ordered(y.ptr, f32_bytes(&v)));
            }
        }
    }
}

/// The profile label of an attention call: its ratio, `what` (the raw-query form's "raw q "),
/// and whether it is one token or a prompt.
fn attend_label(spec: &AttnSpec, n: usize, what: &str) -> String {
    let n = if n == 1 { "=1" } else { ">1" };
    format!("attend ratio {} {what}n{n}", spec.ratio)
}

#[cfg(test)]
mod skip_tests {
    use super::skip_list;

    #[test]
    fn skip_list_takes_trimmed_comma_separated_names() {
        assert_eq!(
            skip_list(" hc_post_pre_norm_l,attend_one_tc5 ,, m3gu1_iq2_xxs"),
            ["hc_post_pre_norm_l", "attend_one_tc5", "m3gu1_iq2_xxs"]
        );
        assert!(skip_list("").is_empty());
        assert!(skip_list(" , ").is_empty());
    }
}

#[cfg(test)]
mod cap_tests {
    use super::{grown_cap, row_limit, ROW_ALIGN};

    #[test]
    fn row_capacity_doubles_up_to_the_contexts_rows() {
        let open = usize::MAX;
        assert_eq!(grown_cap(65, open), 128);
        assert_eq!(grown_cap(150_000, open), 262_144);
        // A 600k context at ratio 4: 150,000 rows, held in 150,016 (not 262,144).
        let lim = row_limit(600_000, 4);
        assert_eq!(lim, 150_016);
        assert_eq!(grown_cap(70_000, lim), 131_072);
        assert_eq!(grown_cap(140_000, lim), lim);
        assert_eq!(grown_cap(150_000, lim), lim);
        // Past the context (a hint, not a limit): doubling again.
        assert_eq!(grown_cap(150_017, lim), 262_144);
        // Small contexts and the sparsest ratio; always a multiple of ROW_ALIGN.
        assert_eq!(row_limit(100, 128), ROW_ALIGN);
        assert_eq!(row_limit(1_000_000, 128), 7_872);
        for (rows, lim) in [(1, 64), (65, 100_000), (5_000, 7_872), (3, 1)] {
            assert_eq!(grown_cap(rows, lim) % ROW_ALIGN, 0);
            assert!(grown_cap(rows, lim) >= rows);
        }
    }
}
