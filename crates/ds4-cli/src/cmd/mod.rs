pub mod inspect;
pub mod synth;
pub mod tokenize;
