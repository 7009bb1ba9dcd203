//! Session snapshot format, version 2 (all little-endian):
//!
//! ```text
//! magic "DS4SNAP\0" | u32 version = 2 | [u8; 32] model id (SHA-256 of the GGUF header)
//! u32 n_tokens | u32 vocab | u32 n_layer | u32 head_dim | u32 window | u32 has_logits
//! u32 tokens[n_tokens] | f32 logits[vocab] (if has_logits)
//! per layer: ROWS raw rows, min(n, window) rows of head_dim, oldest first
//!            if compressed: u32 rows, ROWS rows[..], f32 front_kv[..], f32 front_score[..]
//!            if CSA:        the same for the indexer
//! [u8; 32] SHA-256 of everything above
//! ROWS = u32 encoding, then the values: 0 = f32, 1 = f16 (IEEE half)
//! ```
//! Frontier sizes are fixed by the model, so they are not stored. Raw rows are written in
//! position order (not ring order), so the format does not depend on a backend's ring layout.
//! Cache rows are written as f16 when every value of the array round-trips through f16 in bits
//! (the model's rows are f16-rounded: half the bytes of a long context's checkpoint, exactly),
//! else as f32 (rounding switched off, or values that are not the model's). Version 1 (every
//! array f32, no encoding words) is still read.

