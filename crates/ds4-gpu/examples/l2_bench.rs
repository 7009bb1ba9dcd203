//! `l2_bench [trials]`: does an L2 prefetch of a decode weight (elementwise.cu `l2_prefetch`,
//! `Backend::prefetch`) shorten the one-row Q8_0 product that reads it next?
//!
//! Part A (eager, device events): per trial, [prefetch of W on the stream or on a second
//! stream] [k tiny kernels: the latency-bound work between] [event] [the product y = W x]
//! [event], W one of several copies whose bytes together reach ≥ 256 MB (so W is cold unless
//! prefetched). A slow load kernel first keeps the device busy while the host queues the trials
//! (no host gaps inside the timed spans). Prints the product's median µs cold and after each
//! prefetch form, the prefetch kernel's own time and the wait's.
//!
//! Part B (graph-recorded steps, as the decode runs): per rep [Backend::prefetch(W)] [k adds]
//! [product], all reps of a config in one recorded step; µs per rep for cold / prefetched, and
//! the same without the product (so the product's share is the difference).

mod common;

use ds4_backend::{Backend, GgmlType, Part, WeightSrc};
use ds4_gguf::{GgufFile, GgufWriter};
use ds4_gpu::model::PREFETCH_OFF;
use ds4_gpu::runtime::{Arg, DevPtr, Event, LaunchDims, Stream};
use ds4_gpu::GpuBackend;
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use std::sync::Arc;
use std::time::Instant;

type W = <GpuBackend as Backend>::Weight;

/// A GGUF in memory with one Q8_0 tensor `w` of `rows × cols` (bytes: a repeating pattern).
fn weight_file(cols: usize, rows: usize) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    w.add_tensor("w", GgmlType::Q8_0, &[cols as u64, rows as u64])
        .unwrap();
    let bytes = w
        .to_bytes(|_, out: &mut [u8]| -> Result<(), ds4_gguf::GgufError> {
            for (i, b) in out.iter_mut().enumerate() {
                // small scales (f16 0x1xxx) and any quants: finite products
                *b = if i % 34 == 1 {
                    0x10
                } else {
                    (i * 7 % 251) as u8
                };
            }
            Ok(())
        })
        .unwrap();
    Arc::new(GgufFile::from_bytes("bench.gguf", bytes).unwrap())
}

