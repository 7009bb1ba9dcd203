//! Parsing generated text: reasoning split (§2.2) and DSML tool calls (§3.4).
//!
//! The structural steps here are shared by the whole-text parser ([`parse_output`]) and
//! the incremental one ([`crate::StreamParser`]); each step looks at the text from a
//! position and either succeeds, needs more input, or fails at a byte offset.
//!
//! Deliberate differences from C ds4 (each makes streaming and non-streaming agree):
//! * the block starts at the *earliest* start tag of any dialect (C tries the dialects in
//!   a fixed order over the whole text);
//! * reasoning ends at the *first* `</think>` and tools are searched after it (C searches
//!   after the last one, so a tool argument containing `</think>` broke the call);
//! * without thinking, `</think>` is not special in the output (no reasoning split);
//! * in thinking mode without `</think>` the text is returned as reasoning with
//!   `reasoning_closed: false` (the caller picks the §2.2 policy);
//! * an invalid JSON value of a `string="false"` parameter is kept as a JSON string and
//!   flagged in [`ParsedCall::invalid_json`] instead of silently becoming `{}`.

use crate::json::{is_c_space, minify, quote, trim_c_space};
use crate::protocol::{THINK_CLOSE, THINK_OPEN};
use std::fmt;

/// The three tag spellings the model is known to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `<｜DSML｜tool_calls>` …
    Full,
    /// First bar missing: `<DSML｜tool_calls>` …
    Short,
    /// Plain XML: `<tool_calls>`, `<invoke`, `<parameter`.
    Xml,
}

pub(crate) struct Tags {
    pub calls_open: &'static str,
    pub calls_close: &'static str,
    pub invoke_open: &'static str,
    pub invoke_close: &'static str,
    pub param_open: &'static str,
    pub param_close: &'static str,
}

const FULL: Tags = Tags {
    calls_open: "<｜DSML｜tool_calls>",
    calls_close: "</｜DSML｜tool_calls>",
    invoke_open: "<｜DSML｜invoke",
    invoke_close: "</｜DSML｜invoke>",
    param_open: "<｜DSML｜parameter",
    param_close: "</｜DSML｜parameter>",
};
const SHORT: Tags = Tags {
    calls_open: "<DSML｜tool_calls>",
    calls_close: "</DSML｜tool_calls>",
    invoke_open: "<DSML｜invoke",
    invoke_close: "</DSML｜invoke>",
    param_open: "<DSML｜parameter",
    param_close: "</DSML｜parameter>",
};
const XML: Tags = Tags {
    calls_open: "<tool_calls>",
    calls_close: "</tool_calls>",
    invoke_open: "<invoke",
    invoke_close: "</invoke>",
    param_open: "<parameter",
    param_close: "</parameter>",
};

pub(crate) const DIALECTS: [Dialect; 3] = [Dialect::Full, Dialect::Short, Dialect::Xml];

impl Dialect {
    pub(crate) fn tags(self) -> &'static Tags {
        match self {
            Dialect::Full => &FULL,
            Dialect::Short => &SHORT,
            Dialect::Xml => &XML,
        }
    }
}

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// Compact JSON object, keys in the order the model emitted them.
    pub arguments_json: String,
    /// Parameters (`outer.inner` for nested ones) whose `string="false"` value was not
    /// valid JSON; each is carried as a JSON string of the raw text instead.
    pub invalid_json: Vec<String>,
}

/// What went wrong in a tool block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DsmlErrorKind {
    /// Expected an `invoke` tag or the closing `tool_calls` tag.
    ExpectedInvoke,
    /// Expected a `parameter` tag or the closing `invoke` tag.
    ExpectedParameter,
    /// An `invoke` tag without a non-empty `name="…"`.
    MissingInvokeName,
    /// A `parameter` tag without a non-empty `name="…"`.
    MissingParameterName,
}

