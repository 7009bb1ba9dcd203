//! Hopper wgmma form of the dense Q8_0 prefill products (`gpu/gemm_wq.cu`, `gwq_q8_0`): on CUDA
//! sm_90 (NVRTC `sm_90a`) it takes `Part::All` Q8_0 products of n > 4 token rows before the
//! BLAS-Lt path (matmul.rs hook): the attention projections, shared expert, compressor / indexer
//! projections. `DS4_GPU_GEMM_WQ=0` (read once per process) or [`GpuBackend::set_gemm_wq`] turn
//! it off (then blas.rs runs as before); so does `DS4_GPU_BLAS=off` (the form takes the vendor
//! path's place: with that path off the built-in GEMM runs, as before).
//!
//! X converted once by `gemm_xt_f32` (unit layout, no sums: f16 hi/lo of x * 2^s per token row);
//! wgmma m64nNk16 f16 with 64 weight rows as A (the int8 q of Q8_0, exact in f16, decoded by each
//! lane straight into its A registers) and up to 64 token rows as B (shared memory by
//! descriptor), two terms (q·hi, q·lo) per block, `acc += d * block` in f32. No weight
//! conversion pass (blas.rs dequantises the weights to bf16 hi/lo every call). CTA: 4
//! warpgroups, 256 weight rows x 16/32/64 tokens (the tile that fills the SMs), 200 KiB of dynamic
//! shared memory, 1 CTA per SM. H200: bench/results/gpu-gemm-f16-h200.txt.

use super::{GpuBackend, GpuBuf, GpuWeight};
use crate::runtime::{Arg, LaunchDims};
use ds4_backend::{GgmlType, Part};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// 0 off, 1 on; UNSET: read `DS4_GPU_GEMM_WQ` (`0` = off; default on) on first use.
static WQ: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = 255;
/// `gwq_q8_0` launches so far (process-wide; tests: the wgmma form ran).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Weight rows per CTA (4 warpgroups x 64) and the dynamic shared memory `sizeof(GwqSmem)`
/// (gemm_wq.cu static_assert): 8 X block slots of 8 KiB, 2 raw stages of 256 rows x 272 bytes.
const WQ_BN: usize = 256;
const WQ_SMEM: usize = 8 * 8192 + 2 * WQ_BN * 272;
/// Fewest token rows taken (fewer: matvec.rs).
const MIN_N: usize = 5;

fn wq_on() -> bool {
    let v = WQ.load(Ordering::Relaxed);
    if v != UNSET {
        return v == 1;
    }
    let f = u8::from(std::env::var("DS4_GPU_GEMM_WQ").as_deref() != Ok("0"));
    WQ.store(f, Ordering::Relaxed);
    f == 1
}

/// Token tile: 64, or 32 / 16 when the grid of 64-token tiles would leave a quarter of the SMs
/// idle (small products: kv 4096 -> 512).
fn token_tile(rows: usize, n: usize, sms: usize) -> usize {
    let ctas = |bm: usize| rows.div_ceil(WQ_BN) * n.div_ceil(bm);
    [64, 32]
        .into_iter()
        .find(|&bm| 4 * ctas(bm) >= 3 * sms)
        .unwrap_or(16)
}

impl GpuBackend {
    /// The wgmma dense Q8_0 form (`gwq_q8_0`) on or off (default: on where it applies, or
    /// `DS4_GPU_GEMM_WQ`). Process-wide (tests, benchmarks).
    pub fn set_gemm_wq(on: bool) {
        WQ.store(on as u8, Ordering::Relaxed);
    }

    /// `gwq_q8_0` launches so far in this process.
    pub fn gemm_wq_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// matmul.rs hook: `y[i] = W·x[i]` for Q8_0 weights, `Part::All`, n > 4 rows, `cols` a
    /// multiple of 256, 16-byte aligned rows and x, on a CUDA sm_90a device with the switch on;
    /// false (nothing queued) otherwise.
    pub(crate) fn gemm_wq_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        let Some((p, ty, cols, rows, row_bytes)) = w.mat_parts() else {
            return false;
        };
        if ty != GgmlType::Q8_0
            || part != Part::All
            || n < MIN_N
            || rows == 0
            || !cols.is_multiple_of(256)
            || !row_bytes.is_multiple_of(16)
            || !p.0.is_multiple_of(16)
            || !x.ptr.0.is_multiple_of(16)
            || !wq_on()
            || !super::blas::switched_on()
            || !self.gemm_wg_supported()
            || self.failed()
        {
            return false;
        }
        // X: hi/lo f16 in the unit layout (gemm.cu gemm_xt_f32, unit = 1, no sums).
        let xt = self.scratch(n * cols);
        let inv = self.scratch(n);
        self.run(
            &ds4_kernels::GEMM,
            "gemm_xt_f32",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::I64(cols as i64),
                Arg::I32(cols as i32),
                Arg::Ptr(xt.ptr),
                Arg::Null,
                Arg::Ptr(inv.ptr),
                Arg::I32(1),
            ],
        );
        let bm = token_tile(rows, n, self.gpu.info().sm_count as usize);
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        self.run(
            &ds4_kernels::GEMM_WQ,
            "gwq_q8_0",
            LaunchDims {
                grid: [rows.div_ceil(WQ_BN) as u32, n.div_ceil(bm) as u32, 1],
                block: [2 * WQ_BN as u32, 1, 1],
                shared_bytes: WQ_SMEM as u32,
            },
            &[
                Arg::Ptr(p),
                Arg::Ptr(xt.ptr),
                Arg::Ptr(inv.ptr),
                Arg::Ptr(y.ptr),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I64(row_bytes as i64),
                Arg::I32(n as i32),
                Arg::I32(bm as i32),
            ],
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_tile_fills_the_sms() {
        assert_eq!(token_tile(32768, 2048, 132), 64); // q_b
        assert_eq!(token_tile(1024, 2048, 132), 64); // q_a: 128 CTAs
        assert_eq!(token_tile(512, 2048, 132), 32); // kv: 128 CTAs at 32
        assert_eq!(token_tile(512, 200, 132), 16);
    }
}
