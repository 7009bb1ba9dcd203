//! `attn_bench [reps]`: decode attention in one launch (`attend_one_f32`, `gpu/attention.cu`) at
//! the full model's shapes (64 heads × 512, window 128, 64 RoPE dims, top-k 512) for each layer
//! kind at 2k and 32k context, where its time goes. (1) µs per call: `reps` launches back to
//! back between two events, as the engine launches it (PDL when on). (2) The probe
//! (`attend_one_p`, the same body plus %globaltimer stamps), one launch at a time: when each
//! phase ends after the first CTA's start (max over CTAs; median of the launches).
//! Launched as the decode graph launches it (model/attn.rs `attend_one` with a step position):
//! the position in a device word, chunk 0 (the kernel picks chunk and splits), a grid of the
//! most splits (CTAs past the used splits join the barrier and the merge). Each form in `forms`
//! twice, alternating, each with its own counters; each form's second output must have its
//! first one's bits (exit 1 if not), and the largest difference of each form's output from the
//! first form's is printed. A/B forms go in `forms` (session 11's:
//! bench/results/gpu-attn-a12-h200.txt; session 17's: gpu-attn-a17-h200.txt): the f32 tile
//! loop, the tile loop on tensor cores (`attend_one_tc`) and its A/B forms v1, v5 (session 19:
//! model/attn.rs `DS4_GPU_AOTC`); the last field of a form caps its splits (fewer, longer
//! splits: a17's tc s24 / s16 / s8).

mod common;

use ds4_gpu::runtime::{Arg, DevPtr, LaunchDims, Stream};
use ds4_gpu::Gpu;
use rand::{Rng, SeedableRng};

const NH: usize = 64;
const HD: usize = 512;
const WIN: usize = 128;
const NROT: usize = 64;
const TOPK: usize = 512;
const HG: usize = 16; // DS4_AO_HG
const NST: usize = 8; // DS4_AO_NST

fn randv(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(lo..hi)).collect()
}

