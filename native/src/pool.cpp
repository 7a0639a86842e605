#include "pool.h"

#include "doorbell.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace tandem {

namespace {

constexpr auto kJobSpin = std::chrono::microseconds(50);

// Polls `ready` for a short while; true if it came true. Lets a thread catch work that follows
// closely without the cost of a sleep and wake-up, and still sleep when there is none. Every 64
// polls it yields its core to any thread waiting for one (a no-op where none is): where the cores
// are shared (a co-located stack: the other process's pool, the serving threads), a poller that
// held its core until its time slice ran out would push that work onto the cores that compute.
template <typename Ready>
bool spin_until(Ready ready, std::chrono::microseconds spin = kJobSpin) {
    const auto end = std::chrono::steady_clock::now() + spin;
    while (std::chrono::steady_clock::now() < end) {
        for (int i = 0; i < 64; ++i) {
            if (ready()) return true;
            __builtin_ia32_pause();  // leaves the core's resources to whatever shares it meanwhile
        }
        sched_yield();
    }
    return false;
}

}  // namespace

void Job::finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    done_ = true;
    cv_.notify_all();
}

bool Job::done() { return done_.load(); }

void Job::wait() {
    if (!spin_until([&] { return done_.load(); })) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return done_.load(); });
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
}

ThreadPool::ThreadPool(int threads, int spin_us) : spin_(spin_us) {
    if (threads < 1) throw std::invalid_argument("threads must be >= 1");
    if (spin_us < 0) throw std::invalid_argument("spin_us must be >= 0");
    coordinator_ = std::thread([this] { coordinator_loop(); });
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { helper_loop(); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        end_bell_park();
    }
    jobs_cv_.notify_all();
    work_cv_.notify_all();
    coordinator_.join();
    for (auto& t : helpers_) t.join();
}

std::shared_ptr<Job> ThreadPool::submit(std::function<void()> work) {
    auto job = std::make_shared<Job>();
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) throw std::runtime_error("thread pool is shut down");
        jobs_.emplace_back(std::move(work), job);
        ++queued_;
    }
    jobs_cv_.notify_one();
    return job;
}

void ThreadPool::run(const std::function<void()>& work) {
    std::lock_guard<std::mutex> exec(exec_mu_);
    work();
}

void ThreadPool::coordinator_loop() {
    for (;;) {
        std::pair<std::function<void()>, std::shared_ptr<Job>> item;
        // back-to-back layer calls skip the sleep
        spin_until([&] { return queued_.load() > 0 || parked_at_.load() == generation_.load(); }, spin_);
        {
            std::unique_lock<std::mutex> lock(mu_);
            jobs_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
            if (jobs_.empty()) return;
            item = std::move(jobs_.front());
            jobs_.pop_front();
            --queued_;
        }
        std::exception_ptr error;
        try {
            std::lock_guard<std::mutex> exec(exec_mu_);
            item.first();
        } catch (...) {
            error = std::current_exception();
        }
        item.second->finish(error);
    }
}

void ThreadPool::run_tasks() {
    try {
        for (int t; (t = next_.fetch_add(1)) < n_;) {
            (*fn_)(t);
            done_.fetch_add(1);
        }
    } catch (...) {  // stop handing out tasks; the coordinator rethrows once everyone has left
        std::lock_guard<std::mutex> lock(mu_);
        if (!task_error_) task_error_ = std::current_exception();
        failed_ = true;
        next_ = n_;
    }
}

void ThreadPool::warm(const void* p, size_t bytes) {
    if (helpers_.empty() || bytes == 0) return;
    std::lock_guard<std::mutex> lock(warm_mu_);
    warm_.emplace_back(static_cast<const char*>(p), bytes);
    warm_pending_ = true;
}

// Prefetches the queued ranges a page at a time, leaving the rest queued as work arrives or the
// pool is parked (the cores are another process's then).
void ThreadPool::warm_until_work(uint64_t seen) {
    constexpr size_t kStep = 4096;
    while (warm_pending_.load() && generation_.load() == seen && parked_at_.load() != seen) {
        std::pair<const char*, size_t> range;
        {
            std::lock_guard<std::mutex> lock(warm_mu_);
            if (warm_.empty()) {
                warm_pending_ = false;
                return;
            }
            range = warm_.front();
            const size_t step = std::min(kStep, range.second);
            warm_.front() = {range.first + step, range.second - step};
            if (warm_.front().second == 0) warm_.erase(warm_.begin());
            range.second = step;
        }
        for (size_t off = 0; off < range.second; off += 64) __builtin_prefetch(range.first + off, 0, 2);
    }
}

