//! Byte-exact protocol strings the model was trained with. Extracted from
//! antirez/ds4 @ 8d57664 (`ds4.c:63`, `ds4_server.c:1997-2026`) by decoding the C
//! string literals; `tests/protocol.rs` checks their SHA-256. The `.txt` files
//! must never be edited or re-encoded (see `.gitattributes`).

/// Think-Max "Reasoning Effort" paragraph (476 bytes, ends in `\n\n`); goes right after BOS.
pub const THINK_MAX_PREFIX: &str = include_str!("protocol/think_max_prefix.txt");
/// Tools section header (1183 bytes), followed by the schema lines.
pub const TOOLS_PREAMBLE: &str = include_str!("protocol/tools_preamble.txt");
/// Tools section trailer (146 bytes, no trailing newline).
pub const TOOLS_POSTAMBLE: &str = include_str!("protocol/tools_postamble.txt");

/// Special token strings (interfaces.md §4.1). The bars are U+FF5C, `▁` is U+2581.
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
pub const DSML: &str = "｜DSML｜";

/// All special strings, for callers that split rendered text at specials.
pub const SPECIALS: [&str; 7] = [BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML];

/// System prompt of the CLI one-shot/REPL renderers and `/v1/completions` (no period).
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant";
/// System prompt of `ds4-bench --chat-prompt-file` (with period).
pub const BENCH_SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// Minimum context size for Think Max (DeepSeek's 384K recommendation).
pub const THINK_MAX_MIN_CONTEXT: u64 = 393_216;
