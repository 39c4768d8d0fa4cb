// CPU sparse decode through the public API against the fp64 reference (spec sections 3 and 7):
// awkward batch/page/head/topk sizes, both formats, extra caches, lengths, sinks, -1 and
// out-of-range indices, NaN in every unreferenced slot, strided tensors, determinism; plus the
// CPU micro-kernels of every ISA this machine runs against naive loops.
#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "src/cpu/attention_common.h"
#include "src/kv/format.h"
#include "tests/cpp/sparse_cases.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla {
namespace {

const Options kCPU{Backend::kCPU, nullptr};
constexpr double kInf = std::numeric_limits<double>::infinity();

using test_support::test_seed;

// Runs the CPU backend on a poisoned output and checks it against the reference.
ref::CompareResult run_and_compare(ref::SparseCase& c) {
  c.poison_outputs();
  const Status st = sparse_decode(c.args(), Workspace{}, kCPU);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const ref::RefOutput r = ref::sparse_decode_reference(c.args());
  return ref::compare_outputs(c.out.view(), c.lse.view(), r,
                              ref::Tolerance::sparse(c.config.value_scale_log2));
}

using sparse_cases::base;
using sparse_cases::with_extra;

class CpuSparseDecode : public ::testing::TestWithParam<sparse_cases::NamedCase> {};

TEST_P(CpuSparseDecode, MatchesReference) {
  ref::SparseCaseConfig cfg = GetParam().config;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
}

// The corner cases of every backend, and an extra list that is no multiple of a 64-token tile.
std::vector<sparse_cases::NamedCase> sparse_params() {
  std::vector<sparse_cases::NamedCase> v = sparse_cases::corner_cases();
  auto c = with_extra(base(KVFormat::kModel1, 2, 2, 64, 128, 256), 200, 64);
  c.use_sink = true;
  v.push_back({"b2_sq2_h64_page256_model1_extra200_sink", c});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuSparseDecode, ::testing::ValuesIn(sparse_params()),
                         [](const auto& info) { return info.param.name; });

// topk_length / extra_topk_length of 0, partial, exactly topk and beyond topk (clamped); the
// entries past each length point at NaN slots or far out of the cache and must not be read.
TEST(CpuSparseDecodeLengths, ZeroPartialAndBeyondTopk) {
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32}) {
    ref::SparseCaseConfig cfg = with_extra(base(format, 5, 2, 8, 75, 61), 40, 2);
    cfg.use_sink = true;
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::SparseCase c = ref::make_sparse_case(cfg);
    c.topk_length = ref::make_int_tensor({0, 9, 75, 1000, 0});
    c.extra_topk_length = ref::make_int_tensor({40, 0, 3, 0, -7});
    // Entries beyond the lengths: huge or negative slots.
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t len = static_cast<int64_t>(c.topk_length.get({i}));
        for (int64_t k = std::max<int64_t>(len, 0); k < 75; ++k) {
          c.indices.set({i, s, k}, k % 2 ? 2000000000.0 : -5.0);
        }
      }
    }
    ref::Rng rng(cfg.seed + 1);
    c.refresh_cache(rng);
    const ref::CompareResult res = run_and_compare(c);
    EXPECT_TRUE(res.ok) << res.summary();
    // Request 4 has no valid entry in either cache: out 0 and lse +inf, whatever the sink.
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < 8; ++h) {
        EXPECT_EQ(c.lse.get({4, h, s}), kInf);
        EXPECT_EQ(c.out.get({4, s, h, 0}), 0.0);
      }
    }
  }
}

// The sparse cases refuse value scales their format cannot hold exactly, as the dense ones do.
TEST(SparseReference, ValueScaleOutsideTheFormatThrows) {
  const auto scaled = [](KVFormat format, int k) {
    return ref::with_values_scaled(base(format, 1, 1, 8, 16, 64), k);
  };
  EXPECT_THROW(ref::make_sparse_case(scaled(KVFormat::kModel1, -1)), std::invalid_argument);
  EXPECT_THROW(ref::make_sparse_case(scaled(KVFormat::kV32, 61)), std::invalid_argument);
  EXPECT_NO_THROW(ref::make_sparse_case(scaled(KVFormat::kV32, 60)));
}

