//! `ds4 serve`: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) and
//! Anthropic (`/v1/messages`, `/v1/messages/count_tokens`) compatible HTTP server, plus
//! `/v1/models`, `/health` and Prometheus `/metrics` (interfaces.md §1).
//!
//! Shape: axum handlers parse, render and tokenise on the tokio pool; generation runs on one
//! worker thread ([`worker`]) fed by a FIFO queue; events come back over a channel and are
//! written as JSON or SSE by [`output`]. A dropped response (client gone) sets the job's
//! cancel flag, which the worker checks every token and every prefill step.

pub mod error;
pub mod metrics;
pub mod output;
pub mod request;
pub mod worker;
mod writer;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ds4_chat::{DsmlReplay, ParseOptions, ThinkMode};
use ds4_engine::{Engine, SamplerConfig};
use ds4_tokenizer::Tokenizer;
use error::{ApiError, Proto};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use output::{Ctx, Writer};
use request::{Kind, Prepared};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{channel, Receiver};
use worker::{ForceOutput, GenEvent, GenJob, GenResult, Scheduler};

pub use metrics::Metrics;

/// Server settings (the `ds4 serve` flags).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Session context in tokens.
    pub ctx: usize,
    /// Default max output tokens when a request gives none.
    pub default_max_tokens: usize,
    /// Required key (Bearer or `x-api-key`); `None` = no auth.
    pub api_key: Option<String>,
    pub cors: bool,
    /// Largest accepted request body.
    pub max_body: usize,
    /// Largest accepted JSON nesting depth.
    pub max_json_depth: usize,
    /// Time allowed for reading a request body.
    pub read_timeout: Duration,
    /// Interval of `: keep-alive` SSE comments while a stream is otherwise silent.
    pub keepalive: Duration,
    /// Exact-replay map size (tool-call ids).
    pub tool_memory_max_ids: usize,
    /// Test-only forced output file (hidden flag).
    pub force_output: ForceOutput,
    /// `--trace FILE`: log every request in full.
    pub trace: Option<Arc<worker::Trace>>,
    /// Open connections at most; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// A streaming client that reads nothing for this long (its event queue full) has its
    /// generation cancelled.
    pub stall_timeout: Duration,
    /// `--kv-disk-dir` and friends: the disk KV cache; `None` = off.
    pub kv_disk: Option<KvDiskConfig>,
    /// `--kv-mem-mb`: memory for live sessions, each counted at
    /// `Engine::memory_estimate(ctx)` (its size at a full context). `None`: room for
    /// [`DEFAULT_LIVE_SESSIONS`], fewer as [`default_live_sessions`] and, on a GPU,
    /// [`device_live_sessions`] allow. At least one session is always kept.
    pub kv_mem_bytes: Option<u64>,
}

/// Live sessions kept at most when `--kv-mem-mb` is not given.
pub const DEFAULT_LIVE_SESSIONS: usize = 4;

/// Live sessions kept without `--kv-mem-mb`: [`DEFAULT_LIVE_SESSIONS`], fewer when they would
/// take more than a quarter of the memory available at start (`available`, when known);
/// always at least one.
pub fn default_live_sessions(per_session: u64, available: Option<u64>) -> usize {
    let fit = available.map_or(u64::MAX, |a| a / 4 / per_session.max(1));
    fit.clamp(1, DEFAULT_LIVE_SESSIONS as u64) as usize
}

/// Live sessions a GPU holds without `--kv-mem-mb`: as many of `per_session` (its session
/// state at the full context) as fit half the device memory `free` at start, the other half
/// kept for what the first prompts add (the bf16 weight copies, ~11.6 GiB for q2, and the
/// prompt's scratch, ~6 GiB); at most [`DEFAULT_LIVE_SESSIONS`], at least one.
pub fn device_live_sessions(per_session: u64, free: u64) -> usize {
    (free / 2 / per_session.max(1)).clamp(1, DEFAULT_LIVE_SESSIONS as u64) as usize
}

use ds4_engine::mem_available;

/// The disk KV cache settings (interfaces.md §5.3).
#[derive(Clone, Debug)]
pub struct KvDiskConfig {
    pub dir: std::path::PathBuf,
    /// Budget for the `*.kv` files.
    pub space_bytes: u64,
    pub policy: ds4_kvstore::Policy,
}

/// Worker → handler events buffered per request (memory bound for clients that stall).
pub const EVENT_QUEUE: usize = 512;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            ctx: 32768,
            default_max_tokens: 393_216,
            api_key: None,
            cors: false,
            max_body: 16 << 20,
            max_json_depth: 128,
            read_timeout: Duration::from_secs(30),
            keepalive: Duration::from_secs(5),
            tool_memory_max_ids: 100_000,
            force_output: ForceOutput::default(),
            trace: None,
            max_connections: 512,
            stall_timeout: Duration::from_secs(20),
            kv_disk: None,
            kv_mem_bytes: None,
        }
    }
}

