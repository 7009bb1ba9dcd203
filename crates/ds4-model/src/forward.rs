//! The DS4 forward-pass schedule (model.md §3), written once against the backend boundary
//! ([`ds4_backend::Backend`]). It owns the weight handles and the order of ops; backends own
//! the arithmetic. Buffers are token-major: `x` is `[n, N, D]` (stream-major inside a token).

use crate::offload::{self, HostExperts, HostPlacement, HostStack, GROUP, UPLOAD_MIN};
use crate::{AttnKind, HParams, LayerKind, WeightDir};
use ds4_backend::rope::{Rope, RopeTables};
use ds4_backend::{
    AttnSpec, Backend, CompDims, CompressSpec, HcDims, HostLayerState, IndexSpec, LayerDims,
    MoeSpec, Part, RopeKind, Rounding, RowRounding, Shard, WeightKind, WeightSrc, Which,
};
use ds4_gguf::GgufFile;
use std::any::Any;
use std::sync::Arc;

/// The model's two RoPE tables (plain for SWA layers and MTP, YaRN for compressed layers).
pub fn rope_tables(hp: &HParams) -> RopeTables {
    let n_rot = hp.n_rot as usize;
    RopeTables {
        swa: Rope::plain(hp.rope_base, n_rot),
        comp: Rope::yarn(
            hp.compress_rope_base,
            n_rot,
            hp.rope_scale_factor,
            hp.rope_orig_ctx,
            hp.yarn_beta_fast,
            hp.yarn_beta_slow,
        ),
    }
}

struct Hc<W> {
    mixer: W, // [N·D → (2+N)·N] (head: → N)
    scale: W,
    base: W,
}

struct Comp<W> {
    ape: W, // ratio rows of width coff·d
    kv: W,
    gate: W,
    norm: W,
    dims: CompDims,
}

struct Indexer<W> {
    q_b: W,
    proj: W,
    comp: Comp<W>,
}

struct Layer<W> {
    kind: LayerKind,
    dims: LayerDims,
    hc_attn: Hc<W>,
    attn_norm: W,
    q_a: W,
    q_a_norm: W,
    q_b: W,
    kv: W,
    kv_norm: W,
    sinks: W,
    out_a: W,
    out_b: W,
    comp: Option<Comp<W>>,
    indexer: Option<Indexer<W>>,
    hc_ffn: Hc<W>,
    ffn_norm: W,
    router: W,
    bias: Option<W>,
    tid2eid: Option<W>,
    experts: Experts<W>,
    gate_sh: W,
    up_sh: W,
    down_sh: W,
    clamp: f32,
    clamp_sh: f32,
}

/// A layer's routed-expert stacks: on the backend, or in host memory (`offload.rs`).
enum Experts<W> {
    Here {
        gate: W,
        up: W,
        down: W,
    },
    Host {
        run: Box<dyn HostExperts>,
        stacks: Box<[HostStack; 3]>,
        /// The block's index (the layer buffer's key).
        layer: usize,
    },
}

/// The MTP speculative head's weights (model.md §2.5, §3.7).
struct Mtp<W> {
    block: Layer<W>,
    e_proj: W,
    h_proj: W,
    enorm: W,
    hnorm: W,
    norm: W,
    head: Hc<W>,
}

/// A loaded model on backend `B`.
pub struct Model<B: Backend> {
    pub hp: HParams,
    pub rounding: Rounding,
    /// Declared before `layers`, so dropped first: a GPU backend unlocks the host-memory
    /// experts' pages (`Backend::register_host`) before their stacks' memory goes.
    pub backend: B,
    /// Which routed experts this model holds (expert parallelism; `Shard::ONE`: all).
    pub shard: Shard,
    /// The host memory `embd` is read from where the backend reads it in place
    /// (`Backend::host_matrix`; None: `embd` is the backend's copy). Declared after `backend`:
    /// dropped after the GPU unlocks its pages.
    embd_host: Option<HostStack>,
    embd: B::Weight,
    out_hc: Hc<B::Weight>,
    out_norm: B::Weight,
    output: B::Weight,
    layers: Vec<Layer<B::Weight>>,
    mtp: Option<Mtp<B::Weight>>,
    /// Host-memory experts not gathered: prompt batches of at least `.0` tokens upload them
    /// `.1` at a time, smaller ones run on the host (`offload.rs`; unused when no layer keeps
    /// them on the host).
    host_batch: (usize, usize),
    /// Host-memory experts of every batch gathered into device slots (`HostPlacement::gather`).
    host_gather: bool,
    /// Those slots (gate, up, down), made at the first such batch for its stacks' types and
    /// shapes, shared by every host layer (batches run one layer after another, and a gather is
    /// ordered after the ops that read the previous one): [`offload::gather_slots`] experts a
    /// stack (24), ~170 MB of device memory in the q2 mix, ~340 MB in q4. The memory
    /// plan allows one uploaded group (GROUP = 32 experts) beside the weights: a prompt batch
    /// that uploads groups drops the slots first (24 experts of the model fit in that room).
    slots: std::sync::Mutex<Option<Slots<B::Weight>>>,
    /// One host layer's whole expert stacks on the device ([`LayerBuffer`]; None: not made).
    layer_buf: std::sync::Mutex<Option<LayerBuffer<B::Weight>>>,
}

/// Device room for one host layer's whole routed-expert stacks (gate, up, down: every expert;
/// a q2 layer's 1.8 GB), which the engine's memory plan pays for with one more layer in host
/// memory (`ds4_engine::host_expert_layers`). Between batches it holds the last host layer
/// (made at load): decode steps and small batches run that layer as if resident, so the plan
/// decodes as fast as one without the buffer and one layer fewer on the host. A prompt batch of
/// [`offload::prefetch_min`] tokens or more (which selects nearly every expert, so a gather
/// would copy the whole layer anyway) fills it with each host layer in turn, ahead of use: the
/// first at the batch's start, the next right after a layer's MoE is issued, each copy on its
/// own stream (`Backend::prefetch_experts`) while the layers before it compute, and ends with
/// the last host layer in it again. Host layers spread through the model (the engine's plan)
/// leave each copy the layers between two of them to hide behind.
struct LayerBuffer<W> {
    w: [W; 3],
    /// The stacks' (type, cols, rows) it was made for: host layers of other shapes gather.
    key: [(ds4_backend::GgmlType, usize, usize); 3],
    /// The host layer whose experts it holds, or is being filled with (`pending`).
    holds: usize,
    pending: bool,
}

/// Device slots for gathered host-memory experts.
struct Slots<W> {
    /// The stacks' (type, cols, rows) they were made for.
    key: [(ds4_backend::GgmlType, usize, usize); 3],
    /// Experts a slot stack holds.
    cap: usize,
    /// Gate, up, down; None where they could not be made (the host path from then on).
    w: Option<[W; 3]>,
}

/// Logits per evaluated position, and (when asked) the final HC streams of the same
/// positions.
pub type Evaluated = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// The pick after every evaluated position ([`Model::eval_pick`]), and (when asked) the final
/// HC streams of the same positions.
pub type Picked = (Vec<u32>, Vec<Vec<f32>>);

/// A block's MoE output with its HC post still to apply: `(y, post, comb)`.
type Pending<B> = (
    <B as Backend>::Buf,
    <B as Backend>::Buf,
    <B as Backend>::Buf,
);

/// A session's state on backend `B`.
pub struct State<B: Backend> {
    pub tokens: Vec<u32>,
    pub layers: Vec<B::LayerState>,
}

impl<B: Backend> PartialEq for State<B>
where
    B::LayerState: PartialEq,
{
    fn eq(&self, o: &Self) -> bool {
        self.tokens == o.tokens && self.layers == o.layers
    }
}

impl<B: Backend> std::fmt::Debug for State<B>
where
    B::LayerState: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("tokens", &self.tokens)
            .field("layers", &self.layers)
            .finish()
    }
}

/// A rollback point of a [`State`] (speculative verification, model.md §4.4).
pub struct Checkpoint<B: Backend> {
    n_tokens: usize,
    marks: Vec<B::Mark>,
}

/// A session's state in host memory (snapshots).
#[derive(Clone, Debug, PartialEq)]
pub struct HostState {
    pub tokens: Vec<u32>,
    pub layers: Vec<HostLayerState>,
}

/// Where a model's tensors come from: bound GGUF files ([`FileSource`]) or a generator
/// (`synthetic.rs`). `kind` says how the schedule uses the tensor.
pub trait WeightSource<B: Backend> {
    fn weight(&mut self, b: &B, name: &str, kind: WeightKind) -> Result<B::Weight, String>;
    /// Experts `e0 .. e0 + count` of the 3-D expert stack `name` (GGUF dims `[cols, rows,
    /// experts]`) as a matrix of `count` experts: an expert-parallel rank's part
    /// (`ds4_backend::shard`).
    fn experts(&mut self, b: &B, name: &str, e0: usize, count: usize) -> Result<B::Weight, String>;
    /// Rows `r0 .. r0 + count` of the matrix `name` (GGUF dims `[cols, rows]`), or elements of
    /// the vector `name`: a tensor-parallel rank's part (`ds4_backend::shard`).
    fn rows(
        &mut self,
        b: &B,
        name: &str,
        kind: WeightKind,
        r0: usize,
        count: usize,
    ) -> Result<B::Weight, String>;
    /// Columns `c0 .. c0 + count` (whole quant blocks) of the matrix `name`: a tensor-parallel
    /// rank's part of a product whose input is split.
    fn cols(&mut self, b: &B, name: &str, c0: usize, count: usize) -> Result<B::Weight, String>;
    /// Whether the source has a tensor (optional parts: the MTP block).
    fn has(&self, name: &str) -> bool;
    /// The expert stack `name` in host memory (`offload.rs`), for layers that keep their
    /// routed experts there.
    fn host_stack(&mut self, _b: &B, name: &str) -> Result<HostStack, String> {
        Err(format!(
            "tensor {name}: this weight source cannot keep tensors in host memory"
        ))
    }
    /// The matrix `name` (GGUF dims `[cols, rows]`) in host memory, as a one-expert
    /// [`HostStack`] (dims `[cols, rows, 1]`): a table the backend reads in place
    /// ([`offload::HOST_TABLE`]).
    fn host_matrix(&mut self, _b: &B, name: &str) -> Result<HostStack, String> {
        Err(format!(
            "tensor {name}: this weight source cannot keep tensors in host memory"
        ))
    }
}

