//! The `*.kv` checkpoint file, version 1 (all integers little-endian).
//!
//! ```text
//! offset  size  field
//! 0       8     magic "DS4KVC\0\0"
//! 8       4     u32 format version = 1
//! 12      32    model id (the engine's SHA-256 of the GGUF header)
//! 44      1     save reason: 0 unknown, 1 cold, 2 continued, 3 evict, 4 shutdown
//! 45      1     flags, owned by the caller (ds4-server: bit1 key is a Responses visible
//!               transcript, bit2 key is a thinking visible transcript)
//! 46      2     reserved (0)
//! 48      4     u32 token count n (> 0)
//! 52      4     u32 context size of the session that was saved
//! 56      8     u64 creation time (unix seconds)
//! 64      4     u32 key byte count K (> 0)
//! 68      4     u32 extra byte count E (opaque caller data, e.g. a tool-id map)
//! 72      8     u64 snapshot byte count P
//! 80      K     key: the rendered prompt bytes this entry is a prefix of
//! 80+K    4n    u32 token ids the snapshot holds
//! H=80+K+4n 32  SHA-256 of bytes [0, H)      (header checksum: `ls`/lookup trust the key
//!                                             and sizes without reading the payload)
//! H+32    P     engine session snapshot (opaque here; it carries its own checksum too)
//! H+32+P  E     extra bytes
//! end-32  32    SHA-256 of every byte before it
//! ```
//!
//! The file is named `<lowercase hex SHA-256 of (model id ‖ key)>.kv`; a file whose name does not match
//! its key is invalid. Its length must be exactly `H + 32 + P + E + 32`, so a truncated file
//! is rejected from its header alone. The last-use time is the file's mtime (set explicitly on
//! write and on every lookup hit), so nothing covered by a checksum ever changes in place.
//! Writers create `<name>.tmp.<pid>.<seq>` in the same directory, fsync it, rename it over
//! the final name and fsync the directory; readers never look at `*.tmp.*` files.

use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

pub const MAGIC: &[u8; 8] = b"DS4KVC\0\0";
pub const VERSION: u32 = 1;
/// Bytes of the fixed header before the key.
pub const FIXED_LEN: usize = 80;
const SUM_LEN: usize = 32;
/// Sanity limits on header counts, so a corrupt header cannot ask for absurd allocations.
const MAX_KEY: u32 = 1 << 30;
const MAX_TOKENS: u32 = 1 << 28;

/// Why a checkpoint was written (interfaces.md §5.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Unknown = 0,
    Cold = 1,
    Continued = 2,
    Evict = 3,
    Shutdown = 4,
}

impl Reason {
    pub fn from_u8(v: u8) -> Option<Reason> {
        Some(match v {
            0 => Reason::Unknown,
            1 => Reason::Cold,
            2 => Reason::Continued,
            3 => Reason::Evict,
            4 => Reason::Shutdown,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Reason::Unknown => "unknown",
            Reason::Cold => "cold",
            Reason::Continued => "continued",
            Reason::Evict => "evict",
            Reason::Shutdown => "shutdown",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("not a ds4 KV cache file (bad magic at offset 0)")]
    BadMagic,
    #[error("unsupported format version {0} at offset 8 (this build reads version {VERSION})")]
    Version(u32),
    #[error("invalid {field} {value} at offset {offset}")]
    Field {
        field: &'static str,
        value: u64,
        offset: usize,
    },
    #[error("truncated or oversized: file is {actual} bytes, its header says {expected}")]
    Length { actual: u64, expected: u64 },
    #[error("truncated: file is {0} bytes, it ended inside the header")]
    Short(u64),
    #[error("header checksum mismatch at offset {0}: the header, key or token list is corrupt")]
    HeaderChecksum(u64),
    #[error("checksum mismatch at offset {0}: the snapshot or extra bytes are corrupt")]
    Checksum(u64),
    #[error("file name {name} does not match the SHA-256 of its key")]
    Name { name: String },
}

impl FormatError {
    /// True when the bytes are damaged (as opposed to an I/O failure or a file of another
    /// format version), i.e. the file can never become loadable.
    pub fn is_corrupt(&self) -> bool {
        !matches!(self, FormatError::Io(_) | FormatError::Version(_))
    }
}

/// The fixed header fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub model_id: [u8; 32],
    pub reason: Reason,
    pub flags: u8,
    pub n_tokens: u32,
    pub ctx: u32,
    pub created: u64,
    pub key_len: u32,
    pub extra_len: u32,
    pub snapshot_len: u64,
}

impl Header {
    /// Offset of the header checksum (end of the token list).
    pub fn header_sum_offset(&self) -> u64 {
        FIXED_LEN as u64 + self.key_len as u64 + 4 * self.n_tokens as u64
    }

    pub fn snapshot_offset(&self) -> u64 {
        self.header_sum_offset() + SUM_LEN as u64
    }

