#include "ops.h"

#include <cmath>

namespace tandem {

void rms_norm(const float* x, const float* w, int rows, int cols, float eps, float* y) {
    constexpr int kLanes = 16;  // independent partial sums, so the compiler can vectorize the reduction
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

}  // namespace tandem
