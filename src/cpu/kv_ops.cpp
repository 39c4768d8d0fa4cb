// CPU KV-cache tools: quantize-and-store, dequantize, page repack. Byte layouts and the
// quantization recipe follow spec section 2 through src/kv/format.h, so the bytes written here
// are identical to what the CUDA backend and the engines produce.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "src/cpu/cpu_backend.h"
#include "src/kv/format.h"

namespace sparse_mla::cpu {
namespace {

// Reads element (row, col) of a rank-2 view of bf16/fp16/float32 values as float.
float load_value(const TensorView& t, int64_t row, int64_t col) {
  const int64_t off = row * t.strides[0] + col * t.strides[1];
  switch (t.dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(t.data)[off];
    case DType::kBFloat16:
      return fmt::bf16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    case DType::kFloat16:
      return fmt::fp16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    default:
      return 0.f;
  }
}

// bf16 bits of element (row, col): exact for bf16 sources, RNE otherwise.
uint16_t load_bf16(const TensorView& t, int64_t row, int64_t col) {
  if (t.dtype == DType::kBFloat16) {
    return static_cast<const uint16_t*>(t.data)[row * t.strides[0] + col * t.strides[1]];
  }
  return fmt::float_to_bf16(load_value(t, row, col));
}

int32_t load_index(const TensorView& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0]];
}

int32_t load_index2(const TensorView& t, int64_t i, int64_t j) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0] + j * t.strides[1]];
}

void store_bf16(uint8_t* dst, uint16_t bits) { std::memcpy(dst, &bits, 2); }

uint8_t* page_base(const KVCache& kv, int64_t page) {
  return static_cast<uint8_t*>(kv.data) + page * kv.page_stride;
}

// Quantizes `count` values (a scale tile) of row `row` starting at column `col0`; returns the
// scale exponent and writes the e4m3 codes to dst.
int quantize_tile(const TensorView& src, int64_t row, int64_t col0, int count, uint8_t* dst) {
  float vals[kV32ScaleTile];
  float amax = 0.f;
  for (int j = 0; j < count; ++j) {
    vals[j] = load_value(src, row, col0 + j);
    // fmax ignores NaN, so a NaN element does not poison the whole tile's scale.
    amax = std::fmax(amax, std::fabs(vals[j]));
  }
  const int e = fmt::scale_exponent(amax);
  const float scale = fmt::exp2i(e);
  for (int j = 0; j < count; ++j) dst[j] = fmt::float_to_e4m3(vals[j] / scale);
  return e;
}

void quantize_model1(const TensorView& src, int64_t row, uint8_t* base, int64_t page_size,
                     int64_t t) {
  uint8_t* data = base + fmt::model1_row_offset(t);
  uint8_t* scales = base + fmt::model1_scale_offset(page_size, t);
  for (int tile = 0; tile < kModel1NopeDims / kModel1ScaleTile; ++tile) {
    const int e = quantize_tile(src, row, tile * kModel1ScaleTile, kModel1ScaleTile,
                                data + tile * kModel1ScaleTile);
    scales[tile] = static_cast<uint8_t>(e + 127);
  }
  scales[kModel1ScaleBytes - 1] = 0;
  for (int j = 0; j < kRopeDims; ++j) {
    store_bf16(data + kModel1NopeDims + 2 * j, load_bf16(src, row, kModel1NopeDims + j));
  }
}

void quantize_v32(const TensorView& src, int64_t row, uint8_t* dst) {
  for (int tile = 0; tile < kV32NopeDims / kV32ScaleTile; ++tile) {
    const int e =
        quantize_tile(src, row, tile * kV32ScaleTile, kV32ScaleTile, dst + tile * kV32ScaleTile);
    const float scale = fmt::exp2i(e);
    std::memcpy(dst + fmt::kV32ScaleOffset + 4 * tile, &scale, 4);
  }
  for (int j = 0; j < kRopeDims; ++j) {
    store_bf16(dst + fmt::kV32RopeOffset + 2 * j, load_bf16(src, row, kV32NopeDims + j));
  }
}

// Writes `value` as element (row, col) of a float32 or bf16 view.
void store_out(const TensorView& out, int64_t row, int64_t col, float value) {
  const int64_t off = row * out.strides[0] + col * out.strides[1];
  if (out.dtype == DType::kFloat32) {
    static_cast<float*>(out.data)[off] = value;
  } else {
    static_cast<uint16_t*>(out.data)[off] = fmt::float_to_bf16(value);
  }
}

