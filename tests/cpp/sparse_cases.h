// Sparse decode test shapes shared by the CPU and the CUDA suites: the corner cases every backend
// must pass (awkward batch / head / topk / page sizes, both formats, extra caches, lengths, sinks,
// strided tensors, -1 and out-of-range indices, shared slots). The CUDA suite adds its forced tile
// configurations and the shapes that exercise its row padding and split lists.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::sparse_cases {

inline ref::SparseCaseConfig base(KVFormat format, int64_t b, int64_t s_q, int64_t h_q,
                                  int64_t topk, int64_t page_size) {
  ref::SparseCaseConfig c;
  c.format = format;
  c.b = b;
  c.s_q = s_q;
  c.h_q = h_q;
  c.topk = topk;
  c.page_size = page_size;
  return c;
}

inline ref::SparseCaseConfig with_extra(ref::SparseCaseConfig c, int64_t extra_topk,
                                        int64_t extra_page_size) {
  c.use_extra = true;
  c.extra_topk = extra_topk;
  c.extra_page_size = extra_page_size;
  return c;
}

// DeepSeek-V4 C1 layout (main topk 128 on 256-token pages, extra 512 on 64), few requests.
inline ref::SparseCaseConfig c1_layout_with_sink() {
  ref::SparseCaseConfig c = with_extra(base(KVFormat::kModel1, 2, 2, 64, 128, 256), 512, 64);
  c.use_sink = true;
  return c;
}

inline ref::SparseCaseConfig v32_h128_with_sink() {
  ref::SparseCaseConfig c = base(KVFormat::kV32, 1, 2, 128, 65, 69);
  c.use_sink = true;
  return c;
}

struct NamedCase {
  std::string name;
  ref::SparseCaseConfig config;
};
inline void PrintTo(const NamedCase& c, std::ostream* os) { *os << c.name; }  // gtest's output

// NaN fed two ways, which every backend must carry to the rows fed and only to them: into q
// (request 0, head 3: every logit of that row) and into a referenced row's rope dims (request 1,
// query token 0: its first 64 entries name that one slot, which no other list names, so its first
// tiles hold only NaN logits; the rest are finite rows). Needs b >= 2, h_q >= 4 and topk > 64.
inline void feed_nan(ref::SparseCase& c) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  c.q.set({0, 0, 3, 7}, nan);
  const int64_t slot = static_cast<int64_t>(c.indices.get({1, 0, 0}));
  std::vector<float> row(c.kv.d_qk());
  ref::Rng rng(c.config.seed + 1);
  for (float& v : row) v = static_cast<float>(rng.uniform(-0.1, 0.1));
  for (size_t d = row.size() - 64; d < row.size(); ++d) row[d] = static_cast<float>(nan);
  ref::write_row(c.kv, slot, 0, row.data());
  // Only request 1's query token 0 names that slot (random lists may share slots).
  for (int64_t i = 0; i < c.config.b; ++i) {
    for (int64_t s = 0; s < c.config.s_q; ++s) {
      for (int64_t k = 0; k < c.config.topk; ++k) {
        if (c.indices.get({i, s, k}) == static_cast<double>(slot)) c.indices.set({i, s, k}, -1.0);
      }
    }
  }
  for (int64_t k = 0; k < 64; ++k) c.indices.set({1, 0, k}, static_cast<double>(slot));
}

// The outputs of a case given feed_nan: NaN in the rows fed, finite beside them.
inline void expect_nan_where_fed(const ref::SparseCase& c) {
  EXPECT_TRUE(std::isnan(c.lse.get({0, 3, 0})));
  EXPECT_TRUE(std::isnan(c.out.get({0, 0, 3, 100})));
  EXPECT_FALSE(std::isnan(c.lse.get({0, 2, 0})));
  EXPECT_FALSE(std::isnan(c.out.get({0, 0, 2, 100})));
  for (int64_t h = 0; h < c.config.h_q; ++h) {
    EXPECT_TRUE(std::isnan(c.lse.get({1, h, 0}))) << "head " << h;
    EXPECT_TRUE(std::isnan(c.out.get({1, 0, h, 5}))) << "head " << h;
    if (c.config.s_q > 1) EXPECT_FALSE(std::isnan(c.lse.get({1, h, 1}))) << "head " << h;
  }
}

