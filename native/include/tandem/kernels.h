// The kernel interface: a table of function pointers per ISA variant. Each variant's source file
// is compiled with only its own instruction-set flags; the driver (moe.cpp) is compiled for the
// baseline and only calls through the table.
// T tokens, D hidden size, I expert intermediate size, R rows, C columns.
#pragma once
#include <cstdint>

#include "tandem/format.h"

namespace tandem {

// Activations of n tokens for one matrix product: fp32 rows (bf16 weights) or int8 blocks of 32
// columns with one fp32 scale per block (int8/int4 weights). Token i lives at row index[i] when an
// index is given, else at row i; then kPadRows rows past the last token can be read (their values
// are not used), so a tile of 16 tokens loads whole.
constexpr int kPadRows = 16;
struct Activations {
    const float* f = nullptr;   // [rows][C]
    const int8_t* q = nullptr;  // [rows][C]
    const float* s = nullptr;   // [rows][C / 32]
    const int32_t* c = nullptr;  // int4 weights: [rows][C / 8] from int4_corrections
    const int32_t* sums = nullptr;  // int4_asym weights: [rows][C / 32], each block's sum of q
    const int32_t* index = nullptr;
    const uint8_t* bf16_exact = nullptr;  // bf16 weights: per row, 1 where arrange found x exactly bf16
    int cols = 0;

    int64_t row(int i) const { return index ? index[i] : i; }
};

// y[i * ldy + (r - r0)] = dot(row r of w, token i of x) for r in [r0, r1), i in [0, n).
using MatmulFn = void (*)(const Matrix& w, int r0, int r1, const Activations& x, int n, float* y, int ldy);
// One row of C fp32 values -> int8 blocks of 32 in [-levels, levels] with fp32 scales (C a multiple
// of 32); levels comes from activation_levels.
using QuantizeFn = void (*)(const float* x, int cols, int levels, int8_t* q, float* s);

// The range activations are quantized to against a format's weights: int8 uses all of int8; int4
// uses 7 bits, so that its unsigned (offset) weights times them fit the int16 sums of maddubs.
constexpr int activation_levels(Format f) { return f == Format::INT4 ? 63 : 127; }
// What the SIMD int4 kernels subtract from sums against the levels offset by 128 (unsigned), per 8
// columns of a quantized row (one step of format.h's int4 tile, columns j and j + 4 sharing a
// byte): two int16 in one int32, 128 * (x0 + x1 + x4 + x5) low and 128 * (x2 + x3 + x6 + x7) high.
void int4_corrections(const int8_t* q, int cols, int32_t* out);
// Each 32-column block's sum of a quantized row (int4_asym: the minimums' share of a product).
void block_sums(const int8_t* q, int cols, int32_t* out);
// One row of C fp32 values -> the layout this variant's bf16 matmul reads, C floats' worth of bytes
// (may reorder the columns, or split each value into two bf16 parts); true where that split found
// every value exactly bf16 (no low parts: the matmul may skip their products), else false.
using ArrangeFn = bool (*)(const float* x, int cols, float* out);

// h[j] = silu(gate_up[j]) * gate_up[I + j] for j < I: one token's [2I] gate/up row -> [I].
using SiluMulFn = void (*)(const float* gate_up, int intermediate, float* h);
// gpt-oss's h[j] = (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate_up[j], limit),
// u = gate_up[I + j] (format.h's Activation::SWIGLU_OAI).
using SwigluOaiFn = void (*)(const float* gate_up, int intermediate, float alpha, float limit, float* h);

// y[m * ldy + o] = x[m] . w[o] for m < rows, o < outs, float32 (x [rows][in], w's rows ldw apart): each
// value summed in one fixed order whatever the rows around it (an exact small linear: a router's; a few
// query heads against their cached keys).
using DotRowsFn = void (*)(const float* x, int rows, int in, const float* w, long ldw, int outs, float* y, int ldy);
// y[m * ldy + d] += sum over o < outs, in order, of p[m * ldp + o] * v[o * ldv + d] for m < rows,
// d < cols, float32, one multiply-add a term: each value's arithmetic fixed whatever the rows and
// outs around it (query heads' probabilities against their cached values, a run of positions a call).
using WeighRowsFn = void (*)(const float* p, int rows, long ldp, const float* v, long ldv, int outs, float* y, int ldy,
                             int cols);

struct KernelTable {
    const char* name;
    MatmulFn matmul[kFormats];  // indexed by Format
    QuantizeFn quantize;
    ArrangeFn arrange;
    SiluMulFn silu_mul;
    SwigluOaiFn swiglu_oai;
    DotRowsFn dot_rows;
    WeighRowsFn weigh_rows;
    // Where matmul's arithmetic for a token depends on how many tokens share the call (AMX's bf16
    // tiles from 16 tokens), a kernel whose does not, for dense linears; null: matmul's does not.
    MatmulFn invariant[kFormats] = {};
};

const KernelTable& generic_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
const KernelTable& avx512_vnni_kernels();
const KernelTable& avx512_bf16_kernels();
const KernelTable& amx_kernels();

}  // namespace tandem
