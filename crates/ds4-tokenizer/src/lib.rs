//! DeepSeek byte-level BPE tokenizer.
//!
//! Reproduces HF `tokenizers` on DeepSeek V4's `tokenizer.json`: the pre-tokenizer
//! (see [`pretok`]) splits text into pieces, each piece's UTF-8 bytes are mapped to the
//! GPT-2 byte alphabet ([`bytes`]) and merged by rank. Tokens that plain BPE can never
//! produce (a code point outside the byte alphabet, or a multi-char string that is no
//! merge's result: `<｜User｜>`, `<think>`, placeholders, …) are the *added* tokens;
//! [`Tokenizer::encode_with_specials`] splits them out of text (leftmost-longest, like
//! HF's added-vocabulary pass), [`Tokenizer::encode`] never does.

pub mod builtin;
pub mod bytes;
pub mod pretok;
mod stream;

pub use builtin::Vocab;
pub use stream::StreamDecoder;

use aho_corasick::{AhoCorasick, MatchKind};
use rustc_hash::FxHashMap;
use std::sync::Mutex;

/// The seven chat strings of interfaces.md §4.1, in `SpecialIds` field order.
pub const CHAT_SPECIALS: [&str; 7] = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenizerError {
    #[error("vocabulary is empty")]
    EmptyVocab,
    #[error("vocabulary has {0} tokens, more than u32 ids allow")]
    VocabTooLarge(usize),
    #[error("special token {0:?} is missing from the vocabulary")]
    MissingSpecial(&'static str),
    #[error("byte-level symbol {symbol:?} (byte 0x{byte:02X}) is missing from the vocabulary")]
    MissingByte { byte: u8, symbol: char },
    #[error("merge #{index} {entry:?}: {reason}")]
    BadMerge {
        index: usize,
        entry: String,
        reason: &'static str,
    },
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
}

/// Ids of the chat specials, looked up by string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: u32,
    pub eos: u32,
    pub user: u32,
    pub assistant: u32,
    pub think_open: u32,
    pub think_close: u32,
    pub dsml: u32,
}

/// Pieces longer than this (bytes) are not cached.
const CACHE_MAX_PIECE: usize = 256;
/// Entries in the piece cache before it is cleared.
const CACHE_CAP: usize = 200_000;
/// Pieces with more symbols than this use the heap-based merge loop.
const SMALL_PIECE: usize = 64;

/// Piece -> ids cache. Pieces of at most 15 bytes are keyed inline (bytes + length in
/// the top byte of a u128), longer ones by their bytes.
#[derive(Default)]
struct Cache {
    /// key -> (start, len) in `ids`
    small: FxHashMap<u128, (u32, u32)>,
    big: FxHashMap<Box<[u8]>, (u32, u32)>,
    ids: Vec<u32>,
}

impl Cache {
    #[inline]
    fn small_key(piece: &[u8]) -> u128 {
        let mut k = [0u8; 16];
        k[..piece.len()].copy_from_slice(piece);
        k[15] = piece.len() as u8;
        u128::from_le_bytes(k)
    }

    #[inline]
    fn get(&self, piece: &[u8]) -> Option<&[u32]> {
        let hit = if piece.len() < 16 {
            self.small.get(&Self::small_key(piece))
        } else {
            self.big.get(piece)
        };
        hit.map(|&(s, l)| &self.ids[s as usize..(s + l) as usize])
    }

    fn insert(&mut self, piece: &[u8], ids: &[u32]) {
        if self.small.len() + self.big.len() >= CACHE_CAP {
            self.small.clear();
            self.big.clear();
            self.ids.clear();
        }
        let v = (self.ids.len() as u32, ids.len() as u32);
        self.ids.extend_from_slice(ids);
        if piece.len() < 16 {
            self.small.insert(Self::small_key(piece), v);
        } else {
            self.big.insert(piece.into(), v);
        }
    }
}

