//! Routed experts kept in host memory (`--cpu-experts`): a model larger than the GPU's memory
//! keeps every dense weight on the device and the routed-expert stacks of some layers in host
//! memory (the file's mmap: no copy). The schedule then runs those layers' routed experts
//!
//! - by default ([`Gather::Auto`]) on a GPU that page-locked the stacks at load, for every
//!   batch: the router's selections come back to the host, the selected experts' slabs are
//!   copied by DMA into device slots (`Backend::expert_slots` / `gather_experts`: ~43 MB a q2
//!   layer for a decode step, the whole layer's 1.8 GB for a 2k prompt) and the backend's MoE
//!   runs on them; a batch that selects more experts than the slots hold ([`gather_slots`])
//!   is gathered in [`rounds`];
//! - where the gather is off (`DS4_HOST_EXPERTS_DECODE=host`, or the stacks not page-locked),
//!   batches under [`HostPlacement::upload_min`] tokens (decode steps among them) on the host:
//!   the router's selections and the MoE input come back to the host, [`HostExperts::run`]
//!   computes `Backend::moe_experts`'s value there, and the sum goes back up (a host read ends
//!   a recorded decode graph: the step's later layers run eagerly);
//! - and larger prompt batches on the device: the experts that the batch selects are uploaded
//!   [`HostPlacement::group`] at a time (each group one stack slice, bound like an
//!   expert-parallel rank's part) and run there, their sums added.
//!
//! Beside these, the schedule holds one host layer's whole stacks on the device (the layer
//! buffer, `forward.rs` `LayerBuffer`): the last host layer between batches (run as resident),
//! each host layer in turn, copied ahead of use, during prompt batches of [`prefetch_min`]
//! tokens or more; host layers are [`spread`] through the model so that each copy has the
//! layers before it to hide behind. With any host layer the embedding table stays in host
//! memory as well ([`HOST_TABLE`]: a token reads one row), read in place by the backend.
//!
//! Summation order: the host path sums the slots in selection order as every backend does; the
//! grouped path and gathers of several rounds add the groups' (rounds') sums (f32 order
//! changes, as between expert-parallel ranks).

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

    /// The whole stack's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.file.bytes()[self.offset..self.offset + self.n_bytes]
    }

    /// Expert `e`'s slab.
    pub fn expert(&self, e: usize) -> &[u8] {
        &self.bytes()[e * self.slab()..(e + 1) * self.slab()]
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
    /// Where the experts are not gathered ([`Gather`]): prompt batches of at least this many
    /// tokens upload the selected experts a group at a time and run them on the backend,
    /// smaller batches run on the host.
    pub upload_min: usize,
    /// Experts uploaded (and run) at a time.
    pub group: usize,
    /// Whether batches gather the experts they select onto the device, or run as above.
    pub gather: Gather,
}

/// Whether batches gather their host-memory experts onto the device
/// (`DS4_HOST_EXPERTS_DECODE=auto|gpu|host`, named when only decode steps gathered; since
/// session 45 every batch does, which beat the grouped uploads and the host's cores at every
/// size measured: see `Model::moe_gather`).
///
/// Measured on H100s (PCIe 5, 16 host cores; bench/results/gpu-s44-h100.txt runs A-C, full-size
/// q2 at 2k): with the stacks page-locked, a DMA gather of a layer's 6 selected experts costs
/// ~1 ms a token, the host's cores 2-4 ms (8 layers on the host: 66-72 against 17-46 tokens/s,
/// the hosts differing; 4 layers: 84-85 against 35-37); the q4 mix's 24 host layers tie (18.7-20.6
/// against 19.5-22.1). Through pinned staging (memory not page-locked) a gather cost ~2.6 ms a
/// q2 layer (session 43). Sharing a step's experts between bus and host lost (run C).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gather {
    /// Gather by DMA where the backend page-locks the stacks at load ([`lock_budget`]
    /// allowing), else as `Host`. The default.
    Auto,
    /// Gather wherever the backend has expert slots (through staging if not page-locked).
    Gpu,
    /// Never gather: batches under [`HostPlacement::upload_min`] tokens on the host's cores,
    /// larger ones uploaded in groups.
    Host,
}

