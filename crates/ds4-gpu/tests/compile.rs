//! Portability without a GPU: every kernel module compiles with NVRTC for sm_80, sm_90a and
//! sm_100, with hipRTC for gfx90a (wave64) and gfx1030 (wave32), and with clang-19's HIP driver
//! for gfx942 (wave64) and gfx1100 (wave32), and each code object defines every kernel the module
//! lists. A missing compiler skips with the reason, or fails when DS4_REQUIRE_COMPILERS=1 (CI
//! installs all three with tools/gpu/ci-install.sh). Each compiler's target × module jobs run
//! on one thread per target from one queue, largest module first ([`pool`]): CI's 2 cores stay
//! busy to the end instead of waiting on one target's modules in series. hipRTC compiles one at
//! a time whatever the threads (`Hiprtc::compile` holds a process-wide lock), so it gets one.
//! A module's `mma_only` kernels are checked where the target has mma (CUDA sm_80+), and the
//! clang test checks they are absent on AMD (not compiled for nothing).

use ds4_gpu::compiler::{cuda_defines, hip_defines, Compiler, Hiprtc, Nvrtc};
use ds4_gpu::GpuError;
use ds4_kernels::Module;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

fn require() -> bool {
    std::env::var("DS4_REQUIRE_COMPILERS").is_ok_and(|v| v == "1")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// `job(target, module)` for every target × module of `ds4_kernels::MODULES` on one thread per
/// target, the jobs taken in turn from one queue ordered by module source size, largest first (a
/// rough cost order, so the last jobs are short); the outputs in queue order. The compilers take
/// concurrent compiles (the runtime compiles a model's modules in parallel too), except hipRTC,
/// which serialises them: `threads` caps the threads (0: one per target).
fn pool<T: Sync, R: Send>(
    targets: &[T],
    threads: usize,
    job: impl Fn(&T, &Module) -> R + Sync,
) -> Vec<R> {
    let mut modules: Vec<&Module> = ds4_kernels::MODULES.iter().collect();
    modules.sort_by_key(|m| std::cmp::Reverse(m.source.len()));
    let jobs: Vec<(&T, &Module)> = modules
        .iter()
        .flat_map(|&m| targets.iter().map(move |t| (t, m)))
        .collect();
    let out: Vec<Mutex<Option<R>>> = jobs.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let n = if threads == 0 {
            targets.len()
        } else {
            threads.min(targets.len())
        };
        for _ in 0..n {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(t, m)) = jobs.get(i) else { break };
                *out[i].lock().unwrap() = Some(job(t, m));
            });
        }
    });
    out.into_iter()
        .map(|r| r.into_inner().unwrap().expect("every job ran"))
        .collect()
}

fn check_all(c: &dyn Compiler, targets: &[(&str, Vec<(String, String)>)], threads: usize) {
    println!("{} from {}", c.version(), c.path().display());
    let failures: Vec<String> = pool(targets, threads, |(arch, defines), m| {
        let t = std::time::Instant::now();
        match c.compile(m, arch, defines) {
            Ok(code) => {
                let missing: Vec<_> = m
                    .kernels_for(ds4_kernels::has_mma(defines))
                    .filter(|k| !contains(&code, k.as_bytes()))
                    .collect();
                println!(
                    "  {arch} {}: {} bytes in {:.2} s{}",
                    m.name,
                    code.len(),
                    t.elapsed().as_secs_f64(),
                    if missing.is_empty() {
                        String::new()
                    } else {
                        format!(", MISSING {missing:?}")
                    }
                );
                (!missing.is_empty()).then(|| {
                    format!(
                        "{arch} {}: kernels {missing:?} not in the code object",
                        m.name
                    )
                })
            }
            Err(e) => Some(format!("{arch} {}: {e}", m.name)),
        }
    })
    .into_iter()
    .flatten()
    .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn skip_or_fail(what: &str, e: GpuError) {
    if require() {
        panic!("DS4_REQUIRE_COMPILERS=1 but {what} is unavailable: {e}");
    }
    println!("skipped: {what} unavailable (run tools/gpu/ci-install.sh): {e}");
}

#[test]
fn nvrtc_compiles_every_module() {
    let c = match Nvrtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("NVRTC", e),
    };
    let targets = [
        ("sm_80", cuda_defines(8, 0, 32)),
        ("sm_90a", cuda_defines(9, 0, 32)),
        ("sm_100", cuda_defines(10, 0, 32)),
    ];
    check_all(&c, &targets, 0);
}

