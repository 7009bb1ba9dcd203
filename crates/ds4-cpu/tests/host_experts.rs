//! Routed experts kept in host memory (`ds4_model::offload`, `--cpu-experts`) on the CPU
//! backend, where both forms can be compared with the plain model: small batches run the
//! experts through `HostExperts::run` (the bits of the plain model), prompt batches bind the
//! selected experts a group at a time and add the groups' sums (f32 order only). The GPU's
//! gather in rounds is held here to the whole MoE too (`gather_rounds_add_up_to_the_whole_moe`),
//! and the schedule's gather itself runs here on the CPU backend's expert slots
//! (`CpuBackend::with_expert_slots`: slots, rounds, masked weights, sums, as on a GPU).

mod common;

use ds4_backend::{GgmlType, MoeSpec, Shard};
use ds4_cpu::{math::silu, CpuBackend, CpuHostExperts, CpuModel, Rounding};
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, FileSource, Model};
use ds4_model::offload::{HostExperts, HostPlacement, HostStack};
use ds4_model::{bind_main, HParams};
use ds4_quant::act::{ActKernel, QuantizedAct};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Held by the tests that set or read process-wide switches and counters of
/// `ds4_model::offload` (gather mode, slot count, the gather / group counters).
static GLOBALS: Mutex<()> = Mutex::new(());

fn globals() -> std::sync::MutexGuard<'static, ()> {
    GLOBALS.lock().unwrap_or_else(|e| e.into_inner())
}

fn load_placed(path: &Path, layers: Vec<usize>, upload_min: usize, group: usize) -> CpuModel {
    load_placed_with(
        path,
        layers,
        upload_min,
        group,
        false,
        None,
        Rounding::MODEL,
    )
}

/// [`load_placed`]; `int8`: the host experts quantise their activations (`--precision fast`);
/// `slots`: the backend has expert slots with room for that many experts and batches gather
/// into them (as on a GPU).
fn load_placed_with(
    path: &Path,
    layers: Vec<usize>,
    upload_min: usize,
    group: usize,
    int8: bool,
    slots: Option<usize>,
    rounding: Rounding,
) -> CpuModel {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let dir = bind_main(&file, &hp).unwrap();
    let files = [(file, dir)];
    let ropes = rope_tables(&hp);
    let make = |s: &[HostStack; 3]| {
        let e = CpuHostExperts::new(s, &ropes)?;
        let e = if int8 { e.with_int8_activations() } else { e };
        Ok(Box::new(e) as Box<dyn HostExperts>)
    };
    let mut placement = HostPlacement::new(layers, &make);
    placement.upload_min = upload_min;
    placement.group = group;
    if slots.is_some() {
        placement.gather = ds4_model::offload::Gather::Gpu;
    }
    let mut progress = |_: usize, _: usize| {};
    let mut src = FileSource::new(&files, &mut progress);
    src.prefetch_host = true; // as the engine sets it where the stacks fit the RAM
    let b = CpuBackend::new(rope_tables(&hp));
    let b = match slots {
        Some(usize::MAX) => b.with_expert_slots(true),
        Some(room) => b.with_expert_slot_room(room),
        None => b,
    };
    Model::load_placed(b, hp, &mut src, rounding, Shard::ONE, Some(&placement)).unwrap()
}

/// `layers` in host memory on a backend with room for every expert slot, gathering (upload_min
/// 1: were the gather not taken, batches would upload groups of 4), without rounding steps;
/// `buffer`: with the layer buffer. Callers hold [`globals`].
fn load_gathering(path: &Path, layers: &[usize], buffer: bool) -> CpuModel {
    ds4_model::offload::set_layer_buffer(Some(buffer));
    let m = load_placed_with(
        path,
        layers.to_vec(),
        1,
        4,
        false,
        Some(usize::MAX),
        Rounding::NONE,
    );
    ds4_model::offload::set_layer_buffer(None);
    m
}

fn tokens() -> Vec<u32> {
    (0..40u32).map(|i| (i * 97 + 13) % 512).collect()
}

