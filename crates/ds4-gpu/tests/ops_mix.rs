//! The model glue ops (embed, hc_split, hc_collapse, hc_post, moe_route) on the GPU against the
//! CPU reference, op by op on random inputs at tiny (D 256, 16 experts) and full (D 4096, 256
//! experts) shapes. Skips with the reason when no GPU is present (DS4_REQUIRE_GPU=1: fail).
//!
//! The kernels do the CPU's f32 operations in the CPU's order, so differences come only from
//! exp/log1p (libm vs device, at most an ulp): embed is exact, the rest held to 1e-5 relative,
//! router selections exactly. The fused ops (hc_pre_norm, hc_post_pre_norm, norm_rope) run
//! fused, without the post fusion and unfused (`GpuBackend::set_fuse`).
//!
//! Every case runs on all three kernel forms: the glue forms (default), the latency forms
//! (`DS4_GPU_MIX=fast`) and the simple ones (`DS4_GPU_MIX=simple`), switched here process-wide
//! through `GpuBackend::set_mix_form`, so the tests take a lock and run one at a time.

mod common;

use common::{assert_close, backends, f32_bytes, file, max_rel, randn, rng, src};
use ds4_backend::{Backend, GgmlType, HcDims, MoeSpec, Part};
use ds4_cpu::CpuBackend;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use rand::Rng;
use std::sync::Mutex;

const TOL: f32 = 1e-5;

/// Serialises the tests: the kernel form is a process-wide switch.
static FORM: Mutex<()> = Mutex::new(());

/// Run `f(form)` on the glue, latency (with the wide and the v1 fused forms: rms_norm differs)
/// and simple forms; leaves the defaults (fast, lat) set.
fn both_forms(mut f: impl FnMut(&str)) {
    let _g = FORM.lock().unwrap_or_else(|e| e.into_inner());
    for form in ["glue", "fast", "fast-v1", "simple"] {
        let (mix, fuse) = form.split_once('-').unwrap_or((form, "lat"));
        GpuBackend::set_mix_form(mix);
        GpuBackend::set_fuse_form(fuse);
        f(form);
    }
    GpuBackend::set_mix_form("fast");
    GpuBackend::set_fuse_form("lat");
}

fn setup() -> Option<(CpuBackend, GpuBackend)> {
    backends(&HParams::tiny())
}

/// Both backends' bindings of one f32 vector.
fn vectors(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    v: &[f32],
) -> (
    <CpuBackend as Backend>::Weight,
    <GpuBackend as Backend>::Weight,
) {
    let f = file(&[("v", GgmlType::F32, vec![v.len() as u64], f32_bytes(v))]);
    (
        cpu.vector(&src(&f, "v")).unwrap(),
        gpu.vector(&src(&f, "v")).unwrap(),
    )
}

fn gpu_ok(gpu: &GpuBackend, op: &str) {
    if let Err(e) = gpu.check() {
        panic!("{op}: GPU error: {e}");
    }
}

fn hc(nh: usize, d: usize) -> HcDims {
    let hp = HParams::tiny();
    HcDims {
        n: nh,
        d,
        sinkhorn_iters: hp.hc_sinkhorn_iters as usize,
        eps: hp.hc_eps,
    }
}

/// Table bytes of `rows × cols` values of type `ty` (random) for the GGUF.
fn table_bytes(r: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let vals = randn(r, rows * cols, 2.0);
    match ty {
        GgmlType::F32 => f32_bytes(&vals),
        GgmlType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => {
            let mut out = Vec::new();
            for _ in 0..rows * cols / 32 {
                let d = half::f16::from_f32(r.gen_range(1e-3f32..0.05));
                out.extend_from_slice(&d.to_le_bytes());
                out.extend((0..32).map(|_| r.gen_range(-127i32..=127) as i8 as u8));
            }
            out
        }
        _ => unreachable!(),
    }
}

#[test]
fn embed_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(1);
        for (d, vocab) in [(256usize, 512usize), (4096, 64)] {
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
                let bytes = table_bytes(&mut r, ty, vocab, d);
                let f = file(&[("embd", ty, vec![d as u64, vocab as u64], bytes)]);
                let (tc, tg) = (
                    cpu.matrix(&src(&f, "embd")).unwrap(),
                    gpu.matrix(&src(&f, "embd")).unwrap(),
                );
                let n = 7;
                let mut toks: Vec<i32> = (0..n).map(|_| r.gen_range(0..vocab as i32)).collect();
                toks[3] = toks[1]; // a repeated id
                toks[5] = vocab as i32 - 1;
                for copies in [1usize, 4] {
                    let len = n * copies * d;
                    let mut oc = cpu.alloc(len);
                    cpu.embed(&tc, &cpu.upload_i32(&toks), n, copies, d, &mut oc);
                    let mut og = gpu.alloc(len);
                    gpu.embed(&tg, &gpu.upload_i32(&toks), n, copies, d, &mut og);
                    let og = gpu.download(&og, len);
                    gpu_ok(&gpu, "embed");
                    assert_close(
                        &format!("embed {form} {ty:?} d {d} ×{copies}"),
                        &og,
                        &oc,
                        0.0,
                    );
                }
            }
        }
    });
}

#[test]
fn hc_split_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(2);
        // Decode (1 token) and batches; N 4 (the model), 1..3 and 8; 70 and 130 tokens span several
        // Sinkhorn CTAs; d 260 a partial column CTA, d 4098 (not float4) the simple kernel.
        for (nh, d, n) in [
            (4usize, 256usize, 5usize),
            (4, 4096, 1),
            (4, 4096, 5),
            (8, 256, 3),
            (4, 256, 70),
            (4, 260, 130),
            (1, 256, 2),
            (2, 128, 3),
            (3, 4096, 1),
            (4, 4098, 2),
            (4, 4096, 20), // past one wave of 64-thread column CTAs: 256-thread CTAs
        ] {
            let h = hc(nh, d);
            let mix = (2 + nh) * nh;
            let (sc, sg) = vectors(&cpu, &gpu, &randn(&mut r, 3, 0.5));
            let (bc, bg) = vectors(&cpu, &gpu, &randn(&mut r, mix, 1.0));
            let m = randn(&mut r, n * mix, 3.0);
            let x = randn(&mut r, n * nh * d, 1.0);

            let (mut zc, mut pc, mut cc) =
                (cpu.alloc(n * d), cpu.alloc(n * nh), cpu.alloc(n * nh * nh));
            cpu.hc_split(h, &m, &sc, &bc, &x, n, &mut zc, &mut pc, &mut cc);
            let (mut zg, mut pg, mut cg) =
                (gpu.alloc(n * d), gpu.alloc(n * nh), gpu.alloc(n * nh * nh));
            gpu.hc_split(
                h,
                &gpu.upload(&m),
                &sg,
                &bg,
                &gpu.upload(&x),
                n,
                &mut zg,
                &mut pg,
                &mut cg,
            );
            let (zg, pg, cg) = (
                gpu.download(&zg, n * d),
                gpu.download(&pg, n * nh),
                gpu.download(&cg, n * nh * nh),
            );
            gpu_ok(&gpu, "hc_split");
            let what = format!("hc_split {form} N {nh} d {d} n {n}");
            assert_close(&format!("{what} post"), &pg, &pc, TOL);
            assert_close(&format!("{what} comb"), &cg, &cc, TOL);
            assert_close(&format!("{what} z"), &zg, &zc, TOL);
        }
    });
}

