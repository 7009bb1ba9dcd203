//! Dense prefill products through the vendor's BLAS-Lt (cuBLASLt / hipBLASLt): not yet
//! implemented; every entry declines, so gemm.rs runs the product.

use super::{GpuBackend, GpuBuf, GpuWeight};
use ds4_backend::Part;

/// Per-backend BLAS-Lt state (handle, workspace), opened on first use.
#[derive(Default)]
pub(crate) struct BlasSlot;

impl GpuBackend {
    /// `y[i] = W·x[i]` (`Part` as in Backend::matmul) for n > 4 rows; false: declined.
    pub(crate) fn blas_matmul(
        &self,
        _w: &GpuWeight,
        _part: Part,
        _x: &GpuBuf,
        _n: usize,
        _y: &mut GpuBuf,
    ) -> bool {
        false
    }

    /// Backend::matmul_grouped for n > 4 rows; false: declined.
    pub(crate) fn blas_grouped(
        &self,
        _w: &GpuWeight,
        _groups: usize,
        _x: &GpuBuf,
        _n: usize,
        _y: &mut GpuBuf,
    ) -> bool {
        false
    }
}
