// Fuzz target "validation": arbitrary arguments for every public operation (ranks, shapes,
// strides, dtypes, devices, formats, page geometry, pointers, backends, enum values outside their
// range), each tensor an exact-size heap block filled with random bytes (outputs with a poison
// byte), run on the CPU backend.
//
// Properties checked:
// - The library's verdict agrees with an independent model of the contract (docs/errors.md):
//   every accepted request satisfies the model, and while extents and strides stay small the
//   model's verdict and the library's are the same.
// - Errors are InvalidArgument or Unsupported with a message "<argument>: <what>", and nothing is
//   written; the workspace/plan/supported queries agree with the operation itself.
// - An accepted request runs to OK without touching a byte outside its tensors (AddressSanitizer
//   sees the end of every block) and never writes an input.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/harness.h"
#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::fuzz {

namespace validation_detail {

#if SPARSE_MLA_WITH_CUDA
inline constexpr bool kCudaBuild = true;
#else
inline constexpr bool kCudaBuild = false;
#endif

inline constexpr int64_t kAnyExtent = -1;
inline constexpr size_t kMaxTensorBytes = size_t{1} << 20;
inline constexpr size_t kMaxCacheBytes = size_t{4} << 20;

constexpr DType kAllDTypes[] = {DType::kUInt8,    DType::kInt32,   DType::kFloat32,
                                DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3};

inline int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return INT64_MAX;
  return r;
}
inline int64_t sat_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return a < 0 ? INT64_MIN : INT64_MAX;
  return r;
}

// Slots of a cache, 0 when the geometry is not positive (no overflow on wild values).
inline int64_t slots_of(const KVCache& kv) {
  return kv.page_size > 0 && kv.num_pages > 0 ? sat_mul(kv.num_pages, kv.page_size) : 0;
}

// How the values of an int32 tensor are drawn.
struct IntFill {
  int64_t bound = 0;  // valid values are [0, bound)
};

// Builds one request from the input. Tracks whether it can be executed safely (every buffer
// real and small, work small, host device) and whether its numbers are small enough for the
// model to be exact.
class Builder {
 public:
  Builder(Input& in, Arena& arena) : in_(in), arena_(arena), gen_(in.u64()) {}

  Device device(Device main) {
    switch (in_.u8() % 40) {
      case 0:
        return Device{DeviceType::kCUDA, 0};
      case 1:
        return Device{DeviceType::kCPU, 1};
      case 2:
        return Device{static_cast<DeviceType>(in_.range(2, 255)), 0};
      case 3:
        return Device{DeviceType::kCUDA, static_cast<int>(in_.u32())};
      default:
        return main;
    }
  }

  int64_t extent(int64_t want) {
    switch (in_.u8() % 32) {
      case 28:
        return in_.range(0, 8);
      case 29:
        return want + (in_.coin() ? 1 : -1);
      case 30:
        return in_.pick<int64_t>({kMaxExtent, kMaxExtent + 1, int64_t{1} << 32, int64_t{1} << 40,
                                  INT64_MAX, -1, INT64_MIN, int64_t{1} << 62});
      case 31:
        return 0;
      default:
        return want;
    }
  }

  // A tensor argument: dims of `want` (kAnyExtent entries must be given concretely by the
  // caller), then perturbed by the input.
  TensorView tensor(const char* name, bool output, DType dtype, std::vector<int64_t> want,
                    Device dev, IntFill fill = {}) {
    TensorView t;
    const int want_rank = static_cast<int>(want.size());
    t.ndim = in_.u8() % 40 == 0 ? static_cast<int>(in_.range(-1, 64)) : want_rank;
    switch (in_.u8() % 40) {
      case 0:
        t.dtype = kAllDTypes[in_.u8() % 6];
        break;
      case 1:
        t.dtype = static_cast<DType>(in_.range(6, 255));
        break;
      default:
        t.dtype = dtype;
    }
    t.device = device(dev);
    const int dims = std::min(std::max(t.ndim, 0), kMaxDims);
    for (int d = 0; d < dims; ++d) t.shape[d] = d < want_rank ? extent(want[d]) : in_.range(0, 3);
    strides(t, dims);
    for (int d = 0; d < dims; ++d) {
      if (t.shape[d] > 4096 || t.shape[d] < 0 || t.strides[d] > (1 << 24) ||
          t.strides[d] < -(1 << 24)) {
        exact_ = false;
      }
    }
    place(t, name, output, fill);
    return t;
  }

