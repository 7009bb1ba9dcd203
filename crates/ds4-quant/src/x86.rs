//! x86-64 dot products: AVX2+FMA+F16C (8 lanes) and AVX-512F (16 lanes).
//!
//! Weights are formed exactly as the dequantiser forms them (the products `d·sc·q`, `db·grid`
//! are exact in f32, and `fmsub(dl, q, ml)` rounds once like `dl·q − ml` does because `dl·q` is
//! exact), so these kernels differ from the portable path only in summation order. For Q8_0 and
//! IQ2_XXS the per-block scale is applied after summing `q·x` within the block, which is one
//! extra rounding per block.
//!
//! Every kernel works on `min(whole blocks in row, whole blocks in x)` so it never reads out of
//! bounds; the public wrappers are only handed out by `dot_kernel_for` after the ISA check.

use std::arch::x86_64::*;

use crate::iq2_tables::KSIGNS_IQ2XS;
use crate::portable::{iq2_db, q4k_factors, GRID_F32, QK_K, SIGN_MASKS};
use crate::{f16_at, GgmlType};

type RawDot = fn(&[u8], &[f32]) -> f32;

/// `PF`: whether the kernel prefetches the row's bytes ahead ([`crate::prefetch_block`]); the
/// forms without it serve rows already in cache (a prompt's second and later tokens).
pub(crate) fn avx2_dot_fn<const PF: bool>(ty: GgmlType) -> RawDot {
    // SAFETY (all closures): handed out only when AVX2+FMA+F16C were detected.
    match ty {
        GgmlType::F32 => |r, x| unsafe { avx2::dot_f32::<PF>(r, x) },
        GgmlType::F16 => |r, x| unsafe { avx2::dot_f16::<PF>(r, x) },
        GgmlType::BF16 => |r, x| unsafe { avx2::dot_bf16::<PF>(r, x) },
        GgmlType::Q8_0 => |r, x| unsafe { avx2::dot_q8_0::<PF>(r, x) },
        GgmlType::Q2_K => |r, x| unsafe { avx2::dot_q2_k::<PF>(r, x) },
        GgmlType::Q4_K => |r, x| unsafe { avx2::dot_q4_k::<PF>(r, x) },
        GgmlType::IQ2_XXS => |r, x| unsafe { avx2::dot_iq2_xxs::<PF>(r, x) },
        _ => unreachable!("caller checked the type is supported"),
    }
}

pub(crate) fn avx512_dot_fn<const PF: bool>(ty: GgmlType) -> RawDot {
    // SAFETY (all closures): handed out only when AVX-512F and F16C were detected.
    match ty {
        GgmlType::F32 => |r, x| unsafe { avx512::dot_f32::<PF>(r, x) },
        GgmlType::F16 => |r, x| unsafe { avx512::dot_f16::<PF>(r, x) },
        GgmlType::BF16 => |r, x| unsafe { avx512::dot_bf16::<PF>(r, x) },
        GgmlType::Q8_0 => |r, x| unsafe { avx512::dot_q8_0::<PF>(r, x) },
        GgmlType::Q2_K => |r, x| unsafe { avx512::dot_q2_k::<PF>(r, x) },
        GgmlType::Q4_K => |r, x| unsafe { avx512::dot_q4_k::<PF>(r, x) },
        GgmlType::IQ2_XXS => |r, x| unsafe { avx512::dot_iq2_xxs::<PF>(r, x) },
        _ => unreachable!("caller checked the type is supported"),
    }
}

use crate::RawDot4;

/// AVX2 kernels that take four tokens a pass over the row (prompt batches): as
/// [`avx512_dot4_fn`].
pub(crate) fn avx2_dot4_fn<const PF: bool>(ty: GgmlType) -> Option<RawDot4> {
    // SAFETY (all closures): handed out only when AVX2+FMA+F16C were detected.
    match ty {
        GgmlType::Q8_0 => Some(|r, x| unsafe { avx2::dot_n_q8_0::<PF, 4>(r, x) }),
        GgmlType::Q2_K => Some(|r, x| unsafe { avx2::dot_n_q2_k::<PF, 4>(r, x) }),
        GgmlType::Q4_K => Some(|r, x| unsafe { avx2::dot_n_q4_k::<PF, 4>(r, x) }),
        GgmlType::IQ2_XXS => Some(|r, x| unsafe { avx2::dot_n_iq2_xxs::<PF, 4>(r, x) }),
        _ => None,
    }
}