#[test]
fn hiprtc_compiles_every_module() {
    let c = match Hiprtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("hipRTC", e),
    };
    let targets = [
        ("gfx90a", hip_defines("gfx90a", 64)),
        ("gfx1030", hip_defines("gfx1030", 32)),
    ];
    check_all(&c, &targets, 1);
    // Newer targets where this hipRTC knows them (Debian's ROCm 5.2 does not know gfx942 or
    // gfx1100); an unknown target must be a clear error, not the abort ROCm 5.2 gives.
    println!("  targets known to comgr: {:?}", c.targets());
    for (arch, warp) in [("gfx942", 64), ("gfx1100", 32)] {
        match c.compile(&ds4_kernels::QUANT, arch, &hip_defines(arch, warp)) {
            Ok(code) => println!("  {arch} quant: {} bytes", code.len()),
            Err(e) => {
                assert!(!c.supports(arch), "{arch}: {e}");
                assert!(e.to_string().contains("not supported"), "{e}");
                println!("  {arch}: not supported by this hipRTC (skipped)");
            }
        }
    }
}

/// hipRTC compiles from several threads run one at a time (ROCm 5's comgr is not thread-safe:
/// concurrent compiles hung a CI run), and each still succeeds.
#[test]
fn hiprtc_compiles_one_at_a_time() {
    let c = match Hiprtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("hipRTC", e),
    };
    let d = hip_defines("gfx1030", 32);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| c.compile(&ds4_kernels::ELEMENTWISE, "gfx1030", &d).unwrap());
        }
    });
    assert_eq!(Hiprtc::most_at_once(), 1);
}

/// The prelude rejects a missing or odd warp width, so no kernel silently assumes one.
#[test]
fn prelude_requires_warp_define() {
    let c = match Nvrtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("NVRTC", e),
    };
    let mut d = cuda_defines(9, 0, 32);
    d.retain(|(k, _)| k != "DS4_WARP");
    let e = c
        .compile(&ds4_kernels::ELEMENTWISE, "sm_90a", &d)
        .unwrap_err();
    assert!(e.to_string().contains("DS4_WARP"), "{e}");
    d.push(("DS4_WARP".into(), "48".into()));
    assert!(c.compile(&ds4_kernels::ELEMENTWISE, "sm_90a", &d).is_err());
}

/// Where libamdhip64 is installed (CI: Debian's libamdhip64-5), the HIP runtime's whole
/// `dlopen` table resolves: without AMD hardware the first failure must be a driver status
/// (hipInit / hipGetDeviceCount), never a missing library or symbol.
#[test]
fn hip_runtime_table_resolves() {
    if let Err(e) = Hiprtc::load() {
        return skip_or_fail("libamdhip64 (hipRTC)", e);
    }
    match ds4_gpu::hip::HipRuntime::device_count() {
        Ok(n) => println!("HIP runtime: {n} device(s)"),
        Err(e @ GpuError::Api { .. }) => println!("HIP runtime loaded, no device: {e}"),
        Err(e) => panic!("HIP runtime table did not resolve: {e}"),
    }
    for (vendor, r) in ds4_gpu::probe() {
        println!(
            "probe {vendor}: {}",
            r.map_or_else(|e| e.to_string(), |n| format!("{n} device(s)"))
        );
    }
}

