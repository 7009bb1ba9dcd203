//! Helpers shared by the integration tests: seeded RNG, Gaussian samples, random valid blocks.
#![allow(dead_code)]

use ds4_quant::GgmlType;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

pub fn rng(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// Standard normal samples (Box–Muller).
pub fn gaussian(r: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = r.gen_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = r.gen();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// A random finite f16 bit pattern: half the time any finite value (subnormals, ±0 included),
/// otherwise a typical positive scale around 1e-2.
pub fn finite_f16(r: &mut impl Rng) -> [u8; 2] {
    if r.gen_bool(0.5) {
        let mut b: u16 = r.gen();
        if b & 0x7c00 == 0x7c00 {
            b &= 0x83ff;
        }
        b.to_le_bytes()
    } else {
        half::f16::from_f32(r.gen_range(1e-4f32..3e-2)).to_le_bytes()
    }
}

/// Offsets of the f16 fields in a block of `ty`.
pub fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::IQ2_XXS => &[0],
        GgmlType::Q4_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        _ => &[],
    }
}

/// A random valid row of `n` elements: random codes, finite scales; for F32/F16/BF16 finite
/// values of mixed magnitude.
pub fn random_row(r: &mut impl Rng, ty: GgmlType, n: usize) -> Vec<u8> {
    match ty {
        GgmlType::F32 => gaussian(r, n)
            .iter()
            .map(|v| v * 4f32.powi(r.gen_range(-8..8)))
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n).flat_map(|_| finite_f16(r)).collect(),
        GgmlType::BF16 => gaussian(r, n)
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        _ => {
            let bb = ty.block_bytes() as usize;
            let nb = n / ty.block_elems() as usize;
            let mut out = vec![0u8; nb * bb];
            r.fill(&mut out[..]);
            for b in out.chunks_exact_mut(bb) {
                for &off in f16_fields(ty) {
                    b[off..off + 2].copy_from_slice(&finite_f16(r));
                }
            }
            out
        }
    }
}
