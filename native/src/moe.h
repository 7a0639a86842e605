// The fused MoE layer call: out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t,k].
// T tokens, K experts per token, D hidden size, I expert intermediate size, E experts.
#pragma once
#include <cstdint>

#include "pool.h"
#include "tandem/format.h"
#include "tandem/kernels.h"

namespace tandem {

// A validated, read-only view of a packed layer buffer (see format.h).
struct MoeLayerView {
    const uint8_t* base = nullptr;
    Format format = Format::BF16;
    int experts = 0, hidden = 0, intermediate = 0, group = 0;

    static MoeLayerView parse(const uint8_t* data, size_t size);  // throws std::invalid_argument
    Matrix w13(int e) const;  // [2I, D]
    Matrix w2(int e) const;   // [D, I]
};

struct MoeCall {
    const MoeLayerView* layer;
    const float* x;        // [T, D]
    const int64_t* ids;    // [T, K], validated in range
    const float* weights;  // [T, K]
    float* out;            // [T, D]
    int tokens, top_k;
};

void moe_forward(ThreadPool& pool, const KernelTable& kernels, const MoeCall& call);

// Packs float32 expert weights (w13 [E, 2I, D], w2 [E, D, I]) into a layer buffer of
// layer_bytes(...) bytes, on all threads of the pool.
void pack_layer(ThreadPool& pool, const float* w13, const float* w2, Format f, int experts, int hidden,
                int intermediate, int group, uint8_t* dst);

}  // namespace tandem
