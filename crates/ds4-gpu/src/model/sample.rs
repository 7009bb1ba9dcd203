//! Token sampling on the device ([`Backend::sample`], kernels `gpu/sample.cu`): only the chosen
//! id (4 bytes) is read back, which also ends a recorded decode step (the kernels run inside its
//! graph). Greedy: one multi-CTA argmax. Temperature: four kernels (max; per-bin counts and
//! masses; ids grouped by bin; one CTA that orders only the bins a boundary falls in).
//! `DS4_GPU_SAMPLE=off`: download the logits and pick on the host; `=onecta`: the single-CTA
//! radix-select kernel for temperature (A/B switches).

use super::{GpuBackend, GpuBuf};
use crate::runtime::{Arg, LaunchDims};
use ds4_backend::sample::{select_rows, SampleParams};
use ds4_backend::Backend;

/// CTAs of the greedy argmax and of the max / histogram passes (256 threads each; 129,280
/// logits: ~4 per thread).
const ARGMAX_CTAS: u32 = 128;
/// Workspace words before the ids (`SQ_IDS` in gpu/sample.cu).
const WS_HEAD: usize = 15364;
/// Leading workspace words zeroed before each pick (`SQ_ZERO`).
const WS_ZERO: usize = 6148;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Off,
    OneCta,
    Multi,
}

fn mode() -> Mode {
    static M: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();
    *M.get_or_init(|| match std::env::var("DS4_GPU_SAMPLE").as_deref() {
        Ok("off") => Mode::Off,
        Ok("onecta") => Mode::OneCta,
        _ => Mode::Multi,
    })
}

impl GpuBackend {
    pub(crate) fn op_sample(&self, logits: &GpuBuf, vocab: usize, p: &SampleParams, u: f64) -> u32 {
        self.op_sample_rows(logits, vocab, p, &[u])[0]
    }

    /// Row r of `logits` `[draws.len(), vocab]` picked with draw `draws[r]`: the kernels of
    /// every row queued, then one read of the ids (a speculative step's rows, one round trip).
    pub(crate) fn op_sample_rows(
        &self,
        logits: &GpuBuf,
        vocab: usize,
        p: &SampleParams,
        draws: &[f64],
    ) -> Vec<u32> {
        let rows = draws.len();
        let mode = mode();
        if rows == 0 {
            return Vec::new();
        }
        if vocab == 0 || mode == Mode::Off || vocab >= 1 << 24 || self.failed() {
            let all = self.download(logits, rows * vocab);
            return select_rows(&all, vocab, p, draws);
        }
        let out = self.scratch(rows);
        // Workspaces live until the read below (each row its own: the rows' kernels may share
        // nothing but the stream's order).
        let mut keep = Vec::new();
        for (r, &u) in draws.iter().enumerate() {
            let row = logits.view(r * vocab, vocab);
            keep.push(self.queue_pick(&row, vocab, p, u, out.ptr.offset(4 * r as u64), mode));
        }
        let ids = self.download_bytes(out.ptr, 4 * rows);
        drop(keep);
        ids.chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Queue one row's pick into the u32 at `out`; returns the workspaces it uses.
    fn queue_pick(
        &self,
        logits: &GpuBuf,
        vocab: usize,
        p: &SampleParams,
        u: f64,
        out: crate::runtime::DevPtr,
        mode: Mode,
    ) -> Vec<GpuBuf> {
        let n = Arg::I32(vocab as i32);
        let g = ARGMAX_CTAS.min(vocab.div_ceil(256) as u32).max(1);
        if p.greedy() {
            // [part_v: CTAS f32][part_i: CTAS u32][ticket]
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
                    Arg::Ptr(out),
                ],
            );
            return vec![part];
        }
        let probs = self.scratch(2 * vocab); // f64 per logit (the single-CTA form)
        let top_k = Arg::I32(p.top_k.min(i32::MAX as usize) as i32);
        let u_bits = Arg::I64(u.to_bits() as i64);
        if mode == Mode::OneCta {
            self.run(
                &ds4_kernels::SAMPLE,
                "sample_pick",
                LaunchDims::linear(1, 1024),
                &[
                    Arg::Ptr(logits.ptr),
                    n,
                    Arg::Ptr(probs.ptr),
                    Arg::F32(p.temperature),
                    top_k,
                    Arg::F32(p.top_p),
                    Arg::F32(p.min_p),
                    u_bits,
                    Arg::Ptr(out),
                ],
            );
            return vec![probs];
        }
        // Fixed-point weights w · 2^qshift: n of them sum below 2^63.
        let qshift = 63 - ceil_log2(vocab) as i32;
        let ws = self.scratch(WS_HEAD + vocab);
        self.zero(ws.ptr, WS_ZERO);
        let (x, w) = (Arg::Ptr(logits.ptr), Arg::Ptr(ws.ptr));
        let m = &ds4_kernels::SAMPLE;
        let t = Arg::F32(p.temperature);
        self.run(m, "sample_top", LaunchDims::linear(g, 256), &[x, n, w]);
        self.run(
            m,
            "sample_hist",
            LaunchDims::linear(g, 256),
            &[x, n, t, Arg::F32(p.min_p), Arg::I32(qshift), w],
        );
        let gs = vocab.div_ceil(256).min(65535) as u32;
        self.run(
            m,
            "sample_scatter",
            LaunchDims::linear(gs, 256),
            &[x, n, t, w],
        );
        self.run(
            m,
            "sample_finish",
            LaunchDims::linear(1, 1024),
            &[
                x,
                n,
                Arg::Ptr(probs.ptr),
                t,
                top_k,
                Arg::F32(p.top_p),
                Arg::F32(p.min_p),
                u_bits,
                Arg::I32(qshift),
                w,
                Arg::Ptr(out),
            ],
        );
        vec![probs, ws]
    }
}

/// Smallest b with n ≤ 2^b.
fn ceil_log2(n: usize) -> u32 {
    n.next_power_of_two().trailing_zeros()
}

#[cfg(test)]
mod tests {
    #[test]
    fn workspace_layout_matches_the_kernels() {
        let src = ds4_kernels::SAMPLE.source;
        assert!(src.contains("#define SQ_NB 2048\n"));
        assert!(src.contains("#define SQ_ZERO (SQ_MASS + 2 * SQ_NB)     // 6148"));
        assert!(
            src.contains("#define SQ_IDS (SQ_PART + 1024)           // n u32: ids by bin (15364)")
        );
        assert_eq!(super::WS_ZERO, 4 + 3 * 2048);
        assert_eq!(super::WS_HEAD, super::WS_ZERO + 4 * 2048 + 1024);
        assert_eq!(super::ceil_log2(129_280), 17);
        assert_eq!(super::ceil_log2(1), 0);
        assert_eq!(super::ceil_log2(1024), 10);
        assert_eq!(super::ceil_log2(1025), 11);
    }
}
