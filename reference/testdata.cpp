#include "reference/testdata.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "src/kv/format.h"

namespace sparse_mla::ref {

// ---- Rng ----
namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

double Rng::normal() {
  // Box-Muller; 1 - u keeps the log argument in (0, 1].
  const double u = 1.0 - uniform();
  const double v = uniform();
  return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * M_PI * v);
}

int64_t Rng::below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
int64_t Rng::between(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }

// ---- Reference conversions ----
namespace {

// Rounds |x| (finite, >= 0) to a binary format with p significant bits and smallest normal
// exponent emin (round to nearest even, subnormals included). Exact in double for our formats.
double round_magnitude(double a, int p, int emin) {
  if (a == 0) return 0;
  int k;
  std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1)
  const int e = std::max(k - 1, emin);
  const double quantum = std::ldexp(1.0, e - (p - 1));
  return std::nearbyint(a / quantum) * quantum;  // default rounding mode: ties to even
}

// Bit pattern of a non-negative value exactly representable in the format (p significant bits,
// exponent bias `bias`, smallest normal exponent 1 - bias).
uint32_t encode_magnitude(double v, int p, int bias) {
  const int emin = 1 - bias;
  if (v < std::ldexp(1.0, emin)) {
    return static_cast<uint32_t>(v /
                                 std::ldexp(1.0, emin - (p - 1)));  // may be 2^(p-1): min normal
  }
  int k;
  std::frexp(v, &k);
  const int e = k - 1;
  const uint32_t man = static_cast<uint32_t>((std::ldexp(v, -e) - 1.0) * std::ldexp(1.0, p - 1));
  return (static_cast<uint32_t>(e + bias) << (p - 1)) | man;
}

uint16_t to_ieee16(double x, int p, int bias, int exp_bits) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const uint16_t exp_all = static_cast<uint16_t>(((1u << exp_bits) - 1) << (p - 1));
  if (std::isnan(x)) return static_cast<uint16_t>(sign | exp_all | (1u << (p - 2)));
  const double a = std::fabs(x);
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -(p - 1)), (1 << exp_bits) - 2 - bias);
  if (std::isinf(a)) return sign | exp_all;
  const double r = round_magnitude(a, p, 1 - bias);
  if (r > max_finite) return sign | exp_all;
  return static_cast<uint16_t>(sign | encode_magnitude(r, p, bias));
}

}  // namespace

uint8_t ref_float_to_e4m3(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  const double r = round_magnitude(std::fabs(x), 4, -6);
  if (r >= 448.0) return sign | 0x7e;  // saturate (also catches inf)
  return static_cast<uint8_t>(sign | encode_magnitude(r, 4, 7));
}

uint16_t ref_float_to_bf16(double x) { return to_ieee16(x, 8, 127, 8); }
uint16_t ref_float_to_fp16(double x) { return to_ieee16(x, 11, 15, 5); }

int ref_scale_exponent(float amax) {
  float s = amax / 448.0f;
  if (!(s >= 1e-4f)) s = 1e-4f;
  if (std::isinf(s)) return 127;
  int k;
  const double f = std::frexp(static_cast<double>(s), &k);
  const int e = f == 0.5 ? k - 1 : k;  // ceil(log2 s)
  return std::min(e, 127);
}

// ---- HostTensor ----
namespace {

int64_t pad_elems(DType dtype) { return 16 / static_cast<int64_t>(dtype_size(dtype)); }

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t stride = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    s[d] = stride;
    stride *= shape[d];
  }
  return s;
}

double read_scalar(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return *static_cast<const uint8_t*>(p);
    case DType::kInt32:
      return *static_cast<const int32_t*>(p);
    case DType::kFloat32:
      return *static_cast<const float*>(p);
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return fmt::bf16_to_float(h);
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return fmt::fp16_to_float(h);
    }
  }
  return 0;
}

void write_scalar(void* p, DType dtype, double v) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      *static_cast<uint8_t*>(p) = static_cast<uint8_t>(v);
      break;
    case DType::kInt32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(v);
      break;
    case DType::kFloat32:
      *static_cast<float*>(p) = static_cast<float>(v);
      break;
    case DType::kBFloat16: {
      const uint16_t h = ref_float_to_bf16(v);
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::kFloat16: {
      const uint16_t h = ref_float_to_fp16(v);
      std::memcpy(p, &h, 2);
      break;
    }
  }
}

