//! `matvec_bench [reps]`: decode dense weight products (model/matvec.rs, gpu/matvec.cu) against the
//! general kernels of matmul.rs (matvec off: direct form, and the coalesced mmc form), as GB/s of
//! weight bytes read per call. Timing: `reps` calls queued back to back between two syncs (wall
//! clock, so products of a few MB include launch overhead); small weights are bound several
//! times and rotated so that the working set (≥ 256 MB) is far larger than the L2.

mod common;

use ds4_backend::{Backend, GgmlType, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::conformance::random_row;
use ds4_gpu::GpuBackend;
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

type W = <GpuBackend as Backend>::Weight;
type B = <GpuBackend as Backend>::Buf;

/// A GGUF in memory with one tensor `w` of `experts × rows × cols` (64 random rows tiled).
fn weight_file(ty: GgmlType, cols: usize, rows: usize, experts: usize) -> Arc<GgufFile> {
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cols as u64 ^ rows as u64);
    let uniq: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, cols, &mut r)).collect();
    let mut dims = vec![cols as u64, rows as u64];
    if experts > 1 {
        dims.push(experts as u64);
    }
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, &dims).unwrap();
    let bytes = w
        .to_bytes(|_, out: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
            let rb = uniq[0].len();
            for (i, c) in out.chunks_mut(rb).enumerate() {
                c.copy_from_slice(&uniq[(i * 7 + i / 64) % 64]);
            }
            Ok(())
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes("bench.gguf", bytes).unwrap())
}

fn bind(gpu: &GpuBackend, f: &Arc<GgufFile>) -> W {
    let t = f.tensor("w").unwrap();
    let src = WeightSrc {
        name: "w",
        file: f,
        ty: t.ty,
        dims: &t.dims,
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    };
    gpu.matrix(&src).unwrap()
}

/// Copies of one weight whose bytes together reach 256 MB (at most 64).
fn copies(gpu: &GpuBackend, ty: GgmlType, cols: usize, rows: usize) -> (Vec<W>, f64) {
    let bytes = (rows * ty.row_bytes(cols as u64).unwrap() as usize) as f64;
    let m = ((256e6 / bytes).ceil() as usize).clamp(1, 64);
    let f = weight_file(ty, cols, rows, 1);
    ((0..m).map(|_| bind(gpu, &f)).collect(), bytes)
}

/// Seconds per call of `f(i)`, `reps` calls queued between two syncs (after 3 warm-up calls).
fn time(gpu: &GpuBackend, probe: &B, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..3 {
        f(i);
    }
    gpu.download(probe, 1);
    let t = Instant::now();
    for i in 0..reps {
        f(i);
    }
    gpu.download(probe, 1);
    if let Err(e) = gpu.check() {
        panic!("GPU error: {e}");
    }
    t.elapsed().as_secs_f64() / reps as f64
}

/// The forms: 0 matvec.rs staged for every type (variant 5), 1 matmul.rs direct, 2 matmul.rs
/// coalesced (the general form, n = 1 for the types where staging loses), 3 matvec.rs before the
/// staged kernels (variant 4: `mv<NT>_*`, n = 2..4 only), 4..=5 the n = 1 `mvq_*` forms r2u4,
/// r1u4 (Q8_0, F16), 6 the default.
fn set_form(form: usize) {
    GpuBackend::set_matvec(matches!(form, 0 | 3..=5));
    GpuBackend::set_matvec_variant(match form {
        0 => 5,
        3 => 4,
        _ => 0,
    });
    GpuBackend::set_matvec_one(match form {
        4..=5 => form as u8 - 3,
        6 => 255,
        _ => 0,
    });
    GpuBackend::set_matmul_tiles(false);
    GpuBackend::set_matmul_coalesced(form == 2 || form == 6);
    if form == 6 {
        GpuBackend::set_matvec_defaults();
    }
}
const FORMS: [&str; 7] = [
    "staged",
    "mm direct",
    "mm coalesced",
    "mv old",
    "mvq r2u4",
    "mvq r1u4",
    "default",
];

