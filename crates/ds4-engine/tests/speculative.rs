//! MTP speculative decoding gives exactly the plain greedy output, whether drafts are accepted
//! (perfect drafter), rejected (adversarial drafter) or come from the MTP block (random weights:
//! mostly rejected). On the CPU backend, where a batch's rows are bit-identical to single steps;
//! on a GPU an accepted draft keeps the rows of a 2-token step, which sums in another order
//! (tests/gpu.rs gpu_accepted_drafts_match_single_steps).

mod common;

use common::PROMPT;
use ds4_engine::{BackendChoice, Engine, EngineOptions, Session};

fn engine() -> Engine {
    let path = ds4_synth::tiny_model_for_tests(21, true);
    let mut o = EngineOptions::new(&path);
    o.backend = BackendChoice::Cpu; // `auto` would take a GPU where there is one
    o.mtp = Some(ds4_synth::mtp_path(&path));
    Engine::open(&o).unwrap()
}

const N: usize = 60; // crosses the 8-row window and several CSA/HCA windows

fn greedy_reference(e: &Engine) -> Vec<u32> {
    common::greedy(e, N).0
}

fn run(
    s: &mut Session,
    draft: &mut dyn FnMut(&[f32], u32, usize) -> u32,
) -> (Vec<u32>, ds4_engine::SpecStats) {
    common::with_drafter(s, N, draft)
}

#[test]
fn speculative_output_equals_greedy() {
    let e = engine();
    let reference = greedy_reference(&e);
    let full = common::after_prompt(&reference);

    // Perfect drafter: every draft is the true next-next token → every draft accepted.
    let mut s = e.new_session(512);
    let (out, st) = run(&mut s, &mut |_, _, pos| {
        full.get(pos + 1).copied().unwrap_or(u32::MAX)
    });
    assert_eq!(out, reference);
    assert!(st.drafted > 20 && st.accepted == st.drafted, "{st:?}");
    let after_perfect = s.snapshot();

    // Adversarial drafter: always wrong → every draft rejected and rolled back.
    let mut s2 = e.new_session(512);
    let (out, st) = run(&mut s2, &mut |_, _, pos| {
        (full.get(pos + 1).copied().unwrap_or(0) + 1) % 512
    });
    assert_eq!(out, reference);
    assert!(st.drafted > 20 && st.accepted == 0, "{st:?}");
    // Every rejected draft undone in place (its slots restored, no re-evaluation), those that
    // close compressor windows included.
    assert_eq!(st.undone, st.drafted, "{st:?}");
    // Rollback leaves exactly the state plain decoding reaches.
    let mut plain = e.new_session(512);
    plain.sync(&full, &mut |_, _| {}).unwrap();
    assert_eq!(s2.snapshot(), plain.snapshot());
    assert_eq!(after_perfect, plain.snapshot());

    // The MTP block itself.
    let mut s3 = e.new_session(512);
    s3.sync(&PROMPT, &mut |_, _| {}).unwrap();
    assert!(s3.has_mtp());
    let mut out = Vec::new();
    let st = s3
        .generate_greedy(N, true, &mut |t| {
            out.push(t);
            true
        })
        .unwrap();
    assert_eq!(out, reference);
    // A draft at every step that follows a rejection or a plain step: drafting never stops.
    assert!(st.drafted >= N / 2, "{st:?}");
    eprintln!(
        "MTP on random weights: {} drafted, {} accepted",
        st.drafted, st.accepted
    );
}

#[test]
fn stopping_on_a_token_does_not_evaluate_it() {
    let e = engine();
    let reference = greedy_reference(&e);
    let mut s = e.new_session(512);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut seen = 0;
    s.generate_greedy(N, true, &mut |_| {
        seen += 1;
        seen < 5
    })
    .unwrap();
    assert_eq!(s.tokens().len(), PROMPT.len() + 4);
    assert_eq!(&s.tokens()[PROMPT.len()..], &reference[..4]);
}
