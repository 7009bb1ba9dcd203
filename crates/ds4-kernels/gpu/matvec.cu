// Decode-time weight products (a few token rows): bandwidth-bound matvec kernels.
#include "prelude.cuh"
