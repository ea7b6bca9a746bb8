// The fused kernels' own thread pool and ``for_rows``, which shares a kernel's rows out on it
// (or on torch's OpenMP threads). pool.cpp holds the process's pool.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace specdraft {

// ---- the kernels' own thread pool ----------------------------------------------------------
//
// torch's OpenMP runtime (libgomp) throttles its workers' spin-wait to almost nothing once the
// process has more OpenMP threads than cores — which it does as soon as a second thread (the
// batch scheduler's, a request's) has run a parallel region beside the main thread's: every
// parallel region then waits for a worker to wake from the kernel, and a forward run from the
// scheduler thread took twice as long as from the main thread (a 30 µs GEMM took 90-130 µs).
// So the fused kernels share out their rows on a pool of their own: torch's thread count
// (``configure``), workers that spin for a short while after each task (the next kernel of a
// forward comes within microseconds) and then sleep. One call at a time uses the workers; a call
// from another thread meanwhile runs its rows itself. Rows are independent and each is computed
// whole by one thread, so which thread takes which row changes nothing in the results.

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    // a worker knows the epoch it was made in (0), whenever its thread starts: a task posted
    // before it first looks is still news to it
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this] { work(0); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(sleep_);
      stop_ = true;
      epoch_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int threads() const { return threads_; }

  // f(i) for every i in [0, n), on the pool's threads and the caller's.
  void run(int64_t n, const std::function<void(int64_t)>& f) {
    std::unique_lock<std::mutex> busy(call_, std::try_to_lock);
    if (!busy.owns_lock() || threads_ == 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    task_ = &f;
    count_ = n;
    next_.store(0);
    pending_.store(threads_ - 1);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      epoch_.fetch_add(1);
    }
    if (sleepers_.load() > 0) wake_.notify_all();
    share();
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
    task_ = nullptr;
  }

 private:
  void share() {
    for (int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) (*task_)(i);
  }

  void work(uint64_t seen) {
    while (true) {
      // spin a while for the next task, then sleep until one comes
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
      while (epoch_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) _mm_pause();
      if (epoch_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return epoch_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = epoch_.load();
      if (stop_) return;
      share();
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  static constexpr int kSpinMicroseconds = 200;
  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex call_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  int64_t count_ = 0;
  const std::function<void(int64_t)>* task_ = nullptr;
  bool stop_ = false;
};

// The pool, made with torch's intra-op thread count at first use (or ``configure``'s).
Pool& shared_pool();

// Whether this thread's fused kernels share rows on the pool (true) or on torch's OpenMP threads
// (false): see pool.cpp.
extern thread_local bool on_pool;

// Rows [0, n) shared out between threads when there is enough work (about 64 K operations a
// share); a row's arithmetic is the same on any thread.
template <typename F>
static inline void for_rows(int64_t n, int64_t work_per_row, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work_per_row));
  if (n <= grain) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  if (!on_pool) {
    at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) f(i);
    });
    return;
  }
  const int64_t shares = (n + grain - 1) / grain;
  shared_pool().run(shares, [&](int64_t share) {
    for (int64_t i = share * grain, end = std::min(n, (share + 1) * grain); i < end; ++i) f(i);
  });
}

}  // namespace specdraft
