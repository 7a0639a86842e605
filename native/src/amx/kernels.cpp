// AMX kernels: the prefill matrix products on the tile unit. int8 and int4 weights use tdpbssd
// (int8 x int8 -> int32), one 32-column block per product, scaled into fp32 accumulators after
// each; bf16 weights use tdpbf16ps against the hi and lo bf16 parts of x (as avx512_bf16 splits
// them), accumulating in the tile. Under kAmxMinTokens tokens, for int4_asym weights, and for
// everything besides the matrix products, the shared SIMD kernels run, compiled here as in the
// avx512_bf16 variant (int4_asym on the tiles, its minimums added per block after each product,
// took 165 ms against the SIMD kernel's 93 for a 512-token Qwen3-30B layer on a 2-core Xeon).
// int8 weights are B operands as packed (format.h: a 32-column block of a 16-row tile is the 16
// rows' 4-byte column groups interleaved); int4 tiles are expanded to that, and bf16 16-row slabs
// repacked to it, block by block, into a per-thread buffer.
// M tokens per tile (16), N weight rows per tile (16).
#include <cstring>

#include "simd/kernels_impl.h"

#if !defined(TANDEM_SIMD_BF16)
#error "the AMX kernels read the activation layout of the avx512_bf16 kernels"
#endif

