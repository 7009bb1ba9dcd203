//! Decode-time weight products (n ≤ 4 token rows). Each entry returns true when it ran the product, false to leave it to the general
//! kernels of matmul.rs (unsupported type or shape). Semantics: ds4-cpu backend.rs.
//!
//! Staged form (`mvs<NT>_<t>` in gpu/matvec.cu): a CTA copies a tile of whole rows (or, when rows
//! are few, a column range of one row: split K across CTAs, tiles added in order by `mvs_sum_f32`)
//! into shared memory with coalesced 16-byte loads, then computes from there (`mvs_plan` sizes it).
//! It is the default only where it measured faster (`staged_wins`: 2-bit types, Q8_0/Q4_K at
//! n = 2..4, the 16384-column F16 mixes); otherwise `mv<NT>_<t>` (lanes over consecutive 8-element
//! slices, x kept in registers across the MV_R rows of a warp) for n = 2..4 and matmul.rs's
//! coalesced kernels for n = 1. For n = 1 Q8_0/F16 the `mvq_<form>_<t>` kernels come first
//! (`mvq_auto`: all loads of U column steps × R rows of a warp issued before the math, 2.9 TB/s on
//! the Q8_0 head). Q8_0 matrices of one slab also get a decode-layout copy at upload
//! (`q8_decode_copy`: 16-byte aligned quant rows + a separate f16 scale array; the GGUF blocks
//! stay for the GEMM), and their n = 1 products run `mvr_<form>_q8_0` from it (16-byte loads),
//! or `mvx_r4u2_q8_0` (x staged once per CTA in shared memory) for rows of <= 1024 columns;
//! copies of longer rows in whole 512-column tiles take the interleaved layout (`Q8_IL`, default:
//! contiguous x loads a warp) and the `*_q8_0i` kernels;
//! merged F16 sets of >= 2048 rows take `mvxm_r4u2_f16` (`Q8_FORM`).
//! Few-row F16 products can split their columns across CTAs (`mvq_splits`, opt-in). Also: the n = 1 variants `mv1v<v>_<t>` (opt-in) and `mvgu_<t>`/`mvdown_<t>`
//! for the routed experts.
//! n = 2..4 (speculative verify steps, session 33): Q8_0 products with a decode-layout copy run
//! `mvrn2` / `mvrn4` (each row read once for every token; each token's sums as `mvr_r2u2`'s for
//! it alone), and the model's merged n = 1 forms (F16 sets, the shared expert's gate/up and
//! down + add: mod.rs) run once per token on views of the token rows.

use super::{type_suffix as suffix, GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::gpu::DeviceBuffer;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{GgmlType, MoeSpec, Part};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Warps per CTA (`MV_WARPS` in matvec.cu).
const MV_WARPS: usize = 8;
/// Rows per warp (`MV_R`).
const MV_R: usize = 4;
/// Most slots per token of `mvdown_*` (`MV_MAXK`).
const MV_MAXK: usize = 8;

/// Process-wide switch (on by default) so tests and benchmarks can compare with matmul.rs.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Whether one-row products (decode, n = 1) take the `mv1*` kernels where the staged form is not
/// used. Off by default: on the
/// full-size q2 model on an H200 the coalesced kernels of matmul.rs decode faster (51.9 against
/// 37–45 tok/s, bench/results/gpu-resident-full-q2.txt); n = 2..4 (speculative verification)
/// stay here, where one read of the weights serves every row.
static ONE: AtomicBool = AtomicBool::new(false);

/// Kernel form of `mv_matmul`/`mv_grouped`: 0 (default) staged `mvs*` where it measured faster
/// (`staged_wins`), else `mv<NT>_*` for n = 2..4 and matmul.rs for n = 1; 1..=3 the n = 1 variants
/// `mv1v<v>_*` (Q8_0, Q2_K, Q4_K, IQ2_XXS) and `mv<NT>_*` otherwise; 4 no staged kernels (the form
/// before them); 5 staged for every type and n it takes. Process-wide, for tests and benchmarks
/// (`DS4_GPU_MATVEC=v<k>`).
static VARIANT: AtomicU8 = AtomicU8::new(0);

/// n = 1 products of Q8_0 and F16 by `mvq_<form>_<t>` (all loads of U column steps × R rows
/// issued before the math): MVQ_AUTO (default) where `mvq_auto` says it measured faster, 0 never,
/// 1..=2 always the form MVQ_FORMS[k - 1]. `DS4_GPU_MVQ=off|auto|r2u4|r1u4` (r1u8 and r4u2,
/// never the fastest, were deleted).
static MVQ: AtomicU8 = AtomicU8::new(MVQ_AUTO);
const MVQ_AUTO: u8 = 255;
static MVQ_ENV: std::sync::Once = std::sync::Once::new();
/// (name, rows per warp R); U = 8 / R column steps except r1u4.
const MVQ_FORMS: [(&str, usize); 2] = [("r2u4", 2), ("r1u4", 1)];
/// The F16 `mvq_*` / `mvqm_*` kernels with their first round of weight loads issued before the
/// PDL wait (`mvq_r2u4_f16l`, `mvq_r1u4_f16l`, `mvqm_r2u4_f16l`; as the `mvr` / `mvx` forms and
/// the router do): in the model's products (indexer q_b 1024 -> 8192, HCA compressor 4096 ->
/// 2 x 512, the HC mixers) that round is every weight load of the warp, so they overlap the
/// previous kernel. The same sums. `DS4_GPU_MVQ_LATE=on|off` (or `set_matvec_mvq_late`). Default
/// on: H200 graph us after an rms_norm (matvec_bench f2), early -> late: indexer q_b 7.29 ->
/// 6.55, HCA compressor 6.05 -> 4.55, router product 4.77 -> 3.92, HC mixer 16384->24 6.56 ->
/// 6.31; 2k decode +1.4% (bench/results/gpu-f220-h200.txt).
static MVQ_LATE: AtomicBool = AtomicBool::new(true);
static MVQ_LATE_ENV: std::sync::Once = std::sync::Once::new();

/// Interleaved F16 copies (gpu/matvec.cu `f16_repack_i`: tiles of 256 columns whose 16-byte
/// slot s holds columns 4s .. 4s + 3 and 128 + 4s .. + 3, so a warp step's x loads are 512
/// contiguous bytes each) of F16 single-slab matrices of at least F16_IL_ROWS rows and at most
/// F16_IL_MAXC columns in whole tiles (the indexer's q_b, 1024 -> 8192: 16.8 MB more a CSA layer),
/// taken by its n = 1 r2u4 products (`mvq_r2u4_f16i`, `_f16il` with `MVQ_LATE`).
/// `DS4_GPU_F16_IL=on|off` (or `set_matvec_f16_il`), read when a copy would be made. Per lane
/// another order of the same f32 sums.
static F16_IL: AtomicBool = AtomicBool::new(false);
static F16_IL_ENV: std::sync::Once = std::sync::Once::new();
const F16_IL_ROWS: usize = 4096;
const F16_IL_MAXC: usize = 2048;

/// "l" (the late-wait kernel name's suffix) for F16 when `MVQ_LATE` is on, else "".
fn mvq_late(ty: GgmlType) -> &'static str {
    MVQ_LATE_ENV.call_once(|| {
        if let Ok(v) = std::env::var("DS4_GPU_MVQ_LATE") {
            MVQ_LATE.store(!matches!(v.as_str(), "off" | "0"), Ordering::Relaxed);
        }
    });
    if ty == GgmlType::F16 && MVQ_LATE.load(Ordering::Relaxed) {
        "l"
    } else {
        ""
    }
}

