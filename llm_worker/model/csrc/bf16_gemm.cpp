// The GEMM over bfloat16 weights (``bf16_linear``).

#include <cstring>

#include "gemm.h"
#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

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

}  // namespace

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

}  // namespace specdraft
