//! `DS4_SPEC_ROLLBACK=whole` (its own test binary: the variable is read by every generation of
//! the process): rejected drafts roll their verify batch back whole and evaluate the kept token
//! again, the form before slot marks; the output and the state are still plain greedy's.

mod common;

use ds4_engine::{BackendChoice, Engine, EngineOptions};

#[test]
fn whole_rollbacks_give_greedy_output_and_state() {
    std::env::set_var("DS4_SPEC_ROLLBACK", "whole");
    let path = ds4_synth::tiny_model_for_tests(21, true);
    let mut o = EngineOptions::new(&path);
    o.backend = BackendChoice::Cpu;
    o.mtp = Some(ds4_synth::mtp_path(&path)); // streams kept: drafts are made
    let e = Engine::open(&o).unwrap();
    let n = 40;
    let reference = common::greedy(&e, n).0;
    let full = common::after_prompt(&reference);
    let mut s = e.new_session(512);
    let (out, st) = common::with_drafter(&mut s, n, &mut |_, _, pos| {
        (full.get(pos + 1).copied().unwrap_or(0) + 1) % 512
    });
    assert_eq!(out, reference);
    assert!(st.drafted > 10 && st.accepted == 0, "{st:?}");
    assert_eq!(st.undone, 0, "no draft undone in place: {st:?}");
    let mut plain = e.new_session(512);
    plain.sync(&full, &mut |_, _| {}).unwrap();
    assert_eq!(s.snapshot(), plain.snapshot());
}