size_t blocks_for(size_t bytes) { return (bytes + 63) / 64; }

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides)
    : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
  int64_t max_offset = 0;
  bool empty = false;
  for (size_t d = 0; d < shape_.size(); ++d) {
    if (shape_[d] == 0) empty = true;
    max_offset += (shape_[d] - 1) * strides_[d];
  }
  const size_t bytes = empty ? 0 : static_cast<size_t>(max_offset + 1) * dtype_size(dtype_);
  storage_.resize(std::max<size_t>(blocks_for(bytes), 1));
  fill_bytes(0);
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

void* HostTensor::data() { return storage_.data(); }
const void* HostTensor::data() const { return storage_.data(); }

TensorView HostTensor::view() const {
  TensorView t;
  t.data = const_cast<void*>(data());
  t.dtype = dtype_;
  t.device = Device{};
  t.ndim = ndim();
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = shape_[d];
    t.strides[d] = strides_[d];
  }
  return t;
}

std::optional<TensorView> HostTensor::opt_view() const {
  if (!defined()) return std::nullopt;
  return view();
}

int64_t HostTensor::offset(std::initializer_list<int64_t> index) const {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) off += i * strides_[d++];
  return off;
}

double HostTensor::get(std::initializer_list<int64_t> index) const {
  return read_scalar(static_cast<const uint8_t*>(data()) + offset(index) * dtype_size(dtype_),
                     dtype_);
}

void HostTensor::set(std::initializer_list<int64_t> index, double value) {
  write_scalar(static_cast<uint8_t*>(data()) + offset(index) * dtype_size(dtype_), dtype_, value);
}

void HostTensor::fill(double value) {
  uint8_t* base = static_cast<uint8_t*>(data());
  const size_t es = dtype_size(dtype_);
  for_each_index([&](const std::vector<int64_t>& idx) {
    int64_t off = 0;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * strides_[d];
    write_scalar(base + off * es, dtype_, value);
  });
}

std::vector<uint8_t> output_bytes(const HostTensor& out, const HostTensor& lse) {
  std::vector<uint8_t> bytes;
  for (const HostTensor* t : {&out, &lse}) {
    const auto* base = static_cast<const uint8_t*>(t->data());
    const size_t es = dtype_size(t->dtype());
    t->for_each_index([&](const std::vector<int64_t>& idx) {
      int64_t off = 0;
      for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t->strides()[d];
      bytes.insert(bytes.end(), base + off * es, base + (off + 1) * es);
    });
  }
  return bytes;
}

void HostTensor::fill_bytes(uint8_t byte) {
  std::memset(storage_.data(), byte, storage_.size() * sizeof(detail::AlignedBlock));
}

HostTensor make_tensor(DType dtype, std::vector<int64_t> shape, Layout layout) {
  const int n = static_cast<int>(shape.size());
  std::vector<int64_t> strides = contiguous_strides(shape);
  const int64_t pad = pad_elems(dtype);
  if (layout == Layout::kPadded && n > 1) {
    strides[n - 1] = 1;
    for (int d = n - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1] + pad;
  } else if (layout == Layout::kTransposed && n > 1) {
    strides[n - 1] = 1;
    int64_t running = shape[n - 1] + pad;
    for (int d = 0; d <= n - 2; ++d) {
      strides[d] = running;
      running = running * shape[d] + pad;
    }
  }
  return HostTensor(dtype, std::move(shape), std::move(strides));
}

HostTensor make_tensor_strided(DType dtype, std::vector<int64_t> shape,
                               std::vector<int64_t> strides) {
  return HostTensor(dtype, std::move(shape), std::move(strides));
}

HostTensor make_int_tensor(const std::vector<int32_t>& values) {
  HostTensor t = make_tensor(DType::kInt32, {static_cast<int64_t>(values.size())});
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * 4);
  return t;
}

HostTensor make_float_tensor(const std::vector<float>& values) {
  HostTensor t = make_tensor(DType::kFloat32, {static_cast<int64_t>(values.size())});
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * 4);
  return t;
}

HostTensor random_tensor(Rng& rng, DType dtype, std::vector<int64_t> shape, double lo, double hi,
                         Layout layout) {
  HostTensor t = make_tensor(dtype, std::move(shape), layout);
  t.fill_bytes(0xff);  // gaps between elements hold NaN for the float dtypes
  uint8_t* base = static_cast<uint8_t*>(t.data());
  const size_t es = dtype_size(dtype);
  t.for_each_index([&](const std::vector<int64_t>& idx) {
    int64_t off = 0;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
    write_scalar(base + off * es, dtype, rng.uniform(lo, hi));
  });
  return t;
}

