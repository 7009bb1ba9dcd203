//! `gpu_check [auto|cuda|rocm] [device]`: device info, the conformance suite, then matvec
//! throughput per weight type. Exit status 1 when a check fails.

use ds4_gpu::{Backend, Gpu};
use ds4_quant::GgmlType;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let backend: Backend = args
        .get(1)
        .map_or("auto", |s| s.as_str())
        .parse()
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
    let device = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let t = std::time::Instant::now();
    let gpu = match Gpu::open(backend, device) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2)
        }
    };
    println!("opened in {:.2} s", t.elapsed().as_secs_f64());
    let t = std::time::Instant::now();
    let report = match ds4_gpu::conformance::run(&gpu, 0x5eed, &mut std::io::stdout()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    };
    println!("conformance took {:.2} s", t.elapsed().as_secs_f64());
    // Throughput: decode-sized matrices (4096 wide, model.md §1), ~64-300 MB of weights each.
    println!("matvec throughput (median of 20, event-timed; GB/s of weight bytes):");
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 16384, 4096),
        (GgmlType::Q8_0, 1024, 4096),
        (GgmlType::Q2_K, 16384, 4096),
        (GgmlType::Q4_K, 16384, 4096),
        (GgmlType::IQ2_XXS, 16384, 4096),
        (GgmlType::F16, 16384, 4096),
        (GgmlType::F32, 4096, 4096),
        (GgmlType::Q8_0, 4096, 65536),
    ] {
        match ds4_gpu::conformance::time_matvec(&gpu, ty, rows, cols, 20) {
            Ok((ms, gbs)) => println!(
                "  {ty:8} {rows:6} x {cols:6}: {ms:8.4} ms  {gbs:7.1} GB/s  (plan {:?})",
                gpu.matvec_plan(rows, cols)
            ),
            Err(e) => println!("  {ty} {rows} x {cols}: error {e}"),
        }
    }
    if report.failed() > 0 {
        std::process::exit(1);
    }
}
