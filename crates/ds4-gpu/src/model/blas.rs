//! Dense prefill products (n > 4 token rows) through the vendor's BLAS-Lt (cuBLASLt on CUDA,
//! hipBLASLt on ROCm; library table in `crate::blas`), tried before the built-in GEMM (gemm.rs)
//! by the hooks in matmul.rs. Covered: F32, F16, BF16 and Q8_0 weights (the attention
//! projections, shared expert, compressor/indexer/HC projections), Part::All and
//! Part::Expert(e), and the grouped output product (strided batch, one batch per group).
//! Anything else declines (false) and the GEMM runs; so does everything when the library is
//! missing (one line says what was searched).
//!
//! Precision: the same three terms as the GEMM's default bf16 hi/lo form (gemm.cu), in ONE
//! product: `blas_prep.cu` writes W' = [W_hi | W_hi | W_lo] (rows × 3K bf16, dequantised from
//! the GGUF blocks each call into pooled scratch) and X' = [X_hi | X_lo | X_hi] (n × 3K), and
//! the library sums along 3K with f32 compute and accumulation into y (f32, y's strides).
//! BF16 weights (lo = 0) take 2K. `DS4_GPU_BLAS=fast` takes a single bf16 product over K
//! (X_hi · W_hi: ~2^-9 per term; error measured in tests/ops_blas.rs): the engine's default
//! through `--precision fast` (precision.rs), which leaves this variable to win when set.
//!
//! `DS4_GPU_BLAS=f16` (opt-in): ONE product of f16 operands with f32 compute and accumulation
//! for Q8_0 and F16 weights (F32 and BF16 weights keep the three-term form): W' = f16(W·2^-u),
//! X' = f16(X·2^s), and the library multiplies by alpha = 2^(u-s), read from device memory
//! (pointer mode DEVICE), so y = W·X with one f16 rounding per operand (~2^-11 relative each;
//! 8x finer than bf16). s is one power of two per product from a device-side max|X|
//! (`blas_amax`: partial maxima, reduced again by each consumer block), so max|X|·2^s < 2^15:
//! no overflow whatever the activations; values below max|X|·2^-29 of the same product become
//! f16 subnormals (absolute error ≤ max|X|·2^-40 per element; tests/ops_blas.rs holds the
//! bound). u is 0 unless a Q8_0 block has d ≥ 256 (|q·d| could pass f16's 65504; real weights
//! have d < 1): then the whole weight is scaled down by 2^-u (u ≤ 9) rather than produce Inf
//! or fall back (that decision would need the host to read the weight: a sync). F16 weights
//! are read in place when aligned (256-byte base and batch stride), else copied. H200
//! (bench/results/gpu-blas-p17-h200.txt): worst error 1.6e-4 of Σ|w·x| per output (f64
//! reference), tiny-model logits within 0.16 of the CPU (three-term: 1.5e-4); prefill +12.4% /
//! +13.3% at 2k / 8k over `on` (`fast`: +17.6% / +18.6%).
//!
//! Switch: `DS4_GPU_BLAS=off|on|fast|f16` (unset: `on` where the library loads, unless the
//! engine's `--precision` set a form: `on` for exact, `fast` for fast) or
//! [`GpuBackend::set_blas`] / [`GpuBackend::set_blas_f16`]. H200, full-size q2, 2048-token
//! prompt: prefill 1,473 -> 1,901 tok/s (fast: 2,124); per product 3-5.5x the GEMM
//! (bench/results/gpu-blas-b-h200.txt). The library
//! is opened when the backend is made and gets a 32 MiB workspace allocated once, and one small
//! product runs then (the library's one-time set-up: 165 ms of host time in the first prompt
//! otherwise, see `blas_warm`), so the call neither allocates nor synchronises; it runs on the
//! backend's stream (the legacy default stream of the primary context, which the library's
//! runtime shares). `DS4_GPU_BLAS_TRACE=1` prints the host time of each new plan's heuristic
//! query and first product (the library loads each kernel on first use: 3-22 ms per new shape
//! in the first prompt on the H200). Never recorded in a
//! decode graph (n ≤ 4 goes to matvec.rs; a recording backend declines anyway).
//! ROCm: the same path with hipBLASLt's enum values; not run here (no AMD GPU was available).
//!
//! Operands made once (the bf16 forms above; the f16 form is unchanged):
//! - W' cache, `DS4_GPU_BF16_CACHE=0|1|auto` (unset: auto): W' is a function of the weight
//!   and the number of K-parts only, so the first product of a weight writes it into a buffer
//!   the weight keeps (`GpuWeight::Mat::bf`, dropped with it) and later products read it
//!   instead of dequantising again (~190 us a layer of `blas_w_*` at 2k on the H200, every
//!   chunk). `auto` makes a copy only while the device's free memory after it stays above
//!   [`CACHE_MARGIN`] (`DS4_GPU_BF16_CACHE_MARGIN` GiB overrides), else that weight keeps the
//!   per-call conversion (decided once per weight); `1` whenever the allocation succeeds; `0`
//!   never. Full-size q2 under `--precision fast` (one part): ~11 GiB of copies;
//!   [`GpuBackend::bf16_cache_bytes`] reports them (`ds4 bench` prints the line).
//! - X' sharing, `DS4_GPU_BLAS_XSHARE=0|1` (unset: 1): inside `matmul_multi` /
//!   `matmul_gateup` (products of ONE input, written to outputs that cannot alias it) X' is
//!   converted for the first product and reused by the next ones of the same shape (the
//!   attention's q_a + kv, the compressors' and indexer's five projections of z, the shared
//!   expert's gate + up). Same bits either way.
//! - X' made by the producer: `blas_grouped_pre` takes a one-term bf16 X' the caller wrote
//!   (`Backend::attend_project`: the prompt attention stores its output in that form, mod.rs),
//!   so the f32 X is neither written nor converted; `blas_fast_x_ok` says beforehand whether
//!   the product would take that form. Same bits as `blas_x_f32` of the f32 values.
//! - Plans by token-count bucket, `DS4_GPU_BLAS_NBUCKET=0|1|N` (unset or `1` or any
//!   value that is not a number: on with the limit 2048; N: the limit N; `0`: off): a plan's heuristic query and
//!   the first call of each new algorithm (the library loads its kernel then, 3-22 ms of host
//!   time each on the H200, bench/results/gpu-prefill-p8-h200.txt) come with every new number
//!   of token rows: every prompt length, and the 6144- and 8192-row steps of the bench's 8k and
//!   32k rows after its 2048-token warm-up. With the switch a product of n rows takes the
//!   algorithm of the plan for min(next power of two of n, limit) rows (made first, with the
//!   heuristic) once cuBLASLt's cublasLtMatmulAlgoCheck accepts it for n within the workspace,
//!   else its own heuristic (also on ROCm, which has no check here). Same arithmetic (f32
//!   accumulation along K in the algorithm's order; a different algorithm may order K
//!   differently, as the heuristic's own choice for n could). H200 (bench/results/
//!   gpu-pg20-h200.txt): the bench's 8k row (a 6144-row step after the 2048-token warm-up)
//!   +1.2% / +0.9% prefill; steady 8192-row steps on the 2048-row algorithms: 32k -0.15%
//!   (noise), 8k +0.4%.