/// Bounded exact-replay map (interfaces.md §3.5): tool-call id → the raw DSML block the
/// model sampled for it; oldest ids are forgotten first.
#[derive(Default)]
pub struct ReplayStore {
    ids: HashMap<String, Arc<str>>,
    order: VecDeque<String>,
    max: usize,
}

impl ReplayStore {
    pub fn new(max: usize) -> Self {
        ReplayStore {
            max,
            ..Default::default()
        }
    }
    pub fn remember(&mut self, ids: &[String], block: &str) {
        let b: Arc<str> = Arc::from(block);
        for id in ids {
            if self.ids.insert(id.clone(), b.clone()).is_none() {
                self.order.push_back(id.clone());
            }
        }
        self.trim();
    }

    fn trim(&mut self) {
        while self.ids.len() > self.max {
            match self.order.pop_front() {
                Some(old) => {
                    self.ids.remove(&old);
                }
                None => break,
            }
        }
    }
}

/// Tool-id map stored in a disk checkpoint's extra bytes (interfaces.md §5.5): `"KTM"`,
/// version 1, u32 entry count, then per entry u32 id length (1–256), u32 DSML length, id
/// bytes, DSML bytes (all little-endian). Only blocks that occur in the checkpoint's key.
const TOOL_MAP_MAGIC: &[u8; 3] = b"KTM";
const TOOL_MAP_VERSION: u8 = 1;
const TOOL_ID_MAX: usize = 256;
/// Bounds of one checkpoint's map when written: entries and id+DSML bytes.
const TOOL_MAP_MAX_ENTRIES: usize = 4096;
const TOOL_MAP_MAX_BYTES: usize = 16 << 20;

impl ReplayStore {
    /// The encoded tool-id map of the remembered blocks that occur in `key` (a checkpoint's
    /// rendered key), newest ids first, bounded by [`TOOL_MAP_MAX_ENTRIES`] /
    /// [`TOOL_MAP_MAX_BYTES`]; empty when none occurs. Each distinct block is searched
    /// for once (blocks are shared by the ids of one turn).
    pub fn encode_for(&self, key: &[u8]) -> Vec<u8> {
        let key = String::from_utf8_lossy(key);
        let mut found: HashMap<*const u8, bool> = HashMap::new();
        let (mut body, mut n, mut bytes) = (Vec::new(), 0u32, 0usize);
        for id in self.order.iter().rev() {
            let Some(b) = self.ids.get(id) else { continue };
            if id.is_empty() || id.len() > TOOL_ID_MAX {
                continue;
            }
            let hit = *found
                .entry(b.as_ptr())
                .or_insert_with(|| key.contains(&**b));
            if !hit {
                continue;
            }
            if n as usize == TOOL_MAP_MAX_ENTRIES || bytes + id.len() + b.len() > TOOL_MAP_MAX_BYTES
            {
                break;
            }
            body.extend_from_slice(&(id.len() as u32).to_le_bytes());
            body.extend_from_slice(&(b.len() as u32).to_le_bytes());
            body.extend_from_slice(id.as_bytes());
            body.extend_from_slice(b.as_bytes());
            n += 1;
            bytes += id.len() + b.len();
        }
        if n == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(8 + body.len());
        out.extend_from_slice(TOOL_MAP_MAGIC);
        out.push(TOOL_MAP_VERSION);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Loads a checkpoint's tool-id map (from [`ReplayStore::encode_for`]) whose file key is
    /// `key`. The extra bytes are not covered by a checksum the loader verifies, so each
    /// block must occur verbatim in the (verified) key; the whole map is rejected otherwise.
    /// Ids already known keep their block. Returns how many ids were added.
    pub fn load_map(&mut self, key: &[u8], map: &[u8]) -> Result<usize, String> {
        let u32_at = |at: usize, what: &str| -> Result<usize, String> {
            map.get(at..at + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
                .ok_or_else(|| format!("tool map truncated in the {what} at byte {at}"))
        };
        if map.len() < 8 || &map[..3] != TOOL_MAP_MAGIC {
            return Err("not a tool map (no \"KTM\" magic)".into());
        }
        if map[3] != TOOL_MAP_VERSION {
            return Err(format!(
                "tool map version {} (expected {TOOL_MAP_VERSION})",
                map[3]
            ));
        }
        let n = u32_at(4, "entry count")?;
        let limit = 4 * self.max.max(1);
        if n > limit {
            return Err(format!("tool map of {n} entries exceeds {limit}"));
        }
        let key = String::from_utf8_lossy(key);
        let mut entries = Vec::with_capacity(n.min(TOOL_MAP_MAX_ENTRIES));
        let mut at = 8;
        for i in 0..n {
            let il = u32_at(at, "id length")?;
            let bl = u32_at(at + 4, "DSML length")?;
            if il == 0 || il > TOOL_ID_MAX {
                return Err(format!("tool map entry {i}: id length {il} at byte {at}"));
            }
            let (s, e) = (at + 8, at + 8 + il + bl);
            let (Some(id), Some(block)) = (map.get(s..s + il), map.get(s + il..e)) else {
                return Err(format!("tool map entry {i} truncated at byte {at}"));
            };
            let (Ok(id), Ok(block)) = (std::str::from_utf8(id), std::str::from_utf8(block)) else {
                return Err(format!("tool map entry {i} at byte {at} is not UTF-8"));
            };
            if block.is_empty() || !key.contains(block) {
                return Err(format!(
                    "tool map entry {i}: its DSML block is not in the entry's key"
                ));
            }
            entries.push((id.to_string(), block));
            at = e;
        }
        if at != map.len() {
            return Err(format!(
                "tool map has {} trailing bytes at byte {at}",
                map.len() - at
            ));
        }
        // Oldest first so that the newest ids are the last forgotten.
        // Ids of one turn share one stored block.
        let mut shared: HashMap<&str, Arc<str>> = HashMap::new();
        let mut added = 0;
        for (id, block) in entries.into_iter().rev() {
            if !self.ids.contains_key(&id) {
                let b = shared
                    .entry(block)
                    .or_insert_with(|| Arc::from(block))
                    .clone();
                self.ids.insert(id.clone(), b);
                self.order.push_back(id);
                added += 1;
            }
        }
        self.trim();
        Ok(added)
    }
}

impl DsmlReplay for ReplayStore {
    fn replay_block(&self, ids: &[&str]) -> Option<Arc<str>> {
        let (first, rest) = ids.split_first()?;
        let b = self.ids.get(*first)?;
        rest.iter()
            .all(|id| self.ids.get(*id).is_some_and(|x| **x == **b))
            .then(|| b.clone())
    }
}

/// What exists once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub scheduler: Scheduler,
}

pub struct AppState {
    pub cfg: ServerConfig,
    pub metrics: Arc<Metrics>,
    ready: OnceLock<Ready>,
    load_error: OnceLock<String>,
    started: Instant,
    /// Shared with the worker, which writes it into disk checkpoints.
    replay: Arc<Mutex<ReplayStore>>,
    counter: AtomicU64,
}

impl AppState {
    pub fn new(cfg: ServerConfig) -> Arc<AppState> {
        Arc::new(AppState {
            replay: Arc::new(Mutex::new(ReplayStore::new(cfg.tool_memory_max_ids))),
            cfg,
            metrics: Arc::new(Metrics::default()),
            ready: OnceLock::new(),
            load_error: OnceLock::new(),
            started: Instant::now(),
            counter: AtomicU64::new(0),
        })
    }

