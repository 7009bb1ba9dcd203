//! GPU ops against the CPU reference (see `ds4_gpu::conformance`). Skips with the reason when
//! no GPU can be opened, unless DS4_REQUIRE_GPU=1. `DS4_GPU_BACKEND` (auto|cuda|rocm) and
//! `DS4_GPU_DEVICE` pick the device.

use ds4_gpu::{Backend, Gpu};

#[test]
fn ops_match_cpu_reference() {
    let backend: Backend = std::env::var("DS4_GPU_BACKEND")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .unwrap();
    let device = std::env::var("DS4_GPU_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let gpu = match Gpu::open(backend, device) {
        Ok(g) => g,
        Err(e) => {
            if std::env::var("DS4_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("DS4_REQUIRE_GPU=1 but no GPU: {e}");
            }
            println!("skipped: no GPU available: {e}");
            return;
        }
    };
    let report = ds4_gpu::conformance::run(&gpu, 0x5eed, &mut std::io::stdout()).unwrap();
    let failed: Vec<_> = report.checks.iter().filter(|c| !c.passed).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}
