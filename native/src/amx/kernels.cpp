// AMX kernels: the prefill matrix products on the tile unit.
// - int8, int4 and int4_asym weights: tdpbssd (tdpbsud for int4_asym's unsigned codes), one
//   32-column block per product, whose int32 sums are then scaled into fp32 exactly as the SIMD
//   kernels scale them, so a token gets the same bits from either (batch invariance). int8 blocks
//   are B operands as packed (format.h: a 32-column block of a 16-row tile is the 16 rows' 4-byte
//   column groups interleaved); 4-bit blocks are expanded to that during a slab's first pass. The
//   tokens' int8 rows are arranged so each A operand is 512 contiguous bytes, and a partial last
//   token tile scales only its real rows.
// - bf16 weights: tdpbf16ps of the arranged activations (hi and lo bf16 parts of x, as avx512_bf16
//   splits them, copied tile by tile as A operands) against each 16-column block twice over,
//   accumulating in the tiles; blocks are transposed into B operands during a slab's first pass.
// A slab (16 weight rows; two at a time for bf16) meets two token tiles per pass, so each B operand
// is loaded once for 32 tokens. Under kAmxMinTokens tokens, and for everything besides the matrix products, the shared
// SIMD kernels run, compiled here as in the avx512_bf16 variant.
// M tokens per tile (16), N weight rows per tile (16).
#include <cstring>
#include <utility>

#include "aligned.h"
#include "simd/kernels_impl.h"

#if !defined(TANDEM_SIMD_BF16)
#error "the AMX kernels read the activation layout of the avx512_bf16 kernels"
#endif

namespace tandem {
namespace {

constexpr int kTileM = 16;                   // tokens per tile
constexpr int kTileN = 16;                   // weight rows per tile
constexpr int kWords = kBlockBytes / 4;      // 4-byte column groups per block
constexpr int kBTileWords = kWords * kTileN;  // one int8 block of a slab: [8 words][16 rows]
constexpr int kAmxMinTokens = 16;            // fewer tokens: the SIMD kernels
constexpr int kTokenChunk = 64;              // tokens per pass over the rows; 4-bit slabs expand once per chunk
constexpr int kPackedBlock = int_block_bytes(Format::INT4);  // bytes of a 4-bit slab's 32-column block, as packed
constexpr int kExpandAhead = 8;              // blocks of a 4-bit slab asked for into L1 ahead of their expansion

// The 64-byte operand of ldtilecfg, palette 1: tile t holds rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// int: tmm0, 1, 6, 7 C [16 tokens][16 rows] int32 += tmm2, 3 A [16 tokens][32 columns] int8
//      . tmm4, 5 B [8 column groups][16 rows][4 columns] int8 (int4_asym: unsigned codes).
constexpr TileConfig kIntTiles = {1,
                                  0,
                                  {},
                                  {kTileN * 4, kTileN * 4, kBlock, kBlock, kTileN * 4, kTileN * 4, kTileN * 4, kTileN * 4},
                                  {kTileM, kTileM, kTileM, kTileM, kWords, kWords, kTileM, kTileM}};

// The tile unit configured for one call (the configuration is per thread); released at the end.
class TileScope {
  public:
    explicit TileScope(const TileConfig& config) { _tile_loadconfig(&config); }
    ~TileScope() { _tile_release(); }
    TileScope(const TileScope&) = delete;
    TileScope& operator=(const TileScope&) = delete;
};

// The tile load intrinsics do not tell the compiler that they read memory: a barrier makes the
// plain stores that fill their operand buffers land first.
inline void operands_ready() { __asm__ volatile("" ::: "memory"); }

int round_up(int n, int m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------- int8 and int4

// Tokens i0 .. i0 + count - 1 as contiguous rows q [padded][C], s [padded][C / 32] and, where the
// activations have them, block sums [padded][C / 32]; zero rows after.
void gather_int8(const Activations& x, int i0, int count, int padded, int8_t* q, float* s, int32_t* sums) {
    const int blocks = x.cols / kBlock;
    for (int m = 0; m < padded; ++m, q += x.cols, s += blocks, sums += x.sums ? blocks : 0) {
        if (m >= count) {
            std::fill(q, q + x.cols, int8_t(0));
            std::fill(s, s + blocks, 0.f);
            if (x.sums) std::fill(sums, sums + blocks, 0);
            continue;
        }
        const int64_t row = x.row(i0 + m);
        std::copy(x.q + row * x.cols, x.q + (row + 1) * x.cols, q);
        std::copy(x.s + row * blocks, x.s + (row + 1) * blocks, s);
        if (x.sums) std::copy(x.sums + row * blocks, x.sums + (row + 1) * blocks, sums);
    }
}

// count int8 token rows q [count][C] -> A operands dst [tiles][blocks][16 tokens][32 columns], a
// tile's rows 32 bytes apart (rows C bytes apart would fall in a few L1 sets); rows past count zero.
void arrange_int8(const int8_t* q, int count, int cols, int8_t* dst) {
    const int blocks = cols / kBlock, padded = round_up(count, kTileM);
    for (int m = 0; m < padded; ++m, q += cols) {
        int8_t* out = dst + (int64_t(m / kTileM) * blocks * kTileM + m % kTileM) * kBlock;
        for (int b = 0; b < blocks; ++b, out += kTileM * kBlock) {
            const __m256i v = m < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock)) : _mm256_setzero_si256();
            _mm256_store_si256(reinterpret_cast<__m256i*>(out), v);
        }
    }
}

// dst[b][n] = the fp16 values at src (a slab's scales or minimums, [groups][16 rows]) as fp32, per
// 32-column block (a group spans per_group blocks).
void slab_floats(const uint16_t* src, int blocks, int per_group, float* dst) {
    for (int b = 0; b < blocks; ++b)
        _mm512_storeu_ps(dst + b * kTileN, _mm512_cvtph_ps(_mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(src + b / per_group * kTileN))));
}

