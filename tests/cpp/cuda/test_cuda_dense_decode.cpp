// CUDA dense decode (portable sm_80+ kernels) through the public API against the fp64 reference
// and the CPU backend (spec sections 4 and 7): bf16 / fp16 / MODEL1 / V32 pages, h_q / h_kv
// grouping, causal multi-token queries, page sizes 1..256, empty and clamped requests, block-table
// entries outside the cache, strided tensors, long requests split over CTAs, every tile
// configuration, determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "tests/cpp/cuda/decode_util.h"
#include "tests/cpp/dense_cases.h"

namespace sparse_mla {
namespace {

using decode_test::DeviceDense;
using decode_test::expect_refused_by_every_query;
using decode_test::ScopedTiles;
using decode_test::test_seed;
using gpu_test::Stream;

constexpr double kInf = std::numeric_limits<double>::infinity();

ref::DenseCaseConfig base(KVFormat format, int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv,
                          int64_t page_size, std::vector<int32_t> seqlens = {}) {
  ref::DenseCaseConfig c;
  c.format = format;
  c.b = b;
  c.s_q = s_q;
  c.h_q = h_q;
  c.h_kv = h_kv;
  c.page_size = page_size;
  c.seqlens = std::move(seqlens);
  return c;
}

void check_case(ref::DenseCase& c) {
  Stream stream;
  DeviceDense d(c);
  ASSERT_TRUE(decode_test::run_dense(d.args, stream));
  c.poison_outputs();
  d.download(c);
  decode_test::expect_reference_and_cpu(
      c, ref::dense_decode_reference(c.args()), ref::Tolerance::dense(c.config.value_scale_log2),
      [](const DenseDecodeArgs& a) {
        return dense_decode(a, Workspace{}, Options{Backend::kCPU, nullptr});
      });
}

struct DenseParam {
  const char* name;
  ref::DenseCaseConfig config;
  const char* tiles = nullptr;
};

std::vector<DenseParam> dense_params() {
  const KVFormat BF = KVFormat::kBF16, FP = KVFormat::kFP16, M1 = KVFormat::kModel1,
                 V32 = KVFormat::kV32;
  std::vector<DenseParam> v;
  v.push_back({"bf16_b1_sq1_h16_page64", base(BF, 1, 1, 16, 1, 64)});
  v.push_back({"bf16_b2_sq1_h1_page1", base(BF, 2, 1, 1, 1, 1, {37, 5})});
  {
    auto c = base(BF, 3, 2, 16, 2, 53);
    c.causal = true;
    v.push_back({"bf16_b3_sq2_h16_hkv2_page53_causal", c});
  }
  {
    auto c = base(FP, 3, 3, 8, 4, 61);
    c.causal = true;
    v.push_back({"fp16_b3_sq3_h8_hkv4_page61_causal", c});
  }
  v.push_back({"fp16_b2_sq1_h24_hkv3_page2", base(FP, 2, 1, 24, 3, 2, {300, 41})});
  {
    auto c = base(M1, 3, 2, 64, 1, 256);
    c.causal = true;
    v.push_back({"model1_b3_sq2_h64_page256_causal", c});
    v.push_back({"model1_b3_sq2_h64_page256_causal_tiles16x16", c, "16x16"});
  }
  v.push_back({"v32_b2_sq1_h32_page69", base(V32, 2, 1, 32, 1, 69)});
  v.push_back({"v32_b3_sq2_h16_page2", base(V32, 3, 2, 16, 1, 2, {1, 2, 300})});
  {
    // V32 with two 64-row blocks a group: one KV head (causal, a length of 0), and two KV heads
    // of two row blocks each.
    auto c = base(V32, 3, 2, 64, 1, 64, {700, 0, 90});
    c.causal = true;
    v.push_back({"v32_b3_sq2_h64_causal_2_row_blocks", c});
    v.push_back({"v32_b2_sq1_h256_hkv2_page32", base(V32, 2, 1, 256, 2, 32, {1200, 333})});
  }
  {
    // An imbalanced batch (one long request split over many CTAs, short ones packed).
    auto c = base(BF, 4, 4, 16, 1, 64, {580, 5640, 216, 212});
    c.causal = true;
    v.push_back({"bf16_b4_sq4_h16_imbalanced_causal", c});
    c.s_q = 1;
    c.h_q = 128;
    v.push_back({"bf16_b4_sq1_h128_imbalanced", c});
    v.push_back({"bf16_b4_sq1_h128_imbalanced_tiles32x32", c, "32x32"});
    v.push_back({"bf16_b4_sq1_h128_imbalanced_tiles16x16", c, "16x16"});
  }
  {
    auto c = base(BF, 2, 4, 128, 1, 64, {700, 90});
    c.causal = true;
    v.push_back({"bf16_b2_sq4_h128_causal_8_row_blocks", c});
  }
  {
    // Empty requests, a request of s_q - 1 tokens (its first query rows see nothing under the
    // causal mask) and one clamped to max_pages * page_size.
    auto c = base(BF, 4, 3, 8, 1, 16, {0, 2, 100, 0});
    c.max_pages = 5;
    c.causal = true;
    v.push_back({"bf16_b4_sq3_h8_empty_short_clamped_causal", c});
  }
  {
    auto c = base(FP, 3, 2, 16, 2, 61);
    c.q_layout = ref::Layout::kTransposed;
    c.out_layout = ref::Layout::kPadded;
    c.page_stride = ref::default_page_stride(FP, 61, 2) + 96;
    v.push_back({"fp16_b3_sq2_h16_hkv2_strided_q_out_padded_pages", c});
    c.format = M1;
    c.h_kv = 1;
    c.page_stride = ref::default_page_stride(M1, 61) + 32;
    v.push_back({"model1_b3_sq2_h16_strided_q_out_padded_pages", c});
  }
  {
    // FP8 pages with 16 query rows or fewer a KV head (the Hopper kernel's narrow form): causal
    // s_q 2 over 8 heads with a long request split over many CTAs, and 2 KV heads of 5 rows.
    auto c = base(M1, 3, 2, 8, 1, 64, {2500, 70, 1});
    c.causal = true;
    v.push_back({"model1_b3_sq2_h8_causal_split", c});
    v.push_back({"v32_b2_sq1_h10_hkv2_page37", base(V32, 2, 1, 10, 2, 37, {1500, 333})});
  }
  {
    // h_kv > 1 with more than 16 query rows a KV head, which the Hopper kernel takes: 2 KV
    // heads x 3 row blocks (64, 64 and 16 of the 144 rows at h_q 96, s_q 3), and one 64-row
    // block a KV head.
    auto c = base(BF, 2, 3, 96, 2, 48, {300, 77});
    c.causal = true;
    v.push_back({"bf16_b2_sq3_h96_hkv2_page48_causal", c});
    v.push_back({"fp16_b3_sq1_h128_hkv2_page32", base(FP, 3, 1, 128, 2, 32)});
  }
  {
    // The Hopper kernel's two ways to fetch 16-bit rows: TMA boxes of 8 tokens where the page
    // size is a multiple of 8 (here with 64-token tiles straddling pages of 40 and padded page
    // strides), cp.async rows elsewhere (pages of 61).
    auto c = base(FP, 3, 2, 64, 2, 40, {333, 80, 7});
    c.q_layout = ref::Layout::kTransposed;
    c.out_layout = ref::Layout::kPadded;
    c.page_stride = ref::default_page_stride(FP, 40, 2) + 96;
    v.push_back({"fp16_b3_sq2_h64_hkv2_page40_padded_pages", c});
    auto d = base(BF, 2, 2, 32, 1, 61, {250, 64});
    d.causal = true;
    v.push_back({"bf16_b2_sq2_h32_page61_causal", d});
    // 4 query rows a KV head on pages of 8 (the smallest TMA page: one box a page).
    v.push_back({"bf16_b2_sq1_h16_hkv4_page8", base(BF, 2, 1, 16, 4, 8, {203, 64})});
  }
  {
    // MODEL1 pages with 4 row blocks of 64 on the same token lists, causal.
    auto c = base(M1, 2, 2, 128, 1, 64, {700, 90});
    c.causal = true;
    v.push_back({"model1_b2_sq2_h128_causal_4_row_blocks", c});
  }
  {
    auto c = base(M1, 2, 1, 64, 1, 64);
    c.softmax_scale = 1.0f / std::sqrt(512.0f);
    v.push_back({"model1_b2_sq1_h64_default_scale", c});
  }
  {
    // A sharp softmax: row maxima rise by more than the Hopper consumers' slack mid-request,
    // with several tiles a CTA part; fp16 P has the tighter range.
    auto c = base(BF, 8, 1, 128, 1, 64, {3000, 2500, 3100, 2900, 2800, 3050, 2950, 2700});
    c.softmax_scale = 30.f;
    v.push_back({"bf16_b8_sq1_h128_sharp_scale", c});
    c.format = FP;
    v.push_back({"fp16_b8_sq1_h128_sharp_scale", c});
  }
  {
    // Values 2^40 times larger or smaller (scores as usual), split over several CTAs: partial
    // rows and their combine far outside fp16's range either way (FP8 pages: larger only).
    using ref::with_values_scaled;
    v.push_back({"bf16_b2_sq1_h64_values_times_2pow40",
                 with_values_scaled(base(BF, 2, 1, 64, 1, 64, {3000, 2000}), 40)});
    v.push_back({"bf16_b2_sq2_h64_values_times_2pow_minus40",
                 with_values_scaled(base(BF, 2, 2, 64, 1, 64, {3000, 2000}), -40)});
    v.push_back({"model1_b2_sq1_h64_values_times_2pow40",
                 with_values_scaled(base(M1, 2, 1, 64, 1, 64, {3000, 2000}), 40)});
  }
  // Many requests of random lengths (1-512), about two a part: where their own order does not
  // balance the parts with whole requests, the planner lays them out in its own
  // (test_cuda_plan.cpp checks the plans themselves).
  v.push_back({"bf16_b300_sq1_h16_many_varied_requests", base(BF, 300, 1, 16, 1, 64)});
  return v;
}

class CudaDenseDecode : public ::testing::TestWithParam<DenseParam> {};

TEST_P(CudaDenseDecode, MatchesReferenceAndCpu) {
  SKIP_WITHOUT_GPU();
  ref::DenseCaseConfig cfg = GetParam().config;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ScopedTiles tiles(GetParam().tiles);
  ref::DenseCase c = ref::make_dense_case(cfg);
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDenseDecode, ::testing::ValuesIn(dense_params()),
                         [](const auto& info) { return std::string(info.param.name); });

// Block-table entries to point elsewhere (absent pages, ids outside the cache), after which the
// cache is drawn again: rows of the pages still referenced random, the rest NaN.
struct TableEntry {
  int64_t request, page;
  double id;
};
void relink_pages(ref::DenseCase& c, uint64_t seed, const std::vector<TableEntry>& entries) {
  for (const TableEntry& e : entries) c.block_table.set({e.request, e.page}, e.id);
  ref::Rng rng(seed + 1);
  c.refresh_cache(rng);
}

// Token positions past the kernels' 32-bit limit (a page of 2^31-1 tokens in a cache of no pages)
// are refused alike by the queries and the run.
TEST(CudaDenseDecodeCorners, TokenLimitReportedByEveryQuery) {
  SKIP_WITHOUT_GPU();
  const Device dev = gpu_test::cuda_device();
  const int64_t page_size = INT32_MAX;
  gpu_test::DeviceBuffer q(16 * 576 * 2), cache(16), table(4), seqlens(4), out(16 * 512 * 2),
      lse(16 * 4);
  DenseDecodeArgs a;
  a.q = TensorView::contiguous(q.data(), DType::kBFloat16, dev, {1, 1, 16, 576});
  a.kv = KVCache{cache.data(), dev, KVFormat::kBF16, 0, page_size, page_size * 1152, 1};
  a.block_table = TensorView::contiguous(table.data(), DType::kInt32, dev, {1, 1});
  a.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, dev, {1});
  a.out = TensorView::contiguous(out.data(), DType::kBFloat16, dev, {1, 1, 16, 512});
  a.lse = TensorView::contiguous(lse.data(), DType::kFloat32, dev, {1, 16, 1});
  expect_refused_by_every_query(a, "max_pages * page_size = 2147483647", dense_decode_supported,
                                dense_decode_workspace_size, dense_decode);
}

// More token lists than the planner's 32-bit counters allow (2^30 + 1 requests, all tensors
// broadcast by zero strides) is refused alike by the queries and the run.
TEST(CudaDenseDecodeCorners, TokenListLimitReportedByEveryQuery) {
  SKIP_WITHOUT_GPU();
  const Device dev = gpu_test::cuda_device();
  const int64_t b = (int64_t{1} << 30) + 1;
  gpu_test::DeviceBuffer q(576 * 2), cache(64 * 1152), table(4), seqlens(4), out(512 * 2), lse(4);
  DenseDecodeArgs a;
  a.q = TensorView::strided(q.data(), DType::kBFloat16, dev, {b, 1, 1, 576}, {0, 0, 0, 1});
  a.kv = KVCache{cache.data(), dev, KVFormat::kBF16, 1, 64, 64 * 1152, 1};
  a.block_table = TensorView::strided(table.data(), DType::kInt32, dev, {b, 1}, {0, 1});
  a.cache_seqlens = TensorView::strided(seqlens.data(), DType::kInt32, dev, {b}, {0});
  a.out = TensorView::strided(out.data(), DType::kBFloat16, dev, {b, 1, 1, 512}, {0, 0, 0, 1});
  a.lse = TensorView::strided(lse.data(), DType::kFloat32, dev, {b, 1, 1}, {0, 0, 0});
  expect_refused_by_every_query(a, "1073741825 token lists", dense_decode_supported,
                                dense_decode_workspace_size, dense_decode);
}

// The plan of a larger call (more requests, longer ones, a wider block table) used for a smaller
// one: the kernels hold its lengths to the call's block table and its ids to the call's requests
// (values wrong, no access outside: memcheck in gpu_check's subset sees the reads; the outputs'
// second half, past the call's requests, must stay poisoned).
TEST(CudaDenseDecodeCorners, PlanOfALargerCallStaysInBounds) {
  SKIP_WITHOUT_GPU();
  ref::DenseCaseConfig big_cfg = base(KVFormat::kBF16, 4, 2, 16, 1, 32, {700, 500, 300, 650});
  big_cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(big_cfg.seed));
  ref::DenseCase big = ref::make_dense_case(big_cfg);
  ref::DenseCaseConfig small_cfg = base(KVFormat::kBF16, 2, 2, 16, 1, 32, {40, 60});
  small_cfg.seed = big_cfg.seed + 1;
  ref::DenseCase small = ref::make_dense_case(small_cfg);
  DeviceDense db(big), ds(small);
  const DenseDecodeArgs run = decode_test::into_first_half(ds.args, db.args);
  Stream stream;
  const Options o = stream.options();
  WorkspaceSizes sizes;
  ASSERT_TRUE(dense_decode_workspace_size(db.args, o, &sizes).ok());
  decode_test::DeviceWorkspace ws(sizes);
  db.poison_outputs();
  ASSERT_TRUE(dense_decode_plan(db.args, ws.ws, o).ok());
  const Status st = dense_decode(run, ws.ws, o);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(stream.sync());
  decode_test::expect_second_half_poisoned(db, "the plan of a larger call");
}

