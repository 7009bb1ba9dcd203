//! The backend boundary. The forward-pass schedule (`ds4_model::forward`) is written once
//! against [`Backend`]; the CPU reference (`ds4-cpu`) and the GPU backends (`ds4-gpu`)
//! implement it. Ops are batch-level: every op covers the `n` tokens of one step at positions
//! `t0 .. t0 + n` (decode: `n = 1`), and buffers are token-major (`[n, …]`, row-major).
//!
//! The vocabulary is the model's, not a general tensor library's: the causal parts
//! (compressor, indexer, sink attention) are single ops over a whole chunk, so a GPU can run a
//! chunk in parallel while the CPU loops token by token — with identical visible state. What a
//! token `t` may see is a formula, not an order of evaluation: raw rows of positions
//! `max(0, t−W+1) ..= t`, compressed rows `< (t+1) / ratio`.

pub mod rope;
pub mod sample;
pub mod shard;
pub mod state;

pub use ds4_gguf::GgmlType;
use ds4_gguf::GgufFile;
pub use sample::SampleParams;
pub use shard::{HostComm, Shard};
pub use state::{HostCompState, HostLayerState};
use std::sync::Arc;

/// The rounding steps the published model was validated with (design.md "Semantics to keep
/// exact"); each can be switched off to compare against plain HF transformers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounding {
    /// FP8 (E4M3) round trip of raw and compressed KV rows (non-RoPE part).
    pub fp8_kv: bool,
    /// Hadamard + FP4 (E2M1) round trip of indexer queries and rows.
    pub fp4_indexer: bool,
    /// Cache rows stored at f16 precision.
    pub f16_cache: bool,
}

impl Rounding {
    /// The model's semantics (default).
    pub const MODEL: Rounding = Rounding {
        fp8_kv: true,
        fp4_indexer: true,
        f16_cache: true,
    };
    /// No rounding: plain float math, as HF transformers computes.
    pub const NONE: Rounding = Rounding {
        fp8_kv: false,
        fp4_indexer: false,
        f16_cache: false,
    };
}

/// Rounding applied to rows by [`Backend::round_rows`], in this order: FP8 of the first
/// `fp8_nope` columns (blocks of 64, 0 = off), Hadamard + FP4 of the whole row, f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RowRounding {
    pub fp8_nope: usize,
    pub fp4_hadamard: bool,
    pub f16: bool,
}

/// Which RoPE frequency table (model.md §3.1): plain for SWA-only layers and MTP, YaRN for
/// the compressed layers. Backends build both from [`rope::Rope`] at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    Swa,
    Comp,
}

/// A tensor handed to [`Backend::matrix`] / [`Backend::vector`] / [`Backend::table`]: bytes
/// `offset .. offset + n_bytes` of a mapped GGUF, GGUF dims `[cols, rows, experts]`.
pub struct WeightSrc<'a> {
    pub name: &'a str,
    pub file: &'a Arc<GgufFile>,
    pub ty: GgmlType,
    pub dims: &'a [u64],
    pub offset: usize,
    pub n_bytes: usize,
}

impl WeightSrc<'_> {
    pub fn bytes(&self) -> &[u8] {
        &self.file.bytes()[self.offset..self.offset + self.n_bytes]
    }
    pub fn cols(&self) -> usize {
        self.dims[0] as usize
    }
    pub fn rows(&self) -> usize {
        self.dims.get(1).copied().unwrap_or(1) as usize
    }
    pub fn elems(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// How the schedule uses a tensor: matrix (weight products, embedding, `ape` rows), f32
/// vector (norms, scales, biases, sinks), or i32 table (hash routing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightKind {
    Matrix,
    Vector,
    Table,
}

/// Values of a generated weight ([`Backend::random`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// `center + U(−spread, spread)`, then quantised to the weight's type.
    Uniform { center: f32, spread: f32 },
    /// Rows of distinct expert ids in `0 .. n_expert` (hash-routing tables).
    ExpertIds { n_expert: u32 },
}

/// The part of a weight matrix a product uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A 2-D matrix (or the first slab of a stack).
    All,
    /// Expert `e`'s slab of a 3-D stack.
    Expert(usize),
}

/// Hyper-connection shape (model.md §3.1).
#[derive(Clone, Copy, Debug)]
pub struct HcDims {
    /// Streams N.
    pub n: usize,
    /// Embedding width D.
    pub d: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// A compressor (model.md §3.3, §4.1): `ratio` positions pool into one row of width `d`;
/// `coff = 2` for the overlapping CSA/indexer compressors, 1 for HCA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompDims {
    pub ratio: usize,
    pub coff: usize,
    pub d: usize,
}

impl CompDims {
    /// Projection width per position (`coff · d`).
    pub fn width(&self) -> usize {
        self.coff * self.d
    }
    /// Frontier slots (`coff · ratio`).
    pub fn slots(&self) -> usize {
        self.coff * self.ratio
    }
}

