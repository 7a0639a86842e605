// A layer call's path between the two services, in native code so no Python runs between a request
// and its answer:
//   Executor    checks a call against what an expert server holds (errors name the field) and runs
//               it on the kernels, x in float32 or bfloat16 bits; both transports end here.
//   ShmServer   the expert server's end of a co-located session: waits on the request doorbell,
//               validates the descriptor against the segment, computes, answers, rings back.
//   ShmClient   the dense side's end: copies a call in, publishes its descriptor, rings; waits on
//               the response doorbell and copies the result out.
// The segment layout is services/common/shm_layout.py's (shm_layout() here returns this side's
// numbers; a test checks that both agree). Everything read from the other process is read once into
// local memory (descriptor, expert ids, weights) and checked before use.
// T tokens, D hidden size, K experts per token, E experts in a layer.
#include "expert_session.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_util.h"
#include "copy.h"
#include "doorbell.h"
#include "tandem/executor_api.h"

namespace tandem {

namespace {

namespace layout {
constexpr size_t kHeaderBytes = 512, kPrewake = 32, kRequestSeq = 64, kRequest = 68, kRequestSleepers = 120, kResponseSeq = 128,
                 kResponse = 132, kResponseSleepers = 152, kMessage = 192, kMessageBytes = 256, kTrace = 448,
                 kTraceBytes = 62;
constexpr uint32_t kVersion = 4, kF32 = 1, kBF16 = 2, kTraceEach = 1;
constexpr uint32_t kOk = 0, kInvalidArgument = 3, kInternal = 13;
}  // namespace layout

using Invalid = std::invalid_argument;
std::string str(uint64_t v) { return std::to_string(v); }

template <typename T>
T load(const uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <typename T>
void put(uint8_t* p, T v) {
    std::memcpy(p, &v, sizeof v);
}

// One call's descriptor: "<IIIIIQQQQ" at kRequest.
struct Descriptor {
    uint32_t layer, tokens, hidden, top_k, x_dtype;
    uint64_t x, ids, weights, out;

    static Descriptor read(const uint8_t* base) {
        const uint8_t* p = base + layout::kRequest;
        return {load<uint32_t>(p),      load<uint32_t>(p + 4),  load<uint32_t>(p + 8),
                load<uint32_t>(p + 12), load<uint32_t>(p + 16), load<uint64_t>(p + 20),
                load<uint64_t>(p + 28), load<uint64_t>(p + 36), load<uint64_t>(p + 44)};
    }

    void write(uint8_t* base) const {
        uint8_t* p = base + layout::kRequest;
        put(p, layer), put(p + 4, tokens), put(p + 8, hidden), put(p + 12, top_k), put(p + 16, x_dtype);
        put(p + 20, x), put(p + 28, ids), put(p + 36, weights), put(p + 44, out);
    }
};

// ------------------------------------------------------------------------------------ Executor

class Executor {
public:
    Executor(py::dict layers, py::object pool, int hidden, int experts, int max_tokens, bool echo)
        : keep_(layers), pool_obj_(pool), pool_(&pool.cast<ThreadPool&>()), hidden_(hidden), experts_(experts),
          max_tokens_(max_tokens), echo_(echo) {
        for (auto item : layers) {
            const PyLayer& l = item.second.cast<const PyLayer&>();
            if (!echo && (l.view.hidden != hidden || l.view.experts != experts))
                throw Invalid("layers: layer " + std::string(py::str(item.first)) + " is " + str(l.view.experts) +
                              " experts x hidden " + str(l.view.hidden) + ", the server serves " + str(experts) +
                              " x " + str(hidden));
            views_[item.first.cast<int64_t>()] = &l.view;
        }
    }

    // A call's header, before any of its data is touched.
    void check(int64_t layer, int64_t tokens, int64_t hidden, int64_t top_k) const {
        if (!views_.count(layer)) {
            std::string owned = "[";
            for (const auto& kv : views_) owned += (owned.size() > 1 ? ", " : "") + std::to_string(kv.first);
            throw Invalid("layer: " + std::to_string(layer) + " is not served here (this server owns " + owned + "])");
        }
        if (hidden != hidden_)
            throw Invalid("hidden: the model's hidden size is " + str(hidden_) + ", the call has " + std::to_string(hidden));
        if (tokens < 1 || tokens > max_tokens_)
            throw Invalid("tokens: " + std::to_string(tokens) + " is outside [1, " + str(max_tokens_) + "]");
        if (top_k < 1 || top_k > experts_)
            throw Invalid("top_k: " + std::to_string(top_k) + " is outside [1, " + str(experts_) + "]");
    }

    // out [T, D] = the layer's weighted experts of x [T, D], both float32 or both bfloat16 bits;
    // ids [T, K] (checked here), weights [T, K]. One call at a time; call without the GIL.
    void run(int64_t layer, const void* x, void* out, bool bf16, const int64_t* ids, const float* weights, int T, int K) {
        for (int64_t i = 0; i < int64_t(T) * K; ++i)
            if (ids[i] < 0 || ids[i] >= experts_)
                throw Invalid("ids: expert id " + std::to_string(ids[i]) + " out of range [0, " + str(experts_) + ")");
        std::lock_guard<std::mutex> lock(mu_);
        const size_t n = size_t(T) * size_t(hidden_);
        if (echo_) {
            copy_bytes(out, x, n * (bf16 ? 2 : 4));
            return;
        }
        const float* x32 = static_cast<const float*>(x);
        float* out32 = static_cast<float*>(out);
        if (bf16) {
            x32_.resize(n), out32_.resize(n);
            const auto* xb = static_cast<const uint16_t*>(x);
            for (size_t i = 0; i < n; ++i) x32_[i] = bf16_to_float(xb[i]);
            x32 = x32_.data(), out32 = out32_.data();
        }
        const MoeCall call{views_.at(layer), x32, ids, weights, out32, T, K};
        const KernelTable& kernels = active_kernels();
        pool_->run([&] { moe_forward(*pool_, kernels, call); });
        if (bf16) {
            auto* ob = static_cast<uint16_t*>(out);
            for (size_t i = 0; i < n; ++i) ob[i] = float_to_bf16(out32_[i]);
        }
    }

    // run() for a call that came inline (gRPC): the helpers sleep after it rather than spin for the
    // pool's spin, which is sized for a shared-memory session's prewakes (that session parks them itself).
    void run_inline(int64_t layer, const void* x, void* out, bool bf16, const int64_t* ids, const float* weights,
                    int T, int K) {
        run(layer, x, out, bf16, ids, weights, T, K);
        pool_->park();
    }

    int max_tokens() const { return max_tokens_; }
    void park() { pool_->park(); }
    void park_on(const uint32_t* word, uint32_t value, double max_s) { pool_->park_on(word, value, max_s); }

    // This executor as a C table (executor_api.h) in a capsule that holds self (this executor's
    // Python object) alive while it lives.
    py::object api(py::object self) {
        api_ = {TANDEM_EXECUTOR_API_VERSION, this, &api_check, &api_run};
        PyObject* capsule = PyCapsule_New(&api_, TANDEM_EXECUTOR_API_NAME, [](PyObject* c) {
            Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(c)));
        });
        if (capsule == nullptr) throw py::error_already_set();
        PyCapsule_SetContext(capsule, self.inc_ref().ptr());
        return py::reinterpret_steal<py::object>(capsule);
    }

private:
    // An exception as the table's status and message: ValueError-like ones are INVALID_ARGUMENT.
    template <typename F>
    static int guarded(char* message, size_t cap, F&& f) {
        int status = 0;
        std::string what;
        try {
            f();
        } catch (const Invalid& e) {
            status = layout::kInvalidArgument, what = e.what();
        } catch (const std::exception& e) {
            status = layout::kInternal, what = e.what();
        }
        if (status && cap) {
            const size_t n = std::min(what.size(), cap - 1);
            std::memcpy(message, what.data(), n);
            message[n] = 0;
        }
        return status;
    }

