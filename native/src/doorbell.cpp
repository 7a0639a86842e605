// Doorbells for the shared-memory transport: a 32-bit sequence word in a mapped segment, published
// with release ordering and waited on with acquire ordering; a short spin, then a futex sleep.
#include "doorbell.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

namespace tandem {

bool futex_sleep(const uint32_t* word, uint32_t expected, double seconds) {
    timespec ts;
    ts.tv_sec = time_t(seconds);
    ts.tv_nsec = long((seconds - double(ts.tv_sec)) * 1e9);
    const long r = syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
    return r == 0 || errno == EAGAIN || errno == EINTR;
}

void futex_wake(const uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0); }

uint32_t bell_load(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

void bell_ring(Bell bell, uint32_t value) {
    __atomic_store_n(bell.seq, value, __ATOMIC_SEQ_CST);
    // Either a sleeper counted itself before this load and is woken, or it reads the new value
    // before sleeping (both sides are sequentially consistent); FUTEX_WAIT rechecks the value too.
    if (__atomic_load_n(bell.sleepers, __ATOMIC_SEQ_CST) != 0) bell_wake(bell);
}

void bell_wake(Bell bell) { futex_wake(bell.seq); }

uint32_t bell_wait(Bell bell, uint32_t old_value, double spin_us, double timeout_s) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto spin_end = start + std::chrono::duration<double, std::micro>(spin_us);
    uint32_t value = bell_load(bell.seq);
    for (int polls = 1; value == old_value && clock::now() < spin_end; ++polls) {
        __builtin_ia32_pause();
        if (polls % 64 == 0) sched_yield();  // the core to any thread waiting for one, as the pool's spins do
        value = bell_load(bell.seq);
    }
    if (value != old_value) return value;
    __atomic_add_fetch(bell.sleepers, 1, __ATOMIC_SEQ_CST);
    value = __atomic_load_n(bell.seq, __ATOMIC_SEQ_CST);
    const double left = timeout_s - std::chrono::duration<double>(clock::now() - start).count();
    if (value == old_value && left > 0) futex_sleep(bell.seq, old_value, left);
    __atomic_sub_fetch(bell.sleepers, 1, __ATOMIC_SEQ_CST);
    return bell_load(bell.seq);
}

uint32_t AdaptiveSpin::wait(Bell bell, uint32_t old_value, double spin_us, double timeout_s) {
    const auto start = std::chrono::steady_clock::now();
    const uint32_t value = bell_wait(bell, old_value, spin ? spin_us : 0, timeout_s);
    if (value != old_value)
        spin = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() < spin_us;
    return value;
}

int64_t wall_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace tandem
