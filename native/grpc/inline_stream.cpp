// tandem_grpc: the inline data plane's client (one Compute stream to one expert server) on grpc++.
//
// grpcio's Python streams hand every request to a thread that consumes the request iterator and
// every response from its polling thread to the caller: on the 2-core bench machine those
// hand-offs and the Python around them were most of a layer's 540 us round trip. Here the caller's
// own thread drives the call's completion queue with the GIL released: submit posts the write and
// the read of its answer and returns; wait runs the queue until both are done, within a deadline.
// T tokens, D hidden size, K experts per token.
#include <grpcpp/grpcpp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "compute_server.h"
#include "generate_server.h"
#include "copy.h"
#include "tandem/v1/expert.grpc.pb.h"

namespace py = pybind11;
namespace pb = tandem::v1;

namespace {

// A call that failed: the gRPC status code's name (UNAVAILABLE, DEADLINE_EXCEEDED...) and details.
struct RpcFailure : std::runtime_error {
    std::string code;
    RpcFailure(std::string c, const std::string& details) : std::runtime_error(details), code(std::move(c)) {}
};

const char* code_name(grpc::StatusCode c) {
    switch (c) {
        case grpc::StatusCode::OK: return "OK";
        case grpc::StatusCode::CANCELLED: return "CANCELLED";
        case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
        case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
        case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
        case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
        case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
        case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
        case grpc::StatusCode::INTERNAL: return "INTERNAL";
        case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
        default: return "UNKNOWN";
    }
}

// The wire's dtypes (expert.proto's DType) and their numpy names.
int wire_dtype(const py::array& a, const char* field) {
    if (a.dtype().is(py::dtype::of<float>())) return pb::FLOAT32;
    if (a.dtype().is(py::dtype::of<uint16_t>())) return pb::BFLOAT16;
    if (a.dtype().is(py::dtype::of<int64_t>())) return pb::INT64;
    throw std::invalid_argument(std::string(field) + ": dtype must be float32, uint16 (bfloat16 bits) or int64");
}

void fill(pb::Tensor* t, const py::array& a, const char* field) {
    if (a.ndim() != 2 || !(a.flags() & py::array::c_style))
        throw std::invalid_argument(std::string(field) + ": must be a C-contiguous 2-D array");
    t->set_dtype(static_cast<pb::DType>(wire_dtype(a, field)));
    t->clear_shape();
    t->add_shape(a.shape(0));
    t->add_shape(a.shape(1));
    std::string* data = t->mutable_data();
    data->resize(size_t(a.nbytes()));
    tandem::copy_bytes(data->data(), a.data(), data->size());
}

// The response's tensor as a new numpy array, after checking dtype, shape and byte count.
py::array to_array(const pb::Tensor& t) {
    py::dtype dtype;
    if (t.dtype() == pb::FLOAT32) dtype = py::dtype::of<float>();
    else if (t.dtype() == pb::BFLOAT16) dtype = py::dtype::of<uint16_t>();
    else throw RpcFailure("INTERNAL", "out.dtype: expected FLOAT32 or BFLOAT16");
    if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < 0) throw RpcFailure("INTERNAL", "out.shape: expected [T, D]");
    py::array out(dtype, {t.shape(0), t.shape(1)});
    if (size_t(out.nbytes()) != t.data().size())
        throw RpcFailure("INTERNAL", "out.data: " + std::to_string(t.data().size()) + " bytes do not hold the shape");
    tandem::copy_bytes(out.mutable_data(), t.data().data(), t.data().size());
    return out;
}

using Clock = std::chrono::system_clock;

// grpc++'s log lines, less one kind: grpcio and this library read the same GRPC_EXPERIMENTS
// variable, whose names (services/common/grpc_defaults.py) are grpcio's, and grpc++ 1.51 would
// report each name it does not know on every process start.
void log_line(gpr_log_func_args* a) {
    if (std::strncmp(a->message, "Unknown experiment", 18) == 0) return;
    std::fprintf(stderr, "%s %s:%d] %s\n", gpr_log_severity_string(a->severity), a->file, a->line, a->message);
}

class InlineStream {
public:
    InlineStream(const std::string& target, const std::string& root_pem, int max_message_bytes, double connect_s,
                 int keepalive_ms) {
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(max_message_bytes);
        args.SetMaxSendMessageSize(max_message_bytes);
        if (keepalive_ms > 0) {  // a quiet link ends the stream with UNAVAILABLE (services/common/grpc_defaults.py)
            args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
            args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms);
            args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
            args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
        }
        auto creds = root_pem.empty() ? grpc::InsecureChannelCredentials()
                                      : grpc::SslCredentials(grpc::SslCredentialsOptions{root_pem, "", ""});
        stub_ = pb::ExpertService::NewStub(grpc::CreateCustomChannel(target, creds, args));
        call_ = stub_->PrepareAsyncCompute(&ctx_, &cq_);
        call_->StartCall(tag(kStart));
        py::gil_scoped_release release;
        try {
            unsigned start = bit(kStart);
            await(start, deadline(connect_s), connect_s);
        } catch (...) {
            shutdown();
            throw;
        }
    }

    ~InlineStream() {
        py::gil_scoped_release release;
        shutdown();
    }

    // Sends one layer's call and posts the read of its answer, waiting for neither: the caller goes on
    // (the shared experts) while the call is out. An answer nobody waited for is read and dropped first.
    void submit(uint32_t layer, const py::array& x, const py::array& ids, const py::array& weights,
                const std::string& traceparent, bool each, double timeout_s) {
        alive();
        if (pending_) {
            py::gil_scoped_release release;
            await(pending_, deadline(timeout_s), timeout_s);
        }
        request_.set_layer(layer);
        fill(request_.mutable_x(), x, "x");
        fill(request_.mutable_ids(), ids, "ids");
        fill(request_.mutable_weights(), weights, "weights");
        request_.set_traceparent(traceparent);
        request_.set_trace_each(each);
        py::gil_scoped_release release;
        call_->Write(request_, tag(kWrite));
        call_->Read(&response_, tag(kRead));
        pending_ = bit(kWrite) | bit(kRead);
    }

    // The submitted call's answer: (out [T, D] in x's dtype, seconds the server computed).
    py::tuple wait(double timeout_s) {
        alive();
        if (!pending_) throw std::logic_error("wait: no call was submitted");
        {
            py::gil_scoped_release release;
            await(pending_, deadline(timeout_s), timeout_s);
        }
        return py::make_tuple(to_array(response_.out()), response_.compute_s());
    }

    bool dead() const { return dead_; }

    // Cancels the stream and waits for its last events: afterwards every call raises UNAVAILABLE.
    void close() {
        py::gil_scoped_release release;
        shutdown();
    }

