//! Dense prefill products through the vendor BLAS-Lt (model/blas.rs: cuBLASLt / hipBLASLt)
//! against the CPU reference: every covered weight type (F32, F16, BF16, Q8_0), Part::All and
//! Part::Expert, grouped products (4 groups, and the model's out_a: 8 groups of 4096 -> 1024),
//! a real shape (Q8_0 4096 -> 1024), n ∈ {5, 37, 64, 2048}. Each case in two forms: the default
//! (bf16 hi/lo terms laid along K: one product, three terms) held to ops_gemm's tolerance for
//! the GEMM's bf16 form (2e-3 relative to 1 + |cpu|), and `fast` (one bf16 product) held to
//! TOL_FAST relative to 1 + rms(cpu) (both operands rounded to bf16 once: ~2^-9 per term, so
//! the error scales with rms(y), not with each output). The warm product at open ran. Each case
//! checks that the library took the product (launch counter). The f16 form (`DS4_GPU_BLAS=f16`)
//! is held to f64 per output by its rounding model (blas_f16_against_f64). Forms are
//! process-wide: run with --test-threads=1 on a GPU.
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

/// Plans by token-count bucket (`DS4_GPU_BLAS_NBUCKET`, here the limit 64): products of 100 and
/// 300 rows take the algorithm found for 64 rows (cuBLASLt: the library's check accepts it;
/// counted), products of 37 rows the one for 64; each against the CPU in both forms, and
/// beside the same products with their own heuristic plans.
#[test]
fn blas_plans_by_bucket() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    let mut cases = Cases::default();
    for fast in [false, true] {
        GpuBackend::set_blas(true, fast);
        for (ty, cols, rows) in [
            (GgmlType::F16, 1024, 64),
            (GgmlType::Q8_0, 1024, 200),
            (GgmlType::F32, 512, 96),
        ] {
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 1, 40 + rows as u64);
            // 64 first (the bucket's own plan), then sizes that map to it.
            for n in [64, 100, 300, 37] {
                let x = randn(&mut rng(4000 + n as u64), n * cols, 1.0);
                let cx = cpu.upload(&x);
                let mut cy = cpu.alloc(n * rows);
                cpu.matmul(&cw, Part::All, &cx, n, &mut cy);
                let c = cpu.download(&cy, n * rows);
                let gx = gpu.upload(&x);
                let mut gy = gpu.alloc(n * rows);
                GpuBackend::set_blas_nbucket(Some(64));
                let (l0, like0) = (GpuBackend::blas_launches(), GpuBackend::blas_plans_like());
                gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
                let g = gpu.download(&gy, n * rows);
                let like = GpuBackend::blas_plans_like() - like0;
                // The same product with its own plan (bucketing off: a plan per n).
                GpuBackend::set_blas_nbucket(None);
                let mut oy = gpu.alloc(n * rows);
                gpu.matmul(&gw, Part::All, &gx, n, &mut oy);
                let own = gpu.download(&oy, n * rows);
                let d = max_rel(&g, &own);
                let key = format!("bucket 64 {ty:?} {cols}->{rows} n={n} fast={fast}");
                println!("{key}: plans like the bucket's {like}; vs own plan max rel {d:.3e}");
                // A new plan per (form, n != 64) on cuBLASLt (which has the check); 64 is the
                // bucket itself.
                let expect_like = n != 64 && gpu.gpu().info().vendor == Vendor::Nvidia;
                if expect_like && like == 0 {
                    cases
                        .bad
                        .push(format!("{key}: the bucket's algorithm was not taken"));
                }
                cases.check(key, fast, l0, &g, None, &c, &gpu);
            }
        }
    }
    GpuBackend::set_blas_nbucket(None);
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

