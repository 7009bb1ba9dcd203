//! Decode-time weight products (n ≤ 4 token rows). Each entry returns true when it ran the product, false to leave it to the general
//! kernels of matmul.rs (unsupported type or shape). Semantics: ds4-cpu backend.rs.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use ds4_backend::{MoeSpec, Part};

impl GpuBackend {
    /// `y[i] = W·x[i]` (`Part` as in Backend::matmul).
    pub(crate) fn mv_matmul(
        &self,
        _w: &GpuWeight,
        _part: Part,
        _x: &GpuBuf,
        _n: usize,
        _y: &mut GpuBuf,
    ) -> bool {
        false
    }

    /// Backend::matmul_grouped.
    pub(crate) fn mv_grouped(
        &self,
        _w: &GpuWeight,
        _groups: usize,
        _x: &GpuBuf,
        _n: usize,
        _y: &mut GpuBuf,
    ) -> bool {
        false
    }

    /// Backend::moe_experts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mv_moe(
        &self,
        _spec: &MoeSpec,
        _gate: &GpuWeight,
        _up: &GpuWeight,
        _down: &GpuWeight,
        _z: &GpuBuf,
        _sel: &GpuIBuf,
        _wgt: &GpuBuf,
        _n: usize,
        _out: &mut GpuBuf,
    ) -> bool {
        false
    }
}
