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

    /// What one token writes ([`crate::TokenSlots`]): its ring slot, its frontier slots a
    /// compressor and a row it pools. Rolling back to it undoes only that token.
    pub fn mark_slots(&self, s: &crate::TokenSlots) -> HostMark {
        let hd = self.raw.len() / self.raw_pos.len();
        let front = |c: &Option<HostCompState>, at: Option<crate::FrontSlots>| {
            c.as_ref().zip(at).map(|(c, f)| {
                let w = f.width;
                let saved = f
                    .ranges
                    .iter()
                    .filter(|r| r.1 > 0)
                    .map(|&(s0, n)| {
                        let r = s0 * w..(s0 + n) * w;
                        (
                            r.start,
                            c.front_kv[r.clone()].to_vec(),
                            c.front_score[r].to_vec(),
                        )
                    })
                    .collect();
                (saved, f.pooled)
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
                    if let (Some(c), Some((saved, pooled))) = (dst.as_mut(), src) {
                        for (off, kv, score) in saved {
                            c.front_kv[off..off + kv.len()].copy_from_slice(&kv);
                            c.front_score[off..off + score.len()].copy_from_slice(&score);
                        }
                        c.rows.truncate(c.rows.len() - pooled);
                    }
                }
            }
        }
    }
}

type CompMark = Option<(Vec<f32>, Vec<f32>, usize)>;
/// Saved frontier ranges (value offset, `state_kv` values, `state_score` values) and the values
/// of the row the token pools (0: none).
type SlotMark = Option<(Vec<(usize, Vec<f32>, Vec<f32>)>, usize)>;

#[derive(Clone, Debug)]
enum Kept {
    /// Everything a batch may change (rows by count).
    Whole {
        raw: Vec<f32>,
        raw_pos: Vec<i64>,
        comp: CompMark,
        index: CompMark,
    },
    /// One token's ring slot (row and position), frontier slots and pooled row.
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

    // A token's writes, as the CPU's compress_one and ring store make them: its ring slot,
    // its frontier slot and, closing a window, a pooled row and the shift of the window into
    // slots 0..r.
    fn write(st: &mut HostLayerState, d: &LayerDims, pos: usize, v: f32) {
        let hd = d.head_dim;
        let r = pos % d.window;
        st.raw[r * hd..(r + 1) * hd].fill(v);
        st.raw_pos[r] = pos as i64;
        for (c, cd) in [(&mut st.comp, d.comp), (&mut st.index, d.index)] {
            let (c, cd) = (c.as_mut().unwrap(), cd.unwrap());
            let (q, w) = (cd.ratio, cd.width());
            let slot = q + pos % q;
            c.front_kv[slot * w..(slot + 1) * w].fill(v);
            c.front_score[slot * w..(slot + 1) * w].fill(-v);
            if (pos + 1).is_multiple_of(q) {
                c.rows.extend(std::iter::repeat_n(v, cd.d));
                c.front_kv.copy_within(q * w..2 * q * w, 0);
                c.front_score.copy_within(q * w..2 * q * w, 0);
            }
        }
    }

    #[test]
    fn slot_marks_undo_only_the_last_token() {
        let d = dims();
        // Drafts at 14 (inside a window), 15 (closing one: a pooled row, the shift) and 16
        // (after a kept token that closed one: its row stays).
        for draft in [14, 15, 16] {
            let mut st = HostLayerState::new(&d);
            for p in 0..draft - 1 {
                write(&mut st, &d, p, p as f32 + 1.0);
            }
            let slots = TokenSlots::of(&d, draft);
            assert_eq!(slots.ring, draft % 8);
            let m = st.mark_slots(&slots);
            write(&mut st, &d, draft - 1, 100.0);
            let kept = st.clone();
            write(&mut st, &d, draft, 200.0);
            assert_ne!(st, kept);
            st.rollback(m);
            assert_eq!(
                st, kept,
                "draft {draft}: its writes undone, the kept token's stay"
            );
        }
        // A whole mark still restores everything.
        let mut st = HostLayerState::new(&d);
        for p in 0..13 {
            write(&mut st, &d, p, p as f32 + 1.0);
        }
        let whole = st.mark();
        let before = st.clone();
        write(&mut st, &d, 13, 300.0);
        st.rollback(whole);
        assert_eq!(st, before);
    }

    #[test]
    fn token_slots_follow_the_frontier_rule() {
        let d = dims();
        let t = TokenSlots::of(&d, 14);
        assert_eq!(t.ring, 6);
        assert_eq!(t.comp.unwrap().ranges, [(6, 1), (0, 0)]);
        assert_eq!(t.comp.unwrap().width, 6);
        assert_eq!(t.index.unwrap().width, 4);
        // Closing a CSA window: the window's slots 0..4 too.
        assert_eq!(
            TokenSlots::of(&d, 15).comp.unwrap().ranges,
            [(7, 1), (0, 4)]
        );
        // HCA (coff 1): slot pos mod ratio, no shift even where a window closes.
        let h = LayerDims {
            comp: Some(CompDims {
                ratio: 128,
                coff: 1,
                d: 5,
            }),
            index: None,
            ..d
        };
        let t = TokenSlots::of(&h, 127);
        assert_eq!((t.ring, t.index), (7, None));
        assert_eq!(t.comp.unwrap().ranges, [(127, 1), (0, 0)]);
    }
}