/// The W' cache (DS4_GPU_BF16_CACHE) and X' sharing in multi-products (DS4_GPU_BLAS_XSHARE,
/// model/blas.rs) change no bits: matmul_multi (Q8_0 4096 -> 1024 and -> 512, F16 -> 256,
/// BF16 -> 128: parts 3, 3, 3, 2 in the default form) and matmul_gateup (Q8_0 -> 384 twice),
/// n = 64, in both forms, with each of cache off/on × sharing off/on: every output equal to the
/// plain form's bit for bit, and the plain form within the tolerance of the CPU (the gate/up
/// pair: its products, and its swiglu against the host's of the GPU's products). The counters
/// show the path taken: with the cache on a second pass converts no W', with sharing on a
/// multi converts X' once per layout. A weight made after one is dropped (the allocator may
/// hand out the same address) must not see the dropped weight's copy.
#[test]
fn blas_cache_and_shared_x_same_bits() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    let (k, n) = (4096, 64);
    let shapes = [
        (GgmlType::Q8_0, 1024),
        (GgmlType::Q8_0, 512),
        (GgmlType::F16, 256),
        (GgmlType::BF16, 128),
    ];
    let ws: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(ty, rows))| weight(&cpu, &gpu, ty, k, rows, 1, 500 + i as u64))
        .collect();
    let (cg, gg) = weight(&cpu, &gpu, GgmlType::Q8_0, k, 384, 1, 510);
    let (cu, gu) = weight(&cpu, &gpu, GgmlType::Q8_0, k, 384, 1, 511);
    let x = randn(&mut rng(512), n * k, 1.0);
    let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
    // CPU: each product of the multi.
    let mut want: Vec<Vec<f32>> = Vec::new();
    for ((cw, _), &(_, rows)) in ws.iter().zip(&shapes) {
        let mut cy = cpu.alloc(n * rows);
        cpu.matmul(cw, Part::All, &cx, n, &mut cy);
        want.push(cpu.download(&cy, n * rows));
    }
    let run = |gpu: &GpuBackend| -> Vec<Vec<f32>> {
        let mut ys: Vec<_> = shapes.iter().map(|&(_, r)| gpu.alloc(n * r)).collect();
        let gws: Vec<_> = ws.iter().map(|(_, g)| g).collect();
        let mut refs: Vec<_> = ys.iter_mut().collect();
        gpu.matmul_multi(&gws, &gx, n, &mut refs);
        let mut h = gpu.alloc(n * 384);
        gpu.matmul_gateup(&gg, &gu, &gx, n, 384, &mut h, 10.0);
        let mut out: Vec<_> = ys
            .iter()
            .zip(&shapes)
            .map(|(y, &(_, r))| gpu.download(y, n * r))
            .collect();
        out.push(gpu.download(&h, n * 384));
        out
    };
    let mut bad = Vec::new();
    for fast in [false, true] {
        GpuBackend::set_blas(true, fast);
        GpuBackend::set_bf16_cache(Some(false));
        GpuBackend::set_blas_xshare(false);
        let l0 = GpuBackend::blas_launches();
        let (w0, x0) = GpuBackend::blas_conversions();
        let plain = run(&gpu);
        let (w1, x1) = GpuBackend::blas_conversions();
        println!(
            "fast={fast} plain: {} products, {} W' and {} X' conversions",
            GpuBackend::blas_launches() - l0,
            w1 - w0,
            x1 - x0
        );
        if GpuBackend::blas_launches() - l0 != 6 || w1 - w0 != 6 || x1 - x0 != 6 {
            bad.push(format!(
                "fast={fast}: the plain form did not take 6 library products"
            ));
        }
        // The multi's products against the CPU; the gate/up pair through its two products
        // (each against the CPU) and the swiglu of the GPU's own g and u on the host (the
        // swiglu amplifies the products' rounding by the other factor: not a CPU tolerance).
        let (mut hg, mut hu) = (gpu.alloc(n * 384), gpu.alloc(n * 384));
        gpu.matmul(&gg, Part::All, &gx, n, &mut hg);
        gpu.matmul(&gu, Part::All, &gx, n, &mut hu);
        let (hg, hu) = (gpu.download(&hg, n * 384), gpu.download(&hu, n * 384));
        let host_h: Vec<f32> = hg
            .iter()
            .zip(&hu)
            .map(|(&g, &u)| {
                let g = g.min(10.0);
                g / (1.0 + (-g).exp()) * u.clamp(-10.0, 10.0)
            })
            .collect();
        let eh = max_rel(&plain[4], &host_h);
        println!("fast={fast} gate/up: max rel {eh:.3e} against the host swiglu of the GPU's g, u");
        if eh > 1e-4 {
            bad.push(format!(
                "fast={fast} gate/up: {eh:.3e} against the host swiglu"
            ));
        }
        let mut cgy = cpu.alloc(n * 384);
        for (name, cw, g) in [("gate", &cg, &hg), ("up", &cu, &hu)] {
            cpu.matmul(cw, Part::All, &cx, n, &mut cgy);
            let c = cpu.download(&cgy, n * 384);
            let (e, tol) = if fast {
                (max_rel_rms(g, &c), TOL_FAST)
            } else {
                (max_rel(g, &c), TOL)
            };
            println!("fast={fast} {name}: max rel {e:.3e} against the CPU");
            if e > tol {
                bad.push(format!("fast={fast} {name}: {e:.3e} against the CPU"));
            }
        }
        for (i, (g, c)) in plain.iter().zip(&want).enumerate() {
            let (e, tol) = if fast {
                (max_rel_rms(g, c), TOL_FAST)
            } else {
                (max_rel(g, c), TOL)
            };
            println!("fast={fast} product {i}: max rel {e:.3e} against the CPU");
            if e > tol {
                bad.push(format!("fast={fast} product {i}: {e:.3e} against the CPU"));
            }
        }
        for (cache, share) in [(true, false), (false, true), (true, true)] {
            GpuBackend::set_bf16_cache(Some(cache));
            GpuBackend::set_blas_xshare(share);
            for pass in 0..2 {
                let (w0, x0) = GpuBackend::blas_conversions();
                let got = run(&gpu);
                let (w1, x1) = GpuBackend::blas_conversions();
                // W': none on a cached pass; X': one per layout (parts 3 and 2 in the multi
                // in the default form, one in fast; one for the gate/up pair) when shared.
                let want_w = if cache { 0 } else { 6 };
                let want_x = if share {
                    if fast {
                        2
                    } else {
                        3
                    }
                } else {
                    6
                };
                let (dw, dx) = (w1 - w0, x1 - x0);
                let same = got.iter().zip(&plain).all(|(a, b)| {
                    a.iter()
                        .map(|v| v.to_bits())
                        .eq(b.iter().map(|v| v.to_bits()))
                });
                println!(
                    "fast={fast} cache={cache} share={share} pass {pass}: W' {dw}, X' {dx}, same bits: {same}"
                );
                if !same {
                    bad.push(format!(
                        "fast={fast} cache={cache} share={share}: bits differ"
                    ));
                }
                // A cached pass after the first may find copies made by an earlier setting.
                if (pass == 1 || !cache) && (dw != want_w || dx != want_x) {
                    bad.push(format!(
                        "fast={fast} cache={cache} share={share} pass {pass}: W' {dw} (want {want_w}), X' {dx} (want {want_x})"
                    ));
                }
            }
        }
        let (bytes, copies, declined) = gpu.bf16_cache_stats();
        println!("fast={fast}: {copies} copies, {bytes} bytes, {declined} declined");
        if copies != 6 {
            bad.push(format!("fast={fast}: {copies} W' copies, want 6"));
        }
    }
    // A new weight after a dropped one: never the old copy.
    GpuBackend::set_blas(true, true);
    GpuBackend::set_bf16_cache(Some(true));
    for seed in [600, 601, 602] {
        let (cw, gw) = weight(&cpu, &gpu, GgmlType::Q8_0, k, 512, 1, seed);
        let mut cy = cpu.alloc(n * 512);
        cpu.matmul(&cw, Part::All, &cx, n, &mut cy);
        let c = cpu.download(&cy, n * 512);
        let mut gy = gpu.alloc(n * 512);
        gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
        let e = max_rel_rms(&gpu.download(&gy, n * 512), &c);
        println!("fresh weight {seed}: max rel {e:.3e} (rms-relative)");
        if e > TOL_FAST {
            bad.push(format!("fresh weight {seed}: {e:.3e}: a stale copy?"));
        }
    }
    GpuBackend::set_bf16_cache(None);
    GpuBackend::set_blas_xshare(true);
    GpuBackend::set_blas(true, false);
    if let Err(e) = gpu.check() {
        bad.push(format!("GPU error: {e}"));
    }
    assert!(bad.is_empty(), "failed: {bad:?}");
}

