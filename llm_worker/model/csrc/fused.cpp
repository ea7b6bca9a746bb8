// Fused, row-invariant CPU kernels for the fast forward (llm_worker/model/native.py).
//
// Every kernel computes each output row with the same sequence of floating-point operations,
// whatever the number of rows, the row's place in the tensor, or how the rows are split between
// threads: reductions run in one fixed order per row (never split across threads or re-blocked
// by size), elementwise work pads its tail to a full vector and runs the same vector code on it.
// So a token's numbers do not depend on what else is in its forward (batch invariance).
//
// AVX2 + FMA, 8 float lanes, with AVX-512 versions of the attention and the packed GEMM where the
// processor has it; built with -ffp-contract=off so that only the FMAs written here are fused.
// Tensors in float32 or bfloat16 (converted to float32 on load, rounded to nearest even on store,
// as torch does); RoPE tables and attention's arithmetic run in float32, over a KV cache held in
// float32 or bfloat16 (widened exactly as it is read). Sections: vector
// helpers, the thread pool, residual add + RMSNorm, SiLU·up, RoPE + the cache write, attention,
// the GEMM over exactly quantised weights, the GEMM over bfloat16 weights.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <pthread.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using BF16 = at::BFloat16;

// Functions compiled for AVX-512 as well as the AVX2 baseline, used where the processor has it
// (``has_avx512``). The packed GEMM's are bit-identical to their AVX2 versions (the same FMA
// chains, 16 lanes at a time); the attention's sum a score's 16-lane partial sums in another
// order than its 8-lane ones — either way the same on every row and call of one machine.
#define SPECDRAFT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

bool has_avx512();

// ---- 8-lane loads and stores -------------------------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const BF16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// c10::BFloat16's rounding (round to nearest even, NaN -> 0x7FC0), eight lanes at once.
inline void store8(BF16* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// A tail of k < 8 elements through the same vector code: copied into a zeroed block.
template <typename T>
inline __m256 load_tail(const T* p, int64_t k) {
  alignas(32) T block[8] = {};
  for (int64_t i = 0; i < k; ++i) block[i] = p[i];
  return load8(block);
}

template <typename T>
inline void store_tail(T* p, __m256 v, int64_t k) {
  alignas(32) T block[8];
  store8(block, v);
  for (int64_t i = 0; i < k; ++i) p[i] = block[i];
}

// The sum of a vector's lanes in one fixed order.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of w[0 .. count), 8 lanes at a time (a max is exact: any order gives its bits).
inline float max_of(const float* w, int64_t count) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t p = 0;
  for (; p + 8 <= count; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + p));
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  float top = _mm256_cvtss_f32(m);
  for (; p < count; ++p) top = std::max(top, w[p]);
  return top;
}

// exp(x) per lane: Cephes' range reduction and polynomial (about 1 ulp); exp(x) = 0 below -88.37.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

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

std::mutex pool_lock;
std::unique_ptr<Pool> pool;

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
// otherwise spin against the pool's; a forward of packed GEMMs (this file's) uses the pool.
thread_local bool on_pool = true;

void use_pool(bool yes) { on_pool = yes; }

// Rows [0, n) shared out between threads when there is enough work (about 64 K operations a
// share); a row's arithmetic is the same on any thread.
template <typename F>
inline void for_rows(int64_t n, int64_t work_per_row, const F& f) {
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

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// f(pointer to t's data) with the pointer typed float* or BF16* by t's dtype.
template <typename F>
void with_data(const torch::Tensor& t, const char* name, const F& f) {
  if (t.scalar_type() == at::kFloat) {
    f(t.data_ptr<float>());
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
    f(t.data_ptr<BF16>());
  }
}

// f(keys' data, values' data), typed float* or BF16* by the cache's dtype (one for both).
template <typename F>
void with_cache(const torch::Tensor& keys, const torch::Tensor& values, const F& f) {
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values of one dtype");
  with_data(keys, "keys", [&](auto* kp) { f(kp, values.data_ptr<std::remove_pointer_t<decltype(kp)>>()); });
}

// ---- residual add + RMSNorm ------------------------------------------------------------------

// sum of squares of a row of `h` in a fixed order: four accumulators over blocks of 32, then
// blocks of 8 and a zero-padded tail into the first.
template <typename T>
float sum_squares(const T* x, int64_t h) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= h; i += 32) {
    __m256 v0 = load8(x + i), v1 = load8(x + i + 8), v2 = load8(x + i + 16), v3 = load8(x + i + 24);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  for (; i + 8 <= h; i += 8) {
    __m256 v = load8(x + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  if (i < h) {
    __m256 v = load_tail(x + i, h - i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// out = weight * (x / rms(x)); in bfloat16 as transformers' LlamaRMSNorm does it: the normalised
// row is rounded to bfloat16 before the weight multiplies it.
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, h) / static_cast<float>(h) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  auto one = [&](__m256 v, __m256 wv) {
    __m256 normed = _mm256_mul_ps(v, vinv);
    if constexpr (std::is_same_v<T, BF16>) {  // round to bfloat16 first
      alignas(32) BF16 tmp[8];
      store8(tmp, normed);
      normed = load8(tmp);
    }
    return _mm256_mul_ps(wv, normed);
  };
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) store8(out + i, one(load8(x + i), load8(w + i)));
  if (i < h) store_tail(out + i, one(load_tail(x + i, h - i), load_tail(w + i, h - i)), h - i);
}

template <typename T>
void add_rows(const T* a, const T* b, T* out, int64_t h) {
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) store8(out + i, _mm256_add_ps(load8(a + i), load8(b + i)));
  if (i < h) store_tail(out + i, _mm256_add_ps(load_tail(a + i, h - i), load_tail(b + i, h - i)), h - i);
}

// (h + delta, rms_norm(h + delta) * weight); without delta, (h, rms_norm(h) * weight).
std::vector<torch::Tensor> add_rms_norm(
    torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  check_cpu(h, "h");
  check_cpu(weight, "weight");
  TORCH_CHECK(h.dim() == 2 && weight.dim() == 1 && weight.size(0) == h.size(1), "h [n, hidden], weight [hidden]");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type(), "weight and h must have one dtype");
  const int64_t n = h.size(0), width = h.size(1);
  torch::Tensor sum = h;
  if (delta.has_value()) {
    check_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(), "delta like h");
    sum = torch::empty_like(h);
  }
  torch::Tensor out = torch::empty_like(h);
  auto run = [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    const T* d = delta.has_value() ? delta->data_ptr<T>() : nullptr;
    T *s = sum.data_ptr<T>(), *o = out.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    for_rows(n, 4 * width, [&](int64_t r) {
      if (d) add_rows(x + r * width, d + r * width, s + r * width, width);
      rms_row(s + r * width, w, o + r * width, width, static_cast<float>(eps));
    });
  };
  with_data(h, "h", run);
  return {sum, out};
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  auto one = [](__m256 g, __m256 u) {
    __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    __m256 silu = _mm256_div_ps(g, sig);
    if constexpr (std::is_same_v<T, BF16>) {  // F.silu's result is rounded before the product
      alignas(32) BF16 tmp[8];
      store8(tmp, silu);
      silu = load8(tmp);
    }
    return _mm256_mul_ps(silu, u);
  };
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) store8(out + i, one(load8(gate + i), load8(up + i)));
  if (i < width)
    store_tail(out + i, one(load_tail(gate + i, width - i), load_tail(up + i, width - i)), width - i);
}

