//! Decode weight products (model/matvec.rs, gpu/matvec.cu: n ≤ 4) against the CPU reference
//! (the default mix of forms; `matvec_staged`: the staged `mvs*` kernels for every type):
//! every weight type on random valid blocks, n = 1..4, Part::All and Part::Expert, row counts
//! that are not multiples of the rows per warp, column counts that end mid warp-step, K split
//! across warps (few rows), grouped products, the model's real shapes, and routed experts with
//! experts repeated across tokens and within one token. Skips with the reason when no GPU is
//! present (DS4_REQUIRE_GPU=1: fail). Every case is run and printed before the assertion.
//!
//! Sums are f32 in another order than the CPU and block scales are applied per 8-element slice
//! (sum(q·x)·d), so results agree to f32 rounding of the dot products: TOL relative to
//! 1 + |cpu|, TOL_K for the K-quants (random 6-bit scales and mins: large terms that cancel),
//! both times sqrt(cols / 2048) past 2048 columns (the rounding of a sum of `cols` products grows
//! with its length). Measured on an H200 (commit 8cdd45f): worst 6.3e-5 for Q8_0 8192->4096,
//! 5.2e-5 at 4096 columns, 1.6e-4 for Q4_K, 7.4e-5 for the MoE with Q4_K down.

mod common;

use common::{backends, max_rel, randn, random_routes, rng, weight, Pair};
use ds4_backend::{Backend, GgmlType, MoeSpec, Part};
use ds4_cpu::CpuBackend;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;

const TOL: f32 = 5e-5;
const TOL_K: f32 = 2e-4;

const TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
];

/// Whether the block format needs 256-column rows.
fn k_quant(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::IQ2_XXS)
}

/// Records every case, asserts once at the end.
#[derive(Default)]
struct Cases {
    bad: Vec<String>,
    worst: f32,
    n: usize,
}

impl Cases {
    /// `cols`: the longest dot product in the case.
    fn check(&mut self, name: String, cols: usize, g: &[f32], c: &[f32], gpu: &GpuBackend) {
        self.check_scaled(name, cols, g, c, gpu, 1.0);
    }

    /// As `check` with the tolerance times `scale`.
    fn check_scaled(
        &mut self,
        name: String,
        cols: usize,
        g: &[f32],
        c: &[f32],
        gpu: &GpuBackend,
        scale: f32,
    ) {
        self.n += 1;
        if let Err(e) = gpu.check() {
            println!("{name}: GPU error: {e}");
            self.bad.push(format!("{name}: {e}"));
            return;
        }
        let e = max_rel(g, c);
        self.worst = self.worst.max(e);
        let base = if name.contains("_K") { TOL_K } else { TOL };
        let tol = scale * base * (cols as f32 / 2048.0).sqrt().max(1.0);
        println!("{name}: max rel {e:.3e} (tolerance {tol:.1e})");
        if e > tol {
            self.bad.push(format!("{name}: {e:.3e}"));
        }
    }

    fn finish(self) {
        println!(
            "{} cases, worst {:.3e} (tolerance {TOL:.0e}, {TOL_K:.0e} with K-quants, × sqrt(cols/2048) past 2048)",
            self.n, self.worst
        );
        assert!(self.bad.is_empty(), "failed cases: {:?}", self.bad);
    }
}

/// One matmul case: CPU vs GPU, the GPU output poisoned (NaN) first.
#[allow(clippy::too_many_arguments)]
fn matmul_case(
    cases: &mut Cases,
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    w: &Pair,
    name: &str,
    cols: usize,
    rows: usize,
    n: usize,
    part: Part,
    seed: u64,
) {
    let x = randn(&mut rng(seed), n * cols, 1.0);
    let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
    let mut cy = cpu.alloc(n * rows);
    let mut gy = gpu.upload(&vec![f32::NAN; n * rows]);
    cpu.matmul(&w.0, part, &cx, n, &mut cy);
    gpu.matmul(&w.1, part, &gx, n, &mut gy);
    cases.check(
        format!("{name} {cols}->{rows} n={n} {part:?}"),
        cols,
        &gpu.download(&gy, n * rows),
        &cpu.download(&cy, n * rows),
        gpu,
    );
}

#[test]
fn matvec_every_type_and_n() {
    ds4_gpu::GpuBackend::set_matvec(true); // one-row products are opt-in
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for (ti, &ty) in TYPES.iter().enumerate() {
        // (cols, rows, experts): many rows (kspl 1 or 2), rows not a multiple of 4, a column
        // count ending mid warp-step (not for the 256-element formats), few rows (K split).
        let shapes: &[(usize, usize, usize)] = if k_quant(ty) {
            &[(1024, 2050, 3), (1536, 70, 2), (4096, 40, 1)]
        } else {
            &[(1056, 2050, 3), (1120, 70, 2), (4096, 40, 1)]
        };
        for (si, &(cols, rows, experts)) in shapes.iter().enumerate() {
            let w = weight(
                &cpu,
                &gpu,
                ty,
                cols,
                rows,
                experts,
                100 + 10 * ti as u64 + si as u64,
            );
            for n in 1..=4 {
                let mut parts = vec![Part::All];
                if experts > 1 {
                    parts.push(Part::Expert(experts - 1));
                }
                for part in parts {
                    let seed = 1000 + n as u64 + 7 * si as u64;
                    matmul_case(
                        &mut cases,
                        &cpu,
                        &gpu,
                        &w,
                        &format!("matvec {ty:?}"),
                        cols,
                        rows,
                        n,
                        part,
                        seed,
                    );
                }
            }
        }
    }
    cases.finish();
}

/// The opt-in n = 1 variants (process-wide switch: run this binary with --test-threads=1 on a
/// GPU so other tests keep the default while this one runs).
#[test]
fn matvec_variants() {
    ds4_gpu::GpuBackend::set_matvec(true); // one-row products are opt-in
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for (ti, ty) in [
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ]
    .into_iter()
    .enumerate()
    {
        // Whole 4-step groups only, groups plus a remainder, a ragged last step (Q8_0), K split.
        let shapes: &[(usize, usize)] = if ty == GgmlType::Q8_0 {
            &[(4096, 2050), (1536, 1030), (1056, 70), (4096, 40)]
        } else {
            &[(4096, 2050), (1536, 1030), (4096, 40)]
        };
        for (si, &(cols, rows)) in shapes.iter().enumerate() {
            let w = weight(
                &cpu,
                &gpu,
                ty,
                cols,
                rows,
                2,
                700 + 10 * ti as u64 + si as u64,
            );
            for v in 1..=3 {
                GpuBackend::set_matvec_variant(v);
                for part in [Part::All, Part::Expert(1)] {
                    matmul_case(
                        &mut cases,
                        &cpu,
                        &gpu,
                        &w,
                        &format!("variant {v} {ty:?}"),
                        cols,
                        rows,
                        1,
                        part,
                        v as u64 + si as u64,
                    );
                }
            }
        }
    }
    GpuBackend::set_matvec_variant(0);
    cases.finish();
}

/// The staged kernels' own shapes: split K across CTAs (few rows: the hyper-connection mixes
/// 16384->24 and ->4, 4096->64), whole-row tiles of 1..16 rows, odd row counts (1, 3, 17), a
/// ragged last column tile, Part::Expert past a split product; then the same products twice
/// (bitwise equal: no atomics), and the older form (variant 4, n = 2..4) on a few of them.
/// Variant 5 stages every type (the default only where it measured faster).
#[test]
fn matvec_staged() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    GpuBackend::set_matvec_variant(5);
    let mut cases = Cases::default();
    let shapes: &[(GgmlType, usize, usize, usize)] = &[
        (GgmlType::F16, 16384, 24, 1),
        (GgmlType::F16, 16384, 4, 1),
        (GgmlType::F16, 4096, 64, 1),
        (GgmlType::F16, 4096, 256, 1),
        (GgmlType::F16, 1024, 8192, 1),
        (GgmlType::F16, 4096, 17, 2),
        (GgmlType::F32, 4064, 3, 2),
        (GgmlType::BF16, 2048, 1, 1),
        (GgmlType::Q8_0, 256, 1, 1),
        (GgmlType::Q8_0, 2304, 3, 2),
        (GgmlType::Q8_0, 1024, 4099, 1),
        (GgmlType::Q8_0, 8192, 17, 1),
        (GgmlType::Q2_K, 3072, 5, 2),
        (GgmlType::Q4_K, 2304, 33, 1),
        (GgmlType::IQ2_XXS, 4096, 19, 2),
    ];
    for (si, &(ty, cols, rows, experts)) in shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, ty, cols, rows, experts, 900 + si as u64);
        for n in 1..=4 {
            let part = if experts > 1 {
                Part::Expert(experts - 1)
            } else {
                Part::All
            };
            let seed = 5000 + n as u64 + 11 * si as u64;
            matmul_case(
                &mut cases,
                &cpu,
                &gpu,
                &w,
                &format!("staged {ty:?}"),
                cols,
                rows,
                n,
                part,
                seed,
            );
            // Deterministic: a second run gives the same bits.
            let x = randn(&mut rng(seed), n * cols, 1.0);
            let gx = gpu.upload(&x);
            let mut a = gpu.alloc(n * rows);
            let mut b = gpu.alloc(n * rows);
            gpu.matmul(&w.1, part, &gx, n, &mut a);
            gpu.matmul(&w.1, part, &gx, n, &mut b);
            let (a, b) = (gpu.download(&a, n * rows), gpu.download(&b, n * rows));
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            println!("staged {ty:?} {cols}->{rows} n={n}: repeat bitwise equal {same}");
            assert!(
                same,
                "staged {ty:?} {cols}->{rows} n={n}: results differ between runs"
            );
            if n > 1 && si % 3 == 0 {
                GpuBackend::set_matvec_variant(4);
                matmul_case(
                    &mut cases,
                    &cpu,
                    &gpu,
                    &w,
                    &format!("old form {ty:?}"),
                    cols,
                    rows,
                    n,
                    part,
                    seed,
                );
                GpuBackend::set_matvec_variant(5);
            }
        }
    }
    GpuBackend::set_matvec_variant(0);
    cases.finish();
}