  // A cache descriptor of `format` (perturbed), over one exact-size block.
  KVCache cache(KVFormat format, int64_t heads, Device dev) {
    KVCache c;
    c.device = device(dev);
    c.format = in_.u8() % 40 == 0 ? static_cast<KVFormat>(in_.range(0, 255)) : format;
    c.num_heads = in_.u8() % 40 == 0 ? in_.pick<int64_t>({0, -1, 2, 128, 129, INT64_MAX}) : heads;
    switch (in_.u8() % 24) {
      case 0:
        c.page_size = in_.pick<int64_t>({0, -1, kMaxExtent, kMaxExtent + 1, int64_t{1} << 40});
        break;
      default:
        c.page_size = in_.pick<int64_t>({1, 2, 3, 7, 53, 64, 69, 16});
    }
    switch (in_.u8() % 24) {
      case 0:
        c.num_pages = in_.pick<int64_t>({-1, kMaxExtent, kMaxExtent + 1, int64_t{1} << 40});
        break;
      default:
        c.num_pages = in_.range(0, 4);
    }
    const int64_t bpt = model_bytes_per_token(c.format, c.num_heads);
    const int64_t min_stride = sat_mul(c.page_size, bpt);
    const int64_t rounded = min_stride >= INT64_MAX - 16 ? INT64_MAX : (min_stride + 15) / 16 * 16;
    switch (in_.u8() % 24) {
      case 0:
        c.page_stride = min_stride;
        break;
      case 1:
        c.page_stride = sat_add(rounded, -16);
        break;
      case 2:
        c.page_stride = sat_add(rounded, 8);
        break;
      case 3:
        c.page_stride = in_.pick<int64_t>({0, -16, int64_t{1} << 40, INT64_MAX / 2});
        break;
      default:
        c.page_stride = sat_add(rounded, 16 * in_.range(0, 2));
    }
    if (c.num_heads > 4096 || c.num_heads < -4096 || c.page_size > 4096 || c.page_size < -4096 ||
        c.num_pages > 4096 || c.num_pages < -4096 || c.page_stride > (1 << 24) ||
        c.page_stride < -(1 << 24)) {
      exact_ = false;
    }
    // Bytes a valid descriptor may address: the padding after the last page is not included.
    int64_t bytes = -1;
    if (c.num_pages >= 0 && c.page_size > 0 && bpt > 0 && c.page_stride >= 0) {
      bytes = c.num_pages == 0
                  ? 0
                  : sat_add(sat_mul(c.num_pages - 1, c.page_stride), sat_mul(c.page_size, bpt));
    }
    const size_t misalign = pointer_misalign();
    if (bytes < 0 || static_cast<uint64_t>(bytes) > kMaxCacheBytes) {
      executable_ = false;
      c.data = arena_.alloc(0, misalign);
    } else {
      auto* p = arena_.alloc(static_cast<size_t>(bytes), misalign);
      gen_.fill(p, static_cast<size_t>(bytes));
      c.data = p;
      regions_.push_back(Region{"cache", p, static_cast<size_t>(bytes), false, {}});
    }
    if (in_.u8() % 40 == 0) c.data = nullptr;
    if (c.device.type != DeviceType::kCPU) executable_ = false;
    return c;
  }

  // Work the caller estimates; over the cap the request is only validated, not run.
  void work(int64_t units, int64_t cap) {
    if (units < 0 || units > cap) executable_ = false;
  }
  void not_executable() { executable_ = false; }

  bool executable() const { return executable_; }
  bool exact() const { return exact_; }
  std::vector<Region>& regions() { return regions_; }
  Input& in() { return in_; }

  static int64_t model_bytes_per_token(KVFormat f, int64_t heads) {
    switch (f) {
      case KVFormat::kModel1:
        return 584;
      case KVFormat::kV32:
        return 656;
      case KVFormat::kBF16:
      case KVFormat::kFP16:
        return sat_mul(heads, 1152);
    }
    return 584;  // unknown formats: the allocation just needs some size
  }

 private:
  size_t pointer_misalign() {
    switch (in_.u8() % 32) {
      case 0:
        return in_.pick<size_t>({1, 2, 4, 8});
      case 1:
        return in_.pick<size_t>({16, 32, 48});
      default:
        return 0;
    }
  }

  void strides(TensorView& t, int dims) {
    const int mode = in_.u8() % 16;
    int64_t pad = 0;
    if (mode == 10 || mode == 11) pad = in_.pick<int64_t>({1, 8, 16, 64});
    int64_t acc = 1;
    if (mode == 12 && dims >= 3) {  // outer dims stored in reverse order, last dim contiguous
      t.strides[dims - 1] = 1;
      acc = sat_add(std::max<int64_t>(t.shape[dims - 1], 1), 8);
      for (int d = 0; d < dims - 1; ++d) {
        t.strides[d] = acc;
        acc = sat_mul(acc, std::max<int64_t>(t.shape[d], 1));
      }
      return;
    }
    for (int d = dims - 1; d >= 0; --d) {
      t.strides[d] = acc;
      acc = sat_add(sat_mul(acc, std::max<int64_t>(t.shape[d], 1)), d == dims - 1 ? pad : 0);
    }
    if (mode == 13) {
      for (int d = 0; d < dims; ++d) t.strides[d] = in_.range(0, 64);
    } else if (mode == 14 && dims > 0) {
      t.strides[in_.u8() % dims] = in_.pick<int64_t>({0, -1, -64, int64_t{1} << 40, INT64_MAX / 2});
    } else if (mode == 15 && dims > 0) {
      t.strides[dims - 1] = in_.pick<int64_t>({0, 2, 3});
    }
  }

  void place(TensorView& t, const char* name, bool output, IntFill fill) {
    const size_t misalign = pointer_misalign();
    const size_t elem = elem_size(t.dtype) ? elem_size(t.dtype) : 1;
    const int64_t span = span_bytes(t, static_cast<int64_t>(elem));
    if (span < 0 || static_cast<uint64_t>(span) > kMaxTensorBytes) {
      executable_ = false;
      t.data = arena_.alloc(0, misalign);
    } else {
      auto* p = arena_.alloc(static_cast<size_t>(span), misalign);
      t.data = p;
      if (output) {
        std::memset(p, 0xa5, static_cast<size_t>(span));
      } else if (t.dtype == DType::kInt32) {
        fill_ints(p, static_cast<size_t>(span) / 4, fill);
      } else {
        gen_.fill(p, static_cast<size_t>(span));
      }
      regions_.push_back(Region{name, p, static_cast<size_t>(span), output, {}});
    }
    if (in_.u8() % 48 == 0) t.data = nullptr;
    if (t.device.type != DeviceType::kCPU) executable_ = false;
  }

