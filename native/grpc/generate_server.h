// tandem_grpc's Generate server (generate_server.cpp), registered by the module in inline_stream.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace tandem {

void register_generate_server(pybind11::module_& m);

}  // namespace tandem
