#include "linear_bindings.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_util.h"
#include "decode_layer.h"
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

// Linears of one input in one call, their outputs side by side: out [T, sum O].
void linears_forward(const std::vector<const PackedLinear*>& parts, py::array x, py::array out, ThreadPool& pool,
                     const std::string& isa) {
    if (parts.empty()) throw std::invalid_argument("linears: expected at least one");
    int width = 0;
    for (const PackedLinear* l : parts) {
        if (l->in() != parts[0]->in())
            throw std::invalid_argument("linears: in_features " + std::to_string(l->in()) + " and " +
                                        std::to_string(parts[0]->in()) + " differ");
        width += l->out();
    }
    check_array<float>(x, "x", "float32", {-1, parts[0]->in()});
    const py::ssize_t T = x.shape(0);
    check_array<float>(out, "out", "float32", {T, width});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    if (out.data() == x.data()) throw std::invalid_argument("out: must not alias x");
    const KernelTable& k = table(isa);
    const float* xp = static_cast<const float*>(x.data());
    float* yp = static_cast<float*>(out.mutable_data());
    py::gil_scoped_release release;
    pool.run([&] {
        int offset = 0;
        for (const PackedLinear* l : parts) {
            l->forward(pool, k, xp, int(T), yp + offset, width);
            offset += l->out();
        }
    });
}

