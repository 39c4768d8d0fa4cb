// CUDA KV-cache tools through the public API: quantize_store, dequantize and repack_pages must
// leave exactly the bytes the CPU backend leaves (whole cache images compared, so bytes nobody
// should write are checked too), and agree with the reference quantizer / dequantizer and with
// a byte-copy model of repacking written here from the spec. Page sizes 1 to 1000 (odd ones
// included), padded page strides, padded and misaligned rows, slots -1 / out of range, NaN and
// infinite sources, corrupt block tables.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "src/kv/format.h"
#include "tests/cpp/cuda/gpu_util.h"

namespace sparse_mla {
namespace {

using gpu_test::DeviceKV;
using gpu_test::DeviceTensor;
using gpu_test::Stream;

const Options kCPU{Backend::kCPU, nullptr};
constexpr int32_t kMaxI32 = std::numeric_limits<int32_t>::max();

uint8_t* image(const ref::HostCache& c) { return static_cast<uint8_t*>(c.desc().data); }

void random_bytes(ref::Rng& rng, uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(p + i, &r, std::min<size_t>(8, n - i));
  }
}

// A pool whose page stride is the format's default plus `pad` bytes (a multiple of 16).
ref::HostCache make_cache(KVFormat format, int64_t num_pages, int64_t page_size, int64_t pad,
                          int64_t heads = 1) {
  ref::CacheConfig c;
  c.format = format;
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.num_heads = heads;
  c.page_stride = ref::default_page_stride(format, page_size, heads) + pad;
  return ref::HostCache(c);
}

// Byte ranges (offset from the pool start, length) of one token, written from the spec.
std::vector<std::pair<int64_t, int64_t>> token_spans(const KVCache& kv, int64_t page, int64_t t) {
  const int64_t base = page * kv.page_stride;
  if (kv.format == KVFormat::kModel1) {
    return {{base + t * 576, 576}, {base + kv.page_size * 576 + t * 8, 8}};
  }
  const int64_t bpt = kv.format == KVFormat::kV32 ? 656 : kv.num_heads * 576 * 2;
  return {{base + t * bpt, bpt}};
}

// Equal byte images, or where they first differ (page and byte inside it) and how often.
::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got, const uint8_t* want,
                                      const KVCache& layout) {
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " bytes differ; first at page " << first / layout.page_stride << " byte "
         << first % layout.page_stride << ": got " << int{got[first]} << ", expected "
         << int{want[first]};
}

std::vector<int64_t> shuffled(ref::Rng& rng, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[i], v[rng.below(i + 1)]);
  return v;
}

int32_t out_of_range_slot(ref::Rng& rng, int64_t num_slots) {
  const int32_t choices[] = {static_cast<int32_t>(num_slots), static_cast<int32_t>(num_slots + 5),
                             kMaxI32, -2, std::numeric_limits<int32_t>::min()};
  return choices[rng.below(5)];
}

// ---------------------------------------------------------------------------------------------
// quantize_store

struct QuantizeCase {
  KVFormat format;
  DType src_dtype;
  int64_t page_size;
  int64_t stride_pad = 0;  // bytes added to the default page stride
  int64_t row_pad = 0;     // elements added to src's row stride
  size_t src_offset = 0;   // bytes: src data pointer only element-aligned when nonzero
  int64_t n = 300;
};

std::string describe(const QuantizeCase& c) {
  return std::string(kv_format_name(c.format)) + " src " + dtype_name(c.src_dtype) + " page_size " +
         std::to_string(c.page_size) + " stride_pad " + std::to_string(c.stride_pad) + " row_pad " +
         std::to_string(c.row_pad) + " offset " + std::to_string(c.src_offset) + " n " +
         std::to_string(c.n);
}

