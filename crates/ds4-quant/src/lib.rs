//! Quantisation block formats (model.md §5): dequantisation, exact dot products, quantisers.
//!
//! Supported types: F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS (and I32 tables for reading).
//! A *row* is a whole number of blocks, laid out as in GGUF (model.md §0: `out` rows of `in`
//! elements). Dot products are *exact mode*: `Σ dequant(w)·x` in f32 with f32 activations (no
//! activation quantisation); SIMD paths differ from the portable one only in summation order.
//!
//! ISA paths: on x86-64 AVX2+FMA+F16C and AVX-512F, detected once at first use; on AArch64
//! NEON (always present there). Set `DS4_QUANT_PORTABLE=1` (read once) or call
//! [`set_force_portable`] to force the portable path.

pub mod act;
mod iq2_tables;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
mod quantize;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

pub use ds4_gguf::GgmlType;
pub use iq2_tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
pub use quantize::quantize_row;

/// Errors from this crate. Every variant names the type and the quantity that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{op} is not supported for ggml type {ty}")]
    Unsupported { ty: GgmlType, op: &'static str },
    #[error("{ty}: a row of {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty}: {what} has length {got}, expected {expected}")]
    Length {
        ty: GgmlType,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("I32: value {value} at element {index} is not exactly representable as f32")]
    InexactI32 { index: usize, value: i32 },
    #[error("instruction set {0} is not available on this CPU")]
    IsaUnavailable(Isa),
}

/// The types that have a dequantiser, a dot product and a quantiser here.
pub const SUPPORTED: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
];

/// Whether `ty` is one of [`SUPPORTED`].
pub fn is_supported(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty)
}

fn require_supported(ty: GgmlType, op: &'static str) -> Result<(), QuantError> {
    if is_supported(ty) {
        Ok(())
    } else {
        Err(QuantError::Unsupported { ty, op })
    }
}

/// Bytes of a row of `n` elements of `ty`, or an error when `n` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block = ty.block_elems() as usize;
    ty.row_bytes(n as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or(QuantError::PartialBlock { ty, n, block })
}

/// Check that `bytes` holds exactly one row of `n` elements of `ty`.
fn check_row(ty: GgmlType, what: &'static str, bytes: usize, n: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, n)?;
    if bytes != expected {
        return Err(QuantError::Length {
            ty,
            what,
            expected,
            got: bytes,
        });
    }
    Ok(())
}

/// Dequantise one row: `src` holds `dst.len()` elements of type `ty`, written to `dst` as f32.
/// The result is bit-identical to `gguf.quants.dequantize` (pip `gguf` 0.19). I32 is accepted
/// for integer tables and fails if a value has no exact f32 (|v| > 2^24); see [`read_i32_row`].
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if ty == GgmlType::I32 {
        check_row(ty, "source row", src.len(), dst.len())?;
        for (i, (c, o)) in src.chunks_exact(4).zip(dst.iter_mut()).enumerate() {
            let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if v.unsigned_abs() > 1 << 24 {
                return Err(QuantError::InexactI32 { index: i, value: v });
            }
            *o = v as f32;
        }
        return Ok(());
    }
    require_supported(ty, "dequantisation")?;
    check_row(ty, "source row", src.len(), dst.len())?;
    portable::dequantize(ty, src, dst);
    Ok(())
}

/// Read an I32 table row (e.g. `ffn_gate_tid2eid`): `src` holds `dst.len()` little-endian i32.
pub fn read_i32_row(src: &[u8], dst: &mut [i32]) -> Result<(), QuantError> {
    check_row(GgmlType::I32, "source row", src.len(), dst.len())?;
    for (c, o) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ISA selection

/// A dot-product implementation family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 AVX2 + FMA + F16C, 256-bit.
    Avx2,
    /// x86-64 AVX-512F (+F16C), 512-bit.
    Avx512,
    /// AArch64 Advanced SIMD, 128-bit (every AArch64 CPU has it).
    Neon,
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        })
    }
}

struct Detected {
    avx2: bool,
    avx512: bool,
    env_portable: bool,
}

fn detected() -> &'static Detected {
    static D: OnceLock<Detected> = OnceLock::new();
    D.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let (avx2, avx512) = (
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"),
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("f16c"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, avx512) = (false, false);
        let env_portable = std::env::var("DS4_QUANT_PORTABLE")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false);
        Detected {
            avx2,
            avx512,
            env_portable,
        }
    })
}

static FORCE_PORTABLE: AtomicBool = AtomicBool::new(false);