void linear_forward(const PackedLinear& l, py::array x, py::array out, ThreadPool& pool, const std::string& isa) {
    linears_forward({&l}, x, out, pool, isa);
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

void py_add_rms_norm(py::array h, py::array delta, py::array w, float eps, py::array out) {
    check_array<float>(h, "h", "float32", {-1, -1});
    const py::ssize_t rows = h.shape(0), cols = h.shape(1);
    if (!h.writeable()) throw std::invalid_argument("h: must be writable");
    check_array<float>(delta, "delta", "float32", {rows, cols});
    check_array<float>(w, "weight", "float32", {cols});
    check_array<float>(out, "out", "float32", {rows, cols});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    if (!(eps >= 0.f)) throw std::invalid_argument("eps: must be >= 0");
    add_rms_norm(static_cast<float*>(h.mutable_data()), static_cast<const float*>(delta.data()),
                 static_cast<const float*>(w.data()), int(rows), int(cols), eps, static_cast<float*>(out.mutable_data()));
}

// A float32 [T, N, D] array whose last dimension is contiguous, as rows and heads with their strides
// (a query or key view into a fused projection's output, say).
HeadView head_view(const py::array& a, const char* name, bool writable) {
    if (!py::isinstance<py::array_t<float>>(a) || a.dtype().itemsize() != 4)
        throw std::invalid_argument(std::string(name) + ": expected dtype float32, got " + std::string(py::str(a.dtype())));
    if (a.ndim() != 3) throw std::invalid_argument(std::string(name) + ": expected 3 dims [T, N, D], got " + shape_of(a));
    if (a.strides(2) != 4 || a.strides(0) % 4 || a.strides(1) % 4 || a.strides(0) < 0 || a.strides(1) < 0)
        throw std::invalid_argument(std::string(name) + ": its last dimension must be contiguous");
    if (writable && !a.writeable()) throw std::invalid_argument(std::string(name) + ": must be writable");
    return {static_cast<float*>(const_cast<void*>(a.data())), long(a.strides(0) / 4), long(a.strides(1) / 4)};
}

void py_rope(py::array x, py::array cos, py::array sin, bool interleaved, py::array out, py::object norm_obj,
             float eps) {
    const HeadView src = head_view(x, "x", false), dst = head_view(out, "out", true);
    const py::ssize_t rows = x.shape(0), heads = x.shape(1), dim = x.shape(2);
    if (out.shape(0) != rows || out.shape(1) != heads || out.shape(2) != dim)
        throw std::invalid_argument("out: shape " + shape_of(out) + ", should be x's " + shape_of(x));
    check_array<float>(cos, "cos", "float32", {rows, -1});
    const py::ssize_t half = cos.shape(1);
    check_array<float>(sin, "sin", "float32", {rows, half});
    if (half < 1 || 2 * half > dim)
        throw std::invalid_argument("cos: " + std::to_string(half) + " angles do not fit heads of " + std::to_string(dim));
    py::array norm;
    if (!norm_obj.is_none()) {
        norm = norm_obj.cast<py::array>();
        check_array<float>(norm, "norm", "float32", {dim});
        if (!(eps >= 0.f)) throw std::invalid_argument("eps: must be >= 0");
    }
    const float* norm_p = norm_obj.is_none() ? nullptr : static_cast<const float*>(norm.data());
    py::gil_scoped_release release;
    rope(src, dst, int(rows), int(heads), int(dim), static_cast<const float*>(cos.data()),
         static_cast<const float*>(sin.data()), int(half), interleaved, norm_p, eps);
}

void py_linear_f32(py::array x, py::array w, py::object bias_obj, py::array out, ThreadPool& pool, const std::string& isa) {
    check_array<float>(x, "x", "float32", {-1, -1});
    const py::ssize_t rows = x.shape(0), in = x.shape(1);
    check_array<float>(w, "weight", "float32", {-1, in});
    const py::ssize_t outs = w.shape(0);
    check_array<float>(out, "out", "float32", {rows, outs});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    py::array bias;
    if (!bias_obj.is_none()) {
        bias = bias_obj.cast<py::array>();
        check_array<float>(bias, "bias", "float32", {outs});
    }
    const float *xp = static_cast<const float*>(x.data()), *wp = static_cast<const float*>(w.data());
    const float* bp = bias_obj.is_none() ? nullptr : static_cast<const float*>(bias.data());
    float* yp = static_cast<float*>(out.mutable_data());
    const KernelTable& k = table(isa);
    py::gil_scoped_release release;
    pool.run([&] { linear_f32(pool, k, xp, int(rows), int(in), wp, int(outs), bp, yp); });
}

void py_route_softmax_topk(py::array logits, int k, bool normalize, float scale, py::array ids, py::array weights) {
    check_array<float>(logits, "logits", "float32", {-1, -1});
    const py::ssize_t rows = logits.shape(0), experts = logits.shape(1);
    if (k < 1 || k > experts)
        throw std::invalid_argument("k: must be in [1, " + std::to_string(experts) + "], got " + std::to_string(k));
    check_array<int64_t>(ids, "ids", "int64", {rows, k});
    check_array<float>(weights, "weights", "float32", {rows, k});
    if (!ids.writeable() || !weights.writeable()) throw std::invalid_argument("ids, weights: must be writable");
    route_softmax_topk(static_cast<const float*>(logits.data()), int(rows), int(experts), k, normalize, scale,
                       static_cast<int64_t*>(ids.mutable_data()), static_cast<float*>(weights.mutable_data()));
}

void py_attend(py::array q, py::array k, py::array v, py::array mask, float scale, py::object sinks_obj, py::array out,
               ThreadPool& pool, py::object q2_obj, py::object k2_obj, py::object q_up_obj, py::object v_up_obj) {
    AttendArgs a{};
    a.q = head_view(q, "q", false);
    a.tokens = int(q.shape(0)), a.heads = int(q.shape(1)), a.q_dim = int(q.shape(2));
    py::array q_up, v_up;
    if (!q_up_obj.is_none()) {
        q_up = q_up_obj.cast<py::array>();
        check_array<float>(q_up, "q_up", "float32", {a.heads, a.q_dim, -1});
        a.n_dim = a.q_dim, a.q_dim = int(q_up.shape(2)), a.q_up = static_cast<const float*>(q_up.data());
    }
    check_array<float>(k, "k", "float32", {-1, -1, a.q_dim});
    a.positions = int(k.shape(0)), a.kv_heads = int(k.shape(1));
    check_array<float>(v, "v", "float32", {a.positions, a.kv_heads, -1});
    a.v_dim = int(v.shape(2));
    if (a.kv_heads < 1 || a.heads % a.kv_heads)
        throw std::invalid_argument("k: " + std::to_string(a.kv_heads) + " key heads do not divide " +
                                    std::to_string(a.heads) + " query heads");
    check_array<bool>(mask, "mask", "bool", {a.tokens, a.positions});
    if (!v_up_obj.is_none()) {
        v_up = v_up_obj.cast<py::array>();
        check_array<float>(v_up, "v_up", "float32", {a.heads, -1, a.v_dim});
        a.o_dim = int(v_up.shape(1)), a.v_up = static_cast<const float*>(v_up.data());
    }
    check_array<float>(out, "out", "float32", {a.tokens, py::ssize_t(a.heads) * (a.v_up ? a.o_dim : a.v_dim)});
    if (!out.writeable()) throw std::invalid_argument("out: must be writable");
    py::array sinks;
    if (!sinks_obj.is_none()) {
        sinks = sinks_obj.cast<py::array>();
        check_array<float>(sinks, "sinks", "float32", {a.heads});
        a.sinks = static_cast<const float*>(sinks.data());
    }
    if (q2_obj.is_none() != k2_obj.is_none()) throw std::invalid_argument("q2, k2: give both or neither");
    py::array q2, k2;
    if (!q2_obj.is_none()) {
        q2 = q2_obj.cast<py::array>(), k2 = k2_obj.cast<py::array>();
        a.q2 = head_view(q2, "q2", false);
        if (q2.shape(0) != a.tokens || q2.shape(1) != a.heads)
            throw std::invalid_argument("q2: shape " + shape_of(q2) + ", should be [T, H, D2] with q's T and H");
        a.q2_dim = int(q2.shape(2));
        check_array<float>(k2, "k2", "float32", {a.positions, a.kv_heads, a.q2_dim});
        a.k2 = static_cast<const float*>(k2.data());
    }
    a.k = static_cast<const float*>(k.data()), a.v = static_cast<const float*>(v.data());
    a.mask = static_cast<const bool*>(mask.data()), a.out = static_cast<float*>(out.mutable_data());
    a.scale = scale;
    const KernelTable& kernels = table("");
    py::gil_scoped_release release;
    pool.run([&] { attend(pool, kernels, a); });
}


const float* optional_floats(const py::object& obj, const char* name, py::ssize_t size, std::vector<py::object>& keep) {
    if (obj.is_none()) return nullptr;
    py::array a = obj.cast<py::array>();
    check_array<float>(a, name, "float32", {size});
    keep.push_back(a);
    return static_cast<const float*>(a.data());
}

std::vector<const PackedLinear*> linears_of(const std::vector<const PackedLinear*>& parts, const char* name, int in,
                                            int width) {
    int sum = 0;
    for (const PackedLinear* l : parts) {
        if (l->in() != in)
            throw std::invalid_argument(std::string(name) + ": in_features " + std::to_string(l->in()) + ", expected " +
                                        std::to_string(in));
        sum += l->out();
    }
    if (parts.empty() || sum != width)
        throw std::invalid_argument(std::string(name) + ": " + std::to_string(sum) + " outputs, expected " +
                                    std::to_string(width));
    return parts;
}

struct PyDecodeLayer {  // a tandem_native.DecodeLayer: the layer's arrays and linears, kept alive
    DecodeLayer layer;
    std::vector<py::object> keep;
};

std::unique_ptr<PyDecodeLayer> make_decode_layer(py::array input_norm, py::array post_norm, float eps,
                                                 const std::vector<const PackedLinear*>& qkv,
                                                 const std::vector<const PackedLinear*>& o, int heads, int kv_heads,
                                                 int head_dim, py::object q_norm, py::object k_norm, bool interleaved,
                                                 float scale, py::object sinks, py::object gate, py::object gate_bias,
                                                 py::list linears, int top_k, bool normalize, float route_scale) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 2)
        throw std::invalid_argument("heads, kv_heads, head_dim: " + std::to_string(kv_heads) + " key heads must divide " +
                                    std::to_string(heads) + " query heads of at least 2 dims");
    if (!(eps >= 0.f)) throw std::invalid_argument("eps: must be >= 0");
    auto p = std::make_unique<PyDecodeLayer>();
    DecodeLayer& L = p->layer;
    check_array<float>(input_norm, "input_norm", "float32", {-1});
    L.hidden = int(input_norm.shape(0));
    check_array<float>(post_norm, "post_norm", "float32", {L.hidden});
    L.input_norm = static_cast<const float*>(input_norm.data()), L.post_norm = static_cast<const float*>(post_norm.data());
    L.eps = eps, L.heads = heads, L.kv_heads = kv_heads, L.head_dim = head_dim, L.interleaved = interleaved;
    L.scale = scale;
    L.qkv = linears_of(qkv, "qkv", L.hidden, (heads + 2 * kv_heads) * head_dim);
    L.o = linears_of(o, "o", heads * head_dim, L.hidden);
    p->keep = {input_norm, post_norm, linears};
    L.q_norm = optional_floats(q_norm, "q_norm", head_dim, p->keep);
    L.k_norm = optional_floats(k_norm, "k_norm", head_dim, p->keep);
    L.sinks = optional_floats(sinks, "sinks", heads, p->keep);
    L.gate = L.gate_bias = nullptr, L.experts = 0;
    if (!gate.is_none()) {
        py::array g = gate.cast<py::array>();
        check_array<float>(g, "gate", "float32", {-1, L.hidden});
        L.experts = int(g.shape(0));
        L.gate = static_cast<const float*>(g.data());
        p->keep.push_back(g);
        L.gate_bias = optional_floats(gate_bias, "gate_bias", L.experts, p->keep);
    } else if (!gate_bias.is_none()) {
        throw std::invalid_argument("gate_bias: given without a gate");
    }
    if (top_k < 0 || top_k > L.experts)
        throw std::invalid_argument("top_k: must be in [0, " + std::to_string(L.experts) + "] (the router's experts), got " +
                                    std::to_string(top_k));
    L.top_k = top_k, L.normalize = normalize, L.route_scale = route_scale;
    return p;
}

