// Shared pieces of the fuzz targets: an input reader that never fails (an exhausted input reads
// as zeros, which every target maps to its plainest valid request), exact-size host allocations
// (so AddressSanitizer flags any byte read or written past what a valid request may touch), a
// tiny deterministic generator for bulk data, and the finding report.
// Header-only: the libFuzzer mains (fuzz/fuzz_main.cpp) and the regression test
// (tests/cpp/test_fuzz_regressions.cpp) include the same code.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "sparse_mla/sparse_mla.h"

namespace sparse_mla::fuzz {

inline std::string num(int64_t v) { return std::to_string(v); }

// memcmp that accepts empty (possibly null) ranges.
inline bool same_bytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

// Reads the fuzz input front to back; reads past the end return zeros.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return static_cast<uint32_t>(u16()) | (static_cast<uint32_t>(u16()) << 16); }
  uint64_t u64() { return static_cast<uint64_t>(u32()) | (static_cast<uint64_t>(u32()) << 32); }
  float f32() {
    const uint32_t u = u32();
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  bool coin() { return u8() & 1; }
  // Uniform-ish in [lo, hi] (lo <= hi, span below 2^32).
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(u32() % span);
  }
  template <typename T>
  T pick(std::initializer_list<T> options) {
    return options.begin()[u8() % options.size()];
  }
  size_t remaining() const { return pos_ < size_ ? size_ - pos_ : 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// splitmix64: bulk data (cache bytes, values) from one seed the input picks.
class Gen {
 public:
  explicit Gen(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  void fill(void* dst, size_t bytes) {
    auto* p = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t v = next();
      std::memcpy(p + i, &v, bytes - i < 8 ? bytes - i : 8);
    }
  }

 private:
  uint64_t s_;
};

// Heap blocks of exactly the requested size (plus a leading misalignment), so that the first
// byte past a valid request's range is outside the allocation.
class Arena {
 public:
  // `bytes` usable bytes at a pointer that is `misalign` bytes past a 64-byte boundary.
  uint8_t* alloc(size_t bytes, size_t misalign = 0) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, misalign + bytes + (misalign + bytes == 0 ? 1 : 0)) != 0) {
      std::abort();  // the harness itself is out of memory: not a finding in the library
    }
    blocks_.emplace_back(static_cast<uint8_t*>(p));
    return static_cast<uint8_t*>(p) + misalign;
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<uint8_t, Free>> blocks_;
};

// A named host buffer whose bytes the harness snapshots around a call.
struct Region {
  const char* name;
  uint8_t* data;
  size_t bytes;
  bool output;  // the call may write it
  std::vector<uint8_t> before;

  void snapshot() { before.assign(data, data + bytes); }
  bool unchanged() const;
};

inline bool Region::unchanged() const { return same_bytes(before.data(), data, bytes); }

// Collects the first property violation of one run. Empty means the run found nothing.
struct Findings {
  std::string first;
  bool any() const { return !first.empty(); }
  void fail(const std::string& what) {
    if (first.empty()) first = what;
  }
};

// Largest extent the API accepts (validate.h keeps its own copy; the models here are written
// from the documented contract, not from the validation code).
inline constexpr int64_t kMaxExtent = (int64_t{1} << 31) - 1;

// Bytes of element addresses spanned by a view: 1 + sum (shape-1)*stride elements; 0 if empty.
// Returns -1 when the span is negative (negative strides) or does not fit comfortably.
inline int64_t span_bytes(const TensorView& t, int64_t elem) {
  if (t.ndim < 0 || t.ndim > kMaxDims) return -1;
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return -1;
    if (t.shape[d] == 0) return 0;
  }
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 1) continue;
    if (t.strides[d] < 0) return -1;
    int64_t extent_bytes;
    if (__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &extent_bytes)) return -1;
    if (extent_bytes > (int64_t{1} << 40)) return -1;
    last += extent_bytes;
    if (last > (int64_t{1} << 40)) return -1;
  }
  return (last + 1) * elem;
}

// Bytes of a cache up to its last page's last token: the fuzz targets allocate exactly that, so
// even the padding after the last page lies outside the block.
inline size_t exact_cache_bytes(const KVCache& kv) {
  return kv.num_pages <= 0 ? 0
                           : static_cast<size_t>((kv.num_pages - 1) * kv.page_stride +
                                                 kv.page_size * kv.bytes_per_token());
}

inline size_t elem_size(DType d) {
  switch (d) {
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return 1;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
  }
  return 0;
}

}  // namespace sparse_mla::fuzz
