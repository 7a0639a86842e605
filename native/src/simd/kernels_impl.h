// The SIMD kernels of the AVX2 and AVX-512 variants, at 256-bit width (AVX-512's bf16 FMA tiles at
// 512: bf16_tile_x2). Each variant's source
// includes this header and is compiled with its own flags, which select what the code uses:
//   AVX2 + FMA + F16C     the base (VEX, 16 registers, 2 tokens per weight load in prefill);
//   AVX-512 F/BW/VL/DQ    EVEX with 32 registers: 4 tokens per weight load;
//   + AVX512_VNNI         vpdpbusd for the int8 dot products;
//   + AVX512_BF16         vdpbf16ps for bf16 weights, against activations split into two bf16 parts
//                         (the low one skipped for tokens whose values are exactly bf16).
// Everything lives in an anonymous namespace: each variant's object has its own copy.
// int8 uses the sign trick: |a| (unsigned) times sign(b, a) (signed) through maddubs (which cannot
// saturate because |a|, |b| <= 127) or vpdpbusd (which does not saturate). int4 looks its levels up
// offset by 128 (unsigned) against 7-bit x and subtracts 128 sum(x) (int4_step). Every path gives
// exact int32 sums of a 32-column block's products, so the variants agree bit for bit before the
// float scaling.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
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

// Weight streams a one-token call (decode) reads side by side, each a run of consecutive tiles.
// On AVX2 machines one stream and its software prefetch keep too few lines in flight: a Zen 2 read
// int4 weights at 0.76-0.82 of the read bandwidth that way (int8 0.74), and at 0.90-1.05 (int8
// 1.04-1.27) with four runs, which the hardware prefetchers follow on their own. AVX-512 machines
// (Zen 4) read at 0.94-0.99 with one.
#if defined(__AVX512F__)
constexpr int kDecodeStreams = 1;
#else
constexpr int kDecodeStreams = 4;
#endif
#if defined(__AVX512F__)
constexpr int kTokensPerLoad = 4;  // 16 accumulators fit the 32 registers
#else
constexpr int kTokensPerLoad = 2;
#endif
// int8 takes 4 tokens per load on AVX2 too: each token's step is a sign, a maddubs, a madd and an
// add against the load's |w| made once, and its 8 sums beside the load's 4 registers still fit. On
// a Zen 3 (one thread per core, side by side against 2 tokens), a 512-token layer call (qwen3
// shape, 32 tokens an expert) 1.02-1.32x (median 1.08), a 64-token one (4 an expert) 1.08-1.53x
// (median 1.20); int4_asym's step gained 0.98-1.11x that way, so it keeps kTokensPerLoad.
constexpr int kInt8Tokens = 4;

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
bool arrange(const float* x, int cols, float* out) {
    __m256i lo_bits = _mm256_setzero_si256();
    for (int c = 0; c < cols; c += kChunk) {
        const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + kChunk / 2);
        const __m256bh hi = _mm256_cvtne2ps_pbh(b, a);  // columns 0-7 from a, 8-15 from b
        const __m256i hi_bits = (__m256i)hi;
        const __m256 a_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(hi_bits)), 16));
        const __m256 b_hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(hi_bits, 1)), 16));
        const __m256bh lo = _mm256_cvtne2ps_pbh(_mm256_sub_ps(b, b_hi), _mm256_sub_ps(a, a_hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), hi_bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + kChunk / 2), (__m256i)lo);
        lo_bits = _mm256_or_si256(lo_bits, (__m256i)lo);
    }
    return _mm256_testz_si256(lo_bits, lo_bits);
}

// One 4-row tile of bf16 weights against N tokens sharing its loads: y[i][k] = dot(row r + k, x[i]).
// Each lane adds a chunk's lo products, then its hi ones, into one accumulator, in the same order
// whatever N: a token's sums are the same alone or beside others (batch invariance).
// Lo = false: every token's x is exactly bf16 (arrange's low parts all +0), whose products would add
// nothing: skipped, one vdpbf16ps a chunk instead of two (the same sums).
template <int N, bool Lo>
void bf16_tile(const uint16_t* tile, int cols, const float* const* x, float (*y)[kTileRows]) {
    __m256 acc[N][kTileRows];
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < kTileRows; ++k) acc[i][k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += kChunk, tile += kTileRows * kChunk) {
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + 64, _MM_HINT_T0);
        __m256bh v[kTileRows];
        for (int k = 0; k < kTileRows; ++k) v[k] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * kChunk));
        for (int i = 0; i < N; ++i) {
            const __m256bh hi = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i] + c));
            if constexpr (Lo) {
                const __m256bh lo = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i] + c + kChunk / 2));
                for (int k = 0; k < kTileRows; ++k) acc[i][k] = _mm256_dpbf16_ps(_mm256_dpbf16_ps(acc[i][k], v[k], lo), v[k], hi);
            } else {
                for (int k = 0; k < kTileRows; ++k) acc[i][k] = _mm256_dpbf16_ps(acc[i][k], v[k], hi);
            }
        }
    }
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < kTileRows; ++k) y[i][k] = hsum(acc[i][k]);
}
#else
// A shift gives a weight chunk's even columns as fp32 and a mask the odd ones, so a chunk of x is
// stored as its 8 even then 8 odd values.
bool arrange(const float* x, int cols, float* out) {
    int c = 0;
    for (; c + kChunk <= cols; c += kChunk)
        for (int j = 0; j < kChunk / 2; ++j) {
            out[c + j] = x[c + 2 * j];
            out[c + kChunk / 2 + j] = x[c + 2 * j + 1];
        }
    for (; c < cols; ++c) out[c] = x[c];
    return false;
}

