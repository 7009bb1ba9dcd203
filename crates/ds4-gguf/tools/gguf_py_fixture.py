#!/usr/bin/env python3
"""Cross-check ds4-gguf against the pip `gguf` package (an independent implementation).

  python3 crates/ds4-gguf/tools/gguf_py_fixture.py
      writes tests/data/gguf_py.gguf with gguf's GGUFWriter and tests/data/gguf_py.expected:
      what gguf's GGUFReader reports (key order and types, alignment, data offset, each
      tensor's type, dims, absolute offset, size and byte sum). tests/gguf_py.rs reads both.
  python3 crates/ds4-gguf/tools/gguf_py_fixture.py --check FILE...
      reads files written by ds4-gguf (e.g. the fuzz seeds from `--example gguf_seeds`) with
      GGUFReader and prints what it sees, failing on any parse error.
"""
import os
import sys

from importlib.metadata import version

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGUFValueType as VT, GGMLQuantizationType as QT

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")


def write(path):
    w = GGUFWriter(path, "deepseek4")  # adds general.architecture first
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", -1.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "<｜begin▁of▁sentence｜>")
    w.add_key_value("t.arr.u32", [0, 4, 128], VT.ARRAY, VT.UINT32)
    w.add_key_value("t.arr.i32", [0, -4], VT.ARRAY, VT.INT32)
    w.add_key_value("t.arr.f32", [10.0, 0.5], VT.ARRAY, VT.FLOAT32)
    w.add_key_value("t.arr.str", ["Ġa", "b c", ""], VT.ARRAY, VT.STRING)
    w.add_key_value("t.arr.bool", [False, True], VT.ARRAY, VT.BOOL)
    rng = np.random.default_rng(7)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))  # dims [5, 3]
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    raw = lambda rows, nbytes: rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    w.add_tensor("q8_0", raw(2, 2 * 34), raw_dtype=QT.Q8_0)  # dims [64, 2]
    w.add_tensor("q2_k", raw(1, 84), raw_dtype=QT.Q2_K)
    w.add_tensor("iq2_xxs", raw(3, 66), raw_dtype=QT.IQ2_XXS)
    w.add_tensor("bf16", raw(1, 6), raw_dtype=QT.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def describe(path):
    r = GGUFReader(path)
    lines = [f"alignment {r.alignment}", f"data_offset {r.data_offset}"]
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue  # the reader's pseudo-fields for the header
        t = [int(x) for x in f.types]
        lines.append(f"kv {f.name} {' '.join(map(str, t))}")
    for t in r.tensors:
        dims = ",".join(str(int(d)) for d in t.shape)
        data = np.asarray(t.data).view(np.uint8)
        lines.append(
            f"tensor {t.name} {int(t.tensor_type)} {dims} {int(t.data_offset)} {int(t.n_bytes)} {int(data.astype(np.uint64).sum())}"
        )
    return lines


def main():
    if sys.argv[1:2] == ["--check"]:
        for p in sys.argv[2:]:
            print(f"== {p}")
            print("\n".join(describe(p)))
        return
    path = os.path.join(HERE, "gguf_py.gguf")
    write(path)
    with open(os.path.join(HERE, "gguf_py.expected"), "w") as f:
        f.write(f"# written by tools/gguf_py_fixture.py, read back with pip gguf {version('gguf')} GGUFReader\n")
        f.write("\n".join(describe(path)) + "\n")
        # The block geometry table: id, name, elements per block, bytes per block.
        for t, (elems, nbytes) in gguf.GGML_QUANT_SIZES.items():
            f.write(f"type {int(t)} {t.name} {elems} {nbytes}\n")
    print(open(os.path.join(HERE, "gguf_py.expected")).read())


if __name__ == "__main__":
    main()