use super::switch::{code, env_code, on_unless_off, UNSET};
use super::{type_suffix as suffix, GpuBackend, GpuBuf, GpuWeight};
use crate::blas::{BlasLt, Handle, Plan, Shape};
use crate::gpu::DeviceBuffer;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{GgmlType, Part};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

/// Workspace given to the library (and the most an algorithm may ask for).
const WORKSPACE: usize = 32 << 20;
/// Fewest token rows taken (fewer: matvec.rs).
const MIN_N: usize = 5;
/// Plans kept per backend before the cache is cleared (prefill sees a handful of shapes).
const MAX_PLANS: usize = 256;

/// 0 off, 1 on (three-term hi/lo), 2 fast (one bf16 term), 3 f16 (one scaled f16 term);
/// UNSET: read `DS4_GPU_BLAS`.
static MODE: AtomicU8 = AtomicU8::new(UNSET);
const OFF: u8 = 0;
const ON: u8 = 1;
const FAST: u8 = 2;
const F16: u8 = 3;
/// blas_amax's blocks (blas_prep.cu BP_P): 2 words of partial maxima each.
const AMAX_BLOCKS: usize = 256;
/// Library products queued so far (process-wide), so tests can see the path took a product.
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Plans that took their bucket's algorithm (process-wide).
static LIKE: AtomicU64 = AtomicU64::new(0);

/// `DS4_GPU_BF16_CACHE`: 0 never, 1 always, 2 auto (free memory above the margin); UNSET: read it.
static CACHE: AtomicU8 = AtomicU8::new(UNSET);
const CACHE_AUTO: u8 = 2;
/// Free device memory `auto` leaves after a W' copy: 8 GiB spare plus 16 GiB for what grows
/// after the first prompt (a prompt step's scratch, ~6 GiB at 12288 tokens, gemm.rs; the session
/// state, 12.2 GiB at 1M tokens of context). The H200 with the q2 weights has ~57 GiB free.
const CACHE_MARGIN: u64 = 24 << 30;
/// `DS4_GPU_BLAS_XSHARE`: 0 off, 1 on; UNSET: read it.
static XSHARE: AtomicU8 = AtomicU8::new(UNSET);
/// `DS4_GPU_BLAS_NBUCKET`: the largest bucket of token rows (module doc; default 2048); 0 off;
/// UNSET_N: read.
static NBUCKET: AtomicU64 = AtomicU64::new(UNSET_N);
const UNSET_N: u64 = u64::MAX;
/// The default largest bucket: the bench's warm-up prompt and the 2k rows are one product of
/// 2048 token rows, so larger prompts (one step of up to the prefill chunk) reuse its kernels.
const NBUCKET_MAX: u64 = 2048;

/// The token count whose plan's algorithm a product of `n` rows takes: the next power of two,
/// at most the bucket limit; `n` itself when off.
fn n_bucket(n: u64) -> u64 {
    let mut m = NBUCKET.load(Ordering::Relaxed);
    if m == UNSET_N {
        m = match std::env::var("DS4_GPU_BLAS_NBUCKET").as_deref() {
            Ok("0") | Ok("off") => 0,
            Ok("1") | Ok("on") => NBUCKET_MAX,
            Ok(v) => v
                .parse::<u64>()
                .map_or(NBUCKET_MAX, |v| v.max(MIN_N as u64)),
            Err(_) => NBUCKET_MAX,
        };
        NBUCKET.store(m, Ordering::Relaxed);
    }
    if m == 0 {
        return n;
    }
    n.next_power_of_two().min(m)
}

fn cache_mode() -> u8 {
    code(&CACHE, "DS4_GPU_BF16_CACHE", |v| match v {
        Some("0") | Some("off") => 0,
        Some("1") | Some("on") => 1,
        _ => CACHE_AUTO,
    })
}

fn cache_margin() -> u64 {
    static M: OnceLock<u64> = OnceLock::new();
    *M.get_or_init(|| {
        std::env::var("DS4_GPU_BF16_CACHE_MARGIN")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(CACHE_MARGIN, |g| g << 30)
    })
}

