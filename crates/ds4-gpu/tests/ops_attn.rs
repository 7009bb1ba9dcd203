//! The attention-state ops (rope, round_rows, compress, index_select, attend) on the GPU against
//! the CPU reference on random inputs, at tiny shapes and the real ones (64 heads, head 512,
//! window 128, top-k 512). Skips with the reason when no GPU is present (DS4_REQUIRE_GPU=1: fail).
//!
//! Exact: row rounding (bits), compressor frontiers (bits), ring state, indexer selections.
//! Near: RoPE (device sin/cos in f64, then cast), pooled rows and attention (exp, sum order).
//! attend and index_select run every case with both kernel forms (split/fast and simple) through
//! a process-wide switch: run with `--test-threads=1` so the two tests do not flip it for each other.

mod common;

use common::{assert_close, backends, f32_bytes, file, randn, rng, src};
use ds4_backend::{
    AttnSpec, Backend, CompDims, CompressSpec, GgmlType, HostLayerState, IndexSpec, LayerDims,
    RopeKind, RowRounding, Which,
};
use ds4_cpu::CpuBackend;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use rand::seq::SliceRandom;
use rand::Rng;

type CpuW = <CpuBackend as Backend>::Weight;
type GpuW = <GpuBackend as Backend>::Weight;

fn setup() -> Option<(CpuBackend, GpuBackend)> {
    backends(&HParams::tiny())
}

fn gpu_ok(gpu: &GpuBackend, op: &str) {
    if let Err(e) = gpu.check() {
        panic!("{op}: GPU error: {e}");
    }
}

fn vectors(cpu: &CpuBackend, gpu: &GpuBackend, v: &[f32]) -> (CpuW, GpuW) {
    let f = file(&[("v", GgmlType::F32, vec![v.len() as u64], f32_bytes(v))]);
    (
        cpu.vector(&src(&f, "v")).unwrap(),
        gpu.vector(&src(&f, "v")).unwrap(),
    )
}

/// A `rows × cols` matrix of type F32, F16 or BF16 on both backends.
fn matrices(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    ty: GgmlType,
    vals: &[f32],
    rows: usize,
    cols: usize,
) -> (CpuW, GpuW) {
    let bytes = match ty {
        GgmlType::F32 => f32_bytes(vals),
        GgmlType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => panic!("matrices: {ty:?} is not a float type"),
    };
    let f = file(&[("m", ty, vec![cols as u64, rows as u64], bytes)]);
    (
        cpu.matrix(&src(&f, "m")).unwrap(),
        gpu.matrix(&src(&f, "m")).unwrap(),
    )
}

fn assert_bits(op: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: lengths");
    let bad: Vec<usize> = (0..cpu.len())
        .filter(|&i| gpu[i].to_bits() != cpu[i].to_bits())
        .collect();
    println!("{op}: {} of {} values differ in bits", bad.len(), cpu.len());
    if let Some(&i) = bad.first() {
        panic!(
            "{op}: value {i}: GPU {} ({:#x}) vs CPU {} ({:#x})",
            gpu[i],
            gpu[i].to_bits(),
            cpu[i],
            cpu[i].to_bits()
        );
    }
}

/// Rounded values: a device exp an ulp away can move a value to the neighbouring grid point,
/// so allow a few flips (≤ `frac` of the values, each within `tol`), the rest within 1e-5.
fn assert_mostly_close(op: &str, gpu: &[f32], cpu: &[f32], frac: f64, tol: f32) {
    assert_close(op, gpu, cpu, tol);
    let far = gpu
        .iter()
        .zip(cpu)
        .filter(|(g, c)| (*g - *c).abs() > 1e-5 * (1.0 + c.abs()))
        .count();
    assert!(
        far as f64 <= frac * cpu.len() as f64 + 1.0,
        "{op}: {far} of {} values off by more than 1e-5",
        cpu.len()
    );
}

// ---------------------------------------------------------------------------------------------

#[test]
fn rope_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    let mut r = rng(1);
    for &(n, heads, width) in &[(3usize, 4usize, 128usize), (2, 1, 64), (5, 64, 512)] {
        for kind in [RopeKind::Swa, RopeKind::Comp] {
            for inverse in [false, true] {
                for t0 in [0usize, 7, 1_000_000] {
                    let x = randn(&mut r, n * heads * width, 2.0);
                    let mut c = x.clone();
                    cpu.rope(&mut c, n, heads, width, 64, t0, kind, inverse);
                    let mut g = gpu.upload(&x);
                    gpu.rope(&mut g, n, heads, width, 64, t0, kind, inverse);
                    let op = format!("rope {kind:?} inv {inverse} t0 {t0} {n}x{heads}x{width}");
                    let gv = gpu.download(&g, x.len());
                    gpu_ok(&gpu, &op);
                    assert_close(&op, &gv, &c, 2e-6);
                }
            }
        }
    }
}

/// Rows built to hit rounding ties: integers on the FP8 grid scale, f16 half-steps.
fn tie_rows(r: &mut impl Rng, rows: usize, width: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * width);
    for row in 0..rows {
        let e = r.gen_range(-12i32..6);
        for c in 0..width {
            let x = match row % 4 {
                // FP8: block amax 448·2^e (scale exactly 2^e), integers between.
                0 if c % 64 == 0 => 448.0 * 2f32.powi(e),
                0 => r.gen_range(-448i32..=448) as f32 * 2f32.powi(e),
                // FP8 subnormal ties: multiples of 2^-10 of the scale.
                1 if c % 64 == 0 => 448.0 * 2f32.powi(e),
                1 => r.gen_range(-64i32..=64) as f32 * 2f32.powi(e - 10),
                // f16 ties: multiples of 2^-12 near 1..4, and near the f16 subnormal range.
                2 => r.gen_range(-16384i32..16384) as f32 * 2f32.powi(-12),
                _ => r.gen_range(-4096i32..4096) as f32 * 2f32.powi(-26),
            };
            v.push(x);
        }
    }
    v
}

#[test]
fn round_rows_is_exact() {
    let Some((cpu, gpu)) = setup() else { return };
    let mut r = rng(2);
    let cases = [
        (
            512,
            RowRounding {
                fp8_nope: 448,
                fp4_hadamard: false,
                f16: true,
            },
        ),
        (
            512,
            RowRounding {
                fp8_nope: 448,
                fp4_hadamard: false,
                f16: false,
            },
        ),
        (
            512,
            RowRounding {
                fp8_nope: 0,
                fp4_hadamard: false,
                f16: true,
            },
        ),
        (
            128,
            RowRounding {
                fp8_nope: 0,
                fp4_hadamard: true,
                f16: true,
            },
        ),
        (
            128,
            RowRounding {
                fp8_nope: 0,
                fp4_hadamard: true,
                f16: false,
            },
        ),
        (
            512,
            RowRounding {
                fp8_nope: 448,
                fp4_hadamard: true,
                f16: true,
            },
        ),
        (
            64,
            RowRounding {
                fp8_nope: 0,
                fp4_hadamard: true,
                f16: true,
            },
        ),
        (
            128,
            RowRounding {
                fp8_nope: 64,
                fp4_hadamard: false,
                f16: true,
            },
        ),
    ];
    // Width-128 FP4 rows take round_fp4h128_f32 (a warp a row) by default and round_rows_f32
    // in the simple form: both.
    for (width, rr, simple) in cases
        .iter()
        .flat_map(|&(w, rr)| [(w, rr, false), (w, rr, true)])
    {
        GpuBackend::set_attn_simple(simple);
        let rows = 1500;
        let mut x = randn(&mut r, rows * width, 3.0);
        // Scaled rows (tiny and large magnitudes) and tie rows.
        for (i, v) in x.iter_mut().enumerate() {
            match (i / width) % 5 {
                0 => *v *= 1e-6,
                1 => *v *= 3e3,
                _ => {}
            }
        }
        x.extend(tie_rows(&mut r, 800, width));
        let rows = x.len() / width;
        let mut c = x.clone();
        cpu.round_rows(&mut c, rows, width, rr);
        let mut g = gpu.upload(&x);
        gpu.round_rows(&mut g, rows, width, rr);
        let op = format!("round_rows {width} {rr:?} simple {simple}");
        let gv = gpu.download(&g, x.len());
        gpu_ok(&gpu, &op);
        assert_bits(&op, &gv, &c);
    }
    GpuBackend::set_attn_simple(false);
}

// ---------------------------------------------------------------------------------------------

struct CompCase {
    dims: CompDims,
    which: Which,
    ape_ty: GgmlType,
    round: RowRounding,
    chunks: &'static [usize],
}

