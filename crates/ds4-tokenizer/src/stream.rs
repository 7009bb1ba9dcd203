//! Incremental detokenization that only ever hands out whole UTF-8 characters.

use crate::{Tokenizer, TokenizerError};

/// Push token ids, get back the text they complete. Bytes of a character split across
/// tokens are held until the character is complete; bytes that can never form valid
/// UTF-8 come out as U+FFFD (as `String::from_utf8_lossy` would).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.pending.extend_from_slice(tok.token_bytes(id)?);
        Ok(self.take_complete())
    }

    /// Adds several tokens; returns the newly completed text.
    pub fn push_all(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String, TokenizerError> {
        for &id in ids {
            self.pending.extend_from_slice(tok.token_bytes(id)?);
        }
        Ok(self.take_complete())
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is held back comes out (an incomplete character as U+FFFD).
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix was just validated.
                    out.push_str(std::str::from_utf8(&rest[..good]).unwrap_or_default());
                    match e.error_len() {
                        // Invalid bytes: replace and continue after them.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &rest[good + bad..];
                        }
                        // Incomplete character at the end: keep it for later.
                        None => {
                            rest = &rest[good..];
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