    static int api_check(void* self, int64_t layer, int64_t tokens, int64_t hidden, int64_t top_k, char* message,
                         size_t cap) {
        return guarded(message, cap, [&] { static_cast<Executor*>(self)->check(layer, tokens, hidden, top_k); });
    }

    static int api_run(void* self, int64_t layer, const void* x, void* out, int bf16, const int64_t* ids,
                       const float* weights, int tokens, int top_k, char* message, size_t cap) {
        return guarded(message, cap, [&] {
            static_cast<Executor*>(self)->run_inline(layer, x, out, bf16 != 0, ids, weights, tokens, top_k);
        });
    }

    TandemExecutorApi api_{};
    py::dict keep_;
    py::object pool_obj_;
    ThreadPool* pool_;
    std::map<int64_t, const MoeLayerView*> views_;
    int hidden_, experts_, max_tokens_;
    bool echo_;
    std::mutex mu_;
    std::vector<float> x32_, out32_;  // a bfloat16 call's float32 copies, under mu_
};

// x as the wire carries it: float32, or bfloat16 bits in any 16-bit integer dtype.
uint32_t x_code(const py::array& x, const char* name) {
    const char kind = x.dtype().kind();
    if (kind == 'f' && x.itemsize() == 4) return layout::kF32;
    if ((kind == 'i' || kind == 'u') && x.itemsize() == 2) return layout::kBF16;
    throw Invalid(std::string(name) + ": expected float32 or bfloat16 bits (int16/uint16), got " +
                  std::string(py::str(x.dtype())));
}

void check_x(const py::array& a, const char* name, int64_t rows, int64_t cols) {
    if (a.ndim() != 2 || !(a.flags() & py::array::c_style) || (rows >= 0 && a.shape(0) != rows) ||
        (cols >= 0 && a.shape(1) != cols))
        throw Invalid(std::string(name) + ": expected a C-contiguous [" + (rows >= 0 ? str(rows) : "T") + ", " +
                      (cols >= 0 ? str(cols) : "D") + "] array, got shape " + shape_of(a));
}

void executor_run(Executor& ex, int64_t layer, py::array x, py::array ids, py::array weights, py::array out) {
    const uint32_t code = x_code(x, "x");
    check_x(x, "x", -1, -1);
    const int64_t T = x.shape(0), D = x.shape(1);
    check_array<int64_t>(ids, "ids", "int64", {T, -1});
    const int64_t K = ids.shape(1);
    check_array<float>(weights, "weights", "float32", {T, K});
    if (x_code(out, "out") != code) throw Invalid("out: must have x's dtype");
    check_x(out, "out", T, D);
    if (!out.writeable()) throw Invalid("out: must be writable");
    ex.check(layer, T, D, K);
    const void* xp = x.data();
    void* op = out.mutable_data();
    if (xp == op) throw Invalid("out: must not alias x");
    const auto* ip = static_cast<const int64_t*>(ids.data());
    const auto* wp = static_cast<const float*>(weights.data());
    py::gil_scoped_release release;
    ex.run_inline(layer, xp, op, code == layout::kBF16, ip, wp, int(T), int(K));
}

// ------------------------------------------------------------------------------------ the segment

// A mapped segment held from Python (an mmap): exported while held, so it cannot be unmapped under a
// wait. release() drops it, at once or when the call in progress (without the GIL) returns.
class Mapping {
public:
    explicit Mapping(py::buffer buffer) : info_(std::make_unique<py::buffer_info>(buffer.request(true))) {
        if (info_->readonly) throw Invalid("segment: must be writable");
        if (info_->ndim != 1 || info_->itemsize != 1) throw Invalid("segment: must be a flat run of bytes");
        size_ = size_t(info_->size);
        if (size_ < layout::kHeaderBytes)
            throw Invalid("segment: " + str(size_) + " bytes is less than the header's " + str(layout::kHeaderBytes));
        base_ = static_cast<uint8_t*>(info_->ptr);
        if (reinterpret_cast<uintptr_t>(base_) % 64) throw Invalid("segment: must be 64-byte aligned");
    }

