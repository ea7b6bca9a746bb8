// What the packed GEMMs (quant_gemm.cpp, bf16_gemm.cpp) share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace specdraft {

// f(std::integral_constant<int, R>{}, m) for rows [0, M) in blocks of R = 6 rows from row m (the
// last block 1..6): register-blocked kernels take their row count as a template argument.
template <typename F>
static inline void in_blocks_of_six(int64_t M, const F& f) {
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

}  // namespace specdraft
