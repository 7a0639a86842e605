// What tandem_grpc's servers (Compute, Generate) set up and stop alike: one listening port, message
// limits, the keepalive pings our clients send, a thread quota, and a shutdown with a grace period.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

namespace tandem {

// Serves service on address (port 0: any free one, written to *port); throws when it cannot listen.
inline std::unique_ptr<grpc::Server> start_server(grpc::Service* service, const std::string& address,
                                                  std::shared_ptr<grpc::ServerCredentials> creds,
                                                  int max_message_bytes, int max_threads, int keepalive_ms,
                                                  const std::string& quota_name, int* port) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, std::move(creds), port);
    builder.SetMaxReceiveMessageSize(max_message_bytes);
    builder.SetMaxSendMessageSize(max_message_bytes);
    // Clients ping every keepalive_ms (services/common/grpc_defaults.py): allowed, calls or not.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, keepalive_ms / 2);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    grpc::ResourceQuota quota(quota_name);
    quota.SetMaxThreads(max_threads);  // a thread a stream, and the pollers: streams past it get RESOURCE_EXHAUSTED
    builder.SetResourceQuota(quota);
    builder.RegisterService(service);
    std::unique_ptr<grpc::Server> server;
    {
        pybind11::gil_scoped_release release;
        server = builder.BuildAndStart();
    }
    if (!server || *port == 0) throw std::runtime_error("cannot listen on " + address);
    return server;
}

// Ends the open streams (after grace_s at most, GIL released: their threads may want it) and stops listening.
inline void stop_server(std::unique_ptr<grpc::Server>& server, double grace_s) {
    if (!server) return;
    {
        pybind11::gil_scoped_release release;
        server->Shutdown(std::chrono::system_clock::now() +
                         std::chrono::microseconds(int64_t(std::max(0.0, std::min(grace_s, 1e6)) * 1e6)));
        server->Wait();
    }
    server.reset();
}

}  // namespace tandem
