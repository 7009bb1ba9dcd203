//! Prompt rendering: the server chat template (interfaces.md §4.2), canonical DSML for
//! history tool calls (§3.3), exact replay (§3.5), the live tool tail (§3.6) and the
//! CLI renderers (§4.3).

use crate::json::{self, ArgValue};
use crate::protocol::*;
use crate::think::ThinkMode;
use std::collections::HashMap;
use std::sync::Arc;

/// Message role after API mapping (`function` → Tool; unknown roles are dropped upstream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// Maps an API role name: `function` is a tool result; unknown roles give `None`
    /// (the message is ignored).
    pub fn from_api(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "developer" => Some(Role::Developer),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" | "function" => Some(Role::Tool),
            _ => None,
        }
    }

    fn is_system(self) -> bool {
        matches!(self, Role::System | Role::Developer)
    }
    fn is_user_like(self) -> bool {
        matches!(self, Role::User | Role::Tool)
    }
}

/// A tool call in history, as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// Raw JSON text of the arguments exactly as the client sent it.
    pub arguments: String,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    /// Text content. For Anthropic user messages this already holds the
    /// `<tool_result>` pieces (see [`push_tool_result`]).
    pub content: String,
    /// Hidden reasoning of an assistant turn.
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// For tool results (not rendered; used by replay/continuation bookkeeping).
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
    pub fn tool(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            tool_call_id: Some(call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }
    pub fn with_reasoning(mut self, r: impl Into<String>) -> Self {
        self.reasoning = Some(r.into());
        self
    }
    pub fn with_call(mut self, id: &str, name: &str, arguments: &str) -> Self {
        self.tool_calls.push(ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        });
        self
    }
}

/// Everything the server renderer needs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// One raw JSON text per tool schema, exactly as the client sent it (after
    /// unwrapping OpenAI's `{"type":"function","function":X}` to `X`).
    pub tools: Vec<String>,
    /// `tool_choice:"none"` (or Anthropic `{"type":"none"}`): no tools section.
    pub tool_choice_none: bool,
    pub think: ThinkMode,
}

impl ChatRequest {
    /// The tools that are rendered (and whose DSML is to be expected).
    pub fn tools_active(&self) -> bool {
        !self.tool_choice_none && self.tools.iter().any(|t| !t.is_empty())
    }
}

/// Exact-replay hook (§3.5): maps the call ids of one assistant message to the raw DSML
/// block the model sampled for them. Return `Some` only if *all* ids are known and point
/// to the same block; the renderer then writes that block verbatim instead of the
/// canonical form.
pub trait DsmlReplay {
    fn replay_block(&self, call_ids: &[&str]) -> Option<Arc<str>>;
}

/// No replay: always canonical.
pub struct NoReplay;

impl DsmlReplay for NoReplay {
    fn replay_block(&self, _: &[&str]) -> Option<Arc<str>> {
        None
    }
}

/// A simple unbounded id → block map (parallel calls share one `Arc`). The server's
/// bounded LRU store can implement [`DsmlReplay`] the same way.
#[derive(Debug, Default, Clone)]
pub struct ReplayMap {
    ids: HashMap<String, Arc<str>>,
}

