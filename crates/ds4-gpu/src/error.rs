use std::path::PathBuf;

/// Errors of the GPU layer. Each names the library, symbol, API call, kernel or size at fault.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No candidate of a library could be opened; `searched` lists every path tried, with the
    /// loader's message for those that exist but failed.
    #[error("{what}: could not load any of {names:?}; searched:\n  {}", searched.join("\n  "))]
    LibraryNotFound {
        what: &'static str,
        names: Vec<String>,
        searched: Vec<String>,
    },
    #[error("{library} ({path}): missing symbol {symbol}")]
    MissingSymbol {
        library: &'static str,
        path: PathBuf,
        symbol: String,
    },
    /// A driver/runtime call failed: `call` is the API function, `code` its status.
    #[error("{api} {call} failed: {code} ({name}: {message})")]
    Api {
        api: &'static str,
        call: &'static str,
        code: i64,
        name: String,
        message: String,
    },
    /// The kernel compiler rejected a module; `log` is its full output.
    #[error("{compiler} failed to compile module {module} for {arch}: {status}\n{log}")]
    Compile {
        compiler: String,
        module: String,
        arch: String,
        status: String,
        log: String,
    },
    #[error("no {backend} device {index}: {count} visible")]
    NoDevice {
        backend: &'static str,
        index: usize,
        count: usize,
    },
    #[error("kernel {kernel} not found in module {module}")]
    NoKernel { module: String, kernel: String },
    /// `Backend::Auto` found neither vendor; both reasons.
    #[error("no GPU backend could be opened.\nCUDA: {cuda}\nROCm: {rocm}")]
    NoBackend {
        cuda: Box<GpuError>,
        rocm: Box<GpuError>,
    },
    /// A device allocation failed (`source`: the driver's status), with the device's free and
    /// total memory at that moment when it could tell.
    #[error(
        "device memory: could not allocate {} ({}): {source}. Session state grows with the \
         context (~12 GiB at 1M tokens of the full model on a GPU) and each live session holds \
         its own: a smaller --ctx, fewer live sessions (--kv-mem-mb) or DS4_GPU_BF16_CACHE=0 (no \
         bf16 copies of the dense weights) leave more room",
        mib(*bytes),
        match (free, total) {
            (Some(f), Some(t)) => format!("{} of {} free", mib(*f), mib(*t)),
            _ => "free memory unknown".to_string(),
        }
    )]
    OutOfMemory {
        bytes: u64,
        free: Option<u64>,
        total: Option<u64>,
        source: Box<GpuError>,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Quant(#[from] ds4_quant::QuantError),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// Bytes as MiB (or GiB from 10 GiB) for messages.
fn mib(b: u64) -> String {
    if b >= 10 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocation failure names the size, the free memory and what leaves more room.
    #[test]
    fn out_of_memory_names_sizes_and_remedies() {
        let src = || {
            Box::new(GpuError::Api {
                api: "CUDA",
                call: "cuMemAlloc",
                code: 2,
                name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
                message: "out of memory".into(),
            })
        };
        let e = GpuError::OutOfMemory {
            bytes: 512 << 20,
            free: Some(300 << 20),
            total: Some(140 << 30),
            source: src(),
        }
        .to_string();
        for want in [
            "could not allocate 512.0 MiB (300.0 MiB of 140.0 GiB free)",
            "CUDA_ERROR_OUT_OF_MEMORY",
            "--ctx",
            "--kv-mem-mb",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        let e = GpuError::OutOfMemory {
            bytes: 12 << 30,
            free: None,
            total: None,
            source: src(),
        }
        .to_string();
        assert!(e.contains("12.0 GiB (free memory unknown)"), "{e}");
    }
}