  void fill_ints(uint8_t* p, size_t n, IntFill fill) {
    const int mode = in_.u8() % 4;
    for (size_t i = 0; i < n; ++i) {
      int32_t v;
      const uint32_t r = gen_.u32();
      if (mode == 0) {
        v = -1;
      } else if (mode == 1 || (r & 3) != 0) {
        v = fill.bound > 0 ? static_cast<int32_t>((r >> 2) % static_cast<uint64_t>(fill.bound))
                           : -1;
      } else {
        const int32_t odd[] = {-1, INT32_MIN, INT32_MAX, static_cast<int32_t>(fill.bound),
                               static_cast<int32_t>(r)};
        v = odd[(r >> 2) % 5];
      }
      std::memcpy(p + 4 * i, &v, 4);
    }
  }

  Input& in_;
  Arena& arena_;
  Gen gen_;
  std::vector<Region> regions_;
  bool executable_ = true;
  bool exact_ = true;
};

// ---- The model of the contract ----

struct Want {
  const char* name;
  std::vector<DType> dtypes;
  std::vector<int64_t> shape;  // kAnyExtent matches any extent
  bool last_dim_contiguous = false;
  size_t alignment = 0;  // bytes; 0 = the element size
};

// First violated rule, or "" when the request satisfies the model.
class Model {
 public:
  explicit Model(const Options& o) : options_(o) {}

  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  void require(bool cond, const std::string& what) {
    if (!cond && why_.empty()) why_ = what;
  }

  void tensor(const TensorView& t, const Want& w) {
    const std::string n(w.name);
    require(t.ndim == static_cast<int>(w.shape.size()), n + ": rank");
    if (!ok()) return;
    bool dtype_ok = false;
    for (DType d : w.dtypes) dtype_ok |= d == t.dtype;
    require(dtype_ok, n + ": dtype");
    if (!ok()) return;
    const int64_t elem = static_cast<int64_t>(elem_size(t.dtype));
    bool empty = false;
    for (int d = 0; d < t.ndim; ++d) {
      require(t.shape[d] >= 0 && t.shape[d] <= kMaxExtent, n + ": extent");
      require(w.shape[d] == kAnyExtent || t.shape[d] == w.shape[d], n + ": shape");
      require(t.shape[d] <= 1 || t.strides[d] >= 0, n + ": negative stride");
      empty |= t.shape[d] == 0;
    }
    if (!ok()) return;
    const size_t align = w.alignment ? w.alignment : static_cast<size_t>(elem);
    require(empty || t.data != nullptr, n + ": null data");
    require(reinterpret_cast<uintptr_t>(t.data) % align == 0, n + ": misaligned data");
    const int last = t.ndim - 1;
    if (w.last_dim_contiguous && !empty && last >= 0 && t.shape[last] > 1) {
      require(t.strides[last] == 1, n + ": last dim not contiguous");
    }
    for (int d = 0; d < last && !empty; ++d) {
      if (t.shape[d] > 1 && align > static_cast<size_t>(elem)) {
        require(t.strides[d] % (static_cast<int64_t>(align) / elem) == 0, n + ": stride alignment");
      }
    }
    // The addressed range must fit 64-bit byte offsets (the library keeps a margin on top).
    if (!empty) {
      int64_t last_offset = 0;
      for (int d = 0; d < t.ndim; ++d) {
        if (t.shape[d] > 1)
          last_offset = sat_add(last_offset, sat_mul(t.shape[d] - 1, t.strides[d]));
      }
      require(sat_mul(last_offset, elem) < INT64_MAX, n + ": addressed range overflows");
    }
  }

  void opt_tensor(const std::optional<TensorView>& t, const Want& w) {
    if (t) tensor(*t, w);
  }

  void cache(const KVCache& c, const char* name) {
    const std::string n(name);
    const bool known = c.format == KVFormat::kModel1 || c.format == KVFormat::kV32 ||
                       c.format == KVFormat::kBF16 || c.format == KVFormat::kFP16;
    require(known, n + ": unknown format");
    if (!ok()) return;
    const bool fp8 = c.format == KVFormat::kModel1 || c.format == KVFormat::kV32;
    require(fp8 ? c.num_heads == 1 : (c.num_heads >= 1 && c.num_heads <= 128), n + ": num_heads");
    require(c.page_size >= 1 && c.page_size <= kMaxExtent, n + ": page_size");
    require(c.num_pages >= 0 && c.num_pages <= kMaxExtent, n + ": num_pages");
    if (!ok()) return;
    const int64_t bpt = Builder::model_bytes_per_token(c.format, c.num_heads);
    require(c.page_stride >= sat_mul(c.page_size, bpt), n + ": page_stride below the page");
    require(c.page_stride % 16 == 0, n + ": page_stride not a multiple of 16");
    require(c.num_pages == 0 || c.data != nullptr, n + ": null data");
    require(reinterpret_cast<uintptr_t>(c.data) % 16 == 0, n + ": misaligned data");
    if (c.num_pages > 0) {
      require(sat_mul(c.num_pages, c.page_stride) < INT64_MAX, n + ": pool size overflows");
    }
  }

  void same_device(Device d, Device main, const char* name) {
    require(d == main, std::string(name) + ": device");
  }

  void scale(const std::optional<float>& s) {
    // Its base-2 form, s * log2(e), must be finite as well.
    if (s) require(std::isfinite(*s) && *s > 0.f && *s <= 2.35e38f, "softmax_scale");
  }

