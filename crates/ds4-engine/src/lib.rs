//! The engine: opens a model on a backend, hands out sessions. This is the only API the CLI
//! and the server use — tokens in, logits/tokens out, snapshots as bytes; never a tensor.

pub mod sampler;
mod snapshot;

use ds4_backend::{Backend, HostComm, Shard};
use ds4_cpu::CpuBackend;
pub use ds4_cpu::Rounding;
use ds4_gguf::{GgmlType, GgufFile};
pub use ds4_gpu::Precision;
use ds4_model::forward::{rope_tables, AnyLayerState, AnyState, Forward, Model};
use ds4_model::offload::{meminfo, HostExperts, HostPlacement, HostStack};
use ds4_model::sharded::Sharded;
use ds4_model::synthetic::SynthSource;
use ds4_model::{bind_main, HParams};
use ds4_tokenizer::Tokenizer;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use ds4_model::synthetic::SynthPreset;
pub use sampler::{
    argmax, log_sum_exp, select, top_logprobs, SampleParams, Sampler, SamplerConfig,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] ds4_gguf::GgufError),
    #[error(transparent)]
    HParams(#[from] ds4_model::HParamsError),
    #[error(transparent)]
    Bind(#[from] ds4_model::BindError),
    #[error("{0}: tokenizer: {1}")]
    Tokenizer(String, ds4_tokenizer::TokenizerError),
    #[error("backend {0}: {1}")]
    Backend(String, String),
    #[error("context full: {needed} tokens do not fit the session's context of {ctx}")]
    ContextFull { needed: usize, ctx: usize },
    #[error("token id {0} is outside the vocabulary ({1} ids)")]
    BadToken(u32, usize),
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// A sound snapshot written by a newer ds4 (format `found`; this build reads 1 to
    /// `newest`): callers keep the file, it is not damaged.
    #[error(
        "snapshot: format version {found} is newer than this build reads (1 to {newest}); \
         update ds4 to use it"
    )]
    SnapshotNewer { found: u32, newest: u32 },
}

impl EngineError {
    /// True where a snapshot was refused for what it holds (damage, another model, a shape
    /// that does not match), so a cache may delete it; false for a newer format and for a
    /// context this session cannot hold (the file is sound: another process can use it).
    pub fn snapshot_is_bad(&self) -> bool {
        matches!(self, EngineError::Snapshot(_))
    }
}

/// Which backend runs the model (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Cpu,
    Cuda,
    Rocm,
    Metal,
}

impl BackendChoice {
    pub fn parse(s: &str) -> Option<BackendChoice> {
        Some(match s {
            "auto" => BackendChoice::Auto,
            "cpu" => BackendChoice::Cpu,
            "cuda" => BackendChoice::Cuda,
            "rocm" => BackendChoice::Rocm,
            "metal" => BackendChoice::Metal,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub model: PathBuf,
    /// MTP GGUF for speculative decoding (model.md §2.5).
    pub mtp: Option<PathBuf>,
    /// [`Engine::open_synthetic`] also generates a random MTP block (benchmarks of drafts).
    pub synthetic_mtp: bool,
    pub backend: BackendChoice,
    /// CPU worker threads (None: all cores).
    pub threads: Option<usize>,
    /// GPU index among the visible devices (`--device`).
    pub device: usize,
    /// Expert parallelism (`--devices`): with two or more entries the model is split by
    /// routed experts over these GPUs, one rank each (NCCL / RCCL between them; `device` is
    /// then unused). With the CPU backend: that many reference ranks in this process.
    pub devices: Vec<usize>,
    /// Expert-parallel GPU ranks add their MoE sums through host memory instead of NCCL /
    /// RCCL: slower (no decode graphs), but ranks may then share a device (tests; the CLI's
    /// `DS4_EP_COMM=host`).
    pub ep_host_comm: bool,
    /// Tensor parallelism with `devices` too (`ds4_backend::shard`): each rank also holds its
    /// part of every attention's heads and of the shared expert, where the ranks divide them
    /// (`ds4_model::forward::tp_fits`; else experts only). Default on.
    pub tp: bool,
    pub rounding: Rounding,
    /// Rounding of the GPU's prefill tensor-core products (`--precision`; ds4-gpu
    /// `model/precision.rs`). The CPU backend computes in f32 either way.
    pub precision: Precision,
    /// Which layers' routed experts a GPU model keeps in host memory (`--cpu-experts`,
    /// `ds4_model::offload`).
    pub cpu_experts: CpuExperts,
}

/// `--cpu-experts`: where a one-GPU model's routed experts live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuExperts {
    /// On the GPU when the model fits; else as few layers' experts in host memory as let the
    /// rest fit, spread through the model ([`ds4_model::offload::spread`]).
    Auto,
    /// All on the GPU (a model that does not fit is refused).
    Off,
    /// `n` layers' experts in host memory, spread through the model, the last layer among
    /// them (`usize::MAX`: every layer's).
    Layers(usize),
}

impl CpuExperts {
    /// `auto`, `off` / `none` / `0`, `all`, or a layer count.
    pub fn parse(s: &str) -> Option<CpuExperts> {
        Some(match s {
            "auto" => CpuExperts::Auto,
            "off" | "none" | "0" => CpuExperts::Off,
            "all" => CpuExperts::Layers(usize::MAX),
            n => CpuExperts::Layers(n.parse().ok().filter(|&n| n > 0)?),
        })
    }
}

/// What a placement may move to host memory: each main layer's routed-expert bytes
/// (`per_layer[i]`), the experts a layer has, and the bytes of the table that goes with them
/// once any layer is on the host (`ds4_model::offload::HOST_TABLE`, read there in place; 0
/// where `DS4_HOST_EMBED=off`).
#[derive(Clone, Copy)]
pub struct Movable<'a> {
    pub per_layer: &'a [u64],
    pub n_expert: usize,
    pub table: u64,
}

impl Movable<'_> {
    /// Weight bytes that leave the device with host layers `host`: their routed experts and
    /// the table (none without host layers).
    fn moved(&self, host: &[usize]) -> u64 {
        match host.is_empty() {
            true => 0,
            false => host.iter().map(|&i| self.per_layer[i]).sum::<u64>() + self.table,
        }
    }
}

/// [`Movable::table`] of a model with these `(name, bytes)` tensors.
fn host_table_bytes<'a>(mut tensors: impl Iterator<Item = (&'a str, u64)>) -> u64 {
    match ds4_model::offload::host_table_wanted() {
        true => (tensors.find(|t| t.0 == ds4_model::offload::HOST_TABLE)).map_or(0, |t| t.1),
        false => 0,
    }
}

/// Device bytes a prompt batch needs beside the weights when some experts are in host memory:
/// one uploaded group of the largest layer's stacks ([`ds4_model::offload::GROUP`] experts).
fn host_group_bytes(per_layer: &[u64], n_expert: usize) -> u64 {
    let max = per_layer.iter().copied().max().unwrap_or(0);
    max / n_expert.max(1) as u64 * ds4_model::offload::GROUP.min(n_expert) as u64
}

/// The layers whose routed experts stay in host memory (ascending): per `choice`, and for
/// `Auto` the fewest layers (spread through the model: [`ds4_model::offload::spread`]) that
/// let the other weights fit `free` bytes with the reserve ([`gpu_fit_error`]), beside one
/// uploaded group and the layer buffer ([`host_extra_bytes`]); `weights`: all bytes.
pub fn host_expert_layers(
    choice: CpuExperts,
    m: &Movable,
    weights: u64,
    free: Option<u64>,
) -> Vec<usize> {
    let (per_layer, n_expert) = (m.per_layer, m.n_expert);
    let n = per_layer.len();
    let spread = |k: usize| ds4_model::offload::spread(k, n);
    match choice {
        CpuExperts::Off => Vec::new(),
        CpuExperts::Layers(k) => spread(k),
        CpuExperts::Auto => {
            let Some(free) = free else {
                return Vec::new();
            };
            if weights.saturating_add(GPU_RESERVE) <= free {
                return Vec::new();
            }
            for k in 1..=n {
                let host = spread(k);
                let extra = host_extra_bytes(per_layer, n_expert, &host);
                let on_gpu = weights.saturating_sub(m.moved(&host)).saturating_add(extra);
                if on_gpu.saturating_add(GPU_RESERVE) <= free {
                    return host;
                }
            }
            spread(n) // still too big: the fit check says so with the numbers
        }
    }
}

/// Device bytes beside the resident weights when the routed experts of layers `host` are in
/// host memory: one uploaded group ([`host_group_bytes`]) and the layer buffer that holds one
/// host layer's experts (`ds4_model::offload::layer_buffer_bytes`: decode steps run that
/// layer as resident, prompts fill it with each host layer ahead of use). Nothing without
/// host layers.
fn host_extra_bytes(per_layer: &[u64], n_expert: usize, host: &[usize]) -> u64 {
    if host.is_empty() {
        return 0;
    }
    host_group_bytes(per_layer, n_expert)
        + ds4_model::offload::layer_buffer_bytes(host.iter().map(|&i| per_layer[i]))
}

/// A backend error, with what to change appended where the device ran out of memory during a
/// step (the weights loaded, but the session state and scratch did not fit beside them).
fn out_of_memory_hint(e: String) -> String {
    let oom = ["OUT_OF_MEMORY", "hipErrorOutOfMemory", "out of memory"];
    if !e.contains("device memory") || !oom.iter().any(|m| e.contains(m)) {
        return e;
    }
    format!(
        "{e}\nthe GPU ran out of memory beside the weights: a smaller --ctx (session state \
         grows with it), fewer live sessions (ds4 serve --kv-mem-mb), or the routed experts of \
         more layers in host memory (--cpu-experts N) leave more room"
    )
}

/// A placement's bytes: (routed experts in host memory, what the GPU holds: the other weights
/// (all but those experts and, with them, the table: [`Movable::moved`]), what host layers
/// add ([`host_extra_bytes`]), and the layout copies if `keep`).
fn placed_bytes(m: &Movable, own: u64, copies: u64, host: &[usize], keep: bool) -> (u64, u64) {
    let on_host: u64 = host.iter().map(|&i| m.per_layer[i]).sum();
    let extra = host_extra_bytes(m.per_layer, m.n_expert, host);
    let dev = own.saturating_sub(m.moved(host)) + extra + if keep { copies } else { 0 };
    (on_host, dev)
}

/// Where a GPU model's weights go on a device with `free` bytes free: the layers whose routed
/// experts stay in host memory ([`host_expert_layers`]) and whether the GPU also makes its
/// decode-layout copies (`copies` bytes: [`gpu_layout_bytes`]). The copies only speed up the
/// one-token dense products, while each layer of experts in host memory costs a decode step
/// milliseconds of CPU time, so under `Auto` they go first: a model that does not fit with them
/// is placed without them (6.1 GiB in either mix: three to four layers of q2 experts). With a fixed
/// choice they are made when they fit. `own`: the weights' own bytes (all of them).
fn place_weights(
    choice: CpuExperts,
    m: &Movable,
    own: u64,
    copies: u64,
    free: Option<u64>,
) -> (Vec<usize>, bool) {
    let Some(free) = free else {
        return (host_expert_layers(choice, m, own, None), true);
    };
    let fits = |host: &[usize], with: bool| {
        let dev = placed_bytes(m, own, copies, host, with).1;
        dev.saturating_add(GPU_RESERVE) <= free
    };
    let with = host_expert_layers(choice, m, own + copies, Some(free));
    let without = host_expert_layers(choice, m, own, Some(free));
    // The copies stay only where they cost no layer of experts more in host memory.
    if with.len() <= without.len() && fits(&with, true) {
        return (with, true);
    }
    let keep = fits(&without, true);
    (without, keep)
}

/// Routed-expert bytes of each main layer, from `(name, bytes)` of every tensor.
fn expert_bytes_per_layer<'a>(
    n_layer: usize,
    tensors: impl Iterator<Item = (&'a str, u64)>,
) -> Vec<u64> {
    let mut v = vec![0u64; n_layer];
    for (name, b) in tensors {
        let Some(rest) = name.strip_prefix("blk.") else {
            continue;
        };
        let Some((i, t)) = rest.split_once('.') else {
            continue;
        };
        if t.ends_with("_exps.weight") {
            if let Some(x) = i.parse::<usize>().ok().and_then(|i| v.get_mut(i)) {
                *x += b;
            }
        }
    }
    v
}

/// Device bytes a GPU backend adds to weights of these (type, GGUF dims) for its copies in
/// other layouts ([`ds4_gpu::GpuBackend::layout_copy_bytes`]); they stay on the GPU whatever
/// `--cpu-experts` moves (expert stacks get none).
fn gpu_layout_bytes<'a>(tensors: impl Iterator<Item = (GgmlType, &'a [u64])>) -> u64 {
    tensors
        .map(|(ty, dims)| ds4_gpu::GpuBackend::layout_copy_bytes(ty, dims))
        .sum()
}

/// Why the weights left on the device do not fit even with `what` = (layers, of layers, bytes)
/// of routed experts in host memory (None: they fit with [`GPU_RESERVE`] to spare).
fn host_fit_error(
    what: (usize, usize, u64),
    dev_weights: u64,
    free: u64,
    total: u64,
    device: &str,
) -> Option<String> {
    gpu_fit_error(dev_weights, free, total, device)?;
    Some(format!(
        "with the routed experts of {} of {} layers in host memory ({:.1} GiB), the other \
         weights still need {:.1} GiB of device memory (plus ~{:.0} GiB for session state and \
         scratch), but {device} has {:.1} of {:.1} GiB free: use another GPU (--device N) or \
         --backend cpu",
        what.0,
        what.1,
        gib(what.2),
        gib(dev_weights),
        gib(GPU_RESERVE),
        gib(free),
        gib(total)
    ))
}

