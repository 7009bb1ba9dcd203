//! Disk KV cache: session checkpoints keyed by the rendered prompt bytes they are a prefix of
//! (interfaces.md §5). The file format is documented in [`format`]; when to write checkpoints
//! is in [`policy`].
//!
//! * **Lookup** re-scans the directory on every call (it is disposable: files may vanish or
//!   appear at any time), keeps entries of this model whose key is a byte prefix of the
//!   prompt, and loads the longest (ties: more tokens, then most recently used). A candidate
//!   that fails full verification is logged once, deleted, and the next one is tried.
//! * **Last use** is the file's mtime, set when written and on every hit.
//! * **Eviction** after every write: least recently used first (unreadable files before
//!   any valid one) until the `*.kv` files in the directory fit the budget; the file just
//!   written is never evicted by its own write. Files of other models count toward the
//!   budget and are evicted like any other (the directory belongs to one cache).
//! * **Crash safety**: see [`format`]: temporary file, fsync, rename, fsync the directory.
//!   Temporary files left by dead processes are removed by [`KvStore::open`].
//! * Invalid files (truncated, corrupt, other format version, other model) are skipped with
//!   one `eprintln!` line per file and process, never loaded. A sound file whose snapshot the
//!   engine cannot read (a newer snapshot format) is marked with [`KvStore::pass_over`]:
//!   skipped from then on, and kept.

pub mod format;
pub mod policy;

pub use format::{FormatError, Header, Meta, Reason};
pub use policy::Policy;

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("kv cache {path}: {err}")]
    Io { path: PathBuf, err: io::Error },
    #[error("kv cache: {0}")]
    Invalid(String),
    #[error("kv cache: no entry in {dir} matches {what}")]
    NotFound { dir: PathBuf, what: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> KvError + '_ {
    move |err| KvError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// Caller-owned fields stored with a checkpoint.
#[derive(Clone, Debug)]
pub struct SaveMeta {
    pub reason: Reason,
    /// Stored verbatim in the header (ds4-server: bit1 Responses / bit2 thinking visible key).
    pub flags: u8,
    /// Context size of the session that was saved.
    pub ctx: u32,
    /// Opaque bytes returned with a hit (e.g. the exact-replay tool-id map).
    pub extra: Vec<u8>,
}

impl SaveMeta {
    pub fn new(reason: Reason, ctx: usize) -> SaveMeta {
        SaveMeta {
            reason,
            flags: 0,
            ctx: ctx.min(u32::MAX as usize) as u32,
            extra: Vec::new(),
        }
    }
}

/// What a save did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Saved {
    /// The file was written; `evicted` are the file names removed to respect the budget.
    Written {
        path: PathBuf,
        bytes: u64,
        evicted: Vec<String>,
    },
    /// An entry with the same key, model, tokens, flags and extra bytes already existed; its last-use
    /// time was refreshed instead.
    Unchanged { path: PathBuf },
    /// The file alone would exceed the space budget; nothing was written.
    TooLarge { bytes: u64, budget: u64 },
}

/// A loaded checkpoint. `key_len` bytes of the prompt are covered by `tokens`; the caller
/// restores `snapshot` into a session and tokenizes the rest of the prompt.
#[derive(Clone, Debug)]
pub struct Hit {
    pub key_len: usize,
    pub tokens: Vec<u32>,
    pub snapshot: Vec<u8>,
    pub extra: Vec<u8>,
    pub reason: Reason,
    pub flags: u8,
    pub ctx: u32,
    pub created: u64,
    pub path: PathBuf,
}

/// One `*.kv` file as found in a directory.
#[derive(Debug)]
pub struct EntryInfo {
    pub path: PathBuf,
    /// File stem: hex SHA-256 of (model id ‖ key).
    pub name: String,
    pub file_len: u64,
    /// The file's mtime.
    pub last_used: SystemTime,
    /// The verified head of the file, or why it is unreadable.
    pub meta: Result<Meta, FormatError>,
}

