// tandem_grpc's Compute server (compute_server.cpp), registered by the module in inline_stream.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace tandem {

void register_compute_server(pybind11::module_& m);

}  // namespace tandem