// Checks a case of every format and the head counts `h_qs`, made by `config` and changed by
// `feed`: against the reference, then by `expect`.
template <typename Config>
void check_fed_cases(std::initializer_list<int64_t> h_qs, Config config,
                     void (*feed)(ref::DenseCase&), void (*expect)(const ref::DenseCase&)) {
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kFP16, KVFormat::kModel1, KVFormat::kV32}) {
    for (int64_t h_q : h_qs) {
      ref::DenseCaseConfig cfg = config(format, h_q);
      cfg.seed = test_seed();
      SCOPED_TRACE("h_q " + std::to_string(h_q) + " SPARSE_MLA_TEST_SEED=" +
                   std::to_string(cfg.seed));
      ref::DenseCase c = ref::make_dense_case(cfg);
      feed(c);
      check_case(c);
      expect(c);
    }
  }
}

// NaN in tokens past some query tokens' causal horizon reaches only the query tokens that see
// them (not the others through 0 * V in the tile they share): h_q 4 (12 rows a list: the Hopper
// kernel's narrow form on FP8 pages), 8 (24 rows in one CTA), 100 (64-row CTAs of one query token
// and CTAs of two) and 128 (six 64-row CTAs a list, each of one query token: the form without the
// cleaning, whose producers skip the tokens past their CTA's horizon).
TEST(CudaDenseDecodeCorners, NanPastTheCausalHorizonStaysHidden) {
  SKIP_WITHOUT_GPU();
  check_fed_cases(
      {4, 8, 100, 128},
      [](KVFormat format, int64_t h_q) {
        return dense_cases::nan_past_horizon_config(format, h_q, 64);
      },
      dense_cases::feed_nan_past_horizon, dense_cases::expect_nan_only_past_horizon);
}

