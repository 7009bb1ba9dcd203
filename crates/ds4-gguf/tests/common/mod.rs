//! Shared fixtures: a writer holding every value type and every tensor type.
#![allow(dead_code)]

use ds4_gguf::{Array, GgmlType, GgufError, GgufWriter, StringArray, Value};

/// Deterministic tensor bytes: depend on the tensor index and the byte position.
pub fn pattern(index: usize, buf: &mut [u8]) {
    for (j, b) in buf.iter_mut().enumerate() {
        *b = (j.wrapping_mul(31) ^ index.wrapping_mul(131) ^ (j >> 8)) as u8;
    }
}

pub fn fill(index: usize, buf: &mut [u8]) -> Result<(), GgufError> {
    pattern(index, buf);
    Ok(())
}

/// Metadata covering every scalar type, strings, and typed, empty and nested arrays.
pub fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::from("deepseek4")),
        ("test.u8", Value::U8(0xfe)),
        ("test.i8", Value::I8(-5)),
        ("test.u16", Value::U16(0xbeef)),
        ("test.i16", Value::I16(-12345)),
        ("test.u32", Value::U32(0xdead_beef)),
        ("test.i32", Value::I32(-7)),
        ("test.u64", Value::U64(u64::MAX - 1)),
        ("test.i64", Value::I64(i64::MIN + 3)),
        ("test.f32", Value::F32(-1.5e-6)),
        ("test.f64", Value::F64(std::f64::consts::PI)),
        ("test.bool.t", Value::Bool(true)),
        ("test.bool.f", Value::Bool(false)),
        ("test.str", Value::from("héllo ｜DSML｜ <｜User｜>")),
        ("test.str.empty", Value::from("")),
        ("test.arr.u8", Value::from(vec![1u8, 2, 255])),
        ("test.arr.i8", Value::from(vec![-128i8, 0, 127])),
        ("test.arr.u16", Value::from(vec![0u16, 65535])),
        ("test.arr.i16", Value::from(vec![-32768i16, 32767])),
        ("test.arr.u32", Value::from(vec![0u32, 4, 128, u32::MAX])),
        ("test.arr.i32", Value::from(vec![0i32, 4, 128, -1])),
        ("test.arr.u64", Value::from(vec![u64::MAX])),
        ("test.arr.i64", Value::from(vec![i64::MIN, 0])),
        (
            "test.arr.f32",
            Value::from(vec![1.0f32, -0.0, f32::INFINITY, 1e-30]),
        ),
        ("test.arr.f64", Value::from(vec![10.0f64, 2.5])),
        ("test.arr.bool", Value::from(vec![true, false, true])),
        (
            "test.arr.str",
            Value::from(vec!["a", "", "Ġthe", "<｜end▁of▁sentence｜>"]),
        ),
        ("test.arr.empty", Value::Array(Array::F64(vec![]))),
        (
            "test.arr.empty_str",
            Value::Array(Array::String(StringArray::new())),
        ),
        (
            "test.arr.nested",
            Value::from(vec![
                Array::U32(vec![1, 2]),
                Array::String(["x", "yz"].iter().collect()),
                Array::Array(vec![Array::F32(vec![0.5]), Array::Bool(vec![])]),
                Array::Array(vec![]),
            ]),
        ),
    ]
}

/// Dims with a row of two blocks and three rows, so block geometry matters.
pub fn dims_for(ty: GgmlType) -> Vec<u64> {
    vec![ty.block_elems() * 2, 3]
}

/// A writer with every metadata value type and one tensor of every ggml type, plus a 4-D and a
/// zero-sized tensor.
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.set(k, v);
    }
    for ty in GgmlType::ALL {
        w.add_tensor(format!("t.{}", ty.name()), ty, &dims_for(ty))
            .unwrap();
    }
    w.add_tensor("t.4d", GgmlType::F16, &[2, 3, 4, 5]).unwrap();
    w.add_tensor("t.empty", GgmlType::F32, &[4, 0]).unwrap();
    w
}

/// A small valid file: a few keys and two tensors (for exhaustive truncation/mutation).
pub fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", "deepseek4");
    w.set("deepseek4.block_count", 2u32);
    w.set("deepseek4.rope.freq_base", 10000.0f32);
    w.set("deepseek4.attention.compress_ratios", vec![0u32, 4, 128]);
    w.set("tokenizer.ggml.tokens", vec!["a", "b", "ab"]);
    w.set(
        "test.nested",
        vec![Array::I32(vec![-1]), Array::Array(vec![Array::U8(vec![7])])],
    );
    w.add_tensor("blk.0.attn_q_a.weight", GgmlType::Q8_0, &[64, 2])
        .unwrap();
    w.add_tensor("output_norm.weight", GgmlType::F32, &[5])
        .unwrap();
    w.to_bytes(fill).unwrap()
}

/// Touches every value and every tensor byte (what a consumer or the fuzzer does).
pub fn walk(f: &ds4_gguf::GgufFile) -> u64 {
    fn walk_array(a: &Array) -> u64 {
        let mut h = a.len() as u64;
        match a {
            Array::Array(v) => h += v.iter().map(walk_array).sum::<u64>(),
            Array::String(s) => h += s.iter().map(|x| x.len() as u64).sum::<u64>(),
            _ => {
                for i in 0..a.len() {
                    h += a.get(i).and_then(|v| v.as_u64()).unwrap_or(1);
                }
            }
        }
        h
    }
    let mut h = 0u64;
    for e in f.metadata() {
        h = h.wrapping_add(e.value.to_string().len() as u64);
        h = h.wrapping_add(e.value.as_u64().unwrap_or(0));
        if let Some(a) = e.value.as_array() {
            h = h.wrapping_add(walk_array(a));
            let _ = a.to_f32_vec();
            let _ = a.to_u32_vec();
        }
    }
    for t in f.tensors() {
        let d = f.tensor_data(t);
        assert_eq!(d.len() as u64, t.n_bytes);
        h = h.wrapping_add(d.iter().map(|&b| b as u64).sum::<u64>());
        h = h.wrapping_add(t.row_bytes() + t.n_rows());
    }
    h
}