double load(const TensorView& t, const int64_t* index) {
  int64_t off = 0;
  for (int d = 0; d < t.ndim; ++d) off += index[d] * t.strides[d];
  return read_scalar(static_cast<const uint8_t*>(t.data) + off * dtype_size(t.dtype), t.dtype);
}

double load(const TensorView& t, std::initializer_list<int64_t> index) {
  return load(t, std::data(index));
}

// ---- Caches ----
int64_t default_page_stride(KVFormat format, int64_t page_size, int64_t num_heads) {
  if (format == KVFormat::kModel1) {
    const int64_t bytes = page_size * kModel1BytesPerToken;
    return (bytes + kModel1RowBytes - 1) / kModel1RowBytes * kModel1RowBytes;
  }
  const int64_t bytes = page_size * kv_format_bytes_per_token(format, num_heads);
  return (bytes + 15) / 16 * 16;
}

HostCache::HostCache(const CacheConfig& config) : config_(config) {
  if (kv_format_is_fp8(config_.format)) config_.num_heads = 1;
  if (config_.page_stride == 0) {
    config_.page_stride = default_page_stride(config_.format, config_.page_size, config_.num_heads);
  }
  bytes_ = static_cast<size_t>(config_.num_pages * config_.page_stride);
  storage_.resize(std::max<size_t>(blocks_for(bytes_), 1));
  std::memset(storage_.data(), 0xff, storage_.size() * sizeof(detail::AlignedBlock));
}

KVCache HostCache::desc() const {
  KVCache c;
  c.data = const_cast<detail::AlignedBlock*>(storage_.data());
  c.device = Device{};
  c.format = config_.format;
  c.num_pages = config_.num_pages;
  c.page_size = config_.page_size;
  c.page_stride = config_.page_stride;
  c.num_heads = config_.num_heads;
  return c;
}

TensorView HostCache::tensor() const {
  const KVFormat f = config_.format;
  const bool fp8 = kv_format_is_fp8(f);
  const DType dtype =
      fp8 ? DType::kUInt8 : (f == KVFormat::kBF16 ? DType::kBFloat16 : DType::kFloat16);
  const int64_t last = f == KVFormat::kModel1 ? kModel1BytesPerToken
                       : f == KVFormat::kV32  ? kV32BytesPerToken
                                              : kDenseHeadDim;
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  return TensorView::strided(desc().data, dtype, Device{},
                             {config_.num_pages, config_.page_size, config_.num_heads, last},
                             {config_.page_stride / elem, config_.num_heads * last, last, 1});
}

uint8_t* HostCache::page(int64_t p) {
  return reinterpret_cast<uint8_t*>(storage_.data()) + p * config_.page_stride;
}

namespace {

uint8_t* slot_base(const KVCache& c, int64_t slot) {
  return static_cast<uint8_t*>(c.data) + (slot / c.page_size) * c.page_stride;
}

// Quantizes `n` values in tiles of `tile` with the reference recipe; returns scale exponents.
void quantize_tiles(const float* v, int n, int tile, uint8_t* codes, int* exps) {
  for (int j = 0; j < n / tile; ++j) {
    float amax = 0.f;
    for (int i = 0; i < tile; ++i) amax = std::max(amax, std::fabs(v[j * tile + i]));
    const int e = ref_scale_exponent(amax);
    exps[j] = e;
    for (int i = 0; i < tile; ++i) {
      codes[j * tile + i] = ref_float_to_e4m3(std::ldexp(static_cast<double>(v[j * tile + i]), -e));
    }
  }
}

void store_bf16(uint8_t* dst, double v) {
  const uint16_t h = ref_float_to_bf16(v);
  std::memcpy(dst, &h, 2);
}

}  // namespace

