#include "tandem/format.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace tandem {

size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

static size_t values_bytes(Format f, int rows, int cols) {
    size_t n = size_t(rows) * size_t(cols);
    switch (f) {
        case Format::BF16: return n * 2;
        case Format::INT8: return n;
        case Format::INT4:
        case Format::INT4_ASYM: return n / 2;
    }
    throw std::invalid_argument("unknown format");
}

static size_t scales_bytes(Format f, int rows, int cols, int group) {
    return f == Format::BF16 ? 0 : size_t(rows) * size_t(cols / group) * 2;
}

size_t matrix_bytes(Format f, int rows, int cols, int group) {
    const size_t scales = align64(scales_bytes(f, rows, cols, group));
    return align64(values_bytes(f, rows, cols)) + (f == Format::INT4_ASYM ? 2 * scales : scales);
}

size_t expert_bytes(Format f, int hidden, int intermediate, int group) {
    return matrix_bytes(f, 2 * intermediate, hidden, group) + matrix_bytes(f, hidden, intermediate, group);
}

size_t bias_bytes(int experts, int hidden, int intermediate) {
    return align64(size_t(experts) * (2 * size_t(intermediate) + size_t(hidden)) * sizeof(float));
}

size_t layer_bytes(Format f, int experts, int hidden, int intermediate, int group, bool biased) {
    return sizeof(Header) + size_t(experts) * expert_bytes(f, hidden, intermediate, group) +
           (biased ? bias_bytes(experts, hidden, intermediate) : 0);
}

Matrix matrix_at(const uint8_t* base, Format f, int rows, int cols, int group, const int8_t* levels) {
    Matrix m;
    m.data = base;
    m.levels = f == Format::INT4 ? levels : nullptr;
    m.rows = rows;
    m.cols = cols;
    m.group = group;
    m.format = f;
    if (f != Format::BF16) m.scales = reinterpret_cast<const uint16_t*>(base + align64(values_bytes(f, rows, cols)));
    if (f == Format::INT4_ASYM)
        m.mins = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(m.scales) +
                                                   align64(scales_bytes(f, rows, cols, group)));
    return m;
}

const char* format_name(Format f) {
    switch (f) {
        case Format::BF16: return "bf16";
        case Format::INT8: return "int8";
        case Format::INT4: return "int4";
        case Format::INT4_ASYM: return "int4_asym";
    }
    return "?";
}

float fp16_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400));
        bits = sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint16_t sign = uint16_t((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0);  // inf / nan
    if (ax >= 0x477ff000u) return sign | 0x7c00;  // rounds past the largest fp16: inf
    if (ax < 0x38800000u) {  // subnormal or zero in fp16: round to a multiple of 2^-24
        float a;
        std::memcpy(&a, &ax, 4);
        return sign | uint16_t(std::nearbyint(a * 16777216.0f));
    }
    uint32_t mant = ax & 0x7fffff, exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // round to nearest even
    return sign | uint16_t(h);
}

float bf16_to_float(uint16_t b) {
    uint32_t bits = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);  // quiet nan
    return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

}  // namespace tandem
