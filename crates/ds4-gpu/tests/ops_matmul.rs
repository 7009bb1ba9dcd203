//! Weight products on the GPU (matmul, matmul_grouped, moe_experts) against the CPU reference:
//! every weight type on random valid blocks, n ∈ {1, 2, 7, 16, 33, 128}, Part::All and
//! Part::Expert, grouped products, and routed experts with experts repeated across tokens
//! (fused gate/up path and the separate-type fallback). Skips with the reason when no GPU is
//! present (DS4_REQUIRE_GPU=1: fail). Every case is run and printed before the assertion.
//! Each case runs in the three kernel forms (form 0 direct, 1 shared-memory tiles, 2 coalesced;
//! process-wide switches: run this binary with --test-threads=1 on a GPU so the tests do not
//! flip them under each other).
//!
//! Summation order differs from the CPU (warp-interleaved chunks), so results agree to f32
//! rounding of the dot products: held to TOL relative to 1 + |cpu|, TOL_Q4K where a Q4_K weight
//! is involved (random 6-bit scales and mins make large terms that cancel; measured on an H200:
//! worst 7.8e-5 with Q4_K, 2.0e-5 otherwise).

mod common;

use common::{backends, max_rel, randn, random_routes, rng, weight};
use ds4_backend::{Backend, GgmlType, MoeSpec, Part};
use ds4_gpu::GpuBackend;
use ds4_model::HParams;

const TOL: f32 = 5e-5;
const TOL_Q4K: f32 = 2e-4;

const TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
];

const NS: &[usize] = &[1, 2, 7, 16, 33, 128];

/// Records every case, asserts once at the end.
#[derive(Default)]
struct Cases {
    bad: Vec<String>,
    worst: f32,
}

impl Cases {
    fn check(&mut self, name: String, g: &[f32], c: &[f32], gpu: &GpuBackend) {
        if let Err(e) = gpu.check() {
            println!("{name}: GPU error: {e}");
            self.bad.push(format!("{name}: {e}"));
            return;
        }
        let e = max_rel(g, c);
        self.worst = self.worst.max(e);
        let tol = if name.contains("Q4_K") { TOL_Q4K } else { TOL };
        println!("{name}: max rel {e:.3e}");
        if e > tol {
            self.bad.push(format!("{name}: {e:.3e}"));
        }
    }

    fn finish(self) {
        println!(
            "worst {:.3e} (tolerance {TOL:.0e}, {TOL_Q4K:.0e} with Q4_K)",
            self.worst
        );
        assert!(self.bad.is_empty(), "failed cases: {:?}", self.bad);
    }
}

#[test]
fn matmul_every_type_and_n() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for form in 0..3 {
        let tiles = form == 1;
        GpuBackend::set_matmul_tiles(tiles);
        GpuBackend::set_matmul_coalesced(form == 2);
        // These tests hold the general kernels of matmul.rs: the decode (matvec.rs) and prefill
        // (gemm.rs) fast paths, which would take these products first, have their own tests.
        GpuBackend::set_matvec(false);
        GpuBackend::set_gemm(false, false);
        GpuBackend::set_blas(false, false);
        for (ti, &ty) in TYPES.iter().enumerate() {
            // 3 experts of 72 rows × 1024 columns; Part::All uses the first slab.
            let (cols, rows) = (1024, 72);
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 3, 100 + ti as u64);
            for &n in NS {
                let mut r = rng(1000 + n as u64);
                let x = randn(&mut r, n * cols, 1.0);
                for part in [Part::All, Part::Expert(2)] {
                    let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
                    let (mut cy, mut gy) = (cpu.alloc(n * rows), gpu.alloc(n * rows));
                    cpu.matmul(&cw, part, &cx, n, &mut cy);
                    gpu.matmul(&gw, part, &gx, n, &mut gy);
                    cases.check(
                        format!("matmul {ty:?} n={n} {part:?} form={form}"),
                        &gpu.download(&gy, n * rows),
                        &cpu.download(&cy, n * rows),
                        &gpu,
                    );
                }
            }
        }
        // A decode-sized shape with few rows (K split inside the CTA).
        for (ti, &ty) in TYPES.iter().enumerate() {
            let (cols, rows) = (4096, 40);
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 1, 200 + ti as u64);
            for n in [1, 9] {
                let x = randn(&mut rng(7), n * cols, 1.0);
                let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
                let (mut cy, mut gy) = (cpu.alloc(n * rows), gpu.alloc(n * rows));
                cpu.matmul(&cw, Part::All, &cx, n, &mut cy);
                gpu.matmul(&gw, Part::All, &gx, n, &mut gy);
                cases.check(
                    format!("matmul {ty:?} 4096x{rows} n={n} form={form}"),
                    &gpu.download(&gy, n * rows),
                    &cpu.download(&cy, n * rows),
                    &gpu,
                );
            }
        }
    }
    cases.finish();
}

