// The dense path's small fused steps, where torch's many small ops cost a decode step more than the
// arithmetic: RMSNorm (optionally after the residual add). R rows of C values.
#pragma once

namespace tandem {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, in float32 (as the reference models compute it).
void rms_norm(const float* x, const float* w, int rows, int cols, float eps, float* y);

}  // namespace tandem
