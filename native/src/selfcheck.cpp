// The chosen variant, checked against the generic one before first use: a small random layer of
// every format, a decode call and a prefill call (tile paths included); a variant that disagrees
// beyond the tests' bound gives way to the next one down, with a warning naming both.
// E experts, D hidden size, I intermediate size, T tokens, K experts per token.
#include "selfcheck.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "dispatch.h"
#include "moe.h"

namespace tandem {

namespace {

constexpr int kE = 4, kD = 128, kI = 64, kK = 2;
constexpr double kBound = 1e-3;  // relative error against generic, as tests/native holds every variant to

struct Lcg {  // deterministic, so every import checks the same numbers
    uint64_t state = 0x9e3779b97f4a7c15ull;
    float next() {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        return float(int32_t(state >> 32)) / 2147483648.f;
    }
};

std::vector<float> forward(const KernelTable& k, ThreadPool& pool, const std::vector<uint8_t>& layer, int tokens,
                           const std::vector<float>& x, const std::vector<int64_t>& ids, const std::vector<float>& w) {
    const MoeLayerView view = MoeLayerView::parse(layer.data(), layer.size());
    std::vector<float> out(size_t(tokens) * kD);
    const MoeCall call{&view, x.data(), ids.data(), w.data(), out.data(), tokens, kK};
    pool.run([&] { moe_forward(pool, k, call); });
    return out;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
    double err = 0, norm = 0;
    for (size_t i = 0; i < a.size(); ++i) err += double(a[i] - b[i]) * (a[i] - b[i]), norm += double(b[i]) * b[i];
    return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

// The worst relative error of k against generic over every format and both call shapes; `fault`
// adds a known error to k's answers (how the tests make a variant disagree).
double disagreement(const KernelTable& k, bool fault) {
    ThreadPool pool(2);
    Lcg rng;
    std::vector<float> w13(size_t(kE) * 2 * kI * kD), w2(size_t(kE) * kD * kI);
    for (float& v : w13) v = rng.next() / std::sqrt(float(kD));
    for (float& v : w2) v = rng.next() / std::sqrt(float(kI));
    double worst = 0;
    for (Format f : {Format::BF16, Format::INT8, Format::INT4, Format::INT4_ASYM}) {
        std::vector<uint8_t> layer(layer_bytes(f, kE, kD, kI, f == Format::BF16 ? 0 : kBlock));
        pack_layer(pool, w13.data(), w2.data(), f, kE, kD, kI, kBlock, layer.data());
        for (int tokens : {1, 32}) {
            std::vector<float> x(size_t(tokens) * kD), weights(size_t(tokens) * kK);
            std::vector<int64_t> ids(size_t(tokens) * kK);
            for (float& v : x) v = rng.next();
            for (int t = 0; t < tokens; ++t)
                for (int j = 0; j < kK; ++j) ids[t * kK + j] = (t + j) % kE, weights[t * kK + j] = 0.5f + 0.5f * rng.next();
            std::vector<float> got = forward(k, pool, layer, tokens, x, ids, weights);
            if (fault) got[0] += 1.f + std::fabs(got[0]);
            worst = std::max(worst, relative_error(got, forward(generic_kernels(), pool, layer, tokens, x, ids, weights)));
        }
    }
    return worst;
}

}  // namespace

const KernelTable& checked_kernels(const std::string& faulty, std::string& warning) {
    const std::vector<std::string> isas = supported_isas();
    for (size_t i = isas.size(); i-- > 1;) {
        const KernelTable& k = kernels_for(isas[i]);
        const double err = disagreement(k, isas[i] == faulty);
        if (err <= kBound) return k;
        warning += "tandem_native: the " + isas[i] + " kernels disagree with generic (relative error " +
                   std::to_string(err) + " > " + std::to_string(kBound) + ") on this CPU; using " + isas[i - 1] +
                   " instead. ";
    }
    return generic_kernels();
}

}  // namespace tandem