// S 4-row tiles of bf16 weights (tile t at tile + t * stride) against N tokens sharing their loads:
// y[i][4 t + k] = dot(row k of tile t, x[i]). Each lane adds a chunk's even product, then its odd
// one, into one accumulator (half the accumulators of keeping them apart, so two tokens share each
// weight load); a tile's arithmetic is the same whatever N and S (batch invariance). S > 1: a lone
// token reads S weight streams side by side (kDecodeStreams).
template <int N, int S = 1>
void bf16_tile(const uint16_t* tile, int64_t stride, int cols, const float* const* x, float (*y)[S * kTileRows]) {
    const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
    __m256 acc[N][S * kTileRows];
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < S * kTileRows; ++k) acc[i][k] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += kChunk, tile += kTileRows * kChunk) {
        __m256 even[N], odd[N];
        for (int i = 0; i < N; ++i) even[i] = _mm256_loadu_ps(x[i] + c), odd[i] = _mm256_loadu_ps(x[i] + c + kChunk / 2);
        for (int t = 0; t < S; ++t) {
            const uint16_t* rows = tile + t * stride;
            _mm_prefetch(reinterpret_cast<const char*>(rows) + kPrefetch, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(rows) + kPrefetch + 64, _MM_HINT_T0);
            for (int k = 0; k < kTileRows; ++k) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + k * kChunk));
                const __m256 even_w = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 odd_w = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int i = 0; i < N; ++i)
                    acc[i][t * kTileRows + k] =
                        _mm256_fmadd_ps(odd_w, odd[i], _mm256_fmadd_ps(even_w, even[i], acc[i][t * kTileRows + k]));
            }
        }
    }
    for (int i = 0; i < N; ++i)
        for (int k = 0; k < S * kTileRows; ++k) y[i][k] = hsum(acc[i][k]);
}

#if defined(__AVX512F__)
// bf16_tile<N> at 512 bits, for CPUs with two 512-bit FMA units (Intel Xeons): a load holds two rows'
// chunks, and each 256-bit half adds its row's even then odd products lane by lane as bf16_tile
// does, then sums the same way, so the bits are bf16_tile's. Against 256 bits, the conversions and
// FMAs per weight are halved and 6 tokens share the loads (12 accumulators, 12 broadcast x chunks).
template <int N>
void bf16_tile_x2(const uint16_t* tile, int cols, const float* const* x, float (*y)[kTileRows]) {
    const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
    __m512 acc[N][kTileRows / 2];
    for (int i = 0; i < N; ++i)
        for (int h = 0; h < kTileRows / 2; ++h) acc[i][h] = _mm512_setzero_ps();
    for (int c = 0; c < cols; c += kChunk, tile += kTileRows * kChunk) {
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kPrefetch + 64, _MM_HINT_T0);
        __m512 even_w[kTileRows / 2], odd_w[kTileRows / 2];
        for (int h = 0; h < kTileRows / 2; ++h) {
            const __m512i v = _mm512_loadu_si512(tile + 2 * h * kChunk);  // rows 2h and 2h + 1
            even_w[h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd_w[h] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int i = 0; i < N; ++i) {
            const __m512 even = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[i] + c));
            const __m512 odd = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[i] + c + kChunk / 2));
            for (int h = 0; h < kTileRows / 2; ++h)
                acc[i][h] = _mm512_fmadd_ps(odd_w[h], odd, _mm512_fmadd_ps(even_w[h], even, acc[i][h]));
        }
    }
    for (int i = 0; i < N; ++i)
        for (int h = 0; h < kTileRows / 2; ++h) {
            y[i][2 * h] = hsum(_mm512_castps512_ps256(acc[i][h]));
            y[i][2 * h + 1] = hsum(_mm512_extractf32x8_ps(acc[i][h], 1));
        }
}
#endif
#endif

