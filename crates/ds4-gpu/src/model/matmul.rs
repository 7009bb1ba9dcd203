//! Weight products on the GPU: dense matmul over `n` rows, grouped output projection, and the
//! routed experts. Baseline: one matvec launch per row (`Gpu::matvec`); the MoE reads the
//! selection back to the host (one sync per MoE layer).

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::runtime::DevPtr;
use ds4_backend::{Backend, MoeSpec, Part};

impl GpuBackend {
    /// `y[i] = W[rows r0 .. r0+rows] · x[i]` for one product, row pointers given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matvec_rows(
        &self,
        w: &GpuWeight,
        byte0: usize,
        rows: usize,
        x: DevPtr,
        y: DevPtr,
    ) {
        let GpuWeight::Mat { buf, ty, cols, .. } = w else {
            self.note::<()>(Err(crate::GpuError::Invalid(
                "matmul on a vector weight".into(),
            )));
            return;
        };
        if self.failed() {
            return;
        }
        let plan = self.gpu.matvec_plan(rows, *cols);
        let scratch = self.scratch(plan.scratch_elems(rows));
        let r = self.gpu.matvec(
            *ty,
            buf.ptr().offset(byte0 as u64),
            x,
            y,
            rows,
            *cols,
            Some((scratch.ptr, scratch.len)),
            self.stream,
        );
        self.note(r);
    }

    pub(crate) fn op_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        let GpuWeight::Mat {
            cols,
            rows,
            row_bytes,
            ..
        } = *w
        else {
            return self.matvec_rows(w, 0, 0, x.ptr, y.ptr);
        };
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * rows * row_bytes,
        };
        for i in 0..n {
            self.matvec_rows(
                w,
                byte0,
                rows,
                x.ptr.offset((i * cols * 4) as u64),
                y.ptr.offset((i * rows * 4) as u64),
            );
        }
    }

    pub(crate) fn op_matmul_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        let GpuWeight::Mat {
            cols,
            rows,
            row_bytes,
            ..
        } = *w
        else {
            return self.matvec_rows(w, 0, 0, x.ptr, y.ptr);
        };
        let r = rows / groups;
        for i in 0..n {
            for g in 0..groups {
                self.matvec_rows(
                    w,
                    g * r * row_bytes,
                    r,
                    x.ptr.offset(((i * groups + g) * cols * 4) as u64),
                    y.ptr.offset(((i * rows + g * r) * 4) as u64),
                );
            }
        }
    }

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
        let (k, d, ff) = (spec.n_used, spec.d, spec.ff);
        let sel = self.download_i32(sel, n * k);
        let wgt = self.download(wgt, n * k);
        let g = self.scratch(ff);
        let u = self.scratch(ff);
        let y = self.scratch(d);
        self.zero(out.ptr, n * d);
        let slab = |w: &GpuWeight| match *w {
            GpuWeight::Mat {
                rows, row_bytes, ..
            } => rows * row_bytes,
            _ => 0,
        };
        for i in 0..n {
            for s in 0..k {
                let e = sel[i * k + s].max(0) as usize;
                let x = z.ptr.offset((i * d * 4) as u64);
                self.matvec_rows(gate, e * slab(gate), ff, x, g.ptr);
                self.matvec_rows(up, e * slab(up), ff, x, u.ptr);
                self.run(
                    &ds4_kernels::ELEMENTWISE,
                    "swiglu_f32",
                    crate::LaunchDims::linear(ff.div_ceil(256) as u32, 256),
                    &[
                        crate::Arg::Ptr(g.ptr),
                        crate::Arg::Ptr(u.ptr),
                        crate::Arg::Ptr(g.ptr),
                        crate::Arg::F32(spec.clamp),
                        crate::Arg::F32(wgt[i * k + s]),
                        crate::Arg::I64(ff as i64),
                    ],
                );
                self.matvec_rows(down, e * slab(down), d, g.ptr, y.ptr);
                let o = out.ptr.offset((i * d * 4) as u64);
                self.run(
                    &ds4_kernels::ELEMENTWISE,
                    "add_f32",
                    crate::LaunchDims::linear(d.div_ceil(256) as u32, 256),
                    &[
                        crate::Arg::Ptr(o),
                        crate::Arg::Ptr(y.ptr),
                        crate::Arg::Ptr(o),
                        crate::Arg::I64(d as i64),
                    ],
                );
            }
        }
    }
}
