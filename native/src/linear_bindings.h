// tandem_native.Linear (a dense linear layer packed for the expert kernels, linear.h) and the dense
// path's fused small steps (ops.h).
#pragma once
#include <pybind11/pybind11.h>

namespace tandem {

void register_linear(pybind11::module_& m);

}  // namespace tandem
