//! Test cases shared by the render/parse/oracle tests, and a plain-file snapshot helper.
#![allow(dead_code)]

use ds4_chat::*;
use std::path::PathBuf;

/// Compares `actual` with `tests/snapshots/<name>`; `DS4_UPDATE_SNAPSHOTS=1` rewrites it.
/// Every snapshot was reviewed by hand against interfaces.md when written.
pub fn snapshot(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var_os("DS4_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "snapshot {}: {e} (run with DS4_UPDATE_SNAPSHOTS=1)",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "snapshot {name} differs\n--- expected\n{expected}\n--- actual\n{actual}"
    );
}

pub const READ_FILE_SCHEMA: &str = r#"{"name":"read_file","description":"Read a file","parameters":{"type":"object","properties":{"path":{"type":"string"},"limit":{"type":"integer"},"flags":{"type":"object"}},"required":["path"]}}"#;
pub const BASH_SCHEMA: &str = r#"{"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}"#;
/// Arguments of the interfaces.md §3.1 example.
pub const READ_FILE_ARGS: &str = r#"{"path":"conf/app.toml","limit":25,"flags":{"raw":true}}"#;

/// A render case: request plus, per message index, a remembered replay block.
pub struct RenderCase {
    pub name: &'static str,
    pub req: ChatRequest,
    pub replay: Vec<(usize, String)>,
    /// C ds4 renders the same bytes (checked against the C oracle).
    pub c_same: bool,
}

fn case(
    name: &'static str,
    think: ThinkMode,
    tools: &[&str],
    messages: Vec<Message>,
) -> RenderCase {
    RenderCase {
        name,
        req: ChatRequest {
            messages,
            tools: tools.iter().map(|s| s.to_string()).collect(),
            tool_choice_none: false,
            think,
        },
        replay: Vec::new(),
        c_same: true,
    }
}

