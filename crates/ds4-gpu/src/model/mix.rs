//! Model glue ops on the GPU: embedding, hyper-connections, router, elementwise (kernels in
//! `ds4-kernels/gpu/model.cu` and `elementwise.cu`). Reference: ds4-cpu backend.rs.
//!
//! rms_norm, hc_split, hc_collapse, hc_post and moe_route have latency forms for decode
//! (`*_fast`, `*x4`: float4 loads in flight at once, warp-synchronous Sinkhorn and top-k; the
//! default, `DS4_GPU_MIX=fast`), and glue forms on top (opt-in, `DS4_GPU_MIX=glue`: Sinkhorn in
//! one thread's registers per token, 64-thread column CTAs, rms_norm with one barrier; on the H200
//! they decoded full-size q2 at 67.3 tok/s against 70.9 for the fast forms, so they are not the
//! default). `DS4_GPU_MIX=simple` runs the first kernels, one CTA per row or token (or
//! [`GpuBackend::set_mix_form`]).

use super::{GpuBackend, GpuBuf, GpuIBuf, GpuWeight};
use crate::error::GpuError;
use crate::runtime::{Arg, DevPtr, LaunchDims};
use ds4_backend::{GgmlType, HcDims, MoeSpec};
use std::sync::atomic::{AtomicU8, Ordering};

/// Most hyper-connection streams the `hc_*` kernels take (`DS4_HC_MAX` in model.cu).
const HC_MAX: usize = 16;
/// Most experts, and experts per token, `moe_route` takes (`DS4_ROUTE_MAX_E`, `_K`).
const ROUTE_MAX_E: usize = 1024;
const ROUTE_MAX_K: usize = 32;
/// Longest row `rmsnorm_f32x4` takes: 4 float4 per thread of a 1024-thread CTA.
const NORM_X4_MAX: usize = 4 * 4 * 1024;

/// Kernel forms: 0 not yet read from `DS4_GPU_MIX`, 1 glue, 2 simple, 3 fast (default)
/// (process-wide).
static MODE: AtomicU8 = AtomicU8::new(0);

/// Which glue kernels run: `DS4_GPU_MIX=simple|glue`, read once (anything else: fast), or
/// [`GpuBackend::set_mix_form`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MixForm {
    /// One CTA per row or token (the first kernels).
    Simple,
    /// The round-2 latency forms (float4, warp-synchronous Sinkhorn and top-k).
    Fast,
    /// The default: fast plus a Sinkhorn in one thread's registers per token (N <= 4), 64-thread
    /// column CTAs for hc_split/collapse/post, rms_norm with one block barrier.
    Glue,
}

fn mix_form() -> MixForm {
    let mut m = MODE.load(Ordering::Relaxed);
    if m == 0 {
        let env = match std::env::var("DS4_GPU_MIX").as_deref() {
            Ok("simple") => 2,
            Ok("glue") => 1,
            _ => 3,
        };
        m = match MODE.compare_exchange(0, env, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => env,
            Err(cur) => cur,
        };
    }
    match m {
        2 => MixForm::Simple,
        3 => MixForm::Fast,
        _ => MixForm::Glue,
    }
}

/// Whether the simple kernels are in use.
fn mix_simple() -> bool {
    mix_form() == MixForm::Simple
}

/// Whether the glue forms are in use.
fn mix_glue() -> bool {
    mix_form() == MixForm::Glue
}

/// Threads of the glue forms' column CTAs (float4 columns each): 64 (more, smaller CTAs) while
/// the columns of all `n` tokens fit in 16384 threads (one wave of the SMs; decode), else 256
/// (prefill, as the latency forms).
fn glue_cols(n: usize, d: usize) -> usize {
    if n * (d / 4) <= 64 * 256 {
        64
    } else {
        256
    }
}

/// float4 loads are safe at this address.
fn al16(p: DevPtr) -> bool {
    p.0.is_multiple_of(16)
}

