mod common;

use common::*;
use ds4_chat::*;

#[test]
fn doc_example_3_1() {
    let p = parse_output(DOC_3_1_OUTPUT, false);
    assert_eq!(p.content, "I'll look at the first lines of the config.");
    assert_eq!(p.tool_calls.len(), 1);
    assert_eq!(p.tool_calls[0].name, "read_file");
    assert_eq!(
        p.tool_calls[0].arguments_json,
        r#"{"path":"conf/app.toml","limit":25,"flags":{"raw":true}}"#
    );
    assert_eq!(
        p.raw_dsml.as_deref(),
        Some(&DOC_3_1_OUTPUT[DOC_3_1_OUTPUT.find("\n\n").unwrap()..])
    );
    assert_eq!(p.status, DsmlStatus::Parsed(Dialect::Full));
}

fn case(name: &str) -> ParseCase {
    parse_cases().into_iter().find(|c| c.name == name).unwrap()
}

#[test]
fn c_test_suite_assertions() {
    // Facts from ds4_server.c's unit tests (test_parse_*, test_dsml_parser_*, test_thinking_dsml_*,
    // test_tool_separator_*, test_tool_parse_failure_*).
    let p = parse_output(&case("short_dialect").text, true);
    assert_eq!(
        (
            p.reasoning.as_deref(),
            p.content.as_str(),
            p.tool_calls.len()
        ),
        (Some("need a tool"), "", 1)
    );
    let p = parse_output(&case("nested_recovery").text, false);
    assert_eq!(p.content, "review done");
    assert_eq!(p.tool_calls[0].name, "edit");
    assert_eq!(
        p.tool_calls[0].arguments_json,
        r#"{"path":"/private/tmp/tetris.c","edits":{"oldText":"old <text>","newText":"new text"}}"#
    );
    let c = case("missing_invoke_name");
    let p = parse_output(&c.text, false);
    assert!(matches!(
        p.status,
        DsmlStatus::Malformed(DsmlError {
            kind: DsmlErrorKind::MissingInvokeName,
            ..
        })
    ));
    assert_eq!(
        (
            p.content.as_str(),
            p.reasoning.as_deref(),
            p.tool_calls.len()
        ),
        (c.text.as_str(), None, 0)
    );
    let p = parse_output(&case("dsml_inside_reasoning").text, true);
    assert!(p.tool_calls.is_empty() && p.reasoning.unwrap().contains("<｜DSML｜tool_calls>"));
    assert_eq!(p.content, "Final answer.");
    let p = parse_output(&case("thinking_tool_after_close").text, true);
    assert_eq!(
        (p.reasoning.as_deref(), p.content.as_str()),
        (Some("need a shell check"), "")
    );
    assert_eq!(p.tool_calls[0].arguments_json, r#"{"command":"pwd"}"#);
    let p = parse_output(&case("separator_whitespace").text, true);
    assert_eq!(p.content, "I will inspect the files.");
}

#[test]
fn error_names_offset() {
    let c = case("unknown_tag");
    let p = parse_output(&c.text, false);
    let DsmlStatus::Malformed(e) = p.status else {
        panic!("{:?}", p.status)
    };
    assert_eq!(e.kind, DsmlErrorKind::ExpectedInvoke);
    assert!(c.text[e.offset..].starts_with("<｜DSML｜call"));
    assert!(e.to_string().contains(&format!("byte {}", e.offset)));
    let p = parse_output(&case("unterminated_value").text, true);
    assert!(matches!(p.status, DsmlStatus::Unterminated { .. }));
    assert_eq!(
        p.content,
        case("unterminated_value").text,
        "failure: the whole text is content"
    );
}

#[test]
fn parse_snapshots() {
    for c in parse_cases() {
        snapshot(
            &format!("parse/{}.txt", c.name),
            &describe(&parse_output(&c.text, c.thinking)),
        );
    }
}

fn run_chunks(text: &[u8], cuts: &[usize], opts: ParseOptions) -> (Vec<StreamEvent>, ParsedOutput) {
    let mut sp = StreamParser::new(opts);
    let mut ev = Vec::new();
    let mut prev = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        ev.extend(sp.push_bytes(&text[prev..c]));
        prev = c;
    }
    let (tail, out) = sp.finish();
    ev.extend(tail);
    (coalesce(ev), out)
}