// gate_up [n, 2 I] (gate, then up) -> silu(gate) * up [n, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [n, 2 * intermediate]");
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({n, width}, gate_up.options());
  auto run = [&](auto* g) {
    using T = std::remove_pointer_t<decltype(g)>;
    T* o = out.data_ptr<T>();
    for_rows(n, 8 * width, [&](int64_t r) {
      silu_mul_row(g + 2 * r * width, g + (2 * r + 1) * width, o + r * width, width);
    });
  };
  with_data(gate_up, "gate_up", run);
  return out;
}

// ---- RoPE and the KV cache write ------------------------------------------------------------

// One head's RoPE: out = x * cos + (x2, x1) * sin_signed (sin_signed = (-sin1, sin2)), in float32,
// stored as O (float32, or bfloat16 rounded to nearest even).
template <typename O>
inline void rope_head(const float* x, const float* cos, const float* sin, O* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += 8) {
    const int64_t partner = i < half ? i + half : i - half;
    __m256 v = _mm256_mul_ps(load8(x + i), load8(cos + i));
    store8(out + i, _mm256_fmadd_ps(load8(x + partner), load8(sin + i), v));
  }
}

// qkv [N, (H + 2 K) d] (float32 or bfloat16, as the GEMM gave it); for rows[j]: its queries,
// rotated, into q [N, H, d] (float32), its keys rotated and its values into the cache
// keys [S, K, capacity, d] / values [S, K, capacity, dv] (both float32 or both bfloat16: a key is
// rotated in float32, then rounded to nearest even) at slot[j], position cache_pos[j].
// cos, sin [N, d]: each row's RoPE table rows.
void rope_store(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q, torch::Tensor keys,
    torch::Tensor values, torch::Tensor rows, torch::Tensor slot, torch::Tensor cache_pos) {
  for (auto* t : {&qkv, &cos, &sin, &q, &keys, &values, &rows, &slot, &cache_pos}) check_cpu(*t, "rope_store argument");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4, "q [N, H, d], keys/values [S, K, capacity, d]");
  const int64_t heads = q.size(1), d = q.size(2), kv = keys.size(1), capacity = keys.size(2), dv = values.size(3);
  TORCH_CHECK(d % 8 == 0 && keys.size(3) == d && dv >= d, "head_dim must be a multiple of 8");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv) * d, "qkv width");
  TORCH_CHECK(q.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
      "q and tables in float32");
  const int64_t m = rows.size(0), width = qkv.size(1), slots = keys.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* sl = slot.data_ptr<int64_t>();
  const int64_t* pos = cache_pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < m; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < q.size(0) && sl[j] >= 0 && sl[j] < slots && pos[j] >= 0 && pos[j] < capacity,
        "row, slot or cache position out of range");
  float* qo = q.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  auto run = [&](auto* src, auto* ko, auto* vo) {  // the cache's dtype: keys rounded once, after RoPE
    using T = std::remove_pointer_t<decltype(src)>;
    for_rows(m, 4 * width, [&](int64_t j) {
      const int64_t r = row[j];
      const T* x = src + r * width;
      const float *cr = c + r * d, *sr = s + r * d;
      std::vector<float> buf(d);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < d; i += 8) store8(buf.data() + i, load8(x + h * d + i));
        rope_head(buf.data(), cr, sr, qo + (r * heads + h) * d, d);
      }
      for (int64_t h = 0; h < kv; ++h) {
        const int64_t at_cache = ((sl[j] * kv + h) * capacity + pos[j]);
        for (int64_t i = 0; i < d; i += 8) store8(buf.data() + i, load8(x + (heads + h) * d + i));
        rope_head(buf.data(), cr, sr, ko + at_cache * d, d);
        const T* v = x + (heads + kv + h) * d;
        for (int64_t i = 0; i < d; i += 8) store8(vo + at_cache * dv + i, load8(v + i));
      }
    });
  };
  with_data(qkv, "qkv", [&](auto* src) { with_cache(keys, values, [&](auto* ko, auto* vo) { run(src, ko, vo); }); });
}

// ---- attention -------------------------------------------------------------------------------

// Eight keys' dot products with q at once: each key's own accumulator over d in order, then one
// fixed reduction tree (the same for every lane), so a key's score does not depend on its
// neighbours in the block. Keys in float32 or bfloat16 (widened exactly on load).
template <typename K>
inline __m256 dot8(const float* q, const K* const* k, int64_t d) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv = _mm256_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(k[t] + i), a[t]);
  }
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query row and head: its query, its KV head's keys and values (K: float or BF16), the scale.
template <typename K>
struct Job {
  const float* q;  // [d]
  const K* keys;  // [capacity, d] of its KV head
  const K* values;  // [capacity, dv]
  int64_t d, dv;
  float scale;
};

