// A persistent worker pool: one coordinator thread runs submitted jobs in order; inside a job,
// parallel_for spreads tasks over the coordinator and the helper threads. Idle threads spin for
// spin_us, then sleep on a condition variable, so no core burns long between calls: a short spin
// where other processes need the cores between calls, a longer one where this process issues
// calls a fraction of a millisecond apart (a decode step's layers) and a wake-up each would cost.
// park() ends the spins at once: a process that hands the cores to another (a layer call to a
// co-located expert server, or its answer back) keeps long spins within its own phase and parks
// when the phase ends.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

class Job {
public:
    void wait();  // rethrows the job's exception, if any
    bool done();

private:
    friend class ThreadPool;
    void finish(std::exception_ptr error);
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<bool> done_{false};
    std::exception_ptr error_;
};

class ThreadPool {
public:
    explicit ThreadPool(int threads, int spin_us = 50);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return int(helpers_.size()) + 1; }
    std::shared_ptr<Job> submit(std::function<void()> work);
    // Runs `work` on the calling thread as the coordinator (no hand-off to wait for); blocks while
    // a submitted job is running.
    void run(const std::function<void()>& work);
    // Only from inside a submitted job (the coordinator thread).
    void parallel_for(int n, const std::function<void(int)>& fn);
    // Idle threads stop spinning and sleep until the next call (any thread, any time).
    void park() { parked_at_.store(generation_.load()); }
    // Ends a park ahead of the next call: sleeping helpers wake and spin for spin_us awaiting it, so
    // their wake-up overlaps what the caller does before that call (the cores are this process's
    // again: a co-located server's answer came). Any thread, any time.
    void unpark();
    // park(), with the helpers that were spinning waiting on *word while it holds value, at most
    // max_s: a doorbell of a shared segment that the other process rings for the next call or its
    // answer, waking them together with the thread that waits for it, so that they are spinning when
    // its parallel_for comes (helpers asleep already stay asleep: moving them would wake them). The
    // word is only ever given to the kernel (futex), never read here; a parallel_for or unpark() ends
    // the wait at once.
    void park_on(const uint32_t* word, uint32_t value, double max_s);
    // An idle helper reads [p, p + bytes) into the caches until the next parallel_for (what a call
    // soon after will read: a decode step's dense weights, between the small ops that leave the
    // memory idle); a request queued while every helper sleeps is dropped. Any thread, any time.
    void warm(const void* p, size_t bytes);

private:
    void coordinator_loop();
    void helper_loop();
    void run_tasks();
    void warm_until_work(uint64_t seen);
    bool sleep_on_bell(uint64_t seen, uint64_t& bell_seen, std::unique_lock<std::mutex>& lock);
    void end_bell_park();  // under mu_

    std::mutex mu_;
    std::condition_variable work_cv_, done_cv_, jobs_cv_;
    std::deque<std::pair<std::function<void()>, std::shared_ptr<Job>>> jobs_;
    std::atomic<int> queued_{0};
    std::mutex exec_mu_;  // held by whichever thread is coordinating a job
    const std::function<void(int)>* fn_ = nullptr;
    int n_ = 0;
    std::atomic<int> next_{0}, done_{0}, active_{0};
    std::atomic<uint64_t> generation_{0};
    // The generation park() was called at: an idle thread that has seen that parallel_for does not
    // spin (sticky, so a helper that reaches its spin only after the park sleeps too).
    std::atomic<uint64_t> parked_at_{UINT64_MAX};
    std::atomic<uint64_t> unparks_{0};  // unpark() calls so far (under mu_ when changed)
    struct BellPark {
        const uint32_t* word = nullptr;  // null: none
        uint32_t value = 0;
        double max_s = 0;
        uint64_t epoch = 0, parked_at = 0;
    } bell_;  // under mu_
    std::atomic<int> bell_sleepers_{0};  // helpers in a futex wait on bell_.word
    std::mutex warm_mu_;
    std::vector<std::pair<const char*, size_t>> warm_;  // ranges left to read ahead, oldest first
    std::atomic<bool> warm_pending_{false};
    bool stop_ = false;
    bool open_ = false;  // helpers may join the current parallel_for (under mu_)
    std::exception_ptr task_error_;
    std::atomic<bool> failed_{false};  // first exception thrown by a task of the current parallel_for
    const std::chrono::microseconds spin_;
    std::thread coordinator_;
    std::vector<std::thread> helpers_;
};

}  // namespace tandem
