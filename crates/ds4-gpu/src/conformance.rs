//! The op conformance suite: every GPU op against the CPU reference on random inputs.
//!
//! * Dequantisation must be bit-identical to `ds4_quant::dequantize_row`.
//! * Matrix-vector products are compared with an f64 sum of the same dequantised weights; the
//!   error bound is `tol · Σ|w·x|` (summation-order error, which grows with K), with `tol` per
//!   type; the CPU kernel (`ds4_quant::dot_kernel`) is held to the same bound, so a failing GPU
//!   result is worse than the reference's own rounding. Both the K-split and unsplit forms run.
//! * RMSNorm against ds4-cpu's definition (f64 sum of squares), elementwise ops exactly (add,
//!   mul, scale) or within 2 ulp-scale of `exp` (SwiGLU).
//!
//! Every output is poisoned with NaN before the op, so an unwritten element fails.

use std::io::Write;

use ds4_quant::GgmlType;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::Result;
use crate::gpu::{f32_bytes, Gpu};
use crate::runtime::Stream;

/// Types with GPU dequant/matvec kernels, each with its matvec tolerance (relative to Σ|w·x|).
pub const TYPES: &[(GgmlType, f64)] = &[
    (GgmlType::F32, 1e-5),
    (GgmlType::F16, 1e-5),
    (GgmlType::BF16, 1e-5),
    (GgmlType::Q8_0, 1e-5),
    (GgmlType::Q2_K, 1e-5),
    (GgmlType::Q4_K, 1e-5),
    (GgmlType::IQ2_XXS, 1e-5),
];

/// (rows, cols) of the matvec cases: rows not a multiple of the CTA's rows, split and unsplit.
pub const SHAPES: &[(usize, usize)] = &[(333, 4096), (4099, 512), (3, 16384)];

/// Outcome of one check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    pub fn passed(&self) -> usize {
        self.checks.iter().filter(|c| c.passed).count()
    }
    pub fn failed(&self) -> usize {
        self.checks.len() - self.passed()
    }
}

const POISON: u32 = 0x7fc0_0000; // quiet NaN

fn f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// A random row of `ty` with `cols` elements: random bytes (every code, sign and sub-scale
/// pattern occurs) with the f16 super-scales replaced by finite values, or random normals for
/// the float types.
pub fn random_row(ty: GgmlType, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
    let rb = ds4_quant::row_bytes(ty, cols).expect("whole blocks");
    let mut b = vec![0u8; rb];
    let scale = |rng: &mut dyn rand::RngCore| -> [u8; 2] {
        let mag = 10f32.powf(-3.0 + 2.0 * (rng.next_u32() as f32 / u32::MAX as f32));
        let s = if rng.next_u32() & 1 == 1 { -mag } else { mag };
        f16_bits(s).to_le_bytes()
    };
    let gauss = |rng: &mut dyn rand::RngCore| -> f32 {
        // Sum of 4 uniforms, centred: cheap, roughly normal, unbounded enough for tests.
        (0..4)
            .map(|_| rng.next_u32() as f32 / u32::MAX as f32)
            .sum::<f32>()
            - 2.0
    };
    match ty {
        GgmlType::F32 => {
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&gauss(rng).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_bits(gauss(rng)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                let bits = (gauss(rng).to_bits() >> 16) as u16;
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut b[..]);
            let (bb, offs): (usize, &[usize]) = match ty {
                GgmlType::Q8_0 => (34, &[0]),
                GgmlType::Q2_K => (84, &[80, 82]),
                GgmlType::Q4_K => (144, &[0, 2]),
                GgmlType::IQ2_XXS => (66, &[0]),
                _ => unreachable!("TYPES lists the supported types"),
            };
            for blk in b.chunks_exact_mut(bb) {
                for &o in offs {
                    blk[o..o + 2].copy_from_slice(&scale(rng));
                }
            }
        }
    }
    b
}

struct Suite<'a> {
    gpu: &'a Gpu,
    out: &'a mut dyn Write,
    report: Report,
}

