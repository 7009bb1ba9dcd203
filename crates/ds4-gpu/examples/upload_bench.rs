//! `upload_bench [GiB]`: host → device upload rate through `Gpu::upload` (pinned double
//! buffering, parallel staging copies), as model loading uses it: GiB of host memory (default 8,
//! touched first, like a file in the page cache) uploaded in 512 MiB tensors.

mod common;

use std::time::Instant;

fn main() {
    let gib: usize = common::arg(1, 8);
    let gpu = common::open_gpu();
    let total = gib << 30;
    let host: Vec<u8> = (0..total).map(|i| (i * 7 + (i >> 12)) as u8).collect();
    let piece = 512 << 20;
    let bufs: Vec<_> = (0..total / piece)
        .map(|_| gpu.alloc(piece).expect("device memory"))
        .collect();
    for round in 0..2 {
        let t = Instant::now();
        for (b, src) in bufs.iter().zip(host.chunks(piece)) {
            gpu.upload(b.ptr(), src).expect("upload");
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "round {round}: {gib} GiB in {s:.2} s = {:.1} GB/s ({} threads)",
            total as f64 / s / 1e9,
            rayon::current_num_threads()
        );
    }
}
