//! Token selection from logits (greedy / temperature / top-k / top-p / min-p) given one uniform
//! draw `u` in [0, 1): the reference every backend's [`crate::Backend::sample`] follows, so a
//! seeded host RNG picks the same token on the CPU and on a device.

/// Sampling settings of one request (the RNG stays with the caller).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 = greedy (argmax; ties → lowest id).
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p × the best one (0 = off).
    pub min_p: f32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }
}

impl SampleParams {
    /// The pick is the argmax (no draw is used).
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Index of the largest value, lowest index on ties.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// [`select`] of each `vocab`-long row of `logits` with its draw (`draws[r]` for row r).
pub fn select_rows(logits: &[f32], vocab: usize, c: &SampleParams, draws: &[f64]) -> Vec<u32> {
    logits
        .chunks(vocab.max(1))
        .zip(draws)
        .map(|(l, &u)| select(l, c, u))
        .collect()
}

/// The token for draw `u` ∈ [0, 1). Candidates in order of logit (`total_cmp`, ties: lower id
/// first); top-k keeps the first k; weights `exp(f64((l − max) / T))` (the difference and the
/// division in f32) normalised over those; min-p keeps `p ≥ p_best · min_p` (at least one);
/// top-p the shortest prefix whose mass reaches `top_p`; then the first candidate whose
/// cumulative probability reaches `u × (mass kept)`.
pub fn select(logits: &[f32], c: &SampleParams, u: f64) -> u32 {
    if c.greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let keep = if c.top_k > 0 {
        c.top_k.min(logits.len())
    } else {
        logits.len()
    };
    let cand = if keep < logits.len() / 16 {
        // A short top-k: select, then sort the few kept, on (key, id) pairs as one u64 each
        // (distinct, so the order is the comparison's).
        top(logits, keep)
    } else {
        let mut cand = order(logits);
        cand.truncate(keep);
        cand
    };
    let m = logits[cand[0] as usize];
    let mut p: Vec<f64> = cand
        .iter()
        .map(|&i| (((logits[i as usize] - m) / c.temperature) as f64).exp())
        .collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    let mut n = p.len();
    if c.min_p > 0.0 {
        let floor = p[0] * c.min_p as f64;
        n = p.iter().take_while(|&&x| x >= floor).count().max(1);
    }
    if c.top_p < 1.0 {
        let mut acc = 0.0;
        let mut k = 0;
        while k < n {
            acc += p[k];
            k += 1;
            if acc >= c.top_p as f64 {
                break;
            }
        }
        n = k.max(1);
    }
    let total: f64 = p[..n].iter().sum();
    let mut r = u * total;
    for (i, &pi) in p[..n].iter().enumerate() {
        r -= pi;
        if r <= 0.0 {
            return cand[i];
        }
    }
    cand[n - 1]
}

/// Key of `v` whose ascending order is `total_cmp`'s descending order.
fn desc_key(v: f32) -> u32 {
    let b = v.to_bits() as i32;
    // total_cmp's key (an i32 in ascending order) made unsigned, then reversed.
    let k = (b ^ ((((b >> 31) as u32) >> 1) as i32)) as u32 ^ 0x8000_0000;
    !k
}

/// The first `k` (≥ 1) ids of [`order`], by a selection and a sort of those `k`.
fn top(logits: &[f32], k: usize) -> Vec<u32> {
    let mut a = keys(logits);
    a.select_nth_unstable(k - 1);
    a.truncate(k);
    a.sort_unstable();
    a.into_iter().map(|x| x as u32).collect()
}

/// `(desc_key << 32) | id` of every value: ascending order is the candidates' order.
fn keys(logits: &[f32]) -> Vec<u64> {
    logits
        .iter()
        .enumerate()
        .map(|(i, &v)| ((desc_key(v) as u64) << 32) | i as u64)
        .collect()
}

/// All ids of `logits` in order of logit (`total_cmp`, descending), lower id first among equal
/// values: the order a comparison sort by (logit, id) gives, by a stable LSD radix sort of the
/// ids (taken in ascending order) on their 32-bit keys, 3 passes of 11 bits. A full-vocabulary
/// pick (129,280) went 8.2 -> 4.7 ms with it on a 2-core host (example `select_bench`; the
/// comparison sort alone took 6.6).
fn order(logits: &[f32]) -> Vec<u32> {
    const BITS: u32 = 11;
    let mut a = keys(logits);
    let mut b = vec![0u64; a.len()];
    for pass in 0..3 {
        let shift = 32 + pass * BITS;
        let digit = |x: u64| ((x >> shift) & ((1 << BITS) - 1)) as usize;
        let mut count = [0usize; 1 << BITS];
        for &x in &a {
            count[digit(x)] += 1;
        }
        let mut at = 0;
        for c in count.iter_mut() {
            (*c, at) = (at, at + *c);
        }
        for &x in &a {
            let d = digit(x);
            b[count[d]] = x;
            count[d] += 1;
        }
        std::mem::swap(&mut a, &mut b);
    }
    a.into_iter().map(|x| x as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The radix order is the comparison sort's on values with ties, both zeros, infinities
    /// and NaNs of both signs, at the vocabulary's size and at small ones.
    #[test]
    fn radix_order_is_the_comparison_order() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let specials = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            1.5,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::MAX,
        ];
        for n in [1usize, 2, 7, 300, 129_280] {
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let r = next();
                    match r % 8 {
                        0 => specials[(r >> 8) as usize % specials.len()],
                        1 => ((r >> 8) % 5) as f32, // many exact ties
                        _ => {
                            f32::from_bits((r >> 16) as u32 & 0x7fff_ffff)
                                * if r & 4 == 0 { 1.0 } else { -1.0 }
                        }
                    }
                })
                .collect();
            let mut want: Vec<u32> = (0..n as u32).collect();
            want.sort_by(|a, b| v[*b as usize].total_cmp(&v[*a as usize]).then(a.cmp(b)));
            assert_eq!(order(&v), want, "n {n}");
            for k in [1, n.div_ceil(20), n] {
                assert_eq!(top(&v, k), want[..k], "n {n} top {k}");
            }
        }
    }

    /// The pick for a grid of draws equals the comparison-sort reference's, with and without
    /// top-k / top-p / min-p, on a vocabulary of random logits with ties.
    #[test]
    fn select_picks_as_the_sorted_reference() {
        let mut s = 99u64;
        let logits: Vec<f32> = (0..129_280)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if i % 9 == 0 {
                    2.0
                } else {
                    ((s >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
                }
            })
            .collect();
        let reference = |c: &SampleParams, u: f64| {
            let mut cand: Vec<u32> = (0..logits.len() as u32).collect();
            cand.sort_by(|a, b| {
                logits[*b as usize]
                    .total_cmp(&logits[*a as usize])
                    .then(a.cmp(b))
            });
            if c.top_k > 0 {
                cand.truncate(c.top_k);
            }
            let m = logits[cand[0] as usize];
            let p: Vec<f64> = cand
                .iter()
                .map(|&i| (((logits[i as usize] - m) / c.temperature) as f64).exp())
                .collect();
            let total: f64 = p.iter().sum();
            let p: Vec<f64> = p.iter().map(|x| x / total).collect();
            let mut n = p.len();
            if c.min_p > 0.0 {
                n = p
                    .iter()
                    .take_while(|&&x| x >= p[0] * c.min_p as f64)
                    .count()
                    .max(1);
            }
            if c.top_p < 1.0 {
                let (mut acc, mut k) = (0.0, 0);
                while k < n {
                    acc += p[k];
                    k += 1;
                    if acc >= c.top_p as f64 {
                        break;
                    }
                }
                n = k.max(1);
            }
            let mut r = u * p[..n].iter().sum::<f64>();
            for (i, &pi) in p[..n].iter().enumerate() {
                r -= pi;
                if r <= 0.0 {
                    return cand[i];
                }
            }
            cand[n - 1]
        };
        let t = |temperature| SampleParams {
            temperature,
            ..Default::default()
        };
        let configs = [
            t(0.8),
            t(3.0),
            SampleParams {
                top_p: 0.9,
                ..t(1.0)
            },
            SampleParams {
                min_p: 0.05,
                ..t(0.7)
            },
            SampleParams {
                top_k: 40,
                ..t(1.0)
            },
            SampleParams {
                top_k: 20_000,
                top_p: 0.5,
                ..t(2.0)
            },
        ];
        for c in &configs {
            for i in 0..16 {
                let u = (i as f64 + 0.37) / 16.0;
                assert_eq!(select(&logits, c, u), reference(c, u), "{c:?} u {u}");
            }
        }
    }
}
