//! Dot products: every ISA path against an f64 reference of `dequantize_row` and against each
//! other, on random valid rows of several lengths; `matvec` against per-row dots.
//!
//! Tolerance. Every path forms exactly the dequantised weights (or the exact products
//! `d·(q·x)`-style rescalings of them) and differs only in how the `n` products are summed. Each
//! term passes through at most `n + 16` f32 roundings (one product/FMA, at most `n` accumulations
//! in any lane order, a block rescale, a 16→1 horizontal reduction), so by the standard bound
//! |computed − exact| ≤ γ_{n+16} · Σ|w_k·x_k| with γ_m = m·u/(1 − m·u), u = 2⁻²⁴. A wrong element,
//! sign, scale or block exceeds this by orders of magnitude.

mod common;

use common::{gaussian, random_row, rng};
use ds4_quant::{
    dequantize_row, dot_kernel_for, dot_row, matvec, quantize_row, set_force_portable, GgmlType,
    Isa, SUPPORTED,
};
use rand::Rng;

fn lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_elems() {
        1 => vec![
            1, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 1000, 4096, 4099,
        ],
        32 => vec![32, 64, 96, 160, 4096, 32 * 131],
        _ => vec![256, 512, 768, 2048, 4096, 256 * 27],
    }
}

/// (exact Σ w·x in f64, Σ|w·x| in f64) from the dequantised row.
fn reference(ty: GgmlType, row: &[u8], x: &[f32]) -> (f64, f64) {
    let mut w = vec![0f32; x.len()];
    dequantize_row(ty, row, &mut w).unwrap();
    let exact = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let mag = w
        .iter()
        .zip(x)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    (exact, mag)
}

fn bound(n: usize, mag: f64) -> f64 {
    let m = (n + 16) as f64 * 2f64.powi(-24);
    m / (1.0 - m) * mag + 1e-37
}

fn check_all_paths(ty: GgmlType, row: &[u8], x: &[f32], what: &str) {
    let (exact, mag) = reference(ty, row, x);
    let tol = bound(x.len(), mag);
    let mut results = Vec::new();
    for isa in Isa::available() {
        let got = dot_kernel_for(ty, isa).unwrap().dot(row, x) as f64;
        assert!(
            (got - exact).abs() <= tol,
            "{ty} {isa} n={} {what}: got {got:e}, exact {exact:e}, |err| {:e} > tol {tol:e}",
            x.len(),
            (got - exact).abs()
        );
        results.push((isa, got));
    }
    for &(isa, got) in &results[1..] {
        let p = results[0].1;
        assert!(
            (got - p).abs() <= 2.0 * tol,
            "{ty} {isa} vs portable n={}: {got:e} vs {p:e}",
            x.len()
        );
    }
}

#[test]
fn every_path_matches_dequantise_then_dot_on_random_valid_rows() {
    let mut r = rng(1);
    eprintln!("paths: {:?}", Isa::available());
    for ty in SUPPORTED {
        for n in lengths(ty) {
            for trial in 0..3 {
                let row = random_row(&mut r, ty, n);
                let scale = 10f32.powi(r.gen_range(-3..3));
                let x: Vec<f32> = gaussian(&mut r, n).iter().map(|v| v * scale).collect();
                check_all_paths(ty, &row, &x, &format!("random row {trial}"));
            }
        }
    }
}

#[test]
fn every_path_matches_on_quantised_gaussian_rows() {
    // Realistic rows (small scales, mins that cancel) from the quantisers.
    let mut r = rng(2);
    for ty in SUPPORTED {
        for n in lengths(ty) {
            let w = gaussian(&mut r, n);
            let mut row = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
            quantize_row(ty, &w, &mut row).unwrap();
            let x = gaussian(&mut r, n);
            check_all_paths(ty, &row, &x, "quantised gaussian row");
        }
    }
}

/// Every f16 and bf16 bit pattern (Inf, NaN, subnormals, ±0 among them) converted by every
/// path as `dequantize_row` converts it: each value alone in a 32-element row (inside the SIMD
/// loops), dotted with ones.
#[test]
fn every_half_value_converts_exactly_on_every_path() {
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let ones = [1f32; 32];
        for isa in Isa::available() {
            let k = dot_kernel_for(ty, isa).unwrap();
            for bits in 0..=u16::MAX {
                let at = bits as usize % 32;
                let mut row = [0u8; 64];
                row[2 * at..2 * at + 2].copy_from_slice(&bits.to_le_bytes());
                let mut want = [0f32; 32];
                dequantize_row(ty, &row, &mut want).unwrap();
                let (got, want) = (k.dot(&row, &ones), want[at]);
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "{ty} {isa} {bits:#06x}: {got:e}, expected {want:e}"
                );
            }
        }
    }
}

#[test]
fn wrong_weights_are_detected() {
    // The tolerance is tight enough that a single flipped code changes the verdict.
    let mut r = rng(3);
    for ty in SUPPORTED {
        let n = 1024;
        let w = gaussian(&mut r, n);
        let mut row = vec![0u8; ty.row_bytes(n as u64).unwrap() as usize];
        quantize_row(ty, &w, &mut row).unwrap();
        let x = gaussian(&mut r, n);
        let (_, mag) = reference(ty, &row, &x);
        let good = dot_row(ty, &row, &x).unwrap() as f64;
        let mut bad = row.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x10; // a code bit (F32: an exponent bit) of the last element(s)
        let (exact_bad, _) = reference(ty, &bad, &x);
        assert!(
            (exact_bad - good).abs() > bound(n, mag),
            "{ty}: corruption invisible to the test"
        );
    }
}

