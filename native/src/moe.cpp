#include "moe.h"

#include "activations.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem {

namespace {

constexpr int kFewTokens = 16;  // up to this many tokens a call is treated as decode

std::string dims(const Header& h) {
    return std::to_string(h.num_experts) + " experts, hidden " + std::to_string(h.hidden) + ", intermediate " +
           std::to_string(h.intermediate) + ", group " + std::to_string(h.group_size);
}

void check_scales(const MoeLayerView& v) {
    if (v.format == Format::BF16) return;
    for (int e = 0; e < v.experts; ++e)
        for (const Matrix& m : {v.w13(e), v.w2(e)}) {
            const size_t n = size_t(m.rows) * (m.cols / m.group);
            for (size_t i = 0; i < n; ++i)
                if (!std::isfinite(fp16_to_float(m.scales[i])) || (m.mins && !std::isfinite(fp16_to_float(m.mins[i]))))
                    throw std::invalid_argument("buffer: non-finite scale in expert " + std::to_string(e));
        }
}

bool increasing(const int8_t* levels) {
    for (int q = 0; q < 15; ++q)
        if (levels[q] >= levels[q + 1]) return false;
    return true;
}

}  // namespace

MoeLayerView MoeLayerView::parse(const uint8_t* data, size_t size, bool scales) {
    if (size < sizeof(Header)) throw std::invalid_argument("buffer: too small for a layer header");
    Header h;
    std::memcpy(&h, data, sizeof h);
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) throw std::invalid_argument("buffer: not a packed MoE layer");
    if (h.version != kLayoutVersion)
        throw std::invalid_argument("buffer: layout version " + std::to_string(h.version) + ", expected " +
                                    std::to_string(kLayoutVersion));
    if (h.format >= uint32_t(kFormats)) throw std::invalid_argument("buffer: unknown format");
    const bool quantized = h.format != uint32_t(Format::BF16);
    if (!h.num_experts || !h.hidden || !h.intermediate || h.num_experts > (1u << 20) || h.hidden > (1u << 20) ||
        h.intermediate > (1u << 20) || h.hidden % block_cols(Format(h.format)) ||
        h.intermediate % block_cols(Format(h.format)) ||
        (quantized && (!h.group_size || h.group_size % kBlock || h.hidden % h.group_size ||
                       h.intermediate % h.group_size)))
        throw std::invalid_argument("buffer: inconsistent header (" + dims(h) + ")");
    if (h.format == uint32_t(Format::INT4) && !increasing(h.levels))
        throw std::invalid_argument("buffer: the int4 levels are not strictly increasing");
    if (h.activation > uint32_t(Activation::SWIGLU_OAI) || h.biased > 1 || !std::isfinite(h.alpha) ||
        !std::isfinite(h.limit) || h.limit < 0.f)
        throw std::invalid_argument("buffer: unknown activation or bias flag in the header");
    MoeLayerView v;
    v.base = data;
    v.format = Format(h.format);
    v.levels = v.format == Format::INT4 ? reinterpret_cast<const int8_t*>(data + offsetof(Header, levels)) : nullptr;
    v.experts = int(h.num_experts);
    v.hidden = int(h.hidden);
    v.intermediate = int(h.intermediate);
    v.group = quantized ? int(h.group_size) : 0;
    v.activation = Activation(h.activation);
    v.alpha = h.alpha;
    v.limit = h.limit;
    const size_t need = layer_bytes(v.format, v.experts, v.hidden, v.intermediate, v.group, h.biased);
    if (h.biased) v.biases = reinterpret_cast<const float*>(data + need - bias_bytes(v.experts, v.hidden, v.intermediate));
    if (h.total_bytes != need || size < need)
        throw std::invalid_argument("buffer: " + std::to_string(size) + " bytes, the header (" + dims(h) + ") needs " +
                                    std::to_string(need));
    if (scales) check_scales(v);
    return v;
}

Matrix MoeLayerView::w13(int e) const {
    const uint8_t* p = base + sizeof(Header) + size_t(e) * expert_bytes(format, hidden, intermediate, group);
    return matrix_at(p, format, 2 * intermediate, hidden, group, levels);
}