    uint8_t* base() const {
        if (base_ == nullptr) throw std::runtime_error("segment: released");
        return base_;
    }
    size_t size() const { return size_; }
    uint32_t* word(size_t offset) const { return reinterpret_cast<uint32_t*>(base() + offset); }
    Bell request() const { return {word(layout::kRequestSeq), word(layout::kRequestSleepers)}; }
    Bell response() const { return {word(layout::kResponseSeq), word(layout::kResponseSleepers)}; }

    // [offset, offset + nbytes) inside the data area and aligned to `align`, or an error naming field.
    uint8_t* region(const char* field, uint64_t offset, uint64_t nbytes, uint64_t align) const {
        if (offset < layout::kHeaderBytes || offset > size_ || nbytes > size_ - offset || offset % align)
            throw Invalid(std::string(field) + ": " + str(nbytes) + " bytes at offset " + str(offset) +
                          " fall outside the data area [" + str(layout::kHeaderBytes) + ", " + str(size_) +
                          ") or are misaligned");
        return base() + offset;
    }

    // Held around work done without the GIL (taken and dropped with the GIL held).
    struct Busy {
        explicit Busy(Mapping& m) : m(m) { ++m.busy_; }
        ~Busy() {
            if (--m.busy_ == 0 && m.released_) m.drop();
        }
        Mapping& m;
    };

    void release() {
        released_ = true;
        if (busy_ == 0) drop();
    }

    bool released() const { return released_; }

private:
    void drop() {
        base_ = nullptr;
        info_.reset();
    }

    std::unique_ptr<py::buffer_info> info_;
    uint8_t* base_ = nullptr;
    size_t size_ = 0;
    int busy_ = 0;
    bool released_ = false;
};

void check_wait(double spin_us, double timeout_s) {
    if (!(spin_us >= 0) || !std::isfinite(spin_us) || !(timeout_s >= 0) || !std::isfinite(timeout_s))
        throw Invalid("spin_us and timeout_s must be finite and >= 0");
}

// ------------------------------------------------------------------------------------ server end

class ShmServer {
public:
    ShmServer(py::buffer segment, py::object executor, uint32_t max_tokens, double spin_us)
        : map_(segment), executor_obj_(executor), ex_(&executor.cast<Executor&>()), spin_us_(spin_us),
          max_tokens_(max_tokens) {
        check_wait(spin_us, 0);
        seen_ = bell_load(map_.word(layout::kRequestSeq));
    }

