// Futex doorbells over a shared-memory segment: a 32-bit sequence word published
// with release ordering and waited on with acquire ordering; a short spin, then a futex sleep.
#pragma once
#include <cstdint>

namespace tandem {

// A doorbell in a shared segment: a sequence word and a count of its sleepers (in the same cache
// line), so that a ring makes a futex system call only when someone sleeps.
struct Bell {
    uint32_t* seq;
    uint32_t* sleepers;
};

uint32_t bell_load(const uint32_t* word);
// Publishes value with release ordering and wakes the sleepers (of any process), if any.
void bell_ring(Bell bell, uint32_t value);
// Wakes every sleeper without changing the word.
void bell_wake(Bell bell);
// Waits until *seq != old_value, a wake, or the timeout: spins spin_us, then sleeps on the futex.
// Returns the word's value then. Call without the GIL.
uint32_t bell_wait(Bell bell, uint32_t old_value, double spin_us, double timeout_s);
// Nanoseconds since the Unix epoch (Python's time.time_ns), for spans.
int64_t wall_ns();

}  // namespace tandem