#[test]
fn matvec_real_shapes() {
    ds4_gpu::GpuBackend::set_matvec(true); // one-row products are opt-in
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for (name, ty, cols, rows) in [
        ("attn q_a", GgmlType::Q8_0, 4096, 1024),
        ("attn q_b", GgmlType::Q8_0, 1024, 32768),
        ("attn kv", GgmlType::Q8_0, 4096, 512),
        ("attn out_b", GgmlType::Q8_0, 8192, 4096),
        ("shared up", GgmlType::Q8_0, 4096, 2048),
        ("shared down", GgmlType::Q8_0, 2048, 4096),
        ("router", GgmlType::F16, 4096, 256),
        ("hc mix", GgmlType::F16, 16384, 24),
        ("hc head mix", GgmlType::F16, 16384, 4),
        ("index proj", GgmlType::F16, 4096, 64),
        ("F16 4096->512", GgmlType::F16, 4096, 512),
        ("F16 4096->1024", GgmlType::F16, 4096, 1024),
        ("F16 1024->8192", GgmlType::F16, 1024, 8192),
        ("head (rows cut)", GgmlType::Q8_0, 4096, 12928),
        ("expert gate", GgmlType::IQ2_XXS, 4096, 2048),
        ("expert down", GgmlType::Q2_K, 2048, 4096),
        ("expert down q4", GgmlType::Q4_K, 2048, 4096),
    ] {
        let w = weight(&cpu, &gpu, ty, cols, rows, 1, cols as u64 ^ rows as u64);
        for n in [1, 2, 4] {
            matmul_case(
                &mut cases,
                &cpu,
                &gpu,
                &w,
                &format!("{name} {ty:?}"),
                cols,
                rows,
                n,
                Part::All,
                n as u64,
            );
        }
    }
    cases.finish();
}

#[test]
fn matvec_grouped() {
    ds4_gpu::GpuBackend::set_matvec(true); // one-row products are opt-in
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // (groups, cols per group, total rows): small for every type, and attn out_a (8 × 4096->1024).
    let mut shapes: Vec<(GgmlType, usize, usize, usize)> =
        TYPES.iter().map(|&ty| (ty, 4, 512, 72)).collect();
    shapes.push((GgmlType::Q8_0, 8, 4096, 8192));
    for (si, &(ty, groups, cols, rows)) in shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, ty, cols, rows, 1, 300 + si as u64);
        for n in 1..=4 {
            let x = randn(&mut rng(n as u64 + si as u64), n * groups * cols, 1.0);
            let (cx, gx) = (cpu.upload(&x), gpu.upload(&x));
            let mut cy = cpu.alloc(n * rows);
            let mut gy = gpu.upload(&vec![f32::NAN; n * rows]);
            cpu.matmul_grouped(&w.0, groups, &cx, n, &mut cy);
            gpu.matmul_grouped(&w.1, groups, &gx, n, &mut gy);
            cases.check(
                format!("grouped {ty:?} {groups}x({cols}->{}) n={n}", rows / groups),
                cols,
                &gpu.download(&gy, n * rows),
                &cpu.download(&cy, n * rows),
                &gpu,
            );
        }
    }
    cases.finish();
}

#[test]
fn matvec_moe() {
    ds4_gpu::GpuBackend::set_matvec(true); // one-row products are opt-in
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // (d, ff, n_used): small, and the model's 4096 / 2048 / 6.
    for (d, ff, k) in [(256, 512, 3), (2048, 512, 3), (4096, 2048, 6)] {
        let spec = MoeSpec {
            n_expert: 8,
            n_used: k,
            d,
            ff,
            weight_scale: 1.0,
            clamp: 0.05,
        };
        // q2 mix, q4 mix, Q8_0/F16, and mixed gate/up types (declined: matmul.rs runs it).
        let mixes = [
            (GgmlType::IQ2_XXS, GgmlType::IQ2_XXS, GgmlType::Q2_K),
            (GgmlType::IQ2_XXS, GgmlType::IQ2_XXS, GgmlType::Q4_K),
            (GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::F16),
            (GgmlType::F16, GgmlType::Q8_0, GgmlType::BF16),
        ];
        for (mi, &(tg, tu, td)) in mixes.iter().enumerate() {
            if d == 4096 && mi >= 2 {
                continue;
            }
            let s = 400 + 10 * mi as u64 + d as u64;
            let (cg, gg) = weight(&cpu, &gpu, tg, d, ff, spec.n_expert, s);
            let (cu, gu) = weight(&cpu, &gpu, tu, d, ff, spec.n_expert, s + 1);
            let (cd, gd) = weight(&cpu, &gpu, td, ff, d, spec.n_expert, s + 2);
            for n in 1..=4 {
                let mut r = rng(s + n as u64);
                let z = randn(&mut r, n * d, 1.0);
                // Distinct experts within a token, repeated across tokens; the last token of
                // n = 4 repeats one expert in two slots.
                let (mut sel, wgt) = random_routes(&mut r, n, spec.n_expert, k);
                if n == 4 {
                    sel[3 * k + k - 1] = sel[3 * k];
                }
                let (cz, cs, cw) = (cpu.upload(&z), cpu.upload_i32(&sel), cpu.upload(&wgt));
                let mut co = cpu.alloc(n * d);
                cpu.moe_experts(&spec, &cg, &cu, &cd, &cz, &cs, &cw, n, &mut co);
                let (gz, gs, gw) = (gpu.upload(&z), gpu.upload_i32(&sel), gpu.upload(&wgt));
                let mut go = gpu.upload(&vec![f32::NAN; n * d]);
                gpu.moe_experts(&spec, &gg, &gu, &gd, &gz, &gs, &gw, n, &mut go);
                cases.check(
                    format!("moe {tg:?}/{tu:?}/{td:?} d={d} ff={ff} k={k} n={n}"),
                    d.max(ff),
                    &gpu.download(&go, n * d),
                    &cpu.download(&co, n * d),
                    &gpu,
                );
            }
        }
    }
    cases.finish();
}

