//! `ds4`: the one binary. Each subcommand lives in `cmd/` and uses only the library crates'
//! public APIs.

mod cmd;
mod progress;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ds4",
    version,
    about = "Native inference engine for DeepSeek V4 Flash",
    long_about = "Native inference engine for DeepSeek V4 Flash (GGUF, q2/q4 mixes).\n\n\
        Quick start without the real weights:\n  \
        ds4 synth --preset tiny -o models/tiny.gguf\n  \
        ds4 inspect models/tiny.gguf\n  \
        ds4 tokenize -m models/tiny.gguf 'Hello, world'\n  \
        ds4 run -m models/tiny.gguf -p 'Hello' -n 16"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic DeepSeek V4 GGUF (random weights, real layout and tokenizer).
    Synth(cmd::synth::Args),
    /// Describe a GGUF file: architecture, hyper-parameters, tensors by type, weight check.
    Inspect(cmd::inspect::Args),
    /// Print the token ids of a text as a JSON array (or decode ids with --decode).
    Tokenize(cmd::tokenize::Args),
    /// Generate a reply to one prompt, streamed to stdout.
    Run(cmd::run::Args),
    /// Interactive chat (REPL) with history, /commands and Ctrl-C to stop a reply.
    Chat(cmd::chat::Args),
    /// Write the logits after every position of a token sequence to a .npy file.
    Logits(cmd::logits::Args),
    /// Prefill and decode speed at growing context frontiers, as CSV.
    Bench(cmd::bench::Args),
    /// List compute devices, GPU drivers and kernel compilers found on this machine.
    Devices,
    /// OpenAI- and Anthropic-compatible HTTP server (chat, completions, responses, messages).
    Serve(cmd::serve::Args),
    /// Disk KV cache directory: list entries, show one file, remove entries.
    Kv(cmd::kv::Args),
    /// Compile the GPU kernels for a target into the disk cache ahead of time (no GPU needed).
    Kernels(cmd::kernels::Args),
}

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of stdout goes away (`ds4 … | head`)
    // instead of failing a write.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let r = match cli.cmd {
        Command::Synth(a) => cmd::synth::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Devices => {
            ds4_engine::device_report()
                .iter()
                .for_each(|l| println!("{l}"));
            Ok(())
        }
        Command::Serve(a) => cmd::serve::run(a),
        Command::Kv(a) => cmd::kv::run(a),
        Command::Kernels(a) => cmd::kernels::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The context chain, without repeating a cause its wrapper already quotes.
            let mut msg = String::new();
            for cause in e.chain() {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&c);
                }
            }
            eprintln!("ds4: error: {msg}");
            ExitCode::FAILURE
        }
    }
}
