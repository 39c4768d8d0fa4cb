// CUDA sparse decode (portable sm_80+ kernels) through the public API against the fp64 reference
// and the CPU backend (spec sections 3 and 7): both formats, awkward batch / head / topk / page
// sizes, extra caches, lengths, sinks, -1 and out-of-range indices, NaN in every unreferenced slot,
// strided tensors, long lists split over many CTAs, every tile configuration, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "src/kv/format.h"
#include "tests/cpp/cuda/decode_util.h"
#include "tests/cpp/cuda/plan_util.h"
#include "tests/cpp/sparse_cases.h"

namespace sparse_mla {
namespace {

using decode_test::DeviceSparse;
using decode_test::expect_refused_by_every_query;
using decode_test::ScopedTiles;
using decode_test::test_seed;
using gpu_test::Stream;

constexpr double kInf = std::numeric_limits<double>::infinity();
const KVFormat M1 = KVFormat::kModel1, V32 = KVFormat::kV32;

using sparse_cases::base;
using sparse_cases::with_extra;

// Checks the outputs in c.out / c.lse against the reference and against the CPU backend.
void check_outputs(const ref::SparseCase& c) {
  decode_test::expect_reference_and_cpu(
      c, ref::sparse_decode_reference(c.args()), ref::Tolerance::sparse(c.config.value_scale_log2),
      [](const SparseDecodeArgs& a) {
        return sparse_decode(a, Workspace{}, Options{Backend::kCPU, nullptr});
      });
}

// Runs the CUDA backend on `c` (outputs land in c.out / c.lse) and checks them.
void check_case(ref::SparseCase& c) {
  Stream stream;
  DeviceSparse d(c);
  ASSERT_TRUE(decode_test::run_sparse(d.args, stream));
  c.poison_outputs();
  d.download(c);
  check_outputs(c);
}

struct SparseParam {
  std::string name;
  ref::SparseCaseConfig config;
  const char* tiles = nullptr;  // forced tile configuration, nullptr = the kernel's choice
};
void PrintTo(const SparseParam& p, std::ostream* os) { *os << p.name; }  // gtest's output

// The corner cases of every backend, then forced tile configurations and the shapes that exercise
// the kernels' row padding and split lists.
std::vector<SparseParam> sparse_params() {
  std::vector<SparseParam> v;
  for (const auto& c : sparse_cases::corner_cases()) v.push_back({c.name, c.config});
  // Small batches pick 32-row tiles by default; 64x32 is what larger batches run.
  v.push_back({"b2_sq2_h64_page256_model1_c1_sink_tiles64x32", sparse_cases::c1_layout_with_sink(),
               "64x32"});
  v.push_back({"b2_sq2_h64_page256_model1_c1_sink_tiles16x16", sparse_cases::c1_layout_with_sink(),
               "16x16"});
  v.push_back({"b1_sq2_h128_page69_v32_sink_tiles64x32", sparse_cases::v32_h128_with_sink(),
               "64x32"});
  v.push_back({"b1_sq2_h128_page69_v32_sink_tiles16x16", sparse_cases::v32_h128_with_sink(),
               "16x16"});
  // Head counts that pad: 24 rows in a 32-row CTA, 40 in a 64-row one, 100 over two.
  v.push_back({"b2_sq2_h24_model1", with_extra(base(M1, 2, 2, 24, 150, 64), 40, 2)});
  v.push_back({"b2_sq1_h40_v32", base(V32, 2, 1, 40, 150, 61)});
  v.push_back({"b1_sq2_h100_model1_tiles16x32", base(M1, 1, 2, 100, 99, 64), "16x32"});
  v.push_back({"b2_sq4_h64_model1_topk300", base(M1, 2, 4, 64, 300, 64)});
  {
    // Long lists: every pair is split over many CTAs and merged by the combine kernel.
    auto c = with_extra(base(M1, 1, 1, 64, 3000, 64), 1000, 2);
    c.use_sink = true;
    v.push_back({"b1_sq1_h64_model1_topk3000_extra1000_split", c});
    v.push_back({"b1_sq1_h64_model1_topk3000_extra1000_split_tiles64x32", c, "64x32"});
    auto d = base(V32, 2, 1, 16, 2500, 256);
    d.use_topk_length = true;
    v.push_back({"b2_sq1_h16_v32_topk2500_split_lengths", d});
    v.push_back({"b2_sq1_h16_v32_topk2500_split_lengths_tiles16x16", d, "16x16"});
  }
  for (KVFormat f : {M1, V32}) {
    // Two 64-row blocks a token list (h_q 128; MODEL1: the Hopper kernel's S over whole 48-token
    // tiles; V32: the rows FlashMLA's Hopper kernel runs without lengths or an extra cache) and
    // 16 rows or fewer (h_q 16 and 5: the Hopper kernel's narrow form): lengths, sinks, -1 and
    // out-of-range indices, split lists, a second block of 36 rows (h_q 100) and a sharp softmax.
    const std::string fmt = f == M1 ? "model1" : "v32";
    for (int h_q : {128, 16}) {
      auto c = with_extra(base(f, 3, 2, h_q, 300, 61), 70, 2);
      c.use_topk_length = c.use_extra_topk_length = true;
      c.use_sink = true;
      c.index.invalid_fraction = 0.1;
      c.index.out_of_range_fraction = 0.1;
      v.push_back(
          {"b3_sq2_h" + std::to_string(h_q) + "_" + fmt + "_extra_lengths_sink_bad_indices", c});
    }
    for (int h_q : {128, 5}) {
      auto d = with_extra(base(f, 1, 1, h_q, 3000, 64), 1000, 2);
      d.use_sink = true;
      v.push_back({"b1_sq1_h" + std::to_string(h_q) + "_" + fmt + "_topk3000_extra1000_split", d});
    }
    v.push_back({"b2_sq2_h100_" + fmt, with_extra(base(f, 2, 2, 100, 150, 64), 40, 2)});
    auto e = base(f, 8, 2, 128, 1000, 64);
    e.softmax_scale = 30.f;
    v.push_back({"b8_sq2_h128_" + fmt + "_topk1000_sharp_scale", e});
  }
  return v;
}

class CudaSparseDecode : public ::testing::TestWithParam<SparseParam> {};

TEST_P(CudaSparseDecode, MatchesReferenceAndCpu) {
  SKIP_WITHOUT_GPU();
  ref::SparseCaseConfig cfg = GetParam().config;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ScopedTiles tiles(GetParam().tiles);
  ref::SparseCase c = ref::make_sparse_case(cfg);
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSparseDecode, ::testing::ValuesIn(sparse_params()),
                         [](const auto& info) { return info.param.name; });

// topk_length / extra_topk_length of 0, partial, exactly topk and beyond topk (clamped); the
// entries past each length point far out of the cache and must not be read; at h_q 128 on two
// row blocks a list.
TEST(CudaSparseDecodeLengths, ZeroPartialAndBeyondTopk) {
  SKIP_WITHOUT_GPU();
  for (auto [format, h_q] : {std::pair{M1, 8}, {V32, 8}, {M1, 128}, {V32, 128}}) {
    ref::SparseCaseConfig cfg = with_extra(base(format, 5, 2, h_q, 75, 61), 40, 2);
    cfg.use_sink = true;
    cfg.seed = test_seed();
    SCOPED_TRACE("h_q " + std::to_string(h_q) +
                 " SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::SparseCase c = ref::make_sparse_case(cfg);
    c.topk_length = ref::make_int_tensor({0, 9, 75, 1000, 0});
    c.extra_topk_length = ref::make_int_tensor({40, 0, 3, 0, -7});
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
    check_case(c);
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < h_q; ++h) {
        EXPECT_EQ(c.lse.get({4, h, s}), kInf);
        EXPECT_EQ(c.out.get({4, s, h, 0}), 0.0);
      }
    }
  }
}

// A request past a CUDA limit (more than 65535 row blocks: 2^22 heads, q, out and lse broadcast
// by zero strides) is refused alike by the queries and the run, not accepted by the queries.
TEST(CudaSparseDecodeCorners, KernelLimitsReportedByEveryQuery) {
  SKIP_WITHOUT_GPU();
  const int64_t h_q = int64_t{64} << 16, topk = 8;
  const Device dev = gpu_test::cuda_device();
  gpu_test::DeviceBuffer q(512 * 2), cache(37440), indices(topk * 4), out(512 * 2), lse(4);
  SparseDecodeArgs a;
  a.q = TensorView::strided(q.data(), DType::kBFloat16, dev, {1, 1, h_q, 512}, {0, 0, 0, 1});
  a.kv = KVCache{cache.data(), dev, KVFormat::kModel1, 1, 64, 37440, 1};
  a.indices = TensorView::contiguous(indices.data(), DType::kInt32, dev, {1, 1, topk});
  a.out = TensorView::strided(out.data(), DType::kBFloat16, dev, {1, 1, h_q, 512}, {0, 0, 0, 1});
  a.lse = TensorView::strided(lse.data(), DType::kFloat32, dev, {1, h_q, 1}, {0, 0, 0});
  expect_refused_by_every_query(a, "row blocks", sparse_decode_supported,
                                sparse_decode_workspace_size, sparse_decode);
}

// More token lists than the planner's 32-bit counters allow (2^30 + 1 requests of one head, all
// tensors broadcast by zero strides) is refused alike by the queries and the run.
TEST(CudaSparseDecodeCorners, TokenListLimitReportedByEveryQuery) {
  SKIP_WITHOUT_GPU();
  const int64_t b = (int64_t{1} << 30) + 1, topk = 8;
  const Device dev = gpu_test::cuda_device();
  gpu_test::DeviceBuffer q(512 * 2), cache(37440), indices(topk * 4), out(512 * 2), lse(4);
  SparseDecodeArgs a;
  a.q = TensorView::strided(q.data(), DType::kBFloat16, dev, {b, 1, 1, 512}, {0, 0, 0, 1});
  a.kv = KVCache{cache.data(), dev, KVFormat::kModel1, 1, 64, 37440, 1};
  a.indices = TensorView::strided(indices.data(), DType::kInt32, dev, {b, 1, topk}, {0, 0, 1});
  a.out = TensorView::strided(out.data(), DType::kBFloat16, dev, {b, 1, 1, 512}, {0, 0, 0, 1});
  a.lse = TensorView::strided(lse.data(), DType::kFloat32, dev, {b, 1, 1}, {0, 0, 0});
  expect_refused_by_every_query(a, "1073741825 token lists", sparse_decode_supported,
                                sparse_decode_workspace_size, sparse_decode);
}

TEST(CudaSparseDecodeCorners, AllIndicesMinusOne) {
  SKIP_WITHOUT_GPU();
  ref::SparseCaseConfig cfg = with_extra(base(M1, 3, 2, 16, 70, 64), 20, 2);
  cfg.use_sink = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  c.indices.fill(-1);
  c.extra_indices.fill(-1);
  c.attn_sink.set({0}, kInf);  // +inf sink on an empty row must not produce NaN
  ref::Rng rng(cfg.seed + 1);
  c.refresh_cache(rng);  // every slot is now NaN
  check_case(c);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < 16; ++h) {
        EXPECT_EQ(c.lse.get({i, h, s}), kInf);
        for (int64_t d = 0; d < kDV; d += 97) EXPECT_EQ(c.out.get({i, s, h, d}), 0.0);
      }
    }
  }
}

