//! Prefill weight products (n > 4 token rows). Each entry returns true when it ran the product, false to leave it to the general
//! kernels of matmul.rs (unsupported type or shape). Semantics: ds4-cpu backend.rs.
//!
//! Kernels: `gemm_<t>` / `gemmp_<t>` / `gemmf_<t>` of `gpu/gemm.cu` (tiles of 64 items × 128
//! weight rows; tensor-core mma with a bf16 hi/lo split (default), 3xTF32 (opt-in:
//! `set_gemm_tf32`, `DS4_GPU_GEMM=tf32`), or the portable FMA form), `gemmw_<t>` (128-item
//! tiles, bf16 form, long prompts: `tile_items`; the mma forms exist only on CUDA sm_80+, the
//! FMA form everywhere: `ds4_kernels::GEMM.mma_only`), split K when the grid would be small (partials
//! summed by `gemm_sum_f32`). The MoE groups (token, slot) pairs by expert on the device
//! (`gm_group_*_i32`: count, scan, scatter, O(pairs); runs cut at the item tile), then gate, up
//! (GEMM each), SwiGLU and the slot sum with matmul.cu's `moe_swiglu_f32` / `moe_sum_f32`.
//! Prompts run in chunks of `prefill_chunk()` tokens (12288 where memory allows: MoE weights read
//! once per chunk; fewer where the memory free beside the weights holds less: `auto_chunk`).
//! The MoE's IQ2_XXS gate/up (the q2 mix) take `gemmc_iq2_xxs` on CUDA sm_80+: z split into
//! bf16 hi/lo once per product (`gemm_xb_f32`; `DS4_GPU_GEMM_XB=0`: the bf16 hi/lo form
//! `gemm_iq2_xxs`, split per CTA), weights g * sign exact in bf16 (two mma per tile, the chunk
//! scale on the accumulators), raw IQ2_XXS fields in flight across the mma; m-tiles of 16 items
//! with no valid pair are skipped (`DS4_GPU_GEMM_SKIP=0` off). Tiled Q2_K products (the q2 mix's
//! down) take `gemmu_q2_k`: weights decoded once per CTA into a shared tile, X in the unit
//! layout of `gemm_xt_f32`. H200 (bench/results/gpu-gemm-e9-h200.txt): routed experts q2
//! n = 2048 9.33 -> 7.98 ms, n = 4096 18.17 -> 15.27 ms against the hi/lo gate/up and `gemmt_q2_k`;
//! `gemmu_q2_k` with less than half the instructions (gpu-gemm-e10-h200.txt): 7.91 -> 7.15 ms,
//! 15.38 -> 13.80 ms, 2k prefill +6%.
//! On CUDA sm_90a the IQ2_XXS gate/up take the wgmma form instead (gemm_wg.rs, `gwg_iq2_xxs`:
//! gate and up in one launch; `DS4_GPU_GEMM_WG=0` keeps `gemmc_iq2_xxs`), and the grouped Q2_K
//! down the wgmma form of `gemmu_q2_k` (gemm_wgd.rs, `gwd_q2_k`: same arguments, launched from
//! `gemm`; `DS4_GPU_GEMM_WGD=0` keeps `gemmu_q2_k`).
//!
//! Tiled integer-weight form `gemmt_<t>` (CUDA sm_80+; default for Q2_K (`gemmu_q2_k`)/Q4_K weights,
//! `DS4_GPU_GEMM_TILED=all` adds Q8_0/IQ2_XXS, `=0` turns it off: see `TILED`): 64 items × 64
//! rows, 128 threads; weights as exact integers in f16 with their scales applied per super-block
//! (Q8_0: per chunk; K-quant mins as one more mma on 16-element activation sums), X converted
//! once per product by `gemm_xt_f32` into hi/lo f16 groups, raw weight blocks and X tiles staged
//! by cp.async, two f16 mma per tile. More precise than the bf16 hi/lo form (weights exact,
//! activations ~22 bits; it replaces the exact-weight form `gemmq*`, same arithmetic).
//!
//! Opt-in tensor-core form on CUDA sm_80+ (`DS4_GPU_GEMM_PRECISE=0`, default off: see `PRECISE`)
//! for Q8_0/Q2_K/Q4_K/IQ2_XXS weights: `gemmh<BM>_<t>`,
//! one f16 mma per tile (instead of the three bf16 hi/lo products) on X converted once per
//! product by `gemm_xh_f32` (rows scaled by a power of two, rounded to f16; the kernel undoes
//! the scale). The bf16 hi/lo form stays the default (`set_gemm_precise`);
//! `DS4_GPU_GEMM_TILE=64|128|256` fixes its item tile (MoE: at most 128).
//! H200 (bench/results/gpu-gemm-s4-h200.txt): 1.5-2.6x the bf16 form per product (Q8_0 4096->16384
//! n = 2048: 47 -> 97 TFLOP/s, IQ2_XXS 78 -> 147, routed experts n = 4096: 59 -> 107), prefill
//! 1474 -> 2168 tok/s at 2048 tokens; error ~2^-12 rms per term (f16 operands), ~5e-4 of rms(y).