#[test]
fn hc_collapse_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(3);
        for (nh, d, n) in [
            (4usize, 256usize, 6usize),
            (4, 4096, 1),
            (4, 4096, 6),
            (8, 256, 3),
            (4, 260, 3),
            (3, 4096, 1),
            (4, 4096, 20),
        ] {
            let h = hc(nh, d);
            let (sc, sg) = vectors(&cpu, &gpu, &randn(&mut r, 1, 0.5));
            let (bc, bg) = vectors(&cpu, &gpu, &randn(&mut r, nh, 1.0));
            let m = randn(&mut r, n * nh, 3.0);
            let x = randn(&mut r, n * nh * d, 1.0);
            let mut yc = cpu.alloc(n * d);
            cpu.hc_collapse(h, &m, &sc, &bc, &x, n, &mut yc);
            let mut yg = gpu.alloc(n * d);
            gpu.hc_collapse(h, &gpu.upload(&m), &sg, &bg, &gpu.upload(&x), n, &mut yg);
            let yg = gpu.download(&yg, n * d);
            gpu_ok(&gpu, "hc_collapse");
            assert_close(
                &format!("hc_collapse {form} N {nh} d {d} n {n}"),
                &yg,
                &yc,
                TOL,
            );
        }
    });
}

#[test]
fn hc_post_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(4);
        // N 8 takes the simple kernel on both forms; d 4098 (not a multiple of 4) too.
        for (nh, d, n) in [
            (4usize, 256usize, 5usize),
            (4, 4096, 1),
            (4, 4096, 5),
            (8, 256, 3),
            (4, 4098, 2),
            (3, 260, 3),
            (4, 4096, 70),
        ] {
            let h = hc(nh, d);
            let x = randn(&mut r, n * nh * d, 1.0);
            let o = randn(&mut r, n * d, 1.0);
            let post: Vec<f32> = (0..n * nh).map(|_| r.gen_range(0.0..2.0)).collect();
            let comb: Vec<f32> = (0..n * nh * nh).map(|_| r.gen_range(0.0..1.0)).collect();
            let mut xc = x.clone();
            cpu.hc_post(h, &mut xc, &o, &post, &comb, n);
            let mut xg = gpu.upload(&x);
            gpu.hc_post(
                h,
                &mut xg,
                &gpu.upload(&o),
                &gpu.upload(&post),
                &gpu.upload(&comb),
                n,
            );
            let xg = gpu.download(&xg, n * nh * d);
            gpu_ok(&gpu, "hc_post");
            assert_close(&format!("hc_post {form} N {nh} d {d} n {n}"), &xg, &xc, TOL);
        }
    });
}

/// Router logits and bias for `n` tokens over `ne` experts, with ties and extremes: token 0 all
/// logits equal (with `flat` bias every key ties), token 1 a tied group {3, 7, 9, 12} inside the
/// top k, token 2 logits past the softplus cut (> 20) and far below it (p = 0), the rest random.
fn router_inputs(r: &mut impl Rng, n: usize, ne: usize, flat: bool) -> (Vec<f32>, Vec<f32>) {
    let mut lg = randn(r, n * ne, 4.0);
    let mut bias = if flat {
        vec![0.05; ne]
    } else {
        randn(r, ne, 0.1)
    };
    lg[..ne].iter_mut().for_each(|v| *v = 0.5);
    for e in [9usize, 3, 12, 7] {
        lg[ne + e] = 8.0;
        if !flat {
            bias[e] = 0.25;
        }
    }
    for (j, v) in lg[2 * ne..3 * ne].iter_mut().enumerate() {
        match j % 4 {
            0 => *v = 25.0 + j as f32 * 0.01,
            1 => *v = -100.0,
            _ => {}
        }
    }
    (lg, bias)
}

/// Bit patterns, for bit-for-bit comparisons of f32 outputs.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A hash router's `tid2eid` table (`[vocab][k]` random expert ids < `ne`) on both backends.
fn hash_table(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    r: &mut impl Rng,
    vocab: usize,
    k: usize,
    ne: usize,
) -> (
    <CpuBackend as Backend>::Weight,
    <GpuBackend as Backend>::Weight,
) {
    let tab: Vec<i32> = (0..vocab * k).map(|_| r.gen_range(0..ne as i32)).collect();
    let f = file(&[(
        "tid2eid",
        GgmlType::I32,
        vec![k as u64, vocab as u64],
        tab.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )]);
    (
        cpu.table(&src(&f, "tid2eid")).unwrap(),
        gpu.table(&src(&f, "tid2eid")).unwrap(),
    )
}

#[test]
fn moe_route_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(5);
        for (ne, k) in [(16usize, 6usize), (256, 6), (256, 8), (1024, 16)] {
            let spec = MoeSpec {
                n_expert: ne,
                n_used: k,
                d: 256,
                ff: 256,
                weight_scale: 1.5,
                clamp: 10.0,
            };
            let (n, vocab) = (9, 64);
            let toks: Vec<i32> = (0..n).map(|_| r.gen_range(0..vocab as i32)).collect();
            let (tc, tg) = hash_table(&cpu, &gpu, &mut r, vocab, k, ne);
            for (hash, flat) in [(false, false), (false, true), (true, false)] {
                let (lg, bias) = router_inputs(&mut r, n, ne, flat);
                let (bc, bg) = vectors(&cpu, &gpu, &bias);
                let (mut sc, mut wc) = (cpu.alloc_i32(n * k), cpu.alloc(n * k));
                let tcs = hash.then_some(&tc);
                cpu.moe_route(&spec, &lg, Some(&bc), tcs, &toks, n, &mut sc, &mut wc);
                let (mut sg, mut wg) = (gpu.alloc_i32(n * k), gpu.alloc(n * k));
                let tgs = hash.then_some(&tg);
                let (lgg, tokg) = (gpu.upload(&lg), gpu.upload_i32(&toks));
                gpu.moe_route(&spec, &lgg, Some(&bg), tgs, &tokg, n, &mut sg, &mut wg);
                let (sg, wg) = (gpu.download_i32(&sg, n * k), gpu.download(&wg, n * k));
                gpu_ok(&gpu, "moe_route");
                let what =
                    format!("moe_route {form} {k} of {ne} experts, hash {hash}, flat bias {flat}");
                assert_eq!(sg, sc, "{what}: selections differ");
                if flat {
                    let first: Vec<i32> = (0..k as i32).collect();
                    assert_eq!(&sc[..k], &first[..], "{what}: full tie");
                }
                if !hash {
                    assert_eq!(&sc[k..k + 4], &[3, 7, 9, 12], "{what}: tied group");
                }
                assert_close(&format!("{what}: weights"), &wg, &wc, TOL);
            }
        }
    });
}

