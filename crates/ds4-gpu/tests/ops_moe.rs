//! Decode MoE kernels (model/moe.rs, gpu/moe.cu) against the CPU reference `moe_experts`:
//! the q2 mix (IQ2_XXS gate/up, Q2_K down), the q4 mix (Q4_K), a mixed one; n = 1..4 with
//! experts repeated across tokens (and once within a token); the clamp active and not; the
//! full-size shape (d 4096, ff 2048, 6 of 8 experts) and small odd ones, with several gate/up
//! row blocks (partial last blocks included). Checks that the decode kernels ran where they
//! cover the rows (16-byte multiples) and were declined elsewhere, and that two runs give
//! identical bits. The forms: v1 (rows staged in shared memory), v2 (direct loads, h in the
//! down kernel's lane order; n = 3, 4 through its two-token loop), v2 with several tile sizes
//! and its default ones, v3d (n = 1, IQ2_XXS gate/up and Q2_K down on tensor cores where the
//! device and shape allow, else v2; checked to have run at d 2048 and 4096, ff 2048, on CUDA
//! sm_80+; with its default and other tile counts; its 8 warps cover both raw-word alignments
//! of `m3_sub`; `moe_decode_hard_x`: x with one huge element per 256-column super-block, x = 0,
//! repeated experts in a token's selection). Skips with the reason when no GPU is present
//! (DS4_REQUIRE_GPU=1: fail). Run with --test-threads=1 on a GPU (process-wide switches).

mod common;

use common::{backends, max_rel, randn, random_routes, rng, weight};
use ds4_backend::{Backend, GgmlType, MoeSpec};
use ds4_gpu::GpuBackend;
use ds4_model::HParams;

/// ‖gpu − cpu‖ / ‖cpu‖ bound (the sums run in another order; f32 lands far under it, a wrong
/// index near 1). The element-wise max |gpu − cpu| / (1 + |cpu|) is printed too: without the
/// clamp, full-size outputs are large sums that cancel to near zero in places, where it reached
/// 1e-2 on an H200 (the older GPU paths show the same on the same data).
const TOL_L2: f32 = 1e-4;

