// Copies of layer tensors (tens of kilobytes) between caller buffers and a shared-memory segment.
#pragma once
#include <emmintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tandem {

// memcpy with 16-byte loads and stores (SSE2, every x86-64). glibc's memcpy moves blocks of this
// size with `rep movsb`, which on AMD Zen 3 (the bench machine) takes about 20x longer when the
// destination lies 1-31 bytes past the source modulo 4 KiB: a 28 KB tensor took 12.7-15.8 us
// instead of 0.6-0.7, depending only on where malloc and the segment put the two buffers.
inline void copy_bytes(void* dst, const void* src, size_t n) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i v[4];
        for (int k = 0; k < 4; ++k) v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * k));
        for (int k = 0; k < 4; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i + 16 * k), v[k]);
    }
    std::memcpy(d + i, s + i, n - i);
}

}  // namespace tandem