fn bind(gpu: &GpuBackend, f: &Arc<GgufFile>) -> W {
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

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// (name, mode, CTAs, piece bytes, on a second stream)
const FORMS: [(&str, i32, u32, i32, bool); 8] = [
    ("cold", -1, 0, 0, false),
    ("bulk 16x16K", 0, 16, 16384, false),
    ("bulk 132x16K", 0, 132, 16384, false),
    ("bulk 4x64K", 0, 4, 65536, false),
    ("line L2 132", 1, 132, 0, false),
    ("line evict_last 132", 2, 132, 0, false),
    ("loads 132", 3, 132, 0, false),
    ("bulk 16x16K side", 0, 16, 16384, true),
];

fn main() {
    let trials: usize = common::arg(1, 24);
    let g = common::open_gpu();
    let gpu = GpuBackend::new(g, &rope_tables(&HParams::tiny())).expect("backend");
    let info = gpu.gpu().info().clone();
    println!(
        "# {} ({}), {} SMs, L2 {:.1} MB; Q8_0 1024 columns, n = 1; {trials} trials a point",
        info.name,
        info.arch,
        info.sm_count,
        info.l2_bytes as f64 / 1e6
    );
    let rt = gpu.gpu().runtime().clone();
    let s = Stream::DEFAULT;
    let pf = gpu
        .gpu()
        .kernel(&ds4_kernels::ELEMENTWISE, "l2_prefetch")
        .unwrap();
    let fill = gpu
        .gpu()
        .kernel(&ds4_kernels::ELEMENTWISE, "fill_u32")
        .unwrap();
    let tiny = gpu.gpu().alloc(4096).unwrap();
    let big = gpu.gpu().alloc(48 << 20).unwrap();
    let side = rt.stream_create().unwrap();
    let ev: Vec<Event> = (0..trials * 4 + 2)
        .map(|_| rt.event_create().unwrap())
        .collect();
    let launch_pf = |st: Stream, p: DevPtr, n: usize, mode: i32, ctas: u32, piece: i32| {
        let z = DevPtr(0);
        let args = [
            Arg::Ptr(p),
            Arg::I64(n as i64),
            Arg::Ptr(z),
            Arg::I64(0),
            Arg::Ptr(z),
            Arg::I64(0),
            Arg::Ptr(z),
            Arg::I64(0),
            Arg::I32(mode),
            Arg::I32(piece),
            Arg::Ptr(z),
        ];
        rt.launch(pf, LaunchDims::linear(ctas, 256), st, &args)
            .unwrap();
    };
    let waits = [0usize, 4, 12, 30];
    let cols = 1024;
    let x = gpu.upload(&vec![0.01f32; cols]);
    let mut rep_rows = Vec::new();
    for rows in [9216usize, 18432, 32768, 41472] {
        let f = weight_file(cols, rows);
        let bytes = rows * 1088;
        let m = (256e6 / bytes as f64).ceil() as usize + 1;
        let ws: Vec<W> = (0..m).map(|_| bind(&gpu, &f)).collect();
        let mut y = gpu.alloc(rows);
        let mut i = 0usize;
        println!(
            "-- A: {:.1} MB ({rows} rows), {m} copies: product us (median) by wait (tiny kernels: 0 / 4 / 12 / 30) | prefetch kernel us | wait us",
            bytes as f64 / 1e6
        );
        for (name, mode, ctas, piece, on_side) in FORMS {
            let mut line = format!("{name:22}");
            let mut pf_us = Vec::new();
            let mut wait_us = Vec::new();
            for &k in &waits {
                gpu.finish().unwrap();
                let t = Instant::now();
                rt.event_record(ev[0], s).unwrap();
                launch_pf(s, big.ptr(), 48 << 20, 3, 2, 0); // delay head (loads, 2 CTAs)
                rt.event_record(ev[1], s).unwrap();
                let mut dt = Vec::new();
                let mut pt = Vec::new();
                let mut wt = Vec::new();
                for tr in 0..trials {
                    let w = &ws[i % m];
                    i += 1;
                    let (p, n) = w.decode_range();
                    let e = &ev[2 + tr * 4..6 + tr * 4];
                    rt.event_record(e[0], s).unwrap();
                    if mode >= 0 {
                        if on_side {
                            rt.stream_wait_event(side, e[0]).unwrap();
                            launch_pf(side, p, n, mode, ctas, piece);
                        } else {
                            launch_pf(s, p, n, mode, ctas, piece);
                        }
                    }
                    rt.event_record(e[1], s).unwrap();
                    for j in 0..k {
                        rt.launch(
                            fill,
                            LaunchDims::linear(1, 64),
                            s,
                            &[
                                Arg::Ptr(tiny.ptr().offset((j % 8) as u64 * 256)),
                                Arg::U32(j as u32),
                                Arg::I64(64),
                            ],
                        )
                        .unwrap();
                    }
                    rt.event_record(e[2], s).unwrap();
                    gpu.matmul(w, Part::All, &x, 1, &mut y);
                    rt.event_record(e[3], s).unwrap();
                }
                let host = t.elapsed().as_secs_f64() * 1e6;
                gpu.finish().unwrap();
                rt.synchronize().unwrap();
                let head = rt.event_elapsed_ms(ev[0], ev[1]).unwrap() * 1e3;
                if head < host as f32 {
                    line += &format!(" [head {head:.0} < host {host:.0} us]");
                }
                for tr in 0..trials {
                    let e = &ev[2 + tr * 4..6 + tr * 4];
                    pt.push(rt.event_elapsed_ms(e[0], e[1]).unwrap() * 1e3);
                    wt.push(rt.event_elapsed_ms(e[1], e[2]).unwrap() * 1e3);
                    dt.push(rt.event_elapsed_ms(e[2], e[3]).unwrap() * 1e3);
                }
                line += &format!(" {:7.2}", median(dt));
                pf_us.push(median(pt));
                wait_us.push(median(wt));
            }
            line += " |";
            for v in pf_us {
                line += &format!(" {v:6.2}");
            }
            line += " |";
            for v in wait_us {
                line += &format!(" {v:6.2}");
            }
            println!("{line}");
        }
        rep_rows.push((rows, ws, y));
    }
    // Part B: recorded steps through the backend hint.
    let mut small = gpu.upload(&vec![1.0f32; 256]);
    let one = gpu.upload(&vec![0.0f32; 256]);
    let reps = 12;
    for (rows, ws, y) in rep_rows.iter_mut() {
        let m = ws.len();
        println!(
            "-- B: {:.1} MB, recorded steps of {reps} reps [prefetch] [k adds] [product]: us per rep (k = 0 / 4 / 8 / 16)",
            *rows as f64 * 1088.0 / 1e6
        );
        for (name, mode, ctas) in [
            ("cold", PREFETCH_OFF, 0u32),
            ("bulk 16", 0, 16),
            ("bulk 132", 0, 132),
            ("line 132", 1, 132),
            ("last 132", 2, 132),
        ] {
            GpuBackend::set_prefetch_l2(mode, ctas);
            let mut line = format!("{name:10}");
            for with_product in [true, false] {
                line += if with_product {
                    " with product:"
                } else {
                    " | without:"
                };
                for k in [0usize, 4, 8, 16] {
                    let mut i = 0usize;
                    let mut best = f64::MAX;
                    for round in 0..4 {
                        gpu.download(&one, 1);
                        gpu.graph_begin(1);
                        for _ in 0..reps {
                            let w = &ws[i % m];
                            i += 1;
                            gpu.prefetch(&[w]);
                            for _ in 0..k {
                                gpu.add(&mut small, &one, 256);
                            }
                            if with_product {
                                gpu.matmul(w, Part::All, &x, 1, y);
                            }
                        }
                        let t = Instant::now();
                        gpu.graph_end();
                        gpu.download(&one, 1);
                        if round > 0 {
                            best = best.min(t.elapsed().as_secs_f64());
                        }
                    }
                    line += &format!(" {:7.2}", best * 1e6 / reps as f64);
                }
            }
            println!("{line}");
        }
    }
    gpu.check().unwrap();
    println!("graph stats: {:?}", gpu.graph_stats());
}