// out = softmax(q . k * scale) · v over the keys at ``pos`` (in that order), 8 lanes at a time.
template <typename T, typename K>
void attend8(const Job<K>& job, const std::vector<int64_t>& pos, T* o) {
  const int64_t count = static_cast<int64_t>(pos.size()), d = job.d;
  if (count == 0) {  // no visible key (never in a forward: a row sees itself)
    for (int64_t i = 0; i < d; i += 8) store8(o + i, _mm256_setzero_ps());
    return;
  }
  thread_local std::vector<float> w;
  w.resize((count + 7) / 8 * 8 + 16);
  const __m256 vscale = _mm256_set1_ps(job.scale);
  for (int64_t b = 0; b < count; b += 8) {
    const K* kptr[8];
    for (int t = 0; t < 8; ++t) kptr[t] = job.keys + pos[std::min(b + t, count - 1)] * d;
    _mm256_storeu_ps(w.data() + b, _mm256_mul_ps(dot8(job.q, kptr, d), vscale));
  }
  const float top = max_of(w.data(), count);
  const __m256 vtop = _mm256_set1_ps(top);
  for (int64_t b = 0; b < count; b += 8)
    _mm256_storeu_ps(w.data() + b, exp8(_mm256_sub_ps(_mm256_loadu_ps(w.data() + b), vtop)));
  __m256 acc[32];
  const int64_t blocks = d / 8;
  for (int64_t i = 0; i < blocks; ++i) acc[i] = _mm256_setzero_ps();
  float denom = 0.0f;
  for (int64_t p = 0; p < count; ++p) {
    const float wp = w[p];
    denom += wp;
    const __m256 vw = _mm256_set1_ps(wp);
    const K* v = job.values + pos[p] * job.dv;
    for (int64_t i = 0; i < blocks; ++i) acc[i] = _mm256_fmadd_ps(vw, load8(v + 8 * i), acc[i]);
  }
  const __m256 vden = _mm256_set1_ps(denom);
  for (int64_t i = 0; i < blocks; ++i) store8(o + 8 * i, _mm256_div_ps(acc[i], vden));
}

// exp8's arithmetic, 16 lanes at a time.
SPECDRAFT_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// 16 lanes from float32 or bfloat16 (widened exactly).
SPECDRAFT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