// Tokens sharing a bf16 tile's loads, as many as their accumulators leave registers for:
// vdpbf16ps 24 (4 rows x 6 tokens, hi and lo parts summed in one) of AVX-512's 32, which keeps both
// of Zen 4's bf16 pipes busy; AVX-512's FMA path 12 (two rows a register x 6 tokens) beside the 6
// tokens' 12 broadcast chunks; AVX2's 8 (4 rows x 2 tokens), leaving its other 8 registers for the
// two tokens' even and odd columns and the weights. 512-bit FMAs against 256-bit ones with 2 tokens
// (bench model, bf16 dense and experts, 512-token prefill in process, Xeon with AVX-512 VNNI, 2
// threads, alternating): 151-167 -> 233-235 tok/s.
#if defined(TANDEM_SIMD_BF16) || defined(__AVX512F__)
constexpr int kBf16Tokens = 6;
#else
constexpr int kBf16Tokens = 2;
#endif

template <int N>
void bf16_tokens(const uint16_t* tile, const Matrix& w, const Activations& x, int i, float* y, int ldy) {
    const float* rows[N];
    float out[N][kTileRows];
    for (int t = 0; t < N; ++t) rows[t] = x.f + x.row(i + t) * x.cols;
#if defined(TANDEM_SIMD_BF16)
    bool exact = x.bf16_exact != nullptr;
    for (int t = 0; t < N && exact; ++t) exact = x.bf16_exact[x.row(i + t)];
    if (exact) bf16_tile<N, false>(tile, w.cols, rows, out);
    else bf16_tile<N, true>(tile, w.cols, rows, out);
#elif defined(__AVX512F__)
    bf16_tile_x2<N>(tile, w.cols, rows, out);
#else
    bf16_tile<N>(tile, 0, w.cols, rows, out);
#endif
    for (int t = 0; t < N; ++t)
        for (int k = 0; k < kTileRows; ++k) y[int64_t(i + t) * ldy + k] = out[t][k];
}

// The last m < N tokens of a tile, in one call.
template <int N>
void bf16_rest(const uint16_t* tile, const Matrix& w, const Activations& x, int i, int m, float* y, int ldy) {
    if constexpr (N > 0) {
        if (m == N) return bf16_tokens<N>(tile, w, x, i, y, ldy);
        bf16_rest<N - 1>(tile, w, x, i, m, y, ldy);
    }
}

#if !defined(TANDEM_SIMD_BF16)
// A lone token's rows as two weight streams side by side (kDecodeStreams; two, as a stream's four
// accumulators take a quarter of AVX2's registers): run tiles of each. Returns the first row left
// (the leftover tiles go one at a time).
int bf16_streams(const Matrix& w, int r0, int r1, const float* x, float* y) {
    constexpr int S = kDecodeStreams > 1 ? 2 : 1;
    const int run = (r1 - r0) / (kTileRows * S);
    if (S == 1 || run == 0) return r0;
    const auto at = [&](int r) { return reinterpret_cast<const uint16_t*>(block_at(w, r, 0)); };
    const int64_t stride = at(r0 + run * kTileRows) - at(r0);
    for (int j = 0; j < run; ++j) {
        const int r = r0 + j * kTileRows;
        float out[1][S * kTileRows];
        bf16_tile<1, S>(at(r), stride, w.cols, &x, out);
        for (int t = 0; t < S; ++t)
            for (int k = 0; k < kTileRows; ++k) y[r - r0 + t * run * kTileRows + k] = out[0][t * kTileRows + k];
    }
    return r0 + run * S * kTileRows;
}
#endif

void matmul_bf16(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    int first = r0;
#if !defined(TANDEM_SIMD_BF16)
    if (n == 1) first = bf16_streams(w, r0, r1, x.f + x.row(0) * x.cols, y);
#endif
    for (int r = first; r < r1; r += kTileRows) {
        const uint16_t* tile = reinterpret_cast<const uint16_t*>(block_at(w, r, 0));
        int i = 0;
        for (; i + kBf16Tokens <= n; i += kBf16Tokens) bf16_tokens<kBf16Tokens>(tile, w, x, i, y + (r - r0), ldy);
        bf16_rest<kBf16Tokens - 1>(tile, w, x, i, n - i, y + (r - r0), ldy);
    }
}

// ---------------------------------------------------------------- int8 and int4
// A tile (format.h) is 16 rows; each 32-byte load holds 8 of them (a half), 4 bytes a row, so a
// vector lane keeps one row's sum: a step's int32 products go straight into the lane, and a 32-column
// block's sums are scaled into fp32 once (no horizontal sums). A token's columns of a step are one
// 4-byte broadcast. A token's arithmetic does not depend on how many tokens share the weight loads,
// so it gets the same bits decoded alone or in a prefill batch (batch invariance).
constexpr int kHalves = kIntTileRows / 8;
constexpr int kInt4Tokens = 2;  // tokens sharing a tile's unpacking (more spill on AVX2's 16 registers)

inline __m256i broadcast4(const void* p) { return _mm256_set1_epi32(*static_cast<const int32_t*>(p)); }

