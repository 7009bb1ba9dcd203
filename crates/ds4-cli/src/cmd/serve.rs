//! `ds4 serve`: the OpenAI- and Anthropic-compatible HTTP server (crate `ds4-server`).

use super::common::ModelArgs;
use anyhow::{anyhow, Context, Result};
use ds4_server::worker::{ForceOutput, Trace};
use ds4_server::ServerConfig;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    ds4 synth --preset tiny -o models/tiny.gguf && ds4 serve -m models/tiny.gguf --ctx 4096\n  \
    ds4 serve -m model.gguf --api-key \"$(openssl rand -hex 16)\" --port 8000\n\n\
Endpoints: POST /v1/chat/completions /v1/completions /v1/responses /v1/messages\n\
/v1/messages/count_tokens; GET /v1/models /health /metrics. Model id: deepseek-v4-flash\n\
(any model name is accepted and echoed; deepseek-chat turns thinking off).\n\n\
Claude Code:\n  \
    ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_AUTH_TOKEN=KEY \\\n  \
    ANTHROPIC_MODEL=deepseek-v4-flash CLAUDE_STREAM_IDLE_TIMEOUT_MS=600000 claude\n  \
(without --api-key any token works, e.g. ANTHROPIC_AUTH_TOKEN=dsv4-local)\n\n\
opencode (opencode.json):\n  \
    {\"provider\": {\"ds4\": {\"npm\": \"@ai-sdk/openai-compatible\", \"name\": \"ds4\",\n    \
    \"options\": {\"baseURL\": \"http://127.0.0.1:8000/v1\", \"apiKey\": \"KEY\"},\n    \
    \"models\": {\"deepseek-v4-flash\": {\"name\": \"DeepSeek V4 Flash\"}}}}}\n\n\
OpenAI SDKs / Codex CLI: base URL http://127.0.0.1:8000/v1, key KEY (or any string).\n\n\
KV cache: several conversations stay live in memory (--kv-mem-mb); a request continues the\n\
one whose tokens are the longest prefix of its prompt. With --kv-disk-dir, checkpoints of\n\
long prompts are written to disk (the system+tools prefix of a new prompt, every ~10k tokens\n\
of prefill or generation, a live session before it is evicted, every live session on\n\
SIGINT/SIGTERM) and a prompt that misses the live sessions restores the longest stored\n\
prefix of its rendered text, even after a restart. Usage reports the reused tokens\n\
(cached_tokens / cache_read_input_tokens); /metrics counts disk hits, misses, saves and\n\
evictions. Inspect with `ds4 kv ls DIR`.")]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind. The default only accepts local clients; use 0.0.0.0 to expose the
    /// server (then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// TCP port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this key from clients, as `Authorization: Bearer KEY` or `x-api-key: KEY`
    /// (compared in constant time). Also read from DS4_API_KEY. /health stays open.
    #[arg(long)]
    api_key: Option<String>,
    /// Default max output tokens when a request gives none (always clamped to the free
    /// context).
    #[arg(short = 'n', long, default_value_t = 393_216)]
    tokens: usize,
    /// Send CORS headers (Access-Control-Allow-Origin: *) so browser pages can call the
    /// server. Does not change the bind address.
    #[arg(long)]
    cors: bool,
    /// Largest accepted request body in MiB (larger: 413).
    #[arg(long, default_value_t = 16)]
    max_body_mb: usize,
    /// Largest accepted JSON nesting depth (deeper: 400).
    #[arg(long, default_value_t = 128)]
    max_json_depth: usize,
    /// Seconds allowed to receive request headers and body (slower: connection closed / 408).
    #[arg(long, default_value_t = 30)]
    read_timeout: u64,
    /// Seconds of silence after which a stream gets a `: keep-alive` SSE comment (long
    /// prefills, hidden reasoning).
    #[arg(long, default_value_t = 5)]
    keepalive: u64,
    /// Seconds a streaming client may stop reading before its generation is cancelled (so a
    /// stuck client cannot hold the queue).
    #[arg(long, default_value_t = 20)]
    stall_timeout: u64,
    /// Open client connections at most (more wait in the listen backlog).
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Tool-call ids remembered for exact DSML replay (keeps agent loops cached).
    #[arg(long, default_value_t = 100_000)]
    tool_memory_max_ids: usize,
    /// Log every request in full to FILE (truncated at start): raw JSON, rendered prompt,
    /// cache decision, generated text, parsed calls. Contains prompts: treat as sensitive.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Memory for live sessions in MiB; each is counted at its full-context size (so the
    /// number kept is MiB / per-session size, at least 1; printed at start). Default: 4
    /// sessions, fewer if they would take over a quarter of the available memory (on a GPU
    /// also: over half its free memory, as the GPU stores them). The least recently used one
    /// is evicted (to the disk cache, if on).
    #[arg(long)]
    kv_mem_mb: Option<u64>,
    /// Directory of the disk KV cache (created with mode 0700). Off when not given.
    #[arg(long)]
    kv_disk_dir: Option<PathBuf>,
    /// Space budget of the disk KV cache in MiB; least recently used entries are evicted.
    #[arg(long, default_value_t = ds4_kvstore::policy::DEFAULT_DISK_SPACE_MB)]
    kv_disk_space_mb: u64,
    /// Never store or load checkpoints shorter than this (tokens).
    #[arg(long, default_value_t = 512)]
    kv_cache_min_tokens: usize,
    /// Store the system+tools prefix of prompts only up to this length (tokens); 0 = never.
    #[arg(long, default_value_t = 30000)]
    kv_cache_cold_max_tokens: usize,
    /// Checkpoint long prefills and generations every N tokens (rounded up to the
    /// alignment); 0 = never.
    #[arg(long, default_value_t = 10000)]
    kv_cache_continued_interval_tokens: usize,
    /// Tokens trimmed from the end of a prompt without a system prefix before storing it.
    #[arg(long, default_value_t = 32)]
    kv_cache_boundary_trim_tokens: usize,
    /// Round stored prompt lengths down to a multiple of N tokens; 0 = no alignment.
    #[arg(long, default_value_t = 2048)]
    kv_cache_boundary_align_tokens: usize,
    /// Testing only: when FILE exists and is non-empty at the start of a request, its text
    /// is emitted as the model's output instead of sampling (re-read per request).
    #[arg(long, hide = true)]
    test_force_output: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let host = if a.host == "localhost" {
        "127.0.0.1"
    } else {
        a.host.as_str()
    };
    let ip: IpAddr = host
        .parse()
        .map_err(|_| anyhow!("--host {:?}: not an IP address", a.host))?;
    if a.model.ctx < 16 {
        return Err(anyhow!("--ctx {}: too small", a.model.ctx));
    }
    let policy = ds4_kvstore::Policy {
        min_tokens: a.kv_cache_min_tokens,
        cold_max_tokens: a.kv_cache_cold_max_tokens,
        continued_interval_tokens: a.kv_cache_continued_interval_tokens,
        boundary_trim_tokens: a.kv_cache_boundary_trim_tokens,
        boundary_align_tokens: a.kv_cache_boundary_align_tokens,
    };
    policy.validate().map_err(|e| anyhow!(e))?;
    if a.kv_disk_space_mb == 0 {
        return Err(anyhow!("--kv-disk-space-mb must be at least 1"));
    }
    let cfg = ServerConfig {
        kv_disk: a.kv_disk_dir.map(|dir| ds4_server::KvDiskConfig {
            dir,
            space_bytes: a.kv_disk_space_mb << 20,
            policy,
        }),
        kv_mem_bytes: a.kv_mem_mb.map(|m| m << 20),
        ctx: a.model.ctx,
        default_max_tokens: a.tokens.max(1),
        api_key: a
            .api_key
            .or_else(|| std::env::var("DS4_API_KEY").ok())
            .filter(|k| !k.is_empty()),
        cors: a.cors,
        max_body: a.max_body_mb.max(1) << 20,
        max_json_depth: a.max_json_depth.max(2),
        read_timeout: Duration::from_secs(a.read_timeout.max(1)),
        keepalive: Duration::from_secs(a.keepalive.max(1)),
        tool_memory_max_ids: a.tool_memory_max_ids,
        max_connections: a.max_connections.max(1),
        stall_timeout: Duration::from_secs(a.stall_timeout.max(1)),
        force_output: ForceOutput(a.test_force_output),
        trace: match &a.trace {
            Some(p) => Some(Arc::new(
                Trace::create(p).with_context(|| format!("--trace {}", p.display()))?,
            )),
            None => None,
        },
    };
    let model = a.model.clone();
    ds4_server::run_blocking(cfg, SocketAddr::new(ip, a.port), move || {
        model.open().map_err(|e| format!("{e:#}"))
    })
    .with_context(|| format!("serving on {host}:{}", a.port))
}
