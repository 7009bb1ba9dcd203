//! Options shared by the commands that run the model.

use crate::progress;
use anyhow::{anyhow, bail, Context, Result};
use ds4_chat::{Piece, ThinkMode};
use ds4_engine::{BackendChoice, Engine, EngineOptions, SamplerConfig, SynthPreset};
use ds4_tokenizer::Tokenizer;
use std::path::PathBuf;

#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// Model GGUF (e.g. one written by `ds4 synth`).
    #[arg(short, long, required_unless_present = "synthetic")]
    pub model: Option<PathBuf>,
    /// Instead of -m: a file-less model with random weights generated on the GPU, of the real
    /// shapes (`full-q2` ≈ 81 GB, `full-q4` ≈ 153 GB) or the 6-layer `tiny` (benchmarks).
    #[arg(long, value_parser = ["full-q2", "full-q4", "tiny"], conflicts_with_all = ["model", "mtp"])]
    pub synthetic: Option<String>,
    /// Seed of the --synthetic weights.
    #[arg(long, default_value_t = 1)]
    pub synthetic_seed: u64,
    /// MTP GGUF (e.g. `<model>-mtp.gguf` from `ds4 synth --mtp`): speculative decoding. Each
    /// step drafts the next token with it and evaluates both in one 2-token step; the draft is
    /// kept when the sampler picks it, so the tokens are plain sampling's (any --temp, top-k,
    /// top-p, min-p; not with logprobs). `run` and `serve` use it; a GPU picks in the verify
    /// step itself. On a GPU a verify step costs ~1.73 plain steps and a rejected draft nothing
    /// more, so it pays when most drafts are kept (H100: 80% kept drafts 13% faster than
    /// plain; `ds4 bench --spec-accept 1,0.8 --spec-mtp` measures).
    #[arg(long)]
    pub mtp: Option<PathBuf>,
    /// Set by `bench --spec-mtp`: a --synthetic model gets a random MTP block.
    #[arg(skip)]
    pub synthetic_mtp: bool,
    /// Compute backend: auto picks a CUDA or ROCm GPU when one is usable, else the CPU.
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "cuda", "rocm", "metal"])]
    pub backend: String,
    /// CPU worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// GPU index among the visible devices (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES apply).
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Split the model over these GPUs (comma-separated indices, e.g. `0,1`), one rank each.
    /// Each GPU holds the session state, 1/N of the routed experts (expert parallelism) and,
    /// with `--parallel tp+ep` (the default, where N divides the 8 attention output groups),
    /// 1/N of each attention's heads and of the shared expert (tensor parallelism); the ranks
    /// add their partial outputs through NCCL (CUDA) or RCCL (ROCm), twice a layer (once with
    /// `ep`). The q4 mix (153 GiB) then fits two 141 GB H200s. With --backend cpu: N
    /// reference ranks in this process (same numbers to ~1e-6, no faster).
    #[arg(long, value_delimiter = ',', num_args = 1.., conflicts_with = "device")]
    pub devices: Vec<usize>,
    /// How --devices splits the model: `tp+ep` (experts, attention heads and the shared
    /// expert; falls back to `ep` where the ranks do not divide the heads' groups) or `ep`
    /// (experts only; every rank holds all dense weights).
    #[arg(long, default_value = "tp+ep", value_parser = ["tp+ep", "ep"])]
    pub parallel: String,
    /// Rounding steps of the model's semantics (FP8 KV rows, Hadamard+FP4 indexer, f16 cache
    /// rows): `model` (default) or `none` — plain float math, as HF transformers computes; for
    /// comparisons against such references.
    #[arg(long, default_value = "model", value_parser = ["model", "none"])]
    pub rounding: String,
    /// Arithmetic of the GPU's prompt (prefill) products: `fast` takes one 16-bit product each
    /// (bf16 dense products, f16 MoE and attention inputs, f32 sums; as mainstream engines do;
    /// ~30% faster prompts), `exact` sums hi/lo terms so the GPU matches the CPU reference to
    /// ~1e-4. Decode steps and the CPU backend are the same either way.
    #[arg(long, default_value = ds4_engine::DEFAULT_PRECISION.name(), value_parser = ["exact", "fast"])]
    pub precision: String,
    /// Routed experts in host memory, for a GPU whose memory cannot hold the model (a 12-24 GB
    /// card with the q2 mix: every dense weight, ~8 GiB, stays on the GPU). `auto`: all on the
    /// GPU when they fit, else those of as few layers as let the rest fit (after dropping the
    /// GPU's ~6 GiB of decode-layout copies of the Q8_0 matrices: those then keep that layout
    /// alone, not their GGUF blocks, at the same bytes and decode speed), spread through the model;
    /// `N`: N layers', spread, the last among them; `all`; `off`: refuse a model that does not
    /// fit. The GPU holds one host layer's experts at a time (the plan counts it): decode
    /// steps run the last host layer as resident and copy the 6 selected experts of each
    /// other one by DMA from page-locked host memory (~1 ms a q2 layer on PCIe 5); prompts of
    /// 128 tokens or more copy each host layer whole ahead of its use, beside the compute
    /// (`DS4_HOST_LAYER_BUFFER=off`: no such layer; smaller prompts gather what they select).
    /// With any host layer the 1 GiB embedding table stays in host memory too, a row a token
    /// read over the bus (`DS4_HOST_EMBED=off`: on the GPU).
    /// `DS4_HOST_EXPERTS_DECODE=host` turns the copies off: batches under 32 tokens then
    /// run those experts on the CPU's cores (~2-4 ms a decode step on 16 cores), larger ones
    /// upload the selected experts 32 at a time.
    #[arg(long, default_value = "auto", value_parser = parse_cpu_experts)]
    pub cpu_experts: ds4_engine::CpuExperts,
    /// Context size in tokens for the session.
    #[arg(long, default_value_t = 32768)]
    pub ctx: usize,
}

