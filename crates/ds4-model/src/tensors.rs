//! The tensor schedule: every tensor a DS4 GGUF holds, with its GGUF dims (`[in, out, …]`, ne0
//! first) and the types it may have (model.md §2.3–2.6). One list serves both weight binding
//! (checking a file) and `ds4 synth` (writing one), so the two cannot drift apart.

use crate::hparams::HParams;
use crate::schedule::AttnKind;
use ds4_gguf::GgmlType::{self, *};

/// What a tensor is, as far as storage type and synthetic initialisation care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Attention projections, shared expert and LM head: Q8_0 in both published mixes.
    Proj,
    /// Routed expert gate/up (`ffn_gate_exps`, `ffn_up_exps`): IQ2_XXS (q2) / Q4_K (q4).
    ExpGateUp,
    /// Routed expert down (`ffn_down_exps`): Q2_K (q2) / Q4_K (q4).
    ExpDown,
    /// Embedding, HC mixers, router, compressor and indexer matrices, `ape`: F16.
    Half,
    /// Norm weights (≈ 1).
    Norm,
    /// HC scales (`*hc_*_scale`).
    HcScale,
    /// HC biases (`*hc_*_base`).
    HcBase,
    /// Attention sink logits.
    Sinks,
    /// Router selection bias `exp_probs_b`.
    Bias,
    /// Hash routing table `ffn_gate_tid2eid`.
    Tid2Eid,
}

/// A published quantisation mix, or the float layout used by oracle fixtures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// `…-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-…` (80.8 GiB).
    Q2,
    /// `…-Q4KExperts-F16HC-…` (153.3 GiB).
    Q4,
    /// Every matrix F32 (oracle fixtures).
    F32,
}

impl Mix {
    pub fn parse(s: &str) -> Option<Mix> {
        match s {
            "q2" => Some(Mix::Q2),
            "q4" => Some(Mix::Q4),
            "f32" => Some(Mix::F32),
            _ => None,
        }
    }
}

impl Family {
    /// Storage type in a given mix.
    pub fn type_in(self, mix: Mix) -> GgmlType {
        use Family::*;
        match (self, mix) {
            (Tid2Eid, _) => I32,
            (Norm | HcScale | HcBase | Sinks | Bias, _) => F32,
            (_, Mix::F32) => F32,
            (Proj, _) => Q8_0,
            (Half, _) => F16,
            (ExpGateUp, Mix::Q2) => IQ2_XXS,
            (ExpDown, Mix::Q2) => Q2_K,
            (ExpGateUp | ExpDown, Mix::Q4) => Q4_K,
        }
    }

    /// Types the engine accepts: the published ones, plus F32 for every float tensor (exact
    /// oracle fixtures) and any routed type for routed experts (as ds4 does).
    pub fn accepted(self) -> &'static [GgmlType] {
        use Family::*;
        match self {
            Tid2Eid => &[I32],
            Norm | HcScale | HcBase | Sinks | Bias => &[F32],
            Proj => &[Q8_0, F32],
            Half => &[F16, F32],
            ExpGateUp | ExpDown => &[IQ2_XXS, Q2_K, Q4_K, Q8_0, F32],
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// GGUF dims, ne0 first: `[in, out]` for matrices, `[in, out, experts]` for expert stacks.
    pub dims: Vec<u64>,
    pub family: Family,
}

impl TensorSpec {
    fn new(name: impl Into<String>, dims: &[u64], family: Family) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            family,
        }
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Input width (ne0) — the fan-in of a matrix.
    pub fn fan_in(&self) -> u64 {
        self.dims[0]
    }
}

