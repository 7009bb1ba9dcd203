//! `blas_bench [reps]`: the model's dense prefill products (n = 2048 token rows, `BLAS_BENCH_N`
//! for others) through the vendor BLAS-Lt (model/blas.rs) against the built-in GEMM (gemm.rs,
//! default form): time per product, TFLOP/s (2·n·rows·cols, one product), and the sum over one
//! layer's products × 43 layers. Forms: gemm (`set_blas(false)`), blas (three hi/lo terms along
//! K, the default), fast (one bf16 product, opt-in), f16 (one f16 product with a device-side
//! power-of-two scale, opt-in). Timing: `reps` calls queued back to back
//! between two syncs (wall clock: the operand conversion kernels and launch overhead in).

mod common;
use ds4_backend::{Backend, GgmlType, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::conformance::random_row;
use ds4_gpu::GpuBackend;
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::SeedableRng;
use std::sync::Arc;
use std::time::Instant;

/// A GGUF in memory with one `rows × cols` tensor `w` (64 random rows tiled).
fn weight_file(ty: GgmlType, cols: usize, rows: usize) -> Arc<GgufFile> {
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cols as u64 ^ rows as u64);
    let uniq: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, cols, &mut r)).collect();
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, &[cols as u64, rows as u64]).unwrap();
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

/// (name, type, groups, cols per group, rows in all, calls per layer).
type Prod = (&'static str, GgmlType, usize, usize, usize, usize);
const PRODUCTS: &[Prod] = &[
    ("attn q_a 4096->1024", GgmlType::Q8_0, 1, 4096, 1024, 1),
    ("attn kv 4096->512", GgmlType::Q8_0, 1, 4096, 512, 1),
    ("attn q_b 1024->32768", GgmlType::Q8_0, 1, 1024, 32768, 1),
    (
        "attn out_a 8x(4096->1024)",
        GgmlType::Q8_0,
        8,
        4096,
        8192,
        1,
    ),
    ("attn out_b 8192->4096", GgmlType::Q8_0, 1, 8192, 4096, 1),
    (
        "shared gate/up 4096->2048",
        GgmlType::Q8_0,
        1,
        4096,
        2048,
        2,
    ),
    ("shared down 2048->4096", GgmlType::Q8_0, 1, 2048, 4096, 1),
    ("f16 4096->1024", GgmlType::F16, 1, 4096, 1024, 2),
    ("f16 1024->8192", GgmlType::F16, 1, 1024, 8192, 1),
    ("f16 4096->64", GgmlType::F16, 1, 4096, 64, 1),
    ("f16 16384->24 (HC)", GgmlType::F16, 1, 16384, 24, 2),
    (
        "q8_0 4096->16384 (gemm_bench's)",
        GgmlType::Q8_0,
        1,
        4096,
        16384,
        0,
    ),
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
    if !gpu.blas_available() {
        println!("no BLAS-Lt library: nothing to compare");
        return;
    }
    let ns: Vec<usize> = std::env::var("BLAS_BENCH_N")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_else(|| vec![2048]);
    // (name, on, fast); the fourth is the f16 form (set_blas_f16).
    let forms: [(&str, bool, bool); 4] = [
        ("gemm", false, false),
        ("blas", true, false),
        ("fast", true, true),
        ("f16", true, false),
    ];
    for n in ns {
        println!("-- n = {n} (us per product, TFLOP/s) --");
        println!(
            "{:34} {:>18} {:>18} {:>18} {:>18} {:>7}",
            "product", "gemm", "blas", "blas fast", "blas f16", "blas x"
        );
        let mut layer = [0.0f64; 4];
        for &(name, ty, groups, cols, rows, calls) in PRODUCTS {
            // A grouped weight is `cols` wide with the groups' rows stacked.
            let f = weight_file(ty, cols, rows);
            let w = bind(&gpu, &f);
            drop(f);
            let x = gpu.upload(&vec![0.5f32; n * groups * cols]);
            let mut y = gpu.alloc(n * rows);
            let flops = 2.0 * (n * rows * cols) as f64;
            let mut s = [0.0f64; 4];
            for (i, &(_, on, fast)) in forms.iter().enumerate() {
                GpuBackend::set_blas(on, fast);
                if i == 3 {
                    GpuBackend::set_blas_f16();
                }
                let l0 = GpuBackend::blas_launches();
                s[i] = time(&gpu, &x, reps, || {
                    if groups > 1 {
                        gpu.matmul_grouped(&w, groups, &x, n, &mut y);
                    } else {
                        gpu.matmul(&w, Part::All, &x, n, &mut y);
                    }
                });
                if on && GpuBackend::blas_launches() == l0 {
                    s[i] = f64::NAN; // declined
                }
                layer[i] += calls as f64 * s[i];
            }
            let cell = |t: f64| format!("{:9.1} {:7.1}", t * 1e6, flops / t / 1e12);
            println!(
                "{name:34} {:>18} {:>18} {:>18} {:>18} {:>6.2}x",
                cell(s[0]),
                cell(s[1]),
                cell(s[2]),
                cell(s[3]),
                s[0] / s[1]
            );
        }
        println!(
            "one layer's products x 43: gemm {:.1} ms, blas {:.1} ms, fast {:.1} ms, f16 {:.1} ms",
            layer[0] * 43e3,
            layer[1] * 43e3,
            layer[2] * 43e3,
            layer[3] * 43e3
        );
    }
    GpuBackend::set_blas(true, false);
}
