// tandem_grpc's Generate server: the dense service's token stream on grpc++, on a port of its own
// next to the dense service's grpcio one (which keeps Generate for clients that do not ask, and
// Tokenize, GetModelInfo, GetStats, health, reflection; GetModelInfo's generate_port names this one).
//
// grpcio's sync server hands each streamed message between the handler's thread, its polling thread
// and back, each turn with the GIL; on the 2-core bench machine that was about 0.25 CPU-ms of a
// 10 ms decode step. Here Python runs once a stream, to open it (open(sink, request, metadata,
// remaining_s) validates, submits to the engine and gives the abort to call if the client goes),
// and the engine's thread pushes each response, serialized, into the stream's Sink; the stream's
// grpc++ thread writes them with no GIL and no Python on the way.
#include "generate_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/method_handler.h>
#include <grpcpp/support/sync_stream.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "server_setup.h"

namespace py = pybind11;

namespace {

// One stream's responses, from the engine's thread (push, fail) to the stream's thread (pop).
class Sink {
public:
    struct Item {
        std::string bytes;  // a serialized GenerateResponse
        bool last = false;
        int code = 0;  // a failure's gRPC status code (then bytes is its message)
    };

    void push(std::string bytes, bool last) { put({std::move(bytes), last, 0}); }

    void fail(int code, std::string message) {
        if (code <= 0 || code > 16) throw std::invalid_argument("fail: code must be a gRPC error code in [1, 16]");
        put({std::move(message), true, code});
    }

    // The next item, waiting up to timeout_s; false on a timeout.
    bool pop(double timeout_s, Item& out) {
        std::unique_lock<std::mutex> lock(mu_);
        if (!ready_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !items_.empty(); }))
            return false;
        out = std::move(items_.front());
        items_.pop_front();
        return true;
    }

    // The stream ended: what comes later is dropped.
    void close() {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        items_.clear();
    }

private:
    void put(Item item) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (closed_) return;
            items_.push_back(std::move(item));
        }
        ready_.notify_one();
    }

    std::mutex mu_;
    std::condition_variable ready_;
    std::deque<Sink::Item> items_;
    bool closed_ = false;
};

constexpr double kPollS = 0.25;  // how often a stream waiting for its next token looks for a cancelled client

// DenseService.Generate as bytes both ways: Python parses the request (a bad one is its
// INVALID_ARGUMENT) and serializes each response; no other method is served here (UNIMPLEMENTED).
class GenerateService final : public grpc::Service {
public:
    explicit GenerateService(py::object open) : open_(std::move(open)) {
        AddMethod(new grpc::internal::RpcServiceMethod(
            "/tandem.v1.DenseService/Generate", grpc::internal::RpcMethod::SERVER_STREAMING,
            new grpc::internal::ServerStreamingHandler<GenerateService, grpc::ByteBuffer, grpc::ByteBuffer>(
                [](GenerateService* service, grpc::ServerContext* ctx, const grpc::ByteBuffer* request,
                   grpc::ServerWriter<grpc::ByteBuffer>* writer) { return service->Generate(ctx, *request, writer); },
                this)));
    }

    ~GenerateService() override {
        py::gil_scoped_acquire gil;
        open_ = py::object();
    }

    grpc::Status Generate(grpc::ServerContext* ctx, const grpc::ByteBuffer& request,
                          grpc::ServerWriter<grpc::ByteBuffer>* writer) {
        if (draining) return {grpc::StatusCode::UNAVAILABLE, "the dense service is shutting down"};
        ++open_streams;
        auto sink = std::make_shared<Sink>();
        py::object abort;
        grpc::Status status = start(ctx, request, sink, &abort);
        if (status.ok()) status = relay(ctx, writer, *sink, abort);
        sink->close();
        {
            py::gil_scoped_acquire gil;
            abort = py::object();
        }
        --open_streams;
        return status;
    }

