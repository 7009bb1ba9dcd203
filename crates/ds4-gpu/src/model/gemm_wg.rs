//! Hopper wgmma form of the MoE's IQ2_XXS gate/up at prefill (`gpu/gemm_wg.cu`): on CUDA sm_90
//! (the NVRTC target `sm_90a`, compiler.rs `cuda_arch`), `DS4_GPU_GEMM_WG=0` (read once per
//! process) or [`GpuBackend::set_gemm_wg`] turn it off (then `gemmc_iq2_xxs` of gemm.rs runs).
//!
//! The token rows z are converted once per product pair by `gwg_x_f32` (scaled by a power of two
//! per row, two f16 planes hi/lo, in the kernel's K order), then `gwg_iq2_xxs` runs gate and up
//! in one launch: wgmma m64nNk16 f16 with 64 weight rows as A (integer weights
//! `(2 ls + 1) * grid * sign`, exact in f16, decoded by each lane straight into its A registers)
//! and the expert's run of up to 64 pairs as B (N = 16, 32, 48 or 64 item columns from shared
//! memory by descriptor), the super-block scale `d / 8` applied per 256 columns. Same arithmetic
//! as the tiled form (`gemmt_iq2_xxs`): weights exact, activations ~22 bits, f32 sums.
//!
//! CTA: 4 warpgroups, 256 weight rows x 64 pairs, 222 KiB of dynamic shared memory (16 X chunk
//! slots: X copied in groups of 4 chunks, 8 chunks ahead; 3 raw weight stages; the 2-stage form
//! with 4 chunks ahead lost 0.3-0.6 %: bench/results/gpu-gemm-e16-h200.txt), 1 CTA per SM.
//! H200 (bench/results/gpu-gemm-w15-h200.txt):
//! routed experts q2 (gate/up + the `gemmu_q2_k` down) n = 2048 7.16 -> 6.23 ms, n = 8192 25.67 ->
//! 23.11 ms; `ds4 bench --synthetic full-q2` prefill 2k 3,465 -> 3,770 tok/s (+8.8 %), 8k 4,062 ->
//! 4,288 (+5.6 %); the skewed n = 2048 MoE test 1.8e-5 off the CPU (`gemmc_iq2_xxs`: 3.8e-4).
//!
//! Taken where all of these hold: the switch is on, CUDA cc 9.0 (warp 32), IQ2_XXS gate and up of
//! the same shape, d a multiple of 256, the MoE's pairs grouped in runs of 64 (the default
//! gate/up form: not the f16 or tiled opt-ins, not the int8 opt-in `DS4_GPU_ACT=q8k`).
//!
//! `DS4_GPU_GEMM_PLANES=1` (or [`GpuBackend::set_gemm_planes`]; the engine's `--precision fast`,
//! its default, sets it: precision.rs): both wgmma MoE kernels read X as its hi plane `f16(v)`
//! alone (`gwg_iq2_xxs_p1`, gemm_wgd.rs `gwd_q2_k_p1`): half the wgmma and X copies,
//! activations rounded once to f16 (~2^-11 relative per element, still finer than the original
//! engine's Q8_K); the conversions then skip the unread lo plane (`DS4_GPU_GEMM_LEAN_X=0`
//! keeps it). Unset: 2 (the exact two-plane form, `--precision exact`). The gate/up's decode
//! form: `DS4_GPU_GW_DQ=0` the previous one (gemm_wg.cu `gw_deq`; same bits). H200
//! (bench/results/gpu-gemm-q17-h200.txt): gate/up 3.61 -> 2.80 ms and down 1.67 -> 1.26 ms at
//! n = 2048, `ds4 bench --synthetic full-q2` prefill 2k +10.6 %, 8k +11.6 %; the tiny models'
//! logits then move up to 0.16 from the CPU's (two planes: 1.6e-4; top-1 unchanged).
//!
//! Wide forms (`DS4_GPU_GW_WIDE`, or [`GpuBackend::set_gemm_wg_wide`]; one plane and decode
//! form 2 only, i.e. `--precision fast`): the gate/up takes the grouping's wide runs (up to 128
//! pairs of one expert, after perm in gemm.rs `group_pairs`'s buffer; the down keeps the runs of
//! 64), so a weight chunk is decoded once per 128 items instead of 64 (at 8192 tokens, ~190
//! pairs an expert: 3-4 runs of 64 become 2). `4` (the default): `gwg_iq2_xxs_p1_d2_fw`, the
//! super-block scale folded into the f16 weights (`f16(f16((2 ls + 1) 16 d) grid)`: two more f16
//! roundings, ~2^-11 relative each; the one-plane f64 test's worst error 9.4e-5 -> 1.5e-4 of
//! sum |w x|), one accumulator set (no flush every 256 columns), so N up to 128 fits 4
//! warpgroups in 126 registers. H200: routed experts -3.7 % (2k) / -17.6 % (8k), `ds4 bench`
//! prefill +6.9 % / +9.0 % (bench/results/gpu-p218-h200.txt). `0`: the runs of 64 as before
//! (`gwg_iq2_xxs_p1_d2`, same bits as the exact scale path); `3`: the fold alone, runs of 64
//! (`_f`: +0.9 % / +1.0 %). The unfolded runs of 128 on 2 warpgroups (202 registers for two
//! accumulator sets: 8 warps an SM, prefill -6.9 % / -3.6 %) and a split of them were deleted
//! (code in 5a7f2d4).
//!
//! Persistent forms (`DS4_GPU_GW_PERSIST`: bit 0 the gate/up, bit 1 the down; default 1, the
//! gate/up alone; or [`GpuBackend::set_gemm_wg_persist`]): the folded wide gate/up and down
//! (`_fwp`) launch one CTA an SM (grid = the SM count, or the tiles' bound if smaller), each
//! taking tiles (run, row tile, gate/up) from a counter in
//! [`GpuBackend::tickets`] (words [`GW_TICKET`]..+4) until they run out: the grid tables are built
//! once an SM instead of once a tile, no CTAs start for the absent runs of the worst-case grid
//! (35% of a 2k prompt's gate/up grid), and a CTA that drew short runs takes more. Same
//! arithmetic per tile (same bits). H200, ncu, a 2k / 8k prompt's 43 calls: gate/up 2,009 ->
//! 1,965 / 5,416 -> 5,298 us a call; down 1,038 -> 1,078 / 2,834 -> 2,979 (slower: not default;
//! bench/results/gpu-moe-s27-h200.txt).
//!
//! Small runs (`DS4_GPU_GW_SMALL=0..8`, default 8, or [`GpuBackend::set_gemm_wg_small`]; the
//! folded wide form, d % 2048 == 0, ff % 8 == 0): the wide runs of at most that many pairs are
//! skipped by the wgmma kernel (`smax`, gemm_wg.cu `gw_tile`) and computed by moe.cu's
//! `m3gus_iq2_xxs` in the same stream: the decode steps' m3gu decode (a lane holds a whole
//! 32-weight sub-block of a row: its aux word, scale and signs once, where the wgmma operand
//! order pays them per 8 weights) with the run's items as the 8 mma.sync B columns (x rounded
//! once to f16, weights exact). A wgmma CTA pays its whole expert slice's decode however few
//! its pairs. H100 (34 layers; bench/results/gpu-s53-h100.txt): prefill 2k +1.6 %, 8k +0.2 %;
//! ncu, 2k: the skipped runs cost wgmma ~0.41 ms a call and m3gus 0.42-0.44 (ncu's cold caches;
//! in the stream it gains). A form on mma.sync in the wgmma operand order (`gws_iq2_xxs_fw`,
//! runs of <= 16) gained +0.7 % at 2k and was deleted (code in 43e29cc). Its grid (and the
//! down's `gwds_q2_k`, gemm_wgd.rs) is a CTA per (run, row tile) of the wide runs' bound: ~10^4
//! CTAs at 8k-32k prompt steps that find their run long and leave. A compact grid (2-3 CTAs an
//! SM, each listing the small runs by an ordered compaction and striding over their tiles;
//! 311a6b6) passed the tests but tied (session 55, bench/results/gpu-s55-h200.txt: H100 2k
//! -0.2 %, 32k +0.5 %; H200 2k +0.3 %, 8k -0.1 %, 32k 0.0 %), so the simpler grid stays.