// Row r of the source: mostly N(0, 0.1^2) rows at scales 2^-30 .. 2^30, plus rows that hit the
// recipe's corners (all zero, the 1e-4 floor, NaN, inf, fp32 subnormals, huge values).
void source_row(ref::Rng& rng, int64_t r, int d, float* v) {
  ref::random_row(rng, d, v);
  const float k = std::ldexp(1.0f, static_cast<int>(rng.between(-30, 30)));
  for (int j = 0; j < d; ++j) v[j] *= k;
  switch (r % 17) {
    case 0:
      std::fill(v, v + d, 0.f);
      break;
    case 1:
      v[rng.below(d)] = std::numeric_limits<float>::quiet_NaN();
      break;
    case 2:
      v[rng.below(d)] = std::numeric_limits<float>::infinity();
      break;
    case 3:
      v[rng.below(d)] = -std::numeric_limits<float>::infinity();
      v[rng.below(d)] = -std::numeric_limits<float>::quiet_NaN();
      break;
    case 4:
      for (int j = 0; j < d; ++j) v[j] = std::ldexp(v[j], -120);  // fp32 subnormals
      break;
    case 5:
      for (int j = 0; j < d; ++j) v[j] = std::ldexp(v[j], 100);  // scales near 2^100
      break;
    case 6:
      for (int j = 0; j < d; ++j) v[j] = 448.0f * std::ldexp(1.0f, j % 9 - 4);  // exact powers
      break;
    case 7:
      for (int j = 0; j < d; ++j) v[j] = (j % 2 ? -1.f : 1.f) * 1e-6f;  // below the 1e-4 floor
      break;
    case 8:
      // Scale exactly 1 (each tile's amax is 448): e4m3 rounding ties and their neighbours.
      for (int j = 0; j < d; ++j) {
        const int k = (j * 7) % 126;
        float x = 0.5f * (fmt::e4m3_to_float(static_cast<uint8_t>(k)) +
                          fmt::e4m3_to_float(static_cast<uint8_t>(k + 1)));
        if (j % 3 == 1) x = std::nextafter(x, 0.f);
        if (j % 3 == 2) x = std::nextafter(x, 1000.f);
        v[j] = (j / 3) % 2 ? -x : x;
        if (j % 64 == 0) v[j] = j % 128 ? -448.f : 448.f;
      }
      break;
    case 9:
      // A whole scale tile of NaN of both signs (its amax is 0) next to ordinary tiles.
      for (int j = 128; j < 256; ++j) {
        v[j] = std::copysign(std::numeric_limits<float>::quiet_NaN(), j % 3 ? 1.f : -1.f);
      }
      break;
    default:
      break;
  }
}

bool all_finite(const float* v, int d) {
  return std::all_of(v, v + d, [](float x) { return std::isfinite(x); });
}

void run_quantize_case(const QuantizeCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed " + std::to_string(seed));
  ref::Rng rng(seed);
  const int d = kv_format_d_qk(c.format);
  const int64_t num_pages = (c.n + c.n / 2) / c.page_size + 2;
  ref::HostCache initial = make_cache(c.format, num_pages, c.page_size, c.stride_pad);
  random_bytes(rng, image(initial), initial.bytes());
  const int64_t num_slots = initial.num_slots();

  ref::HostTensor src = ref::make_tensor_strided(c.src_dtype, {c.n, d}, {d + c.row_pad, 1});
  src.fill_bytes(0x7f);  // NaN in the row padding: must never be read
  std::vector<std::vector<float>> rows(c.n, std::vector<float>(d));
  for (int64_t r = 0; r < c.n; ++r) {
    source_row(rng, r, d, rows[r].data());
    for (int j = 0; j < d; ++j) src.set({r, j}, rows[r][j]);
    for (int j = 0; j < d; ++j) rows[r][j] = static_cast<float>(src.get({r, j}));  // as stored
  }
  const std::vector<int64_t> perm = shuffled(rng, num_slots);
  std::vector<int32_t> slot_values(c.n);
  for (int64_t r = 0; r < c.n; ++r) {
    slot_values[r] = static_cast<int32_t>(perm[r]);
    if (r % 11 == 5) slot_values[r] = -1;
    if (r % 13 == 7) slot_values[r] = out_of_range_slot(rng, num_slots);
  }
  ref::HostTensor slots = ref::make_int_tensor(slot_values);

  ref::HostCache cpu = initial;
  ASSERT_TRUE(quantize_store({src.view(), slots.view(), cpu.desc()}, kCPU).ok());

  DeviceTensor dsrc = gpu_test::to_device(src.view(), c.src_offset);
  DeviceTensor dslots = gpu_test::to_device(slots.view());
  DeviceKV dkv = gpu_test::to_device(initial.desc());
  Stream stream;
  const Status st = quantize_store({dsrc.view, dslots.view, dkv.kv}, stream.options());
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(stream.sync());
  const std::vector<uint8_t> gpu = gpu_test::to_host_bytes(dkv);
  EXPECT_TRUE(same_bytes(gpu, image(cpu), initial.desc())) << "GPU vs CPU backend";

  // The reference quantizer, on every row it defines (finite values), over the CPU image.
  ref::HostCache want = cpu;
  int64_t checked = 0;
  for (int64_t r = 0; r < c.n; ++r) {
    const int32_t slot = slot_values[r];
    if (slot < 0 || slot >= num_slots || !all_finite(rows[r].data(), d)) continue;
    ref::write_row(want, slot, 0, rows[r].data());
    ++checked;
  }
  // Most rows are plain; the first few carry the special patterns (NaN, inf) that are skipped.
  EXPECT_GT(checked, c.n < 10 ? 0 : c.n / 2);
  EXPECT_TRUE(same_bytes(gpu, image(want), initial.desc())) << "GPU vs reference quantizer";
}

