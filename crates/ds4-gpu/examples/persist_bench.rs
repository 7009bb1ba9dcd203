//! `persist_bench [MB per phase] [phases]`: what a persistent decode kernel would buy at the op
//! boundaries. A "phase" streams MB of weights (elementwise.cu `probe_phases`: 16-byte loads, one
//! CTA an SM) and stands for one decode product; phases follow each other as ops do. Two forms:
//! - separate: one launch a phase, recorded and replayed as a CUDA graph with programmatic
//!   dependent launch (how the engine runs a decode step), `pre` vectors a thread loaded before
//!   the PDL wait;
//! - persistent: one launch for all phases, a grid barrier between phases, `pre` vectors a thread
//!   of the next phase loaded before each barrier.
//!
//! MB 0 measures the boundary alone (empty phases). Prints µs a phase and the streaming rate, best
//! of 5 rounds of 4 replays each (host wall clock to completion; phases of distinct weights, so
//! nothing is re-read from L2 unless the whole set fits).

mod common;

use ds4_gpu::gpu::StepGraphs;
use ds4_gpu::runtime::{Arg, KernelCall, LaunchDims, Stream};
use std::time::Instant;

fn main() {
    let mb: f64 = common::arg(1, 36.0);
    let phases: usize = common::arg(2, 64);
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    let info = gpu.info().clone();
    let f = gpu
        .kernel(&ds4_kernels::ELEMENTWISE, "probe_phases")
        .expect("kernel");
    let fill = gpu
        .kernel(&ds4_kernels::ELEMENTWISE, "fill_u32")
        .expect("kernel");
    // Vectors (16 bytes) a phase, a multiple of 4 so that phases stay 64-byte aligned.
    let vpp = ((mb * 1e6 / 16.0) as usize) / 4 * 4;
    let bytes = (vpp * 16 * phases).max(16);
    let w = gpu.alloc(bytes).expect("weights");
    let bar = gpu.alloc(64).expect("barrier words");
    let grid = info.sm_count;
    let sink = gpu.alloc(grid as usize * 4).expect("sink");
    let s = Stream::DEFAULT;
    let fill_call = |p: ds4_gpu::runtime::DevPtr, v: u32, words: usize| {
        KernelCall::new(
            fill,
            LaunchDims::linear(words.div_ceil(256).clamp(1, 65535) as u32, 256),
            &[Arg::Ptr(p), Arg::U32(v), Arg::I64(words as i64)],
        )
        .unwrap()
    };
    rt.launch_call(&fill_call(w.ptr(), 0x5a5a_0101, bytes / 4), s)
        .unwrap();
    rt.launch_call(&fill_call(bar.ptr(), 0, 16), s).unwrap();
    gpu.synchronize().unwrap();
    let call = |p0: usize, n: usize, pre: usize| {
        KernelCall::new(
            f,
            LaunchDims::linear(grid, 256),
            &[
                Arg::Ptr(w.ptr()),
                Arg::I64(vpp as i64),
                Arg::I32(p0 as i32),
                Arg::I32(n as i32),
                Arg::I32(pre as i32),
                Arg::Ptr(bar.ptr()),
                Arg::Ptr(sink.ptr()),
            ],
        )
        .unwrap()
    };
    println!(
        "{} ({} SMs): {phases} phases of {:.1} MB ({vpp} vectors), one CTA an SM",
        info.name,
        grid,
        vpp as f64 * 16.0 / 1e6
    );
    let reps = 4;
    for pre in [0usize, 4, 8] {
        // separate launches, one graph
        let mut g = StepGraphs::default();
        let calls: Vec<KernelCall> = (0..phases).map(|p| call(p, 1, pre)).collect();
        g.run(rt.as_ref(), &calls, s, 0).expect("capture");
        gpu.synchronize().unwrap();
        let mut sep = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                g.run(rt.as_ref(), &calls, s, 0).unwrap();
            }
            gpu.synchronize().unwrap();
            sep = sep.min(t.elapsed().as_secs_f64() / (reps * phases) as f64);
        }
        g.clear(rt.as_ref());
        // persistent
        let one = call(0, phases, pre);
        let mut per = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                rt.launch_call(&one, s).unwrap();
            }
            gpu.synchronize().unwrap();
            per = per.min(t.elapsed().as_secs_f64() / (reps * phases) as f64);
        }
        let rate = |sec: f64| vpp as f64 * 16.0 / sec / 1e12;
        println!(
            "pre {pre}: separate (graph + PDL) {:7.2} us a phase {:5.2} TB/s | persistent (grid barrier) {:7.2} us a phase {:5.2} TB/s",
            sep * 1e6,
            rate(sep),
            per * 1e6,
            rate(per)
        );
    }
    gpu.synchronize().expect("device errors");
}
