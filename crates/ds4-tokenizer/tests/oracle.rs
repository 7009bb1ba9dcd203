//! Exact agreement with HF `tokenizers` on DeepSeek V4's tokenizer.json, over the corpus
//! made by tools/tokenizer/make_corpus.py (expected ids computed by HF, committed).

use ds4_tokenizer::{builtin, StreamDecoder, Tokenizer};
use std::io::Read;
use std::sync::OnceLock;

struct Case {
    text: String,
    /// HF ids with added-token splitting (what `encode_with_specials` must give).
    with_specials: Vec<u32>,
    /// HF ids with no added tokens (what `encode` must give).
    plain: Vec<u32>,
}

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_builtin(builtin::deepseek_v4()).expect("builtin vocab"))
}

/// The committed corpus, or another file of the same format named by `DS4_TOK_ORACLE`
/// (e.g. a larger one made by hand with make_corpus.py).
fn corpus() -> Vec<Case> {
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/oracle.jsonl.gz");
    let path = &std::env::var("DS4_TOK_ORACLE").unwrap_or_else(|_| default.to_string());
    let gz = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut text)
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("id array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{path} line {}: {e}", n + 1));
            let with_specials = ids(&v["s"]);
            let plain = v.get("p").map(ids).unwrap_or_else(|| with_specials.clone());
            Case {
                text: v["t"].as_str().expect("t").to_string(),
                with_specials,
                plain,
            }
        })
        .collect()
}

/// Readable report of the first mismatch: the string, and both id lists (with their
/// token strings) around the first differing position.
fn mismatch(t: &Tokenizer, what: &str, n: usize, text: &str, got: &[u32], want: &[u32]) -> String {
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let from = first.saturating_sub(4);
    let show = |ids: &[u32]| -> String {
        let w: Vec<String> = ids
            .iter()
            .skip(from)
            .take(16)
            .map(|&i| format!("{i}:{:?}", t.token_str(i).unwrap_or("<?>")))
            .collect();
        format!("[{from}..] {}", w.join(" "))
    };
    format!(
        "{what} mismatch on corpus string #{n}: {text:?}\n first difference at token {first}\n ours ({} ids): {}\n want ({} ids): {}",
        got.len(),
        show(got),
        want.len(),
        show(want)
    )
}

#[test]
fn corpus_is_large_and_varied() {
    let c = corpus();
    assert!(c.len() >= 2000, "only {} corpus strings", c.len());
    let all: String = c.iter().map(|x| x.text.as_str()).collect();
    for probe in [
        "fn main",
        "def ",
        "深度",
        "ひらがな",
        "한국어",
        "العربية",
        "हिंदी",
        "Привет",
        "‍",
        "🏽",
        "\r\n",
        "<｜User｜>",
        "｜DSML｜",
    ] {
        assert!(all.contains(probe), "corpus lacks {probe:?}");
    }
}

#[test]
fn encode_with_specials_matches_hf() {
    let t = tok();
    for (n, c) in corpus().iter().enumerate() {
        let got = t.encode_with_specials(&c.text);
        if got != c.with_specials {
            panic!(
                "{}",
                mismatch(
                    t,
                    "encode_with_specials",
                    n,
                    &c.text,
                    &got,
                    &c.with_specials
                )
            );
        }
    }
}

#[test]
fn plain_encode_matches_hf_without_added_tokens() {
    let t = tok();
    for (n, c) in corpus().iter().enumerate() {
        let got = t.encode(&c.text);
        if got != c.plain {
            panic!("{}", mismatch(t, "encode", n, &c.text, &got, &c.plain));
        }
    }
}

#[test]
fn decode_roundtrips_and_streams() {
    let t = tok();
    for (n, c) in corpus().iter().enumerate() {
        for ids in [&c.with_specials, &c.plain] {
            let bytes = t.decode(ids).expect("decode");
            assert_eq!(
                bytes,
                c.text.as_bytes(),
                "decode(encode(s)) != s for #{n} {:?}",
                c.text
            );
            let mut sd = StreamDecoder::new();
            let mut s = String::new();
            for &id in ids.iter() {
                // Every push returns whole characters only (it is a String), and nothing
                // that is not a prefix of the text.
                s.push_str(&sd.push(t, id).expect("push"));
                assert!(
                    c.text.starts_with(&s),
                    "stream went wrong on #{n} {:?}: {s:?}",
                    c.text
                );
            }
            s.push_str(&sd.flush());
            assert_eq!(s, c.text, "streamed text differs for #{n}");
        }
    }
}

#[test]
fn uncached_and_cached_encodes_agree() {
    // Second pass hits the piece cache; a fresh tokenizer misses it.
    let c = corpus();
    let fresh = Tokenizer::from_builtin(builtin::deepseek_v4()).unwrap();
    for x in c.iter().rev().take(200) {
        assert_eq!(fresh.encode(&x.text), x.plain);
        assert_eq!(fresh.encode(&x.text), x.plain);
    }
}
