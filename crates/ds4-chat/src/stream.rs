//! Incremental parsing of generated text (interfaces.md §1.6, §3.7): reasoning, content
//! and tool calls are emitted as they arrive; only partial tags, partial entities,
//! partial UTF-8 and whitespace that may precede a tool block are held back.
//! [`StreamParser::finish`] returns exactly what [`crate::parse_output_with`] returns for
//! the whole text.

use crate::dsml::*;
use crate::json::quote;
use crate::protocol::{THINK_CLOSE, THINK_OPEN};

/// What the stream produced since the last call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    Reasoning(String),
    /// `</think>` was generated.
    ReasoningEnd,
    Content(String),
    /// A tool block started (text is withheld from here on).
    ToolBlockStart,
    /// An `invoke` tag is complete.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// A piece of the call's arguments; the pieces concatenate to `arguments_json`.
    ToolArgs {
        index: usize,
        json_delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
    /// The closing `tool_calls` tag was generated: stop generating here.
    ToolBlockEnd,
    /// The block is malformed or unterminated: it is followed by one `Content` with the
    /// withheld text, and everything after is content.
    ToolBlockFailed(DsmlStatus),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Thinking mode, deciding whether the text starts with `<think>`.
    ThinkStart,
    Reasoning,
    Surface,
    Block,
    /// The block failed: everything else is content.
    Failed,
    /// After the closing tag (or after finish).
    Done,
}

/// State of the parameter value being read.
enum Value {
    /// No `string` attribute: plain string or nested parameters?
    Undecided(ParamHead),
    /// Nested parameters, re-parsed from the start (held until complete); `tried` is the
    /// text length at the last attempt.
    Nested(ParamHead, usize),
    /// A JSON value (held until complete); `scan` tracks JSON strings for [`SamplingState`].
    Json(ParamHead, JsonScan),
    /// A string value emitted up to byte `from`.
    Str { from: usize },
}

/// Incremental scan of a JSON value: are we inside a JSON string?
#[derive(Default)]
struct JsonScan {
    /// Bytes of the value scanned so far.
    done: usize,
    in_str: bool,
    esc: bool,
}

impl JsonScan {
    fn advance(&mut self, text: &str, value_start: usize) {
        for &c in &text.as_bytes()[value_start + self.done..] {
            if self.in_str {
                if self.esc {
                    self.esc = false;
                } else if c == b'\\' {
                    self.esc = true;
                } else if c == b'"' {
                    self.in_str = false;
                }
            } else if c == b'"' {
                self.in_str = true;
            }
        }
        self.done = text.len() - value_start;
    }
}

/// Where generation currently is, for the tools sampler (interfaces.md §1.3 "greedy DSML
/// syntax"): structure is sampled greedily, payload with the request's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplingState {
    /// Not inside a tool block.
    Outside,
    /// Tags, attributes, JSON punctuation, closing markers.
    Structure,
    /// A `string="true"` body or the inside of a JSON string.
    Payload,
}

struct Invoke {
    index: usize,
    name: String,
    args: String,
    invalid: Vec<String>,
    value: Option<Value>,
}

struct Block {
    dialect: Dialect,
    raw_start: usize,
    content_end: usize,
    /// Parse position (start of the next structural token).
    pos: usize,
    calls: Vec<ParsedCall>,
    cur: Option<Invoke>,
    raw_end: Option<usize>,
}

/// Incremental parser. Feed chunks with [`push`](Self::push) or
/// [`push_bytes`](Self::push_bytes), then call [`finish`](Self::finish).
pub struct StreamParser {
    opts: ParseOptions,
    text: String,
    /// Incomplete UTF-8 sequence at the end of the bytes pushed so far.
    pending: Vec<u8>,
    phase: Phase,
    reasoning_start: usize,
    reasoning_end: Option<usize>,
    surface: usize,
    /// Next byte of reasoning/content not yet emitted.
    emit: usize,
    block: Option<Block>,
    failed: Option<DsmlStatus>,
}

/// Merges adjacent deltas of the same kind (fewer, larger events per push; streams of two
/// chunkings compare equal after it).
pub fn coalesce(events: Vec<StreamEvent>) -> Vec<StreamEvent> {
    let mut out: Vec<StreamEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(StreamEvent::Reasoning(a)), StreamEvent::Reasoning(b)) => a.push_str(&b),
            (Some(StreamEvent::Content(a)), StreamEvent::Content(b)) => a.push_str(&b),
            (
                Some(StreamEvent::ToolArgs {
                    index: i,
                    json_delta: a,
                }),
                StreamEvent::ToolArgs {
                    index: j,
                    json_delta: b,
                },
            ) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn escape_fragment(s: &str) -> String {
    let q = quote(s);
    q[1..q.len() - 1].to_string()
}