// dst[b][m] = s[m][b] for a tile's block scales s [rows][blocks]; with sums (int4_asym), also
// dst_min[b][m] = s[m][b] * sums[m][b], the factor of the weights' minimums (as min_block has it).
// Zeros for the padding rows m >= rows: a last partial tile's rows past the activations are not read.
void transpose_tokens(const float* s, const int32_t* sums, int rows, int blocks, float* dst, float* dst_min) {
    for (int m = 0; m < kTileM; ++m)
        for (int b = 0; b < blocks; ++b) {
            const int64_t from = int64_t(m) * blocks + b;
            dst[b * kTileM + m] = m < rows ? s[from] : 0.f;
            if (sums) dst_min[b * kTileM + m] = m < rows ? s[from] * float(sums[from]) : 0.f;
        }
}

// One slab (16 weight rows) against one or two tiles of 16 tokens.
struct IntOperands {
    const uint8_t* b;      // [blocks][512 bytes]: each block a B operand (format.h's int8 layout)
    const float* ws;       // [blocks][16] weight scales
    const float* wm;       // int4_asym: [blocks][16] minimums; else null
    const int8_t* q;       // [16 or 32][C] tokens, rows C bytes apart
    const float* s;        // [tiles][blocks][16] their block scales
    const float* xmin;     // int4_asym: [tiles][blocks][16] their scales times their block sums
    int cols;              // C
    const uint8_t* next;   // the next slab's packed weights, asked for during the first pass; or null
    int next_step;         // bytes of them to ask for per pair of blocks
    const uint8_t* packed;  // 4-bit weights: the slab as packed, expanded into b during the first pass
    __m512i table;          // 4-bit weights: the 16 values of a code (int4 its levels, int4_asym 0-15)
};

