//! Optional activation-quantised fast path (ds4's CPU semantics, model.md §5): the activation is
//! quantised once — to Q8_0 blocks of 32 for Q8_0 weights, to Q8_K blocks of 256 for Q2_K, Q4_K
//! and IQ2_XXS weights — and each weight row is dotted with integer arithmetic, one f32
//! combination per block. This is *not* exact mode: the result differs from [`crate::dot_row`] by
//! the activation rounding (measured in `examples/dot_bench.rs`).
//!
//! Integer sums are exact, and the per-block f32 combination runs in block order on every path,
//! so the AVX2 integer kernels give results bit-identical to the portable ones.
//!
//! Relation to ds4: the activation quantisers and per-block formulas follow ds4.c's scalar CPU
//! code (Q8_0: `Σ (f16(d_w)·d_x)·isum`; Q2_K: `dall·isum − dmin·summs`; IQ2_XXS:
//! `0.125·Σ d·bsum`); Q4_K, which ds4's CPU path lacks, uses the same affine form. ds4 is built
//! with `-ffast-math`, so its sums are not bit-reproducible and no bit-equality is claimed.

use crate::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use crate::portable::{q4k_scale_min, QK_K};
use crate::{check_row, f16_at, row_bytes, GgmlType, Isa, QuantError};

/// Activation block format.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// 32 values: `d: f32` (= amax/127, not rounded to f16), `q: i8[32]`.
    Q8_0,
    /// 256 values: `d: f32` (may be negative), `q: i8[256]`, 16 sums of 16 `q`.
    Q8_K,
}

impl ActFormat {
    pub fn block_elems(self) -> usize {
        match self {
            ActFormat::Q8_0 => 32,
            ActFormat::Q8_K => QK_K,
        }
    }

    /// The format ds4 pairs with weights of `ty`, if this path supports `ty`.
    pub fn for_weight(ty: GgmlType) -> Option<ActFormat> {
        match ty {
            GgmlType::Q8_0 => Some(ActFormat::Q8_0),
            GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS => Some(ActFormat::Q8_K),
            _ => None,
        }
    }
}

/// A quantised activation vector.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedAct {
    format: ActFormat,
    /// One scale per block.
    d: Vec<f32>,
    /// One code per element.
    q: Vec<i8>,
    /// Q8_K only: sums of each 16 consecutive codes.
    bsums: Vec<i16>,
}

impl QuantizedAct {
    /// Quantise `x` (a whole number of blocks) to `format`.
    pub fn new(format: ActFormat, x: &[f32]) -> Result<Self, QuantError> {
        let be = format.block_elems();
        if !x.len().is_multiple_of(be) {
            let ty = match format {
                ActFormat::Q8_0 => GgmlType::Q8_0,
                ActFormat::Q8_K => GgmlType::Q8_K,
            };
            return Err(QuantError::PartialBlock {
                ty,
                n: x.len(),
                block: be,
            });
        }
        let mut a = QuantizedAct {
            format,
            d: Vec::with_capacity(x.len() / be),
            q: vec![0; x.len()],
            bsums: Vec::new(),
        };
        match format {
            ActFormat::Q8_0 => {
                for (xb, qb) in x.chunks_exact(32).zip(a.q.chunks_exact_mut(32)) {
                    // d = amax/127, q = round_half_even(x·(1/d)) (ds4 CPU). |x·(1/d)| ≤ 127 up to
                    // one rounding, so ds4's clamp to −128 never acts; −127 keeps codes symmetric.
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    for (q, v) in qb.iter_mut().zip(xb) {
                        *q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
                    }
                    a.d.push(d);
                }
            }
            ActFormat::Q8_K => {
                a.bsums = vec![0; x.len() / 16];
                for ((xb, qb), sb) in x
                    .chunks_exact(QK_K)
                    .zip(a.q.chunks_exact_mut(QK_K))
                    .zip(a.bsums.chunks_exact_mut(16))
                {
                    // The first element of largest magnitude, sign kept.
                    let (mut amax, mut max) = (0f32, 0f32);
                    for &v in xb {
                        if v.abs() > amax {
                            amax = v.abs();
                            max = v;
                        }
                    }
                    if amax == 0.0 {
                        a.d.push(0.0);
                        continue; // codes and sums stay 0
                    }
                    let iscale = -127.0 / max;
                    for (q, v) in qb.iter_mut().zip(xb) {
                        *q = (iscale * v).round_ties_even().clamp(-127.0, 127.0) as i8;
                    }
                    for (s, qc) in sb.iter_mut().zip(qb.chunks_exact(16)) {
                        *s = qc.iter().map(|&q| q as i16).sum();
                    }
                    a.d.push(1.0 / iscale);
                }
            }
        }
        Ok(a)
    }

