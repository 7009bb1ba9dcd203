//! Attention-state ops on the GPU: RoPE, row rounding, compressors, the lightning indexer and
//! sink attention (kernels in `ds4-kernels/gpu/attention.cu`). Reference: ds4-cpu backend.rs.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuLayerState, GpuWeight};
use crate::error::GpuError;
use ds4_backend::{AttnSpec, CompressSpec, IndexSpec, RopeKind, RowRounding, Which};

impl GpuBackend {
    fn todo(&self, op: &str) {
        self.note::<()>(Err(GpuError::Invalid(format!(
            "GPU op {op} is not implemented yet"
        ))));
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_rope(
        &self,
        _x: &mut GpuBuf,
        _n: usize,
        _heads: usize,
        _width: usize,
        _n_rot: usize,
        _t0: usize,
        _kind: RopeKind,
        _inverse: bool,
    ) {
        self.todo("rope")
    }

    pub(crate) fn op_round_rows(
        &self,
        _x: &mut GpuBuf,
        _rows: usize,
        _width: usize,
        _r: RowRounding,
    ) {
        self.todo("round_rows")
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_compress(
        &self,
        _st: &mut GpuLayerState,
        _which: Which,
        _spec: &CompressSpec,
        _ape: &GpuWeight,
        _norm: &GpuWeight,
        _a: &GpuBuf,
        _g: &GpuBuf,
        _n: usize,
        _t0: usize,
    ) {
        self.todo("compress")
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_index_select(
        &self,
        _st: &GpuLayerState,
        _spec: &IndexSpec,
        _q: &GpuBuf,
        _w: &GpuBuf,
        _n: usize,
        _t0: usize,
        _sel: &mut GpuIBuf,
    ) {
        self.todo("index_select")
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_attend(
        &self,
        _st: &mut GpuLayerState,
        _spec: &AttnSpec,
        _q: &GpuBuf,
        _kv: &GpuBuf,
        _sinks: &GpuWeight,
        _sel: Option<&GpuIBuf>,
        _n: usize,
        _t0: usize,
        _out: &mut GpuBuf,
    ) {
        self.todo("attend")
    }
}
