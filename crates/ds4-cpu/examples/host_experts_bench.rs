//! Speed of routed experts in host memory (`--cpu-experts`): one full-size layer's stacks (q2
//! mix: IQ2_XXS gate/up 4096 x 2048 x 256, Q2_K down 2048 x 4096 x 256, 1.81 GB of random
//! blocks; with `q4`, the q4 mix's Q4_K stacks, 3.62 GB) and `CpuHostExperts::run` for a decode step (1 token, 6 random experts) and for small
//! batches, with f32 activations (`--precision exact`) and int8 ones (`fast`, the default),
//! alternating. Prints ms a layer and what 43 such layers allow per token.
//!
//!     cargo run --release -p ds4-cpu --example host_experts_bench [-- ITERS [q4]]

use ds4_backend::{GgmlType, MoeSpec};
use ds4_cpu::CpuHostExperts;
use ds4_model::forward::rope_tables;
use ds4_model::offload::{HostExperts, HostStack};
use ds4_model::synthetic::SynthPreset;
use std::time::Instant;

/// A stack of `e` experts of `rows x cols` random blocks of `ty`, with small f16 scales.
fn stack(name: &str, ty: GgmlType, cols: u64, rows: u64, e: u64, seed: u64) -> HostStack {
    let (blk, d_at): (usize, &[usize]) = match ty {
        GgmlType::IQ2_XXS => (66, &[0]),
        GgmlType::Q2_K => (84, &[80, 82]),
        GgmlType::Q4_K => (144, &[0, 2]),
        _ => unreachable!(),
    };
    HostStack::in_memory(name, ty, [cols, rows, e], |out| {
        let mut x = seed | 1;
        for b in out.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for (i, v) in b.iter_mut().enumerate() {
                *v = (x >> (8 * i)) as u8;
            }
        }
        for block in out.chunks_exact_mut(blk) {
            for &o in d_at {
                block[o..o + 2].copy_from_slice(&0x1800u16.to_le_bytes()); // f16 ~2^-9
            }
        }
        Ok(())
    })
    .unwrap()
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let q4 = std::env::args().nth(2).is_some_and(|a| a == "q4");
    let (hp, _) = SynthPreset::FullQ2.params();
    let (tg, td) = match q4 {
        true => (GgmlType::Q4_K, GgmlType::Q4_K),
        false => (GgmlType::IQ2_XXS, GgmlType::Q2_K),
    };
    let (d, ff, ne, k) = (
        hp.n_embd as u64,
        hp.n_ff_exp as u64,
        hp.n_expert as u64,
        hp.n_expert_used as usize,
    );
    let t = Instant::now();
    let stacks = [
        stack("gate", tg, d, ff, ne, 1),
        stack("up", tg, d, ff, ne, 2),
        stack("down", td, ff, d, ne, 3),
    ];
    let bytes: usize = stacks.iter().map(|s| s.n_bytes).sum();
    println!(
        "layer stacks ({tg} / {td}): {:.2} GB in {:.1} s; {} threads",
        bytes as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    // `--precision exact`'s form (f32 activations) and `fast`'s (int8 activations).
    let exact = CpuHostExperts::new(&stacks, &rope_tables(&hp)).unwrap();
    let int8 = CpuHostExperts::new(&stacks, &rope_tables(&hp))
        .unwrap()
        .with_int8_activations();
    let spec = MoeSpec {
        n_expert: ne as usize,
        n_used: k,
        d: d as usize,
        ff: ff as usize,
        weight_scale: hp.expert_weights_scale,
        clamp: 10.0,
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        x >> 33
    };
    // (tokens, experts a token shares with the previous token's): the last row is an MTP pair
    // whose second token repeats half of the first one's experts (rows read once for both).
    for (n, shared) in [(1usize, 0usize), (2, 0), (4, 0), (8, 0), (2, k / 2)] {
        let z: Vec<f32> = (0..n * d as usize)
            .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..iters {
            // The two forms alternate; each call gets new distinct experts a token (cold in
            // the caches, as in decode).
            for (form, run) in [&exact, &int8].into_iter().enumerate() {
                let mut sel: Vec<i32> = Vec::new();
                for t in 0..n {
                    let mut s: Vec<i32> = match t {
                        0 => Vec::new(),
                        _ => sel[(t - 1) * k..(t - 1) * k + shared].to_vec(),
                    };
                    while s.len() < k {
                        let e = (next() % ne) as i32;
                        if !s.contains(&e) {
                            s.push(e);
                        }
                    }
                    sel.extend(s);
                }
                let wgt = vec![1.0 / k as f32; n * k];
                let t = Instant::now();
                let out = run.run(&spec, &z, &sel, &wgt, n);
                times[form].push(t.elapsed().as_secs_f64());
                assert!(out.iter().all(|v| v.is_finite()));
            }
        }
        for (form, mut times) in times.into_iter().enumerate() {
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let med = times[times.len() / 2];
            let distinct = (n * k - (n - 1) * shared).min(ne as usize);
            let read = distinct as f64 * bytes as f64 / ne as f64;
            println!(
                "n = {n}{}, {}: {:.2} ms a layer (median of {iters}), {:.1} GB/s of expert bytes; 43 layers: {:.1} tokens/s{}",
                if shared > 0 {
                    format!(" ({shared} of {k} experts shared)")
                } else {
                    String::new()
                },
                ["exact (f32 activations)", "fast (int8 activations)"][form],
                med * 1e3,
                read / med / 1e9,
                n as f64 / (43.0 * med),
                if n == 1 { " (decode)" } else { "" }
            );
        }
    }
}
