// A decoder layer's dense side for a few new tokens (a decode step) in one pool job: the steps the
// dense path would otherwise call one by one from Python, each a binding call and a wake of the
// pool's helpers, which cost a decode step more than the steps' arithmetic. The same kernels run in
// the same order on the same values, so the bits are those of the steps apart.
// T new tokens, D hidden size, H query heads, Hkv key/value heads, Dh head size, E routed experts,
// S a sequence's cached positions (this step's included).
#pragma once

#include <vector>

#include "linear.h"
#include "ops.h"

namespace tandem {

// What a layer holds from load time (pointers into arrays its binding keeps alive).
struct DecodeLayer {
    const float *input_norm, *post_norm;  // [D]
    float eps;
    std::vector<const PackedLinear*> qkv;  // outputs side by side: q [H * Dh], k and v [Hkv * Dh]
    std::vector<const PackedLinear*> o;    // [D] from [H * Dh]
    int hidden, heads, kv_heads, head_dim;
    const float *q_norm, *k_norm;  // [Dh]: each head RMS-normed before it turns (Qwen3), or null
    bool interleaved;
    float scale;
    const float* sinks;                // [H] or null
    const float *gate, *gate_bias;     // the router [E, D] and [E], or null (a dense MLP layer; no bias)
    int experts;
    int top_k;                         // > 0: route by softmax then top-k (route_softmax_topk) in the call
    bool normalize;
    float route_scale;
};

// One sequence's rows of the step and its layer cache.
struct DecodeSequence {
    int row0, rows;
    float *k, *v;            // [S, Hkv, Dh] from the sequence's first position; the rows go at [start, start + rows)
    const int64_t* slots;    // [S] or null: position s's row of k and v (a paged cache's block table)
    int start;
    const bool* mask;        // [rows, S]
};

// h [T, D] += delta (none at the first layer); q, k, v of rms_norm(h) by the qkv linears, q and k
// turned (cos, sin [T, half]) after their head norms; each sequence's k and v rows into its cache and
// its queries' attention over it; h += o(attention); x [T, D] = rms_norm(h) by post_norm; logits
// [T, E] = x's router products where the layer has a router, and with top_k its choice: ids [T, k]
// and weights [T, k]. From outside any job on `pool`.
void decode_layer(ThreadPool& pool, const KernelTable& k, const DecodeLayer& layer, float* h, const float* delta,
                  int tokens, const float* cos, const float* sin, int half, const std::vector<DecodeSequence>& seqs,
                  float* x, float* logits, int64_t* ids, float* weights);

}  // namespace tandem
