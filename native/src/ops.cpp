#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tandem {

namespace {

constexpr int kLanes = 16;  // independent partial sums, so the compiler can vectorize a reduction

// A head's logits [S] over its cache -> its probabilities: scaled, masked, softmax (the head's sink
// joining it as one more logit with no value).
// S: the positions up to the token's last seen one (the ones after it would add exact zeros).
void softmax_row(const AttendArgs& a, int h, const bool* seen, int S, float* logits) {
    float top = a.sinks ? a.sinks[h] : -std::numeric_limits<float>::infinity();
    for (int s = 0; s < S; ++s) {
        logits[s] = seen[s] ? logits[s] * a.scale : -std::numeric_limits<float>::infinity();
        top = std::max(top, logits[s]);
    }
    float total = a.sinks ? std::exp(a.sinks[h] - top) : 0.f;
    for (int s = 0; s < S; ++s) total += logits[s] = std::exp(logits[s] - top);
    for (int s = 0; s < S; ++s) logits[s] /= total;
}

// Position s's row of the cached keys and values.
inline long row_of(const AttendArgs& a, int s) { return a.slots ? long(a.slots[s]) : long(s); }

// The end of the run of positions from s0 whose rows follow each other (a paged cache's block).
inline int run_end(const int64_t* slots, int s0, int S) {
    int s1 = s0 + 1;
    while (s1 < S && slots[s1] == slots[s1 - 1] + 1) ++s1;
    return s1;
}

// logits[j][s] (row stride ld) = q_j . key s for the n query heads from q (head stride q_head) and
// positions [0, S) of keys (dim values of head g's part, a row every step floats): each key row
// read once for all n heads where they lie side by side.
void dot_keys(const KernelTable& k, const AttendArgs& a, const float* q, long q_head, int n, int dim, const float* keys,
              long step, int S, float* logits, int ld) {
    for (int s0 = 0, s1; s0 < S; s0 = s1) {  // runs of positions whose rows follow each other
        s1 = a.slots ? run_end(a.slots, s0, S) : S;
        const float* run = keys + row_of(a, s0) * step;
        if (q_head == dim) {
            k.dot_rows(q, n, dim, run, step, s1 - s0, logits + s0, ld);
        } else {
            for (int j = 0; j < n; ++j) k.dot_rows(q + j * q_head, 1, dim, run, step, s1 - s0, logits + long(j) * ld + s0, ld);
        }
    }
}

// One token's query heads [h0, h1) of one key/value head's group: each cached key and value row is
// read once for all of them. A head's arithmetic is the same whichever heads share the call.
// logits: [h1 - h0, positions] scratch.
void attend_heads(const KernelTable& k, const AttendArgs& a, int t, int h0, int h1, float* logits) {
    const bool* seen = a.mask + long(t) * a.positions;
    int S = a.positions;  // a prompt chunk's token sees none of the positions after its own
    while (S > 0 && !seen[S - 1]) --S;
    const int n = h1 - h0, ld = a.positions, g = h0 / (a.heads / a.kv_heads);
    const long v_step = long(a.kv_heads) * a.v_dim;
    const float* q = a.q.base + t * a.q.row + h0 * a.q.head;
    long q_head = a.q.head;
    thread_local std::vector<float> queries, weighed;
    if (a.q_up) {  // each head's query: its Dn values times its [Dn, Dq] matrix
        queries.assign(size_t(n) * a.q_dim, 0.f);
        for (int j = 0; j < n; ++j)
            k.weigh_rows(q + j * a.q.head, 1, a.n_dim, a.q_up + long(h0 + j) * a.n_dim * a.q_dim, a.q_dim, a.n_dim,
                         queries.data() + long(j) * a.q_dim, a.q_dim, a.q_dim);
        q = queries.data(), q_head = a.q_dim;
    }
    dot_keys(k, a, q, q_head, n, a.q_dim, a.k + long(g) * a.q_dim, long(a.kv_heads) * a.q_dim, S, logits, ld);
    if (a.k2) {  // the keys' second part, summed in after the first
        thread_local std::vector<float> part;
        part.resize(size_t(n) * S);
        dot_keys(k, a, a.q2.base + t * a.q2.row + h0 * a.q2.head, a.q2.head, n, a.q2_dim, a.k2 + long(g) * a.q2_dim,
                 long(a.kv_heads) * a.q2_dim, S, part.data(), S);
        for (int j = 0; j < n; ++j)
            for (int s = 0; s < S; ++s) logits[long(j) * ld + s] += part[long(j) * S + s];
    }
    for (int j = 0; j < n; ++j) softmax_row(a, h0 + j, seen, S, logits + long(j) * ld);
    if (a.v_up) weighed.resize(size_t(n) * a.v_dim);
    float* out = a.v_up ? weighed.data() : a.out + (long(t) * a.heads + h0) * a.v_dim;
    std::fill(out, out + long(n) * a.v_dim, 0.f);
    const float* values = a.v + long(g) * a.v_dim;
    for (int s0 = 0, s1; s0 < S; s0 = s1) {
        s1 = a.slots ? run_end(a.slots, s0, S) : S;
        k.weigh_rows(logits + s0, n, ld, values + row_of(a, s0) * v_step, v_step, s1 - s0, out, a.v_dim, a.v_dim);
    }
    for (int j = 0; a.v_up && j < n; ++j)  // each head's output: its [Do, Dv] matrix times its weighted values
        k.dot_rows(out + long(j) * a.v_dim, 1, a.v_dim, a.v_up + long(h0 + j) * a.o_dim * a.v_dim, a.v_dim, a.o_dim,
                   a.out + (long(t) * a.heads + h0 + j) * a.o_dim, a.o_dim);
}

}  // namespace

