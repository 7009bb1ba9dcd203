//! File-less models: a [`WeightSource`] that asks the backend to generate every tensor of the
//! main GGUF ([`main_tensors`]) with the real names, dims and types of a quantisation mix, and
//! the value scales `ds4 synth` writes to files (norms ≈ 1, matrices of RMS 1/√fan_in, …), so
//! activations stay sane through every layer. For speed benchmarks at full size with no file.

use crate::forward::WeightSource;
use crate::hparams::HParams;
use crate::offload::HostStack;
use crate::tensors::{main_tensors, mtp_tensors, tensor_bytes, Family, Mix, TensorSpec};
use ds4_backend::{Backend, Fill, WeightKind};
use std::collections::HashMap;

/// A synthetic model shape (`--synthetic`), as `ds4 synth`'s presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthPreset {
    /// model.md §6.1: 6 layers, every code path, q2 types, a reduced vocabulary.
    Tiny,
    /// Real shapes, q2 mix (≈ 81 GB).
    FullQ2,
    /// Real shapes, q4 mix (≈ 153 GB).
    FullQ4,
}

impl SynthPreset {
    pub fn parse(s: &str) -> Option<SynthPreset> {
        match s {
            "tiny" => Some(SynthPreset::Tiny),
            "full-q2" => Some(SynthPreset::FullQ2),
            "full-q4" => Some(SynthPreset::FullQ4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SynthPreset::Tiny => "tiny",
            SynthPreset::FullQ2 => "full-q2",
            SynthPreset::FullQ4 => "full-q4",
        }
    }

    pub fn params(self) -> (HParams, Mix) {
        match self {
            SynthPreset::Tiny => (HParams::tiny(), Mix::Q2),
            SynthPreset::FullQ2 => (HParams::flash(), Mix::Q2),
            SynthPreset::FullQ4 => (HParams::flash(), Mix::Q4),
        }
    }
}

/// The fill of a tensor of `family` with fan-in `fan_in` (same scales as crates/ds4-synth).
pub fn fill_for(family: Family, fan_in: u64, hp: &HParams) -> Fill {
    let u = |center: f32, spread: f32| Fill::Uniform { center, spread };
    match family {
        Family::Norm => u(1.0, 0.1),
        Family::HcScale => u(1.0, 0.5),
        Family::HcBase | Family::Sinks => u(0.0, 0.8),
        Family::Bias => u(0.0, 0.1),
        Family::Tid2Eid => Fill::ExpertIds {
            n_expert: hp.n_expert,
        },
        // Uniform ±√3·σ has RMS σ = 1/√fan_in.
        _ => u(0.0, 3f32.sqrt() / (fan_in as f32).sqrt()),
    }
}

/// Generates the main model's tensors on the backend; `progress(bytes_done, bytes_total)`
/// after each tensor (bytes as the mix stores them).
pub struct SynthSource<'a> {
    hp: HParams,
    mix: Mix,
    seed: u64,
    specs: HashMap<String, (usize, TensorSpec)>,
    progress: &'a mut dyn FnMut(usize, usize),
    done: usize,
    total: usize,
}

impl<'a> SynthSource<'a> {
    pub fn new(
        hp: &HParams,
        mix: Mix,
        seed: u64,
        progress: &'a mut dyn FnMut(usize, usize),
    ) -> SynthSource<'a> {
        let list = main_tensors(hp);
        let total = list
            .iter()
            .map(|s| tensor_bytes(s, s.family.type_in(mix)).unwrap_or(0) as usize)
            .sum();
        let specs = list
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), (i, s)))
            .collect();
        SynthSource {
            hp: hp.clone(),
            mix,
            seed,
            specs,
            progress,
            done: 0,
            total,
        }
    }

    /// With `on`, the MTP block's tensors too (`mtp.0.*`, model.md §2.5, in the mix's types):
    /// the model then loads a random MTP block, for benchmarks of speculative steps.
    pub fn with_mtp(mut self, on: bool) -> Self {
        if on {
            for s in mtp_tensors(&self.hp) {
                self.total += tensor_bytes(&s, s.family.type_in(self.mix)).unwrap_or(0) as usize;
                let i = self.specs.len();
                self.specs.insert(s.name.clone(), (i, s));
            }
        }
        self
    }

    /// Bytes of every tensor as the mix stores them.
    pub fn total_bytes(&self) -> usize {
        self.total
    }
}

