#include "reference/compare.h"

#include <cmath>
#include <cstdio>

#include "reference/testdata.h"

namespace sparse_mla::ref {

namespace {

// Both NaN, or both the same infinity.
bool special_match(double a, double r) {
  if (std::isnan(r) || std::isnan(a)) return std::isnan(r) && std::isnan(a);
  return a == r;
}

}  // namespace

std::string CompareResult::summary() const {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%s: max abs err %.3g, cos diff %.3g, max lse err %.3g, bad out %lld, bad lse %lld",
                ok ? "PASS" : "FAIL", max_abs_err, cos_diff, max_lse_err,
                static_cast<long long>(bad_out), static_cast<long long>(bad_lse));
  std::string s = buf;
  if (!ok) s += " (" + message + ")";
  return s;
}

CompareResult compare_outputs(const TensorView& out, const TensorView& lse, const RefOutput& ref,
                              const Tolerance& tol) {
  CompareResult res;
  auto fail = [&](const std::string& msg) {
    if (res.ok) res.message = msg;
    res.ok = false;
  };
  if (out.ndim != 4 || out.shape[0] != ref.b || out.shape[1] != ref.s_q ||
      out.shape[2] != ref.h_q || out.shape[3] != ref.d_v) {
    fail("out shape " + out.shape_string() + " does not match the reference");
    return res;
  }
  if (lse.ndim != 3 || lse.shape[0] != ref.b || lse.shape[1] != ref.h_q ||
      lse.shape[2] != ref.s_q) {
    fail("lse shape " + lse.shape_string() + " does not match the reference");
    return res;
  }
  char buf[256];
  double dot = 0, norm = 0, ref_max = 0;
  for (int64_t i = 0; i < ref.b; ++i) {
    for (int64_t s = 0; s < ref.s_q; ++s) {
      for (int64_t h = 0; h < ref.h_q; ++h) {
        for (int64_t d = 0; d < ref.d_v; ++d) {
          const double a = load(out, {i, s, h, d});
          const double r = ref.out_at(i, s, h, d);
          bool good;
          if (!std::isfinite(a) || !std::isfinite(r)) {
            good = special_match(a, r);
          } else {
            const double err = std::fabs(a - r);
            res.max_abs_err = std::max(res.max_abs_err, err);
            good = err <= tol.out_abs || err <= tol.out_rel * std::fabs(r);
            ref_max = std::max(ref_max, std::fabs(r));
            dot += a * r;
            norm += a * a + r * r;
          }
          if (!good) {
            ++res.bad_out;
            std::snprintf(buf, sizeof buf, "out[%lld, %lld, %lld, %lld] = %.6g, reference %.6g",
                          static_cast<long long>(i), static_cast<long long>(s),
                          static_cast<long long>(h), static_cast<long long>(d), a, r);
            fail(buf);
          }
        }
        const double a = load(lse, {i, h, s});
        const double r = ref.lse_at(i, s, h);
        bool good;
        if (!std::isfinite(a) || !std::isfinite(r)) {
          good = special_match(a, r);
        } else {
          const double err = std::fabs(a - r);
          res.max_lse_err = std::max(res.max_lse_err, err);
          good = err <= tol.lse_abs || err <= tol.lse_rel * std::fabs(r);
        }
        if (!good) {
          ++res.bad_lse;
          std::snprintf(buf, sizeof buf, "lse[%lld, %lld, %lld] (b, h, s) = %.9g, reference %.9g",
                        static_cast<long long>(i), static_cast<long long>(h),
                        static_cast<long long>(s), a, r);
          fail(buf);
        }
      }
    }
  }
  res.cos_diff = norm > 0 ? 1.0 - 2.0 * dot / norm : 0.0;
  if (res.cos_diff > tol.cos_diff) {
    std::snprintf(buf, sizeof buf, "cosine difference %.3g > %.3g", res.cos_diff, tol.cos_diff);
    fail(buf);
  }
  const int k = tol.value_scale_log2;
  if (k != 0 && !(ref_max >= std::ldexp(1.0, k - 20) && ref_max <= std::ldexp(1.0, k))) {
    std::snprintf(buf, sizeof buf, "reference output up to %.3g: not values scaled by 2^%d",
                  ref_max, k);
    fail(buf);
  }
  return res;
}

}  // namespace sparse_mla::ref