    // Waits up to timeout_s for a call and answers it; then, until hold_s after that answer, answers
    // the calls that follow too, without going back to Python between them (a traced or failed call
    // returns at once, for its span or its log line). None when no call came (a timeout or a wake);
    // else (status, layer, tokens, start_ns, end_ns, traceparent, trace_each) of the last call answered.
    py::object serve_next(double timeout_s, double hold_s) {
        check_wait(0, timeout_s);
        if (!(hold_s >= 0) || !std::isfinite(hold_s)) throw Invalid("hold_s must be finite and >= 0");
        const Bell request = map_.request();
        Mapping::Busy busy(map_);
        bool called = false;
        {
            py::gil_scoped_release release;
            using clock = std::chrono::steady_clock;
            clock::time_point hold_end;
            for (double wait_s = timeout_s; wait_s > 0;) {
                const uint32_t seq = spin_.wait(request, seen_, spin_us_, wait_s);
                if (seq == seen_) break;  // a timeout or a wake (a call published before a stop is still answered)
                seen_ = seq;
                serve(seq);
                if (!called) hold_end = clock::now() + std::chrono::duration_cast<clock::duration>(
                                                           std::chrono::duration<double>(hold_s));
                called = true;
                if (last_.trace_len || (last_.status != layout::kOk && last_.status != layout::kInvalidArgument)) break;
                wait_s = std::chrono::duration<double>(hold_end - clock::now()).count();
            }
        }
        if (!called) return py::none();
        const Answer& a = last_;
        return py::make_tuple(a.status, a.layer, a.tokens, a.start_ns, a.end_ns,
                              py::str(a.trace, a.trace_len), a.trace_each);
    }

    void wake() {
        if (!map_.released()) bell_wake(map_.request());
    }

    void release() { map_.release(); }

private:
    struct Answer {
        uint32_t status = 0, layer = 0, tokens = 0;
        int64_t start_ns = 0, end_ns = 0;
        char trace[layout::kTraceBytes];
        size_t trace_len = 0;
        bool trace_each = false;
    };

    // Answers call seq and rings its caller; the cores go back to the caller until its next call, the
    // helpers waiting for its prewake and this thread (back in serve_next's wait) for the call.
    void serve(uint32_t seq) {
        answer();
        const uint32_t* prewake = map_.word(layout::kPrewake);
        ex_->park_on(prewake, bell_load(prewake), kPrewakeParkS);
        bell_ring(map_.response(), seq);
    }

    void answer() {
        uint8_t* base = map_.base();
        const Descriptor d = Descriptor::read(base);
        Answer& a = last_;
        a.layer = d.layer, a.tokens = d.tokens;
        std::string message;
        a.status = layout::kOk;
        a.start_ns = wall_ns();
        try {
            compute(d);
        } catch (const Invalid& e) {
            a.status = layout::kInvalidArgument, message = e.what();
        } catch (const std::exception& e) {
            a.status = layout::kInternal, message = e.what();
        }
        a.end_ns = wall_ns();
        a.trace_each = base[layout::kTrace] & layout::kTraceEach;
        a.trace_len = std::min<size_t>(base[layout::kTrace + 1], layout::kTraceBytes);
        std::memcpy(a.trace, base + layout::kTrace + 2, a.trace_len);
        const size_t length = std::min(message.size(), layout::kMessageBytes);
        uint8_t* r = base + layout::kResponse;
        put(r, a.status), put(r + 4, uint32_t(length)), put(r + 8, uint32_t(0));
        put(r + 12, a.status ? 0.0 : double(a.end_ns - a.start_ns) / 1e9);
        std::memcpy(base + layout::kMessage, message.data(), length);
    }

    void compute(const Descriptor& d) {
        if (d.tokens > max_tokens_)
            throw Invalid("tokens: " + str(d.tokens) + " is over the session's capacity of " + str(max_tokens_));
        ex_->check(d.layer, d.tokens, d.hidden, d.top_k);
        if (d.x_dtype != layout::kF32 && d.x_dtype != layout::kBF16)
            throw Invalid("x_dtype: unknown code " + str(d.x_dtype));
        const uint64_t el = d.x_dtype == layout::kF32 ? 4 : 2, T = d.tokens, D = d.hidden, K = d.top_k;
        const uint8_t* x = map_.region("x_offset", d.x, T * D * el, el);
        const uint8_t* ids = map_.region("ids_offset", d.ids, T * K * 8, 8);
        const uint8_t* weights = map_.region("weights_offset", d.weights, T * K * 4, 4);
        uint8_t* out = map_.region("out_offset", d.out, T * D * el, el);
        if (out < x + T * D * el && x < out + T * D * el) throw Invalid("out_offset: the out slot overlaps x");
        ids_.resize(T * K), weights_.resize(T * K);  // private copies: the client cannot change them mid-call
        std::memcpy(ids_.data(), ids, T * K * 8);
        std::memcpy(weights_.data(), weights, T * K * 4);
        ex_->run(d.layer, x, out, d.x_dtype == layout::kBF16, ids_.data(), weights_.data(), int(T), int(K));
    }

    // Helpers wait this long at most for a prewake between calls, then sleep until a call wakes them.
    static constexpr double kPrewakeParkS = 1.0;