/// The n = 1 `mvq_*` forms (Q8_0, F16; `set_matvec_one(1..=2)`: r2u4, r1u4; then the default mix): the
/// model's shapes (head rows cut), odd row counts (1, 3, 4099), 32 and 96 columns (ragged and
/// 2-byte aligned Q8_0 rows), Part::Expert, grouped attn out_a; every product run twice (bitwise
/// equal). Process-wide switch: run with --test-threads=1 on a GPU.
#[test]
fn matvec_one_row() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // (type, cols, rows, experts, groups)
    let shapes: &[(GgmlType, usize, usize, usize, usize)] = &[
        (GgmlType::Q8_0, 4096, 1024, 1, 1),
        (GgmlType::Q8_0, 1024, 32768, 1, 1),
        (GgmlType::Q8_0, 4096, 512, 1, 1),
        (GgmlType::Q8_0, 8192, 4096, 1, 1),
        (GgmlType::Q8_0, 4096, 2048, 1, 1),
        (GgmlType::Q8_0, 2048, 4096, 1, 1),
        (GgmlType::Q8_0, 4096, 12928, 1, 1),
        (GgmlType::Q8_0, 4096, 8192, 1, 8),
        (GgmlType::Q8_0, 4096, 1, 1, 1),
        (GgmlType::Q8_0, 4096, 3, 2, 1),
        (GgmlType::Q8_0, 4096, 4099, 1, 1),
        (GgmlType::Q8_0, 32, 70, 2, 1),
        (GgmlType::Q8_0, 96, 33, 1, 1),
        (GgmlType::Q8_0, 1056, 70, 1, 1),
        (GgmlType::F16, 4096, 256, 1, 1),
        (GgmlType::F16, 4096, 1024, 1, 1),
        (GgmlType::F16, 1024, 8192, 1, 1),
        (GgmlType::F16, 16384, 24, 1, 1),
        (GgmlType::F16, 4096, 3, 2, 1),
        (GgmlType::F16, 32, 70, 1, 1),
        (GgmlType::F16, 96, 4099, 1, 1),
        (GgmlType::F16, 512, 72, 1, 4),
    ];
    for (si, &(ty, cols, rows, experts, groups)) in shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, ty, cols, rows, experts, 1300 + si as u64);
        let part = if experts > 1 {
            Part::Expert(experts - 1)
        } else {
            Part::All
        };
        let xs = randn(&mut rng(77 + si as u64), groups * cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cy = cpu.alloc(rows);
        if groups > 1 {
            cpu.matmul_grouped(&w.0, groups, &cx, 1, &mut cy);
        } else {
            cpu.matmul(&w.0, part, &cx, 1, &mut cy);
        }
        let want = cpu.download(&cy, rows);
        // mvq forms 1..=2, then the default under several `mvx` settings (q8 form 0: none).
        for (form, xf, ctas) in [
            (1u8, 1u8, 3u8),
            (2, 1, 3),
            (255, 1, 3),
            (255, 1, 0),
            (255, 1, 1),
            (255, 0, 3),
        ] {
            GpuBackend::set_matvec_one(form);
            GpuBackend::set_matvec_q8_form(xf, ctas);
            let mut outs = Vec::new();
            for _ in 0..2 {
                let mut gy = gpu.upload(&vec![f32::NAN; rows]);
                if groups > 1 {
                    gpu.matmul_grouped(&w.1, groups, &gx, 1, &mut gy);
                } else {
                    gpu.matmul(&w.1, part, &gx, 1, &mut gy);
                }
                outs.push(gpu.download(&gy, rows));
            }
            let name =
                format!("mvq form {form} x {xf}/{ctas} {ty:?} {groups}x{cols}->{rows} {part:?}");
            cases.check(name.clone(), cols, &outs[0], &want, &gpu);
            let same = outs[0]
                .iter()
                .zip(&outs[1])
                .all(|(p, q)| p.to_bits() == q.to_bits());
            println!("{name}: repeat bitwise equal {same}");
            assert!(same, "{name}: results differ between runs");
        }
    }
    GpuBackend::set_matvec_one(255);
    GpuBackend::set_matvec_q8_form(1, 255);
    cases.finish();
}

/// The F16 `mvq_*` / `mvqm_*` kernels that load weights before the PDL wait
/// (`set_matvec_mvq_late(true)`: `mvq_r2u4_f16l`, `mvq_r1u4_f16l`, `mvqm_r2u4_f16l`) against the
/// same kernels waiting first: bitwise the same (the same sums), and within TOL of the CPU. The
/// model's shapes (router, indexer q_b, HC mixer with and without column splits, HCA
/// compressor set), odd row counts, short rows; each run twice.
#[test]
fn matvec_mvq_late() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // single products: (cols, rows, groups, split)
    let singles: &[(usize, usize, usize, bool)] = &[
        (4096, 256, 1, false),
        (1024, 8192, 1, false),
        (16384, 24, 1, false),
        (16384, 24, 1, true),
        (4096, 3, 1, false),
        (96, 4099, 1, false),
        (512, 72, 4, false),
    ];
    for (si, &(cols, rows, groups, split)) in singles.iter().enumerate() {
        let w = weight(&cpu, &gpu, GgmlType::F16, cols, rows, 1, 3300 + si as u64);
        let xs = randn(&mut rng(377 + si as u64), groups * cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cy = cpu.alloc(rows);
        if groups > 1 {
            cpu.matmul_grouped(&w.0, groups, &cx, 1, &mut cy);
        } else {
            cpu.matmul(&w.0, Part::All, &cx, 1, &mut cy);
        }
        let want = cpu.download(&cy, rows);
        GpuBackend::set_matvec_split(split);
        for form in [1u8, 2, 255] {
            GpuBackend::set_matvec_one(form);
            let mut outs = Vec::new();
            for late in [false, true, true] {
                GpuBackend::set_matvec_mvq_late(late);
                let mut gy = gpu.upload(&vec![f32::NAN; rows]);
                if groups > 1 {
                    gpu.matmul_grouped(&w.1, groups, &gx, 1, &mut gy);
                } else {
                    gpu.matmul(&w.1, Part::All, &gx, 1, &mut gy);
                }
                outs.push(gpu.download(&gy, rows));
            }
            let name = format!("mvq late form {form} split {split} F16 {groups}x{cols}->{rows}");
            cases.check(name.clone(), cols, &outs[1], &want, &gpu);
            for (i, o) in outs[1..].iter().enumerate() {
                let same = o
                    .iter()
                    .zip(&outs[0])
                    .all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(
                    same,
                    "{name}: late run {i} differs from the early-wait form"
                );
            }
        }
    }
    GpuBackend::set_matvec_split(false);
    GpuBackend::set_matvec_one(255);
    // merged sets below the mvxm threshold (mvqm_r2u4_f16 / _f16l)
    let sets: &[(usize, &[usize])] = &[
        (4096, &[512, 512]),
        (1056, &[7, 1, 70]),
        (96, &[3, 5, 7, 9, 11]),
    ];
    for (si, &(cols, rows)) in sets.iter().enumerate() {
        let ws: Vec<Pair> = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                weight(
                    &cpu,
                    &gpu,
                    GgmlType::F16,
                    cols,
                    r,
                    1,
                    3400 + 10 * si as u64 + i as u64,
                )
            })
            .collect();
        let xs = randn(&mut rng(477 + si as u64), cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cys: Vec<_> = rows.iter().map(|&r| cpu.alloc(r)).collect();
        let cws: Vec<_> = ws.iter().map(|w| &w.0).collect();
        let mut crefs: Vec<_> = cys.iter_mut().collect();
        cpu.matmul_multi(&cws, &cx, 1, &mut crefs);
        let want: Vec<Vec<f32>> = cys
            .iter()
            .zip(rows)
            .map(|(y, &r)| cpu.download(y, r))
            .collect();
        let mut outs = Vec::new();
        for late in [false, true, true] {
            GpuBackend::set_matvec_mvq_late(late);
            let mut gys: Vec<_> = rows
                .iter()
                .map(|&r| gpu.upload(&vec![f32::NAN; r]))
                .collect();
            let gws: Vec<_> = ws.iter().map(|w| &w.1).collect();
            let mut grefs: Vec<_> = gys.iter_mut().collect();
            gpu.matmul_multi(&gws, &gx, 1, &mut grefs);
            outs.push(
                gys.iter()
                    .zip(rows)
                    .map(|(y, &r)| gpu.download(y, r))
                    .collect::<Vec<_>>(),
            );
        }
        for (i, &r) in rows.iter().enumerate() {
            let name = format!("mvqm late F16 {cols}->{rows:?}[{i}] ({r} rows)");
            cases.check(name.clone(), cols, &outs[1][i], &want[i], &gpu);
            for run in &outs[1..] {
                let same = run[i]
                    .iter()
                    .zip(&outs[0][i])
                    .all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{name}: late differs from the early-wait form");
            }
        }
    }
    GpuBackend::set_matvec_mvq_late(true);
    cases.finish();
}

