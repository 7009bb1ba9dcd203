//! Decode MoE (n ≤ 4 tokens): the routed experts at memory bandwidth. Returns true when it ran
//! the product, false to leave it to matvec.rs / matmul.rs. Semantics: ds4-cpu backend.rs.
//!
//! Forms (`DS4_GPU_MOE_FORM=v1|v2|v3d|v3ip`, `set_moe_form`): v3ip (the default for n = 1 on
//! CUDA sm_80+, IQ2_XXS gate/up with d % 2048 == 0 and Q2_K down at ff = 2048: the model's q2
//! mix; `m3gu1_iq2_xxs` + `m3dn1ip_q2_k`) and v3d (the same with `m3dn1_q2_k`, the f16 down)
//! run both products on tensor cores, exact in the weights
//! (gpu/moe.cu, form 3; its gate/up alone with v2's down tied with v2, an f16-normal weight
//! variant lost: removed, code in git at bba6ee6). Where v3d does not cover the product, v2 (`m2gu<NT>_<t>` + `m2dn<NT>_<t>`) loads each lane's bytes of every row straight
//! from global memory, x in registers, and passes h to the down kernel in that kernel's lane
//! order; v1 (where v3ip does not cover n = 2..4; it measured faster than v2 there) stages rows
//! in shared memory. n = 2..4 (speculative verify steps) runs v3ip's kernels with each token's
//! pairs as its one-token product, where they cover the product (session 33, then a launch pair
//! a token: ~84 against ~117 us a layer at n = 2 on the H200, bench/results/gpu-spec-s33-h200.txt;
//! session 34: one launch pair for all tokens, gpu-long-s34-h200.txt; `DS4_GPU_MOE_TOKENS=off`: v1). Numbers: bench/results/gpu-moe-m8-h200.txt, gpu-moe-m9-h200.txt (session 9: the v3d
//! kernels' shared-memory loads and the down's expert-id loads trimmed, gate/up 35.6 -> 34.3 us,
//! down 20.7 -> 20.5 us under ncu; a nibble-coded grid, two mma chains and a balanced down lost,
//! code in 90d531e). Session 15 (bench/results/gpu-moe-i15-h200.txt): the gate/up on int8
//! tensor cores (mma m16n8k32 s8, one k step a sub-block with its scale on the int32 result, x as
//! 4 int8 limbs per 256-column super-block; forms v4 / v4t / v4b) was 5-6% slower per call than
//! v3d's and tied end to end: deleted, code in daf853e. An int8-x
//! dp4a form (v4i, session 7) was no faster end to end on the H200 and ~1e-2 off the CPU: deleted
//! (bench/results/gpu-moe-m-h200.txt). Numbers: bench/results/gpu-moe-s4-h200.txt,
//! gpu-moe-x-h200.txt, gpu-moe-m-h200.txt. v3ip (session 16, bench/results/gpu-moe-i16-h200.txt):
//! v3d with the down on int8 tensor cores (q * scale <= 45 as int8 weights, x as 4 int8 limbs of
//! 2^-30 of the slot's max) and 5 slots' rows in flight, requested before the PDL wait: 2k
//! decode +0.8% (3 pairs); the int8 down alone (v3i) and the deep one alone (v3p) tied in
//! moe_bench: deleted, code in 5f2b52a.
//!
//! v1: two launches of `gpu/moe.cu`: `moegu<NT>_<t>` (gate + up + SwiGLU × routing weight into a
//! scratch `h`, pairs × ff; one CTA per row block and pair, the first pair of each distinct
//! expert doing the work for every token routed to it) and `moedn_<t>` (down for every pair, each
//! distinct expert's rows read once, then the sum over slots in selection order). Expert ids and
//! weights stay on the device. Covers IQ2_XXS, Q2_K and Q4_K experts with 16-byte multiple rows.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{GgmlType, MoeSpec};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Process-wide switch (on by default) so tests and benchmarks can compare with the older paths.
static ENABLED: AtomicBool = AtomicBool::new(true);
/// `DS4_GPU_MOE_DECODE=off` turns the kernels off for the whole process (A/B of `ds4 bench`).
static ENV_OFF: OnceLock<bool> = OnceLock::new();
/// Gate/up rows per CTA (a multiple of MOE_G, shrunk to fit shared memory); 0: 8 for n = 1, 16
/// for n = 2..4 (the faster of each on an H200, bench/results/gpu-moe-decode-h200.txt).
static GU_ROWS: AtomicUsize = AtomicUsize::new(0);
/// Products run here (for tests: proof the kernels were taken).
static RUNS: AtomicUsize = AtomicUsize::new(0);
/// Of those, the v2 ones (direct loads; v3d included: it shares v2's host path).
static V2_RUNS: AtomicUsize = AtomicUsize::new(0);
/// Of those, the v3d ones (tensor cores; v3ip included).
static V3D_RUNS: AtomicUsize = AtomicUsize::new(0);
/// Of those, the v3ip ones (the int8 down).
static V3IP_RUNS: AtomicUsize = AtomicUsize::new(0);
/// Form: 0 default (v3ip for n = 1, v3ip token by token for n = 2..4, else v1), 1 v1, 2 v2, 3 v3d (`m3gu1_iq2_xxs` +
/// `m3dn1_q2_k`: n <= 4, IQ2_XXS gate/up, Q2_K down of 2048 columns, CUDA sm_80+; else v2),
/// 4 v3ip (v3d with `m3dn1ip_q2_k`, the int8 down, where v3d runs);
/// `DS4_GPU_MOE_FORM=v1|v2|v3d|v3ip`.
static FORM: AtomicUsize = AtomicUsize::new(0);
static ENV_FORM: OnceLock<usize> = OnceLock::new();
/// v2 tiles: gate/up row batches per CTA (0: `DS4_GPU_MOE_V2_TILES` or 6), down row batches
/// per CTA (0: that or 4). H200, n = 1: fewer, larger CTAs were faster in both kernels (x / h
/// are re-read per CTA); gate/up 6 makes 258 CTAs at the model shape, one wave at 2 per SM
/// (4 made 384: gate/up 30.8 -> 29.1 us a call, bench/results/gpu-moe-m-h200.txt).
static V2_NB: AtomicUsize = AtomicUsize::new(0);
static V2_NBR: AtomicUsize = AtomicUsize::new(0);
/// v2 rows per batch (`M2Rb` in moe.cu): gate/up output rows (2x row-dots), down rows.
fn v2_rb(ty: &str) -> (usize, usize) {
    if ty == "q4_k" {
        (2, 4)
    } else {
        (4, 4)
    }
}
/// `DS4_GPU_MOE_V2_TILES=nb,nbr`: v2 tiles for the whole process (A/B of `ds4 bench`).
static ENV_TILES: OnceLock<(usize, usize)> = OnceLock::new();
/// v2 layout kind of h for the down type (`m2_inv` in moe.cu).
fn v2_layout(ty: &str) -> i32 {
    match ty {
        "q2_k" => 1,
        "q4_k" => 2,
        _ => 0,
    }
}

