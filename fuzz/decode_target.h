// Fuzz target "decode": small sparse decode, dense decode and merge on the CPU backend with
// adversarial indices, lengths and block tables (-1, out of range, INT32_MIN/MAX, duplicates,
// negative or oversized lengths), NaN/inf queries, sinks and cache bytes, odd page sizes, padded
// strides. Each request runs twice:
//   run A: unreferenced cache bytes random, outputs poisoned with 0xa5;
//   run B: unreferenced cache bytes rewritten (NaN or other noise), index and block-table entries
//          past the lengths rewritten (pointing anywhere, valid slots included), outputs 0x5a.
// Both runs must succeed with bitwise-identical outputs: that catches unwritten outputs, reads of
// data the request does not reference (another request's tokens, entries past topk_length, the
// unused footer byte) and nondeterminism. Rows without a visible token must give out 0 and
// lse +inf. In "moderate" mode (finite values of the spec's distribution) run A is also compared
// with the fp64 reference under the spec's tolerances. Exact-size blocks let AddressSanitizer see
// every read past a buffer.
//
// The operations run through a DecodeRunner: the CPU backend for the fuzzer and the CPU tests;
// tests/cpp/cuda/test_cuda_fuzz.cpp mirrors every buffer onto the GPU (exact sizes again, for
// compute-sanitizer) and runs a CUDA backend on wider shapes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/format_model.h"
#include "fuzz/harness.h"
#include "reference/compare.h"
#include "reference/reference.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::fuzz {

// Where the decode target runs its three operations. `wide` draws larger shapes (up to 128 query
// heads, lists of up to a few hundred tokens, more pages) so that a GPU backend reaches its
// Hopper kernel, lists cut into several parts and the combine; the checks stay the same. The
// draws without `wide` are the fuzzer's, so its corpus keeps its meaning.
struct DecodeRunner {
  std::function<Status(const SparseDecodeArgs&)> sparse;
  std::function<Status(const DenseDecodeArgs&)> dense;
  std::function<Status(const MergeArgs&)> merge;
  bool wide = false;
};

inline DecodeRunner cpu_runner() {
  const Options o{Backend::kCPU, nullptr};
  return {[o](const SparseDecodeArgs& a) { return sparse_decode(a, Workspace{}, o); },
          [o](const DenseDecodeArgs& a) { return dense_decode(a, Workspace{}, o); },
          [o](const MergeArgs& a) { return merge_attention(a, o); }, false};
}

namespace decode_detail {

// A host tensor over an exact-size block, with its logical elements enumerable.
struct Buf {
  TensorView view;
  uint8_t* bytes = nullptr;
  size_t size = 0;
  size_t elem = 0;

