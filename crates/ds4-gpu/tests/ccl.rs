//! The expert-parallel collective on one device (ccl.rs; `ds4_backend::Backend::all_reduce_sum`):
//! NCCL / RCCL opened at run time, a one-rank communicator, its all-reduce queued between the
//! graph pieces of a recorded step, and the device form of the router's localization against the
//! host rule. Skips, saying why, without a GPU or without the library (`DS4_REQUIRE_GPU=1`: a
//! missing GPU fails; `DS4_REQUIRE_CCL=1`: a missing library fails). Two ranks need two
//! devices: `ds4-engine/tests/gpu.rs`.

mod common;

use ds4_backend::{shard, Backend};
use ds4_gpu::ccl::Ccl;
use ds4_gpu::{GpuBackend, GpuComm};
use ds4_model::forward::rope_tables;
use ds4_model::HParams;
use rand::Rng;
use std::sync::Arc;

/// Held around `Ccl::open`: one test sets `DS4_NCCL_LIB` for a moment.
static LIB_ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn open_ccl(vendor: ds4_gpu::runtime::Vendor) -> ds4_gpu::Result<Ccl> {
    let _g = LIB_ENV.lock().unwrap_or_else(|e| e.into_inner());
    Ccl::open(vendor)
}

fn backend() -> Option<GpuBackend> {
    let gpu = common::open_gpu()?;
    Some(GpuBackend::new(gpu, &rope_tables(&HParams::tiny())).unwrap())
}

#[test]
fn one_rank_all_reduce_between_graph_pieces() {
    let Some(b) = backend() else { return };
    let vendor = b.gpu().info().vendor;
    let ccl = match open_ccl(vendor) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            if std::env::var("DS4_REQUIRE_CCL").is_ok_and(|v| v == "1") {
                panic!("DS4_REQUIRE_CCL=1: {e}");
            }
            println!("skipped: no collective library: {e}");
            return;
        }
    };
    println!(
        "{vendor} collectives {} from {}",
        ccl.version(),
        ccl.path.display()
    );
    let dev = b.gpu().info().index;
    let mut comms = ccl.init_all(&[dev]).unwrap();
    assert_eq!((comms[0].rank, comms[0].n_ranks), (0, 1));
    assert!(ccl.init_all(&[dev, dev]).is_err(), "one rank per device");
    let b = b.with_comm(GpuComm::Ccl(comms.remove(0)));
    let mut r = common::rng(7);
    let xv = common::randn(&mut r, 4099, 1.0);
    let yv = common::randn(&mut r, 4099, 1.0);
    let want: Vec<f32> = xv.iter().zip(&yv).map(|(a, c)| a + c + c).collect();
    // Eagerly, then inside recorded steps (graphs before and after the collective, replayed
    // from the second step on).
    for step in 0..4 {
        let mut s = b.upload(&xv);
        let y = b.upload(&yv);
        if step > 0 {
            b.graph_begin(1);
        }
        b.add(&mut s, &y, xv.len());
        b.all_reduce_sum(&mut s, xv.len()); // one rank: the sum is its own values
        b.add(&mut s, &y, xv.len());
        b.graph_end();
        let got = b.download(&s, xv.len());
        b.check().unwrap();
        assert_eq!(got, want, "step {step}");
    }
}

#[test]
fn localize_on_the_device_equals_the_host_rule() {
    let Some(b) = backend() else { return };
    let (n, k, n_exp) = (300, 6, 16);
    let mut r = common::rng(11);
    let sel: Vec<i32> = (0..n * k).map(|_| r.gen_range(0..n_exp)).collect();
    let wgt = common::randn(&mut r, n * k, 1.0);
    for ranks in [2usize, 3, 5] {
        for rank in 0..ranks {
            let (e0, count) = shard::Shard::ep(rank, ranks).experts(n_exp as usize);
            let (mut hs, mut hw) = (sel.clone(), wgt.clone());
            shard::localize(&mut hs, &mut hw, k, e0, count);
            let mut ds = b.upload_i32(&sel);
            let mut dw = b.upload(&wgt);
            b.moe_localize(&mut ds, &mut dw, n, k, e0, count);
            assert_eq!(b.download_i32(&ds, n * k), hs, "rank {rank} of {ranks}");
            assert_eq!(b.download(&dw, n * k), hw, "rank {rank} of {ranks}");
            assert!(hs.iter().all(|&e| e >= 0 && (e as usize) < count));
        }
    }
    b.check().unwrap();
}

/// No GPU needed: a file named by `DS4_NCCL_LIB` that is not NCCL is one clear error naming the
/// missing entry point and the file (it is tried before any other place).
#[test]
fn a_library_without_the_entry_points_is_a_clear_error() {
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    let Some(libm) = libm else {
        println!("skipped: no libm.so.6 at the usual places to stand in for a wrong library");
        return;
    };
    let r = {
        let _g = LIB_ENV.lock().unwrap_or_else(|e| e.into_inner());
        std::env::set_var("DS4_NCCL_LIB", libm);
        let r = Ccl::open(ds4_gpu::runtime::Vendor::Nvidia);
        std::env::remove_var("DS4_NCCL_LIB");
        r
    };
    let e = r.err().expect("libm is not NCCL").to_string();
    assert!(
        e.contains("ncclGetVersion") && e.contains("libm.so.6"),
        "{e}"
    );
}