#[test]
fn elementwise_matches_cpu() {
    let Some((cpu, gpu)) = setup() else { return };
    both_forms(|form| {
        let mut r = rng(6);
        // d 16384 is the HC norm's one N·D row in decode; 250 (not a multiple of 4) and 20000 (past
        // the float4 kernel's limit) take the simple kernel on both forms.
        for (d, rows) in [
            (256usize, 5usize),
            (4096, 5),
            (16384, 1),
            (16384, 3),
            (128, 40),
            (512, 64),
            (1024, 1),
            (8192, 2),
            (12, 3),
            (250, 3),
            (20000, 2),
        ] {
            let len = rows * d;
            let (a, b) = (randn(&mut r, len, 3.0), randn(&mut r, len, 3.0));

            let mut yc = a.clone();
            cpu.add(&mut yc, &b, len);
            let mut yg = gpu.upload(&a);
            gpu.add(&mut yg, &gpu.upload(&b), len);
            assert_close(
                &format!("add {form} d {d}"),
                &gpu.download(&yg, len),
                &yc,
                0.0,
            );

            let (wc, wg) = vectors(&cpu, &gpu, &randn(&mut r, d, 1.5));
            for weighted in [false, true] {
                let mut xc = a.clone();
                cpu.rms_norm(&mut xc, rows, d, weighted.then_some(&wc), 1e-6);
                let mut xg = gpu.upload(&a);
                gpu.rms_norm(&mut xg, rows, d, weighted.then_some(&wg), 1e-6);
                let xg = gpu.download(&xg, len);
                assert_close(
                    &format!("rms_norm {form} d {d} rows {rows} weighted {weighted}"),
                    &xg,
                    &xc,
                    TOL,
                );
            }

            let mut gc = a.clone();
            cpu.swiglu(&mut gc, &b, len, 1.0);
            let mut gg = gpu.upload(&a);
            gpu.swiglu(&mut gg, &gpu.upload(&b), len, 1.0);
            let gg = gpu.download(&gg, len);
            gpu_ok(&gpu, "elementwise");
            assert_close(&format!("swiglu {form} d {d}"), &gg, &gc, TOL);
        }
    });
}

/// Run `f(form)` with the fused glue on (latency kernels, then the v1 ones), without the post
/// fusion, off (`DS4_GPU_FUSE=off`: the separate ops), and on with the composed ops for
/// prefill (`on-composed`: `set_hcp("off")`; else n > 4 takes the hcp_mix + hcp_finish
/// kernels); leaves it on, lat, hcp on.
fn fuse_forms(mut f: impl FnMut(&str)) {
    let _g = FORM.lock().unwrap_or_else(|e| e.into_inner());
    for (form, fuse, kind, hcp) in [
        ("on", "on", "lat", "on"),
        ("on-v1", "on", "v1", "on"),
        ("nopost", "nopost", "lat", "on"),
        ("off", "off", "lat", "on"),
        ("on-composed", "on", "lat", "off"),
    ] {
        GpuBackend::set_fuse(fuse);
        GpuBackend::set_fuse_form(kind);
        GpuBackend::set_hcp(hcp);
        f(form);
    }
    GpuBackend::set_fuse("on");
    GpuBackend::set_fuse_form("lat");
    GpuBackend::set_hcp("on");
}

/// The fused HC pre + norm differs from the CPU in the order of the mixer dot products (and
/// scales them after the sum): close, not equal (H200: <= 1e-6 at n <= 4). The unfused form's
/// 16384-column mixer product at n = 5 (the GPU matmul) differed by 3.5e-4 in z.
const TOL_FUSED: f32 = 1e-3;

#[test]
fn hc_pre_norm_matches_cpu() {
    // Decode n 1..4 fused (N 1..4, f16/f32/bf16 mixers); n 5, 17, 33, 257, 300 (prefill) take
    // hcp_mix + hcp_finish (128 tokens a tile: 257 and 300 span three), or the separate ops.
    let mut cases = Vec::new();
    for n in [1usize, 2, 3, 4, 5, 17] {
        cases.push((4usize, 4096usize, n, GgmlType::F16));
    }
    cases.extend([
        (4, 4096, 300, GgmlType::F16),
        (4, 4096, 257, GgmlType::BF16),
        (4, 4096, 33, GgmlType::F32),
        (4, 256, 300, GgmlType::F32),
        (4, 256, 33, GgmlType::BF16),
        (1, 256, 9, GgmlType::F16),
        (2, 128, 17, GgmlType::F16),
        (3, 4096, 7, GgmlType::F16),
        (4, 256, 1, GgmlType::F32),
        (4, 256, 3, GgmlType::BF16),
        (4, 256, 17, GgmlType::F32),
        (1, 256, 2, GgmlType::F16),
        (2, 128, 3, GgmlType::F16),
        (3, 4096, 1, GgmlType::F16),
    ]);
    hc_pre_norm_cases(&cases);
}

/// D = 258: the HC mixer's width N·D = 1032 is not a multiple of 32. The GPU weight products
/// walk rows in 32-column chunks (they once dropped the tail here: `post` off by 3.7e-2 on the
/// H200), so a product over such a matrix is refused with an error that names the width; the
/// model's widths are multiples of 32.
#[test]
fn unaligned_product_width_is_refused() {
    let Some((_cpu, gpu)) = setup() else { return };
    let (nh, d) = (4, 258);
    let (mix, w) = ((2 + nh) * nh, nh * d);
    let f = file(&[(
        "mx",
        GgmlType::F32,
        vec![w as u64, mix as u64],
        table_bytes(&mut rng(7), GgmlType::F32, mix, w),
    )]);
    let m = gpu.matrix(&src(&f, "mx")).unwrap();
    for n in [1, 5, 300] {
        let x = gpu.upload(&randn(&mut rng(8), n * w, 1.0));
        let mut y = gpu.alloc(n * mix);
        gpu.matmul(&m, Part::All, &x, n, &mut y);
        let e = gpu.check().expect_err("a 1032-column product is refused");
        assert!(e.contains("1032 columns"), "n {n}: {e}");
    }
}