    /// Installs an opened engine: opens the disk KV cache (if configured), starts the
    /// worker; requests are served from now on. A disk cache that cannot be opened is a load
    /// error (`/health` reports it).
    pub fn set_engine(&self, engine: Engine) {
        let tokenizer = engine.tokenizer().clone();
        let disk = match &self.cfg.kv_disk {
            None => None,
            Some(k) => match ds4_kvstore::KvStore::open(&k.dir, k.space_bytes, engine.model_id()) {
                Ok(store) => {
                    self.load_tool_maps(&store);
                    Some(worker::DiskCache {
                        store,
                        policy: k.policy.clone(),
                        replay: self.replay.clone(),
                    })
                }
                Err(e) => {
                    eprintln!("ds4 serve: error: --kv-disk-dir: {e}");
                    self.set_load_error(format!("--kv-disk-dir: {e}"));
                    return;
                }
            },
        };
        let per = engine.memory_estimate(self.cfg.ctx).max(1);
        // On a GPU the sessions live in device memory: (a session's bytes there, free bytes).
        let gpu = match (engine.gpu_state_estimate(self.cfg.ctx), engine.gpu_memory()) {
            (Some(dev), Some((free, _))) => Some((dev, free)),
            _ => None,
        };
        let max_sessions = match self.cfg.kv_mem_bytes {
            Some(b) => (b / per).max(1) as usize,
            None => {
                let host = default_live_sessions(per, mem_available());
                gpu.map_or(host, |(dev, free)| {
                    host.min(device_live_sessions(dev, free))
                })
            }
        };
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprintln!(
            "ds4 serve: up to {max_sessions} live sessions of {:.1} MiB each{} (--kv-mem-mb){}",
            mib(per),
            match gpu {
                Some((d, free)) => format!(
                    " ({:.1} MiB on the GPU, {:.1} MiB free there)",
                    mib(d),
                    mib(free)
                ),
                _ => String::new(),
            },
            match &self.cfg.kv_disk {
                Some(k) => format!(
                    "; disk KV cache in {} ({} MiB)",
                    k.dir.display(),
                    k.space_bytes >> 20
                ),
                None => String::new(),
            }
        );
        let wc = worker::WorkerConfig {
            ctx: self.cfg.ctx,
            force: self.cfg.force_output.clone(),
            max_sessions,
            disk,
        };
        let scheduler = worker::spawn_worker_with(engine, wc, self.metrics.clone());
        let _ = self.ready.set(Ready {
            tokenizer,
            scheduler,
        });
    }

