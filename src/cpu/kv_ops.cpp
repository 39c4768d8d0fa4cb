// CPU KV-cache tools: quantize-and-store, dequantize, page repack. Byte layouts and the
// quantization recipe follow spec section 2 through src/kv/format.h, so the bytes written here
// are identical to what the CUDA backend and the engines produce.
//
// quantize_store and dequantize work a row at a time through a stack buffer: the row loops are
// branch-free (src/cpu/kv_convert.h) so the compiler vectorizes them, once for the baseline ISA
// and once for AVX2, picked at run time. Rows are split evenly over the OpenMP threads; small
// calls stay on the calling thread.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "src/cpu/attention_common.h"
#include "src/cpu/cpu_backend.h"
#include "src/cpu/kv_convert.h"
#include "src/kv/format.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define SPARSE_MLA_KV_X86 1
#else
#define SPARSE_MLA_KV_X86 0
#endif

namespace sparse_mla::cpu {
namespace {

constexpr int kMaxDims = kDenseHeadDim;  // the widest row of any format (576)

// Below this many row elements a call runs on the calling thread: waking the team costs more
// than the work, and on a busy machine a descheduled worker can hold the join for a time slice.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;

int32_t load_index(const TensorView& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0]];
}

int32_t load_index2(const TensorView& t, int64_t i, int64_t j) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0] + j * t.strides[1]];
}

uint8_t* page_base(const KVCache& kv, int64_t page) {
  return static_cast<uint8_t*>(kv.data) + page * kv.page_stride;
}

// Splits rows [0, n) evenly over the threads (one contiguous range each); fn(begin, end).
template <typename Fn>
void for_row_ranges(int64_t n, int d, const Fn& fn) {
  const bool parallel = n * d >= kMinParallelElements && omp_get_max_threads() > 1;
#pragma omp parallel if (parallel)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t tid = omp_get_thread_num();
    fn(n * tid / nt, n * (tid + 1) / nt);
  }
}

// ---- quantize_store ----