/// `MemAvailable` from `/proc/meminfo` (Linux), in bytes; None elsewhere.
pub fn mem_available() -> Option<u64> {
    meminfo("MemAvailable")
}

/// A file's host-memory experts stay in its mapping: where they exceed what the page cache can
/// hold (RAM less [`HOST_RESERVE`] for everything else), the pages evicted between tokens are
/// read from disk again on every decode step. Said on the backend line, not refused: it runs,
/// at the disk's speed.
fn host_cache_note(bytes: u64, ram: u64) -> Option<String> {
    (bytes.saturating_add(HOST_RESERVE) > ram).then(|| {
        format!(
            "; note: {:.1} GiB of host-memory experts exceed what this machine's {:.1} GiB of RAM \
             can cache: decode steps will read some from disk (fewer layers: --cpu-experts N)",
            gib(bytes),
            gib(ram)
        )
    })
}

/// Bytes as GiB (messages).
fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Host memory kept free beside a synthetic model's host-memory experts.
const HOST_RESERVE: u64 = 2 << 30;

/// Why `bytes` of generated expert stacks (a synthetic model has no file to map them from) do
/// not fit `available` bytes of host memory with [`HOST_RESERVE`] to spare.
fn host_memory_error(layers: usize, bytes: u64, available: u64) -> Option<String> {
    if bytes.saturating_add(HOST_RESERVE) <= available {
        return None;
    }
    Some(format!(
        "the routed experts of {layers} layers need {:.1} GiB of host memory (a synthetic \
         model's are generated, not mapped from a file), but {:.1} GiB are available: keep \
         fewer layers' experts in host memory (--cpu-experts N)",
        gib(bytes),
        gib(available)
    ))
}

/// `--cpu-experts N|all` needs one GPU: several ranks hold 1/N of the experts each instead.
fn check_cpu_experts(opts: &EngineOptions) -> Result<(), EngineError> {
    if opts.devices.len() > 1 && matches!(opts.cpu_experts, CpuExperts::Layers(_)) {
        return Err(EngineError::Backend(
            format!("{:?}", opts.backend).to_lowercase(),
            "--cpu-experts keeps routed experts in host memory beside one GPU; with --devices \
             the ranks split the experts instead (leave --cpu-experts at auto or off)"
                .into(),
        ));
    }
    Ok(())
}

/// Binds a layer's host-memory experts for the CPU's arithmetic: `--precision fast` (the
/// default) quantises the activations of their CPU calls to 8 bits (~1.6x a decode step on this
/// project's 2-core machine, `ds4-cpu/examples/host_experts_bench.rs`), `exact` keeps the CPU
/// reference's f32.
fn cpu_host_experts(
    ropes: &ds4_backend::rope::RopeTables,
    precision: Precision,
) -> impl Fn(&[HostStack; 3]) -> Result<Box<dyn HostExperts>, String> + '_ {
    move |s| {
        let e = ds4_cpu::CpuHostExperts::new(s, ropes)?;
        Ok(Box::new(match precision {
            Precision::Fast => e.with_int8_activations(),
            Precision::Exact => e,
        }) as Box<dyn HostExperts>)
    }
}

impl EngineOptions {
    pub fn new(model: impl Into<PathBuf>) -> EngineOptions {
        EngineOptions {
            model: model.into(),
            mtp: None,
            synthetic_mtp: false,
            backend: BackendChoice::Auto,
            threads: None,
            device: 0,
            devices: Vec::new(),
            ep_host_comm: false,
            tp: true,
            rounding: Rounding::MODEL,
            precision: DEFAULT_PRECISION,
            cpu_experts: CpuExperts::Auto,
        }
    }
}

/// `--precision` when not given: `fast` (one 16-bit product per prefill product; ds4-gpu
/// `model/precision.rs` says what it costs in accuracy and buys in speed). `exact` is the form
/// the GPU-vs-CPU comparisons hold to ~1e-4.
pub const DEFAULT_PRECISION: Precision = Precision::Fast;

/// The first line of a library error, without its list of searched places (`ds4 devices`).
fn first_line(e: &ds4_gpu::GpuError) -> String {
    let msg = e.to_string();
    msg.lines()
        .next()
        .unwrap_or("")
        .trim_end_matches("; searched:")
        .to_string()
}

/// `name: what was found`, or `name: not found<why it matters>: <first line of the error>`.
fn lib_line(name: &str, r: Result<String, ds4_gpu::GpuError>, missing: &str) -> String {
    match r {
        Ok(found) => format!("{name}: {found}"),
        Err(e) => format!("{name}: not found{missing}: {}", first_line(&e)),
    }
}

/// A human-readable report of the compute devices and kernel compilers this machine offers
/// (`ds4 devices`): one line per item, each saying what was found or why not.
pub fn device_report() -> Vec<String> {
    use ds4_gpu::Compiler;
    let mut out = vec![format!(
        "cpu: {} threads available, {} dot products (the reference backend; always present)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        ds4_quant::active_isa()
    )];
    for (vendor, r) in ds4_gpu::probe() {
        let backend = match vendor {
            ds4_gpu::Vendor::Nvidia => ds4_gpu::Backend::Cuda,
            ds4_gpu::Vendor::Amd => ds4_gpu::Backend::Rocm,
        };
        match r {
            Ok(0) => out.push(format!("{vendor}: driver loaded, no visible device")),
            Ok(n) => {
                for i in 0..n {
                    match ds4_gpu::Gpu::open(backend, i) {
                        Ok(g) => {
                            let d = g.info();
                            out.push(format!(
                                "{vendor} device {i}: {} ({}, warp {}, {} SMs/CUs, {:.1} GiB)",
                                d.name,
                                d.arch,
                                d.warp,
                                d.sm_count,
                                d.total_mem as f64 / (1u64 << 30) as f64
                            ));
                            if let Ok((free, _)) = g.mem_info() {
                                out.push(device_plan_line(free));
                            }
                        }
                        Err(e) => out.push(format!("{vendor} device {i}: cannot open: {e}")),
                    }
                }
            }
            Err(e) => out.push(format!("{vendor}: not usable: {}", first_line(&e))),
        }
    }
    let nv = ds4_gpu::Nvrtc::load().map(|c| format!("{} ({})", c.version(), c.path().display()));
    out.push(lib_line("nvrtc", nv, ""));
    let hip = ds4_gpu::Hiprtc::load().map(|c| format!("{} ({})", c.version(), c.path().display()));
    out.push(lib_line("hiprtc", hip, ""));
    for (vendor, ccl, blas) in [
        (ds4_gpu::Vendor::Nvidia, "nccl", "cublaslt"),
        (ds4_gpu::Vendor::Amd, "rccl", "hipblaslt"),
    ] {
        // The collective library joins expert-parallel ranks (`--devices`); one GPU needs none.
        let c = ds4_gpu::ccl::Ccl::open(vendor).map(|c| {
            format!(
                "{} ({}; expert parallelism over --devices)",
                c.version(),
                c.path.display()
            )
        });
        out.push(lib_line(ccl, c, " (--devices needs it; one GPU does not)"));
        // The vendor BLAS takes the dense prefill products (without it the built-in GEMM
        // does, ~30% slower prefill on an H200).
        let b = ds4_gpu::blas::BlasLt::load(vendor)
            .map(|b| format!("{} (dense prefill products)", b.lib.path.display()));
        out.push(lib_line(
            blas,
            b,
            " (dense prefill products use the built-in GEMM)",
        ));
    }
    out.push(full_size_line());
    if let Some(d) = ds4_gpu::cache::cache_dir() {
        out.push(format!("kernel cache: {}", d.display()));
    }
    out
}

/// Memory a full-size model needs: weights of the two published mixes and one session's
/// state at 32k and 1M tokens (`ds4 devices`).
fn full_size_line() -> String {
    use ds4_model::tensors::{mix_sizes, Mix};
    let hp = HParams::flash();
    // (all weights, routed experts, the GPU's layout copies) of a mix.
    let bytes = |mix: Mix| -> (u64, u64, u64) {
        let sizes = mix_sizes(&hp, mix);
        let sum = |f: &dyn Fn(&str) -> bool| -> u64 {
            sizes.iter().filter(|t| f(&t.0.name)).map(|t| t.2).sum()
        };
        let copies = gpu_layout_bytes(sizes.iter().map(|(t, ty, _)| (*ty, &t.dims[..])));
        (
            sum(&|_| true),
            sum(&|n| n.ends_with("_exps.weight")),
            copies,
        )
    };
    let (q2, q4) = (bytes(Mix::Q2), bytes(Mix::Q4));
    format!(
        "full-size model: weights {:.1} GiB (q2) / {:.1} GiB (q4), of which routed experts {:.1} / \
         {:.1} GiB; a GPU also holds {:.1} / {:.1} GiB of decode-layout copies (--cpu-experts all \
         leaves {:.1} / {:.1} GiB on the GPU with them); session state {:.2} GiB at 32k context, \
         {:.2} GiB at 1M ({:.2} / {:.2} GiB on a GPU: bf16 indexer rows)",
        gib(q2.0),
        gib(q4.0),
        gib(q2.1),
        gib(q4.1),
        gib(q2.2),
        gib(q4.2),
        gib(q2.0 - q2.1 + q2.2),
        gib(q4.0 - q4.1 + q4.2),
        gib(hp.session_bytes(32 << 10, 4, 4)),
        gib(hp.session_bytes(1 << 20, 4, 4)),
        gib(hp.session_bytes(32 << 10, 4, 2)),
        gib(hp.session_bytes(1 << 20, 4, 2))
    )
}

/// What `--cpu-experts auto` does with a full-size `mix` on a GPU with `free` bytes free:
/// (layers whose routed experts go to host memory, their bytes, whether the rest then fits,
/// whether the GPU keeps its decode-layout copies).
fn full_size_plan(mix: ds4_model::tensors::Mix, free: u64) -> (usize, u64, bool, bool) {
    full_size_plan_table(mix, free, ds4_model::offload::host_table_wanted())
}

/// [`full_size_plan`] with the embedding table moving with host layers or not (`table`).
fn full_size_plan_table(
    mix: ds4_model::tensors::Mix,
    free: u64,
    table: bool,
) -> (usize, u64, bool, bool) {
    let hp = HParams::flash();
    let sizes = ds4_model::tensors::mix_sizes(&hp, mix);
    let own: u64 = sizes.iter().map(|t| t.2).sum();
    let copies = gpu_layout_bytes(sizes.iter().map(|(t, ty, _)| (*ty, &t.dims[..])));
    let named = || sizes.iter().map(|(t, _, b)| (t.name.as_str(), *b));
    let per = expert_bytes_per_layer(hp.n_layer as usize, named());
    let m = Movable {
        per_layer: &per,
        n_expert: hp.n_expert as usize,
        table: if table { host_table_bytes(named()) } else { 0 },
    };
    let (host, keep) = place_weights(CpuExperts::Auto, &m, own, copies, Some(free));
    let (on_host, dev) = placed_bytes(&m, own, copies, &host, keep);
    let fits = gpu_fit_error(dev, free, free, "").is_none();
    (host.len(), on_host, fits, keep)
}

/// `ds4 devices`' line under a GPU with `free` bytes free: how each full-size mix would run on
/// it alone with `--cpu-experts auto`.
fn device_plan_line(free: u64) -> String {
    use ds4_model::tensors::Mix;
    let n_layer = HParams::flash().n_layer;
    let table = match ds4_model::offload::host_table_wanted() {
        true => " and the embedding table",
        false => "",
    };
    let one = |name: &str, mix: Mix| {
        let (n, bytes, fits, keep) = full_size_plan(mix, free);
        let copies = if keep {
            ""
        } else {
            " with its Q8_0 matrices in the decode layout only"
        };
        match (n, fits) {
            (_, false) => {
                format!("{name} does not fit (even with every layer's experts in host memory)")
            }
            (0, true) => format!("{name} all on the GPU{copies}"),
            (n, true) => format!(
                "{name} with the routed experts of {n} of {n_layer} layers{table} in host \
                 memory ({:.1} GiB of experts){copies}",
                gib(bytes)
            ),
        }
    };
    format!(
        "  full-size model on it alone ({:.1} GiB free, --cpu-experts auto): {}; {}",
        gib(free),
        one("q2", Mix::Q2),
        one("q4", Mix::Q4)
    )
}

pub struct Engine {
    model: Arc<dyn Forward>,
    tokenizer: Arc<Tokenizer>,
    /// SHA-256 of the GGUF header (metadata + tensor table): identifies the model in snapshots.
    model_id: [u8; 32],
    path: PathBuf,
    /// Human-readable backend line (`cpu`, or the GPU and what runs on it).
    backend: String,
    /// Device bytes of the weights on a GPU backend: their own, their layout copies.
    weight_bytes: Option<(u64, u64)>,
    /// Where new sessions' speculative steps pick ([`Engine::set_device_picks`]).
    device_picks: Option<bool>,
}

/// The device a GPU choice resolved to.
struct GpuPick {
    /// `cuda` or `rocm`.
    name: &'static str,
    gpu: ds4_gpu::Gpu,
}

