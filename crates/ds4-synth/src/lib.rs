//! `ds4 synth`: synthetic DeepSeek V4 Flash GGUFs with the published tensor names, types, shapes
//! and metadata keys, random weights with sane scales, and the real tokenizer. Used for loader
//! checks (`--sparse`), speed measurements at full size, and small end-to-end runs (`tiny`).

pub mod blocks;

use anyhow::{bail, Context, Result};
use ds4_gguf::{GgmlType, GgufWriter, Value};
use ds4_model::tensors::tensor_bytes;
use ds4_model::{main_tensors, mtp_tensors, Family, HParams, MetaValue, Mix, TensorSpec};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// model.md §6.1: 6 layers, every code path, q2 quant types, ~40 MB.
    Tiny,
    /// Real shapes, q2 mix (80.76 GiB).
    FullQ2,
    /// Real shapes, q4 mix (153.33 GiB).
    FullQ4,
}

impl Preset {
    pub fn parse(s: &str) -> Option<Preset> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "full-q2" => Some(Preset::FullQ2),
            "full-q4" => Some(Preset::FullQ4),
            _ => None,
        }
    }

    pub fn params(self) -> (HParams, Mix) {
        match self {
            Preset::Tiny => (HParams::tiny(), Mix::Q2),
            Preset::FullQ2 => (HParams::flash(), Mix::Q2),
            Preset::FullQ4 => (HParams::flash(), Mix::Q4),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub hparams: HParams,
    pub mix: Mix,
    pub out: PathBuf,
    pub seed: u64,
    /// Leave tensor data as file holes (only the header is written).
    pub sparse: bool,
    /// Also write the MTP GGUF next to `out` (see [`mtp_path`]).
    pub mtp: bool,
}

#[derive(Clone, Debug)]
pub struct SynthReport {
    pub files: Vec<(PathBuf, u64)>,
    pub tensors: usize,
    pub data_bytes: u64,
    pub seconds: f64,
}

/// `model.gguf` → `model-mtp.gguf`.
pub fn mtp_path(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!("{stem}-mtp.gguf"))
}

fn meta_value(v: MetaValue) -> Value {
    match v {
        MetaValue::U32(x) => Value::U32(x),
        MetaValue::U64(x) => Value::U64(x),
        MetaValue::F32(x) => Value::F32(x),
        MetaValue::Bool(x) => Value::Bool(x),
        MetaValue::Str(s) => Value::String(s),
        MetaValue::U32Array(a) => Value::Array(ds4_gguf::Array::U32(a)),
        MetaValue::F32Array(a) => Value::Array(ds4_gguf::Array::F32(a)),
        MetaValue::StrArray(a) => Value::Array(ds4_gguf::Array::String(a.into_iter().collect())),
    }
}

/// The tokenizer the model file carries: the real DeepSeek V4 vocabulary when it fits,
/// otherwise the reduced byte-level vocabulary of `ds4_tokenizer::builtin::tiny`.
fn vocab_for(hp: &HParams) -> ds4_tokenizer::builtin::Vocab {
    let full = ds4_tokenizer::builtin::deepseek_v4();
    if full.tokens.len() == hp.n_vocab as usize {
        full
    } else {
        ds4_tokenizer::builtin::tiny(hp.n_vocab as usize)
    }
}

/// One unit of parallel work: a run of whole blocks (or rows) of one tensor.
struct Chunk {
    tensor: usize,
    index: u64,
    /// Byte range inside the tensor.
    start: u64,
    len: u64,
}

/// Aim for chunks of this size: big enough for sequential writes, small enough to balance.
const CHUNK_BYTES: u64 = 8 << 20;

/// Per-tensor generation recipe.
struct Recipe {
    ty: GgmlType,
    family: Family,
    /// Block scale `d` for quantised types, value RMS for float types.
    d: f32,
    /// Value range for the F32 "small vector" families.
    range: (f32, f32),
    /// For `ffn_gate_tid2eid`: experts per token and expert count.
    tid: Option<(u32, u32)>,
    /// Unit of chunking in bytes (a block, or one token's row of expert ids).
    unit: u64,
}