/// n = 1 products of Q8_0 matrices that have a decode-layout copy (`GpuWeight::Mat::dec`, made
/// at upload by `q8_decode_copy`) by `mvr_<form>_q8_0` (16-byte quant loads, one halfword scale
/// per half block): MVQ_AUTO (default) the form `mvr_auto` picks, 0 never (the `mvq` path on the
/// GGUF blocks), 1..=2 always MVR_FORMS[k - 1]. `DS4_GPU_Q8_REPACK=off` makes no copies at all
/// (the memory of the previous form); `=r4u2|r2u2` fixes the form (r1u8 and r2u4 lost
/// everywhere: deleted).
static MVR: AtomicU8 = AtomicU8::new(MVQ_AUTO);
static MVR_ENV: std::sync::Once = std::sync::Once::new();
/// Whether uploads make decode-layout copies (false: `DS4_GPU_Q8_REPACK=off`).
static REPACK: AtomicBool = AtomicBool::new(true);
/// Decode-layout copies made in the interleaved layout (gpu/matvec.cu `q8_repack_i`: tiles of
/// 512 columns whose 16-byte slot s holds columns 128j + 4s .. + 3, j = 0..3, so a warp's x
/// loads are contiguous; products `*_q8_0i`) for matrices of more than MVX_Q8_MAXC columns in
/// whole tiles (the `mvr*` products; the `mvx*` ones of <= 1024 columns keep the plain layout):
/// `DS4_GPU_Q8_IL=on|off` (or `set_matvec_q8_il`), read when a copy is made; each copy records
/// its layout (`GpuWeight::Mat::dec_il`). Same bytes; per lane the sum runs over four scale
/// groups of 4 columns instead of one of 16 (another f32 rounding order; ops_matvec
/// matvec_interleaved: within the f64 bound as the plain layout, e.g. 2.6e-5 against 2.4e-5 at
/// 8192 columns). Default on: H200, 2k decode 157.5 / 156.9 against 153.3 / 153.5 tok/s plain;
/// graph us per call plain -> interleaved: out_a 12.69 -> 12.48, out_b 12.96 -> 12.88, shared
/// down 5.15 -> 4.51, q_a 3.43 -> 3.05, head 162.1 -> 143.7, q_a + kv 4.75 -> 4.44, shared
/// gate/up 7.91 -> 6.79 (bench/results/gpu-m119-h200.txt; ncu out_a: L1/TEX 80% -> 29% busy).
static Q8_IL: AtomicBool = AtomicBool::new(true);
/// `mvr_r2u2_q8_0ip` for the single interleaved r2u2 products (`DS4_GPU_MVR_PIPE=1`): each
/// step's next-round loads issued right after that step's math (the same sums). Opt-in: H200
/// graph us out_a 11.6 against 12.5, out_b 12.1 against 12.9, but 2k decode 157.4 against 157.0
/// tok/s (4 pairs, within noise; bench/results/gpu-m119-h200.txt).
static MVR_PIPE: AtomicBool = AtomicBool::new(false);
/// `mvrn*` products for n = 2..4: 1 on, 2 off (`DS4_GPU_MVRN=off`), 0 not read yet.
static MVRN: AtomicU8 = AtomicU8::new(0);
/// `mvrn*` launches (process-wide; tests: the n = 2..4 form ran).
static MVRN_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// `mvxn2` / `mvxn4` for the query's norm + q_b of n = 2..4 token rows (verify steps): 1 on
/// (the default), 2 off (`DS4_GPU_MVXN_TOK=off`: `mvxn` once per token), 0 not read yet.
static MVXN_TOK: AtomicU8 = AtomicU8::new(0);
/// `mvxn2` / `mvxn4` launches (process-wide; tests: the n-token form ran).
static MVXN_TOK_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The n-token forms of the fused and merged decode products for verify steps (the shared
/// expert's gate/up `mvrgun2` / `mvrgun4` and down + add `mvran2` / `mvran4`, the compressor
/// sets `mvxm2`, the router + route `mvq_route2_f16r` / `mvq_route4_f16r` in mix.rs): 1 on
/// (the default; with `mvxn2` and one-row `mvrn2` a 2k verify step at 2 tokens went 198 -> 214
/// tok/s, bench/results/gpu-s64-h100.txt), 2 off (`DS4_GPU_MVN=off`: their n = 1 forms once
/// per token, the router's product and route apart), 0 not read yet.
static MVN: AtomicU8 = AtomicU8::new(0);

pub(super) fn mvn_on() -> bool {
    super::switch::env_code(&MVN, "DS4_GPU_MVN", super::switch::on_unless_off) == 1
}

fn mvxn_tok_on() -> bool {
    super::switch::env_code(&MVXN_TOK, "DS4_GPU_MVXN_TOK", super::switch::on_unless_off) == 1
}

fn mvrn_on() -> bool {
    super::switch::env_code(&MVRN, "DS4_GPU_MVRN", super::switch::on_unless_off) == 1
}

/// Rows a warp of the interleaved `mvrn*` products: 1 (`mvrn<NT>_r1u2_q8_0i`, the default: half
/// the converted quants in registers, 64 against 80 and a spill; kspl planned as for two rows, so
/// the same bits) or 2 (`mvrn<NT>_r2u2_q8_0i`, `DS4_GPU_MVRN_R=2`); 0 not read yet.
static MVRN_R: AtomicU8 = AtomicU8::new(0);

fn mvrn_rows() -> usize {
    super::switch::env_pick(&MVRN_R, "DS4_GPU_MVRN_R", &[("1", 1), ("2", 2)], 1) as usize
}

/// Columns of one interleaved tile.
const IL_TILE: usize = 512;
/// (name, rows per warp R, column steps U in flight).
const MVR_FORMS: [(&str, usize); 2] = [("r4u2", 4), ("r2u2", 2)];

/// Bytes of `q8_decode_copy`'s copy of a matrix (0: none is made): Q8_0 with one slab,
/// unless `DS4_GPU_Q8_REPACK=off`; as many bytes as the GGUF blocks (32 i8 + one f16 a block).
fn q8_copy_bytes(ty: GgmlType, cols: usize, rows: usize, experts: usize) -> usize {
    mvr_env();
    if ty != GgmlType::Q8_0
        || experts != 1
        || !REPACK.load(Ordering::Relaxed)
        || cols == 0
        || rows == 0
        || !cols.is_multiple_of(32)
    {
        return 0;
    }
    rows * cols / 32 * 34
}

/// Bytes of `f16_il_copy`'s copy (0: none): F16 matrices of at least F16_IL_ROWS rows and at
/// most F16_IL_MAXC columns (a multiple of 256), with `DS4_GPU_F16_IL=on` (off by default).
fn f16_il_bytes(ty: GgmlType, cols: usize, rows: usize, experts: usize) -> usize {
    F16_IL_ENV.call_once(|| {
        if let Ok(v) = std::env::var("DS4_GPU_F16_IL") {
            F16_IL.store(matches!(v.as_str(), "on" | "1"), Ordering::Relaxed);
        }
    });
    if ty != GgmlType::F16
        || experts != 1
        || !F16_IL.load(Ordering::Relaxed)
        || rows < F16_IL_ROWS
        || cols > F16_IL_MAXC
        || cols == 0
        || !cols.is_multiple_of(256)
    {
        return 0;
    }
    rows * cols * 2
}

/// Reads `DS4_GPU_Q8_REPACK` once (before the first copy or product).
fn mvr_env() {
    MVR_ENV.call_once(|| {
        if let Ok(v) = std::env::var("DS4_GPU_Q8_REPACK") {
            if v == "off" {
                REPACK.store(false, Ordering::Relaxed);
                MVR.store(0, Ordering::Relaxed);
            } else if let Some(i) = MVR_FORMS.iter().position(|f| f.0 == v) {
                MVR.store(i as u8 + 1, Ordering::Relaxed);
            }
        }
        if let Ok(v) = std::env::var("DS4_GPU_Q8_IL") {
            Q8_IL.store(matches!(v.as_str(), "on" | "1"), Ordering::Relaxed);
        }
        if let Ok(v) = std::env::var("DS4_GPU_MVR_PIPE") {
            MVR_PIPE.store(matches!(v.as_str(), "on" | "1"), Ordering::Relaxed);
        }
    });
}

/// Whether a decode-layout copy of `cols` columns made now takes the interleaved layout.
fn q8_il(cols: usize) -> bool {
    Q8_IL.load(Ordering::Relaxed) && cols > MVX_Q8_MAXC && cols.is_multiple_of(IL_TILE)
}

/// The `mvr` form (1..=2) the default takes for `rows` rows (all groups) of `cols`. H200,
/// 2026-11-30 (bench/results/gpu-matvec-s4-h200.txt, graph-timed us per call, `mvq` r2u4 on the
/// GGUF blocks in brackets): r4u2 on the head (147.6 [194.9], 3.8 TB/s), r2u2 elsewhere: out_a
/// 13.6 [20.8], out_b 13.7 [20.0], q_b 14.6 [17.0], shared up/down 6.3/6.2 [7.3/7.3], q_a 4.1
/// [5.4], kv 3.3 [3.3]; r2u4 (72 registers) and r1u8 lose to both.
fn mvr_auto(rows: usize, _cols: usize) -> u8 {
    if rows >= 65536 {
        1
    } else {
        2
    }
}

/// n = 1 products by `mvx*` (x staged once per CTA in shared memory, rows in batches of 4 rows
/// × 2 warp steps, the next round's loads issued as the current one's math frees their
/// registers; gpu/matvec.cu) where they measured faster (H200, bench/results/gpu-q8-q-h200.txt):
/// Q8_0 decode-copy products of at most MVX_Q8_MAXC columns (`mvx_r4u2_q8_0`, one batch per
/// CTA: attn q_b 12.9 against 15.0 us) and merged F16 sets of at least MVXM_MIN_ROWS rows
/// (`mvxm_r4u2_f16`, 3 CTAs per SM: CSA compressor + indexer 8.9 against 10.6 us). They lost
/// on the longer rows (out_a 14.7 against 13.1, out_b 15.7 against 13.6, shared down 7.0
/// against 6.0, head 147.6 against 146.2: x staged per CTA and the k-slice barriers), on F16
/// single products and the small sets, and as merged Q8_0 (q_a + kv: a tie) or gate/up
/// (11.2 against 9.1) kernels: those forms were deleted. Q8_FORM: 1 (default) as above, 0 the
/// previous forms everywhere (`DS4_GPU_Q8_FORM=r`, `=x` the default). MVX_CTAS: CTAs per SM of
/// the grid (`DS4_GPU_MVX_CTAS`, 0: one batch per CTA; 255: per kind as above).
static Q8_FORM: AtomicU8 = AtomicU8::new(1);
static MVX_CTAS: AtomicU8 = AtomicU8::new(255);
static Q8_FORM_ENV: std::sync::Once = std::sync::Once::new();
/// Most columns of the `mvx_r4u2_q8_0` default.
const MVX_Q8_MAXC: usize = 1024;
/// Fewest rows of a merged F16 set on `mvxm_r4u2_f16` (HCA compressor, 2 × 512: 6.1 against 4.4 us).
const MVXM_MIN_ROWS: usize = 2048;
/// Most columns of an `mvx*` product (x in 32 KB of shared memory: `MVX_MAXC`).
const MVX_MAXC: usize = 8192;

/// (Q8_FORM, CTAs per SM for a kind whose default is `dflt`).
fn q8_form(dflt: usize) -> (u8, usize) {
    Q8_FORM_ENV.call_once(|| {
        if let Ok(v) = std::env::var("DS4_GPU_Q8_FORM") {
            match v.as_str() {
                "r" => Q8_FORM.store(0, Ordering::Relaxed),
                "x" => Q8_FORM.store(1, Ordering::Relaxed),
                _ => {}
            }
        }
        if let Some(c) = std::env::var("DS4_GPU_MVX_CTAS")
            .ok()
            .and_then(|v| v.parse::<u8>().ok())
        {
            MVX_CTAS.store(c.min(8), Ordering::Relaxed);
        }
    });
    let c = MVX_CTAS.load(Ordering::Relaxed);
    (
        Q8_FORM.load(Ordering::Relaxed),
        if c == 255 { dflt } else { c as usize },
    )
}

/// CTA batches per SM the `mvx*` plan aims at when it picks the k-slices (`DS4_GPU_MVX_SPREAD`).
static MVX_SPREAD: AtomicU8 = AtomicU8::new(6);
static MVX_SPREAD_ENV: std::sync::Once = std::sync::Once::new();

fn mvx_spread() -> usize {
    MVX_SPREAD_ENV.call_once(|| {
        if let Some(c) = std::env::var("DS4_GPU_MVX_SPREAD")
            .ok()
            .and_then(|v| v.parse::<u8>().ok())
        {
            MVX_SPREAD.store(c.max(1), Ordering::Relaxed);
        }
    });
    MVX_SPREAD.load(Ordering::Relaxed) as usize
}

/// `mvx*` launch shape: k-slices per row group `ks` (1, 2, 4, 8: the fewest giving
/// `mvx_spread()` CTA batches per SM over all `zs` groups, each slice at least two warp steps of
/// the `hb` slots),
/// CTA batches per group `ncb` ((MV_WARPS / ks) * `r` rows each, `rows_of(per_cta)`), and the
/// grid's CTAs per group (capped at `ctas` per SM, 0: no cap, with the batches spread evenly).
fn mvx_plan(
    rows_of: impl Fn(usize) -> usize,
    r: usize,
    hb: usize,
    zs: usize,
    sm: usize,
    warp: usize,
    ctas: usize,
) -> (usize, usize, usize) {
    let kmax = (hb / (2 * warp)).clamp(1, MV_WARPS);
    let want = mvx_spread() * sm;
    let mut ks = 1;
    while 2 * ks <= kmax && rows_of(MV_WARPS / ks * r) * zs < want {
        ks *= 2;
    }
    let ncb = rows_of(MV_WARPS / ks * r).max(1);
    let gx = if ctas == 0 {
        ncb
    } else {
        let cap = (ctas * sm).div_ceil(zs).max(1);
        ncb.div_ceil(ncb.div_ceil(cap))
    };
    (ks, ncb, gx)
}

/// Merged n = 1 products (`mv_multi`: several matrices of one x in one launch, `mvrm_*`/`mvqm_*`;
/// `mv_gateup`: the shared expert's gate, up and SwiGLU in one, `mvrgu_*`): on by default,
/// `DS4_GPU_MERGE=off` (or `set_matvec_merge(false)`) runs the products one by one as before.
/// H200, graph-timed per set (bench/results/gpu-q8-y-h200.txt): q_a + kv 5.7 against 7.9 us,
/// CSA compressor + indexer (5 F16) 9.2 against 18.7, HCA compressor 4.9 against 7.2, shared
/// gate/up + SwiGLU 9.9 against 14.0; decode at 2k 92.9 against 90.1 tok/s.
static MERGE: AtomicBool = AtomicBool::new(true);
static MERGE_ENV: std::sync::Once = std::sync::Once::new();
/// Most matrices of one merged launch: `mvrm_*` (4 argument sets of 4) and `mvqm_*` (5 of 3);
/// a launch takes at most 24 arguments (runtime.rs MAX_ARGS).
const MVRM_MAX: usize = 4;
const MVQM_MAX: usize = 5;

fn merge_on() -> bool {
    MERGE_ENV.call_once(|| {
        if let Ok(v) = std::env::var("DS4_GPU_MERGE") {
            MERGE.store(v != "off", Ordering::Relaxed);
        }
    });
    MERGE.load(Ordering::Relaxed)
}

/// CTA offsets c_1..c_{max-1} of a merged launch (`mvm_pick`): matrix m of `rows[m]` rows takes
/// ceil(rows[m] / per_cta) CTAs after those of the matrices before it; absent m: i32::MAX.
/// Returns (offsets, total CTAs).
fn mvm_offsets(rows: &[usize], per_cta: usize, max: usize) -> (Vec<i32>, usize) {
    let mut c = vec![i32::MAX; max - 1];
    let mut total = 0;
    for (m, &r) in rows.iter().enumerate() {
        if m > 0 {
            c[m - 1] = total as i32;
        }
        total += r.div_ceil(per_cta);
    }
    (c, total)
}

/// Few-row F16 products (fewer rows than SMs: the HC mixers 16384->24 and ->4, the indexer's
/// 4096->64) can split their columns into `mvq_splits` ranges run as the z groups of one `mvq_*`
/// launch (same rows, columns shifted), partials added in range order by `mvs_sum_f32`. Opt-in
/// (`DS4_GPU_MVQ_SPLIT=on`, `set_matvec_split(true)`): on the H200 it tied the whole form once
/// `mvq_*` issued a warp's last partial round of loads together (hc mix 3.8 against 3.9 us per
/// call, head mix 3.45 against 3.40) and lost on 4096->64 (3.6 against 3.1 by mmc).
static SPLIT: AtomicBool = AtomicBool::new(false);
static SPLIT_ENV: std::sync::Once = std::sync::Once::new();

/// Column ranges for an F16 `rows × cols` product, or 1 (no split): ranges of at least 1024
/// columns (4 warp steps of 256), at most 16, a power of two dividing the 32-column chunks.
fn mvq_splits(ty: GgmlType, rows: usize, cols: usize, zs: usize, sm: usize) -> usize {
    if ty != GgmlType::F16 || zs != 1 || rows >= sm || !cols.is_multiple_of(32) {
        return 1;
    }
    let mut s = 1;
    while 2 * s <= 16 && cols / (2 * s) >= 1024 && (cols / 32).is_multiple_of(2 * s) {
        s *= 2;
    }
    s
}

/// The `mvq` form (1..=2) the default takes for `ty` with `rows` rows (all groups) of `cols`, or 0.
/// H200, 2026-11-30 (bench/results/gpu-matvec-h200.txt, helper N): r2u4 is the fastest form on
/// every Q8_0 shape of the model (head 191 against 272 us for mmc, out_b 16.6 against 22.2,
/// grouped out_a 16.7 against 22.8, q_b 18.2 against 25.3, q_a 5.4 against 7.0) and on F16
/// products of 256 rows or more (router 4.6 against 5.5, 1024->8192 7.8 against 11.8); r1u4 on
/// the few-row 16384-column F16 mixes (24 rows: 5.7 against 9.3 staged; 4 rows not measured);
/// F16 4096->64 ties mmc (4.5 us) and stays there.
fn mvq_auto(ty: GgmlType, rows: usize, cols: usize, _sm: usize) -> u8 {
    match ty {
        GgmlType::Q8_0 => 1,
        GgmlType::F16 if rows >= 128 => 1,
        GgmlType::F16 if cols >= 16384 => 2,
        _ => 0,
    }
}

/// Whether the default form stages `ty` at `n` rows. H200, 2026-11-30
/// (bench/results/gpu-matvec-h200.txt): staged beats the other forms for Q2_K and IQ2_XXS at every
/// n (1.1-1.5x) and for Q8_0 at n = 2..4 (1.1-1.4x on the model's shapes, except 4096->1024), ties
/// Q4_K; at n = 1 the coalesced `mmc*` kernels win for Q8_0 (1.77 against 1.30 TB/s) and the
/// float types, and `mv<NT>_*` wins for the float types at n = 2..4 (the staged form stops near
/// 2.1 TB/s for every type: one load phase, then one compute phase per CTA). One exception: the
/// few-row F16 mixes with 16384 columns (split K across CTAs) at n = 1: 16384->24 10.2 against
/// 12.4 us device time per call, 16384->4 8.6 against 11.2 (4096->64: 9.2 against 6.4, not taken);
/// n = 1 Q8_0/F16 now go to `mvq_*` first where `mvq_auto` takes them (the hc mixes included).
fn staged_wins(ty: GgmlType, n: usize, rows: usize, cols: usize, sm: usize) -> bool {
    match ty {
        GgmlType::Q2_K | GgmlType::IQ2_XXS => true,
        GgmlType::Q8_0 | GgmlType::Q4_K => n >= 2,
        GgmlType::F16 => n == 1 && cols >= 16384 && rows < sm,
        _ => false,
    }
}

/// Bytes of weights one `mvs*` CTA stages (`MVS_STAGE` in matvec.cu).
const MVS_STAGE: usize = 17408;

/// The smallest run of whole blocks that is a multiple of 16 bytes: (bytes, 32-element chunks).
/// Split-K tiles of `mvs*` are whole units.
fn unit(ty: GgmlType) -> Option<(usize, usize)> {
    Some(match ty {
        GgmlType::F32 => (128, 1),
        GgmlType::F16 | GgmlType::BF16 => (64, 1),
        GgmlType::Q8_0 => (272, 8),
        GgmlType::Q2_K => (336, 32),
        GgmlType::Q4_K => (144, 8),
        GgmlType::IQ2_XXS => (528, 64),
        _ => return None,
    })
}

/// Launch shape of one `mvs*` product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MvsPlan {
    /// Rows per CTA.
    pub rc: usize,
    /// Column tiles per row (CTAs along y; > 1: partials + `mvs_sum_f32`).
    pub ks: usize,
    /// Bytes and 32-element chunks per column tile (the whole row when ks = 1).
    pub tile_bytes: usize,
    pub tile_chunks: usize,
    /// Warps of a CTA splitting the column steps of the same rows.
    pub ksi: usize,
}

