//! `matmul_bench [reps]`: weight-product throughput of the GPU backend (`mm*`, `gateup_*` in
//! gpu/matmul.cu) per type and shape, as GB/s of weight bytes read (each distinct weight byte
//! counted once per call). Timing: `reps` calls queued back to back between two syncs (wall
//! clock), so small products include launch overhead. form: 0 direct, 1 tiles, 2 coalesced. Also `Gpu::matvec` (quant.cu) for n = 1.

mod common;

use ds4_backend::{Backend, GgmlType, MoeSpec, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::conformance::random_row;
use ds4_gpu::GpuBackend;
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

/// A GGUF in memory with one tensor `w` of `experts × rows × cols` (64 random rows tiled: the
/// bytes are valid, and the matrix is far larger than any cache).
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

fn bind(gpu: &GpuBackend, f: &Arc<GgufFile>) -> <GpuBackend as Backend>::Weight {
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

/// Seconds per call of `f`, `reps` calls queued between two syncs (after 2 warm-up calls).
fn time(
    gpu: &GpuBackend,
    probe: &<GpuBackend as Backend>::Buf,
    reps: usize,
    mut f: impl FnMut(),
) -> f64 {
    f();
    f();
    gpu.download(probe, 1);
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    gpu.download(probe, 1);
    if let Err(e) = gpu.check() {
        panic!("GPU error: {e}");
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn main() {
    let reps: usize = common::arg(1, 50);
    let g = common::open_gpu();
    let info = g.info().clone();
    println!(
        "device: {} {} ({} SMs, warp {})",
        info.name, info.arch, info.sm_count, info.warp
    );
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    let line = |what: &str, bytes: f64, s: f64| {
        println!("{what:52} {:9.1} us {:8.1} GB/s", s * 1e6, bytes / s / 1e9);
    };

    println!("-- per type, 4096 -> 16384 (n rows of x) --");
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ] {
        let (cols, rows) = (4096, 16384);
        let f = weight_file(ty, cols, rows, 1);
        let w = bind(&gpu, &f);
        let bytes = (rows * ty.row_bytes(cols as u64).unwrap() as usize) as f64;
        for n in [1, 8, 32, 128] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let x = gpu.upload(&x);
            let mut y = gpu.alloc(n * rows);
            for form in 0..3 {
                let tiles = form == 1;
                GpuBackend::set_matmul_tiles(tiles);
                GpuBackend::set_matmul_coalesced(form == 2);
                let s = time(&gpu, &x, reps, || gpu.matmul(&w, Part::All, &x, n, &mut y));
                line(
                    &format!("mm {ty:?} {cols}->{rows} n={n} form={form}"),
                    bytes,
                    s,
                );
            }
        }
        match ds4_gpu::conformance::time_matvec(gpu.gpu(), ty, rows, cols, 20) {
            Ok((ms, gbs)) => println!(
                "{:52} {:9.1} us {gbs:8.1} GB/s",
                format!("quant.cu matvec {ty:?} {cols}->{rows}"),
                ms * 1e3
            ),
            Err(e) => println!("quant.cu matvec {ty:?}: {e}"),
        }
    }

    GpuBackend::set_matmul_tiles(false);
    GpuBackend::set_matmul_coalesced(false);
    println!("-- model shapes (q2 mix), n = 1 and 128, default (direct) form --");
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
        let f = weight_file(ty, cols, rows, 1);
        let w = bind(&gpu, &f);
        let bytes = (rows * ty.row_bytes(cols as u64).unwrap() as usize) as f64;
        for n in [1, 128] {
            let x: Vec<f32> = (0..n * cols * groups)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let x = gpu.upload(&x);
            let mut y = gpu.alloc(n * rows);
            let s = if groups > 1 {
                time(&gpu, &x, reps, || {
                    gpu.matmul_grouped(&w, groups, &x, n, &mut y)
                })
            } else {
                time(&gpu, &x, reps, || gpu.matmul(&w, Part::All, &x, n, &mut y))
            };
            line(
                &format!("{name} {ty:?} {}->{rows} n={n}", cols * groups),
                bytes,
                s,
            );
        }
    }

    println!("-- routed experts: 256 experts, 6 used, D 4096, ff 2048 --");
    for (mix, down_ty) in [("q2", GgmlType::Q2_K), ("q4", GgmlType::Q4_K)] {
        let (d, ff, ne, k) = (4096usize, 2048usize, 256usize, 6usize);
        let fg = weight_file(GgmlType::IQ2_XXS, d, ff, ne);
        let wg = bind(&gpu, &fg);
        drop(fg);
        let fu = weight_file(GgmlType::IQ2_XXS, d, ff, ne);
        let wu = bind(&gpu, &fu);
        drop(fu);
        let fd = weight_file(down_ty, ff, d, ne);
        let wd = bind(&gpu, &fd);
        drop(fd);
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
        for n in [1, 8, 128] {
            let mut sel = Vec::new();
            for _ in 0..n {
                let mut e: Vec<i32> = (0..ne as i32).collect();
                for i in 0..k {
                    let j = rng.gen_range(i..ne);
                    e.swap(i, j);
                }
                sel.extend_from_slice(&e[..k]);
            }
            let mut distinct = sel.clone();
            distinct.sort();
            distinct.dedup();
            let z: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let wgt: Vec<f32> = (0..n * k).map(|_| rng.gen_range(0.0..0.3)).collect();
            let (z, s_, wgt) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
            let mut out = gpu.alloc(n * d);
            for form in 0..3 {
                let tiles = form == 1;
                GpuBackend::set_matmul_tiles(tiles);
                GpuBackend::set_matmul_coalesced(form == 2);
                let s = time(&gpu, &z, reps.min(20), || {
                    gpu.moe_experts(&spec, &wg, &wu, &wd, &z, &s_, &wgt, n, &mut out)
                });
                line(
                    &format!(
                        "moe {mix} n={n} ({} distinct experts) form={form}",
                        distinct.len()
                    ),
                    slab * distinct.len() as f64,
                    s,
                );
            }
        }
    }
}
