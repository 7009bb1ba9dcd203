//! Writer → reader round trips and typed metadata access.
mod common;

use common::*;
use ds4_gguf::{
    Array, GgmlType, GgufError, GgufFile, GgufWriter, StringArray, Value, ValueType,
    DEFAULT_ALIGNMENT,
};

#[test]
fn every_value_type_round_trips_in_order() {
    let bytes = sample_writer().to_bytes(fill).unwrap();
    let f = GgufFile::from_bytes("rt.gguf", bytes).unwrap();
    let expected = all_values();
    // The writer appends general.alignment after the caller's keys.
    assert_eq!(f.metadata().len(), expected.len() + 1);
    for ((k, v), e) in expected.iter().zip(f.metadata()) {
        assert_eq!(*k, e.key);
        assert_eq!(*v, e.value, "{k}");
        assert_eq!(f.get(k), Some(v));
    }
    let last = f.metadata().last().unwrap();
    assert_eq!(last.key, "general.alignment");
    assert_eq!(last.value, Value::U32(32));
    // Record offsets increase and the first record follows the 24-byte header.
    assert_eq!(f.metadata()[0].offset, 24);
    assert!(f.metadata().windows(2).all(|w| w[0].offset < w[1].offset));
    assert_eq!(f.version(), 3);
}

#[test]
fn every_tensor_type_round_trips() {
    let w = sample_writer();
    let layout = w.layout().unwrap();
    let bytes = w.to_bytes(fill).unwrap();
    assert_eq!(bytes.len() as u64, layout.total_len);
    let f = GgufFile::from_bytes("rt.gguf", bytes).unwrap();
    assert_eq!(f.alignment(), DEFAULT_ALIGNMENT);
    assert_eq!(f.data_offset(), layout.header.len() as u64);
    assert_eq!(f.tensors().len(), GgmlType::ALL.len() + 2);
    for (i, ty) in GgmlType::ALL.iter().enumerate() {
        let t = &f.tensors()[i];
        assert_eq!(t.name, format!("t.{}", ty.name()));
        assert_eq!(t.ty, *ty);
        assert_eq!(t.dims, dims_for(*ty));
        assert_eq!(t.n_elements, ty.block_elems() * 6);
        assert_eq!(t.n_bytes, ty.block_bytes() * 6);
        assert_eq!(t.row_bytes(), ty.block_bytes() * 2);
        assert_eq!(t.n_rows(), 3);
        assert_eq!(t.offset % 32, 0);
        assert_eq!(t.offset, layout.offsets[i]);
        let mut want = vec![0u8; t.n_bytes as usize];
        pattern(i, &mut want);
        assert_eq!(f.tensor_data(t), &want[..], "{}", t.name);
        assert_eq!(f.tensor(&t.name), Some(t));
    }
    let t4 = f.tensor("t.4d").unwrap();
    assert_eq!((t4.n_elements, t4.n_bytes), (120, 240));
    let empty = f.tensor("t.empty").unwrap();
    assert_eq!((empty.n_elements, f.tensor_data(empty).len()), (0, 0));
    assert!(f.tensor("missing").is_none());
    // Zero-copy: the view points into the file's bytes.
    let all = f.bytes().as_ptr_range();
    assert!(all.contains(&f.tensor_data(&f.tensors()[0]).as_ptr()));
}

