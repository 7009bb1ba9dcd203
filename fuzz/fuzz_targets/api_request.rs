//! Request bodies for the four endpoints (chat completions, completions, messages,
//! responses): arbitrary bytes that parse as JSON go through the server's request parsing
//! and prompt rendering. Every body is either refused with a client error (4xx, a message)
//! or rendered to a prompt; nothing panics.
#![no_main]

use ds4_chat::NoReplay;
use ds4_server::request;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    let ctx = 4096;
    let r = match sel % 4 {
        0 => request::chat(&v, body, ctx, &NoReplay),
        1 => request::completion(&v, ctx),
        2 => request::messages(&v, body, ctx, &NoReplay),
        _ => request::responses(&v, body, ctx, &NoReplay),
    };
    match r {
        Ok(p) => assert!(p.params.logprobs.is_none_or(|n| n <= 20)),
        Err(e) => {
            assert!(e.status.is_client_error(), "{e:?}");
            assert!(!e.message.is_empty());
        }
    }
});
