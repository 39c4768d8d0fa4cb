// Fuzz target "kv_ops": quantize_store, dequantize and repack_pages (on the CPU backend, or on
// another through a KvOpsRunner) with adversarial slots, block tables and lengths (-1, out of
// range, INT32_MIN/MAX, duplicates), raw cache bytes (NaN scales, NaN codes), NaN/inf/huge source
// values, odd page sizes and padded strides. Every call must succeed; the bytes it writes are
// checked against an independent model of the formats (fuzz/format_model.h), and every byte it was
// not asked to write must be unchanged.
// Buffers are exact-size heap blocks, so AddressSanitizer catches any access outside them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fuzz/format_model.h"
#include "fuzz/harness.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::fuzz {

// The three ops the target calls, on host buffers that they read and write in place: the CPU
// backend, or a GPU backend through device copies (tests/cpp/cuda/test_cuda_fuzz.cpp).
struct KvOpsRunner {
  std::function<Status(const QuantizeStoreArgs&)> quantize_store;
  std::function<Status(const DequantizeArgs&)> dequantize;
  std::function<Status(const RepackArgs&)> repack;
};

inline KvOpsRunner cpu_kv_runner() {
  const Options o{Backend::kCPU, nullptr};
  return {[o](const QuantizeStoreArgs& a) { return quantize_store(a, o); },
          [o](const DequantizeArgs& a) { return dequantize(a, o); },
          [o](const RepackArgs& a) { return repack_pages(a, o); }};
}

