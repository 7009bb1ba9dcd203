//! `--precision`: how the prefill tensor-core products round their inputs. One switch over the
//! per-product forms (each keeps its own `DS4_GPU_*` variable, which wins when set):
//!
//! - `exact`: the products are exact in the weights and carry activations to ~16 bits or
//!   more (three bf16 terms in the dense cuBLASLt products, two f16 planes of X in the MoE's
//!   wgmma kernels, hi/lo queries and probabilities in prefill attention); the GPU matches the
//!   CPU reference to ~1e-4 of the logits on the tiny models (`gpu_forward.rs`).
//! - `fast`: one 16-bit product each, f32 accumulation: the dense products as one bf16 product
//!   (`DS4_GPU_BLAS=fast`: ~2^-9 per factor), the MoE's X as one f16 plane
//!   (`DS4_GPU_GEMM_PLANES=1`: ~2^-12; its gate/up then also folds the super-block scale into
//!   the f16 weights, `DS4_GPU_GW_WIDE=4`: two more roundings of ~2^-11 a weight), prefill attention as one f16 product
//!   (`DS4_GPU_ATTN_TC=fast`). That is how mainstream engines run these products, and finer
//!   than the official inference (FP8 activations in per-128 blocks) and the original engine's
//!   CPU (8-bit Q8_0 / Q8_K activation blocks; model.md §3.8, "Matmul activations"). H200, full-size q2: prefill +33-35% over
//!   `exact` at 2k-32k (bench/results/gpu-lead-s17-h200.txt run B). On the tiny random models
//!   the prompt's logits move by a median 4.5e-2 per position (max ~0.4, top-1 agreement ~90%
//!   per position; the engine test's 13-token prompt: 1.4% RMS, 1.5% with the folded gate/up); the bf16 term is most of it.
//!   `DS4_GPU_BLAS=f16` is a finer, slower dense form (one f16 product with a device-side
//!   scale: median 5.3e-3, top-1 99.4%; +12% instead of +18% over `exact`,
//!   gpu-blas-p17-h200.txt).
//!
//! Decode (n ≤ 4 tokens) runs the same arithmetic under both: a 2-4-token step (an MTP draft
//! pair being verified, a short append) takes the hi/lo attention too (attn.rs attend_tc; before
//! session 31 `fast` gave it one f16 product, and accepted drafts moved greedy tokens). The CPU
//! backend always computes in f32.

use super::GpuBackend;

/// Rounding of the prefill tensor-core products (`--precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Exact,
    Fast,
}

impl Precision {
    pub fn parse(s: &str) -> Option<Precision> {
        match s {
            "exact" => Some(Precision::Exact),
            "fast" => Some(Precision::Fast),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }
}

/// Whether the environment sets `var` (then that switch is left as the user set it).
fn env_set(var: &str) -> bool {
    std::env::var_os(var).is_some()
}

impl GpuBackend {
    /// Set every prefill product's form for `p` (process-wide, like the switches it sets),
    /// except those whose own `DS4_GPU_*` variable is set.
    pub fn set_precision(p: Precision) {
        let fast = p == Precision::Fast;
        if !env_set("DS4_GPU_BLAS") {
            GpuBackend::set_blas(true, fast);
        }
        if !env_set("DS4_GPU_GEMM_PLANES") {
            GpuBackend::set_gemm_planes(if fast { 1 } else { 2 });
        }
        if !env_set("DS4_GPU_ATTN_TC") {
            GpuBackend::set_attn_tc(true, fast);
        }
    }
}