    /// Exact length of a well-formed file with this header.
    pub fn file_len(&self) -> u64 {
        self.snapshot_offset() + self.snapshot_len + self.extra_len as u64 + SUM_LEN as u64
    }

    fn encode(&self) -> [u8; FIXED_LEN] {
        let mut b = [0u8; FIXED_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..44].copy_from_slice(&self.model_id);
        b[44] = self.reason as u8;
        b[45] = self.flags;
        b[48..52].copy_from_slice(&self.n_tokens.to_le_bytes());
        b[52..56].copy_from_slice(&self.ctx.to_le_bytes());
        b[56..64].copy_from_slice(&self.created.to_le_bytes());
        b[64..68].copy_from_slice(&self.key_len.to_le_bytes());
        b[68..72].copy_from_slice(&self.extra_len.to_le_bytes());
        b[72..80].copy_from_slice(&self.snapshot_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FIXED_LEN]) -> Result<Header, FormatError> {
        if &b[0..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(FormatError::Version(version));
        }
        let field = |field, value: u64, offset| FormatError::Field {
            field,
            value,
            offset,
        };
        let reason = Reason::from_u8(b[44]).ok_or(field("save reason", b[44] as u64, 44))?;
        // Reserved: a reader that ignored them would take a file it does not understand.
        let reserved = u16::from_le_bytes([b[46], b[47]]);
        if reserved != 0 {
            return Err(field("reserved bytes", reserved as u64, 46));
        }
        let n_tokens = u32_at(48);
        if n_tokens == 0 || n_tokens > MAX_TOKENS {
            return Err(field("token count", n_tokens as u64, 48));
        }
        let key_len = u32_at(64);
        if key_len == 0 || key_len > MAX_KEY {
            return Err(field("key byte count", key_len as u64, 64));
        }
        let extra_len = u32_at(68);
        if extra_len > MAX_KEY {
            return Err(field("extra byte count", extra_len as u64, 68));
        }
        let snapshot_len = u64_at(72);
        if snapshot_len > 1 << 48 {
            return Err(field("snapshot byte count", snapshot_len, 72));
        }
        Ok(Header {
            version,
            model_id: b[12..44].try_into().unwrap(),
            reason,
            flags: b[45],
            n_tokens,
            ctx: u32_at(52),
            created: u64_at(56),
            key_len,
            extra_len,
            snapshot_len,
        })
    }
}

/// The checksummed head of a file: fixed header, key and token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub header: Header,
    pub key: Vec<u8>,
    pub tokens: Vec<u32>,
}

/// A whole verified file.
#[derive(Clone, Debug)]
pub struct Entry {
    pub meta: Meta,
    pub snapshot: Vec<u8>,
    pub extra: Vec<u8>,
}

/// The file stem of an entry: lowercase hex SHA-256 of the model id followed by the key, so
/// two models sharing a directory never replace each other's entries.
pub fn key_name(model_id: &[u8; 32], key: &[u8]) -> String {
    sha256_hex(&[&model_id[..], key].concat())
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A writer that hashes everything passing through it.
struct Hashing<W> {
    w: W,
    all: Sha256,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.all.update(b);
        self.w.write_all(b)
    }
}

/// Write a complete file. `header` must describe `key`, `tokens`, `snapshot` and `extra`.
pub fn write_entry<W: Write>(
    w: W,
    header: &Header,
    key: &[u8],
    tokens: &[u32],
    snapshot: &[u8],
    extra: &[u8],
) -> io::Result<W> {
    debug_assert_eq!(header.key_len as usize, key.len());
    debug_assert_eq!(header.n_tokens as usize, tokens.len());
    debug_assert_eq!(header.snapshot_len as usize, snapshot.len());
    debug_assert_eq!(header.extra_len as usize, extra.len());
    let mut h = Hashing {
        w,
        all: Sha256::new(),
    };
    h.put(&header.encode())?;
    h.put(key)?;
    let tok: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    h.put(&tok)?;
    let head_sum = h.all.clone().finalize();
    h.put(&head_sum)?;
    // Large snapshots go through in pieces so the hash and the writer interleave.
    for c in snapshot.chunks(1 << 20) {
        h.put(c)?;
    }
    h.put(extra)?;
    let sum = h.all.finalize();
    h.w.write_all(&sum)?;
    Ok(h.w)
}

