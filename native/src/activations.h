// What the fused MoE call and the dense linears share: activations prepared for a variant's
// matmul, and how weight rows are split into tasks (internal to the native module).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "aligned.h"
#include "pool.h"
#include "tandem/kernels.h"

namespace tandem {

// Weight rows per task: long contiguous runs stream best (up to 256 rows), but keep at least 4
// tasks per thread so the threads finish together. Always a multiple of the 4-row tile.
inline int rows_per_task(int rows, int experts, int threads) {
    int block = 256;
    while (block > 32 && experts * ((rows + block - 1) / block) < 4 * threads) block /= 2;
    return block;
}

// v as `rows` rows of `width` (left as they are: their writer fills them) and kPadRows zero rows.
template <typename Vector>
void resize_padded(Vector& v, size_t rows, size_t width) {
    v.resize((rows + kPadRows) * width);
    std::fill(v.begin() + rows * width, v.end(), 0);
}

// Activations ready for a variant's matmul: int8 blocks with scales (integer formats) or fp32 rows
// in the variant's arranged layout (bf16).
struct Prepared {
    AlignedVector<int8_t> q;
    AlignedVector<float> s, f;
    AlignedVector<int32_t> c;     // int4 only
    AlignedVector<int32_t> sums;  // int4_asym only
    AlignedVector<uint8_t> bf16_exact;  // bf16 only: per row, arrange's verdict

    // Rows index[0 .. n) of these `cols`-wide activations as a new contiguous set (padded as prepare pads).
    Prepared gather(ThreadPool& pool, const int32_t* index, int n, int cols) const {
        Prepared out;
        auto take = [&](const auto& from, auto& to, size_t width) {
            if (!from.empty()) resize_padded(to, size_t(n), width);
        };
        const size_t blocks = cols / kBlock;
        take(q, out.q, cols), take(s, out.s, blocks), take(c, out.c, cols / 8), take(sums, out.sums, blocks);
        take(f, out.f, cols), take(bf16_exact, out.bf16_exact, 1);
        constexpr int chunk = 64;
        pool.parallel_for((n + chunk - 1) / chunk, [&](int task) {
            for (int r = task * chunk; r < std::min(n, (task + 1) * chunk); ++r) {
                const size_t from = size_t(index[r]);
                auto copy = [&](const auto& src, auto& dst, size_t width) {
                    if (!src.empty()) std::copy_n(src.data() + from * width, width, dst.data() + size_t(r) * width);
                };
                copy(q, out.q, cols), copy(s, out.s, blocks), copy(c, out.c, cols / 8), copy(sums, out.sums, blocks);
                copy(f, out.f, cols), copy(bf16_exact, out.bf16_exact, 1);
            }
        });
        return out;
    }

    Activations view(const int32_t* index, int cols, size_t first_row) const {
        Activations a;
        a.cols = cols;
        a.index = index;
        if (!q.empty()) {
            a.q = q.data() + first_row * cols;
            a.s = s.data() + first_row * (cols / kBlock);
            if (!c.empty()) a.c = c.data() + first_row * (cols / 8);
            if (!sums.empty()) a.sums = sums.data() + first_row * (cols / kBlock);
        } else {
            a.f = f.data() + first_row * cols;
            a.bf16_exact = bf16_exact.data() + first_row;
        }
        return a;
    }
};

// Builds `rows` rows of `cols` activations (and kPadRows zero rows after them, which a tile kernel
// may read past the last token of a matrix product): produce(r, tmp) writes fp32 row r into tmp, which is
// then quantized or arranged. A few rows (decode) run inline: waking the pool would cost more.
template <typename Produce>
Prepared prepare(ThreadPool& pool, const KernelTable& k, Format f, int rows, int cols, Produce produce) {
    const bool quantized = f != Format::BF16;
    Prepared out;
    auto make = [&](auto& v, size_t width) { resize_padded(v, size_t(rows), width); };  // rows all written below
    if (quantized) {
        make(out.q, cols);
        make(out.s, cols / kBlock);
        if (f == Format::INT4) make(out.c, cols / 8);
        if (f == Format::INT4_ASYM) make(out.sums, cols / kBlock);
    } else {
        make(out.f, cols);
        make(out.bf16_exact, 1);
    }
    constexpr int chunk = 8;
    auto run = [&](int task) {
        thread_local std::vector<float> tmp;
        tmp.resize(cols);
        for (int r = task * chunk; r < std::min(rows, (task + 1) * chunk); ++r) {
            produce(r, tmp.data());
            if (!quantized) out.bf16_exact[r] = k.arrange(tmp.data(), cols, out.f.data() + size_t(r) * cols);
            else k.quantize(tmp.data(), cols, activation_levels(f), out.q.data() + size_t(r) * cols,
                            out.s.data() + size_t(r) * (cols / kBlock));
            if (!out.c.empty()) int4_corrections(out.q.data() + size_t(r) * cols, cols, out.c.data() + size_t(r) * (cols / 8));
            if (!out.sums.empty()) block_sums(out.q.data() + size_t(r) * cols, cols, out.sums.data() + size_t(r) * (cols / kBlock));
        }
    };
    const int tasks = (rows + chunk - 1) / chunk;
    if (tasks == 1) run(0);
    else pool.parallel_for(tasks, run);
    return out;
}

}  // namespace tandem