    /// Quantise `x` in the format ds4 pairs with weights of `ty`.
    pub fn for_weight(ty: GgmlType, x: &[f32]) -> Result<Self, QuantError> {
        let f = ActFormat::for_weight(ty).ok_or(QuantError::Unsupported {
            ty,
            op: "activation-quantised dot product",
        })?;
        Self::new(f, x)
    }

    pub fn format(&self) -> ActFormat {
        self.format
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// Per-block scales.
    pub fn scales(&self) -> &[f32] {
        &self.d
    }

    /// Per-element codes.
    pub fn codes(&self) -> &[i8] {
        &self.q
    }

    /// The values the codes stand for, `d_block · q`.
    pub fn dequantize(&self) -> Vec<f32> {
        let be = self.format.block_elems();
        self.q
            .chunks_exact(be)
            .zip(&self.d)
            .flat_map(|(qb, &d)| qb.iter().map(move |&q| d * q as f32))
            .collect()
    }
}

/// `Σ_k w_k · x̂_k` for one weight row of `ty` and a quantised activation, on the active path.
pub fn dot_row_act(ty: GgmlType, row: &[u8], x: &QuantizedAct) -> Result<f32, QuantError> {
    check_act(ty, x)?;
    check_row(ty, "weight row", row.len(), x.len())?;
    Ok(dot_act_unchecked(ty, row, x, crate::active_isa()))
}

/// The activation-quantised dot product for one weight type, its path resolved once (as
/// [`crate::DotKernel`] is for exact mode), for loops over many rows.
#[derive(Clone, Copy, Debug)]
pub struct ActKernel {
    ty: GgmlType,
    format: ActFormat,
    isa: Isa,
}

impl ActKernel {
    /// The kernel for weights of `ty` on the active path; `None` where this path has no kernel
    /// for `ty` (float weights: use exact mode) or where exact mode is the faster one: IQ2_XXS
    /// on the portable path (0.4 against 0.8 GB/s a core, `examples/dot_bench.rs` with
    /// `DS4_QUANT_PORTABLE=1`; the portable K-quant and Q8_0 kernels are ~2x faster than
    /// exact mode's).
    pub fn new(ty: GgmlType) -> Option<ActKernel> {
        let isa = crate::active_isa();
        if isa == Isa::Portable && ty == GgmlType::IQ2_XXS {
            return None;
        }
        Some(ActKernel {
            ty,
            format: ActFormat::for_weight(ty)?,
            isa,
        })
    }

    /// The activation format the rows of this type pair with.
    pub fn format(&self) -> ActFormat {
        self.format
    }

