use crate::Module;

/// Attention-state ops: RoPE, row rounding (FP8/FP4/f16), compressors, lightning indexer, sink attention (`gpu/attention.cu`).
pub const ATTENTION: Module = Module {
    name: "attention",
    source: include_str!("../gpu/attention.cu"),
    kernels: &[
        "rope_f32",
        "round_rows_f32",
        "round_fp4h128_f32",
        "index_qprep_f32",
        "compress_pool_f32",
        "compress_row_f32",
        "compress_frontier_f32",
        "compress_frontier_ip_f32",
        "index_scores_f32",
        "index_scores128_f32",
        "index_scores128h_f32",
        "index_topk",
        "index_topk_ps",
        "index_topk_r",
        "index_topk_l1",
        "index_topk_l2",
        "attend_f32",
        "attend_part_f32",
        "attend_combine_f32",
        "attend_one_f32",
        "attend_one_p",
        "attend_one_tc",
        "attend_one_tcp",
        "ring_store_f32",
    ],
};
