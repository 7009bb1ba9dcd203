//! Routed experts kept in host memory (`--cpu-experts`): a model larger than the GPU's memory
//! keeps every dense weight on the device and the routed-expert stacks of some layers in host
//! memory (the file's mmap: no copy). The schedule then runs those layers' routed experts
//!
//! - opt-in ([`gather_wanted`]), for decode steps (at most [`GATHER_MAX_TOKENS`] tokens) on a
//!   GPU: the router's selections come back to the host, the selected experts' slabs are
//!   copied into device slots (`Backend::expert_slots` / `gather_experts`: ~43 MB a q2 layer
//!   over the bus) and the backend's MoE runs on them;
//! - on the host for other small batches: the router's selections and the MoE input come back
//!   to the host, [`HostExperts::run`] computes `Backend::moe_experts`'s value there, and the
//!   sum goes back up (a host read ends a recorded decode graph: the step's later layers run
//!   eagerly);
//! - on the device for prompt batches of at least [`HostPlacement::upload_min`] tokens: the
//!   experts that the batch selects are uploaded [`HostPlacement::group`] at a time (each group
//!   one stack slice, bound like an expert-parallel rank's part) and run there, their sums added.
//!   Uploading a layer's used experts over the bus beats the host's arithmetic once a batch
//!   routes more than a few tokens to each expert.
//!
//! Summation order: the host path sums the slots in selection order as every backend does; the
//! grouped path adds the groups' sums (f32 order changes, as between expert-parallel ranks).

use ds4_backend::{GgmlType, MoeSpec, WeightSrc};
use ds4_gguf::GgufFile;
use std::sync::Arc;

/// A routed-expert stack in host memory: bytes `offset .. offset + n_bytes` of `file` (the
/// model's mapping, or an in-memory GGUF for generated weights), GGUF dims `[cols, rows,
/// experts]`, equal contiguous slabs per expert.
#[derive(Clone)]
pub struct HostStack {
    pub name: String,
    pub file: Arc<GgufFile>,
    pub ty: GgmlType,
    pub dims: [u64; 3],
    pub offset: usize,
    pub n_bytes: usize,
}

impl HostStack {
    pub fn experts(&self) -> usize {
        self.dims[2] as usize
    }

    /// Bytes of one expert's slab.
    pub fn slab(&self) -> usize {
        self.n_bytes / self.experts().max(1)
    }

    /// A stack in memory (a one-tensor GGUF) whose bytes `fill` writes: generated weights.
    pub fn in_memory(
        name: &str,
        ty: GgmlType,
        dims: [u64; 3],
        fill: impl FnOnce(&mut [u8]) -> Result<(), String>,
    ) -> Result<HostStack, String> {
        let mut g = ds4_gguf::GgufWriter::new();
        g.add_tensor(name, ty, &dims)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        let mut fill = Some(fill);
        let bytes = g
            .to_bytes(|_, out: &mut [u8]| match fill.take() {
                Some(f) => f(out).map_err(FillError::Fill),
                None => Ok(()), // one tensor: called once
            })
            .map_err(|e| format!("tensor {name}: {e}"))?;
        let file =
            Arc::new(GgufFile::from_bytes(name, bytes).map_err(|e| format!("tensor {name}: {e}"))?);
        let info = file.tensors()[0].clone();
        Ok(HostStack {
            name: name.to_string(),
            file,
            ty,
            dims,
            offset: info.offset as usize,
            n_bytes: info.n_bytes as usize,
        })
    }

    /// `f` with experts `e0 .. e0 + count` as a [`WeightSrc`] (a `[cols, rows, count]` stack).
    pub fn with_src<R>(&self, e0: usize, count: usize, f: impl FnOnce(&WeightSrc) -> R) -> R {
        let dims = [self.dims[0], self.dims[1], count as u64];
        f(&WeightSrc {
            name: &self.name,
            file: &self.file,
            ty: self.ty,
            dims: &dims,
            offset: self.offset + e0 * self.slab(),
            n_bytes: count * self.slab(),
        })
    }
}

/// Why [`HostStack::in_memory`] failed: its `fill`, or the in-memory file.
enum FillError {
    Fill(String),
    File(ds4_gguf::GgufError),
}

impl From<ds4_gguf::GgufError> for FillError {
    fn from(e: ds4_gguf::GgufError) -> FillError {
        FillError::File(e)
    }
}

impl std::fmt::Display for FillError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FillError::Fill(e) => write!(f, "{e}"),
            FillError::File(e) => write!(f, "{e}"),
        }
    }
}

/// Runs one layer's routed experts on the host (ds4-cpu implements it with the reference
/// kernels over the stacks' bytes).
pub trait HostExperts: Send + Sync {
    /// [`ds4_backend::Backend::moe_experts`]'s value: `out [n, d]` from the MoE input `z [n, d]`
    /// and the router's `sel`, `wgt` (`[n, n_used]`).
    fn run(&self, spec: &MoeSpec, z: &[f32], sel: &[i32], wgt: &[f32], n: usize) -> Vec<f32>;
}

/// Builds a layer's [`HostExperts`] from its gate, up and down stacks.
pub type HostExpertsMaker<'a> =
    dyn Fn(&[HostStack; 3]) -> Result<Box<dyn HostExperts>, String> + 'a;