/// Seconds per call of `f(i)` as the decode runs them: `reps` calls recorded as one graph step
/// (after two recorded warm-up rounds), timed from the graph launch to the sync (device time
/// plus the graph update, no per-launch host time).
fn time_graph(gpu: &GpuBackend, probe: &B, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut s = 0.0;
    for _ in 0..3 {
        gpu.download(probe, 1);
        gpu.graph_begin(1);
        for i in 0..reps {
            f(i);
        }
        let t = Instant::now();
        gpu.graph_end();
        gpu.download(probe, 1);
        s = t.elapsed().as_secs_f64();
    }
    if let Err(e) = gpu.check() {
        panic!("GPU error: {e}");
    }
    s / reps as f64
}

/// `matvec_bench reps q8`: the n = 1 decode products of the model (Q8_0 on the decode-layout
/// copy, F16 rows, the merged sets), the previous forms (`mvr`/`mvrm`/`mvrgu`, `mvq`/`mvqm`:
/// q8 form 0) against the `mvx*` forms (x staged in shared memory) and grids; eager (wall clock
/// of queued launches) and graph-recorded (about device time) per call. `hot` (`matvec_bench
/// REPS q8 hot`): one copy of each weight, called over and over, so that a product that fits the
/// L2 (H100 / H200: 50 MB) reads it from there: the ceiling of an L2 prefetch of that product.
/// `pf` (`q8 pf-same` / `q8 pf-next`; the single products' default forms only, the merged sets
/// run unhinted): before each product the L2 hint
/// kernel (`Backend::prefetch`, elementwise.cu `prefetch_l2`) for the same weight (1: racing the
/// product; where the hint fills the L2 usefully the pair costs about the bytes at full DRAM
/// speed, else the bytes twice) or the next call's (2); `MV_BENCH_PF_ONLY=1` times the hint alone.
/// Session 59 (H100, bench/results/gpu-s59-h100.txt): the bytes twice for the 36 MB products, in
/// the bulk form and the per-line, evict_last and completing-load forms of a2086cf / a5d2bed /
/// 8ef64e2; the 8.9 MB shared-expert down at its L2 speed.
fn q8_only(gpu: &GpuBackend, reps: usize, hot: bool, pf: usize) {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(2);
    let line = |what: String, bytes: f64, e: f64, g: f64| {
        println!(
            "{what:60} eager {:8.2} us {:7.1} GB/s | graph {:8.2} us {:7.1} GB/s",
            e * 1e6,
            bytes / e / 1e9,
            g * 1e6,
            bytes / g / 1e9
        );
    };
    println!(
        "-- Q8_0 n = 1, model shapes: mvr (old default) vs the default (mvx up to 1024 columns) --"
    );
    // (name, q8 form, mvx CTAs per SM (255: default), mvx batches per SM): mvx_r4u2_q8_0 is
    // the default up to 1024 columns only (the rest: mvr either way).
    let forms: [(&str, u8, u8, u8); 4] = [
        ("mvr old", 0, 255, 6),
        ("default", 1, 255, 6),
        ("mvx c3", 1, 3, 6),
        ("default", 1, 255, 6),
    ];
    for (name, cols, rows, groups) in [
        ("attn q_b", 1024, 32768, 1),
        ("attn out_a (8 groups)", 4096, 8192, 8),
        ("attn out_b", 8192, 4096, 1),
        ("shared expert down", 2048, 4096, 1),
        ("attn q_a", 4096, 1024, 1),
        ("head", 4096, 129280, 1),
    ] {
        let (mut ws, bytes) = copies(gpu, GgmlType::Q8_0, cols, rows);
        if hot {
            ws.truncate(1);
        }
        let x: Vec<f32> = (0..cols * groups)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let x = gpu.upload(&x);
        let mut y = gpu.alloc(rows);
        for (fname, form, ctas, spread) in forms {
            if pf > 0 && fname != "default" {
                continue;
            }
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_q8_form(form, ctas);
            GpuBackend::set_matvec_mvx_spread(spread);
            let pf_only = std::env::var("MV_BENCH_PF_ONLY").is_ok();
            let mut call = |i: usize| {
                if pf > 0 {
                    gpu.prefetch(&[&ws[(i + pf - 1) % ws.len()]], 1);
                    if pf_only {
                        return;
                    }
                }
                let w = &ws[i % ws.len()];
                if groups > 1 {
                    gpu.matmul_grouped(w, groups, &x, 1, &mut y)
                } else {
                    gpu.matmul(w, Part::All, &x, 1, &mut y)
                }
            };
            let e = time(gpu, &x, reps, &mut call);
            let g = time_graph(gpu, &x, reps, &mut call);
            let what = format!("{name} Q8_0 {}->{rows} n=1 {fname}", cols * groups);
            line(what, bytes, e, g);
        }
    }
    let fforms: [(&str, u8, u8, u8); 3] = [
        ("old", 0, 255, 6),
        ("default", 1, 255, 6),
        ("mvx c0", 1, 0, 6),
    ];
    println!("-- merged n = 1 sets: mvrm/mvqm/mvrgu (old) vs the default (mvxm_r4u2_f16 from 2048 rows) --");
    let sets: [(&str, GgmlType, usize, &[usize]); 4] = [
        ("attn q_a + kv", GgmlType::Q8_0, 4096, &[1024, 512]),
        (
            "CSA compressor + indexer",
            GgmlType::F16,
            4096,
            &[1024, 1024, 256, 256, 64],
        ),
        ("HCA compressor", GgmlType::F16, 4096, &[512, 512]),
        (
            "shared gate/up + swiglu",
            GgmlType::Q8_0,
            4096,
            &[2048, 2048],
        ),
    ];
    for (name, ty, cols, rows) in sets {
        let (mut sets, bytes) = set_copies(gpu, ty, cols, rows);
        if hot {
            sets.truncate(1);
        }
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x = gpu.upload(&x);
        let mut ys: Vec<B> = rows.iter().map(|&r| gpu.alloc(r)).collect();
        let gateup = name.starts_with("shared");
        for (fname, form, ctas, spread) in fforms {
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_q8_form(form, ctas);
            GpuBackend::set_matvec_mvx_spread(spread);
            let mut call = |i: usize| {
                let s = &sets[i % sets.len()];
                if gateup {
                    gpu.matmul_gateup(&s[0], &s[1], &x, 1, rows[0], &mut ys[0], 10.0);
                } else {
                    let ws: Vec<&W> = s.iter().collect();
                    let mut refs: Vec<&mut B> = ys.iter_mut().collect();
                    gpu.matmul_multi(&ws, &x, 1, &mut refs);
                }
            };
            let e = time(gpu, &x, reps, &mut call);
            let g = time_graph(gpu, &x, reps, &mut call);
            line(
                format!("{name} {ty:?} {cols}->{rows:?} {fname}"),
                bytes,
                e,
                g,
            );
        }
    }
    GpuBackend::set_matvec_defaults();
}

