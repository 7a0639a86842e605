// The expert server's call path in native code (see expert_session.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace tandem {

void register_expert_sessions(pybind11::module_& m);

}  // namespace tandem
