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

/// The token for draw `u` ∈ [0, 1). Candidates in order of logit (`total_cmp`, ties: lower id
/// first); top-k keeps the first k; weights `exp(f64((l − max) / T))` (the difference and the
/// division in f32) normalised over those; min-p keeps `p ≥ p_best · min_p` (at least one);
/// top-p the shortest prefix whose mass reaches `top_p`; then the first candidate whose
/// cumulative probability reaches `u × (mass kept)`.
pub fn select(logits: &[f32], c: &SampleParams, u: f64) -> u32 {
    if c.greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let mut cand: Vec<u32> = (0..logits.len() as u32).collect();
    let keep = if c.top_k > 0 {
        c.top_k.min(cand.len())
    } else {
        cand.len()
    };
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if keep < cand.len() {
        cand.select_nth_unstable_by(keep - 1, by_logit);
        cand.truncate(keep);
    }
    cand.sort_by(by_logit);
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
