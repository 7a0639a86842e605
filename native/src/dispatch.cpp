#include "dispatch.h"

#include <cpuid.h>

#include <stdexcept>

namespace tandem {

namespace {

struct Features {
    bool avx2 = false;
};

uint64_t xgetbv0() {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (uint64_t(edx) << 32) | eax;
}

Features detect() {
    Features f;
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
    if (!osxsave || !avx) return f;
    const bool ymm = (xgetbv0() & 0x6) == 0x6;  // the OS saves YMM state
    if (__get_cpuid_max(0, nullptr) < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = ymm && fma && f16c && (b & (1u << 5));
    return f;
}

const Features& features() {
    static const Features f = detect();
    return f;
}

}  // namespace

std::vector<std::string> supported_isas() {
    std::vector<std::string> isas{"generic"};
    if (features().avx2) isas.push_back("avx2");
    return isas;
}

const KernelTable& kernels_for(const std::string& isa) {
    const auto isas = supported_isas();
    bool ok = false;
    for (const auto& s : isas) ok |= s == isa;
    if (isa != "generic" && isa != "avx2")
        throw std::invalid_argument("unknown ISA variant '" + isa + "' (known: generic, avx2)");
    if (!ok) throw std::invalid_argument("ISA variant '" + isa + "' is not supported by this CPU");
    if (isa == "avx2") return avx2_kernels();
    return generic_kernels();
}

const KernelTable& select_kernels(const std::string& forced) {
    return kernels_for(forced.empty() ? supported_isas().back() : forced);
}

}  // namespace tandem