type CpuW = <CpuBackend as Backend>::Weight;
type GpuW = <GpuBackend as Backend>::Weight;

/// An HC block's weights on both backends: mixer ((2+N)·N rows of N·D, type `ty`), scale (3),
/// base ((2+N)·N) and the sublayer norm (D), drawn from `r` in that order.
struct HcWeights {
    mc: CpuW,
    mg: GpuW,
    sc: CpuW,
    sg: GpuW,
    bc: CpuW,
    bg: GpuW,
    nc: CpuW,
    ng: GpuW,
}

fn hc_weights(
    cpu: &CpuBackend,
    gpu: &GpuBackend,
    r: &mut impl Rng,
    nh: usize,
    d: usize,
    ty: GgmlType,
) -> HcWeights {
    let (mix, w) = ((2 + nh) * nh, nh * d);
    let f = file(&[(
        "mx",
        ty,
        vec![w as u64, mix as u64],
        table_bytes(r, ty, mix, w),
    )]);
    let (mc, mg) = (
        cpu.matrix(&src(&f, "mx")).unwrap(),
        gpu.matrix(&src(&f, "mx")).unwrap(),
    );
    let (sc, sg) = vectors(cpu, gpu, &randn(r, 3, 0.02));
    let (bc, bg) = vectors(cpu, gpu, &randn(r, mix, 1.0));
    let (nc, ng) = vectors(cpu, gpu, &randn(r, d, 1.5));
    HcWeights {
        mc,
        mg,
        sc,
        sg,
        bc,
        bg,
        nc,
        ng,
    }
}

fn hc_pre_norm_cases(cases: &[(usize, usize, usize, GgmlType)]) {
    let Some((cpu, gpu)) = setup() else { return };
    fuse_forms(|fused| {
        let mut r = rng(7);
        for &(nh, d, n, ty) in cases {
            let h = hc(nh, d);
            let w = nh * d;
            let HcWeights {
                mc,
                mg,
                sc,
                sg,
                bc,
                bg,
                nc,
                ng,
            } = hc_weights(&cpu, &gpu, &mut r, nh, d, ty);
            let x = randn(&mut r, n * w, 2.0);
            let eps = 1e-6;

            let (mut zc, mut pc, mut cc) =
                (cpu.alloc(n * d), cpu.alloc(n * nh), cpu.alloc(n * nh * nh));
            cpu.hc_pre_norm(h, &mc, &sc, &bc, &nc, &x, n, eps, &mut zc, &mut pc, &mut cc);
            let (mut zg, mut pg, mut cg) =
                (gpu.alloc(n * d), gpu.alloc(n * nh), gpu.alloc(n * nh * nh));
            let xg = gpu.upload(&x);
            // Twice: the fused kernel's arrival counters must be back at zero.
            for _ in 0..2 {
                gpu.hc_pre_norm(
                    h, &mg, &sg, &bg, &ng, &xg, n, eps, &mut zg, &mut pg, &mut cg,
                );
            }
            let (zg, pg, cg) = (
                gpu.download(&zg, n * d),
                gpu.download(&pg, n * nh),
                gpu.download(&cg, n * nh * nh),
            );
            gpu_ok(&gpu, "hc_pre_norm");
            let what = format!("hc_pre_norm fused {fused} N {nh} d {d} n {n} {ty:?}");
            assert_close(&format!("{what} post"), &pg, &pc, TOL_FUSED);
            assert_close(&format!("{what} comb"), &cg, &cc, TOL_FUSED);
            assert_close(&format!("{what} z"), &zg, &zc, TOL_FUSED);

            // HC post of a sublayer output o into x, then this HC pre (fused at decode); three
            // times in a row (x accumulates the posts): the arrival counters are back at zero
            // after every launch.
            let o = randn(&mut r, n * d, 2.0);
            let pin = randn(&mut r, n * nh, 1.0);
            let cin: Vec<f32> = randn(&mut r, n * nh * nh, 0.5)
                .iter()
                .map(|v| (v + 0.5) / nh as f32)
                .collect();
            const CALLS: u64 = 3;
            let mut xc = x.clone();
            for _ in 0..CALLS {
                cpu.hc_post_pre_norm(
                    h, &mut xc, &o, &pin, &cin, &mc, &sc, &bc, &nc, n, eps, &mut zc, &mut pc,
                    &mut cc,
                );
            }
            let mut xg = gpu.upload(&x);
            let (og, ping, cing) = (gpu.upload(&o), gpu.upload(&pin), gpu.upload(&cin));
            let (mut zg, mut pg, mut cg) =
                (gpu.alloc(n * d), gpu.alloc(n * nh), gpu.alloc(n * nh * nh));
            for _ in 0..CALLS {
                gpu.hc_post_pre_norm(
                    h, &mut xg, &og, &ping, &cing, &mg, &sg, &bg, &ng, n, eps, &mut zg, &mut pg,
                    &mut cg,
                );
            }
            let (xg, zg, pg, cg) = (
                gpu.download(&xg, n * w),
                gpu.download(&zg, n * d),
                gpu.download(&pg, n * nh),
                gpu.download(&cg, n * nh * nh),
            );
            gpu_ok(&gpu, "hc_post_pre_norm");
            let what = format!("hc_post_pre_norm fused {fused} N {nh} d {d} n {n} {ty:?}");
            assert_close(&format!("{what} x"), &xg, &xc, TOL);
            assert_close(&format!("{what} post"), &pg, &pc, TOL_FUSED);
            assert_close(&format!("{what} comb"), &cg, &cc, TOL_FUSED);
            assert_close(&format!("{what} z"), &zg, &zc, TOL_FUSED);
            if n <= 4 && fused == "on" {
                // The latency kernels (their last CTA's z beside the Sinkhorn) stay ~1e-6 from
                // the CPU (H200: <= 7e-7 at n 1..4 after three calls).
                for (v, g, c) in [("post", &pg, &pc), ("comb", &cg, &cc), ("z", &zg, &zc)] {
                    let e = max_rel(g, c);
                    assert!(e <= TOL, "{what} {v}: {e:.3e} > {TOL:.0e}");
                }
            }
        }
    });
}

