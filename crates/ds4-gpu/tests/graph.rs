//! Graph replay of decode steps (`GpuBackend::graph_begin`): on the tiny synthetic model, 640
//! tokens decoded one at a time with graphs on give bit-identical logits at every step to
//! graphs off — across the raw window (8), hundreds of ratio-4 and ratio-8 compressor
//! boundaries, the indexer's switch to scoring, a snapshot round trip through the host, and
//! speculative steps (a 3-token batch, then single tokens) rolled back mid-way. Steps with two
//! branches (a second chain in the graph) give the same logits as one chain. Skips with the
//! reason when no GPU is present.

mod common;

use ds4_backend::Rounding;
use ds4_gpu::GpuBackend;
use ds4_model::forward::{rope_tables, Model};
use ds4_model::synthetic::{SynthPreset, SynthSource};
use rand::Rng;

fn tiny() -> Option<Model<GpuBackend>> {
    let gpu = common::open_gpu()?;
    let (hp, mix) = SynthPreset::Tiny.params();
    let b = GpuBackend::new(gpu, &rope_tables(&hp)).expect("GPU backend");
    let mut progress = |_: usize, _: usize| {};
    let mut src = SynthSource::new(&hp, mix, 11, &mut progress);
    Some(Model::load_from(b, hp, &mut src, Rounding::MODEL).expect("tiny model"))
}

/// Logits of every evaluation: each token of `toks` in turn; at step 250 the state goes
/// through the host and back; at steps 400 and 520 a checkpoint, speculative evaluations
/// (3 tokens as one batch, then 2 one at a time), and a rollback.
fn decode(m: &Model<GpuBackend>, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    let mut out = Vec::new();
    for (i, &t) in toks.iter().enumerate() {
        if i == 250 {
            let h = m.to_host(&st);
            st = m.from_host(&h);
        }
        if i == 400 || i == 520 {
            let cp = m.checkpoint(&st);
            out.extend(m.eval_batch(&mut st, &toks[i..i + 3], true).unwrap());
            out.push(m.eval(&mut st, toks[1]).unwrap());
            out.push(m.eval(&mut st, toks[2]).unwrap());
            m.rollback(&mut st, cp);
        }
        out.push(m.eval(&mut st, t).unwrap());
    }
    assert_eq!(st.tokens, toks);
    out
}

#[test]
fn graph_replay_is_bit_identical() {
    let Some(m) = tiny() else { return };
    let mut rng = common::rng(5);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..640).map(|_| rng.gen_range(0..vocab)).collect();

    m.backend.set_graph(false);
    let off = decode(&m, &toks);
    let before = m.backend.graph_stats();
    m.backend.set_graph(true);
    m.backend.set_graph_split(0); // one graph per step
    let on = decode(&m, &toks);
    let s = m.backend.graph_stats();
    println!("graph stats: {s:?} (before the graph run: {before:?})");

    assert_eq!(off.len(), on.len());
    for (i, (a, b)) in off.iter().zip(&on).enumerate() {
        assert_eq!(a.len(), b.len());
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "evaluation {i}: graph replay logits differ from launches"
        );
    }
    // A second pass with graphs on reuses the cached graphs (updates only).
    let again = decode(&m, &toks);
    assert!(again
        .iter()
        .zip(&on)
        .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())));
    let s2 = m.backend.graph_stats();
    println!("graph stats after a second pass: {s2:?}");
    // Steps in pieces of 64 launches (the device runs one while the host records the next).
    m.backend.set_graph_split(64);
    let split = decode(&m, &toks);
    for (i, (a, b)) in off.iter().zip(&split).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "evaluation {i}: logits of steps in pieces differ from launches"
        );
    }
    let s3 = m.backend.graph_stats();
    println!("graph stats after a pass in pieces of 64: {s3:?}");
    if m.backend.graph_on() {
        assert_eq!(before.replays, 0, "graphs ran while turned off");
        assert!(s.replays >= 600, "{s:?}");
        // A few kernel sequences (which compressors emit), new ones on pool or state changes.
        assert!(s.captures <= 64, "{s:?}");
        assert!(s2.captures - s.captures <= 8, "{s2:?}");
    } else {
        println!("graphs unsupported by this driver: compared launches with launches");
    }
}

/// The graph statistics after each step of decoding `toks` one at a time.
fn decode_stats(m: &Model<GpuBackend>, toks: &[u32]) -> Vec<ds4_gpu::gpu::GraphStats> {
    let mut st = m.new_state();
    let mut stats = Vec::new();
    for &t in toks {
        m.eval(&mut st, t).unwrap();
        stats.push(m.backend.graph_stats());
    }
    stats
}

