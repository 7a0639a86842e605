// AVX-512 F/BW/VL/DQ kernels: the shared SIMD kernels (simd/kernels_impl.h) with EVEX encoding and
// 32 registers, so prefill shares each weight load among 4 tokens.
#include "simd/kernels_impl.h"

namespace tandem {

const KernelTable& avx512_kernels() {
    static const KernelTable table = simd_table("avx512");
    return table;
}

}  // namespace tandem
