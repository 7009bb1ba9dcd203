#!/usr/bin/env python3
"""Generate the tokenizer oracle corpus (seeded) and the expected ids from HF `tokenizers`.

    pip install tokenizers   # reference implementation (0.23.3 used for the committed file)
    python3 tools/tokenizer/make_corpus.py PATH/TO/V4/tokenizer.json

Writes crates/ds4-tokenizer/tests/data/oracle.jsonl.gz, one JSON object per line:
    {"t": text, "s": ids, "p": ids}
  "s" = Tokenizer.encode(text, add_special_tokens=False).ids with the full tokenizer.json
        (HF always splits out *added* tokens, special or not: this is encode_with_specials);
  "p" = the same with added_tokens removed (pure byte-level BPE: our plain encode);
        omitted when equal to "s".
See export_vocab.py for where tokenizer.json comes from.
"""
import gzip
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

SEED = 20261130
OUT = Path(__file__).resolve().parents[2] / "crates/ds4-tokenizer/tests/data/oracle.jsonl.gz"

CHAT = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
        "<think>", "</think>", "｜DSML｜"]

CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import numpy as np\nx = np.arange(10_000).reshape(100, -1)\nprint(x.T @ x)\n",
    "class Foo(Base):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, *args, **kw):\n        super().__init__(*args, **kw)\n        self._cache: dict[str, int] = {}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + Send> Iterator for Iter<'a, T> {\n\ttype Item = &'a T;\n\tfn next(&mut self) -> Option<Self::Item> { self.inner.next() }\n}\n",
    "#include <stdio.h>\nint main(int argc, char **argv) {\n    for (int i = 0; i < argc; i++) printf(\"%s\\n\", argv[i]);\n    return 0;\n}\n",
    "const add = (a, b) => a + b;\nexport default async function handler(req, res) {\n  const { id } = req.query;\n  res.status(200).json({ id, ok: true });\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tgo func() { ch <- 42 }()\n\tfmt.Println(<-ch)\n}\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Test</title></head>\n<body><div class=\"a b\">&nbsp;&lt;x&gt;</div></body>\n</html>\n",
    "SELECT u.id, COUNT(*) AS n\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\nWHERE u.created_at >= '2024-01-01'\nGROUP BY u.id\nHAVING n > 5;\n",
    "{\"name\": \"ds4\", \"version\": \"0.1.0\", \"tags\": [\"a\", \"b\"], \"nested\": {\"x\": 1.5e-3, \"y\": null}}",
    "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone 2>&1 | tee log.txt\n",
    "public static void main(String[] args) throws IOException {\r\n    System.out.println(\"Hello\");\r\n}\r\n",
    "    x += 1;\n        y -= 2;\n\t\tz *= 3;\n",
    "if (a&&b||!c) { return a<<2 >>> 1 ^ ~b; } // comment\n/* block\n * comment */\n",
    "@decorator\ndef f(x: int = 0, /, *, y: str = 'a') -> None: ...\n",
    "let re = /^[a-z0-9_.+-]+@[a-z0-9-]+\\.[a-z]{2,}$/i;\n",
    "\\documentclass{article}\n\\begin{document}\n$E = mc^2$ and $\\sum_{i=1}^{n} i = \\frac{n(n+1)}{2}$\n\\end{document}\n",
    "diff --git a/x.rs b/x.rs\n@@ -1,3 +1,4 @@\n-old line\n+new line\n context\n",
    "key: value\nlist:\n  - item1\n  - item2\nmap: {a: 1, b: [2, 3]}\n",
    "https://example.com/path/to/page?query=1&lang=en#section-2 user.name@mail.example.org",
]
PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom...",
    "Dr. Smith's patients — all 1,234 of them — weren't happy; \"why?\" they asked.",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong said: 'That's one small step for man.'",
    "Mr. O'Neil paid $3.50 (plus 7% tax) on 2024-03-15 at 10:30am.",
    "ALL CAPS SENTENCE WITH ACRONYMS LIKE NASA, HTTP/2, and GPT-4o.",
    "Hyphenated-words, e-mail, co-operate, state-of-the-art, well-known.",
    "Naïve café résumé façade coöperate Zürich São Paulo El Niño.",
]
MULTI = [
    "深度求索是一家人工智能公司。我们的目标是探索通用人工智能的本质。",
    "今天天气很好，我们去公园散步吧！你觉得怎么样？",
    "機器學習（Machine Learning）是人工智慧的一個分支。",
    "日本語のテキストです。ひらがなとカタカナ、そして漢字が混ざっています。",
    "東京タワーは１９５８年に完成しました。ｶﾀｶﾅ半角もあります。",
    "한국어 텍스트입니다. 안녕하세요, 만나서 반갑습니다!",
    "مرحبا بالعالم! هذه جملة باللغة العربية مع أرقام ١٢٣٤٥.",
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है, संख्या १२३ के साथ।",
    "Привет, мир! Это предложение на русском языке. Ёлка, щука, ЪЬ.",
    "Γειά σου Κόσμε! Αυτή είναι μια πρόταση στα ελληνικά.",
    "สวัสดีชาวโลก นี่คือประโยคภาษาไทย",
    "שלום עולם! זה משפט בעברית.",
    "Xin chào thế giới! Đây là một câu tiếng Việt.",
    "Türkçe: İstanbul'da ığdır şişe çöp.",
    "Ελληνικά + English + 中文 + русский + العربية mixed in one line.",
    "ქართული ენა, Հայերեն լեզու, አማርኛ ቋንቋ",
    "தமிழ் மொழி, తెలుగు భాష, ಕನ್ನಡ, മലയാളം, বাংলা ভাষা",
]
EMOJI = [
    "👍", "👍🏽", "👨‍👩‍👧‍👦", "🧑🏿‍💻", "🏳️‍🌈", "🇫🇷🇯🇵", "❤️", "✌🏻", "👩‍❤️‍💋‍👨", "🤖🚀🔥💯",
    "😀😃😄😁", "🙂 ok", "#️⃣", "1️⃣2️⃣", "🫠🫶", "🐈‍⬛",
]
SYMBOLS = [
    "→ ← ↑ ↓ ⇒ ⇔ ∀x∈ℝ: x²≥0", "© ® ™ § ¶ † ‡ • …", "€100 £50 ¥1000 ₹20 ₿0.5", "«quoted» „German“ “curly” ‘single’",
    "½ ¼ ¾ ⅓ ⅔ ² ³ ¹", "α+β=γ, Δx·∂y", "☀☁☂☃★☆♠♣♥♦", "─│┌┐└┘├┤┬┴┼", "、。「」『』【】〈〉《》", "！？：；（）～",
    "¡Hola! ¿Qué tal?", "‰ ‱ ′ ″ ‴", "·•‣⁃", "\u00a0non\u00a0breaking\u00a0space", "zero\u200bwidth\u200bspace",
    "soft\u00adhyphen", "e\u0301 a\u0300 o\u0308 n\u0303", "\u0301\u0302 lone combining", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "ﬁ ﬂ ﬀ ligatures", "Ⅻ Ⅳ ⅷ roman", "𝐀𝐁𝐂 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚", "\u2028line sep\u2029para sep", "\u3000ideographic\u3000space",
    "tab\tseparated\tvalues\t", "\x00nul\x01\x02ctl\x7f", "\ufeffBOM", "\ue000\uf8ff private", "\U0001F9D1\u200d\U0001F384",
]
LOOKALIKES = [
    "<|User|>", "<｜User", "User｜>", "</think", "<think", "think>", "<thinking>", "</ think>", "｜DSML｜ inside", "｜DSML |",
    "<｜DSML｜tool_calls>", "</｜DSML｜invoke>", "<｜begin▁of▁sentence｜", "<|begin_of_sentence|>", "<｜end▁of▁sentence｜>>",
    "<<think>>", "<think></think>", "<｜Assistant｜><think>", "<|EOT|>", "<｜tool▁sep｜>", "<｜place▁holder▁no▁7｜>",
    "<dsml:", "</dsml:call>", "<｜/table>｜DSML｜", "<｜latest_reminder｜>", "<|place_holder_mm_span_0100|>", "｜", "▁",
    "<｜fim▁begin｜>def f():<｜fim▁hole｜>\n<｜fim▁end｜>",
]
WS = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \t ", "\r", "\n\n\n\n", "    \n    "]
WORDS = ("the of and to in is that for it as with was on be by at this from or an are not have but had they "
         "you which one were all we when there can more if out so what up about into than them some time only "
         "function return value error data model token string number list object class import print self").split()


