// Attention-state ops: RoPE, row rounding (FP8/FP4/f16), compressors, lightning indexer, sink attention.
#include "prelude.cuh"
