//! The CPU forward pass on a synthesised tiny model (q2 quant mix): runs through every path
//! (hash layers, CSA with the indexer selecting a strict subset, HCA, window wrap) and is
//! deterministic. Correctness against an independent implementation is `oracle.rs`.

mod common;

#[test]
fn tiny_synthetic_model_decodes_deterministically() {
    let m = common::tiny(7);
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 97 + 13) % 512).collect();
    let mut a = m.new_state();
    let mut b = m.new_state();
    let mut last = Vec::new();
    for &t in &tokens {
        let la = m.eval(&mut a, t).unwrap();
        let lb = m.eval(&mut b, t).unwrap();
        assert_eq!(la, lb, "same input, same logits");
        assert!(la.iter().all(|v| v.is_finite()));
        assert_ne!(la, last, "logits change with the position");
        last = la;
    }
    // 40 tokens: 10 CSA rows (> top-k 4: the indexer selects a strict subset), 5 HCA rows.
    let l2 = &a.layers[2];
    assert_eq!(l2.comp.as_ref().unwrap().rows.len(), 10 * 128);
    assert_eq!(l2.index.as_ref().unwrap().rows.len(), 10 * 128);
    assert_eq!(a.layers[3].comp.as_ref().unwrap().rows.len(), 5 * 128);
}