use super::switch::{code, switch_on, UNSET};
use super::{type_suffix as suffix, GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{Backend, GgmlType, MoeSpec, Part};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// A MoE gate/up launch of one form: (gate, up as `GpuWeight::mat_parts`, z, n, k, (sel, grouping,
/// its run count), items per run, gate out, up out) -> whether it ran.
pub(super) type GateUpFn = fn(
    &GpuBackend,
    (DevPtr, GgmlType, usize, usize, usize),
    (DevPtr, GgmlType, usize, usize, usize),
    DevPtr,
    usize,
    usize,
    (DevPtr, DevPtr, usize),
    usize,
    DevPtr,
    DevPtr,
) -> bool;

/// Items (token rows or pairs) per CTA: `gemm_*` tiles and the wide `gemmw_*` tiles (bf16 form);
/// weight rows per CTA (`GM_BN` in gemm.cu).
const BM: usize = 64;
const BM_WIDE: usize = 128;
const BN: usize = 128;
/// Fewest token rows the GEMM takes (decode, n ≤ 4, belongs to matvec.rs).
const MIN_N: usize = 5;
/// Tokens per prompt step on the GPU (`Backend::prefill_chunk`): `DS4_GPU_PREFILL_CHUNK` (read at
/// every call, so a test can switch it), else `auto` (the backend's [`auto_chunk`], chosen
/// before every step).
pub(crate) fn prefill_chunk(auto: impl FnOnce() -> usize) -> usize {
    std::env::var("DS4_GPU_PREFILL_CHUNK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&c: &usize| c > 0)
        .unwrap_or_else(auto)
}

/// Largest prompt step (tokens). H200: 512 -> 747 tok/s, 2048 -> 990-1096, 4096 -> 1105-1311
/// (bench/results/gpu-prefill-h200.txt); 8192 vs 4096 (more pairs per expert per chunk): 8k
/// prefill 3,984 vs 3,843 tok/s, 32k 3,807 vs 3,701 (bench/results/gpu-gemm-e12-h200.txt);
/// 12288 vs 8192 (session 29, alternating): the 32k frontier after a 24,576-token prompt +1.45%,
/// a 32,768-token prompt from 0 +0.9%, 8k and 2k unchanged (gpu-decode-s29-h200.txt run H).
/// 16384 is not taken: its query and attention-output buffers reach 2 GiB (16384 × 64 heads × 512
/// f32), past any 32-bit byte offset; 12288's are 1.5 GiB. Scratch ~6 GB at 12288 (MoE: 3 ×
/// pairs × ff and pairs × d f32).
const DEFAULT_CHUNK: usize = 12288;
// A step's query and attention-output rows (64 heads × 512 f32) stay under 2 GiB.
const _: () = assert!(DEFAULT_CHUNK * 64 * 512 * 4 < 1 << 31);
/// Smallest step [`auto_chunk`] picks (the old default's neighbourhood: ~1,000 tok/s at 2048);
/// the engine's memory plan keeps room for it beside the weights (`GPU_RESERVE`).
const MIN_AUTO_CHUNK: usize = 2048;
/// The steps [`auto_chunk`] tries, largest first (a step's large blocks come from the scratch
/// pool's arenas, mod.rs `Pool`, so a 3072-token step holds less than a 4096-token one).
const AUTO_CHUNKS: [usize; 6] = [DEFAULT_CHUNK, 8192, 6144, 4096, 3072, MIN_AUTO_CHUNK];
/// Scratch a prompt step holds per token before one has been measured (mod.rs `StepMemory`):
/// the full-size model's peak, 504 KiB a token at 2048-token steps and 488 at 4096 on the H100
/// with the q2 mix (`bench/results/gpu-s49-h100.txt`), an eighth added as for a measured one.
const SCRATCH_PER_TOKEN: u64 = 576 << 10;
/// Memory left beside a step's scratch: at least this, or an eighth of what is available (the
/// step's own session-state growth, the BLAS library's workspace, driver allocations).
const STEP_KEEP: u64 = 512 << 20;

/// The largest step of [`AUTO_CHUNKS`] whose scratch fits `avail` (device memory free now plus
/// the scratch pool's idle blocks) less what is kept, at `per_token` bytes a token (measured by
/// earlier steps, an eighth added; else [`SCRATCH_PER_TOKEN`]), else [`MIN_AUTO_CHUNK`].
/// Asked before every step (the backend keeps its first answer while it fits: mod.rs
/// `prefill_chunk`). Unknown free memory: the default.
pub(crate) fn auto_chunk(avail: Option<u64>, per_token: Option<u64>) -> usize {
    let Some(avail) = avail else {
        return DEFAULT_CHUNK;
    };
    let per_token = per_token.map_or(SCRATCH_PER_TOKEN, |t| t + t / 8);
    let budget = avail.saturating_sub((avail / 8).max(STEP_KEEP));
    AUTO_CHUNKS
        .into_iter()
        .find(|&c| c as u64 * per_token <= budget)
        .unwrap_or(MIN_AUTO_CHUNK)
}

/// Most experts the grouping kernels take (`GM_MAXE` in gemm.cu).
const MAX_EXPERTS: usize = 1024;
/// Pairs per block of the grouping kernels.
const GROUP_BLOCK: usize = 256;

/// Kernel form: 0 `gemm_<t>` (bf16 hi/lo tensor cores; `gemmf_<t>` without mma), 1 `gemmf_<t>`
/// (portable FMA), 2 off (decline all), 3 `gemmp_<t>` (3xTF32 tensor cores); UNSET: read
/// `DS4_GPU_GEMM` (bf16 | fma | off | tf32) on first use.
static MODE: AtomicU8 = AtomicU8::new(UNSET);

fn mode() -> u8 {
    code(&MODE, "DS4_GPU_GEMM", |v| match v {
        Some("fma") => 1,
        Some("off") => 2,
        Some("tf32") => 3,
        _ => 0,
    })
}

/// Fewest token rows for the wide tiles (dense; MoE: an average of WIDE_MIN / 2 pairs per
/// expert); `DS4_GPU_GEMM_WIDE` or `set_gemm_wide` override (0: not read yet).
static WIDE_MIN: AtomicUsize = AtomicUsize::new(0);
const DEFAULT_WIDE_MIN: usize = 256;

fn wide_min() -> usize {
    let w = WIDE_MIN.load(Ordering::Relaxed);
    if w != 0 {
        return w;
    }
    let w = std::env::var("DS4_GPU_GEMM_WIDE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&w: &usize| w > 0)
        .unwrap_or(DEFAULT_WIDE_MIN);
    WIDE_MIN.store(w, Ordering::Relaxed);
    w
}

/// Item tile for `n` dense rows (`experts` 0) or `n` pairs over `experts` experts of weight
/// type `ty`, in the current form. Dense: wide only for the types it measured faster on
/// (H200, n = 2048, 4096->16384: Q8_0 47 vs 37 TFLOP/s, F32 70 vs 61, Q2_K 68 vs 63; F16, BF16,
/// Q4_K, IQ2_XXS 5-15 % slower: bench/results/gpu-prefill-h200.txt).
/// Bound on the wide runs (cut every `2 nt`) of a grouping whose runs of `nt` are bounded by
/// `gmax = pairs / nt (rounded up) + min(experts, pairs)` (every caller's form): the same with
/// `2 nt`.
pub(super) fn wide_gmax(pairs: usize, nt: usize, gmax: usize) -> usize {
    gmax.saturating_sub(pairs.div_ceil(nt)) + pairs.div_ceil(2 * nt)
}

/// `mma`: whether the device has the mma forms (the wide tiles are one of them).
fn tile_items(n: usize, experts: usize, ty: GgmlType, mma: bool) -> usize {
    if !mma {
        return BM;
    }
    let need = if experts == 0 {
        if !matches!(ty, GgmlType::Q8_0 | GgmlType::F32 | GgmlType::Q2_K) {
            return BM;
        }
        wide_min()
    } else {
        (wide_min() / 2).saturating_mul(experts)
    };
    if mode() == 0 && n >= need {
        BM_WIDE
    } else {
        BM
    }
}

/// Precise form (bf16 hi/lo) instead of the f16 one: 0 no, 1 yes, UNSET: read
/// `DS4_GPU_GEMM_PRECISE` on first use (default yes; `0` selects the f16 form, ~1.4x prefill).
/// The f16 form is opt-in: on the H200 the tiny model's prefill logits with the model's FP8/FP4
/// rounding moved by up to 0.30 from the CPU's (median 2.4e-2, top-1 agreement 0.93, against
/// 2.6e-5 / 0.997 for the precise form; bench/results/gpu-session4-h200.txt).
static PRECISE: AtomicU8 = AtomicU8::new(UNSET);

fn precise() -> bool {
    code(&PRECISE, "DS4_GPU_GEMM_PRECISE", |v| {
        let p = !(v == Some("0") || std::env::var("DS4_GPU_GEMM_FORM").is_ok_and(|v| v == "f16"))
            || std::env::var("DS4_GPU_GEMM").is_ok_and(|v| v == "bf16");
        p as u8
    }) == 1
}

/// Tiled integer-weight form `gemmt_<t>` (CUDA sm_80+): 0 off (the bf16 hi/lo form), 1 Q2_K and
/// Q4_K (default), 2 also Q8_0 and IQ2_XXS; UNSET: read `DS4_GPU_GEMM_TILED` (`0`, `all`) or
/// `DS4_GPU_GEMM_FORM=exact` (= all: the exact-weight form it replaces) on first use. The f16
/// opt-in takes precedence. H200, 4096->16384 at n = 2048 (bench/results/gpu-gemm-p-h200.txt):
/// Q2_K 76 vs 68 TFLOP/s for the bf16 hi/lo form, Q4_K 74 vs 55, but IQ2_XXS 65 vs 78 and the
/// q2 routed experts (IQ2_XXS gate/up) 51.5 vs 57.4: IQ2_XXS stays on the bf16 form by default.
/// (Q8_0 was not measured: the BLAS-Lt hooks took those products.)
static TILED: AtomicU8 = AtomicU8::new(UNSET);

fn tiled() -> u8 {
    code(&TILED, "DS4_GPU_GEMM_TILED", |v| match v {
        Some("0") => 0,
        Some("all") => 2,
        _ if std::env::var("DS4_GPU_GEMM_FORM").is_ok_and(|v| v == "exact") => 2,
        _ => 1,
    })
}

/// Items and weight rows per CTA of the tiled form (`GT_BM`, `GT_BN` in gemm.cu).
const T_BM: usize = 64;
const T_BN: usize = 64;

/// f16 form with 64/128-item tiles: shared tiles double-buffered (one barrier per K step):
/// 0 no, 1 yes, UNSET: read `DS4_GPU_GEMM_DB` (0 = no; default yes) on first use.
static DBUF: AtomicU8 = AtomicU8::new(UNSET);

fn dbuf() -> bool {
    switch_on(&DBUF, "DS4_GPU_GEMM_DB")
}

/// Item tile of the f16 form: 0 automatic, else 64, 128 or 256; usize::MAX: read
/// `DS4_GPU_GEMM_TILE` on first use.
static HTILE: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Automatic: MoE 128 items from an average of 64 pairs per expert, else 64; dense 256 from
/// n = 1024 (F16 weights 128: no dequantisation to share, more CTAs win), 128 from 256, else 64.
/// H200 (bench/results/gpu-gemm-s4-h200.txt, n = 2048/4096): Q8_0 4096->16384 73 -> 97 TFLOP/s
/// with 256 over 128; MoE n = 2048 (48 pairs per expert) 87 with 64 vs 60 with 128, n = 4096
/// 106 with 128 vs 88 with 64; F16 4096->1024 92 with 128 vs 79 with 256.
fn half_tile(n: usize, experts: usize, ty: GgmlType) -> usize {
    let mut t = HTILE.load(Ordering::Relaxed);
    if t == usize::MAX {
        t = std::env::var("DS4_GPU_GEMM_TILE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|t| [64, 128, 256].contains(t))
            .unwrap_or(0);
        HTILE.store(t, Ordering::Relaxed);
    }
    if experts > 0 {
        // MoE: the down product may take the bf16 form (64/128-item tiles) with the same groups.
        return match t {
            0 if n >= 64 * experts => 128,
            0 => 64,
            t => t.min(128),
        };
    }
    match t {
        0 if n >= 1024 && ty != GgmlType::F16 => 256,
        0 if n >= 256 => 128,
        0 => 64,
        t => t,
    }
}

/// Skip the m-tiles (16 items) of a tile that hold no valid item (`gm_tile_valid` in gemm.cu;
/// bf16 hi/lo and tiled forms): 0 no, 1 yes, UNSET: read `DS4_GPU_GEMM_SKIP` (`0` = no) on first use.
static SKIP: AtomicU8 = AtomicU8::new(UNSET);

fn skip_empty() -> bool {
    switch_on(&SKIP, "DS4_GPU_GEMM_SKIP")
}

/// IQ2_XXS gate/up of the MoE on X split once per product (`gemm_xb_f32`, `gemmc_iq2_xxs`)
/// instead of the bf16 form split per CTA: 0 no, 1 yes, UNSET: read `DS4_GPU_GEMM_XB` (`0` = no).
static XB: AtomicU8 = AtomicU8::new(UNSET);

fn split_x() -> bool {
    switch_on(&XB, "DS4_GPU_GEMM_XB")
}

/// Drop the MoE pairs of route weight 0 from the prefill's grouped products and slot sum (an
/// expert-parallel rank's slots of other ranks' experts): 0 no (every pair computed, the
/// zero-weight ones adding 0), 1 yes, UNSET: read `DS4_GPU_MOE_DROP` (`0` = no). Same values.
static DROP: AtomicU8 = AtomicU8::new(UNSET);

fn drop_zero_pairs() -> bool {
    switch_on(&DROP, "DS4_GPU_MOE_DROP")
}

/// The MoE's SwiGLU fused into the down's X conversion (`gemm_xt_swiglu_f32`: gate and up read
/// once, h never written) where the down takes the tiled form: 0 no (`moe_swiglu_f32`, then
/// `gemm_xt_f32` over h), 1 yes, UNSET: read `DS4_GPU_MOE_SWIGLU_XT` (`0` = no). Same bits.
static SWXT: AtomicU8 = AtomicU8::new(UNSET);
/// Widest h row `gemm_xt_swiglu_f32` takes (one 16-element group a thread, 256 threads).
const SWXT_MAX: usize = 4096;

/// `gemm_xt_swiglu_f32` launches so far (process-wide; tests).
static SWXT_LAUNCHES: AtomicU64 = AtomicU64::new(0);

fn swiglu_xt() -> bool {
    switch_on(&SWXT, "DS4_GPU_MOE_SWIGLU_XT")
}

/// GEMM launches so far (process-wide), so tests can see the GEMM took a product.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Of those, f16-form (`gemmh*`) launches.
static HLAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Of those, `gemmf_*` (portable FMA tiles) launches.
static FLAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Of those, tiled-form (`gemmt_*`) launches.
static TLAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Of those, split-X (`gemmc_*`) launches.
static BLAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Of those, `gemmc_iq2_xxs` launches; tiled launches on `gemmu_q2_k`.
static CLAUNCHES: AtomicU64 = AtomicU64::new(0);
static ULAUNCHES: AtomicU64 = AtomicU64::new(0);
/// The GEMM's tensor-core forms: 0 never, 1 where compiled; UNSET: read `DS4_GPU_GEMM_MMA`
/// (`off`, `0`: never).
static MMA: AtomicU8 = AtomicU8::new(UNSET);

/// One GEMM launch: for item i < n, batch z < zs, weight row r < rows:
/// `y[i*y_tok + z*y_z + r] = (w + z*w_z [+ expert*slab])[r] · x[(i/xdiv)*x_tok + z*x_z ..]`.
struct Gm {
    w: DevPtr,
    ty: GgmlType,
    w_z: usize,
    slab: usize,
    x: DevPtr,
    x_tok: usize,
    x_z: usize,
    xdiv: usize,
    y: DevPtr,
    y_tok: usize,
    y_z: usize,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    n: usize,
    zs: usize,
    /// Pairs grouped by expert: (sel, grp from gm_group_*_i32, gmax).
    grp: Option<(DevPtr, DevPtr, usize)>,
    /// Items per CTA: BM, or BM_WIDE (`gemmw_*`, bf16 form only); f16 form: 64, 128, 256.
    bm: usize,
    /// f16 form: inverse row scales from `gemm_xh_f32` (x then holds f16 values, strides in halves).
    /// Tiled form: from `gemm_xt_f32`.
    xs: Option<DevPtr>,
    /// Tiled form: super-block sums from `gemm_xt_f32` (null for types without mins); x then
    /// holds the hi/lo groups and xs the inverse row scales.
    xt: Option<DevPtr>,
    /// x split once by `gemm_xb_f32` (`gemmc_iq2_xxs`).
    xb: bool,
    /// Tiled form: x in the unit layout (`gemm_xt_f32` unit != 0; Q2_K on `gemmu_q2_k`).
    xu: bool,
}

/// X converted for the f16 form: f16 values (same strides as the f32 source) and per-token-row
/// inverse scales; kept alive until the products are queued.
struct HalfX {
    x: GpuBuf,
    inv: GpuBuf,
}

/// X converted for the tiled form (`gemm_xt_f32`): hi/lo f16 groups (strides of the f32
/// source), per-token inverse scales, super-block sums (K-quants only).
struct TileX {
    x: GpuBuf,
    inv: GpuBuf,
    sums: Option<GpuBuf>,
    /// Unit layout (`gemmu_q2_k`).
    unit: bool,
}

/// X as a product reads it: the f32 source, or converted for the f16 or the tiled form.
enum Xc {
    F32,
    Half(HalfX),
    Tiled(TileX),
}

impl Xc {
    /// (x, xs) fields of a [`Gm`] for source `x`.
    fn parts(&self, x: DevPtr) -> (DevPtr, Option<DevPtr>) {
        match self {
            Xc::F32 => (x, None),
            Xc::Half(h) => (h.x.ptr, Some(h.inv.ptr)),
            Xc::Tiled(t) => (t.x.ptr, Some(t.inv.ptr)),
        }
    }

    /// The `xt` field of a [`Gm`]: Some(sums or null) for the tiled form.
    fn sums(&self) -> Option<DevPtr> {
        match self {
            Xc::Tiled(t) => Some(t.sums.as_ref().map_or(DevPtr(0), |b| b.ptr)),
            _ => None,
        }
    }

    /// The `xu` field of a [`Gm`].
    fn unit(&self) -> bool {
        matches!(self, Xc::Tiled(t) if t.unit)
    }

    /// Item tile for `n` items over `experts` experts (0: dense) of weight type `ty`; `mma`:
    /// whether the device has the mma forms.
    fn tile(&self, n: usize, experts: usize, ty: GgmlType, mma: bool) -> usize {
        match self {
            Xc::F32 => tile_items(n, experts, ty, mma),
            Xc::Half(_) => half_tile(n, experts, ty),
            Xc::Tiled(_) => T_BM,
        }
    }
}

/// Whether the tiled form needs the 16-element activation sums (min terms) for `ty`.
fn needs_sums(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2_K | GgmlType::Q4_K)
}

impl GpuBackend {
    /// Prefill GEMM kernels: `on` false declines every product (general matmul.rs kernels run);
    /// `fma` true takes the portable `gemmf_*` form even where tensor cores exist. Default
    /// (true, false), or `DS4_GPU_GEMM`. Process-wide, for tests and benchmarks.
    pub fn set_gemm(on: bool, fma: bool) {
        MODE.store(
            if !on {
                2
            } else if fma {
                1
            } else {
                0
            },
            Ordering::Relaxed,
        );
    }

    /// Tensor-core form (mode of `set_gemm(true, false)`): `true` the bf16 hi/lo products
    /// (`gemm_*`/`gemmw_*`), `false` the f16 single product (`gemmh*`, default) where it applies.
    /// Process-wide (tests, benchmarks).
    pub fn set_gemm_precise(precise: bool) {
        PRECISE.store(precise as u8, Ordering::Relaxed);
    }

    /// Convert x (rows t < ntok, stride x_tok, `width` elements) for products with weight types
    /// `tys` (all must take the same form) and X strides `strides`. `lo` false: the tiled unit
    /// layout without the lo plane and lo sums (only for the one-plane `gwd_q2_k_p1`:
    /// gemm_wgd.rs `wgd_hi_only`).
    #[allow(clippy::too_many_arguments)]
    fn convert_x(
        &self,
        tys: &[GgmlType],
        strides: &[usize],
        x: DevPtr,
        ntok: usize,
        x_tok: usize,
        width: usize,
        lo: bool,
    ) -> Xc {
        if tys.iter().all(|&t| self.half_ok(t, strides)) {
            Xc::Half(self.half_x(x, ntok, x_tok, width))
        } else if tys.iter().all(|&t| self.tiled_ok(t, strides)) {
            let sums = tys.iter().any(|&t| needs_sums(t));
            // Q2_K (gemmu_q2_k) reads X in the unit layout, the other types gemmt's.
            let unit = tys.iter().all(|&t| t == GgmlType::Q2_K);
            if !unit && tys.contains(&GgmlType::Q2_K) {
                return Xc::F32;
            }
            Xc::Tiled(self.tile_x(x, ntok, x_tok, width, sums, unit, lo || !unit))
        } else {
            Xc::F32
        }
    }

    /// Whether weight type `ty` takes the tiled form with X strides `x_strides` (elements; every
    /// product's column count is among them: whole super-blocks, 16-element sums).
    fn tiled_ok(&self, ty: GgmlType, x_strides: &[usize]) -> bool {
        let t = tiled();
        mode() == 0
            && match ty {
                GgmlType::Q2_K | GgmlType::Q4_K => t >= 1,
                GgmlType::Q8_0 | GgmlType::IQ2_XXS => t >= 2,
                _ => false,
            }
            && self.mma_ok()
            && x_strides.iter().all(|s| s.is_multiple_of(256))
    }

    /// `gemm_xt_f32`: rows t < ntok of x (stride x_tok, first `width` elements) to hi/lo f16
    /// groups (+ super-block sums when `sums`; the unit layout of `gemmu_q2_k` when `unit`;
    /// without the lo plane and lo sums when `!lo`, unit layout only).
    #[allow(clippy::too_many_arguments)]
    fn tile_x(
        &self,
        x: DevPtr,
        ntok: usize,
        x_tok: usize,
        width: usize,
        sums: bool,
        unit: bool,
        lo: bool,
    ) -> TileX {
        let t = TileX {
            x: self.scratch(ntok * x_tok),
            inv: self.scratch(ntok),
            sums: sums.then(|| self.scratch(ntok * x_tok / 16)),
            unit,
        };
        self.run(
            &ds4_kernels::GEMM,
            "gemm_xt_f32",
            LaunchDims::linear(ntok as u32, 256),
            &[
                Arg::Ptr(x),
                Arg::I64(x_tok as i64),
                Arg::I32(width as i32),
                Arg::Ptr(t.x.ptr),
                t.sums.as_ref().map_or(Arg::Null, |b| Arg::Ptr(b.ptr)),
                Arg::Ptr(t.inv.ptr),
                Arg::I32(unit as i32),
                Arg::I32(lo as i32),
            ],
        );
        t
    }

    /// The MoE's SwiGLU fused into the down's X conversion (`gemm_xt_swiglu_f32`; default on,
    /// `DS4_GPU_MOE_SWIGLU_XT=0` off). Process-wide (tests, benchmarks).
    pub fn set_moe_swiglu_xt(on: bool) {
        SWXT.store(on as u8, Ordering::Relaxed);
    }

    /// `gemm_xt_swiglu_f32` launches so far in this process.
    pub fn gemm_swiglu_xt_launches() -> u64 {
        SWXT_LAUNCHES.load(Ordering::Relaxed)
    }

    /// `gemm_xt_swiglu_f32`: the MoE's h (`pairs` rows of `ff`, SwiGLU of gate `g` and up `u`
    /// with clamp and route weights `wgt`, as `moe_swiglu`) converted for the tiled down of type
    /// `ty` as `convert_x(&[ty], &[ff], h, pairs, ff, ff, lo)` would, without h; None where
    /// that conversion is not the tiled form or the row is too wide.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_tile_x(
        &self,
        ty: GgmlType,
        g: DevPtr,
        u: DevPtr,
        wgt: DevPtr,
        clamp: f32,
        pairs: usize,
        ff: usize,
        lo: bool,
    ) -> Option<Xc> {
        if !swiglu_xt()
            || ff > SWXT_MAX
            || self.half_ok(ty, &[ff])
            || !self.tiled_ok(ty, &[ff])
            || pairs > u32::MAX as usize
        {
            return None;
        }
        // convert_x's tiled branch for one type: Q2_K in the unit layout, sums for K-quants.
        let unit = ty == GgmlType::Q2_K;
        let t = TileX {
            x: self.scratch(pairs * ff),
            inv: self.scratch(pairs),
            sums: needs_sums(ty).then(|| self.scratch(pairs * ff / 16)),
            unit,
        };
        SWXT_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        // One 16-element group a thread, whole warps of 64 (wave64 too).
        let threads = (ff / 16).next_multiple_of(64).min(256) as u32;
        self.run(
            &ds4_kernels::GEMM,
            "gemm_xt_swiglu_f32",
            LaunchDims::linear(pairs as u32, threads),
            &[
                Arg::Ptr(g),
                Arg::Ptr(u),
                Arg::Ptr(wgt),
                Arg::F32(clamp),
                Arg::I32(ff as i32),
                Arg::Ptr(t.x.ptr),
                t.sums.as_ref().map_or(Arg::Null, |b| Arg::Ptr(b.ptr)),
                Arg::Ptr(t.inv.ptr),
                Arg::I32(unit as i32),
                Arg::I32((lo || !unit) as i32),
            ],
        );
        Some(Xc::Tiled(t))
    }

    /// Skip empty 16-item m-tiles (default on; `DS4_GPU_GEMM_SKIP=0` off). Process-wide (tests,
    /// benchmarks).
    pub fn set_gemm_skip(on: bool) {
        SKIP.store(on as u8, Ordering::Relaxed);
    }

    /// MoE IQ2_XXS gate/up on X split once per product (`gemmc_iq2_xxs`; default true).
    pub fn set_gemm_xb(on: bool) {
        XB.store(on as u8, Ordering::Relaxed);
    }

    /// Whether the GEMM's tensor-core forms (mma.sync, and on sm_90a wgmma) are compiled for
    /// this device (CUDA sm_80+) and not switched off (`DS4_GPU_GEMM_MMA=off`,
    /// [`GpuBackend::set_gemm_mma`]: the portable forms alone, the host path of a device without
    /// them, e.g. AMD, checked on an NVIDIA GPU). The f16, tiled, int8 and wgmma forms ask too.
    pub(super) fn mma_ok(&self) -> bool {
        let info = self.gpu.info();
        code(&MMA, "DS4_GPU_GEMM_MMA", |v| {
            (!matches!(v, Some("0") | Some("off"))) as u8
        }) == 1
            && info.vendor == crate::runtime::Vendor::Nvidia
            && info.cc.0 >= 8
    }

    /// Take the GEMM's tensor-core forms where the device has them (true, the default) or never
    /// (the portable `gemmf_*` tiles alone, as without mma). Process-wide, for tests.
    pub fn set_gemm_mma(on: bool) {
        MMA.store(on as u8, Ordering::Relaxed);
    }

    /// `gemmf_*` launches so far in this process (the portable FMA tiles).
    pub fn gemm_fma_launches() -> u64 {
        FLAUNCHES.load(Ordering::Relaxed)
    }

    /// `gemm_xb_f32`: rows t < ntok of x (stride and width `width`, a multiple of 32) as the bf16
    /// hi/lo words `gemmc_iq2_xxs` reads.
    fn split_x_buf(&self, x: DevPtr, ntok: usize, width: usize) -> GpuBuf {
        let b = self.scratch(ntok * width);
        self.run(
            &ds4_kernels::GEMM,
            "gemm_xb_f32",
            LaunchDims::linear(ntok as u32, 256),
            &[
                Arg::Ptr(x),
                Arg::I64(width as i64),
                Arg::I32(width as i32),
                Arg::Ptr(b.ptr),
            ],
        );
        b
    }

    /// Tiled form (`gemmt_*`): `on` false the bf16 hi/lo form instead; `all` also for Q8_0 and
    /// IQ2_XXS weights (default: on, Q2_K/Q4_K only). Process-wide (tests, benchmarks).
    pub fn set_gemm_tiled(on: bool, all: bool) {
        TILED.store(
            if !on {
                0
            } else if all {
                2
            } else {
                1
            },
            Ordering::Relaxed,
        );
    }

    /// Tiled-form (`gemmt_*`) GEMM launches so far in this process.
    pub fn gemm_tiled_launches() -> u64 {
        TLAUNCHES.load(Ordering::Relaxed)
    }

    /// f16 form: double-buffered shared tiles (default true; 256-item tiles never).
    pub fn set_gemm_dbuf(on: bool) {
        DBUF.store(on as u8, Ordering::Relaxed);
    }

    /// Item tile of the f16 form: 64, 128 or 256 (MoE: at most 128), 0 automatic.
    pub fn set_gemm_tile(items: usize) {
        HTILE.store(
            if [64, 128, 256].contains(&items) {
                items
            } else {
                0
            },
            Ordering::Relaxed,
        );
    }

    /// Whether weight type `ty` takes the f16 form with X strides `x_strides` (elements).
    fn half_ok(&self, ty: GgmlType, x_strides: &[usize]) -> bool {
        mode() == 0
            && !precise()
            && matches!(
                ty,
                // Not F16: those are the compressor/indexer/HC side weights (a few % of prefill
                // time) whose outputs feed discrete choices (the indexer's top-k): in f16 the
                // tiny model's prefill logits moved 0.13 from the CPU's (top-1 0.93 with the
                // model's FP8/FP4 rounding), so they keep the bf16 hi/lo form.
                GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS
            )
            && self.mma_ok()
            && x_strides.iter().all(|s| s.is_multiple_of(8)) // 16-byte f16 loads
    }

    /// `gemm_xh_f32`: rows t < ntok of x (stride x_tok, first `width` elements) to scaled f16.
    fn half_x(&self, x: DevPtr, ntok: usize, x_tok: usize, width: usize) -> HalfX {
        let h = HalfX {
            x: self.scratch((ntok * x_tok).div_ceil(2)),
            inv: self.scratch(ntok),
        };
        self.run(
            &ds4_kernels::GEMM,
            "gemm_xh_f32",
            LaunchDims::linear(ntok as u32, 256),
            &[
                Arg::Ptr(x),
                Arg::I64(x_tok as i64),
                Arg::I32(width as i32),
                Arg::Ptr(h.x.ptr),
                Arg::Ptr(h.inv.ptr),
            ],
        );
        h
    }

    /// Take the 3xTF32 tensor-core kernels `gemmp_*` (near-f32 accuracy; `gemmf_*` without mma).
    /// Process-wide; `set_gemm` switches back.
    pub fn set_gemm_tf32() {
        MODE.store(3, Ordering::Relaxed);
    }

    /// The MoE's down product: `part[i][..d] = down[expert of pair i] · h[i]` for the `pairs`
    /// rows of h (`[pairs][ff]`), grouped as `grouped` in runs of `bm`; `conv`: X converted for
    /// the f16 or tiled form (else the f32 forms).
    #[allow(clippy::too_many_arguments)]
    fn moe_down(
        &self,
        dn: (DevPtr, GgmlType, usize, usize, usize),
        h: DevPtr,
        pairs: usize,
        grouped: Option<(DevPtr, DevPtr, usize)>,
        bm: usize,
        conv: bool,
        pre: Option<Xc>,
        part: DevPtr,
    ) {
        let (ff, d) = (dn.2, dn.3);
        let hh = if let Some(x) = pre {
            x
        } else if conv {
            let lo = !self.wgd_hi_only(grouped.is_some(), ff);
            self.convert_x(&[dn.1], &[ff], h, pairs, ff, ff, lo)
        } else {
            Xc::F32
        };
        let (hx, hs) = hh.parts(h);
        let ht = hh.sums();
        self.gemm(&Gm {
            w: dn.0,
            ty: dn.1,
            w_z: 0,
            slab: d * dn.4,
            x: hx,
            x_tok: ff,
            x_z: 0,
            xdiv: 1,
            y: part,
            y_tok: d,
            y_z: 0,
            rows: d,
            cols: ff,
            row_bytes: dn.4,
            n: pairs,
            zs: 1,
            grp: grouped,
            bm,
            xs: hs,
            xt: ht,
            xb: false,
            xu: hh.unit(),
        });
    }

    /// Tests: the MoE's down alone in the tiled form (`gemmu_q2_k`, or `gwd_q2_k` on sm_90a
    /// with the wgmma switch on): `[pairs][d]` for the rows of `h` (`[pairs][ff]`) with expert
    /// choices `sel` (`[pairs]`), grouped in runs of 64; None where the tiled form does not take
    /// the down.
    #[doc(hidden)]
    pub fn moe_down_download(
        &self,
        down: &GpuWeight,
        h: &GpuBuf,
        sel: &GpuIBuf,
        pairs: usize,
        n_expert: usize,
    ) -> Option<Vec<f32>> {
        let dn = down.mat_parts()?;
        if pairs == 0
            || n_expert == 0
            || !self.tiled_ok(dn.1, &[dn.2])
            || self.half_ok(dn.1, &[dn.2])
        {
            return None;
        }
        let gmax = pairs.div_ceil(T_BM) + n_expert.min(pairs);
        let grp = self.group_pairs(sel.0.ptr, DevPtr(0), pairs, n_expert, T_BM, gmax);
        let part = self.scratch(pairs * dn.3);
        self.moe_down(
            dn,
            h.ptr,
            pairs,
            Some((sel.0.ptr, grp.ptr, gmax)),
            T_BM,
            true,
            None,
            part.ptr,
        );
        Some(
            self.download_bytes(part.ptr, pairs * dn.3 * 4)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    }

    /// Group `pairs` (token, slot) expert choices `sel` by expert on the device (pairs of weight
    /// 0 in `wgt`, where given, dropped: first in perm, in no run), runs cut every
    /// `nt` pairs, and download `[ngroups, starts[gmax], perm[pairs], ngroups2, starts2[gmax2]]`
    /// with `gmax` as `moe_experts` sizes it and the wide runs (cut every `2 nt`; `gmax2` the
    /// same bound for them) (tests: compare with a stable sort).
    #[doc(hidden)]
    pub fn gemm_group_pairs(
        &self,
        sel: &GpuIBuf,
        wgt: Option<&GpuBuf>,
        pairs: usize,
        n_expert: usize,
        nt: usize,
    ) -> Vec<i32> {
        let gmax = pairs.div_ceil(nt) + n_expert.min(pairs);
        let w = wgt.map_or(DevPtr(0), |w| w.ptr);
        let grp = self.group_pairs(sel.0.ptr, w, pairs, n_expert, nt, gmax);
        self.download_i32(
            &GpuIBuf(grp),
            1 + gmax + pairs + 1 + wide_gmax(pairs, nt, gmax),
        )
    }

    /// Test download shared by the int8 (gemm_i8.rs) and wgmma (gemm_wg.rs) gate/up forms: the
    /// pairs of `sel` (`[n][k]`) grouped in runs of `bm`, `launch` run with its switch `on` forced
    /// to 1 (restored after), gate and up as `[pairs][ff]`; None where the form does not run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gate_up_download(
        &self,
        (gate, up, z, sel): (&GpuWeight, &GpuWeight, &GpuBuf, &GpuIBuf),
        n: usize,
        k: usize,
        n_expert: usize,
        bm: usize,
        on: &AtomicU8,
        launch: GateUpFn,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        let (g, u) = (gate.mat_parts()?, up.mat_parts()?);
        let pairs = n * k;
        if pairs == 0 || n_expert == 0 {
            return None;
        }
        let gmax = pairs.div_ceil(bm) + n_expert.min(pairs);
        let grp = self.group_pairs(sel.0.ptr, DevPtr(0), pairs, n_expert, bm, gmax);
        let ff = g.3;
        let (gy, uy) = (self.scratch(pairs * ff), self.scratch(pairs * ff));
        let was = on.swap(1, Ordering::Relaxed);
        let ran = launch(
            self,
            g,
            u,
            z.ptr,
            n,
            k,
            (sel.0.ptr, grp.ptr, gmax),
            bm,
            gy.ptr,
            uy.ptr,
        );
        on.store(was, Ordering::Relaxed);
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

    /// Device grouping (gm_group_*_i32) into a new scratch `[ngroups, starts[gmax], perm[pairs]]`,
    /// followed by the wide runs (cut every `2 nt`, same perm; gemm_wg.rs's wide gate/up)
    /// `[ngroups2, starts2[wide_gmax(..)]]`.
    pub(super) fn group_pairs(
        &self,
        sel: DevPtr,
        wgt: DevPtr,
        pairs: usize,
        n_expert: usize,
        nt: usize,
        gmax: usize,
    ) -> GpuBuf {
        let gmax2 = wide_gmax(pairs, nt, gmax);
        let grp = self.scratch(1 + gmax + pairs + 1 + gmax2);
        let nb = pairs.div_ceil(GROUP_BLOCK);
        let cnt = self.scratch(nb * (n_expert + 1)); // bucket 0: dropped pairs (wgt 0)
        let (p, ne) = (Arg::I32(pairs as i32), Arg::I32(n_expert as i32));
        let blocks = LaunchDims::linear(nb as u32, GROUP_BLOCK as u32);
        self.run(
            &ds4_kernels::GEMM,
            "gm_group_count_i32",
            blocks,
            &[Arg::Ptr(sel), Arg::Ptr(wgt), p, ne, Arg::Ptr(cnt.ptr)],
        );
        self.run(
            &ds4_kernels::GEMM,
            "gm_group_scan_i32",
            LaunchDims::linear(1, 256),
            &[
                Arg::Ptr(cnt.ptr),
                Arg::I32(nb as i32),
                ne,
                Arg::I32(nt as i32),
                Arg::I32(gmax as i32),
                Arg::Ptr(grp.ptr),
                p,
                Arg::I32(gmax2 as i32),
            ],
        );
        self.run(
            &ds4_kernels::GEMM,
            "gm_group_scatter_i32",
            blocks,
            &[
                Arg::Ptr(sel),
                Arg::Ptr(wgt),
                p,
                ne,
                Arg::Ptr(cnt.ptr),
                Arg::I32(gmax as i32),
                Arg::Ptr(grp.ptr),
            ],
        );
        grp
    }

    /// Wide (128-item, `gemmw_*`) tiles from `min_n` token rows on (dense), or an average of
    /// `min_n / 2` pairs per expert (MoE); `usize::MAX` turns them off. Process-wide (tests, benchmarks).
    pub fn set_gemm_wide(min_n: usize) {
        WIDE_MIN.store(min_n.max(1), Ordering::Relaxed);
    }

    /// GEMM kernel launches so far in this process (tests: the product did not fall back).
    pub fn gemm_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Split-X (`gemmc_iq2_xxs`) GEMM launches so far in this process.
    pub fn gemm_split_launches() -> u64 {
        BLAUNCHES.load(Ordering::Relaxed)
    }

    /// (`gemmc_iq2_xxs`, `gemmu_q2_k`) launches so far in this process.
    pub fn gemm_exact_launches() -> (u64, u64) {
        (
            CLAUNCHES.load(Ordering::Relaxed),
            ULAUNCHES.load(Ordering::Relaxed),
        )
    }

    /// f16-form (`gemmh*`) GEMM launches so far in this process.
    pub fn gemm_half_launches() -> u64 {
        HLAUNCHES.load(Ordering::Relaxed)
    }

    /// Whether the GEMM takes a product of `n` rows of weight type `ty` with `cols` columns and
    /// these f32 pointers/strides (float4 loads of x need 16-byte alignment).
    fn gemm_ok(&self, ty: GgmlType, n: usize, cols: usize, x: DevPtr, x_strides: &[usize]) -> bool {
        mode() != 2
            && n >= MIN_N
            && suffix(ty).is_some()
            && cols.is_multiple_of(32)
            && x.0.is_multiple_of(16)
            && x_strides.iter().all(|s| s.is_multiple_of(4))
    }

    /// Launch one [`Gm`] (split K when the grid would leave SMs idle; never with groups).
    fn gemm(&self, m: &Gm) {
        if m.n == 0 || m.rows == 0 || m.zs == 0 || self.failed() {
            return;
        }
        let Some(sfx) = suffix(m.ty) else { return };
        let til = m.xt.is_some();
        let half = m.xs.is_some() && !til;
        let wide = m.bm == BM_WIDE && mode() == 0;
        // Without mma (HIP, sm < 80) the bf16 and 3xTF32 forms are not compiled
        // (ds4_kernels::GEMM.mma_only): the portable FMA tiles (64 items, as planned there).
        let fma = !self.mma_ok() && !til && !half;
        let form = match mode() {
            _ if fma => "gemmf".into(),
            _ if til && m.ty == GgmlType::Q2_K && m.xu => "gemmu".into(),
            _ if til => "gemmt".into(),
            _ if half => format!("gemmh{}", m.bm),
            1 => "gemmf".into(),
            3 => "gemmp".into(),
            _ if wide => "gemmw".into(),
            _ if m.xb => "gemmc".into(),
            _ => "gemm".into(),
        };
        let bm = if til {
            T_BM
        } else if half || wide {
            m.bm
        } else {
            BM
        };
        let bn = if til { T_BN } else { BN };
        let ytiles = match m.grp {
            Some((_, _, gmax)) => gmax,
            None => m.n.div_ceil(bm),
        };
        let ctas = m.rows.div_ceil(bn) * ytiles * m.zs;
        let nch = m.cols / 32;
        // Split K: up to 8 slices of at least 16 chunks while the grid is under 2 CTAs per SM.
        let want = 2 * self.gpu.info().sm_count as usize;
        let mut ks = 1;
        if m.grp.is_none() {
            while ks < 8 && ctas * ks < want && nch / (2 * ks) >= 16 {
                ks *= 2;
            }
        }
        let mut kc = nch.div_ceil(ks);
        if til {
            kc = kc.next_multiple_of(8); // whole super-blocks per slice
        }
        let ks = nch.div_ceil(kc); // no empty slice
        let total = m.n * m.y_tok; // y spans n rows of y_tok values (every batch inside)
        let part = (ks > 1).then(|| self.scratch(ks * total));
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        if form == "gemmf" {
            FLAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        if half {
            HLAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        if til {
            TLAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        if m.xb {
            BLAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        if form == "gemmc" {
            CLAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        // CUDA sm_90a: the grouped Q2_K down on wgmma (gemm_wgd.rs; DS4_GPU_GEMM_WGD=0 off).
        let wgd = (form == "gemmu")
            .then(|| {
                self.gemm_wgd_dims(
                    m.grp.is_some(),
                    bm,
                    m.zs * ks,
                    (m.rows, m.cols, m.row_bytes, m.w),
                    ytiles,
                    m.n,
                )
            })
            .flatten();
        if form == "gemmu" && wgd.is_none() {
            ULAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        let (sel, grp, gmax) = match m.grp {
            Some((s, g, gm)) => (Arg::Ptr(s), Arg::Ptr(g), gm),
            None => (Arg::Null, Arg::Null, 0),
        };
        let ctr = wgd.as_ref().and_then(|w| w.ctr); // the persistent down's tile counter (its last argument)
        let (module, name, dims) = match &wgd {
            Some(w) => (&ds4_kernels::GEMM_WGD, w.name.to_string(), w.dims), // gemmu's arguments
            None => (
                &ds4_kernels::GEMM,
                format!("{form}_{sfx}"),
                LaunchDims {
                    grid: [
                        m.rows.div_ceil(bn) as u32,
                        ytiles as u32,
                        (m.zs * ks) as u32,
                    ],
                    block: [if til { 128 } else { 2 * bm as u32 }, 1, 1],
                    shared_bytes: 0,
                },
            ),
        };
        let args = [
            Arg::Ptr(m.w),
            Arg::I64(m.w_z as i64),
            sel,
            Arg::I64(m.slab as i64),
            Arg::Ptr(m.x),
        ]
        .into_iter()
        .chain(m.xt.map(|s| if s.0 == 0 { Arg::Null } else { Arg::Ptr(s) })) // gemmt: sums
        .chain(m.xs.map(Arg::Ptr)) // gemmh/gemmt: inverse row scales
        .chain([
            Arg::I64(m.x_tok as i64),
            Arg::I64(m.x_z as i64),
            Arg::I32(m.xdiv.max(1) as i32),
            Arg::Ptr(part.as_ref().map_or(m.y, |p| p.ptr)),
            Arg::I64(m.y_tok as i64),
            Arg::I64(m.y_z as i64),
            Arg::I64(if ks > 1 { total as i64 } else { 0 }),
            Arg::I32(m.rows as i32),
            Arg::I32(m.cols as i32),
            Arg::I64(m.row_bytes as i64),
            Arg::I32(m.n as i32),
            Arg::I32(ks as i32),
            Arg::I32(kc as i32),
            grp,
            Arg::I32(gmax as i32),
            // the wgmma down: runs of at most smax pairs left to gwds_q2_k (gemm_wgd.rs)
            Arg::I32(wgd.as_ref().map_or(skip_empty() as usize, |w| w.smax) as i32),
        ])
        .chain(half.then(|| Arg::I32(dbuf() as i32))) // gemmh: db
        .chain(ctr.map(Arg::Ptr))
        .collect::<Vec<_>>();
        self.run(module, &name, dims, &args);
        if let Some(w) = &wgd {
            self.launch_wgd_small(w, &args);
        }
        if let Some(p) = part {
            self.run(
                &ds4_kernels::GEMM,
                "gemm_sum_f32",
                LaunchDims::linear(total.div_ceil(256) as u32, 256),
                &[
                    Arg::Ptr(p.ptr),
                    Arg::Ptr(m.y),
                    Arg::I32(ks as i32),
                    Arg::I64(total as i64),
                ],
            );
        }
    }

    /// `y[i] = W·x[i]` (`Part` as in Backend::matmul).
    pub(crate) fn gemm_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        if !w.blocks() {
            return false; // decode layout only: matmul.rs `mat` says why
        }
        let GpuWeight::Mat {
            buf,
            ty,
            cols,
            rows,
            row_bytes,
            ..
        } = w
        else {
            return false;
        };
        if !self.gemm_ok(*ty, n, *cols, x.ptr, &[*cols]) {
            return false;
        }
        let slab = rows * row_bytes;
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * slab,
        };
        let xc = self.convert_x(&[*ty], &[*cols], x.ptr, n, *cols, *cols, true);
        let (gx, xs) = xc.parts(x.ptr);
        self.gemm(&Gm {
            w: buf.ptr().offset(byte0 as u64),
            ty: *ty,
            w_z: 0,
            slab,
            x: gx,
            x_tok: *cols,
            x_z: 0,
            xdiv: 1,
            y: y.ptr,
            y_tok: *rows,
            y_z: 0,
            rows: *rows,
            cols: *cols,
            row_bytes: *row_bytes,
            n,
            zs: 1,
            grp: None,
            bm: xc.tile(n, 0, *ty, self.mma_ok()),
            xs,
            xt: xc.sums(),
            xb: false,
            xu: xc.unit(),
        });
        true
    }

    /// Backend::matmul_grouped: group g of every row, `y[i][g*r ..] = W[g*r ..][..r] · x[i][g*cols ..]`.
    pub(crate) fn gemm_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        if !w.blocks() {
            return false; // decode layout only: matmul.rs `mat` says why
        }
        let GpuWeight::Mat {
            buf,
            ty,
            cols,
            rows,
            row_bytes,
            ..
        } = w
        else {
            return false;
        };
        if groups == 0
            || !rows.is_multiple_of(groups)
            || !self.gemm_ok(*ty, n, *cols, x.ptr, &[groups * cols, *cols])
        {
            return false;
        }
        let r = rows / groups;
        let strides = [groups * cols, *cols];
        let xc = self.convert_x(
            &[*ty],
            &strides,
            x.ptr,
            n,
            groups * cols,
            groups * cols,
            true,
        );
        let (gx, xs) = xc.parts(x.ptr);
        self.gemm(&Gm {
            w: buf.ptr(),
            ty: *ty,
            w_z: r * row_bytes,
            slab: 0,
            x: gx,
            x_tok: groups * cols,
            x_z: *cols,
            xdiv: 1,
            y: y.ptr,
            y_tok: *rows,
            y_z: r,
            rows: r,
            cols: *cols,
            row_bytes: *row_bytes,
            n,
            zs: groups,
            grp: None,
            bm: xc.tile(n, 0, *ty, self.mma_ok()),
            xs,
            xt: xc.sums(),
            xb: false,
            xu: xc.unit(),
        });
        true
    }

    /// Backend::moe_experts: pairs (token, slot) grouped by expert, gate and up GEMMs per run of
    /// one expert, SwiGLU (clamp, weight wgt[pair]), down GEMM per pair, per-token sum over slots
    /// in selection order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_moe(
        &self,
        spec: &MoeSpec,
        gate: &GpuWeight,
        up: &GpuWeight,
        down: &GpuWeight,
        z: &GpuBuf,
        sel: &GpuIBuf,
        wgt: &GpuBuf,
        n: usize,
        out: &mut GpuBuf,
    ) -> bool {
        let (k, d, ff) = (spec.n_used, spec.d, spec.ff);
        let pairs = n * k;
        let mats = [gate, up, down].map(GpuWeight::mat_parts);
        let [Some(g), Some(u), Some(dn)] = mats else {
            return false;
        };
        if pairs == 0
            || spec.n_expert == 0
            || spec.n_expert > MAX_EXPERTS
            || pairs
                .checked_mul(ff.max(d))
                .is_none_or(|v| v > i32::MAX as usize)
            || g.2 != d
            || u.2 != d
            || dn.2 != ff
            || g.3 != ff
            || u.3 != ff
            || dn.3 != d
            || !self.gemm_ok(g.1, n, d, z.ptr, &[d])
            || !self.gemm_ok(u.1, n, d, z.ptr, &[d])
            || !self.gemm_ok(dn.1, n, ff, DevPtr(0), &[ff])
        {
            return false;
        }
        let sel = sel.0.ptr;
        // f16 or tiled form per product; gate and up share one converted z.
        let h_gu = self.half_ok(g.1, &[d]) && self.half_ok(u.1, &[d]);
        let h_dn = self.half_ok(dn.1, &[ff]);
        let t_gu = !h_gu && self.tiled_ok(g.1, &[d]) && self.tiled_ok(u.1, &[d]);
        let t_dn = !h_dn && self.tiled_ok(dn.1, &[ff]);
        // Runs of one expert cut every bm pairs: at most pairs/bm + one partial run per expert.
        // bm (64 or 128) suits both forms: a bf16-form product takes it as gemm_/gemmw_ tiles.
        let bm = if t_gu || t_dn {
            T_BM // the other products take 64-item tiles too
        } else if h_gu || h_dn {
            half_tile(pairs, spec.n_expert, g.1)
        } else {
            tile_items(pairs, spec.n_expert, g.1, self.mma_ok())
        };
        let gmax = pairs.div_ceil(bm) + spec.n_expert.min(pairs);
        // Pairs of route weight 0 (an expert-parallel rank's non-local slots) are dropped here
        // and skipped by moe_sum_f32: a rank computes only its own experts' pairs.
        let wz = if drop_zero_pairs() {
            wgt.ptr
        } else {
            DevPtr(0)
        };
        let grp = self.group_pairs(sel, wz, pairs, spec.n_expert, bm, gmax);
        let grouped = Some((sel, grp.ptr, gmax));
        let gb = self.scratch(pairs * ff);
        let ub = self.scratch(pairs * ff);
        let hz = if h_gu || t_gu {
            self.convert_x(&[g.1, u.1], &[d], z.ptr, n, d, d, true)
        } else {
            Xc::F32
        };
        // Opt-in (DS4_GPU_ACT=q8k): IQ2_XXS gate and up on int8 tensor cores (gemm_i8.rs).
        let i8 = !h_gu
            && !t_gu
            && mode() == 0
            && self.moe_gate_up_i8(g, u, z.ptr, n, k, (sel, grp.ptr, gmax), bm, gb.ptr, ub.ptr);
        // CUDA sm_90a: IQ2_XXS gate and up on wgmma (gemm_wg.rs; DS4_GPU_GEMM_WG=0 off).
        let wg = !i8
            && !h_gu
            && !t_gu
            && mode() == 0
            && self.moe_gate_up_wg(g, u, z.ptr, n, k, (sel, grp.ptr, gmax), bm, gb.ptr, ub.ptr);
        // bf16 form for IQ2_XXS gate and up (the q2 mix): z split once into hi/lo words.
        let zb = (!i8
            && !wg
            && !h_gu
            && !t_gu
            && split_x()
            && mode() == 0
            && bm == BM
            && g.1 == GgmlType::IQ2_XXS
            && u.1 == GgmlType::IQ2_XXS
            && d.is_multiple_of(32)
            && self.mma_ok())
        .then(|| self.split_x_buf(z.ptr, n, d));
        let (zx, zs) = match &zb {
            Some(b) => (b.ptr, None),
            None => hz.parts(z.ptr),
        };
        let zt = hz.sums();
        for ((p, ty, _, _, rb), dst) in [(g, &gb), (u, &ub)].into_iter().filter(|_| !i8 && !wg) {
            // Pair i reads token i / k of z.
            self.gemm(&Gm {
                w: p,
                ty,
                w_z: 0,
                slab: ff * rb,
                x: zx,
                x_tok: d,
                x_z: 0,
                xdiv: k,
                y: dst.ptr,
                y_tok: ff,
                y_z: 0,
                rows: ff,
                cols: d,
                row_bytes: rb,
                n: pairs,
                zs: 1,
                grp: grouped,
                bm,
                xs: zs,
                xt: zt,
                xb: zb.is_some(),
                xu: hz.unit(),
            });
        }
        drop(hz);
        drop(zb);
        // The down's X straight from gate and up where it takes the tiled form (no h).
        let lo = !self.wgd_hi_only(true, ff);
        let pre = t_dn
            .then(|| self.swiglu_tile_x(dn.1, gb.ptr, ub.ptr, wgt.ptr, spec.clamp, pairs, ff, lo))
            .flatten();
        let mut h = self.scratch(if pre.is_some() { 0 } else { pairs * ff });
        if pre.is_none() {
            self.moe_swiglu(&gb, &ub, &mut h, wgt, spec.clamp, ff, pairs);
        }
        let part = self.scratch(pairs * d);
        self.moe_down(dn, h.ptr, pairs, grouped, bm, h_dn || t_dn, pre, part.ptr);
        self.moe_slot_sum(part.ptr, wz, out.ptr, n, k, d);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_chunk_fits_the_step_beside_what_is_kept() {
        const MIB: u64 = 1 << 20;
        const GIB: u64 = 1 << 30;
        assert_eq!(auto_chunk(None, None), DEFAULT_CHUNK);
        // H200 after the q2 weights: ~57 GiB free, the longest step.
        assert_eq!(auto_chunk(Some(57 * GIB), None), 12288);
        // 80 GB H100, q2 with 4 host layers (~3.4 GiB free after loading): 4096, before and
        // after a step measured 504 KiB a token; less room as the context grows: shorter.
        assert_eq!(auto_chunk(Some(3400 * MIB), None), 4096);
        assert_eq!(auto_chunk(Some(3400 * MIB), Some(504 << 10)), 4096);
        assert_eq!(auto_chunk(Some(2400 * MIB), Some(504 << 10)), 3072);
        assert_eq!(auto_chunk(Some(1800 * MIB), Some(504 << 10)), 2048);
        // 512 MiB kept below 4 GiB: 4096 tokens of 576 KiB fit 2816 MiB, not a byte less.
        assert_eq!(auto_chunk(Some(2816 * MIB), None), 4096);
        assert_eq!(auto_chunk(Some(2816 * MIB - 1), None), 3072);
        // An eighth kept above: 8192 tokens of 576 KiB need 4608 * 8/7 MiB (5266.3) available.
        assert_eq!(auto_chunk(Some(5267 * MIB), None), 8192);
        assert_eq!(auto_chunk(Some(5266 * MIB), None), 6144);
        // A measured figure gets an eighth more: 576 KiB measured is 648 KiB a token.
        assert_eq!(auto_chunk(Some(5267 * MIB), Some(576 << 10)), 6144);
        // Never below the floor, even with almost nothing free.
        assert_eq!(auto_chunk(Some(GIB), None), MIN_AUTO_CHUNK);
        assert_eq!(auto_chunk(Some(0), Some(MIB)), MIN_AUTO_CHUNK);
        let mut last = 0;
        for f in (0..200).map(|i| i * 512 * MIB) {
            let c = auto_chunk(Some(f), Some(700 << 10));
            assert!(AUTO_CHUNKS.contains(&c) && c >= last, "{f}: {c}");
            let kept = (f / 8).max(STEP_KEEP);
            assert!(c == MIN_AUTO_CHUNK || c as u64 * (700 << 10) * 9 / 8 <= f - kept);
            last = c;
        }
        assert_eq!(last, DEFAULT_CHUNK);
    }

    #[test]
    fn env_override_wins_over_the_automatic_step() {
        // The only test that sets this variable (tests of one binary share the environment).
        std::env::set_var("DS4_GPU_PREFILL_CHUNK", "777");
        assert_eq!(prefill_chunk(|| 4096), 777);
        std::env::set_var("DS4_GPU_PREFILL_CHUNK", "0"); // not a step: ignored
        assert_eq!(prefill_chunk(|| 4096), 4096);
        std::env::remove_var("DS4_GPU_PREFILL_CHUNK");
        assert_eq!(prefill_chunk(|| 8192), 8192);
    }
}
