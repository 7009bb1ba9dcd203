//! `attn_bench [reps]`: decode attention in one launch (`attend_one_f32`, `gpu/attention.cu`) at
//! the full model's shapes (64 heads × 512, window 128, 64 RoPE dims, top-k 512) for each layer
//! kind at 2k and 32k context, where its time goes. (1) µs per call: `reps` launches back to
//! back between two events, as the engine launches it (PDL when on). (2) The probe
//! (`attend_one_p`, the same body plus %globaltimer stamps), one launch at a time: when each
//! phase ends after the first CTA's start (max over CTAs; median of the launches).
//! Splits and chunk as `GpuBackend::attend_one` (model/attn.rs) picks them.

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
const R: usize = 8; // DS4_AO_R
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
    let m = &ds4_kernels::ATTENTION;
    let s = Stream::DEFAULT;
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
    for &(name, ratio, indexed, t) in &cases {
        let top_k = if indexed { TOPK } else { 0 };
        let ncomp = (t + 1).checked_div(ratio).unwrap_or(0);
        let max_cand = WIN.min(t + 1) + top_k + if indexed { 0 } else { ncomp };
        let per_split = NH.div_ceil(HG);
        let most = (sms / per_split).clamp(1, 256);
        let splits = most.min(max_cand.div_ceil(R)).max(1);
        let chunk = max_cand.div_ceil(splits).next_multiple_of(R).max(R);
        let splits = max_cand.div_ceil(chunk).max(1);
        let grid = per_split * splits;
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
        let part_o = gpu.alloc(splits * NH * HD * 4).unwrap();
        let part_mz = gpu.alloc(splits * NH * 2 * 4).unwrap();
        let tk = up(&[0u8; 16]);
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
            Arg::Ptr(tk.ptr()),
            Arg::I64(t as i64),
            Arg::I32(1),
            Arg::I32(NH as i32),
            Arg::I32(HD as i32),
            Arg::I32(WIN as i32),
            Arg::I32(ratio as i32),
            Arg::I32(top_k as i32),
            Arg::I32(chunk as i32),
            Arg::I32(splits as i32),
            Arg::I32(NROT as i32),
            Arg::F32(1.0 / (HD as f32).sqrt()),
            Arg::Null, // absolute position (no per-step block)
        ];
        let dims = LaunchDims::linear(grid as u32, 256);
        let f = gpu.kernel(m, "attend_one_f32").expect("kernel");
        for _ in 0..10 {
            rt.launch(f, dims, s, &args).unwrap();
        }
        rt.event_record(e0, s).unwrap();
        for _ in 0..reps {
            rt.launch(f, dims, s, &args).unwrap();
        }
        rt.event_record(e1, s).unwrap();
        rt.event_sync(e1).unwrap();
        let us = rt.event_elapsed_ms(e0, e1).unwrap() as f64 * 1e3 / reps as f64;
        println!(
            "{name:<16} {max_cand} rows, grid {grid} ({splits} splits of {chunk}): {us:6.2} us/call"
        );
        // (2) probe stamps.
        args.push(Arg::Ptr(stamps.ptr()));
        let p = gpu.kernel(m, "attend_one_p").expect("probe kernel");
        let runs = 50;
        let mut rows: Vec<Vec<f64>> = vec![Vec::new(); NST];
        for _ in 0..runs {
            rt.memset_u32_async(stamps.ptr(), 0, grid * NST * 2, s)
                .unwrap();
            rt.launch(p, dims, s, &args).unwrap();
            rt.synchronize().unwrap();
            let st = read_u64(&gpu, stamps.ptr(), grid * NST);
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
        println!("  {:<24} {:7.2}", "last CTA start", med(&mut rows[0]));
        for (k, l) in labels.iter().enumerate() {
            println!("  {l:<24} {:7.2}", med(&mut rows[k + 1]));
        }
    }
    rt.event_destroy(e0).unwrap();
    rt.event_destroy(e1).unwrap();
}
