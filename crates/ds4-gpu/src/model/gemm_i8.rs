//! Activation-quantised prefill experts (opt-in: `DS4_GPU_ACT=q8k`, or [`GpuBackend::set_gemm_act_q8k`]).
//!
//! ds4's CPU semantics (`ds4_quant::act`, model.md §5) on int8 tensor cores: the MoE's input z is
//! quantised once per product to Q8_K blocks of 256 (`act_q8k_f32` in `gpu/gemm_i8.cu`: codes and
//! scales bit-identical to `QuantizedAct::new(ActFormat::Q8_K, ..)`), and the IQ2_XXS gate and up
//! (the q2 mix) run as one launch of `gemmi8_iq2_xxs`: int8 weights (grid × sign), one
//! `mma.sync m16n8k32 s8` per 16 pairs × 8 rows × 32 elements, the group scale `2 ls + 1` in
//! integer arithmetic, and `dot_row_act`'s per-block f32 combination in block order, so each
//! output equals `dot_row_act(IQ2_XXS, row, QuantizedAct(z))` to the bit. This is not the exact
//! mode (the default): the result differs from it by the activation rounding (~0.4 % per
//! element of z). The down product and everything else keep their default forms.
//!
//! Taken where all of these hold: the switch is on, CUDA sm_80+ (warp 32), IQ2_XXS gate and up,
//! d a multiple of 256, and the MoE's pairs grouped in runs of 64 (the default forms; the f16
//! and tiled gate/up opt-ins take precedence). Elsewhere the exact forms of gemm.rs run.
//! Numbers: bench/results/gpu-gemm-i13-h200.txt.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::GgmlType;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// 0 off, 1 on, UNSET: read `DS4_GPU_ACT` (`q8k` = on) on first use.
static ACT: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = 255;
/// `gemmi8_iq2_xxs` launches so far (process-wide; tests: the int8 kernel ran).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Kernel: 1 `gemmi8_iq2_xxs` (4 warps, one group in flight), 2 `gemmi8w_iq2_xxs` (8 warps),
/// 3 `gemmi8p_iq2_xxs` (4 warps, groups in flight through a ring), 4 `gemmi8pw_iq2_xxs`
/// (8 warps, ring); 0: `DS4_GPU_I8_FORM` (w4 | w8 | p4 | p8) or 3.
static FORM: AtomicUsize = AtomicUsize::new(0);
const KERNELS: [&str; 4] = [
    "gemmi8_iq2_xxs",
    "gemmi8w_iq2_xxs",
    "gemmi8p_iq2_xxs",
    "gemmi8pw_iq2_xxs",
];
/// Pairs per CTA of `gemmi8_iq2_xxs` (`GI_BM`) and weight rows (`GI_BN`).
pub(super) const I8_BM: usize = 64;
const I8_BN: usize = 128;

/// (kernel name, warps) of the int8 gate/up in the current form.
fn form() -> (&'static str, usize) {
    let f = match FORM.load(Ordering::Relaxed) {
        0 => {
            let f = match std::env::var("DS4_GPU_I8_FORM").as_deref() {
                Ok("w4") => 1,
                Ok("w8") => 2,
                Ok("p8") => 4,
                _ => 3,
            };
            FORM.store(f, Ordering::Relaxed);
            f
        }
        f => f,
    };
    (KERNELS[f - 1], if f % 2 == 0 { 8 } else { 4 })
}

fn act_q8k() -> bool {
    let a = ACT.load(Ordering::Relaxed);
    if a != UNSET {
        return a == 1;
    }
    let a = std::env::var("DS4_GPU_ACT").is_ok_and(|v| v == "q8k");
    ACT.store(a as u8, Ordering::Relaxed);
    a
}

/// Q8_K activation on the device (`act_q8k_f32`): codes `[rows][k]` (i8), scales
/// `[rows][k / 256]` (f32), 16-code sums `[rows][k / 16]` (i16).
pub(super) struct ActQ8k {
    pub(super) q: GpuBuf,
    pub(super) d: GpuBuf,
    pub(super) bs: GpuBuf,
}