#[test]
fn host_experts_give_the_plain_models_bits_one_token_at_a_time_and_in_a_batch() {
    let _g = globals();
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::MODEL);
    let n_layer = plain.hp.n_layer as usize;
    // Decode steps asked to gather onto the device (`DS4_HOST_EXPERTS_DECODE=gpu`): the CPU
    // backend has no expert slots, so they run on the host all the same.
    ds4_model::offload::set_gather(Some(ds4_model::offload::Gather::Gpu));
    let host = load_placed(&path, (0..n_layer).collect(), usize::MAX, 32);
    ds4_model::offload::set_gather(None);
    assert_eq!(host.host_expert_layers(), (0..n_layer).collect::<Vec<_>>());
    assert!(plain.host_expert_layers().is_empty());
    // A backend that does not read tables in place (no expert slots) copies the embedding.
    assert_eq!((host.host_table_bytes(), plain.host_table_bytes()), (0, 0));
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    for &t in &tokens() {
        assert_eq!(
            plain.eval(&mut a, t).unwrap(),
            host.eval(&mut b, t).unwrap()
        );
    }
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    assert_eq!(
        plain.eval_batch(&mut a, &tokens(), true).unwrap(),
        host.eval_batch(&mut b, &tokens(), true).unwrap()
    );
    assert_eq!(a, b, "the same session state");
}

/// Largest |a - b| over `a`'s largest |value|, row by row.
fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        let scale = x.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    worst
}

/// The schedule's gather of host-memory experts (`Model::moe_gather`, a GPU's default for
/// `--cpu-experts`) on the CPU backend's expert slots: the router's selections come back, the
/// selected experts' slabs are copied into the slots in order of first use, and the MoE runs
/// on the slots. One round (the default 24 slots hold every expert of the tiny model): the
/// plain model's bits, one token at a time and in batches (the slots' experts are the same
/// bytes and each token's selections are summed in the same order). Rounds of 6 slots (a
/// decode step's 6 experts still one round; a batch's in rounds, the other rounds' pairs
/// weighted 0, the rounds' sums added): the plain model's values to f32 order.
#[test]
fn gathered_host_experts_match_the_plain_model() {
    use ds4_model::offload::{set_gather_slots, GATHERS, GATHER_ROUNDS, UPLOADED_GROUPS};
    use std::sync::atomic::Ordering::Relaxed;
    let _g = globals();
    let path = ds4_synth::tiny_model_for_tests(7, false);
    // Without the model's FP8 / FP4 rounding steps, which can turn the rounds' f32 reordering
    // into a flipped rounding and a 1e-4 difference in a random model's later rows.
    let plain = common::load(&path, Rounding::NONE);
    let (n_layer, n_expert) = (plain.hp.n_layer as usize, plain.hp.n_expert as usize);
    let n_used = plain.hp.n_expert_used as usize;
    // The first layer (hash-routed in this model family) and the last two; upload_min 1: were
    // the gather not taken, every batch would upload groups (counted below).
    let layers = vec![0, n_layer - 2, n_layer - 1];
    // Every host layer gathered: no layer buffer (`layer_buffer_runs_host_layers_as_resident`).
    let tables = || ds4_model::offload::HOST_TABLES.load(Relaxed);
    let t0 = tables();
    let host = load_gathering(&path, &layers, false);
    assert!(host.gathers_host_experts());
    assert_eq!(host.buffered_host_layer(), None);
    assert_eq!(host.host_expert_layers(), layers);
    // With host layers the embedding table is read in place (`offload::HOST_TABLE`), unless
    // DS4_HOST_EMBED=off; the steps below hold it to the plain model's bits.
    let embd = ds4_gguf::GgufFile::open(&path).unwrap();
    let embd = embd.tensor(ds4_model::offload::HOST_TABLE).unwrap().n_bytes as usize;
    assert_eq!((host.host_table_bytes(), tables() - t0), (embd, 1));
    assert_eq!(plain.host_table_bytes(), 0);
    ds4_model::offload::set_host_table(Some(false));
    let copied = load_gathering(&path, &layers, false);
    ds4_model::offload::set_host_table(None);
    assert_eq!((copied.host_table_bytes(), tables() - t0), (0, 1));
    drop(copied);
    let toks = tokens();
    for cap in [None, Some(n_used)] {
        set_gather_slots(cap);
        let slots = ds4_model::offload::gather_slots(n_used);
        let one_round = slots >= n_expert;
        let counts = || [&GATHERS, &GATHER_ROUNDS, &UPLOADED_GROUPS].map(|c| c.load(Relaxed));
        let before = counts();
        let (mut a, mut b) = (plain.new_state(), host.new_state());
        for &t in &toks[..8] {
            assert_eq!(
                plain.eval(&mut a, t).unwrap(),
                host.eval(&mut b, t).unwrap(),
                "a decode step, {slots} slots"
            );
        }
        for chunk in [&toks[8..11], &toks[11..]] {
            let la = plain.eval_batch(&mut a, chunk, true).unwrap();
            let lb = host.eval_batch(&mut b, chunk, true).unwrap();
            if one_round {
                assert_eq!(la, lb, "a {}-token batch, {slots} slots", chunk.len());
            } else {
                let w = worst_relative(&la, &lb);
                println!(
                    "{slots} slots, a {}-token batch: worst {w:.2e}",
                    chunk.len()
                );
                assert!(w < 1e-5, "{slots} slots: worst relative difference {w}");
            }
        }
        if one_round {
            assert_eq!(a, b, "the same session state");
        }
        let after = counts();
        let gathers = after[0] - before[0];
        let rounds = after[1] - before[1];
        println!("{slots} slots: {gathers} gathers, {rounds} rounds");
        // Every host layer of every step and batch gathered; nothing uploaded by groups.
        assert_eq!(gathers, layers.len() * (8 + 2), "{slots} slots");
        assert_eq!(after[2], before[2], "no group uploads");
        if one_round {
            assert_eq!(rounds, gathers);
        } else {
            // The 29-token batch selects every expert: ceil(n_expert / 6) rounds a layer.
            assert!(
                rounds >= gathers - layers.len() + layers.len() * n_expert.div_ceil(slots),
                "{rounds} rounds"
            );
        }
    }
    set_gather_slots(None);
}

