//! `ds4 kv ls|show|rm`: inspect and prune a disk KV cache directory (`--kv-disk-dir`).

use anyhow::{bail, Context, Result};
use ds4_kvstore::format::{self, hex};
use ds4_kvstore::{list_dir, remove_all, resolve, FormatError};
use std::fs::File;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// One line per entry: name, size, tokens, reason, age, last use, model id, key preview.
    Ls {
        dir: PathBuf,
        /// Also read every payload and check its checksum (slower).
        #[arg(long)]
        verify: bool,
    },
    /// Header fields of one `*.kv` file and a full validity check (exit status 1 if invalid).
    Show {
        file: PathBuf,
        /// Print the whole key text instead of a preview.
        #[arg(long)]
        key: bool,
        /// Print every token id.
        #[arg(long)]
        tokens: bool,
    },
    /// Remove one entry (by a unique prefix of its file name) or all of them.
    Rm {
        dir: PathBuf,
        /// File name or a unique prefix of it (hex, `.kv` optional).
        #[arg(required_unless_present = "all")]
        name: Option<String>,
        /// Remove every entry and leftover temporary file.
        #[arg(long, conflicts_with = "name")]
        all: bool,
    },
}

pub fn run(a: Args) -> Result<()> {
    let out = &mut std::io::stdout().lock();
    match a.cmd {
        Cmd::Ls { dir, verify } => ls(out, &dir, verify),
        Cmd::Show { file, key, tokens } => show(out, &file, key, tokens),
        Cmd::Rm { dir, name, all } => rm(out, &dir, name.as_deref(), all),
    }
}

