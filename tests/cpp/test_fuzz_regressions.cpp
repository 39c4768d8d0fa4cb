// The fuzz targets (fuzz/targets.h) inside the normal test binary: every committed seed and crash
// reproducer (fuzz/corpus/<target>/, fuzz/regressions/<target>/) is replayed, plus a batch of
// fresh random inputs per target. Issues the fuzzers found are kept as tests that reproduce them
// directly through the API (see docs/robustness.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "fuzz/targets.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::fuzz {
// gtest prints a failing parameter by its name.
void PrintTo(const Target& target, std::ostream* os) { *os << target.name; }
}  // namespace sparse_mla::fuzz

namespace sparse_mla {
namespace {

namespace fs = std::filesystem;

constexpr Device kHost{};

// The repository root, from this file's path (tests/cpp/<this file>).
fs::path repo_root() { return fs::path(__FILE__).parent_path().parent_path().parent_path(); }

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Runs every file of <root>/<folder>/<target>/ through the target; returns how many ran.
int replay(const fuzz::Target& target, const char* folder) {
  const fs::path dir = repo_root() / folder / target.name;
  if (!fs::is_directory(dir)) return 0;
  int count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::vector<uint8_t> input = read_bytes(entry.path());
    EXPECT_EQ(target.fn(input.data(), input.size()), "")
        << target.name << ": " << entry.path().string();
    ++count;
  }
  return count;
}

class FuzzTarget : public testing::TestWithParam<fuzz::Target> {};

TEST_P(FuzzTarget, CorpusAndReproducers) {
  const int seeds = replay(GetParam(), "fuzz/corpus");
  replay(GetParam(), "fuzz/regressions");
  EXPECT_GT(seeds, 0) << "no seed corpus under fuzz/corpus/" << GetParam().name;
}

// Fresh inputs on every run; SPARSE_MLA_TEST_SEED replays one (the seed is in the failure).
TEST_P(FuzzTarget, RandomInputs) {
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("SPARSE_MLA_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 300; ++i) {
    std::vector<uint8_t> input(rng() % 600);
    for (uint8_t& byte : input) byte = static_cast<uint8_t>(rng());
    const std::string finding = GetParam().fn(input.data(), input.size());
    ASSERT_EQ(finding, "") << GetParam().name << ", SPARSE_MLA_TEST_SEED=" << seed << ", input "
                           << i;
  }
}

INSTANTIATE_TEST_SUITE_P(All, FuzzTarget, testing::ValuesIn(fuzz::kTargets),
                         [](const testing::TestParamInfo<fuzz::Target>& info) {
                           return std::string(info.param.name);
                         });

// repack_pages within one pool (dst is src): engines compact or move pages inside their own
// cache. A page copied onto itself must come out unchanged, and a copy to another page of the
// same pool must land there.
TEST(FuzzFindings, RepackInsideOnePool) {
  constexpr int64_t kPage = 3, kStride = 1760;  // MODEL1, ceil(3*584/16)*16
  std::vector<uint8_t> storage(3 * kStride + 16);
  uint8_t* pool = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) % 16) % 16;
  for (int64_t i = 0; i < 3 * kStride; ++i) pool[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<uint8_t> before(pool, pool + 3 * kStride);
  const KVCache kv{pool, kHost, KVFormat::kModel1, 3, kPage, kStride, 1};
  int32_t src_table[2] = {0, 0}, dst_table[2] = {0, 2}, lens[2] = {3, 2};
  RepackArgs a;
  a.src = kv;
  a.dst = kv;
  a.src_block_table = TensorView::contiguous(src_table, DType::kInt32, kHost, {2, 1});
  a.dst_block_table = TensorView::contiguous(dst_table, DType::kInt32, kHost, {2, 1});
  a.seqlens = TensorView::contiguous(lens, DType::kInt32, kHost, {2});
  ASSERT_TRUE(repack_pages(a, Options{Backend::kCPU, nullptr}).ok());
  // Page 0 unchanged; page 2 holds page 0's first two tokens (rows and footer entries).
  EXPECT_EQ(0, std::memcmp(pool, before.data(), kStride));
  EXPECT_EQ(0, std::memcmp(pool + 2 * kStride, pool, 2 * 576));
  EXPECT_EQ(0, std::memcmp(pool + 2 * kStride + kPage * 576, pool + kPage * 576, 2 * 8));
}

