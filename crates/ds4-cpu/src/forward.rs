//! The DS4 forward pass on the CPU, one token at a time (model.md §3.2–3.5). f32 activations
//! everywhere: this is the reference other backends are tested against.

use crate::math::{self, dot, rms_norm, sigmoid, silu, softmax, softplus};
use crate::rope::Rope;
use crate::weights::{Mat, Weights};
use ds4_model::{AttnKind, HParams, LayerKind};

/// The rounding steps the published model was validated with (design.md "Semantics to keep
/// exact"); each can be switched off to compare against plain HF transformers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounding {
    /// FP8 (E4M3) round trip of raw and compressed KV rows (non-RoPE part).
    pub fp8_kv: bool,
    /// Hadamard + FP4 (E2M1) round trip of indexer queries and rows.
    pub fp4_indexer: bool,
    /// Cache rows stored at f16 precision.
    pub f16_cache: bool,
}

impl Rounding {
    /// The model's semantics (default).
    pub const MODEL: Rounding = Rounding {
        fp8_kv: true,
        fp4_indexer: true,
        f16_cache: true,
    };
    /// No rounding: plain float math, as HF transformers computes.
    pub const NONE: Rounding = Rounding {
        fp8_kv: false,
        fp4_indexer: false,
        f16_cache: false,
    };
}

struct Hc {
    mixer: Mat, // [N·D → (2+N)·N]
    scale: Vec<f32>,
    base: Vec<f32>,
}

struct Compressor {
    ape: Mat, // ratio rows of width w
    kv: Mat,
    gate: Mat,
    norm: Vec<f32>,
    ratio: usize,
    coff: usize,
    /// Row width after pooling (512 attention, 128 indexer).
    d: usize,
}

struct Indexer {
    q_b: Mat,
    proj: Mat,
    comp: Compressor,
}

/// The MTP speculative head's weights (model.md §2.5, §3.7).
struct Mtp {
    block: Layer,
    e_proj: Mat,
    h_proj: Mat,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    norm: Vec<f32>,
    head: Hc,
}

struct Layer {
    kind: LayerKind,
    hc_attn: Hc,
    attn_norm: Vec<f32>,
    q_a: Mat,
    q_a_norm: Vec<f32>,
    q_b: Mat,
    kv: Mat,
    kv_norm: Vec<f32>,
    sinks: Vec<f32>,
    out_a: Mat,
    out_b: Mat,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
    hc_ffn: Hc,
    ffn_norm: Vec<f32>,
    router: Mat,
    bias: Option<Vec<f32>>,
    tid2eid: Option<Vec<i32>>,
    gate_exps: Mat,
    up_exps: Mat,
    down_exps: Mat,
    gate_sh: Mat,
    up_sh: Mat,
    down_sh: Mat,
    clamp: f32,
    clamp_sh: f32,
}

pub struct CpuModel {
    pub hp: HParams,
    pub rounding: Rounding,
    w: Weights,
    embd: Mat,
    out_hc: Hc,
    out_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    mtp: Option<Mtp>,
    rope_swa: Rope,
    rope_comp: Rope,
}

/// Compressor frontier and emitted rows (model.md §4.1).
#[derive(Clone, Debug, PartialEq)]
pub struct CompState {
    /// `coff·ratio` rows × `coff·d` columns each.
    pub front_kv: Vec<f32>,
    pub front_score: Vec<f32>,
    /// Emitted rows, `d` values each, append-only.
    pub rows: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerState {
    /// Ring of raw KV rows: position p lives in slot p mod window.
    pub raw: Vec<f32>,
    /// Position held by each ring slot (−1: empty). Main layers see every position; the MTP
    /// block only the ones it ran at, so attention reads a slot only if it holds position p.
    pub raw_pos: Vec<i64>,
    pub comp: Option<CompState>,
    pub index: Option<CompState>,
}

/// Everything a session needs to continue exactly (model.md §4.3).
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerState>,
}

impl State {
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// What speculative verification may change: the raw rings, the compressor frontiers and
    /// the row counts (model.md §4.4). Rows are append-only, so they are truncated, not copied.
    pub fn checkpoint(&self) -> Checkpoint {
        let comp = |c: &Option<CompState>| {
            c.as_ref()
                .map(|c| (c.front_kv.clone(), c.front_score.clone(), c.rows.len()))
        };
        Checkpoint {
            n_tokens: self.tokens.len(),
            layers: self
                .layers
                .iter()
                .map(|l| {
                    (
                        l.raw.clone(),
                        l.raw_pos.clone(),
                        comp(&l.comp),
                        comp(&l.index),
                    )
                })
                .collect(),
        }
    }