Matrix MoeLayerView::w2(int e) const {
    const uint8_t* p = base + sizeof(Header) + size_t(e) * expert_bytes(format, hidden, intermediate, group) +
                       matrix_bytes(format, 2 * intermediate, hidden, group);
    return matrix_at(p, format, hidden, intermediate, group, levels);
}

// ---------------------------------------------------------------- packing

namespace {

// Quantization of one group of n weights with one scale: int8 rounds w / scale to [-127, 127];
// int4 picks the nearest of the layer's levels (stored as its index).
struct GroupQuantizer {
    static constexpr int kHalfRange = 512;  // the int4 code table spans v in [-256, 256)
    Format format;
    const int8_t* levels;  // int4
    float top = 127.f;     // the largest |level| (at most 127)
    std::array<uint8_t, 2 * kHalfRange> table{};

    GroupQuantizer(Format f, const int8_t* lv) : format(f), levels(lv) {
        if (f != Format::INT4) return;
        top = float(std::min(127, std::max(std::abs(int(lv[0])), std::abs(int(lv[15])))));
        // Integer levels have midpoints at multiples of 1/2, so the nearest level is constant on each
        // [k/2, (k+1)/2): a table indexed by floor(2v) gives it exactly.
        for (int k = 0; k < 2 * kHalfRange; ++k) {
            int q = 0;
            while (q < 15 && 0.5f * (lv[q] + lv[q + 1]) <= 0.5f * (k - kHalfRange)) ++q;
            table[k] = uint8_t(q);
        }
    }

    int code(float v) const {  // v = w / scale
        if (format == Format::INT8) return int(std::max(-127.f, std::min(127.f, std::nearbyint(v))));
        const int k = int(std::floor(2.f * std::max(-256.f, std::min(255.f, v)))) + kHalfRange;
        return table[k];
    }
    float level(int q) const { return format == Format::INT8 ? float(q) : float(levels[q]); }

    float error(const float* w, int n, float scale) const {
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        float err = 0.f;
        for (int j = 0; j < n; ++j) {
            const float d = w[j] - scale * level(code(w[j] * inv));
            err += d * d;
        }
        return err;
    }

    // The least-squares scale for the codes chosen with `scale`.
    float refit(const float* w, int n, float scale) const {
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        float wl = 0.f, ll = 0.f;
        for (int j = 0; j < n; ++j) {
            const float l = level(code(w[j] * inv));
            wl += w[j] * l;
            ll += l * l;
        }
        return ll > 0.f ? wl / ll : 0.f;
    }

