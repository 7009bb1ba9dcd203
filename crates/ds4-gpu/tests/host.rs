//! Host-side pieces that need no GPU and no compiler: the kernel cache, library search
//! messages, device-property parsing, launch-argument encoding, split-K planning inputs.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use ds4_gpu::cache::{cache_key, compile_cached, entry_name, load_or_rebuild, unseal, Origin};
use ds4_gpu::compiler::{cuda_arch, hip_default_warp, hip_defines, Compiler};
use ds4_gpu::{GpuError, Result};
use ds4_kernels::Module;

/// A compiler that returns the module name and arch as "code", counting calls.
struct Fake {
    calls: AtomicUsize,
    version: String,
}

impl Compiler for Fake {
    fn name(&self) -> &'static str {
        "nvrtc"
    }
    fn version(&self) -> String {
        self.version.clone()
    }
    fn path(&self) -> PathBuf {
        PathBuf::from("fake")
    }
    fn compile(&self, m: &Module, arch: &str, _d: &[(String, String)]) -> Result<Vec<u8>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(format!("{}@{arch}", m.name).into_bytes())
    }
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-gpu-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn cache_hits_and_keys() {
    let dir = tmpdir("cache");
    let c = Fake {
        calls: AtomicUsize::new(0),
        version: "nvrtc 13.0".into(),
    };
    let d = vec![("DS4_WARP".to_string(), "32".to_string())];
    let m = &ds4_kernels::QUANT;
    let (a, o1) = compile_cached(&c, m, "sm_90a", &d, Some(&dir)).unwrap();
    let (b, o2) = compile_cached(&c, m, "sm_90a", &d, Some(&dir)).unwrap();
    assert_eq!((o1, o2), (Origin::Compiled, Origin::Cache));
    assert_eq!(a, b);
    assert_eq!(c.calls.load(Ordering::SeqCst), 1);
    // Another arch, define or compiler version is another entry.
    compile_cached(&c, m, "sm_80", &d, Some(&dir)).unwrap();
    let d64 = vec![("DS4_WARP".to_string(), "64".to_string())];
    compile_cached(&c, m, "sm_90a", &d64, Some(&dir)).unwrap();
    assert_eq!(c.calls.load(Ordering::SeqCst), 3);
    let k1 = cache_key(m, "sm_90a", &d, "nvrtc 13.0");
    assert_ne!(k1, cache_key(m, "sm_90a", &d, "nvrtc 13.1"));
    assert_ne!(
        k1,
        cache_key(&ds4_kernels::ELEMENTWISE, "sm_90a", &d, "nvrtc 13.0")
    );
    // Define order does not matter.
    let two = vec![
        ("A".to_string(), "1".to_string()),
        ("B".to_string(), "2".to_string()),
    ];
    let rev: Vec<_> = two.iter().rev().cloned().collect();
    assert_eq!(cache_key(m, "x", &two, "v"), cache_key(m, "x", &rev, "v"));
    // An empty, truncated, damaged or bare (pre-seal) entry is compiled again and replaced.
    let entry = |arch: &str, d: &[(String, String)]| {
        dir.join(entry_name(
            m.name,
            arch,
            &cache_key(m, arch, d, "nvrtc 13.0"),
            true,
        ))
    };
    let p = entry("sm_90a", &d);
    let sound = std::fs::read(&p).unwrap();
    assert_eq!(unseal(&sound), Some(&a[..]));
    let mut flipped = sound.clone();
    flipped[1] ^= 0x10;
    let damaged: [Vec<u8>; 5] = [
        Vec::new(),
        sound[..sound.len() - 1].to_vec(),
        sound[..sound.len() / 2].to_vec(),
        flipped,
        a.clone(),
    ];
    for (i, bytes) in damaged.iter().enumerate() {
        std::fs::write(&p, bytes).unwrap();
        let calls = c.calls.load(Ordering::SeqCst);
        let (code, o) = compile_cached(&c, m, "sm_90a", &d, Some(&dir)).unwrap();
        assert_eq!((o, &code), (Origin::Compiled, &a), "case {i}");
        assert_eq!(c.calls.load(Ordering::SeqCst), calls + 1, "case {i}");
        assert_eq!(
            std::fs::read(&p).unwrap(),
            sound,
            "case {i}: the entry replaced"
        );
    }
    // No cache folder: always compiles.
    let (_, o) = compile_cached(&c, m, "sm_90a", &d, None).unwrap();
    assert_eq!(o, Origin::Compiled);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A code object that the driver refuses is compiled again once where it came from the cache
/// (and the new one loaded); a fresh compilation's refusal is the error.
#[test]
fn a_refused_cached_object_is_rebuilt_once() {
    let refuse_old = |c: &[u8]| match c {
        b"new" => Ok(7),
        _ => Err(GpuError::Invalid("image refused".into())),
    };
    let mut warned = Vec::new();
    let r = load_or_rebuild(
        (b"old".to_vec(), Origin::Cache),
        refuse_old,
        || Ok(b"new".to_vec()),
        |e| warned.push(e.to_string()),
    );
    assert_eq!(r.unwrap(), (7, Origin::Compiled));
    assert!(
        warned.len() == 1 && warned[0].contains("image refused"),
        "{warned:?}"
    );
    // Loaded from the cache: nothing rebuilt.
    let r = load_or_rebuild(
        (b"new".to_vec(), Origin::Cache),
        refuse_old,
        || -> Result<Vec<u8>> { panic!("not rebuilt") },
        |_| panic!("no warning"),
    );
    assert_eq!(r.unwrap(), (7, Origin::Cache));
    // Just compiled and refused: the driver's error, no second compile.
    let e = load_or_rebuild(
        (b"old".to_vec(), Origin::Compiled),
        refuse_old,
        || -> Result<Vec<u8>> { panic!("not rebuilt") },
        |_| panic!("no warning"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("image refused"), "{e}");
    // Rebuilt and still refused: that error.
    let e = load_or_rebuild(
        (b"old".to_vec(), Origin::Cache),
        refuse_old,
        || Ok(b"older".to_vec()),
        |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("image refused"), "{e}");
}

#[test]
fn missing_library_lists_what_was_searched() {
    let dir = tmpdir("lib");
    std::fs::create_dir_all(&dir).unwrap();
    // A file that exists but is not a library: its loader error is reported too.
    std::fs::write(dir.join("libds4bogus.so.1"), b"not an ELF").unwrap();
    let err = ds4_gpu::loader::open(
        "bogus",
        &["libds4bogus.so.1", "libds4none.so"],
        std::slice::from_ref(&dir),
        false,
    )
    .err()
    .expect("cannot load");
    let msg = err.to_string();
    assert!(matches!(err, GpuError::LibraryNotFound { .. }));
    assert!(
        msg.contains(&dir.join("libds4bogus.so.1").display().to_string()),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("{} (absent)", dir.join("libds4none.so").display())),
        "{msg}"
    );
    assert!(msg.contains("system loader"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gcn_arch_is_found_in_properties() {
    let mut props = vec![0u8; 1472];
    props[..12].copy_from_slice(b"gfx-ish name"); // inside the name field: ignored
    props[1160..1160 + 21].copy_from_slice(b"gfx90a:sramecc+:xnack");
    assert_eq!(
        ds4_gpu::hip::find_gcn_arch(&props).as_deref(),
        Some("gfx90a")
    );
    let mut p2 = vec![0u8; 900];
    p2[700..707].copy_from_slice(b"gfx1030");
    assert_eq!(ds4_gpu::hip::find_gcn_arch(&p2).as_deref(), Some("gfx1030"));
    assert_eq!(ds4_gpu::hip::find_gcn_arch(&[0u8; 600]), None);
}

#[test]
fn arch_names_and_defines() {
    assert_eq!(cuda_arch(8, 0), "sm_80");
    assert_eq!(cuda_arch(9, 0), "sm_90a");
    assert_eq!(cuda_arch(10, 0), "sm_100a");
    assert_eq!(hip_default_warp("gfx90a"), 64);
    assert_eq!(hip_default_warp("gfx942"), 64);
    assert_eq!(hip_default_warp("gfx1030"), 32);
    assert_eq!(hip_default_warp("gfx1100"), 32);
    let d = hip_defines("gfx90a:sramecc+", 64);
    assert!(d.contains(&("DS4_GFX".into(), "0x90a".into())));
    assert!(d.contains(&("DS4_WARP".into(), "64".into())));
}

#[test]
fn backend_names_parse() {
    use ds4_gpu::Backend;
    assert_eq!("cuda".parse::<Backend>().unwrap(), Backend::Cuda);
    assert_eq!("rocm".parse::<Backend>().unwrap(), Backend::Rocm);
    assert_eq!("auto".parse::<Backend>().unwrap(), Backend::Auto);
    assert!("metal"
        .parse::<Backend>()
        .unwrap_err()
        .to_string()
        .contains("metal"));
}

/// Host-memory ranges to page-lock: widened to whole pages of the host's size (read from the
/// system, not assumed: 64 KiB pages on many AArch64 servers), merged where they touch.
#[test]
fn registered_ranges_are_whole_pages_of_the_hosts_size() {
    let page = ds4_gpu::gpu::host_page();
    assert!(page.is_power_of_two() && page >= 4096, "{page}");
    #[cfg(target_os = "linux")]
    if let Ok(out) = std::process::Command::new("getconf")
        .arg("PAGESIZE")
        .output()
    {
        let want: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        assert_eq!(page, want, "getconf PAGESIZE");
    }
    let buf = vec![0u8; 1 << 20];
    let base = buf.as_ptr() as usize;
    for page in [4096usize, 16384, 65536] {
        // Two ranges inside one page merge; one ending on the next's page merges with it; a
        // distant one stays apart; an empty one is dropped.
        let r = [
            &buf[10..20],
            &buf[30..40],
            &buf[200_000..200_001],
            &buf[600_000..700_000],
            &buf[5..5],
        ];
        let got = ds4_gpu::gpu::page_ranges(&r, page);
        for &(a, b) in &got {
            assert!(
                a % page == 0 && b % page == 0 && a < b,
                "{page}: {a:#x}..{b:#x}"
            );
        }
        for s in r.iter().filter(|s| !s.is_empty()) {
            let (a, b) = (s.as_ptr() as usize, s.as_ptr() as usize + s.len());
            assert_eq!(
                got.iter().filter(|&&(x, y)| x <= a && b <= y).count(),
                1,
                "{page}: {:#x}..{:#x} in exactly one range",
                a - base,
                b - base
            );
        }
        for w in got.windows(2) {
            assert!(w[0].1 < w[1].0, "{page}: sorted, apart: {got:x?}");
        }
        let want = |a: usize, b: usize| (a / page * page, b.div_ceil(page) * page);
        let (first, second) = (
            want(base + 10, base + 40),
            want(base + 200_000, base + 200_001),
        );
        assert_eq!(got[0].0, first.0);
        if first.1 >= second.0 {
            assert_eq!(
                got[0].1,
                first.1.max(second.1),
                "{page}: touching pages merge"
            );
        }
    }
}

/// A gather's or prefetch's sources become one copy per run of sources that follow each other
/// in memory (a whole stack's experts in order: one copy a stack), in order, lengths kept;
/// empty sources vanish.
#[test]
fn adjacent_sources_are_copied_as_one() {
    let buf = vec![0u8; 4096];
    let base = buf.as_ptr() as usize;
    let r = [
        &buf[0..100],
        &buf[100..300],
        &buf[300..300],
        &buf[300..400],
        &buf[1000..1100],
        &buf[0..50],
        &buf[50..60],
    ];
    let got: Vec<(usize, usize)> = ds4_gpu::gpu::runs(&r)
        .into_iter()
        .map(|(p, n)| (p as usize - base, n))
        .collect();
    assert_eq!(got, vec![(0, 400), (1000, 100), (0, 60)]);
    let total: usize = r.iter().map(|s| s.len()).sum();
    assert_eq!(got.iter().map(|g| g.1).sum::<usize>(), total);
    assert!(ds4_gpu::gpu::runs(&[]).is_empty());
}