fn xshare_on() -> bool {
    code(&XSHARE, "DS4_GPU_BLAS_XSHARE", |v| {
        (!matches!(v, Some("0") | Some("off"))) as u8
    }) == 1
}

/// A weight's W' (blas.rs module doc): (K-parts, the copy); copy None: `auto` declined it
/// (not enough free memory) or the allocation failed, not asked again for these parts.
#[derive(Default)]
pub struct BfSlot(Mutex<Option<(usize, Option<DeviceBuffer>)>>);

/// The X' of the current multi-product scope (`blas_x_scope`): the key says which X, in which
/// layout (x, x_tok, K, groups, n, parts), `buf` holds it until the scope ends.
#[derive(Default)]
struct XShare {
    depth: usize,
    key: Option<(u64, usize, usize, usize, usize, usize)>,
    buf: Option<GpuBuf>,
}

/// Ends a multi-product scope when dropped (see [`GpuBackend::blas_x_scope`]).
pub(crate) struct XScope<'a>(Option<&'a Mutex<XShare>>);

impl Drop for XScope<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.0 {
            let mut xs = m.lock().unwrap();
            xs.depth -= 1;
            if xs.depth == 0 {
                xs.key = None;
                xs.buf = None; // back to the pool (stream-ordered after the products)
            }
        }
    }
}

/// bf16 W' and X' conversions queued so far (process-wide): tests see the cache and the
/// sharing at work.
static W_CONV: AtomicU64 = AtomicU64::new(0);
static X_CONV: AtomicU64 = AtomicU64::new(0);

/// matmul_add in the library's epilogue: 0 not yet read from `DS4_GPU_BLAS_ACC`, 1 on (the
/// default), 2 off (product into scratch, then add_f32).
static ACC: AtomicU8 = AtomicU8::new(0);
/// blas_matmul_add products so far (process-wide), so tests can see the form ran.
static ACC_RUNS: AtomicU64 = AtomicU64::new(0);

fn acc_on() -> bool {
    env_code(&ACC, "DS4_GPU_BLAS_ACC", on_unless_off) == 1
}

/// The next product is the first of a new plan (trace only).
static FIRST: AtomicBool = AtomicBool::new(false);

/// `DS4_GPU_BLAS_TRACE=1`: host time of each new plan (heuristic) and of the first product of
/// each plan (the library loads that kernel then), and of any product call over 200 us.
fn trace() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DS4_GPU_BLAS_TRACE").is_ok_and(|v| v == "1"))
}

fn mode() -> u8 {
    code(&MODE, "DS4_GPU_BLAS", |v| match v {
        Some("off") | Some("0") => OFF,
        Some("fast") => FAST,
        Some("f16") => F16,
        _ => ON,
    })
}

/// Per-backend BLAS-Lt state (handle, workspace, plans), opened with the backend (or on first
/// use when the path was off then); None inside:
/// the library is missing or could not start (said once).
#[derive(Default)]
pub(crate) struct BlasSlot {
    st: OnceLock<Option<BlasState>>,
}

/// Field order is drop order: plans and handle before the workspace (and the runtime it holds).
struct BlasState {
    lt: &'static BlasLt,
    /// Descriptors and algorithm per shape; None: the library has no algorithm (declined).
    /// Key: the shape and the token count whose algorithm it takes (its own n, or its bucket's:
    /// `DS4_GPU_BLAS_NBUCKET`), so both forms stay apart when the switch changes.
    plans: Mutex<HashMap<(Shape, u64), Option<Plan>>>,
    handle: Handle,
    ws: DeviceBuffer,
    /// A call failed: decline from now on (said once).
    broken: AtomicBool,
    /// W' copies made (count, bytes) and weights `auto` declined.
    cached: AtomicU64,
    cached_bytes: AtomicU64,
    declined: AtomicU64,
    xshare: Mutex<XShare>,
    /// The warm product at open ran (blas_warm).
    warmed: AtomicBool,
}

/// One product: for batch (group) z < groups, token row t < n, row j < rows / groups:
/// `y[t*y_tok + z*y_z + j] = W[z*rows/groups + j] · x[t*x_tok + z*cols ..][..cols]`.
struct Job<'a> {
    w: DevPtr,
    /// The weight's W' slot (whole-matrix products only).
    bf: Option<&'a BfSlot>,
    ty: GgmlType,
    row_bytes: usize,
    rows: usize,
    cols: usize,
    groups: usize,
    x: DevPtr,
    x_tok: usize,
    n: usize,
    y: DevPtr,
    y_tok: usize,
    y_z: usize,
    /// y += the product (the library's beta 1) instead of y = it.
    acc: bool,
    /// A Q8_0 matrix's decode layout (matvec.rs `q8_decode_copy`: quants then scales) and
    /// whether it is interleaved: W' is converted from it (the same values as from the blocks,
    /// 16-byte aligned loads), and it is the only layout of a matrix held without its blocks.
    dec: Option<(DevPtr, bool)>,
    /// X' made by the caller (the one-term bf16 form's n × groups × K; `blas_grouped_pre`):
    /// x is not read.
    xpre: Option<DevPtr>,
}

impl Job<'_> {
    /// The library's view of this product with operands of `kk` elements along K per group
    /// (K-parts side by side; W' rows × kk, X' n × groups × kk), in f16 or bf16.
    fn shape(&self, kk: usize, f16: bool) -> Shape {
        let (g, r) = (self.groups, self.rows / self.groups);
        Shape {
            m: r as u64,
            n: self.n as u64,
            k: kk as u64,
            lda: kk as i64,
            ldb: (g * kk) as i64,
            ldd: self.y_tok as i64,
            batch: g as i32,
            a_stride: (r * kk) as i64,
            b_stride: kk as i64,
            d_stride: self.y_z as i64,
            f16,
        }
    }
}