impl Suite<'_> {
    fn record(&mut self, name: String, passed: bool, detail: String) {
        let _ = writeln!(
            self.out,
            "{} {name}: {detail}",
            if passed { "PASS" } else { "FAIL" }
        );
        self.report.checks.push(Check {
            name,
            passed,
            detail,
        });
    }

    fn poisoned(&self, n: usize) -> Result<crate::DeviceBuffer> {
        let b = self.gpu.alloc(n * 4)?;
        self.gpu
            .runtime()
            .memset_u32_async(b.ptr(), POISON, n, Stream::DEFAULT)?;
        Ok(b)
    }

    fn quant(
        &mut self,
        ty: GgmlType,
        tol: f64,
        rows: usize,
        cols: usize,
        rng: &mut Xoshiro256PlusPlus,
    ) -> Result<()> {
        let rb = ds4_quant::row_bytes(ty, cols)?;
        let mut w = Vec::with_capacity(rows * rb);
        for _ in 0..rows {
            w.extend(random_row(ty, cols, rng));
        }
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let dw = self.gpu.alloc_from(&w)?;
        let dx = self.gpu.alloc_f32(&x)?;

        // Dequantisation, bit for bit.
        let mut deq = vec![0f32; rows * cols];
        for (r, o) in deq.chunks_exact_mut(cols).enumerate() {
            ds4_quant::dequantize_row(ty, &w[r * rb..(r + 1) * rb], o)?;
        }
        let dd = self.poisoned(rows * cols)?;
        self.gpu
            .dequant(ty, dw.ptr(), dd.ptr(), rows, cols, Stream::DEFAULT)?;
        let got = self.gpu.download_f32(dd.ptr(), rows * cols)?;
        let bad = got
            .iter()
            .zip(&deq)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let first = got
            .iter()
            .zip(&deq)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        self.record(
            format!("dequant {ty} {rows}x{cols}"),
            bad == 0,
            match first {
                None => "bit-identical".into(),
                Some(i) => format!(
                    "{bad} elements differ; first at {i}: gpu {} cpu {}",
                    got[i], deq[i]
                ),
            },
        );

        // Reference: f64 sum of the dequantised weights; error scale Σ|w·x|.
        let kern = ds4_quant::dot_kernel(ty)?;
        let mut refs = Vec::with_capacity(rows);
        let mut mags = Vec::with_capacity(rows);
        let mut cpu_worst = 0f64;
        for r in 0..rows {
            let row = &deq[r * cols..(r + 1) * cols];
            let s: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let m: f64 = row
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let cpu = kern.dot(&w[r * rb..(r + 1) * rb], &x) as f64;
            cpu_worst = cpu_worst.max((cpu - s).abs() / m.max(f64::MIN_POSITIVE));
            refs.push(s);
            mags.push(m);
        }
        let plan = self.gpu.matvec_plan(rows, cols);
        for split in [false, true] {
            if split && plan.splits == 1 {
                continue;
            }
            let dy = self.poisoned(rows)?;
            let scratch = self.poisoned(plan.scratch_elems(rows).max(1))?;
            let sc = split.then(|| (scratch.ptr(), plan.scratch_elems(rows)));
            self.gpu.matvec(
                ty,
                dw.ptr(),
                dx.ptr(),
                dy.ptr(),
                rows,
                cols,
                sc,
                Stream::DEFAULT,
            )?;
            let y = self.gpu.download_f32(dy.ptr(), rows)?;
            let mut worst = 0f64;
            let mut worst_i = 0;
            for i in 0..rows {
                let e = (y[i] as f64 - refs[i]).abs() / mags[i].max(f64::MIN_POSITIVE);
                let e = if y[i].is_finite() { e } else { f64::INFINITY };
                if e > worst || e.is_nan() {
                    worst = if e.is_nan() { f64::INFINITY } else { e };
                    worst_i = i;
                }
            }
            let form = if split {
                format!("split-K x{}", plan.splits)
            } else {
                "unsplit".into()
            };
            self.record(
                format!("matvec {ty} {rows}x{cols} {form}"),
                worst <= tol && cpu_worst <= tol,
                format!(
                    "max |gpu-ref|/sum|w*x| = {worst:.2e} (row {worst_i}), cpu kernel {cpu_worst:.2e}, tol {tol:.0e}"
                ),
            );
        }
        Ok(())
    }

    fn rmsnorm(
        &mut self,
        rows: usize,
        n: usize,
        weighted: bool,
        rng: &mut Xoshiro256PlusPlus,
    ) -> Result<()> {
        let x: Vec<f32> = (0..rows * n).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
        let w: Vec<f32> = (0..n).map(|_| rng.gen_range(0.5f32..1.5)).collect();
        let eps = 1e-6f32;
        let dx = self.gpu.alloc_f32(&x)?;
        let dw = self.gpu.alloc_f32(&w)?;
        let dy = self.poisoned(rows * n)?;
        self.gpu.rmsnorm(
            dx.ptr(),
            weighted.then(|| dw.ptr()),
            dy.ptr(),
            rows,
            n,
            eps,
            Stream::DEFAULT,
        )?;
        let y = self.gpu.download_f32(dy.ptr(), rows * n)?;
        // ds4-cpu math::rms_norm.
        let mut worst = 0f64;
        for r in 0..rows {
            let xr = &x[r * n..(r + 1) * n];
            let ss: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum();
            let scale = (1.0 / ((ss / n as f64) + eps as f64).sqrt()) as f32;
            for i in 0..n {
                let want = if weighted {
                    xr[i] * scale * w[i]
                } else {
                    xr[i] * scale
                };
                let got = y[r * n + i];
                let e = ((got - want).abs() / want.abs().max(1e-30)) as f64;
                worst = worst.max(if got.is_finite() { e } else { f64::INFINITY });
            }
        }
        let tol = 1e-6;
        self.record(
            format!(
                "rmsnorm {rows}x{n}{}",
                if weighted { " weighted" } else { "" }
            ),
            worst <= tol,
            format!("max rel err {worst:.2e}, tol {tol:.0e}"),
        );
        Ok(())
    }

    fn elementwise(&mut self, n: usize, rng: &mut Xoshiro256PlusPlus) -> Result<()> {
        let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-12.0f32..12.0)).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.gen_range(-12.0f32..12.0)).collect();
        let (da, db) = (self.gpu.alloc_f32(&a)?, self.gpu.alloc_f32(&b)?);
        let s = 0.37f32;
        let (clamp, weight) = (7.0f32, 0.8f32);
        type Cpu = Box<dyn Fn(f32, f32) -> f32>;
        let silu = |v: f32| v * (1.0 / (1.0 + (-v).exp()));
        let cases: Vec<(&str, Cpu, f64)> = vec![
            ("add", Box::new(|x, y| x + y), 0.0),
            ("mul", Box::new(|x, y| x * y), 0.0),
            ("scale", Box::new(move |x, _| x * s), 0.0),
            (
                "swiglu",
                Box::new(move |g, u| silu(g.min(clamp)) * u.clamp(-clamp, clamp) * weight),
                2e-6,
            ),
        ];
        for (name, cpu, tol) in cases {
            let dy = self.poisoned(n)?;
            let (pa, pb, py) = (da.ptr(), db.ptr(), dy.ptr());
            match name {
                "add" => self.gpu.add(pa, pb, py, n, Stream::DEFAULT)?,
                "mul" => self.gpu.mul(pa, pb, py, n, Stream::DEFAULT)?,
                "scale" => self.gpu.scale(pa, py, s, n, Stream::DEFAULT)?,
                _ => self
                    .gpu
                    .swiglu(pa, pb, py, clamp, weight, n, Stream::DEFAULT)?,
            }
            let y = self.gpu.download_f32(py, n)?;
            let mut worst = 0f64;
            for i in 0..n {
                let want = cpu(a[i], b[i]);
                let e = if y[i].is_finite() {
                    ((y[i] - want).abs() / want.abs().max(1e-6)) as f64
                } else {
                    f64::INFINITY
                };
                worst = worst.max(e);
            }
            self.record(
                format!("{name} n={n}"),
                worst <= tol,
                format!("max rel err {worst:.2e}, tol {tol:.0e}"),
            );
        }
        Ok(())
    }
}

