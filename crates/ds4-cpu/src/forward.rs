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

impl CpuModel {
    pub fn new(hp: HParams, w: Weights, rounding: Rounding) -> CpuModel {
        let layers = hp
            .layers()
            .map(|kind| {
                let p = format!("blk.{}.", kind.index);
                let m = |n: &str| w.mat(&format!("{p}{n}.weight"));
                let v = |n: &str| w.vec(&format!("{p}{n}.weight"));
                let l = kind.index as usize;
                let comp = kind.compressed().then(|| {
                    compressor(
                        &w,
                        &format!("{p}attn_compressor"),
                        kind.ratio as usize,
                        kind.coff() as usize,
                        hp.head_dim as usize,
                    )
                });
                let indexer = kind.has_indexer().then(|| Indexer {
                    q_b: m("indexer.attn_q_b"),
                    proj: m("indexer.proj"),
                    comp: compressor(
                        &w,
                        &format!("{p}indexer_compressor"),
                        4,
                        2,
                        hp.indexer_head_dim as usize,
                    ),
                });
                Layer {
                    kind,
                    hc_attn: hc(&w, &p, "hc_attn"),
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
                    hc_ffn: hc(&w, &p, "hc_ffn"),
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
                        .map_or(hp.swiglu_clamp[l], |s| s[l]),
                }
            })
            .collect();
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
        let hp = &self.hp;
        let d = hp.n_embd as usize;
        let n = hp.hc_count as usize;
        let t = st.tokens.len();
        let mut e = vec![0f32; d];
        self.w.row(&self.embd, token as usize, &mut e);
        // Hyper-connection streams X[i], stream-major: x[i·D .. (i+1)·D].
        let mut x: Vec<f32> = (0..n).flat_map(|_| e.iter().copied()).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let (a, post, comb) = self.hc_pre(&layer.hc_attn, &x);
            let mut z = a;
            rms_norm(&mut z, Some(&layer.attn_norm), hp.rms_eps);
            let o = self.attention(layer, &mut st.layers[l], &z, t);
            hc_post(&mut x, &o, &post, &comb, n);
            let (f, post, comb) = self.hc_pre(&layer.hc_ffn, &x);
            let mut z = f;
            rms_norm(&mut z, Some(&layer.ffn_norm), hp.rms_eps);
            let y = self.moe(layer, &z, token);
            hc_post(&mut x, &y, &post, &comb, n);
        }
        st.tokens.push(token);
        self.head(&x)
    }

    /// HC split + collapse (model.md §3.1): returns `Σ pre_i X[i]`, `post`, and the Sinkhorn-
    /// normalised `comb` (row-major `A[a][b]`).
    fn hc_pre(&self, h: &Hc, x: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let hp = &self.hp;
        let n = hp.hc_count as usize;
        let d = hp.n_embd as usize;
        let eps = hp.hc_eps;
        let mut s = x.to_vec();
        rms_norm(&mut s, None, hp.rms_eps);
        let mut m = vec![0f32; (2 + n) * n];
        self.w.matvec(&h.mixer, None, &s, &mut m);
        let pre: Vec<f32> = (0..n)
            .map(|i| sigmoid(m[i] * h.scale[0] + h.base[i]) + eps)
            .collect();
        let post: Vec<f32> = (0..n)
            .map(|i| 2.0 * sigmoid(m[n + i] * h.scale[1] + h.base[n + i]))
            .collect();
        let mut a: Vec<f32> = (0..n * n)
            .map(|k| m[2 * n + k] * h.scale[2] + h.base[2 * n + k])
            .collect();
        for row in a.chunks_mut(n) {
            softmax(row);
            row.iter_mut().for_each(|v| *v += eps);
        }
        let norm_cols = |a: &mut [f32]| {
            for b in 0..n {
                let s: f32 = (0..n).map(|r| a[r * n + b]).sum::<f32>() + eps;
                (0..n).for_each(|r| a[r * n + b] /= s);
            }
        };
        norm_cols(&mut a);
        for _ in 1..hp.hc_sinkhorn_iters {
            for row in a.chunks_mut(n) {
                let s: f32 = row.iter().sum::<f32>() + eps;
                row.iter_mut().for_each(|v| *v /= s);
            }
            norm_cols(&mut a);
        }
        let mut y = vec![0f32; d];
        for i in 0..n {
            for k in 0..d {
                y[k] += pre[i] * x[i * d + k];
            }
        }
        (y, post, a)
    }

    fn attention(&self, l: &Layer, st: &mut LayerState, z: &[f32], t: usize) -> Vec<f32> {
        let hp = &self.hp;
        let rnd = self.rounding;
        let hd = hp.head_dim as usize;
        let nh = hp.n_head as usize;
        let n_rot = hp.n_rot as usize;
        let rope = self.rope(&l.kind);
        // Query: low rank, norm, expand, per-head unweighted norm, RoPE.
        let mut cq = vec![0f32; hp.q_lora_rank as usize];
        self.w.matvec(&l.q_a, None, z, &mut cq);
        rms_norm(&mut cq, Some(&l.q_a_norm), hp.rms_eps);
        let mut q = vec![0f32; nh * hd];
        self.w.matvec(&l.q_b, None, &cq, &mut q);
        for h in q.chunks_mut(hd) {
            rms_norm(h, None, hp.rms_eps);
            rope.apply(h, t as u64, false);
        }
        // The shared KV row of this position into the raw window ring.
        let mut k = vec![0f32; hd];
        self.w.matvec(&l.kv, None, z, &mut k);
        rms_norm(&mut k, Some(&l.kv_norm), hp.rms_eps);
        rope.apply(&mut k, t as u64, false);
        if rnd.fp8_kv {
            math::fp8_sim(&mut k, hd - n_rot);
        }
        if rnd.f16_cache {
            math::f16_round(&mut k);
        }
        let win = hp.sliding_window as usize;
        st.raw[(t % win) * hd..(t % win + 1) * hd].copy_from_slice(&k);

        // Compressors run before attention: a row closed by this token is already visible.
        if let (Some(c), Some(cs)) = (&l.comp, st.comp.as_mut()) {
            if let Some(mut row) = self.compress(c, cs, z, t) {
                let n = cs.rows.len() / c.d;
                rope.apply(&mut row, (c.ratio * n) as u64, false);
                if rnd.fp8_kv {
                    math::fp8_sim(&mut row, hd - n_rot);
                }
                if rnd.f16_cache {
                    math::f16_round(&mut row);
                }
                cs.rows.extend_from_slice(&row);
            }
        }
        if let (Some(ix), Some(is)) = (&l.indexer, st.index.as_mut()) {
            if let Some(mut row) = self.compress(&ix.comp, is, z, t) {
                let n = is.rows.len() / ix.comp.d;
                rope.apply(&mut row, (4 * n) as u64, false);
                if rnd.fp4_indexer {
                    math::fp4_hadamard_sim(&mut row);
                }
                if rnd.f16_cache {
                    math::f16_round(&mut row);
                }
                is.rows.extend_from_slice(&row);
            }
        }

        // Visible compressed rows: all for HCA; for CSA all up to top-k, else the indexer's pick.
        let comp_rows: &[f32] = st.comp.as_ref().map_or(&[], |c| &c.rows);
        let n_comp = comp_rows.len() / hd;
        let selected: Vec<usize> = match (&l.indexer, &st.index) {
            (Some(ix), Some(is)) if n_comp > hp.indexer_top_k as usize => {
                self.index_select(ix, &is.rows, z, &cq, t, rope)
            }
            _ => (0..n_comp).collect(),
        };

        // Attention with sinks over raw rows (positions max(0, t−W+1) ..= t) + selected rows.
        let first = (t + 1).saturating_sub(win);
        let scale = 1.0 / (hd as f32).sqrt();
        let rows: Vec<&[f32]> = (first..=t)
            .map(|p| &st.raw[(p % win) * hd..(p % win + 1) * hd])
            .chain(selected.iter().map(|&r| &comp_rows[r * hd..(r + 1) * hd]))
            .collect();
        let mut o = vec![0f32; nh * hd];
        let mut scores = vec![0f32; rows.len()];
        for h in 0..nh {
            let qh = &q[h * hd..(h + 1) * hd];
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
            let oh = &mut o[h * hd..(h + 1) * hd];
            for (s, r) in scores.iter().zip(&rows) {
                let p = s / zsum;
                oh.iter_mut().zip(r.iter()).for_each(|(o, v)| *o += p * v);
            }
            // Values are the rotated keys: undo the rotation at the query position.
            rope.apply(oh, t as u64, true);
        }

        // Grouped low-rank output projection.
        let groups = hp.o_groups as usize;
        let rank = hp.o_lora_rank as usize;
        let gin = hp.o_group_in() as usize;
        let mut u = vec![0f32; groups * rank];
        for g in 0..groups {
            self.w.matvec_rows(
                &l.out_a,
                g * rank,
                &o[g * gin..(g + 1) * gin],
                &mut u[g * rank..(g + 1) * rank],
            );
        }
        let mut out = vec![0f32; hp.n_embd as usize];
        self.w.matvec(&l.out_b, None, &u, &mut out);
        out
    }

    /// One compressor step (model.md §3.3, frontier rule of §4.1). Returns the pooled row
    /// (normalised, not yet rotated or rounded) when this token closes a window.
    fn compress(
        &self,
        c: &Compressor,
        cs: &mut CompState,
        z: &[f32],
        t: usize,
    ) -> Option<Vec<f32>> {
        let w = c.coff * c.d;
        let r = c.ratio;
        let mut a = vec![0f32; w];
        let mut g = vec![0f32; w];
        self.w.matvec(&c.kv, None, z, &mut a);
        self.w.matvec(&c.gate, None, z, &mut g);
        let mut ape = vec![0f32; w];
        self.w.row(&c.ape, t % r, &mut ape);
        g.iter_mut().zip(&ape).for_each(|(g, b)| *g += b);
        let slot = if c.coff == 2 { r + t % r } else { t % r };
        cs.front_kv[slot * w..(slot + 1) * w].copy_from_slice(&a);
        cs.front_score[slot * w..(slot + 1) * w].copy_from_slice(&g);
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
    /// index first), in ascending order.
    fn index_select(
        &self,
        ix: &Indexer,
        rows: &[f32],
        z: &[f32],
        cq: &[f32],
        t: usize,
        rope: &Rope,
    ) -> Vec<usize> {
        let hp = &self.hp;
        let ihd = hp.indexer_head_dim as usize;
        let nh = hp.indexer_heads as usize;
        let mut q = vec![0f32; nh * ihd];
        self.w.matvec(&ix.q_b, None, cq, &mut q);
        for h in q.chunks_mut(ihd) {
            rope.apply(h, t as u64, false);
            if self.rounding.fp4_indexer {
                math::fp4_hadamard_sim(h);
            }
        }
        let mut wts = vec![0f32; nh];
        self.w.matvec(&ix.proj, None, z, &mut wts);
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

    fn moe(&self, l: &Layer, z: &[f32], token: u32) -> Vec<f32> {
        let hp = &self.hp;
        let ne = hp.n_expert as usize;
        let k = hp.n_expert_used as usize;
        let ff = hp.n_ff_exp as usize;
        let d = hp.n_embd as usize;
        let mut logits = vec![0f32; ne];
        self.w.matvec(&l.router, None, z, &mut logits);
        let p: Vec<f32> = logits.iter().map(|&v| softplus(v).sqrt()).collect();
        let sel: Vec<usize> = match (&l.tid2eid, &l.bias) {
            (Some(tab), _) => tab[token as usize * k..(token as usize + 1) * k]
                .iter()
                .map(|&e| e as usize)
                .collect(),
            (None, Some(b)) => {
                let mut order: Vec<usize> = (0..ne).collect();
                let key = |e: usize| p[e] + b[e];
                order.sort_by(|&x, &y| key(y).total_cmp(&key(x)).then(x.cmp(&y)));
                order.truncate(k);
                order
            }
            (None, None) => unreachable!("a non-hash layer has a bias"),
        };
        let sum: f32 = sel.iter().map(|&e| p[e]).sum();
        let denom = sum.max(2f32.powi(-14)); // ds4's guard; p_e > 0 so it never binds
        let mut out = vec![0f32; d];
        let mut g = vec![0f32; ff];
        let mut u = vec![0f32; ff];
        let mut y = vec![0f32; d];
        let mut ffn =
            |gm: &Mat, um: &Mat, dm: &Mat, e: Option<usize>, wgt: f32, c: f32, out: &mut [f32]| {
                self.w.matvec(gm, e, z, &mut g);
                self.w.matvec(um, e, z, &mut u);
                for (gv, uv) in g.iter_mut().zip(&u) {
                    *gv = silu(gv.min(c)) * uv.clamp(-c, c) * wgt;
                }
                self.w.matvec(dm, e, &g, &mut y);
                out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
            };
        for &e in &sel {
            let wgt = p[e] / denom * hp.expert_weights_scale;
            ffn(
                &l.gate_exps,
                &l.up_exps,
                &l.down_exps,
                Some(e),
                wgt,
                l.clamp,
                &mut out,
            );
        }
        ffn(
            &l.gate_sh, &l.up_sh, &l.down_sh, None, 1.0, l.clamp_sh, &mut out,
        );
        out
    }

    fn head(&self, x: &[f32]) -> Vec<f32> {
        let hp = &self.hp;
        let n = hp.hc_count as usize;
        let d = hp.n_embd as usize;
        let mut s = x.to_vec();
        rms_norm(&mut s, None, hp.rms_eps);
        let mut m = vec![0f32; n];
        self.w.matvec(&self.out_hc.mixer, None, &s, &mut m);
        let mut y = vec![0f32; d];
        for i in 0..n {
            let pre = sigmoid(m[i] * self.out_hc.scale[0] + self.out_hc.base[i]) + hp.hc_eps;
            y.iter_mut()
                .zip(&x[i * d..(i + 1) * d])
                .for_each(|(y, v)| *y += pre * v);
        }
        rms_norm(&mut y, Some(&self.out_norm), hp.rms_eps);
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