/// `mvs*` launch shape for `rows` rows (per each of `zs` groups) of `cols` columns and `rb` bytes,
/// NT tokens per kernel, on `sm` multiprocessors with warp `warp`. None: rows not 16-byte
/// multiples (or too long to stage and not whole units).
#[allow(clippy::too_many_arguments)]
pub(crate) fn mvs_plan(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    rb: usize,
    zs: usize,
    nt: usize,
    sm: usize,
    warp: usize,
) -> Option<MvsPlan> {
    let (ub, uc) = unit(ty)?;
    if rows == 0 || zs == 0 || !rb.is_multiple_of(16) || !cols.is_multiple_of(32) {
        return None;
    }
    let chunks = cols / 32;
    let items = rows * zs;
    // Bytes per CTA: about 4 CTAs per SM over the product, 2 KB .. the stage.
    let target = (items * rb / (4 * sm)).clamp(2048, MVS_STAGE);
    let whole = rb.is_multiple_of(ub) && chunks == rb / ub * uc;
    let (ks, tile_bytes, tile_chunks) = if whole && (items < sm || rb > MVS_STAGE) {
        // Few rows (or rows too long to stage): split each row into about 2 CTAs per SM.
        let upr = rb / ub;
        let want = (2 * sm).div_ceil(items).max(rb.div_ceil(MVS_STAGE));
        let upt = upr.div_ceil(want).clamp(1, MVS_STAGE / ub);
        (upr.div_ceil(upt), upt * ub, upt * uc)
    } else if rb <= MVS_STAGE {
        (1, rb, chunks)
    } else {
        return None;
    };
    let steps = tile_chunks.div_ceil(warp / 4);
    let mut ksi = 1;
    while ksi < 8 && 2 * ksi <= steps {
        ksi *= 2;
    }
    let rmax = 16 / nt * (8 / ksi);
    let rc = if ks == 1 {
        (target / rb).clamp(1, rmax).min(rows)
    } else {
        1
    };
    Some(MvsPlan {
        rc,
        ks,
        tile_bytes,
        tile_chunks,
        ksi,
    })
}

/// Rows per warp of each variant.
const VARIANT_ROWS: [usize; 4] = [MV_R, 1, 2, 4];

/// A matrix weight the kernels take: (pointer, type suffix, cols, rows, row_bytes). Needs
/// whole 32-element chunks and 16-byte aligned rows for the float types (16-byte slice loads).
fn mat(w: &GpuWeight) -> Option<(DevPtr, &'static str, usize, usize, usize)> {
    let (p, ty, cols, rows, row_bytes) = w.mat_parts()?;
    let sfx = suffix(ty)?;
    let wide = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if cols == 0 || rows == 0 || !cols.is_multiple_of(32) || !p.0.is_multiple_of(16) {
        return None;
    }
    if wide && !row_bytes.is_multiple_of(16) {
        return None;
    }
    Some((p, sfx, cols, rows, row_bytes))
}

/// The arguments the one-row `mvr_*` / `mvx_*` kernels share: weights `w` (quants), their
/// scales `d` (F16: null), x and y with their group strides, the shape, and the column split.
#[allow(clippy::too_many_arguments)]
fn q8_args(
    w: DevPtr,
    d: DevPtr,
    x: &GpuBuf,
    x_z: usize,
    y: DevPtr,
    y_z: usize,
    rows: usize,
    cols: usize,
    k: usize,
) -> [Arg; 9] {
    [
        Arg::Ptr(w),
        Arg::Ptr(d),
        Arg::Ptr(x.ptr),
        Arg::I64(x_z as i64),
        Arg::Ptr(y),
        Arg::I64(y_z as i64),
        Arg::I32(rows as i32),
        Arg::I32(cols as i32),
        Arg::I32(k as i32),
    ]
}

impl GpuBackend {
    /// Use (true, the default) or skip the decode kernels; process-wide, for tests and benches.
    pub fn set_matvec(on: bool) {
        ENABLED.store(on, Ordering::Relaxed);
        ONE.store(on, Ordering::Relaxed);
    }

    /// Select the kernel form (0 default, 1..=3 old n = 1 variants, 4 the form before the
    /// staged kernels, 5 staged wherever possible; others read as 0). See `VARIANT`.
    pub fn set_matvec_variant(v: u8) {
        VARIANT.store(if v <= 5 { v } else { 0 }, Ordering::Relaxed);
    }