/// Bound GGUF files (main model, then an optional MTP file); `progress(bytes_done,
/// bytes_total)` after each tensor.
pub struct FileSource<'a> {
    pub files: &'a [(Arc<GgufFile>, WeightDir)],
    pub progress: &'a mut dyn FnMut(usize, usize),
    /// Ask the OS to read host-memory expert stacks into the page cache in the background as
    /// they are bound (`GgufFile::will_need`): set where they fit the RAM, so a cold file's first
    /// decode steps do not fault their experts in from disk one by one.
    pub prefetch_host: bool,
    loaded: usize,
    total: usize,
}

impl<'a> FileSource<'a> {
    pub fn new(
        files: &'a [(Arc<GgufFile>, WeightDir)],
        progress: &'a mut dyn FnMut(usize, usize),
    ) -> FileSource<'a> {
        let total = files
            .iter()
            .map(|(f, _)| f.bytes().len() - f.data_offset() as usize)
            .sum();
        FileSource {
            files,
            progress,
            prefetch_host: false,
            loaded: 0,
            total,
        }
    }
}

impl FileSource<'_> {
    /// The file and bound tensor of `name`.
    fn bound(&self, name: &str) -> Result<(&Arc<GgufFile>, &crate::bind::WeightRef), String> {
        self.files
            .iter()
            .find_map(|(f, d)| d.get(name).map(|w| (f, w)))
            .ok_or_else(|| format!("weight {name} was not bound"))
    }
}

impl<B: Backend> WeightSource<B> for FileSource<'_> {
    fn experts(&mut self, b: &B, name: &str, e0: usize, count: usize) -> Result<B::Weight, String> {
        let (file, w) = self.bound(name)?;
        let n_exp = w.dims.get(2).copied().unwrap_or(1) as usize;
        if w.dims.len() != 3
            || e0 + count > n_exp
            || count == 0
            || !(w.n_bytes as usize).is_multiple_of(n_exp)
        {
            return Err(format!(
                "tensor {name}: experts {e0}..{} of dims {:?}: not an expert stack that holds them",
                e0 + count,
                w.dims
            ));
        }
        // Expert slabs are contiguous and equal: one byte range of the mapping.
        let slab = w.n_bytes as usize / n_exp;
        let dims = [w.dims[0], w.dims[1], count as u64];
        let src = WeightSrc {
            name,
            file,
            ty: w.ty,
            dims: &dims,
            offset: w.offset as usize + e0 * slab,
            n_bytes: count * slab,
        };
        let r = b.matrix(&src).map_err(|e| format!("tensor {name}: {e}"))?;
        // The experts other ranks hold count as done: the bar still ends at the file's size.
        self.loaded += w.n_bytes as usize;
        (self.progress)(self.loaded, self.total);
        Ok(r)
    }
    fn rows(
        &mut self,
        b: &B,
        name: &str,
        kind: WeightKind,
        r0: usize,
        count: usize,
    ) -> Result<B::Weight, String> {
        let (file, w) = self.bound(name)?;
        let bad = || {
            format!(
                "tensor {name}: rows {r0}..{} of dims {:?} ({}): not whole rows of it",
                r0 + count,
                w.dims,
                w.ty.name()
            )
        };
        // A vector's elements are its rows here (whole quant blocks of them).
        let (rows, row, dims) = match w.dims[..] {
            [c, r] => (r as usize, w.ty.row_bytes(c), vec![c, count as u64]),
            [e] => {
                let blk = w.ty.block_elems() as usize;
                if !r0.is_multiple_of(blk) || !count.is_multiple_of(blk) {
                    return Err(bad());
                }
                (
                    e as usize,
                    w.ty.row_bytes(1).filter(|_| blk == 1),
                    vec![count as u64],
                )
            }
            _ => return Err(bad()),
        };
        let Some(row) = row.map(|r| r as usize) else {
            return Err(bad());
        };
        if count == 0 || r0 + count > rows {
            return Err(bad());
        }
        let src = WeightSrc {
            name,
            file,
            ty: w.ty,
            dims: &dims,
            offset: w.offset as usize + r0 * row,
            n_bytes: count * row,
        };
        let r = match kind {
            WeightKind::Matrix => b.matrix(&src),
            WeightKind::Vector => b.vector(&src),
            WeightKind::Table => b.table(&src),
        }
        .map_err(|e| format!("tensor {name}: {e}"))?;
        self.loaded += w.n_bytes as usize; // the other ranks' rows count as done
        (self.progress)(self.loaded, self.total);
        Ok(r)
    }
    fn cols(&mut self, b: &B, name: &str, c0: usize, count: usize) -> Result<B::Weight, String> {
        let (file, w) = self.bound(name)?;
        let blk = w.ty.block_elems() as usize;
        let [c, r] = w.dims[..] else {
            return Err(format!(
                "tensor {name}: columns of dims {:?}: not a matrix",
                w.dims
            ));
        };
        let (c, rows) = (c as usize, r as usize);
        if count == 0 || c0 + count > c || !c0.is_multiple_of(blk) || !count.is_multiple_of(blk) {
            return Err(format!(
                "tensor {name}: columns {c0}..{} of {c} are not whole {} blocks of {blk}",
                c0 + count,
                w.ty.name()
            ));
        }
        // Not contiguous: each row's piece copied into a one-tensor GGUF in memory (the
        // backends bind matrices of files), then bound like any other.
        let at = |n: usize| w.ty.row_bytes(n as u64).unwrap_or(0) as usize;
        let (row, a, n) = (at(c), at(c0), at(count));
        let data = &file.bytes()[w.offset as usize..][..w.n_bytes as usize];
        let mut g = ds4_gguf::GgufWriter::new();
        g.add_tensor(name, w.ty, &[count as u64, rows as u64])
            .map_err(|e| e.to_string())?;
        let bytes = g
            .to_bytes(|_, out: &mut [u8]| {
                for (i, o) in out.chunks_exact_mut(n).enumerate() {
                    o.copy_from_slice(&data[i * row + a..i * row + a + n]);
                }
                Ok::<(), ds4_gguf::GgufError>(())
            })
            .map_err(|e| format!("tensor {name}: {e}"))?;
        let part =
            Arc::new(GgufFile::from_bytes(name, bytes).map_err(|e| format!("tensor {name}: {e}"))?);
        let info = part.tensors()[0].clone();
        let dims = [count as u64, rows as u64];
        let src = WeightSrc {
            name,
            file: &part,
            ty: w.ty,
            dims: &dims,
            offset: info.offset as usize, // absolute in the in-memory file
            n_bytes: rows * n,
        };
        let r = b.matrix(&src).map_err(|e| format!("tensor {name}: {e}"))?;
        self.loaded += w.n_bytes as usize;
        (self.progress)(self.loaded, self.total);
        Ok(r)
    }
    fn weight(&mut self, b: &B, name: &str, kind: WeightKind) -> Result<B::Weight, String> {
        let (file, w) = self.bound(name)?;
        let src = WeightSrc {
            name,
            file,
            ty: w.ty,
            dims: &w.dims,
            offset: w.offset as usize,
            n_bytes: w.n_bytes as usize,
        };
        let r = match kind {
            WeightKind::Matrix => b.matrix(&src),
            WeightKind::Vector => b.vector(&src),
            WeightKind::Table => b.table(&src),
        }
        .map_err(|e| format!("tensor {name}: {e}"))?;
        self.loaded += w.n_bytes as usize;
        (self.progress)(self.loaded, self.total);
        Ok(r)
    }
    fn has(&self, name: &str) -> bool {
        self.files.iter().any(|(_, d)| d.get(name).is_some())
    }
    fn host_stack(&mut self, _b: &B, name: &str) -> Result<HostStack, String> {
        let (_, w) = self.bound(name)?;
        let [c, r, e] = w.dims[..] else {
            return Err(format!(
                "tensor {name}: dims {:?}: not an expert stack",
                w.dims
            ));
        };
        if e == 0 || !w.n_bytes.is_multiple_of(e) {
            return Err(format!(
                "tensor {name}: {} bytes do not split into {e} experts",
                w.n_bytes
            ));
        }
        let s = self.in_host_memory(name, [c, r, e])?;
        if self.prefetch_host {
            // Best effort (the experts are read on demand anyway).
            let _ = s.file.will_need(s.offset, s.n_bytes);
        }
        Ok(s)
    }
    fn host_matrix(&mut self, _b: &B, name: &str) -> Result<HostStack, String> {
        let (_, w) = self.bound(name)?;
        match w.dims[..] {
            [c, r] => self.in_host_memory(name, [c, r, 1]),
            _ => Err(format!("tensor {name}: dims {:?}: not a matrix", w.dims)),
        }
    }
}

impl FileSource<'_> {
    /// Bound tensor `name` where the mapping holds it (GGUF dims `dims`, a trailing 1 for a
    /// matrix), counted as loaded: mapped, not copied.
    fn in_host_memory(&mut self, name: &str, dims: [u64; 3]) -> Result<HostStack, String> {
        let (file, w) = self.bound(name)?;
        let s = HostStack {
            name: name.to_string(),
            file: file.clone(),
            ty: w.ty,
            dims,
            offset: w.offset as usize,
            n_bytes: w.n_bytes as usize,
        };
        self.loaded += s.n_bytes;
        (self.progress)(self.loaded, self.total);
        Ok(s)
    }
}

/// The matrix `name` in host memory, read there in place by the backend
/// (`Backend::host_matrix`), with that memory; where the backend does not (the CPU) or
/// cannot (it says why, once), the backend's own copy of it and None.
fn host_table<B: Backend>(
    b: &B,
    src: &mut dyn WeightSource<B>,
    name: &str,
) -> Result<(B::Weight, Option<HostStack>), String> {
    let st = src.host_matrix(b, name)?;
    // The one-expert stack's own source ([cols, rows, 1]).
    let placed: Result<(B::Weight, bool), String> = st.with_src(0, 1, |ws| {
        let copy = |why: Option<String>| {
            if let Some(why) = why {
                eprintln!("ds4: {name} copied to the device: {why}");
            }
            b.matrix(ws).map_err(|e| format!("tensor {name}: {e}"))
        };
        match b.host_matrix(ws) {
            Some(Ok(w)) => Ok((w, true)),
            Some(Err(e)) => Ok((copy(Some(e))?, false)),
            None => Ok((copy(None)?, false)),
        }
    });
    let (w, in_place) = placed?;
    if in_place {
        offload::HOST_TABLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok((w, in_place.then_some(st)))
}

/// Builds the model's weight structs from a [`WeightSource`].
struct Binder<'a, B: Backend> {
    src: &'a mut dyn WeightSource<B>,
    b: &'a B,
    shard: Shard,
    /// Layers whose routed experts stay in host memory.
    host: Option<&'a HostPlacement<'a>>,
    /// The indexer's rows are FP4-simulated ([`LayerDims::index_fp4`]).
    index_fp4: bool,
}

