// The SIMD kernels of the AVX2 and AVX-512 variants, at 256-bit width. Each variant's source
// includes this header and is compiled with its own flags, which select what the code uses:
//   AVX2 + FMA + F16C     the base (VEX, 16 registers, 2 tokens per weight load in prefill);
//   AVX-512 F/BW/VL/DQ    EVEX with 32 registers: 4 tokens per weight load;
//   + AVX512_VNNI         vpdpbusd for the int8 dot products;
//   + AVX512_BF16         vdpbf16ps for bf16 weights, against activations split into two bf16 parts.
// Everything lives in an anonymous namespace: each variant's object has its own copy.
// int8 uses the sign trick: |x| (unsigned) times sign(w, x) (signed) through maddubs (which cannot
// saturate because |x|, |w| <= 127) or vpdpbusd (which does not saturate). int4 looks its levels up
// offset by 128 (unsigned) against 7-bit x and subtracts 128 sum(x) (int4_dot). Every path gives
// exact int32 sums of the products, so the variants agree bit for bit before the float scaling.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "tandem/kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TANDEM_SIMD_VNNI 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TANDEM_SIMD_BF16 1
#endif

namespace tandem {
namespace {

constexpr int kPrefetch = 2048;  // bytes ahead in the weight stream
#if defined(__AVX512F__)
constexpr int kTokensPerLoad = 4;  // 16 accumulators fit the 32 registers
#else
constexpr int kTokensPerLoad = 2;
#endif

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

// acc + in each int32 lane the sum of its 4 products of unsigned a and signed b bytes.
inline __m256i dot_u8s8(__m256i acc, __m256i a, __m256i b) {
#if defined(TANDEM_SIMD_VNNI)
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

void quantize(const float* x, int cols, int levels, int8_t* q, float* s) {
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
        s[b] = amax / float(levels);
        __m256 inv = _mm256_set1_ps(amax > 0.f ? float(levels) / amax : 0.f);
        __m256i i[4];
        for (int k = 0; k < 4; ++k)
            i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
    }
}

// bf16 rows are read 16 values (32 bytes) at a time; `arrange` stores each 16-column chunk of x as
// the 16 floats' worth of bytes that chunk's products need.
constexpr int kChunk = 16;

#if defined(TANDEM_SIMD_BF16)
// vdpbf16ps multiplies bf16 pairs, so x is split into hi = bf16(x) and lo = bf16(x - hi), which
// carry 16 of its 24 significant bits (relative error <= 2^-17, far below the weights' 2^-9): a
// chunk holds its 16 hi values, then its 16 lo values, in column order (64 bytes, as 16 floats).
// cols is a multiple of 16 (a bf16 weight block).
void arrange(const float* x, int cols, float* out) {
    for (int c = 0; c < cols; c += kChunk) {
        const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + kChunk / 2);
        const __m256bh hi = _mm256_cvtne2ps_pbh(b, a);  // columns 0-7 from a, 8-15 from b
        const __m256i hi_bits = (__m256i)hi;
        const __m256 a_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(hi_bits)), 16));
        const __m256 b_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(hi_bits, 1)), 16));
        const __m256bh lo = _mm256_cvtne2ps_pbh(_mm256_sub_ps(b, b_hi), _mm256_sub_ps(a, a_hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), hi_bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + kChunk / 2), (__m256i)lo);
    }
}

// One 4-row tile of bf16 weights against one token: y[k] = dot(row r + k, x).
void bf16_tile(const uint16_t* tile, int cols, const float* x, float* y) {
    __m256 hi_acc[kTileRows], lo_acc[kTileRows];
    for (int k = 0; k < kTileRows; ++k) hi_acc[k] = lo_acc[k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += kChunk, tile += kTileRows * kChunk) {
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + 64, _MM_HINT_T0);
        const __m256bh hi = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c));
        const __m256bh lo = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c + kChunk / 2));
        for (int k = 0; k < kTileRows; ++k) {
            const __m256bh v = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * kChunk));
            hi_acc[k] = _mm256_dpbf16_ps(hi_acc[k], v, hi);
            lo_acc[k] = _mm256_dpbf16_ps(lo_acc[k], v, lo);
        }
    }
    for (int k = 0; k < kTileRows; ++k) y[k] = hsum(_mm256_add_ps(hi_acc[k], lo_acc[k]));
}
#else
// A shift gives a weight chunk's even columns as fp32 and a mask the odd ones, so a chunk of x is
// stored as its 8 even then 8 odd values.
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
#endif

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