/// Reusable buffers for one encode call.
#[derive(Default)]
struct Scratch {
    syms: Vec<u32>,
    ranks: Vec<u32>,
}

pub struct Tokenizer {
    tokens: Vec<String>,
    /// Decoded bytes of every token, concatenated; token `i` is `bytes[offs[i]..offs[i+1]]`.
    bytes: Vec<u8>,
    offs: Vec<u32>,
    /// Token string -> id (first id wins on duplicates).
    ids: FxHashMap<String, u32>,
    /// Token id of each raw byte's alphabet symbol.
    byte_ids: [u32; 256],
    /// (left id << 32 | right id) -> (rank << 32 | merged id)
    merges: FxHashMap<u64, u64>,
    /// Added (non-BPE) tokens, for `encode_with_specials`.
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    /// Only the seven chat specials, for `encode_with_chat_specials`.
    chat: AhoCorasick,
    chat_ids: [u32; 7],
    is_added: Vec<bool>,
    specials: SpecialIds,
    classes: pretok::Classes,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("merges", &self.merges.len())
            .field("added_tokens", &self.added_ids.len())
            .field("specials", &self.specials)
            .finish()
    }
}

impl Tokenizer {
    /// Builds a tokenizer from GGUF-style arrays: `tokens[id]` (byte-level strings, added
    /// tokens verbatim) and `merges[rank]` = `"left right"`.
    pub fn from_vocab(
        tokens: Vec<String>,
        merges: Vec<String>,
    ) -> Result<Tokenizer, TokenizerError> {
        if tokens.is_empty() {
            return Err(TokenizerError::EmptyVocab);
        }
        if tokens.len() > u32::MAX as usize {
            return Err(TokenizerError::VocabTooLarge(tokens.len()));
        }
        let mut ids: FxHashMap<String, u32> = FxHashMap::default();
        ids.reserve(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let look = |s: &str| ids.get(s).copied();
        let sp = |s: &'static str| look(s).ok_or(TokenizerError::MissingSpecial(s));
        let specials = SpecialIds {
            bos: sp(CHAT_SPECIALS[0])?,
            eos: sp(CHAT_SPECIALS[1])?,
            user: sp(CHAT_SPECIALS[2])?,
            assistant: sp(CHAT_SPECIALS[3])?,
            think_open: sp(CHAT_SPECIALS[4])?,
            think_close: sp(CHAT_SPECIALS[5])?,
            dsml: sp(CHAT_SPECIALS[6])?,
        };
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let symbol = bytes::BYTE_TO_CHAR[b];
            let mut buf = [0u8; 4];
            *slot = look(symbol.encode_utf8(&mut buf)).ok_or(TokenizerError::MissingByte {
                byte: b as u8,
                symbol,
            })?;
        }
        let mut merge_map: FxHashMap<u64, u64> = FxHashMap::default();
        merge_map.reserve(merges.len());
        let mut is_merge_result = vec![false; tokens.len()];
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            let bad = |reason| TokenizerError::BadMerge {
                index: rank,
                entry: m.clone(),
                reason,
            };
            let (l, r) = m
                .split_once(' ')
                .ok_or_else(|| bad("no space separating the two parts"))?;
            if l.is_empty() || r.is_empty() || r.contains(' ') {
                return Err(bad(
                    "expected exactly two non-empty parts separated by one space",
                ));
            }
            let li = look(l).ok_or_else(|| bad("left part is not in the vocabulary"))?;
            let ri = look(r).ok_or_else(|| bad("right part is not in the vocabulary"))?;
            joined.clear();
            joined.push_str(l);
            joined.push_str(r);
            let out = look(&joined).ok_or_else(|| bad("merged token is not in the vocabulary"))?;
            if rank > u32::MAX as usize {
                return Err(bad("too many merges"));
            }
            is_merge_result[out as usize] = true;
            // Keep the lowest rank if a pair repeats.
            merge_map
                .entry((li as u64) << 32 | ri as u64)
                .or_insert((rank as u64) << 32 | out as u64);
        }
        // Decoded bytes; classify added tokens.
        let mut tok_bytes = Vec::with_capacity(tokens.len() * 8);
        let mut offs = Vec::with_capacity(tokens.len() + 1);
        let mut is_added = vec![false; tokens.len()];
        let mut added_ids = Vec::new();
        let mut added_pats: Vec<&str> = Vec::new();
        offs.push(0u32);
        for (i, t) in tokens.iter().enumerate() {
            let as_bytes = bytes::symbols_to_bytes(t);
            let bpe = match &as_bytes {
                Some(_) => t.chars().count() == 1 || is_merge_result[i],
                None => false,
            };
            match (bpe, as_bytes) {
                (true, Some(b)) => tok_bytes.extend_from_slice(&b),
                _ => {
                    is_added[i] = true;
                    tok_bytes.extend_from_slice(t.as_bytes());
                    // Only the first id of a string is matchable; empty strings never are.
                    if !t.is_empty() && look(t) == Some(i as u32) {
                        added_ids.push(i as u32);
                        added_pats.push(t);
                    }
                }
            }
            offs.push(tok_bytes.len() as u32);
        }
        let added = if added_pats.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&added_pats)
                    .expect("aho-corasick over non-empty patterns"),
            )
        };
        let chat_ids = [
            specials.bos,
            specials.eos,
            specials.user,
            specials.assistant,
            specials.think_open,
            specials.think_close,
            specials.dsml,
        ];
        let chat = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(CHAT_SPECIALS)
            .expect("aho-corasick over the chat specials");
        Ok(Tokenizer {
            chat,
            chat_ids,
            tokens,
            bytes: tok_bytes,
            offs,
            ids,
            byte_ids,
            merges: merge_map,
            added,
            added_ids,
            is_added,
            specials,
            classes: pretok::Classes::default(),
            cache: Mutex::new(Cache::default()),
        })
    }

    /// Builds the tokenizer from a [`Vocab`].
    pub fn from_builtin(v: Vocab) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_vocab(v.tokens, v.merges)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn specials(&self) -> SpecialIds {
        self.specials
    }

    /// Id of a token string (exact match), e.g. a special.
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.ids.get(s).copied()
    }

    /// The vocabulary string of `id` (GGUF form).
    pub fn token_str(&self, id: u32) -> Result<&str, TokenizerError> {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .ok_or(self.unknown(id))
    }

    /// True for added tokens (specials and other non-BPE strings), which decode verbatim.
    pub fn is_added(&self, id: u32) -> bool {
        self.is_added.get(id as usize).copied().unwrap_or(false)
    }

    fn unknown(&self, id: u32) -> TokenizerError {
        TokenizerError::UnknownId {
            id,
            vocab_size: self.tokens.len(),
        }
    }

    /// Raw bytes a token stands for (possibly partial UTF-8).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let i = id as usize;
        if i >= self.tokens.len() {
            return Err(self.unknown(id));
        }
        Ok(&self.bytes[self.offs[i] as usize..self.offs[i + 1] as usize])
    }

    /// Concatenated bytes of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Empties the piece cache (it is also bounded: cleared when it reaches 200,000 pieces).
    pub fn clear_cache(&self) {
        if let Ok(mut c) = self.cache.lock() {
            *c = Cache::default();
        }
    }

    /// Plain-text BPE: added/special token strings in `text` are encoded as ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, &mut out);
        out
    }

    /// Appends the plain-text encoding of `text` to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        // One lock per call; if another thread holds the cache, go without it.
        let mut cache = self.cache.try_lock().ok();
        let mut scratch = Scratch::default();
        pretok::split(text, &self.classes, &mut |piece| {
            self.encode_piece(piece.as_bytes(), cache.as_deref_mut(), &mut scratch, out)
        });
    }

    /// Encoding of rendered text: every added token string (at least the seven chat
    /// specials; also the other added tokens, as HF does) becomes its id, scanning
    /// leftmost-longest; the text between them is BPE-encoded.
    pub fn encode_with_specials(&self, text: &str) -> Vec<u32> {
        match &self.added {
            Some(ac) => self.encode_split(text, ac, &self.added_ids),
            None => self.encode(text),
        }
    }

    /// Like `encode_with_specials` but recognising only the seven chat specials of
    /// `CHAT_SPECIALS` (what C ds4 does); other added-token strings stay plain text.
    pub fn encode_with_chat_specials(&self, text: &str) -> Vec<u32> {
        self.encode_split(text, &self.chat, &self.chat_ids)
    }

    fn encode_split(&self, text: &str, ac: &AhoCorasick, ids: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let mut last = 0;
        for m in ac.find_iter(text) {
            if m.start() > last {
                self.encode_into(&text[last..m.start()], &mut out);
            }
            out.push(ids[m.pattern().as_usize()]);
            last = m.end();
        }
        if last < text.len() {
            self.encode_into(&text[last..], &mut out);
        }
        out
    }

    /// BPE of one pre-tokenizer piece (raw bytes).
    fn encode_piece(
        &self,
        piece: &[u8],
        cache: Option<&mut Cache>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        match piece.len() {
            1 => {
                out.push(self.byte_ids[piece[0] as usize]);
                return;
            }
            2 => {
                // One possible merge: cheaper than a cache lookup.
                let (a, b) = (
                    self.byte_ids[piece[0] as usize],
                    self.byte_ids[piece[1] as usize],
                );
                match self.pair(a, b) {
                    Some((_, m)) => out.push(m),
                    None => out.extend_from_slice(&[a, b]),
                }
                return;
            }
            _ => {}
        }
        let cache = match cache {
            Some(c) if piece.len() <= CACHE_MAX_PIECE => c,
            _ => {
                self.bpe(piece, scratch, out);
                return;
            }
        };
        if let Some(ids) = cache.get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        self.bpe(piece, scratch, out);
        cache.insert(piece, &out[start..]);
    }

    #[inline]
    fn pair(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        self.merges
            .get(&((l as u64) << 32 | r as u64))
            .map(|&v| ((v >> 32) as u32, v as u32))
    }

    /// Merge loop: repeatedly merge the adjacent pair of lowest rank (leftmost on ties).
    fn bpe(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if piece.len() > SMALL_PIECE {
            self.bpe_heap(piece, out)
        } else {
            self.bpe_small(piece, scratch, out)
        }
    }

    /// O(n²) merge loop, fastest for short pieces.
    fn bpe_small(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let syms = &mut scratch.syms;
        let ranks = &mut scratch.ranks;
        syms.clear();
        syms.extend(piece.iter().map(|&b| self.byte_ids[b as usize]));
        // ranks[k] = rank of (syms[k], syms[k+1]), u32::MAX if none.
        ranks.clear();
        ranks.extend(
            syms.windows(2)
                .map(|w| self.pair(w[0], w[1]).map_or(u32::MAX, |p| p.0)),
        );
        loop {
            let mut best = u32::MAX;
            let mut at = 0;
            for (k, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = k;
                }
            }
            if best == u32::MAX {
                break;
            }
            let (_, merged) = self.pair(syms[at], syms[at + 1]).expect("ranked pair");
            syms[at] = merged;
            syms.remove(at + 1);
            ranks.remove(at);
            if at + 1 < syms.len() {
                ranks[at] = self.pair(syms[at], syms[at + 1]).map_or(u32::MAX, |p| p.0);
            }
            if at > 0 {
                ranks[at - 1] = self.pair(syms[at - 1], syms[at]).map_or(u32::MAX, |p| p.0);
            }
        }
        out.extend_from_slice(syms);
    }

    /// Same merge order as `bpe`, in O(n log n) for long pieces: a doubly linked list of
    /// symbols and a min-heap of (rank, position) candidates, stale entries skipped.
    fn bpe_heap(&self, piece: &[u8], out: &mut Vec<u32>) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let n = piece.len();
        let mut sym: Vec<u32> = piece.iter().map(|&b| self.byte_ids[b as usize]).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut alive = vec![true; n];
        // (rank, position of left symbol, left id, right id)
        let mut heap = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some((r, _)) = self.pair(sym[i], sym[i + 1]) {
                heap.push(Reverse((r, i, sym[i], sym[i + 1])));
            }
        }
        while let Some(Reverse((_, i, l, r))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j >= n || sym[i] != l || sym[j] != r {
                continue; // stale
            }
            let (_, merged) = self.pair(l, r).expect("ranked pair");
            sym[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] < n {
                prev[next[j]] = i;
            }
            let p = prev[i];
            if p < n {
                if let Some((rk, _)) = self.pair(sym[p], merged) {
                    heap.push(Reverse((rk, p, sym[p], merged)));
                }
            }
            let q = next[i];
            if q < n {
                if let Some((rk, _)) = self.pair(merged, sym[q]) {
                    heap.push(Reverse((rk, i, merged, sym[q])));
                }
            }
        }
        let mut i = 0;
        while i < n {
            out.push(sym[i]);
            i = next[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic test input without extra dependencies.
    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed >> 12;
        *seed ^= *seed << 25;
        *seed ^= *seed >> 27;
        seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    #[test]
    fn heap_and_quadratic_merge_loops_agree() {
        let t = Tokenizer::from_builtin(builtin::deepseek_v4()).unwrap();
        let alphabets: [&[u8]; 4] = [b"ab", b"the quick", b"aaaaab", "éß深🙂x".as_bytes()];
        let mut seed = 0x1234_5678_9ABC_DEF1u64;
        let mut scratch = Scratch::default();
        for round in 0..400 {
            let alpha = alphabets[round % alphabets.len()];
            let len = 2 + (rng(&mut seed) % 120) as usize;
            let piece: Vec<u8> = (0..len)
                .map(|_| alpha[(rng(&mut seed) % alpha.len() as u64) as usize])
                .collect();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            // Both loops directly, whatever the length.
            t.bpe_small(&piece, &mut scratch, &mut a);
            t.bpe_heap(&piece, &mut b);
            assert_eq!(a, b, "piece {:?}", String::from_utf8_lossy(&piece));
            let back: Vec<u8> = a
                .iter()
                .flat_map(|&i| t.token_bytes(i).unwrap().to_vec())
                .collect();
            assert_eq!(back, piece);
        }
    }

    #[test]
    fn random_text_roundtrips() {
        let t = Tokenizer::from_builtin(builtin::deepseek_v4()).unwrap();
        let pool: Vec<char> = " \t\n\r!.,;'\"<>|/_-0123456789aZé深ア한ب\u{301}\u{200D}🙂｜▁"
            .chars()
            .chain(CHAT_SPECIALS.iter().flat_map(|s| s.chars()))
            .collect();
        let mut seed = 42u64;
        for _ in 0..2000 {
            let len = (rng(&mut seed) % 40) as usize;
            let mut s: String = (0..len)
                .map(|_| pool[(rng(&mut seed) % pool.len() as u64) as usize])
                .collect();
            if rng(&mut seed) % 3 < 1 {
                s.push_str(CHAT_SPECIALS[(rng(&mut seed) % 7) as usize]);
            }
            for ids in [
                t.encode(&s),
                t.encode_with_specials(&s),
                t.encode_with_chat_specials(&s),
            ] {
                assert_eq!(t.decode(&ids).unwrap(), s.as_bytes(), "{s:?}");
            }
        }
    }
}