/// ‖a − b‖ / ‖b‖ in f64.
fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = *x as f64 - *y as f64;
        num += if d.is_nan() { f64::INFINITY } else { d * d };
        den += (*y as f64) * (*y as f64);
    }
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

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
    // (d, ff, experts, slots, v1 gate/up rows per CTA, v2 row batches per CTA gate/up, down)
    let shapes = [
        (4096, 2048, 8, 6, 16, (2, 2)),
        (256, 256, 5, 3, 8, (1, 1)),
        (512, 768, 7, 2, 24, (3, 3)),
        (768, 512, 6, 4, 24, (4, 1)),   // ff 512: a partial last block
        (2048, 2048, 9, 5, 16, (3, 2)), // v3d: one stage a row, a last CTA of 2 tiles (of 3)
    ];
    let info = gpu.gpu().info();
    let tc = info.cc.0 >= 8 && info.warp == 32; // CUDA sm_80+: v3d runs
    let mut bad = Vec::new();
    let mut worst = [0f32; 4];
    for (si, &(d, ff, ne, k, rb, (nb, nbr))) in shapes.iter().enumerate() {
        GpuBackend::set_moe_gu_rows(rb);
        GpuBackend::set_moe_v2_tiles(nb, nbr);
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
                    let (mut sel, wgt) = random_routes(&mut r, n, ne, k);
                    if n == 3 && k > 1 {
                        sel[1] = sel[0];
                    }
                    let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
                    let mut co = cpu.alloc(n * d);
                    cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
                    let want = cpu.download(&co, n * d);
                    let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
                    // (form, v2 tiles); (0, 0): the default tiles.
                    let forms = [
                        (1usize, (nb, nbr)),
                        (2, (nb, nbr)),
                        (2, (0, 0)),
                        (3, (nb, nbr)),
                        (3, (0, 0)),
                        (4, (0, 0)),
                    ];
                    for (form, tiles) in forms {
                        GpuBackend::set_moe_form(form);
                        GpuBackend::set_moe_v2_tiles(tiles.0, tiles.1);
                        let mut got = Vec::new();
                        let runs = GpuBackend::moe_decode_runs();
                        let runs2 = GpuBackend::moe_v2_runs();
                        let runs3d = GpuBackend::moe_v3d_runs();
                        let runs3i = GpuBackend::moe_v3ip_runs();
                        for _ in 0..2 {
                            let mut go = gpu.upload(&vec![f32::NAN; n * d]);
                            gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
                            got.push(gpu.download(&go, n * d));
                        }
                        let name = format!(
                        "moe form {form} {tgu:?}/{td:?} d={d} ff={ff} k={k} n={n} clamp={clamp} rb={rb} tiles={tiles:?}"
                    );
                        if let Err(e) = gpu.check() {
                            println!("{name}: GPU error: {e}");
                            bad.push(format!("{name}: {e}"));
                            continue;
                        }
                        let ran = GpuBackend::moe_decode_runs() - runs;
                        let ran2 = GpuBackend::moe_v2_runs() - runs2;
                        let ran3d = GpuBackend::moe_v3d_runs() - runs3d;
                        let ran3i = GpuBackend::moe_v3ip_runs() - runs3i;
                        // IQ2_XXS rows of d < 2048 are not 16-byte multiples: declined (general path).
                        let covered = [(tgu, d), (td, ff)]
                            .iter()
                            .all(|&(t, c)| t.row_bytes(c as u64).unwrap() % 16 == 0);
                        let want_runs = if covered { 2 } else { 0 };
                        let want_v2 = if form >= 2 { want_runs } else { 0 };
                        // n = 2..4: each token's pairs as its one-token product (moe.cu
                        // m3gu_body / M3DN_TOK), at most 32 pairs.
                        let v3d_covers = tc
                            && n * k <= 32
                            && (tgu, td) == (GgmlType::IQ2_XXS, GgmlType::Q2_K)
                            && d % 2048 == 0
                            && ff == 2048;
                        // v3ip (form 4): v3d with the int8 down, where v3d runs.
                        let want_v3d = if form >= 3 && v3d_covers {
                            want_runs
                        } else {
                            0
                        };
                        let want_v3i = if form == 4 { want_v3d } else { 0 };
                        let l2 = rel_l2(&got[0], &want);
                        let e = max_rel(&got[0], &want);
                        let same = got[0]
                            .iter()
                            .zip(&got[1])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        // v3d / v3ip where it ran, else v2 (their fallback).
                        let wi = if form >= 3 && want_v3d == 0 {
                            1
                        } else {
                            form - 1
                        };
                        worst[wi] = worst[wi].max(l2);
                        println!(
                        "{name}: rel L2 {l2:.3e}, max rel {e:.3e}, decode runs {ran} (v2 {ran2}, v3d {ran3d}, v3ip {ran3i}), repeat identical {same}"
                    );
                        if l2.is_nan()
                            || l2 > TOL_L2
                            || ran != want_runs
                            || ran2 != want_v2
                            || ran3d != want_v3d
                            || ran3i != want_v3i
                            || !same
                        {
                            bad.push(format!(
                                "{name}: L2 {l2:.3e} ran {ran} v2 {ran2} v3d {ran3d} v3ip {ran3i} same {same}"
                            ));
                        }
                    }
                }
            }
        }
    }
    GpuBackend::set_moe_gu_rows(0);
    GpuBackend::set_moe_v2_tiles(0, 0);
    GpuBackend::set_moe_form(0);
    println!(
        "worst rel L2: v1 {:.3e}, v2 {:.3e}, v3d {:.3e}, v3ip {:.3e}",
        worst[0], worst[1], worst[2], worst[3]
    );
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
    let e = rel_l2(&gpu.download(&go, n * d), &cpu.download(&co, n * d));
    println!("declined Q8_0/F16: rel L2 {e:.3e}");
    assert!(!e.is_nan() && e <= TOL_L2);
}

