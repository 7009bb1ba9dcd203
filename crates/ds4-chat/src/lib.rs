//! Chat prompt rendering and DSML (interfaces.md §3-4). Text in, text out: no tensors, no token ids.
