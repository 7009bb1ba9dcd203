//! `overlap_bench [MB] [glue ops] [chase] [idx MB] [segments]`: what a dataflow-flag product
//! would buy. A decode step's products wait behind chains of small dependent glue ops (~2.2 ms of a 6.2 ms
//! step, README "Against the targets"); an L2 prefetch beside the glue did not help
//! (the products re-read DRAM, session 59). Here the product is launched at the chain's start
//! on a second branch of the graph, copies the first `pre` bytes of each CTA's slice into its
//! shared memory while the glue runs, and waits for its input on a flag the glue's last op
//! releases (elementwise.cu `probe_pre`, `probe_glue`).
//!
//! Forms, each one CUDA graph of `segments` (4) segments replayed, segment s with its own copy of
//! the weights (so that they come from DRAM, as a decode step's do: 4 x 36 MB exceed the L2):
//! - glue: `glue ops` kernels of 16 CTAs, each thread following `chase` dependent loads through a
//!   random map of `idx MB` (256: DRAM latency; 8: L2), then the join kernel;
//! - product: the streaming products alone (MB of weights each, one CTA an SM);
//! - serial pre=K: glue, then the product after a PDL boundary (how the engine runs it now),
//!   staging K KiB a CTA before its PDL wait (while the last glue op runs);
//! - overlap pre=K: the product on the side branch staging K KiB a CTA, the glue on the main
//!   chain releasing the flag, the join after both;
//! - paced: overlap with the staging spread over the glue (a 4 KiB round a CTA every 125-500 ns
//!   at 96 / 160 / 224 KiB: a burst slows the glue beside it);
//! - stamps: one graph's last segment by %globaltimer (each glue op's start and end; the product
//!   CTAs' start, wait, streamed and end as min / median / max) for serial, overlap and the best
//!   paced form. Results: bench/results/gpu-s60-h100.txt.
//!
//! `OVERLAP_GLUE_ONLY=1`: instead, what a glue op costs: graphs of 32 ops of 1 / 16 / 132 CTAs
//! and 0-8 dependent loads a thread (the op boundary, the last-CTA ticket: an atomic xor, a
//! fence, the ticket, the last CTA's exchange; each dependent round trip).
//!
//! Prints µs a segment (best of 5 rounds of 20 replays, host clock to completion) and the time
//! against serial pre=0, with the bytes staged over the whole grid.

mod common;

use ds4_gpu::gpu::StepGraphs;
use ds4_gpu::runtime::{Arg, KernelCall, LaunchDims, Stream, FLOW_JOIN, FLOW_MAIN, FLOW_SIDE};
use std::time::Instant;