namespace kv_detail {

// A cache over one exact-size block (exact_cache_bytes).
struct Cache {
  KVCache kv;
  uint8_t* bytes = nullptr;
  size_t size = 0;
};

inline int64_t token_bytes(const KVCache& kv) { return kv.bytes_per_token(); }

inline Cache make_cache(Input& in, Arena& arena, KVFormat format, int64_t num_heads) {
  Cache c;
  c.kv.format = format;
  c.kv.num_heads = num_heads;
  c.kv.page_size = in.pick<int64_t>({1, 2, 3, 5, 7, 16, 53, 61, 64, 69});
  c.kv.num_pages = in.range(0, 5);
  const int64_t min_stride = (c.kv.page_size * c.kv.bytes_per_token() + 15) / 16 * 16;
  c.kv.page_stride = min_stride + 16 * in.range(0, 2);
  c.size = exact_cache_bytes(c.kv);
  c.bytes = arena.alloc(c.size);
  c.kv.data = c.bytes;
  Gen gen(in.u64());
  gen.fill(c.bytes, c.size);
  if (in.u8() % 4 == 0) std::memset(c.bytes, 0xff, c.size);  // NaN codes and NaN scales
  return c;
}

// The byte ranges (offset from the cache start, length) of one token: all heads; for MODEL1 the
// 576-byte row and the 8-byte footer entry. Written from docs/formats.md.
inline std::vector<std::pair<int64_t, int64_t>> token_spans(const KVCache& kv, int64_t slot) {
  const int64_t page = slot / kv.page_size, t = slot % kv.page_size;
  const int64_t base = page * kv.page_stride;
  if (kv.format == KVFormat::kModel1) {
    return {{base + t * 576, 576}, {base + kv.page_size * 576 + t * 8, 8}};
  }
  return {{base + t * token_bytes(kv), token_bytes(kv)}};
}

inline std::vector<uint8_t> token_image(const Cache& c, int64_t slot) {
  std::vector<uint8_t> out;
  for (auto [off, len] : token_spans(c.kv, slot)) {
    out.insert(out.end(), c.bytes + off, c.bytes + off + len);
  }
  return out;
}

// Adversarial int32 values for a table of `bound` valid entries.
inline int32_t adversarial_index(Input& in, int64_t bound) {
  switch (in.u8() % 10) {
    case 0:
      return -1;
    case 1:
      return static_cast<int32_t>(bound);
    case 2:
      return static_cast<int32_t>(bound - 1);
    case 3:
      return in.pick<int32_t>({INT32_MIN, INT32_MAX, -2, INT32_MIN + 1});
    case 4:
      return static_cast<int32_t>(in.u32());
    default:
      return bound > 0 ? static_cast<int32_t>(in.u32() % bound) : -1;
  }
}

inline float adversarial_value(Input& in, Gen& gen, int exponent) {
  switch (in.u8() % 16) {
    case 0:
      return NAN;
    case 1:
      return in.coin() ? INFINITY : -INFINITY;
    case 2:
      return in.f32();
    case 3:
      return 0.f;
    default: {
      const float u = static_cast<float>(static_cast<int32_t>(gen.u32())) * 0x1p-31f;
      return std::ldexp(u, exponent);
    }
  }
}

// ---- quantize_store ----

// Checks one stored token against the spec's recipe applied to `row` (d_qk source values as
// floats, `bf16` their bf16 bits when the source is bf16). `token` is token_image().
inline bool quantized_ok(KVFormat format, const std::vector<float>& row, const uint16_t* bf16,
                         const std::vector<uint8_t>& token, std::string* why) {
  const bool m1 = format == KVFormat::kModel1;
  const int nope = m1 ? 448 : 512, tile = m1 ? 64 : 128;
  for (int t0 = 0; t0 < nope; t0 += tile) {
    float amax = 0.f;
    for (int j = t0; j < t0 + tile; ++j) {
      if (!std::isnan(row[j])) amax = std::max(amax, std::fabs(row[j]));
    }
    const int e = model::scale_exponent(amax);
    if (m1) {
      if (token[576 + t0 / 64] != e + 127) {
        *why = "MODEL1 scale byte of tile " + num(t0 / 64) + " is " + num(token[576 + t0 / 64]) +
               ", expected " + num(e + 127);
        return false;
      }
    } else {
      float scale;
      std::memcpy(&scale, &token[512 + 4 * (t0 / 128)], 4);
      if (static_cast<double>(scale) != std::ldexp(1.0, e)) {
        *why = "V32 scale of tile " + num(t0 / 128) + " is not 2^" + num(e);
        return false;
      }
    }
    for (int j = t0; j < t0 + tile; ++j) {
      const uint8_t want = model::e4m3_encode(static_cast<double>(row[j]) / std::ldexp(1.0, e));
      if (token[j] != want) {
        *why = "e4m3 code of dim " + num(j) + " is " + num(token[j]) + ", expected " + num(want);
        return false;
      }
    }
  }
  if (m1 && token[583] != 0) {
    *why = "MODEL1 footer byte 7 is " + num(token[583]) + ", expected 0";
    return false;
  }
  const int rope_at = m1 ? 448 : 528;
  for (int j = 0; j < 64; ++j) {
    uint16_t got;
    std::memcpy(&got, &token[rope_at + 2 * j], 2);
    const bool ok = bf16 ? got == bf16[nope + j] : model::bf16_encode_ok(row[nope + j], got);
    if (!ok) {
      *why = "rope dim " + num(j) + " is bf16 " + num(got);
      return false;
    }
  }
  return true;
}

inline void run_quantize_store(Input& in, Arena& arena, Cache& c, Findings& f,
                               const KvOpsRunner& run) {
  const int d = kv_format_d_qk(c.kv.format);
  const int64_t n = in.range(0, 12);
  const bool bf16 = in.coin();
  const int64_t row_stride = d + in.range(0, 3) * 8;
  const size_t elem = bf16 ? 2 : 4;
  const size_t src_bytes = n == 0 ? 0 : static_cast<size_t>((n - 1) * row_stride + d) * elem;
  uint8_t* src = arena.alloc(src_bytes);
  std::vector<std::vector<float>> rows(n, std::vector<float>(d));
  std::vector<std::vector<uint16_t>> rows_bf16(n, std::vector<uint16_t>(d));
  Gen gen(in.u64());
  for (int64_t i = 0; i < n; ++i) {
    const int exponent = static_cast<int>(in.range(-140, 130));
    for (int j = 0; j < d; ++j) {
      float v = adversarial_value(in, gen, exponent);
      if (bf16) {
        const uint16_t h = static_cast<uint16_t>(model::bits(v) >> 16);
        v = model::as_float(static_cast<uint32_t>(h) << 16);
        rows_bf16[i][j] = h;
        std::memcpy(src + (i * row_stride + j) * 2, &h, 2);
      } else {
        std::memcpy(src + (i * row_stride + j) * 4, &v, 4);
      }
      rows[i][j] = v;
    }
  }
  const int64_t num_slots = c.kv.num_slots();
  uint8_t* slot_buf = arena.alloc(static_cast<size_t>(n) * 4);
  std::vector<int32_t> slots(n);
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = adversarial_index(in, num_slots);
    std::memcpy(slot_buf + 4 * i, &slots[i], 4);
  }
  QuantizeStoreArgs a;
  a.src = TensorView::strided(src, bf16 ? DType::kBFloat16 : DType::kFloat32, Device{}, {n, d},
                              {row_stride, 1});
  a.slots = TensorView::contiguous(slot_buf, DType::kInt32, Device{}, {n});
  a.kv = c.kv;
  const std::vector<uint8_t> before(c.bytes, c.bytes + c.size);
  const std::vector<uint8_t> src_before(src, src + src_bytes);
  const Status s = run.quantize_store(a);
  if (!s.ok()) return f.fail("quantize_store rejected a valid request: " + s.to_string());
  if (!same_bytes(src_before.data(), src, src_bytes)) f.fail("quantize_store wrote src");

