//! Model output through the DSML / reasoning parsers: arbitrary bytes (invalid UTF-8 too),
//! streamed in fuzz-chosen chunks, must give the same result as the whole-text parse of
//! their lossy decoding, and the same coalesced events as one chunk. First input byte:
//! options (bit 0 thinking, bit 1 tool detection); next two: chunking seed.
#![no_main]

use ds4_chat::{
    coalesce, parse_output_with, ParseOptions, ParsedOutput, StreamEvent, StreamParser,
};
use libfuzzer_sys::fuzz_target;

fn stream(text: &[u8], cuts: &[usize], opts: ParseOptions) -> (Vec<StreamEvent>, ParsedOutput) {
    let mut sp = StreamParser::new(opts);
    let mut ev = Vec::new();
    let mut prev = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        ev.extend(sp.push_bytes(&text[prev..c]));
        let _ = (sp.block_closed(), sp.in_tool_block(), sp.sampling_state());
        prev = c;
    }
    let (tail, out) = sp.finish();
    ev.extend(tail);
    (coalesce(ev), out)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let opts = ParseOptions {
        thinking: data[0] & 1 != 0,
        detect_tools: data[0] & 2 != 0,
    };
    let text = &data[3..];
    // Cuts from a small xorshift seeded by bytes 1-2 (1 to 8 pieces, ascending).
    let mut x = u16::from_le_bytes([data[1], data[2]]) as u32 | 1;
    let mut cuts = Vec::new();
    if !text.is_empty() {
        for _ in 0..(x % 8) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            cuts.push(x as usize % (text.len() + 1));
        }
    }
    cuts.sort_unstable();
    let whole = parse_output_with(&String::from_utf8_lossy(text), opts);
    let (ev1, out1) = stream(text, &[], opts);
    let (ev, out) = stream(text, &cuts, opts);
    assert_eq!(out1, whole, "one chunk against the whole-text parse");
    assert_eq!(out, whole, "chunks {cuts:?} against the whole-text parse");
    assert_eq!(ev, ev1, "events of chunks {cuts:?} against one chunk");
});
