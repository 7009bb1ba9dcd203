//! Hyper-parameters read from the `deepseek4.*` GGUF metadata (model.md §1, §2.2) and checked
//! against the invariants the forward pass relies on. Nothing here is fixed to the 43-layer shape:
//! the tiny test models load through the same code.

use crate::schedule::{AttnKind, LayerKind};
use std::fmt;

/// Metadata key prefix of every architecture key.
pub const ARCH: &str = "deepseek4";

/// A metadata value as the model layer needs it. Kept independent of the GGUF crate's own value
/// type so that hyper-parameters can be built, validated and written without a file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U32(u32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    U32Array(Vec<u32>),
    F32Array(Vec<f32>),
    StrArray(Vec<String>),
}

/// Read access to typed metadata; implemented for GGUF files in `crate::gguf_meta`.
/// Each method returns `Err(message)` naming what was expected when the key exists with a wrong
/// type, and `Ok(None)` when the key is absent.
pub trait MetaSource {
    fn source_name(&self) -> String;
    fn u32(&self, key: &str) -> Result<Option<u32>, String>;
    fn u64(&self, key: &str) -> Result<Option<u64>, String>;
    fn f32(&self, key: &str) -> Result<Option<f32>, String>;
    fn bool(&self, key: &str) -> Result<Option<bool>, String>;
    fn str(&self, key: &str) -> Result<Option<String>, String>;
    fn u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, String>;
    fn f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, String>;
}

/// Every problem found while reading or validating hyper-parameters, one per line.
#[derive(Debug, Clone, PartialEq)]
pub struct HParamsError {
    pub source: String,
    pub problems: Vec<String>,
}

impl fmt::Display for HParamsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: invalid DeepSeek V4 hyper-parameters:", self.source)?;
        for p in &self.problems {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for HParamsError {}

#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub name: String,
    pub n_layer: u32,
    /// Hidden size `D`.
    pub n_embd: u32,
    pub n_vocab: u32,
    /// Query heads `H`.
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Head dim `d_h` for K and V (K = V: one shared head).
    pub head_dim: u32,
    /// RoPE dims at the tail of every head row.
    pub n_rot: u32,
    pub q_lora_rank: u32,
    pub o_groups: u32,
    pub o_lora_rank: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    pub n_expert_shared: u32,
    /// Expert FFN width `F` (routed and shared).
    pub n_ff_exp: u32,
    pub n_hash_layer: u32,
    pub sliding_window: u32,
    pub indexer_heads: u32,
    pub indexer_head_dim: u32,
    pub indexer_top_k: u32,
    pub hc_count: u32,
    pub hc_sinkhorn_iters: u32,
    pub hc_eps: f32,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub compress_rope_base: f32,
    pub rope_scale_factor: f32,
    pub rope_orig_ctx: u64,
    pub yarn_beta_fast: f32,
    pub yarn_beta_slow: f32,
    pub expert_weights_scale: f32,
    pub expert_weights_norm: bool,
    /// One ratio per layer (0 = sliding window only, 4 = CSA, > 4 = HCA), then one per MTP layer.
    pub compress_ratios: Vec<u32>,
    /// Routed-expert SwiGLU clamp, one per layer (≥ n_layer entries).
    pub swiglu_clamp: Vec<f32>,
    /// Shared-expert clamp when the file carries `swiglu_clamp_shexp`.
    pub swiglu_clamp_shexp: Option<Vec<f32>>,
    pub context_length: u64,
}

fn key(k: &str) -> String {
    format!("{ARCH}.{k}")
}

/// Upper bounds [`HParams::validate`] holds the values to that no tensor shape bounds (each
/// far above DeepSeek V4 Flash's: 128, 512, 20 and 128).
pub const MAX_WINDOW: u32 = 8192;
pub const MAX_TOP_K: u32 = 8192;
pub const MAX_SINKHORN: u32 = 1000;
pub const MAX_RATIO: u32 = 4096;

