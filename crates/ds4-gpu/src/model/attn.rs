//! Attention-state ops on the GPU: RoPE, row rounding, compressors, the lightning indexer and
//! sink attention (kernels in `ds4-kernels/gpu/attention.cu`). Reference: ds4-cpu backend.rs.

use super::switch::{env_code, env_form, env_pick, on_unless_off};
use super::{GpuBackend, GpuBuf, GpuIBuf, GpuLayerState, GpuWeight};
use crate::error::GpuError;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{AttnSpec, CompressSpec, GgmlType, IndexSpec, RopeKind, RowRounding, Which};
use ds4_kernels::{ATTENTION, ATTN_TC};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// Most score values the indexer keeps at once (tokens are batched under this).
const INDEX_SCORE_BUDGET: usize = 1 << 26;
/// Raw window + selected rows one attention CTA can list (`DS4_ATT_MAXLIST`).
const ATT_MAXLIST: usize = 2048;
/// Largest head width of `attend_f32` (`DS4_ATT_MAXHD`).
const ATT_MAXHD: usize = 1024;
/// Split attention (`attend_part_f32`): heads per CTA, rows per tile, largest head width, most
/// splits per token (`DS4_AP_*`), and the fewest candidate rows worth a split of their own.
const AP_HG: usize = 16;
const AP_R: usize = 4;
const AP_MAXHD: usize = 512;
const AP_MAXSPLIT: usize = 256;
const AP_MIN_ROWS: usize = 16;
/// Rows per CTA of `index_scores128h_f32` (`DS4_IXH_R`).
const IXH_R: usize = 32;

/// Decode attention in one launch (`attend_one_f32`): heads per CTA, rows per tile, most tokens
/// per launch, and its grid barrier's arrival word in `GpuBackend::tickets` (a 32-bit word of its
/// own, above the fused HC's; its low 31 bits are 0 between launches and its top bit flips at each
/// launch, graph replays included: attention.cu `ds4_ao_grid_flip`). The word after it is spare.
const AO_HG: usize = 16;
const AO_R: usize = 8;
/// Rows per tile of the tensor-core form `attend_one_tc` (`DS4_AOT_R`; head width 512 only).
const AOT_R: usize = 16;
const AO_MAX_N: usize = 8;
pub(crate) const AO_TICKET: usize = 64;
const _: () =
    assert!(super::mix::FUSE_TICKETS <= AO_TICKET && AO_TICKET + 2 <= super::TICKET_WORDS);

/// Attention kernels: 0 not yet read from `DS4_GPU_ATTN`, 1 simple (`attend_f32`, one CTA per
/// head and token), 2 split (`attend_part_f32` + `attend_combine_f32`), 3 one launch for decode
/// (`attend_one_f32` for chunks of up to `AO_MAX_N` tokens, else split; the default; its tile
/// loop on tensor cores, `attend_one_tc`, where the device has them and the head width is 512),
/// 4 the same with the f32 tile loop everywhere (`DS4_GPU_ATTN=one-f32`).
static ATTN_MODE: AtomicU8 = AtomicU8::new(0);

fn attn_mode() -> u8 {
    env_pick(
        &ATTN_MODE,
        "DS4_GPU_ATTN",
        &[("simple", 1), ("split", 2), ("one-f32", 4)],
        3,
    )
}

/// The tensor-core decode attention's form: 0 not yet read from `DS4_GPU_AOTC`, 1 `v0`
/// (`attend_one_tc`, session 17's), 2 `v1` (`attend_one_tc1`: the queries' hi/lo split after the
/// first row-pointer listing), 3 `v5` (`attend_one_tc5`, the default: v1 plus the (cos, sin)
/// table and, where it holds no selected rows, the first block's row pointers before the PDL
/// wait). The same bits in every form (attention.cu `ds4_attend_one`'s V). H200, us a call back
/// to back (examples/attn_bench.rs; bench/results/gpu-a119-h200.txt): CSA 2k 12.92 / 12.60 /
/// (v1 + the wait's work, measured with a lost combine) 11.96; HCA 32k 11.34 / 11.19 / 10.71.
static AOTC_FORM: AtomicU8 = AtomicU8::new(0);

fn aotc_kernel() -> &'static str {
    let names = ["attend_one_tc", "attend_one_tc1", "attend_one_tc5"];
    let m = env_pick(
        &AOTC_FORM,
        "DS4_GPU_AOTC",
        &[("v0", 1), ("v1", 2), ("v5", 3)],
        3,
    );
    names[(m as usize - 1).min(names.len() - 1)]
}

fn attn_simple() -> bool {
    attn_mode() == 1
}

/// Decode glue kernels: 0 not yet read from `DS4_GPU_ATTN_GLUE`, 1 old (`compress_frontier_f32`
/// and copies back, pool/norm/rope/round launches, `index_scores128_f32`, `index_topk`), 2 new
/// (in-place frontier, fused `compress_row_f32`, head-split indexer scores, top-k with a parallel
/// bin scan; the default).
static GLUE_MODE: AtomicU8 = AtomicU8::new(0);

fn glue_old() -> bool {
    env_form(&GLUE_MODE, "DS4_GPU_ATTN_GLUE", "old")
}

/// Closed compressor rows: 0 not yet read from `DS4_GPU_COMP_ROW`, 1 fused everywhere
/// (`DS4_GPU_COMP_ROW=fused`; `compress_row_f32`: one CTA a row pools, norms, rotates and
/// rounds it), 2 auto (the default): split where a channel pools at least `CP_MIN_NC`
/// candidates, 3 split everywhere (`DS4_GPU_COMP_ROW=split`). Split: `compress_pool_sh_f32`
/// pools over channel chunks of `CP_CH` (candidates in shared memory, only the two ordered sums
/// serial), then `compress_fin_f32` finishes each row in place; the same bits. H200, 2k prefill
/// (bench/results/gpu-p318-h200.txt): HCA (128 candidates) 383 -> 19 + 7 us; CSA (8) 39 ->
/// 40 + 7 us and its indexer 20 -> 13 + 8 us, so those stay fused.
static COMP_ROW: AtomicU8 = AtomicU8::new(0);
/// Channels per CTA of `compress_pool_sh_f32` (`DS4_CP_CH`).
const CP_CH: usize = 32;
/// Fewest candidates a channel (coff · ratio) for which auto splits the row kernel.
const CP_MIN_NC: usize = 32;

fn comp_row_mode() -> u8 {
    env_pick(
        &COMP_ROW,
        "DS4_GPU_COMP_ROW",
        &[("fused", 1), ("split", 3)],
        2,
    )
}

/// Indexer top-k and query prep: 0 not yet read from `DS4_GPU_TOPK`, 1 old (`index_topk_ps`
/// for every row length; the query copied, then `rope_f32` and `round_fp4h128_f32`), 2 new (the
/// default): `index_topk_r` (keys in registers) for rows of at most `TK_N` candidates, the two
/// levels `index_topk_l1` + `index_topk_l2` for longer rows of batches up to [`tk2_max_tok`]
/// tokens (else `index_topk_ps`, a CTA a token), and
/// the query prep in one launch (`index_qprep_f32`).
static TOPK_MODE: AtomicU8 = AtomicU8::new(0);
/// Most candidates one top-k CTA holds (`DS4_TK_N`: 1024 threads × 16 keys).
const TK_N: usize = 16384;
/// Most tokens the two-level top-k takes at once: any number (the default), or as
/// [`GpuBackend::set_topk2_max`] / `DS4_GPU_TK2_MAX=N` set it (`64`: session 36's form, prompt
/// batches past 64k of context on `index_topk_ps`, a CTA a token). On the H200 the two levels
/// prefill a 4,096-token turn 4% faster at 128k and 10% at 1M, a tie at 2k-32k (rows of at most
/// `TK_N` candidates take `index_topk_r` either way; bench/results/gpu-s38-h200.txt).
/// Survivors are scratch: 8 bytes a token, chunk and k; a batch of `INDEX_SCORE_BUDGET` scores
/// at k = 512 needs 16 MB over long rows, at most ~34 MB just past `TK_N` rows (two chunks).
static TK2_MAX: AtomicUsize = AtomicUsize::new(0);
const TK2_MAX_TOK: usize = usize::MAX;

fn tk2_max_tok() -> usize {
    static ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match TK2_MAX.load(Ordering::Relaxed) {
        0 => *ENV.get_or_init(|| super::env_usize("DS4_GPU_TK2_MAX").unwrap_or(TK2_MAX_TOK)),
        n => n,
    }
}
/// Candidates a level-1 top-k CTA takes (`index_topk_l1`), as set by
/// [`GpuBackend::set_topk_chunk`] (0: the default, [`TK_N`]; `usize::MAX`: not set, then
/// `DS4_GPU_TK_CHUNK`, read once).
static TK_CHUNK: AtomicUsize = AtomicUsize::new(usize::MAX);
static TK_CHUNK_ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// The level-1 chunk for top `k` (see [`TK_CHUNK`]): a multiple of 4 in `k ..= TK_N`.
fn topk_chunk(k: usize) -> usize {
    let c = match TK_CHUNK.load(Ordering::Relaxed) {
        usize::MAX => *TK_CHUNK_ENV.get_or_init(|| {
            std::env::var("DS4_GPU_TK_CHUNK")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        }),
        c => c,
    };
    if c == 0 {
        return TK_N;
    }
    c.next_multiple_of(4)
        .clamp(k.next_multiple_of(4).min(TK_N), TK_N)
}

fn topk_old() -> bool {
    env_form(&TOPK_MODE, "DS4_GPU_TOPK", "old")
}