use super::gemm::wide_gmax;
use super::switch::{code, switch_on, UNSET};
use super::{GpuBackend, GpuBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::GgmlType;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// 0 off, 1 on, UNSET: read `DS4_GPU_GEMM_WG` (`0` = off; default on) on first use.
static WG: AtomicU8 = AtomicU8::new(UNSET);
/// `gwg_iq2_xxs` launches so far (process-wide; tests: the wgmma kernel ran).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// X planes of the wgmma MoE kernels: 1 or 2; UNSET: read `DS4_GPU_GEMM_PLANES` (`1` = one
/// plane; anything else 2) on first use.
static PLANES: AtomicU8 = AtomicU8::new(UNSET);
/// One-plane launches so far: `gwg_iq2_xxs_p1` (0), `gwd_q2_k_p1` (1; gemm_wgd.rs).
pub(in crate::model) static P1_LAUNCHES: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];
/// 0 off, 1 on, UNSET: read `DS4_GPU_GEMM_LEAN_X` (`0` = off; default on) on first use. On: with
/// one X plane the conversions (`gwg_x_f32`, gemm.rs `gemm_xt_f32` for `gwd_q2_k_p1`) skip the
/// lo plane (and lo sums) that the one-plane kernels never read.
static LEAN_X: AtomicU8 = AtomicU8::new(UNSET);
/// 0 off, 1 on, UNSET: read `DS4_GPU_GWX_ONE` (`0` = off; default on) on first use. On: the
/// gate/up's X conversion reads each row once (`gwg_x1_f32`; rows of at most 4096), off: twice
/// (`gwg_x_f32`); the same bits (ops_gemm `gemm_moe_wg_decode_forms_same_bits`).
static X_ONE: AtomicU8 = AtomicU8::new(UNSET);
/// Decode form of `gwg_iq2_xxs*` (gemm_wg.cu `gw_deq` DQ 0 or 2, same bits); UNSET: read
/// `DS4_GPU_GW_DQ` on first use (`0`: the previous form; default [`DQ_DEFAULT`]).
static DQ: AtomicU8 = AtomicU8::new(UNSET);
const DQ_DEFAULT: u8 = 2;
/// Wide gate/up: 0 off, 3 folded runs of 64, 4 folded runs of 128 (1 and 2, the deleted
/// unfolded forms, are unused); UNSET: read `DS4_GPU_GW_WIDE` (`0`, `3`, `4`, else
/// [`WIDE_DEFAULT`]) on first use.
static WIDE: AtomicU8 = AtomicU8::new(UNSET);
/// 4 (folded, runs of 128): H200, prefill 2k +6.9 %, 8k +9.0 %, routed experts -3.7 % / -17.6 %
/// against 0; 3 +0.9 % / +1.0 % (bench/results/gpu-p218-h200.txt).
const WIDE_DEFAULT: u8 = 4;
/// Wide (folded) gate/up launches so far (process-wide; tests).
static WIDE_LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// The small-run gate/up (moe.cu `m3gus_iq2_xxs`): the folded wide form's runs of at most this
/// many pairs go to it (0: none; at most [`M3S_MAX`]); UNSET: read `DS4_GPU_GW_SMALL` (a
/// number; default [`SMALL_DEFAULT`]) on first use.
static SMALL: AtomicU8 = AtomicU8::new(UNSET);
/// H100 (34 layers), 2k prompt +1.6%, 8k +0.2% against 0 (bench/results/gpu-s53-h100.txt).
const SMALL_DEFAULT: u8 = 8;
/// Most pairs of a run `m3gus_iq2_xxs` takes (its 8 B columns) and its CTA's row tiles of 8 (the
/// items' x conversion is paid once a CTA).
const M3S_MAX: u8 = 8;
const M3S_NB: usize = 16;
/// `m3gus_iq2_xxs` launches so far (process-wide; tests).
static SMALL_LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Pairs per CTA of `gwg_iq2_xxs` (`GW_BM`: the grouping's run).
pub(in crate::model) const WG_BM: usize = 64;

/// The persistent `_fwp` forms: bit 0 the gate/up, bit 1 the down; UNSET: read
/// `DS4_GPU_GW_PERSIST` (`0`..`3`; default [`PERSIST_DEFAULT`]) on first use.
static PERSIST: AtomicU8 = AtomicU8::new(UNSET);
/// The gate/up alone: persistent, its 2k / 8k prompt's kernel time -2.2% (the grid tables built
/// once an SM, no absent-run CTAs); the down's went +4-5% (2k / 8k: ptxas serializes its wgmma
/// for want of registers, C7512) and is not taken by default (bench/results/gpu-moe-s27-h200.txt).
const PERSIST_DEFAULT: u8 = 1;
/// `_fwp` launches so far: gate/up (0), down (1; gemm_wgd.rs).
pub(in crate::model) static PERSIST_LAUNCHES: [AtomicU64; 2] =
    [AtomicU64::new(0), AtomicU64::new(0)];
/// First of the 4 words of [`GpuBackend::tickets`] the `_fwp` kernels count tiles in (gate/up:
/// + 0, + 1; down: + 2, + 3). Zero between launches: each launch's last CTA resets its pair.
pub(in crate::model) const GW_TICKET: usize = super::mix::ROUTE_TICKET + 2;
const _: () = assert!(GW_TICKET + 4 <= super::TICKET_WORDS);

/// Which `_fwp` forms run: bit 0 the gate/up, bit 1 the down.
pub(in crate::model) fn persist() -> u8 {
    code(&PERSIST, "DS4_GPU_GW_PERSIST", |v| match v.map(str::trim) {
        Some("0") => 0,
        Some("1") => 1,
        Some("2") => 2,
        Some("3") => 3,
        _ => PERSIST_DEFAULT,
    })
}

/// Weight rows per CTA (`64 NWG`, NWG = 4 warpgroups) and its dynamic shared memory:
/// `sizeof(GwSmem<256>)` in gemm_wg.cu (16 X chunk slots of 8 KiB, 3 raw stages of 256 x 20 + 4
/// words, the 2 KiB grid and 8 copies of the 4 KiB f16 grid; a static_assert there).
const WG_BN: usize = 256;
const WG_SMEM: usize = 16 * 8192 + 3 * (WG_BN * 20 + 4) * 4 + 2048 + 8 * 4096;

fn wg_on() -> bool {
    switch_on(&WG, "DS4_GPU_GEMM_WG")
}

/// Whether the wgmma MoE kernels read X's hi plane alone (`DS4_GPU_GEMM_PLANES=1`).
pub(in crate::model) fn one_plane() -> bool {
    code(&PLANES, "DS4_GPU_GEMM_PLANES", |v| match v {
        Some(s) if s.trim() == "1" => 1,
        _ => 2,
    }) == 1
}

/// Whether the one-plane conversions skip the lo plane (`DS4_GPU_GEMM_LEAN_X`, default on): the
/// caller checks that a one-plane kernel reads the result.
pub(in crate::model) fn lean_x() -> bool {
    switch_on(&LEAN_X, "DS4_GPU_GEMM_LEAN_X")
}

fn x_one() -> bool {
    switch_on(&X_ONE, "DS4_GPU_GWX_ONE")
}

fn wide() -> u8 {
    code(&WIDE, "DS4_GPU_GW_WIDE", |v| match v.map(str::trim) {
        Some("0") => 0,
        Some("3") => 3,
        Some("4") => 4,
        _ => WIDE_DEFAULT,
    })
}

/// Runs of at most this many pairs take `m3gus_iq2_xxs` (0: none).
fn small() -> usize {
    code(&SMALL, "DS4_GPU_GW_SMALL", |v| {
        v.and_then(|s| s.trim().parse::<u8>().ok())
            .map_or(SMALL_DEFAULT, |n| n.min(M3S_MAX))
    }) as usize
}

fn dq() -> u8 {
    code(&DQ, "DS4_GPU_GW_DQ", |v| match v {
        Some(s) if s.trim() == "0" => 0,
        _ => DQ_DEFAULT,
    })
}

impl GpuBackend {
    /// One-plane conversions without the lo plane (default on, or `DS4_GPU_GEMM_LEAN_X`).
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_lean_x(on: bool) {
        LEAN_X.store(on as u8, Ordering::Relaxed);
    }

    /// The gate/up's X conversion in one pass (`gwg_x1_f32`, default on, or `DS4_GPU_GWX_ONE`)
    /// or two (`gwg_x_f32`). Process-wide (tests, benchmarks).
    pub fn set_gemm_x_one(on: bool) {
        X_ONE.store(on as u8, Ordering::Relaxed);
    }

    /// Decode form of the wgmma gate/up, 0 or 2 (gemm_wg.cu `gw_deq`; default [`DQ_DEFAULT`] or
    /// `DS4_GPU_GW_DQ`). Process-wide (tests, benchmarks).
    pub fn set_gemm_wg_dq(dq: u8) {
        assert!(dq == 0 || dq == 2, "decode forms 0 and 2");
        DQ.store(dq, Ordering::Relaxed);
    }

    /// The wide gate/up (one plane, decode form 2): 0 off, 3 and 4 folded (`_f` runs of 64,
    /// `_fw` runs of 128) (default [`WIDE_DEFAULT`], or `DS4_GPU_GW_WIDE`). Process-wide (tests,
    /// benchmarks).
    pub fn set_gemm_wg_wide(mode: u8) {
        assert!(matches!(mode, 0 | 3 | 4), "wide modes 0, 3 and 4");
        WIDE.store(mode, Ordering::Relaxed);
    }

    /// Runs of at most `max` pairs (clamped to 8) to the small-run gate/up `m3gus_iq2_xxs`
    /// beside the folded wide form (0: none; default [`SMALL_DEFAULT`], or `DS4_GPU_GW_SMALL`).
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_wg_small(max: usize) {
        SMALL.store(max.min(M3S_MAX as usize) as u8, Ordering::Relaxed);
    }

    /// The small-run bound in use (see [`Self::set_gemm_wg_small`]).
    pub fn gemm_wg_small() -> usize {
        small()
    }

    /// `m3gus_iq2_xxs` launches so far in this process.
    pub fn gemm_wg_small_launches() -> u64 {
        SMALL_LAUNCHES.load(Ordering::Relaxed)
    }

    /// The wide gate/up mode in use (see [`Self::set_gemm_wg_wide`]).
    pub fn gemm_wg_wide() -> u8 {
        wide()
    }

    /// Wide gate/up calls so far in this process (any mode but 0).
    pub fn gemm_wg_wide_launches() -> u64 {
        WIDE_LAUNCHES.load(Ordering::Relaxed)
    }

    /// The decode form in use (see [`Self::set_gemm_wg_dq`]).
    pub fn gemm_wg_dq() -> u8 {
        dq()
    }

    /// The wgmma MoE gate/up (`gwg_iq2_xxs`) on or off (default: on where it applies, or
    /// `DS4_GPU_GEMM_WG`). Process-wide (tests, benchmarks).
    pub fn set_gemm_wg(on: bool) {
        WG.store(on as u8, Ordering::Relaxed);
    }

    /// `gwg_iq2_xxs` launches so far in this process (both plane forms).
    pub fn gemm_wg_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// X planes of the wgmma MoE kernels (gate/up and down): 1 (hi alone, `--precision fast`) or
    /// 2 (hi and lo, `--precision exact`; the default when unset, or `DS4_GPU_GEMM_PLANES`).
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_planes(planes: u8) {
        assert!(planes == 1 || planes == 2, "X planes: 1 or 2");
        PLANES.store(planes, Ordering::Relaxed);
    }

    /// The persistent forms of the folded wide MoE kernels (`_fwp`, module docs): bit 0 the
    /// gate/up, bit 1 the down (default [`PERSIST_DEFAULT`], or `DS4_GPU_GW_PERSIST`).
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_wg_persist(mode: u8) {
        assert!(mode <= 3, "persistent modes 0..3");
        PERSIST.store(mode, Ordering::Relaxed);
    }

    /// The persistent forms in use (see [`Self::set_gemm_wg_persist`]).
    pub fn gemm_wg_persist() -> u8 {
        persist()
    }

    /// Persistent launches so far in this process: (gate/up `gwg_iq2_xxs_p1_d2_fwp`, down
    /// `gwd_q2_k_p1_fwp`).
    pub fn gemm_wg_persist_launches() -> (u64, u64) {
        (
            PERSIST_LAUNCHES[0].load(Ordering::Relaxed),
            PERSIST_LAUNCHES[1].load(Ordering::Relaxed),
        )
    }

    /// One-plane launches so far in this process: (`gwg_iq2_xxs_p1`, `gwd_q2_k_p1`).
    pub fn gemm_one_plane_launches() -> (u64, u64) {
        (
            P1_LAUNCHES[0].load(Ordering::Relaxed),
            P1_LAUNCHES[1].load(Ordering::Relaxed),
        )
    }

    /// Whether the wgmma kernels are compiled for this device (CUDA cc 9.0: sm_90a) and the
    /// GEMM's tensor-core forms are on (gemm.rs `mma_ok`).
    pub fn gemm_wg_supported(&self) -> bool {
        let info = self.gpu.info();
        self.mma_ok() && info.cc == (9, 0) && info.warp == 32
    }

    /// MoE hook (gemm.rs `gemm_moe`): gate and up of `n * k` pairs (pair i reads token i / k of
    /// z, `[n][d]`) into `gy`, `uy` (`[pairs][ff]`) on `gwg_iq2_xxs`, when the switch is on and
    /// it covers the product (IQ2_XXS weights of the same shape, d % 256 == 0, pairs grouped in
    /// runs of [`WG_BM`] by `grp`). Returns false (nothing queued) otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn moe_gate_up_wg(
        &self,
        g: (DevPtr, GgmlType, usize, usize, usize),
        u: (DevPtr, GgmlType, usize, usize, usize),
        z: DevPtr,
        n: usize,
        k: usize,
        (sel, grp, gmax): (DevPtr, DevPtr, usize),
        bm: usize,
        gy: DevPtr,
        uy: DevPtr,
    ) -> bool {
        let (d, ff, rb) = (g.2, g.3, g.4);
        if !wg_on()
            || bm != WG_BM
            || g.1 != GgmlType::IQ2_XXS
            || u.1 != GgmlType::IQ2_XXS
            || (u.2, u.3, u.4) != (d, ff, rb)
            || !d.is_multiple_of(256)
            || !z.0.is_multiple_of(16)
            || n == 0
            || k == 0
            || ff == 0
            || gmax == 0
            || !self.gemm_wg_supported()
            || self.failed()
        {
            return false;
        }
        // z as f16 hi/lo planes in the kernel's K order (one word per element) and 2^-s per row.
        let p1 = one_plane();
        let xw: GpuBuf = self.scratch(n * d);
        let inv: GpuBuf = self.scratch(n);
        self.run(
            &ds4_kernels::GEMM_WG,
            if x_one() { "gwg_x1_f32" } else { "gwg_x_f32" },
            LaunchDims::linear(n as u32, 128),
            &[
                Arg::Ptr(z),
                Arg::I64(d as i64),
                Arg::I32(d as i32),
                Arg::Ptr(xw.ptr),
                Arg::Ptr(inv.ptr),
                Arg::I32(!(p1 && lean_x()) as i32), // lo plane written
            ],
        );
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        if p1 {
            P1_LAUNCHES[0].fetch_add(1, Ordering::Relaxed);
        }
        let w = if p1 && dq() == 2 { wide() } else { 0 };
        if w != 0 {
            WIDE_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        // (kernel, grid y): the wide runs of 128 follow perm in grp (gemm.rs group_pairs), at
        // most wide_gmax of them; every form has 256 weight rows a CTA and WG_SMEM.
        let (name, gy_max) = match (p1, dq(), w) {
            (_, _, 3) => ("gwg_iq2_xxs_p1_d2_f", gmax),
            (_, _, 4) => ("gwg_iq2_xxs_p1_d2_fw", wide_gmax(n * k, bm, gmax)),
            (false, 0, _) => ("gwg_iq2_xxs", gmax),
            (false, _, _) => ("gwg_iq2_xxs_d2", gmax),
            (true, 0, _) => ("gwg_iq2_xxs_p1", gmax),
            (true, _, _) => ("gwg_iq2_xxs_p1_d2", gmax),
        };
        // The persistent form: one CTA an SM (or fewer: the tiles' bound), tiles from a counter.
        let tiles = ff.div_ceil(WG_BN) * gy_max * 2;
        let pers = w == 4 && persist() & 1 != 0;
        let (name, grid) = if pers {
            PERSIST_LAUNCHES[0].fetch_add(1, Ordering::Relaxed);
            let ctas = (self.gpu.info().sm_count as usize).min(tiles).max(1);
            ("gwg_iq2_xxs_p1_d2_fwp", [ctas as u32, 1, 1])
        } else {
            (name, [ff.div_ceil(WG_BN) as u32, gy_max as u32, 2])
        };
        let ctr = self.tickets.ptr().offset((GW_TICKET * 4) as u64);
        // The folded wide form leaves runs of <= smax pairs to m3gus_iq2_xxs (below: stages of
        // 2048 columns, tiles of 8 rows; shared memory: the grid, x fragments (16 bytes an item
        // and 8 columns), red, fin / tmax, 3 stages); where that does not apply, wgmma keeps them.
        let smem = 2048 + 16 * d + 4096 + 64 + 3 * 16 * 544;
        let smax = if w == 4
            && d.is_multiple_of(2048)
            && ff.is_multiple_of(8)
            && smem <= self.gpu.info().max_shared_per_block as usize
        {
            small()
        } else {
            0
        };
        let args = [
            Arg::Ptr(g.0),
            Arg::Ptr(u.0),
            Arg::I64((ff * rb) as i64), // expert slab
            Arg::Ptr(sel),
            Arg::Ptr(xw.ptr),
            Arg::Ptr(inv.ptr),
            Arg::I32(k as i32),
            Arg::Ptr(gy),
            Arg::Ptr(uy),
            Arg::I64(ff as i64),
            Arg::I32(ff as i32),
            Arg::I32(d as i32),
            Arg::I64(rb as i64),
            Arg::I32((n * k) as i32),
            Arg::Ptr(grp),
            Arg::I32(gmax as i32),
            Arg::I32(smax as i32),
        ];
        self.run(
            &ds4_kernels::GEMM_WG,
            name,
            LaunchDims {
                grid,
                block: [2 * WG_BN as u32, 1, 1],
                shared_bytes: WG_SMEM as u32,
            },
            &args
                .into_iter()
                .chain(pers.then_some(Arg::Ptr(ctr)))
                .collect::<Vec<_>>(),
        );
        if smax > 0 {
            SMALL_LAUNCHES.fetch_add(1, Ordering::Relaxed);
            self.run(
                &ds4_kernels::MOE,
                "m3gus_iq2_xxs",
                LaunchDims {
                    grid: [
                        ff.div_ceil(8 * M3S_NB) as u32,
                        wide_gmax(n * k, bm, gmax) as u32,
                        1,
                    ],
                    block: [256, 1, 1],
                    shared_bytes: smem as u32,
                },
                // the wgmma kernel's arguments with z for its (xw, inv), then the tiles a CTA
                &args[..4]
                    .iter()
                    .copied()
                    .chain([Arg::Ptr(z)])
                    .chain(args[6..].iter().copied())
                    .chain([Arg::I32(M3S_NB as i32)])
                    .collect::<Vec<_>>(),
            );
        }
        true
    }

    /// Tests: the wgmma gate/up of `n` tokens × `k` slots with expert choices `sel` (`[n][k]`):
    /// `(gate, up)` as `[pairs][ff]`, or None where the kernel does not cover the product
    /// (ignores the switch).
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_wg_download(
        &self,
        gate: &GpuWeight,
        up: &GpuWeight,
        z: &GpuBuf,
        sel: &super::GpuIBuf,
        n: usize,
        k: usize,
        n_expert: usize,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        if !self.gemm_wg_supported() {
            return None;
        }
        let launch: super::gemm::GateUpFn = Self::moe_gate_up_wg;
        self.gate_up_download((gate, up, z, sel), n, k, n_expert, WG_BM, &WG, launch)
    }
}
