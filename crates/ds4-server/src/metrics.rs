//! Prometheus text metrics (`GET /metrics`), hand-rolled on atomics: a handful of counters,
//! gauges and one histogram do not justify a metrics framework.

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct Counter(AtomicU64);
impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Gauge(AtomicI64);
impl Gauge {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    pub fn set(&self, v: u64) {
        self.0.store(v as i64, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Seconds buckets for latency histograms.
const BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Default)]
pub struct Histogram(Mutex<(Vec<u64>, f64, u64)>);
impl Histogram {
    pub fn observe(&self, v: f64) {
        let mut h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if h.0.is_empty() {
            h.0 = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                h.0[i] += 1;
            }
        }
        h.1 += v;
        h.2 += 1;
    }
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let c = h.0.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.2);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", h.1, h.2);
    }
}

/// Endpoints counted separately in `requests_total`.
pub const ENDPOINTS: [&str; 8] = [
    "chat_completions",
    "completions",
    "responses",
    "messages",
    "count_tokens",
    "models",
    "health",
    "metrics",
];

#[derive(Default)]
pub struct Metrics {
    pub requests: [Counter; ENDPOINTS.len()],
    /// Requests answered with a 4xx/5xx status.
    pub errors: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    /// Prompt tokens actually prefilled (not reused) and the time it took.
    pub prefill_tokens: Counter,
    prefill_us: Counter,
    decode_us: Counter,
    /// Requests that reused part of the live session, and how many tokens.
    pub cache_hits: Counter,
    pub cache_reused_tokens: Counter,
    pub cancelled: Counter,
    /// Speculative decoding (`--mtp`): drafts the MTP block made, and those kept.
    pub spec_drafted: Counter,
    pub spec_accepted: Counter,
    pub queue_depth: Gauge,
    pub in_flight: Gauge,
    /// 1 while the worker runs a job.
    pub busy: Gauge,
    /// Bytes of KV state held by the live session.
    pub kv_bytes: Gauge,
    /// Seconds from queueing to the first generated token.
    pub ttft: Histogram,
    /// Live sessions held in memory, and how many were evicted to make room.
    pub live_sessions: Gauge,
    pub live_evictions: Counter,
    /// Disk KV cache (`--kv-disk-dir`): lookups that restored a checkpoint / found none,
    /// prompt tokens restored from disk, checkpoints written and their bytes, files evicted
    /// to keep the space budget, and failures (bad entries rejected, writes that failed).
    pub kv_disk_hits: Counter,
    pub kv_disk_misses: Counter,
    pub kv_disk_reused_tokens: Counter,
    pub kv_disk_saves: Counter,
    pub kv_disk_written_bytes: Counter,
    pub kv_disk_evictions: Counter,
    pub kv_disk_errors: Counter,
    /// Bytes of `*.kv` files in the cache directory after the last write.
    pub kv_disk_bytes: Gauge,
}

impl Metrics {
    pub fn request(&self, endpoint: &str) {
        if let Some(i) = ENDPOINTS.iter().position(|e| *e == endpoint) {
            self.requests[i].inc();
        }
    }

    pub fn record_prefill(&self, prefilled: usize, t: Duration, reused: usize) {
        self.prompt_tokens.add((prefilled + reused) as u64);
        self.prefill_tokens.add(prefilled as u64);
        self.prefill_us.add(t.as_micros() as u64);
        if reused > 0 {
            self.cache_hits.inc();
            self.cache_reused_tokens.add(reused as u64);
        }
    }

    pub fn record_decode(&self, n: usize, t: Duration) {
        self.generated_tokens.add(n as u64);
        self.decode_us.add(t.as_micros() as u64);
    }

