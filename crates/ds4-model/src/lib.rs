//! DS4 model description: hyper-parameters and their invariants, the per-layer schedule, the
//! tensor list, weight binding, and the forward-pass schedule over the backend boundary (no
//! arithmetic: backends own it).

pub mod bind;
pub mod forward;
pub mod gguf_meta;
pub mod hparams;
pub mod offload;
pub mod schedule;
pub mod sharded;
pub mod synthetic;
pub mod tensors;

pub use bind::{bind_main, bind_mtp, BindError, WeightDir, WeightRef};
pub use hparams::{HParams, HParamsError, MetaSource, MetaValue};
pub use schedule::{AttnKind, LayerKind};
pub use tensors::{main_tensors, mtp_tensors, Family, Mix, TensorSpec};
