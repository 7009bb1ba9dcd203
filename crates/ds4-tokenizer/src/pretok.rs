//! Pre-tokenizer: a hand-coded equivalent of the `pre_tokenizer` of DeepSeek's
//! `tokenizer.json`, a Sequence of three `Split` (behavior "Isolated") steps, each
//! applied to every piece produced by the previous one (so a later regex never sees
//! across an earlier split point):
//!   1. `\p{N}{1,3}`                      numbers, in chunks of at most 3
//!   2. `[一-龥぀-ゟ゠-ヿ]+`                 runs of CJK U+4E00–9FA5, Hiragana, Katakana
//!   3. `` [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+ ``
//!      `|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`
//!      `| ?[\p{P}\p{S}]+[\r\n]*`
//!      `|\s*[\r\n]+`
//!      `|\s+(?!\S)`
//!      `|\s+`
//!
//! followed by ByteLevel (done by the BPE step). Text that no alternative matches
//! becomes a piece of its own, consecutive unmatched chars together ("Isolated").
//! Regex semantics are Oniguruma's (leftmost, first alternative that matches, greedy
//! with backtracking); each alternative's backtracking is worked out below.

use std::sync::OnceLock;
use unicode_general_category::{get_general_category, GeneralCategory as G};

/// \p{L} or \p{M}.
pub const LM: u8 = 1;
/// \p{N}.
pub const N: u8 = 2;
/// \p{P} or \p{S}.
pub const PS: u8 = 4;
/// \s: U+0009–000D, U+0085 and Zs, Zl, Zp (Oniguruma's Unicode \s).
pub const WS: u8 = 8;

fn class_slow(c: char) -> u8 {
    if matches!(c, '\t'..='\r' | '\u{85}') {
        return WS;
    }
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter
        | G::NonspacingMark
        | G::SpacingMark
        | G::EnclosingMark => LM,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => N,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation
        | G::MathSymbol
        | G::CurrencySymbol
        | G::ModifierSymbol
        | G::OtherSymbol => PS,
        G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => WS,
        _ => 0,
    }
}

/// Class bits of every BMP code point (surrogates: 0), built once.
fn bmp_table() -> &'static [u8] {
    static T: OnceLock<Box<[u8]>> = OnceLock::new();
    T.get_or_init(|| {
        (0u32..0x10000)
            .map(|cp| char::from_u32(cp).map_or(0, class_slow))
            .collect()
    })
}

/// Character classes used by the split regexes.
#[derive(Clone, Copy)]
pub struct Classes {
    bmp: &'static [u8],
}

impl Default for Classes {
    fn default() -> Self {
        Classes { bmp: bmp_table() }
    }
}

impl Classes {
    #[inline]
    pub fn of(&self, c: char) -> u8 {
        let cp = c as usize;
        if cp < 0x10000 {
            self.bmp[cp]
        } else {
            class_slow(c)
        }
    }
}

#[inline]
fn is_cjk(c: char) -> bool {
    matches!(c, '\u{4E00}'..='\u{9FA5}' | '\u{3040}'..='\u{309F}' | '\u{30A0}'..='\u{30FF}')
}

#[inline]
fn is_ascii_punct(c: char) -> bool {
    c.is_ascii_punctuation()
}

/// Char starting at byte `i` of `s` (which must be a char boundary) and its UTF-8 length.
#[inline]
fn char_at(s: &str, i: usize) -> (char, usize) {
    let b = s.as_bytes()[i];
    if b < 0x80 {
        return (b as char, 1);
    }
    // SAFETY-free slow path: `s[i..]` is valid UTF-8 starting at a boundary.
    let c = s[i..].chars().next().unwrap_or('\u{FFFD}');
    (c, c.len_utf8())
}

/// Splits `text` into pre-tokenizer pieces, calling `emit` for each non-empty piece in order.
pub fn split(text: &str, cls: &Classes, emit: &mut impl FnMut(&str)) {
    stage1(text, cls, emit);
}