/// AVX-512 kernels that take four tokens a pass over the row (prompt batches): the row's codes
/// are unpacked once for all four, and each token's sums run through exactly the operations,
/// in the same order, of its one-token kernel (the same code with one token), so every result
/// is that kernel's bits. None for the types without one (they run token by token).
pub(crate) fn avx512_dot4_fn<const PF: bool>(ty: GgmlType) -> Option<RawDot4> {
    // SAFETY (all closures): handed out only when AVX-512F and F16C were detected.
    match ty {
        GgmlType::Q8_0 => Some(|r, x| unsafe { avx512::dot_n_q8_0::<PF, 4>(r, x) }),
        GgmlType::Q2_K => Some(|r, x| unsafe { avx512::dot_n_q2_k::<PF, 4>(r, x) }),
        GgmlType::Q4_K => Some(|r, x| unsafe { avx512::dot_n_q4_k::<PF, 4>(r, x) }),
        GgmlType::IQ2_XXS => Some(|r, x| unsafe { avx512::dot_n_iq2_xxs::<PF, 4>(r, x) }),
        _ => None,
    }
}

#[inline(always)]
fn f16_bits_to_f32(b: u16) -> f32 {
    crate::f16_to_f32(b)
}

#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Elements of a scalar-typed row usable with `x` (element size `es`).
#[inline(always)]
fn scalar_len(row: &[u8], x: &[f32], es: usize) -> usize {
    (row.len() / es).min(x.len())
}

/// Whole blocks present in both the row and `x`.
#[inline(always)]
fn block_count(row: &[u8], x: &[f32], bb: usize, be: usize) -> usize {
    (row.len() / bb).min(x.len() / be)
}

/// Whole blocks present in the row and in every token of `xs`.
#[inline(always)]
fn block_count_n<const T: usize>(row: &[u8], xs: &[&[f32]; T], bb: usize, be: usize) -> usize {
    xs.iter()
        .map(|x| block_count(row, x, bb, be))
        .min()
        .unwrap_or(0)
}

