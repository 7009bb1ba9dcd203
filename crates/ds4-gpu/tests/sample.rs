//! Token sampling on the GPU (`Backend::sample`, gpu/sample.cu) against the host reference
//! `ds4_backend::sample::select`: random logits (normal, coarse with many ties, all equal) at
//! vocab 1,000 and 129,280, every combination of the filters, many draws u; then the same
//! inside a recorded step (graph replays with new arguments each step), timing each pick
//! (`DS4_GPU_SAMPLE=onecta`: the single-CTA temperature form, for A/B). Greedy must match
//! exactly; a temperature pick may differ only within rounding of a boundary (the host gives
//! the GPU's pick for u ± 3e-5 or top-p/min-p × (1 ± 1e-6): with all-equal logits the top-p
//! set's edge is a sum of 64,640 equal terms). Skips with the reason without a GPU.

mod common;

use ds4_backend::sample::{select, SampleParams};
use ds4_backend::Backend;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use rand::Rng;
use std::time::Instant;

fn gpu() -> Option<GpuBackend> {
    common::backends(&HParams::tiny()).map(|(_, g)| g)
}

/// Logits of kind 0 normal (scale 3), 1 coarse (quarter steps: many ties), 2 all equal.
fn logits(kind: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut r = common::rng(seed);
    match kind {
        0 => common::randn(&mut r, n, 3.0),
        1 => (0..n)
            .map(|_| (r.gen_range(-8i32..=8) as f32) * 0.25)
            .collect(),
        _ => vec![0.5; n],
    }
}

fn combos() -> Vec<SampleParams> {
    let mut v = Vec::new();
    for &temperature in &[0.0f32, 0.7, 1.0, 1.5] {
        for &top_k in &[0usize, 1, 5, 40, 200] {
            for &top_p in &[1.0f32, 0.9, 0.5] {
                for &min_p in &[0.0f32, 0.05, 0.5] {
                    v.push(SampleParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                    });
                }
            }
        }
    }
    v
}

/// (exact, near-boundary) counts; panics on a pick the host never makes near u.
fn check(l: &[f32], p: &SampleParams, u: f64, got: u32, what: &str) -> (usize, usize) {
    let want = select(l, p, u);
    if got == want {
        return (1, 0);
    }
    // u or a filter threshold (top-p, min-p: the set's edge) within rounding.
    let d = 3e-5;
    let nudged = |f: f32| SampleParams {
        top_p: if p.top_p < 1.0 { p.top_p * f } else { p.top_p },
        min_p: p.min_p * f,
        ..*p
    };
    let near = [1.0, 1.0 + 1e-6, 1.0 - 1e-6].iter().any(|&f| {
        [u, u - d, u + d]
            .iter()
            .any(|&v| select(l, &nudged(f), v.clamp(0.0, 1.0 - 1e-12)) == got)
    });
    assert!(
        near && !p.greedy(),
        "{what}: {p:?} u {u}: GPU picked {got} (logit {}), host {want} (logit {})",
        l.get(got as usize).copied().unwrap_or(f32::NAN),
        l[want as usize]
    );
    (0, 1)
}

#[test]
fn gpu_sampling_matches_host_select() {
    let Some(g) = gpu() else { return };
    let mut r = common::rng(5);
    let (mut exact, mut near) = (0, 0);
    for &n in &[1000usize, 129_280] {
        for kind in 0..3 {
            let l = logits(kind, n, 100 + kind as u64 + n as u64);
            let buf = g.upload(&l);
            for p in combos() {
                let draws = if n > 1000 { 3 } else { 8 };
                for k in 0..draws {
                    let u = match k {
                        0 => 0.0,
                        1 => 0.999_999,
                        _ => r.gen::<f64>(),
                    };
                    let got = g.sample(&buf, n, &p, u);
                    let (e, m) = check(&l, &p, u, got, &format!("n {n} kind {kind}"));
                    exact += e;
                    near += m;
                }
            }
        }
    }
    g.check().unwrap();
    println!("{exact} picks exact, {near} within rounding of a boundary");
    assert!(near * 100 <= exact, "too many boundary picks: {near}");
}

#[test]
fn gpu_sampling_inside_recorded_steps() {
    let Some(g) = gpu() else { return };
    let n = 129_280;
    let mut r = common::rng(9);
    let l = logits(0, n, 77);
    let t1 = SampleParams {
        temperature: 1.0,
        ..Default::default()
    };
    let cases = [
        SampleParams::default(),
        t1,
        SampleParams { top_k: 40, ..t1 },
        SampleParams { top_p: 0.95, ..t1 },
        SampleParams { min_p: 0.05, ..t1 },
        SampleParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
        },
    ];
    for p in cases {
        let mut times = Vec::new();
        for step in 0..12 {
            let u = r.gen::<f64>();
            g.graph_begin(1);
            let buf = g.upload(&l); // the step's first action: recording goes on
            let t = Instant::now();
            let got = g.sample(&buf, n, &p, u);
            times.push(t.elapsed().as_secs_f64() * 1e6);
            g.graph_end();
            g.check().unwrap();
            check(&l, &p, u, got, &format!("recorded step {step}"));
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{p:?}: median {:.1} us a pick (launch + read of the id), stats {:?}",
            times[times.len() / 2],
            g.graph_stats()
        );
    }
}
