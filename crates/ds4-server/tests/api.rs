//! HTTP-level tests on the tiny synthetic model: every endpoint streaming and not, tool
//! calls and reasoning through forced output, error shapes, hostile input, cancellation,
//! concurrency and the API key. Run with `cargo test -p ds4-server --release`.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ds4_engine::{Engine, EngineOptions};
use ds4_server::worker::ForceOutput;
use ds4_server::{router, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

/// One tiny model per test process.
fn model() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds4-server-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("tiny.gguf");
        ds4_synth::synth_tiny(&out, 7).unwrap();
        out
    })
    .clone()
}

struct Srv {
    state: Arc<AppState>,
    force: PathBuf,
}

impl Srv {
    fn new(edit: impl FnOnce(&mut ServerConfig)) -> Srv {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let force = model().with_file_name(format!("force-{n}.txt"));
        let _ = std::fs::remove_file(&force);
        let mut cfg = ServerConfig {
            ctx: 2048,
            force_output: ForceOutput(Some(force.clone())),
            ..Default::default()
        };
        edit(&mut cfg);
        let state = AppState::new(cfg);
        state.set_engine(Engine::open(&EngineOptions::new(model())).unwrap());
        Srv { state, force }
    }

    fn force(&self, text: &str) {
        std::fs::write(&self.force, text).unwrap();
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        hdr: &[(&str, &str)],
    ) -> (StatusCode, String) {
        let mut b = Request::builder().method(method).uri(path);
        for (k, v) in hdr {
            b = b.header(*k, *v);
        }
        let req = b
            .body(body.map_or(Body::empty(), |v| Body::from(v.to_string())))
            .unwrap();
        let resp = router(self.state.clone()).oneshot(req).await.unwrap();
        let st = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (st, String::from_utf8(bytes.to_vec()).unwrap())
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (st, s) = self.call("POST", path, Some(body), &[]).await;
        (
            st,
            serde_json::from_str(&s).unwrap_or_else(|e| panic!("{e}: {s}")),
        )
    }

    /// SSE frames of a streaming request: (event name, data).
    async fn stream(&self, path: &str, body: Value) -> Vec<(String, String)> {
        let (st, s) = self.call("POST", path, Some(body), &[]).await;
        assert_eq!(st, StatusCode::OK, "{s}");
        sse_frames(&s)
    }
}

fn sse_frames(s: &str) -> Vec<(String, String)> {
    s.split("\n\n")
        .filter(|f| !f.trim().is_empty() && !f.starts_with(':'))
        .map(|f| {
            let mut ev = String::new();
            let mut data = String::new();
            for l in f.lines() {
                if let Some(x) = l.strip_prefix("event: ") {
                    ev = x.into();
                } else if let Some(x) = l.strip_prefix("data: ") {
                    data = x.into();
                }
            }
            (ev, data)
        })
        .collect()
}

fn datas(frames: &[(String, String)]) -> Vec<Value> {
    frames
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect()
}

const TOOL_OUT: &str = "Need the file.</think>Reading.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a&lt;b.txt</｜DSML｜parameter>\n<｜DSML｜parameter name=\"limit\" string=\"false\">25</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>never sent";

