//! Quantisers for fixtures and synthetic weights (sane error, not llama.cpp quality).
//!
//! F16 (round-to-nearest-even), BF16 and Q8_0 follow ggml's reference quantisers bit for bit
//! (checked against gguf-py in the tests). Q2_K/Q4_K fit a scale and a min per sub-block by a few
//! rounds of least squares; IQ2_XXS searches the 256-entry grid per 8 weights under the
//! even-sign-parity constraint.

use crate::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use crate::portable::QK_K;
use crate::{check_row, require_supported, GgmlType, QuantError};
use half::f16;

/// Quantise one row: `src` (a whole number of blocks) into `dst` (exactly the row's bytes).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    require_supported(ty, "quantisation")?;
    check_row(ty, "destination row", dst.len(), src.len())?;
    match ty {
        GgmlType::F32 => {
            for (v, o) in src.iter().zip(dst.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (v, o) in src.iter().zip(dst.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (v, o) in src.iter().zip(dst.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            for (x, o) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
                quantize_q8_0(x, o);
            }
        }
        GgmlType::Q2_K => {
            blocks_parallel(src, dst, 84, quantize_q2_k);
        }
        GgmlType::Q4_K => {
            blocks_parallel(src, dst, 144, quantize_q4_k);
        }
        GgmlType::IQ2_XXS => {
            blocks_parallel(src, dst, 66, quantize_iq2_xxs);
        }
        _ => unreachable!("checked above"),
    }
    Ok(())
}

/// Quantise the 256-element blocks of a row independently, in parallel when there are several
/// (the searching quantisers are slow: ~1–3 M weights/s per core).
fn blocks_parallel(src: &[f32], dst: &mut [u8], bb: usize, f: fn(&[f32], &mut [u8])) {
    use rayon::prelude::*;
    if src.len() >= 4 * QK_K {
        src.par_chunks_exact(QK_K)
            .zip(dst.par_chunks_exact_mut(bb))
            .for_each(|(x, o)| f(x, o));
    } else {
        for (x, o) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(bb)) {
            f(x, o);
        }
    }
}

/// ggml's `fp32_to_bf16`: NaN forced quiet, otherwise round to nearest even.
fn f32_to_bf16(v: f32) -> u16 {
    let n = v.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 64) as u16;
    }
    ((n as u64 + (0x7fff + ((n >> 16) & 1)) as u64) >> 16) as u16
}

/// ggml reference Q8_0: `d = amax/127`, `q = round_half_away(x/d)`.
fn quantize_q8_0(x: &[f32], o: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    o[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, v) in o[2..34].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}

/// Least-squares fit of `x ≈ s·q − m` with `q ∈ 0..=nmax`, `s ≥ 0`, `m ≥ 0`. Returns `(s, m)`.
fn fit_scale_min(x: &[f32], nmax: u8) -> (f32, f32) {
    let mx = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mn = x.iter().fold(f32::INFINITY, |a, &v| a.min(v)).min(0.0);
    if mx <= mn {
        return (0.0, -mn);
    }
    let err = |s: f32, m: f32| -> f32 {
        x.iter()
            .map(|&v| {
                let q = if s > 0.0 {
                    ((v + m) / s).round().clamp(0.0, nmax as f32)
                } else {
                    0.0
                };
                let e = s * q - m - v;
                e * e
            })
            .sum()
    };
    let mut best = ((mx - mn) / nmax as f32, -mn);
    let mut best_err = err(best.0, best.1);
    // Try a few initial ranges, then refine each with least squares on the assignments.
    for step in 0..8 {
        let mut s = (mx - mn) / (nmax as f32 + step as f32 * 0.25 - 0.5).max(0.5);
        let mut m = -mn;
        for _ in 0..3 {
            let (mut sq, mut sqq, mut sx, mut sqx) = (0f64, 0f64, 0f64, 0f64);
            for &v in x {
                let q = ((v + m) / s).round().clamp(0.0, nmax as f32) as f64;
                sq += q;
                sqq += q * q;
                sx += v as f64;
                sqx += q * v as f64;
            }
            let n = x.len() as f64;
            let det = n * sqq - sq * sq;
            if det <= 0.0 {
                break;
            }
            let (mut ns, mut nm) = ((n * sqx - sq * sx) / det, -(sx * sqq - sq * sqx) / det);
            if nm < 0.0 {
                nm = 0.0;
                ns = if sqq > 0.0 { sqx / sqq } else { 0.0 };
            }
            if ns <= 0.0 {
                break;
            }
            s = ns as f32;
            m = nm as f32;
            let e = err(s, m);
            if e < best_err {
                best_err = e;
                best = (s, m);
            }
        }
    }
    best
}

