//! Our Unicode classes vs. how HF `tokenizers` (Oniguruma) classified every code point,
//! probed by tools/tokenizer/char_classes.py and committed as tests/data/hf_char_classes.txt.

use ds4_tokenizer::pretok::{Classes, LM, N, PS, WS};

#[test]
fn every_code_point_classified_like_hf() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/hf_char_classes.txt"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut want = vec![0u8; 0x110000];
    let mut n_ranges = 0;
    for (ln, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(' ').collect();
        let bad = || -> ! { panic!("{path} line {}: {line:?}", ln + 1) };
        if f.len() != 3 {
            bad();
        }
        let a = u32::from_str_radix(f[0], 16).unwrap_or_else(|_| bad());
        let b = u32::from_str_radix(f[1], 16).unwrap_or_else(|_| bad());
        let k = match f[2] {
            "L" => LM,
            "N" => N,
            "P" => PS,
            "W" => WS,
            _ => bad(),
        };
        want[a as usize..=b as usize].fill(k);
        n_ranges += 1;
    }
    assert!(n_ranges > 1000, "only {n_ranges} ranges in {path}");
    let cls = Classes::default();
    let mut bad = Vec::new();
    for cp in 0..0x110000u32 {
        let Some(c) = char::from_u32(cp) else {
            continue;
        };
        let got = cls.of(c);
        if got != want[cp as usize] {
            bad.push(format!("U+{cp:04X} ours {got} hf {}", want[cp as usize]));
        }
    }
    assert!(
        bad.is_empty(),
        "{} code points differ (1=L/M 2=N 4=P/S 8=\\s): {:?}",
        bad.len(),
        &bad[..bad.len().min(40)]
    );
}
