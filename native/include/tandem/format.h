// Packed routed-expert layers: one flat buffer = a 128-byte header, then per expert the w13 matrix
// ([2I, D]: gate rows, then up rows) and the w2 matrix ([D, I]), each section 64-byte aligned, then
// (a biased layer) every expert's fp32 biases: b13 [E][2I], then b2 [E][D].
// D hidden size, I expert intermediate size, E experts, G group size (a multiple of 32).
// bf16: a matrix of R rows x C columns (multiples of 16) is stored in tiles of 4 rows, 16 columns
//   (32 bytes) of a row at a time ([R/4][C/16][4 rows][16 uint16]), so the 4 rows a kernel computes
//   together are one sequential stream.
// int8 and int4: R and C are multiples of 32 (of 64 for int4), w = scale * q with one fp16 scale per
//   G columns of a row. Values are stored in tiles of 16 rows, 32 columns at a time, each 32-column
//   block as steps of a few columns with the 16 rows' 4 bytes side by side
//   ([R/16][C/32][steps][16 rows][4 bytes]), so one 32-byte load holds 8 rows' next columns and a
//   token's matching columns are one broadcast (the kernels keep a row's sums in a vector lane, and
//   the block is AMX's int8 B operand as it is):
//     int8: 8 steps of 4 columns, symmetric int8 q;
//     int4: 4 steps of 8 columns; byte j of a row's 4 holds column j in its low nibble and column
//           j + 4 in its high nibble, an index into the layer's 16 int8 levels (its header's
//           `levels`): w = scale * levels[q]. Quantizing float weights uses kInt4Levels (non-uniform,
//           as llama.cpp's IQ4_NL); a checkpoint already in 16 levels per group (uniform int4 with
//           a scale, Q4_0, IQ4_NL) keeps its own, so it imports without a second rounding.
//     int4_asym: int4's tiles of 4-bit codes q in 0-15 (no levels): w = scale * q + min, with an fp16
//           scale and an fp16 minimum per group (llama.cpp's Q4_1; Q4_K's sub-blocks).
//   The scales follow the values, tile by tile: [R/16][C/G][16 rows] fp16; int4_asym's minimums
//   follow the scales in the same order.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tandem {

enum class Format : uint32_t { BF16 = 0, INT8 = 1, INT4 = 2, INT4_ASYM = 3 };
constexpr int kFormats = 4;
constexpr bool four_bit(Format f) { return f == Format::INT4 || f == Format::INT4_ASYM; }
constexpr int kBlock = 32;  // activation quantization block, and the int8/int4 weight block
constexpr int kTileRows = 4;       // rows of a bf16 tile
constexpr int kIntTileRows = 16;   // rows of an int8 / int4 tile
constexpr uint32_t kLayoutVersion = 4;
// Levels of the int4 format, denser near zero where most weights lie: about 12% less error than
// 16 evenly spaced levels on normally distributed weights, at the same size and speed.
constexpr int8_t kInt4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr char kMagic[8] = {'T', 'N', 'D', 'M', 'O', 'E', '0', '1'};

struct Header {
    char magic[8];
    uint32_t version;
    uint32_t format;
    uint32_t group_size;
    uint32_t num_experts;
    uint32_t hidden;
    uint32_t intermediate;
    uint64_t total_bytes;
    int8_t levels[16];  // int4: the value of each 4-bit code (zeros otherwise)
    uint32_t activation;  // Activation
    uint32_t biased;      // 1: per-expert fp32 biases follow the experts (b13 [E][2I], then b2 [E][D])
    float alpha, limit;   // Activation::SWIGLU_OAI's parameters
    uint8_t reserved[56];
};
static_assert(sizeof(Header) == 128, "header is 128 bytes");

// The experts' gated activation of gate g and up u: SILU silu(g) * u; SWIGLU_OAI (gpt-oss)
// (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit).
enum class Activation : uint32_t { SILU = 0, SWIGLU_OAI = 1 };

// A read-only view of one packed matrix.
struct Matrix {
    const uint8_t* data = nullptr;     // quantized values (or bf16)
    const uint16_t* scales = nullptr;  // fp16 [rows][cols / group]; null for bf16
    const uint16_t* mins = nullptr;    // int4_asym: fp16 [rows][cols / group], as the scales
    const int8_t* levels = nullptr;    // int4: the layer's 16 levels (the header's)
    int rows = 0, cols = 0, group = 0;
    Format format = Format::BF16;
};

size_t align64(size_t n);
size_t matrix_bytes(Format f, int rows, int cols, int group);
size_t expert_bytes(Format f, int hidden, int intermediate, int group);
size_t layer_bytes(Format f, int experts, int hidden, int intermediate, int group, bool biased = false);
size_t bias_bytes(int experts, int hidden, int intermediate);  // the biases' region, 64-byte aligned
Matrix matrix_at(const uint8_t* base, Format f, int rows, int cols, int group, const int8_t* levels);
// What a matrix's columns (and the hidden and intermediate sizes) must be a multiple of: 16 (bf16,
// its block width), 32 (int8), 64 (int4 and int4_asym, a whole number of bytes per tile row); a
// shift, so the bf16 address arithmetic has no division in it.
constexpr int block_shift(Format f) { return f == Format::BF16 ? 4 : f == Format::INT8 ? 5 : 6; }
constexpr int block_cols(Format f) { return 1 << block_shift(f); }
static_assert(block_cols(Format::BF16) == 16 && block_cols(Format::INT8) == kBlock &&
              block_cols(Format::INT4) == 2 * kBlock && block_cols(Format::INT4_ASYM) == 2 * kBlock);
constexpr int kBlockBytes = 32;  // bytes per bf16 block, and per step of an int tile's 8 rows
// Address of block b (of block_cols columns) of row r, bf16.
inline const uint8_t* block_at(const Matrix& m, int r, int b) {
    const int blocks = m.cols >> block_shift(m.format);
    return m.data + ((int64_t(r / kTileRows) * blocks + b) * kTileRows + r % kTileRows) * kBlockBytes;
}

// int8 / int4: bytes of one 32-column block of a 16-row tile (512 and 256), its columns per step
// (4 and 8), and the address of block b of the tile holding row r.
constexpr int int_block_bytes(Format f) { return f == Format::INT8 ? 512 : 256; }
constexpr int int_step_cols(Format f) { return f == Format::INT8 ? 4 : 8; }
inline const uint8_t* int_block_at(const Matrix& m, int r, int b) {
    return m.data + (int64_t(r / kIntTileRows) * (m.cols / kBlock) + b) * int_block_bytes(m.format);
}
// The byte holding column c of row r (int4: in its low nibble when c % 8 < 4, else its high one).
inline const uint8_t* int_byte_at(const Matrix& m, int r, int c) {
    const int step = int_step_cols(m.format);
    return int_block_at(m, r, c / kBlock) + ((c % kBlock) / step * kIntTileRows + r % kIntTileRows) * 4 + c % 4;
}
// The fp16 scale of group g of row r (and, at the same offset from m.mins, its int4_asym minimum).
inline int64_t int_group_index(const Matrix& m, int r, int g) {
    return (int64_t(r / kIntTileRows) * (m.cols / m.group) + g) * kIntTileRows + r % kIntTileRows;
}
inline const uint16_t* int_scale_at(const Matrix& m, int r, int g) { return m.scales + int_group_index(m, r, g); }
inline const uint16_t* int_min_at(const Matrix& m, int r, int g) { return m.mins + int_group_index(m, r, g); }
const char* format_name(Format f);

// fp16 / bf16 <-> fp32 conversions used by packing and the generic kernels.
float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace tandem