/// `\p{N}{1,3}` isolated.
fn stage1(s: &str, cls: &Classes, emit: &mut impl FnMut(&str)) {
    let b = s.as_bytes();
    let mut i = 0;
    let mut span = 0; // start of the current non-number span
    while i < b.len() {
        // ASCII fast path: only '0'..='9' are numbers.
        if b[i] < 0x80 {
            if !b[i].is_ascii_digit() {
                i += 1;
                continue;
            }
        } else {
            let (c, l) = char_at(s, i);
            if cls.of(c) & N == 0 {
                i += l;
                continue;
            }
        }
        if span < i {
            stage2(&s[span..i], cls, emit);
        }
        let start = i;
        let mut k = 0;
        while k < 3 && i < b.len() {
            let (c, l) = char_at(s, i);
            if cls.of(c) & N == 0 {
                break;
            }
            i += l;
            k += 1;
        }
        emit(&s[start..i]); // a 1-3 digit piece: no stage-2/3 regex matches digits
        span = i;
    }
    if span < b.len() {
        stage2(&s[span..], cls, emit);
    }
}

/// `[一-龥぀-ゟ゠-ヿ]+` isolated.
fn stage2(s: &str, cls: &Classes, emit: &mut impl FnMut(&str)) {
    let b = s.as_bytes();
    // All chars of the ranges are 3-byte UTF-8 with a lead byte in E3..=E9.
    let maybe_cjk = |x: u8| (0xE3..=0xE9).contains(&x);
    if !b.iter().any(|&x| maybe_cjk(x)) {
        return stage3(s, cls, emit);
    }
    let mut i = 0;
    let mut span = 0;
    while i < b.len() {
        if !maybe_cjk(b[i]) {
            i += 1; // continuation and other bytes never start a CJK char
            continue;
        }
        let (c, l) = char_at(s, i);
        if !is_cjk(c) {
            i += l;
            continue;
        }
        if span < i {
            stage3(&s[span..i], cls, emit);
        }
        let start = i;
        while i < b.len() {
            let (c, l) = char_at(s, i);
            if !is_cjk(c) {
                break;
            }
            i += l;
        }
        // The run still goes through stage 3 (it may hold kana punctuation such as ・ or ゠).
        stage3(&s[start..i], cls, emit);
        span = i;
    }
    if span < b.len() {
        stage3(&s[span..], cls, emit);
    }
}

/// End (byte offset) of the run of chars from `i` whose class has a bit of `mask`.
#[inline]
fn run(s: &str, mut i: usize, cls: &Classes, mask: u8) -> usize {
    while i < s.len() {
        let (c, l) = char_at(s, i);
        if cls.of(c) & mask == 0 {
            break;
        }
        i += l;
    }
    i
}

#[inline]
fn run_while(s: &str, mut i: usize, f: impl Fn(u8) -> bool) -> usize {
    let b = s.as_bytes();
    while i < b.len() && f(b[i]) {
        i += 1;
    }
    i
}

/// The big alternation, isolated. See the module docs.
fn stage3(s: &str, cls: &Classes, emit: &mut impl FnMut(&str)) {
    let n = s.len();
    let mut i = 0;
    let mut gap: Option<usize> = None; // start of pending unmatched chars
    while i < n {
        let (c0, l0) = char_at(s, i);
        let k0 = cls.of(c0);
        let j = i + l0;
        let (c1, k1) = if j < n {
            let (c, _) = char_at(s, j);
            (Some(c), cls.of(c))
        } else {
            (None, 0)
        };
        let end = match_at(s, i, c0, k0, j, c1, k1, cls);
        match end {
            Some(e) => {
                if let Some(g) = gap.take() {
                    emit(&s[g..i]);
                }
                emit(&s[i..e]);
                i = e;
            }
            None => {
                gap.get_or_insert(i);
                i = j;
            }
        }
    }
    if let Some(g) = gap {
        emit(&s[g..]);
    }
}