namespace tandem {
namespace {

constexpr int kTileM = 16;                   // tokens per tile
constexpr int kTileN = 16;                   // weight rows per tile
constexpr int kWords = kBlockBytes / 4;      // 4-byte column groups per block
constexpr int kBTileWords = kWords * kTileN;  // one block of a slab, repacked: [8 words][16 rows]
constexpr int kAmxMinTokens = 16;            // fewer tokens: the SIMD kernels
constexpr int kTokenChunk = 64;              // tokens gathered at once; each slab is repacked once per chunk

// The 64-byte operand of ldtilecfg, palette 1: tile t holds rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// int8: tmm0 C [16 tokens][16 rows] int32 += tmm1 A [16 tokens][32 columns] int8
//       . tmm2 B [8 column groups][16 rows][4 columns] int8.
constexpr TileConfig kInt8Tiles = {1, 0, {}, {kTileN * 4, kBlock, kTileN * 4}, {kTileM, kTileM, kWords}};
// bf16: tmm0 C [16 tokens][16 rows] fp32 += tmm1 A hi, tmm2 A lo [16 tokens][32 columns] bf16
//       . tmm3 B [16 column pairs][16 rows][2 columns] bf16.
constexpr TileConfig kBf16Tiles = {1, 0, {}, {kTileN * 4, 64, 64, kTileN * 4}, {kTileM, kTileM, kTileM, 2 * kWords}};

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

// bf16 rows r .. r + 15 as B operands: dst[b][j][n] = 32-bit column group j of block b of row
// r + n. group[g] points at rows r + 4g .. r + 4g + 3 in the packed layout ([blocks][4 rows][32 bytes]).
void repack_slab(const uint8_t* const* group, int blocks, uint32_t* dst) {
    for (int b = 0; b < blocks; ++b, dst += kBTileWords)
        for (int n = 0; n < kTileN; ++n) {
            uint32_t words[kWords];
            std::memcpy(words, group[n / kTileRows] + (int64_t(b) * kTileRows + n % kTileRows) * kBlockBytes, kBlockBytes);
            for (int j = 0; j < kWords; ++j) dst[j * kTileN + n] = words[j];
        }
}

// ---------------------------------------------------------------- int8 and int4

// Tokens i0 .. i0 + count - 1 as contiguous rows q [padded][C], s [padded][C / 32]; zero rows after.
void gather_int8(const Activations& x, int i0, int count, int padded, int8_t* q, float* s) {
    const int blocks = x.cols / kBlock;
    for (int m = 0; m < padded; ++m, q += x.cols, s += blocks) {
        if (m >= count) {
            std::fill(q, q + x.cols, int8_t(0));
            std::fill(s, s + blocks, 0.f);
            continue;
        }
        std::copy(x.q + x.row(i0 + m) * x.cols, x.q + (x.row(i0 + m) + 1) * x.cols, q);
        std::copy(x.s + x.row(i0 + m) * blocks, x.s + (x.row(i0 + m) + 1) * blocks, s);
    }
}

// ws[g][n] = the scale of group g in row r + n (stored in that order, format.h).
void slab_scales(const Matrix& w, int r, float* ws) {
    const uint16_t* half = int_scale_at(w, r, 0);
    for (int i = 0; i < w.cols / w.group * kTileN; ++i) ws[i] = _cvtsh_ss(half[i]);
}

// y[m * ldy + n] = dot(slab row n, token m) for m < count, from 16 gathered tokens (q, s), the
// repacked slab and its scales: per block, one tile product, then its int32 sums scaled into fp32.
void int8_product(const uint32_t* slab, const float* ws, int per_group, const int8_t* q, const float* s, int cols,
                  int count, float* y, int ldy) {
    const int blocks = cols / kBlock;
    float acc[kTileM][kTileN] = {};
    alignas(64) int32_t dot[kTileM][kTileN];
    for (int b = 0; b < blocks; ++b) {
        _tile_zero(0);
        _tile_loadd(1, q + b * kBlock, cols);
        _tile_loadd(2, slab + int64_t(b) * kBTileWords, kTileN * 4);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, dot, kTileN * 4);
        const float* wsb = ws + (b / per_group) * kTileN;
        for (int m = 0; m < kTileM; ++m) {
            const float xs = s[int64_t(m) * blocks + b];
            for (int n = 0; n < kTileN; ++n) acc[m][n] += float(dot[m][n]) * (wsb[n] * xs);
        }
    }
    for (int m = 0; m < count; ++m) std::copy(acc[m], acc[m] + kTileN, y + int64_t(m) * ldy);
}

void matmul_int_simd(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (w.format == Format::INT4) matmul_int4(w, r0, r1, x, n, y, ldy);
    else matmul_int8(w, r0, r1, x, n, y, ldy);
}

// int8 or int4 weights (int4 tiles expanded to int8 first); calls with few tokens go to the SIMD
// kernels. r0 and r1 are multiples of the 16-row tile (format.h), which is a slab.
void matmul_int_tiles(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    static_assert(kIntTileRows == kTileN, "an int tile is one B operand slab");
    if (n < kAmxMinTokens) return matmul_int_simd(w, r0, r1, x, n, y, ldy);
    const bool int4 = w.format == Format::INT4;
    const int cols = w.cols, blocks = cols / kBlock;
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> s, ws;
    thread_local std::vector<uint32_t> expanded;
    q.resize(size_t(kTokenChunk) * cols);
    s.resize(size_t(kTokenChunk) * blocks);
    ws.resize(size_t(kTileN) * (cols / w.group));
    expanded.resize(int4 ? size_t(blocks) * kBTileWords : 0);
    TileScope tiles(kInt8Tiles);
    for (int i0 = 0; i0 < n; i0 += kTokenChunk) {
        const int count = std::min(kTokenChunk, n - i0);
        gather_int8(x, i0, count, round_up(count, kTileM), q.data(), s.data());
        for (int r = r0; r < r1; r += kTileN) {
            const uint32_t* slab = reinterpret_cast<const uint32_t*>(int_block_at(w, r, 0));
            if (int4) {
                for (int b = 0; b < blocks; ++b)
                    expand_int4_block(w, r, b, reinterpret_cast<uint8_t*>(expanded.data() + size_t(b) * kBTileWords));
                slab = expanded.data();
            }
            slab_scales(w, r, ws.data());
            operands_ready();
            for (int m0 = 0; m0 < count; m0 += kTileM)
                int8_product(slab, ws.data(), w.group / kBlock, q.data() + size_t(m0) * cols,
                             s.data() + size_t(m0) * blocks, cols, std::min(kTileM, count - m0),
                             y + int64_t(i0 + m0) * ldy + (r - r0), ldy);
        }
    }
}

// ---------------------------------------------------------------- bf16

// Tokens i0 .. i0 + count - 1 (arranged: per 16 columns, 16 hi then 16 lo bf16) as contiguous rows
// hi [padded][C] and lo [padded][C]; zero rows after.
void gather_bf16(const Activations& x, int i0, int count, int padded, uint16_t* hi, uint16_t* lo) {
    for (int m = 0; m < padded; ++m, hi += x.cols, lo += x.cols) {
        if (m >= count) {
            std::fill(hi, hi + x.cols, uint16_t(0));
            std::fill(lo, lo + x.cols, uint16_t(0));
            continue;
        }
        const float* xm = x.f + x.row(i0 + m) * x.cols;
        for (int c = 0; c < x.cols; c += kChunk) {
            std::memcpy(hi + c, xm + c, kChunk * sizeof(uint16_t));
            std::memcpy(lo + c, xm + c + kChunk / 2, kChunk * sizeof(uint16_t));
        }
    }
}

// y[m * ldy + n] = dot(slab row n, token m) for m < count, from 16 gathered tokens (hi, lo) and the
// repacked slab: 32 columns per pair of tile products, accumulated in the tile.
void bf16_product(const uint32_t* slab, const uint16_t* hi, const uint16_t* lo, int cols, int count, float* y, int ldy) {
    alignas(64) float out[kTileM][kTileN];
    _tile_zero(0);
    for (int c = 0; c < cols; c += 2 * kChunk) {
        _tile_loadd(1, hi + c, cols * sizeof(uint16_t));
        _tile_loadd(2, lo + c, cols * sizeof(uint16_t));
        _tile_loadd(3, slab + int64_t(c / kChunk) * kBTileWords, kTileN * 4);
        _tile_dpbf16ps(0, 1, 3);
        _tile_dpbf16ps(0, 2, 3);
    }
    _tile_stored(0, out, kTileN * 4);
    for (int m = 0; m < count; ++m) std::copy(out[m], out[m] + kTileN, y + int64_t(m) * ldy);
}

// bf16 weights with C a multiple of 32; rows past the last whole slab, calls with few tokens and
// other widths go to the SIMD kernel.
void matmul_bf16_tiles(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy) {
    if (n < kAmxMinTokens || w.cols % (2 * kChunk)) return matmul_bf16(w, r0, r1, x, n, y, ldy);
    const int cols = w.cols, slab_end = r0 + (r1 - r0) / kTileN * kTileN;
    thread_local std::vector<uint16_t> hi, lo;
    thread_local std::vector<uint32_t> slab;
    hi.resize(size_t(kTokenChunk) * cols);
    lo.resize(size_t(kTokenChunk) * cols);
    slab.resize(size_t(cols / kChunk) * kBTileWords);
    {
        TileScope tiles(kBf16Tiles);
        for (int i0 = 0; i0 < n; i0 += kTokenChunk) {
            const int count = std::min(kTokenChunk, n - i0);
            gather_bf16(x, i0, count, round_up(count, kTileM), hi.data(), lo.data());
            for (int r = r0; r < slab_end; r += kTileN) {
                const uint8_t* group[kTileN / kTileRows];
                for (int g = 0; g < kTileN / kTileRows; ++g) group[g] = block_at(w, r + g * kTileRows, 0);
                repack_slab(group, cols / kChunk, slab.data());
                operands_ready();
                for (int m0 = 0; m0 < count; m0 += kTileM)
                    bf16_product(slab.data(), hi.data() + size_t(m0) * cols, lo.data() + size_t(m0) * cols, cols,
                                 std::min(kTileM, count - m0), y + int64_t(i0 + m0) * ldy + (r - r0), ldy);
            }
        }
    }
    if (slab_end < r1) matmul_bf16(w, slab_end, r1, x, n, y + (slab_end - r0), ldy);
}

}  // namespace

const KernelTable& amx_kernels() {
    static const KernelTable table = [] {
        KernelTable t = simd_table("amx");
        t.matmul[int(Format::BF16)] = matmul_bf16_tiles;
        t.matmul[int(Format::INT8)] = matmul_int_tiles;
        t.matmul[int(Format::INT4)] = matmul_int_tiles;
        return t;
    }();
    return table;
}

}  // namespace tandem
