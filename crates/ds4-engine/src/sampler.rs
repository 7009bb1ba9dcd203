//! Token sampling from logits: greedy, temperature, top-k, top-p, min-p, seeded.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax; ties → lowest id).
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p × the best one (0 = off).
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Xoshiro256PlusPlus,
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

/// `ln Σ exp(logits)`, max-subtracted and summed in f64: `logits[t] − log_sum_exp` is the
/// log-probability of token `t`.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    m + logits
        .iter()
        .map(|v| ((v - m) as f64).exp())
        .sum::<f64>()
        .ln() as f32
}

/// The `k` most likely tokens with their log-probabilities, best first.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let lse = log_sum_exp(logits);
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    idx.into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect()
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
        Sampler { cfg, rng }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let c = &self.cfg;
        if c.temperature <= 0.0 || c.top_k == 1 {
            return argmax(logits);
        }
        // Candidates sorted by logit (ties: lower id first), then the filters in order.
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
        let mut r = self.rng.gen::<f64>() * total;
        for (i, &pi) in p[..n].iter().enumerate() {
            r -= pi;
            if r <= 0.0 {
                return cand[i];
            }
        }
        cand[n - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_lowest_id_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.0, 5.0, 5.0]), 1);
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let logits = [0.0, 1.0, 2.0, 3.0, 4.0];
        let run = |cfg: SamplerConfig| {
            let mut s = Sampler::new(cfg);
            let mut seen = [0usize; 5];
            for _ in 0..4000 {
                seen[s.sample(&logits) as usize] += 1;
            }
            seen
        };
        let base = SamplerConfig {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        let all = run(base.clone());
        assert!(all.iter().all(|&c| c > 0), "{all:?}");
        let k2 = run(SamplerConfig {
            top_k: 2,
            ..base.clone()
        });
        assert_eq!(&k2[..3], &[0, 0, 0]);
        // p(4) ≈ 0.64, p(3) ≈ 0.24: top-p 0.5 keeps only the best.
        let p = run(SamplerConfig {
            top_p: 0.5,
            ..base.clone()
        });
        assert_eq!(p, [0, 0, 0, 0, 4000]);
        // min-p 0.3: p(3)/p(4) = e^-1 ≈ 0.37 stays, p(2)/p(4) ≈ 0.14 goes.
        let mp = run(SamplerConfig {
            min_p: 0.3,
            ..base.clone()
        });
        assert_eq!(&mp[..3], &[0, 0, 0]);
        assert!(mp[3] > 0);
        // Same seed, same sequence.
        assert_eq!(run(base.clone()), all);
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let lp = top_logprobs(&[0.0, 2.0, 1.0], 3);
        assert_eq!(lp.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        let s: f32 = lp.iter().map(|x| x.1.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
    }
}
