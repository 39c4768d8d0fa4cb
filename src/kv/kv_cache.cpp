#include "sparse_mla/kv_cache.h"

#include <string>

namespace sparse_mla {

const char* kv_format_name(KVFormat format) {
  switch (format) {
    case KVFormat::kModel1: return "MODEL1";
    case KVFormat::kV32: return "V32";
    case KVFormat::kBF16: return "BF16";
    case KVFormat::kFP16: return "FP16";
  }
  return "unknown";
}

int kv_format_d_qk(KVFormat format) {
  return format == KVFormat::kModel1 ? kDV : kDenseHeadDim;
}

int64_t kv_format_bytes_per_token(KVFormat format, int64_t num_heads) {
  switch (format) {
    case KVFormat::kModel1: return kModel1BytesPerToken;
    case KVFormat::kV32: return kV32BytesPerToken;
    case KVFormat::kBF16:
    case KVFormat::kFP16: return num_heads * kDenseHeadDim * 2;
  }
  return 0;
}

bool kv_format_is_fp8(KVFormat format) {
  return format == KVFormat::kModel1 || format == KVFormat::kV32;
}

Status kv_cache_from_tensor(const TensorView& t, const char* arg, KVCache* cache) {
  const std::string name(arg);
  if (t.ndim != 4) {
    return Status::InvalidArgument(name + ": rank " + std::to_string(t.ndim) +
                                   ", expected 4 ([num_pages, page_size, h_kv, bytes or 576])");
  }
  for (int d = 0; d < 4; ++d) {
    if (t.shape[d] < 0 || t.shape[d] > (int64_t{1} << 31) - 1) {
      return Status::InvalidArgument(name + ": dim " + std::to_string(d) + " is " +
                                     std::to_string(t.shape[d]) + ", expected 0..2147483647");
    }
    if (t.shape[d] > 1 && (t.strides[d] < 0 || t.strides[d] > (int64_t{1} << 48))) {
      return Status::InvalidArgument(name + ": stride " + std::to_string(d) + " is " +
                                     std::to_string(t.strides[d]) + ", expected 0..2^48");
    }
  }
  KVCache c;
  c.data = t.data;
  c.device = t.device;
  c.num_pages = t.shape[0];
  c.page_size = t.shape[1];
  c.num_heads = t.shape[2];
  const int64_t last = t.shape[3];
  if (t.dtype == DType::kUInt8 || t.dtype == DType::kFloat8E4M3) {
    if (last == kModel1BytesPerToken) {
      c.format = KVFormat::kModel1;
    } else if (last == kV32BytesPerToken) {
      c.format = KVFormat::kV32;
    } else {
      return Status::InvalidArgument(name + ": last dim " + std::to_string(last) +
                                     ", expected 584 (MODEL1) or 656 (V32)");
    }
    if (c.num_heads != 1) {
      return Status::InvalidArgument(name + ": dim 2 (h_kv) is " + std::to_string(c.num_heads) +
                                     ", expected 1 for FP8 caches");
    }
  } else if (t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16) {
    c.format = t.dtype == DType::kBFloat16 ? KVFormat::kBF16 : KVFormat::kFP16;
    if (last != kDenseHeadDim) {
      return Status::InvalidArgument(name + ": last dim " + std::to_string(last) +
                                     ", expected 576 for a bf16/fp16 cache");
    }
  } else {
    return Status::InvalidArgument(name + ": dtype " + std::string(dtype_name(t.dtype)) +
                                   ", expected uint8/float8_e4m3fn (FP8 pages) or bfloat16/float16");
  }
  // Each page must be dense inside: tokens, heads and bytes packed, pages may be padded. An empty
  // tensor addresses nothing, so its strides need no layout (numpy 2 gives them all 0).
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  const int64_t row = last;
  bool empty = false;
  for (int d = 0; d < 4; ++d) empty |= t.shape[d] == 0;
  const bool dense_inside = empty || ((t.shape[3] <= 1 || t.strides[3] == 1) &&
                                      (t.shape[2] <= 1 || t.strides[2] == row) &&
                                      (t.shape[1] <= 1 || t.strides[1] == row * t.shape[2]));
  if (!dense_inside) {
    return Status::InvalidArgument(name + ": strides [" + std::to_string(t.strides[0]) + ", " +
                                   std::to_string(t.strides[1]) + ", " +
                                   std::to_string(t.strides[2]) + ", " +
                                   std::to_string(t.strides[3]) +
                                   "] do not describe dense pages; expected strides[1] = " +
                                   std::to_string(row * t.shape[2]) + ", strides[2] = " +
                                   std::to_string(row) + ", strides[3] = 1");
  }
  // One page has no neighbour to step to and the stride of an extent of 1 means nothing: the
  // page's own bytes, rounded up to the 16-byte multiple the checks ask of every stride. Heads
  // past the checks' 128 (rejected there by name) would overflow that product.
  if (t.shape[0] > 1) {
    c.page_stride = t.strides[0] * elem;
  } else if (c.num_heads <= 128) {
    c.page_stride = (c.page_size * c.bytes_per_token() + 15) / 16 * 16;
  }
  *cache = c;
  return Status::Ok();
}

}  // namespace sparse_mla
