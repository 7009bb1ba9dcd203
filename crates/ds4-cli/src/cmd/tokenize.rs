use anyhow::{bail, Context, Result};
use ds4_gguf::GgufFile;
use ds4_tokenizer::Tokenizer;
use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    ds4 tokenize -m model.gguf 'Hello, world'             # [19923, 14, 2058]\n  \
    echo -n 'text' | ds4 tokenize -m model.gguf -\n  \
    ds4 tokenize -m model.gguf --decode '[19923, 14, 2058]'")]
pub struct Args {
    /// GGUF file whose tokenizer to use.
    #[arg(short, long)]
    model: PathBuf,
    /// Text to encode, or with --decode a JSON array of ids; `-` reads it from stdin.
    input: String,
    /// Turn a JSON array of token ids back into text.
    #[arg(long)]
    decode: bool,
    /// Treat special-token strings (`<｜User｜>`, `</think>`, …) as plain text instead of
    /// emitting their special ids.
    #[arg(long)]
    no_specials: bool,
}

pub fn run(a: Args) -> Result<()> {
    let input = if a.input == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        s
    } else {
        a.input
    };
    let file = GgufFile::open(&a.model)?;
    let vocab = ds4_model::gguf_meta::vocab(&file)?;
    let tok = Tokenizer::from_vocab(vocab.0, vocab.1)
        .with_context(|| format!("{}: loading the tokenizer", a.model.display()))?;
    let mut out = std::io::stdout().lock();
    if a.decode {
        let ids: Vec<u32> = serde_json::from_str(input.trim())
            .context("--decode expects a JSON array of non-negative token ids, like [1, 2, 3]")?;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= tok.vocab_size()) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                tok.vocab_size()
            );
        }
        out.write_all(&tok.decode(&ids)?)?;
    } else {
        let ids = if a.no_specials {
            tok.encode(&input)
        } else {
            tok.encode_with_specials(&input)
        };
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    }
    Ok(())
}