/// Backend::matmul_add at n > 4 (the shared expert's down product added into the routed sum):
/// the add in the library's epilogue (beta 1) against the old form (product into scratch, then
/// add_f32; `DS4_GPU_BLAS_ACC=off`) bit for bit, in the default, fast and f16 forms (f16
/// declines: the old form runs), every covered type, and the CPU within the forms' tolerances.
/// Each case checks which form ran (counter). y holds other values than zero (the routed sum).
#[test]
fn blas_matmul_add_same_bits() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    let mut bad = Vec::new();
    for form in ["on", "fast", "f16"] {
        match form {
            "f16" => GpuBackend::set_blas_f16(),
            _ => GpuBackend::set_blas(true, form == "fast"),
        }
        // (type, cols, rows, n): small shapes, and the shared down (Q8_0 2048 -> 4096).
        let mut shapes: Vec<(GgmlType, usize, usize, usize)> = Vec::new();
        for &ty in TYPES {
            for n in [5usize, 64, 300] {
                shapes.push((ty, 512, 192, n));
            }
        }
        shapes.push((GgmlType::Q8_0, 2048, 4096, 256));
        for (si, &(ty, cols, rows, n)) in shapes.iter().enumerate() {
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 1, 500 + si as u64);
            let x = randn(&mut rng(600 + si as u64), n * cols, 1.0);
            let y0 = randn(&mut rng(700 + si as u64), n * rows, 2.0);
            let c = {
                let (cx, mut cy) = (cpu.upload(&x), cpu.upload(&y0));
                cpu.matmul_add(&cw, &cx, n, rows, &mut cy);
                cpu.download(&cy, n * rows)
            };
            let gx = gpu.upload(&x);
            let run = |acc: bool| {
                GpuBackend::set_blas_acc(acc);
                let mut gy = gpu.upload(&y0);
                let a0 = GpuBackend::blas_acc_launches();
                gpu.matmul_add(&gw, &gx, n, rows, &mut gy);
                let took = GpuBackend::blas_acc_launches() > a0;
                (gpu.download(&gy, n * rows), took)
            };
            let (new, took_new) = run(true);
            let (old, took_old) = run(false);
            GpuBackend::set_blas_acc(true);
            let name = format!("matmul_add {form} {ty:?} {cols}->{rows} n={n}");
            if let Err(e) = gpu.check() {
                bad.push(format!("{name}: GPU error {e}"));
                continue;
            }
            let diff = new
                .iter()
                .zip(&old)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            let (e, tol) = match form {
                "on" => (max_rel(&new, &c), TOL),
                _ => (max_rel_rms(&new, &c), TOL_FAST),
            };
            println!(
                "{name}: epilogue form {took_new}, {diff} values differ in bits from the old form, \
                 max rel to the CPU {e:.3e}"
            );
            if diff != 0 || e > tol || took_old || took_new != (form != "f16") {
                bad.push(format!(
                    "{name}: diff {diff}, err {e:.3e}, ran {took_new}/{took_old}"
                ));
            }
        }
    }
    GpuBackend::set_blas(true, false);
    assert!(bad.is_empty(), "failed cases: {bad:?}");
}

