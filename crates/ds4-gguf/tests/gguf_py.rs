//! A file written by the pip `gguf` package's GGUFWriter, checked against what its GGUFReader
//! reports (both committed; regenerate with tools/gguf_py_fixture.py).
use ds4_gguf::{GgmlType, GgufFile, GgufWriter, Value};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/");

#[test]
fn reads_what_gguf_py_wrote() {
    let f = GgufFile::open(format!("{DATA}gguf_py.gguf")).unwrap();
    let expected = std::fs::read_to_string(format!("{DATA}gguf_py.expected")).unwrap();
    let (mut kv, mut tensors, mut types) = (0, 0, 0);
    for line in expected.lines().filter(|l| !l.starts_with('#')) {
        let w: Vec<&str> = line.split(' ').collect();
        match w[0] {
            "alignment" => assert_eq!(f.alignment().to_string(), w[1]),
            "data_offset" => assert_eq!(f.data_offset().to_string(), w[1]),
            "kv" => {
                // Same keys in the same order, same type ids (array: array + element type).
                let e = &f.metadata()[kv];
                kv += 1;
                assert_eq!(e.key, w[1]);
                let mut types = vec![e.value.value_type().id().to_string()];
                if let Some(a) = e.value.as_array() {
                    types.push(a.elem_type().id().to_string());
                }
                assert_eq!(types, w[2..], "{}", e.key);
            }
            "tensor" => {
                let t = &f.tensors()[tensors];
                tensors += 1;
                assert_eq!(t.name, w[1]);
                assert_eq!(t.ty.id().to_string(), w[2]);
                let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
                assert_eq!(dims.join(","), w[3]);
                assert_eq!(t.offset.to_string(), w[4], "{}", t.name);
                assert_eq!(t.n_bytes.to_string(), w[5], "{}", t.name);
                let sum: u64 = f.tensor_data(t).iter().map(|&b| u64::from(b)).sum();
                assert_eq!(sum.to_string(), w[6], "{}", t.name);
            }
            "type" => {
                // pip gguf's GGML_QUANT_SIZES: every type it knows exists here with the same
                // name and geometry. Known difference: Q8_1, where pip gguf keeps the old f32
                // (d, s) layout (40 bytes) but ggml's block_q8_1 holds two f16 (36 bytes).
                let id: u32 = w[1].parse().unwrap();
                let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("type {id} {}", w[2]));
                assert_eq!(ty.name(), w[2]);
                assert_eq!(ty.block_elems().to_string(), w[3], "{ty}");
                let bytes = if ty == GgmlType::Q8_1 { "36" } else { w[4] };
                assert_eq!(ty.block_bytes().to_string(), bytes, "{ty}");
                types += 1;
            }
            other => panic!("unexpected line {other}"),
        }
    }
    assert_eq!(types, GgmlType::ALL.len());
    assert_eq!((kv, tensors), (f.metadata().len(), f.tensors().len()));
    assert_eq!(tensors, 7);

    // The values the script wrote.
    assert_eq!(f.require_str("general.architecture").unwrap(), "deepseek4");
    assert_eq!(f.get("t.u8"), Some(&Value::U8(250)));
    assert_eq!(f.get("t.i8"), Some(&Value::I8(-100)));
    assert_eq!(f.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(f.get("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(f.require_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.require_i64("t.i32").unwrap(), -2_000_000_000);
    assert_eq!(f.require_u64("t.u64").unwrap(), (1 << 63) + 5);
    assert_eq!(f.require_i64("t.i64").unwrap(), -(1 << 62));
    assert_eq!(f.require_f32("t.f32").unwrap(), -1.25);
    assert_eq!(f.get("t.f64"), Some(&Value::F64(1e-300)));
    assert!(f.require_bool("t.bool").unwrap());
    assert_eq!(f.require_str("t.str").unwrap(), "<｜begin▁of▁sentence｜>");
    assert_eq!(f.require_u32_array("t.arr.u32").unwrap(), vec![0, 4, 128]);
    assert!(f.require_u32_array("t.arr.i32").is_err()); // -4
    assert_eq!(f.require_f32_array("t.arr.f32").unwrap(), vec![10.0, 0.5]);
    assert_eq!(
        f.require_str_array("t.arr.str").unwrap(),
        vec!["Ġa", "b c", ""]
    );
    assert_eq!(f.get("t.arr.bool"), Some(&Value::from(vec![false, true])));
    let i32t = f.tensor("i32").unwrap();
    let vals: Vec<i32> = f
        .tensor_data(i32t)
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(vals, (0..7).collect::<Vec<_>>());
    assert_eq!(f.tensor("iq2_xxs").unwrap().ty, GgmlType::IQ2_XXS);
}

/// Rebuilding the gguf-py file with our writer (same keys, tensors, data) gives the same bytes:
/// both follow the same layout rules (the writer differs only in where it puts
/// general.alignment, so it is set first here as gguf-py does after the architecture).
#[test]
fn writer_reproduces_gguf_py_layout() {
    let path = format!("{DATA}gguf_py.gguf");
    let f = GgufFile::open(&path).unwrap();
    let mut w = GgufWriter::new();
    for e in f.metadata() {
        w.set(e.key.clone(), e.value.clone());
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims).unwrap();
    }
    let bytes = w
        .to_bytes(|i, buf| -> Result<(), ds4_gguf::GgufError> {
            buf.copy_from_slice(f.tensor_data(&f.tensors()[i]));
            Ok(())
        })
        .unwrap();
    let original = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), original.len());
    assert!(bytes == original, "rebuilt file differs from gguf-py's");
}