  std::map<int64_t, std::vector<int64_t>> writers;  // slot -> rows that target it
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0 && slots[i] < num_slots) writers[slots[i]].push_back(i);
  }
  std::vector<uint8_t> written(c.size, 0);
  for (const auto& [slot, rows_at] : writers) {
    for (auto [off, len] : token_spans(c.kv, slot)) {
      std::fill(written.begin() + off, written.begin() + off + len, 1);
    }
    // Rows that name the same slot race (unspecified which wins): only a single writer's
    // bytes are checked.
    if (rows_at.size() != 1) continue;
    std::string why;
    const int64_t i = rows_at[0];
    if (!quantized_ok(c.kv.format, rows[i], bf16 ? rows_bf16[i].data() : nullptr,
                      token_image(c, slot), &why)) {
      return f.fail("quantize_store row " + num(i) + " -> slot " + num(slot) + ": " + why);
    }
  }
  for (size_t b = 0; b < c.size; ++b) {
    if (!written[b] && c.bytes[b] != before[b]) {
      return f.fail("quantize_store changed cache byte " + num(static_cast<int64_t>(b)) +
                    " that no valid slot covers");
    }
  }
}

// ---- dequantize ----

// The value of dim j of a stored token, from its bytes (head 0 for dense formats).
inline double stored_value(const KVCache& kv, const std::vector<uint8_t>& token, int j) {
  auto bf16_at = [&](int off) {
    uint16_t h;
    std::memcpy(&h, &token[off], 2);
    return model::bf16_value(h);
  };
  switch (kv.format) {
    case KVFormat::kModel1:
      if (j < 448) {
        return static_cast<float>(model::e4m3_value(token[j]) *
                                  model::ue8m0_value(token[576 + j / 64]));
      }
      return bf16_at(448 + 2 * (j - 448));
    case KVFormat::kV32:
      if (j < 512) {
        float scale;
        std::memcpy(&scale, &token[512 + 4 * (j / 128)], 4);
        return static_cast<float>(model::e4m3_value(token[j]) * scale);
      }
      return bf16_at(528 + 2 * (j - 512));
    case KVFormat::kBF16:
      return bf16_at(2 * j);
    case KVFormat::kFP16: {
      uint16_t h;
      std::memcpy(&h, &token[2 * j], 2);
      return model::fp16_value(h);
    }
  }
  return 0;
}

