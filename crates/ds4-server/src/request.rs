//! Request bodies → a protocol-neutral [`Prepared`] request (interfaces.md §1.3–1.4, §2.1).
//! Only the listed fields are read; others are ignored. `null` counts as absent everywhere
//! (the *Gotcha* in §1.3); a present field of the wrong type is a 400 naming the field.

use crate::error::{ApiError, Proto};
use ds4_chat::{
    push_tool_result, render_chat_prompt, render_completion_prompt, tool_schema_line, ChatRequest,
    DsmlReplay, Message, Role, ThinkControls, ThinkMode, ToolCall,
};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

pub const DEFAULT_MODEL: &str = "deepseek-v4-flash";

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
    Messages,
    Responses,
}

impl Kind {
    pub fn proto(self) -> Proto {
        match self {
            Kind::Messages => Proto::Anthropic,
            _ => Proto::OpenAi,
        }
    }
    /// `param` of a context-length error.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat | Kind::Messages => "messages",
            Kind::Completion => "prompt",
            Kind::Responses => "input",
        }
    }
}

/// Sampling and length knobs of one request (absent = server default).
#[derive(Debug, Clone, Default)]
pub struct GenParams {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    /// `None` or ≤ 0: random.
    pub seed: Option<i64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `logprobs` / `top_logprobs` (an *Opportunity* over ds4, which ignored them): report
    /// the sampled token's log-probability and this many alternatives (≤ 20).
    pub logprobs: Option<usize>,
}

/// A parsed, rendered request.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub kind: Kind,
    pub model: String,
    pub prompt_text: String,
    pub think: ThinkMode,
    /// DSML is parsed from the output (chat-like endpoints unless `tool_choice` is none).
    pub detect_tools: bool,
    pub params: GenParams,
    /// Responses: `reasoning.summary` was requested (reasoning is returned).
    pub summary: bool,
    /// Responses namespaced tools: (prompt name, namespace, wire name).
    pub namespaces: Vec<(String, String, String)>,
}

fn bad(field: &str, what: &str) -> ApiError {
    ApiError::bad(format!("invalid JSON request: field `{field}` {what}"))
}

/// Typed, null-tolerant access to a JSON object's fields.
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    pub fn new(map: &'a Map<String, Value>) -> Self {
        Fields { map, prefix: "" }
    }
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    /// The value, with `null` treated as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(bad(&self.name(key), "must be a boolean")),
        }
    }
    pub fn f32(&self, key: &str) -> Result<Option<f32>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64().map(|f| f as f32)),
            Some(_) => Err(bad(&self.name(key), "must be a number")),
        }
    }
    /// Integers are truncated; negative → 0 (§1.3).
    pub fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(Some(
                n.as_i64()
                    .or_else(|| {
                        n.as_f64()
                            .map(|f| f.clamp(i64::MIN as f64, i64::MAX as f64) as i64)
                    })
                    .unwrap_or(i64::MAX),
            )),
            Some(_) => Err(bad(&self.name(key), "must be a number")),
        }
    }
    pub fn usize(&self, key: &str) -> Result<Option<usize>, ApiError> {
        Ok(self.i64(key)?.map(|v| v.max(0) as usize))
    }
    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(bad(&self.name(key), "must be a string")),
        }
    }
    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Fields { map: m, prefix: "" })),
            Some(_) => Err(bad(&self.name(key), "must be an object")),
        }
    }
    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => Err(bad(&self.name(key), "must be an array")),
        }
    }
    /// `stop`: a string or an array of strings (non-strings skipped, empty strings dropped).
    pub fn stop(&self, key: &str) -> Result<Vec<String>, ApiError> {
        let v: Vec<String> = match self.get(key) {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect(),
            Some(_) => return Err(bad(&self.name(key), "must be a string or an array")),
        };
        Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
    }
}

/// Message content: string, null → "", array → concatenated strings and `text` of parts
/// (other parts, e.g. images, dropped); other types → "".
fn content_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect(),
        _ => String::new(),
    }
}