/// Q8_0 matrices held in the decode layout only (`GpuBackend::set_q8_decode_only`: the engine's
/// choice where the layout copies do not fit beside the blocks): the same device bytes as the
/// blocks alone, no copy counted, and every product the same bits as from the blocks: prompt
/// products through the library (W' converted from the decode layout, plain and interleaved
/// rows: 1024 and 4096 columns; dense and grouped; default, fast and f16 forms, f16 taking the
/// fast form there) and one- and two-token products by the decode kernels, which the default
/// (both layouts) runs too. With the library off the product is refused with an error that
/// says why, not run on blocks that are not there.
#[test]
fn blas_from_the_decode_layout_same_bits() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    // (cols, rows, groups): plain rows, interleaved rows, the model's out_a at a few rows.
    let shapes = [
        (1024usize, 512usize, 1usize),
        (4096, 256, 1),
        (4096, 8 * 64, 8),
    ];
    let mut bad = Vec::new();
    for (si, &(cols, rows, groups)) in shapes.iter().enumerate() {
        let seed = 900 + si as u64;
        // One upload of the same bytes per layout: blocks only, both, decode layout only.
        let upload = |copies: bool, dec_only: bool| {
            gpu.set_layout_copies(copies);
            gpu.set_q8_decode_only(dec_only);
            let (b0, l0) = (gpu.weight_bytes(), gpu.layout_bytes());
            let (_, w) = weight(&cpu, &gpu, GgmlType::Q8_0, cols, rows, 1, seed);
            (w, gpu.weight_bytes() - b0, gpu.layout_bytes() - l0)
        };
        let (blocks, bb, bl) = upload(false, false);
        let (both, tb, tl) = upload(true, false);
        let (dec, db, dl) = upload(true, true);
        gpu.set_layout_copies(true);
        gpu.set_q8_decode_only(false);
        println!(
            "{cols}x{rows}: weight / copy bytes: blocks {bb} / {bl}, both {tb} / {tl}, decode \
             layout only {db} / {dl}"
        );
        if !(bb == tb && tb == db && bl == 0 && tl == bb && dl == 0) {
            bad.push(format!(
                "{cols}x{rows}: bytes {bb}/{bl} {tb}/{tl} {db}/{dl}"
            ));
        }
        let prod = |w: &<GpuBackend as Backend>::Weight, n: usize| -> Vec<f32> {
            let x = randn(&mut rng(seed + 50 + n as u64), n * cols * groups, 1.0);
            let gx = gpu.upload(&x);
            let out = rows;
            let mut gy = gpu.alloc(n * out);
            if groups == 1 {
                gpu.matmul(w, Part::All, &gx, n, &mut gy);
            } else {
                gpu.matmul_grouped(w, groups, &gx, n, &mut gy);
            }
            gpu.download(&gy, n * out)
        };
        let differ = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count()
        };
        for form in ["on", "fast", "f16"] {
            match form {
                "f16" => GpuBackend::set_blas_f16(),
                _ => GpuBackend::set_blas(true, form == "fast"),
            }
            GpuBackend::set_bf16_cache(Some(false));
            let n = 37;
            let l0 = GpuBackend::blas_launches();
            let (a, b) = (prod(&dec, n), prod(&blocks, n));
            let took = GpuBackend::blas_launches() - l0;
            if let Err(e) = gpu.check() {
                bad.push(format!("{cols}x{rows} {form}: GPU error {e}"));
                continue;
            }
            // f16: the blocks take the f16 form, the decode layout the fast one: compare
            // with the fast form's product of the blocks instead.
            let b = if form == "f16" {
                GpuBackend::set_blas(true, true);
                prod(&blocks, n)
            } else {
                b
            };
            let d = differ(&a, &b);
            println!("{cols}x{rows} groups {groups} {form} n={n}: {d} of {} values differ from the blocks' product ({took} library products)", a.len());
            if d != 0 || took != 2 {
                bad.push(format!(
                    "{cols}x{rows} {form}: {d} differ, {took} library products"
                ));
            }
        }
        GpuBackend::set_blas(true, false);
        GpuBackend::set_bf16_cache(None);
        for n in [1usize, 2] {
            let (a, b) = (prod(&dec, n), prod(&both, n));
            let d = differ(&a, &b);
            println!(
                "{cols}x{rows} groups {groups} n={n}: {d} values differ from both layouts' product"
            );
            if d != 0 || gpu.check().is_err() {
                bad.push(format!("{cols}x{rows} n={n}: {d} differ"));
            }
        }
        // No library: the product needs the blocks, which are gone: an error, not garbage.
        GpuBackend::set_blas(false, false);
        let _ = prod(&dec, 37);
        let e = gpu.check();
        GpuBackend::set_blas(true, false);
        println!("{cols}x{rows} without the library: {e:?}");
        match e {
            Err(e) if e.contains("decode layout only") => {}
            other => bad.push(format!("{cols}x{rows} without the library: {other:?}")),
        }
        let _ = gpu.check();
    }
    GpuBackend::set_bf16_cache(None);
    assert!(bad.is_empty(), "failed cases: {bad:?}");
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

