// Doorbells for the shared-memory transport: a 32-bit sequence word in a mapped segment, published
// with release ordering and waited on with acquire ordering; a short spin, then a futex sleep.
#include "doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace tandem {

namespace {

// The sequence word at `offset` of a writable buffer (an mmap of the segment), checked for bounds
// and 4-byte alignment. The buffer_info keeps the mapping exported (it cannot be closed) while held.
uint32_t* word_at(const py::buffer_info& info, size_t offset) {
    if (info.readonly) throw std::invalid_argument("buffer: must be writable");
    const size_t size = size_t(info.size) * size_t(info.itemsize);
    if (offset % 4 != 0 || offset + 4 > size)
        throw std::invalid_argument("offset: " + std::to_string(offset) + " is not an aligned word inside " +
                                    std::to_string(size) + " bytes");
    auto* word = reinterpret_cast<uint32_t*>(static_cast<char*>(info.ptr) + offset);
    if (reinterpret_cast<uintptr_t>(word) % 4 != 0) throw std::invalid_argument("buffer: word is not 4-byte aligned");
    return word;
}

uint32_t load_acquire(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

// Sleeps while *word == expected, for at most `seconds`; returns early on any wake (shared futex: the
// other side is another process).
void futex_sleep(uint32_t* word, uint32_t expected, double seconds) {
    timespec ts;
    ts.tv_sec = time_t(seconds);
    ts.tv_nsec = long((seconds - double(ts.tv_sec)) * 1e9);
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

}  // namespace

uint32_t doorbell_load(py::buffer buffer, size_t offset) {
    const py::buffer_info info = buffer.request(true);
    return load_acquire(word_at(info, offset));
}

void doorbell_ring(py::buffer buffer, size_t offset, uint32_t value) {
    const py::buffer_info info = buffer.request(true);
    uint32_t* word = word_at(info, offset);
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void doorbell_wake(py::buffer buffer, size_t offset) {
    const py::buffer_info info = buffer.request(true);
    syscall(SYS_futex, word_at(info, offset), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

uint32_t doorbell_wait(py::buffer buffer, size_t offset, uint32_t old_value, double spin_us, double timeout_s) {
    if (!(spin_us >= 0) || !(timeout_s >= 0) || !std::isfinite(timeout_s))
        throw std::invalid_argument("spin_us and timeout_s must be finite and >= 0");
    const py::buffer_info info = buffer.request(true);
    uint32_t* word = word_at(info, offset);
    py::gil_scoped_release release;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto spin_end = start + std::chrono::duration<double, std::micro>(spin_us);
    uint32_t value = load_acquire(word);
    while (value == old_value && clock::now() < spin_end) {
        __builtin_ia32_pause();
        value = load_acquire(word);
    }
    if (value != old_value) return value;
    const double left = timeout_s - std::chrono::duration<double>(clock::now() - start).count();
    if (left > 0) futex_sleep(word, old_value, left);
    return load_acquire(word);
}

void register_doorbell(py::module_& m) {
    m.def("doorbell_load", &doorbell_load, py::arg("buffer"), py::arg("offset"),
          "The 32-bit word at offset, read with acquire ordering.");
    m.def("doorbell_ring", &doorbell_ring, py::arg("buffer"), py::arg("offset"), py::arg("value"),
          "Stores value at offset with release ordering and wakes every waiter.");
    m.def("doorbell_wake", &doorbell_wake, py::arg("buffer"), py::arg("offset"),
          "Wakes every waiter on the word at offset without changing it.");
    m.def("doorbell_wait", &doorbell_wait, py::arg("buffer"), py::arg("offset"), py::arg("old_value"),
          py::arg("spin_us"), py::arg("timeout_s"),
          "Waits (GIL released) until the word at offset differs from old_value, a wake, or the timeout; "
          "returns the word's value then.");
}

}  // namespace tandem
