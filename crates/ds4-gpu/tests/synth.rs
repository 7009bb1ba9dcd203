//! `GpuBackend::random`: every generated type dequantises (on the CPU, from the downloaded
//! bytes) to finite values with the requested centre and spread; quantised blocks are exactly
//! the host mirror's; expert-id rows are distinct and in range. Skips without a GPU.

mod common;

use ds4_backend::{Backend, Fill, GgmlType, WeightKind};
use ds4_gpu::model::{synth, GpuWeight};
use ds4_gpu::GpuBackend;
use ds4_model::HParams;

fn bytes_of(g: &GpuBackend, w: &GpuWeight) -> Vec<u8> {
    let buf = match w {
        GpuWeight::Mat { buf, .. } | GpuWeight::F32 { buf, .. } | GpuWeight::I32 { buf, .. } => buf,
    };
    g.gpu().synchronize().unwrap();
    let mut out = vec![0u8; buf.bytes()];
    g.gpu().download(buf.ptr(), &mut out).unwrap();
    out
}

/// (mean, RMS about the mean).
fn stats(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|x| *x as f64).sum::<f64>() / n;
    let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn matrices_of_every_type_have_the_requested_spread() {
    let Some((_, g)) = common::backends(&HParams::tiny()) else {
        return;
    };
    let spread = 0.05f32;
    let target = spread as f64 / 3f64.sqrt(); // RMS of U(−spread, spread)
    let dims = [4096u64, 64, 2];
    let n = (dims[0] * dims[1] * dims[2]) as usize;
    for (i, ty) in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 100 + i as u64;
        let before = g.weight_bytes();
        let w = g
            .random(
                WeightKind::Matrix,
                ty,
                &dims,
                Fill::Uniform {
                    center: 0.0,
                    spread,
                },
                seed,
            )
            .unwrap_or_else(|e| panic!("{ty:?}: {e}"));
        let raw = bytes_of(&g, &w);
        assert_eq!(
            raw.len() as u64,
            ty.row_bytes(dims[0]).unwrap() * dims[1] * dims[2]
        );
        assert_eq!(g.weight_bytes() - before, raw.len() as u64, "{ty:?}");
        if ty.block_elems() > 1 {
            let d = synth::block_scale(ty, spread);
            for (j, b) in raw.iter().enumerate() {
                assert_eq!(
                    *b,
                    synth::synth_byte(ty, seed, d, j as u64),
                    "{ty:?} byte {j}"
                );
            }
        }
        let mut v = vec![0f32; n];
        ds4_quant::dequantize_row(ty, &raw, &mut v).unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{ty:?}");
        let (mean, rms) = stats(&v);
        println!("{ty:?}: mean {mean:.5} rms {rms:.5} (target {target:.5})");
        assert!(mean.abs() < 0.1 * target, "{ty:?}: mean {mean}");
        assert!((rms / target - 1.0).abs() < 0.05, "{ty:?}: rms {rms}");
        if matches!(ty, GgmlType::F32 | GgmlType::F16) {
            let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(max <= spread * 1.001, "{ty:?}: {max}");
        }
    }
}

#[test]
fn vectors_are_f32_around_their_centre_and_f16_matrices_too() {
    let Some((_, g)) = common::backends(&HParams::tiny()) else {
        return;
    };
    let fill = Fill::Uniform {
        center: 1.0,
        spread: 0.1,
    };
    let w = g
        .random(WeightKind::Vector, GgmlType::F32, &[4096], fill, 3)
        .unwrap();
    let raw = bytes_of(&g, &w);
    let v: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(v.len(), 4096);
    assert!(v.iter().all(|x| (0.9..=1.1).contains(x)));
    let (mean, _) = stats(&v);
    assert!((mean - 1.0).abs() < 0.01, "{mean}");
    let w = g
        .random(WeightKind::Matrix, GgmlType::F16, &[256, 16], fill, 4)
        .unwrap();
    let mut h = vec![0f32; 256 * 16];
    ds4_quant::dequantize_row(GgmlType::F16, &bytes_of(&g, &w), &mut h).unwrap();
    assert!(h.iter().all(|x| (0.899..=1.101).contains(x)));
    // Quantised types have no centre.
    assert!(g
        .random(WeightKind::Matrix, GgmlType::Q8_0, &[256, 16], fill, 5)
        .is_err());
}

#[test]
fn expert_id_rows_are_distinct_and_in_range() {
    let Some((_, g)) = common::backends(&HParams::tiny()) else {
        return;
    };
    let (k, rows, n_expert) = (6usize, 5000usize, 256u32);
    let w = g
        .random(
            WeightKind::Table,
            GgmlType::I32,
            &[k as u64, rows as u64],
            Fill::ExpertIds { n_expert },
            9,
        )
        .unwrap();
    let raw = bytes_of(&g, &w);
    let ids: Vec<i32> = raw
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(ids.len(), k * rows);
    let mut seen = vec![0usize; n_expert as usize];
    for row in ids.chunks_exact(k) {
        for (a, x) in row.iter().enumerate() {
            assert!((0..n_expert as i32).contains(x));
            assert!(!row[..a].contains(x), "row {row:?}");
            seen[*x as usize] += 1;
        }
    }
    // Every expert is used (≈ 117 times each).
    assert!(seen.iter().all(|&c| c > 50), "{seen:?}");
}

#[test]
fn host_mirror_gives_unit_scales() {
    // No GPU needed: the host mirror's blocks dequantise to the RMS the scale assumes.
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ] {
        let r = synth::unit_rms(ty);
        assert!(r.is_finite() && r > 0.1, "{ty:?}: {r}");
        let d = synth::block_scale(ty, 3f32.sqrt());
        let blocks = 64u64;
        let raw: Vec<u8> = (0..blocks * ty.block_bytes())
            .map(|i| synth::synth_byte(ty, 77, d, i))
            .collect();
        let mut v = vec![0f32; (blocks * ty.block_elems()) as usize];
        ds4_quant::dequantize_row(ty, &raw, &mut v).unwrap();
        let (_, rms) = stats(&v);
        assert!((rms - 1.0).abs() < 0.1, "{ty:?}: {rms}");
    }
}

/// `Backend::finish` (the end of a model load) waits for queued generation and surfaces a failure
/// recorded by an earlier op once: here an activation larger than any device's memory.
#[test]
fn finish_waits_and_surfaces_a_failed_op() {
    let Some((_, g)) = common::backends(&HParams::tiny()) else {
        return;
    };
    let w = g
        .random(
            WeightKind::Matrix,
            GgmlType::Q8_0,
            &[4096, 256],
            Fill::Uniform {
                center: 0.0,
                spread: 0.05,
            },
            7,
        )
        .unwrap();
    assert_eq!(g.finish(), Ok(()));
    assert!(bytes_of(&g, &w).iter().any(|&b| b != 0));
    let huge = g.alloc(1usize << 46); // 256 TiB of f32: no device has it
    let e = g
        .finish()
        .expect_err("the failed allocation surfaces at finish");
    assert!(e.contains("device memory"), "{e}");
    drop(huge);
    assert_eq!(g.finish(), Ok(()), "reported once");
}
