use super::common::{encode_pieces, think_mode, ModelArgs, SampleArgs};
use crate::progress;
use anyhow::{bail, Context, Result};
use ds4_engine::{top_logprobs, Drafted, Sampler, SpecStats};
use ds4_tokenizer::StreamDecoder;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    ds4 run -m models/tiny.gguf -p 'Write a haiku' -n 32\n  \
    ds4 run -m model.gguf --think high --temp 0.6 --top-p 0.95 -p 'Why is the sky blue?'\n  \
    ds4 run -m model.gguf --prompt-file prompt.txt --dump-tokens")]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The user prompt. A prompt starting with <｜begin▁of▁sentence｜> is used as an
    /// already-rendered transcript.
    #[arg(short, long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// System prompt (default "You are a helpful assistant"; "" for none).
    #[arg(long)]
    system: Option<String>,
    /// Thinking mode: none answers directly, high/max reason in <think> first.
    #[arg(long, default_value = "none", value_parser = ["none", "high", "max"])]
    think: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sample: SampleArgs,
    /// Print the prompt's token ids and each generated id to stderr.
    #[arg(long)]
    dump_tokens: bool,
    /// Write each generated token's top log-probabilities as JSON lines to FILE.
    #[arg(long)]
    dump_logprobs: Option<PathBuf>,
    /// How many alternatives --dump-logprobs records per token.
    #[arg(long, default_value_t = 5)]
    logprobs_top_k: usize,
}

pub fn run(a: Args) -> Result<()> {
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?
        }
        (None, None) => bail!("give a prompt with -p TEXT or --prompt-file FILE"),
    };
    let engine = a.model.open()?;
    super::common::note_host_experts(&engine);
    let tok = engine.tokenizer().clone();
    let mode = think_mode(&a.think);
    let ids = encode_pieces(
        &tok,
        &ds4_chat::cli_one_shot(a.system.as_deref(), &prompt, mode),
    )?;
    if a.dump_tokens {
        eprintln!("prompt tokens ({}): {:?}", ids.len(), ids);
    }
    let mut session = engine.new_session(a.model.ctx);
    let pb = progress::count("prefill", ids.len() as u64);
    session.sync(&ids, &mut |done, _| pb.set_position(done as u64))?;
    pb.finish_and_clear();
    let mut logprobs = match &a.dump_logprobs {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let mut sampler = Sampler::new(a.sample.config());
    let eos = tok.specials().eos;
    let mut dec = StreamDecoder::new();
    let mut out = std::io::stdout().lock();
    // Without logprobs each step samples on the backend (only the id comes back); with an MTP
    // file each step also drafts the token after it and checks it in the same 2-token step,
    // kept when the sampler picks it (the tokens plain sampling gives, any sampler; a GPU
    // picks both rows of the step itself).
    let spec = session.has_mtp() && logprobs.is_none();
    if session.has_mtp() && !spec {
        eprintln!("mtp: drafts not used (--dump-logprobs reads every step's logits)");
    }
    let mut picked: Option<u32> = None;
    let mut pre = false; // `picked` is a kept draft, already evaluated
    let mut stats = SpecStats::default();
    for _ in 0..a.max_tokens {
        let next = match picked.take() {
            Some(t) => t,
            None => {
                // The session's logits, or a kept draft's step's pick after it.
                let next = session
                    .pick(&mut sampler)?
                    .context("no logits after the prompt")?;
                if let (Some(w), Some(logits)) = (logprobs.as_mut(), session.logits()) {
                    let top: Vec<serde_json::Value> = top_logprobs(logits, a.logprobs_top_k)
                        .into_iter()
                        .map(|(id, lp)| serde_json::json!({"id": id, "logprob": lp}))
                        .collect();
                    writeln!(w, "{}", serde_json::json!({"token": next, "top": top}))?;
                }
                next
            }
        };
        if a.dump_tokens {
            eprintln!("token {next}");
        }
        if next == eos {
            break;
        }
        out.write_all(dec.push(&tok, next)?.as_bytes())?;
        out.flush()?;
        if std::mem::take(&mut pre) {
            continue; // evaluated with the token before it; the pick after it is the session's
        }
        if spec {
            let r = session.eval_draft(next, &mut sampler)?;
            stats.note(r);
            match r {
                Drafted::Accepted(d) => (picked, pre) = (Some(d), true),
                Drafted::Rejected(x) => picked = Some(x),
                Drafted::NoDraft => {
                    session.eval(next)?;
                }
            }
        } else if logprobs.is_some() {
            session.eval(next)?;
        } else {
            picked = Some(session.eval_sampled(next, &mut sampler)?);
        }
    }
    if spec {
        eprintln!(
            "mtp: {} drafts, {} accepted ({:.1} %)",
            stats.drafted,
            stats.accepted,
            100.0 * stats.acceptance()
        );
    }
    out.write_all(dec.flush().as_bytes())?;
    writeln!(out)?;
    Ok(())
}