    Mapping map_;
    py::object executor_obj_;
    Executor* ex_;
    double spin_us_;
    AdaptiveSpin spin_;
    uint32_t max_tokens_ = 0, seen_ = 0;
    Answer last_;
    std::vector<int64_t> ids_;
    std::vector<float> weights_;
};

// ------------------------------------------------------------------------------------ client end

// A 2-D C-contiguous array in host memory, read from a numpy array or a CPU torch.Tensor (through
// its Python attributes: this module does not link libtorch; a layer call's tensors pass without a
// numpy conversion each).
struct HostArray {
    enum Kind { kF32, kBF16, kI64, kOther };
    const void* data;
    int64_t rows, cols;
    Kind kind;

    size_t nbytes() const { return size_t(rows * cols) * (kind == kBF16 ? 2 : kind == kF32 ? 4 : 8); }
};

struct TorchNames {  // torch's type and dtypes, and the attribute names read, looked up once
    py::object tensor, f32, bf16, i64;
    py::object is_cpu, is_contiguous, shape, dtype, data_ptr;  // interned strings
};

const TorchNames& torch_names() {
    static const TorchNames* names = [] {
        py::module_ torch = py::module_::import("torch");
        auto name = [](const char* s) { return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(s)); };
        return new TorchNames{torch.attr("Tensor"), torch.attr("float32"), torch.attr("bfloat16"), torch.attr("int64"),
                              name("is_cpu"), name("is_contiguous"), name("shape"), name("dtype"), name("data_ptr")};
    }();
    return *names;
}

// An attribute (or a no-argument method's result) of obj; errors propagate as Python's.
py::object attribute(py::handle obj, const py::object& name, bool call = false) {
    PyObject* v = call ? PyObject_CallMethodNoArgs(obj.ptr(), name.ptr()) : PyObject_GetAttr(obj.ptr(), name.ptr());
    if (v == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(v);
}

// A CPU tensor's array, read with the C API (pybind11's attribute and cast helpers took about 2.5 us
// a tensor here, a third of a co-located layer call).
HostArray tensor_array(py::handle obj, const std::string& field) {
    const TorchNames& torch = torch_names();
    if (attribute(obj, torch.is_cpu).ptr() != Py_True || attribute(obj, torch.is_contiguous, true).ptr() != Py_True)
        throw Invalid(field + ": must be a contiguous CPU tensor");
    const py::object shape = attribute(obj, torch.shape);
    if (!PyTuple_Check(shape.ptr()) || PyTuple_GET_SIZE(shape.ptr()) != 2)
        throw Invalid(field + ": expected 2 dims, got " + std::string(py::str(shape)));
    const int64_t rows = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 0));
    const int64_t cols = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), 1));
    if (PyErr_Occurred()) throw py::error_already_set();
    const py::object dtype = attribute(obj, torch.dtype);
    HostArray::Kind k = dtype.is(torch.f32)    ? HostArray::kF32
                        : dtype.is(torch.bf16) ? HostArray::kBF16
                        : dtype.is(torch.i64)  ? HostArray::kI64
                                               : HostArray::kOther;
    void* data = PyLong_AsVoidPtr(attribute(obj, torch.data_ptr, true).ptr());
    if (PyErr_Occurred()) throw py::error_already_set();
    return {data, rows, cols, k};
}

HostArray host_array(py::handle obj, const char* name) {
    const std::string field(name);
    const TorchNames& torch = torch_names();
    if (Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(torch.tensor.ptr()) || py::isinstance(obj, torch.tensor))
        return tensor_array(obj, field);
    if (!py::isinstance<py::array>(obj)) throw Invalid(field + ": expected a torch.Tensor or a numpy array");
    const auto a = py::reinterpret_borrow<py::array>(obj);
    if (a.ndim() != 2 || !(a.flags() & py::array::c_style))
        throw Invalid(field + ": expected a C-contiguous 2-D array, got shape " + shape_of(a));
    const char kind = a.dtype().kind();
    const auto size = a.itemsize();
    HostArray::Kind k = HostArray::kOther;
    if (kind == 'f' && size == 4) k = HostArray::kF32;
    if ((kind == 'i' || kind == 'u') && size == 2) k = HostArray::kBF16;
    if (kind == 'i' && size == 8) k = HostArray::kI64;
    return {a.data(), a.shape(0), a.shape(1), k};
}


struct Slots {
    uint64_t x, ids, weights, out;
};

class ShmClient {
public:
    ShmClient(py::buffer segment, Slots slots, int max_tokens, int hidden, int top_k)
        : map_(segment), slots_(slots), max_tokens_(max_tokens), hidden_(hidden), top_k_(top_k) {
        if (max_tokens < 1 || hidden < 1 || top_k < 1) throw Invalid("max_tokens, hidden and top_k must be >= 1");
        const uint64_t T = uint64_t(max_tokens), D = uint64_t(hidden), K = uint64_t(top_k);
        map_.region("x", slots.x, T * D * 4, 64), map_.region("ids", slots.ids, T * K * 8, 64);
        map_.region("weights", slots.weights, T * K * 4, 64), map_.region("out", slots.out, T * D * 4, 64);
        seq_ = bell_load(map_.word(layout::kRequestSeq));
    }