// Blocks b .. b + n - 1 of a 4-bit slab (o.packed) -> format.h's int8 layout in o.b: each step's
// low nibbles become one int8 step, its high nibbles the next. (A pair of blocks is expanded while
// the pair before it is computed: a tile load waits for stores just made to reach the cache.) The
// packed blocks kExpandAhead on are asked for into L1: from L2, where the slab's prefetch left them,
// the expansion's loads cost about 8% of a prefill.
template <bool Unsigned>
inline void expand_blocks(const IntOperands& o, int b, int n) {
    const char* ahead = reinterpret_cast<const char*>(o.packed) + int64_t(b + kExpandAhead) * kPackedBlock;
    for (int line = 0; line < n * kPackedBlock; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    constexpr int steps = kBlock / 8;  // a step: 8 columns of 16 rows, 64 bytes packed
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const auto* in = reinterpret_cast<const __m512i*>(o.packed) + b * steps;
    auto* out = reinterpret_cast<__m512i*>(const_cast<uint8_t*>(o.b)) + 2 * b * steps;
    for (int step = 0; step < n * steps; ++step, ++in, out += 2) {
        const __m512i raw = _mm512_loadu_si512(in);
        const __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        if constexpr (Unsigned) {  // int4_asym: the codes as they are
            _mm512_storeu_si512(out, lo);
            _mm512_storeu_si512(out + 1, hi);
        } else {
            _mm512_storeu_si512(out, _mm512_shuffle_epi8(o.table, lo));
            _mm512_storeu_si512(out + 1, _mm512_shuffle_epi8(o.table, hi));
        }
    }
    operands_ready();
}

// Block b of the slab into B tile bt, then C tile c = A tile a (token tile t's block b) . B, stored
// into buf: int8 x int8, or int8 x unsigned codes (int4_asym). The tile intrinsics take register
// numbers as literals, hence the macros.
#define TANDEM_LOAD_B(bt) _tile_loadd(bt, o.b + int64_t(b) * kTileN * kBlock, kTileN * 4)
#define TANDEM_PRODUCT(c, a, bt, t)                                              \
    do {                                                                         \
        _tile_zero(c);                                                           \
        _tile_loadd(a, o.q + (int64_t(t) * (o.cols / kBlock) + b) * kTileM * kBlock, kBlock); \
        if constexpr (Unsigned) _tile_dpbsud(c, a, bt);                          \
        else _tile_dpbssd(c, a, bt);                                             \
        _tile_stored(c, buf[t], kTileN * 4);                                     \
    } while (0)

// Block b against Tiles token tiles in tile set Set (consecutive blocks alternate between the two,
// so one block's products run while the other's sums are scaled): set 0 takes B in tmm4 and C in
// tmm0 (tmm1 for a second token tile), set 1 B in tmm5 and C in tmm6 (tmm7); A is tmm2 (tmm3).
template <int Set, int Tiles, bool Unsigned>
inline void block_products(const IntOperands& o, int b, int32_t (*buf)[kTileM * kTileN]) {
    if constexpr (Set == 0) {
        TANDEM_LOAD_B(4);
        TANDEM_PRODUCT(0, 2, 4, 0);
        if constexpr (Tiles == 2) TANDEM_PRODUCT(1, 3, 4, 1);
    } else {
        TANDEM_LOAD_B(5);
        TANDEM_PRODUCT(6, 2, 5, 0);
        if constexpr (Tiles == 2) TANDEM_PRODUCT(7, 3, 5, 1);
    }
}
#undef TANDEM_PRODUCT
#undef TANDEM_LOAD_B

// The tile loads (and the int4 expansion's bursts) are not followed by the hardware prefetchers:
// while a slab is computed, the next slab's packed weights are asked for into L2, a little per pair
// of blocks, and an int8 slab's own blocks into L1 a little ahead of their loads.
constexpr int kNearAhead = 2048;
inline void prefetch_ahead(const IntOperands& o, int b, bool near) {
    const char* next = reinterpret_cast<const char*>(o.next) + int64_t(b / 2) * o.next_step;
    for (int line = 0; line < o.next_step; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    if (!near) return;
    const char* own = reinterpret_cast<const char*>(o.b) + int64_t(b) * kTileN * kBlock + kNearAhead;
    for (int line = 0; line < 2 * kTileN * kBlock; line += 64) _mm_prefetch(own + line, _MM_HINT_T0);
}

// 16 tokens' fp32 sums of one slab's 16 rows.
struct TileSums {
    __m512 row[kTileM];
};

// The tile store intrinsics do not tell the compiler that they write memory: this says buf has
// changed.
template <typename Buffer>
inline void stored(Buffer& buf) {
    __asm__ volatile("" : "+m"(buf));
}

// acc.row[m] += the int32 sums of block b in buf (token tile t), scaled as the SIMD kernels scale
// them (scale_block, then min_block for int4_asym): the same fp32 operations in the same order, so
// the bits agree. Partial: only rows m < rows (the tile's tokens; the rest are padding).
template <bool Asym, bool Partial, size_t... M>
inline void scale_product(const IntOperands& o, int b, int t, const int32_t* buf, TileSums& acc, int rows,
                          std::index_sequence<M...>) {
    const int64_t at = (int64_t(t) * (o.cols / kBlock) + b) * kTileM;
    const __m512 ws = _mm512_loadu_ps(o.ws + b * kTileN);
    const float* xs = o.s + at;
    ((Partial && int(M) >= rows ? void()
                                : void(acc.row[M] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf + M * kTileN)),
                                                                    _mm512_mul_ps(ws, _mm512_set1_ps(xs[M])), acc.row[M]))),
     ...);
    if constexpr (Asym) {
        const __m512 mins = _mm512_loadu_ps(o.wm + b * kTileN);
        const float* xmin = o.xmin + at;
        ((Partial && int(M) >= rows ? void() : void(acc.row[M] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xmin[M]), acc.row[M]))),
         ...);
    }
}