TEST(CpuSparseDecodeCorners, AllIndicesMinusOne) {
  ref::SparseCaseConfig cfg = with_extra(base(KVFormat::kModel1, 3, 2, 16, 70, 64), 20, 2);
  cfg.use_sink = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  c.indices.fill(-1);
  c.extra_indices.fill(-1);
  c.attn_sink.set({0}, kInf);  // +inf sink on an empty row must not produce NaN
  ref::Rng rng(cfg.seed + 1);
  c.refresh_cache(rng);  // every slot is now NaN
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < 16; ++h) {
        EXPECT_EQ(c.lse.get({i, h, s}), kInf);
        for (int64_t d = 0; d < kDV; d += 97) EXPECT_EQ(c.out.get({i, s, h, d}), 0.0);
      }
    }
  }
}

// Checks a case of `cfg` changed by `feed`: against the reference, then by `expect`.
void check_fed_case(ref::SparseCaseConfig cfg, void (*feed)(ref::SparseCase&),
                    void (*expect)(const ref::SparseCase&)) {
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  feed(c);
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
  expect(c);
}

// NaN in a query row or in a referenced cache row makes the rows that use it NaN (out and lse),
// as in the reference, wherever the NaN token sits in the list: a row of NaN logits alone used to
// read as empty (out 0, lse +inf), and a NaN token in a tile before the first finite one was
// dropped.
TEST(CpuSparseDecodeCorners, NanInQueryOrReferencedRowPropagates) {
  check_fed_case(base(KVFormat::kV32, 2, 1, 8, 70, 64), sparse_cases::feed_nan,
                 sparse_cases::expect_nan_where_fed);
}

// A list whose logits are all -inf (its one row -inf in a dim where q is positive): lse +inf and
// out 0 as with no valid slot, but NaN where V holds the -inf (0 * -inf), sink or not; the sum
// of 0 used to give the reference NaN everywhere (robustness.md finding 19).
TEST(CpuSparseDecodeCorners, ListOfMinusInfLogitsReadsAsEmptyButForInfV) {
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32}) {
    ref::SparseCaseConfig cfg = base(format, 2, 2, 8, 70, 64);
    cfg.use_sink = true;
    check_fed_case(cfg, sparse_cases::feed_minus_inf_logits, sparse_cases::expect_minus_inf_rows);
  }
}

// A dim of extent 1 only ever has index 0, so its stride is never used: a negative one (numpy's
// a[::-1] on such a dim) is accepted and changes nothing.
TEST(CpuSparseDecodeCorners, SizeOneDimsMayHaveNegativeStrides) {
  ref::SparseCaseConfig cfg = base(KVFormat::kModel1, 2, 1, 8, 40, 64);
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  c.poison_outputs();
  SparseDecodeArgs args = c.args();
  args.q.strides[1] = -12345;        // s_q = 1
  args.indices.strides[1] = -77;
  args.out.strides[1] = -3;
  args.lse.strides[2] = -1;
  const Status st = sparse_decode(args, Workspace{}, kCPU);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const ref::CompareResult res =
      ref::compare_outputs(c.out.view(), c.lse.view(), ref::sparse_decode_reference(c.args()),
                           ref::Tolerance::sparse(c.config.value_scale_log2));
  EXPECT_TRUE(res.ok) << res.summary();
}

