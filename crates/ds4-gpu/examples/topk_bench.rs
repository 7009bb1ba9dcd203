//! `topk_bench [reps]`: the lightning indexer's decode top-k (`gpu/attention.cu`) for one token
//! with v visible candidates (top-k 512, ratio 4, rows of v, Gaussian scores), and its query prep.
//! (1) µs per call, `reps` launches back to back between two events (after 10), as model/attn.rs
//! `index_topk` launches them: `index_topk_ps` (old), `index_topk_r` (one CTA,
//! keys in registers; v <= 16384), `index_topk_l1` + `index_topk_l2` (two levels, a pair of
//! launches per call; v > 16384; level-1 chunks of 16384 (the default) down to 2048). Every
//! form's selection must equal the old one's (exit 1 if not).
//! (2) The indexer query of one decode token (64 heads × 128, 64 RoPE dims): the copy, `rope_f32`
//! and `round_fp4h128_f32` against `index_qprep_f32` (its output must have their bits).

mod common;

use ds4_gpu::runtime::{Arg, LaunchDims, Stream};
use ds4_gpu::Gpu;
use rand::{Rng, SeedableRng};

const TOPK: usize = 512;
const RATIO: usize = 4;
const TK_N: usize = 16384; // DS4_TK_N

/// A standard normal sample (Box-Muller).
fn gauss(r: &mut impl Rng) -> f32 {
    let (u, v): (f64, f64) = (r.gen_range(1e-12..1.0), r.gen());
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

fn bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

type Events = (ds4_gpu::runtime::Event, ds4_gpu::runtime::Event);

/// µs per call of the launches `ks` (kernel, dims, args), in order, `reps` times.
fn time_us(gpu: &Gpu, ks: &[(&str, LaunchDims, Vec<Arg>)], reps: usize, (e0, e1): Events) -> f64 {
    let rt = gpu.runtime();
    let s = Stream::DEFAULT;
    let fs: Vec<_> = ks
        .iter()
        .map(|(n, _, _)| gpu.kernel(&ds4_kernels::ATTENTION, n).expect("kernel"))
        .collect();
    let go = || {
        for (f, (_, d, a)) in fs.iter().zip(ks) {
            rt.launch(*f, *d, s, a).unwrap();
        }
    };
    for _ in 0..10 {
        go();
    }
    rt.event_record(e0, s).unwrap();
    for _ in 0..reps {
        go();
    }
    rt.event_record(e1, s).unwrap();
    rt.event_sync(e1).unwrap();
    rt.event_elapsed_ms(e0, e1).unwrap() as f64 * 1e3 / reps as f64
}

fn read_i32(gpu: &Gpu, p: ds4_gpu::runtime::DevPtr, n: usize) -> Vec<i32> {
    let mut b = vec![0u8; n * 4];
    gpu.download(p, &mut b).unwrap();
    b.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn main() {
    let reps: usize = common::arg(1, 200);
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    println!(
        "# {} ({}); top-k {TOPK}, one token, Gaussian scores, {reps} reps; us per call",
        gpu.info().name,
        gpu.info().arch
    );
    let ev = (rt.event_create().unwrap(), rt.event_create().unwrap());
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
    let up = |b: &[u8]| gpu.alloc_from(b).expect("device memory");
    let mut differ = false;
    for &v in &[8192usize, 16384, 32768, 65_536, 131_072, 262_144] {
        let sc: Vec<f32> = (0..v).map(|_| gauss(&mut r)).collect();
        let scores = up(&bytes(&sc, f32::to_le_bytes));
        let sel = gpu.alloc(TOPK * 4).unwrap();
        // Survivors for the most chunks any form below takes (TK_N / TOPK).
        let gmax = TK_N / TOPK;
        let surv = gpu.alloc(2 * gmax * TOPK * 4).unwrap();
        let (skey, spos) = (surv.ptr(), surv.ptr().offset((gmax * TOPK * 4) as u64));
        let t = (RATIO * v - 1) as i64;
        let one = |name: &'static str| {
            let args = vec![
                Arg::Ptr(scores.ptr()),
                Arg::Ptr(sel.ptr()),
                Arg::I64(t),
                Arg::I64(v as i64),
                Arg::I32(RATIO as i32),
                Arg::I32(TOPK as i32),
                Arg::Null,
            ];
            vec![(name, LaunchDims::linear(1, 1024), args)]
        };
        let mut forms = vec![("old index_topk_ps", one("index_topk_ps"))];
        if v <= TK_N {
            forms.push(("index_topk_r", one("index_topk_r")));
        } else {
            // Level-1 chunks (attn.rs topk_chunk, DS4_GPU_TK_CHUNK): TK_N (the default) and
            // smaller ones, while their survivors fit one level-2 CTA.
            for chunk in [TK_N, 8192, 4096, 2048] {
                let g = v.div_ceil(chunk);
                if g * TOPK > TK_N {
                    continue;
                }
                let l1 = vec![
                    Arg::Ptr(scores.ptr()),
                    Arg::Ptr(skey),
                    Arg::Ptr(spos),
                    Arg::I64(t),
                    Arg::I64(v as i64),
                    Arg::I32(RATIO as i32),
                    Arg::I32(TOPK as i32),
                    Arg::I32(g as i32),
                    Arg::I32(chunk as i32),
                    Arg::Null,
                ];
                let l2 = vec![
                    Arg::Ptr(skey),
                    Arg::Ptr(spos),
                    Arg::Ptr(sel.ptr()),
                    Arg::I64(t),
                    Arg::I32(RATIO as i32),
                    Arg::I32(TOPK as i32),
                    Arg::I32(g as i32),
                    Arg::I32(chunk as i32),
                    Arg::Null,
                ];
                let d1 = LaunchDims {
                    grid: [g as u32, 1, 1],
                    block: [1024, 1, 1],
                    shared_bytes: 0,
                };
                forms.push((
                    match chunk {
                        TK_N => "l1+l2 chunk 16384",
                        8192 => "l1+l2 chunk 8192",
                        4096 => "l1+l2 chunk 4096",
                        _ => "l1+l2 chunk 2048",
                    },
                    vec![
                        ("index_topk_l1", d1, l1),
                        ("index_topk_l2", LaunchDims::linear(1, 1024), l2),
                    ],
                ));
            }
        }
        let mut first: Option<Vec<i32>> = None;
        for round in 0..2 {
            for (label, ks) in &forms {
                rt.memset_u32_async(sel.ptr(), 0, TOPK, Stream::DEFAULT)
                    .unwrap();
                let us = time_us(&gpu, ks, reps, ev);
                let got = read_i32(&gpu, sel.ptr(), TOPK);
                let same = match &first {
                    None => {
                        first = Some(got);
                        true
                    }
                    Some(f) => *f == got,
                };
                differ |= !same;
                println!(
                    "v {v:7} {round} {label:<18} {us:8.2}{}",
                    if same { "" } else { "  SELECTION DIFFERS" }
                );
            }
        }
    }
    // Query prep: 64 heads × 128 of one token at position 32767.
    let (nh, hd, nrot) = (64usize, 128usize, 64usize);
    let q: Vec<f32> = (0..nh * hd).map(|_| gauss(&mut r)).collect();
    let qd = up(&bytes(&q, f32::to_le_bytes));
    let fr: Vec<f64> = (0..nrot / 2)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / nrot as f64))
        .collect();
    let freqs = up(&bytes(&fr, f64::to_le_bytes));
    let (o1, o2) = (
        gpu.alloc(nh * hd * 4).unwrap(),
        gpu.alloc(nh * hd * 4).unwrap(),
    );
    let pos = 32_767i64;
    let rope = vec![
        Arg::Ptr(o1.ptr()),
        Arg::Ptr(freqs.ptr()),
        Arg::I64(nh as i64),
        Arg::I32(nh as i32),
        Arg::I32(hd as i32),
        Arg::I32(nrot as i32),
        Arg::I64(pos),
        Arg::I64(1),
        Arg::I32(0),
        Arg::Null,
    ];
    let round = vec![Arg::Ptr(o1.ptr()), Arg::I64(nh as i64), Arg::I32(0)];
    let old = [
        (
            "rope_f32",
            LaunchDims::linear((nh * nrot / 2).div_ceil(256) as u32, 256),
            rope,
        ),
        (
            "round_fp4h128_f32",
            LaunchDims::linear(nh.div_ceil(8) as u32, 256),
            round,
        ),
    ];
    let fused_args = vec![
        Arg::Ptr(qd.ptr()),
        Arg::Ptr(o2.ptr()),
        Arg::Ptr(freqs.ptr()),
        Arg::I64(nh as i64),
        Arg::I32(nh as i32),
        Arg::I32(nrot as i32),
        Arg::I64(pos),
        Arg::Null,
    ];
    let dims = LaunchDims::linear(nh.div_ceil(8) as u32, 256);
    let fused = [("index_qprep_f32", dims, fused_args)];
    for round in 0..2 {
        // The old form's copy (a d2d of 32 KiB) is not timed; its launches rotate and round
        // the same buffer again each time (the time does not depend on the values).
        let t_old = time_us(&gpu, &old, reps, ev);
        let t_new = time_us(&gpu, &fused, reps, ev);
        println!(
            "query prep {round}: rope_f32 + round_fp4h128_f32 {t_old:6.2} (copy not timed), \
             index_qprep_f32 {t_new:6.2}"
        );
    }
    rt.copy_d2d_async(o1.ptr(), qd.ptr(), nh * hd * 4, Stream::DEFAULT)
        .unwrap();
    for (n, d, a) in &old {
        let f = gpu.kernel(&ds4_kernels::ATTENTION, n).unwrap();
        rt.launch(f, *d, Stream::DEFAULT, a).unwrap();
    }
    rt.synchronize().unwrap();
    let (a, b) = (
        gpu.download_f32(o1.ptr(), nh * hd).unwrap(),
        gpu.download_f32(o2.ptr(), nh * hd).unwrap(),
    );
    let qsame = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
    println!("query prep bits equal: {qsame}");
    rt.event_destroy(ev.0).unwrap();
    rt.event_destroy(ev.1).unwrap();
    if differ || !qsame {
        eprintln!("FAIL: outputs differ");
        std::process::exit(1);
    }
    println!("# every selection equals the old kernel's");
}