/// Resolve `--backend`: `Ok(None)` runs on the CPU (`cpu`, or `auto` with no usable GPU —
/// silently); a GPU that was asked for and cannot be opened is an error.
fn pick_gpu(choice: BackendChoice, device: usize) -> Result<Option<GpuPick>, EngineError> {
    let open = |name: &'static str, which| {
        ds4_gpu::Gpu::open(which, device).map(|gpu| GpuPick { name, gpu })
    };
    match choice {
        BackendChoice::Cpu => Ok(None),
        BackendChoice::Metal => Err(EngineError::Backend(
            "metal".into(),
            "not available in this build yet (use --backend cpu)".into(),
        )),
        BackendChoice::Auto => Ok(open("cuda", ds4_gpu::Backend::Cuda)
            .or_else(|_| open("rocm", ds4_gpu::Backend::Rocm))
            .ok()),
        BackendChoice::Cuda | BackendChoice::Rocm => {
            let (name, which) = match choice {
                BackendChoice::Cuda => ("cuda", ds4_gpu::Backend::Cuda),
                _ => ("rocm", ds4_gpu::Backend::Rocm),
            };
            open(name, which).map(Some).map_err(|e| {
                EngineError::Backend(
                    name.into(),
                    format!("{e}\nno usable GPU: use --backend cpu"),
                )
            })
        }
    }
}

/// `cuda (NVIDIA H200 sm_90a, fast precision)`.
fn gpu_line(name: &str, gpu: &ds4_gpu::Gpu, precision: Precision) -> String {
    let i = gpu.info();
    format!(
        "{name} ({} {}, {} precision)",
        i.name,
        i.arch,
        precision.name()
    )
}

/// Device memory kept free beside the weights: session state at the default context, scratch
/// pools, kernel modules, the BLAS workspace. Measured on an H100 (session 41): a 2,048-token
/// prompt at the smallest prefill step (2,048 tokens: 1 GiB of scratch) used 2.3 GiB beside the
/// weights and their copies; with 1 GiB kept the q2 mix loaded and then ran out of memory at
/// its first prompt.
const GPU_RESERVE: u64 = 3 << 30;

/// Why `weights` bytes of weights do not fit a device with `free` of `total` bytes free (None:
/// they fit with [`GPU_RESERVE`] to spare). Said before anything is uploaded.
pub fn gpu_fit_error(weights: u64, free: u64, total: u64, device: &str) -> Option<String> {
    if weights.saturating_add(GPU_RESERVE) <= free {
        return None;
    }
    Some(format!(
        "the model's weights need {:.1} GiB of device memory (with the GPU's decode-layout \
         copies of the Q8_0 matrices where they fit; plus ~{:.0} GiB for session state and \
         scratch), but {device} has {:.1} of {:.1} GiB free: keep routed experts in host memory \
         (--cpu-experts auto, the default, or a layer count), use a smaller mix (the q2 file is \
         80.8 GiB), another GPU (--device N), or --backend cpu",
        gib(weights),
        gib(GPU_RESERVE),
        gib(free),
        gib(total)
    ))
}

/// The resident GPU backend on `pick`, for a model with `weights` bytes of weights and `hp`,
/// and its backend line; a clear error first when the weights cannot fit its free memory.
fn gpu_backend(
    pick: GpuPick,
    hp: &HParams,
    weights: u64,
    precision: Precision,
) -> Result<(ds4_gpu::GpuBackend, String), EngineError> {
    let line = gpu_line(pick.name, &pick.gpu, precision);
    if let Ok((free, total)) = pick.gpu.mem_info() {
        let dev = format!("GPU {} ({})", pick.gpu.info().index, pick.gpu.info().name);
        if let Some(e) = gpu_fit_error(weights, free, total, &dev) {
            return Err(EngineError::Backend(pick.name.into(), e));
        }
    }
    ds4_gpu::GpuBackend::set_precision(precision);
    let b = ds4_gpu::GpuBackend::new(pick.gpu, &rope_tables(hp))
        .map_err(|e| EngineError::Backend(pick.name.into(), e.to_string()))?;
    Ok((b, line))
}

/// [`gpu_backend`] for a model whose routed experts may stay in host memory
/// (`opts.cpu_experts`): the backend, its line (saying where the experts are), the layers
/// whose experts are in host memory and their bytes. `weights`: all the weights' own bytes,
/// `copies`: the GPU's layout copies of them ([`place_weights`] decides whether it makes them).
fn gpu_backend_placed(
    pick: GpuPick,
    hp: &HParams,
    weights: u64,
    copies: u64,
    movable: &Movable,
    opts: &EngineOptions,
) -> Result<(ds4_gpu::GpuBackend, String, Vec<usize>, u64), EngineError> {
    let mem = pick.gpu.mem_info().ok();
    let free = mem.map(|m| m.0);
    let (host, keep) = place_weights(opts.cpu_experts, movable, weights, copies, free);
    let (on_host, dev_weights) = placed_bytes(movable, weights, copies, &host, keep);
    let per_layer = movable.per_layer;
    if let (false, Some((free, total))) = (host.is_empty(), mem) {
        let dev = format!("GPU {} ({})", pick.gpu.info().index, pick.gpu.info().name);
        let what = (host.len(), per_layer.len(), on_host);
        if let Some(e) = host_fit_error(what, dev_weights, free, total, &dev) {
            return Err(EngineError::Backend(pick.name.into(), e));
        }
    }
    let (b, mut line) = gpu_backend(pick, hp, dev_weights, opts.precision)?;
    if !keep {
        // No room for both layouts: the Q8_0 matrices keep the decode layout alone (the
        // decode kernels' layout, 16-byte aligned: ~20% faster decode than the blocks at the
        // same bytes) where the vendor BLAS runs prompts, the F16 ones their plain layout.
        b.without_layout_copies();
    }
    if !host.is_empty() {
        line += &host_experts_line(host.len(), per_layer.len(), on_host, opts.precision);
    }
    if !keep && copies > 0 {
        line += &format!(
            "; {} ({:.1} GiB of device memory kept for the weights)",
            if b.q8_decode_only() {
                "Q8_0 matrices in the decode layout only, without their GGUF blocks"
            } else {
                "no decode-layout copies of the Q8_0 matrices"
            },
            gib(copies)
        );
    }
    Ok((b, line, host, on_host))
}

/// The backend line's part for host-memory experts: how many layers, how much memory, and the
/// arithmetic of their decode steps ([`cpu_host_experts`]).
fn host_experts_line(n_host: usize, n_layer: usize, bytes: u64, precision: Precision) -> String {
    let act = match precision {
        Precision::Fast => "int8",
        Precision::Exact => "f32",
    };
    format!(
        "; routed experts of {n_host} of {n_layer} layers in host memory ({:.1} GiB, {act} \
         activations on the CPU; --cpu-experts)",
        gib(bytes)
    )
}

/// The backend line once the model is loaded, where the model reads its embedding table from
/// host memory in place (`bytes` > 0: `ds4_model::offload::HOST_TABLE`).
fn with_table_note(line: String, bytes: usize) -> String {
    match bytes {
        0 => line,
        b => format!(
            "{line}; embedding table in host memory ({:.1} GiB, its rows read over the bus)",
            gib(b as u64)
        ),
    }
}

/// The backend line once the model is loaded (the plan's line is written before the stacks
/// are page-locked): where every batch copies its selected host-memory experts over the bus
/// (`ds4_model::offload::Gather`), the CPU does none of their arithmetic, and the line says so;
/// where the model holds one host layer on the GPU (`buffered`: the layer buffer of
/// `ds4_model::forward`), it says that too.
fn with_gather_note(line: String, gathers: bool, buffered: Option<usize>) -> String {
    let mut line = line;
    if gathers {
        for act in ["int8", "f32"] {
            let planned = format!(", {act} activations on the CPU; --cpu-experts)");
            if line.contains(&planned) {
                line = line.replacen(
                    &planned,
                    ", the selected ones copied to the GPU over the bus; --cpu-experts)",
                    1,
                );
                break;
            }
        }
    }
    match buffered {
        Some(l) => line.replacen(
            "; --cpu-experts)",
            &format!(
                "; layer {l}'s held on the GPU, prompts copy each host layer ahead of its use; \
                 --cpu-experts)"
            ),
            1,
        ),
        None => line,
    }
}

/// Bytes of a model's weights: all of them, the routed experts' part (split between
/// expert-parallel ranks), the part tensor parallelism splits (attention heads, shared expert),
/// and the quant block sizes of the tensors TP cuts by columns (`ds4_model::forward::tp_fits`).
#[derive(Clone, Copy, Default)]
struct RankBytes {
    all: u64,
    experts: u64,
    tp: u64,
    /// Layout copies a GPU rank makes ([`gpu_layout_bytes`]), of them those of TP-split tensors.
    layout: u64,
    layout_tp: u64,
    out_b_block: usize,
    down_block: usize,
}

impl RankBytes {
    /// Sizes from a model's tensors as (name, bytes, type, GGUF dims).
    fn of<'a>(tensors: impl Iterator<Item = (&'a str, u64, GgmlType, &'a [u64])>) -> RankBytes {
        let mut r = RankBytes::default();
        for (name, bytes, ty, dims) in tensors {
            let blk = ty.block_elems() as usize;
            let copy = gpu_layout_bytes(std::iter::once((ty, dims)));
            r.all += bytes;
            r.layout += copy;
            if name.contains("_exps.") {
                r.experts += bytes; // routed expert stacks: split over the ranks
            } else if ds4_model::forward::tp_splits(name) {
                r.tp += bytes;
                r.layout_tp += copy;
            }
            if name.ends_with("attn_output_b.weight") {
                r.out_b_block = r.out_b_block.max(blk);
            } else if name.ends_with("ffn_down_shexp.weight") {
                r.down_block = r.down_block.max(blk);
            }
        }
        r
    }

    /// Whether `n` ranks split the attention and shared expert too (`opts.tp` asked for it).
    fn tp(&self, hp: &HParams, n: usize, asked: bool) -> bool {
        asked && ds4_model::forward::tp_fits(hp, n, self.out_b_block, self.down_block)
    }

    /// The layout copies one of `n` ranks makes (with `tp`, of the TP-split tensors' parts).
    fn layout_per_rank(&self, n: usize, tp: bool) -> u64 {
        match tp {
            true => self.layout - (self.layout_tp - self.layout_tp / n as u64),
            false => self.layout,
        }
    }

    /// The most any of `n` ranks holds, layout copies included (ranks differ by at most one
    /// expert of each layer; with `tp`, the TP-split tensors in equal parts).
    fn per_rank(&self, n: usize, n_expert: usize, tp: bool) -> u64 {
        let most = n_expert.div_ceil(n) as u64;
        let split = if tp { self.tp - self.tp / n as u64 } else { 0 };
        self.all - self.experts - split
            + (self.experts * most).div_ceil(n_expert.max(1) as u64)
            + self.layout_per_rank(n, tp)
    }
}

/// An opened model, its backend line, and the device bytes of its weights (GPU backends).
type Opened = (Arc<dyn Forward>, String, Option<(u64, u64)>);

/// Loads one expert-parallel rank's model on backend `B` (its weights from a file or made on
/// the device), reporting `progress(done, total)` of that rank.
type RankLoader<'a, B> =
    dyn Fn(B, Shard, &mut dyn FnMut(usize, usize)) -> Result<Model<B>, String> + Sync + 'a;

