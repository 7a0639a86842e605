#include "linear.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "activations.h"
#include "moe.h"

namespace tandem {

namespace {

constexpr int kRowAlign = 32;  // the largest task granularity of rows_per_task's blocks

int round_up(int n, int m) { return (n + m - 1) / m * m; }

// Columns padded to a whole number of the format's blocks and of groups.
int padded_cols(Format f, int in, int group) {
    return round_up(in, f == Format::BF16 ? block_cols(f) : std::lcm(block_cols(f), group));
}

uint8_t* allocate(size_t bytes) {
    void* p = std::aligned_alloc(64, align64(bytes));
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, align64(bytes));
    return static_cast<uint8_t*>(p);
}

}  // namespace

PackedLinear::PackedLinear(Format f, int out, int in, int group, const int8_t* levels)
    : format_(f), out_(out), in_(in), group_(f == Format::BF16 ? 0 : group),
      rows_(round_up(out, kRowAlign)),
      cols_(padded_cols(f, in, group)), levels_{}, bytes_(matrix_bytes(f, rows_, cols_, group_)),
      data_(allocate(bytes_), std::free) {
    std::memcpy(levels_, levels ? levels : kInt4Levels, sizeof levels_);
}

Matrix PackedLinear::matrix() const { return matrix_at(data_.get(), format_, rows_, cols_, group_, levels()); }

void PackedLinear::pack(ThreadPool& pool, int row0, int rows, const float* w) {
    const Matrix m = matrix();
    constexpr int kPackRows = 32;
    std::atomic<bool> bad{false};
    pool.run([&] {
        pool.parallel_for((rows + kPackRows - 1) / kPackRows, [&](int task) {
            const int r0 = task * kPackRows, r1 = std::min(rows, r0 + kPackRows);
            std::vector<float> padded(size_t(r1 - r0) * cols_, 0.f);
            for (int r = r0; r < r1; ++r) std::copy(w + size_t(r) * in_, w + size_t(r + 1) * in_, padded.begin() + size_t(r - r0) * cols_);
            if (!pack_rows(m, row0 + r0, row0 + r1, padded.data())) bad = true;
        });
    });
    if (bad) throw std::invalid_argument("weight: non-finite value, or a scale beyond fp16's range");
}

void PackedLinear::put_codes(int row0, int rows, const uint8_t* codes, const uint16_t* scales, const uint16_t* mins) {
    put_matrix_codes(matrix(), row0, rows, in_, codes, scales, mins);
}

void PackedLinear::set_bias(const float* b) { bias_.assign(b, b + out_); }

void PackedLinear::dequantize(float* out) const {
    std::vector<float> all(size_t(rows_) * cols_);
    tandem::dequantize(matrix(), all.data());
    for (int r = 0; r < out_; ++r) std::copy_n(all.data() + size_t(r) * cols_, in_, out + size_t(r) * in_);
}

void PackedLinear::forward(ThreadPool& pool, const KernelTable& table, const float* x, int tokens, float* y,
                           int ldy) const {
    if (tokens == 0) return;
    if (ldy == 0) ldy = out_;
    // A token's bits never depend on its batch-mates: the table's batch-invariant kernel where it has one.
    const MatmulFn matmul = table.invariant[int(format_)] ? table.invariant[int(format_)] : table.matmul[int(format_)];
    const Matrix m = matrix();
    const Prepared a = prepare(pool, table, format_, tokens, cols_, [&](int t, float* row) {
        std::copy(x + size_t(t) * in_, x + size_t(t + 1) * in_, row);
        std::fill(row + in_, row + cols_, 0.f);
    });
    const int block = rows_per_task(rows_, 1, pool.size()), tasks = (rows_ + block - 1) / block;
    const Activations act = a.view(nullptr, cols_, 0);
    auto task = [&](int i) {
        const int r0 = i * block, r1 = std::min(rows_, r0 + block), kept = std::min(r1, out_) - r0;
        if (r1 <= out_) {
            matmul(m, r0, r1, act, tokens, y + r0, ldy);
        } else {  // the padded rows' tile: computed aside, only the real rows kept
            thread_local std::vector<float> tail;
            tail.resize(size_t(tokens) * (r1 - r0));
            matmul(m, r0, r1, act, tokens, tail.data(), r1 - r0);
            for (int t = 0; t < tokens; ++t)
                std::copy_n(tail.data() + size_t(t) * (r1 - r0), kept, y + size_t(t) * ldy + r0);
        }
        if (!bias_.empty())
            for (int t = 0; t < tokens; ++t)
                for (int r = r0; r < r0 + kept; ++r) y[size_t(t) * ldy + r] += bias_[r];
    };
    if (tasks == 1) task(0);
    else pool.parallel_for(tasks, task);
}

}  // namespace tandem