// (row0, rows, k, v, first, start, mask, slots): k and v a layer cache [N, Hkv, Dh] whose sequence
// begins at row `first`, its step's rows going at first + start; or, with slots [>= start + rows]
// (first 0), position s at row slots[s] (a paged cache's block table).
DecodeSequence decode_sequence(const DecodeLayer& L, const py::tuple& t, int tokens) {
    if (t.size() != 8) throw std::invalid_argument("sequences: each is (row0, rows, k, v, first, start, mask, slots)");
    DecodeSequence s{};
    s.row0 = t[0].cast<int>(), s.rows = t[1].cast<int>();
    const int first = t[4].cast<int>();
    s.start = t[5].cast<int>();
    if (s.row0 < 0 || s.rows < 1 || s.row0 + s.rows > tokens || first < 0 || s.start < 0)
        throw std::invalid_argument("sequences: rows [" + std::to_string(s.row0) + ", " + std::to_string(s.row0 + s.rows) +
                                    ") at " + std::to_string(first) + " + " + std::to_string(s.start) + " out of range");
    const py::ssize_t end = py::ssize_t(first) + s.start + s.rows;
    py::array k = t[2].cast<py::array>(), v = t[3].cast<py::array>(), mask = t[6].cast<py::array>();
    check_array<float>(k, "k", "float32", {-1, L.kv_heads, L.head_dim});
    check_array<float>(v, "v", "float32", {k.shape(0), L.kv_heads, L.head_dim});
    if (end > k.shape(0)) throw std::invalid_argument("k: " + std::to_string(k.shape(0)) + " cache rows, " +
                                                      std::to_string(end) + " needed");
    if (!k.writeable() || !v.writeable()) throw std::invalid_argument("k, v: must be writable");
    check_array<bool>(mask, "mask", "bool", {s.rows, s.start + s.rows});
    const size_t offset = size_t(first) * L.kv_heads * L.head_dim;
    s.k = static_cast<float*>(k.mutable_data()) + offset, s.v = static_cast<float*>(v.mutable_data()) + offset;
    s.mask = static_cast<const bool*>(mask.data());
    s.slots = nullptr;
    if (!t[7].is_none()) {
        py::array slots = t[7].cast<py::array>();
        check_array<int64_t>(slots, "slots", "int64", {-1});
        if (first != 0 || slots.shape(0) < s.start + s.rows)
            throw std::invalid_argument("slots: " + std::to_string(slots.shape(0)) + " of them, " +
                                        std::to_string(s.start + s.rows) + " needed, with first 0");
        s.slots = static_cast<const int64_t*>(slots.data());
        for (int i = 0; i < s.start + s.rows; ++i)
            if (s.slots[i] < 0 || s.slots[i] >= k.shape(0))
                throw std::invalid_argument("slots: " + std::to_string(s.slots[i]) + " out of the cache's " +
                                            std::to_string(k.shape(0)) + " rows");
    }
    return s;
}