// Block b's sums of each token tile into acc; the last tile holds last_rows tokens.
template <int Tiles, bool Asym>
inline void scale_products(const IntOperands& o, int b, int32_t (*buf)[kTileM * kTileN], TileSums* acc, int last_rows) {
    constexpr auto rows = std::make_index_sequence<kTileM>{};
    for (int t = 0; t + 1 < Tiles; ++t) scale_product<Asym, false>(o, b, t, buf[t], acc[t], kTileM, rows);
    if (last_rows == kTileM) scale_product<Asym, false>(o, b, Tiles - 1, buf[Tiles - 1], acc[Tiles - 1], kTileM, rows);
    else scale_product<Asym, true>(o, b, Tiles - 1, buf[Tiles - 1], acc[Tiles - 1], last_rows, rows);
}

// y[m * ldy + n] = dot(slab row n, token m) for m < count (count <= 16 * Tiles): each block's B
// operand loaded once for both token tiles.
template <int Tiles, bool Unsigned>
void int_product(const IntOperands& o, int count, float* y, int ldy) {
    const int blocks = o.cols / kBlock, last_rows = count - (Tiles - 1) * kTileM;
    alignas(64) int32_t buf[2][Tiles][kTileM * kTileN];
    TileSums acc[Tiles];
    for (auto& tile : acc)
        for (auto& a : tile.row) a = _mm512_setzero_ps();
    if (o.packed) expand_blocks<Unsigned>(o, 0, std::min(2, blocks));  // then each pair expands the next one
    int b = 0;
    for (; b + 2 <= blocks; b += 2) {
        if (o.next) prefetch_ahead(o, b, !o.packed);
        if (o.packed) expand_blocks<Unsigned>(o, b + 2, std::min(2, blocks - b - 2));
        block_products<0, Tiles, Unsigned>(o, b, buf[0]);
        block_products<1, Tiles, Unsigned>(o, b + 1, buf[1]);
        stored(buf);
        scale_products<Tiles, Unsigned>(o, b, buf[0], acc, last_rows);
        scale_products<Tiles, Unsigned>(o, b + 1, buf[1], acc, last_rows);
    }
    if (b < blocks) {
        block_products<0, Tiles, Unsigned>(o, b, buf[0]);
        stored(buf);
        scale_products<Tiles, Unsigned>(o, b, buf[0], acc, last_rows);
    }
    for (int m = 0; m < count; ++m) _mm512_storeu_ps(y + int64_t(m) * ldy, acc[m / kTileM].row[m % kTileM]);
}