    /// Return to a checkpoint taken on this state.
    pub fn rollback(&mut self, cp: Checkpoint) {
        self.tokens.truncate(cp.n_tokens);
        for (l, (raw, pos, comp, index)) in self.layers.iter_mut().zip(cp.layers) {
            l.raw = raw;
            l.raw_pos = pos;
            for (dst, src) in [(&mut l.comp, comp), (&mut l.index, index)] {
                if let (Some(c), Some((kv, score, rows))) = (dst.as_mut(), src) {
                    c.front_kv = kv;
                    c.front_score = score;
                    c.rows.truncate(rows);
                }
            }
        }
    }
}

type CompCheckpoint = Option<(Vec<f32>, Vec<f32>, usize)>;

/// A point to return to after rejected speculative tokens ([`State::checkpoint`]).
pub struct Checkpoint {
    n_tokens: usize,
    layers: Vec<(Vec<f32>, Vec<i64>, CompCheckpoint, CompCheckpoint)>,
}

fn hc(w: &Weights, prefix: &str, which: &str) -> Hc {
    Hc {
        mixer: w.mat(&format!("{prefix}{which}_fn.weight")),
        scale: w.vec(&format!("{prefix}{which}_scale.weight")),
        base: w.vec(&format!("{prefix}{which}_base.weight")),
    }
}

fn compressor(w: &Weights, p: &str, ratio: usize, coff: usize, d: usize) -> Compressor {
    Compressor {
        ape: w.mat(&format!("{p}_ape.weight")),
        kv: w.mat(&format!("{p}_kv.weight")),
        gate: w.mat(&format!("{p}_gate.weight")),
        norm: w.vec(&format!("{p}_norm.weight")),
        ratio,
        coff,
        d,
    }
}

/// Weights of one transformer block with name prefix `p` (`blk.7.` or `mtp.0.`).
fn build_layer(w: &Weights, hp: &HParams, p: &str, kind: LayerKind) -> Layer {
    let m = |n: &str| w.mat(&format!("{p}{n}.weight"));
    let v = |n: &str| w.vec(&format!("{p}{n}.weight"));
    // The MTP block uses the last layer's clamp (every published layer has the same one).
    let l = (kind.index as usize).min(hp.swiglu_clamp.len() - 1);
    let hd = hp.head_dim as usize;
    let comp = kind.compressed().then(|| {
        compressor(
            w,
            &format!("{p}attn_compressor"),
            kind.ratio as usize,
            kind.coff() as usize,
            hd,
        )
    });
    let indexer = kind.has_indexer().then(|| Indexer {
        q_b: m("indexer.attn_q_b"),
        proj: m("indexer.proj"),
        comp: compressor(
            w,
            &format!("{p}indexer_compressor"),
            4,
            2,
            hp.indexer_head_dim as usize,
        ),
    });
    Layer {
        kind,
        hc_attn: hc(w, p, "hc_attn"),
        attn_norm: v("attn_norm"),
        q_a: m("attn_q_a"),
        q_a_norm: v("attn_q_a_norm"),
        q_b: m("attn_q_b"),
        kv: m("attn_kv"),
        kv_norm: v("attn_kv_a_norm"),
        sinks: v("attn_sinks"),
        out_a: m("attn_output_a"),
        out_b: m("attn_output_b"),
        comp,
        indexer,
        hc_ffn: hc(w, p, "hc_ffn"),
        ffn_norm: v("ffn_norm"),
        router: m("ffn_gate_inp"),
        bias: (!kind.hash_routed).then(|| w.vec(&format!("{p}exp_probs_b.bias"))),
        tid2eid: kind
            .hash_routed
            .then(|| w.i32s(&format!("{p}ffn_gate_tid2eid.weight"))),
        gate_exps: m("ffn_gate_exps"),
        up_exps: m("ffn_up_exps"),
        down_exps: m("ffn_down_exps"),
        gate_sh: m("ffn_gate_shexp"),
        up_sh: m("ffn_up_shexp"),
        down_sh: m("ffn_down_shexp"),
        clamp: hp.swiglu_clamp[l],
        clamp_sh: hp
            .swiglu_clamp_shexp
            .as_ref()
            .map_or(hp.swiglu_clamp[l], |s| s[l.min(s.len() - 1)]),
    }
}

