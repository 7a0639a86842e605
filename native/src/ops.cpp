#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tandem {

namespace {

constexpr int kLanes = 16;  // independent partial sums, so the compiler can vectorize a reduction

// Four floats as one value (GCC's vector extension: SSE on the baseline this file is built for).
typedef float v4 __attribute__((vector_size(16)));

inline v4 load4(const float* p) {
    v4 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

inline void store4(float* p, v4 v) { __builtin_memcpy(p, &v, sizeof v); }

// sum a[i] b[i] in a fixed order: 16 lanes over the multiples of 16, the lanes added in order, then the rest.
float dot(const float* a, const float* b, int n) {
    v4 s0 = {}, s1 = {}, s2 = {}, s3 = {};
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        s0 += load4(a + i) * load4(b + i);
        s1 += load4(a + i + 4) * load4(b + i + 4);
        s2 += load4(a + i + 8) * load4(b + i + 8);
        s3 += load4(a + i + 12) * load4(b + i + 12);
    }
    const v4 s = (s0 + s1) + (s2 + s3);
    float sum = (s[0] + s[1]) + (s[2] + s[3]);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// y[i] += p x[i]
void axpy(float p, const float* x, float* y, int n) {
    const v4 pv = {p, p, p, p};
    int i = 0;
    for (; i + 4 <= n; i += 4) store4(y + i, load4(y + i) + pv * load4(x + i));
    for (; i < n; ++i) y[i] += p * x[i];
}

// One token's one head: logits over the positions it sees, their softmax, the weighted values.
void attend_head(const AttendArgs& a, int t, int h, float* logits) {
    const int group = a.heads / a.kv_heads, g = h / group;
    const float* q = a.q.base + t * a.q.row + h * a.q.head;
    const bool* seen = a.mask + long(t) * a.positions;
    const long k_step = long(a.kv_heads) * a.q_dim, v_step = long(a.kv_heads) * a.v_dim;
    float top = a.sinks ? a.sinks[h] : -std::numeric_limits<float>::infinity();
    for (int s = 0; s < a.positions; ++s) {
        logits[s] = seen[s] ? dot(q, a.k + s * k_step + g * a.q_dim, a.q_dim) * a.scale
                            : -std::numeric_limits<float>::infinity();
        top = std::max(top, logits[s]);
    }
    float total = a.sinks ? std::exp(a.sinks[h] - top) : 0.f;
    for (int s = 0; s < a.positions; ++s) total += logits[s] = std::exp(logits[s] - top);
    float* out = a.out + (long(t) * a.heads + h) * a.v_dim;
    std::fill(out, out + a.v_dim, 0.f);
    for (int s = 0; s < a.positions; ++s) {
        const float p = logits[s] / total;
        if (p == 0.f) continue;
        axpy(p, a.v + s * v_step + g * a.v_dim, out, a.v_dim);
    }
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
        k.dot_rows(x, rows, in, w + long(o0) * in, o1 - o0, y + o0, out);
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

void attend(ThreadPool& pool, const AttendArgs& a) {
    pool.parallel_for(a.heads, [&](int h) {
        thread_local std::vector<float> logits;
        logits.resize(a.positions);
        for (int t = 0; t < a.tokens; ++t) attend_head(a, t, h, logits.data());
    });
}

}  // namespace tandem