impl Gather {
    /// `DS4_HOST_EXPERTS_DECODE`'s value: `auto` (or empty), `gpu`, `host` (or `cpu`).
    pub fn parse(v: &str) -> Result<Gather, String> {
        match v {
            "" | "auto" => Ok(Gather::Auto),
            "gpu" => Ok(Gather::Gpu),
            "host" | "cpu" => Ok(Gather::Host),
            _ => Err(format!(
                "DS4_HOST_EXPERTS_DECODE={v:?}: expected auto, gpu or host"
            )),
        }
    }
}

/// [`set_gather`]'s override: 0 none (the environment), else 1 + the mode's position.
static GATHER: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The mode of engines opened now: [`set_gather`]'s, else `DS4_HOST_EXPERTS_DECODE`'s (an
/// unknown value says so once and counts as `auto`).
pub fn gather_mode() -> Gather {
    match GATHER.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Gather::Auto,
        2 => Gather::Gpu,
        3 => Gather::Host,
        _ => {
            let v = std::env::var("DS4_HOST_EXPERTS_DECODE").unwrap_or_default();
            Gather::parse(&v).unwrap_or_else(|e| {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| eprintln!("ds4: {e}; using auto"));
                Gather::Auto
            })
        }
    }
}

/// Overrides `DS4_HOST_EXPERTS_DECODE` for engines opened from now on (None: the environment
/// again; tests, A/B benchmarks).
pub fn set_gather(mode: Option<Gather>) {
    let v = match mode {
        None => 0,
        Some(Gather::Auto) => 1,
        Some(Gather::Gpu) => 2,
        Some(Gather::Host) => 3,
    };
    GATHER.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// Host memory that [`Gather::Auto`] may page-lock: `MemAvailable` (which counts the page
/// cache that an mmap'd file's stacks sit in) less 4 GiB for everything else, so that locking
/// never starves the machine. None where /proc/meminfo cannot tell (no limit).
pub fn lock_budget() -> Option<usize> {
    Some(lock_budget_of(meminfo("MemAvailable")? / 1024))
}

/// A `/proc/meminfo` field (`key` without its colon) in bytes; None where there is none (not
/// Linux, or no such key).
pub fn meminfo(key: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(meminfo_kib(&m, key)? * 1024)
}

/// [`lock_budget`] for `MemAvailable` = `kib` KiB.
fn lock_budget_of(kib: u64) -> usize {
    (kib.saturating_sub(4 << 20) as usize).saturating_mul(1024)
}

/// The kB figure of `key` in /proc/meminfo's text.
fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Tokens whose selections the gather's device slots hold at once (decode and speculative
/// verify steps: one round). Larger batches are gathered in rounds of that many experts
/// ([`rounds`]), so the slots stay ~173 MB (q2) whatever the batch.
pub const GATHER_MAX_TOKENS: usize = 4;

/// Batches whose host-memory experts were gathered onto the device (process-wide; tests).
pub static GATHERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Rounds of those gathers (one slots' fill each; process-wide; tests).
pub static GATHER_ROUNDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Expert groups uploaded for prompt batches that were not gathered (process-wide; tests).
pub static UPLOADED_GROUPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

static SLOTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Experts the gather's device slots hold: [`GATHER_MAX_TOKENS`] tokens' selections (24 of the
/// model's 6 a token), or `DS4_HOST_EXPERTS_SLOTS` / [`set_gather_slots`] (tests: few slots
/// force rounds), never fewer than one token's `n_used` (the GPU's MoE kernels take at least
/// a token's selections of experts: with 4 slots for 6 a token, session 45's run B got wrong
/// logits). Read when a model's slots are made.
pub fn gather_slots(n_used: usize) -> usize {
    let set = match SLOTS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => std::env::var("DS4_HOST_EXPERTS_SLOTS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(GATHER_MAX_TOKENS * n_used),
        v => v,
    };
    set.max(n_used).max(1)
}

/// Overrides [`gather_slots`] for this process (None: back to the default).
pub fn set_gather_slots(slots: Option<usize>) {
    SLOTS.store(slots.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// One fill of the gather's slots: the experts copied (global ids, slot order) and the batch's
/// selections as slot numbers. `wgt`: the router weights with every slot that names another
/// round's expert zeroed (that slot then points at a slot of this round that its token uses, or
/// slot 0, as `ds4_backend::shard::localize` does); None where one round holds every expert
/// (the weights unchanged).
#[derive(Debug, PartialEq)]
pub struct Round {
    pub experts: Vec<i32>,
    pub sel: Vec<i32>,
    pub wgt: Option<Vec<f32>>,
}

/// A gathered batch's rounds: the experts that `sel` (`[n, k]`, expert ids) names, in order of
/// first use, `cap` a round. `wgt` is needed only where more than one round is.
pub fn rounds(
    sel: &[i32],
    wgt: Option<&[f32]>,
    k: usize,
    cap: usize,
) -> Result<Vec<Round>, String> {
    let (cap, k) = (cap.max(1), k.max(1));
    // Each expert's place in order of first use (a table by id: a 12k-token batch has ~74k
    // selections, looked up once a round).
    let top = sel.iter().copied().max().unwrap_or(0);
    if let Some(e) = sel.iter().find(|&&e| e < 0) {
        return Err(format!("selection {e} is not an expert id"));
    }
    let mut place = vec![u32::MAX; top as usize + 1];
    let mut used: Vec<i32> = Vec::new();
    for &e in sel {
        if place[e as usize] == u32::MAX {
            place[e as usize] = used.len() as u32;
            used.push(e);
        }
    }
    let place = |e: i32| place[e as usize] as usize;
    if used.len() <= cap {
        let local = sel.iter().map(|&e| place(e) as i32).collect();
        return Ok(vec![Round {
            experts: used,
            sel: local,
            wgt: None,
        }]);
    }
    let wgt = wgt.ok_or("a gather of several rounds needs the router weights")?;
    if wgt.len() != sel.len() {
        return Err(format!(
            "{} router weights for {} selections",
            wgt.len(),
            sel.len()
        ));
    }
    Ok(used
        .chunks(cap)
        .enumerate()
        .map(|(r, experts)| {
            let here = |e: i32| (place(e) / cap == r).then(|| place(e) % cap);
            let (mut s, mut w) = (Vec::with_capacity(sel.len()), wgt.to_vec());
            for (row, wrow) in sel.chunks(k).zip(w.chunks_mut(k)) {
                let first = row.iter().find_map(|&e| here(e)).unwrap_or(0);
                for (&e, w) in row.iter().zip(wrow) {
                    match here(e) {
                        Some(i) => s.push(i as i32),
                        None => {
                            s.push(first as i32);
                            *w = 0.0;
                        }
                    }
                }
            }
            Round {
                experts: experts.to_vec(),
                sel: s,
                wgt: Some(w),
            }
        })
        .collect())
}

/// Prompt batches of at least this many tokens fill the layer buffer with every host layer
/// in turn (`forward.rs` `LayerBuffer`); smaller ones gather the experts they select (a
/// 128-token batch selects ~95% of 256 experts, 6 a token; a 32-token batch ~53%).
/// `DS4_HOST_LAYER_PREFETCH_MIN` overrides it.
pub const PREFETCH_MIN: usize = 128;

/// [`PREFETCH_MIN`] or its override.
pub fn prefetch_min() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("DS4_HOST_LAYER_PREFETCH_MIN")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| v > 0)
            .unwrap_or(PREFETCH_MIN)
    })
}

/// A default-on switch: off where the environment variable `var` is `off` or `0`, unless
/// [`Switch::set`] overrode it (tests, callers) for models loaded from then on.
struct Switch {
    var: &'static str,
    /// 0: none (the environment), 1 off, 2 on.
    over: std::sync::atomic::AtomicU8,
}

impl Switch {
    const fn new(var: &'static str) -> Switch {
        Switch {
            var,
            over: std::sync::atomic::AtomicU8::new(0),
        }
    }

    fn on(&self) -> bool {
        match self.over.load(std::sync::atomic::Ordering::Relaxed) {
            1 => false,
            2 => true,
            _ => !std::env::var(self.var).is_ok_and(|v| v == "off" || v == "0"),
        }
    }

    fn set(&self, on: Option<bool>) {
        let v = on.map_or(0, |on| if on { 2 } else { 1 });
        self.over.store(v, std::sync::atomic::Ordering::Relaxed);
    }
}

static LAYER_BUFFER: Switch = Switch::new("DS4_HOST_LAYER_BUFFER");

/// Whether models loaded now make the layer buffer (`forward.rs` `LayerBuffer`): on unless
/// `DS4_HOST_LAYER_BUFFER=off` (or [`set_layer_buffer`]). The engine's memory plan counts
/// its bytes where it is wanted ([`layer_buffer_bytes`]).
pub fn layer_buffer_wanted() -> bool {
    LAYER_BUFFER.on()
}

/// Overrides `DS4_HOST_LAYER_BUFFER` for models loaded from now on (None: the environment).
pub fn set_layer_buffer(on: Option<bool>) {
    LAYER_BUFFER.set(on)
}

/// The layer buffer's device bytes for a placement with host layers of these routed-expert
/// byte counts (the largest; 0 where there are none or the buffer is off).
pub fn layer_buffer_bytes(host_layer_bytes: impl Iterator<Item = u64>) -> u64 {
    match layer_buffer_wanted() {
        true => host_layer_bytes.max().unwrap_or(0),
        false => 0,
    }
}

/// The tensor that a model with host layers reads from host memory in place (the GPU maps
/// it: `Backend::host_matrix`): the embedding table, 1 GiB of F16 of which a token reads one
/// 8 KiB row, so that the device memory goes to routed experts (on an 80 GB H100 the q2 mix
/// then keeps one layer fewer on the host; so does the q4 mix on an H200).
pub const HOST_TABLE: &str = "token_embd.weight";

static HOST_TABLE_SWITCH: Switch = Switch::new("DS4_HOST_EMBED");

/// Whether models loaded now with host layers read [`HOST_TABLE`] from host memory: on unless
/// `DS4_HOST_EMBED=off` (or [`set_host_table`]). The engine's memory plan leaves its bytes
/// off the device where this holds and host layers exist.
pub fn host_table_wanted() -> bool {
    HOST_TABLE_SWITCH.on()
}

/// Overrides `DS4_HOST_EMBED` for models loaded from now on (None: the environment).
pub fn set_host_table(on: Option<bool>) {
    HOST_TABLE_SWITCH.set(on)
}

/// Tables bound in host memory, read in place by the backend (process-wide; tests).
pub static HOST_TABLES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Fills of the layer buffer beside the compute (process-wide; tests).
pub static LAYER_PREFETCHES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);
/// Host layers' MoE runs from the layer buffer (process-wide; tests).
pub static BUFFERED_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `k` of `n` layers spread through the model, the last one last: layer `(j + 1) n / k - 1`
/// for `j < k` (k = 1: the last layer; k = n: all). Each host layer's experts then have the
/// layers since the previous one to cross the bus behind (`forward.rs` `LayerBuffer`).
pub fn spread(k: usize, n: usize) -> Vec<usize> {
    let k = k.min(n);
    (0..k).map(|j| (j + 1) * n / k - 1).collect()
}

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
            gather: gather_mode(),
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
    fn spread_layers_end_at_the_last_and_leave_even_gaps() {
        assert_eq!(spread(1, 43), vec![42]);
        assert_eq!(spread(5, 43), vec![7, 16, 24, 33, 42]);
        assert_eq!(spread(2, 4), vec![1, 3]);
        assert_eq!(spread(4, 4), vec![0, 1, 2, 3]);
        assert_eq!(spread(usize::MAX, 3), vec![0, 1, 2]);
        assert!(spread(0, 43).is_empty());
        for k in 1..=43 {
            let s = spread(k, 43);
            assert_eq!(s.len(), k);
            assert!(s.windows(2).all(|w| w[0] < w[1]), "{k}: {s:?}");
            assert_eq!(*s.last().unwrap(), 42);
            // Gaps differ by at most one layer.
            let gaps: Vec<usize> = s.windows(2).map(|w| w[1] - w[0]).collect();
            if let (Some(lo), Some(hi)) = (gaps.iter().min(), gaps.iter().max()) {
                assert!(hi - lo <= 1, "{k}: {gaps:?}");
            }
        }
    }

    #[test]
    fn gather_modes_parse_and_bad_values_say_what_is_accepted() {
        assert_eq!(Gather::parse(""), Ok(Gather::Auto));
        assert_eq!(Gather::parse("auto"), Ok(Gather::Auto));
        assert_eq!(Gather::parse("gpu"), Ok(Gather::Gpu));
        assert_eq!(Gather::parse("host"), Ok(Gather::Host));
        assert_eq!(Gather::parse("cpu"), Ok(Gather::Host));
        let e = Gather::parse("dma").unwrap_err();
        assert!(
            e.contains("\"dma\"") && e.contains("auto, gpu or host"),
            "{e}"
        );
    }

    #[test]
    fn one_round_keeps_the_weights_and_numbers_experts_by_first_use() {
        // 2 tokens x 3 slots; expert 9 twice.
        let sel = [9, 4, 7, 4, 9, 2];
        let r = rounds(&sel, None, 3, 24).unwrap();
        assert_eq!(
            r,
            vec![Round {
                experts: vec![9, 4, 7, 2],
                sel: vec![0, 1, 2, 1, 0, 3],
                wgt: None,
            }]
        );
        // Exactly full: still one round.
        assert_eq!(rounds(&sel, None, 3, 4).unwrap().len(), 1);
        // Several rounds need the weights.
        let e = rounds(&sel, None, 3, 3).unwrap_err();
        assert!(e.contains("router weights"), "{e}");
        let e = rounds(&sel, Some(&[1.0; 5]), 3, 3).unwrap_err();
        assert!(e.contains("5 router weights for 6 selections"), "{e}");
        let e = rounds(&[3, -1, 2], None, 3, 24).unwrap_err();
        assert!(e.contains("selection -1"), "{e}");
        assert_eq!(
            rounds(&[], None, 6, 24).unwrap()[0].experts,
            Vec::<i32>::new()
        );
    }

    #[test]
    fn rounds_cover_every_selection_once_with_its_weight() {
        let (k, n, cap) = (6, 13, 4);
        // A deterministic scatter of 16 experts over 13 tokens, no repeats within a token.
        let sel: Vec<i32> = (0..n * k)
            .map(|i| ((i / k) * 5 + (i % k) * 3) as i32 % 16)
            .collect();
        for row in sel.chunks(k) {
            for (i, e) in row.iter().enumerate() {
                assert!(
                    !row[..i].contains(e),
                    "test data repeats an expert: {row:?}"
                );
            }
        }
        let wgt: Vec<f32> = (0..n * k).map(|i| 0.5 + i as f32).collect();
        let r = rounds(&sel, Some(&wgt), k, cap).unwrap();
        assert_eq!(r.len(), 4, "16 experts in rounds of 4");
        let mut seen = vec![0usize; n * k];
        for round in &r {
            assert!(round.experts.len() <= cap);
            let w = round.wgt.as_ref().unwrap();
            for (i, (&slot, &wi)) in round.sel.iter().zip(w).enumerate() {
                assert!(
                    (slot as usize) < round.experts.len(),
                    "slot {slot} past the round"
                );
                if wi != 0.0 {
                    // A live slot names the token's own expert with its own weight.
                    assert_eq!(round.experts[slot as usize], sel[i]);
                    assert_eq!(wi, wgt[i]);
                    seen[i] += 1;
                } else {
                    assert!(
                        !round.experts.contains(&sel[i]),
                        "slot {i} dropped in its round"
                    );
                }
            }
        }
        assert!(
            seen.iter().all(|&c| c == 1),
            "every selection in exactly one round: {seen:?}"
        );
        // Rounds partition the experts, in order of first use.
        let all: Vec<i32> = r.iter().flat_map(|x| x.experts.clone()).collect();
        let mut first = Vec::new();
        for &e in &sel {
            if !first.contains(&e) {
                first.push(e);
            }
        }
        assert_eq!(all, first);
    }

    #[test]
    fn the_slot_count_defaults_to_four_tokens_and_can_be_set() {
        set_gather_slots(Some(7));
        assert_eq!(gather_slots(6), 7);
        set_gather_slots(Some(4));
        assert_eq!(gather_slots(6), 6, "at least a token's selections");
        set_gather_slots(None);
        if std::env::var("DS4_HOST_EXPERTS_SLOTS").is_err() {
            assert_eq!(gather_slots(6), 24);
            assert_eq!(gather_slots(8), 32);
        }
    }

    #[test]
    fn the_lock_budget_leaves_4_gib_of_available_memory() {
        let text =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   20971520 kB\n";
        assert_eq!(meminfo_kib(text, "MemAvailable"), Some(20971520));
        assert_eq!(meminfo_kib(text, "MemAvail"), None); // whole keys only
        assert_eq!(meminfo_kib("MemAvailable: x kB", "MemAvailable"), None);
        assert_eq!(lock_budget_of(20971520), 16 << 30); // 20 GiB available -> 16 GiB
        assert_eq!(lock_budget_of(1 << 20), 0); // less than the reserve: nothing
    }

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
