// n / d for 0 <= n < 2^31 with a multiply and a shift (Granlund-Montgomery, round-up multiplier):
// the page of a slot without an integer division per token (a runtime 32-bit division is about
// twenty instructions). Built on the host, used by the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "src/kv/format.h"

namespace sparse_mla::cuda {

struct SlotDivider {
  uint32_t d = 1, mul = 1, shift = 0;

  // d is clamped to 2^31, which gives 0 for every n < 2^31, as the true division by a larger d
  // would.
  static SlotDivider make(int64_t d) {
    SlotDivider s;
    s.d = static_cast<uint32_t>(std::clamp<int64_t>(d, 1, int64_t{1} << 31));
    while ((uint64_t{1} << s.shift) < s.d) ++s.shift;
    // < 2^32 for every d <= 2^31: 2^shift < 2d, and a power of two gives exactly 1.
    s.mul =
        static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s.shift) - s.d)) / s.d + 1);
    return s;
  }
  // mulhi(n, mul) < n, so the sum stays below 2^32 for n < 2^31.
  SPARSE_MLA_HD uint32_t quotient(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
  SPARSE_MLA_HD uint32_t remainder(uint32_t n, uint32_t q) const { return n - q * d; }
};

}  // namespace sparse_mla::cuda
