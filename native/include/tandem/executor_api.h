// The expert server's Executor (native/src/expert_session.cpp) as a C table, so that native code in
// another extension module (tandem_grpc's Compute server) can run layer calls on it without the GIL
// and without sharing C++ types across modules. tandem_native hands it over as a PyCapsule named
// TANDEM_EXECUTOR_API_NAME (Executor.api); the capsule's owner keeps the Executor alive.
// T tokens, D hidden size, K experts per token.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define TANDEM_EXECUTOR_API_NAME "tandem_native.ExecutorApi"
#define TANDEM_EXECUTOR_API_VERSION 1u

extern "C" {

// Each call returns 0, or a gRPC status code (3 INVALID_ARGUMENT: the message names the field; 13
// INTERNAL) with a NUL-terminated message of at most cap bytes written to message.
struct TandemExecutorApi {
    uint32_t version;
    void* self;
    // A call's header, before any of its data is touched.
    int (*check)(void* self, int64_t layer, int64_t tokens, int64_t hidden, int64_t top_k, char* message, size_t cap);
    // out [T, D] = the layer's weighted experts of x [T, D], both float32 or both bfloat16 bits (bf16 != 0);
    // ids [T, K] int64 (range-checked), weights [T, K] float32. Call check first.
    int (*run)(void* self, int64_t layer, const void* x, void* out, int bf16, const int64_t* ids,
               const float* weights, int tokens, int top_k, char* message, size_t cap);
};

}  // extern "C"
