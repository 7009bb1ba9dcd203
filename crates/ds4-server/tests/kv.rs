//! Disk KV cache and live sessions through the HTTP API on the tiny synthetic model:
//! restore after a clean shutdown, rejection of corrupt / truncated / foreign entries,
//! several conversations alternating, LRU eviction of live sessions and the disk budget.
//! The process-level tests (SIGTERM, kill -9) are in ds4-cli's `tests/serve_kv.rs`.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ds4_engine::{Engine, EngineOptions};
use ds4_kvstore::Policy;
use ds4_server::worker::ForceOutput;
use ds4_server::{router, AppState, KvDiskConfig, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tower::ServiceExt;

fn tmp() -> PathBuf {
    std::env::temp_dir().join(format!("ds4-server-kv-{}", std::process::id()))
}

/// One tiny model per test process.
fn model() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        std::fs::create_dir_all(tmp()).unwrap();
        let out = tmp().join("tiny.gguf");
        ds4_synth::synth_tiny(&out, 7).unwrap();
        out
    })
    .clone()
}

fn fresh_dir(name: &str) -> PathBuf {
    let d = tmp().join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Small thresholds so short test prompts are stored.
fn policy() -> Policy {
    Policy {
        min_tokens: 32,
        cold_max_tokens: 0,
        continued_interval_tokens: 0,
        boundary_trim_tokens: 8,
        boundary_align_tokens: 32,
    }
}

const CTX: usize = 2048;

struct Srv {
    state: Arc<AppState>,
    force: PathBuf,
}

impl Srv {
    /// `sessions`: live sessions kept; `disk`: (dir, space budget in bytes).
    fn new(sessions: u64, disk: Option<(&Path, u64)>) -> Srv {
        Srv::with_policy(sessions, disk, policy())
    }

    fn with_policy(sessions: u64, disk: Option<(&Path, u64)>, policy: Policy) -> Srv {
        Srv::build(sessions, disk, policy, None)
    }

    fn build(
        sessions: u64,
        disk: Option<(&Path, u64)>,
        policy: Policy,
        trace: Option<Arc<ds4_server::worker::Trace>>,
    ) -> Srv {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let force = tmp().join(format!("force-{n}.txt"));
        let _ = std::fs::remove_file(&force);
        let engine = Engine::open(&EngineOptions::new(model())).unwrap();
        let cfg = ServerConfig {
            ctx: CTX,
            force_output: ForceOutput(Some(force.clone())),
            kv_mem_bytes: Some(sessions * engine.memory_estimate(CTX)),
            kv_disk: disk.map(|(d, b)| KvDiskConfig {
                dir: d.to_path_buf(),
                space_bytes: b,
                policy,
            }),
            trace,
            ..Default::default()
        };
        let state = AppState::new(cfg);
        state.set_engine(engine);
        Srv { state, force }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = router(self.state.clone()).oneshot(req).await.unwrap();
        let st = resp.status();
        let b = resp.into_body().collect().await.unwrap().to_bytes();
        // Checkpoints are written in the background: the tests look at the files and
        // counters once the request's writes are done.
        self.state.wait_disk_writes();
        let s = String::from_utf8(b.to_vec()).unwrap();
        assert_eq!(st, StatusCode::OK, "{s}");
        serde_json::from_str(&s).unwrap()
    }

    /// One chat turn (thinking off, greedy, ≤ 16 tokens): (reply, prompt tokens, cached
    /// tokens).
    async fn chat(&self, msgs: &[(&str, &str)], forced: Option<&str>) -> (String, u64, u64) {
        self.chat_model("deepseek-chat", msgs, forced).await
    }

    async fn chat_model(
        &self,
        model: &str,
        msgs: &[(&str, &str)],
        forced: Option<&str>,
    ) -> (String, u64, u64) {
        match forced {
            Some(f) => std::fs::write(&self.force, f).unwrap(),
            None => {
                let _ = std::fs::remove_file(&self.force);
            }
        }
        let m: Vec<Value> = msgs
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let v = self
            .post(
                "/v1/chat/completions",
                // A fixed seed: thinking models sample at temperature 1 whatever is asked, and
                // replies are compared across servers.
                json!({"model": model, "messages": m, "max_tokens": 16, "temperature": 0, "seed": 1}),
            )
            .await;
        let u = &v["usage"];
        (
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            u["prompt_tokens"].as_u64().unwrap(),
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        )
    }

    fn metric(&self, name: &str) -> u64 {
        let text = self.state.metrics.render(true);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

fn long_user(topic: &str) -> String {
    format!(
        "{topic}: {}",
        "the quick brown fox jumps over the lazy dog ".repeat(7)
    )
}

fn kv_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "kv"))
        .collect();
    v.sort();
    v
}

