//! Shared by the GPU backend tests: open the device (or say why not), build weights from
//! bytes for both backends, random data, comparisons.
#![allow(dead_code)] // each test binary uses a subset

use ds4_backend::{GgmlType, WeightSrc};
use ds4_cpu::CpuBackend;
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::{Backend as Vendor, Gpu, GpuBackend};
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// Whether the device has the tensor-core (mma.sync) kernels: CUDA sm_80+ (warp 32).
pub fn sm80(gpu: &GpuBackend) -> bool {
    let i = gpu.gpu().info();
    i.vendor == ds4_gpu::runtime::Vendor::Nvidia && i.cc.0 >= 8 && i.warp == 32
}

/// One GPU test at a time per process: tests flip process-wide kernel forms (`set_*`) and share
/// the device's context (one thread's synchronize fails while another captures a graph), so a
/// test holds this lock from opening the device until its thread ends (libtest runs each test
/// on its own thread). With it, the default parallel `cargo test` gives the results of
/// `--test-threads=1`.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

thread_local! {
    static HELD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, ()>>> =
        const { std::cell::RefCell::new(None) };
}

fn serialize() {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.is_none() {
            // A test that panicked while holding the lock poisons it; the next one goes on.
            *h = Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner()));
        }
    });
}

/// The device named by `DS4_GPU_BACKEND` / `DS4_GPU_DEVICE` (auto / 0), or None with the
/// reason printed. `DS4_REQUIRE_GPU=1` turns a missing device into a failure. Serializes the
/// calling test with the other GPU tests of this process (see `SERIAL`).
pub fn open_gpu() -> Option<Gpu> {
    serialize();
    let vendor: Vendor = std::env::var("DS4_GPU_BACKEND")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .unwrap();
    let device = std::env::var("DS4_GPU_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    match Gpu::open(vendor, device) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("DS4_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("DS4_REQUIRE_GPU=1 but no GPU: {e}");
            }
            println!("skipped: no GPU available: {e}");
            None
        }
    }
}

/// The CPU reference and the GPU backend with the RoPE tables of `hp`.
pub fn backends(hp: &HParams) -> Option<(CpuBackend, GpuBackend)> {
    let gpu = open_gpu()?;
    let ropes = rope_tables(hp);
    Some((
        CpuBackend::new(ropes.clone()),
        GpuBackend::new(gpu, &ropes).expect("GPU backend"),
    ))
}

/// A GGUF in memory holding `tensors` (name, type, GGUF dims, bytes).
pub fn file(tensors: &[(&str, GgmlType, Vec<u64>, Vec<u8>)]) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    for (name, ty, dims, _) in tensors {
        w.add_tensor(*name, *ty, dims).unwrap();
    }
    let bytes = w
        .to_bytes(|i, out: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
            out.copy_from_slice(&tensors[i].3);
            Ok(())
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes("test.gguf", bytes).unwrap())
}

/// The view of tensor `name` of `f` that backends bind.
pub fn src<'a>(f: &'a Arc<GgufFile>, name: &'a str) -> WeightSrc<'a> {
    let t = f.tensor(name).unwrap();
    WeightSrc {
        name,
        file: f,
        ty: t.ty,
        dims: &t.dims,
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    }
}

/// f32 values as GGUF bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn rng(seed: u64) -> rand_xoshiro::Xoshiro256PlusPlus {
    rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// `n` values uniform in ±`scale`.
pub fn randn(r: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-scale..scale)).collect()
}

/// MoE routes of `n` tokens: `n_used` distinct experts of `n_expert` per token (a partial
/// shuffle, so experts repeat across tokens), then a weight in [0.1, 1) per (token, slot),
/// drawn in that order.
pub fn random_routes(
    r: &mut impl Rng,
    n: usize,
    n_expert: usize,
    n_used: usize,
) -> (Vec<i32>, Vec<f32>) {
    let mut sel = Vec::with_capacity(n * n_used);
    for _ in 0..n {
        let mut e: Vec<i32> = (0..n_expert as i32).collect();
        for i in 0..n_used {
            let j = r.gen_range(i..e.len());
            e.swap(i, j);
        }
        sel.extend_from_slice(&e[..n_used]);
    }
    let wgt = (0..n * n_used).map(|_| r.gen_range(0.1..1.0)).collect();
    (sel, wgt)
}