/// Tensors of one transformer block with name prefix `prefix` (`blk.7.` or `mtp.0.`).
fn block_tensors(hp: &HParams, prefix: &str, l: Option<u32>, out: &mut Vec<TensorSpec>) {
    use Family::*;
    let d = hp.n_embd as u64;
    let mix = hp.hc_mix() as u64;
    let hc_flat = (hp.hc_count * hp.n_embd) as u64;
    let hd = hp.head_dim as u64;
    let q_rank = hp.q_lora_rank as u64;
    let ff = hp.n_ff_exp as u64;
    let ne = hp.n_expert as u64;
    let mut t = |n: &str, dims: &[u64], f: Family| {
        out.push(TensorSpec::new(format!("{prefix}{n}"), dims, f))
    };
    t("hc_attn_fn.weight", &[hc_flat, mix], Half);
    t("hc_attn_scale.weight", &[3], HcScale);
    t("hc_attn_base.weight", &[mix], HcBase);
    t("attn_norm.weight", &[d], Norm);
    t("attn_q_a.weight", &[d, q_rank], Proj);
    t("attn_q_a_norm.weight", &[q_rank], Norm);
    t("attn_q_b.weight", &[q_rank, hp.q_dim() as u64], Proj);
    t("attn_kv.weight", &[d, hd], Proj);
    t("attn_kv_a_norm.weight", &[hd], Norm);
    t("attn_sinks.weight", &[hp.n_head as u64], Sinks);
    t(
        "attn_output_a.weight",
        &[
            hp.o_group_in() as u64,
            (hp.o_groups * hp.o_lora_rank) as u64,
        ],
        Proj,
    );
    t(
        "attn_output_b.weight",
        &[(hp.o_groups * hp.o_lora_rank) as u64, d],
        Proj,
    );
    if let Some(l) = l {
        let kind = hp.layer(l);
        if kind.compressed() {
            let w = kind.coff() as u64 * hd;
            t("attn_compressor_ape.weight", &[w, kind.ratio as u64], Half);
            t("attn_compressor_kv.weight", &[d, w], Half);
            t("attn_compressor_gate.weight", &[d, w], Half);
            t("attn_compressor_norm.weight", &[hd], Norm);
        }
        if kind.attn == AttnKind::Csa {
            let ihd = hp.indexer_head_dim as u64;
            let iw = kind.coff() as u64 * ihd;
            t(
                "indexer.attn_q_b.weight",
                &[q_rank, hp.indexer_heads as u64 * ihd],
                Half,
            );
            t("indexer.proj.weight", &[d, hp.indexer_heads as u64], Half);
            t(
                "indexer_compressor_ape.weight",
                &[iw, kind.ratio as u64],
                Half,
            );
            t("indexer_compressor_kv.weight", &[d, iw], Half);
            t("indexer_compressor_gate.weight", &[d, iw], Half);
            t("indexer_compressor_norm.weight", &[ihd], Norm);
        }
    }
    t("hc_ffn_fn.weight", &[hc_flat, mix], Half);
    t("hc_ffn_scale.weight", &[3], HcScale);
    t("hc_ffn_base.weight", &[mix], HcBase);
    t("ffn_norm.weight", &[d], Norm);
    t("ffn_gate_inp.weight", &[d, ne], Half);
    match l {
        Some(l) if l < hp.n_hash_layer => t(
            "ffn_gate_tid2eid.weight",
            &[hp.n_expert_used as u64, hp.n_vocab as u64],
            Tid2Eid,
        ),
        _ => t("exp_probs_b.bias", &[ne], Bias),
    }
    t("ffn_gate_exps.weight", &[d, ff, ne], ExpGateUp);
    t("ffn_up_exps.weight", &[d, ff, ne], ExpGateUp);
    t("ffn_down_exps.weight", &[ff, d, ne], ExpDown);
    t("ffn_gate_shexp.weight", &[d, ff], Proj);
    t("ffn_up_shexp.weight", &[d, ff], Proj);
    t("ffn_down_shexp.weight", &[ff, d], Proj);
}

/// Every tensor of the main GGUF, globals first, then layer by layer.
pub fn main_tensors(hp: &HParams) -> Vec<TensorSpec> {
    use Family::*;
    let d = hp.n_embd as u64;
    let v = hp.n_vocab as u64;
    let n = hp.hc_count as u64;
    let mut out = vec![
        TensorSpec::new("token_embd.weight", &[d, v], Half),
        TensorSpec::new("output_hc_fn.weight", &[n * d, n], Half),
        TensorSpec::new("output_hc_base.weight", &[n], HcBase),
        TensorSpec::new("output_hc_scale.weight", &[1], HcScale),
        TensorSpec::new("output_norm.weight", &[d], Norm),
        TensorSpec::new("output.weight", &[d, v], Proj),
    ];
    for l in 0..hp.n_layer {
        block_tensors(hp, &format!("blk.{l}."), Some(l), &mut out);
    }
    out
}

/// The 32 tensors of the MTP GGUF (model.md §2.5): one SWA-only, bias-routed block plus the
/// embedding/hidden projections and its own HC head. It reuses the main embedding and LM head.
pub fn mtp_tensors(hp: &HParams) -> Vec<TensorSpec> {
    use Family::*;
    let d = hp.n_embd as u64;
    let n = hp.hc_count as u64;
    let mut out = vec![
        TensorSpec::new("mtp.0.hc_head_fn.weight", &[n * d, n], Half),
        TensorSpec::new("mtp.0.hc_head_base.weight", &[n], HcBase),
        TensorSpec::new("mtp.0.hc_head_scale.weight", &[1], HcScale),
        TensorSpec::new("mtp.0.e_proj.weight", &[d, d], Proj),
        TensorSpec::new("mtp.0.h_proj.weight", &[d, d], Proj),
        TensorSpec::new("mtp.0.enorm.weight", &[d], Norm),
        TensorSpec::new("mtp.0.hnorm.weight", &[d], Norm),
        TensorSpec::new("mtp.0.norm.weight", &[d], Norm),
    ];
    block_tensors(hp, "mtp.0.", None, &mut out);
    out
}

/// Bytes a tensor occupies with type `ty` (None when ne0 is not a whole number of blocks).
pub fn tensor_bytes(spec: &TensorSpec, ty: GgmlType) -> Option<u64> {
    let row = ty.row_bytes(spec.dims[0])?;
    row.checked_mul(spec.dims[1..].iter().product::<u64>())
}

/// Every main tensor of `hp` in `mix` with its type and bytes: what memory plans and rank
/// splits sum over without a file (a size that is not a whole number of blocks counts 0).
pub fn mix_sizes(hp: &HParams, mix: Mix) -> Vec<(TensorSpec, GgmlType, u64)> {
    main_tensors(hp)
        .into_iter()
        .map(|t| {
            let ty = t.family.type_in(mix);
            let b = tensor_bytes(&t, ty).unwrap_or(0);
            (t, ty, b)
        })
        .collect()
}