    /// The switches of this file as at open (on; n = 1 only by `mvq_*` and the staged form).
    pub fn set_matvec_defaults() {
        ENABLED.store(true, Ordering::Relaxed);
        ONE.store(false, Ordering::Relaxed);
        VARIANT.store(0, Ordering::Relaxed);
        Self::set_matvec_one(MVQ_AUTO);
        Self::set_matvec_repacked(MVQ_AUTO);
        Self::set_matvec_split(false);
        Self::set_matvec_q8_form(1, 255);
        Self::set_matvec_mvx_spread(6);
        Self::set_matvec_merge(true);
        Self::set_matvec_mvq_late(true);
    }

    /// n = 1 form for Q8_0/F16 (`MVQ`): 0 off, 1..=2 a fixed form, anything else auto.
    pub fn set_matvec_one(form: u8) {
        MVQ_ENV.call_once(|| {});
        MVQ.store(if form <= 2 { form } else { MVQ_AUTO }, Ordering::Relaxed);
    }

    /// Split the columns of few-row F16 products across CTAs (`SPLIT`; default off).
    pub fn set_matvec_split(on: bool) {
        SPLIT_ENV.call_once(|| {});
        SPLIT.store(on, Ordering::Relaxed);
    }

    /// n = 1 form for Q8_0 matrices with a decode-layout copy (`MVR`): 0 off (the `mvq` path),
    /// 1..=2 a fixed `mvr` form, anything else auto (`mvx`/`mvr`). Copies are still made at
    /// upload.
    pub fn set_matvec_repacked(form: u8) {
        mvr_env();
        MVR.store(if form <= 2 { form } else { MVQ_AUTO }, Ordering::Relaxed);
    }

    /// n = 1 form (`Q8_FORM`: 0 the `mvr`/`mvq` forms everywhere, else `mvx*` where it
    /// measured faster) and the CTAs per SM of the `mvx*` grids (0: no cap; 1..=8; 255 or
    /// more: the defaults per kind).
    pub fn set_matvec_q8_form(form: u8, ctas: u8) {
        Q8_FORM_ENV.call_once(|| {});
        Q8_FORM.store(form.min(1), Ordering::Relaxed);
        MVX_CTAS.store(if ctas <= 8 { ctas } else { 255 }, Ordering::Relaxed);
    }

    /// CTA batches per SM the `mvx*` plans aim at (1..; default 6; see `mvx_plan`).
    pub fn set_matvec_mvx_spread(m: u8) {
        MVX_SPREAD_ENV.call_once(|| {});
        MVX_SPREAD.store(m.max(1), Ordering::Relaxed);
    }

    /// Decode-layout copies made from now on in the interleaved layout (`Q8_IL`) or the plain one.
    pub fn set_matvec_q8_il(on: bool) {
        mvr_env();
        Q8_IL.store(on, Ordering::Relaxed);
    }

    /// The pipelined interleaved r2u2 product (`MVR_PIPE`) on or off.
    pub fn set_matvec_mvr_pipe(on: bool) {
        mvr_env();
        MVR_PIPE.store(on, Ordering::Relaxed);
    }

    /// The F16 `mvq` / `mvqm` kernels that load weights before the PDL wait (`MVQ_LATE`) on or off.
    pub fn set_matvec_mvq_late(on: bool) {
        MVQ_LATE_ENV.call_once(|| {});
        MVQ_LATE.store(on, Ordering::Relaxed);
    }