/// Quantise super-block scales/mins (≥ 0) to `bits`-bit integers with one f16 factor each.
fn quantize_factors(v: &[f32], bits: u32) -> (f16, Vec<u8>) {
    let max_code = ((1u32 << bits) - 1) as f32;
    let vmax = v.iter().fold(0f32, |a, &b| a.max(b));
    let d = f16::from_f32(vmax / max_code);
    let df = d.to_f32();
    let codes = v
        .iter()
        .map(|&s| {
            if df > 0.0 {
                (s / df).round().clamp(0.0, max_code) as u8
            } else {
                0
            }
        })
        .collect();
    (d, codes)
}

/// Codes `q = clamp(round((x + ml)/dl), 0, nmax)` for one sub-block.
fn affine_codes(x: &[f32], dl: f32, ml: f32, nmax: u8) -> impl Iterator<Item = u8> + '_ {
    x.iter().map(move |&v| {
        if dl > 0.0 {
            ((v + ml) / dl).round().clamp(0.0, nmax as f32) as u8
        } else {
            0
        }
    })
}

fn quantize_q2_k(x: &[f32], o: &mut [u8]) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(16).map(|c| fit_scale_min(c, 3)).collect();
    let (d, sc) = quantize_factors(&fits.iter().map(|f| f.0).collect::<Vec<_>>(), 4);
    let (dmin, mn) = quantize_factors(&fits.iter().map(|f| f.1).collect::<Vec<_>>(), 4);
    o.fill(0);
    for s in 0..16 {
        o[s] = sc[s] | (mn[s] << 4);
    }
    o[80..82].copy_from_slice(&d.to_le_bytes());
    o[82..84].copy_from_slice(&dmin.to_le_bytes());
    // Sub-block s = 8·half + 2j + i holds weights 128·half + 32j + 16i .. +16 (model.md §5).
    for half in 0..2 {
        for j in 0..4 {
            for i in 0..2 {
                let s = 8 * half + 2 * j + i;
                let dl = d.to_f32() * sc[s] as f32;
                let ml = dmin.to_f32() * mn[s] as f32;
                let k0 = 128 * half + 32 * j + 16 * i;
                for (l, q) in affine_codes(&x[k0..k0 + 16], dl, ml, 3).enumerate() {
                    o[16 + 32 * half + 16 * i + l] |= q << (2 * j);
                }
            }
        }
    }
}

fn quantize_q4_k(x: &[f32], o: &mut [u8]) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(32).map(|c| fit_scale_min(c, 15)).collect();
    let (d, sc) = quantize_factors(&fits.iter().map(|f| f.0).collect::<Vec<_>>(), 6);
    let (dmin, mn) = quantize_factors(&fits.iter().map(|f| f.1).collect::<Vec<_>>(), 6);
    o.fill(0);
    o[0..2].copy_from_slice(&d.to_le_bytes());
    o[2..4].copy_from_slice(&dmin.to_le_bytes());
    // Pack the 6-bit pairs (inverse of `q4k_scale_min`).
    let scales = &mut o[4..16];
    for b in 0..4 {
        scales[b] = sc[b] | ((sc[b + 4] >> 4) << 6);
        scales[b + 4] = mn[b] | ((mn[b + 4] >> 4) << 6);
        scales[b + 8] = (sc[b + 4] & 15) | ((mn[b + 4] & 15) << 4);
    }
    for c in 0..4 {
        for h in 0..2 {
            let b = 2 * c + h;
            let dl = d.to_f32() * sc[b] as f32;
            let ml = dmin.to_f32() * mn[b] as f32;
            let k0 = 64 * c + 32 * h;
            for (l, q) in affine_codes(&x[k0..k0 + 32], dl, ml, 15).enumerate() {
                o[16 + 32 * c + l] |= q << (4 * h);
            }
        }
    }
}

/// The grid transposed to `[j][entry]` as f32 plus `Σ_j g_j²` per entry, so the search below
/// runs over entries in vectorisable loops.
struct Iq2Search {
    g: [[f32; 256]; 8],
    gg: [f32; 256],
}

fn iq2_search() -> &'static Iq2Search {
    static T: std::sync::OnceLock<Box<Iq2Search>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = Box::new(Iq2Search {
            g: [[0.0; 256]; 8],
            gg: [0.0; 256],
        });
        for (e, &packed) in IQ2XXS_GRID.iter().enumerate() {
            for (j, &b) in packed.to_le_bytes().iter().enumerate() {
                t.g[j][e] = b as f32;
                t.gg[e] += (b as f32) * (b as f32);
            }
        }
        t
    })
}