/// Expert parallelism, and tensor parallelism where `opts.tp` and the model allow it
/// (`ds4_backend::shard`), over `opts.devices`: one rank per GPU joined by NCCL / RCCL
/// (`EngineOptions::ep_host_comm`: through host memory, which also lets ranks share a device:
/// tests), or `--backend cpu` reference ranks. Returns the model, its backend line and the
/// device bytes of rank 0's weights. GPU ranks load at once; progress sums them.
fn open_ranks(
    opts: &EngineOptions,
    hp: &HParams,
    sizes: RankBytes,
    progress: &mut dyn FnMut(usize, usize),
    load_gpu: &RankLoader<'_, ds4_gpu::GpuBackend>,
    load_cpu: &RankLoader<'_, CpuBackend>,
) -> Result<Opened, EngineError> {
    let n = opts.devices.len();
    let n_expert = hp.n_expert as usize;
    if n > n_expert {
        return Err(EngineError::Backend(
            "expert parallel".into(),
            format!("--devices names {n} ranks but the model has {n_expert} routed experts"),
        ));
    }
    let tp = sizes.tp(hp, n, opts.tp);
    let kind = if tp {
        "tensor + expert parallel"
    } else {
        "expert parallel"
    };
    let mut ranks: Vec<Box<dyn Forward>> = Vec::with_capacity(n);
    if opts.backend == BackendChoice::Cpu {
        let comm = HostComm::new(n);
        for rank in 0..n {
            let b = CpuBackend::new(rope_tables(hp)).with_comm(rank, comm.clone());
            let shard = Shard {
                rank,
                n_ranks: n,
                tp,
            };
            let m = load_cpu(b, shard, &mut |d, t| progress(rank * t + d, n * t))
                .map_err(|e| EngineError::Backend(format!("cpu rank {rank}"), e))?;
            ranks.push(Box::new(m));
        }
        let m = Sharded::new(ranks).map_err(|e| EngineError::Backend("cpu".into(), e))?;
        return Ok((Arc::new(m), format!("cpu x{n} ({kind})"), None));
    }
    // Every device first: a missing one is an error before anything loads.
    let mut picks = Vec::with_capacity(n);
    for &d in &opts.devices {
        let pick = pick_gpu(opts.backend, d)?.ok_or_else(|| {
            EngineError::Backend(
                "expert parallel".into(),
                format!(
                    "--devices: GPU {d} is not usable (expert parallelism runs on CUDA or ROCm \
                     GPUs; `ds4 devices` lists them; --backend cpu runs reference ranks)"
                ),
            )
        })?;
        picks.push(pick);
    }
    let name = picks[0].name;
    if picks.iter().any(|p| p.name != name) {
        return Err(EngineError::Backend(
            "expert parallel".into(),
            "--devices mixes CUDA and ROCm GPUs: one vendor per group".into(),
        ));
    }
    let mut comms: Vec<ds4_gpu::GpuComm> = if opts.ep_host_comm {
        let c = HostComm::new(n);
        (0..n)
            .map(|rank| ds4_gpu::GpuComm::Host {
                rank,
                comm: c.clone(),
            })
            .collect()
    } else {
        let vendor = picks[0].gpu.info().vendor;
        let ccl = ds4_gpu::ccl::Ccl::open(vendor).map_err(|e| {
            EngineError::Backend(
                name.into(),
                format!("{e}\nexpert parallelism (--devices) needs it"),
            )
        })?;
        Arc::new(ccl)
            .init_all(&opts.devices)
            .map_err(|e| EngineError::Backend(name.into(), e.to_string()))?
            .into_iter()
            .map(ds4_gpu::GpuComm::Ccl)
            .collect()
    };
    let per_rank = sizes.per_rank(n, n_expert, tp);
    let line = gpu_line(name, &picks[0].gpu, opts.precision);
    // Every rank's backend first (a device short of memory is an error before any upload),
    // then the ranks load at once, one thread each: the uploads of several GPUs overlap.
    let mut backends = Vec::with_capacity(n);
    for (rank, pick) in picks.into_iter().enumerate() {
        let dev = pick.gpu.info().index;
        // A rank whose share fits only without the layout copies makes none and keeps its Q8_0
        // matrices in the decode layout alone (as one GPU does, `place_weights`); the fit
        // check then counts the weights alone.
        let copies = sizes.layout_per_rank(n, tp);
        let keep = match pick.gpu.mem_info() {
            Ok((free, _)) => per_rank.saturating_add(GPU_RESERVE) <= free,
            Err(_) => true,
        };
        let need = if keep { per_rank } else { per_rank - copies };
        let (b, _) = gpu_backend(pick, hp, need, opts.precision)?;
        if !keep {
            b.without_layout_copies();
        }
        let shard = Shard {
            rank,
            n_ranks: n,
            tp,
        };
        backends.push((b.with_comm(comms.remove(0)), shard, dev));
    }
    // Progress: the ranks' bytes so far over their totals, reported from this thread (the
    // callback need not be Send) while the loads run.
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let done: Vec<(AtomicUsize, AtomicUsize)> = (0..n).map(|_| Default::default()).collect();
    let running = AtomicUsize::new(n);
    let loaded: Vec<Result<Model<ds4_gpu::GpuBackend>, EngineError>> = std::thread::scope(|s| {
        let hs: Vec<_> = backends
            .into_iter()
            .map(|(b, shard, dev)| {
                let (done, running) = (&done, &running);
                s.spawn(move || {
                    let rank = shard.rank;
                    let err =
                        |e| EngineError::Backend(format!("{name} rank {rank} (GPU {dev})"), e);
                    let r = load_gpu(b, shard, &mut |d, t| {
                        done[rank].0.store(d, Relaxed);
                        done[rank].1.store(t, Relaxed);
                    })
                    .map_err(err)
                    .and_then(|m| m.backend.finish().map_err(err).map(|_| m));
                    running.fetch_sub(1, Relaxed);
                    r
                })
            })
            .collect();
        let sum = || {
            done.iter().fold((0, 0), |(a, b), (d, t)| {
                (a + d.load(Relaxed), b + t.load(Relaxed))
            })
        };
        while running.load(Relaxed) > 0 {
            let (d, t) = sum();
            if t > 0 {
                progress(d, t);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let (d, t) = sum();
        progress(d, t.max(d));
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(EngineError::Backend(
                        name.into(),
                        "a rank's load panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut wb0 = None;
    for m in loaded {
        let m = m?;
        wb0.get_or_insert((m.backend.weight_bytes(), m.backend.layout_bytes()));
        ranks.push(Box::new(m));
    }
    let m = Sharded::new(ranks).map_err(|e| EngineError::Backend(name.into(), e))?;
    let devs: Vec<String> = opts.devices.iter().map(|d| d.to_string()).collect();
    Ok((
        Arc::new(m),
        format!("{line}, {kind} on GPUs {}", devs.join(",")),
        wb0,
    ))
}

impl Engine {
    pub fn open(opts: &EngineOptions) -> Result<Engine, EngineError> {
        Engine::open_with_progress(opts, &mut |_, _| {})
    }

    /// [`Engine::open`], calling `progress(bytes_done, bytes_total)` while weights load.
    pub fn open_with_progress(
        opts: &EngineOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Engine, EngineError> {
        check_cpu_experts(opts)?;
        let pick = if opts.devices.len() > 1 {
            None // expert parallelism: each rank's device below
        } else {
            pick_gpu(
                opts.backend,
                opts.devices.first().copied().unwrap_or(opts.device),
            )?
        };
        if let Some(t) = opts.threads {
            // Only the first engine of a process sets the pool size; later calls keep it.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build_global();
        }
        let file = Arc::new(GgufFile::open(&opts.model)?);
        let hp = HParams::from_meta(file.as_ref())?;
        let dir = bind_main(&file, &hp)?;
        let name = opts.model.display().to_string();
        let (tokens, merges) = ds4_model::gguf_meta::vocab(&file)?;
        let tokenizer = Tokenizer::from_vocab(tokens, merges)
            .map_err(|e| EngineError::Tokenizer(name.clone(), e))?;
        let model_id: [u8; 32] =
            Sha256::digest(&file.bytes()[..file.data_offset() as usize]).into();
        let mut files = vec![(file, dir)];
        if let Some(p) = &opts.mtp {
            let mf = Arc::new(GgufFile::open(p)?);
            let mdir = ds4_model::bind_mtp(&mf, &hp)?;
            files.push((mf, mdir));
        }
        let (model, backend, weight_bytes): Opened = match pick {
            _ if opts.devices.len() > 1 => {
                let sizes = RankBytes::of(
                    files
                        .iter()
                        .flat_map(|(f, _)| f.tensors())
                        .map(|t| (t.name.as_str(), t.n_bytes, t.ty, &t.dims[..])),
                );
                let rounding = opts.rounding;
                let (m, line, wb) = open_ranks(
                    opts,
                    &hp,
                    sizes,
                    progress,
                    &|b, shard, p| Model::load_shard(b, hp.clone(), &files, rounding, shard, p),
                    &|b, shard, p| Model::load_shard(b, hp.clone(), &files, rounding, shard, p),
                )?;
                (m, line, wb)
            }
            Some(pick) => {
                let name = pick.name;
                let tensors = || files.iter().flat_map(|(f, _)| f.tensors());
                let weights = tensors().map(|t| t.n_bytes).sum::<u64>();
                let copies = gpu_layout_bytes(tensors().map(|t| (t.ty, &t.dims[..])));
                let named = || {
                    files[0]
                        .0
                        .tensors()
                        .iter()
                        .map(|t| (t.name.as_str(), t.n_bytes))
                };
                let per_layer = expert_bytes_per_layer(hp.n_layer as usize, named());
                let movable = Movable {
                    per_layer: &per_layer,
                    n_expert: hp.n_expert as usize,
                    table: host_table_bytes(named()),
                };
                let (b, mut line, host, on_host) =
                    gpu_backend_placed(pick, &hp, weights, copies, &movable, opts)?;
                let note = meminfo("MemTotal").and_then(|r| host_cache_note(on_host, r));
                if let Some(note) = &note {
                    line += note;
                }
                let ropes = rope_tables(&hp);
                let make = cpu_host_experts(&ropes, opts.precision);
                let placement = HostPlacement::new(host, &make);
                let mut src = ds4_model::forward::FileSource::new(&files, progress);
                // Host stacks that the page cache can hold: read in the background from now.
                src.prefetch_host = note.is_none();
                let m = Model::load_placed(
                    b,
                    hp,
                    &mut src,
                    opts.rounding,
                    Shard::ONE,
                    Some(&placement),
                )
                .map_err(|e| EngineError::Backend(name.into(), e))?;
                m.backend
                    .finish()
                    .map_err(|e| EngineError::Backend(name.into(), e))?;
                let wb = (m.backend.weight_bytes(), m.backend.layout_bytes());
                let line =
                    with_gather_note(line, m.gathers_host_experts(), m.buffered_host_layer());
                let line = with_table_note(line, m.host_table_bytes());
                (Arc::new(m), line, Some(wb))
            }
            None => {
                let cpu = CpuBackend::new(rope_tables(&hp));
                let m = Model::load(cpu, hp, &files, opts.rounding, progress)
                    .map_err(|e| EngineError::Backend("cpu".into(), e))?;
                (Arc::new(m), "cpu".to_string(), None)
            }
        };
        Ok(Engine {
            model,
            tokenizer: Arc::new(tokenizer),
            model_id,
            path: opts.model.clone(),
            backend,
            weight_bytes,
            device_picks: None,
        })
    }

    /// A file-less model of `preset` shape with random weights generated on the GPU from
    /// `seed` (benchmarks). The full presets use the real DeepSeek V4 tokenizer. The CPU
    /// backend cannot generate weights: that is an error (write a file with `ds4 synth`).
    pub fn open_synthetic(
        preset: SynthPreset,
        opts: &EngineOptions,
        seed: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Engine, EngineError> {
        let (mut hp, mix) = preset.params();
        // A dev knob: the first N layers only (decode A/B runs on a GPU too small for all).
        let layers = std::env::var("DS4_SYNTH_LAYERS").ok();
        if let Some(v) = &layers {
            let n = v.parse::<u32>().map_err(|_| {
                EngineError::Backend(
                    "synthetic".into(),
                    format!("DS4_SYNTH_LAYERS={v}: expected a number of layers"),
                )
            })?;
            hp.keep_layers(n);
        }
        // --backend cpu, or auto finding no GPU (auto then means the CPU).
        let on_cpu = || {
            EngineError::Backend(
                "cpu".into(),
                "synthetic models are generated on a GPU (--backend cuda or rocm); for the CPU \
                 write one with `ds4 synth` and pass it with -m"
                    .into(),
            )
        };
        if opts.backend == BackendChoice::Cpu {
            return Err(on_cpu());
        }
        check_cpu_experts(opts)?;
        let vocab = if hp.n_vocab as usize == ds4_tokenizer::builtin::DEEPSEEK_V4_VOCAB_SIZE {
            ds4_tokenizer::builtin::deepseek_v4()
        } else {
            ds4_tokenizer::builtin::tiny(hp.n_vocab as usize)
        };
        let label = match layers {
            Some(_) => format!(
                "<synthetic {} seed {seed}, first {} layers>",
                preset.name(),
                hp.n_layer
            ),
            None => format!("<synthetic {} seed {seed}>", preset.name()),
        };
        let tokenizer = Tokenizer::from_vocab(vocab.tokens, vocab.merges)
            .map_err(|e| EngineError::Tokenizer(label.clone(), e))?;
        let model_id: [u8; 32] = Sha256::digest(label.as_bytes()).into();
        if opts.devices.len() > 1 {
            let sizes = ds4_model::tensors::mix_sizes(&hp, mix);
            let sizes = RankBytes::of(
                sizes
                    .iter()
                    .map(|(t, ty, b)| (t.name.as_str(), *b, *ty, &t.dims[..])),
            );
            let rounding = opts.rounding;
            let (model, backend, wb) = open_ranks(
                opts,
                &hp,
                sizes,
                progress,
                &|b, shard, p| {
                    let mut src = SynthSource::new(&hp, mix, seed, p).with_mtp(opts.synthetic_mtp);
                    Model::load_from_shard(b, hp.clone(), &mut src, rounding, shard)
                },
                &|_, _, _| Err("synthetic models are generated on a GPU".into()),
            )?;
            return Ok(Engine {
                model,
                tokenizer: Arc::new(tokenizer),
                model_id,
                path: PathBuf::from(label),
                backend,
                weight_bytes: wb,
                device_picks: None,
            });
        }
        let Some(pick) = pick_gpu(opts.backend, opts.device)? else {
            return Err(on_cpu());
        };
        let name = pick.name;
        let sizes = ds4_model::tensors::mix_sizes(&hp, mix);
        let named = || sizes.iter().map(|(t, _, b)| (t.name.as_str(), *b));
        let per_layer = expert_bytes_per_layer(hp.n_layer as usize, named());
        let movable = Movable {
            per_layer: &per_layer,
            n_expert: hp.n_expert as usize,
            table: host_table_bytes(named()),
        };
        let mut src = SynthSource::new(&hp, mix, seed, progress).with_mtp(opts.synthetic_mtp);
        let weights = src.total_bytes() as u64;
        let copies = gpu_layout_bytes(sizes.iter().map(|(t, ty, _)| (*ty, &t.dims[..])));
        // Host-memory stacks are generated on the device, then copied out and freed there.
        let (b, line, host, on_host) =
            gpu_backend_placed(pick, &hp, weights, copies, &movable, opts)?;
        if let Some(e) = mem_available().and_then(|a| host_memory_error(host.len(), on_host, a)) {
            return Err(EngineError::Backend(name.into(), e));
        }
        let ropes = rope_tables(&hp);
        let make = cpu_host_experts(&ropes, opts.precision);
        let placement = HostPlacement::new(host, &make);
        let m = Model::load_placed(b, hp, &mut src, opts.rounding, Shard::ONE, Some(&placement))
            .map_err(|e| EngineError::Backend(name.into(), e))?;
        // Random weights are generated by queued kernels: wait for them here, so that the
        // caller's first prompt (a benchmark's timer) does not include their tail.
        m.backend
            .finish()
            .map_err(|e| EngineError::Backend(name.into(), e))?;
        // The host table was generated there too (counted, then freed).
        let wb = (
            (m.backend.weight_bytes()).saturating_sub(on_host + m.host_table_bytes() as u64),
            m.backend.layout_bytes(),
        );
        let line = with_gather_note(line, m.gathers_host_experts(), m.buffered_host_layer());
        let line = with_table_note(line, m.host_table_bytes());
        Ok(Engine {
            model: Arc::new(m),
            tokenizer: Arc::new(tokenizer),
            model_id,
            path: PathBuf::from(label),
            backend: line,
            weight_bytes: Some(wb),
            device_picks: None,
        })
    }

    /// Where new sessions' speculative steps pick: on the backend (`Some(true)`, a GPU's way),
    /// on the host from the logits (`Some(false)`, the CPU's), or as the backend does (None).
    /// [`Session::set_device_picks`] for one session; for tests and A/B runs.
    pub fn set_device_picks(&mut self, on: Option<bool>) {
        self.device_picks = on;
    }

    /// Whether an MTP block is loaded (sessions can draft).
    pub fn has_mtp(&self) -> bool {
        self.model.has_mtp()
    }

    /// Device bytes held by the model's weights (GPU backends), None on the CPU.
    pub fn gpu_weight_bytes(&self) -> Option<u64> {
        self.weight_bytes.map(|w| w.0)
    }

    /// Device bytes of the weights' copies in other layouts made at upload (GPU backends: the
    /// Q8_0 matrices' decode layout), None on the CPU. With several ranks: rank 0's.
    pub fn gpu_layout_bytes(&self) -> Option<u64> {
        self.weight_bytes.map(|w| w.1)
    }

    pub fn hparams(&self) -> &HParams {
        self.model.hp()
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// SHA-256 of the GGUF header: the model identity stored in snapshots and disk caches.
    pub fn model_id(&self) -> [u8; 32] {
        self.model_id
    }

    /// The backend in use, as a human-readable line.
    /// Device bytes of weight copies the backend made after loading (GPU: the bf16 operands of
    /// the dense prefill products, made at the first prompt), None on the CPU.
    pub fn gpu_weight_copy_bytes(&self) -> Option<u64> {
        self.weight_bytes.map(|_| self.model.weight_copy_bytes())
    }

    /// Free and total device memory now (GPU backends; several ranks: the one with the least
    /// free), None on the CPU.
    pub fn gpu_memory(&self) -> Option<(u64, u64)> {
        self.model.device_memory()
    }

    pub fn backend_name(&self) -> &str {
        &self.backend
    }

    /// A new session able to hold `ctx` tokens.
    pub fn new_session(&self, ctx: usize) -> Session {
        Session {
            model: self.model.clone(),
            model_id: self.model_id,
            state: self.model.new_state(ctx),
            logits: None,
            streams: None,
            mtp: self.model.has_mtp().then(|| self.model.new_mtp_state()),
            keep_streams: false,
            ctx,
            steps: Vec::new(),
            model_steps: 0,
            undo: None,
            device_picks: self.device_picks.unwrap_or(self.weight_bytes.is_some()),
        }
    }

    /// Bytes of session state for a context of `ctx` tokens: the raw window of every layer,
    /// compressor frontiers, and the compressed/indexer rows at full context (f32, as the CPU
    /// backend stores them).
    pub fn memory_estimate(&self, ctx: usize) -> u64 {
        self.hparams().session_bytes(ctx, 4, 4)
    }

    /// The same on the device of a GPU backend (None on the CPU): the indexer's rows take 2
    /// bytes a value there when FP4-simulated (bf16, exact; ds4-gpu `GpuComp::bf16`), and the
    /// compressed rows' capacity is the context's rows rounded up to 64 (ds4-gpu `ROW_ALIGN`;
    /// counted here as the context rounded up to 64 rows of the sparsest ratio, 128).
    pub fn gpu_state_estimate(&self, ctx: usize) -> Option<u64> {
        self.weight_bytes?;
        let fp4 = self.model.layer_dims().iter().any(|l| l.index_fp4);
        Some(self.hparams().session_bytes(
            ctx.next_multiple_of(64 * 128),
            4,
            if fp4 { 2 } else { 4 },
        ))
    }
}

/// `DS4_SPEC_ROLLBACK=whole`: every rejected draft rolls its verify batch back whole and
/// evaluates the kept token again (the form before slot marks; for A/B timings).
fn spec_rollback_whole() -> bool {
    std::env::var("DS4_SPEC_ROLLBACK").is_ok_and(|v| v == "whole")
}

/// Speculative decoding counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    pub drafted: usize,
    pub accepted: usize,
    /// Rejected drafts dropped in place: the verify batch's first row kept, only the draft's
    /// writes undone (`Forward::checkpoint_last`); the other rejections rolled the batch back
    /// and evaluated the kept token again (`DS4_SPEC_ROLLBACK=whole`, or a backend without
    /// slot marks).
    pub undone: usize,
}

impl SpecStats {
    /// Counts one [`Session::eval_draft`] step: a draft made (kept or not), or none.
    pub fn note(&mut self, r: Drafted) {
        match r {
            Drafted::Accepted(_) => {
                (self.drafted, self.accepted) = (self.drafted + 1, self.accepted + 1)
            }
            Drafted::Rejected(_) => self.drafted += 1,
            Drafted::NoDraft => {}
        }
    }

    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Tokens per batched step when logits of every position are wanted (`eval_all`: chunk × vocab
/// floats). Prompt sync batches by the backend's own `Forward::prefill_chunk` instead.
pub const PREFILL_CHUNK: usize = 128;

/// One conversation's model state. Sessions are independent; several may exist at once.
/// A session's state in host memory as [`Session::capture`] took it. Memory: the raw window
/// and compressed rows as f32 (up to twice the encoded size, whose rows may be f16).
pub struct Capture {
    hp: HParams,
    model_id: [u8; 32],
    state: ds4_model::forward::HostState,
    logits: Option<Vec<f32>>,
}

impl Capture {
    /// The snapshot bytes (`snapshot.rs`), as [`Session::snapshot`] at capture time.
    pub fn encode(&self) -> Vec<u8> {
        snapshot::write(
            &self.hp,
            &self.model_id,
            &self.state,
            self.logits.as_deref(),
        )
    }

    /// Positions held.
    pub fn tokens(&self) -> &[u32] {
        &self.state.tokens
    }
}

pub struct Session {
    model: Arc<dyn Forward>,
    model_id: [u8; 32],
    state: AnyState,
    logits: Option<Vec<f32>>,
    /// Final hyper-connection streams of the last position (the MTP block's input).
    streams: Option<Vec<f32>>,
    /// The MTP block's own raw window (drafts only; rebuilt, never snapshotted).
    mtp: Option<AnyLayerState>,
    /// Keep `streams` after each step without an MTP block ([`Session::set_keep_streams`]).
    keep_streams: bool,
    ctx: usize,
    /// Tokens of each step the last [`Session::sync`] evaluated.
    steps: Vec<usize>,
    /// Model steps run ([`Session::model_steps`]).
    model_steps: u64,
    /// How to take back the draft that [`Session::eval_draft`] kept, until the next evaluation.
    undo: Option<Undo>,
    /// The backend picks tokens on a device ([`Session::eval_sampled`] hands back only the id):
    /// speculative steps pick there too (a host pick costs a download and a host `select`, 4.7
    /// ms over the whole vocabulary on a 2-core host, `ds4-backend` example `select_bench`).
    device_picks: bool,
}

/// A kept draft's way back: the verify step's checkpoint of the draft's writes (or of the whole
/// state before the batch, `whole`), and the batch's row of the token before the draft.
struct Undo {
    cp: ds4_model::forward::AnyCheckpoint,
    whole: bool,
    token: u32,
    /// None where the verify step picked on the device (no logits left it).
    logits: Option<Vec<f32>>,
    streams: Option<Vec<f32>>,
    /// The verify step's device pick after the draft ([`Session::pick`] takes it).
    ahead: Option<Ahead>,
}

/// A pick after a kept draft made on the device by its verify step, with the settings and the
/// draw it was made with: the caller's next pick is this one when its sampler has those settings
/// and that next draw (the draw plain decoding would take there).
#[derive(Clone, Copy)]
struct Ahead {
    id: u32,
    p: SampleParams,
    u: f64,
}

/// How a verify step judges the draft.
enum Judge<'a> {
    /// On the host, from the logits after the token before the draft.
    Host(&'a mut dyn FnMut(&[f32]) -> bool),
    /// On the device: both rows picked with `p` and `draws` (only the ids leave it);
    /// `keep(pick after the token before the draft)`.
    Device {
        p: SampleParams,
        draws: [f64; 2],
        keep: &'a mut dyn FnMut(u32) -> bool,
    },
}

/// How [`Session::verify`] left a draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Kept,
    /// Rejected; its writes restored in place.
    Undone,
    /// Rejected; the batch rolled back whole and the token before it evaluated again.
    Redone,
}

/// What [`Session::eval_draft`] did with its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafted {
    /// No draft this step (no MTP block, no streams of the last position, the context's end,
    /// or the drafter failed): nothing was evaluated; evaluate the token another way.
    NoDraft,
    /// The pick after the token was not the draft: the state is after the token and this is
    /// the pick (as [`Session::eval_sampled`] returns it).
    Rejected(u32),
    /// The pick after the token was the draft, this id: the state is after the token and the
    /// draft, [`Session::logits`] are those after the draft (pick the next token from them), and
    /// [`Session::undo_draft`] takes the draft back until the next evaluation.
    Accepted(u32),
}

impl Session {
    pub fn tokens(&self) -> &[u32] {
        &self.state.tokens
    }

    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Tokens [`Session::sync`] evaluates per batch now: the backend's prompt step (128 on the
    /// CPU; 2,048-12,288 on a GPU, sized to the memory free before each step). A caller that prefills piecewise
    /// (to check for cancellation) should cut at multiples of it: smaller pieces re-read every
    /// routed expert's weights per piece, and host-memory experts cross the bus each time.
    pub fn prefill_step(&self) -> usize {
        self.model.prefill_chunk().max(1)
    }

    /// Model steps this session has run: each prompt batch, decode step and speculative verify
    /// step counts one (what drafts save; a pick that re-evaluates a draft shows here).
    pub fn model_steps(&self) -> u64 {
        self.model_steps
    }

    /// Tokens of each batch the last [`Session::sync`] evaluated (the GPU's prompt steps).
    pub fn last_steps(&self) -> &[usize] {
        &self.steps
    }

    /// Logits after the last evaluated token (None before the first).
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// `tokens` are valid ids and a session of `needed` tokens fits the context.
    fn check(&self, needed: usize, tokens: &[u32]) -> Result<(), EngineError> {
        let v = self.model.hp().n_vocab as usize;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(EngineError::BadToken(bad, v));
        }
        if needed > self.ctx {
            return Err(EngineError::ContextFull {
                needed,
                ctx: self.ctx,
            });
        }
        Ok(())
    }

    /// Keep the last position's final streams after each step even without an MTP file, so
    /// [`Session::generate_with_drafter`] drafts with any drafter (the benchmark's oracle, tests).
    /// Costs one download of N·D floats a step; off by default (with MTP they are kept anyway).
    pub fn set_keep_streams(&mut self, on: bool) {
        self.keep_streams = on;
    }

    /// Evaluate one token at the next position.
    pub fn eval(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.check(self.state.tokens.len() + 1, &[token])?;
        self.undo = None;
        self.step(&[token])?;
        Ok(self.logits.as_deref().unwrap_or_default())
    }

    /// Evaluate one token at the next position and return the token `sampler` picks after it,
    /// chosen on the backend (a GPU hands back only the id; `DS4_GPU_SAMPLE=off`: on the host).
    /// The same token as `sampler.sample(self.eval(token)?)` for the same sampler state; the
    /// session keeps no logits afterwards (use [`Session::eval`] where logprobs are wanted).
    pub fn eval_sampled(&mut self, token: u32, sampler: &mut Sampler) -> Result<u32, EngineError> {
        self.check(self.state.tokens.len() + 1, &[token])?;
        self.undo = None;
        let u = sampler.draw();
        self.model_steps += 1;
        let r = self
            .model
            .eval_sample(&mut self.state, token, &sampler.params(), u);
        let id = self.backend_result(r)?;
        self.logits = None;
        self.streams = None;
        Ok(id)
    }

    /// Evaluate `tokens` through the batched prompt path; logits after every position.
    pub fn eval_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.check(self.state.tokens.len() + tokens.len(), tokens)?;
        self.undo = None;
        let mut out = Vec::with_capacity(tokens.len());
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            self.model_steps += 1;
            let r = self.model.eval_batch(&mut self.state, chunk, true, false);
            out.extend(self.backend_result(r)?.0);
        }
        self.logits = out.last().cloned();
        self.streams = None;
        Ok(out)
    }

    /// Bring the session to exactly `tokens`: extend when the live state is a prefix, rebuild
    /// otherwise (DS4's compressed state is append-only, model.md §4.4). `progress(done, total)`
    /// is called per evaluated token. Returns how many tokens were reused.
    pub fn sync(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<usize, EngineError> {
        self.check(tokens.len(), tokens)?;
        self.undo = None;
        let live = &self.state.tokens;
        let reuse = if live.len() <= tokens.len() && tokens[..live.len()] == live[..] {
            live.len()
        } else {
            0
        };
        if reuse == 0 && !live.is_empty() {
            self.reset();
        }
        let todo = &tokens[reuse..];
        let mut done = 0;
        self.steps.clear();
        while done < todo.len() {
            // Asked before every step: a GPU sizes it to the memory free now, which the
            // session state takes more of as the context grows.
            let step = self.model.prefill_chunk().max(1).min(todo.len() - done);
            // Bit-identical to evaluating one token at a time (see ds4-cpu's prefill test).
            self.step(&todo[done..done + step])?;
            self.steps.push(step);
            done += step;
            progress(done, todo.len());
        }
        Ok(reuse)
    }

    /// Evaluate a batch; keep the last position's logits and streams.
    fn step(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
        self.model_steps += 1;
        // Streams feed the MTP drafter (its state may be lent out during generation).
        let want = self.keep_streams || self.model.has_mtp();
        let r = self.model.eval_batch(&mut self.state, tokens, false, want);
        let (mut l, mut s) = self.backend_result(r)?;
        self.logits = l.pop();
        self.streams = s.pop();
        Ok(())
    }

    /// A backend failure leaves the state undefined: drop it, report the error (with what to
    /// change where the device ran out of memory).
    fn backend_result<T>(&mut self, r: Result<T, String>) -> Result<T, EngineError> {
        r.map_err(|e| {
            self.reset();
            EngineError::Backend(self.model.backend_name(), out_of_memory_hint(e))
        })
    }

    /// Whether MTP drafting is available (an MTP file was loaded).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Evaluates [`next`, `d`] (positions t, t + 1) as one step and keeps the draft when the
    /// judge says so (from the logits after next on the host, or from the device's pick after
    /// next): the state is then after `d` with its row's logits (host judge) and streams, and
    /// `self.undo` holds the way back to `next`. Otherwise the draft is undone: its writes alone
    /// restored, the batch's row of `next` kept (on the CPU bit-identical to a step of `next`
    /// alone; on a GPU the 2-token kernels' sums, as a kept draft's rows are), or without slot
    /// marks (`DS4_SPEC_ROLLBACK=whole`) the batch rolled back and `next` evaluated again. The
    /// device judge's picks after next and after d are returned.
    fn verify(
        &mut self,
        next: u32,
        d: u32,
        judge: Judge,
    ) -> Result<(Verdict, Option<[u32; 2]>), EngineError> {
        let t = self.state.tokens.len();
        let light = if spec_rollback_whole() {
            None
        } else {
            self.model.checkpoint_last(&self.state, t + 1)
        };
        let (cp, whole) = match light {
            Some(cp) => (cp, false),
            None => (self.model.checkpoint(&self.state), true),
        };
        self.model_steps += 1;
        // The rows' logits (host judge) or picks (device judge), and streams.
        let (keep, picks, l0, l1, streams2) = match judge {
            Judge::Host(keep) => {
                let r = self
                    .model
                    .eval_batch(&mut self.state, &[next, d], true, true);
                let (logits2, streams2) = self.backend_result(r)?;
                let mut rows = logits2.into_iter();
                let l0 = rows.next().unwrap_or_default();
                (keep(&l0), None, Some(l0), rows.next(), streams2)
            }
            Judge::Device { p, draws, keep } => {
                let r = self
                    .model
                    .eval_pick(&mut self.state, &[next, d], &p, &draws, true);
                let (ids, streams2) = self.backend_result(r)?;
                let picks = [ids[0], ids[1]];
                (keep(picks[0]), Some(picks), None, None, streams2)
            }
        };
        let mut srows = streams2.into_iter();
        let (s0, s1) = (srows.next(), srows.next());
        if keep {
            self.logits = l1;
            self.streams = s1;
            self.undo = Some(Undo {
                cp,
                whole,
                token: next,
                logits: l0,
                streams: s0,
                ahead: None,
            });
            Ok((Verdict::Kept, picks))
        } else {
            self.undo = None;
            self.model.rollback(&mut self.state, cp);
            if whole {
                self.step(&[next])?;
                Ok((Verdict::Redone, picks))
            } else {
                self.logits = l0;
                self.streams = s0;
                Ok((Verdict::Undone, picks))
            }
        }
    }

    /// Evaluate `token` at the next position together with the MTP block's draft of the token
    /// after it, and pick the token after `token` with `sampler` (on the host, from the verify
    /// step's logits: one draw, as [`Session::eval_sampled`] takes). Kept when the pick is the
    /// draft, so the tokens are those plain sampling gives for the same draws, whatever the
    /// sampler (temperature, top-k, top-p, min-p; greedy too). On the CPU the logits are bit for
    /// bit a plain step's; on a GPU a 2-token step's sums. [`Drafted::NoDraft`]: nothing was
    /// evaluated (evaluate `token` with [`Session::eval`], which keeps the streams the next
    /// draft needs; [`Session::eval_sampled`] does not).
    pub fn eval_draft(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
    ) -> Result<Drafted, EngineError> {
        let t = self.state.tokens.len(); // position of `token`
        self.check(t + 1, &[token])?;
        self.undo = None;
        if t + 2 > self.ctx {
            return Ok(Drafted::NoDraft);
        }
        let (Some(mtp), Some(hs)) = (self.mtp.as_mut(), self.streams.as_deref()) else {
            return Ok(Drafted::NoDraft);
        };
        // A failed draft is no draft (the main model decides alone); the MTP block's row of
        // position t is written either way, as generate_greedy's drafts write it.
        let d = self.model.mtp_draft(mtp, hs, token, t).unwrap_or(u32::MAX);
        self.eval_with_draft(token, d, sampler)
    }

    /// [`Session::eval_draft`] with the draft `d` given (`u32::MAX` or another id out of the
    /// vocabulary: no draft): for other drafters, and for tests, which drive the kept and the
    /// rejected paths with perfect and adversarial drafts.
    pub fn eval_with_draft(
        &mut self,
        token: u32,
        d: u32,
        sampler: &mut Sampler,
    ) -> Result<Drafted, EngineError> {
        let t = self.state.tokens.len();
        self.check(t + 1, &[token])?;
        self.undo = None;
        if t + 2 > self.ctx || d as usize >= self.model.hp().n_vocab as usize {
            return Ok(Drafted::NoDraft);
        }
        if self.device_picks {
            // Both rows picked on the device: after `token` with this pick's draw, after the
            // draft with the sampler's next draw, which the caller's next pick takes where the
            // draft stands (`Session::pick`); a rejected draft's second pick is dropped, its draw
            // not taken.
            let p = sampler.params();
            let draws = [sampler.draw(), sampler.peek()];
            let judge = Judge::Device {
                p,
                draws,
                keep: &mut |id| id == d,
            };
            let (v, picks) = self.verify(token, d, judge)?;
            let [first, after] = picks.unwrap_or([u32::MAX; 2]);
            return Ok(if v == Verdict::Kept {
                if let Some(u) = self.undo.as_mut() {
                    u.ahead = Some(Ahead {
                        id: after,
                        p,
                        u: draws[1],
                    });
                }
                Drafted::Accepted(d)
            } else {
                Drafted::Rejected(first)
            });
        }
        let mut picked = u32::MAX;
        let (v, _) = self.verify(
            token,
            d,
            Judge::Host(&mut |l| {
                picked = sampler.sample(l);
                picked == d
            }),
        )?;
        Ok(if v == Verdict::Kept {
            Drafted::Accepted(d)
        } else {
            Drafted::Rejected(picked)
        })
    }

    /// The token `sampler` picks after the last evaluated token, taking one draw as
    /// `sampler.sample(logits)` does: from the session's logits, or after a draft kept by a step
    /// that picked on the device ([`Session::eval_draft`] on a GPU: no logits left the device),
    /// that step's pick after the draft where it was made with this sampler's settings and next
    /// draw. A sampler that differs there (the caller changed samplers at the draft: a tool
    /// block's structure is picked greedily) has the draft evaluated again alone for its logits
    /// (a step more; rare). None when there is nothing to pick from: nothing evaluated yet, or
    /// [`Session::eval_sampled`] handed its pick back instead of logits.
    pub fn pick(&mut self, sampler: &mut Sampler) -> Result<Option<u32>, EngineError> {
        if let Some(l) = self.logits.as_deref() {
            return Ok(Some(sampler.sample(l)));
        }
        let Some(u) = self.undo.as_mut() else {
            return Ok(None);
        };
        if let Some(a) = u.ahead.take() {
            if a.p == sampler.params() && a.u == sampler.peek() {
                sampler.draw();
                return Ok(Some(a.id));
            }
        }
        let d = self.state.tokens.last().copied().unwrap_or_default();
        self.undo_draft()?;
        self.step(&[d])?;
        Ok(self.logits.as_deref().map(|l| sampler.sample(l)))
    }

    /// Make speculative steps pick on the backend ([`Backend::sample_rows`]) as a device's
    /// session does, or on the host from the logits. For tests: on the CPU backend the two paths
    /// give the same picks, so the device path's bookkeeping runs without a device.
    pub fn set_device_picks(&mut self, on: bool) {
        self.device_picks = on;
    }

    /// Take back the draft that the last speculative step kept ([`Session::eval_draft`], or the
    /// last of [`Session::generate_with_verdict`]'s; nothing evaluated since): the state, logits
    /// and streams become those after the token before it, as a plain step of that token leaves
    /// them (bit for bit on the CPU; no logits where the step picked on the device). For a
    /// caller that stops at the draft (an end token, a stop sequence, the token limit), so the
    /// live state ends where plain decoding's does. False when there is nothing to take back.
    pub fn undo_draft(&mut self) -> Result<bool, EngineError> {
        let Some(u) = self.undo.take() else {
            return Ok(false);
        };
        self.model.rollback(&mut self.state, u.cp);
        if u.whole {
            self.step(&[u.token])?;
        } else {
            self.logits = u.logits;
            self.streams = u.streams;
        }
        Ok(true)
    }

    /// Greedy generation of up to `n` tokens. Each token is passed to `on_token`, which returns
    /// false to stop (that token is then not evaluated, e.g. EOS). With `speculative` and an
    /// MTP file, the MTP block drafts one token per step and the main model verifies it in the
    /// same batch; the output is identical to plain greedy decoding either way.
    pub fn generate_greedy(
        &mut self,
        n: usize,
        speculative: bool,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecStats, EngineError> {
        if speculative && self.mtp.is_some() {
            self.generate_mtp_with_verdict(n, &mut |pick, d| pick == d, on_token)
        } else {
            self.generate_with_drafter(n, &mut |_, _, _| u32::MAX, on_token)
        }
    }

    /// [`Session::generate_with_verdict`] with the MTP block as the drafter (no MTP block: no
    /// drafts): for benchmarks that time its drafts too (`ds4 bench --spec-mtp`).
    pub fn generate_mtp_with_verdict(
        &mut self,
        n: usize,
        accept: &mut dyn FnMut(u32, u32) -> bool,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecStats, EngineError> {
        let model = self.model.clone();
        let mut mtp = self.mtp.take();
        let mut draft = |hs: &[f32], tok: u32, pos: usize| match mtp.as_mut() {
            // A failed draft is no draft: the main model decides alone. The pick is made on
            // the backend (only the id crosses to the host).
            Some(st) => model.mtp_draft(st, hs, tok, pos).unwrap_or(u32::MAX),
            None => u32::MAX,
        };
        let r = self.generate_with_verdict(n, &mut draft, accept, on_token);
        self.mtp = mtp;
        r
    }

    /// Greedy generation with an arbitrary drafter. With positions 0..t−1 consumed and `next`
    /// the certain token for position t, `draft(streams of position t−1, next, t)` guesses the
    /// token at t+1 (`u32::MAX`: no draft). Public so tests can drive the accept and reject
    /// paths with perfect and adversarial drafters.
    pub fn generate_with_drafter(
        &mut self,
        n: usize,
        draft: &mut dyn FnMut(&[f32], u32, usize) -> u32,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecStats, EngineError> {
        self.generate_with_verdict(n, draft, &mut |pick, d| pick == d, on_token)
    }

    /// [`Session::generate_with_drafter`] with the verdict on each draft given by `accept(model's
    /// pick, draft)` instead of their equality: for benchmarks, which time the verify, rollback
    /// and re-evaluation paths at a chosen acceptance rate on random weights (the tokens are
    /// then not greedy's: an accepted draft is kept whatever the model picked).
    pub fn generate_with_verdict(
        &mut self,
        n: usize,
        draft: &mut dyn FnMut(&[f32], u32, usize) -> u32,
        accept: &mut dyn FnMut(u32, u32) -> bool,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecStats, EngineError> {
        let mut stats = SpecStats::default();
        let v = self.model.hp().n_vocab as usize;
        let mut produced = 0;
        // Greedy picks: from the logits, or after a kept draft its verify step's device pick;
        // `known`: a rejected draft's verify step picked the token after `next` on the device.
        let mut greedy = Sampler::new(SamplerConfig::default());
        let mut known = None;
        while produced < n {
            let next = match known.take() {
                Some(t) => t,
                None => match self.pick(&mut greedy)? {
                    Some(t) => t,
                    None => break,
                },
            };
            if !on_token(next) {
                break;
            }
            produced += 1;
            let t = self.state.tokens.len(); // position of `next`
            if t + 1 >= self.ctx {
                self.eval(next)?;
                break;
            }
            let d = match (&self.streams, produced < n && t + 2 <= self.ctx) {
                (Some(hs), true) => draft(hs, next, t),
                _ => u32::MAX,
            };
            if (d as usize) >= v {
                self.eval(next)?;
                continue;
            }
            stats.drafted += 1;
            let p = greedy.params();
            let judge = if self.device_picks {
                Judge::Device {
                    p,
                    draws: [0.0; 2],
                    keep: &mut |id| accept(id, d),
                }
            } else {
                Judge::Host(&mut |l| accept(argmax(l), d))
            };
            match self.verify(next, d, judge)? {
                (Verdict::Kept, picks) => {
                    stats.accepted += 1;
                    if !on_token(d) {
                        // A token the caller stops at is not evaluated: take the draft back.
                        self.undo_draft()?;
                        break;
                    }
                    if let (Some([_, after]), Some(u)) = (picks, self.undo.as_mut()) {
                        u.ahead = Some(Ahead {
                            id: after,
                            p,
                            u: 0.0,
                        });
                    }
                    produced += 1;
                }
                (v, picks) => {
                    stats.undone += (v == Verdict::Undone) as usize;
                    known = picks.map(|p| p[0]);
                }
            }
        }
        Ok(stats)
    }

    /// Bytes of KV state held now: raw window rows, compressed and indexer rows, frontiers.
    pub fn kv_bytes(&self) -> u64 {
        // f32 values, as the host form of the state holds them (the same on every backend).
        let n = self.state.tokens.len() as u64;
        self.model
            .layer_dims()
            .iter()
            .map(|l| {
                let c = |c: &Option<ds4_backend::CompDims>| {
                    c.as_ref().map_or(0, |c| {
                        (n / c.ratio as u64) * c.d as u64 + 2 * (c.slots() * c.width()) as u64
                    })
                };
                4 * ((l.window * l.head_dim) as u64 + c(&l.comp) + c(&l.index))
            })
            .sum()
    }

    /// Drop all state.
    pub fn reset(&mut self) {
        self.undo = None;
        self.state = self.model.new_state(self.ctx);
        self.logits = None;
        self.streams = None;
        self.mtp = self.model.has_mtp().then(|| self.model.new_mtp_state());
    }

    /// Replace the state with one at position `tokens.len()` whose KV rows are random values
    /// (uniform in [-1, 1), rounded to f16) of the sizes a real context gives: the raw window
    /// (positions n - window .. n), every compressed and indexer row (n / ratio each), fresh
    /// compressor frontiers. For decode benchmarks at long frontiers without computing their prompts
    /// (`ds4 bench --decode-only`): the values stand in for computed ones, so the logits that
    /// follow mean nothing, but every kernel sees the row counts it would. No logits afterwards.
    /// At 1M tokens of the full model the host builds ~13 GB of rows for the upload.
    pub fn fill_random(&mut self, tokens: &[u32], seed: u64) -> Result<(), EngineError> {
        use rand::{Rng, SeedableRng};
        self.check(tokens.len(), tokens)?;
        self.reset(); // the old state's memory goes before the new one is uploaded
        let n = tokens.len();
        // A pool of 2^20 random values, cycled through from a moving start (a draw per value
        // would take most of the fill at 1M); buffers of one layer do not repeat each other.
        let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        // f16 values, as the model's cache rows are (so a snapshot stores them as a computed
        // context's, at 2 bytes a value).
        let pool: Vec<f32> = (0..1 << 20)
            .map(|_| half::f16::from_f32(r.gen_range(-1.0f32..1.0)).to_f32())
            .collect();
        let mut at = 0usize;
        let mut fill = |len: usize| {
            let mut v = Vec::with_capacity(len);
            while v.len() < len {
                let take = (len - v.len()).min(pool.len() - at);
                v.extend_from_slice(&pool[at..at + take]);
                at = (at + take) % pool.len();
            }
            at = (at + 7919) % pool.len();
            v
        };
        let layers = self
            .model
            .layer_dims()
            .iter()
            .map(|ld| {
                let mut h = ds4_backend::HostLayerState::new(ld);
                let w = ld.window;
                h.raw = fill(w * ld.head_dim);
                for p in n.saturating_sub(w)..n {
                    h.raw_pos[p % w] = p as i64;
                }
                for (c, hc) in [(&ld.comp, &mut h.comp), (&ld.index, &mut h.index)] {
                    if let (Some(c), Some(hc)) = (c, hc.as_mut()) {
                        hc.rows = fill(n / c.ratio * c.d);
                    }
                }
                h
            })
            .collect();
        let host = ds4_model::forward::HostState {
            tokens: tokens.to_vec(),
            layers,
        };
        self.state = self.model.state_from_host(&host, self.ctx);
        Ok(())
    }

    /// Serialise the full state (versioned, checksummed; see `snapshot.rs`).
    pub fn snapshot(&self) -> Vec<u8> {
        self.capture().encode()
    }

    /// The state copied to host memory, not yet encoded: [`Capture::encode`] gives the bytes
    /// `snapshot` would have given now, on any thread, while the session moves on. The
    /// download is the only part that needs the session (a GPU's state to host memory);
    /// encoding and the checksum are most of a snapshot's time on a slow host core.
    pub fn capture(&self) -> Capture {
        Capture {
            hp: self.model.hp().clone(),
            model_id: self.model_id,
            state: self.model.state_to_host(&self.state),
            logits: self.logits.clone(),
        }
    }

    /// Replace the state with a snapshot of the same model.
    pub fn restore(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        let (state, logits) = snapshot::read(
            self.model.hp(),
            &self.model.layer_dims(),
            &self.model_id,
            bytes,
        )
        .map_err(|e| match e {
            snapshot::ReadError::Newer(found) => EngineError::SnapshotNewer {
                found,
                newest: snapshot::VERSION,
            },
            snapshot::ReadError::Invalid(s) => EngineError::Snapshot(s),
        })?;
        if state.tokens.len() > self.ctx {
            return Err(EngineError::ContextFull {
                needed: state.tokens.len(),
                ctx: self.ctx,
            });
        }
        self.reset();
        self.state = self.model.state_from_host(&state, self.ctx);
        self.logits = logits;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's share of the full-size mixes: the sizes come from the synthetic tensor list
    /// (real shapes and types), so the q4 mix must fit two 141 GB H200s with either form, and
    /// TP must take its tensors' bytes off each rank and apply only where N divides 8 groups.
    #[test]
    fn rank_sizes_of_the_full_mixes() {
        for preset in [
            ds4_model::synthetic::SynthPreset::FullQ2,
            ds4_model::synthetic::SynthPreset::FullQ4,
        ] {
            let (hp, mix) = preset.params();
            let sizes = ds4_model::tensors::mix_sizes(&hp, mix);
            let r = RankBytes::of(
                sizes
                    .iter()
                    .map(|(t, ty, b)| (t.name.as_str(), *b, *ty, &t.dims[..])),
            );
            assert!(r.experts > r.all / 2 && r.tp > 0 && r.tp < r.all - r.experts);
            // Every Q8_0 matrix that is not an expert stack once more (the decode layout), of
            // them the TP-split ones: in both mixes most of the dense weights.
            let q8: u64 = sizes
                .iter()
                .filter(|(t, ty, _)| *ty == GgmlType::Q8_0 && t.dims.len() == 2)
                .map(|(_, _, b)| b)
                .sum();
            assert_eq!(r.layout, q8);
            assert!(r.layout_tp > 0 && r.layout_tp < r.layout && r.layout_tp <= r.tp);
            assert!(r.layout > (r.all - r.experts) / 2, "{} {}", r.layout, r.all);
            assert_eq!(
                (r.out_b_block, r.down_block),
                (32, 32),
                "Q8_0 out_b and shared down"
            );
            let n_exp = hp.n_expert as usize;
            for n in [2usize, 4, 8] {
                assert!(r.tp(&hp, n, true), "{n} ranks split 8 groups");
                assert!(!r.tp(&hp, n, false), "not asked");
                let (ep, tp) = (r.per_rank(n, n_exp, false), r.per_rank(n, n_exp, true));
                assert!(tp < ep && ep < r.all, "{n}: {tp} {ep}");
                let split = |b: u64| b - b / n as u64;
                assert_eq!(ep - tp, split(r.tp) + split(r.layout_tp));
                assert_eq!(
                    ep,
                    r.all + r.layout - r.experts + r.experts.div_ceil(n as u64)
                );
                println!(
                    "{} over {n}: {:.2} GiB a rank (ep {:.2})",
                    preset.name(),
                    gib(tp),
                    gib(ep)
                );
            }
            assert!(!r.tp(&hp, 3, true) && !r.tp(&hp, 16, true));
            // Two H200s (~139.5 GiB free each) hold the q4 mix either way.
            assert!(gib(r.per_rank(2, n_exp, false)) < 138.0);
        }
    }

    /// The plans the README quotes, from the full-size tensor lists: the q4 mix on one H200
    /// (139.5 GiB free) keeps the experts of 6 layers on the host, the q2 mix on a 24 GB card
    /// (~22.5 GiB free) those of 37, on an 80 GB H100 (78.6 GiB free) those of 4, one of them
    /// held in the layer buffer each time (bounds kept loose: GPU_RESERVE may be tuned), each without the decode-layout copies;
    /// the q2 mix on an H200 all on the GPU with them; and `ds4 devices`' line that says so.
    #[test]
    fn full_size_plans() {
        use ds4_model::tensors::Mix;
        let gib = 1u64 << 30;
        let (q4, q4_bytes, fits, keep) = full_size_plan(Mix::Q4, 139 * gib + gib / 2);
        // One layer more than the weights alone need: the layer buffer holds one of them.
        assert!((4..=9).contains(&q4) && fits && !keep, "{q4}");
        // 3.37 GiB of Q4_K experts a layer.
        assert!(q4_bytes > q4 as u64 * 3 * gib && q4_bytes < q4 as u64 * 4 * gib);
        let (q2, _, fits, keep) = full_size_plan(Mix::Q2, 22 * gib + gib / 2);
        assert!((30..=41).contains(&q2) && fits && !keep, "{q2}");
        // Session 41: on an H100 the q2 mix with its copies and no host layers ran out of
        // memory at load; without the copies 80.8 GiB still need a few layers on the host.
        let (h100, _, fits, keep) = full_size_plan(Mix::Q2, 78 * gib + 6 * gib / 10);
        assert!((2..=5).contains(&h100) && fits && !keep, "{h100}");
        assert_eq!(
            device_plan_line(78 * gib + 6 * gib / 10).contains("layers and the embedding table"),
            ds4_model::offload::host_table_wanted()
        );
        // The embedding table read from host memory (1 GiB) saves a layer of experts on the
        // H100 (q2) and the H200 (q4): 4 and 6 against 5 and 7 (DS4_HOST_EMBED=off).
        if ds4_model::offload::host_table_wanted() {
            for (mix, free, k) in [
                (Mix::Q2, 78 * gib + 6 * gib / 10, h100),
                (Mix::Q4, 139 * gib + gib / 2, q4),
            ] {
                let off = full_size_plan_table(mix, free, false);
                assert_eq!(off.0, k + 1, "{mix:?}");
                assert!(off.2);
            }
        }
        assert_eq!(full_size_plan(Mix::Q2, 139 * gib), (0, 0, true, true));
        assert!(
            !full_size_plan(Mix::Q2, 6 * gib).2,
            "8 GiB of dense weights in 6 GiB"
        );
        for free in [22 * gib + gib / 2, 78 * gib + 6 * gib / 10] {
            println!("{}", device_plan_line(free));
        }
        let h200 = device_plan_line(139 * gib + gib / 2);
        println!("{h200}");
        assert!(h200.contains("q2 all on the GPU;"), "{h200}");
        assert!(
            h200.contains(&format!("q4 with the routed experts of {q4} of 43 layers"))
                && h200.contains("in host memory")
                && h200.ends_with("with its Q8_0 matrices in the decode layout only"),
            "{h200}"
        );
        let small = device_plan_line(6 * gib);
        assert!(
            small.contains("q2 does not fit") && small.contains("q4 does not fit"),
            "{small}"
        );
    }

    #[test]
    fn out_of_memory_errors_say_what_to_change() {
        let e = "device memory: 134217728 bytes: CUDA driver cuMemAlloc failed: 2 \
                 (CUDA_ERROR_OUT_OF_MEMORY: out of memory)";
        let h = out_of_memory_hint(e.to_string());
        assert!(
            h.starts_with(e) && h.contains("--cpu-experts N") && h.contains("--ctx"),
            "{h}"
        );
        let hip = out_of_memory_hint("device memory: 64 bytes: hipErrorOutOfMemory".into());
        assert!(hip.contains("--kv-mem-mb"), "{hip}");
        // Other failures pass unchanged.
        let other = "kernel launch failed: CUDA_ERROR_ILLEGAL_ADDRESS".to_string();
        assert_eq!(out_of_memory_hint(other.clone()), other);
    }

    /// The decode-layout copies go before any layer of experts moves to host memory, and stay
    /// where they fit beside a fixed choice.
    #[test]
    fn place_weights_drops_the_layout_copies_first() {
        let gib = 1u64 << 30;
        // 4 layers of 2 GiB of experts (8 experts: a group is a whole layer) plus 2 GiB of
        // dense weights: 10 GiB own bytes; 1 GiB of copies; r: the reserve.
        let r = GPU_RESERVE;
        let per = [2 * gib; 4];
        let m = Movable {
            per_layer: &per,
            n_expert: 8,
            table: 0,
        };
        let place = |c, free| place_weights(c, &m, 10 * gib, gib, Some(free));
        assert_eq!(place(CpuExperts::Auto, 11 * gib + r), (vec![], true));
        assert_eq!(place(CpuExperts::Auto, 11 * gib + r - 1), (vec![], false));
        assert_eq!(place(CpuExperts::Auto, 10 * gib + r), (vec![], false));
        // Host layers add a group (2 GiB here) and the layer buffer (a layer, 2 GiB). Without
        // copies three layers go (10 - 6 + 2 + 2 = 8 GiB).
        assert_eq!(place(CpuExperts::Auto, 8 * gib + r), (vec![0, 1, 3], false));
        // Copies that fit beside the fewest layers stay (9 GiB).
        assert_eq!(place(CpuExperts::Auto, 9 * gib + r), (vec![0, 1, 3], true));
        assert_eq!(place(CpuExperts::Layers(1), 20 * gib), (vec![3], true));
        assert_eq!(place(CpuExperts::Layers(1), 10 * gib + r), (vec![3], false));
        assert_eq!(place(CpuExperts::Off, 11 * gib + r), (vec![], true));
        assert_eq!(place(CpuExperts::Off, 10 * gib + r), (vec![], false));
        // No memory figure (a device that does not say): as asked, with copies.
        assert_eq!(
            place_weights(CpuExperts::Auto, &m, 10 * gib, gib, None),
            (vec![], true)
        );
    }

    #[test]
    fn host_expert_layers_keep_the_fewest_spread_layers_that_let_the_rest_fit() {
        let gib = 1u64 << 30;
        // 4 layers of 2 GiB of experts (8 experts: a group of 8 is a whole layer's 2 GiB) plus
        // 2 GiB of dense weights: 10 GiB.
        let per = [2 * gib; 4];
        let w = 10 * gib;
        let m = Movable {
            per_layer: &per,
            n_expert: 8,
            table: 0,
        };
        let plan = |c, free| host_expert_layers(c, &m, w, free);
        assert_eq!(
            plan(CpuExperts::Auto, Some(w + GPU_RESERVE)),
            Vec::<usize>::new()
        );
        assert_eq!(plan(CpuExperts::Auto, None), Vec::<usize>::new());
        // r: the reserve. 8 GiB + r free: 10 + 2 (group) + 2 (layer buffer) - 2k + r <= 8 + r
        // first at k = 3, the layers spread with the last among them.
        let r = GPU_RESERVE;
        assert_eq!(plan(CpuExperts::Auto, Some(8 * gib + r)), vec![0, 1, 3]);
        assert_eq!(
            plan(CpuExperts::Auto, Some(8 * gib + r - 1)),
            vec![0, 1, 2, 3]
        );
        assert_eq!(plan(CpuExperts::Layers(2), None), vec![1, 3]);
        // A table of 1 GiB leaves with the first host layer (part of the 10 GiB): 7 GiB + r
        // free take 3 layers (10 - 1 + 4 - 6 = 7), not 4; with room for all it stays.
        let mt = Movable { table: gib, ..m };
        assert_eq!(
            host_expert_layers(CpuExperts::Auto, &mt, w, Some(7 * gib + r)),
            vec![0, 1, 3]
        );
        assert_eq!(plan(CpuExperts::Auto, Some(7 * gib + r)), vec![0, 1, 2, 3]);
        assert!(host_expert_layers(CpuExperts::Auto, &mt, w, Some(w + r)).is_empty());
        assert_eq!(mt.moved(&[]), 0);
        assert_eq!(mt.moved(&[1, 3]), 5 * gib);
        assert_eq!(
            placed_bytes(&mt, w, gib, &[1, 3], false),
            (4 * gib, 9 * gib)
        );
        assert_eq!(placed_bytes(&mt, w, gib, &[], true), (0, 11 * gib));
        // 2 GiB + r free: dense 2 + group 2 + buffer 2 = 6 > 2 even with every layer on the
        // host: all of them (the fit check then refuses with the numbers).
        assert_eq!(plan(CpuExperts::Auto, Some(2 * gib + r)), vec![0, 1, 2, 3]);
        assert_eq!(plan(CpuExperts::Off, Some(gib)), Vec::<usize>::new());
        assert_eq!(plan(CpuExperts::Layers(1), Some(100 * gib)), vec![3]);
        assert_eq!(plan(CpuExperts::Layers(usize::MAX), None), vec![0, 1, 2, 3]);
        assert_eq!(
            CpuExperts::parse("all"),
            Some(CpuExperts::Layers(usize::MAX))
        );
        assert_eq!(CpuExperts::parse("12"), Some(CpuExperts::Layers(12)));
        assert_eq!(CpuExperts::parse("0"), Some(CpuExperts::Off));
        assert_eq!(CpuExperts::parse("auto"), Some(CpuExperts::Auto));
        assert_eq!(CpuExperts::parse("-1"), None);
        let per_layer = expert_bytes_per_layer(
            2,
            [
                ("blk.0.ffn_gate_exps.weight", 5),
                ("blk.0.ffn_up_exps.weight", 5),
                ("blk.1.ffn_down_exps.weight", 7),
                ("blk.1.ffn_gate_shexp.weight", 100),
                ("blk.9.ffn_down_exps.weight", 1),
                ("token_embd.weight", 1000),
            ]
            .into_iter(),
        );
        assert_eq!(per_layer, vec![10, 7]);
        // Dense weights too large even with every layer's experts on the host: said with the
        // numbers; the same weights with room: no error.
        let e =
            host_fit_error((43, 43, 78 * gib), 8 * gib, 6 * gib, 8 * gib, "GPU 0 (T4)").unwrap();
        assert!(
            e.contains("43 of 43 layers in host memory (78.0 GiB)"),
            "{e}"
        );
        assert!(
            e.contains("still need 8.0 GiB") && e.contains("GPU 0 (T4) has 6.0 of 8.0"),
            "{e}"
        );
        assert_eq!(
            host_fit_error(
                (43, 43, 78 * gib),
                8 * gib,
                8 * gib + GPU_RESERVE,
                16 * gib,
                "d"
            ),
            None
        );
        let e = host_memory_error(43, 72 * gib, 60 * gib).unwrap();
        assert!(
            e.contains("43 layers need 72.0 GiB") && e.contains("60.0 GiB are available"),
            "{e}"
        );
        assert_eq!(host_memory_error(43, 72 * gib, 74 * gib), None);
        assert!(host_memory_error(43, 72 * gib, 74 * gib - 1).is_some());
        assert!(mem_available().is_none_or(|b| b > 0));
        assert!(meminfo("MemTotal").is_none_or(|t| t >= mem_available().unwrap_or(0)));
        // A file's experts beyond what RAM can cache: a note, with the numbers.
        let n = host_cache_note(60 * gib, 61 * gib).unwrap();
        assert!(
            n.contains("60.0 GiB of host-memory experts exceed") && n.contains("61.0 GiB of RAM"),
            "{n}"
        );
        assert_eq!(host_cache_note(60 * gib, 62 * gib), None);
        assert!(host_cache_note(60 * gib, 62 * gib - 1).is_some());
        // The backend line says which arithmetic the host experts' decode steps use.
        let fast = host_experts_line(35, 43, 59 * gib, Precision::Fast);
        assert_eq!(
            fast,
            "; routed experts of 35 of 43 layers in host memory (59.0 GiB, int8 activations on \
             the CPU; --cpu-experts)"
        );
        assert!(host_experts_line(1, 43, gib, Precision::Exact).contains("f32 activations"));
        // Loaded with the selected experts copied over the bus, it says so; else as planned.
        let line = format!("cuda (H100){fast}");
        assert_eq!(
            with_gather_note(line.clone(), true, None),
            "cuda (H100); routed experts of 35 of 43 layers in host memory (59.0 GiB, the \
             selected ones copied to the GPU over the bus; --cpu-experts)"
        );
        assert_eq!(
            with_gather_note(line.clone(), true, Some(42)),
            "cuda (H100); routed experts of 35 of 43 layers in host memory (59.0 GiB, the \
             selected ones copied to the GPU over the bus; layer 42's held on the GPU, prompts \
             copy each host layer ahead of its use; --cpu-experts)"
        );
        let exact = format!(
            "cuda (H100){}",
            host_experts_line(1, 43, gib, Precision::Exact)
        );
        assert!(with_gather_note(exact, true, None).contains("GiB, the selected ones copied"));
        assert_eq!(with_gather_note(line.clone(), false, None), line);
        assert_eq!(
            with_gather_note("cuda (H100)".into(), true, Some(3)),
            "cuda (H100)"
        );
    }

    #[test]
    fn weights_that_cannot_fit_the_gpu_are_refused_before_any_upload() {
        let gib = 1u64 << 30;
        let h200 = (139 * gib + gib / 2, 140 * gib);
        // The q2 mix (80.8 GiB) fits one H200; the q4 mix (153.3 GiB) does not.
        assert_eq!(
            gpu_fit_error(81 * gib, h200.0, h200.1, "GPU 0 (H200)"),
            None
        );
        let e = gpu_fit_error(153 * gib + gib / 3, h200.0, h200.1, "GPU 0 (H200)").unwrap();
        assert!(e.contains("need 153.3 GiB"), "{e}");
        assert!(
            e.contains("GPU 0 (H200) has 139.5 of 140.0 GiB free"),
            "{e}"
        );
        assert!(
            e.contains("--backend cpu") && e.contains("--device N"),
            "{e}"
        );
        // The reserve is kept: exactly weights + reserve fits, one byte more does not.
        let free = 10 * gib + GPU_RESERVE;
        assert_eq!(gpu_fit_error(10 * gib, free, 16 * gib, "d"), None);
        assert!(gpu_fit_error(10 * gib + 1, free, 16 * gib, "d").is_some());
        assert!(gpu_fit_error(u64::MAX, free, 16 * gib, "d").is_some());
    }

    #[test]
    fn gpu_backends_without_a_gpu_fail_with_a_clear_message() {
        for (choice, name) in [(BackendChoice::Cuda, "cuda"), (BackendChoice::Rocm, "rocm")] {
            let mut o = EngineOptions::new("/nonexistent/model.gguf");
            o.backend = choice;
            match Engine::open(&o) {
                Err(EngineError::Backend(n, msg)) => {
                    assert_eq!(n, name);
                    assert!(msg.ends_with("no usable GPU: use --backend cpu"), "{msg}");
                }
                // A device is present: the missing file is reported instead.
                Err(EngineError::Gguf(_)) => println!("skipped: a {name} device is present"),
                Err(e) => panic!("{name}: {e}"),
                Ok(_) => panic!("{name}: opened a missing file"),
            }
        }
    }

    #[test]
    fn eval_sampled_is_eval_then_sample_on_the_cpu() {
        let path = ds4_synth::tiny_model_for_tests(21, false);
        let mut o = EngineOptions::new(&path);
        o.backend = BackendChoice::Cpu;
        let e = Engine::open(&o).unwrap();
        let cfg = SamplerConfig {
            temperature: 1.2,
            top_k: 30,
            top_p: 0.9,
            min_p: 0.02,
            seed: 7,
        };
        let prompt = [0u32, 5, 77, 300, 12];
        let run = |device: bool| {
            let mut s = e.new_session(128);
            s.sync(&prompt, &mut |_, _| {}).unwrap();
            let mut sm = Sampler::new(cfg.clone());
            let mut t = sm.sample(s.logits().unwrap());
            let mut out = vec![t];
            for _ in 0..12 {
                t = if device {
                    s.eval_sampled(t, &mut sm).unwrap()
                } else {
                    sm.sample(s.eval(t).unwrap())
                };
                out.push(t);
            }
            out
        };
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn synthetic_tiny_loads_on_a_gpu() {
        let mut o = EngineOptions::new("");
        o.backend = BackendChoice::Auto;
        if pick_gpu(o.backend, 0).ok().flatten().is_none() {
            println!("skipped: no GPU");
            return;
        }
        let mut last = (0, 0);
        let e = Engine::open_synthetic(SynthPreset::Tiny, &o, 1, &mut |d, t| last = (d, t))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(last.0 > 0 && last.0 == last.1, "{last:?}");
        assert!(e.backend_name().starts_with("cuda (") || e.backend_name().starts_with("rocm ("));
        // Matrices as the mix stores them, vectors as f32: at least the file's bytes.
        assert!(e.gpu_weight_bytes().unwrap() >= last.1 as u64);
        println!(
            "{}: {} weight bytes",
            e.backend_name(),
            e.gpu_weight_bytes().unwrap()
        );
    }

    #[test]
    fn synthetic_models_need_a_gpu() {
        let mut o = EngineOptions::new("");
        o.backend = BackendChoice::Cpu;
        let e = Engine::open_synthetic(SynthPreset::Tiny, &o, 1, &mut |_, _| {})
            .err()
            .expect("the CPU cannot generate weights");
        assert!(e.to_string().contains("generated on a GPU"), "{e}");
    }
}