/// "42s", "5m", "3h", "2d" for a duration in seconds.
fn ago(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn since(t: SystemTime) -> String {
    ago(SystemTime::now()
        .duration_since(t)
        .map_or(0, |d| d.as_secs()))
}

fn since_unix(secs: u64) -> String {
    since(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

fn size(b: u64) -> String {
    match b {
        b if b < 1 << 10 => format!("{b} B"),
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b if b < 1 << 30 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
    }
}

/// One-line, escaped preview of a key: its head and (more distinctive) tail.
fn preview(key: &[u8], head: usize, tail: usize) -> String {
    let text = String::from_utf8_lossy(key);
    let chars: Vec<char> = text.chars().collect();
    let esc = |c: &[char]| c.iter().flat_map(|c| c.escape_debug()).collect::<String>();
    if chars.len() <= head + tail + 1 {
        esc(&chars)
    } else {
        format!(
            "{}…{}",
            esc(&chars[..head]),
            esc(&chars[chars.len() - tail..])
        )
    }
}

fn ls(out: &mut dyn Write, dir: &Path, verify: bool) -> Result<()> {
    if !dir.is_dir() {
        bail!("{}: not a directory", dir.display());
    }
    let entries = list_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    writeln!(
        out,
        "{:<12} {:>10} {:>7} {:<9} {:>5} {:>5} {:<8} key",
        "name", "size", "tokens", "reason", "age", "used", "model"
    )?;
    let (mut total, mut bad) = (0u64, 0usize);
    // Most recently used first.
    for e in entries.iter().rev() {
        total += e.file_len;
        let mut meta = e.meta.as_ref().map_err(|err| err.to_string());
        if verify && meta.is_ok() {
            if let Err(err) = ds4_kvstore::read_file(&e.path) {
                meta = Err(err.to_string());
            }
        }
        match meta {
            Ok(m) => {
                let h = &m.header;
                writeln!(
                    out,
                    "{:<12} {:>10} {:>7} {:<9} {:>5} {:>5} {:<8} {}",
                    &e.name[..12],
                    size(e.file_len),
                    h.n_tokens,
                    h.reason.name(),
                    since_unix(h.created),
                    since(e.last_used),
                    &hex(&h.model_id)[..8],
                    preview(&m.key, 24, 40)
                )?;
            }
            Err(err) => {
                bad += 1;
                writeln!(
                    out,
                    "{:<12} {:>10} invalid: {err}",
                    &e.name[..12],
                    size(e.file_len)
                )?;
            }
        }
    }
    writeln!(
        out,
        "{} entries ({} invalid), {}",
        entries.len(),
        bad,
        size(total)
    )?;
    Ok(())
}

fn show(out: &mut dyn Write, path: &Path, full_key: bool, all_tokens: bool) -> Result<()> {
    let f = File::open(path).with_context(|| format!("{}", path.display()))?;
    let md = f.metadata()?;
    writeln!(out, "file         {} ({} bytes)", path.display(), md.len())?;
    let stem = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".kv"));
    // The head first (so a damaged payload still shows its header), then the whole file.
    let meta = match format::read_meta(&mut BufReader::new(f), md.len(), None) {
        Ok((m, _)) => m,
        Err(e) => {
            writeln!(out, "valid        no: {e}")?;
            bail!("{}: {e}", path.display());
        }
    };
    let h = &meta.header;
    let name_ok = stem == Some(format::key_name(&h.model_id, &meta.key).as_str());
    writeln!(out, "format       DS4KVC version {}", h.version)?;
    writeln!(out, "model id     {}", hex(&h.model_id))?;
    writeln!(out, "reason       {}", h.reason.name())?;
    writeln!(out, "flags        {:#04x}", h.flags)?;
    writeln!(out, "tokens       {}", h.n_tokens)?;
    writeln!(out, "context      {}", h.ctx)?;
    writeln!(
        out,
        "created      {} (unix), {} ago",
        h.created,
        since_unix(h.created)
    )?;
    if let Ok(t) = md.modified() {
        writeln!(out, "last used    {} ago (file mtime)", since(t))?;
    }
    writeln!(
        out,
        "key          {} bytes, SHA-256 {}",
        h.key_len,
        if name_ok {
            "matches the file name"
        } else {
            "does NOT match the file name"
        }
    )?;
    writeln!(out, "snapshot     {} bytes", h.snapshot_len)?;
    writeln!(out, "extra        {} bytes", h.extra_len)?;
    let full = ds4_kvstore::read_file(path);
    let verdict: Result<(), String> = match (&full, name_ok) {
        (Err(e), _) => Err(e.to_string()),
        (Ok(_), false) => Err(FormatError::Name {
            name: stem.unwrap_or("?").into(),
        }
        .to_string()),
        (Ok(_), true) => Ok(()),
    };
    match &verdict {
        Ok(()) => writeln!(out, "valid        yes (header and file checksums match)")?,
        Err(e) => writeln!(out, "valid        no: {e}")?,
    }
    let key = if full_key {
        String::from_utf8_lossy(&meta.key).into_owned()
    } else {
        preview(&meta.key, 60, 100)
    };
    writeln!(out, "key text     {key}")?;
    let shown = if all_tokens {
        meta.tokens.len()
    } else {
        meta.tokens.len().min(16)
    };
    let ids: Vec<String> = meta.tokens[..shown].iter().map(|t| t.to_string()).collect();
    let more = if shown < meta.tokens.len() {
        " …"
    } else {
        ""
    };
    writeln!(out, "token ids    [{}{more}]", ids.join(", "))?;
    if let Err(e) = verdict {
        bail!("{}: {e}", path.display());
    }
    Ok(())
}

fn rm(out: &mut dyn Write, dir: &Path, name: Option<&str>, all: bool) -> Result<()> {
    if !dir.is_dir() {
        bail!("{}: not a directory", dir.display());
    }
    if all {
        let n = remove_all(dir)?;
        writeln!(out, "removed {n} files from {}", dir.display())?;
        return Ok(());
    }
    let Some(name) = name else {
        bail!("give an entry name or --all");
    };
    let path = resolve(dir, name)?;
    std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    writeln!(out, "removed {}", path.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_kvstore::{KvStore, Reason, SaveMeta};

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ds4-cli-kv-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn text(f: impl FnOnce(&mut dyn Write) -> Result<()>) -> (String, Result<()>) {
        let mut v = Vec::new();
        let r = f(&mut v);
        (String::from_utf8(v).unwrap(), r)
    }

    #[test]
    fn ls_show_rm() {
        let d = dir("cmds");
        let store = KvStore::open(&d, 1 << 20, [0xab; 32]).unwrap();
        let meta = SaveMeta::new(Reason::Shutdown, 2048);
        store
            .save(b"<sys>alpha\nline two", &[1, 2, 3], &[5; 64], &meta)
            .unwrap();
        store.save(b"<sys>beta", &[4; 20], &[6; 64], &meta).unwrap();
        let (o, r) = text(|w| ls(w, &d, true));
        r.unwrap();
        assert!(o.contains("shutdown") && o.contains("abababab"), "{o}");
        assert!(o.contains("<sys>alpha\\nline two"), "{o}");
        assert!(o.contains("2 entries (0 invalid)"), "{o}");

        let alpha = store.path_for(b"<sys>alpha\nline two");
        let (o, r) = text(|w| show(w, &alpha, false, false));
        r.unwrap();
        assert!(o.contains("valid        yes"), "{o}");
        assert!(
            o.contains("tokens       3") && o.contains("[1, 2, 3]"),
            "{o}"
        );

        // A flipped payload byte: ls --verify and show both report it; show fails.
        let mut b = std::fs::read(&alpha).unwrap();
        let n = b.len();
        b[n - 40] ^= 1;
        std::fs::write(&alpha, &b).unwrap();
        let (o, r) = text(|w| show(w, &alpha, false, false));
        assert!(
            r.is_err() && o.contains("valid        no: checksum mismatch"),
            "{o}"
        );
        let (o, _) = text(|w| ls(w, &d, true));
        assert!(o.contains("2 entries (1 invalid)"), "{o}");
        let (o, _) = text(|w| ls(w, &d, false));
        assert!(o.contains("2 entries (0 invalid)"), "{o}");

        // rm by prefix, then --all.
        let stem = format::key_name(&[0xab; 32], b"<sys>beta");
        let (o, r) = text(|w| rm(w, &d, Some(&stem[..10]), false));
        r.unwrap();
        assert!(o.contains("removed"), "{o}");
        assert!(!store.path_for(b"<sys>beta").exists());
        assert!(text(|w| rm(w, &d, Some("zz"), false)).1.is_err());
        let (o, r) = text(|w| rm(w, &d, None, true));
        r.unwrap();
        assert!(o.contains("removed 1 files"), "{o}");
        let (o, _) = text(|w| ls(w, &d, false));
        assert!(o.contains("0 entries"), "{o}");
        assert!(text(|w| ls(w, &d.join("missing"), false)).1.is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn formatting() {
        assert_eq!(ago(5), "5s");
        assert_eq!(ago(600), "10m");
        assert_eq!(ago(3 * 3600), "3h");
        assert_eq!(ago(5 * 86400), "5d");
        assert_eq!(size(2048), "2.0 KiB");
        assert_eq!(preview(b"short", 2, 2), "short");
        assert_eq!(preview(b"0123456789", 2, 3), "01…789");
    }
}