// The layer's 16 int4 levels as signed bytes, in both lanes; xor 0x80 gives them offset by 128 (unsigned).
inline __m256i int4_levels(const Matrix& w) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)));
}

// The quantized values, block scales and (int4) corrections of tokens i .. i + N - 1.
template <int N>
struct TokenRows {
    const int8_t* q[N];
    const float* s[N];
    const int32_t* c[N];
    const int32_t* sums[N];

    TokenRows(const Activations& x, int i) {
        for (int t = 0; t < N; ++t) {
            q[t] = x.q + x.row(i + t) * x.cols;
            s[t] = x.s + x.row(i + t) * (x.cols / kBlock);
            c[t] = x.c ? x.c + x.row(i + t) * (x.cols / 8) : nullptr;
            sums[t] = x.sums ? x.sums + x.row(i + t) * (x.cols / kBlock) : nullptr;
        }
    }
};

// acc[i][h] += dot[i][h] * (weight scales of the block's rows * token i's x scale), for the block b
// whose scales (fp16, 16 rows) are at ws.
template <int N>
inline void scale_block(const uint16_t* ws, const float* const* xs, int b, const __m256i (&dot)[N][kHalves],
                        __m256 (&acc)[N][kHalves]) {
    __m256 wsh[kHalves];
    for (int h = 0; h < kHalves; ++h) wsh[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + 8 * h)));
    for (int i = 0; i < N; ++i) {
        const __m256 x_scale = _mm256_broadcast_ss(xs[i] + b);
        for (int h = 0; h < kHalves; ++h)
            acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_mul_ps(wsh[h], x_scale), acc[i][h]);
    }
}

// int4_asym: acc[i][h] += the block's row minimums (fp16, 16 rows, at wm) * token i's x scale * its
// sum over the block.
template <int N>
inline void min_block(const uint16_t* wm, const TokenRows<N>& t, int b, __m256 (&acc)[N][kHalves]) {
    __m256 m[kHalves];
    for (int h = 0; h < kHalves; ++h) m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + 8 * h)));
    for (int i = 0; i < N; ++i) {
        const __m256 f = _mm256_set1_ps(t.s[i][b] * float(t.sums[i][b]));
        for (int h = 0; h < kHalves; ++h) acc[i][h] = _mm256_fmadd_ps(m[h], f, acc[i][h]);
    }
}

// One block's weight scales after another: a group of G columns spans G / 32 blocks.
struct ScaleWalk {
    const uint16_t* at;
    int per_group, left;
    ScaleWalk(const Matrix& w, int r) : at(int_scale_at(w, r, 0)), per_group(w.group / kBlock), left(per_group) {}
    void next() {
        if (--left == 0) at += kIntTileRows, left = per_group;
    }
};

// Decode's S streams of weights are followed by the hardware prefetchers; their scales (and
// int4_asym's minimums), S more streams each, are fetched here, a 64-byte line (two blocks' 16
// rows) at a time, kScalePrefetch bytes ahead. On a Zen 3 this took int4_asym's one-token calls from
// 0.50-0.63 to 0.69-0.73 of the read bandwidth (alternating runs, both with dot2_u4s8).
constexpr int kScalePrefetch = 512;

template <Format F, int S>
inline void prefetch_scales(const Matrix& w, const uint16_t* scales, int64_t tile_scales) {
    for (int k = 0; k < S; ++k) {
        const uint16_t* at = scales + k * tile_scales;
        _mm_prefetch(reinterpret_cast<const char*>(at) + kScalePrefetch, _MM_HINT_T0);
        if constexpr (F == Format::INT4_ASYM)
            _mm_prefetch(reinterpret_cast<const char*>(w.mins + (at - w.scales)) + kScalePrefetch, _MM_HINT_T0);
    }
}