    /// `Σ w_k · x̂_k` over the whole blocks present in both `row` and `x` (rows are not
    /// validated: the caller slices whole rows). Panics if `x` is not in [`Self::format`] (a
    /// programming error: the kernels index `x` by that format's block size).
    #[inline]
    pub fn dot(&self, row: &[u8], x: &QuantizedAct) -> f32 {
        assert_eq!(
            x.format, self.format,
            "{} rows with a {:?} activation",
            self.ty, x.format
        );
        dot_act_unchecked(self.ty, row, x, self.isa)
    }
}

/// `y = W·x̂` for `rows` rows (rayon over rows when large), activation quantised once.
pub fn matvec_act(
    ty: GgmlType,
    weight: &[u8],
    rows: usize,
    x: &QuantizedAct,
    y: &mut [f32],
) -> Result<(), QuantError> {
    use rayon::prelude::*;
    check_act(ty, x)?;
    let rb = row_bytes(ty, x.len())?;
    if y.len() != rows {
        return Err(QuantError::Length {
            ty,
            what: "output vector y",
            expected: rows,
            got: y.len(),
        });
    }
    if Some(weight.len()) != rb.checked_mul(rows) {
        return Err(QuantError::Length {
            ty,
            what: "weight matrix",
            expected: rb.saturating_mul(rows),
            got: weight.len(),
        });
    }
    let isa = crate::active_isa();
    let one = |r: usize| dot_act_unchecked(ty, &weight[r * rb..(r + 1) * rb], x, isa);
    if rows * rb < crate::PAR_MIN_BYTES || rows < 2 {
        for (r, o) in y.iter_mut().enumerate() {
            *o = one(r);
        }
    } else {
        let min_len = (crate::PAR_TASK_BYTES / rb.max(1)).max(1);
        y.par_iter_mut()
            .enumerate()
            .with_min_len(min_len)
            .for_each(|(r, o)| *o = one(r));
    }
    Ok(())
}

fn check_act(ty: GgmlType, x: &QuantizedAct) -> Result<(), QuantError> {
    let want = ActFormat::for_weight(ty).ok_or(QuantError::Unsupported {
        ty,
        op: "activation-quantised dot product",
    })?;
    if want != x.format {
        return Err(QuantError::Unsupported {
            ty,
            op: match want {
                ActFormat::Q8_0 => "activation-quantised dot with a non-Q8_0 activation",
                ActFormat::Q8_K => "activation-quantised dot with a non-Q8_K activation",
            },
        });
    }
    Ok(())
}

/// Dot on a given path (tests and benchmarks), checked like [`dot_row_act`].
pub fn dot_act_isa(
    ty: GgmlType,
    row: &[u8],
    x: &QuantizedAct,
    isa: Isa,
) -> Result<f32, QuantError> {
    check_act(ty, x)?;
    check_row(ty, "weight row", row.len(), x.len())?;
    if !isa.is_available() {
        return Err(QuantError::IsaUnavailable(isa));
    }
    Ok(dot_act_unchecked(ty, row, x, isa))
}

/// Callers guarantee: `x.format` is the format for `ty` (the kernels index `x` by the block
/// size of that format) and `isa` is available; row length mismatches only truncate.
fn dot_act_unchecked(ty: GgmlType, row: &[u8], x: &QuantizedAct, isa: Isa) -> f32 {
    debug_assert_eq!(ActFormat::for_weight(ty), Some(x.format));
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && Isa::Avx2.is_available() {
        // SAFETY: AVX2 was detected; the format matches `ty` (see above).
        return unsafe {
            match ty {
                GgmlType::Q2_K => avx2::q2_k(row, x),
                GgmlType::Q4_K => avx2::q4_k(row, x),
                GgmlType::IQ2_XXS => avx2::iq2_xxs(row, x),
                GgmlType::Q8_0 => avx2::q8_0(row, x),
                _ => 0.0, // unreachable: callers checked the type
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        // SAFETY: NEON is a baseline feature of the aarch64 targets; the format matches `ty`.
        return unsafe {
            match ty {
                GgmlType::Q2_K => neon::q2_k(row, x),
                GgmlType::Q4_K => neon::q4_k(row, x),
                GgmlType::IQ2_XXS => neon::iq2_xxs(row, x),
                GgmlType::Q8_0 => neon::q8_0(row, x),
                _ => 0.0, // unreachable: callers checked the type
            }
        };
    }
    let _ = isa;
    dot_act_blocks(ty, row, x)
}

/// AArch64 NEON kernels: the integer sums by widening multiplies (`smull`, |w·x| ≤ 128·127 fits
/// i16) and pairwise accumulation into i32 (`sadalp`), then the portable path's per-block f32
/// combination in block order: bit-identical to it.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use std::arch::aarch64::*;

    /// `Σ w_i·x_i` over 16 codes.
    #[inline(always)]
    unsafe fn dot16(w: int8x16_t, x: int8x16_t) -> i32 {
        let p = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        let p = vpadalq_s16(vpaddlq_s16(p), vmull_high_s8(w, x));
        vaddvq_s32(p)
    }

    pub(super) unsafe fn q8_0(row: &[u8], x: &QuantizedAct) -> f32 {
        let nb = (row.len() / 34).min(x.d.len());
        let (rp, xp) = (row.as_ptr(), x.q.as_ptr());
        let mut sumf = 0f32;
        for ib in 0..nb {
            crate::prefetch_block(rp.add(34 * ib), 34);
            let w = rp.add(34 * ib + 2) as *const i8;
            let xq = xp.add(32 * ib);
            let isum =
                dot16(vld1q_s8(w), vld1q_s8(xq)) + dot16(vld1q_s8(w.add(16)), vld1q_s8(xq.add(16)));
            sumf += f16_at(row, 34 * ib) * x.d[ib] * isum as f32;
        }
        sumf
    }

    pub(super) unsafe fn q2_k(row: &[u8], x: &QuantizedAct) -> f32 {
        let three = vdupq_n_u8(3);
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(84).enumerate().take(x.d.len()) {
            crate::prefetch_block(b.as_ptr(), 84);
            let (sc, qs) = (&b[0..16], b.as_ptr().add(16));
            let xq = x.q.as_ptr().add(QK_K * ib);
            let mut isum = 0i32;
            for half in 0..2 {
                for i in 0..2 {
                    // Run s = 8·half + 2j + i: (qs[32·half + 16·i + l] >> 2j) & 3, l < 16.
                    let q = vld1q_u8(qs.add(32 * half + 16 * i));
                    for j in 0..4 {
                        let codes = vandq_u8(vshlq_u8(q, vdupq_n_s8(-2 * j as i8)), three);
                        let s = 8 * half + 2 * j + i;
                        let xv = vld1q_s8(xq.add(16 * s));
                        isum += dot16(vreinterpretq_s8_u8(codes), xv) * (sc[s] & 15) as i32;
                    }
                }
            }
            let summs = q2k_summs(sc, &x.bsums[16 * ib..16 * ib + 16]);
            sumf = combine_affine(sumf, x.d[ib], f16_at(b, 80), f16_at(b, 82), isum, summs);
        }
        sumf
    }

    pub(super) unsafe fn q4_k(row: &[u8], x: &QuantizedAct) -> f32 {
        let fifteen = vdupq_n_u8(15);
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(144).enumerate().take(x.d.len()) {
            crate::prefetch_block(b.as_ptr(), 144);
            let (sc, _) = q4k_unpack(&b[4..16]);
            let qs = b.as_ptr().add(16);
            let xq = x.q.as_ptr().add(QK_K * ib);
            let mut isum = 0i32;
            for c in 0..4 {
                // Sub-block 2c: low nibbles of qs[32c..32c + 32]; 2c + 1: the high nibbles.
                let mut lo = 0i32;
                let mut hi = 0i32;
                for h in 0..2 {
                    let v = vld1q_u8(qs.add(32 * c + 16 * h));
                    let l = vreinterpretq_s8_u8(vandq_u8(v, fifteen));
                    let u = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                    lo += dot16(l, vld1q_s8(xq.add(64 * c + 16 * h)));
                    hi += dot16(u, vld1q_s8(xq.add(64 * c + 32 + 16 * h)));
                }
                isum += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
            }
            let summs = q4k_summs(&b[4..16], &x.bsums[16 * ib..16 * ib + 16]);
            sumf = combine_affine(sumf, x.d[ib], f16_at(b, 0), f16_at(b, 2), isum, summs);
        }
        sumf
    }

    pub(super) unsafe fn iq2_xxs(row: &[u8], x: &QuantizedAct) -> f32 {
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(66).enumerate().take(x.d.len()) {
            crate::prefetch_block(b.as_ptr(), 66);
            let xq = x.q.as_ptr().add(QK_K * ib);
            let mut bsum = 0i32;
            for g in 0..8 {
                let grp = &b[2 + 8 * g..10 + 8 * g];
                let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
                let mut gsum = 0i32;
                for h in 0..2 {
                    // Two grid rows of 8 magnitudes (<= 43: fit i8), times their ±1 signs.
                    let c = 2 * h;
                    let mag = vcombine_u64(
                        vcreate_u64(IQ2XXS_GRID[grp[c] as usize]),
                        vcreate_u64(IQ2XXS_GRID[grp[c + 1] as usize]),
                    );
                    let sgn = vcombine_u64(
                        vcreate_u64(SIGNS_PM1[((aux >> (7 * c)) & 127) as usize]),
                        vcreate_u64(SIGNS_PM1[((aux >> (7 * (c + 1))) & 127) as usize]),
                    );
                    let w = vmulq_s8(vreinterpretq_s8_u64(mag), vreinterpretq_s8_u64(sgn));
                    gsum += dot16(w, vld1q_s8(xq.add(32 * g + 16 * h)));
                }
                bsum += (2 * (aux >> 28) as i32 + 1) * gsum;
            }
            sumf = combine_iq2(sumf, f16_at(b, 0), x.d[ib], bsum);
        }
        0.125 * sumf
    }
}

/// Integer parts: Σ w_i·x_i over 32 codes.
#[inline(always)]
fn idot32(w: &[i8; 32], x: &[i8; 32]) -> i32 {
    w.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// Sums over each run of 16 of `Σ w_i·x_i`, for 256 codes.
#[inline(always)]
fn isums16(w: &[i8; QK_K], x: &[i8; QK_K]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (o, (a, b)) in out
        .iter_mut()
        .zip(w.chunks_exact(16).zip(x.chunks_exact(16)))
    {
        *o = a.iter().zip(b).map(|(&p, &q)| p as i32 * q as i32).sum();
    }
    out
}

/// AVX2 kernels. Invariant: activation codes lie in −127..=127 (the quantisers never produce
/// −128), which the `sign_epi8` trick relies on.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// 16 i16 pair sums → 8 i32 lanes: lanes 0–3 cover bytes 0–15, lanes 4–7 bytes 16–31.
    /// maddubs wants unsigned × signed, so it gets |w| × (x with w's sign); |−128| = 128 as u8
    /// is right, and x ≠ −128 keeps `sign` exact. Pair sums stay within ±2·128·127 (no
    /// saturation).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn mul32(w: *const i8, x: *const i8) -> __m256i {
        let vw = _mm256_loadu_si256(w as *const __m256i);
        let vx = _mm256_loadu_si256(x as *const __m256i);
        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(vw), _mm256_sign_epi8(vx, vw));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum4(v: __m128i) -> i32 {
        let s = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Horizontal sum of 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum8(v: __m256i) -> i32 {
        hsum4(_mm_add_epi32(
            _mm256_castsi256_si128(v),
            _mm256_extracti128_si256::<1>(v),
        ))
    }

    /// Q8_0 × Q8_0, four blocks at a time: the four integer sums are reduced together
    /// (`hadd`), the four products `(dw·dx)·isum` formed in one vector (one rounding each, as the
    /// scalar code), then added to `sumf` one by one in block order.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q8_0(row: &[u8], x: &QuantizedAct) -> f32 {
        let nb = (row.len() / 34).min(x.d.len());
        let rp = row.as_ptr() as *const i8;
        let xp = x.q.as_ptr();
        let mut sumf = 0f32;
        let mut ib = 0;
        while ib + 4 <= nb {
            crate::prefetch_block(row.as_ptr().add(34 * ib), 4 * 34);
            let v: [__m256i; 4] =
                std::array::from_fn(|k| mul32(rp.add(34 * (ib + k) + 2), xp.add(32 * (ib + k))));
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let isums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let scales = _mm_setr_ps(
                f16_at(row, 34 * ib) * x.d[ib],
                f16_at(row, 34 * (ib + 1)) * x.d[ib + 1],
                f16_at(row, 34 * (ib + 2)) * x.d[ib + 2],
                f16_at(row, 34 * (ib + 3)) * x.d[ib + 3],
            );
            let mut t = [0f32; 4];
            _mm_storeu_ps(t.as_mut_ptr(), _mm_mul_ps(scales, _mm_cvtepi32_ps(isums)));
            sumf += t[0];
            sumf += t[1];
            sumf += t[2];
            sumf += t[3];
            ib += 4;
        }
        while ib < nb {
            let isum = hsum8(mul32(rp.add(34 * ib + 2), xp.add(32 * ib)));
            sumf += f16_at(row, 34 * ib) * x.d[ib] * isum as f32;
            ib += 1;
        }
        sumf
    }

    /// Q2_K × Q8_K. Codes are unsigned (0..3), so maddubs takes them directly; each 32-code run
    /// (half, j) covers two scale sub-blocks s = 8·half + 2j (low 128 bits) and s + 1 (high),
    /// applied by `madd` with [sc_s ×8, sc_s+1 ×8], picked from the block's 16 scales by one
    /// byte shuffle (control bytes 0x80 + s keep their high bit: zero bytes).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q2_k(row: &[u8], x: &QuantizedAct) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let m15 = _mm_set1_epi8(15);
        let pick = _mm256_setr_epi8(
            0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 1, -127, 1,
            -127, 1, -127, 1, -127, 1, -127, 1, -127, 1, -127, 1, -127,
        );
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(84).enumerate().take(x.d.len()) {
            crate::prefetch_block(b.as_ptr(), 84);
            let xq = x.q.as_ptr().add(QK_K * ib);
            let sc = _mm_loadu_si128(b.as_ptr() as *const __m128i);
            let scales = _mm256_broadcastsi128_si256(_mm_and_si128(sc, m15));
            let mut acc = [_mm256_setzero_si256(); 2];
            for half in 0..2 {
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * half) as *const __m256i);
                for j in 0..4 {
                    let sh = _mm_cvtsi32_si128(2 * j as i32);
                    let codes = _mm256_and_si256(_mm256_srl_epi16(v, sh), m3);
                    let xv = _mm256_loadu_si256(xq.add(128 * half + 32 * j) as *const __m256i);
                    let p = _mm256_maddubs_epi16(codes, xv);
                    let s = (8 * half + 2 * j) as i8;
                    let sv =
                        _mm256_shuffle_epi8(scales, _mm256_add_epi8(pick, _mm256_set1_epi8(s)));
                    acc[j & 1] = _mm256_add_epi32(acc[j & 1], _mm256_madd_epi16(p, sv));
                }
            }
            // Σ_s bsums[s]·(sc[s] >> 4): the min term's integer part.
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc), m15));
            let bs = _mm256_loadu_si256(x.bsums.as_ptr().add(16 * ib) as *const __m256i);
            let summs = hsum8(_mm256_madd_epi16(bs, mins));
            sumf = combine_affine(
                sumf,
                x.d[ib],
                f16_at(b, 80),
                f16_at(b, 82),
                hsum8(_mm256_add_epi32(acc[0], acc[1])),
                summs,
            );
        }
        sumf
    }

    /// Q4_K × Q8_K: low nibbles of qs[32c..] are sub-block 2c, high nibbles 2c+1.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q4_k(row: &[u8], x: &QuantizedAct) -> f32 {
        let m15 = _mm256_set1_epi8(15);
        // i16 lanes = scale byte j: control bytes (j, 0x80) (0x80 + j keeps the high bit: 0).
        let pick = _mm256_set1_epi16(0x8000u16 as i16);
        let dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(144).enumerate().take(x.d.len()) {
            crate::prefetch_block(b.as_ptr(), 144);
            let (sc, mn) = q4k_unpack(&b[4..16]);
            let scales = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128(i64::from_le_bytes(sc)));
            let xq = x.q.as_ptr().add(QK_K * ib);
            let mut acc = [_mm256_setzero_si256(); 2];
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                let lo = _mm256_and_si256(v, m15);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m15);
                let x0 = _mm256_loadu_si256(xq.add(64 * c) as *const __m256i);
                let x1 = _mm256_loadu_si256(xq.add(64 * c + 32) as *const __m256i);
                let sel = |j: usize| _mm256_add_epi8(pick, _mm256_set1_epi8(j as i8));
                let s0 = _mm256_shuffle_epi8(scales, sel(2 * c));
                let s1 = _mm256_shuffle_epi8(scales, sel(2 * c + 1));
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0);
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1);
                acc[0] = _mm256_add_epi32(acc[0], p0);
                acc[1] = _mm256_add_epi32(acc[1], p1);
            }
            // Σ_b m_b·(bsums[2b] + bsums[2b+1]): each min twice against the 16 sums.
            let mins = _mm_shuffle_epi8(_mm_cvtsi64_si128(i64::from_le_bytes(mn)), dup);
            let bs = _mm256_loadu_si256(x.bsums.as_ptr().add(16 * ib) as *const __m256i);
            let summs = hsum8(_mm256_madd_epi16(bs, _mm256_cvtepu8_epi16(mins)));
            let isum = hsum8(_mm256_add_epi32(acc[0], acc[1]));
            sumf = combine_affine(sumf, x.d[ib], f16_at(b, 0), f16_at(b, 2), isum, summs);
        }
        sumf
    }

    /// IQ2_XXS × Q8_K: grid magnitudes (unsigned) × activation with the weight signs applied
    /// (`sign_epi8` by a ±1 byte mask from [`SIGNS_PM1`], exact because activation codes are
    /// never −128), group scale via `madd`. Two groups an iteration, one accumulator each.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn iq2_xxs(row: &[u8], x: &QuantizedAct) -> f32 {
        let mut sumf = 0f32;
        for (ib, b) in row.chunks_exact(66).enumerate().take(x.d.len()) {
            let xq = x.q.as_ptr().add(QK_K * ib);
            let gp = b.as_ptr().add(2);
            crate::prefetch_block(b.as_ptr(), 66);
            let mut acc = [_mm256_setzero_si256(); 2];
            for g in 0..8 {
                // Group g: 4 grid indices (bytes 0..4), then 4 x 7 sign bits + a 4-bit scale.
                let q = (gp.add(8 * g) as *const u64).read_unaligned();
                let aux = (q >> 32) as u32;
                let gi = |c: usize| IQ2XXS_GRID[*gp.add(8 * g + c) as usize] as i64;
                let grid = _mm256_set_epi64x(gi(3), gi(2), gi(1), gi(0));
                let sgn = _mm256_set_epi64x(
                    SIGNS_PM1[((aux >> 21) & 127) as usize] as i64,
                    SIGNS_PM1[((aux >> 14) & 127) as usize] as i64,
                    SIGNS_PM1[((aux >> 7) & 127) as usize] as i64,
                    SIGNS_PM1[(aux & 127) as usize] as i64,
                );
                let xv = _mm256_loadu_si256(xq.add(32 * g) as *const __m256i);
                let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(xv, sgn));
                let ls = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
                acc[g & 1] = _mm256_add_epi32(acc[g & 1], _mm256_madd_epi16(p, ls));
            }
            let bsum = hsum8(_mm256_add_epi32(acc[0], acc[1]));
            sumf = combine_iq2(sumf, f16_at(b, 0), x.d[ib], bsum);
        }
        0.125 * sumf
    }
}