    pub fn render(&self, ready: bool) -> String {
        let mut o = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        one(
            "ds4_ready",
            "gauge",
            "1 when the model is loaded and requests are served.",
            (ready as u8).to_string(),
        );
        let c = |x: &Counter| x.get().to_string();
        one(
            "ds4_request_errors_total",
            "counter",
            "Requests answered with an error status.",
            c(&self.errors),
        );
        one(
            "ds4_prompt_tokens_total",
            "counter",
            "Prompt tokens of generation requests (reused + prefilled).",
            c(&self.prompt_tokens),
        );
        one(
            "ds4_prefill_tokens_total",
            "counter",
            "Prompt tokens actually prefilled.",
            c(&self.prefill_tokens),
        );
        one(
            "ds4_generated_tokens_total",
            "counter",
            "Generated tokens.",
            c(&self.generated_tokens),
        );
        let secs = |us: &Counter| us.get() as f64 / 1e6;
        one(
            "ds4_prefill_seconds_total",
            "counter",
            "Time spent in prefill.",
            secs(&self.prefill_us).to_string(),
        );
        one(
            "ds4_decode_seconds_total",
            "counter",
            "Time spent decoding.",
            secs(&self.decode_us).to_string(),
        );
        let rate = |n: &Counter, us: &Counter| {
            let s = secs(us);
            if s > 0.0 {
                n.get() as f64 / s
            } else {
                0.0
            }
        };
        one(
            "ds4_prefill_tokens_per_second",
            "gauge",
            "Average prefill rate since start.",
            rate(&self.prefill_tokens, &self.prefill_us).to_string(),
        );
        one(
            "ds4_decode_tokens_per_second",
            "gauge",
            "Average decode rate since start.",
            rate(&self.generated_tokens, &self.decode_us).to_string(),
        );
        one(
            "ds4_cache_hits_total",
            "counter",
            "Requests that reused cached prompt tokens (a live session or the disk KV cache).",
            c(&self.cache_hits),
        );
        one(
            "ds4_cache_reused_tokens_total",
            "counter",
            "Prompt tokens reused (live sessions and disk KV cache).",
            c(&self.cache_reused_tokens),
        );
        one(
            "ds4_requests_cancelled_total",
            "counter",
            "Jobs stopped because the client disconnected.",
            c(&self.cancelled),
        );
        one(
            "ds4_spec_drafted_total",
            "counter",
            "Tokens the MTP block drafted (serve --mtp).",
            c(&self.spec_drafted),
        );
        one(
            "ds4_spec_accepted_total",
            "counter",
            "Drafted tokens that were the sampler's pick, so a step gave two tokens.",
            c(&self.spec_accepted),
        );
        let g = |x: &Gauge| x.get().to_string();
        one(
            "ds4_queue_depth",
            "gauge",
            "Jobs waiting for the worker.",
            g(&self.queue_depth),
        );
        one(
            "ds4_requests_in_flight",
            "gauge",
            "HTTP requests being handled.",
            g(&self.in_flight),
        );
        one(
            "ds4_worker_busy",
            "gauge",
            "1 while a job runs.",
            g(&self.busy),
        );
        one(
            "ds4_kv_cache_bytes",
            "gauge",
            "Bytes of KV state held by the live sessions (device memory on GPU backends).",
            g(&self.kv_bytes),
        );
        one(
            "ds4_live_sessions",
            "gauge",
            "Live sessions held in memory.",
            g(&self.live_sessions),
        );
        one(
            "ds4_live_session_evictions_total",
            "counter",
            "Live sessions evicted (least recently used) to make room for another conversation.",
            c(&self.live_evictions),
        );
        one(
            "ds4_kv_disk_hits_total",
            "counter",
            "Disk KV cache lookups that restored a checkpoint.",
            c(&self.kv_disk_hits),
        );
        one(
            "ds4_kv_disk_misses_total",
            "counter",
            "Disk KV cache lookups that found no usable checkpoint.",
            c(&self.kv_disk_misses),
        );
        one(
            "ds4_kv_disk_reused_tokens_total",
            "counter",
            "Prompt tokens restored from the disk KV cache.",
            c(&self.kv_disk_reused_tokens),
        );
        one(
            "ds4_kv_disk_saves_total",
            "counter",
            "Checkpoints written to the disk KV cache.",
            c(&self.kv_disk_saves),
        );
        one(
            "ds4_kv_disk_written_bytes_total",
            "counter",
            "Bytes of checkpoints written to the disk KV cache.",
            c(&self.kv_disk_written_bytes),
        );
        one(
            "ds4_kv_disk_evictions_total",
            "counter",
            "Disk KV cache files removed to respect --kv-disk-space-mb.",
            c(&self.kv_disk_evictions),
        );
        one(
            "ds4_kv_disk_bytes",
            "gauge",
            "Bytes of checkpoint files in the disk KV cache directory (as of the last write).",
            g(&self.kv_disk_bytes),
        );
        one(
            "ds4_kv_disk_errors_total",
            "counter",
            "Disk KV cache entries rejected when loading, and writes that failed.",
            c(&self.kv_disk_errors),
        );
        let _ = writeln!(o, "# HELP ds4_requests_total HTTP requests by endpoint.\n# TYPE ds4_requests_total counter");
        for (i, e) in ENDPOINTS.iter().enumerate() {
            let _ = writeln!(
                o,
                "ds4_requests_total{{endpoint=\"{e}\"}} {}",
                self.requests[i].get()
            );
        }
        self.ttft.render(
            "ds4_time_to_first_token_seconds",
            "Seconds from queueing a request to its first generated token.",
            &mut o,
        );
        o
    }
}