/// `<64 lowercase hex>.kv` → the stem.
fn entry_stem(file_name: &str) -> Option<&str> {
    let stem = file_name.strip_suffix(".kv")?;
    (stem.len() == 64 && stem.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')))
        .then_some(stem)
}

/// `<64 hex>.kv.tmp.<pid>.<seq>` → the pid.
fn tmp_pid(file_name: &str) -> Option<u32> {
    let (head, tail) = file_name.split_once(".kv.tmp.")?;
    entry_stem(&format!("{head}.kv"))?;
    tail.split('.').next()?.parse().ok()
}

/// Read the verified head of one file.
fn read_info(path: &Path, name: &str) -> io::Result<EntryInfo> {
    let f = File::open(path)?;
    let md = f.metadata()?;
    let meta = format::read_meta(&mut BufReader::new(f), md.len(), Some(name)).map(|m| m.0);
    Ok(EntryInfo {
        path: path.to_path_buf(),
        name: name.to_string(),
        file_len: md.len(),
        last_used: md.modified().unwrap_or(UNIX_EPOCH),
        meta,
    })
}

/// Every `*.kv` file in `dir`, verified up to its header checksum (the payload is not
/// read), sorted least recently used first. A missing directory is an empty list; files
/// that vanish while being listed are left out.
pub fn list_dir(dir: &Path) -> io::Result<Vec<EntryInfo>> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for de in rd {
        let de = match de {
            Ok(de) => de,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let fname = de.file_name();
        let Some(name) = fname.to_str().and_then(entry_stem) else {
            continue;
        };
        match read_info(&de.path(), name) {
            Ok(info) => out.push(info),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => out.push(EntryInfo {
                path: de.path(),
                name: name.to_string(),
                file_len: 0,
                last_used: UNIX_EPOCH,
                meta: Err(FormatError::Io(e)),
            }),
        }
    }
    out.sort_by(|a, b| (a.last_used, &a.name).cmp(&(b.last_used, &b.name)));
    Ok(out)
}

/// The extra bytes of a file with this (verified) header, read without the snapshot and
/// not checked against the file checksum.
fn read_extra(path: &Path, h: &Header) -> io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    f.seek(io::SeekFrom::Start(h.snapshot_offset() + h.snapshot_len))?;
    let mut extra = vec![0u8; h.extra_len as usize];
    f.read_exact(&mut extra)?;
    Ok(extra)
}

/// Read and fully verify one file (any name; `kv show`).
pub fn read_file(path: &Path) -> Result<format::Entry, FormatError> {
    let f = File::open(path)?;
    let len = f.metadata()?.len();
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(entry_stem);
    format::read_entry(&mut BufReader::with_capacity(1 << 20, f), len, name)
}

/// The entry whose file name starts with `prefix` (hex, `.kv` optional); it must be unique.
pub fn resolve(dir: &Path, prefix: &str) -> Result<PathBuf, KvError> {
    let p = prefix
        .strip_suffix(".kv")
        .unwrap_or(prefix)
        .to_ascii_lowercase();
    let all = list_dir(dir).map_err(io_err(dir))?;
    let found: Vec<_> = all.iter().filter(|e| e.name.starts_with(&p)).collect();
    match found.len() {
        1 => Ok(found[0].path.clone()),
        0 => Err(KvError::NotFound {
            dir: dir.to_path_buf(),
            what: format!("'{prefix}'"),
        }),
        n => Err(KvError::Invalid(format!(
            "'{prefix}' matches {n} entries in {}; give more of the name",
            dir.display()
        ))),
    }
}

/// Remove every `*.kv` file and leftover temporary file in `dir`; returns how many.
pub fn remove_all(dir: &Path) -> Result<usize, KvError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => {
            return Err(KvError::Io {
                path: dir.to_path_buf(),
                err: e,
            })
        }
    };
    let mut n = 0;
    for de in rd.flatten() {
        let fname = de.file_name();
        let Some(s) = fname.to_str() else { continue };
        if entry_stem(s).is_some() || tmp_pid(s).is_some() {
            match fs::remove_file(de.path()) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&de.path())(e)),
            }
        }
    }
    Ok(n)
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Set a file's last-use time (its mtime) to now.
fn touch(path: &Path) -> io::Result<()> {
    File::options()
        .write(true)
        .open(path)?
        .set_modified(SystemTime::now())
}

