//! Damaged files: every truncation and thousands of seeded mutations return errors or valid
//! files, never a panic.
mod common;

use common::*;
use ds4_gguf::GgufFile;

/// splitmix64: a tiny deterministic generator, enough for choosing mutations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn every_truncation_is_an_error() {
    for bytes in [small_file(), sample_writer().to_bytes(fill).unwrap()] {
        let full = GgufFile::from_bytes("full.gguf", bytes.clone()).unwrap();
        // The last tensor's data ends before the alignment padding at the end of the file.
        let needed = full
            .tensors()
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .unwrap() as usize;
        for len in 0..needed {
            match GgufFile::from_bytes("cut.gguf", bytes[..len].to_vec()) {
                Ok(_) => panic!("truncation to {len} of {} bytes parsed", bytes.len()),
                Err(e) => assert!(e.to_string().starts_with("cut.gguf: "), "{e}"),
            }
        }
        // Cutting only trailing padding leaves a complete file.
        for len in needed..=bytes.len() {
            let f = GgufFile::from_bytes("cut.gguf", bytes[..len].to_vec()).unwrap();
            walk(&f);
        }
    }
}

#[test]
fn truncation_message_says_truncated() {
    let bytes = small_file();
    let f = GgufFile::from_bytes("x", bytes.clone()).unwrap();
    let t = &f.tensors()[1];
    let cut = (t.offset + 1) as usize;
    let e = GgufFile::from_bytes("model.gguf", bytes[..cut].to_vec()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "model.gguf: tensor {} (info at byte {}): data ends at byte {} but the file has {cut} bytes (truncated?)",
            t.name,
            t.info_offset,
            t.offset + t.n_bytes
        )
    );
}

/// Values that make length and count fields interesting.
const SPECIAL: [u64; 10] = [0, 1, 2, 3, 31, 33, 0xff, 1 << 31, 1 << 62, u64::MAX];

fn mutate(rng: &mut Rng, b: &mut Vec<u8>, header_len: usize) {
    // Bias positions toward the header, where the structure lives.
    let pos = |rng: &mut Rng, len: usize| {
        if rng.below(4) == 0 || header_len == 0 {
            rng.below(len.max(1))
        } else {
            rng.below(header_len.min(len).max(1))
        }
    };
    for _ in 0..1 + rng.below(3) {
        if b.is_empty() {
            return;
        }
        match rng.below(6) {
            0 => {
                let p = pos(rng, b.len());
                b[p] ^= 1 << rng.below(8);
            }
            1 => {
                let p = pos(rng, b.len());
                b[p] = rng.next() as u8;
            }
            // Overwrite a u64 or u32 field (length, count, dim, offset, type id).
            2 | 3 => {
                let p = pos(rng, b.len());
                let v = if rng.below(2) == 0 {
                    SPECIAL[rng.below(SPECIAL.len())]
                } else {
                    rng.next() >> rng.below(64)
                };
                let w = if rng.below(2) == 0 { 8 } else { 4 };
                for (k, byte) in v.to_le_bytes().iter().take(w).enumerate() {
                    if let Some(x) = b.get_mut(p + k) {
                        *x = *byte;
                    }
                }
            }
            4 => {
                let p = pos(rng, b.len());
                let n = 1 + rng.below(16);
                b.drain(p..(p + n).min(b.len()));
            }
            _ => {
                let p = pos(rng, b.len());
                let n = 1 + rng.below(16);
                let fill: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(p..p, fill);
            }
        }
    }
}

#[test]
fn seeded_mutations_never_panic() {
    let seeds = [small_file(), sample_writer().to_bytes(fill).unwrap()];
    let mut rng = Rng(0x5eed_0d54_6667);
    let (mut ok, mut err) = (0, 0);
    for i in 0..6000 {
        let base = &seeds[i % 2];
        let header_len = GgufFile::from_bytes("s", base.clone())
            .unwrap()
            .data_offset() as usize;
        let mut b = base.clone();
        mutate(&mut rng, &mut b, header_len);
        match GgufFile::from_bytes("m.gguf", b) {
            Ok(f) => {
                walk(&f);
                ok += 1;
            }
            Err(e) => {
                assert!(e.to_string().starts_with("m.gguf: "), "{e}");
                err += 1;
            }
        }
    }
    println!("mutations: {ok} still valid, {err} rejected");
    // Both outcomes occur, so the mutations reach past the first checks.
    assert!(ok > 100 && err > 1000, "ok {ok} err {err}");
}