/// The interleaved F16 copies (`set_matvec_f16_il(true)` before the upload: `f16_repack_i`, then
/// `mvq_r2u4_f16i` / `_f16il` with `set_matvec_mvq_late`) against the CPU (TOL, as the plain
/// layout) and the plain copy of the same data: copies made exactly for >= 4096 rows of <= 2048
/// columns in whole 256-column tiles (asserted), late and early bitwise equal, repeats equal.
#[test]
fn matvec_f16_interleaved() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // (cols, rows, copy expected)
    let shapes: &[(usize, usize, bool)] = &[
        (1024, 8192, true),
        (2048, 4096, true),
        (256, 4099, true),
        (1280, 4096, true),
        (4096, 4096, false),
        (96, 4099, false),
        (1024, 1024, false),
    ];
    for (si, &(cols, rows, taken)) in shapes.iter().enumerate() {
        let seed = 3500 + si as u64;
        GpuBackend::set_matvec_f16_il(false);
        let plain = weight(&cpu, &gpu, GgmlType::F16, cols, rows, 1, seed);
        GpuBackend::set_matvec_f16_il(true);
        let il = weight(&cpu, &gpu, GgmlType::F16, cols, rows, 1, seed);
        GpuBackend::set_matvec_f16_il(false);
        assert!(
            !GpuBackend::has_f16_il(&plain.1),
            "{cols}->{rows}: a copy with the switch off"
        );
        assert_eq!(
            GpuBackend::has_f16_il(&il.1),
            taken,
            "{cols}->{rows}: interleaved copy"
        );
        let xs = randn(&mut rng(577 + si as u64), cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cy = cpu.alloc(rows);
        cpu.matmul(&plain.0, Part::All, &cx, 1, &mut cy);
        let want = cpu.download(&cy, rows);
        let run = |w: &<GpuBackend as Backend>::Weight| {
            let mut gy = gpu.upload(&vec![f32::NAN; rows]);
            gpu.matmul(w, Part::All, &gx, 1, &mut gy);
            gpu.download(&gy, rows)
        };
        let p = run(&plain.1);
        let mut outs = Vec::new();
        for late in [false, true, true] {
            GpuBackend::set_matvec_mvq_late(late);
            outs.push(run(&il.1));
        }
        GpuBackend::set_matvec_mvq_late(true);
        cases.check(format!("f16 plain {cols}->{rows}"), cols, &p, &want, &gpu);
        let name = format!("f16 interleaved {cols}->{rows} (copy {taken})");
        cases.check(name.clone(), cols, &outs[0], &want, &gpu);
        for o in &outs[1..] {
            let same = o
                .iter()
                .zip(&outs[0])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: late or repeat differs");
        }
        let same_as_plain = p
            .iter()
            .zip(&outs[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        println!("{name}: bitwise equal to the plain layout: {same_as_plain}");
    }
    cases.finish();
}

/// The n = 1 Q8_0 products from the decode-layout copy (`mvr_*`, `set_matvec_repacked(1..=4)`,
/// then off (`mvq` on the GGUF blocks), the old default and `mvx_r4u2_q8_0` with several grids): the model's shapes (head rows cut),
/// odd row counts (1, 3, 4099), columns that end mid warp-step (32, 96, 1056, 1568),
/// Part::Expert(0) of a one-slab matrix, grouped attn out_a, and a weight generated on the GPU
/// (`random`, the synthetic benchmarks' path: copied on the device); every product run twice
/// (bitwise equal). Process-wide switch: run with --test-threads=1 on a GPU.
#[test]
fn matvec_repacked() {
    use ds4_backend::{Fill, WeightKind};
    use ds4_gpu::model::GpuWeight;
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let repack = std::env::var("DS4_GPU_Q8_REPACK").map_or(true, |v| v != "off");
    let mut cases = Cases::default();
    // (cols, rows, groups, generated on the GPU)
    let shapes: &[(usize, usize, usize, bool)] = &[
        (4096, 1024, 1, false),
        (1024, 32768, 1, false),
        (4096, 512, 1, false),
        (8192, 4096, 1, false),
        (4096, 2048, 1, false),
        (2048, 4096, 1, false),
        (4096, 12928, 1, false),
        (4096, 8192, 8, false),
        (4096, 1, 1, false),
        (4096, 3, 1, false),
        (4096, 4099, 1, false),
        (32, 70, 1, false),
        (96, 33, 1, false),
        (1056, 70, 1, false),
        (1568, 5, 1, false),
        (16384, 40, 1, false),
        (512, 72, 4, false),
        (4096, 2048, 1, true),
        (1056, 37, 1, true),
    ];
    for (si, &(cols, rows, groups, synth)) in shapes.iter().enumerate() {
        let seed = 1500 + si as u64;
        let w = if synth {
            let g = gpu
                .random(
                    WeightKind::Matrix,
                    GgmlType::Q8_0,
                    &[cols as u64, rows as u64],
                    Fill::Uniform {
                        center: 0.0,
                        spread: 0.05,
                    },
                    seed,
                )
                .expect("random Q8_0");
            let GpuWeight::Mat { buf, .. } = &g else {
                panic!("random matrix is not a Mat")
            };
            gpu.gpu().synchronize().unwrap();
            let mut raw = vec![0u8; buf.bytes()];
            gpu.gpu().download(buf.ptr(), &mut raw).unwrap();
            let f = common::file(&[("w", GgmlType::Q8_0, vec![cols as u64, rows as u64], raw)]);
            (cpu.matrix(&common::src(&f, "w")).unwrap(), g)
        } else {
            weight(&cpu, &gpu, GgmlType::Q8_0, cols, rows, 1, seed)
        };
        if repack {
            assert!(
                matches!(w.1, GpuWeight::Mat { dec: Some(_), .. }),
                "{cols}->{rows}: no decode-layout copy"
            );
        }
        let xs = randn(&mut rng(91 + si as u64), groups * cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cy = cpu.alloc(rows);
        let part = if si % 2 == 1 {
            Part::Expert(0)
        } else {
            Part::All
        };
        if groups > 1 {
            cpu.matmul_grouped(&w.0, groups, &cx, 1, &mut cy);
        } else {
            cpu.matmul(&w.0, part, &cx, 1, &mut cy);
        }
        let want = cpu.download(&cy, rows);
        // (mvr form, q8 form, mvx CTAs per SM, spread): the fixed mvr forms (r4u2, r2u2), off
        // (mvq), the old auto form (q8 form 0), the default (mvx_r4u2_q8_0 up to 1024 columns:
        // one batch per CTA), persistent mvx grids of 1 and 3 CTAs per SM (CTAs with several
        // batches), and spreads 1 and 64 (the fewest and most k-slices).
        let forms = [
            (1u8, 1u8, 255u8, 6u8),
            (2, 1, 255, 6),
            (0, 1, 255, 6),
            (255, 0, 255, 6),
            (255, 1, 255, 6),
            (255, 1, 1, 6),
            (255, 1, 3, 6),
            (255, 1, 255, 1),
            (255, 1, 1, 64),
        ];
        for (form, pf, ctas, spread) in forms {
            GpuBackend::set_matvec_repacked(form);
            GpuBackend::set_matvec_q8_form(pf, ctas);
            GpuBackend::set_matvec_mvx_spread(spread);
            let mut outs = Vec::new();
            for _ in 0..2 {
                let mut gy = gpu.upload(&vec![f32::NAN; rows]);
                if groups > 1 {
                    gpu.matmul_grouped(&w.1, groups, &gx, 1, &mut gy);
                } else {
                    gpu.matmul(&w.1, part, &gx, 1, &mut gy);
                }
                outs.push(gpu.download(&gy, rows));
            }
            let name = format!(
                "mvr form {form} q8 form {pf}/{ctas}/{spread} Q8_0 {groups}x{cols}->{rows} {part:?} synth {synth}"
            );
            cases.check(name.clone(), cols, &outs[0], &want, &gpu);
            let same = outs[0]
                .iter()
                .zip(&outs[1])
                .all(|(p, q)| p.to_bits() == q.to_bits());
            println!("{name}: repeat bitwise equal {same}");
            assert!(same, "{name}: results differ between runs");
        }
    }
    GpuBackend::set_matvec_repacked(255);
    GpuBackend::set_matvec_q8_form(1, 255);
    GpuBackend::set_matvec_mvx_spread(6);
    cases.finish();
}

/// Few-row F16 products with their columns split across CTAs (`set_matvec_split`, opt-in)
/// and whole: the HC mixers, the indexer projection, 3 rows, and ranges that end mid warp-step
/// (5120 columns: 4 ranges of 1280); every form of `set_matvec_one`.
#[test]
fn matvec_split() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    for (si, &(cols, rows)) in [
        (16384, 24),
        (16384, 4),
        (4096, 64),
        (4096, 3),
        (5120, 7),
        (2048, 100),
    ]
    .iter()
    .enumerate()
    {
        let w = weight(&cpu, &gpu, GgmlType::F16, cols, rows, 1, 1700 + si as u64);
        let xs = randn(&mut rng(31 + si as u64), cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cy = cpu.alloc(rows);
        cpu.matmul(&w.0, Part::All, &cx, 1, &mut cy);
        let want = cpu.download(&cy, rows);
        for split in [true, false] {
            GpuBackend::set_matvec_split(split);
            for form in [1u8, 2, 255] {
                GpuBackend::set_matvec_one(form);
                let mut gy = gpu.upload(&vec![f32::NAN; rows]);
                gpu.matmul(&w.1, Part::All, &gx, 1, &mut gy);
                let name = format!("F16 {cols}->{rows} split {split} form {form}");
                cases.check(name, cols, &gpu.download(&gy, rows), &want, &gpu);
            }
        }
    }
    GpuBackend::set_matvec_split(false);
    GpuBackend::set_matvec_one(255);
    cases.finish();
}

/// An n-token verify-step form (`mvrgun*`, `mvran*`): it ran (the `mvrn*` launch count grew past
/// `before`) exactly where the weights have interleaved copies (> 1024 columns in 512-column
/// tiles), and each token's `per` outputs in `all` are the bits of its own n = 1 launch (`one`).
fn tokens_as_one_launch(
    name: &str,
    cols: usize,
    before: u64,
    all: &[f32],
    per: usize,
    one: impl Fn(usize) -> Vec<f32>,
) {
    let il = cols > 1024 && cols.is_multiple_of(512);
    assert_eq!(
        GpuBackend::mvrn_launches() > before,
        il,
        "{name}: the n-token form runs on interleaved copies only"
    );
    for t in 0..all.len() / per {
        let same = one(t)
            .iter()
            .zip(&all[t * per..(t + 1) * per])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: token {t} differs from its n = 1 launch");
    }
}

/// Merged n = 1 products (`matmul_multi`: `mvrm_*` on decode copies, `mvqm_*` on F16/Q8_0
/// rows; `matmul_gateup`: `mvrgu_*`) against the CPU's default composition, merged and with
/// `set_matvec_merge(false)`: the model's sets (q_a + kv; compressor + indexer projections),
/// odd row counts (CTAs of a matrix partly empty), one-row matrices, column counts ending mid
/// warp-step, 5 Q8_0 matrices (`mvqm_*_q8_0` on the GGUF blocks), more matrices than one launch
/// takes (falls back), n = 2 (falls back), and the shared expert's gate/up with a clamp that cuts
/// (0.5) and one that does not, at n = 2..4 (`mvrgun2` / `mvrgun4` on interleaved copies, each
/// token bitwise equal to its n = 1 launch).
#[test]
fn matvec_merged() {
    ds4_gpu::GpuBackend::set_matvec(true);
    // The n-token verify-step forms (opt-in in the engine) under test here.
    GpuBackend::set_matvec_mvxn_tok(true);
    GpuBackend::set_matvec_mvn(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    // (type, cols, rows of each matrix, n)
    let sets: &[(GgmlType, usize, &[usize], usize)] = &[
        (GgmlType::Q8_0, 4096, &[1024, 512], 1),
        (GgmlType::Q8_0, 1056, &[37, 70, 1, 5], 1),
        (GgmlType::Q8_0, 1056, &[37, 70, 1, 5, 33], 1),
        (GgmlType::Q8_0, 1056, &[37, 70, 1, 5, 33, 2], 1),
        (GgmlType::Q8_0, 4096, &[3, 4099], 1),
        (GgmlType::F16, 4096, &[1024, 1024, 256, 256, 64], 1),
        (GgmlType::F16, 4096, &[512, 512], 1),
        (GgmlType::F16, 1056, &[7, 1, 70], 1),
        (GgmlType::F16, 96, &[3, 5, 7, 9, 11], 1),
        (GgmlType::F16, 96, &[3, 5, 7, 9, 11, 13, 15], 1),
        (GgmlType::Q8_0, 1024, &[64, 32], 2),
        // 2-4-token steps: F16 sets once per token by the n = 1 merged form
        (GgmlType::F16, 4096, &[1024, 1024, 256, 256, 64], 2),
        (GgmlType::F16, 4096, &[512, 512], 3),
        (GgmlType::F16, 1056, &[7, 1, 70], 4),
        (GgmlType::F16, 96, &[3, 5, 7, 9, 11], 2),
    ];
    for (si, &(ty, cols, rows, n)) in sets.iter().enumerate() {
        let ws: Vec<Pair> = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| weight(&cpu, &gpu, ty, cols, r, 1, 1900 + 10 * si as u64 + i as u64))
            .collect();
        let xs = randn(&mut rng(77 + si as u64), n * cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut cys: Vec<_> = rows.iter().map(|&r| cpu.alloc(n * r)).collect();
        let cws: Vec<_> = ws.iter().map(|w| &w.0).collect();
        let mut crefs: Vec<_> = cys.iter_mut().collect();
        cpu.matmul_multi(&cws, &cx, n, &mut crefs);
        let want: Vec<Vec<f32>> = cys
            .iter()
            .zip(rows)
            .map(|(y, &r)| cpu.download(y, n * r))
            .collect();
        // merged by mvxm (grids of 3 and 1 CTAs per SM), by the old mvrm/mvqm, one by one
        for (merge, xf, ctas) in [(true, 1u8, 3u8), (true, 1, 1), (true, 0, 3), (false, 1, 3)] {
            GpuBackend::set_matvec_merge(merge);
            GpuBackend::set_matvec_q8_form(xf, ctas);
            // most k-slices with one CTA per SM (persistent), else the default plan
            GpuBackend::set_matvec_mvx_spread(if ctas == 1 { 64 } else { 6 });
            let mut gys: Vec<_> = rows
                .iter()
                .map(|&r| gpu.upload(&vec![f32::NAN; n * r]))
                .collect();
            let gws: Vec<_> = ws.iter().map(|w| &w.1).collect();
            let mut grefs: Vec<_> = gys.iter_mut().collect();
            gpu.matmul_multi(&gws, &gx, n, &mut grefs);
            for (i, (&r, y)) in rows.iter().zip(&gys).enumerate() {
                let name =
                    format!("multi {ty:?} {cols}->{rows:?}[{i}] n={n} merge {merge} x {xf}/{ctas}");
                cases.check(name, cols, &gpu.download(y, n * r), &want[i], &gpu);
            }
        }
    }
    // Shared expert gate/up + SwiGLU: (cols, ff, clamp, n)
    for (si, &(cols, ff, clamp, n)) in [
        (4096usize, 2048usize, 10.0f32, 1usize),
        (4096, 2048, 0.5, 1),
        (1056, 37, 1.0, 1),
        (96, 1, 3.0, 1),
        (1024, 64, 1.0, 2),
        // 2-4-token steps: mvrgun2 / mvrgun4 on interleaved copies (> 1024 columns in 512-column
        // tiles), else the fused form once per token
        (4096, 2048, 0.5, 2),
        (2048, 33, 2.0, 3),
        (4096, 64, 1.0, 4),
        (1056, 37, 1.0, 3),
        (96, 1, 3.0, 4),
    ]
    .iter()
    .enumerate()
    {
        let g = weight(&cpu, &gpu, GgmlType::Q8_0, cols, ff, 1, 2100 + si as u64);
        let u = weight(&cpu, &gpu, GgmlType::Q8_0, cols, ff, 1, 2200 + si as u64);
        let xs = randn(&mut rng(177 + si as u64), n * cols, 1.0);
        let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
        let mut ch = cpu.alloc(n * ff);
        cpu.matmul_gateup(&g.0, &u.0, &cx, n, ff, &mut ch, clamp);
        let want = cpu.download(&ch, n * ff);
        for (merge, xf, ctas) in [(true, 1u8, 3u8), (true, 1, 1), (true, 0, 3), (false, 1, 3)] {
            GpuBackend::set_matvec_merge(merge);
            GpuBackend::set_matvec_q8_form(xf, ctas);
            GpuBackend::set_matvec_mvx_spread(if ctas == 1 { 64 } else { 6 });
            let mut gh = gpu.upload(&vec![f32::NAN; n * ff]);
            gpu.matmul_gateup(&g.1, &u.1, &gx, n, ff, &mut gh, clamp);
            // silu(g)·u carries the rounding of both sums, each scaled by the other factor
            // (H200: 2.3e-4 merged, 2.0e-4 by the separate products at 4096 columns): 4x TOL.
            let name =
                format!("gateup Q8_0 {cols}->{ff} clamp {clamp} n={n} merge {merge} x {xf}/{ctas}");
            cases.check_scaled(name, cols, &gpu.download(&gh, n * ff), &want, &gpu, 4.0);
        }
        if n > 1 {
            // Defaults: every token's h the bits of its own n = 1 launch (mvrgun's promise).
            GpuBackend::set_matvec_merge(true);
            GpuBackend::set_matvec_q8_form(1, 255);
            GpuBackend::set_matvec_mvx_spread(6);
            let before = GpuBackend::mvrn_launches();
            let mut gh = gpu.upload(&vec![f32::NAN; n * ff]);
            gpu.matmul_gateup(&g.1, &u.1, &gx, n, ff, &mut gh, clamp);
            let all = gpu.download(&gh, n * ff);
            tokens_as_one_launch(
                &format!("gateup {cols}->{ff} n={n} (mvrgun)"),
                cols,
                before,
                &all,
                ff,
                |t| {
                    let one = gpu.upload(&xs[t * cols..(t + 1) * cols]);
                    let mut oh = gpu.upload(&vec![f32::NAN; ff]);
                    gpu.matmul_gateup(&g.1, &u.1, &one, 1, ff, &mut oh, clamp);
                    gpu.download(&oh, ff)
                },
            );
        }
    }
    GpuBackend::set_matvec_merge(true);
    GpuBackend::set_matvec_q8_form(1, 255);
    GpuBackend::set_matvec_mvx_spread(6);
    cases.finish();
}

/// The decode fusions (`Backend::rms_norm_matmul`: the query's low-rank norm folded into q_b's
/// `mvxn_r4u2_q8_0` (row totals scaled by the norm); `Backend::matmul_add`: the shared down product added into the
/// routed sum by `mvra_r2u2_q8_0`) against the CPU reference (the trait defaults: norm then
/// product, product then add), with shapes the fused kernels take (Q8_0 decode copies, n = 1,
/// <= 1024 columns for the norm, > 1024 for the add; at n = 2..4 the norm's n-token form
/// `mvxn2` / `mvxn4`, bitwise equal to `mvxn` once per token, and the add's `mvran2` / `mvran4`
/// on interleaved copies, bitwise equal to `mvra` once per token) and
/// shapes that fall back (longer or shorter rows): the product, the normed x left in `x`, and
/// the sum; each GPU run twice, bitwise equal.
#[test]
fn matvec_fused() {
    ds4_gpu::GpuBackend::set_matvec(true);
    // The n-token verify-step forms (opt-in in the engine) under test here.
    GpuBackend::set_matvec_mvxn_tok(true);
    GpuBackend::set_matvec_mvn(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    let mut cases = Cases::default();
    let eps = 1e-6;
    // (cols, rows, n): the real q_b (1024 -> 32768) and indexer-free shapes, a ragged row
    // count, short rows, a fallback (2048 columns), and 2-4-token steps (the fused form per
    // token, the normed rows gathered into x).
    let norm_shapes: &[(usize, usize, usize)] = &[
        (1024, 32768, 1),
        (1024, 4099, 1),
        (512, 70, 1),
        (96, 33, 1),
        (1024, 300, 2),
        (2048, 64, 1),
        // 2-4-token steps: the fused form once per token
        (1024, 32768, 2),
        (1024, 4099, 3),
        (512, 70, 4),
    ];
    for (si, &(cols, rows, n)) in norm_shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, GgmlType::Q8_0, cols, rows, 1, 2100 + si as u64);
        let xs = randn(&mut rng(2200 + si as u64), n * cols, 3.0);
        let nv = randn(&mut rng(2300 + si as u64), cols, 1.0);
        let f = common::file(&[(
            "v",
            GgmlType::F32,
            vec![cols as u64],
            common::f32_bytes(&nv),
        )]);
        let (nc, ng) = (
            cpu.vector(&common::src(&f, "v")).unwrap(),
            gpu.vector(&common::src(&f, "v")).unwrap(),
        );
        let mut cx = cpu.upload(&xs);
        let mut cy = cpu.alloc(n * rows);
        cpu.rms_norm_matmul(&mut cx, n, cols, Some(&nc), eps, &w.0, &mut cy);
        let (want_x, want_y) = (cpu.download(&cx, n * cols), cpu.download(&cy, n * rows));
        let run = || {
            let mut gx = gpu.upload(&xs);
            let mut gy = gpu.upload(&vec![f32::NAN; n * rows]);
            gpu.rms_norm_matmul(&mut gx, n, cols, Some(&ng), eps, &w.1, &mut gy);
            (gpu.download(&gx, n * cols), gpu.download(&gy, n * rows))
        };
        let before = GpuBackend::mvxn_tok_launches();
        let outs = [run(), run()];
        let name = format!("rms_norm_matmul Q8_0 {cols}->{rows} n={n}");
        cases.check(format!("{name} x"), cols, &outs[0].0, &want_x, &gpu);
        cases.check(format!("{name} y"), cols, &outs[0].1, &want_y, &gpu);
        let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            bits(&outs[0].0, &outs[1].0) && bits(&outs[0].1, &outs[1].1),
            "{name}: results differ between runs"
        );
        if n > 1 && cols <= 1024 {
            // The n-token form (mvxn2 / mvxn4) ran, and each token's normed row and product are
            // the bits of the one-token form run once per token.
            assert!(
                GpuBackend::mvxn_tok_launches() >= before + 2,
                "{name}: mvxn{n} did not run"
            );
            GpuBackend::set_matvec_mvxn_tok(false);
            let per = run();
            GpuBackend::set_matvec_mvxn_tok(true);
            let same = bits(&outs[0].0, &per.0) && bits(&outs[0].1, &per.1);
            println!("{name}: n-token form bitwise equal to per-token mvxn: {same}");
            assert!(same, "{name}: the n-token form differs from mvxn per token");
        }
    }
    // (cols, rows, n): the real shared down (2048 -> 4096), a ragged row count, 1056 columns
    // (the mvr form), then fallbacks (<= 1024 columns: mvx; n = 2).
    let add_shapes: &[(usize, usize, usize)] = &[
        (2048, 4096, 1),
        (4096, 1027, 1),
        (1056, 70, 1),
        (512, 72, 1),
        (2048, 300, 2),
        // 2-4-token steps: mvra once per token
        (2048, 4096, 2),
        (4096, 1027, 3),
        (1056, 70, 4),
    ];
    for (si, &(cols, rows, n)) in add_shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, GgmlType::Q8_0, cols, rows, 1, 2400 + si as u64);
        let xs = randn(&mut rng(2500 + si as u64), n * cols, 1.0);
        let y0 = randn(&mut rng(2600 + si as u64), n * rows, 2.0);
        let cx = cpu.upload(&xs);
        let mut cy = cpu.upload(&y0);
        cpu.matmul_add(&w.0, &cx, n, rows, &mut cy);
        let want = cpu.download(&cy, n * rows);
        let gx = gpu.upload(&xs);
        let mut outs = Vec::new();
        for _ in 0..2 {
            let mut gy = gpu.upload(&y0);
            gpu.matmul_add(&w.1, &gx, n, rows, &mut gy);
            outs.push(gpu.download(&gy, n * rows));
        }
        let name = format!("matmul_add Q8_0 {cols}->{rows} n={n}");
        cases.check(name.clone(), cols, &outs[0], &want, &gpu);
        assert!(
            outs[0]
                .iter()
                .zip(&outs[1])
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{name}: results differ between runs"
        );
        if n > 1 {
            // mvran2 / mvran4 on interleaved copies: each token the bits of its n = 1 mvra.
            let before = GpuBackend::mvrn_launches();
            let mut gy = gpu.upload(&y0);
            gpu.matmul_add(&w.1, &gx, n, rows, &mut gy);
            let all = gpu.download(&gy, n * rows);
            tokens_as_one_launch(&format!("{name} (mvran)"), cols, before, &all, rows, |t| {
                let one = gpu.upload(&xs[t * cols..(t + 1) * cols]);
                let mut oy = gpu.upload(&y0[t * rows..(t + 1) * rows]);
                gpu.matmul_add(&w.1, &one, 1, rows, &mut oy);
                gpu.download(&oy, rows)
            });
        }
    }
    cases.finish();
}

