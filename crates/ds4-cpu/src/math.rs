//! Elementwise and small-vector building blocks of the forward pass (model.md §3.1), on f32
//! slices. These are the CPU definitions of the ops every backend must reproduce.

/// `x / sqrt(mean(x²) + eps) · w` (unweighted when `w` is None). Sum of squares in f64, as the
/// ds4 CPU reference does (model.md §7.19).
pub fn rms_norm(x: &mut [f32], w: Option<&[f32]>, eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32;
    match w {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * scale * w),
        None => x.iter_mut().for_each(|v| *v *= scale),
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + e^x)` without overflow.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    x.iter_mut().for_each(|v| *v /= s);
}

/// Round to the nearest f16 and back (cache storage precision, model.md §3.1).
pub fn f16_round(x: &mut [f32]) {
    for v in x {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// Nearest E4M3FN value (bias 7, 3 mantissa bits, subnormals m·2⁻⁹, max 448), ties to even.
/// `x` must already be clamped to ±448.
pub fn e4m3(x: f32) -> f32 {
    let a = x.abs();
    if a == 0.0 || a.is_nan() {
        return x;
    }
    // Quantum of the binade (or the subnormal step below 2⁻⁶).
    let e = a.log2().floor().max(-6.0);
    let quantum = (e - 3.0).exp2();
    let q = (a / quantum).round_ties_even() * quantum;
    q.min(448.0).copysign(x)
}

/// FP8 (E4M3FN) round trip with a power-of-two scale per block of 64, applied to the first
/// `n_nope` elements (the RoPE tail is untouched): `fp8sim` of model.md §3.1.
pub fn fp8_sim(v: &mut [f32], n_nope: usize) {
    for blk in v[..n_nope].chunks_mut(64) {
        let amax = blk.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-4);
        let s = ((amax as f64 / 448.0).log2().ceil()).exp2() as f32;
        for x in blk {
            *x = e4m3((*x / s).clamp(-448.0, 448.0)) * s;
        }
    }
}

/// E2M1 magnitudes, indexed by code.
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Nearest E2M1 value, ties to the even code. `x` clamped to ±6.
pub fn e2m1(x: f32) -> f32 {
    let a = x.abs();
    let mut best = 0;
    for (c, &v) in E2M1.iter().enumerate().skip(1) {
        let d = (v - a).abs();
        let db = (E2M1[best] - a).abs();
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    E2M1[best].copysign(x)
}

/// Sylvester-ordered fast Walsh–Hadamard transform scaled by 1/√n (n a power of two).
pub fn hadamard(v: &mut [f32]) {
    let n = v.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    v.iter_mut().for_each(|x| *x *= s);
}

/// `fp4sim(H(v))` of model.md §3.1: Hadamard, then FP4 (E2M1) with a power-of-two scale per
/// block of 32.
pub fn fp4_hadamard_sim(v: &mut [f32]) {
    hadamard(v);
    for blk in v.chunks_mut(32) {
        let amax = blk
            .iter()
            .fold(0f32, |m, x| m.max(x.abs()))
            .max(6.0 * f32::MIN_POSITIVE);
        let s = ((amax as f64 / 6.0).log2().ceil()).exp2() as f32;
        for x in blk {
            *x = e2m1((*x / s).clamp(-6.0, 6.0)) * s;
        }
    }
}

/// Plain dot product in f32.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: vectorisable, and a fixed order (deterministic).
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for k in 0..8 {
            acc[k] += a[i + k] * b[i + k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_grid() {
        assert_eq!(e4m3(448.0), 448.0);
        assert_eq!(e4m3(1.0), 1.0);
        assert_eq!(e4m3(1.0625), 1.0); // tie between 1.0 (even) and 1.125
        assert_eq!(e4m3(1.1875), 1.25); // tie between 1.125 and 1.25 (even)
        assert_eq!(e4m3(-0.3), -0.3125);
        assert_eq!(e4m3(2f32.powi(-9)), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3(1.4 * 2f32.powi(-10)), 2f32.powi(-9));
        assert_eq!(e4m3(0.4 * 2f32.powi(-9)), 0.0);
        assert_eq!(e4m3(15.5), 16.0);
    }

    /// The GPU stores the indexer's rows as bf16 (ds4-gpu `GpuComp::bf16`) because every
    /// FP4-simulated value (e2m1 · 2^k, k from -127 up), f16-rounded or not, is exact in bf16:
    /// blocks at magnitudes from f32 subnormals through the f16 subnormal range to past f16's
    /// largest value (rounded to ±inf) and 0 round-trip in bits; an unrounded row does not.
    #[test]
    fn fp4_rows_are_exact_in_bf16() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut lossy = 0;
        for e in (-140..=40).step_by(3) {
            let mut row: Vec<f32> = (0..128).map(|_| next() * 2f32.powi(e)).collect();
            row[5] = 0.0;
            let raw = row.clone();
            lossy += raw
                .iter()
                .filter(|v| half::bf16::from_f32(**v).to_f32() != **v)
                .count();
            fp4_hadamard_sim(&mut row);
            for f16 in [false, true] {
                let mut r = row.clone();
                if f16 {
                    f16_round(&mut r);
                }
                for (i, &v) in r.iter().enumerate() {
                    let b = half::bf16::from_f32(v).to_f32();
                    assert_eq!(
                        b.to_bits(),
                        v.to_bits(),
                        "scale 2^{e} f16 {f16} value {i}: {v:e}"
                    );
                }
            }
        }
        assert!(
            lossy > 1000,
            "unrounded rows should lose bits in bf16 ({lossy})"
        );
    }

    #[test]
    fn e2m1_grid() {
        assert_eq!(e2m1(0.25), 0.0); // tie 0 / 0.5 → code 0
        assert_eq!(e2m1(0.75), 1.0); // tie 0.5 / 1 → code 2
        assert_eq!(e2m1(2.5), 2.0); // tie 2 / 3 → code 4
        assert_eq!(e2m1(5.0), 4.0); // tie 4 / 6 → code 6 (even)
        assert_eq!(e2m1(-5.5), -6.0);
    }

    /// attention.cu `ds4_e2m1` (the GPU's rounding, a closed form) written in Rust: it must give
    /// the search's value on its callers' domain (|x| <= 6 after the clamp, or NaN) for every
    /// input near each of the seven midpoints and the eight codes (±4096 ulps) and on a sweep
    /// of [0, 6] with negatives and zero signs.
    fn e2m1_closed(x: f32) -> f32 {
        if x.is_nan() {
            return 0f32.copysign(x);
        }
        let a = x.abs().min(6.0);
        let k = if a < 2.0 {
            2.0f32
        } else if a < 4.0 {
            1.0
        } else {
            0.5
        };
        ((a * k).round_ties_even() * (1.0 / k)).copysign(x)
    }

    #[test]
    fn e2m1_closed_form_matches_search() {
        let same = |x: f32| {
            let (a, b) = (e2m1(x), e2m1_closed(x));
            assert!(
                a.to_bits() == b.to_bits(),
                "x {x:e} ({:#x}): search {a}, closed form {b}",
                x.to_bits()
            );
        };
        let points = [
            0.0f32, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0,
        ];
        let mut n = 0;
        for p in points {
            let b = p.to_bits() as i64;
            for d in -4096i64..=4096 {
                let bits = b + d;
                if bits < 0 {
                    continue;
                }
                let x = f32::from_bits(bits as u32);
                if x > 6.0 {
                    continue;
                }
                same(x);
                same(-x);
                n += 2;
            }
        }
        for i in 0..=600_000u32 {
            let x = i as f32 * 1e-5;
            same(x);
            same(-x);
            n += 2;
        }
        for x in [f32::NAN, -f32::NAN, f32::MIN_POSITIVE, 1e-30, -1e-30] {
            same(x);
        }
        assert!(n > 1_000_000);
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let mut v: Vec<f32> = (0..128).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
        let n0: f32 = v.iter().map(|x| x * x).sum();
        let orig = v.clone();
        hadamard(&mut v);
        let n1: f32 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
        hadamard(&mut v); // H is its own inverse
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    /// The scale is exactly 2^ceil(log2(amax/448)) when amax/448 is a power of two (the GPU once
    /// took device log2(2^-6) = -5.999…, ceil → 2^-5). Input: block 0 of row 1509 of ds4-gpu
    /// ops_attn `round_rows_is_exact` (width 512, FP8 448 + f16), values k·2^-16, amax 7 = 448·2^-6.
    #[test]
    fn fp8_sim_power_of_two_amax() {
        let k: [i32; 64] = [
            458752, 32, -47, 3, 37, -6, 27, -63, -21, 47, 1, 5, -38, 37, -16, 3, 31, 3, 30, -45,
            27, 20, 58, -36, 32, -35, -31, 50, -15, 47, 46, 8, -2, -51, 24, 5, 43, -56, 50, 31,
            -39, -28, 54, 1, 60, 11, -43, 17, -24, 29, 22, 22, -40, 25, 48, 51, -64, -8, 38, -53,
            -14, 64, -46, 8,
        ];
        let mut v: Vec<f32> = k.iter().map(|&k| k as f32 * 2f32.powi(-16)).collect();
        fp8_sim(&mut v, 64);
        f16_round(&mut v);
        // -3·2^-9 at scale 2^-6 is on the E4M3 subnormal grid; at 2^-5 it would tie to -2^-13.
        assert_eq!(v[5].to_bits(), 0xb8c0_0000);
        assert_eq!(v[0], 7.0);
        // Every binade (amax >= 1e-4): amax 448·2^e gives scale 2^e, so 3·2^(e-9) stays.
        for e in -22..=40 {
            let s = 2f32.powi(e);
            let mut b = vec![0f32; 64];
            b[0] = 448.0 * s;
            b[1] = 3.0 * 2f32.powi(-9) * s;
            let orig = b.clone();
            fp8_sim(&mut b, 64);
            assert_eq!(b, orig, "amax 448·2^{e}");
        }
    }

    #[test]
    fn fp8_sim_keeps_rope_tail_and_scales_blocks() {
        let mut v: Vec<f32> = (0..192).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let orig = v.clone();
        fp8_sim(&mut v, 128);
        assert_eq!(&v[128..], &orig[128..]);
        for (a, b) in v[..128].iter().zip(&orig[..128]) {
            assert!((a - b).abs() <= b.abs() * 0.07 + 1e-3, "{a} vs {b}");
        }
    }
}
