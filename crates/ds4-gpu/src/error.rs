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