void write_row(HostCache& cache, int64_t slot, int64_t head, const float* values) {
  const KVCache c = cache.desc();
  uint8_t* base = slot_base(c, slot);
  const int64_t t = slot % c.page_size;
  switch (c.format) {
    case KVFormat::kModel1: {
      uint8_t* row = base + fmt::model1_row_offset(t);
      uint8_t* scales = base + fmt::model1_scale_offset(c.page_size, t);
      int exps[kModel1NopeDims / kModel1ScaleTile];
      quantize_tiles(values, kModel1NopeDims, kModel1ScaleTile, row, exps);
      for (int j = 0; j < kModel1NopeDims / kModel1ScaleTile; ++j) {
        scales[j] = static_cast<uint8_t>(exps[j] + 127);
      }
      scales[7] = 0;
      for (int i = 0; i < kRopeDims; ++i) {
        store_bf16(row + kModel1NopeDims + 2 * i, values[kModel1NopeDims + i]);
      }
      break;
    }
    case KVFormat::kV32: {
      uint8_t* row = base + t * kV32BytesPerToken;
      int exps[kV32NopeDims / kV32ScaleTile];
      quantize_tiles(values, kV32NopeDims, kV32ScaleTile, row, exps);
      for (int j = 0; j < kV32NopeDims / kV32ScaleTile; ++j) {
        const float scale = static_cast<float>(std::ldexp(1.0, exps[j]));
        std::memcpy(row + fmt::kV32ScaleOffset + 4 * j, &scale, 4);
      }
      for (int i = 0; i < kRopeDims; ++i) {
        store_bf16(row + fmt::kV32RopeOffset + 2 * i, values[kV32NopeDims + i]);
      }
      break;
    }
    case KVFormat::kBF16:
    case KVFormat::kFP16: {
      uint8_t* row = base + (t * c.num_heads + head) * kDenseHeadDim * 2;
      for (int i = 0; i < kDenseHeadDim; ++i) {
        const uint16_t h = c.format == KVFormat::kBF16 ? ref_float_to_bf16(values[i])
                                                       : ref_float_to_fp16(values[i]);
        std::memcpy(row + 2 * i, &h, 2);
      }
      break;
    }
  }
}

void read_row(const KVCache& c, int64_t slot, int64_t head, double* values) {
  const uint8_t* base = slot_base(c, slot);
  const int64_t t = slot % c.page_size;
  auto bf16_at = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<double>(fmt::bf16_to_float(h));
  };
  switch (c.format) {
    case KVFormat::kModel1: {
      const uint8_t* row = base + fmt::model1_row_offset(t);
      const uint8_t* scales = base + fmt::model1_scale_offset(c.page_size, t);
      for (int i = 0; i < kModel1NopeDims; ++i) {
        values[i] = static_cast<double>(fmt::e4m3_to_float(row[i])) *
                    fmt::ue8m0_to_float(scales[i / kModel1ScaleTile]);
      }
      for (int i = 0; i < kRopeDims; ++i) {
        values[kModel1NopeDims + i] = bf16_at(row + kModel1NopeDims + 2 * i);
      }
      break;
    }
    case KVFormat::kV32: {
      const uint8_t* row = base + t * kV32BytesPerToken;
      float scales[4];
      std::memcpy(scales, row + fmt::kV32ScaleOffset, 16);
      for (int i = 0; i < kV32NopeDims; ++i) {
        values[i] = static_cast<double>(fmt::e4m3_to_float(row[i])) * scales[i / kV32ScaleTile];
      }
      for (int i = 0; i < kRopeDims; ++i) {
        values[kV32NopeDims + i] = bf16_at(row + fmt::kV32RopeOffset + 2 * i);
      }
      break;
    }
    case KVFormat::kBF16:
    case KVFormat::kFP16: {
      const uint8_t* row = base + (t * c.num_heads + head) * kDenseHeadDim * 2;
      for (int i = 0; i < kDenseHeadDim; ++i) {
        uint16_t h;
        std::memcpy(&h, row + 2 * i, 2);
        values[i] = c.format == KVFormat::kBF16 ? fmt::bf16_to_float(h) : fmt::fp16_to_float(h);
      }
      break;
    }
  }
}

void random_row(Rng& rng, int d, float* values) {
  for (int i = 0; i < d; ++i) {
    values[i] = static_cast<float>(std::clamp(0.1 * rng.normal(), -1.0, 1.0));
  }
}

void fill_random(HostCache& cache, Rng& rng, const std::vector<bool>& which, int scale_log2) {
  const int d = cache.d_qk();
  std::vector<float> row(d);
  for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
    if (!which.empty() && !which[slot]) continue;
    for (int64_t h = 0; h < cache.config().num_heads; ++h) {
      random_row(rng, d, row.data());
      for (float& x : row) x = std::ldexp(x, scale_log2);
      write_row(cache, slot, h, row.data());
    }
  }
}