/// The layer buffer (`forward.rs` `LayerBuffer`, on by default where the backend has expert
/// slots): between batches it holds the last host layer, which decode steps and small batches
/// run as resident (no gather); a batch of `offload::prefetch_min()` tokens fills it with each
/// host layer in turn before that layer's MoE (`Backend::prefetch_experts` / `await_experts`,
/// at once on the CPU) and leaves the last one in it. Every form gives the plain model's bits
/// (the same bytes, summed in the same order); the counters show which path each layer took.
#[test]
fn layer_buffer_runs_host_layers_as_resident() {
    use ds4_model::offload::{
        prefetch_min, BUFFERED_RUNS, GATHERS, LAYER_PREFETCHES, UPLOADED_GROUPS,
    };
    use std::sync::atomic::Ordering::Relaxed;
    let _g = globals();
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::NONE);
    let n_layer = plain.hp.n_layer as usize;
    let layers = ds4_model::offload::spread(3, n_layer);
    let last = *layers.last().unwrap();
    let host = load_gathering(&path, &layers, true);
    assert_eq!(host.host_expert_layers(), layers);
    assert_eq!(
        host.buffered_host_layer(),
        Some(last),
        "made holding the last"
    );
    let counts = || {
        [
            &BUFFERED_RUNS,
            &GATHERS,
            &LAYER_PREFETCHES,
            &UPLOADED_GROUPS,
        ]
        .map(|c| c.load(Relaxed))
    };
    let delta = |a: [usize; 4], b: [usize; 4]| [0, 1, 2, 3].map(|i| b[i] - a[i]);
    let n_big = prefetch_min() + 5;
    let toks: Vec<u32> = (0..n_big as u32 + 16)
        .map(|i| (i * 97 + 13) % 512)
        .collect();
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    // Decode steps: the last host layer from the buffer, the others gathered.
    let c0 = counts();
    for &t in &toks[..4] {
        assert_eq!(
            plain.eval(&mut a, t).unwrap(),
            host.eval(&mut b, t).unwrap()
        );
    }
    let k = layers.len();
    assert_eq!(delta(c0, counts()), [4, 4 * (k - 1), 0, 0], "decode steps");
    // A prompt batch: every host layer through the buffer, each copied ahead of its use.
    let c1 = counts();
    let big = &toks[4..4 + n_big];
    assert_eq!(
        plain.eval_batch(&mut a, big, true).unwrap(),
        host.eval_batch(&mut b, big, true).unwrap(),
        "a {n_big}-token batch"
    );
    assert_eq!(delta(c1, counts()), [k, 0, k, 0], "the big batch");
    assert_eq!(
        host.buffered_host_layer(),
        Some(last),
        "left holding the last"
    );
    // A small batch and decode steps after it: as before the big batch.
    let c2 = counts();
    let small = &toks[4 + n_big..8 + n_big];
    assert_eq!(
        plain.eval_batch(&mut a, small, true).unwrap(),
        host.eval_batch(&mut b, small, true).unwrap()
    );
    for &t in &toks[8 + n_big..] {
        assert_eq!(
            plain.eval(&mut a, t).unwrap(),
            host.eval(&mut b, t).unwrap()
        );
    }
    let steps = toks.len() - 8 - n_big;
    assert_eq!(
        delta(c2, counts()),
        [1 + steps, (1 + steps) * (k - 1), 0, 0],
        "small batch and decode steps"
    );
    assert_eq!(a, b, "the same session state");
}