/// First `pat` in `text[start..]`, knowing that `text[start..start + scanned]` held none
/// (only the last `pat.len() - 1` scanned bytes are searched again).
fn find_from(text: &str, start: usize, scanned: usize, pat: &str) -> Option<usize> {
    let mut from = start + scanned.saturating_sub(pat.len() - 1);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    text[from..].find(pat).map(|i| from + i)
}

/// Outcome of advancing the block parser.
enum BlockStep {
    NeedMore,
    Closed,
    Fail(DsmlError),
}

/// Advances the tool block as far as `text` allows, emitting call events.
fn step_block(text: &str, eof: bool, b: &mut Block, out: &mut Vec<StreamEvent>) -> BlockStep {
    let t = b.dialect.tags();
    loop {
        let Some(inv) = b.cur.as_mut() else {
            let p = skip_ws(text, b.pos);
            match invoke_or_end(text, p, t) {
                Step::Ok(InvokeOrEnd::End { next }) => {
                    b.raw_end = Some(next);
                    b.pos = next;
                    out.push(StreamEvent::ToolBlockEnd);
                    return BlockStep::Closed;
                }
                Step::Ok(InvokeOrEnd::Invoke { name, next }) => {
                    let index = b.calls.len();
                    out.push(StreamEvent::ToolCallStart {
                        index,
                        name: name.clone(),
                    });
                    b.cur = Some(Invoke {
                        index,
                        name,
                        args: String::new(),
                        invalid: Vec::new(),
                        value: None,
                    });
                    b.pos = next;
                    continue;
                }
                Step::NeedMore => return BlockStep::NeedMore,
                Step::Fail(e) => return BlockStep::Fail(e),
            }
        };
        let mut delta = |inv: &mut Invoke, s: &str| {
            inv.args.push_str(s);
            out.push(StreamEvent::ToolArgs {
                index: inv.index,
                json_delta: s.to_string(),
            });
        };
        match inv.value.take() {
            None => {
                let p = skip_ws(text, b.pos);
                match param_or_end(text, p, t) {
                    Step::Ok(ParamOrEnd::End { next }) => {
                        delta(inv, if inv.args.is_empty() { "{}" } else { "}" });
                        out.push(StreamEvent::ToolCallEnd { index: inv.index });
                        let inv = b.cur.take().expect("current invoke");
                        b.calls.push(ParsedCall {
                            name: inv.name,
                            arguments_json: inv.args,
                            invalid_json: inv.invalid,
                        });
                        b.pos = next;
                    }
                    Step::Ok(ParamOrEnd::Param(h)) => {
                        let sep = if inv.args.is_empty() { "{" } else { "," };
                        delta(inv, &format!("{sep}{}:", quote(&h.name)));
                        b.pos = h.value_start;
                        inv.value = Some(if h.string_attr.is_none() {
                            Value::Undecided(h)
                        } else if is_string_attr(&h.string_attr) {
                            delta(inv, "\"");
                            Value::Str {
                                from: h.value_start,
                            }
                        } else {
                            Value::Json(h, JsonScan::default())
                        });
                    }
                    Step::NeedMore => return BlockStep::NeedMore,
                    Step::Fail(e) => return BlockStep::Fail(e),
                }
            }
            Some(Value::Undecided(h)) => match starts_nested(text, h.value_start, t) {
                Step::Ok(true) => inv.value = Some(Value::Nested(h, 0)),
                Step::Ok(false) => {
                    delta(inv, "\"");
                    inv.value = Some(Value::Str {
                        from: h.value_start,
                    });
                }
                Step::NeedMore => {
                    inv.value = Some(Value::Undecided(h));
                    return BlockStep::NeedMore;
                }
                Step::Fail(e) => return BlockStep::Fail(e),
            },
            // Progress inside nested parameters needs a new `>` (or the end of input):
            // skip the re-parse otherwise, so long nested values stay linear.
            Some(Value::Nested(h, tried))
                if !eof && tried > 0 && !text.as_bytes()[tried..].contains(&b'>') =>
            {
                inv.value = Some(Value::Nested(h, text.len()));
                return BlockStep::NeedMore;
            }
            Some(Value::Nested(h, _)) => match parse_nested(text, h.value_start, &h.name, t) {
                Step::Ok(n) => {
                    delta(inv, &n.json);
                    inv.invalid.extend(n.invalid);
                    b.pos = n.next;
                }
                Step::NeedMore => {
                    inv.value = Some(Value::Nested(h, text.len()));
                    return BlockStep::NeedMore;
                }
                Step::Fail(e) => return BlockStep::Fail(e),
            },
            Some(Value::Json(h, mut scan)) => {
                match find_from(text, h.value_start, scan.done, t.param_close) {
                    Some(end) => {
                        let (v, ok) = value_json(&text[h.value_start..end], false);
                        if !ok {
                            inv.invalid.push(h.name.clone());
                        }
                        delta(inv, &v);
                        b.pos = end + t.param_close.len();
                    }
                    None => {
                        scan.advance(text, h.value_start);
                        inv.value = Some(Value::Json(h, scan));
                        return BlockStep::NeedMore;
                    }
                }
            }
            Some(Value::Str { from }) => match text[from..].find(t.param_close) {
                Some(i) => {
                    let end = from + i;
                    delta(
                        inv,
                        &format!("{}\"", escape_fragment(&decode_entities(&text[from..end]))),
                    );
                    b.pos = end + t.param_close.len();
                }
                None => {
                    // Hold back a partial closing tag and a partial entity.
                    let mut safe = text.len() - partial_suffix(&text[from..], t.param_close);
                    if let Some(a) = text[from..safe].rfind('&').map(|a| from + a) {
                        let part = &text[a..safe];
                        if ENTITIES
                            .iter()
                            .any(|(e, _)| e.len() > part.len() && e.starts_with(part))
                        {
                            safe = a;
                        }
                    }
                    if safe > from {
                        delta(inv, &escape_fragment(&decode_entities(&text[from..safe])));
                    }
                    inv.value = Some(Value::Str { from: safe });
                    return BlockStep::NeedMore;
                }
            },
        }
    }
}