/// Checks that the streamed events agree with the final result.
fn check_events(
    name: &str,
    text: &str,
    ev: &[StreamEvent],
    out: &ParsedOutput,
    opts: ParseOptions,
) {
    let cat =
        |f: &dyn Fn(&StreamEvent) -> Option<String>| ev.iter().filter_map(f).collect::<String>();
    let reasoning = cat(&|e| {
        if let StreamEvent::Reasoning(s) = e {
            Some(s.clone())
        } else {
            None
        }
    });
    let content = cat(&|e| {
        if let StreamEvent::Content(s) = e {
            Some(s.clone())
        } else {
            None
        }
    });
    let failed = matches!(
        out.status,
        DsmlStatus::Malformed(_) | DsmlStatus::Unterminated { .. }
    );
    if opts.thinking {
        let body = text.strip_prefix("<think>").unwrap_or(text);
        let expect_r = body.find("</think>").map_or(body, |i| &body[..i]);
        assert_eq!(reasoning, expect_r, "{name}: reasoning deltas");
        assert_eq!(
            ev.contains(&StreamEvent::ReasoningEnd),
            out.reasoning_closed,
            "{name}"
        );
    } else {
        assert!(reasoning.is_empty(), "{name}");
    }
    if failed {
        // Visible deltas carried the text after </think>; the final content is the whole text.
        let surface = if opts.thinking {
            &text[text.find("</think>").map_or(text.len(), |i| i + 8)..]
        } else {
            text
        };
        assert_eq!(content, surface, "{name}: content deltas after failure");
        assert!(
            ev.iter()
                .any(|e| matches!(e, StreamEvent::ToolBlockFailed(s) if *s == out.status)),
            "{name}"
        );
    } else {
        assert_eq!(content, out.content, "{name}: content deltas");
        assert_eq!(
            ev.contains(&StreamEvent::ToolBlockEnd),
            matches!(out.status, DsmlStatus::Parsed(_)),
            "{name}"
        );
        for (i, call) in out.tool_calls.iter().enumerate() {
            assert!(
                ev.contains(&StreamEvent::ToolCallStart {
                    index: i,
                    name: call.name.clone()
                }),
                "{name}"
            );
            let args = cat(&|e| match e {
                StreamEvent::ToolArgs { index, json_delta } if *index == i => {
                    Some(json_delta.clone())
                }
                _ => None,
            });
            assert_eq!(
                args, call.arguments_json,
                "{name}: argument deltas of call {i}"
            );
            assert!(
                ev.contains(&StreamEvent::ToolCallEnd { index: i }),
                "{name}"
            );
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn streaming_equals_whole_text_parse() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for c in parse_cases() {
        for detect_tools in [true, false] {
            let opts = ParseOptions {
                thinking: c.thinking,
                detect_tools,
            };
            let expected = parse_output_with(&c.text, opts);
            let bytes = c.text.as_bytes();
            let (ev0, out0) = run_chunks(bytes, &[], opts);
            assert_eq!(out0, expected, "{}: one chunk", c.name);
            check_events(c.name, &c.text, &ev0, &out0, opts);
            // Every single split point (including inside UTF-8 sequences, tags and entities).
            for cut in 0..=bytes.len() {
                let (ev, out) = run_chunks(bytes, &[cut], opts);
                assert_eq!(out, expected, "{}: split at {cut}", c.name);
                assert_eq!(ev, ev0, "{}: events differ when split at {cut}", c.name);
            }
            // Byte by byte, and random chunkings.
            let all: Vec<usize> = (1..bytes.len()).collect();
            let (ev, out) = run_chunks(bytes, &all, opts);
            assert_eq!(
                (ev, out),
                (ev0.clone(), expected.clone()),
                "{}: byte by byte",
                c.name
            );
            for _ in 0..20 {
                let mut cuts = Vec::new();
                let mut p = 0;
                loop {
                    p += 1 + (rng.next() % 9) as usize;
                    if p >= bytes.len() {
                        break;
                    }
                    cuts.push(p);
                }
                let (ev, out) = run_chunks(bytes, &cuts, opts);
                assert_eq!(
                    (ev, out),
                    (ev0.clone(), expected.clone()),
                    "{}: cuts {cuts:?}",
                    c.name
                );
            }
        }
    }
}

#[test]
fn streaming_holds_back_only_partial_markup() {
    let opts = ParseOptions {
        thinking: false,
        detect_tools: true,
    };
    let mut sp = StreamParser::new(opts);
    assert_eq!(
        sp.push("Hello <"),
        vec![StreamEvent::Content("Hello".into())]
    );
    assert_eq!(sp.push("b> x"), vec![StreamEvent::Content(" <b> x".into())]);
    assert_eq!(
        sp.push("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\""),
        vec![StreamEvent::ToolBlockStart]
    );
    assert_eq!(
        sp.push(">"),
        vec![StreamEvent::ToolCallStart {
            index: 0,
            name: "bash".into()
        }]
    );
    let ev = sp.push("<｜DSML｜parameter name=\"cmd\" string=\"true\">ls &am");
    assert_eq!(
        ev,
        vec![StreamEvent::ToolArgs {
            index: 0,
            json_delta: "{\"cmd\":\"ls ".into()
        }]
    );
    assert_eq!(
        sp.push("p; \"x\"</｜DSML｜para"),
        vec![StreamEvent::ToolArgs {
            index: 0,
            json_delta: "& \\\"x\\\"".into()
        }]
    );
    assert!(!sp.block_closed());
    let ev = sp.push("meter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
    assert_eq!(
        ev,
        vec![
            StreamEvent::ToolArgs {
                index: 0,
                json_delta: "\"}".into()
            },
            StreamEvent::ToolCallEnd { index: 0 },
            StreamEvent::ToolBlockEnd
        ]
    );
    assert!(sp.block_closed());
    assert!(sp.push("ignored").is_empty());
    let (ev, out) = sp.finish();
    assert!(ev.is_empty());
    assert_eq!(out.tool_calls[0].arguments_json, r#"{"cmd":"ls & \"x\""}"#);

    // Reasoning: partial </think> held, partial UTF-8 held.
    let mut sp = StreamParser::new(ParseOptions {
        thinking: true,
        detect_tools: true,
    });
    assert_eq!(sp.push("<thi"), vec![]);
    assert_eq!(
        sp.push("nk>abc</th"),
        vec![StreamEvent::Reasoning("abc".into())]
    );
    assert_eq!(
        sp.push_bytes(b"ink>\xF0\x9F"),
        vec![StreamEvent::ReasoningEnd]
    );
    assert_eq!(
        sp.push_bytes(b"\x99\x82"),
        vec![StreamEvent::Content("🙂".into())]
    );
    let (_, out) = sp.finish();
    assert_eq!(
        (out.reasoning.as_deref(), out.content.as_str()),
        (Some("abc"), "🙂")
    );
}

#[test]
fn invalid_utf8_matches_lossy_decoding() {
    let bytes = b"ok \xFF\xFE</think>x\xE2\x82";
    let opts = ParseOptions {
        thinking: true,
        detect_tools: true,
    };
    for cut in 0..=bytes.len() {
        let (_, out) = run_chunks(bytes, &[cut], opts);
        assert_eq!(
            out,
            parse_output_with(&String::from_utf8_lossy(bytes), opts)
        );
    }
}

#[test]
fn detection_off_for_tool_choice_none() {
    let p = parse_output_with(
        DOC_3_1_OUTPUT,
        ParseOptions {
            thinking: false,
            detect_tools: false,
        },
    );
    assert_eq!(
        (p.content.as_str(), p.tool_calls.len(), &p.status),
        (DOC_3_1_OUTPUT, 0, &DsmlStatus::NoBlock)
    );
}

#[test]
fn sampling_state_tracks_structure_and_payload() {
    let mut sp = StreamParser::new(ParseOptions {
        thinking: false,
        detect_tools: true,
    });
    let mut at = |chunk: &str| {
        sp.push(chunk);
        sp.sampling_state()
    };
    use SamplingState::*;
    assert_eq!(at("I'll look.\n\n"), Outside);
    assert_eq!(
        at("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n"),
        Structure
    );
    assert_eq!(
        at("<｜DSML｜parameter name=\"path\" string=\"true\">"),
        Payload
    );
    assert_eq!(at("conf/app <b>"), Payload);
    assert_eq!(at("</"), Structure);
    assert_eq!(at("｜DSML｜parameter>\n"), Structure);
    assert_eq!(
        at("<｜DSML｜parameter name=\"flags\" string=\"false\">{"),
        Structure
    );
    assert_eq!(at("\"ra"), Payload);
    assert_eq!(
        at("w\\\""),
        Payload,
        "escaped quote stays inside the string"
    );
    assert_eq!(at("\": "), Structure);
    assert_eq!(
        at("true}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"),
        Structure
    );
    assert_eq!(at("</｜DSML｜tool_calls>"), Outside);
    let (_, out) = sp.finish();
    assert_eq!(
        out.tool_calls[0].arguments_json,
        r#"{"path":"conf/app <b>","flags":{"raw\"":true}}"#
    );
}

/// Random soups of DSML fragments: no panics, and streaming always equals the whole-text parse.
#[test]
fn random_dsml_soup_streams_like_whole_text() {
    const PIECES: &[&str] = &[
        "<｜DSML｜tool_calls>",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜invoke name=\"f\">",
        "<｜DSML｜invoke>",
        "</｜DSML｜invoke>",
        "<｜DSML｜parameter name=\"p\" string=\"true\">",
        "<｜DSML｜parameter name=\"q\" string=\"false\">",
        "<｜DSML｜parameter name=\"n\">",
        "</｜DSML｜parameter>",
        "<DSML｜tool_calls>",
        "<DSML｜invoke name=\"s\">",
        "<DSML｜parameter name=\"x\" string=\"true\">",
        "</DSML｜parameter>",
        "</DSML｜invoke>",
        "</DSML｜tool_calls>",
        "<tool_calls>",
        "<invoke name=\"x\">",
        "<parameter name=\"y\">",
        "</parameter>",
        "</invoke>",
        "</tool_calls>",
        "<think>",
        "</think>",
        "&amp;",
        "&lt;",
        "&",
        "&quo",
        "\n\n",
        " ",
        "\t",
        "hello",
        "{\"a\": [1, 2]}",
        "\"s\\\"",
        "42",
        "ü😀",
        "<",
        ">",
        "</",
        "<｜",
    ];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for round in 0..3000 {
        let n = 1 + (rng.next() % 24) as usize;
        let text: String = (0..n)
            .map(|_| PIECES[(rng.next() % PIECES.len() as u64) as usize])
            .collect();
        let opts = ParseOptions {
            thinking: rng.next() % 2 == 0,
            detect_tools: rng.next() % 5 != 0,
        };
        let expected = parse_output_with(&text, opts);
        let bytes = text.as_bytes();
        let (ev0, out0) = run_chunks(bytes, &[], opts);
        assert_eq!(out0, expected, "round {round}: {text:?}");
        check_events("soup", &text, &ev0, &out0, opts);
        for _ in 0..4 {
            let mut cuts = Vec::new();
            let mut p = 0;
            loop {
                p += 1 + (rng.next() % 7) as usize;
                if p >= bytes.len() {
                    break;
                }
                cuts.push(p);
            }
            let (ev, out) = run_chunks(bytes, &cuts, opts);
            assert_eq!(out, expected, "round {round}: {text:?} cuts {cuts:?}");
            assert_eq!(ev, ev0, "round {round}: {text:?} cuts {cuts:?}");
        }
    }
}

/// Generates a well-formed turn (random dialect, calls, parameter kinds, values), then
/// sometimes corrupts it (drop, duplicate or truncate a piece).
fn random_turn(rng: &mut Rng) -> (String, bool) {
    let pick = |rng: &mut Rng, xs: &[&'static str]| xs[(rng.next() % xs.len() as u64) as usize];
    let values = [
        "ls -la",
        "a &lt;b&gt; &amp;&amp; c",
        "",
        " x \n y ",
        "ü😀 日本",
        "&quo",
        "</think>",
        "{\"k\": [1, \"v\"]}",
        "1.5e3",
        "{bad",
    ];
    let thinking = rng.next() % 2 == 0;
    let mut parts: Vec<String> = Vec::new();
    if thinking {
        parts.push(pick(rng, &["", "<think>"]).into());
        parts.push(
            pick(
                rng,
                &["hmm", "plan & act", "", "quote <｜DSML｜tool_calls> here"],
            )
            .into(),
        );
        parts.push("</think>".into());
    }
    parts.push(pick(rng, &["", "Sure.", "Text with <b>tags</b> & more", "ok "]).into());
    parts.push(pick(rng, &["\n\n", "", " \n", "\n\n\n"]).into());
    let d = pick(rng, &["｜DSML｜", "DSML｜", ""]);
    parts.push(format!("<{d}tool_calls>\n"));
    for i in 0..rng.next() % 4 {
        parts.push(format!("<{d}invoke name=\"tool{i}\">\n"));
        for j in 0..rng.next() % 4 {
            let v = pick(rng, &values);
            match rng.next() % 4 {
                0 => parts.push(format!(
                    "<{d}parameter name=\"p{j}\" string=\"true\">{v}</{d}parameter>\n"
                )),
                1 => parts.push(format!(
                    "<{d}parameter name=\"p{j}\" string=\"false\">{v}</{d}parameter>\n"
                )),
                2 => parts.push(format!("<{d}parameter name=\"p{j}\">{v}</{d}parameter>\n")),
                _ => {
                    parts.push(format!("<{d}parameter name=\"p{j}\">\n"));
                    parts.push(format!(
                        "<{d}parameter name=\"in\" string=\"true\">{v}</{d}parameter>\n"
                    ));
                    if rng.next() % 2 == 0 {
                        parts.push(format!("</{d}parameter>\n"));
                    }
                }
            }
        }
        parts.push(format!("</{d}invoke>\n"));
    }
    parts.push(format!("</{d}tool_calls>"));
    match rng.next() % 6 {
        0 => {
            let i = (rng.next() % parts.len() as u64) as usize;
            parts.remove(i);
        }
        1 => {
            let i = (rng.next() % parts.len() as u64) as usize;
            let p = parts[i].clone();
            parts.insert(i, p);
        }
        2 => {
            let t: String = parts.concat();
            let mut cut = (rng.next() % (t.len() as u64 + 1)) as usize;
            while !t.is_char_boundary(cut) {
                cut -= 1;
            }
            return (t[..cut].to_string(), thinking);
        }
        _ => {}
    }
    (parts.concat(), thinking)
}

#[test]
fn random_turns_stream_like_whole_text() {
    let mut rng = Rng(0x0bad_cafe_f00d_d00d);
    let mut parsed_with_calls = 0;
    for round in 0..3000 {
        let (text, thinking) = random_turn(&mut rng);
        let opts = ParseOptions {
            thinking,
            detect_tools: true,
        };
        let expected = parse_output_with(&text, opts);
        if matches!(expected.status, DsmlStatus::Parsed(_)) && !expected.tool_calls.is_empty() {
            parsed_with_calls += 1;
            for c in &expected.tool_calls {
                // Arguments are always valid JSON objects (invalid values become strings).
                let v: serde_json::Value = serde_json::from_str(&c.arguments_json).unwrap();
                assert!(v.is_object(), "{}", c.arguments_json);
            }
        }
        let bytes = text.as_bytes();
        let (ev0, out0) = run_chunks(bytes, &[], opts);
        assert_eq!(out0, expected, "round {round}: {text:?}");
        check_events("turn", &text, &ev0, &out0, opts);
        for _ in 0..4 {
            let mut cuts = Vec::new();
            let mut p = 0;
            loop {
                p += 1 + (rng.next() % 11) as usize;
                if p >= bytes.len() {
                    break;
                }
                cuts.push(p);
            }
            let (ev, out) = run_chunks(bytes, &cuts, opts);
            assert_eq!(out, expected, "round {round}: {text:?} cuts {cuts:?}");
            assert_eq!(ev, ev0, "round {round}: {text:?} cuts {cuts:?}");
        }
    }
    assert!(
        parsed_with_calls > 500,
        "generator too weak: {parsed_with_calls}"
    );
}

#[test]
fn unclosed_reasoning_policy() {
    let mut p = parse_output("<think>partial thought", true);
    assert_eq!(
        (p.reasoning.as_deref(), p.reasoning_closed),
        (Some("partial thought"), false)
    );
    p.unclosed_reasoning_as_content();
    assert_eq!((p.reasoning, p.content.as_str()), (None, "partial thought"));
    let mut q = parse_output("r</think>answer", true);
    q.unclosed_reasoning_as_content();
    assert_eq!(
        (q.reasoning.as_deref(), q.content.as_str()),
        (Some("r"), "answer")
    );
}