impl<B: Backend> Binder<'_, B> {
    fn m(&mut self, name: &str) -> Result<B::Weight, String> {
        self.src.weight(self.b, name, WeightKind::Matrix)
    }
    /// A routed-expert stack: this rank's experts of it (all of them on one rank).
    fn x(&mut self, hp: &HParams, name: &str) -> Result<B::Weight, String> {
        if !self.shard.is_split() {
            return self.m(name);
        }
        let (e0, count) = self.shard.experts(hp.n_expert as usize);
        self.src.experts(self.b, name, e0, count)
    }
    /// A block's routed-expert stacks: in host memory for the placement's layers (main model
    /// only), else on the backend.
    fn experts(
        &mut self,
        hp: &HParams,
        p: &str,
        kind: &LayerKind,
    ) -> Result<Experts<B::Weight>, String> {
        let names = ["gate", "up", "down"].map(|w| format!("{p}ffn_{w}_exps.weight"));
        let host = self
            .host
            .filter(|h| p.starts_with("blk.") && h.layers.contains(&(kind.index as usize)));
        let Some(h) = host else {
            return Ok(Experts::Here {
                gate: self.x(hp, &names[0])?,
                up: self.x(hp, &names[1])?,
                down: self.x(hp, &names[2])?,
            });
        };
        let stacks = Box::new([
            self.src.host_stack(self.b, &names[0])?,
            self.src.host_stack(self.b, &names[1])?,
            self.src.host_stack(self.b, &names[2])?,
        ]);
        let run = (h.make)(&stacks).map_err(|e| format!("{p} routed experts: {e}"))?;
        Ok(Experts::Host {
            run,
            stacks,
            layer: kind.index as usize,
        })
    }
    /// Rows `a .. a + count` of `name` on a tensor-parallel rank, the whole tensor otherwise.
    fn tp_rows(
        &mut self,
        name: &str,
        kind: WeightKind,
        a: usize,
        count: usize,
    ) -> Result<B::Weight, String> {
        if !self.shard.is_tp() {
            return self.src.weight(self.b, name, kind);
        }
        self.src.rows(self.b, name, kind, a, count)
    }
    /// Columns `a .. a + count` of `name` on a tensor-parallel rank, the whole tensor otherwise.
    fn tp_cols(&mut self, name: &str, a: usize, count: usize) -> Result<B::Weight, String> {
        if !self.shard.is_tp() {
            return self.m(name);
        }
        self.src.cols(self.b, name, a, count)
    }
    fn v(&mut self, name: &str) -> Result<B::Weight, String> {
        self.src.weight(self.b, name, WeightKind::Vector)
    }
    fn t(&mut self, name: &str) -> Result<B::Weight, String> {
        self.src.weight(self.b, name, WeightKind::Table)
    }
    fn has(&self, name: &str) -> bool {
        self.src.has(name)
    }
    fn hc(&mut self, p: &str, which: &str) -> Result<Hc<B::Weight>, String> {
        Ok(Hc {
            mixer: self.m(&format!("{p}{which}_fn.weight"))?,
            scale: self.v(&format!("{p}{which}_scale.weight"))?,
            base: self.v(&format!("{p}{which}_base.weight"))?,
        })
    }
    fn comp(&mut self, p: &str, dims: CompDims) -> Result<Comp<B::Weight>, String> {
        Ok(Comp {
            ape: self.m(&format!("{p}_ape.weight"))?,
            kv: self.m(&format!("{p}_kv.weight"))?,
            gate: self.m(&format!("{p}_gate.weight"))?,
            norm: self.v(&format!("{p}_norm.weight"))?,
            dims,
        })
    }

    /// One transformer block with name prefix `p` (`blk.7.` or `mtp.0.`).
    fn layer(
        &mut self,
        hp: &HParams,
        p: &str,
        kind: LayerKind,
    ) -> Result<Layer<B::Weight>, String> {
        let dims = layer_dims(hp, &kind, self.index_fp4);
        // The MTP block uses the last layer's clamp (every published layer has the same one).
        let l = (kind.index as usize).min(hp.swiglu_clamp.len() - 1);
        let comp = match dims.comp {
            Some(c) => Some(self.comp(&format!("{p}attn_compressor"), c)?),
            None => None,
        };
        let indexer = match dims.index {
            Some(c) => Some(Indexer {
                q_b: self.m(&format!("{p}indexer.attn_q_b.weight"))?,
                proj: self.m(&format!("{p}indexer.proj.weight"))?,
                comp: self.comp(&format!("{p}indexer_compressor"), c)?,
            }),
            None => None,
        };
        // Tensor parallelism (`ds4_backend::shard`): this rank's attention output groups
        // g0 .. g0 + gl (their heads' q_b rows, sinks and out_a rows, their out_b columns) and
        // shared-expert hidden units f0 .. f0 + fl (gate / up rows, down columns).
        let (g0, gl) = self.shard.part(hp.o_groups as usize);
        let (f0, fl) = self.shard.part(hp.n_ff_exp as usize);
        let hpg = (hp.n_head / hp.o_groups) as usize; // heads per output group
        let (hd, orank) = (hp.head_dim as usize, hp.o_lora_rank as usize);
        let (mx, vc) = (WeightKind::Matrix, WeightKind::Vector);
        Ok(Layer {
            kind,
            dims,
            hc_attn: self.hc(p, "hc_attn")?,
            attn_norm: self.v(&format!("{p}attn_norm.weight"))?,
            q_a: self.m(&format!("{p}attn_q_a.weight"))?,
            q_a_norm: self.v(&format!("{p}attn_q_a_norm.weight"))?,
            q_b: self.tp_rows(
                &format!("{p}attn_q_b.weight"),
                mx,
                g0 * hpg * hd,
                gl * hpg * hd,
            )?,
            kv: self.m(&format!("{p}attn_kv.weight"))?,
            kv_norm: self.v(&format!("{p}attn_kv_a_norm.weight"))?,
            sinks: self.tp_rows(&format!("{p}attn_sinks.weight"), vc, g0 * hpg, gl * hpg)?,
            out_a: self.tp_rows(
                &format!("{p}attn_output_a.weight"),
                mx,
                g0 * orank,
                gl * orank,
            )?,
            out_b: self.tp_cols(&format!("{p}attn_output_b.weight"), g0 * orank, gl * orank)?,
            comp,
            indexer,
            hc_ffn: self.hc(p, "hc_ffn")?,
            ffn_norm: self.v(&format!("{p}ffn_norm.weight"))?,
            router: self.m(&format!("{p}ffn_gate_inp.weight"))?,
            bias: if kind.hash_routed {
                None
            } else {
                Some(self.v(&format!("{p}exp_probs_b.bias"))?)
            },
            tid2eid: if kind.hash_routed {
                Some(self.t(&format!("{p}ffn_gate_tid2eid.weight"))?)
            } else {
                None
            },
            experts: self.experts(hp, p, &kind)?,
            gate_sh: self.tp_rows(&format!("{p}ffn_gate_shexp.weight"), mx, f0, fl)?,
            up_sh: self.tp_rows(&format!("{p}ffn_up_shexp.weight"), mx, f0, fl)?,
            down_sh: self.tp_cols(&format!("{p}ffn_down_shexp.weight"), f0, fl)?,
            clamp: hp.swiglu_clamp[l],
            clamp_sh: hp
                .swiglu_clamp_shexp
                .as_ref()
                .map_or(hp.swiglu_clamp[l], |s| s[l.min(s.len() - 1)]),
        })
    }
}

/// (type, cols, rows) of each of a layer's three stacks.
fn stack_key(stacks: &[HostStack; 3]) -> [(ds4_backend::GgmlType, usize, usize); 3] {
    stacks
        .each_ref()
        .map(|h| (h.ty, h.dims[0] as usize, h.dims[1] as usize))
}

/// The [`LayerBuffer`], holding the last host layer's experts (None: no host layers, the
/// buffer off (`offload::layer_buffer_wanted`), no expert slots on this backend (the CPU's
/// reference backend), or no device room: a note says so and batches gather as before).
fn layer_buffer<B: Backend>(
    backend: &B,
    layers: &[Layer<B::Weight>],
) -> Option<LayerBuffer<B::Weight>> {
    let (layer, stacks) = layers.iter().rev().find_map(|l| match &l.experts {
        Experts::Host { stacks, layer, .. } => Some((*layer, stacks)),
        Experts::Here { .. } => None,
    })?;
    if !offload::layer_buffer_wanted() {
        return None;
    }
    let key = stack_key(stacks);
    let mut w = Vec::with_capacity(3);
    for (st, &(ty, cols, rows)) in stacks.iter().zip(&key) {
        match backend.expert_slots(ty, cols, rows, st.experts())? {
            Ok(x) => w.push(x),
            Err(e) => {
                eprintln!(
                    "ds4: no device room for a host layer's experts ({e}): prompts gather the \
                     experts they select instead"
                );
                return None;
            }
        }
    }
    let w: [B::Weight; 3] = w.try_into().ok()?;
    let mut lb = LayerBuffer {
        w,
        key,
        holds: usize::MAX,
        pending: false,
    };
    fill_buffer(backend, &mut lb, layer, stacks, false);
    Some(lb)
}