  // Calls fn(byte offset) for every logical element.
  void each(const std::function<void(int64_t)>& fn) const {
    int64_t idx[kMaxDims] = {};
    int64_t total = 1;
    for (int d = 0; d < view.ndim; ++d) total *= view.shape[d];
    for (int64_t e = 0; e < total; ++e) {
      int64_t off = 0;
      for (int d = 0; d < view.ndim; ++d) off += idx[d] * view.strides[d];
      fn(off * static_cast<int64_t>(elem));
      for (int d = view.ndim - 1; d >= 0; --d) {
        if (++idx[d] < view.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  template <typename T>
  T get(int64_t byte_off) const {
    T v;
    std::memcpy(&v, bytes + byte_off, sizeof(T));
    return v;
  }
  template <typename T>
  void set(int64_t byte_off, T v) {
    std::memcpy(bytes + byte_off, &v, sizeof(T));
  }
  int64_t offset(std::initializer_list<int64_t> index) const {
    int64_t off = 0, d = 0;
    for (int64_t i : index) off += i * view.strides[d++];
    return off * static_cast<int64_t>(elem);
  }
};

// Contiguous, outer-padded or outer-transposed layouts (last dim always contiguous).
inline Buf make_buf(Input& in, Arena& arena, DType dtype, std::vector<int64_t> shape,
                    bool allow_layouts = true) {
  Buf b;
  b.elem = elem_size(dtype);
  const int n = static_cast<int>(shape.size());
  const int layout = allow_layouts ? in.u8() % 4 : 0;
  const int64_t pad = layout == 1 ? in.pick<int64_t>({8, 16, 24}) : 0;
  std::vector<int64_t> strides(n, 1);
  if (layout == 2 && n >= 3) {
    int64_t acc = shape[n - 1] + 8;
    for (int d = 0; d < n - 1; ++d) {
      strides[d] = acc;
      acc *= std::max<int64_t>(shape[d], 1);
    }
  } else {
    int64_t acc = 1;
    for (int d = n - 1; d >= 0; --d) {
      strides[d] = acc;
      acc = acc * std::max<int64_t>(shape[d], 1) + (d == n - 1 ? pad : 0);
    }
  }
  b.view.dtype = dtype;
  b.view.ndim = n;
  for (int d = 0; d < n; ++d) {
    b.view.shape[d] = shape[d];
    b.view.strides[d] = strides[d];
  }
  const int64_t span = span_bytes(b.view, static_cast<int64_t>(b.elem));
  b.size = static_cast<size_t>(span);
  b.bytes = arena.alloc(b.size);
  b.view.data = b.bytes;
  std::memset(b.bytes, 0xee, b.size);
  return b;
}

struct Cache {
  KVCache kv;
  uint8_t* bytes = nullptr;
  size_t size = 0;
  std::vector<uint8_t> referenced;  // per byte: 1 when the request reads it
};

inline Cache make_cache(Input& in, Arena& arena, KVFormat format, int64_t heads, bool wide) {
  Cache c;
  c.kv.format = format;
  c.kv.num_heads = heads;
  c.kv.page_size = in.pick<int64_t>({1, 2, 3, 5, 16, 53, 64, 69});
  c.kv.num_pages = in.range(0, wide ? 12 : 4);
  const int64_t min_stride = (c.kv.page_size * c.kv.bytes_per_token() + 15) / 16 * 16;
  c.kv.page_stride = min_stride + 16 * in.range(0, 2);
  c.size = exact_cache_bytes(c.kv);
  c.bytes = arena.alloc(c.size);
  c.kv.data = c.bytes;
  c.referenced.assign(c.size, 0);
  return c;
}

// Marks the bytes of one slot the decode may read: all heads; MODEL1 row + footer bytes 0..6.
inline void reference_slot(Cache& c, int64_t slot) {
  const int64_t page = slot / c.kv.page_size, t = slot % c.kv.page_size;
  const int64_t base = page * c.kv.page_stride;
  auto mark = [&](int64_t off, int64_t len) {
    std::fill(c.referenced.begin() + off, c.referenced.begin() + off + len, 1);
  };
  if (c.kv.format == KVFormat::kModel1) {
    mark(base + t * 576, 576);
    mark(base + c.kv.page_size * 576 + t * 8, 7);
  } else {
    mark(base + t * c.kv.bytes_per_token(), c.kv.bytes_per_token());
  }
}

// Fills a referenced slot. Moderate: the spec's test distribution (N(0, 0.1^2) clipped to
// [-1, 1]) quantized with the recipe; otherwise raw bytes (any code, any scale, NaN included).
inline void fill_slot(Cache& c, int64_t slot, bool moderate, Gen& gen) {
  const int64_t page = slot / c.kv.page_size, t = slot % c.kv.page_size;
  uint8_t* base = c.bytes + page * c.kv.page_stride;
  if (!moderate) {
    if (c.kv.format == KVFormat::kModel1) {
      gen.fill(base + t * 576, 576);
      gen.fill(base + c.kv.page_size * 576 + t * 8, 8);
    } else {
      gen.fill(base + t * c.kv.bytes_per_token(), static_cast<size_t>(c.kv.bytes_per_token()));
    }
    return;
  }
  auto value = [&] {
    // Sum of 4 uniforms: roughly normal, then scaled to sigma 0.1 and clipped.
    double s = 0;
    for (int k = 0; k < 4; ++k) s += (gen.u32() * 0x1p-32) - 0.5;
    return std::clamp(s * 0.1 / std::sqrt(4.0 / 12.0), -1.0, 1.0);
  };
  auto bf16 = [](double v) {
    uint32_t u = model::bits(static_cast<float>(v));
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  };
  const int64_t heads = c.kv.num_heads;
  if (c.kv.format == KVFormat::kBF16 || c.kv.format == KVFormat::kFP16) {
    uint8_t* row = base + t * c.kv.bytes_per_token();
    for (int64_t k = 0; k < heads * 576; ++k) {
      const double v = value();
      const uint16_t h =
          c.kv.format == KVFormat::kBF16 ? bf16(v) : model::fp16_encode(static_cast<float>(v));
      std::memcpy(row + 2 * k, &h, 2);
    }
    return;
  }
  const bool m1 = c.kv.format == KVFormat::kModel1;
  const int nope = m1 ? 448 : 512, tile = m1 ? 64 : 128;
  uint8_t* row = base + t * (m1 ? 576 : 656);
  double vals[576];
  for (int j = 0; j < nope + 64; ++j) vals[j] = value();
  for (int t0 = 0; t0 < nope; t0 += tile) {
    float amax = 0;
    for (int j = t0; j < t0 + tile; ++j)
      amax = std::max(amax, static_cast<float>(std::fabs(vals[j])));
    const int e = model::scale_exponent(amax);
    for (int j = t0; j < t0 + tile; ++j) row[j] = model::e4m3_encode(vals[j] / std::ldexp(1.0, e));
    if (m1) {
      base[c.kv.page_size * 576 + t * 8 + t0 / 64] = static_cast<uint8_t>(e + 127);
    } else {
      const float s = static_cast<float>(std::ldexp(1.0, e));
      std::memcpy(row + 512 + 4 * (t0 / 128), &s, 4);
    }
  }
  for (int j = 0; j < 64; ++j) {
    const uint16_t h = bf16(vals[nope + j]);
    std::memcpy(row + (m1 ? 448 : 528) + 2 * j, &h, 2);
  }
}

// Rewrites every byte the request does not reference.
inline void scramble_unreferenced(Cache& c, Gen& gen, bool nan) {
  for (size_t k = 0; k < c.size; ++k) {
    if (!c.referenced[k]) c.bytes[k] = nan ? 0xff : static_cast<uint8_t>(gen.u32());
  }
}

inline int32_t adversarial_index(Input& in, int64_t bound) {
  switch (in.u8() % 12) {
    case 0:
    case 1:
      return -1;
    case 2:
      return static_cast<int32_t>(bound);
    case 3:
      return in.pick<int32_t>({INT32_MIN, INT32_MAX, -2, INT32_MIN + 1});
    case 4:
      return static_cast<int32_t>(in.u32());
    default:
      return bound > 0 ? static_cast<int32_t>(in.u32() % bound) : -1;
  }
}

inline int32_t adversarial_length(Input& in, int64_t count) {
  switch (in.u8() % 6) {
    case 0:
      return in.pick<int32_t>({INT32_MIN, INT32_MAX, -1, 0});
    case 1:
      return static_cast<int32_t>(count + in.range(1, 3));
    default:
      return static_cast<int32_t>(in.range(0, count));
  }
}

// Query-like values: moderate ones in [-1, 1], otherwise specials mixed in.
inline uint32_t value_bits(Input& in, Gen& gen, bool moderate) {
  const float u = static_cast<float>(static_cast<int32_t>(gen.u32())) * 0x1p-31f;
  if (moderate) return model::bits(u);
  switch (in.u8() % 10) {
    case 0:
      return model::bits(NAN);
    case 1:
      return model::bits(in.coin() ? INFINITY : -INFINITY);
    case 2:
      return model::bits(std::ldexp(u, static_cast<int>(in.range(-130, 127))));
    case 3:
      return in.u32();
    default:
      return model::bits(u);
  }
}

inline void fill_values(Buf& b, Input& in, Gen& gen, bool moderate) {
  b.each([&](int64_t off) {
    const uint32_t u = value_bits(in, gen, moderate);
    if (b.elem == 4) {
      b.set<uint32_t>(off, u);
    } else if (b.view.dtype == DType::kFloat16) {
      b.set<uint16_t>(off, model::fp16_encode(model::as_float(u)));
    } else {
      b.set<uint16_t>(off, static_cast<uint16_t>(u >> 16));
    }
  });
}

// Runs `op` twice as described at the top; `rescramble` prepares run B.
inline void twice(Findings& f, const char* what, std::vector<Buf*> outputs,
                  const std::function<Status()>& op, const std::function<void()>& rescramble,
                  std::vector<std::vector<uint8_t>>* result_a) {
  for (Buf* o : outputs) std::memset(o->bytes, 0xa5, o->size);
  const Status sa = op();
  if (!sa.ok()) return f.fail(std::string(what) + " rejected a valid request: " + sa.to_string());
  result_a->clear();
  for (Buf* o : outputs) result_a->emplace_back(o->bytes, o->bytes + o->size);
  rescramble();
  for (Buf* o : outputs) std::memset(o->bytes, 0x5a, o->size);
  const Status sb = op();
  if (!sb.ok()) return f.fail(std::string(what) + " run B failed: " + sb.to_string());
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Buf& o = *outputs[k];
    std::vector<uint8_t> logical(o.size, 0);
    o.each([&](int64_t off) {
      for (size_t e = 0; e < o.elem; ++e) logical[off + e] = 1;
    });
    for (size_t i = 0; i < o.size; ++i) {
      const uint8_t a = (*result_a)[k][i], bb = o.bytes[i];
      if (logical[i] && a != bb) {
        return f.fail(std::string(what) + ": output " + num(static_cast<int64_t>(k)) + " byte " +
                      num(static_cast<int64_t>(i)) +
                      " differs between runs (unwritten, nondeterministic, or it read data the "
                      "request does not reference)");
      }
      if (!logical[i] && (a != 0xa5 || bb != 0x5a)) {
        return f.fail(std::string(what) + ": wrote output padding byte " +
                      num(static_cast<int64_t>(i)));
      }
    }
  }
  // Leave run A's results in place for the checks that follow.
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k]->size) std::memcpy(outputs[k]->bytes, (*result_a)[k].data(), outputs[k]->size);
  }
}

inline float out_value(const Buf& out, int64_t off) {
  if (out.view.dtype == DType::kFloat32) return out.get<float>(off);
  const uint16_t h = out.get<uint16_t>(off);
  if (out.view.dtype == DType::kFloat16) return static_cast<float>(model::fp16_value(h));
  return static_cast<float>(model::bf16_value(h));
}

// Rows with nothing to attend: out exactly 0, lse +inf.
inline void check_empty_row(Findings& f, const char* what, const Buf& out, const Buf& lse,
                            int64_t i, int64_t s, int64_t h) {
  for (int64_t d = 0; d < out.view.shape[3]; ++d) {
    if (out_value(out, out.offset({i, s, h, d})) != 0.f) {
      return f.fail(std::string(what) + ": row (" + num(i) + ", " + num(s) + ", " + num(h) +
                    ") has no token but out is not 0");
    }
  }
  const float l = lse.get<float>(lse.offset({i, h, s}));
  if (!(std::isinf(l) && l > 0)) {
    f.fail(std::string(what) + ": row (" + num(i) + ", " + num(s) + ", " + num(h) +
           ") has no token but lse is not +inf");
  }
}

inline void compare_reference(Findings& f, const char* what, const Buf& out, const Buf& lse,
                              const ref::RefOutput& r, ref::Tolerance tol) {
  // The cosine bound is statistical: over a handful of elements, correct bf16 rounding alone
  // (relative error up to 2^-8) reaches (2^-8)^2 / 2 = 7.6e-6. Small outputs get that bound
  // plus margin; the per-element bounds stay as in the spec.
  int64_t elements = 1;
  for (int d = 0; d < out.view.ndim; ++d) elements *= out.view.shape[d];
  if (elements < 4096) tol.cos_diff = std::max(tol.cos_diff, 1e-5);
  const ref::CompareResult c = ref::compare_outputs(out.view, lse.view, r, tol);
  if (!c.ok) f.fail(std::string(what) + " vs the fp64 reference: " + c.summary());
}

inline std::optional<float> decode_scale(Input& in, int d_qk) {
  switch (in.u8() % 6) {
    case 0:
      return std::nullopt;
    case 1:
      return static_cast<float>(std::pow(d_qk, -0.55));
    case 2:
      return 1e-3f;
    case 3:
      return 0.5f;
    default:
      return static_cast<float>(std::pow(d_qk, -0.5));
  }
}

// ---- sparse decode ----

inline void sparse(Input& in, Arena& arena, Findings& f, bool moderate, const DecodeRunner& run) {
  Gen gen(in.u64());
  const KVFormat format = in.coin() ? KVFormat::kModel1 : KVFormat::kV32;
  const int d_qk = format == KVFormat::kModel1 ? 512 : 576;
  const bool wide = run.wide;
  const int64_t b = in.range(0, 3), s_q = in.range(1, 2);
  const int64_t h_q = wide ? in.pick<int64_t>({1, 5, 16, 31, 64, 100, 128}) : in.range(1, 6);
  // Long lists only where the fp64 reference of a moderate input stays quick.
  const bool long_lists = wide && in.coin();
  const int64_t topk = long_lists ? in.range(25, h_q >= 64 ? 96 : 320) : in.range(1, 24);
  Cache kv = make_cache(in, arena, format, 1, wide);
  const bool use_extra = in.u8() % 3 == 0;
  Cache extra = use_extra ? make_cache(in, arena, format, 1, wide) : Cache{};
  const int64_t extra_topk =
      !use_extra ? 0 : (long_lists ? in.range(13, h_q >= 64 ? 48 : 160) : in.range(1, 12));

  Buf q = make_buf(in, arena, DType::kBFloat16, {b, s_q, h_q, d_qk});
  fill_values(q, in, gen, moderate);
  Buf idx = make_buf(in, arena, DType::kInt32, {b, s_q, topk});
  idx.each([&](int64_t off) { idx.set<int32_t>(off, adversarial_index(in, kv.kv.num_slots())); });
  std::optional<Buf> len, eidx, elen, sink;
  if (in.coin()) {
    len = make_buf(in, arena, DType::kInt32, {b});
    len->each([&](int64_t off) { len->set<int32_t>(off, adversarial_length(in, topk)); });
  }
  if (use_extra) {
    eidx = make_buf(in, arena, DType::kInt32, {b, s_q, extra_topk});
    eidx->each(
        [&](int64_t off) { eidx->set<int32_t>(off, adversarial_index(in, extra.kv.num_slots())); });
    if (in.coin()) {
      elen = make_buf(in, arena, DType::kInt32, {b});
      elen->each([&](int64_t off) { elen->set<int32_t>(off, adversarial_length(in, extra_topk)); });
    }
  }
  if (in.coin()) {
    sink = make_buf(in, arena, DType::kFloat32, {h_q});
    sink->each([&](int64_t off) {
      float v;
      switch (in.u8() % 6) {
        case 0:
          v = -INFINITY;
          break;
        case 1:
          v = INFINITY;
          break;
        case 2:
          v = moderate ? 0.f : NAN;
          break;
        default:
          v = static_cast<float>(static_cast<int32_t>(gen.u32())) * 0x1p-29f;
      }
      sink->set<float>(off, v);
    });
  }
  Buf out = make_buf(in, arena, DType::kBFloat16, {b, s_q, h_q, 512});
  Buf lse;
  if (in.coin()) {  // FlashMLA's sparse layout: a [b, h_q, s_q] view of a [b, s_q, h_q] buffer
    lse = make_buf(in, arena, DType::kFloat32, {b, s_q, h_q}, false);
    std::swap(lse.view.shape[1], lse.view.shape[2]);
    std::swap(lse.view.strides[1], lse.view.strides[2]);
  } else {
    lse = make_buf(in, arena, DType::kFloat32, {b, h_q, s_q});
  }

  // Which entries count, which slots they reference; fill those, scramble the rest.
  auto length_of = [&](const std::optional<Buf>& l, int64_t i, int64_t count) -> int64_t {
    if (!l) return count;
    return std::clamp<int64_t>(l->get<int32_t>(l->offset({i})), 0, count);
  };
  std::vector<bool> row_has_token(b * s_q, false);
  auto mark = [&](Cache& c, const Buf& ix, const std::optional<Buf>& l, int64_t count) {
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t s = 0; s < s_q; ++s) {
        for (int64_t j = 0; j < length_of(l, i, count); ++j) {
          const int64_t slot = ix.get<int32_t>(ix.offset({i, s, j}));
          if (slot < 0 || slot >= c.kv.num_slots()) continue;
          reference_slot(c, slot);
          row_has_token[i * s_q + s] = true;
        }
      }
    }
  };
  mark(kv, idx, len, topk);
  if (use_extra) mark(extra, *eidx, elen, extra_topk);
  for (Cache* c : {&kv, &extra}) {
    if (!c->bytes) continue;
    gen.fill(c->bytes, c->size);
    for (int64_t slot = 0; slot < c->kv.num_slots(); ++slot) {
      const int64_t page = slot / c->kv.page_size, t = slot % c->kv.page_size;
      const int64_t at =
          page * c->kv.page_stride + t * (c->kv.format == KVFormat::kModel1 ? 576 : 656);
      if (c->referenced[at]) fill_slot(*c, slot, moderate, gen);
    }
  }

  SparseDecodeArgs a;
  a.q = q.view;
  a.kv = kv.kv;
  a.indices = idx.view;
  if (len) a.topk_length = len->view;
  if (use_extra) {
    a.extra_kv = extra.kv;
    a.extra_indices = eidx->view;
    if (elen) a.extra_topk_length = elen->view;
  }
  if (sink) a.attn_sink = sink->view;
  a.softmax_scale = decode_scale(in, d_qk);
  a.out = out.view;
  a.lse = lse.view;
  const bool nan_noise = in.coin();
  auto rescramble = [&] {
    for (Cache* c : {&kv, &extra}) {
      if (c->bytes) scramble_unreferenced(*c, gen, nan_noise);
    }
    // Entries past the lengths may point anywhere, including at NaN-filled valid slots.
    auto past = [&](Buf& ix, const std::optional<Buf>& l, int64_t count, int64_t slots) {
      for (int64_t i = 0; i < b; ++i) {
        for (int64_t s = 0; s < s_q; ++s) {
          for (int64_t j = length_of(l, i, count); j < count; ++j) {
            ix.set<int32_t>(ix.offset({i, s, j}),
                            slots > 0 ? static_cast<int32_t>(gen.u32() % slots) : -1);
          }
        }
      }
    };
    past(idx, len, topk, kv.kv.num_slots());
    if (use_extra) past(*eidx, elen, extra_topk, extra.kv.num_slots());
  };
  std::vector<std::vector<uint8_t>> result;
  twice(
      f, "sparse_decode", {&out, &lse}, [&] { return run.sparse(a); }, rescramble, &result);
  if (f.any()) return;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      if (row_has_token[i * s_q + s]) continue;
      for (int64_t h = 0; h < h_q && !f.any(); ++h)
        check_empty_row(f, "sparse_decode", out, lse, i, s, h);
    }
  }
  if (moderate && !f.any()) {
    compare_reference(f, "sparse_decode", out, lse, ref::sparse_decode_reference(a),
                      ref::Tolerance::sparse());
  }
}

