//! Synthetic weights are valid and sanely scaled in every quant mix.

use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::{bind_main, bind_mtp, Family, HParams, Mix};
use ds4_synth::{mtp_path, synth, SynthOptions};

fn write(mix: Mix, name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ds4-synth-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("m.gguf");
    let opts = SynthOptions {
        hparams: HParams::tiny(),
        mix,
        out: out.clone(),
        seed: 3,
        sparse: false,
        mtp: true,
    };
    let r = synth(&opts, &|_, _| {}).unwrap();
    assert_eq!(r.files.len(), 2);
    out
}

fn check_file(path: &std::path::Path, mtp: bool) {
    let f = GgufFile::open(path).unwrap();
    let hp = HParams::from_meta(&f).unwrap();
    let dir = if mtp {
        bind_mtp(&f, &hp)
    } else {
        bind_main(&f, &hp)
    }
    .unwrap();
    for w in &dir.tensors {
        let bytes = f.tensor_data(f.tensor(&w.name).unwrap());
        if w.ty == GgmlType::I32 {
            // Hash routing: every token gets n_expert_used distinct valid experts.
            let k = hp.n_expert_used as usize;
            let ids: Vec<i32> = bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            for row in ids.chunks(k) {
                let mut r = row.to_vec();
                r.sort();
                r.dedup();
                assert_eq!(r.len(), k, "{}: duplicate experts in {row:?}", w.name);
                assert!(r.iter().all(|&e| (0..hp.n_expert as i32).contains(&e)));
            }
            continue;
        }
        let n = w.dims.iter().product::<u64>() as usize;
        let mut v = vec![0f32; n];
        ds4_quant::dequantize_row(w.ty, bytes, &mut v).unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{}: non-finite value",
            w.name
        );
        let rms = (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / n as f64;
        match w.family {
            Family::Norm => assert!((rms - 1.0).abs() < 0.1, "{}: norm rms {rms}", w.name),
            Family::Proj | Family::Half | Family::ExpGateUp | Family::ExpDown => {
                let want = 1.0 / (w.dims[0] as f64).sqrt();
                assert!(
                    rms > 0.8 * want && rms < 1.25 * want,
                    "{} ({}): rms {rms}, want ≈ {want}",
                    w.name,
                    w.ty
                );
                assert!(
                    mean.abs() < 0.2 * want,
                    "{} ({}): mean {mean} is not ≈ 0",
                    w.name,
                    w.ty
                );
            }
            _ => assert!(rms < 2.0, "{}: rms {rms}", w.name),
        }
    }
}

#[test]
fn q2_mix_is_valid_and_scaled() {
    let p = write(Mix::Q2, "q2");
    check_file(&p, false);
    check_file(&mtp_path(&p), true);
}

#[test]
fn q4_and_f32_mixes_are_valid_and_scaled() {
    check_file(&write(Mix::Q4, "q4"), false);
    check_file(&write(Mix::F32, "f32"), false);
}