mod avx2 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// 8 unsigned bytes at `p` widened to 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn u8x8(p: *const u8) -> __m256i {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f32<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 4);
        let (w, xp) = (row.as_ptr() as *const f32, x.as_ptr());
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            if PF {
                crate::prefetch_block((w as *const u8).add(4 * i), 128);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 8 * k;
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(o)), _mm256_loadu_ps(xp.add(o)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(i)), _mm256_loadu_ps(xp.add(i)), a[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ));
        while i < n {
            s += w.add(i).read_unaligned() * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 2);
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let ld = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * o) as *const __m128i));
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            if PF {
                crate::prefetch_block(w.add(2 * i), 64);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 8 * k;
                *acc = _mm256_fmadd_ps(ld(o), _mm256_loadu_ps(xp.add(o)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            a[0] = _mm256_fmadd_ps(ld(i), _mm256_loadu_ps(xp.add(i)), a[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ));
        while i < n {
            s += f16_bits_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_bf16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 2);
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let ld = |o: usize| {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * o) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        };
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            if PF {
                crate::prefetch_block(w.add(2 * i), 64);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 8 * k;
                *acc = _mm256_fmadd_ps(ld(o), _mm256_loadu_ps(xp.add(o)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            a[0] = _mm256_fmadd_ps(ld(i), _mm256_loadu_ps(xp.add(i)), a[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ));
        while i < n {
            s += bf16_bits_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q8_0::<PF, 1>(row, [x])[0]
    }

    /// Q8_0 for `T` tokens: each block's codes converted once, each token's sums in its own
    /// accumulators (one token: [`dot_q8_0`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_n_q8_0<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 34, 32);
        let mut total = [[_mm256_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let b = row.as_ptr().add(34 * ib);
            if PF {
                crate::prefetch_block(b, 34);
            }
            // F16C conversion of the scale (exact; the scale is finite in valid data, and a NaN
            // scale gives NaN either way).
            let d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([
                row[34 * ib],
                row[34 * ib + 1],
            ]) as i32)));
            let q: [__m256; 4] = std::array::from_fn(|k| {
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * k) as *const __m128i));
                _mm256_cvtepi32_ps(v)
            });
            for (x, tot) in xs.iter().zip(total.iter_mut()) {
                let xp = x.as_ptr().add(32 * ib);
                let mut s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                let mut s1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xp.add(8)));
                s0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), s0);
                s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), s1);
                tot[ib & 1] = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), tot[ib & 1]);
            }
        }
        total.map(|t| hsum(_mm256_add_ps(t[0], t[1])))
    }

    /// Q2_K sub-block factors `d·(sc & 15)` and `dmin·(sc >> 4)` for the 16 scale bytes
    /// (exact products, as in the dequantiser).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k_factors(blk: &[u8], dl: &mut [f32; 16], ml: &mut [f32; 16]) {
        let d = _mm256_set1_ps(f16_at(blk, 80));
        let dmin = _mm256_set1_ps(f16_at(blk, 82));
        for h in 0..2 {
            let s = u8x8(blk.as_ptr().add(8 * h));
            let lo = _mm256_cvtepi32_ps(_mm256_and_si256(s, _mm256_set1_epi32(15)));
            let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(s));
            _mm256_storeu_ps(dl.as_mut_ptr().add(8 * h), _mm256_mul_ps(d, lo));
            _mm256_storeu_ps(ml.as_mut_ptr().add(8 * h), _mm256_mul_ps(dmin, hi));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q2_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q2_k::<PF, 1>(row, [x])[0]
    }

    /// Q2_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
    /// accumulators (one token: [`dot_q2_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_n_q2_k<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 84, QK_K);
        let three = _mm256_set1_epi32(3);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let (mut dls, mut mls) = ([0f32; 16], [0f32; 16]);
        for ib in 0..nb {
            let blk = &row[84 * ib..84 * ib + 84];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 84);
            }
            let qs = blk.as_ptr().add(16);
            q2k_factors(blk, &mut dls, &mut mls);
            for half in 0..2 {
                for i in 0..2 {
                    // 16 weights per (half, i, j) share the bytes qs[32·half + 16·i ..][..16].
                    let lo = u8x8(qs.add(32 * half + 16 * i));
                    let hi = u8x8(qs.add(32 * half + 16 * i + 8));
                    for j in 0..4 {
                        let s = 8 * half + 2 * j + i;
                        let dl = _mm256_set1_ps(dls[s]);
                        let ml = _mm256_set1_ps(mls[s]);
                        let sh = _mm_cvtsi32_si128(2 * j as i32);
                        let q0 = _mm256_and_si256(_mm256_srl_epi32(lo, sh), three);
                        let q1 = _mm256_and_si256(_mm256_srl_epi32(hi, sh), three);
                        let w0 = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(q0), ml);
                        let w1 = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(q1), ml);
                        let o = QK_K * ib + 128 * half + 32 * j + 16 * i;
                        for (x, a) in xs.iter().zip(acc.iter_mut()) {
                            let xo = x.as_ptr().add(o);
                            a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xo), a[0]);
                            a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xo.add(8)), a[1]);
                        }
                    }
                }
            }
        }
        acc.map(|a| hsum(_mm256_add_ps(a[0], a[1])))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q4_k::<PF, 1>(row, [x])[0]
    }

    /// Q4_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
    /// accumulators (one token: [`dot_q4_k`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_n_q4_k<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 144, QK_K);
        let fifteen = _mm256_set1_epi32(15);
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let blk = &row[144 * ib..144 * ib + 144];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 144);
            }
            let qs = blk.as_ptr().add(16);
            let (dl, ml) = q4k_factors(blk);
            for c in 0..4 {
                let dl0 = _mm256_set1_ps(dl[2 * c]);
                let ml0 = _mm256_set1_ps(ml[2 * c]);
                let dl1 = _mm256_set1_ps(dl[2 * c + 1]);
                let ml1 = _mm256_set1_ps(ml[2 * c + 1]);
                for t in 0..4 {
                    let v = u8x8(qs.add(32 * c + 8 * t));
                    let qlo = _mm256_cvtepi32_ps(_mm256_and_si256(v, fifteen));
                    let qhi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                    let w0 = _mm256_fmsub_ps(dl0, qlo, ml0);
                    let w1 = _mm256_fmsub_ps(dl1, qhi, ml1);
                    let o = QK_K * ib + 64 * c + 8 * t;
                    for (x, a) in xs.iter().zip(acc.iter_mut()) {
                        let xo = x.as_ptr().add(o);
                        a[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xo), a[0]);
                        a[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xo.add(32)), a[1]);
                    }
                }
            }
        }
        acc.map(|a| hsum(_mm256_add_ps(a[0], a[1])))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_iq2_xxs<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_iq2_xxs::<PF, 1>(row, [x])[0]
    }

    /// IQ2_XXS for `T` tokens: each group's signed grid vectors formed once (one token:
    /// [`dot_iq2_xxs`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_n_iq2_xxs<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 66, QK_K);
        let mut total = [[_mm256_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let blk = &row[66 * ib..66 * ib + 66];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 66);
            }
            let d = f16_at(blk, 0);
            for g in 0..8 {
                let grp = &blk[2 + 8 * g..10 + 8 * g];
                let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
                // Magnitudes from the f32 grid, signs by XOR with the expanded sign mask.
                let w: [__m256; 4] = std::array::from_fn(|c| {
                    let gv = _mm256_loadu_ps(GRID_F32[grp[c] as usize].as_ptr());
                    let m = SIGN_MASKS[((aux >> (7 * c)) & 127) as usize].as_ptr();
                    _mm256_xor_ps(gv, _mm256_loadu_ps(m as *const f32))
                });
                let db = _mm256_set1_ps(iq2_db(d, aux));
                for (x, tot) in xs.iter().zip(total.iter_mut()) {
                    let xb = x.as_ptr().add(QK_K * ib + 32 * g);
                    let mut sg = [_mm256_setzero_ps(); 2];
                    for (c, wc) in w.iter().enumerate() {
                        let xv = _mm256_loadu_ps(xb.add(8 * c));
                        sg[c & 1] = _mm256_fmadd_ps(*wc, xv, sg[c & 1]);
                    }
                    tot[g & 1] = _mm256_fmadd_ps(db, _mm256_add_ps(sg[0], sg[1]), tot[g & 1]);
                }
            }
        }
        total.map(|t| hsum(_mm256_add_ps(t[0], t[1])))
    }
}

