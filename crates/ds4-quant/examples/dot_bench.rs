//! Dot-product throughput per type and ISA path on one core, in GB/s of weight bytes.
//!
//! `cargo run -p ds4-quant --release --example dot_bench [-- --quick]`
//!
//! Two working sets: "L2" (≈192 KiB of weights, re-read from cache) and "mem" (512 MiB, larger
//! than the 300 MiB L3 of the machines measured, so streamed from DRAM). Rows are 4096 elements
//! (the model's hidden size), random valid codes. Each
//! measurement is the best of 5 repetitions of ≥ 0.1 s (0.02 s with --quick).
//!
//! Then the optional activation-quantised path (`ds4_quant::act`, Q8_0/Q8_K activations as in
//! ds4's CPU code): the same throughput, and its difference from exact mode on a matvec of
//! quantised Gaussian weights with a Gaussian input.

use std::hint::black_box;
use std::time::Instant;

use ds4_quant::act::{dot_act_isa, QuantizedAct};
use ds4_quant::{dot_kernel_for, quantize_row, GgmlType, Isa, SUPPORTED};

/// Deterministic xorshift bytes (no dependency on rand in an example).
fn fill(buf: &mut [u8], mut s: u64) {
    for b in buf {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = (s >> 24) as u8;
    }
}

