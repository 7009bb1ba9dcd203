//! Best-fit suballocation of large scratch blocks (a prompt step's activations) inside a few
//! big device regions, so that one step's blocks of many sizes share memory.
//!
//! Why: the pool's size classes (mod.rs `Pool`) keep a freed block for its own class only, so a
//! step's footprint was the sum over classes of each class's peak, not the peak of what is live
//! at once: an H100 2048-token step of the full-size q2 model held 1.0 GiB at its peak and
//! 1.72 GiB of blocks (session 49, `bench/results/gpu-s49-h100.txt`); a 4096-token step then ran
//! out of memory where its 1.95 GiB peak fit. Here a freed range is coalesced with its free
//! neighbours and serves any size.
//!
//! Pure bookkeeping over addresses (no device calls), so it is tested without a GPU; the pool
//! makes and frees the regions. All work runs on one stream, so a range freed here may be handed
//! out again at once (its next user is ordered after its last), as for the class lists.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Ranges are handed out in multiples of this (keeps every block 64 KiB-aligned inside a
/// region whose base is: the driver's allocations are 2 MiB-aligned).
pub(crate) const GRAIN: u64 = 64 << 10;

#[derive(Default)]
pub(crate) struct Arenas {
    /// Regions: base -> usable bytes (a region's last bytes past that are slack, never handed out).
    regions: BTreeMap<u64, u64>,
    /// Free ranges: start -> length; coalesced, never spanning two regions.
    free: BTreeMap<u64, u64>,
    /// The same ranges by (length, start): best fit is the first at least as long.
    by_len: BTreeSet<(u64, u64)>,
    /// Ranges handed out: start -> length.
    used: HashMap<u64, u64>,
}

impl Arenas {
    /// The length a request of `bytes` takes.
    pub(crate) fn len_for(bytes: u64) -> u64 {
        bytes.max(1).div_ceil(GRAIN) * GRAIN
    }

    /// A range of `bytes` from the free ranges (best fit, the lowest address among equals), or
    /// None where no free range is long enough.
    pub(crate) fn take(&mut self, bytes: u64) -> Option<u64> {
        let len = Self::len_for(bytes);
        let &(flen, start) = self.by_len.range((len, 0)..).next()?;
        self.remove_free(start, flen);
        if flen > len {
            self.insert_free(start + len, flen - len);
        }
        self.used.insert(start, len);
        Some(start)
    }

    /// A new region of `usable` bytes at `base` (its length a multiple of [`GRAIN`]).
    pub(crate) fn add_region(&mut self, base: u64, usable: u64) {
        debug_assert!(usable.is_multiple_of(GRAIN) && usable > 0);
        self.regions.insert(base, usable);
        self.insert_free(base, usable);
    }

    /// Returns the range at `start`; its length, or None where it was not handed out here.
    pub(crate) fn give(&mut self, start: u64) -> Option<u64> {
        let len = self.used.remove(&start)?;
        let region = self.region_of(start);
        let (mut s, mut l) = (start, len);
        // The free range just before, when it ends here and lies in the same region.
        if let Some((&ps, &pl)) = self.free.range(..s).next_back() {
            if ps + pl == s && self.region_of(ps) == region {
                self.remove_free(ps, pl);
                s = ps;
                l += pl;
            }
        }
        // The free range just after.
        if let Some(&nl) = self.free.get(&(s + l)) {
            if self.region_of(s + l) == region {
                self.remove_free(s + l, nl);
                l += nl;
            }
        }
        self.insert_free(s, l);
        Some(len)
    }

    /// Regions nothing is handed out from (base, usable bytes), removed from the bookkeeping:
    /// the caller frees them.
    pub(crate) fn take_idle_regions(&mut self) -> Vec<(u64, u64)> {
        let idle: Vec<(u64, u64)> = self
            .regions
            .iter()
            .filter(|(b, u)| self.free.get(b) == Some(u))
            .map(|(&b, &u)| (b, u))
            .collect();
        for &(b, u) in &idle {
            self.regions.remove(&b);
            self.remove_free(b, u);
        }
        idle
    }

    /// Bytes handed out, and bytes of the regions free.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> (u64, u64) {
        (self.used.values().sum(), self.free.values().sum())
    }

    fn region_of(&self, addr: u64) -> Option<u64> {
        let (&b, &u) = self.regions.range(..=addr).next_back()?;
        (addr < b + u).then_some(b)
    }

    fn insert_free(&mut self, s: u64, l: u64) {
        self.free.insert(s, l);
        self.by_len.insert((l, s));
    }

    fn remove_free(&mut self, s: u64, l: u64) {
        self.free.remove(&s);
        self.by_len.remove(&(l, s));
    }
}

