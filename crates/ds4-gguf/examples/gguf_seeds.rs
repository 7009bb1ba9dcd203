//! Writes a few small valid GGUF files into a directory: the seed corpus for `fuzz/`.
//!   cargo run -p ds4-gguf --release --example gguf_seeds -- fuzz/corpus/gguf_parse
use ds4_gguf::{Array, GgmlType, GgufError, GgufWriter, StringArray, Value};

fn fill(i: usize, buf: &mut [u8]) -> Result<(), GgufError> {
    for (j, b) in buf.iter_mut().enumerate() {
        *b = (i * 7 + j) as u8;
    }
    Ok(())
}

fn main() -> Result<(), GgufError> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/corpus/gguf_parse".into());
    std::fs::create_dir_all(&dir).map_err(|source| GgufError::Io {
        file: dir.clone(),
        source,
    })?;
    let mut files: Vec<(&str, GgufWriter)> = Vec::new();

    // Every scalar type, strings, typed and nested arrays.
    let mut w = GgufWriter::new();
    w.set("general.architecture", "deepseek4");
    w.set("u8", 1u8)
        .set("i8", -1i8)
        .set("u16", 2u16)
        .set("i16", -2i16);
    w.set("u32", 3u32)
        .set("i32", -3i32)
        .set("u64", 4u64)
        .set("i64", -4i64);
    w.set("f32", 0.5f32)
        .set("f64", 0.25f64)
        .set("bool", true)
        .set("str", "ｓｔｒ");
    w.set("arr.u32", vec![0u32, 4, 128])
        .set("arr.f32", vec![1.0f32, 2.0]);
    w.set("arr.bool", vec![true, false])
        .set("arr.str", vec!["a", "bc"]);
    w.set("arr.i64", vec![-1i64])
        .set("arr.u8", vec![9u8])
        .set("arr.f64", vec![1.5f64]);
    w.set(
        "arr.nested",
        vec![Array::I16(vec![1]), Array::Array(vec![Array::U64(vec![])])],
    );
    files.push(("values.gguf", w));

    // One tensor of every ggml type (one block each).
    let mut w = GgufWriter::new();
    for ty in GgmlType::ALL {
        w.add_tensor(format!("t.{ty}"), ty, &[ty.block_elems()])?;
    }
    files.push(("types.gguf", w));

    // DS4-like: keys, vocabulary, a few tensors of several dims, alignment 64.
    let mut w = GgufWriter::new();
    w.set("general.alignment", 64u32);
    w.set("deepseek4.block_count", 2u32);
    w.set("deepseek4.attention.compress_ratios", vec![0i32, 4]);
    w.set("deepseek4.swiglu_clamp_exp", vec![10.0f32, 10.0]);
    w.set("deepseek4.expert_weights_norm", true);
    let toks: StringArray = ["<｜begin▁of▁sentence｜>", "Ġ", "a", "b", "ab"]
        .iter()
        .collect();
    w.set("tokenizer.ggml.tokens", toks);
    w.set("tokenizer.ggml.merges", Value::from(vec!["a b"]));
    w.add_tensor("token_embd.weight", GgmlType::F16, &[8, 5])?;
    w.add_tensor("blk.0.attn_q_a.weight", GgmlType::Q8_0, &[32, 2])?;
    w.add_tensor(
        "blk.0.ffn_gate_exps.weight",
        GgmlType::IQ2_XXS,
        &[256, 1, 2],
    )?;
    w.add_tensor("blk.0.ffn_gate_tid2eid", GgmlType::I32, &[2, 1, 1, 2])?;
    files.push(("ds4.gguf", w));

    // Empty file (header only) and an empty tensor.
    files.push(("empty.gguf", GgufWriter::new()));
    let mut w = GgufWriter::new();
    w.add_tensor("z", GgmlType::F32, &[0])?;
    w.add_tensor("one", GgmlType::BF16, &[1])?;
    files.push(("zero.gguf", w));

    for (name, w) in files {
        let path = std::path::Path::new(&dir).join(name);
        w.write_to_path(&path, fill)?;
        println!("{}", path.display());
    }
    Ok(())
}