/// Copies of a set of matrices of one x (`rows` each, one type and cols): m sets whose bytes
/// together reach 256 MB (at most 64), and the bytes of one set.
fn set_copies(gpu: &GpuBackend, ty: GgmlType, cols: usize, rows: &[usize]) -> (Vec<Vec<W>>, f64) {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let bytes = rows.iter().map(|r| r * rb).sum::<usize>() as f64;
    let m = ((256e6 / bytes).ceil() as usize).clamp(1, 64);
    let fs: Vec<_> = rows.iter().map(|&r| weight_file(ty, cols, r, 1)).collect();
    let sets = (0..m)
        .map(|_| fs.iter().map(|f| bind(gpu, f)).collect())
        .collect();
    (sets, bytes)
}

/// `matvec_bench reps merged`: n = 1 products of one x merged into one launch (`matmul_multi`,
/// `matmul_gateup`) against one by one (`set_matvec_merge(false)`), eager and graph-timed per
/// call of the whole set.
fn merged(gpu: &GpuBackend, reps: usize) {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(3);
    println!("-- merged n = 1 products: one launch vs one by one --");
    let sets: [(&str, GgmlType, usize, &[usize]); 4] = [
        ("attn q_a + kv", GgmlType::Q8_0, 4096, &[1024, 512]),
        (
            "CSA compressor + indexer",
            GgmlType::F16,
            4096,
            &[1024, 1024, 256, 256, 64],
        ),
        ("HCA compressor", GgmlType::F16, 4096, &[512, 512]),
        (
            "shared gate/up + swiglu",
            GgmlType::Q8_0,
            4096,
            &[2048, 2048],
        ),
    ];
    for (name, ty, cols, rows) in sets {
        let (sets, bytes) = set_copies(gpu, ty, cols, rows);
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x = gpu.upload(&x);
        let mut ys: Vec<B> = rows.iter().map(|&r| gpu.alloc(r)).collect();
        let gateup = name.starts_with("shared");
        for merge in [false, true] {
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_merge(merge);
            let mut call = |i: usize| {
                let s = &sets[i % sets.len()];
                if gateup {
                    gpu.matmul_gateup(&s[0], &s[1], &x, 1, rows[0], &mut ys[0], 10.0);
                } else {
                    let ws: Vec<&W> = s.iter().collect();
                    let mut refs: Vec<&mut B> = ys.iter_mut().collect();
                    gpu.matmul_multi(&ws, &x, 1, &mut refs);
                }
            };
            let e = time(gpu, &x, reps, &mut call);
            let g = time_graph(gpu, &x, reps, &mut call);
            println!(
                "{:60} eager {:8.2} us {:7.1} GB/s | graph {:8.2} us {:7.1} GB/s",
                format!("{name} {ty:?} {cols}->{rows:?} merge {merge}"),
                e * 1e6,
                bytes / e / 1e9,
                g * 1e6,
                bytes / g / 1e9
            );
        }
    }
    GpuBackend::set_matvec_defaults();
}