/// A malformed tool block: what and where (byte offset into the whole generated text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DsmlError {
    pub kind: DsmlErrorKind,
    pub offset: usize,
}

impl fmt::Display for DsmlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            DsmlErrorKind::ExpectedInvoke => "expected an invoke tag or the closing tool_calls tag",
            DsmlErrorKind::ExpectedParameter => {
                "expected a parameter tag or the closing invoke tag"
            }
            DsmlErrorKind::MissingInvokeName => "invoke tag without a name attribute",
            DsmlErrorKind::MissingParameterName => "parameter tag without a name attribute",
        };
        write!(
            f,
            "malformed tool call block: {what} at byte {}",
            self.offset
        )
    }
}

impl std::error::Error for DsmlError {}

/// Outcome of DSML detection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DsmlStatus {
    /// No tool block (or detection disabled).
    NoBlock,
    /// A complete block was parsed.
    Parsed(Dialect),
    /// The block is malformed: no calls, the whole text is content.
    Malformed(DsmlError),
    /// The text ended inside the block (the request finishes with an error): no calls,
    /// the whole text is content. `offset` is where the block started.
    Unterminated { offset: usize },
}

/// The generated text, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOutput {
    /// `Some` in thinking mode (possibly empty), unless the tool block failed.
    pub reasoning: Option<String>,
    /// Whether `</think>` was seen (always false without thinking).
    pub reasoning_closed: bool,
    pub content: String,
    pub tool_calls: Vec<ParsedCall>,
    /// Exact bytes of the block from its start (with a directly preceding `\n\n`) through
    /// the closing tag: what the exact-replay map stores.
    pub raw_dsml: Option<String>,
    pub status: DsmlStatus,
    /// A closing `tool_calls` tag appeared without an opening one (ignored; worth a log line).
    pub orphan_end: bool,
}

impl ParsedOutput {
    /// §2.2 policy for a thinking turn that never closed `</think>`: when the model stopped
    /// on its own (EOS, not a token limit), return the text as content so the answer is not
    /// empty. Call for finish `stop` only; no-op if reasoning was closed.
    pub fn unclosed_reasoning_as_content(&mut self) {
        if !self.reasoning_closed {
            if let Some(r) = self.reasoning.take() {
                self.content = r;
            }
        }
    }
}

/// Parser switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// The prompt ended with `<think>`: the text starts with reasoning.
    pub thinking: bool,
    /// Look for DSML (off for `tool_choice:"none"`).
    pub detect_tools: bool,
}

// ---------------------------------------------------------------------------------------
// Shared structural steps.

/// Result of one structural step at a position.
#[derive(Debug)]
pub(crate) enum Step<T> {
    Ok(T),
    /// The text so far is a proper prefix of something valid.
    NeedMore,
    Fail(DsmlError),
}

pub(crate) fn skip_ws(s: &str, mut p: usize) -> usize {
    let b = s.as_bytes();
    while p < b.len() && is_c_space(b[p]) {
        p += 1;
    }
    p
}