#[test]
fn custom_alignment_and_positioned_writes_match_to_bytes() {
    let mut w = GgufWriter::new();
    w.set("general.alignment", 256u32);
    w.add_tensor("a", GgmlType::F32, &[3]).unwrap();
    w.add_tensor("b", GgmlType::Q8_0, &[32, 2]).unwrap();
    let l = w.layout().unwrap();
    assert_eq!(l.header.len() % 256, 0);
    assert_eq!(l.offsets[1] - l.offsets[0], 256);
    assert_eq!(l.sizes, vec![12, 68]);
    assert_eq!(l.total_len, l.offsets[1] + 256);
    // What `ds4 synth` does: set_len, header, then each tensor at its offset.
    let mut manual = vec![0u8; l.total_len as usize];
    manual[..l.header.len()].copy_from_slice(&l.header);
    for i in [1, 0] {
        let r = l.offsets[i] as usize..(l.offsets[i] + l.sizes[i]) as usize;
        pattern(i, &mut manual[r]);
    }
    assert_eq!(manual, w.to_bytes(fill).unwrap());
    let f = GgufFile::from_bytes("al.gguf", manual).unwrap();
    assert_eq!(f.alignment(), 256);
    assert_eq!(f.tensor("b").unwrap().offset % 256, 0);
}

