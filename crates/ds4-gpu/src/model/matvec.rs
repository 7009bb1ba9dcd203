//! Decode-time weight products (n ≤ 4 token rows). Each entry returns true when it ran the product, false to leave it to the general
//! kernels of matmul.rs (unsupported type or shape). Semantics: ds4-cpu backend.rs.
//!
//! Kernels: `gpu/matvec.cu` (`mv<NT>_<t>`, `mvgu_<t>`, `mvdown_<t>`): lanes over consecutive
//! 8-element slices (coalesced x and weight loads), x kept in registers across the MV_R rows of a
//! warp, `kspl` warps of a CTA splitting the columns of the same rows only when rows are few.

use super::{type_suffix as suffix, GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
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

/// Whether one-row products (decode, n = 1) take these kernels too. Off by default: on the
/// full-size q2 model on an H200 the coalesced kernels of matmul.rs decode faster (51.9 against
/// 37–45 tok/s, bench/results/gpu-resident-full-q2.txt); n = 2..4 (speculative verification)
/// stay here, where one read of the weights serves every row.
static ONE: AtomicBool = AtomicBool::new(false);

/// Opt-in n = 1 kernel variant (0: default `mv1_*`; 1..=3: `mv1v<v>_*` for Q8_0, Q2_K, Q4_K,
/// IQ2_XXS, see matvec.cu); process-wide, for tests and benchmarks. Not yet measured.
static VARIANT: AtomicU8 = AtomicU8::new(0);

/// Rows per warp of each variant.
const VARIANT_ROWS: [usize; 4] = [MV_R, 1, 2, 4];

/// A matrix weight the kernels take: (pointer, type suffix, cols, rows, row_bytes). Needs
/// whole 32-element chunks and 16-byte aligned rows for the float types (16-byte slice loads).
fn mat(w: &GpuWeight) -> Option<(DevPtr, &'static str, usize, usize, usize)> {
    let GpuWeight::Mat {
        buf,
        ty,
        cols,
        rows,
        row_bytes,
        ..
    } = w
    else {
        return None;
    };
    let sfx = suffix(*ty)?;
    let p = buf.ptr();
    let wide = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if *cols == 0 || *rows == 0 || !cols.is_multiple_of(32) || !p.0.is_multiple_of(16) {
        return None;
    }
    if wide && !row_bytes.is_multiple_of(16) {
        return None;
    }
    Some((p, sfx, *cols, *rows, *row_bytes))
}

impl GpuBackend {
    /// Use (true, the default) or skip the decode kernels; process-wide, for tests and benches.
    pub fn set_matvec(on: bool) {
        ENABLED.store(on, Ordering::Relaxed);
        ONE.store(on, Ordering::Relaxed);
    }

    /// Select the n = 1 kernel variant (0 default, 1..=3 opt-in; others read as 0).
    pub fn set_matvec_variant(v: u8) {
        VARIANT.store(if v <= 3 { v } else { 0 }, Ordering::Relaxed);
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
            && (n > 1 || ONE.load(Ordering::Relaxed))
            && x.ptr.0.is_multiple_of(16)
            && !self.failed()
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
        let v = if n == 1 && matches!(sfx, "q8_0" | "q2_k" | "q4_k" | "iq2_xxs") {
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
        if !self.mv_ok(n, x) {
            return false;
        }
        let Some((p, sfx, cols, rows, rb)) = mat(w) else {
            return false;
        };
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * rows * rb,
        };
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

    /// Backend::matmul_grouped.
    pub(crate) fn mv_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        if !self.mv_ok(n, x) || groups == 0 {
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
