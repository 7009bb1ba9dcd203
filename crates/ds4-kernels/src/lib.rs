//! GPU kernel sources, embedded as text: one CUDA C++ source for NVIDIA (NVRTC) and AMD
//! (hipRTC). The files under `gpu/` include no toolkit header; `gpu/prelude.cuh` is the only
//! place where the two spellings differ. The host compiles a [`Module`] by passing its
//! [`Module::source`] with [`HEADERS`] as in-memory include files, plus the defines the prelude
//! documents (`DS4_CUDA`/`DS4_HIP`, `DS4_WARP`, `DS4_ARCH`, `DS4_GFX`).

/// One compilation unit and the kernels (`extern "C"` names) it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Module {
    /// Short name, also the file name under `gpu/` without `.cu`.
    pub name: &'static str,
    /// The `.cu` text.
    pub source: &'static str,
    /// Every `extern "C"` kernel the module defines on every target.
    pub kernels: &'static [&'static str],
    /// Kernels defined only where the module's `mma.sync` path is compiled (CUDA, `DS4_ARCH`
    /// >= 800, see [`has_mma`]); the host takes a portable kernel elsewhere.
    pub mma_only: &'static [&'static str],
}

impl Module {
    /// The kernels a code object of this module defines, given whether its target has mma.
    pub fn kernels_for(&self, mma: bool) -> impl Iterator<Item = &'static str> {
        let extra: &'static [&'static str] = if mma { self.mma_only } else { &[] };
        self.kernels.iter().chain(extra).copied()
    }
}