// Rows of S tiles (format F) against N tokens: tile k is the stride-th tile after tile k - 1, from
// row r, and y[i * ldy + 16 stride k + j] = dot(row j of tile k, token i).
// step(p, b, s, dot) adds step s of block b (its bytes at p) to the int32 sums dot[i][h]; each
// block's sums are then scaled into fp32 and added to y, where they accumulate (in L1: S tiles'
// accumulators would spill AVX2's 16 registers). A block's steps go across the S tiles in turn, so
// a step's token operands are loaded once for all of them: on a Zen 3, one thread on L3-resident
// weights (5th-percentile calls, side by side against tile after tile), int8 1.03-1.21x, int4_asym
// 1.02-1.12x, int4 0.97-1.05x (two tiles at a time there, to spill less, was 0.77-0.97x).
template <int N, Format F, int S, typename Step>
void int_tile(const Matrix& w, int r, int stride, const TokenRows<N>& t, float* y, int ldy, Step step) {
    const int blocks = w.cols / kBlock;
    const int64_t tile_bytes = int64_t(stride) * blocks * int_block_bytes(F);
    const int64_t tile_scales = stride * (int_scale_at(w, kIntTileRows, 0) - w.scales);
    auto out = [&](int k, int i, int h) { return y + int64_t(i) * ldy + kIntTileRows * stride * k + 8 * h; };
    const uint8_t* p = int_block_at(w, r, 0);
    ScaleWalk ws(w, r);
    for (int k = 0; k < S; ++k)
        for (int i = 0; i < N; ++i)
            for (int h = 0; h < kHalves; ++h) _mm256_storeu_ps(out(k, i, h), _mm256_setzero_ps());
    for (int b = 0; b < blocks; ++b, ws.next(), p += int_block_bytes(F)) {
        if constexpr (S == 1)
            for (int line = 0; line < int_block_bytes(F); line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch + line, _MM_HINT_T0);
        else if (b % 2 == 0)
            prefetch_scales<F, S>(w, ws.at, tile_scales);
        __m256i dot[S][N][kHalves];
        for (auto& tile : dot)
            for (auto& row : tile)
                for (auto& d : row) d = _mm256_setzero_si256();
        for (int s = 0; s < kBlock / int_step_cols(F); ++s)
            for (int k = 0; k < S; ++k) step(p + k * tile_bytes + s * kHalves * 32, b, s, dot[k]);
        for (int k = 0; k < S; ++k) {
            const uint16_t* scales = ws.at + k * tile_scales;
            __m256 acc[N][kHalves];
            for (int i = 0; i < N; ++i)
                for (int h = 0; h < kHalves; ++h) acc[i][h] = _mm256_loadu_ps(out(k, i, h));
            scale_block<N>(scales, t.s, b, dot[k], acc);
            if constexpr (F == Format::INT4_ASYM) min_block<N>(w.mins + (scales - w.scales), t, b, acc);
            for (int i = 0; i < N; ++i)
                for (int h = 0; h < kHalves; ++h) _mm256_storeu_ps(out(k, i, h), acc[i][h]);
        }
    }
}

// int8 through the sign trick: |a| (unsigned) times sign(b, a) (signed) through maddubs, which
// cannot saturate since |a|, |b| <= 127; one token takes a = x (its broadcast), several share a = w
// (made unsigned once per load).
template <int N, int S>
void int8_tile(const Matrix& w, int r, int stride, const TokenRows<N>& t, float* y, int ldy) {
    int_tile<N, Format::INT8, S>(w, r, stride, t, y, ldy, [&](const uint8_t* p, int b, int s, __m256i (&dot)[N][kHalves]) {
        __m256i wv[kHalves], aw[kHalves];
        for (int h = 0; h < kHalves; ++h) {
            wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
            if (N > 1) aw[h] = _mm256_abs_epi8(wv[h]);
        }
        for (int i = 0; i < N; ++i) {
            const __m256i xb = broadcast4(t.q[i] + b * kBlock + 4 * s);
            const __m256i ax = _mm256_abs_epi8(xb);
            for (int h = 0; h < kHalves; ++h)
                dot[i][h] = N > 1 ? dot_u8s8(dot[i][h], aw[h], _mm256_sign_epi8(xb, wv[h]))
                                  : dot_u8s8(dot[i][h], ax, _mm256_sign_epi8(wv[h], xb));
        }
    });
}

// In each int32 lane (a row), the exact sum of the 8 products of a step: levels (offset by 128,
// unsigned: lo columns 0-3, hi 4-7) times 7-bit x (xlo, xhi: the token's 4-byte broadcasts), less
// the correction (int4_corrections). AVX2: an int16 lane u0 x0 + u1 x1 <= 2 * 241 * 63 cannot
// saturate; the sum of both halves may wrap before the correction comes off, but the result, 4
// products of |w| <= 128 and |x| <= 63, fits int16, so the wrapped arithmetic is exact.
inline __m256i int4_step(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi, __m256i correction) {
#if defined(TANDEM_SIMD_VNNI)
    const __m256i sum = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
    return _mm256_sub_epi32(sum, _mm256_madd_epi16(correction, _mm256_set1_epi16(1)));
#else
    const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(_mm256_sub_epi16(sum, correction), _mm256_set1_epi16(1));
#endif
}

// One step's 32 bytes of int4 (8 rows x 8 columns) -> the levels of columns 0-3 (lo) and 4-7 (hi)
// of each row, looked up in `table` (the layer's levels, possibly offset).
inline void unpack_int4(const uint8_t* p, __m256i table, __m256i& lo, __m256i& hi) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i mask = _mm256_set1_epi8(0x0f);
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, mask));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
}

// dot[i][h] += a step's levels (lo, hi: columns col .. col + 7 of each half's 8 rows) times token i's x.
template <int N>
inline void int4_tokens(const __m256i (&lo)[kHalves], const __m256i (&hi)[kHalves], const TokenRows<N>& t, int col,
                        __m256i (&dot)[N][kHalves]) {
    for (int i = 0; i < N; ++i) {
        const __m256i xlo = broadcast4(t.q[i] + col), xhi = broadcast4(t.q[i] + col + 4);
        const __m256i correction = _mm256_set1_epi32(t.c[i][col / 8]);
        for (int h = 0; h < kHalves; ++h)
            dot[i][h] = _mm256_add_epi32(dot[i][h], int4_step(lo[h], hi[h], xlo, xhi, correction));
    }
}