/// v3d on hard x at the full size (d 4096, ff 2048, 6 of 8 experts, n = 1, q2 mix): one element
/// of 3e4 in every 256-column super-block (the other elements ~1: 15 bits below it), one huge
/// element in the whole vector, x = 0 (the output must be exactly 0), x ~1e-6, and a selection
/// that repeats experts (slots 0 and 1, 3 and 5). Same tolerance as above; v3d must have run
/// (CUDA sm_80+) and repeat bit for bit. (Written for the int8 forms of session 15, which lost
/// and were deleted: bench/results/gpu-moe-i15-h200.txt.) The same for the default form (0:
/// v3ip, the int8 down of session 16), which must have run.
#[test]
fn moe_decode_hard_x() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let info = gpu.gpu().info();
    let tc = info.cc.0 >= 8 && info.warp == 32;
    GpuBackend::set_moe_decode(true);
    GpuBackend::set_moe_gu_rows(0);
    GpuBackend::set_moe_v2_tiles(0, 0);
    let (d, ff, ne, k, n) = (4096, 2048, 8, 6, 1);
    let (cg, gg) = weight(&cpu, &gpu, GgmlType::IQ2_XXS, d, ff, ne, 41);
    let (cu, gu) = weight(&cpu, &gpu, GgmlType::IQ2_XXS, d, ff, ne, 42);
    let (cd, gd) = weight(&cpu, &gpu, GgmlType::Q2_K, ff, d, ne, 43);
    let mut r = rng(44);
    let base = randn(&mut r, d, 1.0);
    let mut per_block = base.clone();
    for b in 0..d / 256 {
        per_block[256 * b + (37 * b) % 256] = if b % 2 == 0 { 3e4 } else { -3e4 };
    }
    let mut one = base.clone();
    one[1234] = 3e4;
    let cases: [(&str, Vec<f32>, Vec<i32>); 5] = [
        ("huge per super-block", per_block, vec![0, 1, 2, 3, 4, 5]),
        ("one huge", one, vec![7, 2, 5, 0, 3, 1]),
        ("zero", vec![0.0; d], vec![0, 1, 2, 3, 4, 5]),
        ("repeated experts", base.clone(), vec![4, 4, 1, 6, 2, 6]),
        (
            "small",
            base.iter().map(|v| v * 1e-6).collect(),
            vec![1, 3, 5, 7, 0, 2],
        ),
    ];
    let wgt = vec![0.3f32, 0.2, 0.15, 0.15, 0.1, 0.1];
    let mut bad = Vec::new();
    for (what, z, sel) in cases {
        for (clamp, form) in [3usize, 0]
            .into_iter()
            .flat_map(|f| [(1e4f32, f), (10.0, f)])
        {
            GpuBackend::set_moe_form(form);
            let spec = MoeSpec {
                n_expert: ne,
                n_used: k,
                d,
                ff,
                weight_scale: 1.0,
                clamp,
            };
            let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
            let mut co = cpu.alloc(n * d);
            cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
            let want = cpu.download(&co, n * d);
            let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
            let runs3d = GpuBackend::moe_v3d_runs();
            let runs3i = GpuBackend::moe_v3ip_runs();
            let mut got = Vec::new();
            for _ in 0..2 {
                let mut go = gpu.upload(&vec![f32::NAN; n * d]);
                gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
                got.push(gpu.download(&go, n * d));
            }
            let fname = if form == 3 { "v3d" } else { "default (v3ip)" };
            let name = format!("hard x: {fname} {what} clamp={clamp}");
            if let Err(e) = gpu.check() {
                bad.push(format!("{name}: GPU error: {e}"));
                continue;
            }
            let ran = GpuBackend::moe_v3d_runs() - runs3d;
            let ran3i = GpuBackend::moe_v3ip_runs() - runs3i;
            let want_ran = if tc { 2 } else { 0 };
            let want_3i = if form == 0 { want_ran } else { 0 };
            let zero = want.iter().all(|v| *v == 0.0);
            // x = 0: the CPU's output is exactly zero; so must the GPU's be.
            let l2 = if zero {
                if got[0].iter().all(|v| *v == 0.0) {
                    0.0
                } else {
                    f32::INFINITY
                }
            } else {
                rel_l2(&got[0], &want)
            };
            let same = got[0]
                .iter()
                .zip(&got[1])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            println!("{name}: rel L2 {l2:.3e}, runs {ran}, repeat identical {same}");
            if l2.is_nan() || l2 > TOL_L2 || ran != want_ran || ran3i != want_3i || !same {
                bad.push(format!(
                    "{name}: L2 {l2:.3e} ran {ran} v3ip {ran3i} same {same}"
                ));
            }
        }
    }
    GpuBackend::set_moe_form(0);
    assert!(bad.is_empty(), "failing cases: {bad:#?}");
}