def rand_number(r):
    k = r.choice([1, 2, 3, 4, 5, 7, 10, 16, 25])
    s = "".join(r.choice("0123456789") for _ in range(k))
    return r.choice([s, s + "." + s[:3], "-" + s, s[:2] + "," + s, "0x" + s, s + "e-5", "١٢٣" + s, "１２３" + s, "Ⅻ" + s])


def rand_chars(r):
    blocks = [(0x20, 0x7f), (0xa0, 0x250), (0x300, 0x370), (0x370, 0x530), (0x590, 0x700), (0x900, 0xe00),
              (0x1100, 0x1200), (0x2000, 0x2c00), (0x3000, 0x3100), (0x4e00, 0x9fff), (0xac00, 0xd7a3),
              (0xf900, 0xfb00), (0xfe00, 0xff00), (0xff00, 0xfff0), (0x10000, 0x10200), (0x1d400, 0x1d800),
              (0x1f000, 0x1fb00), (0x20000, 0x20100), (0xe0000, 0xe0080), (0xf0000, 0xf0010), (0x0, 0x20)]
    out = []
    for _ in range(r.randint(1, 24)):
        a, b = r.choice(blocks)
        c = r.randrange(a, b)
        if 0xd800 <= c < 0xe000:
            continue
        out.append(chr(c))
    return "".join(out)


