// Packed routed-expert layers: one flat buffer = a 64-byte header, then per expert the w13 matrix
// ([2I, D]: gate rows, then up rows) and the w2 matrix ([D, I]), each section 64-byte aligned.
// A matrix of R rows x C columns (both multiples of 32; of 64 for int4) is cut into 32-byte blocks:
// 16 columns of bf16, 32 of int8 or 64 of int4. Values are stored in tiles of 4 rows, block by
// block ([R/4][C/block][4 rows][block bytes]), so the 4 rows a kernel computes together are one
// sequential stream; then come the fp16 scales, row-major [R][C/G].
//   bf16: a block is 16 uint16.
//   int8: a block is 32 int8, symmetric: w = scale * q.
//   int4: a block is two 32-column halves of 16 bytes; byte j of a half holds its column j in the
//         low nibble and column j+16 in the high nibble, so one 32-byte load unpacks into two
//         registers of 32 weights. A nibble indexes the 16 non-uniform levels of kInt4Levels (as
//         llama.cpp's IQ4_NL), so w = scale * kInt4Levels[q].
// D hidden size, I expert intermediate size, E experts, G group size (a multiple of 32).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tandem {

enum class Format : uint32_t { BF16 = 0, INT8 = 1, INT4 = 2 };
constexpr int kFormats = 3;
constexpr int kBlock = 32;  // activation quantization block, and the int8/int4 weight block
constexpr int kTileRows = 4;
constexpr uint32_t kLayoutVersion = 1;
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
    uint8_t reserved[24];
};
static_assert(sizeof(Header) == 64, "header is 64 bytes");

// A read-only view of one packed matrix.
struct Matrix {
    const uint8_t* data = nullptr;     // quantized values (or bf16)
    const uint16_t* scales = nullptr;  // fp16 [rows][cols / group]; null for bf16
    int rows = 0, cols = 0, group = 0;
    Format format = Format::BF16;
};

size_t align64(size_t n);
size_t matrix_bytes(Format f, int rows, int cols, int group);
size_t expert_bytes(Format f, int hidden, int intermediate, int group);
size_t layer_bytes(Format f, int experts, int hidden, int intermediate, int group);
Matrix matrix_at(const uint8_t* base, Format f, int rows, int cols, int group);
// Columns per block: 16 (bf16), 32 (int8), 64 (int4); a shift, so the kernels' address arithmetic
// has no division in it.
constexpr int block_shift(Format f) { return 4 + int(f); }
constexpr int block_cols(Format f) { return 1 << block_shift(f); }
static_assert(block_cols(Format::BF16) == 16 && block_cols(Format::INT8) == kBlock &&
              block_cols(Format::INT4) == 2 * kBlock);
constexpr int kBlockBytes = 32;  // bytes per block, every format
// Address of block b (of block_cols columns) of row r.
inline const uint8_t* block_at(const Matrix& m, int r, int b) {
    const int blocks = m.cols >> block_shift(m.format);
    return m.data + ((int64_t(r / kTileRows) * blocks + b) * kTileRows + r % kTileRows) * kBlockBytes;
}
const char* format_name(Format f);

// fp16 / bf16 <-> fp32 conversions used by packing and the generic kernels.
float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace tandem
