use super::common::ModelArgs;
use anyhow::{bail, Context, Result};
use ds4_engine::{argmax, Sampler, SamplerConfig};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
#[command(
    after_help = "For each context frontier the prompt is extended (incremental prefill) to that \
    length, then --gen-tokens tokens are generated greedily (EOS ignored) from a snapshot, which is \
    restored afterwards. Before the first frontier, --warmup N untimed runs of that frontier (prompt \
    and generation, on a session that is then dropped) load what a process loads once: kernels, the \
    BLAS library's kernels for each shape, decode graphs (--warmup 0: the first row then includes \
    them, as a first prompt does). CSV on stdout (or --csv FILE):\n  \
    ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes\n\n\
    A header on stderr (lines starting with #) gives the backend, the device memory held by the \
    weights and the session state at 32k and 1M tokens of context; on a GPU a # line after each \
    frontier gives the device memory in use then (measured: weights, copies, state, scratch).\n\n\
    Long frontiers take long: every prompt token scores every compressed indexer row (quadratic \
    in the context). One H200, full-q2: ~9,400 tok/s up to 64k, then 7,450 (64k to 128k), 5,600 \
    (to 256k) and 3,700 (to 512k); a 256k prompt takes ~40 s, the 512k to 1M part more than 6 \
    minutes. --decode-only times decode there without the prompts: each frontier's state is random \
    KV rows of that context's sizes (the prefill columns stay empty). --turn N times the last N \
    prompt tokens of each frontier on such a state (a coding agent's next turn at that context: \
    prefill of N, then decode).\n\n\
    Examples:\n  ds4 bench -m models/tiny.gguf --ctx-start 256 --ctx-max 4096 --step-mul 2 --gen-tokens 32\n  \
    ds4 bench --backend cuda --synthetic full-q2 --ctx-start 2048 --ctx-max 32768   (no file: random \
    weights of the real shapes generated on the GPU)\n  \
    ds4 bench --backend cuda --synthetic full-q2 --ctx-start 65536 --ctx-max 262144 --step-mul 2 \
    --gen-tokens 32   (the long end)\n  \
    ds4 bench --backend cuda --synthetic full-q2 --ctx-start 262144 --ctx-max 1048576 --step-mul 2 \
    --decode-only   (decode at 256k, 512k and 1M: under a minute on one H200)\n  \
    ds4 bench --backend cuda --synthetic full-q2 --ctx-start 131072 --ctx-max 1048576 --step-mul 2 \
    --turn 4096   (a 4,096-token turn and its answer at 128k .. 1M)"
)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// First frontier (tokens of context).
    #[arg(long, default_value_t = 2048)]
    ctx_start: usize,
    /// Last frontier.
    #[arg(long, default_value_t = 32768)]
    ctx_max: usize,
    /// Add this many tokens per frontier (default: double with --step-mul 2).
    #[arg(long, conflicts_with = "step_mul")]
    step_incr: Option<usize>,
    /// Multiply the frontier by this factor each step.
    #[arg(long)]
    step_mul: Option<f64>,
    /// Tokens generated at each frontier.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Text to tokenize for the prompt (repeated as needed); default: built-in English and code.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Untimed runs of the first frontier before measuring (one-time loads out of the numbers).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Also write the CSV to this file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Also time speculative decoding at each frontier, once per listed acceptance rate A (0 to
    /// 1, comma-separated): a draft at every step, verified in a 2-token step as with `--mtp`,
    /// kept with probability A whatever the model picked (forced, so random weights give the
    /// same acceptance; rejected: the draft's writes undone in place, or with
    /// DS4_SPEC_ROLLBACK=whole the step rolled back and the token evaluated alone). Times the
    /// engine's verify steps, rollbacks and host traffic at that acceptance; the drafts are the
    /// plain run's tokens (free), unless --spec-mtp. Adds the columns
    /// spec<A>_tps,spec<A>_drafted,spec<A>_accepted per rate.
    #[arg(long, value_delimiter = ',')]
    spec_accept: Vec<f64>,
    /// With --spec-accept: the drafts come from the model's MTP block, so its cost (one layer
    /// and the output head a draft) is in the speculative columns (the verdicts stay forced).
    /// With --synthetic a random MTP block is generated too; with -m pass --mtp FILE.
    #[arg(long, requires = "spec_accept")]
    spec_mtp: bool,
    /// Time decode only: at each frontier the session state is random KV rows of the sizes that
    /// context gives (raw window, every compressed and indexer row) instead of the prompt's, so
    /// decode at long frontiers (512k, 1M) takes seconds instead of a prefill of minutes. The
    /// prefill columns stay empty; the generated tokens mean nothing (the rows are not the
    /// model's), their cost is decode's at that context.
    #[arg(long)]
    decode_only: bool,
    /// Time an N-token turn at each frontier without the prompt before it: the state is random
    /// KV rows of the sizes that `frontier - N` tokens give (as --decode-only), then the
    /// frontier's last N prompt tokens are prefilled (the prefill columns) and --gen-tokens
    /// generated, so prefill at 512k / 1M of context is timed in seconds. N below --ctx-start.
    #[arg(long, conflicts_with = "decode_only")]
    turn: Option<usize>,
}