impl HParams {
    /// DeepSeek V4 Flash as published (model.md §1).
    pub fn flash() -> HParams {
        let n_layer = 43u32;
        let mut ratios: Vec<u32> = (0..n_layer)
            .map(|l| match l {
                0 | 1 => 0,
                l if l % 2 == 0 => 4,
                _ => 128,
            })
            .collect();
        ratios.push(0); // the MTP block
        HParams {
            name: "DeepSeek-V4-Flash".into(),
            n_layer,
            n_embd: 4096,
            n_vocab: 129280,
            n_head: 64,
            n_head_kv: 1,
            head_dim: 512,
            n_rot: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            n_expert: 256,
            n_expert_used: 6,
            n_expert_shared: 1,
            n_ff_exp: 2048,
            n_hash_layer: 3,
            sliding_window: 128,
            indexer_heads: 64,
            indexer_head_dim: 128,
            indexer_top_k: 512,
            hc_count: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_eps: 1e-6,
            rope_base: 10000.0,
            compress_rope_base: 160000.0,
            rope_scale_factor: 16.0,
            rope_orig_ctx: 65536,
            yarn_beta_fast: 32.0,
            yarn_beta_slow: 1.0,
            expert_weights_scale: 1.5,
            expert_weights_norm: true,
            compress_ratios: ratios,
            swiglu_clamp: vec![10.0; n_layer as usize],
            swiglu_clamp_shexp: None,
            context_length: 1 << 20,
        }
    }

    /// The first `n` (>= 1) of the layers only, the MTP block's entries kept: a synthetic
    /// benchmark on a GPU too small for every layer (`DS4_SYNTH_LAYERS`; a layer costs what it
    /// costs in the whole model, the totals are not the model's).
    pub fn keep_layers(&mut self, n: u32) {
        let n = n.clamp(1, self.n_layer);
        let mtp = self.compress_ratios.get(self.n_layer as usize).copied();
        self.compress_ratios.truncate(n as usize);
        self.compress_ratios.extend(mtp);
        self.swiglu_clamp.truncate(n as usize);
        self.n_hash_layer = self.n_hash_layer.min(n);
        self.n_layer = n;
    }

    /// The tiny test configuration of model.md §6.1: every code path of the real model with
    /// small shapes (6 layers: 2 SWA, 2 CSA, 2 HCA with ratio 8; window 8; indexer top-4).
    pub fn tiny() -> HParams {
        HParams {
            name: "ds4-tiny".into(),
            n_layer: 6,
            n_embd: 256,
            n_vocab: 512,
            n_head: 4,
            n_head_kv: 1,
            head_dim: 128,
            n_rot: 64,
            q_lora_rank: 64,
            o_groups: 2,
            o_lora_rank: 64,
            n_expert: 16,
            n_expert_used: 6,
            n_expert_shared: 1,
            n_ff_exp: 256,
            n_hash_layer: 3,
            sliding_window: 8,
            indexer_heads: 16,
            indexer_head_dim: 128,
            indexer_top_k: 4,
            compress_ratios: vec![0, 0, 4, 8, 4, 8, 0],
            swiglu_clamp: vec![1.0; 6],
            ..HParams::flash()
        }
    }

