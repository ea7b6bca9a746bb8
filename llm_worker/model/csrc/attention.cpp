// Row-invariant softmax attention over the visible cached keys (``attention``).

#include <utility>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

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
  const K* shared_keys;  // positions [0, shared) read here instead (the same bytes in another slot)
  const K* shared_values;
  int64_t shared;
  const K* key(int64_t p) const { return (p < shared ? shared_keys : keys) + p * d; }
  const K* value(int64_t p) const { return (p < shared ? shared_values : values) + p * dv; }
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
    for (int t = 0; t < 8; ++t) kptr[t] = job.key(pos[std::min(b + t, count - 1)]);
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
    const K* v = job.value(pos[p]);
    for (int64_t i = 0; i < blocks; ++i) acc[i] = _mm256_fmadd_ps(vw, load8(v + 8 * i), acc[i]);
  }
  const __m256 vden = _mm256_set1_ps(denom);
  for (int64_t i = 0; i < blocks; ++i) store8(o + 8 * i, _mm256_div_ps(acc[i], vden));
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
  const K* shared_keys;  // the prefix [0, shared) is read here instead: the same bytes in another
  const K* shared_values;  // slot, whose copy other rows of the forward read too (cache-hot)
  int64_t shared;
  const K* keys_at(int64_t p) const { return p < shared ? shared_keys : keys; }  // + p * d
  const K* values_at(int64_t p) const { return p < shared ? shared_values : values; }  // + p * dv
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
    const int64_t at = pos != nullptr ? pos[p - lo] : p;
    const K* v = g.values_at(at) + at * g.dv;
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
    const K* v = g.values_at(p) + p * g.dv;
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
  // A block's keys all come from one buffer: blocks end at the shared prefix's end.
  auto block_end = [&](int64_t k0) { return std::min(std::min(end, k0 + kBlock), k0 < g.shared ? g.shared : end); };
  // scores: the prefix (and causal rows' new keys) a block at a time for every pair, then each
  // other row's own new keys. Lanes past a block's (or a row's) last key repeat that key; their
  // scores land where the next block writes over them, or past the row's keys (never read).
  for (int64_t k0 = 0, k1 = 0; k0 < end; k0 = k1) {
    k1 = block_end(k0);
    if (k1 < end) prefetch_rows(g.keys_at(k1), k1, block_end(k1), d);
    auto score = [&](const auto* keys, int64_t first) SPECDRAFT_AVX512 {  // key p at keys + (p - first) * d
      using KB = std::remove_const_t<std::remove_pointer_t<decltype(keys)>>;
      for (int64_t pr = 0; pr < pairs; ++pr) {
        const int64_t hi = std::min(k1, reach(pr / g.group));
        const float* q = query(pr);
        float* wp = w.data() + pr * stride;
        for (int64_t b = k0; b < hi; b += 8) {
          const KB* kptr[8];
          for (int t = 0; t < 8; ++t) kptr[t] = keys + (std::min(b + t, hi - 1) - first) * d;
          _mm256_storeu_ps(wp + b, _mm256_mul_ps(dot8_wide(q, kptr, d), vscale));
        }
      }
    };
    if (g.rows > 1) {  // the block in float32 once for every row's heads (a bfloat16 cache widened)
      score(widened(g.keys_at(k0), k0, k1, d, key_block), k0);
    } else {  // one row's heads: a bfloat16 cache widened as it is loaded
      score(g.keys_at(k0), 0);
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
  for (int64_t k0 = 0, k1 = 0; k0 < end; k0 = k1) {
    k1 = block_end(k0);
    if (k1 < end) prefetch_rows(g.values_at(k1), k1, block_end(k1), g.dv);
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

}  // namespace

// Softmax attention of query rows over their visible cached keys. Row j (q row rows[j]) sees the
// committed prefix [0, start[j]) of cache slot slot[j] and, among its call's new rows (cache
// positions start[j] + i), those with visible[j][i]. Per query head: scores = q . k * scale over
// the visible keys in cache order, w = exp(score - max), out = sum w v / sum w, both sums in the
// order of the visible keys. A row's result depends only on its own visible keys: more rows in the
// forward, and other rows' keys between its own, change nothing. Query head h reads KV head
// h / (H / K). q in float32; the cache's keys and values both float32 or both bfloat16 (widened
// exactly: the same arithmetic as on their float32 copies). Output: out [N, H * d] (float32 or
// bfloat16) at row rows[j].
//
// Shared prefixes (``source``, ``shared``: both or neither, [m] each): row j reads cache positions
// [0, shared[j]) from slot source[j] instead of its own. The caller promises that slot holds the
// same bytes there (the same tokens' K/V on a batch-invariant forward): the result is the same,
// bit for bit, and the rows of a forward that share one system prompt read one copy of it, which
// stays in the processor's caches, instead of one copy each from memory.
void attention(
    torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor rows, torch::Tensor slot,
    torch::Tensor start, torch::Tensor visible, double scale, torch::Tensor out,
    c10::optional<torch::Tensor> source, c10::optional<torch::Tensor> shared) {
  for (auto* t : {&q, &keys, &values, &rows, &slot, &start, &visible, &out}) check_cpu(*t, "attention argument");
  TORCH_CHECK(source.has_value() == shared.has_value(), "source and shared: both or neither");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && visible.dim() == 2, "shapes");
  TORCH_CHECK(visible.scalar_type() == at::kBool, "visible must be bool");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const int64_t heads = q.size(1), d = q.size(2), kv = keys.size(1), capacity = keys.size(2), dv = values.size(3);
  TORCH_CHECK(d % 8 == 0 && d <= 256 && keys.size(3) == d && dv >= d && heads % kv == 0, "head_dim");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == heads * d, "out [N, H * d]");
  const int64_t m = rows.size(0), width = visible.size(1), group = heads / kv, slots = keys.size(0);
  const int64_t *row = rows.data_ptr<int64_t>(), *sl = slot.data_ptr<int64_t>(), *st = start.data_ptr<int64_t>();
  const int64_t *src = sl, *sh = nullptr;  // sh == nullptr: nothing shared
  if (source.has_value()) {
    for (auto* t : {&*source, &*shared}) {
      check_cpu(*t, "attention argument");
      TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == rows.numel(), "source and shared: [m] int64");
    }
    src = source->data_ptr<int64_t>();
    sh = shared->data_ptr<int64_t>();
  }
  int64_t longest = 0;
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < q.size(0) && row[j] < out.size(0) && sl[j] >= 0 && sl[j] < slots
        && st[j] >= 0 && st[j] + width <= capacity, "row, slot or start out of range");
    TORCH_CHECK(sh == nullptr || (src[j] >= 0 && src[j] < slots && sh[j] >= 0 && sh[j] <= st[j]),
        "source slot or shared prefix out of range");
    longest = std::max(longest, st[j] + width);
  }
  auto shared_of = [&](int64_t j) { return sh != nullptr ? sh[j] : int64_t{0}; };
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
      while (e < m && e - j < kChunk && sl[e] == sl[j] && st[e] == st[j] && src[e] == src[j]
          && shared_of(e) == shared_of(j))
        ++e;
      chunks.emplace_back(j, e);
      j = e;
    }
    auto run_grouped = [&](auto* dst, const auto* kp, const auto* vp) {
      using K = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      const int64_t n = static_cast<int64_t>(chunks.size()) * kv;
      for_rows(n, 4 * longest * d * group * kChunk, [&](int64_t job) {
        const auto [j0, j1] = chunks[job / kv];
        const int64_t h = job % kv;
        const int64_t base = (sl[j0] * kv + h) * capacity, from = (src[j0] * kv + h) * capacity;
        const GroupJob<K> g{qp, kp + base * d, vp + base * dv, row + j0, vis + j0 * width, j1 - j0, heads, h * group,
            group, st[j0], width, d, dv, fscale, kp + from * d, vp + from * dv, shared_of(j0)};
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
      const int64_t from = (src[j] * kv + h / group) * capacity;
      thread_local std::vector<int64_t> pos;  // the visible positions in cache order
      pos.clear();
      for (int64_t p = 0; p < st[j]; ++p) pos.push_back(p);
      for (int64_t i = 0; i < width; ++i)
        if (vis[j * width + i]) pos.push_back(st[j] + i);
      const Job<K> job_of_row{
          qp + (row[j] * heads + h) * d, kp + base * d, vp + base * dv, d, dv, fscale, kp + from * d, vp + from * dv,
          shared_of(j)};
      attend8(job_of_row, pos, dst + row[j] * heads * d + h * d);
    });
  };
  with_data(out, "out", [&](auto* dst) { with_cache(keys, values, [&](auto* kp, auto* vp) { run(dst, kp, vp); }); });
}

}  // namespace specdraft