    /// The n = 2..4 decode-layout Q8_0 products (`mvrn*`) on or off (default on, or
    /// `DS4_GPU_MVRN=off`); process-wide, for tests and benchmarks.
    pub fn set_matvec_mvrn(on: bool) {
        MVRN.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Rows a warp of the interleaved `mvrn*` products (1 or 2; `DS4_GPU_MVRN_R`), process-wide.
    pub fn set_matvec_mvrn_rows(r: u8) {
        MVRN_R.store(r.clamp(1, 2), Ordering::Relaxed);
    }

    /// `mvrn*` launches so far in this process.
    pub fn mvrn_launches() -> u64 {
        MVRN_LAUNCHES.load(Ordering::Relaxed)
    }

    /// The n-token norm + product (`mvxn2` / `mvxn4`) on or off (default on, or
    /// `DS4_GPU_MVXN_TOK=off`); process-wide, for tests and benchmarks.
    pub fn set_matvec_mvxn_tok(on: bool) {
        MVXN_TOK.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// The n-token fused / merged verify-step forms (`MVN`: `mvrgun*`, `mvran*`, `mvxm2`,
    /// `mvq_route2/4_f16r`) on or off (default on, or `DS4_GPU_MVN=off`); process-wide.
    pub fn set_matvec_mvn(on: bool) {
        MVN.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// `mvxn2` / `mvxn4` launches so far in this process.
    pub fn mvxn_tok_launches() -> u64 {
        MVXN_TOK_LAUNCHES.load(Ordering::Relaxed)
    }

    /// Whether `w` has an interleaved F16 copy (`F16_IL`); for tests.
    pub fn has_f16_il(w: &GpuWeight) -> bool {
        matches!(w, GpuWeight::Mat { f16i: Some(_), .. })
    }

    /// Interleaved F16 copies (`F16_IL`) made from now on, or none.
    pub fn set_matvec_f16_il(on: bool) {
        F16_IL_ENV.call_once(|| {});
        F16_IL.store(on, Ordering::Relaxed);
    }

    /// Merged n = 1 products on or off (`MERGE`; default on).
    pub fn set_matvec_merge(on: bool) {
        MERGE_ENV.call_once(|| {});
        MERGE.store(on, Ordering::Relaxed);
    }

    /// Device bytes of the copies in other layouts that uploading a weight of type `ty` and
    /// GGUF dims `dims` makes beside its own bytes (the Q8_0 decode layout, the interleaved
    /// F16 copy; per the switches as they are now). Memory plans add them: in both published mixes
    /// 6.1 GiB, every Q8_0 matrix that is not an expert stack a second time.
    pub fn layout_copy_bytes(ty: GgmlType, dims: &[u64]) -> u64 {
        let d = |i: usize| dims.get(i).copied().unwrap_or(1) as usize;
        let (cols, rows, experts) = (d(0), d(1), d(2));
        (q8_copy_bytes(ty, cols, rows, experts) + f16_il_bytes(ty, cols, rows, experts)) as u64
    }

    /// The decode-layout copy of a Q8_0 matrix with one slab (None: another type, expert slabs,
    /// `DS4_GPU_Q8_REPACK=off`, or no memory for it, which is not an error): the buffer holds
    /// Q (rows × cols i8, row g at byte g·cols) then D (rows × cols/32 f16 scales), written by
    /// `q8_repack` on the stream from the GGUF blocks in `buf`; with whether it is in the
    /// interleaved layout (`q8_repack_i`, `Q8_IL`). Counted as a copy (or not) by `q8_layouts`.
    pub(crate) fn q8_decode_copy(
        &self,
        buf: &DeviceBuffer,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        experts: usize,
    ) -> (Option<DeviceBuffer>, bool) {
        mvr_env();
        let il = q8_il(cols);
        let bytes = q8_copy_bytes(ty, cols, rows, experts);
        if bytes == 0 || !(self.layout_copies() || self.q8_decode_only()) || self.failed() {
            return (None, il);
        }
        let nb = rows * cols / 32;
        if buf.bytes() < nb * 34 {
            return (None, il);
        }
        self.interrupt();
        // Q: 32·nb bytes, then D: 2·nb
        let Ok(dec) = self.gpu.alloc(bytes) else {
            return (None, il);
        };
        let q = dec.ptr();
        self.run(
            &ds4_kernels::MATVEC,
            if il { "q8_repack_i" } else { "q8_repack" },
            LaunchDims::linear(nb.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(buf.ptr()),
                Arg::I64(nb as i64),
                Arg::Ptr(q),
                Arg::Ptr(q.offset((nb * 32) as u64)),
            ],
        );
        (Some(dec), il)
    }

    /// A matrix's layouts from its GGUF blocks in `buf`: (the weight's `buf`, `dec`, `dec_il`).
    /// `q8_decode_copy`'s copy beside the blocks, or with [`GpuBackend::q8_decode_only`] in
    /// place of them: the blocks are freed once the repack has read them (`buf` becomes a null
    /// buffer, [`GpuWeight::blocks`] false) and the decode layout counts as the weight's own
    /// bytes (the same 34 bytes a block), not as a copy.
    pub(crate) fn q8_layouts(
        &self,
        buf: DeviceBuffer,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        experts: usize,
    ) -> (DeviceBuffer, Option<DeviceBuffer>, bool) {
        let (dec, il) = self.q8_decode_copy(&buf, ty, cols, rows, experts);
        let Some(d) = dec.as_ref() else {
            return (buf, None, il);
        };
        // The repack reads the blocks on the stream: they are freed after it has run.
        if !self.q8_decode_only() || self.note(self.gpu.synchronize()).is_none() {
            self.count_layout_copy(d.bytes());
            return (buf, dec, il);
        }
        drop(buf);
        (DeviceBuffer::null(&self.gpu), dec, il)
    }

    /// The interleaved F16 copy of `buf` (see `F16_IL`), or None (another type or shape, the
    /// switch off, no memory: not an error).
    pub(crate) fn f16_il_copy(
        &self,
        buf: &DeviceBuffer,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        experts: usize,
    ) -> Option<DeviceBuffer> {
        let bytes = f16_il_bytes(ty, cols, rows, experts);
        if bytes == 0
            || !self.layout_copies()
            || buf.bytes() < rows * cols * 2
            || !buf.ptr().0.is_multiple_of(16)
            || self.failed()
        {
            return None;
        }
        self.interrupt();
        let slots = rows * cols / 8;
        let dst = self.gpu.alloc(bytes).ok()?;
        self.count_layout_copy(bytes);
        self.run(
            &ds4_kernels::MATVEC,
            "f16_repack_i",
            LaunchDims::linear(slots.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(buf.ptr()),
                Arg::I64(slots as i64),
                Arg::Ptr(dst.ptr()),
            ],
        );
        Some(dst)
    }

    /// One n = 1 product by `mvr_*` from a decode-layout copy `dec` (rows per group `rows`, `zs`
    /// groups of consecutive rows, x of group z at element z·x_z, y at z·y_z), or false when off.
    /// `add`: y += W·x by `mvra_r2u2_q8_0`, false (nothing run) where another form would be taken.
    /// `il`: `dec` is in the interleaved layout (the `*_q8_0i` kernels).
    #[allow(clippy::too_many_arguments)]
    fn mvr(
        &self,
        dec: &DeviceBuffer,
        il: bool,
        x: &GpuBuf,
        x_z: usize,
        y: DevPtr,
        y_z: usize,
        rows: usize,
        cols: usize,
        zs: usize,
        add: bool,
    ) -> bool {
        mvr_env();
        let form = match MVR.load(Ordering::Relaxed) {
            MVQ_AUTO => mvr_auto(rows * zs, cols),
            f => f,
        };
        let nb = rows * zs * cols / 32;
        if form == 0
            || !ENABLED.load(Ordering::Relaxed)
            || !x.ptr.0.is_multiple_of(16)
            || !cols.is_multiple_of(32)
            || dec.bytes() < nb * 34
            || self.failed()
        {
            return false;
        }
        let (xf, ctas) = q8_form(0);
        let mvx = xf > 0 && cols <= MVX_Q8_MAXC && MVR.load(Ordering::Relaxed) == MVQ_AUTO && !il;
        if add && (mvx || form != 2) {
            return false;
        }
        if mvx {
            let q = dec.ptr();
            self.mvx(
                "mvx_r4u2_q8_0",
                q,
                q.offset((nb * 32) as u64),
                x,
                x_z,
                y,
                y_z,
                rows,
                cols,
                zs,
                4,
                16,
                ctas,
                &[],
            );
            return true;
        }
        let (name, r) = MVR_FORMS[form as usize - 1];
        // A warp step is DS4_WARP half blocks (16 columns each): mv_kspl counts steps of
        // warp/4 chunks of 32 columns, so it is asked about cols / 2.
        let (dims, k) = self.mv_dims(rows, r, 1, zs, cols / 2);
        let q = dec.ptr();
        self.run(
            &ds4_kernels::MATVEC,
            &format!(
                "mvr{}_{name}_q8_0{}",
                if add { "a" } else { "" },
                match (il, !add && form == 2 && MVR_PIPE.load(Ordering::Relaxed)) {
                    (true, true) => "ip",
                    (true, false) => "i",
                    _ => "",
                }
            ),
            dims,
            &q8_args(q, q.offset((nb * 32) as u64), x, x_z, y, y_z, rows, cols, k),
        );
        true
    }

    /// n = 2..4 token rows of a decode-layout Q8_0 product (`mvrn<NT>_r2u2_q8_0[i]`, NT = 2 or
    /// 4): every row's weights read once for all tokens, each token row the bits `mvr_r2u2`
    /// gives it alone (same per-lane order). `x_tok` / `y_tok`: floats between token rows.
    /// `DS4_GPU_MVRN=off` (or [`GpuBackend::set_matvec_mvrn`]) leaves them to the staged and
    /// `mv<NT>` kernels, the form before.
    #[allow(clippy::too_many_arguments)]
    fn mvrn(
        &self,
        dec: &DeviceBuffer,
        il: bool,
        x: &GpuBuf,
        (x_tok, x_z): (usize, usize),
        y: DevPtr,
        (y_tok, y_z): (usize, usize),
        rows: usize,
        cols: usize,
        zs: usize,
        n: usize,
        add: bool,
    ) -> bool {
        mvr_env();
        let nb = rows * zs * cols / 32;
        if !(2..=4).contains(&n)
            || !mvrn_on()
            || (add && (!il || !mvn_on()))
            || MVR.load(Ordering::Relaxed) == 0
            || !ENABLED.load(Ordering::Relaxed)
            || !x.ptr.0.is_multiple_of(16)
            || !x_tok.is_multiple_of(4)
            || !x_z.is_multiple_of(4)
            || !cols.is_multiple_of(32)
            || dec.bytes() < nb * 34
            || self.failed()
        {
            return false;
        }
        let nt = if n == 2 { 2 } else { 4 };
        // kspl as r2u2 plans it (a row's sums depend on it); the grid for r rows a warp.
        let r = if il && !add { mvrn_rows() } else { 2 };
        let (mut dims, k) = self.mv_dims(rows, 2, 1, zs, cols / 2);
        dims.grid[0] = rows.div_ceil(MV_WARPS / k * r) as u32;
        let q = dec.ptr();
        let mut args =
            q8_args(q, q.offset((nb * 32) as u64), x, x_z, y, y_z, rows, cols, k).to_vec();
        args.extend([
            Arg::I64(x_tok as i64),
            Arg::I64(y_tok as i64),
            Arg::I32(n as i32),
        ]);
        self.run(
            &ds4_kernels::MATVEC,
            &format!(
                "mvr{}n{nt}_r{r}u2_q8_0{}",
                if add { "a" } else { "" },
                if il { "i" } else { "" }
            ),
            dims,
            &args,
        );
        MVRN_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// One `mvx_<form>_<t>` launch (see Q8_FORM): `rows` rows per group × `zs` groups (W rows
    /// of group z from z·rows, x at z·x_z, y at z·y_z), R = `r` rows a warp, `c` columns per
    /// 16-byte slot (Q8_0 16, F16 8); d: the Q8_0 scales (F16: null).
    #[allow(clippy::too_many_arguments)]
    fn mvx(
        &self,
        name: &str,
        w: DevPtr,
        d: DevPtr,
        x: &GpuBuf,
        x_z: usize,
        y: DevPtr,
        y_z: usize,
        rows: usize,
        cols: usize,
        zs: usize,
        r: usize,
        c: usize,
        ctas: usize,
        extra: &[Arg],
    ) {
        let sm = self.gpu.info().sm_count as usize;
        let (ks, _, gx) = mvx_plan(
            |per| rows.div_ceil(per),
            r,
            cols / c,
            zs,
            sm,
            self.warp() as usize,
            ctas,
        );
        self.run(
            &ds4_kernels::MATVEC,
            name,
            LaunchDims {
                grid: [gx as u32, 1, zs as u32],
                block: [MV_WARPS as u32 * self.warp(), 1, 1],
                shared_bytes: 0,
            },
            &q8_args(w, d, x, x_z, y, y_z, rows, cols, ks)
                .into_iter()
                .chain(extra.iter().copied())
                .collect::<Vec<_>>(),
        );
    }

    /// The `mvq` form (index into MVQ_FORMS, from 1) and column ranges for an n = 1 product of
    /// `ty`, or None where `mvq` declines it (off, another type, alignment).
    #[allow(clippy::too_many_arguments)]
    fn mvq_pick(
        &self,
        ty: GgmlType,
        w: DevPtr,
        w_z: usize,
        x: &GpuBuf,
        rows: usize,
        cols: usize,
        rb: usize,
        zs: usize,
    ) -> Option<(u8, usize)> {
        MVQ_ENV.call_once(|| {
            if let Ok(v) = std::env::var("DS4_GPU_MVQ") {
                let f = match v.as_str() {
                    "off" => 0,
                    _ => MVQ_FORMS
                        .iter()
                        .position(|f| f.0 == v)
                        .map_or(MVQ_AUTO, |i| i as u8 + 1),
                };
                MVQ.store(f, Ordering::Relaxed);
            }
        });
        SPLIT_ENV.call_once(|| {
            if let Ok(v) = std::env::var("DS4_GPU_MVQ_SPLIT") {
                SPLIT.store(v == "on", Ordering::Relaxed);
            }
        });
        let sm = self.gpu.info().sm_count as usize;
        let splits = if SPLIT.load(Ordering::Relaxed) {
            mvq_splits(ty, rows, cols, zs, sm)
        } else {
            1
        };
        let form = match (MVQ.load(Ordering::Relaxed), splits) {
            (MVQ_AUTO, 1) => mvq_auto(ty, rows * zs, cols, sm),
            (MVQ_AUTO, _) => 2, // r1u4: one round of loads per warp on 1024-column ranges
            (f, _) => f,
        };
        // F16 slices are 16-byte loads; Q8_0 needs 2-byte aligned rows (word loads of the slices).
        let align: usize = if ty == GgmlType::F16 { 16 } else { 2 };
        if form == 0
            || !ENABLED.load(Ordering::Relaxed)
            || !x.ptr.0.is_multiple_of(16)
            || !w.0.is_multiple_of(align as u64)
            || !rb.is_multiple_of(align)
            || !w_z.is_multiple_of(align)
            || self.failed()
        {
            return None;
        }
        Some((form, splits))
    }

    /// Launch dims and kspl of `mvq_r2u4_f16` when `mv_matmul` runs `y = w·x` at n = 1
    /// (`Part::All`) as that one launch, else None. The fused router (mix.rs `op_matmul_route`)
    /// runs the same CTAs, so its logits are the same bits.
    pub(crate) fn mvq_r2u4_f16_plan(
        &self,
        w: &GpuWeight,
        x: &GpuBuf,
    ) -> Option<(LaunchDims, usize)> {
        let (p, _, cols, rows, rb) = mat(w)?;
        let GpuWeight::Mat {
            ty: GgmlType::F16,
            dec: None,
            ..
        } = w
        else {
            return None;
        };
        let pick = self.mvq_pick(GgmlType::F16, p, 0, x, rows, cols, rb, 1)?;
        (pick == (1, 1)).then(|| self.mv_dims(rows, MVQ_FORMS[0].1, 1, 1, cols))
    }

    /// One n = 1 F16 product from its interleaved copy `c` (`mvq_r2u4_f16i`, `_f16il` with
    /// `MVQ_LATE`) where `mvq` would take r2u4 without column splits, else false (nothing run).
    fn mvq_il(
        &self,
        c: &DeviceBuffer,
        x: &GpuBuf,
        y: DevPtr,
        rows: usize,
        cols: usize,
        rb: usize,
    ) -> bool {
        let w = c.ptr();
        if self.mvq_pick(GgmlType::F16, w, 0, x, rows, cols, rb, 1) != Some((1, 1)) {
            return false;
        }
        let (dims, k) = self.mv_dims(rows, MVQ_FORMS[0].1, 1, 1, cols);
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvq_r2u4_f16i{}", mvq_late(GgmlType::F16)),
            dims,
            &[
                Arg::Ptr(w),
                Arg::I64(0),
                Arg::Ptr(x.ptr),
                Arg::I64(0),
                Arg::Ptr(y),
                Arg::I64(0),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I64(rb as i64),
                Arg::I32(k as i32),
            ],
        );
        true
    }

    /// One n = 1 product by `mvq_*` (Q8_0, F16), or false when off, declined or another type.
    /// Strides as in `mv_launch` (bytes for w_z, elements for x_z and y_z).
    #[allow(clippy::too_many_arguments)]
    fn mvq(
        &self,
        ty: GgmlType,
        w: DevPtr,
        w_z: usize,
        x: &GpuBuf,
        x_z: usize,
        y: DevPtr,
        y_z: usize,
        rows: usize,
        cols: usize,
        rb: usize,
        zs: usize,
    ) -> bool {
        let sfx = match ty {
            GgmlType::Q8_0 => "q8_0",
            GgmlType::F16 => "f16",
            _ => return false,
        };
        let Some((form, splits)) = self.mvq_pick(ty, w, w_z, x, rows, cols, rb, zs) else {
            return false;
        };
        let (name, r) = MVQ_FORMS[form as usize - 1];
        if splits > 1 {
            // Range j: columns j·cs.. of every row (w_z = cs·2 bytes, x_z = cs), partial j at
            // part[j·rows..]; then y[r] = sum over j in order.
            let cs = cols / splits;
            let part = self.scratch(splits * rows);
            let (dims, k) = self.mv_dims(rows, r, 1, splits, cs);
            self.run(
                &ds4_kernels::MATVEC,
                &format!("mvq_{name}_{sfx}{}", mvq_late(ty)),
                dims,
                &[
                    Arg::Ptr(w),
                    Arg::I64((cs * 2) as i64),
                    Arg::Ptr(x.ptr),
                    Arg::I64(cs as i64),
                    Arg::Ptr(part.ptr),
                    Arg::I64(rows as i64),
                    Arg::I32(rows as i32),
                    Arg::I32(cs as i32),
                    Arg::I64(rb as i64),
                    Arg::I32(k as i32),
                ],
            );
            self.run(
                &ds4_kernels::MATVEC,
                "mvs_sum_f32",
                LaunchDims::linear(rows.div_ceil(256) as u32, 256),
                &[
                    Arg::Ptr(part.ptr),
                    Arg::I32(splits as i32),
                    Arg::I64(rows as i64),
                    Arg::I32(1),
                    Arg::I32(rows as i32),
                    Arg::Ptr(y),
                    Arg::I64(rows as i64),
                    Arg::I64(0),
                ],
            );
            return true;
        }
        let (dims, k) = self.mv_dims(rows, r, 1, zs, cols);
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvq_{name}_{sfx}{}", mvq_late(ty)),
            dims,
            &[
                Arg::Ptr(w),
                Arg::I64(w_z as i64),
                Arg::Ptr(x.ptr),
                Arg::I64(x_z as i64),
                Arg::Ptr(y),
                Arg::I64(y_z as i64),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I64(rb as i64),
                Arg::I32(k as i32),
            ],
        );
        true
    }

    /// Warps per row group (1, 2, 4, 8): the fewest that give about 16 working warps per SM,
    /// each keeping at least one column step (MV_CPW chunks).
    fn mv_kspl(&self, row_groups: usize, cols: usize) -> usize {
        let info = self.gpu.info();
        let want = 16 * info.sm_count as usize;
        let steps = (cols / 32).div_ceil(info.warp as usize / 4);
        let mut k = 1;
        while k < MV_WARPS && 2 * k <= steps && row_groups * k < want {
            k *= 2;
        }
        k
    }

    /// Launch dims for `rows` rows (per y item, `r` per warp) × `items` × `zs`, and kspl.
    fn mv_dims(
        &self,
        rows: usize,
        r: usize,
        items: usize,
        zs: usize,
        cols: usize,
    ) -> (LaunchDims, usize) {
        let groups = rows.div_ceil(r);
        let k = self.mv_kspl(groups * items * zs, cols);
        let per_cta = MV_WARPS / k * r;
        (
            LaunchDims {
                grid: [rows.div_ceil(per_cta) as u32, items as u32, zs as u32],
                block: [MV_WARPS as u32 * self.warp(), 1, 1],
                shared_bytes: 0,
            },
            k,
        )
    }

    fn mv_ok(&self, n: usize, x: &GpuBuf) -> bool {
        ENABLED.load(Ordering::Relaxed)
            && (1..=4).contains(&n)
            && (n > 1 || (ONE.load(Ordering::Relaxed) && VARIANT.load(Ordering::Relaxed) < 4))
            && x.ptr.0.is_multiple_of(16)
            && !self.failed()
    }

    /// One staged product (`mvs<NT>_<sfx>`, plus `mvs_sum_f32` when rows are split), or false
    /// when off or the shape is declined. Strides as in `mv_launch`.
    #[allow(clippy::too_many_arguments)]
    fn mvs(
        &self,
        ty: GgmlType,
        w: DevPtr,
        w_z: usize,
        x: &GpuBuf,
        x_tok: usize,
        x_z: usize,
        y: DevPtr,
        y_tok: usize,
        y_z: usize,
        rows: usize,
        cols: usize,
        rb: usize,
        n: usize,
        zs: usize,
    ) -> bool {
        let v = VARIANT.load(Ordering::Relaxed);
        let sm = self.gpu.info().sm_count as usize;
        if !ENABLED.load(Ordering::Relaxed)
            || !(v == 5 || (v == 0 && staged_wins(ty, n, rows * zs, cols, sm)))
            || !(1..=4).contains(&n)
            || !x.ptr.0.is_multiple_of(16)
            || !w.0.is_multiple_of(16)
            || !w_z.is_multiple_of(16)
            || self.failed()
        {
            return false;
        }
        let Some(sfx) = suffix(ty) else {
            return false;
        };
        let nt = match n {
            1 => 1,
            2 => 2,
            _ => 4,
        };
        let Some(p) = mvs_plan(ty, rows, cols, rb, zs, nt, sm, self.warp() as usize) else {
            return false;
        };
        let part = (p.ks > 1).then(|| self.scratch(p.ks * n * zs * rows));
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvs{nt}_{sfx}"),
            LaunchDims {
                grid: [rows.div_ceil(p.rc) as u32, p.ks as u32, zs as u32],
                block: [MV_WARPS as u32 * self.warp(), 1, 1],
                shared_bytes: 0,
            },
            &[
                Arg::Ptr(w),
                Arg::I64(w_z as i64),
                Arg::Ptr(x.ptr),
                Arg::I64(x_tok as i64),
                Arg::I64(x_z as i64),
                Arg::Ptr(y),
                Arg::I64(y_tok as i64),
                Arg::I64(y_z as i64),
                part.as_ref().map_or(Arg::Null, |b| Arg::Ptr(b.ptr)),
                Arg::I32(rows as i32),
                Arg::I32((cols / 32) as i32),
                Arg::I64(rb as i64),
                Arg::I32(p.tile_bytes as i32),
                Arg::I32(p.tile_chunks as i32),
                Arg::I32(n as i32),
                Arg::I32(p.rc as i32),
                Arg::I32(p.ksi as i32),
            ],
        );
        if let Some(part) = part {
            let total = n * zs * rows;
            self.run(
                &ds4_kernels::MATVEC,
                "mvs_sum_f32",
                LaunchDims::linear(total.div_ceil(256) as u32, 256),
                &[
                    Arg::Ptr(part.ptr),
                    Arg::I32(p.ks as i32),
                    Arg::I64(total as i64),
                    Arg::I32(zs as i32),
                    Arg::I32(rows as i32),
                    Arg::Ptr(y),
                    Arg::I64(y_tok as i64),
                    Arg::I64(y_z as i64),
                ],
            );
        }
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn mv_launch(
        &self,
        sfx: &str,
        w: DevPtr,
        w_z: usize,
        x: DevPtr,
        x_tok: usize,
        x_z: usize,
        y: DevPtr,
        y_tok: usize,
        y_z: usize,
        rows: usize,
        cols: usize,
        row_bytes: usize,
        n: usize,
        zs: usize,
    ) {
        let nt = match n {
            1 => 1,
            2 => 2,
            _ => 4,
        };
        let v = VARIANT.load(Ordering::Relaxed) as usize;
        let v = if n == 1 && v <= 3 && matches!(sfx, "q8_0" | "q2_k" | "q4_k" | "iq2_xxs") {
            v
        } else {
            0
        };
        let (dims, k) = self.mv_dims(rows, VARIANT_ROWS[v], 1, zs, cols);
        let name = if v == 0 {
            format!("mv{nt}_{sfx}")
        } else {
            format!("mv1v{v}_{sfx}")
        };
        self.run(
            &ds4_kernels::MATVEC,
            &name,
            dims,
            &[
                Arg::Ptr(w),
                Arg::I64(w_z as i64),
                Arg::Ptr(x),
                Arg::I64(x_tok as i64),
                Arg::I64(x_z as i64),
                Arg::Ptr(y),
                Arg::I64(y_tok as i64),
                Arg::I64(y_z as i64),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I64(row_bytes as i64),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
            ],
        );
    }

    /// `y[i] = W·x[i]` (`Part` as in Backend::matmul).
    pub(crate) fn mv_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        let Some((p, sfx, cols, rows, rb)) = mat(w) else {
            return false;
        };
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * rows * rb,
        };
        let GpuWeight::Mat {
            ty,
            dec,
            dec_il,
            f16i,
            ..
        } = w
        else {
            return false;
        };
        if let (1, Some(dec), 0) = (n, dec, byte0) {
            if self.mvr(dec, *dec_il, x, 0, y.ptr, 0, rows, cols, 1, false) {
                return true;
            }
        }
        if let (Some(dec), 0) = (dec, byte0) {
            if self.mvrn(
                dec,
                *dec_il,
                x,
                (cols, 0),
                y.ptr,
                (rows, 0),
                rows,
                cols,
                1,
                n,
                false,
            ) {
                return true;
            }
        }
        if let (1, Some(c), 0) = (n, f16i, byte0) {
            if self.mvq_il(c, x, y.ptr, rows, cols, rb) {
                return true;
            }
        }
        if !w.blocks() {
            return false; // the kernels below read GGUF blocks
        }
        let w0 = p.offset(byte0 as u64);
        if n == 1 && self.mvq(*ty, w0, 0, x, 0, y.ptr, 0, rows, cols, rb, 1) {
            return true;
        }
        if self.mvs(*ty, w0, 0, x, cols, 0, y.ptr, rows, 0, rows, cols, rb, n, 1) {
            return true;
        }
        if !self.mv_ok(n, x) {
            return false;
        }
        self.mv_launch(
            sfx,
            p.offset(byte0 as u64),
            0,
            x.ptr,
            cols,
            0,
            y.ptr,
            rows,
            0,
            rows,
            cols,
            rb,
            n,
            1,
        );
        true
    }

