//! `hc_bench [reps]`: the fused HC post + pre + norm of one decode token (N 4, D 4096, an F16
//! mixer of 24 rows × 16384, 20 Sinkhorn iterations; `gpu/fused.cu`), where its time goes.
//! (1) µs per call of the kernel (`hc_post_pre_norm_l`) and of its probe (`hc_post_pre_norm_p`,
//! waiting for the previous kernel first or, as `_l`, after the mixer loads) stopped after each
//! phase: `reps` launches back to back between two events (PDL launches as in the engine).
//! (2) The probe's %globaltimer stamps (one launch at a time): when each phase ends, after the
//! first CTA starts (max over the CTAs for the per-CTA phases; the last CTA's for the
//! epilogue: its z's end apart from its Sinkhorn's on CUDA), and the Sinkhorn's and the
//! collapse's clock64 cycles.
//! (3) first, prefill (`HC_BENCH_N` tokens, default 2048; `GpuBackend`): µs per call of
//! hc_post_pre_norm (the HC post, then the HC pre) and hc_pre_norm with the `hcp_mix` +
//! `hcp_finish` kernels (`set_hcp("on")`), with `hcp_mix_tc` at 2, 4 and 8 CTAs per SM after
//! the separate post or with the post inside (`hcp_post_mix_tc`), and with the composed ops
//! ("off"): `reps` (at most 50) calls queued between two syncs (wall clock).
//! `HC_BENCH_PREFILL_ONLY=1`: (3) alone.

mod common;

use ds4_backend::{Backend, GgmlType, HcDims, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::runtime::{Arg, DevPtr, LaunchDims, Stream};
use ds4_gpu::{Gpu, GpuBackend};
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use half::f16;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

const NH: usize = 4;
const D: usize = 4096;
const MIX: usize = (2 + NH) * NH;
const FW_T: u32 = 256; // fused.cu FW_T
const FU_PART: usize = 32; // fused.cu FU_PART
const FP_NST: usize = 12; // fused.cu FP_NST
const ITERS: i32 = 20;

fn randv(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(lo..hi)).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A GGUF in memory with one tensor `t` of type `ty` and dims `dims` (bytes `b`).
fn gguf(ty: GgmlType, dims: &[u64], b: Vec<u8>) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    w.add_tensor("t", ty, dims).unwrap();
    let bytes = w
        .to_bytes(|_, out: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
            out.copy_from_slice(&b);
            Ok(())
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes("bench.gguf", bytes).unwrap())
}

fn wsrc(f: &Arc<GgufFile>) -> WeightSrc<'_> {
    let t = f.tensor("t").unwrap();
    WeightSrc {
        name: "t",
        file: f,
        ty: t.ty,
        dims: &t.dims,
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    }
}

