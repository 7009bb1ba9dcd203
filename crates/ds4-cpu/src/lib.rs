//! CPU reference backend: every op of the backend boundary in f32, weights read from the
//! mmap. `ds4_model::forward` drives it; the numbers every other backend must match.

pub mod backend;
pub mod math;

pub use backend::{CpuBackend, CpuHostExperts, CpuWeight};
pub use ds4_backend::Rounding;
use ds4_backend::{HostComm, Shard};
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, Forward, Model};
use ds4_model::sharded::Sharded;
use ds4_model::{bind_main, HParams, WeightDir};
use std::path::Path;
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

/// The GGUF model at `path` split by experts (and with `tp`, its attention and shared expert:
/// tensor parallelism) over `n_ranks` CPU backends joined by a host all-reduce
/// (`ds4_backend::shard`): the reference for the parallel forms, which the GPU backends run
/// over NCCL / RCCL. One thread per rank and call.
pub fn load_sharded(
    path: &Path,
    rounding: Rounding,
    n_ranks: usize,
    tp: bool,
) -> Result<Sharded, String> {
    let file = Arc::new(GgufFile::open(path).map_err(|e| e.to_string())?);
    let hp = HParams::from_meta(file.as_ref()).map_err(|e| e.to_string())?;
    let dir = bind_main(&file, &hp).map_err(|e| e.to_string())?;
    let files = [(file, dir)];
    let comm = HostComm::new(n_ranks);
    let mut ranks: Vec<Box<dyn Forward>> = Vec::with_capacity(n_ranks);
    for rank in 0..n_ranks {
        let b = CpuBackend::new(rope_tables(&hp)).with_comm(rank, comm.clone());
        let shard = Shard { rank, n_ranks, tp };
        let m = Model::load_shard(b, hp.clone(), &files, rounding, shard, &mut |_, _| {})?;
        ranks.push(Box::new(m));
    }
    Sharded::new(ranks)
}
