//! The engine: opens a model on a backend, hands out sessions. This is the only API the CLI
//! and the server use — tokens in, logits/tokens out, snapshots as bytes; never a tensor.

pub mod sampler;
mod snapshot;

use ds4_cpu::{CpuModel, Rounding, State, Weights};
use ds4_gguf::GgufFile;
use ds4_model::{bind_main, HParams};
use ds4_tokenizer::Tokenizer;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use sampler::{argmax, top_logprobs, Sampler, SamplerConfig};

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
    pub backend: BackendChoice,
    /// CPU worker threads (None: all cores).
    pub threads: Option<usize>,
    pub rounding: Rounding,
}

impl EngineOptions {
    pub fn new(model: impl Into<PathBuf>) -> EngineOptions {
        EngineOptions {
            model: model.into(),
            backend: BackendChoice::Auto,
            threads: None,
            rounding: Rounding::MODEL,
        }
    }
}

pub struct Engine {
    model: Arc<CpuModel>,
    tokenizer: Arc<Tokenizer>,
    /// SHA-256 of the GGUF header (metadata + tensor table): identifies the model in snapshots.
    model_id: [u8; 32],
    path: PathBuf,
}

impl Engine {
    pub fn open(opts: &EngineOptions) -> Result<Engine, EngineError> {
        match opts.backend {
            BackendChoice::Auto | BackendChoice::Cpu => {}
            other => {
                return Err(EngineError::Backend(
                    format!("{other:?}").to_lowercase(),
                    "not available in this build yet: the GPU backends are being written (use --backend cpu)".into(),
                ))
            }
        }
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
        let model = CpuModel::new(hp, Weights::new(file, dir), opts.rounding);
        Ok(Engine {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            model_id,
            path: opts.model.clone(),
        })
    }

    pub fn hparams(&self) -> &HParams {
        &self.model.hp
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn backend_name(&self) -> &'static str {
        "cpu"
    }

    /// A new session able to hold `ctx` tokens.
    pub fn new_session(&self, ctx: usize) -> Session {
        Session {
            model: self.model.clone(),
            model_id: self.model_id,
            state: self.model.new_state(),
            logits: None,
            ctx,
        }
    }

    /// Bytes of session state for a context of `ctx` tokens: the raw window of every layer,
    /// compressor frontiers, and the compressed/indexer rows at full context (f32, as the CPU
    /// backend stores them).
    pub fn memory_estimate(&self, ctx: usize) -> u64 {
        let hp = self.hparams();
        let hd = hp.head_dim as u64;
        let ihd = hp.indexer_head_dim as u64;
        let mut b = 0u64;
        for l in hp.layers() {
            b += hp.sliding_window as u64 * hd * 4;
            if l.compressed() {
                let c = l.coff() as u64;
                b += 2 * (c * l.ratio as u64) * (c * hd) * 4
                    + (ctx as u64 / l.ratio as u64) * hd * 4;
            }
            if l.has_indexer() {
                b += 2 * 8 * (2 * ihd) * 4 + (ctx as u64 / 4) * ihd * 4;
            }
        }
        b + hp.n_vocab as u64 * 4 + ctx as u64 * 4
    }
}

/// Tokens per batched prefill step: bounds activation memory (≈ chunk × 200 KB at full size).
pub const PREFILL_CHUNK: usize = 128;

impl Session {
    /// Evaluate `tokens` through the batched prompt path; logits after every position.
    pub fn eval_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        if self.state.tokens.len() + tokens.len() > self.ctx {
            return Err(EngineError::ContextFull {
                needed: self.state.tokens.len() + tokens.len(),
                ctx: self.ctx,
            });
        }
        let v = self.model.hp.n_vocab as usize;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(EngineError::BadToken(bad, v));
        }
        let mut out = Vec::with_capacity(tokens.len());
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            out.extend(self.model.eval_batch(&mut self.state, chunk, true));
        }
        self.logits = out.last().cloned();
        Ok(out)
    }
}

/// One conversation's model state. Sessions are independent; several may exist at once.
pub struct Session {
    model: Arc<CpuModel>,
    model_id: [u8; 32],
    state: State,
    logits: Option<Vec<f32>>,
    ctx: usize,
}

impl Session {
    pub fn tokens(&self) -> &[u32] {
        &self.state.tokens
    }

    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Logits after the last evaluated token (None before the first).
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// Evaluate one token at the next position.
    pub fn eval(&mut self, token: u32) -> Result<&[f32], EngineError> {
        let v = self.model.hp.n_vocab as usize;
        if token as usize >= v {
            return Err(EngineError::BadToken(token, v));
        }
        if self.state.tokens.len() >= self.ctx {
            return Err(EngineError::ContextFull {
                needed: self.state.tokens.len() + 1,
                ctx: self.ctx,
            });
        }
        self.logits = Some(self.model.eval(&mut self.state, token));
        Ok(self.logits.as_deref().unwrap_or_default())
    }

    /// Bring the session to exactly `tokens`: extend when the live state is a prefix, rebuild
    /// otherwise (DS4's compressed state is append-only, model.md §4.4). `progress(done, total)`
    /// is called per evaluated token. Returns how many tokens were reused.
    pub fn sync(
        &mut self,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<usize, EngineError> {
        if tokens.len() > self.ctx {
            return Err(EngineError::ContextFull {
                needed: tokens.len(),
                ctx: self.ctx,
            });
        }
        let v = self.model.hp.n_vocab as usize;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(EngineError::BadToken(bad, v));
        }
        let live = &self.state.tokens;
        let reuse = if live.len() <= tokens.len() && tokens[..live.len()] == live[..] {
            live.len()
        } else {
            0
        };
        if reuse == 0 && !live.is_empty() {
            self.state = self.model.new_state();
            self.logits = None;
        }
        let todo = &tokens[reuse..];
        let mut done = 0;
        for chunk in todo.chunks(PREFILL_CHUNK) {
            // Bit-identical to evaluating one token at a time (see ds4-cpu's prefill test).
            self.logits = self.model.eval_batch(&mut self.state, chunk, false).pop();
            done += chunk.len();
            progress(done, todo.len());
        }
        Ok(reuse)
    }

    /// Bytes of KV state held now: raw window rows, compressed and indexer rows, frontiers.
    pub fn kv_bytes(&self) -> u64 {
        let f = |v: &[f32]| v.len() as u64 * 4;
        self.state
            .layers
            .iter()
            .map(|l| {
                let c = |c: &Option<ds4_cpu::forward::CompState>| {
                    c.as_ref()
                        .map_or(0, |c| f(&c.rows) + f(&c.front_kv) + f(&c.front_score))
                };
                f(&l.raw) + c(&l.comp) + c(&l.index)
            })
            .sum()
    }

    /// Drop all state.
    pub fn reset(&mut self) {
        self.state = self.model.new_state();
        self.logits = None;
    }

    /// Serialise the full state (versioned, checksummed; see `snapshot.rs`).
    pub fn snapshot(&self) -> Vec<u8> {
        snapshot::write(
            &self.model,
            &self.model_id,
            &self.state,
            self.logits.as_deref(),
        )
    }

    /// Replace the state with a snapshot of the same model.
    pub fn restore(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        let (state, logits) =
            snapshot::read(&self.model, &self.model_id, bytes).map_err(EngineError::Snapshot)?;
        if state.tokens.len() > self.ctx {
            return Err(EngineError::ContextFull {
                needed: state.tokens.len(),
                ctx: self.ctx,
            });
        }
        self.state = state;
        self.logits = logits;
        Ok(())
    }
}
