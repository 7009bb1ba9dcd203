//! `gemm_bench [reps]`: prefill GEMM throughput (gemm.rs, gpu/gemm.cu) as TFLOP/s (2·n·rows·cols
//! per product) and GB/s of weight bytes: per type (4096 -> 16384, n = 2048), then the model's
//! dense shapes and the full-size routed experts at n = 2048 and 4096 token rows
//! (`GEMM_BENCH_N=512,2048` other n), each in every form: tiled = the tiled form for every quantised type
//! (`gemmt_*`: integer weights, raw blocks and X staged by cp.async; default for Q2_K/Q4_K), f16 = the opt-in single f16 product
//! (automatic item tile, double-buffered), f16/1buf = single-buffered, f16/64|128|256 = fixed tiles, bf16 = the previous default (hi/lo split,
//! three products; `DS4_GPU_GEMM_TILED=0`); `GEMM_BENCH_ALL=1` adds the f16 tile variants, tf32
//! and fma (per type). default = the default forms (the tiled form for Q2_K/Q4_K, the MoE's
//! IQ2_XXS gate/up on wgmma on CUDA sm_90a (`gwg_iq2_xxs`), elsewhere on X split once:
//! `gemmc_iq2_xxs`), /nowg = the gate/up on `gemmc_iq2_xxs` on sm_90a too, /noskip = empty m-tiles not skipped, /noxb
//! = X split per CTA, int8 = the MoE's gate/up activation-quantised (`gemmi8_iq2_xxs`, opt-in
//! `DS4_GPU_ACT=q8k`). `GEMM_BENCH_MOE=1`: the routed experts alone, in more forms;
//! `GEMM_BENCH_FORMS=default,bf16`: only those forms (model shapes and routed experts).
//! Timing: `reps` calls queued back to back between two syncs (wall clock, launch overhead in).
//! Ends each n with an estimate of prefill tokens/s from the products of one layer × 43 layers
//! (attention, shared expert, routed experts; compressor/indexer projections not included).

mod common;
use ds4_backend::{Backend, GgmlType, MoeSpec, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::conformance::random_row;
use ds4_gpu::GpuBackend;
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

/// A GGUF in memory with one tensor `w` of `experts × rows × cols` (64 random rows tiled).
fn weight_file(ty: GgmlType, cols: usize, rows: usize, experts: usize) -> Arc<GgufFile> {
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(cols as u64 ^ rows as u64);
    let uniq: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, cols, &mut r)).collect();
    let mut dims = vec![cols as u64, rows as u64];
    if experts > 1 {
        dims.push(experts as u64);
    }
    let mut w = GgufWriter::new();
    w.add_tensor("w", ty, &dims).unwrap();
    let bytes = w
        .to_bytes(|_, out: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
            let rb = uniq[0].len();
            for (i, c) in out.chunks_mut(rb).enumerate() {
                c.copy_from_slice(&uniq[(i * 7 + i / 64) % 64]);
            }
            Ok(())
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes("bench.gguf", bytes).unwrap())
}

fn bind(gpu: &GpuBackend, f: &Arc<GgufFile>) -> <GpuBackend as Backend>::Weight {
    let t = f.tensor("w").unwrap();
    let src = WeightSrc {
        name: "w",
        file: f,
        ty: t.ty,
        dims: &t.dims,
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    };
    gpu.matrix(&src).unwrap()
}

/// Seconds per call of `f`, `reps` calls queued between two syncs (after 2 warm-up calls).
fn time(
    gpu: &GpuBackend,
    probe: &<GpuBackend as Backend>::Buf,
    reps: usize,
    mut f: impl FnMut(),
) -> f64 {
    f();
    f();
    gpu.download(probe, 1);
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    gpu.download(probe, 1);
    if let Err(e) = gpu.check() {
        panic!("GPU error: {e}");
    }
    t.elapsed().as_secs_f64() / reps as f64
}