def rand_mix(r):
    parts = []
    for _ in range(r.randint(1, 12)):
        k = r.random()
        if k < 0.25:
            parts.append(r.choice(WORDS))
        elif k < 0.35:
            parts.append(r.choice(WS))
        elif k < 0.45:
            parts.append(rand_number(r))
        elif k < 0.55:
            s = r.choice(MULTI)
            i = r.randrange(len(s))
            parts.append(s[i:i + r.randint(1, 12)])
        elif k < 0.62:
            parts.append(r.choice(EMOJI))
        elif k < 0.70:
            parts.append(r.choice(SYMBOLS)[: r.randint(1, 10)])
        elif k < 0.76:
            parts.append(r.choice(LOOKALIKES))
        elif k < 0.80:
            parts.append(r.choice(CHAT))
        elif k < 0.88:
            s = r.choice(CODE)
            i = r.randrange(len(s))
            parts.append(s[i:i + r.randint(1, 40)])
        elif k < 0.94:
            parts.append(rand_chars(r))
        else:
            parts.append(r.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") * r.randint(1, 4) + r.choice(WORDS))
    sep = r.choice(["", " ", "", "\n", ""])
    return sep.join(parts)


def corpus(added):
    r = random.Random(SEED)
    out = [""]
    for pool in (CODE, PROSE, MULTI, EMOJI, SYMBOLS, LOOKALIKES, WS, CHAT):
        out += pool
    for pool in (CODE, PROSE, MULTI):
        out += [s.replace("\n", "\r\n") for s in pool] + [" " + s for s in pool] + [s.upper() for s in pool]
    out += [c * n for c in " \t\n" for n in (1, 2, 3, 5, 17, 64)] + [" " * n + "x" for n in range(1, 10)]
    out += ["9" * n for n in range(1, 40)] + ["a" + "1" * n + "b" for n in range(1, 12)] + [str(2 ** n) for n in range(0, 200, 7)]
    out += [" " * n + "123" for n in range(0, 5)] + ["x" + " " * n + "\n" for n in range(0, 5)]
    # long single pieces (exercise the O(n log n) merge loop used above 64 bytes)
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    out += ["".join(r.choice(b64) for _ in range(n)) for n in (65, 100, 300, 1000, 4000)]
    out += ["a" * 200, "ab" * 150, " " * 300 + "x", "\n" * 100, "-" * 120, "=" * 80 + "\n", "🙂" * 40, "深" * 100,
            "ا" * 70 + "ب", "Supercalifragilisticexpialidocious" * 4, "x" + "\u0301" * 80, "'" * 70 + "s"]
    # every added token once, in light context (HF splits them all out)
    out += [f"a{tok}b" if i % 2 else f" {tok}\n" for i, tok in enumerate(added)]
    # a rendered chat prompt, like the server builds
    out.append("<｜begin▁of▁sentence｜>You are terse.<｜User｜>Show the config<｜Assistant｜><think>Need to read it.</think>\n\n"
               "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">"
               "config.toml</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜>"
               "<tool_result>port = 80</tool_result><｜Assistant｜><think>")
    # short strings over an adversarial alphabet: every kind of whitespace, marks, ZWJ,
    # non-ASCII digits/punct, kana punctuation, specials and their fragments
    tricky = list(" \t\r\n\u000b\u000c\u0085\u00a0\u3000\u2028\u2029\u200d\u200b\ufeff\x00\x01.,;!?'\"-_()[]{}<>|/\\"
                  "aZzé\u0301\u0308ß1٣５Ⅻ²🙂👍🏽❤\ufe0fア・ー々〆゠深한ب\ue000") + CHAT + ["<｜", "｜>", "▁"]
    out += ["".join(r.choice(tricky) for _ in range(r.randint(1, 25))) for _ in range(1000)]
    while len(out) < 4300:
        out.append(rand_mix(r))
    # long documents (for the benchmark mix too)
    for _ in range(40):
        out.append("".join(r.choice(CODE + PROSE + MULTI) + r.choice(WS) for _ in range(r.randint(5, 30))))
    return out


def main():
    path = sys.argv[1]
    full = Tokenizer.from_file(path)
    j = json.loads(Path(path).read_text())
    added = [a["content"] for a in j["added_tokens"]]
    j["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(j))
    texts = corpus(added)
    n_diff = 0
    lines = []
    for t in texts:
        s = full.encode(t, add_special_tokens=False).ids
        p = plain.encode(t, add_special_tokens=False).ids
        rec = {"t": t, "s": s}
        if p != s:
            rec["p"] = p
            n_diff += 1
        lines.append(json.dumps(rec, ensure_ascii=False))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    OUT.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    print(f"wrote {OUT}: {len(texts)} strings, {sum(len(t.encode()) for t in texts)} bytes, "
          f"{n_diff} with added tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
