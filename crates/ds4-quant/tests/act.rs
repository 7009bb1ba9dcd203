//! The optional activation-quantised path (`ds4_quant::act`).
//!
//! * Activation quantisers: model.md §5 formulas, per-element error ≤ |d|/2.
//! * Dot products: against an f64 reference `Σ dequant(w)_k · x̂_k` (x̂ = the dequantised
//!   activation). Integer parts are exact; each block adds ≤ 4 f32 roundings of terms bounded by
//!   B = Σ_k (|w_k| + 2|m_k|)·|x̂_k| (m_k = the K-quant min term, since the kernel forms
//!   `d·sc·Σq·x̂ − dmin·m·Σx̂` separately), plus the running sum: tolerance (nb + 8)·u·B·4.
//! * Against exact mode: |fast − exact| ≤ Σ|w_k|·|x_k − x̂_k| + both roundings (rigorous).
//! * AVX2 and portable paths are bit-identical.

mod common;

use common::{gaussian, random_row, rng};
use ds4_quant::act::{dot_act_isa, dot_row_act, matvec_act, ActFormat, QuantizedAct};
use ds4_quant::{dequantize_row, dot_row, quantize_row, GgmlType, Isa};
use rand::Rng;

const TYPES: [GgmlType; 4] = [
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
];
const U: f64 = 1.0 / 16_777_216.0;

fn deq(ty: GgmlType, row: &[u8], n: usize) -> Vec<f32> {
    let mut w = vec![0f32; n];
    dequantize_row(ty, row, &mut w).unwrap();
    w
}

/// `-m_k` per element: the row dequantised with all codes zeroed (K-quants), else zeros.
fn mins(ty: GgmlType, row: &[u8], n: usize) -> Vec<f32> {
    let mut r = row.to_vec();
    match ty {
        GgmlType::Q2_K => r.chunks_exact_mut(84).for_each(|b| b[16..80].fill(0)),
        GgmlType::Q4_K => r.chunks_exact_mut(144).for_each(|b| b[16..144].fill(0)),
        _ => return vec![0.0; n],
    }
    deq(ty, &r, n)
}

fn check(ty: GgmlType, row: &[u8], x: &[f32]) {
    let n = x.len();
    let a = QuantizedAct::for_weight(ty, x).unwrap();
    let xh = a.dequantize();
    let w = deq(ty, row, n);
    let m = mins(ty, row, n);
    let reference: f64 = w.iter().zip(&xh).map(|(&p, &q)| p as f64 * q as f64).sum();
    let b: f64 = (0..n)
        .map(|k| (w[k].abs() as f64 + 2.0 * m[k].abs() as f64) * xh[k].abs() as f64)
        .sum();
    let nb = n / a.format().block_elems();
    let tol = 4.0 * (nb + 8) as f64 * U * b + 1e-30;

    let port = dot_act_isa(ty, row, &a, Isa::Portable).unwrap();
    assert!(
        (port as f64 - reference).abs() <= tol,
        "{ty} n={n}: act dot {port:e} vs reference {reference:e}, tol {tol:e}"
    );
    for isa in Isa::available() {
        let v = dot_act_isa(ty, row, &a, isa).unwrap();
        assert_eq!(
            v.to_bits(),
            port.to_bits(),
            "{ty} {isa} n={n}: not bit-identical to portable"
        );
    }
    assert_eq!(dot_row_act(ty, row, &a).unwrap().to_bits(), port.to_bits());

    // Against exact mode: the activation rounding bounds the difference.
    let exact = dot_row(ty, row, x).unwrap() as f64;
    let mag: f64 = w
        .iter()
        .zip(x)
        .map(|(&p, &q)| (p as f64 * q as f64).abs())
        .sum();
    let act_err: f64 = (0..n)
        .map(|k| w[k].abs() as f64 * (x[k] - xh[k]).abs() as f64)
        .sum();
    let lim = act_err + tol + (n + 16) as f64 * U * mag * 1.01;
    assert!(
        (port as f64 - exact).abs() <= lim,
        "{ty} n={n}: |fast − exact| > {lim:e}"
    );
}

#[test]
fn act_dots_match_reference_and_exact_mode() {
    let mut r = rng(11);
    for ty in TYPES {
        let lengths: &[usize] = if ty == GgmlType::Q8_0 {
            &[32, 96, 160, 256, 4096 + 96] // block counts that are not multiples of 4 too
        } else {
            &[256, 512, 2048, 4096]
        };
        for &n in lengths {
            for _ in 0..3 {
                let row = random_row(&mut r, ty, n);
                let x: Vec<f32> = gaussian(&mut r, n).iter().map(|v| v * 3.0).collect();
                check(ty, &row, &x);
            }
            let wq = gaussian(&mut r, n);
            let mut row = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
            quantize_row(ty, &wq, &mut row).unwrap();
            let mut x = gaussian(&mut r, n);
            x[r.gen_range(0..n)] = 0.0;
            check(ty, &row, &x);
        }
    }
}

