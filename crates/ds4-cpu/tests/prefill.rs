//! Batched prefill ≡ one-token decode, bit for bit, at prompt lengths around the window (8) and
//! the compression boundaries (4, 8), and with chunks that end mid-window.

mod common;

#[test]
fn chunked_prefill_is_bit_identical_to_decode() {
    let m = common::tiny(11);
    let tokens: Vec<u32> = (0..70u32).map(|i| (i * 193 + 5) % 512).collect();
    // Reference: one token at a time, logits after every position.
    let mut st = m.new_state();
    let decode: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| m.eval(&mut st, t).unwrap())
        .collect();
    // Whole sequence as one batch, all positions.
    let mut sb = m.new_state();
    assert_eq!(m.eval_batch(&mut sb, &tokens, true).unwrap(), decode);
    assert_eq!(sb, st, "same state after the batch");
    // Chunkings ending inside CSA and HCA windows and across the window wrap.
    for chunks in [
        &[22usize, 19, 1, 1, 27][..],
        &[3, 5, 7, 9, 11, 13, 22],
        &[8, 8, 8, 46],
        &[1, 69],
    ] {
        let mut s = m.new_state();
        let mut pos = 0;
        for &c in chunks {
            let got = m.eval_batch(&mut s, &tokens[pos..pos + c], true).unwrap();
            assert_eq!(
                got,
                decode[pos..pos + c].to_vec(),
                "chunks {chunks:?} at {pos}"
            );
            pos += c;
        }
        assert_eq!(s, st, "chunks {chunks:?}: state differs");
    }
    // Last-position-only output equals the last row.
    for len in [1usize, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64] {
        let mut s = m.new_state();
        let last = m.eval_batch(&mut s, &tokens[..len], false).unwrap();
        assert_eq!(last.len(), 1);
        assert_eq!(last[0], decode[len - 1], "prompt length {len}");
    }
}

/// A token's attention heads and indexer scores split over the threads (the form long contexts
/// take) give the one-thread form's bits: decode steps and a batch, past the window and the
/// indexer's top-k.
#[test]
fn attention_split_over_threads_gives_the_same_bits() {
    use ds4_cpu::{CpuBackend, Rounding};
    use ds4_gguf::GgufFile;
    use ds4_model::forward::{rope_tables, Model};
    use ds4_model::{bind_main, HParams};
    use std::sync::Arc;
    let path = ds4_synth::tiny_model_for_tests(11, false);
    let load = |par_min: usize| {
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let hp = HParams::from_meta(file.as_ref()).unwrap();
        let dir = bind_main(&file, &hp).unwrap();
        let b = CpuBackend::new(rope_tables(&hp)).with_par_attend_min(par_min);
        Model::load(b, hp, &[(file, dir)], Rounding::MODEL, &mut |_, _| {}).unwrap()
    };
    let (one, split) = (load(usize::MAX), load(0));
    let tokens: Vec<u32> = (0..70u32).map(|i| (i * 193 + 5) % 512).collect();
    let (mut a, mut b) = (one.new_state(), split.new_state());
    for &t in &tokens[..40] {
        assert_eq!(one.eval(&mut a, t).unwrap(), split.eval(&mut b, t).unwrap());
    }
    assert_eq!(
        one.eval_batch(&mut a, &tokens[40..], true).unwrap(),
        split.eval_batch(&mut b, &tokens[40..], true).unwrap()
    );
    assert_eq!(a, b, "the same state");
}

/// A verify batch's last token undone by slot marks (`Model::checkpoint_last`: its raw ring
/// slot, its frontier slots and a row it pooled) leaves exactly the state of the batch's first
/// token evaluated alone — every ring slot and position, every frontier value, the rows — at
/// every position, drafts that close CSA (4) and HCA (8) windows included.
#[test]
fn slot_marks_undo_the_last_token_of_a_batch() {
    let m = common::tiny(11);
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 193 + 5) % 512).collect();
    let mut st = m.new_state();
    for t in 0..34 {
        // st holds positions 0..t; the batch is tokens[t] (kept) and a draft at t + 1.
        let draft = (tokens[t + 1] + 7) % 512;
        let mut b = m.from_host(&m.to_host(&st));
        let cp = m
            .checkpoint_last(&b, t + 1)
            .expect("the CPU has slot marks");
        let rows = m.eval_batch(&mut b, &[tokens[t], draft], true).unwrap();
        m.rollback(&mut b, cp);
        let mut single = m.from_host(&m.to_host(&st));
        assert_eq!(rows[0], m.eval(&mut single, tokens[t]).unwrap());
        assert_eq!(m.to_host(&b), m.to_host(&single), "position {t}");
        m.eval(&mut st, tokens[t]).unwrap();
    }
}

/// The MTP block's draft picked on the backend (`Model::mtp_draft`, what speculative decoding
/// uses) is the argmax of the logits `Model::mtp_eval` returns, at every position of a short
/// run (the two MTP states fed alike).
#[test]
fn mtp_draft_is_the_argmax_of_mtp_logits() {
    use ds4_cpu::Rounding;
    use ds4_gguf::GgufFile;
    use ds4_model::{bind_main, bind_mtp, HParams};
    use std::sync::Arc;
    let path = ds4_synth::tiny_model_for_tests(21, true);
    let main = Arc::new(GgufFile::open(&path).unwrap());
    let mtp = Arc::new(GgufFile::open(ds4_synth::mtp_path(&path)).unwrap());
    let hp = HParams::from_meta(main.as_ref()).unwrap();
    let (dm, dt) = (bind_main(&main, &hp).unwrap(), bind_mtp(&mtp, &hp).unwrap());
    let m = ds4_cpu::load(hp, &[(main, dm), (mtp, dt)], Rounding::MODEL).unwrap();
    assert!(m.has_mtp());
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 193 + 5) % 512).collect();
    let mut st = m.new_state();
    let (mut a, mut b) = (m.new_mtp_state(), m.new_mtp_state());
    let mut differ = 0;
    for t in 0..tokens.len() - 1 {
        let (_, hs) = m
            .eval_batch_streams(&mut st, &tokens[t..=t], false, true)
            .unwrap();
        let (l, _) = m.mtp_eval(&mut a, &hs[0], tokens[t + 1], t + 1).unwrap();
        let d = m.mtp_draft(&mut b, &hs[0], tokens[t + 1], t + 1).unwrap();
        assert_eq!(d, ds4_backend::sample::argmax(&l), "position {}", t + 1);
        differ += usize::from(t > 0 && d != tokens[t]);
    }
    assert!(
        differ > 0,
        "drafts all equal to a token: a constant pick would pass"
    );
}
