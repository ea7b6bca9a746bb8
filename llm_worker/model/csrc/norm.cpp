// Residual add + RMSNorm (``add_rms_norm``).

#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

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

}  // namespace

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

}  // namespace specdraft