    /// Records that loading failed (`/health` reports it).
    pub fn set_load_error(&self, e: String) {
        let _ = self.load_error.set(e);
    }

    fn ready(&self, proto: Proto) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(|| {
            let msg = match self.load_error.get() {
                Some(e) => format!("model failed to load: {e}"),
                None => "model is loading; retry shortly".into(),
            };
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg).proto(proto)
        })
    }

    /// Clean shutdown of the worker: stops generation and writes the live sessions to the
    /// disk cache (reason `shutdown`). Returns when done; a no-op before the model loaded.
    pub fn shutdown(&self) {
        if let Some(r) = self.ready.get() {
            r.scheduler.shutdown();
        }
    }

    /// Returns once every disk KV cache checkpoint stored by the jobs queued so far is written
    /// (the worker writes them on a background thread); a no-op before the model loaded.
    pub fn wait_disk_writes(&self) {
        if let Some(r) = self.ready.get() {
            r.scheduler.wait_disk_writes();
        }
    }

    /// Restores the exact-replay map from the tool-id maps of the cache's entries (once, at
    /// startup: later checkpoints are written from this process's map). A map that does not
    /// decode is ignored with one log line.
    fn load_tool_maps(&self, store: &ds4_kvstore::KvStore) {
        let (mut files, mut ids) = (0, 0);
        for (key, extra) in store.extras() {
            match self.replay().load_map(&key, &extra) {
                Ok(n) => {
                    files += 1;
                    ids += n;
                }
                Err(e) => eprintln!(
                    "ds4 serve: kv cache: ignoring the tool map of {}: {e}",
                    store.path_for(&key).display()
                ),
            }
        }
        if files > 0 {
            eprintln!("ds4 serve: kv cache: restored {ids} tool-call ids from {files} entries");
        }
    }

    fn replay(&self) -> std::sync::MutexGuard<'_, ReplayStore> {
        self.replay.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Opens the engine on a blocking thread and installs it (the server answers `/health`
/// with `loading` meanwhile).
pub fn load_in_background(
    state: Arc<AppState>,
    open: impl FnOnce() -> Result<Engine, String> + Send + 'static,
) {
    std::thread::spawn(move || match open() {
        Ok(e) => state.set_engine(e),
        Err(e) => state.set_load_error(e),
    });
}

pub fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut body = v.to_string();
    body.push('\n');
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router with every endpoint and the security layers.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/health", get(health))
        .route("/metrics", get(metrics_handler))
        .fallback(|req: Request| async move {
            let p = proto_of(req.uri().path());
            ApiError::new(StatusCode::NOT_FOUND, "unknown endpoint")
                .proto(p)
                .into_response()
        })
        .method_not_allowed_fallback(|req: Request| async move {
            let p = proto_of(req.uri().path());
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
                .proto(p)
                .into_response()
        })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

fn proto_of(path: &str) -> Proto {
    if path.starts_with("/v1/messages") {
        Proto::Anthropic
    } else {
        Proto::OpenAi
    }
}

/// Outer layer: OPTIONS, API key, CORS headers, error/in-flight metrics.
async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    // hyper bounds its read buffer (~400 KB); this is the documented, tighter limit.
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    let mut resp = if header_bytes > MAX_HEADER_BYTES {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("request headers exceed {MAX_HEADER_BYTES} bytes"),
        )
        .proto(proto_of(req.uri().path()))
        .into_response()
    } else if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else if let Some(e) = check_key(&st, &req) {
        e.into_response()
    } else {
        st.metrics.in_flight.inc();
        let r = next.run(req).await;
        st.metrics.in_flight.dec();
        r
    };
    if resp.status().is_client_error() || resp.status().is_server_error() {
        st.metrics.errors.inc();
    }
    if st.cfg.cors {
        let h = resp.headers_mut();
        h.insert("access-control-allow-origin", HeaderValue::from_static("*"));
        h.insert(
            "access-control-allow-methods",
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            "access-control-allow-headers",
            HeaderValue::from_static("*"),
        );
    }
    resp
}

/// `--api-key`: `Authorization: Bearer KEY` or `x-api-key: KEY`, constant-time compare.
/// `/health` stays open for probes.
fn check_key(st: &AppState, req: &Request) -> Option<ApiError> {
    let key = st.cfg.api_key.as_ref()?;
    if req.uri().path() == "/health" {
        return None;
    }
    let h = req.headers();
    let given = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
    let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
    (!ok).then(|| {
        ApiError::new(StatusCode::UNAUTHORIZED, "invalid or missing API key")
            .proto(proto_of(req.uri().path()))
    })
}