impl GpuBackend {
    /// Use the simple glue kernels (true) or the default (fast) forms (false). Process-wide.
    pub fn set_mix_simple(on: bool) {
        Self::set_mix_form(if on { "simple" } else { "fast" });
    }

    /// Select the glue kernel form by its `DS4_GPU_MIX` name: "fast" (the default), "glue" or
    /// "simple" (overrides the variable). Process-wide; for tests and benchmarks of every form.
    pub fn set_mix_form(form: &str) {
        let m = match form {
            "glue" => 1,
            "simple" => 2,
            "fast" => 3,
            _ => panic!("set_mix_form: unknown form {form:?} (glue, fast, simple)"),
        };
        MODE.store(m, Ordering::Relaxed);
    }

    fn invalid(&self, msg: &str) {
        self.note::<()>(Err(GpuError::Invalid(msg.to_string())));
    }

    /// `out[(i·copies + c)·d ..]` = row `tokens[i]` of the table, dequantised (F32, F16, BF16,
    /// Q8_0), one CTA per token.
    pub(crate) fn op_embed(
        &self,
        table: &GpuWeight,
        tokens: &GpuIBuf,
        n: usize,
        copies: usize,
        d: usize,
        out: &mut GpuBuf,
    ) {
        let GpuWeight::Mat {
            buf,
            ty,
            cols,
            row_bytes,
            ..
        } = table
        else {
            return self.invalid("embed: the table must be a matrix weight");
        };
        let code = match ty {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 3,
            _ => return self.invalid(&format!("embed: unsupported table type {ty:?}")),
        };
        if d > *cols {
            return self.invalid(&format!("embed: width {d} > table columns {cols}"));
        }
        if n == 0 || copies == 0 || d == 0 {
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "embed_rows",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(buf.ptr()),
                Arg::Ptr(tokens.0.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(copies as i32),
                Arg::I32(d as i32),
                Arg::I64(*row_bytes as i64),
                Arg::I32(code),
            ],
        );
    }

    pub(crate) fn op_add(&self, y: &mut GpuBuf, x: &GpuBuf, len: usize) {
        let blocks = len.div_ceil(256).max(1) as u32;
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "add_f32",
            LaunchDims::linear(blocks, 256),
            &[
                Arg::Ptr(y.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(y.ptr),
                Arg::I64(len as i64),
            ],
        );
    }

    pub(crate) fn op_rms_norm(
        &self,
        x: &mut GpuBuf,
        rows: usize,
        width: usize,
        w: Option<&GpuWeight>,
        eps: f32,
    ) {
        if rows == 0 {
            return;
        }
        let fast = !mix_simple()
            && width.is_multiple_of(4)
            && width <= NORM_X4_MAX
            && al16(x.ptr)
            && w.is_none_or(|w| al16(w.ptr()));
        // x4: one float4 per thread up to 1024 threads (a 16384 row: 4 each), whole warps.
        let warp = self.warp() as usize;
        let (name, threads) = if fast && mix_glue() {
            // Two float4 per thread (four past 2048 float4): fewer warp partials to add.
            let per = if width / 4 <= 2048 { 2 } else { 4 };
            (
                "rmsnorm_f32g",
                (width / 4)
                    .div_ceil(per)
                    .next_multiple_of(warp)
                    .clamp(warp, 1024),
            )
        } else if fast {
            (
                "rmsnorm_f32x4",
                (width / 4).next_multiple_of(warp).clamp(warp, 1024),
            )
        } else {
            ("rmsnorm_f32", 256)
        };
        self.run(
            &ds4_kernels::ELEMENTWISE,
            name,
            LaunchDims::linear(rows as u32, threads as u32),
            &[
                Arg::Ptr(x.ptr),
                w.map_or(Arg::Null, |w| Arg::Ptr(w.ptr())),
                Arg::Ptr(x.ptr),
                Arg::I32(width as i32),
                Arg::F32(eps),
            ],
        );
    }

