//! `--synthetic` (file-less models generated on the GPU) and GPU backend errors: clear
//! messages, no panic, nothing on stdout when the model cannot be built.

use std::process::{Command, Output};

fn ds4(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(args)
        .output()
        .expect("run ds4")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn has_gpu() -> bool {
    let o = ds4(&["devices"]);
    text(&o.stdout)
        .lines()
        .any(|l| l.contains(" device ") && !l.contains("cannot open"))
}

#[test]
fn synthetic_on_the_cpu_is_a_clear_error_and_writes_nothing() {
    let o = ds4(&[
        "bench",
        "--synthetic",
        "tiny",
        "--backend",
        "cpu",
        "--ctx-start",
        "8",
        "--ctx-max",
        "8",
    ]);
    let err = text(&o.stderr);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty(), "{}", text(&o.stdout));
    assert!(
        err.contains("synthetic models are generated on a GPU"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn synthetic_and_model_conflict() {
    let o = ds4(&["bench", "--synthetic", "tiny", "-m", "x.gguf"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("cannot be used with"));
    let o = ds4(&["bench"]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--model"), "{}", text(&o.stderr));
}

#[test]
fn gpu_backend_without_a_gpu_is_a_clear_error() {
    if has_gpu() {
        println!("skipped: a GPU is present");
        return;
    }
    for backend in ["cuda", "rocm"] {
        let o = ds4(&["bench", "--synthetic", "tiny", "--backend", backend]);
        let err = text(&o.stderr);
        assert!(!o.status.success());
        assert!(o.stdout.is_empty());
        assert!(err.contains("no usable GPU: use --backend cpu"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // auto with no GPU is the CPU, quietly (here: the CPU cannot generate weights).
    let o = ds4(&["bench", "--synthetic", "tiny"]);
    let err = text(&o.stderr);
    assert!(err.contains("backend cpu"), "{err}");
}

#[test]
fn devices_reports_full_size_memory() {
    let o = ds4(&["devices"]);
    assert!(o.status.success());
    let out = text(&o.stdout);
    assert!(
        out.contains("full-size model: weights 80.8 GiB (q2) / 153.3 GiB (q4)"),
        "{out}"
    );
    // What a GPU holds with every routed expert in host memory (--cpu-experts all): the dense
    // 8.2 GiB and the decode-layout copies of their Q8_0 matrices.
    assert!(
        out.contains(
            "routed experts 72.6 / 145.1 GiB; a GPU also holds 6.1 / 6.1 GiB of decode-layout \
             copies (--cpu-experts all leaves 14.3 / 14.3 GiB on the GPU with them)"
        ),
        "{out}"
    );
}
