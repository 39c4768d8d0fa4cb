// Owned host test data for tests, the `sparse-mla` command line and benchmarks: paged caches filled
// by a reference quantizer (spec section 2), queries, indices, lengths, sinks, block tables and
// NaN-poisoned outputs, each exposed as a TensorView / KVCache over buffers it owns.
// Test and tool code only; never part of the library.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "sparse_mla/kv_cache.h"
#include "sparse_mla/ops.h"
#include "sparse_mla/tensor.h"

namespace sparse_mla::ref {

namespace detail {
// 64-byte aligned storage unit: std::vector honours over-alignment, and copies keep the layout.
struct alignas(64) AlignedBlock {
  unsigned char bytes[64];
};
}  // namespace detail

// Deterministic across platforms and standard libraries (xoshiro256**, Box-Muller).
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  double uniform();                         // [0, 1)
  double uniform(double lo, double hi);     // [lo, hi)
  double normal();                          // N(0, 1)
  int64_t below(int64_t n);                 // [0, n), n >= 1
  int64_t between(int64_t lo, int64_t hi);  // [lo, hi]

 private:
  uint64_t s_[4];
};

// ---- Reference scalar conversions (independent of src/kv/format.h) ----
// Round to nearest even. e4m3 saturates to +-448; NaN gives 0x7f (sign kept).
uint8_t ref_float_to_e4m3(double x);
uint16_t ref_float_to_bf16(double x);
uint16_t ref_float_to_fp16(double x);
// The spec recipe on a tile's amax (computed in fp32 as engines do): log2 of the power-of-two
// scale.
int ref_scale_exponent(float amax);

// ---- Host tensors ----
enum class Layout {
  kContiguous,
  kPadded,      // same order, every outer stride padded by 16 bytes (last dim contiguous)
  kTransposed,  // outer dims stored in reverse order, padded (last dim contiguous)
};

// An owned, 64-byte aligned host array with explicit strides (in elements). Copyable: views are
// built on demand, so copies never alias.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides);

  bool defined() const { return !shape_.empty(); }
  DType dtype() const { return dtype_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const;
  void* data();
  const void* data() const;
  TensorView view() const;
  std::optional<TensorView> opt_view() const;  // nullopt when undefined

  int64_t offset(std::initializer_list<int64_t> index) const;    // in elements
  double get(std::initializer_list<int64_t> index) const;        // any dtype, as double
  void set(std::initializer_list<int64_t> index, double value);  // rounds (RNE) to the dtype
  void fill(double value);                                       // every logical element
  void fill_bytes(uint8_t byte);  // the whole allocation, gaps between strided elements included
  // Calls f(index) for every logical element, index as a vector of ndim coordinates.
  template <typename F>
  void for_each_index(F&& f) const;

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_, strides_;
  std::vector<detail::AlignedBlock> storage_;
};

HostTensor make_tensor(DType dtype, std::vector<int64_t> shape,
                       Layout layout = Layout::kContiguous);
HostTensor make_tensor_strided(DType dtype, std::vector<int64_t> shape,
                               std::vector<int64_t> strides);
HostTensor make_int_tensor(const std::vector<int32_t>& values);  // [n] int32
HostTensor make_float_tensor(const std::vector<float>& values);  // [n] float32
// Uniform in [lo, hi), rounded to the dtype.
HostTensor random_tensor(Rng& rng, DType dtype, std::vector<int64_t> shape, double lo, double hi,
                         Layout layout = Layout::kContiguous);

// Reads element `index` of any host TensorView (its strides) as double.
double load(const TensorView& t, const int64_t* index);
double load(const TensorView& t, std::initializer_list<int64_t> index);

// ---- Paged caches ----
struct CacheConfig {
  KVFormat format = KVFormat::kModel1;
  int64_t num_pages = 1;
  int64_t page_size = 64;
  int64_t num_heads = 1;    // h_kv, dense formats only
  int64_t page_stride = 0;  // bytes; 0 = default_page_stride()
};

// MODEL1: the engine rule ceil(page_size*584/576)*576; others: the minimum rounded up to 16.
int64_t default_page_stride(KVFormat format, int64_t page_size, int64_t num_heads = 1);

class HostCache {
 public:
  HostCache() = default;
  explicit HostCache(const CacheConfig& config);  // every byte 0xFF (NaN) until written

  bool defined() const { return !storage_.empty(); }
  const CacheConfig& config() const { return config_; }
  KVCache desc() const;  // data points into this object
  // [num_pages, page_size, h_kv, 584|656|576] uint8 (FP8) or bf16/fp16 (dense), page stride kept.
  TensorView tensor() const;
  uint8_t* page(int64_t p);
  int64_t num_slots() const { return config_.num_pages * config_.page_size; }
  int d_qk() const { return kv_format_d_qk(config_.format); }
  size_t bytes() const { return bytes_; }

