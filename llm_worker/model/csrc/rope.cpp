// RoPE and the KV cache write (``rope_store``).

#include <vector>

#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

// ---- RoPE and the KV cache write ------------------------------------------------------------

// One half of a head's RoPE: out[i] = x[i] * cos[i] + partner[i] * sin[i] for i < n, 8 lanes at a
// time, the last n % 8 through the same vector code (a zero-padded tail: ``load_tail``), so each
// lane's arithmetic is the same wherever it falls.
template <typename O>
inline void rope_half(const float* x, const float* partner, const float* cos, const float* sin, O* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(load8(x + i), load8(cos + i));
    store8(out + i, _mm256_fmadd_ps(load8(partner + i), load8(sin + i), v));
  }
  if (i < n) {
    const int64_t k = n - i;
    __m256 v = _mm256_mul_ps(load_tail(x + i, k), load_tail(cos + i, k));
    store_tail(out + i, _mm256_fmadd_ps(load_tail(partner + i, k), load_tail(sin + i, k), v), k);
  }
}

// One head's RoPE: out = x * cos + (x2, x1) * sin_signed (sin_signed = (-sin1, sin2)), in float32,
// stored as O (float32, or bfloat16 rounded to nearest even). Each half on its own: where half the
// head is not a multiple of 8 (head_dim 24, 40) a vector across the middle would take its partners
// from both halves and read past the head's end.
template <typename O>
inline void rope_head(const float* x, const float* cos, const float* sin, O* out, int64_t d) {
  const int64_t half = d / 2;
  rope_half(x, x + half, cos, sin, out, half);  // x1 · cos1 + x2 · (-sin1)
  rope_half(x + half, x, cos + half, sin + half, out + half, half);  // x2 · cos2 + x1 · sin2
}

}  // namespace

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

}  // namespace specdraft