/// Force (or stop forcing) the portable path for [`dot_row`], [`dot_kernel`] and [`matvec`].
/// `DS4_QUANT_PORTABLE=1` in the environment forces it regardless of this switch. Kernels
/// already resolved with [`dot_kernel`] keep the path they were resolved for.
pub fn set_force_portable(on: bool) {
    FORCE_PORTABLE.store(on, Ordering::Relaxed);
}

impl Isa {
    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => detected().avx2,
            Isa::Avx512 => detected().avx512,
            Isa::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// All paths this CPU can run, portable first.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// The fastest path this CPU can run (ignores forcing).
    pub fn best() -> Isa {
        if Isa::Avx512.is_available() {
            Isa::Avx512
        } else if Isa::Avx2.is_available() {
            Isa::Avx2
        } else if Isa::Neon.is_available() {
            Isa::Neon
        } else {
            Isa::Portable
        }
    }
}

/// The path [`dot_row`], [`dot_kernel`] and [`matvec`] use now.
pub fn active_isa() -> Isa {
    if detected().env_portable || FORCE_PORTABLE.load(Ordering::Relaxed) {
        Isa::Portable
    } else {
        Isa::best()
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products

/// Inner kernel contract: processes `min(whole blocks in row, whole blocks in x)` blocks, so a
/// mismatched call is memory-safe but truncated.
type RawDot = fn(&[u8], &[f32]) -> f32;

/// A dot-product kernel resolved once for a type and an ISA path; [`DotKernel::dot`] is the
/// unchecked fast variant for loops.
#[derive(Clone, Copy)]
pub struct DotKernel {
    ty: GgmlType,
    isa: Isa,
    f: RawDot,
    /// The same kernel without prefetching: for a row already in cache (the second and later
    /// inputs of [`DotKernel::matmul_unchecked`]); same bits.
    f_cached: RawDot,
    /// Four tokens a pass over the row (prompt batches), each token `f`'s bits; with and
    /// without prefetching. None where this path has no such kernel for the type.
    f4: Option<(RawDot4, RawDot4)>,
}

/// Four tokens' dot products with one row at once (see [`DotKernel::matmul_unchecked`]).
pub(crate) type RawDot4 = fn(&[u8], [&[f32]; 4]) -> [f32; 4];

impl fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DotKernel({}, {})", self.ty, self.isa)
    }
}

impl DotKernel {
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// `Σ dequant(row)·x` without validation: the caller guarantees
    /// `row.len() == row_bytes(ty, x.len())`. Otherwise the result covers only the blocks
    /// present in both (never out of bounds, never a panic), which is garbage for the caller.
    #[inline]
    pub fn dot(&self, row: &[u8], x: &[f32]) -> f32 {
        (self.f)(row, x)
    }

    /// `y[r] = dot(weight row r, x)` for `y.len()` rows, without validation (see [`matvec`]).
    pub fn matvec_unchecked(&self, weight: &[u8], x: &[f32], y: &mut [f32]) {
        let rb = match row_bytes(self.ty, x.len()) {
            Ok(rb) if rb > 0 => rb,
            _ => {
                y.fill(0.0);
                return;
            }
        };
        let rows = y.len().min(weight.len() / rb);
        let (y, rest) = y.split_at_mut(rows);
        rest.fill(0.0);
        let total = rows * rb;
        if total < PAR_MIN_BYTES || rows < 2 {
            for (r, o) in y.iter_mut().enumerate() {
                *o = self.dot(&weight[r * rb..(r + 1) * rb], x);
            }
        } else {
            let min_len = (PAR_TASK_BYTES / rb).max(1);
            y.par_iter_mut()
                .enumerate()
                .with_min_len(min_len)
                .for_each(|(r, o)| *o = self.dot(&weight[r * rb..(r + 1) * rb], x));
        }
    }

