//! Response bodies and SSE event sequences per protocol (interfaces.md §1.5–1.8).

use crate::worker::{Finish, GenResult, TokenLogprob};
use bytes::Bytes;
use ds4_chat::StreamEvent;
use rand::RngCore;
use serde_json::{json, Value};

/// `prefix` + `n` random bytes as lowercase hex (unguessable ids, §1.11).
pub fn rand_id(prefix: &str, n: usize) -> String {
    let mut b = vec![0u8; n];
    rand::rngs::OsRng.fill_bytes(&mut b);
    let mut s = String::from(prefix);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Per-response constants.
#[derive(Clone, Debug)]
pub struct Ctx {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub include_usage: bool,
    /// Responses: return reasoning as a summary item.
    pub summary: bool,
    /// Tool-call id prefix (`call_` or `toolu_`).
    pub call_prefix: &'static str,
    /// Responses namespaced tools: (prompt name, namespace, wire name).
    pub namespaces: Vec<(String, String, String)>,
}

/// Tool-call ids, created on first use so streamed and final calls share them.
#[derive(Default, Debug)]
pub struct Ids(pub Vec<String>);
impl Ids {
    pub fn get(&mut self, i: usize, prefix: &str) -> String {
        while self.0.len() <= i {
            self.0.push(rand_id(prefix, 16));
        }
        self.0[i].clone()
    }
}

fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
fn sse_event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

fn openai_finish(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
        Finish::Error => "error",
    }
}

fn anthropic_stop(f: Finish) -> &'static str {
    match f {
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
        Finish::Stop | Finish::Error => "end_turn",
    }
}

pub fn openai_usage(r: &GenResult) -> Value {
    json!({
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": r.cached_tokens,
            "cache_write_tokens": r.prompt_tokens - r.cached_tokens,
        }
    })
}

fn anthropic_usage(prompt: usize, cached: usize, out: usize) -> Value {
    json!({
        "input_tokens": 0,
        "output_tokens": out,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": prompt - cached,
    })
}

fn responses_usage(r: &GenResult) -> Value {
    json!({
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": r.cached_tokens,
            "cache_write_tokens": r.prompt_tokens - r.cached_tokens,
        },
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    })
}

fn reasoning(r: &GenResult) -> &str {
    r.parsed.reasoning.as_deref().unwrap_or("")
}

/// Arguments as a JSON value for Anthropic `input` (always an object there).
fn args_value(a: &str) -> Value {
    serde_json::from_str(a).unwrap_or_else(|_| json!({}))
}

// ------------------------------------------------------------------------------------------
// Log-probabilities.

