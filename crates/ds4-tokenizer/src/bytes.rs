//! GPT-2 byte-level alphabet: every byte maps to one printable code point.
//! Bytes 33–126, 161–172 and 174–255 map to themselves; the other 68 bytes map,
//! in increasing byte order, to U+0100, U+0101, … (so space 0x20 -> 'Ġ' U+0120,
//! newline 0x0A -> 'Ċ' U+010A).

/// Code point for each byte.
pub const BYTE_TO_CHAR: [char; 256] = build_byte_to_char();

const fn is_self_mapped(b: u32) -> bool {
    (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)
}

const fn build_byte_to_char() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0u32;
    while b < 256 {
        let cp = if is_self_mapped(b) {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    out
}

/// Inverse of `BYTE_TO_CHAR` for code points 0..=0x143 (-1: not in the alphabet).
const CHAR_TO_BYTE: [i16; 0x144] = build_char_to_byte();

const fn build_char_to_byte() -> [i16; 0x144] {
    let mut out = [-1i16; 0x144];
    let mut b = 0;
    while b < 256 {
        out[BYTE_TO_CHAR[b] as usize] = b as i16;
        b += 1;
    }
    out
}

/// The byte a code point of the alphabet stands for, or None if `c` is not in it.
#[inline]
pub fn char_to_byte(c: char) -> Option<u8> {
    match CHAR_TO_BYTE.get(c as usize) {
        Some(&b) if b >= 0 => Some(b as u8),
        _ => None,
    }
}

/// Byte-level string for raw bytes (what BPE tokens and merges are written in).
pub fn bytes_to_symbols(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| BYTE_TO_CHAR[b as usize]).collect()
}

/// Raw bytes of a byte-level string, or None if some code point is outside the alphabet.
pub fn symbols_to_bytes(s: &str) -> Option<Vec<u8>> {
    s.chars().map(char_to_byte).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
        assert_eq!(BYTE_TO_CHAR[b'!' as usize], '!');
        assert_eq!(BYTE_TO_CHAR[0xAD], '\u{0143}'); // last of the 68 remapped bytes
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = BYTE_TO_CHAR[b as usize];
            assert!(seen.insert(c));
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(char_to_byte('\u{0144}'), None);
        assert_eq!(char_to_byte(' '), None);
    }
}