void py_decode_layer(const PyDecodeLayer& p, py::array h, py::object delta_obj, py::array cos, py::array sin,
                     py::list sequences, py::array x, py::object logits_obj, py::object ids_obj, py::object weights_obj,
                     ThreadPool& pool) {
    const DecodeLayer& L = p.layer;
    check_array<float>(h, "h", "float32", {-1, L.hidden});
    const int T = int(h.shape(0));
    if (T < 1 || !h.writeable()) throw std::invalid_argument("h: must be writable, with at least one row");
    py::array delta;
    if (!delta_obj.is_none()) {
        delta = delta_obj.cast<py::array>();
        check_array<float>(delta, "delta", "float32", {T, L.hidden});
    }
    check_array<float>(cos, "cos", "float32", {T, -1});
    const int half = int(cos.shape(1));
    check_array<float>(sin, "sin", "float32", {T, half});
    if (half < 1 || 2 * half > L.head_dim)
        throw std::invalid_argument("cos: " + std::to_string(half) + " angles do not fit heads of " + std::to_string(L.head_dim));
    check_array<float>(x, "x", "float32", {T, L.hidden});
    if (!x.writeable() || x.data() == h.data()) throw std::invalid_argument("x: must be writable and not h");
    py::array logits;
    if (L.gate) {
        if (logits_obj.is_none()) throw std::invalid_argument("logits: the layer has a router");
        logits = logits_obj.cast<py::array>();
        check_array<float>(logits, "logits", "float32", {T, L.experts});
        if (!logits.writeable()) throw std::invalid_argument("logits: must be writable");
    }
    py::array ids, weights;
    if (L.top_k) {
        if (ids_obj.is_none() || weights_obj.is_none()) throw std::invalid_argument("ids, weights: the layer routes");
        ids = ids_obj.cast<py::array>(), weights = weights_obj.cast<py::array>();
        check_array<int64_t>(ids, "ids", "int64", {T, L.top_k});
        check_array<float>(weights, "weights", "float32", {T, L.top_k});
        if (!ids.writeable() || !weights.writeable()) throw std::invalid_argument("ids, weights: must be writable");
    }
    std::vector<DecodeSequence> seqs;
    int covered = 0;
    for (const py::handle& item : sequences) {
        seqs.push_back(decode_sequence(L, item.cast<py::tuple>(), T));
        if (seqs.back().row0 != covered) throw std::invalid_argument("sequences: rows must follow each other from 0");
        covered += seqs.back().rows;
    }
    if (covered != T) throw std::invalid_argument("sequences: cover " + std::to_string(covered) + " of " + std::to_string(T) + " rows");
    float* hp = static_cast<float*>(h.mutable_data());
    const float* dp = delta_obj.is_none() ? nullptr : static_cast<const float*>(delta.data());
    const float *cp = static_cast<const float*>(cos.data()), *sp = static_cast<const float*>(sin.data());
    float* xp = static_cast<float*>(x.mutable_data());
    float* lp = L.gate ? static_cast<float*>(logits.mutable_data()) : nullptr;
    int64_t* ip = L.top_k ? static_cast<int64_t*>(ids.mutable_data()) : nullptr;
    float* wp = L.top_k ? static_cast<float*>(weights.mutable_data()) : nullptr;
    const KernelTable& kernels = table("");
    py::gil_scoped_release release;
    decode_layer(pool, kernels, L, hp, dp, T, cp, sp, half, seqs, xp, lp, ip, wp);
}

}  // namespace

