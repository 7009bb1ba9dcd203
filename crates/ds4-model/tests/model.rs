//! Hyper-parameter validation, the tensor schedule's totals against the published files, and
//! binding messages.

use ds4_gguf::GgmlType;
use ds4_model::bind::{bind_specs, Found};
use ds4_model::tensors::tensor_bytes;
use ds4_model::{main_tensors, mtp_tensors, AttnKind, HParams, MetaSource, MetaValue, Mix};
use std::collections::HashMap;

/// Metadata held in a map, as written by `HParams::to_metadata`.
struct MapMeta(HashMap<String, MetaValue>);

impl MapMeta {
    fn from(hp: &HParams) -> MapMeta {
        MapMeta(hp.to_metadata().into_iter().collect())
    }
    fn get(&self, k: &str) -> Option<&MetaValue> {
        self.0.get(k)
    }
}

fn wrong(k: &str, v: &MetaValue) -> String {
    format!("key {k}: unexpected {v:?}")
}

impl MetaSource for MapMeta {
    fn source_name(&self) -> String {
        "map".into()
    }
    fn u32(&self, k: &str) -> Result<Option<u32>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::U32(x)) => Ok(Some(*x)),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn u64(&self, k: &str) -> Result<Option<u64>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::U64(x)) => Ok(Some(*x)),
            Some(MetaValue::U32(x)) => Ok(Some(*x as u64)),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn f32(&self, k: &str) -> Result<Option<f32>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::F32(x)) => Ok(Some(*x)),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::Bool(x)) => Ok(Some(*x)),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn str(&self, k: &str) -> Result<Option<String>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::Str(x)) => Ok(Some(x.clone())),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn u32_array(&self, k: &str) -> Result<Option<Vec<u32>>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::U32Array(x)) => Ok(Some(x.clone())),
            Some(v) => Err(wrong(k, v)),
        }
    }
    fn f32_array(&self, k: &str) -> Result<Option<Vec<f32>>, String> {
        match self.get(k) {
            None => Ok(None),
            Some(MetaValue::F32Array(x)) => Ok(Some(x.clone())),
            Some(v) => Err(wrong(k, v)),
        }
    }
}

#[test]
fn presets_round_trip_through_metadata() {
    for hp in [HParams::flash(), HParams::tiny()] {
        hp.validate().unwrap();
        let back = HParams::from_meta(&MapMeta::from(&hp)).unwrap();
        assert_eq!(back, hp);
    }
}

#[test]
fn flash_schedule_matches_model_md() {
    let hp = HParams::flash();
    let kinds: Vec<AttnKind> = hp.layers().map(|l| l.attn).collect();
    assert_eq!(kinds.iter().filter(|k| **k == AttnKind::Swa).count(), 2);
    assert_eq!(kinds.iter().filter(|k| **k == AttnKind::Csa).count(), 21);
    assert_eq!(kinds.iter().filter(|k| **k == AttnKind::Hca).count(), 20);
    assert_eq!(hp.layer(2).attn, AttnKind::Csa);
    assert!(hp.layer(2).hash_routed && !hp.layer(3).hash_routed);
    assert_eq!(hp.layer(41).ratio, 128);
}

#[test]
fn other_sizes_load() {
    // Not fixed to 43 layers: a 3-layer model with a ratio-16 HCA layer is valid.
    let mut hp = HParams::tiny();
    hp.n_layer = 3;
    hp.compress_ratios = vec![0, 4, 16];
    hp.swiglu_clamp = vec![2.0; 3];
    hp.n_hash_layer = 1;
    let back = HParams::from_meta(&MapMeta::from(&hp)).unwrap();
    assert_eq!(back.n_layer, 3);
    assert_eq!(main_tensors(&back).len(), 6 + 3 * 24 + 2 * 4 + 6);
}