/// n = 2..4 tokens (speculative verify steps) in the default form: on CUDA sm_80+ with the q2
/// mix at the model's shape, the n = 1 v3ip kernels once per token, so every token's output is
/// bitwise the one it gets alone (its k slots, its x) and within TOL_L2 of the CPU; experts
/// repeated across tokens and once within a token. `set_moe_per_token(false)`: the v1 kernels
/// (TOL_L2). Elsewhere (other devices) the default runs and is checked against the CPU only.
#[test]
fn moe_decode_tokens_run_as_single_steps() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    GpuBackend::set_moe_decode(true);
    GpuBackend::set_moe_form(0);
    let info = gpu.gpu().info();
    let tc = info.cc.0 >= 8 && info.warp == 32;
    if !tc {
        println!("per-token form not checked: needs CUDA sm_80+ (this device: the default only)");
    }
    let (d, ff, ne, k) = (4096, 2048, 8, 6);
    let (cg, gg) = weight(&cpu, &gpu, GgmlType::IQ2_XXS, d, ff, ne, 3100);
    let (cu, gu) = weight(&cpu, &gpu, GgmlType::IQ2_XXS, d, ff, ne, 3101);
    let (cd, gd) = weight(&cpu, &gpu, GgmlType::Q2_K, ff, d, ne, 3102);
    let spec = MoeSpec {
        n_expert: ne,
        n_used: k,
        d,
        ff,
        weight_scale: 1.0,
        clamp: 0.3,
    };
    for n in 2..=4usize {
        let mut r = rng(3200 + n as u64);
        let z = randn(&mut r, n * d, 1.0);
        let (mut sel, wgt) = random_routes(&mut r, n, ne, k);
        sel[1] = sel[0]; // an expert twice in token 0
        let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
        let mut co = cpu.alloc(n * d);
        cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
        let want = cpu.download(&co, n * d);
        let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
        type Buf = <GpuBackend as Backend>::Buf;
        type IBuf = <GpuBackend as Backend>::IBuf;
        let run = |m: usize, z: &Buf, s: &IBuf, w: &Buf| {
            let mut go = gpu.upload(&vec![f32::NAN; m * d]);
            gpu.moe_experts(&spec, &gg, &gu, &gd, z, s, w, m, &mut go);
            gpu.download(&go, m * d)
        };
        let before = GpuBackend::moe_token_runs();
        let got = run(n, &gz, &gs, &gw);
        let ran = GpuBackend::moe_token_runs() - before;
        let l2 = rel_l2(&got, &want);
        println!("n {n}: default rel L2 {l2:.3e}, per-token runs {ran}");
        assert!(l2 <= TOL_L2, "n {n}: default form off the CPU: {l2:.3e}");
        if tc {
            assert_eq!(ran, 1, "n {n}: the per-token form did not run");
            for t in 0..n {
                let zt = gpu.upload(&z[t * d..(t + 1) * d]);
                let st = gpu.upload_i32(&sel[t * k..(t + 1) * k]);
                let wt = gpu.upload(&wgt[t * k..(t + 1) * k]);
                let one = run(1, &zt, &st, &wt);
                let same = one
                    .iter()
                    .zip(&got[t * d..(t + 1) * d])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "n {n}: token {t} differs from its single step");
            }
        }
        GpuBackend::set_moe_per_token(false);
        let before = GpuBackend::moe_token_runs();
        let old = run(n, &gz, &gs, &gw);
        GpuBackend::set_moe_per_token(true);
        assert_eq!(
            GpuBackend::moe_token_runs(),
            before,
            "n {n}: switch off ignored"
        );
        let l2 = rel_l2(&old, &want);
        println!("n {n}: v1 (per-token off) rel L2 {l2:.3e}");
        assert!(l2 <= TOL_L2, "n {n}: v1 off the CPU: {l2:.3e}");
    }
}
