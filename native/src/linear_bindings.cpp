#include "linear_bindings.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_util.h"
#include "linear.h"
#include "ops.h"

namespace tandem {

namespace {

std::unique_ptr<PackedLinear> make_linear(const std::string& fmt, int out, int in, int group, py::object levels) {
    const Format f = parse_format(fmt);
    if (out < 1 || in < 1 || out > (1 << 24) || in > (1 << 20))
        throw std::invalid_argument("out_features, in_features: must be in [1, 2^24] and [1, 2^20], got " +
                                    std::to_string(out) + ", " + std::to_string(in));
    if (f != Format::BF16 && (group < kBlock || group % kBlock || group > 4096))
        throw std::invalid_argument("group_size: must be a multiple of 32 (at most 4096), got " + std::to_string(group));
    const std::vector<int8_t> table = parse_levels(levels, f);
    return std::make_unique<PackedLinear>(f, out, in, group, table.data());
}

int check_rows(const PackedLinear& l, int row0, py::ssize_t rows) {
    if (row0 < 0 || rows < 1 || row0 + rows > l.out())
        throw std::invalid_argument("row0: rows [" + std::to_string(row0) + ", " + std::to_string(row0 + rows) +
                                    ") out of range [0, " + std::to_string(l.out()) + ")");
    return int(rows);
}

void pack_linear(PackedLinear& l, py::array w, ThreadPool& pool, int row0) {
    check_array<float>(w, "weight", "float32", {-1, l.in()});
    const int rows = check_rows(l, row0, w.shape(0));
    const float* data = static_cast<const float*>(w.data());
    py::gil_scoped_release release;
    l.pack(pool, row0, rows, data);
}

void put_linear_codes(PackedLinear& l, int row0, py::array codes, py::array scales, py::object mins_obj) {
    if (l.format() == Format::BF16) throw std::invalid_argument("linear: a bf16 linear has no codes");
    check_array<uint8_t>(codes, "codes", "uint8", {-1, l.in()});
    const int rows = check_rows(l, row0, codes.shape(0));
    if (l.in() % l.group())
        throw std::invalid_argument("codes: in_features (" + std::to_string(l.in()) + ") is not a multiple of the group (" +
                                    std::to_string(l.group()) + ")");
    check_array<uint16_t>(scales, "scales", "uint16 (fp16 bits)", {rows, l.in() / l.group()});
    const uint8_t* c = static_cast<const uint8_t*>(codes.data());
    if (four_bit(l.format()) && std::any_of(c, c + size_t(rows) * l.in(), [](uint8_t q) { return q > 15; }))
        throw std::invalid_argument("codes: 4-bit codes must be in [0, 15]");
    if ((l.format() == Format::INT4_ASYM) != !mins_obj.is_none())
        throw std::invalid_argument("mins: int4_asym linears need them, and only they take them");
    py::array mins = mins_obj.is_none() ? py::array() : mins_obj.cast<py::array>();
    if (!mins_obj.is_none()) check_array<uint16_t>(mins, "mins", "uint16 (fp16 bits)", {rows, l.in() / l.group()});
    l.put_codes(row0, rows, c, static_cast<const uint16_t*>(scales.data()),
                mins_obj.is_none() ? nullptr : static_cast<const uint16_t*>(mins.data()));
}

void linear_forward(const PackedLinear& l, py::array x, py::array out, ThreadPool& pool, const std::string& isa) {
    check_array<float>(x, "x", "float32", {-1, l.in()});
    const py::ssize_t T = x.shape(0);
    check_array<float>(out, "out", "float32", {T, l.out()});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    if (out.data() == x.data()) throw std::invalid_argument("out: must not alias x");
    const KernelTable& k = table(isa);
    const float* xp = static_cast<const float*>(x.data());
    float* yp = static_cast<float*>(out.mutable_data());
    py::gil_scoped_release release;
    pool.run([&] { l.forward(pool, k, xp, int(T), yp); });
}

void py_rms_norm(py::array x, py::array w, float eps, py::array out) {
    check_array<float>(x, "x", "float32", {-1, -1});
    const py::ssize_t rows = x.shape(0), cols = x.shape(1);
    check_array<float>(w, "weight", "float32", {cols});
    check_array<float>(out, "out", "float32", {rows, cols});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    if (!(eps >= 0.f)) throw std::invalid_argument("eps: must be >= 0");
    rms_norm(static_cast<const float*>(x.data()), static_cast<const float*>(w.data()), int(rows), int(cols), eps,
             static_cast<float*>(out.mutable_data()));
}

}  // namespace

void register_linear(py::module_& m) {
    m.def("rms_norm", &py_rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out"),
          "out [R, C] = x / sqrt(mean(x^2) + eps) * weight, float32 (the dense path's RMSNorm in one call)");
    py::class_<PackedLinear>(m, "Linear", "A dense linear y = x W^T (+ b), W [O, I] packed in an expert format")
        .def(py::init(&make_linear), py::arg("fmt"), py::arg("out_features"), py::arg("in_features"),
             py::arg("group_size") = 32, py::arg("levels") = py::none())
        .def_property_readonly("format", [](const PackedLinear& l) { return std::string(format_name(l.format())); })
        .def_property_readonly("out_features", &PackedLinear::out)
        .def_property_readonly("in_features", &PackedLinear::in)
        .def_property_readonly("group_size", &PackedLinear::group)
        .def_property_readonly("biased", &PackedLinear::biased)
        .def_property_readonly("levels", [](const PackedLinear& l) {
            return l.levels() ? std::vector<int>(l.levels(), l.levels() + 16) : std::vector<int>();
        })
        .def_property_readonly("nbytes", &PackedLinear::nbytes)
        .def_property_readonly("address", [](const PackedLinear& l) { return reinterpret_cast<size_t>(l.matrix().data); },
                               "where the packed weights start (ThreadPool.warm)")
        .def("pack", &pack_linear, py::arg("weight"), py::arg("pool"), py::arg("row0") = 0,
             "Quantize float32 rows [row0, row0 + n) from weight [n, I]")
        .def("put_codes", &put_linear_codes, py::arg("row0"), py::arg("codes"), py::arg("scales"), py::arg("mins") = py::none(),
             "Store already-quantized rows as they are: codes uint8 [n, I], fp16 scales (and int4_asym's "
             "minimums) as uint16 [n, I / G]")
        .def("set_bias", [](PackedLinear& l, py::array b) {
            check_array<float>(b, "bias", "float32", {l.out()});
            l.set_bias(static_cast<const float*>(b.data()));
        }, py::arg("bias"))
        .def("dequantize", [](const PackedLinear& l) {
            py::array_t<float> out({py::ssize_t(l.out()), py::ssize_t(l.in())});
            l.dequantize(out.mutable_data());
            return out;
        }, "The float32 weight [O, I] the packed values stand for")
        .def("forward", &linear_forward, py::arg("x"), py::arg("out"), py::arg("pool"), py::arg("isa") = "",
             "out [T, O] = x [T, I] W^T (+ b), written in place");
}

}  // namespace tandem
