// AVX-512 + VNNI kernels: the avx512 variant with the int8 dot products done by vpdpbusd.
#include "simd/kernels_impl.h"

namespace tandem {

const KernelTable& avx512_vnni_kernels() {
    static const KernelTable table = simd_table("avx512_vnni");
    return table;
}

}  // namespace tandem
