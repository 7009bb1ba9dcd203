//! Activation-quantised prefill experts: opt-in with `DS4_GPU_ACT=q8k` (read once per process)
//! or [`GpuBackend::set_gemm_act_q8k`]; the default stays the exact form.
//!
//! ds4's CPU semantics (`ds4_quant::act`, model.md §5) on int8 tensor cores: the MoE's input z is
//! quantised once per product to Q8_K blocks of 256 (`act_q8k_f32` in `gpu/gemm_i8.cu`: codes,
//! scales and 16-code sums bit-identical to `QuantizedAct::new(ActFormat::Q8_K, ..)`), and the
//! IQ2_XXS gate and up (the q2 mix) run as one launch of `gemmi8_iq2_xxs`: int8 weights (grid ×
//! sign), one `mma.sync m16n8k32 s8` per 16 pairs × 8 rows × 32 elements, the group scale
//! `2 ls + 1` in integer arithmetic, and `dot_row_act`'s per-block f32 combination in block
//! order, so each output equals `dot_row_act(IQ2_XXS, row, QuantizedAct(z))` to the bit. This is
//! not the exact mode: the result differs from it by the activation rounding. The down product
//! and everything else keep their default forms (the Q2_K down's int8 form was not built).
//!
//! Taken where all of these hold: the switch is on, CUDA sm_80+ (warp 32), IQ2_XXS gate and up,
//! d a multiple of 256, the bf16 GEMM mode, and the MoE's pairs grouped in runs of 64 (the
//! default forms; the f16 and tiled gate/up opt-ins take precedence). Elsewhere the exact forms
//! of gemm.rs run.
//!
//! H200 (bench/results/gpu-gemm-i13-h200.txt): routed experts q2 (gate/up + the default
//! `gemmu_q2_k` down) n = 2048 / 4096 / 8192: 7.21 / 13.79 / 25.62 ms -> 5.90 / 11.36 / 21.18 ms;
//! `ds4 bench --synthetic full-q2` prefill 2k 3,464 -> 3,871 tok/s (+11.7 %), 8k 4,028 -> 4,491
//! (+11.5 %), decode unchanged. Tiny model (gpu_forward's prefill cases, rounding off): logits
//! up to 0.43 from the exact CPU reference, median per-position max 3.7e-2 to 4.0e-2, top-1
//! agreement 0.91-0.94, where the default form gives 1.6e-4 / 8e-5 / 1.0 (that test's bounds
//! are 3e-2 / 5e-3 / 0.98: it fails with the switch on, by design).

use super::switch::{code, UNSET};
use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::GgmlType;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// 0 off, 1 on, UNSET: read `DS4_GPU_ACT` (`q8k` = on) on first use.
static ACT: AtomicU8 = AtomicU8::new(UNSET);
/// `gemmi8_iq2_xxs` launches so far (process-wide; tests: the int8 kernel ran).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Pairs per CTA of `gemmi8_iq2_xxs` (`GI_BM`) and weight rows (`GI_BN`).
pub(super) const I8_BM: usize = 64;
const I8_BN: usize = 128;

fn act_q8k() -> bool {
    code(&ACT, "DS4_GPU_ACT", |v| (v == Some("q8k")) as u8) == 1
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

    /// `gemmi8_iq2_xxs` launches so far in this process.
    pub fn gemm_i8_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Whether the int8 kernels are compiled for this device (CUDA sm_80+, warp 32).
    fn i8_ok(&self) -> bool {
        self.mma_ok() && self.gpu.info().warp == 32
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
        self.run(
            &ds4_kernels::GEMM_I8,
            "gemmi8_iq2_xxs",
            LaunchDims {
                grid: [rows.div_ceil(I8_BN) as u32, gmax as u32, 2],
                block: [128, 1, 1],
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
        if !self.i8_ok() {
            return None;
        }
        let launch: super::gemm::GateUpFn = Self::moe_gate_up_i8;
        self.gate_up_download((gate, up, z, sel), n, k, n_expert, I8_BM, &ACT, launch)
    }
}
