//! The `ds4` binary end to end: synth → inspect → tokenize, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ds4(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(args)
        .output()
        .expect("run ds4")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ds4 synth --preset tiny` into `dir`; returns the model path.
fn synth_tiny(dir: &Path) -> PathBuf {
    let m = dir.join("tiny.gguf");
    let o = ds4(&["synth", "--preset", "tiny", "-o", s(&m)]);
    assert!(o.status.success(), "{}", stderr(&o));
    m
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn full_size_sparse_files_match_the_published_totals() {
    let d = tmpdir("full");
    let q2 = d.join("q2.gguf");
    let o = ds4(&[
        "synth",
        "--preset",
        "full-q2",
        "--sparse",
        "--mtp",
        "-o",
        s(&q2),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ds4(&["inspect", s(&q2)]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("1328 tensors, 284.3 B parameters, 80.76 GiB of tensor data"),
        "{out}"
    );
    assert!(out.contains("weights       OK: 1328 tensors"), "{out}");
    assert!(out.contains("tokenizer     129280 tokens"), "{out}");
    let o = ds4(&["inspect", s(&d.join("q2-mtp.gguf"))]);
    assert!(
        stdout(&o).contains("OK: 32 tensors match the DeepSeek V4 MTP layout"),
        "{}",
        stdout(&o)
    );

    let q4 = d.join("q4.gguf");
    assert!(
        ds4(&["synth", "--preset", "full-q4", "--sparse", "-o", s(&q4)])
            .status
            .success()
    );
    let out = stdout(&ds4(&["inspect", s(&q4)]));
    assert!(out.contains("(153.33 GiB)"), "{out}"); // the published file size
    assert!(
        out.contains("1328 tensors, 284.3 B parameters, 153.32 GiB of tensor data"),
        "{out}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `ds4 synth --layers N`: the real shapes with the first N layers (their routing and
/// compression as in the whole model), a layout `inspect` accepts; past the preset's count, an
/// error naming it.
#[test]
fn synth_keeps_the_first_layers_when_asked() {
    let d = tmpdir("layers");
    let m = d.join("q2-4.gguf");
    let o = ds4(&[
        "synth",
        "--preset",
        "full-q2",
        "--layers",
        "4",
        "--sparse",
        "-o",
        s(&m),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&ds4(&["inspect", s(&m)]));
    assert!(out.contains("layers      4 ("), "{out}");
    assert!(out.contains("weights       OK:"), "{out}");
    let o = ds4(&["synth", "--preset", "tiny", "--layers", "7", "-o", s(&m)]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--layers 7: the tiny preset has 6 layers"),
        "{}",
        stderr(&o)
    );
    let o = ds4(&["synth", "--preset", "tiny", "--layers", "0", "-o", s(&m)]);
    assert!(!o.status.success(), "0 layers refused");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn tiny_model_round_trips_text_through_the_tokenizer() {
    let d = tmpdir("tiny");
    let m = synth_tiny(&d);
    let out = stdout(&ds4(&["inspect", s(&m)]));
    assert!(
        out.contains("layers      6 (2 SWA, 2 CSA, 2 HCA; hash-routed 0-2)"),
        "{out}"
    );
    let text = "Hello <｜User｜> wörld 👋\n\tfn main() {}";
    let o = ds4(&["tokenize", "-m", s(&m), text]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: Vec<u32> = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(
        ids.contains(&2),
        "<｜User｜> is special id 2 in the tiny vocabulary: {ids:?}"
    );
    let json = serde_json::to_string(&ids).unwrap();
    let o = ds4(&["tokenize", "-m", s(&m), "--decode", &json]);
    assert_eq!(stdout(&o), text);
    // --no-specials encodes the marker as plain text.
    let plain: Vec<u32> = serde_json::from_str(
        stdout(&ds4(&["tokenize", "-m", s(&m), "--no-specials", text])).trim(),
    )
    .unwrap();
    assert!(!plain.contains(&2));
    // Same seed, same bytes.
    let m2 = d.join("tiny2.gguf");
    assert!(ds4(&["synth", "--preset", "tiny", "-o", s(&m2)])
        .status
        .success());
    assert_eq!(std::fs::read(&m).unwrap(), std::fs::read(&m2).unwrap());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_input_gives_one_clear_error_and_no_panic() {
    let d = tmpdir("bad");
    let m = synth_tiny(&d);
    let bytes = std::fs::read(&m).unwrap();

    let trunc = d.join("trunc.gguf");
    std::fs::write(&trunc, &bytes[..bytes.len() - 1000]).unwrap();
    let o = ds4(&["inspect", s(&trunc)]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("trunc.gguf") && e.contains("truncated"), "{e}");
    assert!(!e.contains("panicked"), "{e}");

    let not = d.join("not.gguf");
    std::fs::write(&not, b"hello world, not a gguf file at all").unwrap();
    let e = stderr(&ds4(&["inspect", s(&not)]));
    assert!(
        e.contains("not.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );

    let e = stderr(&ds4(&["inspect", s(&d.join("missing.gguf"))]));
    assert!(e.contains("missing.gguf"), "{e}");

    let o = ds4(&["tokenize", "-m", s(&m), "--decode", "[1, 99999]"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("99999"), "{}", stderr(&o));
    let o = ds4(&["tokenize", "-m", s(&m), "--decode", "not json"]);
    assert!(stderr(&o).contains("JSON array"), "{}", stderr(&o));

    // --cpu-experts: a bad value names the accepted ones; a layer count with several ranks
    // (CPU reference ranks here) says why not.
    let run = ["run", "-m", s(&m), "-p", "hi"];
    let o = ds4(&[&run[..], &["--cpu-experts", "some"]].concat());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("expected auto, off, all or a number of layers"),
        "{e}"
    );
    let more = ["--backend", "cpu", "--devices", "0,1", "--cpu-experts", "2"];
    let o = ds4(&[&run[..], &more[..]].concat());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("--cpu-experts") && e.contains("--devices"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn run_and_logits_on_the_tiny_model() {
    let d = tmpdir("run");
    let m = synth_tiny(&d);
    // Greedy generation is deterministic; EOS is respected; logprobs are written per token.
    let lp = d.join("lp.jsonl");
    let args = [
        "run",
        "-m",
        s(&m),
        "-p",
        "Hello",
        "-n",
        "12",
        "--dump-logprobs",
        s(&lp),
        "--logprobs-top-k",
        "3",
    ];
    let a = ds4(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    let b = ds4(&args);
    assert_eq!(a.stdout, b.stdout);
    let reply = a.stdout.clone();
    let lines = std::fs::read_to_string(&lp).unwrap();
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["top"].as_array().unwrap().len(), 3);
    assert_eq!(
        first["token"], first["top"][0]["id"],
        "greedy picks the top logprob"
    );

    // logits: decode and --prefill paths give the same [T, vocab] float32 array.
    let ids = d.join("ids.txt");
    std::fs::write(&ids, "0, 17 300\n42,7 99 511 3 3 3 64 65 66").unwrap();
    let (o1, o2) = (d.join("a.npy"), d.join("b.npy"));
    let r = ds4(&["logits", "-m", s(&m), "--tokens", s(&ids), "--out", s(&o1)]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(ds4(&[
        "logits",
        "-m",
        s(&m),
        "--tokens",
        s(&ids),
        "--out",
        s(&o2),
        "--prefill"
    ])
    .status
    .success());
    let (a, b) = (std::fs::read(&o1).unwrap(), std::fs::read(&o2).unwrap());
    assert_eq!(a, b);
    let hlen = u16::from_le_bytes([a[8], a[9]]) as usize;
    let header = std::str::from_utf8(&a[10..10 + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'") && header.contains("'shape': (13, 512)"),
        "{header}"
    );
    assert_eq!((10 + hlen) % 64, 0);
    assert_eq!(a.len(), 10 + hlen + 13 * 512 * 4);

    std::fs::write(&ids, "1 2 x").unwrap();
    let e = stderr(&ds4(&[
        "logits",
        "-m",
        s(&m),
        "--tokens",
        s(&ids),
        "--out",
        s(&o1),
    ]));
    assert!(e.contains("entry 3") && e.contains("\"x\""), "{e}");
    let e = stderr(&ds4(&["run", "-m", s(&m), "-p", "hi", "--backend", "cuda"]));
    assert!(e.contains("cuda") && e.contains("--backend cpu"), "{e}");

    // Expert parallelism: 3 CPU reference ranks give the same greedy reply; GPU ranks that
    // cannot open are one clear error.
    let mut ep = args.to_vec();
    ep.extend(["--backend", "cpu", "--devices", "0,1,2"]);
    let c = ds4(&ep);
    assert!(c.status.success(), "{}", stderr(&c));
    assert_eq!(c.stdout, reply);
    // 2 ranks also split the attention heads and the shared expert (tensor parallelism, the
    // default), or not (`--parallel ep`): the same reply either way; an unknown form is refused.
    for par in ["tp+ep", "ep"] {
        let mut tp = args.to_vec();
        tp.extend(["--backend", "cpu", "--devices", "0,1", "--parallel", par]);
        let c = ds4(&tp);
        assert!(c.status.success(), "{par}: {}", stderr(&c));
        assert_eq!(c.stdout, reply, "{par}");
    }
    let mut bad = args.to_vec();
    bad.extend(["--backend", "cpu", "--devices", "0,1", "--parallel", "tp"]);
    let e = stderr(&ds4(&bad));
    assert!(e.contains("--parallel") && e.contains("tp+ep"), "{e}");
    let o = ds4(&[
        "run",
        "-m",
        s(&m),
        "-p",
        "hi",
        "--backend",
        "cuda",
        "--devices",
        "0,7",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("GPU") && e.contains("--backend cpu"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn chat_repl_commands_and_ctrl_c_stops_only_the_reply() {
    use std::io::{Read, Write};
    use std::process::Stdio;
    let d = tmpdir("chat");
    let m = synth_tiny(&d);
    let snap = d.join("s.bin");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(["chat", "-m", s(&m), "-n", "1000000", "--ctx", "100000000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "first\\\nline two").unwrap();
    stdin.flush().unwrap();
    // Let it generate, then Ctrl-C: the reply stops, the REPL goes on.
    let mut stdout = child.stdout.take().unwrap();
    let mut buf = [0u8; 64];
    let _ = stdout.read(&mut buf).unwrap();
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    writeln!(
        stdin,
        "/save {}\n/reset\n/load {}\n/quit",
        s(&snap),
        s(&snap)
    )
    .unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("(stopped)"), "{err}");
    assert!(err.contains("(conversation cleared)"), "{err}");
    assert!(err.contains("(saved ") && err.contains("(loaded "), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn devices_report_and_closed_pipes_do_not_panic() {
    let o = ds4(&["devices"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("cpu: "), "{out}");
    assert!(
        out.contains("cuda") && out.contains("rocm") && out.contains("nvrtc"),
        "{out}"
    );
    // Whether the vendor BLAS (dense prefill products) loads, found or not.
    for l in ["cublaslt: ", "hipblaslt: "] {
        assert!(out.lines().any(|x| x.starts_with(l)), "{l} {out}");
    }
    // A reader that goes away early (`ds4 … | head -1`) ends the process quietly.
    let d = tmpdir("pipe");
    let m = d.join("q2.gguf");
    assert!(
        ds4(&["synth", "--preset", "full-q2", "--sparse", "-o", s(&m)])
            .status
            .success()
    );
    let sh = format!(
        "{} inspect --tensors {} | head -1",
        env!("CARGO_BIN_EXE_ds4"),
        s(&m)
    );
    let o = Command::new("sh").args(["-c", &sh]).output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 1);
    std::fs::remove_dir_all(&d).ok();
}

/// `ds4 kernels`: bad targets and module names are clear errors; with NVRTC present (CI
/// installs the pip wheel) one module compiles into the cache, a second run finds it cached,
/// and `--prune` removes a stale entry of the same target and keeps other files.
#[test]
fn kernels_precompiles_into_the_cache() {
    let d = tmpdir("kernels");
    let o = ds4(&["kernels", "--target", "sm_9x", "--cache", s(&d)]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("kernel target `sm_9x`"),
        "{}",
        stderr(&o)
    );
    let o = ds4(&[
        "kernels",
        "--target",
        "sm_90a",
        "--module",
        "nope",
        "--cache",
        s(&d),
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    if e.contains("NVRTC") && !e.contains("no kernel module") {
        println!("skipped: NVRTC unavailable here: {e}");
        return;
    }
    assert!(
        e.contains("no kernel module `nope`") && e.contains("attention"),
        "{e}"
    );
    let stale = d.join("quant-sm_90a-0000.cubin");
    let other = d.join("notes.txt");
    std::fs::write(&stale, b"old").unwrap();
    std::fs::write(&other, b"keep").unwrap();
    let args = [
        "kernels",
        "--target",
        "sm_90a",
        "--module",
        "quant",
        "--cache",
        s(&d),
    ];
    let o = ds4(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("quant") && stdout(&o).contains("compiled"),
        "{}",
        stdout(&o)
    );
    let mut again = args.to_vec();
    again.push("--prune");
    let o = ds4(&again);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("cached"), "{}", stdout(&o));
    assert!(!stale.exists() && other.exists());
    let cubins = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".cubin.ds4"))
        .count();
    assert_eq!(cubins, 1);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bench_writes_one_csv_row_per_frontier_after_the_warm_up() {
    let d = tmpdir("bench");
    let m = synth_tiny(&d);
    let csv = d.join("b.csv");
    let args = |warm: &'static str| {
        let mut v = vec!["bench", "-m", s(&m), "--backend", "cpu", "--ctx-start", "8"];
        v.extend(["--ctx-max", "16", "--gen-tokens", "2", "--warmup", warm]);
        v
    };
    let mut a = args("1");
    a.extend(["--csv", s(&csv)]);
    let o = ds4(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes"
    );
    // Frontiers 8 and 16 (doubling); the second prefills only the 8 new tokens.
    assert_eq!(lines.len(), 3, "{out}");
    assert!(
        lines[1].starts_with("8,8,") && lines[2].starts_with("16,8,"),
        "{out}"
    );
    for l in &lines[1..] {
        let f: Vec<&str> = l.split(',').collect();
        assert_eq!(f.len(), 6, "{l}");
        assert!(f[2].parse::<f64>().unwrap() > 0.0 && f[4].parse::<f64>().unwrap() > 0.0);
        assert_eq!(f[3], "2");
    }
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), out);
    let err = stderr(&o);
    assert!(err.contains("# warm-up 1: 8 tokens + 2 generated"), "{err}");
    let o = ds4(&args("0"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("warm-up"), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 3);
}

/// `ds4 bench` of the tiny model `m` on the CPU at frontiers 8 and 16, 3 generated tokens, one
/// warm-up, plus `extra`.
fn tiny_bench(m: &Path, extra: &[&str]) -> Output {
    let mut v = vec!["bench", "-m", s(m), "--backend", "cpu", "--ctx-start", "8"];
    v.extend(["--ctx-max", "16", "--gen-tokens", "3", "--warmup", "1"]);
    v.extend(extra);
    ds4(&v)
}

/// A bench CSV's rows after its header, split into fields.
fn csv_rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

/// [`tiny_bench`] with `extra` and without: both succeed with a row a frontier, and each row
/// has the plain run's frontier and state size. The run's output and its rows.
fn bench_against_plain(m: &Path, extra: &[&str]) -> (Output, Vec<Vec<String>>) {
    let o = tiny_bench(m, extra);
    assert!(o.status.success(), "{}", stderr(&o));
    let plain = tiny_bench(m, &[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let (rows, plain) = (csv_rows(&stdout(&o)), csv_rows(&stdout(&plain)));
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (r, p) in rows.iter().zip(&plain) {
        assert_eq!(r.len(), 9, "{rows:?}");
        assert_eq!((&r[0], &r[5]), (&p[0], &p[5]), "{rows:?}\n{plain:?}");
    }
    (o, rows)
}

#[test]
fn bench_decode_only_times_decode_on_random_states() {
    let d = tmpdir("bench-dec");
    let m = synth_tiny(&d);
    let (o, rows) = bench_against_plain(&m, &["--decode-only", "--spec-accept", "1"]);
    for r in &rows {
        // No prefill: its columns empty; decode timed; the state's size that of the context.
        assert_eq!((&*r[1], &*r[2], &*r[3]), ("", "", "3"), "{rows:?}");
        assert!(r[4].parse::<f64>().unwrap() > 0.0 && r[6].parse::<f64>().unwrap() > 0.0);
    }
    let err = stderr(&o);
    assert!(
        err.contains("# 16: random state of 16 positions in"),
        "{err}"
    );
}

#[test]
fn bench_turn_times_a_prefill_on_random_states() {
    let d = tmpdir("bench-turn");
    let m = synth_tiny(&d);
    let run = |extra: &[&str]| tiny_bench(&m, extra);
    let (o, rows) = bench_against_plain(&m, &["--turn", "3", "--spec-accept", "1"]);
    for r in &rows {
        // The turn's 3 tokens prefilled and timed, decode timed, the state a full context's.
        assert_eq!((&*r[1], &*r[3]), ("3", "3"), "{rows:?}");
        for c in [2, 4, 6] {
            assert!(r[c].parse::<f64>().unwrap() > 0.0, "{rows:?}");
        }
    }
    let err = stderr(&o);
    assert!(
        err.contains("# 16: random state of 13 positions in"),
        "{err}"
    );
    // A turn as long as the first frontier, or beside --decode-only: refused.
    let o = run(&["--turn", "8"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--turn 8: a turn is 1 to --ctx-start - 1 tokens"),
        "{}",
        stderr(&o)
    );
    let o = run(&["--turn", "2", "--decode-only"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
}

/// `ds4 bench` of the tiny model `m` on the CPU at frontier 16, 12 generated tokens, no warm-up,
/// speculative at rates 1 and 0.
fn spec_bench_args(m: &Path) -> Vec<&str> {
    let mut a = vec!["bench", "-m", s(m), "--backend", "cpu", "--ctx-start", "16"];
    a.extend(["--ctx-max", "16", "--gen-tokens", "12", "--warmup", "0"]);
    a.extend(["--spec-accept", "1,0"]);
    a
}

#[test]
fn bench_spec_accept_times_oracle_drafts_at_each_rate() {
    let d = tmpdir("bench-spec");
    let m = synth_tiny(&d);
    let o = ds4(&spec_bench_args(&m));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes,\
         spec1_tps,spec1_drafted,spec1_accepted,spec0_tps,spec0_drafted,spec0_accepted"
    );
    assert_eq!(lines.len(), 2, "{out}");
    let f: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(f.len(), 12, "{out}");
    let n = |i: usize| f[i].parse::<f64>().unwrap();
    assert!(n(6) > 0.0 && n(9) > 0.0, "{out}");
    // Always kept: a 2-token step per draft (the first token has no streams yet, so 12 tokens
    // take one plain step, 5 drafts, and a last plain step).
    assert!(n(7) >= 4.0 && n(8) == n(7), "{out}");
    // Never kept: a draft at every token but the first and last, each rolled back.
    assert!(n(10) >= 9.0 && n(11) == 0.0, "{out}");
    // Kept drafts are the plain run's tokens: at rate 1 the output is the plain run's.
    assert!(
        !stderr(&o).contains("differ from the plain"),
        "{}",
        stderr(&o)
    );
    let o = ds4(&[
        "bench",
        "-m",
        s(&m),
        "--backend",
        "cpu",
        "--spec-accept",
        "1.5",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--spec-accept 1.5"), "{}", stderr(&o));
}

/// `bench --spec-mtp`: the drafts come from the MTP block (`--mtp FILE`), a draft at every step
/// but the first and last as with the oracle, at each forced rate; refused without an MTP block.
#[test]
fn bench_spec_mtp_times_the_mtp_blocks_drafts() {
    let d = tmpdir("bench-spec-mtp");
    let m = d.join("tiny.gguf");
    let o = ds4(&["synth", "--preset", "tiny", "--mtp", "-o", s(&m)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mtp = d.join("tiny-mtp.gguf");
    let mut a = spec_bench_args(&m);
    a.push("--spec-mtp");
    let o = ds4(&[&a[..], &["--mtp", s(&mtp)]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let f: Vec<f64> = out
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split(',')
        .map(|v| v.parse().unwrap_or(-1.0))
        .collect();
    assert_eq!(f.len(), 12, "{out}");
    assert!(f[6] > 0.0 && f[9] > 0.0, "{out}");
    assert!(f[7] >= 4.0 && f[8] == f[7], "{out}");
    assert!(f[10] >= 9.0 && f[11] == 0.0, "{out}");
    // Without an MTP block: a clear refusal.
    let o = ds4(&a);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--spec-mtp: the model has no MTP block"),
        "{}",
        stderr(&o)
    );
}

/// `run --mtp`: speculative decoding under a sampler prints plain sampling's reply (the CPU's
/// 2-token rows are bit-identical to single steps) and the drafts' count.
#[test]
fn run_with_mtp_prints_the_plain_reply() {
    let d = tmpdir("run-mtp");
    let m = d.join("tiny.gguf");
    let o = ds4(&["synth", "--preset", "tiny", "--mtp", "-o", s(&m)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mtp = d.join("tiny-mtp.gguf");
    for sample in [
        &["--temp", "0"][..],
        &["--temp", "0.9", "--top-k", "50", "--seed", "5"],
    ] {
        let base = [
            &[
                "run",
                "-m",
                s(&m),
                "-p",
                "Hello",
                "-n",
                "24",
                "--backend",
                "cpu",
            ][..],
            sample,
        ]
        .concat();
        let plain = ds4(&base);
        assert!(plain.status.success(), "{}", stderr(&plain));
        let spec = ds4(&[&base[..], &["--mtp", s(&mtp)]].concat());
        assert!(spec.status.success(), "{}", stderr(&spec));
        assert_eq!(stdout(&plain), stdout(&spec), "{sample:?}");
        let e = stderr(&spec);
        // A draft at every step but the last (24 tokens, no end token on these weights).
        let drafts: usize = e
            .split("mtp: ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no draft count: {e}"));
        assert!(drafts >= 12, "{e}");
        assert!(!stderr(&plain).contains("mtp: "));
    }
    // Logprobs need every step's logits: no drafts, and it says why.
    let lp = d.join("lp.jsonl");
    let o = ds4(&[
        "run",
        "-m",
        s(&m),
        "-p",
        "Hi",
        "-n",
        "4",
        "--backend",
        "cpu",
        "--mtp",
        s(&mtp),
        "--dump-logprobs",
        s(&lp),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("mtp: drafts not used (--dump-logprobs"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&d).ok();
}
