// tandem_grpc's Compute server: the inline data plane's server end on grpc++, on a port of its own
// next to the expert server's grpcio one (which keeps GetInfo, health, reflection, the shared-memory
// sessions and a Compute of its own for clients that do not ask; GetInfo's compute_port names this one).
//
// grpcio's server hands each message between its polling thread, the handler's thread and the
// request iterator; on the 2-core bench machine that was about 300 us of a layer's round trip.
// Here each stream has one grpc++ thread that reads a call, checks it (errors name the field, as
// services/common/wire.py's do), runs it on the expert server's Executor through its C table
// (tandem/executor_api.h) and writes the answer, with no Python on the way. What Python still does
// for these calls happens off the path: the drain polls activity(), and a thread turns the traced
// calls' records into spans (records()).
// T tokens, D hidden size, K experts per token.
#include "compute_server.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "server_setup.h"
#include "tandem/executor_api.h"
#include "tandem/v1/expert.grpc.pb.h"

namespace py = pybind11;
namespace pb = tandem::v1;

namespace {

int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// A traced call, for the Python thread that makes its span; traceparent empty: the stream ended.
struct TraceRecord {
    uint64_t stream;
    std::string traceparent;
    bool each;
    uint32_t layer, tokens;
    int64_t start_ns, end_ns;
};

// The traced calls not yet taken; at most kLimit are kept (the rest are counted and dropped).
class TraceRecords {
public:
    static constexpr size_t kLimit = 1 << 16;

    void push(TraceRecord r) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (queue_.size() >= kLimit) {
                ++dropped_;
                return;
            }
            queue_.push_back(std::move(r));
        }
        ready_.notify_one();
    }

    // Waits up to timeout_s for records; false once closed and empty.
    bool take(double timeout_s, std::deque<TraceRecord>& into) {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return closed_ || !queue_.empty(); });
        into.swap(queue_);
        return !(closed_ && into.empty());
    }

    void close() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            closed_ = true;
        }
        ready_.notify_all();
    }

    uint64_t dropped() {
        std::lock_guard<std::mutex> lock(mu_);
        return dropped_;
    }

private:
    std::mutex mu_;
    std::condition_variable ready_;
    std::deque<TraceRecord> queue_;
    uint64_t dropped_ = 0;
    bool closed_ = false;
};

grpc::Status invalid(const std::string& message) { return {grpc::StatusCode::INVALID_ARGUMENT, message}; }

std::string dtype_name(int d) {
    const std::string& name = pb::DType_Name(static_cast<pb::DType>(d));
    return name.empty() ? std::to_string(d) : name;
}

std::string shape_text(const pb::Tensor& t) {
    std::string s = "[";
    for (int i = 0; i < t.shape_size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape(i));
    return s + "]";
}

// A tensor of the call against wire.decode's rules: one of two dtypes, 2 non-negative dims, bytes
// that hold them. An empty string when it passes, else the error naming field.
std::string check_tensor(const char* field, const pb::Tensor& t, pb::DType a, pb::DType b) {
    const std::string f(field);
    if (t.dtype() != a && t.dtype() != b) {
        const std::string names = a == b ? dtype_name(a) : dtype_name(a) + ", " + dtype_name(b);
        return f + ".dtype: expected " + names + ", got " + dtype_name(t.dtype());
    }
    if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < 0)
        return f + ".shape: expected 2 non-negative dims, got " + shape_text(t);
    const unsigned __int128 bytes =
        (unsigned __int128)t.shape(0) * (unsigned __int128)t.shape(1) * (t.dtype() == pb::BFLOAT16 ? 2 : t.dtype() == pb::INT64 ? 8 : 4);
    if (bytes != t.data().size())
        return f + ".data: " + std::to_string(t.data().size()) + " bytes do not hold a " + shape_text(t) + " tensor";
    return "";
}

