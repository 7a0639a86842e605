// Thin pybind11 bindings: argument validation at the edge, no compute, the GIL released around work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_util.h"
#include "dispatch.h"
#include "expert_session.h"
#include "linear_bindings.h"
#include "moe.h"
#include "selfcheck.h"

namespace py = pybind11;
using namespace tandem;

namespace {

const KernelTable* g_active = nullptr;

}  // namespace

const KernelTable& tandem::active_kernels() { return *g_active; }

namespace {

struct PyJob {
    std::shared_ptr<Job> job;
    py::object keep;  // the arguments, alive until the job is done

    void wait() {
        py::gil_scoped_release release;
        job->wait();
    }
};

// The hidden and intermediate sizes and the group size a format takes; throws naming them.
void check_dims(Format f, const std::string& fmt, int D, int I, int group) {
    const int align = std::max(kBlock, block_cols(f));
    if (D < 1 || I < 1 || D % align || I % align)
        throw std::invalid_argument("hidden (" + std::to_string(D) + ") and intermediate (" + std::to_string(I) +
                                    ") sizes must be multiples of " + std::to_string(align) + " for " + fmt);
    if (f != Format::BF16 && (group < kBlock || group % kBlock || D % group || I % group))
        throw std::invalid_argument("group_size: " + std::to_string(group) + " must be a multiple of 32 dividing hidden (" +
                                    std::to_string(D) + ") and intermediate (" + std::to_string(I) + ")");
}

ExpertShape parse_shape(const std::string& activation, float alpha, float limit, bool biases) {
    ExpertShape shape{Activation::SILU, alpha, limit, biases};
    if (activation == "swiglu_oai") shape.activation = Activation::SWIGLU_OAI;
    else if (activation != "silu") throw std::invalid_argument("activation: 'silu' or 'swiglu_oai', got '" + activation + "'");
    if (!std::isfinite(alpha) || !std::isfinite(limit) || limit < 0.f)
        throw std::invalid_argument("alpha, limit: must be finite, limit >= 0");
    return shape;
}

py::array_t<uint8_t> new_layer(const std::string& fmt, int E, int D, int I, int group, py::object levels,
                               const std::string& activation, float alpha, float limit, bool biases) {
    const Format f = parse_format(fmt);
    const ExpertShape shape = parse_shape(activation, alpha, limit, biases);
    if (E < 1) throw std::invalid_argument("experts: must be >= 1, got " + std::to_string(E));
    check_dims(f, fmt, D, I, group);
    const std::vector<int8_t> table = parse_levels(levels, f);
    const int g = f == Format::BF16 ? 0 : group;
    py::array_t<uint8_t> out(py::ssize_t(layer_bytes(f, E, D, I, g, biases)));
    init_layer(f, E, D, I, g, table.data(), shape, out.mutable_data());
    return out;
}


// A layer buffer being filled: its header valid (its scales not checked yet).
MoeLayerView filling_view(const py::array& buffer) {
    check_array<uint8_t>(buffer, "buffer", "uint8", {-1});
    return MoeLayerView::parse(static_cast<const uint8_t*>(buffer.data()), size_t(buffer.shape(0)), false);
}

// ... and writable, to be filled.
MoeLayerView filling(py::array& buffer) {
    if (!buffer.writeable()) throw std::invalid_argument("buffer: must be writable");
    return filling_view(buffer);
}

void pack_into(py::array buffer, int e0, py::array w13, py::array w2, ThreadPool& pool) {
    const MoeLayerView v = filling(buffer);
    check_array<float>(w13, "w13", "float32", {-1, 2 * v.intermediate, v.hidden});
    const int n = int(w13.shape(0));
    check_array<float>(w2, "w2", "float32", {n, v.hidden, v.intermediate});
    if (e0 < 0 || n < 1 || e0 + n > v.experts)
        throw std::invalid_argument("first_expert: experts [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                                    ") out of range [0, " + std::to_string(v.experts) + ")");
    const float* a = static_cast<const float*>(w13.data());
    const float* b = static_cast<const float*>(w2.data());
    py::gil_scoped_release release;
    pack_experts(pool, v, e0, e0 + n, a, b);
}

void put_codes_into(py::array buffer, int e, const std::string& matrix, int row0, py::array codes, py::array scales,
                    py::object mins_obj) {
    const MoeLayerView v = filling(buffer);
    if (v.format == Format::BF16) throw std::invalid_argument("buffer: a bf16 layer has no codes");
    if (matrix != "w13" && matrix != "w2") throw std::invalid_argument("matrix: 'w13' or 'w2', got '" + matrix + "'");
    if (e < 0 || e >= v.experts) throw std::invalid_argument("expert: " + std::to_string(e) + " out of range");
    const Matrix m = matrix == "w2" ? v.w2(e) : v.w13(e);
    check_array<uint8_t>(codes, "codes", "uint8", {-1, m.cols});
    const int rows = int(codes.shape(0));
    check_array<uint16_t>(scales, "scales", "uint16 (fp16 bits)", {rows, m.cols / m.group});
    if (row0 < 0 || rows < 1 || row0 + rows > m.rows)
        throw std::invalid_argument("row0: rows [" + std::to_string(row0) + ", " + std::to_string(row0 + rows) +
                                    ") out of range [0, " + std::to_string(m.rows) + ")");
    const uint8_t* c = static_cast<const uint8_t*>(codes.data());
    if (four_bit(v.format) && std::any_of(c, c + size_t(rows) * m.cols, [](uint8_t q) { return q > 15; }))
        throw std::invalid_argument("codes: 4-bit codes must be in [0, 15]");
    if ((v.format == Format::INT4_ASYM) != !mins_obj.is_none())
        throw std::invalid_argument("mins: int4_asym layers need them, and only they take them");
    py::array mins = mins_obj.is_none() ? py::array() : mins_obj.cast<py::array>();
    if (!mins_obj.is_none()) check_array<uint16_t>(mins, "mins", "uint16 (fp16 bits)", {rows, m.cols / m.group});
    put_codes(v, e, matrix == "w2", row0, rows, c, static_cast<const uint16_t*>(scales.data()),
              mins_obj.is_none() ? nullptr : static_cast<const uint16_t*>(mins.data()));
}

void put_biases_into(py::array buffer, int e, py::array b13, py::array b2) {
    const MoeLayerView v = filling(buffer);
    if (!v.biases) throw std::invalid_argument("buffer: the layer has no biases (new_layer(..., biases=True))");
    if (e < 0 || e >= v.experts) throw std::invalid_argument("expert: " + std::to_string(e) + " out of range");
    check_array<float>(b13, "b13", "float32", {2 * v.intermediate});
    check_array<float>(b2, "b2", "float32", {v.hidden});
    put_biases(v, e, static_cast<const float*>(b13.data()), static_cast<const float*>(b2.data()));
}

py::array_t<uint8_t> py_pack_experts(py::array w13, py::array w2, const std::string& fmt, int group, ThreadPool& pool) {
    const Format f = parse_format(fmt);
    check_array<float>(w13, "w13", "float32", {-1, -1, -1});
    const int E = int(w13.shape(0)), I2 = int(w13.shape(1)), D = int(w13.shape(2));
    if (E < 1 || D < 1 || I2 < 2 || I2 % 2) throw std::invalid_argument("w13: shape " + shape_of(w13) + " is not [E, 2I, D]");
    const int I = I2 / 2;
    check_array<float>(w2, "w2", "float32", {E, D, I});
    try {
        check_dims(f, fmt, D, I, group);
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(std::string("w13: ") + e.what());
    }
    const int g = f == Format::BF16 ? 0 : group;
    py::array_t<uint8_t> out(py::ssize_t(layer_bytes(f, E, D, I, g)));
    const float* a = static_cast<const float*>(w13.data());
    const float* b = static_cast<const float*>(w2.data());
    uint8_t* dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        pack_layer(pool, a, b, f, E, D, I, g, dst);
    }
    return out;
}

