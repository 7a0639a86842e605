// The dense path's small fused steps, where torch's many small ops cost a decode step more than the
// arithmetic: RMSNorm, rotary embedding, and a few new tokens' attention over their cache.
// R rows of C values; T new tokens, S cached positions, H query heads, Hkv key/value heads,
// Dq and Dv the key and value head sizes.
#pragma once

#include <cstdint>

#include "pool.h"
#include "tandem/kernels.h"

namespace tandem {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, in float32 (as the reference models compute it).
void rms_norm(const float* x, const float* w, int rows, int cols, float eps, float* y);

// The residual add before a norm, fused: h[r] += d[r], then y[r] = rms_norm(h[r]) (the same bits as
// the add and rms_norm apart).
void add_rms_norm(float* h, const float* d, const float* w, int rows, int cols, float eps, float* y);

// Heads laid out with strides (in floats): head h of row t starts at base + t * row + h * head.
struct HeadView {
    float* base;
    long row, head;
};

// Rotary embedding of `heads` heads of T rows, src into dst (which may be src): the first 2 * half
// dims of each head turn by their row's angles (cos, sin [T][half]) as (x1 cos - x2 sin, x2 cos +
// x1 sin), pairs (i, i + half), or interleaved pairs (2i, 2i + 1) written back as those two halves;
// dims past 2 * half pass as they are. The same float32 operations, in the same order, as torch's.
// With norm [head_dim], each head is RMS-normed first (Qwen3's per-head q and k norms), as rms_norm.
void rope(HeadView src, HeadView dst, int rows, int heads, int head_dim, const float* cos, const float* sin,
          int half, bool interleaved, const float* norm = nullptr, float eps = 0.f);

// y [M, O] = x [M, I] w^T (+ b) in float32 by the variant's dot_rows (each value summed in one fixed
// order: a row's result does not depend on the rows around it), output features spread over the
// pool: the small float linears a step keeps exact, a router's; from inside a job on `pool`.
void linear_f32(ThreadPool& pool, const KernelTable& k, const float* x, int rows, int in, const float* w, int out,
                const float* b, float* y);

// Routing by softmax then top-k (Qwen-MoE, Mixtral): per row of logits [T][E], the k most probable
// experts (ties to the lower id), ids [T][k] and their probabilities [T][k], divided by their sum where
// `normalize`, then times `scale`.
void route_softmax_topk(const float* logits, int rows, int experts, int k, bool normalize, float scale, int64_t* ids,
                        float* weights);

struct AttendArgs {
    HeadView q;                 // [T, H, Dq]
    const float *k, *v;         // [S, Hkv, Dq], [S, Hkv, Dv], contiguous
    HeadView q2;                // [T, H, Dq2], with k2: a second part of each query and key, kept
    const float* k2;            // apart ([S, Hkv, Dq2], contiguous; null: none): MLA's rotary part
    int q2_dim;                 //   beside the latent, each logit q . k + q2 . k2
    const float* q_up;          // [H, Dn, Dq] or null: q holds Dn values a head, its query is q[t, h] q_up[h]
    const float* v_up;          // [H, Do, Dv] or null: a head's output is v_up[h] (its weighted values), Do
    int n_dim, o_dim;           //   values (absorbed MLA: kv_b_proj's key and value parts, by head)
    const int64_t* slots;       // [S] or null: position s's row of k and v (a paged cache's block table)
    const bool* mask;           // [T, S]: which cached positions each new token sees
    const float* sinks;         // [H] or null: a learned logit per head that joins the softmax with no value
    float* out;                 // [T, H * Dv] ([T, H * Do] with v_up)
    int tokens, heads, kv_heads, q_dim, v_dim, positions;
    float scale;
};

// out[t, h] = softmax_s(scale * q[t, h] . k[s, h / g] where mask[t, s]) . v[s, h / g], g = H / Hkv,
// each head of each token on its own (its result does not depend on the batch around it), the query
// products by the variant's dot_rows, the values' by its weigh_rows; from inside a job on `pool`.
void attend(ThreadPool& pool, const KernelTable& k, const AttendArgs& a);

}  // namespace tandem
