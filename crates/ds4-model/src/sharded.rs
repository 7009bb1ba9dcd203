//! An expert- (and tensor-) parallel model ([`ds4_backend::shard`]) as one [`Forward`]: every
//! call runs on all ranks at once, one thread each (a rank's all-reduces wait for the others),
//! and answers with rank 0's result. Ranks hold the same session state (the same tokens through
//! the same replicated schedule, MoE outputs made equal by the all-reduce), so a state's
//! snapshot is rank 0's and a restored one goes to every rank.

use crate::forward::{
    AnyCheckpoint, AnyLayerState, AnyState, Evaluated, Forward, HostState, Picked,
};
use crate::HParams;
use ds4_backend::{LayerDims, SampleParams};

/// Ranks `0 .. n` of one expert-parallel group, each a model loaded with its
/// [`ds4_backend::Shard`] on a backend of that group.
pub struct Sharded {
    ranks: Vec<Box<dyn Forward>>,
}

impl Sharded {
    /// `ranks[r]` must be rank r of the group (a rank's position is its place in the sum).
    pub fn new(ranks: Vec<Box<dyn Forward>>) -> Result<Sharded, String> {
        let Some(first) = ranks.first() else {
            return Err("an expert-parallel model needs at least one rank".into());
        };
        let dims = first.layer_dims();
        if ranks.iter().any(|r| r.layer_dims() != dims) {
            return Err("expert-parallel ranks of different models".into());
        }
        Ok(Sharded { ranks })
    }

    pub fn n_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// `f(rank, part)` on every rank at once with that rank's part (`parts[r]`); rank 0's
    /// value, or the first failing rank's error. Rank 0 runs on the caller's thread, the
    /// others on scoped threads (a decode step spawns n - 1 threads: ~10-20 us, well under a
    /// step's milliseconds, so no persistent workers).
    fn all<S: Send, T: Send>(
        &self,
        parts: &mut [S],
        f: impl Fn(&dyn Forward, &mut S) -> Result<T, String> + Sync,
    ) -> Result<T, String> {
        debug_assert_eq!(parts.len(), self.ranks.len());
        let f = &f;
        let mut out: Vec<Result<T, String>> = std::thread::scope(|s| {
            let mut it = self.ranks.iter().zip(parts.iter_mut());
            let (r0, p0) = it.next().expect("at least one rank (Sharded::new)");
            let hs: Vec<_> = it.map(|(r, p)| s.spawn(move || f(r.as_ref(), p))).collect();
            // A panic on this thread becomes rank 0's error, as a joined rank's does.
            let r0 = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r0.as_ref(), p0)));
            let mut out =
                vec![r0.unwrap_or_else(|_| Err("an expert-parallel rank panicked".into()))];
            out.extend(hs.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("an expert-parallel rank panicked".into()))
            }));
            out
        });
        if let Some(i) = out.iter().position(|r| r.is_err()) {
            return out.swap_remove(i).map_err(|e| format!("rank {i}: {e}"));
        }
        out.swap_remove(0)
    }

    /// The per-rank parts of a sharded value (built as a `Vec<T>`, one a rank).
    fn parts<T: 'static>(b: &mut Box<dyn std::any::Any + Send>) -> &mut Vec<T> {
        b.downcast_mut::<Vec<T>>()
            .expect("state of this expert-parallel model")
    }

    /// Run `f` with each rank's state, keeping the tokens of rank 0's state as the sharded
    /// state's.
    fn with_states<T: Send>(
        &self,
        st: &mut AnyState,
        f: impl Fn(&dyn Forward, &mut AnyState) -> Result<T, String> + Sync,
    ) -> Result<T, String> {
        let parts = Self::parts::<AnyState>(&mut st.layers);
        let r = self.all(parts, f);
        st.tokens = parts[0].tokens.clone();
        r
    }
}

