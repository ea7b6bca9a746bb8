// The process's thread pool of the fused kernels (pool.h), and the bindings' ``configure`` and
// ``use_pool``.
#include "pool.h"

#include <pthread.h>

#include "kernels.h"

namespace specdraft {

namespace {

std::mutex pool_lock;
std::unique_ptr<Pool> pool;

}  // namespace

// The pool, made with torch's intra-op thread count at first use (or ``configure``'s). A child
// made by fork() has none of the parent's workers: it forgets the pool (leaked, not joined) and
// makes its own.
Pool& shared_pool() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { (void)pool.release(); });
    return true;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lock(pool_lock);
  if (!pool) pool = std::make_unique<Pool>(at::get_num_threads());
  return *pool;
}

// Use ``threads`` threads from now on (torch.set_num_threads for the fused kernels).
void configure(int64_t threads) {
  std::lock_guard<std::mutex> lock(pool_lock);
  if (!pool || pool->threads() != threads) {
    pool.reset();
    pool = std::make_unique<Pool>(static_cast<int>(threads));
  }
}

// Whether this thread's fused kernels share rows on the pool (true) or on torch's OpenMP threads
// (false): a forward whose GEMMs run on oneDNN (OpenMP) keeps to OpenMP, whose workers would
// otherwise spin against the pool's; a forward of packed GEMMs (quant_gemm.cpp, bf16_gemm.cpp)
// uses the pool.
thread_local bool on_pool = true;

void use_pool(bool yes) { on_pool = yes; }

}  // namespace specdraft