private:
    void shutdown() {
        if (closed_) return;
        closed_ = true;
        ctx_.TryCancel();
        if (!finishing_) call_->Finish(&status_, tag(kFinish));
        cq_.Shutdown();
        void* got;
        bool ok;
        while (cq_.Next(&got, &ok)) {
        }
    }

    enum Op : intptr_t { kStart = 1, kWrite, kRead, kFinish };
    static void* tag(Op op) { return reinterpret_cast<void*>(op); }
    static unsigned bit(Op op) { return 1u << op; }
    static Clock::time_point deadline(double s) {
        return Clock::now() + std::chrono::microseconds(int64_t(std::min(s, 1e7) * 1e6));
    }

    void alive() const {
        if (closed_ || dead_) throw RpcFailure("UNAVAILABLE", "the stream to the expert server ended");
    }

    // Runs the completion queue until every op in ops (a mask of bit(op), cleared as they complete)
    // has completed. An op that fails ends the stream: its status is fetched and raised; ops that
    // outlive the deadline cancel it (DEADLINE_EXCEEDED).
    void await(unsigned& ops, Clock::time_point until, double timeout_s) {
        void* got;
        bool ok;
        while (ops) {
            const auto state = cq_.AsyncNext(&got, &ok, until);
            if (state == grpc::CompletionQueue::TIMEOUT) {
                dead_ = true;
                ctx_.TryCancel();
                char what[64];
                std::snprintf(what, sizeof what, "no answer within %g s", timeout_s);
                throw RpcFailure("DEADLINE_EXCEEDED", what);
            }
            if (state != grpc::CompletionQueue::GOT_EVENT) throw RpcFailure("UNAVAILABLE", "the stream was shut down");
            if (!ok) fail();
            ops &= ~bit(static_cast<Op>(reinterpret_cast<intptr_t>(got)));
        }
    }

    [[noreturn]] void fail() {
        dead_ = true;
        finishing_ = true;
        call_->Finish(&status_, tag(kFinish));
        void* got;
        bool ok;
        while (cq_.AsyncNext(&got, &ok, deadline(5.0)) == grpc::CompletionQueue::GOT_EVENT)
            if (got == tag(kFinish)) break;
        if (status_.ok()) throw RpcFailure("UNAVAILABLE", "the expert server ended the stream");
        throw RpcFailure(code_name(status_.error_code()), status_.error_message());
    }

    grpc::CompletionQueue cq_;  // declared first, destroyed last: the call refers to it
    std::unique_ptr<pb::ExpertService::Stub> stub_;
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientAsyncReaderWriter<pb::ComputeRequest, pb::ComputeResponse>> call_;
    pb::ComputeRequest request_;
    pb::ComputeResponse response_;
    grpc::Status status_;
    unsigned pending_ = 0;  // bit(kWrite) | bit(kRead) of the call submitted and not yet waited for
    bool dead_ = false, closed_ = false, finishing_ = false;
};

}  // namespace

PYBIND11_MODULE(tandem_grpc, m) {
    m.doc() = "The inline expert-call stream on grpc++: its client (the caller's thread drives it, GIL released) and server";
    gpr_set_log_function(log_line);
    static py::exception<RpcFailure> failure(m, "RpcFailure");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const RpcFailure& e) {
            PyErr_SetObject(failure.ptr(), py::make_tuple(e.code, e.what()).ptr());
        }
    });
    py::class_<InlineStream>(m, "InlineStream")
        .def(py::init<const std::string&, const std::string&, int, double, int>(), py::arg("target"),
             py::arg("root_pem") = "", py::arg("max_message_bytes") = 256 << 20, py::arg("connect_s") = 30.0,
             py::arg("keepalive_ms") = 0,
             "Opens a Compute stream to target (TLS when root_pem is given; keepalive_ms: ping period and timeout)")
        .def("submit", &InlineStream::submit, py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("weights"),
             py::arg("traceparent") = "", py::arg("trace_each") = false, py::arg("timeout_s") = 120.0,
             "Sends x [T, D] (float32 or bfloat16 bits), ids [T, K] int64, weights [T, K] float32")
        .def("wait", &InlineStream::wait, py::arg("timeout_s") = 120.0, "(out [T, D], compute seconds) of the next answer")
        .def("close", &InlineStream::close)
        .def_property_readonly("dead", &InlineStream::dead);
    tandem::register_compute_server(m);
    tandem::register_generate_server(m);
}