class ComputeService final : public pb::ExpertService::Service {
public:
    ComputeService(const TandemExecutorApi* api, TraceRecords* records) : api_(api), records_(records) {}

    grpc::Status Compute(grpc::ServerContext*,
                         grpc::ServerReaderWriter<pb::ComputeResponse, pb::ComputeRequest>* stream) override {
        if (draining) return {grpc::StatusCode::UNAVAILABLE, "the expert server is shutting down"};
        const uint64_t id = next_stream_++;
        bool traced = false;
        pb::ComputeRequest request;
        pb::ComputeResponse response;
        grpc::Status status;
        while (stream->Read(&request)) {
            ++busy;
            int64_t start = 0, end = 0;
            status = answer(request, &response, &start, &end);
            const bool sent = status.ok() && stream->Write(response);
            last_end_ns = steady_ns();
            --busy;
            if (!sent) break;
            if (!request.traceparent().empty()) {
                traced = true;
                records_->push({id, request.traceparent(), request.trace_each(), request.layer(),
                                uint32_t(request.x().shape(0)), start, end});
            }
        }
        if (traced) records_->push({id, "", false, 0, 0, 0, 0});
        return status;
    }

    std::atomic<bool> draining{false};
    std::atomic<int> busy{0};                 // calls read and not yet answered
    std::atomic<int64_t> last_end_ns{steady_ns()};  // steady clock (time.monotonic's) of the last answer

private:
    grpc::Status answer(const pb::ComputeRequest& q, pb::ComputeResponse* r, int64_t* start, int64_t* end) {
        std::string error = check_tensor("x", q.x(), pb::FLOAT32, pb::BFLOAT16);
        if (error.empty()) error = check_tensor("ids", q.ids(), pb::INT64, pb::INT64);
        if (error.empty()) error = check_tensor("weights", q.weights(), pb::FLOAT32, pb::FLOAT32);
        if (!error.empty()) return invalid(error);
        const int64_t T = q.x().shape(0), D = q.x().shape(1), K = q.ids().shape(1);
        if (q.ids().shape(0) != T)
            return invalid("ids.shape: expected [" + std::to_string(T) + ", K] (x's tokens), got " + shape_text(q.ids()));
        if (q.weights().shape(0) != T || q.weights().shape(1) != K)
            return invalid("weights.shape: expected [" + std::to_string(T) + ", " + std::to_string(K) + "] (ids'), got " +
                           shape_text(q.weights()));
        char message[512];
        if (int code = api_->check(api_->self, q.layer(), T, D, K, message, sizeof message))
            return {static_cast<grpc::StatusCode>(code), message};
        pb::Tensor* out = r->mutable_out();
        out->set_dtype(q.x().dtype());
        out->clear_shape();
        out->add_shape(T);
        out->add_shape(D);
        std::string* data = out->mutable_data();
        data->resize(q.x().data().size());
        *start = wall_ns();
        const int code = api_->run(api_->self, q.layer(), q.x().data().data(), data->data(), q.x().dtype() == pb::BFLOAT16,
                                   reinterpret_cast<const int64_t*>(q.ids().data().data()),
                                   reinterpret_cast<const float*>(q.weights().data().data()), int(T), int(K), message,
                                   sizeof message);
        *end = wall_ns();
        if (code) return {static_cast<grpc::StatusCode>(code), message};
        r->set_compute_s(double(*end - *start) / 1e9);
        return grpc::Status::OK;
    }

    const TandemExecutorApi* api_;
    TraceRecords* records_;
    std::atomic<uint64_t> next_stream_{1};
};