#[test]
fn invariant_violations_name_their_key() {
    type Mutation = fn(&mut HParams);
    let cases: Vec<(Mutation, &str)> = vec![
        (|h| h.n_head_kv = 2, "deepseek4.attention.head_count_kv = 2"),
        (
            |h| h.o_groups = 3,
            "deepseek4.attention.output_group_count = 3",
        ),
        (
            |h| h.n_expert_used = 300,
            "deepseek4.expert_used_count = 300",
        ),
        (
            |h| h.compress_ratios[3] = 2,
            "deepseek4.attention.compress_ratios[3] = 2",
        ),
        (
            |h| h.compress_ratios.truncate(10),
            "deepseek4.attention.compress_ratios: 10 entries for 43 layers",
        ),
        (|h| h.n_rot = 63, "deepseek4.rope.dimension_count = 63"),
        (
            |h| h.indexer_head_dim = 96,
            "deepseek4.attention.indexer.key_length = 96",
        ),
        (
            |h| h.expert_weights_norm = false,
            "deepseek4.expert_weights_norm = false",
        ),
        (
            |h| h.rms_eps = 0.0,
            "deepseek4.attention.layer_norm_rms_epsilon = 0",
        ),
        (
            |h| h.swiglu_clamp.truncate(5),
            "deepseek4.swiglu_clamp_exp: 5 entries for 43 layers",
        ),
        (|h| h.n_hash_layer = 50, "deepseek4.hash_layer_count = 50"),
        // Found by fuzz/model_load: a top-k of 1.6e9 asked the first token for 6 GB.
        (
            |h| h.indexer_top_k = 1_611_301_000,
            "deepseek4.attention.indexer.top_k = 1611301000: at most 8192",
        ),
        (
            |h| h.sliding_window = 1 << 20,
            "deepseek4.attention.sliding_window = 1048576: at most 8192",
        ),
        (
            |h| h.hc_sinkhorn_iters = 5000,
            "deepseek4.hyper_connection.sinkhorn_iterations = 5000: at most 1000",
        ),
        (
            |h| h.compress_ratios[1] = 1 << 16,
            "deepseek4.attention.compress_ratios[1] = 65536: at most 4096",
        ),
    ];
    for (mutate, expect) in cases {
        let mut hp = HParams::flash();
        mutate(&mut hp);
        let err = HParams::from_meta(&MapMeta::from(&hp)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(expect), "expected {expect:?} in:\n{msg}");
    }
}

#[test]
fn missing_and_mistyped_keys_are_all_reported() {
    let mut m = MapMeta::from(&HParams::flash());
    m.0.remove("deepseek4.block_count");
    m.0.insert(
        "deepseek4.embedding_length".into(),
        MetaValue::Str("4096".into()),
    );
    m.0.insert(
        "general.architecture".into(),
        MetaValue::Str("llama".into()),
    );
    let err = HParams::from_meta(&m).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("metadata key deepseek4.block_count: missing"),
        "{msg}"
    );
    assert!(
        msg.contains("metadata key deepseek4.embedding_length"),
        "{msg}"
    );
    assert!(
        msg.contains("expected \"deepseek4\", found \"llama\""),
        "{msg}"
    );
    assert_eq!(err.problems.len(), 3, "{msg}");
}

fn totals(hp: &HParams, mix: Mix) -> (usize, u64, u64) {
    let specs = main_tensors(hp);
    let params = specs.iter().map(|s| s.n_elements()).sum();
    let bytes = specs
        .iter()
        .map(|s| tensor_bytes(s, s.family.type_in(mix)).unwrap())
        .sum();
    (specs.len(), params, bytes)
}

#[test]
fn published_file_totals() {
    // issue: 1,328 tensors, 284.3 B parameters, 80.76 GiB (q2) and 153.33 GiB (q4).
    let hp = HParams::flash();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let (n, params, q2) = totals(&hp, Mix::Q2);
    assert_eq!(n, 1328);
    assert_eq!(format!("{:.1}", params as f64 / 1e9), "284.3");
    assert_eq!(format!("{:.2}", gib(q2)), "80.76");
    // The q4 tensor data is 153.322 GiB; with the ~4.5 MB tokenizer header the file is the
    // published 153.33 GiB (checked on a synthesised file in the CLI tests).
    let (_, _, q4) = totals(&hp, Mix::Q4);
    assert_eq!(format!("{:.3}", gib(q4)), "153.322");
    assert_eq!(mtp_tensors(&hp).len(), 32);
}