TEST(CudaKV, QuantizeStoreMatchesCpuAndReference) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  for (KVFormat f : {KVFormat::kModel1, KVFormat::kV32}) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t ps : {1, 2, 53, 61, 64, 69, 256}) {
        run_quantize_case({f, dt, ps}, seed + ps);
      }
      run_quantize_case({f, dt, 64, 48, 8, 0, 777}, seed + 1);  // padded pages and rows
      run_quantize_case({f, dt, 53, 16, 1, 0, 129}, seed + 2);  // rows not 16-byte aligned
      run_quantize_case({f, dt, 61, 0, 0, dtype_size(dt), 100}, seed + 3);  // pointer offset
      run_quantize_case({f, dt, 256, 0, 0, 0, 5000}, seed + 4);
      run_quantize_case({f, dt, 2, 0, 0, 0, 1}, seed + 5);
      // Page sizes that stress the kernel's multiply-shift page division, and odd row counts
      // (a warp stores two bf16 rows, so its second row may not exist).
      for (int64_t ps : {3, 7, 255, 257, 1000}) {
        run_quantize_case({f, dt, ps, 32, 0, 0, 301}, seed + 6 + ps);
      }
      run_quantize_case({f, dt, 64, 0, 0, 0, 3}, seed + 7);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dequantize

struct DequantizeCase {
  KVFormat format;
  int64_t heads = 1;
  int64_t page_size = 64;
  int64_t stride_pad = 0;
  DType out_dtype = DType::kFloat32;
  int64_t row_pad = 0;  // elements
  size_t out_offset = 0;
  bool fuzz = false;  // random bytes (NaN codes, odd V32 scales) instead of quantized rows
  int64_t n = 200;
};

std::string describe(const DequantizeCase& c) {
  return std::string(kv_format_name(c.format)) + " heads " + std::to_string(c.heads) +
         " page_size " + std::to_string(c.page_size) + " stride_pad " +
         std::to_string(c.stride_pad) + " out " + dtype_name(c.out_dtype) + " row_pad " +
         std::to_string(c.row_pad) + " offset " + std::to_string(c.out_offset) +
         (c.fuzz ? " fuzz" : "");
}

uint32_t element_bits(const ref::HostTensor& t, int64_t r, int64_t j) {
  const uint8_t* p =
      static_cast<const uint8_t*>(t.data()) + t.offset({r, j}) * dtype_size(t.dtype());
  uint32_t v = 0;
  std::memcpy(&v, p, dtype_size(t.dtype()));
  return v;
}

bool is_nan_bits(uint32_t v, DType dt) {
  if (dt == DType::kFloat32) return (v & 0x7fffffffu) > 0x7f800000u;
  return (v & 0x7fffu) > 0x7f80u;
}

