// Weight products beyond one vector: batched matmul, expert-indexed products.
#include "prelude.cuh"