impl StreamParser {
    pub fn new(opts: ParseOptions) -> Self {
        StreamParser {
            opts,
            text: String::new(),
            pending: Vec::new(),
            phase: Phase::ThinkStart,
            reasoning_start: 0,
            reasoning_end: None,
            surface: 0,
            emit: 0,
            block: None,
            failed: None,
        }
    }

    /// Feeds a text chunk.
    pub fn push(&mut self, chunk: &str) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if self.phase == Phase::Done {
            return out; // text after the closing tag is ignored (generation stops there)
        }
        self.text.push_str(chunk);
        self.advance(false, &mut out);
        coalesce(out)
    }

    /// Feeds raw bytes (e.g. token pieces that split UTF-8 sequences). Incomplete
    /// sequences are held; invalid bytes become U+FFFD as in `String::from_utf8_lossy`.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Vec<StreamEvent> {
        self.pending.extend_from_slice(bytes);
        let mut s = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(v) => {
                    s.push_str(v);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    s.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        Some(n) => {
                            s.push('\u{fffd}');
                            self.pending.drain(..valid + n);
                        }
                    }
                }
            }
        }
        self.push(&s)
    }

    /// True once the closing `tool_calls` tag was generated (the engine stops there).
    pub fn block_closed(&self) -> bool {
        self.block.as_ref().is_some_and(|b| b.raw_end.is_some())
    }

    /// True while inside a tool block.
    pub fn in_tool_block(&self) -> bool {
        self.phase == Phase::Block
    }

    /// Whether the next token continues tool-call structure or payload.
    pub fn sampling_state(&self) -> SamplingState {
        let Some(b) = self.block.as_ref().filter(|_| self.phase == Phase::Block) else {
            return SamplingState::Outside;
        };
        match b.cur.as_ref().and_then(|i| i.value.as_ref()) {
            Some(Value::Str { from }) => {
                // Once a closing tag has visibly started (`</`…), finish it greedily.
                if partial_suffix(&self.text[*from..], b.dialect.tags().param_close) >= 2 {
                    SamplingState::Structure
                } else {
                    SamplingState::Payload
                }
            }
            Some(Value::Json(_, scan)) if scan.in_str => SamplingState::Payload,
            _ => SamplingState::Structure,
        }
    }

    fn emit_text(&mut self, end: usize, reasoning: bool, out: &mut Vec<StreamEvent>) {
        if end > self.emit {
            let s = self.text[self.emit..end].to_string();
            out.push(if reasoning {
                StreamEvent::Reasoning(s)
            } else {
                StreamEvent::Content(s)
            });
            self.emit = end;
        }
    }

    fn fail(&mut self, status: DsmlStatus, out: &mut Vec<StreamEvent>) {
        let content_end = self.block.as_ref().map_or(self.emit, |b| b.content_end);
        out.push(StreamEvent::ToolBlockFailed(status.clone()));
        self.failed = Some(status);
        self.emit = content_end;
        self.phase = Phase::Failed;
        self.emit_text(self.text.len(), false, out);
    }

    fn advance(&mut self, eof: bool, out: &mut Vec<StreamEvent>) {
        loop {
            match self.phase {
                Phase::ThinkStart => {
                    if !self.opts.thinking {
                        self.phase = Phase::Surface;
                        continue;
                    }
                    if !eof
                        && self.text.len() < THINK_OPEN.len()
                        && THINK_OPEN.starts_with(self.text.as_str())
                    {
                        return;
                    }
                    self.reasoning_start = if self.text.starts_with(THINK_OPEN) {
                        THINK_OPEN.len()
                    } else {
                        0
                    };
                    self.emit = self.reasoning_start;
                    self.phase = Phase::Reasoning;
                }
                Phase::Reasoning => match self.text[self.emit..].find(THINK_CLOSE) {
                    Some(i) => {
                        let end = self.emit + i;
                        self.emit_text(end, true, out);
                        out.push(StreamEvent::ReasoningEnd);
                        self.reasoning_end = Some(end);
                        self.surface = end + THINK_CLOSE.len();
                        self.emit = self.surface;
                        self.phase = Phase::Surface;
                    }
                    None => {
                        let hold = if eof {
                            0
                        } else {
                            partial_suffix(&self.text[self.emit..], THINK_CLOSE)
                        };
                        self.emit_text(self.text.len() - hold, true, out);
                        return;
                    }
                },
                Phase::Surface => {
                    if !self.opts.detect_tools {
                        self.emit_text(self.text.len(), false, out);
                        return;
                    }
                    match find_block_start(&self.text, self.emit) {
                        Some((tag, dialect)) => {
                            let ce = content_end(&self.text, self.surface, tag);
                            self.emit_text(ce, false, out);
                            out.push(StreamEvent::ToolBlockStart);
                            self.block = Some(Block {
                                dialect,
                                raw_start: raw_block_start(&self.text, self.surface, tag),
                                content_end: ce,
                                pos: tag + dialect.tags().calls_open.len(),
                                calls: Vec::new(),
                                cur: None,
                                raw_end: None,
                            });
                            self.phase = Phase::Block;
                        }
                        None if eof => {
                            self.emit_text(self.text.len(), false, out);
                            return;
                        }
                        None => {
                            // Hold a partial start tag and the whitespace before it.
                            let avail =
                                self.text.len() - partial_block_start(&self.text[self.emit..]);
                            let end = content_end(&self.text, self.emit, avail);
                            self.emit_text(end, false, out);
                            return;
                        }
                    }
                }
                Phase::Block => {
                    let b = self.block.as_mut().expect("block state");
                    match step_block(&self.text, eof, b, out) {
                        BlockStep::Closed => {
                            self.phase = Phase::Done;
                            return;
                        }
                        BlockStep::NeedMore if eof => {
                            let offset = b.raw_start;
                            self.fail(DsmlStatus::Unterminated { offset }, out);
                            return;
                        }
                        BlockStep::NeedMore => return,
                        BlockStep::Fail(e) => {
                            self.fail(DsmlStatus::Malformed(e), out);
                            return;
                        }
                    }
                }
                Phase::Failed => {
                    self.emit_text(self.text.len(), false, out);
                    return;
                }
                Phase::Done => return,
            }
        }
    }

    /// Ends the stream: flushes held text and returns the final result, equal to
    /// [`crate::parse_output_with`] on the whole text.
    pub fn finish(mut self) -> (Vec<StreamEvent>, ParsedOutput) {
        let mut out = Vec::new();
        if !self.pending.is_empty() && self.phase != Phase::Done {
            self.pending.clear();
            self.text.push('\u{fffd}');
        }
        self.advance(true, &mut out);
        let out = coalesce(out);
        let text = &self.text;
        let reasoning_closed = self.reasoning_end.is_some();
        if let Some(status) = self.failed.take() {
            return (out, failed_output(text, reasoning_closed, status));
        }
        let reasoning = self.opts.thinking.then(|| {
            let end = self.reasoning_end.unwrap_or(text.len());
            text[self.reasoning_start..end].to_string()
        });
        if self.opts.thinking && !reasoning_closed {
            let r = ParsedOutput {
                reasoning,
                reasoning_closed,
                content: String::new(),
                tool_calls: Vec::new(),
                raw_dsml: None,
                status: DsmlStatus::NoBlock,
                orphan_end: false,
            };
            return (out, r);
        }
        let r = match self.block.take() {
            Some(b) => ParsedOutput {
                reasoning,
                reasoning_closed,
                content: text[self.surface..b.content_end].to_string(),
                tool_calls: b.calls,
                raw_dsml: Some(text[b.raw_start..b.raw_end.expect("closed block")].to_string()),
                status: DsmlStatus::Parsed(b.dialect),
                orphan_end: false,
            },
            None => ParsedOutput {
                reasoning,
                reasoning_closed,
                content: text[self.surface..].to_string(),
                tool_calls: Vec::new(),
                raw_dsml: None,
                status: DsmlStatus::NoBlock,
                orphan_end: self.opts.detect_tools && contains_block_end(&text[self.surface..]),
            },
        };
        (out, r)
    }
}