// A list whose logits are all -inf: request 1's query token 0 names in every entry one slot,
// which no other list names, holding a row with -inf in ref::minus_inf_dim, and its q is 0.5 in
// that dim for every head. Needs b >= 2 and no extra cache.
inline void feed_minus_inf_logits(ref::SparseCase& c) {
  const int64_t slot = static_cast<int64_t>(c.indices.get({1, 0, 0}));
  ref::Rng rng(c.config.seed + 2);
  ref::write_minus_inf_row(c.kv, rng, slot);
  for (int64_t i = 0; i < c.config.b; ++i) {
    for (int64_t s = 0; s < c.config.s_q; ++s) {
      for (int64_t k = 0; k < c.config.topk; ++k) {
        if (c.indices.get({i, s, k}) == static_cast<double>(slot)) c.indices.set({i, s, k}, -1.0);
      }
    }
  }
  for (int64_t k = 0; k < c.config.topk; ++k) c.indices.set({1, 0, k}, static_cast<double>(slot));
  const int64_t dim = ref::minus_inf_dim(c.config.format);
  for (int64_t h = 0; h < c.config.h_q; ++h) c.q.set({1, 0, h, dim}, 0.5);
}

// The outputs of a case given feed_minus_inf_logits: lse +inf and out 0 in the rows fed, with
// NaN (0 * -inf) in the -inf dim where V holds it (MODEL1; V32's lies past d_v); finite beside.
inline void expect_minus_inf_rows(const ref::SparseCase& c) {
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t dim = ref::minus_inf_dim(c.config.format);
  for (int64_t h = 0; h < c.config.h_q; ++h) {
    EXPECT_EQ(c.lse.get({1, h, 0}), inf) << "head " << h;
    for (int64_t d : {0, 100, 453, 511}) {  // 453: the -inf dim but for V32
      if (d == dim) {
        EXPECT_TRUE(std::isnan(c.out.get({1, 0, h, d}))) << "head " << h << " dim " << d;
      } else {
        EXPECT_EQ(c.out.get({1, 0, h, d}), 0.0) << "head " << h << " dim " << d;
      }
    }
    EXPECT_TRUE(std::isfinite(c.lse.get({0, h, 0}))) << "head " << h;
    EXPECT_TRUE(std::isfinite(c.out.get({0, 0, h, 453}))) << "head " << h;
  }
}

