//! [`Backend::random`](ds4_backend::Backend::random) on the device: weights of every type
//! written straight into device memory by `ds4-kernels/gpu/synth.cu` (no host bytes, no bus),
//! so a full-size model exists in seconds. Quantised blocks get an f16 super-block scale chosen
//! so the dequantised values have the requested spread; the per-type RMS of unit-scale blocks
//! comes from a host mirror of the kernel's byte stream, dequantised by `ds4-quant`.

use super::{GpuBackend, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{Backend, Fill, GgmlType, WeightKind};
use std::sync::OnceLock;

/// `synth_quant` type code of a quantised type (`SQ_*` in synth.cu).
fn qcode(ty: GgmlType) -> Option<i32> {
    Some(match ty {
        GgmlType::Q8_0 => 1,
        GgmlType::Q2_K => 2,
        GgmlType::Q4_K => 3,
        GgmlType::IQ2_XXS => 4,
        _ => return None,
    })
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn rbyte(seed: u64, i: u64) -> u32 {
    ((mix64(seed ^ (i >> 3).wrapping_mul(0xd1b5_4a32_d192_ed03)) >> ((i & 7) * 8)) & 0xff) as u32
}

/// Byte `i` of `synth_quant`'s stream (host mirror of `ds4_synth_byte`).
pub fn synth_byte(ty: GgmlType, seed: u64, dbits: u16, i: u64) -> u8 {
    let (dl, dh) = ((dbits & 0xff) as u32, (dbits >> 8) as u32);
    let d = |o: u64| if o & 1 == 0 { dl } else { dh };
    let v = match ty {
        GgmlType::Q8_0 => {
            let o = i % 34;
            if o < 2 {
                d(o)
            } else {
                match rbyte(seed, i) {
                    0x80 => 0x81,
                    r => r,
                }
            }
        }
        GgmlType::Q2_K => {
            let o = i % 84;
            if o < 16 {
                let sc = 1 + rbyte(seed, i) % 10;
                sc | (sc * 3).div_ceil(2) << 4
            } else if o >= 80 {
                d(o)
            } else {
                rbyte(seed, i)
            }
        }
        GgmlType::Q4_K => {
            let (o, base) = (i % 144, i - i % 144);
            let sc = |j: u64| 1 + rbyte(seed, base + 4 + j) % 8;
            let m = |j: u64| (sc(j) * 15).div_ceil(2);
            match o {
                0..=3 => d(o),
                4..=7 => sc(o - 4) | (sc(o) >> 4) << 6,
                8..=11 => m(o - 8) | (m(o - 4) >> 4) << 6,
                12..=15 => (sc(o - 8) & 15) | (m(o - 8) & 15) << 4,
                _ => rbyte(seed, i),
            }
        }
        _ => {
            let o = i % 66;
            if o < 2 {
                d(o)
            } else {
                rbyte(seed, i)
            }
        }
    };
    v as u8
}

/// RMS of the dequantised values of `synth_quant` blocks with d = 1 (cached per type).
pub fn unit_rms(ty: GgmlType) -> f32 {
    static CACHE: [OnceLock<f32>; 4] = [const { OnceLock::new() }; 4];
    let Some(c) = qcode(ty) else { return 1.0 };
    *CACHE[c as usize - 1].get_or_init(|| {
        let blocks = 256u64;
        let n = blocks * ty.block_bytes();
        let one = half::f16::from_f32(1.0).to_bits();
        let raw: Vec<u8> = (0..n).map(|i| synth_byte(ty, 0x5eed, one, i)).collect();
        let mut v = vec![0f32; (blocks * ty.block_elems()) as usize];
        ds4_quant::dequantize_row(ty, &raw, &mut v).expect("synthetic blocks dequantise");
        let ms = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
        ms.sqrt() as f32
    })
}

/// The f16 super-block scale giving values of RMS `spread/√3` (uniform ±spread) for `ty`.
pub fn block_scale(ty: GgmlType, spread: f32) -> u16 {
    half::f16::from_f32(spread / 3f32.sqrt() / unit_rms(ty)).to_bits()
}

impl GpuBackend {
    /// A grid-stride launch over `n` items.
    fn synth_dims(&self, n: u64) -> LaunchDims {
        let cap = (self.gpu.info().sm_count.max(1) as u64) * 64;
        LaunchDims::linear(n.div_ceil(256).clamp(1, cap) as u32, 256)
    }

    fn synth_alloc(&self, bytes: usize) -> Result<crate::gpu::DeviceBuffer, String> {
        self.gpu.alloc(bytes.max(4)).map_err(|e| {
            format!(
                "device memory: {bytes} bytes for a weight ({:.1} GiB already held by weights): {e}",
                self.weight_bytes() as f64 / (1u64 << 30) as f64
            )
        })
    }

    fn synth_values(&self, p: DevPtr, n: u64, half: bool, seed: u64, center: f32, spread: f32) {
        self.run(
            &ds4_kernels::SYNTH,
            if half { "synth_f16" } else { "synth_f32" },
            self.synth_dims(n),
            &[
                Arg::Ptr(p),
                Arg::I64(n as i64),
                Arg::I64(seed as i64),
                Arg::F32(center),
                Arg::F32(spread),
            ],
        );
    }

    /// [`Backend::random`](ds4_backend::Backend::random).
    pub(crate) fn op_random(
        &self,
        kind: WeightKind,
        ty: GgmlType,
        dims: &[u64],
        fill: Fill,
        seed: u64,
    ) -> Result<GpuWeight, String> {
        let elems: u64 = dims.iter().product();
        let cols = dims.first().copied().unwrap_or(1);
        let rows = dims.get(1).copied().unwrap_or(1);
        let experts = dims.get(2).copied().unwrap_or(1);
        let w = match (kind, fill) {
            (WeightKind::Table, Fill::ExpertIds { n_expert }) => {
                if ty != GgmlType::I32 || cols > 32 || cols > n_expert as u64 || n_expert == 0 {
                    return Err(format!(
                        "expert-id table {ty:?} {dims:?}: needs I32 rows of at most 32 and at most {n_expert} ids"
                    ));
                }
                let buf = self.synth_alloc(elems as usize * 4)?;
                let n_rows = elems / cols.max(1);
                self.run(
                    &ds4_kernels::SYNTH,
                    "synth_expert_ids",
                    self.synth_dims(n_rows),
                    &[
                        Arg::Ptr(buf.ptr()),
                        Arg::I64(n_rows as i64),
                        Arg::I32(cols as i32),
                        Arg::I32(n_expert as i32),
                        Arg::I64(seed as i64),
                    ],
                );
                GpuWeight::I32 {
                    buf,
                    len: elems as usize,
                }
            }
            (WeightKind::Vector, Fill::Uniform { center, spread }) => {
                // Vectors are f32 on the device whatever their stored type.
                let buf = self.synth_alloc(elems as usize * 4)?;
                self.synth_values(buf.ptr(), elems, false, seed, center, spread);
                GpuWeight::F32 {
                    buf,
                    len: elems as usize,
                }
            }
            (WeightKind::Matrix, Fill::Uniform { center, spread }) => {
                let row_bytes = ty
                    .row_bytes(cols)
                    .ok_or_else(|| format!("{cols} columns do not fill whole {ty:?} blocks"))?;
                let bytes = row_bytes * rows * experts;
                let buf = self.synth_alloc(bytes as usize)?;
                match (ty, qcode(ty)) {
                    (GgmlType::F32 | GgmlType::F16, _) => self.synth_values(
                        buf.ptr(),
                        elems,
                        ty == GgmlType::F16,
                        seed,
                        center,
                        spread,
                    ),
                    (_, Some(code)) if center == 0.0 => self.run(
                        &ds4_kernels::SYNTH,
                        "synth_quant",
                        self.synth_dims(bytes),
                        &[
                            Arg::Ptr(buf.ptr()),
                            Arg::I64(bytes as i64),
                            Arg::I32(code),
                            Arg::I64(seed as i64),
                            Arg::U32(block_scale(ty, spread) as u32),
                        ],
                    ),
                    _ => {
                        return Err(format!(
                            "cannot generate {ty:?} weights centred at {center} on the GPU"
                        ))
                    }
                }
                let f16i =
                    self.f16_il_copy(&buf, ty, cols as usize, rows as usize, experts as usize);
                let (buf, dec, dec_il) =
                    self.q8_layouts(buf, ty, cols as usize, rows as usize, experts as usize);
                GpuWeight::Mat {
                    f16i,
                    dec,
                    dec_il,
                    buf,
                    ty,
                    cols: cols as usize,
                    rows: rows as usize,
                    experts: experts as usize,
                    row_bytes: row_bytes as usize,
                    bf: Default::default(),
                }
            }
            (k, f) => return Err(format!("cannot generate a {k:?} weight from {f:?}")),
        };
        if self.failed() {
            return Err(self.check().err().unwrap_or_default());
        }
        *self.weight_bytes.lock().unwrap() += match &w {
            // Held in the decode layout only: that layout is the weight's bytes.
            GpuWeight::Mat { dec: Some(d), .. } if !w.blocks() => d.bytes() as u64,
            GpuWeight::Mat { buf, .. }
            | GpuWeight::F32 { buf, .. }
            | GpuWeight::I32 { buf, .. } => buf.bytes() as u64,
        };
        Ok(w)
    }
}