/// Positions live in device memory (`GpuBackend::step_pos`): once the few kernel sequences of
/// a decode step are captured, steady steps replay their graphs with no node updated — tokens
/// 300..480 of the tiny model, past its raw window (8), across ratio-4 and ratio-8 compressor
/// rows and indexer selections, between two doublings of the compressed rows' capacity (a new
/// buffer: its pointers update once). With positions as kernel arguments (the form before; on
/// the H200 this test then counted 31.3 updates a step) it fails.
#[test]
fn steady_decode_steps_update_no_graph_nodes() {
    let Some(m) = tiny() else { return };
    if !m.backend.graph_on() {
        println!("graphs unsupported by this driver: nothing to check");
        return;
    }
    let mut rng = common::rng(9);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..480).map(|_| rng.gen_range(0..vocab)).collect();
    let (a, b) = (300, 479);

    let s = decode_stats(&m, &toks);
    let (s0, s1) = (s[a], s[b]);
    println!("positions in device memory, steps {a}..{b}: {s0:?} -> {s1:?}");
    assert!(s1.replays - s0.replays >= (b - a) as u64, "{s1:?}");
    assert_eq!(s1.eager, s0.eager, "steps ran launch by launch");
    assert_eq!(
        s1.captures, s0.captures,
        "new kernel sequences in steady decode"
    );
    assert_eq!(
        s1.patched - s0.patched,
        0,
        "graph nodes updated in steady decode (DS4_GPU_GRAPH_TRACE=1 names them)"
    );
}

/// Decode steps as graphs of two chains (`Backend::side_begin`: the compressors beside the query
/// path, the shared expert's gate/up beside the router and routed experts) give bit-identical
/// logits to one chain (`DS4_GPU_BRANCH=off`) and to launches one by one, in one graph per step
/// and in pieces of 64 (a piece is not cut inside a branch), across the same snapshot and
/// rollbacks as above; and branching happened (graph launches with a second chain counted),
/// where the driver captures two streams.
#[test]
fn branched_steps_are_bit_identical() {
    let Some(m) = tiny() else { return };
    if !m.backend.graph_on() {
        println!("graphs unsupported by this driver: nothing to check");
        return;
    }
    let mut rng = common::rng(13);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..560).map(|_| rng.gen_range(0..vocab)).collect();
    let same = |a: &[Vec<f32>], b: &[Vec<f32>], what: &str| {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "evaluation {i}: {what}"
            );
        }
    };

    m.backend.set_graph(false);
    let eager = decode(&m, &toks);
    m.backend.set_graph(true);
    m.backend.set_graph_split(0);
    m.backend.set_branch(false);
    let s0 = m.backend.graph_stats();
    let one = decode(&m, &toks);
    let s1 = m.backend.graph_stats();
    m.backend.set_branch(true);
    let two = decode(&m, &toks);
    let s2 = m.backend.graph_stats();
    m.backend.set_graph_split(64);
    let two64 = decode(&m, &toks);
    let s3 = m.backend.graph_stats();
    println!("one chain: {s1:?}\ntwo chains: {s2:?}\ntwo chains, pieces of 64: {s3:?}");
    same(&eager, &one, "one-chain graphs differ from launches");
    same(&one, &two, "two-chain graphs differ from one chain");
    same(
        &one,
        &two64,
        "two-chain graphs in pieces of 64 differ from one chain",
    );
    assert_eq!(
        s1.branched, s0.branched,
        "branched graphs with DS4_GPU_BRANCH off"
    );
    assert!(s2.replays - s1.replays >= 500, "{s2:?}");
    if m.backend.gpu().runtime().branches_supported() {
        // Steps (one graph each) have side branches: nearly every launch is branched.
        let (b, r) = (s2.branched - s1.branched, s2.replays - s1.replays);
        assert!(
            b * 10 >= r * 9,
            "{b} of {r} graph launches branched: {s2:?}"
        );
        assert!(s3.branched - s2.branched >= 500, "{s3:?}");
        // No more steps run launch by launch than with one chain (state growth, snapshots).
        assert_eq!(s2.eager - s1.eager, s1.eager - s0.eager, "{s2:?}");
    } else {
        assert_eq!(s3.branched, 0);
        println!("this runtime captures one stream: two-chain steps ran as one chain");
    }
}

