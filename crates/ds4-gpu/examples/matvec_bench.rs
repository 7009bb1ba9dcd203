//! `matvec_bench [reps]`: decode weight products (model/matvec.rs, gpu/matvec.cu) against the
//! general kernels of matmul.rs (matvec off: direct form, and the coalesced mmc form), as GB/s of
//! weight bytes read per call. Timing: `reps` calls queued back to back between two syncs (wall
//! clock, so products of a few MB include launch overhead); small weights are bound several
//! times and rotated so that the working set (≥ 256 MB) is far larger than the L2.

use ds4_backend::{Backend, GgmlType, MoeSpec, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::conformance::random_row;
use ds4_gpu::{Gpu, GpuBackend};
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

/// The three forms: 0 matvec.rs, 1 matmul.rs direct, 2 matmul.rs coalesced.
fn set_form(form: usize) {
    GpuBackend::set_matvec(form == 0);
    GpuBackend::set_matmul_tiles(false);
    GpuBackend::set_matmul_coalesced(form == 2);
}

const FORMS: [&str; 3] = ["matvec", "mm direct", "mm coalesced"];

/// The opt-in n = 1 variants (GpuBackend::set_matvec_variant 1..=3) of the types that have them.
fn variants(
    gpu: &GpuBackend,
    reps: usize,
    ty: GgmlType,
    what: &str,
    bytes: f64,
    mut f: impl FnMut(usize),
) {
    if !matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS
    ) {
        return;
    }
    set_form(0);
    for v in 1..=3 {
        GpuBackend::set_matvec_variant(v);
        let s = time(gpu, &gpu.upload(&[0.0]), reps, &mut f);
        println!(
            "{:60} {:9.2} us {:8.1} GB/s",
            format!("{what} matvec v{v}"),
            s * 1e6,
            bytes / s / 1e9
        );
    }
    GpuBackend::set_matvec_variant(0);
}

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let g = match Gpu::open(ds4_gpu::Backend::Auto, 0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2)
        }
    };
    let info = g.info().clone();
    println!(
        "device: {} {} ({} SMs, warp {})",
        info.name, info.arch, info.sm_count, info.warp
    );
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
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
            for (form, fname) in FORMS.iter().enumerate() {
                if n > 1 && form == 2 {
                    continue;
                }
                set_form(form);
                let s = time(&gpu, &x, reps, |i| {
                    gpu.matmul(&ws[i % ws.len()], Part::All, &x, n, &mut y)
                });
                line(&format!("{ty:?} {cols}->{rows} n={n} {fname}"), bytes, s);
            }
            if n == 1 {
                variants(
                    &gpu,
                    reps,
                    ty,
                    &format!("{ty:?} {cols}->{rows} n=1"),
                    bytes,
                    |i| gpu.matmul(&ws[i % ws.len()], Part::All, &x, 1, &mut y),
                );
            }
        }
    }

    println!("-- model shapes (q2 mix), n = 1 --");
    for (name, ty, cols, rows, groups) in [
        ("attn q_a", GgmlType::Q8_0, 4096, 1024, 1),
        ("attn q_b", GgmlType::Q8_0, 1024, 32768, 1),
        ("attn kv", GgmlType::Q8_0, 4096, 512, 1),
        ("attn out_a (8 groups)", GgmlType::Q8_0, 4096, 8192, 8),
        ("attn out_b", GgmlType::Q8_0, 8192, 4096, 1),
        ("shared expert up", GgmlType::Q8_0, 4096, 2048, 1),
        ("shared expert down", GgmlType::Q8_0, 2048, 4096, 1),
        ("router", GgmlType::F16, 4096, 256, 1),
        ("head", GgmlType::Q8_0, 4096, 129280, 1),
    ] {
        let (ws, bytes) = copies(&gpu, ty, cols, rows);
        let x: Vec<f32> = (0..cols * groups)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let x = gpu.upload(&x);
        let mut y = gpu.alloc(rows);
        for (form, fname) in FORMS.iter().enumerate().take(2) {
            set_form(form);
            let s = time(&gpu, &x, reps, |i| {
                let w = &ws[i % ws.len()];
                if groups > 1 {
                    gpu.matmul_grouped(w, groups, &x, 1, &mut y)
                } else {
                    gpu.matmul(w, Part::All, &x, 1, &mut y)
                }
            });
            line(
                &format!("{name} {ty:?} {}->{rows} {fname}", cols * groups),
                bytes,
                s,
            );
        }
        let what = format!("{name} {ty:?} {}->{rows}", cols * groups);
        variants(&gpu, reps, ty, &what, bytes, |i| {
            let w = &ws[i % ws.len()];
            if groups > 1 {
                gpu.matmul_grouped(w, groups, &x, 1, &mut y)
            } else {
                gpu.matmul(w, Part::All, &x, 1, &mut y)
            }
        });
    }

    println!("-- routed experts: 256 experts, 6 used, D 4096, ff 2048 (selections rotated) --");
    for (mix, down_ty) in [("q2", GgmlType::Q2_K), ("q4", GgmlType::Q4_K)] {
        let (d, ff, ne, k) = (4096usize, 2048usize, 256usize, 6usize);
        let wg = bind(&gpu, &weight_file(GgmlType::IQ2_XXS, d, ff, ne));
        let wu = bind(&gpu, &weight_file(GgmlType::IQ2_XXS, d, ff, ne));
        let wd = bind(&gpu, &weight_file(down_ty, ff, d, ne));
        let slab = (ff * GgmlType::IQ2_XXS.row_bytes(d as u64).unwrap() as usize * 2
            + d * down_ty.row_bytes(ff as u64).unwrap() as usize) as f64;
        let spec = MoeSpec {
            n_expert: ne,
            n_used: k,
            d,
            ff,
            weight_scale: 1.0,
            clamp: 10.0,
        };
        for n in [1, 2, 4] {
            // 16 selections to rotate through; bytes = mean distinct experts × slab.
            let mut sels = Vec::new();
            let mut distinct = 0usize;
            for _ in 0..16 {
                let mut sel = Vec::new();
                for _ in 0..n {
                    let mut e: Vec<i32> = (0..ne as i32).collect();
                    for i in 0..k {
                        let j = rng.gen_range(i..ne);
                        e.swap(i, j);
                    }
                    sel.extend_from_slice(&e[..k]);
                }
                let mut u = sel.clone();
                u.sort();
                u.dedup();
                distinct += u.len();
                sels.push(gpu.upload_i32(&sel));
            }
            let z: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let wgt: Vec<f32> = (0..n * k).map(|_| rng.gen_range(0.0..0.3)).collect();
            let (z, wgt) = (gpu.upload(&z), gpu.upload(&wgt));
            let mut out = gpu.alloc(n * d);
            for (form, fname) in FORMS.iter().enumerate() {
                set_form(form);
                let s = time(&gpu, &z, reps, |i| {
                    gpu.moe_experts(&spec, &wg, &wu, &wd, &z, &sels[i % 16], &wgt, n, &mut out)
                });
                line(
                    &format!(
                        "moe {mix} n={n} ({:.1} distinct experts) {fname}",
                        distinct as f64 / 16.0
                    ),
                    slab * distinct as f64 / 16.0,
                    s,
                );
            }
        }
    }
    set_form(0);
}
