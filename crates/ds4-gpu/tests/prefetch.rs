//! L2 prefetch hints (`Backend::prefetch`, elementwise.cu `l2_prefetch` on a third chain of a
//! decode step's graph): on the tiny synthetic model, decode steps give bit-identical logits
//! with the hints off, in each prefetch form, as one graph per step and in pieces of 64, and
//! against launches one by one; and the hints were in the captured graphs (hint nodes counted
//! at capture: a hint that silently did nothing fails). Skips with the reason when no GPU is
//! present.

mod common;

use ds4_backend::Rounding;
use ds4_gpu::model::PREFETCH_OFF;
use ds4_gpu::GpuBackend;
use ds4_model::forward::{rope_tables, Model};
use ds4_model::synthetic::{SynthPreset, SynthSource};
use rand::Rng;

fn tiny() -> Option<Model<GpuBackend>> {
    let gpu = common::open_gpu()?;
    let (hp, mix) = SynthPreset::Tiny.params();
    let b = GpuBackend::new(gpu, &rope_tables(&hp)).expect("GPU backend");
    let mut progress = |_: usize, _: usize| {};
    let mut src = SynthSource::new(&hp, mix, 11, &mut progress);
    Some(Model::load_from(b, hp, &mut src, Rounding::MODEL).expect("tiny model"))
}

/// Logits of each token of `toks` decoded one at a time, with a checkpoint, a 3-token batch
/// and a rollback at step 100.
fn decode(m: &Model<GpuBackend>, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    let mut out = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        if i == 100 {
            let cp = m.checkpoint(&st);
            out.extend(m.eval_batch(&mut st, &toks[i..i + 3], true).unwrap());
            m.rollback(&mut st, cp);
        }
        out.push(m.eval(&mut st, t).unwrap());
    }
    out
}

#[test]
fn prefetch_hints_run_and_change_nothing() {
    let Some(m) = tiny() else { return };
    let mut rng = common::rng(17);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..240).map(|_| rng.gen_range(0..vocab)).collect();
    let same = |a: &[Vec<f32>], b: &[Vec<f32>], what: &str| {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "evaluation {i}: {what}"
            );
        }
    };
    m.backend.set_graph(false);
    GpuBackend::set_prefetch_l2(0, 0);
    let eager = decode(&m, &toks);
    m.backend.set_graph(true);
    m.backend.set_graph_split(0);
    GpuBackend::set_prefetch_l2(PREFETCH_OFF, 0);
    let s0 = m.backend.graph_stats();
    let off = decode(&m, &toks);
    let s1 = m.backend.graph_stats();
    println!("prefetch off: {s1:?}");
    same(&eager, &off, "graphs without hints differ from launches");
    assert_eq!(s1.hints, s0.hints, "hint nodes captured with the hints off");
    for (mode, ctas, what) in [
        (0u8, 16u32, "bulk"),
        (1, 132, "line"),
        (2, 132, "line evict_last"),
        (3, 64, "loads"),
    ] {
        GpuBackend::set_prefetch_l2(mode, ctas);
        for split in [0, 64] {
            m.backend.set_graph_split(split);
            let a = m.backend.graph_stats();
            let on = decode(&m, &toks);
            let b = m.backend.graph_stats();
            println!("prefetch {what}, pieces of {split}: {b:?}");
            same(
                &off,
                &on,
                &format!("prefetch {what} (pieces of {split}) changed the logits"),
            );
            if m.backend.graph_on() && m.backend.gpu().runtime().branches_supported() {
                assert!(b.replays - a.replays >= toks.len() as u64, "{b:?}");
                assert!(
                    b.hints > a.hints,
                    "no hint node captured (prefetch {what}, pieces of {split}): {b:?}"
                );
            }
        }
    }
    GpuBackend::set_prefetch_l2(0, 16);
}