/// Shared memory of the v3d gate/up at `cols` columns (`m3gu_body`: grid, x fragments, partials
/// and maxima, 3 stages of 16 rows at a 544-byte stride).
fn v3_smem(cols: usize) -> usize {
    2048 + 4 * cols + 4 * (8 * 16 + 8) + 3 * 16 * 544
}

/// The v3d / v3ip down (`m3dn1_q2_k` / `m3dn1ip_q2_k`): threads, shared memory (x fragments and
/// group sums of two slots, partials, scales, nst stages of 16 rows at a 688-byte stride: 2, or
/// `M3D_DEEP` for v3ip).
const V3D_THREADS: usize = 512;
const V3D_DEEP: usize = 6;
fn v3d_smem(nst: usize) -> usize {
    2 * 512 * 16 + 2 * 8 * 2 * 16 * 2 + 16 * 16 * 4 + 64 * 4 + nst * 16 * 688
}

/// `m3dn2_body` (the v3ip down's default; DS4_GPU_M3D_R32=0: v3d_smem): as v3d_smem with
/// partials of two row tiles and `V3D_DEEP` stages of 32 rows.
fn v3d_smem_r32() -> usize {
    2 * 512 * 16 + 2 * 8 * 2 * 16 * 2 + 2 * 16 * 16 * 4 + 64 * 4 + V3D_DEEP * 32 * 688
}

/// Whether the v3d down covers dn: n = 1..4 tokens (a grid row each), Q2_K rows of 2048
/// columns, at most MAXP pairs.
fn v3d_fits(dn: Mat, n: usize, k: usize) -> bool {
    (1..=4).contains(&n) && dn.1 == "q2_k" && dn.2 == 2048 && dn.4 == 672 && n * k <= MAXP
}

