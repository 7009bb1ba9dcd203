//! Sessions on the tiny synthetic model: sync semantics, snapshot/restore with a bit-identical
//! continuation, corrupt snapshots rejected, several sessions at once.

use ds4_engine::{Engine, EngineOptions};

fn engine() -> Engine {
    Engine::open(&EngineOptions::new(ds4_synth::tiny_model_for_tests(
        5, false,
    )))
    .unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 131 + salt * 7 + 11) % 512)
        .collect()
}

#[test]
fn snapshot_restore_continues_bit_identically() {
    let e = engine();
    let prompt = toks(37, 1); // mid-window for both the CSA (4) and HCA (8) compressors
    let mut a = e.new_session(256);
    a.sync(&prompt, &mut |_, _| {}).unwrap();
    let snap = a.snapshot();
    let mut b = e.new_session(256);
    b.restore(&snap).unwrap();
    assert_eq!(a.tokens(), b.tokens());
    assert_eq!(a.logits(), b.logits());
    for t in toks(30, 2) {
        let la = a.eval(t).unwrap().to_vec();
        let lb = b.eval(t).unwrap().to_vec();
        assert_eq!(la, lb);
    }
    // A snapshot of the restored session is byte-identical to the original's.
    assert_eq!(a.snapshot(), b.snapshot());
}

/// A capture encoded after the session moved on gives the bytes of a snapshot taken when the
/// capture was (the server encodes its checkpoints on another thread), and it restores.
#[test]
fn a_capture_encodes_later_to_the_snapshot_of_its_moment() {
    let e = engine();
    let mut a = e.new_session(256);
    a.sync(&toks(37, 3), &mut |_, _| {}).unwrap();
    let at = a.snapshot();
    let cap = a.capture();
    assert_eq!(cap.tokens(), a.tokens());
    for t in toks(12, 4) {
        a.eval(t).unwrap();
    }
    let later = std::thread::spawn(move || cap.encode()).join().unwrap();
    assert_eq!(later, at);
    assert_ne!(later, a.snapshot());
    let mut b = e.new_session(256);
    b.restore(&later).unwrap();
    assert_eq!(b.tokens().len(), 37);
}

#[test]
fn corrupt_or_truncated_snapshots_are_rejected() {
    let e = engine();
    let mut a = e.new_session(64);
    a.sync(&toks(20, 3), &mut |_, _| {}).unwrap();
    let snap = a.snapshot();
    let mut b = e.new_session(64);
    let mut bad = snap.clone();
    bad[200] ^= 1;
    assert!(b
        .restore(&bad)
        .unwrap_err()
        .to_string()
        .contains("checksum"));
    assert!(b.restore(&snap[..snap.len() / 2]).is_err());
    assert!(b
        .restore(b"garbage")
        .unwrap_err()
        .to_string()
        .contains("magic"));
    let mut small = e.new_session(10);
    assert!(small
        .restore(&snap)
        .unwrap_err()
        .to_string()
        .contains("context"));
    assert!(
        b.tokens().is_empty(),
        "a failed restore leaves the session untouched"
    );
}

#[test]
fn sync_extends_prefixes_and_rebuilds_otherwise() {
    let e = engine();
    let p = toks(25, 4);
    let mut s = e.new_session(128);
    assert_eq!(s.sync(&p[..10], &mut |_, _| {}).unwrap(), 0);
    assert_eq!(s.sync(&p, &mut |_, _| {}).unwrap(), 10);
    let mut fresh = e.new_session(128);
    fresh.sync(&p, &mut |_, _| {}).unwrap();
    assert_eq!(
        s.logits(),
        fresh.logits(),
        "extending equals evaluating in one go"
    );
    let mut q = p.clone();
    q[5] = (q[5] + 1) % 512;
    assert_eq!(
        s.sync(&q, &mut |_, _| {}).unwrap(),
        0,
        "a changed token forces a rebuild"
    );
    assert!(s
        .sync(&toks(200, 5), &mut |_, _| {})
        .unwrap_err()
        .to_string()
        .contains("context full"));
    assert!(s.eval(9999).is_err());
}

/// `Session::sync` evaluates in the backend's prompt steps (128 on the CPU), the last one
/// partial, reports them (`last_steps`), reports progress after each, and a sync with nothing
/// new evaluates no step.
#[test]
fn sync_steps_are_the_backends_prompt_steps() {
    let e = engine();
    let p = toks(300, 6);
    let mut s = e.new_session(512);
    assert_eq!(s.prefill_step(), 128);
    let mut seen = Vec::new();
    s.sync(&p, &mut |done, total| seen.push((done, total)))
        .unwrap();
    assert_eq!(s.last_steps(), &[128, 128, 44]);
    assert_eq!(seen, vec![(128, 300), (256, 300), (300, 300)]);
    assert_eq!(s.sync(&p, &mut |_, _| {}).unwrap(), 300);
    assert!(s.last_steps().is_empty());
    let mut more = p.clone();
    more.extend(toks(5, 7));
    s.sync(&more, &mut |_, _| {}).unwrap();
    assert_eq!(s.last_steps(), &[5]);
}

/// `Session::fill_random` (`ds4 bench --decode-only`): the state it builds holds exactly the rows
/// a computed context of the same length holds (its snapshot, which stores every row, has the
/// same size, with no logits), the same tokens, and decoding goes on from it; a fill that does
/// not fit the context is refused.
#[test]
fn random_fill_has_the_row_counts_of_a_real_context() {
    let e = engine();
    for n in [1usize, 7, 8, 37, 64, 130] {
        let prompt = toks(n, 4);
        let mut real = e.new_session(256);
        real.sync(&prompt, &mut |_, _| {}).unwrap();
        let logits_bytes = 4 * real.logits().unwrap().len();
        let mut fake = e.new_session(256);
        fake.fill_random(&prompt, 9).unwrap();
        assert_eq!(fake.tokens(), &prompt[..]);
        assert!(fake.logits().is_none());
        assert_eq!(
            fake.snapshot().len() + logits_bytes,
            real.snapshot().len(),
            "{n} tokens"
        );
        // Another seed fills other values into the same shapes.
        let mut other = e.new_session(256);
        other.fill_random(&prompt, 10).unwrap();
        assert_eq!(other.snapshot().len(), fake.snapshot().len());
        assert_ne!(other.snapshot(), fake.snapshot());
        let l = fake.eval(3).unwrap();
        assert!(l.iter().all(|v| v.is_finite()), "{n} tokens");
        assert_eq!(fake.tokens().len(), n + 1);
    }
    let mut small = e.new_session(10);
    assert!(small.fill_random(&toks(11, 5), 1).is_err());
}