impl GpuBackend {
    /// BLAS-Lt products: `on` false declines every product (the GEMM runs); `fast` takes one
    /// bf16 product instead of the three hi/lo terms. Default (true, false), or `DS4_GPU_BLAS`.
    /// Process-wide, for tests and benchmarks.
    pub fn set_blas(on: bool, fast: bool) {
        MODE.store(
            match (on, fast) {
                (false, _) => OFF,
                (true, false) => ON,
                (true, true) => FAST,
            },
            Ordering::Relaxed,
        );
    }

    /// BLAS-Lt products in the f16 form (`DS4_GPU_BLAS=f16`: one f16 product with a device-side
    /// power-of-two scale; module doc). Process-wide, for tests and benchmarks.
    pub fn set_blas_f16() {
        MODE.store(F16, Ordering::Relaxed);
    }

    /// The W' cache's policy (module doc): Some(true) always, Some(false) never, None `auto`.
    pub fn set_bf16_cache(on: Option<bool>) {
        CACHE.store(
            match on {
                Some(true) => 1,
                Some(false) => 0,
                None => CACHE_AUTO,
            },
            Ordering::Relaxed,
        );
    }

    /// X' sharing inside multi-products on or off (module doc).
    pub fn set_blas_xshare(on: bool) {
        XSHARE.store(on as u8, Ordering::Relaxed);
    }

    /// Plans by token-count bucket (module doc): Some(limit) on (products of more rows than the
    /// limit take the limit's algorithm), None off. Process-wide, for tests and benchmarks.
    pub fn set_blas_nbucket(limit: Option<usize>) {
        NBUCKET.store(limit.map_or(0, |l| l.max(MIN_N) as u64), Ordering::Relaxed);
    }

    /// Device bytes held by W' copies of this backend's weights (made so far), the number of
    /// copies and of weights `auto` declined for lack of free memory.
    pub fn bf16_cache_stats(&self) -> (u64, u64, u64) {
        self.blas
            .st
            .get()
            .and_then(|s| s.as_ref())
            .map_or((0, 0, 0), |s| {
                (
                    s.cached_bytes.load(Ordering::Relaxed),
                    s.cached.load(Ordering::Relaxed),
                    s.declined.load(Ordering::Relaxed),
                )
            })
    }

    /// Device bytes held by W' copies (see [`GpuBackend::bf16_cache_stats`]).
    pub fn bf16_cache_bytes(&self) -> u64 {
        self.bf16_cache_stats().0
    }

