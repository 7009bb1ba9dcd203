//! Bit-exact comparison with the pip `gguf` package (gguf-py 0.19), the independent oracle.
//! Fixtures: `tests/data`, written by `tools/quant/gen_fixtures.py`.

use std::io::Read;
use std::path::PathBuf;

use ds4_quant::{dequantize_row, quantize_row, GgmlType};

fn data(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn gunzip(name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&data(name)[..])
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    out
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const TYPES: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
];

#[test]
fn dequantize_is_bit_identical_to_gguf_py() {
    for ty in TYPES {
        let raw = data(&format!("{}.blocks", ty.name()));
        let expected = f32s(&gunzip(&format!("{}.expected.gz", ty.name())));
        let bb = ty.block_bytes() as usize;
        let be = ty.block_elems() as usize;
        assert_eq!(
            raw.len() / bb * be,
            expected.len(),
            "{ty}: fixture sizes disagree"
        );
        assert!(expected.len() >= 1024, "{ty}: too few fixture values");

        // The whole fixture as one row, and block by block as rows of one block.
        let mut out = vec![0f32; expected.len()];
        dequantize_row(ty, &raw, &mut out).unwrap();
        let mut one = vec![0f32; be];
        for (i, (blk, exp)) in raw
            .chunks_exact(bb)
            .zip(expected.chunks_exact(be))
            .enumerate()
        {
            dequantize_row(ty, blk, &mut one).unwrap();
            for (k, (&got, &want)) in one.iter().zip(exp).enumerate() {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{ty}: block {i} element {k}: got {got:e}, gguf-py {want:e}"
                );
            }
        }
        let same = out
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{ty}: whole-row dequantisation differs from gguf-py");
    }
}

#[test]
fn fixtures_exercise_special_values() {
    // The comparison above is only meaningful if the fixtures contain the awkward cases.
    let f16 = f32s(&gunzip("F16.expected.gz"));
    assert!(f16.iter().any(|v| v.is_nan()));
    assert!(f16.iter().any(|v| v.is_infinite()));
    assert!(
        f16.iter().any(|v| *v != 0.0 && v.abs() < 6.1e-5),
        "no f16 subnormal"
    );
    // A signalling NaN (0x7D01): its payload must survive unquieted, as in gguf-py.
    assert_eq!(f16[5].to_bits(), 0x7fa0_2000);
    let bf16 = f32s(&gunzip("BF16.expected.gz"));
    assert!(bf16.iter().any(|v| v.is_nan()) && bf16.iter().any(|v| v.is_infinite()));
    for ty in ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS"] {
        let v = f32s(&gunzip(&format!("{ty}.expected.gz")));
        assert!(v.iter().all(|x| x.is_finite()), "{ty}");
        assert!(
            v.iter().any(|x| *x < 0.0) && v.iter().any(|x| *x > 0.0),
            "{ty}"
        );
    }
}

#[test]
fn reference_quantisers_are_bit_identical_to_gguf_py() {
    let x = f32s(&data("quant_input.f32"));
    for ty in [GgmlType::Q8_0, GgmlType::BF16, GgmlType::F16] {
        let expected = data(&format!("{}.quantized", ty.name()));
        let mut out = vec![0u8; ty.row_bytes(x.len() as u64).unwrap() as usize];
        quantize_row(ty, &x, &mut out).unwrap();
        assert_eq!(out.len(), expected.len(), "{ty}");
        if let Some(i) = out.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!(
                "{ty}: byte {i} differs: ours {:#04x}, gguf-py {:#04x}",
                out[i], expected[i]
            );
        }
    }
}
