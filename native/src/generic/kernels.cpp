// The reference kernels: plain C++, built for every CPU, the oracle the ISA variants are tested against.
#include <algorithm>
#include <cmath>

#include "tandem/kernels.h"

namespace tandem {
namespace {

void quantize(const float* x, int cols, int levels, int8_t* q, float* s) {
    for (int b = 0; b < cols / kBlock; ++b) {
        const float* xb = x + b * kBlock;
        float amax = 0.f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        float scale = amax / float(levels), inv = amax > 0.f ? float(levels) / amax : 0.f;
        s[b] = scale;
        for (int j = 0; j < kBlock; ++j) q[b * kBlock + j] = int8_t(std::nearbyint(xb[j] * inv));
    }
}

void matmul_bf16(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    const int width = block_cols(Format::BF16);
    for (int r = r0; r < r1; ++r) {
        for (int i = 0; i < n; ++i) {
            const float* xi = x.f + x.row(i) * x.cols;
            float acc = 0.f;
            for (int b = 0; b < w.cols / width; ++b) {
                const uint16_t* block = reinterpret_cast<const uint16_t*>(block_at(w, r, b));
                for (int j = 0; j < width; ++j) acc += bf16_to_float(block[j]) * xi[b * width + j];
            }
            y[int64_t(i) * ldy + (r - r0)] = acc;
        }
    }
}

// Shared by the integer formats: `unpack` turns block b of row r into 32 codes; int4_asym adds each
// block's minimum times the token's sum over the block.
template <typename Unpack>
void matmul_int(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy, Unpack unpack) {
    const int blocks = w.cols / kBlock, per_group = w.group / kBlock;
    int8_t wq[kBlock];
    for (int r = r0; r < r1; ++r) {
        auto scale = [&](int b) { return fp16_to_float(*int_scale_at(w, r, b / per_group)); };
        auto min = [&](int b) { return fp16_to_float(*int_min_at(w, r, b / per_group)); };
        for (int i = 0; i < n; ++i) {
            const int8_t* xq = x.q + x.row(i) * x.cols;
            const float* xs = x.s + x.row(i) * blocks;
            float acc = 0.f;
            for (int b = 0; b < blocks; ++b) {
                unpack(r, b, wq);
                int32_t dot = 0;
                for (int j = 0; j < kBlock; ++j) dot += int32_t(wq[j]) * xq[b * kBlock + j];
                acc += float(dot) * (xs[b] * scale(b));
                if (w.mins) acc += min(b) * (xs[b] * float(x.sums[x.row(i) * blocks + b]));
            }
            y[int64_t(i) * ldy + (r - r0)] = acc;
        }
    }
}

void matmul_int8(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    matmul_int(w, r0, r1, x, n, y, ldy, [&](int r, int b, int8_t* out) {
        for (int j = 0; j < kBlock; ++j) out[j] = int8_t(*int_byte_at(w, r, b * kBlock + j));
    });
}

void matmul_int4(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    matmul_int(w, r0, r1, x, n, y, ldy, [&](int r, int b, int8_t* out) {
        for (int j = 0; j < kBlock; ++j) {
            const uint8_t byte = *int_byte_at(w, r, b * kBlock + j);
            out[j] = w.levels[j % 8 < 4 ? byte & 0x0f : byte >> 4];
        }
    });
}

void matmul_int4_asym(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    matmul_int(w, r0, r1, x, n, y, ldy, [&](int r, int b, int8_t* out) {
        for (int j = 0; j < kBlock; ++j) {
            const uint8_t byte = *int_byte_at(w, r, b * kBlock + j);
            out[j] = int8_t(j % 8 < 4 ? byte & 0x0f : byte >> 4);
        }
    });
}

bool arrange(const float* x, int cols, float* out) {
    std::copy(x, x + cols, out);
    return false;
}

void silu_mul(const float* gate_up, int intermediate, float* h) {
    for (int j = 0; j < intermediate; ++j) {
        const float g = gate_up[j];
        h[j] = g / (1.f + std::exp(-g)) * gate_up[intermediate + j];
    }
}

void swiglu_oai(const float* gate_up, int intermediate, float alpha, float limit, float* h) {
    for (int j = 0; j < intermediate; ++j) {
        const float g = std::min(gate_up[j], limit), u = std::max(-limit, std::min(limit, gate_up[intermediate + j]));
        h[j] = (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
    }
}

void dot_rows(const float* x, int rows, int in, const float* w, long ldw, int outs, float* y, int ldy) {
    for (int m = 0; m < rows; ++m)
        for (int o = 0; o < outs; ++o) {
            const float *xm = x + long(m) * in, *wo = w + o * ldw;
            float sum = 0.f;
            for (int i = 0; i < in; ++i) sum += xm[i] * wo[i];
            y[long(m) * ldy + o] = sum;
        }
}

void weigh_rows(const float* p, int rows, long ldp, const float* v, long ldv, int outs, float* y, int ldy, int cols) {
    for (int m = 0; m < rows; ++m)
        for (int o = 0; o < outs; ++o) {
            const float w = p[long(m) * ldp + o];
            const float* vo = v + o * ldv;
            float* ym = y + long(m) * ldy;
            for (int d = 0; d < cols; ++d) ym[d] = std::fma(w, vo[d], ym[d]);
        }
}

}  // namespace

const KernelTable& generic_kernels() {
    static const KernelTable table{"generic", {matmul_bf16, matmul_int8, matmul_int4, matmul_int4_asym}, quantize, arrange,
                                   silu_mul, swiglu_oai, dot_rows, weigh_rows};
    return table;
}

}  // namespace tandem