/// Random valid row bytes: random codes, f16 scales set to 0.01, finite scalar values.
fn weights(ty: GgmlType, n: usize, rows: usize) -> Vec<u8> {
    let rb = ty.row_bytes(n as u64).unwrap() as usize;
    let mut w = vec![0u8; rb * rows];
    fill(&mut w, 0x9e37_79b9_7f4a_7c15);
    let d = half::f16::from_f32(0.01).to_le_bytes();
    let fields: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::IQ2_XXS => &[0],
        GgmlType::Q4_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        _ => &[],
    };
    let bb = ty.block_bytes() as usize;
    match ty {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                let v = (c[0] as f32 - 128.0) / 64.0;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c[1] = (c[1] & 0x83) | 0x30; // normal, |v| in [2^-3, 2^0)
            }
        }
        GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c[1] = (c[1] & 0x80) | 0x3f; // normal, |v| in [2^-2, 2^0) (no subnormal stalls)
            }
        }
        _ => {
            for b in w.chunks_exact_mut(bb) {
                for &o in fields {
                    b[o..o + 2].copy_from_slice(&d);
                }
            }
        }
    }
    w
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let min_t = if quick { 0.02 } else { 0.1 };
    let n = 4096;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    println!("# ds4-quant dot_bench: exact-mode dot products, one core, rows of {n} elements");
    println!("# GB/s = weight bytes read / time (1e9 bytes); Gelem/s = weights per ns");
    println!(
        "{:<8} {:<9} {:>10} {:>10} {:>10} {:>10}",
        "type", "path", "L2 GB/s", "L2 Gel/s", "mem GB/s", "mem Gel/s"
    );
    let mut exact_mem = std::collections::HashMap::new();
    for ty in SUPPORTED {
        let rb = ty.row_bytes(n as u64).unwrap() as usize;
        let rows_l2 = (192 << 10) / rb;
        let rows_dram = ((512 << 20) / rb).max(1);
        let w_dram = weights(ty, n, rows_dram);
        let w_l2 = &w_dram[..rows_l2.max(1) * rb];
        for isa in Isa::available() {
            let k = dot_kernel_for(ty, isa).unwrap();
            let mut rates = Vec::new();
            for w in [w_l2, &w_dram[..]] {
                let rows = w.len() / rb;
                let mut best = f64::INFINITY;
                for _ in 0..5 {
                    let t0 = Instant::now();
                    let mut passes = 0usize;
                    let mut acc = 0f32;
                    while t0.elapsed().as_secs_f64() < min_t {
                        for r in 0..rows {
                            acc += k.dot(black_box(&w[r * rb..(r + 1) * rb]), black_box(&x));
                        }
                        passes += 1;
                    }
                    black_box(acc);
                    best = best.min(t0.elapsed().as_secs_f64() / passes as f64);
                }
                let bytes = w.len() as f64;
                let elems = (rows * n) as f64;
                rates.push((bytes / best / 1e9, elems / best / 1e9));
            }
            println!(
                "{:<8} {:<9} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                ty.name(),
                isa.to_string(),
                rates[0].0,
                rates[0].1,
                rates[1].0,
                rates[1].1
            );
            exact_mem.insert((ty.id(), isa.to_string()), rates[1].0);
        }
    }

    println!();
    println!("# activation-quantised path (x quantised once per matvec, not counted in the time);");
    println!("# rel.RMS diff = ‖y_act − y_exact‖/‖y_exact‖ over 256 quantised Gaussian rows;");
    println!(
        "# vs exact = mem GB/s over exact mode's best path in the table above (portable-act: over portable)"
    );
    println!(
        "{:<8} {:<9} {:>10} {:>10} {:>10} {:>10}   {:>12} {:>12}",
        "type", "path", "L2 GB/s", "L2 Gel/s", "mem GB/s", "mem Gel/s", "rel.RMS diff", "vs exact"
    );
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ] {
        let rb = ty.row_bytes(n as u64).unwrap() as usize;
        let rows_l2 = (192 << 10) / rb;
        let rows_dram = ((512 << 20) / rb).max(1);
        let w_dram = weights(ty, n, rows_dram);
        let w_l2 = &w_dram[..rows_l2.max(1) * rb];
        let xa = QuantizedAct::for_weight(ty, &x).unwrap();
        // Accuracy: 256 rows of quantised pseudo-Gaussian weights (sum of 4 uniforms).
        let acc_rows = 256;
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut unif = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let wf: Vec<f32> = (0..acc_rows * n)
            .map(|_| (unif() + unif() + unif() + unif()) * 1.7)
            .collect();
        let xg: Vec<f32> = (0..n)
            .map(|_| (unif() + unif() + unif() + unif()) * 1.7)
            .collect();
        let mut wq = vec![0u8; acc_rows * rb];
        for (src, dst) in wf.chunks_exact(n).zip(wq.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst).unwrap();
        }
        let xga = QuantizedAct::for_weight(ty, &xg).unwrap();
        let ke = dot_kernel_for(ty, Isa::best()).unwrap();
        let (mut num, mut den) = (0f64, 0f64);
        for r in 0..acc_rows {
            let row = &wq[r * rb..(r + 1) * rb];
            let e = ke.dot(row, &xg) as f64;
            let f = dot_act_isa(ty, row, &xga, Isa::best()).unwrap() as f64;
            num += (f - e) * (f - e);
            den += e * e;
        }
        let rel = (num / den).sqrt();
        // The act path has no AVX-512 kernels (AVX-512BW forms measured no faster on the
        // machines here): Avx512 runs the AVX2 ones.
        for isa in Isa::available().into_iter().filter(|i| *i != Isa::Avx512) {
            let mut rates = Vec::new();
            for w in [w_l2, &w_dram[..]] {
                let rows = w.len() / rb;
                let mut best = f64::INFINITY;
                for _ in 0..5 {
                    let t0 = Instant::now();
                    let mut passes = 0usize;
                    let mut acc = 0f32;
                    while t0.elapsed().as_secs_f64() < min_t {
                        for r in 0..rows {
                            acc += dot_act_isa(
                                ty,
                                black_box(&w[r * rb..(r + 1) * rb]),
                                black_box(&xa),
                                isa,
                            )
                            .unwrap();
                        }
                        passes += 1;
                    }
                    black_box(acc);
                    best = best.min(t0.elapsed().as_secs_f64() / passes as f64);
                }
                rates.push((w.len() as f64 / best / 1e9, (rows * n) as f64 / best / 1e9));
            }
            // Exact mode's mem throughput from the first table (portable-act: portable).
            let exact_isa = if isa == Isa::Portable {
                Isa::Portable
            } else {
                Isa::best()
            };
            let exact_rate = exact_mem[&(ty.id(), exact_isa.to_string())];
            println!(
                "{:<8} {:<9} {:>10.2} {:>10.2} {:>10.2} {:>10.2}   {:>12.2e} {:>11.2}x",
                ty.name(),
                format!("{isa}-act"),
                rates[0].0,
                rates[0].1,
                rates[1].0,
                rates[1].1,
                rel,
                rates[1].0 / exact_rate
            );
        }
    }
}