/// `matvec_bench reps il`: the n = 1 Q8_0 decode products (`mvr*`, merged `mvrm`/`mvrgu`) on the
/// plain decode layout against the interleaved one (`set_matvec_q8_il`: copies made in each
/// layout; ip: interleaved with `set_matvec_mvr_pipe`, single products only), graph-timed per
/// call, alternating p / i / ip twice. `only`: the shapes whose name contains it (ncu runs).
fn il_only(gpu: &GpuBackend, reps: usize, only: &str) {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(4);
    println!("-- Q8_0 n = 1 decode products: plain (p) vs interleaved (i) decode layout, graph us per call --");
    // (name, cols, rows of each matrix, groups); two matrices: a merged set (q_a + kv: mvrm;
    // gate/up: mvrgu).
    let shapes: [(&str, usize, &[usize], usize); 7] = [
        ("attn out_a (8 groups)", 4096, &[8192], 8),
        ("attn out_b", 8192, &[4096], 1),
        ("shared expert down", 2048, &[4096], 1),
        ("attn q_a", 4096, &[1024], 1),
        ("head", 4096, &[129280], 1),
        ("attn q_a + kv", 4096, &[1024, 512], 1),
        ("shared gate/up + swiglu", 4096, &[2048, 2048], 1),
    ];
    for (name, cols, rows, groups) in shapes {
        if !name.contains(only) {
            continue;
        }
        let mut lay = Vec::new();
        for il in [false, true] {
            GpuBackend::set_matvec_q8_il(il);
            lay.push(set_copies(gpu, GgmlType::Q8_0, cols, rows));
        }
        GpuBackend::set_matvec_q8_il(false);
        let bytes = lay[0].1;
        let x: Vec<f32> = (0..cols * groups)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let x = gpu.upload(&x);
        let mut ys: Vec<B> = rows.iter().map(|&r| gpu.alloc(r)).collect();
        let mut t = [Vec::new(), Vec::new(), Vec::new()];
        for round in 0..6 {
            let l = round % 3;
            let sets = &lay[l.min(1)].0;
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_mvr_pipe(l == 2);
            let mut call = |i: usize| {
                let s = &sets[i % sets.len()];
                if rows.len() == 2 && name.starts_with("shared") {
                    gpu.matmul_gateup(&s[0], &s[1], &x, 1, rows[0], &mut ys[0], 10.0);
                } else if rows.len() == 2 {
                    let ws: Vec<&W> = s.iter().collect();
                    let mut refs: Vec<&mut B> = ys.iter_mut().collect();
                    gpu.matmul_multi(&ws, &x, 1, &mut refs);
                } else if groups > 1 {
                    gpu.matmul_grouped(&s[0], groups, &x, 1, &mut ys[0]);
                } else {
                    gpu.matmul(&s[0], Part::All, &x, 1, &mut ys[0]);
                }
            };
            t[l].push(time_graph(gpu, &x, reps, &mut call) * 1e6);
        }
        let best = |v: &Vec<f64>| v.iter().cloned().fold(f64::MAX, f64::min);
        println!(
            "{:26} {}->{:?}: p {:6.2} {:6.2} | i {:6.2} {:6.2} | ip {:6.2} {:6.2} us | best p {:6.2} i {:6.2} ({:+.1}%) ip {:6.2} ({:+.1}%) GB/s {:5.0} {:5.0} {:5.0}",
            name,
            cols * groups,
            rows,
            t[0][0],
            t[0][1],
            t[1][0],
            t[1][1],
            t[2][0],
            t[2][1],
            best(&t[0]),
            best(&t[1]),
            (best(&t[1]) / best(&t[0]) - 1.0) * 100.0,
            best(&t[2]),
            (best(&t[2]) / best(&t[0]) - 1.0) * 100.0,
            bytes / best(&t[0]) / 1e3,
            bytes / best(&t[1]) / 1e3,
            bytes / best(&t[2]) / 1e3
        );
    }
    GpuBackend::set_matvec_mvr_pipe(false);
    GpuBackend::set_matvec_defaults();
}