// An empty batch whose tensors have all-zero strides (numpy 2's zero-size arrays) addresses
// nothing and is accepted, whatever its layout would have been.
TEST(CpuSparseDecodeCorners, EmptyBatchWithZeroStrides) {
  ref::HostCache cache(ref::CacheConfig{KVFormat::kModel1, 2, 3, 1, 0});
  alignas(16) static uint8_t none[16];
  SparseDecodeArgs args;
  args.q = TensorView::strided(none, DType::kBFloat16, Device{}, {0, 1, 2, 512}, {0, 0, 0, 0});
  args.kv = cache.desc();
  args.indices = TensorView::strided(none, DType::kInt32, Device{}, {0, 1, 8}, {0, 0, 0});
  args.out = TensorView::strided(none, DType::kBFloat16, Device{}, {0, 1, 2, 512}, {0, 0, 0, 0});
  args.lse = TensorView::strided(none, DType::kFloat32, Device{}, {0, 2, 1}, {0, 0, 0});
  const Status st = sparse_decode(args, Workspace{}, kCPU);
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// Sinks of +inf (out 0), -inf (no effect) and finite values, one per head; lse excludes the sink.
TEST(CpuSparseDecodeCorners, SinkInfinitiesAndFinite) {
  ref::SparseCaseConfig cfg = with_extra(base(KVFormat::kModel1, 3, 2, 8, 50, 53), 30, 64);
  cfg.use_sink = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  const double sinks[8] = {kInf, -kInf, 0.0, 5.0, -3.0, 1e30, -1e30, 7.5};
  for (int h = 0; h < 8; ++h) c.attn_sink.set({h}, sinks[h]);
  ref::SparseCase no_sink = c;
  no_sink.attn_sink = ref::HostTensor();
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
  const ref::CompareResult res2 = run_and_compare(no_sink);
  EXPECT_TRUE(res2.ok) << res2.summary();
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t d = 0; d < kDV; d += 31) {
        EXPECT_EQ(c.out.get({i, s, 0, d}), 0.0);                            // +inf sink
        EXPECT_EQ(c.out.get({i, s, 1, d}), no_sink.out.get({i, s, 1, d}));  // -inf sink
      }
      for (int h = 0; h < 8; ++h) EXPECT_EQ(c.lse.get({i, h, s}), no_sink.lse.get({i, h, s}));
    }
  }
}

// A case small enough to compute by hand: two MODEL1 rows of constant values, both exactly
// representable (0.5 = 256 * 2^-9, -0.25 = 256 * 2^-10), q = 2^-9 everywhere, scale 1.
TEST(CpuSparseDecodeCorners, HandComputedTwoRows) {
  ref::HostCache cache(ref::CacheConfig{KVFormat::kModel1, 2, 3, 1, 0});
  std::vector<float> a(512, 0.5f), bvals(512, -0.25f);
  ref::write_row(cache, 1, 0, a.data());
  ref::write_row(cache, 4, 0, bvals.data());
  ref::HostTensor q = ref::make_tensor(DType::kBFloat16, {1, 1, 2, 512});
  q.fill(1.0 / 512);
  ref::HostTensor idx = ref::make_int_tensor({1, -1, 4, 5000});
  SparseDecodeArgs args;
  args.q = q.view();
  args.kv = cache.desc();
  args.indices = TensorView::contiguous(idx.data(), DType::kInt32, Device{}, {1, 1, 4});
  args.softmax_scale = 1.0f;
  ref::HostTensor sink = ref::make_float_tensor({-std::numeric_limits<float>::infinity(), 1.0f});
  args.attn_sink = sink.view();
  ref::HostTensor out = ref::make_out(DType::kBFloat16, 1, 1, 2);
  ref::HostTensor lse = ref::make_lse(1, 2, 1);
  args.out = out.view();
  args.lse = lse.view();
  ASSERT_TRUE(sparse_decode(args, Workspace{}, kCPU).ok());

  const double la = 0.5, lb = -0.25;  // 512 * 2^-9 * value
  const double lse_expected = std::log(std::exp(la) + std::exp(lb));
  const double o = (std::exp(la) * 0.5 + std::exp(lb) * -0.25) / (std::exp(la) + std::exp(lb));
  const double sink_factor = 1.0 / (1.0 + std::exp(1.0 - lse_expected));
  const ref::RefOutput r = ref::sparse_decode_reference(args);
  for (int h = 0; h < 2; ++h) {
    const double expect_out = h == 0 ? o : o * sink_factor;
    EXPECT_NEAR(r.lse_at(0, 0, h), lse_expected, 1e-12);
    EXPECT_NEAR(lse.get({0, h, 0}), lse_expected, 1e-6);
    for (int d = 0; d < 512; d += 51) {
      EXPECT_NEAR(r.out_at(0, 0, h, d), expect_out, 1e-12);
      EXPECT_NEAR(out.get({0, 0, h, d}), expect_out, 2e-3);
    }
  }
}

