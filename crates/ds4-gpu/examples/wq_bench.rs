//! `wq_bench [reps]`: the model's dense Q8_0 prefill products (n = 2048 token rows,
//! `WQ_BENCH_N` for others) on the wgmma form (model/gemm_wq.rs, `gwq_q8_0`) against the vendor
//! BLAS-Lt three-term product (model/blas.rs, the switch off): time per product (X conversion
//! and, for blas, the weight conversion in), TFLOP/s (2·n·rows·cols), the two outputs' max
//! difference relative to 1 + |blas|, and the sum over one layer's products. Timing: `reps`
//! calls queued back to back between two syncs.

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

/// A GGUF in memory with one `rows × cols` Q8_0 tensor `w` (64 random rows tiled).
fn weight_file(cols: usize, rows: usize) -> Arc<GgufFile> {
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cols as u64 ^ rows as u64);
    let uniq: Vec<Vec<u8>> = (0..64)
        .map(|_| random_row(GgmlType::Q8_0, cols, &mut r))
        .collect();
    let mut w = GgufWriter::new();
    w.add_tensor("w", GgmlType::Q8_0, &[cols as u64, rows as u64])
        .unwrap();
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
    gpu.matrix(&WeightSrc {
        name: "w",
        file: f,
        ty: t.ty,
        dims: &t.dims,
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    })
    .unwrap()
}

/// Seconds per call of `f`: `reps` calls between two syncs, after two warm-up calls.
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

/// (name, cols, rows, calls per layer).
const PRODUCTS: &[(&str, usize, usize, usize)] = &[
    ("attn q_a 4096->1024", 4096, 1024, 1),
    ("attn kv 4096->512", 4096, 512, 1),
    ("attn q_b 1024->32768", 1024, 32768, 1),
    ("attn out_b 8192->4096", 8192, 4096, 1),
    ("shared gate/up 4096->2048", 4096, 2048, 2),
    ("shared down 2048->4096", 2048, 4096, 1),
];

fn main() {
    let reps: usize = common::arg(1, 10);
    let g = common::open_gpu();
    let info = g.info().clone();
    println!(
        "device: {} {} ({} SMs)",
        info.name, info.arch, info.sm_count
    );
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
    let ns: Vec<usize> = std::env::var("WQ_BENCH_N")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_else(|| vec![2048]);
    for n in ns {
        println!("-- n = {n} (us per product, TFLOP/s) --");
        println!(
            "{:28} {:>18} {:>18} {:>7} {:>10}",
            "product", "blas", "wgmma", "x", "max diff"
        );
        let mut layer = [0.0f64; 2];
        for &(name, cols, rows, calls) in PRODUCTS {
            let f = weight_file(cols, rows);
            let w = bind(&gpu, &f);
            drop(f);
            let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(n as u64);
            let xv: Vec<f32> = (0..n * cols).map(|_| r.gen_range(-1.0..1.0)).collect();
            let x = gpu.upload(&xv);
            let mut y = gpu.alloc(n * rows);
            let flops = 2.0 * (n * rows * cols) as f64;
            let mut s = [0.0f64; 2];
            let mut out = [Vec::new(), Vec::new()];
            for (i, on) in [false, true].into_iter().enumerate() {
                GpuBackend::set_gemm_wq(on);
                let l0 = GpuBackend::gemm_wq_launches();
                s[i] = time(&gpu, &x, reps, || gpu.matmul(&w, Part::All, &x, n, &mut y));
                if on && GpuBackend::gemm_wq_launches() == l0 {
                    s[i] = f64::NAN; // declined
                }
                out[i] = gpu.download(&y, n * rows);
                layer[i] += calls as f64 * s[i];
            }
            let diff = out[1]
                .iter()
                .zip(&out[0])
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0.0f32, f32::max);
            let cell = |t: f64| format!("{:9.1} {:7.1}", t * 1e6, flops / t / 1e12);
            println!(
                "{name:28} {:>18} {:>18} {:>6.2}x {diff:>10.2e}",
                cell(s[0]),
                cell(s[1]),
                s[0] / s[1]
            );
        }
        println!(
            "one layer's Q8_0 products (us): blas {:.1}, wgmma {:.1}",
            layer[0] * 1e6,
            layer[1] * 1e6
        );
    }
    GpuBackend::set_gemm_wq(true);
}
