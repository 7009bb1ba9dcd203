//! AArch64 dot products on NEON (Advanced SIMD: 4 f32 lanes, part of every AArch64 CPU, so no
//! run-time detection): Apple silicon, Graviton, Ampere, NVIDIA Grace.
//!
//! The same contract as the x86 kernels (`x86.rs`): every weight is formed exactly as the
//! dequantiser forms it (`d·sc` and `db·grid` are exact f32 products; `dl·q − ml` rounds once
//! whether fused or not, since `dl·q` is exact), so only the summation order differs from the
//! portable path; Q8_0 and IQ2_XXS apply the block / group scale after summing `q·x` within it
//! (one more rounding). Each kernel covers `min(whole blocks in row, whole blocks in x)`, so a
//! mismatched call is truncated, never out of bounds.

use std::arch::aarch64::*;

use crate::portable::{iq2_db, q4k_factors, GRID_F32, QK_K, SIGN_MASKS};
use crate::{f16_at, f16_to_f32, GgmlType};

type RawDot = fn(&[u8], &[f32]) -> f32;

/// `PF`: whether the kernel asks for the row's bytes ahead ([`crate::prefetch_block`]); the
/// forms without serve rows already in cache (a prompt's second and later tokens).
pub(crate) fn dot_fn<const PF: bool>(ty: GgmlType) -> RawDot {
    // SAFETY (all closures): NEON is a baseline feature of the aarch64 targets.
    match ty {
        GgmlType::F32 => |r, x| unsafe { dot_f32::<PF>(r, x) },
        GgmlType::F16 => |r, x| unsafe { dot_f16::<PF>(r, x) },
        GgmlType::BF16 => |r, x| unsafe { dot_bf16::<PF>(r, x) },
        GgmlType::Q8_0 => |r, x| unsafe { dot_q8_0::<PF>(r, x) },
        GgmlType::Q2_K => |r, x| unsafe { dot_q2_k::<PF>(r, x) },
        GgmlType::Q4_K => |r, x| unsafe { dot_q4_k::<PF>(r, x) },
        GgmlType::IQ2_XXS => |r, x| unsafe { dot_iq2_xxs::<PF>(r, x) },
        _ => unreachable!("caller checked the type is supported"),
    }
}

/// Sum of 4 accumulators' lanes: `(a0 + a1) + (a2 + a3)`, then the lanes.
#[inline(always)]
unsafe fn hsum4(a: [float32x4_t; 4]) -> f32 {
    vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])))
}

/// 4 f16 bit patterns (widened to u32 lanes) as f32, exactly as [`f16_to_f32`] converts them
/// (NaN payloads kept): the exponent and mantissa moved into place and rescaled by 2^112, the
/// exponent forced to 255 for Inf / NaN, the sign put back.
#[inline(always)]
unsafe fn f16x4(h: uint32x4_t) -> float32x4_t {
    let me = vandq_u32(h, vdupq_n_u32(0x7fff));
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    let scaled = vmulq_f32(
        vreinterpretq_f32_u32(vshlq_n_u32::<13>(me)),
        vdupq_n_f32(f32::from_bits((127 + 112) << 23)),
    );
    let inf_nan = vandq_u32(vcgtq_u32(me, vdupq_n_u32(0x7bff)), vdupq_n_u32(0x7f80_0000));
    vreinterpretq_f32_u32(vorrq_u32(
        vorrq_u32(vreinterpretq_u32_f32(scaled), inf_nan),
        sign,
    ))
}

/// 8 f16 at `p` as two f32 vectors.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> (float32x4_t, float32x4_t) {
    let h = vld1q_u16(p as *const u16);
    (
        f16x4(vmovl_u16(vget_low_u16(h))),
        f16x4(vmovl_u16(vget_high_u16(h))),
    )
}

/// 8 bf16 at `p` as two f32 vectors (the bits shifted into place: exact).
#[inline(always)]
unsafe fn bf16x8(p: *const u8) -> (float32x4_t, float32x4_t) {
    let h = vld1q_u16(p as *const u16);
    (
        vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
        vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(h))),
    )
}