// ---- dense decode ----

inline void dense(Input& in, Arena& arena, Findings& f, bool moderate, const DecodeRunner& run) {
  Gen gen(in.u64());
  const KVFormat format =
      in.pick<KVFormat>({KVFormat::kBF16, KVFormat::kFP16, KVFormat::kModel1, KVFormat::kV32});
  const bool fp8 = format == KVFormat::kModel1 || format == KVFormat::kV32;
  const int64_t h_kv = fp8 ? 1 : in.range(1, 2);
  const bool wide = run.wide;
  const int64_t b = in.range(0, 3), s_q = in.range(1, 3);
  const int64_t h_q = h_kv * (wide ? in.pick<int64_t>({1, 3, 8, 16, 64}) : in.range(1, 3));
  const int d_qk = format == KVFormat::kModel1 ? 512 : 576;
  const DType qt = format == KVFormat::kFP16 ? DType::kFloat16 : DType::kBFloat16;
  Cache kv = make_cache(in, arena, format, h_kv, wide);
  const int64_t max_pages = in.range(0, wide && h_q < 32 ? 12 : 4);
  const int64_t capacity = max_pages * kv.kv.page_size;
  Buf q = make_buf(in, arena, qt, {b, s_q, h_q, d_qk});
  fill_values(q, in, gen, moderate);
  Buf table = make_buf(in, arena, DType::kInt32, {b, max_pages});
  table.each([&](int64_t off) { table.set<int32_t>(off, adversarial_index(in, kv.kv.num_pages)); });
  Buf seqlens = make_buf(in, arena, DType::kInt32, {b});
  seqlens.each([&](int64_t off) { seqlens.set<int32_t>(off, adversarial_length(in, capacity)); });
  const bool causal = in.coin();
  Buf out = make_buf(in, arena, qt, {b, s_q, h_q, 512});
  Buf lse = make_buf(in, arena, DType::kFloat32, {b, h_q, s_q});

  std::vector<int64_t> lens(b);
  std::vector<bool> row_has_token(b * s_q, false);
  for (int64_t i = 0; i < b; ++i) {
    lens[i] = std::clamp<int64_t>(seqlens.get<int32_t>(seqlens.offset({i})), 0, capacity);
    for (int64_t t = 0; t < lens[i]; ++t) {
      const int64_t page = table.get<int32_t>(table.offset({i, t / kv.kv.page_size}));
      if (page < 0 || page >= kv.kv.num_pages) continue;
      reference_slot(kv, page * kv.kv.page_size + t % kv.kv.page_size);
      for (int64_t s = 0; s < s_q; ++s) {
        if (!causal || t <= lens[i] - s_q + s) row_has_token[i * s_q + s] = true;
      }
    }
  }
  if (kv.bytes) {
    gen.fill(kv.bytes, kv.size);
    for (int64_t slot = 0; slot < kv.kv.num_slots(); ++slot) {
      const int64_t page = slot / kv.kv.page_size, t = slot % kv.kv.page_size;
      const int64_t at = page * kv.kv.page_stride +
                         t * (format == KVFormat::kModel1 ? 576 : kv.kv.bytes_per_token());
      if (kv.referenced[at]) fill_slot(kv, slot, moderate, gen);
    }
  }
  DenseDecodeArgs a;
  a.q = q.view;
  a.kv = kv.kv;
  a.block_table = table.view;
  a.cache_seqlens = seqlens.view;
  a.causal = causal;
  a.softmax_scale = decode_scale(in, d_qk);
  a.out = out.view;
  a.lse = lse.view;
  const bool nan_noise = in.coin();
  auto rescramble = [&] {
    if (kv.bytes) scramble_unreferenced(kv, gen, nan_noise);
    // Block-table entries past the pages a request uses may name any page.
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t p = (lens[i] + kv.kv.page_size - 1) / kv.kv.page_size; p < max_pages; ++p) {
        table.set<int32_t>(
            table.offset({i, p}),
            kv.kv.num_pages > 0 ? static_cast<int32_t>(gen.u32() % kv.kv.num_pages) : -1);
      }
    }
  };
  std::vector<std::vector<uint8_t>> result;
  twice(
      f, "dense_decode", {&out, &lse}, [&] { return run.dense(a); }, rescramble, &result);
  if (f.any()) return;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      if (row_has_token[i * s_q + s]) continue;
      for (int64_t h = 0; h < h_q && !f.any(); ++h)
        check_empty_row(f, "dense_decode", out, lse, i, s, h);
    }
  }
  if (moderate && !f.any()) {
    compare_reference(f, "dense_decode", out, lse, ref::dense_decode_reference(a),
                      ref::Tolerance::dense());
  }
}