impl ReplayMap {
    /// Remembers `block` (a parsed turn's `raw_dsml`) for every id of that turn.
    pub fn remember(&mut self, call_ids: &[&str], block: &str) {
        let block: Arc<str> = Arc::from(block);
        for id in call_ids {
            self.ids.insert((*id).to_string(), block.clone());
        }
    }
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl DsmlReplay for ReplayMap {
    fn replay_block(&self, call_ids: &[&str]) -> Option<Arc<str>> {
        let (first, rest) = call_ids.split_first()?;
        let block = self.ids.get(*first)?;
        for id in rest {
            // Same block by content (storage may or may not share the Arc).
            if self.ids.get(*id).map(|b| **b != **block).unwrap_or(true) {
                return None;
            }
        }
        Some(block.clone())
    }
}

/// `<tool_result>` text escaping: only the exact closing tag is escaped (`&lt;/tool_result>`).
pub fn escape_tool_result(s: &str) -> String {
    s.replace("</tool_result>", "&lt;/tool_result>")
}

/// Appends `<tool_result>RESULT</tool_result>` to `content` (Anthropic tool results inside
/// a user message; also what the server renderer writes for tool messages).
pub fn push_tool_result(content: &mut String, result: &str) {
    content.push_str("<tool_result>");
    content.push_str(&escape_tool_result(result));
    content.push_str("</tool_result>");
}

fn escape_attr(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
}

const PARAM_END: &str = "</｜DSML｜parameter>";

fn push_param(out: &mut String, name: &str, value: &ArgValue) {
    out.push_str("<｜DSML｜parameter name=\"");
    escape_attr(name, out);
    match value {
        ArgValue::Str(s) => {
            out.push_str("\" string=\"true\">");
            out.push_str(&s.replace(PARAM_END, "&lt;/｜DSML｜parameter>"));
        }
        ArgValue::Json(j) => {
            out.push_str("\" string=\"false\">");
            // Only possible inside a JSON string, where \u003c is an equivalent spelling.
            out.push_str(&j.replace(PARAM_END, "\\u003c/｜DSML｜parameter>"));
        }
    }
    out.push_str(PARAM_END);
    out.push('\n');
}

/// Canonical DSML for a list of calls (§3.3), including the leading `\n\n`.
/// Arguments keep the client's key order; non-object arguments become one
/// `arguments` string parameter holding the raw text.
pub fn canonical_dsml(calls: &[ToolCall]) -> String {
    let mut out = String::from("\n\n<｜DSML｜tool_calls>\n");
    for c in calls {
        out.push_str("<｜DSML｜invoke name=\"");
        escape_attr(&c.name, &mut out);
        out.push_str("\">\n");
        match json::object_members(&c.arguments) {
            Some(members) => {
                for (k, v) in &members {
                    push_param(&mut out, k, v);
                }
            }
            None => push_param(&mut out, "arguments", &ArgValue::Str(c.arguments.clone())),
        }
        out.push_str("</｜DSML｜invoke>\n");
    }
    out.push_str("</｜DSML｜tool_calls>");
    out
}

/// Renders an assistant message's calls: replayed block if the hook knows them all, else canonical.
fn push_calls(out: &mut String, calls: &[ToolCall], replay: &dyn DsmlReplay) {
    if calls.is_empty() {
        return;
    }
    let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
    match replay.replay_block(&ids).filter(|b| !b.is_empty()) {
        Some(block) => out.push_str(&block),
        None => out.push_str(&canonical_dsml(calls)),
    }
}

/// The schema line for one client tool entry (§1.4, §3.2): OpenAI's
/// `{"type":"function","function":X}` (any object with a `function` member) gives the raw
/// bytes of `X`; anything else is used as sent.
pub fn tool_schema_line(raw_tool: &str) -> &str {
    match json::member_span(raw_tool, "function") {
        Some(r) => &raw_tool[r],
        None => raw_tool,
    }
}

/// Tools section (§3.2): preamble, schema lines joined by `\n`, postamble.
pub fn tools_section(schemas: &[String]) -> String {
    let mut s = String::from(TOOLS_PREAMBLE);
    s.push_str(&schemas.join("\n"));
    s.push_str(TOOLS_POSTAMBLE);
    s
}

/// *Tool context* (§4.2): active tools, an assistant message with calls, or a tool message.
pub fn tool_context(req: &ChatRequest) -> bool {
    req.tools_active()
        || req.messages.iter().any(|m| {
            (m.role == Role::Assistant && !m.tool_calls.is_empty()) || m.role == Role::Tool
        })
}

/// Renders the turns from `start` on. `keep_reasoning(i)` decides, in thinking modes,
/// whether assistant message `i` keeps `<think>REASONING</think>`.
fn render_turns(
    out: &mut String,
    msgs: &[Message],
    start: usize,
    think: ThinkMode,
    keep_reasoning: &dyn Fn(usize) -> bool,
    replay: &dyn DsmlReplay,
) {
    let (mut pending_assistant, mut pending_tool) = (false, false);
    for (i, m) in msgs.iter().enumerate().skip(start) {
        match m.role {
            Role::System | Role::Developer => {}
            Role::User => {
                out.push_str(USER);
                out.push_str(&m.content);
                pending_assistant = true;
                pending_tool = false;
            }
            Role::Tool => {
                // A run of consecutive tool results shares one <｜User｜>.
                if !pending_tool {
                    out.push_str(USER);
                }
                push_tool_result(out, &m.content);
                pending_assistant = true;
                pending_tool = true;
            }
            Role::Assistant => {
                if pending_assistant {
                    out.push_str(ASSISTANT);
                    if think.thinking() && keep_reasoning(i) {
                        out.push_str(THINK_OPEN);
                        out.push_str(m.reasoning.as_deref().unwrap_or(""));
                    }
                    out.push_str(THINK_CLOSE);
                }
                out.push_str(&m.content);
                push_calls(out, &m.tool_calls, replay);
                out.push_str(EOS);
                pending_assistant = false;
                pending_tool = false;
            }
        }
    }
    if pending_assistant {
        out.push_str(ASSISTANT);
        out.push_str(if think.thinking() {
            THINK_OPEN
        } else {
            THINK_CLOSE
        });
    }
}

/// Server chat rendering (§4.2), byte-exact with ds4's `render_chat_prompt_text`.
pub fn render_chat_prompt(req: &ChatRequest, replay: &dyn DsmlReplay) -> String {
    let msgs = &req.messages;
    let tool_ctx = tool_context(req);
    let last_user = msgs.iter().rposition(|m| m.role.is_user_like());

    let mut system = String::new();
    if req.tools_active() {
        system.push_str(&tools_section(&req.tools));
    }
    for m in msgs.iter().filter(|m| m.role.is_system()) {
        if !system.is_empty() {
            system.push_str("\n\n");
        }
        system.push_str(&m.content);
    }

    let mut out = String::from(BOS);
    if req.think == ThinkMode::Max {
        out.push_str(THINK_MAX_PREFIX);
    }
    out.push_str(&system);
    // Reasoning is kept in tool context, or for assistant turns after the last user/tool message.
    let keep = |i: usize| tool_ctx || last_user.is_none_or(|u| i > u);
    render_turns(&mut out, msgs, 0, req.think, &keep, replay);
    out
}

/// Live tool-continuation tail (§3.6): `<｜end▁of▁sentence｜>` then the messages from
/// `start` on (tool results, user text, ...) and the next assistant prefix. Reasoning of
/// assistant messages in the tail is always kept in thinking modes.
pub fn render_tool_tail(
    msgs: &[Message],
    start: usize,
    think: ThinkMode,
    replay: &dyn DsmlReplay,
) -> String {
    let mut out = String::from(EOS);
    render_turns(&mut out, msgs, start, think, &|_| true, replay);
    out
}

/// A piece of a CLI prompt: specials are inserted by token id, text is BPE-encoded
/// *without* special detection (so user text `<｜User｜>` stays text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Special(&'static str),
    Text(String),
}

