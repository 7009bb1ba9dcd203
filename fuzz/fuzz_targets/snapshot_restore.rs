//! Restore arbitrary session snapshots into a tiny model's session. The input is a snapshot
//! without its checksum: the target appends the SHA-256 so that the parser behind the
//! checksum is what gets exercised (a damaged file with a valid sum: a bug or a hostile
//! cache directory). Restores must fail with an error or give a state that can run on.
#![no_main]

use ds4_engine::{Engine, EngineOptions};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds4-fuzz-snap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("tiny.gguf");
        ds4_synth::synth_tiny(&out, 7).unwrap();
        let mut opts = EngineOptions::new(&out);
        opts.threads = Some(1);
        let e = Engine::open(&opts).unwrap();
        let _ = std::fs::remove_dir_all(&dir); // the mapping stays valid
        e
    })
}

/// Seeds: `DS4_FUZZ_SEEDS=DIR` writes this model's snapshots (checksum stripped) at a few
/// lengths into DIR on the first run (then run with DIR as the corpus).
fn write_seeds(e: &Engine) {
    let Some(dir) = std::env::var_os("DS4_FUZZ_SEEDS") else {
        return;
    };
    std::fs::create_dir_all(&dir).unwrap();
    for n in [0usize, 1, 9, 37, 130] {
        let mut s = e.new_session(256);
        let toks: Vec<u32> = (0..n as u32).map(|i| 3 + i * 7 % 200).collect();
        if n > 0 {
            s.eval_all(&toks).unwrap();
        }
        let mut b = s.snapshot();
        b.truncate(b.len() - 32);
        std::fs::write(std::path::Path::new(&dir).join(format!("snap-{n}")), b).unwrap();
    }
}

fuzz_target!(|data: &[u8]| {
    let e = engine();
    static SEEDS: OnceLock<()> = OnceLock::new();
    SEEDS.get_or_init(|| write_seeds(e));
    let mut b = data.to_vec();
    let sum: [u8; 32] = Sha256::digest(&b).into();
    b.extend_from_slice(&sum);
    let mut s = e.new_session(256);
    match s.restore(&b) {
        Ok(()) => {
            // A restored state snapshots to bytes that restore to the same state (one
            // round: value encodings may change from the input's), then runs on.
            assert!(s.tokens().len() <= 256);
            let again = s.snapshot();
            let mut t = e.new_session(256);
            t.restore(&again)
                .expect("a snapshot of a restored state restores");
            assert!(t.snapshot() == again, "snapshot round trip");
            if s.tokens().len() < 256 {
                let _ = s.eval(5);
            }
        }
        Err(err) => {
            let m = err.to_string();
            assert!(!m.is_empty());
        }
    }
});