    // The group's fp16 scale: amax / 127 for int8; for int4 the best of a few candidates and their
    // least-squares refits, since at 16 levels the choice matters. (A refit for int8 lowers the
    // squared error but clamps each group's largest weight: the default model's perplexity rose.)
    uint16_t scale(const float* w, int n, float amax) const {
        uint16_t best = float_to_fp16(amax / top);
        if (format == Format::INT8) return best;
        float best_err = error(w, n, fp16_to_float(best));
        const uint16_t narrow = float_to_fp16(amax / (top * 110.f / 127.f));
        const float narrow_err = error(w, n, fp16_to_float(narrow));
        if (narrow_err < best_err) best = narrow, best_err = narrow_err;
        const uint16_t refit_scale = float_to_fp16(refit(w, n, fp16_to_float(best)));
        return error(w, n, fp16_to_float(refit_scale)) < best_err ? refit_scale : best;
    }
};

// Stores code q of column c of row r (int8: the value; int4: its nibble, format.h).
void put_code(const Matrix& m, int r, int c, int q) {
    uint8_t& byte = *const_cast<uint8_t*>(int_byte_at(m, r, c));
    if (m.format == Format::INT8) byte = uint8_t(int8_t(q));
    else byte = c % 8 < 4 ? uint8_t((byte & 0xf0) | q) : uint8_t((byte & 0x0f) | (q << 4));
}

// int4_asym: group g of row r as 16 evenly spaced steps from its minimum to its maximum (the fp16
// values as stored decide the codes); false on a non-finite value.
bool pack_group_asym(const float* wg, const Matrix& m, int r, int g) {
    float lo = wg[0], hi = wg[0];
    for (int j = 0; j < m.group; ++j) {
        if (!std::isfinite(wg[j])) return false;
        lo = std::min(lo, wg[j]);
        hi = std::max(hi, wg[j]);
    }
    uint16_t& scale = *const_cast<uint16_t*>(int_scale_at(m, r, g));
    uint16_t& min = *const_cast<uint16_t*>(int_min_at(m, r, g));
    scale = float_to_fp16((hi - lo) / 15.f);
    min = float_to_fp16(lo);
    const float s = fp16_to_float(scale), base = fp16_to_float(min), inv = s > 0.f ? 1.f / s : 0.f;
    if (!std::isfinite(s) || !std::isfinite(base)) return false;
    for (int j = 0; j < m.group; ++j)
        put_code(m, r, g * m.group + j, int(std::max(0.f, std::min(15.f, std::nearbyint((wg[j] - base) * inv)))));
    return true;
}

// Quantizes row r of matrix m from its C float values; returns false on a non-finite value or scale.
bool pack_row(const GroupQuantizer& quant, const float* w, const Matrix& m, int r) {
    const Format f = m.format;
    const int cols = m.cols, group = m.group;
    if (f == Format::BF16) {
        const int width = block_cols(f);
        bool ok = true;
        for (int c = 0; c < cols; ++c) {
            ok &= std::isfinite(w[c]);
            reinterpret_cast<uint16_t*>(const_cast<uint8_t*>(block_at(m, r, c / width)))[c % width] = float_to_bf16(w[c]);
        }
        return ok;
    }
    for (int g = 0; g < cols / group; ++g) {
        const float* wg = w + g * group;
        if (f == Format::INT4_ASYM) {
            if (!pack_group_asym(wg, m, r, g)) return false;
            continue;
        }
        float amax = 0.f;
        for (int j = 0; j < group; ++j) {
            if (!std::isfinite(wg[j])) return false;
            amax = std::max(amax, std::fabs(wg[j]));
        }
        uint16_t& stored = *const_cast<uint16_t*>(int_scale_at(m, r, g));
        stored = quant.scale(wg, group, amax);
        const float scale = fp16_to_float(stored);
        if (!std::isfinite(scale)) return false;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int j = 0; j < group; ++j) put_code(m, r, g * group + j, quant.code(wg[j] * inv));
    }
    return true;
}

}  // namespace

void init_layer(Format f, int experts, int hidden, int intermediate, int group, const int8_t* levels,
                const ExpertShape& shape, uint8_t* dst) {
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kLayoutVersion;
    h.format = uint32_t(f);
    h.group_size = f == Format::BF16 ? 0 : uint32_t(group);
    h.num_experts = uint32_t(experts);
    h.hidden = uint32_t(hidden);
    h.intermediate = uint32_t(intermediate);
    h.total_bytes = layer_bytes(f, experts, hidden, intermediate, f == Format::BF16 ? 0 : group, shape.biased);
    if (f == Format::INT4) std::memcpy(h.levels, levels ? levels : kInt4Levels, sizeof h.levels);
    h.activation = uint32_t(shape.activation);
    h.biased = shape.biased ? 1 : 0;
    h.alpha = shape.alpha;
    h.limit = shape.limit;
    std::memset(dst, 0, h.total_bytes);
    std::memcpy(dst, &h, sizeof h);
}

void pack_experts(ThreadPool& pool, const MoeLayerView& v, int e0, int e1, const float* w13, const float* w2) {
    const int D = v.hidden, I = v.intermediate;
    const GroupQuantizer quant(v.format, v.levels);
    std::atomic<int> bad{-1};
    const int per_expert = 2 * I + D;  // w13 rows, then w2 rows
    constexpr int kPackRows = 32;
    const int blocks = (per_expert + kPackRows - 1) / kPackRows;
    pool.run([&] {
        pool.parallel_for((e1 - e0) * blocks, [&](int task) {
            const int e = task / blocks, r0 = (task % blocks) * kPackRows;
            for (int r = r0; r < std::min(per_expert, r0 + kPackRows); ++r) {
                const bool first = r < 2 * I;
                const Matrix m = first ? v.w13(e0 + e) : v.w2(e0 + e);
                const int row = first ? r : r - 2 * I;
                const float* src = first ? w13 + (size_t(e) * 2 * I + row) * D : w2 + (size_t(e) * D + row) * I;
                if (!pack_row(quant, src, m, row)) bad = first ? 0 : 1;
            }
        });
    });
    if (bad >= 0)
        throw std::invalid_argument(std::string(bad == 0 ? "w13" : "w2") +
                                    ": non-finite value, or a scale beyond fp16's range");
}

