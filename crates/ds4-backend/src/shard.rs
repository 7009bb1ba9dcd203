//! Expert and tensor parallelism: a model split over `n_ranks` backends (GPUs, or CPU ranks
//! in tests). Every rank holds the whole session state and runs the same schedule on the same
//! tokens (design.md "multi-GPU").
//! - Expert parallelism (EP): rank `r` holds only the routed experts `Shard::experts` of each
//!   layer. A MoE sublayer sums, on each rank, the routed experts it holds, and
//!   [`crate::Backend::all_reduce_sum`] adds the ranks' partial sums, so every rank continues
//!   with the same values.
//! - Tensor parallelism (TP, `Shard::tp`, with EP): rank `r` also holds the part
//!   [`Shard::part`] of each attention's output groups (their query heads: rows of `q_b` and
//!   `out_a`, sinks, columns of `out_b`) and of the shared expert's hidden width (rows of its
//!   gate / up, columns of its down). The attention output is then a partial sum per rank (one
//!   more all-reduce a layer) and the shared expert's part joins the MoE's all-reduce. Without
//!   TP every rank holds the dense weights and rank 0 adds the whole shared expert.
//!
//! What that changes against one rank: the same terms added in another f32 order (the MoE
//! output `(rank 0's slots + shared part) + rank 1's + …`, the attention output as per-rank
//! partial products), a few ulp, nothing else.

use std::sync::{Arc, Barrier, Mutex};

/// Which part of the model a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
    /// Tensor parallelism of the attention and the shared expert too (see the module doc).
    pub tp: bool,
}

impl Shard {
    /// One rank holding everything (no expert parallelism).
    pub const ONE: Shard = Shard {
        rank: 0,
        n_ranks: 1,
        tp: false,
    };

    /// Rank `rank` of `n_ranks`, expert parallel only.
    pub fn ep(rank: usize, n_ranks: usize) -> Shard {
        Shard {
            rank,
            n_ranks,
            tp: false,
        }
    }

    /// Whether the ranks split the attention and the shared expert (TP).
    pub fn is_tp(&self) -> bool {
        self.tp && self.is_split()
    }

    /// This rank's items `a .. a + count` of `n` split by TP (all of them without TP): equal
    /// contiguous parts where `n` divides (the caller checks [`Shard::tp_fits`]).
    pub fn part(&self, n: usize) -> (usize, usize) {
        if !self.is_tp() {
            return (0, n);
        }
        (n * self.rank / self.n_ranks, n / self.n_ranks)
    }

    /// Whether `n_ranks` can split `o_groups` attention output groups (each `o_rank` columns of
    /// `out_b`, whose quant blocks hold `out_b_block` elements) and a shared expert of hidden
    /// width `ff` (its down's blocks `down_block`): equal parts of whole blocks.
    pub fn tp_fits(
        n_ranks: usize,
        o_groups: usize,
        o_rank: usize,
        out_b_block: usize,
        ff: usize,
        down_block: usize,
    ) -> bool {
        let whole = |n: usize, b: usize| {
            n.is_multiple_of(n_ranks) && (n / n_ranks).is_multiple_of(b.max(1))
        };
        n_ranks > 1
            && o_groups.is_multiple_of(n_ranks)
            && whole(o_groups * o_rank, out_b_block)
            && whole(ff, down_block)
    }

    /// The experts `e0 .. e0 + count` of `n_expert` this rank holds: contiguous ranges, sizes
    /// differing by at most one (16 over 3 ranks: 5, 5, 6), so a rank's experts are one
    /// contiguous byte range of each GGUF expert stack (mapped, never copied on the host).
    pub fn experts(&self, n_expert: usize) -> (usize, usize) {
        let a = n_expert * self.rank / self.n_ranks;
        let b = n_expert * (self.rank + 1) / self.n_ranks;
        (a, b - a)
    }

    pub fn is_split(&self) -> bool {
        self.n_ranks > 1
    }
}

/// The host rule of [`crate::Backend::moe_localize`] on `[n, k]` selections and weights: a
/// selection of an expert `e0 <= e < e0 + count` becomes `e - e0`; any other keeps a zero
/// weight and points at one the token does hold (its first local selection, so a backend that
/// computes each distinct expert of a token once does no extra work for it), or at local expert
/// 0 where the token has none here. A zero-weight slot adds exactly 0 to the sum (its expert's
/// output is finite: SwiGLU is clamped). Every backend's implementation gives these values.
pub fn localize(sel: &mut [i32], wgt: &mut [f32], k: usize, e0: usize, count: usize) {
    let local = |e: i32| e >= e0 as i32 && e < (e0 + count) as i32;
    for (s, w) in sel.chunks_mut(k).zip(wgt.chunks_mut(k)) {
        let first = s.iter().find(|&&e| local(e)).map_or(0, |&e| e - e0 as i32);
        for (e, w) in s.iter_mut().zip(w.iter_mut()) {
            if local(*e) {
                *e -= e0 as i32;
            } else {
                *e = first;
                *w = 0.0;
            }
        }
    }
}

