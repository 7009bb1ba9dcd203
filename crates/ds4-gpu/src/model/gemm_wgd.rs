//! Hopper wgmma form of the MoE's Q2_K down at prefill (`gpu/gemm_wgd.cu`, `gwd_q2_k`): on CUDA
//! sm_90 (NVRTC `sm_90a`) it replaces `gemmu_q2_k` for the grouped down product (gemm.rs `gemm`
//! hook: same arguments, X from `gemm_xt_f32` in the unit layout with super-block sums);
//! `DS4_GPU_GEMM_WGD=0` (read once per process) or [`GpuBackend::set_gemm_wgd`] turn it off.
//!
//! wgmma m64nNk16 f16 with 64 weight rows as A (the integers `sl * q` of Q2_K, exact in f16,
//! decoded by each lane straight into its A registers) and the expert's run of up to 64 pairs as
//! B (N = 16, 32, 48 or 64 from shared memory by descriptor); per super-block `acc += d * D`,
//! then the min term `sum_j 16 m_j * S_j / 16` as one more wgmma pair (hi/lo sums) into the same
//! accumulator and `acc -= dmin * M`. Same arithmetic as `gemmu_q2_k`. CTA: 4 warpgroups, 256
//! weight rows x 64 pairs, 192 KiB of dynamic shared memory, 1 CTA per SM. With
//! `DS4_GPU_GEMM_PLANES=1` (gemm_wg.rs `one_plane`) `gwd_q2_k_p1`: X and the sums as their hi
//! planes alone (the engine's `--precision fast`; bench/results/gpu-gemm-q17-h200.txt).
//! H200: bench/results/gpu-gemm-d16-h200.txt.
//!
//! Folded wide form (`gwd_q2_k_p1_fw`, one plane only; `DS4_GPU_GWD_WIDE=0` or
//! [`GpuBackend::set_gemm_wgd_wide`] off): the grouping's wide runs (up to 128 pairs of one
//! expert a CTA, as the gate/up's `gwg_iq2_xxs_p1_d2_fw`) and one accumulator set, the
//! super-block scales folded into the f16 weights (two f16 roundings a weight, one for the min
//! term's). Results: bench/results/gpu-gwd-s22-h200.txt. Its persistent form
//! (`gwd_q2_k_p1_fwp`, bit 1 of `DS4_GPU_GW_PERSIST`, gemm_wg.rs) gives the same bits but ran
//! 4-5% slower a call, so it is off by default (bench/results/gpu-moe-s27-h200.txt).
//!
//! Small runs (`DS4_GPU_GWD_SMALL=0..16`, default 8, or [`GpuBackend::set_gemm_wgd_small`]; the
//! folded wide form, row_bytes % 16 == 0, i.e. ff % 1024 == 0): the wide runs of at most that many
//! pairs are skipped by the wgmma kernel (its `smax` argument, gemm_wgd.cu `gwd_tile_fw`) and
//! computed by `gwds_q2_k` in the same stream, as the gate/up's small runs (gemm_wg.rs): mma.sync
//! with the run's items as B columns and the one-token down's decode (weights `sl q` exact, the
//! min term as one more mma a super-block), so a run of a few pairs no longer pays a 256-row
//! wgmma CTA's whole decode. H100 (34 layers; bench/results/gpu-s54-h100.txt): prefill 2k +0.7 %
//! / +0.9 %, 8k and 32k -0.1 %; ncu, 2k: 1.27-1.34 ms a call on wgmma alone, 1.01 + 0.18-0.22
//! with it. Bounds over 8 take `gwds16_q2_k` (two n8 tiles of items a decoded A fragment, 2 CTAs
//! an SM for its shared memory): 2k +0.5 %, so 8 stays the default.

use super::gemm::wide_gmax;
use super::gemm_wg::{lean_x, one_plane, persist, GW_TICKET, P1_LAUNCHES, PERSIST_LAUNCHES};
use super::switch::{code, switch_on, UNSET};
use super::GpuBackend;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// 0 off, 1 on, UNSET: read `DS4_GPU_GEMM_WGD` (`0` = off; default on) on first use.
static WGD: AtomicU8 = AtomicU8::new(UNSET);
/// `gwd_q2_k` launches so far (process-wide; tests: the wgmma down ran).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// The folded wide form: 0 off, 1 on, UNSET: read `DS4_GPU_GWD_WIDE` (`0` = off; default on).
static WIDE: AtomicU8 = AtomicU8::new(UNSET);
/// Folded wide launches so far (process-wide; tests).
static WIDE_LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Weight rows per CTA (4 warpgroups x 64) and the dynamic shared memory `sizeof(GwdSmem<256>)`
/// (gemm_wgd.cu static_assert): 16 X chunk slots of 8 KiB, 2 sums stages of 4 KiB, 2 raw stages
/// of 256 rows x 28 words.
const WGD_BN: usize = 256;
const WGD_SMEM: usize = 16 * 8192 + 2 * 4096 + 2 * WGD_BN * 28 * 4;
/// `sizeof(GwdSmemW<256>)` of the folded wide form: 16 X slots (128 items' hi units), 3 sums
/// stages of 4 KiB, 3 raw stages (the min wgmma is waited a chunk later than in `gwd_q2_k`).
const WGD_SMEM_W: usize = 16 * 8192 + 3 * 4096 + 3 * WGD_BN * 28 * 4;