SPECDRAFT_AVX512 inline __m512 load16(const BF16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// dot8 with 16-lane partial sums over d (d a multiple of 16), folded to 8 lanes, then the same tree.
template <typename K>
SPECDRAFT_AVX512 inline __m256 dot8_wide(const float* q, const K* const* k, int64_t d) {
  __m512 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) a[t] = _mm512_fmadd_ps(qv, load16(k[t] + i), a[t]);
  }
  __m256 f[8];
  for (int t = 0; t < 8; ++t) f[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]), _mm512_extractf32x8_ps(a[t], 1));
  __m256 t0 = _mm256_hadd_ps(f[0], f[1]), t1 = _mm256_hadd_ps(f[2], f[3]);
  __m256 t2 = _mm256_hadd_ps(f[4], f[5]), t3 = _mm256_hadd_ps(f[6], f[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend8 with 16-lane dot products, exponentials and value sums (d a multiple of 16), for every
// query head of one KV head and every row of one call (the rows share their slot and committed
// prefix [0, start)). Per row and head the arithmetic and its order are a single row's (each
// key's score its own; the max; the exponentials; the weighted value sums and their denominator
// key by key in cache order), so a row's output does not depend on the others. Only the loops'
// order serves the group: the prefix is walked in blocks of keys, each block's keys and values
// read once from memory for all the rows and heads (L1 after the first). A row's new keys (its
// visible ones among the call's) follow per row, or, when every row is causal (a prefill chunk),
// in the same blocked walk, each row up to its own last key.
template <typename K>
struct GroupJob {
  const float* q;  // [N, H, d] queries
  const K* keys;  // [capacity, d] of the KV head (K: float or BF16)
  const K* values;  // [capacity, dv]
  const int64_t* row;  // the rows' q / out rows
  const bool* visible;  // [rows, width] each row's visible new keys
  int64_t rows, heads, head0, group, start, width, d, dv;
  float scale;
};

// One pair's running sums over keys [lo, hi): positions pos[0 ..] (nullptr: the keys themselves).
template <typename K>
SPECDRAFT_AVX512 inline void sum_values(
    const GroupJob<K>& g, const float* w, const int64_t* pos, int64_t lo, int64_t hi, float* acc, float& denom) {
  __m512 a[16];
  const int64_t blocks = g.d / 16;
  for (int64_t i = 0; i < blocks; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  float den = denom;
  for (int64_t p = lo; p < hi; ++p) {
    const float wv = w[p];
    den += wv;
    const __m512 vw = _mm512_set1_ps(wv);
    const K* v = g.values + (pos != nullptr ? pos[p - lo] : p) * g.dv;
    for (int64_t i = 0; i < blocks; ++i) a[i] = _mm512_fmadd_ps(vw, load16(v + 16 * i), a[i]);
  }
  denom = den;
  for (int64_t i = 0; i < blocks; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// sum_values for P pairs at once (head_dim 64: 4 P sums in registers), pair q's weights at
// w + q * stride, its sums at acc + q * 64: each value row is loaded once for all of them and
// the P independent chains keep the FMA units busy, each pair's sums still in key order (the same
// bits as P calls of sum_values).
template <int P, typename K>
SPECDRAFT_AVX512 inline void sum_values_pairs(
    const GroupJob<K>& g, const float* w, int64_t stride, int64_t lo, int64_t hi, float* acc, float* denom) {
  __m512 a[P][4];
  float den[P];
  for (int q = 0; q < P; ++q) {
    den[q] = denom[q];
    for (int i = 0; i < 4; ++i) a[q][i] = _mm512_loadu_ps(acc + q * 64 + 16 * i);
  }
  for (int64_t p = lo; p < hi; ++p) {
    const K* v = g.values + p * g.dv;
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int q = 0; q < P; ++q) {
      const float wv = w[q * stride + p];
      den[q] += wv;
      const __m512 vw = _mm512_set1_ps(wv);
      a[q][0] = _mm512_fmadd_ps(vw, v0, a[q][0]);
      a[q][1] = _mm512_fmadd_ps(vw, v1, a[q][1]);
      a[q][2] = _mm512_fmadd_ps(vw, v2, a[q][2]);
      a[q][3] = _mm512_fmadd_ps(vw, v3, a[q][3]);
    }
  }
  for (int q = 0; q < P; ++q) {
    denom[q] = den[q];
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + q * 64 + 16 * i, a[q][i]);
  }
}

// Cache rows [lo, hi) of ``width`` elements as float32, row p at the result + (p - lo) * width: a
// float32 cache in place, a bfloat16 one widened (exactly) into ``scratch``, once for every pair
// of a chunk's rows to read rather than once per pair (prefill: 24 pairs read each key).
inline const float* widened(const float* base, int64_t lo, int64_t, int64_t width, std::vector<float>&) {
  return base + lo * width;
}

SPECDRAFT_AVX512 inline const float* widened(
    const BF16* base, int64_t lo, int64_t hi, int64_t width, std::vector<float>& scratch) {
  const int64_t n = (hi - lo) * width;
  scratch.resize(n);
  const BF16* src = base + lo * width;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(scratch.data() + i, load16(src + i));
  for (; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch.data();
}

// Asks for cache rows [lo, hi) of ``width`` elements ahead of use: a job's next block of keys or
// values streams in while the current one is summed (no effect on any result).
template <typename K>
inline void prefetch_rows(const K* base, int64_t lo, int64_t hi, int64_t width) {
  const char* p = reinterpret_cast<const char*>(base + lo * width);
  const char* end = reinterpret_cast<const char*>(base + hi * width);
  for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

template <typename T, typename K>
SPECDRAFT_AVX512 void attend16_group(const GroupJob<K>& g, T* dst) {
  constexpr int64_t kBlock = 64;  // keys per block: 16 KB of keys, as much of values, stay in L1
  const int64_t pairs = g.rows * g.group, d = g.d, start = g.start, blocks = d / 16;
  const int64_t stride = (start + g.width + 15) / 16 * 16 + 16;
  thread_local std::vector<float> w, acc, denom, key_block;
  thread_local std::vector<int64_t> tail, tails;
  w.resize(pairs * stride);
  acc.resize(pairs * d);
  denom.assign(pairs, 0.0f);
  tail.resize(g.rows * std::max<int64_t>(g.width, 1));
  tails.assign(g.rows, 0);
  for (int64_t r = 0; r < g.rows; ++r)
    for (int64_t i = 0; i < g.width; ++i)
      if (g.visible[r * g.width + i]) tail[r * g.width + tails[r]++] = start + i;
  auto query = [&](int64_t pr) { return g.q + (g.row[pr / g.group] * g.heads + g.head0 + pr % g.group) * d; };
  // Causal rows (each sees the call's new keys 0 .. n - 1, as a prefill chunk's rows do): their new
  // keys follow the prefix in the cache, so the blocked walk below covers them too, each row up to
  // its own last key — the same keys in the same order as the per-row walk, the same bits.
  bool causal = true;
  int64_t end = start;  // the blocked walk's last key + 1
  for (int64_t r = 0; r < g.rows && causal; ++r) {
    for (int64_t i = 0; i < tails[r] && causal; ++i) causal = tail[r * g.width + i] == start + i;
    end = std::max(end, start + tails[r]);
  }
  if (!causal) end = start;
  auto reach = [&](int64_t r) { return causal ? start + tails[r] : start; };  // row r's blocked keys end
  const __m256 vscale = _mm256_set1_ps(g.scale);
  // scores: the prefix (and causal rows' new keys) a block at a time for every pair, then each
  // other row's own new keys
  for (int64_t k0 = 0; k0 < end; k0 += kBlock) {
    const int64_t k1 = std::min(end, k0 + kBlock);
    prefetch_rows(g.keys, k1, std::min(end, k1 + kBlock), d);
    auto score = [&](const auto* keys, int64_t first) SPECDRAFT_AVX512 {  // key p at keys + (p - first) * d
      using KB = std::remove_const_t<std::remove_pointer_t<decltype(keys)>>;
      for (int64_t pr = 0; pr < pairs; ++pr) {
        const int64_t last = reach(pr / g.group), hi = std::min(k1, last);
        const float* q = query(pr);
        float* wp = w.data() + pr * stride;
        for (int64_t b = k0; b < hi; b += 8) {  // b + 7 < k1 or last <= k1: within the block
          const KB* kptr[8];
          for (int t = 0; t < 8; ++t) kptr[t] = keys + (std::min(b + t, last - 1) - first) * d;
          _mm256_storeu_ps(wp + b, _mm256_mul_ps(dot8_wide(q, kptr, d), vscale));
        }
      }
    };
    if (g.rows > 1) {  // the block in float32 once for every row's heads (a bfloat16 cache widened)
      score(widened(g.keys, k0, k1, d, key_block), k0);
    } else {  // one row's heads: a bfloat16 cache widened as it is loaded
      score(g.keys, 0);
    }
  }
  for (int64_t pr = 0; pr < pairs && !causal; ++pr) {
    const int64_t r = pr / g.group, n = tails[r];
    const int64_t* own = tail.data() + r * g.width;
    const float* q = query(pr);
    float* wp = w.data() + pr * stride + start;
    for (int64_t b = 0; b < n; b += 8) {
      const K* kptr[8];
      for (int t = 0; t < 8; ++t) kptr[t] = g.keys + own[std::min(b + t, n - 1)] * d;
      _mm256_storeu_ps(wp + b, _mm256_mul_ps(dot8_wide(q, kptr, d), vscale));
    }
  }
  // w = exp(score - max) per pair
  for (int64_t pr = 0; pr < pairs; ++pr) {
    const int64_t count = start + tails[pr / g.group];
    float* wp = w.data() + pr * stride;
    const __m512 vtop = _mm512_set1_ps(max_of(wp, count));
    for (int64_t b = 0; b < count; b += 16) _mm512_storeu_ps(wp + b, exp16(_mm512_sub_ps(_mm512_loadu_ps(wp + b), vtop)));
  }
  // the weighted value sums, key by key in cache order: the prefix (and causal rows' new keys) a
  // block at a time, then each other row's own new keys
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t k0 = 0; k0 < end; k0 += kBlock) {
    prefetch_rows(g.values, k0 + kBlock, std::min(end, k0 + 2 * kBlock), g.dv);
    const int64_t k1 = std::min(end, k0 + kBlock);
    for (int64_t r = 0; r < g.rows; ++r) {  // a row's heads together: they share its last key
      const int64_t hi = std::min(k1, reach(r)), first = r * g.group, stop = first + g.group;
      if (hi <= k0) continue;
      for (int64_t pr = first; pr < stop; pr += d == 64 ? 3 : 1) {
        float *wp = w.data() + pr * stride, *ap = acc.data() + pr * d, *dp = denom.data() + pr;
        if (d != 64) {
          sum_values(g, wp, nullptr, k0, hi, ap, *dp);
          continue;
        }
        switch (std::min<int64_t>(3, stop - pr)) {
          case 3: sum_values_pairs<3>(g, wp, stride, k0, hi, ap, dp); break;
          case 2: sum_values_pairs<2>(g, wp, stride, k0, hi, ap, dp); break;
          default: sum_values_pairs<1>(g, wp, stride, k0, hi, ap, dp);
        }
      }
    }
  }
  for (int64_t pr = 0; pr < pairs && !causal; ++pr) {
    const int64_t r = pr / g.group;
    sum_values(g, w.data() + pr * stride, tail.data() + r * g.width, start, start + tails[r], acc.data() + pr * d,
        denom[pr]);
  }
  for (int64_t pr = 0; pr < pairs; ++pr) {
    T* o = dst + (g.row[pr / g.group] * g.heads + g.head0 + pr % g.group) * d;
    if (start + tails[pr / g.group] == 0) {  // no visible key (never in a forward: a row sees itself)
      for (int64_t i = 0; i < d; i += 8) store8(o + i, _mm256_setzero_ps());
      continue;
    }
    const __m512 vden = _mm512_set1_ps(denom[pr]);
    for (int64_t i = 0; i < blocks; ++i) {
      const __m512 r = _mm512_div_ps(_mm512_loadu_ps(acc.data() + pr * d + 16 * i), vden);
      store8(o + 16 * i, _mm512_castps512_ps256(r));
      store8(o + 16 * i + 8, _mm512_extractf32x8_ps(r, 1));
    }
  }
}

// Softmax attention of query rows over their visible cached keys. Row j (q row rows[j]) sees the
// committed prefix [0, start[j]) of cache slot slot[j] and, among its call's new rows (cache
// positions start[j] + i), those with visible[j][i]. Per query head: scores = q . k * scale over
// the visible keys in cache order, w = exp(score - max), out = sum w v / sum w, both sums in the
// order of the visible keys. A row's result depends only on its own visible keys: more rows in the
// forward, and other rows' keys between its own, change nothing. Query head h reads KV head
// h / (H / K). q in float32; the cache's keys and values both float32 or both bfloat16 (widened
// exactly: the same arithmetic as on their float32 copies). Output: out [N, H * d] (float32 or
// bfloat16) at row rows[j].
void attention(
    torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor rows, torch::Tensor slot,
    torch::Tensor start, torch::Tensor visible, double scale, torch::Tensor out) {
  for (auto* t : {&q, &keys, &values, &rows, &slot, &start, &visible, &out}) check_cpu(*t, "attention argument");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && visible.dim() == 2, "shapes");
  TORCH_CHECK(visible.scalar_type() == at::kBool, "visible must be bool");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const int64_t heads = q.size(1), d = q.size(2), kv = keys.size(1), capacity = keys.size(2), dv = values.size(3);
  TORCH_CHECK(d % 8 == 0 && d <= 256 && keys.size(3) == d && dv >= d && heads % kv == 0, "head_dim");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == heads * d, "out [N, H * d]");
  const int64_t m = rows.size(0), width = visible.size(1), group = heads / kv, slots = keys.size(0);
  const int64_t *row = rows.data_ptr<int64_t>(), *sl = slot.data_ptr<int64_t>(), *st = start.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < q.size(0) && row[j] < out.size(0) && sl[j] >= 0 && sl[j] < slots
        && st[j] >= 0 && st[j] + width <= capacity, "row, slot or start out of range");
    longest = std::max(longest, st[j] + width);
  }
  const float* qp = q.data_ptr<float>();
  const bool* vis = visible.data_ptr<bool>();
  const float fscale = static_cast<float>(scale);
  if (has_avx512() && d % 16 == 0) {  // rows of a call (consecutive, same slot, prefix) in chunks, per KV head
    // Chunks of up to 8 rows, fewer when that leaves under four jobs a thread: sharing a key
    // block between more rows saves less than a thread left idle costs.
    const int64_t threads = on_pool ? shared_pool().threads() : at::get_num_threads();
    const int64_t kChunk = std::clamp<int64_t>(m * kv / (4 * threads), 1, 8);
    std::vector<std::pair<int64_t, int64_t>> chunks;  // [j0, j1)
    for (int64_t j = 0; j < m;) {
      int64_t e = j + 1;
      while (e < m && e - j < kChunk && sl[e] == sl[j] && st[e] == st[j]) ++e;
      chunks.emplace_back(j, e);
      j = e;
    }
    auto run_grouped = [&](auto* dst, const auto* kp, const auto* vp) {
      using K = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      const int64_t n = static_cast<int64_t>(chunks.size()) * kv;
      for_rows(n, 4 * longest * d * group * kChunk, [&](int64_t job) {
        const auto [j0, j1] = chunks[job / kv];
        const int64_t h = job % kv;
        const int64_t base = (sl[j0] * kv + h) * capacity;
        const GroupJob<K> g{qp, kp + base * d, vp + base * dv, row + j0, vis + j0 * width, j1 - j0, heads, h * group,
            group, st[j0], width, d, dv, fscale};
        attend16_group(g, dst);
      });
    };
    with_data(out, "out", [&](auto* dst) {
      with_cache(keys, values, [&](auto* kp, auto* vp) { run_grouped(dst, kp, vp); });
    });
    return;
  }
  auto run = [&](auto* dst, const auto* kp, const auto* vp) {
    using K = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    for_rows(m * heads, 4 * longest * d, [&](int64_t job) {
      const int64_t j = job / heads, h = job % heads;
      const int64_t base = (sl[j] * kv + h / group) * capacity;  // the KV head's first position
      thread_local std::vector<int64_t> pos;  // the visible positions in cache order
      pos.clear();
      for (int64_t p = 0; p < st[j]; ++p) pos.push_back(p);
      for (int64_t i = 0; i < width; ++i)
        if (vis[j * width + i]) pos.push_back(st[j] + i);
      const Job<K> job_of_row{qp + (row[j] * heads + h) * d, kp + base * d, vp + base * dv, d, dv, fscale};
      attend8(job_of_row, pos, dst + row[j] * heads * d + h * d);
    });
  };
  with_data(out, "out", [&](auto* dst) { with_cache(keys, values, [&](auto* kp, auto* vp) { run(dst, kp, vp); }); });
}