    // Copies a call into its slots and publishes it; returns its sequence number. x [T, D] float32
    // or bfloat16, ids [T, K] int64, weights [T, K] float32: CPU tensors or numpy arrays.
    uint32_t submit(uint32_t layer, py::handle x_obj, py::handle ids_obj, py::handle weights_obj,
                    const std::string& traceparent, bool each) {
        return publish(stage(layer, x_obj, ids_obj, weights_obj, traceparent, each));
    }

    // submit() and finish() in one, for a caller with nothing to do until the answer: the GIL is
    // released and the pools parked before the ring, so the server's thread it wakes (often onto this
    // core) finds this thread asleep rather than preempting it with Python still to run.
    // (seq, finish()'s answer, or None when none came within timeout_s).
    py::tuple call(uint32_t layer, py::handle x_obj, py::handle ids_obj, py::handle weights_obj, py::object out,
                   double spin_us, double timeout_s, const py::list& pools, const std::string& traceparent,
                   bool each) {
        check_wait(spin_us, timeout_s);
        const Descriptor d = stage(layer, x_obj, ids_obj, weights_obj, traceparent, each);
        const std::vector<ThreadPool*> parked = pools_of(pools);
        bool answered;
        uint32_t seq;
        {
            Mapping::Busy busy(map_);
            py::gil_scoped_release release;
            park(parked, seq_ + 1, timeout_s);
            seq = publish(d);
            answered = spin_.wait(map_.response(), seq - 1, spin_us, timeout_s) == seq;
            uncount();
        }
        return py::make_tuple(seq, answered ? py::object(result(out)) : py::none());
    }

    // Says a call comes soon (its routing is under way): the server's helpers, which wait for this
    // between calls, wake and spin for it, while this side's helpers (idle meanwhile: routing runs on
    // one thread) wait on the answer's doorbell, as in wait(), leaving their cores to them.
    void expect(const py::list& pools) {
        park(pools_of(pools), seq_ + 1, kParkAtExpectS);
        uint32_t* prewake = map_.word(layout::kPrewake);
        __atomic_add_fetch(prewake, 1, __ATOMIC_SEQ_CST);
        futex_wake(prewake);
    }

    // Writes a descriptor (its data already in place) and rings; returns its sequence number.
    uint32_t publish(const Descriptor& d) {
        uint8_t* base = map_.base();
        d.write(base);
        seq_ += 1;
        bell_ring(map_.request(), seq_);
        return seq_;
    }

    // Whether the answer to call seq came within timeout_s (false: a timeout or a wake). The pools'
    // helpers wait on the answer's doorbell meanwhile, as long as this thread (which counts as a
    // sleeper for them, so that the answer wakes them too), so they are up when this process's next
    // native call comes.
    bool wait(uint32_t seq, double spin_us, double timeout_s, const py::list& pools) {
        check_wait(spin_us, timeout_s);
        const std::vector<ThreadPool*> parked = pools_of(pools);
        const Bell response = map_.response();
        Mapping::Busy busy(map_);
        py::gil_scoped_release release;
        park(parked, seq, timeout_s);
        const bool answered = spin_.wait(response, seq - 1, spin_us, timeout_s) == seq;
        uncount();
        return answered;
    }

    // wait() then result(): None when no answer came within timeout_s (or a wake ended the wait).
    py::object finish(uint32_t seq, double spin_us, double timeout_s, py::object out, const py::list& pools) {
        if (!wait(seq, spin_us, timeout_s, pools)) return py::none();
        return result(out);
    }

    // (status, message, seconds the server computed) of the last answer; with status 0 and out given,
    // copies the result [T, D] of the last submitted call into out (x's dtype).
    py::tuple result(py::object out) {
        const uint8_t* base = map_.base();
        const uint8_t* r = base + layout::kResponse;
        const uint32_t status = load<uint32_t>(r);
        const size_t length = std::min<size_t>(load<uint32_t>(r + 4), layout::kMessageBytes);
        const double compute_s = load<double>(r + 12);
        if (status != layout::kOk) {
            const std::string message(reinterpret_cast<const char*>(base + layout::kMessage), length);
            return py::make_tuple(status, py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(message.data(), message.size(), "replace")),
                                  0.0);
        }
        if (!out.is_none()) {
            py::array o = out.cast<py::array>();
            if (x_code(o, "out") != x_code_) throw Invalid("out: must have the submitted x's dtype");
            check_x(o, "out", tokens_, hidden_);
            if (!o.writeable()) throw Invalid("out: must be writable");
            copy_bytes(o.mutable_data(), base + slots_.out, size_t(o.nbytes()));
        }
        return py::make_tuple(status, py::str(""), compute_s);
    }

    void wake() {
        if (!map_.released()) bell_wake(map_.response());
    }

    void release() { map_.release(); }