void scale_v32_scales(HostCache& cache, Rng& rng, const std::vector<bool>& which) {
  const KVCache c = cache.desc();
  for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
    if (!which.empty() && !which[slot]) continue;
    uint8_t* scales = slot_base(c, slot) + (slot % c.page_size) * kV32BytesPerToken +
                      fmt::kV32ScaleOffset;
    for (int j = 0; j < kV32NopeDims / kV32ScaleTile; ++j) {
      float s;
      std::memcpy(&s, scales + 4 * j, 4);
      s *= static_cast<float>(rng.uniform(0.5, 1.0));
      std::memcpy(scales + 4 * j, &s, 4);
    }
  }
}

int64_t minus_inf_dim(KVFormat format) {
  return (format == KVFormat::kV32 ? kV32NopeDims : kModel1NopeDims) + 5;
}

void write_minus_inf_row(HostCache& cache, Rng& rng, int64_t slot) {
  const KVCache c = cache.desc();
  std::vector<float> row(kv_format_d_qk(c.format));
  for (int64_t h = 0; h < c.num_heads; ++h) {
    random_row(rng, static_cast<int>(row.size()), row.data());
    row[minus_inf_dim(c.format)] = -std::numeric_limits<float>::infinity();
    write_row(cache, slot, h, row.data());
  }
}

void poison_slot(HostCache& cache, int64_t slot) {
  const KVCache c = cache.desc();
  uint8_t* base = slot_base(c, slot);
  const int64_t t = slot % c.page_size;
  switch (c.format) {
    case KVFormat::kModel1:
      std::memset(base + fmt::model1_row_offset(t), 0xff, kModel1RowBytes);
      std::memset(base + fmt::model1_scale_offset(c.page_size, t), 0xff, kModel1ScaleBytes);
      break;
    case KVFormat::kV32:
      std::memset(base + t * kV32BytesPerToken, 0xff, kV32BytesPerToken);
      break;
    case KVFormat::kBF16:
    case KVFormat::kFP16: {
      const int64_t row_bytes = c.num_heads * kDenseHeadDim * 2;
      std::memset(base + t * row_bytes, 0xff, row_bytes);
      break;
    }
  }
}

void poison_unreferenced(HostCache& cache, const std::vector<bool>& referenced) {
  for (int64_t slot = 0; slot < cache.num_slots(); ++slot) {
    if (!referenced[slot]) poison_slot(cache, slot);
  }
}

// ---- Indices, lengths, block tables ----
namespace {

int32_t out_of_range_value(Rng& rng, int64_t num_slots) {
  switch (rng.below(5)) {
    case 0:
      return static_cast<int32_t>(num_slots);
    case 1:
      return static_cast<int32_t>(num_slots + rng.below(1000));
    case 2:
      return static_cast<int32_t>(-2 - rng.below(1000));
    case 3:
      return std::numeric_limits<int32_t>::max();
    default:
      return std::numeric_limits<int32_t>::min();
  }
}

// k distinct values from [lo, hi), random order.
std::vector<int64_t> sample_distinct(Rng& rng, int64_t lo, int64_t hi, int64_t k) {
  const int64_t n = hi - lo;
  std::vector<int64_t> out;
  out.reserve(k);
  if (k * 4 < n) {
    std::unordered_set<int64_t> seen;
    while (static_cast<int64_t>(out.size()) < k) {
      const int64_t v = lo + rng.below(n);
      if (seen.insert(v).second) out.push_back(v);
    }
  } else {
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), lo);
    for (int64_t i = 0; i < k; ++i) {
      std::swap(all[i], all[i + rng.below(n - i)]);
      out.push_back(all[i]);
    }
  }
  return out;
}

}  // namespace

HostTensor random_indices(Rng& rng, int64_t b, int64_t s_q, int64_t topk, int64_t num_slots,
                          const IndexConfig& config,
                          const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  HostTensor t = make_tensor(DType::kInt32, {b, s_q, topk}, config.layout);
  t.fill_bytes(0x7f);  // gaps hold huge slots: a kernel that reads them goes out of range
  for (int64_t i = 0; i < b; ++i) {
    const int64_t lo = ranges.empty() ? 0 : ranges[i].first;
    const int64_t hi = ranges.empty() ? num_slots : ranges[i].second;
    for (int64_t s = 0; s < s_q; ++s) {
      const std::vector<int64_t> slots = sample_distinct(rng, lo, hi, std::min(topk, hi - lo));
      for (int64_t k = 0; k < topk; ++k) {
        int64_t v = k < static_cast<int64_t>(slots.size()) ? slots[k] : -1;
        if (v >= 0) {
          const double u = rng.uniform();
          if (u < config.invalid_fraction) {
            v = -1;
          } else if (u < config.invalid_fraction + config.out_of_range_fraction) {
            v = out_of_range_value(rng, num_slots);
          }
        }
        t.set({i, s, k}, static_cast<double>(v));
      }
    }
  }
  return t;
}

