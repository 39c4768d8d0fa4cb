// The malformed-input catalogue: every bad argument gets the right error, naming the argument with
// expected and actual values, and nothing is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "sparse_mla/sparse_mla.h"

namespace sparse_mla {
namespace {

constexpr Device kCPU{};
constexpr Device kGPU0{DeviceType::kCUDA, 0};
constexpr uint8_t kPoison = 0xA5;

// Host buffer with 64-byte aligned storage, filled with a poison byte.
struct Buffer {
  explicit Buffer(size_t bytes) : storage(bytes + 128, kPoison) {}
  void* data() {
    auto p = reinterpret_cast<uintptr_t>(storage.data());
    return reinterpret_cast<void*>((p + 63) & ~uintptr_t{63});
  }
  bool untouched() const {
    for (uint8_t v : storage)
      if (v != kPoison) return false;
    return true;
  }
  std::vector<uint8_t> storage;
};

struct Case {
  std::string name;
  StatusCode code;
  std::string message;  // must appear in the error message
};

// Valid sparse-decode arguments over small host buffers; each test breaks one thing.
struct SparseFixture {
  static constexpr int64_t b = 2, s_q = 1, h_q = 4, topk = 8, pages = 3, page = 64;
  Buffer q{b * s_q * h_q * 512 * 2}, cache{pages * 37440}, indices{b * s_q * topk * 4};
  Buffer out{b * s_q * h_q * 512 * 2}, lse{b * h_q * s_q * 4}, lengths{b * 4}, sink{h_q * 4};
  SparseDecodeArgs args;
  SparseFixture() {
    std::memset(indices.data(), 0xff, b * s_q * topk * 4);  // all -1
    args.q = TensorView::contiguous(q.data(), DType::kBFloat16, kCPU, {b, s_q, h_q, 512});
    args.kv = KVCache{cache.data(), kCPU, KVFormat::kModel1, pages, page, 37440, 1};
    args.indices = TensorView::contiguous(indices.data(), DType::kInt32, kCPU, {b, s_q, topk});
    args.out = TensorView::contiguous(out.data(), DType::kBFloat16, kCPU, {b, s_q, h_q, 512});
    args.lse = TensorView::contiguous(lse.data(), DType::kFloat32, kCPU, {b, h_q, s_q});
  }
  TensorView lengths_view() {
    return TensorView::contiguous(lengths.data(), DType::kInt32, kCPU, {b});
  }
};

void expect_error(const Status& s, const Case& c) {
  EXPECT_FALSE(s.ok()) << c.name << ": accepted";
  EXPECT_EQ(s.code(), c.code) << c.name << ": " << s.to_string();
  EXPECT_NE(s.message().find(c.message), std::string::npos)
      << c.name << ": message '" << s.message() << "' lacks '" << c.message << "'";
}

using SparseMutation = std::function<void(SparseFixture&)>;

TEST(ErrorCatalogue, SparseDecode) {
  const StatusCode kBad = StatusCode::kInvalidArgument;
  const std::vector<std::pair<Case, SparseMutation>> cases = {
      {{"q rank", kBad, "q: rank 3"},
       [](SparseFixture& f) { f.args.q.ndim = 3; }},
      {{"q dtype", kBad, "q: dtype float32, expected bfloat16"},
       [](SparseFixture& f) { f.args.q.dtype = DType::kFloat32; }},
      {{"q d_qk", kBad, "q: last dim 576, expected 512"},
       [](SparseFixture& f) { f.args.q.shape[3] = 576; }},
      {{"q last stride", kBad, "q: last dim stride 2, expected 1"},
       [](SparseFixture& f) { f.args.q.strides[3] = 2; }},
      {{"q misaligned", kBad, "q: data pointer is not 16-byte aligned"},
       [](SparseFixture& f) { f.args.q.data = static_cast<char*>(f.args.q.data) + 2; }},
      {{"q stride alignment", kBad, "q: stride 2 is 1032 bytes, expected a multiple of 16"},
       [](SparseFixture& f) { f.args.q.strides[2] = 516; }},
      {{"q negative stride", kBad, "q: stride 0 is -2048, expected >= 0"},
       [](SparseFixture& f) { f.args.q.strides[0] = -2048; }},
      {{"q s_q zero", kBad, "q: s_q (dim 1) is 0, expected >= 1"},
       [](SparseFixture& f) { f.args.q.shape[1] = 0; }},
      {{"q h_q zero", kBad, "q: h_q (dim 2) is 0, expected >= 1"},
       [](SparseFixture& f) { f.args.q.shape[2] = 0; }},
      {{"q huge batch", kBad, "q: dim 0 is 1099511627776, expected 0..2147483647"},
       [](SparseFixture& f) { f.args.q.shape[0] = int64_t{1} << 40; }},
      {{"q stride overflow", kBad, "overflows"},
       [](SparseFixture& f) { f.args.q.strides[0] = int64_t{1} << 61; }},
      {{"q null data", kBad, "q: data pointer is null"},
       [](SparseFixture& f) { f.args.q.data = nullptr; }},
      {{"q rows", kBad, "q: b * s_q * h_q = 2 * 1 * 2147483647 query rows, expected at most "
                        "2147483647"},
       [](SparseFixture& f) { f.args.q.shape[2] = INT32_MAX; f.args.q.strides[2] = 0; }},
      {{"cache format", kBad, "k_cache: format BF16, expected MODEL1 or V32"},
       [](SparseFixture& f) { f.args.kv.format = KVFormat::kBF16; }},
      {{"cache format value", kBad, "k_cache: format value 9, expected MODEL1, V32, BF16 or FP16"},
       [](SparseFixture& f) { f.args.kv.format = static_cast<KVFormat>(9); }},
      {{"extra format value", kBad,
        "extra_k_cache: format value 200, expected MODEL1, V32, BF16 or FP16"},
       [](SparseFixture& f) {
         f.args.extra_kv = f.args.kv;
         f.args.extra_kv->format = static_cast<KVFormat>(200);
         f.args.extra_indices = f.args.indices;
       }},
      {{"page stride small", kBad, "k_cache: page_stride 37360 bytes, expected >= page_size"},
       [](SparseFixture& f) { f.args.kv.page_stride = 37360; }},
      {{"page stride unaligned", kBad, "k_cache: page_stride 37448 bytes, expected a multiple of 16"},
       [](SparseFixture& f) { f.args.kv.page_stride = 37448; }},
      {{"page size zero", kBad, "k_cache: page_size 0, expected 1.."},
       [](SparseFixture& f) { f.args.kv.page_size = 0; }},
      {{"negative pages", kBad, "k_cache: num_pages -1, expected 0.."},
       [](SparseFixture& f) { f.args.kv.num_pages = -1; }},
      {{"cache misaligned", kBad, "k_cache: data pointer is not 16-byte aligned"},
       [](SparseFixture& f) { f.args.kv.data = static_cast<char*>(f.args.kv.data) + 8; }},
      {{"cache null", kBad, "k_cache: data pointer is null with 3 pages"},
       [](SparseFixture& f) { f.args.kv.data = nullptr; }},
      {{"cache pages overflow", kBad, "k_cache: num_pages * page_stride overflows"},
       [](SparseFixture& f) { f.args.kv.num_pages = 2000000000; f.args.kv.page_stride = int64_t{1} << 40; }},
      {{"fp8 heads", kBad, "k_cache: num_heads 2, expected 1 for FP8 formats"},
       [](SparseFixture& f) { f.args.kv.num_heads = 2; }},
      {{"indices dtype", kBad, "indices: dtype float32, expected int32"},
       [](SparseFixture& f) { f.args.indices.dtype = DType::kFloat32; }},
      {{"indices batch", kBad, "indices: shape [3, 1, 8], expected [2, 1, *]"},
       [](SparseFixture& f) { f.args.indices.shape[0] = 3; }},
      {{"indices topk zero", kBad, "indices: topk (dim 2) is 0, expected >= 1"},
       [](SparseFixture& f) { f.args.indices.shape[2] = 0; }},
      {{"indices device", kBad, "indices: on cuda:0, expected cpu (the device of q)"},
       [](SparseFixture& f) { f.args.indices.device = kGPU0; }},
      {{"indices cpu index", kBad, "indices: on cpu:1, expected cpu (the device of q)"},
       [](SparseFixture& f) { f.args.indices.device = Device{DeviceType::kCPU, 1}; }},
      {{"topk_length shape", kBad, "topk_length: shape [3], expected [2]"},
       [](SparseFixture& f) { f.args.topk_length = f.lengths_view(); f.args.topk_length->shape[0] = 3; }},
      {{"topk_length dtype", kBad, "topk_length: dtype float32, expected int32"},
       [](SparseFixture& f) { f.args.topk_length = f.lengths_view(); f.args.topk_length->dtype = DType::kFloat32; }},
      {{"extra indices alone", kBad, "extra_indices: given without extra_k_cache"},
       [](SparseFixture& f) { f.args.extra_indices = f.args.indices; }},
      {{"extra length alone", kBad, "extra_topk_length: given without extra_k_cache"},
       [](SparseFixture& f) { f.args.extra_topk_length = f.lengths_view(); }},
      {{"extra format", kBad, "extra_k_cache: format V32, expected MODEL1"},
       [](SparseFixture& f) {
         f.args.extra_kv = f.args.kv;
         f.args.extra_kv->format = KVFormat::kV32;
         f.args.extra_indices = f.args.indices;
       }},
      {{"extra missing indices", kBad, "extra_indices: missing"},
       [](SparseFixture& f) { f.args.extra_kv = f.args.kv; }},
      {{"sink shape", kBad, "attn_sink: shape [5], expected [4]"},
       [](SparseFixture& f) {
         f.args.attn_sink = TensorView::contiguous(f.sink.data(), DType::kFloat32, kCPU, {5});
       }},
      {{"scale nan", kBad, "softmax_scale: nan, expected a finite value > 0 and at most 2.35e38"},
       [](SparseFixture& f) { f.args.softmax_scale = std::nanf(""); }},
      {{"scale negative", kBad, "softmax_scale: -1.000000, expected a finite value > 0"},
       [](SparseFixture& f) { f.args.softmax_scale = -1.f; }},
      {{"scale huge", kBad, "softmax_scale: 300000000549775575777803994281145270272.000000"},
       [](SparseFixture& f) { f.args.softmax_scale = 3e38f; }},
      {{"out d_v", kBad, "out: shape [2, 1, 4, 576], expected [2, 1, 4, 512]"},
       [](SparseFixture& f) { f.args.out.shape[3] = 576; }},
      {{"out dtype", kBad, "out: dtype float32, expected bfloat16"},
       [](SparseFixture& f) { f.args.out.dtype = DType::kFloat32; }},
      {{"lse layout", kBad, "lse: shape [2, 1, 4], expected [2, 4, 1]"},
       [](SparseFixture& f) { f.args.lse.shape[1] = 1; f.args.lse.shape[2] = 4; }},
      {{"out device", kBad, "out: on cuda:0, expected cpu"},
       [](SparseFixture& f) { f.args.out.device = kGPU0; }},
  };
  for (const auto& [c, mutate] : cases) {
    SparseFixture f;
    mutate(f);
    expect_error(sparse_decode(f.args, Workspace{}, Options{Backend::kCPU}), c);
    EXPECT_TRUE(f.out.untouched() && f.lse.untouched()) << c.name << ": output written";
    WorkspaceSizes sizes;
    expect_error(sparse_decode_workspace_size(f.args, Options{}, &sizes), c);
    Backend chosen;
    expect_error(sparse_decode_supported(f.args, Options{}, &chosen), c);
  }
}

TEST(ErrorCatalogue, BackendSelection) {
  SparseFixture f;
  Backend chosen = Backend::kAuto;
  ASSERT_TRUE(sparse_decode_supported(f.args, Options{}, &chosen).ok());
  EXPECT_EQ(chosen, Backend::kCPU);
  expect_error(sparse_decode(f.args, Workspace{}, Options{Backend::kCUDA}),
               {"cuda on host tensors", StatusCode::kInvalidArgument,
                "backend 'cuda' runs on CUDA tensors, but the tensors are on cpu"});
  expect_error(sparse_decode(f.args, Workspace{}, Options{Backend::kSM90}),
               {"sm90 on host tensors", StatusCode::kInvalidArgument,
                "backend 'sm90' runs on CUDA tensors"});
  ::setenv("SPARSE_MLA_BACKEND", "tpu", 1);
  expect_error(sparse_decode(f.args, Workspace{}, Options{}),
               {"bad env", StatusCode::kInvalidArgument,
                "environment variable SPARSE_MLA_BACKEND: backend: 'tpu', expected one of auto, "
                "cpu, cuda, sm90"});
  ::setenv("SPARSE_MLA_BACKEND", "cpu", 1);
  EXPECT_TRUE(sparse_decode_supported(f.args, Options{}, &chosen).ok());
  ::unsetenv("SPARSE_MLA_BACKEND");
  expect_error(sparse_decode(f.args, Workspace{}, Options{static_cast<Backend>(7)}),
               {"backend value", StatusCode::kInvalidArgument,
                "options.backend: value 7, expected auto, cpu, cuda or sm90"});
  Backend parsed;
  expect_error(parse_backend("gpu", &parsed),
               {"parse", StatusCode::kInvalidArgument, "backend: 'gpu', expected one of"});
  EXPECT_TRUE(f.out.untouched());
}

struct DenseFixture {
  static constexpr int64_t b = 2, s_q = 2, h_q = 4, pages = 4, page = 16, max_pages = 2;
  Buffer q{b * s_q * h_q * 576 * 2}, cache{pages * page * 2 * 576 * 2}, table{b * max_pages * 4};
  Buffer seqlens{b * 4}, out{b * s_q * h_q * 512 * 2}, lse{b * h_q * s_q * 4};
  DenseDecodeArgs args;
  DenseFixture() {
    args.q = TensorView::contiguous(q.data(), DType::kBFloat16, kCPU, {b, s_q, h_q, 576});
    args.kv = KVCache{cache.data(), kCPU, KVFormat::kBF16, pages, page, page * 2 * 576 * 2, 2};
    args.block_table = TensorView::contiguous(table.data(), DType::kInt32, kCPU, {b, max_pages});
    args.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, kCPU, {b});
    args.out = TensorView::contiguous(out.data(), DType::kBFloat16, kCPU, {b, s_q, h_q, 512});
    args.lse = TensorView::contiguous(lse.data(), DType::kFloat32, kCPU, {b, h_q, s_q});
  }
};

TEST(ErrorCatalogue, DenseDecode) {
  const StatusCode kBad = StatusCode::kInvalidArgument;
  const std::vector<std::pair<Case, std::function<void(DenseFixture&)>>> cases = {
      {{"h_q % h_kv", kBad, "q: h_q 3 is not a multiple of h_kv 2"},
       [](DenseFixture& f) { f.args.q.shape[2] = 3; f.args.out.shape[2] = 3; f.args.lse.shape[1] = 3; }},
      {{"q dtype vs cache", kBad, "q: dtype float16, expected bfloat16 with a BF16 cache"},
       [](DenseFixture& f) { f.args.q.dtype = DType::kFloat16; }},
      {{"block_table rank", kBad, "block_table: rank 1"},
       [](DenseFixture& f) { f.args.block_table.ndim = 1; }},
      {{"block_table batch", kBad, "block_table: shape [3, 2], expected [2, *]"},
       [](DenseFixture& f) { f.args.block_table.shape[0] = 3; }},
      {{"seqlens shape", kBad, "cache_seqlens: shape [1], expected [2]"},
       [](DenseFixture& f) { f.args.cache_seqlens.shape[0] = 1; }},
      {{"tokens overflow", kBad, "block_table: max_pages * page_size = 1000000000 * 16 exceeds"},
       [](DenseFixture& f) { f.args.block_table.shape[1] = 1000000000; f.args.block_table.strides[0] = 1; }},
      {{"dense d_qk", kBad, "q: last dim 512, expected 576"},
       [](DenseFixture& f) { f.args.q.shape[3] = 512; }},
      {{"dense heads", kBad, "k_cache: num_heads 0, expected 1..128"},
       [](DenseFixture& f) { f.args.kv.num_heads = 0; }},
      {{"dense out dtype", kBad, "out: dtype float16, expected bfloat16"},
       [](DenseFixture& f) { f.args.out.dtype = DType::kFloat16; }},
      {{"dense q rows", kBad, "q: b * s_q * h_q = 2 * 1073741824 * 4 query rows"},
       [](DenseFixture& f) { f.args.q.shape[1] = int64_t{1} << 30; f.args.q.strides[1] = 0; }},
  };
  for (const auto& [c, mutate] : cases) {
    DenseFixture f;
    mutate(f);
    expect_error(dense_decode(f.args, Workspace{}, Options{Backend::kCPU}), c);
    EXPECT_TRUE(f.out.untouched() && f.lse.untouched()) << c.name << ": output written";
  }
}

TEST(ErrorCatalogue, MergeAndKVTools) {
  const StatusCode kBad = StatusCode::kInvalidArgument;
  Buffer parts{2 * 1 * 1 * 4 * 512 * 4}, lse_parts{2 * 4 * 4}, out{4 * 512 * 2}, lse{4 * 4};
  MergeArgs m;
  m.out_parts = TensorView::contiguous(parts.data(), DType::kFloat32, kCPU, {2, 1, 1, 4, 512});
  m.lse_parts = TensorView::contiguous(lse_parts.data(), DType::kFloat32, kCPU, {2, 1, 1, 4});
  m.out = TensorView::contiguous(out.data(), DType::kBFloat16, kCPU, {1, 1, 4, 512});
  m.lse = TensorView::contiguous(lse.data(), DType::kFloat32, kCPU, {1, 4, 1});
  MergeArgs bad = m;
  bad.out_parts.shape[0] = 0;
  expect_error(merge_attention(bad, {}), {"merge n", kBad, "out_parts: n (dim 0) is 0, expected >= 1"});
  bad = m;
  bad.lse_parts.shape[3] = 5;
  expect_error(merge_attention(bad, {}), {"merge lse", kBad, "lse_parts: shape [2, 1, 1, 5], expected [2, 1, 1, 4]"});
  bad = m;  // 2^66 rows would wrap to 0 in 64 bits
  for (int d = 1; d <= 3; ++d) {
    bad.out_parts.shape[d] = bad.lse_parts.shape[d] = int64_t{1} << 22;
    bad.out_parts.strides[d] = bad.lse_parts.strides[d] = 0;
  }
  expect_error(merge_attention(bad, {}),
               {"merge rows", kBad, "out_parts: b * s_q * h_q = 4194304 * 4194304 * 4194304 "
                                    "query rows, expected at most 2147483647"});
  bad = m;
  bad.out.dtype = DType::kFloat16;
  expect_error(merge_attention(bad, {}), {"merge out dtype", kBad, "out: dtype float16, expected bfloat16 or float32"});
  EXPECT_TRUE(out.untouched() && lse.untouched());

  Buffer cache{2 * 37440}, src{3 * 512 * 4}, slots{3 * 4}, rows{3 * 512 * 4};
  QuantizeStoreArgs qs;
  qs.src = TensorView::contiguous(src.data(), DType::kFloat32, kCPU, {3, 512});
  qs.slots = TensorView::contiguous(slots.data(), DType::kInt32, kCPU, {3});
  qs.kv = KVCache{cache.data(), kCPU, KVFormat::kModel1, 2, 64, 37440, 1};
  QuantizeStoreArgs bq = qs;
  bq.kv.format = KVFormat::kBF16;
  expect_error(quantize_store(bq, {}), {"quantize bf16", kBad, "kv: format BF16, expected MODEL1 or V32"});
  bq.kv.format = static_cast<KVFormat>(9);
  expect_error(quantize_store(bq, {}),
               {"quantize format value", kBad, "kv: format value 9, expected MODEL1, V32, BF16 or FP16"});
  bq = qs;
  bq.src.shape[1] = 576;
  expect_error(quantize_store(bq, {}), {"quantize width", kBad, "src: shape [3, 576], expected [*, 512]"});
  bq = qs;
  bq.slots.shape[0] = 2;
  expect_error(quantize_store(bq, {}), {"quantize slots", kBad, "slots: shape [2], expected [3]"});
  EXPECT_TRUE(cache.untouched()) << "quantize_store wrote into the cache on bad input";

  DequantizeArgs dq;
  dq.kv = qs.kv;
  dq.slots = qs.slots;
  dq.out = TensorView::contiguous(rows.data(), DType::kFloat32, kCPU, {2, 512});
  expect_error(dequantize(dq, {}), {"dequantize rows", kBad, "out: shape [2, 512], expected [3, 512]"});
  EXPECT_TRUE(rows.untouched());

  Buffer dst{8 * 1728}, table_src{4}, table_dst{4 * 4}, lens{4};
  RepackArgs rp;
  rp.src = qs.kv;
  rp.dst = KVCache{dst.data(), kCPU, KVFormat::kV32, 8, 2, 1728, 1};
  rp.src_block_table = TensorView::contiguous(table_src.data(), DType::kInt32, kCPU, {1, 1});
  rp.dst_block_table = TensorView::contiguous(table_dst.data(), DType::kInt32, kCPU, {1, 4});
  rp.seqlens = TensorView::contiguous(lens.data(), DType::kInt32, kCPU, {1});
  expect_error(repack_pages(rp, {}), {"repack format", kBad, "dst: format V32 with 1 heads, expected MODEL1"});
  rp.dst.format = KVFormat::kModel1;
  rp.dst_block_table.shape[0] = 2;
  expect_error(repack_pages(rp, {}), {"repack table", kBad, "dst_block_table: shape [2, 4], expected [1, *]"});
  EXPECT_TRUE(dst.untouched());
}

TEST(ErrorCatalogue, CacheFromTensor) {
  Buffer bytes{2 * 64 * 584};
  KVCache cache;
  TensorView t = TensorView::contiguous(bytes.data(), DType::kUInt8, kCPU, {2, 64, 1, 580});
  expect_error(kv_cache_from_tensor(t, "k_cache", &cache),
               {"last dim", StatusCode::kInvalidArgument,
                "k_cache: last dim 580, expected 584 (MODEL1) or 656 (V32)"});
  t = TensorView::strided(bytes.data(), DType::kUInt8, kCPU, {2, 64, 1, 584}, {64 * 584, 600, 584, 1});
  expect_error(kv_cache_from_tensor(t, "k_cache", &cache),
               {"page not dense", StatusCode::kInvalidArgument, "do not describe dense pages"});
  t = TensorView::contiguous(bytes.data(), DType::kFloat32, kCPU, {2, 64, 1, 146});
  expect_error(kv_cache_from_tensor(t, "k_cache", &cache),
               {"dtype", StatusCode::kInvalidArgument, "k_cache: dtype float32, expected uint8"});
  t = TensorView::contiguous(bytes.data(), DType::kUInt8, kCPU, {2, 64, 584});
  expect_error(kv_cache_from_tensor(t, "k_cache", &cache),
               {"rank", StatusCode::kInvalidArgument, "k_cache: rank 3, expected 4"});
}

// Default strides of absurd extents saturate instead of overflowing, and validation rejects the
// view with a message (the buffer behind it is never touched).
TEST(ErrorCatalogue, HugeExtentsSaturate) {
  const int64_t huge = int64_t{1} << 40;
  const TensorView t =
      TensorView::contiguous(nullptr, DType::kBFloat16, kCPU, {huge, huge, huge, 512});
  EXPECT_EQ(t.strides[3], 1);
  EXPECT_EQ(t.strides[2], 512);
  EXPECT_EQ(t.strides[1], huge * 512);
  EXPECT_EQ(t.strides[0], INT64_MAX);
  EXPECT_EQ(t.numel(), INT64_MAX);

  SparseFixture f;
  f.args.q = TensorView::contiguous(f.q.data(), DType::kBFloat16, kCPU, {huge, huge, huge, 512});
  const Status st = sparse_decode(f.args, Workspace{}, Options{});
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

}  // namespace
}  // namespace sparse_mla
