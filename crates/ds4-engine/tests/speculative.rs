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
    // Plain decoding's state, compared one token on (a kept draft picked on the device leaves
    // no logits to snapshot).
    let mut plain = e.new_session(512);
    plain.sync(&full, &mut |_, _| {}).unwrap();
    plain.eval(1).unwrap();
    let plain = plain.snapshot();
    let same = |s: &mut Session| {
        s.eval(1).unwrap();
        s.snapshot() == plain
    };
    // Host picks (the CPU's), and the picks a GPU makes in its verify steps.
    for device in [false, true] {
        // Perfect drafter: every draft is the true next-next token → every draft accepted.
        let mut s = e.new_session(512);
        s.set_device_picks(device);
        let (out, st) = run(&mut s, &mut |_, _, pos| {
            full.get(pos + 1).copied().unwrap_or(u32::MAX)
        });
        assert_eq!(out, reference, "device picks {device}");
        assert!(st.drafted > 20 && st.accepted == st.drafted, "{st:?}");
        // One step a draft, one a token without: no pick evaluated anything again.
        assert_eq!(
            s.model_steps() as usize,
            1 + st.drafted + (N - 2 * st.accepted),
            "device picks {device}"
        );
        assert!(same(&mut s), "device picks {device}: after kept drafts");

        // Adversarial drafter: always wrong → every draft rejected and rolled back.
        let mut s2 = e.new_session(512);
        s2.set_device_picks(device);
        let (out, st) = run(&mut s2, &mut |_, _, pos| {
            (full.get(pos + 1).copied().unwrap_or(0) + 1) % 512
        });
        assert_eq!(out, reference, "device picks {device}");
        assert!(st.drafted > 20 && st.accepted == 0, "{st:?}");
        // Every rejected draft undone in place (its slots restored, no re-evaluation), those
        // that close compressor windows included.
        assert_eq!(st.undone, st.drafted, "{st:?}");
        // Rollback leaves exactly the state plain decoding reaches.
        assert!(
            same(&mut s2),
            "device picks {device}: after rejected drafts"
        );

        // The MTP block itself.
        let mut s3 = e.new_session(512);
        s3.set_device_picks(device);
        s3.sync(&PROMPT, &mut |_, _| {}).unwrap();
        assert!(s3.has_mtp());
        let mut out = Vec::new();
        let st = s3
            .generate_greedy(N, true, &mut |t| {
                out.push(t);
                true
            })
            .unwrap();
        assert_eq!(out, reference, "device picks {device}");
        // A draft at every step that follows a rejection or a plain step: drafting never stops.
        assert!(st.drafted >= N / 2, "{st:?}");
        eprintln!(
            "MTP on random weights (device picks {device}): {} drafted, {} accepted",
            st.drafted, st.accepted
        );
    }
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
/// it: a kept draft is the next token, already evaluated, and the pick after it is the
/// session's ([`Session::pick`]: from its logits, or with `device` picks, as a GPU session
/// makes them, the verify step's, with no step of its own: checked). Returns the tokens,
/// (kept, rejected, no draft) counts, the session.
fn sampled_with_drafts(
    e: &Engine,
    cfg: &SamplerConfig,
    n: usize,
    device: bool,
    mut draft: Option<&mut dyn FnMut(usize, u32) -> u32>,
) -> (Vec<u32>, [usize; 3], Session) {
    let mut s = e.new_session(512);
    s.set_device_picks(device);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let prompt_steps = s.model_steps();
    let mut sm = Sampler::new(cfg.clone());
    let (mut out, mut counts, mut next) = (Vec::new(), [0; 3], None);
    while out.len() < n {
        let t = next
            .take()
            .unwrap_or_else(|| s.pick(&mut sm).unwrap().expect("a pick"));
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
    // One step a loop turn (a verify step, or a plain one without a draft): no pick made a
    // step of its own.
    let turns = counts.iter().sum::<usize>() as u64;
    assert_eq!(
        s.model_steps() - prompt_steps,
        turns,
        "{cfg:?}, device picks {device}"
    );
    (out, counts, s)
}

/// A session after the prompt and `tokens`, its speculative steps picking on the host or, with
/// `device`, as a GPU's do.
fn session_after(e: &Engine, tokens: &[u32], device: bool) -> Session {
    let mut s = e.new_session(512);
    s.set_device_picks(device);
    s.sync(&common::after_prompt(tokens), &mut |_, _| {})
        .unwrap();
    s
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
    // Without an MTP block there is nothing to draft with.
    let mut o = EngineOptions::new(ds4_synth::tiny_model_for_tests(21, true));
    o.backend = BackendChoice::Cpu;
    let no_mtp = Engine::open(&o).unwrap();
    let mut s = no_mtp.new_session(64);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut sm = Sampler::new(SamplerConfig::default());
    assert_eq!(s.eval_draft(1, &mut sm).unwrap(), Drafted::NoDraft);
    assert_eq!(s.tokens().len(), PROMPT.len(), "nothing evaluated");
    // Host picks (the CPU's) and device picks (a GPU's; `Backend::sample_rows` on the CPU makes
    // them from the same logits): the plain tokens either way.
    for (cfg, device) in configs.iter().flat_map(|c| [(c, false), (c, true)]) {
        let (want, mut plain) = sampled_plain(&e, cfg, N);
        let full = common::after_prompt(&want);
        let what = format!("{cfg:?}, device picks {device}");
        // States compared one token on (a kept draft's device picks leave no logits to
        // snapshot): that token's step reads every cache row the drafts wrote.
        plain.eval(1).unwrap();
        let plain = plain.snapshot();
        let same = |mut s: Session, what: &str| {
            s.eval(1).unwrap();
            assert!(s.snapshot() == plain, "{what}");
        };
        // Perfect drafts: every one kept (one pick a step, the same draws as plain sampling).
        let (got, c, s) = sampled_with_drafts(
            &e,
            cfg,
            N,
            device,
            Some(&mut |pos, _| full.get(pos + 1).copied().unwrap_or(u32::MAX)),
        );
        assert_eq!(got, want, "{what}: perfect drafts");
        assert!(c[0] > 20 && c[1] == 0, "{what}: {c:?}");
        same(s, &format!("{what}: state after kept drafts"));
        // Wrong drafts: every one rejected and undone in place.
        let (got, c, s) = sampled_with_drafts(
            &e,
            cfg,
            N,
            device,
            Some(&mut |pos, _| (full.get(pos + 1).copied().unwrap_or(0) + 1) % 512),
        );
        assert_eq!(got, want, "{what}: wrong drafts");
        assert!(c[0] == 0 && c[1] > 20, "{what}: {c:?}");
        same(s, &format!("{what}: state after rejected drafts"));
        // The MTP block's drafts.
        let (got, c, s) = sampled_with_drafts(&e, cfg, N, device, None);
        assert_eq!(got, want, "{what}: MTP drafts");
        assert!(c[0] + c[1] >= N / 2, "{what}: drafting stopped: {c:?}");
        same(s, &format!("{what}: state after MTP drafts"));
        eprintln!("{what}: MTP drafts kept / rejected / none: {c:?}");
    }
}

/// A device-picked step made its pick after the kept draft with the request's sampler; a
/// caller that picks there with another sampler (a tool block's structure, greedily) gets that
/// sampler's pick from the draft's logits, the draft evaluated again alone.
#[test]
fn a_pick_with_another_sampler_after_a_device_kept_draft_is_that_samplers() {
    let e = engine();
    let (want, _) = sampled_plain(&e, &SamplerConfig::default(), 8);
    let hot = SamplerConfig {
        temperature: 1.0,
        seed: 5,
        ..Default::default()
    };
    let plain = session_after(&e, &want[..6], false);
    for device in [false, true] {
        let mut s = session_after(&e, &want[..4], device);
        // The draft is the greedy token, so kept only where the hot sampler picks it too: the
        // first seed whose first draw does.
        let p = session_after(&e, &want[..5], false);
        let seed = (0..100_000)
            .find(|&seed| {
                let mut probe = Sampler::new(SamplerConfig {
                    seed,
                    ..hot.clone()
                });
                probe.sample(p.logits().unwrap()) == want[5]
            })
            .expect("a seed that picks the greedy token");
        let mut hs = Sampler::new(SamplerConfig {
            seed,
            ..hot.clone()
        });
        let r = s.eval_with_draft(want[4], want[5], &mut hs).unwrap();
        assert_eq!(r, Drafted::Accepted(want[5]), "device picks {device}");
        // The greedy pick after the draft, not the hot sampler's.
        let mut greedy = Sampler::new(SamplerConfig::default());
        assert_eq!(
            s.pick(&mut greedy).unwrap(),
            Some(want[6]),
            "device picks {device}"
        );
        assert_eq!(s.tokens(), plain.tokens());
        assert!(s.snapshot() == plain.snapshot(), "device picks {device}");
    }
}

#[test]
fn a_kept_draft_taken_back_leaves_the_plain_state() {
    let e = engine();
    let (want, _) = sampled_plain(&e, &SamplerConfig::default(), 8);
    let plain = session_after(&e, &want[..5], false);
    for device in [false, true] {
        let mut s = session_after(&e, &want[..4], device);
        assert!(!s.undo_draft().unwrap(), "nothing to take back yet");
        let mut greedy = Sampler::new(SamplerConfig::default());
        let r = s.eval_with_draft(want[4], want[5], &mut greedy).unwrap();
        assert_eq!(r, Drafted::Accepted(want[5]));
        assert_eq!(s.tokens().len(), PROMPT.len() + 6);
        assert!(s.undo_draft().unwrap());
        assert!(!s.undo_draft().unwrap(), "taken back once");
        assert_eq!(s.tokens(), plain.tokens());
        if device {
            // No logits left the device: nothing to pick from (a plain GPU step that picked
            // on the device leaves the same).
            assert_eq!(s.logits(), None);
            assert_eq!(s.pick(&mut greedy).unwrap(), None);
        } else {
            assert!(s.snapshot() == plain.snapshot(), "the plain state");
            assert_eq!(s.logits(), plain.logits());
            // Decoding goes on from there as plainly: the next greedy token is the reference's.
            assert_eq!(argmax(s.logits().unwrap()), want[5]);
        }
        s.eval(want[5]).unwrap();
        let p2 = session_after(&e, &want[..6], false);
        assert!(s.snapshot() == p2.snapshot(), "device picks {device}");
        assert_eq!(s.logits(), p2.logits());
    }
}
