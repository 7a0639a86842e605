// What the binding files share: a packed layer held from Python, and the checks on array arguments.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "dispatch.h"
#include "moe.h"

namespace tandem {

namespace py = pybind11;

// The kernel table chosen at import (bindings.cpp).
const KernelTable& active_kernels();

// A variant by name ("" for the active one).
inline const KernelTable& table(const std::string& isa) { return isa.empty() ? active_kernels() : kernels_for(isa); }

inline Format parse_format(const std::string& name) {
    if (name == "bf16") return Format::BF16;
    if (name == "int8") return Format::INT8;
    if (name == "int4") return Format::INT4;
    if (name == "int4_asym") return Format::INT4_ASYM;
    throw std::invalid_argument("fmt: unknown format '" + name + "' (bf16, int8, int4, int4_asym)");
}

// int4's 16 levels from Python (None: kInt4Levels), checked; only the int4 format takes them.
inline std::vector<int8_t> parse_levels(const py::object& levels, Format f) {
    std::vector<int8_t> table(kInt4Levels, kInt4Levels + 16);
    if (levels.is_none()) return table;
    if (f != Format::INT4) throw std::invalid_argument("levels: only the int4 format has levels");
    table = levels.cast<std::vector<int8_t>>();
    if (table.size() != 16) throw std::invalid_argument("levels: expected 16 values, got " + std::to_string(table.size()));
    for (int q = 0; q < 15; ++q)
        if (table[q] >= table[q + 1]) throw std::invalid_argument("levels: must be strictly increasing");
    return table;
}

struct PyLayer {  // a tandem_native.MoeLayer
    py::object owner;  // keeps the buffer alive
    MoeLayerView view;
};

inline std::string shape_of(const py::array& a) {
    std::string s = "[";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + "]";
}

// Checks dtype, rank, contiguity and (where given, >= 0) each dimension of an array argument.
template <typename T>
inline void check_array(const py::array& a, const char* name, const char* dtype, std::initializer_list<py::ssize_t> shape) {
    if (!py::isinstance<py::array_t<T>>(a) || a.dtype().itemsize() != py::ssize_t(sizeof(T)))
        throw std::invalid_argument(std::string(name) + ": expected dtype " + dtype + ", got " +
                                    std::string(py::str(a.dtype())));
    if (a.ndim() != py::ssize_t(shape.size()))
        throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(shape.size()) + " dims, got shape " +
                                    shape_of(a));
    if (!(a.flags() & py::array::c_style)) throw std::invalid_argument(std::string(name) + ": must be C-contiguous");
    int i = 0;
    for (py::ssize_t want : shape) {
        if (want >= 0 && a.shape(i) != want)
            throw std::invalid_argument(std::string(name) + ": shape " + shape_of(a) + ", dimension " + std::to_string(i) +
                                        " should be " + std::to_string(want));
        ++i;
    }
}

}  // namespace tandem