/// The f16 form's exponents, as blas_prep.cu picks them: s from max|x| (X' = x·2^s), u from a
/// Q8_0 weight's max|d| (W' = w·2^-u).
fn f16_exponents(x: &[f32], w: &[u8], ty: GgmlType, cols: usize) -> (i32, i32) {
    let mx = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    let s = 141 - ((mx >> 23) as i32).clamp(27, 254);
    let u = if ty == GgmlType::Q8_0 {
        let rb = ds4_quant::row_bytes(ty, cols).unwrap();
        let md = w
            .chunks_exact(rb)
            .flat_map(|row| row.chunks_exact(34))
            .map(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7fff)
            .max()
            .unwrap_or(0);
        ((md >> 10) as i32 - 22).max(0)
    } else {
        0
    };
    (s, u)
}

/// One f16-form case against f64: `groups` groups of `rows` rows × `cols` (or `experts` slabs of
/// `rows` × `cols`, product on the last), n tokens; token row 1 scaled by 1e4 and row 3 by 1e-6
/// (one product spans 10 decades), `big`: one Q8_0 block with d = 1000 (|q·d| up to 128000,
/// past f16's 65504: the weight is scaled by 2^-u). Returns (worst err/S on the ordinary rows,
/// worst err/S on the tiny row, worst err/bound); failures go to `bad`.
#[allow(clippy::too_many_arguments)]
fn f16_case(
    gpu: &GpuBackend,
    ty: GgmlType,
    cols: usize,
    rows: usize,
    groups: usize,
    experts: usize,
    n: usize,
    big: bool,
    seed: u64,
    bad: &mut Vec<String>,
) -> [f64; 3] {
    use rayon::prelude::*;
    let mut r = rng(seed);
    let all = rows * groups * experts;
    let rb = ds4_quant::row_bytes(ty, cols).unwrap();
    let mut bytes: Vec<u8> = (0..all)
        .flat_map(|_| ds4_gpu::conformance::random_row(ty, cols, &mut r))
        .collect();
    let last = (experts - 1) * rows * groups; // first row of the product's slab
    if big {
        // d = 1000.0 (f16 0x63d0) in block 3 of the slab's row 5.
        let o = (last + 5) * rb + 3 * 34;
        bytes[o..o + 2].copy_from_slice(&0x63d0u16.to_le_bytes());
    }
    let slab = &bytes[last * rb..(last + rows * groups) * rb];
    let mut w = vec![0f32; rows * groups * cols];
    for (row, out) in slab.chunks_exact(rb).zip(w.chunks_exact_mut(cols)) {
        ds4_quant::dequantize_row(ty, row, out).unwrap();
    }
    let mut dims = vec![cols as u64, (rows * groups) as u64];
    if experts > 1 {
        dims.push(experts as u64);
    }
    let f = common::file(&[("w", ty, dims, bytes.clone())]);
    let gw = gpu.matrix(&common::src(&f, "w")).unwrap();
    let kx = groups * cols;
    let mut x = randn(&mut rng(seed + 1), n * kx, 1.0);
    x[kx..2 * kx].iter_mut().for_each(|v| *v *= 1e4);
    x[3 * kx..4 * kx].iter_mut().for_each(|v| *v *= 1e-6);
    let (s, u) = f16_exponents(&x, slab, ty, cols);
    let gx = gpu.upload(&x);
    let ny = rows * groups;
    let mut gy = gpu.alloc(n * ny);
    let l0 = GpuBackend::blas_launches();
    if groups > 1 {
        gpu.matmul_grouped(&gw, groups, &gx, n, &mut gy);
    } else {
        let part = if experts > 1 {
            Part::Expert(experts - 1)
        } else {
            Part::All
        };
        gpu.matmul(&gw, part, &gx, n, &mut gy);
    }
    let y = gpu.download(&gy, n * ny);
    let name = format!(
        "f16 {ty:?} {groups}x{cols}->{ny} experts={experts} n={n} big={big} (s {s}, u {u})"
    );
    if let Err(e) = gpu.check() {
        bad.push(format!("{name}: GPU error {e}"));
        return [f64::INFINITY; 3];
    }
    if GpuBackend::blas_launches() == l0 {
        bad.push(format!("{name}: the library took no product"));
    }
    // Tokens checked: all for n ≤ 64, else the special rows, the last and 40 spread ones.
    let toks: Vec<usize> = if n <= 64 {
        (0..n).collect()
    } else {
        let mut t: Vec<usize> = (0..5).chain([n - 1]).collect();
        t.extend((0..40).map(|i| 5 + i * (n - 6) / 40));
        t
    };
    // Rounding model per output: each operand rounded once to f16 (relative 2^-11 when normal;
    // absolute half a subnormal step, 2^-25, in the scaled units: 2^-25·2^-s for x, 2^-25·2^u
    // for w), f32 accumulation over K (≤ K·2^-24 relative to S = Σ|w·x|, 2^-11 at K = 8192),
    // an exact power-of-two alpha: err ≤ 2^-9·S + 2^-25·(2^-s·Σ|w| + 2^u·Σ|x|)·(1 + 2^-10).
    let (es, et, eb) = toks
        .par_iter()
        .map(|&t| {
            let mut m = [0f64; 3];
            for jj in 0..ny {
                let z = jj / rows;
                let wr = &w[jj * cols..(jj + 1) * cols];
                let xr = &x[t * kx + z * cols..t * kx + (z + 1) * cols];
                let (mut e, mut sa, mut sw, mut sx) = (0f64, 0f64, 0f64, 0f64);
                for (&a, &b) in wr.iter().zip(xr) {
                    let (a, b) = (a as f64, b as f64);
                    e += a * b;
                    sa += (a * b).abs();
                    sw += a.abs();
                    sx += b.abs();
                }
                let bound = 2f64.powi(-9) * sa
                    + 2f64.powi(-25)
                        * (2f64.powi(-s) * sw + 2f64.powi(u) * sx)
                        * (1.0 + 2f64.powi(-10))
                    + 1e-30;
                let err = (y[t * ny + jj] as f64 - e).abs();
                let err = if err.is_finite() { err } else { f64::INFINITY };
                let rel = err / sa.max(1e-30);
                if t == 3 {
                    m[1] = m[1].max(rel);
                } else {
                    m[0] = m[0].max(rel);
                }
                m[2] = m[2].max(err / bound);
            }
            (m[0], m[1], m[2])
        })
        .reduce(
            || (0.0, 0.0, 0.0),
            |a, b| (a.0.max(b.0), a.1.max(b.1), a.2.max(b.2)),
        );
    println!(
        "{name}: err/S {es:.3e} (tiny row {et:.3e}), err/bound {eb:.3e}{}",
        if eb <= 1.0 { "" } else { " FAIL" }
    );
    if eb.is_nan() || eb > 1.0 {
        bad.push(format!("{name}: err/bound {eb:.3e}"));
    }
    [es, et, eb]
}

