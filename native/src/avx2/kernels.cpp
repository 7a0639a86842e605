// AVX2 + FMA + F16C kernels. Integer formats use the sign trick: |x| (unsigned) times sign(w, x)
// (signed) through maddubs, which cannot saturate because |x|, |w| <= 127.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "tandem/kernels.h"

namespace tandem {
namespace {

constexpr int kPrefetch = 2048;  // bytes ahead in the weight stream

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

// One 4-row tile of bf16 weights against one token: y[k] = dot(row r + k, x).
void bf16_tile(const uint16_t* tile, int cols, const float* x, float* y) {
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    __m256 even_acc[kTileRows], odd_acc[kTileRows];
    for (int k = 0; k < kTileRows; ++k) even_acc[k] = odd_acc[k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += kChunk, tile += kTileRows * kChunk) {
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + 64, _MM_HINT_T0);
        const __m256 even = _mm256_loadu_ps(x + c), odd = _mm256_loadu_ps(x + c + kChunk / 2);
        for (int k = 0; k < kTileRows; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * kChunk));
            even_acc[k] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even, even_acc[k]);
            odd_acc[k] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), odd, odd_acc[k]);
        }
    }
    for (int k = 0; k < kTileRows; ++k) y[k] = hsum(_mm256_add_ps(even_acc[k], odd_acc[k]));
}

void matmul_bf16(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    float out[kTileRows];
    for (int r = r0; r < r1; r += kTileRows) {
        const uint16_t* tile = reinterpret_cast<const uint16_t*>(block_at(w, r, 0));
        for (int i = 0; i < n; ++i) {
            bf16_tile(tile, w.cols, x.f + x.row(i) * x.cols, out);
            for (int k = 0; k < kTileRows; ++k) y[int64_t(i) * ldy + (r - r0) + k] = out[k];
        }
    }
}

struct Int8Block {
    static constexpr int kBytes = kBlock;
    static __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
};

struct Int4Block {
    static constexpr int kBytes = kBlock / 2;
    static __m256i load(const uint8_t* p) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kInt4Levels)));
        const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        return _mm256_shuffle_epi8(levels, idx);
    }
};

constexpr int kSpan = 64;  // blocks whose combined scales are prepared at once (2048 columns)

// scale[k][j] = x scale of block b0 + j times the weight scale of its group in row r + k.
void combined_scales(const Matrix& w, int r, int b0, int nb, const float* xs, float (*scale)[kSpan]) {
    const int per_group = w.group / kBlock, groups = w.cols / w.group;
    for (int k = 0; k < kTileRows; ++k) {
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

// One 4-row tile of int8/int4 weights against one quantized token: y[k] = dot(row r + k, x).
template <typename Block>
void int_tile(const Matrix& w, int r, const int8_t* xq, const float* xs, float* y) {
    const int blocks = w.cols / kBlock;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* tile = block_at(w, r, 0);
    __m256 acc[kTileRows];
    for (int k = 0; k < kTileRows; ++k) acc[k] = _mm256_setzero_ps();
    alignas(32) float scale[kTileRows][kSpan];
    for (int b0 = 0; b0 < blocks; b0 += kSpan) {
        const int nb = std::min(kSpan, blocks - b0);
        combined_scales(w, r, b0, nb, xs, scale);
        for (int j = 0; j < nb; ++j, tile += kTileRows * Block::kBytes) {
            for (int line = 0; line < kTileRows * Block::kBytes; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + line, _MM_HINT_T0);
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b0 + j) * kBlock));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            for (int k = 0; k < kTileRows; ++k) {
                const __m256i sw = _mm256_sign_epi8(Block::load(tile + k * Block::kBytes), xv);
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), ones);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[k][j]), acc[k]);
            }
        }
    }
    for (int k = 0; k < kTileRows; ++k) y[k] = hsum(acc[k]);
}

template <typename Block>
void matmul_int(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    const int blocks = x.cols / kBlock;
    float out[kTileRows];
    for (int r = r0; r < r1; r += kTileRows)
        for (int i = 0; i < n; ++i) {
            int_tile<Block>(w, r, x.q + x.row(i) * x.cols, x.s + x.row(i) * blocks, out);
            for (int k = 0; k < kTileRows; ++k) y[int64_t(i) * ldy + (r - r0) + k] = out[k];
        }
}

}  // namespace

const KernelTable& avx2_kernels() {
    static const KernelTable table{
        "avx2", {matmul_bf16, matmul_int<Int8Block>, matmul_int<Int4Block>}, quantize, arrange};
    return table;
}

}  // namespace tandem
