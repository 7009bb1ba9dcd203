//! Chat prompt rendering, thinking modes and DSML tool calls for DeepSeek V4 Flash
//! (interfaces.md §2-4). Text in, text out: no tensors, no token ids.
//!
//! * [`render_chat_prompt`]: the server template; [`canonical_dsml`] and [`DsmlReplay`]
//!   for tool calls in history; [`render_tool_tail`] for live tool continuations.
//! * [`cli_one_shot`], [`CliChat`], [`render_completion_prompt`]: the other templates.
//! * [`ThinkControls`]: per-request thinking-mode resolution.
//! * [`parse_output`] / [`StreamParser`]: reasoning, content and tool calls out of the
//!   generated text, whole or chunk by chunk (same result).

mod dsml;
mod json;
pub mod protocol;
mod render;
mod stream;
mod think;

pub use dsml::{
    parse_output, parse_output_with, Dialect, DsmlError, DsmlErrorKind, DsmlStatus, ParseOptions,
    ParsedCall, ParsedOutput,
};
pub use protocol::*;
pub use render::{
    canonical_dsml, cli_one_shot, cli_prelude, cli_user_turn, escape_tool_result, is_prerendered,
    pieces_text, push_tool_result, render_chat_prompt, render_completion_prompt, render_tool_tail,
    tool_context, tool_schema_line, tools_section, ChatRequest, CliChat, DsmlReplay, Message,
    NoReplay, Piece, ReplayMap, Role, ToolCall,
};
pub use stream::{coalesce, SamplingState, StreamEvent, StreamParser};
pub use think::{parse_effort, Effort, ThinkControls, ThinkError, ThinkMode, ThinkResolution};