// int_product for the tokens of one chunk from m0: two token tiles at a time, then one.
template <bool Unsigned>
void chunk_products(IntOperands o, int m0, int count, float* y, int ldy) {
    const int blocks = o.cols / kBlock;
    const int8_t* q = o.q;
    const float* s = o.s;
    const float* xmin = o.xmin;
    for (; m0 < count; m0 += 2 * kTileM) {
        o.q = q + int64_t(m0) * o.cols;
        o.s = s + int64_t(m0) * blocks;
        o.xmin = xmin ? xmin + int64_t(m0) * blocks : nullptr;
        float* ym = y + int64_t(m0) * ldy;
        if (count - m0 > kTileM) int_product<2, Unsigned>(o, std::min(2 * kTileM, count - m0), ym, ldy);
        else int_product<1, Unsigned>(o, count - m0, ym, ldy);
        o.next = nullptr, o.packed = nullptr;
    }
}

void matmul_int_simd(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (w.format == Format::INT4) matmul_int4(w, r0, r1, x, n, y, ldy);
    else if (w.format == Format::INT4_ASYM) matmul_int4_asym(w, r0, r1, x, n, y, ldy);
    else matmul_int8(w, r0, r1, x, n, y, ldy);
}

// int8, int4 and int4_asym weights (4-bit tiles expanded to the int8 layout first: int4 to its
// levels, int4_asym to its codes); calls with few tokens go to the SIMD kernels. r0 and r1 are
// multiples of the 16-row tile (format.h), which is a slab.
void matmul_int_tiles(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    static_assert(kIntTileRows == kTileN, "an int tile is one B operand slab");
    if (n < kAmxMinTokens) return matmul_int_simd(w, r0, r1, x, n, y, ldy);
    const bool asym = w.format == Format::INT4_ASYM, expand = w.format != Format::INT8;
    const int cols = w.cols, blocks = cols / kBlock, tiles = kTokenChunk / kTileM;
    thread_local AlignedVector<int8_t> q, arranged;
    thread_local std::vector<float> s, ws, wm, st;
    thread_local std::vector<float> xmin;
    thread_local std::vector<int32_t> sums;
    thread_local AlignedVector<uint32_t> expanded;
    if (x.index) {
        q.resize(size_t(kTokenChunk) * cols);
        s.resize(size_t(kTokenChunk) * blocks);
        sums.resize(asym ? size_t(kTokenChunk) * blocks : 0);
    }
    arranged.resize(size_t(kTokenChunk) * cols);
    st.resize(size_t(kTokenChunk) * blocks);
    xmin.resize(asym ? size_t(kTokenChunk) * blocks : 0);
    ws.resize(size_t(kTileN) * blocks);
    wm.resize(asym ? size_t(kTileN) * blocks : 0);
    expanded.resize(expand ? size_t(blocks) * kBTileWords : 0);
    IntOperands o{nullptr, ws.data(), asym ? wm.data() : nullptr, nullptr, nullptr, nullptr, cols, nullptr, 0, nullptr, {}};
    if (expand)
        o.table = w.format == Format::INT4
                      ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)))
                      : _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    TileScope tile_unit(kIntTiles);
    for (int i0 = 0; i0 < n; i0 += kTokenChunk) {
        const int count = std::min(kTokenChunk, n - i0);
        // Rows as they lie where they are contiguous, else gathered; then arranged as A operands.
        const int8_t* tq = x.q + int64_t(i0) * cols;
        const float* ts = x.s + int64_t(i0) * blocks;
        const int32_t* tsums = asym ? x.sums + int64_t(i0) * blocks : nullptr;
        if (x.index) {
            gather_int8(x, i0, count, round_up(count, kTileM), q.data(), s.data(), sums.data());
            tq = q.data(), ts = s.data(), tsums = asym ? sums.data() : nullptr;
        }
        arrange_int8(tq, count, cols, arranged.data());
        tq = arranged.data();
        for (int t = 0; t * kTileM < count && t < tiles; ++t) {
            const size_t at = size_t(t) * kTileM * blocks;
            transpose_tokens(ts + at, asym ? tsums + at : nullptr, std::min(kTileM, count - t * kTileM), blocks, st.data() + at, asym ? xmin.data() + at : nullptr);
        }
        for (int r = r0; r < r1; r += kTileN) {
            o.b = expand ? reinterpret_cast<const uint8_t*>(expanded.data()) : int_block_at(w, r, 0);
            o.packed = expand ? int_block_at(w, r, 0) : nullptr;
            slab_floats(int_scale_at(w, r, 0), blocks, w.group / kBlock, ws.data());
            if (asym) slab_floats(int_min_at(w, r, 0), blocks, w.group / kBlock, wm.data());
            operands_ready();
            o.q = tq;
            o.s = st.data();
            o.xmin = asym ? xmin.data() : nullptr;
            o.next = int_block_at(w, r + kTileN, 0);
            o.next_step = int(2 * int_block_bytes(w.format));
            float* ym = y + int64_t(i0) * ldy + (r - r0);
            if (asym) chunk_products<true>(o, 0, count, ym, ldy);
            else chunk_products<false>(o, 0, count, ym, ldy);
        }
    }
}

