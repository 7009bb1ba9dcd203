//! The CPU reference backend: every op of [`ds4_backend::Backend`] in f32, weights read
//! straight from the mmap through `ds4-quant`'s exact dot products. Causal ops loop token by
//! token, so a batch gives bit-identical numbers to one-token decode. These are the
//! definitions other backends are tested against.

use crate::math::{self, dot, rms_norm, sigmoid, silu, softmax, softplus};
use ds4_backend::rope::RopeTables;
use ds4_backend::{
    AttnSpec, Backend, CompDims, CompressSpec, GgmlType, HcDims, HostComm, HostCompState,
    HostLayerState, IndexSpec, LayerDims, MoeSpec, Part, RopeKind, RowRounding, WeightSrc, Which,
};
use ds4_gguf::GgufFile;
use std::sync::Arc;

/// A bound matrix: `rows` rows of `cols` elements (GGUF `[cols, rows, experts]`).
#[derive(Clone)]
pub struct Mat {
    file: Arc<GgufFile>,
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    offset: usize,
    n_bytes: usize,
    kernel: ds4_quant::DotKernel,
}

impl Mat {
    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }
    fn bytes(&self) -> &[u8] {
        &self.file.bytes()[self.offset..self.offset + self.n_bytes]
    }
}

/// A weight on the CPU: a matrix in the mmap, or small values copied once.
pub enum CpuWeight {
    Mat(Mat),
    F32(Vec<f32>),
    I32(Vec<i32>),
    /// Expert slots ([`CpuBackend::with_expert_slots`]): a stack in this process's memory that
    /// [`Backend::gather_experts`] rewrites (each gather makes a new stack and swaps it in, so
    /// a MoE call that took the old one keeps reading it).
    Slots(std::sync::Mutex<Mat>),
}

impl CpuWeight {
    fn mat(&self) -> &Mat {
        match self {
            CpuWeight::Mat(m) => m,
            CpuWeight::Slots(_) => panic!("expert slots are read by moe_experts only"),
            _ => panic!("a matrix op on a vector weight"),
        }
    }
    /// The matrix a MoE call reads: [`CpuWeight::mat`], or the slots' stack as it is now.
    fn experts(&self) -> std::borrow::Cow<'_, Mat> {
        match self {
            CpuWeight::Slots(m) => {
                std::borrow::Cow::Owned(m.lock().unwrap_or_else(|e| e.into_inner()).clone())
            }
            w => std::borrow::Cow::Borrowed(w.mat()),
        }
    }
    fn f32s(&self) -> &[f32] {
        match self {
            CpuWeight::F32(v) => v,
            _ => panic!("a vector op on a non-f32 weight"),
        }
    }
    fn i32s(&self) -> &[i32] {
        match self {
            CpuWeight::I32(v) => v,
            _ => panic!("a table op on a non-i32 weight"),
        }
    }
}

pub struct CpuBackend {
    ropes: RopeTables,
    /// This rank and its group's all-reduce, where the model is split by experts (tests of
    /// expert parallelism: `ds4_backend::shard`).
    comm: Option<(usize, Arc<HostComm>)>,
    /// MoE calls of at most this many (token, expert) slots take [`moe_slots`]'s form.
    slots_max: usize,
    /// How many experts [`Backend::expert_slots`] finds room for (None: it gives no slots;
    /// [`CpuBackend::with_expert_slots`], [`CpuBackend::with_expert_slot_room`]).
    slot_room: Option<usize>,
    /// Work from which a token's attention heads / indexer rows run on the threads
    /// ([`PAR_ATTEND_MIN`]; [`CpuBackend::with_par_attend_min`]).
    par_attend_min: usize,
}

impl CpuBackend {
    pub fn new(ropes: RopeTables) -> CpuBackend {
        CpuBackend {
            ropes,
            comm: None,
            slots_max: moe_slots_max(),
            slot_room: None,
            par_attend_min: PAR_ATTEND_MIN,
        }
    }

    /// Splits a token's attention heads and indexer rows over the threads from `n`
    /// multiply-adds on (0: always, `usize::MAX`: never); the same bits either way (tests).
    pub fn with_par_attend_min(mut self, n: usize) -> CpuBackend {
        self.par_attend_min = n;
        self
    }

    /// Gives expert slots ([`Backend::expert_slots`], [`Backend::gather_experts`]) as a GPU
    /// does, so that the schedule's gather of host-memory experts (`ds4_model::offload`, the
    /// GPU's default for `--cpu-experts`) runs, slots, rounds and all, on the CPU in tests.
    /// Off by default: the CPU runs host-memory experts where they lie (no copy).
    pub fn with_expert_slots(mut self, on: bool) -> CpuBackend {
        self.slot_room = on.then_some(usize::MAX);
        self
    }

    /// [`CpuBackend::with_expert_slots`] with room for `n` experts a request: asking for more
    /// fails as a GPU's allocation does when its memory runs short (tests of the fallback).
    pub fn with_expert_slot_room(mut self, n: usize) -> CpuBackend {
        self.slot_room = Some(n);
        self
    }

    /// MoE calls of at most `n` slots in [`moe_slots`]'s form (decode-sized), larger ones expert
    /// by expert (0: always expert by expert). Both give the same bits (`tests/host_experts.rs`).
    pub fn with_moe_slots_max(mut self, n: usize) -> CpuBackend {
        self.slots_max = n;
        self
    }