/// The prefill HC pre (hcp_mix + hcp_finish: f32 products of the raw X, f32 sums of a lane's
/// columns, f64 across lanes and splits, then the RMS scale; hcp_mix_tc: tf32 hi + lo terms of
/// X on tensor cores, f32 sums per split; with the post inside it or before it) is at least
/// as close to the CPU as the composed ops (the BLAS mixer product of three bf16 terms of the normalised X) at the
/// model's shape: max relative error of post, comb and z, n 300, N 4, D 4096, an F16 mixer,
/// with and without the HC post (allowed: 1.5x the composed form's, plus 1e-6; H200: 6.0e-7 / 1.1e-7 / 6.0e-7
/// against 9.0e-6 / 7.6e-7 / 3.3e-6 with the post).
#[test]
fn hc_prefill_precision() {
    let Some((cpu, gpu)) = setup() else { return };
    let _g = FORM.lock().unwrap_or_else(|e| e.into_inner());
    let (nh, d, n, ty) = (4usize, 4096usize, 300usize, GgmlType::F16);
    let h = hc(nh, d);
    let w = nh * d;
    let mut r = rng(11);
    let HcWeights {
        mc,
        mg,
        sc,
        sg,
        bc,
        bg,
        nc,
        ng,
    } = hc_weights(&cpu, &gpu, &mut r, nh, d, ty);
    let x = randn(&mut r, n * w, 2.0);
    let o = randn(&mut r, n * d, 2.0);
    let pin = randn(&mut r, n * nh, 1.0);
    let cin: Vec<f32> = randn(&mut r, n * nh * nh, 0.5)
        .iter()
        .map(|v| (v + 0.5) / nh as f32)
        .collect();
    let eps = 1e-6;
    for with_post in [false, true] {
        let mut xc = x.clone();
        let (mut zc, mut pc, mut cc) =
            (cpu.alloc(n * d), cpu.alloc(n * nh), cpu.alloc(n * nh * nh));
        if with_post {
            cpu.hc_post_pre_norm(
                h, &mut xc, &o, &pin, &cin, &mc, &sc, &bc, &nc, n, eps, &mut zc, &mut pc, &mut cc,
            );
        } else {
            cpu.hc_pre_norm(h, &mc, &sc, &bc, &nc, &x, n, eps, &mut zc, &mut pc, &mut cc);
        }
        let mut errs = Vec::new();
        let mut outs: Vec<Vec<u32>> = Vec::new(); // z, post, comb (and x) bits per form
                                                  // hcp_mix_tc (tensor cores, where the device has them) + hcp_finish, hcp_mix +
                                                  // hcp_finish, then the composed ops.
        let tc_dev = common::sm80(&gpu);
        // (form, DS4_GPU_HCP_TC, DS4_GPU_HCP_POST): the post inside hcp_post_mix_tc, then
        // hc_post_fast + hcp_mix_tc; the composed ops last.
        for (hcp, tc, hpost) in [
            ("tc", "on", "on"),
            ("tc-pf0", "on", "on"),
            ("tc-lb0", "on", "on"),
            ("tc-sep", "on", "off"),
            ("tc-keep0", "on", "on"),
            ("on", "off", "on"),
            ("off", "off", "on"),
        ] {
            GpuBackend::set_hcp(if hcp.starts_with("tc") { "on" } else { hcp });
            GpuBackend::set_hcp_tc(tc);
            GpuBackend::set_hcp_post(hpost);
            GpuBackend::set_hcp_lb(if hcp == "tc-lb0" { "off" } else { "on" });
            GpuBackend::set_hcp_pf(if hcp == "tc-pf0" { "off" } else { "on" });
            GpuBackend::set_hcp_keep(if hcp == "tc-keep0" { "off" } else { "on" });
            let runs = GpuBackend::hcp_tc_launches();
            let runs4 = GpuBackend::hcp_lb_launches();
            let runs_p = GpuBackend::hcp_pf_launches();
            let mut xg = gpu.upload(&x);
            let (og, ping, cing) = (gpu.upload(&o), gpu.upload(&pin), gpu.upload(&cin));
            let (mut zg, mut pg, mut cg) =
                (gpu.alloc(n * d), gpu.alloc(n * nh), gpu.alloc(n * nh * nh));
            if with_post {
                gpu.hc_post_pre_norm(
                    h, &mut xg, &og, &ping, &cing, &mg, &sg, &bg, &ng, n, eps, &mut zg, &mut pg,
                    &mut cg,
                );
            } else {
                gpu.hc_pre_norm(
                    h, &mg, &sg, &bg, &ng, &xg, n, eps, &mut zg, &mut pg, &mut cg,
                );
            }
            let (pv, cv, zv) = (
                gpu.download(&pg, n * nh),
                gpu.download(&cg, n * nh * nh),
                gpu.download(&zg, n * d),
            );
            let e = [max_rel(&pv, &pc), max_rel(&cv, &cc), max_rel(&zv, &zc)];
            let xv = gpu.download(&xg, n * w);
            outs.push(
                [&zv, &pv, &cv, &xv]
                    .iter()
                    .flat_map(|v| v.iter().map(|x| x.to_bits()))
                    .collect(),
            );
            gpu_ok(&gpu, "hc prefill");
            if with_post {
                // The post's X' (in place) has hc_post_fast's bits, which are the CPU's.
                let xg = gpu.download(&xg, n * w);
                let diff = xg
                    .iter()
                    .zip(&xc)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    diff, 0,
                    "post {with_post} hcp {hcp}: x differs from the CPU's post"
                );
            }
            let ran = GpuBackend::hcp_tc_launches() - runs;
            println!(
                "post {with_post} hcp {hcp}: max rel error post/comb/z {:.3e} {:.3e} {:.3e} \
                 (hcp_mix_tc launches {ran})",
                e[0], e[1], e[2]
            );
            let want = hcp.starts_with("tc") && tc_dev;
            assert_eq!(ran > 0, want, "hcp_mix_tc ran {ran} times ({hcp})");
            let ran4 = GpuBackend::hcp_lb_launches() - runs4;
            let want4 = matches!(hcp, "tc" | "tc-pf0" | "tc-keep0") && with_post && tc_dev;
            assert_eq!(ran4 > 0, want4, "hcp_post_mix_tc4 ran {ran4} times ({hcp})");
            let ran_p = GpuBackend::hcp_pf_launches() - runs_p;
            let want_p = matches!(hcp, "tc" | "tc-keep0") && with_post && tc_dev;
            assert_eq!(
                ran_p > 0,
                want_p,
                "hcp_post_mix_tc4p ran {ran_p} times ({hcp})"
            );
            errs.push(e);
        }
        GpuBackend::set_hcp("on");
        GpuBackend::set_hcp_tc("on");
        GpuBackend::set_hcp_post("on");
        GpuBackend::set_hcp_lb("on");
        GpuBackend::set_hcp_pf("on");
        GpuBackend::set_hcp_keep("on");
        // hcp_finish's one-pass z (fu_finish_keep) and its two-pass fu_finish: the same bits.
        assert_eq!(
            outs[0], outs[4],
            "post {with_post}: hcp_finish with DS4_GPU_HCP_KEEP=off differs in bits"
        );
        // hcp_post_mix_tc4p (L2 fetches), the register-bounded hcp_post_mix_tc4 and the
        // unbounded kernel: one code, one result.
        assert_eq!(
            outs[0], outs[1],
            "post {with_post}: hcp_post_mix_tc4p differs in bits"
        );
        assert_eq!(
            outs[1], outs[2],
            "post {with_post}: hcp_post_mix_tc4 differs in bits"
        );
        let composed = errs.len() - 1;
        for form in 0..composed {
            for (k, (h, c)) in errs[form].iter().zip(&errs[composed]).enumerate() {
                assert!(
                    *h <= 1.5 * c + 1e-6,
                    "post {with_post} form {form}: hcp error {h:.3e} > composed {c:.3e} (output {k})"
                );
            }
        }
    }
}