impl GpuBackend {
    /// The activation-quantised MoE gate/up (`gemmi8_iq2_xxs`) on or off (default: off, or
    /// `DS4_GPU_ACT=q8k`). Process-wide (tests, benchmarks).
    pub fn set_gemm_act_q8k(on: bool) {
        ACT.store(on as u8, Ordering::Relaxed);
    }

    /// Kernel of the int8 gate/up: 1 `gemmi8_iq2_xxs`, 2 `gemmi8w_iq2_xxs`, 3
    /// `gemmi8p_iq2_xxs`, 4 `gemmi8pw_iq2_xxs`; 0 the default. Process-wide (tests, benchmarks).
    pub fn set_gemm_i8_form(f: usize) {
        FORM.store(f.min(4), Ordering::Relaxed);
    }

    /// `gemmi8*_iq2_xxs` launches so far in this process.
    pub fn gemm_i8_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Whether the int8 kernels are compiled for this device (CUDA sm_80+, warp 32).
    fn i8_ok(&self) -> bool {
        let info = self.gpu.info();
        info.vendor == crate::runtime::Vendor::Nvidia && info.cc.0 >= 8 && info.warp == 32
    }

    /// `act_q8k_f32`: rows t < ntok of x (stride x_tok, `k` elements, k % 256 == 0) to Q8_K.
    pub(super) fn act_q8k_rows(&self, x: DevPtr, ntok: usize, x_tok: usize, k: usize) -> ActQ8k {
        let a = ActQ8k {
            q: self.scratch((ntok * k).div_ceil(4)),
            d: self.scratch(ntok * (k / 256)),
            bs: self.scratch((ntok * (k / 16)).div_ceil(2)),
        };
        if ntok > 0 && k > 0 {
            self.run(
                &ds4_kernels::GEMM_I8,
                "act_q8k_f32",
                LaunchDims {
                    grid: [(k / 256) as u32, ntok as u32, 1],
                    block: [256, 1, 1],
                    shared_bytes: 0,
                },
                &[
                    Arg::Ptr(x),
                    Arg::I64(x_tok as i64),
                    Arg::I32(k as i32),
                    Arg::Ptr(a.q.ptr),
                    Arg::Ptr(a.d.ptr),
                    Arg::Ptr(a.bs.ptr),
                ],
            );
        }
        a
    }