    /// Read from metadata and validate. Reports every problem at once.
    pub fn from_meta(m: &dyn MetaSource) -> Result<HParams, HParamsError> {
        let mut problems = Vec::new();
        macro_rules! req {
            ($method:ident, $k:expr) => {{
                let k = key($k);
                match m.$method(&k) {
                    Ok(Some(v)) => Some(v),
                    Ok(None) => {
                        problems.push(format!("metadata key {k}: missing"));
                        None
                    }
                    Err(e) => {
                        problems.push(format!("metadata key {k}: {e}"));
                        None
                    }
                }
            }};
        }
        macro_rules! opt {
            ($method:ident, $k:expr) => {{
                match m.$method($k) {
                    Ok(v) => v,
                    Err(e) => {
                        problems.push(format!("metadata key {}: {e}", $k));
                        None
                    }
                }
            }};
        }
        match opt!(str, "general.architecture") {
            Some(a) if a == ARCH => {}
            Some(a) => problems.push(format!(
                "metadata key general.architecture: expected \"{ARCH}\", found \"{a}\" (not a DeepSeek V4 file)"
            )),
            None => problems.push("metadata key general.architecture: missing".into()),
        }
        let name = opt!(str, "general.name").unwrap_or_default();
        let n_layer = req!(u32, "block_count");
        let n_embd = req!(u32, "embedding_length");
        let n_vocab = req!(u32, "vocab_size");
        let n_head = req!(u32, "attention.head_count");
        let n_head_kv = req!(u32, "attention.head_count_kv");
        let key_len = req!(u32, "attention.key_length");
        let val_len = req!(u32, "attention.value_length");
        let n_rot = req!(u32, "rope.dimension_count");
        let q_lora_rank = req!(u32, "attention.q_lora_rank");
        let o_lora_rank = req!(u32, "attention.output_lora_rank");
        let o_groups = req!(u32, "attention.output_group_count");
        let n_expert = req!(u32, "expert_count");
        let n_expert_used = req!(u32, "expert_used_count");
        let n_ff_exp = req!(u32, "expert_feed_forward_length");
        let n_expert_shared = req!(u32, "expert_shared_count");
        let n_hash_layer = req!(u32, "hash_layer_count");
        let sliding_window = req!(u32, "attention.sliding_window");
        let indexer_heads = req!(u32, "attention.indexer.head_count");
        let indexer_head_dim = req!(u32, "attention.indexer.key_length");
        let indexer_top_k = req!(u32, "attention.indexer.top_k");
        let hc_count = req!(u32, "hyper_connection.count");
        let hc_sinkhorn_iters = req!(u32, "hyper_connection.sinkhorn_iterations");
        let hc_eps = req!(f32, "hyper_connection.epsilon");
        let compress_ratios = req!(u32_array, "attention.compress_ratios");
        let swiglu_clamp = req!(f32_array, "swiglu_clamp_exp");
        let rope_orig_ctx = req!(u64, "rope.scaling.original_context_length");
        let rope_base = req!(f32, "rope.freq_base");
        let rope_scale_factor = req!(f32, "rope.scaling.factor");
        let yarn_beta_fast = req!(f32, "rope.scaling.yarn_beta_fast");
        let yarn_beta_slow = req!(f32, "rope.scaling.yarn_beta_slow");
        let compress_rope_base = req!(f32, "attention.compress_rope_freq_base");
        let expert_weights_scale = req!(f32, "expert_weights_scale");
        let rms_eps = req!(f32, "attention.layer_norm_rms_epsilon");
        let expert_weights_norm = req!(bool, "expert_weights_norm");
        let swiglu_clamp_shexp = opt!(f32_array, &key("swiglu_clamp_shexp"));
        let context_length = opt!(u64, &key("context_length")).unwrap_or(0);
        for k in ["expert_group_count", "expert_group_used_count"] {
            if let Some(v) = opt!(u32, &key(k)) {
                if v != 0 {
                    problems.push(format!(
                        "metadata key {}: {v}: group-limited routing is not part of DeepSeek V4 (must be 0)",
                        key(k)
                    ));
                }
            }
        }
        let src = m.source_name();
        if let (Some(k), Some(v)) = (key_len, val_len) {
            if k != v {
                problems.push(format!(
                    "metadata keys {} = {k} and {} = {v}: keys and values share one head, so they must be equal",
                    key("attention.key_length"),
                    key("attention.value_length")
                ));
            }
        }
        if !problems.is_empty() {
            return Err(HParamsError {
                source: src,
                problems,
            });
        }
        // All required keys are present here.
        let hp = HParams {
            name,
            n_layer: n_layer.unwrap(),
            n_embd: n_embd.unwrap(),
            n_vocab: n_vocab.unwrap(),
            n_head: n_head.unwrap(),
            n_head_kv: n_head_kv.unwrap(),
            head_dim: key_len.unwrap(),
            n_rot: n_rot.unwrap(),
            q_lora_rank: q_lora_rank.unwrap(),
            o_groups: o_groups.unwrap(),
            o_lora_rank: o_lora_rank.unwrap(),
            n_expert: n_expert.unwrap(),
            n_expert_used: n_expert_used.unwrap(),
            n_expert_shared: n_expert_shared.unwrap(),
            n_ff_exp: n_ff_exp.unwrap(),
            n_hash_layer: n_hash_layer.unwrap(),
            sliding_window: sliding_window.unwrap(),
            indexer_heads: indexer_heads.unwrap(),
            indexer_head_dim: indexer_head_dim.unwrap(),
            indexer_top_k: indexer_top_k.unwrap(),
            hc_count: hc_count.unwrap(),
            hc_sinkhorn_iters: hc_sinkhorn_iters.unwrap(),
            hc_eps: hc_eps.unwrap(),
            rms_eps: rms_eps.unwrap(),
            rope_base: rope_base.unwrap(),
            compress_rope_base: compress_rope_base.unwrap(),
            rope_scale_factor: rope_scale_factor.unwrap(),
            rope_orig_ctx: rope_orig_ctx.unwrap(),
            yarn_beta_fast: yarn_beta_fast.unwrap(),
            yarn_beta_slow: yarn_beta_slow.unwrap(),
            expert_weights_scale: expert_weights_scale.unwrap(),
            expert_weights_norm: expert_weights_norm.unwrap(),
            compress_ratios: compress_ratios.unwrap(),
            swiglu_clamp: swiglu_clamp.unwrap(),
            swiglu_clamp_shexp,
            context_length,
        };
        hp.validate().map_err(|problems| HParamsError {
            source: src,
            problems,
        })?;
        Ok(hp)
    }

