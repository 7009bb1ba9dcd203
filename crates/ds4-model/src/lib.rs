//! DS4 model description: hyper-parameters, layer schedule, weight binding.