/// Whether code compiled with these defines has the `mma.sync` paths (`DS4_CUDA` and
/// `DS4_ARCH >= 800`, as the kernel sources test it).
pub fn has_mma(defines: &[(String, String)]) -> bool {
    let get = |k: &str| {
        defines
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    get("DS4_CUDA").is_some() && get("DS4_ARCH").and_then(|v| v.parse::<u32>().ok()) >= Some(800)
}

/// In-memory include files, `(include name, text)`, given to every compilation.
pub const HEADERS: &[(&str, &str)] = &[
    ("prelude.cuh", include_str!("../gpu/prelude.cuh")),
    ("iq2xxs_grid.cuh", include_str!("../gpu/iq2xxs_grid.cuh")),
    ("dequant.cuh", include_str!("../gpu/dequant.cuh")),
    ("hc.cuh", include_str!("../gpu/hc.cuh")),
    ("route.cuh", include_str!("../gpu/route.cuh")),
    ("ptx.cuh", include_str!("../gpu/ptx.cuh")),
    ("wgmma.cuh", include_str!("../gpu/wgmma.cuh")),
];

/// Weight types with `dequant_<t>` and `matvec_<t>` kernels in [`QUANT`], by kernel suffix.
pub const QUANT_TYPES: &[&str] = &["f32", "f16", "bf16", "q8_0", "q2_k", "q4_k", "iq2_xxs"];

/// Dequantisation and matrix-vector products (`gpu/quant.cu`).
pub const QUANT: Module = Module {
    name: "quant",
    source: include_str!("../gpu/quant.cu"),
    mma_only: &[],
    kernels: &[
        "dequant_f32",
        "matvec_f32",
        "dequant_f16",
        "matvec_f16",
        "dequant_bf16",
        "matvec_bf16",
        "dequant_q8_0",
        "matvec_q8_0",
        "dequant_q2_k",
        "matvec_q2_k",
        "dequant_q4_k",
        "matvec_q4_k",
        "dequant_iq2_xxs",
        "matvec_iq2_xxs",
        "reduce_splits_f32",
    ],
};

/// RMSNorm and elementwise ops (`gpu/elementwise.cu`).
pub const ELEMENTWISE: Module = Module {
    name: "elementwise",
    source: include_str!("../gpu/elementwise.cu"),
    mma_only: &[],
    kernels: &[
        "rmsnorm_f32",
        "rmsnorm_f32x4",
        "rmsnorm_f32g",
        "rmsnorm_f32w",
        "add_f32",
        "mul_f32",
        "scale_f32",
        "swiglu_f32",
        "copy_u32",
        "copy_list",
        "fill_u32",
        "prefetch_l2",
        "probe_phases",
        "probe_idx",
        "probe_glue",
        "probe_pre",
        "probe_join",
    ],
};

mod attention;
mod attn_tc;
mod blas_prep;
mod fused;
mod gemm;
mod gemm_i8;
mod gemm_wg;
mod gemm_wgd;
mod matmul;
mod matvec;
mod model;
mod moe;
mod sample;
mod synth;
pub use attention::ATTENTION;
pub use attn_tc::ATTN_TC;
pub use blas_prep::BLAS_PREP;
pub use fused::FUSED;
pub use gemm::GEMM;
pub use gemm_i8::GEMM_I8;
pub use gemm_wg::GEMM_WG;
pub use gemm_wgd::GEMM_WGD;
pub use matmul::MATMUL;
pub use matvec::MATVEC;
pub use model::MODEL;
pub use moe::MOE;
pub use sample::SAMPLE;
pub use synth::SYNTH;

/// Every module, for compile checks.
pub const MODULES: &[Module] = &[
    QUANT,
    ELEMENTWISE,
    ATTENTION,
    ATTN_TC,
    MODEL,
    MATMUL,
    SYNTH,
    MATVEC,
    GEMM,
    MOE,
    FUSED,
    SAMPLE,
    BLAS_PREP,
    GEMM_I8,
    GEMM_WG,
    GEMM_WGD,
];

/// The kernels of `m` that may be launched with programmatic dependent launch (PDL): those whose
/// body starts with `ds4_pdl_enter();` (prelude.cuh), i.e. that wait for the previous kernels
/// before touching memory, or with `DS4_PDL_LATE;` (fused.cu: only weights are read before its
/// own `ds4_pdl_enter()`). Read from the source text, so the list cannot drift from the code.
pub fn pdl_kernels(m: &Module) -> Vec<&'static str> {
    let src = m.source;
    m.kernels_for(true)
        .filter(|k| {
            // The definition: `DS4_KERNEL void DS4_BOUNDS(..) <k>(`, then its body's first '{'.
            src.match_indices("DS4_KERNEL void DS4_BOUNDS(")
                .any(|(i, _)| {
                    let rest = &src[i..];
                    let Some(after) = rest.split_once(')').map(|x| x.1.trim_start()) else {
                        return false;
                    };
                    after.strip_prefix(k).is_some_and(|a| a.starts_with('('))
                        && after.split_once('{').is_some_and(|(_, body)| {
                            let b = body.trim_start();
                            b.starts_with("ds4_pdl_enter();") || b.starts_with("DS4_PDL_LATE;")
                        })
                })
        })
        .collect()
}

/// Rows handled by one CTA of `matvec_*` (one warp per row); must match `DS4_MV_WARPS` in
/// `gpu/quant.cu` (checked by a test).
pub const MV_WARPS: u32 = 4;