/// Turn 1 (forced reply) and the user's follow-up of one conversation.
fn turns(topic: &str) -> (String, &'static str) {
    (long_user(topic), "Noted, go on.")
}

/// The reference second turn of a conversation, with both turns on one live session.
async fn reference(topic: &str) -> (String, u64, u64) {
    let s = Srv::new(1, None);
    let (u, r) = turns(topic);
    s.chat(&[("user", &u)], Some(r)).await;
    s.chat(
        &[("user", &u), ("assistant", r), ("user", "And then?")],
        None,
    )
    .await
}

/// Writes the first turn of `topic` to `dir` through a clean shutdown; returns the entries.
async fn first_turn_then_shutdown(topic: &str, dir: &Path) -> Vec<PathBuf> {
    let s = Srv::new(1, Some((dir, 1 << 30)));
    let (u, r) = turns(topic);
    let (_, p, c) = s.chat(&[("user", &u)], Some(r)).await;
    assert_eq!(c, 0);
    assert!(p > 64, "prompt of {p} tokens is too short for the test");
    assert!(kv_files(dir).is_empty(), "no cold stores in this policy");
    s.state.shutdown();
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 1);
    kv_files(dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clean_shutdown_is_restored_after_a_restart_with_the_same_reply() {
    let want = reference("restart").await;
    assert!(want.2 > want.1 / 2, "the reference reused its live session");
    let dir = fresh_dir("restart");
    let files = first_turn_then_shutdown("restart", &dir).await;
    assert_eq!(files.len(), 1);
    // "Restart": a new server on the same directory.
    let s = Srv::new(1, Some((&dir, 1 << 30)));
    let (u, r) = turns("restart");
    let got = s
        .chat(
            &[("user", &u), ("assistant", r), ("user", "And then?")],
            None,
        )
        .await;
    // Same prompt, same reused prefix (everything up to the new user turn), same reply.
    assert_eq!(got, want);
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
    assert_eq!(s.metric("ds4_kv_disk_reused_tokens_total"), want.2);
    assert_eq!(s.metric("ds4_prefill_tokens_total"), want.1 - want.2);
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_truncated_and_foreign_entries_are_rejected_and_the_server_keeps_serving() {
    let want = reference("corrupt").await;
    let dir = fresh_dir("corrupt-src");
    let src = first_turn_then_shutdown("corrupt", &dir).await.remove(0);
    let good = std::fs::read(&src).unwrap();
    let name = src.file_name().unwrap().to_owned();
    // Each damaged copy: the lookup skips (or deletes) it and the prompt is prefilled cold.
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let n = good.len();
    let cases: Vec<(&str, Damage)> = vec![
        (
            "payload byte flipped",
            Box::new(move |b| b[n - 100] ^= 0x40),
        ),
        ("header byte flipped", Box::new(|b| b[20] ^= 1)),
        ("truncated", Box::new(move |b| b.truncate(n - 7))),
        ("truncated to the header", Box::new(|b| b.truncate(40))),
        ("empty", Box::new(|b| b.clear())),
    ];
    for (i, (what, damage)) in cases.into_iter().enumerate() {
        let d = fresh_dir("corrupt-case");
        std::fs::create_dir_all(&d).unwrap();
        let mut b = good.clone();
        damage(&mut b);
        std::fs::write(d.join(&name), &b).unwrap();
        let s = Srv::new(1, Some((&d, 1 << 30)));
        let (u, r) = turns("corrupt");
        let msgs = [
            ("user", u.as_str()),
            ("assistant", r),
            ("user", "And then?"),
        ];
        let got = s.chat(&msgs, None).await;
        assert_eq!(got.0, want.0, "{what}");
        assert_eq!((got.1, got.2), (want.1, 0), "{what}: nothing reused");
        assert_eq!(s.metric("ds4_kv_disk_hits_total"), 0, "{what}");
        if i == 0 {
            // Still serving.
            let again = s.chat(&msgs, None).await;
            assert_eq!(again.0, want.0, "{what}");
        }
    }
    // A well-formed entry of this model whose snapshot the engine refuses: deleted.
    let entry = ds4_kvstore::read_file(&src).unwrap();
    let d = fresh_dir("corrupt-snapshot");
    let id = Engine::open(&EngineOptions::new(model()))
        .unwrap()
        .model_id();
    let store = ds4_kvstore::KvStore::open(&d, 1 << 30, id).unwrap();
    let mut snap = entry.snapshot.clone();
    snap.truncate(snap.len() / 2);
    let meta = ds4_kvstore::SaveMeta::new(ds4_kvstore::Reason::Shutdown, CTX);
    store
        .save(&entry.meta.key, &entry.meta.tokens, &snap, &meta)
        .unwrap();
    assert_eq!(kv_files(&d).len(), 1);
    let s = Srv::new(1, Some((&d, 1 << 30)));
    let (u, r) = turns("corrupt");
    let got = s
        .chat(
            &[("user", &u), ("assistant", r), ("user", "And then?")],
            None,
        )
        .await;
    assert_eq!(got, (want.0.clone(), want.1, 0), "bad snapshot");
    assert_eq!(s.metric("ds4_kv_disk_errors_total"), 1);
    assert!(kv_files(&d).is_empty(), "the bad entry was deleted");
    // Another model's entry: same payload and key, written under another model identity
    // (both under its own name and renamed to the one this model looks up).
    for rename in [false, true] {
        let d = fresh_dir("corrupt-foreign");
        let other = ds4_kvstore::KvStore::open(&d, 1 << 30, [0x5a; 32]).unwrap();
        let saved = other
            .save(
                &entry.meta.key,
                &entry.meta.tokens,
                &entry.snapshot,
                &ds4_kvstore::SaveMeta::new(ds4_kvstore::Reason::Shutdown, CTX),
            )
            .unwrap();
        let ds4_kvstore::Saved::Written { path, .. } = saved else {
            panic!("{saved:?}")
        };
        if rename {
            std::fs::rename(&path, d.join(&name)).unwrap();
        }
        let s = Srv::new(1, Some((&d, 1 << 30)));
        let (u, r) = turns("corrupt");
        let got = s
            .chat(
                &[("user", &u), ("assistant", r), ("user", "And then?")],
                None,
            )
            .await;
        assert_eq!(
            got,
            (want.0.clone(), want.1, 0),
            "foreign, renamed={rename}"
        );
    }
    // The undamaged file is used.
    let d = fresh_dir("corrupt-good");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(&name), &good).unwrap();
    let s = Srv::new(1, Some((&d, 1 << 30)));
    let (u, r) = turns("corrupt");
    let got = s
        .chat(
            &[("user", &u), ("assistant", r), ("user", "And then?")],
            None,
        )
        .await;
    assert_eq!(got, want);
}

/// A sound entry whose snapshot a newer ds4 wrote (format version above this build's, its
/// checksum valid): the prompt is prefilled cold and the file stays for that build.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_snapshot_format_is_passed_over_and_kept() {
    use sha2::{Digest, Sha256};
    let want = reference("newer").await;
    let dir = fresh_dir("newer-src");
    let src = first_turn_then_shutdown("newer", &dir).await.remove(0);
    let entry = ds4_kvstore::read_file(&src).unwrap();
    let mut snap = entry.snapshot.clone();
    // Version word after the 8-byte magic; the last 32 bytes are the SHA-256 of the rest.
    snap[8..12].copy_from_slice(&99u32.to_le_bytes());
    let body = snap.len() - 32;
    let sum: [u8; 32] = Sha256::digest(&snap[..body]).into();
    snap[body..].copy_from_slice(&sum);
    let d = fresh_dir("newer");
    let id = Engine::open(&EngineOptions::new(model()))
        .unwrap()
        .model_id();
    let store = ds4_kvstore::KvStore::open(&d, 1 << 30, id).unwrap();
    let meta = ds4_kvstore::SaveMeta::new(ds4_kvstore::Reason::Shutdown, CTX);
    store
        .save(&entry.meta.key, &entry.meta.tokens, &snap, &meta)
        .unwrap();
    let s = Srv::new(1, Some((&d, 1 << 30)));
    let (u, r) = turns("newer");
    let msgs = [
        ("user", u.as_str()),
        ("assistant", r),
        ("user", "And then?"),
    ];
    let got = s.chat(&msgs, None).await;
    assert_eq!(got, (want.0.clone(), want.1, 0), "prefilled cold");
    assert_eq!(s.metric("ds4_kv_disk_errors_total"), 0);
    assert_eq!(s.metric("ds4_kv_disk_misses_total"), 1);
    let left = kv_files(&d);
    assert!(
        left.iter().any(|p| ds4_kvstore::read_file(p)
            .map(|e| e.snapshot == snap)
            .unwrap_or(false)),
        "the newer entry is kept: {left:?}"
    );
}

