// Futex doorbells over a shared-memory segment: a 32-bit sequence word published
// with release ordering and waited on with acquire ordering; a short spin, then a futex sleep.
#pragma once
#include <cstdint>

namespace tandem {

uint32_t bell_load(const uint32_t* word);
// Stores value with release ordering and wakes every waiter (of any process).
void bell_ring(uint32_t* word, uint32_t value);
void bell_wake(uint32_t* word);
// Waits until *word != old_value, a wake, or the timeout: spins spin_us, then sleeps on the futex.
// Returns the word's value then. Call without the GIL.
uint32_t bell_wait(uint32_t* word, uint32_t old_value, double spin_us, double timeout_s);
// Nanoseconds since the Unix epoch (Python's time.time_ns), for spans.
int64_t wall_ns();

}  // namespace tandem