/// The small-run down (`gwds_q2_k`): the folded wide form's runs of at most this many pairs go to
/// it (0: none; at most [`SMALL_MAX`]); UNSET: read `DS4_GPU_GWD_SMALL` (a number; default
/// [`SMALL_DEFAULT`]) on first use.
static SMALL: AtomicU8 = AtomicU8::new(UNSET);
const SMALL_DEFAULT: u8 = 8;
/// Most pairs of a run `gwds_q2_k` takes (two n8 tiles of B columns), and its CTA's row tiles of
/// 16 (the items' X is loaded once a CTA).
const SMALL_MAX: u8 = 16;
const SMALL_NB: usize = 8;
/// `gwds_q2_k` / `gwds16_q2_k` launches so far (process-wide; tests).
static SMALL_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Runs of at most this many pairs take `gwds_q2_k` (0: none).
fn small() -> usize {
    code(&SMALL, "DS4_GPU_GWD_SMALL", |v| {
        v.and_then(|s| s.trim().parse::<u8>().ok())
            .map_or(SMALL_DEFAULT, |n| n.min(SMALL_MAX))
    }) as usize
}

/// `gwds_q2_k`'s dynamic shared memory for `cols` columns of `row_bytes` and `nx` item slots (8
/// or 16; gemm_wgd.cu): 3 stages of 16 rows at `gwds_srw` words (a multiple of 4, its quarter
/// odd), X (16 bytes an item per 8 columns), the sums (32 bytes an item a super-block) and red
/// (8 x 16 x nx floats).
fn small_smem(cols: usize, row_bytes: usize, nx: usize) -> usize {
    let w = row_bytes.div_ceil(16) * 4;
    let srw = if (w / 4) % 2 == 1 { w } else { w + 4 };
    3 * 16 * 4 * srw + 2 * cols * nx + 32 * nx * (cols / 256) + 512 * nx
}

/// A launch of the wgmma down in place of `gemmu_q2_k` (gemm.rs `gemm`).
pub(in crate::model) struct WgdLaunch {
    pub name: &'static str,
    pub dims: LaunchDims,
    /// The persistent form's tile counter (its last argument).
    pub ctr: Option<DevPtr>,
    /// The kernel's `smax` (gemmu's `skip` position): runs of at most this many pairs are left
    /// to `gwds_q2_k`, launched by `launch_wgd_small` (0: none).
    pub smax: usize,
    /// `gwds_q2_k` (or `gwds16_q2_k` where the bound is over 8) and its launch dimensions where
    /// `smax > 0`: grid (rows / 128, the wide runs' bound), 256 threads.
    small: Option<(&'static str, LaunchDims)>,
}

fn wgd_on() -> bool {
    switch_on(&WGD, "DS4_GPU_GEMM_WGD")
}

impl GpuBackend {
    /// The wgmma MoE down (`gwd_q2_k`) on or off (default: on where it applies, or
    /// `DS4_GPU_GEMM_WGD`). Process-wide (tests, benchmarks).
    pub fn set_gemm_wgd(on: bool) {
        WGD.store(on as u8, Ordering::Relaxed);
    }

    /// `gwd_q2_k` launches so far in this process.
    pub fn gemm_wgd_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// The folded wide down (`gwd_q2_k_p1_fw`, one plane only) on or off (default on, or
    /// `DS4_GPU_GWD_WIDE`). Process-wide (tests, benchmarks).
    pub fn set_gemm_wgd_wide(on: bool) {
        WIDE.store(on as u8, Ordering::Relaxed);
    }

    /// `gwd_q2_k_p1_fw` launches so far in this process.
    pub fn gemm_wgd_wide_launches() -> u64 {
        WIDE_LAUNCHES.load(Ordering::Relaxed)
    }

    /// Runs of at most `max` pairs (clamped to 16) to the small-run down `gwds_q2_k` beside the
    /// folded wide form (0: none; default [`SMALL_DEFAULT`], or `DS4_GPU_GWD_SMALL`).
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_wgd_small(max: usize) {
        SMALL.store(max.min(SMALL_MAX as usize) as u8, Ordering::Relaxed);
    }

    /// The small-run bound in use (see [`Self::set_gemm_wgd_small`]).
    pub fn gemm_wgd_small() -> usize {
        small()
    }

    /// `gwds_q2_k` / `gwds16_q2_k` launches so far in this process.
    pub fn gemm_wgd_small_launches() -> u64 {
        SMALL_LAUNCHES.load(Ordering::Relaxed)
    }

    /// Whether [`Self::gemm_wgd_dims`] takes a product with these parameters.
    fn wgd_takes(&self, grouped: bool, bm: usize, zs_ks: usize, cols: usize) -> bool {
        wgd_on()
            && grouped
            && bm == 64
            && zs_ks == 1
            && cols.is_multiple_of(256)
            && self.gemm_wg_supported()
    }

