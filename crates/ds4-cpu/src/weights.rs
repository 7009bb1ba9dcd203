//! Weight access for the CPU reference: matrices are read straight from the mmap through the
//! `ds4-quant` exact dot products; small F32 vectors (norms, scales, biases) are copied once.

use ds4_gguf::{GgmlType, GgufFile};
use ds4_model::{WeightDir, WeightRef};
use std::sync::Arc;

/// A bound matrix: `rows` rows of `cols` elements (GGUF `[cols, rows, experts]`).
#[derive(Clone, Debug)]
pub struct Mat {
    /// Index of the file holding it (main model 0, MTP 1).
    pub file: usize,
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    pub offset: usize,
    pub n_bytes: usize,
    kernel: ds4_quant::DotKernel,
}

impl Mat {
    fn new(file: usize, w: &WeightRef) -> Mat {
        let cols = w.dims[0] as usize;
        let rows = w.dims.get(1).copied().unwrap_or(1) as usize;
        Mat {
            file,
            ty: w.ty,
            cols,
            rows,
            offset: w.offset as usize,
            n_bytes: w.n_bytes as usize,
            // Binding only admits types ds4-quant supports.
            kernel: ds4_quant::dot_kernel(w.ty).expect("bound weight types are supported"),
        }
    }

    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }
}

/// The bound weight files of a model: the main GGUF and optionally the MTP GGUF.
pub struct Weights {
    files: Vec<(Arc<GgufFile>, WeightDir)>,
    accel: Option<Arc<dyn MatAccel>>,
}

/// Runs the weight products somewhere else (the engine plugs a GPU in here); everything else
/// stays on the CPU. `w` is a contiguous block of whole rows of type `ty` (`cols` elements
/// each) that always has the same bytes for the same `key` (file index, absolute byte offset),
/// so an implementation may upload it once and reuse it. `xs` is `n × cols`, `ys` `n × rows`.
pub trait MatAccel: Send + Sync {
    fn matmul(
        &self,
        key: (usize, usize),
        ty: GgmlType,
        w: &[u8],
        cols: usize,
        xs: &[f32],
        ys: &mut [f32],
    );
}

impl Weights {
    pub fn new(file: Arc<GgufFile>, dir: WeightDir) -> Weights {
        Weights {
            files: vec![(file, dir)],
            accel: None,
        }
    }

    /// Add a second bound file (the MTP GGUF); its names must not clash with the main file's.
    pub fn add_file(&mut self, file: Arc<GgufFile>, dir: WeightDir) {
        self.files.push((file, dir));
    }

    fn get(&self, name: &str) -> (usize, &WeightRef) {
        self.files
            .iter()
            .enumerate()
            .find_map(|(i, (_, d))| d.get(name).map(|w| (i, w)))
            .unwrap_or_else(|| panic!("weight {name} was not bound"))
    }

    pub fn has(&self, name: &str) -> bool {
        self.files.iter().any(|(_, d)| d.get(name).is_some())
    }

    pub fn mat(&self, name: &str) -> Mat {
        let (i, w) = self.get(name);
        Mat::new(i, w)
    }

    fn bytes(&self, m: &Mat) -> &[u8] {
        &self.files[m.file].0.bytes()[m.offset..m.offset + m.n_bytes]
    }

    fn raw(&self, name: &str) -> (&WeightRef, &[u8]) {
        let (i, w) = self.get(name);
        (
            w,
            &self.files[i].0.bytes()[w.offset as usize..(w.offset + w.n_bytes) as usize],
        )
    }

    /// `y = M·x` (or of expert `e`'s slab for a 3-D stack).
    pub fn matvec(&self, m: &Mat, expert: Option<usize>, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), m.cols);
        debug_assert_eq!(y.len(), m.rows);
        self.matmul(m, expert, x, y);
    }

    /// Several tokens at once: `xs` is `n × cols`, `ys` is `n × rows` (token-major). On the CPU
    /// each output row is bit-identical to the one-token product.
    pub fn matmul(&self, m: &Mat, expert: Option<usize>, xs: &[f32], ys: &mut [f32]) {
        let slab = m.rows * m.row_bytes();
        let (w, start) = match expert {
            Some(e) => (
                &self.bytes(m)[e * slab..(e + 1) * slab],
                m.offset + e * slab,
            ),
            None => (&self.bytes(m)[..slab], m.offset),
        };
        self.product(m, (m.file, start), w, xs, ys);
    }

    /// `matmul` restricted to rows `r0 .. r0 + ys.len()/n` (one output group).
    pub fn matmul_rows(&self, m: &Mat, r0: usize, xs: &[f32], ys: &mut [f32]) {
        let n = xs.len() / m.cols;
        let rb = m.row_bytes();
        let rows = ys.len() / n.max(1);
        let w = &self.bytes(m)[r0 * rb..(r0 + rows) * rb];
        self.product(m, (m.file, m.offset + r0 * rb), w, xs, ys);
    }

    /// Run a weight product on the accelerator when one is attached, else on the CPU.
    fn product(&self, m: &Mat, key: (usize, usize), w: &[u8], xs: &[f32], ys: &mut [f32]) {
        match &self.accel {
            Some(a) => a.matmul(key, m.ty, w, m.cols, xs, ys),
            None => m.kernel.matmul_unchecked(w, xs, m.cols, ys),
        }
    }

    /// Attach an accelerator for the weight products (see [`MatAccel`]).
    pub fn set_accel(&mut self, accel: Arc<dyn MatAccel>) {
        self.accel = Some(accel);
    }

    /// One row of a matrix, dequantised (embedding lookup, `ape` rows).
    pub fn row(&self, m: &Mat, r: usize, out: &mut [f32]) {
        let rb = m.row_bytes();
        let b = &self.bytes(m)[r * rb..(r + 1) * rb];
        ds4_quant::dequantize_row(m.ty, b, out).expect("bound rows dequantise");
    }

    /// A whole F32 tensor as a vector.
    pub fn vec(&self, name: &str) -> Vec<f32> {
        let (w, b) = self.raw(name);
        let mut out = vec![0f32; w.dims.iter().product::<u64>() as usize];
        ds4_quant::dequantize_row(w.ty, b, &mut out).expect("bound vectors dequantise");
        out
    }

    /// An I32 table (`ffn_gate_tid2eid`).
    pub fn i32s(&self, name: &str) -> Vec<i32> {
        let (_, b) = self.raw(name);
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}