  // Backend choice for tensors on `dev` (CPU-only builds; CUDA builds skip the model there).
  void backend(Device dev) {
    Backend requested = options_.backend;
    if (requested == Backend::kAuto) {
      const char* env = std::getenv("SPARSE_MLA_BACKEND");
      if (env && *env) {
        const std::string e(env);
        if (e == "cpu")
          requested = Backend::kCPU;
        else if (e == "cuda")
          requested = Backend::kCUDA;
        else if (e == "sm90")
          requested = Backend::kSM90;
        else
          require(e == "auto", "SPARSE_MLA_BACKEND");
      }
    }
    require(dev.type == DeviceType::kCPU, "device is not the host");
    require(requested == Backend::kAuto || requested == Backend::kCPU, "backend not cpu");
  }

 private:
  const Options& options_;
  std::string why_;
};

inline int model_d_qk(KVFormat f) { return f == KVFormat::kModel1 ? 512 : 576; }

inline bool any_device_not_host(std::initializer_list<Device> devices) {
  for (Device d : devices) {
    if (d.type != DeviceType::kCPU) return true;
  }
  return false;
}

// ---- Checking one call ----

struct Call {
  Builder& b;
  Findings& f;
  const char* op;

  // Compares the library's verdict with the model's and checks what the call wrote.
  void check(const Status& s, const Model& m, bool model_applies) {
    if (!s.ok()) {
      if (s.code() != StatusCode::kInvalidArgument && s.code() != StatusCode::kUnsupported) {
        return f.fail(std::string(op) + ": unexpected status " + s.to_string());
      }
      if (s.message().empty() || s.message().find(": ") == std::string::npos) {
        return f.fail(std::string(op) + ": error message without '<argument>: ': " + s.message());
      }
      if (model_applies && m.ok() && b.exact()) {
        return f.fail(std::string(op) + ": rejected a request the model accepts: " + s.to_string());
      }
    } else if (model_applies && !m.ok()) {
      return f.fail(std::string(op) + ": accepted a request the model rejects (" + m.why() + ")");
    }
    for (const Region& r : b.regions()) {
      if ((!s.ok() || !r.output) && !r.unchanged()) {
        return f.fail(std::string(op) + ": " + (s.ok() ? "wrote input " : "failed but wrote ") +
                      r.name);
      }
    }
  }
};

inline Options options(Builder& b) {
  Options o;
  switch (b.in().u8() % 32) {
    case 0:
      o.backend = Backend::kCUDA;
      break;
    case 1:
      o.backend = Backend::kSM90;
      break;
    case 2:
      o.backend = static_cast<Backend>(b.in().range(4, 255));
      break;
    case 3:
    case 4:
    case 5:
    case 6:
      o.backend = Backend::kCPU;
      break;
    default:
      o.backend = Backend::kAuto;
  }
  return o;
}

inline std::optional<float> scale_arg(Input& in) {
  switch (in.u8() % 16) {
    case 0:
      return std::nullopt;
    case 1:
      return 0.f;
    case 2:
      return -0.0625f;
    case 3:
      return NAN;
    case 4:
      return INFINITY;
    case 5:
      return 1e-40f;
    case 6:
      return in.f32();
    default:
      return 0.0441941738f;
  }
}

inline void snapshot(Builder& b) {
  for (Region& r : b.regions()) r.snapshot();
}

// Decode ops: the validation-only queries must agree with the operation itself.
template <typename Args, typename Supported, typename Size, typename Plan, typename Run>
void decode_calls(Builder& b, Findings& f, const char* op, const Args& a, const Options& o,
                  const Model& m, bool model_applies, Supported supported, Size size, Plan plan,
                  Run run) {
  snapshot(b);
  Call call{b, f, op};
  Backend chosen;
  const Status s_sup = supported(a, o, &chosen);
  call.check(s_sup, m, model_applies);
  WorkspaceSizes sizes;
  const Status s_size = size(a, o, &sizes);
  if (s_size.code() != s_sup.code() || s_size.message() != s_sup.message()) {
    return f.fail(std::string(op) + ": workspace_size says '" + s_size.to_string() +
                  "' but supported says '" + s_sup.to_string() + "'");
  }
  if (s_sup.ok() && chosen == Backend::kCPU && (sizes.plan_bytes || sizes.scratch_bytes)) {
    return f.fail(std::string(op) + ": the CPU backend asks for a workspace");
  }
  // Plans and runs launch work on CUDA devices; with host pointers that is only safe to try
  // in a CPU-only build, where those requests are rejected.
  const bool may_launch = !s_sup.ok() || chosen == Backend::kCPU;
  if (!may_launch || (s_sup.ok() && !b.executable())) return;
  const Workspace ws{};
  const Status s_plan = plan(a, ws, o);
  if (s_plan.code() != s_sup.code() || s_plan.message() != s_sup.message()) {
    return f.fail(std::string(op) + ": plan says '" + s_plan.to_string() +
                  "' but supported says '" + s_sup.to_string() + "'");
  }
  const Status s_run = run(a, ws, o);
  if (s_run.code() != s_sup.code() || s_run.message() != s_sup.message()) {
    return f.fail(std::string(op) + ": run says '" + s_run.to_string() + "' but supported says '" +
                  s_sup.to_string() + "'");
  }
  call.check(s_run, m, model_applies);
}

// ---- Operations ----

