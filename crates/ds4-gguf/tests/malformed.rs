//! Hand-built files (independent of the writer): one valid, then each malformation with its
//! specific message.
use ds4_gguf::{GgmlType, GgufFile, Value};

/// Little-endian byte builder for GGUF pieces.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u8(&mut self, x: u8) -> &mut Self {
        self.0.push(x);
        self
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, x: u32) -> &mut Self {
        self.str(key).u32(4).u32(x)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, off: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(off)
    }
    fn pad(&mut self, align: usize) -> &mut Self {
        while self.0.len() % align != 0 {
            self.0.push(0);
        }
        self
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    fn pos(&self) -> u64 {
        self.0.len() as u64
    }
}

fn err(r: &Raw) -> String {
    GgufFile::from_bytes("bad.gguf", r.0.clone())
        .unwrap_err()
        .to_string()
}

fn assert_err(r: &Raw, want: &str) {
    let e = err(r);
    assert!(e.contains(want), "error {e:?} does not contain {want:?}");
    assert!(e.starts_with("bad.gguf: "), "{e}");
}

const F32: u32 = 0;
const Q8_0: u32 = 8;

#[test]
fn handcrafted_valid_file_parses() {
    // alignment 64, two tensors stored out of order, an i32 array, a string.
    let mut r = Raw::header(3, 2, 3);
    r.str("general.alignment").u32(4).u32(64);
    r.str("ratios")
        .u32(9)
        .u32(5)
        .u64(3)
        .u32(0)
        .u32(4)
        .u32(u32::MAX); // i32 [0, 4, -1]
    r.str("name").u32(8).str("tiny");
    let info_a = r.pos();
    r.tensor("a", &[32, 2], Q8_0, 64); // 68 bytes at data+64
    let info_b = r.pos();
    r.tensor("b", &[3], F32, 0); // 12 bytes at data+0
    r.pad(64);
    let data = r.pos();
    r.bytes(&[1; 12]).zeros(52).bytes(&[2; 68]);
    let f = GgufFile::from_bytes("ok.gguf", r.0.clone()).unwrap();
    assert_eq!((f.alignment(), f.data_offset()), (64, data));
    let a = f.tensor("a").unwrap();
    assert_eq!(
        (a.offset, a.n_bytes, a.n_elements, a.info_offset),
        (data + 64, 68, 64, info_a)
    );
    assert_eq!((a.ty, a.dims.as_slice()), (GgmlType::Q8_0, &[32u64, 2][..]));
    assert_eq!(f.tensor_data(a), &[2; 68][..]);
    let b = f.tensor("b").unwrap();
    assert_eq!((b.offset, b.info_offset), (data, info_b));
    assert_eq!(f.tensor_data(b), &[1; 12][..]);
    assert_eq!(f.get("ratios"), Some(&Value::from(vec![0i32, 4, -1])));
    assert_eq!(f.require_str("name").unwrap(), "tiny");
    // A file whose last byte is the last tensor byte is complete.
    r.0.truncate(r.0.len());
    assert!(GgufFile::from_bytes("ok.gguf", r.0).is_ok());
}

#[test]
fn bad_magic_and_version() {
    let mut r = Raw(b"GGML".to_vec());
    r.u32(3).u64(0).u64(0);
    assert_err(&r, "not a GGUF file: the first bytes are [47, 47, 4d, 4c]");
    assert_err(&Raw(vec![]), "not a GGUF file: the first bytes are []");
    assert_eq!(
        err(&Raw::header(2, 0, 0)),
        "bad.gguf: GGUF version 2 is not supported (only version 3)"
    );
    let mut short = Raw(b"GGUF".to_vec());
    short.u8(3);
    assert_err(
        &short,
        "header: version at byte 4 needs 4 bytes but the file has 5 bytes",
    );
}

#[test]
fn counts_larger_than_the_file() {
    assert_eq!(
        err(&Raw::header(3, 1 << 40, 0)),
        "bad.gguf: header: tensor count (count at byte 8) is 1099511627776, but the 8 bytes left in the file hold at most 0"
    );
    let mut r = Raw::header(3, 0, 5);
    r.zeros(64);
    assert_err(&r, "header: metadata count (count at byte 16) is 5, but the 64 bytes left in the file hold at most 4");
    // Tensor count that fits the whole file but not what is left after the metadata.
    let mut r = Raw::header(3, 2, 1);
    r.kv_u32("k", 1).zeros(40);
    assert_err(
        &r,
        "tensor count (count at byte 8) is 2, but the 40 bytes left in the file hold at most 1",
    );
    // Array length.
    let mut r = Raw::header(3, 0, 1);
    r.str("arr").u32(9).u32(4).u64(1 << 40).zeros(16);
    assert_err(&r, "metadata key arr (record at byte 24): array length (count at byte 43) is 1099511627776, but the 16 bytes left in the file hold at most 4");
    let mut r = Raw::header(3, 0, 1);
    r.str("strs").u32(9).u32(8).u64(3).str("a").zeros(2);
    assert_err(
        &r,
        "array length (count at byte 44) is 3, but the 11 bytes left in the file hold at most 1",
    );
}

