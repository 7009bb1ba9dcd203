//! Weight products on the GPU: dense matmul over `n` rows, grouped output projection, and the
//! routed experts, all through the `mm<NT>_<type>` kernels of `gpu/matmul.cu` (one launch per
//! product; each weight chunk is read once per group of NT token rows). The MoE reads the
//! expert ids on the device: no host sync.

use super::switch::{env_code, on_unless_off};
use super::{type_suffix as suffix, GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use crate::GpuError;
use ds4_backend::{GgmlType, MoeSpec, Part};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

/// Whether products may use the shared-memory tile kernels (`mmt*`, `gateupt_*`) when the
/// weight is 16-byte aligned; process-wide, for tests and benchmarks comparing the two forms.
/// Off by default: on an H200 they measured within ±5% of the direct form, mostly slower
/// (bench/results/gpu-matmul-h200.txt).
static TILES: AtomicBool = AtomicBool::new(false);

/// Whether products use the coalesced kernels (`mmc*`, `gateupc_*`: four lanes per chunk), before
/// tiles. On by default: on the H200 (full-size q2, bench/results/gpu-resident-full-q2.txt) they
/// took decode from 32 to 39 tok/s and prefill from 67 to 149 tok/s over the direct form.
static COALESCED: AtomicBool = AtomicBool::new(true);

/// The MoE's slot sum four columns a thread (`moe_sum4_f32`, 16-byte loads) where the width and
/// buffers allow: 0 not read yet from `DS4_GPU_MOE_SUM4`, 1 on (default), 2 off (`moe_sum_f32`,
/// a column a thread). The same sums in the same order: the same bits.
static SUM4: AtomicU8 = AtomicU8::new(0);
/// `moe_sum4_f32` launches so far in this process (tests: the form ran).
static SUM4_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Warps per CTA of the `mm*`/`gateup_*` kernels (`MM_WARPS` in `gpu/matmul.cu`).
pub(crate) const MM_WARPS: usize = 8;

/// One `mm*` launch; for item t < n and batch z < zs (byte/element strides, see matmul.cu):
/// `y[t*y_tok + z*y_z + r] = (W + z*w_z + sel[t]*slab)[r] · x[(t/xdiv)*x_tok + z*x_z ..]`.
pub(crate) struct Mm {
    pub w: DevPtr,
    pub ty: GgmlType,
    pub w_z: usize,
    pub sel: Option<DevPtr>,
    pub slab: usize,
    pub x: DevPtr,
    pub x_tok: usize,
    pub x_z: usize,
    pub xdiv: usize,
    pub y: DevPtr,
    pub y_tok: usize,
    pub y_z: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub n: usize,
    pub zs: usize,
    /// By-expert groups from `moe_group_i32` (`[ngroups, starts[gmax], perm[n]]`, gmax).
    pub grp: Option<(DevPtr, usize)>,
}

/// Items per CTA of the grouped (by expert) products; `moe_group_i32` cuts runs to this.
const GROUP_NT: usize = 8;

/// Chunks per shared-memory tile of the `mmt*` kernels (`mm_tile_chunks` in matmul.cu).
fn tile_chunks(ty: GgmlType) -> usize {
    match ty {
        GgmlType::F32 => 16,
        GgmlType::F16 | GgmlType::BF16 => 32,
        _ => 64,
    }
}

/// 16-byte loads are safe: base, per-row, per-batch and per-expert strides all multiples of 16.
fn tiled(base: DevPtr, strides: &[usize]) -> bool {
    TILES.load(Ordering::Relaxed)
        && base.0.is_multiple_of(16)
        && strides.iter().all(|s| s.is_multiple_of(16))
}

impl GpuBackend {
    /// `h[p] = silu(min(g[p], c)) · clamp(u[p], ±c) · wgt[p / ff]` over `pairs` rows of `ff`:
    /// the routed experts' SwiGLU with each (token, slot) pair's routing weight.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_swiglu(
        &self,
        g: &GpuBuf,
        u: &GpuBuf,
        h: &mut GpuBuf,
        wgt: &GpuBuf,
        clamp: f32,
        ff: usize,
        pairs: usize,
    ) {
        let total = pairs * ff;
        self.run(
            &ds4_kernels::MATMUL,
            "moe_swiglu_f32",
            LaunchDims::linear(total.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(g.ptr),
                Arg::Ptr(u.ptr),
                Arg::Ptr(h.ptr),
                Arg::Ptr(wgt.ptr),
                Arg::F32(clamp),
                Arg::I32(ff as i32),
                Arg::I64(total as i64),
            ],
        );
    }

    /// Use or avoid (false, the default) the shared-memory tile kernels for aligned weights.
    /// Process-wide; for tests and benchmarks of both forms.
    pub fn set_matmul_tiles(on: bool) {
        TILES.store(on, Ordering::Relaxed);
    }

    /// Use (the default) or avoid the coalesced `mmc*` kernels (precede tiles).
    /// Process-wide; for tests and benchmarks.
    pub fn set_matmul_coalesced(on: bool) {
        COALESCED.store(on, Ordering::Relaxed);
    }

    /// Warps per row (1, 2, 4, 8): the fewest that give the grid about four CTAs per SM, while
    /// each warp keeps at least one step of chunks (a warp width, or a tile of `tile` chunks).
    fn kspl(&self, rows: usize, other_ctas: usize, cols: usize, tile: Option<usize>) -> usize {
        let info = self.gpu.info();
        let want = 4 * info.sm_count as usize;
        let step = tile.unwrap_or(info.warp as usize);
        let max_k = (cols / 32).div_ceil(step).clamp(1, MM_WARPS);
        let mut k = 1;
        while k < max_k && rows.div_ceil(MM_WARPS / k) * other_ctas < want {
            k *= 2;
        }
        k
    }

    fn kernel_suffix(&self, ty: GgmlType) -> Option<&'static str> {
        let s = suffix(ty);
        if s.is_none() {
            self.note::<()>(Err(GpuError::Invalid(format!(
                "no GPU weight product for {ty:?}"
            ))));
        }
        s
    }

    /// Launch one [`Mm`] product.
    pub(crate) fn mm(&self, m: &Mm) {
        if m.n == 0 || m.rows == 0 || m.zs == 0 || self.failed() {
            return;
        }
        let Some(sfx) = self.kernel_suffix(m.ty) else {
            return;
        };
        // Items per CTA: NT consecutive rows, runs of one expert (grp), or single expert items.
        let (nt, groups) = match (m.grp, m.sel, m.n) {
            (Some((_, gmax)), _, _) => (GROUP_NT, gmax),
            (None, Some(_), _) | (None, None, 1) => (1, m.n),
            (None, None, 2..=4) => (4, 1),
            _ => (8, m.n.div_ceil(8)),
        };
        let coalesced = COALESCED.load(Ordering::Relaxed);
        let tiles = !coalesced && tiled(m.w, &[m.row_bytes, m.w_z, m.slab]);
        let step = if coalesced {
            Some(self.warp() as usize / 4)
        } else {
            tiles.then(|| tile_chunks(m.ty))
        };
        let k = self.kspl(m.rows, groups * m.zs, m.cols, step);
        let dims = LaunchDims {
            grid: [
                m.rows.div_ceil(MM_WARPS / k) as u32,
                groups as u32,
                m.zs as u32,
            ],
            block: [MM_WARPS as u32 * self.warp(), 1, 1],
            shared_bytes: 0,
        };
        self.run(
            &ds4_kernels::MATMUL,
            &format!(
                "mm{}{nt}_{sfx}",
                if coalesced {
                    "c"
                } else if tiles {
                    "t"
                } else {
                    ""
                }
            ),
            dims,
            &[
                Arg::Ptr(m.w),
                Arg::I64(m.w_z as i64),
                m.sel.map_or(Arg::Null, Arg::Ptr),
                Arg::I64(m.slab as i64),
                Arg::Ptr(m.x),
                Arg::I64(m.x_tok as i64),
                Arg::I64(m.x_z as i64),
                Arg::I32(m.xdiv.max(1) as i32),
                Arg::Ptr(m.y),
                Arg::I64(m.y_tok as i64),
                Arg::I64(m.y_z as i64),
                Arg::I32(m.rows as i32),
                Arg::I32(m.cols as i32),
                Arg::I64(m.row_bytes as i64),
                Arg::I32(m.n as i32),
                Arg::I32(k as i32),
                m.grp.map_or(Arg::Null, |g| Arg::Ptr(g.0)),
                Arg::I32(m.grp.map_or(0, |g| g.1) as i32),
            ],
        );
    }

    /// The weight's pointer and an [`Mm`] over all its rows for one item (or an error noted).
    /// The general kernels read GGUF blocks: a matrix held in the decode layout only is an
    /// error here (the decode kernels and the vendor BLAS, which run its products, declined).
    fn mat(&self, w: &GpuWeight) -> Option<(DevPtr, Mm)> {
        if !w.blocks() {
            let (cols, rows) = match w {
                GpuWeight::Mat { cols, rows, .. } => (*cols, *rows),
                _ => (0, 0),
            };
            self.note::<()>(Err(GpuError::Invalid(format!(
                "a Q8_0 product of {cols} x {rows} held in the decode layout only (the GGUF \
                 blocks were dropped to fit the device) has no kernel on this path: the \
                 vendor BLAS declined it (DS4_GPU_BLAS=off?); DS4_GPU_Q8_REPACK=off keeps the \
                 blocks instead"
            ))));
            return None;
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
            self.note::<()>(Err(GpuError::Invalid("matmul on a vector weight".into())));
            return None;
        };
        Some((
            buf.ptr(),
            Mm {
                w: buf.ptr(),
                ty: *ty,
                w_z: 0,
                sel: None,
                slab: rows * row_bytes,
                x: DevPtr(0),
                x_tok: *cols,
                x_z: 0,
                xdiv: 1,
                y: DevPtr(0),
                y_tok: *rows,
                y_z: 0,
                rows: *rows,
                cols: *cols,
                row_bytes: *row_bytes,
                n: 1,
                zs: 1,
                grp: None,
            },
        ))
    }

    /// Every weight product (matvec, GEMM and `mm` kernels) walks rows in chunks of 32 columns
    /// (one Q8_0 block, an eighth of a K/IQ super-block). A float matrix of another width is
    /// refused with an error instead of losing its tail; the model's widths are multiples of 32.
    pub(crate) fn product_width_ok(&self, w: &GpuWeight) -> bool {
        match w {
            GpuWeight::Mat { cols, .. } if !cols.is_multiple_of(32) => {
                self.note::<()>(Err(GpuError::Invalid(format!(
                    "weight product over {cols} columns: the GPU backend needs a multiple of 32 \
                     (--backend cpu runs it)"
                ))));
                false
            }
            _ => true,
        }
    }

    pub(crate) fn op_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        // Fast paths first (decode: matvec.rs, prefill: gemm.rs); they decline what they
        // do not cover and this general form runs.
        if self.failed()
            || !self.product_width_ok(w)
            || self.mv_matmul(w, part, x, n, y)
            || self.blas_matmul(w, part, x, n, y)
            || self.gemm_matmul(w, part, x, n, y)
        {
            return;
        }
        let Some((p, m)) = self.mat(w) else { return };
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * m.slab,
        };
        self.mm(&Mm {
            w: p.offset(byte0 as u64),
            x: x.ptr,
            y: y.ptr,
            n,
            ..m
        });
    }

    /// Group g of every row: `y[i][g*r ..] = W[g*r .. (g+1)*r] · x[i][g*cols ..]`, one launch
    /// (blockIdx.z = g).
    pub(crate) fn op_matmul_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        if self.failed()
            || !self.product_width_ok(w)
            || self.mv_grouped(w, groups, x, n, y)
            || self.blas_grouped(w, groups, x, n, y)
            || self.gemm_grouped(w, groups, x, n, y)
        {
            return;
        }
        let Some((_, m)) = self.mat(w) else { return };
        if groups == 0 {
            return;
        }
        let r = m.rows / groups;
        self.mm(&Mm {
            w_z: r * m.row_bytes,
            x: x.ptr,
            x_tok: groups * m.cols,
            x_z: m.cols,
            y: y.ptr,
            y_tok: m.rows,
            y_z: r,
            rows: r,
            n,
            zs: groups,
            ..m
        });
    }

    /// Routed experts for `n` tokens × `k` slots without leaving the device: gate+up+SwiGLU
    /// (fused when gate and up share a type) into `h` (pairs × ff), down per pair into `part`
    /// (pairs × d), then the per-token sum over slots in selection order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_moe_experts(
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
    ) {
        if self.failed()
            || self.dec_moe(spec, gate, up, down, z, sel, wgt, n, out)
            || self.mv_moe(spec, gate, up, down, z, sel, wgt, n, out)
            || self.gemm_moe(spec, gate, up, down, z, sel, wgt, n, out)
        {
            return;
        }
        let (k, d, ff) = (spec.n_used, spec.d, spec.ff);
        let pairs = n * k;
        if pairs == 0 {
            return;
        }
        let (Some((gp, gm)), Some((up_p, um)), Some((dp, dm))) =
            (self.mat(gate), self.mat(up), self.mat(down))
        else {
            return;
        };
        let sel = sel.0.ptr;
        let mut h = self.scratch(pairs * ff);
        // Prefill: pairs grouped by expert (each slab read once per run of GROUP_NT pairs);
        // the grouping kernel is quadratic in pairs, so only up to a few thousand.
        let grp = if pairs >= 2 * spec.n_expert && pairs <= 4096 {
            let gmax = pairs.div_ceil(GROUP_NT) + spec.n_expert.min(pairs);
            let g = self.scratch(1 + gmax + pairs);
            let flag = self.scratch(pairs);
            self.run(
                &ds4_kernels::MATMUL,
                "moe_group_i32",
                LaunchDims::linear(1, 256),
                &[
                    Arg::Ptr(sel),
                    Arg::I32(pairs as i32),
                    Arg::I32(GROUP_NT as i32),
                    Arg::I32(gmax as i32),
                    Arg::Ptr(g.ptr),
                    Arg::Ptr(flag.ptr),
                ],
            );
            Some((g, gmax, flag))
        } else {
            None
        };
        let grp_arg = grp.as_ref().map(|(g, gmax, _)| (g.ptr, *gmax));
        let same = gm.ty == um.ty && gm.row_bytes == um.row_bytes && gm.cols == um.cols;
        if same && grp.is_none() {
            let Some(sfx) = self.kernel_suffix(gm.ty) else {
                return;
            };
            let coalesced = COALESCED.load(Ordering::Relaxed);
            let tiles = !coalesced && tiled(gp, &[gm.row_bytes, gm.slab]) && tiled(up_p, &[]);
            let step = if coalesced {
                Some(self.warp() as usize / 4)
            } else {
                tiles.then(|| tile_chunks(gm.ty))
            };
            let kk = self.kspl(ff, pairs, d, step);
            let form = if coalesced {
                "c"
            } else if tiles {
                "t"
            } else {
                ""
            };
            self.run(
                &ds4_kernels::MATMUL,
                &format!("gateup{form}_{sfx}"),
                LaunchDims {
                    grid: [ff.div_ceil(MM_WARPS / kk) as u32, pairs as u32, 1],
                    block: [MM_WARPS as u32 * self.warp(), 1, 1],
                    shared_bytes: 0,
                },
                &[
                    Arg::Ptr(gp),
                    Arg::Ptr(up_p),
                    Arg::Ptr(sel),
                    Arg::I64(gm.slab as i64),
                    Arg::Ptr(z.ptr),
                    Arg::I32(k as i32),
                    Arg::Ptr(wgt.ptr),
                    Arg::F32(spec.clamp),
                    Arg::Ptr(h.ptr),
                    Arg::I32(ff as i32),
                    Arg::I32(d as i32),
                    Arg::I64(gm.row_bytes as i64),
                    Arg::I32(kk as i32),
                ],
            );
        } else {
            let g = self.scratch(pairs * ff);
            let u = self.scratch(pairs * ff);
            for (m, dst) in [(gm, &g), (um, &u)] {
                self.mm(&Mm {
                    sel: Some(sel),
                    x: z.ptr,
                    x_tok: d,
                    xdiv: k,
                    y: dst.ptr,
                    y_tok: ff,
                    rows: ff,
                    n: pairs,
                    grp: grp_arg,
                    ..m
                });
            }
            self.moe_swiglu(&g, &u, &mut h, wgt, spec.clamp, ff, pairs);
        }
        let part = self.scratch(pairs * d);
        self.mm(&Mm {
            w: dp,
            sel: Some(sel),
            x: h.ptr,
            x_tok: ff,
            y: part.ptr,
            y_tok: d,
            rows: d,
            n: pairs,
            grp: grp_arg,
            ..dm
        });
        self.moe_slot_sum(part.ptr, wgt.ptr, out.ptr, n, k, d);
    }

    /// The slot sum's 16-byte form on or off (`DS4_GPU_MOE_SUM4`); process-wide (tests, A/B).
    pub fn set_moe_sum4(on: bool) {
        SUM4.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// `moe_sum4_f32` launches so far in this process.
    pub fn moe_sum4_launches() -> u64 {
        SUM4_LAUNCHES.load(Ordering::Relaxed)
    }

    /// `out[i][j]` = the sum over slots s = 0..k (in order) of `part[i·k + s][j]`, skipping
    /// slots of route weight exactly 0 (`wgt`; `DevPtr(0)`: none skipped), for `n` tokens of
    /// width `d`.
    pub(super) fn moe_slot_sum(
        &self,
        part: DevPtr,
        wgt: DevPtr,
        out: DevPtr,
        n: usize,
        k: usize,
        d: usize,
    ) {
        let four = d.is_multiple_of(4)
            && part.0.is_multiple_of(16)
            && out.0.is_multiple_of(16)
            && env_code(&SUM4, "DS4_GPU_MOE_SUM4", on_unless_off) == 1;
        let (name, items) = if four {
            SUM4_LAUNCHES.fetch_add(1, Ordering::Relaxed);
            ("moe_sum4_f32", n * d / 4)
        } else {
            ("moe_sum_f32", n * d)
        };
        self.run(
            &ds4_kernels::MATMUL,
            name,
            LaunchDims::linear(items.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(part),
                Arg::Ptr(wgt),
                Arg::Ptr(out),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                Arg::I64(items as i64),
            ],
        );
    }
}
