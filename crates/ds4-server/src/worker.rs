//! The generation worker: one OS thread owns the engine and its live session and runs
//! queued jobs in FIFO order (interfaces.md §7.1). HTTP handlers talk to it over channels:
//! a job goes in through [`Scheduler::submit`], [`GenEvent`]s come back.
//!
//! The job/event interface knows nothing of one-session-at-a-time: a batching scheduler with
//! several live sessions can replace [`run_worker`] behind the same [`Scheduler`].

use crate::metrics::Metrics;
use crate::writer::Writer;
use ds4_chat::{
    ParseOptions, ParsedOutput, SamplingState, StreamEvent, StreamParser, THINK_CLOSE, THINK_OPEN,
};
use ds4_engine::{
    log_sum_exp, top_logprobs, Drafted, Engine, Sampler, SamplerConfig, Session, SpecStats,
};
use ds4_tokenizer::{StreamDecoder, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

/// Where a prefill from `end` to `total` pauses (each piece's end, the last `total`): every
/// `step` tokens, and exactly at each of `stops` (checkpoint frontiers) inside the range. At
/// least one piece, so an empty remainder still evaluates (and yields logits).
fn prefill_pieces(mut end: usize, total: usize, step: usize, stops: &[usize]) -> Vec<usize> {
    let mut out = Vec::new();
    loop {
        let mut next = (end + step.max(1)).min(total);
        if let Some(&s) = stops.iter().find(|&&s| s > end && s < next) {
            next = s;
        }
        end = next;
        out.push(end);
        if end >= total {
            return out;
        }
    }
}

/// Fewest tokens prefilled between two cancellation checks (and progress events); a step is
/// the backend's prompt batch when larger (`Session::prefill_step`: on a GPU thousands of
/// tokens, since each batch reads every routed expert's weights once; with 128-token steps a
/// 16k-token prompt on an H100 with host-memory experts prefilled at 241 tokens/s).
const PREFILL_STEP: usize = 128;

/// Why generation ended (interfaces.md §1.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// EOS, a stop sequence, or the end of the forced text.
    Stop,
    /// `max_tokens` or the context is full.
    Length,
    /// A complete tool block was generated.
    ToolCalls,
    /// Decode failure, an unterminated tool block, cancellation or shutdown.
    Error,
}

/// One generation request, ready to run: rendered text plus its full tokenization.
pub struct GenJob {
    pub prompt_text: String,
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Stop sequences (non-empty strings).
    pub stop: Vec<String>,
    /// How to split the output (thinking, DSML detection). Completions use
    /// `{thinking:false, detect_tools:false}`: everything is raw content.
    pub parse: ParseOptions,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Set when the client is gone: the worker stops within one token / prefill step.
    pub cancel: Arc<AtomicBool>,
    /// Bounded: a client that stops reading fills it (see `stall`).
    pub events: Sender<GenEvent>,
    /// How long the worker waits on a full event channel (a client that connected but does
    /// not read) before cancelling the job, so one stuck client cannot hold the queue.
    pub stall: std::time::Duration,
    pub enqueued: Instant,
    /// `--trace`: where to log this request, with its raw JSON.
    pub trace: Option<TraceJob>,
}

/// `--trace FILE` (interfaces.md §7.5): a human-readable log of every request — raw JSON,
/// rendered prompt, cache decision, generated text, parsed message. It holds full prompts:
/// treat it as sensitive.
#[derive(Debug)]
pub struct Trace {
    file: std::sync::Mutex<std::fs::File>,
    n: std::sync::atomic::AtomicU64,
}

impl Trace {
    /// Creates (truncates) the file.
    pub fn create(path: &std::path::Path) -> std::io::Result<Trace> {
        Ok(Trace {
            file: std::sync::Mutex::new(std::fs::File::create(path)?),
            n: Default::default(),
        })
    }
}

/// One traced request.
pub struct TraceJob {
    pub trace: Arc<Trace>,
    pub kind: &'static str,
    pub raw_json: String,
}

impl TraceJob {
    fn write(
        &self,
        job: &GenJob,
        fields: &[(&str, String)],
        text: &str,
        parsed: &ParsedOutput,
        error: Option<&str>,
    ) {
        use std::fmt::Write as _;
        use std::io::Write as _;
        let n = self.trace.n.fetch_add(1, Ordering::Relaxed) + 1;
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut o = format!("===== request {n} t={secs} =====\nkind: {}\n", self.kind);
        for (k, v) in fields {
            let _ = writeln!(o, "{k}: {v}");
        }
        if let Some(e) = error {
            let _ = writeln!(o, "error: {e}");
        }
        let _ = write!(
            o,
            "--- raw request json ---\n{}\n--- rendered prompt ---\n{}\n--- generated text ---\n{text}\n--- parsed message ---\nstatus: {:?}\nreasoning: {}\ncontent: {}\n",
            self.raw_json,
            job.prompt_text,
            parsed.status,
            parsed.reasoning.as_deref().unwrap_or(""),
            parsed.content
        );
        for (i, c) in parsed.tool_calls.iter().enumerate() {
            let _ = writeln!(o, "tool_call[{i}]: {} {}", c.name, c.arguments_json);
        }
        let _ = writeln!(o, "===== end request {n} =====");
        let mut f = self.trace.file.lock().unwrap_or_else(|e| e.into_inner());
        let _ = f.write_all(o.as_bytes());
    }
}

/// What the worker reports back, in order: `Prefill`*, `Started`, `Stream`*, then `Done`
/// or `Failed`.
#[derive(Debug)]
pub enum GenEvent {
    Prefill {
        done: usize,
        total: usize,
    },
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Stream(Vec<StreamEvent>),
    /// The next generated token's log-probabilities (only when the job asked for them).
    Logprob(TokenLogprob),
    Done(Box<GenResult>),
    /// Nothing was generated (prefill failed or the job was cancelled before decoding).
    Failed(String),
}

/// One generated token with its log-probability and the most likely alternatives.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// (bytes, logprob), best first.
    pub top: Vec<(Vec<u8>, f32)>,
}