inline void sparse(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const KVFormat format = in.coin() ? KVFormat::kModel1 : KVFormat::kV32;
  const int64_t bs = in.range(0, 3), s_q = in.range(1, 3), h_q = in.range(1, 8);
  const int64_t topk = in.range(1, 20), extra_topk = in.range(1, 12);
  SparseDecodeArgs a;
  a.kv = b.cache(format, 1, dev);
  a.q = b.tensor("q", false, DType::kBFloat16, {bs, s_q, h_q, model_d_qk(format)}, dev);
  a.indices = b.tensor("indices", false, DType::kInt32, {bs, s_q, topk}, dev, {slots_of(a.kv)});
  if (in.coin())
    a.topk_length = b.tensor("topk_length", false, DType::kInt32, {bs}, dev, {topk + 2});
  const int extra_mode = in.u8() % 8;
  if (extra_mode < 3) {
    a.extra_kv = b.cache(format, 1, dev);
    if (extra_mode != 2 || in.coin()) {
      a.extra_indices = b.tensor("extra_indices", false, DType::kInt32, {bs, s_q, extra_topk}, dev,
                                 {slots_of(*a.extra_kv)});
    }
    if (in.coin()) {
      a.extra_topk_length =
          b.tensor("extra_topk_length", false, DType::kInt32, {bs}, dev, {extra_topk + 2});
    }
  } else if (extra_mode == 3) {  // extra arguments without an extra cache
    a.extra_indices = b.tensor("extra_indices", false, DType::kInt32, {bs, s_q, 1}, dev, {1});
  }
  if (in.coin()) a.attn_sink = b.tensor("attn_sink", false, DType::kFloat32, {h_q}, dev);
  a.softmax_scale = scale_arg(in);
  a.out = b.tensor("out", true, DType::kBFloat16, {bs, s_q, h_q, 512}, dev);
  a.lse = b.tensor("lse", true, DType::kFloat32, {bs, h_q, s_q}, dev);
  const Options o = options(b);
  b.work(sat_mul(sat_mul(a.q.shape[0], a.q.shape[1]),
                 sat_mul(a.q.shape[2], sat_add(a.indices.shape[2],
                                               a.extra_indices ? a.extra_indices->shape[2] : 0))),
         4096);

  Model m(o);
  m.tensor(a.q,
           {"q", {DType::kBFloat16}, {kAnyExtent, kAnyExtent, kAnyExtent, kAnyExtent}, true, 16});
  if (m.ok()) {
    const Device qd = a.q.device;
    const int64_t B = a.q.shape[0], S = a.q.shape[1], H = a.q.shape[2];
    m.require(S >= 1 && H >= 1, "q: s_q and h_q >= 1");
    m.cache(a.kv, "k_cache");
    m.require(a.kv.format == KVFormat::kModel1 || a.kv.format == KVFormat::kV32,
              "k_cache: not FP8");
    m.same_device(a.kv.device, qd, "k_cache");
    if (m.ok()) m.require(a.q.shape[3] == model_d_qk(a.kv.format), "q: d_qk");
    m.tensor(a.indices, {"indices", {DType::kInt32}, {B, S, kAnyExtent}});
    m.same_device(a.indices.device, qd, "indices");
    if (m.ok()) m.require(a.indices.shape[2] >= 1, "indices: topk");
    m.opt_tensor(a.topk_length, {"topk_length", {DType::kInt32}, {B}});
    if (a.topk_length) m.same_device(a.topk_length->device, qd, "topk_length");
    m.require(a.extra_kv || (!a.extra_indices && !a.extra_topk_length),
              "extra_* without extra cache");
    if (a.extra_kv) {
      m.cache(*a.extra_kv, "extra_k_cache");
      m.require(a.extra_kv->format == a.kv.format, "extra_k_cache: format");
      m.same_device(a.extra_kv->device, qd, "extra_k_cache");
      m.require(a.extra_indices.has_value(), "extra_indices: missing");
      m.opt_tensor(a.extra_indices, {"extra_indices", {DType::kInt32}, {B, S, kAnyExtent}});
      if (a.extra_indices) {
        m.same_device(a.extra_indices->device, qd, "extra_indices");
        if (m.ok()) m.require(a.extra_indices->shape[2] >= 1, "extra_indices: extra_topk");
      }
      m.opt_tensor(a.extra_topk_length, {"extra_topk_length", {DType::kInt32}, {B}});
      if (a.extra_topk_length) m.same_device(a.extra_topk_length->device, qd, "extra_topk_length");
    }
    m.opt_tensor(a.attn_sink, {"attn_sink", {DType::kFloat32}, {H}});
    if (a.attn_sink) m.same_device(a.attn_sink->device, qd, "attn_sink");
    m.scale(a.softmax_scale);
    m.tensor(a.out, {"out", {DType::kBFloat16}, {B, S, H, 512}, true, 16});
    m.same_device(a.out.device, qd, "out");
    m.tensor(a.lse, {"lse", {DType::kFloat32}, {B, H, S}});
    m.same_device(a.lse.device, qd, "lse");
    m.backend(qd);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.q.device, a.kv.device});
  decode_calls(b, f, "sparse_decode", a, o, m, model_applies, sparse_decode_supported,
               sparse_decode_workspace_size, sparse_decode_plan, sparse_decode);
}

