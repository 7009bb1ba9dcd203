//! Model glue ops on the GPU: embedding, hyper-connections, router, elementwise (kernels in
//! `ds4-kernels/gpu/model.cu` and `elementwise.cu`). Reference: ds4-cpu backend.rs.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::error::GpuError;
use crate::runtime::{Arg, LaunchDims};
use ds4_backend::{HcDims, MoeSpec};

impl GpuBackend {
    fn todo_mix(&self, op: &str) {
        self.note::<()>(Err(GpuError::Invalid(format!(
            "GPU op {op} is not implemented yet"
        ))));
    }

    pub(crate) fn op_embed(
        &self,
        _table: &GpuWeight,
        _tokens: &GpuIBuf,
        _n: usize,
        _copies: usize,
        _d: usize,
        _out: &mut GpuBuf,
    ) {
        self.todo_mix("embed")
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

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_split(
        &self,
        _hc: HcDims,
        _m: &GpuBuf,
        _scale: &GpuWeight,
        _base: &GpuWeight,
        _x: &GpuBuf,
        _n: usize,
        _z: &mut GpuBuf,
        _post: &mut GpuBuf,
        _comb: &mut GpuBuf,
    ) {
        self.todo_mix("hc_split")
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_collapse(
        &self,
        _hc: HcDims,
        _m: &GpuBuf,
        _scale: &GpuWeight,
        _base: &GpuWeight,
        _x: &GpuBuf,
        _n: usize,
        _y: &mut GpuBuf,
    ) {
        self.todo_mix("hc_collapse")
    }

    pub(crate) fn op_hc_post(
        &self,
        _hc: HcDims,
        _x: &mut GpuBuf,
        _o: &GpuBuf,
        _post: &GpuBuf,
        _comb: &GpuBuf,
        _n: usize,
    ) {
        self.todo_mix("hc_post")
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_moe_route(
        &self,
        _spec: &MoeSpec,
        _logits: &GpuBuf,
        _bias: Option<&GpuWeight>,
        _tid2eid: Option<&GpuWeight>,
        _tokens: &GpuIBuf,
        _n: usize,
        _sel: &mut GpuIBuf,
        _wgt: &mut GpuBuf,
    ) {
        self.todo_mix("moe_route")
    }
}
