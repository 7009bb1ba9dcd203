//! Model glue ops on the GPU: embedding, hyper-connections, router, elementwise (kernels in
//! `ds4-kernels/gpu/model.cu` and `elementwise.cu`). Reference: ds4-cpu backend.rs.
//!
//! rms_norm, hc_split, hc_collapse, hc_post and moe_route have latency forms for decode
//! (`*_fast`, `*x4`: float4 loads in flight at once, warp-synchronous Sinkhorn and top-k; the
//! default, `DS4_GPU_MIX=fast`), and glue forms on top (opt-in, `DS4_GPU_MIX=glue`: Sinkhorn in
//! one thread's registers per token, 64-thread column CTAs, rms_norm with one barrier; on the H200
//! they decoded full-size q2 at 67.3 tok/s against 70.9 for the fast forms, so they are not the
//! default). `DS4_GPU_MIX=simple` runs the first kernels, one CTA per row or token (or
//! [`GpuBackend::set_mix_form`]).

use super::switch::{env_code, on_unless_off, set_code};
use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::error::GpuError;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{GgmlType, HcDims, MoeSpec, RopeKind, RowRounding};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Most hyper-connection streams the `hc_*` kernels take (`DS4_HC_MAX` in model.cu).
const HC_MAX: usize = 16;
/// Most experts, and experts per token, `moe_route` takes (`DS4_ROUTE_MAX_E`, `_K`).
const ROUTE_MAX_E: usize = 1024;
const ROUTE_MAX_K: usize = 32;
/// Longest row `rmsnorm_f32x4` takes: 4 float4 per thread of a 1024-thread CTA.
const NORM_X4_MAX: usize = 4 * 4 * 1024;

/// Kernel forms: 0 not yet read from `DS4_GPU_MIX`, 1 glue, 2 simple, 3 fast (default)
/// (process-wide).
static MODE: AtomicU8 = AtomicU8::new(0);

/// Which glue kernels run: `DS4_GPU_MIX=simple|glue`, read once (anything else: fast), or
/// [`GpuBackend::set_mix_form`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MixForm {
    /// One CTA per row or token (the first kernels).
    Simple,
    /// The round-2 latency forms (float4, warp-synchronous Sinkhorn and top-k).
    Fast,
    /// The default: fast plus a Sinkhorn in one thread's registers per token (N <= 4), 64-thread
    /// column CTAs for hc_split/collapse/post, rms_norm with one block barrier.
    Glue,
}

fn mix_form() -> MixForm {
    let m = env_code(&MODE, "DS4_GPU_MIX", |v| match v {
        Some("simple") => 2,
        Some("glue") => 1,
        _ => 3,
    });
    match m {
        2 => MixForm::Simple,
        3 => MixForm::Fast,
        _ => MixForm::Glue,
    }
}

/// Whether the simple kernels are in use.
fn mix_simple() -> bool {
    mix_form() == MixForm::Simple
}

/// Whether the glue forms are in use.
fn mix_glue() -> bool {
    mix_form() == MixForm::Glue
}

/// Threads of the glue forms' column CTAs (float4 columns each): 64 (more, smaller CTAs) while
/// the columns of all `n` tokens fit in 16384 threads (one wave of the SMs; decode), else 256
/// (prefill, as the latency forms).
fn glue_cols(n: usize, d: usize) -> usize {
    if n * (d / 4) <= 64 * 256 {
        64
    } else {
        256
    }
}

/// Fused glue (fused.cu): 0 not yet read from `DS4_GPU_FUSE`, 1 on (default), 2 off, 3 on
/// but the HC post unfused (`nopost`) (process-wide).
static FUSE: AtomicU8 = AtomicU8::new(0);

/// Most tokens the fused HC pre takes (decode): each token's split CTAs read the whole mixer,
/// so prefill keeps the separate ops (one GEMM reads it once per step).
const FUSE_HC_MAX_N: usize = 4;
/// Most splits of a token's row in the fused HC pre.
const FUSE_HC_SPLITS: usize = 64;
/// Doubles per (token, split) partial (`FU_PART` in fused.cu).
const FUSE_PART: usize = 32;
/// Tokens with an arrival counter in `GpuBackend::tickets` (>= FUSE_HC_MAX_N).
pub(crate) const FUSE_TICKETS: usize = 64;

/// Whether the fused glue runs: `DS4_GPU_FUSE=off` (or `0`) turns it off, `nopost` keeps the
/// HC post separate; read once, or [`GpuBackend::set_fuse`].
fn fuse_on() -> bool {
    let m = env_code(&FUSE, "DS4_GPU_FUSE", |v| match v {
        Some("nopost") => 3,
        v => on_unless_off(v),
    });
    m == 1 || m == 3
}

/// Prefill HC pre (n > FUSE_HC_MAX_N, fused.cu `hcp_mix` + `hcp_finish`): 0 not yet read from
/// `DS4_GPU_HCP`, 1 on (default), 2 off (the composed ops: copy, rms_norm, the BLAS mixer
/// product, hc_split, rms_norm) (process-wide).
static HCP: AtomicU8 = AtomicU8::new(0);

/// Whether the prefill HC pre runs (`DS4_GPU_HCP=off` or `0` turns it off; read once, or
/// [`GpuBackend::set_hcp`]); only with the fused glue on.
fn hcp_on() -> bool {
    env_code(&HCP, "DS4_GPU_HCP", on_unless_off) == 1 && fuse_on()
}

/// The prefill HC pre's mixer partials on tensor cores (`hcp_mix_tc`): 0 not yet read from
/// `DS4_GPU_HCP_TC`, 1 on (the default where it applies: CUDA sm_80+, N = 4, an F16 or BF16
/// mixer, D a multiple of 16), 2 off (`hcp_mix`), 11..=26: on, aiming at code - 10 CTAs per SM
/// (`DS4_GPU_HCP_TC=1..16`; on: HT_CTAS_PER_SM) (process-wide).
static HCP_TC: AtomicU8 = AtomicU8::new(0);

/// `off`/`0`: 2; a number 1..=16 of CTAs per SM: 10 + it; anything else (or unset): 1.
fn hcp_tc_parse(v: Option<&str>) -> u8 {
    match v {
        Some("off") | Some("0") => 2,
        Some(k) => match k.parse::<u8>() {
            Ok(k @ 1..=16) => 10 + k,
            _ => 1,
        },
        None => 1,
    }
}

/// CTAs per SM hcp_mix_tc's splits aim at, or None: hcp_mix (`DS4_GPU_HCP_TC=off`).
fn hcp_tc_ctas() -> Option<usize> {
    match env_code(&HCP_TC, "DS4_GPU_HCP_TC", hcp_tc_parse) {
        2 => None,
        c if c > 10 => Some((c - 10) as usize),
        _ => Some(HT_CTAS_PER_SM),
    }
}

/// The HC post inside the prefill's tensor-core mix (`hcp_post_mix_tc`): 0 not yet read from
/// `DS4_GPU_HCP_POST`, 1 on (default), 2 off (hc_post_fast, then hcp_mix_tc) (process-wide).
static HCP_POST: AtomicU8 = AtomicU8::new(0);

