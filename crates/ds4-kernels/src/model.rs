use crate::Module;

/// Model glue ops: embedding, hyper-connections (split/collapse/post), router, elementwise (`gpu/model.cu`).
pub const MODEL: Module = Module {
    name: "model",
    source: include_str!("../gpu/model.cu"),
    mma_only: &[],
    kernels: &[
        "embed_rows",
        "hc_split",
        "hc_collapse",
        "hc_post",
        "moe_route",
        "hc_split_fast",
        "hc_collapse_fast",
        "hc_post_fast",
        "moe_route_fast",
        "hc_split_glue",
    ],
};