// A request whose logits are all -inf: lse +inf and out 0 as with no valid token, but NaN where V
// holds the -inf (0 * -inf); h_q 4, 8 and 128 (narrow, one and several 64-row CTAs a list), its
// 5000 tokens split over CTAs whose every part is of -inf logits only.
TEST(CudaDenseDecodeCorners, RequestOfMinusInfLogitsReadsAsEmptyButForInfV) {
  SKIP_WITHOUT_GPU();
  check_fed_cases(
      {4, 8, 128},
      [](KVFormat format, int64_t h_q) { return base(format, 2, 2, h_q, 1, 64, {300, 5000}); },
      dense_cases::feed_minus_inf_logits, dense_cases::expect_minus_inf_rows);
}

// Block-table entries outside [0, num_pages) make their tokens absent and are never read;
// requests with no token left give out 0 and lse +inf.
TEST(CudaDenseDecodeCorners, OutOfRangeBlockTableEntries) {
  SKIP_WITHOUT_GPU();
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kModel1}) {
    ref::DenseCaseConfig cfg = base(format, 3, 2, 16, 1, 32, {200, 64, 90});
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::DenseCase c = ref::make_dense_case(cfg);
    const auto num_pages = static_cast<double>(c.kv.config().num_pages);
    relink_pages(c, cfg.seed,
                 {{0, 1, -1},
                  {0, 3, num_pages},
                  {0, 4, 2147483647.0},
                  {1, 0, -2147483648.0},
                  {1, 1, num_pages + 7}});
    check_case(c);
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < 16; ++h) {
        EXPECT_EQ(c.lse.get({1, h, s}), kInf);
        EXPECT_EQ(c.out.get({1, s, h, 7}), 0.0);
      }
    }
  }
}

