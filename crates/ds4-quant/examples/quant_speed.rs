//! Quantiser throughput: `cargo run -p ds4-quant --release --example quant_speed`.
use std::time::Instant;

use ds4_quant::{quantize_row, SUPPORTED};

fn main() {
    let n = 4096;
    let rows = 64;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let x: Vec<f32> = (0..n * rows)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect();
    println!(
        "# quantize_row throughput, {rows} rows of {n} (Q2_K/Q4_K/IQ2_XXS use all cores via rayon)"
    );
    for ty in SUPPORTED {
        let rb = ty.row_bytes(n as u64).unwrap() as usize;
        let mut out = vec![0u8; rb];
        let t0 = Instant::now();
        for r in 0..rows {
            quantize_row(ty, &x[r * n..(r + 1) * n], &mut out).unwrap();
        }
        let dt = t0.elapsed().as_secs_f64();
        println!(
            "{:<8} {:>10.2} Mweights/s",
            ty.name(),
            (n * rows) as f64 / dt / 1e6
        );
    }
}