fn recipe(spec: &TensorSpec, ty: GgmlType, hp: &HParams, unit_rms: f32) -> Recipe {
    let sigma = 1.0 / (spec.fan_in() as f32).sqrt(); // RMS ≈ 1/√fan_in for matrices
    let range = match spec.family {
        Family::Norm => (0.9, 1.1),
        Family::HcScale => (0.5, 1.5),
        Family::HcBase | Family::Sinks => (-0.8, 0.8),
        Family::Bias => (-0.1, 0.1),
        _ => (0.0, 0.0),
    };
    let tid = (spec.family == Family::Tid2Eid).then_some((hp.n_expert_used, hp.n_expert));
    let unit = match spec.family {
        Family::Tid2Eid => 4 * hp.n_expert_used as u64,
        _ => ty.block_bytes(),
    };
    Recipe {
        ty,
        family: spec.family,
        d: sigma / unit_rms,
        range,
        tid,
        unit,
    }
}

fn gen_chunk(r: &Recipe, table: &blocks::F16Table, rng: &mut Xoshiro256PlusPlus, out: &mut [u8]) {
    if let Some((k, n)) = r.tid {
        // One row of `k` distinct expert ids per token (partial Fisher–Yates).
        let mut perm: Vec<i32> = (0..n as i32).collect();
        for row in out.chunks_exact_mut(4 * k as usize) {
            for i in 0..k as usize {
                let j = rng.gen_range(i..n as usize);
                perm.swap(i, j);
                row[4 * i..4 * i + 4].copy_from_slice(&perm[i].to_le_bytes());
            }
        }
        return;
    }
    match r.family {
        Family::Norm | Family::HcScale | Family::HcBase | Family::Sinks | Family::Bias => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.gen_range(r.range.0..r.range.1).to_le_bytes());
            }
        }
        _ => blocks::fill(r.ty, r.d, Some(table), rng, out),
    }
}

/// What to generate: shape, mix and seed of one file.
struct Gen<'a> {
    hp: &'a HParams,
    mix: Mix,
    seed: u64,
    sparse: bool,
}

/// Write one GGUF: header first, then every tensor chunk in parallel with positioned writes.
fn write_file(
    path: &Path,
    meta: Vec<(String, MetaValue)>,
    specs: &[TensorSpec],
    g: &Gen,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(u64, u64)> {
    let Gen {
        hp,
        mix,
        seed,
        sparse,
    } = *g;
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.set(k, meta_value(v));
    }
    let mut recipes = Vec::with_capacity(specs.len());
    let mut calib = std::collections::HashMap::new();
    let mut crng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xca11b);
    for s in specs {
        let ty = s.family.type_in(mix);
        if tensor_bytes(s, ty).is_none() {
            bail!(
                "tensor {}: {} rows of {} elements are not whole {} blocks",
                s.name,
                ty,
                s.dims[0],
                ty
            );
        }
        w.add_tensor(&s.name, ty, &s.dims)
            .with_context(|| format!("adding tensor {}", s.name))?;
        let rms = *calib
            .entry(ty)
            .or_insert_with(|| blocks::unit_rms(ty, &mut crng));
        recipes.push(recipe(s, ty, hp, rms));
    }
    let layout = w.layout().context("laying out the GGUF file")?;
    let tmp = path.with_extension("gguf.tmp");
    let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    file.set_len(layout.total_len)
        .with_context(|| format!("sizing {}", tmp.display()))?;
    file.write_all_at(&layout.header, 0)
        .with_context(|| format!("writing header of {}", tmp.display()))?;
    let data_bytes: u64 = layout.sizes.iter().sum();
    if !sparse {
        let mut chunks = Vec::new();
        for (t, (&size, r)) in layout.sizes.iter().zip(&recipes).enumerate() {
            let per = (CHUNK_BYTES / r.unit).max(1) * r.unit;
            let mut start = 0;
            let mut index = 0;
            while start < size {
                let len = per.min(size - start);
                chunks.push(Chunk {
                    tensor: t,
                    index,
                    start,
                    len,
                });
                start += len;
                index += 1;
            }
        }
        // One F16 value table per distinct RMS, seeded deterministically.
        let mut trng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xf16);
        let mut tables: Vec<(f32, blocks::F16Table)> = Vec::new();
        for r in recipes.iter().filter(|r| r.ty == GgmlType::F16) {
            if !tables.iter().any(|(d, _)| *d == r.d) {
                tables.push((r.d, blocks::F16Table::new(r.d, &mut trng)));
            }
        }
        let unused = blocks::F16Table::new(1.0, &mut trng);
        let done = std::sync::atomic::AtomicU64::new(0);
        chunks
            .par_iter()
            .try_for_each_init(Vec::new, |buf: &mut Vec<u8>, c| -> Result<()> {
                let r = &recipes[c.tensor];
                buf.resize(c.len as usize, 0);
                // Seed from (file seed, tensor, chunk): identical output whatever the thread count.
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(
                    seed ^ (c.tensor as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                        ^ c.index.wrapping_mul(0xd1b5_4a32_d192_ed03),
                );
                let table = tables
                    .iter()
                    .find(|(d, _)| *d == r.d)
                    .map_or(&unused, |(_, t)| t);
                gen_chunk(r, table, &mut rng, buf);
                file.write_all_at(buf, layout.offsets[c.tensor] + c.start)
                    .with_context(|| {
                        format!(
                            "writing tensor {} to {}",
                            specs[c.tensor].name,
                            tmp.display()
                        )
                    })?;
                let d = done.fetch_add(c.len, std::sync::atomic::Ordering::Relaxed) + c.len;
                progress(d, data_bytes);
                Ok(())
            })?;
    }
    file.sync_all()
        .with_context(|| format!("syncing {}", tmp.display()))?;
    drop(file);
    fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok((layout.total_len, data_bytes))
}