inline void dense(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const KVFormat format =
      in.pick<KVFormat>({KVFormat::kBF16, KVFormat::kFP16, KVFormat::kModel1, KVFormat::kV32});
  const bool fp8 = format == KVFormat::kModel1 || format == KVFormat::kV32;
  const int64_t h_kv = fp8 ? 1 : in.range(1, 3);
  const int64_t bs = in.range(0, 3), s_q = in.range(1, 3), h_q = h_kv * in.range(1, 4);
  const int64_t max_pages = in.range(0, 4);
  const DType qt = format == KVFormat::kFP16 ? DType::kFloat16 : DType::kBFloat16;
  DenseDecodeArgs a;
  a.kv = b.cache(format, h_kv, dev);
  a.q = b.tensor("q", false, qt, {bs, s_q, h_q, model_d_qk(format)}, dev);
  a.block_table = b.tensor("block_table", false, DType::kInt32, {bs, max_pages}, dev,
                           {a.kv.num_pages > 0 ? a.kv.num_pages : 0});
  a.cache_seqlens =
      b.tensor("cache_seqlens", false, DType::kInt32, {bs}, dev,
               {sat_add(sat_mul(max_pages, std::max<int64_t>(a.kv.page_size, 0)), 2)});
  a.causal = in.coin();
  a.softmax_scale = scale_arg(in);
  a.out = b.tensor("out", true, qt, {bs, s_q, h_q, 512}, dev);
  a.lse = b.tensor("lse", true, DType::kFloat32, {bs, h_q, s_q}, dev);
  const Options o = options(b);
  b.work(sat_mul(sat_mul(sat_mul(a.q.shape[0], a.q.shape[1]), a.q.shape[2]),
                 sat_mul(a.block_table.shape[1], a.kv.page_size)),
         8192);

  Model m(o);
  m.tensor(a.q, {"q",
                 {DType::kBFloat16, DType::kFloat16},
                 {kAnyExtent, kAnyExtent, kAnyExtent, kAnyExtent},
                 true,
                 16});
  if (m.ok()) {
    const Device qd = a.q.device;
    const int64_t B = a.q.shape[0], S = a.q.shape[1], H = a.q.shape[2];
    m.require(S >= 1 && H >= 1, "q: s_q and h_q >= 1");
    m.cache(a.kv, "k_cache");
    m.same_device(a.kv.device, qd, "k_cache");
    if (m.ok()) {
      m.require(a.q.dtype == (a.kv.format == KVFormat::kFP16 ? DType::kFloat16 : DType::kBFloat16),
                "q: dtype of the cache");
      m.require(a.q.shape[3] == model_d_qk(a.kv.format), "q: d_qk");
      m.require(H % a.kv.num_heads == 0, "q: h_q multiple of h_kv");
    }
    m.tensor(a.block_table, {"block_table", {DType::kInt32}, {B, kAnyExtent}});
    m.same_device(a.block_table.device, qd, "block_table");
    if (m.ok()) {
      m.require(sat_mul(a.block_table.shape[1], a.kv.page_size) <= kMaxExtent,
                "block_table: max_pages * page_size");
    }
    m.tensor(a.cache_seqlens, {"cache_seqlens", {DType::kInt32}, {B}});
    m.same_device(a.cache_seqlens.device, qd, "cache_seqlens");
    m.scale(a.softmax_scale);
    m.tensor(a.out, {"out", {a.q.dtype}, {B, S, H, 512}, true, 16});
    m.same_device(a.out.device, qd, "out");
    m.tensor(a.lse, {"lse", {DType::kFloat32}, {B, H, S}});
    m.same_device(a.lse.device, qd, "lse");
    m.backend(qd);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.q.device, a.kv.device});
  decode_calls(b, f, "dense_decode", a, o, m, model_applies, dense_decode_supported,
               dense_decode_workspace_size, dense_decode_plan, dense_decode);
}

// Ops without a validation-only query run whenever the request is small and real, or when the
// model rejects it (then the library must reject it too, before touching anything).
inline void run_checked(Builder& b, Findings& f, const char* op, const Model& m, bool model_applies,
                        const std::function<Status()>& call_op) {
  if (!b.executable() && (m.ok() || !model_applies)) return;
  snapshot(b);
  const Status s = call_op();
  Call{b, f, op}.check(s, m, model_applies);
}

inline void merge(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const int64_t n = in.range(1, 3), bs = in.range(0, 2), s_q = in.range(0, 2), h_q = in.range(0, 4);
  const int64_t d_v = in.pick<int64_t>({512, 1, 7, 64, 4096, 4097});
  MergeArgs a;
  a.out_parts = b.tensor("out_parts", false, in.coin() ? DType::kFloat32 : DType::kBFloat16,
                         {n, bs, s_q, h_q, d_v}, dev);
  a.lse_parts = b.tensor("lse_parts", false, DType::kFloat32, {n, bs, s_q, h_q}, dev);
  if (in.coin()) a.attn_sink = b.tensor("attn_sink", false, DType::kFloat32, {h_q}, dev);
  a.out = b.tensor("out", true, in.coin() ? DType::kFloat32 : DType::kBFloat16, {bs, s_q, h_q, d_v},
                   dev);
  a.lse = b.tensor("lse", true, DType::kFloat32, {bs, h_q, s_q}, dev);
  const Options o = options(b);
  if (a.out_parts.ndim == 5) {
    int64_t elems = 1;
    for (int d = 0; d < 5; ++d) elems = sat_mul(elems, a.out_parts.shape[d]);
    b.work(elems, 1 << 20);
  } else {
    b.not_executable();
  }

  Model m(o);
  m.tensor(a.out_parts, {"out_parts",
                         {DType::kFloat32, DType::kBFloat16},
                         {kAnyExtent, kAnyExtent, kAnyExtent, kAnyExtent, kAnyExtent},
                         true});
  if (m.ok()) {
    const Device od = a.out_parts.device;
    const int64_t N = a.out_parts.shape[0], B = a.out_parts.shape[1], S = a.out_parts.shape[2],
                  H = a.out_parts.shape[3], D = a.out_parts.shape[4];
    m.require(N >= 1, "out_parts: n");
    m.require(D >= 1 && D <= 4096, "out_parts: d_v");
    m.tensor(a.lse_parts, {"lse_parts", {DType::kFloat32}, {N, B, S, H}});
    m.same_device(a.lse_parts.device, od, "lse_parts");
    m.opt_tensor(a.attn_sink, {"attn_sink", {DType::kFloat32}, {H}});
    if (a.attn_sink) m.same_device(a.attn_sink->device, od, "attn_sink");
    m.tensor(a.out, {"out", {DType::kBFloat16, DType::kFloat32}, {B, S, H, D}, true});
    m.same_device(a.out.device, od, "out");
    m.tensor(a.lse, {"lse", {DType::kFloat32}, {B, H, S}});
    m.same_device(a.lse.device, od, "lse");
    m.backend(od);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.out_parts.device});
  if (!model_applies) return;
  run_checked(b, f, "merge_attention", m, model_applies, [&] { return merge_attention(a, o); });
}