 private:
  CacheConfig config_;
  size_t bytes_ = 0;
  std::vector<detail::AlignedBlock> storage_;
};

// Stores one head of one slot from d_qk values (MODEL1: 448 quantized + 64 bf16; V32: 512
// quantized + 64 bf16; dense: rounded to bf16/fp16), quantizing with the reference recipe.
void write_row(HostCache& cache, int64_t slot, int64_t head, const float* values);
// Dequantizes one head of one slot into d_qk doubles with src/kv/format.h (any host KVCache).
void read_row(const KVCache& cache, int64_t slot, int64_t head, double* values);
// Random latent row: N(0, 0.1^2) clipped to [-1, 1].
void random_row(Rng& rng, int d, float* values);
// Writes random rows into every slot (all heads) where `which` is empty or which[slot] is true,
// each value times 2^scale_log2 (exact where the format holds the result: FP8 scales move by the
// same power, but not below the quantizer's smallest, 1e-4 / 448; fp16 pages keep ~2^-10..2^15).
void fill_random(HostCache& cache, Rng& rng, const std::vector<bool>& which = {},
                 int scale_log2 = 0);
// The dim of `format`'s rows that tests set to -inf: one stored in 16 bits (the FP8 formats' rope
// dim 5, inside V for MODEL1 and past it for V32; V dim 453 of the 16-bit formats).
int64_t minus_inf_dim(KVFormat format);
// Writes a random row (random_row) with -inf in minus_inf_dim into every head of `slot`: its logit
// is -inf for every query that is positive in that dim and finite elsewhere.
void write_minus_inf_row(HostCache& cache, Rng& rng, int64_t slot);
// Sets every byte of a slot (all heads, MODEL1 footer scales included) to 0xFF: NaN everywhere.
void poison_slot(HostCache& cache, int64_t slot);
void poison_unreferenced(HostCache& cache, const std::vector<bool>& referenced);

// ---- Indices, lengths, block tables ----
struct IndexConfig {
  double invalid_fraction = 0.0;       // entries set to -1
  double out_of_range_fraction = 0.0;  // entries set outside [0, num_slots) but not -1
  Layout layout = Layout::kContiguous;
};
// [b, s_q, topk] int32, distinct valid slots per (request, query token) row, drawn from [0,
// num_slots) or, with ranges, from request i's [ranges[i].first, ranges[i].second). When a range is
// smaller than topk, the rest of the row is -1.
HostTensor random_indices(Rng& rng, int64_t b, int64_t s_q, int64_t topk, int64_t num_slots,
                          const IndexConfig& config = {},
                          const std::vector<std::pair<int64_t, int64_t>>& ranges = {});
// [b, max_pages] int32 with distinct pages while they last (then reused), random order.
HostTensor random_block_table(Rng& rng, int64_t b, int64_t max_pages, int64_t num_pages);

// Which slots a sparse index tensor may make the kernel read (entries within the lengths,
// clamped to [0, topk], that fall inside [0, num_slots)).
std::vector<bool> sparse_referenced_slots(const TensorView& indices,
                                          const std::optional<TensorView>& lengths,
                                          int64_t num_slots);
// Which slots dense decode reads: t < clamp(seqlens[i]) through the block table.
std::vector<bool> dense_referenced_slots(const TensorView& block_table,
                                         const TensorView& cache_seqlens, int64_t page_size,
                                         int64_t num_pages);

// Output buffers poisoned with NaN. lse in the FlashMLA sparse layout: a [b, h_q, s_q] view of a
// contiguous [b, s_q, h_q] buffer.
HostTensor make_out(DType dtype, int64_t b, int64_t s_q, int64_t h_q, int64_t d_v = kDV,
                    Layout layout = Layout::kContiguous);
HostTensor make_lse(int64_t b, int64_t h_q, int64_t s_q, bool flash_sparse_layout = false);

// ---- Whole problems ----
struct SparseCaseConfig {
  KVFormat format = KVFormat::kModel1;
  int64_t b = 1, s_q = 1, h_q = 64;
  int64_t topk = 128;
  int64_t page_size = 64;
  int64_t page_stride = 0;        // 0 = default
  int64_t slots_per_request = 0;  // 0: max(2*topk, topk+16); slots of request i are private to it
  bool shared_slots = false;      // all requests draw from one pool of slots_per_request slots
  IndexConfig index;

  bool use_extra = false;
  int64_t extra_topk = 0;
  int64_t extra_page_size = 64;
  int64_t extra_page_stride = 0;
  int64_t extra_slots_per_request = 0;
  IndexConfig extra_index;

