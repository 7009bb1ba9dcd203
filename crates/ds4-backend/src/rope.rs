//! Partial interleaved RoPE on the tail of a row (model.md §3.1, §7.1–7.5).

/// Pair frequencies of one layer class. Angles are formed in f64 and reduced before the f32
/// cos/sin (the most accurate choice of §7.5).
#[derive(Clone, Debug)]
pub struct Rope {
    /// ω_p for p = 0 .. n_rot/2.
    pub freqs: Vec<f64>,
}

impl Rope {
    /// Plain RoPE (SWA-only layers and MTP): `ω_p = base^(−2p/n_rot)`.
    pub fn plain(base: f32, n_rot: usize) -> Rope {
        let freqs = (0..n_rot / 2)
            .map(|p| (base as f64).powf(-2.0 * p as f64 / n_rot as f64))
            .collect();
        Rope { freqs }
    }

    /// YaRN-blended frequencies of the compressed layers, with no magnitude factor.
    pub fn yarn(
        base: f32,
        n_rot: usize,
        factor: f32,
        orig_ctx: u64,
        beta_fast: f32,
        beta_slow: f32,
    ) -> Rope {
        let base = base as f64;
        let n = n_rot as f64;
        // Pair index at which a wavelength completes `beta` turns over the original context.
        let c = |beta: f64| {
            n * ((orig_ctx as f64) / (2.0 * std::f64::consts::PI * beta)).ln() / (2.0 * base.ln())
        };
        let lo = c(beta_fast as f64).floor().max(0.0);
        let hi = c(beta_slow as f64).ceil().min(n - 1.0);
        let span = if hi == lo { 0.001 } else { hi - lo };
        let freqs = (0..n_rot / 2)
            .map(|p| {
                let w0 = base.powf(-2.0 * p as f64 / n);
                let ramp = ((p as f64 - lo) / span).clamp(0.0, 1.0);
                let keep = 1.0 - ramp; // γ_p: share of the original frequency
                (w0 / factor as f64) * (1.0 - keep) + w0 * keep
            })
            .collect();
        Rope { freqs }
    }

    /// Rotate the last `2·freqs.len()` elements of `v` by position `t` (inverse: by −t).
    pub fn apply(&self, v: &mut [f32], t: u64, inverse: bool) {
        let n_rot = 2 * self.freqs.len();
        let tail = v.len() - n_rot;
        for (p, &w) in self.freqs.iter().enumerate() {
            let theta = (t as f64 * w) % std::f64::consts::TAU;
            let (s, c) = theta.sin_cos();
            let (s, c) = (if inverse { -s } else { s } as f32, c as f32);
            let (a, b) = (v[tail + 2 * p], v[tail + 2 * p + 1]);
            v[tail + 2 * p] = a * c - b * s;
            v[tail + 2 * p + 1] = a * s + b * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_ramp_matches_model_md() {
        // lo = 15, hi = 25 for the real constants: pairs ≤ 15 keep ω⁰, pairs ≥ 25 are ω⁰/16.
        let r = Rope::yarn(160000.0, 64, 16.0, 65536, 32.0, 1.0);
        let w0 = |p: usize| 160000f64.powf(-2.0 * p as f64 / 64.0);
        assert!((r.freqs[15] - w0(15)).abs() < 1e-15);
        assert!((r.freqs[25] - w0(25) / 16.0).abs() < 1e-15);
        assert!(r.freqs[20] < w0(20) && r.freqs[20] > w0(20) / 16.0);
    }

    #[test]
    fn inverse_undoes_forward() {
        let r = Rope::plain(10000.0, 64);
        let mut v: Vec<f32> = (0..128).map(|i| i as f32 * 0.01).collect();
        let orig = v.clone();
        r.apply(&mut v, 12345, false);
        assert_ne!(v, orig);
        assert_eq!(&v[..64], &orig[..64]);
        r.apply(&mut v, 12345, true);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}

/// The two frequency tables of a model (plain and YaRN), built once from its parameters.
#[derive(Clone, Debug)]
pub struct RopeTables {
    pub swa: Rope,
    pub comp: Rope,
}

impl RopeTables {
    pub fn get(&self, kind: crate::RopeKind) -> &Rope {
        match kind {
            crate::RopeKind::Swa => &self.swa,
            crate::RopeKind::Comp => &self.comp,
        }
    }
}
