//! Decode MoE (n ≤ 4 tokens): the routed experts at memory bandwidth. Returns true when it ran
//! the product, false to leave it to matvec.rs / matmul.rs. Semantics: ds4-cpu backend.rs.

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use ds4_backend::MoeSpec;

impl GpuBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dec_moe(
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
