//! `moe_bench [reps]`: decode MoE (model/moe.rs, gpu/moe.cu) against the older paths
//! (`set_moe_decode(false)`: n = 1 the coalesced matmul.rs kernels, n = 2..4 matvec.rs), at
//! full size (d 4096, ff 2048, 256 experts, 6 slots) for the q2 mix (IQ2_XXS gate/up, Q2_K
//! down) and the q4 mix (Q4_K), n = 1..4. Weights are generated on the device. µs per call
//! (one layer's routed experts: `reps` calls queued between two syncs, wall clock, each with
//! another random selection so the experts come from memory, not L2) and GB/s of the distinct
//! experts' bytes. Forms: v1 (rows staged in shared memory; rbN gate/up rows per CTA), v2
//! (direct loads; nbA/B = gate/up and down row batches per CTA; default 6/4), v3d (n = 1 q2 mix
//! on tensor cores, nbA gate/up tiles of 8 rows per CTA, default 3; elsewhere v2 with nbA/B),
//! v3ip (v3d with the int8 down `m3dn1ip_q2_k`, the n = 1 default).
//! `moe_bench [reps] [n_max]`; `MOE_BENCH_FORMS=v2,v3d` runs only the forms so named,
//! `MOE_BENCH_WARM=0` without the 5 warm-up calls (profilers), `MOE_BENCH_SELS=1` one selection
//! every call (its experts from L2).

use ds4_backend::{Backend, Fill, GgmlType, MoeSpec, WeightKind};
use ds4_gpu::{Gpu, GpuBackend};
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::{Rng, SeedableRng};
use std::time::Instant;

type B = <GpuBackend as Backend>::Buf;

fn main() {
    let reps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let n_max: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let gpu = match Gpu::open(ds4_gpu::Backend::Auto, 0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no GPU available: {e}");
            return;
        }
    };
    let ropes = rope_tables(&HParams::tiny());
    let gpu = GpuBackend::new(gpu, &ropes).expect("GPU backend");
    let (d, ff, ne, k) = (4096usize, 2048usize, 256usize, 6usize);
    let fill = Fill::Uniform {
        center: 0.0,
        spread: 0.02,
    };
    println!("{:44} {:>10} {:>10}", "case", "us/call", "GB/s");
    for (mix, tgu, td) in [
        ("q2", GgmlType::IQ2_XXS, GgmlType::Q2_K),
        ("q4", GgmlType::Q4_K, GgmlType::Q4_K),
    ] {
        let m = |ty, cols: usize, rows: usize, seed| {
            gpu.random(
                WeightKind::Matrix,
                ty,
                &[cols as u64, rows as u64, ne as u64],
                fill,
                seed,
            )
            .expect("random weight")
        };
        let (wg, wu, wd) = (m(tgu, d, ff, 1), m(tgu, d, ff, 2), m(td, ff, d, 3));
        let rb_gu = tgu.row_bytes(d as u64).unwrap() as usize;
        let rb_dn = td.row_bytes(ff as u64).unwrap() as usize;
        let spec = MoeSpec {
            n_expert: ne,
            n_used: k,
            d,
            ff,
            weight_scale: 1.0,
            clamp: 10.0,
        };
        for n in 1..=n_max {
            let mut r = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(n as u64);
            let z = gpu.upload(
                &(0..n * d)
                    .map(|_| r.gen_range(-1.0f32..1.0))
                    .collect::<Vec<_>>(),
            );
            let wgt = gpu.upload(&vec![0.3f32; n * k]);
            // 64 selections (distinct experts within a token) and their distinct-expert bytes.
            let mut sels = Vec::new();
            let mut bytes = 0f64;
            for _ in 0..64 {
                let mut s = Vec::new();
                for _ in 0..n {
                    let mut e: Vec<i32> = (0..ne as i32).collect();
                    for i in 0..k {
                        let j = r.gen_range(i..ne);
                        e.swap(i, j);
                    }
                    s.extend_from_slice(&e[..k]);
                }
                let mut u = s.clone();
                u.sort();
                u.dedup();
                bytes += (u.len() * (2 * ff * rb_gu + d * rb_dn)) as f64 / 64.0;
                sels.push(gpu.upload_i32(&s));
            }
            let mut out = gpu.alloc(n * d);
            // (name, decode kernels on, form, v1 rows, v2 tiles)
            type Form = (&'static str, bool, usize, usize, (usize, usize));
            let forms: [Form; 7] = [
                ("old", false, 1, 16, (0, 0)),
                ("v1 rb16", true, 1, 16, (0, 0)),
                ("v2 nb6/4", true, 2, 0, (6, 4)),
                ("v3d nb3", true, 3, 0, (3, 4)),
                ("v3ip nb3", true, 4, 0, (3, 4)),
                ("v3d nb2", true, 3, 0, (2, 4)),
                ("v3d nb4", true, 3, 0, (4, 4)),
            ];
            // MOE_BENCH_FORMS=a,b: only the forms whose names contain one of these (for profilers);
            // MOE_BENCH_WARM=w: w calls before the timed ones (default 5; 0 for profilers).
            let only = std::env::var("MOE_BENCH_FORMS").unwrap_or_default();
            let warm: usize = std::env::var("MOE_BENCH_WARM")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(5);
            // MOE_BENCH_SELS=s: rotate over the first s selections only (1: the same 6 experts
            // every call, ~43 MB at n = 1 in the q2 mix: mostly L2-resident, the ceiling of a
            // prefetch of the selected experts).
            let nsel: usize = std::env::var("MOE_BENCH_SELS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(64)
                .clamp(1, 64);
            for (form, on, f, rb, (nb, nbr)) in forms {
                if !only.is_empty() && !only.split(',').any(|o| form.contains(o)) {
                    continue;
                }
                GpuBackend::set_moe_decode(on);
                GpuBackend::set_moe_form(f);
                GpuBackend::set_moe_gu_rows(rb);
                GpuBackend::set_moe_v2_tiles(nb, nbr);
                let call = |i: usize, out: &mut B| {
                    gpu.moe_experts(&spec, &wg, &wu, &wd, &z, &sels[i % nsel], &wgt, n, out)
                };
                for i in 0..warm {
                    call(i, &mut out);
                }
                gpu.download(&out, 1);
                let t = Instant::now();
                for i in 0..reps {
                    call(i, &mut out);
                }
                gpu.download(&out, 1);
                if let Err(e) = gpu.check() {
                    panic!("GPU error: {e}");
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "{:44} {:10.2} {:10.1}",
                    format!("{mix} n={n} {form}"),
                    s * 1e6,
                    bytes / s / 1e9
                );
            }
        }
    }
    GpuBackend::set_moe_decode(true);
    GpuBackend::set_moe_gu_rows(0);
    GpuBackend::set_moe_form(0);
    GpuBackend::set_moe_v2_tiles(0, 0);
}