// 16-bit pages of whole tiles (64 and 256 tokens), which the Hopper kernel loads by TMA: absent
// pages under full tiles, a partial last tile and a request with no page left read nothing and
// give zeros where no token is left.
TEST(CudaDenseDecodeCorners, AbsentPagesUnderFullTiles) {
  SKIP_WITHOUT_GPU();
  for (int64_t page_size : {64, 256}) {
    ref::DenseCaseConfig cfg = base(KVFormat::kBF16, 3, 1, 16, 1, page_size, {700, 130, 300});
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed) +
                 " page_size=" + std::to_string(page_size));
    ref::DenseCase c = ref::make_dense_case(cfg);
    const auto num_pages = static_cast<double>(c.kv.config().num_pages);
    std::vector<TableEntry> entries = {{0, 1, -1}, {1, 0, num_pages}};
    if (page_size == 64) entries.insert(entries.end(), {{1, 1, -1}, {1, 2, num_pages + 3}});
    relink_pages(c, cfg.seed, entries);
    check_case(c);
    for (int64_t h = 0; h < 16; ++h) {
      EXPECT_EQ(c.lse.get({1, h, 0}), kInf);
      EXPECT_EQ(c.out.get({1, 0, h, 5}), 0.0);
    }
  }
}

TEST(CudaDenseDecodeDeterminism, BitwiseAcrossRuns) {
  SKIP_WITHOUT_GPU();
  ref::DenseCaseConfig cfg = base(KVFormat::kBF16, 3, 2, 64, 1, 64, {3000, 17, 900});
  cfg.causal = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::DenseCase c = ref::make_dense_case(cfg);
  Stream stream;
  DeviceDense d(c);
  std::vector<std::vector<uint8_t>> outs;
  for (int run = 0; run < 3; ++run) {
    d.poison_outputs();
    ASSERT_TRUE(decode_test::run_dense(d.args, stream));
    d.download(c);
    outs.push_back(ref::output_bytes(c.out, c.lse));
  }
  EXPECT_TRUE(outs[0] == outs[1]);
  EXPECT_TRUE(outs[0] == outs[2]);
}