/// Arguments as raw JSON text: a JSON string is taken as the text, any other value is
/// serialised (keys in the order sent).
fn args_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Raw bytes of the top-level `tools` entries (schema lines must be the client's bytes).
fn raw_tools(body: &[u8]) -> Vec<String> {
    let Ok(top) = serde_json::from_slice::<BTreeMap<String, Box<RawValue>>>(body) else {
        return vec![];
    };
    let Some(t) = top.get("tools") else {
        return vec![];
    };
    serde_json::from_str::<Vec<Box<RawValue>>>(t.get())
        .map(|v| {
            v.iter()
                .map(|r| tool_schema_line(r.get()).to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn think_common(f: &Fields, tc: &mut ThinkControls) -> Result<(), ApiError> {
    if let Some(v) = f.map.get("thinking") {
        tc.apply_thinking(v)
            .map_err(|e| ApiError::bad(e.to_string()))?;
    }
    if let Some(b) = f.bool("think")? {
        tc.apply_think(b);
    }
    if let Some(v) = f.get("reasoning_effort") {
        tc.apply_effort("reasoning_effort", v)
            .map_err(|e| ApiError::bad(e.to_string()))?;
    }
    Ok(())
}

fn params_common(f: &Fields, kind: Kind) -> Result<GenParams, ApiError> {
    let mut p = GenParams {
        temperature: f.f32("temperature")?,
        top_p: f.f32("top_p")?,
        stream: f.bool("stream")?.unwrap_or(false),
        ..Default::default()
    };
    if kind != Kind::Responses {
        p.top_k = f.usize("top_k")?;
    }
    match kind {
        Kind::Chat | Kind::Completion => {
            p.min_p = f.f32("min_p")?;
            p.seed = f.i64("seed")?;
            p.stop = f.stop("stop")?;
            if let Some(o) = f.object("stream_options")? {
                p.include_usage = o.bool("include_usage")?.unwrap_or(false);
            }
            p.logprobs = if kind == Kind::Chat {
                f.bool("logprobs")?
                    .filter(|b| *b)
                    .map(|_| f.usize("top_logprobs"))
                    .transpose()?
                    .map(|k| k.unwrap_or(0).min(20))
            } else {
                // Legacy completions: `logprobs` is the number of alternatives.
                f.usize("logprobs")?.map(|k| k.min(20))
            };
            // Every spelling; the later one in the body wins.
            for (k, _) in f.map.iter() {
                if k == "max_tokens" || k == "max_completion_tokens" {
                    if let Some(n) = f.usize(k)? {
                        p.max_tokens = Some(n);
                    }
                }
            }
        }
        Kind::Messages => {
            p.stop = f.stop("stop_sequences")?;
            p.max_tokens = f.usize("max_tokens")?;
        }
        Kind::Responses => {
            for (k, _) in f.map.iter() {
                if k == "max_output_tokens" || k == "max_tokens" {
                    if let Some(n) = f.usize(k)? {
                        p.max_tokens = Some(n);
                    }
                }
            }
        }
    }
    Ok(p)
}

fn model_of(f: &Fields) -> Result<String, ApiError> {
    Ok(f.str("model")?.unwrap_or(DEFAULT_MODEL).to_string())
}

/// `POST /v1/chat/completions`.
pub fn chat(
    v: &Value,
    body: &[u8],
    ctx: usize,
    replay: &dyn DsmlReplay,
) -> Result<Prepared, ApiError> {
    let f = root(v)?;
    let model = model_of(&f)?;
    let msgs = f
        .array("messages")?
        .ok_or_else(|| ApiError::bad("missing messages"))?;
    let mut messages = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let Value::Object(mo) = m else {
            return Err(bad(&format!("messages[{i}]"), "must be an object"));
        };
        let mf = Fields::new(mo);
        let role_name = mf.str("role")?.unwrap_or("user");
        let Some(role) = Role::from_api(role_name) else {
            continue; // unknown roles are ignored
        };
        let mut msg = Message::new(role, content_text(mf.get("content")));
        if let Some(r) = mf.get("reasoning_content") {
            msg.reasoning = Some(content_text(Some(r)));
        }
        msg.tool_call_id = mf.str("tool_call_id")?.map(str::to_string);
        for c in mf.array("tool_calls")?.into_iter().flatten() {
            let func = c.get("function");
            let name = func.and_then(|x| x.get("name")).and_then(Value::as_str);
            let args = func
                .and_then(|x| x.get("arguments"))
                .filter(|a| !a.is_null());
            if let (Some(name), Some(args)) = (name, args) {
                msg.tool_calls.push(ToolCall {
                    id: c
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    name: name.to_string(),
                    arguments: args_text(args),
                });
            }
        }
        messages.push(msg);
    }
    let tool_choice_none = matches!(f.get("tool_choice"), Some(Value::String(s)) if s == "none");
    let mut tc = ThinkControls::default();
    think_common(&f, &mut tc)?;
    let think = tc.resolve(Some(&model), ctx as u64).mode;
    let req = ChatRequest {
        messages,
        tools: if f.get("tools").is_some() {
            raw_tools(body)
        } else {
            vec![]
        },
        tool_choice_none,
        think,
    };
    Ok(Prepared {
        kind: Kind::Chat,
        prompt_text: render_chat_prompt(&req, replay),
        model,
        think,
        detect_tools: !tool_choice_none,
        params: params_common(&f, Kind::Chat)?,
        summary: false,
        namespaces: vec![],
    })
}

fn root(v: &Value) -> Result<Fields<'_>, ApiError> {
    match v {
        Value::Object(m) => Ok(Fields::new(m)),
        _ => Err(ApiError::bad(
            "invalid JSON request: the body must be a JSON object",
        )),
    }
}

/// `POST /v1/completions`: the prompt is chat-wrapped (§1.4); no DSML parsing.
pub fn completion(v: &Value, ctx: usize) -> Result<Prepared, ApiError> {
    let f = root(v)?;
    let model = model_of(&f)?;
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::bad("missing prompt")),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => match a.first() {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(bad("prompt", "must be a string or an array of strings")),
        },
        Some(_) => return Err(bad("prompt", "must be a string or an array of strings")),
    };
    let mut tc = ThinkControls::default();
    think_common(&f, &mut tc)?;
    let think = tc.resolve(Some(&model), ctx as u64).mode;
    Ok(Prepared {
        kind: Kind::Completion,
        prompt_text: render_completion_prompt(&prompt, think),
        model,
        think,
        detect_tools: false,
        params: params_common(&f, Kind::Completion)?,
        summary: false,
        namespaces: vec![],
    })
}

/// `POST /v1/messages` (and `count_tokens`, which ignores the generation fields).
pub fn messages(
    v: &Value,
    body: &[u8],
    ctx: usize,
    replay: &dyn DsmlReplay,
) -> Result<Prepared, ApiError> {
    let f = root(v).map_err(|e| e.proto(Proto::Anthropic))?;
    let an = |e: ApiError| e.proto(Proto::Anthropic);
    let model = model_of(&f).map_err(an)?;
    let msgs = f
        .array("messages")
        .map_err(an)?
        .ok_or_else(|| ApiError::bad("missing messages").proto(Proto::Anthropic))?;
    let mut messages = Vec::new();
    // System: string or text blocks joined with `\n`; `x-anthropic-` parts dropped (§1.4).
    let mut system = String::new();
    let mut add_sys = |t: &str| {
        if t.starts_with("x-anthropic-") {
            return;
        }
        if !system.is_empty() && !system.ends_with('\n') {
            system.push('\n');
        }
        system.push_str(t);
    };
    match f.get("system") {
        None => {}
        Some(Value::String(s)) => add_sys(s),
        Some(Value::Array(a)) => {
            for p in a {
                match p {
                    Value::String(s) => add_sys(s),
                    Value::Object(o) => {
                        if let Some(t) = o.get("text").and_then(Value::as_str) {
                            add_sys(t)
                        }
                    }
                    _ => {}
                }
            }
        }
        Some(_) => return Err(an(bad("system", "must be a string or an array"))),
    }
    if !system.is_empty() {
        messages.push(Message::system(system));
    }
    for (i, m) in msgs.iter().enumerate() {
        let Value::Object(mo) = m else {
            return Err(an(bad(&format!("messages[{i}]"), "must be an object")));
        };
        let mf = Fields::new(mo);
        let role = match mf.str("role").map_err(an)?.unwrap_or("user") {
            "assistant" => Role::Assistant,
            "user" => Role::User,
            _ => continue,
        };
        let mut msg = Message::new(role, String::new());
        let blocks: Vec<Value> = match mf.get("content") {
            None => vec![],
            Some(Value::String(s)) => vec![Value::String(s.clone())],
            Some(Value::Array(a)) => a.clone(),
            Some(_) => {
                return Err(an(bad(
                    &format!("messages[{i}].content"),
                    "must be a string or an array",
                )))
            }
        };
        for b in &blocks {
            match b {
                Value::String(s) => msg.content.push_str(s),
                Value::Object(o) => match o.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        if let Some(t) = o.get("text").and_then(Value::as_str) {
                            msg.content.push_str(t);
                        }
                    }
                    Some("thinking") => {
                        if let Some(t) = o.get("thinking").and_then(Value::as_str) {
                            msg.reasoning.get_or_insert_with(String::new).push_str(t);
                        }
                    }
                    Some("tool_use") => msg.tool_calls.push(ToolCall {
                        id: o.get("id").and_then(Value::as_str).unwrap_or("").into(),
                        name: o.get("name").and_then(Value::as_str).unwrap_or("").into(),
                        arguments: o
                            .get("input")
                            .filter(|x| !x.is_null())
                            .map(|x| x.to_string())
                            .unwrap_or_else(|| "{}".into()),
                    }),
                    Some("tool_result") => {
                        let r = content_text(o.get("content"));
                        push_tool_result(&mut msg.content, &r);
                        msg.tool_call_id = o
                            .get("tool_use_id")
                            .and_then(Value::as_str)
                            .map(str::to_string);
                    }
                    _ => {} // images, documents, redacted thinking
                },
                _ => {}
            }
        }
        messages.push(msg);
    }
    let tool_choice_none = matches!(
        f.get("tool_choice").and_then(|t| t.get("type")),
        Some(Value::String(s)) if s == "none"
    );
    let mut tc = ThinkControls::default();
    if let Some(v) = f.map.get("thinking") {
        tc.apply_thinking(v)
            .map_err(|e| an(ApiError::bad(e.to_string())))?;
    }
    if let Some(eff) = f
        .get("output_config")
        .and_then(|o| o.get("effort"))
        .filter(|e| !e.is_null())
    {
        tc.apply_effort("output_config.effort", eff)
            .map_err(|e| an(ApiError::bad(e.to_string())))?;
    }
    if let Some(v) = f.get("reasoning_effort") {
        tc.apply_effort("reasoning_effort", v)
            .map_err(|e| an(ApiError::bad(e.to_string())))?;
    }
    let think = tc.resolve(Some(&model), ctx as u64).mode;
    let req = ChatRequest {
        messages,
        tools: if f.get("tools").is_some() {
            raw_tools(body)
        } else {
            vec![]
        },
        tool_choice_none,
        think,
    };
    Ok(Prepared {
        kind: Kind::Messages,
        prompt_text: render_chat_prompt(&req, replay),
        model,
        think,
        detect_tools: !tool_choice_none,
        params: params_common(&f, Kind::Messages).map_err(an)?,
        summary: false,
        namespaces: vec![],
    })
}