/// Runs the case's chunks on both backends, checking each against the CPU; returns the GPU's
/// compressed rows after the last chunk.
fn run_compress(cpu: &CpuBackend, gpu: &GpuBackend, case: &CompCase, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    let c = case.dims;
    let (w, d, ratio) = (c.width(), c.d, c.ratio);
    let ld = LayerDims {
        window: 8,
        head_dim: d,
        comp: if case.which == Which::Attn {
            Some(c)
        } else {
            None
        },
        index: if case.which == Which::Index {
            Some(c)
        } else {
            None
        },
        // FP4-rounded indexer rows: the GPU stores them as bf16 (exact).
        index_fp4: case.round.fp4_hadamard,
    };
    let ape_v = randn(&mut r, ratio * w, 1.0);
    let (ape_c, ape_g) = matrices(cpu, gpu, case.ape_ty, &ape_v, ratio, w);
    let norm_v: Vec<f32> = (0..d).map(|_| r.gen_range(0.5f32..1.5)).collect();
    let (norm_c, norm_g) = vectors(cpu, gpu, &norm_v);
    let spec = CompressSpec {
        dims: c,
        rope: RopeKind::Comp,
        n_rot: 64,
        round: case.round,
        eps: 1e-6,
    };
    let mut cs = cpu.new_layer_state(&ld);
    let mut gs = gpu.new_layer_state(&ld);
    let mut t0 = 0;
    let exact_rows = case.round == RowRounding::default();
    let mut rows = Vec::new();
    for (k, &n) in case.chunks.iter().enumerate() {
        let a = randn(&mut r, n * w, 2.0);
        let g = randn(&mut r, n * w, 3.0);
        cpu.compress(&mut cs, case.which, &spec, &ape_c, &norm_c, &a, &g, n, t0);
        let (ag, gg) = (gpu.upload(&a), gpu.upload(&g));
        gpu.compress(&mut gs, case.which, &spec, &ape_g, &norm_g, &ag, &gg, n, t0);
        t0 += n;
        let op = format!(
            "compress r {ratio} coff {} d {d} {:?} chunk {k} (n {n}, now t {t0})",
            c.coff, case.ape_ty
        );
        let hs = gpu.state_to_host(&gs);
        gpu_ok(gpu, &op);
        let pick = |h: &HostLayerState| match case.which {
            Which::Attn => h.comp.clone().unwrap(),
            Which::Index => h.index.clone().unwrap(),
        };
        let (hc, hg) = (pick(&cs), pick(&hs));
        assert_bits(&format!("{op} front_kv"), &hg.front_kv, &hc.front_kv);
        assert_bits(
            &format!("{op} front_score"),
            &hg.front_score,
            &hc.front_score,
        );
        assert_eq!(hg.rows.len(), hc.rows.len(), "{op}: row count");
        if exact_rows {
            assert_close(&format!("{op} rows"), &hg.rows, &hc.rows, 1e-5);
        } else {
            assert_mostly_close(&format!("{op} rows"), &hg.rows, &hc.rows, 0.002, 1.0);
        }
        rows = hg.rows;
    }
    rows
}

#[test]
fn compress_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    let none = RowRounding::default();
    let kv_round = RowRounding {
        fp8_nope: 448,
        fp4_hadamard: false,
        f16: true,
    };
    let ix_round = RowRounding {
        fp8_nope: 0,
        fp4_hadamard: true,
        f16: true,
    };
    let small: &[usize] = &[1, 3, 4, 9, 130, 1, 1, 2, 5, 3, 1, 8, 17, 1];
    let hca: &[usize] = &[1, 3, 8, 17, 130, 1, 1, 5, 7, 1, 64];
    let cases = [
        CompCase {
            dims: CompDims {
                ratio: 8,
                coff: 1,
                d: 128,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F32,
            round: none,
            chunks: hca,
        },
        CompCase {
            dims: CompDims {
                ratio: 8,
                coff: 1,
                d: 128,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F16,
            round: none,
            chunks: hca,
        },
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 128,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F32,
            round: none,
            chunks: small,
        },
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 128,
            },
            which: Which::Index,
            ape_ty: GgmlType::F16,
            round: ix_round,
            chunks: small,
        },
        // Real shapes: HCA (128, d 512), CSA (4, d 512), indexer (4, d 128).
        CompCase {
            dims: CompDims {
                ratio: 128,
                coff: 1,
                d: 512,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F16,
            round: kv_round,
            chunks: &[1, 3, 128, 257, 130, 1, 1, 40, 300],
        },
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 512,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F16,
            round: kv_round,
            chunks: &[1, 3, 4, 9, 130, 1, 2, 1, 70],
        },
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 128,
            },
            which: Which::Index,
            ape_ty: GgmlType::F16,
            round: ix_round,
            chunks: &[2, 3, 4, 9, 130, 1, 1, 1, 70],
        },
    ];
    // Decode runs (n = 1 steps across several closes) and an odd width.
    let ones: &[usize] = &[1; 19];
    let decode = [
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 512,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F16,
            round: kv_round,
            chunks: ones,
        },
        CompCase {
            dims: CompDims {
                ratio: 4,
                coff: 2,
                d: 128,
            },
            which: Which::Index,
            ape_ty: GgmlType::F16,
            round: ix_round,
            chunks: ones,
        },
        CompCase {
            dims: CompDims {
                ratio: 8,
                coff: 1,
                d: 512,
            },
            which: Which::Attn,
            ape_ty: GgmlType::BF16,
            round: kv_round,
            chunks: ones,
        },
        CompCase {
            dims: CompDims {
                ratio: 3,
                coff: 2,
                d: 72,
            },
            which: Which::Attn,
            ape_ty: GgmlType::F32,
            round: none,
            chunks: &[1, 1, 2, 1, 1, 1, 5, 1, 1, 1, 1],
        },
    ];
    // Both glue forms: new (default) and old (DS4_GPU_ATTN_GLUE=old); the new one with both row
    // forms everywhere, split and fused (DS4_GPU_COMP_ROW=split / fused; the default takes
    // either by the pool's length), whose rows must agree in bits.
    let all: Vec<&CompCase> = cases.iter().chain(decode.iter()).collect();
    GpuBackend::set_attn_glue_old(false);
    let mut split = Vec::new();
    for fused in [false, true] {
        GpuBackend::set_comp_row(if fused { "fused" } else { "split" });
        for (i, case) in all.iter().enumerate() {
            let rows = run_compress(&cpu, &gpu, case, 100 + i as u64);
            if !fused {
                split.push(rows);
            } else {
                let c = case.dims;
                let op = format!("compress r {} coff {} d {}", c.ratio, c.coff, c.d);
                assert_bits(&format!("{op}: split rows vs fused"), &split[i], &rows);
            }
        }
    }
    GpuBackend::set_comp_row("auto");
    GpuBackend::set_attn_glue_old(true);
    for (i, case) in all.iter().enumerate() {
        run_compress(&cpu, &gpu, case, 100 + i as u64);
    }
    GpuBackend::set_attn_glue_old(false);
}

// ---------------------------------------------------------------------------------------------

