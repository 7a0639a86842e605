// Vectors for activations and scratch: their data starts on a cache line, so a tile or vector load
// of a 64-byte row touches one line, not two (malloc aligns large blocks to 16 bytes only); their
// elements are left uninitialized (every user writes what it reads); and large blocks are kept for
// the next call of the same shape (take_block / give_block), since a prefill's fresh megabytes
// would otherwise be page-faulted and zeroed by the kernel every layer.
#pragma once
#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace tandem {

constexpr std::size_t kCacheLine = 64;

// A block of at least `bytes` (rounded up to its size class), cache-line aligned; give_block takes
// it back for reuse (up to a bound on the bytes kept; past it, the block is freed).
void* take_block(std::size_t bytes);
void give_block(void* block, std::size_t bytes);

template <typename T>
struct LineAligned {
    using value_type = T;
    LineAligned() = default;
    template <typename U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(std::size_t n) { return static_cast<T*>(take_block(n * sizeof(T))); }
    void deallocate(T* p, std::size_t n) { give_block(p, n * sizeof(T)); }
    template <typename U, typename... Args>
    void construct(U* p, Args&&... args) {
        if constexpr (sizeof...(Args) == 0) ::new (static_cast<void*>(p)) U;
        else ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
    template <typename U>
    bool operator==(const LineAligned<U>&) const { return true; }
    template <typename U>
    bool operator!=(const LineAligned<U>&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

}  // namespace tandem