// ---- GEMM over exactly quantised weights -------------------------------------------------------
//
// A weight [N, K] (output row n, inputs k) each of whose blocks of 32 inputs of a row is exactly
// scale * q + offset with q in 0..15 and a float16 scale and offset (GGUF's Q4_1), or scale * q
// with q in -128..127 (Q8_0), in panels of 16 output columns:
//   4-bit: codes [P, K, 8] uint8, byte j of input k of panel p holding column j (low nibble) and
//          column j + 8 (high nibble); scales and offsets [P, K / 32, 16] float32;
//   8-bit: codes [P, K, 16] int8; scales [P, K / 32, 16].
// The weight is rebuilt exactly: scale * q needs at most 11 + 8 significant bits, so it is exact in
// float32 and fma(scale, q, offset) rounds once, as the de-quantised float32 weight did. Each
// output is one chain y = fma(x[k], w[k], y) over k = 0 .. K - 1 from 0, whatever the number of
// rows and however they are blocked: row-invariant by construction. Reads 0.75 (4-bit) or 1.1
// (8-bit) bytes per weight instead of 4.

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;


struct Codes4 {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  // The panel's 16 weights at input k (block b = k / 32): w0 columns 0..7, w1 columns 8..15.
  inline void at(int64_t p, int64_t kb_count, int64_t k, __m256& w0, __m256& w1) const {
    const int64_t K = kb_count * kBlock;
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (p * K + k) * 8)));
    const float* s = scales + (p * kb_count + k / kBlock) * kPanel;
    const float* o = offsets + (p * kb_count + k / kBlock) * kPanel;
    w0 = _mm256_fmadd_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), _mm256_loadu_ps(o));
    w1 = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(o + 8));
  }
  // A block's scales and offsets for the 16 columns of panel p (block kb), in registers.
  struct Block16 {
    __m512 s, o;
  };
  SPECDRAFT_AVX512 inline Block16 block16(int64_t p, int64_t kb_count, int64_t kb) const {
    const int64_t at = (p * kb_count + kb) * kPanel;
    return {_mm512_loadu_ps(scales + at), _mm512_loadu_ps(offsets + at)};
  }
  // The same 16 weights as ``at`` in one 16-lane vector (lanes 0..7 the low nibbles, 8..15 the
  // high ones), input k of panel p (K inputs) in block b.
  SPECDRAFT_AVX512 inline __m512 at16(const Block16& b, int64_t p, int64_t K, int64_t k) const {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (p * K + k) * 8));
    __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(bytes, bytes));
    v = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0)),
        _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(b.s, _mm512_cvtepi32_ps(v), b.o);
  }
};