/// (name, on, fma, tf32, precise, f16 item tile, f16 double buffer): see `GpuBackend::set_gemm`,
/// `set_gemm_tf32`, `set_gemm_precise`, `set_gemm_tile`, `set_gemm_dbuf`. "f16" is the default
/// form (automatic tile, double-buffered), "bf16" the previous default (hi/lo split, three
/// products), "f16/64" .. fixed f16 tiles, "f16/1buf" two barriers per K step.
type Form = (&'static str, bool, bool, bool, bool, usize, bool);
const F16: Form = ("f16", true, false, false, false, 0, true);
const F16_1BUF: Form = ("f16/1buf", true, false, false, false, 0, false);
const BF16: Form = ("bf16", true, false, false, true, 0, true);
const TILED: Form = ("tiled", true, false, false, true, 0, true);
const DEFAULT: Form = ("default", true, false, false, true, 0, true);
const DEFAULT_NOSKIP: Form = ("default/noskip", true, false, false, true, 0, true);
const BF16_NOSKIP: Form = ("bf16/noskip", true, false, false, true, 0, true);
const DEFAULT_NOXB: Form = ("default/noxb", true, false, false, true, 0, true);
/// The default forms with the MoE's IQ2_XXS gate/up on `gemmc_iq2_xxs` instead of the wgmma
/// form (`gwg_iq2_xxs`, the default on CUDA sm_90a; `DS4_GPU_GEMM_WG=0`).
const DEFAULT_NOWG: Form = ("default/nowg", true, false, false, true, 0, true);
/// The default forms with the MoE's IQ2_XXS gate/up activation-quantised on int8 tensor cores
/// (`gemmi8_iq2_xxs`, opt-in `DS4_GPU_ACT=q8k`; not exact).
const INT8: Form = ("int8", true, false, false, true, 0, true);
const F16_64: Form = ("f16/64", true, false, false, false, 64, true);
const F16_128: Form = ("f16/128", true, false, false, false, 128, true);
const F16_256: Form = ("f16/256", true, false, false, false, 256, true);
const TF32: Form = ("tf32", true, false, true, false, 0, true);
const FMA: Form = ("fma", true, true, false, false, 0, true);

fn set_form(f: Form) {
    let (_, on, fma, tf32, precise, tile, dbuf) = f;
    GpuBackend::set_gemm_dbuf(dbuf);
    GpuBackend::set_gemm(on, fma);
    if tf32 {
        GpuBackend::set_gemm_tf32();
    }
    GpuBackend::set_gemm_precise(precise);
    GpuBackend::set_gemm_tile(tile);
    // bf16: the hi/lo form everywhere; tiled: the tiled form for every quantised type; default:
    // the tiled form for Q2_K/Q4_K. "/noskip": empty m-tiles not skipped; "/noxb": the MoE's
    // IQ2_XXS gate/up split X per CTA (gemm_iq2_xxs) instead of once (gemmc_iq2_xxs).
    GpuBackend::set_gemm_tiled(!f.0.starts_with("bf16"), f.0 == "tiled");
    GpuBackend::set_gemm_skip(!f.0.contains("noskip"));
    GpuBackend::set_gemm_xb(!f.0.ends_with("/noxb"));
    GpuBackend::set_gemm_act_q8k(f.0 == "int8");
    GpuBackend::set_gemm_wg(!f.0.ends_with("/nowg"));
}

fn main() {
    let reps: usize = common::arg(1, 20);
    let g = common::open_gpu();
    let info = g.info().clone();
    println!(
        "device: {} {} ({} SMs, warp {})",
        info.name, info.arch, info.sm_count, info.warp
    );
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1);
    let line = |what: &str, flops: f64, bytes: f64, s: f64| {
        println!(
            "{what:56} {:9.1} us {:7.2} TFLOP/s {:8.1} GB/s",
            s * 1e6,
            flops / s / 1e12,
            bytes / s / 1e9
        );
    };

    let all = std::env::var("GEMM_BENCH_ALL").is_ok(); // also tf32 and fma per type
                                                       // GEMM_BENCH_MOE=1: the routed experts alone, in more forms.
    let moe_only = std::env::var("GEMM_BENCH_MOE").is_ok();
    let n = 2048;
    if !moe_only {
        println!("-- per type, 4096 -> 16384, n = {n} --");
    }
    for ty in if moe_only {
        &[][..]
    } else {
        &ds4_quant::SUPPORTED[..]
    } {
        let ty = *ty;
        let (cols, rows) = (4096, 16384);
        let f = weight_file(ty, cols, rows, 1);
        let w = bind(&gpu, &f);
        drop(f);
        let bytes = (rows * ty.row_bytes(cols as u64).unwrap() as usize) as f64;
        let flops = 2.0 * (n * rows * cols) as f64;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x = gpu.upload(&x);
        let mut y = gpu.alloc(n * rows);
        let mut forms = vec![BF16, TILED, F16];
        if all {
            forms.extend([F16_1BUF, F16_64, F16_128, F16_256, TF32, FMA]);
        }
        for form in forms {
            set_form(form);
            let s = time(&gpu, &x, reps.min(5), || {
                gpu.matmul(&w, Part::All, &x, n, &mut y)
            });
            line(
                &format!("{ty:?} {cols}->{rows} {}", form.0),
                flops,
                bytes,
                s,
            );
        }
    }
    set_form(BF16);

    // Routed experts at full size (weights shared by every n).
    let (d, ff, ne, k) = (4096usize, 2048usize, 256usize, 6usize);
    let fg = weight_file(GgmlType::IQ2_XXS, d, ff, ne);
    let wg = bind(&gpu, &fg);
    drop(fg);
    let fu = weight_file(GgmlType::IQ2_XXS, d, ff, ne);
    let wu = bind(&gpu, &fu);
    drop(fu);
    let fd = weight_file(GgmlType::Q2_K, ff, d, ne);
    let wd = bind(&gpu, &fd);
    drop(fd);
    let slab = (ff * GgmlType::IQ2_XXS.row_bytes(d as u64).unwrap() as usize * 2
        + d * GgmlType::Q2_K.row_bytes(ff as u64).unwrap() as usize) as f64;
    let spec = MoeSpec {
        n_expert: ne,
        n_used: k,
        d,
        ff,
        weight_scale: 1.0,
        clamp: 10.0,
    };
    let shapes = [
        ("attn q_a", GgmlType::Q8_0, 4096, 1024, 1, 1),
        ("attn q_b", GgmlType::Q8_0, 1024, 32768, 1, 1),
        ("attn kv", GgmlType::Q8_0, 4096, 512, 1, 1),
        ("attn out_a (8 groups)", GgmlType::Q8_0, 4096, 8192, 8, 1),
        ("attn out_b", GgmlType::Q8_0, 8192, 4096, 1, 1),
        ("shared expert gate/up", GgmlType::Q8_0, 4096, 2048, 1, 2),
        ("shared expert down", GgmlType::Q8_0, 2048, 4096, 1, 1),
        ("F16 4096->1024", GgmlType::F16, 4096, 1024, 1, 1),
        ("F16 1024->8192", GgmlType::F16, 1024, 8192, 1, 1),
    ];
    let mut ws = Vec::new();
    for &(_, ty, cols, rows, _, _) in &shapes {
        let f = weight_file(ty, cols, rows, 1);
        ws.push(bind(&gpu, &f));
    }

    let ns: Vec<usize> = std::env::var("GEMM_BENCH_N")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|| vec![2048, 4096]);
    for n in ns {
        // One layer's products (attention, shared expert, routed experts; F16 rows not in the layer
        // sum: compressor/indexer shapes) per form.
        // GEMM_BENCH_FORMS=default,bf16: only those forms (by name).
        let pick = std::env::var("GEMM_BENCH_FORMS").ok();
        let forms: Vec<Form> = if let Some(p) = &pick {
            let all = [
                DEFAULT,
                DEFAULT_NOSKIP,
                DEFAULT_NOXB,
                DEFAULT_NOWG,
                INT8,
                BF16,
                BF16_NOSKIP,
                TILED,
                F16,
            ];
            p.split(',')
                .filter_map(|n| all.iter().find(|f| f.0 == n).copied())
                .collect()
        } else if moe_only {
            vec![
                DEFAULT,
                DEFAULT_NOWG,
                INT8,
                DEFAULT_NOSKIP,
                DEFAULT_NOXB,
                BF16,
                TILED,
                F16,
            ]
        } else {
            vec![DEFAULT, BF16, TILED, F16]
        };
        let mut layer = vec![0.0f64; forms.len()];
        println!("-- model shapes (q2 mix), n = {n} --");
        for (&(name, ty, cols, rows, groups, per_layer), w) in
            shapes.iter().zip(&ws).filter(|_| !moe_only)
        {
            let bytes = (rows * ty.row_bytes(cols as u64).unwrap() as usize) as f64;
            let flops = 2.0 * (n * rows * cols) as f64;
            let x: Vec<f32> = (0..n * cols * groups)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let x = gpu.upload(&x);
            let mut y = gpu.alloc(n * rows);
            for (fi, &form) in forms.iter().enumerate() {
                set_form(form);
                let s = if groups > 1 {
                    time(&gpu, &x, reps, || {
                        gpu.matmul_grouped(w, groups, &x, n, &mut y)
                    })
                } else {
                    time(&gpu, &x, reps, || gpu.matmul(w, Part::All, &x, n, &mut y))
                };
                if ty != GgmlType::F16 {
                    layer[fi] += s * per_layer as f64;
                }
                line(
                    &format!("{name} {ty:?} {}->{rows} {}", cols * groups, form.0),
                    flops,
                    bytes,
                    s,
                );
            }
        }
        // Routed experts: uniform random distinct choices per token.
        let mut sel = Vec::new();
        for _ in 0..n {
            let mut e: Vec<i32> = (0..ne as i32).collect();
            for i in 0..k {
                let j = rng.gen_range(i..ne);
                e.swap(i, j);
            }
            sel.extend_from_slice(&e[..k]);
        }
        let mut distinct = sel.clone();
        distinct.sort();
        distinct.dedup();
        let z: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let wgt: Vec<f32> = (0..n * k).map(|_| rng.gen_range(0.0..0.3)).collect();
        let (z, s_, wgt) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
        let mut out = gpu.alloc(n * d);
        let flops = 2.0 * (n * k * 3 * d * ff) as f64;
        for (fi, &form) in forms.iter().enumerate() {
            set_form(form);
            let s = time(&gpu, &z, reps.min(10), || {
                gpu.moe_experts(&spec, &wg, &wu, &wd, &z, &s_, &wgt, n, &mut out)
            });
            layer[fi] += s;
            line(
                &format!(
                    "moe q2 IQ2_XXS/Q2_K 256x6 n={n} ({} experts) {}",
                    distinct.len(),
                    form.0
                ),
                flops,
                slab * distinct.len() as f64,
                s,
            );
        }
        for (fi, form) in forms.iter().enumerate() {
            println!(
                "one layer's products at n = {n}, {}: {:.1} us; x 43 layers: {:.0} tok/s (products only)",
                form.0,
                layer[fi] * 1e6,
                n as f64 / (43.0 * layer[fi])
            );
        }
    }
    set_form(BF16);
}