/// Which compressor of a layer an op works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Attn,
    Index,
}

/// Static shape of one layer's attention state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDims {
    pub window: usize,
    pub head_dim: usize,
    pub comp: Option<CompDims>,
    pub index: Option<CompDims>,
    /// The indexer's rows are FP4-simulated (Hadamard + E2M1 with power-of-two block scales):
    /// every value is e2m1 · 2^k, exact in bf16, so a backend may store them in 2 bytes (the
    /// GPU does); the host form ([`HostCompState`]) stays f32.
    pub index_fp4: bool,
}

/// What one token at position `pos` writes to a layer's state (model.md §4.1): its raw ring
/// slot (`pos mod window`: the row and its position) and, per compressor, frontier slots
/// ([`FrontSlots`]) and possibly one pooled row. Putting these back undoes the token:
/// speculative decoding drops a rejected draft, the last token of its verify batch, this way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenSlots {
    pub ring: usize,
    /// The attention compressor's and the indexer's frontier slots.
    pub comp: Option<FrontSlots>,
    pub index: Option<FrontSlots>,
}

/// Frontier slots a token changes: `ranges` of (first slot, count), `width` values a slot in
/// `state_kv` and in `state_score`. Its own slot (`pos mod r`, CSA `r + pos mod r`), and where it
/// closes a CSA window (`pos + 1` a multiple of `r`) also slots `0..r`, which the window then
/// moves into; the window's other slots keep what the earlier tokens wrote. A closing token also
/// pools a row of `pooled` values (`d`; 0 for the others): undoing it drops the last row (the
/// batch's earlier tokens may have pooled rows of their own, which stay).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrontSlots {
    pub ranges: [(usize, usize); 2],
    pub width: usize,
    pub pooled: usize,
}

impl TokenSlots {
    pub fn of(dims: &LayerDims, pos: usize) -> TokenSlots {
        let front = |c: &Option<CompDims>| {
            c.map(|c| {
                let r = c.ratio;
                let own = if c.coff == 2 { r + pos % r } else { pos % r };
                let pools = (pos + 1).is_multiple_of(r);
                let shift = c.coff == 2 && pools;
                FrontSlots {
                    ranges: [(own, 1), (0, if shift { r } else { 0 })],
                    width: c.width(),
                    pooled: if pools { c.d } else { 0 },
                }
            })
        };
        TokenSlots {
            ring: pos % dims.window,
            comp: front(&dims.comp),
            index: front(&dims.index),
        }
    }
}

/// One compressor step over a chunk ([`Backend::compress`]).
#[derive(Clone, Copy, Debug)]
pub struct CompressSpec {
    pub dims: CompDims,
    pub rope: RopeKind,
    /// Rows are rotated at position `ratio · row` over their last `n_rot` values.
    pub n_rot: usize,
    pub round: RowRounding,
    pub eps: f32,
}

/// Lightning-indexer selection ([`Backend::index_select`]).
#[derive(Clone, Copy, Debug)]
pub struct IndexSpec {
    pub heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Ratio of the attention compressor whose rows are selected (CSA: 4).
    pub ratio: usize,
    pub n_rot: usize,
    pub rope: RopeKind,
    /// Hadamard + FP4 round trip of the query (after RoPE).
    pub fp4: bool,
}

/// Sink attention ([`Backend::attend`]).
#[derive(Clone, Copy, Debug)]
pub struct AttnSpec {
    pub n_head: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub window: usize,
    /// Compression ratio of the layer's attention rows (0: SWA only).
    pub ratio: usize,
    /// Width of a selection row when the indexer selects (CSA), else 0.
    pub top_k: usize,
    pub rope: RopeKind,
}

/// MoE shape ([`Backend::moe_route`], [`Backend::moe_experts`]).
#[derive(Clone, Copy, Debug)]
pub struct MoeSpec {
    pub n_expert: usize,
    pub n_used: usize,
    pub d: usize,
    pub ff: usize,
    pub weight_scale: f32,
    pub clamp: f32,
}

/// What a backend must provide. Every op's reference semantics is the CPU backend's
/// implementation (`ds4-cpu`); other backends are tested against it op by op.
pub trait Backend: Send + Sync + Sized {
    /// f32 activations.
    type Buf: Send;
    /// i32 values (token ids, expert and row selections).
    type IBuf: Send;
    /// A bound weight (matrix, f32 vector or i32 table).
    type Weight: Send + Sync;
    /// One layer's attention state: raw window ring, compressor frontiers and rows.
    type LayerState: Send;
    /// A rollback point of a [`Backend::LayerState`].
    type Mark: Send;

    fn name(&self) -> String;

    /// The first error since the last check (a device backend records failures — out of
    /// memory, a failed launch — and turns later ops into no-ops; the schedule calls this at
    /// the end of every step). The CPU backend never fails.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Block until every queued operation has run, then [`Backend::check`]. Called at the end of
    /// a model load: weights generated or uploaded asynchronously are then resident (a benchmark's
    /// first prompt does not wait for them) and a failure surfaces at the load, not in the first
    /// step. The CPU backend runs everything at once.
    fn finish(&self) -> Result<(), String> {
        self.check()
    }

