//! Compares with C ds4's own renderer and parser (tools/oracle.c, run by hand; its
//! output is committed in tests/oracle/expected.bin).
mod common;

use common::*;
use ds4_chat::*;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oracle")
}

fn put(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(format!("{}\n", s.len()).as_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn take<'a>(buf: &'a [u8], pos: &mut usize) -> &'a str {
    let nl = pos.to_owned()
        + buf[*pos..]
            .iter()
            .position(|&b| b == b'\n')
            .expect("framed record");
    let n: usize = std::str::from_utf8(&buf[*pos..nl])
        .unwrap()
        .parse()
        .unwrap();
    let s = std::str::from_utf8(&buf[nl + 1..nl + 1 + n]).expect("utf-8 record");
    *pos = nl + 1 + n;
    s
}

/// Removes JSON whitespace outside strings (C separates members with ", " and ": ").
fn strip_json_ws(s: &str) -> String {
    let (mut out, mut in_str, mut esc) = (String::new(), false, false);
    for c in s.chars() {
        if in_str {
            esc = !esc && c == '\\';
            in_str = esc || c != '"';
            out.push(c);
        } else if c == '"' {
            in_str = true;
            out.push(c);
        } else if !c.is_ascii_whitespace() {
            out.push(c);
        }
    }
    out
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::Developer => "developer",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

fn cases_bin() -> Vec<u8> {
    let mut out = Vec::new();
    for c in render_cases().iter().filter(|c| c.c_same) {
        put(&mut out, "render");
        let mode = match c.req.think {
            ThinkMode::None => "0",
            ThinkMode::High => "1",
            ThinkMode::Max => "2",
        };
        put(&mut out, mode);
        let schemas = if c.req.tools_active() {
            c.req.tools.join("\n")
        } else {
            String::new()
        };
        put(&mut out, &schemas);
        put(&mut out, &c.req.messages.len().to_string());
        for (i, m) in c.req.messages.iter().enumerate() {
            put(&mut out, role_name(m.role));
            put(&mut out, &m.content);
            put(&mut out, if m.reasoning.is_some() { "1" } else { "0" });
            put(&mut out, m.reasoning.as_deref().unwrap_or(""));
            put(
                &mut out,
                c.replay
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or("", |(_, b)| b.as_str()),
            );
            put(&mut out, &m.tool_calls.len().to_string());
            for t in &m.tool_calls {
                put(&mut out, &t.name);
                put(&mut out, &t.arguments);
            }
        }
    }
    for c in parse_cases().iter().filter(|c| c.c_same) {
        put(&mut out, "parse");
        put(&mut out, if c.thinking { "1" } else { "0" });
        put(&mut out, &c.text);
    }
    out
}

#[test]
fn matches_c_ds4() {
    let cases = cases_bin();
    if std::env::var_os("DS4_WRITE_ORACLE_CASES").is_some() {
        std::fs::create_dir_all(dir()).unwrap();
        std::fs::write(dir().join("cases.bin"), &cases).unwrap();
        return;
    }
    let committed = std::fs::read(dir().join("cases.bin")).expect("tests/oracle/cases.bin");
    assert!(
        committed == cases,
        "cases changed: regenerate tests/oracle (see tools/oracle.c)"
    );
    let exp = std::fs::read(dir().join("expected.bin")).expect("tests/oracle/expected.bin");
    let mut pos = 0;
    let mut n = 0;
    for c in render_cases().iter().filter(|c| c.c_same) {
        let ours = render_chat_prompt(&c.req, &replay_of(c));
        assert_eq!(ours, take(&exp, &mut pos), "render case {}", c.name);
        n += 1;
    }
    for c in parse_cases().iter().filter(|c| c.c_same) {
        let ok = take(&exp, &mut pos) == "ok";
        let has_r = take(&exp, &mut pos) == "1";
        let reasoning = take(&exp, &mut pos).to_string();
        let content = take(&exp, &mut pos).to_string();
        let ncalls: usize = take(&exp, &mut pos).parse().unwrap();
        let calls: Vec<(String, String)> = (0..ncalls)
            .map(|_| {
                (
                    take(&exp, &mut pos).to_string(),
                    strip_json_ws(take(&exp, &mut pos)),
                )
            })
            .collect();
        let raw = take(&exp, &mut pos).to_string();
        let p = parse_output(&c.text, c.thinking);
        let our_ok = !matches!(
            p.status,
            DsmlStatus::Malformed(_) | DsmlStatus::Unterminated { .. }
        );
        assert_eq!(our_ok, ok, "parse case {}: ok flag", c.name);
        if ok {
            assert_eq!(
                p.reasoning.as_deref(),
                has_r.then_some(reasoning.as_str()),
                "parse case {}",
                c.name
            );
            assert_eq!(p.content, content, "parse case {}", c.name);
            let ours: Vec<(String, String)> = p
                .tool_calls
                .iter()
                .map(|t| (t.name.clone(), t.arguments_json.clone()))
                .collect();
            assert_eq!(ours, calls, "parse case {}", c.name);
            assert_eq!(p.raw_dsml.unwrap_or_default(), raw, "parse case {}", c.name);
        }
        n += 1;
    }
    assert_eq!(pos, exp.len(), "expected.bin has extra records");
    assert!(n > 30);
}