/// Reads the body with the size limit and read timeout; a declared length over the limit
/// is refused before reading anything (413).
async fn read_body(st: &AppState, req: Request, proto: Proto) -> Result<Bytes, ApiError> {
    let max = st.cfg.max_body;
    let too_big = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds the limit of {max} bytes"),
        )
        .proto(proto)
    };
    if let Some(n) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if n > max as u64 {
            return Err(too_big());
        }
    }
    let body = http_body_util::Limited::new(req.into_body(), max);
    match tokio::time::timeout(st.cfg.read_timeout, body.collect()).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timed out reading the request body",
        )
        .proto(proto)),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_big()),
        Ok(Err(e)) => Err(ApiError::bad(format!("bad HTTP request: {e}")).proto(proto)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// Nesting depth of a JSON text (arrays/objects outside strings), stopping past `max`.
fn json_depth_exceeds(b: &[u8], max: usize) -> bool {
    let (mut d, mut in_str, mut esc) = (0usize, false, false);
    for &c in b {
        if in_str {
            if esc {
                esc = false;
            } else if c == b'\\' {
                esc = true;
            } else if c == b'"' {
                in_str = false;
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'[' | b'{' => {
                d += 1;
                if d > max {
                    return true;
                }
            }
            b']' | b'}' => d = d.saturating_sub(1),
            _ => {}
        }
    }
    false
}

fn parse_json(st: &AppState, b: &[u8], proto: Proto) -> Result<Value, ApiError> {
    if json_depth_exceeds(b, st.cfg.max_json_depth) {
        return Err(ApiError::bad(format!(
            "invalid JSON request: nesting deeper than {} levels",
            st.cfg.max_json_depth
        ))
        .proto(proto));
    }
    serde_json::from_slice(b).map_err(|e| {
        ApiError::bad(format!(
            "invalid JSON request: {e} (line {}, column {})",
            e.line(),
            e.column()
        ))
        .proto(proto)
    })
}

/// Cancels the job when dropped (the response finished or the client went away).
struct CancelOnDrop(Arc<AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

struct Running {
    rx: Receiver<GenEvent>,
    cancel: CancelOnDrop,
}

fn sampler_for(p: &Prepared) -> SamplerConfig {
    let seed = match p.params.seed {
        Some(s) if s > 0 => s as u64,
        _ => rand::random(),
    };
    if p.think != ThinkMode::None {
        // Thinking overrides the client's sampling knobs (§1.3); the seed is kept.
        return SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.05,
            seed,
        };
    }
    SamplerConfig {
        temperature: p.params.temperature.unwrap_or(1.0),
        top_k: p.params.top_k.unwrap_or(0).min(1024),
        top_p: p.params.top_p.unwrap_or(1.0),
        min_p: p.params.min_p.unwrap_or(0.05),
        seed,
    }
}

/// Tokenises, checks the context, queues the job.
fn endpoint_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Chat => "chat_completions",
        Kind::Completion => "completions",
        Kind::Messages => "messages",
        Kind::Responses => "responses",
    }
}

async fn start(
    st: &Arc<AppState>,
    p: &Prepared,
    trace: Option<worker::TraceJob>,
) -> Result<Running, ApiError> {
    let proto = p.kind.proto();
    let ready = st.ready(proto)?;
    let tok = ready.tokenizer.clone();
    let text = p.prompt_text.clone();
    let tokens = tokio::task::spawn_blocking(move || tok.encode_with_chat_specials(&text))
        .await
        .map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).proto(proto)
        })?;
    let ctx = st.cfg.ctx;
    if tokens.len() >= ctx {
        return Err(
            ApiError::context_length(tokens.len(), ctx, p.kind.prompt_param()).proto(proto),
        );
    }
    let room = ctx - tokens.len();
    let max_tokens = p
        .params
        .max_tokens
        .unwrap_or(st.cfg.default_max_tokens)
        .min(room);
    let (tx, rx) = channel(EVENT_QUEUE);
    let cancel = Arc::new(AtomicBool::new(false));
    let job = GenJob {
        prompt_text: p.prompt_text.clone(),
        prompt_tokens: tokens,
        max_tokens,
        sampler: sampler_for(p),
        stop: p.params.stop.clone(),
        logprobs: p.params.logprobs,
        parse: ParseOptions {
            thinking: p.kind != Kind::Completion && p.think.thinking(),
            detect_tools: p.detect_tools,
        },
        cancel: cancel.clone(),
        events: tx,
        enqueued: Instant::now(),
        stall: st.cfg.stall_timeout,
        trace,
    };
    ready
        .scheduler
        .submit(job)
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e).proto(proto))?;
    Ok(Running {
        rx,
        cancel: CancelOnDrop(cancel),
    })
}

