//! The DeepSeek V4 tokenizer on arbitrary text: encoding then decoding gives back the
//! text's bytes exactly (byte-level BPE loses nothing), with and without special-token
//! recognition; every id is inside the vocabulary.
#![no_main]

use ds4_tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let v = ds4_tokenizer::builtin::deepseek_v4();
        Tokenizer::from_vocab(v.tokens, v.merges).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let t = tok();
    let n = t.vocab_size() as u32;
    for ids in [
        t.encode(text),
        t.encode_with_specials(text),
        t.encode_with_chat_specials(text),
    ] {
        assert!(ids.iter().all(|&i| i < n));
        assert_eq!(t.decode(&ids).unwrap(), text.as_bytes());
    }
});
