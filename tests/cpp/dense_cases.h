// Dense decode test cases shared by the CPU and the CUDA suites.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::dense_cases {

// Causal decode (s_q 3, two requests) where tokens that only the later query tokens see are NaN
// in every byte: request 0's last token (seen by query token 2 alone) and request 1's
// second-to-last (seen by tokens 1 and 2). The query tokens that do not see them must come out
// finite: a hidden token's V must not reach them through 0 * V.
inline ref::DenseCaseConfig nan_past_horizon_config(KVFormat format, int64_t h_q,
                                                    int64_t page_size) {
  ref::DenseCaseConfig c;
  c.format = format;
  c.b = 2;
  c.s_q = 3;
  c.h_q = h_q;
  c.page_size = page_size;
  c.seqlens = {150, 97};
  c.causal = true;
  return c;
}

inline void feed_nan_past_horizon(ref::DenseCase& c) {
  for (int64_t i = 0; i < 2; ++i) {
    const int64_t t = c.config.seqlens[i] - 1 - i;
    const int64_t ps = c.config.page_size;
    const int64_t page = static_cast<int64_t>(c.block_table.get({i, t / ps}));
    ref::poison_slot(c.kv, page * ps + t % ps);
  }
}

inline void expect_nan_only_past_horizon(const ref::DenseCase& c) {
  for (int64_t h = 0; h < c.config.h_q; ++h) {
    for (int64_t s = 0; s < 3; ++s) {
      const bool sees_nan[2] = {s == 2, s >= 1};
      for (int64_t i = 0; i < 2; ++i) {
        EXPECT_EQ(std::isnan(c.lse.get({i, h, s})), sees_nan[i])
            << "request " << i << " query token " << s << " head " << h;
        EXPECT_EQ(std::isnan(c.out.get({i, s, h, 77})), sees_nan[i])
            << "request " << i << " query token " << s << " head " << h;
      }
    }
  }
}

}  // namespace sparse_mla::dense_cases