fn ctx_for(st: &AppState, p: &Prepared) -> Ctx {
    let n = st.counter.fetch_add(1, Ordering::Relaxed) + 1;
    let id = match p.kind {
        Kind::Completion => format!("cmpl-{n}"),
        Kind::Responses => output::rand_id("resp_", 12),
        _ => format!("chatcmpl-{n}"),
    };
    Ctx {
        id,
        model: p.model.clone(),
        created: now(),
        include_usage: p.params.include_usage,
        summary: p.summary,
        namespaces: p.namespaces.clone(),
        call_prefix: if p.kind == Kind::Messages {
            "toolu_"
        } else {
            "call_"
        },
    }
}

fn remember(st: &AppState, ids: &[String], r: &GenResult) {
    if let Some(block) = &r.parsed.raw_dsml {
        let n = r.parsed.tool_calls.len().min(ids.len());
        if n > 0 {
            st.replay().remember(&ids[..n], block);
        }
    }
}

/// Parses and renders on a blocking thread (rendering is linear but prompts can be large).
async fn prepare(
    st: &Arc<AppState>,
    req: Request,
    kind: Kind,
) -> Result<(Prepared, Bytes), ApiError> {
    let proto = kind.proto();
    let body = read_body(st, req, proto).await?;
    let st2 = st.clone();
    let body2 = body.clone();
    tokio::task::spawn_blocking(move || {
        let v = parse_json(&st2, &body, proto)?;
        let ctx = st2.cfg.ctx;
        let replay = st2.replay();
        let p = match kind {
            Kind::Chat => request::chat(&v, &body, ctx, &*replay),
            Kind::Completion => request::completion(&v, ctx),
            Kind::Messages => request::messages(&v, &body, ctx, &*replay),
            Kind::Responses => request::responses(&v, &body, ctx, &*replay),
        };
        p.map_err(|e| e.proto(proto))
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).proto(proto))?
    .map(|p| (p, body2))
}

async fn generate(st: Arc<AppState>, req: Request, kind: Kind, endpoint: &str) -> Response {
    st.metrics.request(endpoint);
    let proto = kind.proto();
    let (p, body) = match prepare(&st, req, kind).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let trace = st.cfg.trace.as_ref().map(|t| worker::TraceJob {
        trace: t.clone(),
        kind: endpoint_name(kind),
        raw_json: String::from_utf8_lossy(&body).into_owned(),
    });
    let run = match start(&st, &p, trace).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let c = ctx_for(&st, &p);
    if p.params.stream {
        let w: Box<dyn Writer> = match kind {
            Kind::Chat => Box::new(output::ChatWriter::new(c)),
            Kind::Completion => Box::new(output::CompletionWriter { c, lp_offset: 0 }),
            Kind::Messages => Box::new(output::MessagesWriter::new(c)),
            Kind::Responses => Box::new(output::ResponsesWriter::new(c)),
        };
        return sse_response(st, run, w);
    }
    let mut run = run;
    let mut logprobs = Vec::new();
    let r = loop {
        match run.rx.recv().await {
            Some(GenEvent::Done(r)) => break r,
            Some(GenEvent::Logprob(lp)) => logprobs.push(lp),
            Some(GenEvent::Failed(m)) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m)
                    .proto(proto)
                    .into_response()
            }
            Some(_) => {}
            None => {
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "generation worker stopped",
                )
                .proto(proto)
                .into_response()
            }
        }
    };
    let mut ids = output::Ids::default();
    let lp = p.params.logprobs.is_some().then_some(&logprobs[..]);
    let body = match kind {
        Kind::Chat => output::chat_body(&c, &r, &mut ids, lp),
        Kind::Completion => output::completion_body(&c, &r, lp),
        Kind::Messages => output::messages_body(&c, &r, &mut ids),
        Kind::Responses => {
            output::responses_body(&c, &r, &mut ids, &mut output::RespIds::default())
        }
    };
    remember(&st, &ids.0, &r);
    drop(run.cancel);
    json_response(StatusCode::OK, &body)
}

