//! CPU reference backend: every op of the backend boundary in f32, weights read from the
//! mmap. `ds4_model::forward` drives it; the numbers every other backend must match.

pub mod backend;
pub mod math;

pub use backend::{CpuBackend, CpuWeight};
pub use ds4_backend::Rounding;
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, Model};
use ds4_model::{HParams, WeightDir};
use std::sync::Arc;

/// The forward pass on the CPU backend.
pub type CpuModel = Model<CpuBackend>;
/// A session state on the CPU backend.
pub type State = ds4_model::forward::State<CpuBackend>;

/// Bind `files` (main model, then an optional MTP file) on the CPU backend.
pub fn load(
    hp: HParams,
    files: &[(Arc<GgufFile>, WeightDir)],
    rounding: Rounding,
) -> Result<CpuModel, String> {
    let b = CpuBackend::new(rope_tables(&hp));
    Model::load(b, hp, files, rounding, &mut |_, _| {})
}