// Row `row` of src as fp32 in x[0, d), and its rope part as bf16 bits: exact for bf16 sources,
// nearest even otherwise.
SPARSE_MLA_KV_INLINE void load_src_row(const TensorView& src, int64_t row, int d, int nope,
                                       float* x, uint16_t* rope) {
  const int64_t cs = src.strides[1];
  const int64_t off = row * src.strides[0];
  if (src.dtype == DType::kFloat32) {
    const float* p = static_cast<const float*>(src.data) + off;
    if (cs == 1) {
      std::memcpy(x, p, sizeof(float) * d);
    } else {
      for (int j = 0; j < d; ++j) x[j] = p[j * cs];
    }
    for (int j = 0; j < kRopeDims; ++j) rope[j] = kv::bf16_from_float(x[nope + j]);
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(src.data) + off;
  if (src.dtype == DType::kBFloat16) {
    if (cs == 1) {
      for (int j = 0; j < d; ++j) x[j] = fmt::bf16_to_float(p[j]);
      std::memcpy(rope, p + nope, sizeof(uint16_t) * kRopeDims);
    } else {
      for (int j = 0; j < d; ++j) x[j] = fmt::bf16_to_float(p[j * cs]);
      for (int j = 0; j < kRopeDims; ++j) rope[j] = p[(nope + j) * cs];
    }
    return;
  }
  for (int j = 0; j < d; ++j) x[j] = kv::fp16_to_float(p[j * cs]);  // kFloat16
  for (int j = 0; j < kRopeDims; ++j) rope[j] = kv::bf16_from_float(x[nope + j]);
}

// Quantizes one scale tile: returns the scale exponent and writes the e4m3 codes to dst.
template <int kCount>
SPARSE_MLA_KV_INLINE int quantize_tile(const float* x, uint8_t* dst) {
  // amax over the non-NaN |x| (a NaN must not poison the tile's scale): non-negative floats order
  // like their bits, so this is an integer max.
  uint32_t amax = 0;
  for (int j = 0; j < kCount; ++j) {
    const uint32_t a = fmt::float_bits(x[j]) & 0x7fffffffu;
    amax = std::max(amax, kv::select(a > 0x7f800000u, 0u, a));
  }
  const int e = fmt::scale_exponent(fmt::bits_float(amax));
  // x / 2^e == x * 2^-e exactly (same real value, one rounding); 2^-127 is a subnormal.
  const float inv = e == 127 ? fmt::bits_float(0x00400000u) : fmt::exp2i(-e);
  for (int j = 0; j < kCount; ++j) dst[j] = kv::e4m3_from_float(x[j] * inv);
  return e;
}

SPARSE_MLA_KV_INLINE void quantize_range(const QuantizeStoreArgs& args, int64_t begin,
                                         int64_t end) {
  const KVCache& kv = args.kv;
  const int64_t num_slots = kv.num_slots();
  const bool m1 = kv.format == KVFormat::kModel1;
  const int nope = m1 ? kModel1NopeDims : kV32NopeDims;
  alignas(64) float x[kMaxDims];
  alignas(64) uint16_t rope[kRopeDims];
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = load_index(args.slots, i);
    if (slot < 0 || slot >= num_slots) continue;  // -1 skips; out of range is never written
    const int64_t t = slot % kv.page_size;
    uint8_t* base = page_base(kv, slot / kv.page_size);
    load_src_row(args.src, i, nope + kRopeDims, nope, x, rope);
    if (m1) {
      uint8_t* data = base + fmt::model1_row_offset(t);
      uint8_t* scales = base + fmt::model1_scale_offset(kv.page_size, t);
      for (int tile = 0; tile < kModel1NopeDims / kModel1ScaleTile; ++tile) {
        const int e = quantize_tile<kModel1ScaleTile>(x + tile * kModel1ScaleTile,
                                                      data + tile * kModel1ScaleTile);
        scales[tile] = static_cast<uint8_t>(e + 127);
      }
      scales[kModel1ScaleBytes - 1] = 0;
      std::memcpy(data + kModel1NopeDims, rope, sizeof(rope));
    } else {
      uint8_t* data = base + t * kV32BytesPerToken;
      for (int tile = 0; tile < kV32NopeDims / kV32ScaleTile; ++tile) {
        const int e =
            quantize_tile<kV32ScaleTile>(x + tile * kV32ScaleTile, data + tile * kV32ScaleTile);
        const float scale = fmt::exp2i(e);
        std::memcpy(data + fmt::kV32ScaleOffset + 4 * tile, &scale, 4);
      }
      std::memcpy(data + fmt::kV32RopeOffset, rope, sizeof(rope));
    }
  }
}

// ---- dequantize ----

// e4m3 codes times the tile's scale. When both are NaN, which NaN a multiply returns depends on the
// operand order the compiler picks; the choice is made explicit here and keeps the bits of the
// earlier scalar code: a NaN MODEL1 scale wins (it is the one NaN 0x7fc00000), a NaN V32 code wins.
template <int kCount, bool kNanScaleWins>
SPARSE_MLA_KV_INLINE void dequantize_tile(const uint8_t* codes, float scale, float* y) {
  if (kNanScaleWins && scale != scale) {
    std::fill(y, y + kCount, scale);
    return;
  }
  for (int j = 0; j < kCount; ++j) {
    const float v = kv::e4m3_to_float(codes[j]);
    y[j] = fmt::bits_float(kv::select((codes[j] & 0x7fu) == 0x7fu, fmt::float_bits(v),
                                      fmt::float_bits(v * scale)));
  }
}

SPARSE_MLA_KV_INLINE void load_bf16_run(const uint8_t* src, int n, float* y) {
  uint16_t h[kMaxDims];
  std::memcpy(h, src, sizeof(uint16_t) * n);
  for (int j = 0; j < n; ++j) y[j] = fmt::bf16_to_float(h[j]);
}