// Same inputs give bitwise the same outputs, with 1, 2 or 7 threads (head / row groups split
// differently).
TEST(CpuSparseDecodeDeterminism, BitwiseAcrossRunsAndThreadCounts) {
  ref::SparseCaseConfig cfg = with_extra(base(KVFormat::kModel1, 2, 1, 24, 150, 64), 90, 2);
  cfg.use_sink = true;
  cfg.use_topk_length = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<uint8_t>> outs;
  for (int threads : {1, 2, 7, 2}) {
    omp_set_num_threads(threads);
    c.poison_outputs();
    ASSERT_TRUE(sparse_decode(c.args(), Workspace{}, kCPU).ok());
    outs.push_back(ref::output_bytes(c.out, c.lse));
  }
  omp_set_num_threads(saved);
  for (size_t k = 1; k < outs.size(); ++k) EXPECT_EQ(outs[k], outs[0]) << "run " << k;
  const ref::CompareResult res = ref::compare_outputs(
      c.out.view(), c.lse.view(), ref::sparse_decode_reference(c.args()), ref::Tolerance::sparse());
  EXPECT_TRUE(res.ok) << res.summary();
}

// targets.md C1 at b = 8 (s_q 2, h_q 64, main topk 128 on 256-token pages, extra topk 512 on
// 64-token pages, requests of 16384 + 4096 slots): checked against the reference, and timed for
// the log (best of 5; FLOPs = 2 * h_q * attended * (d_qk + d_v) per query token). No assertion on
// time: the machine is shared.
TEST(CpuSparseDecodePerf, C1Batch8AccuracyAndThroughput) {
  ref::SparseCaseConfig cfg = with_extra(base(KVFormat::kModel1, 8, 2, 64, 128, 256), 512, 64);
  cfg.slots_per_request = 16384;
  cfg.extra_slots_per_request = 4096;
  cfg.softmax_scale = 1.0f / std::sqrt(512.0f);
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  double best_ms = 1e30;
  for (int run = 0; run < 5; ++run) {
    c.poison_outputs();
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = sparse_decode(c.args(), Workspace{}, kCPU);
    const auto t1 = std::chrono::steady_clock::now();
    ASSERT_TRUE(st.ok()) << st.to_string();
    best_ms = std::min(best_ms, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  const double flops = 2.0 * 64 * (128 + 512) * (512 + 512) * 8 * 2;
  std::printf(
      "[ perf     ] C1 b=8 s_q=2 h_q=64 MODEL1: %.2f ms, %.1f GFLOP/s (%s kernels, %d threads)\n",
      best_ms, flops / best_ms * 1e-6, cpu::detail::kernels().name, omp_get_max_threads());
  RecordProperty("c1_b8_gflops", std::to_string(flops / best_ms * 1e-6));
  const ref::RefOutput r = ref::sparse_decode_reference(c.args());
  const ref::CompareResult res =
      ref::compare_outputs(c.out.view(), c.lse.view(), r, ref::Tolerance::sparse());
  EXPECT_TRUE(res.ok) << res.summary();
}

// ---- CPU micro-kernels against naive loops, for each kernel set this machine runs ----
class CpuKernels : public ::testing::TestWithParam<const char*> {};

TEST_P(CpuKernels, QkPvExp2MatchNaiveLoops) {
  const cpu::detail::Kernels* k = cpu::detail::kernels_named(GetParam());
  if (k == nullptr) GTEST_SKIP() << GetParam() << " kernels are not available on this CPU";
  ref::Rng rng(test_seed());
  using cpu::detail::kRowPitch;
  for (int M : {1, 5, 6, 7, 13}) {
    for (int T : {1, 2, 3, 4, 17, 64}) {
      const int d = 576, d_v = 512, ldq = 600, lds = 70, ldo = 520;
      std::vector<float> q(M * ldq), rows(T * kRowPitch), s(M * lds, -7.f), o(M * ldo);
      for (auto& x : q) x = static_cast<float>(rng.uniform(-1, 1));
      for (auto& x : rows) x = static_cast<float>(rng.uniform(-1, 1));
      for (auto& x : o) x = static_cast<float>(rng.uniform(-1, 1));
      std::vector<float> o0 = o;
      k->qk(q.data(), ldq, M, rows.data(), kRowPitch, T, d, s.data(), lds);
      for (int m = 0; m < M; ++m) {
        for (int t = 0; t < lds; ++t) {
          if (t >= T) {
            ASSERT_EQ(s[m * lds + t], -7.f) << "qk wrote past T";
            continue;
          }
          double ref_dot = 0;
          for (int x = 0; x < d; ++x) ref_dot += double(q[m * ldq + x]) * rows[t * kRowPitch + x];
          ASSERT_NEAR(s[m * lds + t], ref_dot, 1e-4) << "m " << m << " t " << t;
        }
      }
      k->pv(s.data(), lds, M, rows.data(), kRowPitch, T, d_v, o.data(), ldo);
      for (int m = 0; m < M; ++m) {
        for (int n = 0; n < ldo; ++n) {
          double ref_o = o0[m * ldo + n];
          if (n < d_v) {
            for (int t = 0; t < T; ++t) ref_o += double(s[m * lds + t]) * rows[t * kRowPitch + n];
          }
          ASSERT_NEAR(o[m * ldo + n], ref_o, 1e-3 * (1 + std::fabs(ref_o)))
              << "m " << m << " n " << n;
        }
      }
    }
  }
  std::vector<float> x = {0.f,     -0.5f,  -1.f,    -3.3f,  -20.25f,
                          -125.9f, -126.f, -126.5f, -200.f, -std::numeric_limits<float>::infinity(),
                          0.49f,   -0.51f, -64.f};
  std::vector<float> y = x;
  k->exp2(y.data(), static_cast<int>(y.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = x[i] < -126.f ? 0.0 : std::exp2(double(x[i]));
    EXPECT_NEAR(y[i], want, want * 5e-7) << "exp2(" << x[i] << ")";
  }
}

// Half-precision row conversions: q rows in (scaled) and output rows out (scaled, RNE), with
// NaN, infinities, overflow, subnormals and ties, against the reference's own rounding.
TEST_P(CpuKernels, HalfRowsConvertExactly) {
  const cpu::detail::Kernels* k = cpu::detail::kernels_named(GetParam());
  if (k == nullptr) GTEST_SKIP() << GetParam() << " kernels are not available on this CPU";
  ref::Rng rng(test_seed());
  const float specials[] = {0.f,
                            -0.f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            65504.f,
                            65520.f,
                            65519.f,
                            1e-8f,
                            -3e-6f,
                            1.00390625f,
                            1.01171875f,
                            3.4e38f,
                            1e-40f};
  const int n = 203;  // not a multiple of 8: the tail path too
  std::vector<float> src(n);
  for (int i = 0; i < n; ++i) {
    src[i] = i < 14
                 ? specials[i]
                 : static_cast<float>(rng.uniform(-2, 2) * std::ldexp(1.0, rng.between(-30, 20)));
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (float scale : {1.f, 0.37f}) {
      std::vector<uint16_t> got(n, 0x1234);
      k->store_row(src.data(), scale, dtype, got.data(), n);
      for (int i = 0; i < n; ++i) {
        const float x = src[i] * scale;
        const uint16_t want =
            dtype == DType::kBFloat16 ? ref::ref_float_to_bf16(x) : ref::ref_float_to_fp16(x);
        const bool nan = std::isnan(x);
        const float back =
            dtype == DType::kBFloat16 ? fmt::bf16_to_float(got[i]) : fmt::fp16_to_float(got[i]);
        if (nan) {
          EXPECT_TRUE(std::isnan(back)) << "element " << i;
        } else {
          EXPECT_EQ(got[i], want) << dtype_name(dtype) << " element " << i << " value " << x;
        }
      }
      std::vector<float> in(n, -1.f);
      k->load_row(got.data(), dtype, scale, in.data(), n);
      for (int i = 0; i < n; ++i) {
        const float half =
            dtype == DType::kBFloat16 ? fmt::bf16_to_float(got[i]) : fmt::fp16_to_float(got[i]);
        const float want = half * scale;
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(in[i])) << "element " << i;
        } else {
          EXPECT_EQ(in[i], want) << dtype_name(dtype) << " element " << i;
        }
      }
    }
  }
}

// Row dequantization of every format against src/kv/format.h through the reference reader,
// including every e4m3 code (subnormals, negative zero, NaN) and extreme scales.
TEST_P(CpuKernels, DequantizeRowsExactly) {
  const cpu::detail::Kernels* k = cpu::detail::kernels_named(GetParam());
  if (k == nullptr) GTEST_SKIP() << GetParam() << " kernels are not available on this CPU";
  ref::Rng rng(test_seed());
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32, KVFormat::kBF16, KVFormat::kFP16}) {
    const int64_t heads = kv_format_is_fp8(format) ? 1 : 3;
    ref::HostCache cache(ref::CacheConfig{format, 2, 5, heads, 0});
    ref::fill_random(cache, rng);
    // Raw bytes: all 256 e4m3 codes over the nope parts, scales of every kind.
    for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
      uint8_t* page = cache.page(slot / 5);
      const int64_t t = slot % 5;
      if (format == KVFormat::kModel1) {
        for (int i = 0; i < 448; ++i) page[t * 576 + i] = static_cast<uint8_t>(slot * 37 + i);
        const uint8_t scales[7] = {127, 0, 1, 254, 255, 100, 140};
        for (int j = 0; j < 7; ++j) page[5 * 576 + t * 8 + j] = scales[(j + slot) % 7];
      } else if (format == KVFormat::kV32) {
        for (int i = 0; i < 512; ++i) page[t * 656 + i] = static_cast<uint8_t>(slot * 37 + i);
        const float scales[4] = {1.f, 0x1p-20f, 0x1p10f, 0.375f};
        std::memcpy(page + t * 656 + 512, scales, 16);
      } else {
        for (int i = 0; i < 576 * heads; ++i) {
          const uint16_t h = static_cast<uint16_t>(rng.next());
          std::memcpy(page + (t * heads * 576 + i) * 2, &h, 2);
        }
      }
    }
    std::vector<float> got(cpu::detail::kRowPitch);
    std::vector<double> want(576);
    const KVCache desc = cache.desc();
    for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
      for (int64_t h = 0; h < heads; ++h) {
        k->dequant[static_cast<int>(format)](cache.page(slot / 5), 5, heads, slot % 5, h,
                                             got.data());
        ref::read_row(desc, slot, h, want.data());
        for (int i = 0; i < kv_format_d_qk(format); ++i) {
          if (std::isnan(want[i])) {
            ASSERT_TRUE(std::isnan(got[i])) << kv_format_name(format) << " dim " << i;
          } else {
            // A correctly rounded fp32 product equals the exact product rounded to fp32.
            ASSERT_EQ(static_cast<float>(want[i]), got[i])
                << kv_format_name(format) << " slot " << slot << " head " << h << " dim " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuKernels, ::testing::Values("generic", "avx2", "avx512"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace sparse_mla