private:
    // Checks a call and copies it into its slots; the descriptor to publish.
    Descriptor stage(uint32_t layer, py::handle x_obj, py::handle ids_obj, py::handle weights_obj,
                     const std::string& traceparent, bool each) {
        const HostArray x = host_array(x_obj, "x"), ids = host_array(ids_obj, "ids");
        const HostArray weights = host_array(weights_obj, "weights");
        if (x.kind != HostArray::kF32 && x.kind != HostArray::kBF16)
            throw Invalid("x: expected float32 or bfloat16 (bits in int16/uint16)");
        if (x.cols != hidden_) throw Invalid("x: hidden size " + std::to_string(x.cols) + ", the session's is " + str(hidden_));
        const int64_t T = x.rows, K = ids.cols;
        if (T < 1 || T > max_tokens_)
            throw Invalid("x: " + std::to_string(T) + " tokens is outside the session's [1, " + str(max_tokens_) + "]");
        if (ids.kind != HostArray::kI64 || ids.rows != T)
            throw Invalid("ids: expected int64 [" + std::to_string(T) + ", K]");
        if (K < 1 || K > top_k_) throw Invalid("ids: top-k " + std::to_string(K) + " is outside [1, " + str(top_k_) + "]");
        if (weights.kind != HostArray::kF32 || weights.rows != T || weights.cols != K)
            throw Invalid("weights: expected float32 [" + std::to_string(T) + ", " + std::to_string(K) + "]");
        uint8_t* base = map_.base();
        copy_bytes(base + slots_.x, x.data, x.nbytes());
        std::memcpy(base + slots_.ids, ids.data, ids.nbytes());
        std::memcpy(base + slots_.weights, weights.data, weights.nbytes());
        const size_t length = std::min(traceparent.size(), layout::kTraceBytes);
        base[layout::kTrace] = each ? layout::kTraceEach : 0;
        base[layout::kTrace + 1] = uint8_t(length);
        std::memcpy(base + layout::kTrace + 2, traceparent.data(), length);
        const uint32_t code = x.kind == HostArray::kF32 ? layout::kF32 : layout::kBF16;
        tokens_ = T, x_code_ = code;
        return {layer, uint32_t(T), uint32_t(hidden_), uint32_t(K), code, slots_.x, slots_.ids, slots_.weights,
                slots_.out};
    }

    Mapping map_;
    Slots slots_;
    int max_tokens_, hidden_, top_k_;
    uint32_t seq_ = 0, x_code_ = layout::kF32;
    int64_t tokens_ = 0;
    // Whether this thread counts as a sleeper of the answer to call counted_seq_, for parked pools.
    bool counted_ = false;
    uint32_t counted_seq_ = 0;
    // A park made by expect() lasts until the wait takes over, or this long (a call never made).
    static constexpr double kParkAtExpectS = 1.0;

    static std::vector<ThreadPool*> pools_of(const py::list& pools) {
        std::vector<ThreadPool*> out;
        for (py::handle p : pools) out.push_back(&p.cast<ThreadPool&>());
        return out;
    }

    // The pools' helpers wait on the answer to call seq (the response word holds seq - 1 until then),
    // this thread counted as a sleeper for them, so that the server's ring wakes them too.
    void park(const std::vector<ThreadPool*>& pools, uint32_t seq, double max_s) {
        if (pools.empty()) return;
        const Bell response = map_.response();
        if (!counted_ || counted_seq_ != seq) {
            uncount();
            __atomic_add_fetch(response.sleepers, 1, __ATOMIC_SEQ_CST);
            counted_ = true, counted_seq_ = seq;
        }
        for (ThreadPool* p : pools) p->park_on(response.seq, seq - 1, max_s);
    }

    void uncount() {
        if (!counted_) return;
        __atomic_sub_fetch(map_.response().sleepers, 1, __ATOMIC_SEQ_CST);
        counted_ = false;
    }
    AdaptiveSpin spin_;
};

py::dict layout_numbers() {
    py::dict d;
    d["HEADER_BYTES"] = layout::kHeaderBytes, d["REQUEST_SEQ"] = layout::kRequestSeq;
    d["REQUEST_AT"] = layout::kRequest, d["RESPONSE_SEQ"] = layout::kResponseSeq;
    d["RESPONSE_AT"] = layout::kResponse, d["MESSAGE_AT"] = layout::kMessage;
    d["PREWAKE"] = layout::kPrewake;
    d["REQUEST_SLEEPERS"] = layout::kRequestSleepers, d["RESPONSE_SLEEPERS"] = layout::kResponseSleepers;
    d["MESSAGE_BYTES"] = layout::kMessageBytes, d["TRACE_AT"] = layout::kTrace;
    d["LAYOUT_VERSION"] = layout::kVersion, d["TRACE_EACH"] = layout::kTraceEach;
    d["X_DTYPE_CODES"] = py::dict(py::arg("float32") = layout::kF32, py::arg("bfloat16") = layout::kBF16);
    return d;
}

}  // namespace

