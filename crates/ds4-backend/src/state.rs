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
        HostMark(Kept::Whole {
            raw: self.raw.clone(),
            raw_pos: self.raw_pos.clone(),
            comp: comp(&self.comp),
            index: comp(&self.index),
        })
    }

    /// What one token writes where it closes no window ([`crate::TokenSlots`]): its ring slot
    /// and one frontier slot a compressor. Rolling back to it undoes only that token.
    pub fn mark_slots(&self, s: &crate::TokenSlots) -> HostMark {
        let hd = self.raw.len() / self.raw_pos.len();
        let front = |c: &Option<HostCompState>, at: Option<(usize, usize)>| {
            c.as_ref().zip(at).map(|(c, (slot, w))| {
                let r = slot * w..(slot + 1) * w;
                (
                    slot,
                    c.front_kv[r.clone()].to_vec(),
                    c.front_score[r].to_vec(),
                )
            })
        };
        HostMark(Kept::Slots {
            slot: s.ring,
            row: self.raw[s.ring * hd..(s.ring + 1) * hd].to_vec(),
            pos: self.raw_pos[s.ring],
            comp: front(&self.comp, s.comp),
            index: front(&self.index, s.index),
        })
    }

    /// Return to a mark taken on this state.
    pub fn rollback(&mut self, m: HostMark) {
        match m.0 {
            Kept::Whole {
                raw,
                raw_pos,
                comp,
                index,
            } => {
                self.raw = raw;
                self.raw_pos = raw_pos;
                for (dst, src) in [(&mut self.comp, comp), (&mut self.index, index)] {
                    if let (Some(c), Some((kv, score, rows))) = (dst.as_mut(), src) {
                        c.front_kv = kv;
                        c.front_score = score;
                        c.rows.truncate(rows);
                    }
                }
            }
            Kept::Slots {
                slot,
                row,
                pos,
                comp,
                index,
            } => {
                let hd = row.len();
                self.raw[slot * hd..(slot + 1) * hd].copy_from_slice(&row);
                self.raw_pos[slot] = pos;
                for (dst, src) in [(&mut self.comp, comp), (&mut self.index, index)] {
                    if let (Some(c), Some((s, kv, score))) = (dst.as_mut(), src) {
                        let w = kv.len();
                        c.front_kv[s * w..(s + 1) * w].copy_from_slice(&kv);
                        c.front_score[s * w..(s + 1) * w].copy_from_slice(&score);
                    }
                }
            }
        }
    }
}

type CompMark = Option<(Vec<f32>, Vec<f32>, usize)>;
/// A frontier slot's index and its saved `state_kv` / `state_score` rows.
type SlotMark = Option<(usize, Vec<f32>, Vec<f32>)>;

#[derive(Clone, Debug)]
enum Kept {
    /// Everything a batch may change (rows by count).
    Whole {
        raw: Vec<f32>,
        raw_pos: Vec<i64>,
        comp: CompMark,
        index: CompMark,
    },
    /// One token's ring slot (row and position) and frontier slots.
    Slots {
        slot: usize,
        row: Vec<f32>,
        pos: i64,
        comp: SlotMark,
        index: SlotMark,
    },
}

/// A rollback point of a [`HostLayerState`].
#[derive(Clone, Debug)]
pub struct HostMark(Kept);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CompDims, LayerDims, TokenSlots};

    fn dims() -> LayerDims {
        LayerDims {
            window: 8,
            head_dim: 4,
            comp: Some(CompDims {
                ratio: 4,
                coff: 2,
                d: 3,
            }),
            index: Some(CompDims {
                ratio: 4,
                coff: 2,
                d: 2,
            }),
            index_fp4: false,
        }
    }

    // A token's writes, as the CPU's compress_one and ring store make them.
    fn write(st: &mut HostLayerState, d: &LayerDims, pos: usize, v: f32) {
        let hd = d.head_dim;
        let r = pos % d.window;
        st.raw[r * hd..(r + 1) * hd].fill(v);
        st.raw_pos[r] = pos as i64;
        for (c, cd) in [(&mut st.comp, d.comp), (&mut st.index, d.index)] {
            let (c, cd) = (c.as_mut().unwrap(), cd.unwrap());
            let (slot, w) = (cd.ratio + pos % cd.ratio, cd.width());
            c.front_kv[slot * w..(slot + 1) * w].fill(v);
            c.front_score[slot * w..(slot + 1) * w].fill(-v);
        }
    }

    #[test]
    fn slot_marks_undo_only_the_last_token() {
        let d = dims();
        let mut st = HostLayerState::new(&d);
        for p in 0..13 {
            write(&mut st, &d, p, p as f32 + 1.0);
        }
        // Positions 13 and 14 as one batch; 14 is the draft (14 + 1 closes no window of 4).
        let slots = TokenSlots::of(&d, 14).expect("no window closes at 14");
        assert_eq!(slots.ring, 6);
        assert_eq!(slots.comp, Some((6, 6)));
        assert_eq!(slots.index, Some((6, 4)));
        let m = st.mark_slots(&slots);
        write(&mut st, &d, 13, 100.0);
        let mut only_13 = st.clone();
        write(&mut st, &d, 14, 200.0);
        assert_ne!(st, only_13);
        st.rollback(m);
        assert_eq!(
            st, only_13,
            "the draft's writes undone, the kept token's stay"
        );
        // A whole mark still restores everything.
        let whole = only_13.mark();
        let before = only_13.clone();
        write(&mut only_13, &d, 14, 300.0);
        only_13.rollback(whole);
        assert_eq!(only_13, before);
    }

    #[test]
    fn no_slot_marks_where_a_window_closes() {
        let d = dims();
        assert!(TokenSlots::of(&d, 3).is_none());
        assert!(TokenSlots::of(&d, 15).is_none());
        assert!(TokenSlots::of(&d, 16).is_some());
        // HCA (coff 1): slot pos mod ratio, closing at multiples of 128 less one.
        let h = LayerDims {
            comp: Some(CompDims {
                ratio: 128,
                coff: 1,
                d: 5,
            }),
            index: None,
            ..d
        };
        assert_eq!(
            TokenSlots::of(&h, 130),
            Some(TokenSlots {
                ring: 2,
                comp: Some((2, 5)),
                index: None
            })
        );
        assert!(TokenSlots::of(&h, 127).is_none());
        assert!(TokenSlots::of(&h, 126).is_some());
        // No compressor: any position.
        let swa = LayerDims {
            comp: None,
            index: None,
            ..d
        };
        assert!(TokenSlots::of(&swa, 3).is_some());
    }
}
