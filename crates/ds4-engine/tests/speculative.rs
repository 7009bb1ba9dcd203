//! MTP speculative decoding gives exactly the plain greedy output, whether drafts are accepted
//! (perfect drafter), rejected (adversarial drafter) or come from the MTP block (random weights:
//! mostly rejected). On the CPU backend, where a batch's rows are bit-identical to single steps;
//! on a GPU an accepted draft keeps the rows of a 2-token step, which sums in another order
//! (tests/gpu.rs gpu_accepted_drafts_match_single_steps).

mod common;

use common::PROMPT;
use ds4_engine::{
    argmax, BackendChoice, Drafted, Engine, EngineOptions, Sampler, SamplerConfig, Session,
};

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

/// `n` tokens sampled with `cfg` after [`PROMPT`], plainly (`eval` of each, the host picking from
/// its logits): the tokens and the session after them.
fn sampled_plain(e: &Engine, cfg: &SamplerConfig, n: usize) -> (Vec<u32>, Session) {
    let mut s = e.new_session(512);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut sm = Sampler::new(cfg.clone());
    let mut out = Vec::new();
    for _ in 0..n {
        let t = sm.sample(s.logits().unwrap());
        out.push(t);
        s.eval(t).unwrap();
    }
    (out, s)
}

/// The same through [`Session::eval_with_draft`] (`draft(position of the token, token)` gives
/// the draft; None: the MTP block's, [`Session::eval_draft`]), as a server's decode loop runs
/// it: a kept draft is the next token, already evaluated, and the pick after it comes from
/// the session's logits. Returns the tokens, (kept, rejected, no draft) counts, the session.
fn sampled_with_drafts(
    e: &Engine,
    cfg: &SamplerConfig,
    n: usize,
    mut draft: Option<&mut dyn FnMut(usize, u32) -> u32>,
) -> (Vec<u32>, [usize; 3], Session) {
    let mut s = e.new_session(512);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut sm = Sampler::new(cfg.clone());
    let (mut out, mut counts, mut next) = (Vec::new(), [0; 3], None);
    while out.len() < n {
        let t = next
            .take()
            .unwrap_or_else(|| sm.sample(s.logits().unwrap()));
        out.push(t);
        let r = match draft.as_mut() {
            Some(f) => {
                let d = f(s.tokens().len(), t);
                s.eval_with_draft(t, d, &mut sm).unwrap()
            }
            None => s.eval_draft(t, &mut sm).unwrap(),
        };
        match r {
            Drafted::Accepted(d) => {
                counts[0] += 1;
                if out.len() < n {
                    out.push(d);
                } else {
                    // One more token than asked for: not emitted, so not evaluated either.
                    assert!(s.undo_draft().unwrap());
                }
            }
            Drafted::Rejected(x) => {
                counts[1] += 1;
                next = Some(x);
            }
            Drafted::NoDraft => {
                counts[2] += 1;
                s.eval(t).unwrap();
            }
        }
    }
    (out, counts, s)
}

#[test]
fn drafts_under_any_sampler_give_the_plain_samplers_tokens() {
    let e = engine();
    let configs = [
        SamplerConfig::default(), // greedy
        SamplerConfig {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        },
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            seed: 11,
        },
    ];
    for cfg in &configs {
        // The CPU picks on the host anyway: drafts pay under every sampler.
        assert!(e.new_session(64).drafts_pay(&Sampler::new(cfg.clone())));
        // Without an MTP block there is nothing to draft with.
        let mut o = EngineOptions::new(ds4_synth::tiny_model_for_tests(21, true));
        o.backend = BackendChoice::Cpu;
        let no_mtp = Engine::open(&o).unwrap();
        assert!(!no_mtp
            .new_session(64)
            .drafts_pay(&Sampler::new(cfg.clone())));
        let (want, plain) = sampled_plain(&e, cfg, N);
        let full = common::after_prompt(&want);
        // Perfect drafts: every one kept (one pick a step, the same draws as plain sampling).
        let (got, c, s) = sampled_with_drafts(
            &e,
            cfg,
            N,
            Some(&mut |pos, _| full.get(pos + 1).copied().unwrap_or(u32::MAX)),
        );
        assert_eq!(got, want, "{cfg:?}: perfect drafts");
        assert!(c[0] > 20 && c[1] == 0, "{cfg:?}: {c:?}");
        assert_eq!(
            s.snapshot(),
            plain.snapshot(),
            "{cfg:?}: state after kept drafts"
        );
        // Wrong drafts: every one rejected and undone in place.
        let (got, c, s) = sampled_with_drafts(
            &e,
            cfg,
            N,
            Some(&mut |pos, _| (full.get(pos + 1).copied().unwrap_or(0) + 1) % 512),
        );
        assert_eq!(got, want, "{cfg:?}: wrong drafts");
        assert!(c[0] == 0 && c[1] > 20, "{cfg:?}: {c:?}");
        assert_eq!(
            s.snapshot(),
            plain.snapshot(),
            "{cfg:?}: state after rejected drafts"
        );
        // The MTP block's drafts.
        let (got, c, s) = sampled_with_drafts(&e, cfg, N, None);
        assert_eq!(got, want, "{cfg:?}: MTP drafts");
        assert!(c[0] + c[1] >= N / 2, "{cfg:?}: drafting stopped: {c:?}");
        assert_eq!(
            s.snapshot(),
            plain.snapshot(),
            "{cfg:?}: state after MTP drafts"
        );
        eprintln!("{cfg:?}: MTP drafts kept / rejected / none: {c:?}");
    }
}

#[test]
fn a_kept_draft_taken_back_leaves_the_plain_state() {
    let e = engine();
    let (want, _) = sampled_plain(&e, &SamplerConfig::default(), 8);
    let mut plain = e.new_session(512);
    plain
        .sync(&common::after_prompt(&want[..5]), &mut |_, _| {})
        .unwrap();
    let mut s = e.new_session(512);
    s.sync(&common::after_prompt(&want[..4]), &mut |_, _| {})
        .unwrap();
    assert!(!s.undo_draft().unwrap(), "nothing to take back yet");
    let mut greedy = Sampler::new(SamplerConfig::default());
    let r = s.eval_with_draft(want[4], want[5], &mut greedy).unwrap();
    assert_eq!(r, Drafted::Accepted(want[5]));
    assert_eq!(s.tokens().len(), PROMPT.len() + 6);
    assert!(s.undo_draft().unwrap());
    assert!(!s.undo_draft().unwrap(), "taken back once");
    assert_eq!(s.tokens(), plain.tokens());
    assert_eq!(s.snapshot(), plain.snapshot());
    assert_eq!(s.logits(), plain.logits());
    // And decoding goes on from there as plainly: the next greedy token is the reference's.
    assert_eq!(argmax(s.logits().unwrap()), want[5]);
    s.eval(want[5]).unwrap();
    plain.eval(want[5]).unwrap();
    assert_eq!(s.snapshot(), plain.snapshot());
}