    /// Backend::rms_norm_matmul at n = 1 in one launch (`mvxn_r4u2_q8_0`: every CTA stages
    /// x * norm weight, takes the row's sum of squares at the staging barrier and scales each row
    /// total by the norm's s; CTA 0 also writes the normed row to a new buffer that then replaces
    /// `x`), or false (nothing run: the product would not take `mvx_r4u2_q8_0`). H200, 2k decode
    /// (bench/results/gpu-fuse-f8-h200.txt): with `mv_matmul_add` 127.0 against 126.0 tok/s
    /// unfused; the deferred scale 127.2/126.5 against 125.7/125.9 for x normed before staging
    /// (17.6 us a call, the rmsnorm + product pair's time; deleted).
    /// n = 2..4 (verify steps): `mvxn2` / `mvxn4`, the n token rows staged side by side and each
    /// weight slot loaded once for all (q_b's 35 MB read once, not n times); each token's product
    /// and normed row the bits `mvxn` gives it alone (`DS4_GPU_MVXN_TOK=off`: false, so
    /// the caller runs `mvxn` once per token).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mv_norm_matmul(
        &self,
        x: &mut GpuBuf,
        n: usize,
        cols: usize,
        norm: Option<&GpuWeight>,
        eps: f32,
        w: &GpuWeight,
        y: &mut GpuBuf,
    ) -> bool {
        mvr_env();
        let (
            Some(GpuWeight::F32 { buf: nb, len }),
            GpuWeight::Mat {
                ty: GgmlType::Q8_0,
                dec: Some(dec),
                dec_il: false,
                rows,
                cols: wc,
                ..
            },
        ) = (norm, w)
        else {
            return false;
        };
        let name = match n {
            1 => "mvxn_r4u2_q8_0",
            // Each token's copy of x at t cols / 4 float4s keeps the one-token slot swizzle
            // (128-column multiples); all copies within the kernel's MVX_MAXC floats.
            2..=4
                if mvxn_tok_on()
                    && cols.is_multiple_of(128)
                    && n.next_power_of_two() * cols <= MVX_MAXC =>
            {
                if n == 2 {
                    "mvxn2_r4u2_q8_0"
                } else {
                    "mvxn4_r4u2_q8_0"
                }
            }
            _ => return false,
        };
        let (xf, ctas) = q8_form(0);
        let nq = rows * cols / 32;
        if !ENABLED.load(Ordering::Relaxed)
            || MVR.load(Ordering::Relaxed) != MVQ_AUTO
            || xf == 0
            || *wc != cols
            || *len < cols
            || cols > MVX_Q8_MAXC
            || !cols.is_multiple_of(32)
            || !x.ptr.0.is_multiple_of(16)
            || !nb.ptr().0.is_multiple_of(16)
            || dec.bytes() < nq * 34
            || self.failed()
        {
            return false;
        }
        let xn = self.scratch(n * cols);
        let q = dec.ptr();
        let mut extra = vec![Arg::Ptr(nb.ptr()), Arg::F32(eps), Arg::Ptr(xn.ptr)];
        if n > 1 {
            extra.push(Arg::I32(n as i32));
            MVXN_TOK_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        self.mvx(
            name,
            q,
            q.offset((nq * 32) as u64),
            x,
            0,
            y.ptr,
            0,
            *rows,
            cols,
            1,
            4,
            16,
            ctas,
            &extra,
        );
        *x = xn; // the raw rows go back to the pool (stream-ordered, as every scratch buffer)
        true
    }

    /// Backend::matmul_add at n = 1 (`mvra_r2u2_q8_0`: y += W·x in the product's epilogue), or
    /// false (nothing run: the product would take another form). ncu: 7.6 us a call, the product
    /// alone's time (add_f32's 2.1 us a layer gone).
    /// n = 2..4 (verify steps): `mvran2` / `mvran4` on interleaved copies (each row read once
    /// for every token, each token's bits as `mvra` alone; `DS4_GPU_MVN=off` or
    /// `DS4_GPU_MVRN=off`: false, so the caller runs `mvra` once per token).
    pub(crate) fn mv_matmul_add(
        &self,
        w: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        let GpuWeight::Mat {
            dec: Some(dec),
            dec_il,
            rows,
            cols,
            ..
        } = w
        else {
            return false;
        };
        if n == 1 {
            return self.mvr(dec, *dec_il, x, 0, y.ptr, 0, *rows, *cols, 1, true);
        }
        self.mvrn(
            dec,
            *dec_il,
            x,
            (*cols, 0),
            y.ptr,
            (*rows, 0),
            *rows,
            *cols,
            1,
            n,
            true,
        )
    }

    /// Backend::matmul_grouped.
    pub(crate) fn mv_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        if groups == 0 {
            return false;
        }
        let Some((p, sfx, cols, rows, rb)) = mat(w) else {
            return false;
        };
        if !rows.is_multiple_of(groups) {
            return false;
        }
        // Group g: rows g*r .. (g+1)*r of W times columns g*cols .. of each x row.
        let r = rows / groups;
        let GpuWeight::Mat {
            ty, dec, dec_il, ..
        } = w
        else {
            return false;
        };
        let (x_tok, x_z) = (groups * cols, cols);
        if let (1, Some(dec)) = (n, dec) {
            if self.mvr(dec, *dec_il, x, x_z, y.ptr, r, r, cols, groups, false) {
                return true;
            }
        }
        if let Some(dec) = dec {
            let (xs, ys) = ((x_tok, x_z), (rows, r));
            if self.mvrn(dec, *dec_il, x, xs, y.ptr, ys, r, cols, groups, n, false) {
                return true;
            }
        }
        if !w.blocks() {
            return false; // the kernels below read GGUF blocks
        }
        if n == 1 && self.mvq(*ty, p, r * rb, x, x_z, y.ptr, r, r, cols, rb, groups) {
            return true;
        }
        if self.mvs(
            *ty,
            p,
            r * rb,
            x,
            x_tok,
            x_z,
            y.ptr,
            rows,
            r,
            r,
            cols,
            rb,
            n,
            groups,
        ) {
            return true;
        }
        if !self.mv_ok(n, x) {
            return false;
        }
        self.mv_launch(
            sfx,
            p,
            r * rb,
            x.ptr,
            groups * cols,
            cols,
            y.ptr,
            rows,
            r,
            r,
            cols,
            rb,
            n,
            groups,
        );
        true
    }

    /// Backend::matmul_multi at n = 1 in one launch, or false (the caller runs the products one
    /// by one): 2..=5 matrices of equal cols, up to 4 Q8_0 with decode copies (`mvrm_r2u2_q8_0`,
    /// unless the `mvr` path is off), else all of one type F16 / Q8_0 (`mvqm_r2u4_<t>`, unless
    /// `mvq` is off).
    pub(crate) fn mv_multi(
        &self,
        ws: &[&GpuWeight],
        x: &GpuBuf,
        n: usize,
        ys: &mut [&mut GpuBuf],
    ) -> bool {
        // n = 2 (verify steps): the F16 sets' `mvxm2` only (each token's bits as n = 1).
        if !(n == 1 || (n == 2 && mvn_on()))
            || ws.len() < 2
            || ws.len() > MVQM_MAX
            || ws.len() != ys.len()
            || !merge_on()
            || !ENABLED.load(Ordering::Relaxed)
            || !x.ptr.0.is_multiple_of(16)
            || self.failed()
        {
            return false;
        }
        mvr_env();
        let mut parts = Vec::with_capacity(ws.len());
        for w in ws {
            let GpuWeight::Mat {
                buf,
                ty,
                cols,
                rows,
                experts: 1,
                row_bytes,
                dec,
                dec_il,
                ..
            } = w
            else {
                return false;
            };
            parts.push((
                buf.ptr(),
                *ty,
                *cols,
                *rows,
                *row_bytes,
                dec.as_ref(),
                *dec_il,
            ));
        }
        let (ty, cols, rb) = (parts[0].1, parts[0].2, parts[0].4);
        if cols == 0
            || !cols.is_multiple_of(32)
            || parts
                .iter()
                .any(|p| p.1 != ty || p.2 != cols || p.4 != rb || p.3 == 0)
        {
            return false;
        }
        let rows: Vec<usize> = parts.iter().map(|p| p.3).collect();
        let block = [MV_WARPS as u32 * self.warp(), 1, 1];
        let decoded = ty == GgmlType::Q8_0
            && ws.len() <= MVRM_MAX
            && MVR.load(Ordering::Relaxed) != 0
            && parts
                .iter()
                .all(|p| p.5.is_some_and(|d| d.bytes() >= p.3 * cols / 32 * 34))
            && parts.iter().all(|p| p.6 == parts[0].6);
        let (xf, ctas) = q8_form(3);
        let f16 = ty == GgmlType::F16
            && MVQ.load(Ordering::Relaxed) != 0
            && rows.iter().sum::<usize>() >= MVXM_MIN_ROWS
            && rb == cols * 2
            && parts.iter().all(|p| p.0 .0.is_multiple_of(16));
        if n > 1 && !(xf > 0 && f16 && cols.is_multiple_of(128) && n * cols <= MVX_MAXC) {
            return false;
        }
        if xf > 0 && cols <= MVX_MAXC && f16 {
            // mvxm_r4u2_f16: R = 4, batches of (MV_WARPS / ks)·4 rows per matrix.
            let sm = self.gpu.info().sm_count as usize;
            let rows_of = |per: usize| rows.iter().map(|r| r.div_ceil(per)).sum::<usize>();
            let (ks, ncb, gx) = mvx_plan(rows_of, 4, cols / 8, 1, sm, self.warp() as usize, ctas);
            let (offs, _) = mvm_offsets(&rows, MV_WARPS / ks * 4, MVQM_MAX);
            let mut args = Vec::with_capacity(24);
            for m in 0..MVQM_MAX {
                let (w, y, r) = match (parts.get(m), ys.get(m)) {
                    (Some(p), Some(y)) => (p.0, y.ptr, p.3),
                    _ => (DevPtr(0), DevPtr(0), 0),
                };
                args.extend([Arg::Ptr(w), Arg::Ptr(y), Arg::I32(r as i32)]);
            }
            args.extend([Arg::Ptr(x.ptr), Arg::I32(cols as i32), Arg::I32(ks as i32)]);
            args.extend(offs.iter().map(|&o| Arg::I32(o)));
            args.push(Arg::I32(ncb as i32));
            let dims = LaunchDims {
                grid: [gx as u32, 1, 1],
                block,
                shared_bytes: 0,
            };
            let name = if n == 1 {
                "mvxm_r4u2_f16"
            } else {
                args.push(Arg::I32(n as i32));
                MVRN_LAUNCHES.fetch_add(1, Ordering::Relaxed);
                "mvxm2_r4u2_f16"
            };
            self.run(&ds4_kernels::MATVEC, name, dims, &args);
            return true;
        }
        if decoded {
            // mvr r2u2 per matrix: R = 2, kspl from all row groups, steps of cols / 2 (see mvr).
            let groups: usize = rows.iter().map(|r| r.div_ceil(2)).sum();
            let k = self.mv_kspl(groups, cols / 2);
            let (c, total) = mvm_offsets(&rows, MV_WARPS / k * 2, MVRM_MAX);
            let mut args = Vec::with_capacity(4 * MVRM_MAX + 6);
            for m in 0..MVRM_MAX {
                match (parts.get(m), ys.get(m)) {
                    (Some(p), Some(y)) => {
                        let q = p.5.unwrap().ptr();
                        let nb = p.3 * cols / 32;
                        args.extend([
                            Arg::Ptr(q),
                            Arg::Ptr(q.offset((nb * 32) as u64)),
                            Arg::Ptr(y.ptr),
                            Arg::I32(p.3 as i32),
                        ]);
                    }
                    _ => args.extend([
                        Arg::Ptr(DevPtr(0)),
                        Arg::Ptr(DevPtr(0)),
                        Arg::Ptr(DevPtr(0)),
                        Arg::I32(0),
                    ]),
                }
            }
            args.extend([Arg::Ptr(x.ptr), Arg::I32(cols as i32), Arg::I32(k as i32)]);
            args.extend(c.iter().map(|&o| Arg::I32(o)));
            let dims = LaunchDims {
                grid: [total as u32, 1, 1],
                block,
                shared_bytes: 0,
            };
            let name = if parts[0].6 {
                "mvrm_r2u2_q8_0i"
            } else {
                "mvrm_r2u2_q8_0"
            };
            self.run(&ds4_kernels::MATVEC, name, dims, &args);
            return true;
        }
        if ws.iter().any(|w| !w.blocks()) {
            return false; // the kernels below read GGUF blocks
        }
        let sfx = match ty {
            GgmlType::F16 => "f16",
            GgmlType::Q8_0 => "q8_0",
            _ => return false,
        };
        // As mvq: F16 slices are 16-byte loads, Q8_0 slices word loads of 2-byte aligned rows.
        let align: usize = if ty == GgmlType::F16 { 16 } else { 2 };
        if MVQ.load(Ordering::Relaxed) == 0
            || !rb.is_multiple_of(align)
            || parts.iter().any(|p| !p.0 .0.is_multiple_of(align as u64))
        {
            return false;
        }
        let groups: usize = rows.iter().map(|r| r.div_ceil(2)).sum();
        let k = self.mv_kspl(groups, cols);
        let (c, total) = mvm_offsets(&rows, MV_WARPS / k * 2, MVQM_MAX);
        let mut args = Vec::with_capacity(3 * MVQM_MAX + 8);
        for m in 0..MVQM_MAX {
            match (parts.get(m), ys.get(m)) {
                (Some(p), Some(y)) => {
                    args.extend([Arg::Ptr(p.0), Arg::Ptr(y.ptr), Arg::I32(p.3 as i32)])
                }
                _ => args.extend([Arg::Ptr(DevPtr(0)), Arg::Ptr(DevPtr(0)), Arg::I32(0)]),
            }
        }
        args.extend([
            Arg::Ptr(x.ptr),
            Arg::I32(cols as i32),
            Arg::I64(rb as i64),
            Arg::I32(k as i32),
        ]);
        args.extend(c.iter().map(|&o| Arg::I32(o)));
        let dims = LaunchDims {
            grid: [total as u32, 1, 1],
            block,
            shared_bytes: 0,
        };
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvqm_r2u4_{sfx}{}", mvq_late(ty)),
            dims,
            &args,
        );
        true
    }

    /// Backend::matmul_gateup at n = 1 in one launch (`mvrgu_r2u2_q8_0`: gate and up Q8_0 with
    /// decode copies, equal shapes, `h` gets the SwiGLU of `ff` rows), or false.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mv_gateup(
        &self,
        g: &GpuWeight,
        u: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        ff: usize,
        h: &mut GpuBuf,
        clamp: f32,
    ) -> bool {
        // n = 2..4 (verify steps): `mvrgun2` / `mvrgun4` on interleaved copies (each row read
        // once for every token, each token's bits as n = 1; `DS4_GPU_MVN=off` or
        // `DS4_GPU_MVRN=off`: false, so the caller runs the n = 1 form once per token).
        let tok = (2..=4).contains(&n) && mvrn_on() && mvn_on();
        if !(n == 1 || tok) || !merge_on() || !ENABLED.load(Ordering::Relaxed) || self.failed() {
            return false;
        }
        mvr_env();
        let (
            GpuWeight::Mat {
                ty: GgmlType::Q8_0,
                cols,
                rows,
                experts: 1,
                dec: Some(dg),
                dec_il: gi,
                ..
            },
            GpuWeight::Mat {
                ty: GgmlType::Q8_0,
                cols: cu,
                rows: ru,
                experts: 1,
                dec: Some(du),
                dec_il: ui,
                ..
            },
        ) = (g, u)
        else {
            return false;
        };
        let (cols, rows) = (*cols, *rows);
        let nb = rows * cols / 32;
        if MVR.load(Ordering::Relaxed) == 0
            || cols != *cu
            || gi != ui
            || rows != *ru
            || rows != ff
            || cols == 0
            || !cols.is_multiple_of(32)
            || !x.ptr.0.is_multiple_of(16)
            || dg.bytes() < nb * 34
            || du.bytes() < nb * 34
            || (n > 1 && !*gi)
        {
            return false;
        }
        // One row pair per warp (R = 1 in mv_dims' terms), steps of cols / 2 (see mvr).
        let (dims, k) = self.mv_dims(rows, 1, 1, 1, cols / 2);
        let (qg, qu) = (dg.ptr(), du.ptr());
        let name = match (n, *gi) {
            (1, true) => "mvrgu_r2u2_q8_0i",
            (1, false) => "mvrgu_r2u2_q8_0",
            (2, _) => "mvrgun2_r2u2_q8_0i",
            _ => "mvrgun4_r2u2_q8_0i",
        };
        let mut args = vec![
            Arg::Ptr(qg),
            Arg::Ptr(qg.offset((nb * 32) as u64)),
            Arg::Ptr(qu),
            Arg::Ptr(qu.offset((nb * 32) as u64)),
            Arg::Ptr(x.ptr),
            Arg::Ptr(h.ptr),
            Arg::I32(rows as i32),
            Arg::I32(cols as i32),
            Arg::F32(clamp),
            Arg::I32(k as i32),
        ];
        if n > 1 {
            args.push(Arg::I32(n as i32));
            MVRN_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
        self.run(&ds4_kernels::MATVEC, name, dims, &args);
        true
    }

    /// Backend::moe_experts: `mvgu_*` (gate, up, SwiGLU × weight per pair into scratch h), then
    /// `mvdown_*` (down per slot, summed over slots in selection order).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mv_moe(
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
        if !self.mv_ok(n, z) || k == 0 || k > MV_MAXK {
            return false;
        }
        let (Some(g), Some(u), Some(dn)) = (mat(gate), mat(up), mat(down)) else {
            return false;
        };
        // Gate and up share type and shape ([ff, d] per expert), down is [d, ff].
        if g.1 != u.1 || g.2 != d || u.2 != d || g.3 != ff || u.3 != ff || g.4 != u.4 {
            return false;
        }
        if dn.2 != ff || dn.3 != d {
            return false;
        }
        let pairs = n * k;
        let h = self.scratch(pairs * ff);
        let (dims, kk) = self.mv_dims(ff, MV_R, pairs, 1, d);
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvgu_{}", g.1),
            dims,
            &[
                Arg::Ptr(g.0),
                Arg::Ptr(u.0),
                Arg::Ptr(sel.0.ptr),
                Arg::I64((ff * g.4) as i64),
                Arg::Ptr(z.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(wgt.ptr),
                Arg::F32(spec.clamp),
                Arg::Ptr(h.ptr),
                Arg::I32(ff as i32),
                Arg::I32(d as i32),
                Arg::I64(g.4 as i64),
                Arg::I32(kk as i32),
            ],
        );
        let (dims, kk) = self.mv_dims(d, MV_R, n, 1, ff);
        self.run(
            &ds4_kernels::MATVEC,
            &format!("mvdown_{}", dn.1),
            dims,
            &[
                Arg::Ptr(dn.0),
                Arg::Ptr(sel.0.ptr),
                Arg::I64((d * dn.4) as i64),
                Arg::Ptr(h.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(out.ptr),
                Arg::I32(d as i32),
                Arg::I32(ff as i32),
                Arg::I64(dn.4 as i64),
                Arg::I32(kk as i32),
            ],
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default n = 1 routing of `mvq_*`: every Q8_0 product, F16 with >= 128 rows or the
    /// 16384-column mixes; other types and the small F16 4096->64 stay elsewhere.
    #[test]
    fn mvq_routing() {
        assert_eq!(mvq_auto(GgmlType::Q8_0, 129280, 4096, 132), 1);
        assert_eq!(mvq_auto(GgmlType::Q8_0, 1, 32, 132), 1);
        assert_eq!(mvq_auto(GgmlType::F16, 256, 4096, 132), 1);
        assert_eq!(mvq_auto(GgmlType::F16, 24, 16384, 132), 2);
        assert_eq!(mvq_auto(GgmlType::F16, 64, 4096, 132), 0);
        assert_eq!(mvq_auto(GgmlType::F32, 4096, 4096, 132), 0);
        assert_eq!(mvq_auto(GgmlType::Q2_K, 4096, 4096, 132), 0);
        assert!(MVQ_FORMS.iter().all(|f| f.1 <= MV_WARPS));
        assert_eq!(mvr_auto(129280, 4096), 1);
        assert_eq!(mvr_auto(8192, 4096), 2);
        assert_eq!(mvr_auto(1, 32), 2);
        assert!(MVR_FORMS.iter().all(|f| f.1 <= MV_WARPS));
        assert_eq!(mvq_splits(GgmlType::F16, 24, 16384, 1, 132), 16);
        assert_eq!(mvq_splits(GgmlType::F16, 7, 5120, 1, 132), 4);
        assert_eq!(mvq_splits(GgmlType::F16, 256, 4096, 1, 132), 1);
        assert_eq!(mvq_splits(GgmlType::Q8_0, 24, 16384, 1, 132), 1);
    }

    /// Every plan stages at most MVS_STAGE bytes, covers each row with whole-unit tiles, keeps
    /// the rows of a warp within its accumulators, and gives the big products enough CTAs.
    #[test]
    fn mvs_plans_fit() {
        let types = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q2_K,
            GgmlType::Q4_K,
            GgmlType::IQ2_XXS,
        ];
        let shapes = [
            (1024, 32768, 1),
            (8192, 4096, 1),
            (4096, 1024, 8),
            (4096, 129280, 1),
            (16384, 24, 1),
            (16384, 4, 1),
            (4096, 64, 1),
            (1024, 8192, 1),
            (256, 1, 1),
            (512, 3, 4),
            (1056, 2050, 1),
            (1536, 70, 1),
        ];
        for ty in types {
            for &(cols, rows, zs) in &shapes {
                let Some(rb) = ty.row_bytes(cols as u64).map(|b| b as usize) else {
                    continue;
                };
                for nt in [1, 2, 4] {
                    for (sm, warp) in [(132, 32), (104, 64)] {
                        let Some(p) = mvs_plan(ty, rows, cols, rb, zs, nt, sm, warp) else {
                            assert!(!rb.is_multiple_of(16) || !cols.is_multiple_of(32));
                            continue;
                        };
                        let what = format!("{ty:?} {cols}->{rows}x{zs} nt {nt}: {p:?}");
                        assert!(p.rc >= 1 && p.rc <= rows, "{what}");
                        assert!(p.rc * p.tile_bytes.min(rb) <= MVS_STAGE, "{what}");
                        assert!(p.tile_bytes.is_multiple_of(16), "{what}");
                        assert!(p.rc.div_ceil(8 / p.ksi) <= 16 / nt, "{what}");
                        assert!(p.tile_chunks * p.ks >= cols / 32, "{what}");
                        assert!(p.tile_chunks * (p.ks - 1) < cols / 32, "{what}");
                        if p.ks > 1 {
                            let (ub, uc) = unit(ty).unwrap();
                            assert_eq!(p.tile_bytes / ub * uc, p.tile_chunks, "{what}");
                            assert_eq!(p.rc, 1, "{what}");
                        } else {
                            assert_eq!(p.tile_bytes, rb, "{what}");
                        }
                        if rows * zs * rb >= 8 << 20 && sm == 132 {
                            assert!(rows.div_ceil(p.rc) * p.ks * zs >= 2 * sm, "{what}");
                        }
                    }
                }
            }
        }
        // The few-row F16 products split K across CTAs.
        let p = mvs_plan(GgmlType::F16, 24, 16384, 32768, 1, 1, 132, 32).unwrap();
        assert!(p.ks * 24 >= 132, "{p:?}");
    }
}