// One 32-byte int4 block (64 columns) -> two registers of 32 levels from `table` (16 bytes in each
// 128-bit lane): `lo` holds columns 0-15 and 32-47, `hi` columns 16-31 and 48-63 (each 128-bit lane
// is one 32-column half).
inline void load_int4(const uint8_t* p, __m256i table, __m256i& lo, __m256i& hi) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i mask = _mm256_set1_epi8(0x0f);
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, mask));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
}

// kInt4Levels as signed bytes, in both lanes; xor 0x80 gives them offset by 128 (unsigned).
inline __m256i int4_levels() {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kInt4Levels)));
}

constexpr int kSpan = 64;  // blocks whose combined scales are prepared at once (2048 columns)
constexpr int kScaleStride = kSpan + 8;  // padded: the int4 tile reads 8 scales from any block

// Walks the fp16 group scales ws of one row over blocks b0 + j, j < nb, a group at a time (no
// division per block): put8(j, v) takes 8 blocks' fp32 scales at once where a group is one block,
// put(j, s) one block's otherwise.
template <typename Put8, typename Put>
inline void for_block_scales(const uint16_t* ws, int per_group, int b0, int nb, Put8 put8, Put put) {
    int j = 0;
    if (per_group == 1)
        for (; j + 8 <= nb; j += 8) put8(j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + b0 + j))));
    for (int g = (b0 + j) / per_group; j < nb; ++g)
        for (const float wg = _cvtsh_ss(ws[g]); j < std::min(nb, (g + 1) * per_group - b0); ++j) put(j, wg);
}

// scale[i][k][j] = wk[j] times the x scale of token i's block b0 + j, j < nb.
template <int N>
inline void scale_products(const float* wk, int k, int b0, int nb, const float* const* xs,
                           float (*scale)[kTileRows][kScaleStride]) {
    int j = 0;
    for (; j + 8 <= nb; j += 8) {
        const __m256 wv = _mm256_loadu_ps(wk + j);
        for (int i = 0; i < N; ++i) _mm256_storeu_ps(scale[i][k] + j, _mm256_mul_ps(wv, _mm256_loadu_ps(xs[i] + b0 + j)));
    }
    for (; j < nb; ++j)
        for (int i = 0; i < N; ++i) scale[i][k][j] = wk[j] * xs[i][b0 + j];
}

// Where a tile's weight scales come from. Both give combined<N>(r, b0, nb, xs, scale):
// scale[i][k][j] = x scale of token i's block b0 + j times the weight scale of that block in row r + k.
// HalfScales converts the fp16 scales at each use (decode: a tile meets one or two tokens);
// TileScales converts a tile's scales once (load) and shares them across its many tokens (prefill).
struct HalfScales {
    const uint16_t* data;
    int groups;     // scale groups per row
    int per_group;  // blocks per group
    explicit HalfScales(const Matrix& w) : data(w.scales), groups(w.cols / w.group), per_group(w.group / kBlock) {}
    const uint16_t* row(int r) const { return data + int64_t(r) * groups; }
    void load(int) {}

    template <int N>
    void combined(int r, int b0, int nb, const float* const* xs, float (*scale)[kTileRows][kScaleStride]) const {
        for (int k = 0; k < kTileRows; ++k)
            for_block_scales(
                row(r + k), per_group, b0, nb,
                [&](int j, __m256 wv) {
                    for (int i = 0; i < N; ++i)
                        _mm256_storeu_ps(scale[i][k] + j, _mm256_mul_ps(wv, _mm256_loadu_ps(xs[i] + b0 + j)));
                },
                [&](int j, float wg) {
                    for (int i = 0; i < N; ++i) scale[i][k][j] = wg * xs[i][b0 + j];
                });
    }
};