/// Slots that find no room (device memory short): the schedule gives up on the gather for the
/// rest of the run and takes the paths of a backend without slots: decode steps on the host
/// (the plain model's bits), batches of `upload_min` tokens or more by groups uploaded (f32
/// order only), no gathers.
#[test]
fn slots_without_room_fall_back_to_the_host_and_group_paths() {
    use ds4_model::offload::{GATHERS, UPLOADED_GROUPS};
    use std::sync::atomic::Ordering::Relaxed;
    let _g = globals();
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::NONE);
    let n_layer = plain.hp.n_layer as usize;
    let layers = vec![n_layer - 2, n_layer - 1];
    // Room for 3 experts: less than any gather asks for (at least a token's 6).
    let host = load_placed_with(&path, layers, 4, 4, false, Some(3), Rounding::NONE);
    assert!(
        host.gathers_host_experts(),
        "asked for; the room runs out at the first batch"
    );
    let toks = tokens();
    let (g0, u0) = (GATHERS.load(Relaxed), UPLOADED_GROUPS.load(Relaxed));
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    for &t in &toks[..6] {
        assert_eq!(
            plain.eval(&mut a, t).unwrap(),
            host.eval(&mut b, t).unwrap()
        );
    }
    assert_eq!(
        UPLOADED_GROUPS.load(Relaxed),
        u0,
        "decode steps ran on the host"
    );
    let la = plain.eval_batch(&mut a, &toks[6..], true).unwrap();
    let lb = host.eval_batch(&mut b, &toks[6..], true).unwrap();
    let w = worst_relative(&la, &lb);
    assert!(w < 1e-5, "worst relative difference {w}");
    assert_eq!(GATHERS.load(Relaxed), g0, "nothing gathered");
    assert!(
        UPLOADED_GROUPS.load(Relaxed) > u0,
        "the batch uploaded groups"
    );
}

/// The CPU backend's decode-sized MoE calls (one parallel region for all slots' rows) give the
/// expert-by-expert form's bits: one token at a time, and batches of 2 and 10 tokens (60 slots,
/// the form's bound is 64).
#[test]
fn the_slots_form_gives_the_expert_by_expert_bits() {
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let slots = common::load(&path, Rounding::MODEL);
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let dir = bind_main(&file, &hp).unwrap();
    let b = CpuBackend::new(rope_tables(&hp)).with_moe_slots_max(0);
    let by_expert = Model::load(b, hp, &[(file, dir)], Rounding::MODEL, &mut |_, _| {}).unwrap();
    let (mut a, mut b) = (slots.new_state(), by_expert.new_state());
    let toks = tokens();
    for &t in &toks[..12] {
        assert_eq!(
            slots.eval(&mut a, t).unwrap(),
            by_expert.eval(&mut b, t).unwrap()
        );
    }
    for chunk in [&toks[12..14], &toks[14..24]] {
        assert_eq!(
            slots.eval_batch(&mut a, chunk, true).unwrap(),
            by_expert.eval_batch(&mut b, chunk, true).unwrap()
        );
    }
    assert_eq!(a, b, "the same session state");
}

