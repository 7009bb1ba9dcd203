//! Session state in host memory: the CPU backend's own state, and the form every backend
//! converts to and from for snapshots (model.md §4.3).

/// Compressor frontier and emitted rows (model.md §4.1).
#[derive(Clone, Debug, PartialEq)]
pub struct HostCompState {
    /// `coff·ratio` slots × `coff·d` columns each.
    pub front_kv: Vec<f32>,
    pub front_score: Vec<f32>,
    /// Emitted rows, `d` values each, append-only.
    pub rows: Vec<f32>,
}

/// One layer's attention state.
#[derive(Clone, Debug, PartialEq)]
pub struct HostLayerState {
    /// Ring of raw KV rows: position p lives in slot p mod window.
    pub raw: Vec<f32>,
    /// Position held by each ring slot (−1: empty). Main layers see every position; the MTP
    /// block only the ones it ran at, so attention reads a slot only if it holds position p.
    pub raw_pos: Vec<i64>,
    pub comp: Option<HostCompState>,
    pub index: Option<HostCompState>,
}

impl HostLayerState {
    /// A fresh state of the given shape.
    pub fn new(dims: &crate::LayerDims) -> HostLayerState {
        let front = |c: &crate::CompDims| {
            let n = c.slots() * c.width();
            HostCompState {
                front_kv: vec![0.0; n],
                front_score: vec![f32::NEG_INFINITY; n],
                rows: Vec::new(),
            }
        };
        HostLayerState {
            raw: vec![0.0; dims.window * dims.head_dim],
            raw_pos: vec![-1; dims.window],
            comp: dims.comp.as_ref().map(front),
            index: dims.index.as_ref().map(front),
        }
    }

    /// What speculative verification may change: the raw ring, the compressor frontiers and
    /// the row counts (model.md §4.4). Rows are append-only, so they are truncated, not copied.
    pub fn mark(&self) -> HostMark {
        let comp = |c: &Option<HostCompState>| {
            c.as_ref()
                .map(|c| (c.front_kv.clone(), c.front_score.clone(), c.rows.len()))
        };
        HostMark {
            raw: self.raw.clone(),
            raw_pos: self.raw_pos.clone(),
            comp: comp(&self.comp),
            index: comp(&self.index),
        }
    }

    /// Return to a mark taken on this state.
    pub fn rollback(&mut self, m: HostMark) {
        self.raw = m.raw;
        self.raw_pos = m.raw_pos;
        for (dst, src) in [(&mut self.comp, m.comp), (&mut self.index, m.index)] {
            if let (Some(c), Some((kv, score, rows))) = (dst.as_mut(), src) {
                c.front_kv = kv;
                c.front_score = score;
                c.rows.truncate(rows);
            }
        }
    }
}

type CompMark = Option<(Vec<f32>, Vec<f32>, usize)>;

/// A rollback point of a [`HostLayerState`].
#[derive(Clone, Debug)]
pub struct HostMark {
    raw: Vec<f32>,
    raw_pos: Vec<i64>,
    comp: CompMark,
    index: CompMark,
}