fn tools_openai() -> Value {
    json!([{"type":"function","function":{"name":"read_file","description":"Read a file",
        "parameters":{"type":"object","properties":{"path":{"type":"string"},"limit":{"type":"integer"}}}}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_metrics() {
    let s = Srv::new(|_| {});
    let (st, v) = s.call("GET", "/v1/models", None, &[]).await;
    assert_eq!(st, StatusCode::OK);
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["data"][0]["id"], "deepseek-v4-flash");
    assert_eq!(v["data"][0]["context_length"], 2048);
    let (st, v) = s.call("GET", "/health", None, &[]).await;
    assert_eq!(st, StatusCode::OK);
    assert!(v.contains("\"ready\""), "{v}");
    let (st, _) = s.call("GET", "/v1/models/other", None, &[]).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    s.post(
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":2}),
    )
    .await;
    let (st, m) = s.call("GET", "/metrics", None, &[]).await;
    assert_eq!(st, StatusCode::OK);
    for name in [
        "ds4_requests_total{endpoint=\"chat_completions\"} 1",
        "ds4_generated_tokens_total",
        "ds4_queue_depth 0",
        "ds4_time_to_first_token_seconds_count 1",
        "ds4_cache_reused_tokens_total",
    ] {
        assert!(m.contains(name), "{name} missing in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_loading_before_the_engine() {
    let state = AppState::new(ServerConfig::default());
    let req = Request::get("/health").body(Body::empty()).unwrap();
    let r = router(state.clone()).oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let req = Request::post("/v1/chat/completions")
        .body(Body::from(r#"{"messages":[]}"#))
        .unwrap();
    let r = router(state).oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_sampled_greedy_is_deterministic_and_counts_usage() {
    let s = Srv::new(|_| {});
    let body = json!({"model":"deepseek-chat","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello"}],
        "max_tokens":6,"temperature":0,"top_p":null,"seed":null,"stream":null});
    let (st, a) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(st, StatusCode::OK, "{a}");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 6);
    assert_eq!(a["model"], "deepseek-chat");
    assert!(a["choices"][0]["message"]
        .get("reasoning_content")
        .is_none()); // alias: thinking off
    let p = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(p > 5);
    let (_, b) = s.post("/v1/chat/completions", body).await;
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    // The same text streamed greedily.
    let fr = s
        .stream("/v1/chat/completions", json!({"model":"deepseek-chat","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello"}],
            "max_completion_tokens":6,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}))
        .await;
    assert_eq!(fr.last().unwrap().1, "[DONE]");
    let d = datas(&fr);
    assert_eq!(d[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = d
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        a["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let usage = &d.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(usage["prompt_tokens"], p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_tool_call_reasoning_and_exact_replay() {
    let s = Srv::new(|_| {});
    s.force(TOOL_OUT);
    let req = json!({"messages":[{"role":"user","content":"show a<b.txt"}],"tools":tools_openai()});
    let (st, v) = s.post("/v1/chat/completions", req.clone()).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], "Reading.");
    assert_eq!(c["message"]["reasoning_content"], "Need the file.");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "read_file");
    assert_eq!(
        call["function"]["arguments"],
        r#"{"path":"a<b.txt","limit":25}"#
    );
    let id = call["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 37, "{id}");

    // Next turn: the client sends the call back re-serialised (different spacing); exact
    // replay renders the sampled DSML, so the live session is reused up to the new text.
    s.force("Done.</think>It has 25 lines.");
    let prompt1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let gen1 = v["usage"]["completion_tokens"].as_u64().unwrap();
    let next = json!({"messages":[{"role":"user","content":"show a<b.txt"},
        {"role":"assistant","content":"Reading.","reasoning_content":"Need the file.",
         "tool_calls":[{"id":id,"type":"function","function":{"name":"read_file","arguments":"{ \"path\": \"a<b.txt\", \"limit\": 25 }"}}]},
        {"role":"tool","tool_call_id":id,"content":"x = 1"}],"tools":tools_openai()});
    let (st, w) = s.post("/v1/chat/completions", next).await;
    assert_eq!(st, StatusCode::OK, "{w}");
    assert_eq!(w["choices"][0]["message"]["content"], "It has 25 lines.");
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt1 + gen1 - 1,
        "cached {cached}, first turn {prompt1}+{gen1}"
    );

    // Streaming: live tool-call deltas whose arguments concatenate to the final JSON.
    s.force(TOOL_OUT);
    let d = datas(&s.stream("/v1/chat/completions", json!({"messages":[{"role":"user","content":"x"}],"tools":tools_openai(),"stream":true})).await);
    let reasoning: String = d
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    let content: String = d
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(reasoning, "Need the file.");
    assert_eq!(content, "Reading.");
    let calls: Vec<&Value> = d
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls[0][0]["function"]["name"], "read_file");
    assert!(calls[0][0]["id"].as_str().unwrap().starts_with("call_"));
    let args: String = calls
        .iter()
        .filter_map(|c| c[0]["function"]["arguments"].as_str())
        .collect();
    let args: Value = serde_json::from_str(&args).unwrap();
    assert_eq!(args, json!({"path":"a<b.txt","limit":25}));
    assert_eq!(
        d.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // tool_choice none: no parsing, the markup is plain content.
    let (_, v) = s.post("/v1/chat/completions", json!({"messages":[{"role":"user","content":"x"}],"tools":tools_openai(),"tool_choice":"none"})).await;
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("tool_calls>"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_with_stop_sequences() {
    let s = Srv::new(|_| {});
    s.force("Alpha beta STOP gamma");
    let (st, v) = s
        .post(
            "/v1/completions",
            json!({"prompt":"Say it","stop":["STOP", ""],"max_tokens":50}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Alpha beta ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    let fr = s
        .stream(
            "/v1/completions",
            json!({"prompt":["Say it", 3],"stop":"STOP","stream":true}),
        )
        .await;
    let d = datas(&fr);
    let text: String = d
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "Alpha beta ");
    assert_eq!(d.last().unwrap()["choices"][0]["finish_reason"], "stop");
    // Without a stop sequence, the end of the forced text is a stop; max_tokens a length.
    let (_, v) = s
        .post("/v1/completions", json!({"prompt":"x","max_tokens":3}))
        .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_thinking_tools_and_count_tokens() {
    let s = Srv::new(|_| {});
    s.force(TOOL_OUT);
    let tools = json!([{"name":"read_file","description":"Read","input_schema":{"type":"object"}}]);
    let req = json!({"model":"claude-x","max_tokens":400,"system":[{"type":"text","text":"x-anthropic-billing: 1"},{"type":"text","text":"Be terse."}],
        "messages":[{"role":"user","content":[{"type":"text","text":"read it"}]}],"tools":tools,"thinking":{"type":"enabled","budget_tokens":100}});
    let (st, v) = s.post("/v1/messages", req.clone()).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["stop_reason"], "tool_use");
    let blocks = v["content"].as_array().unwrap();
    assert_eq!(blocks[0]["type"], "thinking");
    assert_eq!(blocks[0]["thinking"], "Need the file.");
    assert_eq!(blocks[1], json!({"type":"text","text":"Reading."}));
    assert_eq!(blocks[2]["type"], "tool_use");
    assert!(blocks[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(blocks[2]["input"], json!({"path":"a<b.txt","limit":25}));
    assert_eq!(v["usage"]["input_tokens"], 0);

    let fr = s.stream("/v1/messages", json!({"max_tokens":400,"stream":true,"messages":[{"role":"user","content":"read it"}],"tools":tools})).await;
    let names: Vec<&str> = fr.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(
        &names[names.len() - 2..],
        &["message_delta", "message_stop"]
    );
    let d = datas(&fr);
    let starts: Vec<&str> = d
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| e["content_block"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(starts, ["thinking", "text", "tool_use"]);
    let pj: String = d
        .iter()
        .filter_map(|e| e["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&pj).unwrap(),
        json!({"path":"a<b.txt","limit":25})
    );
    assert!(d.iter().any(|e| e["delta"]["type"] == "signature_delta"));
    let md = d.iter().find(|e| e["type"] == "message_delta").unwrap();
    assert_eq!(md["delta"]["stop_reason"], "tool_use");
    // Block indexes increase by one per block.
    let idx: Vec<u64> = d
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, [0, 1, 2]);

    // Thinking only (truncated): an empty text block follows.
    s.force("thinking forever and ever");
    let (_, v) = s
        .post(
            "/v1/messages",
            json!({"max_tokens":3,"messages":[{"role":"user","content":"q"}]}),
        )
        .await;
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["content"][1], json!({"type":"text","text":""}));

    let (st, c) = s
        .post(
            "/v1/messages/count_tokens",
            json!({"messages":[{"role":"user","content":"read it"}],"tools":tools}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert!(c["input_tokens"].as_u64().unwrap() > 100, "{c}"); // tools preamble included
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_stream_and_not() {
    let s = Srv::new(|_| {});
    s.force(TOOL_OUT);
    let tools = json!([{"type":"function","name":"read_file","parameters":{"type":"object"}}]);
    let (st, v) = s.post("/v1/responses", json!({"input":"read","instructions":"Be terse.","tools":tools,"reasoning":{"effort":"high","summary":"auto"}})).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "completed");
    let out = v["output"].as_array().unwrap();
    assert_eq!(out[0]["type"], "reasoning");
    assert_eq!(out[0]["summary"][0]["text"], "Need the file.");
    assert_eq!(out[1]["content"][0]["text"], "Reading.");
    assert_eq!(out[2]["type"], "function_call");
    assert_eq!(out[2]["arguments"], r#"{"path":"a<b.txt","limit":25}"#);
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));

    let d = datas(&s.stream("/v1/responses", json!({"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"read"}]}],"tools":tools,"stream":true})).await);
    for (i, e) in d.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
        // sequence_number is the second key
        assert_eq!(
            e.as_object().unwrap().keys().nth(1).unwrap(),
            "sequence_number"
        );
    }
    assert_eq!(d[0]["type"], "response.created");
    assert!(!d
        .iter()
        .any(|e| e["type"] == "response.reasoning_summary_text.delta")); // no summary requested
    let last = d.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    let fc = d
        .iter()
        .find(|e| e["type"] == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(fc["arguments"], r#"{"path":"a<b.txt","limit":25}"#);
    // A function_call_output continuation renders.
    s.force("ok</think>Fine.");
    let call_id = last["response"]["output"][1]["call_id"].as_str().unwrap();
    let (st, v) = s
        .post(
            "/v1/responses",
            json!({"input":[{"role":"user","content":"read"},
        {"type":"function_call","call_id":call_id,"name":"read_file","arguments":"{}"},
        {"type":"function_call_output","call_id":call_id,"output":"data"}],"tools":tools}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], "Fine.");
    // Truncated: incomplete.
    let (_, v) = s
        .post("/v1/responses", json!({"input":"x","max_output_tokens":2}))
        .await;
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_each_protocols_shape() {
    let s = Srv::new(|c| c.ctx = 64);
    let (st, b) = s.call("POST", "/v1/chat/completions", None, &[]).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{b}");
    let (st, b) = s.call("POST", "/v1/chat/completions", None, &[]).await;
    assert!(b.contains("invalid JSON request") && st == 400);
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[],"stream":"yes"}),
        )
        .await;
    assert_eq!(st, 400);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("`stream`"),
        "{v}"
    );
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[],"max_tokens":"10"}),
        )
        .await;
    assert_eq!(st, 400);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
    let (_, v) = s.post("/v1/chat/completions", json!({"model":"m"})).await;
    assert_eq!(v["error"]["message"], "missing messages");
    let (_, v) = s.post("/v1/completions", json!({})).await;
    assert_eq!(v["error"]["message"], "missing prompt");
    let (_, v) = s
        .post(
            "/v1/responses",
            json!({"input":"x","tool_choice":{"type":"function"}}),
        )
        .await;
    assert_eq!(v["error"]["message"], "forced tool_choice not supported");
    let (_, v) = s.post("/v1/responses", json!({"input":[{"type":"message","role":"user","content":[{"type":"input_image","image_url":"x"}]}]})).await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("input_image"),
        "{v}"
    );
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"x"}],"reasoning_effort":"extreme"}),
        )
        .await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("extreme"),
        "{v}"
    );
    // Anthropic envelope.
    let (st, v) = s.post("/v1/messages", json!({"max_tokens":5})).await;
    assert_eq!(st, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], "missing messages");
    // Context length, with the counts.
    let long = "word ".repeat(200);
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":long}]}),
        )
        .await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["param"], "messages");
    assert_eq!(v["error"]["n_ctx"], 64);
    assert!(v["error"]["n_prompt_tokens"].as_u64().unwrap() >= 64);
    let (_, v) = s
        .post(
            "/v1/messages",
            json!({"max_tokens":5,"messages":[{"role":"user","content":long}]}),
        )
        .await;
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["n_ctx"], 64);
    // Unknown route / wrong method.
    let (st, b) = s.call("GET", "/v2/nothing", None, &[]).await;
    assert_eq!(st, 404);
    assert!(b.contains("unknown endpoint"));
    let (st, _) = s.call("GET", "/v1/chat/completions", None, &[]).await;
    assert_eq!(st, 405);
    // Deep JSON.
    let deep = format!("{{\"messages\":{}1{}}}", "[".repeat(5000), "]".repeat(5000));
    let req = Request::post("/v1/chat/completions")
        .body(Body::from(deep))
        .unwrap();
    let r = router(s.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(r.status(), 400);
    let b = r.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&b).contains("nesting"));
    // Still serving.
    let (st, _) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"x"}],"max_tokens":1}),
        )
        .await;
    assert_eq!(st, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_and_cors() {
    let s = Srv::new(|c| {
        c.api_key = Some("sekrit".into());
        c.cors = true;
    });
    let body = json!({"messages":[{"role":"user","content":"x"}],"max_tokens":1});
    let (st, b) = s
        .call("POST", "/v1/chat/completions", Some(body.clone()), &[])
        .await;
    assert_eq!(st, 401);
    assert!(b.contains("authentication_error"));
    let (st, _) = s
        .call(
            "POST",
            "/v1/chat/completions",
            Some(body.clone()),
            &[("authorization", "Bearer wrong")],
        )
        .await;
    assert_eq!(st, 401);
    let (st, _) = s
        .call(
            "POST",
            "/v1/chat/completions",
            Some(body.clone()),
            &[("authorization", "Bearer sekrit")],
        )
        .await;
    assert_eq!(st, 200);
    let (st, b) = s
        .call(
            "POST",
            "/v1/messages",
            Some(json!({"max_tokens":1,"messages":[{"role":"user","content":"x"}]})),
            &[("x-api-key", "nope")],
        )
        .await;
    assert_eq!(st, 401);
    assert!(b.contains("\"type\":\"error\""));
    let (st, _) = s
        .call(
            "POST",
            "/v1/messages",
            Some(json!({"max_tokens":1,"messages":[{"role":"user","content":"x"}]})),
            &[("x-api-key", "sekrit")],
        )
        .await;
    assert_eq!(st, 200);
    let (st, _) = s.call("GET", "/health", None, &[]).await;
    assert_eq!(st, 200);
    let req = Request::builder()
        .method("OPTIONS")
        .uri("/v1/messages")
        .body(Body::empty())
        .unwrap();
    let r = router(s.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.headers()["access-control-allow-origin"], "*");
}

// ---------------------------------------------------------------------------------------
// Real sockets.

async fn listen(s: &Srv) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let st = s.state.clone();
    tokio::spawn(ds4_server::serve(l, st, std::future::pending()));
    addr
}

