//! [`Backend::prefetch`](ds4_backend::Backend::prefetch) on the GPU: decode steps (n ≤ 4 token
//! rows) move the weights the schedule names into L2 while the latency-bound glue kernels before
//! them run (HC, norms, RoPE, compressor, attention: ~60 us a layer in which the memory is
//! otherwise idle), so the products that follow read them from L2. One `l2_prefetch` launch
//! (elementwise.cu) per hint, launched with PDL so it starts beside the kernel before it; only
//! where PDL runs (CUDA sm_90+). Prefill products are compute-bound: no prefetch.
//!
//! Budget: at most `DS4_GPU_L2PF_MB` (default 3/4 of L2) per hint, the weights taken in the
//! order given (the last one cut short), so what is fetched still fits beside the step's
//! activations. `DS4_GPU_L2PF=off` (or [`GpuBackend::set_l2_prefetch`]) turns it off;
//! `DS4_GPU_L2PF=last` fetches with the evict_last policy.

use super::{GpuBackend, GpuWeight};
use crate::runtime::{Arg, DevPtr, LaunchDims};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Bytes a thread prefetches by default (`DS4_GPU_L2PF_CHUNK` in KiB); a multiple of 16.
const CHUNK: usize = 2 << 10;
/// Most token rows a hint is taken for (the decode graph's steps).
const MAX_N: usize = 4;

/// Bytes named by the prefetch launches so far (process-wide, for tests; a replayed graph
/// counts once, when recorded).
static BYTES: AtomicU64 = AtomicU64::new(0);

/// 0 unread, 1 off, else 2 + the kernel's policy (0 bulk, 1 bulk evict_last, 2 lines, 3 lines
/// evict_last).
static MODE: AtomicU8 = AtomicU8::new(0);

fn mode() -> u8 {
    let m = MODE.load(Ordering::Relaxed);
    if m != 0 {
        return m;
    }
    let m = match std::env::var("DS4_GPU_L2PF").as_deref() {
        Ok("off") | Ok("0") => 1,
        Ok("last") => 3,
        Ok("line") => 4,
        Ok("linelast") => 5,
        _ => 2,
    };
    MODE.store(m, Ordering::Relaxed);
    m
}

fn chunk() -> usize {
    static C: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *C.get_or_init(|| {
        std::env::var("DS4_GPU_L2PF_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(CHUNK, |kb| (kb << 10).max(128))
    })
}

fn budget_env() -> Option<usize> {
    std::env::var("DS4_GPU_L2PF_MB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map(|mb| mb << 20)
}

impl GpuBackend {
    /// L2 prefetch hints on or off (process-wide; default on, `DS4_GPU_L2PF`).
    pub fn set_l2_prefetch(on: bool) {
        MODE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Bytes the L2 prefetch launches have named so far in this process (see [`BYTES`]).
    pub fn l2_prefetch_bytes() -> u64 {
        BYTES.load(Ordering::Relaxed)
    }

    /// The byte range a decode product of `w` reads: the decode copy of a Q8_0 matrix where
    /// there is one, else the matrix; None for vectors, tables and expert slabs (the routed
    /// experts are not known before the router runs).
    fn decode_range(w: &GpuWeight) -> Option<(DevPtr, usize)> {
        match w {
            GpuWeight::Mat {
                buf, experts, dec, ..
            } if *experts <= 1 => {
                let b = dec.as_ref().unwrap_or(buf);
                Some((b.ptr(), b.bytes()))
            }
            _ => None,
        }
    }

    pub(crate) fn op_prefetch(&self, ws: &[&GpuWeight], n: usize) {
        let m = mode();
        if n > MAX_N || m == 1 || !self.gpu.pdl_on() {
            return;
        }
        let mut left = budget_env().unwrap_or(self.gpu.info().l2_bytes as usize * 3 / 4);
        let mut ranges: Vec<(DevPtr, usize)> = Vec::with_capacity(4);
        for w in ws {
            let Some((p, len)) = Self::decode_range(w) else {
                continue;
            };
            // 16-byte aligned start (allocations are), length rounded down to 16.
            let len = len.min(left) & !15;
            if len == 0 || p.0 % 16 != 0 {
                continue;
            }
            left -= len;
            ranges.push((p, len));
            if ranges.len() == 4 || left < 16 {
                self.launch_prefetch(&ranges, m - 2);
                ranges.clear();
            }
            if left < 16 {
                break;
            }
        }
        if !ranges.is_empty() {
            self.launch_prefetch(&ranges, m - 2);
        }
    }

    fn launch_prefetch(&self, ranges: &[(DevPtr, usize)], policy: u8) {
        let _p = self.prof(|| "prefetch".to_string());
        let mut args = Vec::with_capacity(10);
        let mut chunks = 0;
        for i in 0..4 {
            let (p, len) = ranges.get(i).copied().unwrap_or((DevPtr(0), 0));
            chunks += len.div_ceil(chunk());
            BYTES.fetch_add(len as u64, Ordering::Relaxed);
            args.extend([Arg::Ptr(p), Arg::I64(len as i64)]);
        }
        args.extend([Arg::I32(chunk() as i32), Arg::I32(policy as i32)]);
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "l2_prefetch",
            LaunchDims::linear(chunks.div_ceil(128) as u32, 128),
            &args,
        );
    }
}