fn lp_token(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// OpenAI chat `logprobs.content` entries.
fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(b, lp)| json!({"token": lp_token(b), "logprob": lp, "bytes": b}))
                .collect();
            json!({"token": lp_token(&t.bytes), "logprob": t.logprob, "bytes": t.bytes,
                   "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions `logprobs` object.
fn completion_logprobs(lps: &[TokenLogprob], offset: usize) -> Value {
    let mut off = offset;
    let mut offsets = Vec::new();
    for t in lps {
        offsets.push(off);
        off += t.bytes.len();
    }
    json!({
        "tokens": lps.iter().map(|t| lp_token(&t.bytes)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| {
            let m: serde_json::Map<String, Value> =
                t.top.iter().map(|(b, lp)| (lp_token(b), json!(lp))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

// ------------------------------------------------------------------------------------------
// Non-streaming bodies.

pub fn chat_body(c: &Ctx, r: &GenResult, ids: &mut Ids, lp: Option<&[TokenLogprob]>) -> Value {
    let mut msg = json!({"role": "assistant", "content": r.parsed.content});
    if !reasoning(r).is_empty() {
        msg["reasoning_content"] = json!(reasoning(r));
    }
    if !r.parsed.tool_calls.is_empty() {
        let calls: Vec<Value> = r
            .parsed
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, tc)| {
                json!({"id": ids.get(i, c.call_prefix), "type": "function",
                       "function": {"name": tc.name, "arguments": tc.arguments_json}})
            })
            .collect();
        msg["tool_calls"] = json!(calls);
    }
    let mut choice = json!({"index": 0, "message": msg, "finish_reason": openai_finish(r.finish)});
    if let Some(lp) = lp {
        choice["logprobs"] = chat_logprobs(lp);
    }
    json!({
        "id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
        "choices": [choice], "usage": openai_usage(r),
    })
}

pub fn completion_body(c: &Ctx, r: &GenResult, lp: Option<&[TokenLogprob]>) -> Value {
    let mut choice = json!({"text": r.text, "index": 0, "finish_reason": openai_finish(r.finish)});
    if let Some(lp) = lp {
        choice["logprobs"] = completion_logprobs(lp, 0);
    }
    json!({
        "id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
        "choices": [choice], "usage": openai_usage(r),
    })
}

pub fn messages_body(c: &Ctx, r: &GenResult, ids: &mut Ids) -> Value {
    let mut content = Vec::new();
    if !reasoning(r).is_empty() {
        content.push(json!({"type": "thinking", "thinking": reasoning(r), "signature": c.id}));
    }
    if !r.parsed.content.is_empty() {
        content.push(json!({"type": "text", "text": r.parsed.content}));
    }
    for (i, tc) in r.parsed.tool_calls.iter().enumerate() {
        content.push(json!({"type": "tool_use", "id": ids.get(i, c.call_prefix),
                            "name": tc.name, "input": args_value(&tc.arguments_json)}));
    }
    if content.iter().all(|b| b["type"] == "thinking") {
        content.push(json!({"type": "text", "text": ""}));
    }
    json!({
        "id": c.id, "type": "message", "role": "assistant", "model": c.model,
        "content": content, "stop_reason": anthropic_stop(r.finish), "stop_sequence": null,
        "usage": anthropic_usage(r.prompt_tokens, r.cached_tokens, r.completion_tokens),
    })
}

/// Responses item ids, fixed once per response.
#[derive(Debug)]
pub struct RespIds {
    rs: String,
    msg: String,
    fc: Vec<String>,
}
impl Default for RespIds {
    fn default() -> Self {
        RespIds {
            rs: rand_id("rs_", 12),
            msg: rand_id("msg_", 12),
            fc: vec![],
        }
    }
}

fn resp_status(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::ToolCalls => "completed",
        Finish::Length => "incomplete",
        Finish::Error => "failed",
    }
}

fn reasoning_item(ri: &RespIds, text: &str, closed: bool) -> Value {
    json!({"id": ri.rs, "type": "reasoning", "status": if closed {"completed"} else {"incomplete"},
           "summary": [{"type": "summary_text", "text": text}]})
}
fn message_item(ri: &RespIds, text: &str) -> Value {
    json!({"id": ri.msg, "type": "message", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn call_items(c: &Ctx, r: &GenResult, ids: &mut Ids, ri: &mut RespIds) -> Vec<Value> {
    r.parsed
        .tool_calls
        .iter()
        .enumerate()
        .map(|(i, tc)| {
            while ri.fc.len() <= i {
                ri.fc.push(rand_id("fc_", 12));
            }
            let ns = c.namespaces.iter().find(|(p, _, _)| *p == tc.name);
            let mut item = json!({"id": ri.fc[i], "type": "function_call", "status": "completed",
                   "name": ns.map_or(tc.name.as_str(), |n| n.2.as_str()),
                   "call_id": ids.get(i, c.call_prefix), "arguments": tc.arguments_json});
            if let Some((_, n, _)) = ns {
                item["namespace"] = json!(n);
            }
            item
        })
        .collect()
}

pub fn responses_body(c: &Ctx, r: &GenResult, ids: &mut Ids, ri: &mut RespIds) -> Value {
    let mut output = Vec::new();
    if c.summary && !reasoning(r).is_empty() {
        output.push(reasoning_item(ri, reasoning(r), r.parsed.reasoning_closed));
    }
    if !r.parsed.content.is_empty() {
        output.push(message_item(ri, &r.parsed.content));
    }
    output.extend(call_items(c, r, ids, ri));
    let mut o = json!({
        "id": c.id, "object": "response", "created_at": c.created,
        "status": resp_status(r.finish), "model": c.model, "output": output,
        "usage": responses_usage(r),
    });
    match r.finish {
        Finish::Length => o["incomplete_details"] = json!({"reason": "max_tokens"}),
        Finish::Error => {
            o["error"] = json!({"code": "server_error",
                                "message": r.error.as_deref().unwrap_or("generation failed")})
        }
        _ => {}
    }
    o
}

// ------------------------------------------------------------------------------------------
// Streaming.

/// Turns worker events into SSE frames for one protocol.
pub trait Writer: Send {
    fn started(&mut self, prompt_tokens: usize, cached: usize) -> Vec<Bytes>;
    fn events(&mut self, ev: &[StreamEvent]) -> Vec<Bytes>;
    /// A generated token's log-probabilities (sent only when requested).
    fn logprob(&mut self, _lp: &TokenLogprob) -> Vec<Bytes> {
        vec![]
    }
    fn done(&mut self, r: &GenResult) -> Vec<Bytes>;
    /// Prefill failed after the SSE headers went out.
    fn failed(&mut self, msg: &str) -> Vec<Bytes>;
    /// Tool-call ids handed out (for the exact-replay map).
    fn ids(&self) -> &[String];
}

fn openai_stream_error(msg: &str) -> Vec<Bytes> {
    vec![sse_event(
        "error",
        &json!({"error": {"message": msg, "type": "server_error"}}),
    )]
}

pub struct ChatWriter {
    pub c: Ctx,
    pub ids: Ids,
    streamed: usize,
}
impl ChatWriter {
    pub fn new(c: Ctx) -> Self {
        ChatWriter {
            c,
            ids: Ids::default(),
            streamed: 0,
        }
    }
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Bytes {
        sse_data(&json!({"id": self.c.id, "object": "chat.completion.chunk",
            "created": self.c.created, "model": self.c.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
    }
}
impl Writer for ChatWriter {
    fn started(&mut self, _: usize, _: usize) -> Vec<Bytes> {
        vec![self.chunk(json!({"role": "assistant"}), None)]
    }
    fn logprob(&mut self, lp: &TokenLogprob) -> Vec<Bytes> {
        // Text deltas are decoupled from tokens (tags, UTF-8 and stop sequences are held
        // back), so log-probabilities travel in their own chunks with an empty delta.
        vec![sse_data(
            &json!({"id": self.c.id, "object": "chat.completion.chunk",
            "created": self.c.created, "model": self.c.model,
            "choices": [{"index": 0, "delta": {}, "logprobs": chat_logprobs(std::slice::from_ref(lp)),
                         "finish_reason": null}]}),
        )]
    }
    fn events(&mut self, ev: &[StreamEvent]) -> Vec<Bytes> {
        let mut out = Vec::new();
        for e in ev {
            match e {
                StreamEvent::Reasoning(s) if !s.is_empty() => {
                    out.push(self.chunk(json!({"reasoning_content": s}), None))
                }
                StreamEvent::Content(s) if !s.is_empty() => {
                    out.push(self.chunk(json!({"content": s}), None))
                }
                StreamEvent::ToolCallStart { index, name } => {
                    let id = self.ids.get(*index, self.c.call_prefix);
                    self.streamed = self.streamed.max(index + 1);
                    out.push(self.chunk(
                        json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                               "function": {"name": name, "arguments": ""}}]}),
                        None,
                    ))
                }
                StreamEvent::ToolArgs { index, json_delta } => out.push(self.chunk(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": json_delta}}]}),
                    None,
                )),
                _ => {}
            }
        }
        out
    }
    fn done(&mut self, r: &GenResult) -> Vec<Bytes> {
        let mut out = Vec::new();
        // Calls the live projection did not stream: one chunk with full arguments.
        let rest: Vec<Value> = r
            .parsed
            .tool_calls
            .iter()
            .enumerate()
            .skip(self.streamed)
            .map(|(i, tc)| {
                json!({"index": i, "id": self.ids.get(i, self.c.call_prefix), "type": "function",
                       "function": {"name": tc.name, "arguments": tc.arguments_json}})
            })
            .collect();
        if !rest.is_empty() {
            out.push(self.chunk(json!({ "tool_calls": rest }), None));
        }
        out.push(self.chunk(json!({}), Some(openai_finish(r.finish))));
        if self.c.include_usage {
            out.push(sse_data(
                &json!({"id": self.c.id, "object": "chat.completion.chunk",
                "created": self.c.created, "model": self.c.model, "choices": [],
                "usage": openai_usage(r)}),
            ));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
    fn failed(&mut self, msg: &str) -> Vec<Bytes> {
        openai_stream_error(msg)
    }
    fn ids(&self) -> &[String] {
        &self.ids.0
    }
}

pub struct CompletionWriter {
    pub c: Ctx,
    /// Byte offset of the next token (logprobs `text_offset`).
    pub lp_offset: usize,
}
impl CompletionWriter {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Bytes {
        sse_data(&json!({"id": self.c.id, "object": "text_completion",
            "created": self.c.created, "model": self.c.model,
            "choices": [{"text": text, "index": 0, "finish_reason": finish}]}))
    }
}
impl Writer for CompletionWriter {
    fn started(&mut self, _: usize, _: usize) -> Vec<Bytes> {
        vec![]
    }
    fn logprob(&mut self, lp: &TokenLogprob) -> Vec<Bytes> {
        let off = self.lp_offset;
        self.lp_offset += lp.bytes.len();
        vec![sse_data(
            &json!({"id": self.c.id, "object": "text_completion",
            "created": self.c.created, "model": self.c.model,
            "choices": [{"text": "", "index": 0,
                         "logprobs": completion_logprobs(std::slice::from_ref(lp), off),
                         "finish_reason": null}]}),
        )]
    }
    fn events(&mut self, ev: &[StreamEvent]) -> Vec<Bytes> {
        ev.iter()
            .filter_map(|e| match e {
                StreamEvent::Content(s) | StreamEvent::Reasoning(s) if !s.is_empty() => {
                    Some(self.chunk(s, None))
                }
                _ => None,
            })
            .collect()
    }
    fn done(&mut self, r: &GenResult) -> Vec<Bytes> {
        let mut out = vec![self.chunk("", Some(openai_finish(r.finish)))];
        if self.c.include_usage {
            out.push(sse_data(
                &json!({"id": self.c.id, "object": "text_completion",
                "created": self.c.created, "model": self.c.model, "choices": [],
                "usage": openai_usage(r)}),
            ));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
    fn failed(&mut self, msg: &str) -> Vec<Bytes> {
        openai_stream_error(msg)
    }
    fn ids(&self) -> &[String] {
        &[]
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Block {
    None,
    Thinking,
    Text,
    Tool,
}

pub struct MessagesWriter {
    pub c: Ctx,
    pub ids: Ids,
    block: Block,
    index: usize,
    had_thinking: bool,
    had_text: bool,
    streamed: usize,
}
impl MessagesWriter {
    pub fn new(c: Ctx) -> Self {
        MessagesWriter {
            c,
            ids: Ids::default(),
            block: Block::None,
            index: 0,
            had_thinking: false,
            had_text: false,
            streamed: 0,
        }
    }
    fn close(&mut self, out: &mut Vec<Bytes>) {
        if self.block == Block::None {
            return;
        }
        if self.block == Block::Thinking {
            out.push(sse_event(
                "content_block_delta",
                &json!({"type": "content_block_delta",
                "index": self.index, "delta": {"type": "signature_delta", "signature": self.c.id}}),
            ));
        }
        out.push(sse_event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": self.index}),
        ));
        self.index += 1;
        self.block = Block::None;
    }
    fn open(&mut self, b: Block, cb: Value, out: &mut Vec<Bytes>) {
        self.close(out);
        out.push(sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.index, "content_block": cb}),
        ));
        self.block = b;
    }
    fn delta(&self, d: Value) -> Bytes {
        sse_event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.index, "delta": d}),
        )
    }
}
impl Writer for MessagesWriter {
    fn started(&mut self, prompt: usize, cached: usize) -> Vec<Bytes> {
        vec![sse_event(
            "message_start",
            &json!({"type": "message_start", "message": {"id": self.c.id, "type": "message",
                "role": "assistant", "model": self.c.model, "content": [], "stop_reason": null,
                "stop_sequence": null, "usage": anthropic_usage(prompt, cached, 0)}}),
        )]
    }
    fn events(&mut self, ev: &[StreamEvent]) -> Vec<Bytes> {
        let mut out = Vec::new();
        for e in ev {
            match e {
                StreamEvent::Reasoning(s) if !s.is_empty() => {
                    if self.block != Block::Thinking {
                        self.open(
                            Block::Thinking,
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                            &mut out,
                        );
                        self.had_thinking = true;
                    }
                    out.push(self.delta(json!({"type": "thinking_delta", "thinking": s})));
                }
                StreamEvent::Content(s) if !s.is_empty() => {
                    if self.block != Block::Text {
                        self.open(Block::Text, json!({"type": "text", "text": ""}), &mut out);
                        self.had_text = true;
                    }
                    out.push(self.delta(json!({"type": "text_delta", "text": s})));
                }
                StreamEvent::ToolCallStart { index, name } => {
                    let id = self.ids.get(*index, self.c.call_prefix);
                    self.streamed = self.streamed.max(index + 1);
                    self.open(
                        Block::Tool,
                        json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                        &mut out,
                    );
                }
                StreamEvent::ToolArgs { json_delta, .. } => out.push(
                    self.delta(json!({"type": "input_json_delta", "partial_json": json_delta})),
                ),
                StreamEvent::ToolCallEnd { .. } => self.close(&mut out),
                _ => {}
            }
        }
        out
    }
    fn done(&mut self, r: &GenResult) -> Vec<Bytes> {
        let mut out = Vec::new();
        for (i, tc) in r.parsed.tool_calls.iter().enumerate().skip(self.streamed) {
            let id = self.ids.get(i, self.c.call_prefix);
            self.open(
                Block::Tool,
                json!({"type": "tool_use", "id": id, "name": tc.name, "input": {}}),
                &mut out,
            );
            out.push(
                self.delta(json!({"type": "input_json_delta", "partial_json": tc.arguments_json})),
            );
            self.close(&mut out);
            self.streamed = i + 1;
        }
        self.close(&mut out);
        if self.had_thinking && !self.had_text && self.streamed == 0 || self.index == 0 {
            self.open(Block::Text, json!({"type": "text", "text": ""}), &mut out);
            self.close(&mut out);
        }
        out.push(sse_event(
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": anthropic_stop(r.finish), "stop_sequence": null},
                "usage": {"output_tokens": r.completion_tokens}}),
        ));
        out.push(sse_event("message_stop", &json!({"type": "message_stop"})));
        out
    }
    fn failed(&mut self, msg: &str) -> Vec<Bytes> {
        vec![sse_event(
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": msg}}),
        )]
    }
    fn ids(&self) -> &[String] {
        &self.ids.0
    }
}

pub struct ResponsesWriter {
    pub c: Ctx,
    pub ids: Ids,
    ri: RespIds,
    seq: u64,
    next_index: usize,
    rs_index: Option<usize>,
    msg_index: Option<usize>,
    reasoning: String,
    text: String,
}
impl ResponsesWriter {
    pub fn new(c: Ctx) -> Self {
        ResponsesWriter {
            c,
            ids: Ids::default(),
            ri: RespIds::default(),
            seq: 0,
            next_index: 0,
            rs_index: None,
            msg_index: None,
            reasoning: String::new(),
            text: String::new(),
        }
    }
    /// One event; `sequence_number` is the second key (§1.6).
    fn ev(&mut self, ty: &str, rest: Value) -> Bytes {
        let mut o = serde_json::Map::new();
        o.insert("type".into(), json!(ty));
        o.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        if let Value::Object(m) = rest {
            o.extend(m);
        }
        sse_data(&Value::Object(o))
    }
    fn shell(&self, status: &str) -> Value {
        json!({"id": self.c.id, "object": "response", "created_at": self.c.created,
               "status": status, "model": self.c.model, "output": []})
    }
}
impl Writer for ResponsesWriter {
    fn started(&mut self, _: usize, _: usize) -> Vec<Bytes> {
        let r = self.shell("in_progress");
        vec![self.ev("response.created", json!({ "response": r }))]
    }
    fn events(&mut self, ev: &[StreamEvent]) -> Vec<Bytes> {
        let mut out = Vec::new();
        for e in ev {
            match e {
                StreamEvent::Reasoning(s) if !s.is_empty() && self.c.summary => {
                    let idx = match self.rs_index {
                        Some(i) => i,
                        None => {
                            let i = self.next_index;
                            self.next_index += 1;
                            self.rs_index = Some(i);
                            let item = json!({"id": self.ri.rs, "type": "reasoning",
                                              "status": "in_progress", "summary": []});
                            out.push(self.ev(
                                "response.output_item.added",
                                json!({"output_index": i, "item": item}),
                            ));
                            let rs = self.ri.rs.clone();
                            out.push(self.ev(
                                "response.reasoning_summary_part.added",
                                json!({"item_id": rs, "output_index": i, "summary_index": 0,
                                       "part": {"type": "summary_text", "text": ""}}),
                            ));
                            i
                        }
                    };
                    self.reasoning.push_str(s);
                    let rs = self.ri.rs.clone();
                    out.push(self.ev(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": rs, "output_index": idx, "summary_index": 0, "delta": s}),
                    ));
                }
                StreamEvent::Content(s) if !s.is_empty() => {
                    let idx = match self.msg_index {
                        Some(i) => i,
                        None => {
                            let i = self.next_index;
                            self.next_index += 1;
                            self.msg_index = Some(i);
                            let item = json!({"id": self.ri.msg, "type": "message",
                                "status": "in_progress", "role": "assistant", "content": []});
                            out.push(self.ev(
                                "response.output_item.added",
                                json!({"output_index": i, "item": item}),
                            ));
                            let m = self.ri.msg.clone();
                            out.push(self.ev("response.content_part.added",
                                json!({"item_id": m, "output_index": i, "content_index": 0,
                                       "part": {"type": "output_text", "text": "", "annotations": []}})));
                            i
                        }
                    };
                    self.text.push_str(s);
                    let m = self.ri.msg.clone();
                    out.push(self.ev(
                        "response.output_text.delta",
                        json!({"item_id": m, "output_index": idx, "content_index": 0, "delta": s}),
                    ));
                }
                _ => {}
            }
        }
        out
    }
    fn done(&mut self, r: &GenResult) -> Vec<Bytes> {
        let mut out = Vec::new();
        if let Some(i) = self.rs_index {
            let rs = self.ri.rs.clone();
            let t = self.reasoning.clone();
            out.push(self.ev(
                "response.reasoning_summary_text.done",
                json!({"item_id": rs, "output_index": i, "summary_index": 0, "text": t}),
            ));
            out.push(self.ev(
                "response.reasoning_summary_part.done",
                json!({"item_id": rs, "output_index": i, "summary_index": 0,
                       "part": {"type": "summary_text", "text": t}}),
            ));
            let item = reasoning_item(&self.ri, &t, r.parsed.reasoning_closed);
            out.push(self.ev(
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
        }
        // The final text is authoritative (a failed tool block's withheld tail included).
        if !r.parsed.content.is_empty() && r.parsed.content.starts_with(&self.text) {
            let tail = r.parsed.content[self.text.len()..].to_string();
            if !tail.is_empty() {
                out.extend(self.events(&[StreamEvent::Content(tail)]));
            }
        }
        if let Some(i) = self.msg_index {
            let m = self.ri.msg.clone();
            let t = self.text.clone();
            out.push(self.ev(
                "response.output_text.done",
                json!({"item_id": m, "output_index": i, "content_index": 0, "text": t}),
            ));
            out.push(self.ev(
                "response.content_part.done",
                json!({"item_id": m, "output_index": i, "content_index": 0,
                       "part": {"type": "output_text", "text": t, "annotations": []}}),
            ));
            let item = message_item(&self.ri, &t);
            out.push(self.ev(
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
        }
        let c = self.c.clone();
        for item in call_items(&c, r, &mut self.ids, &mut self.ri) {
            let i = self.next_index;
            self.next_index += 1;
            let mut added = item.clone();
            added["status"] = json!("in_progress");
            added["arguments"] = json!("");
            out.push(self.ev(
                "response.output_item.added",
                json!({"output_index": i, "item": added}),
            ));
            out.push(self.ev(
                "response.function_call_arguments.delta",
                json!({"item_id": item["id"], "output_index": i, "delta": item["arguments"]}),
            ));
            out.push(self.ev(
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": i, "name": item["name"],
                       "arguments": item["arguments"]}),
            ));
            out.push(self.ev(
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
        }
        let mut ids = Ids(self.ids.0.clone());
        let body = responses_body(&c, r, &mut ids, &mut self.ri);
        let ty = match r.finish {
            Finish::Length => "response.incomplete",
            Finish::Error => "response.failed",
            _ => "response.completed",
        };
        out.push(self.ev(ty, json!({ "response": body })));
        out
    }
    fn failed(&mut self, msg: &str) -> Vec<Bytes> {
        openai_stream_error(msg)
    }
    fn ids(&self) -> &[String] {
        &self.ids.0
    }
}