// Checks a case changed by `feed` on both formats, both kernel widths (h_q 8 and 128), short lists
// and lists split over CTAs: against the reference, then by `expect`.
void check_fed_cases(bool sink, void (*feed)(ref::SparseCase&),
                     void (*expect)(const ref::SparseCase&)) {
  for (KVFormat format : {M1, V32}) {
    for (int64_t h_q : {8, 128}) {
      for (int64_t topk : {70, 2600}) {
        ref::SparseCaseConfig cfg = base(format, 2, 2, h_q, topk, 64);
        cfg.use_sink = sink;
        cfg.seed = test_seed();
        SCOPED_TRACE("h_q " + std::to_string(h_q) + " topk " + std::to_string(topk) +
                     " SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
        ref::SparseCase c = ref::make_sparse_case(cfg);
        feed(c);
        check_case(c);
        expect(c);
      }
    }
  }
}

// NaN in a query row or in a referenced cache row makes the rows that use it NaN (out and lse),
// as in the reference, and no other row (split lists: the NaN partials pass through the combine).
TEST(CudaSparseDecodeCorners, NanInQueryOrReferencedRowPropagates) {
  SKIP_WITHOUT_GPU();
  check_fed_cases(false, sparse_cases::feed_nan, sparse_cases::expect_nan_where_fed);
}

// A list whose logits are all -inf: lse +inf and out 0 as with no valid slot, but NaN where V
// holds the -inf (0 * -inf), sink or not (split lists: every part of -inf logits only, whose
// partials' NaN the combine keeps).
TEST(CudaSparseDecodeCorners, ListOfMinusInfLogitsReadsAsEmptyButForInfV) {
  SKIP_WITHOUT_GPU();
  check_fed_cases(true, sparse_cases::feed_minus_inf_logits, sparse_cases::expect_minus_inf_rows);
}

// Sinks of +inf (out 0), -inf (no effect) and finite values; lse excludes the sink. Run with a
// short list (final output written by the attention kernel) and a long one (written by combine).
TEST(CudaSparseDecodeCorners, SinkInfinitiesAndFinite) {
  SKIP_WITHOUT_GPU();
  for (int64_t topk : {50, 2600}) {
    ref::SparseCaseConfig cfg = with_extra(base(M1, 3, 2, 8, topk, 53), 30, 64);
    cfg.use_sink = true;
    cfg.seed = test_seed();
    SCOPED_TRACE("topk " + std::to_string(topk) + " SPARSE_MLA_TEST_SEED=" +
                 std::to_string(cfg.seed));
    ref::SparseCase c = ref::make_sparse_case(cfg);
    const double sinks[8] = {kInf, -kInf, 0.0, 5.0, -3.0, 1e30, -1e30, 7.5};
    for (int h = 0; h < 8; ++h) c.attn_sink.set({h}, sinks[h]);
    ref::SparseCase no_sink = c;
    no_sink.attn_sink = ref::HostTensor();
    check_case(c);
    check_case(no_sink);
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t d = 0; d < kDV; d += 31) {
          EXPECT_EQ(c.out.get({i, s, 0, d}), 0.0);
          EXPECT_EQ(c.out.get({i, s, 1, d}), no_sink.out.get({i, s, 1, d}));
        }
        for (int h = 0; h < 8; ++h) EXPECT_EQ(c.lse.get({i, h, s}), no_sink.lse.get({i, h, s}));
      }
    }
  }
}