void register_linear(py::module_& m) {
    m.def("rope", &py_rope, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("interleaved"), py::arg("out"),
          py::arg("norm") = py::none(), py::arg("eps") = 0.f,
          "out [T, N, D] = x's heads turned by the rows' angles cos, sin [T, R/2] (out may be x), float32; with "
          "norm [D], each head RMS-normed (eps) first");
    m.def("linear_f32", &py_linear_f32, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("pool"),
          py::arg("isa") = "", "out [M, O] = x [M, I] weight [O, I]^T (+ bias [O]), float32, every value summed in one "
          "fixed order (the variant's)");
    m.def("route_softmax_topk", &py_route_softmax_topk, py::arg("logits"), py::arg("k"), py::arg("normalize"),
          py::arg("scale"), py::arg("ids"), py::arg("weights"),
          "ids [T, k] int64 and weights [T, k] float32 of each row of logits [T, E]: the k most probable experts "
          "after a softmax (ties to the lower id), divided by their sum if normalize, times scale");
    m.def("attend", &py_attend, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
          py::arg("sinks"), py::arg("out"), py::arg("pool"), py::arg("q2") = py::none(), py::arg("k2") = py::none(),
          py::arg("q_up") = py::none(), py::arg("v_up") = py::none(),
          "out [T, H * Dv] = softmax(scale q k^T, where mask [T, S]; sinks [H] or None) v, q [T, H, Dq] against "
          "k [S, Hkv, Dq] and v [S, Hkv, Dv], float32: a few new tokens' attention over their cache; with q2 "
          "[T, H, D2] and k2 [S, Hkv, D2], each logit adds q2 . k2 (MLA's rotary part beside its latent); with "
          "q_up [H, Dn, Dq], q holds Dn values a head and head h's query is q[t, h] q_up[h]; with v_up [H, Do, Dv], "
          "head h's output is v_up[h] times its weighted values (out [T, H * Do]): absorbed MLA in one call");
    m.def("add_rms_norm", &py_add_rms_norm, py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
          py::arg("out"), "h [R, C] += delta, then out [R, C] = rms_norm(h) * weight, float32 (a residual add and "
          "the next norm in one call)");
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
    py::class_<PyDecodeLayer>(m, "DecodeLayer",
                              "A decoder layer's dense side for a few new tokens in one call (grouped-query attention)")
        .def(py::init(&make_decode_layer), py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"),
             py::arg("o"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("q_norm"),
             py::arg("k_norm"), py::arg("interleaved"), py::arg("scale"), py::arg("sinks"), py::arg("gate"),
             py::arg("gate_bias"), py::arg("linears"), py::arg("top_k") = 0, py::arg("normalize") = false,
             py::arg("route_scale") = 1.f,
             "norms [D], the qkv and o linears (lists of Linear; `linears` keeps them alive), per-head q and k "
             "norms [Dh] or None, sinks [H] or None, the router [E, D] and its bias [E] or None; top_k > 0: the "
             "call routes too, by softmax then top-k (route_softmax_topk's normalize and scale)")
        .def("forward", &py_decode_layer, py::arg("h"), py::arg("delta"), py::arg("cos"), py::arg("sin"),
             py::arg("sequences"), py::arg("x"), py::arg("logits"), py::arg("ids"), py::arg("weights"), py::arg("pool"),
             "h [T, D] += delta; its normed q, k, v (turned by cos, sin [T, R/2]); each sequence's (row0, rows, k, v, "
             "first, start, mask, slots) k and v rows into its cache [N, Hkv, Dh] at first + start and attention "
             "over [first, first + start + rows) where mask [rows, start + rows] (with slots [S] int64, position s "
             "at row slots[s]); h += o(attention); x [T, D] = its post norm; logits [T, E] = the router's products "
             "of x (None where the layer has none); ids and weights [T, k] its choice, where the layer routes");
    m.def("linears_forward", &linears_forward, py::arg("linears"), py::arg("x"), py::arg("out"), py::arg("pool"),
          py::arg("isa") = "", "out [T, sum O] = each linear's x [T, I] W^T (+ b) side by side, in one call");
}

}  // namespace tandem
