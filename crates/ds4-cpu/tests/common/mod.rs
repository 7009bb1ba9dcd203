//! Shared by the CPU tests: open, bind and build a model.
#![allow(dead_code)] // each test binary uses a subset

use ds4_cpu::{CpuModel, Rounding};
use ds4_gguf::GgufFile;
use ds4_model::{bind_main, HParams};
use std::path::Path;
use std::sync::Arc;

pub fn load(path: &Path, rounding: Rounding) -> CpuModel {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let dir = bind_main(&file, &hp).unwrap();
    ds4_cpu::load(hp, &[(file, dir)], rounding).unwrap()
}

/// The tiny synthetic model (q2 mix) for `seed`, rounding steps on.
pub fn tiny(seed: u64) -> CpuModel {
    load(
        &ds4_synth::tiny_model_for_tests(seed, false),
        Rounding::MODEL,
    )
}
