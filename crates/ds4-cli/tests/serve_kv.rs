//! `ds4 serve` with the disk KV cache as a real process: a SIGTERM writes the live session
//! and a restarted server continues from it with the same reply; kill -9 during checkpoint
//! writes never leaves an entry that is used wrongly, and the server always starts again.

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-serve-kv-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn model(dir: &Path) -> PathBuf {
    let m = dir.join("tiny.gguf");
    let o = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(["synth", "--preset", "tiny", "-o"])
        .arg(&m)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    m
}

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `ds4 serve` and waits until the model is loaded.
fn start(model: &Path, force: &Path, disk: Option<&Path>, extra: &[&str]) -> Server {
    let port = free_port();
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4"));
    c.arg("serve")
        .arg("-m")
        .arg(model)
        .args([
            "--ctx",
            "2048",
            "--threads",
            "1",
            "--port",
            &port.to_string(),
        ])
        .arg("--test-force-output")
        .arg(force)
        .args([
            "--kv-cache-min-tokens",
            "32",
            "--kv-cache-boundary-align-tokens",
            "32",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(d) = disk {
        c.arg("--kv-disk-dir").arg(d);
    }
    let s = Server {
        child: c.spawn().unwrap(),
        port,
    };
    let t = Instant::now();
    loop {
        if let Some((200, _)) = request(port, "GET", "/health", None) {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A minimal HTTP/1.1 client (Connection: close): (status, body).
fn request(port: u16, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let b = body.map(|v| v.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// One chat turn (thinking off, greedy, 6 tokens): (reply, prompt tokens, cached tokens).
fn chat(s: &Server, msgs: &[(&str, &str)]) -> (String, u64, u64) {
    let m: Vec<Value> = msgs
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    let body = json!({"model": "deepseek-chat", "messages": m, "max_tokens": 6, "temperature": 0});
    let (st, b) = request(s.port, "POST", "/v1/chat/completions", Some(&body)).unwrap();
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let u = &v["usage"];
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .into(),
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

fn sigterm_and_wait(mut s: Server) {
    let st = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let t = Instant::now();
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            assert!(st.success(), "exit status {st}");
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kv_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "kv"))
        .collect()
}

fn tmp_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".kv.tmp."))
        .count()
}

const USER: &str = "Tell me about foxes. ";

fn user() -> String {
    USER.repeat(20)
}

#[test]
fn sigterm_writes_the_session_and_a_restarted_server_continues_with_the_same_reply() {
    let dir = tmpdir("restart");
    let m = model(&dir);
    let force = dir.join("force.txt");
    let u = user();
    let turn2 = [
        ("user", u.as_str()),
        ("assistant", "Foxes are small."),
        ("user", "More?"),
    ];
    // Reference: both turns on one server, no disk cache.
    std::fs::write(&force, "Foxes are small.").unwrap();
    let s = start(&m, &force, None, &[]);
    chat(&s, &[("user", &u)]);
    std::fs::remove_file(&force).unwrap();
    let want = chat(&s, &turn2);
    drop(s);
    assert!(
        want.2 > 64,
        "the reference reused its live session: {want:?}"
    );
    // Turn 1, SIGTERM, restart, turn 2.
    let kv = dir.join("kv");
    std::fs::write(&force, "Foxes are small.").unwrap();
    let s = start(&m, &force, Some(&kv), &[]);
    chat(&s, &[("user", &u)]);
    sigterm_and_wait(s);
    assert!(!kv_files(&kv).is_empty());
    std::fs::remove_file(&force).unwrap();
    let s = start(&m, &force, Some(&kv), &[]);
    let got = chat(&s, &turn2);
    assert_eq!(
        got, want,
        "only the new turn is prefilled and the reply is the same"
    );
    let (_, metrics) = request(s.port, "GET", "/metrics", None).unwrap();
    assert!(
        metrics.contains("\nds4_kv_disk_hits_total 1\n"),
        "{metrics}"
    );
}

#[test]
fn kill_9_during_checkpoint_writes_never_leaves_a_used_corrupt_entry() {
    let dir = tmpdir("crash");
    let m = model(&dir);
    let force = dir.join("force.txt");
    let kv = dir.join("kv");
    // A long forced answer with a checkpoint every 32 generated tokens.
    let answer = "Foxes are small. ".repeat(60);
    let flags = ["--kv-cache-continued-interval-tokens", "32"];
    let mut mid_write = 0;
    for i in 0..10 {
        std::fs::write(&force, &answer).unwrap();
        let mut s = start(&m, &force, Some(&kv), &flags);
        let port = s.port;
        let u = user();
        let h = std::thread::spawn(move || {
            let body = json!({"model": "deepseek-chat", "messages": [{"role":"user","content": u}], "max_tokens": 400});
            let _ = request(port, "POST", "/v1/chat/completions", Some(&body));
        });
        // Let earlier checkpoints complete (so each round gets further), then kill the
        // moment the next one is being written (its temporary file exists).
        let t = Instant::now();
        while kv_files(&kv).len() < i / 2 && !h.is_finished() {}
        while tmp_files(&kv) == 0 && !h.is_finished() && t.elapsed() < Duration::from_secs(10) {}
        s.child.kill().unwrap(); // SIGKILL
        s.child.wait().unwrap();
        h.join().unwrap();
        // (Most rounds die inside the write and leave the temporary file behind.)
        mid_write += (tmp_files(&kv) > 0) as usize;
        // Every entry present is complete and valid (written to a temporary file first).
        for f in kv_files(&kv) {
            if let Err(e) = ds4_kvstore::read_file(&f) {
                panic!("round {i}: {} is invalid: {e}", f.display());
            }
        }
    }
    assert!(!kv_files(&kv).is_empty(), "some checkpoints were written");
    eprintln!("{mid_write} of 10 kills hit a write in progress");
    assert!(
        mid_write >= 3,
        "only {mid_write} kills hit a write in progress"
    );
    // Reference reply for a prompt that extends the stored checkpoints.
    std::fs::remove_file(&force).unwrap();
    let u = user();
    let said = "Foxes are small. ".repeat(20);
    let turn2 = [
        ("user", u.as_str()),
        ("assistant", said.trim_end()),
        ("user", "More?"),
    ];
    let s = start(&m, &force, None, &[]);
    let want = chat(&s, &turn2);
    drop(s);
    // The server starts on the crashed directory, removes the dead writers' temporary
    // files, and any entry it uses gives the same reply as a cold prefill.
    let s = start(&m, &force, Some(&kv), &flags);
    assert_eq!(tmp_files(&kv), 0);
    let got = chat(&s, &turn2);
    assert_eq!((&got.0, got.1), (&want.0, want.1));
    assert!(got.2 > 0, "a checkpoint was reused: {got:?}");
}
