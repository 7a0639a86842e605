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
// bell_wait whose spin pays only where it catches the ring: it spins while the last ring came
// within spin_us, and otherwise sleeps at once. Where the other side's work between rings is longer
// than the spin (a decode step's dense work, an expert call), spinning took a core from the process
// that was to ring, on a machine whose cores the two share; back-to-back calls still spin.
struct AdaptiveSpin {
    bool spin = true;
    uint32_t wait(Bell bell, uint32_t old_value, double spin_us, double timeout_s);
};
// Sleeps while *word == expected, for at most `seconds` (a shared futex: any process may wake it).
// True when it woke or the word differed, false on the timeout or a fault. Only the kernel reads the
// word, so a segment unmapped meanwhile is a fault here, not a crash.
bool futex_sleep(const uint32_t* word, uint32_t expected, double seconds);
// Wakes every sleeper on word (any process).
void futex_wake(const uint32_t* word);
// Nanoseconds since the Unix epoch (Python's time.time_ns), for spans.
int64_t wall_ns();

}  // namespace tandem