#[test]
fn strings_past_eof_and_bad_utf8() {
    let mut r = Raw::header(3, 0, 1);
    r.u64(1000).bytes(b"abcdefghijklm");
    assert_eq!(
        err(&r),
        "bad.gguf: metadata record 0 (at byte 24): key: string length 1000 (at byte 24) runs past the end of the file (13 bytes left)"
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(8).u64(u64::MAX).zeros(4);
    assert_err(&r, "metadata key s (record at byte 24): string length 18446744073709551615 (at byte 37) runs past the end of the file (4 bytes left)");
    let mut r = Raw::header(3, 0, 1);
    r.str("v")
        .u32(9)
        .u32(8)
        .u64(2)
        .str("ok")
        .u64(9)
        .bytes(b"abc");
    assert_err(
        &r,
        "metadata key v (record at byte 24): element 1: string length 9",
    );
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).bytes(&[0xff, 0xfe]).u32(0).u8(1);
    assert_eq!(
        err(&r),
        "bad.gguf: metadata record 0 (at byte 24): key (string at byte 24) is not valid UTF-8: \"\\xff\\xfe\""
    );
    let mut r = Raw::header(3, 1, 0);
    r.u64(3).bytes(b"a\xc3(").u32(1).u64(1).u32(F32).u64(0);
    assert_err(
        &r,
        "tensor info 0 (at byte 24): name (string at byte 24) is not valid UTF-8",
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(8).u64(1).u8(0x80);
    assert_err(
        &r,
        "metadata key s (record at byte 24) (string at byte 37) is not valid UTF-8",
    );
}

#[test]
fn unknown_value_types_bad_bools_and_deep_nesting() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u64(0);
    assert_eq!(
        err(&r),
        "bad.gguf: metadata key k (record at byte 24): unknown value type id 13 at byte 33"
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(99).u64(0);
    assert_err(
        &r,
        "metadata key k (record at byte 24): unknown value type id 99 at byte 37",
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("b").u32(7).u8(2);
    assert_err(
        &r,
        "metadata key b (record at byte 24): bool byte at 37 is 2, expected 0 or 1",
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("b").u32(9).u32(7).u64(3).bytes(&[1, 0, 7]);
    assert_err(&r, "bool byte at 51 is 7");
    // 9 nested arrays: one deeper than allowed; 8 is fine.
    for (levels, ok) in [(8, true), (9, false)] {
        let mut r = Raw::header(3, 0, 1);
        r.str("deep").u32(9);
        for _ in 0..levels - 1 {
            r.u32(9).u64(1);
        }
        r.u32(0).u64(1).u8(42);
        let res = GgufFile::from_bytes("bad.gguf", r.0.clone());
        assert_eq!(res.is_ok(), ok, "{levels}");
        if !ok {
            assert_err(
                &r,
                "metadata key deep (record at byte 24): arrays nested deeper than 8 levels",
            );
        }
    }
}

#[test]
fn truncated_metadata_values() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(10).bytes(&[1, 2, 3]);
    assert_eq!(
        err(&r),
        "bad.gguf: metadata key k (record at byte 24): value at byte 37 needs 8 bytes but the file has 40 bytes (truncated?)"
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("kkkkk").bytes(&[4, 0]);
    assert_err(
        &r,
        "metadata key kkkkk (record at byte 24): value type at byte 37 needs 4 bytes",
    );
}

#[test]
fn bad_tensor_infos() {
    let info = Raw::header(3, 1, 0).pos();
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[32], 4, 0);
    assert_eq!(
        err(&r),
        format!("bad.gguf: tensor w (info at byte {info}): unknown ggml type id 4")
    );
    let mut r = Raw::header(3, 1, 0);
    r.str("w").u32(0).zeros(32);
    assert_eq!(
        err(&r),
        "bad.gguf: tensor w (info at byte 24): n_dims is 0, expected 1 to 4"
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[1, 1, 1, 1, 1], F32, 0);
    assert_err(
        &r,
        "tensor w (info at byte 24): n_dims is 5, expected 1 to 4",
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[1 << 32, 1 << 32], F32, 0);
    assert_err(
        &r,
        "tensor w (info at byte 24): dims [4294967296, 4294967296] overflow",
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[1 << 62], F32, 0); // 2^62 elements fit, 2^64 bytes do not
    assert_err(
        &r,
        "tensor w (info at byte 24): dims [4611686018427387904] overflow",
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[0, 1 << 63], F32, 0); // ggml would read a negative ne1
    assert_err(
        &r,
        "tensor w (info at byte 24): dims [0, 9223372036854775808] overflow",
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.7.attn_q_b.weight", &[33, 2], Q8_0, 0);
    assert_err(&r, "tensor blk.7.attn_q_b.weight (info at byte 24): row length ne0 = 33 is not a multiple of the Q8_0 block size 32");
}

#[test]
fn truncated_tensor_info_names_the_field() {
    // A short tensor info fails the count check first (fewer than 32 bytes left)...
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[32], F32, 0);
    r.0.truncate(r.0.len() - 3);
    assert_err(
        &r,
        "tensor count (count at byte 8) is 1, but the 30 bytes left",
    );
    // ...a longer one names the field that is cut short.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("long_tensor_name", &[32], F32, 0);
    r.0.truncate(r.0.len() - 3);
    assert_err(
        &r,
        "tensor long_tensor_name (info at byte 24): offset at byte",
    );
    assert_err(&r, "needs 8 bytes but the file has");
}

#[test]
fn duplicates() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("a", 1);
    let second = r.pos();
    r.kv_u32("a", 2);
    assert_eq!(
        err(&r),
        format!("bad.gguf: duplicate metadata key a (record at byte {second}; first at byte 24)")
    );
    let mut r = Raw::header(3, 2, 0);
    r.tensor("w", &[4], F32, 0);
    let second = r.pos();
    r.tensor("w", &[4], F32, 32);
    r.pad(32).zeros(64);
    assert_eq!(
        err(&r),
        format!("bad.gguf: duplicate tensor name w (info at byte {second}; first at byte 24)")
    );
}

#[test]
fn alignment_key() {
    for (v, found) in [(0u32, "u32 0"), (48, "u32 48")] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", v);
        assert_eq!(
            err(&r),
            format!("bad.gguf: general.alignment (record at byte 24) is {found}; it must be a non-zero power of two u32")
        );
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(8).str("32");
    assert_err(&r, "general.alignment (record at byte 24) is string \"32\"");
}

#[test]
fn misaligned_truncated_and_overlapping_data() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[4], F32, 4);
    r.pad(32).zeros(64);
    assert_eq!(
        err(&r),
        "bad.gguf: tensor w (info at byte 24): data offset 4 is not a multiple of the alignment 32"
    );

    // The "truncated file" message: expected end vs actual size.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.7.attn_q_b.weight", &[32, 4], Q8_0, 0);
    r.pad(32);
    let data = r.pos();
    r.zeros(100);
    assert_eq!(
        err(&r),
        format!(
            "bad.gguf: tensor blk.7.attn_q_b.weight (info at byte 24): data ends at byte {} but the file has {} bytes (truncated?)",
            data + 136,
            data + 100
        )
    );
    // Offset so large that data_offset + offset overflows.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("w", &[4], F32, u64::MAX - 31);
    assert_err(
        &r,
        "data ends at byte 18446744073709551615 but the file has",
    );

    let mut r = Raw::header(3, 3, 0);
    r.tensor("a", &[16], F32, 0); // bytes 0..64
    r.tensor("z", &[0], F32, 32); // empty: overlaps nothing
    let info_b = r.pos();
    r.tensor("b", &[16], F32, 32); // bytes 32..96
    r.pad(32);
    let d = r.pos();
    r.zeros(128);
    assert_eq!(
        err(&r),
        format!(
            "bad.gguf: tensor b (info at byte {info_b}) data bytes {}..{} overlap tensor a (bytes {}..{})",
            d + 32,
            d + 96,
            d,
            d + 64
        )
    );
    // Adjacent tensors do not overlap.
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], F32, 0);
    r.tensor("b", &[16], F32, 64);
    r.pad(32).zeros(128);
    assert!(GgufFile::from_bytes("ok.gguf", r.0).is_ok());
}
