// Model glue ops: embedding, hyper-connections (split/collapse/post), router, elementwise.
#include "prelude.cuh"