// Indices at the int32 extremes and just outside the cache never fault (run under
// compute-sanitizer memcheck by tools/gpu_sanitize.sh) and count as absent.
TEST(CudaSparseDecodeCorners, AdversarialIndicesStayInBounds) {
  SKIP_WITHOUT_GPU();
  for (KVFormat format : {M1, V32}) {
    ref::SparseCaseConfig cfg = with_extra(base(format, 2, 2, 16, 64, 53), 33, 2);
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::SparseCase c = ref::make_sparse_case(cfg);
    const int64_t n_main = c.kv.num_slots(), n_extra = c.extra_kv.num_slots();
    const double bad[] = {INT_MAX, INT_MIN, -2.0, static_cast<double>(n_main),
                          static_cast<double>(n_main + 53), 1e9};
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t k = 0; k < 64; k += 3) c.indices.set({i, s, k}, bad[k % 6]);
        for (int64_t k = 1; k < 33; k += 4) {
          c.extra_indices.set({i, s, k}, k % 2 ? static_cast<double>(n_extra) : INT_MIN);
        }
      }
    }
    ref::Rng rng(cfg.seed + 1);
    c.refresh_cache(rng);
    check_case(c);
  }
}

// A plan the run cannot check (made for other shapes, or overwritten) gives wrong values but never
// an access outside the call's tensors: the kernels hold its pair places, ids and lengths to the
// call's own shapes. The run's out / lse are the first half of larger poisoned buffers, whose
// second half must stay untouched; compute-sanitizer's memcheck (gpu_check's subset) sees the
// reads.
TEST(CudaSparseDecodeCorners, ForeignOrGarbagePlanStaysInBounds) {
  SKIP_WITHOUT_GPU();
  const Options o{gpu_test::gpu_backend_under_test()};
  ref::SparseCaseConfig big_cfg = with_extra(base(M1, 6, 2, 16, 96, 53), 40, 2);
  big_cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(big_cfg.seed));
  ref::SparseCase big = ref::make_sparse_case(big_cfg);
  ref::SparseCaseConfig small_cfg = base(M1, 3, 2, 16, 20, 53);
  small_cfg.seed = big_cfg.seed + 1;
  ref::SparseCase small = ref::make_sparse_case(small_cfg);
  DeviceSparse db(big), ds(small);
  const SparseDecodeArgs run = decode_test::into_first_half(ds.args, db.args);
  WorkspaceSizes sizes;
  ASSERT_TRUE(sparse_decode_workspace_size(db.args, o, &sizes).ok());
  decode_test::DeviceWorkspace ws(sizes);
  Stream stream;
  const Options so = stream.options();
  // The plan of the larger call (more requests, a longer main list, an extra cache).
  db.poison_outputs();
  ASSERT_TRUE(sparse_decode_plan(db.args, ws.ws, so).ok());
  Status st = sparse_decode(run, ws.ws, so);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(stream.sync());
  decode_test::expect_second_half_poisoned(db, "the plan of a larger call");
  // Plans overwritten with bytes that make every field negative, huge, or random.
  std::mt19937 rng(static_cast<uint32_t>(big_cfg.seed));
  for (int fill : {0xff, 0x7f, -1}) {
    SCOPED_TRACE("plan bytes " + std::to_string(fill));
    std::vector<uint8_t> garbage(sizes.plan_bytes);
    for (uint8_t& v : garbage) v = static_cast<uint8_t>(fill >= 0 ? fill : rng());
    ws.plan.upload(garbage.data(), garbage.size());
    db.poison_outputs();
    st = sparse_decode(run, ws.ws, so);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(stream.sync());
    decode_test::expect_second_half_poisoned(db, "a garbage plan");
  }
}