struct TileScales {
    HalfScales half;
    int blocks;
    std::vector<float> f;  // [kTileRows][blocks]: the current tile's scales, one per 32-column block
    explicit TileScales(const Matrix& w) : half(w), blocks(w.cols / kBlock), f(size_t(kTileRows) * blocks) {}

    void load(int r) {
        for (int k = 0; k < kTileRows; ++k) {
            float* out = f.data() + k * blocks;
            for_block_scales(
                half.row(r + k), half.per_group, 0, blocks, [&](int j, __m256 wv) { _mm256_storeu_ps(out + j, wv); },
                [&](int j, float wg) { out[j] = wg; });
        }
    }

    template <int N>
    void combined(int, int b0, int nb, const float* const* xs, float (*scale)[kTileRows][kScaleStride]) const {
        for (int k = 0; k < kTileRows; ++k) scale_products<N>(f.data() + k * blocks + b0, k, b0, nb, xs, scale);
    }
};

constexpr int kTileScaleTokens = 4;  // from this many tokens a tile's scales are converted once

// One 4-row tile of int8/int4 weights against N quantized tokens (N <= kTokensPerLoad; the tokens
// share each weight load, for prefill): y[i * ldy + k] = dot(row r + k, token i).
template <typename Block, int N, typename Scales>
void int_tile(const Matrix& w, const Scales& ws, int r, const int8_t* const* xq, const float* const* xs,
              float* y, int ldy) {
    const int blocks = w.cols / kBlock;
    const uint8_t* tile = block_at(w, r, 0);
    float total[N][kTileRows] = {};
    alignas(32) float scale[N][kTileRows][kScaleStride];
    for (int b0 = 0; b0 < blocks; b0 += kSpan) {
        const int nb = std::min(kSpan, blocks - b0);
        ws.template combined<N>(r, b0, nb, xs, scale);
        __m256 acc[N][kTileRows];
        for (int i = 0; i < N; ++i)
            for (int k = 0; k < kTileRows; ++k) acc[i][k] = _mm256_setzero_ps();
        for (int j = 0; j < nb; ++j, tile += kTileRows * Block::kBytes) {
            for (int line = 0; line < kTileRows * Block::kBytes; line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + line, _MM_HINT_T0);
            __m256i xv[N], ax[N];
            for (int i = 0; i < N; ++i) {
                xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + (b0 + j) * kBlock));
                ax[i] = _mm256_sign_epi8(xv[i], xv[i]);
            }
            for (int k = 0; k < kTileRows; ++k) {
                const __m256i wv = Block::load(tile + k * Block::kBytes);
                for (int i = 0; i < N; ++i) {
                    const __m256i dot = dot_u8s8(_mm256_setzero_si256(), ax[i], _mm256_sign_epi8(wv, xv[i]));
                    acc[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[i][k][j]), acc[i][k]);
                }
            }
        }
        for (int i = 0; i < N; ++i)  // per span, so no accumulator lives across a call
            for (int k = 0; k < kTileRows; ++k) total[i][k] += hsum(acc[i][k]);
    }
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < kTileRows; ++k) y[int64_t(i) * ldy + k] = total[i][k];
}

// The quantized values and block scales of tokens i .. i + N - 1.
template <int N>
struct TokenRows {
    const int8_t* q[N];
    const float* s[N];

    TokenRows(const Activations& x, int i) {
        for (int t = 0; t < N; ++t) {
            q[t] = x.q + x.row(i + t) * x.cols;
            s[t] = x.s + x.row(i + t) * (x.cols / kBlock);
        }
    }
};

// Tokens i .. i + N - 1 against the 4-row tile at row r.
template <typename Block, int N, typename Scales>
void int_tokens(const Matrix& w, const Scales& ws, int r, const Activations& x, int i, float* y, int ldy) {
    const TokenRows<N> t(x, i);
    int_tile<Block, N>(w, ws, r, t.q, t.s, y + int64_t(i) * ldy, ldy);
}

