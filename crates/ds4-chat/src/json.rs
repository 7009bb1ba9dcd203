//! Minimal JSON scanning that keeps the client's bytes: validation, whitespace-only
//! minification (numbers/escapes are never re-formatted) and ordered object iteration
//! (duplicate keys kept). serde_json would re-serialize values, which would change
//! the prompt bytes and break KV-prefix reuse.

/// C `isspace` in the "C" locale: the whitespace DSML parsing skips and trims.
pub(crate) fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// Trims C whitespace on both ends.
pub(crate) fn trim_c_space(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii() && is_c_space(c as u8))
}

/// JSON-escapes `s` as a quoted JSON string.
pub(crate) fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("serializing a str cannot fail")
}

/// Nesting limit for the recursive scanner (deeper input is reported invalid).
const MAX_DEPTH: usize = 256;

struct Scanner<'a> {
    s: &'a [u8],
    pos: usize,
}

impl<'a> Scanner<'a> {
    fn ws(&mut self) {
        while self.pos < self.s.len() && matches!(self.s[self.pos], b' ' | b'\t' | b'\n' | b'\r') {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Skips one value (leading whitespace not included). Returns false if invalid.
    fn skip_value(&mut self, depth: usize) -> bool {
        if depth > MAX_DEPTH {
            return false;
        }
        match self.peek() {
            Some(b'"') => self.string(None),
            Some(b'{') => {
                self.pos += 1;
                self.ws();
                if self.eat(b'}') {
                    return true;
                }
                loop {
                    self.ws();
                    if !self.string(None) {
                        return false;
                    }
                    self.ws();
                    if !self.eat(b':') {
                        return false;
                    }
                    self.ws();
                    if !self.skip_value(depth + 1) {
                        return false;
                    }
                    self.ws();
                    if self.eat(b'}') {
                        return true;
                    }
                    if !self.eat(b',') {
                        return false;
                    }
                }
            }
            Some(b'[') => {
                self.pos += 1;
                self.ws();
                if self.eat(b']') {
                    return true;
                }
                loop {
                    self.ws();
                    if !self.skip_value(depth + 1) {
                        return false;
                    }
                    self.ws();
                    if self.eat(b']') {
                        return true;
                    }
                    if !self.eat(b',') {
                        return false;
                    }
                }
            }
            Some(b't') => self.lit(b"true"),
            Some(b'f') => self.lit(b"false"),
            Some(b'n') => self.lit(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => false,
        }
    }

    fn lit(&mut self, l: &[u8]) -> bool {
        if self.s[self.pos..].starts_with(l) {
            self.pos += l.len();
            true
        } else {
            false
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> bool {
        self.eat(b'-');
        if self.eat(b'0') {
            // no leading zeros
        } else if self.digits() == 0 {
            return false;
        }
        if self.eat(b'.') && self.digits() == 0 {
            return false;
        }
        if self.eat(b'e') || self.eat(b'E') {
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            if self.digits() == 0 {
                return false;
            }
        }
        true
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.pos..self.pos + 4)?;
        let h = std::str::from_utf8(h).ok()?;
        let v = u32::from_str_radix(h, 16).ok()?;
        if !h.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.pos += 4;
        Some(v)
    }

    /// Scans a string at `pos` (which must be `"`); decodes into `out` when given.
    /// Raw control characters are invalid (strict JSON); lone surrogates decode to U+FFFD.
    fn string(&mut self, mut out: Option<&mut String>) -> bool {
        if !self.eat(b'"') {
            return false;
        }
        loop {
            let start = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            if let Some(o) = out.as_deref_mut() {
                // Input came from a &str and we stopped at an ASCII byte: valid UTF-8.
                o.push_str(std::str::from_utf8(&self.s[start..self.pos]).unwrap_or("\u{fffd}"));
            }
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return true;
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = match self.peek() {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            let Some(hi) = self.hex4() else { return false };
                            let mut c = char::from_u32(hi);
                            if (0xD800..0xDC00).contains(&hi)
                                && self.s[self.pos..].starts_with(b"\\u")
                            {
                                let save = self.pos;
                                self.pos += 2;
                                match self.hex4() {
                                    Some(lo) if (0xDC00..0xE000).contains(&lo) => {
                                        c = char::from_u32(
                                            0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00),
                                        );
                                    }
                                    _ => self.pos = save,
                                }
                            }
                            if let Some(o) = out.as_deref_mut() {
                                o.push(c.unwrap_or('\u{fffd}'));
                            }
                            continue;
                        }
                        _ => return false,
                    };
                    self.pos += 1;
                    if let Some(o) = out.as_deref_mut() {
                        o.push(c);
                    }
                }
                _ => return false, // end of input or raw control character
            }
        }
    }
}

/// Removes JSON whitespace outside strings, keeping every other byte as written.
/// Only call on text already validated.
fn strip_ws(valid: &str) -> String {
    let mut out = String::with_capacity(valid.len());
    let (mut in_str, mut esc) = (false, false);
    for c in valid.chars() {
        if in_str {
            out.push(c);
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
            out.push(c);
        } else if !matches!(c, ' ' | '\t' | '\n' | '\r') {
            out.push(c);
        }
    }
    out
}

