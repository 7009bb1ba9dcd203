//! Tensor parallelism's weight parts (`WeightSource::rows` / `cols`, `ds4_backend::shard`) on
//! the tiny GGUF: a rank's rows / columns compute exactly that part of the whole product, and
//! parts that are not whole rows or quant blocks are clear errors naming the tensor.

use ds4_backend::{Backend, Part, WeightKind};
use ds4_cpu::CpuBackend;
use ds4_gguf::GgufFile;
use ds4_model::forward::{rope_tables, FileSource, WeightSource};
use ds4_model::{bind_main, HParams};
use std::path::PathBuf;
use std::sync::Arc;

fn tiny() -> Option<PathBuf> {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/oracle/tiny-q.gguf");
    if p.exists() {
        Some(p)
    } else {
        println!("skipped: no oracle fixture at {}", p.display());
        None
    }
}

/// The tiny model's bound file and a CPU backend for it.
#[allow(clippy::type_complexity)]
fn setup() -> Option<(
    Arc<GgufFile>,
    [(Arc<GgufFile>, ds4_model::WeightDir); 1],
    CpuBackend,
)> {
    let path = tiny()?;
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let hp = HParams::from_meta(file.as_ref()).unwrap();
    let files = [(file.clone(), bind_main(&file, &hp).unwrap())];
    Some((file, files, CpuBackend::new(rope_tables(&hp))))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn rows_and_columns_compute_their_part_of_the_product() {
    let Some((file, files, b)) = setup() else {
        return;
    };
    let mut prog = |_: usize, _: usize| {};
    let mut src = FileSource::new(&files, &mut prog);
    let name = "blk.1.attn_output_b.weight"; // [cols = o_groups * o_lora_rank, rows = n_embd]
    let t = file.tensor(name).unwrap().clone();
    let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
    let full = src.weight(&b, name, WeightKind::Matrix).unwrap();
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let mut y = b.alloc(rows);
    b.matmul(&full, Part::All, &b.upload(&x), 1, &mut y);
    let y = b.download(&y, rows);
    // Columns: the second half's product is the full product with the first half's x at 0.
    let (c0, cn) = (cols / 2, cols / 2);
    let part = src.cols(&b, name, c0, cn).unwrap();
    let mut yp = b.alloc(rows);
    b.matmul(&part, Part::All, &b.upload(&x[c0..]), 1, &mut yp);
    let mut xz = x.clone();
    xz[..c0].iter_mut().for_each(|v| *v = 0.0);
    let mut yz = b.alloc(rows);
    b.matmul(&full, Part::All, &b.upload(&xz), 1, &mut yz);
    let d = max_diff(&b.download(&yp, rows), &b.download(&yz, rows));
    println!("{name} columns {c0}..{}: max |Δ| {d:e}", c0 + cn);
    assert!(d <= 1e-5, "{d}");
    // Rows: the last quarter of the outputs.
    let (r0, rn) = (rows * 3 / 4, rows / 4);
    let part = src.rows(&b, name, WeightKind::Matrix, r0, rn).unwrap();
    let mut yr = b.alloc(rn);
    b.matmul(&part, Part::All, &b.upload(&x), 1, &mut yr);
    let d = max_diff(&b.download(&yr, rn), &y[r0..]);
    println!("{name} rows {r0}..{}: max |Δ| {d:e}", r0 + rn);
    assert_eq!(d, 0.0, "a row part is the same rows' bytes");
    // Sinks (a vector): elements.
    let sinks = src
        .rows(&b, "blk.1.attn_sinks.weight", WeightKind::Vector, 2, 2)
        .unwrap();
    let all = src
        .weight(&b, "blk.1.attn_sinks.weight", WeightKind::Vector)
        .unwrap();
    let (ds4_cpu::CpuWeight::F32(p), ds4_cpu::CpuWeight::F32(a)) = (&sinks, &all) else {
        panic!("sinks are f32 vectors on the CPU");
    };
    assert_eq!(p[..], a[2..4]);
}

#[test]
fn parts_that_are_not_whole_rows_or_blocks_are_errors() {
    let Some((file, files, b)) = setup() else {
        return;
    };
    let mut prog = |_: usize, _: usize| {};
    let mut src = FileSource::new(&files, &mut prog);
    let name = "blk.1.attn_output_b.weight";
    let cols = file.tensor(name).unwrap().dims[0] as usize;
    for (c0, n, why) in [(1, 32, "whole"), (0, cols + 32, "whole"), (0, 0, "whole")] {
        let e = src.cols(&b, name, c0, n).err().expect("a bad column part");
        assert!(e.contains(name) && e.contains(why), "{e}");
    }
    let rows = file.tensor(name).unwrap().dims[1] as usize;
    let e = src
        .rows(&b, name, WeightKind::Matrix, rows - 1, 2)
        .err()
        .expect("rows past the end");
    assert!(e.contains(name) && e.contains("rows"), "{e}");
    let e = src
        .cols(&b, "blk.1.attn_sinks.weight", 0, 2)
        .err()
        .expect("columns of a vector");
    assert!(e.contains("not a matrix"), "{e}");
    let e = src
        .rows(&b, "blk.9.nope.weight", WeightKind::Matrix, 0, 1)
        .err()
        .expect("an unbound tensor");
    assert!(e.contains("not bound"), "{e}");
}