    std::atomic<bool> draining{false};
    std::atomic<int> open_streams{0};

private:
    // Python's open(): (0, "", abort) once the engine has the request, (code, message, None) if not.
    grpc::Status start(grpc::ServerContext* ctx, const grpc::ByteBuffer& request, const std::shared_ptr<Sink>& sink,
                       py::object* abort) {
        grpc::Slice slice;
        if (!request.DumpToSingleSlice(&slice).ok()) return {grpc::StatusCode::INTERNAL, "the request could not be read"};
        std::string bytes(reinterpret_cast<const char*>(slice.begin()), slice.size());
        const auto deadline = ctx->deadline();
        const bool bounded = deadline != std::chrono::system_clock::time_point::max();
        const double remaining =
            bounded ? std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count() : 0.0;
        py::gil_scoped_acquire gil;
        try {
            py::dict metadata;
            for (const auto& [key, value] : ctx->client_metadata())
                metadata[py::str(key.data(), key.size())] = py::str(value.data(), value.size());
            py::tuple r = open_(sink, py::bytes(bytes), metadata, bounded ? py::object(py::float_(remaining)) : py::none());
            const int code = r[0].cast<int>();
            if (code) return {static_cast<grpc::StatusCode>(code), r[1].cast<std::string>()};
            *abort = r[2];
            return grpc::Status::OK;
        } catch (const std::exception& e) {  // a Python error, or open() answering something else than its tuple
            return {grpc::StatusCode::INTERNAL, std::string("opening the stream: ") + e.what()};
        }
    }

    // Writes the sink's responses until the last; a client that goes away aborts the request.
    grpc::Status relay(grpc::ServerContext* ctx, grpc::ServerWriter<grpc::ByteBuffer>* writer, Sink& sink,
                       const py::object& abort) {
        Sink::Item item;
        while (true) {
            if (!sink.pop(kPollS, item)) {
                if (ctx->IsCancelled()) break;
                continue;
            }
            if (item.code) return {static_cast<grpc::StatusCode>(item.code), item.bytes};
            grpc::Slice slice(item.bytes);
            if (!writer->Write(grpc::ByteBuffer(&slice, 1))) break;
            if (item.last) return grpc::Status::OK;
        }
        sink.close();
        py::gil_scoped_acquire gil;
        try {
            abort();
        } catch (py::error_already_set& e) {
            e.discard_as_unraisable(abort);
        }
        return {grpc::StatusCode::CANCELLED, "the client went away"};
    }

    py::object open_;
};

class GenerateServer {
public:
    GenerateServer(py::object open, const std::string& address, int max_message_bytes, int max_threads,
                   int keepalive_ms) {
        service_ = std::make_unique<GenerateService>(std::move(open));
        server_ = tandem::start_server(service_.get(), address, grpc::InsecureServerCredentials(), max_message_bytes,
                                       max_threads, keepalive_ms, "tandem-generate", &port_);
    }

    ~GenerateServer() { stop(0.0); }

    int port() const { return port_; }

    int open_streams() const { return service_->open_streams.load(); }

    // Ends the open streams (after grace seconds at most) and stops listening.
    void stop(double grace_s) {
        if (!server_) return;
        service_->draining = true;
        tandem::stop_server(server_, grace_s);
    }

private:
    std::unique_ptr<GenerateService> service_;
    std::unique_ptr<grpc::Server> server_;  // after service_: destroyed (stopped) before it
    int port_ = 0;
};

}  // namespace

namespace tandem {

void register_generate_server(py::module_& m) {
    py::class_<Sink, std::shared_ptr<Sink>>(m, "GenerateSink",
                                            "One Generate stream's responses, from the engine's thread to the stream's")
        .def("push", [](Sink& s, py::bytes b, bool last) { s.push(std::string(b), last); }, py::arg("response"),
             py::arg("last"), "A serialized GenerateResponse; last: the stream ends after it")
        .def("fail", &Sink::fail, py::arg("code"), py::arg("message"), "Ends the stream with this gRPC status");
    py::class_<GenerateServer>(m, "GenerateServer")
        .def(py::init<py::object, const std::string&, int, int, int>(), py::arg("open"), py::arg("address"),
             py::arg("max_message_bytes") = 64 << 20, py::arg("max_threads") = 64, py::arg("keepalive_ms") = 5000,
             "Serves DenseService.Generate on address (host:port, port 0: any free one); each stream calls "
             "open(sink, request bytes, metadata dict, remaining seconds or None) -> (0, '', abort) or (code, message, None)")
        .def_property_readonly("port", &GenerateServer::port)
        .def_property_readonly("open_streams", &GenerateServer::open_streams)
        .def("stop", &GenerateServer::stop, py::arg("grace_s") = 0.0,
             "Cancels the open streams after grace_s at most, stops listening");
}

}  // namespace tandem