impl CpuModel {
    pub fn new(hp: HParams, w: Weights, rounding: Rounding) -> CpuModel {
        let layers = hp
            .layers()
            .map(|kind| build_layer(&w, &hp, &format!("blk.{}.", kind.index), kind))
            .collect();
        // The MTP block (model.md §3.7): an SWA-only, bias-routed layer with its own head.
        let mtp = w.has("mtp.0.e_proj.weight").then(|| {
            let kind = LayerKind {
                index: hp.n_layer,
                ratio: 0,
                attn: AttnKind::Swa,
                hash_routed: false,
            };
            Mtp {
                block: build_layer(&w, &hp, "mtp.0.", kind),
                e_proj: w.mat("mtp.0.e_proj.weight"),
                h_proj: w.mat("mtp.0.h_proj.weight"),
                enorm: w.vec("mtp.0.enorm.weight"),
                hnorm: w.vec("mtp.0.hnorm.weight"),
                norm: w.vec("mtp.0.norm.weight"),
                head: hc(&w, "mtp.0.", "hc_head"),
            }
        });
        let n_rot = hp.n_rot as usize;
        CpuModel {
            rope_swa: Rope::plain(hp.rope_base, n_rot),
            rope_comp: Rope::yarn(
                hp.compress_rope_base,
                n_rot,
                hp.rope_scale_factor,
                hp.rope_orig_ctx,
                hp.yarn_beta_fast,
                hp.yarn_beta_slow,
            ),
            embd: w.mat("token_embd.weight"),
            out_hc: Hc {
                mixer: w.mat("output_hc_fn.weight"),
                scale: w.vec("output_hc_scale.weight"),
                base: w.vec("output_hc_base.weight"),
            },
            out_norm: w.vec("output_norm.weight"),
            output: w.mat("output.weight"),
            layers,
            mtp,
            hp,
            rounding,
            w,
        }
    }

    /// A fresh session state.
    pub fn new_state(&self) -> State {
        let hd = self.hp.head_dim as usize;
        let win = self.hp.sliding_window as usize;
        let front = |c: &Compressor| {
            let n = c.coff * c.ratio * c.coff * c.d;
            CompState {
                front_kv: vec![0.0; n],
                front_score: vec![f32::NEG_INFINITY; n],
                rows: Vec::new(),
            }
        };
        State {
            tokens: Vec::new(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerState {
                    raw: vec![0.0; win * hd],
                    raw_pos: vec![-1; win],
                    comp: l.comp.as_ref().map(front),
                    index: l.indexer.as_ref().map(|i| front(&i.comp)),
                })
                .collect(),
        }
    }

    fn rope(&self, kind: &LayerKind) -> &Rope {
        if kind.attn == AttnKind::Swa {
            &self.rope_swa
        } else {
            &self.rope_comp
        }
    }

    /// Process one token at the next position; returns the logits after it.
    pub fn eval(&self, st: &mut State, token: u32) -> Vec<f32> {
        self.eval_batch(st, &[token], false)
            .pop()
            .unwrap_or_default()
    }

    /// Process `tokens` at the next positions as one batch (layer-major: every projection is a
    /// matrix product over the batch, the causal parts run token by token in order). Returns
    /// the logits after every position (`all`) or after the last one. Every number is
    /// bit-identical to evaluating the tokens one at a time: the matrix products give each
    /// token exactly its matvec, and the per-token arithmetic is the same code.
    pub fn eval_batch(&self, st: &mut State, tokens: &[u32], all: bool) -> Vec<Vec<f32>> {
        self.eval_batch_streams(st, tokens, all).0
    }