/// 8 unsigned bytes at `p` as two f32 vectors.
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> (uint32x4_t, uint32x4_t) {
    let w = vmovl_u8(vld1_u8(p));
    (vmovl_u16(vget_low_u16(w)), vmovl_u16(vget_high_u16(w)))
}

unsafe fn dot_f32<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    let n = (row.len() / 4).min(x.len());
    let (w, xp) = (row.as_ptr() as *const f32, x.as_ptr());
    let mut a = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        if PF {
            crate::prefetch_block((w as *const u8).add(4 * i), 64);
        }
        for (k, acc) in a.iter_mut().enumerate() {
            let o = i + 4 * k;
            *acc = vfmaq_f32(*acc, vld1q_f32(w.add(o)), vld1q_f32(xp.add(o)));
        }
        i += 16;
    }
    while i + 4 <= n {
        a[0] = vfmaq_f32(a[0], vld1q_f32(w.add(i)), vld1q_f32(xp.add(i)));
        i += 4;
    }
    let mut s = hsum4(a);
    while i < n {
        s += w.add(i).read_unaligned() * x[i];
        i += 1;
    }
    s
}

/// F16 / BF16 rows: 16 elements an iteration, `ld` converting 8 at a byte address.
#[inline(always)]
unsafe fn dot_half<const PF: bool>(
    row: &[u8],
    x: &[f32],
    ld: unsafe fn(*const u8) -> (float32x4_t, float32x4_t),
    conv: fn(u16) -> f32,
) -> f32 {
    let n = (row.len() / 2).min(x.len());
    let (w, xp) = (row.as_ptr(), x.as_ptr());
    let mut a = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        if PF {
            crate::prefetch_block(w.add(2 * i), 32);
        }
        let (w0, w1) = ld(w.add(2 * i));
        let (w2, w3) = ld(w.add(2 * i + 16));
        a[0] = vfmaq_f32(a[0], w0, vld1q_f32(xp.add(i)));
        a[1] = vfmaq_f32(a[1], w1, vld1q_f32(xp.add(i + 4)));
        a[2] = vfmaq_f32(a[2], w2, vld1q_f32(xp.add(i + 8)));
        a[3] = vfmaq_f32(a[3], w3, vld1q_f32(xp.add(i + 12)));
        i += 16;
    }
    let mut s = hsum4(a);
    while i < n {
        s += conv(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])) * x[i];
        i += 1;
    }
    s
}

unsafe fn dot_f16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_half::<PF>(row, x, f16x8, f16_to_f32)
}

unsafe fn dot_bf16<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_half::<PF>(row, x, bf16x8, |b| f32::from_bits((b as u32) << 16))
}

unsafe fn dot_q8_0<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_n_q8_0::<PF, 1>(row, [x])[0]
}

/// Whole blocks present in the row and in every token of `xs`.
#[inline(always)]
fn block_count_n<const T: usize>(row: &[u8], xs: &[&[f32]; T], bb: usize, be: usize) -> usize {
    xs.iter()
        .map(|x| (row.len() / bb).min(x.len() / be))
        .min()
        .unwrap_or(0)
}

