// CPU merge of partial attention results: out = sum_i exp(lse_i - lse) out_i over the non-empty
// parts (lse +-inf is empty), lse = log(sum_i exp(lse_i)), sink applied once at the end.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/attention_common.h"
#include "src/cpu/cpu_backend.h"

namespace sparse_mla::cpu {

namespace {

float load_part(const TensorView& t, int64_t c, int64_t i, int64_t s, int64_t h, int64_t d) {
  if (t.dtype == DType::kFloat32) return *detail::element<const float>(t, c, i, s, h, d);
  return fmt::bf16_to_float(*detail::element<const uint16_t>(t, c, i, s, h, d));
}

void store_out(const TensorView& t, int64_t i, int64_t s, int64_t h, int64_t d, float v) {
  if (t.dtype == DType::kFloat32) {
    *detail::element<float>(t, i, s, h, d) = v;
  } else {
    *detail::element<uint16_t>(t, i, s, h, d) = fmt::float_to_bf16(v);
  }
}

}  // namespace

Status merge_attention(const MergeArgs& args, const MergeProblem& p) {
  const int64_t rows = p.b * p.s_q * p.h_q;
  const float nan = std::numeric_limits<float>::quiet_NaN();
#pragma omp parallel
  {
    std::vector<float> acc(p.d_v);
    std::vector<double> weight(p.n);
    std::vector<char> empty(p.n);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t h = row % p.h_q;
      const int64_t s = row / p.h_q % p.s_q;
      const int64_t i = row / p.h_q / p.s_q;
      float* lse_out = detail::element<float>(args.lse, i, h, s);
      double mx = -std::numeric_limits<double>::infinity();
      bool any = false, has_nan = false;
      for (int64_t c = 0; c < p.n; ++c) {
        const double l = *detail::element<const float>(args.lse_parts, c, i, s, h);
        if (std::isnan(l)) has_nan = true;
        if (std::isinf(l)) continue;
        mx = std::max(mx, l);
        any = true;
      }
      if (has_nan) {  // a NaN lse is propagated rather than silently dropped
        for (int64_t d = 0; d < p.d_v; ++d) store_out(args.out, i, s, h, d, nan);
        *lse_out = nan;
        continue;
      }
      if (!any) {
        for (int64_t d = 0; d < p.d_v; ++d) store_out(args.out, i, s, h, d, 0.f);
        *lse_out = std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0;
      for (int64_t c = 0; c < p.n; ++c) {
        const double l = *detail::element<const float>(args.lse_parts, c, i, s, h);
        empty[c] = std::isinf(l);
        weight[c] = empty[c] ? 0.0 : std::exp(l - mx);
        sum += weight[c];
      }
      const double lse = mx + std::log(sum);
      double factor = 1.0 / sum;
      if (args.attn_sink) {
        factor /=
            1.0 +
            std::exp(static_cast<double>(*detail::element<const float>(*args.attn_sink, h)) - lse);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < p.n; ++c) {
        if (empty[c]) continue;  // its values are never read
        const float w = static_cast<float>(weight[c] * factor);
        for (int64_t d = 0; d < p.d_v; ++d) acc[d] += w * load_part(args.out_parts, c, i, s, h, d);
      }
      for (int64_t d = 0; d < p.d_v; ++d) store_out(args.out, i, s, h, d, acc[d]);
      *lse_out = static_cast<float>(lse);
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