struct Codes8 {
  const int8_t* codes;
  const float* scales;
  inline void at(int64_t p, int64_t kb_count, int64_t k, __m256& w0, __m256& w1) const {
    const int64_t K = kb_count * kBlock;
    const int8_t* c = codes + (p * K + k) * kPanel;
    const float* s = scales + (p * kb_count + k / kBlock) * kPanel;
    w0 = _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)))));
    w1 = _mm256_mul_ps(_mm256_loadu_ps(s + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))));
  }
  struct Block16 {
    __m512 s;
  };
  SPECDRAFT_AVX512 inline Block16 block16(int64_t p, int64_t kb_count, int64_t kb) const {
    return {_mm512_loadu_ps(scales + (p * kb_count + kb) * kPanel)};
  }
  SPECDRAFT_AVX512 inline __m512 at16(const Block16& b, int64_t p, int64_t K, int64_t k) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (p * K + k) * kPanel));
    return _mm512_mul_ps(b.s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
};

// R rows x one panel from de-quantised weights w [K, 16]: acc[r] = chain over k of x[r, k] w[k].
template <int R>
inline void rows_panel(const float* x, int64_t ldx, const float* w, int64_t K, __m256* acc) {
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[2 * r] = _mm256_fmadd_ps(xb, w0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * r + 1]);
    }
  }
}