void run_dequantize_case(const DequantizeCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed " + std::to_string(seed));
  ref::Rng rng(seed);
  const int d = kv_format_d_qk(c.format);
  const int64_t num_pages = 300 / c.page_size + 2;
  ref::HostCache cache = make_cache(c.format, num_pages, c.page_size, c.stride_pad, c.heads);
  if (c.fuzz) {
    random_bytes(rng, image(cache), cache.bytes());
  } else {
    ref::fill_random(cache, rng);
  }
  const int64_t num_slots = cache.num_slots();
  std::vector<int32_t> slot_values(c.n);
  for (int64_t r = 0; r < c.n; ++r) {
    slot_values[r] = static_cast<int32_t>(rng.below(num_slots));
    if (r % 7 == 3) slot_values[r] = -1;
    if (r % 9 == 4) slot_values[r] = out_of_range_slot(rng, num_slots);
  }
  ref::HostTensor slots = ref::make_int_tensor(slot_values);

  ref::HostTensor cpu_out = ref::make_tensor_strided(c.out_dtype, {c.n, d}, {d + c.row_pad, 1});
  cpu_out.fill_bytes(0xff);
  ASSERT_TRUE(dequantize({cache.desc(), slots.view(), cpu_out.view()}, kCPU).ok());

  DeviceKV dkv = gpu_test::to_device(cache.desc());
  DeviceTensor dslots = gpu_test::to_device(slots.view());
  DeviceTensor dout = gpu_test::poisoned_like(cpu_out.view(), 0xff, c.out_offset);
  Stream stream;
  const Status st = dequantize({dkv.kv, dslots.view, dout.view}, stream.options());
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(stream.sync());
  ref::HostTensor gpu_out = cpu_out;
  gpu_out.fill_bytes(0);
  gpu_test::copy_to_host(dout, gpu_out.view());

  // Row padding stays poisoned; every element equals the CPU's bit for bit (any NaN matches any
  // NaN: a NaN's sign and payload after a multiply are not defined by C++ on the CPU side).
  int64_t bad = 0;
  std::vector<double> want(static_cast<size_t>(d));
  for (int64_t r = 0; r < c.n; ++r) {
    for (int64_t j = d; j < d + c.row_pad && r + 1 < c.n; ++j) {
      const uint8_t* p = static_cast<const uint8_t*>(gpu_out.data()) +
                         (r * (d + c.row_pad) + j) * dtype_size(c.out_dtype);
      for (size_t k = 0; k < dtype_size(c.out_dtype); ++k) bad += p[k] != 0xff;
    }
    const int32_t slot = slot_values[r];
    const bool valid = slot >= 0 && slot < num_slots;
    if (valid && !c.fuzz) ref::read_row(cache.desc(), slot, 0, want.data());
    for (int64_t j = 0; j < d; ++j) {
      const uint32_t g = element_bits(gpu_out, r, j), h = element_bits(cpu_out, r, j);
      const bool ok = g == h || (is_nan_bits(g, c.out_dtype) && is_nan_bits(h, c.out_dtype));
      if (!ok && bad++ == 0) {
        ADD_FAILURE() << "row " << r << " (slot " << slot << ") col " << j << ": GPU bits 0x"
                      << std::hex << g << ", CPU 0x" << h << std::dec;
      }
      if (c.fuzz) continue;
      // Reference: exact values (bf16 output: rounded once); invalid slots give zeros.
      const double v = valid ? want[j] : 0.0;
      const uint32_t expect = c.out_dtype == DType::kFloat32
                                  ? fmt::float_bits(static_cast<float>(v))
                                  : ref::ref_float_to_bf16(v);
      if (g != expect && bad++ == 0) {
        ADD_FAILURE() << "row " << r << " (slot " << slot << ") col " << j << ": GPU bits 0x"
                      << std::hex << g << ", reference 0x" << expect << std::dec;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaKV, DequantizeMatchesCpuAndReference) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  struct Fmt {
    KVFormat f;
    int64_t heads;
  };
  for (Fmt fh : {Fmt{KVFormat::kModel1, 1}, Fmt{KVFormat::kV32, 1}, Fmt{KVFormat::kBF16, 1},
                 Fmt{KVFormat::kBF16, 2}, Fmt{KVFormat::kFP16, 3}}) {
    for (DType out : {DType::kFloat32, DType::kBFloat16}) {
      for (int64_t ps : {1, 2, 53, 61, 64, 69, 256}) {
        run_dequantize_case({fh.f, fh.heads, ps, 0, out}, seed + ps);
      }
      run_dequantize_case({fh.f, fh.heads, 64, 32, out, 8}, seed + 1);  // padded
      run_dequantize_case({fh.f, fh.heads, 53, 0, out, 1}, seed + 2);   // unaligned rows
      run_dequantize_case({fh.f, fh.heads, 61, 16, out, 0, dtype_size(out)}, seed + 3);
      run_dequantize_case({fh.f, fh.heads, 64, 0, out, 0, 0, true}, seed + 4);  // fuzz
      run_dequantize_case({fh.f, fh.heads, 69, 16, out, 3, 0, true}, seed + 5);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// repack_pages

struct RepackCase {
  KVFormat format;
  int64_t heads = 1;
  int64_t src_page_size, dst_page_size;
  int64_t src_pad = 0, dst_pad = 0;  // page stride padding, bytes
  int64_t b = 3;
  int64_t max_len = 300;
  bool corrupt_tables = true;  // some block-table entries -1 / out of range
  bool padded_tables = false;  // non-contiguous block tables
};

std::string describe(const RepackCase& c) {
  return std::string(kv_format_name(c.format)) + " heads " + std::to_string(c.heads) + " pages " +
         std::to_string(c.src_page_size) + " -> " + std::to_string(c.dst_page_size) + " pads " +
         std::to_string(c.src_pad) + "/" + std::to_string(c.dst_pad) + " b " + std::to_string(c.b) +
         " max_len " + std::to_string(c.max_len);
}

ref::HostTensor table_like(const ref::HostTensor& t, bool padded) {
  ref::HostTensor out = ref::make_tensor(DType::kInt32, t.shape(),
                                         padded ? ref::Layout::kPadded : ref::Layout::kContiguous);
  out.fill_bytes(0xee);  // garbage in the padding: never read
  t.for_each_index([&](const std::vector<int64_t>& i) {
    out.set({i[0], i[1]}, t.get({i[0], i[1]}));
  });
  return out;
}

void run_repack_case(const RepackCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed " + std::to_string(seed));
  ref::Rng rng(seed);
  const int64_t max_src_pages = (c.max_len + c.src_page_size - 1) / c.src_page_size + 1;
  const int64_t max_dst_pages = (c.max_len + c.dst_page_size - 1) / c.dst_page_size;
  const int64_t src_pages = c.b * max_src_pages + 1;
  const int64_t dst_pages = c.b * max_dst_pages + 5;  // distinct pages for every entry, + unnamed
  ref::HostCache src = make_cache(c.format, src_pages, c.src_page_size, c.src_pad, c.heads);
  ref::HostCache dst = make_cache(c.format, dst_pages, c.dst_page_size, c.dst_pad, c.heads);
  random_bytes(rng, image(src), src.bytes());
  random_bytes(rng, image(dst), dst.bytes());

  ref::HostTensor sbt = ref::random_block_table(rng, c.b, max_src_pages, src_pages);
  ref::HostTensor dbt = ref::random_block_table(rng, c.b, max_dst_pages, dst_pages);
  if (c.corrupt_tables) {
    for (ref::HostTensor* t : {&sbt, &dbt}) {
      const int64_t pages = t == &sbt ? src_pages : dst_pages;
      t->for_each_index([&](const std::vector<int64_t>& i) {
        if (rng.uniform() < 0.08)
          t->set({i[0], i[1]}, rng.below(2) ? -1 : out_of_range_slot(rng, pages));
      });
    }
  }
  sbt = table_like(sbt, c.padded_tables);
  dbt = table_like(dbt, c.padded_tables);
  const int64_t capacity =
      std::min(max_src_pages * c.src_page_size, max_dst_pages * c.dst_page_size);
  std::vector<int32_t> len_values(c.b);
  for (int64_t i = 0; i < c.b; ++i) {
    len_values[i] = static_cast<int32_t>(rng.between(0, c.max_len));
    if (i % 5 == 1) len_values[i] = static_cast<int32_t>(capacity + 100);  // clamped
    if (i % 5 == 2) len_values[i] = 0;
    if (i % 5 == 3) len_values[i] = -5;
    if (i % 5 == 4) len_values[i] = static_cast<int32_t>(std::min(c.max_len, 2 * c.dst_page_size));
  }
  ref::HostTensor seqlens = ref::make_int_tensor(len_values);

  // The model: every token below the clamped length whose two pages are in range is copied.
  std::vector<uint8_t> want(image(dst), image(dst) + dst.bytes());
  const KVCache sk = src.desc(), dk = dst.desc();
  for (int64_t i = 0; i < c.b; ++i) {
    const int64_t len = std::clamp<int64_t>(len_values[i], 0, capacity);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t sp = static_cast<int64_t>(sbt.get({i, t / c.src_page_size}));
      const int64_t dp = static_cast<int64_t>(dbt.get({i, t / c.dst_page_size}));
      if (sp < 0 || sp >= src_pages || dp < 0 || dp >= dst_pages) continue;
      const auto from = token_spans(sk, sp, t % c.src_page_size);
      const auto to = token_spans(dk, dp, t % c.dst_page_size);
      for (size_t k = 0; k < from.size(); ++k) {
        std::memcpy(want.data() + to[k].first, image(src) + from[k].first, from[k].second);
      }
    }
  }

  ref::HostCache cpu = dst;
  ASSERT_TRUE(
      repack_pages({src.desc(), cpu.desc(), sbt.view(), dbt.view(), seqlens.view()}, kCPU).ok());
  EXPECT_TRUE(same_bytes({image(cpu), image(cpu) + cpu.bytes()}, want.data(), dk))
      << "CPU backend vs model";

  DeviceKV dsrc = gpu_test::to_device(src.desc());
  DeviceKV ddst = gpu_test::to_device(dst.desc());
  DeviceTensor dsbt = gpu_test::to_device(sbt.view());
  DeviceTensor ddbt = gpu_test::to_device(dbt.view());
  DeviceTensor dlen = gpu_test::to_device(seqlens.view());
  Stream stream;
  const Status st =
      repack_pages({dsrc.kv, ddst.kv, dsbt.view, ddbt.view, dlen.view}, stream.options());
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(stream.sync());
  EXPECT_TRUE(same_bytes(gpu_test::to_host_bytes(ddst), want.data(), dk)) << "GPU vs model";
  EXPECT_TRUE(same_bytes(gpu_test::to_host_bytes(ddst), image(cpu), dk)) << "GPU vs CPU";
  EXPECT_TRUE(same_bytes(gpu_test::to_host_bytes(dsrc), image(src), sk)) << "src was modified";
}

TEST(CudaKV, RepackMatchesCpuAndByteModel) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gpu_test::test_seed();
  const std::pair<int64_t, int64_t> sizes[] = {{256, 64}, {64, 256},  {53, 61}, {61, 53},
                                               {2, 69},   {69, 2},    {1, 2},   {2, 1},
                                               {64, 64},  {256, 256}, {69, 1}};
  struct Fmt {
    KVFormat f;
    int64_t heads;
  };
  for (Fmt fh : {Fmt{KVFormat::kModel1, 1}, Fmt{KVFormat::kV32, 1}, Fmt{KVFormat::kBF16, 1},
                 Fmt{KVFormat::kFP16, 2}}) {
    for (auto [sps, dps] : sizes) {
      run_repack_case({fh.f, fh.heads, sps, dps}, seed + sps * 1000 + dps);
    }
    run_repack_case({fh.f, fh.heads, 256, 64, 48, 16, 5, 700, true, true}, seed + 1);
    run_repack_case({fh.f, fh.heads, 53, 2, 16, 32, 4, 200, false, true}, seed + 2);
    run_repack_case({fh.f, fh.heads, 64, 53, 0, 0, 1, 1, false, false}, seed + 3);
  }
  // The production shape: engine strides, many requests, thousands of tokens each.
  run_repack_case({KVFormat::kModel1, 1, 256, 64, 0, 0, 16, 4096, true, false}, seed + 4);
  // More requests than a block reads lengths at a time (256), most of them short or empty.
  run_repack_case({KVFormat::kModel1, 1, 64, 2, 0, 0, 600, 90, true, false}, seed + 5);
}

// Block tables 2^31-1 entries wide (zero strides) over 2^16 requests, all empty but the last,
// which copies three tokens from src page 0 into dst page 0: the work is those tokens. The kernel
// used to visit every (request, 64-token chunk) below the tables' capacity, 2^41 items here.
TEST(CudaKV, RepackWideTablesCostOnlyTheCopiableTokens) {
  SKIP_WITHOUT_GPU();
  ref::Rng rng(gpu_test::test_seed());
  ref::HostCache src = make_cache(KVFormat::kModel1, 1, 1, 0);
  ref::HostCache dst = make_cache(KVFormat::kModel1, 1, 1, 0);
  random_bytes(rng, image(src), src.bytes());
  random_bytes(rng, image(dst), dst.bytes());
  const int64_t b = 1 << 16, wide = kMaxI32;
  int32_t zero = 0;
  std::vector<int32_t> lens(b, 0);
  lens[b - 1] = 3;
  DeviceKV dsrc = gpu_test::to_device(src.desc());
  DeviceKV ddst = gpu_test::to_device(dst.desc());
  DeviceTensor dtable = gpu_test::to_device(
      TensorView::strided(&zero, DType::kInt32, Device{}, {b, wide}, {0, 0}));
  DeviceTensor dlen = gpu_test::to_device(ref::make_int_tensor(lens).view());
  Stream stream;
  const Status st =
      repack_pages({dsrc.kv, ddst.kv, dtable.view, dtable.view, dlen.view}, stream.options());
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(stream.sync());
  // Token 0's row and scales (584 bytes) came from src; the page's padding is as it was.
  std::vector<uint8_t> want(image(dst), image(dst) + dst.bytes());
  std::memcpy(want.data(), image(src), 584);
  EXPECT_TRUE(same_bytes(gpu_test::to_host_bytes(ddst), want.data(), dst.desc()));
}

// ---------------------------------------------------------------------------------------------
// Graph capture: none of the three launches allocates or synchronizes, so all can be captured.

TEST(CudaKV, OpsAreGraphCapturable) {
  SKIP_WITHOUT_GPU();
  ref::Rng rng(gpu_test::test_seed());
  const int64_t n = 64;
  ref::HostCache cache = make_cache(KVFormat::kModel1, 4, 64, 0);
  ref::HostCache packed = make_cache(KVFormat::kModel1, 16, 2, 0);
  ref::HostTensor src = ref::random_tensor(rng, DType::kBFloat16, {n, kDV}, -1, 1);
  std::vector<int32_t> slot_values(n);
  for (int64_t r = 0; r < n; ++r) slot_values[r] = static_cast<int32_t>(r * 3 % 256);
  ref::HostTensor slots = ref::make_int_tensor(slot_values);
  ref::HostTensor sbt = ref::make_tensor(DType::kInt32, {1, 4});
  ref::HostTensor dbt = ref::make_tensor(DType::kInt32, {1, 16});
  for (int64_t p = 0; p < 4; ++p) sbt.set({0, p}, 3 - p);
  for (int64_t p = 0; p < 16; ++p) dbt.set({0, p}, (p * 5) % 16);
  ref::HostTensor seqlens = ref::make_int_tensor({29});
  ref::HostTensor out = ref::make_tensor(DType::kFloat32, {n, kDV});

  DeviceKV dcache = gpu_test::to_device(cache.desc());
  DeviceKV dpacked = gpu_test::to_device(packed.desc());
  DeviceTensor dsrc = gpu_test::to_device(src.view()), dslots = gpu_test::to_device(slots.view());
  DeviceTensor dsbt = gpu_test::to_device(sbt.view()), ddbt = gpu_test::to_device(dbt.view());
  DeviceTensor dlen = gpu_test::to_device(seqlens.view());
  DeviceTensor dout = gpu_test::poisoned_like(out.view());
  Stream stream;
  auto enqueue = [&] {
    EXPECT_TRUE(quantize_store({dsrc.view, dslots.view, dcache.kv}, stream.options()).ok());
    EXPECT_TRUE(
        repack_pages({dcache.kv, dpacked.kv, dsbt.view, ddbt.view, dlen.view}, stream.options())
            .ok());
    EXPECT_TRUE(dequantize({dcache.kv, dslots.view, dout.view}, stream.options()).ok());
  };
  enqueue();
  ASSERT_TRUE(stream.sync());
  const std::vector<uint8_t> eager_packed = gpu_test::to_host_bytes(dpacked);
  const std::vector<uint8_t> eager_out = dout.buffer.to_vector<uint8_t>();
  dpacked.buffer.fill(0xff);
  dout.buffer.fill(0xff);

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
  enqueue();
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  ASSERT_TRUE(stream.sync());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  EXPECT_EQ(gpu_test::to_host_bytes(dpacked), eager_packed);
  EXPECT_EQ(dout.buffer.to_vector<uint8_t>(), eager_out);
}

// A device that does not exist is a Status, not a crash.
TEST(CudaKV, MissingDeviceIsAnError) {
  SKIP_WITHOUT_GPU();
  ref::HostCache cache = make_cache(KVFormat::kModel1, 1, 64, 0);
  DeviceKV dkv = gpu_test::to_device(cache.desc());
  ref::HostTensor slots = ref::make_int_tensor({0});
  DeviceTensor dslots = gpu_test::to_device(slots.view());
  DeviceTensor dout = gpu_test::poisoned_like(ref::make_tensor(DType::kFloat32, {1, kDV}).view());
  const Device missing{DeviceType::kCUDA, 97};
  dkv.kv.device = missing;
  dslots.view.device = missing;
  dout.view.device = missing;
  const Status st = dequantize({dkv.kv, dslots.view, dout.view}, Options{Backend::kCUDA, nullptr});
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("97"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace sparse_mla