HostTensor random_block_table(Rng& rng, int64_t b, int64_t max_pages, int64_t num_pages) {
  std::vector<int64_t> perm = sample_distinct(rng, 0, num_pages, num_pages);
  HostTensor t = make_tensor(DType::kInt32, {b, max_pages});
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t p = 0; p < max_pages; ++p) {
      t.set({i, p}, static_cast<double>(perm[(i * max_pages + p) % num_pages]));
    }
  }
  return t;
}

std::vector<bool> sparse_referenced_slots(const TensorView& indices,
                                          const std::optional<TensorView>& lengths,
                                          int64_t num_slots) {
  std::vector<bool> ref(num_slots, false);
  const int64_t b = indices.shape[0], s_q = indices.shape[1], topk = indices.shape[2];
  for (int64_t i = 0; i < b; ++i) {
    int64_t len = topk;
    if (lengths) len = std::clamp<int64_t>(static_cast<int64_t>(load(*lengths, {i})), 0, topk);
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t k = 0; k < len; ++k) {
        const int64_t v = static_cast<int64_t>(load(indices, {i, s, k}));
        if (v >= 0 && v < num_slots) ref[v] = true;
      }
    }
  }
  return ref;
}

std::vector<bool> dense_referenced_slots(const TensorView& block_table,
                                         const TensorView& cache_seqlens, int64_t page_size,
                                         int64_t num_pages) {
  std::vector<bool> ref(num_pages * page_size, false);
  const int64_t b = block_table.shape[0], max_pages = block_table.shape[1];
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = std::clamp<int64_t>(static_cast<int64_t>(load(cache_seqlens, {i})), 0,
                                            max_pages * page_size);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t page = static_cast<int64_t>(load(block_table, {i, t / page_size}));
      if (page >= 0 && page < num_pages) ref[page * page_size + t % page_size] = true;
    }
  }
  return ref;
}

HostTensor make_out(DType dtype, int64_t b, int64_t s_q, int64_t h_q, int64_t d_v, Layout layout) {
  HostTensor t = make_tensor(dtype, {b, s_q, h_q, d_v}, layout);
  t.fill_bytes(0xff);
  return t;
}

HostTensor make_lse(int64_t b, int64_t h_q, int64_t s_q, bool flash_sparse_layout) {
  HostTensor t = flash_sparse_layout
                     ? make_tensor_strided(DType::kFloat32, {b, h_q, s_q}, {s_q * h_q, 1, h_q})
                     : make_tensor(DType::kFloat32, {b, h_q, s_q});
  t.fill_bytes(0xff);
  return t;
}

// ---- Whole problems ----
namespace {

HostTensor random_lengths(Rng& rng, int64_t b, int64_t topk) {
  std::vector<int32_t> v(b);
  for (auto& x : v) x = static_cast<int32_t>(rng.between(0, topk + 2));
  return make_int_tensor(v);
}

// Builds a cache whose requests own private slot ranges (or share one pool).
HostCache make_sparse_cache(KVFormat format, int64_t b, int64_t topk, int64_t page_size,
                            int64_t page_stride, int64_t slots_per_request, bool shared,
                            std::vector<std::pair<int64_t, int64_t>>* ranges) {
  const int64_t spr = slots_per_request > 0 ? slots_per_request : std::max(2 * topk, topk + 16);
  const int64_t pages_per_request = (spr + page_size - 1) / page_size;
  const int64_t num_pages = shared ? pages_per_request : b * pages_per_request;
  ranges->clear();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t lo = shared ? 0 : i * pages_per_request * page_size;
    ranges->emplace_back(lo, lo + spr);
  }
  return HostCache(CacheConfig{format, num_pages, page_size, 1, page_stride});
}

}  // namespace

float default_softmax_scale(KVFormat format) {
  return static_cast<float>(std::pow(kv_format_d_qk(format), -0.55));
}

