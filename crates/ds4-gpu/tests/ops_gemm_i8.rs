//! Activation-quantised prefill experts (gemm_i8.rs / gpu/gemm_i8.cu, opt-in `DS4_GPU_ACT=q8k`)
//! against ds4_quant::act on the CPU: the Q8_K quantiser bit for bit (codes, scales, 16-code
//! sums; rows with ties of |x| of both signs, rounding ties, zeros and an all-zero block), the
//! IQ2_XXS gate/up (`gemmi8_iq2_xxs`) against `dot_row_act` per (pair, row) with uneven expert
//! loads (an expert with no pair, one with exactly one, one with two runs of 64) and a row count
//! that is not a multiple of the CTA's 128 rows, and the MoE hook: with the switch on the whole
//! routed-expert product takes the int8 kernel (launch counter) and stays near the exact CPU
//! result; with it off the kernel does not run. Skips with the reason when no GPU is present;
//! the int8 cases also skip (printed) off CUDA sm_80+. H200 (bench/results/gpu-gemm-i13-h200.txt):
//! quantiser 0 mismatches; gate/up 192,000 of 192,000 outputs bit-identical to `dot_row_act`
//! (held to 1e-6 relative); the int8 MoE 7.05e-2 of 1 + rms off the exact CPU result (exact
//! form: 4.4e-5).

mod common;

use common::{backends, max_rel_rms, randn, random_experts, rng, sm80};
use ds4_backend::{Backend, GgmlType, MoeSpec};
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use ds4_quant::act::{dot_row_act, ActFormat, QuantizedAct};
use rand::Rng;

