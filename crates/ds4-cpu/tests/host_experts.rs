//! Routed experts kept in host memory (`ds4_model::offload`, `--cpu-experts`) on the CPU
//! backend, where both forms can be compared with the plain model: small batches run the
//! experts through `HostExperts::run` (the bits of the plain model), prompt batches bind the
//! selected experts a group at a time and add the groups' sums (f32 order only).

mod common;

use ds4_backend::Shard;
use ds4_cpu::{CpuBackend, CpuHostExperts, CpuModel, Rounding};
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, FileSource, Model};
use ds4_model::offload::{HostExperts, HostPlacement, HostStack};
use ds4_model::{bind_main, HParams};
use std::path::Path;
use std::sync::Arc;

fn load_placed(path: &Path, layers: Vec<usize>, upload_min: usize, group: usize) -> CpuModel {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let dir = bind_main(&file, &hp).unwrap();
    let files = [(file, dir)];
    let ropes = rope_tables(&hp);
    let make =
        |s: &[HostStack; 3]| Ok(Box::new(CpuHostExperts::new(s, &ropes)?) as Box<dyn HostExperts>);
    let mut placement = HostPlacement::new(layers, &make);
    placement.upload_min = upload_min;
    placement.group = group;
    let mut progress = |_: usize, _: usize| {};
    let mut src = FileSource::new(&files, &mut progress);
    let b = CpuBackend::new(rope_tables(&hp));
    Model::load_placed(
        b,
        hp,
        &mut src,
        Rounding::MODEL,
        Shard::ONE,
        Some(&placement),
    )
    .unwrap()
}

fn tokens() -> Vec<u32> {
    (0..40u32).map(|i| (i * 97 + 13) % 512).collect()
}

#[test]
fn host_experts_give_the_plain_models_bits_one_token_at_a_time_and_in_a_batch() {
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::MODEL);
    let n_layer = plain.hp.n_layer as usize;
    let host = load_placed(&path, (0..n_layer).collect(), usize::MAX, 32);
    assert_eq!(host.host_expert_layers(), (0..n_layer).collect::<Vec<_>>());
    assert!(plain.host_expert_layers().is_empty());
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    for &t in &tokens() {
        assert_eq!(
            plain.eval(&mut a, t).unwrap(),
            host.eval(&mut b, t).unwrap()
        );
    }
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    assert_eq!(
        plain.eval_batch(&mut a, &tokens(), true).unwrap(),
        host.eval_batch(&mut b, &tokens(), true).unwrap()
    );
    assert_eq!(a, b, "the same session state");
}

#[test]
fn prompt_batches_run_the_selected_experts_group_by_group() {
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::MODEL);
    let n_expert = plain.hp.n_expert as usize;
    // Groups of 3 experts (several groups, the last one short), batches of >= 4 tokens; the
    // last two layers only (the others as plain).
    let n_layer = plain.hp.n_layer as usize;
    let host = load_placed(&path, vec![n_layer - 2, n_layer - 1], 4, 3);
    assert!(
        n_expert > 3 && !n_expert.is_multiple_of(3),
        "{n_expert} experts"
    );
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    let la = plain.eval_batch(&mut a, &tokens(), true).unwrap();
    let lb = host.eval_batch(&mut b, &tokens(), true).unwrap();
    let mut worst = 0f32;
    for (x, y) in la.iter().zip(&lb) {
        let scale = x.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    assert!(worst < 1e-5, "worst relative difference {worst}");
    // Decode steps after the prompt take the host path: the same next logits as a plain model
    // would give from the grouped prompt's state (it holds the same rows to f32 order).
    let ta = plain.eval(&mut a, 5).unwrap();
    let tb = host.eval(&mut b, 5).unwrap();
    let scale = ta.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let d = ta
        .iter()
        .zip(&tb)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(d / scale < 1e-5, "decode after the prompt: {}", d / scale);
}
