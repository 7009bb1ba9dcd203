//! Token sampling on the device ([`Backend::sample`], kernels `gpu/sample.cu`): only the chosen
//! id (4 bytes) is read back, which also ends a recorded decode step (the kernels run inside its
//! graph). `DS4_GPU_SAMPLE=off`: download the logits and pick on the host (A/B switch).

use super::{GpuBackend, GpuBuf};
use crate::runtime::{Arg, LaunchDims};
use ds4_backend::sample::{select, SampleParams};
use ds4_backend::Backend;

/// CTAs of the greedy argmax (256 threads each; 129,280 logits: ~4 per thread).
const ARGMAX_CTAS: u32 = 128;

fn gpu_sample_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DS4_GPU_SAMPLE").map_or(true, |v| v != "off"))
}

impl GpuBackend {
    pub(crate) fn op_sample(&self, logits: &GpuBuf, vocab: usize, p: &SampleParams, u: f64) -> u32 {
        if vocab == 0 || !gpu_sample_on() || vocab >= 1 << 24 || self.failed() {
            return select(&self.download(logits, vocab), p, u);
        }
        let out = self.scratch(1);
        let n = Arg::I32(vocab as i32);
        if p.greedy() {
            // [part_v: CTAS f32][part_i: CTAS u32][ticket]
            let g = ARGMAX_CTAS.min(vocab.div_ceil(256) as u32).max(1);
            let part = self.scratch(2 * g as usize + 1);
            let ticket = part.ptr.offset(8 * g as u64);
            self.fill(ticket, 0, 1);
            self.run(
                &ds4_kernels::SAMPLE,
                "sample_argmax",
                LaunchDims::linear(g, 256),
                &[
                    Arg::Ptr(logits.ptr),
                    n,
                    Arg::Ptr(part.ptr),
                    Arg::Ptr(part.ptr.offset(4 * g as u64)),
                    Arg::Ptr(ticket),
                    Arg::Ptr(out.ptr),
                ],
            );
        } else {
            let probs = self.scratch(2 * vocab); // f64 per logit
            self.run(
                &ds4_kernels::SAMPLE,
                "sample_pick",
                LaunchDims::linear(1, 1024),
                &[
                    Arg::Ptr(logits.ptr),
                    n,
                    Arg::Ptr(probs.ptr),
                    Arg::F32(p.temperature),
                    Arg::I32(p.top_k.min(i32::MAX as usize) as i32),
                    Arg::F32(p.top_p),
                    Arg::F32(p.min_p),
                    Arg::I64(u.to_bits() as i64),
                    Arg::Ptr(out.ptr),
                ],
            );
        }
        let id = self.download_bytes(out.ptr, 4);
        u32::from_le_bytes([id[0], id[1], id[2], id[3]])
    }
}