// ---------------------------------------------------------------- bf16
// An arranged activation row (avx512_bf16's layout) holds, per 16 columns, their 16 hi then 16 lo
// bf16 parts: 64 bytes, which is one A tile row of 16 pairs, loaded as it lies. Its B operand is the
// slab's 16 columns twice ([16 column pairs: the 8 pairs, then the same 8][16 rows][2]), so one
// tdpbf16ps takes hi . w + lo . w. Blocks are transposed into that layout during the first pass.

// Block b (16 columns) of the bf16 slab whose 4-row groups start at group[0..3] -> dst [16][16]
// 32-bit words: dst[j][n] = word j % 8 (a column pair) of row n. An 8 x 8 transpose of words in
// each 256-bit half (rows 0-7 and 8-15), then the halves interleaved 128 bits at a time.
void transpose_block(const uint8_t* const* group, int b, uint32_t* dst) {
    __m512i z[8];
    for (int k = 0; k < 8; ++k) {  // z[k] = [row k | row k + 8]
        const int64_t at = (int64_t(b) * kTileRows + k % kTileRows) * kBlockBytes;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group[k / kTileRows] + at));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group[2 + k / kTileRows] + at));
        z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    __m512i t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]);
    }
    for (int k = 0; k < 8; k += 4)
        for (int h = 0; h < 2; ++h) {
            u[k + 2 * h] = _mm512_unpacklo_epi64(t[k + h], t[k + h + 2]);
            u[k + 2 * h + 1] = _mm512_unpackhi_epi64(t[k + h], t[k + h + 2]);
        }
    // u[k] (k < 4) holds word k (low 128 bits of each half) and k + 4 (high) of rows 0-3 / 8-11;
    // u[k + 4] the same of rows 4-7 / 12-15.
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    auto* out = reinterpret_cast<__m512i*>(dst);
    for (int k = 0; k < 4; ++k) {
        const __m512i word_k = _mm512_permutex2var_epi64(u[k], low, u[k + 4]);
        const __m512i word_k4 = _mm512_permutex2var_epi64(u[k], high, u[k + 4]);
        _mm512_storeu_si512(out + k, word_k);
        _mm512_storeu_si512(out + k + 8, word_k);
        _mm512_storeu_si512(out + k + 4, word_k4);
        _mm512_storeu_si512(out + k + 12, word_k4);
    }
}