namespace {

// The range of value_scale_log2 whose values each format holds exactly (random rows within
// [-1, 1], most above 1e-3): FP8 pages not below the quantizer's smallest scale, fp16 not past
// its normal range, nothing past fp32 sums of up to 2^8 P a token.
void check_value_scale(KVFormat format, int k) {
  int lo = -60, hi = 60;
  if (kv_format_is_fp8(format)) lo = 0;
  if (format == KVFormat::kFP16) lo = -4, hi = 15;
  if (k < lo || k > hi) {
    throw std::invalid_argument("value_scale_log2 " + std::to_string(k) + " outside [" +
                                std::to_string(lo) + ", " + std::to_string(hi) + "] for " +
                                kv_format_name(format));
  }
}

}  // namespace

SparseCase make_sparse_case(const SparseCaseConfig& cfg) {
  check_value_scale(cfg.format, cfg.value_scale_log2);
  Rng rng(cfg.seed);
  SparseCase c;
  c.config = cfg;
  const int d_qk = kv_format_d_qk(cfg.format);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  c.kv = make_sparse_cache(cfg.format, cfg.b, cfg.topk, cfg.page_size, cfg.page_stride,
                           cfg.slots_per_request, cfg.shared_slots, &ranges);
  c.q = random_tensor(rng, DType::kBFloat16, {cfg.b, cfg.s_q, cfg.h_q, d_qk}, -1, 1, cfg.q_layout);
  c.indices = random_indices(rng, cfg.b, cfg.s_q, cfg.topk, c.kv.num_slots(), cfg.index, ranges);
  if (cfg.use_topk_length) c.topk_length = random_lengths(rng, cfg.b, cfg.topk);
  if (cfg.use_extra) {
    c.extra_kv = make_sparse_cache(cfg.format, cfg.b, cfg.extra_topk, cfg.extra_page_size,
                                   cfg.extra_page_stride, cfg.extra_slots_per_request,
                                   cfg.shared_slots, &ranges);
    c.extra_indices = random_indices(rng, cfg.b, cfg.s_q, cfg.extra_topk, c.extra_kv.num_slots(),
                                     cfg.extra_index, ranges);
    if (cfg.use_extra_topk_length) {
      c.extra_topk_length = random_lengths(rng, cfg.b, cfg.extra_topk);
    }
  }
  if (cfg.use_sink) {
    std::vector<float> sink(cfg.h_q);
    for (auto& x : sink) x = static_cast<float>(rng.normal());
    c.attn_sink = make_float_tensor(sink);
  }
  c.softmax_scale = cfg.softmax_scale.value_or(default_softmax_scale(cfg.format));
  c.out = make_out(DType::kBFloat16, cfg.b, cfg.s_q, cfg.h_q, kDV, cfg.out_layout);
  c.lse = make_lse(cfg.b, cfg.h_q, cfg.s_q, cfg.flash_lse_layout);
  c.refresh_cache(rng);
  return c;
}

