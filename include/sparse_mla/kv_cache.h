// Paged KV-cache descriptors. Byte layouts are specified in docs/formats.md.
#pragma once

#include <cstdint>

#include "sparse_mla/status.h"
#include "sparse_mla/tensor.h"

namespace sparse_mla {

enum class KVFormat : uint8_t {
  kModel1,  // DeepSeek-V4: 584 B/token, e4m3 nope[448] + bf16 rope[64] rows, UE8M0 scales in a page footer
  kV32,     // DeepSeek-V3.2: 656 B/token rows: e4m3 nope[512], fp32 scales[4], bf16 rope[64]
  kBF16,    // dense: [page_size, num_heads, 576] bf16 per page
  kFP16,    // dense: [page_size, num_heads, 576] fp16 per page
};

const char* kv_format_name(KVFormat format);

inline constexpr int kDV = 512;            // value width of every format
inline constexpr int kModel1BytesPerToken = 584;
inline constexpr int kModel1RowBytes = 576;  // 448 e4m3 + 64 bf16
inline constexpr int kModel1ScaleBytes = 8;  // 7 UE8M0 + 1 unused, in the page footer
inline constexpr int kModel1NopeDims = 448;
inline constexpr int kModel1ScaleTile = 64;
inline constexpr int kV32BytesPerToken = 656;
inline constexpr int kV32NopeDims = 512;
inline constexpr int kV32ScaleTile = 128;
inline constexpr int kDenseHeadDim = 576;
inline constexpr int kRopeDims = 64;

// Key width (d_qk) of a format: 512 for MODEL1, 576 for the others.
int kv_format_d_qk(KVFormat format);
// Bytes one token takes in a page (all heads, footer included); num_heads matters for BF16/FP16 only.
int64_t kv_format_bytes_per_token(KVFormat format, int64_t num_heads = 1);
bool kv_format_is_fp8(KVFormat format);

struct KVCache {
  void* data = nullptr;  // start of page 0
  Device device{};
  KVFormat format = KVFormat::kModel1;
  int64_t num_pages = 0;
  int64_t page_size = 0;    // tokens per page, >= 1
  int64_t page_stride = 0;  // bytes between pages: >= page_size * bytes_per_token, multiple of 16
  int64_t num_heads = 1;    // h_kv; FP8 formats have exactly 1

  int64_t num_slots() const { return num_pages * page_size; }
  int64_t bytes_per_token() const { return kv_format_bytes_per_token(format, num_heads); }
};

// Maps an engine's cache tensor onto a descriptor: FP8 formats are uint8 (or float8_e4m3)
// [num_pages, page_size, 1, 584|656]; dense formats are bf16/fp16 [num_pages, page_size, h_kv, 576].
// The page stride comes from strides[0]; each page must be dense inside.
Status kv_cache_from_tensor(const TensorView& tensor, const char* arg_name, KVCache* cache);

}  // namespace sparse_mla