/// The KV row's rounding at width `w`: FP8 of the part without RoPE, then f16.
fn kv_round(w: usize, n_rot: usize) -> ds4_backend::RowRounding {
    ds4_backend::RowRounding {
        fp8_nope: w - n_rot,
        fp4_hadamard: false,
        f16: true,
    }
}

/// The indexer's rounding (Hadamard + FP4, then f16): norm_rope takes the separate ops for it.
const FP4_ROUND: ds4_backend::RowRounding = ds4_backend::RowRounding {
    fp8_nope: 0,
    fp4_hadamard: true,
    f16: true,
};

#[test]
fn norm_rope_matches_cpu() {
    use ds4_backend::RopeKind;
    let Some((cpu, gpu)) = setup() else { return };
    let n_rot = HParams::tiny().n_rot as usize;
    fuse_forms(|fused| {
        let mut r = rng(8);
        // q (64 heads of 512, no weight), kv (1 head, weighted, FP8 + f16), decode and prefill;
        // Hadamard/FP4 rounding takes the separate ops.
        let (kv, fp4) = (|w: usize| kv_round(w, n_rot), FP4_ROUND);
        for (n, heads, width, weighted, round, t0) in [
            (1usize, 64usize, 512usize, false, None, 7usize),
            (3, 64, 512, false, None, 100_000),
            (1, 1, 512, true, Some(kv(512)), 5),
            (5, 1, 512, true, Some(kv(512)), 4095),
            (300, 1, 512, true, Some(kv(512)), 0),
            (17, 4, 128, false, None, 33),
            (2, 1, 128, true, Some(kv(128)), 9),
            (2, 1, 256, true, Some(fp4), 9),
            (4, 2, 200, true, Some(kv(200)), 1),
            (1, 2, 1024, true, Some(kv(1024)), 77),
            (1, 1, 2048, true, Some(kv(2048)), 3),
            (1, 1, 8192, true, Some(kv(8192)), 3), // past norm_rope_g's 1024 float4: staged
        ] {
            for kind in [RopeKind::Swa, RopeKind::Comp] {
                let len = n * heads * width;
                let a = randn(&mut r, len, 3.0);
                let (wc, wg) = vectors(&cpu, &gpu, &randn(&mut r, width, 1.5));
                let mut xc = a.clone();
                let wcr = weighted.then_some(&wc);
                cpu.norm_rope(&mut xc, n, heads, width, wcr, 1e-6, n_rot, t0, kind, round);
                let mut xg = gpu.upload(&a);
                let wgr = weighted.then_some(&wg);
                gpu.norm_rope(&mut xg, n, heads, width, wgr, 1e-6, n_rot, t0, kind, round);
                let xg = gpu.download(&xg, len);
                gpu_ok(&gpu, "norm_rope");
                // f16 rounding of the RoPE tail can flip on an ulp of sin/cos (2^-11 relative);
                // the FP8 part sees the same normalised values as the CPU.
                let tol = if round.is_some() { 1e-3 } else { TOL };
                assert_close(
                    &format!("norm_rope fused {fused} n {n} heads {heads} width {width} {kind:?} {round:?}"),
                    &xg,
                    &xc,
                    tol,
                );
            }
        }
    });
}

/// (n, heads of a, heads of b, width, b's rounding, t0) of a norm_rope_pair case.
type PairCase = (
    usize,
    usize,
    usize,
    usize,
    Option<ds4_backend::RowRounding>,
    usize,
);

/// norm_rope_pair of `case` on `be` (eps 1e-6): a unweighted and unrounded (the query), b
/// weighted by `w` and rounded by the case's rounding (the KV row).
fn rope_pair<B: Backend>(
    be: &B,
    a: &mut B::Buf,
    b: &mut B::Buf,
    w: &B::Weight,
    case: PairCase,
    n_rot: usize,
    kind: ds4_backend::RopeKind,
) {
    let (n, ha, hb, width, round_b, t0) = case;
    be.norm_rope_pair(
        a,
        ha,
        None,
        None,
        b,
        hb,
        Some(w),
        round_b,
        n,
        width,
        1e-6,
        n_rot,
        t0,
        kind,
    );
}