    /// The ops from here to [`Backend::graph_end`] are one step over `n` tokens that a device
    /// backend may record and replay as one graph (GPU decode: one driver call instead of a
    /// launch per op). Results are the same; a host read (download) ends the step early. The
    /// CPU backend does nothing.
    fn graph_begin(&self, _n: usize) {}

    /// End of the step begun by [`Backend::graph_begin`]: run whatever is still recorded.
    fn graph_end(&self) {}

    /// A hint for two independent pieces of work (a scheduling hint only: results are the
    /// same with or without it). The ops issued from here to [`Backend::side_end`] (the side
    /// branch) depend only on what was issued before this call, and the ops issued after
    /// `side_end` up to [`Backend::join`] (the main branch) do not read or write what the side
    /// branch writes; a device may run the two branches concurrently. Ops after `join` see both.
    /// No nesting: one side branch at a time. The CPU backend (and any backend by default)
    /// runs everything in issue order.
    fn side_begin(&self) {}

    /// End of the side branch begun by [`Backend::side_begin`]: the ops from here to
    /// [`Backend::join`] form the main branch.
    fn side_end(&self) {}

    /// Join the two branches: the ops issued from here on wait for both.
    fn join(&self) {}

    /// A hint: the weights `ws` are read soon by a step of `n` tokens, after some ops that
    /// read little memory (norms, attention, routing). A device may start moving their bytes
    /// into its cache meanwhile (GPU decode: an L2 prefetch, `DS4_GPU_PREFETCH`); results are
    /// the same with or without it. The CPU backend does nothing.
    fn prefetch(&self, _ws: &[&Self::Weight], _n: usize) {}

    /// Tokens per prompt step the engine should batch now, asked before every step (activation
    /// memory grows with it: ~0.5 MiB a token at full size on a GPU). The CPU gains nothing
    /// past 128; a GPU reads each expert's weights once per step, so it wants the most that fits
    /// the memory free at that point.
    fn prefill_chunk(&self) -> usize {
        128
    }

    /// Device bytes of operand copies made from the weights after loading (a GPU's bf16 forms
    /// of its dense prefill weights, made at the first prompt); 0 where none.
    fn weight_copy_bytes(&self) -> u64 {
        0
    }

    /// The device's free and total memory in bytes now (GPU backends); None where the backend
    /// keeps its state in host memory.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }

    // ---- binding ----
    /// A matrix used by [`Backend::matmul`] / [`Backend::embed`] (any supported quant type).
    fn matrix(&self, src: &WeightSrc) -> Result<Self::Weight, String>;
    /// A matrix that the backend reads in place from host memory instead of copying it: for a
    /// table read a few rows a step (the embedding: 8 KiB a token of a 1 GiB table), so that a
    /// model with routed experts in host memory leaves that device memory to experts. `src`'s
    /// bytes must stay mapped while the backend lives. None where the backend does not do
    /// this (the CPU reads every weight from host memory anyway); an error says why it could
    /// not (the caller then binds it with [`Backend::matrix`]).
    fn host_matrix(&self, _src: &WeightSrc) -> Option<Result<Self::Weight, String>> {
        None
    }

    /// Device room for `capacity` routed experts of type `ty`, `[cols, rows]` each (contents
    /// undefined), that [`Backend::gather_experts`] fills: decode steps of experts held in host
    /// memory upload the ones they select (ds4-model `offload.rs`). None where the backend
    /// computes those on the host instead (the CPU).
    fn expert_slots(
        &self,
        _ty: GgmlType,
        _cols: usize,
        _rows: usize,
        _capacity: usize,
    ) -> Option<Result<Self::Weight, String>> {
        None
    }

    /// Page-locks host memory that [`Backend::gather_experts`] will copy from (the host-memory
    /// experts' stacks; it must outlive the backend), so that the copies need no staging.
    /// Returns the bytes locked (0: not done, the copies are staged).
    fn register_host(&self, _ranges: &[&[u8]]) -> u64 {
        0
    }

    /// Copies `slabs` (one expert's bytes each, in order) into the first `slabs.len()` experts
    /// of `slots` ([`Backend::expert_slots`]), after the ops issued so far (they may still read
    /// the previous contents) and before the ops issued next.
    fn gather_experts(&self, _slots: &Self::Weight, _slabs: &[&[u8]]) {}

    /// [`Backend::gather_experts`] that may run beside the ops issued next: the copies start
    /// after the ops issued so far (which may still read the previous contents) and are
    /// visible to the ops issued after [`Backend::await_experts`]; ops issued in between must
    /// not read `slots`. A GPU copies on a stream of its own (page-locked sources), so a
    /// layer's experts cross the bus while earlier layers compute; the default copies at once.
    fn prefetch_experts(&self, slots: &Self::Weight, slabs: &[&[u8]]) {
        self.gather_experts(slots, slabs)
    }

