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

// acc[d] += w * part[d] over one row of a part (fp32 or bf16, element stride `stride`).
void accumulate(const TensorView& parts, const void* row, int64_t stride, int d_v, float w,
                float* acc) {
  if (parts.dtype == DType::kFloat32) {
    const float* x = static_cast<const float*>(row);
    for (int d = 0; d < d_v; ++d) acc[d] += w * x[d * stride];
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(row);
    for (int d = 0; d < d_v; ++d) acc[d] += w * fmt::bf16_to_float(x[d * stride]);
  }
}

void store_row(const TensorView& out, int64_t i, int64_t s, int64_t h, int d_v, const float* v,
               float fill, bool use_fill) {
  const int64_t stride = out.strides[3];
  if (out.dtype == DType::kFloat32) {
    float* o = detail::element<float>(out, i, s, h);
    for (int d = 0; d < d_v; ++d) o[d * stride] = use_fill ? fill : v[d];
  } else {
    uint16_t* o = detail::element<uint16_t>(out, i, s, h);
    for (int d = 0; d < d_v; ++d) o[d * stride] = fmt::float_to_bf16(use_fill ? fill : v[d]);
  }
}

}  // namespace

Status merge_attention(const MergeArgs& args, const MergeProblem& p) {
  const int64_t rows = p.b * p.s_q * p.h_q;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Three passes over a row's parts (maximum, sum, weighted sum) read the lse again instead of
  // keeping a weight a part, so a thread's memory does not grow with n.
#pragma omp parallel
  {
    std::vector<float> acc(p.d_v);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t h = row % p.h_q;
      const int64_t s = row / p.h_q % p.s_q;
      const int64_t i = row / p.h_q / p.s_q;
      float* lse_out = detail::element<float>(args.lse, i, h, s);
      auto part_lse = [&](int64_t c) -> double {
        return *detail::element<const float>(args.lse_parts, c, i, s, h);
      };
      double mx = -std::numeric_limits<double>::infinity();
      bool any = false, has_nan = false;
      for (int64_t c = 0; c < p.n; ++c) {
        const double l = part_lse(c);
        if (std::isnan(l)) has_nan = true;
        if (std::isinf(l)) continue;  // an empty part
        mx = std::max(mx, l);
        any = true;
      }
      if (has_nan) {  // a NaN lse is propagated rather than silently dropped
        store_row(args.out, i, s, h, p.d_v, nullptr, nan, true);
        *lse_out = nan;
        continue;
      }
      if (!any) {
        store_row(args.out, i, s, h, p.d_v, nullptr, 0.f, true);
        *lse_out = std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0;
      for (int64_t c = 0; c < p.n; ++c) {
        const double l = part_lse(c);
        if (!std::isinf(l)) sum += std::exp(l - mx);
      }
      const double lse = mx + std::log(sum);
      double factor = 1.0 / sum;
      if (args.attn_sink) {
        const double sink = *detail::element<const float>(*args.attn_sink, h);
        factor /= 1.0 + std::exp(sink - lse);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < p.n; ++c) {
        const double l = part_lse(c);
        if (std::isinf(l)) continue;  // its values are never read
        const void* part =
            args.out_parts.dtype == DType::kFloat32
                ? static_cast<const void*>(detail::element<const float>(args.out_parts, c, i, s, h))
                : static_cast<const void*>(
                      detail::element<const uint16_t>(args.out_parts, c, i, s, h));
        accumulate(args.out_parts, part, args.out_parts.strides[4], p.d_v,
                   static_cast<float>(std::exp(l - mx) * factor), acc.data());
      }
      store_row(args.out, i, s, h, p.d_v, acc.data(), 0.f, false);
      *lse_out = static_cast<float>(lse);
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