/// `matvec_bench reps f2`: the F16 n = 1 products with their weight loads before the PDL wait
/// (`set_matvec_mvq_late(true)`, `l`) against the early wait (`e`), and the router's fused
/// product + route by `DS4_GPU_ROUTE` form (rounds, on = ranks, off); graph us per call, each call after
/// an rms_norm of its x (a dependent kernel before it, as in the model); forms alternate by
/// round, best of the rounds.
fn f2(gpu: &GpuBackend, reps: usize) {
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(5);
    let best = |v: &Vec<f64>| v.iter().cloned().fold(f64::MAX, f64::min);
    let probe = gpu.alloc(1);
    println!(
        "-- F16 n = 1 products after an rms_norm: early wait (e) vs late (l), graph us per call --"
    );
    let shapes: [(&str, usize, &[usize], usize); 5] = [
        ("indexer q_b (mvq r2u4)", 1024, &[8192], 1),
        ("HCA compressor (mvqm)", 4096, &[512, 512], 1),
        ("router product (mvq r2u4)", 4096, &[256], 1),
        ("HC mixer 16384->24", 16384, &[24], 1),
        (
            "CSA compressor + indexer (mvxm)",
            4096,
            &[1024, 1024, 256, 256, 64],
            1,
        ),
    ];
    for (name, cols, rows, _) in shapes {
        let (sets, bytes) = set_copies(gpu, GgmlType::F16, cols, rows);
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut xb = gpu.upload(&x);
        let mut ys: Vec<B> = rows.iter().map(|&r| gpu.alloc(r)).collect();
        let mut t = [Vec::new(), Vec::new()];
        for round in 0..6 {
            let late = round % 2 == 1;
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_mvq_late(late);
            let mut call = |i: usize| {
                gpu.rms_norm(&mut xb, 1, cols, None, 1e-6);
                let s = &sets[i % sets.len()];
                if rows.len() > 1 {
                    let ws: Vec<&W> = s.iter().collect();
                    let mut refs: Vec<&mut B> = ys.iter_mut().collect();
                    gpu.matmul_multi(&ws, &xb, 1, &mut refs);
                } else {
                    gpu.matmul(&s[0], Part::All, &xb, 1, &mut ys[0]);
                }
            };
            t[late as usize].push(time_graph(gpu, &probe, reps, &mut call) * 1e6);
        }
        let (e, l) = (best(&t[0]), best(&t[1]));
        println!(
            "{name:32} {cols}->{rows:?}: e {:?} | l {:?} | best e {e:6.2} l {l:6.2} us ({:+.1}%), GB/s {:5.0} {:5.0}",
            t[0].iter().map(|v| (v * 100.0).round() / 100.0).collect::<Vec<_>>(),
            t[1].iter().map(|v| (v * 100.0).round() / 100.0).collect::<Vec<_>>(),
            (l / e - 1.0) * 100.0,
            bytes / e / 1e3,
            bytes / l / 1e3
        );
    }
    GpuBackend::set_matvec_defaults();

    println!("-- indexer q_b 1024 -> 8192 F16 after an rms_norm: plain e / l, interleaved copy i / il (DS4_GPU_F16_IL), graph us --");
    {
        let (cols, rows) = (1024usize, 8192usize);
        let (plain, bytes) = set_copies(gpu, GgmlType::F16, cols, &[rows]);
        GpuBackend::set_matvec_f16_il(true);
        let (il, _) = set_copies(gpu, GgmlType::F16, cols, &[rows]);
        GpuBackend::set_matvec_f16_il(false);
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut xb = gpu.upload(&x);
        let mut y = gpu.alloc(rows);
        let mut t = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for round in 0..8 {
            let f = round % 4;
            let sets = if f < 2 { &plain } else { &il };
            GpuBackend::set_matvec_defaults();
            GpuBackend::set_matvec_mvq_late(f % 2 == 1);
            let mut call = |i: usize| {
                gpu.rms_norm(&mut xb, 1, cols, None, 1e-6);
                gpu.matmul(&sets[i % sets.len()][0], Part::All, &xb, 1, &mut y);
            };
            t[f].push(time_graph(gpu, &probe, reps, &mut call) * 1e6);
        }
        GpuBackend::set_matvec_defaults();
        let names = ["e", "l", "i", "il"];
        for (f, n) in names.iter().enumerate() {
            println!(
                "q_b {n:2}: {:?} best {:6.2} us, {:5.0} GB/s",
                t[f].iter()
                    .map(|v| (v * 100.0).round() / 100.0)
                    .collect::<Vec<_>>(),
                best(&t[f]),
                bytes / best(&t[f]) / 1e3
            );
        }
    }

    println!("-- router 4096 -> 256 F16, top 6 + bias: matmul_route after an rms_norm, graph us per call --");
    let (cols, ne, k) = (4096usize, 256usize, 6usize);
    let spec = ds4_backend::MoeSpec {
        n_expert: ne,
        n_used: k,
        d: cols,
        ff: 2048,
        weight_scale: 1.5,
        clamp: 10.0,
    };
    let (sets, _) = set_copies(gpu, GgmlType::F16, cols, &[ne]);
    let bf = weight_file(GgmlType::F32, ne, 1, 1);
    let bt = bf.tensor("w").unwrap();
    let bias = gpu
        .vector(&WeightSrc {
            name: "w",
            file: &bf,
            ty: bt.ty,
            dims: &bt.dims,
            offset: bt.offset as usize,
            n_bytes: bt.n_bytes as usize,
        })
        .unwrap();
    let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut xb = gpu.upload(&x);
    let tok = gpu.upload_i32(&[0]);
    let (mut lg, mut sel, mut wgt) = (gpu.alloc(ne), gpu.alloc_i32(k), gpu.alloc(k));
    let forms = ["rounds", "on", "off"];
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    let mut picks: Vec<Vec<i32>> = Vec::new();
    for round in 0..9 {
        let f = round % 3;
        GpuBackend::set_route_form(forms[f]);
        let mut call = |i: usize| {
            gpu.rms_norm(&mut xb, 1, cols, None, 1e-6);
            let s = &sets[i % sets.len()];
            gpu.matmul_route(
                &spec,
                &s[0],
                &xb,
                1,
                &mut lg,
                Some(&bias),
                None,
                &tok,
                &mut sel,
                &mut wgt,
            );
        };
        t[f].push(time_graph(gpu, &probe, reps, &mut call) * 1e6);
        picks.push(gpu.download_i32(&sel, k));
    }
    GpuBackend::set_route_form("on");
    for (f, name) in forms.iter().enumerate() {
        println!(
            "route {name:5}: {:?} best {:6.2} us",
            t[f].iter()
                .map(|v| (v * 100.0).round() / 100.0)
                .collect::<Vec<_>>(),
            best(&t[f])
        );
    }
    let same = picks.windows(2).all(|w| w[0] == w[1]);
    println!(
        "route: the last selections of every round equal: {same} ({:?})",
        picks[0]
    );
}