/// Runs conversation `topic`'s next turn on `s` and returns its cached tokens; `hist` holds
/// the conversation so far (user/assistant alternating).
async fn next_turn(s: &Srv, hist: &mut Vec<(String, String)>, topic: &str) -> (u64, u64) {
    let n = hist.len();
    let user = if n == 0 {
        long_user(topic)
    } else {
        format!("{topic} question {n}")
    };
    hist.push(("user".into(), user));
    let reply = format!("{topic} answer {n}.");
    let msgs: Vec<(&str, &str)> = hist.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
    let (_, p, c) = s.chat(&msgs, Some(&reply)).await;
    hist.push(("assistant".into(), reply));
    (p, c)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_conversations_alternating_both_reuse_their_live_sessions() {
    let s = Srv::new(2, None);
    let (mut a, mut b) = (vec![], vec![]);
    assert_eq!(next_turn(&s, &mut a, "alpha").await.1, 0);
    assert_eq!(next_turn(&s, &mut b, "beta").await.1, 0);
    for _ in 0..2 {
        for (h, t) in [(&mut a, "alpha"), (&mut b, "beta")] {
            let before = s.metric("ds4_prompt_tokens_total");
            let (p, c) = next_turn(&s, h, t).await;
            assert!(c > 64 && c < p, "{t}: cached {c} of {p}");
            assert!(before > 0);
        }
    }
    assert_eq!(s.metric("ds4_live_sessions"), 2);
    assert_eq!(s.metric("ds4_live_session_evictions_total"), 0);

    // With room for one session and no disk cache the two conversations thrash.
    let s = Srv::new(1, None);
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..2 {
        assert_eq!(next_turn(&s, &mut a, "alpha").await.1, 0);
        assert_eq!(next_turn(&s, &mut b, "beta").await.1, 0);
    }
    assert_eq!(s.metric("ds4_live_session_evictions_total"), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_least_recently_used_session_is_evicted_to_disk_and_restored_from_there() {
    let dir = fresh_dir("lru");
    let s = Srv::new(2, Some((&dir, 1 << 30)));
    let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
    next_turn(&s, &mut a, "alpha").await;
    next_turn(&s, &mut b, "beta").await;
    next_turn(&s, &mut a, "alpha").await; // alpha is now the most recent
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 0);
    next_turn(&s, &mut c, "gamma").await; // evicts beta, not alpha
    assert_eq!(s.metric("ds4_live_session_evictions_total"), 1);
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 1);
    let (p, cached) = next_turn(&s, &mut a, "alpha").await; // still live
    assert!(cached > 64 && cached < p);
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 0);
    // beta comes back from disk (evicting gamma, the least recently used now).
    let (p, cached) = next_turn(&s, &mut b, "beta").await;
    assert!(cached > 64 && cached < p, "beta cached {cached} of {p}");
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
    assert_eq!(s.metric("ds4_kv_disk_reused_tokens_total"), cached);
    assert_eq!(s.metric("ds4_live_session_evictions_total"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_disk_budget_is_kept_by_evicting_the_least_recently_used_entries() {
    // Measure one entry, then allow a little over two.
    let dir = fresh_dir("budget-probe");
    let size = std::fs::metadata(&first_turn_then_shutdown("budget", &dir).await[0])
        .unwrap()
        .len();
    let budget = size * 5 / 2;
    let dir = fresh_dir("budget");
    let s = Srv::new(1, Some((&dir, budget)));
    let mut hs: Vec<Vec<(String, String)>> = vec![vec![]; 4];
    let topics = ["budget", "one", "two", "three"];
    for (h, t) in hs.iter_mut().zip(topics) {
        next_turn(&s, h, t).await; // each evicts the previous conversation to disk
    }
    s.state.shutdown();
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 4);
    let files = kv_files(&dir);
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .sum();
    assert!(total <= budget, "{total} > {budget}");
    assert_eq!(files.len(), 2);
    assert_eq!(s.metric("ds4_kv_disk_evictions_total"), 2);
    // The two most recent conversations survived; the oldest two did not.
    let mut keys: Vec<String> = files
        .iter()
        .map(|f| {
            let key = ds4_kvstore::read_file(f).unwrap().meta.key;
            let key = String::from_utf8(key).unwrap();
            topics
                .iter()
                .find(|t| key.contains(&format!("{t}: the quick")))
                .unwrap()
                .to_string()
        })
        .collect();
    keys.sort();
    assert_eq!(keys, ["three", "two"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_system_prompt_is_stored_cold_and_reused_by_another_conversation() {
    let system = format!("You are a fox expert. {}", long_user("rules"));
    let conv = |who: &str| {
        vec![
            ("system".to_string(), system.clone()),
            ("user".to_string(), format!("Hello from {who}")),
        ]
    };
    let (a, b) = (conv("ann"), conv("bob"));
    let want = Srv::new(1, None).chat(&refs(&b), None).await;
    let dir = fresh_dir("cold");
    let pol = Policy {
        cold_max_tokens: 2000,
        ..policy()
    };
    let s = Srv::with_policy(1, Some((&dir, 1 << 30)), pol);
    s.chat(&refs(&a), None).await;
    // The cold checkpoint is the system prefix: its key ends just before the user turn.
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 1);
    let files = kv_files(&dir);
    let key = ds4_kvstore::read_file(&files[0]).unwrap().meta.key;
    let key = String::from_utf8(key).unwrap();
    assert!(key.ends_with(&system), "{key:?}");
    // Bob's conversation evicts Ann's session (to disk) and restores the shared prefix.
    let got = s.chat(&refs(&b), None).await;
    assert_eq!((&got.0, got.1), (&want.0, want.1));
    assert_eq!(
        got.2,
        ds4_kvstore::read_file(&files[0]).unwrap().meta.tokens.len() as u64
    );
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
    assert_eq!(s.metric("ds4_live_session_evictions_total"), 1);
    assert_eq!(kv_files(&dir).len(), 2);
}

fn refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn continued_checkpoints_are_written_at_aligned_frontiers_of_a_long_prefill() {
    let dir = fresh_dir("continued");
    let pol = Policy {
        continued_interval_tokens: 50, // rounded up to the alignment: 64
        ..policy()
    };
    let s = Srv::with_policy(1, Some((&dir, 1 << 30)), pol);
    let (_, p, _) = s.chat(&[("user", &long_user("cont"))], Some("Ok.")).await;
    let mut lens: Vec<usize> = kv_files(&dir)
        .iter()
        .map(|f| ds4_kvstore::read_file(f).unwrap().meta.tokens.len())
        .collect();
    lens.sort_unstable();
    // Every frontier of the prompt (and maybe of the reply), none missing.
    let want: Vec<usize> = (1..=lens.len()).map(|k| 64 * k).collect();
    assert_eq!(lens, want);
    assert!(lens.len() >= 2 && *lens.last().unwrap() + 64 > p as usize);
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), want.len() as u64);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_thinking_turn_the_session_is_stored_under_the_visible_transcript() {
    let u = long_user("think");
    let turn2 = [
        ("user", u.as_str()),
        ("assistant", "The answer."),
        ("user", "More?"),
    ];
    let forced = "Hm.</think>The answer.";
    // Reference: one server, the live session continues from the visible transcript.
    let r = Srv::new(1, None);
    r.chat_model("deepseek-v4-flash", &[("user", &u)], Some(forced))
        .await;
    let want = r.chat_model("deepseek-v4-flash", &turn2, None).await;
    assert!(want.2 > 64, "{want:?}");
    let dir = fresh_dir("visible");
    let s = Srv::new(1, Some((&dir, 1 << 30)));
    s.chat_model("deepseek-v4-flash", &[("user", &u)], Some(forced))
        .await;
    s.state.shutdown();
    // Two keys (reasoning dropped: `</think>answer`, or kept empty: `<think></think>answer`),
    // flagged as thinking-visible transcripts.
    let files = kv_files(&dir);
    assert_eq!(files.len(), 2);
    for f in &files {
        let m = ds4_kvstore::read_file(f).unwrap().meta;
        assert_eq!(m.header.flags, 4);
        assert!(!String::from_utf8(m.key).unwrap().contains("Hm."));
    }
    let s = Srv::new(1, Some((&dir, 1 << 30)));
    let got = s.chat_model("deepseek-v4-flash", &turn2, None).await;
    assert_eq!(got, want);
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cache_directory_may_be_deleted_while_the_server_runs() {
    let dir = fresh_dir("deleted");
    let s = Srv::new(1, Some((&dir, 1 << 30)));
    let (mut a, mut b) = (vec![], vec![]);
    next_turn(&s, &mut a, "alpha").await;
    std::fs::remove_dir_all(&dir).unwrap();
    // A miss looks up a missing directory, then evicting alpha recreates it.
    let (_, cached) = next_turn(&s, &mut b, "beta").await;
    assert_eq!(cached, 0);
    assert_eq!(kv_files(&dir).len(), 1);
    let (p, cached) = next_turn(&s, &mut a, "alpha").await;
    assert!(cached > 64 && cached < p);
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
    assert_eq!(s.metric("ds4_kv_disk_errors_total"), 0);
}

/// Sampled with `limit` before `path`: the canonical rendering of the JSON the client sends
/// back (`path` first) differs, so only exact replay reproduces these bytes.
const SAMPLED_DSML: &str = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"limit\" string=\"false\">25</｜DSML｜parameter>\n<｜DSML｜parameter name=\"path\" string=\"true\">notes.txt</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

#[tokio::test(flavor = "multi_thread")]
async fn exact_tool_replay_survives_a_restart_through_the_checkpoint_tool_map() {
    let dir = fresh_dir("toolmap");
    let tools = json!([{"type":"function","function":{"name":"read_file","description":"Read a file",
        "parameters":{"type":"object","properties":{"path":{"type":"string"},"limit":{"type":"integer"}}}}}]);
    let user = long_user("tools");
    let chat = |msgs: Value| {
        json!({"model": "deepseek-chat", "messages": msgs, "tools": tools,
        "max_tokens": 400, "temperature": 0})
    };
    let s = Srv::new(1, Some((&dir, 1 << 30)));
    std::fs::write(&s.force, format!("Reading.\n\n{SAMPLED_DSML}")).unwrap();
    let v = s
        .post(
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": user}])),
        )
        .await;
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let id = v["choices"][0]["message"]["tool_calls"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The client sends the call back re-serialised: other key order and spacing.
    let call = json!({"role": "assistant", "content": "Reading.", "tool_calls": [{"id": id,
        "type": "function", "function": {"name": "read_file",
        "arguments": "{ \"path\": \"notes.txt\",  \"limit\": 25 }"}}]});
    let result = json!({"role": "tool", "tool_call_id": id, "content": "25 lines of notes"});
    std::fs::write(&s.force, "The file has 25 lines.").unwrap();
    let w = s
        .post(
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": user}, call, result])),
        )
        .await;
    let prompt2 = w["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        w["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 32,
        "exact replay continued the live session: {w}"
    );
    s.state.shutdown();
    assert_eq!(s.metric("ds4_kv_disk_saves_total"), 1);
    drop(s);

    // "Restart" with an empty in-memory map; the rendered prompt goes to the trace.
    let trace_path = dir.with_file_name("toolmap-trace.txt");
    let trace = Arc::new(ds4_server::worker::Trace::create(&trace_path).unwrap());
    let s = Srv::build(1, Some((&dir, 1 << 30)), policy(), Some(trace));
    std::fs::write(&s.force, "Nothing more.").unwrap();
    let answer = json!({"role": "assistant", "content": "The file has 25 lines."});
    let next = json!({"role": "user", "content": "Thanks. And then?"});
    let x = s
        .post(
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": user}, call, result, answer, next])),
        )
        .await;
    let cached = x["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The whole previous prompt (past the tool block and its result) came from disk.
    assert!(
        cached >= prompt2,
        "cached {cached}, previous prompt {prompt2}: {x}"
    );
    assert_eq!(s.metric("ds4_kv_disk_hits_total"), 1);
    let t = std::fs::read_to_string(&trace_path).unwrap();
    assert!(
        t.contains(SAMPLED_DSML),
        "the exact sampled DSML is rendered: {t}"
    );
    let _ = std::fs::remove_file(&trace_path);
}