fn bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn read_u64(gpu: &Gpu, p: DevPtr, n: usize) -> Vec<u64> {
    let mut b = vec![0u8; n * 8];
    gpu.download(p, &mut b).unwrap();
    b.chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn main() {
    let reps: usize = common::arg(1, 400);
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    let sms = gpu.info().sm_count as usize;
    println!(
        "# {} ({}), {sms} SMs; heads {NH} x {HD}, window {WIN}, top-k {TOPK}, {reps} reps",
        gpu.info().name,
        gpu.info().arch
    );
    let (e0, e1) = (rt.event_create().unwrap(), rt.event_create().unwrap());
    let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
    let up = |b: &[u8]| gpu.alloc_from(b).expect("device memory");
    // (name, ratio, indexed, t): one decode token at position t.
    let cases = [
        ("window only 2k", 0usize, false, 2047usize),
        ("HCA r128 2k", 128, false, 2047),
        ("CSA r4 2k", 4, true, 2047),
        ("HCA r128 32k", 128, false, 32767),
        ("CSA r4 32k", 4, true, 32767),
    ];
    let labels = [
        "row pointers listed",
        "first tile in shared",
        "tile loop done",
        "partials stored",
        "past the barrier",
        "merge done",
        "exit",
    ];
    // (label, timed kernel, probe kernel, rows per tile, most splits)
    let forms = [
        ("f32", "attend_one_f32", "attend_one_p", 8usize, 256usize),
        ("tc", "attend_one_tc", "attend_one_tcp", 16, 256),
        ("tc v1", "attend_one_tc1", "attend_one_tc1p", 16, 256),
        ("tc v5", "attend_one_tc5", "attend_one_tc5p", 16, 256),
    ];
    println!(
        "# columns: us/call, then phase ends (us after the first CTA's start): last CTA start, {}",
        labels.join(", ")
    );
    let mut differ = false;
    for &(name, ratio, indexed, t) in &cases {
        let top_k = if indexed { TOPK } else { 0 };
        let ncomp = (t + 1).checked_div(ratio).unwrap_or(0);
        let max_cand = WIN.min(t + 1) + top_k + if indexed { 0 } else { ncomp };
        let per_split = NH.div_ceil(HG);
        let full = (sms / per_split).clamp(1, 256);
        // A form's grid and (splits, chunk) as model/attn.rs `attend_one` picks them.
        let shape = |r: usize, cap: usize| {
            let most = full.min(cap).max(1);
            let splits = most.min(max_cand.div_ceil(r)).max(1);
            let chunk = max_cand.div_ceil(splits).next_multiple_of(r).max(r);
            (most, max_cand.div_ceil(chunk).max(1), chunk)
        };
        let grid = per_split * full;
        let q = up(&bytes(&randv(&mut r, NH * HD, -0.3, 0.3), f32::to_le_bytes));
        let kv = up(&bytes(&randv(&mut r, HD, -1.0, 1.0), f32::to_le_bytes));
        let raw = up(&bytes(
            &randv(&mut r, WIN * HD, -1.0, 1.0),
            f32::to_le_bytes,
        ));
        // Slot s holds the latest position p < t with p % WIN == s.
        let pos: Vec<i32> = (0..WIN)
            .map(|sl| {
                (0..t)
                    .rev()
                    .find(|p| p % WIN == sl)
                    .map_or(-1, |p| p as i32)
            })
            .collect();
        let raw_pos = up(&bytes(&pos, i32::to_le_bytes));
        let comp = up(&bytes(
            &randv(&mut r, ncomp.max(1) * HD, -1.0, 1.0),
            f32::to_le_bytes,
        ));
        let selv: Vec<i32> = (0..TOPK)
            .map(|_| r.gen_range(0..ncomp.max(1)) as i32)
            .collect();
        let sel = up(&bytes(&selv, i32::to_le_bytes));
        let sinks = up(&bytes(&randv(&mut r, NH, -2.0, 2.0), f32::to_le_bytes));
        let fr: Vec<f64> = (0..NROT / 2)
            .map(|i| 10000f64.powf(-2.0 * i as f64 / NROT as f64))
            .collect();
        let freqs = up(&bytes(&fr, f64::to_le_bytes));
        let out = gpu.alloc(NH * HD * 4).unwrap();
        let part_o = gpu.alloc(full * NH * HD * 4).unwrap();
        let part_mz = gpu.alloc(full * NH * 2 * 4).unwrap();
        let tks: Vec<_> = forms.iter().map(|_| up(&[0u8; 16])).collect();
        let pos_w = up(&(t as i64).to_le_bytes());
        let stamps = gpu.alloc(grid * NST * 8).unwrap();
        let mut args = vec![
            Arg::Ptr(q.ptr()),
            Arg::Ptr(kv.ptr()),
            Arg::Ptr(raw.ptr()),
            Arg::Ptr(raw_pos.ptr()),
            if ratio > 0 {
                Arg::Ptr(comp.ptr())
            } else {
                Arg::Null
            },
            if indexed {
                Arg::Ptr(sel.ptr())
            } else {
                Arg::Null
            },
            Arg::Ptr(sinks.ptr()),
            Arg::Ptr(freqs.ptr()),
            Arg::Ptr(out.ptr()),
            Arg::Ptr(part_o.ptr()),
            Arg::Ptr(part_mz.ptr()),
            Arg::Null, // counters: per form, below
            Arg::I64(0),
            Arg::I32(1),
            Arg::I32(NH as i32),
            Arg::I32(HD as i32),
            Arg::I32(WIN as i32),
            Arg::I32(ratio as i32),
            Arg::I32(top_k as i32),
            Arg::I32(0),           // chunk 0: the kernel picks chunk and splits
            Arg::I32(full as i32), // most splits: per form, below
            Arg::I32(NROT as i32),
            Arg::F32(1.0 / (HD as f32).sqrt()),
            Arg::Ptr(pos_w.ptr()),
        ];
        println!("{name}: {max_cand} rows, grid {grid} at most");
        for &(label, _, _, r, cap) in &forms {
            let (most, splits, chunk) = shape(r, cap);
            println!(
                "  {label}: grid {} ({splits} splits of {chunk} used)",
                per_split * most
            );
        }
        // Each form's round-0 output; its round-1 output must have the same bits.
        let mut first: Vec<Option<Vec<f32>>> = vec![None; forms.len()];
        for round in 0..2 {
            for (fi, &(label, kname, pname, r, cap)) in forms.iter().enumerate() {
                let (most, _, _) = shape(r, cap);
                let dims = LaunchDims::linear((per_split * most) as u32, 256);
                args[11] = Arg::Ptr(tks[fi].ptr());
                args[20] = Arg::I32(most as i32);
                let us = time_us(&gpu, kname, dims, &args, reps, (e0, e1));
                let mut got = vec![0u8; NH * HD * 4];
                gpu.download(out.ptr(), &mut got).unwrap();
                let got: Vec<f32> = got
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                // Largest |difference| from the first form's output, relative to its largest |value|.
                let rel = first[0].as_ref().map_or(0.0, |f0| {
                    let top = f0.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = f0
                        .iter()
                        .zip(&got)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    d / top
                });
                match &first[fi] {
                    None => first[fi] = Some(got),
                    Some(f) if f.iter().zip(&got).any(|(a, b)| a.to_bits() != b.to_bits()) => {
                        println!("  {round} {label}: output bits differ from its first");
                        differ = true;
                    }
                    Some(_) => {}
                }
                let mut a = args.clone();
                a.push(Arg::Ptr(stamps.ptr()));
                let st = probe(&gpu, pname, dims, &a, per_split * most);
                let cols: Vec<String> = st.iter().map(|v| format!("{v:6.2}")).collect();
                println!(
                    "  {round} {label:<10} {us:6.2} | {} | vs {}: {rel:.2e}",
                    cols.join(" "),
                    forms[0].0
                );
            }
        }
    }
    rt.event_destroy(e0).unwrap();
    rt.event_destroy(e1).unwrap();
    if differ {
        eprintln!("FAIL: the outputs differ");
        std::process::exit(1);
    }
    println!("# every form's outputs have the same bits in both rounds");
}

/// µs per call of `kname`: `reps` launches back to back between two events (after 10).
fn time_us(
    gpu: &Gpu,
    kname: &str,
    dims: LaunchDims,
    args: &[Arg],
    reps: usize,
    (e0, e1): (ds4_gpu::runtime::Event, ds4_gpu::runtime::Event),
) -> f64 {
    let rt = gpu.runtime();
    let s = Stream::DEFAULT;
    let f = gpu.kernel(&ds4_kernels::ATTENTION, kname).expect("kernel");
    for _ in 0..10 {
        rt.launch(f, dims, s, args).unwrap();
    }
    rt.event_record(e0, s).unwrap();
    for _ in 0..reps {
        rt.launch(f, dims, s, args).unwrap();
    }
    rt.event_record(e1, s).unwrap();
    rt.event_sync(e1).unwrap();
    rt.event_elapsed_ms(e0, e1).unwrap() as f64 * 1e3 / reps as f64
}

/// The probe `pname` launched one at a time: per stamp k, the latest CTA's stamp k after the
/// first CTA's start, median over the launches (k = 0: the last CTA's start).
fn probe(gpu: &Gpu, pname: &str, dims: LaunchDims, args: &[Arg], grid: usize) -> Vec<f64> {
    let rt = gpu.runtime();
    let s = Stream::DEFAULT;
    let stamps = match args.last() {
        Some(Arg::Ptr(p)) => *p,
        _ => unreachable!("the stamps pointer is the last argument"),
    };
    let p = gpu
        .kernel(&ds4_kernels::ATTENTION, pname)
        .expect("probe kernel");
    {
        let runs = 50;
        let mut rows: Vec<Vec<f64>> = vec![Vec::new(); NST];
        for _ in 0..runs {
            rt.memset_u32_async(stamps, 0, grid * NST * 2, s).unwrap();
            rt.launch(p, dims, s, args).unwrap();
            rt.synchronize().unwrap();
            let st = read_u64(gpu, stamps, grid * NST);
            let at = |c: usize, k: usize| st[c * NST + k];
            let t0 = (0..grid).map(|c| at(c, 0)).min().unwrap();
            rows[0].push(
                (0..grid)
                    .map(|c| at(c, 0))
                    .max()
                    .unwrap()
                    .saturating_sub(t0) as f64
                    / 1e3,
            );
            for (k, row) in rows.iter_mut().enumerate().skip(1) {
                let mx = (0..grid).map(|c| at(c, k)).max().unwrap();
                row.push(mx.saturating_sub(t0) as f64 / 1e3);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        rows.iter_mut().map(med).collect()
    }
}