mod avx512 {
    use super::*;

    /// 16 unsigned bytes at `p` widened to 16 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn u8x16(p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_f32<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 4);
        let (w, xp) = (row.as_ptr() as *const f32, x.as_ptr());
        let mut a = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            if PF {
                crate::prefetch_block((w as *const u8).add(4 * i), 256);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 16 * k;
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(w.add(o)), _mm512_loadu_ps(xp.add(o)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w.add(i)), _mm512_loadu_ps(xp.add(i)), a[0]);
            i += 16;
        }
        if i < n {
            // Masked tail: lanes past n are neither read nor added.
            let k: __mmask16 = (1u32 << (n - i)) as u16 - 1;
            let wv = _mm512_maskz_loadu_ps(k, w.add(i));
            let xv = _mm512_maskz_loadu_ps(k, xp.add(i));
            a[1] = _mm512_fmadd_ps(wv, xv, a[1]);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(a[0], a[1]),
            _mm512_add_ps(a[2], a[3]),
        ))
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_f16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 2);
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let ld = |o: usize| _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * o) as *const __m256i));
        let mut a = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            if PF {
                crate::prefetch_block(w.add(2 * i), 128);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 16 * k;
                *acc = _mm512_fmadd_ps(ld(o), _mm512_loadu_ps(xp.add(o)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            a[0] = _mm512_fmadd_ps(ld(i), _mm512_loadu_ps(xp.add(i)), a[0]);
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(a[0], a[1]),
            _mm512_add_ps(a[2], a[3]),
        ));
        while i < n {
            s += f16_bits_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_bf16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        let n = scalar_len(row, x, 2);
        let (w, xp) = (row.as_ptr(), x.as_ptr());
        let ld = |o: usize| {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(2 * o) as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        };
        let mut a = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            if PF {
                crate::prefetch_block(w.add(2 * i), 128);
            }
            for (k, acc) in a.iter_mut().enumerate() {
                let o = i + 16 * k;
                *acc = _mm512_fmadd_ps(ld(o), _mm512_loadu_ps(xp.add(o)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            a[0] = _mm512_fmadd_ps(ld(i), _mm512_loadu_ps(xp.add(i)), a[0]);
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(a[0], a[1]),
            _mm512_add_ps(a[2], a[3]),
        ));
        while i < n {
            s += bf16_bits_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_q8_0<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q8_0::<PF, 1>(row, [x])[0]
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_q2_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q2_k::<PF, 1>(row, [x])[0]
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_q4_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_q4_k::<PF, 1>(row, [x])[0]
    }

    /// Q4_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
    /// accumulators (one token: [`dot_q4_k`]).
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_n_q4_k<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 144, QK_K);
        let fifteen = _mm512_set1_epi32(15);
        let mut acc = [[_mm512_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let blk = &row[144 * ib..144 * ib + 144];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 144);
            }
            let qs = blk.as_ptr().add(16);
            let (dl, ml) = q4k_factors(blk);
            for c in 0..4 {
                let dl0 = _mm512_set1_ps(dl[2 * c]);
                let ml0 = _mm512_set1_ps(ml[2 * c]);
                let dl1 = _mm512_set1_ps(dl[2 * c + 1]);
                let ml1 = _mm512_set1_ps(ml[2 * c + 1]);
                for t in 0..2 {
                    let v = u8x16(qs.add(32 * c + 16 * t));
                    let qlo = _mm512_cvtepi32_ps(_mm512_and_si512(v, fifteen));
                    let qhi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                    let w0 = _mm512_fmsub_ps(dl0, qlo, ml0);
                    let w1 = _mm512_fmsub_ps(dl1, qhi, ml1);
                    let o = QK_K * ib + 64 * c + 16 * t;
                    for (x, a) in xs.iter().zip(acc.iter_mut()) {
                        let xo = x.as_ptr().add(o);
                        a[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xo), a[0]);
                        a[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xo.add(32)), a[1]);
                    }
                }
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }

    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_iq2_xxs<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
        dot_n_iq2_xxs::<PF, 1>(row, [x])[0]
    }

    /// Q8_0 for `T` tokens: each block's `q` and `d` formed once, each token's sums in its own
    /// accumulators (one token: [`dot_q8_0`]).
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_n_q8_0<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 34, 32);
        let mut total = [[_mm512_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let b = row.as_ptr().add(34 * ib);
            if PF {
                crate::prefetch_block(b, 34);
            }
            let d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([
                row[34 * ib],
                row[34 * ib + 1],
            ]) as i32)));
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                b.add(2) as *const __m128i
            )));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                b.add(18) as *const __m128i
            )));
            for (x, tot) in xs.iter().zip(total.iter_mut()) {
                let xp = x.as_ptr().add(32 * ib);
                let s = _mm512_fmadd_ps(
                    q1,
                    _mm512_loadu_ps(xp.add(16)),
                    _mm512_mul_ps(q0, _mm512_loadu_ps(xp)),
                );
                tot[ib & 1] = _mm512_fmadd_ps(d, s, tot[ib & 1]);
            }
        }
        total.map(|t| _mm512_reduce_add_ps(_mm512_add_ps(t[0], t[1])))
    }

    /// Q2_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
    /// accumulators (one token: [`dot_q2_k`]).
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_n_q2_k<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 84, QK_K);
        let three = _mm512_set1_epi32(3);
        let mut acc = [[_mm512_setzero_ps(); 2]; T];
        let (mut dls, mut mls) = ([0f32; 16], [0f32; 16]);
        for ib in 0..nb {
            let blk = &row[84 * ib..84 * ib + 84];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 84);
            }
            let qs = blk.as_ptr().add(16);
            let sc = u8x16(blk.as_ptr());
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc));
            _mm512_storeu_ps(
                dls.as_mut_ptr(),
                _mm512_mul_ps(_mm512_set1_ps(f16_at(blk, 80)), lo),
            );
            _mm512_storeu_ps(
                mls.as_mut_ptr(),
                _mm512_mul_ps(_mm512_set1_ps(f16_at(blk, 82)), hi),
            );
            for half in 0..2 {
                for i in 0..2 {
                    let v = u8x16(qs.add(32 * half + 16 * i));
                    for j in 0..4 {
                        let s = 8 * half + 2 * j + i;
                        let dl = _mm512_set1_ps(dls[s]);
                        let ml = _mm512_set1_ps(mls[s]);
                        let sh = _mm_cvtsi32_si128(2 * j as i32);
                        let q = _mm512_and_si512(_mm512_srl_epi32(v, sh), three);
                        let w = _mm512_fmsub_ps(dl, _mm512_cvtepi32_ps(q), ml);
                        let o = QK_K * ib + 128 * half + 32 * j + 16 * i;
                        for (x, a) in xs.iter().zip(acc.iter_mut()) {
                            a[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x.as_ptr().add(o)), a[i]);
                        }
                    }
                }
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }

    /// IQ2_XXS for `T` tokens: each group's signed grid vectors formed once (one token:
    /// [`dot_iq2_xxs`]).
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_n_iq2_xxs<const PF: bool, const T: usize>(
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let nb = block_count_n(row, &xs, 66, QK_K);
        let zero = _mm512_setzero_ps();
        let mut total = [[_mm512_setzero_ps(); 2]; T];
        for ib in 0..nb {
            let blk = &row[66 * ib..66 * ib + 66];
            if PF {
                crate::prefetch_block(blk.as_ptr(), 66);
            }
            let d = f16_at(blk, 0);
            for g in 0..8 {
                let grp = &blk[2 + 8 * g..10 + 8 * g];
                let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
                let mut w = [zero; 2];
                for (h, wh) in w.iter_mut().enumerate() {
                    let g0 = _mm256_loadu_ps(GRID_F32[grp[2 * h] as usize].as_ptr());
                    let g1 = _mm256_loadu_ps(GRID_F32[grp[2 * h + 1] as usize].as_ptr());
                    let gv = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(_mm256_castps_pd(g0)),
                        _mm256_castps_pd(g1),
                    ));
                    let s0 = KSIGNS_IQ2XS[((aux >> (14 * h)) & 127) as usize] as u16;
                    let s1 = KSIGNS_IQ2XS[((aux >> (14 * h + 7)) & 127) as usize] as u16;
                    *wh = _mm512_mask_sub_ps(gv, s0 | (s1 << 8), zero, gv);
                }
                let db = _mm512_set1_ps(iq2_db(d, aux));
                for (x, tot) in xs.iter().zip(total.iter_mut()) {
                    let xb = x.as_ptr().add(QK_K * ib + 32 * g);
                    // sg[h] starts at zero: fma(w, x, 0) as in the one-token kernel.
                    let sg0 = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), zero);
                    let sg1 = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb.add(16)), zero);
                    tot[g & 1] = _mm512_fmadd_ps(db, _mm512_add_ps(sg0, sg1), tot[g & 1]);
                }
            }
        }
        total.map(|t| _mm512_reduce_add_ps(_mm512_add_ps(t[0], t[1])))
    }
}
