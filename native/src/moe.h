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
    const int8_t* levels = nullptr;  // int4: the header's 16 levels
    const float* biases = nullptr;   // biased layers: b13 [E][2I], then b2 [E][D]
    Format format = Format::BF16;
    Activation activation = Activation::SILU;
    float alpha = 0.f, limit = 0.f;
    int experts = 0, hidden = 0, intermediate = 0, group = 0;

    // Throws std::invalid_argument; check_scales = false skips the walk over every scale (a buffer
    // being filled expert by expert).
    static MoeLayerView parse(const uint8_t* data, size_t size, bool check_scales = true);
    Matrix w13(int e) const;  // [2I, D]
    Matrix w2(int e) const;   // [D, I]
    const float* b13(int e) const { return biases ? biases + size_t(e) * 2 * intermediate : nullptr; }  // [2I]
    const float* b2(int e) const {  // [D]
        return biases ? biases + size_t(experts) * 2 * intermediate + size_t(e) * hidden : nullptr;
    }
};

// How a layer's experts compute besides their matrices.
struct ExpertShape {
    Activation activation = Activation::SILU;
    float alpha = 0.f, limit = 0.f;
    bool biased = false;
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

// Writes the header of an empty layer into dst (layer_bytes(...) bytes, zeroed after the header).
// levels: int4's 16 levels, strictly increasing (null: kInt4Levels); ignored for other formats.
void init_layer(Format f, int experts, int hidden, int intermediate, int group, const int8_t* levels,
                const ExpertShape& shape, uint8_t* dst);

// Stores expert e's biases (b13 [2I], b2 [D]) in a biased layer.
void put_biases(const MoeLayerView& layer, int e, const float* b13, const float* b2);

// Quantizes float32 weights of experts [e0, e1) (w13 [e1 - e0, 2I, D], w2 [e1 - e0, D, I]) into
// the layer on all threads of the pool, to the nearest of the layer's levels.
void pack_experts(ThreadPool& pool, const MoeLayerView& layer, int e0, int e1, const float* w13, const float* w2);

// Stores already-quantized rows [row0, row0 + rows) of expert e's w13 (or w2) as they are: codes
// [rows][C] (int8 values; int4 indices into the layer's levels; int4_asym q, all 0-15), fp16 scales
// [rows][C / G] and, for int4_asym, fp16 minimums as the scales. Arguments are validated by the caller.
void put_codes(const MoeLayerView& layer, int e, bool w2, int row0, int rows, const uint8_t* codes,
               const uint16_t* scales, const uint16_t* mins);

// put_codes into any matrix: codes [rows][cols] for its first `cols` columns (a multiple of the
// group; the rest keep their zeros), scales (and mins) [rows][cols / G].
void put_matrix_codes(const Matrix& m, int row0, int rows, int cols, const uint8_t* codes, const uint16_t* scales,
                      const uint16_t* mins);

// Quantizes rows [r0, r1) of m from float32 rows w [r1 - r0][m.cols] on this thread; false on a
// non-finite value or a scale beyond fp16's range.
bool pack_rows(const Matrix& m, int r0, int r1, const float* w);

// The float32 values a packed matrix stands for, [R][C] into out (the oracle of imports and tests).
void dequantize(const Matrix& m, float* out);

// init_layer and pack_experts of every expert (w13 [E, 2I, D], w2 [E, D, I]) with kInt4Levels.
void pack_layer(ThreadPool& pool, const float* w13, const float* w2, Format f, int experts, int hidden,
                int intermediate, int group, uint8_t* dst);

}  // namespace tandem