fn token_logprob(tok: &Tokenizer, logits: &[f32], t: u32, k: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let bytes = |id: u32| tok.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
    TokenLogprob {
        bytes: bytes(t),
        logprob: logits[t as usize] - lse,
        top: top_logprobs(logits, k)
            .into_iter()
            .map(|(id, lp)| (bytes(id), lp))
            .collect(),
    }
}

#[derive(Debug)]
pub struct GenResult {
    pub finish: Finish,
    pub parsed: ParsedOutput,
    /// The generated text as emitted (after stop-sequence cuts).
    pub text: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// How many of them the backend picked after its decode step ([`Session::eval_sampled`]:
    /// no logits read back); the others were picked on the host from the logits.
    pub sampled_tokens: usize,
    /// Why generation failed, for `Finish::Error`.
    pub error: Option<String>,
}

/// The disk KV cache as the worker uses it: the store and when to write checkpoints.
pub struct DiskCache {
    pub store: ds4_kvstore::KvStore,
    pub policy: ds4_kvstore::Policy,
    /// The exact-replay map: each checkpoint stores the entries whose DSML occurs in its key.
    pub replay: Arc<Mutex<crate::ReplayStore>>,
}

/// The disk cache with the worker's background writer (`writer.rs`): what the worker's
/// functions are handed.
struct Disk<'a> {
    cache: &'a Arc<DiskCache>,
    writer: &'a Writer,
}

impl std::ops::Deref for Disk<'_> {
    type Target = DiskCache;
    fn deref(&self) -> &DiskCache {
        self.cache
    }
}

/// Everything the worker needs besides the engine.
pub struct WorkerConfig {
    /// Context of every live session.
    pub ctx: usize,
    pub force: ForceOutput,
    /// Live sessions kept in memory at most (≥ 1); the least recently used one is evicted
    /// (saved to the disk cache first, when enabled) to make room for a new conversation.
    pub max_sessions: usize,
    pub disk: Option<DiskCache>,
}

enum Msg {
    Job(Box<GenJob>),
    /// Save every live session to the disk cache, then acknowledge.
    Shutdown(mpsc::Sender<()>),
    /// Acknowledge once the disk cache's writes so far are on disk.
    WaitDisk(mpsc::Sender<()>),
}

/// The handle handlers submit jobs through. Cloneable; FIFO.
#[derive(Clone)]
pub struct Scheduler {
    tx: mpsc::Sender<Msg>,
    metrics: Arc<Metrics>,
    /// Set by [`Scheduler::shutdown`]: running and queued jobs stop.
    stopping: Arc<AtomicBool>,
}

impl Scheduler {
    /// Queues a job. Fails only when the worker is gone.
    pub fn submit(&self, job: GenJob) -> Result<(), String> {
        self.metrics.queue_depth.inc();
        self.tx.send(Msg::Job(Box::new(job))).map_err(|_| {
            self.metrics.queue_depth.dec();
            "the generation worker has stopped".to_string()
        })
    }