void put_matrix_codes(const Matrix& m, int row0, int rows, int cols, const uint8_t* codes, const uint16_t* scales,
                      const uint16_t* mins) {
    const int groups = cols / m.group;
    for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < cols; ++c) put_code(m, row0 + r, c, codes[size_t(r) * cols + c]);
        for (int g = 0; g < groups; ++g) {
            *const_cast<uint16_t*>(int_scale_at(m, row0 + r, g)) = scales[size_t(r) * groups + g];
            if (m.mins) *const_cast<uint16_t*>(int_min_at(m, row0 + r, g)) = mins[size_t(r) * groups + g];
        }
    }
}

void put_codes(const MoeLayerView& v, int e, bool w2, int row0, int rows, const uint8_t* codes, const uint16_t* scales,
               const uint16_t* mins) {
    const Matrix m = w2 ? v.w2(e) : v.w13(e);
    put_matrix_codes(m, row0, rows, m.cols, codes, scales, mins);
}

bool pack_rows(const Matrix& m, int r0, int r1, const float* w) {
    const GroupQuantizer quant(m.format, m.levels);
    bool ok = true;
    for (int r = r0; r < r1; ++r) ok &= pack_row(quant, w + size_t(r - r0) * m.cols, m, r);
    return ok;
}

void put_biases(const MoeLayerView& v, int e, const float* b13, const float* b2) {
    std::copy(b13, b13 + 2 * v.intermediate, const_cast<float*>(v.b13(e)));
    std::copy(b2, b2 + v.hidden, const_cast<float*>(v.b2(e)));
}

void dequantize(const Matrix& m, float* out) {
    for (int r = 0; r < m.rows; ++r, out += m.cols)
        for (int c = 0; c < m.cols; ++c) {
            if (m.format == Format::BF16) {
                const int width = block_cols(m.format);
                out[c] = bf16_to_float(reinterpret_cast<const uint16_t*>(block_at(m, r, c / width))[c % width]);
                continue;
            }
            const uint8_t byte = *int_byte_at(m, r, c);
            const int code = c % 8 < 4 ? byte & 0x0f : byte >> 4;
            const float scale = fp16_to_float(*int_scale_at(m, r, c / m.group));
            if (m.format == Format::INT4_ASYM) out[c] = scale * float(code) + fp16_to_float(*int_min_at(m, r, c / m.group));
            else out[c] = scale * (m.format == Format::INT8 ? float(int8_t(byte)) : float(m.levels[code]));
        }
}

void pack_layer(ThreadPool& pool, const float* w13, const float* w2, Format f, int experts, int hidden,
                int intermediate, int group, uint8_t* dst) {
    init_layer(f, experts, hidden, intermediate, group, nullptr, ExpertShape{}, dst);
    const MoeLayerView v = MoeLayerView::parse(dst, layer_bytes(f, experts, hidden, intermediate, f == Format::BF16 ? 0 : group), false);
    pack_experts(pool, v, 0, experts, w13, w2);
}

void block_sums(const int8_t* q, int cols, int32_t* out) {
    for (int b = 0; b < cols / kBlock; ++b, q += kBlock) {
        int32_t sum = 0;
        for (int j = 0; j < kBlock; ++j) sum += q[j];
        out[b] = sum;
    }
}

void int4_corrections(const int8_t* q, int cols, int32_t* out) {
    for (int c = 0; c < cols; c += 8, q += 8) {
        const int lo = 128 * (q[0] + q[1] + q[4] + q[5]), hi = 128 * (q[2] + q[3] + q[6] + q[7]);
        *out++ = int32_t(uint32_t(uint16_t(lo)) | (uint32_t(uint16_t(hi)) << 16));
    }
}

