// CUDA merge_attention through the public API against the fp64 reference (spec section 7
// tolerances): 1..40 parts, empty parts (lse +-inf, NaN values that must not leak), all-empty
// rows, NaN lse, sinks (finite, +-inf), fp32/bf16 parts and outputs, d_v from 1 to 4096,
// padded / transposed / misaligned layouts, poisoned outputs, determinism and graph capture.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/cuda/gpu_util.h"

namespace sparse_mla {
namespace {

using gpu_test::DeviceTensor;
using gpu_test::Stream;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The same values in another layout (padding bytes poisoned with NaN).
ref::HostTensor relayout(const ref::HostTensor& t, ref::Layout layout) {
  ref::HostTensor out = ref::make_tensor(t.dtype(), t.shape(), layout);
  out.fill_bytes(0xff);
  t.for_each_index([&](const std::vector<int64_t>& i) {
    int64_t so = 0, doff = 0;
    for (size_t d = 0; d < i.size(); ++d) {
      so += i[d] * t.strides()[d];
      doff += i[d] * out.strides()[d];
    }
    const size_t e = dtype_size(t.dtype());
    std::memcpy(static_cast<uint8_t*>(out.data()) + doff * e,
                static_cast<const uint8_t*>(t.data()) + so * e, e);
  });
  return out;
}

// Bytes of t's span that belong to no element are still 0xff.
::testing::AssertionResult gaps_untouched(const ref::HostTensor& t) {
  const TensorView v = t.view();
  const size_t e = dtype_size(t.dtype());
  std::vector<bool> covered(gpu_test::span_bytes(v), false);
  t.for_each_index([&](const std::vector<int64_t>& i) {
    int64_t off = 0;
    for (size_t d = 0; d < i.size(); ++d) off += i[d] * t.strides()[d];
    for (size_t k = 0; k < e; ++k) covered[off * e + k] = true;
  });
  const uint8_t* p = static_cast<const uint8_t*>(t.data());
  for (size_t k = 0; k < covered.size(); ++k) {
    if (!covered[k] && p[k] != 0xff) {
      return ::testing::AssertionFailure() << "padding byte " << k << " was written";
    }
  }
  return ::testing::AssertionSuccess();
}

struct Layouts {
  ref::Layout parts = ref::Layout::kContiguous;
  ref::Layout lse_parts = ref::Layout::kContiguous;
  ref::Layout out = ref::Layout::kContiguous;
  bool flash_lse = false;   // lse as a [b, h_q, s_q] view of a [b, s_q, h_q] buffer
  size_t parts_offset = 0;  // bytes past a 16-byte boundary (element-aligned views)
  size_t out_offset = 0;
};

std::string describe(const ref::MergeCaseConfig& c) {
  return "n " + std::to_string(c.n) + " b " + std::to_string(c.b) + " s_q " +
         std::to_string(c.s_q) + " h_q " + std::to_string(c.h_q) + " d_v " + std::to_string(c.d_v) +
         " parts " + dtype_name(c.parts_dtype) + " out " + dtype_name(c.out_dtype) + " empty " +
         std::to_string(c.empty_fraction) + (c.use_sink ? " sink" : "");
}

// Runs the case on the GPU (twice: results must be bitwise identical) and checks it against
// the reference. `edit` may change inputs (NaN lse, infinite sinks) before anything runs.
template <typename Edit>
void run_merge_case(ref::MergeCaseConfig cfg, const Layouts& lay, uint64_t seed, Edit&& edit) {
  cfg.seed = seed;
  SCOPED_TRACE(describe(cfg) + " seed " + std::to_string(seed));
  ref::MergeCase c = ref::make_merge_case(cfg);
  edit(c);
  const ref::RefOutput want = ref::merge_reference(c.args());

  const ref::HostTensor parts = relayout(c.out_parts, lay.parts);
  const ref::HostTensor lse_parts = relayout(c.lse_parts, lay.lse_parts);
  ref::HostTensor out = relayout(c.out, lay.out);
  ref::HostTensor lse = ref::make_lse(cfg.b, cfg.h_q, cfg.s_q, lay.flash_lse);
  DeviceTensor dparts = gpu_test::to_device(parts.view(), lay.parts_offset);
  DeviceTensor dlse_parts = gpu_test::to_device(lse_parts.view());
  std::optional<DeviceTensor> dsink;
  if (c.attn_sink.defined()) dsink = gpu_test::to_device(c.attn_sink.view());
  Stream stream;

  std::vector<uint8_t> first_out, first_lse;
  for (int rep = 0; rep < 2; ++rep) {
    DeviceTensor dout = gpu_test::poisoned_like(out.view(), 0xff, lay.out_offset);
    DeviceTensor dlse = gpu_test::poisoned_like(lse.view());
    MergeArgs a;
    a.out_parts = dparts.view;
    a.lse_parts = dlse_parts.view;
    if (dsink) a.attn_sink = dsink->view;
    a.out = dout.view;
    a.lse = dlse.view;
    const Status st = merge_attention(a, stream.options());
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(stream.sync());
    gpu_test::copy_to_host(dout, out.view());
    gpu_test::copy_to_host(dlse, lse.view());
    const uint8_t* po = static_cast<const uint8_t*>(out.data());
    const uint8_t* pl = static_cast<const uint8_t*>(lse.data());
    std::vector<uint8_t> o(po, po + gpu_test::span_bytes(out.view()));
    std::vector<uint8_t> l(pl, pl + gpu_test::span_bytes(lse.view()));
    if (rep == 0) {
      first_out = o;
      first_lse = l;
    } else {
      EXPECT_EQ(o, first_out) << "out differs between two identical runs";
      EXPECT_EQ(l, first_lse) << "lse differs between two identical runs";
    }
  }

  ref::Tolerance tol = ref::Tolerance::sparse();
  if (cfg.parts_dtype == DType::kFloat32 && cfg.out_dtype == DType::kFloat32) {
    tol.out_abs = 1e-5;  // fp32 throughout: only rounding of the weights and the sums
    tol.out_rel = 1e-5;
    tol.cos_diff = 1e-10;
  }
  const ref::CompareResult r = ref::compare_outputs(out.view(), lse.view(), want, tol);
  EXPECT_TRUE(r.ok) << r.message << "\n" << r.summary();
  EXPECT_TRUE(gaps_untouched(out));
}

void run_merge_case(const ref::MergeCaseConfig& cfg, const Layouts& lay, uint64_t seed) {
  run_merge_case(cfg, lay, seed, [](ref::MergeCase&) {});
}

TEST(CudaMerge, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  int k = 0;
  for (DType parts : {DType::kFloat32, DType::kBFloat16}) {
    for (DType out : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t n : {1, 2, 3, 7, 40}) {
        ref::MergeCaseConfig c;
        c.n = n;
        c.b = 3;
        c.s_q = 2;
        c.h_q = 8;
        c.parts_dtype = parts;
        c.out_dtype = out;
        c.empty_fraction = n == 1 ? 0.0 : 0.3;
        c.use_sink = n % 2 == 1;
        run_merge_case(c, {}, seed + k++);
      }
      for (int64_t d_v : {1, 37, 300, 4096}) {  // scalar path, odd tails, many tiles
        ref::MergeCaseConfig c;
        c.n = 3;
        c.b = 2;
        c.h_q = 3;
        c.d_v = d_v;
        c.parts_dtype = parts;
        c.out_dtype = out;
        c.empty_fraction = 0.2;
        c.use_sink = true;
        run_merge_case(c, {}, seed + k++);
      }
    }
  }
}

TEST(CudaMerge, StridedAndMisalignedLayouts) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  ref::MergeCaseConfig c;
  c.n = 4;
  c.b = 2;
  c.s_q = 3;
  c.h_q = 5;
  c.empty_fraction = 0.25;
  c.use_sink = true;
  Layouts padded;
  padded.parts = ref::Layout::kPadded;
  padded.out = ref::Layout::kPadded;
  padded.flash_lse = true;
  Layouts transposed;
  transposed.parts = ref::Layout::kTransposed;
  transposed.lse_parts = ref::Layout::kTransposed;
  transposed.out = ref::Layout::kTransposed;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    c.parts_dtype = dt;
    c.out_dtype = dt;
    Layouts misaligned;
    misaligned.parts_offset = dtype_size(dt);
    misaligned.out_offset = 2 * dtype_size(dt);
    run_merge_case(c, padded, seed);
    run_merge_case(c, transposed, seed + 1);
    run_merge_case(c, misaligned, seed + 2);
  }
}

