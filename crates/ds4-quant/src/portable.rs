//! Portable dequantisers (bit-identical to `gguf.quants.dequantize`) and dot products.
//!
//! Every weight is computed with the same f32 operations, in the same order, as gguf-py:
//! Q2_K/Q4_K `(d·sc)·q − dmin·m`, IQ2_XXS `((d·(0.5+ls))·0.25)·grid·sign`. No FMA contraction
//! (Rust never contracts `a*b+c`).

use crate::iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use crate::{f16_at, f16_to_f32, GgmlType};

pub(crate) const QK_K: usize = 256;

/// `iq2xxs_grid` as f32 vectors of 8 (derived from the generated table at compile time).
pub(crate) static GRID_F32: [[f32; 8]; 256] = {
    let mut t = [[0f32; 8]; 256];
    let mut e = 0;
    while e < 256 {
        let mut j = 0;
        while j < 8 {
            t[e][j] = ((IQ2XXS_GRID[e] >> (8 * j)) & 0xff) as f32;
            j += 1;
        }
        e += 1;
    }
    t
};

/// `ksigns_iq2xs` expanded to per-lane f32 sign-bit masks (0x8000_0000 where negative), to be
/// XORed onto the grid magnitudes.
pub(crate) static SIGN_MASKS: [[u32; 8]; 128] = {
    let mut t = [[0u32; 8]; 128];
    let mut s = 0;
    while s < 128 {
        let mut j = 0;
        while j < 8 {
            if (KSIGNS_IQ2XS[s] >> j) & 1 != 0 {
                t[s][j] = 0x8000_0000;
            }
            j += 1;
        }
        s += 1;
    }
    t
};

/// Dequantise whole blocks; `src`/`dst` lengths were validated by the caller.
pub(crate) fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (c, o) in src.chunks_exact(4).zip(dst) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (c, o) in src.chunks_exact(2).zip(dst) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::BF16 => {
            for (c, o) in src.chunks_exact(2).zip(dst) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
                deq_q8_0(b, o.try_into().unwrap());
            }
        }
        GgmlType::Q2_K => {
            for (b, o) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
                deq_q2_k(b, o.try_into().unwrap());
            }
        }
        GgmlType::Q4_K => {
            for (b, o) in src.chunks_exact(144).zip(dst.chunks_exact_mut(QK_K)) {
                deq_q4_k(b, o.try_into().unwrap());
            }
        }
        GgmlType::IQ2_XXS => {
            for (b, o) in src.chunks_exact(66).zip(dst.chunks_exact_mut(QK_K)) {
                deq_iq2_xxs(b, o.try_into().unwrap());
            }
        }
        _ => unreachable!("caller checked the type is supported"),
    }
}

/// Q8_0, 34 bytes: `d: f16`, `qs: i8[32]`.
#[inline]
pub(crate) fn deq_q8_0(b: &[u8], o: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (w, &q) in o.iter_mut().zip(&b[2..34]) {
        *w = (q as i8) as f32 * d;
    }
}