/// Decodes `&amp; &lt; &gt; &quot; &apos;`; any other `&` is literal.
pub(crate) fn decode_entities(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        match ENTITIES.iter().find(|(e, _)| rest.starts_with(e)) {
            Some((e, c)) => {
                out.push(*c);
                rest = &rest[e.len()..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

pub(crate) const ENTITIES: [(&str, char); 5] = [
    ("&amp;", '&'),
    ("&lt;", '<'),
    ("&gt;", '>'),
    ("&quot;", '"'),
    ("&apos;", '\''),
];

/// Length of the longest suffix of `s` that is a proper, non-empty prefix of `pat`.
pub(crate) fn partial_suffix(s: &str, pat: &str) -> usize {
    let (s, pat) = (s.as_bytes(), pat.as_bytes());
    let max = (pat.len() - 1).min(s.len());
    (1..=max)
        .rev()
        .find(|&k| s[s.len() - k..] == pat[..k])
        .unwrap_or(0)
}

/// Value of attribute `key="…"` in a tag (the key must follow whitespace), entity-decoded.
pub(crate) fn attr(tag: &str, key: &str) -> Option<String> {
    let pat = format!("{key}=\"");
    let mut from = 0;
    while let Some(i) = tag[from..].find(&pat) {
        let at = from + i;
        if at > 0 && is_c_space(tag.as_bytes()[at - 1]) {
            let v = at + pat.len();
            let end = tag[v..].find('"')?;
            return Some(decode_entities(&tag[v..v + end]));
        }
        from = at + pat.len();
    }
    None
}

/// Is an opening tag `open` (followed by whitespace or `>`) at `p`?
fn open_tag_at(s: &str, p: usize, open: &str) -> Step<bool> {
    let rest = &s[p..];
    if rest.starts_with(open) {
        match rest.as_bytes().get(open.len()) {
            None => Step::NeedMore,
            Some(&b) if b == b'>' || is_c_space(b) => Step::Ok(true),
            Some(_) => Step::Ok(false),
        }
    } else if open.starts_with(rest) {
        Step::NeedMore
    } else {
        Step::Ok(false)
    }
}

/// Is the exact tag `close` at `p`?
fn close_tag_at(s: &str, p: usize, close: &str) -> Step<bool> {
    let rest = &s[p..];
    if rest.starts_with(close) {
        Step::Ok(true)
    } else if close.starts_with(rest) {
        Step::NeedMore
    } else {
        Step::Ok(false)
    }
}

/// Reads a tag starting at `p` through its first `>`; returns (tag text, position after).
fn tag_through_gt(s: &str, p: usize) -> Option<(&str, usize)> {
    s[p..].find('>').map(|i| (&s[p..p + i + 1], p + i + 1))
}

/// Either the next invoke or the end of the block (`p` is after skipped whitespace).
pub(crate) enum InvokeOrEnd {
    Invoke { name: String, next: usize },
    End { next: usize },
}

pub(crate) fn invoke_or_end(s: &str, p: usize, t: &Tags) -> Step<InvokeOrEnd> {
    let close = close_tag_at(s, p, t.calls_close);
    let open = open_tag_at(s, p, t.invoke_open);
    match (close, open) {
        (Step::Ok(true), _) => Step::Ok(InvokeOrEnd::End {
            next: p + t.calls_close.len(),
        }),
        (_, Step::Ok(true)) => match tag_through_gt(s, p) {
            None => Step::NeedMore,
            Some((tag, next)) => match attr(tag, "name").filter(|n| !n.is_empty()) {
                Some(name) => Step::Ok(InvokeOrEnd::Invoke { name, next }),
                None => Step::Fail(DsmlError {
                    kind: DsmlErrorKind::MissingInvokeName,
                    offset: p,
                }),
            },
        },
        (Step::NeedMore, _) | (_, Step::NeedMore) => Step::NeedMore,
        _ => Step::Fail(DsmlError {
            kind: DsmlErrorKind::ExpectedInvoke,
            offset: p,
        }),
    }
}

/// A parameter head: name, `string` attribute if present, where the value starts.
pub(crate) struct ParamHead {
    pub name: String,
    pub string_attr: Option<String>,
    pub value_start: usize,
}

pub(crate) enum ParamOrEnd {
    Param(ParamHead),
    End { next: usize },
}

fn param_head(s: &str, p: usize) -> Step<ParamHead> {
    match tag_through_gt(s, p) {
        None => Step::NeedMore,
        Some((tag, next)) => match attr(tag, "name").filter(|n| !n.is_empty()) {
            Some(name) => Step::Ok(ParamHead {
                name,
                string_attr: attr(tag, "string"),
                value_start: next,
            }),
            None => Step::Fail(DsmlError {
                kind: DsmlErrorKind::MissingParameterName,
                offset: p,
            }),
        },
    }
}

pub(crate) fn param_or_end(s: &str, p: usize, t: &Tags) -> Step<ParamOrEnd> {
    let close = close_tag_at(s, p, t.invoke_close);
    let open = open_tag_at(s, p, t.param_open);
    match (close, open) {
        (Step::Ok(true), _) => Step::Ok(ParamOrEnd::End {
            next: p + t.invoke_close.len(),
        }),
        (_, Step::Ok(true)) => match param_head(s, p) {
            Step::Ok(h) => Step::Ok(ParamOrEnd::Param(h)),
            Step::NeedMore => Step::NeedMore,
            Step::Fail(e) => Step::Fail(e),
        },
        (Step::NeedMore, _) | (_, Step::NeedMore) => Step::NeedMore,
        _ => Step::Fail(DsmlError {
            kind: DsmlErrorKind::ExpectedParameter,
            offset: p,
        }),
    }
}

/// For a parameter without a `string` attribute: does its value (after whitespace) start
/// with another parameter tag (nested-parameter recovery)?
pub(crate) fn starts_nested(s: &str, value_start: usize, t: &Tags) -> Step<bool> {
    open_tag_at(s, skip_ws(s, value_start), t.param_open)
}

/// JSON text of a leaf value and whether it was valid.
pub(crate) fn value_json(raw: &str, is_string: bool) -> (String, bool) {
    if is_string {
        return (quote(&decode_entities(raw)), true);
    }
    let t = trim_c_space(raw);
    if t.is_empty() {
        return ("null".to_string(), true);
    }
    match minify(t) {
        Some(m) => (m, true),
        None => (quote(raw), false),
    }
}

pub(crate) fn is_string_attr(a: &Option<String>) -> bool {
    a.as_deref().is_none_or(|v| v == "true")
}

/// A parsed nested-parameter object: compact JSON, invalid member names, position after.
pub(crate) struct Nested {
    pub json: String,
    pub invalid: Vec<String>,
    pub next: usize,
}

/// Parses the members of a nested-parameter value starting at `value_start` (whose first
/// non-space text is a parameter tag), then skips an optional closing parameter tag.
pub(crate) fn parse_nested(s: &str, value_start: usize, outer: &str, t: &Tags) -> Step<Nested> {
    let mut p = value_start;
    let mut json = String::from("{");
    let mut invalid = Vec::new();
    let mut n = 0;
    loop {
        p = skip_ws(s, p);
        match open_tag_at(s, p, t.param_open) {
            Step::NeedMore => return Step::NeedMore,
            Step::Fail(e) => return Step::Fail(e),
            Step::Ok(false) => break,
            Step::Ok(true) => {}
        }
        let h = match param_head(s, p) {
            Step::Ok(h) => h,
            Step::NeedMore => return Step::NeedMore,
            Step::Fail(e) => return Step::Fail(e),
        };
        let Some(end) = s[h.value_start..]
            .find(t.param_close)
            .map(|i| h.value_start + i)
        else {
            return Step::NeedMore;
        };
        let (v, ok) = value_json(&s[h.value_start..end], is_string_attr(&h.string_attr));
        if !ok {
            invalid.push(format!("{outer}.{}", h.name));
        }
        if n > 0 {
            json.push(',');
        }
        json.push_str(&quote(&h.name));
        json.push(':');
        json.push_str(&v);
        n += 1;
        p = end + t.param_close.len();
    }
    json.push('}');
    debug_assert!(
        n > 0,
        "parse_nested is only called when a parameter tag follows"
    );
    match close_tag_at(s, p, t.param_close) {
        Step::Ok(true) => p += t.param_close.len(),
        Step::NeedMore => return Step::NeedMore,
        _ => {}
    }
    Step::Ok(Nested {
        json,
        invalid,
        next: p,
    })
}

/// Earliest tool block start of any dialect in `s[from..]`.
pub(crate) fn find_block_start(s: &str, from: usize) -> Option<(usize, Dialect)> {
    DIALECTS
        .iter()
        .filter_map(|&d| s[from..].find(d.tags().calls_open).map(|i| (from + i, d)))
        .min_by_key(|&(i, _)| i)
}

/// Longest suffix of `s` that could still grow into a block start tag.
pub(crate) fn partial_block_start(s: &str) -> usize {
    DIALECTS
        .iter()
        .map(|d| partial_suffix(s, d.tags().calls_open))
        .max()
        .unwrap_or(0)
}

pub(crate) fn contains_block_end(s: &str) -> bool {
    DIALECTS.iter().any(|d| s.contains(d.tags().calls_close))
}

/// Start of the raw block: the tag, or two bytes earlier when `\n\n` directly precedes it.
pub(crate) fn raw_block_start(s: &str, surface_start: usize, tag: usize) -> usize {
    if tag >= surface_start + 2 && s[..tag].ends_with("\n\n") {
        tag - 2
    } else {
        tag
    }
}

/// End of the content before a block: trailing whitespace removed.
pub(crate) fn content_end(s: &str, surface_start: usize, tag: usize) -> usize {
    surface_start
        + s[surface_start..tag]
            .trim_end_matches(|c: char| c.is_ascii() && is_c_space(c as u8))
            .len()
}

/// The result for a failed block: everything is content.
pub(crate) fn failed_output(
    text: &str,
    reasoning_closed: bool,
    status: DsmlStatus,
) -> ParsedOutput {
    ParsedOutput {
        reasoning: None,
        reasoning_closed,
        content: text.to_string(),
        tool_calls: Vec::new(),
        raw_dsml: None,
        status,
        orphan_end: false,
    }
}

// ---------------------------------------------------------------------------------------
// Whole-text parser.

/// Parses generated text with tool detection on (see [`parse_output_with`]).
pub fn parse_output(text: &str, thinking: bool) -> ParsedOutput {
    parse_output_with(
        text,
        ParseOptions {
            thinking,
            detect_tools: true,
        },
    )
}

/// Splits generated text into reasoning, content and tool calls.
pub fn parse_output_with(text: &str, opts: ParseOptions) -> ParsedOutput {
    let mut reasoning = None;
    let mut reasoning_closed = false;
    let mut surface = 0;
    if opts.thinking {
        let body = if text.starts_with(THINK_OPEN) {
            THINK_OPEN.len()
        } else {
            0
        };
        match text[body..].find(THINK_CLOSE) {
            Some(i) => {
                reasoning = Some(text[body..body + i].to_string());
                reasoning_closed = true;
                surface = body + i + THINK_CLOSE.len();
            }
            None => {
                return ParsedOutput {
                    reasoning: Some(text[body..].to_string()),
                    reasoning_closed: false,
                    content: String::new(),
                    tool_calls: Vec::new(),
                    raw_dsml: None,
                    status: DsmlStatus::NoBlock,
                    orphan_end: false,
                };
            }
        }
    }
    let plain = |orphan| ParsedOutput {
        reasoning: reasoning.clone(),
        reasoning_closed,
        content: text[surface..].to_string(),
        tool_calls: Vec::new(),
        raw_dsml: None,
        status: DsmlStatus::NoBlock,
        orphan_end: orphan,
    };
    if !opts.detect_tools {
        return plain(false);
    }
    let Some((tag, dialect)) = find_block_start(text, surface) else {
        return plain(contains_block_end(&text[surface..]));
    };
    let raw_start = raw_block_start(text, surface, tag);
    let content = text[surface..content_end(text, surface, tag)].to_string();
    let fail = |status| failed_output(text, reasoning_closed, status);
    let unterminated = || fail(DsmlStatus::Unterminated { offset: raw_start });
    let t = dialect.tags();

    let mut calls = Vec::new();
    let mut p = tag + t.calls_open.len();
    loop {
        p = skip_ws(text, p);
        let (name, next) = match invoke_or_end(text, p, t) {
            Step::Ok(InvokeOrEnd::End { next }) => {
                return ParsedOutput {
                    reasoning,
                    reasoning_closed,
                    content,
                    tool_calls: calls,
                    raw_dsml: Some(text[raw_start..next].to_string()),
                    status: DsmlStatus::Parsed(dialect),
                    orphan_end: false,
                };
            }
            Step::Ok(InvokeOrEnd::Invoke { name, next }) => (name, next),
            Step::NeedMore => return unterminated(),
            Step::Fail(e) => return fail(DsmlStatus::Malformed(e)),
        };
        p = next;
        let mut args = String::from("{");
        let mut invalid = Vec::new();
        loop {
            p = skip_ws(text, p);
            let h = match param_or_end(text, p, t) {
                Step::Ok(ParamOrEnd::End { next }) => {
                    p = next;
                    break;
                }
                Step::Ok(ParamOrEnd::Param(h)) => h,
                Step::NeedMore => return unterminated(),
                Step::Fail(e) => return fail(DsmlStatus::Malformed(e)),
            };
            if args.len() > 1 {
                args.push(',');
            }
            args.push_str(&quote(&h.name));
            args.push(':');
            let nested = h.string_attr.is_none()
                && match starts_nested(text, h.value_start, t) {
                    Step::Ok(b) => b,
                    Step::NeedMore => return unterminated(),
                    Step::Fail(e) => return fail(DsmlStatus::Malformed(e)),
                };
            if nested {
                match parse_nested(text, h.value_start, &h.name, t) {
                    Step::Ok(n) => {
                        args.push_str(&n.json);
                        invalid.extend(n.invalid);
                        p = n.next;
                    }
                    Step::NeedMore => return unterminated(),
                    Step::Fail(e) => return fail(DsmlStatus::Malformed(e)),
                }
            } else {
                let Some(end) = text[h.value_start..]
                    .find(t.param_close)
                    .map(|i| h.value_start + i)
                else {
                    return unterminated();
                };
                let (v, ok) = value_json(&text[h.value_start..end], is_string_attr(&h.string_attr));
                if !ok {
                    invalid.push(h.name.clone());
                }
                args.push_str(&v);
                p = end + t.param_close.len();
            }
        }
        args.push('}');
        calls.push(ParsedCall {
            name,
            arguments_json: args,
            invalid_json: invalid,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entities_and_attrs() {
        assert_eq!(
            decode_entities("a &amp;&amp; b &lt;x&gt; &quot;&apos; &nbsp; &"),
            "a && b <x> \"' &nbsp; &"
        );
        assert_eq!(
            attr(r#"<invoke name="a&amp;b" string="true">"#, "name").as_deref(),
            Some("a&b")
        );
        assert_eq!(attr(r#"<invoke xname="a">"#, "name"), None);
        assert_eq!(attr(r#"<parameter name="x">"#, "string"), None);
    }

    #[test]
    fn partial_suffixes() {
        assert_eq!(
            partial_suffix("abc</｜DS", "</｜DSML｜parameter>"),
            "</｜DS".len()
        );
        assert_eq!(partial_suffix("abc", "</x>"), 0);
        assert_eq!(
            partial_suffix("</x>", "</x>"),
            0,
            "a complete match is not partial"
        );
    }

    #[test]
    fn value_rules() {
        assert_eq!(
            value_json(" a &lt;b\n", true),
            ("\" a <b\\n\"".into(), true)
        );
        assert_eq!(value_json(" \n", false), ("null".into(), true));
        assert_eq!(value_json(" [1, 2] ", false), ("[1,2]".into(), true));
        assert_eq!(value_json("{bad", false), ("\"{bad\"".into(), false));
    }
}