/// A blocking HTTP/1.0 exchange (no chunking): status and body.
fn http(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    let _ = c.write_all(body);
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    let s = String::from_utf8_lossy(&out).to_string();
    let status = s
        .split(' ')
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    let body = s
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

fn post_head(path: &str, len: usize) -> String {
    format!("POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413_without_being_read() {
    let s = Srv::new(|c| c.max_body = 1 << 20);
    let addr = listen(&s).await;
    tokio::task::spawn_blocking(move || {
        // Declared 100 MB: refused from the header alone; we send only 1 MB of it.
        let t = Instant::now();
        let (st, b) = http(addr, &post_head("/v1/chat/completions", 100_000_000), &vec![b' '; 1 << 20]);
        assert_eq!(st, 413, "{b}");
        assert!(b.contains("exceeds the limit"));
        assert!(t.elapsed() < Duration::from_secs(10));
        // Chunked, no length: cut off at the limit.
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").unwrap();
        let chunk = vec![b'a'; 64 << 10];
        for _ in 0..40 {
            if c.write_all(format!("{:x}\r\n", chunk.len()).as_bytes()).is_err() || c.write_all(&chunk).is_err() || c.write_all(b"\r\n").is_err() {
                break;
            }
        }
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        let s = String::from_utf8_lossy(&out);
        assert!(s.starts_with("HTTP/1.1 413"), "{s}");
        assert!(s.contains("request_too_large"), "{s}");
        // Still serving.
        let body = br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":1}"#;
        let (st, _) = http(addr, &post_head("/v1/chat/completions", body.len()), body);
        assert_eq!(st, 200);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_client_times_out_and_headers_are_bounded() {
    let s = Srv::new(|c| c.read_timeout = Duration::from_millis(1000));
    let addr = listen(&s).await;
    tokio::task::spawn_blocking(move || {
        // Body promised but never sent.
        let (st, b) = http(addr, &post_head("/v1/chat/completions", 50), b"{");
        assert!(st == 408 || st == 0, "{st} {b}");
        // A 100 KiB header block.
        let big = format!(
            "GET /health HTTP/1.0\r\nX-Big: {}\r\n\r\n",
            "a".repeat(100 << 10)
        );
        let (st, _) = http(addr, &big, b"");
        assert_eq!(st, 431);
        let (st, _) = http(addr, "GET /health HTTP/1.0\r\n\r\n", b"");
        assert_eq!(st, 200);
    })
    .await
    .unwrap();
}

/// Sends a request, reads `read` bytes of the answer (0: none), hangs up; then waits until
/// the worker is idle and has counted `cancelled` cancellations.
fn hang_up(
    addr: std::net::SocketAddr,
    body: &[u8],
    read: usize,
    m: &ds4_server::Metrics,
    cancelled: u64,
) {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(post_head("/v1/chat/completions", body.len()).as_bytes())
        .unwrap();
    c.write_all(body).unwrap();
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < read {
        got += c.read(&mut buf).unwrap();
    }
    if read == 0 {
        let t = Instant::now();
        while m.busy.get() == 0 {
            assert!(t.elapsed() < Duration::from_secs(20));
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200)); // decoding by now
    }
    drop(c);
    let t = Instant::now();
    while m.busy.get() == 1 || m.cancelled.get() < cancelled {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "generation did not stop"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_stops_generation() {
    let s = Srv::new(|c| c.ctx = 8192);
    s.force(&"word ".repeat(4000));
    let addr = listen(&s).await;
    let m = s.state.metrics.clone();
    tokio::task::spawn_blocking(move || {
        let body = br#"{"messages":[{"role":"user","content":"go"}],"max_tokens":4000,"stream":true,"think":false}"#;
        hang_up(addr, body, 2000, &m, 1);
        let after_stream = m.generated_tokens.get();
        assert!(after_stream < 4000, "{after_stream}");
        // A non-streaming client that leaves stops its generation too.
        let body = br#"{"messages":[{"role":"user","content":"go"}],"max_tokens":4000,"think":false}"#;
        hang_up(addr, body, 0, &m, 2);
        assert!(m.generated_tokens.get() - after_stream < 4000);
        let body = br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":2}"#;
        let (st, _) = http(addr, &post_head("/v1/chat/completions", body.len()), body);
        assert_eq!(st, 200);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_clients_get_their_own_answers() {
    let s = Srv::new(|_| {});
    let addr = listen(&s).await;
    let req = |i: usize| {
        json!({"messages":[{"role":"user","content":format!("question number {i}")}],"max_tokens":3,
               "temperature":0,"think":false})
        .to_string()
    };
    let ask = move |body: String| {
        let (st, b) = http(
            addr,
            &post_head("/v1/chat/completions", body.len()),
            body.as_bytes(),
        );
        assert_eq!(st, 200, "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let handles: Vec<_> = (0..32)
        .map(|i| {
            let b = req(i);
            tokio::task::spawn_blocking(move || ask(b))
        })
        .collect();
    let mut concurrent = Vec::new();
    for h in handles {
        concurrent.push(h.await.unwrap());
    }
    // Each answer equals the same prompt asked alone (greedy).
    for i in [0, 7, 31] {
        let b = req(i);
        let alone = tokio::task::spawn_blocking(move || ask(b)).await.unwrap();
        assert_eq!(alone, concurrent[i], "client {i}");
    }
    assert_eq!(s.state.metrics.queue_depth.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_stream_gets_keepalive_comments() {
    let s = Srv::new(|c| {
        c.keepalive = Duration::from_millis(20);
        c.ctx = 4096;
    });
    s.force(&"word ".repeat(1000));
    let st = s.state.clone();
    // Occupy the worker.
    let busy = tokio::spawn(async move {
        let req = Request::post("/v1/chat/completions")
            .body(Body::from(
                r#"{"messages":[{"role":"user","content":"long"}],"max_tokens":400,"think":false}"#,
            ))
            .unwrap();
        router(st)
            .oneshot(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap();
    });
    let t = Instant::now();
    while s.state.metrics.busy.get() == 0 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (st, b) = s
        .call(
            "POST",
            "/v1/chat/completions",
            Some(json!({"messages":[{"role":"user","content":"x"}],"max_tokens":2,"stream":true})),
            &[],
        )
        .await;
    assert_eq!(st, 200);
    assert!(
        b.starts_with(": keep-alive\n\n"),
        "{}",
        &b[..b.len().min(200)]
    );
    assert!(b.ends_with("data: [DONE]\n\n"));
    busy.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_turn_reuses_the_live_session_with_hidden_reasoning() {
    let s = Srv::new(|_| {});
    s.force("Let me think it over.</think>Answer one.");
    let first = json!({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Question?"}]});
    let (_, a) = s.post("/v1/chat/completions", first).await;
    assert_eq!(a["choices"][0]["message"]["content"], "Answer one.");
    let p1 = a["usage"]["prompt_tokens"].as_u64().unwrap();
    let g1 = a["usage"]["completion_tokens"].as_u64().unwrap();
    // The client replays the answer without its reasoning (as chat clients do): the prompt
    // differs from the KV text, yet the live session (which holds the reasoning) continues.
    s.force("Sure.</think>Answer two.");
    let second = json!({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Question?"},
        {"role":"assistant","content":"Answer one."},{"role":"user","content":"And then?"}]});
    let (_, b) = s.post("/v1/chat/completions", second.clone()).await;
    assert_eq!(b["choices"][0]["message"]["content"], "Answer two.");
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"],
        p1 + g1
    );
    // A different history cannot continue: cold prefill.
    let (_, c) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"Other"}]}),
        )
        .await;
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Same prompt again after a cold one: its own tokens are a prefix of nothing live (the
    // KV holds the generated answer too), so it is also cold; but a continuation is warm.
    let (_, d) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"Other"},
            {"role":"assistant","content":"Answer two."},{"role":"user","content":"x"}]}),
        )
        .await;
    assert!(
        d["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (_, m) = s.call("GET", "/metrics", None, &[]).await;
    assert!(m.contains("ds4_cache_hits_total 2"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_turn_replayed_without_reasoning_still_continues_live() {
    let s = Srv::new(|_| {});
    s.force(TOOL_OUT);
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"go"}],"tools":tools_openai()}),
        )
        .await;
    let id = v["choices"][0]["message"]["tool_calls"][0]["id"]
        .as_str()
        .unwrap();
    let p1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let g1 = v["usage"]["completion_tokens"].as_u64().unwrap();
    // No reasoning_content echoed (as Responses clients without summaries do): the KV's
    // reasoning is kept and the rest of the turn continues from it.
    s.force("ok</think>Done.");
    let (_, w) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"go"},
            {"role":"assistant","content":"Reading.","tool_calls":[{"id":id,"type":"function",
             "function":{"name":"read_file","arguments":"{}"}}]},
            {"role":"tool","tool_call_id":id,"content":"data"}],"tools":tools_openai()}),
        )
        .await;
    assert_eq!(w["choices"][0]["message"]["content"], "Done.");
    // The closing tag's last token was never evaluated (generation stops there), so one
    // generated token is re-encoded with the new text.
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, p1 + g1 - 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_namespaced_tools_are_flattened_and_mapped_back() {
    let s = Srv::new(|_| {});
    s.force("x</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"fs.read\">\n<｜DSML｜parameter name=\"p\" string=\"true\">a</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
    let tools = json!([{"type":"namespace","name":"fs.","tools":[{"type":"function","name":"read","parameters":{}}]}]);
    let (_, v) = s
        .post("/v1/responses", json!({"input":"go","tools":tools}))
        .await;
    let call = &v["output"][0];
    assert_eq!(call["type"], "function_call", "{v}");
    assert_eq!(call["name"], "read");
    assert_eq!(call["namespace"], "fs.");
    assert_eq!(call["arguments"], r#"{"p":"a"}"#);
    // The prompt carries the flattened schema.
    let (_, c) = s
        .post(
            "/v1/messages/count_tokens",
            json!({"messages":[{"role":"user","content":"go"}]}),
        )
        .await;
    assert!(
        v["usage"]["input_tokens"].as_u64().unwrap() > c["input_tokens"].as_u64().unwrap() + 100
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_for_chat_and_completions() {
    let s = Srv::new(|_| {});
    let req = json!({"messages":[{"role":"user","content":"Hi"}],"think":false,"temperature":0,
        "max_tokens":4,"logprobs":true,"top_logprobs":3});
    let (_, v) = s.post("/v1/chat/completions", req.clone()).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    let mut text = Vec::new();
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the best alternative; log-probs are sorted and ≤ 0.
        assert_eq!(t["bytes"], top[0]["bytes"]);
        assert_eq!(t["logprob"], top[0]["logprob"]);
        let lps: Vec<f64> = top.iter().map(|x| x["logprob"].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0,
            "{lps:?}"
        );
        text.extend(
            t["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&text),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // Streamed: the same tokens in logprobs chunks.
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let d = datas(&s.stream("/v1/chat/completions", sreq).await);
    let streamed: Vec<&Value> = d
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].get(0))
        .collect();
    assert_eq!(streamed.len(), 4);
    assert_eq!(streamed[0]["logprob"], content[0]["logprob"]);
    // Not requested: absent.
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages":[{"role":"user","content":"Hi"}],"max_tokens":1}),
        )
        .await;
    assert!(v["choices"][0].get("logprobs").is_none());
    // Legacy completions.
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt":"Hi","max_tokens":3,"logprobs":2,"think":false,"temperature":0}),
        )
        .await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_file_logs_each_request() {
    let path = model().with_file_name("trace-test.txt");
    let trace = Arc::new(ds4_server::worker::Trace::create(&path).unwrap());
    let s = Srv::new(|c| c.trace = Some(trace));
    s.force("hm</think>Traced answer.");
    s.post(
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"trace me"}]}),
    )
    .await;
    s.post(
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"trace me"},
        {"role":"assistant","content":"Traced answer."},{"role":"user","content":"again"}]}),
    )
    .await;
    let t = std::fs::read_to_string(&path).unwrap();
    assert!(
        t.contains("===== request 1 ") && t.contains("===== end request 2 ====="),
        "{t}"
    );
    assert!(t.contains("\"content\":\"trace me\"")); // raw JSON
    assert!(t.contains("<｜User｜>trace me<｜Assistant｜><think>")); // rendered prompt
    assert!(t.contains("content: Traced answer."));
    assert!(t.contains("cache_source: none"));
    assert!(t.contains("cache_source: thinking-visible"));
}