// ---------------------------------------------------------------- forward

namespace {

struct Plan {  // tokens grouped by expert; a = index of an active expert
    std::vector<int> experts;       // [A] expert id
    std::vector<int> start;         // [A + 1] offsets into tokens / weights
    std::vector<int32_t> tokens;    // [T * K] token index, grouped by expert
    std::vector<float> weights;     // [T * K]
};

Plan plan(const MoeCall& c, int num_experts) {
    std::vector<int> count(num_experts, 0);
    const int n = c.tokens * c.top_k;
    for (int i = 0; i < n; ++i) ++count[c.ids[i]];
    Plan p;
    std::vector<int> slot(num_experts, -1);
    p.start.push_back(0);
    for (int e = 0; e < num_experts; ++e)
        if (count[e]) {
            slot[e] = int(p.experts.size());
            p.experts.push_back(e);
            p.start.push_back(p.start.back() + count[e]);
        }
    p.tokens.resize(n);
    p.weights.resize(n);
    std::vector<int> fill(p.start.begin(), p.start.end() - 1);
    for (int i = 0; i < n; ++i) {
        const int a = slot[c.ids[i]];
        p.tokens[fill[a]] = i / c.top_k;
        p.weights[fill[a]++] = c.weights[i];
    }
    return p;
}

// Decode: one task per (active expert, block of w2 rows), so each task streams one long run of
// weights; then out[t] = sum of w * y over token t's experts, column block by column block, which
// keeps the sum race-free and in a fixed order whatever the thread count.
void down_by_experts(ThreadPool& pool, const KernelTable& k, const MoeCall& c, const Plan& p, const Prepared& h) {
    const MoeLayerView& L = *c.layer;
    const int D = L.hidden, I = L.intermediate, A = int(p.experts.size()), rows = p.start[A];
    AlignedVector<float> y(size_t(rows) * D);  // [rows, D], every row written below
    const int down_rows = rows_per_task(D, A, pool.size()), blocks = (D + down_rows - 1) / down_rows;
    pool.parallel_for(A * blocks, [&](int task) {
        const int a = task / blocks, r0 = (task % blocks) * down_rows, r1 = std::min(D, r0 + down_rows);
        k.matmul[int(L.format)](L.w2(p.experts[a]), r0, r1, h.view(nullptr, I, p.start[a]), p.start[a + 1] - p.start[a],
                                y.data() + size_t(p.start[a]) * D + r0, D);
    });
    for (int a = 0; a < A; ++a) {
        const float* b2 = L.b2(p.experts[a]);
        for (int e = p.start[a]; e < p.start[a + 1]; ++e) {
            float* o = c.out + size_t(p.tokens[e]) * D;
            const float* ye = y.data() + size_t(e) * D;
            if (b2) for (int j = 0; j < D; ++j) o[j] += p.weights[e] * (ye[j] + b2[j]);
            else for (int j = 0; j < D; ++j) o[j] += p.weights[e] * ye[j];
        }
    }
}

void prefetch_range(const void* begin, const void* end) {
    for (auto* q = static_cast<const uint8_t*>(begin); q < static_cast<const uint8_t*>(end); q += 64) __builtin_prefetch(q, 0, 2);
}

// Asks for rows [r0, r1) of m (a whole number of tiles: values, then scales) to be brought into the
// cache ahead of use: a prefill task reads one short block of each expert's rows in turn, which the
// hardware prefetchers do not foresee (about 8% of the down projections' time).
void prefetch_rows(const Matrix& m, int r0, int r1) {
    if (m.format == Format::BF16) return prefetch_range(block_at(m, r0, 0), block_at(m, r1, 0));
    prefetch_range(int_block_at(m, r0, 0), int_block_at(m, r1, 0));
    prefetch_range(int_scale_at(m, r0, 0), int_scale_at(m, r1, 0));
}

// Prefill: a task owns a block of output columns for every token and runs every expert's rows of
// that block, accumulating in a fixed order; no [rows, D] intermediate is written.
void down_by_columns(ThreadPool& pool, const KernelTable& k, const MoeCall& c, const Plan& p, const Prepared& h) {
    const MoeLayerView& L = *c.layer;
    const int D = L.hidden, I = L.intermediate, A = int(p.experts.size());
    const int columns = rows_per_task(D, 1, pool.size());  // of w2, one block of output columns each
    pool.parallel_for((D + columns - 1) / columns, [&](int task) {
        const int r0 = task * columns, r1 = std::min(D, r0 + columns), width = r1 - r0;
        thread_local std::vector<float> y;
        for (int a = 0; a < A; ++a) {
            if (a + 1 < A) prefetch_rows(L.w2(p.experts[a + 1]), r0, r1);
            const int n = p.start[a + 1] - p.start[a];
            y.resize(size_t(n) * width);
            k.matmul[int(L.format)](L.w2(p.experts[a]), r0, r1, h.view(nullptr, I, p.start[a]), n, y.data(), width);
            const float* b2 = L.b2(p.experts[a]);
            for (int i = 0; i < n; ++i) {
                float* o = c.out + size_t(p.tokens[p.start[a] + i]) * D + r0;
                const float w = p.weights[p.start[a] + i];
                const float* yi = y.data() + size_t(i) * width;
                if (b2) for (int j = 0; j < width; ++j) o[j] += w * (yi[j] + b2[r0 + j]);
                else for (int j = 0; j < width; ++j) o[j] += w * yi[j];
            }
        }
    });
}

}  // namespace

