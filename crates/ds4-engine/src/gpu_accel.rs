//! The hybrid GPU path, only with `DS4_GPU_HYBRID=1` (the default is the resident
//! `ds4_gpu::GpuBackend`): the weight products (≈ all of the bytes and FLOPs of a token) run
//! on a CUDA or ROCm device through `ds4-gpu`'s matvec kernels; everything else stays on the CPU
//! reference. Each weight block is uploaded on first use and kept. Activations cross the bus
//! per product, so this is a correctness bridge, not the fast path (that keeps everything
//! resident and replays a captured graph).

use ds4_cpu::MatAccel;
use ds4_gguf::GgmlType;
use ds4_gpu::{DeviceBuffer, Gpu, Stream};
use std::collections::HashMap;
use std::sync::Mutex;

pub struct GpuAccel {
    gpu: Gpu,
    /// Uploaded weight blocks by (file, byte offset).
    weights: Mutex<HashMap<(usize, usize), DeviceBuffer>>,
}

impl GpuAccel {
    pub fn new(gpu: Gpu) -> GpuAccel {
        GpuAccel {
            gpu,
            weights: Mutex::new(HashMap::new()),
        }
    }
}

impl MatAccel for GpuAccel {
    fn matmul(
        &self,
        key: (usize, usize),
        ty: GgmlType,
        w: &[u8],
        cols: usize,
        xs: &[f32],
        ys: &mut [f32],
    ) {
        let n = xs.len() / cols;
        let rows = ys.len() / n.max(1);
        let mut run = || -> ds4_gpu::Result<()> {
            let wp = {
                let mut map = self.weights.lock().expect("weight map lock");
                match map.entry(key) {
                    std::collections::hash_map::Entry::Occupied(e) => e.get().ptr(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(self.gpu.alloc_from(w)?).ptr()
                    }
                }
            };
            let x = self.gpu.alloc_f32(xs)?;
            let y = self.gpu.alloc(ys.len() * 4)?;
            for t in 0..n {
                self.gpu.matvec(
                    ty,
                    wp,
                    x.ptr().offset((t * cols * 4) as u64),
                    y.ptr().offset((t * rows * 4) as u64),
                    rows,
                    cols,
                    None,
                    Stream::DEFAULT,
                )?;
            }
            self.gpu.synchronize()?;
            ys.copy_from_slice(&self.gpu.download_f32(y.ptr(), ys.len())?);
            Ok(())
        };
        // The trait has no error channel: a device failure mid-run is fatal, with its reason.
        if let Err(e) = run() {
            panic!("GPU weight product failed ({ty}, {rows}×{cols}): {e}");
        }
    }
}
