//! Progress bars on a terminal, nothing when stderr is piped.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A byte-count progress bar, hidden unless stderr is a terminal.
pub fn bytes(msg: &str, total: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A count progress bar (tokens), hidden unless stderr is a terminal.
pub fn count(msg: &str, total: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A spinner for steps of unknown length, hidden unless stderr is a terminal.
pub fn spinner(msg: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}
