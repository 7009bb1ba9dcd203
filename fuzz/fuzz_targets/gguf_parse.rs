//! Parse arbitrary bytes as GGUF; for files that parse, touch every metadata value and every
//! tensor byte, check the reader's invariants, and round-trip through the writer.
#![no_main]

use ds4_gguf::{Array, GgufFile, GgufWriter, Value};
use libfuzzer_sys::fuzz_target;

fn walk_array(a: &Array, acc: &mut u64) {
    *acc = acc.wrapping_add(a.len() as u64);
    let _ = a.type_name();
    let _ = a.to_f32_vec();
    let _ = a.to_u32_vec();
    match a {
        Array::Array(v) => v.iter().for_each(|x| walk_array(x, acc)),
        Array::String(s) => s
            .iter()
            .for_each(|x| *acc = acc.wrapping_add(x.len() as u64)),
        _ => {
            for i in 0..a.len() {
                let v = a.get(i).expect("index in range");
                walk_value(&v, acc);
            }
        }
    }
}

fn walk_value(v: &Value, acc: &mut u64) {
    let _ = (v.as_u32(), v.as_u64(), v.as_i64(), v.as_f32(), v.as_f64());
    let _ = (v.as_bool(), v.as_str(), v.type_name(), v.to_string());
    if let Some(a) = v.as_array() {
        walk_array(a, acc);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    let mut acc = 0u64;
    for e in f.metadata() {
        walk_value(&e.value, &mut acc);
        assert!(std::ptr::eq(f.get(&e.key).unwrap(), &e.value));
        let _ = f.require_u32(&e.key).map_err(|e| e.to_string());
        let _ = f.require_f32_array(&e.key).map_err(|e| e.to_string());
        let _ = f.require_u32_array(&e.key).map_err(|e| e.to_string());
        let _ = f.require_str_array(&e.key).map_err(|e| e.to_string());
    }
    let mut ranges = Vec::new();
    for t in f.tensors() {
        let d = f.tensor_data(t);
        assert_eq!(d.len() as u64, t.n_bytes);
        assert_eq!(t.offset % f.alignment(), 0);
        assert!(t.offset >= f.data_offset());
        acc = acc.wrapping_add(d.iter().map(|&b| u64::from(b)).sum::<u64>());
        acc = acc.wrapping_add(t.row_bytes().wrapping_add(t.n_rows()));
        assert_eq!(f.tensor(&t.name), Some(t));
        if t.n_bytes > 0 {
            ranges.push((t.offset, t.offset + t.n_bytes));
        }
    }
    ranges.sort();
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
    std::hint::black_box(acc);

    // Writer round trip: same metadata and tensors (skip what the writer refuses by design,
    // and huge alignments that would make the rebuilt file large).
    if f.alignment() > 4096 {
        return;
    }
    let mut w = GgufWriter::new();
    for e in f.metadata() {
        w.set(e.key.clone(), e.value.clone());
    }
    for t in f.tensors() {
        if w.add_tensor(t.name.clone(), t.ty, &t.dims).is_err() {
            return;
        }
    }
    let Ok(bytes) = w.to_bytes(|i, buf: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
        buf.copy_from_slice(f.tensor_data(&f.tensors()[i]));
        Ok(())
    }) else {
        return;
    };
    let g = GgufFile::from_bytes("rebuilt.gguf", bytes).expect("writer output parses");
    // Same keys and values in the same order (Debug so that NaN compares equal to NaN).
    for (a, b) in f.metadata().iter().zip(g.metadata()) {
        assert_eq!(a.key, b.key);
        assert_eq!(format!("{:?}", a.value), format!("{:?}", b.value));
    }
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty), (&b.name, &b.dims, b.ty));
        assert_eq!(f.tensor_data(a), g.tensor_data(b));
    }
});