#[test]
fn matmul_grouped_every_type() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    let (groups, cols, rows) = (4, 512, 64); // 16 rows per group
    for form in 0..3 {
        let tiles = form == 1;
        GpuBackend::set_matmul_tiles(tiles);
        GpuBackend::set_matmul_coalesced(form == 2);
        // These tests hold the general kernels of matmul.rs: the decode (matvec.rs) and prefill
        // (gemm.rs) fast paths, which would take these products first, have their own tests.
        GpuBackend::set_matvec(false);
        GpuBackend::set_gemm(false, false);
        GpuBackend::set_blas(false, false);
        for (ti, &ty) in TYPES.iter().enumerate() {
            let (cw, gw) = weight(&cpu, &gpu, ty, cols, rows, 1, 300 + ti as u64);
            for &n in NS {
                let x = randn(&mut rng(n as u64), n * groups * cols, 1.0);
                let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
                let (mut cy, mut gy) = (cpu.alloc(n * rows), gpu.alloc(n * rows));
                cpu.matmul_grouped(&cw, groups, &cx, n, &mut cy);
                gpu.matmul_grouped(&gw, groups, &gx, n, &mut gy);
                cases.check(
                    format!("grouped {ty:?} n={n} form={form}"),
                    &gpu.download(&gy, n * rows),
                    &cpu.download(&cy, n * rows),
                    &gpu,
                );
            }
        }
    }
    cases.finish();
}

#[test]
fn moe_experts_repeated_experts() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for form in 0..3 {
        let tiles = form == 1;
        GpuBackend::set_matmul_tiles(tiles);
        GpuBackend::set_matmul_coalesced(form == 2);
        // These tests hold the general kernels of matmul.rs: the decode (matvec.rs) and prefill
        // (gemm.rs) fast paths, which would take these products first, have their own tests.
        GpuBackend::set_matvec(false);
        GpuBackend::set_gemm(false, false);
        GpuBackend::set_blas(false, false);
        // d 2048: IQ2_XXS rows are 528 bytes (16-byte aligned, tile kernels); d 256: 66 (direct).
        for d in [256, 2048] {
            let spec = MoeSpec {
                n_expert: 8,
                n_used: 3,
                d,
                ff: 512,
                weight_scale: 1.0,
                clamp: 0.05,
            };
            // (gate, up, down): the model's q2 mix (fused gate/up), the q4 down, and mixed gate/up types
            // (the separate-product fallback).
            let mixes = [
                (GgmlType::IQ2_XXS, GgmlType::IQ2_XXS, GgmlType::Q2_K),
                (GgmlType::IQ2_XXS, GgmlType::IQ2_XXS, GgmlType::Q4_K),
                (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::F16),
                (GgmlType::F16, GgmlType::Q8_0, GgmlType::BF16),
            ];
            for (mi, &(tg, tu, td)) in mixes.iter().enumerate() {
                let s = 400 + 10 * mi as u64 + d as u64;
                let (cg, gg) = weight(&cpu, &gpu, tg, spec.d, spec.ff, spec.n_expert, s);
                let (cu, gu) = weight(&cpu, &gpu, tu, spec.d, spec.ff, spec.n_expert, s + 1);
                let (cd, gd) = weight(&cpu, &gpu, td, spec.ff, spec.d, spec.n_expert, s + 2);
                for n in [1, 2, 7, 33] {
                    let mut r = rng(s + n as u64);
                    let z = randn(&mut r, n * spec.d, 1.0);
                    // Distinct experts within a token, repeated across tokens.
                    let (sel, wgt) = random_routes(&mut r, n, spec.n_expert, spec.n_used);
                    let mut outs = Vec::new();
                    {
                        let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
                        let mut co = cpu.alloc(n * spec.d);
                        cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
                        outs.push(cpu.download(&co, n * spec.d));
                    }
                    {
                        let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
                        let mut go = gpu.alloc(n * spec.d);
                        gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
                        outs.push(gpu.download(&go, n * spec.d));
                    }
                    cases.check(
                        format!("moe {tg:?}/{tu:?}/{td:?} d={d} n={n} form={form}"),
                        &outs[1],
                        &outs[0],
                        &gpu,
                    );
                }
            }
        }
    }
    cases.finish();
}