fn main() {
    let reps: usize = common::arg(1, 100);
    let only_q8 = std::env::args().nth(2).as_deref() == Some("q8");
    let mode = std::env::args().nth(3).unwrap_or_default();
    let hot = mode == "hot";
    let pf = match mode.as_str() {
        "pf-same" => 1,
        "pf-next" => 2,
        _ => 0,
    };
    if pf > 0 {
        GpuBackend::set_prefetch_mb(254);
    }
    let g = common::open_gpu();
    let info = g.info().clone();
    println!(
        "device: {} {} ({} SMs, warp {})",
        info.name, info.arch, info.sm_count, info.warp
    );
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
    if only_q8 {
        println!(
            "-- {} --",
            match (hot, pf) {
                (true, _) => "hot: one copy of each weight (L2-resident where it fits)",
                (_, 1) => "cold, each product after an L2 hint for its own weight",
                (_, 2) => "cold, each product after an L2 hint for the next call's weight",
                _ => "cold: copies rotated over >= 256 MB",
            }
        );
        q8_only(&gpu, reps, hot, pf);
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("il") {
        il_only(&gpu, reps, &std::env::args().nth(3).unwrap_or_default());
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("f2") {
        f2(&gpu, reps);
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("merged") {
        merged(&gpu, reps);
        return;
    }
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    let line = |what: &str, bytes: f64, s: f64| {
        println!("{what:60} {:9.2} us {:8.1} GB/s", s * 1e6, bytes / s / 1e9);
    };

    println!("-- per type, 4096 -> 16384 --");
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::IQ2_XXS,
        GgmlType::Q4_K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        let (cols, rows) = (4096, 16384);
        let (ws, bytes) = copies(&gpu, ty, cols, rows);
        for n in [1, 2, 4] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let x = gpu.upload(&x);
            let mut y = gpu.alloc(n * rows);
            let forms: &[usize] = match (n, ty) {
                (1, GgmlType::Q8_0 | GgmlType::F16) => &[2, 4, 5],
                (1, _) => &[0, 2],
                _ => &[0, 3],
            };
            for &form in forms {
                set_form(form);
                let s = time(&gpu, &x, reps, |i| {
                    gpu.matmul(&ws[i % ws.len()], Part::All, &x, n, &mut y)
                });
                let fname = FORMS[form];
                line(&format!("{ty:?} {cols}->{rows} n={n} {fname}"), bytes, s);
            }
        }
    }

    println!("-- model shapes (q2 mix): n = 1 old forms vs mvq, n = 2 staged vs mv old --");
    for (name, ty, cols, rows, groups) in [
        ("attn q_a", GgmlType::Q8_0, 4096, 1024, 1),
        ("attn q_b", GgmlType::Q8_0, 1024, 32768, 1),
        ("attn kv", GgmlType::Q8_0, 4096, 512, 1),
        ("attn out_a (8 groups)", GgmlType::Q8_0, 4096, 8192, 8),
        ("attn out_b", GgmlType::Q8_0, 8192, 4096, 1),
        ("shared expert up", GgmlType::Q8_0, 4096, 2048, 1),
        ("shared expert down", GgmlType::Q8_0, 2048, 4096, 1),
        ("hc mix", GgmlType::F16, 16384, 24, 1),
        ("router", GgmlType::F16, 4096, 256, 1),
        ("F16 4096->512", GgmlType::F16, 4096, 512, 1),
        ("F16 4096->1024", GgmlType::F16, 4096, 1024, 1),
        ("F16 1024->8192", GgmlType::F16, 1024, 8192, 1),
        ("F16 4096->64", GgmlType::F16, 4096, 64, 1),
        ("head", GgmlType::Q8_0, 4096, 129280, 1),
    ] {
        let (ws, bytes) = copies(&gpu, ty, cols, rows);
        for n in [1, 2] {
            let x: Vec<f32> = (0..n * cols * groups)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let x = gpu.upload(&x);
            let mut y = gpu.alloc(n * rows);
            // n = 1: the old default (mm coalesced; staged for the F16 16384-column mixes), the
            // four mvq forms and the new default.
            let forms: &[usize] = if n == 1 { &[2, 0, 4, 5, 6] } else { &[0, 3] };
            for &form in forms {
                set_form(form);
                let s = time(&gpu, &x, reps, |i| {
                    let w = &ws[i % ws.len()];
                    if groups > 1 {
                        gpu.matmul_grouped(w, groups, &x, n, &mut y)
                    } else {
                        gpu.matmul(w, Part::All, &x, n, &mut y)
                    }
                });
                let fname = FORMS[form];
                line(
                    &format!("{name} {ty:?} {}->{rows} n={n} {fname}", cols * groups),
                    bytes,
                    s,
                );
            }
        }
    }
    set_form(6);
}
