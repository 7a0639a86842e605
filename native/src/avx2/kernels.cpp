// AVX2 + FMA + F16C kernels: the shared SIMD kernels (simd/kernels_impl.h) with VEX encoding.
#include "simd/kernels_impl.h"

namespace tandem {

const KernelTable& avx2_kernels() {
    static const KernelTable table = simd_table("avx2");
    return table;
}

}  // namespace tandem