/// A product's device operands: token rows z [n, d], slots sel / wgt [n, k], output [n, d].
struct MoeIo {
    z: DevPtr,
    sel: DevPtr,
    wgt: DevPtr,
    out: DevPtr,
}

/// n = 2..4 by the v3ip kernels token by token (each token's pairs as its one-token product, all
/// tokens in one launch pair): 1 on (default), 2 off (`DS4_GPU_MOE_TOKENS=off` or
/// [`GpuBackend::set_moe_per_token`]: the v1 kernels), 0 not read yet.
static PER_TOKEN: AtomicU8 = AtomicU8::new(0);
/// Products run per token that way (process-wide; tests).
static TOKEN_RUNS: AtomicUsize = AtomicUsize::new(0);

fn per_token() -> bool {
    super::switch::env_code(
        &PER_TOKEN,
        "DS4_GPU_MOE_TOKENS",
        super::switch::on_unless_off,
    ) == 1
}

/// Threads per CTA, row-dots per reduction group, most pairs, table bytes (`MOE_*` in moe.cu).
const THREADS: usize = 256;
const G: usize = 8;
const MAXP: usize = 32;
const TAB: usize = 3072;
/// Dynamic shared memory per CTA we allow ourselves (the static limit is 48 KiB).
const SMEM: usize = 46 * 1024;

fn suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::IQ2_XXS => "iq2_xxs",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q4_K => "q4_k",
        _ => return None,
    })
}