PyLayer make_layer(py::buffer buffer) {
    py::buffer_info info = buffer.request();
    if (info.ndim != 1 && !(info.strides.size() == 1 && info.strides[0] == info.itemsize))
        throw std::invalid_argument("buffer: must be one contiguous run of bytes");
    const size_t size = size_t(info.size) * size_t(info.itemsize);
    return PyLayer{buffer, MoeLayerView::parse(static_cast<const uint8_t*>(info.ptr), size)};
}

MoeCall make_call(const PyLayer& layer, py::array x, py::array ids, py::array weights, py::array out) {
    const int D = layer.view.hidden;
    check_array<float>(x, "x", "float32", {-1, D});
    const py::ssize_t T = x.shape(0);
    check_array<int64_t>(ids, "ids", "int64", {T, -1});
    const py::ssize_t K = ids.shape(1);
    if (K < 1 || K > layer.view.experts) throw std::invalid_argument("ids: top-k " + std::to_string(K) + " out of range");
    check_array<float>(weights, "weights", "float32", {T, K});
    check_array<float>(out, "out", "float32", {T, D});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    if (out.data() == x.data()) throw std::invalid_argument("out: must not alias x");
    const int64_t* id = static_cast<const int64_t*>(ids.data());
    for (py::ssize_t i = 0; i < T * K; ++i)
        if (id[i] < 0 || id[i] >= layer.view.experts)
            throw std::invalid_argument("ids: expert id " + std::to_string(id[i]) + " out of range [0, " +
                                        std::to_string(layer.view.experts) + ")");
    return MoeCall{&layer.view, static_cast<const float*>(x.data()), id, static_cast<const float*>(weights.data()),
                   static_cast<float*>(out.mutable_data()), int(T), int(K)};
}