/// Index rows for a state: random, with runs of duplicated rows (tied scores) and zero rows.
fn index_rows(r: &mut impl Rng, rows: usize, ihd: usize) -> Vec<f32> {
    let mut v = randn(r, rows * ihd, 1.0);
    for k in 1..rows {
        match k % 7 {
            1 | 2 => {
                let (a, b) = v.split_at_mut(k * ihd);
                b[..ihd].copy_from_slice(&a[(k - 1) * ihd..k * ihd]);
            }
            5 => v[k * ihd..(k + 1) * ihd].fill(0.0),
            _ => {}
        }
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn run_index(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    heads: usize,
    top_k: usize,
    fp4: bool,
    n: usize,
    t0: usize,
    seed: u64,
) {
    let mut r = rng(seed);
    let (ihd, ratio) = (128, 4);
    let c = CompDims {
        ratio,
        coff: 2,
        d: ihd,
    };
    let ld = LayerDims {
        window: 8,
        head_dim: 128,
        comp: None,
        index: Some(c),
        index_fp4: fp4, // the GPU's rows bf16 (exact: rounded below)
    };
    let rows = (t0 + n) / ratio;
    let mut h = HostLayerState::new(&ld);
    let mut rv = index_rows(&mut r, rows, ihd);
    if fp4 {
        // The compressor writes FP4-simulated, f16-rounded rows when the indexer is FP4 (the
        // same flag): index_scores_tc relies on it.
        let rr = RowRounding {
            fp8_nope: 0,
            fp4_hadamard: true,
            f16: true,
        };
        cpu.round_rows(&mut rv, rows, ihd, rr);
    }
    h.index.as_mut().unwrap().rows = rv;
    let cs = cpu.state_from_host(&ld, &h);
    let gs = gpu.state_from_host(&ld, &h);
    let spec = IndexSpec {
        heads,
        head_dim: ihd,
        top_k,
        ratio,
        n_rot: 64,
        rope: RopeKind::Comp,
        fp4,
    };
    let q = randn(&mut r, n * heads * ihd, 1.0);
    // Mixed-sign head weights, one token with all weights positive.
    let mut w = randn(&mut r, n * heads, 1.0);
    w[..heads].iter_mut().for_each(|v| *v = v.abs());
    let mut sc = vec![0i32; n * top_k];
    cpu.index_select(&cs, &spec, &q, &w, n, t0, &mut sc);
    let (qg, wg) = (gpu.upload(&q), gpu.upload(&w));
    let mut sg = gpu.alloc_i32(n * top_k);
    gpu.index_select(&gs, &spec, &qg, &wg, n, t0, &mut sg);
    let op = format!("index_select heads {heads} top_k {top_k} fp4 {fp4} n {n} t0 {t0}");
    let got = gpu.download_i32(&sg, n * top_k);
    gpu_ok(gpu, &op);
    for i in 0..n {
        assert_eq!(
            &got[i * top_k..(i + 1) * top_k],
            &sc[i * top_k..(i + 1) * top_k],
            "{op}: token {i} (t {}, visible {})",
            t0 + i,
            (t0 + i + 1) / ratio
        );
    }
    println!("{op}: selections equal");
}

#[test]
fn index_select_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    // Both indexer kernel forms (index_scores128_f32 by default, index_scores_f32 when simple).
    // Glue forms: new (default), old (DS4_GPU_ATTN_GLUE=old); index_scores128h/index_topk_ps
    // run only with the new one, index_scores_tc (prefill, 64 heads, fp4) only with the new one
    // and tensor cores on (the first form).
    // The fourth flag: the old top-k and query prep (DS4_GPU_TOPK=old). The fifth: prompt batches
    // on index_scores_wg (sm_90a; elsewhere index_scores_tc either way) or index_scores_tc. The
    // last: decode steps (1-4 tokens) of 16,384 or more rows (the 70k, 400k, 300k and 131k cases
    // below) on index_scores_d or index_scores_tc.
    for (simple, old, tc, tk_old, wg, dec) in [
        (false, false, true, false, true, true),
        (false, false, true, false, false, false),
        (false, false, false, false, true, true),
        (false, true, true, false, true, true),
        (true, false, true, false, true, true),
        (false, false, true, true, true, true),
    ] {
        GpuBackend::set_attn_simple(simple);
        GpuBackend::set_attn_glue_old(old);
        GpuBackend::set_index_tc(tc);
        GpuBackend::set_topk_old(tk_old);
        GpuBackend::set_index_wg(wg);
        GpuBackend::set_index_dec(dec);
        println!("simple {simple} old glue {old} tc {tc} old top-k {tk_old} wg {wg} dec {dec}");
        // Tiny: top_k 8, ratio 4: visible < 8, == 8 (t = 32..35), > 8; a chunk crossing all three.
        run_index(&cpu, &gpu, 4, 8, true, 1, 10, 1);
        run_index(&cpu, &gpu, 4, 8, true, 1, 31, 2);
        run_index(&cpu, &gpu, 4, 8, false, 1, 35, 3);
        run_index(&cpu, &gpu, 4, 8, true, 70, 0, 4);
        run_index(&cpu, &gpu, 16, 8, true, 40, 300, 5);
        run_index(&cpu, &gpu, 16, 8, false, 3, 5000, 6);
        // Real: 64 heads, top_k 512.
        run_index(&cpu, &gpu, 64, 512, true, 1, 2047, 7);
        run_index(&cpu, &gpu, 64, 512, true, 9, 2040, 8);
        run_index(&cpu, &gpu, 64, 512, true, 1, 40_000, 9);
        run_index(&cpu, &gpu, 64, 512, true, 4, 20_000, 10);
        // Prefill chunks (index_scores_tc): tokens crossing top_k rows, a ragged last token
        // group, several row tiles and CTAs of rows, rows past the last tile.
        run_index(&cpu, &gpu, 64, 512, true, 37, 2030, 13);
        run_index(&cpu, &gpu, 64, 512, true, 130, 9001, 14);
        // index_scores_wg: 17 row tiles and a ragged one, 3 token groups and a ragged last one
        // (a warpgroup of absent tokens); the case above crosses two CTAs of rows (2048 each).
        run_index(&cpu, &gpu, 64, 512, true, 15, 4400, 17);
        run_index(&cpu, &gpu, 64, 512, false, 9, 3000, 15);
        // Decode: one token just past top_k rows, 64 heads; odd head count.
        run_index(&cpu, &gpu, 64, 512, true, 1, 2600, 11);
        run_index(&cpu, &gpu, 7, 8, true, 1, 301, 12);
        // Decode past one top-k CTA's 16384 rows (two levels: index_topk_l1 + l2); with that
        // many rows decode's scores walk more than 64 rows a CTA (attn.rs ixt_rb_few: ~two CTAs
        // an SM), also at a 400k / 300k context (100k / 75k rows, ragged last CTAs).
        run_index(&cpu, &gpu, 64, 512, true, 1, 70_000, 16);
        run_index(&cpu, &gpu, 64, 512, true, 1, 400_000, 18);
        run_index(&cpu, &gpu, 64, 512, true, 2, 300_001, 19);
        // Verify steps of 3 and 4 tokens: rows of one tile, many tiles and CTAs (ragged last; the
        // second a token a CTA on index_scores_d), the tokens' visible counts apart.
        run_index(&cpu, &gpu, 64, 512, true, 3, 2046, 20);
        run_index(&cpu, &gpu, 64, 512, true, 4, 131_069, 21);
        // A prompt chunk past 16,384 rows (wgmma scores, a top-k a CTA a token).
        run_index(&cpu, &gpu, 64, 512, true, 70, 70_000, 22);
    }
    // The same chunk and a 3-batch one with session 36's forms, wgmma's CTAs row blocks first
    // and a top-k CTA a token for prompt batches (DS4_GPU_IXW_ORDER=rows, DS4_GPU_TK2_MAX=64):
    // the same selections.
    GpuBackend::set_ixw_tok_first(false);
    GpuBackend::set_topk2_max(64);
    println!("wgmma row blocks first, two-level top-k for batches of at most 64");
    run_index(&cpu, &gpu, 64, 512, true, 70, 70_000, 22);
    run_index(&cpu, &gpu, 64, 512, true, 130, 9001, 14);
    GpuBackend::set_ixw_tok_first(true);
    GpuBackend::set_topk2_max(0);
    GpuBackend::set_index_dec(true);
    GpuBackend::set_attn_simple(false);
    GpuBackend::set_attn_glue_old(false);
    GpuBackend::set_index_tc(true);
    GpuBackend::set_topk_old(false);
    GpuBackend::set_index_wg(true);
}

/// The CPU's selection (ds4-cpu backend.rs index_select): the top k of `scores` (the visible
/// ones) by total_cmp, ties to the lower index, ascending, −1 padded.
fn topk_ref(scores: &[f32], k: usize) -> Vec<i32> {
    let mut out = vec![-1i32; k];
    if scores.len() <= k {
        for (r, o) in out.iter_mut().take(scores.len()).enumerate() {
            *o = r as i32;
        }
        return out;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    for (o, r) in out.iter_mut().zip(order) {
        *o = r as i32;
    }
    out
}

/// Scores of one token: 0 Gaussian; 1 nine values (±0 among them: ties everywhere); 2 all
/// equal; 3 Gaussian with ±inf, NaNs, ±0, subnormals, and runs of a repeated large value;
/// finite only: 4 Gaussian with ±0, subnormals, runs of a value and a few of ±1e38; 5 one
/// exponent (10 + 0.01·Gaussian); 6 Gaussian in steps of 1/64 (equal keys at the threshold);
/// 7 as 4 with ±3e38 (the value range overflows). Kinds 4-7 were written for a value-bucket
/// first pass (index_topk_rv, da1150a, deleted) and stay as more shapes for the radix select.
fn topk_scores(r: &mut impl Rng, n: usize, kind: usize) -> Vec<f32> {
    match kind {
        0 => randn(r, n, 1.0),
        4 | 7 => {
            let big = if kind == 4 { 1e38 } else { 3e38 };
            let specials = [big, -big, 0.0, -0.0, 1e-40, -1e-40, 1e-45];
            let mut v = randn(r, n, 1.0);
            for x in v.iter_mut() {
                match r.gen_range(0..256) {
                    0..=3 => *x = specials[r.gen_range(0..specials.len())],
                    4..=9 => *x = 1.75,
                    _ => {}
                }
            }
            v
        }
        5 => randn(r, n, 0.01).into_iter().map(|x| 10.0 + x).collect(),
        6 => randn(r, n, 1.0)
            .into_iter()
            .map(|x| (x * 64.0).round() / 64.0)
            .collect(),
        1 => (0..n)
            .map(|_| [-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0][r.gen_range(0..9)])
            .collect(),
        2 => vec![0.25; n],
        _ => {
            let mut v = randn(r, n, 1.0);
            let specials = [
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
                0.0,
                -0.0,
                1e-40,
                -1e-40,
            ];
            for x in v.iter_mut() {
                match r.gen_range(0..64) {
                    0 => *x = specials[r.gen_range(0..specials.len())],
                    1..=3 => *x = 2.5,
                    _ => {}
                }
            }
            v
        }
    }
}

/// index_topk_rows on `n` tokens from position `t0` (ratio 4, rows of `stride`) against
/// topk_ref, every score kind; scores past a token's visible count are +inf (selected if read).
fn run_topk(gpu: &GpuBackend, stride: usize, n: usize, t0: usize, k: usize, seed: u64) {
    let ratio = 4;
    let mut r = rng(seed);
    for kind in 0..8 {
        let mut s = vec![f32::INFINITY; n * stride];
        let mut want = Vec::with_capacity(n * k);
        for i in 0..n {
            let vis = (t0 + i + 1) / ratio;
            let row = topk_scores(&mut r, vis, kind);
            s[i * stride..i * stride + vis].copy_from_slice(&row);
            want.extend(topk_ref(&row, k));
        }
        let sg = gpu.upload(&s);
        let mut sel = gpu.alloc_i32(n * k);
        gpu.index_topk_rows(&sg, stride, n, t0, ratio, k, &mut sel);
        let op = format!("index_topk stride {stride} n {n} t0 {t0} k {k} kind {kind}");
        let got = gpu.download_i32(&sel, n * k);
        gpu_ok(gpu, &op);
        for i in 0..n {
            assert_eq!(
                &got[i * k..(i + 1) * k],
                &want[i * k..(i + 1) * k],
                "{op}: token {i} (visible {})",
                (t0 + i + 1) / ratio
            );
        }
    }
    println!("index_topk stride {stride} n {n} t0 {t0} k {k}: selections equal");
}

#[test]
fn index_topk_matches_cpu() {
    let Some((_cpu, gpu)) = setup() else { return };
    const N: usize = 16384; // one top-k CTA's rows (index_topk_r; DS4_TK_N)
                            // One token seeing v rows: position 4v − 1.
    let at = |v: usize| 4 * v - 1;
    // The old kernel, and the new ones with level-1 chunks of 16384 (the default), 4096, 2048;
    // the last set: two levels only for batches of at most 64 (DS4_GPU_TK2_MAX=64), not any.
    for (old, chunk, tk2) in [
        (false, 0, 0),
        (false, 4096, 0),
        (false, 2048, 0),
        (true, 0, 0),
        (false, 0, 64),
    ] {
        GpuBackend::set_topk_old(old);
        GpuBackend::set_topk_chunk(chunk);
        GpuBackend::set_topk2_max(tk2);
        println!("old {old}, level-1 chunk {chunk} (0: 16384), two levels up to {tk2} (0: any)");
        let mut seed = 100;
        let mut case = |stride: usize, n: usize, t0: usize, k: usize| {
            seed += 1;
            run_topk(&gpu, stride, n, t0, k, seed);
        };
        // One CTA (index_topk_r): around top_k, 4 to 16 keys a thread, 8k (32k context), the
        // CTA's capacity; rows of the visible count and of a larger capacity (decode).
        for v in [
            511,
            512,
            513,
            1000,
            4100,
            8191,
            8192,
            8193,
            12_289,
            N - 1,
            N,
        ] {
            case(v, 1, at(v), 512);
            case(N, 1, at(v), 512);
        }
        // Two levels (index_topk_l1 + l2): just past one CTA, a partial last chunk below,
        // at and above top_k, whole chunks, 128k and 256k candidates (1M context).
        for v in [
            N + 1,
            N + 511,
            N + 512,
            N + 513,
            3 * N,
            100_000,
            131_072,
            262_144,
        ] {
            case(v, 1, at(v), 512);
            case(262_144, 1, at(v), 512);
        }
        // Several tokens: visible counts crossing top_k; crossing one CTA's rows (two levels).
        case(N, 12, 4 * 510, 512);
        case(4 * N, 9, 4 * N - 3, 512);
        // Prompt-size batches (more than 64 tokens: a CTA a token in the last set): visible
        // counts crossing one CTA's rows; 66 tokens at 100k candidates (7 chunks each).
        case(4 * N, 100, 4 * N - 200, 512);
        case(131_072, 66, at(100_000), 512);
        // Small top-k (deep ties), and the largest top-k whose survivors fill one CTA
        // (4 chunks × 4096), and one past it (the old kernel).
        case(2 * N, 3, at(20_000), 8);
        case(9, 1, at(9), 8);
        case(8, 1, at(8), 8);
        case(4 * N, 1, at(4 * N), 4096);
        case(4 * N, 1, at(4 * N - 1000), 4096);
        case(2 * N, 1, at(30_000), 8193);
    }
    GpuBackend::set_topk_old(false);
    GpuBackend::set_topk_chunk(0);
    GpuBackend::set_topk2_max(0);
}

/// The indexer query's prep in one launch (index_qprep_f32) has the bits of the copy, rope_f32
/// and round_fp4h128_f32 (DS4_GPU_TOPK=old).
#[test]
fn index_query_prep_is_exact() {
    let Some((_cpu, gpu)) = setup() else { return };
    let mut r = rng(77);
    for &(n, heads, n_rot, t0) in &[
        (1usize, 64usize, 64usize, 32_767usize),
        (3, 64, 64, 1_000_000),
        (5, 7, 128, 0),
        (2, 16, 0, 123),
        (1, 64, 2, 40_000),
        // Several tokens a CTA (8 rows): 8, 2 or 3 positions in one shared (cos, sin) table.
        (19, 1, 128, 999_990),
        (11, 3, 64, 65_530),
        (1, 64, 64, 4_000_000_000),
    ] {
        let spec = IndexSpec {
            heads,
            head_dim: 128,
            top_k: 512,
            ratio: 4,
            n_rot,
            rope: RopeKind::Comp,
            fp4: true,
        };
        let len = n * heads * 128;
        let mut q = randn(&mut r, len, 1.0);
        // Zero rows and a huge value: the FP4 scale's edges.
        q[..128].fill(0.0);
        q[len - 1] = 3e30;
        let qg = gpu.upload(&q);
        let mut outs = Vec::new();
        // The default (index_qprep_f32), then the old three ops.
        for tk_old in [false, true] {
            GpuBackend::set_topk_old(tk_old);
            let mut o = gpu.upload(&vec![f32::NAN; len]);
            gpu.index_query_prep(&qg, n, &spec, t0, &mut o);
            outs.push(gpu.download(&o, len));
        }
        let op = format!("index query prep n {n} heads {heads} n_rot {n_rot} t0 {t0}");
        gpu_ok(&gpu, &op);
        assert_bits(&op, &outs[0], &outs[1]);
        println!("{op}: bits equal");
    }
    GpuBackend::set_topk_old(false);
}

// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct AttCase {
    heads: usize,
    hd: usize,
    win: usize,
    ratio: usize,
    top_k: usize,
    with_sel: bool,
    n: usize,
    t0: usize,
    holes: bool,
}

/// A GPU attention form: tensor cores (hi/lo split or one f16 product) for prefill, the f32
/// kernels by their `DS4_GPU_ATTN` name (`one`: one launch at decode, `split`, `simple`), and
/// its tolerance against the CPU.
#[derive(Clone, Copy)]
struct Form {
    name: &'static str,
    tc: bool,
    fast: bool,
    /// `fast` with head width 512 (`DS4_GPU_ATTN_TCG`): one CTA per token (`on`,
    /// `attn_tc512g_f32`; `r64` with 64-row tiles; `pipe` pipelined) or per 16 heads (`off`).
    tcg: &'static str,
    /// `tcg` `on` on sm_90a: the wgmma kernel (`attn_wg512_f32`, `DS4_GPU_ATTN_WG=on`) or
    /// mma.sync (`attn_tc512g_f32`, the default).
    wg: bool,
    attn: &'static str,
    tol: f32,
}

const TC: Form = Form {
    name: "tc",
    tc: true,
    fast: false,
    tcg: "on",
    wg: true,
    attn: "one",
    tol: 2e-5,
};
const TC_FAST: Form = Form {
    name: "tc-fast",
    tc: true,
    fast: true,
    tcg: "on",
    wg: true,
    attn: "one",
    tol: 3e-3,
};
/// `TC_FAST` with 16 heads a CTA (`attn_tc512h_f32`, `DS4_GPU_ATTN_TCG=off`).
const TC_FAST16: Form = Form {
    name: "tc-fast16",
    tcg: "off",
    ..TC_FAST
};
/// `TC_FAST` on mma.sync where `TC_FAST` takes wgmma (`attn_tc512g_f32` on sm_90a, the
/// engine's default; elsewhere the same kernel as `TC_FAST`).
const TC_FAST_MMA: Form = Form {
    name: "tc-fast-mma",
    wg: false,
    ..TC_FAST
};
/// `TC_FAST` with 64-row tiles (`attn_tc512g64_f32`, `DS4_GPU_ATTN_TCG=r64`).
const TC_FAST64: Form = Form {
    name: "tc-fast64",
    tcg: "r64",
    ..TC_FAST
};
/// `TC_FAST` pipelined (`attn_tc512gp_f32`, `DS4_GPU_ATTN_TCG=pipe`).
const TC_FASTP: Form = Form {
    name: "tc-fastp",
    tcg: "pipe",
    ..TC_FAST
};
const ONE: Form = Form {
    name: "one",
    tc: false,
    fast: false,
    tcg: "on",
    wg: true,
    attn: "one",
    tol: 2e-5,
};
/// `ONE` (the default `DS4_GPU_AOTC=v5`) in the tensor-core form's other forms (`v0`: session
/// 17's kernel; `v1`: the queries' split after the first row pointers): the same bits as `ONE`.
const ONE_V0: Form = Form {
    name: "one-v0",
    attn: "one-v0",
    ..ONE
};
const ONE_V1: Form = Form {
    name: "one-v1",
    attn: "one-v1",
    ..ONE
};
/// The one-launch decode form with its f32 tile loop everywhere (`ONE` takes the tile loop on
/// tensor cores, `attend_one_tc`, for head width 512 on CUDA sm_80+).
const ONE_F32: Form = Form {
    name: "one-f32",
    tc: false,
    fast: false,
    tcg: "on",
    wg: true,
    attn: "one-f32",
    tol: 2e-5,
};
const SPLIT: Form = Form {
    name: "split",
    tc: false,
    fast: false,
    tcg: "on",
    wg: true,
    attn: "split",
    tol: 2e-5,
};
const SIMPLE: Form = Form {
    name: "simple",
    tc: false,
    fast: false,
    tcg: "on",
    wg: true,
    attn: "simple",
    tol: 2e-5,
};

fn set_form(f: Form) {
    GpuBackend::set_attn_tc(f.tc, f.fast);
    // The tensor-core forms also take decode steps of 2-4 tokens (opt-in; the default runs
    // them on the one-launch decode kernel, the `one` forms here).
    GpuBackend::set_attn_step_tc(f.tc);
    GpuBackend::set_attn_tcg(f.tcg);
    GpuBackend::set_attn_wg(f.wg);
    // "one-vN": the one-launch form with `DS4_GPU_AOTC=vN`.
    let (attn, aotc) = match f.attn.strip_prefix("one-v") {
        Some(v) => ("one", format!("v{v}")),
        None => (f.attn, "v5".to_string()),
    };
    GpuBackend::set_attn_form(attn);
    GpuBackend::set_aotc_form(&aotc);
}

/// f16-rounded values as the KV cache stores them (the model's default rounding).
fn f16_vals(v: &mut [f32]) {
    for x in v {
        *x = half::f16::from_f32(*x).to_f32();
    }
}

/// One case: the CPU reference once, then every form on a fresh GPU state (output, ring and
/// ring positions compared). `f16_rows`: raw, compressed and new rows f16-rounded (tensor-core
/// forms read rows as f16, exact then). Returns the outputs of the forms.
fn run_attend(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    a: &AttCase,
    seed: u64,
    f16_rows: bool,
    forms: &[Form],
) -> Vec<Vec<f32>> {
    let mut r = rng(seed);
    let (nh, hd, win) = (a.heads, a.hd, a.win);
    let comp = (a.ratio > 0).then_some(CompDims {
        ratio: a.ratio,
        coff: 1,
        d: hd,
    });
    let ld = LayerDims {
        window: win,
        head_dim: hd,
        comp,
        index: None,
        index_fp4: false,
    };
    let mut h = HostLayerState::new(&ld);
    // Ring before t0: the last W positions, some slots empty or stale (MTP-style holes).
    h.raw = randn(&mut r, win * hd, 1.0);
    for s in 0..win {
        let p = (0..a.t0).rev().find(|p| p % win == s);
        h.raw_pos[s] = match p {
            Some(p) if a.holes && r.gen_bool(0.25) => {
                if r.gen_bool(0.5) || p < win {
                    -1
                } else {
                    (p - win) as i64
                }
            }
            Some(p) => p as i64,
            None => -1,
        };
    }
    let n_rows = (a.t0 + a.n).checked_div(a.ratio).unwrap_or(0);
    if let Some(c) = h.comp.as_mut() {
        c.rows = randn(&mut r, n_rows * hd, 1.0);
    }
    let spec = AttnSpec {
        n_head: nh,
        head_dim: hd,
        n_rot: 64,
        window: win,
        ratio: a.ratio,
        top_k: if a.with_sel { a.top_k } else { 0 },
        rope: RopeKind::Comp,
    };
    let q = randn(&mut r, a.n * nh * hd, 0.3);
    let mut kv = randn(&mut r, a.n * hd, 1.0);
    if f16_rows {
        f16_vals(&mut h.raw);
        f16_vals(&mut kv);
        if let Some(c) = h.comp.as_mut() {
            f16_vals(&mut c.rows);
        }
    }
    let mut cs = cpu.state_from_host(&ld, &h);
    let sinks_v = randn(&mut r, nh, 2.0);
    let (sk_c, sk_g) = vectors(cpu, gpu, &sinks_v);
    let sel: Option<Vec<i32>> = a.with_sel.then(|| {
        let mut s = vec![-1i32; a.n * a.top_k];
        for i in 0..a.n {
            let vis = (a.t0 + i + 1) / a.ratio;
            let mut rows: Vec<i32> = (0..vis as i32).collect();
            rows.shuffle(&mut r);
            rows.truncate(a.top_k);
            if i % 2 == 0 {
                rows.sort_unstable();
            }
            for (k, v) in rows.into_iter().enumerate() {
                // Leave some holes (−1) inside the row as well.
                s[i * a.top_k + k] = if k % 5 == 3 { -1 } else { v };
            }
        }
        s
    });
    let mut oc = vec![0f32; a.n * nh * hd];
    cpu.attend(
        &mut cs,
        &spec,
        &q,
        &kv,
        &sk_c,
        sel.as_ref(),
        a.n,
        a.t0,
        &mut oc,
    );
    let cs = cpu.state_to_host(&cs);
    let (qg, kvg) = (gpu.upload(&q), gpu.upload(&kv));
    let selg = sel.as_ref().map(|s| gpu.upload_i32(s));
    let mut outs = Vec::new();
    for &f in forms {
        set_form(f);
        let mut gs = gpu.state_from_host(&ld, &h);
        let mut og = gpu.alloc(a.n * nh * hd);
        gpu.attend(
            &mut gs,
            &spec,
            &qg,
            &kvg,
            &sk_g,
            selg.as_ref(),
            a.n,
            a.t0,
            &mut og,
        );
        let op = format!(
            "attend {} heads {nh} hd {hd} W {win} ratio {} sel {} n {} t0 {} holes {} f16 {f16_rows}",
            f.name, a.ratio, a.with_sel, a.n, a.t0, a.holes
        );
        let got = gpu.download(&og, a.n * nh * hd);
        let hs = gpu.state_to_host(&gs);
        gpu_ok(gpu, &op);
        assert_close(&op, &got, &oc, f.tol);
        assert_bits(&format!("{op} ring"), &hs.raw, &cs.raw);
        assert_eq!(hs.raw_pos, cs.raw_pos, "{op}: raw_pos");
        outs.push(got);
    }
    set_form(TC);
    GpuBackend::set_attn_step_tc(false); // the default
    outs
}

#[test]
fn attend_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    let tiny = |ratio, with_sel, n, t0, holes| AttCase {
        heads: 4,
        hd: 64,
        win: 16,
        ratio,
        top_k: 8,
        with_sel,
        n,
        t0,
        holes,
    };
    let real = |ratio, with_sel, n, t0, holes| AttCase {
        heads: 64,
        hd: 512,
        win: 128,
        ratio,
        top_k: 512,
        with_sel,
        n,
        t0,
        holes,
    };
    let cases = [
        tiny(0, false, 1, 0, false),
        tiny(0, false, 1, 37, true),
        tiny(4, false, 1, 37, true),
        tiny(4, true, 1, 100, true),
        tiny(4, true, 70, 100, true),
        tiny(4, false, 70, 3, false),
        tiny(8, false, 40, 50, true),
        tiny(0, false, 70, 20, true),
        real(4, true, 1, 5000, false),
        real(4, true, 1, 5000, true),
        real(128, false, 1, 70_000, false),
        real(0, false, 1, 300, true),
        real(4, true, 70, 3000, true),
        real(128, false, 200, 1000, false),
        // Decode chunks of a few tokens (one launch): early positions, every layer kind, a head
        // count that is not a multiple of 16, many splits.
        real(0, false, 2, 10, false),
        real(4, true, 3, 5000, true),
        real(128, false, 8, 2000, true),
        real(128, false, 1, 400_000, false),
        tiny(4, false, 5, 37, true),
        tiny(8, false, 8, 0, false),
        AttCase {
            heads: 40,
            ..real(4, true, 2, 2100, true)
        },
    ];
    // Every form on every case; the switches are process-wide and only this test attends.
    // ONE_V0 and ONE_V1 must give ONE's bits (forms 2..=4 of the list; 0..=2 of forms[2..]).
    let forms = [TC, TC_FAST, ONE, ONE_V0, ONE_V1, ONE_F32, SPLIT, SIMPLE];
    let same = |outs: &[Vec<f32>], at: usize, c: &AttCase| {
        for k in 1..=2 {
            let d = bit_diffs(&outs[at], &outs[at + k]);
            assert_eq!(
                d,
                0,
                "{}: {d} output values differ from one's ({c:?})",
                forms[2 + k].name
            );
        }
    };
    for (i, c) in cases.iter().enumerate() {
        let outs = run_attend(&cpu, &gpu, c, 300 + i as u64, false, &forms[2..]);
        same(&outs, 0, c);
        let outs = run_attend(&cpu, &gpu, c, 300 + i as u64, true, &forms);
        same(&outs, 2, c);
    }
}