/// (pointer, suffix, cols, rows, row_bytes) of an expert stack.
type Mat = (DevPtr, &'static str, usize, usize, usize);

/// The expert stack as the kernels take it (16-byte rows and base).
fn mat(w: &GpuWeight) -> Option<Mat> {
    let (p, ty, cols, rows, row_bytes) = w.mat_parts()?;
    if rows == 0
        || !cols.is_multiple_of(256)
        || !row_bytes.is_multiple_of(16)
        || !p.0.is_multiple_of(16)
    {
        return None;
    }
    Some((p, suffix(ty)?, cols, rows, row_bytes))
}

impl GpuBackend {
    /// Use (true, the default) or skip the decode MoE kernels; process-wide, for tests and benches.
    pub fn set_moe_decode(on: bool) {
        ENABLED.store(on, Ordering::Relaxed);
    }

    /// Gate/up rows per CTA (8, 16, 24, 32; 0: the default choice); process-wide, for benchmarks.
    pub fn set_moe_gu_rows(rb: usize) {
        let rb = if rb == 0 {
            0
        } else {
            rb.clamp(G, 4 * G) / G * G
        };
        GU_ROWS.store(rb, Ordering::Relaxed);
    }

    /// Form of the decode MoE: 0 the default (v3ip for n = 1, v1 above), 1 v1, 2 v2, 3 v3d,
    /// 4 v3ip; process-wide, for tests and benches (`DS4_GPU_MOE_FORM=v1|v2|v3d|v3ip` when 0).
    pub fn set_moe_form(form: usize) {
        FORM.store(form.min(4), Ordering::Relaxed);
    }

    /// v2 tiles: gate/up row batches per CTA, down row batches per CTA (0: the defaults).
    pub fn set_moe_v2_tiles(nb: usize, nbr: usize) {
        V2_NB.store(nb.min(16), Ordering::Relaxed);
        V2_NBR.store(nbr.min(16), Ordering::Relaxed);
    }

    /// How many products these kernels have run (process-wide).
    pub fn moe_decode_runs() -> usize {
        RUNS.load(Ordering::Relaxed)
    }

    /// How many of those were the v2 form (process-wide).
    pub fn moe_v2_runs() -> usize {
        V2_RUNS.load(Ordering::Relaxed)
    }

    /// How many of those were the v3d form (process-wide).
    pub fn moe_v3d_runs() -> usize {
        V3D_RUNS.load(Ordering::Relaxed)
    }

    /// n = 2..4 products by the v3ip kernels token by token (default on).
    pub fn set_moe_per_token(on: bool) {
        PER_TOKEN.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// How many n = 2..4 products ran per token that way (process-wide).
    pub fn moe_token_runs() -> usize {
        TOKEN_RUNS.load(Ordering::Relaxed)
    }

    /// How many of those were the v3ip form (process-wide).
    pub fn moe_v3ip_runs() -> usize {
        V3IP_RUNS.load(Ordering::Relaxed)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dec_moe(
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
        let env_off = *ENV_OFF.get_or_init(|| {
            std::env::var("DS4_GPU_MOE_DECODE").is_ok_and(|v| v == "off" || v == "0")
        });
        if env_off
            || !ENABLED.load(Ordering::Relaxed)
            || !(1..=4).contains(&n)
            || k == 0
            || pairs > MAXP
            || !z.ptr.0.is_multiple_of(16)
            || self.failed()
        {
            return false;
        }
        let (Some(g), Some(u), Some(dn)) = (mat(gate), mat(up), mat(down)) else {
            return false;
        };
        // Gate and up: one type, [ff, d] per expert; down [d, ff].
        if g.1 != u.1 || (g.2, g.3, g.4) != (d, ff, u.4) || (u.2, u.3) != (d, ff) {
            return false;
        }
        if (dn.2, dn.3) != (ff, d) {
            return false;
        }
        let form = match FORM.load(Ordering::Relaxed) {
            0 => *ENV_FORM.get_or_init(|| match std::env::var("DS4_GPU_MOE_FORM").as_deref() {
                Ok("v1") => 1,
                Ok("v2") => 2,
                Ok("v3d") => 3,
                Ok("v3ip") => 4,
                _ => 0,
            }),
            f => f,
        };
        let io = MoeIo {
            z: z.ptr,
            sel: sel.0.ptr,
            wgt: wgt.ptr,
            out: out.ptr,
        };
        // n = 2..4 (speculative verify steps): the v3ip kernels with every token's pairs as the
        // one-token product runs them (one launch pair for all tokens; same bits per token).
        if form == 0
            && n > 1
            && per_token()
            && self.v3_fits(g, n)
            && v3d_fits(dn, n, k)
            && self.dec_moe_v2(spec, (g, u, dn), &io, n, true, true)
        {
            RUNS.fetch_add(1, Ordering::Relaxed);
            TOKEN_RUNS.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        // n = 1: v3ip (v2 where its kernels do not cover the product).
        let form = if form == 0 && n == 1 { 4 } else { form };
        let v3d = form >= 3 && self.v3_fits(g, n) && v3d_fits(dn, n, k);
        // v3ip: the int8 down.
        let i8dn = v3d && form == 4;
        if form >= 2 && self.dec_moe_v2(spec, (g, u, dn), &io, n, v3d, i8dn) {
            RUNS.fetch_add(1, Ordering::Relaxed);
            V2_RUNS.fetch_add(1, Ordering::Relaxed);
            if v3d {
                V3D_RUNS.fetch_add(1, Ordering::Relaxed);
            }
            if i8dn {
                V3IP_RUNS.fetch_add(1, Ordering::Relaxed);
            }
            return true;
        }
        let warps = THREADS / self.warp() as usize;
        let nt = match n {
            1 => 1,
            2 => 2,
            _ => 4,
        };
        // Gate/up rows per CTA: the preferred count, halved until tables + partials + rows fit.
        let gu_smem = |rb: usize| TAB + 4 * warps * 2 * rb * nt + 2 * rb * g.4;
        let mut rb = match GU_ROWS.load(Ordering::Relaxed) {
            0 if n == 1 => G,
            0 => 2 * G,
            r => r,
        };
        while rb > G && gu_smem(rb) > SMEM {
            rb -= G;
        }
        // Down: MOE_G rows per CTA, as many experts per staging batch as fit.
        let red = warps * (pairs * G).next_multiple_of(4) * 4;
        let fixed = TAB + 2 * MAXP * 4 + red;
        let slot = G * dn.4;
        if gu_smem(rb) > SMEM || fixed + slot > SMEM {
            return false;
        }
        let ub = ((SMEM - fixed) / slot).min(pairs);
        let h = self.scratch(pairs * ff);
        self.run(
            &ds4_kernels::MOE,
            &format!("moegu{nt}_{}", g.1),
            LaunchDims {
                grid: [ff.div_ceil(rb) as u32, pairs as u32, 1],
                block: [THREADS as u32, 1, 1],
                shared_bytes: gu_smem(rb) as u32,
            },
            &gu_args(spec, (g, u), &io, n, &h, &[Arg::I32(rb as i32)]),
        );
        self.run(
            &ds4_kernels::MOE,
            &format!("moedn_{}", dn.1),
            LaunchDims {
                grid: [d.div_ceil(G) as u32, 1, 1],
                block: [THREADS as u32, 1, 1],
                shared_bytes: (fixed + ub * slot) as u32,
            },
            &dn_args(spec, dn, &io, &h, n, &[Arg::I32(ub as i32)]),
        );
        RUNS.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Whether the v3d gate/up (`m3gu1_iq2_xxs`) covers gate/up g at n tokens: n = 1..4 (a token's
    /// pairs as its one-token product), IQ2_XXS rows of a multiple of 2048 columns (stages of 8
    /// blocks), x fragments within shared memory, CUDA sm_80+.
    fn v3_fits(&self, g: Mat, n: usize) -> bool {
        let info = self.gpu.info();
        (1..=4).contains(&n)
            && g.1 == "iq2_xxs"
            && g.2.is_multiple_of(2048)
            && g.4 == g.2 / 256 * 66
            && v3_smem(g.2) <= SMEM
            && info.warp == 32
            && info.cc.0 >= 8
    }

    /// The v2 launches (v3d: the v3d kernels instead, i8dn: with the v3ip down); false: the
    /// shape does not fit them; nothing was queued.
    #[allow(clippy::too_many_arguments)]
    fn dec_moe_v2(
        &self,
        spec: &MoeSpec,
        (g, u, dn): (Mat, Mat, Mat),
        io: &MoeIo,
        n: usize,
        v3d: bool,
        i8dn: bool,
    ) -> bool {
        let (k, d, ff) = (spec.n_used, spec.d, spec.ff);
        let pairs = n * k;
        let w = self.warp() as usize;
        let warps = THREADS / w;
        // A row group: the warps whose lanes cover the 32-column units of one row.
        let wpg = |cols: usize| (cols / 32).div_ceil(w);
        if wpg(d) > warps || wpg(ff) > warps {
            return false;
        }
        let nt = if n == 1 { 1 } else { 2 };
        let (rb_gu, _) = v2_rb(g.1);
        let (_, rb_dn) = v2_rb(dn.1);
        let env = *ENV_TILES.get_or_init(|| {
            let v = std::env::var("DS4_GPU_MOE_V2_TILES").unwrap_or_default();
            let mut it = v
                .split(',')
                .map(|x| x.trim().parse::<usize>().unwrap_or(0).min(16));
            (it.next().unwrap_or(0), it.next().unwrap_or(0))
        });
        let pick = |set: usize, env: usize, default: usize| match (set, env) {
            (0, 0) => default,
            (0, e) => e,
            (s, _) => s,
        };
        let nb = pick(V2_NB.load(Ordering::Relaxed), env.0, 6);
        let nbr = pick(V2_NBR.load(Ordering::Relaxed), env.1, 4);
        let tr_gu = warps / wpg(d) * rb_gu * nb;
        let tr_dn = rb_dn * nbr;
        let upp = (d / 32) | 1;
        let red_gu = (warps * nb * 2 * rb_gu * nt).next_multiple_of(4);
        let smem_gu = 2048 + 4 * red_gu + 16 * nt * 8 * upp;
        let smem_dn = 2048 + 4 * (4 * MAXP + 4) + 4 * wpg(ff) * pairs * tr_dn;
        if !v3d && (smem_gu > SMEM || smem_dn > SMEM) {
            return false;
        }
        // h in the down kernel's lane order: per pair, whole warps of 32-column units (v3d:
        // plain order).
        let hs = if v3d { ff } else { wpg(ff) * w * 32 };
        let h = self.scratch(pairs * hs);
        // v3d: tiles of 8 gate/up rows, nb per CTA (3 at the model shape: 516 CTAs, one wave at
        // 4 per SM).
        let nb3 = pick(V2_NB.load(Ordering::Relaxed), env.0, 3);
        let ngu = ff.div_ceil(8 * nb3);
        let (name, grid, smem, tiles) = if v3d {
            (format!("m3gu1_{}", g.1), ngu, v3_smem(d), nb3)
        } else {
            (format!("m2gu{nt}_{}", g.1), ff.div_ceil(tr_gu), smem_gu, nb)
        };
        // v3d: max |h| per pair and gate/up CTA (the down's x scale).
        let mx = v3d.then(|| self.scratch(pairs * ngu));
        let mut tail = vec![
            Arg::I32(tiles as i32),
            Arg::I32(v2_layout(dn.1)),
            Arg::I32(hs as i32),
        ];
        if let Some(mx) = &mx {
            tail.push(Arg::Ptr(mx.ptr));
        }
        self.run(
            &ds4_kernels::MOE,
            &name,
            LaunchDims {
                grid: [grid as u32, pairs as u32, 1],
                block: [THREADS as u32, 1, 1],
                shared_bytes: smem as u32,
            },
            &gu_args(spec, (g, u), io, n, &h, &tail),
        );
        // Down + slot sum: v3d also takes the gate/up CTAs' maxima.
        let mut tail = vec![Arg::I32(nbr as i32), Arg::I32(hs as i32)];
        let (name, grid, block, smem) = match &mx {
            Some(mx) => {
                tail.extend([Arg::Ptr(mx.ptr), Arg::I32(ngu as i32)]);
                let (f, nst) = if i8dn { ("ip", V3D_DEEP) } else { ("", 2) };
                // The int8 down with 32 rows a CTA (m3dn2_body; DS4_GPU_M3D_R32=0: 16).
                // (cuda_defines picks the kernel's form by the same rule.)
                let info = self.gpu.info();
                let r32 = i8dn
                    && info.vendor == crate::runtime::Vendor::Nvidia
                    && crate::compiler::m3d_r32(info.cc.0, info.cc.1);
                (
                    format!("m3dn1{f}_{}", dn.1),
                    d.div_ceil(if r32 { 32 } else { 16 }),
                    V3D_THREADS,
                    if r32 { v3d_smem_r32() } else { v3d_smem(nst) },
                )
            }
            None => (
                format!("m2dn{nt}_{}", dn.1),
                d.div_ceil(tr_dn),
                THREADS,
                smem_dn,
            ),
        };
        // v3d: a token a grid row (m3dn1*: M3DN_TOK); v2 takes every token in each CTA.
        let rows_y = if mx.is_some() { n } else { 1 };
        self.run(
            &ds4_kernels::MOE,
            &name,
            LaunchDims {
                grid: [grid as u32, rows_y as u32, 1],
                block: [block as u32, 1, 1],
                shared_bytes: smem as u32,
            },
            &dn_args(spec, dn, io, &h, n, &tail),
        );
        true
    }
}

/// The arguments every gate/up kernel takes (`MOEGU_PARAMS` / `M2GU_PARAMS` in moe.cu up to
/// row_bytes), then the form's own.
#[allow(clippy::too_many_arguments)]
fn gu_args(
    spec: &MoeSpec,
    (g, u): (Mat, Mat),
    io: &MoeIo,
    n: usize,
    h: &GpuBuf,
    tail: &[Arg],
) -> Vec<Arg> {
    let mut a = vec![
        Arg::Ptr(g.0),
        Arg::Ptr(u.0),
        Arg::Ptr(io.sel),
        Arg::I64((spec.ff * g.4) as i64),
        Arg::Ptr(io.z),
        Arg::I32(n as i32),
        Arg::I32(spec.n_used as i32),
        Arg::Ptr(io.wgt),
        Arg::F32(spec.clamp),
        Arg::Ptr(h.ptr),
        Arg::I32(spec.ff as i32),
        Arg::I32(spec.d as i32),
        Arg::I64(g.4 as i64),
    ];
    a.extend_from_slice(tail);
    a
}

/// The arguments every down kernel takes (up to row_bytes), then the form's own.
fn dn_args(spec: &MoeSpec, dn: Mat, io: &MoeIo, h: &GpuBuf, n: usize, tail: &[Arg]) -> Vec<Arg> {
    let mut a = vec![
        Arg::Ptr(dn.0),
        Arg::Ptr(io.sel),
        Arg::I64((spec.d * dn.4) as i64),
        Arg::Ptr(h.ptr),
        Arg::I32(n as i32),
        Arg::I32(spec.n_used as i32),
        Arg::Ptr(io.out),
        Arg::I32(spec.d as i32),
        Arg::I32(spec.ff as i32),
        Arg::I64(dn.4 as i64),
    ];
    a.extend_from_slice(tail);
    a
}