    /// MoE hook (gemm.rs `gemm_moe`): gate and up of `pairs` pairs (pair i reads token i / k of z,
    /// `[n][d]`) into `gy`, `uy` (`[pairs][ff]`) on `gemmi8_iq2_xxs`, when the switch is on and
    /// it covers the product (IQ2_XXS weights of the same row size, d % 256 == 0, pairs grouped
    /// in runs of [`I8_BM`] by `grp`). Returns false (nothing queued) otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_gate_up_i8(
        &self,
        g: (DevPtr, GgmlType, usize, usize, usize),
        u: (DevPtr, GgmlType, usize, usize, usize),
        z: DevPtr,
        n: usize,
        k: usize,
        grp: (DevPtr, DevPtr, usize),
        bm: usize,
        gy: DevPtr,
        uy: DevPtr,
    ) -> bool {
        let (d, ff) = (g.2, g.3);
        if !act_q8k()
            || bm != I8_BM
            || g.1 != GgmlType::IQ2_XXS
            || u.1 != GgmlType::IQ2_XXS
            || (u.2, u.3, u.4) != (d, ff, g.4)
            || !d.is_multiple_of(256)
            || k == 0
            || ff == 0
            || !self.i8_ok()
            || self.failed()
        {
            return false;
        }
        let a = self.act_q8k_rows(z, n, d, d);
        self.gemm_i8_launch((g.0, u.0, g.4), &a, d, k, (gy, uy), ff, n * k, grp);
        true
    }

    /// One `gemmi8_iq2_xxs` launch (z 0: w0 -> y0, z 1: w1 -> y1; `rows` rows per expert).
    #[allow(clippy::too_many_arguments)]
    fn gemm_i8_launch(
        &self,
        (w0, w1, row_bytes): (DevPtr, DevPtr, usize),
        a: &ActQ8k,
        cols: usize,
        xdiv: usize,
        (y0, y1): (DevPtr, DevPtr),
        rows: usize,
        pairs: usize,
        (sel, grp, gmax): (DevPtr, DevPtr, usize),
    ) {
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        let (kernel, w) = form();
        self.run(
            &ds4_kernels::GEMM_I8,
            kernel,
            LaunchDims {
                grid: [rows.div_ceil(I8_BN) as u32, gmax as u32, 2],
                block: [32 * w as u32, 1, 1],
                shared_bytes: 0,
            },
            &[
                Arg::Ptr(w0),
                Arg::Ptr(w1),
                Arg::I64((rows * row_bytes) as i64), // expert slab
                Arg::Ptr(sel),
                Arg::Ptr(a.q.ptr),
                Arg::Ptr(a.d.ptr),
                Arg::I32(xdiv as i32),
                Arg::Ptr(y0),
                Arg::Ptr(y1),
                Arg::I64(rows as i64),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I64(row_bytes as i64),
                Arg::I32(pairs as i32),
                Arg::Ptr(grp),
                Arg::I32(gmax as i32),
            ],
        );
    }

    /// Tests: `act_q8k_f32` of `n` rows of `k` values in `x`, downloaded as (codes, scales,
    /// 16-code sums).
    #[doc(hidden)]
    pub fn act_q8k_download(
        &self,
        x: &GpuBuf,
        n: usize,
        k: usize,
    ) -> (Vec<i8>, Vec<f32>, Vec<i16>) {
        let a = self.act_q8k_rows(x.ptr, n, k, k);
        let q = self.download_bytes(a.q.ptr, n * k);
        let d = self.download_bytes(a.d.ptr, n * (k / 256) * 4);
        let bs = self.download_bytes(a.bs.ptr, n * (k / 16) * 2);
        (
            q.into_iter().map(|b| b as i8).collect(),
            d.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            bs.chunks_exact(2)
                .map(|c| i16::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    }

    /// Tests: the int8 gate/up of `n` tokens × `k` slots with expert choices `sel` (`[n][k]`):
    /// `(gate, up)` as `[pairs][ff]`, or None where the kernel does not cover the product
    /// (ignores the switch).
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_i8_download(
        &self,
        gate: &GpuWeight,
        up: &GpuWeight,
        z: &GpuBuf,
        sel: &GpuIBuf,
        n: usize,
        k: usize,
        n_expert: usize,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        let (g, u) = (gate.mat_parts()?, up.mat_parts()?);
        let pairs = n * k;
        if pairs == 0 || n_expert == 0 || !self.i8_ok() {
            return None;
        }
        let gmax = pairs.div_ceil(I8_BM) + n_expert.min(pairs);
        let grp = self.group_pairs(sel.0.ptr, pairs, n_expert, I8_BM, gmax);
        let ff = g.3;
        let (gy, uy) = (self.scratch(pairs * ff), self.scratch(pairs * ff));
        let was = ACT.swap(1, Ordering::Relaxed);
        let ran = self.moe_gate_up_i8(
            g,
            u,
            z.ptr,
            n,
            k,
            (sel.0.ptr, grp.ptr, gmax),
            I8_BM,
            gy.ptr,
            uy.ptr,
        );
        ACT.store(was, Ordering::Relaxed);
        if !ran {
            return None;
        }
        let f = |b: &GpuBuf| -> Vec<f32> {
            self.download_bytes(b.ptr, pairs * ff * 4)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        Some((f(&gy), f(&uy)))
    }
}
