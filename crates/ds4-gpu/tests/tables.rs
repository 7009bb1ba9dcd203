//! `ds4-kernels/gpu/iq2xxs_grid.cuh` must hold exactly ds4-quant's IQ2_XXS grid (the CPU
//! reference's table). `DS4_REGEN=1` rewrites the header from it.

fn render() -> String {
    let mut s = String::from(
        "// Generated from ds4_quant::IQ2XXS_GRID (ggml's iq2xxs_grid): 8 magnitudes per entry, one per byte.\n\
         // Regenerate: DS4_REGEN=1 cargo test -p ds4-gpu --release --test tables (the test checks it matches).\n\
         #pragma once\n__device__ const u64 ds4_iq2xxs_grid[256] = {\n",
    );
    for row in ds4_quant::IQ2XXS_GRID.chunks(4) {
        let cells: Vec<String> = row.iter().map(|v| format!("0x{v:016x}ull")).collect();
        s.push_str(&format!("    {},\n", cells.join(", ")));
    }
    s.push_str("};\n");
    s
}

#[test]
fn iq2xxs_grid_header_matches_ds4_quant() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../ds4-kernels/gpu/iq2xxs_grid.cuh"
    );
    let want = render();
    if std::env::var("DS4_REGEN").is_ok_and(|v| v == "1") {
        std::fs::write(path, &want).unwrap();
    }
    let have = ds4_kernels::HEADERS
        .iter()
        .find(|h| h.0 == "iq2xxs_grid.cuh")
        .unwrap()
        .1;
    assert!(
        have == want,
        "{path} is stale: run DS4_REGEN=1 cargo test -p ds4-gpu --release --test tables"
    );
}

/// The kernel computes ksigns_iq2xs (7 sign bits + odd-parity bit) instead of tabling it.
#[test]
fn ksigns_formula_matches_table() {
    for (s, &k) in ds4_quant::KSIGNS_IQ2XS.iter().enumerate() {
        let s = s as u32;
        assert_eq!(k as u32, s | ((s.count_ones() & 1) << 7), "entry {s}");
    }
}