// One or two bf16 slabs (16 weight rows each) against one or two tiles of 16 tokens.
struct Bf16Operands {
    uint32_t* b[2];                // per slab [blocks][16][16] B operands
    const uint8_t* group[2][4];    // per slab its 4-row groups as packed, transposed into b during the first pass; or null
    const float* x;                // [1 or 2 token tiles][blocks][16 tokens][16] A operands
    int cols;                      // C
};

// C tiles: tmm0/1 token tile 0 against slab 0/1, tmm2/3 token tile 1; A tmm4 (token tile 0), tmm5
// (token tile 1); B tmm6 (slab 0), tmm7 (slab 1). Each loaded operand meets two of the other kind,
// and the four sums are independent chains.
constexpr int kATile = kTileM * kChunk;  // floats of one token tile's A operand of a block
constexpr int kBTile = kTileN * kTileN;  // words of one slab's B operand of a block
constexpr TileConfig kBf16Tiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// The first pass transposes the slabs' blocks into their B operands kAhead blocks before their
// products: a tile load does not take its bytes from pending stores, it waits for them to land.
constexpr int kAhead = 2;

template <int Slabs>
inline void transpose_into(const Bf16Operands& o, int b) {
    if (!o.group[0][0] || b >= o.cols / kChunk) return;
    for (int s = 0; s < Slabs; ++s) transpose_block(o.group[s], b, o.b[s] + int64_t(b) * kBTile);
    operands_ready();
}

template <int Slabs, int Tiles>
inline void bf16_block(const Bf16Operands& o, int b) {
    transpose_into<Slabs>(o, b + kAhead);
    _tile_loadd(6, o.b[0] + int64_t(b) * kBTile, kTileN * 4);
    _tile_loadd(4, o.x + int64_t(b) * kATile, kChunk * sizeof(float));
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (Slabs == 2) {
        _tile_loadd(7, o.b[1] + int64_t(b) * kBTile, kTileN * 4);
        _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (Tiles == 2) {
        _tile_loadd(5, o.x + int64_t(o.cols) * kTileM + int64_t(b) * kATile, kChunk * sizeof(float));
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (Slabs == 2) _tile_dpbf16ps(3, 5, 7);
    }
}

// y[m * ldy + 16 * s + n] = dot(slab s row n, token m) for m < count (count <= 16 * Tiles).
template <int Slabs, int Tiles>
void bf16_product(const Bf16Operands& o, int count, float* y, int ldy) {
    const int blocks = o.cols / kChunk;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int b = 0; b < kAhead; ++b) transpose_into<Slabs>(o, b);
    for (int b = 0; b < blocks; ++b) bf16_block<Slabs, Tiles>(o, b);
    alignas(64) float sums[4][kTileM * kTileN];  // [token tile][slab]
    _tile_stored(0, sums[0], kTileN * 4);
    if constexpr (Slabs == 2) _tile_stored(1, sums[1], kTileN * 4);
    if constexpr (Tiles == 2) {
        _tile_stored(2, sums[2], kTileN * 4);
        if constexpr (Slabs == 2) _tile_stored(3, sums[3], kTileN * 4);
    }
    operands_ready();
    for (int m = 0; m < count; ++m)
        for (int s = 0; s < Slabs; ++s)
            _mm512_storeu_ps(y + int64_t(m) * ldy + s * kTileN, _mm512_load_ps(sums[2 * (m / kTileM) + s] + (m % kTileM) * kTileN));
}

