use anyhow::{Context, Result};
use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::{bind_main, bind_mtp, AttnKind, HParams};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file (main model or MTP).
    file: PathBuf,
    /// Also list every tensor (name, type, dims, offset).
    #[arg(long)]
    tensors: bool,
    /// Also list every metadata key (arrays abbreviated).
    #[arg(long)]
    metadata: bool,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(a: Args) -> Result<()> {
    let f = GgufFile::open(&a.file)?;
    let file_len = std::fs::metadata(&a.file)
        .with_context(|| format!("{}", a.file.display()))?
        .len();
    println!(
        "file          {} ({:.2} GiB)",
        a.file.display(),
        file_len as f64 / GIB
    );
    println!(
        "container     GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        f.version(),
        f.metadata().len(),
        f.tensors().len(),
        f.alignment()
    );
    let arch = f
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("(none)");
    let name = f.get("general.name").and_then(|v| v.as_str()).unwrap_or("");
    println!(
        "architecture  {arch}{}",
        if name.is_empty() {
            String::new()
        } else {
            format!(" ({name})")
        }
    );

    // Tensors by type: count, parameters, bytes.
    let mut by_type: BTreeMap<GgmlType, (usize, u64, u64)> = BTreeMap::new();
    for t in f.tensors() {
        let e = by_type.entry(t.ty).or_default();
        e.0 += 1;
        e.1 += t.n_elements;
        e.2 += t.n_bytes;
    }
    let (mut n, mut params, mut bytes) = (0usize, 0u64, 0u64);
    println!("tensors by type:");
    for (ty, (c, p, b)) in &by_type {
        println!(
            "  {:<8} {:>5} tensors {:>16} params {:>10.2} GiB",
            ty.name(),
            c,
            p,
            *b as f64 / GIB
        );
        n += c;
        params += p;
        bytes += b;
    }
    println!(
        "total         {n} tensors, {:.1} B parameters, {:.2} GiB of tensor data",
        params as f64 / 1e9,
        bytes as f64 / GIB
    );

    let is_mtp = f.tensors().iter().any(|t| t.name.starts_with("mtp."))
        && f.tensor("token_embd.weight").is_none();
    match HParams::from_meta(&f) {
        Ok(hp) => {
            print_hparams(&hp);
            let bound = if is_mtp {
                bind_mtp(&f, &hp)
            } else {
                bind_main(&f, &hp)
            };
            match bound {
                Ok(w) => {
                    println!(
                        "weights       OK: {} tensors match the DeepSeek V4 {} layout{}",
                        w.len(),
                        if is_mtp { "MTP" } else { "main" },
                        if w.ignored.is_empty() {
                            String::new()
                        } else {
                            format!(" ({} unused ignored)", w.ignored.len())
                        }
                    );
                }
                Err(e) => println!("weights       {e}"),
            }
        }
        Err(e) => println!("hyper-parameters: {e}"),
    }
    if let Some(tokens) = f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
        let merges = f
            .get("tokenizer.ggml.merges")
            .and_then(|v| v.as_array())
            .map_or(0, |m| m.len());
        println!("tokenizer     {} tokens, {} merges", tokens.len(), merges);
    }
    if a.metadata {
        println!("metadata:");
        for e in f.metadata() {
            println!("  {} = {}", e.key, e.value);
        }
    }
    if a.tensors {
        println!("tensors:");
        for t in f.tensors() {
            println!(
                "  {:<44} {:<8} {:?} @ {}",
                t.name,
                t.ty.name(),
                t.dims,
                t.offset
            );
        }
    }
    Ok(())
}

fn print_hparams(hp: &HParams) {
    let count = |k: AttnKind| hp.layers().filter(|l| l.attn == k).count();
    println!("hyper-parameters:");
    println!(
        "  layers      {} ({} SWA, {} CSA, {} HCA; hash-routed {})",
        hp.n_layer,
        count(AttnKind::Swa),
        count(AttnKind::Csa),
        count(AttnKind::Hca),
        if hp.n_hash_layer == 0 {
            "none".to_string()
        } else {
            format!("0-{}", hp.n_hash_layer - 1)
        }
    );
    println!("  hidden      {}, vocab {}", hp.n_embd, hp.n_vocab);
    println!(
        "  attention   {} heads × {} (RoPE tail {}), one KV head, q rank {}, output {} groups × {}",
        hp.n_head, hp.head_dim, hp.n_rot, hp.q_lora_rank, hp.o_groups, hp.o_lora_rank
    );
    println!(
        "  window      {} raw rows; compress ratios {:?}",
        hp.sliding_window,
        &hp.compress_ratios[..hp.n_layer as usize]
    );
    println!(
        "  indexer     {} heads × {}, top-k {}",
        hp.indexer_heads, hp.indexer_head_dim, hp.indexer_top_k
    );
    println!(
        "  experts     {} routed ({} used, scale {}) + {} shared, width {}, SwiGLU clamp {}",
        hp.n_expert,
        hp.n_expert_used,
        hp.expert_weights_scale,
        hp.n_expert_shared,
        hp.n_ff_exp,
        hp.swiglu_clamp[0]
    );
    println!(
        "  mHC         {} streams, {} Sinkhorn iterations",
        hp.hc_count, hp.hc_sinkhorn_iters
    );
    println!(
        "  RoPE        base {} (SWA) / {} (compressed, YaRN ×{} from {}, β {}/{})",
        hp.rope_base,
        hp.compress_rope_base,
        hp.rope_scale_factor,
        hp.rope_orig_ctx,
        hp.yarn_beta_fast,
        hp.yarn_beta_slow
    );
    println!("  context     {}", hp.context_length);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "  session     {:.2} GiB at 32K tokens, {:.2} GiB at 1M (f32 cache rows; f16 rows: {:.2} / {:.2} GiB)",
        gib(hp.session_bytes(32768, 4, 4)),
        gib(hp.session_bytes(1 << 20, 4, 4)),
        gib(hp.session_bytes(32768, 2, 2)),
        gib(hp.session_bytes(1 << 20, 2, 2))
    );
}
