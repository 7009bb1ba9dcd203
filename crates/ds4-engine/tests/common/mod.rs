//! Shared by the engine tests: a prompt of the tiny models, greedy decoding, logit distance.
#![allow(dead_code)] // each test binary uses a subset

use ds4_engine::{argmax, Engine, Session, SpecStats};

pub const PROMPT: [u32; 13] = [0, 5, 77, 300, 12, 9, 411, 250, 3, 3, 90, 128, 7];

/// `n` greedy tokens after [`PROMPT`] and the logits before each.
pub fn greedy(e: &Engine, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut s = e.new_session(512);
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let l = s.logits().unwrap().to_vec();
        let t = argmax(&l);
        toks.push(t);
        logits.push(l);
        s.eval(t).unwrap();
    }
    (toks, logits)
}

/// [`PROMPT`] followed by `toks`: the token list whose position p+1 a perfect drafter proposes.
pub fn after_prompt(toks: &[u32]) -> Vec<u32> {
    PROMPT.iter().chain(toks).copied().collect()
}

/// [`PROMPT`] into `s`, then `n` tokens by speculative decoding with `draft` as the drafter: the
/// tokens and the drafter's statistics.
pub fn with_drafter(
    s: &mut Session,
    n: usize,
    draft: &mut dyn FnMut(&[f32], u32, usize) -> u32,
) -> (Vec<u32>, SpecStats) {
    s.sync(&PROMPT, &mut |_, _| {}).unwrap();
    let mut out = Vec::new();
    let stats = s.generate_with_drafter(n, draft, &mut |t| {
        out.push(t);
        true
    });
    (out, stats.unwrap())
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// [`max_abs`] over rows of logits.
pub fn max_abs_rows(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| max_abs(x, y))
        .fold(0.0, f32::max)
}