/// One stderr line when the GPU keeps routed experts in host memory (`--cpu-experts`), for the
/// commands that otherwise print nothing about the backend (`run`, `logits`).
pub fn note_host_experts(engine: &Engine) {
    if engine.backend_name().contains("in host memory") {
        eprintln!("ds4: {}", engine.backend_name());
    }
}

fn parse_cpu_experts(s: &str) -> Result<ds4_engine::CpuExperts, String> {
    ds4_engine::CpuExperts::parse(s)
        .ok_or_else(|| format!("{s}: expected auto, off, all or a number of layers"))
}

impl ModelArgs {
    pub fn open(&self) -> Result<Engine> {
        let mut o = EngineOptions::new(self.model.clone().unwrap_or_default());
        o.backend = BackendChoice::parse(&self.backend)
            .ok_or_else(|| anyhow!("unknown backend {}", self.backend))?;
        o.threads = self.threads;
        o.device = self.device;
        o.devices = self.devices.clone();
        o.tp = self.parallel == "tp+ep";
        // Host-memory all-reduce instead of NCCL / RCCL (ranks may share a GPU): for tests.
        o.ep_host_comm = std::env::var("DS4_EP_COMM").is_ok_and(|v| v == "host");
        if self.rounding == "none" {
            o.rounding = ds4_engine::Rounding::NONE;
        }
        o.precision = ds4_engine::Precision::parse(&self.precision)
            .ok_or_else(|| anyhow!("unknown precision {}", self.precision))?;
        o.mtp = self.mtp.clone();
        o.synthetic_mtp = self.synthetic_mtp;
        o.cpu_experts = self.cpu_experts;
        let (what, msg) = match (&self.synthetic, &self.model) {
            (Some(p), _) => (format!("synthetic {p}"), "generating weights"),
            (None, Some(m)) => (m.display().to_string(), "loading weights"),
            (None, None) => bail!("no model: pass -m FILE or --synthetic PRESET"),
        };
        // On a terminal (nothing when stderr is piped): a spinner while the file is opened and
        // bound, then a byte bar with the rate, made on the first report so the two never draw
        // at once.
        let spinner = progress::spinner(&format!("opening {what}"));
        let mut bar: Option<indicatif::ProgressBar> = None;
        let mut cb = |done: usize, total: usize| {
            let b = bar.get_or_insert_with(|| {
                spinner.finish_and_clear();
                progress::bytes(msg, total as u64)
            });
            b.set_length(total as u64);
            b.set_position(done as u64);
        };
        let e = match &self.synthetic {
            Some(p) => {
                let preset =
                    SynthPreset::parse(p).ok_or_else(|| anyhow!("unknown synthetic model {p}"))?;
                Engine::open_synthetic(preset, &o, self.synthetic_seed, &mut cb)
            }
            None => Engine::open_with_progress(&o, &mut cb),
        };
        spinner.finish_and_clear();
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let e = e.with_context(|| format!("loading the model {what}"))?;
        if let Some(note) = cpu_experts_note(self.cpu_experts, e.backend_name()) {
            eprintln!("ds4: {note}");
        }
        Ok(e)
    }
}

/// `--cpu-experts N|all` asked of a model that runs on the CPU backend: said, not refused (every
/// weight is in host memory there already).
fn cpu_experts_note(choice: ds4_engine::CpuExperts, backend: &str) -> Option<&'static str> {
    (matches!(choice, ds4_engine::CpuExperts::Layers(_)) && backend == "cpu").then_some(
        "--cpu-experts has no effect on the CPU backend (every weight is in host memory); it \
         splits a model between one GPU and the host",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_experts_on_the_cpu_backend_is_noted() {
        use ds4_engine::CpuExperts;
        assert!(cpu_experts_note(CpuExperts::Layers(3), "cpu").is_some());
        assert!(cpu_experts_note(CpuExperts::Layers(usize::MAX), "cpu").is_some());
        assert_eq!(cpu_experts_note(CpuExperts::Auto, "cpu"), None);
        assert_eq!(
            cpu_experts_note(CpuExperts::Layers(3), "cuda (NVIDIA H200 sm_90a)"),
            None
        );
    }
}

#[derive(clap::Args, Clone)]
pub struct SampleArgs {
    /// Temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below min-p × the best token's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SampleArgs {
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

pub fn think_mode(s: &str) -> ThinkMode {
    match s {
        "high" => ThinkMode::High,
        "max" => ThinkMode::Max,
        _ => ThinkMode::None,
    }
}

/// Token ids of rendered pieces: specials by id, text BPE-encoded without special detection —
/// except an already-rendered prompt (starts with BOS), tokenized with special detection.
pub fn encode_pieces(tok: &Tokenizer, pieces: &[Piece]) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for p in pieces {
        match p {
            Piece::Special(s) => ids.push(
                tok.token_id(s)
                    .ok_or_else(|| anyhow!("the vocabulary has no {s} token"))?,
            ),
            Piece::Text(t) if ds4_chat::is_prerendered(t) => {
                ids.extend(tok.encode_with_specials(t))
            }
            Piece::Text(t) => ids.extend(tok.encode(t)),
        }
    }
    Ok(ids)
}