impl Forward for Sharded {
    fn hp(&self) -> &HParams {
        self.ranks[0].hp()
    }
    fn backend_name(&self) -> String {
        format!(
            "{} x{} (parallel ranks)",
            self.ranks[0].backend_name(),
            self.ranks.len()
        )
    }
    fn prefill_chunk(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| r.prefill_chunk())
            .min()
            .unwrap_or(1)
    }
    fn weight_copy_bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.weight_copy_bytes()).sum()
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.ranks
            .iter()
            .filter_map(|r| r.device_memory())
            .min_by_key(|m| m.0)
    }
    fn new_state(&self, ctx: usize) -> AnyState {
        AnyState {
            tokens: Vec::new(),
            layers: Box::new(
                self.ranks
                    .iter()
                    .map(|r| r.new_state(ctx))
                    .collect::<Vec<_>>(),
            ),
        }
    }
    fn eval_batch(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        all: bool,
        streams: bool,
    ) -> Result<Evaluated, String> {
        self.with_states(st, |m, s| m.eval_batch(s, tokens, all, streams))
    }
    fn eval_sample(
        &self,
        st: &mut AnyState,
        token: u32,
        p: &SampleParams,
        u: f64,
    ) -> Result<u32, String> {
        // Every rank samples the same logits with the same draw: the same id.
        self.with_states(st, |m, s| m.eval_sample(s, token, p, u))
    }
    fn eval_pick(
        &self,
        st: &mut AnyState,
        tokens: &[u32],
        p: &SampleParams,
        draws: &[f64],
        streams: bool,
    ) -> Result<Picked, String> {
        // As eval_sample: the same logits and draws on every rank, the same ids.
        self.with_states(st, |m, s| m.eval_pick(s, tokens, p, draws, streams))
    }
    fn checkpoint(&self, st: &AnyState) -> AnyCheckpoint {
        let parts = st
            .layers
            .downcast_ref::<Vec<AnyState>>()
            .expect("state of this expert-parallel model");
        AnyCheckpoint(Box::new(
            self.ranks
                .iter()
                .zip(parts)
                .map(|(r, s)| r.checkpoint(s))
                .collect::<Vec<_>>(),
        ))
    }
    fn checkpoint_last(&self, st: &AnyState, pos: usize) -> Option<AnyCheckpoint> {
        let parts = st
            .layers
            .downcast_ref::<Vec<AnyState>>()
            .expect("state of this expert-parallel model");
        let cps = self
            .ranks
            .iter()
            .zip(parts)
            .map(|(r, s)| r.checkpoint_last(s, pos))
            .collect::<Option<Vec<_>>>()?;
        Some(AnyCheckpoint(Box::new(cps)))
    }
    fn rollback(&self, st: &mut AnyState, cp: AnyCheckpoint) {
        let cps = *cp
            .0
            .downcast::<Vec<AnyCheckpoint>>()
            .expect("checkpoint of this expert-parallel model");
        let parts = Self::parts::<AnyState>(&mut st.layers);
        for ((r, s), c) in self.ranks.iter().zip(parts.iter_mut()).zip(cps) {
            r.rollback(s, c);
        }
        st.tokens = parts[0].tokens.clone();
    }
    fn state_to_host(&self, st: &AnyState) -> HostState {
        let parts = st
            .layers
            .downcast_ref::<Vec<AnyState>>()
            .expect("state of this expert-parallel model");
        self.ranks[0].state_to_host(&parts[0])
    }
    fn state_from_host(&self, h: &HostState, ctx: usize) -> AnyState {
        AnyState {
            tokens: h.tokens.clone(),
            layers: Box::new(
                self.ranks
                    .iter()
                    .map(|r| r.state_from_host(h, ctx))
                    .collect::<Vec<_>>(),
            ),
        }
    }
    fn layer_dims(&self) -> Vec<LayerDims> {
        self.ranks[0].layer_dims()
    }
    fn has_mtp(&self) -> bool {
        self.ranks.iter().all(|r| r.has_mtp())
    }
    fn new_mtp_state(&self) -> AnyLayerState {
        AnyLayerState(Box::new(
            self.ranks
                .iter()
                .map(|r| r.new_mtp_state())
                .collect::<Vec<_>>(),
        ))
    }
    fn mtp_eval(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), String> {
        self.all(Self::parts::<AnyLayerState>(&mut st.0), |m, s| {
            m.mtp_eval(s, hs, tok, pos)
        })
    }
    fn mtp_draft(
        &self,
        st: &mut AnyLayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> Result<u32, String> {
        // Every rank picks from the same logits: the same id.
        self.all(Self::parts::<AnyLayerState>(&mut st.0), |m, s| {
            m.mtp_draft(s, hs, tok, pos)
        })
    }
}