#[test]
fn q8_0_activation_quantiser() {
    let mut r = rng(12);
    let mut x = gaussian(&mut r, 128);
    x[32..64].fill(0.0);
    let a = QuantizedAct::new(ActFormat::Q8_0, &x).unwrap();
    assert_eq!(a.scales().len(), 4);
    assert_eq!(a.scales()[1], 0.0);
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = a.scales()[b];
        assert_eq!(d, amax / 127.0);
        for (k, &v) in xb.iter().enumerate() {
            let q = a.codes()[32 * b + k];
            assert!((-127..=127).contains(&q));
            assert!(
                (v - d * q as f32).abs() <= d * 0.5 * (1.0 + 1e-6),
                "block {b} elem {k}"
            );
        }
    }
}

#[test]
fn q8_k_activation_quantiser() {
    let mut r = rng(13);
    let mut x = gaussian(&mut r, 768);
    x[256..512].fill(0.0);
    x[7] = -9.0; // the largest magnitude of block 0 is negative
    let a = QuantizedAct::new(ActFormat::Q8_K, &x).unwrap();
    let d = a.scales();
    assert_eq!(d[1], 0.0);
    assert!(a.codes()[256..512].iter().all(|&q| q == 0));
    // iscale = −127/max, d = 1/iscale: the max element maps to −127, d has the opposite sign.
    assert_eq!(a.codes()[7], -127);
    assert!(d[0] > 0.0 && (d[0] - 9.0 / 127.0).abs() < 1e-7);
    for (b, xb) in x.chunks_exact(256).enumerate() {
        for (k, &v) in xb.iter().enumerate() {
            let q = a.codes()[256 * b + k];
            assert!((v - d[b] * q as f32).abs() <= d[b].abs() * 0.5 * (1.0 + 1e-6) + 1e-30);
        }
    }
    assert_eq!(a.dequantize().len(), 768);
}

#[test]
fn act_errors() {
    let x = vec![0.5f32; 256];
    let a8 = QuantizedAct::new(ActFormat::Q8_0, &x).unwrap();
    let ak = QuantizedAct::new(ActFormat::Q8_K, &x).unwrap();
    assert!(QuantizedAct::new(ActFormat::Q8_K, &x[..100]).is_err());
    assert!(QuantizedAct::for_weight(GgmlType::F16, &x).is_err());
    assert!(dot_row_act(GgmlType::Q2_K, &[0u8; 84], &a8).is_err());
    assert!(dot_row_act(GgmlType::Q8_0, &[0u8; 8 * 34], &ak).is_err());
    assert!(dot_row_act(GgmlType::Q2_K, &[0u8; 83], &ak).is_err());
    // A Q8_0 activation of 256 values has 8 blocks; the Q2_K kernel must never see it.
    for isa in Isa::available() {
        assert!(dot_act_isa(GgmlType::Q2_K, &[0u8; 84], &a8, isa).is_err());
        assert!(dot_act_isa(GgmlType::IQ2_XXS, &[0u8; 66], &a8, isa).is_err());
    }
    let mut y = [0f32; 2];
    assert!(matvec_act(GgmlType::Q2_K, &[0u8; 84 * 3], 2, &ak, &mut y).is_err());
    matvec_act(GgmlType::Q2_K, &[0u8; 84 * 2], 2, &ak, &mut y).unwrap();
}

#[test]
fn matvec_act_matches_rows() {
    let mut r = rng(14);
    for (ty, n, rows) in [(GgmlType::Q8_0, 4096, 300), (GgmlType::IQ2_XXS, 4096, 40)] {
        let rb = ty.row_bytes(n as u64).unwrap() as usize;
        let w: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut r, ty, n)).collect();
        let a = QuantizedAct::for_weight(ty, &gaussian(&mut r, n)).unwrap();
        let mut y = vec![0f32; rows];
        matvec_act(ty, &w, rows, &a, &mut y).unwrap();
        for (i, v) in y.iter().enumerate() {
            let d = dot_row_act(ty, &w[i * rb..(i + 1) * rb], &a).unwrap();
            assert_eq!(v.to_bits(), d.to_bits(), "{ty} row {i}");
        }
    }
}

/// The resolved kernel (`ActKernel`) gives `dot_row_act`'s bits; float types have none, and
/// on the portable path IQ2_XXS has none (exact mode is faster there).
#[test]
fn act_kernel_matches_dot_row_act() {
    use ds4_quant::act::ActKernel;
    let mut r = rng(77);
    for ty in TYPES {
        let Some(k) = ActKernel::new(ty) else {
            assert!(ty == GgmlType::IQ2_XXS && ds4_quant::active_isa() == Isa::Portable);
            continue;
        };
        assert_eq!(Some(k.format()), ActFormat::for_weight(ty));
        let x = gaussian(&mut r, 512);
        let a = QuantizedAct::for_weight(ty, &x).unwrap();
        let row = random_row(&mut r, ty, 512);
        assert_eq!(
            k.dot(&row, &a).to_bits(),
            dot_row_act(ty, &row, &a).unwrap().to_bits()
        );
    }
    assert!(ActKernel::new(GgmlType::F16).is_none());
    ds4_quant::set_force_portable(true);
    let (iq2, q2k) = (
        ActKernel::new(GgmlType::IQ2_XXS),
        ActKernel::new(GgmlType::Q2_K),
    );
    ds4_quant::set_force_portable(false);
    assert!(iq2.is_none() && q2k.is_some());
}