/// The trait defaults of the fused ops on the CPU reference (no GPU needed): `rms_norm_matmul`
/// leaves the normed rows in `x` and equals `rms_norm` then `matmul`; `matmul_add` equals
/// `matmul` then `add` (bitwise: the same operations).
#[test]
fn fused_defaults_cpu() {
    let hp = HParams::tiny();
    let cpu = CpuBackend::new(ds4_model::forward::rope_tables(&hp));
    let (cols, rows, n) = (256, 40, 2);
    let mut r = rng(2700);
    let bytes: Vec<u8> = (0..rows)
        .flat_map(|_| ds4_gpu::conformance::random_row(GgmlType::Q8_0, cols, &mut r))
        .collect();
    let nv = randn(&mut r, cols, 1.0);
    let f = common::file(&[
        ("w", GgmlType::Q8_0, vec![cols as u64, rows as u64], bytes),
        (
            "v",
            GgmlType::F32,
            vec![cols as u64],
            common::f32_bytes(&nv),
        ),
    ]);
    let w = cpu.matrix(&common::src(&f, "w")).unwrap();
    let v = cpu.vector(&common::src(&f, "v")).unwrap();
    let xs = randn(&mut r, n * cols, 2.0);
    let y0 = randn(&mut r, n * rows, 1.0);

    let (mut xa, mut ya) = (cpu.upload(&xs), cpu.alloc(n * rows));
    cpu.rms_norm_matmul(&mut xa, n, cols, Some(&v), 1e-6, &w, &mut ya);
    let (mut xb, mut yb) = (cpu.upload(&xs), cpu.alloc(n * rows));
    cpu.rms_norm(&mut xb, n, cols, Some(&v), 1e-6);
    cpu.matmul(&w, Part::All, &xb, n, &mut yb);
    assert_eq!(cpu.download(&xa, n * cols), cpu.download(&xb, n * cols));
    assert_eq!(cpu.download(&ya, n * rows), cpu.download(&yb, n * rows));
    assert_ne!(cpu.download(&xa, n * cols), xs, "x is left normed");

    let x = cpu.upload(&xs);
    let mut ya = cpu.upload(&y0);
    cpu.matmul_add(&w, &x, n, rows, &mut ya);
    let (mut yb, mut t) = (cpu.upload(&y0), cpu.alloc(n * rows));
    cpu.matmul(&w, Part::All, &x, n, &mut t);
    cpu.add(&mut yb, &t, n * rows);
    assert_eq!(cpu.download(&ya, n * rows), cpu.download(&yb, n * rows));
    assert_ne!(cpu.download(&ya, n * rows), y0, "y is added to");
}

