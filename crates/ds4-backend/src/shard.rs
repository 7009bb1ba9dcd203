//! Expert parallelism (EP): a model split over `n_ranks` backends (GPUs, or CPU ranks in
//! tests). Every rank holds the dense weights and the whole session state and runs the same
//! schedule on the same tokens; rank `r` holds only the routed experts `Shard::experts` of
//! each layer. A MoE sublayer then sums, on each rank, the routed experts it holds (rank 0
//! adds the shared expert), and [`crate::Backend::all_reduce_sum`] adds the ranks' partial
//! sums, so every rank continues with the same values (design.md "multi-GPU").
//!
//! What that changes against one rank: the MoE output is `(rank 0's slots + shared) + rank
//! 1's slots + …` instead of the slots in selection order then the shared expert: the same
//! terms in another f32 summation order (a few ulp), nothing else.

use std::sync::{Arc, Barrier, Mutex};

/// Which part of the routed experts a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
}

impl Shard {
    /// One rank holding everything (no expert parallelism).
    pub const ONE: Shard = Shard {
        rank: 0,
        n_ranks: 1,
    };

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
                let (a, c) = Shard { rank, n_ranks: n }.experts(16);
                assert_eq!(a, next, "n {n} rank {rank}");
                assert!(c == 16 / n || c == 16 / n + 1, "n {n} rank {rank}: {c}");
                next = a + c;
            }
            assert_eq!(next, 16);
        }
        assert_eq!(Shard::ONE.experts(256), (0, 256));
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