// ---- Combine of heavily split pairs ----

// Forces a layout of the combine kernel for the scope (test hook of combine.cu); nullptr keeps
// the shape-based choice.
class ScopedCombineLayout {
 public:
  explicit ScopedCombineLayout(const char* layout) {
    if (layout != nullptr) setenv("SPARSE_MLA_COMBINE_LAYOUT", layout, 1);
  }
  ~ScopedCombineLayout() { unsetenv("SPARSE_MLA_COMBINE_LAYOUT"); }
  ScopedCombineLayout(const ScopedCombineLayout&) = delete;
  ScopedCombineLayout& operator=(const ScopedCombineLayout&) = delete;
};

// Default choice first, then every layout (warps per row x dims per CTA).
const char* const kCombineLayouts[] = {nullptr,  "w8d128", "w8d256", "w8d512",
                                       "w4d512", "w2d512", "w1d512", "w1d512b2r2"};

// The imbalanced batch of the performance targets (4641 / 45118 / 1730 / 1696 tokens, h_q 16,
// causal): the long request is split over a hundred parts or more and merged by the combine
// kernel. Every combine layout against the reference; the default one twice, bitwise equal. The
// "holes" variant adds block-table runs outside the cache: request 2 loses every page (all its
// parts are empty: out 0, lse +inf) and request 1 a run of 50 pages (some of its parts are empty,
// the rest still merge). MODEL1 pages at s_q 4 fill 64-row CTAs, which on the sm90 backend write
// fp16 partials with exponents; the one-warp-a-row layouts walk more than 32 of those parts a
// warp. Dense decode has no sink; the sparse test below merges with one.
TEST(CudaDenseDecodeCombine, ImbalancedBatchEveryLayoutDeterministic) {
  SKIP_WITHOUT_GPU();
  const struct {
    KVFormat format;
    int64_t s_q;
  } shapes[] = {{KVFormat::kBF16, 1}, {KVFormat::kBF16, 4}, {KVFormat::kModel1, 4}};
  for (const auto& shape : shapes) {
    const int64_t s_q = shape.s_q;
    for (bool holes : {false, true}) {
      ref::DenseCaseConfig cfg = base(shape.format, 4, s_q, 16, 1, 64, {4641, 45118, 1730, 1696});
      cfg.causal = true;
      cfg.seed = test_seed();
      SCOPED_TRACE(std::string(kv_format_name(shape.format)) + " s_q " + std::to_string(s_q) +
                   (holes ? " holes" : "") + " SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
      ref::DenseCase c = ref::make_dense_case(cfg);
      if (holes) {
        const auto num_pages = static_cast<double>(c.kv.config().num_pages);
        std::vector<TableEntry> entries;
        for (int64_t pg = 0; pg < 28; ++pg) entries.push_back({2, pg, -1});
        for (int64_t pg = 100; pg < 150; ++pg) entries.push_back({1, pg, num_pages + pg});
        relink_pages(c, cfg.seed, entries);
      }
      const ref::RefOutput r = ref::dense_decode_reference(c.args());
      Stream stream;
      DeviceDense d(c);
      std::vector<uint8_t> first;
      for (const char* layout : kCombineLayouts) {
        SCOPED_TRACE(layout != nullptr ? layout : "default layout");
        ScopedCombineLayout forced(layout);
        d.poison_outputs();
        ASSERT_TRUE(decode_test::run_dense(d.args, stream));
        c.poison_outputs();
        d.download(c);
        const ref::CompareResult res = ref::compare_outputs(
            c.out.view(), c.lse.view(), r, ref::Tolerance::dense(cfg.value_scale_log2));
        EXPECT_TRUE(res.ok) << "vs reference: " << res.summary();
        if (holes) {
          for (int64_t s = 0; s < s_q; ++s) {
            for (int64_t h = 0; h < 16; ++h) {
              EXPECT_EQ(c.lse.get({2, h, s}), kInf);
              for (int64_t e = 0; e < kDV; e += 37) EXPECT_EQ(c.out.get({2, s, h, e}), 0.0);
            }
          }
        }
        if (layout == nullptr) {
          first = ref::output_bytes(c.out, c.lse);
          d.poison_outputs();
          ASSERT_TRUE(decode_test::run_dense(d.args, stream));
          d.download(c);
          EXPECT_TRUE(ref::output_bytes(c.out, c.lse) == first) << "second run differs";
        }
      }
    }
  }
}

// A sparse batch whose long lists are split over many parts, with sinks (+inf: out 0; -inf: no
// effect; finite), merged by every combine layout.
TEST(CudaDenseDecodeCombine, SparseSinkEveryLayout) {
  SKIP_WITHOUT_GPU();
  ref::SparseCaseConfig cfg;
  cfg.format = KVFormat::kModel1;
  cfg.b = 3;
  cfg.s_q = 2;
  cfg.h_q = 16;
  cfg.topk = 3100;
  cfg.page_size = 64;
  cfg.use_topk_length = true;
  cfg.use_sink = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::SparseCase c = ref::make_sparse_case(cfg);
  c.topk_length = ref::make_int_tensor({3100, 2500, 40});
  c.attn_sink.set({0}, kInf);
  c.attn_sink.set({1}, -kInf);
  ref::Rng rng(cfg.seed + 1);
  c.refresh_cache(rng);
  const ref::RefOutput r = ref::sparse_decode_reference(c.args());
  Stream stream;
  decode_test::DeviceSparse d(c);
  for (const char* layout : kCombineLayouts) {
    SCOPED_TRACE(layout != nullptr ? layout : "default layout");
    ScopedCombineLayout forced(layout);
    d.poison_outputs();
    ASSERT_TRUE(decode_test::run_sparse(d.args, stream));
    c.poison_outputs();
    d.download(c);
    const ref::CompareResult res =
        ref::compare_outputs(c.out.view(), c.lse.view(), r, ref::Tolerance::sparse());
    EXPECT_TRUE(res.ok) << "vs reference: " << res.summary();
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t e = 0; e < kDV; e += 41) EXPECT_EQ(c.out.get({i, s, 0, e}), 0.0);
      }
    }
  }
}

}  // namespace
}  // namespace sparse_mla