/// Text of a Responses content value: string, null, or parts of text-like types
/// (anything else is rejected, §1.4).
fn responses_text(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) => {
            let mut s = String::new();
            for (j, p) in a.iter().enumerate() {
                match p {
                    Value::String(t) => s.push_str(t),
                    Value::Object(o) => {
                        let ty = o.get("type").and_then(Value::as_str).unwrap_or("");
                        let ok = matches!(
                            ty,
                            "input_text"
                                | "output_text"
                                | "text"
                                | "summary_text"
                                | "reasoning_text"
                        );
                        match o.get("text").and_then(Value::as_str) {
                            Some(t) if ok => s.push_str(t),
                            _ => {
                                return Err(ApiError::bad(format!(
                                    "invalid JSON request: {at}[{j}]: content part type {ty:?} is not supported (text only)"
                                )))
                            }
                        }
                    }
                    _ => return Err(bad(&format!("{at}[{j}]"), "must be a string or an object")),
                }
            }
            Ok(s)
        }
        Some(_) => Err(bad(at, "must be a string, null or an array")),
    }
}

/// `POST /v1/responses`.
pub fn responses(
    v: &Value,
    body: &[u8],
    ctx: usize,
    replay: &dyn DsmlReplay,
) -> Result<Prepared, ApiError> {
    let f = root(v)?;
    let model = model_of(&f)?;
    for k in ["previous_response_id", "conversation"] {
        if f.get(k).is_some() {
            return Err(ApiError::bad(format!(
                "{k} is not supported; replay full input instead"
            )));
        }
    }
    let mut messages: Vec<Message> = Vec::new();
    if let Some(s) = f.str("instructions")? {
        messages.push(Message::system(s));
    }
    match f.get("input") {
        None => return Err(ApiError::bad("missing input")),
        Some(Value::String(s)) => messages.push(Message::user(s.clone())),
        Some(Value::Array(items)) => responses_items(items, &mut messages)?,
        Some(_) => return Err(bad("input", "must be a string or an array")),
    }
    let tool_choice_none = match f.get("tool_choice") {
        None => false,
        Some(Value::String(s)) if s == "none" => true,
        Some(Value::String(s)) if s == "auto" => false,
        Some(Value::String(s)) => {
            return Err(ApiError::bad(format!("tool_choice={s} not supported")))
        }
        Some(_) => return Err(ApiError::bad("forced tool_choice not supported")),
    };
    let mut tc = ThinkControls::default();
    let mut summary = false;
    if let Some(r) = f.object("reasoning")? {
        if let Some(e) = r.map.get("effort") {
            tc.apply_responses_effort(e)
                .map_err(|e| ApiError::bad(e.to_string()))?;
        }
        summary = matches!(r.str("summary")?, Some("auto" | "concise" | "detailed"));
    }
    let think = tc.resolve(Some(&model), ctx as u64).mode;
    let mut namespaces = Vec::new();
    let tools = match f.array("tools")? {
        Some(list) => responses_tools(list, raw_tools(body), &mut namespaces),
        None => vec![],
    };
    let req = ChatRequest {
        messages,
        tools,
        tool_choice_none,
        think,
    };
    Ok(Prepared {
        kind: Kind::Responses,
        prompt_text: render_chat_prompt(&req, replay),
        model,
        think,
        detect_tools: !tool_choice_none,
        params: params_common(&f, Kind::Responses)?,
        summary,
        namespaces,
    })
}