    /// Several inputs at once (prefill): `xs` holds `n_tok` vectors of `cols` elements and `ys`
    /// receives `n_tok` vectors of `ys.len() / n_tok` outputs (token-major, like `xs`). Every
    /// output is bit-identical to [`DotKernel::matvec_unchecked`] of the same token — each row
    /// is read once per token block while it is still in cache, not re-summed differently.
    /// No validation beyond memory safety (mismatched sizes give zeros/truncation, see
    /// [`matmul`] for the checked form).
    pub fn matmul_unchecked(&self, weight: &[u8], xs: &[f32], cols: usize, ys: &mut [f32]) {
        let rb = match row_bytes(self.ty, cols) {
            Ok(rb) if rb > 0 => rb,
            _ => {
                ys.fill(0.0);
                return;
            }
        };
        let n_tok = xs.len() / cols;
        if n_tok == 0 {
            ys.fill(0.0);
            return;
        }
        let out_rows = ys.len() / n_tok;
        let rows = out_rows.min(weight.len() / rb);
        ys.fill(0.0);
        // Rows in tasks of ≥ PAR_TASK_BYTES; each task fills a rows×tokens tile, scattered after.
        let per_task = (PAR_TASK_BYTES / rb).clamp(1, rows.max(1));
        let tile = |r0: usize, r1: usize| -> Vec<f32> {
            let mut t = vec![0f32; (r1 - r0) * n_tok];
            for r in r0..r1 {
                let row = &weight[r * rb..(r + 1) * rb];
                let out = &mut t[(r - r0) * n_tok..(r - r0 + 1) * n_tok];
                // Four tokens a pass where the path has the kernel (the row's codes unpacked
                // once for four: same bits per token), the rest one by one.
                let mut k = 0;
                if let Some((f4, f4_cached)) = self.f4 {
                    while k + 4 <= n_tok {
                        let x = |i: usize| &xs[(k + i) * cols..(k + i + 1) * cols];
                        let f = if k == 0 { f4 } else { f4_cached };
                        out[k..k + 4].copy_from_slice(&f(row, [x(0), x(1), x(2), x(3)]));
                        k += 4;
                    }
                }
                while k < n_tok {
                    let f = if k == 0 { self.f } else { self.f_cached };
                    out[k] = f(row, &xs[k * cols..(k + 1) * cols]);
                    k += 1;
                }
            }
            t
        };
        let starts: Vec<usize> = (0..rows).step_by(per_task).collect();
        let tiles: Vec<Vec<f32>> = if rows * rb * n_tok < PAR_MIN_BYTES || starts.len() < 2 {
            starts
                .iter()
                .map(|&r0| tile(r0, (r0 + per_task).min(rows)))
                .collect()
        } else {
            starts
                .par_iter()
                .map(|&r0| tile(r0, (r0 + per_task).min(rows)))
                .collect()
        };
        for (&r0, t) in starts.iter().zip(&tiles) {
            for (i, vals) in t.chunks_exact(n_tok).enumerate() {
                for (k, &v) in vals.iter().enumerate() {
                    ys[k * out_rows + r0 + i] = v;
                }
            }
        }
    }
}

/// `Y = X·Wᵀ` for `n_tok` inputs: `xs` is `n_tok × cols` (token-major), `weight` is `rows` rows
/// of `cols` elements of `ty`, `ys` is `n_tok × rows`. Each output equals [`matvec`] of its
/// token bit for bit.
pub fn matmul(
    ty: GgmlType,
    weight: &[u8],
    rows: usize,
    xs: &[f32],
    cols: usize,
    ys: &mut [f32],
) -> Result<(), QuantError> {
    require_supported(ty, "matmul")?;
    let rb = row_bytes(ty, cols)?;
    if cols == 0 || !xs.len().is_multiple_of(cols) {
        return Err(QuantError::Length {
            ty,
            what: "input matrix xs (not a whole number of rows of `cols`)",
            expected: cols * (xs.len() / cols.max(1)),
            got: xs.len(),
        });
    }
    let n_tok = xs.len() / cols;
    if ys.len() != n_tok * rows {
        return Err(QuantError::Length {
            ty,
            what: "output matrix ys",
            expected: n_tok * rows,
            got: ys.len(),
        });
    }
    if Some(weight.len()) != rb.checked_mul(rows) {
        return Err(QuantError::Length {
            ty,
            what: "weight matrix",
            expected: rb.saturating_mul(rows),
            got: weight.len(),
        });
    }
    dot_kernel(ty)?.matmul_unchecked(weight, xs, cols, ys);
    Ok(())
}

/// Matrices with fewer weight bytes than this run on the calling thread.
const PAR_MIN_BYTES: usize = 1 << 20;
/// How far ahead of the bytes being read the SIMD kernels ask for weight bytes
/// ([`prefetch_block`]). Streaming rows from DRAM (experts, a CPU decode step), the hardware
/// prefetcher alone left the kernels at about half their in-cache rate on this project's 2-core
/// Xeon VM: IQ2_XXS × Q8_K 1.65 -> 2.9 GB/s a core with it, exact Q4_K 2.05 -> 5.4
/// (`examples/dot_bench.rs`, `bench/results/quant-dot-cpu.txt`). 1-4 KiB ahead measured
/// alike, 512 bytes ~5% less.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const PREFETCH_BYTES: usize = 1024;