/// Read and verify the head of a file (`file_len` = its length on disk). `name`, when
/// given, must be the file stem, i.e. the hex SHA-256 of the key.
pub fn read_meta<R: Read>(
    r: &mut R,
    file_len: u64,
    name: Option<&str>,
) -> Result<(Meta, Sha256), FormatError> {
    let mut fixed = [0u8; FIXED_LEN];
    read_exact(r, &mut fixed, file_len)?;
    let header = Header::decode(&fixed)?;
    if header.file_len() != file_len {
        return Err(FormatError::Length {
            actual: file_len,
            expected: header.file_len(),
        });
    }
    let mut all = Sha256::new();
    all.update(fixed);
    let mut key = vec![0u8; header.key_len as usize];
    read_exact(r, &mut key, file_len)?;
    all.update(&key);
    let mut tok = vec![0u8; 4 * header.n_tokens as usize];
    read_exact(r, &mut tok, file_len)?;
    all.update(&tok);
    let mut sum = [0u8; SUM_LEN];
    read_exact(r, &mut sum, file_len)?;
    if all.clone().finalize().as_slice() != sum {
        return Err(FormatError::HeaderChecksum(header.header_sum_offset()));
    }
    all.update(sum);
    if let Some(name) = name {
        if key_name(&header.model_id, &key) != name {
            return Err(FormatError::Name { name: name.into() });
        }
    }
    let tokens = tok
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok((
        Meta {
            header,
            key,
            tokens,
        },
        all,
    ))
}

/// Read and verify a whole file.
pub fn read_entry<R: Read>(
    r: &mut R,
    file_len: u64,
    name: Option<&str>,
) -> Result<Entry, FormatError> {
    let (meta, mut all) = read_meta(r, file_len, name)?;
    let mut snapshot = vec![0u8; meta.header.snapshot_len as usize];
    read_exact(r, &mut snapshot, file_len)?;
    all.update(&snapshot);
    let mut extra = vec![0u8; meta.header.extra_len as usize];
    read_exact(r, &mut extra, file_len)?;
    all.update(&extra);
    let mut sum = [0u8; SUM_LEN];
    read_exact(r, &mut sum, file_len)?;
    if all.finalize().as_slice() != sum {
        return Err(FormatError::Checksum(file_len - SUM_LEN as u64));
    }
    Ok(Entry {
        meta,
        snapshot,
        extra,
    })
}

/// `read_exact` whose end-of-file error says how long the file was.
fn read_exact<R: Read>(r: &mut R, buf: &mut [u8], file_len: u64) -> Result<(), FormatError> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FormatError::Short(file_len)
        } else {
            FormatError::Io(e)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Header, Vec<u8>) {
        let key = b"<sys>hello".to_vec();
        let tokens = [5u32, 6, 7];
        let snap = vec![9u8; 100];
        let extra = b"xy".to_vec();
        let h = Header {
            version: VERSION,
            model_id: [3; 32],
            reason: Reason::Cold,
            flags: 2,
            n_tokens: 3,
            ctx: 4096,
            created: 1_700_000_000,
            key_len: key.len() as u32,
            extra_len: 2,
            snapshot_len: 100,
        };
        let bytes = write_entry(Vec::new(), &h, &key, &tokens, &snap, &extra).unwrap();
        (h, bytes)
    }

    #[test]
    fn round_trip_and_exact_length() {
        let (h, bytes) = sample();
        assert_eq!(bytes.len() as u64, h.file_len());
        let name = key_name(&[3; 32], b"<sys>hello");
        let e = read_entry(&mut &bytes[..], bytes.len() as u64, Some(&name)).unwrap();
        assert_eq!(e.meta.header, h);
        assert_eq!(e.meta.key, b"<sys>hello");
        assert_eq!(e.meta.tokens, [5, 6, 7]);
        assert_eq!(e.snapshot, vec![9u8; 100]);
        assert_eq!(e.extra, b"xy");
        // Field offsets as documented.
        assert_eq!(&bytes[8..12], &1u32.to_le_bytes());
        assert_eq!(bytes[44], 1);
        assert_eq!(&bytes[48..52], &3u32.to_le_bytes());
        assert_eq!(&bytes[80..90], b"<sys>hello");
        assert_eq!(&bytes[90..94], &5u32.to_le_bytes());
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_rejected() {
        let (_, bytes) = sample();
        let n = bytes.len() as u64;
        for i in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[i] ^= bit;
                let r = read_entry(&mut &b[..], n, None);
                assert!(r.is_err(), "flip at {i} accepted");
            }
        }
        for len in 0..bytes.len() {
            let r = read_entry(&mut &bytes[..len], len as u64, None);
            assert!(r.unwrap_err().is_corrupt(), "truncation to {len} accepted");
        }
        // Reserved bytes set, checksums made to match (found by fuzz/kv_entry): refused with
        // the offset, not read as an entry whose rewrite would differ.
        let mut b = bytes.clone();
        b[46] = 1;
        let hs = 80 + 10 + 12;
        let sum: [u8; 32] = Sha256::digest(&b[..hs]).into();
        b[hs..hs + 32].copy_from_slice(&sum);
        let end = b.len() - 32;
        let sum: [u8; 32] = Sha256::digest(&b[..end]).into();
        b[end..].copy_from_slice(&sum);
        let e = read_entry(&mut &b[..], n, None).unwrap_err();
        assert_eq!(e.to_string(), "invalid reserved bytes 1 at offset 46");
        // A wrong name is caught even when the bytes are intact.
        let r = read_entry(&mut &bytes[..], n, Some(&key_name(&[3; 32], b"other")));
        assert!(matches!(r, Err(FormatError::Name { .. })));
    }
}