/// The interleaved decode layout (`set_matvec_q8_il`: copies made by `q8_repack_i`, products by
/// `mvr*_q8_0i`, `mvrm_*_q8_0i`, `mvrgu_*_q8_0i`, `mvra_*_q8_0i`) against an f64 reference of
/// the same blocks (and the plain layout's error beside it): the model's shapes (head rows cut),
/// both fixed mvr forms and the auto one, odd row counts, 1536 columns (3 tiles: a wave64 step
/// ends mid tile), grouped out_a, 16384 columns (k split), the merged q_a + kv and gate/up sets
/// and matmul_add; copies of <= 1024 columns or not whole tiles must stay plain. Each product run
/// twice (bitwise equal). Tolerance as `Cases` (TOL relative to 1 + |ref|, × sqrt(cols / 2048)).
/// Process-wide switches: run with --test-threads=1 on a GPU.
#[test]
fn matvec_interleaved() {
    use ds4_gpu::model::GpuWeight;
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((_cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    if std::env::var("DS4_GPU_Q8_REPACK").is_ok_and(|v| v == "off") {
        println!("skipped: DS4_GPU_Q8_REPACK=off makes no decode copies");
        return;
    }
    // Q8_0 rows with their f64 values, uploaded plain and interleaved.
    struct Q8 {
        vals: Vec<f64>,
        plain: GpuWeight,
        il: GpuWeight,
    }
    let make = |cols: usize, rows: usize, seed: u64| -> Q8 {
        let mut r = rng(seed);
        let bytes: Vec<u8> = (0..rows)
            .flat_map(|_| ds4_gpu::conformance::random_row(GgmlType::Q8_0, cols, &mut r))
            .collect();
        let vals: Vec<f64> = bytes
            .chunks(34)
            .flat_map(|b| {
                let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64();
                b[2..34].iter().map(move |&q| d * (q as i8) as f64)
            })
            .collect();
        let f = common::file(&[("w", GgmlType::Q8_0, vec![cols as u64, rows as u64], bytes)]);
        GpuBackend::set_matvec_q8_il(false);
        let plain = gpu.matrix(&common::src(&f, "w")).unwrap();
        GpuBackend::set_matvec_q8_il(true);
        let il = gpu.matrix(&common::src(&f, "w")).unwrap();
        GpuBackend::set_matvec_q8_il(false);
        let want_il = cols > 1024 && cols.is_multiple_of(512);
        for (w, on) in [(&plain, false), (&il, want_il)] {
            assert!(
                matches!(w, GpuWeight::Mat { dec: Some(_), dec_il, .. } if *dec_il == on),
                "{cols}->{rows}: decode copy missing or not in the {} layout",
                if on { "interleaved" } else { "plain" }
            );
        }
        Q8 { vals, plain, il }
    };
    // y[g·rows + r] = W[g·rows + r] . x[g·cols ..] in f64.
    let reference = |w: &Q8, cols: usize, rows: usize, groups: usize, x: &[f32]| -> Vec<f32> {
        let r = rows / groups;
        (0..rows)
            .map(|i| {
                let xo = (i / r) * cols;
                (0..cols)
                    .map(|k| w.vals[i * cols + k] * x[xo + k] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    let mut cases = Cases::default();
    // (cols, rows, groups)
    let shapes: &[(usize, usize, usize)] = &[
        (4096, 1024, 1),
        (8192, 4096, 1),
        (2048, 4096, 1),
        (4096, 8192, 8),
        (4096, 12928, 1),
        (16384, 40, 1),
        (4096, 3, 1),
        (4096, 4099, 1),
        (1536, 70, 1),
        (1024, 64, 1),
        (1056, 33, 1),
    ];
    for (si, &(cols, rows, groups)) in shapes.iter().enumerate() {
        let w = make(cols, rows, 3100 + si as u64);
        let xs = randn(&mut rng(3200 + si as u64), groups * cols, 1.0);
        let want = reference(&w, cols, rows, groups, &xs);
        let gx = gpu.upload(&xs);
        // (mvr form, pipelined): r4u2, r2u2, auto, r2u2 pipelined (mvr_r2u2_q8_0ip)
        for (form, pipe) in [(1u8, false), (2, false), (255, false), (2, true)] {
            GpuBackend::set_matvec_repacked(form);
            GpuBackend::set_matvec_mvr_pipe(pipe);
            for (lay, gw) in [("plain", &w.plain), ("il", &w.il)] {
                let mut outs = Vec::new();
                for _ in 0..2 {
                    let mut gy = gpu.upload(&vec![f32::NAN; rows]);
                    if groups > 1 {
                        gpu.matmul_grouped(gw, groups, &gx, 1, &mut gy);
                    } else {
                        gpu.matmul(gw, Part::All, &gx, 1, &mut gy);
                    }
                    outs.push(gpu.download(&gy, rows));
                }
                let name = format!(
                    "{lay} mvr form {form} pipe {pipe} Q8_0 {groups}x{cols}->{rows} vs f64"
                );
                cases.check(name.clone(), cols, &outs[0], &want, &gpu);
                assert!(
                    bits(&outs[0], &outs[1]),
                    "{name}: results differ between runs"
                );
            }
        }
    }
    GpuBackend::set_matvec_repacked(255);
    GpuBackend::set_matvec_mvr_pipe(false);
    // Merged sets (matmul_multi: mvrm) and gate/up (mvrgu).
    for (si, rows) in [&[1024usize, 512][..], &[3, 4099], &[37, 70, 1, 5]]
        .iter()
        .enumerate()
    {
        let cols = 4096;
        let ws: Vec<Q8> = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| make(cols, r, 3300 + 10 * si as u64 + i as u64))
            .collect();
        let xs = randn(&mut rng(3400 + si as u64), cols, 1.0);
        let gx = gpu.upload(&xs);
        for lay in ["plain", "il"] {
            let gws: Vec<&GpuWeight> = ws
                .iter()
                .map(|w| if lay == "il" { &w.il } else { &w.plain })
                .collect();
            let mut gys: Vec<_> = rows
                .iter()
                .map(|&r| gpu.upload(&vec![f32::NAN; r]))
                .collect();
            let mut grefs: Vec<_> = gys.iter_mut().collect();
            gpu.matmul_multi(&gws, &gx, 1, &mut grefs);
            for (i, (&r, y)) in rows.iter().zip(&gys).enumerate() {
                let want = reference(&ws[i], cols, r, 1, &xs);
                let name = format!("{lay} multi Q8_0 {cols}->{rows:?}[{i}] vs f64");
                cases.check(name, cols, &gpu.download(y, r), &want, &gpu);
            }
        }
    }
    for (si, &(cols, ff, clamp)) in [
        (4096usize, 2048usize, 10.0f32),
        (4096, 2048, 0.5),
        (2048, 37, 1.0),
    ]
    .iter()
    .enumerate()
    {
        let g = make(cols, ff, 3500 + si as u64);
        let u = make(cols, ff, 3600 + si as u64);
        let xs = randn(&mut rng(3700 + si as u64), cols, 1.0);
        let (gr, ur) = (
            reference(&g, cols, ff, 1, &xs),
            reference(&u, cols, ff, 1, &xs),
        );
        let want: Vec<f32> = gr
            .iter()
            .zip(&ur)
            .map(|(&a, &b)| {
                let a = (a as f64).min(clamp as f64);
                let b = (b as f64).clamp(-(clamp as f64), clamp as f64);
                (a / (1.0 + (-a).exp()) * b) as f32
            })
            .collect();
        let gx = gpu.upload(&xs);
        for (lay, gw, uw) in [("plain", &g.plain, &u.plain), ("il", &g.il, &u.il)] {
            let mut gh = gpu.upload(&vec![f32::NAN; ff]);
            gpu.matmul_gateup(gw, uw, &gx, 1, ff, &mut gh, clamp);
            let name = format!("{lay} gateup Q8_0 {cols}->{ff} clamp {clamp} vs f64");
            cases.check_scaled(name, cols, &gpu.download(&gh, ff), &want, &gpu, 4.0);
        }
    }
    // matmul_add (mvra): y0 + W·x.
    for (si, &(cols, rows)) in [(2048usize, 4096usize), (4096, 1027)].iter().enumerate() {
        let w = make(cols, rows, 3800 + si as u64);
        let xs = randn(&mut rng(3900 + si as u64), cols, 1.0);
        let y0 = randn(&mut rng(4000 + si as u64), rows, 2.0);
        let want: Vec<f32> = reference(&w, cols, rows, 1, &xs)
            .iter()
            .zip(&y0)
            .map(|(&a, &b)| (a as f64 + b as f64) as f32)
            .collect();
        let gx = gpu.upload(&xs);
        for (lay, gw) in [("plain", &w.plain), ("il", &w.il)] {
            let mut gy = gpu.upload(&y0);
            gpu.matmul_add(gw, &gx, 1, rows, &mut gy);
            let name = format!("{lay} matmul_add Q8_0 {cols}->{rows} vs f64");
            cases.check(name, cols, &gpu.download(&gy, rows), &want, &gpu);
        }
    }
    cases.finish();
}

/// Decode-layout Q8_0 products of n = 2..4 token rows (`mvrn2_*` / `mvrn4_*`: speculative
/// verify steps) against the CPU (TOL) and, token by token, bitwise against the n = 1 kernel of
/// the same form (`mvr_r2u2_q8_0[i]`: the same per-lane sums); the model's shapes (head rows
/// cut; interleaved and plain copies), odd row counts, a 32-column row, grouped attn out_a;
/// every product twice (bitwise equal); with `set_matvec_mvrn(false)` the staged / `mv<NT>`
/// form as before (TOL). Process-wide switches: run with --test-threads=1 on a GPU.
#[test]
fn matvec_repacked_tokens() {
    ds4_gpu::GpuBackend::set_matvec(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    if std::env::var("DS4_GPU_Q8_REPACK").is_ok_and(|v| v == "off") {
        println!("skipped: DS4_GPU_Q8_REPACK=off (no decode-layout copies)");
        return;
    }
    let mut cases = Cases::default();
    // (cols, rows, groups)
    let shapes: &[(usize, usize, usize)] = &[
        (1024, 32768, 1),
        (8192, 4096, 1),
        (4096, 2048, 1),
        (2048, 4096, 1),
        (4096, 12928, 1),
        (4096, 8192, 8),
        (4096, 3, 1),
        (4096, 4099, 1),
        (1056, 70, 1),
        (32, 5, 1),
    ];
    for (si, &(cols, rows, groups)) in shapes.iter().enumerate() {
        let w = weight(&cpu, &gpu, GgmlType::Q8_0, cols, rows, 1, 2600 + si as u64);
        for n in 2..=4usize {
            let xs = randn(
                &mut rng(2700 + si as u64 * 4 + n as u64),
                n * groups * cols,
                1.0,
            );
            let (cx, gx) = (cpu.upload(&xs), gpu.upload(&xs));
            let run = |b: &dyn Fn(&mut <GpuBackend as Backend>::Buf)| {
                let mut gy = gpu.upload(&vec![f32::NAN; n * rows]);
                b(&mut gy);
                gpu.download(&gy, n * rows)
            };
            let mut cy = cpu.alloc(n * rows);
            if groups > 1 {
                cpu.matmul_grouped(&w.0, groups, &cx, n, &mut cy);
            } else {
                cpu.matmul(&w.0, Part::All, &cx, n, &mut cy);
            }
            let want = cpu.download(&cy, n * rows);
            let product = |x: &<GpuBackend as Backend>::Buf, m: usize| {
                run(&|gy| {
                    if groups > 1 {
                        gpu.matmul_grouped(&w.1, groups, x, m, gy);
                    } else {
                        gpu.matmul(&w.1, Part::All, x, m, gy);
                    }
                })
            };
            let before = GpuBackend::mvrn_launches();
            GpuBackend::set_matvec_mvrn_rows(2);
            let got = product(&gx, n);
            let again = product(&gx, n);
            let name = format!("mvrn Q8_0 {groups}x{cols}->{rows} n {n}");
            assert!(
                GpuBackend::mvrn_launches() >= before + 2,
                "{name}: mvrn did not run"
            );
            // The bound of the one-row tests, 1.5x: the max over n token rows of the same
            // rounding (n times the samples; the bitwise check below ties each row to n = 1).
            cases.check_scaled(name.clone(), cols, &got, &want, &gpu, 1.5);
            assert!(
                got.iter()
                    .zip(&again)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{name}: results differ between runs"
            );
            // One row a warp (the default, DS4_GPU_MVRN_R=1; interleaved copies): the same bits
            // as two rows a warp (DS4_GPU_MVRN_R=2).
            GpuBackend::set_matvec_mvrn_rows(1);
            let one_row = product(&gx, n);
            assert!(
                got.iter()
                    .zip(&one_row)
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{name}: one row a warp differs from two"
            );
            // Token by token through the n = 1 kernel of the same form (r2u2, no mvx).
            GpuBackend::set_matvec_repacked(2);
            GpuBackend::set_matvec_q8_form(0, 255);
            for t in 0..n {
                let one = gpu.upload(&xs[t * groups * cols..(t + 1) * groups * cols]);
                let alone = product(&one, 1);
                let same = alone
                    .iter()
                    .zip(&got[t * rows..(t + 1) * rows])
                    .all(|(p, q)| p.to_bits() == q.to_bits());
                println!("{name}: token {t} bitwise equal to n = 1: {same}");
                assert!(same, "{name}: token {t} differs from its n = 1 product");
            }
            GpuBackend::set_matvec_repacked(255);
            GpuBackend::set_matvec_q8_form(1, 255);
            GpuBackend::set_matvec_mvrn(false);
            let old = product(&gx, n);
            GpuBackend::set_matvec_mvrn(true);
            cases.check_scaled(format!("{name} (mvrn off)"), cols, &old, &want, &gpu, 1.5);
        }
    }
    cases.finish();
}

/// F16 `matmul_multi` sets of 2-4 token rows: the compressor + indexer set (on `mvxm`) at n = 2
/// in one launch (`mvxm2`), else the merged n = 1 kernel once per token: each token's outputs
/// bitwise the n = 1 product of that token alone (and `matvec_merged` holds them to the CPU).
/// The compressor + indexer set and the HCA pair.
#[test]
fn matvec_merged_tokens() {
    ds4_gpu::GpuBackend::set_matvec(true);
    // The n-token verify-step forms (opt-in in the engine) under test here.
    GpuBackend::set_matvec_mvxn_tok(true);
    GpuBackend::set_matvec_mvn(true);
    let Some((cpu, gpu)) = backends(&HParams::tiny()) else {
        return;
    };
    for (si, rows) in [&[1024usize, 1024, 256, 256, 64][..], &[512, 512]]
        .iter()
        .enumerate()
    {
        let cols = 4096;
        let ws: Vec<Pair> = rows
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                weight(
                    &cpu,
                    &gpu,
                    GgmlType::F16,
                    cols,
                    r,
                    1,
                    2900 + 10 * si as u64 + i as u64,
                )
            })
            .collect();
        let gws: Vec<_> = ws.iter().map(|w| &w.1).collect();
        let run = |x: &[f32], n: usize| -> Vec<Vec<f32>> {
            let gx = gpu.upload(x);
            let mut gys: Vec<_> = rows
                .iter()
                .map(|&r| gpu.upload(&vec![f32::NAN; n * r]))
                .collect();
            let mut grefs: Vec<_> = gys.iter_mut().collect();
            gpu.matmul_multi(&gws, &gx, n, &mut grefs);
            gys.iter()
                .zip(rows.iter())
                .map(|(y, &r)| gpu.download(y, n * r))
                .collect()
        };
        for n in 2..=4usize {
            let xs = randn(&mut rng(3000 + 10 * si as u64 + n as u64), n * cols, 1.0);
            let before = GpuBackend::mvrn_launches();
            let all = run(&xs, n);
            assert_eq!(
                GpuBackend::mvrn_launches() > before,
                si == 0 && n == 2,
                "set {si} n {n}: mvxm2 runs the mvxm set at n = 2 only"
            );
            for t in 0..n {
                let one = run(&xs[t * cols..(t + 1) * cols], 1);
                for (m, &r) in rows.iter().enumerate() {
                    let same = one[m]
                        .iter()
                        .zip(&all[m][t * r..(t + 1) * r])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "set {si} n {n}: token {t}, matrix {m} differs from n = 1"
                    );
                }
            }
        }
    }
}
