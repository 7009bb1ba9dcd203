//! A DeepSeek V4 file with edited metadata and tensor records, through hyper-parameter
//! validation, tensor binding, loading on the CPU backend and one token's forward pass. The
//! base is the tiny synthetic model; the input is a list of 6-byte edits `[op, which, v0..v3]`:
//! op 0 sets a numeric metadata value (or one element of a numeric array) to v, op 1 sets one
//! dimension of a tensor to a small value, op 2 changes a tensor's type. Whatever the file
//! says, the result is a model or an error; nothing panics or aborts.
#![no_main]

use ds4_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use ds4_model::forward::{rope_tables, Model};
use ds4_model::{bind_main, HParams};
use ds4_quant::SUPPORTED;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

fn base() -> &'static GgufFile {
    static F: OnceLock<GgufFile> = OnceLock::new();
    F.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds4-fuzz-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("tiny.gguf");
        ds4_synth::synth_tiny(&out, 7).unwrap();
        let f = GgufFile::from_bytes("tiny.gguf", std::fs::read(&out).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        f
    })
}

/// `v` as the numeric value `old` is, or one element of it; None for other values.
fn edited(old: &Value, v: u32, which: u8) -> Option<Value> {
    Some(match old {
        Value::U32(_) => Value::U32(v),
        Value::I32(_) => Value::I32(v as i32),
        Value::U64(_) => Value::U64(v as u64),
        Value::F32(_) => Value::F32(f32::from_bits(v)),
        Value::Bool(_) => Value::Bool(v & 1 == 1),
        Value::Array(Array::U32(a)) if !a.is_empty() => {
            let mut a = a.clone();
            let i = which as usize % a.len();
            a[i] = v;
            Value::Array(Array::U32(a))
        }
        Value::Array(Array::F32(a)) if !a.is_empty() => {
            let mut a = a.clone();
            let i = which as usize % a.len();
            a[i] = f32::from_bits(v);
            Value::Array(Array::F32(a))
        }
        _ => return None,
    })
}

fuzz_target!(|data: &[u8]| {
    let f = base();
    let mut meta: Vec<(String, Value)> = f
        .metadata()
        .iter()
        .map(|e| (e.key.clone(), e.value.clone()))
        .collect();
    let mut tensors: Vec<(String, GgmlType, Vec<u64>)> = f
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.ty, t.dims.clone()))
        .collect();
    for e in data.chunks_exact(6) {
        let v = u32::from_le_bytes([e[2], e[3], e[4], e[5]]);
        match e[0] % 3 {
            0 => {
                let i = (e[1] as usize * 7 + (v as usize >> 24)) % meta.len();
                if let Some(nv) = edited(&meta[i].1, v, e[1]) {
                    meta[i].1 = nv;
                }
            }
            1 => {
                let n = tensors.len();
                let t = &mut tensors[(v as usize >> 16) % n];
                let d = e[1] as usize % t.2.len();
                t.2[d] = (v & 0xfff) as u64;
            }
            _ => {
                let t = (v as usize >> 8) % tensors.len();
                tensors[t].1 = SUPPORTED[e[1] as usize % SUPPORTED.len()];
            }
        }
    }
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.set(k, v);
    }
    for (name, ty, dims) in &tensors {
        if w.add_tensor(name.clone(), *ty, dims).is_err() {
            return; // dims that do not fill whole blocks: the reader test covers those
        }
    }
    // The harness's own limit: a dimension edit can ask for a file of gigabytes (the
    // reader's bounds against the file size are gguf_parse's subject).
    match w.layout() {
        Ok(l) if l.total_len <= 64 << 20 => {}
        _ => return,
    }
    let orig = f.tensors();
    let Ok(bytes) = w.to_bytes(|i, buf: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
        let src = f.tensor_data(&orig[i]);
        let n = src.len().min(buf.len());
        buf[..n].copy_from_slice(&src[..n]);
        Ok(())
    }) else {
        return;
    };
    let file = Arc::new(GgufFile::from_bytes("edited.gguf", bytes).expect("writer output parses"));
    let Ok(hp) = HParams::from_meta(file.as_ref()) else {
        return;
    };
    let Ok(dir) = bind_main(&file, &hp) else {
        return;
    };
    let backend = ds4_cpu::CpuBackend::new(rope_tables(&hp));
    let Ok(m) = Model::load(
        backend,
        hp,
        &[(file, dir)],
        ds4_cpu::Rounding::MODEL,
        &mut |_, _| {},
    ) else {
        return;
    };
    let mut st = m.new_state();
    let _ = m.eval(&mut st, 1);
});