#[test]
fn prompt_batches_run_the_selected_experts_group_by_group() {
    let _g = globals();
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::MODEL);
    let n_expert = plain.hp.n_expert as usize;
    // Groups of 3 experts (several groups, the last one short), batches of >= 4 tokens; the
    // last two layers only (the others as plain).
    let n_layer = plain.hp.n_layer as usize;
    let host = load_placed(&path, vec![n_layer - 2, n_layer - 1], 4, 3);
    assert!(
        n_expert > 3 && !n_expert.is_multiple_of(3),
        "{n_expert} experts"
    );
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    let la = plain.eval_batch(&mut a, &tokens(), true).unwrap();
    let lb = host.eval_batch(&mut b, &tokens(), true).unwrap();
    let mut worst = 0f32;
    for (x, y) in la.iter().zip(&lb) {
        let scale = x.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    assert!(worst < 1e-5, "worst relative difference {worst}");
    // Decode steps after the prompt take the host path: the same next logits as a plain model
    // would give from the grouped prompt's state (it holds the same rows to f32 order).
    let ta = plain.eval(&mut a, 5).unwrap();
    let tb = host.eval(&mut b, 5).unwrap();
    let scale = ta.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let d = ta
        .iter()
        .zip(&tb)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(d / scale < 1e-5, "decode after the prompt: {}", d / scale);
}