/// Best grid entry for 8 magnitudes `y` (already divided by the scale), given that the sign
/// pattern (bit j = x_j < 0) has odd parity when `odd`: then the cheapest element is flipped,
/// costing `4·y_j·g_j`. Returns (entry, flip mask, squared error).
fn iq2_best_entry(y: &[f32; 8], odd: bool) -> (u8, u8, f32) {
    let t = iq2_search();
    // err(e) = Σy² − 2·Σ y_j·g_ej + Σ g_ej²  (+ the flip cost when odd).
    let yy: f32 = y.iter().map(|v| v * v).sum();
    let mut err = t.gg;
    for (yj, gj) in y.iter().zip(&t.g) {
        let m = -2.0 * yj;
        for (e, g) in err.iter_mut().zip(gj) {
            *e += m * g;
        }
    }
    if odd {
        let mut flip = [f32::INFINITY; 256];
        for (yj, gj) in y.iter().zip(&t.g) {
            let m = 4.0 * yj;
            for (f, g) in flip.iter_mut().zip(gj) {
                *f = f.min(m * g);
            }
        }
        for (e, f) in err.iter_mut().zip(&flip) {
            *e += f;
        }
    }
    let (mut be, mut bv) = (0usize, f32::INFINITY);
    for (e, &v) in err.iter().enumerate() {
        if v < bv {
            bv = v;
            be = e;
        }
    }
    let flip = if odd {
        // The element whose flip is cheapest for the chosen entry (lowest index on ties).
        let mut bj = 0;
        for j in 1..8 {
            if y[j] * t.g[j][be] < y[bj] * t.g[bj][be] {
                bj = j;
            }
        }
        1u8 << bj
    } else {
        0
    };
    (be as u8, flip, (bv + yy).max(0.0))
}

/// Quantise 8 values with the given scale (`w = s·grid·sign`). Returns (entry, 7-bit sign
/// index, squared error in x units).
fn iq2_chunk(x: &[f32], s: f32) -> (u8, u8, f32) {
    let mut neg = 0u8;
    let mut y = [0f32; 8];
    for j in 0..8 {
        if x[j] < 0.0 {
            neg |= 1 << j;
        }
        y[j] = if s > 0.0 { x[j].abs() / s } else { 0.0 };
    }
    let (e, flip, err) = iq2_best_entry(&y, neg.count_ones() % 2 == 1);
    let signs = neg ^ flip;
    debug_assert_eq!(KSIGNS_IQ2XS[(signs & 127) as usize], signs);
    (e, signs & 127, err * s * s)
}

/// Best scale for a group of 32: a few candidates, then a least-squares refit of the winner.
fn iq2_group_scale(x: &[f32]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    if amax == 0.0 {
        return 0.0;
    }
    let group_err = |s: f32| -> f32 { x.chunks_exact(8).map(|c| iq2_chunk(c, s).2).sum() };
    let mut best = (amax / 43.0, f32::INFINITY);
    for t in [43.0f32, 32.0, 24.0, 17.0, 11.0, 8.0] {
        let s = amax / t;
        let e = group_err(s);
        if e < best.1 {
            best = (s, e);
        }
    }
    // Refit: s = Σ|x|·g / Σg² over the chosen entries (signs fixed by the choice).
    let (mut num, mut den) = (0f64, 0f64);
    for c in x.chunks_exact(8) {
        let (e, si, _) = iq2_chunk(c, best.0);
        let g = IQ2XXS_GRID[e as usize].to_le_bytes();
        let signs = KSIGNS_IQ2XS[si as usize];
        for j in 0..8 {
            let w = if signs >> j & 1 != 0 {
                -(g[j] as f64)
            } else {
                g[j] as f64
            };
            num += w * c[j] as f64;
            den += w * w;
        }
    }
    let s = (num / den) as f32;
    if s > 0.0 && group_err(s) < best.1 {
        s
    } else {
        best.0
    }
}

fn quantize_iq2_xxs(x: &[f32], o: &mut [u8]) {
    let scales: Vec<f32> = x.chunks_exact(32).map(iq2_group_scale).collect();
    // db = d·(0.5 + ls)·0.25 with ls ≤ 15, so d = max_scale / 3.875.
    let smax = scales.iter().fold(0f32, |a, &b| a.max(b));
    let d = f16::from_f32(smax / 3.875);
    let df = d.to_f32();
    o.fill(0);
    o[0..2].copy_from_slice(&d.to_le_bytes());
    for (g, (xg, &s)) in x.chunks_exact(32).zip(&scales).enumerate() {
        let ls = if df > 0.0 {
            (s / (df * 0.25) - 0.5).round().clamp(0.0, 15.0) as u32
        } else {
            0
        };
        let mut aux = ls << 28;
        let db = df * (0.5 + ls as f32) * 0.25;
        let grp = &mut o[2 + 8 * g..10 + 8 * g];
        for (c, xc) in xg.chunks_exact(8).enumerate() {
            let (e, si, _) = iq2_chunk(xc, db);
            grp[c] = e;
            aux |= (si as u32) << (7 * c);
        }
        grp[4..8].copy_from_slice(&aux.to_le_bytes());
    }
}