inline void run_dequantize(Input& in, Arena& arena, Cache& c, Findings& f,
                           const KvOpsRunner& run) {
  const int d = kv_format_d_qk(c.kv.format);
  const int64_t n = in.range(0, 12);
  const bool f32 = in.coin();
  const int64_t row_stride = d + in.range(0, 2) * 8;
  const size_t elem = f32 ? 4 : 2;
  const size_t out_bytes = n == 0 ? 0 : static_cast<size_t>((n - 1) * row_stride + d) * elem;
  uint8_t* out = arena.alloc(out_bytes);
  std::memset(out, 0xa5, out_bytes);
  const int64_t num_slots = c.kv.num_slots();
  uint8_t* slot_buf = arena.alloc(static_cast<size_t>(n) * 4);
  std::vector<int32_t> slots(n);
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = adversarial_index(in, num_slots);
    std::memcpy(slot_buf + 4 * i, &slots[i], 4);
  }
  DequantizeArgs a;
  a.kv = c.kv;
  a.slots = TensorView::contiguous(slot_buf, DType::kInt32, Device{}, {n});
  a.out = TensorView::strided(out, f32 ? DType::kFloat32 : DType::kBFloat16, Device{}, {n, d},
                              {row_stride, 1});
  const std::vector<uint8_t> before(c.bytes, c.bytes + c.size);
  const Status s = run.dequantize(a);
  if (!s.ok()) return f.fail("dequantize rejected a valid request: " + s.to_string());
  if (!same_bytes(before.data(), c.bytes, c.size)) return f.fail("dequantize wrote the cache");
  for (int64_t i = 0; i < n; ++i) {
    const bool valid = slots[i] >= 0 && slots[i] < num_slots;
    const std::vector<uint8_t> token = valid ? token_image(c, slots[i]) : std::vector<uint8_t>{};
    for (int j = 0; j < d; ++j) {
      const double want = valid ? stored_value(c.kv, token, j) : 0.0;
      const uint8_t* at = out + (i * row_stride + j) * elem;
      bool ok;
      double got_value;
      if (f32) {
        float got;
        std::memcpy(&got, at, 4);
        got_value = got;
        ok = model::same_value(got, want) && (valid || model::bits(got) == 0);
      } else {
        uint16_t got;
        std::memcpy(&got, at, 2);
        got_value = model::bf16_value(got);
        ok = valid ? model::bf16_encode_ok(static_cast<float>(want), got, false) : got == 0;
      }
      if (!ok) {
        return f.fail(std::string("dequantize ") + kv_format_name(c.kv.format) + " row " + num(i) +
                      " (slot " + num(slots[i]) + ") dim " + num(j) + ": got " +
                      std::to_string(got_value) + ", model " + std::to_string(want) +
                      (f32 ? " (float32 out)" : " (bf16 out)"));
      }
    }
    for (int64_t j = d; j < row_stride && i + 1 < n; ++j) {
      for (size_t k = 0; k < elem; ++k) {
        if (out[(i * row_stride + j) * elem + k] != 0xa5) {
          return f.fail("dequantize wrote the padding after row " + num(i));
        }
      }
    }
  }
}

// ---- repack_pages ----

