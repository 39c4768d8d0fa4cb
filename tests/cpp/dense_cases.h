// Dense decode test cases shared by the CPU and the CUDA suites.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

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

// Every logit of request 1 -inf: each of its tokens holds a row with -inf in ref::minus_inf_dim,
// and its q is 0.5 in that dim (every query token and head). Needs b >= 2.
inline void feed_minus_inf_logits(ref::DenseCase& c) {
  ref::Rng rng(c.config.seed + 2);
  const int64_t ps = c.config.page_size;
  const auto len = static_cast<int64_t>(c.cache_seqlens.get({1}));
  for (int64_t t = 0; t < len; ++t) {
    const auto page = static_cast<int64_t>(c.block_table.get({1, t / ps}));
    ref::write_minus_inf_row(c.kv, rng, page * ps + t % ps);
  }
  const int64_t dim = ref::minus_inf_dim(c.config.format);
  for (int64_t s = 0; s < c.config.s_q; ++s) {
    for (int64_t h = 0; h < c.config.h_q; ++h) c.q.set({1, s, h, dim}, 0.5);
  }
}

// The outputs of a case given feed_minus_inf_logits: request 1's rows have lse +inf and out 0,
// with NaN (0 * -inf) in the -inf dim where V holds it (all formats but V32); request 0 finite.
inline void expect_minus_inf_rows(const ref::DenseCase& c) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t dim = ref::minus_inf_dim(c.config.format);
  for (int64_t s = 0; s < c.config.s_q; ++s) {
    for (int64_t h = 0; h < c.config.h_q; ++h) {
      EXPECT_EQ(c.lse.get({1, h, s}), inf) << "query token " << s << " head " << h;
      for (int64_t d : {0, 100, 453, 511}) {  // 453: the -inf dim but for V32
        if (d == dim) {
          EXPECT_TRUE(std::isnan(c.out.get({1, s, h, d}))) << "token " << s << " head " << h;
        } else {
          EXPECT_EQ(c.out.get({1, s, h, d}), 0.0) << "token " << s << " head " << h << " dim " << d;
        }
      }
      EXPECT_TRUE(std::isfinite(c.lse.get({0, h, s}))) << "query token " << s << " head " << h;
      EXPECT_TRUE(std::isfinite(c.out.get({0, s, h, 453}))) << "query token " << s << " head " << h;
    }
  }
}

}  // namespace sparse_mla::dense_cases
