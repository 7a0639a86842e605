// Dense linear layers on the expert kernels: y = W x (+ b) with W [O, I] packed as one always-active
// expert's matrix (format.h's tiles, scales and levels), computed by the same kernel table on the
// same pool. Rows are padded with zeros to a multiple of 32 and columns to the format's block (and
// the group), so every shape packs: padded columns meet zero activations, padded rows are computed
// into scratch and never returned.
// T tokens, O output features, I input features.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "pool.h"
#include "tandem/format.h"
#include "tandem/kernels.h"

namespace tandem {

class PackedLinear {
public:
    // levels: int4's 16 levels (null: kInt4Levels); ignored for other formats.
    PackedLinear(Format f, int out, int in, int group, const int8_t* levels);

    Format format() const { return format_; }
    int out() const { return out_; }
    int in() const { return in_; }
    int group() const { return group_; }
    const int8_t* levels() const { return format_ == Format::INT4 ? levels_ : nullptr; }
    size_t nbytes() const { return bytes_; }
    bool biased() const { return !bias_.empty(); }
    Matrix matrix() const;

    // Quantizes float32 rows [row0, row0 + rows) from w [rows][I] on the pool; throws on a
    // non-finite value or a scale beyond fp16.
    void pack(ThreadPool& pool, int row0, int rows, const float* w);
    // Stores already-quantized rows as they are (moe.h's put_codes): codes [rows][I], fp16 scales
    // (and int4_asym's minimums) [rows][I / G].
    void put_codes(int row0, int rows, const uint8_t* codes, const uint16_t* scales, const uint16_t* mins);
    void set_bias(const float* b);  // [O]
    void dequantize(float* out) const;  // [O][I]
    // y [T][O] = x [T][I] W^T (+ b); from inside a job on `pool` (the coordinator thread). Rows of y
    // are ldy floats apart (0: O; more: y is a column range of a wider output, several linears of one
    // input side by side).
    void forward(ThreadPool& pool, const KernelTable& k, const float* x, int tokens, float* y, int ldy = 0) const;

private:
    Format format_;
    int out_, in_, group_, rows_, cols_;
    int8_t levels_[16];
    size_t bytes_;
    std::unique_ptr<uint8_t, void (*)(void*)> data_;
    std::vector<float> bias_;
};

}  // namespace tandem