/// norm_rope_pair (one norm_rope_pair_g launch when both row sets take norm_rope_g) against
/// two GPU norm_rope calls, bit for bit, and the CPU (the default: two norm_ropes) within the
/// norm_rope tolerances; cases where a set takes another form (FP4 rounding: the separate ops;
/// width 200: norm_rope_f32) run the two calls.
#[test]
fn norm_rope_pair_matches_two_calls() {
    use ds4_backend::RopeKind;
    let Some((cpu, gpu)) = setup() else { return };
    let n_rot = HParams::tiny().n_rot as usize;
    // Both decode pair kernels (`DS4_GPU_NRLATE`: norm_rope_pair_gl waits for the PDL after the
    // weights and the RoPE table; norm_rope_pair_g first) and the prefill warp form
    // (norm_rope_pair_w, `DS4_GPU_NRW`, n > 4) with the CTA form it replaces: each the same bits
    // as two norm_rope calls (norm_rope_g).
    for (late, nrw) in [("off", "on"), ("on", "on"), ("off", "off")] {
        GpuBackend::set_nrlate(late);
        GpuBackend::set_nrw(nrw);
        let runs = GpuBackend::nrw_launches();
        fuse_forms(|fused| {
            let mut r = rng(9);
            let (kv, fp4) = (|w: usize| kv_round(w, n_rot), FP4_ROUND);
            // PairCase: a unweighted and unrounded (the query), b weighted (the KV row).
            for c in [
                (1usize, 64usize, 1usize, 512usize, Some(kv(512)), 7usize),
                (1, 64, 1, 512, None, 4095),
                (3, 64, 1, 512, Some(kv(512)), 100_000),
                (300, 8, 1, 512, Some(kv(512)), 0),
                (2, 4, 2, 128, Some(kv(128)), 9),
                (1, 2, 1, 1024, Some(kv(1024)), 77),
                (2, 4, 1, 256, Some(fp4), 9),
                (4, 2, 1, 200, Some(kv(200)), 1),
                // Prefill (the warp form where on): rows of a warp across a's end (15 rows of a),
                // 64 heads at the 2k end, a width of two float4 a lane, one not a multiple of a
                // warp's float4, and one past a warp (the CTA form).
                (5, 3, 1, 512, Some(kv(512)), 33),
                (7, 64, 1, 512, Some(kv(512)), 2041),
                (6, 4, 1, 256, Some(kv(256)), 100_000),
                (6, 2, 1, 200, Some(kv(200)), 1),
                (5, 2, 1, 1024, Some(kv(1024)), 77),
            ] {
                let (n, ha, hb, width, round_b, t0) = c;
                for kind in [RopeKind::Swa, RopeKind::Comp] {
                    let (la, lb) = (n * ha * width, n * hb * width);
                    let a = randn(&mut r, la, 3.0);
                    let b = randn(&mut r, lb, 3.0);
                    let (wc, wg) = vectors(&cpu, &gpu, &randn(&mut r, width, 1.5));
                    let (mut ac, mut bc) = (a.clone(), b.clone());
                    rope_pair(&cpu, &mut ac, &mut bc, &wc, c, n_rot, kind);
                    let (mut ap, mut bp) = (gpu.upload(&a), gpu.upload(&b));
                    rope_pair(&gpu, &mut ap, &mut bp, &wg, c, n_rot, kind);
                    let (mut a2, mut b2) = (gpu.upload(&a), gpu.upload(&b));
                    gpu.norm_rope(&mut a2, n, ha, width, None, 1e-6, n_rot, t0, kind, None);
                    let wgr = Some(&wg);
                    gpu.norm_rope(&mut b2, n, hb, width, wgr, 1e-6, n_rot, t0, kind, round_b);
                    let (ap, bp) = (gpu.download(&ap, la), gpu.download(&bp, lb));
                    let (a2, b2) = (gpu.download(&a2, la), gpu.download(&b2, lb));
                    gpu_ok(&gpu, "norm_rope_pair");
                    let case = format!("norm_rope_pair late {late} nrw {nrw} fused {fused} n {n} {ha}+{hb} heads width {width} {kind:?} {round_b:?}");
                    assert!(bits(&ap) == bits(&a2), "{case}: a differs from norm_rope");
                    assert!(bits(&bp) == bits(&b2), "{case}: b differs from norm_rope");
                    assert_close(&format!("{case} a"), &ap, &ac, TOL);
                    let tol = if round_b.is_some() { 1e-3 } else { TOL };
                    assert_close(&format!("{case} b"), &bp, &bc, tol);
                }
            }
        });
        let ran = GpuBackend::nrw_launches() - runs;
        if nrw == "on" {
            assert!(ran > 0, "norm_rope_pair_w never ran");
        } else {
            assert_eq!(ran, 0, "norm_rope_pair_w ran with DS4_GPU_NRW off");
        }
    }
    GpuBackend::set_nrw("on");
    GpuBackend::set_nrlate("off");
}