impl<B: Backend> WeightSource<B> for SynthSource<'_> {
    fn weight(&mut self, b: &B, name: &str, kind: WeightKind) -> Result<B::Weight, String> {
        let (i, spec) = self
            .specs
            .get(name)
            .ok_or_else(|| format!("synthetic model has no tensor {name}"))?;
        let ty = spec.family.type_in(self.mix);
        let fill = fill_for(spec.family, spec.fan_in(), &self.hp);
        // One independent stream per tensor.
        let seed = self
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(*i as u64 + 1);
        let w = b
            .random(kind, ty, &spec.dims, fill, seed)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        self.done += tensor_bytes(spec, ty).unwrap_or(0) as usize;
        (self.progress)(self.done, self.total);
        Ok(w)
    }

    fn experts(&mut self, b: &B, name: &str, e0: usize, count: usize) -> Result<B::Weight, String> {
        let dims = self.dims_of(name)?;
        if dims.len() != 3 {
            return Err(format!(
                "tensor {name}: experts of dims {dims:?}: not an expert stack"
            ));
        }
        // Its own stream per (tensor, first expert): a rank's experts are random weights of
        // the same scales, not the one-rank model's (benchmarks only need the shapes).
        self.part(b, name, WeightKind::Matrix, 2, e0, count)
    }

    fn rows(
        &mut self,
        b: &B,
        name: &str,
        kind: WeightKind,
        r0: usize,
        count: usize,
    ) -> Result<B::Weight, String> {
        let r = self.dims_of(name)?.len() - 1; // rows: the outer dim (a vector's elements)
        self.part(b, name, kind, r, r0, count)
    }

    fn cols(&mut self, b: &B, name: &str, c0: usize, count: usize) -> Result<B::Weight, String> {
        self.part(b, name, WeightKind::Matrix, 0, c0, count)
    }

    fn has(&self, name: &str) -> bool {
        self.specs.contains_key(name)
    }

    /// [`SynthSource::in_host_memory`].
    fn host_stack(&mut self, b: &B, name: &str) -> Result<HostStack, String> {
        match self.dims_of(name)? {
            &[c, r, e] => self.in_host_memory(b, name, [c, r, e]),
            d => Err(format!("tensor {name}: dims {d:?}: not an expert stack")),
        }
    }

    fn host_matrix(&mut self, b: &B, name: &str) -> Result<HostStack, String> {
        match self.dims_of(name)? {
            &[c, r] => self.in_host_memory(b, name, [c, r, 1]),
            d => Err(format!("tensor {name}: dims {d:?}: not a matrix")),
        }
    }
}

impl SynthSource<'_> {
    /// Tensor `name` (GGUF dims `dims`, a trailing 1 for a matrix) generated on the backend
    /// like any weight, then read back into an in-memory GGUF (the device copy is dropped):
    /// host memory holds it, as a file's mapping would.
    fn in_host_memory<B: Backend>(
        &mut self,
        b: &B,
        name: &str,
        dims: [u64; 3],
    ) -> Result<HostStack, String> {
        let ty = self.specs[name].1.family.type_in(self.mix);
        let w = <Self as WeightSource<B>>::weight(self, b, name, WeightKind::Matrix)?;
        HostStack::in_memory(name, ty, dims, |out| b.read_weight(&w, out))
    }

    fn dims_of(&self, name: &str) -> Result<&[u64], String> {
        self.specs
            .get(name)
            .map(|(_, s)| &s.dims[..])
            .ok_or_else(|| format!("synthetic model has no tensor {name}"))
    }

    /// Items `a .. a + count` of dim `axis` of tensor `name`: random weights of the tensor's
    /// type and scales in that shape, from their own stream (a tensor-parallel rank's part,
    /// as [`SynthSource`]'s experts: not the one-rank model's values).
    fn part<B: Backend>(
        &mut self,
        b: &B,
        name: &str,
        kind: WeightKind,
        axis: usize,
        a: usize,
        count: usize,
    ) -> Result<B::Weight, String> {
        let (i, spec) = self
            .specs
            .get(name)
            .ok_or_else(|| format!("synthetic model has no tensor {name}"))?;
        let n = spec.dims.get(axis).copied().unwrap_or(0) as usize;
        if count == 0 || a + count > n {
            return Err(format!(
                "tensor {name}: items {a}..{} of dim {axis} of {:?}",
                a + count,
                spec.dims
            ));
        }
        let ty = spec.family.type_in(self.mix);
        let fill = fill_for(spec.family, spec.fan_in(), &self.hp);
        let mut dims = spec.dims.clone();
        dims[axis] = count as u64;
        let seed = self
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(*i as u64 + 1)
            .wrapping_add(((a as u64) << 32) | ((axis as u64 + 1) << 60));
        let w = b
            .random(kind, ty, &dims, fill, seed)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        self.done += tensor_bytes(spec, ty).unwrap_or(0) as usize;
        (self.progress)(self.done, self.total);
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_q2_is_about_81_gb_and_names_are_known() {
        let (hp, mix) = SynthPreset::FullQ2.params();
        let mut p = |_: usize, _: usize| {};
        let s = SynthSource::new(&hp, mix, 1, &mut p);
        let gib = s.total_bytes() as f64 / (1u64 << 30) as f64;
        assert!((79.0..83.0).contains(&gib), "{gib}");
        assert!(!s.specs.contains_key("mtp.0.e_proj.weight"));
        assert!(s.specs.contains_key("blk.0.ffn_gate_tid2eid.weight"));
        // With the MTP block: its tensors (the names an MTP file binds), one layer's bytes more.
        let base = s.total_bytes();
        let m = SynthSource::new(&hp, mix, 1, &mut p).with_mtp(true);
        for t in mtp_tensors(&hp) {
            assert!(m.specs.contains_key(&t.name), "{}", t.name);
        }
        let extra = (m.total_bytes() - base) as f64 / (1u64 << 30) as f64;
        assert!((1.0..3.0).contains(&extra), "{extra} GiB");
        // Indices stay distinct (one random stream per tensor).
        let mut idx: Vec<usize> = m.specs.values().map(|(i, _)| *i).collect();
        idx.sort_unstable();
        idx.dedup();
        assert_eq!(idx.len(), m.specs.len());
    }

    #[test]
    fn fills_follow_ds4_synth_scales() {
        let hp = HParams::tiny();
        assert_eq!(
            fill_for(Family::Norm, 64, &hp),
            Fill::Uniform {
                center: 1.0,
                spread: 0.1
            }
        );
        match fill_for(Family::Proj, 4096, &hp) {
            Fill::Uniform { center, spread } => {
                assert_eq!(center, 0.0);
                assert!((spread / 3f32.sqrt() - 1.0 / 64.0).abs() < 1e-6);
            }
            f => panic!("{f:?}"),
        }
    }
}