inline void quantize(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const KVFormat format = in.pick<KVFormat>({KVFormat::kModel1, KVFormat::kV32, KVFormat::kBF16});
  const int64_t n = in.range(0, 9);
  QuantizeStoreArgs a;
  a.kv = b.cache(format, 1, dev);
  a.src = b.tensor("src", false, in.coin() ? DType::kBFloat16 : DType::kFloat32,
                   {n, model_d_qk(format)}, dev);
  a.slots = b.tensor("slots", false, DType::kInt32, {n}, dev, {slots_of(a.kv)});
  const Options o = options(b);
  b.work(a.src.ndim >= 1 ? a.src.shape[0] : 0, 256);
  // quantize_store writes the cache: it must be an output region.
  for (Region& r : b.regions()) {
    if (std::strcmp(r.name, "cache") == 0) r.output = true;
  }

  Model m(o);
  m.cache(a.kv, "kv");
  m.require(a.kv.format == KVFormat::kModel1 || a.kv.format == KVFormat::kV32, "kv: not FP8");
  if (m.ok()) {
    m.tensor(
        a.src,
        {"src", {DType::kBFloat16, DType::kFloat32}, {kAnyExtent, model_d_qk(a.kv.format)}, true});
  }
  if (m.ok()) {
    m.tensor(a.slots, {"slots", {DType::kInt32}, {a.src.shape[0]}});
    m.same_device(a.slots.device, a.src.device, "slots");
    m.same_device(a.kv.device, a.src.device, "kv");
    m.backend(a.src.device);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.src.device, a.kv.device});
  if (!model_applies) return;
  run_checked(b, f, "quantize_store", m, model_applies, [&] { return quantize_store(a, o); });
}

inline void dequant(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const KVFormat format =
      in.pick<KVFormat>({KVFormat::kModel1, KVFormat::kV32, KVFormat::kBF16, KVFormat::kFP16});
  const int64_t heads =
      (format == KVFormat::kBF16 || format == KVFormat::kFP16) ? in.range(1, 2) : 1;
  const int64_t n = in.range(0, 9);
  DequantizeArgs a;
  a.kv = b.cache(format, heads, dev);
  a.slots = b.tensor("slots", false, DType::kInt32, {n}, dev, {slots_of(a.kv)});
  a.out = b.tensor("out", true, in.coin() ? DType::kBFloat16 : DType::kFloat32,
                   {n, model_d_qk(format)}, dev);
  const Options o = options(b);
  b.work(a.slots.ndim >= 1 ? a.slots.shape[0] : 0, 256);

  Model m(o);
  m.cache(a.kv, "kv");
  m.tensor(a.slots, {"slots", {DType::kInt32}, {kAnyExtent}});
  if (m.ok()) {
    m.tensor(a.out, {"out",
                     {DType::kBFloat16, DType::kFloat32},
                     {a.slots.shape[0], model_d_qk(a.kv.format)},
                     true});
    m.same_device(a.slots.device, a.kv.device, "slots");
    m.same_device(a.out.device, a.kv.device, "out");
    m.backend(a.kv.device);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.kv.device});
  if (!model_applies) return;
  run_checked(b, f, "dequantize", m, model_applies, [&] { return dequantize(a, o); });
}