// Tokens i0 .. i0 + count - 1 of the arranged rows as A operands, dst [tiles][blocks][16][16]:
// each tile's rows 64 bytes apart, where rows C floats apart would all fall in one L1 set. Rows past
// count keep what an earlier call left there (zeros at first): their products are dropped.
void arrange_tiles(const Activations& x, int i0, int count, float* dst) {
    const int blocks = x.cols / kChunk;
    for (int t = 0; t * kTileM < count; ++t)
        for (int m = 0; m < std::min(kTileM, count - t * kTileM); ++m) {
            const int i = t * kTileM + m;
            float* out = dst + (int64_t(t) * blocks * kTileM + m) * kChunk;
            const float* row = x.f + x.row(i0 + i) * x.cols;
            for (int b = 0; b < blocks; ++b)
                _mm512_storeu_ps(out + int64_t(b) * kATile, _mm512_loadu_ps(row + b * kChunk));
        }
}

// Slabs slabs from row r against count arranged tokens (A operands), two token tiles at a time.
template <int Slabs>
void bf16_slabs(const Matrix& w, int r, const float* tokens, int count, uint32_t* slab, float* y, int ldy) {
    const int cols = w.cols;
    Bf16Operands o{{slab, slab + int64_t(cols / kChunk) * kBTile}, {}, nullptr, cols};
    for (int s = 0; s < Slabs; ++s)
        for (int g = 0; g < kTileN / kTileRows; ++g) o.group[s][g] = block_at(w, r + s * kTileN + g * kTileRows, 0);
    for (int m0 = 0; m0 < count; m0 += 2 * kTileM) {
        o.x = tokens + int64_t(m0) * cols;
        float* ym = y + int64_t(m0) * ldy;
        if (count - m0 > kTileM) bf16_product<Slabs, 2>(o, std::min(2 * kTileM, count - m0), ym, ldy);
        else bf16_product<Slabs, 1>(o, count - m0, ym, ldy);
        o.group[0][0] = nullptr;
    }
}

// bf16 weights on the tiles however few the tokens (a tile's rows past n are dropped), so a
// token's bits do not depend on n; rows past the last whole slab go to
// the SIMD kernel, as they do at any n.
void bf16_tiles(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n == 0) return;
    const int cols = w.cols, slab_end = r0 + (r1 - r0) / kTileN * kTileN;
    thread_local AlignedVector<float> tokens;
    thread_local AlignedVector<uint32_t> slab;
    tokens.resize(size_t(kTokenChunk) * cols, 0.f);
    slab.resize(2 * size_t(cols / kChunk) * kBTile);
    {
        TileScope tile_unit(kBf16Tiles);
        for (int i0 = 0; i0 < n; i0 += kTokenChunk) {
            const int count = std::min(kTokenChunk, n - i0);
            arrange_tiles(x, i0, count, tokens.data());
            operands_ready();
            for (int r = r0; r < slab_end; r += 2 * kTileN) {
                float* yr = y + int64_t(i0) * ldy + (r - r0);
                if (slab_end - r >= 2 * kTileN) bf16_slabs<2>(w, r, tokens.data(), count, slab.data(), yr, ldy);
                else bf16_slabs<1>(w, r, tokens.data(), count, slab.data(), yr, ldy);
            }
        }
    }
    if (slab_end < r1) matmul_bf16(w, slab_end, r1, x, n, y + (slab_end - r0), ldy);
}

// The MoE's bf16 products: calls with few tokens (decode) on the SIMD kernel, the rest on the tiles.
void matmul_bf16_tiles(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n < kAmxMinTokens) return matmul_bf16(w, r0, r1, x, n, y, ldy);
    bf16_tiles(w, r0, r1, x, n, y, ldy);
}

}  // namespace

const KernelTable& amx_kernels() {
    static const KernelTable table = [] {
        KernelTable t = simd_table("amx");
        t.matmul[int(Format::BF16)] = matmul_bf16_tiles;
        t.matmul[int(Format::INT8)] = matmul_int_tiles;
        t.matmul[int(Format::INT4)] = matmul_int_tiles;
        t.matmul[int(Format::INT4_ASYM)] = matmul_int_tiles;
        t.invariant[int(Format::BF16)] = bf16_tiles;
        return t;
    }();
    return table;
}

}  // namespace tandem
