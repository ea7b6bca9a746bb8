// What the engine reads off a forward's logits between steps: each row's k largest entries
// (``top_k_rows``) and the softmax's largest probability of a row (``top_probability``), on the
// calling thread, 8 lanes at a time.

#include <cmath>
#include <limits>

#include "kernels.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

// Row p[0 .. v)'s k largest into idx (largest first, equal values in index order); false if the
// row holds a NaN (idx then undefined). One pass in index order keeping the best k so far: an
// entry enters only if it is larger than the k-th kept (an equal one came later, so it ranks
// after), and goes after the kept entries it equals.
bool top_k_row(const float* p, int64_t v, int64_t k, float* val, int64_t* idx) {
  int64_t count = 0;
  auto offer = [&](float x, int64_t i) {
    if (count == k && !(x > val[k - 1])) return;
    int64_t at = count < k ? count++ : k - 1;  // the slot it may take: the end, or the k-th's
    while (at > 0 && val[at - 1] < x) {  // after every kept entry >= x
      val[at] = val[at - 1];
      idx[at] = idx[at - 1];
      --at;
    }
    val[at] = x;
    idx[at] = i;
  };
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 x = _mm256_loadu_ps(p + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) return false;
    const __m256 floor = _mm256_set1_ps(count == k ? val[k - 1] : -std::numeric_limits<float>::infinity());
    int mask = count == k ? _mm256_movemask_ps(_mm256_cmp_ps(x, floor, _CMP_GT_OQ)) : 0xff;
    for (; mask; mask &= mask - 1) {
      const int j = __builtin_ctz(mask);
      offer(p[i + j], i + j);
    }
  }
  for (; i < v; ++i) {
    if (std::isnan(p[i])) return false;
    offer(p[i], i);
  }
  return true;
}

}  // namespace

// x [n, v] float32 → [n, k] int64: each row's k largest entries, largest first, equal values in
// index order (a stable sort's first k); a row holding a NaN gets -1 everywhere (the caller ranks
// it another way).
torch::Tensor top_k_rows(torch::Tensor x, int64_t k) {
  check_cpu(x, "logits");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "logits [n, v] float32");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(k >= 1 && k <= v, "k must be in 1..", v);
  auto out = torch::empty({n, k}, torch::kLong);
  std::vector<float> val(k);
  for (int64_t r = 0; r < n; ++r) {
    int64_t* idx = out.data_ptr<int64_t>() + r * k;
    if (!top_k_row(x.data_ptr<float>() + r * v, v, k, val.data(), idx))
      for (int64_t j = 0; j < k; ++j) idx[j] = -1;
  }
  return out;
}

// row [v] float32 → the softmax's largest probability, 1 / Σ exp(x − max) (the sum in double over
// float32 exponentials); NaN if the row holds a NaN or its largest entry is not finite.
double top_probability(torch::Tensor row) {
  check_cpu(row, "logits");
  TORCH_CHECK(row.dim() == 1 && row.scalar_type() == at::kFloat, "a logits row [v] float32");
  const float* p = row.data_ptr<float>();
  const int64_t v = row.size(0);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 x = _mm256_loadu_ps(p + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < v; ++i) has_nan = has_nan || std::isnan(p[i]);
  const float top = max_of(p, v);
  if (has_nan || !std::isfinite(top)) return std::numeric_limits<double>::quiet_NaN();
  const __m256 vtop = _mm256_set1_ps(top);
  double sum = 0.0;
  for (i = 0; i + 8 <= v; i += 8) sum += hsum(exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vtop)));
  for (; i < v; ++i) sum += std::exp(static_cast<double>(p[i] - top));
  return 1.0 / sum;
}

}  // namespace specdraft