/// Q2_K, 84 bytes: `scales: u8[16]`, `qs: u8[64]`, `d: f16`, `dmin: f16`.
#[inline]
pub(crate) fn deq_q2_k(b: &[u8], o: &mut [f32; QK_K]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    // Weight k = 128·half + 32·j + 16·i + l uses qs[32·half + 16·i + l] >> 2j, scale 8·half + 2j + i.
    for half in 0..2 {
        for j in 0..4 {
            for i in 0..2 {
                let s = scales[8 * half + 2 * j + i];
                let dl = d * (s & 15) as f32;
                let ml = dmin * (s >> 4) as f32;
                let q = &qs[32 * half + 16 * i..32 * half + 16 * i + 16];
                let out = &mut o[128 * half + 32 * j + 16 * i..][..16];
                for (w, &byte) in out.iter_mut().zip(q) {
                    *w = dl * ((byte >> (2 * j)) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Q4_K 6-bit scale and min of sub-block `b` (0..8) from the 12 packed bytes.
#[inline(always)]
pub(crate) fn q4k_scale_min(scales: &[u8], b: usize) -> (u8, u8) {
    if b < 4 {
        (scales[b] & 63, scales[b + 4] & 63)
    } else {
        (
            (scales[b + 4] & 15) | ((scales[b - 4] >> 6) << 4),
            (scales[b + 4] >> 4) | ((scales[b] >> 6) << 4),
        )
    }
}

/// A Q4_K block's sub-block factors `d·sc` and `dmin·m` (exact f32 products), by sub-block;
/// every path forms its weights `dl·q − ml` from these.
#[inline(always)]
pub(crate) fn q4k_factors(b: &[u8]) -> ([f32; 8], [f32; 8]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (mut dl, mut ml) = ([0f32; 8], [0f32; 8]);
    for s in 0..8 {
        let (sc, m) = q4k_scale_min(&b[4..16], s);
        dl[s] = d * sc as f32;
        ml[s] = dmin * m as f32;
    }
    (dl, ml)
}

/// Q4_K, 144 bytes: `d: f16`, `dmin: f16`, `scales: u8[12]`, `qs: u8[128]`.
#[inline]
pub(crate) fn deq_q4_k(b: &[u8], o: &mut [f32; QK_K]) {
    let (dls, mls) = q4k_factors(b);
    let qs = &b[16..144];
    // Chunk c of 64 weights: low nibbles of qs[32c..32c+32] (sub-block 2c), then high (2c+1).
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        for (h, shift) in [(0usize, 0u8), (1, 4)] {
            let (dl, ml) = (dls[2 * c + h], mls[2 * c + h]);
            let out = &mut o[64 * c + 32 * h..][..32];
            for (w, &byte) in out.iter_mut().zip(q) {
                *w = dl * ((byte >> shift) & 15) as f32 - ml;
            }
        }
    }
}

/// IQ2_XXS group scale: `(d·(0.5 + ls))·0.25`, as gguf-py computes it.
#[inline(always)]
pub(crate) fn iq2_db(d: f32, aux: u32) -> f32 {
    d * (0.5 + (aux >> 28) as f32) * 0.25
}

/// IQ2_XXS, 66 bytes: `d: f16`, then 8 groups of (4 grid indices u8, u32 aux).
#[inline]
pub(crate) fn deq_iq2_xxs(b: &[u8], o: &mut [f32; QK_K]) {
    let d = f16_at(b, 0);
    for g in 0..8 {
        let grp = &b[2 + 8 * g..10 + 8 * g];
        let aux = u32::from_le_bytes([grp[4], grp[5], grp[6], grp[7]]);
        let db = iq2_db(d, aux);
        for c in 0..4 {
            let grid = &GRID_F32[grp[c] as usize];
            let signs = &SIGN_MASKS[((aux >> (7 * c)) & 127) as usize];
            let out = &mut o[32 * g + 8 * c..][..8];
            for j in 0..8 {
                // Sign applied by flipping the sign bit: exact, same as gguf-py's `· ±1`.
                out[j] = f32::from_bits((db * grid[j]).to_bits() ^ signs[j]);
            }
        }
    }
}

/// Dot of two equal-length f32 slices with 8 partial sums (vectorisable, fixed order).
#[inline(always)]
fn dot_f32s(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = w.len().min(x.len()) / 8 * 8;
    for (a, b) in w[..n8].chunks_exact(8).zip(x[..n8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (a, b) in w[n8..].iter().zip(&x[n8..]) {
        s += a * b;
    }
    s
}

pub(crate) fn dot_fn(ty: GgmlType) -> fn(&[u8], &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => dot_f32,
        GgmlType::F16 => dot_f16,
        GgmlType::BF16 => dot_bf16,
        GgmlType::Q8_0 => dot_q8_0,
        GgmlType::Q2_K => |r, x| dot_blocks::<84, QK_K>(r, x, deq_q2_k),
        GgmlType::Q4_K => |r, x| dot_blocks::<144, QK_K>(r, x, deq_q4_k),
        GgmlType::IQ2_XXS => |r, x| dot_blocks::<66, QK_K>(r, x, deq_iq2_xxs),
        _ => unreachable!("caller checked the type is supported"),
    }
}

/// Scalar element types: 8 partial sums over groups of 8 converted elements, then the tail.
#[inline(always)]
fn dot_scalar<const ES: usize>(row: &[u8], x: &[f32], conv: impl Fn(&[u8]) -> f32) -> f32 {
    let n = (row.len() / ES).min(x.len());
    let n8 = n / 8 * 8;
    let mut acc = [0f32; 8];
    for (w8, x8) in row[..n8 * ES]
        .chunks_exact(8 * ES)
        .zip(x[..n8].chunks_exact(8))
    {
        for l in 0..8 {
            acc[l] += conv(&w8[l * ES..l * ES + ES]) * x8[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (e, xv) in row[n8 * ES..n * ES].chunks_exact(ES).zip(&x[n8..n]) {
        s += conv(e) * xv;
    }
    s
}

fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar::<4>(row, x, |e| f32::from_le_bytes([e[0], e[1], e[2], e[3]]))
}

fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar::<2>(row, x, |e| f16_to_f32(u16::from_le_bytes([e[0], e[1]])))
}

fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_scalar::<2>(row, x, |e| {
        f32::from_bits((u16::from_le_bytes([e[0], e[1]]) as u32) << 16)
    })
}

fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    dot_blocks::<34, 32>(row, x, deq_q8_0)
}

/// Block types: dequantise each block into a stack buffer (bit-identical weights), then dot.
#[inline(always)]
fn dot_blocks<const BB: usize, const BE: usize>(
    row: &[u8],
    x: &[f32],
    deq: fn(&[u8], &mut [f32; BE]),
) -> f32 {
    let mut buf = [0f32; BE];
    let mut s = 0f32;
    for (b, xb) in row.chunks_exact(BB).zip(x.chunks_exact(BE)) {
        deq(b, &mut buf);
        s += dot_f32s(&buf, xb);
    }
    s
}