    /// gemm.rs hook (the down's conversion): whether the grouped down of `cols` columns on the
    /// tiled form (runs of 64, no split K) reads X's hi plane alone (`gwd_q2_k_p1`) and the
    /// lean conversion is on, so `gemm_xt_f32` may skip the lo plane and lo sums.
    pub(in crate::model) fn wgd_hi_only(&self, grouped: bool, cols: usize) -> bool {
        one_plane() && lean_x() && self.wgd_takes(grouped, 64, 1, cols)
    }

    /// gemm.rs hook: the kernel (`gwd_q2_k`, or `gwd_q2_k_p1` with one X plane) and its launch
    /// dimensions in place of a `gemmu_q2_k` launch of `rows` weight rows and `ytiles` item runs,
    /// when the switch is on and the kernel covers it: grouped pairs in runs of `bm` = 64, one
    /// batch and no split K (`zs_ks` = 1), `cols` a multiple of 256, a CUDA sm_90a device.
    /// Counts the launch.
    /// `w`, `row_bytes`: the weights (the small-run down stages 16-byte pieces of whole rows).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn gemm_wgd_dims(
        &self,
        grouped: bool,
        bm: usize,
        zs_ks: usize,
        (rows, cols, row_bytes, w): (usize, usize, usize, DevPtr),
        ytiles: usize,
        n: usize,
    ) -> Option<WgdLaunch> {
        if !self.wgd_takes(grouped, bm, zs_ks, cols) {
            return None;
        }
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        let wide = one_plane() && switch_on(&WIDE, "DS4_GPU_GWD_WIDE");
        let (name, gy, smem) = if wide {
            P1_LAUNCHES[1].fetch_add(1, Ordering::Relaxed);
            WIDE_LAUNCHES.fetch_add(1, Ordering::Relaxed);
            // The wide runs of 128 follow perm in the grouping (gemm.rs group_pairs).
            ("gwd_q2_k_p1_fw", wide_gmax(n, bm, ytiles), WGD_SMEM_W)
        } else if one_plane() {
            P1_LAUNCHES[1].fetch_add(1, Ordering::Relaxed);
            ("gwd_q2_k_p1", ytiles, WGD_SMEM)
        } else {
            ("gwd_q2_k", ytiles, WGD_SMEM)
        };
        // The persistent form (gemm_wg.rs docs): one CTA an SM, tiles from a counter (the
        // kernel's last argument).
        let tiles = rows.div_ceil(WGD_BN) * gy;
        let (name, grid, ctr) = if wide && persist() & 2 != 0 {
            PERSIST_LAUNCHES[1].fetch_add(1, Ordering::Relaxed);
            let ctas = (self.gpu.info().sm_count as usize).min(tiles).max(1);
            let ctr = self.tickets.ptr().offset(((GW_TICKET + 2) * 4) as u64);
            ("gwd_q2_k_p1_fwp", [ctas as u32, 1, 1], Some(ctr))
        } else {
            (name, [rows.div_ceil(WGD_BN) as u32, gy as u32, 1], None)
        };
        let dims = LaunchDims {
            grid,
            block: [2 * WGD_BN as u32, 1, 1],
            shared_bytes: smem as u32,
        };
        // gwds_q2_k's item slots: 16 where runs of more than 8 pairs go to it (its shared memory
        // is sized by the bound: runs of <= 8 alone keep 8 slots).
        let bound = small();
        let nx = if bound > 8 { 16 } else { 8 };
        let smem_s = small_smem(cols, row_bytes, nx);
        let smax = if wide
            && row_bytes.is_multiple_of(16)
            && w.0.is_multiple_of(16)
            && smem_s <= self.gpu.info().max_shared_per_block as usize
        {
            bound
        } else {
            0
        };
        let small = (smax > 0).then(|| {
            let dims = LaunchDims {
                grid: [rows.div_ceil(16 * SMALL_NB) as u32, gy as u32, 1],
                block: [256, 1, 1],
                shared_bytes: smem_s as u32,
            };
            (if nx == 16 { "gwds16_q2_k" } else { "gwds_q2_k" }, dims)
        });
        Some(WgdLaunch {
            name,
            dims,
            ctr,
            smax,
            small,
        })
    }

    /// After a [`Self::gemm_wgd_dims`] launch with `smax > 0`: `gwds_q2_k` on the runs it left,
    /// with that launch's first 23 arguments (gemmu's, `smax` last) and the row tiles a CTA.
    pub(in crate::model) fn launch_wgd_small(&self, l: &WgdLaunch, args: &[Arg]) {
        let Some((name, dims)) = l.small else { return };
        SMALL_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        self.run(
            &ds4_kernels::GEMM_WGD,
            name,
            dims,
            &args[..23]
                .iter()
                .copied()
                .chain([Arg::I32(SMALL_NB as i32)])
                .collect::<Vec<_>>(),
        );
    }
}