fn main() {
    let mb: f64 = common::arg(1, 36.0);
    let glue_ops: usize = common::arg(2, 8);
    let chase: i32 = common::arg(3, 4);
    let idx_mb: f64 = common::arg(4, 256.0);
    let segs: usize = common::arg(5, 4usize).max(1);
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    let info = gpu.info().clone();
    let k = |name: &str| {
        gpu.kernel(&ds4_kernels::ELEMENTWISE, name)
            .unwrap_or_else(|e| panic!("kernel {name}: {e}"))
    };
    let (f_idx, f_glue, f_pre, f_join) = (
        k("probe_idx"),
        k("probe_glue"),
        k("probe_pre"),
        k("probe_join"),
    );
    let vpp = (mb * 1e6 / 16.0) as usize;
    let w = gpu.alloc(vpp * 16 * segs).expect("weights");
    let words = ((idx_mb * 1e6 / 4.0) as usize).max(1024);
    let idx = gpu.alloc(words * 4).expect("idx");
    // u32 words: io[0..2] (probe_glue's start word and xor word), the ticket at 32, the flag at
    // 48 (each on its own 64-byte span).
    let io = gpu.alloc(256).expect("io words");
    let sink = gpu.alloc(info.sm_count as usize * 4).expect("sink");
    let s = Stream::DEFAULT;
    rt.memset_u32_async(w.ptr(), 0x5a5a_0101, vpp * 4 * segs, s)
        .unwrap();
    rt.memset_u32_async(io.ptr(), 0, 64, s).unwrap();
    rt.launch(
        f_idx,
        LaunchDims::linear(1024, 256),
        s,
        &[Arg::Ptr(idx.ptr()), Arg::U32(words as u32)],
    )
    .unwrap();
    gpu.synchronize().unwrap();
    let ticket = io.ptr().offset(128);
    let flag = io.ptr().offset(192);
    // Stamps (ns): glue op i at 2i, 2i + 1; the product's CTA b at 64 + 4b .. (4 a CTA).
    let stamps = gpu
        .alloc((64 + 4 * info.sm_count as usize) * 8)
        .expect("stamps");
    // One glue op: `ctas` CTAs, `ch` dependent loads a thread, the flag it releases and its stamps
    // (either may be Arg::Null).
    let glue_call = |ctas: u32, ch: i32, fl: Arg, st: Arg| {
        KernelCall::new(
            f_glue,
            LaunchDims::linear(ctas, 256),
            &[
                Arg::Ptr(idx.ptr()),
                Arg::U32(words as u32),
                Arg::I32(ch),
                Arg::Ptr(io.ptr()),
                Arg::Ptr(ticket),
                fl,
                st,
            ],
        )
        .unwrap()
    };
    // The chain: glue_ops ops of 16 CTAs, the last one releasing the flag when last_flag.
    let glue_st = |last_flag: bool, st: bool| -> Vec<KernelCall> {
        (0..glue_ops)
            .map(|i| {
                let fl = if last_flag && i + 1 == glue_ops {
                    Arg::Ptr(flag)
                } else {
                    Arg::Null
                };
                let sa = if st && i < 32 {
                    Arg::Ptr(stamps.ptr().offset(16 * i as u64))
                } else {
                    Arg::Null
                };
                glue_call(16, chase, fl, sa)
            })
            .collect()
    };
    let glue = |last_flag: bool| glue_st(last_flag, false);
    let product_sp = |seg: usize, pre_vecs: usize, fl: bool, flow: u8, st: bool, pace: i32| {
        let mut d = LaunchDims::linear(info.sm_count, 256);
        d.shared_bytes = (pre_vecs * 16) as u32;
        let mut c = KernelCall::new(
            f_pre,
            d,
            &[
                Arg::Ptr(w.ptr().offset((seg * vpp * 16) as u64)),
                Arg::I64(vpp as i64),
                Arg::I32(pre_vecs as i32),
                if fl { Arg::Ptr(flag) } else { Arg::Null },
                Arg::Ptr(sink.ptr()),
                if st {
                    Arg::Ptr(stamps.ptr().offset(64 * 8))
                } else {
                    Arg::Null
                },
                Arg::I32(pace),
            ],
        )
        .unwrap();
        c.flow = flow;
        c
    };
    let product = |seg: usize, pre_vecs: usize, fl: bool, flow: u8| {
        product_sp(seg, pre_vecs, fl, flow, false, 0)
    };
    let join = |flow: u8| {
        let mut c = KernelCall::new(f_join, LaunchDims::linear(1, 32), &[Arg::Ptr(flag)]).unwrap();
        c.flow = flow;
        c
    };
    let time = |calls: &[KernelCall]| -> (f64, u64) {
        let mut g = StepGraphs::default();
        g.run(rt.as_ref(), calls, s, 0).expect("capture");
        gpu.synchronize().expect("first replay");
        let reps = 20;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                g.run(rt.as_ref(), calls, s, 0).unwrap();
            }
            gpu.synchronize().expect("replays");
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        let branched = g.stats.branched;
        g.clear(rt.as_ref());
        (best * 1e6, branched)
    };
    // µs a segment of a graph of `segs` segments.
    let seg_us = |calls: &[KernelCall]| {
        let (t, b) = time(calls);
        (t / segs as f64, b)
    };
    if std::env::var("OVERLAP_GLUE_ONLY").is_ok_and(|v| v == "1") {
        println!(
            "{}: us a glue op (32 ops a graph, PDL), dependent loads over {idx_mb} MB",
            info.name
        );
        for ctas in [1u32, 16, info.sm_count] {
            let row: Vec<String> = [0, 1, 2, 4, 8]
                .iter()
                .map(|&ch| {
                    let calls: Vec<KernelCall> = (0..32)
                        .map(|_| glue_call(ctas, ch, Arg::Null, Arg::Null))
                        .collect();
                    let (t, _) = time(&calls);
                    format!("{ch} loads {:6.2}", t / 32.0)
                })
                .collect();
            println!("{ctas:4} CTAs: {}", row.join(" | "));
        }
        return;
    }
    println!(
        "{} ({} SMs, {} KiB shared a block): product {:.1} MB, {glue_ops} glue ops of {chase} \
         dependent loads a thread over {idx_mb} MB",
        info.name,
        info.sm_count,
        info.max_shared_per_block / 1024,
        vpp as f64 * 16.0 / 1e6
    );
    let mut g_calls = Vec::new();
    let mut p_calls = Vec::new();
    for seg in 0..segs {
        g_calls.extend(glue(false));
        g_calls.push(join(FLOW_MAIN));
        p_calls.push(product(seg, 0, false, FLOW_MAIN));
    }
    let (t_glue, _) = seg_us(&g_calls);
    let (t_prod, _) = seg_us(&p_calls);
    println!(
        "glue {t_glue:8.2} us | product {t_prod:8.2} us ({:.2} TB/s), a segment",
        vpp as f64 * 16.0 / t_prod / 1e6
    );
    let max_kib = (info.max_shared_per_block / 1024).saturating_sub(2) as usize;
    let mut pres = vec![0usize, 32, 96, 160];
    pres.push(max_kib.min(224));
    pres.retain(|&p| p <= max_kib);
    pres.dedup();
    let mut base = 0.0;
    for kib in pres {
        let pre_vecs = kib * 1024 / 16;
        let staged = (pre_vecs * 16 * info.sm_count as usize).min(vpp * 16);
        let mut serial = Vec::new();
        let mut over = Vec::new();
        for seg in 0..segs {
            serial.extend(glue(false));
            serial.push(product(seg, pre_vecs, false, FLOW_MAIN));
            serial.push(join(FLOW_MAIN));
            over.push(product(seg, pre_vecs, true, FLOW_SIDE));
            over.extend(glue(true));
            over.push(join(FLOW_JOIN));
        }
        let (ts, _) = seg_us(&serial);
        if kib == 0 {
            base = ts;
        }
        let (to, branched) = seg_us(&over);
        println!(
            "pre {kib:3} KiB ({:5.1} MB staged): serial {ts:8.2} us ({:+6.2}) | overlap {to:8.2} us ({:+6.2}){}",
            staged as f64 / 1e6,
            ts - base,
            to - base,
            if branched == 0 {
                " (NOT branched: one chain)"
            } else {
                ""
            }
        );
    }
    // Paced staging (ns a round of 4 KiB a CTA): spread over the glue instead of one burst.
    let mut best = (f64::MAX, 0, 0);
    for (pace_kib, pace) in [
        (96usize, 125),
        (96, 250),
        (96, 500),
        (160, 125),
        (160, 250),
        (160, 500),
        (224, 125),
        (224, 250),
        (224, 500),
    ] {
        let pace_kib = pace_kib.min(max_kib);
        let pre_vecs = pace_kib * 1024 / 16;
        let mut over = Vec::new();
        for seg in 0..segs {
            over.push(product_sp(seg, pre_vecs, true, FLOW_SIDE, false, pace));
            over.extend(glue(true));
            over.push(join(FLOW_JOIN));
        }
        let (to, _) = seg_us(&over);
        if to < best.0 {
            best = (to, pace, pace_kib);
        }
        println!(
            "pre {pace_kib:3} KiB paced {pace:4} ns a round: overlap {to:8.2} us ({:+6.2})",
            to - base
        );
    }
    // Where the time goes: one graph's last segment stamped (ns from its first glue op's start).
    let n_sm = info.sm_count as usize;
    for (kib, fl, pace) in [
        (0usize, false, 0),
        (0, true, 0),
        (160, true, 0),
        (160, true, best.1),
    ] {
        let pre_vecs = (kib * 1024 / 16).min(info.max_shared_per_block as usize / 16 - 128);
        let mut calls = Vec::new();
        for seg in 0..segs {
            let last = seg + 1 == segs;
            if fl {
                calls.push(product_sp(seg, pre_vecs, true, FLOW_SIDE, last, pace));
                calls.extend(glue_st(true, last));
                calls.push(join(FLOW_JOIN));
            } else {
                calls.extend(glue_st(false, last));
                calls.push(product_sp(seg, pre_vecs, false, FLOW_MAIN, last, 0));
                calls.push(join(FLOW_MAIN));
            }
        }
        let _ = time(&calls);
        let mut st = vec![0u64; 64 + 4 * n_sm];
        // SAFETY: st holds exactly the stamps buffer's bytes; the device is idle after time().
        unsafe {
            rt.copy_d2h_async(st.as_mut_ptr() as *mut u8, stamps.ptr(), st.len() * 8, s)
                .unwrap();
        }
        gpu.synchronize().unwrap();
        let t0 = st[0] as i64;
        let rel = |v: u64| (v as i64 - t0) as f64 / 1e3;
        let ops: Vec<String> = (0..glue_ops.min(32))
            .map(|i| format!("{:.1}-{:.1}", rel(st[2 * i]), rel(st[2 * i + 1])))
            .collect();
        let col = |k: usize| {
            let mut v: Vec<f64> = (0..n_sm).map(|b| rel(st[64 + 4 * b + k])).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            format!("{:.1}/{:.1}/{:.1}", v[0], v[n_sm / 2], v[n_sm - 1])
        };
        println!(
            "stamps ({}, pre {kib} KiB, pace {pace}), us from the glue's start: glue ops {} | product CTAs \
             (min/median/max) start {} waited {} streamed {} end {}",
            if fl { "overlap" } else { "serial" },
            ops.join(" "),
            col(0),
            col(1),
            col(2),
            col(3)
        );
    }
    gpu.synchronize().expect("device errors");
}
