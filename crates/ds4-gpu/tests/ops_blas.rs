//! Dense prefill products through the vendor BLAS-Lt (model/blas.rs: cuBLASLt / hipBLASLt)
//! against the CPU reference: every covered weight type (F32, F16, BF16, Q8_0), Part::All and
//! Part::Expert, grouped products (4 groups, and the model's out_a: 8 groups of 4096 -> 1024),
//! a real shape (Q8_0 4096 -> 1024), n ∈ {5, 37, 64, 2048}. Each case in two forms: the default
//! (bf16 hi/lo terms laid along K: one product, three terms) held to ops_gemm's tolerance for
//! the GEMM's bf16 form (2e-3 relative to 1 + |cpu|), and `fast` (one bf16 product) held to
//! TOL_FAST relative to 1 + rms(cpu) (both operands rounded to bf16 once: ~2^-9 per term, so
//! the error scales with rms(y), not with each output). The warm product at open ran. Each case
//! checks that the library took the product (launch counter). Forms are process-wide: run with
//! --test-threads=1 on a GPU.
//! Without a GPU the device tests skip with the reason; with a GPU but no library they skip
//! saying what was searched. The host test (runs anywhere) checks the loader's failure line.

mod common;

use common::{backends, max_rel, max_rel_rms, randn, rng, weight};
use ds4_backend::{Backend, GgmlType, Part};
use ds4_gpu::blas::{decline_line, BlasLt};
use ds4_gpu::runtime::Vendor;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;

/// Default form: the GEMM's bf16 hi/lo tolerance (ops_gemm TOL_TC).
const TOL: f32 = 2e-3;
/// Fast form (one bf16 product), relative to 1 + rms(cpu): measured up to 1.5e-2 on the H200
/// (bench/results/gpu-blas-b-h200.txt).
const TOL_FAST: f32 = 3e-2;

const TYPES: &[GgmlType] = &[GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0];
const NS: &[usize] = &[5, 37, 64, 2048];

#[derive(Default)]
struct Cases {
    bad: Vec<String>,
    /// Worst error: default form, fast form, the built-in GEMM on the default form's cases.
    worst: [f32; 3],
}

impl Cases {
    /// `gemm`: the built-in GEMM's result for the same case (default form), for comparison.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &mut self,
        name: String,
        fast: bool,
        l0: u64,
        g: &[f32],
        gemm: Option<Vec<f32>>,
        c: &[f32],
        gpu: &GpuBackend,
    ) {
        if let Err(e) = gpu.check() {
            println!("{name}: GPU error: {e}");
            self.bad.push(format!("{name}: {e}"));
            return;
        }
        let took = GpuBackend::blas_launches() > l0;
        let (e, tol) = if fast {
            (max_rel_rms(g, c), TOL_FAST)
        } else {
            (max_rel(g, c), TOL)
        };
        self.worst[fast as usize] = self.worst[fast as usize].max(e);
        let ge = gemm.map(|v| max_rel(&v, c));
        if let Some(ge) = ge {
            self.worst[2] = self.worst[2].max(ge);
        }
        println!(
            "{name}: max rel {e:.3e}{}{}{}",
            if fast { " (rms-relative)" } else { "" },
            ge.map_or(String::new(), |ge| format!(" (built-in GEMM {ge:.3e})")),
            if took { "" } else { " (BLAS NOT USED)" }
        );
        if e > tol || !took {
            self.bad.push(format!("{name}: {e:.3e} blas={took}"));
        }
    }

    fn finish(self) {
        println!(
            "worst: default {:.3e} (tolerance {TOL:.0e}), fast {:.3e} (rms-relative, {TOL_FAST:.0e}); \
             built-in GEMM on the default form's cases {:.3e}",
            self.worst[0], self.worst[1], self.worst[2]
        );
        GpuBackend::set_blas(true, false);
        assert!(self.bad.is_empty(), "failed cases: {:?}", self.bad);
    }
}

/// Backends with the library loaded, or None with the reason printed.
fn blas_backends() -> Option<(ds4_cpu::CpuBackend, GpuBackend)> {
    let (cpu, gpu) = backends(&HParams::tiny())?;
    if !gpu.blas_available() {
        println!("skipped: the BLAS-Lt library did not load (line above says what was searched)");
        return None;
    }
    Some((cpu, gpu))
}