    /// Orders the ops issued from now on after the copies of every
    /// [`Backend::prefetch_experts`] so far.
    fn await_experts(&self) {}

    /// A small tensor used as f32 values (norm weights, scales, biases, sinks).
    fn vector(&self, src: &WeightSrc) -> Result<Self::Weight, String>;
    /// An I32 table (hash routing `tid2eid`).
    fn table(&self, src: &WeightSrc) -> Result<Self::Weight, String>;

    /// A weight of type `ty` and GGUF dims `dims` filled on the backend itself from `seed`
    /// (full-size benchmarks with no file). Backends that cannot say so.
    fn random(
        &self,
        kind: WeightKind,
        ty: GgmlType,
        dims: &[u64],
        fill: Fill,
        seed: u64,
    ) -> Result<Self::Weight, String> {
        let _ = (kind, ty, dims, fill, seed);
        Err(format!("backend {} cannot generate weights", self.name()))
    }

    /// The bytes of a matrix weight as a file stores them (its quant blocks) into `out`, whose
    /// length must be the weight's size: generated weights kept in host memory
    /// (`ds4_model::offload`). Backends that cannot say so.
    fn read_weight(&self, w: &Self::Weight, out: &mut [u8]) -> Result<(), String> {
        let _ = (w, out);
        Err(format!("backend {} cannot read weights back", self.name()))
    }

    // ---- memory ----
    /// A buffer of `len` values with unspecified contents: every op writes the whole of its
    /// output (the CPU backend happens to give zeros; a GPU backend gives recycled memory).
    fn alloc(&self, len: usize) -> Self::Buf;
    fn upload(&self, data: &[f32]) -> Self::Buf;
    fn upload_i32(&self, data: &[i32]) -> Self::IBuf;
    /// Like [`Backend::alloc`], for i32 values.
    fn alloc_i32(&self, len: usize) -> Self::IBuf;
    /// The first `len` values.
    fn download(&self, b: &Self::Buf, len: usize) -> Vec<f32>;
    fn download_i32(&self, b: &Self::IBuf, len: usize) -> Vec<i32>;
    /// The token [`sample::select`] picks from the first `vocab` values of `logits` for draw
    /// `u` ∈ [0, 1) (unused when greedy). Default: download and pick on the host; a device
    /// backend picks in place and returns only the id (the end of a recorded step).
    fn sample(&self, logits: &Self::Buf, vocab: usize, p: &SampleParams, u: f64) -> u32 {
        sample::select(&self.download(logits, vocab), p, u)
    }
    /// Row r of `logits` `[draws.len(), vocab]` picked as [`Backend::sample`] picks it, with
    /// draw `draws[r]` (a speculative step's rows). A device reads the ids back in one go.
    fn sample_rows(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        p: &SampleParams,
        draws: &[f64],
    ) -> Vec<u32> {
        let all = self.download(logits, draws.len() * vocab);
        sample::select_rows(&all, vocab, p, draws)
    }
    /// `dst[dst_off ..][.. len] = src[src_off ..][.. len]`.
    fn copy(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        len: usize,
    );

    // ---- state ----
    fn new_layer_state(&self, dims: &LayerDims) -> Self::LayerState;
    fn state_to_host(&self, st: &Self::LayerState) -> HostLayerState;
    /// `h` has the shapes of `dims` (callers validate first).
    fn state_from_host(&self, dims: &LayerDims, h: &HostLayerState) -> Self::LayerState;
    /// `st` will hold at most `tokens` positions (its session's context): a backend whose
    /// row capacity grows in steps may stop growing there rather than at its next step. A
    /// hint: rows past it still fit.
    fn bound_state(&self, _st: &mut Self::LayerState, _tokens: usize) {}
    fn mark(&self, st: &Self::LayerState) -> Self::Mark;
    fn rollback(&self, st: &mut Self::LayerState, m: Self::Mark);
    /// Marks of several layers (a model's checkpoint: one device operation where the backend
    /// batches them; the default marks each).
    fn mark_all(&self, sts: &[Self::LayerState]) -> Vec<Self::Mark> {
        sts.iter().map(|s| self.mark(s)).collect()
    }
    /// Marks that undo only what one token writes ([`TokenSlots`], a layer each), taken before
    /// a batch whose last token it is: [`Backend::rollback_all`] then drops that token and keeps
    /// the batch's others (their frontier slots and the rows they pooled).
    /// None where the backend has no such marks (the caller then marks everything and
    /// re-evaluates the kept tokens).
    fn mark_slots_all(
        &self,
        _sts: &[Self::LayerState],
        _slots: &[TokenSlots],
    ) -> Option<Vec<Self::Mark>> {
        None
    }
    /// [`Backend::rollback`] of each layer to its mark (`ms` from [`Backend::mark_all`] or
    /// [`Backend::mark_slots_all`] of them).
    fn rollback_all(&self, sts: &mut [Self::LayerState], ms: Vec<Self::Mark>) {
        for (s, m) in sts.iter_mut().zip(ms) {
            self.rollback(s, m);
        }
    }