/// ±1 bytes for each of the 128 IQ2_XS sign patterns (byte j = −1 where bit j of
/// `KSIGNS_IQ2XS[i]` is set, else +1): `sign_epi8`'s operand, made at compile time.
const SIGNS_PM1: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let s = KSIGNS_IQ2XS[i];
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if (s >> j) & 1 != 0 { 0xff } else { 0x01 };
            t[i] |= byte << (8 * j);
            j += 1;
        }
        i += 1;
    }
    t
};

/// Per-block f32 combination for the affine K-quants, shared by every path so results agree
/// bit for bit: `sumf + (dx·d·isum − dx·dmin·summs)` (ds4's `dall·isum − dmin·summs`).
#[inline(always)]
fn combine_affine(sumf: f32, dx: f32, d: f32, dmin: f32, isum: i32, summs: i32) -> f32 {
    let dall = dx * d;
    let dm = dx * dmin;
    sumf + (dall * isum as f32 - dm * summs as f32)
}

/// Per-block f32 combination for IQ2_XXS: `sumf + (d·dx)·bsum` (the final ·0.125 is applied
/// once after the loop).
#[inline(always)]
fn combine_iq2(sumf: f32, d: f32, dx: f32, bsum: i32) -> f32 {
    sumf + d * dx * bsum as f32
}