    /// A scope whose library products all read one X (Backend::matmul_multi, matmul_gateup):
    /// the first converts X', the next ones of the same layout reuse it; ends when dropped.
    /// Callers guarantee X is not written inside the scope (the outputs are other buffers).
    pub(crate) fn blas_x_scope(&self) -> XScope<'_> {
        let m = self
            .blas
            .st
            .get()
            .and_then(|s| s.as_ref())
            .map(|s| &s.xshare);
        if let Some(m) = m {
            m.lock().unwrap().depth += 1;
        }
        XScope(m)
    }

    /// bf16 W' and X' conversions queued so far in this process (blas_w_*, blas_x_f32).
    pub fn blas_conversions() -> (u64, u64) {
        (
            W_CONV.load(Ordering::Relaxed),
            X_CONV.load(Ordering::Relaxed),
        )
    }

    /// matmul_add products taken by the library form (beta 1) so far in this process.
    pub fn blas_acc_launches() -> u64 {
        ACC_RUNS.load(Ordering::Relaxed)
    }

    /// matmul_add's library form (beta 1) on or off (`DS4_GPU_BLAS_ACC`; default on).
    /// Process-wide, for tests and A/B benchmarks.
    pub fn set_blas_acc(on: bool) {
        ACC.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Library products queued so far in this process.
    pub fn blas_launches() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Plans made so far (process-wide) with their bucket's algorithm (`DS4_GPU_BLAS_NBUCKET`)
    /// instead of a heuristic query of their own.
    pub fn blas_plans_like() -> u64 {
        LIKE.load(Ordering::Relaxed)
    }

    /// Open the library when the backend is made (GpuBackend::new), unless the path is off: on
    /// the H200 a cold first open of libcublasLt (hundreds of MB) inside the first prompt cost
    /// ~0.2 s of a 2048-token prefill (bench/results/gpu-blas-b-h200.txt).
    pub(crate) fn blas_started(self) -> GpuBackend {
        if mode() != OFF {
            self.blas_state();
        }
        self
    }

    /// Whether this backend's BLAS-Lt library loaded and started (opens it on first call).
    pub fn blas_available(&self) -> bool {
        self.blas_state().is_some()
    }

    /// Whether prompt products go to the library: it loaded and `DS4_GPU_BLAS` is not `off`
    /// (what a matrix held in the decode layout only needs: `set_q8_decode_only`).
    pub fn blas_runs_prompts(&self) -> bool {
        mode() != OFF && self.blas_available()
    }

    fn blas_state(&self) -> Option<&BlasState> {
        self.blas
            .st
            .get_or_init(|| self.open_blas())
            .as_ref()
            .filter(|s| !s.broken.load(Ordering::Relaxed))
    }

    fn open_blas(&self) -> Option<BlasState> {
        let lt = match BlasLt::get(self.gpu.info().vendor) {
            Ok(lt) => lt,
            Err(line) => {
                eprintln!("{line}");
                return None;
            }
        };
        // The allocation makes the device's context current on this thread first.
        let started = self
            .gpu
            .alloc(WORKSPACE)
            .and_then(|ws| Ok((ws, lt.handle()?)));
        match started {
            Ok((ws, handle)) => {
                let st = BlasState {
                    lt,
                    plans: Mutex::new(HashMap::new()),
                    handle,
                    ws,
                    broken: AtomicBool::new(false),
                    cached: AtomicU64::new(0),
                    cached_bytes: AtomicU64::new(0),
                    declined: AtomicU64::new(0),
                    xshare: Mutex::new(XShare::default()),
                    warmed: AtomicBool::new(false),
                };
                let warmed = self.blas_warm(&st);
                st.warmed.store(warmed, Ordering::Relaxed);
                Some(st)
            }
            Err(e) => {
                eprintln!(
                    "ds4: {} ({}) could not start: {e}: dense prefill products use the built-in GEMM",
                    lt.name,
                    lt.lib.path.display()
                );
                None
            }
        }
    }

    /// One small product when the library is opened, waited for: the library's one-time
    /// set-up then happens when the backend is made instead of inside the first prompt. On the
    /// H200 (bench/results/gpu-prefill-p8-h200.txt) the first product of a process cost 165 ms
    /// of host time (heuristic query 55.8 ms, call 109.6 ms: the library loads its kernels on
    /// first use); after this warm product (46 ms here) the first product of that shape (the HC
    /// product, m 24, k 3 × 16384) took 13.7 ms (0.3 ms heuristic).
    /// True when the product ran; errors are otherwise ignored (the real products report theirs).
    fn blas_warm(&self, st: &BlasState) -> bool {
        let t0 = std::time::Instant::now();
        // A bf16 product of a prefill-like shape (m rows, n tokens, k = three K-parts).
        let (m, n, k) = (512usize, 64usize, 1536usize);
        let shape = Shape {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            lda: k as i64,
            ldb: k as i64,
            ldd: m as i64,
            batch: 1,
            a_stride: 0,
            b_stride: 0,
            d_stride: 0,
            f16: false,
        };
        let Ok(Some(plan)) = st.handle.plan(&shape, WORKSPACE) else {
            return false;
        };
        let (Ok(a), Ok(b), Ok(d)) = (
            self.gpu.alloc(m * k * 2),
            self.gpu.alloc(n * k * 2),
            self.gpu.alloc(m * n * 4),
        ) else {
            return false;
        };
        let rt = self.gpu.runtime();
        let ok = rt
            .memset_u32_async(a.ptr(), 0, a.bytes() / 4, self.stream)
            .and_then(|_| rt.memset_u32_async(b.ptr(), 0, b.bytes() / 4, self.stream))
            .and_then(|_| {
                st.handle.matmul(
                    &plan,
                    a.ptr(),
                    b.ptr(),
                    d.ptr(),
                    None,
                    false,
                    st.ws.ptr(),
                    WORKSPACE,
                    self.stream,
                )
            })
            .and_then(|_| self.gpu.synchronize())
            .is_ok();
        if trace() {
            eprintln!(
                "ds4 blas: warm product at open {:.2} ms (ok: {ok})",
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        ok
    }

    /// Whether the warm product ran when the library was opened (opens it on first call).
    pub fn blas_warmed(&self) -> bool {
        self.blas_state()
            .is_some_and(|s| s.warmed.load(Ordering::Relaxed))
    }

    /// `y[i] = W·x[i]` (`Part` as in Backend::matmul) for n > 4 rows; false: declined.
    pub(crate) fn blas_matmul(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        self.blas_dense(w, part, x, n, y, false)
    }

    /// `y[i] += W·x[i]` for n > 4 rows (Backend::matmul_add: the add in the library's
    /// epilogue, beta 1, instead of a product into scratch and add_f32; `DS4_GPU_BLAS_ACC=off`
    /// declines). The epilogue's sum is the add's (one f32 rounding of y + the product) over the
    /// same product, so y gets the same bits. Declined in the f16 form (its device-side
    /// (alpha, beta) pair carries beta 0); false: declined.
    pub(crate) fn blas_matmul_add(
        &self,
        w: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        if !acc_on() || mode() == F16 {
            return false;
        }
        let ok = self.blas_dense(w, Part::All, x, n, y, true);
        if ok {
            ACC_RUNS.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// One product of a dense weight (or one expert's slab) over n token rows; `acc`: y += it
    /// (the library's beta 1). The W' cache slot is the whole weight's, so only Part::All has one.
    fn blas_dense(
        &self,
        w: &GpuWeight,
        part: Part,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
        acc: bool,
    ) -> bool {
        let Some((p, ty, cols, rows, row_bytes)) = w.mat_parts() else {
            return false;
        };
        let slab = match part {
            Part::All => 0,
            Part::Expert(e) => e * rows * row_bytes,
        };
        self.blas_job(&Job {
            w: p.offset(slab as u64),
            dec: matches!(part, Part::All).then(|| w.dec_parts()).flatten(),
            bf: matches!(part, Part::All).then(|| w.bf_slot()).flatten(),
            ty,
            row_bytes,
            rows,
            cols,
            groups: 1,
            x: x.ptr,
            x_tok: cols,
            n,
            y: y.ptr,
            y_tok: rows,
            y_z: 0,
            acc,
            xpre: None,
        })
    }

    /// Backend::matmul_grouped for n > 4 rows (one strided batch per group); false: declined.
    pub(crate) fn blas_grouped(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        self.blas_grouped_job(w, groups, x, n, y, false)
    }

    /// The grouped product's job; `xpre`: x is the caller's one-term bf16 X' (blas_grouped_pre).
    fn blas_grouped_job(
        &self,
        w: &GpuWeight,
        groups: usize,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
        xpre: bool,
    ) -> bool {
        let Some((p, ty, cols, rows, row_bytes)) = w.mat_parts() else {
            return false;
        };
        if groups == 0 || !rows.is_multiple_of(groups) {
            return false;
        }
        self.blas_job(&Job {
            w: p,
            dec: w.dec_parts(),
            bf: w.bf_slot(),
            ty,
            row_bytes,
            rows,
            cols,
            groups,
            x: x.ptr,
            x_tok: groups * cols,
            n,
            y: y.ptr,
            y_tok: rows,
            y_z: rows / groups,
            acc: false,
            xpre: xpre.then_some(x.ptr),
        })
    }

    /// Whether a grouped product of `w` over `n` rows would take the one-term bf16 form
    /// (`DS4_GPU_BLAS=fast`, the engine's `--precision fast`) whose X' a caller may make itself
    /// ([`Self::blas_grouped_pre`]). Only the plan can still decline it.
    pub(crate) fn blas_fast_x_ok(&self, w: &GpuWeight, groups: usize, n: usize) -> bool {
        let Some((_, ty, cols, rows, _)) = w.mat_parts() else {
            return false;
        };
        mode() == FAST
            && n >= MIN_N
            && groups > 0
            && rows.is_multiple_of(groups)
            && !self.failed()
            && !self.recording.load(Ordering::Acquire)
            && matches!(
                ty,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
            )
            && cols > 0
            && cols.is_multiple_of(32)
            && suffix(ty).is_some()
            && self.blas_state().is_some()
    }

    /// `len` bf16 values of `xb` as f32 into `out` (exact; `len` a multiple of 8).
    pub(crate) fn blas_widen(&self, xb: &GpuBuf, len: usize, out: &mut GpuBuf) {
        let n8 = len / 8;
        self.run(
            &ds4_kernels::BLAS_PREP,
            "blas_x_widen",
            LaunchDims::linear(n8.div_ceil(256) as u32, 256),
            &[Arg::Ptr(xb.ptr), Arg::I64(n8 as i64), Arg::Ptr(out.ptr)],
        );
    }

    /// Backend::matmul_grouped of the X' the caller made (`xb`: n × groups × cols bf16, what
    /// `blas_x_f32` makes of X in the one-term form); false: declined (nothing queued).
    pub(crate) fn blas_grouped_pre(
        &self,
        w: &GpuWeight,
        groups: usize,
        xb: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) -> bool {
        self.blas_fast_x_ok(w, groups, n) && self.blas_grouped_job(w, groups, xb, n, y, true)
    }

    fn blas_job(&self, j: &Job) -> bool {
        let m = mode();
        if j.xpre.is_some() && m != FAST {
            return false; // a caller's X' is the one-term bf16 form's (parts 1)
        }
        if m == OFF
            || j.n < MIN_N
            || self.failed()
            || self.recording.load(Ordering::Acquire)
            || !matches!(
                j.ty,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
            )
            || j.cols == 0
            || !j.cols.is_multiple_of(32)
            || !j.x.0.is_multiple_of(16)
            || !j.x_tok.is_multiple_of(4)
        {
            return false;
        }
        let Some(sfx) = suffix(j.ty) else {
            return false;
        };
        let Some(st) = self.blas_state() else {
            return false;
        };
        // (The f16 form scans and converts GGUF blocks: a matrix held in the decode layout
        // only takes the fast bf16 form instead.)
        let blocks = j.w.0 != 0;
        if m == F16 && blocks && matches!(j.ty, GgmlType::Q8_0 | GgmlType::F16) {
            return self.blas_job_f16(st, j, sfx);
        }
        // Parts along K: hi/lo terms (see the module doc); BF16 weights have no lo part.
        let parts = if m == FAST || (m == F16 && !blocks) {
            1
        } else if j.ty == GgmlType::BF16 {
            2
        } else {
            3
        };
        let (g, kk) = (j.groups, parts * j.cols);
        let shape = j.shape(kk, false);
        let mut plans = st.plans.lock().unwrap();
        let Some(plan) = self.blas_plan(st, &mut plans, &shape) else {
            return false;
        };
        // W' (rows × kk bf16): the weight's copy, or made now in scratch (counts 4-byte words).
        let cached =
            j.bf.and_then(|slot| self.blas_w_cached(st, slot, j, parts, sfx));
        let wtmp = cached.is_none().then(|| {
            let wp = self.scratch(j.rows * kk / 2);
            self.blas_w(j, parts, sfx, wp.ptr);
            wp
        });
        let wptr = cached.unwrap_or_else(|| wtmp.as_ref().unwrap().ptr);
        // X' (n × g × kk bf16): the scope's shared copy when it is this X in this layout.
        let key = (j.x.0, j.x_tok, j.cols, g, j.n, parts);
        let mut xs = st.xshare.lock().unwrap();
        let share = xs.depth > 0 && xshare_on();
        let mut xtmp = None;
        let xptr = match (&xs.buf, j.xpre) {
            (_, Some(p)) => p,
            (Some(b), None) if share && xs.key == Some(key) => b.ptr,
            _ => {
                let xp = self.scratch(j.n * g * kk / 2);
                self.blas_x(j, parts, xp.ptr);
                let p = xp.ptr;
                if share {
                    xs.key = Some(key);
                    xs.buf = Some(xp); // the one it replaces goes back to the pool
                } else {
                    xtmp = Some(xp);
                }
                p
            }
        };
        drop(xs);
        let ok = self.blas_run(st, plan, wptr, xptr, j.y, None, j.acc, j.rows, kk);
        drop((wtmp, xtmp));
        ok
    }

    /// W (GGUF blocks) -> W' (rows × parts·K bf16) at `out`.
    fn blas_w(&self, j: &Job, parts: usize, sfx: &str, out: DevPtr) {
        W_CONV.fetch_add(1, Ordering::Relaxed);
        let wslices = j.rows * j.cols / 8;
        if let (GgmlType::Q8_0, Some((q, il))) = (j.ty, j.dec) {
            // From the decode layout: quants Q (rows × cols bytes), then the scales D.
            let d = q.offset((j.rows * j.cols) as u64);
            self.run(
                &ds4_kernels::BLAS_PREP,
                if il { "blas_w_q8_0di" } else { "blas_w_q8_0d" },
                LaunchDims::linear(wslices.div_ceil(256) as u32, 256),
                &[
                    Arg::Ptr(q),
                    Arg::Ptr(d),
                    Arg::I32(j.cols as i32),
                    Arg::I64(j.rows as i64),
                    Arg::I32(parts as i32),
                    Arg::Ptr(out),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::BLAS_PREP,
            &format!("blas_w_{sfx}"),
            LaunchDims::linear(wslices.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(j.w),
                Arg::I64(j.row_bytes as i64),
                Arg::I32(j.cols as i32),
                Arg::I64(j.rows as i64),
                Arg::I32(parts as i32),
                Arg::Ptr(out),
            ],
        );
    }

    /// X (f32, n rows of g groups of K) -> X' (n × g × parts·K bf16) at `out`.
    fn blas_x(&self, j: &Job, parts: usize, out: DevPtr) {
        X_CONV.fetch_add(1, Ordering::Relaxed);
        let xslices = j.n * j.groups * j.cols / 8;
        self.run(
            &ds4_kernels::BLAS_PREP,
            "blas_x_f32",
            LaunchDims::linear(xslices.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(j.x),
                Arg::I64(j.x_tok as i64),
                Arg::I32(j.cols as i32),
                Arg::I32(j.groups as i32),
                Arg::I64(j.n as i64),
                Arg::I32(parts as i32),
                Arg::Ptr(out),
            ],
        );
    }

    /// The weight's W' copy for `parts` (made now, once, when the policy allows: module doc);
    /// None: convert per call.
    fn blas_w_cached(
        &self,
        st: &BlasState,
        slot: &BfSlot,
        j: &Job,
        parts: usize,
        sfx: &str,
    ) -> Option<DevPtr> {
        // Off: the per-call conversion, even where a copy exists (a run-time A/B).
        let policy = cache_mode();
        if policy == 0 {
            return None;
        }
        let mut s = slot.0.lock().unwrap();
        if let Some((p, copy)) = &*s {
            if *p == parts {
                return copy.as_ref().map(|b| b.ptr());
            }
        }
        let bytes = j.rows * parts * j.cols * 2;
        let room = policy != CACHE_AUTO
            || self
                .gpu
                .mem_info()
                .is_ok_and(|(free, _)| free >= bytes as u64 + cache_margin());
        let copy = if room {
            self.gpu.alloc(bytes).ok()
        } else {
            None
        };
        match &copy {
            Some(b) => {
                self.blas_w(j, parts, sfx, b.ptr());
                st.cached.fetch_add(1, Ordering::Relaxed);
                st.cached_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            }
            None => {
                st.declined.fetch_add(1, Ordering::Relaxed);
            }
        }
        let ptr = copy.as_ref().map(|b| b.ptr());
        // A copy for other parts (the mode changed: tests) is replaced.
        if let Some((_, Some(old))) = s.replace((parts, copy)) {
            st.cached.fetch_sub(1, Ordering::Relaxed);
            st.cached_bytes
                .fetch_sub(old.bytes() as u64, Ordering::Relaxed);
        }
        ptr
    }

    /// The cached plan for `shape` (made on first use); None: no algorithm, or the library
    /// failed (then declined from now on). With `DS4_GPU_BLAS_NBUCKET` (module doc) a shape of
    /// another token count takes the algorithm of its bucket's plan when the library accepts it.
    fn blas_plan<'p>(
        &self,
        st: &BlasState,
        plans: &'p mut HashMap<(Shape, u64), Option<Plan>>,
        shape: &Shape,
    ) -> Option<&'p Plan> {
        let nb = n_bucket(shape.n);
        let key = (*shape, nb);
        if !plans.contains_key(&key) {
            if plans.len() + 1 >= MAX_PLANS {
                plans.clear();
            }
            let t0 = std::time::Instant::now();
            let like = if nb != shape.n {
                let bs = Shape { n: nb, ..*shape };
                let made = self.blas_plan(st, plans, &bs).map(|b| {
                    let t1 = std::time::Instant::now();
                    let r = st.handle.plan_like(shape, b, WORKSPACE);
                    (r, t1)
                });
                match made {
                    Some((Ok(Some(p)), t1)) => {
                        LIKE.fetch_add(1, Ordering::Relaxed);
                        if trace() {
                            eprintln!(
                                "ds4 blas: plan m{} n{} k{} b{}: algorithm of n{nb}, checked in \
                                 {:.1} us",
                                shape.m,
                                shape.n,
                                shape.k,
                                shape.batch,
                                t1.elapsed().as_secs_f64() * 1e6
                            );
                        }
                        Some(p)
                    }
                    _ => None, // not accepted (or no plan there): ask the heuristic
                }
            } else {
                None
            };
            let asked = like.is_none();
            let r = match like {
                Some(p) => Ok(Some(p)),
                None => st.handle.plan(shape, WORKSPACE),
            };
            match r {
                Ok(p) => {
                    if trace() && asked {
                        eprintln!(
                            "ds4 blas: plan m{} n{} k{} b{}{}: heuristic {:.1} us",
                            shape.m,
                            shape.n,
                            shape.k,
                            shape.batch,
                            if shape.f16 { " f16" } else { "" },
                            t0.elapsed().as_secs_f64() * 1e6
                        );
                        FIRST.store(true, Ordering::Relaxed);
                    }
                    plans.insert(key, p);
                }
                Err(e) => {
                    self.blas_broken(st, &e);
                    return None;
                }
            }
        }
        plans.get(&key).and_then(|p| p.as_ref()) // None: no algorithm for this shape
    }

    /// The f16 form (module doc): partial maxima, W' (unless an aligned F16 weight is read in
    /// place), X' and the device-side alpha, then one f16 product.
    fn blas_job_f16(&self, st: &BlasState, j: &Job, sfx: &str) -> bool {
        let (g, r, k) = (j.groups, j.rows / j.groups, j.cols);
        // An F16 weight is already W' (u = 0) when the library's 256-byte alignment holds.
        let in_place = j.ty == GgmlType::F16
            && j.w.0.is_multiple_of(256)
            && (g == 1 || (r * k * 2).is_multiple_of(256));
        let shape = j.shape(k, true);
        let mut plans = st.plans.lock().unwrap();
        let Some(plan) = self.blas_plan(st, &mut plans, &shape) else {
            return false;
        };
        // Partial maxima (2 words a block), then (alpha, beta) at word 2·AMAX_BLOCKS.
        let part = self.scratch(2 * AMAX_BLOCKS + 2);
        let ab = part.ptr.offset((8 * AMAX_BLOCKS) as u64);
        // Q8_0: scan the blocks' d (34-byte blocks of 32); F16: nothing to scale.
        let nb = if j.ty == GgmlType::Q8_0 { k / 32 } else { 0 };
        self.run(
            &ds4_kernels::BLAS_PREP,
            "blas_amax",
            LaunchDims::linear(AMAX_BLOCKS as u32, 256),
            &[
                Arg::Ptr(j.x),
                Arg::I64(j.x_tok as i64),
                Arg::I32((g * k) as i32),
                Arg::I64(j.n as i64),
                Arg::Ptr(j.w),
                Arg::I64(j.row_bytes as i64),
                Arg::I32(nb as i32),
                Arg::I64(j.rows as i64),
                Arg::Ptr(part.ptr),
            ],
        );
        // W' (rows × K f16) and X' (n × g × K f16); scratch counts 4-byte words.
        let wp = (!in_place).then(|| self.scratch(j.rows * k / 2));
        if let Some(wp) = &wp {
            self.run(
                &ds4_kernels::BLAS_PREP,
                &format!("blas_wh_{sfx}"),
                LaunchDims::linear((j.rows * k / 8).div_ceil(256) as u32, 256),
                &[
                    Arg::Ptr(j.w),
                    Arg::I64(j.row_bytes as i64),
                    Arg::I32(k as i32),
                    Arg::I64(j.rows as i64),
                    Arg::Ptr(part.ptr),
                    Arg::Ptr(wp.ptr),
                ],
            );
        }
        let xp = self.scratch(j.n * g * k / 2);
        self.run(
            &ds4_kernels::BLAS_PREP,
            "blas_xh_f32",
            LaunchDims::linear((j.n * g * k / 8).div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(j.x),
                Arg::I64(j.x_tok as i64),
                Arg::I32(k as i32),
                Arg::I32(g as i32),
                Arg::I64(j.n as i64),
                Arg::Ptr(part.ptr),
                Arg::Ptr(ab),
                Arg::Ptr(xp.ptr),
            ],
        );
        let w = wp.as_ref().map_or(j.w, |w| w.ptr);
        debug_assert!(!j.acc, "the f16 form carries beta 0");
        self.blas_run(st, plan, w, xp.ptr, j.y, Some(ab), false, j.rows, k)
    }

    /// Queue the library product y = alpha · W'X' (alpha: a device scalar pair, or 1) on the
    /// backend's stream once the operands' kernels are queued; count it (trace: its host time)
    /// or mark the library broken (false: the caller's GEMM runs).
    #[allow(clippy::too_many_arguments)]
    fn blas_run(
        &self,
        st: &BlasState,
        plan: &Plan,
        w: DevPtr,
        x: DevPtr,
        y: DevPtr,
        alpha: Option<DevPtr>,
        acc: bool,
        rows: usize,
        kk: usize,
    ) -> bool {
        if self.failed() {
            return true; // the error is recorded; the step fails at its check
        }
        let t0 = std::time::Instant::now();
        let r = st.handle.matmul(
            plan,
            w,
            x,
            y,
            alpha,
            acc,
            st.ws.ptr(),
            WORKSPACE,
            self.stream,
        );
        if trace() {
            let us = t0.elapsed().as_secs_f64() * 1e6;
            if FIRST.swap(false, Ordering::Relaxed) || us > 200.0 {
                eprintln!("ds4 blas: product m{rows} k{kk} host call {us:.1} us");
            }
        }
        match r {
            Ok(()) => {
                LAUNCHES.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                self.blas_broken(st, &e);
                false
            }
        }
    }

    fn blas_broken(&self, st: &BlasState, e: &crate::GpuError) {
        if !st.broken.swap(true, Ordering::Relaxed) {
            eprintln!(
                "ds4: {} failed ({e}): dense prefill products use the built-in GEMM",
                st.lt.name
            );
        }
    }
}
