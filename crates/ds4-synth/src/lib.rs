//! Synthetic DS4 GGUF generator.