void ThreadPool::unpark() {
    if (helpers_.empty()) return;
    {
        std::lock_guard<std::mutex> lock(mu_);
        parked_at_.store(UINT64_MAX);
        unparks_.fetch_add(1);
        end_bell_park();
    }
    work_cv_.notify_all();
}

void ThreadPool::park_on(const uint32_t* word, uint32_t value, double max_s) {
    if (helpers_.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    bell_ = {word, value, max_s, bell_.epoch + 1, generation_.load()};
    parked_at_.store(bell_.parked_at);  // spinning helpers move to the bell; sleeping ones stay asleep
}

void ThreadPool::end_bell_park() {
    if (bell_.word != nullptr && bell_sleepers_.load() > 0) futex_wake(bell_.word);
    bell_.word = nullptr;
}

// Under the lock, with no new work: waits on the bell of a park_on not yet waited for; true when it
// rang (the helper then spins for the call it brings), false when there is none or it timed out.
bool ThreadPool::sleep_on_bell(uint64_t seen, uint64_t& bell_seen, std::unique_lock<std::mutex>& lock) {
    if (bell_.word == nullptr || bell_.epoch == bell_seen || generation_.load() != seen) return false;
    const BellPark bell = bell_;
    bell_seen = bell.epoch;
    bell_sleepers_.fetch_add(1);
    lock.unlock();
    const bool rang = futex_sleep(bell.word, bell.value, bell.max_s);
    lock.lock();
    bell_sleepers_.fetch_sub(1);
    if (!rang) return false;
    uint64_t parked = bell.parked_at;  // the park this ring ends, unless a newer one came meanwhile
    parked_at_.compare_exchange_strong(parked, UINT64_MAX);
    return true;
}

void ThreadPool::helper_loop() {
    uint64_t seen = 0, unparks = 0, bell_seen = 0;
    for (;;) {
        warm_until_work(seen);
        const bool woke = spin_until(
            [&] { return generation_.load() != seen || parked_at_.load() == seen || warm_pending_.load(); }, spin_);
        if (woke && generation_.load() == seen && parked_at_.load() != seen) continue;  // a range to warm
        {
            std::unique_lock<std::mutex> lock(mu_);
            if (sleep_on_bell(seen, bell_seen, lock)) continue;
            unparks = unparks_.load();  // one from before this sleep is spent
            work_cv_.wait(lock, [&] { return stop_ || generation_.load() != seen || unparks_.load() != unparks; });
            if (stop_) return;
            if (generation_.load() == seen) {  // unparked: spin for the call that follows
                unparks = unparks_.load();
                continue;
            }
            seen = generation_.load();
            if (!open_) continue;  // that parallel_for is over: its counters may be reset any time
            active_.fetch_add(1);
        }
        run_tasks();
        std::lock_guard<std::mutex> lock(mu_);
        if (active_.fetch_sub(1) == 1) done_cv_.notify_all();
    }
}

void ThreadPool::parallel_for(int n, const std::function<void(int)>& fn) {
    if (n <= 0) return;
    if (warm_pending_.load()) {  // what was not read ahead by now is this call's to read
        std::lock_guard<std::mutex> lock(warm_mu_);
        warm_.clear();
        warm_pending_ = false;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        fn_ = &fn;
        n_ = n;
        next_ = 0;
        done_ = 0;
        task_error_ = nullptr;
        failed_ = false;
        open_ = true;
        end_bell_park();
        generation_.fetch_add(1);
    }
    if (!helpers_.empty() && n > 1) work_cv_.notify_all();
    run_tasks();
    auto finished = [&] { return active_.load() == 0 && next_.load() >= n && (done_.load() == n || failed_.load()); };
    spin_until(finished);
    // Decided under the lock, where helpers join: one that joined after the spin's look at active_
    // is waited for, and none joins after (it would take a task index from this call's counter and
    // run it as the next call's, twice, leaving done_ past n and the next call waiting forever).
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, finished);
    open_ = false;
    if (task_error_) std::rethrow_exception(task_error_);
}

}  // namespace tandem