#[test]
fn every_tiny_tensor_is_whole_blocks_in_every_mix() {
    let hp = HParams::tiny();
    for mix in [Mix::Q2, Mix::Q4, Mix::F32] {
        for s in main_tensors(&hp).iter().chain(&mtp_tensors(&hp)) {
            let ty = s.family.type_in(mix);
            assert!(tensor_bytes(s, ty).is_some(), "{} as {ty}", s.name);
        }
    }
}

#[test]
fn binding_reports_each_problem_in_the_documented_form() {
    let hp = HParams::flash();
    let specs = main_tensors(&hp);
    let mut file: HashMap<String, (GgmlType, Vec<u64>)> = specs
        .iter()
        .map(|s| (s.name.clone(), (s.family.type_in(Mix::Q2), s.dims.clone())))
        .collect();
    file.get_mut("blk.7.attn_q_b.weight").unwrap().0 = GgmlType::F16;
    file.remove("blk.3.attn_sinks.weight");
    file.get_mut("blk.9.ffn_up_exps.weight").unwrap().0 = GgmlType::Q4_K;
    file.get_mut("output_norm.weight").unwrap().1 = vec![4095];
    file.insert("blk.1.exp_probs_b.bias".into(), (GgmlType::F32, vec![256])); // tolerated
    file.insert("rope_freqs.weight".into(), (GgmlType::F32, vec![32]));
    let names: Vec<String> = file.keys().cloned().collect();
    let err = bind_specs(
        "x.gguf",
        &specs,
        |n| {
            file.get(n).map(|(ty, dims)| Found {
                ty: *ty,
                dims: dims.clone(),
                offset: 0,
                n_bytes: 0,
            })
        },
        names.iter().map(|s| s.as_str()),
        |n| n == "blk.1.exp_probs_b.bias",
    )
    .unwrap_err();
    let msg = err.to_string();
    for want in [
        "tensor blk.7.attn_q_b.weight: expected Q8_0 or F32 [1024, 32768], found F16 [1024, 32768]",
        "tensor blk.3.attn_sinks.weight: missing (expected F32 [64])",
        "tensor blk.9.ffn_up_exps.weight: type Q4_K differs from blk.9.ffn_gate_exps.weight type IQ2_XXS",
        "tensor output_norm.weight: expected F32 [4096], found F32 [4095]",
        "tensor rope_freqs.weight: not part of the DeepSeek V4 layout",
    ] {
        assert!(msg.contains(want), "missing {want:?} in:\n{msg}");
    }
    assert_eq!(err.problems.len(), 5, "{msg}");
}

#[test]
fn session_memory_matches_model_md_sizes() {
    // model.md §4.2: 3440 compressed values per token; fixed part ≈ 10.75 MiB raw window +
    // 11.64 MiB frontiers (f32); ≈ 430 MiB at 32K and 13.4 GiB at 1M in f32.
    let hp = HParams::flash();
    let per_token = (hp.session_bytes(2 << 20, 4, 4) - hp.session_bytes(1 << 20, 4, 4)) as f64
        / (1u64 << 20) as f64;
    assert!(
        (per_token - (3440.0 * 4.0 + 4.0)).abs() < 1.0,
        "{per_token}"
    );
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let fixed = gib(hp.session_bytes(0, 4, 4));
    assert!((fixed - (10.75 + 11.64) / 1024.0).abs() < 0.01, "{fixed}");
    assert!((gib(hp.session_bytes(1 << 20, 4, 4)) - 13.47).abs() < 0.1);
    assert!(hp.session_bytes(32768, 2, 2) < hp.session_bytes(32768, 4, 4));
    // bf16 indexer rows (the GPU): each indexer layer's 2^18 rows × 128 values at 1M, 2 bytes
    // saved a value.
    let saved = hp.session_bytes(1 << 20, 4, 4) - hp.session_bytes(1 << 20, 4, 2);
    let ix_layers = hp.layers().filter(|l| l.has_indexer()).count() as u64;
    assert_eq!(saved, ix_layers * (1 << 18) * 128 * 2);
}
