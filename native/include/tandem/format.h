// Packed routed-expert layers: one flat buffer = a 64-byte header, then per expert the w13 matrix
// ([2I, D]: gate rows, then up rows) and the w2 matrix ([D, I]), each section 64-byte aligned.
// A matrix of R rows x C columns is stored row-major as
//   bf16: uint16 [R][C]
//   int8: int8 [R][C], then fp16 scales [R][C/G]        (symmetric, q = round(w / s))
//   int4: uint8 [R][C/2], then fp16 scales [R][C/G]     (per 32-column block: 16 bytes, byte j holds
//         column j in its low nibble and column j+16 in its high nibble; a nibble indexes the 16
//         non-uniform levels of kInt4Levels, as llama.cpp's IQ4_NL, so w = scale * kInt4Levels[q])
// D hidden size, I expert intermediate size, E experts, G group size (a multiple of 32).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tandem {

enum class Format : uint32_t { BF16 = 0, INT8 = 1, INT4 = 2 };
constexpr int kFormats = 3;
constexpr int kBlock = 32;  // activation quantization block and int4 nibble block
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
const char* format_name(Format f);

// fp16 / bf16 <-> fp32 conversions used by packing and the generic kernels.
float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace tandem
