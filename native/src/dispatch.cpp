#include "dispatch.h"

#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <stdexcept>

namespace tandem {

namespace {

// What each variant needs; each implies the ones before it.
struct Features {
    bool generic = true;
    bool avx2 = false;         // AVX2, FMA, F16C; the OS saves YMM state
    bool avx512 = false;       // + AVX-512 F, DQ, BW, VL; the OS saves ZMM and opmask state
    bool avx512_vnni = false;  // + AVX512_VNNI
    bool avx512_bf16 = false;  // + AVX512_BF16
    bool amx = false;          // + AMX-TILE, AMX-INT8, AMX-BF16; the OS saves tile state and lets us use it
};

struct Variant {
    const char* name;
    bool Features::*supported;
    const KernelTable& (*table)();
};

const Variant kVariants[] = {  // worst to best
    {"generic", &Features::generic, generic_kernels},
    {"avx2", &Features::avx2, avx2_kernels},
    {"avx512", &Features::avx512, avx512_kernels},
    {"avx512_vnni", &Features::avx512_vnni, avx512_vnni_kernels},
    {"avx512_bf16", &Features::avx512_bf16, avx512_bf16_kernels},
    {"amx", &Features::amx, amx_kernels},
};

constexpr uint64_t kXcr0Ymm = 0x6;              // SSE and AVX state
constexpr uint64_t kXcr0Zmm = 0xe6;             // + opmask, ZMM0-15 upper halves, ZMM16-31
constexpr uint64_t kXcr0Tiles = 3ull << 17;     // XTILECFG and XTILEDATA
constexpr int kXfeatureTileData = 18;

uint64_t xgetbv0() {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (uint64_t(edx) << 32) | eax;
}

bool bit(unsigned reg, int n) { return (reg >> n) & 1u; }

// Linux hands out tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16+);
// the grant holds for the whole process. Any failure means no AMX.
bool request_tile_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) != 0) return false;
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted >> kXfeatureTileData) & 1ul;
#else
    return false;
#endif
}

Features detect() {
    Features f;
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const bool osxsave = bit(c, 27), avx = bit(c, 28), fma = bit(c, 12), f16c = bit(c, 29);
    if (!osxsave || !avx || __get_cpuid_max(0, nullptr) < 7) return f;
    const uint64_t xcr0 = xgetbv0();
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned max_subleaf = a, b7 = b, c7 = c, d7 = d;
    unsigned a7_1 = 0;
    if (max_subleaf >= 1) __cpuid_count(7, 1, a7_1, b, c, d);
    f.avx2 = (xcr0 & kXcr0Ymm) == kXcr0Ymm && fma && f16c && bit(b7, 5);
    f.avx512 = f.avx2 && (xcr0 & kXcr0Zmm) == kXcr0Zmm && bit(b7, 16) && bit(b7, 17) && bit(b7, 30) && bit(b7, 31);
    f.avx512_vnni = f.avx512 && bit(c7, 11);
    f.avx512_bf16 = f.avx512_vnni && bit(a7_1, 5);
    f.amx = f.avx512_bf16 && bit(d7, 22) && bit(d7, 24) && bit(d7, 25) && (xcr0 & kXcr0Tiles) == kXcr0Tiles &&
            request_tile_permission();
    return f;
}

const Features& features() {
    static const Features f = detect();
    return f;
}

std::string join(const std::vector<std::string>& names) {
    std::string s;
    for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
    return s;
}

}  // namespace

std::vector<std::string> supported_isas() {
    std::vector<std::string> isas;
    for (const Variant& v : kVariants)
        if (features().*v.supported) isas.push_back(v.name);
    return isas;
}

const KernelTable& kernels_for(const std::string& isa) {
    for (const Variant& v : kVariants) {
        if (isa != v.name) continue;
        if (!(features().*v.supported))
            throw std::invalid_argument("ISA variant '" + isa + "' is not supported by this CPU or OS (supported: " +
                                        join(supported_isas()) + ")");
        return v.table();
    }
    std::vector<std::string> known;
    for (const Variant& v : kVariants) known.push_back(v.name);
    throw std::invalid_argument("unknown ISA variant '" + isa + "' (known: " + join(known) + ")");
}

const KernelTable& select_kernels(const std::string& forced) {
    return kernels_for(forced.empty() ? supported_isas().back() : forced);
}

}  // namespace tandem
