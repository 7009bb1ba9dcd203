// Prefill weight products: tensor-core GEMM (mma) with a portable fallback.
#include "prelude.cuh"