inline void store_panel(const __m256* acc, float* y, int64_t columns, const float* bias) {
  alignas(32) float out[kPanel];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  for (int64_t j = 0; j < columns; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

// R rows x G panels at once, weights de-quantised as they stream by (each once for the R rows;
// G panels give 2 G independent chains a row to keep the FMA units busy).
template <class Codes, int R, int G>
inline void rows_panels(const Codes& c, const float* x, int64_t ldx, int64_t p0, int64_t kb_count, __m256* acc) {
  for (int i = 0; i < 2 * R * G; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t K = kb_count * kBlock;
  for (int64_t k = 0; k < K; ++k) {
    for (int g = 0; g < G; ++g) {
      __m256 w0, w1;
      c.at(p0 + g, kb_count, k, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        acc[(r * G + g) * 2] = _mm256_fmadd_ps(xb, w0, acc[(r * G + g) * 2]);
        acc[(r * G + g) * 2 + 1] = _mm256_fmadd_ps(xb, w1, acc[(r * G + g) * 2 + 1]);
      }
    }
  }
}

// rows_panels for R rows (1..3) and the panels p0 .. p1 - 1 (at most 2), stored into y.
template <class Codes, int R>
inline void few_rows(const Codes& c, const float* x, int64_t K, int64_t p0, int64_t p1, int64_t N,
    const float* bias, float* y) {
  const int64_t kb_count = K / kBlock;
  __m256 acc[2 * R * 2];
  const int G = static_cast<int>(p1 - p0);
  if (G == 2) {
    rows_panels<Codes, R, 2>(c, x, K, p0, kb_count, acc);
  } else {
    rows_panels<Codes, R, 1>(c, x, K, p0, kb_count, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel(acc + (r * G + g) * 2, y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel),
          bias ? bias + p * kPanel : nullptr);
    }
}

SPECDRAFT_AVX512 inline void store_panel16(__m512 acc, float* y, int64_t columns, const float* bias) {
  alignas(64) float out[kPanel];
  _mm512_store_ps(out, acc);
  for (int64_t j = 0; j < columns; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

template <class Codes, int R, int G>
SPECDRAFT_AVX512 inline void rows_panels16(const Codes& c, const float* x, int64_t ldx, int64_t p0, int64_t kb_count, __m512* acc) {
  for (int i = 0; i < R * G; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t K = kb_count * kBlock;
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    typename Codes::Block16 blocks[G];
    for (int g = 0; g < G; ++g) blocks[g] = c.block16(p0 + g, kb_count, kb);
    for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k) {
      for (int g = 0; g < G; ++g) {
        const __m512 w = c.at16(blocks[g], p0 + g, K, k);
        for (int r = 0; r < R; ++r) acc[r * G + g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r * G + g]);
      }
    }
  }
}

template <class Codes, int R>
SPECDRAFT_AVX512 inline void few_rows16(const Codes& c, const float* x, int64_t K, int64_t p0, int64_t p1,
    int64_t N, const float* bias, float* y) {
  const int64_t kb_count = K / kBlock;
  __m512 acc[R * 4];  // at most R * G of them in use
  const int G = static_cast<int>(p1 - p0);
  switch (G) {
    case 4: rows_panels16<Codes, R, 4>(c, x, K, p0, kb_count, acc); break;
    case 3: rows_panels16<Codes, R, 3>(c, x, K, p0, kb_count, acc); break;
    case 2: rows_panels16<Codes, R, 2>(c, x, K, p0, kb_count, acc); break;
    default: rows_panels16<Codes, R, 1>(c, x, K, p0, kb_count, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel16(acc[r * G + g], y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel), bias ? bias + p * kPanel : nullptr);
    }
}

// R rows x G panels from de-quantised weights w [K, G, 16] (the task's panels side by side):
// per input, G weight vectors and R broadcasts feed R * G FMAs (24 at R = 6, G = 4), enough to
// keep the FMA units busy where one panel at a time left them waiting on loads.
template <int R, int G>
SPECDRAFT_AVX512 inline void rows_buffered16(const float* x, int64_t K, const float* w, int64_t N, int64_t p0,
    const float* bias, float* y) {
  __m512 acc[R * G];
  for (int i = 0; i < R * G; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[G];
    for (int g = 0; g < G; ++g) wk[g] = _mm512_loadu_ps(w + (k * G + g) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int g = 0; g < G; ++g) acc[r * G + g] = _mm512_fmadd_ps(xb, wk[g], acc[r * G + g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g;
      store_panel16(acc[r * G + g], y + r * N + p * kPanel, std::min(kPanel, N - p * kPanel), bias ? bias + p * kPanel : nullptr);
    }
}

// f(std::integral_constant<int, R>{}, m) for rows [0, M) in blocks of R = 6 rows from row m (the
// last block 1..6): register-blocked kernels take their row count as a template argument.
template <typename F>
inline void in_blocks_of_six(int64_t M, const F& f) {
  for (int64_t m = 0; m < M; m += 6) {
    switch (std::min<int64_t>(6, M - m)) {
      case 6: f(std::integral_constant<int, 6>{}, m); break;
      case 5: f(std::integral_constant<int, 5>{}, m); break;
      case 4: f(std::integral_constant<int, 4>{}, m); break;
      case 3: f(std::integral_constant<int, 3>{}, m); break;
      case 2: f(std::integral_constant<int, 2>{}, m); break;
      default: f(std::integral_constant<int, 1>{}, m);
    }
  }
}

template <int G>
SPECDRAFT_AVX512 inline void many_rows16(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
    int64_t p0, const float* bias, float* y) {
  in_blocks_of_six(M, [&](auto rows, int64_t m) {
    rows_buffered16<decltype(rows)::value, G>(x + m * K, K, w, N, p0, bias, y + m * N);
  });
}

// One task of quant_gemm (panels p0 .. p1 - 1, every row), 16 lanes at a time.
template <class Codes>
SPECDRAFT_AVX512 void quant_task16(const Codes& c, const float* x, int64_t M, int64_t K, int64_t N,
    const float* bias, float* y, int64_t p0, int64_t p1) {
  if (M <= 16) {  // decode and drafts: weights de-quantised as they stream by, once for all rows
    const int64_t step = M <= 4 ? 4 : M <= 8 ? 2 : 1;  // panels at once: at most 16 accumulators
    for (int64_t p = p0; p < p1; p += step) {
      const int64_t q = std::min(p1, p + step);
      switch (M) {
#define SPECDRAFT_ROWS(R) \
  case R: few_rows16<Codes, R>(c, x, K, p, q, N, bias, y); break;
        SPECDRAFT_ROWS(1) SPECDRAFT_ROWS(2) SPECDRAFT_ROWS(3) SPECDRAFT_ROWS(4) SPECDRAFT_ROWS(5)
        SPECDRAFT_ROWS(6) SPECDRAFT_ROWS(7) SPECDRAFT_ROWS(8) SPECDRAFT_ROWS(9) SPECDRAFT_ROWS(10)
        SPECDRAFT_ROWS(11) SPECDRAFT_ROWS(12) SPECDRAFT_ROWS(13) SPECDRAFT_ROWS(14) SPECDRAFT_ROWS(15)
        default: few_rows16<Codes, 16>(c, x, K, p, q, N, bias, y);
#undef SPECDRAFT_ROWS
      }
    }
    return;
  }
  // many rows: the task's panels de-quantised once into a buffer [K, G, 16], then rows six at a time
  const int64_t kb_count = K / kBlock, G = p1 - p0;
  thread_local std::vector<float> buffer;
  buffer.resize(K * kPanel * G);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const auto block = c.block16(p0 + g, kb_count, kb);
      for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k)
        _mm512_storeu_ps(buffer.data() + (k * G + g) * kPanel, c.at16(block, p0 + g, K, k));
    }
  switch (G) {
    case 4: many_rows16<4>(x, M, K, buffer.data(), N, p0, bias, y); break;
    case 3: many_rows16<3>(x, M, K, buffer.data(), N, p0, bias, y); break;
    case 2: many_rows16<2>(x, M, K, buffer.data(), N, p0, bias, y); break;
    default: many_rows16<1>(x, M, K, buffer.data(), N, p0, bias, y);
  }
}

// Whether the environment variable ``name`` is "0" (a variant turned off, for tests and comparisons).
bool turned_off(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) == "0";
}

// Whether the AVX-512 variants run (SPECDRAFT_NATIVE_AVX512=0 keeps AVX2: tests compare the two).
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
      && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
      && !turned_off("SPECDRAFT_NATIVE_AVX512");
  return yes;
}

template <class Codes>
void quant_gemm(const Codes& c, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* y) {
  const int64_t P = (N + kPanel - 1) / kPanel, kb_count = K / kBlock;
  const bool wide = has_avx512();
  const int64_t group = wide ? 4 : 2;  // panels per task
  const int64_t tasks = (P + group - 1) / group;
  for_rows(tasks, std::max<int64_t>(1, M) * K * kPanel * group, [&](int64_t task) {
    const int64_t p0 = task * group, p1 = std::min(P, p0 + group);
    if (wide) {
      quant_task16(c, x, M, K, N, bias, y, p0, p1);
      return;
    }
    auto columns = [&](int64_t p) { return std::min(kPanel, N - p * kPanel); };
    if (M < 4) {  // decode and small drafts: de-quantise as the weights stream by
      if (M == 1) few_rows<Codes, 1>(c, x, K, p0, p1, N, bias, y);
      if (M == 2) few_rows<Codes, 2>(c, x, K, p0, p1, N, bias, y);
      if (M == 3) few_rows<Codes, 3>(c, x, K, p0, p1, N, bias, y);
      return;
    }
    // many rows: each panel de-quantised once into a buffer, then rows six at a time
    thread_local std::vector<float> buffer;
    buffer.resize(K * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k = 0; k < K; ++k) {
        __m256 w0, w1;
        c.at(p, kb_count, k, w0, w1);
        _mm256_storeu_ps(buffer.data() + k * kPanel, w0);
        _mm256_storeu_ps(buffer.data() + k * kPanel + 8, w1);
      }
      const float* b = bias ? bias + p * kPanel : nullptr;
      __m256 acc[12];
      for (int64_t m = 0; m < M; m += 6) {
        const int64_t rows = std::min<int64_t>(6, M - m);
        switch (rows) {  // the same chain per output whichever: only the rows in flight differ
          case 6: rows_panel<6>(x + m * K, K, buffer.data(), K, acc); break;
          case 5: rows_panel<5>(x + m * K, K, buffer.data(), K, acc); break;
          case 4: rows_panel<4>(x + m * K, K, buffer.data(), K, acc); break;
          case 3: rows_panel<3>(x + m * K, K, buffer.data(), K, acc); break;
          case 2: rows_panel<2>(x + m * K, K, buffer.data(), K, acc); break;
          default: rows_panel<1>(x + m * K, K, buffer.data(), K, acc);
        }
        for (int64_t r = 0; r < rows; ++r) store_panel(acc + 2 * r, y + (m + r) * N + p * kPanel, columns(p), b);
      }
    }
  });
}