template <typename Block, typename Scales>
void int_rows(const Matrix& w, const Scales& ws, int r, const Activations& x, int n, float* y, int ldy) {
    int i = 0;
    for (; i + kTokensPerLoad <= n; i += kTokensPerLoad) int_tokens<Block, kTokensPerLoad>(w, ws, r, x, i, y, ldy);
    for (; i + 2 <= n; i += 2) int_tokens<Block, 2>(w, ws, r, x, i, y, ldy);
    if (i < n) int_tokens<Block, 1>(w, ws, r, x, i, y, ldy);
}

template <typename Block, typename Scales>
void int_matrix(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    Scales ws(w);
    for (int r = r0; r < r1; r += kTileRows) {
        ws.load(r);
        int_rows<Block>(w, ws, r, x, n, y + (r - r0), ldy);
    }
}

template <typename Block>
void matmul_int(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n >= kTileScaleTokens) int_matrix<Block, TileScales>(w, r0, r1, x, n, y, ldy);
    else int_matrix<Block, HalfScales>(w, r0, r1, x, n, y, ldy);
}

// 128 * (sum of the 4 activations behind each int32 lane of an int4 dot): the correction that
// turns sums against the offset levels (w + 128) back into sums against w. AVX2 keeps it as int16
// pair sums, VNNI as its int32 negation (the dot's starting value).
inline __m256i int4_correction(__m256i xlo, __m256i xhi) {
    const __m256i ones = _mm256_set1_epi8(1);
#if defined(TANDEM_SIMD_VNNI)
    const __m256i sum = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, xlo), ones, xhi);
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7));
#else
    return _mm256_slli_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(ones, xlo), _mm256_maddubs_epi16(ones, xhi)), 7);
#endif
}

// In each int32 lane, the exact sum of the 8 products of levels w and activations x behind it,
// from the offset levels u = w + 128 (unsigned, so maddubs/vpdpbusd take them as they are) and
// x in [-63, 63]: sum(u x) - 128 sum(x). AVX2: an int16 lane u0 x0 + u1 x1 <= 2 * 241 * 63 cannot
// saturate; the int16 sums of the two halves and the correction may wrap on the way, but their
// result, 4 products of |w| <= 127 and |x| <= 63, fits int16, so the wrapped arithmetic is exact.
inline __m256i int4_dot(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi, __m256i correction) {
#if defined(TANDEM_SIMD_VNNI)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(correction, lo, xlo), hi, xhi);
#else
    const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(_mm256_sub_epi16(sum, correction), _mm256_set1_epi16(1));
#endif
}

// One 4-row tile of int4 weights against N quantized tokens (N <= kTokensPerLoad), their
// activations 7-bit (activation_levels). Each 32-byte load gives two 32-column halves, unpacked
// once for all N tokens; x is rearranged to match, so both halves reduce into one register whose
// low lanes belong to the first half-block and high lanes to the second (scaled by the combined
// scales of both blocks). A token's arithmetic does not depend on N or on its batch-mates, so a token
// gets the same result decoded alone or in a prefill batch (batch invariance).
template <int N, typename Scales>
void int4_tile(const Matrix& w, const Scales& ws, int r, const int8_t* const* xq, const float* const* xs,
               float* y, int ldy) {
    const int blocks = w.cols / kBlock;
    const uint8_t* tile = block_at(w, r, 0);
    const __m256i table = _mm256_xor_si256(int4_levels(), _mm256_set1_epi8(char(0x80)));
    float total[N][kTileRows] = {};
    alignas(32) float scale[N][kTileRows][kScaleStride];
    for (int b0 = 0; b0 < blocks; b0 += kSpan) {
        const int nb = std::min(kSpan, blocks - b0);
        ws.template combined<N>(r, b0, nb, xs, scale);
        __m256 acc[N][kTileRows];
        for (int i = 0; i < N; ++i)
            for (int k = 0; k < kTileRows; ++k) acc[i][k] = _mm256_setzero_ps();
        for (int j = 0; j < nb; j += 2, tile += kTileRows * kBlockBytes) {
            _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + 64, _MM_HINT_T0);
            __m256i xlo[N], xhi[N], correction[N];
            for (int i = 0; i < N; ++i) {
                const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + (b0 + j) * kBlock));
                const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + (b0 + j + 1) * kBlock));
                xlo[i] = _mm256_permute2x128_si256(xa, xb, 0x20);
                xhi[i] = _mm256_permute2x128_si256(xa, xb, 0x31);
                correction[i] = int4_correction(xlo[i], xhi[i]);
            }
            for (int k = 0; k < kTileRows; ++k) {
                __m256i lo, hi;
                load_int4(tile + k * kBlockBytes, table, lo, hi);
                for (int i = 0; i < N; ++i) {
                    // the scales of blocks j (low lanes) and j + 1: two broadcast loads and a blend
                    // keep the shuffle unit, which the unpacking and the dot products saturate, free
                    const __m256 sc = _mm256_blend_ps(_mm256_broadcast_ss(&scale[i][k][j]),
                                                      _mm256_broadcast_ss(&scale[i][k][j + 1]), 0xf0);
                    const __m256i dot = int4_dot(lo, hi, xlo[i], xhi[i], correction[i]);
                    acc[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[i][k]);
                }
            }
        }
        for (int i = 0; i < N; ++i)  // per span, so no accumulator lives across a call
            for (int k = 0; k < kTileRows; ++k) total[i][k] += hsum(acc[i][k]);
    }
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < kTileRows; ++k) y[int64_t(i) * ldy + k] = total[i][k];
}