    // ---- ops ----
    /// `out[i·copies + c] = table row tokens[i]` (width `d`): the embedding into N streams.
    fn embed(
        &self,
        table: &Self::Weight,
        tokens: &Self::IBuf,
        n: usize,
        copies: usize,
        d: usize,
        out: &mut Self::Buf,
    );
    /// `y[i] = W · x[i]` for `n` rows of `x` (`[n, cols]` → `[n, rows]`).
    fn matmul(&self, w: &Self::Weight, part: Part, x: &Self::Buf, n: usize, y: &mut Self::Buf);
    /// Grouped low-rank product (model.md §3.3 output): group `g` of `groups` maps input
    /// columns `g·cols .. (g+1)·cols` of each row through weight rows `g·r .. (g+1)·r`, where
    /// `r = rows / groups`; `x` is `[n, groups·cols]`, `y` is `[n, rows]`.
    fn matmul_grouped(
        &self,
        w: &Self::Weight,
        groups: usize,
        x: &Self::Buf,
        n: usize,
        y: &mut Self::Buf,
    );
    /// `y[..len] += x[..len]`.
    fn add(&self, y: &mut Self::Buf, x: &Self::Buf, len: usize);
    /// RMSNorm of `rows` rows of `width` in place, weighted when `w` is given.
    fn rms_norm(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        width: usize,
        w: Option<&Self::Weight>,
        eps: f32,
    );
    /// RoPE on the last `n_rot` values of each of `heads` rows of width `width` per token;
    /// token `i` at position `t0 + i` (inverse: rotate by −position).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut Self::Buf,
        n: usize,
        heads: usize,
        width: usize,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        inverse: bool,
    );
    /// Rounding steps on `rows` rows of `width` (see [`RowRounding`]).
    fn round_rows(&self, x: &mut Self::Buf, rows: usize, width: usize, r: RowRounding);
    /// HC pre (model.md §3.1) from the mixer output `m` (`[n, (2+N)·N]`): writes the collapsed
    /// input `z = Σ pre_i X[i]` (`[n, D]`), `post` (`[n, N]`) and the Sinkhorn-normalised
    /// `comb` (`[n, N·N]`, row-major `A[a][b]`). `x` is `[n, N, D]`.
    #[allow(clippy::too_many_arguments)]
    fn hc_split(
        &self,
        hc: HcDims,
        m: &Self::Buf,
        scale: &Self::Weight,
        base: &Self::Weight,
        x: &Self::Buf,
        n: usize,
        z: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    );
    /// The head's collapse (model.md §3.5): `y = Σ (sigmoid(m_i·scale₀ + base_i) + eps) X[i]`
    /// with `m` `[n, N]`.
    #[allow(clippy::too_many_arguments)]
    fn hc_collapse(
        &self,
        hc: HcDims,
        m: &Self::Buf,
        scale: &Self::Weight,
        base: &Self::Weight,
        x: &Self::Buf,
        n: usize,
        y: &mut Self::Buf,
    );
    /// HC post (expand): `X'[j] = post_j·o + Σ_i A[i][j]·X[i]` for each token.
    fn hc_post(
        &self,
        hc: HcDims,
        x: &mut Self::Buf,
        o: &Self::Buf,
        post: &Self::Buf,
        comb: &Self::Buf,
        n: usize,
    );
    /// Compressor over a chunk (model.md §3.3, frontier rule §4.1): token `i` at `t0 + i`
    /// stores its projection `a[i]` and score `g[i] + ape[(t0+i) mod ratio]` in the frontier;
    /// every token that closes a window appends the pooled row (softmax over candidates per
    /// channel, RMSNorm with `norm`, RoPE at `ratio · row`, rounding) to the rows.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        st: &mut Self::LayerState,
        which: Which,
        spec: &CompressSpec,
        ape: &Self::Weight,
        norm: &Self::Weight,
        a: &Self::Buf,
        g: &Self::Buf,
        n: usize,
        t0: usize,
    );
    /// Lightning indexer: for token `i`, when more than `top_k` attention rows are visible
    /// (`(t+1)/ratio`), the `top_k` visible rows with the largest scores (ties: lower index
    /// first), else all visible rows; ascending, padded with −1. `q` is `[n, heads, head_dim]`
    /// before RoPE, `w` `[n, heads]`; `sel` is `[n, top_k]`. With `spec.fp4` the indexer rows
    /// are FP4-simulated (the compressor rounds them under the same flag); a backend may rely on
    /// it (the GPU scores prefill chunks on tensor cores, exact for such rows).
    #[allow(clippy::too_many_arguments)]
    fn index_select(
        &self,
        st: &Self::LayerState,
        spec: &IndexSpec,
        q: &Self::Buf,
        w: &Self::Buf,
        n: usize,
        t0: usize,
        sel: &mut Self::IBuf,
    );
    /// Sink attention for the chunk: token `i` writes its raw row `kv[i]` to the ring, then
    /// attends (one shared KV head, keys = values) over raw rows of positions
    /// `max(0, t−W+1) ..= t` and compressed rows — `sel[i]` when given, else all visible ones
    /// — with per-head sinks; the output is rotated back by −t. `q` `[n, heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        st: &mut Self::LayerState,
        spec: &AttnSpec,
        q: &Self::Buf,
        kv: &Self::Buf,
        sinks: &Self::Weight,
        sel: Option<&Self::IBuf>,
        n: usize,
        t0: usize,
        out: &mut Self::Buf,
    );
    /// Whether [`Backend::attend_qnorm`] of `n` tokens norms and rotates the queries inside its
    /// attention (faster than a separate [`Backend::norm_rope`]), so the schedule should leave
    /// them raw. Default: false.
    fn attend_norms_q(&self, spec: &AttnSpec, n: usize) -> bool {
        let _ = (spec, n);
        false
    }
    /// [`Backend::attend`] of the raw queries `q` after their [`Backend::norm_rope`] (unweighted
    /// heads, `eps`, RoPE at `t0 + i`, no rounding); `q` itself is left as given. Default: a
    /// normed copy, then [`Backend::attend`].
    #[allow(clippy::too_many_arguments)]
    fn attend_qnorm(
        &self,
        st: &mut Self::LayerState,
        spec: &AttnSpec,
        q: &Self::Buf,
        eps: f32,
        kv: &Self::Buf,
        sinks: &Self::Weight,
        sel: Option<&Self::IBuf>,
        n: usize,
        t0: usize,
        out: &mut Self::Buf,
    ) {
        let len = n * spec.n_head * spec.head_dim;
        let mut qn = self.alloc(len);
        self.copy(q, 0, &mut qn, 0, len);
        let (nh, hd) = (spec.n_head, spec.head_dim);
        self.norm_rope(
            &mut qn, n, nh, hd, None, eps, spec.n_rot, t0, spec.rope, None,
        );
        self.attend(st, spec, &qn, kv, sinks, sel, n, t0, out);
    }
    /// The attention ([`Backend::attend`], or with `qeps` [`Backend::attend_qnorm`] of raw
    /// queries) and its grouped output projection: `y = matmul_grouped(w, groups, o)` of the
    /// attention's output o (`[n, heads, head_dim]`, used by nothing else). A backend may hand o
    /// to the product in the product's own operand format and never store it in f32 (the GPU's
    /// `fast` prompt steps: bf16). Default: the two ops through an f32 o.
    #[allow(clippy::too_many_arguments)]
    fn attend_project(
        &self,
        st: &mut Self::LayerState,
        spec: &AttnSpec,
        q: &Self::Buf,
        qeps: Option<f32>,
        kv: &Self::Buf,
        sinks: &Self::Weight,
        sel: Option<&Self::IBuf>,
        n: usize,
        t0: usize,
        w: &Self::Weight,
        groups: usize,
        y: &mut Self::Buf,
    ) {
        let mut o = self.alloc(n * spec.n_head * spec.head_dim);
        match qeps {
            Some(eps) => self.attend_qnorm(st, spec, q, eps, kv, sinks, sel, n, t0, &mut o),
            None => self.attend(st, spec, q, kv, sinks, sel, n, t0, &mut o),
        }
        self.matmul_grouped(w, groups, &o, n, y);
    }
    /// Router (model.md §3.4): scores `sqrt(softplus(logit))`; experts from `tid2eid[token]`
    /// (hash layers) or the top `n_used` of score + bias (ties: lower id); weights = score /
    /// Σ selected scores · `weight_scale`. `sel`, `wgt` are `[n, n_used]`.
    #[allow(clippy::too_many_arguments)]
    fn moe_route(
        &self,
        spec: &MoeSpec,
        logits: &Self::Buf,
        bias: Option<&Self::Weight>,
        tid2eid: Option<&Self::Weight>,
        tokens: &Self::IBuf,
        n: usize,
        sel: &mut Self::IBuf,
        wgt: &mut Self::Buf,
    );
    /// Routed experts: `out[i] = Σ_s down_e(swiglu_c(gate_e·z, up_e·z) · wgt[i,s])` over the
    /// selected experts `e = sel[i,s]`, summed in selection order into zeros. A slot of weight
    /// exactly 0 adds exactly 0 (SwiGLU is clamped: finite), so a backend may skip it: the CPU
    /// and the GPU's prefill do, and an expert-parallel rank then computes only its own
    /// experts' slots ([`Backend::moe_localize`] zeroes the others).
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        spec: &MoeSpec,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        z: &Self::Buf,
        sel: &Self::IBuf,
        wgt: &Self::Buf,
        n: usize,
        out: &mut Self::Buf,
    );
    /// `g = silu(min(g, c)) · clamp(u, −c, c)` over `len` values (the shared expert).
    fn swiglu(&self, g: &mut Self::Buf, u: &Self::Buf, len: usize, clamp: f32);

    // ---- expert parallelism (`shard.rs`) ----
    /// Rewrite the router's `[n, k]` global selections and weights for a rank holding experts
    /// `e0 .. e0 + count` ([`shard::localize`]), before [`Backend::moe_experts`] of that rank's
    /// expert stacks. Default: on the host (download, rewrite, upload); a backend that records
    /// decode steps as graphs rewrites on the device.
    fn moe_localize(
        &self,
        sel: &mut Self::IBuf,
        wgt: &mut Self::Buf,
        n: usize,
        k: usize,
        e0: usize,
        count: usize,
    ) {
        let mut s = self.download_i32(sel, n * k);
        let mut w = self.download(wgt, n * k);
        shard::localize(&mut s, &mut w, k, e0, count);
        *sel = self.upload_i32(&s);
        *wgt = self.upload(&w);
    }
    /// `y[..len] = Σ over the ranks of this backend's EP group of their y[..len]`, the same
    /// values on every rank. A backend outside any group (the default) leaves y as it is.
    fn all_reduce_sum(&self, y: &mut Self::Buf, len: usize) {
        let _ = (y, len);
    }

    // ---- fused ops (defaults: the composition; devices may fuse) ----
    /// `ys[i] = ws[i]·x` for every i ([`Backend::matmul`] with `Part::All`, `n` rows of `x`):
    /// products of one input that a device may run as one launch. Default: the products in order.
    fn matmul_multi(
        &self,
        ws: &[&Self::Weight],
        x: &Self::Buf,
        n: usize,
        ys: &mut [&mut Self::Buf],
    ) {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.matmul(w, Part::All, x, n, y);
        }
    }
    /// [`Backend::rms_norm`] of the `n` rows of `x` (`[n, cols]`, in place, weighted when `norm`
    /// is given), then `y = w·x` ([`Backend::matmul`], `Part::All`): on return `x` holds the
    /// normed rows either way. A device may fold the norm into the product's staging of `x` (the
    /// query's low-rank norm before q_b). Default: that composition.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(
        &self,
        x: &mut Self::Buf,
        n: usize,
        cols: usize,
        norm: Option<&Self::Weight>,
        eps: f32,
        w: &Self::Weight,
        y: &mut Self::Buf,
    ) {
        self.rms_norm(x, n, cols, norm, eps);
        self.matmul(w, Part::All, x, n, y);
    }
    /// `y[..n·rows] += w·x` for `n` rows of `x` (`rows` = rows of `w`): [`Backend::matmul`] into
    /// a scratch buffer, then [`Backend::add`] (the default), which a device may fold into the
    /// product's epilogue (the shared expert's down product added into the routed sum).
    fn matmul_add(
        &self,
        w: &Self::Weight,
        x: &Self::Buf,
        n: usize,
        rows: usize,
        y: &mut Self::Buf,
    ) {
        let mut t = self.alloc(n * rows);
        self.matmul(w, Part::All, x, n, &mut t);
        self.add(y, &t, n * rows);
    }
    /// Shared-expert gate/up with the clamped SwiGLU: `h = g·x`, then [`Backend::swiglu`] of
    /// `h` with `u·x` over `n·ff` values (`ff` = rows of `g` and `u`). Default: that composition.
    #[allow(clippy::too_many_arguments)]
    fn matmul_gateup(
        &self,
        g: &Self::Weight,
        u: &Self::Weight,
        x: &Self::Buf,
        n: usize,
        ff: usize,
        h: &mut Self::Buf,
        clamp: f32,
    ) {
        let mut t = self.alloc(n * ff);
        self.matmul(g, Part::All, x, n, h);
        self.matmul(u, Part::All, x, n, &mut t);
        self.swiglu(h, &t, n * ff, clamp);
    }
    /// HC pre with the sublayer's input norm (model.md §3.1): `m = mixer · rms_norm(X)` (no
    /// weight, over N·D per token), [`Backend::hc_split`] into `z`, `post`, `comb`, then
    /// `rms_norm(z, norm)` over D. `x` is `[n, N, D]`. Default: [`hc_pre_norm_composed`].
    #[allow(clippy::too_many_arguments)]
    fn hc_pre_norm(
        &self,
        hc: HcDims,
        mixer: &Self::Weight,
        scale: &Self::Weight,
        base: &Self::Weight,
        norm: &Self::Weight,
        x: &Self::Buf,
        n: usize,
        eps: f32,
        z: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    ) {
        hc_pre_norm_composed(self, hc, mixer, scale, base, norm, x, n, eps, z, post, comb)
    }

    /// [`Backend::hc_post`] of a sublayer's output `o` (with its `post_in`, `comb_in`) into `x`,
    /// then [`Backend::hc_pre_norm`] of the next sublayer on the new `x`. Default: the two ops.
    #[allow(clippy::too_many_arguments)]
    fn hc_post_pre_norm(
        &self,
        hc: HcDims,
        x: &mut Self::Buf,
        o: &Self::Buf,
        post_in: &Self::Buf,
        comb_in: &Self::Buf,
        mixer: &Self::Weight,
        scale: &Self::Weight,
        base: &Self::Weight,
        norm: &Self::Weight,
        n: usize,
        eps: f32,
        z: &mut Self::Buf,
        post: &mut Self::Buf,
        comb: &mut Self::Buf,
    ) {
        self.hc_post(hc, x, o, post_in, comb_in, n);
        self.hc_pre_norm(hc, mixer, scale, base, norm, x, n, eps, z, post, comb);
    }

    /// RMSNorm of the `n·heads` rows of `width` (weighted when `w` is given), then RoPE of
    /// token `i` at `t0 + i` (forward), then [`Backend::round_rows`] when `round` is given.
    /// Default: [`norm_rope_composed`].
    #[allow(clippy::too_many_arguments)]
    fn norm_rope(
        &self,
        x: &mut Self::Buf,
        n: usize,
        heads: usize,
        width: usize,
        w: Option<&Self::Weight>,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        round: Option<RowRounding>,
    ) {
        norm_rope_composed(self, x, n, heads, width, w, eps, n_rot, t0, kind, round)
    }

    /// Two [`Backend::norm_rope`]s of `n` tokens sharing the row width, eps, RoPE and
    /// positions: `a` (`heads_a` rows a token, weight `w_a`, rounding `round_a`), then `b` (its
    /// own). The attention's query heads and shared KV row; the GPU runs both in one launch
    /// (same results as the two calls). Default: the two calls.
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_pair(
        &self,
        a: &mut Self::Buf,
        heads_a: usize,
        w_a: Option<&Self::Weight>,
        round_a: Option<RowRounding>,
        b: &mut Self::Buf,
        heads_b: usize,
        w_b: Option<&Self::Weight>,
        round_b: Option<RowRounding>,
        n: usize,
        width: usize,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
    ) {
        self.norm_rope(a, n, heads_a, width, w_a, eps, n_rot, t0, kind, round_a);
        self.norm_rope(b, n, heads_b, width, w_b, eps, n_rot, t0, kind, round_b);
    }

    /// The MoE router: `logits = router·z` ([`Backend::matmul`], `Part::All`; `[n, n_expert]`),
    /// then [`Backend::moe_route`] of those logits into `sel`, `wgt`. The GPU runs both in one
    /// launch at n = 1 (same logits, selections and weights as the two calls). Default: the two
    /// calls.
    #[allow(clippy::too_many_arguments)]
    fn matmul_route(
        &self,
        spec: &MoeSpec,
        router: &Self::Weight,
        z: &Self::Buf,
        n: usize,
        logits: &mut Self::Buf,
        bias: Option<&Self::Weight>,
        tid2eid: Option<&Self::Weight>,
        tokens: &Self::IBuf,
        sel: &mut Self::IBuf,
        wgt: &mut Self::Buf,
    ) {
        self.matmul(router, Part::All, z, n, logits);
        self.moe_route(spec, logits, bias, tid2eid, tokens, n, sel, wgt);
    }
}

