//! The model glue ops (embed, hc_split, hc_collapse, hc_post, moe_route) on the GPU against the
//! CPU reference, op by op on random inputs at tiny (D 256, 16 experts) and full (D 4096, 256
//! experts) shapes. Skips with the reason when no GPU is present (DS4_REQUIRE_GPU=1: fail).
//!
//! The kernels do the CPU's f32 operations in the CPU's order, so differences come only from
//! exp/log1p (libm vs device, at most an ulp): embed is exact, the rest held to 1e-5 relative,
//! router selections exactly.
//!
//! Every case runs on all three kernel forms: the glue forms (default), the latency forms
//! (`DS4_GPU_MIX=fast`) and the simple ones (`DS4_GPU_MIX=simple`), switched here process-wide
//! through `GpuBackend::set_mix_form`, so the tests take a lock and run one at a time.

mod common;

use common::{assert_close, backends, f32_bytes, file, randn, rng, src};
use ds4_backend::{Backend, GgmlType, HcDims, MoeSpec};
use ds4_cpu::CpuBackend;
use ds4_gpu::GpuBackend;
use ds4_model::HParams;
use rand::Rng;
use std::sync::Mutex;

const TOL: f32 = 1e-5;

/// Serialises the tests: the kernel form is a process-wide switch.
static FORM: Mutex<()> = Mutex::new(());

/// Run `f(form)` on the glue, latency and simple forms; leaves the default (fast) set.
fn both_forms(mut f: impl FnMut(&str)) {
    let _g = FORM.lock().unwrap_or_else(|e| e.into_inner());
    for form in ["glue", "fast", "simple"] {
        GpuBackend::set_mix_form(form);
        f(form);
    }
    GpuBackend::set_mix_form("fast");
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
            let tab: Vec<i32> = (0..vocab * k).map(|_| r.gen_range(0..ne as i32)).collect();
            let tab_bytes: Vec<u8> = tab.iter().flat_map(|v| v.to_le_bytes()).collect();
            let f = file(&[(
                "tid2eid",
                GgmlType::I32,
                vec![k as u64, vocab as u64],
                tab_bytes,
            )]);
            let (tc, tg) = (
                cpu.table(&src(&f, "tid2eid")).unwrap(),
                gpu.table(&src(&f, "tid2eid")).unwrap(),
            );
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
