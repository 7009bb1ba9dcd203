//! Session snapshot format, version 1 (all little-endian):
//!
//! ```text
//! magic "DS4SNAP\0" | u32 version = 1 | [u8; 32] model id (SHA-256 of the GGUF header)
//! u32 n_tokens | u32 vocab | u32 n_layer | u32 head_dim | u32 window | u32 has_logits
//! u32 tokens[n_tokens] | f32 logits[vocab] (if has_logits)
//! per layer: f32 raw rows, min(n, window) rows of head_dim, oldest first
//!            if compressed: u32 rows, f32 rows[..], f32 front_kv[..], f32 front_score[..]
//!            if CSA:        the same for the indexer
//! [u8; 32] SHA-256 of everything above
//! ```
//! Frontier sizes are fixed by the model, so they are not stored. Raw rows are written in
//! position order (not ring order), so the format does not depend on a backend's ring layout.

use ds4_backend::{HostCompState as CompState, HostLayerState, LayerDims};
use ds4_model::forward::HostState as State;
use ds4_model::HParams;
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"DS4SNAP\0";
const VERSION: u32 = 1;

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_f32s(b: &mut Vec<u8>, v: &[f32]) {
    b.reserve(v.len() * 4);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

pub fn write(hp: &HParams, id: &[u8; 32], st: &State, logits: Option<&[f32]>) -> Vec<u8> {
    let hd = hp.head_dim as usize;
    let win = hp.sliding_window as usize;
    let n = st.tokens.len();
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    put_u32(&mut b, VERSION);
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
        put_f32s(b, &c.rows);
        put_f32s(b, &c.front_kv);
        put_f32s(b, &c.front_score);
    };
    for ls in &st.layers {
        for p in n.saturating_sub(win)..n {
            put_f32s(&mut b, &ls.raw[(p % win) * hd..(p % win + 1) * hd]);
        }
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
}

pub fn read(
    hp: &HParams,
    dims: &[LayerDims],
    id: &[u8; 32],
    bytes: &[u8],
) -> Result<(State, Option<Vec<f32>>), String> {
    if bytes.len() < MAGIC.len() + 4 + 32 + 32 || &bytes[..8] != MAGIC {
        return Err("not a ds4 session snapshot (bad magic)".into());
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    let want: [u8; 32] = Sha256::digest(body).into();
    if want != sum {
        return Err("checksum mismatch: the snapshot is corrupt".into());
    }
    let mut r = Reader { b: body, pos: 8 };
    let version = r.u32("version")?;
    if version != VERSION {
        return Err(format!(
            "unsupported version {version} (this build reads {VERSION})"
        ));
    }
    if r.take(32, "model id")? != id {
        return Err("taken with a different model file".into());
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
            return Err(format!("{what} {got} does not match the model's {want}"));
        }
    }
    let has_logits = r.u32("logits flag")? != 0;
    let mut st = State {
        tokens: Vec::new(),
        layers: dims.iter().map(HostLayerState::new).collect(),
    };
    if n > body.len() / 4 {
        return Err(format!("token count {n} exceeds the snapshot size"));
    }
    for _ in 0..n {
        st.tokens.push(r.u32("tokens")?);
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
    let comp = |r: &mut Reader, c: &mut CompState, d: usize, limit: usize| -> Result<(), String> {
        let rows = r.u32("compressed row count")? as usize;
        if rows > limit {
            return Err(format!("{rows} compressed rows for {n} tokens"));
        }
        c.rows = vec![0f32; rows * d];
        r.f32s(&mut c.rows, "compressed rows")?;
        r.f32s(&mut c.front_kv, "compressor frontier")?;
        r.f32s(&mut c.front_score, "compressor frontier scores")
    };
    for (l, ls) in st.layers.iter_mut().enumerate() {
        for p in n.saturating_sub(win)..n {
            r.f32s(
                &mut ls.raw[(p % win) * hd..(p % win + 1) * hd],
                "raw window rows",
            )?;
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
        ));
    }
    Ok((st, logits))
}
