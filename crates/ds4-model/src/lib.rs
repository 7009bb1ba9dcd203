//! DS4 model description: hyper-parameters and their invariants, the per-layer schedule, the
//! tensor list, and weight binding. No arithmetic lives here; the forward pass will.

pub mod bind;
pub mod gguf_meta;
pub mod hparams;
pub mod schedule;
pub mod tensors;

pub use bind::{bind_main, bind_mtp, BindError, WeightDir, WeightRef};
pub use hparams::{HParams, HParamsError, MetaSource, MetaValue};
pub use schedule::{AttnKind, LayerKind};
pub use tensors::{main_tensors, mtp_tensors, Family, Mix, TensorSpec};