// The plan and the scratch must be separate memory: the kernels write partials into scratch while
// other CTAs read the plan.
TEST(CudaSparseDecodeCorners, OverlappingPlanAndScratchRefused) {
  SKIP_WITHOUT_GPU();
  ref::SparseCase c = ref::make_sparse_case(base(M1, 4, 2, 16, 200, 64));
  DeviceSparse d(c);
  const Options o{gpu_test::gpu_backend_under_test()};
  WorkspaceSizes sizes;
  ASSERT_TRUE(sparse_decode_workspace_size(d.args, o, &sizes).ok());
  ASSERT_GT(sizes.plan_bytes, 16u);
  ASSERT_GT(sizes.scratch_bytes, 0u);
  gpu_test::DeviceBuffer one(sizes.plan_bytes + sizes.scratch_bytes);
  Workspace ws{one.data(), sizes.plan_bytes, one.ptr<uint8_t>() + 16, sizes.scratch_bytes};
  for (const Status& st : {sparse_decode_plan(d.args, ws, o), sparse_decode(d.args, ws, o)}) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("workspace: plan and scratch overlap"), std::string::npos)
        << st.to_string();
  }
}

// Many token lists of varied lengths, several a part: where the lists' own order does not balance
// the parts with whole lists, the planner lays them out in an order of its own (params.h), so
// that none is split. Every list must then sit on the cost line once, whole, and the outputs
// match. On the H200 at least one of the shapes takes that order on each backend; the test fails
// where none does.
TEST(CudaSparseDecodePlan, WholeListsInTheirOwnOrder) {
  SKIP_WITHOUT_GPU();
  int reordered = 0;
  for (int64_t b : {100, 230}) {
    ref::SparseCaseConfig cfg = with_extra(base(M1, b, 2, 24, 64, 64), 320, 2);
    cfg.use_extra_topk_length = true;
    cfg.use_sink = true;
    cfg.seed = test_seed();
    SCOPED_TRACE("b " + std::to_string(b) + " SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::SparseCase c = ref::make_sparse_case(cfg);
    Stream stream;
    DeviceSparse d(c);
    const Options o = stream.options();
    WorkspaceSizes sizes;
    ASSERT_TRUE(sparse_decode_workspace_size(d.args, o, &sizes).ok());
    decode_test::DeviceWorkspace ws(sizes);
    ws.plan.fill(plan_test::kPoison);
    ASSERT_TRUE(sparse_decode_plan(d.args, ws.ws, o).ok());
    ASSERT_TRUE(sparse_decode(d.args, ws.ws, o).ok());
    ASSERT_TRUE(stream.sync());
    c.poison_outputs();
    d.download(c);
    check_outputs(c);
    // Every list once, whole where the planner took its own order (plan_util.h).
    reordered += plan_test::expect_valid_plan(plan_test::read_plan(ws.plan, b * 2));
  }
  EXPECT_GE(reordered, 1) << "no shape took the planner's own order";
}

// One output row with dims 2^30 apart in magnitude inside the dims that one lane of a CTA writes.
// Split pairs of the Hopper backend's 64-row CTAs leave as fp16 partials, each lane's values
// scaled by one power of two set by the largest (semantics.md, "Precision of split token lists").
// Here every cached token holds exactly 1.0 in some dim blocks (MODEL1: blocks 0 and 2 of 64
// dims, V32: block 1 of 128), which makes each lane's largest partial value 1 (the scores only
// shift by a constant), and its small blocks (MODEL1: 1 and 3, V32: 2) 2^26 below their usual
// ~0.1: their partial values fall into fp16's subnormal range and must come out within 2^-39 of
// that largest value, beside the bf16 output's own rounding. Flushed to zero, they would not.
TEST(CudaSparseDecodeCorners, OutputDimsFarApartInMagnitude) {
  SKIP_WITHOUT_GPU();
  constexpr int kShift = 26;
  constexpr uint8_t kE4m3One = 0x38, kUe8m0One = 127;
  for (KVFormat format : {M1, V32}) {
    // Lists of 14 (MODEL1) and 13 (V32) 48-token tiles over 4 row blocks: split on every backend.
    ref::SparseCaseConfig cfg =
        format == M1 ? sparse_cases::c1_layout_with_sink() : base(V32, 2, 2, 64, 600, 64);
    cfg.seed = test_seed();
    SCOPED_TRACE(std::string(format == M1 ? "MODEL1" : "V32") +
                 " SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    const int block_dims = format == M1 ? 64 : 128;
    const std::vector<int> ones = format == M1 ? std::vector<int>{0, 2} : std::vector<int>{1};
    const std::vector<int> small = format == M1 ? std::vector<int>{1, 3} : std::vector<int>{2};
    ref::SparseCase c = ref::make_sparse_case(cfg);
    for (ref::HostCache* cache : {&c.kv, &c.extra_kv}) {
      if (!cache->defined()) continue;
      const int64_t page_size = cache->config().page_size;
      for (int64_t pg = 0; pg < cache->config().num_pages; ++pg) {
        for (int64_t t = 0; t < page_size; ++t) {
          if (format == M1) {
            uint8_t* row = cache->page(pg) + fmt::model1_row_offset(t);
            uint8_t* scales = cache->page(pg) + fmt::model1_scale_offset(page_size, t);
            if (scales[0] == 0xff) continue;  // an unreferenced slot's NaN
            for (int blk : ones) {
              std::memset(row + blk * 64, kE4m3One, 64);
              scales[blk] = kUe8m0One;
            }
            for (int blk : small) {
              ASSERT_GT(scales[blk], kShift);
              scales[blk] -= kShift;
            }
          } else {
            uint8_t* row = cache->page(pg) + t * kV32BytesPerToken;
            float scales[4];
            std::memcpy(scales, row + fmt::kV32ScaleOffset, sizeof(scales));
            if (std::isnan(scales[0])) continue;  // an unreferenced slot's NaN
            for (int blk : ones) {
              std::memset(row + blk * 128, kE4m3One, 128);
              scales[blk] = 1.f;
            }
            for (int blk : small) scales[blk] = std::ldexp(scales[blk], -kShift);
            std::memcpy(row + fmt::kV32ScaleOffset, scales, sizeof(scales));
          }
        }
      }
    }
    Stream stream;
    DeviceSparse dev(c);
    ASSERT_TRUE(decode_test::run_sparse(dev.args, stream));
    c.poison_outputs();
    dev.download(c);
    check_outputs(c);
    const ref::RefOutput r = ref::sparse_decode_reference(c.args());
    double largest = 0;
    int64_t above_bound = 0;  // small values that a flush to zero would get wrong
    const double bound_abs = std::ldexp(1.0, -38);  // 2^-39 of a largest value below 2
    for (int64_t i = 0; i < cfg.b; ++i) {
      for (int64_t s = 0; s < cfg.s_q; ++s) {
        for (int64_t h = 0; h < cfg.h_q; ++h) {
          for (int blk : small) {
            for (int64_t d = blk * block_dims; d < (blk + 1) * block_dims; ++d) {
              const double want = r.out_at(i, s, h, d), got = c.out.get({i, s, h, d});
              ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8) + bound_abs)
                  << "request " << i << " token " << s << " head " << h << " dim " << d;
              largest = std::max(largest, std::fabs(want));
              above_bound += std::fabs(want) > 16 * bound_abs;
            }
          }
        }
      }
    }
    // Subnormal once scaled (below 2^-14 of 2^14), and large enough to be told from zero.
    EXPECT_LT(largest, std::ldexp(1.0, -28));
    EXPECT_GT(above_bound, 0);
  }
}

// Same inputs and plan give bitwise the same outputs; a fresh plan too.
TEST(CudaSparseDecodeDeterminism, BitwiseAcrossRuns) {
  SKIP_WITHOUT_GPU();
  ref::SparseCaseConfig cfg = with_extra(base(M1, 3, 2, 64, 1500, 64), 300, 2);
  cfg.use_sink = true;
  cfg.use_topk_length = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  Stream stream;
  DeviceSparse d(c);
  std::vector<std::vector<uint8_t>> outs;
  for (int run = 0; run < 3; ++run) {
    d.poison_outputs();
    ASSERT_TRUE(decode_test::run_sparse(d.args, stream));
    d.download(c);
    outs.push_back(ref::output_bytes(c.out, c.lse));
  }
  EXPECT_TRUE(outs[0] == outs[1]);
  EXPECT_TRUE(outs[0] == outs[2]);
}

}  // namespace
}  // namespace sparse_mla