/// A checkpoint of every layer (ring, positions, compressor frontiers) is one device launch
/// (`copy_list`), and a rollback after speculative steps (a 3-token batch, then a single token,
/// across compressor boundaries) restores the state bit for bit: the host copy equals the one
/// taken at the checkpoint, and decoding on gives the logits of a run that never took the detour.
#[test]
fn rollback_restores_the_state_bitwise() {
    let Some(m) = tiny() else { return };
    let mut rng = common::rng(9);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..96).map(|_| rng.gen_range(0..vocab)).collect();
    let mut plain = m.new_state();
    let mut detour = m.new_state();
    for (i, &t) in toks.iter().enumerate() {
        let want = m.eval(&mut plain, t).unwrap();
        if i % 7 == 3 {
            let before = m.to_host(&detour);
            let launches = GpuBackend::copy_list_launches();
            let cp = m.checkpoint(&detour);
            assert_eq!(GpuBackend::copy_list_launches(), launches + 1);
            let j = (i * 13) % 90;
            m.eval_batch(&mut detour, &toks[j..j + 3], true).unwrap();
            m.eval(&mut detour, toks[j + 3]).unwrap();
            m.rollback(&mut detour, cp);
            assert_eq!(GpuBackend::copy_list_launches(), launches + 2);
            assert!(
                m.to_host(&detour) == before,
                "token {i}: state after rollback differs"
            );
        }
        let got = m.eval(&mut detour, t).unwrap();
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "token {i}: logits after rollbacks differ"
        );
    }
}

/// Slot marks (`Model::checkpoint_last`) on the GPU: a verify batch [kept, draft] rolled back
/// to them holds exactly the batch's state except what the draft wrote — its raw ring row and
/// position, its frontier slots (with the previous window's where it closed a CSA window) and
/// a row it pooled — which hold their values from before the batch again (bit for bit, every
/// layer; the batch replays to the same bits). Positions 20..60 of the tiny model: raw window
/// 8, compressor ratios 4 and 8, drafts inside windows and closing them.
#[test]
fn slot_marks_undo_the_last_token_of_a_batch() {
    let Some(m) = tiny() else { return };
    let mut rng = common::rng(13);
    let vocab = m.hp.n_vocab;
    let toks: Vec<u32> = (0..64).map(|_| rng.gen_range(0..vocab)).collect();
    let dims = m.layer_dims();
    let mut st = m.new_state();
    for &t in &toks[..20] {
        m.eval(&mut st, t).unwrap();
    }
    let mut closing = 0;
    for t in 20..60 {
        let draft = (toks[t + 1] + 1) % vocab;
        let before = m.to_host(&st);
        let cp = m
            .checkpoint_last(&st, t + 1)
            .expect("the GPU has slot marks");
        // The batch's own state, from a copy of the state before it.
        let mut b = m.from_host(&before);
        m.eval_batch(&mut b, &[toks[t], draft], true).unwrap();
        let mut want = m.to_host(&b);
        want.tokens.pop();
        for (l, (w, p)) in want.layers.iter_mut().zip(&before.layers).enumerate() {
            let slots = ds4_backend::TokenSlots::of(&dims[l], t + 1);
            let hd = dims[l].head_dim;
            let r = slots.ring * hd..(slots.ring + 1) * hd;
            w.raw[r.clone()].copy_from_slice(&p.raw[r]);
            w.raw_pos[slots.ring] = p.raw_pos[slots.ring];
            for (wc, pc, at) in [
                (&mut w.comp, &p.comp, slots.comp),
                (&mut w.index, &p.index, slots.index),
            ] {
                if let (Some(wc), Some(pc), Some(f)) = (wc.as_mut(), pc, at) {
                    for &(s0, n) in &f.ranges {
                        let r = s0 * f.width..(s0 + n) * f.width;
                        wc.front_kv[r.clone()].copy_from_slice(&pc.front_kv[r.clone()]);
                        wc.front_score[r.clone()].copy_from_slice(&pc.front_score[r]);
                    }
                    let keep = wc.rows.len() - f.pooled;
                    wc.rows.truncate(keep);
                    closing += usize::from(f.pooled > 0);
                }
            }
        }
        m.eval_batch(&mut st, &[toks[t], draft], true).unwrap();
        m.rollback(&mut st, cp);
        let got = m.to_host(&st);
        assert_eq!(got.tokens, toks[..=t].to_vec());
        for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                g.raw_pos, w.raw_pos,
                "position {t}, layer {l}: ring positions"
            );
            assert_eq!(
                bits(&g.raw),
                bits(&w.raw),
                "position {t}, layer {l}: ring rows"
            );
            for (gc, wc) in [(&g.comp, &w.comp), (&g.index, &w.index)] {
                if let (Some(gc), Some(wc)) = (gc, wc) {
                    assert_eq!(bits(&gc.front_kv), bits(&wc.front_kv), "{t} {l}: frontier");
                    assert_eq!(bits(&gc.front_score), bits(&wc.front_score), "{t} {l}");
                    assert_eq!(bits(&gc.rows), bits(&wc.rows), "{t} {l}: rows");
                }
            }
        }
        // On from the kept token, as speculative decoding goes on after a rejection.
    }
    println!("slot marks: 40 drafts undone, {closing} compressor windows closed by drafts");
    assert!(closing > 10, "drafts closing windows: {closing}");
}
