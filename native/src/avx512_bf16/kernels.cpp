// AVX-512 + VNNI + BF16 kernels: the avx512_vnni variant with the bf16 dot products done by
// vdpbf16ps (activations split into two bf16 parts by `arrange`).
#include "simd/kernels_impl.h"

namespace tandem {

const KernelTable& avx512_bf16_kernels() {
    static const KernelTable table = simd_table("avx512_bf16");
    return table;
}

}  // namespace tandem
