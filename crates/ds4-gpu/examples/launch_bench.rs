//! `launch_bench [launches]`: host cost of a kernel launch, the decode step's floor. A chain of
//! N tiny launches (`fill_u32` of 64 words, so the device side is ~nothing), timed as
//! (1) launches one by one, (2) one graph replay of the same chain ([`StepGraphs`], capture
//! excluded), (3) a replay after updating every 8th node (what a decode step patches).
//! Prints µs per launch for each.

mod common;

use ds4_gpu::gpu::StepGraphs;
use ds4_gpu::runtime::{Arg, KernelCall, LaunchDims, Stream};
use std::time::Instant;

fn main() {
    let n: usize = common::arg(1, 2000);
    let gpu = common::open_gpu();
    let rt = gpu.runtime().clone();
    let f = gpu
        .kernel(&ds4_kernels::ELEMENTWISE, "fill_u32")
        .expect("kernel");
    let buf = gpu.alloc(64 * 4 * 16).expect("device memory");
    let call = |i: usize, v: u32| {
        KernelCall::new(
            f,
            LaunchDims::linear(1, 64),
            &[
                Arg::Ptr(buf.ptr().offset(((i % 16) * 256) as u64)),
                Arg::U32(v),
                Arg::I64(64),
            ],
        )
        .unwrap()
    };
    let s = Stream::DEFAULT;
    let rounds = 5;
    // (1) one by one
    let mut best = f64::MAX;
    for r in 0..rounds {
        gpu.synchronize().unwrap();
        let t = Instant::now();
        for i in 0..n {
            rt.launch_call(&call(i, r as u32), s).unwrap();
        }
        let host = t.elapsed().as_secs_f64();
        gpu.synchronize().unwrap();
        best = best.min(host);
    }
    println!(
        "launches one by one: {:.2} us host per launch ({n} launches)",
        best * 1e6 / n as f64
    );
    // (2) graph replay, no updates
    let mut g = StepGraphs::default();
    let calls: Vec<KernelCall> = (0..n).map(|i| call(i, 7)).collect();
    g.run(rt.as_ref(), &calls, s, 0).expect("capture");
    gpu.synchronize().unwrap();
    let mut best = (f64::MAX, f64::MAX);
    for _ in 0..rounds {
        let t = Instant::now();
        g.run(rt.as_ref(), &calls, s, 0).unwrap();
        let host = t.elapsed().as_secs_f64();
        gpu.synchronize().unwrap();
        let all = t.elapsed().as_secs_f64();
        best = (best.0.min(host), best.1.min(all));
    }
    println!(
        "graph replay: {:.3} us host per node, {:.2} us per node to completion",
        best.0 * 1e6 / n as f64,
        best.1 * 1e6 / n as f64
    );
    // (3) every 8th node updated each replay
    let mut best = (f64::MAX, f64::MAX);
    for r in 0..rounds {
        let calls: Vec<KernelCall> = (0..n)
            .map(|i| call(i, if i % 8 == 0 { 100 + r as u32 } else { 7 }))
            .collect();
        let t = Instant::now();
        g.run(rt.as_ref(), &calls, s, 0).unwrap();
        let host = t.elapsed().as_secs_f64();
        gpu.synchronize().unwrap();
        let all = t.elapsed().as_secs_f64();
        best = (best.0.min(host), best.1.min(all));
    }
    println!(
        "graph replay with {} updates: {:.3} us host per node ({:.2} us per update), {:.2} us per node to completion",
        n / 8,
        best.0 * 1e6 / n as f64,
        best.0 * 1e6 / (n / 8) as f64,
        best.1 * 1e6 / n as f64
    );
    println!("stats: {:?}", g.stats);
    g.clear(rt.as_ref());
}
