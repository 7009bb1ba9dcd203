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

pub use ds4_backend::sample::{argmax, select, SampleParams};

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

    /// The settings without the seed (what [`select`] and `Backend::sample` take).
    pub fn params(&self) -> SampleParams {
        SampleParams {
            temperature: self.cfg.temperature,
            top_k: self.cfg.top_k,
            top_p: self.cfg.top_p,
            min_p: self.cfg.min_p,
        }
    }

    /// The uniform draw for the next pick: one per non-greedy pick, none when greedy (0).
    pub fn draw(&mut self) -> f64 {
        if self.params().greedy() {
            0.0
        } else {
            self.rng.gen::<f64>()
        }
    }

    /// The draw [`Sampler::draw`] would give next, not taken.
    pub fn peek(&self) -> f64 {
        if self.params().greedy() {
            0.0
        } else {
            self.rng.clone().gen::<f64>()
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let u = self.draw();
        select(logits, &self.params(), u)
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

    fn temp1() -> SampleParams {
        SampleParams {
            temperature: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn select_walks_the_cumulative_in_logit_order_with_ties_by_id() {
        // Order 1, 2 (tie, lower id first), 3, 0; p ≈ 0.3995, 0.3995, 0.147, 0.054.
        let l = [1.0, 3.0, 3.0, 2.0];
        let pick = |u: f64| select(&l, &temp1(), u);
        assert_eq!(
            [pick(0.0), pick(0.3), pick(0.5), pick(0.9), pick(0.99)],
            [1, 1, 2, 3, 0]
        );
        let k2 = SampleParams {
            top_k: 2,
            ..temp1()
        };
        assert_eq!(select(&l, &k2, 0.99), 2);
        assert_eq!(select(&l, &k2, 0.1), 1);
        // top_k 1 and temperature 0 are greedy (u ignored).
        let k1 = SampleParams {
            top_k: 1,
            ..temp1()
        };
        assert_eq!(select(&l, &k1, 0.99), 1);
        assert_eq!(select(&l, &SampleParams::default(), 0.99), 1);
    }

    #[test]
    fn select_filters() {
        let l = [0.0, 1.0, 2.0, 3.0, 4.0];
        // top-p 0.5: only the best (p ≈ 0.64).
        let tp = SampleParams {
            top_p: 0.5,
            ..temp1()
        };
        assert!([0.0, 0.5, 0.999].iter().all(|&u| select(&l, &tp, u) == 4));
        // top-p 0.8: 4 and 3 (0.64 + 0.24).
        let tp = SampleParams {
            top_p: 0.8,
            ..temp1()
        };
        assert_eq!(select(&l, &tp, 0.999), 3);
        // min-p 0.3 keeps 4 and 3; min-p above 1 keeps the best only.
        let mp = SampleParams {
            min_p: 0.3,
            ..temp1()
        };
        assert_eq!(select(&l, &mp, 0.999), 3);
        let mp = SampleParams {
            min_p: 2.0,
            ..temp1()
        };
        assert_eq!(select(&l, &mp, 0.999), 4);
        // Low temperature sharpens: u = 0.9 still picks the best.
        let cold = SampleParams {
            temperature: 0.1,
            ..Default::default()
        };
        assert_eq!(select(&l, &cold, 0.9), 4);
        assert_eq!(select(&l, &temp1(), 0.999), 0);
    }

    #[test]
    fn sampler_is_select_with_its_seeded_draws() {
        let l: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let cfg = SamplerConfig {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            seed: 42,
        };
        let mut a = Sampler::new(cfg.clone());
        let mut b = Sampler::new(cfg);
        for _ in 0..200 {
            let u = b.draw();
            assert_eq!(a.sample(&l), select(&l, &b.params(), u));
        }
        // Greedy consumes no draws.
        let mut g = Sampler::new(SamplerConfig::default());
        assert_eq!(g.draw(), 0.0);
    }
}