// A GEMM's optional bias: [N] float32 (nullptr: none).
const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_cpu(*bias, "bias");
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() >= n, "bias [N] float32");
  return bias->data_ptr<float>();
}

// x [M, K] float32 @ the packed weight^T (+ bias) -> [M, N] float32.
torch::Tensor quant_linear(
    torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
    c10::optional<torch::Tensor> bias, int64_t n) {
  for (auto* t : {&x, &codes, &scales}) check_cpu(*t, "quant_linear argument");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kBlock == 0 && scales.scalar_type() == at::kFloat && scales.numel() == P * (K / kBlock) * kPanel,
      "scales [P, K / 32, 16] for x's K");
  const float* b = bias_data(bias, n);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (offsets.has_value()) {
    check_cpu(*offsets, "offsets");
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == P * K * 8, "4-bit codes [P, K, 8] uint8");
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->numel() == scales.numel(), "offsets like scales");
    Codes4 c{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets->data_ptr<float>()};
    quant_gemm(c, x.data_ptr<float>(), M, K, n, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.numel() == P * K * kPanel, "8-bit codes [P, K, 16] int8");
    Codes8 c{codes.data_ptr<int8_t>(), scales.data_ptr<float>()};
    quant_gemm(c, x.data_ptr<float>(), M, K, n, b, y.data_ptr<float>());
  }
  return y;
}

// ---- the GEMM over bfloat16 weights (AVX512-BF16) --------------------------------------------
//
// y = x W^T (+ bias) for bfloat16 x and W, float32 sums, rounded to bfloat16 once at the end (as
// torch's bfloat16 linear). The weight is packed in panels of 16 outputs by pairs of inputs,
// [P, K / 2, 16, 2] (``pack_bf16``): one 64-byte load holds input pair k of 16 outputs, and one
// VDPBF16PS adds x[2k] w[2k] + x[2k + 1] w[2k + 1] into each output's float32 sum. Each output's
// chain runs over k = 0 .. K / 2 - 1 in order, whatever the rows in flight, the panels beside it
// or the thread: row-invariant by construction, like the packed-block GEMM. Small products read
// the weights once for all rows (memory-bound); large ones keep 6 rows x 4 panels of sums in
// registers, twice the multiply-adds a cycle of float32 FMAs.

#define SPECDRAFT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool has_bf16_dot() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16")
      && !turned_off("SPECDRAFT_NATIVE_BF16");
  return yes;
}

// R rows x G panels (p0 ..): out[r, p * 16 + j] = bf16(sum_k x[r, k] w[p * 16 + j, k] + bias).
template <int R, int G>
SPECDRAFT_BF16 inline void bf16_panels(const uint16_t* x, int64_t K, const uint16_t* w, int64_t p0,
    int64_t N, const float* bias, uint16_t* y) {
  const int64_t pairs = K / 2;
  const uint16_t* wp[G];
  for (int g = 0; g < G; ++g) wp[g] = w + (p0 + g) * pairs * 32;
  __m512 acc[R * G];
  for (int i = 0; i < R * G; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh wk[G];
    for (int g = 0; g < G; ++g) wk[g] = (__m512bh)_mm512_loadu_si512(wp[g] + k * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[r, 2k] and x[r, 2k + 1] as one 32-bit lane (memcpy: no aliasing)
      std::memcpy(&pair, x + r * K + 2 * k, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < G; ++g) acc[r * G + g] = _mm512_dpbf16_ps(acc[r * G + g], xb, wk[g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t p = p0 + g, columns = std::min<int64_t>(16, N - p * 16);
      __m512 v = acc[r * G + g];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << columns) - 1), bias + p * 16));
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(y + r * N + p * 16, static_cast<__mmask16>((1u << columns) - 1), out);
    }
}

template <int G>
SPECDRAFT_BF16 void bf16_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t p0,
    int64_t N, const float* bias, uint16_t* y) {
  in_blocks_of_six(M, [&](auto rows, int64_t m) {
    bf16_panels<decltype(rows)::value, G>(x + m * K, K, w, p0, N, bias, y + m * N);
  });
}

// x [M, K] bfloat16 @ the packed weight^T (+ float32 bias) -> [M, N] bfloat16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  check_cpu(x, "bf16_linear x");
  check_cpu(packed, "bf16_linear weight");
  TORCH_CHECK(has_bf16_dot(), "bf16_linear needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x [M, K] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), P = (n + 15) / 16;
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.numel() == P * K * 16,
      "weight packed [P, K / 2, 16, 2] bfloat16 for x's K");
  const float* b = bias_data(bias, n);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<BF16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<BF16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<BF16>());
  const int64_t group = 4, tasks = (P + group - 1) / group;
  for_rows(tasks, M * K * 16 * group, [&](int64_t task) {
    const int64_t p0 = task * group;
    switch (std::min(P, p0 + group) - p0) {
      case 4: bf16_rows<4>(xs, M, K, ws, p0, n, b, ys); break;
      case 3: bf16_rows<3>(xs, M, K, ws, p0, n, b, ys); break;
      case 2: bf16_rows<2>(xs, M, K, ws, p0, n, b, ys); break;
      default: bf16_rows<1>(xs, M, K, ws, p0, n, b, ys);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta) * weight)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [n, 2 I]");
  m.def("rope_store", &rope_store, "RoPE of queries and keys; keys and values into the cache");
  m.def("attention", &attention, "row-invariant softmax attention over visible cached keys");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias) with W packed as exact 4- or 8-bit blocks");
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias), bfloat16, W packed [P, K / 2, 16, 2] (AVX512-BF16)");
  m.def("wide", &has_avx512, "whether the AVX-512 variants run here");
  m.def("bf16_dot", &has_bf16_dot, "whether the bfloat16 GEMM (AVX512-BF16) runs here");
  m.def("configure", &configure, "the number of threads the fused kernels share their rows between");
  m.def("use_pool", &use_pool, "this thread's kernels share rows on the pool (or on torch's OpenMP threads)");
}