class ComputeServer {
public:
    ComputeServer(py::object executor, const std::string& address, const std::string& cert_pem,
                  const std::string& key_pem, int max_message_bytes, int max_threads, int keepalive_ms)
        : api_obj_(executor.attr("api")) {
        api_ = static_cast<const TandemExecutorApi*>(PyCapsule_GetPointer(api_obj_.ptr(), TANDEM_EXECUTOR_API_NAME));
        if (api_ == nullptr) throw py::error_already_set();
        if (api_->version != TANDEM_EXECUTOR_API_VERSION)
            throw std::invalid_argument("executor: C table version " + std::to_string(api_->version) + ", expected " +
                                        std::to_string(TANDEM_EXECUTOR_API_VERSION) + " (rebuild both modules)");
        service_ = std::make_unique<ComputeService>(api_, &records_);
        std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
        if (!cert_pem.empty()) {
            grpc::SslServerCredentialsOptions options;
            options.pem_key_cert_pairs.push_back({key_pem, cert_pem});
            creds = grpc::SslServerCredentials(options);
        }
        server_ = tandem::start_server(service_.get(), address, creds, max_message_bytes, max_threads, keepalive_ms,
                                       "tandem-compute", &port_);
    }

    ~ComputeServer() { stop(0.0); }

    int port() const { return port_; }

    // New streams are refused (UNAVAILABLE); the open ones are answered until stop().
    void drain() { service_->draining = true; }

    // (calls under way, time.monotonic() of the last answer).
    py::tuple activity() const {
        return py::make_tuple(service_->busy.load(), double(service_->last_end_ns.load()) / 1e9);
    }

    // The traced calls answered since the last take, waiting up to timeout_s for one: a list of
    // (stream, traceparent, trace_each, layer, tokens, start_ns, end_ns), traceparent "" for a traced
    // stream that ended; None once the server has stopped.
    py::object records(double timeout_s) {
        std::deque<TraceRecord> taken;
        bool open;
        {
            py::gil_scoped_release release;
            open = records_.take(timeout_s, taken);
        }
        if (!open) return py::none();
        py::list out;
        for (const TraceRecord& r : taken)
            out.append(py::make_tuple(r.stream, r.traceparent, r.each, r.layer, r.tokens, r.start_ns, r.end_ns));
        return out;
    }

    uint64_t dropped_records() { return records_.dropped(); }

    // Ends the open streams (after grace seconds at most) and stops listening.
    void stop(double grace_s) {
        if (!server_) return;
        service_->draining = true;
        tandem::stop_server(server_, grace_s);
        records_.close();
    }

private:
    py::object api_obj_;  // the executor's capsule: holds the executor alive while this lives
    const TandemExecutorApi* api_ = nullptr;
    TraceRecords records_;
    std::unique_ptr<ComputeService> service_;
    std::unique_ptr<grpc::Server> server_;  // after service_: destroyed (stopped) before it
    int port_ = 0;
};

}  // namespace

namespace tandem {

void register_compute_server(py::module_& m) {
    py::class_<ComputeServer>(m, "ComputeServer")
        .def(py::init<py::object, const std::string&, const std::string&, const std::string&, int, int, int>(),
             py::arg("executor"), py::arg("address"), py::arg("cert_pem") = "", py::arg("key_pem") = "",
             py::arg("max_message_bytes") = 256 << 20, py::arg("max_threads") = 64, py::arg("keepalive_ms") = 5000,
             "Serves Compute on address (host:port, port 0: any free one) with tandem_native.Executor executor; "
             "TLS when cert_pem is given")
        .def_property_readonly("port", &ComputeServer::port)
        .def("drain", &ComputeServer::drain, "Refuses new streams; the open ones are answered until stop()")
        .def("activity", &ComputeServer::activity, "(calls under way, time.monotonic() of the last answer)")
        .def("records", &ComputeServer::records, py::arg("timeout_s"),
             "Traced calls since the last take: [(stream, traceparent, trace_each, layer, tokens, start_ns, end_ns)]; "
             "traceparent '' when a traced stream ended; None once stopped")
        .def_property_readonly("dropped_records", &ComputeServer::dropped_records)
        .def("stop", &ComputeServer::stop, py::arg("grace_s") = 0.0,
             "Cancels the open streams after grace_s at most, stops listening");
}

}  // namespace tandem