/// Concatenates pieces into rendered text (loses the special/text distinction).
pub fn pieces_text(pieces: &[Piece]) -> String {
    pieces
        .iter()
        .map(|p| match p {
            Piece::Special(s) => *s,
            Piece::Text(t) => t.as_str(),
        })
        .collect()
}

fn think_piece(think: ThinkMode) -> Piece {
    Piece::Special(if think.thinking() {
        THINK_OPEN
    } else {
        THINK_CLOSE
    })
}

/// CLI transcript start: BOS, [Think-Max prefix], system text. `system: None` uses
/// [`DEFAULT_SYSTEM_PROMPT`]; `Some("")` disables it.
pub fn cli_prelude(system: Option<&str>, think: ThinkMode) -> Vec<Piece> {
    let mut p = vec![Piece::Special(BOS)];
    if think == ThinkMode::Max {
        p.push(Piece::Text(THINK_MAX_PREFIX.to_string()));
    }
    let sys = system.unwrap_or(DEFAULT_SYSTEM_PROMPT);
    if !sys.is_empty() {
        p.push(Piece::Text(sys.to_string()));
    }
    p
}

/// One user turn for the CLI: `<｜User｜>` text `<｜Assistant｜>` `<think>`/`</think>`.
pub fn cli_user_turn(text: &str, think: ThinkMode) -> Vec<Piece> {
    vec![
        Piece::Special(USER),
        Piece::Text(text.to_string()),
        Piece::Special(ASSISTANT),
        think_piece(think),
    ]
}