#[test]
fn write_to_path_then_mmap_open() {
    let dir = std::env::temp_dir().join(format!("ds4-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sample.gguf");
    let w = sample_writer();
    w.write_to_path(&path, fill).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.bytes(), &w.to_bytes(fill).unwrap()[..]);
    assert_eq!(f.name(), path.display().to_string());
    walk(&f);
    // A mapping (pages the OS may drop; host-memory experts budget their page-locking on it),
    // unlike the same bytes held in memory.
    assert!(f.is_mapped());
    assert!(!GgufFile::from_bytes("m.gguf", w.to_bytes(fill).unwrap())
        .unwrap()
        .is_mapped());
    // Read-ahead advice: any range inside the file (unaligned included), none outside it.
    let n = f.bytes().len();
    f.will_need(0, n).unwrap();
    f.will_need(3, n - 3).unwrap();
    f.will_need(n, 0).unwrap();
    let e = f.will_need(1, n).unwrap_err().to_string();
    assert!(
        e.contains("outside the file") && e.contains("sample.gguf"),
        "{e}"
    );
    assert!(f.will_need(usize::MAX, 2).is_err());
    // Only the final file is left behind.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("sample.gguf")]);

    // A failing fill leaves neither the target nor a temporary file.
    let bad = dir.join("bad.gguf");
    let err = w
        .write_to_path(&bad, |i, _| {
            if i == 3 {
                Err(GgufError::Write {
                    what: "tensor 3".into(),
                    reason: "generator failed".into(),
                })
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(err.to_string().contains("generator failed"), "{err}");
    assert!(!bad.exists());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

    let missing = GgufFile::open(dir.join("nope.gguf")).unwrap_err();
    assert!(missing.to_string().contains("nope.gguf"), "{missing}");
    let not_file = GgufFile::open(&dir).unwrap_err().to_string();
    assert!(not_file.ends_with(": not a regular file"), "{not_file}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn typed_access_widens_losslessly() {
    let mut w = GgufWriter::new();
    w.set("u8", 200u8);
    w.set("i32.pos", 7i32);
    w.set("i32.neg", -7i32);
    w.set("u64.small", 4096u64);
    w.set("u64.big", 1u64 << 40);
    w.set("f64", 0.25f64);
    w.set("u32", 3u32);
    w.set("flag", true);
    w.set("name", "x");
    w.set("ratios.i32", vec![0i32, 4, 128]);
    w.set("ratios.neg", vec![0i32, -4]);
    w.set("clamp.f64", vec![10.0f64, 7.5]);
    w.set("clamp.i32", vec![10i32]);
    w.set("tokens", vec!["a", "b"]);
    let f = GgufFile::from_bytes("m.gguf", w.to_bytes(fill).unwrap()).unwrap();
    assert_eq!(f.require_u32("u8").unwrap(), 200);
    assert_eq!(f.require_u32("i32.pos").unwrap(), 7);
    assert_eq!(f.require_u32("u64.small").unwrap(), 4096);
    assert_eq!(f.require_u64("u64.big").unwrap(), 1 << 40);
    assert_eq!(f.require_u64("i32.pos").unwrap(), 7);
    assert_eq!(f.require_i64("i32.neg").unwrap(), -7);
    assert_eq!(f.require_f32("f64").unwrap(), 0.25);
    assert_eq!(f.require_f32("u32").unwrap(), 3.0);
    assert_eq!(f.require_f32("i32.neg").unwrap(), -7.0);
    assert!(f.require_bool("flag").unwrap());
    assert_eq!(f.require_str("name").unwrap(), "x");
    assert_eq!(f.require_u32_array("ratios.i32").unwrap(), vec![0, 4, 128]);
    assert_eq!(f.require_f32_array("clamp.f64").unwrap(), vec![10.0, 7.5]);
    assert_eq!(f.require_f32_array("clamp.i32").unwrap(), vec![10.0]);
    assert_eq!(f.require_str_array("tokens").unwrap(), vec!["a", "b"]);
    assert_eq!(f.require_strings("tokens").unwrap().get(1), Some("b"));

    let msg = |r: Result<(), GgufError>| r.unwrap_err().to_string();
    let rec = f.entry("i32.neg").unwrap().offset;
    let m = msg(f.require_u32("i32.neg").map(drop));
    assert_eq!(
        m,
        format!("m.gguf: metadata key i32.neg (record at byte {rec}): expected an integer that fits in u32, found i32 -7")
    );
    let m = msg(f.require_u32("u64.big").map(drop));
    assert!(m.contains("found u64 1099511627776"), "{m}");
    let m = msg(f.require_str("u32").map(drop));
    assert!(m.contains("expected string, found u32 3"), "{m}");
    let m = msg(f.require_bool("u8").map(drop));
    assert!(m.contains("expected bool, found u8 200"), "{m}");
    let m = msg(f.require_f32("name").map(drop));
    assert!(m.contains("found string \"x\""), "{m}");
    let m = msg(f.require_u32_array("ratios.neg").map(drop));
    assert!(m.contains("array of i32 whose element 1 is -4"), "{m}");
    let m = msg(f.require_u32_array("tokens").map(drop));
    assert!(m.contains("found array of string with 2 elements"), "{m}");
    let m = msg(f.require_f32_array("u32").map(drop));
    assert!(m.contains("expected array of f32"), "{m}");
    let m = msg(f.require_str_array("clamp.f64").map(drop));
    assert!(
        m.contains("expected array of string, found array of f64"),
        "{m}"
    );
    assert_eq!(
        msg(f.require_u32("deepseek4.block_count").map(drop)),
        "m.gguf: metadata key deepseek4.block_count is missing"
    );
}

#[test]
fn file_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GgufFile>();
    send_sync::<GgufError>();
}

#[test]
fn value_accessors() {
    assert_eq!(Value::I64(-1).as_u64(), None);
    assert_eq!(Value::U64(u64::MAX).as_i64(), None);
    assert_eq!(Value::I8(-3).as_i64(), Some(-3));
    assert_eq!(Value::U32(5).as_bool(), None);
    assert_eq!(Value::F32(1.0).as_u32(), None);
    assert_eq!(Value::Bool(true).as_f32(), None);
    assert_eq!(Value::from("s").as_array(), None);
    assert_eq!(Value::from(vec![1u32]).type_name(), "array of u32");
    assert_eq!(Value::from(vec![1u32]).value_type(), ValueType::Array);
    let a: StringArray = ["x", "yy", ""].iter().collect();
    assert_eq!(
        (a.len(), a.total_bytes(), a.get(2), a.get(3)),
        (3, 3, Some(""), None)
    );
    assert_eq!(a.to_vec(), vec!["x", "yy", ""]);
    assert_eq!(
        Array::String(a).to_u32_vec(),
        Err(ds4_gguf::ConvertError::WrongType)
    );
    let shown = Value::from((0..20u32).collect::<Vec<_>>()).to_string();
    assert_eq!(shown, "[array of u32; 20] [0, 1, 2, 3, 4, 5, 6, 7, ...]");
}

#[test]
fn writer_rejects_bad_tensors_and_alignment() {
    let mut w = GgufWriter::new();
    let e = w.add_tensor("q", GgmlType::Q4_K, &[100, 2]).unwrap_err();
    assert!(
        e.to_string()
            .contains("row length 100 is not a multiple of the Q4_K block size 256"),
        "{e}"
    );
    assert!(w.add_tensor("x", GgmlType::F32, &[]).is_err());
    assert!(w.add_tensor("x", GgmlType::F32, &[1, 1, 1, 1, 1]).is_err());
    assert!(w
        .add_tensor("x", GgmlType::F32, &[1 << 32, 1 << 32])
        .unwrap_err()
        .to_string()
        .contains("overflow"));
    assert!(w.add_tensor("", GgmlType::F32, &[1]).is_err());
    assert!(w.add_tensor("x", GgmlType::F32, &[0, 1 << 63]).is_err());
    assert!(w.add_tensor("n".repeat(64), GgmlType::F32, &[1]).is_err());
    assert_eq!(w.add_tensor("x", GgmlType::F32, &[1]).unwrap(), 0);
    assert!(w
        .add_tensor("x", GgmlType::F32, &[1])
        .unwrap_err()
        .to_string()
        .contains("added twice"));
    for bad in [
        Value::U32(0),
        Value::U32(48),
        Value::U64(32),
        Value::from("32"),
    ] {
        w.set("general.alignment", bad);
        let e = w.layout().unwrap_err();
        assert!(e.to_string().contains("general.alignment"), "{e}");
    }
    w.set("general.alignment", 1u32);
    w.add_tensor("y", GgmlType::I8, &[3]).unwrap();
    let l = w.layout().unwrap();
    assert_eq!(
        l.offsets,
        vec![l.header.len() as u64, l.header.len() as u64 + 4]
    );
    assert_eq!(l.total_len, l.header.len() as u64 + 7);
    // Nesting beyond the reader's limit is refused at write time.
    let mut deep = Array::U8(vec![1]);
    for _ in 0..ds4_gguf::MAX_ARRAY_DEPTH {
        deep = Array::Array(vec![deep]);
    }
    w.set("deep", deep);
    assert!(w
        .layout()
        .unwrap_err()
        .to_string()
        .contains("nested deeper"));
}

#[test]
fn setting_a_key_twice_replaces_it_in_place() {
    let mut w = GgufWriter::new();
    w.set("a", 1u32).set("b", 2u32).set("a", "one");
    let f = GgufFile::from_bytes("s.gguf", w.to_bytes(fill).unwrap()).unwrap();
    let keys: Vec<_> = f.metadata().iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, vec!["a", "b", "general.alignment"]);
    assert_eq!(f.require_str("a").unwrap(), "one");
}

/// The real vocabulary has 129,280 tokens and ~127k merges; opening must stay fast.
#[test]
fn large_string_arrays_open_fast() {
    let tokens: StringArray = (0..129_280).map(|i| format!("Ġtok{i}")).collect();
    let merges: StringArray = (0..127_741)
        .map(|i| format!("Ġa{i} b{}", i % 977))
        .collect();
    let mut w = GgufWriter::new();
    w.set("tokenizer.ggml.tokens", tokens);
    w.set("tokenizer.ggml.merges", merges);
    w.add_tensor("x", GgmlType::F32, &[4]).unwrap();
    let bytes = w.to_bytes(fill).unwrap();
    let mut best = f64::MAX;
    let mut f = None;
    for _ in 0..3 {
        let b = bytes.clone();
        let t = std::time::Instant::now();
        f = Some(GgufFile::from_bytes("vocab.gguf", b).unwrap());
        best = best.min(t.elapsed().as_secs_f64());
    }
    let f = f.unwrap();
    println!(
        "open with 257k strings ({} bytes): {:.1} ms",
        bytes.len(),
        best * 1e3
    );
    let toks = f.require_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!((toks.len(), toks[129_279]), (129_280, "Ġtok129279"));
    assert_eq!(
        f.require_strings("tokenizer.ggml.merges").unwrap().get(978),
        Some("Ġa978 b1")
    );
    // Generous bound for a loaded 2-core CI machine; the target is < 100 ms.
    assert!(best < 0.5, "open took {best} s");
}

/// Full-size shapes: offsets past 4 GiB, and the header alone reports the first missing tensor.
#[test]
fn full_size_layout_without_data() {
    let mut w = GgufWriter::new();
    w.set("general.architecture", "deepseek4");
    let mut expect = 0u64;
    for l in 0..43 {
        for (n, ty, dims) in [
            ("attn_q_b.weight", GgmlType::Q8_0, [1024u64, 32768, 1]),
            ("ffn_gate_exps.weight", GgmlType::IQ2_XXS, [4096, 2048, 256]),
            ("ffn_up_exps.weight", GgmlType::IQ2_XXS, [4096, 2048, 256]),
            ("ffn_down_exps.weight", GgmlType::Q2_K, [2048, 4096, 256]),
        ] {
            w.add_tensor(format!("blk.{l}.{n}"), ty, &dims).unwrap();
            expect += ty.row_bytes(dims[0]).unwrap() * dims[1] * dims[2];
        }
    }
    let l = w.layout().unwrap();
    assert_eq!(l.sizes.iter().sum::<u64>(), expect);
    assert!(l.total_len > 64 << 30, "{}", l.total_len); // far past u32 offsets
    assert!(l.offsets.windows(2).all(|o| o[0] < o[1] && o[1] % 32 == 0));
    let last = l.offsets.len() - 1;
    assert_eq!(
        l.total_len,
        (l.offsets[last] + l.sizes[last]).div_ceil(32) * 32
    );
    let e = GgufFile::from_bytes("big.gguf", l.header.clone()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "big.gguf: tensor blk.0.attn_q_b.weight (info at byte {}): data ends at byte {} but the file has {} bytes (truncated?)",
            // The first tensor info follows the two metadata records.
            24 + (8 + 20 + 4 + 8 + 9) + (8 + 17 + 4 + 4),
            l.offsets[0] + l.sizes[0],
            l.header.len()
        )
    );
}

/// A sparse full-size file: mmap, offsets past 4 GiB, zero-copy view of the last tensor.
/// Skipped where the filesystem does not make sparse files (it would really write 74 GB).
#[cfg(unix)]
#[test]
fn sparse_full_size_file_opens() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let mut w = GgufWriter::new();
    for l in 0..43 {
        w.add_tensor(
            format!("blk.{l}.ffn_gate_exps.weight"),
            GgmlType::IQ2_XXS,
            &[4096, 2048, 256],
        )
        .unwrap();
    }
    let l = w.layout().unwrap();
    let path = std::env::temp_dir().join(format!("ds4-gguf-sparse-{}.gguf", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(l.total_len).unwrap();
    file.write_all_at(&l.header, 0).unwrap();
    let last = l.offsets.len() - 1;
    file.write_all_at(b"last", l.offsets[last]).unwrap();
    let sparse = file.metadata().unwrap().blocks() * 512 < 1 << 30;
    drop(file);
    if sparse {
        let f = GgufFile::open(&path).unwrap();
        let t = &f.tensors()[last];
        assert!(t.offset > 1 << 32);
        assert_eq!(t.offset, l.offsets[last]);
        assert_eq!(&f.tensor_data(t)[..4], b"last");
        assert_eq!(f.tensor_data(t).len() as u64, 2048 * 256 * 16 * 66);
    } else {
        println!("skipped: {} is not sparse here", path.display());
    }
    std::fs::remove_file(&path).unwrap();
}
