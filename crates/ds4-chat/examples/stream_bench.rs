//! Throughput of the whole-text and incremental DSML parsers on a large generated turn
//! (long reasoning, a file-write call with a 1 MiB string argument, a large JSON value and
//! a large nested-parameter value), fed in 4-byte chunks like token pieces.
//!
//!     cargo run -p ds4-chat --release --example stream_bench

use ds4_chat::*;
use std::time::Instant;

fn main() {
    let mut text = String::new();
    for i in 0..5_000 * scale() {
        text.push_str(&format!(
            "Step {i}: consider the edge case & check the <b>bounds</b>.\n"
        ));
    }
    text.push_str(
        "</think>Writing the file now.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"write\">\n",
    );
    text.push_str("<｜DSML｜parameter name=\"content\" string=\"true\">");
    for i in 0..20_000 * scale() {
        text.push_str(&format!(
            "fn f{i}() -> u32 {{ if a &lt; b && c > d {{ 1 }} else {{ 2 }} }}\n"
        ));
    }
    text.push_str("</｜DSML｜parameter>\n<｜DSML｜parameter name=\"table\" string=\"false\">[");
    for i in 0..10_000 * scale() {
        text.push_str(&format!("{{\"k\": {i}, \"v\": \"x y\"}}, "));
    }
    text.push_str("0]</｜DSML｜parameter>\n<｜DSML｜parameter name=\"edits\">\n");
    text.push_str("<｜DSML｜parameter name=\"old\" string=\"true\">");
    text.push_str(&"old line\n".repeat(20_000 * scale()));
    text.push_str(
        "</｜DSML｜parameter>\n</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    );
    let mb = text.len() as f64 / (1 << 20) as f64;

    let t = Instant::now();
    let whole = parse_output(&text, true);
    let dt_whole = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let mut sp = StreamParser::new(ParseOptions {
        thinking: true,
        detect_tools: true,
    });
    let mut events = 0;
    for chunk in text.as_bytes().chunks(4) {
        events += sp.push_bytes(chunk).len();
    }
    let (tail, streamed) = sp.finish();
    let dt_stream = t.elapsed().as_secs_f64();
    assert_eq!(streamed, whole);
    assert_eq!(whole.tool_calls.len(), 1);
    println!(
        "{mb:.2} MiB: parse_output {:.1} ms ({:.0} MiB/s); StreamParser 4-byte chunks {:.1} ms ({:.0} MiB/s, {} events)",
        dt_whole * 1e3,
        mb / dt_whole,
        dt_stream * 1e3,
        mb / dt_stream,
        events + tail.len()
    );
}

/// Size multiplier (`SCALE`, default 1), to check that time grows linearly.
fn scale() -> usize {
    std::env::var("SCALE").map_or(1, |v| v.parse().expect("SCALE is a number"))
}