/// Run every check on `gpu`, printing one line per check to `out`. Errors from the driver
/// (not mismatches) abort with `Err`.
pub fn run(gpu: &Gpu, seed: u64, out: &mut dyn Write) -> Result<Report> {
    let info = gpu.info().clone();
    let _ = writeln!(
        out,
        "device: {} ({}, arch {}, warp {}, {} SMs, {:.1} GiB, {}), compiler {}",
        info.name,
        info.vendor,
        info.arch,
        info.warp,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.driver,
        gpu.runtime().compiler().version()
    );
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut s = Suite {
        gpu,
        out,
        report: Report::default(),
    };
    for &(ty, tol) in TYPES {
        for &(rows, cols) in SHAPES {
            s.quant(ty, tol, rows, cols, &mut rng)?;
        }
    }
    for (rows, n) in [(5, 4096), (3, 1000)] {
        s.rmsnorm(rows, n, true, &mut rng)?;
        s.rmsnorm(rows, n, false, &mut rng)?;
    }
    s.elementwise(1_000_003, &mut rng)?;
    let _ = writeln!(s.out, "modules: {:?}", gpu.module_origins());
    let r = s.report;
    let _ = writeln!(s.out, "{} passed, {} failed", r.passed(), r.failed());
    Ok(r)
}

/// Matvec throughput on `rows × cols` of `ty` (random blocks): median of `reps` event-timed
/// launches, as (ms, GB/s of weight bytes).
pub fn time_matvec(
    gpu: &Gpu,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    reps: usize,
) -> Result<(f64, f64)> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    let rb = ds4_quant::row_bytes(ty, cols)?;
    // One random row repeated would be cached; fill the whole matrix.
    let mut w = Vec::with_capacity(rows * rb);
    for _ in 0..rows {
        w.extend(random_row(ty, cols, &mut rng));
    }
    let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let dw = gpu.alloc_from(&w)?;
    let dx = gpu.alloc_from(f32_bytes(&x))?;
    let dy = gpu.alloc(rows * 4)?;
    let plan = gpu.matvec_plan(rows, cols);
    let scratch = gpu.alloc(plan.scratch_elems(rows).max(1) * 4)?;
    let sc = Some((scratch.ptr(), plan.scratch_elems(rows)));
    let rt = gpu.runtime();
    let (e0, e1) = (rt.event_create()?, rt.event_create()?);
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps + 3 {
        rt.event_record(e0, Stream::DEFAULT)?;
        gpu.matvec(
            ty,
            dw.ptr(),
            dx.ptr(),
            dy.ptr(),
            rows,
            cols,
            sc,
            Stream::DEFAULT,
        )?;
        rt.event_record(e1, Stream::DEFAULT)?;
        rt.event_sync(e1)?;
        if i >= 3 {
            times.push(rt.event_elapsed_ms(e0, e1)? as f64);
        }
    }
    rt.event_destroy(e0)?;
    rt.event_destroy(e1)?;
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let ms = times[times.len() / 2];
    Ok((ms, (rows * rb) as f64 / (ms * 1e-3) / 1e9))
}