PyJob submit(py::object layer_obj, py::array x, py::array ids, py::array weights, py::array out, py::object pool_obj,
             const std::string& isa) {
    const PyLayer& layer = layer_obj.cast<const PyLayer&>();
    ThreadPool& pool = pool_obj.cast<ThreadPool&>();
    const MoeCall call = make_call(layer, x, ids, weights, out);
    const KernelTable& k = table(isa);
    auto job = pool.submit([&pool, &k, call] { moe_forward(pool, k, call); });
    return PyJob{job, py::make_tuple(layer_obj, x, ids, weights, out, pool_obj)};
}

}  // namespace

PYBIND11_MODULE(tandem_native, m) {
    m.doc() = "Tandem's CPU MoE kernels (generic, AVX2, AVX-512 and AMX variants, the best chosen at import)";
    // TANDEM_NATIVE_ISA forces a variant as it is; otherwise the best one is checked against generic
    // first (TANDEM_NATIVE_SELFCHECK_FAULT=<variant> makes that one fail the check, for the tests).
    const char* forced = std::getenv("TANDEM_NATIVE_ISA");
    if (forced && *forced) {
        g_active = &select_kernels(forced);
    } else {
        const char* fault = std::getenv("TANDEM_NATIVE_SELFCHECK_FAULT");
        std::string warning;
        g_active = &checked_kernels(fault ? fault : "", warning);
        if (!warning.empty() && PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) != 0) throw py::error_already_set();
    }
    register_expert_sessions(m);
    register_linear(m);

    m.def("supported_isas", &supported_isas, "ISA variants this CPU runs, best last");
    m.def("active_isa", [] { return std::string(g_active->name); });

    py::class_<ThreadPool>(m, "ThreadPool")
        .def(py::init([](int threads, int spin_us) {
                 if (threads < 1) throw std::invalid_argument("threads: must be >= 1, got " + std::to_string(threads));
                 if (spin_us < 0 || spin_us > 100000)
                     throw std::invalid_argument("spin_us: must be in [0, 100000], got " + std::to_string(spin_us));
                 return std::make_unique<ThreadPool>(threads, spin_us);
             }),
             py::arg("threads"), py::arg("spin_us") = 50,
             "threads workers (the caller of a call counts as one); idle ones spin spin_us, then sleep")
        .def("park", &ThreadPool::park, "idle threads stop spinning and sleep until the next call")
        .def("unpark", &ThreadPool::unpark, "sleeping helpers wake and spin for the next call (ends a park early)")
        .def("warm", [](ThreadPool& pool, size_t address, size_t bytes) {
                 pool.warm(reinterpret_cast<const void*>(address), bytes);
             }, py::arg("address"), py::arg("nbytes"),
             "an idle helper reads [address, address + nbytes) into the caches until the next call")
        .def_property_readonly("size", &ThreadPool::size);

    py::class_<PyLayer>(m, "MoeLayer")
        .def(py::init(&make_layer), py::arg("buffer"), "A zero-copy view of a packed layer buffer")
        .def_property_readonly("format", [](const PyLayer& l) { return std::string(format_name(l.view.format)); })
        .def_property_readonly("num_experts", [](const PyLayer& l) { return l.view.experts; })
        .def_property_readonly("hidden", [](const PyLayer& l) { return l.view.hidden; })
        .def_property_readonly("intermediate", [](const PyLayer& l) { return l.view.intermediate; })
        .def_property_readonly("group_size", [](const PyLayer& l) { return l.view.group; })
        .def_property_readonly("activation", [](const PyLayer& l) {
            return std::string(l.view.activation == Activation::SILU ? "silu" : "swiglu_oai");
        })
        .def_property_readonly("biased", [](const PyLayer& l) { return l.view.biases != nullptr; })
        .def_property_readonly("levels", [](const PyLayer& l) {
            return l.view.levels ? std::vector<int>(l.view.levels, l.view.levels + 16) : std::vector<int>();
        })
        .def_property_readonly("nbytes", [](const PyLayer& l) {
            return layer_bytes(l.view.format, l.view.experts, l.view.hidden, l.view.intermediate, l.view.group,
                               l.view.biases != nullptr);
        });

    py::class_<PyJob>(m, "MoeJob").def("wait", &PyJob::wait).def("done", [](PyJob& j) { return j.job->done(); });

    m.def("new_layer", &new_layer, py::arg("fmt"), py::arg("experts"), py::arg("hidden"), py::arg("intermediate"),
          py::arg("group_size") = 32, py::arg("levels") = py::none(), py::arg("activation") = "silu",
          py::arg("alpha") = 0.f, py::arg("limit") = 0.f, py::arg("biases") = false,
          "An empty packed layer buffer (uint8) to fill with pack_into / put_codes (and put_biases); levels: "
          "int4's 16 int8 levels; activation 'silu' or 'swiglu_oai' (gpt-oss, with alpha and limit)");
    m.def("put_biases", &put_biases_into, py::arg("buffer"), py::arg("expert"), py::arg("b13"), py::arg("b2"),
          "Store expert e's float32 biases: b13 [2I] (gate, then up), b2 [D]");
    m.def("pack_into", &pack_into, py::arg("buffer"), py::arg("first_expert"), py::arg("w13"), py::arg("w2"),
          py::arg("pool"), "Quantize float32 w13 [n, 2I, D] and w2 [n, D, I] into experts first_expert .. + n - 1");
    m.def("put_codes", &put_codes_into, py::arg("buffer"), py::arg("expert"), py::arg("matrix"), py::arg("row0"),
          py::arg("codes"), py::arg("scales"), py::arg("mins") = py::none(),
          "Store already-quantized rows as they are: codes uint8 [rows, C], fp16 scales (and int4_asym's "
          "minimums) as uint16 [rows, C / G]");
    m.def(
        "dequantize",
        [](py::object layer, int e, const std::string& matrix) {
            const MoeLayerView v = py::isinstance<PyLayer>(layer) ? layer.cast<const PyLayer&>().view
                                                                 : filling_view(layer.cast<py::array>());
            if (e < 0 || e >= v.experts) throw std::invalid_argument("expert: " + std::to_string(e) + " out of range");
            if (matrix != "w13" && matrix != "w2") throw std::invalid_argument("matrix: 'w13' or 'w2', got '" + matrix + "'");
            const Matrix m = matrix == "w2" ? v.w2(e) : v.w13(e);
            py::array_t<float> out({py::ssize_t(m.rows), py::ssize_t(m.cols)});
            dequantize(m, out.mutable_data());
            return out;
        },
        py::arg("layer"), py::arg("expert"), py::arg("matrix"),
        "The float32 values of one packed matrix, [R, C], of a MoeLayer or a buffer being filled");
    m.def("pack_experts", &py_pack_experts, py::arg("w13"), py::arg("w2"), py::arg("fmt"), py::arg("group_size") = 32,
          py::arg("pool"), "float32 w13 [E, 2I, D] and w2 [E, D, I] -> a packed layer buffer (uint8)");
    m.def(
        "packed_bytes",
        [](const std::string& fmt, int experts, int hidden, int intermediate, int group, bool biases) {
            const Format f = parse_format(fmt);
            return layer_bytes(f, experts, hidden, intermediate, f == Format::BF16 ? 0 : group, biases);
        },
        py::arg("fmt"), py::arg("experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("group_size") = 32,
        py::arg("biases") = false,
        "Bytes of one packed layer buffer");
    m.def("moe_submit", &submit, py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("out"),
          py::arg("pool"), py::arg("isa") = "", "Start a fused MoE layer call; returns a MoeJob");
    m.def(
        "moe_forward",
        [](const PyLayer& layer, py::array x, py::array ids, py::array weights, py::array out, ThreadPool& pool,
           const std::string& isa) {
            const MoeCall call = make_call(layer, x, ids, weights, out);
            const KernelTable& k = table(isa);
            py::gil_scoped_release release;
            pool.run([&] { moe_forward(pool, k, call); });
        },
        py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("out"), py::arg("pool"),
        py::arg("isa") = "", "out[t] = sum_k weights[t,k] * expert_ids[t,k](x[t]), written in place");
}