/// Indexer scores on tensor cores (`index_scores_tc`, attn_tc.cu):
/// `DS4_GPU_INDEX_TC=off` keeps `index_scores128h_f32`.
static INDEX_TC: AtomicU8 = AtomicU8::new(0);
/// `index_scores_tc`: tokens per CTA (`IXT_TOK`), rows per CTA for prefill batches (enough to
/// reuse each CTA's query fragments) and for batches of at most `IXT_FEW` tokens (decode: enough
/// CTAs to fill the GPU).
const IXT_TOK: usize = 4;
const IXT_RB: usize = 256;
const IXT_RB_FEW: usize = 64;
const IXT_FEW: usize = 4;
/// Most rows a decode `index_scores_tc` CTA walks ([`ixt_rb_few`]).
const IXT_RB_FEW_MAX: usize = 1024;
/// `DS4_GPU_IXT_RB=N`: decode's indexer rows per CTA fixed at N (a multiple of 32; A/B runs), for
/// either scores kernel; unset or 0: [`ixt_rb_few`]'s or [`ixd_rb`]'s choice. Read once.
static IXT_RB_ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Rows per CTA of decode's `index_scores_tc` for a score row of `stride` candidates on `sms`
/// SMs: `IXT_RB_FEW` until that makes more than two CTAs an SM, then the multiple of 32 that
/// makes about two (at most `IXT_RB_FEW_MAX`). At 64 rows a CTA (two 32-row tiles after its
/// query fragments are loaded) a 256k context ran 1,024 CTAs: 31 us a layer for 32 MB of f32
/// rows (~1 TB/s); about two CTAs an SM: decode +2% at 128k, +5% at 256k
/// (bench/results/gpu-long-s34-h200.txt). Every row's score is computed as before (same bits);
/// `stride` moves only when the rows' capacity doubles, so decode graphs stay valid.
pub(crate) fn ixt_rb_few(stride: usize, sms: usize) -> usize {
    let env = ixt_rb_env();
    if env > 0 {
        return env;
    }
    stride
        .div_ceil(2 * sms.max(1))
        .next_multiple_of(32)
        .clamp(IXT_RB_FEW, IXT_RB_FEW_MAX)
}

/// Decode steps' (1-4 tokens) indexer scores by `index_scores_d` (attn_tc.cu: a token a CTA,
/// every warp computing, 3 CTAs an SM; same bits as `index_scores_tc`) where the score rows
/// hold at least `IXD_MIN_ROWS` (64k tokens of context): on the H200 a tie at 64k-256k, decode
/// +1.5% at 512k, +2.5% at 1M; shorter contexts were not measured with it and keep
/// `index_scores_tc` (bench/results/gpu-index-s35-h200.txt). `DS4_GPU_INDEX_DEC=off` keeps
/// `index_scores_tc` everywhere; `DS4_GPU_IXD_MIN=N` takes it from N score rows (A/B runs).
static INDEX_DEC: AtomicU8 = AtomicU8::new(0);
const IXD_MIN_ROWS: usize = 16384;

fn ixd_min_rows() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| super::env_usize("DS4_GPU_IXD_MIN").unwrap_or(IXD_MIN_ROWS))
}
/// `index_scores_d`'s dynamic shared bytes (attn_tc.cu `IXD_SMEM`: 4 stages of 32 bf16 rows at a
/// 136-value stride, two 64 x 36 f32 term tiles).
const IXD_SMEM: u32 = 53_248;

fn index_dec_ok() -> bool {
    !env_form(&INDEX_DEC, "DS4_GPU_INDEX_DEC", "off")
}

/// Rows per CTA of `index_scores_d` for a score row of `stride` candidates on `sms` SMs: the
/// multiple of 32 that makes about three CTAs an SM a token (its occupancy), at least one
/// 32-row tile; `DS4_GPU_IXT_RB=N` fixes N. Follows `stride` (the rows' capacity in decode), so
/// graphs stay valid.
pub(crate) fn ixd_rb(stride: usize, sms: usize) -> usize {
    let env = ixt_rb_env();
    if env > 0 {
        return env;
    }
    stride.div_ceil(3 * sms.max(1)).next_multiple_of(32).max(32)
}