/// Prefill chunks (n = 1..300, odd sizes) of every layer kind: window only, ratio 4 with
/// selected rows, ratio 128 (and ratio 4 / 8 without a selection); the tensor-core forms
/// against the f32 kernels and the CPU. Rows f16-rounded as the model stores them, plus a few
/// unrounded cases where the tensor-core form reads rows rounded to f16 (looser tolerance).
#[test]
fn attend_prefill_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    let case = |heads, hd, win, ratio, with_sel, n, t0, holes| AttCase {
        heads,
        hd,
        win,
        ratio,
        top_k: if hd == 512 { 512 } else { 8 },
        with_sel,
        n,
        t0,
        holes,
    };
    let cases = [
        case(64, 512, 128, 0, false, 2, 0, false),
        case(64, 512, 128, 0, false, 300, 7, true),
        case(64, 512, 128, 0, false, 129, 5000, false),
        case(64, 512, 128, 4, true, 3, 0, false),
        case(64, 512, 128, 4, true, 257, 1000, true),
        case(64, 512, 128, 4, true, 300, 4093, false),
        case(64, 512, 128, 4, false, 65, 200, true),
        case(64, 512, 128, 128, false, 255, 127, true),
        case(64, 512, 128, 128, false, 33, 9000, false),
        case(64, 512, 128, 128, false, 300, 0, false),
        case(40, 512, 128, 4, true, 17, 2100, true),
        case(4, 64, 16, 0, false, 300, 5, true),
        case(4, 64, 16, 4, true, 129, 100, true),
        case(20, 64, 16, 8, false, 31, 50, false),
    ];
    let wg0 = GpuBackend::attn_wg_launches();
    for (i, c) in cases.iter().enumerate() {
        let outs = run_attend(
            &cpu,
            &gpu,
            c,
            900 + i as u64,
            true,
            &[
                TC,
                TC_FAST,
                SPLIT,
                TC_FAST16,
                TC_FAST64,
                TC_FASTP,
                TC_FAST_MMA,
            ],
        );
        // The tensor-core form next to the split f32 kernels.
        assert_close(
            &format!("attend case {i}: tc vs split"),
            &outs[0],
            &outs[2],
            2e-5,
        );
        // A decode step (n <= 4: a speculative pair, a short append) takes the hi/lo form under
        // `fast` too: every fast form gives TC's bits there.
        if c.n <= 4 {
            for k in [1, 3, 4, 5, 6] {
                let d = bit_diffs(&outs[k], &outs[0]);
                assert_eq!(
                    d, 0,
                    "attend case {i} (n {}): fast form {k} differs from tc in {d} values",
                    c.n
                );
            }
        }
    }
    // TC_FAST takes the wgmma kernel on sm_90a in each head-width-512 prompt case (n > 4;
    // TC_FAST_MMA never).
    let wg_runs = GpuBackend::attn_wg_launches() - wg0;
    let want = if gpu.gpu().info().cc == (9, 0) {
        cases.iter().filter(|c| c.hd == 512 && c.n > 4).count() as u64
    } else {
        0
    };
    println!("attn_wg512_f32 launches: {wg_runs} (want {want})");
    assert_eq!(wg_runs, want, "wgmma attention launches");
    let loose = Form { tol: 1e-3, ..TC };
    for (i, c) in cases.iter().enumerate().step_by(3) {
        run_attend(&cpu, &gpu, c, 950 + i as u64, false, &[loose]);
    }
}