// Token `slot` of the cache (head 0 for dense formats) as exact fp32 values in y[0, d_qk).
SPARSE_MLA_KV_INLINE void dequantize_token(const KVCache& kv, int64_t slot, float* y) {
  const int64_t t = slot % kv.page_size;
  const uint8_t* base = page_base(kv, slot / kv.page_size);
  switch (kv.format) {
    case KVFormat::kModel1: {
      const uint8_t* data = base + fmt::model1_row_offset(t);
      const uint8_t* scales = base + fmt::model1_scale_offset(kv.page_size, t);
      for (int tile = 0; tile < kModel1NopeDims / kModel1ScaleTile; ++tile) {
        dequantize_tile<kModel1ScaleTile, true>(data + tile * kModel1ScaleTile,
                                          fmt::ue8m0_to_float(scales[tile]),
                                          y + tile * kModel1ScaleTile);
      }
      load_bf16_run(data + kModel1NopeDims, kRopeDims, y + kModel1NopeDims);
      break;
    }
    case KVFormat::kV32: {
      const uint8_t* data = base + t * kV32BytesPerToken;
      float scales[kV32NopeDims / kV32ScaleTile];
      std::memcpy(scales, data + fmt::kV32ScaleOffset, sizeof(scales));
      for (int tile = 0; tile < kV32NopeDims / kV32ScaleTile; ++tile) {
        dequantize_tile<kV32ScaleTile, false>(data + tile * kV32ScaleTile, scales[tile],
                                       y + tile * kV32ScaleTile);
      }
      load_bf16_run(data + fmt::kV32RopeOffset, kRopeDims, y + kV32NopeDims);
      break;
    }
    case KVFormat::kBF16:
      // Head 0 of the token: heads follow each other inside the token's row.
      load_bf16_run(base + t * kv.bytes_per_token(), kDenseHeadDim, y);
      break;
    case KVFormat::kFP16: {
      uint16_t h[kDenseHeadDim];
      std::memcpy(h, base + t * kv.bytes_per_token(), sizeof(h));
      for (int j = 0; j < kDenseHeadDim; ++j) y[j] = kv::fp16_to_float(h[j]);
      break;
    }
  }
}

SPARSE_MLA_KV_INLINE void dequantize_range(const DequantizeArgs& args, int64_t begin,
                                           int64_t end) {
  const KVCache& kv = args.kv;
  const TensorView& out = args.out;
  const int64_t num_slots = kv.num_slots();
  const int d = kv_format_d_qk(kv.format);
  const int64_t cs = out.strides[1];
  alignas(64) float y[kMaxDims];
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = load_index(args.slots, i);
    if (slot < 0 || slot >= num_slots) {
      std::fill(y, y + d, 0.f);
    } else {
      dequantize_token(kv, slot, y);
    }
    if (out.dtype == DType::kFloat32) {
      float* o = static_cast<float*>(out.data) + i * out.strides[0];
      if (cs == 1) {
        std::memcpy(o, y, sizeof(float) * d);
      } else {
        for (int j = 0; j < d; ++j) o[j * cs] = y[j];
      }
    } else {
      uint16_t* o = static_cast<uint16_t*>(out.data) + i * out.strides[0];
      if (cs == 1) {
        for (int j = 0; j < d; ++j) o[j] = kv::bf16_from_float(y[j]);
      } else {
        for (int j = 0; j < d; ++j) o[j * cs] = kv::bf16_from_float(y[j]);
      }
    }
  }
}

// ---- ISA variants of the row loops ----

using QuantizeFn = void (*)(const QuantizeStoreArgs&, int64_t, int64_t);
using DequantizeFn = void (*)(const DequantizeArgs&, int64_t, int64_t);

struct RowKernels {
  QuantizeFn quantize;
  DequantizeFn dequantize;
};