/// Where clang-19 and the HIP headers are installed (CI: Debian's clang-19 and
/// libamdhip64-dev), every module compiles offline to AMD ISA for the targets the Debian hipRTC
/// (ROCm 5.2) does not know: gfx942 (MI300, wave64) and gfx1100 (RDNA3, wave32). The device
/// code goes through clang's HIP driver (`-x hip --offload-device-only -S`, assembly: no lld
/// needed) with the same defines the host passes at run time; hipRTC declares the HIP builtins
/// implicitly, clang gets them from `-include hip/hip_runtime.h`. Each kernel a module lists
/// must appear as an `.amdhsa_kernel` in its assembly. The two targets' jobs run in parallel.
#[test]
fn clang_hip_compiles_every_module_for_gfx942_and_gfx1100() {
    let clang = std::env::var("DS4_HIP_CLANG").unwrap_or_else(|_| "clang-19".into());
    let rocm = ["ROCM_PATH", "HIP_PATH"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .chain(["/usr".to_string(), "/opt/rocm".to_string()])
        .find(|p| {
            std::path::Path::new(p)
                .join("include/hip/hip_runtime.h")
                .exists()
        });
    let version = std::process::Command::new(&clang).arg("--version").output();
    let (rocm, version) = match (rocm, version) {
        (Some(r), Ok(v)) if v.status.success() => (r, v),
        (r, v) => {
            let why = format!(
                "{clang}: {}; HIP headers (include/hip/hip_runtime.h under $ROCM_PATH, /usr, \
                 /opt/rocm): {}",
                match &v {
                    Ok(o) if o.status.success() => "found".to_string(),
                    Ok(o) => format!("exit status {}", o.status),
                    Err(e) => e.to_string(),
                },
                r.as_deref().unwrap_or("not found")
            );
            if require() {
                panic!("DS4_REQUIRE_COMPILERS=1 but clang HIP is unavailable: {why}");
            }
            return println!("skipped: clang HIP unavailable (run tools/gpu/ci-install.sh): {why}");
        }
    };
    let first = String::from_utf8_lossy(&version.stdout);
    println!(
        "{} with HIP headers from {rocm}",
        first.lines().next().unwrap_or("?")
    );
    let dir = std::env::temp_dir().join(format!("ds4-clang-hip-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in ds4_kernels::HEADERS {
        std::fs::write(dir.join(name), text).unwrap();
    }
    for m in ds4_kernels::MODULES {
        std::fs::write(dir.join(format!("{}.cu", m.name)), m.source).unwrap();
    }
    let failures: Vec<String> = pool(
        &[("gfx942", 64u32), ("gfx1100", 32)],
        0,
        |&(arch, warp), m| {
            let t = std::time::Instant::now();
            let out = dir.join(format!("{}-{arch}.s", m.name));
            let mut cmd = std::process::Command::new(&clang);
            cmd.args([
                "-x",
                "hip",
                "--offload-device-only",
                "-nogpulib",
                "-O3",
                "-std=c++17",
                "-S",
            ])
            .arg(format!("--offload-arch={arch}"))
            .arg(format!("--rocm-path={rocm}"))
            .args(["-include", "hip/hip_runtime.h"])
            .arg(format!("-I{}", dir.display()));
            for (k, v) in hip_defines(arch, warp) {
                cmd.arg(format!("-D{k}={v}"));
            }
            let o = cmd
                .arg("-o")
                .arg(&out)
                .arg(dir.join(format!("{}.cu", m.name)))
                .output();
            let o = match o {
                Ok(o) => o,
                Err(e) => return Some(format!("{arch} {}: {clang}: {e}", m.name)),
            };
            let err = String::from_utf8_lossy(&o.stderr);
            if !o.status.success() {
                let head: Vec<_> = err.lines().take(20).collect();
                return Some(format!(
                    "{arch} {}: {}\n{}",
                    m.name,
                    o.status,
                    head.join("\n")
                ));
            }
            let asm = std::fs::read_to_string(&out).unwrap_or_default();
            let has = |k: &str| {
                asm.lines()
                    .any(|l| l.trim() == format!(".amdhsa_kernel {k}"))
            };
            let missing: Vec<_> = m.kernels.iter().filter(|k| !has(k)).collect();
            let extra: Vec<_> = m.mma_only.iter().filter(|k| has(k)).collect();
            // Warnings (e.g. an occupancy hint not met on wave64) are printed, not failures.
            let warnings = err.lines().filter(|l| l.contains("warning:")).count();
            println!(
                "  {arch} {}: {} kernels in {:.1} s{}{}",
                m.name,
                m.kernels.len() - missing.len(),
                t.elapsed().as_secs_f64(),
                if warnings > 0 {
                    format!(", {warnings} warnings")
                } else {
                    String::new()
                },
                if missing.is_empty() {
                    String::new()
                } else {
                    format!(", MISSING {missing:?}")
                }
            );
            if !extra.is_empty() {
                return Some(format!(
                    "{arch} {}: mma-only kernels {extra:?} compiled",
                    m.name
                ));
            }
            (!missing.is_empty())
                .then(|| format!("{arch} {}: kernels {missing:?} not in the ISA", m.name))
        },
    )
    .into_iter()
    .flatten()
    .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The prompt's wgmma kernels (MoE, indexer scores, attention) keep their asynchronous pipeline on sm_90a. ptxas (through
/// NVRTC, `--ptxas-options=-v`) notes C7512, "wgmma.mma_async instructions are serialized", for a
/// kernel whose registers do not fit the pipeline: every wgmma then waits for the one before
/// (session 27: the persistent down `gwd_q2_k_p1_fwp` is serialized, +4-5% a call on the H200,
/// so it is off by default; bench/results/gpu-moe-s27-h200.txt). The default forms must be
/// neither serialized nor spilling; each log must name them (a log without ptxas notes would
/// make the check vacuous). Skips (fails under DS4_REQUIRE_COMPILERS=1) without NVRTC.
#[test]
fn wgmma_kernels_not_serialized() {
    let c = match Nvrtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("NVRTC", e),
    };
    let defines = cuda_defines(9, 0, 32);
    let mut serialized = Vec::new();
    let mut spills: Vec<(String, String)> = Vec::new();
    let mut named = Vec::new();
    for m in [
        &ds4_kernels::GEMM_WG,
        &ds4_kernels::GEMM_WGD,
        &ds4_kernels::ATTN_TC,
    ] {
        let (_, log) = c
            .compile_logged(m, "sm_90a", &defines, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let mut func = String::new();
        for line in log.lines() {
            if line.contains("wgmma.mma_async instructions are serialized") {
                println!("  {}", line.trim());
                serialized.push(line.rsplit('\'').nth(1).unwrap_or("?").to_string());
            } else if let Some(f) = line.split("Function properties for ").nth(1) {
                func = f.trim().to_string();
                named.push(func.clone());
            } else if line.contains("bytes spill stores") {
                spills.push((func.clone(), line.trim().to_string()));
            }
        }
    }
    println!("  serialized: {serialized:?}");
    for k in [
        "gwg_iq2_xxs_p1_d2_fw",
        "gwg_iq2_xxs_p1_d2_fwp",
        "gwd_q2_k_p1_fw",
        "index_scores_wg",
        "attn_wg512_f32",
        "attn_wg512n_f32",
    ] {
        assert!(named.iter().any(|n| n == k), "{k}: not in ptxas's notes");
        assert!(
            !serialized.iter().any(|s| s == k),
            "{k}: ptxas serialized its wgmma (C7512)"
        );
        let (_, sp) = spills.iter().find(|(f, _)| f == k).expect("spill line");
        assert!(
            sp.contains(" 0 bytes spill stores"),
            "{k}: ptxas spills: {sp}"
        );
    }
}

/// ptxas's notes (registers, shared memory, spills per kernel) of the modules named in
/// `DS4_PTXAS_MODULES` (space-separated, e.g. "matvec attention"; default "matvec") for sm_90a,
/// printed: a tool for kernel work (`cargo test --release -p ds4-gpu --test compile ptxas_notes
/// -- --ignored --nocapture`). It fails on a name that is no module and on a module of which
/// ptxas reports no kernel's registers (a log without notes).
#[test]
#[ignore]
fn ptxas_notes() {
    let c = match Nvrtc::load() {
        Ok(c) => c,
        Err(e) => return skip_or_fail("NVRTC", e),
    };
    let want = std::env::var("DS4_PTXAS_MODULES").unwrap_or_else(|_| "matvec".into());
    let defines = cuda_defines(9, 0, 32);
    for name in want.split_whitespace() {
        let m = ds4_kernels::MODULES
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("DS4_PTXAS_MODULES: no module {name:?}"));
        let (_, log) = c
            .compile_logged(m, "sm_90a", &defines, &["--ptxas-options=-v"])
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let mut func = String::new();
        let mut used = 0;
        for line in log.lines() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                func = f.trim().to_string();
            } else if line.contains("Used ") || line.contains("spill") {
                used += line.contains("Used ") as usize;
                println!("{}: {}", func, line.trim());
            }
        }
        assert!(used > 0, "{name}: ptxas reported no kernel's registers");
    }
}
