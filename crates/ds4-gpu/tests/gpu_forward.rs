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

/// The tiny model's scratch blocks are small: every test here takes those of 64 KiB and more
/// from the scratch pool's arenas (suballocated, `model/arena.rs`), as a full-size prompt step's
/// are, so the logits compared below also hold the arena bookkeeping to account. Set before
/// any backend of this process allocates (the pool reads it once).
fn arenas_for_most_blocks() {
    std::env::set_var("DS4_GPU_POOL_ARENA_MIN", "65536");
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
    arenas_for_most_blocks();
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

/// Largest |Δ| between two runs' logits.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// A state bound to its session's context (`Model::bound`, ds4-gpu `GpuComp::limit`) holds
/// the context's rows rounded up to 64, not the next power of two, and gives the same logits
/// as an unbound one; a restored state holds its rows rounded up to 64 and goes on the same.
/// The fixture's 320 tokens twice (640): on the CSA layers (ratio 4) 158 rows after the prompt,
/// held in 256 unbound (64 doubled past 128) and 192 bound (160 rounded up).
#[test]
fn bounded_row_capacity_changes_no_logit() {
    let hp = HParams::tiny();
    arenas_for_most_blocks();
    let Some(_) = common::open_gpu() else { return };
    let ids = tokens().repeat(2);
    assert_eq!(
        ids.len(),
        640,
        "the fixture's token count changed: redo the capacities"
    );
    let (_, gpu_b) = common::backends(&hp).unwrap();
    let gpu = load(gpu_b, "tiny-q.gguf", Rounding::MODEL);
    let n = ids.len();
    let (head, tail) = ids.split_at(n - 8);
    let mut open = gpu.new_state();
    let mut bound = gpu.new_state();
    gpu.bound(&mut bound, n);
    let a = gpu.eval_batch(&mut open, head, true).unwrap();
    let b = gpu.eval_batch(&mut bound, head, true).unwrap();
    let d = max_diff(&a, &b);
    println!("prefill of {}: max |Δ| {d:.3e}", head.len());
    assert!(d <= 1e-4, "prefill: {d}");
    let ratios = &gpu.hp.compress_ratios;
    let mut csa = 0;
    for (l, (o, b)) in open.layers.iter().zip(&bound.layers).enumerate() {
        let (o, b) = (o.row_capacity(), b.row_capacity());
        println!("layer {l} ratio {}: open {o:?}, bound {b:?}", ratios[l]);
        for (o, b) in o.into_iter().zip(b) {
            assert_eq!(o.is_some(), b.is_some());
            if let (Some(o), Some(b)) = (o, b) {
                let rows = head.len() / ratios[l] as usize;
                assert!(b >= rows && b <= o && b % 64 == 0, "layer {l}: {b} of {o}");
                if ratios[l] == 4 {
                    assert_eq!((o, b), (256, 192), "layer {l}");
                    csa += 1;
                }
            }
        }
    }
    assert!(csa >= 2, "the fixture has CSA layers with indexers");
    // Restored from the host form: its rows (158) rounded up to 64, whatever the bound.
    let mut restored = gpu.from_host(&gpu.to_host(&open));
    gpu.bound(&mut restored, n);
    for (l, r) in restored.layers.iter().enumerate() {
        if ratios[l] == 4 {
            assert_eq!(r.row_capacity(), [Some(192), Some(192)], "layer {l}");
        }
    }
    let step = |st: &mut ds4_model::forward::State<_>| -> Vec<Vec<f32>> {
        tail.iter().map(|&t| gpu.eval(st, t).unwrap()).collect()
    };
    let (a, b, r) = (step(&mut open), step(&mut bound), step(&mut restored));
    let (db, dr) = (max_diff(&a, &b), max_diff(&a, &r));
    println!(
        "decode of {}: bound max |Δ| {db:.3e}, restored {dr:.3e}",
        tail.len()
    );
    assert!(
        db <= 1e-4 && dr <= 1e-4,
        "decode: bound {db}, restored {dr}"
    );
}

/// The Q8_0 matrices' layouts. A backend told to make no layout copies
/// (`GpuBackend::set_layout_copies(false)`) holds the GGUF blocks alone; the default holds the
/// decode layout beside them; one told to hold the decode layout only
/// (`GpuBackend::set_q8_decode_only`: the engine's choice where both do not fit) holds the
/// blocks' bytes and no copy. Decode: the blocks alone within 1e-4 of the default (other
/// kernels), the decode layout alone bit for bit (the same kernels). Prompt steps of 5 and 40
/// tokens: the decode layout alone bit for bit as the blocks alone (the library's bf16 operand
/// converted from either layout is the same); steps of 2 within 1e-4 (the decode kernels).
#[test]
fn q8_layouts_keep_the_logits() {
    let hp = HParams::tiny();
    arenas_for_most_blocks();
    let Some(_) = common::open_gpu() else { return };
    let ids = &tokens()[..40];
    let (_, both_b) = common::backends(&hp).unwrap();
    let (_, blocks_b) = common::backends(&hp).unwrap();
    let (_, dec_b) = common::backends(&hp).unwrap();
    blocks_b.set_layout_copies(false);
    dec_b.set_q8_decode_only(true);
    let both = load(both_b, "tiny-q.gguf", Rounding::NONE);
    let blocks = load(blocks_b, "tiny-q.gguf", Rounding::NONE);
    let dec = load(dec_b, "tiny-q.gguf", Rounding::NONE);
    let bytes =
        |m: &Model<ds4_gpu::GpuBackend>| (m.backend.weight_bytes(), m.backend.layout_bytes());
    let ((wt, ct), (wb, cb), (wd, cd)) = (bytes(&both), bytes(&blocks), bytes(&dec));
    println!(
        "weights / copies: both {wt} / {ct}, blocks {wb} / {cb}, decode layout only {wd} / {cd}"
    );
    assert!(wt == wb && wb == wd, "{wt} {wb} {wd}");
    assert!(ct > cd && cb == 0, "{ct} {cd} {cb}"); // dec: the F16 copies alone
    let t = run(&both, ids, None);
    let (db, dd) = (
        max_diff(&t, &run(&blocks, ids, None)),
        max_diff(&t, &run(&dec, ids, None)),
    );
    println!(
        "decode of {}: max |Δ| {db:.3e} (blocks), {dd:.3e} (decode layout only)",
        ids.len()
    );
    assert!(db <= 1e-4, "{db}");
    assert_eq!(dd, 0.0);
    if !dec.backend.blas_available() {
        // Prompt steps of a matrix without its blocks run on the library alone.
        println!("prompt steps skipped: the BLAS-Lt library did not load");
        return;
    }
    for chunk in [2usize, 5, 40] {
        let d = max_diff(
            &run(&blocks, ids, Some(chunk)),
            &run(&dec, ids, Some(chunk)),
        );
        println!("prompt steps of {chunk}: max |Δ| {d:.3e} against the blocks alone");
        if chunk >= 5 {
            assert_eq!(d, 0.0, "steps of {chunk}");
        } else {
            assert!(d <= 1e-4, "steps of {chunk}: {d}"); // the decode kernels against the blocks'
        }
    }
}

/// `Backend::prefetch` is a hint: decode with the L2 prefetches on (24 MiB a hint, on the
/// graph's hint chain) gives the same logits bit for bit as without.
#[test]
fn prefetch_hints_keep_the_logits() {
    let hp = HParams::tiny();
    arenas_for_most_blocks();
    let Some(_) = common::open_gpu() else { return };
    let ids = &tokens()[..40];
    let (_, b) = common::backends(&hp).unwrap();
    let m = load(b, "tiny-q.gguf", Rounding::NONE);
    ds4_gpu::GpuBackend::set_prefetch_mb(0);
    let off = run(&m, ids, None);
    let before = ds4_gpu::GpuBackend::prefetch_launches();
    ds4_gpu::GpuBackend::set_prefetch_mb(24);
    let on = run(&m, ids, None);
    let launched = ds4_gpu::GpuBackend::prefetch_launches() - before;
    ds4_gpu::GpuBackend::set_prefetch_mb(0);
    println!("prefetch_l2 launches: {launched}");
    assert!(launched >= 3 * hp.n_layer as u64, "{launched}");
    let d = max_diff(&off, &on);
    println!(
        "decode of {} with and without prefetches: max |Δ| {d:.3e}",
        ids.len()
    );
    assert_eq!(d, 0.0);
}

/// A prompt step of 256 tokens or more is measured: the scratch pool's peak over it, per
/// token, is what later steps are sized by (`GpuBackend::step_scratch_per_token`). Every block
/// a step takes is back in the pool when it ends (handed out: 0), shorter steps teach nothing,
/// and the step the backend asks for stays within its bounds.
#[test]
fn prompt_steps_measure_their_scratch() {
    use ds4_backend::Backend;
    let hp = HParams::tiny();
    arenas_for_most_blocks();
    let Some(_) = common::open_gpu() else { return };
    let ids = tokens().repeat(2); // 640
    let (_, b) = common::backends(&hp).unwrap();
    let m = load(b, "tiny-q.gguf", Rounding::MODEL);
    assert_eq!(m.backend.step_scratch_per_token(), None);
    let mut st = m.new_state();
    m.eval_batch(&mut st, &ids[..100], false).unwrap();
    assert_eq!(
        m.backend.step_scratch_per_token(),
        None,
        "100 tokens teach nothing"
    );
    m.eval_batch(&mut st, &ids[100..], false).unwrap();
    let n = ids.len() - 100;
    let t = m
        .backend
        .step_scratch_per_token()
        .expect("a 540-token step is measured");
    let (in_use, idle) = m.backend.pool_bytes();
    println!("{n}-token step: {t} bytes a token; pool: {in_use} handed out, {idle} idle");
    // At least the step's own rows: the HC streams (n_hc x n_embd f32) of every token.
    let streams = (hp.hc_count * hp.n_embd * 4) as u64;
    assert!(t >= streams && t < 64 << 20, "{t} vs {streams}");
    assert_eq!(
        in_use, 0,
        "every scratch block is back in the pool after the step"
    );
    assert!(
        idle >= t * n as u64 / 2,
        "the step's blocks stay pooled: {idle}"
    );
    let c = m.backend.prefill_chunk();
    assert!((2048..=12288).contains(&c), "{c}");
}