inline void repack(Builder& b, Findings& f) {
  Input& in = b.in();
  const Device dev{};
  const KVFormat format =
      in.pick<KVFormat>({KVFormat::kModel1, KVFormat::kV32, KVFormat::kBF16, KVFormat::kFP16});
  const int64_t heads =
      (format == KVFormat::kBF16 || format == KVFormat::kFP16) ? in.range(1, 2) : 1;
  const int64_t bs = in.range(0, 3), max_src = in.range(0, 3), max_dst = in.range(0, 3);
  RepackArgs a;
  a.src = b.cache(format, heads, dev);
  a.dst = b.cache(in.u8() % 16 == 0 ? KVFormat::kV32 : format, heads, dev);
  a.seqlens = b.tensor("seqlens", false, DType::kInt32, {bs}, dev, {64});
  a.src_block_table = b.tensor("src_block_table", false, DType::kInt32, {bs, max_src}, dev,
                               {a.src.num_pages > 0 ? a.src.num_pages : 0});
  a.dst_block_table = b.tensor("dst_block_table", false, DType::kInt32, {bs, max_dst}, dev,
                               {a.dst.num_pages > 0 ? a.dst.num_pages : 0});
  const Options o = options(b);
  // Per request: table entries visited plus tokens copied (lengths are clamped to the smaller
  // table capacity).
  const int64_t per_request =
      sat_add(sat_add(a.src_block_table.shape[1], a.dst_block_table.shape[1]),
              std::min(sat_mul(a.src_block_table.shape[1], a.src.page_size),
                       sat_mul(a.dst_block_table.shape[1], a.dst.page_size)));
  b.work(sat_mul(a.seqlens.ndim >= 1 ? a.seqlens.shape[0] : 0, per_request), 1 << 14);
  // The destination pool is written; it is the second cache region.
  int caches = 0;
  for (Region& r : b.regions()) {
    if (std::strcmp(r.name, "cache") == 0 && caches++ == 1) r.output = true;
  }

  Model m(o);
  m.cache(a.src, "src");
  m.cache(a.dst, "dst");
  m.require(a.src.format == a.dst.format && a.src.num_heads == a.dst.num_heads, "dst: format");
  m.same_device(a.dst.device, a.src.device, "dst");
  m.tensor(a.seqlens, {"seqlens", {DType::kInt32}, {kAnyExtent}});
  if (m.ok()) {
    const int64_t B = a.seqlens.shape[0];
    m.tensor(a.src_block_table, {"src_block_table", {DType::kInt32}, {B, kAnyExtent}});
    m.tensor(a.dst_block_table, {"dst_block_table", {DType::kInt32}, {B, kAnyExtent}});
    m.same_device(a.seqlens.device, a.src.device, "seqlens");
    m.same_device(a.src_block_table.device, a.src.device, "src_block_table");
    m.same_device(a.dst_block_table.device, a.src.device, "dst_block_table");
    m.backend(a.src.device);
  }
  const bool model_applies = !kCudaBuild || !any_device_not_host({a.src.device});
  if (!model_applies) return;
  run_checked(b, f, "repack_pages", m, model_applies, [&] { return repack_pages(a, o); });
}

// kv_cache_from_tensor: an accepted tensor must describe pages inside the tensor's own span,
// so dequantizing every slot of the resulting cache stays inside the exact-size block.
inline void cache_from_tensor(Builder& b, Findings& f, Arena& arena) {
  Input& in = b.in();
  const Device dev{};
  const int kind = in.u8() % 4;
  const int64_t pages = in.range(0, 4), page = in.pick<int64_t>({1, 2, 3, 64}),
                heads = kind >= 2 ? in.range(1, 3) : 1;
  const int64_t last = kind == 0 ? 584 : kind == 1 ? 656 : 576;
  const DType dtype = kind == 0 || kind == 1 ? (in.coin() ? DType::kUInt8 : DType::kFloat8E4M3)
                                             : (kind == 2 ? DType::kBFloat16 : DType::kFloat16);
  const TensorView t = b.tensor("k_cache", false, dtype, {pages, page, heads, last}, dev);
  KVCache kv;
  const Status s = kv_cache_from_tensor(t, "k_cache", &kv);
  if (!s.ok()) {
    if (s.code() != StatusCode::kInvalidArgument || s.message().rfind("k_cache: ", 0) != 0) {
      f.fail("kv_cache_from_tensor: bad error " + s.to_string());
    }
    return;
  }
  // Necessary conditions of an accepted tensor.
  const bool fp8 = t.dtype == DType::kUInt8 || t.dtype == DType::kFloat8E4M3;
  if (t.ndim != 4 || (fp8 && (t.shape[2] != 1 || (t.shape[3] != 584 && t.shape[3] != 656))) ||
      (!fp8 && (t.dtype != DType::kBFloat16 && t.dtype != DType::kFloat16)) ||
      (!fp8 && t.shape[3] != 576) || kv.num_pages != t.shape[0] || kv.page_size != t.shape[1] ||
      kv.data != t.data || kv.device != t.device) {
    return f.fail("kv_cache_from_tensor accepted " + t.shape_string() + " " + dtype_name(t.dtype) +
                  " or described it wrongly");
  }
  const int64_t n = slots_of(kv);
  if (!b.executable() || n > 4096) return;
  uint8_t* slots = arena.alloc(static_cast<size_t>(n) * 4);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(i);
    std::memcpy(slots + 4 * i, &v, 4);
  }
  const int64_t d = kv.format == KVFormat::kModel1 ? 512 : 576;
  float* out = reinterpret_cast<float*>(arena.alloc(static_cast<size_t>(n * d) * 4));
  DequantizeArgs a;
  a.kv = kv;
  a.slots = TensorView::contiguous(slots, DType::kInt32, t.device, {n});
  a.out = TensorView::contiguous(out, DType::kFloat32, t.device, {n, d});
  // Rejections are fine here (e.g. a stride that is not a multiple of 16): only an accepted
  // descriptor matters, and ASan checks that its pages lie inside the tensor.
  (void)dequantize(a, Options{Backend::kCPU, nullptr});
}

}  // namespace validation_detail

inline std::string fuzz_validation(const uint8_t* data, size_t size) {
  using namespace validation_detail;
  Input in(data, size);
  Arena arena;
  Findings f;
  Builder b(in, arena);
  switch (in.u8() % 7) {
    case 0:
      sparse(b, f);
      break;
    case 1:
      dense(b, f);
      break;
    case 2:
      merge(b, f);
      break;
    case 3:
      quantize(b, f);
      break;
    case 4:
      dequant(b, f);
      break;
    case 5:
      repack(b, f);
      break;
    case 6:
      cache_from_tensor(b, f, arena);
      break;
  }
  return f.first;
}

}  // namespace sparse_mla::fuzz
