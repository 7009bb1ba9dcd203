use crate::Module;

/// Decode MoE (n ≤ 4 tokens): fused gate+up+SwiGLU and down+slot sum over the routed experts,
/// each distinct expert read once (`gpu/moe.cu`): v1 `moe*` (rows staged in shared memory), v2
/// `m2*` (direct loads), v3d `m3*` (n = 1, IQ2_XXS gate/up and Q2_K down on tensor cores, CUDA
/// sm_80+); `m3gus_iq2_xxs`: the prompt MoE's runs of <= 8 pairs on m3gu's gate/up decode
/// (beside gemm_wg.cu's wgmma form, which skips them).
pub const MOE: Module = Module {
    name: "moe",
    source: include_str!("../gpu/moe.cu"),
    mma_only: &[],
    kernels: &[
        "moegu1_iq2_xxs",
        "moegu2_iq2_xxs",
        "moegu4_iq2_xxs",
        "moegu1_q2_k",
        "moegu2_q2_k",
        "moegu4_q2_k",
        "moegu1_q4_k",
        "moegu2_q4_k",
        "moegu4_q4_k",
        "moedn_iq2_xxs",
        "moedn_q2_k",
        "moedn_q4_k",
        "m2gu1_iq2_xxs",
        "m2gu1_q2_k",
        "m2gu1_q4_k",
        "m2gu2_iq2_xxs",
        "m2gu2_q2_k",
        "m2gu2_q4_k",
        "m2dn1_iq2_xxs",
        "m2dn1_q2_k",
        "m2dn1_q4_k",
        "m2dn2_iq2_xxs",
        "m2dn2_q2_k",
        "m2dn2_q4_k",
        "m3gu1_iq2_xxs",
        "m3dn1_q2_k",
        "m3dn1ip_q2_k",
        "m3gus_iq2_xxs",
        "moe_localize",
    ],
};