void dequantize_row(const KVCache& kv, int64_t slot, const TensorView& out, int64_t row) {
  const int64_t page = slot / kv.page_size;
  const int64_t t = slot % kv.page_size;
  const uint8_t* base = page_base(kv, page);
  switch (kv.format) {
    case KVFormat::kModel1: {
      const uint8_t* data = base + fmt::model1_row_offset(t);
      const uint8_t* scales = base + fmt::model1_scale_offset(kv.page_size, t);
      for (int j = 0; j < kModel1NopeDims; ++j) {
        store_out(out, row, j,
                  fmt::e4m3_to_float(data[j]) * fmt::ue8m0_to_float(scales[j / kModel1ScaleTile]));
      }
      for (int j = 0; j < kRopeDims; ++j) {
        uint16_t bits;
        std::memcpy(&bits, data + kModel1NopeDims + 2 * j, 2);
        store_out(out, row, kModel1NopeDims + j, fmt::bf16_to_float(bits));
      }
      break;
    }
    case KVFormat::kV32: {
      const uint8_t* data = base + t * kV32BytesPerToken;
      float scales[kV32NopeDims / kV32ScaleTile];
      std::memcpy(scales, data + fmt::kV32ScaleOffset, sizeof(scales));
      for (int j = 0; j < kV32NopeDims; ++j) {
        store_out(out, row, j, fmt::e4m3_to_float(data[j]) * scales[j / kV32ScaleTile]);
      }
      for (int j = 0; j < kRopeDims; ++j) {
        uint16_t bits;
        std::memcpy(&bits, data + fmt::kV32RopeOffset + 2 * j, 2);
        store_out(out, row, kV32NopeDims + j, fmt::bf16_to_float(bits));
      }
      break;
    }
    case KVFormat::kBF16:
    case KVFormat::kFP16: {
      // Head 0 of the token: heads follow each other inside the token's row.
      const uint8_t* data = base + t * kv.bytes_per_token();
      for (int j = 0; j < kDenseHeadDim; ++j) {
        uint16_t bits;
        std::memcpy(&bits, data + 2 * j, 2);
        store_out(
            out, row, j,
            kv.format == KVFormat::kBF16 ? fmt::bf16_to_float(bits) : fmt::fp16_to_float(bits));
      }
      break;
    }
  }
}

// Copies tokens [src_t, src_t + n) of one src page to [dst_t, dst_t + n) of one dst page.
void copy_run(const KVCache& src, int64_t src_page, int64_t src_t, const KVCache& dst,
              int64_t dst_page, int64_t dst_t, int64_t n) {
  const uint8_t* s = page_base(src, src_page);
  uint8_t* d = page_base(dst, dst_page);
  if (src.format == KVFormat::kModel1) {
    std::memcpy(d + fmt::model1_row_offset(dst_t), s + fmt::model1_row_offset(src_t),
                static_cast<size_t>(n * kModel1RowBytes));
    std::memcpy(d + fmt::model1_scale_offset(dst.page_size, dst_t),
                s + fmt::model1_scale_offset(src.page_size, src_t),
                static_cast<size_t>(n * kModel1ScaleBytes));
    return;
  }
  const int64_t bpt = src.bytes_per_token();
  std::memcpy(d + dst_t * bpt, s + src_t * bpt, static_cast<size_t>(n * bpt));
}

}  // namespace

Status quantize_store(const QuantizeStoreArgs& args) {
  const TensorView& src = args.src;
  const KVCache& kv = args.kv;
  const int64_t n = src.shape[0];
  const int64_t num_slots = kv.num_slots();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = load_index(args.slots, i);
    if (slot < 0 || slot >= num_slots) continue;  // -1 skips; out of range is never written
    const int64_t page = slot / kv.page_size;
    const int64_t t = slot % kv.page_size;
    uint8_t* base = page_base(kv, page);
    if (kv.format == KVFormat::kModel1) {
      quantize_model1(src, i, base, kv.page_size, t);
    } else {
      quantize_v32(src, i, base + t * kV32BytesPerToken);
    }
  }
  return Status::Ok();
}

Status dequantize(const DequantizeArgs& args) {
  const KVCache& kv = args.kv;
  const TensorView& out = args.out;
  const int64_t n = args.slots.shape[0];
  const int64_t num_slots = kv.num_slots();
  const int d = kv_format_d_qk(kv.format);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = load_index(args.slots, i);
    if (slot < 0 || slot >= num_slots) {
      for (int j = 0; j < d; ++j) store_out(out, i, j, 0.f);
      continue;
    }
    dequantize_row(kv, slot, out, i);
  }
  return Status::Ok();
}

Status repack_pages(const RepackArgs& args) {
  const KVCache& src = args.src;
  const KVCache& dst = args.dst;
  const int64_t b = args.seqlens.shape[0];
  const int64_t max_src_pages = args.src_block_table.shape[1];
  const int64_t max_dst_pages = args.dst_block_table.shape[1];
  const int64_t capacity = std::min(max_src_pages * src.page_size, max_dst_pages * dst.page_size);
  // One work item per (request, dst page): items write disjoint pages unless the caller's
  // tables name one page twice.
#pragma omp parallel for collapse(2) schedule(dynamic, 4)
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t dp = 0; dp < max_dst_pages; ++dp) {
      const int64_t len = std::clamp<int64_t>(load_index(args.seqlens, i), 0, capacity);
      const int64_t begin = dp * dst.page_size;
      const int64_t end = std::min(begin + dst.page_size, len);
      if (begin >= end) continue;
      const int64_t dst_page = load_index2(args.dst_block_table, i, dp);
      if (dst_page < 0 || dst_page >= dst.num_pages) continue;
      for (int64_t t = begin; t < end;) {
        const int64_t sp = t / src.page_size;
        const int64_t src_t = t % src.page_size;
        const int64_t n = std::min(end - t, src.page_size - src_t);
        const int64_t src_page = load_index2(args.src_block_table, i, sp);
        if (src_page >= 0 && src_page < src.num_pages) {
          copy_run(src, src_page, src_t, dst, dst_page, t - begin, n);
        }
        t += n;
      }
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