// ---- Fuzzer findings, fixed; each test reproduces one through the API ----

struct SparseArgs {
  std::vector<uint16_t> q = std::vector<uint16_t>(512, 0);
  std::vector<int32_t> indices = std::vector<int32_t>(1, -1);
  std::vector<uint16_t> out = std::vector<uint16_t>(512, 0);
  std::vector<float> lse = std::vector<float>(1, 0.f);
  alignas(16) uint8_t cache[2 * 584 + 16] = {};
  SparseDecodeArgs args;
  SparseArgs() {
    args.q = TensorView::contiguous(q.data(), DType::kBFloat16, kHost, {1, 1, 1, 512});
    args.kv = KVCache{cache, kHost, KVFormat::kModel1, 1, 2, 1168, 1};
    args.indices = TensorView::contiguous(indices.data(), DType::kInt32, kHost, {1, 1, 1});
    args.out = TensorView::contiguous(out.data(), DType::kBFloat16, kHost, {1, 1, 1, 512});
    args.lse = TensorView::contiguous(lse.data(), DType::kFloat32, kHost, {1, 1, 1});
  }
};

// A TensorView whose ndim exceeds kMaxDims was rejected, but building the message read
// shape[5..ndim) past the array (UBSan: index out of bounds; ASan with a large ndim).
TEST(FuzzFindings, RankAboveMaxDims) {
  SparseArgs s;
  s.args.q.ndim = 64;
  Backend chosen;
  const Status st = sparse_decode_supported(s.args, Options{}, &chosen);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("q: rank 64"), std::string::npos) << st.message();
}

// kv_cache_from_tensor computed page_size * bytes_per_token and strides[0] * element size
// without range checks: huge extents overflowed int64 (UBSan: signed overflow).
TEST(FuzzFindings, CacheFromTensorHugePageOverflows) {
  alignas(16) static uint8_t bytes[656];
  TensorView t;  // set by hand: TensorView::strided would overflow computing default strides
  t.data = bytes;
  t.dtype = DType::kUInt8;
  t.ndim = 4;
  const int64_t shape[4] = {1, int64_t{1} << 62, 1, 656}, strides[4] = {0, 656, 656, 1};
  for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
  KVCache kv;
  const Status st = kv_cache_from_tensor(t, "k_cache", &kv);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

// TensorView::numel multiplied extents without an overflow check and check_tensor called it
// first, so a 4-D view with large (individually valid) extents overflowed int64 (UBSan).
TEST(FuzzFindings, NumelOverflows) {
  SparseArgs s;
  const int64_t big = (int64_t{1} << 31) - 1;
  for (int d = 0; d < 3; ++d) s.args.q.shape[d] = big, s.args.q.strides[d] = 0;
  Backend chosen;
  const Status st = sparse_decode_supported(s.args, Options{}, &chosen);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

// check_kv_cache accepted a KVFormat value outside the enum (bytes_per_token 0, so any
// page_stride passed); dequantize then returned OK without writing its output.
TEST(FuzzFindings, UnknownCacheFormat) {
  alignas(16) uint8_t cache[64] = {};
  int32_t slot = 0;
  std::vector<float> out(576, -7.f);
  DequantizeArgs a;
  a.kv = KVCache{cache, kHost, static_cast<KVFormat>(9), 1, 1, 16, 1};
  a.slots = TensorView::contiguous(&slot, DType::kInt32, kHost, {1});
  a.out = TensorView::contiguous(out.data(), DType::kFloat32, kHost, {1, 576});
  const Status st = dequantize(a, Options{Backend::kCPU, nullptr});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

// A DeviceType value outside the enum was taken for a CUDA device (and, in a CUDA build, could
// reach the CUDA backend with host pointers).
TEST(FuzzFindings, DeviceTypeOutsideEnum) {
  SparseArgs s;
  const Device odd{static_cast<DeviceType>(7), 0};
  for (TensorView* t : {&s.args.q, &s.args.indices, &s.args.out, &s.args.lse}) t->device = odd;
  s.args.kv.device = odd;
  Backend chosen;
  const Status st = sparse_decode_supported(s.args, Options{}, &chosen);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("device type 7"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace sparse_mla
