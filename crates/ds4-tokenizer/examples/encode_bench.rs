//! Single-thread encode throughput over the oracle corpus, repeated to >= 50 MB.
//!
//!     cargo run -p ds4-tokenizer --release --example encode_bench
//!
//! Prints MB/s (1 MB = 1e6 bytes) for plain `encode` (warm piece cache, as in a
//! long-running server) and for a cold cache (a fresh tokenizer for each pass).

use ds4_tokenizer::{builtin, Tokenizer};
use std::io::Read;
use std::time::Instant;

fn main() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/oracle.jsonl.gz");
    let gz = std::fs::read(path).expect("corpus");
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
    let vocab = builtin::deepseek_v4();
    let tok = Tokenizer::from_builtin(vocab.clone()).expect("vocab");
    println!(
        "corpus: {} strings, {} bytes; repeated {reps}x = {:.1} MB; tokenizer load {:.0} ms",
        docs.len(),
        corpus_bytes,
        (reps * corpus_bytes) as f64 / 1e6,
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Warm cache: one untimed pass, then the timed repetitions.
    let mut n_tokens = 0usize;
    for d in &docs {
        n_tokens += tok.encode(d).len();
    }
    let t = Instant::now();
    let mut sink = 0usize;
    for _ in 0..reps {
        for d in &docs {
            sink += tok.encode(d).len();
        }
    }
    let dt = t.elapsed().as_secs_f64();
    let mb = (reps * corpus_bytes) as f64 / 1e6;
    println!(
        "encode (warm cache): {mb:.1} MB in {dt:.2} s = {:.1} MB/s, {:.2} M tokens/s ({} tokens per pass)",
        mb / dt,
        sink as f64 / dt / 1e6,
        n_tokens
    );
    // Cold cache: fresh tokenizer per pass (construction not timed).
    let passes = 5;
    let mut dt = 0.0;
    for _ in 0..passes {
        let fresh = Tokenizer::from_builtin(vocab.clone()).expect("vocab");
        let t = Instant::now();
        for d in &docs {
            sink += fresh.encode(d).len();
        }
        dt += t.elapsed().as_secs_f64();
    }
    let mb = (passes * corpus_bytes) as f64 / 1e6;
    println!(
        "encode (cold cache, {passes} passes): {mb:.2} MB in {dt:.3} s = {:.1} MB/s",
        mb / dt
    );
    let t = Instant::now();
    for d in &docs {
        sink += tok.encode_with_specials(d).len();
    }
    let dt = t.elapsed().as_secs_f64();
    println!(
        "encode_with_specials (warm): {:.1} MB/s  [checksum {sink}]",
        corpus_bytes as f64 / 1e6 / dt
    );
}