inline void run_repack(Input& in, Arena& arena, Cache& src, Findings& f,
                       const KvOpsRunner& run) {
  // In-place use (dst aliases src) is covered by its own regression test; here pools differ.
  Cache dst = make_cache(in, arena, src.kv.format, src.kv.num_heads);
  const int64_t b = in.range(0, 4);
  const int64_t max_src = in.range(0, 4), max_dst = in.range(0, 4);
  auto table = [&](int64_t cols, int64_t bound, std::vector<int32_t>* values) {
    uint8_t* buf = arena.alloc(static_cast<size_t>(b * cols) * 4);
    values->resize(b * cols);
    for (int64_t k = 0; k < b * cols; ++k) {
      (*values)[k] = adversarial_index(in, bound);
      std::memcpy(buf + 4 * k, &(*values)[k], 4);
    }
    return buf;
  };
  std::vector<int32_t> sbt, dbt, lens;
  uint8_t* sbt_buf = table(max_src, src.kv.num_pages, &sbt);
  uint8_t* dbt_buf = table(max_dst, dst.kv.num_pages, &dbt);
  uint8_t* len_buf = arena.alloc(static_cast<size_t>(b) * 4);
  lens.resize(b);
  const int64_t capacity = std::min(max_src * src.kv.page_size, max_dst * dst.kv.page_size);
  for (int64_t i = 0; i < b; ++i) {
    lens[i] = in.coin() ? static_cast<int32_t>(in.range(-2, capacity + 2))
                        : adversarial_index(in, capacity + 1);
    std::memcpy(len_buf + 4 * i, &lens[i], 4);
  }
  RepackArgs a;
  a.src = src.kv;
  a.dst = dst.kv;
  a.src_block_table = TensorView::contiguous(sbt_buf, DType::kInt32, Device{}, {b, max_src});
  a.dst_block_table = TensorView::contiguous(dbt_buf, DType::kInt32, Device{}, {b, max_dst});
  a.seqlens = TensorView::contiguous(len_buf, DType::kInt32, Device{}, {b});
  const std::vector<uint8_t> src_before(src.bytes, src.bytes + src.size);
  const std::vector<uint8_t> dst_before(dst.bytes, dst.bytes + dst.size);
  const Status s = run.repack(a);
  if (!s.ok()) return f.fail("repack_pages rejected a valid request: " + s.to_string());
  if (!same_bytes(src_before.data(), src.bytes, src.size)) {
    return f.fail("repack_pages wrote the source pool");
  }
  // dst slot -> the src slots copied there (several when the tables name a dst page twice).
  std::map<int64_t, std::vector<int64_t>> sources;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = std::clamp<int64_t>(lens[i], 0, capacity);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t sp = sbt[i * max_src + t / src.kv.page_size];
      const int64_t dp = dbt[i * max_dst + t / dst.kv.page_size];
      if (sp < 0 || sp >= src.kv.num_pages || dp < 0 || dp >= dst.kv.num_pages) continue;
      sources[dp * dst.kv.page_size + t % dst.kv.page_size].push_back(sp * src.kv.page_size +
                                                                      t % src.kv.page_size);
    }
  }
  std::vector<uint8_t> written(dst.size, 0);
  for (const auto& [dslot, from] : sources) {
    const std::vector<uint8_t> got = token_image(dst, dslot);
    bool any = false;
    for (int64_t sslot : from) {
      std::vector<uint8_t> want;
      for (auto [off, len] : token_spans(src.kv, sslot)) {
        want.insert(want.end(), src_before.begin() + off, src_before.begin() + off + len);
      }
      any |= want == got;
    }
    // Several sources for one dst token race; a mix of their bytes is accepted only then.
    if (!any && from.size() == 1) {
      return f.fail("repack_pages: dst slot " + num(dslot) + " does not hold src slot " +
                    num(from[0]));
    }
    for (auto [off, len] : token_spans(dst.kv, dslot)) {
      std::fill(written.begin() + off, written.begin() + off + len, 1);
    }
  }
  for (size_t k = 0; k < dst.size; ++k) {
    if (!written[k] && dst.bytes[k] != dst_before[k]) {
      return f.fail("repack_pages changed dst byte " + num(static_cast<int64_t>(k)) +
                    " outside the tokens it was asked to copy");
    }
  }
}

}  // namespace kv_detail

inline std::string fuzz_kv_ops_on(const uint8_t* data, size_t size, const KvOpsRunner& run) {
  using namespace kv_detail;
  Input in(data, size);
  Arena arena;
  Findings f;
  const KVFormat format =
      in.pick<KVFormat>({KVFormat::kModel1, KVFormat::kV32, KVFormat::kBF16, KVFormat::kFP16});
  const int64_t heads = kv_format_is_fp8(format) ? 1 : in.range(1, 3);
  Cache cache = make_cache(in, arena, format, heads);
  if (kv_format_is_fp8(format)) run_quantize_store(in, arena, cache, f, run);
  if (!f.any()) run_dequantize(in, arena, cache, f, run);
  if (!f.any()) run_repack(in, arena, cache, f, run);
  return f.first;
}

inline std::string fuzz_kv_ops(const uint8_t* data, size_t size) {
  return fuzz_kv_ops_on(data, size, cpu_kv_runner());
}

}  // namespace sparse_mla::fuzz