#[test]
fn dot_row_and_matvec_agree_with_the_kernel() {
    let mut r = rng(4);
    // The Q8_0 case is > 1 MiB so the rayon path runs.
    for (ty, n, rows) in [
        (GgmlType::Q8_0, 4096, 300),
        (GgmlType::Q4_K, 2048, 40),
        (GgmlType::IQ2_XXS, 4096, 17),
        (GgmlType::F16, 1000, 9),
        (GgmlType::Q2_K, 512, 3000),
    ] {
        let rb = ty.row_bytes(n as u64).unwrap() as usize;
        let w: Vec<u8> = (0..rows).flat_map(|_| random_row(&mut r, ty, n)).collect();
        let x = gaussian(&mut r, n);
        let mut y = vec![f32::NAN; rows];
        matvec(ty, &w, rows, &x, &mut y).unwrap();
        let k = ds4_quant::dot_kernel(ty).unwrap();
        for (i, &yi) in y.iter().enumerate() {
            let row = &w[i * rb..(i + 1) * rb];
            assert_eq!(yi.to_bits(), k.dot(row, &x).to_bits(), "{ty} row {i}");
            assert_eq!(
                yi.to_bits(),
                dot_row(ty, row, &x).unwrap().to_bits(),
                "{ty} row {i}"
            );
            check_all_paths(ty, row, &x, "matvec row");
        }
    }
}

#[test]
fn forcing_portable_changes_the_path() {
    set_force_portable(true);
    let k = ds4_quant::dot_kernel(GgmlType::Q4_K).unwrap();
    set_force_portable(false);
    assert_eq!(k.isa(), Isa::Portable);
}

#[test]
fn matmul_equals_matvec_per_token_bit_for_bit() {
    let mut r = rng(5);
    // Token counts below, at and past 4: the four-token kernels (Q8_0, Q2_K, Q4_K, IQ2_XXS)
    // and the tokens left over run token by token.
    for (ty, cols, rows, n_tok) in [
        (GgmlType::Q8_0, 1024, 700, 5), // > 1 MiB of work: the rayon path
        (GgmlType::Q8_0, 96, 11, 8),
        (GgmlType::Q2_K, 512, 33, 3),
        (GgmlType::Q2_K, 768, 21, 9),
        (GgmlType::Q4_K, 512, 5, 6),
        (GgmlType::F16, 100, 7, 4),
        (GgmlType::IQ2_XXS, 256, 9, 1),
        (GgmlType::IQ2_XXS, 512, 13, 7),
        (GgmlType::IQ2_XXS, 4096, 300, 4), // > 1 MiB: rayon
    ] {
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| random_row(&mut r, ty, cols))
            .collect();
        let xs = gaussian(&mut r, cols * n_tok);
        let mut ys = vec![f32::NAN; rows * n_tok];
        ds4_quant::matmul(ty, &w, rows, &xs, cols, &mut ys).unwrap();
        for t in 0..n_tok {
            let mut y = vec![0f32; rows];
            matvec(ty, &w, rows, &xs[t * cols..(t + 1) * cols], &mut y).unwrap();
            for i in 0..rows {
                assert_eq!(
                    ys[t * rows + i].to_bits(),
                    y[i].to_bits(),
                    "{ty} token {t} row {i}"
                );
            }
        }
        // Every path's own batched form against its one-token kernel.
        let rb = ty.row_bytes(cols as u64).unwrap() as usize;
        for isa in Isa::available() {
            let k = dot_kernel_for(ty, isa).unwrap();
            let mut ys = vec![f32::NAN; rows * n_tok];
            k.matmul_unchecked(&w, &xs, cols, &mut ys);
            for t in 0..n_tok {
                let x = &xs[t * cols..(t + 1) * cols];
                for i in 0..rows {
                    let want = k.dot(&w[i * rb..(i + 1) * rb], x);
                    assert_eq!(
                        ys[t * rows + i].to_bits(),
                        want.to_bits(),
                        "{ty} {isa} token {t} row {i}"
                    );
                }
            }
        }
    }
    let e = ds4_quant::matmul(GgmlType::F32, &[0u8; 32], 2, &[0.0; 8], 4, &mut [0.0; 5]);
    assert!(matches!(
        e,
        Err(ds4_quant::QuantError::Length {
            what: "output matrix ys",
            ..
        })
    ));
    let e = ds4_quant::matmul(GgmlType::F32, &[0u8; 32], 2, &[0.0; 9], 4, &mut [0.0; 4]);
    assert!(e.is_err());
}

/// Run by `env_var_forces_portable` in a child process with `DS4_QUANT_PORTABLE=1`.
#[test]
#[ignore = "run by env_var_forces_portable in a child process"]
fn child_reports_active_isa() {
    if std::env::var("DS4_QUANT_PORTABLE").as_deref() == Ok("1") {
        assert_eq!(ds4_quant::active_isa(), Isa::Portable);
        assert_eq!(
            ds4_quant::dot_kernel(GgmlType::Q8_0).unwrap().isa(),
            Isa::Portable
        );
    }
}

#[test]
fn env_var_forces_portable() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_reports_active_isa",
            "--nocapture",
        ])
        .env("DS4_QUANT_PORTABLE", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("1 passed"),
        "child did not run the test:\n{text}"
    );
}
