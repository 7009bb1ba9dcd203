//! CPU reference backend: the DS4 forward pass in f32, weights read from the mmap.

pub mod forward;
pub mod math;
pub mod rope;
pub mod weights;

pub use forward::{CpuModel, Rounding, State};
pub use weights::{MatAccel, Weights};
