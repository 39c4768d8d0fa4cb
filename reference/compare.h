// Spec section 7 checks of a library output (out + lse tensors, any strides and float dtypes)
// against the fp64 reference. Test and tool code only.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "reference/reference.h"
#include "sparse_mla/tensor.h"

namespace sparse_mla::ref {

struct Tolerance {
  double out_abs = 1e-3;        // an element passes within out_abs ...
  double out_rel = 2.01 / 128;  // ... or within out_rel * |ref|
  double cos_diff = 5e-6;       // 1 - 2*sum(a*b) / (sum(a^2) + sum(b^2)) over the whole output
  double lse_abs = 1e-6;
  double lse_rel = 8.01 / 65536;

  // Cache values 2^value_scale_log2 times spec section 7's (testdata's value_scale_log2): the
  // absolute bound, set for those, scales with them, and the reference output's largest
  // magnitude must lie in [2^(k - 20), 2^k] (the case really was scaled).
  int value_scale_log2 = 0;

  static Tolerance sparse(int value_scale_log2 = 0) {
    return scaled(Tolerance{}, value_scale_log2);
  }
  static Tolerance dense(int value_scale_log2 = 0) {
    Tolerance t;
    t.out_abs = 8e-4;
    return scaled(t, value_scale_log2);
  }
  static Tolerance scaled(Tolerance t, int value_scale_log2) {
    t.value_scale_log2 = value_scale_log2;
    t.out_abs = std::ldexp(t.out_abs, value_scale_log2);
    return t;
  }
};

struct CompareResult {
  bool ok = true;
  double max_abs_err = 0;  // over finite out elements
  double cos_diff = 0;     // 0 when both outputs are all zero
  double max_lse_err = 0;  // over finite lse elements
  int64_t bad_out = 0;     // elements out of tolerance (inf/NaN mismatches included)
  int64_t bad_lse = 0;
  std::string message;  // first failure, readable; "" when ok

  std::string summary() const;  // one line: pass/fail and the figures above
};

// out: [b, s_q, h_q, d_v] (bf16, fp16 or fp32); lse: [b, h_q, s_q] fp32.
CompareResult compare_outputs(const TensorView& out, const TensorView& lse, const RefOutput& ref,
                              const Tolerance& tol);

}  // namespace sparse_mla::ref
