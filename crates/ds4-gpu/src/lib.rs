//! ds4 GPU layer: CUDA (driver API + NVRTC) and ROCm (HIP + hipRTC) behind one small
//! [`Runtime`] trait, both loaded with `dlopen` at run time — this crate builds and its tests
//! run on machines with no GPU and no toolkit. Kernels come from `ds4-kernels` (one source for
//! both vendors), are compiled at first use and cached on disk ([`cache`]). [`Gpu`] is the host
//! side the engine calls: buffers, staged copies, ops; [`conformance`] checks every op against
//! the CPU reference (`ds4-quant`).

pub mod blas;
pub mod cache;
pub mod ccl;
pub mod compiler;
pub mod conformance;
pub mod cuda;
pub mod error;
pub mod gpu;
pub mod hip;
pub mod loader;
pub mod model;
pub mod precompile;
pub mod runtime;

pub use compiler::{Compiler, Hiprtc, Nvrtc};
pub use error::{GpuError, Result};
pub use gpu::{
    probe, Backend, DeviceBuffer, Gpu, MatvecPlan, DIRECT_GATHERS, DIRECT_UPLOADS, PREFETCHES,
};
pub use model::{GpuBackend, GpuComm, Precision};
pub use runtime::{
    Arg, DevPtr, DeviceInfo, Event, Function, LaunchDims, ModuleHandle, Runtime, Stream, Vendor,
};