/// Asks for the cache lines of the `bytes` bytes at `p + PREFETCH_BYTES`. A prefetch never
/// faults, so reading past the row's end (into the next row, or nothing) is harmless.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_block(p: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut o = 0;
    while o < bytes {
        // SAFETY: prefetch is a hint; any address is allowed (wrapping_add: no provenance use).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES + o) as *const i8) };
        o += 64;
    }
}

/// [`prefetch_block`] for AArch64 (`prfm pldl1keep`; 64-byte steps, as most AArch64 cores'
/// lines; Apple's 128-byte lines are then asked for twice, which costs nothing).
#[cfg(target_arch = "aarch64")]
#[inline(always)]
pub(crate) fn prefetch_block(p: *const u8, bytes: usize) {
    let mut o = 0;
    while o < bytes {
        let a = p.wrapping_add(PREFETCH_BYTES + o);
        // SAFETY: a prefetch is a hint that never faults; it reads no memory and writes none.
        unsafe {
            std::arch::asm!("prfm pldl1keep, [{a}]", a = in(reg) a,
                options(nostack, readonly, preserves_flags));
        }
        o += 64;
    }
}

/// Weight bytes per rayon task at least.
const PAR_TASK_BYTES: usize = 128 << 10;

/// The kernel for `ty` on the [`active_isa`].
pub fn dot_kernel(ty: GgmlType) -> Result<DotKernel, QuantError> {
    dot_kernel_for(ty, active_isa())
}

/// The kernel for `ty` on a given path (for tests and benchmarks).
pub fn dot_kernel_for(ty: GgmlType, isa: Isa) -> Result<DotKernel, QuantError> {
    require_supported(ty, "dot product")?;
    if !isa.is_available() {
        return Err(QuantError::IsaUnavailable(isa));
    }
    let f4 = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::avx512_dot4_fn::<true>(ty).zip(x86::avx512_dot4_fn::<false>(ty)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::avx2_dot4_fn::<true>(ty).zip(x86::avx2_dot4_fn::<false>(ty)),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dot4_fn::<true>(ty).zip(neon::dot4_fn::<false>(ty)),
        _ => None,
    };
    let (f, f_cached): (RawDot, RawDot) = match isa {
        Isa::Portable => (portable::dot_fn(ty), portable::dot_fn(ty)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::avx2_dot_fn::<true>(ty), x86::avx2_dot_fn::<false>(ty)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (
            x86::avx512_dot_fn::<true>(ty),
            x86::avx512_dot_fn::<false>(ty),
        ),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => (neon::dot_fn::<true>(ty), neon::dot_fn::<false>(ty)),
        #[allow(unreachable_patterns)] // every path of this target is matched above
        _ => return Err(QuantError::IsaUnavailable(isa)),
    };
    Ok(DotKernel {
        ty,
        isa,
        f,
        f_cached,
        f4,
    })
}

/// `Σ_k dequant(row)[k]·x[k]` in f32 (exact mode), on the active path.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    require_supported(ty, "dot product")?;
    check_row(ty, "weight row", row.len(), x.len())?;
    Ok(dot_kernel(ty)?.dot(row, x))
}

/// `y = W·x` for a `rows × x.len()` weight matrix of type `ty` (`rows` rows of `x.len()`
/// elements, model.md §0). Rows run in parallel with rayon when the matrix is large.
pub fn matvec(
    ty: GgmlType,
    weight: &[u8],
    rows: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), QuantError> {
    require_supported(ty, "matvec")?;
    let rb = row_bytes(ty, x.len())?;
    if y.len() != rows {
        return Err(QuantError::Length {
            ty,
            what: "output vector y",
            expected: rows,
            got: y.len(),
        });
    }
    let expected = rb.checked_mul(rows).ok_or(QuantError::Length {
        ty,
        what: "weight matrix (size overflows)",
        expected: usize::MAX,
        got: weight.len(),
    })?;
    if weight.len() != expected {
        return Err(QuantError::Length {
            ty,
            what: "weight matrix",
            expected,
            got: weight.len(),
        });
    }
    dot_kernel(ty)?.matvec_unchecked(weight, x, y);
    Ok(())
}