/// The f16 form (`DS4_GPU_BLAS=f16`, model/blas.rs) against f64 on the model's K (1024, 4096,
/// 8192) and n (5, 64, 2048): Q8_0 and F16 weights (an aligned F16 weight is read in place;
/// an expert slab at an unaligned offset is converted), a grouped product, a Q8_0 block with
/// d = 1000 (scaled path, no Inf), and token rows 10 decades apart in one product, each output
/// held to the rounding model's bound (f16_case). F32 and BF16 weights keep the three-term form
/// in this mode (checked against the CPU at TOL).
#[test]
fn blas_f16_against_f64() {
    let Some((cpu, gpu)) = blas_backends() else {
        return;
    };
    GpuBackend::set_blas_f16();
    let mut bad = Vec::new();
    let mut worst = [0f64; 3];
    let mut seed = 500;
    let mut cases: Vec<(GgmlType, usize, usize, usize, usize, usize, bool)> = Vec::new();
    for &(cols, rows) in &[(1024, 384), (4096, 256), (8192, 256)] {
        for &n in &[5, 64, 2048] {
            cases.push((GgmlType::Q8_0, cols, rows, 1, 1, n, false));
            cases.push((GgmlType::F16, cols, rows, 1, 1, n, false));
        }
        cases.push((GgmlType::Q8_0, cols, rows, 1, 1, 64, true));
    }
    // Grouped (the out_a form) and an F16 expert slab at an unaligned offset (101·2112 bytes).
    cases.push((GgmlType::Q8_0, 1024, 128, 4, 1, 64, false));
    cases.push((GgmlType::F16, 1056, 101, 1, 2, 37, false));
    for (ty, cols, rows, groups, experts, n, big) in cases {
        seed += 2;
        let m = f16_case(
            &gpu, ty, cols, rows, groups, experts, n, big, seed, &mut bad,
        );
        for i in 0..3 {
            worst[i] = worst[i].max(m[i]);
        }
    }
    // F32 / BF16 weights: the three-term form in this mode too.
    let mut rest = Cases::default();
    for ty in [GgmlType::F32, GgmlType::BF16] {
        let (cw, gw) = weight(&cpu, &gpu, ty, 1024, 200, 1, 77);
        let n = 64;
        let x = randn(&mut rng(78), n * 1024, 1.0);
        let cx = cpu.upload(&x);
        let mut cy = cpu.alloc(n * 200);
        cpu.matmul(&cw, Part::All, &cx, n, &mut cy);
        let c = cpu.download(&cy, n * 200);
        let gx = gpu.upload(&x);
        let mut gy = gpu.alloc(n * 200);
        let l0 = GpuBackend::blas_launches();
        gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
        let g = gpu.download(&gy, n * 200);
        rest.check(
            format!("f16 mode, {ty:?} (three-term form)"),
            false,
            l0,
            &g,
            None,
            &c,
            &gpu,
        );
    }
    println!(
        "f16 form worst: err/S {:.3e} (ordinary rows; one f16 rounding per operand ~2^-11 = \
         4.9e-4 per term), tiny rows (1e-10 of the product's max) {:.3e}, err/bound {:.3e}",
        worst[0], worst[1], worst[2]
    );
    bad.append(&mut rest.bad);
    GpuBackend::set_blas(true, false);
    assert!(bad.is_empty(), "failed cases: {bad:?}");
}
