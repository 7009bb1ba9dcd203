//! Decode MoE kernels (model/moe.rs, gpu/moe.cu) against the CPU reference `moe_experts`:
//! the q2 mix (IQ2_XXS gate/up, Q2_K down), the q4 mix (Q4_K), a mixed one; n = 1..4 with
//! experts repeated across tokens (and once within a token); the clamp active and not; the
//! full-size shape (d 4096, ff 2048, 6 of 8 experts) and small odd ones, with several gate/up
//! row blocks (partial last blocks included). Checks that the decode kernels ran, and that two
//! runs give identical bits. Skips with the reason when no GPU is present (DS4_REQUIRE_GPU=1:
//! fail). Run with --test-threads=1 on a GPU (process-wide switches).

mod common;

use common::{backends, max_rel, randn, rng, weight};
use ds4_backend::{Backend, GgmlType, MoeSpec};
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use rand::Rng;

/// Relative to 1 + |cpu| (the sums run in another order); Q4_K's random scales and mins make
/// large cancelling terms, hence its looser bound (as ops_matmul.rs).
const TOL: f32 = 1e-4;
const TOL_Q4K: f32 = 4e-4;

#[test]
fn moe_decode_matches_cpu() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    GpuBackend::set_moe_decode(true);
    let mixes = [
        (GgmlType::IQ2_XXS, GgmlType::Q2_K),
        (GgmlType::Q4_K, GgmlType::Q4_K),
        (GgmlType::IQ2_XXS, GgmlType::Q4_K),
    ];
    // (d, ff, experts, slots, gate/up rows per CTA)
    let shapes = [
        (4096, 2048, 8, 6, 16),
        (256, 256, 5, 3, 16),
        (512, 768, 7, 2, 24),
        (768, 512, 6, 4, 8),
    ];
    let mut bad = Vec::new();
    let mut worst = 0f32;
    for (si, &(d, ff, ne, k, rb)) in shapes.iter().enumerate() {
        GpuBackend::set_moe_gu_rows(rb);
        for (mi, &(tgu, td)) in mixes.iter().enumerate() {
            if si == 0 && mi == 2 {
                continue; // full size: the two model mixes
            }
            let s = 1000 + 100 * si as u64 + 10 * mi as u64;
            let (cg, gg) = weight(&cpu, &gpu, tgu, d, ff, ne, s);
            let (cu, gu) = weight(&cpu, &gpu, tgu, d, ff, ne, s + 1);
            let (cd, gd) = weight(&cpu, &gpu, td, ff, d, ne, s + 2);
            for n in 1..=4 {
                for clamp in [1e4f32, 0.3] {
                    let spec = MoeSpec {
                        n_expert: ne,
                        n_used: k,
                        d,
                        ff,
                        weight_scale: 1.0,
                        clamp,
                    };
                    let mut r = rng(s + 7 * n as u64 + (clamp < 1.0) as u64);
                    let z = randn(&mut r, n * d, 1.0);
                    // Distinct experts within a token, repeated across tokens; n = 3 also repeats
                    // one within token 0.
                    let mut sel = Vec::new();
                    for _ in 0..n {
                        let mut e: Vec<i32> = (0..ne as i32).collect();
                        for i in 0..k {
                            let j = r.gen_range(i..e.len());
                            e.swap(i, j);
                        }
                        sel.extend_from_slice(&e[..k]);
                    }
                    if n == 3 && k > 1 {
                        sel[1] = sel[0];
                    }
                    let wgt: Vec<f32> = (0..n * k).map(|_| r.gen_range(0.1..1.0)).collect();
                    let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
                    let mut co = cpu.alloc(n * d);
                    cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
                    let want = cpu.download(&co, n * d);
                    let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
                    let mut got = Vec::new();
                    let runs = GpuBackend::moe_decode_runs();
                    for _ in 0..2 {
                        let mut go = gpu.upload(&vec![f32::NAN; n * d]);
                        gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
                        got.push(gpu.download(&go, n * d));
                    }
                    let name = format!(
                        "moe {tgu:?}/{td:?} d={d} ff={ff} k={k} n={n} clamp={clamp} rb={rb}"
                    );
                    if let Err(e) = gpu.check() {
                        println!("{name}: GPU error: {e}");
                        bad.push(format!("{name}: {e}"));
                        continue;
                    }
                    let ran = GpuBackend::moe_decode_runs() - runs;
                    let e = max_rel(&got[0], &want);
                    let same = got[0]
                        .iter()
                        .zip(&got[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    worst = worst.max(e);
                    println!("{name}: max rel {e:.3e}, decode runs {ran}, repeat identical {same}");
                    let tol = if tgu == GgmlType::Q4_K || td == GgmlType::Q4_K {
                        TOL_Q4K
                    } else {
                        TOL
                    };
                    if e > tol || ran != 2 || !same {
                        bad.push(format!("{name}: {e:.3e} ran {ran} same {same}"));
                    }
                }
            }
        }
    }
    GpuBackend::set_moe_gu_rows(16);
    println!("worst {worst:.3e}");
    assert!(bad.is_empty(), "failing cases: {bad:#?}");
}

/// Types the kernels do not cover are declined (the general path runs, still right).
#[test]
fn moe_decode_declines_other_types() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    GpuBackend::set_moe_decode(true);
    let (d, ff, ne, k, n) = (256, 256, 4, 2, 1);
    let spec = MoeSpec {
        n_expert: ne,
        n_used: k,
        d,
        ff,
        weight_scale: 1.0,
        clamp: 1e4,
    };
    let (cg, gg) = weight(&cpu, &gpu, GgmlType::Q8_0, d, ff, ne, 5);
    let (cu, gu) = weight(&cpu, &gpu, GgmlType::Q8_0, d, ff, ne, 6);
    let (cd, gd) = weight(&cpu, &gpu, GgmlType::F16, ff, d, ne, 7);
    let mut r = rng(8);
    let z = randn(&mut r, n * d, 1.0);
    let sel = vec![3, 1];
    let wgt = vec![0.5, 0.25];
    let mut co = cpu.alloc(n * d);
    let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
    cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
    let runs = GpuBackend::moe_decode_runs();
    let mut go = gpu.alloc(n * d);
    let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
    gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
    gpu.check().unwrap();
    assert_eq!(GpuBackend::moe_decode_runs(), runs);
    let e = max_rel(&gpu.download(&go, n * d), &cpu.download(&co, n * d));
    println!("declined Q8_0/F16: max rel {e:.3e}");
    assert!(e <= 1e-4);
}