inline std::vector<NamedCase> corner_cases() {
  const KVFormat M1 = KVFormat::kModel1, V32 = KVFormat::kV32;
  std::vector<NamedCase> v;
  v.push_back({"b1_sq1_h1_topk37_page1_model1", base(M1, 1, 1, 1, 37, 1)});
  v.push_back({"b1_sq1_h1_topk37_page1_v32", base(V32, 1, 1, 1, 37, 1)});
  v.push_back({"b3_sq2_h8_page53_v32_extra_page2", with_extra(base(V32, 3, 2, 8, 100, 53), 70, 2)});
  v.push_back(
      {"b3_sq2_h8_page53_model1_extra_page2", with_extra(base(M1, 3, 2, 8, 100, 53), 70, 2)});
  {
    auto c = with_extra(base(M1, 3, 3, 16, 131, 61), 45, 69);
    c.use_topk_length = c.use_extra_topk_length = true;
    c.use_sink = true;
    v.push_back({"b3_sq3_h16_page61_model1_extra_page69_lengths_sink", c});
    c.format = V32;
    v.push_back({"b3_sq3_h16_page61_v32_extra_page69_lengths_sink", c});
  }
  v.push_back(
      {"b74_sq1_h8_page64_model1_extra_page256", with_extra(base(M1, 74, 1, 8, 77, 64), 33, 256)});
  v.push_back({"b2_sq2_h64_page256_model1_c1_sink", c1_layout_with_sink()});
  v.push_back({"b1_sq2_h128_page69_v32_sink", v32_h128_with_sink()});
  v.push_back(
      {"b2_sq1_h128_page2_model1_extra_page1", with_extra(base(M1, 2, 1, 128, 96, 2), 10, 1)});
  v.push_back({"b3_sq1_h16_topk1_page2_model1", base(M1, 3, 1, 16, 1, 2)});
  {
    auto c = with_extra(base(M1, 3, 2, 16, 90, 53), 41, 61);
    c.q_layout = ref::Layout::kTransposed;
    c.index.layout = ref::Layout::kPadded;
    c.extra_index.layout = ref::Layout::kTransposed;
    c.out_layout = ref::Layout::kPadded;
    c.flash_lse_layout = true;
    c.page_stride = ref::default_page_stride(M1, 53) + 48;
    c.extra_page_stride = ref::default_page_stride(M1, 61) + 1024;
    v.push_back({"b3_sq2_h16_model1_strided_q_indices_out_lse_padded_pages", c});
    c.format = V32;
    c.page_stride = ref::default_page_stride(V32, 53) + 16;
    c.extra_page_stride = ref::default_page_stride(V32, 61) + 64;
    v.push_back({"b3_sq2_h16_v32_strided_q_indices_out_lse_padded_pages", c});
    // The same at h_q 100: the Hopper kernel's 64-row CTAs, whose second row block is partly
    // padding, write strided output rows a quad at a time.
    c.h_q = 100;
    v.push_back({"b3_sq2_h100_v32_strided_q_indices_out_lse_padded_pages", c});
    c.format = M1;
    c.page_stride = ref::default_page_stride(M1, 53) + 48;
    c.extra_page_stride = ref::default_page_stride(M1, 61) + 1024;
    v.push_back({"b3_sq2_h100_model1_strided_q_indices_out_lse_padded_pages", c});
  }
  // More heads than one CPU work unit takes (256): the CPU splits them into groups; on a GPU five
  // 64-row blocks, the last partly padding.
  v.push_back({"b2_sq1_h300_topk90_page61_model1_extra_page2",
               with_extra(base(M1, 2, 1, 300, 90, 61), 40, 2)});
  {
    auto c = with_extra(base(M1, 3, 2, 8, 120, 64), 60, 2);
    c.index.invalid_fraction = 0.2;
    c.index.out_of_range_fraction = 0.2;
    c.extra_index.invalid_fraction = 0.3;
    c.extra_index.out_of_range_fraction = 0.3;
    v.push_back({"b3_sq2_h8_model1_minus1_and_out_of_range_indices", c});
    c.format = V32;
    v.push_back({"b3_sq2_h8_v32_minus1_and_out_of_range_indices", c});
  }
  {
    // Requests share one pool of slots, so the same slot appears in several rows.
    auto c = with_extra(base(M1, 3, 3, 8, 70, 53), 50, 2);
    c.shared_slots = true;
    c.use_sink = true;
    v.push_back({"b3_sq3_h8_model1_shared_slots", c});
  }
  {
    // A realistic softmax scale (d_qk^-0.5) instead of the accuracy protocol's d_qk^-0.55.
    auto c = base(M1, 2, 1, 64, 200, 64);
    c.softmax_scale = 1.0f / std::sqrt(512.0f);
    v.push_back({"b2_sq1_h64_model1_default_scale", c});
  }
  {
    // A sharp softmax (scores with a standard deviation of ~57 in base 2): row maxima keep
    // rising from tile to tile by more than the Hopper consumers' slack (2^8), and P grows up to
    // it in between. Enough work that each CTA's part holds several tiles of a pair.
    auto c = base(M1, 16, 2, 64, 1000, 64);
    c.softmax_scale = 30.f;
    v.push_back({"b16_sq2_h64_model1_topk1000_sharp_scale", c});
    c.format = V32;
    v.push_back({"b16_sq2_h64_v32_topk1000_sharp_scale", c});
  }
  {
    // V32 scales that are not powers of two (any fp32 scale is valid in the format), in narrow
    // (16 rows) and two-row-block (128 rows) lists, with the extra cache, lengths and sinks.
    auto c = with_extra(base(V32, 3, 2, 16, 100, 53), 70, 2);
    c.v32_scales_not_pow2 = true;
    c.use_topk_length = c.use_extra_topk_length = true;
    c.use_sink = true;
    v.push_back({"b3_sq2_h16_v32_extra_page2_lengths_sink_scales_not_pow2", c});
    c = base(V32, 2, 2, 128, 300, 64);
    c.v32_scales_not_pow2 = true;
    v.push_back({"b2_sq2_h128_v32_topk300_scales_not_pow2", c});
  }
  {
    // Cache values 2^40 times larger (the scores as usual): outputs, split pairs' partial rows
    // and their combine far outside fp16's range. Smaller values are not possible in FP8 pages:
    // the quantizer's smallest scale is 1e-4 / 448.
    auto c = ref::with_values_scaled(base(M1, 2, 2, 64, 2048, 64), 40);
    v.push_back({"b2_sq2_h64_model1_topk2048_values_times_2pow40", c});
    c = ref::with_values_scaled(base(V32, 2, 2, 64, 2048, 64), 40);
    v.push_back({"b2_sq2_h64_v32_topk2048_values_times_2pow40", c});
  }
  return v;
}

}  // namespace sparse_mla::sparse_cases