    /// [`CpuModel::eval_batch`] that also returns the final hyper-connection streams (N·D
    /// values, before the head) of the same positions — the MTP block's input.
    pub fn eval_batch_streams(
        &self,
        st: &mut State,
        tokens: &[u32],
        all: bool,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let hp = &self.hp;
        let d = hp.n_embd as usize;
        let nhc = hp.hc_count as usize;
        let n = tokens.len();
        if n == 0 {
            return (Vec::new(), Vec::new());
        }
        let t0 = st.tokens.len();
        // Hyper-connection streams of token i: x[i·N·D ..], stream-major inside.
        let mut x = vec![0f32; n * nhc * d];
        let mut e = vec![0f32; d];
        for (i, &tok) in tokens.iter().enumerate() {
            self.w.row(&self.embd, tok as usize, &mut e);
            for k in 0..nhc {
                x[(i * nhc + k) * d..(i * nhc + k + 1) * d].copy_from_slice(&e);
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            self.layer_forward(layer, &mut st.layers[l], &mut x, tokens, t0);
        }
        st.tokens.extend_from_slice(tokens);
        let first = if all { 0 } else { n - 1 };
        let streams: Vec<Vec<f32>> = (first..n)
            .map(|i| x[i * nhc * d..(i + 1) * nhc * d].to_vec())
            .collect();
        let logits = streams
            .iter()
            .map(|xs| self.head(&self.out_hc, &self.out_norm, xs))
            .collect();
        (logits, streams)
    }

    /// One transformer block over the batch: HC pre, attention, HC post, HC pre, MoE, HC post.
    fn layer_forward(
        &self,
        layer: &Layer,
        st: &mut LayerState,
        x: &mut [f32],
        tokens: &[u32],
        t0: usize,
    ) {
        let hp = &self.hp;
        let d = hp.n_embd as usize;
        let nhc = hp.hc_count as usize;
        let n = tokens.len();
        let post_all = |x: &mut [f32], o: &[f32], post: &[f32], comb: &[f32]| {
            for i in 0..n {
                let xs = &mut x[i * nhc * d..(i + 1) * nhc * d];
                let (p, c) = (
                    &post[i * nhc..(i + 1) * nhc],
                    &comb[i * nhc * nhc..(i + 1) * nhc * nhc],
                );
                hc_post(xs, &o[i * d..(i + 1) * d], p, c, nhc);
            }
        };
        let (mut z, post, comb) = self.hc_pre(&layer.hc_attn, x, n);
        z.chunks_mut(d)
            .for_each(|z| rms_norm(z, Some(&layer.attn_norm), hp.rms_eps));
        let o = self.attention(layer, st, &z, t0);
        post_all(x, &o, &post, &comb);
        let (mut z, post, comb) = self.hc_pre(&layer.hc_ffn, x, n);
        z.chunks_mut(d)
            .for_each(|z| rms_norm(z, Some(&layer.ffn_norm), hp.rms_eps));
        let y = self.moe(layer, &z, tokens);
        post_all(x, &y, &post, &comb);
    }

    /// Whether an MTP block is loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// A fresh state for the MTP block: its own raw window ring (model.md §3.7).
    pub fn new_mtp_state(&self) -> LayerState {
        let hd = self.hp.head_dim as usize;
        let win = self.hp.sliding_window as usize;
        LayerState {
            raw: vec![0.0; win * hd],
            raw_pos: vec![-1; win],
            comp: None,
            index: None,
        }
    }

    /// The MTP block at position `pos` on token `tok` and hidden streams `hs` (N·D): returns its
    /// logits (a guess for the token after `tok`) and its output streams. Panics without MTP
    /// weights ([`CpuModel::has_mtp`]).
    pub fn mtp_eval(
        &self,
        st: &mut LayerState,
        hs: &[f32],
        tok: u32,
        pos: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let mtp = self.mtp.as_ref().expect("MTP weights loaded");
        let hp = &self.hp;
        let d = hp.n_embd as usize;
        let nhc = hp.hc_count as usize;
        let mut e = vec![0f32; d];
        self.w.row(&self.embd, tok as usize, &mut e);
        rms_norm(&mut e, Some(&mtp.enorm), hp.rms_eps);
        let mut ep = vec![0f32; d];
        self.w.matvec(&mtp.e_proj, None, &e, &mut ep);
        let mut x = vec![0f32; nhc * d];
        let mut h = vec![0f32; d];
        for i in 0..nhc {
            h.copy_from_slice(&hs[i * d..(i + 1) * d]);
            rms_norm(&mut h, Some(&mtp.hnorm), hp.rms_eps);
            let xi = &mut x[i * d..(i + 1) * d];
            self.w.matvec(&mtp.h_proj, None, &h, xi);
            xi.iter_mut().zip(&ep).for_each(|(x, e)| *x += e);
        }
        self.layer_forward(&mtp.block, st, &mut x, &[tok], pos);
        (self.head(&mtp.head, &mtp.norm, &x), x)
    }

    /// HC split + collapse for `n` tokens (model.md §3.1): returns `Σ pre_i X[i]` (n × D),
    /// `post` (n × N) and the Sinkhorn-normalised `comb` (n × N·N, row-major `A[a][b]`).
    fn hc_pre(&self, h: &Hc, x: &[f32], n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let hp = &self.hp;
        let nhc = hp.hc_count as usize;
        let d = hp.n_embd as usize;
        let eps = hp.hc_eps;
        let mix = (2 + nhc) * nhc;
        let mut s = x.to_vec();
        s.chunks_mut(nhc * d)
            .for_each(|s| rms_norm(s, None, hp.rms_eps));
        let mut ms = vec![0f32; n * mix];
        self.w.matmul(&h.mixer, None, &s, &mut ms);
        let mut y = vec![0f32; n * d];
        let mut posts = Vec::with_capacity(n * nhc);
        let mut combs = Vec::with_capacity(n * nhc * nhc);
        for (t, m) in ms.chunks(mix).enumerate() {
            let pre: Vec<f32> = (0..nhc)
                .map(|i| sigmoid(m[i] * h.scale[0] + h.base[i]) + eps)
                .collect();
            posts
                .extend((0..nhc).map(|i| 2.0 * sigmoid(m[nhc + i] * h.scale[1] + h.base[nhc + i])));
            let mut a: Vec<f32> = (0..nhc * nhc)
                .map(|k| m[2 * nhc + k] * h.scale[2] + h.base[2 * nhc + k])
                .collect();
            for row in a.chunks_mut(nhc) {
                softmax(row);
                row.iter_mut().for_each(|v| *v += eps);
            }
            let norm_cols = |a: &mut [f32]| {
                for b in 0..nhc {
                    let s: f32 = (0..nhc).map(|r| a[r * nhc + b]).sum::<f32>() + eps;
                    (0..nhc).for_each(|r| a[r * nhc + b] /= s);
                }
            };
            norm_cols(&mut a);
            for _ in 1..hp.hc_sinkhorn_iters {
                for row in a.chunks_mut(nhc) {
                    let s: f32 = row.iter().sum::<f32>() + eps;
                    row.iter_mut().for_each(|v| *v /= s);
                }
                norm_cols(&mut a);
            }
            combs.extend_from_slice(&a);
            let xt = &x[t * nhc * d..(t + 1) * nhc * d];
            let yt = &mut y[t * d..(t + 1) * d];
            for i in 0..nhc {
                for k in 0..d {
                    yt[k] += pre[i] * xt[i * d + k];
                }
            }
        }
        (y, posts, combs)
    }

    /// Attention sublayer for `n = z.len() / D` tokens at positions `t0 ..` (model.md §3.3).
    fn attention(&self, l: &Layer, st: &mut LayerState, z: &[f32], t0: usize) -> Vec<f32> {
        let hp = &self.hp;
        let rnd = self.rounding;
        let d = hp.n_embd as usize;
        let n = z.len() / d;
        let hd = hp.head_dim as usize;
        let nh = hp.n_head as usize;
        let n_rot = hp.n_rot as usize;
        let rank = hp.q_lora_rank as usize;
        let rope = self.rope(&l.kind);
        // Query: low rank, norm, expand, per-head unweighted norm, RoPE.
        let mut cq = vec![0f32; n * rank];
        self.w.matmul(&l.q_a, None, z, &mut cq);
        cq.chunks_mut(rank)
            .for_each(|c| rms_norm(c, Some(&l.q_a_norm), hp.rms_eps));
        let mut q = vec![0f32; n * nh * hd];
        self.w.matmul(&l.q_b, None, &cq, &mut q);
        for (i, qt) in q.chunks_mut(nh * hd).enumerate() {
            for h in qt.chunks_mut(hd) {
                rms_norm(h, None, hp.rms_eps);
                rope.apply(h, (t0 + i) as u64, false);
            }
        }
        // The shared KV row of each position.
        let mut kv = vec![0f32; n * hd];
        self.w.matmul(&l.kv, None, z, &mut kv);
        for (i, k) in kv.chunks_mut(hd).enumerate() {
            rms_norm(k, Some(&l.kv_norm), hp.rms_eps);
            rope.apply(k, (t0 + i) as u64, false);
            if rnd.fp8_kv {
                math::fp8_sim(k, hd - n_rot);
            }
            if rnd.f16_cache {
                math::f16_round(k);
            }
        }
        // Compressor and indexer projections for the whole batch.
        let proj = |c: &Compressor| {
            let w = c.coff * c.d;
            let (mut a, mut g) = (vec![0f32; n * w], vec![0f32; n * w]);
            self.w.matmul(&c.kv, None, z, &mut a);
            self.w.matmul(&c.gate, None, z, &mut g);
            (a, g)
        };
        let comp_proj = l.comp.as_ref().map(proj);
        let idx_proj = l.indexer.as_ref().map(|ix| {
            let ihd = hp.indexer_head_dim as usize;
            let inh = hp.indexer_heads as usize;
            let (a, g) = proj(&ix.comp);
            let mut iq = vec![0f32; n * inh * ihd];
            self.w.matmul(&ix.q_b, None, &cq, &mut iq);
            let mut iw = vec![0f32; n * inh];
            self.w.matmul(&ix.proj, None, z, &mut iw);
            (a, g, iq, iw)
        });

        let win = hp.sliding_window as usize;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = vec![0f32; n * nh * hd];
        for i in 0..n {
            let t = t0 + i;
            // Raw row into the ring. Later tokens of the batch have not been written yet, so
            // the ring still holds every row token t can see.
            st.raw[(t % win) * hd..(t % win + 1) * hd].copy_from_slice(&kv[i * hd..(i + 1) * hd]);
            st.raw_pos[t % win] = t as i64;
            // Compressors before attention: a row closed by this token is already visible.
            if let (Some(c), Some(cs), Some((a, g))) = (&l.comp, st.comp.as_mut(), &comp_proj) {
                let w = c.coff * c.d;
                if let Some(mut row) =
                    self.compress(c, cs, &a[i * w..(i + 1) * w], &g[i * w..(i + 1) * w], t)
                {
                    let nrow = cs.rows.len() / c.d;
                    rope.apply(&mut row, (c.ratio * nrow) as u64, false);
                    if rnd.fp8_kv {
                        math::fp8_sim(&mut row, hd - n_rot);
                    }
                    if rnd.f16_cache {
                        math::f16_round(&mut row);
                    }
                    cs.rows.extend_from_slice(&row);
                }
            }
            if let (Some(ix), Some(is), Some((a, g, _, _))) =
                (&l.indexer, st.index.as_mut(), &idx_proj)
            {
                let w = ix.comp.coff * ix.comp.d;
                if let Some(mut row) = self.compress(
                    &ix.comp,
                    is,
                    &a[i * w..(i + 1) * w],
                    &g[i * w..(i + 1) * w],
                    t,
                ) {
                    let nrow = is.rows.len() / ix.comp.d;
                    rope.apply(&mut row, (4 * nrow) as u64, false);
                    if rnd.fp4_indexer {
                        math::fp4_hadamard_sim(&mut row);
                    }
                    if rnd.f16_cache {
                        math::f16_round(&mut row);
                    }
                    is.rows.extend_from_slice(&row);
                }
            }
            // Visible compressed rows: all for HCA; for CSA all up to top-k, else the indexer's.
            let comp_rows: &[f32] = st.comp.as_ref().map_or(&[], |c| &c.rows);
            let n_comp = comp_rows.len() / hd;
            let selected: Vec<usize> = match (&st.index, &idx_proj) {
                (Some(is), Some((_, _, iq, iw))) if n_comp > hp.indexer_top_k as usize => {
                    let inh = hp.indexer_heads as usize;
                    let ihd = hp.indexer_head_dim as usize;
                    self.index_select(
                        &is.rows,
                        &iq[i * inh * ihd..(i + 1) * inh * ihd],
                        &iw[i * inh..(i + 1) * inh],
                        t,
                        rope,
                    )
                }
                _ => (0..n_comp).collect(),
            };
            // Attention with sinks over raw rows (positions max(0, t−W+1) ..= t) + selected.
            let first = (t + 1).saturating_sub(win);
            let rows: Vec<&[f32]> = (first..=t)
                .filter(|&p| st.raw_pos[p % win] == p as i64)
                .map(|p| &st.raw[(p % win) * hd..(p % win + 1) * hd])
                .chain(selected.iter().map(|&r| &comp_rows[r * hd..(r + 1) * hd]))
                .collect();
            let mut scores = vec![0f32; rows.len()];
            let qi = &q[i * nh * hd..(i + 1) * nh * hd];
            let oi = &mut o[i * nh * hd..(i + 1) * nh * hd];
            for h in 0..nh {
                let qh = &qi[h * hd..(h + 1) * hd];
                for (s, r) in scores.iter_mut().zip(&rows) {
                    *s = dot(qh, r) * scale;
                }
                let sink = l.sinks[h];
                let m = scores.iter().copied().fold(sink, f32::max);
                let mut zsum = (sink - m).exp();
                for s in scores.iter_mut() {
                    *s = (*s - m).exp();
                    zsum += *s;
                }
                let oh = &mut oi[h * hd..(h + 1) * hd];
                for (s, r) in scores.iter().zip(&rows) {
                    let p = s / zsum;
                    oh.iter_mut().zip(r.iter()).for_each(|(o, v)| *o += p * v);
                }
                // Values are the rotated keys: undo the rotation at the query position.
                rope.apply(oh, t as u64, true);
            }
        }

        // Grouped low-rank output projection: group g maps heads g·H/G .. to rank values.
        let groups = hp.o_groups as usize;
        let orank = hp.o_lora_rank as usize;
        let gin = hp.o_group_in() as usize;
        let mut u = vec![0f32; n * groups * orank];
        let mut og = vec![0f32; n * gin];
        let mut ug = vec![0f32; n * orank];
        for g in 0..groups {
            for i in 0..n {
                og[i * gin..(i + 1) * gin]
                    .copy_from_slice(&o[i * nh * hd + g * gin..i * nh * hd + (g + 1) * gin]);
            }
            self.w.matmul_rows(&l.out_a, g * orank, &og, &mut ug);
            for i in 0..n {
                u[i * groups * orank + g * orank..i * groups * orank + (g + 1) * orank]
                    .copy_from_slice(&ug[i * orank..(i + 1) * orank]);
            }
        }
        let mut out = vec![0f32; n * d];
        self.w.matmul(&l.out_b, None, &u, &mut out);
        out
    }

    /// One compressor step (model.md §3.3, frontier rule of §4.1) with this token's projections
    /// `a` and gate `g` (before `ape`). Returns the pooled, normalised row when this token closes
    /// a window (not yet rotated or rounded).
    fn compress(
        &self,
        c: &Compressor,
        cs: &mut CompState,
        a: &[f32],
        g: &[f32],
        t: usize,
    ) -> Option<Vec<f32>> {
        let w = c.coff * c.d;
        let r = c.ratio;
        let mut ape = vec![0f32; w];
        self.w.row(&c.ape, t % r, &mut ape);
        let slot = if c.coff == 2 { r + t % r } else { t % r };
        cs.front_kv[slot * w..(slot + 1) * w].copy_from_slice(a);
        for ((s, g), b) in cs.front_score[slot * w..(slot + 1) * w]
            .iter_mut()
            .zip(g)
            .zip(&ape)
        {
            *s = g + b;
        }
        if !(t + 1).is_multiple_of(r) {
            return None;
        }
        let mut p = vec![0f32; c.d];
        let mut sc = vec![0f32; c.coff * r];
        for (j, pj) in p.iter_mut().enumerate() {
            // Candidates per channel: HCA the r tokens of this window; CSA the A-half (columns
            // 0..d) of the previous window (rows 0..r) and the B-half (columns d..2d) of this one.
            let cand = |i: usize| {
                if c.coff == 2 && i >= r {
                    i * w + c.d + j
                } else {
                    i * w + j
                }
            };
            for (i, s) in sc.iter_mut().enumerate() {
                *s = cs.front_score[cand(i)];
            }
            softmax(&mut sc);
            *pj = sc
                .iter()
                .enumerate()
                .map(|(i, s)| s * cs.front_kv[cand(i)])
                .sum();
        }
        if c.coff == 2 {
            // This window becomes the previous one.
            cs.front_kv.copy_within(r * w..2 * r * w, 0);
            cs.front_score.copy_within(r * w..2 * r * w, 0);
        }
        rms_norm(&mut p, Some(&c.norm), self.hp.rms_eps);
        Some(p)
    }

    /// Lightning indexer: the `top_k` compressed rows with the largest scores (ties: lower
    /// index first), ascending. `q` is this token's indexer query (heads × head dim, before
    /// RoPE), `wts` its head weights (before scaling).
    fn index_select(
        &self,
        rows: &[f32],
        q: &[f32],
        wts: &[f32],
        t: usize,
        rope: &Rope,
    ) -> Vec<usize> {
        let hp = &self.hp;
        let ihd = hp.indexer_head_dim as usize;
        let nh = hp.indexer_heads as usize;
        let mut q = q.to_vec();
        for h in q.chunks_mut(ihd) {
            rope.apply(h, t as u64, false);
            if self.rounding.fp4_indexer {
                math::fp4_hadamard_sim(h);
            }
        }
        let ws = 1.0 / ((ihd * nh) as f32).sqrt();
        let n = rows.len() / ihd;
        let scores: Vec<f32> = (0..n)
            .map(|r| {
                let k = &rows[r * ihd..(r + 1) * ihd];
                (0..nh)
                    .map(|h| wts[h] * ws * dot(&q[h * ihd..(h + 1) * ihd], k).max(0.0))
                    .sum()
            })
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        order.truncate(hp.indexer_top_k as usize);
        order.sort_unstable();
        order
    }

    /// MoE sublayer for the batch (model.md §3.4): experts run as matrix products over the
    /// tokens routed to them; each token sums its experts in selection order, then the shared
    /// expert (the same order as one-token evaluation).
    fn moe(&self, l: &Layer, z: &[f32], tokens: &[u32]) -> Vec<f32> {
        let hp = &self.hp;
        let ne = hp.n_expert as usize;
        let k = hp.n_expert_used as usize;
        let ff = hp.n_ff_exp as usize;
        let d = hp.n_embd as usize;
        let n = tokens.len();
        let mut logits = vec![0f32; n * ne];
        self.w.matmul(&l.router, None, z, &mut logits);
        // Selection and weights per token.
        let mut sel = Vec::with_capacity(n * k);
        let mut wgt = Vec::with_capacity(n * k);
        for (i, lg) in logits.chunks(ne).enumerate() {
            let p: Vec<f32> = lg.iter().map(|&v| softplus(v).sqrt()).collect();
            let s: Vec<usize> = match (&l.tid2eid, &l.bias) {
                (Some(tab), _) => {
                    let tok = tokens[i] as usize;
                    tab[tok * k..(tok + 1) * k]
                        .iter()
                        .map(|&e| e as usize)
                        .collect()
                }
                (None, Some(b)) => {
                    let mut order: Vec<usize> = (0..ne).collect();
                    let key = |e: usize| p[e] + b[e];
                    order.sort_by(|&x, &y| key(y).total_cmp(&key(x)).then(x.cmp(&y)));
                    order.truncate(k);
                    order
                }
                (None, None) => unreachable!("a non-hash layer has a bias"),
            };
            let sum: f32 = s.iter().map(|&e| p[e]).sum();
            let denom = sum.max(2f32.powi(-14)); // ds4's guard; p_e > 0 so it never binds
            wgt.extend(s.iter().map(|&e| p[e] / denom * hp.expert_weights_scale));
            sel.extend(s);
        }
        // SwiGLU expert on a set of token rows: gate/up, clamp, weight, down.
        let ffn = |gm: &Mat,
                   um: &Mat,
                   dm: &Mat,
                   e: Option<usize>,
                   xs: &[f32],
                   w: &[f32],
                   c: f32|
         -> Vec<f32> {
            let m = w.len();
            let (mut g, mut u) = (vec![0f32; m * ff], vec![0f32; m * ff]);
            self.w.matmul(gm, e, xs, &mut g);
            self.w.matmul(um, e, xs, &mut u);
            for (r, (gr, ur)) in g.chunks_mut(ff).zip(u.chunks(ff)).enumerate() {
                for (gv, uv) in gr.iter_mut().zip(ur) {
                    *gv = silu(gv.min(c)) * uv.clamp(-c, c) * w[r];
                }
            }
            let mut y = vec![0f32; m * d];
            self.w.matmul(dm, e, &g, &mut y);
            y
        };
        // Per (token, slot) expert outputs, computed expert by expert.
        let mut slot_out = vec![0f32; n * k * d];
        for e in 0..ne {
            let users: Vec<usize> = (0..n * k).filter(|&s| sel[s] == e).collect();
            if users.is_empty() {
                continue;
            }
            let xs: Vec<f32> = users
                .iter()
                .flat_map(|&s| z[(s / k) * d..(s / k + 1) * d].iter().copied())
                .collect();
            let w: Vec<f32> = users.iter().map(|&s| wgt[s]).collect();
            let y = ffn(
                &l.gate_exps,
                &l.up_exps,
                &l.down_exps,
                Some(e),
                &xs,
                &w,
                l.clamp,
            );
            for (r, &s) in users.iter().enumerate() {
                slot_out[s * d..(s + 1) * d].copy_from_slice(&y[r * d..(r + 1) * d]);
            }
        }
        let shared = ffn(
            &l.gate_sh,
            &l.up_sh,
            &l.down_sh,
            None,
            z,
            &vec![1.0; n],
            l.clamp_sh,
        );
        let mut out = vec![0f32; n * d];
        for i in 0..n {
            let o = &mut out[i * d..(i + 1) * d];
            for s in 0..k {
                o.iter_mut()
                    .zip(&slot_out[(i * k + s) * d..(i * k + s + 1) * d])
                    .for_each(|(o, v)| *o += v);
            }
            o.iter_mut()
                .zip(&shared[i * d..(i + 1) * d])
                .for_each(|(o, v)| *o += v);
        }
        out
    }

    /// Output head (model.md §3.5) with a given HC head and final norm.
    fn head(&self, hc: &Hc, norm: &[f32], x: &[f32]) -> Vec<f32> {
        let hp = &self.hp;
        let n = hp.hc_count as usize;
        let d = hp.n_embd as usize;
        let mut s = x.to_vec();
        rms_norm(&mut s, None, hp.rms_eps);
        let mut m = vec![0f32; n];
        self.w.matvec(&hc.mixer, None, &s, &mut m);
        let mut y = vec![0f32; d];
        for i in 0..n {
            let pre = sigmoid(m[i] * hc.scale[0] + hc.base[i]) + hp.hc_eps;
            y.iter_mut()
                .zip(&x[i * d..(i + 1) * d])
                .for_each(|(y, v)| *y += pre * v);
        }
        rms_norm(&mut y, Some(norm), hp.rms_eps);
        let mut logits = vec![0f32; hp.n_vocab as usize];
        self.w.matvec(&self.output, None, &y, &mut logits);
        logits
    }
}

/// HC post (expand): `X'[j] = post_j·o + Σ_i A[i][j]·X[i]` — column j of the comb (§7.6).
fn hc_post(x: &mut [f32], o: &[f32], post: &[f32], comb: &[f32], n: usize) {
    let d = o.len();
    let old = x.to_vec();
    for j in 0..n {
        let xj = &mut x[j * d..(j + 1) * d];
        for k in 0..d {
            let mut v = post[j] * o[k];
            for i in 0..n {
                v += comb[i * n + j] * old[i * d + k];
            }
            xj[k] = v;
        }
    }
}