/// Q8_0 for `T` tokens: each block's codes converted once, each token's sums in its own
/// accumulators (one token: [`dot_q8_0`]).
#[inline]
unsafe fn dot_n_q8_0<const PF: bool, const T: usize>(row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let nb = block_count_n(row, &xs, 34, 32);
    let mut total = [[vdupq_n_f32(0.0); 2]; T];
    for ib in 0..nb {
        let b = row.as_ptr().add(34 * ib);
        if PF {
            crate::prefetch_block(b, 34);
        }
        let d = vdupq_n_f32(f16_at(row, 34 * ib));
        // 32 codes: i8 -> i16 -> i32 -> f32 (exact).
        let mut q = [vdupq_n_f32(0.0); 8];
        for h in 0..2 {
            let v = vld1q_s8(b.add(2 + 16 * h) as *const i8);
            let (lo, hi) = (vmovl_s8(vget_low_s8(v)), vmovl_s8(vget_high_s8(v)));
            q[4 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
            q[4 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
            q[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
            q[4 * h + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
        }
        for (x, tot) in xs.iter().zip(total.iter_mut()) {
            let xp = x.as_ptr().add(32 * ib);
            let mut s = [vdupq_n_f32(0.0); 2];
            for (k, qk) in q.iter().enumerate() {
                s[k & 1] = vfmaq_f32(s[k & 1], *qk, vld1q_f32(xp.add(4 * k)));
            }
            tot[ib & 1] = vfmaq_f32(tot[ib & 1], d, vaddq_f32(s[0], s[1]));
        }
    }
    total.map(|t| vaddvq_f32(vaddq_f32(t[0], t[1])))
}

unsafe fn dot_q2_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_n_q2_k::<PF, 1>(row, [x])[0]
}

/// Q2_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
/// accumulators (one token: [`dot_q2_k`]).
#[inline]
unsafe fn dot_n_q2_k<const PF: bool, const T: usize>(row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let nb = block_count_n(row, &xs, 84, QK_K);
    let three = vdupq_n_u32(3);
    let mut acc = [[vdupq_n_f32(0.0); 4]; T];
    for ib in 0..nb {
        let blk = &row[84 * ib..84 * ib + 84];
        if PF {
            crate::prefetch_block(blk.as_ptr(), 84);
        }
        let (scales, qs) = (&blk[0..16], blk.as_ptr().add(16));
        let d = f16_at(blk, 80);
        let dmin = f16_at(blk, 82);
        for half in 0..2 {
            for i in 0..2 {
                // 16 weights per (half, i, j) share the bytes qs[32·half + 16·i ..][..16].
                let q16 = vld1q_u8(qs.add(32 * half + 16 * i));
                let (lo, hi) = (vmovl_u8(vget_low_u8(q16)), vmovl_u8(vget_high_u8(q16)));
                let bytes = [
                    vmovl_u16(vget_low_u16(lo)),
                    vmovl_u16(vget_high_u16(lo)),
                    vmovl_u16(vget_low_u16(hi)),
                    vmovl_u16(vget_high_u16(hi)),
                ];
                for j in 0..4 {
                    let s = scales[8 * half + 2 * j + i];
                    let dl = vdupq_n_f32(d * (s & 15) as f32);
                    let ml = vdupq_n_f32(dmin * (s >> 4) as f32);
                    let sh = vdupq_n_s32(-2 * j as i32);
                    // dl·q is exact: one rounding for dl·q − ml either way.
                    let w = bytes.map(|v| {
                        let q = vcvtq_f32_u32(vandq_u32(vshlq_u32(v, sh), three));
                        vsubq_f32(vmulq_f32(dl, q), ml)
                    });
                    let o = QK_K * ib + 128 * half + 32 * j + 16 * i;
                    for (x, a) in xs.iter().zip(acc.iter_mut()) {
                        let xo = x.as_ptr().add(o);
                        for (k, wk) in w.iter().enumerate() {
                            a[k] = vfmaq_f32(a[k], *wk, vld1q_f32(xo.add(4 * k)));
                        }
                    }
                }
            }
        }
    }
    acc.map(|a| hsum4(a))
}

unsafe fn dot_q4_k<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_n_q4_k::<PF, 1>(row, [x])[0]
}

/// Q4_K for `T` tokens: each weight vector formed once, then each token's FMA into its own
/// accumulators (one token: [`dot_q4_k`]).
#[inline]
unsafe fn dot_n_q4_k<const PF: bool, const T: usize>(row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let nb = block_count_n(row, &xs, 144, QK_K);
    let fifteen = vdupq_n_u32(15);
    let mut acc = [[vdupq_n_f32(0.0); 4]; T];
    for ib in 0..nb {
        let blk = &row[144 * ib..144 * ib + 144];
        if PF {
            crate::prefetch_block(blk.as_ptr(), 144);
        }
        let qs = blk.as_ptr().add(16);
        let (dl, ml) = q4k_factors(blk);
        for c in 0..4 {
            let dl0 = vdupq_n_f32(dl[2 * c]);
            let ml0 = vdupq_n_f32(ml[2 * c]);
            let dl1 = vdupq_n_f32(dl[2 * c + 1]);
            let ml1 = vdupq_n_f32(ml[2 * c + 1]);
            for t in 0..4 {
                let (v0, v1) = u8x8(qs.add(32 * c + 8 * t));
                let o = QK_K * ib + 64 * c + 8 * t;
                for (k, v) in [v0, v1].into_iter().enumerate() {
                    let qlo = vcvtq_f32_u32(vandq_u32(v, fifteen));
                    let qhi = vcvtq_f32_u32(vshrq_n_u32::<4>(v));
                    let w0 = vsubq_f32(vmulq_f32(dl0, qlo), ml0);
                    let w1 = vsubq_f32(vmulq_f32(dl1, qhi), ml1);
                    for (x, a) in xs.iter().zip(acc.iter_mut()) {
                        let xo = x.as_ptr().add(o);
                        a[k] = vfmaq_f32(a[k], w0, vld1q_f32(xo.add(4 * k)));
                        a[2 + k] = vfmaq_f32(a[2 + k], w1, vld1q_f32(xo.add(32 + 4 * k)));
                    }
                }
            }
        }
    }
    acc.map(|a| hsum4(a))
}

unsafe fn dot_iq2_xxs<const PF: bool>(row: &[u8], x: &[f32]) -> f32 {
    dot_n_iq2_xxs::<PF, 1>(row, [x])[0]
}

/// IQ2_XXS for `T` tokens: each group's signed grid vectors formed once (one token:
/// [`dot_iq2_xxs`]).
#[inline]
unsafe fn dot_n_iq2_xxs<const PF: bool, const T: usize>(row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    let nb = block_count_n(row, &xs, 66, QK_K);
    let mut total = [[vdupq_n_f32(0.0); 2]; T];
    for ib in 0..nb {
        let blk = &row[66 * ib..66 * ib + 66];
        if PF {
            crate::prefetch_block(blk.as_ptr(), 66);
        }
        let d = f16_at(blk, 0);
        for g in 0..8 {
            let grp = &blk[2 + 8 * g..10 + 8 * g];
            let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
            // Magnitudes from the f32 grid, signs by XOR with the expanded sign mask: 8 lanes a
            // grid entry, two vectors each.
            let w: [float32x4_t; 8] = std::array::from_fn(|i| {
                let (c, k) = (i / 2, i % 2);
                let gv = GRID_F32[grp[c] as usize].as_ptr();
                let m = SIGN_MASKS[((aux >> (7 * c)) & 127) as usize].as_ptr();
                vreinterpretq_f32_u32(veorq_u32(
                    vreinterpretq_u32_f32(vld1q_f32(gv.add(4 * k))),
                    vld1q_u32(m.add(4 * k)),
                ))
            });
            let db = vdupq_n_f32(iq2_db(d, aux));
            for (x, tot) in xs.iter().zip(total.iter_mut()) {
                let xo = x.as_ptr().add(QK_K * ib + 32 * g);
                let mut sg = [vdupq_n_f32(0.0); 2];
                for (i, wi) in w.iter().enumerate() {
                    sg[i % 2] = vfmaq_f32(sg[i % 2], *wi, vld1q_f32(xo.add(4 * i)));
                }
                tot[g & 1] = vfmaq_f32(tot[g & 1], db, vaddq_f32(sg[0], sg[1]));
            }
        }
    }
    total.map(|t| vaddvq_f32(vaddq_f32(t[0], t[1])))
}

/// Four tokens a pass over the row (prompt batches) for the types with a `dot_n_*` kernel:
/// each token's bits are its one-token kernel's (the same code).
pub(crate) fn dot4_fn<const PF: bool>(ty: GgmlType) -> Option<crate::RawDot4> {
    // SAFETY (all closures): NEON is a baseline feature of the aarch64 targets.
    match ty {
        GgmlType::Q8_0 => Some(|r, x| unsafe { dot_n_q8_0::<PF, 4>(r, x) }),
        GgmlType::Q2_K => Some(|r, x| unsafe { dot_n_q2_k::<PF, 4>(r, x) }),
        GgmlType::Q4_K => Some(|r, x| unsafe { dot_n_q4_k::<PF, 4>(r, x) }),
        GgmlType::IQ2_XXS => Some(|r, x| unsafe { dot_n_iq2_xxs::<PF, 4>(r, x) }),
        _ => None,
    }
}