void register_expert_sessions(py::module_& m) {
    m.def("shm_layout", &layout_numbers, "This side's numbers of the shared-memory segment layout");

    py::class_<Executor>(m, "Executor")
        .def(py::init<py::dict, py::object, int, int, int, bool>(), py::arg("layers"), py::arg("pool"),
             py::arg("hidden"), py::arg("num_experts"), py::arg("max_tokens"), py::arg("echo") = false,
             "An expert server's layers {index: MoeLayer} on a pool; echo returns x unchanged")
        .def("check", &Executor::check, py::arg("layer"), py::arg("tokens"), py::arg("hidden"), py::arg("top_k"),
             "ValueError naming the field unless a call of this header can run here")
        .def("run", &executor_run, py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("out"),
             "out [T, D] = the layer's experts of x [T, D] (float32, or bfloat16 bits in both)")
        .def_property_readonly("api", [](py::object self) { return self.cast<Executor&>().api(self); },
                               "This executor as a C table for other native modules (tandem/executor_api.h)");

    py::class_<ShmServer>(m, "ShmServer")
        .def(py::init<py::buffer, py::object, uint32_t, double>(), py::arg("segment"), py::arg("executor"),
             py::arg("max_tokens"), py::arg("spin_us"))
        .def("serve_next", &ShmServer::serve_next, py::arg("timeout_s"), py::arg("hold_s") = 0.0,
             "Answers the next call, if one comes within timeout_s, and those that follow within hold_s of it "
             "(a traced or failed one returns at once): None, or (status, layer, tokens, start_ns, end_ns, "
             "traceparent, trace_each) of the last")
        .def("wake", &ShmServer::wake, "Ends a serve_next that is waiting")
        .def("release", &ShmServer::release, "Lets go of the segment");

    py::class_<Descriptor>(m, "ShmDescriptor")
        .def(py::init([](uint32_t layer, uint32_t tokens, uint32_t hidden, uint32_t top_k, uint32_t x_dtype,
                         uint64_t x, uint64_t ids, uint64_t weights, uint64_t out) {
                 return Descriptor{layer, tokens, hidden, top_k, x_dtype, x, ids, weights, out};
             }),
             py::arg("layer"), py::arg("tokens"), py::arg("hidden"), py::arg("top_k"), py::arg("x_dtype"),
             py::arg("x_offset"), py::arg("ids_offset"), py::arg("weights_offset"), py::arg("out_offset"));

    py::class_<ShmClient>(m, "ShmClient")
        .def(py::init([](py::buffer segment, uint64_t x, uint64_t ids, uint64_t weights, uint64_t out, int max_tokens,
                         int hidden, int top_k) {
                 return std::make_unique<ShmClient>(segment, Slots{x, ids, weights, out}, max_tokens, hidden, top_k);
             }),
             py::arg("segment"), py::arg("x_offset"), py::arg("ids_offset"), py::arg("weights_offset"),
             py::arg("out_offset"), py::arg("max_tokens"), py::arg("hidden"), py::arg("top_k"))
        .def("submit", &ShmClient::submit, py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"),
             py::arg("traceparent") = "", py::arg("trace_each") = false,
             "Copies a call in and publishes it; returns its sequence number")
        .def("call", &ShmClient::call, py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"),
             py::arg("out"), py::arg("spin_us"), py::arg("timeout_s"), py::arg("pools") = py::list(),
             py::arg("traceparent") = "", py::arg("trace_each") = false,
             "submit() and finish() in one, the GIL released before the ring: (seq, answer or None)")
        .def("expect", &ShmClient::expect, py::arg("pools") = py::list(),
             "Says a call comes soon: the server's helpers wake for it, the pools' helpers wait for its answer")
        .def("publish", &ShmClient::publish, py::arg("descriptor"), "Publishes a raw descriptor (its data in place)")
        .def("wait", &ShmClient::wait, py::arg("seq"), py::arg("spin_us"), py::arg("timeout_s"),
             py::arg("pools") = py::list(),
             "Whether the answer to seq came within timeout_s (GIL released); the pools' helpers wake with it")
        .def("result", &ShmClient::result, py::arg("out") = py::none(),
             "(status, message, compute_s) of the answer; copies the result into out when status is 0")
        .def("finish", &ShmClient::finish, py::arg("seq"), py::arg("spin_us"), py::arg("timeout_s"),
             py::arg("out") = py::none(), py::arg("pools") = py::list(),
             "wait() then result(): None when no answer came")
        .def("wake", &ShmClient::wake, "Ends a wait in progress")
        .def("release", &ShmClient::release, "Lets go of the segment");
}

}  // namespace tandem