// Tokens i .. i + N - 1 against the int4 tile at row r.
template <int N, typename Scales>
void int4_tokens(const Matrix& w, const Scales& ws, int r, const Activations& x, int i, float* y, int ldy) {
    const TokenRows<N> t(x, i);
    int4_tile<N>(w, ws, r, t.q, t.s, y + int64_t(i) * ldy, ldy);
}

constexpr int kInt4Tokens = 2;  // tokens sharing one unpacked tile (more spill on AVX2's 16 registers)

template <typename Scales>
void int4_matrix(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    Scales ws(w);
    for (int r = r0; r < r1; r += kTileRows) {
        ws.load(r);
        float* yr = y + (r - r0);
        int i = 0;
        for (; i + kInt4Tokens <= n; i += kInt4Tokens) int4_tokens<kInt4Tokens>(w, ws, r, x, i, yr, ldy);
        if (i < n) int4_tokens<1>(w, ws, r, x, i, yr, ldy);
    }
}

void matmul_int4(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n >= kTileScaleTokens) int4_matrix<TileScales>(w, r0, r1, x, n, y, ldy);
    else int4_matrix<HalfScales>(w, r0, r1, x, n, y, ldy);
}

// The 4 rows of an int4 tile -> the same rows as int8 blocks, in the int8 packed layout (AMX
// repacks from this).
[[maybe_unused]] void expand_int4_tile(const uint8_t* src, int cols, uint8_t* dst) {
    for (int b = 0; b < cols / (2 * kBlock); ++b)
        for (int k = 0; k < kTileRows; ++k, src += kBlockBytes) {
            __m256i lo, hi;
            load_int4(src, int4_levels(), lo, hi);
            auto* out = reinterpret_cast<__m256i*>(dst);
            _mm256_storeu_si256(out + (2 * b) * kTileRows + k, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256(out + (2 * b + 1) * kTileRows + k, _mm256_permute2x128_si256(lo, hi, 0x31));
        }
}

// exp(x) for x in [-87, 88]: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes' polynomial,
// about 1 ulp); inputs outside are clamped, which silu tolerates (the result saturates).
inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

void silu_mul(const float* gate_up, int intermediate, float* h) {
    const float* up = gate_up + intermediate;
    int j = 0;
    for (; j + 8 <= intermediate; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate_up + j);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(h + j, _mm256_mul_ps(s, _mm256_loadu_ps(up + j)));
    }
    for (; j < intermediate; ++j) h[j] = gate_up[j] / (1.f + std::exp(-gate_up[j])) * up[j];
}

// The kernel table of the including variant.
KernelTable simd_table(const char* name) {
    return {name, {matmul_bf16, matmul_int<Int8Block>, matmul_int4}, quantize, arrange, silu_mul};
}

}  // namespace
}  // namespace tandem
