//! The whole forward pass on the GPU backend against the CPU reference and HF transformers'
//! expected logits (the committed oracle fixture, model.md §6): every position of the
//! 640-token sequence, one-token decode and the chunked prefill path, rounding off (so the
//! reference is plain float math) and on. Skips with the reason when no GPU is present.
//!
//! Tolerance: the GPU sums in a different order (warp reductions, split K) than the CPU, so
//! logits differ by float rounding: 1e-3 absolute at logit magnitudes ~1 with rounding off.
//! With FP8/FP4 rounding on, a tie-near value can round to the neighbouring grid point on one
//! backend and not the other, so only top-1 agreement and the median are held tight.

mod common;

use ds4_backend::Rounding;
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, Model};
use ds4_model::{bind_main, HParams};
use std::path::PathBuf;
use std::sync::Arc;

/// The oracle fixtures; `DS4_ORACLE_DIR` overrides (test binaries carried to a GPU machine run
/// from another checkout path).
fn fixtures() -> PathBuf {
    std::env::var_os("DS4_ORACLE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle")
        })
}

fn tokens() -> Vec<u32> {
    let b = std::fs::read(fixtures().join("tokens.npy")).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hlen..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn load<B: ds4_backend::Backend>(b: B, name: &str, rounding: Rounding) -> Model<B> {
    let file = Arc::new(GgufFile::open(fixtures().join(name)).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let dir = bind_main(&file, &hp).unwrap();
    Model::load(b, hp, &[(file, dir)], rounding, &mut |_, _| {}).unwrap()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |m, (i, &x)| if x > m.1 { (i, x) } else { m },
        )
        .0
}

fn run<B: ds4_backend::Backend>(m: &Model<B>, ids: &[u32], chunk: Option<usize>) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    match chunk {
        None => ids.iter().map(|&t| m.eval(&mut st, t).unwrap()).collect(),
        Some(c) => ids
            .chunks(c)
            .flat_map(|ch| m.eval_batch(&mut st, ch, true).unwrap())
            .collect(),
    }
}

fn compare(what: &str, gpu: &[Vec<f32>], cpu: &[Vec<f32>]) -> (f32, f32, f64) {
    assert_eq!(gpu.len(), cpu.len());
    let mut maxes: Vec<f32> = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| {
            g.iter()
                .zip(c)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max)
        })
        .collect();
    let top1 = gpu
        .iter()
        .zip(cpu)
        .filter(|(g, c)| argmax(g) == argmax(c))
        .count() as f64
        / gpu.len() as f64;
    let max = maxes.iter().copied().fold(0.0, f32::max);
    maxes.sort_by(f32::total_cmp);
    let med = maxes[maxes.len() / 2];
    println!("{what}: max |Δ| {max:.3e}, median per-position max {med:.3e}, top-1 {top1:.4}");
    (max, med, top1)
}

/// The prefill GEMM forms (process-wide switch) and the logit tolerance each is held to: the
/// bf16 hi/lo tensor-core form keeps ~16 significant bits per product term (~1e-3 relative per
/// product, measured in bench/results/gpu-gemm-h200.txt), which through 6 layers gives logit
/// differences of a few 1e-3; the 3xTF32 and FMA forms are near f32. The f16 form (default for
/// quantised weights, opt-in) rounds each operand to f16 (~2^-12 per term): its bounds were set from
/// the H200 run in bench/results/gpu-session4-h200.txt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gemm {
    /// The opt-in f16 single-product form for quantised weights (bf16 hi/lo for the rest).
    Half,
    /// `set_gemm_precise(true)`, the default: bf16 hi/lo everywhere.
    Bf16,
    Tf32,
    Fma,
}

impl Gemm {
    fn set(self) {
        ds4_gpu::GpuBackend::set_gemm_precise(self == Gemm::Bf16);
        match self {
            Gemm::Half | Gemm::Bf16 => ds4_gpu::GpuBackend::set_gemm(true, false),
            Gemm::Tf32 => ds4_gpu::GpuBackend::set_gemm_tf32(),
            Gemm::Fma => ds4_gpu::GpuBackend::set_gemm(true, true),
        }
    }
    fn tol_max(self) -> f32 {
        match self {
            // H200, session 10: 0.288 (tiny-f32) and 0.359 (tiny-q) with the prefill HC pre
            // kernels (hcp_mix, 10x closer to the CPU op by op: ops_mix hc_prefill_precision),
            // 0.123 and 0.161 with the composed ops (DS4_GPU_HCP=off); medians 1.7e-3 both.
            Gemm::Half => 4e-1,
            Gemm::Bf16 => 3e-2,
            Gemm::Tf32 | Gemm::Fma => 1e-3,
        }
    }
    /// Median per-position max |Δ| and top-1 agreement held in every mode.
    fn tol_med_top1(self) -> (f32, f64) {
        match self {
            // Measured on the H200 with FP8/FP4 rounding: median 2.4e-2, top-1 0.931 (the f16
            // form is opt-in for that reason).
            Gemm::Half => (3e-2, 0.9),
            _ => (5e-3, 0.98),
        }
    }
}

#[test]
fn gpu_forward_matches_cpu_reference() {
    let hp = HParams::tiny();
    let Some(_) = common::open_gpu() else { return };
    let ids = tokens();
    let mut failures = Vec::new();
    for (file, rounding, plain) in [
        ("tiny-f32.gguf", Rounding::NONE, true),
        ("tiny-q.gguf", Rounding::NONE, true),
        ("tiny-q.gguf", Rounding::MODEL, false),
    ] {
        let (cpu_b, gpu_b) = common::backends(&hp).unwrap();
        let _ = rope_tables(&hp);
        let cpu = load(cpu_b, file, rounding);
        let gpu = load(gpu_b, file, rounding);
        let want = run(&cpu, &ids, None);
        let mut cases = vec![("decode".to_string(), None, Gemm::Fma)];
        for g in [Gemm::Half, Gemm::Bf16, Gemm::Tf32, Gemm::Fma] {
            cases.push((format!("prefill 128 {g:?}"), Some(128), g));
            cases.push((format!("prefill 37 {g:?}"), Some(37), g));
        }
        for (what, chunk, g) in cases {
            g.set();
            let got = run(&gpu, &ids, chunk);
            let (max, med, top1) = compare(&format!("{file} {rounding:?} {what}"), &got, &want);
            // With FP8/FP4 rounding on, a value near a grid tie can land on the other side on
            // one backend: only the median and top-1 are held there.
            let tol = if plain { g.tol_max() } else { f32::INFINITY };
            let (tol_med, tol_top1) = g.tol_med_top1();
            if max > tol || med > tol_med || top1 < tol_top1 {
                failures.push(format!(
                    "{file} {what}: max {max:.3e} (tol {tol:.0e}), median {med:.3e}, top-1 {top1}"
                ));
            }
        }
    }
    Gemm::Bf16.set();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