/// Largest |a − b| / (1 + |b|) over two equal-length slices; panics on a length mismatch.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_nan() || y.is_nan() {
                f32::INFINITY
            } else {
                (x - y).abs() / (1.0 + y.abs())
            }
        })
        .fold(0.0, f32::max)
}

/// Assert `gpu` ≈ `cpu` within `tol` (relative to 1 + |cpu|), naming the op.
pub fn assert_close(op: &str, gpu: &[f32], cpu: &[f32], tol: f32) {
    let e = max_rel(gpu, cpu);
    println!(
        "{op}: max rel error {e:.3e} (tolerance {tol:.1e}) over {} values",
        cpu.len()
    );
    assert!(
        e <= tol,
        "{op}: GPU differs from the CPU reference by {e:.3e} > {tol:.1e}"
    );
}

/// A weight on both backends: (CPU, GPU).
pub type Pair = (
    <ds4_cpu::CpuBackend as ds4_backend::Backend>::Weight,
    <ds4_gpu::GpuBackend as ds4_backend::Backend>::Weight,
);

/// A `[experts, rows, cols]` weight of random valid rows of `ty`, bound on both backends.
pub fn weight(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    ty: GgmlType,
    cols: usize,
    rows: usize,
    experts: usize,
    seed: u64,
) -> Pair {
    use ds4_backend::Backend;
    let mut r = rng(seed);
    let bytes: Vec<u8> = (0..rows * experts)
        .flat_map(|_| ds4_gpu::conformance::random_row(ty, cols, &mut r))
        .collect();
    let mut dims = vec![cols as u64, rows as u64];
    if experts > 1 {
        dims.push(experts as u64);
    }
    let f = file(&[("w", ty, dims, bytes)]);
    (
        cpu.matrix(&src(&f, "w")).unwrap(),
        gpu.matrix(&src(&f, "w")).unwrap(),
    )
}

/// max |a - b| / (1 + rms(b)) (NaN: infinite).
pub fn max_rel_rms(a: &[f32], b: &[f32]) -> f32 {
    let rms = (b.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / b.len().max(1) as f64)
        .sqrt() as f32;
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_nan() || y.is_nan() {
                f32::INFINITY
            } else {
                (x - y).abs()
            }
        })
        .fold(0.0, f32::max)
        / (1.0 + rms)
}

/// Random experts `[ne][rows][cols]` of type `t`: (raw bytes, GPU weight).
pub fn random_experts(
    gpu: &GpuBackend,
    t: GgmlType,
    cols: usize,
    rows: usize,
    ne: usize,
    seed: u64,
) -> (Vec<u8>, <GpuBackend as ds4_backend::Backend>::Weight) {
    let mut rr = rng(seed);
    let bytes: Vec<u8> = (0..rows * ne)
        .flat_map(|_| ds4_gpu::conformance::random_row(t, cols, &mut rr))
        .collect();
    let w = experts_from_bytes(gpu, t, cols, rows, ne, &bytes);
    (bytes, w)
}

/// Experts `[ne][rows][cols]` of type `t` from their raw bytes, as a GPU weight.
pub fn experts_from_bytes(
    gpu: &GpuBackend,
    t: GgmlType,
    cols: usize,
    rows: usize,
    ne: usize,
    bytes: &[u8],
) -> <GpuBackend as ds4_backend::Backend>::Weight {
    use ds4_backend::Backend as _;
    let f = file(&[(
        "w",
        t,
        vec![cols as u64, rows as u64, ne as u64],
        bytes.to_vec(),
    )]);
    gpu.matrix(&src(&f, "w")).unwrap()
}