/// A stack of `e` experts of `rows x cols` random blocks of `ty` with small scales (F16: random
/// values in ±1/8).
fn random_stack(name: &str, ty: GgmlType, cols: u64, rows: u64, e: u64, seed: u64) -> HostStack {
    HostStack::in_memory(name, ty, [cols, rows, e], |out| {
        let mut x = seed | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for b in out.chunks_mut(8) {
            let v = next();
            for (i, o) in b.iter_mut().enumerate() {
                *o = (v >> (8 * i)) as u8;
            }
        }
        let scale = 0x2000u16.to_le_bytes(); // f16 2^-7
        let (blk, d_at): (usize, &[usize]) = match ty {
            GgmlType::IQ2_XXS | GgmlType::Q8_0 => (ty.block_bytes() as usize, &[0]),
            GgmlType::Q4_K => (144, &[0, 2]),
            GgmlType::Q2_K => (84, &[80, 82]),
            GgmlType::F16 => {
                for c in out.chunks_exact_mut(2) {
                    let v = (next() % 2001) as f32 / 8000.0 - 0.125;
                    c.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
                return Ok(());
            }
            _ => unreachable!("{ty}"),
        };
        for block in out.chunks_exact_mut(blk) {
            for &o in d_at {
                block[o..o + 2].copy_from_slice(&scale);
            }
        }
        Ok(())
    })
    .unwrap()
}

/// Row `r` of expert `e` of a stack, dequantised.
fn deq_row(s: &HostStack, e: usize, r: usize) -> Vec<f32> {
    let [cols, rows, _] = s.dims;
    let rb = s.ty.row_bytes(cols).unwrap() as usize;
    let at = (e * rows as usize + r) * rb;
    let mut w = vec![0f32; cols as usize];
    let b = s.bytes();
    ds4_quant::dequantize_row(s.ty, &b[at..at + rb], &mut w).unwrap();
    w
}

/// `x` as the act kernels see it: quantised in the format `ty`'s rows pair with and
/// dequantised (unchanged for a type without an act kernel on this machine's path).
fn as_int8(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    match ActKernel::new(ty) {
        Some(k) => QuantizedAct::new(k.format(), x).unwrap().dequantize(),
        None => x.to_vec(),
    }
}

/// A MoE call's spec (`ne` experts, `k` a token, `[ff, d]` gate/up), the rope tables a
/// `CpuHostExperts` takes, and an input `z [n, d]` of values in ±2.
fn moe_case(
    d: u64,
    ff: u64,
    ne: usize,
    k: usize,
    n: usize,
) -> (MoeSpec, ds4_backend::rope::RopeTables, Vec<f32>) {
    let spec = MoeSpec {
        n_expert: ne,
        n_used: k,
        d: d as usize,
        ff: ff as usize,
        weight_scale: 1.5,
        clamp: 10.0,
    };
    let z: Vec<f32> = (0..n * d as usize)
        .map(|i| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * 2.0)
        .collect();
    (spec, rope_tables(&HParams::tiny()), z)
}

/// `--precision fast`'s host experts: each product is the integer dot product of the weights'
/// codes with 8-bit activations. Held to an f64 reference over the dequantised weights and the
/// dequantised activations (relative RMS 1e-4: f32 sums, and an h value next to a rounding tie
/// may take the neighbouring code), which the f32-activation form misses by ~6e-3; per quant
/// mix, a type without act kernels (F16) staying exact.
#[test]
fn int8_activations_match_a_dequantised_reference() {
    let (d, ff, ne, k, n) = (512u64, 256u64, 8usize, 3usize, 2usize);
    let (spec, ropes, z) = moe_case(d, ff, ne, k, n);
    let sel = [1i32, 6, 3, 4, 1, 7];
    let wgt = [0.5f32, 0.25, 0.75, 0.4, 0.3, 0.2];
    for (tg, td) in [
        (GgmlType::IQ2_XXS, GgmlType::Q2_K),
        (GgmlType::Q4_K, GgmlType::Q4_K),
        (GgmlType::Q8_0, GgmlType::Q8_0),
        (GgmlType::F16, GgmlType::Q2_K),
    ] {
        let stacks = [
            random_stack("gate", tg, d, ff, ne as u64, 11),
            random_stack("up", tg, d, ff, ne as u64, 12),
            random_stack("down", td, ff, d, ne as u64, 13),
        ];
        let exact = CpuHostExperts::new(&stacks, &ropes).unwrap();
        let int8 = CpuHostExperts::new(&stacks, &ropes)
            .unwrap()
            .with_int8_activations();
        let got = int8.run(&spec, &z, &sel, &wgt, n);
        let plain = exact.run(&spec, &z, &sel, &wgt, n);
        let mut want = vec![0f64; n * d as usize];
        for t in 0..n {
            let zt = as_int8(tg, &z[t * d as usize..(t + 1) * d as usize]);
            for j in 0..k {
                let (e, w) = (sel[t * k + j] as usize, wgt[t * k + j]);
                let dot = |s: &HostStack, r: usize, x: &[f32]| -> f64 {
                    let row = deq_row(s, e, r);
                    row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
                };
                let h: Vec<f32> = (0..ff as usize)
                    .map(|r| {
                        let (g, u) = (
                            dot(&stacks[0], r, &zt) as f32,
                            dot(&stacks[1], r, &zt) as f32,
                        );
                        silu(g.min(spec.clamp)) * u.clamp(-spec.clamp, spec.clamp) * w
                    })
                    .collect();
                let ht = as_int8(td, &h);
                for r in 0..d as usize {
                    want[t * d as usize + r] += dot(&stacks[2], r, &ht);
                }
            }
        }
        let rel = |a: &[f32]| {
            let num: f64 = a
                .iter()
                .zip(&want)
                .map(|(&p, &q)| (p as f64 - q).powi(2))
                .sum();
            let den: f64 = want.iter().map(|q| q * q).sum();
            (num / den).sqrt()
        };
        println!(
            "{tg}/{td}: int8 form vs reference {:.2e}, f32 form vs reference {:.2e}",
            rel(&got),
            rel(&plain)
        );
        assert!(
            rel(&got) < 1e-4,
            "{tg}/{td}: int8 form off by {:.2e}",
            rel(&got)
        );
        assert!(
            rel(&plain) > 1e-3,
            "{tg}/{td}: the reference does not see the rounding"
        );
    }
}

/// A whole model with int8 host experts stays close to the plain model and is not silently
/// the exact form. Per position (relative RMS of the logits): the first position's ~2e-2 is the
/// activation rounding through 6 layers; later positions add discrete flips (the model's FP8 KV
/// rounding, the indexer's top-k), up to ~0.3 on this random model, so the median is held.
#[test]
fn int8_host_experts_stay_close_to_the_plain_model() {
    let path = ds4_synth::tiny_model_for_tests(7, false);
    let plain = common::load(&path, Rounding::MODEL);
    let n_layer = plain.hp.n_layer as usize;
    let host = load_placed_with(
        &path,
        (0..n_layer).collect(),
        usize::MAX,
        32,
        true,
        None,
        Rounding::MODEL,
    );
    let (mut a, mut b) = (plain.new_state(), host.new_state());
    let mut rels: Vec<f64> = tokens()
        .iter()
        .map(|&t| {
            let la = plain.eval(&mut a, t).unwrap();
            let lb = host.eval(&mut b, t).unwrap();
            let num: f64 = la
                .iter()
                .zip(&lb)
                .map(|(&p, &q)| (p as f64 - q as f64).powi(2))
                .sum();
            let den: f64 = la.iter().map(|&p| (p as f64).powi(2)).sum();
            (num / den).sqrt()
        })
        .collect();
    let first = rels[0];
    rels.sort_by(f64::total_cmp);
    let median = rels[rels.len() / 2];
    println!(
        "tiny model, every layer's experts int8 on the host: logits' relative RMS {first:.2e} at \
         the first position, median {median:.2e}, worst {:.2e}",
        rels[rels.len() - 1]
    );
    assert!(first > 1e-4 && first < 5e-2, "first position: {first:.2e}");
    assert!(median < 5e-2, "median: {median:.2e}");
}

/// A batch gathered in rounds (`offload::rounds`, the GPU's path for host-memory experts when a
/// batch selects more experts than the device slots hold): each round's experts copied into
/// slot stacks of `cap` experts, the MoE run on the slots with the round's selections and
/// masked weights, the rounds' outputs added. That sum is the whole MoE's (f32 order only):
/// masked pairs, which point at another slot of their token (or slot 0) with weight 0, add
/// nothing, and every selection is counted once.
#[test]
fn gather_rounds_add_up_to_the_whole_moe() {
    let (d, ff, ne, k, n, cap) = (512u64, 256u64, 12usize, 3usize, 7usize, 4usize);
    let (spec, ropes, z) = moe_case(d, ff, ne, k, n);
    // Distinct experts within a token, 11 of the 12 used (3 rounds of 4).
    let sel: Vec<i32> = (0..n * k)
        .map(|i| ((i / k) * 5 + (i % k) * 4) as i32 % 11)
        .collect();
    let wgt: Vec<f32> = (0..n * k).map(|i| 0.1 + (i % 5) as f32 * 0.2).collect();
    let stacks = [
        random_stack("gate", GgmlType::IQ2_XXS, d, ff, ne as u64, 21),
        random_stack("up", GgmlType::IQ2_XXS, d, ff, ne as u64, 22),
        random_stack("down", GgmlType::Q2_K, ff, d, ne as u64, 23),
    ];
    let want = CpuHostExperts::new(&stacks, &ropes)
        .unwrap()
        .run(&spec, &z, &sel, &wgt, n);
    let rounds = ds4_model::offload::rounds(&sel, Some(&wgt), k, cap).unwrap();
    assert_eq!(rounds.len(), 3, "11 experts in rounds of 4");
    let mut got = vec![0f32; n * d as usize];
    for r in &rounds {
        // The slots: the round's experts' slabs in order, the rest zero (never selected).
        let slots = stacks.each_ref().map(|st| {
            HostStack::in_memory(
                &st.name,
                st.ty,
                [st.dims[0], st.dims[1], cap as u64],
                |out| {
                    let slab = st.slab();
                    out.fill(0);
                    for (i, &e) in r.experts.iter().enumerate() {
                        out[i * slab..(i + 1) * slab].copy_from_slice(st.expert(e as usize));
                    }
                    Ok(())
                },
            )
            .unwrap()
        });
        let rspec = MoeSpec {
            n_expert: cap,
            ..spec
        };
        let part = CpuHostExperts::new(&slots, &ropes).unwrap().run(
            &rspec,
            &z,
            &r.sel,
            r.wgt.as_ref().unwrap(),
            n,
        );
        for (g, p) in got.iter_mut().zip(&part) {
            *g += p;
        }
    }
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!("rounds of {cap}: max |Δ| {diff:.3e} of max {scale:.3e}");
    assert!(
        scale > 0.0 && diff <= 1e-5 * scale,
        "rounds differ by {diff} of {scale}"
    );
}