#[test]
fn act_q8k_matches_cpu_bit_for_bit() {
    let Some((_cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let (n, k) = (9usize, 1024usize);
    let mut r = rng(1300);
    let mut x = randn(&mut r, n * k, 1.0);
    // Row 1: block 0 all zero; block 1 a single nonzero; block 2 the largest |x| twice, negative
    // first (the first one gives the sign); block 3 tiny values.
    x[k..k + 256].fill(0.0);
    x[k + 256..k + 512].fill(0.0);
    x[k + 256 + 77] = -0.25;
    x[k + 512 + 3] = -7.5;
    x[k + 512 + 200] = 7.5;
    for v in &mut x[k + 768..2 * k] {
        *v *= 1e-30;
    }
    // Row 2: max 127 (iscale -1): halves round to even; block 1 of -0.0 and 0.0.
    for (i, v) in x[2 * k..2 * k + 256].iter_mut().enumerate() {
        *v = (i as f32 - 128.0) * 0.5;
    }
    x[2 * k + 255] = 127.0;
    for (i, v) in x[2 * k + 256..2 * k + 512].iter_mut().enumerate() {
        *v = if i % 2 == 0 { -0.0 } else { 0.0 };
    }
    // Row 3: positive max first, equal negative later; large magnitudes.
    x[3 * k + 10] = 1e6;
    x[3 * k + 20] = -1e6;
    for v in &mut x[3 * k + 256..4 * k] {
        *v *= 1e5;
    }
    // Rows 4..: integer-ish values on a grid where ties occur after scaling.
    for v in &mut x[4 * k..] {
        *v = (*v * 8.0).round() / 4.0;
    }
    let gx = gpu.upload(&x);
    let (q, d, bs) = gpu.act_q8k_download(&gx, n, k);
    let mut bad = Vec::new();
    for t in 0..n {
        let a = QuantizedAct::new(ActFormat::Q8_K, &x[t * k..(t + 1) * k]).unwrap();
        let cq = a.codes();
        let gq = &q[t * k..(t + 1) * k];
        if let Some(i) = (0..k).find(|&i| cq[i] != gq[i]) {
            bad.push(format!("row {t}: code {i}: gpu {} cpu {}", gq[i], cq[i]));
        }
        for (b, cd) in a.scales().iter().enumerate() {
            let gd = d[t * (k / 256) + b];
            if gd.to_bits() != cd.to_bits() {
                bad.push(format!("row {t} block {b}: d gpu {gd:e} cpu {cd:e}"));
            }
        }
        for s in 0..k / 16 {
            let want: i16 = cq[16 * s..16 * s + 16].iter().map(|&c| c as i16).sum();
            if bs[t * (k / 16) + s] != want {
                bad.push(format!(
                    "row {t} sum {s}: gpu {} cpu {want}",
                    bs[t * (k / 16) + s]
                ));
            }
        }
    }
    println!("act_q8k: {n} rows x {k}: {} mismatches", bad.len());
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gate_up_i8_matches_act_reference() {
    let Some((_cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    if !sm80(&gpu) {
        println!("skipped: the int8 kernel needs CUDA sm_80+");
        return;
    }
    // 8 experts, 3 slots, 100 tokens: expert 0 never chosen, expert 1 by token 0 only, expert 2
    // by every token (100 pairs: runs of 64 and 36), the rest uneven at random.
    let (ne, k, n, d, ff) = (8usize, 3usize, 100usize, 1024usize, 320usize);
    let (gb, gw) = random_experts(&gpu, GgmlType::IQ2_XXS, d, ff, ne, 1310);
    let (ub, uw) = random_experts(&gpu, GgmlType::IQ2_XXS, d, ff, ne, 1311);
    let mut r = rng(1312);
    let z = randn(&mut r, n * d, 1.0);
    let mut sel = Vec::new();
    for t in 0..n {
        let mut e: Vec<i32> = (3..ne as i32).collect();
        for i in 0..2 {
            let j = r.gen_range(i..e.len());
            e.swap(i, j);
        }
        sel.extend_from_slice(&[2, e[0], if t == 0 { 1 } else { e[1] }]);
    }
    let (gz, gs) = (gpu.upload(&z), gpu.upload_i32(&sel));
    let rb = GgmlType::IQ2_XXS.row_bytes(d as u64).unwrap() as usize;
    // The CPU reference, per (pair, row), gate then up.
    let mut want = vec![Vec::new(), Vec::new()];
    for t in 0..n {
        let a = QuantizedAct::new(ActFormat::Q8_K, &z[t * d..(t + 1) * d]).unwrap();
        for s in 0..k {
            let e = sel[t * k + s] as usize;
            for (bytes, w) in [&gb, &ub].into_iter().zip(want.iter_mut()) {
                for row in 0..ff {
                    let o = (e * ff + row) * rb;
                    w.push(dot_row_act(GgmlType::IQ2_XXS, &bytes[o..o + rb], &a).unwrap());
                }
            }
        }
    }
    let l0 = GpuBackend::gemm_i8_launches();
    let (gy, uy) = gpu
        .moe_gate_up_i8_download(&gw, &uw, &gz, &gs, n, k, ne)
        .expect("int8 gate/up covers the product");
    assert_eq!(GpuBackend::gemm_i8_launches(), l0 + 1, "one gemmi8 launch");
    let (mut worst, mut exact) = (0f32, 0usize);
    let mut first_bad = None;
    for (y, w) in [&gy, &uy].into_iter().zip(&want) {
        for (i, (&got, &want)) in y.iter().zip(w).enumerate() {
            let err = (got - want).abs() / (1.0 + want.abs());
            let err = if got.is_nan() { f32::INFINITY } else { err };
            worst = worst.max(err);
            if err > 1e-6 && first_bad.is_none() {
                let (p, row) = (i / ff, i % ff);
                first_bad = Some(format!(
                    "pair {p} (token {}, expert {}) row {row}: gpu {got:e} cpu {want:e}",
                    p / k,
                    sel[p]
                ));
            }
            exact += (got.to_bits() == want.to_bits()) as usize;
        }
    }
    println!(
        "gemmi8_iq2_xxs vs dot_row_act: {} outputs, {exact} bit-identical, worst rel err {worst:e}",
        2 * n * k * ff
    );
    assert!(worst <= 1e-6, "{}", first_bad.unwrap_or_default());
}

#[test]
fn moe_hook_takes_int8_with_the_switch() {
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    if !sm80(&gpu) {
        println!("skipped: the int8 kernel needs CUDA sm_80+");
        return;
    }
    let spec = MoeSpec {
        n_expert: 16,
        n_used: 6,
        d: 1024,
        ff: 512,
        weight_scale: 1.0,
        clamp: 10.0,
    };
    let (cg, gg) = common::weight(&cpu, &gpu, GgmlType::IQ2_XXS, spec.d, spec.ff, 16, 1320);
    let (cu, gu) = common::weight(&cpu, &gpu, GgmlType::IQ2_XXS, spec.d, spec.ff, 16, 1321);
    let (cd, gd) = common::weight(&cpu, &gpu, GgmlType::Q2_K, spec.ff, spec.d, 16, 1322);
    let n = 128;
    let mut r = rng(1323);
    let z = randn(&mut r, n * spec.d, 1.0);
    let (sel, wgt) = common::random_routes(&mut r, n, spec.n_expert, spec.n_used);
    let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
    let mut co = cpu.alloc(n * spec.d);
    cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
    let want = cpu.download(&co, n * spec.d);
    let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
    let mut out = Vec::new();
    for on in [true, false] {
        GpuBackend::set_gemm_act_q8k(on);
        let l0 = GpuBackend::gemm_i8_launches();
        let mut go = gpu.alloc(n * spec.d);
        gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
        let got = gpu.download(&go, n * spec.d);
        let launches = GpuBackend::gemm_i8_launches() - l0;
        let err = max_rel_rms(&got, &want);
        println!("moe q2 n={n} act q8k {on}: gemmi8 launches {launches}, max err / (1 + rms) vs exact CPU {err:e}");
        assert_eq!(launches, u64::from(on), "switch {on}");
        out.push(err);
    }
    GpuBackend::set_gemm_act_q8k(false);
    // The exact form is held to 2e-3 in ops_gemm. The activation rounding (Q8_K: up to 1/254 of
    // a block's largest |z| per element) gave 7.05e-2 on the H200 with these seeds (the max over
    // 131,072 outputs of the gate/up error carried through SwiGLU and the down product); a
    // wrong tile or expert is O(1).
    assert!(
        out[0] < 0.1,
        "int8 MoE off the exact result by {:e}",
        out[0]
    );
    assert!(out[1] < 2e-3, "exact MoE off by {:e}", out[1]);
}