// ---------------------------------------------------------------------------------------------

/// How many values of `a` and `b` differ in their bits.
fn bit_diffs(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// A layer's state before a chunk of `n` tokens at `t0`: a full ring of random rows holding the
/// last `win` positions before `t0` (empty slots -1), and with `ratio > 0` random compressed
/// rows for every position up to `t0 + n` (raw rows drawn first, then compressed).
fn ring_layer(
    r: &mut impl Rng,
    win: usize,
    hd: usize,
    ratio: usize,
    n: usize,
    t0: usize,
) -> (LayerDims, HostLayerState) {
    let ld = LayerDims {
        window: win,
        head_dim: hd,
        comp: (ratio > 0).then_some(CompDims {
            ratio,
            coff: 1,
            d: hd,
        }),
        index: None,
        index_fp4: false,
    };
    let mut h = HostLayerState::new(&ld);
    h.raw = randn(r, win * hd, 1.0);
    for s in 0..win {
        h.raw_pos[s] = (0..t0)
            .rev()
            .find(|p| p % win == s)
            .map_or(-1, |p| p as i64);
    }
    let n_rows = (t0 + n).checked_div(ratio).unwrap_or(0);
    if let Some(c) = h.comp.as_mut() {
        c.rows = randn(r, n_rows * hd, 1.0);
    }
    (ld, h)
}

/// Wall time per call of `f` (after a warm-up call), device synchronised around the loop.
fn time_us(gpu: &GpuBackend, iters: u32, mut f: impl FnMut()) -> f64 {
    f();
    gpu.gpu().synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..iters {
        f();
    }
    gpu.gpu().synchronize().unwrap();
    t.elapsed().as_secs_f64() * 1e6 / iters as f64
}

/// Timing of attend (split and simple kernels) and index_select at the real shapes; not a check.
/// `cargo test --release -p ds4-gpu --test ops_attn -- --ignored --nocapture --test-threads=1`
#[test]
#[ignore]
fn attend_bench() {
    let Some((_cpu, gpu)) = setup() else { return };
    let mut r = rng(7);
    let (nh, hd, win, top_k) = (64usize, 512usize, 128usize, 512usize);
    // (ratio, with_sel, n, t0)
    let cases = [
        (4usize, true, 1usize, 2048usize),
        (4, true, 1, 32_768),
        (128, false, 1, 2048),
        (128, false, 1, 32_768),
        (128, false, 1, 1_000_000),
        (4, true, 128, 2048),
        (128, false, 128, 32_768),
        // Prefill chunks (the bench's 2k and 8k prompts): ratio 4, ratio 128, window only.
        (4, true, 2048, 0),
        (128, false, 2048, 0),
        (0, false, 2048, 0),
        (4, true, 2048, 6144),
        (128, false, 2048, 6144),
    ];
    // DS4_ATTN_BENCH=tc: the prefill chunks only, the tensor-core forms, fast forms A B C D A B C D.
    let tc_only = std::env::var("DS4_ATTN_BENCH").is_ok_and(|v| v == "tc");
    for &(ratio, with_sel, n, t0) in &cases {
        let (ld, h) = ring_layer(&mut r, win, hd, ratio, n, t0);
        let mut gs = gpu.state_from_host(&ld, &h);
        let spec = AttnSpec {
            n_head: nh,
            head_dim: hd,
            n_rot: 64,
            window: win,
            ratio,
            top_k: if with_sel { top_k } else { 0 },
            rope: RopeKind::Comp,
        };
        let qg = gpu.upload(&randn(&mut r, n * nh * hd, 0.3));
        let kvg = gpu.upload(&randn(&mut r, n * hd, 1.0));
        let sinks_v = randn(&mut r, nh, 2.0);
        let f = file(&[("v", GgmlType::F32, vec![nh as u64], f32_bytes(&sinks_v))]);
        let sk = gpu.vector(&src(&f, "v")).unwrap();
        // As the indexer selects: a token seeing fewer compressed rows than top-k gets them all
        // (in a random order) and −1 in the other slots (a 2k prompt's early tokens).
        let selg = with_sel.then(|| {
            let mut s = vec![-1i32; n * top_k];
            for i in 0..n {
                let vis = (t0 + i + 1) / ratio;
                for k in 0..top_k.min(vis) {
                    s[i * top_k + k] = r.gen_range(0..vis) as i32;
                }
            }
            gpu.upload_i32(&s)
        });
        let mut og = gpu.alloc(n * nh * hd);
        let iters = if n >= 1024 { 5 } else { 20 };
        if tc_only && n < 1024 {
            continue;
        }
        let forms: &[Form] = if tc_only {
            &[
                TC_FAST16, TC_FAST, TC_FAST64, TC_FAST16, TC_FAST, TC_FAST64, TC,
            ]
        } else {
            &[TC, TC_FAST, TC_FAST16, ONE, SPLIT, SIMPLE]
        };
        for &f in forms {
            if f.tc && n == 1 {
                continue; // decode keeps the f32 kernels
            }
            set_form(f);
            let us = time_us(&gpu, iters, || {
                gpu.attend(
                    &mut gs,
                    &spec,
                    &qg,
                    &kvg,
                    &sk,
                    selg.as_ref(),
                    n,
                    t0,
                    &mut og,
                )
            });
            gpu_ok(&gpu, "attend bench");
            println!(
                "attend {:9} ratio {ratio} sel {with_sel} n {n} t0 {t0}: {us:.1} µs",
                f.name
            );
        }
    }
    set_form(TC);
    GpuBackend::set_attn_step_tc(false); // the default
    if tc_only {
        return;
    }
    // Indexer: 64 heads × 128, top-k 512, ratio 4.
    for &(n, t0) in &[(1usize, 32_768usize), (1, 1_000_000), (128, 32_768)] {
        let (ih, ihd, ratio) = (64usize, 128usize, 4usize);
        let c = CompDims {
            ratio,
            coff: 2,
            d: ihd,
        };
        let ld = LayerDims {
            window: 8,
            head_dim: 128,
            comp: None,
            index: Some(c),
            index_fp4: true, // bf16 rows (random values, rounded on upload: a timing only)
        };
        let mut h = HostLayerState::new(&ld);
        h.index.as_mut().unwrap().rows = randn(&mut r, (t0 + n) / ratio * ihd, 1.0);
        let gs = gpu.state_from_host(&ld, &h);
        let spec = IndexSpec {
            heads: ih,
            head_dim: ihd,
            top_k: 512,
            ratio,
            n_rot: 64,
            rope: RopeKind::Comp,
            fp4: true,
        };
        let qg = gpu.upload(&randn(&mut r, n * ih * ihd, 1.0));
        let wg = gpu.upload(&randn(&mut r, n * ih, 1.0));
        let mut sg = gpu.alloc_i32(n * 512);
        for simple in [false, true] {
            GpuBackend::set_attn_simple(simple);
            let us = time_us(&gpu, 10, || {
                gpu.index_select(&gs, &spec, &qg, &wg, n, t0, &mut sg)
            });
            gpu_ok(&gpu, "index bench");
            println!(
                "index_select {} n {n} t0 {t0}: {us:.1} µs",
                if simple { "simple" } else { "fast  " }
            );
        }
    }
    GpuBackend::set_attn_simple(false);
}

/// A prompt-attention case of head width 512 (window 128, 64 rotated columns, top-k 512 where
/// selected): its ring layer with f16 rows, raw queries at the scale of q_b's outputs (the norm
/// matters), f16 KV rows, sinks, and selections (slot k of a token absent past its visible rows
/// and where k % m == r for `absent` = (m, r)).
struct RawCase {
    ld: LayerDims,
    h: HostLayerState,
    spec: AttnSpec,
    q: Vec<f32>,
    kv: Vec<f32>,
    sinks: Vec<f32>,
    sel: Option<Vec<i32>>,
}

fn raw_case(
    seed: u64,
    nh: usize,
    ratio: usize,
    with_sel: bool,
    n: usize,
    t0: usize,
    absent: (i32, i32),
) -> RawCase {
    let (hd, win, top_k) = (512usize, 128usize, 512usize);
    let mut r = rng(seed);
    let (ld, mut h) = ring_layer(&mut r, win, hd, ratio, n, t0);
    f16_vals(&mut h.raw);
    if let Some(c) = h.comp.as_mut() {
        f16_vals(&mut c.rows);
    }
    let spec = AttnSpec {
        n_head: nh,
        head_dim: hd,
        n_rot: 64,
        window: win,
        ratio,
        top_k: if with_sel { top_k } else { 0 },
        rope: RopeKind::Comp,
    };
    let q = randn(&mut r, n * nh * hd, 3.0);
    let mut kv = randn(&mut r, n * hd, 1.0);
    f16_vals(&mut kv);
    let sinks = randn(&mut r, nh, 2.0);
    let (m, rm) = absent;
    let sel = with_sel.then(|| {
        (0..n)
            .flat_map(|i| {
                let vis = ((t0 + i + 1) / ratio) as i32;
                (0..top_k as i32).map(move |k| {
                    if k < vis && k % m != rm {
                        vis - 1 - k
                    } else {
                        -1
                    }
                })
            })
            .collect()
    });
    RawCase {
        ld,
        h,
        spec,
        q,
        kv,
        sinks,
        sel,
    }
}

/// `attend_qnorm` of raw queries (`attn_tc512gn_f32`: each head RMS-normed and rotated as the
/// prefill attention loads it) against the separate norm_rope + attend on the GPU, in bits
/// (output and ring), with the fused kernel on and off; against the CPU's default (a normed
/// copy, then attend) at the fast form's tolerance; the raw queries are left as given.
#[test]
fn attend_qnorm_matches_norm_then_attend() {
    let Some((cpu, gpu)) = setup() else { return };
    set_form(TC_FAST);
    let eps = 1e-6f32;
    let cases = [
        (64usize, 4usize, true, 70usize, 3000usize),
        (64, 128, false, 200, 1000),
        (64, 0, false, 37, 300),
        (40, 4, true, 9, 2100), // heads not a multiple of 32: absent heads in the fragments
    ];
    let mut bad = Vec::new();
    // Both sm_90a kernels (wgmma: attn_wg512[n]_f32, mma.sync: attn_tc512g[n]_f32; elsewhere
    // the mma.sync pass repeats), with the chunk's RoPE table (atc_rope_tab) and without it.
    for ((wg, rtab), (ci, &(nh, ratio, with_sel, n, t0))) in
        [(true, true), (false, true), (false, false)]
            .into_iter()
            .flat_map(|f| cases.iter().enumerate().map(move |c| (f, c)))
    {
        GpuBackend::set_attn_wg(wg);
        GpuBackend::set_attn_rtab(rtab);
        let RawCase {
            ld,
            h,
            spec,
            q,
            kv,
            sinks,
            sel,
        } = raw_case(900 + ci as u64, nh, ratio, with_sel, n, t0, (7, 3));
        let hd = spec.head_dim;
        let (sk_c, sk_g) = vectors(&cpu, &gpu, &sinks);
        let op =
            format!("attend_qnorm wg {wg} rtab {rtab} heads {nh} ratio {ratio} sel {with_sel} n {n} t0 {t0}");
        GpuBackend::set_attn_qnorm(true); // the previous case ended with it off
        assert!(
            gpu.attend_norms_q(&spec, n),
            "{op}: the GPU should take the fused form"
        );
        assert!(!gpu.attend_norms_q(&spec, 4), "{op}: not at a decode step");
        // CPU: the trait's default.
        let mut cs = cpu.state_from_host(&ld, &h);
        let mut oc = vec![0f32; n * nh * hd];
        cpu.attend_qnorm(
            &mut cs,
            &spec,
            &q,
            eps,
            &kv,
            &sk_c,
            sel.as_ref(),
            n,
            t0,
            &mut oc,
        );
        let (qg, kvg) = (gpu.upload(&q), gpu.upload(&kv));
        let selg = sel.as_ref().map(|s| gpu.upload_i32(s));
        // GPU reference: norm_rope of a copy, then attend.
        let mut qn = gpu.upload(&q);
        gpu.norm_rope(&mut qn, n, nh, hd, None, eps, 64, t0, RopeKind::Comp, None);
        let mut gs = gpu.state_from_host(&ld, &h);
        let mut og = gpu.alloc(n * nh * hd);
        gpu.attend(
            &mut gs,
            &spec,
            &qn,
            &kvg,
            &sk_g,
            selg.as_ref(),
            n,
            t0,
            &mut og,
        );
        let want = gpu.download(&og, n * nh * hd);
        let want_ring = gpu.state_to_host(&gs).raw;
        for on in [true, false] {
            GpuBackend::set_attn_qnorm(on);
            let l0 = GpuBackend::attn_qnorm_launches();
            let mut gs = gpu.state_from_host(&ld, &h);
            let mut og = gpu.alloc(n * nh * hd);
            gpu.attend_qnorm(
                &mut gs,
                &spec,
                &qg,
                eps,
                &kvg,
                &sk_g,
                selg.as_ref(),
                n,
                t0,
                &mut og,
            );
            let got = gpu.download(&og, n * nh * hd);
            let ring = gpu.state_to_host(&gs).raw;
            gpu_ok(&gpu, &op);
            let ran = GpuBackend::attn_qnorm_launches() - l0;
            let diff = bit_diffs(&got, &want);
            let rel = got
                .iter()
                .zip(&oc)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
                / oc.iter().map(|v| v.abs()).fold(1e-30f32, f32::max);
            println!("{op} fused {on}: ran {ran}, {diff} of {} values differ in bits from norm_rope + attend, max |d| / max |cpu| {rel:.3e}", got.len());
            if ran != u64::from(on) || diff != 0 || ring != want_ring || rel.is_nan() || rel >= 3e-3
            {
                bad.push(format!(
                    "{op} fused {on}: ran {ran}, {diff} differ, ring same {}, rel {rel:.3e}",
                    ring == want_ring
                ));
            }
        }
        let q_after = gpu.download(&qg, n * nh * hd);
        if q_after
            .iter()
            .zip(&q)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            bad.push(format!("{op}: the raw queries changed"));
        }
    }
    GpuBackend::set_attn_qnorm(true);
    GpuBackend::set_attn_rtab(true);
    set_form(TC);
    GpuBackend::set_attn_step_tc(false); // the default
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// `attend_project` (the attention and its grouped output projection as one op): under the
/// `fast` forms (one-f16 attention, one-term bf16 BLAS product) the one-CTA-a-token kernel
/// writes the product's bf16 X' itself (`attn_tc512g[n]_bf`), and the product's output and the
/// ring are those of f32 o converted by the product (attend, then matmul_grouped), bit for bit;
/// with the exact forms (the three-term product) and with the switch off it takes the two ops;
/// its fallback (as if the library declined the product: the output widened to f32) gives the
/// same bits too.
/// Raw and normed queries, top-k and plain compressed rows, 64 and 40 heads (5 groups of 4096).
#[test]
fn attend_project_bf16_same_bits() {
    let Some((cpu, gpu)) = setup() else { return };
    let lib = gpu.blas_available();
    if !lib {
        println!("the BLAS-Lt library did not load: only the two-op path is checked");
    }
    let eps = 1e-6f32;
    let cases = [
        (64usize, 4usize, true, 70usize, 3000usize, true),
        (64, 128, false, 200, 1000, false),
        (40, 4, true, 9, 2100, true),
        (64, 0, false, 37, 300, false),
    ];
    let mut bad = Vec::new();
    for (ci, &(nh, ratio, with_sel, n, t0, raw)) in cases.iter().enumerate() {
        let RawCase {
            ld,
            h,
            spec,
            q,
            kv,
            sinks,
            sel,
        } = raw_case(1300 + ci as u64, nh, ratio, with_sel, n, t0, (5, 2));
        let hd = spec.head_dim;
        let (_, sk_g) = vectors(&cpu, &gpu, &sinks);
        let groups = nh * hd / 4096;
        let rows = groups * 96;
        let (_, w) = common::weight(&cpu, &gpu, GgmlType::Q8_0, 4096, rows, 1, 1400 + ci as u64);
        let (kvg, selg) = (gpu.upload(&kv), sel.as_ref().map(|s| gpu.upload_i32(s)));
        let mut qg = gpu.upload(&q);
        let qeps = if raw {
            Some(eps)
        } else {
            gpu.norm_rope(&mut qg, n, nh, hd, None, eps, 64, t0, RopeKind::Comp, None);
            None
        };
        // (fast, on, fallback): the last as if the library declined the bf16 X' product.
        for (fast, on, fb) in [
            (true, true, false),
            (true, false, false),
            (false, true, false),
            (true, true, true),
        ] {
            // (the mma.sync kernel: the engine's default; the wgmma form keeps the two ops)
            set_form(if fast { TC_FAST_MMA } else { TC });
            GpuBackend::set_blas(true, fast);
            GpuBackend::set_attn_bf16(on);
            GpuBackend::set_attn_bf16_fallback(fb);
            let op = format!(
                "attend_project fast {fast} bf16 {on} fallback {fb} heads {nh} ratio {ratio} sel {with_sel} n {n} t0 {t0} raw {raw}"
            );
            // The two ops: attention into f32 o, then the grouped product.
            let mut gs = gpu.state_from_host(&ld, &h);
            let mut og = gpu.alloc(n * nh * hd);
            match qeps {
                Some(e) => gpu.attend_qnorm(
                    &mut gs,
                    &spec,
                    &qg,
                    e,
                    &kvg,
                    &sk_g,
                    selg.as_ref(),
                    n,
                    t0,
                    &mut og,
                ),
                None => gpu.attend(
                    &mut gs,
                    &spec,
                    &qg,
                    &kvg,
                    &sk_g,
                    selg.as_ref(),
                    n,
                    t0,
                    &mut og,
                ),
            }
            let mut yw = gpu.alloc(n * rows);
            gpu.matmul_grouped(&w, groups, &og, n, &mut yw);
            let want = gpu.download(&yw, n * rows);
            let want_ring = gpu.state_to_host(&gs).raw;
            // The one op.
            let l0 = GpuBackend::attn_bf16_launches();
            let mut gs = gpu.state_from_host(&ld, &h);
            let mut y = gpu.alloc(n * rows);
            gpu.attend_project(
                &mut gs,
                &spec,
                &qg,
                qeps,
                &kvg,
                &sk_g,
                selg.as_ref(),
                n,
                t0,
                &w,
                groups,
                &mut y,
            );
            let got = gpu.download(&y, n * rows);
            let ring = gpu.state_to_host(&gs).raw;
            gpu_ok(&gpu, &op);
            let ran = GpuBackend::attn_bf16_launches() - l0;
            let diff = bit_diffs(&got, &want);
            let nonzero = got.iter().filter(|v| **v != 0.0).count();
            println!("{op}: bf16 kernel ran {ran}, {diff} of {} outputs differ in bits ({nonzero} non-zero)", got.len());
            let expect = u64::from(fast && on && lib);
            if ran != expect || diff != 0 || ring != want_ring || nonzero < got.len() / 2 {
                bad.push(format!("{op}: ran {ran} (want {expect}), {diff} differ, ring same {}, {nonzero} non-zero", ring == want_ring));
            }
        }
    }
    GpuBackend::set_attn_bf16(true);
    GpuBackend::set_attn_bf16_fallback(false);
    GpuBackend::set_blas(true, false);
    set_form(TC);
    GpuBackend::set_attn_step_tc(false); // the default
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