/// Which layers keep their routed experts in host memory, and how they run there.
pub struct HostPlacement<'a> {
    /// Main-model layers (block indices) whose routed experts stay in host memory.
    pub layers: Vec<usize>,
    pub make: &'a HostExpertsMaker<'a>,
    /// Prompt batches of at least this many tokens upload the selected experts and run them on
    /// the backend (smaller batches: on the host).
    pub upload_min: usize,
    /// Experts uploaded (and run) at a time.
    pub group: usize,
    /// Decode steps (at most [`GATHER_MAX_TOKENS`] tokens) upload the experts they select into
    /// the backend's expert slots and run them there (`Backend::expert_slots`), where it has
    /// them; else on the host ([`gather_wanted`]).
    pub gather: bool,
}

/// [`set_gather`]'s override: 0 none, 1 on, 2 off.
static GATHER: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether decode steps gather their host-memory experts onto the device
/// (`DS4_HOST_EXPERTS_DECODE=gpu`, or [`set_gather`]). Off by default: on an H100 with 16
/// host cores a gathered q2 layer cost ~2.6 ms a token against ~1.9 ms on the host's cores
/// (decode with 8 layers on the host 35.6 against 38.8 tokens/s, with 4 57.1 against 55.1;
/// bench/results/gpu-s43-h100.txt runs D-E), when the slabs passed through pinned staging by
/// the host's memcpy before the bus. With the gather on, the stacks are now page-locked at load
/// (`Backend::register_host`) and copied by DMA: not yet measured.
pub fn gather_wanted() -> bool {
    match GATHER.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => std::env::var("DS4_HOST_EXPERTS_DECODE").is_ok_and(|v| v == "gpu"),
    }
}

/// Overrides `DS4_HOST_EXPERTS_DECODE` for engines opened from now on (tests, A/B benchmarks).
pub fn set_gather(on: bool) {
    GATHER.store(if on { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
}

/// Tokens of the largest step whose host-memory experts are gathered onto the device (decode
/// and speculative verify steps); larger batches below [`HostPlacement::upload_min`] run on the
/// host. The slots hold this many tokens' selections.
pub const GATHER_MAX_TOKENS: usize = 4;

/// Steps whose host-memory experts were gathered onto the device (process-wide; tests).
pub static GATHERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`HostPlacement::upload_min`] unless `DS4_HOST_EXPERTS_UPLOAD_MIN` says otherwise.
pub const UPLOAD_MIN: usize = 32;
/// [`HostPlacement::group`] unless `DS4_HOST_EXPERTS_GROUP` says otherwise: 32 experts of the
/// q2 mix are ~225 MB of device memory (q4 ~450 MB).
pub const GROUP: usize = 32;

impl HostPlacement<'_> {
    /// `layers` with the defaults (or their environment overrides).
    pub fn new<'a>(layers: Vec<usize>, make: &'a HostExpertsMaker<'a>) -> HostPlacement<'a> {
        let env = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&v| v > 0)
                .unwrap_or(d)
        };
        HostPlacement {
            layers,
            make,
            upload_min: env("DS4_HOST_EXPERTS_UPLOAD_MIN", UPLOAD_MIN),
            group: env("DS4_HOST_EXPERTS_GROUP", GROUP),
            gather: gather_wanted(),
        }
    }
}

/// For a prompt batch, the groups `[g * group, (g + 1) * group)` of experts that some slot of
/// non-zero weight selects (ascending), each with its slots' selections rewritten to local ids
/// and the other slots' weights zeroed (`ds4_backend::shard::localize`).
pub fn groups(
    sel: &[i32],
    wgt: &[f32],
    k: usize,
    n_expert: usize,
    group: usize,
) -> Vec<(usize, usize, Vec<i32>, Vec<f32>)> {
    let group = group.max(1);
    let n_groups = n_expert.div_ceil(group);
    let mut used = vec![false; n_groups];
    for (&e, &w) in sel.iter().zip(wgt) {
        if w != 0.0 && e >= 0 && (e as usize) < n_expert {
            used[e as usize / group] = true;
        }
    }
    (0..n_groups)
        .filter(|&g| used[g])
        .map(|g| {
            let e0 = g * group;
            let count = group.min(n_expert - e0);
            let (mut s, mut w) = (sel.to_vec(), wgt.to_vec());
            ds4_backend::shard::localize(&mut s, &mut w, k, e0, count);
            (e0, count, s, w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_the_selected_experts_once_each() {
        // 2 tokens, 3 slots, 10 experts in groups of 4: experts 1, 5, 9 and 2, 3 (weight 0: not
        // a user), 8.
        let sel = [1, 5, 9, 2, 3, 8];
        let wgt = [0.5, 0.25, 0.25, 0.7, 0.0, 0.3];
        let g = groups(&sel, &wgt, 3, 10, 4);
        let firsts: Vec<(usize, usize)> = g.iter().map(|x| (x.0, x.1)).collect();
        assert_eq!(firsts, vec![(0, 4), (4, 4), (8, 2)]);
        // Every slot of non-zero weight is kept (with a local id) in exactly one group.
        for (i, (&e, &w)) in sel.iter().zip(&wgt).enumerate() {
            let keep: Vec<_> = g.iter().filter(|x| x.3[i] != 0.0).collect();
            if w == 0.0 {
                assert!(keep.is_empty(), "slot {i}");
                continue;
            }
            assert_eq!(keep.len(), 1, "slot {i}");
            let (e0, _, s, ws) = keep[0];
            assert_eq!(*e0 as i32 + s[i], e);
            assert_eq!(ws[i], w);
        }
    }
}