    /// Returns once the jobs queued before this call have run and the disk KV cache
    /// checkpoints they stored are written (they are written in the background, `writer.rs`).
    pub fn wait_disk_writes(&self) {
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Msg::WaitDisk(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Clean shutdown: the running job stops at its next token, queued jobs fail, then every
    /// live session worth keeping is written to the disk cache (reason `shutdown`). Returns
    /// when that is done (or the worker is gone).
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

/// Test-only forced output (hidden `--test-force-output FILE`): when the file exists and is
/// non-empty at the start of a request, its text is tokenised and emitted instead of sampled
/// tokens — through the same decode, stop, DSML and protocol path. Re-read per request so a
/// test can change it between requests.
#[derive(Clone, Debug, Default)]
pub struct ForceOutput(pub Option<PathBuf>);

impl ForceOutput {
    fn tokens(&self, tok: &Tokenizer) -> Option<Vec<u32>> {
        let text = std::fs::read_to_string(self.0.as_ref()?).ok()?;
        (!text.is_empty()).then(|| tok.encode_with_chat_specials(&text))
    }
}

/// Starts the worker thread with one live session and no disk cache.
pub fn spawn_worker(
    engine: Engine,
    ctx: usize,
    force: ForceOutput,
    metrics: Arc<Metrics>,
) -> Scheduler {
    let cfg = WorkerConfig {
        ctx,
        force,
        max_sessions: 1,
        disk: None,
    };
    spawn_worker_with(engine, cfg, metrics)
}

/// Starts the worker thread for an opened engine; returns the scheduler that feeds it.
pub fn spawn_worker_with(engine: Engine, cfg: WorkerConfig, metrics: Arc<Metrics>) -> Scheduler {
    let (tx, rx) = mpsc::channel::<Msg>();
    let m = metrics.clone();
    let stopping = Arc::new(AtomicBool::new(false));
    let st = stopping.clone();
    std::thread::Builder::new()
        .name("ds4-worker".into())
        .spawn(move || run_worker(engine, cfg, rx, m, st))
        .expect("spawning the worker thread");
    Scheduler {
        tx,
        metrics,
        stopping,
    }
}

/// One live session plus the decoded bytes of its tokens (for rendered-text prefix reuse).
struct Live {
    session: Session,
    bytes: Vec<u8>,
    /// "thinking-visible" (interfaces.md §5.2 step 6, and ds4's Responses analogue): after a
    /// thinking turn, the live text as a client replays it *without* the reasoning — either
    /// `…<｜Assistant｜></think>` + rest (plain chat drops earlier reasoning) or
    /// `…<｜Assistant｜><think></think>` + rest (tool context, reasoning not echoed), where
    /// rest is what the KV holds after `</think>` (content, DSML). A prompt extending one
    /// of them continues from the live KV, which still holds the hidden reasoning.
    visible: Vec<String>,
    /// Token count of the last checkpoint written from this session (0: none): continued
    /// checkpoints go beyond it, and a session already on disk is not written again.
    stored: usize,
    /// Worker tick of the last job (least recently used = smallest).
    used: u64,
}

impl Live {
    fn new(session: Session) -> Live {
        Live {
            session,
            bytes: Vec::new(),
            visible: Vec::new(),
            stored: 0,
            used: 0,
        }
    }
}

/// Header flag of a checkpoint keyed by a thinking-visible transcript (interfaces.md §5.5).
const FLAG_THINKING_VISIBLE: u8 = 4;

/// Writes the session's whole state as a checkpoint: keyed by its decoded text, or, right
/// after a thinking turn, by the visible transcripts a client will replay. The state is copied
/// to host memory here (`Session::capture`); it is encoded and the file written on the disk
/// writer's thread (`writer.rs`), after the previous write has finished (one checkpoint in
/// host memory at a time: its capture, then also its bytes while they are written).
fn store(
    disk: &Disk,
    tok: &Tokenizer,
    live: &mut Live,
    reason: ds4_kvstore::Reason,
    metrics: &Arc<Metrics>,
) {
    let s = &live.session;
    let n = s.tokens().len();
    if n == 0 {
        return;
    }
    let keys: Vec<(Vec<u8>, u8)> = if live.visible.is_empty() {
        match tok.decode(s.tokens()) {
            Ok(b) => vec![(b, 0)],
            Err(e) => {
                eprintln!("ds4 serve: kv cache: not storing a session: {e}");
                return;
            }
        }
    } else {
        live.visible
            .iter()
            .map(|v| (v.as_bytes().to_vec(), FLAG_THINKING_VISIBLE))
            .collect()
    };
    disk.writer.wait_idle();
    let t = Instant::now();
    let capture = s.capture();
    let snap_ms = t.elapsed().as_secs_f64() * 1e3;
    let tokens = s.tokens().to_vec();
    let metas: Vec<(Vec<u8>, ds4_kvstore::SaveMeta)> = keys
        .into_iter()
        .map(|(key, flags)| {
            let mut meta = ds4_kvstore::SaveMeta::new(reason, s.ctx());
            meta.flags = flags;
            meta.extra = disk
                .replay
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .encode_for(&key);
            (key, meta)
        })
        .collect();
    live.stored = n;
    let (cache, metrics) = (disk.cache.clone(), metrics.clone());
    disk.writer.submit(move || {
        let t = Instant::now();
        let snap = capture.encode();
        drop(capture);
        let enc_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        for (key, meta) in metas {
            match cache.store.save(&key, &tokens, &snap, &meta) {
                Ok(ds4_kvstore::Saved::Written { bytes, evicted, .. }) => {
                    metrics.kv_disk_saves.inc();
                    metrics.kv_disk_written_bytes.add(bytes);
                    metrics.kv_disk_evictions.add(evicted.len() as u64);
                    eprintln!(
                        "ds4 serve: kv cache: stored {n} tokens ({reason:?}, {:.1} MiB, state copied in {snap_ms:.0} ms; in the background encoded in {enc_ms:.0} ms, written in {:.0} ms){}",
                        bytes as f64 / (1 << 20) as f64,
                        t.elapsed().as_secs_f64() * 1e3,
                        if evicted.is_empty() {
                            String::new()
                        } else {
                            format!(", evicted {} old entries", evicted.len())
                        }
                    );
                }
                Ok(ds4_kvstore::Saved::Unchanged { .. }) => {}
                Ok(ds4_kvstore::Saved::TooLarge { bytes, budget }) => eprintln!(
                    "ds4 serve: kv cache: not storing {n} tokens: {bytes} bytes exceed --kv-disk-space-mb ({budget} bytes)"
                ),
                Err(e) => {
                    metrics.kv_disk_errors.inc();
                    eprintln!("ds4 serve: {e}");
                }
            }
        }
        metrics.kv_disk_bytes.set(cache.store.total_bytes());
    });
}

/// Stores a whole live session (reasons `evict` / `shutdown`) when it is long enough and not
/// already on disk as it stands.
fn store_whole(
    disk: Option<&Disk>,
    tok: &Tokenizer,
    live: &mut Live,
    reason: ds4_kvstore::Reason,
    metrics: &Arc<Metrics>,
) {
    let Some(d) = disk else { return };
    let n = live.session.tokens().len();
    if d.policy.store_whole(n) && (live.stored != n || !live.visible.is_empty()) {
        store(d, tok, live, reason, metrics);
    }
}

fn run_worker(
    engine: Engine,
    cfg: WorkerConfig,
    rx: mpsc::Receiver<Msg>,
    metrics: Arc<Metrics>,
    stopping: Arc<AtomicBool>,
) {
    let tok = engine.tokenizer().clone();
    let cache = cfg.disk.map(Arc::new);
    // Declared after `cache`, so dropped first: its queue is written before the worker ends.
    let writer = Writer::new("ds4-kv-writer");
    let disk = cache.as_ref().map(|cache| Disk {
        cache,
        writer: &writer,
    });
    let disk = disk.as_ref();
    let max_sessions = cfg.max_sessions.max(1);
    let mut pool: Vec<Live> = Vec::new();
    let mut tick = 0u64;
    if let Some(d) = disk {
        metrics.kv_disk_bytes.set(d.store.total_bytes());
    }
    while let Ok(msg) = rx.recv() {
        let job = match msg {
            Msg::Job(job) => *job,
            Msg::WaitDisk(ack) => {
                writer.wait_idle();
                let _ = ack.send(());
                continue;
            }
            Msg::Shutdown(ack) => {
                for live in &mut pool {
                    store_whole(disk, &tok, live, ds4_kvstore::Reason::Shutdown, &metrics);
                }
                writer.wait_idle();
                let _ = ack.send(());
                // Later jobs (there should be none) fail below.
                continue;
            }
        };
        metrics.queue_depth.dec();
        if job.cancel.load(Ordering::Relaxed) {
            metrics.cancelled.inc();
            continue; // the client left while queued
        }
        if stopping.load(Ordering::Relaxed) {
            send(&job, GenEvent::Failed("the server is shutting down".into()));
            continue;
        }
        metrics.busy.set(1);
        tick += 1;
        let forced = cfg.force.tokens(&tok);
        let (idx, plan) = pick(
            &engine,
            cfg.ctx,
            &tok,
            &mut pool,
            max_sessions,
            disk,
            &job,
            &metrics,
        );
        let live = &mut pool[idx];
        live.used = tick;
        let thinking_prompt = run_job(&tok, live, plan, job, forced, &metrics, disk, &stopping);
        live.bytes = tok.decode(live.session.tokens()).unwrap_or_default();
        if let Some(p) = thinking_prompt {
            live.visible = visible_keys(&p, &live.bytes);
        }
        metrics
            .kv_bytes
            .set(pool.iter().map(|l| l.session.kv_bytes()).sum());
        metrics.live_sessions.set(pool.len() as u64);
        metrics.busy.set(0);
    }
}

/// How a job starts: the effective prompt tokens and where the reused prefix came from.
struct Plan {
    tokens: Vec<u32>,
    source: &'static str,
}

/// Chooses the live session for a job (interfaces.md §5.2, extended to several sessions):
/// the one whose tokens are the longest prefix of the job's effective prompt (ties: most
/// recent). On a miss, a new session is made — evicting the least recently used one to the
/// disk cache when `max_sessions` are live — and the disk cache is searched for the longest
/// stored prefix of the rendered prompt.
#[allow(clippy::too_many_arguments)]
fn pick(
    engine: &Engine,
    ctx: usize,
    tok: &Tokenizer,
    pool: &mut Vec<Live>,
    max_sessions: usize,
    disk: Option<&Disk>,
    job: &GenJob,
    metrics: &Arc<Metrics>,
) -> (usize, Plan) {
    let mut best: Option<(usize, usize, u64, Plan)> = None;
    for (i, live) in pool.iter().enumerate() {
        let n = live.session.tokens().len();
        if n == 0 {
            continue;
        }
        let (tokens, source) = effective_tokens(tok, live, job);
        if !tokens.starts_with(live.session.tokens()) {
            continue;
        }
        if best.as_ref().is_none_or(|b| (n, live.used) > (b.1, b.2)) {
            best = Some((i, n, live.used, Plan { tokens, source }));
        }
    }
    if let Some((i, _, _, plan)) = best {
        return (i, plan);
    }
    // Miss: a fresh session, in an empty slot, a new one, or the least recently used one's.
    let idx = if let Some(i) = pool.iter().position(|l| l.session.tokens().is_empty()) {
        i
    } else if pool.len() < max_sessions {
        pool.push(Live::new(engine.new_session(ctx)));
        pool.len() - 1
    } else {
        let i = (0..pool.len()).min_by_key(|&i| pool[i].used).unwrap_or(0);
        let live = &mut pool[i];
        eprintln!(
            "ds4 serve: live kv cache miss: evicting the least recently used session ({} tokens)",
            live.session.tokens().len()
        );
        metrics.live_evictions.inc();
        store_whole(disk, tok, live, ds4_kvstore::Reason::Evict, metrics);
        live.session.reset();
        live.bytes.clear();
        live.visible.clear();
        live.stored = 0;
        i
    };
    let live = &mut pool[idx];
    if let Some(d) = disk {
        d.writer.wait_idle(); // a lookup sees every checkpoint stored before it
    }
    if let Some(plan) = disk.and_then(|d| load_from_disk(d, tok, live, job, metrics)) {
        return (idx, plan);
    }
    (
        idx,
        Plan {
            tokens: job.prompt_tokens.clone(),
            source: "none",
        },
    )
}

/// Disk lookup (interfaces.md §5.4): restore the longest stored prefix of the rendered
/// prompt into `live` (which is empty); the effective prompt is its tokens plus the
/// tokenisation of the remaining text (§4.4). `None` on a miss or a damaged entry (which is
/// deleted: the caller then prefills from scratch). A sound entry this build cannot read (a
/// newer ds4's snapshot format) is kept, passed over from then on, and the next prefix tried.
fn load_from_disk(
    disk: &Disk,
    tok: &Tokenizer,
    live: &mut Live,
    job: &GenJob,
    metrics: &Metrics,
) -> Option<Plan> {
    let ctx = live.session.ctx();
    let p = job.prompt_text.as_bytes();
    // Ends: every pass-over removes a candidate.
    let hit = loop {
        let Some(hit) =
            disk.store
                .lookup_longest_prefix(p, disk.policy.min_tokens, ctx.saturating_sub(1))
        else {
            metrics.kv_disk_misses.inc();
            return None;
        };
        if !job.prompt_text.is_char_boundary(hit.key_len) {
            // A key ending inside a character cannot be a rendered-text boundary.
            metrics.kv_disk_misses.inc();
            return None;
        }
        let reject = |why: String| {
            eprintln!(
                "ds4 serve: kv cache: rejecting {}: {why}",
                hit.path.display()
            );
            metrics.kv_disk_errors.inc();
            metrics.kv_disk_misses.inc();
            let _ = std::fs::remove_file(&hit.path);
        };
        match live.session.restore(&hit.snapshot) {
            Err(e) if e.snapshot_is_bad() => {
                reject(e.to_string());
                live.session.reset();
                return None;
            }
            Err(e) => {
                eprintln!(
                    "ds4 serve: kv cache: passing over {} (kept): {e}",
                    hit.path.display()
                );
                disk.store.pass_over(&hit);
                live.session.reset();
            }
            Ok(()) if live.session.tokens() != hit.tokens.as_slice() => {
                reject("the snapshot's tokens differ from the entry's token list".into());
                live.session.reset();
                return None;
            }
            Ok(()) => break hit,
        }
    };
    metrics.kv_disk_hits.inc();
    metrics.kv_disk_reused_tokens.add(hit.tokens.len() as u64);
    live.stored = hit.tokens.len();
    eprintln!(
        "ds4 serve: kv cache: disk hit, {} tokens ({} bytes of the prompt) from {}",
        hit.tokens.len(),
        hit.key_len,
        hit.path.display()
    );
    let mut tokens = hit.tokens;
    tokens.extend(tok.encode_with_chat_specials(&job.prompt_text[hit.key_len..]));
    Some(Plan {
        tokens,
        source: "disk",
    })
}

/// Effective prompt tokens (interfaces.md §5.2, "memory-text" and §4.4): when the live
/// session's decoded text is a byte prefix of the rendered prompt, keep the live tokens and
/// tokenise only the text after that boundary (BPE could merge across it otherwise; and the
/// live tokens may hold sampled tokenisations the full-prompt encoding would not reproduce).
/// Otherwise the full tokenisation (whose token prefix [`Session::sync`] still reuses).
fn effective_tokens(tok: &Tokenizer, live: &Live, job: &GenJob) -> (Vec<u32>, &'static str) {
    let lt = live.session.tokens();
    let p = job.prompt_text.as_bytes();
    for v in &live.visible {
        if let Some(rest) = job.prompt_text.strip_prefix(v.as_str()) {
            let mut t = lt.to_vec();
            t.extend(tok.encode_with_chat_specials(rest));
            return (t, "thinking-visible");
        }
    }
    if !lt.is_empty()
        && live.bytes.len() <= p.len()
        && p.starts_with(&live.bytes)
        && job.prompt_text.is_char_boundary(live.bytes.len())
        && !job.prompt_tokens.starts_with(lt)
    {
        let mut t = lt.to_vec();
        t.extend(tok.encode_with_chat_specials(&job.prompt_text[live.bytes.len()..]));
        return (t, "memory-text");
    }
    (job.prompt_tokens.clone(), "memory-token")
}

fn send(job: &GenJob, mut ev: GenEvent) {
    let t = Instant::now();
    loop {
        match job.events.try_send(ev) {
            // A closed receiver (client gone) is noticed through the cancel flag.
            Ok(()) | Err(TrySendError::Closed(_)) => return,
            Err(TrySendError::Full(e)) => {
                if t.elapsed() >= job.stall {
                    job.cancel.store(true, Ordering::Relaxed);
                    return;
                }
                ev = e;
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_job(
    tok: &Tokenizer,
    live: &mut Live,
    plan: Plan,
    job: GenJob,
    forced: Option<Vec<u32>>,
    metrics: &Arc<Metrics>,
    disk: Option<&Disk>,
    stopping: &AtomicBool,
) -> Option<String> {
    let live_before = live.session.tokens().len();
    let Plan { tokens, mut source } = plan;
    live.visible.clear();
    let ctx = live.session.ctx();
    if tokens.len() >= ctx {
        send(
            &job,
            GenEvent::Failed(format!(
                "prompt has {} tokens, but the context size is {ctx} tokens",
                tokens.len()
            )),
        );
        return None;
    }
    // Prefill in steps so a departed client stops it; a partial prefill stays a valid prefix.
    let t0 = Instant::now();
    let mut cached = None;
    let total = tokens.len();
    if live.session.logits().is_none() && !tokens.is_empty() && live.session.tokens() == tokens {
        // Nothing left to evaluate, and the last decode step handed back a token instead of
        // logits (or a checkpoint of such a state was restored): rebuild to get them.
        live.session.reset();
    }
    let mut end = live.session.tokens().len().min(total);
    if !tokens.starts_with(live.session.tokens()) {
        end = 0;
    }
    // Checkpoint frontiers (interfaces.md §5.3): the cold length when nothing is reused,
    // and the continued frontiers; the prefill stops exactly there to write them.
    let mut cold = None;
    let mut stops = Vec::new();
    if let Some(d) = disk {
        if end == 0 {
            let sp = tok.specials();
            cold = d.policy.cold_store_len(&tokens, sp.user, sp.assistant);
        }
        stops = d.policy.continued_frontiers(end, total);
        stops.extend(cold);
        stops.sort_unstable();
    }
    let step = live.session.prefill_step().max(PREFILL_STEP);
    for next in prefill_pieces(end, total, step, &stops) {
        end = next;
        match live.session.sync(&tokens[..end], &mut |_, _| {}) {
            Ok(reused) => {
                cached.get_or_insert(reused);
            }
            Err(e) => {
                send(&job, GenEvent::Failed(format!("prefill failed: {e}")));
                return None;
            }
        }
        if let Some(d) = disk {
            if cold == Some(end) {
                store(d, tok, live, ds4_kvstore::Reason::Cold, metrics);
            } else if d.policy.continued_due(end, live.stored) {
                store(d, tok, live, ds4_kvstore::Reason::Continued, metrics);
            }
        }
        send(&job, GenEvent::Prefill { done: end, total });
        if end == total {
            break;
        }
        if job.cancel.load(Ordering::Relaxed) || stopping.load(Ordering::Relaxed) {
            metrics.cancelled.inc();
            send(&job, GenEvent::Failed("cancelled".into()));
            return None;
        }
    }
    let cached = cached.unwrap_or(0);
    if cached == 0 {
        source = "none";
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    metrics.record_prefill(total - cached, t0.elapsed(), cached);
    send(
        &job,
        GenEvent::Started {
            prompt_tokens: total,
            cached_tokens: cached,
        },
    );
    let t1 = Instant::now();
    let (finish, text, n, sampled, spec, error, parsed) =
        decode(tok, live, &job, forced, metrics, ctx, disk, stopping);
    let decode_s = t1.elapsed().as_secs_f64();
    // One line per request on stderr: the cache decision and speeds.
    eprintln!(
        "ds4 serve: prompt={total} cached={cached} source={source} prefill={:.1} t/s generated={n} decode={:.1} t/s finish={finish:?} tools={}{}{}",
        (total - cached) as f64 / prefill_s.max(1e-9),
        n as f64 / decode_s.max(1e-9),
        parsed.tool_calls.len(),
        if spec.drafted > 0 {
            format!(" drafts={}/{}", spec.accepted, spec.drafted)
        } else {
            String::new()
        },
        error.as_deref().map(|e| format!(" error={e}")).unwrap_or_default(),
    );
    if let Some(tr) = &job.trace {
        tr.write(
            &job,
            &[
                ("live_tokens_before", live_before.to_string()),
                ("prompt_tokens", total.to_string()),
                ("cache_source", source.to_string()),
                ("cached_tokens", cached.to_string()),
                ("max_tokens", job.max_tokens.to_string()),
                ("sampler", format!("{:?}", job.sampler)),
                ("finish", format!("{finish:?}")),
                ("generated_tokens", n.to_string()),
                ("backend_sampled_tokens", sampled.to_string()),
                ("spec_drafted", spec.drafted.to_string()),
                ("spec_accepted", spec.accepted.to_string()),
                (
                    "elapsed_sec",
                    format!("{:.3}", job.enqueued.elapsed().as_secs_f64()),
                ),
            ],
            &text,
            &parsed,
            error.as_deref(),
        );
    }
    let thinking_prompt =
        (job.parse.thinking && parsed.reasoning_closed && job.prompt_text.ends_with(THINK_OPEN))
            .then(|| job.prompt_text.clone());
    let result = GenResult {
        finish,
        parsed,
        text,
        prompt_tokens: total,
        cached_tokens: cached,
        completion_tokens: n,
        sampled_tokens: sampled,
        error,
    };
    send(&job, GenEvent::Done(Box::new(result)));
    thinking_prompt
}

/// The thinking-visible keys of a live text that starts with `prompt` (see [`Live`]).
fn visible_keys(prompt: &str, live: &[u8]) -> Vec<String> {
    let Some(generated) = live.strip_prefix(prompt.as_bytes()) else {
        return vec![];
    };
    let Ok(generated) = std::str::from_utf8(generated) else {
        return vec![];
    };
    let Some(p) = generated.find(THINK_CLOSE) else {
        return vec![];
    };
    let rest = &generated[p..]; // `</think>` + what follows
    let base = &prompt[..prompt.len() - THINK_OPEN.len()];
    vec![format!("{base}{rest}"), format!("{prompt}{rest}")]
}

/// Holds back the tail that could be the start of a stop sequence (§1.3).
struct StopFilter {
    stops: Vec<String>,
    keep: usize,
    held: String,
}

impl StopFilter {
    fn new(stops: Vec<String>) -> Self {
        let keep = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        StopFilter {
            stops,
            keep,
            held: String::new(),
        }
    }

    /// Adds text; returns what may be emitted and whether a stop sequence was hit (the text
    /// is cut before it).
    fn push(&mut self, s: &str) -> (String, bool) {
        self.held.push_str(s);
        let hit = self
            .stops
            .iter()
            .filter_map(|st| self.held.find(st.as_str()))
            .min();
        if let Some(p) = hit {
            let out = self.held[..p].to_string();
            self.held.clear();
            return (out, true);
        }
        let mut cut = self.held.len().saturating_sub(self.keep);
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// (finish, text, generated tokens, tokens picked by the backend, drafts, error, parsed).
type DecodeOut = (
    Finish,
    String,
    usize,
    usize,
    SpecStats,
    Option<String>,
    ParsedOutput,
);

/// `DS4_SERVER_SAMPLE=logits`: every decode step reads the logits back and the host picks
/// (the A/B switch for the backend-sampled steps).
fn backend_sampling_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DS4_SERVER_SAMPLE").map_or(true, |v| v != "logits"))
}

#[allow(clippy::too_many_arguments)]
fn decode(
    tok: &Tokenizer,
    live: &mut Live,
    job: &GenJob,
    forced: Option<Vec<u32>>,
    metrics: &Arc<Metrics>,
    ctx: usize,
    disk: Option<&Disk>,
    stopping: &AtomicBool,
) -> DecodeOut {
    let eos = tok.specials().eos;
    let mut sampler = Sampler::new(job.sampler.clone());
    // Tool-block structure is picked greedily (no draw, as `argmax`).
    let mut greedy = Sampler::new(SamplerConfig::default());
    // Decode steps hand back the next token (picked on the backend: a GPU reads back 4 bytes
    // instead of the vocabulary's logits) unless logprobs need the logits. `next`: that token.
    let backend_picks = job.logprobs.is_none() && forced.is_none() && backend_sampling_on();
    let mut next: Option<u32> = None;
    let mut next_sampled = false; // `next` was picked on the backend
    let mut sampled = 0usize;
    // Speculative steps (`serve --mtp`): the MTP block drafts the token after each one, a
    // 2-token step evaluates both, and the pick after the token (the request's sampler, one draw
    // as a plain step) keeps the draft when it is the draft: the tokens plain sampling gives.
    // Not with logprobs (each token's logits) or forced tokens. A GPU picks both rows of the
    // step itself. `pre`: `next` is a kept draft, already evaluated; the pick after it is the
    // session's (`Session::pick`: its logits, or that step's device pick).
    let spec = live.session.has_mtp() && job.logprobs.is_none() && forced.is_none();
    let mut pre = false;
    let mut spec_stats = SpecStats::default();
    let mut parser = StreamParser::new(job.parse);
    let mut dec = StreamDecoder::new();
    let mut stop = StopFilter::new(job.stop.clone());
    let mut text = String::new();
    let mut n = 0usize;
    let mut finish = Finish::Length;
    let mut error = None;
    let t0 = Instant::now();
    let mut first = true;
    let mut hit_stop = false;
    let mut forced = forced.map(|v| v.into_iter());
    let emit = |s: &str, parser: &mut StreamParser, text: &mut String| {
        if s.is_empty() {
            return;
        }
        text.push_str(s);
        let ev = parser.push(s);
        if !ev.is_empty() {
            send(job, GenEvent::Stream(ev));
        }
    };
    while n < job.max_tokens {
        if job.cancel.load(Ordering::Relaxed) {
            metrics.cancelled.inc();
            finish = Finish::Error;
            error = Some("cancelled: the client disconnected".into());
            break;
        }
        if stopping.load(Ordering::Relaxed) {
            finish = Finish::Error;
            error = Some("the server is shutting down".into());
            break;
        }
        if live.session.tokens().len() >= ctx {
            break; // context full: length
        }
        let from_backend = next.is_some() && next_sampled;
        next_sampled = false;
        let t = if let Some(it) = forced.as_mut() {
            it.next().unwrap_or(eos)
        } else if let Some(t) = next.take() {
            t
        } else {
            // Tool-block structure is picked greedily, payload with the request's settings:
            // from the session's logits, or (a kept draft) its step's pick on the device.
            let s = if parser.sampling_state() == SamplingState::Structure {
                &mut greedy
            } else {
                &mut sampler
            };
            match live.session.pick(s) {
                Ok(Some(t)) => t,
                Ok(None) => {
                    finish = Finish::Error;
                    error = Some("no logits after prefill".into());
                    break;
                }
                Err(e) => {
                    finish = Finish::Error;
                    error = Some(format!("decode failed: {e}"));
                    break;
                }
            }
        };
        if t == eos {
            finish = Finish::Stop;
            break;
        }
        n += 1;
        sampled += from_backend as usize;
        if let (Some(k), Some(l)) = (job.logprobs, live.session.logits()) {
            send(job, GenEvent::Logprob(token_logprob(tok, l, t, k)));
        }
        if first {
            metrics.ttft.observe(job.enqueued.elapsed().as_secs_f64());
            first = false;
        }
        let piece = dec.push(tok, t).unwrap_or_default();
        let (out, hit) = stop.push(&piece);
        emit(&out, &mut parser, &mut text);
        if hit {
            finish = Finish::Stop;
            hit_stop = true;
            break;
        }
        if parser.block_closed() {
            finish = Finish::ToolCalls;
            break;
        }
        if n == job.max_tokens {
            break; // not evaluated: the next request re-renders from text anyway
        }
        // Continued checkpoints during long generations, never inside a tool block; the
        // step before one keeps its logits (the checkpoint stores them, as after a prefill).
        let after = live.session.tokens().len() + !pre as usize; // tokens once `t` is in
        let checkpoint = disk.is_some_and(|d| {
            parser.sampling_state() == SamplingState::Outside
                && d.policy.continued_due(after, live.stored)
        });
        // The pick after `t`: tool-block structure greedily, payload with the request's sampler.
        let s = if parser.sampling_state() == SamplingState::Structure {
            &mut greedy
        } else {
            &mut sampler
        };
        let r = if pre {
            pre = false; // evaluated with the token before it
            Ok(())
        } else if spec && !checkpoint {
            let r = live.session.eval_draft(t, s);
            if let Ok(d) = r {
                spec_stats.note(d);
            }
            match r {
                Ok(Drafted::Accepted(d)) => {
                    (next, pre) = (Some(d), true);
                    Ok(())
                }
                Ok(Drafted::Rejected(x)) => {
                    next = Some(x);
                    Ok(())
                }
                // Evaluated with its logits and streams kept (the next step's draft needs them).
                Ok(Drafted::NoDraft) => live.session.eval(t).map(|_| ()),
                Err(e) => Err(e),
            }
        } else if backend_picks && !checkpoint {
            // The same pick the host would make from this step's logits at the loop's top.
            live.session.eval_sampled(t, s).map(|id| {
                next = Some(id);
                next_sampled = true;
            })
        } else {
            live.session.eval(t).map(|_| ())
        };
        if let Err(e) = r {
            finish = Finish::Error;
            error = Some(format!("decode failed: {e}"));
            break;
        }
        if checkpoint {
            if let Some(d) = disk {
                store(d, tok, live, ds4_kvstore::Reason::Continued, metrics);
            }
        }
    }
    // A kept draft the loop stopped at (an end token, a stop sequence, the token limit, a closed
    // tool block, a cancel) is taken back: the live state ends where plain decoding's does.
    if pre {
        if let Err(e) = live.session.undo_draft() {
            finish = Finish::Error;
            error.get_or_insert(format!("decode failed: {e}"));
        }
    }
    metrics.spec_drafted.add(spec_stats.drafted as u64);
    metrics.spec_accepted.add(spec_stats.accepted as u64);
    if !hit_stop && !parser.block_closed() {
        let tail = dec.flush();
        let (out, hit) = stop.push(&tail);
        emit(&out, &mut parser, &mut text);
        if hit {
            finish = Finish::Stop;
        } else {
            let rest = stop.flush();
            emit(&rest, &mut parser, &mut text);
        }
    }
    metrics.record_decode(n, t0.elapsed());
    let (ev, parsed) = parser.finish();
    if !ev.is_empty() {
        send(job, GenEvent::Stream(ev));
    }
    if finish != Finish::Error {
        match parsed.status {
            ds4_chat::DsmlStatus::Parsed(_) if !parsed.tool_calls.is_empty() => {
                finish = Finish::ToolCalls
            }
            ds4_chat::DsmlStatus::Unterminated { .. } => {
                finish = Finish::Error;
                error = Some("unterminated tool call".into());
            }
            _ => {}
        }
    }
    (finish, text, n, sampled, spec_stats, error, parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU's prompt step (thousands of tokens) cuts a prompt into that many pieces, not 128s,
    /// and every checkpoint frontier is still a piece's end; the CPU's 128 as before.
    #[test]
    fn prefill_pieces_follow_the_backend_step_and_stop_at_frontiers() {
        assert_eq!(
            prefill_pieces(0, 30_000, 12_288, &[10_240, 16_066]),
            vec![10_240, 16_066, 28_354, 30_000]
        );
        assert_eq!(prefill_pieces(16_131, 17_023, 12_288, &[]), vec![17_023]);
        assert_eq!(prefill_pieces(0, 300, 128, &[]), vec![128, 256, 300]);
        // Frontiers outside the range or at its start are not pieces.
        assert_eq!(
            prefill_pieces(100, 300, 128, &[50, 100, 300]),
            vec![228, 300]
        );
        // Nothing left: one piece at the end (the caller evaluates it for its logits).
        assert_eq!(prefill_pieces(300, 300, 128, &[]), vec![300]);
        // A CPU session's step is the backend's 128 (the server's floor).
        let mut o = ds4_engine::EngineOptions::new(ds4_synth::tiny_model_for_tests(31, false));
        o.backend = ds4_engine::BackendChoice::Cpu;
        let e = Engine::open(&o).unwrap();
        assert_eq!(e.new_session(256).prefill_step(), PREFILL_STEP);
    }

    /// Samplers the decode tests run: full-vocabulary temperature, every filter, greedy.
    fn samplers() -> [SamplerConfig; 3] {
        [
            SamplerConfig {
                temperature: 1.0,
                seed: 11,
                ..Default::default()
            },
            SamplerConfig {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.02,
                seed: 12,
            },
            SamplerConfig::default(),
        ]
    }

    /// Runs one job on a CPU worker; returns (result, the Logprob events' count).
    fn run_one(
        sched: &Scheduler,
        tok: &Tokenizer,
        cfg: SamplerConfig,
        lp: Option<usize>,
    ) -> (GenResult, usize) {
        let text = "<｜begin▁of▁sentence｜><｜User｜>tell me a story<｜Assistant｜><think>";
        let (tx, mut rx) = tokio::sync::mpsc::channel(100_000);
        sched
            .submit(GenJob {
                prompt_text: text.into(),
                prompt_tokens: tok.encode_with_chat_specials(text),
                max_tokens: 40,
                sampler: cfg,
                stop: vec![],
                parse: ParseOptions {
                    thinking: true,
                    detect_tools: true,
                },
                logprobs: lp,
                cancel: Arc::new(AtomicBool::new(false)),
                events: tx,
                stall: std::time::Duration::from_secs(60),
                enqueued: Instant::now(),
                trace: None,
            })
            .unwrap();
        let mut lps = 0;
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenEvent::Logprob(_) => lps += 1,
                GenEvent::Done(r) => return (*r, lps),
                GenEvent::Failed(e) => panic!("{e}"),
                _ => {}
            }
        }
        panic!("no result");
    }

    /// `serve --mtp`: speculative steps under the request's sampler give the plain tokens (the
    /// CPU's 2-token rows are bit-identical to single steps), counted in the metrics, and the
    /// live session they leave serves the next request as plain decoding's does.
    #[test]
    fn mtp_drafts_give_the_plain_replies() {
        let path = ds4_synth::tiny_model_for_tests(21, true);
        let open = |mtp: bool| {
            let mut o = ds4_engine::EngineOptions::new(&path);
            o.backend = ds4_engine::BackendChoice::Cpu;
            o.mtp = mtp.then(|| ds4_synth::mtp_path(&path));
            Engine::open(&o).unwrap()
        };
        let plain = open(false);
        let tok = plain.tokenizer().clone();
        let m_plain = Arc::new(Metrics::default());
        let s_plain = spawn_worker(plain, 512, ForceOutput(None), m_plain.clone());
        // Picks on the host from the verify step's logits (the CPU's way), then as a GPU makes
        // them (both rows on the backend, the pick after a kept draft taken from that step).
        for device in [false, true] {
            let mut spec = open(true);
            spec.set_device_picks(Some(device));
            let m_spec = Arc::new(Metrics::default());
            let s_spec = spawn_worker(spec, 512, ForceOutput(None), m_spec.clone());
            spec_replies_are_plain(&tok, &s_plain, &s_spec, &m_spec, device);
        }
        assert_eq!(m_plain.spec_drafted.get(), 0);
    }

    fn spec_replies_are_plain(
        tok: &Tokenizer,
        s_plain: &Scheduler,
        s_spec: &Scheduler,
        m_spec: &Metrics,
        device: bool,
    ) {
        for cfg in samplers() {
            // Twice each: the second request reuses the live session the first left.
            for round in 0..2 {
                let (a, _) = run_one(s_plain, tok, cfg.clone(), None);
                let before = m_spec.spec_drafted.get();
                let (b, _) = run_one(s_spec, tok, cfg.clone(), None);
                assert!(a.completion_tokens > 1, "{cfg:?}: {a:?}");
                assert_eq!(
                    (a.text.as_str(), a.completion_tokens, a.finish),
                    (b.text.as_str(), b.completion_tokens, b.finish),
                    "{cfg:?} round {round}, device picks {device}"
                );
                assert_eq!(
                    b.cached_tokens, a.cached_tokens,
                    "{cfg:?} round {round}, device picks {device}"
                );
                // A draft at every step but the last (random weights: mostly rejected).
                let drafted = m_spec.spec_drafted.get() - before;
                assert!(
                    drafted + 1 >= b.completion_tokens as u64 - 1,
                    "{cfg:?}: {drafted} drafts for {} tokens",
                    b.completion_tokens
                );
                // Picked in the verify steps, not by eval_sampled.
                assert_eq!(b.sampled_tokens, 0, "{cfg:?}");
            }
        }
        assert!(m_spec.render(true).contains(&format!(
            "ds4_spec_drafted_total {}",
            m_spec.spec_drafted.get()
        )));
    }

    #[test]
    fn backend_sampled_steps_pick_what_the_logits_path_picks() {
        let path = ds4_synth::tiny_model_for_tests(31, false);
        let mut o = ds4_engine::EngineOptions::new(&path);
        o.backend = ds4_engine::BackendChoice::Cpu;
        let engine = Engine::open(&o).unwrap();
        let tok = engine.tokenizer().clone();
        let sched = spawn_worker(engine, 512, ForceOutput(None), Arc::new(Metrics::default()));
        for cfg in samplers() {
            // No logprobs: every step after the first returns the backend's pick.
            let (a, lp_a) = run_one(&sched, &tok, cfg.clone(), None);
            // Logprobs: every step reads the logits (the host picks).
            let (b, lp_b) = run_one(&sched, &tok, cfg.clone(), Some(0));
            assert!(a.completion_tokens > 1, "{cfg:?}: {a:?}");
            assert_eq!(lp_a, 0);
            assert_eq!(lp_b, b.completion_tokens);
            assert_eq!(b.sampled_tokens, 0, "{cfg:?}");
            // The first token comes from the prefill's logits.
            assert_eq!(a.sampled_tokens, a.completion_tokens - 1, "{cfg:?}");
            assert_eq!(
                (a.text.as_str(), a.completion_tokens, a.finish),
                (b.text.as_str(), b.completion_tokens, b.finish),
                "{cfg:?}"
            );
        }
    }

    #[test]
    fn stop_filter_holds_back_split_sequences_and_cuts_before_the_match() {
        let mut f = StopFilter::new(vec!["END".into(), "xy".into()]);
        assert_eq!(f.push("abcE"), ("ab".into(), false)); // "cE" could start "END"
        assert_eq!(f.push("N"), ("c".into(), false)); // "EN" held
        assert_eq!(f.push("Dzz"), ("".into(), true));
        let mut f = StopFilter::new(vec!["é!".into()]);
        // never splits a character when holding back
        assert_eq!(f.push("aéé"), ("aé".into(), false));
        assert_eq!(f.flush(), "é");
    }
}
