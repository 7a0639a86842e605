// The blocks behind AlignedVector: small ones straight from the heap, large ones (a prefill's
// activations and intermediates) kept after use, by size class, for the next call to take.
#include "aligned.h"

#include <map>
#include <mutex>

namespace tandem {
namespace {

constexpr std::size_t kKeptFrom = std::size_t(1) << 20;  // blocks from 1 MiB are kept ...
constexpr std::size_t kKeptAtMost = std::size_t(256) << 20;  // ... up to 256 MiB in all

// Sizes from kKeptFrom up round to an eighth of their power of two, so calls whose token counts
// differ a little share blocks, at most 12.5% larger than asked.
std::size_t size_class(std::size_t bytes) {
    if (bytes < kKeptFrom) return (bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
    std::size_t power = kKeptFrom;
    while (power * 2 <= bytes) power *= 2;
    const std::size_t step = power / 8;
    return (bytes + step - 1) / step * step;
}

struct Kept {
    std::mutex mutex;
    std::multimap<std::size_t, void*> blocks;  // size class -> free block
    std::size_t bytes = 0;
};

// Never destroyed: thread_local vectors give their blocks back as threads end, after static exit.
Kept& kept() {
    static Kept* k = new Kept;
    return *k;
}

void* fresh(std::size_t bytes) { return ::operator new(bytes, std::align_val_t(kCacheLine)); }
void release(void* block) { ::operator delete(block, std::align_val_t(kCacheLine)); }

}  // namespace

void* take_block(std::size_t bytes) {
    const std::size_t size = size_class(bytes);
    if (size >= kKeptFrom) {
        Kept& k = kept();
        std::lock_guard<std::mutex> lock(k.mutex);
        if (auto it = k.blocks.find(size); it != k.blocks.end()) {
            void* block = it->second;
            k.blocks.erase(it);
            k.bytes -= size;
            return block;
        }
    }
    return fresh(size);
}

void give_block(void* block, std::size_t bytes) {
    if (!block) return;
    const std::size_t size = size_class(bytes);
    if (size >= kKeptFrom) {
        Kept& k = kept();
        std::lock_guard<std::mutex> lock(k.mutex);
        if (k.bytes + size <= kKeptAtMost) {
            k.blocks.emplace(size, block);
            k.bytes += size;
            return;
        }
    }
    release(block);
}

}  // namespace tandem
