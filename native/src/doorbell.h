// Futex doorbells over a shared-memory segment (see doorbell.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace tandem {

void register_doorbell(pybind11::module_& m);

}  // namespace tandem
