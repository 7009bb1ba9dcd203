use crate::Module;

/// Prefill sink attention on tensor cores (`gpu/attn_tc.cu`): one CTA per (16 heads, token),
/// S = Q·Kᵀ and O = P·V by mma.sync f16 (CUDA sm_80+; elsewhere the kernels are empty and the
/// host keeps `attend_part_f32`). `attn_tc<hd>_f32`: hi/lo split of Q and P (near f32);
/// `attn_tc<hd>h_f32`: one f16 product each; both read f16 copies of the rows made once a call
/// by `atc_rows_f16`. `attn_tc512g[64]_f32`: the one-product form with one CTA per token for all
/// heads (32- / 64-row tiles, `gp`: 32 pipelined); `attn_wg512[n]_f32` the same on Hopper wgmma
/// (sm_90a, `DS4_GPU_ATTN_WG=on`; `n`: raw queries normed as they load); `atc_rope_tab` the
/// chunk's RoPE angles those raw-query kernels read; `attn_tc512g[n]_bf` write the output as
/// bf16, the X' of the output projection (`Backend::attend_project`). `index_scores_tc`: the lightning indexer's scores
/// (prefill, FP4-simulated queries and rows) by mma.sync bf16, the bits of `index_scores128h_f32`;
/// `index_scores_d` the same for decode steps (1-4 tokens, a token a CTA, every warp computing);
/// `index_scores_wg` the same by wgmma (sm_90a, prefill); all three read the indexer's rows as
/// the compressor stores them when FP4-simulated: bf16 (exact).
pub const ATTN_TC: Module = Module {
    name: "attn_tc",
    source: include_str!("../gpu/attn_tc.cu"),
    mma_only: &[],
    kernels: &[
        "attn_tc512_f32",
        "attn_tc512h_f32",
        "attn_tc512g_f32",
        "attn_tc512gn_f32",
        "attn_tc512g_bf",
        "attn_tc512gn_bf",
        "attn_tc512g64_f32",
        "attn_tc512gp_f32",
        "attn_wg512_f32",
        "attn_wg512n_f32",
        "attn_tc64_f32",
        "attn_tc64h_f32",
        "atc_rows_f16",
        "atc_rope_tab",
        "index_scores_tc",
        "index_scores_d",
        "index_scores_wg",
    ],
};
