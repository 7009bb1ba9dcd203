//! `ds4 kernels`: compile every GPU kernel module for a target into the disk cache, without a
//! GPU (a container build, a login node), so the GPU machine's first start skips compilation.

use anyhow::{Context, Result};
use ds4_gpu::cache::{cache_dir, Origin};
use ds4_gpu::precompile::{precompile, Target};
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "The cache only hits on a machine whose NVRTC/hipRTC has the same \
    major.minor version as the one used here (it is part of the key); `ds4 devices` prints it. \
    Point a GPU machine at the result with DS4_KERNEL_CACHE=DIR (or copy DIR to \
    ~/.cache/ds4/kernels). DS4_NVRTC_LIB=/path/libnvrtc.so.13 picks an NVRTC."
)]
pub struct Args {
    /// Targets: sm_80, sm_90a, sm_100, … (NVRTC) or gfx90a, gfx942, gfx1100, … (hipRTC).
    #[arg(long = "target", required = true, num_args = 1..)]
    targets: Vec<String>,
    /// Wavefront width override for gfx targets (default: 64 on gfx9, 32 on RDNA).
    #[arg(long)]
    warp: Option<u32>,
    /// Cache folder (default: $DS4_KERNEL_CACHE, else ~/.cache/ds4/kernels).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Also delete this target's entries that the current kernel sources no longer produce.
    #[arg(long)]
    prune: bool,
    /// Only these modules (e.g. `--module attention gemm`; default: all).
    #[arg(long = "module", num_args = 1..)]
    modules: Vec<String>,
}

pub fn run(a: Args) -> Result<()> {
    let dir = match a.cache.or_else(cache_dir) {
        Some(d) => d,
        None => anyhow::bail!("no kernel cache folder: pass --cache DIR or set DS4_KERNEL_CACHE"),
    };
    for t in &a.targets {
        let target = Target::parse(t, a.warp)?;
        let r = precompile(&target, &dir, a.prune, &a.modules)
            .with_context(|| format!("compiling kernels for {t} into {}", dir.display()))?;
        println!(
            "{t} ({}) with {} from {} into {}",
            target.arch,
            r.compiler,
            r.compiler_path.display(),
            dir.display()
        );
        for m in &r.modules {
            let how = match m.origin {
                Origin::Cache => "cached",
                Origin::Compiled => "compiled",
            };
            println!(
                "  {:<12} {how:<8} {:>9} bytes {:>7.2} s",
                m.module, m.bytes, m.secs
            );
        }
        for p in &r.pruned {
            println!("  removed stale {}", p.display());
        }
    }
    Ok(())
}
