//! Save and lookup throughput of the disk KV cache for one large synthetic snapshot.
//! `cargo run -p ds4-kvstore --release --example kv_bench -- [DIR] [MIB]` (default: a temp
//! dir, 256 MiB ≈ 18k tokens of the real model's ~14 KiB/token).

use ds4_kvstore::{KvStore, Reason, SaveMeta};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("ds4-kv-bench-{}", std::process::id()))
        });
    let mib: usize = args
        .next()
        .map_or(256, |s| s.parse().expect("MIB: a number"));
    let snap: Vec<u8> = (0..mib << 20).map(|i| ((i * 31) >> 7) as u8).collect();
    let tokens: Vec<u32> = (0..(mib << 20) as u32 / 14336).collect();
    let key = vec![b'k'; tokens.len() * 4];
    let store = KvStore::open(&dir, 1 << 40, [5; 32]).unwrap();
    let t = Instant::now();
    store
        .save(&key, &tokens, &snap, &SaveMeta::new(Reason::Evict, 32768))
        .unwrap();
    let ts = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let hit = store
        .lookup_longest_prefix(&[&key[..], b"tail"].concat(), 1, usize::MAX)
        .expect("hit");
    let tl = t.elapsed().as_secs_f64();
    assert_eq!(hit.snapshot.len(), snap.len());
    let gb = |s: f64| mib as f64 / 1024.0 / s;
    println!(
        "{mib} MiB, {} tokens: save {ts:.3} s ({:.2} GiB/s, incl. fsync), lookup+verify {tl:.3} s ({:.2} GiB/s)",
        tokens.len(),
        gb(ts),
        gb(tl)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