/// Streams worker events as SSE. Comments (`: keep-alive`) go out whenever nothing else was
/// sent for `keepalive` (wall clock, so long prefills and silent decodes never hit client
/// idle timeouts). Dropping the body (client gone) drops the cancel guard.
fn sse_response(st: Arc<AppState>, run: Running, w: Box<dyn Writer>) -> Response {
    struct S {
        st: Arc<AppState>,
        run: Running,
        w: Box<dyn Writer>,
        queue: VecDeque<Bytes>,
        finished: bool,
    }
    let ka = st.cfg.keepalive;
    let s = S {
        st,
        run,
        w,
        queue: VecDeque::new(),
        finished: false,
    };
    let stream = futures_util::stream::unfold(s, move |mut s| async move {
        loop {
            if let Some(b) = s.queue.pop_front() {
                return Some((Ok::<Bytes, std::io::Error>(b), s));
            }
            if s.finished {
                return None;
            }
            match tokio::time::timeout(ka, s.run.rx.recv()).await {
                Err(_) => return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), s)),
                Ok(None) => {
                    s.queue.extend(s.w.failed("generation worker stopped"));
                    s.finished = true;
                }
                Ok(Some(ev)) => match ev {
                    GenEvent::Prefill { .. } => {}
                    GenEvent::Logprob(lp) => s.queue.extend(s.w.logprob(&lp)),
                    GenEvent::Started {
                        prompt_tokens,
                        cached_tokens,
                    } => s.queue.extend(s.w.started(prompt_tokens, cached_tokens)),
                    GenEvent::Stream(evs) => s.queue.extend(s.w.events(&evs)),
                    GenEvent::Done(r) => {
                        s.queue.extend(s.w.done(&r));
                        remember(&s.st, s.w.ids(), &r);
                        s.finished = true;
                    }
                    GenEvent::Failed(m) => {
                        s.queue.extend(s.w.failed(&m));
                        s.finished = true;
                    }
                },
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream.boxed()))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    generate(st, req, Kind::Chat, "chat_completions").await
}
async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    generate(st, req, Kind::Completion, "completions").await
}
async fn responses(State(st): State<Arc<AppState>>, req: Request) -> Response {
    generate(st, req, Kind::Responses, "responses").await
}
async fn messages(State(st): State<Arc<AppState>>, req: Request) -> Response {
    generate(st, req, Kind::Messages, "messages").await
}

/// Anthropic `count_tokens`: the rendered prompt's token count.
async fn count_tokens(State(st): State<Arc<AppState>>, req: Request) -> Response {
    st.metrics.request("count_tokens");
    let r = async {
        let (p, _) = prepare(&st, req, Kind::Messages).await?;
        let tok = st.ready(Proto::Anthropic)?.tokenizer.clone();
        let n = tokio::task::spawn_blocking(move || {
            tok.encode_with_chat_specials(&p.prompt_text).len()
        })
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        Ok::<_, ApiError>(json!({ "input_tokens": n }))
    }
    .await;
    match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.proto(Proto::Anthropic).into_response(),
    }
}

fn model_object(st: &AppState) -> Value {
    let ctx = st.cfg.ctx;
    json!({"id": request::DEFAULT_MODEL, "object": "model", "created": 1767225600u64,
        "owned_by": "ds4", "name": "DeepSeek V4 Flash", "context_length": ctx,
        "top_provider": {"context_length": ctx,
            "max_completion_tokens": st.cfg.default_max_tokens.min(ctx), "is_moderated": false},
        "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature", "top_p",
            "top_k", "min_p", "stop", "seed", "stream", "reasoning_effort"]})
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("models");
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [model_object(&st)]}),
    )
}

async fn model_one(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    st.metrics.request("models");
    if id == request::DEFAULT_MODEL {
        json_response(StatusCode::OK, &model_object(&st))
    } else {
        ApiError::new(StatusCode::NOT_FOUND, format!("unknown model {id:?}")).into_response()
    }
}

/// `GET /health`: 200 `ready`, or 503 `loading` (with seconds elapsed) / `error`.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("health");
    let m = &st.metrics;
    if st.ready.get().is_some() {
        json_response(
            StatusCode::OK,
            &json!({"status": "ready", "progress": 1.0, "queue_depth": m.queue_depth.get(),
                    "busy": m.busy.get() == 1, "ctx": st.cfg.ctx}),
        )
    } else if let Some(e) = st.load_error.get() {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "error", "error": e}),
        )
    } else {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "loading", "progress": 0.0,
                    "elapsed_seconds": st.started.elapsed().as_secs_f64()}),
        )
    }
}

async fn metrics_handler(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("metrics");
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(st.ready.get().is_some()),
    )
        .into_response()
}

/// Largest request header block (bytes).
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// Accept loop: HTTP/1.1 with a header size limit and a header read timeout. Runs until
/// `shutdown` resolves; then stops accepting (in-flight connections finish on their own).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let app = router(state.clone());
    let header_timeout = state.cfg.read_timeout;
    let slots = Arc::new(tokio::sync::Semaphore::new(
        state.cfg.max_connections.max(1),
    ));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return Ok(()),
            },
            _ = &mut shutdown => return Ok(()),
        };
        let (sock, _peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
            },
            _ = &mut shutdown => return Ok(()),
        };
        let _ = sock.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(sock);
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, svc)
                .await;
            drop(permit);
        });
    }
}