/// matmul_route (at n = 1 with an F16 router of 128 rows or more: one mvq_route_f16 launch, the
/// product's CTAs, then the route in the last CTA) against the two GPU calls (matmul, moe_route)
/// bit for bit (logits, selections, weights), and the CPU: its moe_route of the same logits
/// (selections exactly, weights to TOL) and its matmul_route's logits (F16 products: 1e-4 of the
/// largest). Top k and hash layers; at n = 2 the rank form fuses too (mvq_route2_f16r: each
/// token's logits, selections and weights bit for bit its own n = 1 launch's; the CPU checks read
/// the fused launch's); 16 experts (the product takes another kernel), a Q8_0 router, the simple
/// forms, `rounds` at n = 2 and `DS4_GPU_ROUTE=off` run the two calls (no fused launch); `on`
/// (mvq_route_f16r: top k by ranks) and `rounds` (mvq_route_f16: k rounds of a warp max) fuse,
/// with tied scores and a last group of fewer than k experts among the cases. Each case routes twice, so the second launch finds the ticket the
/// first reset.
#[test]
fn matmul_route_matches_two_calls() {
    let Some((cpu, gpu)) = setup() else { return };
    GpuBackend::set_matvec_mvn(true); // the n-token route (opt-in in the engine) under test
    both_forms(|form| {
        let mut r = rng(12);
        // (experts, used, columns, router type, rows and bias of experts ne/2.. copy those of
        // 0..ne/2: equal scores, the lower id first); 196: a last group of 4 (< k) experts
        for (ne, k, d, ty, dup) in [
            (256usize, 6usize, 4096usize, GgmlType::F16, false),
            (16, 6, 256, GgmlType::F16, false),
            (1024, 16, 512, GgmlType::F16, false),
            (256, 8, 4096, GgmlType::Q8_0, false),
            (256, 6, 4096, GgmlType::F16, true),
            (196, 6, 1024, GgmlType::F16, false),
        ] {
            let spec = MoeSpec {
                n_expert: ne,
                n_used: k,
                d,
                ff: 256,
                weight_scale: 1.5,
                clamp: 10.0,
            };
            let vocab = 64;
            let (tc, tg) = hash_table(&cpu, &gpu, &mut r, vocab, k, ne);
            let mut bias = randn(&mut r, ne, 0.1);
            let mut table = table_bytes(&mut r, ty, ne, d);
            if dup {
                let h = table.len() / 2;
                table.copy_within(..h, h);
                bias.copy_within(..ne / 2, ne / 2);
            }
            let f = file(&[
                ("router", ty, vec![d as u64, ne as u64], table),
                ("bias", GgmlType::F32, vec![ne as u64], f32_bytes(&bias)),
            ]);
            let (rc, rg) = (
                cpu.matrix(&src(&f, "router")).unwrap(),
                gpu.matrix(&src(&f, "router")).unwrap(),
            );
            let (bc, bg) = (
                cpu.vector(&src(&f, "bias")).unwrap(),
                gpu.vector(&src(&f, "bias")).unwrap(),
            );
            for (route, n, hash) in ["on", "rounds", "off"].into_iter().flat_map(|f| {
                [
                    (f, 1usize, false),
                    (f, 1, true),
                    (f, 2, false),
                    (f, 2, true),
                ]
            }) {
                GpuBackend::set_route_form(route);
                let z = randn(&mut r, n * d, 1.0);
                let toks: Vec<i32> = (0..n).map(|_| r.gen_range(0..vocab as i32)).collect();
                let (zg, tokg) = (gpu.upload(&z), gpu.upload_i32(&toks));
                let (bgs, tgs) = if hash {
                    (None, Some(&tg))
                } else {
                    (Some(&bg), None)
                };
                let before = GpuBackend::route_fused_launches();
                let mut fused = Vec::new();
                for _ in 0..2 {
                    let mut lg = gpu.alloc(n * ne);
                    let (mut sg, mut wtg) = (gpu.alloc_i32(n * k), gpu.alloc(n * k));
                    gpu.matmul_route(
                        &spec, &rg, &zg, n, &mut lg, bgs, tgs, &tokg, &mut sg, &mut wtg,
                    );
                    fused.push((
                        gpu.download(&lg, n * ne),
                        gpu.download_i32(&sg, n * k),
                        gpu.download(&wtg, n * k),
                    ));
                }
                let runs = GpuBackend::route_fused_launches() - before;
                let mut lg = gpu.alloc(n * ne);
                gpu.matmul(&rg, Part::All, &zg, n, &mut lg);
                let (mut sg, mut wtg) = (gpu.alloc_i32(n * k), gpu.alloc(n * k));
                gpu.moe_route(&spec, &lg, bgs, tgs, &tokg, n, &mut sg, &mut wtg);
                let (lg2, sg2, wg2) = (
                    gpu.download(&lg, n * ne),
                    gpu.download_i32(&sg, n * k),
                    gpu.download(&wtg, n * k),
                );
                gpu_ok(&gpu, "matmul_route");
                let case = format!(
                        "matmul_route {form} {route} n {n} {k} of {ne} experts over {d} {ty:?} hash {hash}"
                    );
                let fuses = ty == GgmlType::F16 && ne >= 128 && route != "off";
                // n = 2 fuses in the rank form (mvq_route2_f16r): each token as its n = 1 launch.
                let fuses_n = fuses && form != "simple" && (n == 1 || route == "on");
                assert_eq!(runs, if fuses_n { 2 } else { 0 }, "{case}: fused launches");
                let (lg2, sg2, wg2) = if n > 1 && fuses_n {
                    for t in 0..n {
                        let zt = gpu.upload(&z[t * d..(t + 1) * d]);
                        let tt = gpu.upload_i32(&toks[t..t + 1]);
                        let mut lg = gpu.alloc(ne);
                        let (mut sg, mut wtg) = (gpu.alloc_i32(k), gpu.alloc(k));
                        gpu.matmul_route(
                            &spec, &rg, &zt, 1, &mut lg, bgs, tgs, &tt, &mut sg, &mut wtg,
                        );
                        let (l1, s1, w1) = (
                            gpu.download(&lg, ne),
                            gpu.download_i32(&sg, k),
                            gpu.download(&wtg, k),
                        );
                        for (i, (lgn, sgn, wgn)) in fused.iter().enumerate() {
                            let tok = format!("{case} call {i} token {t}");
                            assert!(
                                bits(&lgn[t * ne..(t + 1) * ne]) == bits(&l1),
                                "{tok}: logits differ from its n = 1 launch"
                            );
                            assert_eq!(&sgn[t * k..(t + 1) * k], &s1[..], "{tok}: selections");
                            assert!(
                                bits(&wgn[t * k..(t + 1) * k]) == bits(&w1),
                                "{tok}: weights differ from its n = 1 launch"
                            );
                        }
                    }
                    // The CPU checks below then read the fused launch's logits and route.
                    fused[0].clone()
                } else {
                    for (i, (lg1, sg1, wg1)) in fused.iter().enumerate() {
                        assert!(bits(lg1) == bits(&lg2), "{case} call {i}: logits differ");
                        assert_eq!(sg1, &sg2, "{case} call {i}: selections differ");
                        assert!(bits(wg1) == bits(&wg2), "{case} call {i}: weights differ");
                    }
                    (lg2, sg2, wg2)
                };
                // The CPU's route of the GPU's logits, and the CPU's own logits.
                let (bcs, tcs) = if hash {
                    (None, Some(&tc))
                } else {
                    (Some(&bc), None)
                };
                let (mut sc, mut wc) = (cpu.alloc_i32(n * k), cpu.alloc(n * k));
                cpu.moe_route(&spec, &lg2, bcs, tcs, &toks, n, &mut sc, &mut wc);
                assert_eq!(sg2, sc, "{case}: selections differ from the CPU");
                assert_close(&format!("{case}: weights"), &wg2, &wc, TOL);
                let mut lc = cpu.alloc(n * ne);
                let (mut sc2, mut wc2) = (cpu.alloc_i32(n * k), cpu.alloc(n * k));
                cpu.matmul_route(
                    &spec, &rc, &z, n, &mut lc, bcs, tcs, &toks, &mut sc2, &mut wc2,
                );
                let scale = lc.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let err = lc
                    .iter()
                    .zip(&lg2)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    err <= 1e-4 * scale,
                    "{case}: logits {err} from the CPU's (max {scale})"
                );
            }
        }
    });
    GpuBackend::set_route_form("on");
}

/// `DS4_GPU_SKIP` / `GpuBackend::set_skip` (timing knock-outs): a named kernel is not launched
/// (its output keeps what the buffer held), others are, and an empty list launches it again.
#[test]
fn knocked_out_kernels_do_not_run() {
    let _g = FORM.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_cpu, gpu)) = setup() else {
        return;
    };
    // The list is process-wide: emptied again however this test ends.
    struct Unskip;
    impl Drop for Unskip {
        fn drop(&mut self) {
            GpuBackend::set_skip(&[]);
        }
    }
    let _unskip = Unskip;
    let y0 = [1.0f32, 2.0, 3.0];
    let x = gpu.upload(&[10.0f32, 20.0, 30.0]);
    let mut y = gpu.upload(&y0);
    GpuBackend::set_skip(&["add_f32"]);
    gpu.add(&mut y, &x, 3);
    gpu_ok(&gpu, "add knocked out");
    assert_eq!(gpu.download(&y, 3), y0, "add_f32 ran while knocked out");
    // Another kernel still runs: swiglu(1, 1) = silu(1) = 0.731 (clamp 10).
    let mut g = gpu.upload(&[1.0f32; 3]);
    gpu.swiglu(&mut g, &gpu.upload(&[1.0f32; 3]), 3, 10.0);
    gpu_ok(&gpu, "swiglu");
    for v in gpu.download(&g, 3) {
        assert!(
            (v - 0.731_058_6).abs() < 1e-5,
            "swiglu while add_f32 is knocked out: {v}"
        );
    }
    GpuBackend::set_skip(&[]);
    gpu.add(&mut y, &x, 3);
    gpu_ok(&gpu, "add");
    assert_eq!(gpu.download(&y, 3), [11.0, 22.0, 33.0]);
}