    /// Whether a MoE call of `n` tokens takes [`moe_slots`]'s form.
    fn slots_form(&self, spec: &MoeSpec, n: usize) -> bool {
        n * spec.n_used <= self.slots_max
            && spec.ff.is_multiple_of(SLOT_ROWS)
            && spec.d.is_multiple_of(SLOT_ROWS)
    }

    /// Expert slots of `dims` (`[cols, rows, capacity]`) in memory: `old`'s bytes (zeros
    /// where empty) with the first `slabs.len()` experts replaced by `slabs`.
    fn slots_stack(
        &self,
        ty: GgmlType,
        [cols, rows, cap]: [usize; 3],
        old: &[u8],
        slabs: &[&[u8]],
    ) -> Result<CpuWeight, String> {
        let dims = [cols as u64, rows as u64, cap as u64];
        let stack = ds4_model::offload::HostStack::in_memory("expert slots", ty, dims, |out| {
            out.fill(0);
            let keep = old.len().min(out.len());
            out[..keep].copy_from_slice(&old[..keep]);
            let mut at = 0;
            for s in slabs {
                out[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
            Ok(())
        })?;
        match stack.with_src(0, cap, |src| self.matrix(src))? {
            CpuWeight::Mat(m) => Ok(CpuWeight::Slots(std::sync::Mutex::new(m))),
            _ => unreachable!("matrix binds a matrix"),
        }
    }

    /// This backend as rank `rank` of `comm`'s group ([`Backend::all_reduce_sum`]).
    pub fn with_comm(mut self, rank: usize, comm: Arc<HostComm>) -> CpuBackend {
        assert!(rank < comm.n_ranks(), "rank {rank} of {}", comm.n_ranks());
        self.comm = Some((rank, comm));
        self
    }

    /// `ys = W[rows r0 ..] · xs` over whole rows `r0 .. r0 + ys.len()/n`.
    fn product(&self, m: &Mat, byte0: usize, xs: &[f32], ys: &mut [f32]) {
        let n = xs.len() / m.cols;
        let rows = ys.len() / n.max(1);
        let w = &m.bytes()[byte0..byte0 + rows * m.row_bytes()];
        m.kernel.matmul_unchecked(w, xs, m.cols, ys);
    }

    /// One row of a matrix, dequantised (embedding lookup, `ape` rows).
    fn row(m: &Mat, r: usize, out: &mut [f32]) {
        let rb = m.row_bytes();
        let b = &m.bytes()[r * rb..(r + 1) * rb];
        ds4_quant::dequantize_row(m.ty, b, out).expect("bound rows dequantise");
    }

    fn dequant_all(src: &WeightSrc) -> Result<Vec<f32>, String> {
        let mut out = vec![0f32; src.elems()];
        ds4_quant::dequantize_row(src.ty, src.bytes(), &mut out).map_err(|e| e.to_string())?;
        Ok(out)
    }

    /// One compressor step (model.md §3.3, frontier rule of §4.1) with token `t`'s projection
    /// `a` and gate `g`. Returns the pooled, normalised row when `t` closes a window (not yet
    /// rotated or rounded).
    #[allow(clippy::too_many_arguments)]
    fn compress_one(
        c: &CompDims,
        cs: &mut HostCompState,
        ape: &Mat,
        norm: &[f32],
        eps: f32,
        a: &[f32],
        g: &[f32],
        t: usize,
    ) -> Option<Vec<f32>> {
        let w = c.width();
        let r = c.ratio;
        let mut ape_row = vec![0f32; w];
        Self::row(ape, t % r, &mut ape_row);
        let slot = if c.coff == 2 { r + t % r } else { t % r };
        cs.front_kv[slot * w..(slot + 1) * w].copy_from_slice(a);
        for ((s, g), b) in cs.front_score[slot * w..(slot + 1) * w]
            .iter_mut()
            .zip(g)
            .zip(&ape_row)
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
            // 0..d) of the previous window (slots 0..r) and the B-half (columns d..2d) of this.
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
        rms_norm(&mut p, Some(norm), eps);
        Some(p)
    }
}

fn round_row(v: &mut [f32], r: RowRounding) {
    if r.fp8_nope > 0 {
        math::fp8_sim(v, r.fp8_nope);
    }
    if r.fp4_hadamard {
        math::fp4_hadamard_sim(v);
    }
    if r.f16 {
        math::f16_round(v);
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type IBuf = Vec<i32>;
    type Weight = CpuWeight;
    type LayerState = HostLayerState;
    type Mark = ds4_backend::state::HostMark;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn matrix(&self, src: &WeightSrc) -> Result<CpuWeight, String> {
        let kernel =
            ds4_quant::dot_kernel(src.ty).map_err(|e| format!("no CPU dot product: {e}"))?;
        Ok(CpuWeight::Mat(Mat {
            file: src.file.clone(),
            ty: src.ty,
            cols: src.cols(),
            rows: src.rows(),
            offset: src.offset,
            n_bytes: src.n_bytes,
            kernel,
        }))
    }

    fn vector(&self, src: &WeightSrc) -> Result<CpuWeight, String> {
        Ok(CpuWeight::F32(Self::dequant_all(src)?))
    }

    fn host_matrix(&self, src: &WeightSrc) -> Option<Result<CpuWeight, String>> {
        // With expert slots, as a GPU (tests of the schedule's host table); the CPU reads
        // every matrix in place anyway, so this is `matrix` under another name.
        self.slot_room?;
        Some(self.matrix(src))
    }

    fn expert_slots(
        &self,
        ty: GgmlType,
        cols: usize,
        rows: usize,
        capacity: usize,
    ) -> Option<Result<CpuWeight, String>> {
        let room = self.slot_room?;
        if capacity > room {
            return Some(Err(format!(
                "no room for {capacity} expert slots (room for {room})"
            )));
        }
        Some(self.slots_stack(ty, [cols, rows, capacity], &[], &[]))
    }

    fn gather_experts(&self, slots: &CpuWeight, slabs: &[&[u8]]) {
        let CpuWeight::Slots(cell) = slots else {
            panic!("gather_experts into a weight that is not expert slots");
        };
        let mut m = cell.lock().unwrap_or_else(|e| e.into_inner());
        let slab = m.rows * m.row_bytes();
        let cap = m.n_bytes / slab.max(1);
        assert!(
            slabs.len() <= cap && slabs.iter().all(|s| s.len() == slab),
            "gather of {} experts into {cap} slots of {slab} bytes",
            slabs.len()
        );
        let old = m.bytes().to_vec();
        let new = self
            .slots_stack(m.ty, [m.cols, m.rows, cap], &old, slabs)
            .unwrap_or_else(|e| panic!("expert slots: {e}"));
        let CpuWeight::Slots(new) = new else {
            unreachable!("slots_stack makes slots")
        };
        *m = new.into_inner().unwrap_or_else(|e| e.into_inner());
    }

    fn read_weight(&self, w: &CpuWeight, out: &mut [u8]) -> Result<(), String> {
        let CpuWeight::Mat(m) = w else {
            return Err("read_weight: not a matrix".into());
        };
        if out.len() != m.n_bytes {
            return Err(format!(
                "read_weight: {} bytes asked of a {}-byte matrix",
                out.len(),
                m.n_bytes
            ));
        }
        out.copy_from_slice(m.bytes());
        Ok(())
    }

    fn table(&self, src: &WeightSrc) -> Result<CpuWeight, String> {
        if src.ty != GgmlType::I32 {
            return Err(format!("expected I32, found {:?}", src.ty));
        }
        Ok(CpuWeight::I32(
            src.bytes()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }
    fn upload_i32(&self, data: &[i32]) -> Vec<i32> {
        data.to_vec()
    }
    fn alloc_i32(&self, len: usize) -> Vec<i32> {
        vec![0; len]
    }
    fn download(&self, b: &Vec<f32>, len: usize) -> Vec<f32> {
        b[..len].to_vec()
    }
    fn download_i32(&self, b: &Vec<i32>, len: usize) -> Vec<i32> {
        b[..len].to_vec()
    }
    fn copy(&self, src: &Vec<f32>, so: usize, dst: &mut Vec<f32>, d0: usize, len: usize) {
        dst[d0..d0 + len].copy_from_slice(&src[so..so + len]);
    }

    fn new_layer_state(&self, dims: &LayerDims) -> HostLayerState {
        HostLayerState::new(dims)
    }
    fn state_to_host(&self, st: &HostLayerState) -> HostLayerState {
        st.clone()
    }
    fn state_from_host(&self, _dims: &LayerDims, h: &HostLayerState) -> HostLayerState {
        h.clone()
    }
    fn mark(&self, st: &HostLayerState) -> Self::Mark {
        st.mark()
    }
    fn rollback(&self, st: &mut HostLayerState, m: Self::Mark) {
        st.rollback(m)
    }
    fn mark_slots_all(
        &self,
        sts: &[HostLayerState],
        slots: &[ds4_backend::TokenSlots],
    ) -> Option<Vec<Self::Mark>> {
        Some(
            sts.iter()
                .zip(slots)
                .map(|(s, t)| s.mark_slots(t))
                .collect(),
        )
    }

    fn embed(
        &self,
        table: &CpuWeight,
        tokens: &Vec<i32>,
        n: usize,
        copies: usize,
        d: usize,
        out: &mut Vec<f32>,
    ) {
        let m = table.mat();
        let mut e = vec![0f32; d];
        for (i, &tok) in tokens[..n].iter().enumerate() {
            Self::row(m, tok as usize, &mut e);
            for k in 0..copies {
                out[(i * copies + k) * d..(i * copies + k + 1) * d].copy_from_slice(&e);
            }
        }
    }

    fn matmul(&self, w: &CpuWeight, part: Part, x: &Vec<f32>, n: usize, y: &mut Vec<f32>) {
        let m = w.mat();
        let byte0 = match part {
            Part::All => 0,
            Part::Expert(e) => e * m.rows * m.row_bytes(),
        };
        self.product(m, byte0, &x[..n * m.cols], &mut y[..n * m.rows]);
    }

    fn matmul_grouped(
        &self,
        w: &CpuWeight,
        groups: usize,
        x: &Vec<f32>,
        n: usize,
        y: &mut Vec<f32>,
    ) {
        let m = w.mat();
        let gin = m.cols;
        let r = m.rows / groups;
        let mut og = vec![0f32; n * gin];
        let mut ug = vec![0f32; n * r];
        for g in 0..groups {
            for i in 0..n {
                og[i * gin..(i + 1) * gin].copy_from_slice(
                    &x[i * groups * gin + g * gin..i * groups * gin + (g + 1) * gin],
                );
            }
            self.product(m, g * r * m.row_bytes(), &og, &mut ug);
            for i in 0..n {
                y[i * m.rows + g * r..i * m.rows + (g + 1) * r]
                    .copy_from_slice(&ug[i * r..(i + 1) * r]);
            }
        }
    }

    fn add(&self, y: &mut Vec<f32>, x: &Vec<f32>, len: usize) {
        y[..len]
            .iter_mut()
            .zip(&x[..len])
            .for_each(|(y, x)| *y += x);
    }

    fn rms_norm(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        width: usize,
        w: Option<&CpuWeight>,
        eps: f32,
    ) {
        let w = w.map(|w| w.f32s());
        x[..rows * width]
            .chunks_mut(width)
            .for_each(|r| rms_norm(r, w, eps));
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        n: usize,
        heads: usize,
        width: usize,
        n_rot: usize,
        t0: usize,
        kind: RopeKind,
        inverse: bool,
    ) {
        let rope = self.ropes.get(kind);
        debug_assert_eq!(2 * rope.freqs.len(), n_rot);
        for (i, tok) in x[..n * heads * width].chunks_mut(heads * width).enumerate() {
            for h in tok.chunks_mut(width) {
                rope.apply(h, (t0 + i) as u64, inverse);
            }
        }
    }

    fn round_rows(&self, x: &mut Vec<f32>, rows: usize, width: usize, r: RowRounding) {
        x[..rows * width]
            .chunks_mut(width)
            .for_each(|v| round_row(v, r));
    }

    fn hc_split(
        &self,
        hc: HcDims,
        m: &Vec<f32>,
        scale: &CpuWeight,
        base: &CpuWeight,
        x: &Vec<f32>,
        n: usize,
        z: &mut Vec<f32>,
        post: &mut Vec<f32>,
        comb: &mut Vec<f32>,
    ) {
        let (nhc, d, eps) = (hc.n, hc.d, hc.eps);
        let (scale, base) = (scale.f32s(), base.f32s());
        let mix = (2 + nhc) * nhc;
        for (t, m) in m[..n * mix].chunks(mix).enumerate() {
            let pre: Vec<f32> = (0..nhc)
                .map(|i| sigmoid(m[i] * scale[0] + base[i]) + eps)
                .collect();
            for i in 0..nhc {
                post[t * nhc + i] = 2.0 * sigmoid(m[nhc + i] * scale[1] + base[nhc + i]);
            }
            let a = &mut comb[t * nhc * nhc..(t + 1) * nhc * nhc];
            for k in 0..nhc * nhc {
                a[k] = m[2 * nhc + k] * scale[2] + base[2 * nhc + k];
            }
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
            norm_cols(a);
            for _ in 1..hc.sinkhorn_iters {
                for row in a.chunks_mut(nhc) {
                    let s: f32 = row.iter().sum::<f32>() + eps;
                    row.iter_mut().for_each(|v| *v /= s);
                }
                norm_cols(a);
            }
            let xt = &x[t * nhc * d..(t + 1) * nhc * d];
            let yt = &mut z[t * d..(t + 1) * d];
            yt.iter_mut().for_each(|v| *v = 0.0);
            for i in 0..nhc {
                for k in 0..d {
                    yt[k] += pre[i] * xt[i * d + k];
                }
            }
        }
    }

    fn hc_collapse(
        &self,
        hc: HcDims,
        m: &Vec<f32>,
        scale: &CpuWeight,
        base: &CpuWeight,
        x: &Vec<f32>,
        n: usize,
        y: &mut Vec<f32>,
    ) {
        let (nhc, d) = (hc.n, hc.d);
        let (scale, base) = (scale.f32s(), base.f32s());
        for t in 0..n {
            let yt = &mut y[t * d..(t + 1) * d];
            yt.iter_mut().for_each(|v| *v = 0.0);
            for i in 0..nhc {
                let pre = sigmoid(m[t * nhc + i] * scale[0] + base[i]) + hc.eps;
                yt.iter_mut()
                    .zip(&x[(t * nhc + i) * d..(t * nhc + i + 1) * d])
                    .for_each(|(y, v)| *y += pre * v);
            }
        }
    }

    fn hc_post(
        &self,
        hc: HcDims,
        x: &mut Vec<f32>,
        o: &Vec<f32>,
        post: &Vec<f32>,
        comb: &Vec<f32>,
        n: usize,
    ) {
        let (nhc, d) = (hc.n, hc.d);
        for t in 0..n {
            let xs = &mut x[t * nhc * d..(t + 1) * nhc * d];
            let old = xs.to_vec();
            let (p, c) = (
                &post[t * nhc..(t + 1) * nhc],
                &comb[t * nhc * nhc..(t + 1) * nhc * nhc],
            );
            let ot = &o[t * d..(t + 1) * d];
            // X'[j] = post_j·o + Σ_i A[i][j]·X[i] — column j of the comb (model.md §7.6).
            for j in 0..nhc {
                let xj = &mut xs[j * d..(j + 1) * d];
                for k in 0..d {
                    let mut v = p[j] * ot[k];
                    for i in 0..nhc {
                        v += c[i * nhc + j] * old[i * d + k];
                    }
                    xj[k] = v;
                }
            }
        }
    }

    fn compress(
        &self,
        st: &mut HostLayerState,
        which: Which,
        spec: &CompressSpec,
        ape: &CpuWeight,
        norm: &CpuWeight,
        a: &Vec<f32>,
        g: &Vec<f32>,
        n: usize,
        t0: usize,
    ) {
        let cs = match which {
            Which::Attn => st.comp.as_mut(),
            Which::Index => st.index.as_mut(),
        }
        .expect("compress on a layer with that compressor");
        let c = &spec.dims;
        let w = c.width();
        let rope = self.ropes.get(spec.rope);
        for i in 0..n {
            let t = t0 + i;
            let row = Self::compress_one(
                c,
                cs,
                ape.mat(),
                norm.f32s(),
                spec.eps,
                &a[i * w..(i + 1) * w],
                &g[i * w..(i + 1) * w],
                t,
            );
            if let Some(mut row) = row {
                let nrow = cs.rows.len() / c.d;
                rope.apply(&mut row, (c.ratio * nrow) as u64, false);
                round_row(&mut row, spec.round);
                cs.rows.extend_from_slice(&row);
            }
        }
    }

    fn index_select(
        &self,
        st: &HostLayerState,
        spec: &IndexSpec,
        q: &Vec<f32>,
        w: &Vec<f32>,
        n: usize,
        t0: usize,
        sel: &mut Vec<i32>,
    ) {
        let (ihd, nh, k) = (spec.head_dim, spec.heads, spec.top_k);
        let rows = &st.index.as_ref().expect("indexer state").rows;
        let rope = self.ropes.get(spec.rope);
        let ws = 1.0 / ((ihd * nh) as f32).sqrt();
        for i in 0..n {
            let t = t0 + i;
            // The indexer compressor has the attention compressor's ratio: one index row per
            // attention row, the same visible count.
            let visible = (t + 1) / spec.ratio;
            let out = &mut sel[i * k..(i + 1) * k];
            out.fill(-1);
            if visible <= k || k == 0 {
                for (r, o) in out.iter_mut().take(visible).enumerate() {
                    *o = r as i32;
                }
                continue;
            }
            let mut qi = q[i * nh * ihd..(i + 1) * nh * ihd].to_vec();
            for h in qi.chunks_mut(ihd) {
                rope.apply(h, t as u64, false);
                if spec.fp4 {
                    math::fp4_hadamard_sim(h);
                }
            }
            let wi = &w[i * nh..(i + 1) * nh];
            let score = |r: usize| -> f32 {
                let key = &rows[r * ihd..(r + 1) * ihd];
                (0..nh)
                    .map(|h| wi[h] * ws * dot(&qi[h * ihd..(h + 1) * ihd], key).max(0.0))
                    .sum()
            };
            // Rows are scored independently (the same bits on any thread): split over the
            // threads once there are enough of them.
            let scores: Vec<f32> = if visible * nh * ihd >= self.par_attend_min {
                use rayon::prelude::*;
                (0..visible)
                    .into_par_iter()
                    .with_min_len(64)
                    .map(score)
                    .collect()
            } else {
                (0..visible).map(score).collect()
            };
            // The k best (score descending, then position: a total order, so the set is the
            // one a full sort would keep), found in linear time, then in position order.
            let mut order: Vec<usize> = (0..visible).collect();
            order.select_nth_unstable_by(k - 1, |&a, &b| {
                scores[b].total_cmp(&scores[a]).then(a.cmp(&b))
            });
            order.truncate(k);
            order.sort_unstable();
            for (o, r) in out.iter_mut().zip(order) {
                *o = r as i32;
            }
        }
    }

    fn attend(
        &self,
        st: &mut HostLayerState,
        spec: &AttnSpec,
        q: &Vec<f32>,
        kv: &Vec<f32>,
        sinks: &CpuWeight,
        sel: Option<&Vec<i32>>,
        n: usize,
        t0: usize,
        out: &mut Vec<f32>,
    ) {
        let (nh, hd, win) = (spec.n_head, spec.head_dim, spec.window);
        let sinks = sinks.f32s();
        let rope = self.ropes.get(spec.rope);
        let scale = 1.0 / (hd as f32).sqrt();
        out[..n * nh * hd].fill(0.0);
        for i in 0..n {
            let t = t0 + i;
            // Raw row into the ring. Later tokens of the batch have not been written yet, so
            // the ring still holds every row token t can see.
            st.raw[(t % win) * hd..(t % win + 1) * hd].copy_from_slice(&kv[i * hd..(i + 1) * hd]);
            st.raw_pos[t % win] = t as i64;
            let comp_rows: &[f32] = st.comp.as_ref().map_or(&[], |c| &c.rows);
            let selected: Vec<usize> = match sel {
                Some(s) => s[i * spec.top_k..(i + 1) * spec.top_k]
                    .iter()
                    .filter(|&&r| r >= 0)
                    .map(|&r| r as usize)
                    .collect(),
                None if spec.ratio > 0 => (0..(t + 1) / spec.ratio).collect(),
                None => Vec::new(),
            };
            // Raw rows (positions max(0, t−W+1) ..= t) then the selected compressed rows.
            let first = (t + 1).saturating_sub(win);
            let rows: Vec<&[f32]> = (first..=t)
                .filter(|&p| st.raw_pos[p % win] == p as i64)
                .map(|p| &st.raw[(p % win) * hd..(p % win + 1) * hd])
                .chain(selected.iter().map(|&r| &comp_rows[r * hd..(r + 1) * hd]))
                .collect();
            let qi = &q[i * nh * hd..(i + 1) * nh * hd];
            let oi = &mut out[i * nh * hd..(i + 1) * nh * hd];
            // One head: scores against every visible row, softmax with the sink, the weighted
            // sum of the rows. Heads are independent (each its own arithmetic, whatever runs
            // them), so long contexts split them over the threads: the same bits.
            let head = |h: usize, oh: &mut [f32]| {
                let qh = &qi[h * hd..(h + 1) * hd];
                let mut scores: Vec<f32> = rows.iter().map(|r| dot(qh, r) * scale).collect();
                let sink = sinks[h];
                let m = scores.iter().copied().fold(sink, f32::max);
                let mut zsum = (sink - m).exp();
                for s in scores.iter_mut() {
                    *s = (*s - m).exp();
                    zsum += *s;
                }
                for (s, r) in scores.iter().zip(&rows) {
                    let p = s / zsum;
                    oh.iter_mut().zip(r.iter()).for_each(|(o, v)| *o += p * v);
                }
                // Values are the rotated keys: undo the rotation at the query position.
                rope.apply(oh, t as u64, true);
            };
            if rows.len() * nh * hd >= self.par_attend_min {
                use rayon::prelude::*;
                oi.par_chunks_mut(hd)
                    .enumerate()
                    .for_each(|(h, oh)| head(h, oh));
            } else {
                for (h, oh) in oi.chunks_mut(hd).enumerate() {
                    head(h, oh);
                }
            }
        }
    }

    fn moe_route(
        &self,
        spec: &MoeSpec,
        logits: &Vec<f32>,
        bias: Option<&CpuWeight>,
        tid2eid: Option<&CpuWeight>,
        tokens: &Vec<i32>,
        n: usize,
        sel: &mut Vec<i32>,
        wgt: &mut Vec<f32>,
    ) {
        let (ne, k) = (spec.n_expert, spec.n_used);
        for (i, lg) in logits[..n * ne].chunks(ne).enumerate() {
            let p: Vec<f32> = lg.iter().map(|&v| softplus(v).sqrt()).collect();
            let s: Vec<usize> = match (tid2eid, bias) {
                (Some(tab), _) => {
                    let tok = tokens[i] as usize;
                    tab.i32s()[tok * k..(tok + 1) * k]
                        .iter()
                        .map(|&e| e as usize)
                        .collect()
                }
                (None, Some(b)) => {
                    let b = b.f32s();
                    let mut order: Vec<usize> = (0..ne).collect();
                    let key = |e: usize| p[e] + b[e];
                    order.sort_by(|&x, &y| key(y).total_cmp(&key(x)).then(x.cmp(&y)));
                    order.truncate(k);
                    order
                }
                (None, None) => panic!("a router needs a bias or a hash table"),
            };
            let sum: f32 = s.iter().map(|&e| p[e]).sum();
            let denom = sum.max(2f32.powi(-14)); // ds4's guard; p_e > 0 so it never binds
            for (j, &e) in s.iter().enumerate() {
                sel[i * k + j] = e as i32;
                wgt[i * k + j] = p[e] / denom * spec.weight_scale;
            }
        }
    }

    fn moe_experts(
        &self,
        spec: &MoeSpec,
        gate: &CpuWeight,
        up: &CpuWeight,
        down: &CpuWeight,
        z: &Vec<f32>,
        sel: &Vec<i32>,
        wgt: &Vec<f32>,
        n: usize,
        out: &mut Vec<f32>,
    ) {
        let (gm, um, dm) = (gate.experts(), up.experts(), down.experts());
        let (gm, um, dm) = (gm.as_ref(), um.as_ref(), dm.as_ref());
        if self.slots_form(spec, n) {
            let o = moe_slots(spec, [gm, um, dm], [None; 3], z, sel, wgt, n);
            out[..n * spec.d].copy_from_slice(&o);
            return;
        }
        let (k, ff, d, c) = (spec.n_used, spec.ff, spec.d, spec.clamp);
        let slab = |m: &Mat, e: usize| e * m.rows * m.row_bytes();
        // Per (token, slot) expert outputs, computed expert by expert as matrix products over
        // the tokens routed to it (each row bit-identical to its one-token product).
        let mut slot_out = vec![0f32; n * k * d];
        for e in 0..spec.n_expert {
            // A slot of weight exactly 0 adds nothing (`Backend::moe_experts`): skipped, so an
            // expert-parallel rank computes only the slots of experts it holds.
            let users: Vec<usize> = (0..n * k)
                .filter(|&s| sel[s] == e as i32 && wgt[s] != 0.0)
                .collect();
            if users.is_empty() {
                continue;
            }
            let xs: Vec<f32> = users
                .iter()
                .flat_map(|&s| z[(s / k) * d..(s / k + 1) * d].iter().copied())
                .collect();
            let m = users.len();
            let (mut g, mut u) = (vec![0f32; m * ff], vec![0f32; m * ff]);
            self.product(gm, slab(gm, e), &xs, &mut g);
            self.product(um, slab(um, e), &xs, &mut u);
            for (r, (gr, ur)) in g.chunks_mut(ff).zip(u.chunks(ff)).enumerate() {
                let w = wgt[users[r]];
                for (gv, uv) in gr.iter_mut().zip(ur) {
                    *gv = silu(gv.min(c)) * uv.clamp(-c, c) * w;
                }
            }
            let mut y = vec![0f32; m * d];
            self.product(dm, slab(dm, e), &g, &mut y);
            for (r, &s) in users.iter().enumerate() {
                slot_out[s * d..(s + 1) * d].copy_from_slice(&y[r * d..(r + 1) * d]);
            }
        }
        sum_slots(&slot_out, n, k, d, out);
    }

    fn swiglu(&self, g: &mut Vec<f32>, u: &Vec<f32>, len: usize, c: f32) {
        for (gv, uv) in g[..len].iter_mut().zip(&u[..len]) {
            *gv = silu(gv.min(c)) * uv.clamp(-c, c);
        }
    }

    fn all_reduce_sum(&self, y: &mut Vec<f32>, len: usize) {
        if let Some((rank, comm)) = &self.comm {
            comm.all_reduce(*rank, &mut y[..len]);
        }
    }
}

/// `out[i] = Σ over slots s < k in selection order of slot_out[i k + s]`, from zeros: the MoE's
/// slot sum (one order for every form, so their bits agree).
fn sum_slots(slot_out: &[f32], n: usize, k: usize, d: usize, out: &mut [f32]) {
    for i in 0..n {
        let o = &mut out[i * d..(i + 1) * d];
        o.fill(0.0);
        for s in 0..k {
            o.iter_mut()
                .zip(&slot_out[(i * k + s) * d..(i * k + s + 1) * d])
                .for_each(|(o, v)| *o += v);
        }
    }
}

/// A layer's routed experts in host memory (`ds4_model::offload`), run by this backend's
/// [`Backend::moe_experts`] over the stacks' bytes: the reference arithmetic, so a GPU model
/// with host experts computes those layers' experts as `--backend cpu` does. With
/// [`CpuHostExperts::with_int8_activations`] its calls quantise the activations to 8 bits
/// (`ds4_quant::act`) instead, ~1.6x as fast.
pub struct CpuHostExperts {
    cpu: CpuBackend,
    gate: CpuWeight,
    up: CpuWeight,
    down: CpuWeight,
    /// Set by [`CpuHostExperts::with_int8_activations`]: the kernels of gate, up and down
    /// (`None` for a type without one: that product stays exact).
    act: Option<[Option<ds4_quant::act::ActKernel>; 3]>,
}

impl CpuHostExperts {
    /// Binds the gate, up and down stacks (no copy: their bytes stay where they are);
    /// `ropes`: the model's tables (the backend's; the MoE uses none).
    pub fn new(
        stacks: &[ds4_model::offload::HostStack; 3],
        ropes: &RopeTables,
    ) -> Result<CpuHostExperts, String> {
        let cpu = CpuBackend::new(ropes.clone());
        let bind = |s: &ds4_model::offload::HostStack| {
            s.with_src(0, s.experts(), |src| cpu.matrix(src))
                .map_err(|e| format!("tensor {}: {e}", s.name))
        };
        Ok(CpuHostExperts {
            gate: bind(&stacks[0])?,
            up: bind(&stacks[1])?,
            down: bind(&stacks[2])?,
            cpu,
            act: None,
        })
    }

    /// Calls in [`moe_slots`]'s form (all, unless `DS4_CPU_MOE_SLOTS=0`) quantise each token's
    /// MoE input and each slot's hidden activation once, per block of 256 (Q8_K: one f32
    /// scale, int8 codes, as the original engine's CPU does), and take integer dot products
    /// with the weights' codes (`ds4_quant::act`; ~6e-3 relative RMS a product,
    /// `examples/dot_bench.rs`). What `--precision fast` (the default) runs; `exact` keeps f32
    /// activations.
    pub fn with_int8_activations(mut self) -> CpuHostExperts {
        let k = |w: &CpuWeight| ds4_quant::act::ActKernel::new(w.mat().ty);
        self.act = Some([k(&self.gate), k(&self.up), k(&self.down)]);
        self
    }
}

/// One activation row in the form a product's rows take: f32 for exact mode, quantised (once,
/// shared by every row) for the act kernels.
enum ActRow<'a> {
    Exact(&'a [f32]),
    Int8(ds4_quant::act::QuantizedAct),
}

impl ActRow<'_> {
    fn new(x: &[f32], kernel: Option<ds4_quant::act::ActKernel>) -> ActRow<'_> {
        // Rows of a K-quant or Q8_0 weight are whole blocks, so `x` quantises whole.
        match kernel.and_then(|k| ds4_quant::act::QuantizedAct::new(k.format(), x).ok()) {
            Some(q) => ActRow::Int8(q),
            None => ActRow::Exact(x),
        }
    }

    #[inline]
    fn dot(&self, m: &Mat, kernel: Option<ds4_quant::act::ActKernel>, row: &[u8]) -> f32 {
        match (self, kernel) {
            (ActRow::Int8(q), Some(k)) => k.dot(row, q),
            (ActRow::Exact(x), _) => m.kernel.dot(row, x),
            (ActRow::Int8(_), None) => unreachable!("quantised without a kernel"),
        }
    }
}

/// The default of [`CpuBackend::with_moe_slots_max`]: 64 (a decode step's 6 slots, an MTP
/// pair's 12, up to 10 tokens); `DS4_CPU_MOE_SLOTS=N` sets it (0: always expert by expert, for
/// A/B runs: 6-9% slower on 2 cores, bench/results/host-experts-cpu-s39.txt).
fn moe_slots_max() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("DS4_CPU_MOE_SLOTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64)
    })
}
/// `f(expert, row, slots, out)`: a row's value for each of `slots` ([`moe_slots`]).
type SlotRowFn<'a> = dyn Fn(usize, usize, &[usize], &mut [f32]) + Sync + 'a;

/// Output rows a task in [`moe_slots`].
const SLOT_ROWS: usize = 32;

/// Multiply-adds (rows × heads × head size) from which one token's attention or indexer scores
/// are split over the threads: ~1 ms of one core's work (a decode step at a few thousand
/// tokens of context); below it the fork-join costs more than it saves.
const PAR_ATTEND_MIN: usize = 1 << 20;

/// [`Backend::moe_experts`]'s value with one parallel region for every slot's gate/up rows and
/// one for the down rows (the expert-by-expert form runs 3 products an expert one after
/// another, each split over the threads: 18 fork-joins a decode step, unbalanced on many
/// cores); slots of the same expert share their row reads. With `act` all `None` every output
/// is the same row dot product and the slots are summed in the same order, so the bits are the
/// expert-by-expert form's (`tests/host_experts.rs`); an `act` kernel makes that product
/// `ds4_quant::act`'s (int8 activations). `mats`: gate, up, down; `spec.ff` and `spec.d` are
/// multiples of [`SLOT_ROWS`].
#[allow(clippy::too_many_arguments)]
fn moe_slots(
    spec: &MoeSpec,
    [gm, um, dm]: [&Mat; 3],
    [ka, ku, kd]: [Option<ds4_quant::act::ActKernel>; 3],
    z: &[f32],
    sel: &[i32],
    wgt: &[f32],
    n: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let (k, ff, d, c) = (spec.n_used, spec.ff, spec.d, spec.clamp);
    fn row(m: &Mat, e: usize, r: usize) -> &[u8] {
        let rb = m.row_bytes();
        &m.bytes()[(e * m.rows + r) * rb..(e * m.rows + r + 1) * rb]
    }
    // Slots that add something (weight 0 adds exactly 0: skipped, as the backend does).
    let slots: Vec<usize> = (0..n * k)
        .filter(|&s| wgt[s] != 0.0 && (sel[s] as usize) < spec.n_expert && sel[s] >= 0)
        .collect();
    // Each token's input as the gate's and the up's rows take it (quantised once a token).
    let zg: Vec<ActRow> = z.chunks(d).take(n).map(|x| ActRow::new(x, ka)).collect();
    let zu: Vec<ActRow> = z.chunks(d).take(n).map(|x| ActRow::new(x, ku)).collect();
    // Slots grouped by expert (an MTP pair's tokens often share some): a task reads each of
    // its rows once for all the group's slots.
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&j| (sel[slots[j]], j));
    let mut groups: Vec<&[usize]> = Vec::new();
    let mut rest = &order[..];
    while let Some(&j0) = rest.first() {
        let len = rest
            .iter()
            .take_while(|&&j| sel[slots[j]] == sel[slots[j0]])
            .count();
        groups.push(&rest[..len]);
        rest = &rest[len..];
    }
    // One parallel region over (group, SLOT_ROWS rows) tasks of a matrix with `rows` rows;
    // `f(e, r, js, out)` writes row r's value for each slot of `js` into `out`; the values land
    // in slot-major `dst` (`rows` a slot).
    let region = |rows: usize, dst: &mut [f32], f: &SlotRowFn| {
        let tasks: Vec<(usize, usize)> = (0..groups.len())
            .flat_map(|g| (0..rows).step_by(SLOT_ROWS).map(move |r0| (g, r0)))
            .collect();
        let tiles: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(g, r0)| {
                let js = groups[g];
                let e = sel[slots[js[0]]] as usize;
                let mut t = vec![0f32; SLOT_ROWS * js.len()];
                for (i, vals) in t.chunks_exact_mut(js.len()).enumerate() {
                    f(e, r0 + i, js, vals);
                }
                t
            })
            .collect();
        for (&(g, r0), t) in tasks.iter().zip(&tiles) {
            for (i, vals) in t.chunks_exact(groups[g].len()).enumerate() {
                for (&j, &v) in groups[g].iter().zip(vals) {
                    dst[j * rows + r0 + i] = v;
                }
            }
        }
    };
    let mut h = vec![0f32; slots.len() * ff];
    region(ff, &mut h, &|e, r, js, out| {
        let (rg, ru) = (row(gm, e, r), row(um, e, r));
        for (o, &j) in out.iter_mut().zip(js) {
            let (s, t) = (slots[j], slots[j] / k);
            let g = zg[t].dot(gm, ka, rg);
            let u = zu[t].dot(um, ku, ru);
            *o = silu(g.min(c)) * u.clamp(-c, c) * wgt[s];
        }
    });
    let hs: Vec<ActRow> = h.chunks(ff).map(|x| ActRow::new(x, kd)).collect();
    let mut y = vec![0f32; slots.len() * d];
    region(d, &mut y, &|e, r, js, out| {
        let rd = row(dm, e, r);
        for (o, &j) in out.iter_mut().zip(js) {
            *o = hs[j].dot(dm, kd, rd);
        }
    });
    let mut slot_out = vec![0f32; n * k * d];
    for (j, &s) in slots.iter().enumerate() {
        slot_out[s * d..(s + 1) * d].copy_from_slice(&y[j * d..(j + 1) * d]);
    }
    let mut out = vec![0f32; n * d];
    sum_slots(&slot_out, n, k, d, &mut out);
    out
}

impl ds4_model::offload::HostExperts for CpuHostExperts {
    fn run(&self, spec: &MoeSpec, z: &[f32], sel: &[i32], wgt: &[f32], n: usize) -> Vec<f32> {
        let mats = [self.gate.mat(), self.up.mat(), self.down.mat()];
        // Every host call is small enough for the slots form (prompt batches of
        // `HostPlacement::upload_min` tokens or more go to the GPU), which shares rows between
        // a group's slots like the expert-by-expert form and runs the int8 kernels.
        if self.cpu.slots_form(spec, 1) {
            return moe_slots(spec, mats, self.act.unwrap_or([None; 3]), z, sel, wgt, n);
        }
        let mut out = vec![0f32; n * spec.d];
        self.cpu.moe_experts(
            spec,
            &self.gate,
            &self.up,
            &self.down,
            &z.to_vec(),
            &sel.to_vec(),
            &wgt.to_vec(),
            n,
            &mut out,
        );
        out
    }
}