#[test]
fn blas_dense_every_type_and_n() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    // The library's one-time set-up ran when the backend was made (model/blas.rs blas_warm).
    assert!(
        gpu.blas_warmed(),
        "no warm product when the library was opened"
    );
    let mut cases = Cases::default();
    let mut want = std::collections::HashMap::new();
    for fast in [false, true] {
        GpuBackend::set_blas(true, fast);
        for (ti, &ty) in TYPES.iter().enumerate() {
            // 3 experts of 200 rows × 1024 columns.
            let (cols, rows) = (1024, 200);
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 3, 100 + ti as u64);
            for &n in NS {
                let x = randn(&mut rng(1000 + n as u64), n * cols, 1.0);
                for part in [Part::All, Part::Expert(2)] {
                    let key = format!("matmul {ty:?} n={n} {part:?}");
                    let c: &Vec<f32> = want.entry(key.clone()).or_insert_with(|| {
                        let cx = cpu.upload(&x);
                        let mut cy = cpu.alloc(n * rows);
                        cpu.matmul(&cw, part, &cx, n, &mut cy);
                        cpu.download(&cy, n * rows)
                    });
                    let gx = gpu.upload(&x);
                    let mut gy = gpu.alloc(n * rows);
                    let l0 = GpuBackend::blas_launches();
                    gpu.matmul(&gw, part, &gx, n, &mut gy);
                    let g = gpu.download(&gy, n * rows);
                    let gemm = (!fast).then(|| {
                        GpuBackend::set_blas(false, false);
                        gpu.matmul(&gw, part, &gx, n, &mut gy);
                        GpuBackend::set_blas(true, false);
                        gpu.download(&gy, n * rows)
                    });
                    cases.check(format!("{key} fast={fast}"), fast, l0, &g, gemm, c, &gpu);
                }
            }
        }
        // Real shape: attention q_a, Q8_0 4096 -> 1024.
        let (cw, gw) = weight(&cpu, &gpu, GgmlType::Q8_0, 4096, 1024, 1, 7);
        let n = 256;
        let x = randn(&mut rng(8), n * 4096, 1.0);
        let c: &Vec<f32> = want.entry("q_a".into()).or_insert_with(|| {
            let cx = cpu.upload(&x);
            let mut cy = cpu.alloc(n * 1024);
            cpu.matmul(&cw, Part::All, &cx, n, &mut cy);
            cpu.download(&cy, n * 1024)
        });
        let gx = gpu.upload(&x);
        let mut gy = gpu.alloc(n * 1024);
        let l0 = GpuBackend::blas_launches();
        gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
        let g = gpu.download(&gy, n * 1024);
        let gemm = (!fast).then(|| {
            GpuBackend::set_blas(false, false);
            gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
            GpuBackend::set_blas(true, false);
            gpu.download(&gy, n * 1024)
        });
        cases.check(
            format!("matmul Q8_0 4096x1024 n={n} fast={fast}"),
            fast,
            l0,
            &g,
            gemm,
            c,
            &gpu,
        );
    }
    // Off: the library takes nothing (the GEMM runs).
    GpuBackend::set_blas(false, false);
    let (_, gw) = weight(&cpu, &gpu, GgmlType::Q8_0, 256, 64, 1, 9);
    let gx = gpu.upload(&randn(&mut rng(9), 64 * 256, 1.0));
    let mut gy = gpu.alloc(64 * 64);
    let l0 = GpuBackend::blas_launches();
    gpu.matmul(&gw, Part::All, &gx, 64, &mut gy);
    gpu.download(&gy, 1);
    if GpuBackend::blas_launches() != l0 {
        cases
            .bad
            .push("DS4_GPU_BLAS=off still took a product".into());
    }
    cases.finish();
}

#[test]
fn blas_grouped_every_type() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    let mut cases = Cases::default();
    let mut want = std::collections::HashMap::new();
    for fast in [false, true] {
        GpuBackend::set_blas(true, fast);
        // (type, groups, cols, rows): small groups, and the model's out_a.
        let mut shapes: Vec<(GgmlType, usize, usize, usize)> =
            TYPES.iter().map(|&t| (t, 4, 512, 4 * 80)).collect();
        shapes.push((GgmlType::Q8_0, 8, 4096, 8 * 1024));
        for (si, &(ty, groups, cols, rows)) in shapes.iter().enumerate() {
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 1, 300 + si as u64);
            let ns: &[usize] = if cols == 4096 { &[64] } else { NS };
            for &n in ns {
                let x = randn(&mut rng(n as u64), n * groups * cols, 1.0);
                let key = format!("grouped {ty:?} {groups}x{cols}->{rows} n={n}");
                let c: &Vec<f32> = want.entry(key.clone()).or_insert_with(|| {
                    let cx = cpu.upload(&x);
                    let mut cy = cpu.alloc(n * rows);
                    cpu.matmul_grouped(&cw, groups, &cx, n, &mut cy);
                    cpu.download(&cy, n * rows)
                });
                let gx = gpu.upload(&x);
                let mut gy = gpu.alloc(n * rows);
                let l0 = GpuBackend::blas_launches();
                gpu.matmul_grouped(&gw, groups, &gx, n, &mut gy);
                let g = gpu.download(&gy, n * rows);
                let gemm = (!fast).then(|| {
                    GpuBackend::set_blas(false, false);
                    gpu.matmul_grouped(&gw, groups, &gx, n, &mut gy);
                    GpuBackend::set_blas(true, false);
                    gpu.download(&gy, n * rows)
                });
                cases.check(format!("{key} fast={fast}"), fast, l0, &g, gemm, c, &gpu);
            }
        }
    }
    cases.finish();
}

/// Host test (no GPU, no library needed): a failed load lists every place searched, in the
/// one line the backend prints before falling back to the built-in GEMM.
#[test]
fn loader_failure_lists_what_it_searched() {
    for (vendor, file, next) in [
        (
            Vendor::Nvidia,
            "/nonexistent-ds4/libcublasLt.so.13",
            "libcublasLt.so.12",
        ),
        (
            Vendor::Amd,
            "/nonexistent-ds4/libhipblaslt.so.1",
            "libhipblaslt.so.0",
        ),
    ] {
        match BlasLt::open(vendor, Some(file.into())) {
            Ok(lt) => println!(
                "skipped for {vendor:?}: the library is installed here ({})",
                lt.lib.path.display()
            ),
            Err(e) => {
                let line = decline_line(vendor, &e);
                println!("{line}");
                let name = if vendor == Vendor::Nvidia {
                    "cuBLASLt"
                } else {
                    "hipBLASLt"
                };
                assert!(line.starts_with(&format!("ds4: {name} not found (searched ")));
                assert!(line.contains(&format!("{file} (absent)")), "{line}");
                assert!(line.contains(next), "{line}");
                assert!(line.contains("system loader"), "{line}");
                assert!(line.ends_with("dense prefill products use the built-in GEMM"));
                assert!(!line.contains('\n'));
            }
        }
    }
}