#[test]
fn a_client_that_stops_reading_is_cancelled_after_the_stall_timeout() {
    use ds4_server::worker::{spawn_worker, GenEvent, GenJob};
    let engine = Engine::open(&EngineOptions::new(model())).unwrap();
    let force = model().with_file_name("force-stall.txt");
    let text = "word ".repeat(3000);
    std::fs::write(&force, &text).unwrap();
    let tok = engine.tokenizer().clone();
    let forced_len = tok.encode_with_chat_specials(&text).len();
    let metrics = Arc::new(ds4_server::Metrics::default());
    let sched = spawn_worker(engine, 8192, ForceOutput(Some(force)), metrics.clone());
    let job = |tx, cancel, max_tokens| GenJob {
        prompt_text: "<｜begin▁of▁sentence｜>hi".into(),
        prompt_tokens: tok.encode_with_chat_specials("<｜begin▁of▁sentence｜>hi"),
        max_tokens,
        sampler: Default::default(),
        stop: vec![],
        parse: ds4_chat::ParseOptions {
            thinking: false,
            detect_tools: false,
        },
        logprobs: None,
        cancel,
        events: tx,
        enqueued: Instant::now(),
        stall: Duration::from_millis(100),
        trace: None,
    };
    // Nobody reads `_rx`: the queue fills, the worker waits 100 ms, then gives up.
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t = Instant::now();
    sched.submit(job(tx, cancel.clone(), 6000)).unwrap();
    // A second job queued behind it still runs.
    let (tx2, mut rx2) = tokio::sync::mpsc::channel(100_000);
    sched
        .submit(job(tx2, Arc::new(Default::default()), 50))
        .unwrap();
    let mut done = false;
    while let Some(ev) = rx2.blocking_recv() {
        if let GenEvent::Done(r) = ev {
            assert_eq!(r.completion_tokens, forced_len.min(50));
            done = true;
            break;
        }
    }
    assert!(done);
    assert!(cancel.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(metrics.cancelled.get(), 1);
    assert!(t.elapsed() < Duration::from_secs(60));
}