/// Binds `addr`, loads the model in the background (`open`), and serves until Ctrl-C /
/// SIGTERM; then stops generation and writes the live sessions to the disk KV cache before
/// returning. Blocks; builds its own tokio runtime.
pub fn run_blocking(
    cfg: ServerConfig,
    addr: SocketAddr,
    open: impl FnOnce() -> Result<Engine, String> + Send + 'static,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let state = AppState::new(cfg);
    let st = state.clone();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "ds4 serve: listening on http://{} (loading the model; GET /health reports readiness)",
            listener.local_addr()?
        );
        load_in_background(st.clone(), move || {
            let t = Instant::now();
            let r = open();
            match &r {
                Ok(e) => eprintln!(
                    "ds4 serve: model ready in {:.1} s on {}",
                    t.elapsed().as_secs_f64(),
                    e.backend_name()
                ),
                Err(e) => eprintln!("ds4 serve: error: {e}"),
            }
            r
        });
        let shutdown = async {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{signal, SignalKind};
                match signal(SignalKind::terminate()) {
                    Ok(mut term) => {
                        tokio::select! {
                            _ = tokio::signal::ctrl_c() => {}
                            _ = term.recv() => {}
                        }
                    }
                    Err(_) => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("ds4 serve: shutting down");
        };
        serve(listener, st, shutdown).await
    })?;
    state.shutdown();
    eprintln!("ds4 serve: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_maps_hold_the_blocks_in_the_key_and_reject_corrupt_bytes() {
        let (a, b) = (
            "<｜DSML｜tool_calls>A</｜DSML｜tool_calls>",
            "<｜DSML｜tool_calls>B</｜DSML｜tool_calls>",
        );
        let mut r = ReplayStore::new(10);
        r.remember(&["call_1".into(), "call_2".into()], a);
        r.remember(&["call_3".into()], b);
        let key = format!("<｜User｜>x<｜Assistant｜>{a}<｜tool▁output｜>y");
        let map = r.encode_for(key.as_bytes());
        // Header, count 2 (the ids of `a`, newest first), then (4+4+6+len a) per entry.
        assert_eq!(&map[..8], b"KTM\x01\x02\0\0\0");
        assert_eq!(map.len(), 8 + 2 * (14 + a.len()));
        assert!(r.encode_for(b"no blocks here").is_empty());

        let mut fresh = ReplayStore::new(10);
        assert_eq!(fresh.load_map(key.as_bytes(), &map), Ok(2));
        assert_eq!(
            fresh.replay_block(&["call_1", "call_2"]).as_deref(),
            Some(a)
        );
        assert!(fresh.replay_block(&["call_3"]).is_none());
        // Loading again adds nothing.
        assert_eq!(fresh.load_map(key.as_bytes(), &map), Ok(0));

        // Corrupt or foreign bytes are errors, never panics.
        let mut e = ReplayStore::new(10);
        for bad in [&b"junk"[..], b"KTM\x02\x01\0\0\0", &map[..map.len() - 1]] {
            assert!(e.load_map(key.as_bytes(), bad).is_err());
        }
        let mut flipped = map.clone();
        *flipped.last_mut().unwrap() ^= 1; // the block no longer occurs in the key
        let err = e.load_map(key.as_bytes(), &flipped).unwrap_err();
        assert!(err.contains("not in the entry's key"), "{err}");
        let mut long = map.clone();
        long.push(0);
        assert!(e
            .load_map(key.as_bytes(), &long)
            .unwrap_err()
            .contains("trailing"));
        let mut huge = map.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(e
            .load_map(key.as_bytes(), &huge)
            .unwrap_err()
            .contains("exceeds"));
        for cut in 0..map.len() {
            let _ = e.load_map(key.as_bytes(), &map[..cut]);
        }
        assert!(e.replay_block(&["call_1"]).is_none());
    }

    #[test]
    fn default_live_sessions_fit_a_quarter_of_the_available_memory() {
        let gib = 1u64 << 30;
        assert_eq!(default_live_sessions(gib, None), DEFAULT_LIVE_SESSIONS);
        assert_eq!(default_live_sessions(gib, Some(64 * gib)), 4);
        assert_eq!(default_live_sessions(gib, Some(8 * gib)), 2);
        assert_eq!(default_live_sessions(gib, Some(gib)), 1);
        assert_eq!(default_live_sessions(0, Some(0)), 1);
        assert!(mem_available().is_none_or(|b| b > 0));
    }

    /// The full model on one H200 (57 GiB free after the q2 weights): two 1M-token sessions
    /// (12.15 GiB each on the GPU), four at 32k; a small card holds one whatever the context.
    #[test]
    fn device_live_sessions_fit_half_the_free_device_memory() {
        let gib = 1u64 << 30;
        // Engine::gpu_state_estimate of the full model at 1M, 256k and 32k tokens.
        let at = |g: f64| (g * gib as f64) as u64;
        assert_eq!(device_live_sessions(at(12.15), 57 * gib), 2);
        assert_eq!(device_live_sessions(at(3.1), 57 * gib), 4);
        assert_eq!(device_live_sessions(at(0.40), 57 * gib), 4);
        assert_eq!(device_live_sessions(at(12.15), 10 * gib), 1);
        assert_eq!(device_live_sessions(at(3.1), 20 * gib), 3);
        assert_eq!(device_live_sessions(0, 0), 1);
    }
}
