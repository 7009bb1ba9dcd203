//! Expert parallelism through the engine (`EngineOptions::devices`), on CPU reference ranks
//! (the GPU ranks run the same schedule: `tests/gpu.rs`): the tiny model with an MTP file over
//! 2 ranks (with tensor parallelism: the default where the ranks divide the 2 attention output
//! groups; and without) and 3 ranks (expert parallel only: 3 does not divide 2) gives one rank's greedy tokens with logits within a few ulp-scale differences,
//! its snapshots move both ways between one rank and the ranks, speculative decoding (checkpoints,
//! rollbacks and the MTP block through every rank) gives its plain greedy output, and a group
//! larger than the expert count is a clear error.

mod common;

use common::{max_abs, PROMPT};
use ds4_engine::{BackendChoice, Engine, EngineOptions};

const N: usize = 40; // crosses the 8-row window and several CSA/HCA windows

fn open(ranks: usize) -> Result<Engine, ds4_engine::EngineError> {
    open_tp(ranks, true)
}

fn open_tp(ranks: usize, tp: bool) -> Result<Engine, ds4_engine::EngineError> {
    let path = ds4_synth::tiny_model_for_tests(21, true);
    let mut o = EngineOptions::new(&path);
    o.mtp = Some(ds4_synth::mtp_path(&path));
    o.backend = BackendChoice::Cpu;
    // Plain float math: with the FP8/FP4 rounding steps on, the MoE sum's other order can move a
    // value across a rounding boundary (then ~1e-3 logits; the tokens still agreed).
    o.rounding = ds4_engine::Rounding::NONE;
    if ranks > 1 {
        o.devices = (0..ranks).collect();
    }
    o.tp = tp;
    Engine::open(&o)
}

fn greedy(e: &Engine) -> (Vec<u32>, Vec<Vec<f32>>) {
    common::greedy(e, N)
}

#[test]
fn ranks_give_one_ranks_tokens_and_share_snapshots() {
    let one = open(1).unwrap();
    assert_eq!(one.backend_name(), "cpu");
    let (t1, l1) = greedy(&one);
    for (ranks, tp, kind) in [
        (2, true, "tensor + expert parallel"),
        (2, false, "expert parallel"),
        (3, true, "expert parallel"),
    ] {
        let ep = open_tp(ranks, tp).unwrap();
        assert_eq!(ep.backend_name(), format!("cpu x{ranks} ({kind})"));
        let (te, le) = greedy(&ep);
        let worst = l1
            .iter()
            .zip(&le)
            .map(|(a, b)| max_abs(a, b))
            .fold(0.0, f32::max);
        println!(
            "{ranks} ranks ({kind}): max |Δ logit| {worst:.3e} against one rank over {N} steps"
        );
        assert_eq!(te, t1, "{ranks} ranks");
        assert!(worst > 0.0 && worst < 1e-4, "{ranks} ranks: {worst}");

        // A snapshot of the ranks continues on one rank, and one rank's on the ranks.
        let mut s = ep.new_session(512);
        s.sync(&PROMPT, &mut |_, _| {}).unwrap();
        let snap = s.snapshot();
        let want = s.eval(t1[0]).unwrap().to_vec();
        let mut r = one.new_session(512);
        r.restore(&snap).unwrap();
        let d = max_abs(r.eval(t1[0]).unwrap(), &want);
        assert!(d < 1e-4, "ranks -> one rank: {d}");
        let mut r2 = ep.new_session(512);
        r2.restore(&r.snapshot()).unwrap();
        assert_eq!(r2.tokens(), r.tokens());
        let a = r2.eval(t1[1]).unwrap().to_vec();
        let b = r.eval(t1[1]).unwrap().to_vec();
        assert!(max_abs(&a, &b) < 1e-4, "one rank -> ranks");
    }
}

#[test]
fn speculative_decoding_on_ranks_equals_their_greedy() {
    let ep = open(2).unwrap();
    let (plain, _) = greedy(&ep);
    let mut s = ep.new_session(512);
    assert!(s.has_mtp());
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut spec = Vec::new();
    let st = s
        .generate_greedy(N, true, &mut |t| {
            spec.push(t);
            true
        })
        .unwrap();
    println!("speculative on 2 ranks: {st:?}");
    assert!(st.drafted >= N / 2, "{st:?}");
    assert_eq!(spec, plain);
}

#[test]
fn more_ranks_than_experts_is_a_clear_error() {
    let e = open(17).err().expect("17 ranks for 16 experts");
    let msg = e.to_string();
    assert!(
        msg.contains("17 ranks") && msg.contains("16 routed experts"),
        "{msg}"
    );
}