// int4 (activations 7-bit, activation_levels): each step unpacked once for all N tokens.
template <int N, int S>
void int4_tile(const Matrix& w, int r, int stride, const TokenRows<N>& t, float* y, int ldy) {
    const __m256i table = _mm256_xor_si256(int4_levels(w), _mm256_set1_epi8(char(0x80)));
    int_tile<N, Format::INT4, S>(w, r, stride, t, y, ldy, [&](const uint8_t* p, int b, int s, __m256i (&dot)[N][kHalves]) {
        __m256i lo[kHalves], hi[kHalves];
        for (int h = 0; h < kHalves; ++h) unpack_int4(p + 32 * h, table, lo[h], hi[h]);
        int4_tokens<N>(lo, hi, t, b * kBlock + 8 * s, dot);
    });
}

// Prefill: a tile's int4 steps unpacked once for all its tokens ([blocks][steps][halves][lo, hi], 4 KiB
// per 256 columns: L1 or L2), which then go kUnpackedTokens at a time with int4_tile's arithmetic (the
// registers the table and mask took hold a third token's sums). On a Zen 3, one thread per core, both
// builds side by side: a 512-token int4 layer call (qwen3 shape) 0.87-0.96x the time of int4_tile's
// 2 tokens at a time; 4 tokens were no faster than 3 there (AVX-512's 32 registers: not measured).
constexpr int kUnpackFrom = 4;  // tokens of a call from which its tiles are unpacked once
constexpr int kUnpackedTokens = 3;
constexpr int kInt4Steps = kBlock / int_step_cols(Format::INT4);

void unpack_int4_tile(const Matrix& w, int r, std::vector<__m256i>& out) {
    const __m256i table = _mm256_xor_si256(int4_levels(w), _mm256_set1_epi8(char(0x80)));
    const int blocks = w.cols / kBlock;
    out.resize(size_t(blocks) * kInt4Steps * kHalves * 2);
    const uint8_t* p = int_block_at(w, r, 0);
    __m256i* u = out.data();
    for (int j = 0; j < blocks * kInt4Steps * kHalves; ++j, u += 2) unpack_int4(p + 32 * j, table, u[0], u[1]);
}

template <int N>
void int4_unpacked_tile(const Matrix& w, int r, const __m256i* unpacked, const TokenRows<N>& t, float* y, int ldy) {
    int_tile<N, Format::INT4, 1>(w, r, 1, t, y, ldy, [&](const uint8_t*, int b, int s, __m256i (&dot)[N][kHalves]) {
        const __m256i* u = unpacked + (b * kInt4Steps + s) * kHalves * 2;
        __m256i lo[kHalves], hi[kHalves];
        for (int h = 0; h < kHalves; ++h) lo[h] = _mm256_loadu_si256(u + 2 * h), hi[h] = _mm256_loadu_si256(u + 2 * h + 1);
        int4_tokens<N>(lo, hi, t, b * kBlock + 8 * s, dot);
    });
}

// acc + the products of two pairs of (4-bit codes a, int8 x b): AVX2 adds both maddubs in int16
// (four products of at most 15 * 127 each cannot wrap) before widening once, one multiply and one
// add fewer than two dot_u8s8; on a Zen 3 int4_asym's one-token calls went from 0.87-0.90 of
// int4's read-bandwidth fraction to 1.01-1.06 (with prefetch_scales; one process, alternating).
inline __m256i dot2_u4s8(__m256i acc, __m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#if defined(TANDEM_SIMD_VNNI)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, a0, b0), a1, b1);
#else
    const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(sum, _mm256_set1_epi16(1)));
#endif
}

// int4_asym: codes 0-15 are unsigned as they are, so each step is two dot products with the
// token's full 8-bit x (a pair's 2 * 15 * 127 cannot saturate maddubs); the minimums come in per block.
template <int N, int S>
void int4_asym_tile(const Matrix& w, int r, int stride, const TokenRows<N>& t, float* y, int ldy) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    int_tile<N, Format::INT4_ASYM, S>(w, r, stride, t, y, ldy, [&](const uint8_t* p, int b, int s, __m256i (&dot)[N][kHalves]) {
        __m256i lo[kHalves], hi[kHalves];
        for (int h = 0; h < kHalves; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
            lo[h] = _mm256_and_si256(raw, mask);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
        const int col = b * kBlock + 8 * s;
        for (int i = 0; i < N; ++i) {
            const __m256i xlo = broadcast4(t.q[i] + col), xhi = broadcast4(t.q[i] + col + 4);
            for (int h = 0; h < kHalves; ++h) dot[i][h] = dot2_u4s8(dot[i][h], lo[h], xlo, hi[h], xhi);
        }
    });
}

