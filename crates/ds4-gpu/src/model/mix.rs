//! Model glue ops on the GPU: embedding, hyper-connections, router, elementwise (kernels in
//! `ds4-kernels/gpu/model.cu` and `elementwise.cu`). Reference: ds4-cpu backend.rs.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::error::GpuError;
use crate::runtime::{Arg, LaunchDims};
use ds4_backend::{GgmlType, HcDims, MoeSpec};

/// Most hyper-connection streams the `hc_*` kernels take (`DS4_HC_MAX` in model.cu).
const HC_MAX: usize = 16;
/// Most experts, and experts per token, `moe_route` takes (`DS4_ROUTE_MAX_E`, `_K`).
const ROUTE_MAX_E: usize = 1024;
const ROUTE_MAX_K: usize = 32;

impl GpuBackend {
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
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "rmsnorm_f32",
            LaunchDims::linear(rows as u32, 256),
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

    /// HC pre: one CTA per token (Sinkhorn on N threads, the collapse over D).
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

    /// Head collapse, one CTA per token.
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

    /// Router, one CTA per token: hash table (`tid2eid`, an I32 table) or biased top-k.
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
        self.run(
            &ds4_kernels::MODEL,
            "moe_route",
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

    fn hc_ok(&self, hc: &HcDims) -> bool {
        if hc.n == 0 || hc.n > HC_MAX {
            self.invalid(&format!("hc: {} streams (at most {HC_MAX})", hc.n));
            return false;
        }
        true
    }
}