    /// The architecture's invariants. Returns every violation, each naming its key.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut p = Vec::new();
        let mut check = |ok: bool, msg: String| {
            if !ok {
                p.push(msg)
            }
        };
        let k = key;
        for (name, v) in [
            ("block_count", self.n_layer),
            ("embedding_length", self.n_embd),
            ("vocab_size", self.n_vocab),
            ("attention.head_count", self.n_head),
            ("attention.key_length", self.head_dim),
            ("attention.q_lora_rank", self.q_lora_rank),
            ("attention.output_group_count", self.o_groups),
            ("attention.output_lora_rank", self.o_lora_rank),
            ("expert_count", self.n_expert),
            ("expert_used_count", self.n_expert_used),
            ("expert_feed_forward_length", self.n_ff_exp),
            ("attention.sliding_window", self.sliding_window),
            ("attention.indexer.head_count", self.indexer_heads),
            ("attention.indexer.top_k", self.indexer_top_k),
            ("hyper_connection.count", self.hc_count),
            (
                "hyper_connection.sinkhorn_iterations",
                self.hc_sinkhorn_iters,
            ),
        ] {
            check(v > 0, format!("{} = 0: must be positive", k(name)));
        }
        check(
            self.n_head_kv == 1,
            format!(
                "{} = {}: DeepSeek V4 has one shared KV head (must be 1)",
                k("attention.head_count_kv"),
                self.n_head_kv
            ),
        );
        check(
            self.n_expert_shared == 1,
            format!(
                "{} = {}: the tensor layout has exactly one shared expert",
                k("expert_shared_count"),
                self.n_expert_shared
            ),
        );
        check(
            self.n_rot > 0 && self.n_rot.is_multiple_of(2) && self.n_rot < self.head_dim,
            format!(
                "{} = {}: RoPE dims must be even and smaller than the head dim {}",
                k("rope.dimension_count"),
                self.n_rot,
                self.head_dim
            ),
        );
        // fp8sim rounds the non-RoPE part of a KV row in blocks of 64 (model.md §3.1).
        check(
            self.head_dim > self.n_rot && (self.head_dim - self.n_rot).is_multiple_of(64),
            format!(
                "{} = {} with {} RoPE dims: the non-RoPE part must be a multiple of 64 (FP8 blocks)",
                k("attention.key_length"),
                self.head_dim,
                self.n_rot
            ),
        );
        check(
            self.o_groups > 0 && self.n_head.is_multiple_of(self.o_groups),
            format!(
                "{} = {}: must divide the head count {}",
                k("attention.output_group_count"),
                self.o_groups,
                self.n_head
            ),
        );
        // Indexer rows: 128-point-style Hadamard (power of two) then FP4 in blocks of 32, RoPE tail.
        let idh = self.indexer_head_dim;
        check(
            idh.is_power_of_two() && idh >= 32 && idh > self.n_rot,
            format!(
                "{} = {}: must be a power of two ≥ 32 (Hadamard, FP4 blocks) and larger than the RoPE dims {}",
                k("attention.indexer.key_length"),
                idh,
                self.n_rot
            ),
        );
        check(
            self.n_expert_used <= self.n_expert,
            format!(
                "{} = {}: more than the {} experts",
                k("expert_used_count"),
                self.n_expert_used,
                self.n_expert
            ),
        );
        check(
            self.n_hash_layer <= self.n_layer,
            format!(
                "{} = {}: more than the {} layers",
                k("hash_layer_count"),
                self.n_hash_layer,
                self.n_layer
            ),
        );
        check(
            self.expert_weights_norm,
            format!(
                "{} = false: DeepSeek V4 normalises the top-k weights (must be true)",
                k("expert_weights_norm")
            ),
        );
        check(
            self.compress_ratios.len() >= self.n_layer as usize,
            format!(
                "{}: {} entries for {} layers",
                k("attention.compress_ratios"),
                self.compress_ratios.len(),
                self.n_layer
            ),
        );
        for (l, &r) in self.compress_ratios.iter().enumerate() {
            check(
                r == 0 || r == 4 || r > 4,
                format!(
                    "{}[{l}] = {r}: a ratio is 0 (sliding window), 4 (CSA) or larger than 4 (HCA)",
                    k("attention.compress_ratios")
                ),
            );
        }
        check(
            self.swiglu_clamp.len() >= self.n_layer as usize,
            format!(
                "{}: {} entries for {} layers",
                k("swiglu_clamp_exp"),
                self.swiglu_clamp.len(),
                self.n_layer
            ),
        );
        if let Some(s) = &self.swiglu_clamp_shexp {
            check(
                s.len() >= self.n_layer as usize,
                format!(
                    "{}: {} entries for {} layers",
                    k("swiglu_clamp_shexp"),
                    s.len(),
                    self.n_layer
                ),
            );
        }
        for (name, v) in self
            .swiglu_clamp
            .iter()
            .chain(self.swiglu_clamp_shexp.iter().flatten())
            .map(|v| ("swiglu clamp", *v))
        {
            check(
                v.is_finite() && v > 0.0,
                format!("{name} value {v}: must be positive and finite"),
            );
        }
        for (name, v) in [
            ("hyper_connection.epsilon", self.hc_eps),
            ("attention.layer_norm_rms_epsilon", self.rms_eps),
            ("rope.freq_base", self.rope_base),
            ("attention.compress_rope_freq_base", self.compress_rope_base),
            ("expert_weights_scale", self.expert_weights_scale),
            ("rope.scaling.yarn_beta_fast", self.yarn_beta_fast),
            ("rope.scaling.yarn_beta_slow", self.yarn_beta_slow),
        ] {
            check(
                v.is_finite() && v > 0.0,
                format!("{} = {v}: must be positive and finite", k(name)),
            );
        }
        check(
            self.rope_scale_factor.is_finite() && self.rope_scale_factor >= 1.0,
            format!(
                "{} = {}: must be ≥ 1",
                k("rope.scaling.factor"),
                self.rope_scale_factor
            ),
        );
        check(
            self.yarn_beta_fast > self.yarn_beta_slow,
            format!(
                "{} = {} must exceed {} = {}",
                k("rope.scaling.yarn_beta_fast"),
                self.yarn_beta_fast,
                k("rope.scaling.yarn_beta_slow"),
                self.yarn_beta_slow
            ),
        );
        check(
            self.rope_orig_ctx > 0,
            format!(
                "{} = 0: must be positive",
                k("rope.scaling.original_context_length")
            ),
        );
        // Values no tensor shape bounds, that size buffers or loops: a file asking for more
        // is refused here rather than failing an allocation (DeepSeek V4 Flash: window 128,
        // top-k 512, 20 Sinkhorn iterations, ratios 4 and 128).
        for (name, v, max) in [
            ("attention.sliding_window", self.sliding_window, MAX_WINDOW),
            ("attention.indexer.top_k", self.indexer_top_k, MAX_TOP_K),
            (
                "hyper_connection.sinkhorn_iterations",
                self.hc_sinkhorn_iters,
                MAX_SINKHORN,
            ),
        ] {
            check(
                v <= max,
                format!("{} = {v}: at most {max} is supported", k(name)),
            );
        }
        for (l, &r) in self.compress_ratios.iter().enumerate() {
            check(
                r <= MAX_RATIO,
                format!(
                    "{}[{l}] = {r}: at most {MAX_RATIO} is supported",
                    k("attention.compress_ratios")
                ),
            );
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(p)
        }
    }

    /// The schedule entry of layer `l` (model.md §1.1).
    pub fn layer(&self, l: u32) -> LayerKind {
        let ratio = self.compress_ratios[l as usize];
        LayerKind {
            index: l,
            ratio,
            attn: AttnKind::from_ratio(ratio),
            hash_routed: l < self.n_hash_layer,
        }
    }

    pub fn layers(&self) -> impl Iterator<Item = LayerKind> + '_ {
        (0..self.n_layer).map(|l| self.layer(l))
    }

    /// Bytes of one session's state at a context of `ctx` tokens with cache rows of
    /// `row_bytes_per_value` bytes per value (4 = f32 as the CPU stores them, 2 = f16, exact)
    /// and indexer rows of `index_bytes_per_value` (the GPU stores FP4-simulated ones as bf16:
    /// 2): every layer's raw window, the compressor frontiers (always f32), the compressed and
    /// indexer rows at full context (model.md §4.2), the token ids and one logits vector.
    pub fn session_bytes(
        &self,
        ctx: usize,
        row_bytes_per_value: u64,
        index_bytes_per_value: u64,
    ) -> u64 {
        let hd = self.head_dim as u64;
        let ihd = self.indexer_head_dim as u64;
        let v = row_bytes_per_value;
        let ctx = ctx as u64;
        let mut b = 0u64;
        for l in self.layers() {
            b += self.sliding_window as u64 * hd * v;
            if l.compressed() {
                let c = l.coff() as u64;
                b += 2 * (c * l.ratio as u64) * (c * hd) * 4 + ctx / l.ratio as u64 * hd * v;
            }
            if l.has_indexer() {
                b += 2 * 8 * (2 * ihd) * 4 + ctx / 4 * ihd * index_bytes_per_value;
            }
        }
        b + self.n_vocab as u64 * 4 + ctx * 4
    }

    /// `H · d_h`: width of the full query.
    pub fn q_dim(&self) -> u32 {
        self.n_head * self.head_dim
    }

    /// Heads per output group times head dim: the input width of one `attn_output_a` group.
    pub fn o_group_in(&self) -> u32 {
        self.n_head / self.o_groups * self.head_dim
    }

    /// Width of the HC mixer output: `(2 + N)·N`.
    pub fn hc_mix(&self) -> u32 {
        (2 + self.hc_count) * self.hc_count
    }

    /// The metadata that describes these hyper-parameters, in model.md §2.2 order.
    pub fn to_metadata(&self) -> Vec<(String, MetaValue)> {
        use MetaValue::*;
        let mut v = vec![
            ("general.architecture".to_string(), Str(ARCH.into())),
            ("general.name".to_string(), Str(self.name.clone())),
        ];
        let mut put = |k2: &str, val: MetaValue| v.push((key(k2), val));
        put(
            "context_length",
            U32(self.context_length.min(u32::MAX as u64) as u32),
        );
        put("block_count", U32(self.n_layer));
        put("embedding_length", U32(self.n_embd));
        put("vocab_size", U32(self.n_vocab));
        put("attention.head_count", U32(self.n_head));
        put("attention.head_count_kv", U32(self.n_head_kv));
        put("attention.key_length", U32(self.head_dim));
        put("attention.value_length", U32(self.head_dim));
        put("rope.dimension_count", U32(self.n_rot));
        put("attention.q_lora_rank", U32(self.q_lora_rank));
        put("attention.output_lora_rank", U32(self.o_lora_rank));
        put("attention.output_group_count", U32(self.o_groups));
        put("expert_count", U32(self.n_expert));
        put("expert_used_count", U32(self.n_expert_used));
        put("expert_feed_forward_length", U32(self.n_ff_exp));
        put("expert_shared_count", U32(self.n_expert_shared));
        put("hash_layer_count", U32(self.n_hash_layer));
        put("expert_group_count", U32(0));
        put("expert_group_used_count", U32(0));
        put("attention.sliding_window", U32(self.sliding_window));
        put("attention.indexer.head_count", U32(self.indexer_heads));
        put("attention.indexer.key_length", U32(self.indexer_head_dim));
        put("attention.indexer.top_k", U32(self.indexer_top_k));
        put("hyper_connection.count", U32(self.hc_count));
        put(
            "hyper_connection.sinkhorn_iterations",
            U32(self.hc_sinkhorn_iters),
        );
        put("hyper_connection.epsilon", F32(self.hc_eps));
        put(
            "attention.compress_ratios",
            U32Array(self.compress_ratios.clone()),
        );
        put("swiglu_clamp_exp", F32Array(self.swiglu_clamp.clone()));
        if let Some(s) = &self.swiglu_clamp_shexp {
            put("swiglu_clamp_shexp", F32Array(s.clone()));
        }
        put(
            "rope.scaling.original_context_length",
            U64(self.rope_orig_ctx),
        );
        put("rope.freq_base", F32(self.rope_base));
        put("rope.scaling.factor", F32(self.rope_scale_factor));
        put("rope.scaling.yarn_beta_fast", F32(self.yarn_beta_fast));
        put("rope.scaling.yarn_beta_slow", F32(self.yarn_beta_slow));
        put(
            "attention.compress_rope_freq_base",
            F32(self.compress_rope_base),
        );
        put("expert_weights_scale", F32(self.expert_weights_scale));
        put("attention.layer_norm_rms_epsilon", F32(self.rms_eps));
        put("expert_weights_norm", Bool(self.expert_weights_norm));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::HParams;

    #[test]
    fn keep_layers_gives_a_valid_shorter_model() {
        let mut hp = HParams::flash();
        hp.keep_layers(36);
        assert_eq!(hp.n_layer, 36);
        assert_eq!(hp.compress_ratios.len(), 37);
        assert_eq!(
            hp.compress_ratios[..36],
            HParams::flash().compress_ratios[..36]
        );
        assert_eq!(hp.compress_ratios[36], 0); // the MTP block
        assert_eq!(hp.swiglu_clamp.len(), 36);
        hp.validate().unwrap();
        let mut one = HParams::flash();
        one.keep_layers(0); // at least one layer
        assert_eq!((one.n_layer, one.n_hash_layer), (1, 1));
        one.validate().unwrap();
    }
}
