//! Random *valid* quantised blocks with a chosen scale, generated directly (quantising 284 B
//! random floats would take hours; writing random codes with calibrated scales takes seconds).
//! Every dequantised value is finite and the codes are spread so the mean is ≈ 0.

use ds4_gguf::GgmlType;
use half::f16;
use rand::{Rng, RngCore};

/// `n` f16 values ~ uniform(−√3, √3) (unit RMS), looked up by random index: a 64k-entry table
/// makes F16 generation a memcpy-speed operation.
pub struct F16Table(Vec<u16>);

impl F16Table {
    pub fn new(scale: f32, rng: &mut impl Rng) -> F16Table {
        let a = 3f32.sqrt() * scale;
        F16Table(
            (0..65536)
                .map(|_| f16::from_f32(rng.gen_range(-a..a)).to_bits())
                .collect(),
        )
    }
}

fn put_f16(out: &mut [u8], v: f32) {
    out.copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Fill `out` (a whole number of blocks of `ty`) with random blocks whose super-block scale is
/// `d` (for float types `d` is the RMS of the values). `table` serves F16.
pub fn fill(
    ty: GgmlType,
    d: f32,
    table: Option<&F16Table>,
    rng: &mut impl RngCore,
    out: &mut [u8],
) {
    match ty {
        GgmlType::F32 => {
            let a = 3f32.sqrt() * d;
            for c in out.chunks_exact_mut(4) {
                let u = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32; // [0,1)
                c.copy_from_slice(&((2.0 * u - 1.0) * a).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            let t = table.expect("F16 generation needs a table");
            rng.fill_bytes(out);
            for c in out.chunks_exact_mut(2) {
                let i = u16::from_le_bytes([c[0], c[1]]) as usize;
                c.copy_from_slice(&t.0[i].to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // d: f16, qs: i8[32]; −128 is avoided so the code range is symmetric.
            rng.fill_bytes(out);
            for b in out.chunks_exact_mut(34) {
                put_f16(&mut b[0..2], d);
                for q in &mut b[2..] {
                    if *q == 0x80 {
                        *q = 0x81;
                    }
                }
            }
        }
        GgmlType::Q2_K => {
            // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. With dmin = d and
            // min ≈ 1.5·scale, w = d·(scale·q − min) has mean ≈ 0 for uniform 2-bit q.
            rng.fill_bytes(out);
            for b in out.chunks_exact_mut(84) {
                for s in &mut b[0..16] {
                    let sc = 1 + (*s as u32 % 10);
                    let m = (sc * 3).div_ceil(2);
                    *s = (sc | (m << 4)) as u8;
                }
                put_f16(&mut b[80..82], d);
                put_f16(&mut b[82..84], d);
            }
        }
        GgmlType::Q4_K => {
            // d, dmin, scales[12] (6-bit scale/min per 32-weight sub-block), qs[128].
            // min ≈ 7.5·scale centres the 4-bit codes.
            rng.fill_bytes(out);
            for b in out.chunks_exact_mut(144) {
                put_f16(&mut b[0..2], d);
                put_f16(&mut b[2..4], d);
                let mut sc = [0u8; 8];
                let mut m = [0u8; 8];
                for j in 0..8 {
                    sc[j] = 1 + (b[4 + j] % 8);
                    m[j] = ((sc[j] as u32 * 15).div_ceil(2)) as u8; // ≤ 60, fits 6 bits
                }
                let s = &mut b[4..16];
                for j in 0..4 {
                    s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                    s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
                    s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
                }
            }
        }
        GgmlType::IQ2_XXS => {
            // d, then 8 groups of (4 grid indices, u32 signs+scale): every bit pattern is valid.
            rng.fill_bytes(out);
            for b in out.chunks_exact_mut(66) {
                put_f16(&mut b[0..2], d);
            }
        }
        other => unreachable!("synthetic generation does not produce {other}"),
    }
}

/// RMS of the dequantised values of random blocks generated with `d = 1` (for float types 1).
pub fn unit_rms(ty: GgmlType, rng: &mut impl RngCore) -> f32 {
    if !matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS
    ) {
        return 1.0; // float types take the RMS directly; I32 tables are not scaled
    }
    let nblocks = 512u64;
    let mut raw = vec![0u8; (nblocks * ty.block_bytes()) as usize];
    fill(ty, 1.0, None, rng, &mut raw);
    let mut vals = vec![0f32; (nblocks * ty.block_elems()) as usize];
    ds4_quant::dequantize_row(ty, &raw, &mut vals).expect("generated blocks dequantise");
    let ms = vals.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / vals.len() as f64;
    ms.sqrt() as f32
}
