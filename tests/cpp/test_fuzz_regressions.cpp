// The fuzz targets (fuzz/targets.h) inside the normal test binary: every committed seed and crash
// reproducer (fuzz/corpus/<target>/, fuzz/regressions/<target>/) is replayed, plus a batch of
// fresh random inputs per target. Issues the fuzzers found are kept as tests that reproduce them
// directly through the API (see docs/robustness.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "fuzz/targets.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/fuzz_inputs.h"

namespace sparse_mla::fuzz {
// gtest prints a failing parameter by its name.
void PrintTo(const Target& target, std::ostream* os) { *os << target.name; }
}  // namespace sparse_mla::fuzz

namespace sparse_mla {
namespace {

constexpr Device kHost{};

// Runs the committed files of <folder>/<target>/ through the target; returns how many ran.
int replay(const fuzz::Target& target, const char* folder) {
  const std::vector<fuzz_inputs::Input> inputs = fuzz_inputs::committed(folder, target.name);
  for (const fuzz_inputs::Input& in : inputs) {
    EXPECT_EQ(target.fn(in.bytes.data(), in.bytes.size()), "") << target.name << ": " << in.name;
  }
  return static_cast<int>(inputs.size());
}

class FuzzTarget : public testing::TestWithParam<fuzz::Target> {};

TEST_P(FuzzTarget, CorpusAndReproducers) {
  const int seeds = replay(GetParam(), "fuzz/corpus");
  replay(GetParam(), "fuzz/regressions");
  EXPECT_GT(seeds, 0) << "no seed corpus under fuzz/corpus/" << GetParam().name;
}

// Fresh inputs on every run; SPARSE_MLA_TEST_SEED replays one (the seed is in the failure).
TEST_P(FuzzTarget, RandomInputs) {
  const uint64_t seed = test_support::test_seed();
  for (const fuzz_inputs::Input& in : fuzz_inputs::random(seed, 300)) {
    const std::string finding = GetParam().fn(in.bytes.data(), in.bytes.size());
    ASSERT_EQ(finding, "") << GetParam().name << ", SPARSE_MLA_TEST_SEED=" << seed << ", "
                           << in.name;
  }
}

// The decode target's wide shapes (up to 128 heads, longer lists) on the CPU backend, as
// tests/cpp/cuda/test_cuda_fuzz.cpp runs them on the GPU backends.
TEST(FuzzDecodeWide, CorpusReproducersAndRandomInputs) {
  fuzz::DecodeRunner run = fuzz::cpu_runner();
  run.wide = true;
  const uint64_t seed = test_support::test_seed();
  const std::vector<fuzz_inputs::Input> inputs = fuzz_inputs::target_inputs("decode", seed, 200);
  ASSERT_GT(inputs.size(), 200u) << "no seed corpus under fuzz/corpus/decode";
  for (const fuzz_inputs::Input& in : inputs) {
    const std::string finding = fuzz::fuzz_decode_on(in.bytes.data(), in.bytes.size(), run);
    ASSERT_EQ(finding, "") << in.name << ", SPARSE_MLA_TEST_SEED=" << seed;
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

// With one page the synthesized page stride multiplied page_size by bytes_per_token before the
// head count was checked, which overflowed int64 for 2^31-1 heads of a bf16 cache (UBSan).
TEST(FuzzFindings, CacheFromTensorHugeHeadsOnePage) {
  alignas(16) static uint16_t elems[576];
  TensorView t;
  t.data = elems;
  t.dtype = DType::kBFloat16;
  t.ndim = 4;
  const int64_t big = (int64_t{1} << 31) - 1;
  const int64_t shape[4] = {1, big, big, 576}, strides[4] = {0, 576 * big, 576, 1};
  for (int d = 0; d < 4; ++d) t.shape[d] = shape[d], t.strides[d] = strides[d];
  KVCache kv;
  ASSERT_TRUE(kv_cache_from_tensor(t, "k_cache", &kv).ok());  // the operations check the heads
  DequantizeArgs a;
  a.kv = kv;
  int32_t slot = 0;
  float out[576];
  a.slots = TensorView::contiguous(&slot, DType::kInt32, Device{}, {1});
  a.out = TensorView::contiguous(out, DType::kFloat32, Device{}, {1, 576});
  const Status st = dequantize(a, Options{Backend::kCPU, nullptr});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("num_heads 2147483647"), std::string::npos) << st.to_string();
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