fn hcp_post_on() -> bool {
    env_code(&HCP_POST, "DS4_GPU_HCP_POST", on_unless_off) == 1
}

/// hcp_post_mix_tc held to 128 registers (`hcp_post_mix_tc4`: 4 CTAs an SM, the occupancy the
/// splits aim at, against 3 at ptxas's 157; the same code, so the same bits): 0 not yet read
/// from `DS4_GPU_HCP_LB`, 1 on (default), 2 off (process-wide).
static HCP_LB: AtomicU8 = AtomicU8::new(0);
/// hcp_post_mix_tc4 launches so far, process-wide ([`GpuBackend::hcp_lb_launches`]).
static HCP_LB_RUNS: AtomicU64 = AtomicU64::new(0);

fn hcp_lb_on() -> bool {
    env_code(&HCP_LB, "DS4_GPU_HCP_LB", on_unless_off) == 1
}

/// hcp_post_mix_tc4 with X and o loaded by 256-byte L2 fetches (`hcp_post_mix_tc4p`, the same
/// bits): 0 not yet read from `DS4_GPU_HCP_PF`, 1 on (default), 2 off (process-wide).
static HCP_PF: AtomicU8 = AtomicU8::new(0);
/// hcp_post_mix_tc4p launches so far, process-wide ([`GpuBackend::hcp_pf_launches`]).
static HCP_PF_RUNS: AtomicU64 = AtomicU64::new(0);

fn hcp_pf_on() -> bool {
    env_code(&HCP_PF, "DS4_GPU_HCP_PF", on_unless_off) == 1
}

/// hcp_finish with z kept in registers until its rms scale is known (fused.cu fu_finish_keep:
/// written once, the same bits): 0 not yet read from `DS4_GPU_HCP_KEEP`, 1 on (default), 2 off
/// (process-wide).
static HCP_KEEP: AtomicU8 = AtomicU8::new(0);

fn hcp_keep_on() -> bool {
    env_code(&HCP_KEEP, "DS4_GPU_HCP_KEEP", on_unless_off) == 1
}

/// hcp_mix_tc launches so far, process-wide ([`GpuBackend::hcp_tc_launches`]).
static HCP_TC_RUNS: AtomicU64 = AtomicU64::new(0);

/// Tokens of a `hcp_mix_tc` CTA (HT_W warps of 16 in fused.cu) and the CTAs per SM its splits
/// aim at by default.
const HT_TOKENS: usize = 64;
const HT_CTAS_PER_SM: usize = 4;

/// Threads of a `hcp_mix` CTA (`HP_T` in fused.cu), its lanes a token (`HP_L`) and float4
/// columns of a staged mixer chunk (`HP_QC`); CTAs per SM its splits aim at (H200, n 2048:
/// 148 us a call at 2 against 217 at 1 and 159 at 4).
const HP_T: usize = 256;
const HP_L: usize = 2;
const HP_QC: usize = 16;
const HP_CTAS_PER_SM: usize = 2;

