//! Per-layer schedule (model.md §1.1): which attention variant and which router each layer uses.

/// Attention variant of a layer, decided by its compression ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Ratio 0: sliding window of raw KV rows only.
    Swa,
    /// Ratio 4: compressed sparse attention — overlapping windows (coff 2) and the lightning
    /// indexer choosing top-k compressed rows.
    Csa,
    /// Ratio > 4 (128 in the real model): heavily compressed attention, no overlap, no indexer.
    Hca,
}

impl AttnKind {
    pub fn from_ratio(r: u32) -> AttnKind {
        match r {
            0 => AttnKind::Swa,
            4 => AttnKind::Csa,
            _ => AttnKind::Hca,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AttnKind::Swa => "SWA",
            AttnKind::Csa => "CSA",
            AttnKind::Hca => "HCA",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKind {
    pub index: u32,
    pub ratio: u32,
    pub attn: AttnKind,
    /// Routed by `ffn_gate_tid2eid[token]` instead of the biased top-k.
    pub hash_routed: bool,
}

impl LayerKind {
    pub fn compressed(&self) -> bool {
        self.ratio > 0
    }

    pub fn has_indexer(&self) -> bool {
        self.attn == AttnKind::Csa
    }

    /// Compressor overlap factor: CSA windows overlap (2), HCA windows do not (1).
    pub fn coff(&self) -> u32 {
        if self.attn == AttnKind::Csa {
            2
        } else {
            1
        }
    }
}