// Little-endian field readers shared by the implementations.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// IEEE binary16 → binary32, exact; NaN payloads are kept as they are (signalling NaNs stay
/// signalling, as numpy/gguf-py does; F16C hardware would quiet them).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let me = (h & 0x7fff) as u32;
    // Exponent and mantissa moved into f32 position, then rescaled by 2^112 (= 2^(127−15)):
    // exact for normals and for subnormals (an f32 subnormal times 2^112 is an exact normal);
    // the scaling keeps the mantissa bits, so Inf/NaN only need the exponent forced to 255
    // (mask computed without branches so loops over this vectorise).
    let scaled = (f32::from_bits(me << 13) * f32::from_bits((127 + 112) << 23)).to_bits();
    let inf_nan = (((0x7bff - me as i32) >> 31) as u32) & 0x7f80_0000;
    let bits = scaled | inf_nan;
    f32::from_bits(sign | bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_problem() {
        let mut out = [0f32; 32];
        let e = dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
        assert_eq!(
            e,
            QuantError::Length {
                ty: GgmlType::Q8_0,
                what: "source row",
                expected: 34,
                got: 33
            }
        );
        assert!(e.to_string().contains("Q8_0"));
        let e = dequantize_row(GgmlType::Q4_K, &[0u8; 144], &mut out).unwrap_err();
        assert!(matches!(
            e,
            QuantError::PartialBlock {
                n: 32,
                block: 256,
                ..
            }
        ));
        let e = dequantize_row(GgmlType::Q6_K, &[0u8; 210], &mut [0f32; 256]).unwrap_err();
        assert!(e.to_string().contains("Q6_K"), "{e}");
        let e = dot_row(GgmlType::IQ2_XS, &[0u8; 74], &[0f32; 256]).unwrap_err();
        assert!(matches!(
            e,
            QuantError::Unsupported {
                ty: GgmlType::IQ2_XS,
                ..
            }
        ));
        let e = matvec(GgmlType::F32, &[0u8; 16], 2, &[0f32; 2], &mut [0f32; 3]).unwrap_err();
        assert!(matches!(
            e,
            QuantError::Length {
                what: "output vector y",
                ..
            }
        ));
        let e = matvec(GgmlType::F32, &[0u8; 15], 2, &[0f32; 2], &mut [0f32; 2]).unwrap_err();
        assert!(matches!(
            e,
            QuantError::Length {
                what: "weight matrix",
                expected: 16,
                ..
            }
        ));
    }

    #[test]
    fn f16_conversion_is_exact_for_all_65536_patterns() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let reference = half::f16::from_bits(h).to_f32();
            if reference.is_nan() {
                // Payload kept verbatim (half quiets it; numpy does not).
                let want =
                    (((h & 0x8000) as u32) << 16) | 0x7f80_0000 | (((h & 0x3ff) as u32) << 13);
                assert_eq!(ours.to_bits(), want, "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), reference.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn i32_tables() {
        let vals = [0i32, -1, 255, 1 << 24, -(1 << 24)];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = [0i32; 5];
        read_i32_row(&bytes, &mut out).unwrap();
        assert_eq!(out, vals);
        let mut f = [0f32; 5];
        dequantize_row(GgmlType::I32, &bytes, &mut f).unwrap();
        assert_eq!(f, [0.0, -1.0, 255.0, 16777216.0, -16777216.0]);
        let bad = ((1 << 24) + 1i32).to_le_bytes();
        let e = dequantize_row(GgmlType::I32, &bad, &mut [0f32; 1]).unwrap_err();
        assert_eq!(
            e,
            QuantError::InexactI32 {
                index: 0,
                value: (1 << 24) + 1
            }
        );
        assert!(read_i32_row(&bytes[..19], &mut out).is_err());
    }

    #[test]
    fn unchecked_kernel_is_memory_safe_on_mismatch() {
        for ty in SUPPORTED {
            for isa in Isa::available() {
                let k = dot_kernel_for(ty, isa).unwrap();
                // Short row, long x and the reverse: truncated, no panic.
                let _ = k.dot(&[1u8; 100], &[1.0; 512]);
                let _ = k.dot(&[1u8; 1000], &[1.0; 3]);
                assert_eq!(k.dot(&[], &[1.0; 512]), 0.0);
            }
        }
    }

    #[test]
    fn force_portable_switch() {
        set_force_portable(true);
        assert_eq!(active_isa(), Isa::Portable);
        assert_eq!(dot_kernel(GgmlType::F32).unwrap().isa(), Isa::Portable);
        set_force_portable(false);
        if std::env::var("DS4_QUANT_PORTABLE").map_or(true, |v| v.is_empty() || v == "0") {
            assert_eq!(active_isa(), Isa::best());
        }
    }
}