/// CLI one-shot prompt (`ds4_encode_chat_prompt`). A prompt that starts with the BOS string
/// is already rendered: it is returned as a single text piece, to be tokenized *with*
/// special detection (check with [`is_prerendered`]).
pub fn cli_one_shot(system: Option<&str>, prompt: &str, think: ThinkMode) -> Vec<Piece> {
    if is_prerendered(prompt) {
        return vec![Piece::Text(prompt.to_string())];
    }
    let mut p = cli_prelude(system, think);
    p.extend(cli_user_turn(prompt, think));
    p
}

/// True when `-p`/`--prompt-file` text is an already-rendered prompt.
pub fn is_prerendered(prompt: &str) -> bool {
    prompt.starts_with(BOS)
}

/// `/v1/completions` wrapper (§1.4): BOS, [max prefix], `You are a helpful assistant`,
/// `<｜User｜>`, prompt, `<｜Assistant｜>`, think marker. Plain text (the server tokenizes
/// it with special detection).
pub fn render_completion_prompt(prompt: &str, think: ThinkMode) -> String {
    let mut p = cli_prelude(None, think);
    p.extend(cli_user_turn(prompt, think));
    pieces_text(&p)
}

/// CLI REPL transcript (§4.3). Unlike the server, it keeps earlier reasoning: the
/// generated text is appended exactly as sampled.
#[derive(Debug, Clone)]
pub struct CliChat {
    think: ThinkMode,
    pieces: Vec<Piece>,
    /// Pieces already handed to the model.
    fed: usize,
}

impl CliChat {
    pub fn new(system: Option<&str>, think: ThinkMode) -> Self {
        CliChat {
            think,
            pieces: cli_prelude(system, think),
            fed: 0,
        }
    }
    /// Appends a user turn; returns the pieces to feed the model now (the first call also
    /// returns the prelude).
    pub fn user_turn(&mut self, text: &str) -> Vec<Piece> {
        self.pieces.extend(cli_user_turn(text, self.think));
        let new = self.pieces[self.fed..].to_vec();
        self.fed = self.pieces.len();
        new
    }
    /// Records generated text of the current assistant turn (already in the KV).
    pub fn push_generated(&mut self, text: &str) {
        match self.pieces.last_mut() {
            Some(Piece::Text(t)) => t.push_str(text),
            _ => self.pieces.push(Piece::Text(text.to_string())),
        }
        self.fed = self.pieces.len();
    }
    /// Ends the assistant turn with EOS; returns the piece to feed.
    pub fn end_turn(&mut self) -> Piece {
        self.pieces.push(Piece::Special(EOS));
        self.fed = self.pieces.len();
        Piece::Special(EOS)
    }
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }
    pub fn text(&self) -> String {
        pieces_text(&self.pieces)
    }
}