TEST(CudaMerge, EmptyRowsNaNAndInfiniteSinks) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  ref::MergeCaseConfig c;
  c.n = 3;
  c.b = 2;
  c.s_q = 2;
  c.h_q = 4;
  c.use_sink = true;
  // Every part empty: out 0, lse +inf, whatever the sink.
  c.empty_fraction = 1.0;
  run_merge_case(c, {}, seed);
  // NaN lse in some rows makes exactly those rows NaN; sinks +inf (out 0) and -inf (no effect).
  c.empty_fraction = 0.3;
  run_merge_case(c, {}, seed + 1, [](ref::MergeCase& m) {
    m.lse_parts.set({1, 0, 1, 2}, kNaN);
    m.lse_parts.set({0, 1, 0, 0}, kNaN);
    m.attn_sink.set({1}, kInf);
    m.attn_sink.set({3}, -kInf);
  });
  // A part with lse -inf next to finite parts, and one row with a single non-empty part.
  run_merge_case(c, {}, seed + 2, [](ref::MergeCase& m) {
    for (int64_t p = 0; p < 3; ++p) {
      m.lse_parts.set({p, 0, 0, 0}, p == 1 ? 2.5 : -kInf);
      m.lse_parts.set({p, 1, 1, 3}, p == 0 ? 80.0 : (p == 1 ? -80.0 : 0.0));  // far apart
    }
  });
}

TEST(CudaMerge, IsGraphCapturable) {
  SKIP_WITHOUT_GPU();
  ref::MergeCaseConfig cfg;
  cfg.n = 4;
  cfg.b = 2;
  cfg.h_q = 16;
  cfg.use_sink = true;
  cfg.seed = gpu_test::test_seed();
  ref::MergeCase c = ref::make_merge_case(cfg);
  DeviceTensor dparts = gpu_test::to_device(c.out_parts.view());
  DeviceTensor dlse_parts = gpu_test::to_device(c.lse_parts.view());
  DeviceTensor dsink = gpu_test::to_device(c.attn_sink.view());
  DeviceTensor dout = gpu_test::poisoned_like(c.out.view());
  DeviceTensor dlse = gpu_test::poisoned_like(c.lse.view());
  MergeArgs a{dparts.view, dlse_parts.view, dsink.view, dout.view, dlse.view};
  Stream stream;
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status st = merge_attention(a, stream.options());
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.to_string();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  ASSERT_TRUE(stream.sync());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu_test::copy_to_host(dout, c.out.view());
  gpu_test::copy_to_host(dlse, c.lse.view());
  const ref::CompareResult r = ref::compare_outputs(
      c.out.view(), c.lse.view(), ref::merge_reference(c.args()), ref::Tolerance::sparse());
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace sparse_mla
