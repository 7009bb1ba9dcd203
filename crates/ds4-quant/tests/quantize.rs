//! Quantise → dequantise round trips on Gaussian data, with a stated error bound per type.
//!
//! Bounds are on the relative RMS error ‖ŵ − w‖ / ‖w‖ over 64 blocks of N(0,1) data:
//! * F32 exact; F16 ≤ 2⁻¹¹ and BF16 ≤ 2⁻⁸ per element (relative, round to nearest).
//! * Q8_0: a uniform quantiser with step amax/127 (amax ≈ 2.1 for 32 samples) gives RMS
//!   step/√12 ≈ 0.005 (measured 0.0054); bound 0.007, and per element
//!   |err| ≤ d/2 + 127·|d − f16(d)|.
//! * Q4_K (16 levels per 32 weights, scale+min): step ≈ 4.2/15 → ≈ 0.08 for a plain min/max
//!   quantiser; the least-squares fit measures 0.071; bound 0.08.
//! * Q2_K (4 levels per 16 weights): the optimal 4-level quantiser of a Gaussian (Lloyd–Max)
//!   has relative RMS ≈ 0.34 per element; fitting each 16 separately does better (measured
//!   0.263); bound 0.30.
//! * IQ2_XXS (≈2.06 bits/weight, 256-point grid of 8-vectors, even sign parity): measured
//!   0.344, a little worse than Q2_K's 2.6 bits as expected; bound 0.38.

mod common;

use common::{gaussian, rng};
use ds4_quant::{dequantize_row, quantize_row, GgmlType};

fn round_trip(ty: GgmlType, w: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; ty.row_bytes(w.len() as u64).unwrap() as usize];
    quantize_row(ty, w, &mut q).unwrap();
    let mut out = vec![0f32; w.len()];
    dequantize_row(ty, &q, &mut out).unwrap();
    out
}

fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (e / n).sqrt()
}

#[test]
fn round_trip_error_is_within_the_stated_bound() {
    let mut r = rng(7);
    let w = gaussian(&mut r, 64 * 256);
    for (ty, limit) in [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 2f64.powi(-11)),
        (GgmlType::BF16, 2f64.powi(-8)),
        (GgmlType::Q8_0, 0.007),
        (GgmlType::Q4_K, 0.08),
        (GgmlType::Q2_K, 0.30),
        (GgmlType::IQ2_XXS, 0.38),
    ] {
        let out = round_trip(ty, &w);
        let e = rel_rms(&w, &out);
        eprintln!("{ty}: relative RMS error {e:.4} (bound {limit})");
        assert!(e <= limit, "{ty}: relative RMS error {e} > {limit}");
        // Scaling the input scales the output: the scales are really fitted per block.
        let big: Vec<f32> = w.iter().map(|v| v * 1000.0).collect();
        let e_big = rel_rms(&big, &round_trip(ty, &big));
        assert!(e_big <= limit.max(1e-9) * 1.05, "{ty} at ×1000: {e_big}");
    }
}

#[test]
fn per_element_bounds() {
    let mut r = rng(8);
    let w = gaussian(&mut r, 4096);
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let rel = if ty == GgmlType::F16 {
            2f32.powi(-11)
        } else {
            2f32.powi(-8)
        };
        for (a, b) in w.iter().zip(round_trip(ty, &w)) {
            // (N(0,1) samples are far above the f16 subnormal range except very near 0.)
            assert!((a - b).abs() <= rel * a.abs() + 6e-8, "{ty}: {a} -> {b}");
        }
    }
    let out = round_trip(GgmlType::Q8_0, &w);
    for (xb, ob) in w.chunks_exact(32).zip(out.chunks_exact(32)) {
        let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let d16 = half::f16::from_f32(d).to_f32();
        let lim = d / 2.0 + 127.0 * (d - d16).abs() + 1e-6;
        for (a, b) in xb.iter().zip(ob) {
            assert!((a - b).abs() <= lim, "Q8_0: {a} -> {b}, limit {lim}");
        }
    }
}

#[test]
fn zeros_and_constant_blocks() {
    for ty in ds4_quant::SUPPORTED {
        let z = vec![0f32; 512];
        assert!(round_trip(ty, &z).iter().all(|v| *v == 0.0), "{ty}: zeros");
        // A constant positive block is representable by the affine types' min/scale only
        // approximately; it must at least come back close.
        let c = vec![0.5f32; 512];
        let back = round_trip(ty, &c);
        let tol = if ty == GgmlType::IQ2_XXS || ty == GgmlType::Q2_K {
            0.2
        } else {
            0.01
        };
        assert!(
            back.iter().all(|v| (v - 0.5).abs() <= tol),
            "{ty}: constant -> {:?}",
            &back[..4]
        );
    }
}

#[test]
fn quantise_rejects_bad_lengths() {
    let mut out = vec![0u8; 143];
    let e = quantize_row(GgmlType::Q4_K, &[0.0; 256], &mut out).unwrap_err();
    assert!(
        e.to_string().contains("destination row") && e.to_string().contains("144"),
        "{e}"
    );
    assert!(quantize_row(GgmlType::Q8_0, &[0.0; 31], &mut [0u8; 34]).is_err());
    assert!(quantize_row(GgmlType::Q6_K, &[0.0; 256], &mut [0u8; 210]).is_err());
}

#[test]
fn non_finite_inputs_do_not_panic() {
    let mut x = vec![0.25f32; 512];
    x[3] = f32::NAN;
    x[300] = f32::INFINITY;
    x[301] = f32::NEG_INFINITY;
    for ty in ds4_quant::SUPPORTED {
        let mut q = vec![0u8; ty.row_bytes(512).unwrap() as usize];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut out = vec![0f32; 512];
        dequantize_row(ty, &q, &mut out).unwrap();
    }
}