SparseDecodeArgs SparseCase::args() const {
  SparseDecodeArgs a;
  a.q = q.view();
  a.kv = kv.desc();
  a.indices = indices.view();
  a.topk_length = topk_length.opt_view();
  if (extra_kv.defined()) {
    a.extra_kv = extra_kv.desc();
    a.extra_indices = extra_indices.opt_view();
    a.extra_topk_length = extra_topk_length.opt_view();
  }
  a.attn_sink = attn_sink.opt_view();
  a.softmax_scale = softmax_scale;
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

void SparseCase::poison_outputs() {
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
}

void SparseCase::refresh_cache(Rng& rng) {
  auto refresh = [&](HostCache& cache, const HostTensor& idx, const HostTensor& len) {
    std::vector<bool> ref;  // empty: every slot
    if (config.poison_unreferenced) {
      ref = sparse_referenced_slots(idx.view(), len.opt_view(), cache.num_slots());
    }
    fill_random(cache, rng, ref, config.value_scale_log2);
    if (config.v32_scales_not_pow2 && config.format == KVFormat::kV32) {
      scale_v32_scales(cache, rng, ref);
    }
    if (config.poison_unreferenced) poison_unreferenced(cache, ref);
  };
  refresh(kv, indices, topk_length);
  if (extra_kv.defined()) refresh(extra_kv, extra_indices, extra_topk_length);
}

DenseCase make_dense_case(const DenseCaseConfig& cfg) {
  check_value_scale(cfg.format, cfg.value_scale_log2);
  Rng rng(cfg.seed);
  DenseCase c;
  c.config = cfg;
  const int d_qk = kv_format_d_qk(cfg.format);
  const int64_t h_kv = kv_format_is_fp8(cfg.format) ? 1 : cfg.h_kv;
  std::vector<int32_t> seqlens = cfg.seqlens;
  if (seqlens.empty()) {
    for (int64_t i = 0; i < cfg.b; ++i) {
      seqlens.push_back(static_cast<int32_t>(rng.between(1, 2 * cfg.mean_seqlen)));
    }
  }
  int64_t longest = 1;
  for (int32_t s : seqlens) longest = std::max<int64_t>(longest, s);
  const int64_t max_pages =
      cfg.max_pages > 0 ? cfg.max_pages : (longest + cfg.page_size - 1) / cfg.page_size;
  const int64_t num_pages = cfg.b * max_pages + cfg.extra_pages;
  c.kv = HostCache(CacheConfig{cfg.format, num_pages, cfg.page_size, h_kv, cfg.page_stride});
  const DType qt = cfg.format == KVFormat::kFP16 ? DType::kFloat16 : DType::kBFloat16;
  c.q = random_tensor(rng, qt, {cfg.b, cfg.s_q, cfg.h_q, d_qk}, -1, 1, cfg.q_layout);
  c.block_table = random_block_table(rng, cfg.b, max_pages, num_pages);
  c.cache_seqlens = make_int_tensor(seqlens);
  c.softmax_scale = cfg.softmax_scale.value_or(default_softmax_scale(cfg.format));
  c.out = make_out(qt, cfg.b, cfg.s_q, cfg.h_q, kDV, cfg.out_layout);
  c.lse = make_lse(cfg.b, cfg.h_q, cfg.s_q);
  c.refresh_cache(rng);
  return c;
}

DenseDecodeArgs DenseCase::args() const {
  DenseDecodeArgs a;
  a.q = q.view();
  a.kv = kv.desc();
  a.block_table = block_table.view();
  a.cache_seqlens = cache_seqlens.view();
  a.causal = config.causal;
  a.softmax_scale = softmax_scale;
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

void DenseCase::poison_outputs() {
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
}

void DenseCase::refresh_cache(Rng& rng) {
  if (!config.poison_unreferenced) {
    fill_random(kv, rng, {}, config.value_scale_log2);
    return;
  }
  const std::vector<bool> ref = dense_referenced_slots(
      block_table.view(), cache_seqlens.view(), kv.config().page_size, kv.config().num_pages);
  fill_random(kv, rng, ref, config.value_scale_log2);
  poison_unreferenced(kv, ref);
}

MergeCase make_merge_case(const MergeCaseConfig& cfg) {
  Rng rng(cfg.seed);
  MergeCase c;
  c.config = cfg;
  c.out_parts =
      random_tensor(rng, cfg.parts_dtype, {cfg.n, cfg.b, cfg.s_q, cfg.h_q, cfg.d_v}, -1, 1);
  c.lse_parts = random_tensor(rng, DType::kFloat32, {cfg.n, cfg.b, cfg.s_q, cfg.h_q}, 0, 8);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t p = 0; p < cfg.n; ++p) {
    for (int64_t i = 0; i < cfg.b; ++i) {
      for (int64_t s = 0; s < cfg.s_q; ++s) {
        for (int64_t h = 0; h < cfg.h_q; ++h) {
          if (rng.uniform() >= cfg.empty_fraction) continue;
          const double inf = std::numeric_limits<double>::infinity();
          c.lse_parts.set({p, i, s, h}, rng.below(2) ? inf : -inf);
          for (int64_t d = 0; d < cfg.d_v; ++d) c.out_parts.set({p, i, s, h, d}, nan);
        }
      }
    }
  }
  if (cfg.use_sink) {
    std::vector<float> sink(cfg.h_q);
    for (auto& x : sink) x = static_cast<float>(rng.normal() + 4.0);
    c.attn_sink = make_float_tensor(sink);
  }
  c.out = make_out(cfg.out_dtype, cfg.b, cfg.s_q, cfg.h_q, cfg.d_v);
  c.lse = make_lse(cfg.b, cfg.h_q, cfg.s_q);
  return c;
}

MergeArgs MergeCase::args() const {
  MergeArgs a;
  a.out_parts = out_parts.view();
  a.lse_parts = lse_parts.view();
  a.attn_sink = attn_sink.opt_view();
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

void MergeCase::poison_outputs() {
  out.fill_bytes(0xff);
  lse.fill_bytes(0xff);
}

}  // namespace sparse_mla::ref