void quantize_generic(const QuantizeStoreArgs& a, int64_t b, int64_t e) { quantize_range(a, b, e); }
void dequantize_generic(const DequantizeArgs& a, int64_t b, int64_t e) { dequantize_range(a, b, e); }

#if SPARSE_MLA_KV_X86
__attribute__((target("avx2"))) void quantize_avx2(const QuantizeStoreArgs& a, int64_t b,
                                                   int64_t e) {
  quantize_range(a, b, e);
}
__attribute__((target("avx2"))) void dequantize_avx2(const DequantizeArgs& a, int64_t b,
                                                     int64_t e) {
  dequantize_range(a, b, e);
}
#endif

// Follows the attention kernels' choice, so SPARSE_MLA_CPU_ISA=generic selects the baseline
// loops here too.
const RowKernels& row_kernels() {
  static const RowKernels chosen = [] {
#if SPARSE_MLA_KV_X86
    if (std::strcmp(detail::kernels().name, "generic") != 0 && __builtin_cpu_supports("avx2")) {
      return RowKernels{quantize_avx2, dequantize_avx2};
    }
#endif
    return RowKernels{quantize_generic, dequantize_generic};
  }();
  return chosen;
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
  // Rows naming the same slot race (docs/errors.md): which one lands is unspecified.
  const QuantizeFn fn = row_kernels().quantize;
  for_row_ranges(args.src.shape[0], kv_format_d_qk(args.kv.format),
                 [&](int64_t begin, int64_t end) { fn(args, begin, end); });
  return Status::Ok();
}

Status dequantize(const DequantizeArgs& args) {
  const DequantizeFn fn = row_kernels().dequantize;
  for_row_ranges(args.slots.shape[0], kv_format_d_qk(args.kv.format),
                 [&](int64_t begin, int64_t end) { fn(args, begin, end); });
  return Status::Ok();
}
Status repack_pages(const RepackArgs& args) {
  const KVCache& src = args.src;
  const KVCache& dst = args.dst;
  const int64_t b = args.seqlens.shape[0];
  const int64_t max_src_pages = args.src_block_table.shape[1];
  const int64_t max_dst_pages = args.dst_block_table.shape[1];
  const int64_t capacity = std::min(max_src_pages * src.page_size, max_dst_pages * dst.page_size);
  auto length = [&](int64_t i) {
    return std::clamp<int64_t>(load_index(args.seqlens, i), 0, capacity);
  };
  auto dst_pages = [&](int64_t len) { return (len + dst.page_size - 1) / dst.page_size; };
  // dst page dp of request i: its tokens [dp * dst.page_size, ...) below len.
  auto copy_dst_page = [&](int64_t i, int64_t dp, int64_t len) {
    const int64_t dst_page = load_index2(args.dst_block_table, i, dp);
    if (dst_page < 0 || dst_page >= dst.num_pages) return;
    const int64_t begin = dp * dst.page_size;
    const int64_t end = std::min(begin + dst.page_size, len);
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
  };
  // Work items = (request, dst page) pairs below the request's length, numbered in request order;
  // each thread takes one contiguous range of them and walks the lengths to its start. So the
  // work is the tokens copied plus b length reads a thread, whatever the block tables' widths
  // (zero-stride tables may be 2^31 entries wide). Items write disjoint pages unless the
  // caller's tables name one page twice.
  int64_t items = 0;
#pragma omp parallel for reduction(+ : items)
  for (int64_t i = 0; i < b; ++i) items += dst_pages(length(i));
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t first = items / nt * tid + std::min(tid, items % nt);
    const int64_t last = first + items / nt + (tid < items % nt ? 1 : 0);
    int64_t item = 0;  // items of the requests before i
    for (int64_t i = 0; i < b && item < last; ++i) {
      const int64_t len = length(i), n = dst_pages(len);
      for (int64_t dp = std::max<int64_t>(first - item, 0); dp < n && item + dp < last; ++dp) {
        copy_dst_page(i, dp, len);
      }
      item += n;
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
