//! `--precision`: how the prefill tensor-core products round their inputs. One switch over the
//! per-product forms (each keeps its own `DS4_GPU_*` variable, which wins when set):
//!
//! - `exact`: the products are exact in the weights and carry activations to ~16 bits or
//!   more (three bf16 terms in the dense cuBLASLt products, two f16 planes of X in the MoE's
//!   wgmma kernels, hi/lo queries and probabilities in prefill attention); the GPU matches the
//!   CPU reference to ~1e-5 of the logits.
//! - `fast`: one f16 product each (~2^-12 relative per factor, f32 accumulation), as mainstream
//!   engines run these products; still finer than the original engine's 8-bit activations in
//!   the MoE.
//!
//! Decode (n ≤ 4 tokens) is the same under both. The CPU backend always computes in f32.

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
        if !env_set("DS4_GPU_ATTN_TC") {
            GpuBackend::set_attn_tc(true, fast);
        }
    }
}