/// Q2_K `Σ_s bsums[s]·(sc[s] >> 4)` (the min term's integer part).
#[inline(always)]
fn q2k_summs(sc: &[u8], bs: &[i16]) -> i32 {
    bs.iter()
        .zip(sc)
        .map(|(&s, &c)| s as i32 * (c >> 4) as i32)
        .sum()
}

/// A Q4_K block's 8 six-bit scales and 8 six-bit mins from its 12 packed bytes (the same values
/// as [`q4k_scale_min`], by whole-word bit operations).
#[inline(always)]
fn q4k_unpack(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    let w = |i: usize| u32::from_le_bytes([p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    // Scales 0-3: low 6 bits of bytes 0-3; 4-7: low nibbles of bytes 8-11, top 2 bits of 0-3.
    let sc_lo = w0 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
    // Mins 0-3: low 6 bits of bytes 4-7; 4-7: high nibbles of bytes 8-11, top 2 bits of 4-7.
    let mn_lo = w1 & LOW6;
    let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
    let join = |a: u32, b: u32| (a as u64 | (b as u64) << 32).to_le_bytes();
    (join(sc_lo, sc_hi), join(mn_lo, mn_hi))
}

/// Q4_K `Σ_b m_b·(bsums[2b] + bsums[2b+1])`.
#[inline(always)]
fn q4k_summs(scales: &[u8], bs: &[i16]) -> i32 {
    (0..8)
        .map(|b| q4k_scale_min(scales, b).1 as i32 * (bs[2 * b] as i32 + bs[2 * b + 1] as i32))
        .sum()
}

/// The portable block loop; the per-block f32 combination is in block order (as on AVX2).
#[inline(always)]
fn dot_act_blocks(ty: GgmlType, row: &[u8], x: &QuantizedAct) -> f32 {
    let mut sumf = 0f32;
    let mut codes = [0i8; QK_K];
    let xblock = |ib: usize| -> &[i8; QK_K] { x.q[QK_K * ib..QK_K * (ib + 1)].try_into().unwrap() };
    match ty {
        GgmlType::Q8_0 => {
            for ((b, xq), &dx) in row.chunks_exact(34).zip(x.q.chunks_exact(32)).zip(&x.d) {
                let w = as_i8_32(&b[2..34]);
                let isum = idot32(w, xq.try_into().unwrap());
                sumf += f16_at(b, 0) * dx * isum as f32;
            }
        }
        GgmlType::Q2_K => {
            for (ib, b) in row.chunks_exact(84).enumerate().take(x.d.len()) {
                let (sc, qs) = (&b[0..16], &b[16..80]);
                // Codes in element order: weight 128·half + 32j + l is (qs[32·half + l] >> 2j) & 3,
                // so run s of 16 weights has scale byte s.
                for half in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            codes[128 * half + 32 * j + l] =
                                ((qs[32 * half + l] >> (2 * j)) & 3) as i8;
                        }
                    }
                }
                let s16 = isums16(&codes, xblock(ib));
                let summs = q2k_summs(sc, &x.bsums[16 * ib..16 * ib + 16]);
                let isum: i32 = s16.iter().zip(sc).map(|(&v, &c)| v * (c & 15) as i32).sum();
                let dall = x.d[ib] * f16_at(b, 80);
                let dmin = x.d[ib] * f16_at(b, 82);
                sumf += dall * isum as f32 - dmin * summs as f32;
            }
        }
        GgmlType::Q4_K => {
            for (ib, b) in row.chunks_exact(144).enumerate().take(x.d.len()) {
                let (scales, qs) = (&b[4..16], &b[16..144]);
                for c in 0..4 {
                    for l in 0..32 {
                        codes[64 * c + l] = (qs[32 * c + l] & 15) as i8;
                        codes[64 * c + 32 + l] = (qs[32 * c + l] >> 4) as i8;
                    }
                }
                let s16 = isums16(&codes, xblock(ib));
                let summs = q4k_summs(scales, &x.bsums[16 * ib..16 * ib + 16]);
                let isum: i32 = (0..8)
                    .map(|sb| q4k_scale_min(scales, sb).0 as i32 * (s16[2 * sb] + s16[2 * sb + 1]))
                    .sum();
                sumf = combine_affine(sumf, x.d[ib], f16_at(b, 0), f16_at(b, 2), isum, summs);
            }
        }
        GgmlType::IQ2_XXS => {
            for (ib, b) in row.chunks_exact(66).enumerate().take(x.d.len()) {
                let mut ls = [0i32; 8];
                for g in 0..8 {
                    let grp = &b[2 + 8 * g..10 + 8 * g];
                    let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
                    ls[g] = 2 * (aux >> 28) as i32 + 1;
                    for c in 0..4 {
                        let grid = IQ2XXS_GRID[grp[c] as usize].to_le_bytes();
                        let signs = KSIGNS_IQ2XS[((aux >> (7 * c)) & 127) as usize];
                        for j in 0..8 {
                            let v = grid[j] as i8;
                            codes[32 * g + 8 * c + j] = if signs >> j & 1 != 0 { -v } else { v };
                        }
                    }
                }
                let s16 = isums16(&codes, xblock(ib));
                // w = d·(0.5 + ls)·0.25·g·s = d·(2·ls + 1)·g·s / 8
                let bsum: i32 = (0..8).map(|g| ls[g] * (s16[2 * g] + s16[2 * g + 1])).sum();
                sumf = combine_iq2(sumf, f16_at(b, 0), x.d[ib], bsum);
            }
            sumf *= 0.125;
        }
        _ => {}
    }
    sumf
}

#[inline(always)]
fn as_i8_32(b: &[u8]) -> &[i8; 32] {
    assert_eq!(b.len(), 32);
    // SAFETY: u8 and i8 have the same size and alignment; the slice is exactly 32 bytes.
    unsafe { &*(b.as_ptr() as *const [i8; 32]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word-wise unpacking gives `q4k_scale_min`'s values for every byte pattern of each
    /// position (and random blocks).
    #[test]
    fn q4k_unpack_matches_the_bytewise_form() {
        let mut s = 0x1234_5678_9abc_def1u64;
        for _ in 0..2000 {
            let mut p = [0u8; 12];
            for b in p.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *b = s as u8;
            }
            let (sc, mn) = q4k_unpack(&p);
            for j in 0..8 {
                assert_eq!((sc[j], mn[j]), q4k_scale_min(&p, j), "{p:?} sub-block {j}");
            }
        }
    }
}
