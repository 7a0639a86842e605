#include "decode_layer.h"

#include <algorithm>

namespace tandem {

namespace {

// Linears of one input, their outputs side by side [T, width] (linears_forward's loop).
int forward_all(ThreadPool& pool, const KernelTable& k, const std::vector<const PackedLinear*>& parts, const float* x,
                int tokens, float* y, int width) {
    int offset = 0;
    for (const PackedLinear* l : parts) {
        l->forward(pool, k, x, tokens, y + offset, width);
        offset += l->out();
    }
    return offset;
}

}  // namespace

void decode_layer(ThreadPool& pool, const KernelTable& k, const DecodeLayer& L, float* h, const float* delta,
                  int tokens, const float* cos, const float* sin, int half, const std::vector<DecodeSequence>& seqs,
                  float* x, float* logits, int64_t* ids, float* weights) {
    const int D = L.hidden, qw = L.heads * L.head_dim, kw = L.kv_heads * L.head_dim, width = qw + 2 * kw;
    thread_local std::vector<float> qkv, attn, o;
    qkv.resize(size_t(tokens) * width), attn.resize(size_t(tokens) * qw), o.resize(size_t(tokens) * D);
    pool.run([&] {
        if (delta) add_rms_norm(h, delta, L.input_norm, tokens, D, L.eps, x);
        else rms_norm(h, L.input_norm, tokens, D, L.eps, x);
        forward_all(pool, k, L.qkv, x, tokens, qkv.data(), width);
        const HeadView q{qkv.data(), width, L.head_dim}, kv{qkv.data() + qw, width, L.head_dim};
        rope(q, q, tokens, L.heads, L.head_dim, cos, sin, half, L.interleaved, L.q_norm, L.eps);
        rope(kv, kv, tokens, L.kv_heads, L.head_dim, cos, sin, half, L.interleaved, L.k_norm, L.eps);
        for (const DecodeSequence& s : seqs) {
            for (int r = 0; r < s.rows; ++r) {
                const float* row = qkv.data() + size_t(s.row0 + r) * width + qw;
                const size_t at = size_t(s.slots ? s.slots[s.start + r] : s.start + r) * kw;
                std::copy(row, row + kw, s.k + at);
                std::copy(row + kw, row + 2 * kw, s.v + at);
            }
            AttendArgs a{};
            a.q = {q.base + long(s.row0) * width, width, L.head_dim};
            a.k = s.k, a.v = s.v, a.slots = s.slots, a.mask = s.mask, a.sinks = L.sinks;
            a.out = attn.data() + size_t(s.row0) * qw;
            a.tokens = s.rows, a.heads = L.heads, a.kv_heads = L.kv_heads, a.q_dim = a.v_dim = L.head_dim;
            a.positions = s.start + s.rows, a.scale = L.scale;
            attend(pool, k, a);
        }
        forward_all(pool, k, L.o, attn.data(), tokens, o.data(), D);
        add_rms_norm(h, o.data(), L.post_norm, tokens, D, L.eps, x);
        if (L.gate) linear_f32(pool, k, x, tokens, D, L.gate, L.experts, L.gate_bias, logits);
        if (L.top_k) route_softmax_topk(logits, tokens, L.experts, L.top_k, L.normalize, L.route_scale, ids, weights);
    });
}

}  // namespace tandem