fn create_dir(dir: &Path) -> io::Result<()> {
    let mut b = fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

/// Whether a process id is running, when the platform can tell (`/proc`).
fn pid_alive(pid: u32) -> Option<bool> {
    let proc = Path::new("/proc");
    proc.join("self")
        .exists()
        .then(|| proc.join(pid.to_string()).exists())
}

/// The disk KV cache of one model. Safe to share between threads; several processes may use
/// the same directory.
pub struct KvStore {
    dir: PathBuf,
    budget: u64,
    model_id: [u8; 32],
    /// Files already reported as invalid (name, length, mtime): one log line each.
    logged: Mutex<HashSet<(String, u64, SystemTime)>>,
    /// Sound entries this process cannot use (path, creation time; [`KvStore::pass_over`]):
    /// lookups skip them without reading them again. A rewrite of the same key has another
    /// creation time, so it is looked at afresh.
    passed: Mutex<HashSet<(PathBuf, u64)>>,
    seq: AtomicU64,
}

impl KvStore {
    /// Open (creating it with mode 0700 if needed) a cache directory for the model with the
    /// given id, holding at most `budget_bytes` of `*.kv` files. Removes temporary files left
    /// by processes that died mid-write, and evicts down to the budget.
    pub fn open(
        dir: impl Into<PathBuf>,
        budget_bytes: u64,
        model_id: [u8; 32],
    ) -> Result<KvStore, KvError> {
        let dir = dir.into();
        create_dir(&dir).map_err(io_err(&dir))?;
        let s = KvStore {
            dir,
            budget: budget_bytes,
            model_id,
            logged: Mutex::new(HashSet::new()),
            passed: Mutex::new(HashSet::new()),
            seq: AtomicU64::new(0),
        };
        s.clean_tmp();
        s.enforce_budget(None)?;
        Ok(s)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn model_id(&self) -> &[u8; 32] {
        &self.model_id
    }

    /// Path of the entry for a key (whether or not it exists).
    pub fn path_for(&self, key: &[u8]) -> PathBuf {
        self.dir
            .join(format!("{}.kv", format::key_name(&self.model_id, key)))
    }

    fn log_once(&self, e: &EntryInfo, why: &str) {
        let id = (e.name.clone(), e.file_len, e.last_used);
        if self.logged.lock().unwrap().insert(id) {
            eprintln!("ds4 kv: skipping {}: {why}", e.path.display());
        }
    }

    /// Remove `*.kv.tmp.<pid>.*` files whose process is gone (or, where that cannot be
    /// told, that are over an hour old). Another live process's file is left alone (a
    /// writer in another PID namespace may look dead: its rename then fails cleanly).
    fn clean_tmp(&self) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        let me = std::process::id();
        for de in rd.flatten() {
            let fname = de.file_name();
            let Some(pid) = fname.to_str().and_then(tmp_pid) else {
                continue;
            };
            let stale = match pid_alive(pid) {
                _ if pid == me => false,
                Some(alive) => !alive,
                None => de
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(3600)),
            };
            if stale {
                let _ = fs::remove_file(de.path());
            }
        }
    }

    /// The valid entries of this model, least recently used first; invalid ones are
    /// logged once.
    pub fn list(&self) -> Vec<EntryInfo> {
        match list_dir(&self.dir) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("ds4 kv: cannot list {}: {e}", self.dir.display());
                Vec::new()
            }
        }
    }

    /// Check an entry's head against this store: logs and returns false for invalid files
    /// and files of other models.
    fn usable(&self, e: &EntryInfo) -> bool {
        match &e.meta {
            Err(FormatError::Io(err)) if err.kind() == io::ErrorKind::NotFound => false,
            Err(err) => {
                self.log_once(e, &err.to_string());
                false
            }
            Ok(m) if m.header.model_id != self.model_id => {
                self.log_once(
                    e,
                    &format!(
                        "written by another model (id {}…)",
                        &format::hex(&m.header.model_id)[..12]
                    ),
                );
                false
            }
            Ok(_) => true,
        }
    }

    /// The longest cached prefix of `prompt` holding between `min_tokens` and `max_tokens`
    /// tokens (ties: more tokens, then most recently used), fully verified. Its last-use
    /// time is refreshed. A candidate that fails verification is deleted and the next one
    /// tried. `None` when nothing matches (including a missing directory).
    pub fn lookup_longest_prefix(
        &self,
        prompt: &[u8],
        min_tokens: usize,
        max_tokens: usize,
    ) -> Option<Hit> {
        let mut cands: Vec<(EntryInfo, usize, usize)> = self
            .list()
            .into_iter()
            .filter(|e| self.usable(e))
            .filter_map(|e| {
                let m = e.meta.as_ref().ok()?;
                let n = m.tokens.len();
                let ok = prompt.starts_with(&m.key)
                    && n >= min_tokens
                    && n <= max_tokens
                    && !self.is_passed(&e.path, m.header.created);
                let k = m.key.len();
                ok.then_some((e, k, n))
            })
            .collect();
        // Longest key, then most tokens, then most recent.
        cands.sort_by_key(|c| std::cmp::Reverse((c.1, c.2, c.0.last_used)));
        for (info, _, _) in cands {
            let entry = match read_file(&info.path) {
                Ok(e) => e,
                Err(FormatError::Io(e)) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => {
                    self.log_once(&info, &err.to_string());
                    if err.is_corrupt() {
                        let _ = fs::remove_file(&info.path);
                    }
                    continue;
                }
            };
            let m = &entry.meta;
            // The file may have been replaced since it was listed: check again.
            let n = m.tokens.len();
            if m.header.model_id != self.model_id
                || !prompt.starts_with(&m.key)
                || n < min_tokens
                || n > max_tokens
            {
                continue;
            }
            let _ = touch(&info.path);
            return Some(Hit {
                key_len: m.key.len(),
                tokens: entry.meta.tokens,
                snapshot: entry.snapshot,
                extra: entry.extra,
                reason: entry.meta.header.reason,
                flags: entry.meta.header.flags,
                ctx: entry.meta.header.ctx,
                created: entry.meta.header.created,
                path: info.path,
            });
        }
        None
    }

    /// Mark a hit this process cannot use although the file is sound (a snapshot format
    /// newer than its engine reads): later lookups pass over it and it is not deleted; the
    /// budget still counts it and evicts it like any other entry.
    pub fn pass_over(&self, hit: &Hit) {
        self.passed
            .lock()
            .unwrap()
            .insert((hit.path.clone(), hit.created));
    }

    fn is_passed(&self, path: &Path, created: u64) -> bool {
        self.passed
            .lock()
            .unwrap()
            .contains(&(path.to_path_buf(), created))
    }

    /// The extra bytes of every valid entry of this model that has some, with its key:
    /// `(key, extra)`, least recently used first. Only the verified head and the extra bytes
    /// are read (not the snapshot), so the extra bytes are **not** checked against the
    /// file checksum: callers must validate them (e.g. against the verified key).
    pub fn extras(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        for e in self.list() {
            if !self.usable(&e) {
                continue;
            }
            let Ok(m) = e.meta.as_ref() else { continue };
            if m.header.extra_len == 0 {
                continue;
            }
            let at = m.header.snapshot_offset() + m.header.snapshot_len;
            match read_extra(&e.path, &m.header) {
                Ok(extra) => out.push((m.key.clone(), extra)),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    self.log_once(&e, &format!("reading extra bytes at offset {at}: {err}"))
                }
            }
        }
        out
    }

    /// Store a checkpoint: `key` is the rendered prompt prefix covered by `tokens`, whose
    /// session state is `snapshot`. Written atomically (temporary file, fsync, rename, fsync
    /// of the directory, which is recreated if it was deleted), then the budget is enforced.
    pub fn save(
        &self,
        key: &[u8],
        tokens: &[u32],
        snapshot: &[u8],
        meta: &SaveMeta,
    ) -> Result<Saved, KvError> {
        if key.is_empty() || tokens.is_empty() {
            return Err(KvError::Invalid(
                "a checkpoint needs a non-empty key and at least one token".into(),
            ));
        }
        let too_big = |what: &str, n: usize| {
            KvError::Invalid(format!("{what} of {n} exceeds the file format's limit"))
        };
        let header = Header {
            version: format::VERSION,
            model_id: self.model_id,
            reason: meta.reason,
            flags: meta.flags,
            n_tokens: u32::try_from(tokens.len())
                .map_err(|_| too_big("token count", tokens.len()))?,
            ctx: meta.ctx,
            created: now_unix(),
            key_len: u32::try_from(key.len()).map_err(|_| too_big("key length", key.len()))?,
            extra_len: u32::try_from(meta.extra.len())
                .map_err(|_| too_big("extra length", meta.extra.len()))?,
            snapshot_len: snapshot.len() as u64,
        };
        let bytes = header.file_len();
        if bytes > self.budget {
            return Ok(Saved::TooLarge {
                bytes,
                budget: self.budget,
            });
        }
        let name = format::key_name(&self.model_id, key);
        let path = self.dir.join(format!("{name}.kv"));
        if let Ok(info) = read_info(&path, &name) {
            if let Ok(m) = &info.meta {
                let h = &m.header;
                if h.model_id == self.model_id
                    && h.flags == meta.flags
                    && h.extra_len as usize == meta.extra.len()
                    && m.tokens == tokens
                    && h.snapshot_len == snapshot.len() as u64
                    && (meta.extra.is_empty()
                        || read_extra(&path, h).is_ok_and(|x| x == meta.extra))
                {
                    touch(&path).map_err(io_err(&path))?;
                    return Ok(Saved::Unchanged { path });
                }
            }
        }
        create_dir(&self.dir).map_err(io_err(&self.dir))?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!("{name}.kv.tmp.{}.{seq}", std::process::id()));
        let r = (|| -> io::Result<()> {
            let f = File::options().write(true).create_new(true).open(&tmp)?;
            let w = BufWriter::with_capacity(1 << 20, f);
            let mut w = format::write_entry(w, &header, key, tokens, snapshot, &meta.extra)?;
            w.flush()?;
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            f.set_modified(SystemTime::now())?;
            drop(f);
            fs::rename(&tmp, &path)?;
            // Make the rename durable.
            File::open(&self.dir)?.sync_all()
        })();
        if let Err(e) = r {
            let _ = fs::remove_file(&tmp);
            return Err(KvError::Io { path: tmp, err: e });
        }
        let evicted = self.enforce_budget(Some(&name))?;
        Ok(Saved::Written {
            path,
            bytes,
            evicted,
        })
    }

    /// Evict least recently used files (unreadable ones first) until the `*.kv` files fit
    /// the budget; `protect` (a file stem) is kept. Returns the removed stems.
    pub fn enforce_budget(&self, protect: Option<&str>) -> Result<Vec<String>, KvError> {
        let all = list_dir(&self.dir).map_err(io_err(&self.dir))?;
        let mut total: u64 = all.iter().map(|e| e.file_len).sum();
        let mut order: Vec<&EntryInfo> = all.iter().filter(|e| e.meta.is_err()).collect();
        order.extend(all.iter().filter(|e| e.meta.is_ok()));
        let mut evicted = Vec::new();
        for e in order {
            if total <= self.budget {
                break;
            }
            if Some(e.name.as_str()) == protect {
                continue;
            }
            match fs::remove_file(&e.path) {
                Ok(()) => evicted.push(e.name.clone()),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    // Still counts toward the total; try the next one.
                    eprintln!("ds4 kv: cannot evict {}: {err}", e.path.display());
                    continue;
                }
            }
            total -= e.file_len;
        }
        Ok(evicted)
    }

    /// Remove the entry for `key`; false if there was none.
    pub fn remove(&self, key: &[u8]) -> Result<bool, KvError> {
        let p = self.path_for(key);
        match fs::remove_file(&p) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err(&p)(e)),
        }
    }

    /// Bytes of `*.kv` files in the directory now.
    pub fn total_bytes(&self) -> u64 {
        self.list().iter().map(|e| e.file_len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_can_be_shared_between_threads() {
        fn sync<T: Send + Sync>() {}
        sync::<KvStore>();
    }

    #[test]
    fn names() {
        // FIPS 180-2 test vector.
        assert_eq!(
            format::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let stem = format::key_name(&[1; 32], b"abc");
        assert_eq!(
            stem,
            format::sha256_hex(&[[1u8; 32].as_slice(), b"abc"].concat())
        );
        assert_ne!(stem, format::key_name(&[2; 32], b"abc"));
        assert_eq!(entry_stem(&format!("{stem}.kv")), Some(stem.as_str()));
        assert_eq!(entry_stem("abc.kv"), None);
        assert_eq!(entry_stem(&format!("{}.kv", stem.to_uppercase())), None);
        assert_eq!(tmp_pid(&format!("{stem}.kv.tmp.123.4")), Some(123));
        assert_eq!(tmp_pid("x.kv.tmp.123.4"), None);
    }
}