void rms_norm(const float* x, const float* w, int rows, int cols, float eps, float* y) {
    for (int r = 0; r < rows; ++r, x += cols, y += cols) {
        float part[kLanes] = {};
        int c = 0;
        for (; c + kLanes <= cols; c += kLanes)
            for (int j = 0; j < kLanes; ++j) part[j] += x[c + j] * x[c + j];
        float ss = 0.f;
        for (int j = 0; j < kLanes; ++j) ss += part[j];
        for (; c < cols; ++c) ss += x[c] * x[c];
        const float inv = 1.f / std::sqrt(ss / float(cols) + eps);
        for (int j = 0; j < cols; ++j) y[j] = w[j] * (x[j] * inv);
    }
}

void add_rms_norm(float* h, const float* d, const float* w, int rows, int cols, float eps, float* y) {
    for (long i = 0, n = long(rows) * cols; i < n; ++i) h[i] += d[i];
    rms_norm(h, w, rows, cols, eps, y);
}

void rope(HeadView src, HeadView dst, int rows, int heads, int head_dim, const float* cos, const float* sin,
          int half, bool interleaved, const float* norm, float eps) {
    std::vector<float> x1(half), x2(half), normed(norm ? head_dim : 0);
    for (int t = 0; t < rows; ++t) {
        const float *c = cos + long(t) * half, *s = sin + long(t) * half;
        for (int h = 0; h < heads; ++h) {
            const float* x = src.base + t * src.row + h * src.head;
            float* y = dst.base + t * dst.row + h * dst.head;
            if (norm) {
                rms_norm(x, norm, 1, head_dim, eps, normed.data());
                x = normed.data();
            }
            for (int i = 0; i < half; ++i) {
                x1[i] = interleaved ? x[2 * i] : x[i];
                x2[i] = interleaved ? x[2 * i + 1] : x[half + i];
            }
            for (int i = 0; i < half; ++i) {
                y[i] = x1[i] * c[i] - x2[i] * s[i];
                y[half + i] = x2[i] * c[i] + x1[i] * s[i];
            }
            if (y != x) std::copy(x + 2 * half, x + head_dim, y + 2 * half);
        }
    }
}

void linear_f32(ThreadPool& pool, const KernelTable& k, const float* x, int rows, int in, const float* w, int out,
                const float* b, float* y) {
    constexpr int kOutputs = 16;  // output features a task computes, for every row
    pool.parallel_for((out + kOutputs - 1) / kOutputs, [&](int task) {
        const int o0 = task * kOutputs, o1 = std::min(out, o0 + kOutputs);
        k.dot_rows(x, rows, in, w + long(o0) * in, in, o1 - o0, y + o0, out);
        if (b)
            for (int m = 0; m < rows; ++m)
                for (int o = o0; o < o1; ++o) y[long(m) * out + o] += b[o];
    });
}

void route_softmax_topk(const float* logits, int rows, int experts, int k, bool normalize, float scale, int64_t* ids,
                        float* weights) {
    std::vector<float> p(experts);
    std::vector<int> order(experts);
    for (int t = 0; t < rows; ++t, logits += experts, ids += k, weights += k) {
        const float top = *std::max_element(logits, logits + experts);
        float total = 0.f;
        for (int e = 0; e < experts; ++e) total += p[e] = std::exp(logits[e] - top);
        for (int e = 0; e < experts; ++e) p[e] /= total;
        for (int e = 0; e < experts; ++e) order[e] = e;
        std::partial_sort(order.begin(), order.begin() + k, order.end(),
                          [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        float chosen = 0.f;
        for (int j = 0; j < k; ++j) chosen += weights[j] = p[order[j]];
        for (int j = 0; j < k; ++j) {
            ids[j] = order[j];
            weights[j] = (normalize ? weights[j] / chosen : weights[j]) * scale;
        }
    }
}

void attend(ThreadPool& pool, const KernelTable& k, const AttendArgs& a) {
    // a task: one token's heads of one group, or of part of it where there are fewer groups than threads
    const int group = a.heads / a.kv_heads, groups = a.tokens * a.kv_heads;
    const int split = std::min(group, (2 * pool.size() + groups - 1) / groups);  // parts a group is cut into
    const int per = (group + split - 1) / split, parts = (group + per - 1) / per;
    pool.parallel_for(groups * parts, [&](int task) {
        const int part = task % parts, t = task / parts / a.kv_heads, g = task / parts % a.kv_heads;
        const int h0 = g * group + part * per, h1 = std::min((g + 1) * group, h0 + per);
        thread_local std::vector<float> logits;
        logits.resize(size_t(h1 - h0) * a.positions);
        attend_heads(k, a, t, h0, h1, logits.data());
    });
}

}  // namespace tandem