/// End of the regex match starting at byte `i` (char `c0`, class `k0`, next char at
/// byte `j` is `c1` with class `k1`), or None if no alternative matches there.
#[allow(clippy::too_many_arguments)]
#[inline]
fn match_at(
    s: &str,
    i: usize,
    c0: char,
    k0: u8,
    j: usize,
    c1: Option<char>,
    k1: u8,
    cls: &Classes,
) -> Option<usize> {
    let n = s.len();
    // 1. ASCII punct + ASCII letters.
    if is_ascii_punct(c0) && c1.is_some_and(|c| c.is_ascii_alphabetic()) {
        return Some(run_while(s, j, |b| b.is_ascii_alphabetic()));
    }
    // 2. [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ : an optional prefix char (which may itself
    // be a mark) then the letter/mark run. Either way the match is the maximal L/M run.
    if k0 & LM != 0 {
        return Some(run(s, j, cls, LM));
    }
    if c0 != '\r' && c0 != '\n' && k0 & PS == 0 && k1 & LM != 0 {
        return Some(run(s, j, cls, LM));
    }
    // 3. ' '?[\p{P}\p{S}]+[\r\n]*
    let ps_start = if c0 == ' ' && k1 & PS != 0 {
        Some(j)
    } else if k0 & PS != 0 {
        Some(i)
    } else {
        None
    };
    if let Some(p) = ps_start {
        let e = run(s, p, cls, PS);
        return Some(run_while(s, e, |b| b == b'\r' || b == b'\n'));
    }
    if k0 & WS == 0 {
        return None;
    }
    // Whitespace run W = s[i..w_end]; note where its last CR/LF ends and where its last char starts.
    let mut w_end = i;
    let mut last_nl_end = None;
    let mut last_start = i;
    let mut count = 0usize;
    while w_end < n {
        let (c, l) = char_at(s, w_end);
        if cls.of(c) & WS == 0 {
            break;
        }
        last_start = w_end;
        w_end += l;
        count += 1;
        if c == '\r' || c == '\n' {
            last_nl_end = Some(w_end);
        }
    }
    // 4. \s*[\r\n]+ : \s* backtracks to the last CR/LF of the run.
    if let Some(e) = last_nl_end {
        return Some(e);
    }
    // 5. \s+(?!\S) : whole run at the end of the piece, else all but its last char.
    if w_end == n {
        return Some(n);
    }
    if count >= 2 {
        return Some(last_start);
    }
    // 6. \s+
    Some(w_end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(s: &str) -> Vec<String> {
        let mut v = Vec::new();
        split(s, &Classes::default(), &mut |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn splits_like_the_reference_regexes() {
        // Expected splits worked out from the tokenizer.json regexes by hand.
        assert_eq!(pieces("Hello world"), ["Hello", " world"]);
        assert_eq!(pieces("    int x;"), ["   ", " int", " x", ";"]);
        assert_eq!(pieces("a.com"), ["a", ".com"]);
        assert_eq!(pieces("x;\n\ny"), ["x", ";\n\n", "y"]);
        assert_eq!(pieces("1234567"), ["123", "456", "7"]);
        assert_eq!(pieces("  123"), ["  ", "123"]); // stage 1 cut: the run is at a piece end
        assert_eq!(pieces("a \n  b"), ["a", " \n", " ", " b"]);
        assert_eq!(pieces("你好world"), ["你好", "world"]);
        assert_eq!(pieces("ア・イ"), ["ア", "・", "イ"]);
        assert_eq!(pieces("👨\u{200D}👩"), ["👨", "\u{200D}", "👩"]);
        assert_eq!(pieces("e\u{301}"), ["e\u{301}"]);
        assert_eq!(pieces(" ..\r\nx"), [" ..\r\n", "x"]);
        assert_eq!(pieces("\t\tx"), ["\t", "\tx"]);
        assert_eq!(pieces(".café"), [".caf", "é"]);
        assert_eq!(pieces(""), Vec::<String>::new());
    }
}