// Rows [r0, r1) a 16-row tile at a time (r0 and r1 are multiples of it), against the tokens Most
// at a time, then 2, then 1: tile(N, S, r, stride, i, y) computes tokens i .. i + N - 1 of S tiles
// stride tiles apart from row r into y (N and S integral_constants). A lone token reads the rows as
// kDecodeStreams runs of consecutive tiles side by side, then the tiles left over one at a time.
template <int Most, typename Tile>
void by_tiles(int r0, int r1, int n, float* y, int ldy, Tile tile) {
    using One = std::integral_constant<int, 1>;
    constexpr int streams = kDecodeStreams;
    int r = r0;
    if (n == 1 && streams > 1) {
        const int run = (r1 - r0) / (kIntTileRows * streams);  // tiles of each stream
        for (int j = 0; j < run; ++j, r += kIntTileRows)
            tile(One{}, std::integral_constant<int, streams>{}, r, run, 0, y + (r - r0));
        r = r0 + run * streams * kIntTileRows;
    }
    for (; r < r1; r += kIntTileRows) {
        float* yr = y + (r - r0);
        int i = 0;
        for (; i + Most <= n; i += Most) tile(std::integral_constant<int, Most>{}, One{}, r, 1, i, yr + int64_t(i) * ldy);
        for (; i + 2 <= n; i += 2) tile(std::integral_constant<int, 2>{}, One{}, r, 1, i, yr + int64_t(i) * ldy);
        if (i < n) tile(One{}, One{}, r, 1, i, yr + int64_t(i) * ldy);
    }
}

void matmul_int8(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    by_tiles<kInt8Tokens>(r0, r1, n, y, ldy, [&](auto N, auto S, int r, int stride, int i, float* yi) {
        int8_tile<decltype(N)::value, decltype(S)::value>(w, r, stride, TokenRows<decltype(N)::value>(x, i), yi, ldy);
    });
}

void matmul_int4_asym(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    by_tiles<kTokensPerLoad>(r0, r1, n, y, ldy, [&](auto N, auto S, int r, int stride, int i, float* yi) {
        int4_asym_tile<decltype(N)::value, decltype(S)::value>(w, r, stride, TokenRows<decltype(N)::value>(x, i), yi, ldy);
    });
}

// int4 takes kInt4Tokens at a time (its unpacking spills on AVX2 with more), or from kUnpackFrom
// tokens unpacks each tile once for all of them.
void matmul_int4(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n < kUnpackFrom) {
        by_tiles<kInt4Tokens>(r0, r1, n, y, ldy, [&](auto N, auto S, int r, int stride, int i, float* yi) {
            int4_tile<decltype(N)::value, decltype(S)::value>(w, r, stride, TokenRows<decltype(N)::value>(x, i), yi, ldy);
        });
        return;
    }
    thread_local std::vector<__m256i> unpacked;
    for (int r = r0; r < r1; r += kIntTileRows) {  // one tile's tokens at a time (n > 1: no decode streams)
        unpack_int4_tile(w, r, unpacked);
        by_tiles<kUnpackedTokens>(r, r + kIntTileRows, n, y + (r - r0), ldy, [&](auto N, auto, int, int, int i, float* yi) {
            int4_unpacked_tile<decltype(N)::value>(w, r, unpacked.data(), TokenRows<decltype(N)::value>(x, i), yi, ldy);
        });
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

void swiglu_oai(const float* gate_up, int intermediate, float alpha, float limit, float* h) {
    const float* up = gate_up + intermediate;
    const __m256 lim = _mm256_set1_ps(limit), neg_lim = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.f);
    const __m256 neg_alpha = _mm256_set1_ps(-alpha);
    int j = 0;
    for (; j + 8 <= intermediate; j += 8) {
        const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate_up + j), lim);
        const __m256 u = _mm256_max_ps(neg_lim, _mm256_min_ps(lim, _mm256_loadu_ps(up + j)));
        const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_mul_ps(neg_alpha, g))));
        _mm256_storeu_ps(h + j, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
    }
    for (; j < intermediate; ++j) {
        const float g = std::min(gate_up[j], limit), u = std::max(-limit, std::min(limit, up[j]));
        h[j] = (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
    }
}

// A row's dot product with a weight row, finished: the 8 lanes of FMAs over columns [0, i) summed,
// then the columns [i, in) in order, one explicit fma each (the compiler may contract `sum += x * w`
// in one inlined copy and not in another: AVX-512 builds did, so a row's bits depended on whether
// it went with 4 others or alone).
inline float dot_tail(__m256 acc, const float* x, const float* w, int i, int in) {
    float sum = hsum(acc);
    for (; i < in; ++i) sum = std::fma(x[i], w[i], sum);
    return sum;
}