    pub(crate) fn op_swiglu(&self, g: &mut GpuBuf, u: &GpuBuf, len: usize, clamp: f32) {
        let blocks = len.div_ceil(256).max(1) as u32;
        self.run(
            &ds4_kernels::ELEMENTWISE,
            "swiglu_f32",
            LaunchDims::linear(blocks, 256),
            &[
                Arg::Ptr(g.ptr),
                Arg::Ptr(u.ptr),
                Arg::Ptr(g.ptr),
                Arg::F32(clamp),
                Arg::F32(1.0),
                Arg::I64(len as i64),
            ],
        );
    }

    /// HC pre: simple form one CTA per token (Sinkhorn on N threads, the collapse over D); fast
    /// form column CTAs plus one warp per token for the Sinkhorn, concurrently.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_split(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        z: &mut GpuBuf,
        post: &mut GpuBuf,
        comb: &mut GpuBuf,
    ) {
        if !self.hc_ok(&hc) || n == 0 {
            return;
        }
        let cols_ok = hc.d.is_multiple_of(4) && al16(x.ptr) && al16(z.ptr);
        if mix_glue() && hc.n <= 4 && cols_ok {
            // ceil(n / w) Sinkhorn CTAs (a thread a token), then n·cc column CTAs of w threads.
            let w = glue_cols(n, hc.d);
            let cc = (hc.d / 4).div_ceil(w);
            let sink = n.div_ceil(w);
            self.run(
                &ds4_kernels::MODEL,
                "hc_split_glue",
                LaunchDims::linear((sink + n * cc) as u32, w as u32),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(z.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I32(hc.sinkhorn_iters as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(n as i32),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        if !mix_simple() && cols_ok {
            // The Sinkhorn CTAs (a warp a token), then n·cc column CTAs (256 float4 columns each).
            let cc = (hc.d / 4).div_ceil(256);
            let sink = n.div_ceil(256 / self.warp() as usize);
            self.run(
                &ds4_kernels::MODEL,
                "hc_split_fast",
                LaunchDims::linear((sink + n * cc) as u32, 256),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(z.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I32(hc.sinkhorn_iters as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(n as i32),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_split",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(m.ptr),
                Arg::Ptr(scale.ptr()),
                Arg::Ptr(base.ptr()),
                Arg::Ptr(x.ptr),
                Arg::Ptr(z.ptr),
                Arg::Ptr(post.ptr),
                Arg::Ptr(comb.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I32(hc.sinkhorn_iters as i32),
                Arg::F32(hc.eps),
            ],
        );
    }

    /// Head collapse: one CTA per token (simple), or CTAs of 256 float4 columns (fast).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_hc_collapse(
        &self,
        hc: HcDims,
        m: &GpuBuf,
        scale: &GpuWeight,
        base: &GpuWeight,
        x: &GpuBuf,
        n: usize,
        y: &mut GpuBuf,
    ) {
        if !self.hc_ok(&hc) || n == 0 {
            return;
        }
        if !mix_simple() && hc.d > 0 && hc.d.is_multiple_of(4) && al16(x.ptr) && al16(y.ptr) {
            // CTAs per token, `w` float4 columns each (the kernel reads blockDim).
            let w = if mix_glue() { glue_cols(n, hc.d) } else { 256 };
            let cc = (hc.d / 4).div_ceil(w);
            self.run(
                &ds4_kernels::MODEL,
                "hc_collapse_fast",
                LaunchDims::linear((n * cc) as u32, w as u32),
                &[
                    Arg::Ptr(m.ptr),
                    Arg::Ptr(scale.ptr()),
                    Arg::Ptr(base.ptr()),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(y.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::F32(hc.eps),
                    Arg::I32(cc as i32),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_collapse",
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(m.ptr),
                Arg::Ptr(scale.ptr()),
                Arg::Ptr(base.ptr()),
                Arg::Ptr(x.ptr),
                Arg::Ptr(y.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::F32(hc.eps),
            ],
        );
    }

    /// HC post in place on `x` (`[n, N, D]`), one thread per (token, column).
    pub(crate) fn op_hc_post(
        &self,
        hc: HcDims,
        x: &mut GpuBuf,
        o: &GpuBuf,
        post: &GpuBuf,
        comb: &GpuBuf,
        n: usize,
    ) {
        let total = n * hc.d;
        if !self.hc_ok(&hc) || total == 0 {
            return;
        }
        if !mix_simple() && hc.n <= 4 && hc.d.is_multiple_of(4) && al16(x.ptr) && al16(o.ptr) {
            let total4 = total / 4; // one thread per float4 column
            let w = if mix_glue() { glue_cols(n, hc.d) } else { 256 };
            self.run(
                &ds4_kernels::MODEL,
                "hc_post_fast",
                LaunchDims::linear(total4.div_ceil(w) as u32, w as u32),
                &[
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(o.ptr),
                    Arg::Ptr(post.ptr),
                    Arg::Ptr(comb.ptr),
                    Arg::I32(hc.n as i32),
                    Arg::I32(hc.d as i32),
                    Arg::I64(total4 as i64),
                ],
            );
            return;
        }
        self.run(
            &ds4_kernels::MODEL,
            "hc_post",
            LaunchDims::linear(total.div_ceil(256) as u32, 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(o.ptr),
                Arg::Ptr(post.ptr),
                Arg::Ptr(comb.ptr),
                Arg::I32(hc.n as i32),
                Arg::I32(hc.d as i32),
                Arg::I64(total as i64),
            ],
        );
    }

    /// Router, one CTA per token (fast form: top-k by warp 0): hash table (`tid2eid`, an I32 table) or biased top-k.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op_moe_route(
        &self,
        spec: &MoeSpec,
        logits: &GpuBuf,
        bias: Option<&GpuWeight>,
        tid2eid: Option<&GpuWeight>,
        tokens: &GpuIBuf,
        n: usize,
        sel: &mut GpuIBuf,
        wgt: &mut GpuBuf,
    ) {
        let (ne, k) = (spec.n_expert, spec.n_used);
        if ne > ROUTE_MAX_E || k > ROUTE_MAX_K || k > ne {
            return self.invalid(&format!(
                "moe_route: {k} of {ne} experts (at most {ROUTE_MAX_K} of {ROUTE_MAX_E})"
            ));
        }
        if tid2eid.is_none() && bias.is_none() {
            return self.invalid("moe_route: a router needs a bias or a hash table");
        }
        if n == 0 || k == 0 {
            return;
        }
        let (bias, tab) = match tid2eid {
            Some(t) => (Arg::Null, Arg::Ptr(t.ptr())),
            None => (Arg::Ptr(bias.map(|b| b.ptr()).unwrap()), Arg::Null),
        };
        // The fast form keeps the k selected experts on the lanes of one warp.
        let route = if !mix_simple() && k <= self.warp() as usize {
            "moe_route_fast"
        } else {
            "moe_route"
        };
        self.run(
            &ds4_kernels::MODEL,
            route,
            LaunchDims::linear(n as u32, 256),
            &[
                Arg::Ptr(logits.ptr),
                bias,
                tab,
                Arg::Ptr(tokens.0.ptr),
                Arg::Ptr(sel.0.ptr),
                Arg::Ptr(wgt.ptr),
                Arg::I32(ne as i32),
                Arg::I32(k as i32),
                Arg::F32(spec.weight_scale),
            ],
        );
    }

    fn hc_ok(&self, hc: &HcDims) -> bool {
        if hc.n == 0 || hc.n > HC_MAX {
            self.invalid(&format!("hc: {} streams (at most {HC_MAX})", hc.n));
            return false;
        }
        true
    }
}