void moe_forward(ThreadPool& pool, const KernelTable& k, const MoeCall& c) {
    const MoeLayerView& L = *c.layer;
    const int D = L.hidden, I = L.intermediate, F = int(L.format);
    std::fill(c.out, c.out + size_t(c.tokens) * D, 0.f);
    if (c.tokens == 0) return;
    const Plan p = plan(c, L.experts);
    const int A = int(p.experts.size()), rows = p.start[A];
    const Prepared x = prepare(pool, k, L.format, c.tokens, D, [&](int r, float* row) {
        std::copy(c.x + size_t(r) * D, c.x + size_t(r + 1) * D, row);
    });

    // Prefill: each expert's tokens as contiguous rows, which the tile kernels load as they lie.
    const bool prefill = c.tokens > kFewTokens;
    const Prepared grouped = prefill ? x.gather(pool, p.tokens.data(), rows, D) : Prepared{};
    auto tokens_of = [&](int a) {
        return prefill ? grouped.view(nullptr, D, p.start[a]) : x.view(p.tokens.data() + p.start[a], D, 0);
    };

    // Phase 1: gate and up projections, [rows, 2I], one task per (active expert, block of w13 rows).
    AlignedVector<float> hu(size_t(rows) * 2 * I);  // every row written below
    const int up_rows = rows_per_task(2 * I, A, pool.size()), up_blocks = (2 * I + up_rows - 1) / up_rows;
    pool.parallel_for(A * up_blocks, [&](int task) {
        const int a = task / up_blocks, r0 = (task % up_blocks) * up_rows, r1 = std::min(2 * I, r0 + up_rows);
        const int n = p.start[a + 1] - p.start[a];
        k.matmul[F](L.w13(p.experts[a]), r0, r1, tokens_of(a), n,
                    hu.data() + size_t(p.start[a]) * 2 * I + r0, 2 * I);
    });

    // Phase 2: h = act(gate, up) ([rows, I], the gate/up biases added first), ready for the down projections.
    const Prepared h = prepare(pool, k, L.format, rows, I, [&](int r, float* row) {
        float* gate_up = hu.data() + size_t(r) * 2 * I;
        if (L.biases) {
            const int a = int(std::upper_bound(p.start.begin(), p.start.end(), r) - p.start.begin()) - 1;
            const float* b13 = L.b13(p.experts[a]);
            for (int j = 0; j < 2 * I; ++j) gate_up[j] += b13[j];
        }
        if (L.activation == Activation::SILU) k.silu_mul(gate_up, I, row);
        else k.swiglu_oai(gate_up, I, L.alpha, L.limit, row);
    });

    // Phase 3: down projections and the weighted sum over each token's experts.
    if (prefill) down_by_columns(pool, k, c, p, h);
    else down_by_experts(pool, k, c, p, h);
}

}  // namespace tandem
