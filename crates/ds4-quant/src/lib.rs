//! Quantisation block formats (model.md §5).
