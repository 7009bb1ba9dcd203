use crate::progress;
use anyhow::{anyhow, Result};
use ds4_synth::{Preset, SynthOptions};
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    ds4 synth --preset tiny -o models/tiny.gguf          # ~40 MB, every code path, seconds\n  \
    ds4 synth --preset full-q2 --sparse -o /tmp/q2.gguf   # 80.76 GiB file of holes, for loader checks\n  \
    ds4 synth --preset full-q2 --mtp -o models/q2.gguf    # real-size random weights + MTP file\n  \
    ds4 synth --preset full-q2 --layers 4 -o /tmp/q2-4.gguf  # real shapes, 4 of 43 layers (8.85 GiB): benches on a small machine")]
pub struct Args {
    /// Model shape and quant mix: tiny (model.md §6.1), full-q2 (80.76 GiB), full-q4 (153.33 GiB).
    #[arg(long, default_value = "tiny", value_parser = ["tiny", "full-q2", "full-q4"])]
    preset: String,
    /// Output path of the main GGUF.
    #[arg(short, long)]
    out: PathBuf,
    /// Random seed: the same seed gives byte-identical files on any machine and thread count.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Leave tensor data as file holes: instant, for loader and `inspect` checks only.
    #[arg(long)]
    sparse: bool,
    /// Also write the matching MTP GGUF (speculative decoding) as <out stem>-mtp.gguf.
    #[arg(long)]
    mtp: bool,
    /// Keep only the first N layers (the MTP block's shapes unchanged): real per-layer shapes and
    /// costs in a file that fits a small machine; a model's totals are then not the real one's.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    layers: Option<u32>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let preset = Preset::parse(&a.preset).ok_or_else(|| anyhow!("unknown preset {}", a.preset))?;
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()?;
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let (mut hparams, mix) = preset.params();
    if let Some(n) = a.layers {
        if n > hparams.n_layer {
            return Err(anyhow!(
                "--layers {n}: the {} preset has {} layers",
                a.preset,
                hparams.n_layer
            ));
        }
        hparams.keep_layers(n);
    }
    let opts = SynthOptions {
        hparams,
        mix,
        out: a.out,
        seed: a.seed,
        sparse: a.sparse,
        mtp: a.mtp,
    };
    let pb = progress::bytes("synth", 0);
    let report = ds4_synth::synth(&opts, &|done, total| {
        pb.set_length(total);
        pb.set_position(done);
    })?;
    pb.finish_and_clear();
    for (path, len) in &report.files {
        println!(
            "wrote {} ({:.2} GiB)",
            path.display(),
            *len as f64 / (1u64 << 30) as f64
        );
    }
    let rate = if a.sparse {
        String::from("sparse")
    } else {
        format!(
            "{:.2} GB/s",
            report.data_bytes as f64 / report.seconds / 1e9
        )
    };
    println!(
        "{} tensors, {} bytes of tensor data in {:.1} s ({rate})",
        report.tensors, report.data_bytes, report.seconds
    );
    Ok(())
}