#[cfg(test)]
mod tests {
    use super::{Arenas, GRAIN};

    const MIB: u64 = 1 << 20;

    #[test]
    fn freed_ranges_coalesce_and_serve_other_sizes() {
        let mut a = Arenas::default();
        a.add_region(1 << 40, 256 * MIB);
        // 96 + 96 + 64 MiB fill the region; nothing more fits.
        let x = a.take(96 * MIB).unwrap();
        let y = a.take(96 * MIB).unwrap();
        let z = a.take(64 * MIB).unwrap();
        assert_eq!(
            (x, y, z),
            (1 << 40, (1 << 40) + 96 * MIB, (1 << 40) + 192 * MIB)
        );
        assert_eq!(a.take(1), None);
        // Freeing x and y leaves one 192 MiB range, which a 160 MiB block then takes.
        assert_eq!(a.give(x), Some(96 * MIB));
        assert_eq!(a.give(y), Some(96 * MIB));
        assert_eq!(a.bytes(), (64 * MIB, 192 * MIB));
        assert_eq!(a.take(160 * MIB), Some(1 << 40));
        // Not handed out: nothing happens.
        assert_eq!(a.give(12345), None);
        assert_eq!(a.bytes(), (224 * MIB, 32 * MIB));
    }

    #[test]
    fn best_fit_and_regions_stay_apart() {
        let mut a = Arenas::default();
        // Two regions that touch in the address space: never one range across both.
        let (r0, r1) = (1u64 << 40, (1u64 << 40) + 64 * MIB);
        a.add_region(r0, 64 * MIB);
        a.add_region(r1, 32 * MIB);
        assert_eq!(a.take(80 * MIB), None, "no range spans the two regions");
        // Best fit: 20 MiB goes to the 32 MiB region, not the 64 MiB one.
        let b = a.take(20 * MIB).unwrap();
        assert_eq!(b, r1);
        a.give(b);
        assert_eq!(
            a.take(80 * MIB),
            None,
            "freed ranges do not merge across regions"
        );
        // Both regions are idle again and come back whole.
        let mut idle = a.take_idle_regions();
        idle.sort_unstable();
        assert_eq!(idle, vec![(r0, 64 * MIB), (r1, 32 * MIB)]);
        assert_eq!(a.bytes(), (0, 0));
    }

    #[test]
    fn a_region_in_use_is_not_idle() {
        let mut a = Arenas::default();
        a.add_region(0x1000_0000, 8 * MIB);
        a.add_region(0x4000_0000, 8 * MIB);
        let b = a.take(MIB).unwrap();
        assert_eq!(a.take_idle_regions().len(), 1);
        assert_eq!(a.bytes(), (MIB, 7 * MIB));
        a.give(b);
        assert_eq!(a.take_idle_regions(), vec![(b, 8 * MIB)]);
    }

    /// Random takes and gives: handed-out ranges never overlap, stay inside one region, and
    /// when all are given back every region is one free range again.
    #[test]
    fn random_sequences_keep_ranges_disjoint() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut a = Arenas::default();
        let regions = [
            (1u64 << 40, 512 * MIB),
            ((1u64 << 40) + 512 * MIB, 256 * MIB),
            (3u64 << 40, 1024 * MIB),
        ];
        for &(b, u) in &regions {
            a.add_region(b, u);
        }
        let mut live: Vec<(u64, u64)> = Vec::new();
        for _ in 0..20_000 {
            if live.is_empty() || rnd() % 3 != 0 {
                let bytes = 1 + rnd() % (160 * MIB);
                if let Some(s) = a.take(bytes) {
                    live.push((s, Arenas::len_for(bytes)));
                }
            } else {
                let i = (rnd() as usize) % live.len();
                let (s, l) = live.swap_remove(i);
                assert_eq!(a.give(s), Some(l));
            }
            let used: u64 = live.iter().map(|x| x.1).sum();
            assert_eq!(a.bytes(), (used, 1792 * MIB - used));
        }
        live.sort_unstable();
        for w in live.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {w:?}");
        }
        for &(s, l) in &live {
            assert_eq!(s % GRAIN, 0);
            assert!(
                regions.iter().any(|&(b, u)| s >= b && s + l <= b + u),
                "{s} {l}"
            );
        }
        for (s, l) in live.drain(..) {
            assert_eq!(a.give(s), Some(l));
        }
        let mut idle = a.take_idle_regions();
        idle.sort_unstable();
        assert_eq!(idle, regions.to_vec());
    }
}