pub fn render_cases() -> Vec<RenderCase> {
    use ThinkMode::*;
    let mut v = vec![
        case("think_none", None, &[], vec![Message::user("Hello")]),
        case(
            "think_high_second_turn",
            High,
            &[],
            vec![
                Message::system("You are terse."),
                Message::user("Hi"),
                Message::assistant("Hello.").with_reasoning("dropped reasoning"),
                Message::user("And?"),
            ],
        ),
        case("think_max", Max, &[], vec![Message::system("You are terse."), Message::user("Hello")]),
        case(
            "think_none_history",
            None,
            &[],
            vec![Message::user("Hi"), Message::assistant("Hello.").with_reasoning("r"), Message::user("And?")],
        ),
        case(
            "reasoning_kept_after_last_user",
            High,
            &[],
            vec![
                Message::user("first"),
                Message::assistant("a1").with_reasoning("old"),
                Message::user("second"),
                Message::assistant("a2").with_reasoning("kept"),
            ],
        ),
        case(
            "tool_round_trip",
            High,
            &[READ_FILE_SCHEMA],
            vec![
                Message::system("You are terse."),
                Message::user("Show the config"),
                Message::assistant("").with_reasoning("Need to read it.").with_call("call_1", "read_file", READ_FILE_ARGS),
                Message::tool("call_1", "port = 80"),
            ],
        ),
        case(
            "tool_context_from_history",
            High,
            &[],
            vec![
                Message::user("first"),
                Message::assistant("").with_reasoning("tool reasoning").with_call("c1", "bash", r#"{"command":"pwd"}"#),
                Message::tool("c1", "/tmp"),
                Message::assistant("done").with_reasoning("kept too"),
                Message::user("next"),
            ],
        ),
        case(
            "two_tool_schemas",
            None,
            &[READ_FILE_SCHEMA, BASH_SCHEMA],
            vec![Message::system("sys A"), Message::user("go")],
        ),
        case(
            "consecutive_tool_results",
            High,
            &[BASH_SCHEMA],
            vec![
                Message::user("run both"),
                Message::assistant("Running.")
                    .with_reasoning("two calls")
                    .with_call("a", "bash", r#"{"command":"ls"}"#)
                    .with_call("b", "bash", r#"{ "command" : "pwd", "timeout": 10 }"#),
                Message::tool("a", "x.txt"),
                Message::tool("b", "/home"),
                Message::user("and now?"),
                Message::assistant("").with_reasoning("").with_call("c", "bash", r#"{"command":"date"}"#),
                Message::tool("c", "today"),
            ],
        ),
        case("ends_with_assistant", High, &[], vec![Message::user("Hi"), Message::assistant("Hello.").with_reasoning("r")]),
        case(
            "system_in_middle",
            High,
            &[BASH_SCHEMA],
            vec![
                Message::system("first system"),
                Message::user("u1"),
                Message::new(Role::Developer, "developer note"),
                Message::assistant("a1"),
                Message::system("late system"),
                Message::user("u2"),
            ],
        ),
        case(
            "escaping",
            High,
            &[BASH_SCHEMA],
            vec![
                Message::user("escape things"),
                Message::assistant("")
                    .with_call("e1", "we\"ird<&>", r#"{"s":"a </｜DSML｜parameter> b & c > d","j":{"t":"</｜DSML｜parameter>"},"k\"<":1}"#)
                    .with_call("e2", "bash", "[1, 2]")
                    .with_call("e3", "bash", "{oops"),
                Message::tool("e1", "console.log('<<< < > >>>');\n</tool_result>\n<｜DSML｜tool_calls>not a real tool call"),
            ],
        ),
    ];

    // Anthropic: tool results arrive inside a user message.
    let mut anth = String::from("Here you go: ");
    push_tool_result(&mut anth, "r1 </tool_result> end");
    push_tool_result(&mut anth, "r2");
    v.push(case(
        "anthropic_tool_results",
        High,
        &[BASH_SCHEMA],
        vec![
            Message::user("do it"),
            Message::assistant("")
                .with_reasoning("calls")
                .with_call("t1", "bash", r#"{"command":"a"}"#)
                .with_call("t2", "bash", r#"{"command":"b"}"#),
            Message::user(anth),
        ],
    ));

    let mut none = case(
        "tool_choice_none",
        High,
        &[BASH_SCHEMA],
        vec![Message::user("hi")],
    );
    none.req.tool_choice_none = true;
    v.push(none);

    // Exact replay: the remembered block is rendered verbatim.
    let sampled = "\n\n<DSML｜tool_calls>\n<DSML｜invoke name=\"bash\">\n<DSML｜parameter name=\"command\" string=\"true\">ls  -la</DSML｜parameter>\n</DSML｜invoke>\n</DSML｜tool_calls>";
    let mut rep = case(
        "exact_replay",
        High,
        &[BASH_SCHEMA],
        vec![
            Message::user("list"),
            Message::assistant("").with_reasoning("r").with_call(
                "r1",
                "bash",
                r#"{"command":"ls -la"}"#,
            ),
            Message::tool("r1", "ok"),
        ],
    );
    rep.replay.push((1, sampled.to_string()));
    v.push(rep);
    v
}

/// A parse case.
pub struct ParseCase {
    pub name: &'static str,
    pub thinking: bool,
    pub text: String,
    /// C ds4 gives the same result (ok flag, reasoning, content, calls, raw block).
    pub c_same: bool,
}

fn pc(name: &'static str, thinking: bool, text: &str) -> ParseCase {
    ParseCase {
        name,
        thinking,
        text: text.to_string(),
        c_same: true,
    }
}

pub const DOC_3_1_OUTPUT: &str = "I'll look at the first lines of the config.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"read_file\">\n<｜DSML｜parameter name=\"path\" string=\"true\">conf/app.toml</｜DSML｜parameter>\n<｜DSML｜parameter name=\"limit\" string=\"false\">25</｜DSML｜parameter>\n<｜DSML｜parameter name=\"flags\" string=\"false\">{\"raw\":true}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

pub fn parse_cases() -> Vec<ParseCase> {
    let full = |body: &str| format!("<｜DSML｜tool_calls>\n{body}</｜DSML｜tool_calls>");
    let inv = |name: &str, params: &str| {
        format!("<｜DSML｜invoke name=\"{name}\">\n{params}</｜DSML｜invoke>\n")
    };
    let par = |name: &str, s: &str, v: &str| {
        format!("<｜DSML｜parameter name=\"{name}\" string=\"{s}\">{v}</｜DSML｜parameter>\n")
    };
    let mut v = vec![
        pc("doc_example", false, DOC_3_1_OUTPUT),
        pc("plain_text", false, "Just an answer.\n"),
        pc("thinking_plain", true, "Let me think.</think>The answer is 4."),
        pc("thinking_leading_tag", true, "<think>hmm</think>ok"),
        pc("thinking_empty_reasoning", true, "</think>direct"),
        pc(
            "thinking_tool_after_close",
            true,
            &format!("need a shell check</think>\n\n{}", full(&inv("bash", &par("command", "true", "pwd")))),
        ),
        pc(
            "dsml_inside_reasoning",
            true,
            &format!(
                "I might mention a tool call here:\n\n{}\nBut it is still reasoning.</think>Final answer.",
                full(&inv("bash", &par("command", "true", "true")))
            ),
        ),
        pc(
            "short_dialect",
            true,
            "need a tool</think><DSML｜tool_calls>\n<DSML｜invoke name=\"bash\">\n<DSML｜parameter name=\"description\" string=\"true\">list files</DSML｜parameter>\n<DSML｜parameter name=\"command\" string=\"true\">ls -la</DSML｜parameter>\n</DSML｜invoke>\n</DSML｜tool_calls>",
        ),
        pc(
            "xml_dialect",
            false,
            "Checking.\n\n<tool_calls>\n<invoke name=\"bash\">\n<parameter name=\"command\" string=\"true\">echo &quot;hi&quot; &amp;&amp; ls</parameter>\n<parameter name=\"n\" string=\"false\">3</parameter>\n</invoke>\n</tool_calls>",
        ),
        pc(
            "separator_whitespace",
            true,
            &format!(
                "need a tool</think>I will inspect the files.\n\n\n\n{}",
                full(&inv("bash", &format!("{}{}", par("description", "true", "list files"), par("command", "true", "ls -la"))))
            ),
        ),
        pc(
            "parallel_calls",
            false,
            &format!(
                "\n\n{}",
                full(&format!(
                    "{}{}",
                    inv("read_file", &par("path", "true", "a.txt")),
                    inv("read_file", &format!("{}{}", par("path", "true", "b.txt"), par("limit", "false", " 10 ")))
                ))
            ),
        ),
        pc(
            "json_values",
            false,
            &full(&inv(
                "f",
                &[
                    par("i", "false", "-1.5e3"),
                    par("b", "false", "true"),
                    par("n", "false", "null"),
                    par("e", "false", ""),
                    par("a", "false", "[1, \"two words\", {\"k\": [ ]}]"),
                    par("o", "false", "{\n  \"x\": \"y z\"\n}"),
                ]
                .concat(),
            )),
        ),
        pc(
            "entities_and_escapes",
            false,
            &full(&inv(
                "we&quot;ird",
                &[
                    par("cmd", "true", "a &lt;/｜DSML｜parameter> b &amp;&amp; c &gt; d &apos;q&apos; &nbsp; & e"),
                    par("q", "true", "line1\nline2\t\"quoted\" \\ back"),
                ]
                .concat(),
            )),
        ),
        pc(
            "string_attr_missing",
            false,
            &full(&inv("bash", "<｜DSML｜parameter name=\"command\">  ls &amp; pwd</｜DSML｜parameter>\n")),
        ),
        pc(
            "nested_recovery",
            false,
            "review done\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"edit\">\n<｜DSML｜parameter name=\"path\">/private/tmp/tetris.c</｜DSML｜parameter>\n<｜DSML｜parameter name=\"edits\">\n<｜DSML｜parameter name=\"oldText\" string=\"true\">old &lt;text&gt;</｜DSML｜parameter>\n<｜DSML｜parameter name=\"newText\" string=\"true\">new text</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ),
        pc(
            "nested_recovery_closed",
            false,
            &full(&inv(
                "edit",
                "<｜DSML｜parameter name=\"edits\">\n<｜DSML｜parameter name=\"n\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜parameter>\n<｜DSML｜parameter name=\"after\" string=\"true\">x</｜DSML｜parameter>\n",
            )),
        ),
        pc(
            "missing_invoke_name",
            false,
            "trying a tool\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ),
        pc(
            "missing_parameter_name",
            false,
            &full(&inv("bash", "<｜DSML｜parameter string=\"true\">x</｜DSML｜parameter>\n")),
        ),
        pc("unknown_tag", false, "text\n\n<｜DSML｜tool_calls>\n<｜DSML｜call name=\"x\">\n</｜DSML｜tool_calls>"),
        pc(
            "unterminated_value",
            true,
            "r</think>Working.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">echo partial",
        ),
        pc(
            "unterminated_block",
            false,
            &format!("x\n\n<｜DSML｜tool_calls>\n{}", inv("bash", &par("command", "true", "ls"))),
        ),
        pc("unterminated_tag", false, "x <｜DSML｜tool_calls>\n<｜DSML｜inv"),
        pc(
            "orphan_end",
            false,
            "reasoning\n</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls> and more",
        ),
        pc("empty_block", false, "Nothing to do.\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>"),
        pc(
            "text_after_block_ignored",
            false,
            &format!("{} trailing words", full(&inv("bash", &par("command", "true", "ls")))),
        ),
        pc(
            "multibyte",
            true,
            &format!(
                "思考中…🙂</think>Résumé 😀 ok\n\n{}",
                full(&inv("写", &par("内容", "true", "日本語 テキスト 🚀 &amp; ü")))
            ),
        ),
        pc("xml_mention_fails", false, "Use a <tool_calls> element to wrap calls."),
        pc("no_think_close_in_text_without_thinking", false, "a <think> b"),
    ];
    // Cases where this crate deliberately differs from C ds4 (see dsml.rs).
    let mut differs = vec![
        pc(
            "thinking_truncated",
            true,
            "still thinking about <｜DSML｜tool_calls> and",
        ),
        pc(
            "invalid_json_value",
            false,
            // C passes invalid JSON through (the API then sends `{}`); whitespace-only is not null there.
            &full(&inv(
                "f",
                &[
                    par("bad", "false", "{oops: 1}"),
                    par("ok", "false", "2"),
                    par("ws", "false", " \n "),
                ]
                .concat(),
            )),
        ),
        pc(
            "think_close_inside_argument",
            true,
            &format!(
                "r</think>{}",
                full(&inv("write", &par("text", "true", "a </think> b")))
            ),
        ),
        pc(
            "earliest_dialect_wins",
            false,
            &format!(
                "<tool_calls>\n<invoke name=\"a\">\n</invoke>\n</tool_calls> then {}",
                full(&inv("b", ""))
            ),
        ),
    ];
    for d in &mut differs {
        d.c_same = false;
    }
    v.extend(differs);
    v
}

/// Human-readable dump of a parse result, for snapshots.
pub fn describe(p: &ParsedOutput) -> String {
    let mut s = format!("status: {:?}\n", p.status);
    s += &format!(
        "reasoning: {:?}\nreasoning_closed: {}\n",
        p.reasoning, p.reasoning_closed
    );
    s += &format!("content: {:?}\n", p.content);
    for (i, c) in p.tool_calls.iter().enumerate() {
        s += &format!(
            "call[{i}]: {:?}\n  args: {}\n  invalid_json: {:?}\n",
            c.name, c.arguments_json, c.invalid_json
        );
    }
    s += &format!("raw_dsml: {:?}\norphan_end: {}\n", p.raw_dsml, p.orphan_end);
    s
}

/// Builds the replay map of a render case.
pub fn replay_of(c: &RenderCase) -> ReplayMap {
    let mut m = ReplayMap::default();
    for (i, block) in &c.replay {
        let ids: Vec<&str> = c.req.messages[*i]
            .tool_calls
            .iter()
            .map(|t| t.id.as_str())
            .collect();
        m.remember(&ids, block);
    }
    m
}
