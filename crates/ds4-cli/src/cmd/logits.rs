use super::common::ModelArgs;
use crate::progress;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "FILE holds integer token ids separated by whitespace or commas.\n\
    OUT.npy is a float32 NumPy array [T, vocab]: row t holds the logits after token t.\n\n\
    Example:\n  ds4 logits -m models/tiny.gguf --tokens ids.txt --out logits.npy"
)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// File of token ids (whitespace or comma separated).
    #[arg(long)]
    tokens: PathBuf,
    /// Output .npy file.
    #[arg(long)]
    out: PathBuf,
    /// Compute through the batched prompt path instead of one-token decode (same numbers).
    #[arg(long)]
    prefill: bool,
}

pub fn run(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.tokens)
        .with_context(|| format!("reading {}", a.tokens.display()))?;
    let mut ids = Vec::new();
    for (i, w) in text
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|w| !w.is_empty())
        .enumerate()
    {
        let id: u32 = w.parse().with_context(|| {
            format!(
                "{}: entry {} ({w:?}) is not a token id",
                a.tokens.display(),
                i + 1
            )
        })?;
        ids.push(id);
    }
    if ids.is_empty() {
        bail!("{}: no token ids", a.tokens.display());
    }
    let engine = a.model.open()?;
    super::common::note_host_experts(&engine);
    let v = engine.hparams().n_vocab as usize;
    let mut session = engine.new_session(a.model.ctx.max(ids.len()));
    let mut rows: Vec<f32> = Vec::with_capacity(ids.len() * v);
    let pb = progress::count("logits", ids.len() as u64);
    if a.prefill {
        for chunk in ids.chunks(ds4_engine::PREFILL_CHUNK) {
            for l in session.eval_all(chunk)? {
                rows.extend_from_slice(&l);
            }
            pb.inc(chunk.len() as u64);
        }
    } else {
        for &id in &ids {
            rows.extend_from_slice(session.eval(id)?);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    write_npy(&a.out, ids.len(), v, &rows)?;
    Ok(())
}

/// NumPy format v1.0, little-endian float32, C order.
fn write_npy(path: &PathBuf, t: usize, v: usize, data: &[f32]) -> Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({t}, {v}), }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for x in data {
        f.write_all(&x.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}