  bool use_topk_length = false;        // random lengths in [0, topk + 2] (clamping exercised)
  bool use_extra_topk_length = false;  // same for the extra cache
  bool use_sink = false;               // N(0, 1) per head
  std::optional<float> softmax_scale;  // nullopt: spec section 7's d_qk^-0.55
  // Cache values times 2^value_scale_log2 (outputs far from 1; with softmax_scale divided by the
  // same power the scores stay as they were).
  int value_scale_log2 = 0;
  // V32 only: every referenced slot's four fp32 scales times a factor in [0.5, 1), so that they
  // are not powers of two, as another quantizer than the spec's recipe may store them.
  bool v32_scales_not_pow2 = false;
  Layout q_layout = Layout::kContiguous;
  Layout out_layout = Layout::kContiguous;
  bool flash_lse_layout = false;
  // Fill only referenced slots with data and every other byte with NaN (fast for big caches).
  bool poison_unreferenced = true;
  uint64_t seed = 1;
};

struct SparseCase {
  SparseCaseConfig config;
  HostCache kv, extra_kv;
  HostTensor q, indices, extra_indices, topk_length, extra_topk_length, attn_sink, out, lse;
  std::optional<float> softmax_scale;

  // Views into this object (valid while it lives and is not moved).
  SparseDecodeArgs args() const;
  void poison_outputs();  // out and lse to NaN
  // After editing indices/lengths: fills newly referenced slots with random rows, NaN elsewhere.
  void refresh_cache(Rng& rng);
};
// Throws std::invalid_argument for a value_scale_log2 that the format cannot hold exactly.
SparseCase make_sparse_case(const SparseCaseConfig& config);

struct DenseCaseConfig {
  KVFormat format = KVFormat::kBF16;
  int64_t b = 1, s_q = 1, h_q = 16, h_kv = 1;
  int64_t page_size = 64;
  int64_t page_stride = 0;
  std::vector<int32_t> seqlens;  // per request; empty: random in [1, 2*mean_seqlen]
  int64_t mean_seqlen = 256;
  int64_t max_pages = 0;    // 0: enough for the longest request
  int64_t extra_pages = 3;  // pages beyond what the block table names (never referenced)
  bool causal = false;
  std::optional<float> softmax_scale;  // nullopt: d_qk^-0.55
  int value_scale_log2 = 0;            // as in SparseCaseConfig
  Layout q_layout = Layout::kContiguous;
  Layout out_layout = Layout::kContiguous;
  bool poison_unreferenced = true;
  uint64_t seed = 1;
};

struct DenseCase {
  DenseCaseConfig config;
  HostCache kv;
  HostTensor q, block_table, cache_seqlens, out, lse;
  std::optional<float> softmax_scale;

  DenseDecodeArgs args() const;
  void poison_outputs();
  void refresh_cache(Rng& rng);
};
DenseCase make_dense_case(const DenseCaseConfig& config);  // (same)

// Spec section 7's softmax scale: d_qk^-0.55.
float default_softmax_scale(KVFormat format);

// Cache values times 2^k, the softmax scale (the config's, else the default) divided by as much:
// the scores stay as they were.
template <typename Config>
Config with_values_scaled(Config c, int k) {
  c.value_scale_log2 = k;
  c.softmax_scale = std::ldexp(c.softmax_scale.value_or(default_softmax_scale(c.format)), -k);
  return c;
}

struct MergeCaseConfig {
  int64_t n = 2, b = 1, s_q = 1, h_q = 8, d_v = kDV;
  DType parts_dtype = DType::kFloat32;
  DType out_dtype = DType::kBFloat16;
  double empty_fraction = 0.0;  // parts with lse +-inf and NaN values
  bool use_sink = false;
  uint64_t seed = 1;
};

struct MergeCase {
  MergeCaseConfig config;
  HostTensor out_parts, lse_parts, attn_sink, out, lse;
  MergeArgs args() const;
  void poison_outputs();
};
MergeCase make_merge_case(const MergeCaseConfig& config);

// The bytes of out's logical elements, then lse's: what the bitwise determinism tests compare.
std::vector<uint8_t> output_bytes(const HostTensor& out, const HostTensor& lse);

// ---- template definitions ----
template <typename F>
void HostTensor::for_each_index(F&& f) const {
  const int n = ndim();
  int64_t total = numel();
  std::vector<int64_t> idx(n, 0);
  for (int64_t e = 0; e < total; ++e) {
    f(static_cast<const std::vector<int64_t>&>(idx));
    for (int d = n - 1; d >= 0; --d) {
      if (++idx[d] < shape_[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace sparse_mla::ref
