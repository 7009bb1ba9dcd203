#!/usr/bin/env python3
"""Write the ds4-quant test fixtures from the pip package `gguf` (the independent oracle).

For each type: `<T>.blocks` = random *valid* raw blocks (finite f16 scales, random codes) and
`<T>.expected.gz` = gzip of the little-endian f32 output of `gguf.quants.dequantize`.
For the reference quantisers: `quant_input.f32` (random f32) and `<T>.quantized` =
`gguf.quants.quantize` (F16: numpy astype) of that input.

Usage:  python3 tools/quant/gen_fixtures.py   (needs `pip install gguf numpy`; deterministic)
"""
import gzip
import os

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "ds4-quant", "tests", "data")
rng = np.random.default_rng(20261130)


def finite_f16(n: int) -> np.ndarray:
    """n random finite f16 bit patterns: half from all finite patterns (incl. subnormals, ±0),
    half 'realistic' positive scales."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # exponent 31 -> 0
    realistic = (np.abs(rng.normal(size=n)) * 0.01).astype(np.float16).view(np.uint16)
    pick = rng.random(n) < 0.5
    return np.where(pick, bits, realistic).astype(np.uint16)


def blocks(n_blocks: int, size: int, f16_fields: list[int]) -> np.ndarray:
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in f16_fields:
        b[:, off:off + 2] = finite_f16(n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return b


def write(name: str, data: bytes) -> None:
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def gz(name: str, data: bytes) -> None:
    # mtime=0 keeps the output byte-identical between runs.
    with open(os.path.join(OUT, name), "wb") as f:
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0) as g:
            g.write(data)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    cases = {}
    # Scalar types: every special class appears (F16: subnormals, ±inf, NaN; BF16 likewise).
    f32 = (rng.normal(size=1024) * 10.0 ** rng.integers(-44, 37, 1024)).astype(np.float32)
    f32[:6] = [0.0, -0.0, np.inf, -np.inf, 1e-45, -3.4e38]
    cases[T.F32] = f32.view(np.uint8).reshape(-1, 4)
    h = rng.integers(0, 1 << 16, size=2048, dtype=np.uint16)
    # ±0, ±inf, quiet and signalling NaN, smallest/largest subnormal, largest finite.
    h[:10] = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7D01, 0x0001, 0x83FF, 0x7BFF, 0xFBFF]
    cases[T.F16] = h.view(np.uint8).reshape(-1, 2)
    b = rng.integers(0, 1 << 16, size=2048, dtype=np.uint16)
    b[:8] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x807F]
    cases[T.BF16] = b.view(np.uint8).reshape(-1, 2)
    cases[T.Q8_0] = blocks(256, 34, [0])
    cases[T.Q2_K] = blocks(128, 84, [80, 82])
    cases[T.Q4_K] = blocks(128, 144, [0, 2])
    cases[T.IQ2_XXS] = blocks(128, 66, [0])
    for t, raw in cases.items():
        raw = np.ascontiguousarray(raw).reshape(-1)
        out = quants.dequantize(raw, t)
        out = np.asarray(out, dtype=np.float32).reshape(-1)
        write(f"{t.name}.blocks", raw.tobytes())
        gz(f"{t.name}.expected.gz", out.astype("<f4").tobytes())
        print(f"{t.name}: {raw.size} bytes -> {out.size} values")

    # Reference quantisers (ggml round-half-away Q8_0, RNE BF16 with NaN quieting, RNE F16).
    x = (rng.normal(size=2048) * np.exp(rng.normal(size=2048) * 2)).astype(np.float32)
    x[:4] = [0.0, -0.0, 65504.0, 1e-8]
    x[32:64] = 0.0  # an all-zero Q8_0 block
    write("quant_input.f32", x.astype("<f4").tobytes())
    write("Q8_0.quantized", quants.quantize(x, T.Q8_0).tobytes())
    write("BF16.quantized", quants.quantize(x, T.BF16).tobytes())
    write("F16.quantized", x.astype(np.float16).tobytes())


if __name__ == "__main__":
    main()