// ---- merge ----

inline void merge(Input& in, Arena& arena, Findings& f, bool moderate, const DecodeRunner& run) {
  Gen gen(in.u64());
  const int64_t n = in.range(1, 4), b = in.range(0, 2), s_q = in.range(1, 2), h_q = in.range(1, 4);
  const int64_t d_v = in.pick<int64_t>({512, 1, 7, 64});
  Buf parts =
      make_buf(in, arena, in.coin() ? DType::kFloat32 : DType::kBFloat16, {n, b, s_q, h_q, d_v});
  fill_values(parts, in, gen, moderate);
  Buf lse_parts = make_buf(in, arena, DType::kFloat32, {n, b, s_q, h_q});
  lse_parts.each([&](int64_t off) {
    float v;
    switch (in.u8() % 8) {
      case 0:
        v = INFINITY;
        break;
      case 1:
        v = -INFINITY;
        break;
      case 2:
        v = moderate ? 1.f : NAN;
        break;
      case 3:
        v = moderate ? -3.f : in.pick<float>({1e30f, -1e30f, 88.f, -104.f});
        break;
      default:
        v = static_cast<float>(static_cast<int32_t>(gen.u32())) * 0x1p-28f;
    }
    lse_parts.set<float>(off, v);
  });
  std::optional<Buf> sink;
  if (in.coin()) {
    sink = make_buf(in, arena, DType::kFloat32, {h_q});
    sink->each([&](int64_t off) {
      sink->set<float>(off, in.pick<float>({-INFINITY, INFINITY, 0.f, 1.5f, -2.f}));
    });
  }
  Buf out = make_buf(in, arena, in.coin() ? DType::kFloat32 : DType::kBFloat16, {b, s_q, h_q, d_v});
  Buf lse = make_buf(in, arena, DType::kFloat32, {b, h_q, s_q});
  MergeArgs a;
  a.out_parts = parts.view;
  a.lse_parts = lse_parts.view;
  if (sink) a.attn_sink = sink->view;
  a.out = out.view;
  a.lse = lse.view;
  // Parts whose lse is +-inf are empty: their values may be anything (NaN here) in run B.
  auto rescramble = [&] {
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t i = 0; i < b; ++i) {
        for (int64_t s = 0; s < s_q; ++s) {
          for (int64_t h = 0; h < h_q; ++h) {
            if (!std::isinf(lse_parts.get<float>(lse_parts.offset({k, i, s, h})))) continue;
            for (int64_t d = 0; d < d_v; ++d) {
              const int64_t off = parts.offset({k, i, s, h, d});
              if (parts.elem == 4) {
                parts.set<float>(off, NAN);
              } else {
                parts.set<uint16_t>(off, 0x7fc0);
              }
            }
          }
        }
      }
    }
  };
  std::vector<std::vector<uint8_t>> result;
  twice(
      f, "merge_attention", {&out, &lse}, [&] { return run.merge(a); }, rescramble, &result);
  if (f.any()) return;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t h = 0; h < h_q && !f.any(); ++h) {
        bool any = false;
        for (int64_t k = 0; k < n; ++k) {
          any |= !std::isinf(lse_parts.get<float>(lse_parts.offset({k, i, s, h})));
        }
        if (!any) check_empty_row(f, "merge_attention", out, lse, i, s, h);
      }
    }
  }
  if (moderate && !f.any()) {
    compare_reference(f, "merge_attention", out, lse, ref::merge_reference(a),
                      ref::Tolerance::sparse());
  }
}

}  // namespace decode_detail

inline std::string fuzz_decode_on(const uint8_t* data, size_t size, const DecodeRunner& run) {
  using namespace decode_detail;
  Input in(data, size);
  Arena arena;
  Findings f;
  const uint8_t mode = in.u8();
  const bool moderate = (mode & 4) != 0;
  switch (mode % 4) {
    case 0:
    case 1:
      sparse(in, arena, f, moderate, run);
      break;
    case 2:
      dense(in, arena, f, moderate, run);
      break;
    case 3:
      merge(in, arena, f, moderate, run);
      break;
  }
  return f.first;
}

inline std::string fuzz_decode(const uint8_t* data, size_t size) {
  return fuzz_decode_on(data, size, cpu_runner());
}

}  // namespace sparse_mla::fuzz