/// Step sizes as runs: `[4096, 4096, 2048]` -> "4096 x 2, 2048" tokens.
fn step_list(steps: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &n in steps {
        match runs.last_mut() {
            Some((m, k)) if *m == n => *k += 1,
            _ => runs.push((n, 1)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|&(n, k)| {
            if k > 1 {
                format!("{n} x {k}")
            } else {
                n.to_string()
            }
        })
        .collect();
    if parts.is_empty() {
        return "none (nothing new to evaluate)".into();
    }
    format!("{} tokens", parts.join(", "))
}

/// `n` tokens of speculative decoding from the session's frontier `f`, a draft at every step
/// (the MTP block's with `mtp`, else the plain run's token after `next` at position t where
/// there is one), each kept with
/// probability `rate` whatever the model picked (the verdict is forced, so the acceptance is the
/// same on any weights; random weights' near-tie logits would otherwise make a 2-token step's
/// picks leave the plain run's): (tokens/s, draft counts, tokens that differ from `plain`).
fn speculative(
    s: &mut ds4_engine::Session,
    plain: &[u32],
    f: usize,
    n: usize,
    rate: f64,
    vocab: u32,
    mtp: bool,
) -> Result<(f64, ds4_engine::SpecStats, usize)> {
    s.set_keep_streams(true);
    // Fixed-seed draws (splitmix64), so runs are repeatable.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ rate.to_bits();
    let mut uniform = move || {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut draft = |_: &[f32], next: u32, t: usize| match plain.get(t + 1 - f) {
        Some(&d) => d,
        None => (next + 1) % vocab,
    };
    let mut got = Vec::with_capacity(n);
    let t = Instant::now();
    let mut accept = |_: u32, _: u32| uniform() < rate;
    let mut on_token = |tok| {
        got.push(tok);
        true
    };
    let st = if mtp {
        s.generate_mtp_with_verdict(n, &mut accept, &mut on_token)
    } else {
        s.generate_with_verdict(n, &mut draft, &mut accept, &mut on_token)
    };
    let secs = t.elapsed().as_secs_f64();
    s.set_keep_streams(false);
    let st = st?;
    let differ = got.iter().zip(plain).filter(|(a, b)| a != b).count();
    Ok((got.len() as f64 / secs, st, differ))
}

const DEFAULT_TEXT: &str =
    "The quick brown fox jumps over the lazy dog. fn main() { println!(\"hello\"); } \
    Numbers 1234567890 and a CSV row: a,b,c\n";

/// `--decode-only`'s state at frontier `toks.len()`: random rows for all but the last position
/// (`Session::fill_random`, seeded by the frontier: the same state each time), then that token
/// evaluated, so that logits (and the speculative loop's streams) exist as after a prompt.
fn random_state(s: &mut ds4_engine::Session, toks: &[u32]) -> Result<()> {
    let last = *toks.last().context("an empty frontier")?;
    turn_base(s, toks, 1)?;
    s.eval(last)?;
    Ok(())
}

/// `--turn n`'s state before frontier `toks.len()`: random rows for all but the last `n`
/// positions (seeded by the frontier), which the caller then prefills.
fn turn_base(s: &mut ds4_engine::Session, toks: &[u32], n: usize) -> Result<()> {
    s.fill_random(&toks[..toks.len() - n], toks.len() as u64)?;
    Ok(())
}

pub fn run(mut a: Args) -> Result<()> {
    if a.ctx_start == 0 || a.ctx_start > a.ctx_max {
        bail!("--ctx-start must be between 1 and --ctx-max");
    }
    a.model.ctx = a.model.ctx.max(a.ctx_max + a.gen_tokens);
    if let Some(n) = a.turn {
        if n == 0 || n >= a.ctx_start {
            bail!(
                "--turn {n}: a turn is 1 to --ctx-start - 1 tokens (--ctx-start {})",
                a.ctx_start
            );
        }
    }
    let mut margs = a.model.clone();
    margs.synthetic_mtp = a.spec_mtp;
    let engine = margs.open()?;
    if a.spec_mtp && !engine.has_mtp() {
        bail!("--spec-mtp: the model has no MTP block (pass --mtp FILE with -m)");
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    eprintln!(
        "# model: {}  backend: {}",
        engine.path().display(),
        engine.backend_name()
    );
    if let Some(w) = engine.gpu_weight_bytes() {
        // Several ranks (--devices): rank 0's device (the others hold about as much).
        let each = if a.model.devices.len() > 1 {
            " (rank 0)"
        } else {
            ""
        };
        let copies = engine.gpu_layout_bytes().unwrap_or(0);
        eprintln!(
            "# weights on the device{each}: {:.2} GiB, and {:.2} GiB of their decode-layout copies \
             (none where the Q8_0 matrices are held in that layout only, as the backend line \
             says; DS4_GPU_Q8_REPACK=off: none, the blocks alone, slower decode)",
            gib(w),
            gib(copies)
        );
    }
    match (
        engine.gpu_state_estimate(32 << 10),
        engine.gpu_state_estimate(1 << 20),
    ) {
        (Some(a), Some(b)) => eprintln!(
            "# session state on the device: {:.2} GiB at 32k context, {:.2} GiB at 1M (as the GPU \
             stores its rows)",
            gib(a),
            gib(b)
        ),
        _ => eprintln!(
            "# session state: {:.2} GiB at 32k context, {:.2} GiB at 1M (f32 rows)",
            gib(engine.memory_estimate(32 << 10)),
            gib(engine.memory_estimate(1 << 20))
        ),
    }
    let tok = engine.tokenizer().clone();
    let text = match &a.prompt_file {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        None => DEFAULT_TEXT.to_string(),
    };
    let unit = tok.encode(&text);
    if unit.is_empty() {
        bail!("the prompt text encodes to no tokens");
    }
    let prompt: Vec<u32> = unit.iter().copied().cycle().take(a.ctx_max).collect();
    let mut frontiers = vec![a.ctx_start];
    loop {
        let last = *frontiers.last().unwrap_or(&a.ctx_start);
        let next = match (a.step_incr, a.step_mul) {
            (Some(i), _) => last + i.max(1),
            (None, m) => ((last as f64) * m.unwrap_or(2.0)).ceil() as usize,
        };
        if next > a.ctx_max || next <= last {
            break;
        }
        frontiers.push(next);
    }
    for i in 0..a.warmup {
        let t = Instant::now();
        let mut s = engine.new_session(a.model.ctx);
        if a.decode_only {
            random_state(&mut s, &prompt[..a.ctx_start])?;
        } else {
            if let Some(n) = a.turn {
                turn_base(&mut s, &prompt[..a.ctx_start], n)?;
            }
            s.sync(&prompt[..a.ctx_start], &mut |_, _| {})?;
        }
        let mut greedy = Sampler::new(SamplerConfig::default());
        let mut next = argmax(s.logits().context("no logits")?);
        for _ in 0..a.gen_tokens {
            next = s.eval_sampled(next, &mut greedy)?;
        }
        eprintln!(
            "# warm-up {}: {} tokens + {} generated in {:.2} s (not measured)",
            i + 1,
            a.ctx_start,
            a.gen_tokens,
            t.elapsed().as_secs_f64()
        );
    }
    if let Some(a) = a.spec_accept.iter().find(|a| !(0.0..=1.0).contains(*a)) {
        bail!("--spec-accept {a}: an acceptance rate is between 0 and 1");
    }
    let mut out =
        String::from("ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes");
    for r in &a.spec_accept {
        out.push_str(&format!(",spec{r}_tps,spec{r}_drafted,spec{r}_accepted"));
    }
    out.push('\n');
    print!("{out}");
    let vocab = engine.hparams().n_vocab;
    let mut s = engine.new_session(a.model.ctx);
    for &f in &frontiers {
        if let Some(n) = a.turn {
            let t = Instant::now();
            turn_base(&mut s, &prompt[..f], n)?;
            eprintln!(
                "# {f}: random state of {} positions in {:.1} s (--turn {n}, not timed)",
                f - n,
                t.elapsed().as_secs_f64()
            );
        }
        let before = s.tokens().len();
        let t0 = Instant::now();
        if a.decode_only {
            random_state(&mut s, &prompt[..f])?;
            eprintln!(
                "# {f}: random state of {f} positions in {:.1} s (--decode-only)",
                t0.elapsed().as_secs_f64()
            );
        } else {
            s.sync(&prompt[..f], &mut |_, _| {})?;
        }
        let pre = (f - before) as f64 / t0.elapsed().as_secs_f64();
        let kv = s.kv_bytes();
        if let Some((free, total)) = engine.gpu_memory() {
            if !a.decode_only {
                // The GPU sizes each step to the memory free before it (DS4_GPU_PREFILL_CHUNK
                // fixes it).
                eprintln!("# {f}: prompt steps of {}", step_list(s.last_steps()));
            }
            // Measured: everything the process holds on the device (weights, their copies, the
            // session state with its rows' spare capacity, pooled scratch).
            eprintln!(
                "# {f}: device memory in use {:.2} GiB of {:.2} GiB ({:.2} GiB free)",
                gib(total - free),
                gib(total),
                gib(free)
            );
        }
        // The state to come back to after each timed run: a snapshot, or (--decode-only and
        // --turn, where a 1M snapshot would be ~13 GB) the same random fill again (and the turn).
        let random = a.decode_only || a.turn.is_some();
        let snap = (!random).then(|| s.snapshot());
        let back = |s: &mut ds4_engine::Session| -> Result<()> {
            match (&snap, a.turn) {
                (Some(b), _) => s.restore(b)?,
                (None, Some(n)) => {
                    turn_base(s, &prompt[..f], n)?;
                    s.sync(&prompt[..f], &mut |_, _| {})?;
                }
                (None, None) => random_state(s, &prompt[..f])?,
            }
            Ok(())
        };
        let t1 = Instant::now();
        // Greedy, picked on the backend (DS4_GPU_SAMPLE=off: logits to the host).
        let mut greedy = Sampler::new(SamplerConfig::default());
        let mut next = argmax(s.logits().context("no logits")?);
        // The plain run's tokens from position f on (the oracle's answers).
        let mut plain = vec![next];
        for _ in 0..a.gen_tokens {
            next = s.eval_sampled(next, &mut greedy)?;
            plain.push(next);
        }
        let gen = a.gen_tokens as f64 / t1.elapsed().as_secs_f64();
        if !random || !a.spec_accept.is_empty() {
            back(&mut s)?; // (--decode-only / --turn fill the next frontier's state anew)
        }
        let mut line = if a.decode_only {
            format!("{f},,,{},{gen:.2},{kv}", a.gen_tokens)
        } else {
            format!("{f},{},{pre:.2},{},{gen:.2},{kv}", f - before, a.gen_tokens)
        };
        for &rate in &a.spec_accept {
            let (tps, st, differ) =
                speculative(&mut s, &plain, f, a.gen_tokens, rate, vocab, a.spec_mtp)?;
            if rate == 1.0 && differ > 0 && !a.spec_mtp {
                eprintln!(
                    "# {f}: speculative run at 1: {differ} of {} tokens differ from the plain run (the \
                     model's picks after kept drafts come from 2-token rows: near-ties round apart)",
                    a.gen_tokens
                );
            }
            line.push_str(&format!(",{tps:.2},{},{}", st.drafted, st.accepted));
            back(&mut s)?;
        }
        line.push('\n');
        print!("{line}");
        std::io::stdout().flush()?;
        out.push_str(&line);
    }
    if let Some(c) = engine.gpu_weight_copy_bytes() {
        eprintln!(
            "# bf16 weight copies on the device (made at the first prompt, DS4_GPU_BF16_CACHE): {:.2} GiB",
            gib(c)
        );
    }
    if let Some(p) = &a.csv {
        std::fs::write(p, out).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::step_list;

    #[test]
    fn step_list_counts_runs_of_equal_steps() {
        assert_eq!(step_list(&[4096, 4096, 2048]), "4096 x 2, 2048 tokens");
        assert_eq!(
            step_list(&[3072, 2048, 2048, 3072]),
            "3072, 2048 x 2, 3072 tokens"
        );
        assert_eq!(step_list(&[12288]), "12288 tokens");
        assert_eq!(step_list(&[]), "none (nothing new to evaluate)");
    }
}