fn ixt_rb_env() -> usize {
    *IXT_RB_ENV.get_or_init(|| {
        std::env::var("DS4_GPU_IXT_RB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&v| v > 0 && v.is_multiple_of(32))
            .unwrap_or(0)
    })
}

/// The prompt's indexer scores on Hopper wgmma (`index_scores_wg`, sm_90a; same bits as
/// `index_scores_tc`, which batches of at most `IXT_FEW` tokens keep): `DS4_GPU_INDEX_WG=off`
/// keeps `index_scores_tc`. H200, a 32k prompt's 4th 8192-token chunk: see attn_tc.cu.
static INDEX_WG: AtomicU8 = AtomicU8::new(0);
/// `index_scores_wg`: tokens per CTA (`IXW_TOK`), rows per CTA (a multiple of its 64-row tile;
/// each CTA also runs one tile past its last: 1/32 here) and dynamic shared bytes (`IXW_SMEM`).
const IXW_TOK: usize = 4;
const IXW_RB: usize = 2048;
const IXW_SMEM: u32 = 204_800;

/// `index_scores_wg`'s CTA order: token groups first (the default) or row blocks first
/// (`DS4_GPU_IXW_ORDER=rows`, [`GpuBackend::set_ixw_tok_first`]). Token groups first, the CTAs
/// that run together share a row block, so a long context's rows (67 MB a layer at 1M, more
/// than the L2) come from DRAM about once a batch instead of once a token group: +1% on a
/// 4,096-token turn at 128k and 1M on the H200, a tie at 2k-32k (gpu-s38-h200.txt). The same bits.
static IXW_ORDER: AtomicU8 = AtomicU8::new(0);

fn ixw_tok_first() -> bool {
    !env_form(&IXW_ORDER, "DS4_GPU_IXW_ORDER", "rows")
}

fn index_wg_ok(info: &crate::runtime::DeviceInfo) -> bool {
    !env_form(&INDEX_WG, "DS4_GPU_INDEX_WG", "off") && info.cc == (9, 0) && info.warp == 32
}

fn index_tc_ok(info: &crate::runtime::DeviceInfo) -> bool {
    !env_form(&INDEX_TC, "DS4_GPU_INDEX_TC", "off") && info.cc.0 >= 8 && info.warp == 32
}

/// Prefill attention (n > 1) on tensor cores (`attn_tc.cu`): 0 not yet read from
/// `DS4_GPU_ATTN_TC`, 1 off (the f32 kernels), 2 on with the hi/lo split of Q and P (default;
/// the engine's `--precision exact`), 3 on with one f16 product for chunks of more than
/// `GRAPH_MAX_N` tokens, the hi/lo split for decode steps (`DS4_GPU_ATTN_TC=fast`; the engine's
/// `--precision fast`, precision.rs).
static TC_MODE: AtomicU8 = AtomicU8::new(0);
/// Heads per CTA and largest RoPE width of `attn_tc*` (`ATC_HG`, 2·`ATC_MAXROT`).
const ATC_HG: usize = 16;
const ATC_MAXROT: usize = 128;
/// `attn_tc512g[64]_f32` (one CTA per token for all heads, absent candidates dropped; the `fast`
/// form with head width 512 and at most 64 heads): 0 not yet read from `DS4_GPU_ATTN_TCG`, 1 off
/// (`attn_tc512h_f32`, 16 heads a CTA: `DS4_GPU_ATTN_TCG=off`), 2 tiles of 32 rows (default),
/// 3 tiles of 64 rows (`DS4_GPU_ATTN_TCG=r64`; 32 where its shared memory does not fit), 4 tiles
/// of 32 rows pipelined (`DS4_GPU_ATTN_TCG=pipe`, `attn_tc512gp_f32`: O of a tile and S of the
/// next between the same barriers, 2 barriers a tile, three tile buffers).
static TCG_MODE: AtomicU8 = AtomicU8::new(0);
/// The prompt's raw queries normed and rotated inside `attn_tc512g_f32` (`attn_tc512gn_f32`,
/// `Backend::attend_qnorm`) instead of by a separate norm_rope pass: 0 not yet read from
/// `DS4_GPU_ATTN_QNORM`, 1 on (default), 2 off.
static QNORM: AtomicU8 = AtomicU8::new(0);
/// `attn_tc512gn_f32` / `attn_wg512n_f32` launches so far in this process (tests: the fused
/// form ran).
static QNORM_RUNS: AtomicU64 = AtomicU64::new(0);
/// The one-CTA-a-token prefill attention on Hopper wgmma in place of `attn_tc512g[n]_f32` on
/// sm_90a (`attn_wg512[n]_f32`, attn_tc.cu): 0 not yet read from `DS4_GPU_ATTN_WG`, 1 off
/// (default), 2 on (`DS4_GPU_ATTN_WG=on`). Off by default: on the H200 it is 2.3-2.6% slower a
/// call than the mma.sync kernel (an 8k prompt, ncu) and ties or loses ~0.5% end to end; a
/// pipelined form (Q in shared memory, the next tile's S during this tile's softmax; code in
/// 40dc73a) was 19% slower (bench/results/gpu-attn-s30-h200.txt).
static ATTN_WG: AtomicU8 = AtomicU8::new(0);
/// `attn_wg512[n]_f32` launches so far in this process (tests: the wgmma form ran).
static AWG_RUNS: AtomicU64 = AtomicU64::new(0);
/// `Backend::attend_project` with the `fast` output projection (blas.rs one bf16 term): the
/// one-CTA-a-token kernel writes the product's bf16 X' itself (`attn_tc512g[n]_bf`) instead of
/// f32 o that `blas_x_f32` reads again (same bits: the same rounding). 0 not yet read from
/// `DS4_GPU_ATTN_BF16`, 1 on (default), 2 off.
static ATTN_BF16: AtomicU8 = AtomicU8::new(0);
/// `attn_tc512g[n]_bf` launches so far in this process (tests: the bf16 form ran).
static BF16_RUNS: AtomicU64 = AtomicU64::new(0);

/// Tests: `attend_project` takes its fallback (the bf16 output widened to f32, then the product's
/// other forms) as if the library had declined the product.
static BF16_FALLBACK: AtomicBool = AtomicBool::new(false);

pub(crate) fn attn_bf16_fallback() -> bool {
    BF16_FALLBACK.load(Ordering::Relaxed)
}

fn attn_bf16_on() -> bool {
    env_code(&ATTN_BF16, "DS4_GPU_ATTN_BF16", on_unless_off) == 1
}
/// Its dynamic shared bytes before 4 a candidate (`AWG_SMEM`, attn_tc.cu): four 32-row K/V
/// stages, the S exchange, the norm's sums and scales, two RoPE tables, scan counts.
const AWG_SMEM: usize =
    4 * 32 * 1024 + 2 * 2 * 4 * 128 * 16 + 2 * 64 * 8 + (64 + 2 * ATC_MAXROT + 8) * 4;

fn attn_wg_ok(info: &crate::runtime::DeviceInfo) -> bool {
    info.cc == (9, 0)
        && info.warp == 32
        && env_pick(&ATTN_WG, "DS4_GPU_ATTN_WG", &[("on", 2)], 1) == 2
}

/// The RoPE angles of a prompt chunk precomputed for the raw-query kernels (`atc_rope_tab`,
/// then `attn_tc512gn_f32` / `attn_wg512[n]_f32` read them; the same bits): 0 not yet read
/// from `DS4_GPU_ATTN_RTAB`, 1 on (default), 2 off (each CTA computes its token's f64 angles).
static ATTN_RTAB: AtomicU8 = AtomicU8::new(0);

fn attn_rtab_on() -> bool {
    env_code(&ATTN_RTAB, "DS4_GPU_ATTN_RTAB", on_unless_off) == 1
}

fn qnorm_on() -> bool {
    env_code(&QNORM, "DS4_GPU_ATTN_QNORM", on_unless_off) == 1
}
/// Their static shared bytes (`Atg<R, PIPE>::SMEM`, attn_tc.cu: `nb` R-row K/V tiles, four
/// partial-S tiles, the P tile, per-head factors, RoPE, scan counts) before 4 bytes a candidate.
const fn atg_smem(r: usize, nb: usize) -> usize {
    nb * r * 520 * 2 + 4 * 64 * (r + 4) * 4 + 64 * (r + 8) * 2 + (3 * 64 + ATC_MAXROT + 8) * 4
}

fn tcg_mode() -> u8 {
    env_pick(
        &TCG_MODE,
        "DS4_GPU_ATTN_TCG",
        &[("off", 1), ("r64", 3), ("pipe", 4)],
        2,
    )
}

/// Decode steps of 2..=GRAPH_MAX_N tokens on the tensor-core prompt kernels (`DS4_GPU_ATTN_STEP=tc`
/// or [`GpuBackend::set_attn_step_tc`]) instead of the one-launch decode kernel (the default).
static STEP_TC: AtomicU8 = AtomicU8::new(0);

fn step_tc() -> bool {
    env_pick(&STEP_TC, "DS4_GPU_ATTN_STEP", &[("tc", 2)], 1) == 2
}

fn tc_mode() -> u8 {
    env_pick(&TC_MODE, "DS4_GPU_ATTN_TC", &[("off", 1), ("fast", 3)], 2)
}

/// The arguments every attention kernel starts with: queries, this chunk's KV rows, the raw ring
/// and its positions, the compressed rows (null when the layer has none) and the indexer's
/// selection (null without one).
fn attn_inputs(
    q: &GpuBuf,
    kv: &GpuBuf,
    st: &GpuLayerState,
    comp: DevPtr,
    sel: Option<&GpuIBuf>,
) -> [Arg; 6] {
    [
        Arg::Ptr(q.ptr),
        Arg::Ptr(kv.ptr),
        Arg::Ptr(st.raw.ptr()),
        Arg::Ptr(st.raw_pos.ptr()),
        if comp.0 == 0 {
            Arg::Null
        } else {
            Arg::Ptr(comp)
        },
        sel.map_or(Arg::Null, |s| Arg::Ptr(s.0.ptr)),
    ]
}

/// Whether the 16-byte vector loads of the tensor-core, split and fused-norm kernels may read the
/// queries, this chunk's KV rows, the raw ring and the compressed rows (null counts as aligned).
fn attn_aligned(st: &GpuLayerState, q: &GpuBuf, kv: &GpuBuf) -> bool {
    let comp = st.comp.as_ref().map_or(DevPtr(0), |c| c.rows.ptr());
    [q.ptr, kv.ptr, st.raw.ptr(), comp]
        .iter()
        .all(|p| p.0.is_multiple_of(16))
}

/// Attention rows read per token of a chunk of `n` at `t0`: (selected compressed rows, the
/// candidates of the last token, the most of any token in the chunk: window + selected rows, or
/// window + every compressed row when nothing selects).
fn candidates(spec: &AttnSpec, selected: bool, n: usize, t0: usize) -> (usize, usize) {
    let top_k = if selected { spec.top_k } else { 0 };
    let t_last = t0 + n - 1;
    let ncomp = if !selected && spec.ratio > 0 {
        (t_last + 1) / spec.ratio
    } else {
        0
    };
    (top_k, spec.window.min(t_last + 1) + top_k + ncomp)
}

impl GpuBackend {
    /// Use the old decode glue kernels (compressor frontier with copies back, one-thread-per-row
    /// indexer scores, serial top-k bin scan); process-wide, overrides `DS4_GPU_ATTN_GLUE=old`.
    pub fn set_attn_glue_old(on: bool) {
        GLUE_MODE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Closed compressor rows by name, as `DS4_GPU_COMP_ROW`: `fused` (`compress_row_f32`
    /// everywhere), `split` (`compress_pool_sh_f32` + `compress_fin_f32` everywhere), else auto
    /// (split for long pools only, the default); process-wide. For tests and benchmarks.
    pub fn set_comp_row(form: &str) {
        let m = match form {
            "fused" => 1,
            "split" => 3,
            _ => 2,
        };
        COMP_ROW.store(m, Ordering::Relaxed);
    }

    /// The indexer's old top-k and query prep (`index_topk_ps`; copy, `rope_f32`,
    /// `round_fp4h128_f32`) instead of the default forms; process-wide, overrides
    /// `DS4_GPU_TOPK=old`. For tests and benchmarks.
    pub fn set_topk_old(on: bool) {
        TOPK_MODE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Candidates a level-1 top-k CTA takes for rows of more than 16384 (0: the default,
    /// 16384); process-wide, overrides `DS4_GPU_TK_CHUNK`. The same selections at any chunk.
    pub fn set_topk_chunk(chunk: usize) {
        TK_CHUNK.store(chunk, Ordering::Relaxed);
    }

    /// Most tokens of a batch the two-level top-k takes (0: the default, any number);
    /// process-wide, overrides `DS4_GPU_TK2_MAX`. The same selections either way. For tests and
    /// benchmarks.
    pub fn set_topk2_max(n: usize) {
        TK2_MAX.store(n, Ordering::Relaxed);
    }

    /// `index_scores_wg`'s CTAs token groups first (true, the default) or row blocks first
    /// (false); process-wide, overrides `DS4_GPU_IXW_ORDER`. The same bits either way.
    pub fn set_ixw_tok_first(on: bool) {
        IXW_ORDER.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// The indexer query's preparation alone, as `index_select` runs it for `n` tokens from
    /// position `t0`: `q` ([n·heads, head_dim]) rotated and (FP4) rounded into `out`. For tests.
    pub fn index_query_prep(
        &self,
        q: &GpuBuf,
        n: usize,
        spec: &IndexSpec,
        t0: usize,
        out: &mut GpuBuf,
    ) {
        let len = n * spec.heads * spec.head_dim;
        if len == 0 || self.failed() {
            return;
        }
        if q.len < len || out.len < len {
            return self.attn_invalid(format!("index_query_prep: {len} values"));
        }
        self.index_qprep(q.ptr, out.ptr, n, spec, t0, None);
    }

    /// The indexer's top-k alone, as `index_select` runs it, over given score rows: row i at
    /// `scores[i·stride ..]` for the token at position `t0` + i, which sees (t0 + i + 1) / `ratio`
    /// of them; `k` i32 a token into `sel`. For tests and benchmarks.
    #[allow(clippy::too_many_arguments)]
    pub fn index_topk_rows(
        &self,
        scores: &GpuBuf,
        stride: usize,
        n: usize,
        t0: usize,
        ratio: usize,
        k: usize,
        sel: &mut GpuIBuf,
    ) {
        if n == 0 || self.failed() {
            return;
        }
        if ratio == 0 || (t0 + n) / ratio > stride || scores.len < n * stride || n > 65535 {
            return self.attn_invalid(format!("index_topk_rows: n {n} t0 {t0} stride {stride}"));
        }
        self.index_topk(scores.ptr, sel.0.ptr, n, t0, stride, ratio, k, Arg::Null);
    }

    /// Score the FP4 indexer on tensor cores (`index_scores_tc`, default) or
    /// with `index_scores128h_f32`; process-wide, overrides `DS4_GPU_INDEX_TC=off`.
    pub fn set_index_tc(on: bool) {
        INDEX_TC.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Score decode steps' (1-4 tokens) FP4 indexer by `index_scores_d` (default) or keep
    /// `index_scores_tc` (false); overrides `DS4_GPU_INDEX_DEC`. For tests and benchmarks.
    pub fn set_index_dec(on: bool) {
        INDEX_DEC.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Score prompt batches' FP4 indexer on Hopper wgmma (`index_scores_wg`, default on sm_90a)
    /// or keep `index_scores_tc` (false); overrides `DS4_GPU_INDEX_WG`. For tests and benchmarks.
    pub fn set_index_wg(on: bool) {
        INDEX_WG.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Use the simple attention kernel (one CTA per head and token) instead of the default
    /// forms; process-wide, overrides `DS4_GPU_ATTN=simple`. For tests and benchmarks.
    pub fn set_attn_simple(on: bool) {
        ATTN_MODE.store(if on { 1 } else { 3 }, Ordering::Relaxed);
    }

    /// The tensor-core decode attention's form by name, as `DS4_GPU_AOTC` (`v0`, `v1`, `v5`
    /// the default; see `AOTC_FORM`); process-wide. For tests and benchmarks.
    pub fn set_aotc_form(form: &str) {
        let m = match form {
            "v0" => 1,
            "v1" => 2,
            _ => 3,
        };
        AOTC_FORM.store(m, Ordering::Relaxed);
    }

    /// Attention form by name, as `DS4_GPU_ATTN`: `simple`, `split` (two launches at decode),
    /// `one` (one launch at decode, the default: its tile loop on tensor cores where it can),
    /// `one-f32` (one launch, the f32 tile loop); process-wide. For tests and benchmarks.
    pub fn set_attn_form(form: &str) {
        let m = match form {
            "simple" => 1,
            "split" => 2,
            "one-f32" => 4,
            _ => 3,
        };
        ATTN_MODE.store(m, Ordering::Relaxed);
    }

    /// The ring after a chunk of `n` rows at `t0` (its last `min(n, win)` rows), once every token
    /// of the chunk has attended.
    fn ring_store(
        &self,
        st: &GpuLayerState,
        kv: &GpuBuf,
        n: usize,
        t0: usize,
        hd: usize,
        win: usize,
    ) {
        let keep = n.min(win);
        self.run(
            &ATTENTION,
            "ring_store_f32",
            LaunchDims::linear((keep * hd).div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(kv.ptr),
                Arg::Ptr(st.raw.ptr()),
                Arg::Ptr(st.raw_pos.ptr()),
                Arg::I64(t0 as i64),
                Arg::I32(n as i32),
                Arg::I32(hd as i32),
                Arg::I32(win as i32),
            ],
        );
    }

    /// The `fast` prefill attention for head width 512 with one CTA per token
    /// (`attn_tc512g_f32`, the default `on`; `r64`: `attn_tc512g64_f32`; `pipe`:
    /// `attn_tc512gp_f32`) or per 16 heads (`off`: `attn_tc512h_f32`); process-wide, overrides
    /// `DS4_GPU_ATTN_TCG`.
    pub fn set_attn_tcg(form: &str) {
        let m = match form {
            "off" => 1,
            "r64" => 3,
            "pipe" => 4,
            _ => 2,
        };
        TCG_MODE.store(m, Ordering::Relaxed);
    }

    /// The one-CTA-a-token prefill attention on sm_90a: `attn_wg512[n]_f32` on wgmma (true) or
    /// `attn_tc512g[n]_f32` on mma.sync (false, the default); process-wide, overrides
    /// `DS4_GPU_ATTN_WG`. For tests and benchmarks.
    pub fn set_attn_wg(on: bool) {
        ATTN_WG.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// The raw-query prompt attention reads the chunk's RoPE angles from `atc_rope_tab` (true,
    /// the default) or each CTA computes its own; process-wide, overrides `DS4_GPU_ATTN_RTAB`.
    pub fn set_attn_rtab(on: bool) {
        ATTN_RTAB.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// `attn_wg512[n]_f32` launches so far in this process.
    pub fn attn_wg_launches() -> u64 {
        AWG_RUNS.load(Ordering::Relaxed)
    }

    /// `Backend::attend_project`'s bf16 hand-over (`attn_tc512g[n]_bf` writing the `fast`
    /// output projection's X'): on (true, the default) or off (f32 o, then `blas_x_f32`);
    /// process-wide, overrides `DS4_GPU_ATTN_BF16`. For tests and benchmarks.
    pub fn set_attn_bf16(on: bool) {
        ATTN_BF16.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Tests: `attend_project`'s bf16 path behaves as if the library declined its product (the
    /// output widened to f32 and multiplied by the other forms: the same bits under `fast`).
    pub fn set_attn_bf16_fallback(on: bool) {
        BF16_FALLBACK.store(on, Ordering::Relaxed);
    }

    /// `attn_tc512g[n]_bf` launches so far in this process.
    pub fn attn_bf16_launches() -> u64 {
        BF16_RUNS.load(Ordering::Relaxed)
    }

    /// Prefill attention on tensor cores where the device has them (CUDA sm_80+), else the f32
    /// kernels; process-wide, overrides `DS4_GPU_ATTN_TC=off`. `fast` takes one f16 product
    /// for S and for O instead of the hi/lo split (`DS4_GPU_ATTN_TC=fast`).
    pub fn set_attn_tc(on: bool, fast: bool) {
        TC_MODE.store(
            match (on, fast) {
                (false, _) => 1,
                (true, false) => 2,
                (true, true) => 3,
            },
            Ordering::Relaxed,
        );
    }

    fn attn_invalid(&self, msg: String) {
        self.note::<()>(Err(GpuError::Invalid(msg)));
    }

    /// RoPE over `rows` rows of `width` (token = row / heads at position pos0 + token·step;
    /// with `sp`, the step block's position (mod.rs `step_pos`) + pos0).
    #[allow(clippy::too_many_arguments)]
    fn rope_rows(
        &self,
        x: DevPtr,
        rows: usize,
        heads: usize,
        width: usize,
        n_rot: usize,
        pos0: usize,
        step: usize,
        kind: RopeKind,
        inverse: bool,
        sp: Option<DevPtr>,
    ) {
        let work = rows * (n_rot / 2);
        if work == 0 {
            return;
        }
        if n_rot > width || !n_rot.is_multiple_of(2) {
            return self.attn_invalid(format!("rope: n_rot {n_rot} over width {width}"));
        }
        self.run(
            &ATTENTION,
            "rope_f32",
            LaunchDims::linear(work.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(x),
                Arg::Ptr(self.rope_ptr(kind)),
                Arg::I64(rows as i64),
                Arg::I32(heads as i32),
                Arg::I32(width as i32),
                Arg::I32(n_rot as i32),
                Arg::I64(pos0 as i64),
                Arg::I64(step as i64),
                Arg::I32(inverse as i32),
                sp.map_or(Arg::Null, Arg::Ptr),
            ],
        );
    }

    fn round_ptr(&self, x: DevPtr, rows: usize, width: usize, r: RowRounding) {
        if rows == 0 || (r.fp8_nope == 0 && !r.fp4_hadamard && !r.f16) {
            return;
        }
        if r.fp4_hadamard && (!width.is_power_of_two() || width > 8192) {
            return self.attn_invalid(format!("round_rows: Hadamard over width {width}"));
        }
        if width > 12288 || r.fp8_nope > width {
            return self.attn_invalid(format!("round_rows: width {width}"));
        }
        if width == 128
            && r.fp4_hadamard
            && r.fp8_nope == 0
            && self.warp() == 32
            && x.0.is_multiple_of(16)
            && !attn_simple()
        {
            // The indexer's rows and queries: a warp per row (the same bits).
            return self.run(
                &ATTENTION,
                "round_fp4h128_f32",
                LaunchDims::linear(rows.div_ceil(8) as u32, 256),
                &[Arg::Ptr(x), Arg::I64(rows as i64), Arg::I32(r.f16 as i32)],
            );
        }
        let mut dims = LaunchDims::linear(rows as u32, 256);
        dims.shared_bytes = (width * 4) as u32;
        self.run(
            &ATTENTION,
            "round_rows_f32",
            dims,
            &[
                Arg::Ptr(x),
                Arg::I32(width as i32),
                Arg::I32(r.fp8_nope as i32),
                Arg::I32(r.fp4_hadamard as i32),
                Arg::I32(r.f16 as i32),
            ],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rope(
        &self,
        x: &mut GpuBuf,
        n: usize,
        heads: usize,
        width: usize,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        inverse: bool,
    ) {
        self.rope_rows(
            x.ptr,
            n * heads,
            heads,
            width,
            n_rot,
            t0,
            1,
            kind,
            inverse,
            None,
        )
    }

    pub(crate) fn op_round_rows(&self, x: &mut GpuBuf, rows: usize, width: usize, r: RowRounding) {
        self.round_ptr(x.ptr, rows, width, r)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_compress(
        &self,
        st: &mut GpuLayerState,
        which: Which,
        spec: &CompressSpec,
        ape: &GpuWeight,
        norm: &GpuWeight,
        a: &GpuBuf,
        g: &GpuBuf,
        n: usize,
        t0: usize,
    ) {
        if n == 0 || self.failed() {
            return;
        }
        let (ape_ptr, ape_ty, ape_rb) = match ape {
            GpuWeight::Mat {
                buf, ty, row_bytes, ..
            } => {
                let code = match ty {
                    GgmlType::F32 => 0,
                    GgmlType::F16 => 1,
                    GgmlType::BF16 => 2,
                    t => return self.attn_invalid(format!("compress: ape of type {t:?}")),
                };
                (buf.ptr(), code, *row_bytes)
            }
            _ => return self.attn_invalid("compress: ape is not a matrix".into()),
        };
        let Some(c) = st.comp_mut(which) else {
            return self.attn_invalid(format!("compress: layer has no {which:?} compressor"));
        };
        let dims = spec.dims;
        let (r, w, d) = (dims.ratio, dims.width(), dims.d);
        let slots = dims.slots();
        let (cw0, cw) = (t0 / r, (t0 + n) / r);
        let closed = cw - cw0;
        let n_rows = c.n_rows;
        if closed > 0 {
            self.reserve_rows(c, n_rows + closed);
        }
        // Rows first: they read the old frontier. New form: one fused launch per chunk.
        let rr = spec.round;
        let fused_ok = d <= 12288
            && rr.fp8_nope <= d
            && (!rr.fp4_hadamard || (d.is_power_of_two() && d <= 8192))
            && spec.n_rot <= d
            && spec.n_rot.is_multiple_of(2);
        let bf16 = c.bf16;
        if bf16 && !(rr.fp4_hadamard && fused_ok) {
            // Only FP4-simulated rows are exact in bf16 (mod.rs GpuComp::bf16), and only
            // compress_row_f32 writes them (the other forms stage f32 rows in `out`).
            return self.attn_invalid(format!(
                "compress: bf16 indexer rows need FP4 rounding and the fused row kernel (d {d}, \
                 n_rot {})",
                spec.n_rot
            ));
        }
        let fused = fused_ok && (bf16 || !glue_old());
        // Decode (new glue): the position from the step block (mod.rs `step_pos`); the row
        // kernel then finds its rows at window t0 / r, so only when the rows are exactly those
        // (always, unless a state was built otherwise).
        let sp = if !glue_old() && (closed == 0 || fused) && n_rows == cw0 {
            self.step_pos(t0, n)
        } else {
            None
        };
        let t0a = if sp.is_some() { 0 } else { t0 as i64 };
        let common = |fkv: DevPtr, fsc: DevPtr| -> Vec<Arg> {
            vec![
                Arg::Ptr(a.ptr),
                Arg::Ptr(g.ptr),
                Arg::Ptr(ape_ptr),
                Arg::Ptr(fkv),
                Arg::Ptr(fsc),
                Arg::I64(t0a),
                Arg::I32(n as i32),
                Arg::I32(r as i32),
                Arg::I32(dims.coff as i32),
                Arg::I32(w as i32),
                Arg::I32(ape_ty),
                Arg::I32(ape_rb as i32),
            ]
        };
        if closed > 0 && !self.failed() && fused {
            // With sp the kernel adds the first new row (t0 / r = n_rows) to out and pos0.
            let (out, pos0) = match sp {
                Some(_) => (c.rows.ptr(), 0),
                None => (
                    c.rows.ptr().offset((n_rows * d * c.elem()) as u64),
                    r * n_rows,
                ),
            };
            // The row finish's arguments (norm, RoPE, roundings, sp): the tail of both
            // compress_row_f32's and compress_fin_f32's lists.
            let fin = [
                Arg::Ptr(norm.ptr()),
                Arg::F32(spec.eps),
                Arg::Ptr(self.rope_ptr(spec.rope)),
                Arg::I32(spec.n_rot as i32),
                Arg::I64(pos0 as i64),
                Arg::I32(rr.fp8_nope as i32),
                Arg::I32(rr.fp4_hadamard as i32),
                Arg::I32(rr.f16 as i32),
                sp.map_or(Arg::Null, Arg::Ptr),
            ];
            let mut args = common(c.front_kv.ptr(), c.front_score.ptr());
            args.push(Arg::Ptr(out));
            args.extend(fin);
            let mut dims_r = LaunchDims::linear(closed as u32, 256);
            dims_r.shared_bytes = (d * 4) as u32;
            // Candidates [nc][CP_CH] values and scores of compress_pool_sh_f32 in shared memory.
            let nc = dims.coff * r;
            let sh_pool = (2 * nc * CP_CH * 4) as u32;
            let split = !bf16
                && match comp_row_mode() {
                    1 => false,
                    3 => true,
                    _ => nc >= CP_MIN_NC,
                };
            if !split || sh_pool > 48 * 1024 {
                args.push(Arg::I32(bf16 as i32)); // obf
                self.run(&ATTENTION, "compress_row_f32", dims_r, &args);
            } else {
                let mut pa = common(c.front_kv.ptr(), c.front_score.ptr());
                pa.extend([Arg::Ptr(out), sp.map_or(Arg::Null, Arg::Ptr)]);
                let dims_p = LaunchDims {
                    grid: [closed as u32, d.div_ceil(CP_CH) as u32, 1],
                    block: [256, 1, 1],
                    shared_bytes: sh_pool,
                };
                self.run(&ATTENTION, "compress_pool_sh_f32", dims_p, &pa);
                let mut fa = vec![
                    Arg::Ptr(out),
                    Arg::I32(r as i32),
                    Arg::I32(d as i32),
                    Arg::I64(t0a),
                ];
                fa.extend(fin);
                self.run(&ATTENTION, "compress_fin_f32", dims_r, &fa);
            }
        } else if closed > 0 && !self.failed() {
            let out = c.rows.ptr().offset((n_rows * d * 4) as u64);
            let mut args = common(c.front_kv.ptr(), c.front_score.ptr());
            args.push(Arg::Ptr(out));
            let dims_l = LaunchDims {
                grid: [closed as u32, d.div_ceil(128) as u32, 1],
                block: [128, 1, 1],
                shared_bytes: 0,
            };
            self.run(&ATTENTION, "compress_pool_f32", dims_l, &args);
            self.run(
                &ds4_kernels::ELEMENTWISE,
                "rmsnorm_f32",
                LaunchDims::linear(closed as u32, 256),
                &[
                    Arg::Ptr(out),
                    Arg::Ptr(norm.ptr()),
                    Arg::Ptr(out),
                    Arg::I32(d as i32),
                    Arg::F32(spec.eps),
                ],
            );
            self.rope_rows(
                out,
                closed,
                1,
                d,
                spec.n_rot,
                r * n_rows,
                r,
                spec.rope,
                false,
                None,
            );
            self.round_ptr(out, closed, d, spec.round);
        }
        if !glue_old() {
            // In place: each thread owns one slot pair and column.
            let mut args = common(c.front_kv.ptr(), c.front_score.ptr());
            args.push(sp.map_or(Arg::Null, Arg::Ptr));
            self.run(
                &ATTENTION,
                "compress_frontier_ip_f32",
                LaunchDims::linear((r * w).div_ceil(256) as u32, 256),
                &args,
            );
            if !self.failed() {
                c.n_rows = n_rows + closed;
            }
            return;
        }
        // New frontier into scratch, then over the old one.
        let total = slots * w;
        let nkv = self.scratch(total);
        let nsc = self.scratch(total);
        let mut args = common(c.front_kv.ptr(), c.front_score.ptr());
        args.push(Arg::Ptr(nkv.ptr));
        args.push(Arg::Ptr(nsc.ptr));
        self.run(
            &ATTENTION,
            "compress_frontier_f32",
            LaunchDims::linear(total.div_ceil(256) as u32, 256),
            &args,
        );
        self.d2d(c.front_kv.ptr(), nkv.ptr, total * 4);
        self.d2d(c.front_score.ptr(), nsc.ptr, total * 4);
        if !self.failed() {
            c.n_rows = n_rows + closed;
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_index_select(
        &self,
        st: &GpuLayerState,
        spec: &IndexSpec,
        q: &GpuBuf,
        w: &GpuBuf,
        n: usize,
        t0: usize,
        sel: &mut GpuIBuf,
    ) {
        if n == 0 || self.failed() {
            return;
        }
        let Some(ix) = st.index.as_ref() else {
            return self.attn_invalid("index_select: layer has no indexer state".into());
        };
        let (nh, ihd, k) = (spec.heads, spec.head_dim, spec.top_k);
        let max_vis = (t0 + n) / spec.ratio;
        if nh * ihd * 4 > 48 * 1024 {
            return self.attn_invalid(format!("index_select: query {nh}×{ihd} over 48 KiB"));
        }
        // Only tokens that see more than top_k rows score; the query is rotated and rounded
        // in a copy.
        let need_scores = max_vis > k;
        // Decode: positions from the step block (mod.rs `step_pos`; arguments are offsets from
        // it) and the scores' row stride and grid from the rows' capacity, not the visible
        // count, so that no argument moves from one step to the next (CTAs past the visible
        // rows return).
        let sp = if max_vis <= ix.cap {
            self.step_pos(t0, n)
        } else {
            None
        };
        let (base, stride) = match sp {
            Some(_) => (0, ix.cap),
            None => (t0, max_vis),
        };
        let qr = self.scratch(if need_scores { n * nh * ihd } else { 1 });
        if need_scores {
            self.index_qprep(q.ptr, qr.ptr, n, spec, base, sp);
        }
        let ws = 1.0 / ((ihd * nh) as f32).sqrt();
        let batch = if need_scores {
            (INDEX_SCORE_BUDGET / stride).clamp(1, n.min(65535))
        } else {
            n.min(65535)
        };
        let scores = self.scratch(if need_scores { batch * stride } else { 1 });
        let sp_arg = sp.map_or(Arg::Null, Arg::Ptr);
        // The scores' kernel form (the same for every batch). Rows held in registers when ihd is
        // 128 (same bits as the general kernel).
        let fast = !attn_simple()
            && ihd == 128
            && qr.ptr.0.is_multiple_of(16)
            && ix.rows.ptr().0.is_multiple_of(16);
        // Heads split over threads: 32 rows per CTA, term buffer beside the query.
        let split = fast && !glue_old() && nh * (ihd + IXH_R) * 4 <= 48 * 1024;
        // FP4-simulated queries and rows (the compressor rounds the rows under the same flag and
        // stores them as bf16): tensor cores, the same bits (attn_tc.cu); decode too (grid and
        // arguments fixed by the capacity, as above).
        let tc = split && spec.fp4 && ix.bf16 && nh == 64 && index_tc_ok(self.gpu.info());
        // Prompt batches on wgmma.
        let wg = need_scores && tc && sp.is_none() && n > IXT_FEW && index_wg_ok(self.gpu.info());
        let mut i0 = 0;
        while i0 < n {
            let nb = batch.min(n - i0);
            let tb = base + i0;
            // Every scores kernel's first arguments: the batch's queries and weights, the rows,
            // the scores, its first position and the scores' row stride.
            let head = [
                Arg::Ptr(qr.ptr.offset((i0 * nh * ihd * 4) as u64)),
                Arg::Ptr(w.ptr.offset((i0 * nh * 4) as u64)),
                Arg::Ptr(ix.rows.ptr()),
                Arg::Ptr(scores.ptr),
                Arg::I64(tb as i64),
                Arg::I64(stride as i64),
            ];
            if need_scores && wg {
                let _ps = self.prof(|| "index_select: scores".to_string());
                let (tgs, rbs) = (nb.div_ceil(IXW_TOK) as u32, stride.div_ceil(IXW_RB) as u32);
                let tfirst = ixw_tok_first() && rbs <= 65535;
                let dims = LaunchDims {
                    grid: if tfirst { [tgs, rbs, 1] } else { [rbs, tgs, 1] },
                    block: [512, 1, 1],
                    shared_bytes: IXW_SMEM,
                };
                self.run(
                    &ATTN_TC,
                    "index_scores_wg",
                    dims,
                    &[
                        &head[..],
                        &[
                            Arg::I32(nb as i32),
                            Arg::I32(IXW_RB as i32),
                            Arg::I32(spec.ratio as i32),
                            Arg::F32(ws),
                            Arg::I32(tfirst as i32),
                        ],
                    ]
                    .concat(),
                );
            } else if need_scores {
                // DS4_GPU_PROFILE=1: the two halves of index_select apart.
                let _ps = self.prof(|| "index_select: scores".to_string());
                let dims = LaunchDims {
                    grid: [stride.div_ceil(128) as u32, nb as u32, 1],
                    block: [128, 1, 1],
                    shared_bytes: (nh * ihd * 4) as u32,
                };
                // (kernel, grid, the two arguments after the rows' stride): the same
                // arguments otherwise (attention.cu / attn_tc.cu signatures).
                let dec = nb <= IXT_FEW && stride >= ixd_min_rows() && index_dec_ok();
                let (module, name, dims, mid) = if tc && dec {
                    let rb = ixd_rb(stride, self.gpu.info().sm_count as usize);
                    let dims = LaunchDims {
                        grid: [stride.div_ceil(rb) as u32, nb as u32, 1],
                        block: [256, 1, 1],
                        shared_bytes: IXD_SMEM,
                    };
                    (&ATTN_TC, "index_scores_d", dims, [nb, rb])
                } else if tc {
                    let rb = if nb <= IXT_FEW {
                        ixt_rb_few(stride, self.gpu.info().sm_count as usize)
                    } else {
                        IXT_RB
                    };
                    let dims = LaunchDims {
                        grid: [stride.div_ceil(rb) as u32, nb.div_ceil(IXT_TOK) as u32, 1],
                        block: [256, 1, 1],
                        shared_bytes: 0,
                    };
                    (&ATTN_TC, "index_scores_tc", dims, [nb, rb])
                } else if split {
                    let dims = LaunchDims {
                        grid: [stride.div_ceil(IXH_R) as u32, nb as u32, 1],
                        block: [256, 1, 1],
                        shared_bytes: (nh * (ihd + IXH_R) * 4) as u32,
                    };
                    (&ATTENTION, "index_scores128h_f32", dims, [nh, ihd])
                } else if fast {
                    (&ATTENTION, "index_scores128_f32", dims, [nh, ihd])
                } else {
                    (&ATTENTION, "index_scores_f32", dims, [nh, ihd])
                };
                let mut args = head.to_vec();
                args.extend([
                    Arg::I32(mid[0] as i32),
                    Arg::I32(mid[1] as i32),
                    Arg::I32(spec.ratio as i32),
                    Arg::F32(ws),
                    sp_arg,
                ]);
                if !tc {
                    args.push(Arg::I32(ix.bf16 as i32)); // attention.cu's forms: rbf
                }
                self.run(module, name, dims, &args);
            }
            let _pt = self.prof(|| "index_select: top-k".to_string());
            let sel_i = sel.0.ptr.offset((i0 * k * 4) as u64);
            self.index_topk(scores.ptr, sel_i, nb, tb, stride, spec.ratio, k, sp_arg);
            i0 += nb;
        }
    }

    /// The indexer query's preparation: `q` ([n·heads, head_dim]) copied to `qr`, rotated
    /// (token i at position `base` + i, from the step block with `sp`) and, when FP4, rounded
    /// (Hadamard + FP4). One launch (`index_qprep_f32`) for width 128, else the copy,
    /// `rope_f32` and the row rounding (the same bits).
    fn index_qprep(
        &self,
        q: DevPtr,
        qr: DevPtr,
        n: usize,
        spec: &IndexSpec,
        base: usize,
        sp: Option<DevPtr>,
    ) {
        let (nh, ihd) = (spec.heads, spec.head_dim);
        let fused = !topk_old()
            && !attn_simple()
            && spec.fp4
            && ihd == 128
            && spec.n_rot <= ihd
            && spec.n_rot.is_multiple_of(2)
            && self.warp() == 32
            && q.0.is_multiple_of(16)
            && qr.0.is_multiple_of(16);
        if fused {
            return self.run(
                &ATTENTION,
                "index_qprep_f32",
                LaunchDims::linear((n * nh).div_ceil(8) as u32, 256),
                &[
                    Arg::Ptr(q),
                    Arg::Ptr(qr),
                    Arg::Ptr(self.rope_ptr(spec.rope)),
                    Arg::I64((n * nh) as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(spec.n_rot as i32),
                    Arg::I64(base as i64),
                    sp.map_or(Arg::Null, Arg::Ptr),
                ],
            );
        }
        self.d2d(qr, q, n * nh * ihd * 4);
        self.rope_rows(
            qr,
            n * nh,
            nh,
            ihd,
            spec.n_rot,
            base,
            1,
            spec.rope,
            false,
            sp,
        );
        if spec.fp4 {
            let rr = RowRounding {
                fp8_nope: 0,
                fp4_hadamard: true,
                f16: false,
            };
            self.round_ptr(qr, n * nh, ihd, rr);
        }
    }

    /// Top-k of `nb` tokens' score rows (row i at `scores` + i·`stride`, token i at position
    /// `tb` + i, from the step block with `sp`) into `sel` (`k` i32 a token, ascending, −1
    /// padded). The kernel follows the row stride (fixed by the rows' capacity at decode), not
    /// the visible count, so the launch does not change from one decode step to the next.
    #[allow(clippy::too_many_arguments)]
    fn index_topk(
        &self,
        scores: DevPtr,
        sel: DevPtr,
        nb: usize,
        tb: usize,
        stride: usize,
        ratio: usize,
        k: usize,
        sp_arg: Arg,
    ) {
        let tail = [
            Arg::I64(tb as i64),
            Arg::I64(stride as i64),
            Arg::I32(ratio as i32),
            Arg::I32(k as i32),
        ];
        let new = !glue_old() && !topk_old() && k >= 1;
        // Chunks of `chunk` candidates for the two levels; their survivors must fit one CTA.
        let chunk = topk_chunk(k);
        let chunks = stride.div_ceil(chunk);
        if new && stride <= TK_N {
            let mut args = vec![Arg::Ptr(scores), Arg::Ptr(sel)];
            args.extend(tail);
            args.push(sp_arg);
            return self.run(
                &ATTENTION,
                "index_topk_r",
                LaunchDims::linear(nb as u32, 1024),
                &args,
            );
        }
        if new && nb <= tk2_max_tok() && chunks * k <= TK_N {
            // Survivors: keys (u32) then positions (i32), G·k of each a token.
            let m = nb * chunks * k;
            let surv = self.scratch(2 * m);
            let (skey, spos) = (surv.ptr, surv.ptr.offset((m * 4) as u64));
            let mut args = vec![Arg::Ptr(scores), Arg::Ptr(skey), Arg::Ptr(spos)];
            args.extend(tail);
            args.push(Arg::I32(chunks as i32));
            args.push(Arg::I32(chunk as i32));
            args.push(sp_arg);
            let dims = LaunchDims {
                grid: [chunks as u32, nb as u32, 1],
                block: [1024, 1, 1],
                shared_bytes: 0,
            };
            self.run(&ATTENTION, "index_topk_l1", dims, &args);
            return self.run(
                &ATTENTION,
                "index_topk_l2",
                LaunchDims::linear(nb as u32, 1024),
                &[
                    Arg::Ptr(skey),
                    Arg::Ptr(spos),
                    Arg::Ptr(sel),
                    Arg::I64(tb as i64),
                    Arg::I32(ratio as i32),
                    Arg::I32(k as i32),
                    Arg::I32(chunks as i32),
                    Arg::I32(chunk as i32),
                    sp_arg,
                ],
            );
        }
        let mut args = vec![Arg::Ptr(scores), Arg::Ptr(sel)];
        args.extend(tail);
        args.push(sp_arg);
        self.run(
            &ATTENTION,
            if glue_old() {
                "index_topk"
            } else {
                "index_topk_ps"
            },
            LaunchDims::linear(nb as u32, 1024),
            &args,
        );
    }

    /// Whether [`GpuBackend::op_attend`] of `n` raw queries (`qeps` given) may take
    /// `attn_tc512gn_f32`: a prompt chunk (n > 4: its positions are the host's, no step block),
    /// the fast tensor-core form with tiles of 32 rows, head width 512, at most 64 heads. The
    /// launch itself also needs the candidate list in shared memory; else the queries are
    /// normed into a copy first.
    pub(crate) fn attn_norms_q(&self, spec: &AttnSpec, n: usize) -> bool {
        let info = self.gpu.info();
        n > super::GRAPH_MAX_N
            && qnorm_on()
            && tc_mode() == 3
            && tcg_mode() == 2
            && info.cc.0 >= 8
            && info.warp == 32
            && spec.head_dim == 512
            && spec.n_head <= 64
            && spec.n_rot <= ATC_MAXROT
            && spec.n_rot.is_multiple_of(2)
    }

    /// `attn_tc512gn_f32` launches so far in this process.
    pub fn attn_qnorm_launches() -> u64 {
        QNORM_RUNS.load(Ordering::Relaxed)
    }

    /// Decode steps of 2..=4 tokens on the tensor-core prompt kernels (true) or the one-launch
    /// decode kernel (false, the default); process-wide (`DS4_GPU_ATTN_STEP=tc`; tests, A/B).
    pub fn set_attn_step_tc(on: bool) {
        STEP_TC.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Process-wide switch of the fused query norm (`DS4_GPU_ATTN_QNORM`; tests, A/B).
    pub fn set_attn_qnorm(on: bool) {
        QNORM.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Whether [`Self::op_attend_to`] of these operands takes the one-CTA-a-token kernel
    /// `attn_tc512g[n]_f32`, so that it can write bf16 (`attn_bf16_on` aside).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_bf16_form(
        &self,
        st: &GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        kv: &GpuBuf,
        selected: bool,
        n: usize,
        t0: usize,
    ) -> bool {
        // (a raw-query copy made by op_attend_to is scratch: aligned like these)
        attn_bf16_on()
            && self.attn_tc_ok(spec, n, attn_aligned(st, q, kv))
            && matches!(
                self.attn_tcg_kernel(spec, selected, n, t0),
                Some(("attn_tc512g_f32", _, false))
            )
    }

    /// Attention of `q` into `out`; with `qeps`, `q` is raw and each head is first RMS-normed (no
    /// weight, eps `qeps`) and rotated at its position: inside `attn_tc512gn_f32` where that
    /// kernel runs, else into a copy by norm_rope. `bf16`: `out` holds n × heads × head_dim bf16
    /// (half its f32 length) for the one-CTA-a-token kernel's bf16 form, and any other path is an
    /// error (the caller asked [`Self::attn_bf16_form`] first).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_attend_to(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        qeps: Option<f32>,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
        bf16: bool,
    ) {
        if n == 0 || self.failed() {
            return;
        }
        let fused = qeps.is_some()
            && self.attn_norms_q(spec, n)
            && attn_aligned(st, q, kv)
            && atg_smem(32, 2) + 4 * candidates(spec, sel.is_some(), n, t0).1
                <= self.gpu.info().max_shared_per_block as usize;
        let qn;
        let (q, qeps) = match qeps {
            Some(eps) if !fused => {
                let len = n * spec.n_head * spec.head_dim;
                let mut c = self.scratch(len);
                self.d2d(c.ptr, q.ptr, len * 4);
                let (nh, hd) = (spec.n_head, spec.head_dim);
                self.op_norm_rope(
                    &mut c, n, nh, hd, None, eps, spec.n_rot, t0, spec.rope, None,
                );
                qn = c;
                (&qn, None)
            }
            e => (q, e),
        };
        let (nh, hd, win) = (spec.n_head, spec.head_dim, spec.window);
        let top_k = if sel.is_some() { spec.top_k } else { 0 };
        if win + top_k > ATT_MAXLIST || hd > ATT_MAXHD || n > 65535 {
            return self.attn_invalid(format!(
                "attend: window {win} + top_k {top_k}, head_dim {hd} or chunk {n} too large"
            ));
        }
        let comp = st.comp.as_ref().map_or(DevPtr(0), |c| c.rows.ptr());
        if comp.0 == 0 && (sel.is_some() || spec.ratio > 0) {
            return self.attn_invalid("attend: compressed rows wanted, layer has none".into());
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let aligned = attn_aligned(st, q, kv);
        let split_ok = hd <= AP_MAXHD
            && hd.is_multiple_of(4)
            && spec.n_rot <= hd
            && spec.n_rot.is_multiple_of(2)
            && aligned;
        let info = self.gpu.info();
        if self.attn_tc_ok(spec, n, aligned) {
            return self.attend_tc(
                st, spec, q, qeps, kv, sinks, sel, n, t0, out, comp, scale, bf16,
            );
        }
        if bf16 {
            return self.attn_invalid("attend: bf16 output off the tensor-core path".into());
        }
        if qeps.is_some() {
            return self.attn_invalid("attend: raw queries off the tensor-core path".into());
        }
        if attn_mode() >= 3 && split_ok && n <= AO_MAX_N {
            let groups = nh.div_ceil(AO_HG);
            if n * groups <= info.sm_count as usize {
                return self.attend_one(st, spec, q, kv, sinks, sel, n, t0, out, comp, scale);
            }
        }
        if !attn_simple() && split_ok {
            return self.attend_split(st, spec, q, kv, sinks, sel, n, t0, out, comp, scale);
        }
        let dims = LaunchDims {
            grid: [nh as u32, n as u32, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
        };
        self.run(
            &ATTENTION,
            "attend_f32",
            dims,
            &[
                &attn_inputs(q, kv, st, comp, sel)[..],
                &[
                    Arg::Ptr(sinks.ptr()),
                    Arg::Ptr(out.ptr),
                    Arg::I64(t0 as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(win as i32),
                    Arg::I32(spec.ratio as i32),
                    Arg::I32(top_k as i32),
                    Arg::F32(scale),
                ],
            ]
            .concat(),
        );
        // Values are the rotated keys: undo the rotation at each query position.
        self.rope_rows(
            out.ptr,
            n * nh,
            nh,
            hd,
            spec.n_rot,
            t0,
            1,
            spec.rope,
            true,
            None,
        );
        // The ring after the chunk (after every token attended).
        self.ring_store(st, kv, n, t0, hd, win);
    }

    /// Whether op_attend_to takes the tensor-core prompt kernels (attend_tc).
    fn attn_tc_ok(&self, spec: &AttnSpec, n: usize, aligned: bool) -> bool {
        let info = self.gpu.info();
        let hd = spec.head_dim;
        // Decode steps of up to GRAPH_MAX_N tokens (speculative verify steps) take the one-launch
        // decode kernel (attend_one), the one-token steps' (session 33: the prompt kernels'
        // per-token set-up made a 2-token step's ratio-4 attention 60 us a layer against 16;
        // `DS4_GPU_ATTN_STEP=tc` keeps them on the tensor-core prompt kernels).
        (n > super::GRAPH_MAX_N || (n > 1 && step_tc()))
            && tc_mode() != 1
            && info.cc.0 >= 8
            && info.warp == 32
            && (hd == 512 || hd == 64)
            && spec.n_rot <= hd.min(ATC_MAXROT)
            && spec.n_rot.is_multiple_of(2)
            && aligned
    }

    /// attend_tc's one-CTA-a-token kernel for these operands, its dynamic shared bytes and
    /// whether it is the wgmma form (None: the 16-head CTAs of `attn_tc<hd>[h]_f32`).
    fn attn_tcg_kernel(
        &self,
        spec: &AttnSpec,
        selected: bool,
        n: usize,
        t0: usize,
    ) -> Option<(&'static str, usize, bool)> {
        // The one-f16-product forms (`fast`) take prompt chunks only: a decode step of 2-4 tokens
        // (speculative verification, short appends) keeps the hi/lo split, so decode runs the same
        // arithmetic under both precisions and its rows stay within ~1e-6 of single steps (an
        // accepted draft keeps them; engine tests/gpu.rs gpu_accepted_drafts_match_single_steps).
        let fast = tc_mode() == 3 && n > super::GRAPH_MAX_N;
        if spec.head_dim != 512 || !fast || spec.n_head > 64 {
            return None;
        }
        // Its dynamic shared memory holds the token's candidate list.
        let cand = 4 * candidates(spec, selected, n, t0).1;
        let smax = self.gpu.info().max_shared_per_block as usize;
        let g = match tcg_mode() {
            3 if atg_smem(64, 2) + cand <= smax => ("attn_tc512g64_f32", atg_smem(64, 2) + cand),
            4 if atg_smem(32, 3) + cand <= smax => ("attn_tc512gp_f32", atg_smem(32, 3) + cand),
            2..=4 if atg_smem(32, 2) + cand <= smax => ("attn_tc512g_f32", atg_smem(32, 2) + cand),
            _ => return None,
        };
        // On sm_90a the 32-row form may run on wgmma (where its shared memory fits).
        if g.0 == "attn_tc512g_f32" && attn_wg_ok(self.gpu.info()) && AWG_SMEM + cand <= smax {
            return Some(("attn_wg512_f32", AWG_SMEM + cand, true));
        }
        Some((g.0, g.1, false))
    }

    /// Prefill attention on tensor cores: `atc_rows_f16` (f16 copies of the rows; for the
    /// raw-query and wgmma kernels also `atc_rope_tab`, the chunk's RoPE angles), then
    /// `attn_tc<hd>[h]_f32` over (head groups of 16, tokens) or a one-CTA-a-token form (sink and
    /// inverse RoPE included), then `ring_store_f32`.
    #[allow(clippy::too_many_arguments)]
    fn attend_tc(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        qeps: Option<f32>,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
        comp: DevPtr,
        scale: f32,
        bf16: bool,
    ) {
        let (nh, hd, win) = (spec.n_head, spec.head_dim, spec.window);
        let top_k = if sel.is_some() { spec.top_k } else { 0 };
        let fast = tc_mode() == 3 && n > super::GRAPH_MAX_N;
        let name = match (hd, fast) {
            (512, false) => "attn_tc512_f32",
            (512, true) => "attn_tc512h_f32",
            (_, false) => "attn_tc64_f32",
            (_, true) => "attn_tc64h_f32",
        };
        let tcg = self.attn_tcg_kernel(spec, sel.is_some(), n, t0);
        let wg = matches!(tcg, Some((_, _, true)));
        let grouped = tcg.map(|(g, smem, _)| (g, smem));
        // Raw queries (op_attend checked that the 32-row grouped kernel runs): its QN form.
        let grouped = match (grouped, qeps) {
            (Some((g @ ("attn_tc512g_f32" | "attn_wg512_f32"), smem)), Some(_)) => {
                QNORM_RUNS.fetch_add(1, Ordering::Relaxed);
                let raw = if g == "attn_wg512_f32" {
                    "attn_wg512n_f32"
                } else {
                    "attn_tc512gn_f32"
                };
                Some((raw, smem))
            }
            (g, None) => g,
            (_, Some(_)) => {
                return self.attn_invalid("attend: raw queries without attn_tc512gn_f32".into())
            }
        };
        // bf16 output (attend_project asked attn_bf16_form): the 32-row mma.sync kernel's form.
        let grouped = match (grouped, bf16) {
            (g, false) => g,
            (Some(("attn_tc512g_f32", smem)), true) => Some(("attn_tc512g_bf", smem)),
            (Some(("attn_tc512gn_f32", smem)), true) => Some(("attn_tc512gn_bf", smem)),
            (_, true) => {
                return self.attn_invalid("attend: bf16 output without attn_tc512g[n]_f32".into())
            }
        };
        if wg {
            AWG_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        if bf16 {
            BF16_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        let (name, dims) = if let Some((g, smem)) = grouped {
            let d = LaunchDims {
                grid: [1, n as u32, 1],
                block: [256, 1, 1],
                shared_bytes: smem as u32,
            };
            (g, d)
        } else {
            let d = LaunchDims {
                grid: [nh.div_ceil(ATC_HG) as u32, n as u32, 1],
                block: [128, 1, 1],
                shared_bytes: 0,
            };
            (name, d)
        };
        // f16 copies of every row a token may read: [ring (win) | this chunk's kv (n) | the
        // compressed rows visible to the chunk's last token]; the scratch outlives the launches
        // (stream order).
        let ncomp = if comp.0 != 0 && spec.ratio > 0 {
            (t0 + n) / spec.ratio
        } else {
            0
        };
        let total4 = (win + n + ncomp) * hd / 4;
        // (half the bytes a row load: H200 2k CSA attention 2110 vs 2406 us with f32 rows
        // converted at each load, bench/results/gpu-attn-t12-h200.txt).
        let rows = self.scratch(total4 * 2);
        self.run(
            &ATTN_TC,
            "atc_rows_f16",
            LaunchDims {
                grid: [total4.div_ceil(256).min(4096) as u32, 1, 1],
                block: [256, 1, 1],
                shared_bytes: 0,
            },
            &[
                Arg::Ptr(st.raw.ptr()),
                Arg::Ptr(kv.ptr),
                Arg::Ptr(comp),
                Arg::Ptr(rows.ptr),
                Arg::I64((win * hd / 4) as i64),
                Arg::I64((n * hd / 4) as i64),
                Arg::I64(total4 as i64),
            ],
        );
        // The raw-query and wgmma kernels take the chunk's RoPE table (or null: they compute it).
        let takes_tab = name == "attn_tc512gn_f32" || name == "attn_tc512gn_bf" || wg;
        let npair = spec.n_rot / 2;
        let tab = (takes_tab && attn_rtab_on() && npair > 0).then(|| {
            let tab = self.scratch(n * npair * 4);
            self.run(
                &ATTN_TC,
                "atc_rope_tab",
                LaunchDims {
                    grid: [(n * npair).div_ceil(256).min(4096) as u32, 1, 1],
                    block: [256, 1, 1],
                    shared_bytes: 0,
                },
                &[
                    Arg::Ptr(self.rope_ptr(spec.rope)),
                    Arg::Ptr(tab.ptr),
                    Arg::I64(t0 as i64),
                    Arg::I32(n as i32),
                    Arg::I32(npair as i32),
                ],
            );
            tab
        });
        self.run(
            &ATTN_TC,
            name,
            dims,
            &[
                &attn_inputs(q, kv, st, comp, sel)[..],
                &[
                    Arg::Ptr(sinks.ptr()),
                    Arg::Ptr(self.rope_ptr(spec.rope)),
                    Arg::Ptr(out.ptr),
                    Arg::I64(t0 as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(win as i32),
                    Arg::I32(spec.ratio as i32),
                    Arg::I32(top_k as i32),
                    Arg::I32(spec.n_rot as i32),
                    Arg::F32(scale),
                ],
                &[Arg::Ptr(rows.ptr)], // rows16
                // qeps: the QN forms' (the wgmma kernels take it always, unused without QN)
                &qeps
                    .or(wg.then_some(0.0))
                    .map(Arg::F32)
                    .into_iter()
                    .collect::<Vec<_>>()[..],
                &(if takes_tab {
                    vec![tab.as_ref().map_or(Arg::Null, |t| Arg::Ptr(t.ptr))]
                } else {
                    vec![]
                })[..],
            ]
            .concat(),
        );
        self.ring_store(st, kv, n, t0, hd, win);
    }

    /// Decode attention in one launch: `attend_one_f32` over (tokens × head groups × row
    /// splits) CTAs, at most one per SM (all resident: the kernel has a grid-wide barrier
    /// between its split and merge phases); sink, inverse RoPE and ring store included.
    #[allow(clippy::too_many_arguments)]
    fn attend_one(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
        comp: DevPtr,
        scale: f32,
    ) {
        let (nh, hd, win) = (spec.n_head, spec.head_dim, spec.window);
        let (top_k, max_cand) = candidates(spec, sel.is_some(), n, t0);
        let per_split = n * nh.div_ceil(AO_HG);
        let info = self.gpu.info();
        // The tile loop on tensor cores: CUDA sm_80+, 32-lane warps, head width 512.
        let tc = attn_mode() == 3 && info.cc.0 >= 8 && info.warp == 32 && hd == AP_MAXHD;
        let (kname, r) = if tc {
            (aotc_kernel(), AOT_R)
        } else {
            ("attend_one_f32", AO_R)
        };
        // As many splits as fit one CTA per SM, each a whole number of tiles (fewer, longer
        // splits were slower with the tensor-core loop: bench/results/gpu-attn-a17-h200.txt).
        let most = (info.sm_count as usize / per_split).clamp(1, AP_MAXSPLIT);
        let splits = most.min(max_cand.div_ceil(r)).max(1);
        let chunk = max_cand.div_ceil(splits).next_multiple_of(r).max(r);
        let splits = max_cand.div_ceil(chunk).max(1);
        if chunk > i32::MAX as usize {
            return self.attn_invalid(format!("attend: {max_cand} candidate rows"));
        }
        // Decode: the position from the step block (mod.rs `step_pos`) and a grid of the most
        // splits; chunk 0 tells the kernel to pick chunk and splits itself (the values above),
        // so that no argument or grid moves as the context grows.
        let sp = self.step_pos(t0, n);
        let (t0a, chunk, splits, grid_splits) = match sp {
            Some(_) => (0, 0, most, most),
            None => (t0 as i64, chunk, splits, splits),
        };
        let part_o = self.scratch(n * grid_splits * nh * hd);
        let part_mz = self.scratch(n * grid_splits * nh * 2);
        self.run(
            &ATTENTION,
            kname,
            LaunchDims::linear((per_split * grid_splits) as u32, 256),
            &[
                Arg::Ptr(q.ptr),
                Arg::Ptr(kv.ptr),
                Arg::Ptr(st.raw.ptr()),
                Arg::Ptr(st.raw_pos.ptr()),
                if comp.0 == 0 {
                    Arg::Null
                } else {
                    Arg::Ptr(comp)
                },
                sel.map_or(Arg::Null, |s| Arg::Ptr(s.0.ptr)),
                Arg::Ptr(sinks.ptr()),
                Arg::Ptr(self.rope_ptr(spec.rope)),
                Arg::Ptr(out.ptr),
                Arg::Ptr(part_o.ptr),
                Arg::Ptr(part_mz.ptr),
                Arg::Ptr(self.tickets.ptr().offset((AO_TICKET * 4) as u64)),
                Arg::I64(t0a),
                Arg::I32(n as i32),
                Arg::I32(nh as i32),
                Arg::I32(hd as i32),
                Arg::I32(win as i32),
                Arg::I32(spec.ratio as i32),
                Arg::I32(top_k as i32),
                Arg::I32(chunk as i32),
                Arg::I32(splits as i32),
                Arg::I32(spec.n_rot as i32),
                Arg::F32(scale),
                sp.map_or(Arg::Null, Arg::Ptr),
            ],
        );
    }

    /// Split attention: `attend_part_f32` over (row splits, head groups, tokens), then
    /// `attend_combine_f32` (sink, inverse RoPE, ring store) over (heads, tokens).
    #[allow(clippy::too_many_arguments)]
    fn attend_split(
        &self,
        st: &mut GpuLayerState,
        spec: &AttnSpec,
        q: &GpuBuf,
        kv: &GpuBuf,
        sinks: &GpuWeight,
        sel: Option<&GpuIBuf>,
        n: usize,
        t0: usize,
        out: &mut GpuBuf,
        comp: DevPtr,
        scale: f32,
    ) {
        let (nh, hd, win) = (spec.n_head, spec.head_dim, spec.window);
        let (top_k, max_cand) = candidates(spec, sel.is_some(), n, t0);
        let groups = nh.div_ceil(AP_HG);
        // Splits: about four CTAs per SM in all (two or three fit at once), each split at least
        // AP_MIN_ROWS candidates.
        let want = 4 * self.gpu.info().sm_count as usize;
        let splits = want
            .div_ceil(n * groups)
            .min(max_cand.div_ceil(AP_MIN_ROWS))
            .clamp(1, AP_MAXSPLIT);
        let chunk = max_cand.div_ceil(splits).next_multiple_of(AP_R).max(AP_R);
        let splits = max_cand.div_ceil(chunk).max(1);
        if chunk > i32::MAX as usize {
            return self.attn_invalid(format!("attend: {max_cand} candidate rows"));
        }
        let part_o = self.scratch(n * splits * nh * hd);
        let part_mz = self.scratch(n * splits * nh * 2);
        self.run(
            &ATTENTION,
            "attend_part_f32",
            LaunchDims {
                grid: [splits as u32, groups as u32, n as u32],
                block: [256, 1, 1],
                shared_bytes: 0,
            },
            &[
                &attn_inputs(q, kv, st, comp, sel)[..],
                &[
                    Arg::Ptr(part_o.ptr),
                    Arg::Ptr(part_mz.ptr),
                    Arg::I64(t0 as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(win as i32),
                    Arg::I32(spec.ratio as i32),
                    Arg::I32(top_k as i32),
                    Arg::I32(chunk as i32),
                    Arg::I32(splits as i32),
                    Arg::F32(scale),
                ],
            ]
            .concat(),
        );
        self.run(
            &ATTENTION,
            "attend_combine_f32",
            LaunchDims {
                grid: [nh as u32, n as u32, 1],
                block: [256, 1, 1],
                shared_bytes: 0,
            },
            &[
                Arg::Ptr(part_o.ptr),
                Arg::Ptr(part_mz.ptr),
                Arg::Ptr(sinks.ptr()),
                Arg::Ptr(self.rope_ptr(spec.rope)),
                Arg::Ptr(out.ptr),
                Arg::Ptr(kv.ptr),
                Arg::Ptr(st.raw.ptr()),
                Arg::Ptr(st.raw_pos.ptr()),
                Arg::I64(t0 as i64),
                Arg::I32(n as i32),
                Arg::I32(nh as i32),
                Arg::I32(hd as i32),
                Arg::I32(win as i32),
                Arg::I32(splits as i32),
                Arg::I32(spec.n_rot as i32),
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_index_rows_per_cta_grow_with_the_rows() {
        if std::env::var("DS4_GPU_IXT_RB").is_ok() {
            eprintln!("skipped: DS4_GPU_IXT_RB fixes the choice");
            return;
        }
        // Up to ~128k tokens of context (32k rows) the old 64 rows a CTA.
        assert_eq!(ixt_rb_few(512, 132), IXT_RB_FEW);
        assert_eq!(ixt_rb_few(16384, 132), IXT_RB_FEW);
        // Then about two CTAs an SM, in whole 32-row tiles.
        assert_eq!(ixt_rb_few(32768, 132), 128);
        assert_eq!(ixt_rb_few(65536, 132), 256);
        assert_eq!(ixt_rb_few(262144, 132), IXT_RB_FEW_MAX);
        for stride in [1, 100, 4096, 40000, 65536, 1 << 20] {
            for sms in [0, 1, 16, 78, 132, 304] {
                let rb = ixt_rb_few(stride, sms);
                assert!(rb.is_multiple_of(32) && (IXT_RB_FEW..=IXT_RB_FEW_MAX).contains(&rb));
                // Never fewer CTAs than SMs where there are rows for them at 64 a CTA.
                if stride / IXT_RB_FEW >= sms && rb > IXT_RB_FEW {
                    assert!(
                        stride.div_ceil(rb) >= sms,
                        "{stride} rows, {sms} SMs: rb {rb}"
                    );
                }
            }
        }
    }

    #[test]
    fn decode_index_d_rows_fill_three_ctas_an_sm() {
        if std::env::var("DS4_GPU_IXT_RB").is_ok() {
            eprintln!("skipped: DS4_GPU_IXT_RB fixes the choice");
            return;
        }
        // One 32-row tile a CTA until 3 x 132 CTAs, then whole tiles for about three an SM:
        // 64k context (16k rows) 256 CTAs, 256k 342, 1M 391.
        assert_eq!(ixd_rb(2048, 132), 32);
        assert_eq!(ixd_rb(16384, 132), 64);
        assert_eq!(ixd_rb(65536, 132), 192);
        assert_eq!(ixd_rb(262144, 132), 672);
        for stride in [1, 100, 4096, 40000, 65536, 1 << 20] {
            for sms in [0, 1, 16, 78, 132, 304] {
                let rb = ixd_rb(stride, sms);
                assert!(
                    rb.is_multiple_of(32) && rb >= 32,
                    "{stride} rows, {sms} SMs: rb {rb}"
                );
                // Every row covered, and no more CTAs than ~3 an SM once the rows allow it.
                assert!(stride.div_ceil(rb) * rb >= stride);
                if rb > 32 {
                    assert!(
                        stride.div_ceil(rb) <= 3 * sms.max(1),
                        "{stride} rows, {sms} SMs: rb {rb}"
                    );
                }
            }
        }
    }
}
