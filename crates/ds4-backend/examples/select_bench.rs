//! Host pick cost at the vocabulary's size: `cargo run --release -p ds4-backend --example
//! select_bench` prints ms a pick of `sample::select` for greedy, full-vocabulary and top-k
//! samplers on 129,280 random logits (what a speculative step on a GPU adds a pick, and why
//! a GPU session picks on the device, speculative steps included).
use ds4_backend::sample::select;
use ds4_backend::SampleParams;
use std::time::Instant;

fn main() {
    let mut s = 12345u64;
    let logits: Vec<f32> = (0..129_280)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
        })
        .collect();
    let t = |temperature| SampleParams {
        temperature,
        ..Default::default()
    };
    let cases = [
        ("greedy", t(0.0)),
        (
            "temp 1, min-p 0.05 (thinking)",
            SampleParams {
                min_p: 0.05,
                ..t(1.0)
            },
        ),
        (
            "temp 0.8, top-p 0.95",
            SampleParams {
                top_p: 0.95,
                ..t(0.8)
            },
        ),
        (
            "temp 1, top-k 64",
            SampleParams {
                top_k: 64,
                ..t(1.0)
            },
        ),
        (
            "temp 1, top-k 1024",
            SampleParams {
                top_k: 1024,
                ..t(1.0)
            },
        ),
    ];
    for (name, c) in cases {
        let reps = 50;
        let mut acc = 0u64;
        let t0 = Instant::now();
        for i in 0..reps {
            acc += select(&logits, &c, (i as f64 + 0.5) / reps as f64) as u64;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
        println!("{name:32} {ms:8.3} ms a pick  (checksum {acc})");
    }
}