/// An all-reduce between ranks of one process through host memory: each rank hands its
/// values in, waits for all, and takes the sum over ranks in rank order (the same bits on every
/// rank). The CPU's EP transport, and the GPU's where NCCL / RCCL cannot run (several ranks on
/// one device: tests). Every rank must call [`HostComm::all_reduce`] the same number of times
/// with the same lengths; a rank that stops early leaves the others waiting (as NCCL would).
pub struct HostComm {
    n: usize,
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

impl HostComm {
    pub fn new(n_ranks: usize) -> Arc<HostComm> {
        assert!(n_ranks >= 1, "a communicator of no ranks");
        Arc::new(HostComm {
            n: n_ranks,
            slots: Mutex::new(vec![Vec::new(); n_ranks]),
            barrier: Barrier::new(n_ranks),
        })
    }

    pub fn n_ranks(&self) -> usize {
        self.n
    }

    /// `data = Σ_r data_r` over the ranks, summed in rank order.
    pub fn all_reduce(&self, rank: usize, data: &mut [f32]) {
        if self.n == 1 {
            return;
        }
        {
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            s[rank].clear();
            s[rank].extend_from_slice(data);
        }
        self.barrier.wait();
        {
            let s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            assert!(
                s.iter().all(|v| v.len() == data.len()),
                "all_reduce: ranks passed different lengths"
            );
            data.copy_from_slice(&s[0]);
            for v in &s[1..] {
                data.iter_mut().zip(v).for_each(|(d, x)| *d += x);
            }
        }
        // Nobody refills a slot before every rank has read them all.
        self.barrier.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_cover_every_expert_once() {
        for n in [1usize, 2, 3, 5, 8] {
            let mut next = 0;
            for rank in 0..n {
                let (a, c) = Shard::ep(rank, n).experts(16);
                assert_eq!(a, next, "n {n} rank {rank}");
                assert!(c == 16 / n || c == 16 / n + 1, "n {n} rank {rank}: {c}");
                next = a + c;
            }
            assert_eq!(next, 16);
        }
        assert_eq!(Shard::ONE.experts(256), (0, 256));
    }

    #[test]
    fn tp_parts_cover_and_need_whole_blocks() {
        // 8 output groups of 1024 columns (Q8_0 out_b), shared expert 2048 wide (Q8_0 down).
        for n in [2usize, 4, 8] {
            assert!(Shard::tp_fits(n, 8, 1024, 32, 2048, 32), "{n}");
            let mut next = 0;
            for rank in 0..n {
                let s = Shard {
                    rank,
                    n_ranks: n,
                    tp: true,
                };
                let (a, c) = s.part(8);
                assert_eq!((a, c), (next, 8 / n));
                next = a + c;
            }
            assert_eq!(next, 8);
        }
        // 3 ranks do not divide 8 groups; 16 ranks leave no group; a K-quant down (256-element
        // blocks) of 2048 does not split 16 ways into whole blocks.
        assert!(!Shard::tp_fits(3, 8, 1024, 32, 2048, 32));
        assert!(!Shard::tp_fits(16, 8, 1024, 32, 2048, 32));
        assert!(Shard::tp_fits(8, 8, 1024, 32, 2048, 256)); // 256 each: one block
        assert!(!Shard::tp_fits(16, 16, 1024, 32, 2048, 256));
        assert!(
            !Shard::tp_fits(1, 8, 1024, 32, 2048, 32),
            "one rank splits nothing"
        );
        // Without TP (or one rank) a part is everything.
        assert_eq!(Shard::ep(1, 2).part(8), (0, 8));
        assert_eq!(Shard::ONE.part(2048), (0, 2048));
        assert!(!Shard {
            rank: 0,
            n_ranks: 1,
            tp: true
        }
        .is_tp());
    }

    #[test]
    fn localize_keeps_local_and_zeroes_the_rest() {
        // Token 0: experts 9, 2, 12 (rank of 8 .. 16 holds 9 and 12); token 1: 1, 3, 5 (none).
        let mut sel = vec![9, 2, 12, 1, 3, 5];
        let mut wgt = vec![0.5, 0.25, 0.125, 1.0, 2.0, 3.0];
        localize(&mut sel, &mut wgt, 3, 8, 8);
        assert_eq!(sel, vec![1, 1, 4, 0, 0, 0]);
        assert_eq!(wgt, vec![0.5, 0.0, 0.125, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn host_comm_sums_in_rank_order_on_every_rank() {
        let comm = HostComm::new(3);
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let comm = comm.clone();
                    s.spawn(move || {
                        let mut v = vec![r as f32 + 1.0, 1e8 * (r as f32 - 1.0), 0.5];
                        for _ in 0..4 {
                            comm.all_reduce(r, &mut v); // repeated calls reuse the slots
                        }
                        v
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // 4 rounds of sums: the first gives [6, 0, 1.5], then x3 each round.
        for v in &out {
            assert_eq!(v, &out[0]);
        }
        assert_eq!(out[0][0], 6.0 * 27.0);
        assert_eq!(out[0][2], 1.5 * 27.0);
    }
}
