// AVX2 + FMA + F16C kernels. Integer formats use the sign trick: |x| (unsigned) times sign(w, x)
// (signed) through maddubs, which cannot saturate because |x|, |w| <= 127.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "tandem/kernels.h"

namespace tandem {
namespace {

constexpr int kRows = 4;  // weight rows computed together, sharing each activation load

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

void quantize(const float* x, int cols, int8_t* q, float* s) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < cols / kBlock; ++b) {
        const float* xb = x + b * kBlock;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], abs_mask));
        }
        float amax = hmax(m);
        s[b] = amax / 127.f;
        __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i i[4];
        for (int k = 0; k < 4; ++k)
            i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
    }
}

// bf16 rows are read 16 values (32 bytes) at a time: a shift gives the even columns as fp32 and a
// mask the odd ones, so `arrange` stores each 16-column chunk of x as its 8 even then 8 odd values.
constexpr int kChunk = 16;

void arrange(const float* x, int cols, float* out) {
    int c = 0;
    for (; c + kChunk <= cols; c += kChunk)
        for (int j = 0; j < kChunk / 2; ++j) {
            out[c + j] = x[c + 2 * j];
            out[c + kChunk / 2 + j] = x[c + 2 * j + 1];
        }
    for (; c < cols; ++c) out[c] = x[c];
}

template <int R>
void bf16_rows(const uint16_t* w, int cols, const float* x, float* out) {
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    __m256 acc[R];
    for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
    int c = 0;
    for (; c + kChunk <= cols; c += kChunk) {
        const __m256 even = _mm256_loadu_ps(x + c), odd = _mm256_loadu_ps(x + c + kChunk / 2);
        for (int k = 0; k < R; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + int64_t(k) * cols + c));
            acc[k] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even, acc[k]);
            acc[k] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), odd, acc[k]);
        }
    }
    for (int k = 0; k < R; ++k) {
        float sum = hsum(acc[k]);
        for (int j = c; j < cols; ++j) sum += bf16_to_float(w[int64_t(k) * cols + j]) * x[j];
        out[k] = sum;
    }
}

void matmul_bf16(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    const uint16_t* values = reinterpret_cast<const uint16_t*>(w.data);
    float out[kRows];
    for (int r = r0; r < r1; r += kRows) {
        const int rows = std::min(kRows, r1 - r);
        for (int i = 0; i < n; ++i) {
            const float* xi = x.f + x.row(i) * x.cols;
            const uint16_t* wr = values + int64_t(r) * w.cols;
            if (rows == kRows) bf16_rows<kRows>(wr, w.cols, xi, out);
            else for (int k = 0; k < rows; ++k) bf16_rows<1>(wr + int64_t(k) * w.cols, w.cols, xi, out + k);
            for (int k = 0; k < rows; ++k) y[int64_t(i) * ldy + (r - r0) + k] = out[k];
        }
    }
}

struct Int8Block {
    static __m256i load(const uint8_t* row, int b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
    }
    static int64_t row_bytes(int cols) { return cols; }
    static const uint8_t* at(const uint8_t* row, int b) { return row + b * kBlock; }
};

struct Int4Block {
    static __m256i load(const uint8_t* row, int b) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kInt4Levels)));
        const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        return _mm256_shuffle_epi8(levels, idx);
    }
    static int64_t row_bytes(int cols) { return cols / 2; }
    static const uint8_t* at(const uint8_t* row, int b) { return row + b * (kBlock / 2); }
};

constexpr int kSpan = 64;
constexpr int kPrefetch = 1024;  // bytes ahead on each weight row: keeps enough loads in flight  // blocks whose combined scales are prepared at once (2048 columns)

// scale[k][j] = x scale of block b0 + j times the weight scale of its group in row r + k.
template <int R>
void combined_scales(const Matrix& w, int r, int b0, int nb, const float* xs, float (*scale)[kSpan]) {
    const int per_group = w.group / kBlock, groups = w.cols / w.group;
    for (int k = 0; k < R; ++k) {
        const uint16_t* ws = w.scales + int64_t(r + k) * groups;
        int j = 0;
        if (per_group == 1)
            for (; j + 8 <= nb; j += 8) {
                const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + b0 + j)));
                _mm256_storeu_ps(scale[k] + j, _mm256_mul_ps(wv, _mm256_loadu_ps(xs + b0 + j)));
            }
        for (; j < nb; ++j) scale[k][j] = xs[b0 + j] * _cvtsh_ss(ws[(b0 + j) / per_group]);
    }
}

template <typename Block, int R>
void int_rows(const Matrix& w, int r, const int8_t* xq, const float* xs, float* out) {
    const int blocks = w.cols / kBlock;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* row[R];
    for (int k = 0; k < R; ++k) row[k] = w.data + int64_t(r + k) * Block::row_bytes(w.cols);
    __m256 acc[R];
    for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
    alignas(32) float scale[R][kSpan];
    for (int b0 = 0; b0 < blocks; b0 += kSpan) {
        const int nb = std::min(kSpan, blocks - b0);
        combined_scales<R>(w, r, b0, nb, xs, scale);
        for (int j = 0; j < nb; ++j) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b0 + j) * kBlock));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            for (int k = 0; k < R; ++k) {
                _mm_prefetch(reinterpret_cast<const char*>(Block::at(row[k], b0 + j)) + kPrefetch, _MM_HINT_T0);
                const __m256i sw = _mm256_sign_epi8(Block::load(row[k], b0 + j), xv);
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), ones);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[k][j]), acc[k]);
            }
        }
    }
    for (int k = 0; k < R; ++k) out[k] = hsum(acc[k]);
}

template <typename Block>
void matmul_int(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    const int blocks = x.cols / kBlock;
    float out[kRows];
    for (int r = r0; r < r1; r += kRows) {
        const int rows = std::min(kRows, r1 - r);
        for (int i = 0; i < n; ++i) {
            const int8_t* xq = x.q + x.row(i) * x.cols;
            const float* xs = x.s + x.row(i) * blocks;
            if (rows == kRows) int_rows<Block, kRows>(w, r, xq, xs, out);
            else for (int k = 0; k < rows; ++k) int_rows<Block, 1>(w, r + k, xq, xs, out + k);
            for (int k = 0; k < rows; ++k) y[int64_t(i) * ldy + (r - r0) + k] = out[k];
        }
    }
}

}  // namespace

const KernelTable& avx2_kernels() {
    static const KernelTable table{
        "avx2", {matmul_bf16, matmul_int<Int8Block>, matmul_int<Int4Block>}, quantize, arrange};
    return table;
}

}  // namespace tandem