/// [`Backend::hc_pre_norm`] as separate ops: copy, rms_norm, matmul, hc_split, rms_norm.
#[allow(clippy::too_many_arguments)]
pub fn hc_pre_norm_composed<B: Backend>(
    b: &B,
    hc: HcDims,
    mixer: &B::Weight,
    scale: &B::Weight,
    base: &B::Weight,
    norm: &B::Weight,
    x: &B::Buf,
    n: usize,
    eps: f32,
    z: &mut B::Buf,
    post: &mut B::Buf,
    comb: &mut B::Buf,
) {
    let w = hc.n * hc.d;
    let mix = (2 + hc.n) * hc.n;
    let mut s = b.alloc(n * w);
    b.copy(x, 0, &mut s, 0, n * w);
    b.rms_norm(&mut s, n, w, None, eps);
    let mut m = b.alloc(n * mix);
    b.matmul(mixer, Part::All, &s, n, &mut m);
    b.hc_split(hc, &m, scale, base, x, n, z, post, comb);
    b.rms_norm(z, n, hc.d, Some(norm), eps);
}

/// [`Backend::norm_rope`] as separate ops: rms_norm, rope, round_rows.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_composed<B: Backend>(
    b: &B,
    x: &mut B::Buf,
    n: usize,
    heads: usize,
    width: usize,
    w: Option<&B::Weight>,
    eps: f32,
    n_rot: usize,
    t0: usize,
    kind: RopeKind,
    round: Option<RowRounding>,
) {
    b.rms_norm(x, n * heads, width, w, eps);
    b.rope(x, n, heads, width, n_rot, t0, kind, false);
    if let Some(r) = round {
        b.round_rows(x, n * heads, width, r);
    }
}
