use ds4_chat::*;
use sha2::{Digest, Sha256};

fn sha(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn protocol_strings_are_byte_exact() {
    // Lengths and SHA-256 from interfaces.md §3.2 / §4.2.
    assert_eq!(THINK_MAX_PREFIX.len(), 476);
    assert_eq!(
        sha(THINK_MAX_PREFIX),
        "f7a24f3b3050d4a83781e9b755b316aae2ec1d9dc87562541d90bcb04d7350f7"
    );
    assert_eq!(TOOLS_PREAMBLE.len(), 1183);
    assert_eq!(
        sha(TOOLS_PREAMBLE),
        "de87922067300def6cde0b9a5c722c3248d708fb089b088b95c64f082d3a64ea"
    );
    assert_eq!(TOOLS_POSTAMBLE.len(), 146);
    assert_eq!(
        sha(TOOLS_POSTAMBLE),
        "fe26e2683a842d7f5378ebb38e2997e053770d962e3faae89e1d5bf8b8156498"
    );
    assert!(TOOLS_PREAMBLE.starts_with("## Tools\n\nYou have access to a set of tools"));
    assert!(TOOLS_PREAMBLE.ends_with("### Available Tool Schemas\n\n"));
    assert!(TOOLS_POSTAMBLE.starts_with("\n\nYou MUST strictly"));
    assert!(
        THINK_MAX_PREFIX.starts_with("Reasoning Effort: Absolute maximum")
            && THINK_MAX_PREFIX.ends_with("\n\n")
    );
}

#[test]
fn special_token_bytes() {
    // interfaces.md §4.1 byte lengths.
    let lens: Vec<usize> = SPECIALS.iter().map(|s| s.len()).collect();
    assert_eq!(lens, vec![29, 27, 12, 17, 7, 8, 10]);
    assert!(
        SPECIALS.iter().all(|s| !s.contains('|')),
        "bars must be U+FF5C"
    );
}
