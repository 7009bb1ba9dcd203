use super::common::{encode_pieces, think_mode, ModelArgs, SampleArgs};
use crate::progress;
use anyhow::{Context, Result};
use ds4_chat::ThinkMode;
use ds4_engine::Sampler;
use ds4_tokenizer::StreamDecoder;
use rustyline::error::ReadlineError;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Args)]
#[command(after_help = "Commands inside the REPL:\n  \
    /help            this list\n  \
    /reset           forget the conversation\n  \
    /think MODE      none | high | max for the next turns\n  \
    /save FILE       write the session (KV state and tokens) to FILE\n  \
    /load FILE       continue from a session saved with /save\n  \
    /quit            leave (or Ctrl-D)\n\
    End a line with \\ to continue the message on the next line. Ctrl-C stops the reply being \
    generated; at the prompt it clears the line.")]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt (default "You are a helpful assistant"; "" for none).
    #[arg(long)]
    system: Option<String>,
    /// Thinking mode for the conversation.
    #[arg(long, default_value = "none", value_parser = ["none", "high", "max"])]
    think: String,
    /// Tokens to generate at most per reply.
    #[arg(short = 'n', long, default_value_t = 2048)]
    max_tokens: usize,
    #[command(flatten)]
    sample: SampleArgs,
}

const HELP: &str = "/help  /reset  /think none|high|max  /save FILE  /load FILE  /quit — end a line with \\ to continue it";

pub fn run(a: Args) -> Result<()> {
    let engine = a.model.open()?;
    let tok = engine.tokenizer().clone();
    let eos = tok.specials().eos;
    let mut mode = think_mode(&a.think);
    let prelude =
        |mode: ThinkMode| encode_pieces(&tok, &ds4_chat::cli_prelude(a.system.as_deref(), mode));
    // The transcript as token ids; the session is synced to it before each reply.
    let mut transcript = prelude(mode)?;
    let mut session = engine.new_session(a.model.ctx);
    let mut sampler = Sampler::new(a.sample.config());
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst))
            .context("installing the Ctrl-C handler")?;
    }
    let mut rl = rustyline::DefaultEditor::new()?;
    eprintln!(
        "ds4 chat — {} ({} backend). {HELP}",
        engine.path().display(),
        engine.backend_name()
    );
    loop {
        let mut msg = String::new();
        let mut prompt = "> ";
        loop {
            match rl.readline(prompt) {
                Ok(line) => {
                    if let Some(part) = line.strip_suffix('\\') {
                        msg.push_str(part);
                        msg.push('\n');
                        prompt = ". ";
                        continue;
                    }
                    msg.push_str(&line);
                    break;
                }
                Err(ReadlineError::Interrupted) => {
                    msg.clear();
                    prompt = "> ";
                    continue;
                }
                Err(ReadlineError::Eof) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        let msg = msg.trim_end().to_string();
        if msg.is_empty() {
            continue;
        }
        let _ = rl.add_history_entry(msg.as_str());
        if let Some(cmd) = msg.strip_prefix('/') {
            let (name, arg) = cmd
                .split_once(' ')
                .map_or((cmd, ""), |(n, a)| (n, a.trim()));
            match name {
                "help" => eprintln!("{HELP}"),
                "quit" | "exit" => return Ok(()),
                "reset" => {
                    transcript = prelude(mode)?;
                    session.reset();
                    eprintln!("(conversation cleared)");
                }
                "think" => match arg {
                    "none" | "high" | "max" => {
                        mode = think_mode(arg);
                        eprintln!("(thinking mode {arg} from the next turn)");
                    }
                    _ => eprintln!("usage: /think none|high|max"),
                },
                "save" if !arg.is_empty() => {
                    session.sync(&transcript, &mut |_, _| {})?;
                    match std::fs::write(arg, session.snapshot()) {
                        Ok(()) => eprintln!("(saved {} tokens to {arg})", transcript.len()),
                        Err(e) => eprintln!("cannot write {arg}: {e}"),
                    }
                }
                "load" if !arg.is_empty() => match std::fs::read(arg)
                    .map_err(anyhow::Error::from)
                    .and_then(|b| session.restore(&b).map_err(anyhow::Error::from))
                {
                    Ok(()) => {
                        transcript = session.tokens().to_vec();
                        eprintln!("(loaded {} tokens from {arg})", transcript.len());
                    }
                    Err(e) => eprintln!("cannot load {arg}: {e:#}"),
                },
                _ => eprintln!("unknown command /{name}. {HELP}"),
            }
            continue;
        }
        transcript.extend(encode_pieces(&tok, &ds4_chat::cli_user_turn(&msg, mode))?);
        if transcript.len() >= session.ctx() {
            eprintln!(
                "(context full: {} tokens; /reset to start over)",
                transcript.len()
            );
            continue;
        }
        let pb = progress::count("prefill", transcript.len() as u64);
        stop.store(false, Ordering::SeqCst);
        session.sync(&transcript, &mut |done, _| pb.set_position(done as u64))?;
        pb.finish_and_clear();
        let mut dec = StreamDecoder::new();
        let mut out = std::io::stdout().lock();
        let mut picked: Option<u32> = None;
        for _ in 0..a.max_tokens {
            if stop.load(Ordering::SeqCst) {
                eprint!("\n(stopped)");
                break;
            }
            // The first token from the prompt's logits, then sampled on the backend.
            let next = match picked.take() {
                Some(t) => t,
                None => {
                    let Some(logits) = session.logits() else {
                        break;
                    };
                    sampler.sample(logits)
                }
            };
            transcript.push(next);
            if next == eos || transcript.len() >= session.ctx() {
                break;
            }
            out.write_all(dec.push(&tok, next)?.as_bytes())?;
            out.flush()?;
            picked = Some(session.eval_sampled(next, &mut sampler)?);
        }
        out.write_all(dec.flush().as_bytes())?;
        writeln!(out)?;
        // The REPL keeps earlier reasoning; the turn always ends with EOS in the transcript.
        if transcript.last() != Some(&eos) {
            transcript.push(eos);
        }
    }
}
