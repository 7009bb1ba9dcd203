//! Read arbitrary bytes as a disk KV cache entry (ds4-kvstore's format). Where the fixed
//! header decodes, the head checksum (after the token list) is set to the SHA-256 of the
//! bytes before it, and the last 32 bytes to the SHA-256 of the rest, so that what lies behind
//! both checksums is parsed too. An entry either fails with an error or reads back exactly:
//! its parts written again give the same bytes.
#![no_main]

use ds4_kvstore::format::{read_entry, read_meta, write_entry, Header, FIXED_LEN};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

/// Seeds: `DS4_FUZZ_SEEDS=DIR` saves a few entries (keys, token lists, snapshot and extra
/// bytes of several sizes) into DIR on the first run (then run with DIR as the corpus).
fn write_seeds() {
    let Some(dir) = std::env::var_os("DS4_FUZZ_SEEDS") else {
        return;
    };
    let store = ds4_kvstore::KvStore::open(&dir, u64::MAX, [3; 32]).unwrap();
    for (i, key) in ["k", "<sys>", "<sys>|user: hello|assistant: hi"]
        .iter()
        .enumerate()
    {
        let toks: Vec<u32> = (0..(1 + i as u32 * 5)).collect();
        let snap: Vec<u8> = (0..(i * 40)).map(|x| x as u8).collect();
        let mut meta = ds4_kvstore::SaveMeta::new(ds4_kvstore::Reason::Cold, 4096);
        meta.flags = i as u8;
        meta.extra = vec![7; i * 3];
        store.save(key.as_bytes(), &toks, &snap, &meta).unwrap();
    }
}

fuzz_target!(|data: &[u8]| {
    static SEEDS: std::sync::Once = std::sync::Once::new();
    SEEDS.call_once(write_seeds);
    let mut b = data.to_vec();
    if b.len() >= FIXED_LEN {
        if let Ok(h) = Header::decode(b[..FIXED_LEN].try_into().unwrap()) {
            let at = h.header_sum_offset();
            if at + 32 <= b.len() as u64 {
                let at = at as usize;
                let sum: [u8; 32] = Sha256::digest(&b[..at]).into();
                b[at..at + 32].copy_from_slice(&sum);
            }
        }
    }
    if b.len() >= 32 {
        let body = b.len() - 32;
        let sum: [u8; 32] = Sha256::digest(&b[..body]).into();
        b[body..].copy_from_slice(&sum);
    }
    let len = b.len() as u64;
    let meta = read_meta(&mut &b[..], len, None);
    match read_entry(&mut &b[..], len, None) {
        Ok(e) => {
            let (m, _) = meta.expect("a whole entry has a readable head");
            assert_eq!(m, e.meta);
            let h = &e.meta.header;
            assert_eq!(h.file_len(), len);
            let out = write_entry(
                Vec::new(),
                h,
                &e.meta.key,
                &e.meta.tokens,
                &e.snapshot,
                &e.extra,
            )
            .unwrap();
            assert!(
                out == b,
                "an entry written again differs from what was read"
            );
        }
        Err(err) => assert!(!err.to_string().is_empty()),
    }
});
