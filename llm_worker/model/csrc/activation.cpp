// SiLU(gate) * up (``silu_mul``).

#include "kernels.h"
#include "pool.h"
#include "tensors.h"
#include "vec.h"

namespace specdraft {

namespace {

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

}  // namespace

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

}  // namespace specdraft