/// Tokenizer metadata keys (model.md §2.2, interfaces.md §4.4).
fn tokenizer_meta(hp: &HParams) -> Vec<(String, MetaValue)> {
    let v = vocab_for(hp);
    vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::Str("joyai-llm".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::StrArray(v.tokens),
        ),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::StrArray(v.merges),
        ),
    ]
}

/// The tiny preset (model.md §6.1) from `seed`, written to `out` in full, without MTP: the
/// model that tests and fuzz targets run on.
pub fn synth_tiny(out: &Path, seed: u64) -> Result<SynthReport> {
    synth(&tiny_options(out, seed, false), &|_, _| {})
}

/// The tiny preset's options: written in full (no holes), with its MTP file when `mtp`.
fn tiny_options(out: &Path, seed: u64, mtp: bool) -> SynthOptions {
    let (hparams, mix) = Preset::Tiny.params();
    SynthOptions {
        hparams,
        mix,
        out: out.to_path_buf(),
        seed,
        sparse: false,
        mtp,
    }
}

pub fn synth(opts: &SynthOptions, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<SynthReport> {
    let hp = &opts.hparams;
    hp.validate()
        .map_err(|p| anyhow::anyhow!("invalid hyper-parameters:\n  {}", p.join("\n  ")))?;
    let t0 = Instant::now();
    let mut meta = hp.to_metadata();
    meta.push(("general.alignment".into(), MetaValue::U32(32)));
    meta.extend(tokenizer_meta(hp));
    let specs = main_tensors(hp);
    let (len, data) = write_file(
        &opts.out,
        meta,
        &specs,
        &Gen {
            hp,
            mix: opts.mix,
            seed: opts.seed,
            sparse: opts.sparse,
        },
        progress,
    )?;
    let mut files = vec![(opts.out.clone(), len)];
    let mut tensors = specs.len();
    let mut data_bytes = data;
    if opts.mtp {
        // The published MTP file is "Q4K-Q8_0-F32": Q4_K experts and Q8_0 projections.
        let mtp_mix = if opts.mix == Mix::F32 {
            Mix::F32
        } else {
            Mix::Q4
        };
        let mut m = hp.to_metadata();
        m.push(("general.alignment".into(), MetaValue::U32(32)));
        let specs = mtp_tensors(hp);
        let p = mtp_path(&opts.out);
        let (len, data) = write_file(
            &p,
            m,
            &specs,
            &Gen {
                hp,
                mix: mtp_mix,
                seed: opts.seed ^ 0x4d7450,
                sparse: opts.sparse,
            },
            progress,
        )?;
        files.push((p, len));
        tensors += specs.len();
        data_bytes += data;
    }
    Ok(SynthReport {
        files,
        tensors,
        data_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// A tiny synthetic model (q2 mix, plus its MTP file when `mtp`) written once per process and
/// seed into the temp directory; for tests and examples across crates.
pub fn tiny_model_for_tests(seed: u64, mtp: bool) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static DONE: Mutex<Option<HashMap<(u64, bool), PathBuf>>> = Mutex::new(None);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    let map = done.get_or_insert_with(HashMap::new);
    if let Some(p) = map.get(&(seed, mtp)) {
        return p.clone();
    }
    let dir = std::env::temp_dir().join(format!("ds4-tiny-{}-{seed}-{mtp}", std::process::id()));
    fs::create_dir_all(&dir).expect("creating a temp dir");
    let out = dir.join("tiny.gguf");
    synth(&tiny_options(&out, seed, mtp), &|_, _| {}).expect("writing the tiny model");
    map.insert((seed, mtp), out.clone());
    out
}
