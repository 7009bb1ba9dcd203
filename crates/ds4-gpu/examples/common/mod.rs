//! What the GPU examples share: opening the device and reading numeric arguments.

#![allow(dead_code)] // each example uses what it needs

use ds4_gpu::{Backend, Gpu};

/// The first usable GPU, or exit 2 saying why none opened.
pub fn open_gpu() -> Gpu {
    Gpu::open(Backend::Auto, 0).unwrap_or_else(|e| {
        eprintln!("no GPU: {e}");
        std::process::exit(2)
    })
}

/// Command-line argument `i` as a number, `default` when absent or not a number.
pub fn arg<T: std::str::FromStr>(i: usize, default: T) -> T {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