/// Validates `raw` as exactly one JSON value (surrounded by optional whitespace)
/// and returns it minified. `None` when invalid.
pub(crate) fn minify(raw: &str) -> Option<String> {
    let mut sc = Scanner {
        s: raw.as_bytes(),
        pos: 0,
    };
    sc.ws();
    let start = sc.pos;
    if !sc.skip_value(0) {
        return None;
    }
    let end = sc.pos;
    sc.ws();
    if sc.pos != raw.len() {
        return None;
    }
    Some(strip_ws(&raw[start..end]))
}

/// One member of a JSON object, in client order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ArgValue {
    /// JSON string, decoded.
    Str(String),
    /// Any other JSON value, minified.
    Json(String),
}

/// Parses `raw` as a JSON object and returns its members in order (duplicates kept).
/// `None` if `raw` is not exactly one valid JSON object.
pub(crate) fn object_members(raw: &str) -> Option<Vec<(String, ArgValue)>> {
    let mut sc = Scanner {
        s: raw.as_bytes(),
        pos: 0,
    };
    sc.ws();
    if !sc.eat(b'{') {
        return None;
    }
    let mut out = Vec::new();
    sc.ws();
    if !sc.eat(b'}') {
        loop {
            sc.ws();
            let mut key = String::new();
            if !sc.string(Some(&mut key)) {
                return None;
            }
            sc.ws();
            if !sc.eat(b':') {
                return None;
            }
            sc.ws();
            let value = if sc.peek() == Some(b'"') {
                let mut v = String::new();
                if !sc.string(Some(&mut v)) {
                    return None;
                }
                ArgValue::Str(v)
            } else {
                let start = sc.pos;
                if !sc.skip_value(1) {
                    return None;
                }
                ArgValue::Json(strip_ws(&raw[start..sc.pos]))
            };
            out.push((key, value));
            sc.ws();
            if sc.eat(b'}') {
                break;
            }
            if !sc.eat(b',') {
                return None;
            }
        }
    }
    sc.ws();
    if sc.pos != raw.len() {
        return None;
    }
    Some(out)
}

/// Byte range of the value of the first member named `key` of the JSON object `raw`
/// (the value's exact bytes, no surrounding whitespace). `None` if `raw` is not a valid
/// object or has no such member.
pub(crate) fn member_span(raw: &str, key: &str) -> Option<std::ops::Range<usize>> {
    let mut sc = Scanner {
        s: raw.as_bytes(),
        pos: 0,
    };
    sc.ws();
    if !sc.eat(b'{') {
        return None;
    }
    let mut found = None;
    sc.ws();
    if !sc.eat(b'}') {
        loop {
            sc.ws();
            let mut k = String::new();
            if !sc.string(Some(&mut k)) {
                return None;
            }
            sc.ws();
            if !sc.eat(b':') {
                return None;
            }
            sc.ws();
            let start = sc.pos;
            if !sc.skip_value(1) {
                return None;
            }
            if found.is_none() && k == key {
                found = Some(start..sc.pos);
            }
            sc.ws();
            if sc.eat(b'}') {
                break;
            }
            if !sc.eat(b',') {
                return None;
            }
        }
    }
    sc.ws();
    if sc.pos != raw.len() {
        return None;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minify_keeps_bytes_and_rejects_garbage() {
        assert_eq!(
            minify(" { \"a\" : [1 , 2.50e+3, \"x y\\u0041\"] } ").as_deref(),
            Some("{\"a\":[1,2.50e+3,\"x y\\u0041\"]}")
        );
        assert_eq!(minify("25").as_deref(), Some("25"));
        for bad in [
            "",
            "01",
            "1.",
            "{\"a\":1,}",
            "[1 2]",
            "25 abc",
            "\"a\nb\"",
            "tru",
            "{'a':1}",
            "-",
            "1e",
        ] {
            assert_eq!(minify(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn members_in_order_with_duplicates() {
        let m = object_members(r#"{"b":"x\"\ud83d\ude00","a":{ "k" : 1 },"b":null}"#).unwrap();
        assert_eq!(
            m,
            vec![
                ("b".into(), ArgValue::Str("x\"😀".into())),
                ("a".into(), ArgValue::Json("{\"k\":1}".into())),
                ("b".into(), ArgValue::Json("null".into())),
            ]
        );
        assert!(object_members("[1]").is_none());
        assert!(object_members("{\"a\":1} x").is_none());
        assert_eq!(object_members(" {} ").unwrap(), vec![]);
    }

    #[test]
    fn member_spans() {
        let raw = r#"{"type":"function", "function" : {"name": "f"} }"#;
        assert_eq!(
            &raw[member_span(raw, "function").unwrap()],
            r#"{"name": "f"}"#
        );
        assert_eq!(member_span(raw, "nope"), None);
        assert_eq!(
            member_span("{\"function\":1", "function"),
            None,
            "truncated object"
        );
    }
}