/// Threads of a fused HC pre CTA (`DS4_GPU_FUSE_THREADS`, default 256, read once): a split
/// takes that many float4 columns of the N·D row (post + pre: that many / N of each stream);
/// the epilogue's collapse runs on all warps but one (which runs the Sinkhorn).
fn fuse_threads(warp: usize) -> usize {
    static T: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let t = *T.get_or_init(|| {
        std::env::var("DS4_GPU_FUSE_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256)
    });
    t.next_multiple_of(warp).clamp(2 * warp, 1024)
}

/// Whether the HC post is fused with the next HC pre (`DS4_GPU_FUSE=nopost`: the other fusions
/// only).
fn fuse_post() -> bool {
    fuse_on() && FUSE.load(Ordering::Relaxed) == 1
}

/// Fused-kernel forms: 0 not yet read from `DS4_GPU_FUSE_FORM`, 1 `v1` (the session-4 kernels:
/// HC splits of 256 float4 columns, norm_rope_f32 staging the row, rmsnorm_f32x4), 2 `lat`
/// (default: `*_l` HC kernels, ~one split CTA per SM, a last-CTA epilogue with a short serial
/// path; norm_rope_g, the row in registers; a warp per short rms_norm row). The session-6 `wide`
/// HC kernels (`*_w`, 11.1 us a call against 8.8 on the H200) are deleted.
static FORM: AtomicU8 = AtomicU8::new(0);

/// The fused-kernel form (`DS4_GPU_FUSE_FORM=v1`, else lat), read once, or
/// [`GpuBackend::set_fuse_form`].
fn fuse_form() -> u8 {
    env_code(&FORM, "DS4_GPU_FUSE_FORM", |v| {
        if v == Some("v1") {
            1
        } else {
            2
        }
    })
}

/// Whether the wide-split forms run (lat; `DS4_GPU_FUSE_FORM=v1` turns them off).
fn fuse_wide() -> bool {
    fuse_form() >= 2
}

/// Threads of a wide HC CTA (`FW_T` in fused.cu) and float4 columns of z per epilogue thread
/// (`FW_ZR`).
const FW_T: usize = 256;
const FW_ZR: usize = 8;
/// float4 columns per lane of the warp-per-row rmsnorm_f32w.
const ROW_K: usize = 8;
/// float4 columns per thread of norm_rope_g (`NG_K`).
const NG_K: usize = 4;

/// The HC post's inputs (o, post, comb) of a fused hc_post_pre_norm.
type PostIn = (DevPtr, DevPtr, DevPtr);

/// The kernel [`GpuBackend::op_norm_rope`] takes for a row set: the separate ops, norm_rope_g
/// (the row in registers) or norm_rope_f32 (staged), with the CTA's threads.
#[derive(Clone, Copy)]
enum NormRopeForm {
    Composed,
    Regs(usize),
    Staged(usize),
}

/// norm_rope_pair: 0 not yet read from `DS4_GPU_NRPAIR`, 1 on (default: one norm_rope_pair_g
/// launch where both row sets take norm_rope_g), 2 off (two launches) (process-wide).
static NRPAIR: AtomicU8 = AtomicU8::new(0);

/// Whether norm_rope_pair fuses its two launches (`DS4_GPU_NRPAIR=off` or `0` turns it off;
/// read once).
fn nrpair_on() -> bool {
    env_code(&NRPAIR, "DS4_GPU_NRPAIR", on_unless_off) == 1
}

/// norm_rope_pair_g's form: 0 not yet read from `DS4_GPU_NRLATE`, 1 late (`norm_rope_pair_gl`:
/// the weights and the RoPE (sin, cos) before the PDL wait, then the rows; same bits; chunks of
/// at most `NRLATE_MAX_N` tokens), 2 the kernel that waits first (`norm_rope_pair_g`, the
/// default) (process-wide). Opt-in: on the H200 (bench/results/gpu-a119-h200.txt) decode was
/// within noise, and a 2k prefill with it at every chunk ~1.3% slower (its 131k early CTAs).
static NRLATE: AtomicU8 = AtomicU8::new(0);
/// Most tokens a chunk may have for `norm_rope_pair_gl` (decode steps).
const NRLATE_MAX_N: usize = 8;

/// Whether norm_rope_pair takes `norm_rope_pair_gl` (`DS4_GPU_NRLATE=on` or `1`; read once, or
/// [`GpuBackend::set_nrlate`]).
fn nrlate_on() -> bool {
    env_code(&NRLATE, "DS4_GPU_NRLATE", |v| {
        if matches!(v, Some("on") | Some("1")) {
            1
        } else {
            2
        }
    }) == 1
}

/// norm_rope_pair's prefill form: 0 not yet read from `DS4_GPU_NRW`, 1 on (default: the
/// warp-a-row `norm_rope_pair_w` at n > FUSE_HC_MAX_N tokens where norm_rope_pair_g would run
/// and a warp holds the row, NW_K float4 a lane), 2 off (`norm_rope_pair_g`, a CTA a row)
/// (process-wide). Both give the same bits.
static NRW: AtomicU8 = AtomicU8::new(0);

/// Whether the prefill norm_rope_pair takes `norm_rope_pair_w` (`DS4_GPU_NRW=off` or `0`, or
/// [`GpuBackend::set_nrw`], turns it off; read once).
fn nrw_on() -> bool {
    env_code(&NRW, "DS4_GPU_NRW", on_unless_off) == 1
}

/// float4 columns a lane (`NW_K`) and rows a warp (`NW_R`) of norm_rope_pair_w.
const NW_K: usize = 4;
const NW_R: usize = 2;

/// norm_rope_pair_w launches so far, process-wide ([`GpuBackend::nrw_launches`]).
static NRW_RUNS: AtomicU64 = AtomicU64::new(0);

/// matmul_route: 0 not yet read from `DS4_GPU_ROUTE`, 3 `on` (default; `rank` too: the router's
/// product and the route in one `mvq_route_f16r` launch at n = 1, the bias loaded before the PDL
/// wait, the last CTA's top k by ranks), 1 `rounds` (the previous form, `mvq_route_f16`: the top
/// k in k rounds of a warp max), 2 off (two launches) (process-wide). The same bits in all three.
/// H200: matvec_bench f2 (router after an rms_norm, graph us) on 6.63, rounds 7.73, off 8.45;
/// 2k decode +1.5..2% (bench/results/gpu-f220-h200.txt).
static ROUTE: AtomicU8 = AtomicU8::new(0);

fn route_code() -> u8 {
    env_code(&ROUTE, "DS4_GPU_ROUTE", |v| match v {
        Some("rounds") => 1,
        Some("off") | Some("0") => 2,
        _ => 3,
    })
}

/// Whether matmul_route fuses its two launches (`DS4_GPU_ROUTE=off` or `0` turns it off; read
/// once, or [`GpuBackend::set_route_form`]).
fn route_on() -> bool {
    route_code() != 2
}

/// `mvq_route_f16` launches so far, process-wide ([`GpuBackend::route_fused_launches`]).
static ROUTE_RUNS: AtomicU64 = AtomicU64::new(0);

/// `mvq_route_f16`'s arrival counter in `GpuBackend::tickets` (two words past decode attention's
/// barrier word; the word between is spare).
pub(crate) const ROUTE_TICKET: usize = super::attn::AO_TICKET + 2;
const _: () = assert!(ROUTE_TICKET < super::TICKET_WORDS);

/// float4 loads are safe at this address.
fn al16(p: DevPtr) -> bool {
    p.0.is_multiple_of(16)
}

impl GpuBackend {
    /// Use the simple glue kernels (true) or the default (fast) forms (false). Process-wide.
    pub fn set_mix_simple(on: bool) {
        Self::set_mix_form(if on { "simple" } else { "fast" });
    }

    /// Fused router launches (`mvq_route_f16`: Backend::matmul_route at n = 1) by every backend
    /// of the process so far; tests check with it that the fused form ran.
    pub fn route_fused_launches() -> u64 {
        ROUTE_RUNS.load(Ordering::Relaxed)
    }

    /// Select the matmul_route form by its `DS4_GPU_ROUTE` name: "on" (the default, top k by
    /// ranks), "rounds" (the previous fused form) or "off" (overrides the variable).
    /// Process-wide; for tests.
    pub fn set_route_form(form: &str) {
        set_code(&ROUTE, "set_route_form", form, &["rounds", "off", "on"]);
    }

    /// Select norm_rope_pair's kernel by its `DS4_GPU_NRLATE` name: "on" (`norm_rope_pair_gl`,
    /// the PDL wait after the weights and the RoPE table) or "off" (`norm_rope_pair_g`, the
    /// default) (overrides the variable). Process-wide; for tests.
    pub fn set_nrlate(form: &str) {
        set_code(&NRLATE, "set_nrlate", form, &["on", "off"]);
    }

    /// Select norm_rope_pair's prefill form by its `DS4_GPU_NRW` name: "on" (the default:
    /// norm_rope_pair_w, a warp a row) or "off" (norm_rope_pair_g, a CTA a row) (overrides the
    /// variable). Process-wide; for tests and A/B benchmarks.
    pub fn set_nrw(form: &str) {
        set_code(&NRW, "set_nrw", form, &["on", "off"]);
    }

    /// norm_rope_pair_w launches by every backend of the process so far (tests check with it
    /// that the warp form ran).
    pub fn nrw_launches() -> u64 {
        NRW_RUNS.load(Ordering::Relaxed)
    }

    /// Select the prefill HC pre's mixer partials by their `DS4_GPU_HCP_TC` name: "on" (the
    /// default: `hcp_mix_tc` where it applies) or "off" (`hcp_mix`) (overrides the variable).
    /// Process-wide; for tests and A/B benchmarks.
    pub fn set_hcp_tc(form: &str) {
        set_code(&HCP_TC, "set_hcp_tc", form, &["on", "off"]);
    }

    /// hcp_post_mix_tc's register-bounded form (`hcp_post_mix_tc4`) by its `DS4_GPU_HCP_LB`
    /// name: "on" (the default) or "off". Process-wide; for tests and A/B.
    pub fn set_hcp_lb(form: &str) {
        set_code(&HCP_LB, "set_hcp_lb", form, &["on", "off"]);
    }

    /// `hcp_post_mix_tc4` launches so far in this process.
    pub fn hcp_lb_launches() -> u64 {
        HCP_LB_RUNS.load(Ordering::Relaxed)
    }

    /// The L2-fetching form of `hcp_post_mix_tc4` (`hcp_post_mix_tc4p`) by its `DS4_GPU_HCP_PF`
    /// name: "on" (the default) or "off". Process-wide; for tests and A/B.
    pub fn set_hcp_pf(form: &str) {
        set_code(&HCP_PF, "set_hcp_pf", form, &["on", "off"]);
    }

    /// `hcp_post_mix_tc4p` launches so far in this process.
    pub fn hcp_pf_launches() -> u64 {
        HCP_PF_RUNS.load(Ordering::Relaxed)
    }

    /// hcp_finish's one-pass z (`DS4_GPU_HCP_KEEP`): "on" (the default) or "off" (z written,
    /// read back and written normalised). Process-wide; for tests and A/B.
    pub fn set_hcp_keep(form: &str) {
        set_code(&HCP_KEEP, "set_hcp_keep", form, &["on", "off"]);
    }

    /// hcp_mix_tc aiming at `ctas` CTAs per SM (1..=16; 0: off, hcp_mix), as
    /// `DS4_GPU_HCP_TC=ctas` (overrides the variable). Process-wide; for benchmarks.
    pub fn set_hcp_tc_ctas(ctas: usize) {
        let c = if ctas == 0 {
            2
        } else {
            10 + ctas.min(16) as u8
        };
        HCP_TC.store(c, Ordering::Relaxed);
    }

    /// The HC post inside the prefill's tensor-core mix by its `DS4_GPU_HCP_POST` name: "on"
    /// (the default) or "off" (overrides the variable). Process-wide; for tests and A/B.
    pub fn set_hcp_post(form: &str) {
        set_code(&HCP_POST, "set_hcp_post", form, &["on", "off"]);
    }

    /// hcp_mix_tc and hcp_post_mix_tc launches by every backend of the process so far (tests check with it which
    /// form ran).
    pub fn hcp_tc_launches() -> u64 {
        HCP_TC_RUNS.load(Ordering::Relaxed)
    }

    /// Select the glue kernel form by its `DS4_GPU_MIX` name: "fast" (the default), "glue" or
    /// "simple" (overrides the variable). Process-wide; for tests and benchmarks of every form.
    pub fn set_mix_form(form: &str) {
        set_code(&MODE, "set_mix_form", form, &["glue", "simple", "fast"]);
    }

    /// Select the fused glue by its `DS4_GPU_FUSE` name: "on" (the default), "off" (the
    /// separate ops) or "nopost" (the HC post unfused). Process-wide; for tests and benchmarks.
    pub fn set_fuse(form: &str) {
        set_code(&FUSE, "set_fuse", form, &["on", "off", "nopost"]);
    }

    /// Select the prefill HC pre (n > 4 tokens) by its `DS4_GPU_HCP` name: "on" (the default:
    /// `hcp_mix` + `hcp_finish`) or "off" (the composed ops). Process-wide; for tests and A/B
    /// benchmarks.
    pub fn set_hcp(form: &str) {
        set_code(&HCP, "set_hcp", form, &["on", "off"]);
    }

    /// Select the fused kernels' form by its `DS4_GPU_FUSE_FORM` name: "lat" (the default) or
    /// "v1". Process-wide; for tests and A/B benchmarks.
    pub fn set_fuse_form(form: &str) {
        set_code(&FORM, "set_fuse_form", form, &["v1", "lat"]);
    }

    /// HC pre + the sublayer norm. Fused at decode (n <= 4, N <= 4): one launch of n·S CTAs;
    /// CTA (t, s) takes split s of token t's N·D row for the (2+N)·N mixer dot products and
    /// Σx², and the token's last CTA to arrive (atomic ticket) scales them by the RMS, runs
    /// split + Sinkhorn, collapses z and RMS-normalises it. Prefill (n > 4): the same outputs
    /// in two launches (`hc_prefill`; `DS4_GPU_HCP=off`: the separate ops). Else
    /// the separate ops.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_pre_norm(
        &self,
        hc: HcDims,
        mixer: &GpuWeight,
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let fused = al16(x.ptr) && al16(z.ptr) && (1..=FUSE_HC_MAX_N).contains(&n);
        let prefill = al16(x.ptr) && al16(z.ptr) && n > FUSE_HC_MAX_N && hcp_on();
        if let Some(w) = prefill.then(|| self.hc_fusable(&hc, mixer, norm)).flatten() {
            self.hc_prefill(
                &hc, x.ptr, None, w, scale, base, norm, n, eps, z, post, comb,
            );
            return;
        }
        let Some((wp, code, rb)) = fused.then(|| self.hc_fusable(&hc, mixer, norm)).flatten()
        else {
            return ds4_backend::hc_pre_norm_composed(
                self, hc, mixer, scale, base, norm, x, n, eps, z, post, comb,
            );
        };
        self.hc_fused(
            &hc,
            x.ptr,
            None,
            (wp, code, rb),
            scale,
            base,
            norm,
            n,
            eps,
            z,
            post,
            comb,
        );
    }

    /// Whether the fused HC kernels take these shapes (N <= 4, D % 4 == 0, an F32/F16/BF16
    /// mixer of (2+N)·N rows of N·D, an aligned f32 norm) and the glue is fused: the mixer's
    /// (pointer, type code, row bytes).
    fn hc_fusable(
        &self,
        hc: &HcDims,
        mixer: &GpuWeight,
        norm: &GpuWeight,
    ) -> Option<(DevPtr, i32, usize)> {
        let (p, ty, cols, rows, rb) = mixer.mat_parts()?;
        let (code, align) = match ty {
            GgmlType::F32 => (0, 16u64),
            GgmlType::F16 => (1, 8),
            GgmlType::BF16 => (2, 8),
            _ => return None,
        };
        let norm_ok =
            matches!(norm, GpuWeight::F32 { len, .. } if *len >= hc.d) && al16(norm.ptr());
        let ok = fuse_on()
            && (1..=4).contains(&hc.n)
            && hc.d > 0
            && hc.d.is_multiple_of(4)
            && cols == hc.n * hc.d
            && rows >= (2 + hc.n) * hc.n
            && p.0.is_multiple_of(align)
            && (rb as u64).is_multiple_of(align)
            && norm_ok;
        ok.then_some((p, code, rb))
    }

    /// HC post + the next HC pre + norm. Fused at decode as [`GpuBackend::op_hc_pre_norm`]: CTA
    /// (t, s) first applies the HC post to its float4 columns of all N streams of x in place
    /// (a thread a (stream, column)), then takes the mixer products of the new values; the last
    /// CTA reads the new x back through L2 for the collapse. Else the separate ops (prefill: the
    /// HC post, then the prefill HC pre).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_post_pre_norm(
        &self,
        hc: HcDims,
        x: &mut GpuBuf,
        o: &GpuBuf,
        post_in: &GpuBuf,
        comb_in: &GpuBuf,
        mixer: &GpuWeight,
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let fused = fuse_post()
            && al16(x.ptr)
            && al16(o.ptr)
            && al16(z.ptr)
            && (1..=FUSE_HC_MAX_N).contains(&n);
        let Some((wp, code, rb)) = fused.then(|| self.hc_fusable(&hc, mixer, norm)).flatten()
        else {
            // Prefill: the post inside the tensor-core mix where that form runs
            // (hcp_post_mix_tc: hc_post_fast's bits), else hc_post_fast before the HC pre.
            let pre = al16(x.ptr) && al16(z.ptr) && al16(o.ptr) && n > FUSE_HC_MAX_N;
            let pre = pre && hcp_on() && hcp_post_on() && !mix_simple() && self.hc_ok(&hc);
            if let Some(w) = pre.then(|| self.hc_fusable(&hc, mixer, norm)).flatten() {
                let pin = Some((o.ptr, post_in.ptr, comb_in.ptr));
                let (x, s, b) = (x.ptr, scale, base);
                if self.hc_prefill(&hc, x, pin, w, s, b, norm, n, eps, z, post, comb) {
                    return;
                }
            }
            self.op_hc_post(hc, x, o, post_in, comb_in, n);
            return self.op_hc_pre_norm(hc, mixer, scale, base, norm, x, n, eps, z, post, comb);
        };
        let pin = Some((o.ptr, post_in.ptr, comb_in.ptr));
        self.hc_fused(
            &hc,
            x.ptr,
            pin,
            (wp, code, rb),
            scale,
            base,
            norm,
            n,
            eps,
            z,
            post,
            comb,
        );
    }

    /// One launch of the fused HC pre + norm (after the HC post when `pin` is given): the
    /// latency kernels (`*_l`: N·D/4 pairs in splits of a warp's lanes, 1024 / (32 / 4) = 128
    /// CTAs a token at D 4096), or, `v1` or shapes they decline, the first ones (256 float4 columns of the N·D row a
    /// split, or 256 / N of each stream with the post). All take the same arguments.
    #[allow(clippy::too_many_arguments)]
    fn hc_fused(
        &self,
        hc: &HcDims,
        x: DevPtr,
        pin: Option<PostIn>,
        (wp, code, rb): (DevPtr, i32, usize),
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        let warp = self.warp() as usize;
        let d4 = hc.d / 4;
        // The epilogue's collapse runs on all warps but two (fused.cu fl_hc).
        let wide = fuse_wide() && hc.n <= warp && d4 <= FW_ZR * (FW_T - 2 * warp);
        let (name, threads, splits) = if wide {
            let cols = warp / hc.n; // float4 columns of d a split
            let name = if pin.is_some() {
                "hc_post_pre_norm_l"
            } else {
                "hc_pre_norm_l"
            };
            (name, FW_T, d4.div_ceil(cols))
        } else {
            let t = fuse_threads(warp);
            match pin {
                Some(_) => ("hc_post_pre_norm_f32", t, d4.div_ceil(t / hc.n)),
                None => (
                    "hc_pre_norm_f32",
                    t,
                    (hc.n * d4).div_ceil(t).clamp(1, FUSE_HC_SPLITS),
                ),
            }
        };
        let part = self.scratch(n * splits * FUSE_PART * 2); // f64 partials
        let mut args = vec![Arg::Ptr(x)];
        if let Some((o, pi, ci)) = pin {
            args.extend([Arg::Ptr(o), Arg::Ptr(pi), Arg::Ptr(ci)]);
        }
        args.extend([
            Arg::Ptr(wp),
            Arg::I64(rb as i64),
            Arg::I32(code),
            Arg::Ptr(scale.ptr()),
            Arg::Ptr(base.ptr()),
            Arg::Ptr(norm.ptr()),
            Arg::Ptr(z.ptr),
            Arg::Ptr(post.ptr),
            Arg::Ptr(comb.ptr),
            Arg::Ptr(part.ptr),
            Arg::Ptr(self.tickets.ptr()),
            Arg::I32(hc.n as i32),
            Arg::I32(hc.d as i32),
            Arg::I32(splits as i32),
            Arg::I32(hc.sinkhorn_iters as i32),
            Arg::F32(hc.eps),
            Arg::F32(eps),
        ]);
        self.run(
            &ds4_kernels::FUSED,
            name,
            LaunchDims::linear((n * splits) as u32, threads as u32),
            &args,
        );
    }

    /// The prefill HC pre + norm, two launches: `hcp_mix` (HP_L lanes a token, HP_T threads a
    /// CTA, S splits of the float4 columns of d: Σx² and the mixer dot products of the raw X with
    /// the mixer staged in shared memory, partials per (token, split)), then `hcp_finish` (a CTA
    /// a token: the partials' sums, the RMS scale, split + Sinkhorn, collapse, rms_norm). S:
    /// about HP_CTAS_PER_SM CTAs per SM, splits of whole staged chunks.
    #[allow(clippy::too_many_arguments)]
    fn hc_prefill(
        &self,
        hc: &HcDims,
        x: DevPtr,
        pin: Option<PostIn>,
        (wp, code, rb): (DevPtr, i32, usize),
        scale: &GpuWeight,
        base: &GpuWeight,
        norm: &GpuWeight,
        n: usize,
        eps: f32,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) -> bool {
        let d4 = hc.d / 4;
        // Tensor cores (hcp_mix_tc): N = 4 (24 mixer rows, 3 mma tiles), a mixer exact in
        // tf32 (F16, BF16), chunks of 4 float4 columns (D % 16 == 0), CUDA sm_80+.
        let info = self.gpu.info();
        let tc = hcp_tc_ctas().filter(|_| {
            info.vendor == crate::runtime::Vendor::Nvidia
                && info.cc.0 >= 8
                && hc.n == 4
                && matches!(code, 1 | 2)
                && d4.is_multiple_of(4)
        });
        // The register-bounded post + mix (hcp_post_mix_tc4): one wave, counted.
        let bounded = tc.is_some() && pin.is_some() && hcp_lb_on();
        // Its form with 256-byte L2 fetches (hcp_post_mix_tc4p), counted.
        let pf = bounded && hcp_pf_on();
        let (name, tok, threads, ctas) = match (tc, pin) {
            (Some(c), None) => ("hcp_mix_tc", HT_TOKENS, 128, c),
            (Some(c), Some(_)) if pf => ("hcp_post_mix_tc4p", HT_TOKENS, 128, c),
            (Some(c), Some(_)) if bounded => ("hcp_post_mix_tc4", HT_TOKENS, 128, c),
            (Some(c), Some(_)) => ("hcp_post_mix_tc", HT_TOKENS, 128, c),
            (None, None) => ("hcp_mix", HP_T / HP_L, HP_T, HP_CTAS_PER_SM),
            (None, Some(_)) => return false, // the caller runs the post first
        };
        let tiles = n.div_ceil(tok);
        // Splits per token tile. hcp_post_mix_tc4 takes at most one wave of `ctas` CTAs an SM
        // (tiles · splits <= ctas · SMs: a 6144-row prompt step as 96 tiles x 6 splits was 1.09
        // waves, its last 48 CTAs alone on the device); the other forms round up, as measured.
        let slots = ctas * info.sm_count as usize;
        let want = if bounded {
            slots / tiles
        } else {
            slots.div_ceil(tiles)
        }
        .clamp(1, 64);
        let per = d4.div_ceil(want).next_multiple_of(HP_QC).min(d4);
        let splits = d4.div_ceil(per);
        let part = self.scratch(n * splits * FUSE_PART * 2); // f64 partials
        if tc.is_some() {
            HCP_TC_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        if bounded {
            HCP_LB_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        if pf {
            HCP_PF_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        let post_args = pin.map(|(o, p, c)| [Arg::Ptr(o), Arg::Ptr(p), Arg::Ptr(c)]);
        let args: Vec<Arg> = [Arg::Ptr(x)]
            .into_iter()
            .chain(post_args.into_iter().flatten())
            .chain([
                Arg::Ptr(wp),
                Arg::I64(rb as i64),
                Arg::I32(code),
                Arg::Ptr(part.ptr),
                Arg::I32(n as i32),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I32(splits as i32),
                Arg::I32(per as i32),
            ])
            .collect();
        self.run(
            &ds4_kernels::FUSED,
            name,
            LaunchDims::linear((tiles * splits) as u32, threads as u32),
            &args,
        );
        self.run(
            &ds4_kernels::FUSED,
            "hcp_finish",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(x),
                Arg::Ptr(part.ptr),
                Arg::Ptr(scale.ptr()),
                Arg::Ptr(base.ptr()),
                Arg::Ptr(norm.ptr()),
                Arg::Ptr(z.ptr),
                Arg::Ptr(post.ptr),
                Arg::Ptr(comb.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I32(splits as i32),
                Arg::I32(hc.sinkhorn_iters as i32),
                Arg::F32(hc.eps),
                Arg::F32(eps),
                Arg::I32(hcp_keep_on() as i32),
            ],
        );
        true
    }

    /// Threads of a norm_rope_g CTA for rows of `width` in `x` (weight `w`, rounding `r`), or
    /// None where [`Self::op_norm_rope`] takes another form (Hadamard/FP4 rounding,
    /// `DS4_GPU_FUSE=off`: the separate ops; `DS4_GPU_FUSE_FORM=v1`, rows past NG_K·256 float4
    /// or unaligned ones: norm_rope_f32).
    fn norm_rope_form(
        &self,
        x: &GpuBuf,
        width: usize,
        w: Option<&GpuWeight>,
        n_rot: usize,
        r: RowRounding,
    ) -> NormRopeForm {
        let w_ok = w.is_none_or(|w| matches!(w, GpuWeight::F32 { len, .. } if *len >= width));
        let fused = fuse_on()
            && w_ok
            && !r.fp4_hadamard
            && r.fp8_nope <= width
            && n_rot <= width
            && n_rot.is_multiple_of(2)
            && width > 0
            && width <= 12288;
        if !fused {
            return NormRopeForm::Composed;
        }
        let warp = self.warp() as usize;
        // norm_rope_g (wide and grid forms): the row in registers, NG_K float4 a thread of up
        // to 256 (H200 decode: 4.4 us a call against 6.6 for norm_rope_f32, which stages it).
        let threads = (width / 4).next_multiple_of(warp).clamp(warp, 256);
        let in_regs = fuse_wide()
            && width.is_multiple_of(4)
            && width / 4 <= NG_K * threads
            && al16(x.ptr)
            && w.is_none_or(|w| al16(w.ptr()));
        if in_regs {
            NormRopeForm::Regs(threads)
        } else {
            NormRopeForm::Staged(threads)
        }
    }

    /// RMSNorm + RoPE (+ FP8/f16 rounding) in one launch, one CTA per row (the RoPE angles
    /// computed while the row loads); Hadamard/FP4 rounding and `DS4_GPU_FUSE=off` take the
    /// separate ops.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_norm_rope(
        &self,
        x: &mut GpuBuf,
        n: usize,
        heads: usize,
        width: usize,
        w: Option<&GpuWeight>,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        round: Option<RowRounding>,
    ) {
        let r = round.unwrap_or_default();
        let (name, threads) = match self.norm_rope_form(x, width, w, n_rot, r) {
            NormRopeForm::Composed => {
                return ds4_backend::norm_rope_composed(
                    self, x, n, heads, width, w, eps, n_rot, t0, kind, round,
                )
            }
            NormRopeForm::Regs(t) => ("norm_rope_g", t),
            NormRopeForm::Staged(t) => ("norm_rope_f32", t),
        };
        let rows = n * heads;
        if rows == 0 {
            return;
        }
        // Decode: the position from the step block (mod.rs `step_pos`), the argument 0.
        let sp = self.step_pos(t0, n);
        let args = [
            Arg::Ptr(x.ptr),
            w.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
            Arg::Ptr(self.rope_ptr(kind)),
            Arg::I32(heads as i32),
            Arg::I32(width as i32),
            Arg::I32(n_rot as i32),
            Arg::I64(if sp.is_some() { 0 } else { t0 as i64 }),
            Arg::F32(eps),
            Arg::I32(r.fp8_nope as i32),
            Arg::I32(r.f16 as i32),
            sp.map_or(Arg::Null, Arg::Ptr),
        ];
        let mut dims = LaunchDims::linear(rows as u32, threads as u32);
        dims.shared_bytes = if name == "norm_rope_g" {
            (n_rot / 2 * 8) as u32 // (sin, cos) per pair
        } else {
            (width * 4) as u32 // the staged row
        };
        self.run(&ds4_kernels::FUSED, name, dims, &args);
    }

    /// Two norm_ropes of one width, RoPE and positions (the attention's query heads and KV
    /// row) in one norm_rope_pair_g launch when both take norm_rope_g (bit-identical to the
    /// two launches; decode saves a launch and a single-CTA latency chain a layer), else the
    /// two calls. `DS4_GPU_NRPAIR=off`: always the two calls.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_norm_rope_pair(
        &self,
        a: &mut GpuBuf,
        heads_a: usize,
        w_a: Option<&GpuWeight>,
        round_a: Option<RowRounding>,
        b: &mut GpuBuf,
        heads_b: usize,
        w_b: Option<&GpuWeight>,
        round_b: Option<RowRounding>,
        n: usize,
        width: usize,
        eps: f32,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
    ) {
        let (ra, rb) = (round_a.unwrap_or_default(), round_b.unwrap_or_default());
        let (rows_a, rows_b) = (n * heads_a, n * heads_b);
        let form_a = self.norm_rope_form(a, width, w_a, n_rot, ra);
        let form_b = self.norm_rope_form(b, width, w_b, n_rot, rb);
        let threads = match (form_a, form_b) {
            (NormRopeForm::Regs(t), NormRopeForm::Regs(_)) => t, // same width: same threads
            _ => 0,
        };
        if !nrpair_on()
            || threads == 0
            || rows_a == 0
            || rows_b == 0
            || rows_a + rows_b > i32::MAX as usize
        {
            self.op_norm_rope(a, n, heads_a, width, w_a, eps, n_rot, t0, kind, round_a);
            self.op_norm_rope(b, n, heads_b, width, w_b, eps, n_rot, t0, kind, round_b);
            return;
        }
        // Decode: the position from the step block (mod.rs `step_pos`), the argument 0.
        let sp = self.step_pos(t0, n);
        let args = [
            Arg::Ptr(a.ptr),
            w_a.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
            Arg::I32(heads_a as i32),
            Arg::I32(ra.fp8_nope as i32),
            Arg::I32(ra.f16 as i32),
            Arg::I32(rows_a as i32),
            Arg::Ptr(b.ptr),
            w_b.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
            Arg::I32(heads_b as i32),
            Arg::I32(rb.fp8_nope as i32),
            Arg::I32(rb.f16 as i32),
            Arg::Ptr(self.rope_ptr(kind)),
            Arg::I32(width as i32),
            Arg::I32(n_rot as i32),
            Arg::I64(if sp.is_some() { 0 } else { t0 as i64 }),
            Arg::F32(eps),
            sp.map_or(Arg::Null, Arg::Ptr),
        ];
        // Prefill: a warp a row where one warp holds it (the same bits; widths past one float4
        // a thread of the CTA form would sum Σx² in another order, so they stay there).
        let warp = self.warp() as usize;
        if nrw_on() && n > FUSE_HC_MAX_N && width.is_multiple_of(4) && width / 4 <= NW_K * warp {
            let rows = rows_a + rows_b;
            let per_cta = 256 / warp * NW_R; // rows a CTA of 256
            let mut args = args.to_vec();
            args.push(Arg::I32(rows as i32));
            let dims = LaunchDims::linear(rows.div_ceil(per_cta) as u32, 256);
            self.run(&ds4_kernels::FUSED, "norm_rope_pair_w", dims, &args);
            NRW_RUNS.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut dims = LaunchDims::linear((rows_a + rows_b) as u32, threads as u32);
        dims.shared_bytes = (n_rot / 2 * 8) as u32; // (sin, cos) per pair
        let name = if n <= NRLATE_MAX_N && nrlate_on() {
            "norm_rope_pair_gl"
        } else {
            "norm_rope_pair_g"
        };
        self.run(&ds4_kernels::FUSED, name, dims, &args);
    }

    fn invalid(&self, msg: &str) {
        self.note::<()>(Err(GpuError::Invalid(msg.to_string())));
    }

    /// `out[(i·copies + c)·d ..]` = row `tokens[i]` of the table, dequantised (F32, F16, BF16,
    /// Q8_0), one CTA per token.
    pub(crate) fn op_embed(
        &self,
        table: &GpuWeight,
        tokens: &GpuIBuf,
        n: usize,
        copies: usize,
        d: usize,
        out: &mut GpuBuf,
    ) {
        let GpuWeight::Mat {
            buf,
            ty,
            cols,
            row_bytes,
            ..
        } = table
        else {
            return self.invalid("embed: the table must be a matrix weight");
        };
        if !table.blocks() {
            return self.invalid("embed: the table is held in the decode layout only");
        }
        let code = match ty {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 3,
            _ => return self.invalid(&format!("embed: unsupported table type {ty:?}")),
        };
        if d > *cols {
            return self.invalid(&format!("embed: width {d} > table columns {cols}"));
        }
        if n == 0 || copies == 0 || d == 0 {
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "embed_rows",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(buf.ptr()),
                Arg::Ptr(tokens.0.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(copies as i32),
                Arg::I32(d as i32),
                Arg::I64(*row_bytes as i64),
                Arg::I32(code),
            ],
        );
    }

    pub(crate) fn op_add(&self, y: &mut GpuBuf, x: &GpuBuf, len: usize) {
        let blocks = len.div_ceil(256).max(1) as u32;
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "add_f32",
            LaunchDims::linear(blocks, 256),
            &[
                Arg::Ptr(y.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(y.ptr),
                Arg::I64(len as i64),
            ],
        );
    }

    pub(crate) fn op_rms_norm(
        &self,
        x: &mut GpuBuf,
        rows: usize,
        width: usize,
        w: Option<&GpuWeight>,
        eps: f32,
    ) {
        if rows == 0 {
            return;
        }
        let fast = !mix_simple()
            && width.is_multiple_of(4)
            && width <= NORM_X4_MAX
            && al16(x.ptr)
            && w.is_none_or(|w| al16(w.ptr()));
        // x4: one float4 per thread up to 1024 threads (a 16384 row: 4 each), whole warps.
        let warp = self.warp() as usize;
        if fast && fuse_wide() && width / 4 <= ROW_K * warp {
            // Short rows (the 1024-wide query norm): a warp per row, 4 rows a CTA when many.
            let wpb = if rows >= 256 { 4 } else { 1 };
            self.run(
                &ds4_kernels::ELEMENTWISE,
                "rmsnorm_f32w",
                LaunchDims::linear(rows.div_ceil(wpb) as u32, (wpb * warp) as u32),
                &[
                    Arg::Ptr(x.ptr),
                    w.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
                    Arg::Ptr(x.ptr),
                    Arg::I32(width as i32),
                    Arg::F32(eps),
                    Arg::I32(rows as i32),
                ],
            );
            return;
        }
        let (name, threads) = if fast && mix_glue() {
            // Two float4 per thread (four past 2048 float4): fewer warp partials to add.
            let per = if width / 4 <= 2048 { 2 } else { 4 };
            (
                "rmsnorm_f32g",
                (width / 4)
                    .div_ceil(per)
                    .next_multiple_of(warp)
                    .clamp(warp, 1024),
            )
        } else if fast {
            (
                "rmsnorm_f32x4",
                (width / 4).next_multiple_of(warp).clamp(warp, 1024),
            )
        } else {
            ("rmsnorm_f32", 256)
        };
        self.run(
            &ds4_kernels::ELEMENTWISE,
            name,
            LaunchDims::linear(rows as u32, threads as u32),
            &[
                Arg::Ptr(x.ptr),
                w.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
                Arg::Ptr(x.ptr),
                Arg::I32(width as i32),
                Arg::F32(eps),
            ],
        );
    }

    pub(crate) fn op_swiglu(&self, g: &mut GpuBuf, u: &GpuBuf, len: usize, clamp: f32) {
        let blocks = len.div_ceil(256).max(1) as u32;
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "swiglu_f32",
            LaunchDims::linear(blocks, 256),
            &[
                Arg::Ptr(g.ptr),
                Arg::Ptr(u.ptr),
                Arg::Ptr(g.ptr),
                Arg::F32(clamp),
                Arg::F32(1.0),
                Arg::I64(len as i64),
            ],
        );
    }

    /// HC pre: simple form one CTA per token (Sinkhorn on N threads, the collapse over D); fast
    /// form column CTAs plus one warp per token for the Sinkhorn, concurrently.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_split(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        if !self.hc_ok(&hc) || n == 0 {
            return;
        }
        let cols_ok = hc.d.is_multiple_of(4) && al16(x.ptr) && al16(z.ptr);
        if mix_glue() && hc.n <= 4 && cols_ok {
            // ceil(n / w) Sinkhorn CTAs (a thread a token), then n·cc column CTAs of w threads.
            let w = glue_cols(n, hc.d);
            let cc = (hc.d / 4).div_ceil(w);
            let sink = n.div_ceil(w);
            self.run(
                &ds4_kernels::MODEL,
                "hc_split_glue",
                LaunchDims::linear((sink + n * cc) as u32, w as u32),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(z.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I32(hc.sinkhorn_iters as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(n as i32),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        if !mix_simple() && cols_ok {
            // The Sinkhorn CTAs (a warp a token), then n·cc column CTAs (256 float4 columns each).
            let cc = (hc.d / 4).div_ceil(256);
            let sink = n.div_ceil(256 / self.warp() as usize);
            self.run(
                &ds4_kernels::MODEL,
                "hc_split_fast",
                LaunchDims::linear((sink + n * cc) as u32, 256),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(z.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I32(hc.sinkhorn_iters as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(n as i32),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_split",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(m.ptr),
                Arg::Ptr(scale.ptr()),
                Arg::Ptr(base.ptr()),
                Arg::Ptr(x.ptr),
                Arg::Ptr(z.ptr),
                Arg::Ptr(post.ptr),
                Arg::Ptr(comb.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I32(hc.sinkhorn_iters as i32),
                Arg::F32(hc.eps),
            ],
        );
    }

    /// Head collapse: one CTA per token (simple), or CTAs of 256 float4 columns (fast).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_collapse(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        if !self.hc_ok(&hc) || n == 0 {
            return;
        }
        if !mix_simple() && hc.d > 0 && hc.d.is_multiple_of(4) && al16(x.ptr) && al16(y.ptr) {
            // CTAs per token, `w` float4 columns each (the kernel reads blockDim).
            let w = if mix_glue() { glue_cols(n, hc.d) } else { 256 };
            let cc = (hc.d / 4).div_ceil(w);
            self.run(
                &ds4_kernels::MODEL,
                "hc_collapse_fast",
                LaunchDims::linear((n * cc) as u32, w as u32),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(y.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_collapse",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(m.ptr),
                Arg::Ptr(scale.ptr()),
                Arg::Ptr(base.ptr()),
                Arg::Ptr(x.ptr),
                Arg::Ptr(y.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::F32(hc.eps),
            ],
        );
    }

    /// HC post in place on `x` (`[n, N, D]`), one thread per (token, column).
    pub(crate) fn op_hc_post(
        &self,
        hc: HcDims,
        x: &mut GpuBuf,
        o: &GpuBuf,
        post: &GpuBuf,
        comb: &GpuBuf,
        n: usize,
    ) {
        let total = n * hc.d;
        if !self.hc_ok(&hc) || total == 0 {
            return;
        }
        if !mix_simple() && hc.n <= 4 && hc.d.is_multiple_of(4) && al16(x.ptr) && al16(o.ptr) {
            let total4 = total / 4; // one thread per float4 column
            let w = if mix_glue() { glue_cols(n, hc.d) } else { 256 };
            self.run(
                &ds4_kernels::MODEL,
                "hc_post_fast",
                LaunchDims::linear(total4.div_ceil(w) as u32, w as u32),
                &[
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(o.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I64(total4 as i64),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_post",
            LaunchDims::linear(total.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(o.ptr),
                Arg::Ptr(post.ptr),
                Arg::Ptr(comb.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I64(total as i64),
            ],
        );
    }

    /// Router, one CTA per token (fast form: top-k by warp 0): hash table (`tid2eid`, an I32 table) or biased top-k.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_moe_route(
        &self,
        spec: &MoeSpec,
        logits: &GpuBuf,
        bias: Option<&GpuWeight>,
        tid2eid: Option<&GpuWeight>,
        tokens: &GpuIBuf,
        n: usize,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
    ) {
        let (ne, k) = (spec.n_expert, spec.n_used);
        if ne > ROUTE_MAX_E || k > ROUTE_MAX_K || k > ne {
            return self.invalid(&format!(
                "moe_route: {k} of {ne} experts (at most {ROUTE_MAX_K} of {ROUTE_MAX_E})"
            ));
        }
        if tid2eid.is_none() && bias.is_none() {
            return self.invalid("moe_route: a router needs a bias or a hash table");
        }
        if n == 0 || k == 0 {
            return;
        }
        let (bias, tab) = match tid2eid {
            Some(t) => (Arg::Null, Arg::Ptr(t.ptr())),
            None => (Arg::Ptr(bias.map(|b| b.ptr()).unwrap()), Arg::Null),
        };
        // The fast form keeps the k selected experts on the lanes of one warp.
        let route = if !mix_simple() && k <= self.warp() as usize {
            "moe_route_fast"
        } else {
            "moe_route"
        };
        self.run(
            &ds4_kernels::MODEL,
            route,
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(logits.ptr),
                bias,
                tab,
                Arg::Ptr(tokens.0.ptr),
                Arg::Ptr(sel.0.ptr),
                Arg::Ptr(wgt.ptr),
                Arg::I32(ne as i32),
                Arg::I32(k as i32),
                Arg::F32(spec.weight_scale),
            ],
        );
    }

    /// The router's product and the route of one token in one `mvq_route_f16` launch (the
    /// product's CTAs as `mvq_r2u4_f16`, then the last CTA routes as `moe_route_fast`: the same
    /// logits, selections and weights as the two launches), or false (nothing run) where the
    /// two launches would not take those kernels, or with `DS4_GPU_ROUTE=off`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_route_fused(
        &self,
        spec: &MoeSpec,
        router: &GpuWeight,
        z: &GpuBuf,
        n: usize,
        logits: &mut GpuBuf,
        bias: Option<&GpuWeight>,
        tid2eid: Option<&GpuWeight>,
        tokens: &GpuIBuf,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
    ) -> bool {
        let (ne, k) = (spec.n_expert, spec.n_used);
        let GpuWeight::Mat { rows, .. } = router else {
            return false;
        };
        if !route_on()
            || mix_simple()
            || *rows != ne
            || ne > ROUTE_MAX_E
            || k == 0
            || k > ROUTE_MAX_K.min(self.warp() as usize)
            || k > ne
            || (tid2eid.is_none() && bias.is_none())
            || !(1..=4).contains(&n)
            || (n > 1 && (route_code() != 3 || !super::matvec::mvn_on()))
            || self.failed()
        {
            return false;
        }
        let Some((dims, kspl)) = self.mvq_r2u4_f16_plan(router, z) else {
            return false;
        };
        let (bias, tab) = match tid2eid {
            Some(t) => (Arg::Null, Arg::Ptr(t.ptr())),
            None => (Arg::Ptr(bias.map(|b| b.ptr()).unwrap()), Arg::Null),
        };
        let GpuWeight::Mat {
            cols, row_bytes, ..
        } = router
        else {
            return false;
        };
        let ticket = self.tickets.ptr().offset((ROUTE_TICKET * 4) as u64);
        ROUTE_RUNS.fetch_add(1, Ordering::Relaxed);
        // n = 2..4 (verify steps): `mvq_route2_f16r` / `mvq_route4_f16r`, the router read once
        // for every token and the tokens routed one after another by the last CTA (each token's
        // logits, selections and weights the bits of its n = 1 launch).
        let name = match (n, route_code() == 3) {
            (1, true) => "mvq_route_f16r",
            (1, false) => "mvq_route_f16",
            (2, _) => "mvq_route2_f16r",
            _ => "mvq_route4_f16r",
        };
        self.run(
            &ds4_kernels::MATVEC,
            name,
            dims,
            &[
                Arg::Ptr(router.ptr()),
                Arg::Ptr(z.ptr),
                Arg::Ptr(logits.ptr),
                Arg::I32(ne as i32),
                Arg::I32(*cols as i32),
                Arg::I64(*row_bytes as i64),
                Arg::I32(kspl as i32),
                bias,
                tab,
                Arg::Ptr(tokens.0.ptr),
                Arg::Ptr(sel.0.ptr),
                Arg::Ptr(wgt.ptr),
                Arg::I32(k as i32),
                Arg::F32(spec.weight_scale),
                Arg::Ptr(ticket),
            ]
            .into_iter()
            .chain((n > 1).then_some(Arg::I32(n as i32)))
            .collect::<Vec<_>>(),
        );
        true
    }

    fn hc_ok(&self, hc: &HcDims) -> bool {
        if hc.n == 0 || hc.n > HC_MAX {
            self.invalid(&format!("hc: {} streams (at most {HC_MAX})", hc.n));
            return false;
        }
        true
    }
}