/// Queues the copies of `layer`'s whole stacks into the layer buffer: beside the ops issued
/// next (`aside`: `Backend::prefetch_experts`, awaited before the layer's MoE), or in order.
fn fill_buffer<B: Backend>(
    b: &B,
    lb: &mut LayerBuffer<B::Weight>,
    layer: usize,
    stacks: &[HostStack; 3],
    aside: bool,
) {
    for (st, w) in stacks.iter().zip(&lb.w) {
        let slabs: Vec<&[u8]> = (0..st.experts()).map(|e| st.expert(e)).collect();
        match aside {
            true => b.prefetch_experts(w, &slabs),
            false => b.gather_experts(w, &slabs),
        }
    }
    lb.holds = layer;
    lb.pending = aside;
    if aside {
        offload::LAYER_PREFETCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether batches gather host-memory experts onto the device (`offload::Gather`; `host` None:
/// no host placement). Where wanted, the stacks are page-locked for DMA (which also makes the
/// grouped uploads, where slots could not be made, direct copies); `auto` gathers only where
/// that worked.
fn lock_host_experts<B: Backend>(
    backend: &B,
    layers: &[Layer<B::Weight>],
    host: Option<&HostPlacement>,
) -> bool {
    let Some(h) = host.filter(|h| h.gather != offload::Gather::Host) else {
        return false;
    };
    let mode = h.gather;
    let stacks: Vec<&HostStack> = (layers.iter())
        .filter_map(|l| match &l.experts {
            Experts::Host { stacks, .. } => Some(stacks.iter()),
            Experts::Here { .. } => None,
        })
        .flatten()
        .collect();
    // Only a mapped file's pages can need new memory to lock (generated stacks are this
    // process's memory, resident already).
    let mapped: usize = (stacks.iter())
        .filter(|st| st.file.is_mapped())
        .map(|st| st.n_bytes)
        .sum();
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    if let Some(budget) = offload::lock_budget() {
        if mode == offload::Gather::Auto && mapped > budget {
            eprintln!(
                "ds4: host-memory experts not page-locked: {:.1} GiB of the file is more than \
                 available memory allows ({:.1} GiB); batches under {} tokens run them on the \
                 host's cores, larger ones upload them in groups (DS4_HOST_EXPERTS_DECODE=gpu \
                 gathers them through staging instead)",
                gib(mapped),
                gib(budget),
                h.upload_min
            );
            return false;
        }
    }
    if mapped > 8 << 30 {
        // Locking reads in what the page cache does not hold yet.
        eprintln!(
            "ds4: page-locking {:.1} GiB of host-memory experts (pages not cached yet are read \
             from the file first)",
            gib(mapped)
        );
    }
    let t = std::time::Instant::now();
    let ranges: Vec<&[u8]> = stacks.iter().map(|st| st.bytes()).collect();
    let locked = backend.register_host(&ranges);
    if locked > 0 {
        eprintln!(
            "ds4: {:.2} GiB of host-memory experts page-locked in {:.1} s: each batch copies \
             the ones it selects to the device by DMA",
            gib(locked as usize),
            t.elapsed().as_secs_f64()
        );
    }
    mode == offload::Gather::Gpu || locked > 0
}

/// Whether `n` ranks can also split this model's attention output groups and shared expert
/// (tensor parallelism, `ds4_backend::Shard::tp_fits`): `out_b_block` / `down_block` are the
/// quant block sizes of the `out_b` / shared `down` tensors (their column parts must be whole
/// blocks).
pub fn tp_fits(hp: &HParams, n: usize, out_b_block: usize, down_block: usize) -> bool {
    Shard::tp_fits(
        n,
        hp.o_groups as usize,
        hp.o_lora_rank as usize,
        out_b_block,
        hp.n_ff_exp as usize,
        down_block,
    )
}

/// Whether tensor parallelism splits the tensor `name` between ranks (the parts
/// `Binder::layer` takes): an attention's `q_b`, sinks, `out_a`, `out_b` and the shared expert
/// (not the indexer's own `q_b`).
pub fn tp_splits(name: &str) -> bool {
    const SPLIT: [&str; 7] = [
        "attn_q_b.weight",
        "attn_sinks.weight",
        "attn_output_a.weight",
        "attn_output_b.weight",
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ];
    SPLIT.iter().any(|t| name.ends_with(t)) && !name.contains("indexer")
}

/// The attention-state shape of a layer; `index_fp4`: the model's indexer rows are
/// FP4-simulated (`Rounding::fp4_indexer`).
pub fn layer_dims(hp: &HParams, kind: &LayerKind, index_fp4: bool) -> LayerDims {
    let hd = hp.head_dim as usize;
    LayerDims {
        window: hp.sliding_window as usize,
        head_dim: hd,
        comp: kind.compressed().then(|| CompDims {
            ratio: kind.ratio as usize,
            coff: kind.coff() as usize,
            d: hd,
        }),
        index: kind.has_indexer().then_some(CompDims {
            ratio: 4,
            coff: 2,
            d: hp.indexer_head_dim as usize,
        }),
        index_fp4,
    }
}

/// The MTP block's layer kind: SWA only, bias-routed (model.md §3.7).
fn mtp_kind(hp: &HParams) -> LayerKind {
    LayerKind {
        index: hp.n_layer,
        ratio: 0,
        attn: AttnKind::Swa,
        hash_routed: false,
    }
}

impl<B: Backend> Model<B> {
    /// Bind every tensor of `files` (main model first, then an optional MTP file) on `backend`.
    /// `progress(bytes_done, bytes_total)` is called after each tensor.
    pub fn load(
        backend: B,
        hp: HParams,
        files: &[(Arc<GgufFile>, WeightDir)],
        rounding: Rounding,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>, String> {
        let mut src = FileSource::new(files, progress);
        Model::load_from(backend, hp, &mut src, rounding)
    }

    /// [`Model::load`] of rank `shard.rank` of an expert-parallel group: only that rank's
    /// routed experts are bound; `backend` must be that rank of its group's all-reduce.
    pub fn load_shard(
        backend: B,
        hp: HParams,
        files: &[(Arc<GgufFile>, WeightDir)],
        rounding: Rounding,
        shard: Shard,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>, String> {
        let mut src = FileSource::new(files, progress);
        Model::load_from_shard(backend, hp, &mut src, rounding, shard)
    }

    /// Build the model from any [`WeightSource`] (files, or a generator for benchmarks).
    pub fn load_from(
        backend: B,
        hp: HParams,
        src: &mut dyn WeightSource<B>,
        rounding: Rounding,
    ) -> Result<Model<B>, String> {
        Model::load_from_shard(backend, hp, src, rounding, Shard::ONE)
    }

    /// [`Model::load_from`] of one expert-parallel rank ([`Model::load_shard`]).
    pub fn load_from_shard(
        backend: B,
        hp: HParams,
        src: &mut dyn WeightSource<B>,
        rounding: Rounding,
        shard: Shard,
    ) -> Result<Model<B>, String> {
        Model::load_placed(backend, hp, src, rounding, shard, None)
    }

    /// [`Model::load_from_shard`] with the routed experts of `host`'s layers kept in host
    /// memory (`offload.rs`; one rank only).
    pub fn load_placed(
        backend: B,
        hp: HParams,
        src: &mut dyn WeightSource<B>,
        rounding: Rounding,
        shard: Shard,
        host: Option<&HostPlacement>,
    ) -> Result<Model<B>, String> {
        if host.is_some_and(|h| !h.layers.is_empty()) && shard.is_split() {
            return Err(
                "routed experts in host memory (--cpu-experts) need one rank: not with \
                 --devices"
                    .into(),
            );
        }
        if shard.n_ranks == 0 || shard.rank >= shard.n_ranks {
            return Err(format!("rank {} of {} ranks", shard.rank, shard.n_ranks));
        }
        if shard.n_ranks > hp.n_expert as usize {
            return Err(format!(
                "{} ranks for {} routed experts: at most one rank per expert",
                shard.n_ranks, hp.n_expert
            ));
        }
        if shard.is_tp() && !tp_fits(&hp, shard.n_ranks, 1, 1) {
            return Err(format!(
                "{} tensor-parallel ranks do not divide {} attention output groups and a shared \
                 expert of {} hidden units",
                shard.n_ranks, hp.o_groups, hp.n_ff_exp
            ));
        }
        let mut b = Binder {
            src,
            b: &backend,
            shard,
            host,
            index_fp4: rounding.fp4_indexer,
        };
        let mut layers = Vec::with_capacity(hp.n_layer as usize);
        for kind in hp.layers() {
            layers.push(b.layer(&hp, &format!("blk.{}.", kind.index), kind)?);
        }
        let mtp = if b.has("mtp.0.e_proj.weight") {
            Some(Mtp {
                block: b.layer(&hp, "mtp.0.", mtp_kind(&hp))?,
                e_proj: b.m("mtp.0.e_proj.weight")?,
                h_proj: b.m("mtp.0.h_proj.weight")?,
                enorm: b.v("mtp.0.enorm.weight")?,
                hnorm: b.v("mtp.0.hnorm.weight")?,
                norm: b.v("mtp.0.norm.weight")?,
                head: b.hc("mtp.0.", "hc_head")?,
            })
        } else {
            None
        };
        let host_gather = lock_host_experts(&backend, &layers, host);
        let layer_buf = std::sync::Mutex::new(layer_buffer(&backend, &layers));
        // With host layers the embedding table stays in host memory too, read in place
        // (`offload::HOST_TABLE`); elsewhere, or where the backend cannot, it is copied.
        let (embd, embd_host) =
            match host.is_some_and(|h| !h.layers.is_empty()) && offload::host_table_wanted() {
                true => host_table(&backend, &mut *b.src, offload::HOST_TABLE)?,
                false => (b.m(offload::HOST_TABLE)?, None),
            };
        let out_hc = Hc {
            mixer: b.m("output_hc_fn.weight")?,
            scale: b.v("output_hc_scale.weight")?,
            base: b.v("output_hc_base.weight")?,
        };
        let out_norm = b.v("output_norm.weight")?;
        let output = b.m("output.weight")?;
        Ok(Model {
            hp,
            rounding,
            backend,
            shard,
            embd_host,
            embd,
            out_hc,
            out_norm,
            output,
            layers,
            mtp,
            host_batch: host.map_or((UPLOAD_MIN, GROUP), |h| (h.upload_min, h.group)),
            host_gather,
            slots: std::sync::Mutex::new(None),
            layer_buf,
        })
    }

    /// Bytes of the embedding table read from host memory in place (`offload::HOST_TABLE`;
    /// 0: the backend holds its own copy).
    pub fn host_table_bytes(&self) -> usize {
        self.embd_host.as_ref().map_or(0, |t| t.n_bytes)
    }

    /// The host layer whose experts the layer buffer holds now (`LayerBuffer`; tests).
    pub fn buffered_host_layer(&self) -> Option<usize> {
        let g = self.layer_buf.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map(|lb| lb.holds)
    }

    /// Host layers after `after` (all: None) whose stacks have the layer buffer's shapes, in
    /// order.
    fn buffered_layers(
        &self,
        key: &[(ds4_backend::GgmlType, usize, usize); 3],
        after: Option<usize>,
    ) -> impl Iterator<Item = (usize, &[HostStack; 3])> + '_ {
        let key = *key;
        self.layers.iter().filter_map(move |l| match &l.experts {
            Experts::Host { stacks, layer, .. }
                if after.is_none_or(|a| *layer > a) && stack_key(stacks) == key =>
            {
                Some((*layer, stacks.as_ref()))
            }
            _ => None,
        })
    }

    /// A prompt batch of `n` tokens: the layer buffer starts filling with the first host layer
    /// (see [`LayerBuffer`]).
    fn prefetch_first(&self, n: usize) {
        if n < offload::prefetch_min() {
            return;
        }
        let mut g = self.layer_buf.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lb) = g.as_mut() else { return };
        if let Some((first, stacks)) = self.buffered_layers(&lb.key, None).next() {
            if lb.holds != first {
                fill_buffer(&self.backend, lb, first, stacks, true);
            }
        }
    }

    /// Host layer `layer`'s routed experts from the layer buffer where it holds them (waiting
    /// for its copies if still in flight), with no host read: the backend's MoE over the whole
    /// stacks, as resident experts. Then, in a batch of [`offload::prefetch_min`] tokens or
    /// more, the next host layer's copies start. None: the buffer holds another layer.
    #[allow(clippy::too_many_arguments)]
    fn moe_buffered(
        &self,
        layer: usize,
        spec: &MoeSpec,
        z: &B::Buf,
        sel: &B::IBuf,
        wgt: &B::Buf,
        n: usize,
    ) -> Option<B::Buf> {
        let b = &self.backend;
        let mut g = self.layer_buf.lock().unwrap_or_else(|e| e.into_inner());
        let lb = g.as_mut().filter(|lb| lb.holds == layer)?;
        if lb.pending {
            b.await_experts();
            lb.pending = false;
        }
        let mut out = b.alloc(n * spec.d);
        b.moe_experts(spec, &lb.w[0], &lb.w[1], &lb.w[2], z, sel, wgt, n, &mut out);
        offload::BUFFERED_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n >= offload::prefetch_min() {
            // The copies wait for the MoE just issued (the buffer's readers).
            if let Some((next, stacks)) = self.buffered_layers(&lb.key, Some(layer)).next() {
                fill_buffer(b, lb, next, stacks, true);
            }
        }
        Some(out)
    }

    /// Whether batches copy their selected host-memory experts to the backend
    /// (`offload::Gather`; the stacks page-locked at load, or the gather forced).
    pub fn gathers_host_experts(&self) -> bool {
        self.host_gather
    }

    /// Main-model layers whose routed experts are in host memory.
    pub fn host_expert_layers(&self) -> Vec<usize> {
        (self.layers.iter().enumerate())
            .filter(|(_, l)| matches!(l.experts, Experts::Host { .. }))
            .map(|(i, _)| i)
            .collect()
    }

    fn hc_dims(&self) -> HcDims {
        HcDims {
            n: self.hp.hc_count as usize,
            d: self.hp.n_embd as usize,
            sinkhorn_iters: self.hp.hc_sinkhorn_iters as usize,
            eps: self.hp.hc_eps,
        }
    }

    /// Attention-state shape of every main layer.
    pub fn layer_dims(&self) -> Vec<LayerDims> {
        self.layers.iter().map(|l| l.dims).collect()
    }

    /// Attention-state shape of the MTP block.
    pub fn mtp_dims(&self) -> LayerDims {
        layer_dims(&self.hp, &mtp_kind(&self.hp), self.rounding.fp4_indexer)
    }

    /// A fresh session state.
    pub fn new_state(&self) -> State<B> {
        State {
            tokens: Vec::new(),
            layers: self
                .layers
                .iter()
                .map(|l| self.backend.new_layer_state(&l.dims))
                .collect(),
        }
    }

    pub fn checkpoint(&self, st: &State<B>) -> Checkpoint<B> {
        Checkpoint {
            n_tokens: st.tokens.len(),
            marks: self.backend.mark_all(&st.layers),
        }
    }

    /// A checkpoint taken before a batch whose last token sits at `pos`: rolling back to it
    /// drops that token alone and keeps the batch's others (a rejected speculative draft, with
    /// no re-evaluation of the token before it). None where the backend has no such marks:
    /// then [`Model::checkpoint`].
    pub fn checkpoint_last(&self, st: &State<B>, pos: usize) -> Option<Checkpoint<B>> {
        self.slot_checkpoint(&st.layers, pos)
    }

    fn slot_checkpoint(&self, layers: &[B::LayerState], pos: usize) -> Option<Checkpoint<B>> {
        let slots: Vec<_> = self
            .layers
            .iter()
            .map(|l| ds4_backend::TokenSlots::of(&l.dims, pos))
            .collect();
        Some(Checkpoint {
            n_tokens: pos,
            marks: self.backend.mark_slots_all(layers, &slots)?,
        })
    }

    pub fn rollback(&self, st: &mut State<B>, cp: Checkpoint<B>) {
        st.tokens.truncate(cp.n_tokens);
        self.backend.rollback_all(&mut st.layers, cp.marks);
    }

    pub fn to_host(&self, st: &State<B>) -> HostState {
        HostState {
            tokens: st.tokens.clone(),
            layers: st
                .layers
                .iter()
                .map(|l| self.backend.state_to_host(l))
                .collect(),
        }
    }

    /// Tell the backend `st` holds at most `ctx` tokens ([`Backend::bound_state`]).
    pub fn bound(&self, st: &mut State<B>, ctx: usize) {
        for l in st.layers.iter_mut() {
            self.backend.bound_state(l, ctx);
        }
    }

    /// `h` must have this model's shapes (snapshot readers validate before).
    pub fn from_host(&self, h: &HostState) -> State<B> {
        State {
            tokens: h.tokens.clone(),
            layers: self
                .layers
                .iter()
                .zip(&h.layers)
                .map(|(l, hl)| self.backend.state_from_host(&l.dims, hl))
                .collect(),
        }
    }

    /// Process one token at the next position; returns the logits after it.
    pub fn eval(&self, st: &mut State<B>, token: u32) -> Result<Vec<f32>, String> {
        Ok(self
            .eval_batch(st, &[token], false)?
            .pop()
            .unwrap_or_default())
    }

    /// Process `tokens` at the next positions as one batch; the logits after every position
    /// (`all`) or after the last one. On the CPU every number is bit-identical to evaluating
    /// the tokens one at a time.
    pub fn eval_batch(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<Vec<f32>>, String> {
        Ok(self.eval_batch_streams(st, tokens, all, false)?.0)
    }

    /// [`Model::eval_batch`] that also returns (when `streams`) the final hyper-connection
    /// streams (N·D values, before the head) of the same positions — the MTP block's input.
    /// An error is the backend's (device out of memory, a failed launch); the state is then
    /// undefined and must be rebuilt.
    pub fn eval_batch_streams(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        all: bool,
        streams: bool,
    ) -> Result<Evaluated, String> {
        let b = &self.backend;
        let n = tokens.len();
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let (xs, m) = self.layers_forward(st, tokens, all);
        let logits = self.head(&self.out_hc, &self.out_norm, &xs, m);
        let streams = self.host_streams(&xs, m, streams);
        b.graph_end();
        b.check()?;
        Ok((logits, streams))
    }

    /// The final streams of `m` positions on the host, one N·D row each (none unless `want`).
    fn host_streams(&self, xs: &B::Buf, m: usize, want: bool) -> Vec<Vec<f32>> {
        if !want {
            return Vec::new();
        }
        let w = self.hc_dims().n * self.hc_dims().d;
        let v = self.backend.download(xs, m * w);
        v.chunks(w).map(|c| c.to_vec()).collect()
    }

    /// Process one token at the next position and pick the token after it with
    /// [`Backend::sample`] (draw `u`): only the id leaves the device, inside the step's graph.
    /// The same pick as [`ds4_backend::sample::select`] on [`Model::eval`]'s logits.
    pub fn eval_sample(
        &self,
        st: &mut State<B>,
        token: u32,
        p: &ds4_backend::SampleParams,
        u: f64,
    ) -> Result<u32, String> {
        let b = &self.backend;
        let (xs, _) = self.layers_forward(st, &[token], false);
        let logits = self.head_logits(&self.out_hc, &self.out_norm, &xs, 1);
        let id = b.sample(&logits, self.hp.n_vocab as usize, p, u);
        b.graph_end();
        b.check()?;
        Ok(id)
    }

    /// Process `tokens` at the next positions as one batch and pick the token after each
    /// position r with [`Backend::sample_rows`] (draw `draws[r]`; one per token): only the ids
    /// leave the device (a speculative step's verify), with the final streams of every position
    /// when `streams`. The picks are [`ds4_backend::sample::select`]'s on
    /// [`Model::eval_batch`]'s logits of all positions.
    pub fn eval_pick(
        &self,
        st: &mut State<B>,
        tokens: &[u32],
        p: &ds4_backend::SampleParams,
        draws: &[f64],
        streams: bool,
    ) -> Result<Picked, String> {
        let b = &self.backend;
        let n = tokens.len();
        if n == 0 || draws.len() != n {
            return Err(format!("eval_pick: {n} tokens but {} draws", draws.len()));
        }
        let (xs, m) = self.layers_forward(st, tokens, true);
        let logits = self.head_logits(&self.out_hc, &self.out_norm, &xs, m);
        let ids = b.sample_rows(&logits, self.hp.n_vocab as usize, p, draws);
        let streams = self.host_streams(&xs, m, streams);
        b.graph_end();
        b.check()?;
        Ok((ids, streams))
    }

    /// Embedding and every layer over `tokens` (n ≥ 1) at the next positions, as one step that
    /// a device may record (ends at the first host read): the final streams `[m, N, D]` of every
    /// position (`all`, m = n) or of the last (m = 1).
    fn layers_forward(&self, st: &mut State<B>, tokens: &[u32], all: bool) -> (B::Buf, usize) {
        let b = &self.backend;
        let hc = self.hc_dims();
        let w = hc.n * hc.d;
        let n = tokens.len();
        let t0 = st.tokens.len();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        // A prompt batch's first host layer starts crossing the bus now (`LayerBuffer`).
        self.prefetch_first(n);
        // Decode steps may run as one device graph (ends at the logits' download).
        b.graph_begin(n);
        let tok = b.upload_i32(&ids);
        let mut x = b.alloc(n * w);
        b.embed(&self.embd, &tok, n, hc.n, hc.d, &mut x);
        let mut pending = None;
        for (layer, ls) in self.layers.iter().zip(st.layers.iter_mut()) {
            pending = Some(self.layer_forward(layer, ls, &mut x, &tok, n, t0, pending));
        }
        if let Some((y, post, comb)) = pending {
            b.hc_post(hc, &mut x, &y, &post, &comb, n);
        }
        st.tokens.extend_from_slice(tokens);
        let first = if all { 0 } else { n - 1 };
        let m = n - first;
        let mut xs = b.alloc(m * w);
        b.copy(&x, first * w, &mut xs, 0, m * w);
        (xs, m)
    }

    /// One transformer block over the batch: HC pre, attention, HC post, HC pre, MoE. The MoE
    /// output's HC post is returned as `(y, post, comb)` for the caller to apply — fused with the
    /// next block's HC pre when `pending` hands it to that block, else by [`Backend::hc_post`].
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: &Layer<B::Weight>,
        st: &mut B::LayerState,
        x: &mut B::Buf,
        tok: &B::IBuf,
        n: usize,
        t0: usize,
        pending: Option<Pending<B>>,
    ) -> Pending<B> {
        // Prefetch hints (`Backend::prefetch`), each issued after the last weight product
        // before ops that read little memory: here the HC ops, then the query's products.
        self.backend.prefetch(&[&l.q_a, &l.kv, &l.q_b], n);
        let (z, post, comb) = match pending {
            Some((y, p, c)) => self.hc_post_pre(&l.hc_attn, &l.attn_norm, x, &y, &p, &c, n),
            None => self.hc_pre(&l.hc_attn, &l.attn_norm, x, n),
        };
        let o = self.attention(l, st, &z, n, t0);
        let (z, post, comb) = self.hc_post_pre(&l.hc_ffn, &l.ffn_norm, x, &o, &post, &comb, n);
        let y = self.moe(l, &z, tok, n);
        (y, post, comb)
    }

    /// [`Backend::hc_post`] of `o` into `x`, then the HC pre of the next sublayer (`hc_pre`).
    #[allow(clippy::too_many_arguments)]
    fn hc_post_pre(
        &self,
        h: &Hc<B::Weight>,
        norm: &B::Weight,
        x: &mut B::Buf,
        o: &B::Buf,
        post_in: &B::Buf,
        comb_in: &B::Buf,
        n: usize,
    ) -> (B::Buf, B::Buf, B::Buf) {
        let b = &self.backend;
        let hc = self.hc_dims();
        let mut z = b.alloc(n * hc.d);
        let mut post = b.alloc(n * hc.n);
        let mut comb = b.alloc(n * hc.n * hc.n);
        b.hc_post_pre_norm(
            hc,
            x,
            o,
            post_in,
            comb_in,
            &h.mixer,
            &h.scale,
            &h.base,
            norm,
            n,
            self.hp.rms_eps,
            &mut z,
            &mut post,
            &mut comb,
        );
        (z, post, comb)
    }

    /// HC split + collapse + the sublayer's input norm (model.md §3.1):
    /// `(z [n, D], post [n, N], comb [n, N·N])`.
    fn hc_pre(
        &self,
        h: &Hc<B::Weight>,
        norm: &B::Weight,
        x: &B::Buf,
        n: usize,
    ) -> (B::Buf, B::Buf, B::Buf) {
        let b = &self.backend;
        let hc = self.hc_dims();
        let mut z = b.alloc(n * hc.d);
        let mut post = b.alloc(n * hc.n);
        let mut comb = b.alloc(n * hc.n * hc.n);
        b.hc_pre_norm(
            hc,
            &h.mixer,
            &h.scale,
            &h.base,
            norm,
            x,
            n,
            self.hp.rms_eps,
            &mut z,
            &mut post,
            &mut comb,
        );
        (z, post, comb)
    }

    fn rope_kind(kind: &LayerKind) -> RopeKind {
        if kind.attn == AttnKind::Swa {
            RopeKind::Swa
        } else {
            RopeKind::Comp
        }
    }

    /// Attention sublayer for `n` tokens at positions `t0 ..` (model.md §3.3).
    fn attention(
        &self,
        l: &Layer<B::Weight>,
        st: &mut B::LayerState,
        z: &B::Buf,
        n: usize,
        t0: usize,
    ) -> B::Buf {
        let b = &self.backend;
        let hp = &self.hp;
        let rnd = self.rounding;
        let eps = hp.rms_eps;
        let d = hp.n_embd as usize;
        let hd = hp.head_dim as usize;
        // A tensor-parallel rank runs its output groups' heads only (`Binder::layer`).
        let groups = self.shard.part(hp.o_groups as usize).1;
        let nh = hp.n_head as usize / hp.o_groups as usize * groups;
        let n_rot = hp.n_rot as usize;
        let rank = hp.q_lora_rank as usize;
        let rope = Self::rope_kind(&l.kind);
        // The query's low-rank product and the KV row's product both read z: one multi-product.
        let mut cq = b.alloc(n * rank);
        let mut kv = b.alloc(n * hd);
        b.matmul_multi(&[&l.q_a, &l.kv], z, n, &mut [&mut cq, &mut kv]);
        let kv_round = RowRounding {
            fp8_nope: if rnd.fp8_kv { hd - n_rot } else { 0 },
            fp4_hadamard: false,
            f16: rnd.f16_cache,
        };
        // Two independent pieces until the indexer's selection (`Backend::side_begin`): the
        // compressors (side branch: their projections read z, their rows go to the state) and
        // the query path (main branch: q_b, norms and RoPE of q and kv, the indexer's query,
        // which reads the normed cq). Compressors first in issue order: a row closed by token t
        // is visible to t.
        let mut ws: Vec<&B::Weight> = Vec::new();
        let mut outs: Vec<B::Buf> = Vec::new();
        for c in l.comp.iter().chain(l.indexer.as_ref().map(|ix| &ix.comp)) {
            let w = c.dims.width();
            ws.extend([&c.kv, &c.gate]);
            outs.extend([b.alloc(n * w), b.alloc(n * w)]);
        }
        let mut iw = None;
        let branch = !ws.is_empty();
        if branch {
            b.side_begin();
            if let Some(ix) = &l.indexer {
                ws.push(&ix.proj);
                outs.push(b.alloc(n * hp.indexer_heads as usize));
            }
            // Their projections (kv, gate) and the indexer's weights projection all read z:
            // one multi-product.
            let mut refs: Vec<&mut B::Buf> = outs.iter_mut().collect();
            b.matmul_multi(&ws, z, n, &mut refs);
            let mut outs = outs.into_iter(); // in push order: (kv, gate) per compressor, then proj
            if let Some(c) = &l.comp {
                let (a, g) = (outs.next().unwrap(), outs.next().unwrap());
                let spec = CompressSpec {
                    dims: c.dims,
                    rope,
                    n_rot,
                    round: kv_round,
                    eps,
                };
                b.compress(st, Which::Attn, &spec, &c.ape, &c.norm, &a, &g, n, t0);
            }
            if let Some(ix) = &l.indexer {
                let (a, g) = (outs.next().unwrap(), outs.next().unwrap());
                let spec = CompressSpec {
                    dims: ix.comp.dims,
                    rope,
                    n_rot,
                    round: RowRounding {
                        fp8_nope: 0,
                        fp4_hadamard: rnd.fp4_indexer,
                        f16: rnd.f16_cache,
                    },
                    eps,
                };
                b.compress(
                    st,
                    Which::Index,
                    &spec,
                    &ix.comp.ape,
                    &ix.comp.norm,
                    &a,
                    &g,
                    n,
                    t0,
                );
                iw = outs.next();
            }
            b.side_end();
        }
        let spec = AttnSpec {
            n_head: nh,
            head_dim: hd,
            n_rot,
            window: hp.sliding_window as usize,
            ratio: l.dims.comp.map_or(0, |c| c.ratio),
            top_k: if l.indexer.is_some() {
                hp.indexer_top_k as usize
            } else {
                0
            },
            rope,
        };
        // Query: low rank, norm, expand, per-head unweighted norm, RoPE.
        let mut q = b.alloc(n * nh * hd);
        b.rms_norm_matmul(&mut cq, n, rank, Some(&l.q_a_norm), eps, &l.q_b, &mut q);
        // Norms, RoPE, the indexer's selection and the attention, then the output products.
        match &l.indexer {
            Some(ix) => b.prefetch(&[&ix.q_b, &l.out_a], n),
            None => b.prefetch(&[&l.out_a], n),
        }
        // The query heads (unweighted) and the shared KV row of each position (kv_norm,
        // rounded as the cache stores it): one norm_rope_pair, or the KV row alone where the
        // attention norms and rotates the raw queries itself (`Backend::attend_qnorm`).
        let kvn = Some(&l.kv_norm);
        let q_raw = b.attend_norms_q(&spec, n);
        if q_raw {
            b.norm_rope(&mut kv, n, 1, hd, kvn, eps, n_rot, t0, rope, Some(kv_round));
        } else {
            b.norm_rope_pair(
                &mut q,
                nh,
                None,
                None,
                &mut kv,
                1,
                kvn,
                Some(kv_round),
                n,
                hd,
                eps,
                n_rot,
                t0,
                rope,
            );
        }
        let iq = l.indexer.as_ref().map(|ix| {
            let inh = hp.indexer_heads as usize;
            let ihd = hp.indexer_head_dim as usize;
            let mut iq = b.alloc(n * inh * ihd);
            b.matmul(&ix.q_b, Part::All, &cq, n, &mut iq);
            iq
        });
        if branch {
            b.join();
        }
        let sel = iq.as_ref().zip(iw.as_ref()).map(|(iq, iw)| {
            let spec = IndexSpec {
                heads: hp.indexer_heads as usize,
                head_dim: hp.indexer_head_dim as usize,
                top_k: hp.indexer_top_k as usize,
                ratio: l.kind.ratio as usize,
                n_rot,
                rope,
                fp4: rnd.fp4_indexer,
            };
            let mut sel = b.alloc_i32(n * spec.top_k);
            b.index_select(st, &spec, iq, iw, n, t0, &mut sel);
            sel
        });
        // The attention and the grouped low-rank output projection (one op: the backend may
        // hand the attention's output to the product in the product's operand format), then
        // the dense one.
        let mut u = b.alloc(n * groups * hp.o_lora_rank as usize);
        b.attend_project(
            st,
            &spec,
            &q,
            q_raw.then_some(eps),
            &kv,
            &l.sinks,
            sel.as_ref(),
            n,
            t0,
            &l.out_a,
            groups,
            &mut u,
        );
        let mut out = b.alloc(n * d);
        b.matmul(&l.out_b, Part::All, &u, n, &mut out);
        // The HC ops, then the router and the shared expert (the routed experts are known
        // only after the route).
        b.prefetch(&[&l.router, &l.gate_sh, &l.up_sh, &l.down_sh], n);
        if self.shard.is_tp() {
            b.all_reduce_sum(&mut out, n * d); // the ranks' groups' partial products
        }
        out
    }

    /// MoE sublayer (model.md §3.4): routed experts summed in selection order, then the shared
    /// expert.
    fn moe(&self, l: &Layer<B::Weight>, z: &B::Buf, tok: &B::IBuf, n: usize) -> B::Buf {
        let b = &self.backend;
        let hp = &self.hp;
        let spec = MoeSpec {
            n_expert: hp.n_expert as usize,
            n_used: hp.n_expert_used as usize,
            d: hp.n_embd as usize,
            ff: hp.n_ff_exp as usize,
            weight_scale: hp.expert_weights_scale,
            clamp: l.clamp,
        };
        // Expert parallelism: this rank sums the routed experts it holds (localized
        // selections), rank 0 adds the shared expert (with TP every rank its part of it), and
        // the ranks' sums are added (`Backend::all_reduce_sum`).
        let split = self.shard.is_split();
        // Tensor parallel: every rank adds its part of the shared expert (hidden units ff_sh).
        let shared = self.shard.rank == 0 || self.shard.is_tp();
        let ff_sh = self.shard.part(spec.ff).1;
        // The shared expert's gate/up reads only z (side branch, `Backend::side_begin`); the
        // router and the routed experts (main branch) too; the shared down product adds into
        // the routed sum after the join.
        let mut g = None;
        if shared {
            b.side_begin();
            let mut gs = b.alloc(n * ff_sh);
            b.matmul_gateup(&l.gate_sh, &l.up_sh, z, n, ff_sh, &mut gs, l.clamp_sh);
            b.side_end();
            g = Some(gs);
        }
        let mut logits = b.alloc(n * spec.n_expert);
        let mut sel = b.alloc_i32(n * spec.n_used);
        let mut wgt = b.alloc(n * spec.n_used);
        // The router's product and the route: one launch on the GPU at n = 1.
        b.matmul_route(
            &spec,
            &l.router,
            z,
            n,
            &mut logits,
            l.bias.as_ref(),
            l.tid2eid.as_ref(),
            tok,
            &mut sel,
            &mut wgt,
        );
        let mut xspec = spec;
        if split {
            let (e0, count) = self.shard.experts(spec.n_expert);
            b.moe_localize(&mut sel, &mut wgt, n, spec.n_used, e0, count);
            xspec.n_expert = count;
        }
        let mut out = match &l.experts {
            Experts::Here { gate, up, down } => {
                let mut out = b.alloc(n * spec.d);
                b.moe_experts(&xspec, gate, up, down, z, &sel, &wgt, n, &mut out);
                out
            }
            Experts::Host { run, stacks, layer } => {
                match (!split).then(|| self.moe_buffered(*layer, &xspec, z, &sel, &wgt, n)) {
                    Some(Some(out)) => out,
                    _ => self.moe_host(run.as_ref(), stacks, &xspec, z, &sel, &wgt, n),
                }
            }
        };
        if let Some(g) = g {
            b.join();
            b.matmul_add(&l.down_sh, &g, n, spec.d, &mut out);
        }
        if split {
            b.all_reduce_sum(&mut out, n * spec.d);
        }
        out
    }

    /// Routed experts held in host memory (`offload.rs`): decode steps gather their selected
    /// experts into device slots (`moe_gather`) where the backend has them; other small
    /// batches run on the host; larger ones upload the selected experts a group at a time.
    #[allow(clippy::too_many_arguments)]
    fn moe_host(
        &self,
        run: &dyn HostExperts,
        stacks: &[HostStack; 3],
        spec: &MoeSpec,
        z: &B::Buf,
        sel: &B::IBuf,
        wgt: &B::Buf,
        n: usize,
    ) -> B::Buf {
        let b = &self.backend;
        let (k, d) = (spec.n_used, spec.d);
        // Host reads: a recorded decode step ends here (the rest of it runs eagerly).
        let s = b.download_i32(sel, n * k);
        if let Some(out) = self.moe_gather(stacks, spec, z, &s, wgt, n) {
            return out;
        }
        let w = b.download(wgt, n * k);
        let (upload_min, group) = self.host_batch;
        if n < upload_min {
            let zh = b.download(z, n * d);
            return b.upload(&run.run(spec, &zh, &s, &w, n));
        }
        // The gather's slots' room is the groups' (see `slots`).
        *self.slots.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let mut out = b.upload(&vec![0f32; n * d]);
        for (e0, count, gs, gw) in offload::groups(&s, &w, k, spec.n_expert, group) {
            let bind = |i: usize| stacks[i].with_src(e0, count, |src| b.matrix(src));
            let (g, u, dn) = match (bind(0), bind(1), bind(2)) {
                (Ok(g), Ok(u), Ok(dn)) => (g, u, dn),
                // Binding failed (device memory ran short): this group on the host instead
                // (a device backend that failed reports it at the step's check).
                _ => {
                    let zh = b.download(z, n * d);
                    let global: Vec<i32> = gs.iter().map(|&e| e + e0 as i32).collect();
                    let o = run.run(spec, &zh, &global, &gw, n);
                    b.add(&mut out, &b.upload(&o), n * d);
                    continue;
                }
            };
            let gspec = MoeSpec {
                n_expert: count,
                ..*spec
            };
            offload::UPLOADED_GROUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut part = b.alloc(n * d);
            let (si, wi) = (b.upload_i32(&gs), b.upload(&gw));
            b.moe_experts(&gspec, &g, &u, &dn, z, &si, &wi, n, &mut part);
            b.add(&mut out, &part, n * d);
        }
        out
    }

    /// A batch's host-memory experts on the backend (every batch, decode steps and prompts,
    /// where the gather is on): the experts that `sel` (host copy `s`) names, gathered into the
    /// device slots in order of first use, then the backend's MoE over those slots (the same
    /// kernels and sums as resident experts). More experts than slots: in rounds of a slots'
    /// fill (`offload::rounds`), each round's MoE with the other rounds' slots weighted 0 (the
    /// GPU's prompt MoE drops such pairs), the rounds' sums added (f32 order as between
    /// expert-parallel ranks). Session 45 (H100, full-size q2, bench/results/gpu-s45-h100.txt):
    /// faster than the grouped uploads at every batch size tried (16 host layers: 2k prompt
    /// 2,414-2,435 against 2,036-2,041 tok/s, 512-token batches 1,112 against 628) and than the
    /// host's cores for 8-16-token batches (135-201 against 108-144). None: not this path (the
    /// gather off: `offload::Gather`, or the stacks not page-locked; no slots on this backend).
    fn moe_gather(
        &self,
        stacks: &[HostStack; 3],
        spec: &MoeSpec,
        z: &B::Buf,
        s: &[i32],
        wgt: &B::Buf,
        n: usize,
    ) -> Option<B::Buf> {
        let b = &self.backend;
        if !self.host_gather {
            return None;
        }
        let key = stack_key(stacks);
        let cap = offload::gather_slots(spec.n_used);
        let mut guard = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|s| s.key != key || s.cap != cap) {
            *guard = None; // the old slots go before the new ones are made
            let make = |i: usize| {
                let (ty, cols, rows) = key[i];
                b.expert_slots(ty, cols, rows, cap)?.ok()
            };
            let w = match (make(0), make(1), make(2)) {
                (Some(g), Some(u), Some(dn)) => Some([g, u, dn]),
                _ => None, // no slots (CPU) or no room: the host path, from now on
            };
            *guard = Some(Slots { key, cap, w });
        }
        let slots = guard.as_ref()?.w.as_ref()?;
        // Selections are this stack's experts (`moe_localize` points other ranks' slots at a
        // held one); anything else goes to the host path, which says what is wrong.
        if s.iter()
            .any(|&e| e < 0 || e as usize >= stacks[0].experts())
        {
            return None;
        }
        // One round needs no weights on the host (the router's stay on the device); several
        // mask theirs there (`rounds` then asks for them).
        let k = spec.n_used;
        let rounds = match offload::rounds(s, None, k, cap) {
            Ok(r) => r,
            Err(_) => offload::rounds(s, Some(&b.download(wgt, n * k)), k, cap).ok()?,
        };
        let gspec = MoeSpec {
            n_expert: cap,
            ..*spec
        };
        let mut out: Option<B::Buf> = None;
        for r in &rounds {
            for (st, w) in stacks.iter().zip(slots) {
                let srcs: Vec<&[u8]> = r.experts.iter().map(|&e| st.expert(e as usize)).collect();
                b.gather_experts(w, &srcs);
            }
            let si = b.upload_i32(&r.sel);
            let wi = r.wgt.as_ref().map(|w| b.upload(w));
            let mut part = b.alloc(n * spec.d);
            b.moe_experts(
                &gspec,
                &slots[0],
                &slots[1],
                &slots[2],
                z,
                &si,
                wi.as_ref().unwrap_or(wgt),
                n,
                &mut part,
            );
            match &mut out {
                None => out = Some(part),
                Some(o) => b.add(o, &part, n * spec.d),
            }
            offload::GATHER_ROUNDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        offload::GATHERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        out
    }

    /// Output head (model.md §3.5) for `m` rows of streams `xs` (`[m, N, D]`).
    fn head(&self, h: &Hc<B::Weight>, norm: &B::Weight, xs: &B::Buf, m: usize) -> Vec<Vec<f32>> {
        let vocab = self.hp.n_vocab as usize;
        self.backend
            .download(&self.head_logits(h, norm, xs, m), m * vocab)
            .chunks(vocab)
            .map(|c| c.to_vec())
            .collect()
    }

    /// [`Model::head`]'s logits `[m, vocab]`, left on the backend.
    fn head_logits(&self, h: &Hc<B::Weight>, norm: &B::Weight, xs: &B::Buf, m: usize) -> B::Buf {
        let b = &self.backend;
        let hc = self.hc_dims();
        let w = hc.n * hc.d;
        let vocab = self.hp.n_vocab as usize;
        let mut s = b.alloc(m * w);
        b.copy(xs, 0, &mut s, 0, m * w);
        b.rms_norm(&mut s, m, w, None, self.hp.rms_eps);
        let mut mm = b.alloc(m * hc.n);
        b.matmul(&h.mixer, Part::All, &s, m, &mut mm);
        let mut y = b.alloc(m * hc.d);
        b.hc_collapse(hc, &mm, &h.scale, &h.base, xs, m, &mut y);
        b.rms_norm(&mut y, m, hc.d, Some(norm), self.hp.rms_eps);
        let mut logits = b.alloc(m * vocab);
        b.matmul(&self.output, Part::All, &y, m, &mut logits);
        logits
    }

    /// Whether an MTP block is loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// A fresh state for the MTP block: its own raw window ring (model.md §3.7).
    pub fn new_mtp_state(&self) -> B::LayerState {
        self.backend.new_layer_state(&self.mtp_dims())
    }

    /// The MTP block at position `pos` on token `tok` and hidden streams `hs` (N·D): returns
    /// its logits (a guess for the token after `tok`) and its output streams. Panics without
    /// MTP weights ([`Model::has_mtp`]).
    pub fn mtp_eval(
        &self,
        st: &mut B::LayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), String> {
        let (x, logits) = self.mtp_forward(st, hs, tok, pos)?;
        let b = &self.backend;
        let logits = b.download(&logits, self.hp.n_vocab as usize);
        let hc = self.hc_dims();
        let streams = b.download(&x, hc.n * hc.d);
        b.check()?;
        Ok((logits, streams))
    }

    /// [`Model::mtp_eval`]'s greedy draft alone: the argmax of its logits picked on the
    /// backend (the same id as the host's argmax, ties to the lowest), so neither the logits nor
    /// the streams cross to the host.
    pub fn mtp_draft(
        &self,
        st: &mut B::LayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<u32, String> {
        let b = &self.backend;
        // `DS4_MTP_GRAPH=on`: one recorded step, as a decode step (a device replays it as a
        // graph, its own cached kernel sequence), ended by the pick's read; off: eager launches.
        // Opt-in and untimed (written in session 65 when the device pool stopped lending).
        let graph = mtp_graph();
        if graph {
            b.graph_begin(1);
        }
        let r = self.mtp_forward(st, hs, tok, pos);
        let id = r.as_ref().ok().map(|(_, logits)| {
            b.sample(
                logits,
                self.hp.n_vocab as usize,
                &ds4_backend::SampleParams::default(),
                0.0,
            )
        });
        if graph {
            b.graph_end();
        }
        r?;
        b.check()?;
        Ok(id.unwrap_or(u32::MAX))
    }

    /// The MTP block on (streams `hs` of position pos − 1, token `tok` at pos): its final
    /// streams and logits, left on the backend.
    fn mtp_forward(
        &self,
        st: &mut B::LayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<(B::Buf, B::Buf), String> {
        let mtp = self.mtp.as_ref().ok_or("no MTP weights loaded")?;
        let b = &self.backend;
        let hc = self.hc_dims();
        let eps = self.hp.rms_eps;
        let ids = b.upload_i32(&[tok as i32]);
        let mut e = b.alloc(hc.d);
        b.embed(&self.embd, &ids, 1, 1, hc.d, &mut e);
        b.rms_norm(&mut e, 1, hc.d, Some(&mtp.enorm), eps);
        let mut ep = b.alloc(hc.d);
        b.matmul(&mtp.e_proj, Part::All, &e, 1, &mut ep);
        // Each stream: norm, project, add the projected embedding.
        let mut h = b.upload(hs);
        b.rms_norm(&mut h, hc.n, hc.d, Some(&mtp.hnorm), eps);
        let mut x = b.alloc(hc.n * hc.d);
        b.matmul(&mtp.h_proj, Part::All, &h, hc.n, &mut x);
        let mut epn = b.alloc(hc.n * hc.d);
        for i in 0..hc.n {
            b.copy(&ep, 0, &mut epn, i * hc.d, hc.d);
        }
        b.add(&mut x, &epn, hc.n * hc.d);
        let (y, post, comb) = self.layer_forward(&mtp.block, st, &mut x, &ids, 1, pos, None);
        b.hc_post(hc, &mut x, &y, &post, &comb, 1);
        let logits = self.head_logits(&mtp.head, &mtp.norm, &x, 1);
        Ok((x, logits))
    }
}

/// `DS4_MTP_GRAPH=on`: [`Model::mtp_draft`] records its step for a device graph.
fn mtp_graph() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DS4_MTP_GRAPH").is_ok_and(|v| v == "on" || v == "1"))
}

/// A model behind a trait object: the engine picks the backend at run time.
pub trait Forward: Send + Sync {
    fn hp(&self) -> &HParams;
    fn backend_name(&self) -> String;
    /// See [`Backend::prefill_chunk`].
    fn prefill_chunk(&self) -> usize;
    /// See [`Backend::weight_copy_bytes`].
    fn weight_copy_bytes(&self) -> u64;
    /// See [`Backend::device_memory`] (several ranks: the least free).
    fn device_memory(&self) -> Option<(u64, u64)>;
    /// A fresh state for a session of at most `ctx` tokens.
    fn new_state(&self, ctx: usize) -> AnyState;
    /// See [`Model::eval_batch_streams`].
    fn eval_batch(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        all: bool,
        streams: bool,
    ) -> Result<Evaluated, String>;
    /// See [`Model::eval_sample`].
    fn eval_sample(
        &self,
        st: &mut AnyState,
        token: u32,
        p: &ds4_backend::SampleParams,
        u: f64,
    ) -> Result<u32, String>;
    /// See [`Model::eval_pick`].
    fn eval_pick(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        p: &ds4_backend::SampleParams,
        draws: &[f64],
        streams: bool,
    ) -> Result<Picked, String>;
    fn checkpoint(&self, st: &AnyState) -> AnyCheckpoint;
    /// See [`Model::checkpoint_last`] (rolled back by [`Forward::rollback`]).
    fn checkpoint_last(&self, st: &AnyState, pos: usize) -> Option<AnyCheckpoint>;
    fn rollback(&self, st: &mut AnyState, cp: AnyCheckpoint);
    fn state_to_host(&self, st: &AnyState) -> HostState;
    /// `h` on the backend, for a session of at most `ctx` tokens.
    fn state_from_host(&self, h: &HostState, ctx: usize) -> AnyState;
    fn layer_dims(&self) -> Vec<LayerDims>;
    fn has_mtp(&self) -> bool;
    fn new_mtp_state(&self) -> AnyLayerState;
    fn mtp_eval(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), String>;
    /// See [`Model::mtp_draft`].
    fn mtp_draft(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<u32, String>;
}

/// A session state of some backend ([`Forward`]).
pub struct AnyState {
    /// The tokens the state holds, in order.
    pub tokens: Vec<u32>,
    pub(crate) layers: Box<dyn Any + Send>,
}

/// A rollback point of an [`AnyState`].
pub struct AnyCheckpoint(pub(crate) Box<dyn Any + Send>);

/// One layer state of some backend (the MTP block's).
pub struct AnyLayerState(pub(crate) Box<dyn Any + Send>);

impl<B: Backend + 'static> Model<B> {
    fn unwrap_state(st: &mut AnyState) -> State<B> {
        let layers = std::mem::replace(&mut st.layers, Box::new(()));
        State {
            tokens: std::mem::take(&mut st.tokens),
            layers: *layers
                .downcast::<Vec<B::LayerState>>()
                .expect("state from this model"),
        }
    }
    fn mtp_state(st: &mut AnyLayerState) -> &mut B::LayerState {
        st.0.downcast_mut::<B::LayerState>()
            .expect("MTP state from this model")
    }
    fn wrap_state(st: State<B>) -> AnyState {
        AnyState {
            tokens: st.tokens,
            layers: Box::new(st.layers),
        }
    }
}

impl<B: Backend + 'static> Forward for Model<B>
where
    B::LayerState: 'static,
    B::Mark: 'static,
{
    fn hp(&self) -> &HParams {
        &self.hp
    }
    fn backend_name(&self) -> String {
        self.backend.name()
    }
    fn prefill_chunk(&self) -> usize {
        self.backend.prefill_chunk().max(1)
    }
    fn weight_copy_bytes(&self) -> u64 {
        self.backend.weight_copy_bytes()
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.backend.device_memory()
    }
    fn new_state(&self, ctx: usize) -> AnyState {
        let mut s = Model::new_state(self);
        self.bound(&mut s, ctx);
        Self::wrap_state(s)
    }
    fn eval_batch(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        all: bool,
        streams: bool,
    ) -> Result<Evaluated, String> {
        let mut s = Self::unwrap_state(st);
        let r = self.eval_batch_streams(&mut s, tokens, all, streams);
        *st = Self::wrap_state(s);
        r
    }
    fn eval_sample(
        &self,
        st: &mut AnyState,
        token: u32,
        p: &ds4_backend::SampleParams,
        u: f64,
    ) -> Result<u32, String> {
        let mut s = Self::unwrap_state(st);
        let r = Model::eval_sample(self, &mut s, token, p, u);
        *st = Self::wrap_state(s);
        r
    }
    fn eval_pick(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        p: &ds4_backend::SampleParams,
        draws: &[f64],
        streams: bool,
    ) -> Result<Picked, String> {
        let mut s = Self::unwrap_state(st);
        let r = Model::eval_pick(self, &mut s, tokens, p, draws, streams);
        *st = Self::wrap_state(s);
        r
    }
    fn checkpoint(&self, st: &AnyState) -> AnyCheckpoint {
        let layers = st
            .layers
            .downcast_ref::<Vec<B::LayerState>>()
            .expect("state from this model");
        AnyCheckpoint(Box::new(Checkpoint::<B> {
            n_tokens: st.tokens.len(),
            marks: self.backend.mark_all(layers),
        }))
    }
    fn checkpoint_last(&self, st: &AnyState, pos: usize) -> Option<AnyCheckpoint> {
        let layers = st
            .layers
            .downcast_ref::<Vec<B::LayerState>>()
            .expect("state from this model");
        let cp = self.slot_checkpoint(layers, pos)?;
        Some(AnyCheckpoint(Box::new(cp)))
    }
    fn rollback(&self, st: &mut AnyState, cp: AnyCheckpoint) {
        let cp = *cp
            .0
            .downcast::<Checkpoint<B>>()
            .expect("checkpoint of this model");
        let mut s = Self::unwrap_state(st);
        Model::rollback(self, &mut s, cp);
        *st = Self::wrap_state(s);
    }
    fn state_to_host(&self, st: &AnyState) -> HostState {
        let layers = st
            .layers
            .downcast_ref::<Vec<B::LayerState>>()
            .expect("state from this model");
        HostState {
            tokens: st.tokens.clone(),
            layers: layers
                .iter()
                .map(|l| self.backend.state_to_host(l))
                .collect(),
        }
    }
    fn state_from_host(&self, h: &HostState, ctx: usize) -> AnyState {
        let mut s = Model::from_host(self, h);
        self.bound(&mut s, ctx);
        Self::wrap_state(s)
    }
    fn layer_dims(&self) -> Vec<LayerDims> {
        Model::layer_dims(self)
    }
    fn has_mtp(&self) -> bool {
        Model::has_mtp(self)
    }
    fn new_mtp_state(&self) -> AnyLayerState {
        AnyLayerState(Box::new(Model::new_mtp_state(self)))
    }
    fn mtp_eval(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), String> {
        Model::mtp_eval(self, Self::mtp_state(st), hs, tok, pos)
    }
    fn mtp_draft(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<u32, String> {
        Model::mtp_draft(self, Self::mtp_state(st), hs, tok, pos)
    }
}