/// Elements in one work chunk of the quant kernels (every supported row length is a multiple).
pub const CHUNK: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    fn defined_kernels(src: &str) -> Vec<String> {
        // `DS4_KERNEL void ... name(` and the DS4_QUANT_KERNELS(name, T) instantiations.
        let mut out = Vec::new();
        for line in src.lines() {
            let l = line.trim();
            if let Some(rest) = l.strip_prefix("DS4_KERNEL void DS4_BOUNDS(") {
                if let Some(after) = rest.split_once(')').map(|x| x.1) {
                    if let Some(name) = after.trim().split('(').next() {
                        let name = name.trim();
                        let ident = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                        if !name.is_empty() && ident {
                            out.push(name.to_string());
                        }
                    }
                }
            }
            if let Some(rest) = l.strip_prefix("DS4_QUANT_KERNELS(") {
                let t = rest.split(',').next().unwrap().trim();
                out.push(format!("dequant_{t}"));
                out.push(format!("matvec_{t}"));
            }
        }
        out
    }

    #[test]
    fn kernel_lists_match_sources() {
        for m in MODULES {
            let mut found = defined_kernels(m.source);
            let mut listed: Vec<String> = m.kernels_for(true).map(|s| s.to_string()).collect();
            found.sort();
            listed.sort();
            assert_eq!(found, listed, "module {}", m.name);
        }
    }

    #[test]
    fn mma_follows_the_cuda_arch() {
        let d = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(has_mma(&d(&[("DS4_CUDA", "1"), ("DS4_ARCH", "900")])));
        assert!(has_mma(&d(&[("DS4_CUDA", "1"), ("DS4_ARCH", "800")])));
        assert!(!has_mma(&d(&[("DS4_CUDA", "1"), ("DS4_ARCH", "750")])));
        assert!(!has_mma(&d(&[("DS4_HIP", "1"), ("DS4_ARCH", "0")])));
        assert!(!has_mma(&d(&[("DS4_CUDA", "1")])));
        // Only gemm has mma-only kernels, and none is also in the portable list.
        for m in MODULES {
            assert_eq!(m.mma_only.is_empty(), m.name != "gemm", "module {}", m.name);
            assert!(
                m.mma_only.iter().all(|k| !m.kernels.contains(k)),
                "module {}",
                m.name
            );
            assert_eq!(m.kernels_for(false).count(), m.kernels.len());
        }
    }

    #[test]
    fn pdl_kernels_are_read_from_the_bodies() {
        let m = Module {
            name: "t",
            source: "DS4_KERNEL void DS4_BOUNDS(64) a(int x) { ds4_pdl_enter(); f(x); }\n\
                     DS4_KERNEL void DS4_BOUNDS(64) ab(int x) { f(x); ds4_pdl_enter(); }\n\
                     DS4_KERNEL void DS4_BOUNDS(64) c(const float* p,\n    int n) {\n    ds4_pdl_enter();\n}\n",
            kernels: &["a", "ab", "c"],
            mma_only: &[],
        };
        assert_eq!(pdl_kernels(&m), ["a", "c"]);
        // The decode products wait first in every kernel of their modules (moe.cu's prompt
        // kernel m3gus_iq2_xxs aside: launched in stream order beside the wgmma gate/up, whose
        // writes the next kernel's wait must cover, so it is no PDL kernel).
        let moe: Vec<&str> = MOE
            .kernels
            .iter()
            .copied()
            .filter(|k| *k != "m3gus_iq2_xxs")
            .collect();
        assert_eq!(pdl_kernels(&MOE), moe, "module moe");
        for m in [
            MATVEC,
            ELEMENTWISE,
            MODEL,
            ATTENTION,
            ATTN_TC,
            MATMUL,
            SAMPLE,
            SYNTH,
            FUSED,
        ] {
            assert_eq!(pdl_kernels(&m), m.kernels, "module {}", m.name);
        }
    }

    #[test]
    fn quant_types_have_kernels() {
        for t in QUANT_TYPES {
            assert!(
                QUANT.kernels.contains(&format!("matvec_{t}").as_str()),
                "{t}"
            );
            assert!(
                QUANT.kernels.contains(&format!("dequant_{t}").as_str()),
                "{t}"
            );
        }
        assert!(QUANT
            .source
            .contains(&format!("#define DS4_MV_WARPS {MV_WARPS}\n")));
    }

    #[test]
    fn sources_include_no_toolkit_header() {
        for m in MODULES {
            for line in m
                .source
                .lines()
                .chain(HEADERS.iter().flat_map(|h| h.1.lines()))
            {
                if let Some(inc) = line.trim().strip_prefix("#include") {
                    let inc = inc.trim().trim_matches('"');
                    assert!(
                        HEADERS.iter().any(|h| h.0 == inc),
                        "module {} includes {inc}, which is not one of ours",
                        m.name
                    );
                }
            }
        }
    }
}
