//! DeepSeek byte-level BPE tokenizer.
