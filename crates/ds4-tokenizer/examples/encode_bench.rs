//! Single-thread encode throughput over the oracle corpus, repeated to >= 50 MB.
//!
//!     cargo run -p ds4-tokenizer --release --example encode_bench [CORPUS.jsonl.gz]
//!
//! Prints MB/s (1 MB = 1e6 bytes) of wall time and of this thread's CPU time (so that a
//! loaded shared machine still gives a usable number), for plain `encode` with the piece
//! cache warm (as in a long-running server), with the cache cleared before every pass
//! (cold), and for `encode_with_specials`.

use ds4_tokenizer::{builtin, Tokenizer};
use std::io::Read;
use std::time::Instant;

/// CPU time of this thread in seconds (Linux schedstat; NaN elsewhere).
fn cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |ns| ns / 1e9)
}

/// Runs `f` over all docs `reps` times; prints and returns MB/s (wall).
fn run(name: &str, docs: &[String], reps: usize, mut f: impl FnMut(&str) -> usize) -> f64 {
    let bytes: usize = docs.iter().map(|d| d.len()).sum::<usize>() * reps;
    let (t, c) = (Instant::now(), cpu_s());
    let mut tokens = 0usize;
    for _ in 0..reps {
        for d in docs {
            tokens += f(d);
        }
    }
    let (dt, dc) = (t.elapsed().as_secs_f64(), cpu_s() - c);
    let mb = bytes as f64 / 1e6;
    println!(
        "{name:<34} {mb:6.1} MB  {dt:6.2} s wall  {:6.1} MB/s wall  {:6.1} MB/s per CPU-s  {:5.2} M tok/s wall",
        mb / dt,
        mb / dc,
        tokens as f64 / dt / 1e6
    );
    mb / dt
}

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/oracle.jsonl.gz").to_string()
    });
    let gz = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut text)
        .expect("gzip");
    let docs: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["t"].as_str().expect("t").to_string()
        })
        .collect();
    let corpus_bytes: usize = docs.iter().map(|d| d.len()).sum();
    let reps = 50_000_000usize.div_ceil(corpus_bytes);
    let t0 = Instant::now();
    let tok = Tokenizer::from_builtin(builtin::deepseek_v4()).expect("vocab");
    println!(
        "corpus: {} strings, {} bytes, repeated {reps}x; tokenizer load (decompress + build) {:.0} ms",
        docs.len(),
        corpus_bytes,
        t0.elapsed().as_secs_f64() * 1e3
    );
    tok.encode(&docs[0]); // touch
    run("warm-up pass", &docs, 1, |d| tok.encode(d).len());
    run("encode, cache warm", &docs, reps, |d| tok.encode(d).len());
    let mut n = 0usize;
    run("encode, cache cleared every pass", &docs, reps, |d| {
        if n == 0 {
            tok.clear_cache(); // start of a pass
        }
        n = (n + 1) % docs.len();
        tok.encode(d).len()
    });
    run("encode_with_specials, cache warm", &docs, reps, |d| {
        tok.encode_with_specials(d).len()
    });
}