inline float dot_f32(const float* x, const float* w, int in) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= in; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), acc);
    return dot_tail(acc, x, w, i, in);
}

// Four rows against two outputs at a time: 6 loads for 8 fmas (four rows against one: 5 for 4); a
// value's arithmetic is dot_f32's either way, as for the rows and the output left over.
void dot_rows(const float* x, int rows, int in, const float* w, long ldw, int outs, float* y, int ldy) {
    int o = 0;
    for (; o + 2 <= outs; o += 2, w += 2 * ldw) {
        const float* w1 = w + ldw;
        int m = 0;
        for (; m + 4 <= rows; m += 4) {
            const float* xm = x + long(m) * in;
            __m256 a[4][2];
            for (auto& r : a) r[0] = r[1] = _mm256_setzero_ps();
            int i = 0;
            for (; i + 8 <= in; i += 8) {
                const __m256 v0 = _mm256_loadu_ps(w + i), v1 = _mm256_loadu_ps(w1 + i);
                for (int j = 0; j < 4; ++j) {
                    const __m256 xv = _mm256_loadu_ps(xm + long(j) * in + i);
                    a[j][0] = _mm256_fmadd_ps(xv, v0, a[j][0]);
                    a[j][1] = _mm256_fmadd_ps(xv, v1, a[j][1]);
                }
            }
            for (int j = 0; j < 4; ++j) {
                y[long(m + j) * ldy + o] = dot_tail(a[j][0], xm + long(j) * in, w, i, in);
                y[long(m + j) * ldy + o + 1] = dot_tail(a[j][1], xm + long(j) * in, w1, i, in);
            }
        }
        for (; m < rows; ++m) {
            y[long(m) * ldy + o] = dot_f32(x + long(m) * in, w, in);
            y[long(m) * ldy + o + 1] = dot_f32(x + long(m) * in, w1, in);
        }
    }
    if (o < outs)
        for (int m = 0; m < rows; ++m) y[long(m) * ldy + o] = dot_f32(x + long(m) * in, w, in);
}

// Two rows' 32 columns stay in registers through a run of outs (each value one fma a term, in order
// of o, as generic's): the 8 accumulators, 4 value loads and 2 broadcasts fit AVX2's 16 registers.
void weigh_rows(const float* p, int rows, long ldp, const float* v, long ldv, int outs, float* y, int ldy, int cols) {
    constexpr int kCols = 32, kRows = 2;
    int d = 0;
    for (; d + kCols <= cols; d += kCols) {
        int m = 0;
        for (; m + kRows <= rows; m += kRows) {
            float *y0 = y + long(m) * ldy + d, *y1 = y0 + ldy;
            const float *p0 = p + long(m) * ldp, *p1 = p0 + ldp;
            __m256 a0[4], a1[4];
            for (int j = 0; j < 4; ++j) a0[j] = _mm256_loadu_ps(y0 + 8 * j), a1[j] = _mm256_loadu_ps(y1 + 8 * j);
            for (int o = 0; o < outs; ++o) {
                const float* vo = v + o * ldv + d;
                const __m256 w0 = _mm256_set1_ps(p0[o]), w1 = _mm256_set1_ps(p1[o]);
                for (int j = 0; j < 4; ++j) {
                    const __m256 x = _mm256_loadu_ps(vo + 8 * j);
                    a0[j] = _mm256_fmadd_ps(w0, x, a0[j]);
                    a1[j] = _mm256_fmadd_ps(w1, x, a1[j]);
                }
            }
            for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y0 + 8 * j, a0[j]), _mm256_storeu_ps(y1 + 8 * j, a1[j]);
        }
        for (; m < rows; ++m) {
            float* y0 = y + long(m) * ldy + d;
            const float* p0 = p + long(m) * ldp;
            __m256 a0[4];
            for (int j = 0; j < 4; ++j) a0[j] = _mm256_loadu_ps(y0 + 8 * j);
            for (int o = 0; o < outs; ++o) {
                const __m256 w0 = _mm256_set1_ps(p0[o]);
                for (int j = 0; j < 4; ++j) a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v + o * ldv + d + 8 * j), a0[j]);
            }
            for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y0 + 8 * j, a0[j]);
        }
    }
    for (int m = 0; m < rows; ++m)  // the last cols % 32 columns
        for (int o = 0; o < outs; ++o) {
            const float w = p[long(m) * ldp + o];
            for (int c = d; c < cols; ++c) y[long(m) * ldy + c] = std::fma(w, v[o * ldv + c], y[long(m) * ldy + c]);
        }
}

// The kernel table of the including variant.
KernelTable simd_table(const char* name) {
    return {name, {matmul_bf16, matmul_int8, matmul_int4, matmul_int4_asym}, quantize, arrange, silu_mul, swiglu_oai,
            dot_rows, weigh_rows};
}

}  // namespace
}  // namespace tandem