use ds4_backend::{HostCompState as CompState, HostLayerState, LayerDims};
use ds4_model::forward::HostState as State;
use ds4_model::HParams;
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"DS4SNAP\0";
pub(crate) const VERSION: u32 = 2;
/// Row array encodings (version 2).
const ENC_F32: u32 = 0;
const ENC_F16: u32 = 1;
/// Values a conversion job takes (rayon, so a long context's checkpoint converts in parallel).
const CHUNK: usize = 1 << 16;

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` as `N`-byte little-endian values. Element by element into a sized slice, which
/// compiles to a plain copy: a long context's checkpoint is hundreds of MiB (`extend_from_slice`
/// per value took ~1 ns each).
fn put_le<T: Copy, const N: usize>(b: &mut Vec<u8>, v: &[T], le: impl Fn(T) -> [u8; N]) {
    let at = b.len();
    b.resize(at + v.len() * N, 0);
    for (d, &x) in b[at..].chunks_exact_mut(N).zip(v) {
        d.copy_from_slice(&le(x));
    }
}

fn put_f32s(b: &mut Vec<u8>, v: &[f32]) {
    put_le(b, v, f32::to_le_bytes);
}

/// `v` as f16 when every value comes back from f16 with the same bits, else None.
fn exact_f16(v: &[f32]) -> Option<Vec<half::f16>> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let mut h = vec![half::f16::ZERO; v.len()];
    let ok = h
        .par_chunks_mut(CHUNK)
        .zip(v.par_chunks(CHUNK))
        .all(|(h, v)| {
            h.convert_from_f32_slice(v);
            let mut back = vec![0f32; v.len()];
            h.convert_to_f32_slice(&mut back);
            back.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits())
        });
    ok.then_some(h)
}

/// A row array (ROWS in the format): f16 when exact, else f32.
fn put_rows(b: &mut Vec<u8>, v: &[f32]) {
    match exact_f16(v) {
        Some(h) => {
            put_u32(b, ENC_F16);
            put_le(b, &h, half::f16::to_le_bytes);
        }
        None => {
            put_u32(b, ENC_F32);
            put_f32s(b, v);
        }
    }
}

pub fn write(hp: &HParams, id: &[u8; 32], st: &State, logits: Option<&[f32]>) -> Vec<u8> {
    write_version(hp, id, st, logits, VERSION)
}

/// [`write`] in `version` 1 or 2 (1: for the tests that read old snapshots).
fn write_version(
    hp: &HParams,
    id: &[u8; 32],
    st: &State,
    logits: Option<&[f32]>,
    version: u32,
) -> Vec<u8> {
    let rows = |b: &mut Vec<u8>, v: &[f32]| {
        if version >= 2 {
            put_rows(b, v)
        } else {
            put_f32s(b, v)
        }
    };
    let hd = hp.head_dim as usize;
    let win = hp.sliding_window as usize;
    let n = st.tokens.len();
    // Room for everything as f32 at once: growing by doubling copied a long context's
    // checkpoint several times over (rows that convert to f16 take half of it).
    let values: usize = st
        .layers
        .iter()
        .map(|l| {
            let c = |c: &Option<CompState>| {
                c.as_ref().map_or(0, |c| {
                    c.rows.len() + c.front_kv.len() + c.front_score.len() + 2
                })
            };
            l.raw.len() + 1 + c(&l.comp) + c(&l.index)
        })
        .sum();
    let mut b = Vec::with_capacity(128 + 4 * (n + logits.map_or(0, |l| l.len()) + values) + 32);
    b.extend_from_slice(MAGIC);
    put_u32(&mut b, version);
    b.extend_from_slice(id);
    for v in [
        n as u32,
        hp.n_vocab,
        hp.n_layer,
        hp.head_dim,
        hp.sliding_window,
        logits.is_some() as u32,
    ] {
        put_u32(&mut b, v);
    }
    for &t in &st.tokens {
        put_u32(&mut b, t);
    }
    if let Some(l) = logits {
        put_f32s(&mut b, l);
    }
    let comp = |b: &mut Vec<u8>, c: &CompState, d: usize| {
        put_u32(b, (c.rows.len() / d) as u32);
        rows(b, &c.rows);
        put_f32s(b, &c.front_kv);
        put_f32s(b, &c.front_score);
    };
    for ls in &st.layers {
        // The window in position order (one array).
        let raw: Vec<f32> = (n.saturating_sub(win)..n)
            .flat_map(|p| ls.raw[(p % win) * hd..(p % win + 1) * hd].iter().copied())
            .collect();
        rows(&mut b, &raw);
        if let Some(c) = &ls.comp {
            comp(&mut b, c, hd);
        }
        if let Some(c) = &ls.index {
            comp(&mut b, c, hp.indexer_head_dim as usize);
        }
    }
    let sum: [u8; 32] = Sha256::digest(&b).into();
    b.extend_from_slice(&sum);
    b
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        if self.b.len() - self.pos < n {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, {} left",
                self.pos,
                self.b.len() - self.pos
            ));
        }
        self.pos += n;
        Ok(&self.b[self.pos - n..self.pos])
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn f32s(&mut self, out: &mut [f32], what: &str) -> Result<(), String> {
        let s = self.take(out.len() * 4, what)?;
        for (o, c) in out.iter_mut().zip(s.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
    /// A row array: f32 in version 1, ROWS (encoding word, values) from version 2.
    fn rows(&mut self, out: &mut [f32], version: u32, what: &str) -> Result<(), String> {
        if version < 2 {
            return self.f32s(out, what);
        }
        let at = self.pos;
        match self.u32(what)? {
            ENC_F32 => self.f32s(out, what),
            ENC_F16 => {
                use half::slice::HalfFloatSliceExt;
                use rayon::prelude::*;
                let s = self.take(out.len() * 2, what)?;
                out.par_chunks_mut(CHUNK)
                    .zip(s.par_chunks(2 * CHUNK))
                    .for_each(|(o, s)| {
                        let h: Vec<half::f16> = s
                            .chunks_exact(2)
                            .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                            .collect();
                        h.convert_to_f32_slice(o);
                    });
                Ok(())
            }
            e => Err(format!("{what}: unknown row encoding {e} at offset {at}")),
        }
    }
}

/// Why a snapshot was not read.
#[derive(Debug, PartialEq)]
pub enum ReadError {
    /// A sound snapshot (its checksum holds) of a newer format than this build reads: it
    /// belongs to a newer ds4 sharing the cache, so it is not this build's to delete.
    Newer(u32),
    /// Not a snapshot of this model, or damaged: what is wrong and where.
    Invalid(String),
}

impl From<String> for ReadError {
    fn from(s: String) -> Self {
        ReadError::Invalid(s)
    }
}

pub fn read(
    hp: &HParams,
    dims: &[LayerDims],
    id: &[u8; 32],
    bytes: &[u8],
) -> Result<(State, Option<Vec<f32>>), ReadError> {
    if bytes.len() < MAGIC.len() + 4 + 32 + 32 || &bytes[..8] != MAGIC {
        return Err(ReadError::Invalid(
            "not a ds4 session snapshot (bad magic)".into(),
        ));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    let want: [u8; 32] = Sha256::digest(body).into();
    if want != sum {
        return Err(ReadError::Invalid(
            "checksum mismatch: the snapshot is corrupt".into(),
        ));
    }
    let mut r = Reader { b: body, pos: 8 };
    let version = r.u32("version")?;
    if version > VERSION {
        return Err(ReadError::Newer(version));
    }
    if version == 0 {
        return Err(format!("unsupported version 0 (this build reads 1 to {VERSION})").into());
    }
    if r.take(32, "model id")? != id {
        return Err(ReadError::Invalid(
            "taken with a different model file".into(),
        ));
    }
    let n = r.u32("token count")? as usize;
    for (what, want) in [
        ("vocab", hp.n_vocab),
        ("layer count", hp.n_layer),
        ("head dim", hp.head_dim),
        ("window", hp.sliding_window),
    ] {
        let got = r.u32(what)?;
        if got != want {
            return Err(format!("{what} {got} does not match the model's {want}").into());
        }
    }
    let has_logits = r.u32("logits flag")? != 0;
    let mut st = State {
        tokens: Vec::new(),
        layers: dims.iter().map(HostLayerState::new).collect(),
    };
    if n > body.len() / 4 {
        return Err(format!("token count {n} exceeds the snapshot size").into());
    }
    for i in 0..n {
        let at = r.pos;
        let t = r.u32("tokens")?;
        if t >= hp.n_vocab {
            return Err(format!(
                "token {i} = {t} at offset {at} is outside the vocabulary ({} ids)",
                hp.n_vocab
            )
            .into());
        }
        st.tokens.push(t);
    }
    let logits = if has_logits {
        let mut l = vec![0f32; hp.n_vocab as usize];
        r.f32s(&mut l, "logits")?;
        Some(l)
    } else {
        None
    };
    let hd = hp.head_dim as usize;
    let win = hp.sliding_window as usize;
    // A compressor closes one row every `ratio` tokens: floor(n / ratio) rows, no other count
    // (attention reads every row up to there).
    let comp = |r: &mut Reader, c: &mut CompState, d: usize, want: usize| -> Result<(), String> {
        let at = r.pos;
        let rows = r.u32("compressed row count")? as usize;
        if rows != want {
            return Err(format!(
                "{rows} compressed rows at offset {at} for {n} tokens (the layer holds {want})"
            ));
        }
        c.rows = vec![0f32; rows * d];
        r.rows(&mut c.rows, version, "compressed rows")?;
        r.f32s(&mut c.front_kv, "compressor frontier")?;
        r.f32s(&mut c.front_score, "compressor frontier scores")
    };
    for (l, ls) in st.layers.iter_mut().enumerate() {
        let first = n.saturating_sub(win);
        let mut raw = vec![0f32; (n - first) * hd];
        r.rows(&mut raw, version, "raw window rows")?;
        for (k, p) in (first..n).enumerate() {
            ls.raw[(p % win) * hd..(p % win + 1) * hd].copy_from_slice(&raw[k * hd..(k + 1) * hd]);
            ls.raw_pos[p % win] = p as i64;
        }
        let ratio = hp.compress_ratios[l].max(1) as usize;
        if let Some(c) = ls.comp.as_mut() {
            comp(&mut r, c, hd, n / ratio)?;
        }
        if let Some(c) = ls.index.as_mut() {
            comp(&mut r, c, hp.indexer_head_dim as usize, n / 4)?;
        }
    }
    if r.pos != body.len() {
        return Err(format!(
            "{} unexpected bytes after the last layer",
            body.len() - r.pos
        )
        .into());
    }
    Ok((st, logits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_model::forward::layer_dims;

    /// A tiny model's state at `n` tokens: every row value f16-exact (as the model's), the
    /// frontiers not; logits of the vocabulary.
    fn state(n: usize) -> (HParams, Vec<LayerDims>, State, Vec<f32>) {
        let hp = HParams::tiny();
        let dims: Vec<LayerDims> = hp.layers().map(|k| layer_dims(&hp, &k, true)).collect();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut val = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let h16 = |v: f32| half::f16::from_f32(v).to_f32();
        let win = hp.sliding_window as usize;
        let layers = dims
            .iter()
            .map(|d| {
                let mut h = HostLayerState::new(d);
                h.raw.iter_mut().for_each(|v| *v = h16(val()));
                for p in n.saturating_sub(win)..n {
                    h.raw_pos[p % win] = p as i64;
                }
                for (c, hc) in [(&d.comp, &mut h.comp), (&d.index, &mut h.index)] {
                    if let (Some(c), Some(hc)) = (c, hc.as_mut()) {
                        hc.rows = (0..n / c.ratio * c.d).map(|_| h16(val())).collect();
                        hc.front_kv.iter_mut().for_each(|v| *v = val());
                        hc.front_score.iter_mut().for_each(|v| *v = val());
                    }
                }
                h
            })
            .collect();
        let st = State {
            tokens: (0..n as u32).collect(),
            layers,
        };
        let logits = (0..hp.n_vocab).map(|_| val()).collect();
        (hp, dims, st, logits)
    }

    /// Every value of `a` and `b` (the raw rows of the window's positions only) in bits.
    fn same(a: &State, b: &State, n: usize, win: usize) {
        assert_eq!(a.tokens, b.tokens);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
            for p in n.saturating_sub(win)..n {
                let s = (p % win) * 128..(p % win + 1) * 128;
                assert_eq!(
                    bits(&x.raw[s.clone()]),
                    bits(&y.raw[s]),
                    "layer {l} raw {p}"
                );
                assert_eq!(x.raw_pos[p % win], y.raw_pos[p % win]);
            }
            for (c, d) in [(&x.comp, &y.comp), (&x.index, &y.index)] {
                let (c, d) = match (c, d) {
                    (Some(c), Some(d)) => (c, d),
                    (None, None) => continue,
                    _ => panic!("layer {l}: a compressor on one side only"),
                };
                assert_eq!(bits(&c.rows), bits(&d.rows), "layer {l} rows");
                assert_eq!(bits(&c.front_kv), bits(&d.front_kv), "layer {l} frontier");
                assert_eq!(
                    bits(&c.front_score),
                    bits(&d.front_score),
                    "layer {l} scores"
                );
            }
        }
    }

    /// Row values a snapshot holds (raw window, compressed and indexer rows) and their arrays.
    fn row_values(st: &State, n: usize, win: usize) -> (usize, usize) {
        let mut vals = 0;
        let mut arrays = 0;
        for l in &st.layers {
            vals += n.min(win) * 128;
            arrays += 1;
            for c in [&l.comp, &l.index].into_iter().flatten() {
                vals += c.rows.len();
                arrays += 1;
            }
        }
        (vals, arrays)
    }

    #[test]
    fn rows_are_stored_as_f16_when_exact_and_read_back_in_bits() {
        let n = 41;
        let (hp, dims, st, logits) = state(n);
        let id = [7u8; 32];
        let v2 = write(&hp, &id, &st, Some(&logits));
        let v1 = write_version(&hp, &id, &st, Some(&logits), 1);
        // Half the bytes of every row value, one encoding word an array.
        let (vals, arrays) = row_values(&st, n, 8);
        assert_eq!(v1.len() - v2.len(), 2 * vals - 4 * arrays);
        for bytes in [&v2, &v1] {
            let (back, l) = read(&hp, &dims, &id, bytes).unwrap();
            same(&st, &back, n, 8);
            assert_eq!(l.unwrap(), logits);
        }
    }

    #[test]
    fn an_array_that_f16_does_not_hold_stays_f32() {
        let n = 41;
        let (hp, dims, mut st, _) = state(n);
        let id = [7u8; 32];
        let exact = write(&hp, &id, &st, None);
        // One value off f16 in the first layer with an indexer, a NaN with a payload in another
        // layer's raw window (its f16 would drop the payload); -0 is exact.
        let ix = st.layers.iter().position(|l| l.index.is_some()).unwrap();
        st.layers[ix].index.as_mut().unwrap().rows[5] = 0.1;
        st.layers[0].raw[3] = f32::from_bits(0x7fc0_0001);
        st.layers[1].raw[0] = -0.0;
        let rows = st.layers[ix].index.as_ref().unwrap().rows.len();
        let got = write(&hp, &id, &st, None);
        // The indexer array and layer 0's window in f32: 2 more bytes a value.
        assert_eq!(got.len() - exact.len(), 2 * rows + 2 * n.min(8) * 128);
        let (back, _) = read(&hp, &dims, &id, &got).unwrap();
        same(&st, &back, n, 8);
    }

    /// Hostile bytes under a valid checksum: any one byte changed (every 13th position, each
    /// to three values) and any cut gives a snapshot or an error, never a panic or a huge
    /// allocation.
    #[test]
    fn damaged_bodies_with_valid_checksums_never_panic() {
        let (hp, dims, st, logits) = state(13);
        let id = [7u8; 32];
        let good = write(&hp, &id, &st, Some(&logits));
        let seal = |b: &mut Vec<u8>| {
            let body = b.len() - 32;
            let sum: [u8; 32] = Sha256::digest(&b[..body]).into();
            b[body..].copy_from_slice(&sum);
        };
        let (mut ok, mut err) = (0, 0);
        for at in (8..good.len() - 32).step_by(13) {
            for v in [0u8, 0x7f, 0xff] {
                let mut b = good.clone();
                b[at] = v;
                seal(&mut b);
                match read(&hp, &dims, &id, &b) {
                    Ok(_) => ok += 1,
                    Err(_) => err += 1,
                }
            }
        }
        for cut in (8..good.len() - 32).step_by(97) {
            let mut b = good[..cut].to_vec();
            b.extend_from_slice(&[0u8; 32]);
            seal(&mut b);
            assert!(read(&hp, &dims, &id, &b).is_err(), "cut at {cut}");
        }
        // Values change silently (they are data); counts, encodings and sizes do not.
        assert!(ok > 0 && err > 0, "{ok} read, {err} refused");
    }

    #[test]
    fn a_bad_row_encoding_is_refused_with_its_offset() {
        let (hp, dims, st, _) = state(9);
        let id = [7u8; 32];
        let mut b = write(&hp, &id, &st, None);
        // The first layer's window encoding word sits right after the header and the tokens.
        let at = 8 + 4 + 32 + 6 * 4 + 9 * 4;
        assert_eq!(&b[at..at + 4], &ENC_F16.to_le_bytes());
        b[at] = 9;
        let body = b.len() - 32;
        let sum: [u8; 32] = Sha256::digest(&b[..body]).into();
        b[body..].copy_from_slice(&sum);
        let e = read(&hp, &dims, &id, &b).unwrap_err();
        let want = format!("unknown row encoding 9 at offset {at}");
        assert!(
            matches!(&e, ReadError::Invalid(s) if s.contains(&want)),
            "{e:?}"
        );
        // Fewer compressed rows than the tokens close (found by fuzz/snapshot_restore: the CPU's
        // attention then read past them).
        let (_, _, mut short, _) = state(9);
        let l = short.layers.iter().position(|h| h.comp.is_some()).unwrap();
        let c = short.layers[l].comp.as_mut().unwrap();
        let d = c.rows.len() / (9 / hp.compress_ratios[l] as usize);
        c.rows.truncate(c.rows.len() - d);
        let s = write(&hp, &id, &short, None);
        let e = read(&hp, &dims, &id, &s).unwrap_err();
        assert!(
            matches!(&e, ReadError::Invalid(m) if m.contains("compressed rows at offset")
                && m.contains("for 9 tokens (the layer holds")),
            "{e:?}"
        );
        // A token id outside the vocabulary (a later step would embed it).
        let mut t = write(&hp, &id, &st, None);
        let at = 8 + 4 + 32 + 6 * 4 + 4;
        assert_eq!(&t[at..at + 4], &1u32.to_le_bytes());
        t[at..at + 4].copy_from_slice(&hp.n_vocab.to_le_bytes());
        let body = t.len() - 32;
        let sum: [u8; 32] = Sha256::digest(&t[..body]).into();
        t[body..].copy_from_slice(&sum);
        let e = read(&hp, &dims, &id, &t).unwrap_err();
        let want = format!(
            "token 1 = {} at offset {at} is outside the vocabulary",
            hp.n_vocab
        );
        assert!(
            matches!(&e, ReadError::Invalid(s) if s.contains(&want)),
            "{e:?}"
        );
        // A sound file of a future version is told apart from a damaged one (a cache keeps
        // it); version 0 is damage.
        for (v, newer) in [(3u8, true), (0, false)] {
            let mut f = write(&hp, &id, &st, None);
            f[8] = v;
            let body = f.len() - 32;
            let sum: [u8; 32] = Sha256::digest(&f[..body]).into();
            f[body..].copy_from_slice(&sum);
            let e = read(&hp, &dims, &id, &f).unwrap_err();
            if newer {
                assert_eq!(e, ReadError::Newer(3));
            } else {
                assert!(
                    matches!(&e, ReadError::Invalid(s) if s.contains("unsupported version 0")),
                    "{e:?}"
                );
            }
        }
    }
}