/// Responses tools (§1.4): raw bytes as sent, except `{"type":"namespace","name":N,
/// "tools":[…]}`, flattened to one schema per inner function named `N + name` (recorded in
/// `ns` so the output can map it back), and the hosted `tool_search`, rendered as a
/// function of that name.
fn responses_tools(
    list: &[Value],
    raw: Vec<String>,
    ns: &mut Vec<(String, String, String)>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("namespace") => {
                let n = t.get("name").and_then(Value::as_str).unwrap_or("");
                for inner in t
                    .get("tools")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let mut f = inner
                        .get("function")
                        .cloned()
                        .unwrap_or_else(|| inner.clone());
                    let Some(name) = f.get("name").and_then(Value::as_str).map(str::to_string)
                    else {
                        continue;
                    };
                    let prompt_name = format!("{n}{name}");
                    f["name"] = Value::String(prompt_name.clone());
                    out.push(f.to_string());
                    ns.push((prompt_name, n.to_string(), name));
                }
            }
            Some("tool_search") => {
                let mut f = t.clone();
                f["name"] = Value::String("tool_search".into());
                out.push(f.to_string());
            }
            _ => {
                if let Some(r) = raw.get(i) {
                    out.push(r.clone());
                }
            }
        }
    }
    out
}

fn responses_items(items: &[Value], out: &mut Vec<Message>) -> Result<(), ApiError> {
    let mut reasoning: Option<String> = None;
    for (i, it) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(o) = it else {
            return Err(bad(&at, "must be an object"));
        };
        let f = Fields::new(o);
        if let Some(st) = f.str("status")? {
            if st != "completed" {
                return Err(ApiError::bad(format!(
                    "{at}: items with status {st:?} cannot be replayed"
                )));
            }
        }
        let ty = f.str("type")?.unwrap_or("message");
        let prev_assistant = out.last().is_some_and(|m| m.role == Role::Assistant);
        match ty {
            "message" => {
                let role = f.str("role")?.unwrap_or("user");
                let role = Role::from_api(role)
                    .filter(|r| *r != Role::Tool)
                    .ok_or_else(|| ApiError::bad(format!("{at}: unknown role {role:?}")))?;
                let mut m = Message::new(
                    role,
                    responses_text(f.get("content"), &format!("{at}.content"))?,
                );
                if role == Role::Assistant {
                    m.reasoning = reasoning.take();
                } else if let Some(r) = reasoning.take() {
                    out.push(Message::assistant("").with_reasoning(r));
                }
                out.push(m);
            }
            "reasoning" => {
                let mut parts = Vec::new();
                for k in ["summary", "content"] {
                    for p in f.array(k)?.into_iter().flatten() {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            parts.push(t.to_string());
                        }
                    }
                }
                let r = reasoning.get_or_insert_with(String::new);
                if !r.is_empty() && !parts.is_empty() {
                    r.push('\n');
                }
                r.push_str(&parts.join("\n"));
            }
            "function_call"
            | "custom_tool_call"
            | "local_shell_call"
            | "web_search_call"
            | "tool_search_call"
            | "image_generation_call" => {
                let id = f.str("call_id")?.or(f.str("id")?).unwrap_or("").to_string();
                let name = match ty {
                    "local_shell_call" => "local_shell".to_string(),
                    "tool_search_call" => "tool_search".to_string(),
                    "web_search_call" | "image_generation_call" => ty.to_string(),
                    _ => format!(
                        "{}{}",
                        f.str("namespace")?.unwrap_or(""),
                        f.str("name")?.unwrap_or("")
                    ),
                };
                let args = ["arguments", "input", "action"]
                    .iter()
                    .find_map(|k| f.get(k))
                    .map(args_text)
                    .unwrap_or_else(|| "{}".into());
                let call = ToolCall {
                    id,
                    name,
                    arguments: args,
                };
                if prev_assistant && reasoning.is_none() {
                    out.last_mut().expect("checked").tool_calls.push(call);
                } else {
                    let mut m = Message::assistant("");
                    m.reasoning = reasoning.take();
                    m.tool_calls.push(call);
                    out.push(m);
                }
            }
            t if t.ends_with("_output") => {
                if let Some(r) = reasoning.take() {
                    out.push(Message::assistant("").with_reasoning(r));
                }
                let text = match f.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(_)) => {
                        responses_text(f.get("output"), &format!("{at}.output"))?
                    }
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                out.push(Message::tool(f.str("call_id")?.unwrap_or(""), text));
            }
            "compaction" | "context_compaction" => {}
            other => {
                return Err(ApiError::bad(format!(
                    "{at}: input item type {other:?} is not supported"
                )))
            }
        }
    }
    if let Some(r) = reasoning {
        out.push(Message::assistant("").with_reasoning(r));
    }
    Ok(())
}