/// (3) The prefill HC ops at n tokens: the hcp kernels against the composed ops.
fn prefill(reps: usize) {
    let n: usize = std::env::var("HC_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048);
    let gpu = GpuBackend::new(common::open_gpu(), &rope_tables(&HParams::tiny())).expect("backend");
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(9);
    let mixer: Vec<u8> = (0..MIX * NH * D)
        .flat_map(|_| f16::from_f32(r.gen_range(-0.05f32..0.05)).to_le_bytes())
        .collect();
    let fm = gguf(GgmlType::F16, &[(NH * D) as u64, MIX as u64], mixer);
    let mixer = gpu.matrix(&wsrc(&fm)).unwrap();
    let vecw = |v: Vec<f32>| {
        let f = gguf(GgmlType::F32, &[v.len() as u64], bytes(&v));
        gpu.vector(&wsrc(&f)).unwrap()
    };
    let scale = vecw(vec![0.5f32, 0.5, 0.5]);
    let base = vecw(randv(&mut r, MIX, -1.0, 1.0));
    let norm = vecw(randv(&mut r, D, 0.5, 1.5));
    let x0 = randv(&mut r, n * NH * D, -2.0, 2.0);
    let mut x = gpu.upload(&x0);
    let o = gpu.upload(&randv(&mut r, n * D, -2.0, 2.0));
    // A convex comb and post near 1: x stays bounded over the calls.
    let pin = gpu.upload(&randv(&mut r, n * NH, 0.0, 0.1));
    let cin = gpu.upload(&vec![0.25f32; n * NH * NH]);
    let (mut z, mut post, mut comb) = (gpu.alloc(n * D), gpu.alloc(n * NH), gpu.alloc(n * NH * NH));
    let h = HcDims {
        n: NH,
        d: D,
        sinkhorn_iters: ITERS as usize,
        eps: 1e-6,
    };
    println!("# (3) prefill n {n}: us per call, {reps} calls queued between two syncs");
    for round in 0..2 {
        // (label, DS4_GPU_HCP, DS4_GPU_HCP_TC: off or CTAs per SM, DS4_GPU_HCP_POST)
        for (label, hcp, tc, hpost) in [
            ("composed", "off", 0, "on"),
            ("hcp", "on", 0, "on"),
            ("tc2-sep", "on", 2, "off"),
            ("tc4-sep", "on", 4, "off"),
            ("tc8-sep", "on", 8, "off"),
            ("tc2-post", "on", 2, "on"),
            ("tc4-post", "on", 4, "on"),
            ("tc8-post", "on", 8, "on"),
        ] {
            GpuBackend::set_hcp(hcp);
            GpuBackend::set_hcp_tc_ctas(tc);
            GpuBackend::set_hcp_post(hpost);
            for with_post in [true, false] {
                let mut call = |x: &mut <GpuBackend as Backend>::Buf| {
                    if with_post {
                        gpu.hc_post_pre_norm(
                            h, x, &o, &pin, &cin, &mixer, &scale, &base, &norm, n, 1e-6, &mut z,
                            &mut post, &mut comb,
                        );
                    } else {
                        gpu.hc_pre_norm(
                            h, &mixer, &scale, &base, &norm, x, n, 1e-6, &mut z, &mut post,
                            &mut comb,
                        );
                    }
                };
                call(&mut x);
                call(&mut x);
                gpu.download(&x, 1);
                let t = Instant::now();
                for _ in 0..reps {
                    call(&mut x);
                }
                gpu.download(&x, 1);
                let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
                if let Err(e) = gpu.check() {
                    panic!("GPU error: {e}");
                }
                let op = if with_post {
                    "hc_post_pre_norm"
                } else {
                    "hc_pre_norm"
                };
                println!("{op:<18} {label:<14} {us:9.1}  (round {round})");
            }
        }
    }
    GpuBackend::set_hcp("on");
    GpuBackend::set_hcp_tc("on");
    GpuBackend::set_hcp_post("on");
}

fn main() {
    let reps: usize = common::arg(1, 200);
    prefill(reps.min(50));
    if std::env::var_os("HC_BENCH_PREFILL_ONLY").is_some() {
        return;
    }
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    let warp = gpu.info().warp as usize;
    let splits = (D / 4).div_ceil(warp / NH); // 128 at warp 32
    println!(
        "# {} ({}), {} SMs; N {NH}, D {D}, F16 mixer {MIX} x {}, {splits} CTAs of {FW_T}, {reps} reps",
        gpu.info().name,
        gpu.info().arch,
        gpu.info().sm_count,
        NH * D
    );
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
    let up = |v: &[f32]| gpu.alloc_from(&bytes(v)).expect("device memory");
    let x = up(&randv(&mut r, NH * D, -2.0, 2.0));
    let o = up(&randv(&mut r, D, -2.0, 2.0));
    let post_in = up(&randv(&mut r, NH, 0.5, 1.5));
    let comb_in = up(&[0.25f32; NH * NH]);
    let mixer: Vec<u8> = (0..MIX * NH * D)
        .flat_map(|_| f16::from_f32(r.gen_range(-0.05f32..0.05)).to_le_bytes())
        .collect();
    let mixer = gpu.alloc_from(&mixer).expect("device memory");
    let scale = up(&[0.5f32, 0.5, 0.5]);
    let base = up(&randv(&mut r, MIX, -1.0, 1.0));
    let norm = up(&randv(&mut r, D, 0.5, 1.5));
    let z = gpu.alloc(D * 4).unwrap();
    let post = gpu.alloc(NH * 4).unwrap();
    let comb = gpu.alloc(NH * NH * 4).unwrap();
    let part = gpu.alloc(splits * FU_PART * 8).unwrap();
    let tickets = gpu.alloc_from(&[0u8; 4 * 128]).unwrap();
    let stamps = gpu.alloc(splits * FP_NST * 8).unwrap();
    let args = |extra: Option<(i32, i32)>| {
        let mut a = vec![
            Arg::Ptr(x.ptr()),
            Arg::Ptr(o.ptr()),
            Arg::Ptr(post_in.ptr()),
            Arg::Ptr(comb_in.ptr()),
            Arg::Ptr(mixer.ptr()),
            Arg::I64((NH * D * 2) as i64),
            Arg::I32(1),
            Arg::Ptr(scale.ptr()),
            Arg::Ptr(base.ptr()),
            Arg::Ptr(norm.ptr()),
            Arg::Ptr(z.ptr()),
            Arg::Ptr(post.ptr()),
            Arg::Ptr(comb.ptr()),
            Arg::Ptr(part.ptr()),
            Arg::Ptr(tickets.ptr()),
            Arg::I32(NH as i32),
            Arg::I32(D as i32),
            Arg::I32(splits as i32),
            Arg::I32(ITERS),
            Arg::F32(1e-6),
            Arg::F32(1e-6),
        ];
        if let Some((form, stop)) = extra {
            a.extend([Arg::I32(form), Arg::I32(stop), Arg::Ptr(stamps.ptr())]);
        }
        a
    };
    let fused = &ds4_kernels::FUSED;
    let dims = LaunchDims::linear(splits as u32, FW_T);
    let s = Stream::DEFAULT;
    let (e0, e1) = (rt.event_create().unwrap(), rt.event_create().unwrap());
    let time = |name: &str, a: &[Arg]| -> f64 {
        let f = gpu.kernel(fused, name).expect("kernel");
        for _ in 0..10 {
            rt.launch(f, dims, s, a).unwrap();
        }
        rt.event_record(e0, s).unwrap();
        for _ in 0..reps {
            rt.launch(f, dims, s, a).unwrap();
        }
        rt.event_record(e1, s).unwrap();
        rt.event_sync(e1).unwrap();
        rt.event_elapsed_ms(e0, e1).unwrap() as f64 * 1e3 / reps as f64
    };
    println!("# (1) us per call, {reps} back-to-back launches (PDL as the engine)");
    for round in 0..2 {
        let name = "hc_post_pre_norm_l";
        println!(
            "{name:<34} {:7.2}  (round {round})",
            time(name, &args(None))
        );
    }
    let stops = [
        (1, "after the pair values"),
        (2, "after the partials stored"),
        (3, "after the ticket"),
        (4, "after the partial sums"),
        (6, "full but the collapse"),
        (5, "full but the Sinkhorn"),
        (0, "full"),
    ];
    for (form, fname) in [(0, "wait"), (1, "late")] {
        for &(stop, what) in &stops {
            let us = time("hc_post_pre_norm_p", &args(Some((form, stop))));
            println!("probe {fname:<4} stop {stop} {what:<26} {us:7.2}");
        }
    }
    // (2) stamps, one launch at a time.
    let f = gpu.kernel(fused, "hc_post_pre_norm_p").unwrap();
    let runs = 50;
    let labels = [
        "pair values (max over CTAs)",
        "partials stored (max)",
        "ticket (max)",
        "last CTA: partial sums",
        "last CTA: m, pre",
        "last CTA: Sinkhorn end",
        "last CTA: collapse end",
        "last CTA: sum z^2",
        "last CTA: z end",
    ];
    println!("# (2) probe stamps, us after the first CTA's start (median of {runs} launches)");
    for (form, fname) in [(0, "wait"), (1, "late")] {
        let mut rows: Vec<Vec<f64>> = vec![Vec::new(); labels.len() + 5];
        for _ in 0..runs {
            rt.memset_u32_async(stamps.ptr(), 0, splits * FP_NST * 2, s)
                .unwrap();
            rt.launch(f, dims, s, &args(Some((form, 0)))).unwrap();
            rt.synchronize().unwrap();
            let st = read_u64(&gpu, stamps.ptr(), splits * FP_NST);
            let cta = |c: usize, k: usize| st[c * FP_NST + k];
            let t0 = (0..splits).map(|c| cta(c, 0)).min().unwrap();
            let t0max = (0..splits).map(|c| cta(c, 0)).max().unwrap();
            let last = (0..splits).find(|&c| cta(c, 4) != 0).expect("a last CTA");
            let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
            for k in 1..=3 {
                let m = (0..splits).map(|c| cta(c, k)).max().unwrap();
                rows[k - 1].push(us(m));
            }
            for k in 4..=9 {
                rows[k - 1].push(us(cta(last, k)));
            }
            rows[9].push(us(t0max));
            let a_min = (0..splits).map(|c| cta(c, 2)).min().unwrap();
            rows[10].push(us(a_min));
            rows[11].push(cta(last, 10) as f64);
            rows[12].push(cta(last, 11) as f64);
            rows[13].push(us(cta(last, 6).max(cta(last, 9))));
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        println!("{fname}:");
        for (i, l) in labels.iter().enumerate() {
            println!("  {l:<30} {:8.2}", med(&mut rows[i]));
        }
        println!("  {:<30} {:8.2}", "last CTA start (max)", med(&mut rows[9]));
        println!(
            "  {:<30} {:8.2}",
            "first partials stored (min)",
            med(&mut rows[10])
        );
        println!("  {:<30} {:8.0}", "Sinkhorn cycles", med(&mut rows[11]));
        println!("  {:<30} {:8.0}", "collapse cycles", med(&mut rows[12]));
        println!(
            "  {:<30} {:8.2}",
            "last CTA: end (Sinkhorn or z)",
            med(&mut rows[13])
        );
    }
    let zs = gpu.download_f32(z.ptr(), 4).unwrap();
    println!("# z[0..4] {zs:?}");
    rt.event_destroy(e0).unwrap();
    rt.event_destroy(e1).unwrap();
}

fn read_u64(gpu: &Gpu, p: DevPtr, n: usize) -> Vec<u64> {
    let mut b = vec![0u8; n * 8];
    gpu.download(p, &mut b).unwrap();
    b.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
