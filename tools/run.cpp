// `sparse-mla run`: one simulated DeepSeek-V4 decode step. Builds the caches an engine holds (a
// 256-token-page sliding-window cache, a 64-token-page C4 cache and a 2-token-page C128 cache, all
// MODEL1, written by the library's quantize_store), runs one sparse decode per layer type
// (window-only, C4, C128), verifies each against the fp64 reference and prints time and
// throughput.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "tools/commands.h"
#include "tools/timing.h"

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <omp.h>

namespace sparse_mla::tools {
namespace {

constexpr int64_t kWindow = 128;      // sliding-window tokens per query
constexpr int64_t kWindowPage = 256;  // page sizes engines use for each cache
constexpr int64_t kC4Page = 64;
constexpr int64_t kC128Page = 2;
constexpr int64_t kMaxBatch = 65536;
constexpr int64_t kMaxContext = int64_t{1} << 24;
constexpr int64_t kStoreChunk = 8192;  // rows quantize-stored per call while building
// fp64 reference work per layer (query-head x row x dim steps) before verification samples
// requests: keeps large GPU runs from waiting minutes on the host.
constexpr double kReferenceBudget = 1.5e9;

const char* const kUsage =
    "usage: sparse-mla run [--model dsv4-flash|dsv4-pro] [--batch N] [--context L]\n"
    "                      [--backend auto|cpu|cuda|sm90] [--mtp] [--seed S] [--runs R]\n"
    "                      [--verify-all]\n"
    "Builds the KV caches of one DeepSeek-V4 decode step with random latents (window cache on\n"
    "256-token pages, C4 cache on 64-token pages, C128 cache on 2-token pages, MODEL1 FP8), runs\n"
    "one sparse decode per layer type (window-only, C4, C128), checks each against the fp64\n"
    "reference (spec section 7 tolerances) and prints time and throughput.\n"
    "  --model      dsv4-flash (64 heads, C4 top-k 512) or dsv4-pro (128 heads, top-k 1024);\n"
    "               default dsv4-flash\n"
    "  --batch      requests, 1..65536; default 4\n"
    "  --context    mean tokens per request, 1..16777216; each request varies by +-25%;\n"
    "               default 4096\n"
    "  --backend    auto (sm90 on a Hopper GPU with a 90a build, else cuda when a usable GPU\n"
    "               is present, else cpu), cpu, cuda, sm90;\n"
    "               default auto (or SPARSE_MLA_BACKEND)\n"
    "  --mtp        two query tokens per request (one MTP token): s_q = 2\n"
    "  --seed       random seed, default 1\n"
    "  --runs       timed runs per layer (the median is shown); default 3 on CPU, 20 on GPU\n"
    "  --verify-all check every request against the reference, however long it takes\n"
    "Exit status: 0 when every layer verifies, 1 on a failed check or error, 2 on bad arguments.\n";

struct Config {
  std::string model = "dsv4-flash";
  int64_t h_q = 64;
  int64_t c4_topk = 512;
  int64_t batch = 4;
  int64_t context = 4096;
  Backend backend = Backend::kAuto;
  bool mtp = false;
  uint64_t seed = 1;
  int runs = 0;  // 0: the backend's default
  bool verify_all = false;
};

int usage_error(const std::string& message) {
  std::fprintf(stderr, "sparse-mla run: %s\nRun `sparse-mla run --help` for the options.\n",
               message.c_str());
  return 2;
}

bool parse_int(const std::string& text, int64_t lo, int64_t hi, int64_t* value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *value = v;
  return true;
}

// Parses argv (argv[0] is "run"). Returns -1 to go on, else the exit status.
int parse_args(int argc, char** argv, Config* cfg) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take_value = [&]() -> bool {
      if (has_value) return true;
      if (i + 1 >= argc) return false;
      value = argv[++i];
      return true;
    };
    auto int_option = [&](int64_t lo, int64_t hi, int64_t* out) -> int {
      if (!take_value()) return usage_error(arg + ": missing value, expected an integer");
      if (!parse_int(value, lo, hi, out)) {
        return usage_error(arg + ": expected an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got '" + value + "'");
      }
      return -1;
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--mtp" || arg == "--verify-all") {
      if (has_value) return usage_error(arg + ": takes no value, got '" + value + "'");
      (arg == "--mtp" ? cfg->mtp : cfg->verify_all) = true;
    } else if (arg == "--model") {
      if (!take_value())
        return usage_error("--model: missing value, expected dsv4-flash or dsv4-pro");
      if (value == "dsv4-flash") {
        cfg->h_q = 64, cfg->c4_topk = 512;
      } else if (value == "dsv4-pro") {
        cfg->h_q = 128, cfg->c4_topk = 1024;
      } else {
        return usage_error("--model: expected dsv4-flash or dsv4-pro, got '" + value + "'");
      }
      cfg->model = value;
    } else if (arg == "--batch") {
      if (int rc = int_option(1, kMaxBatch, &cfg->batch); rc >= 0) return rc;
    } else if (arg == "--context") {
      if (int rc = int_option(1, kMaxContext, &cfg->context); rc >= 0) return rc;
    } else if (arg == "--seed") {
      int64_t seed = 0;
      if (int rc = int_option(0, std::numeric_limits<int64_t>::max(), &seed); rc >= 0) return rc;
      cfg->seed = static_cast<uint64_t>(seed);
    } else if (arg == "--runs") {
      int64_t runs = 0;
      if (int rc = int_option(1, 10000, &runs); rc >= 0) return rc;
      cfg->runs = static_cast<int>(runs);
    } else if (arg == "--backend") {
      if (!take_value()) {
        return usage_error("--backend: missing value, expected auto, cpu, cuda or sm90");
      }
      if (!parse_backend(value, &cfg->backend).ok()) {
        return usage_error("--backend: expected auto, cpu, cuda or sm90, got '" + value + "'");
      }
    } else {
      return usage_error("unknown argument '" + std::string(argv[i]) + "'");
    }
  }
  return -1;
}

// Progress on stderr: redrawn in place on a terminal, a line per quarter otherwise.
class Progress {
 public:
  Progress() : tty_(isatty(STDERR_FILENO) != 0) {}
  void update(const std::string& stage, int64_t done, int64_t total) {
    const int pct = total > 0 ? static_cast<int>(100 * done / total) : 100;
    if (tty_) {
      std::fprintf(stderr, "\rbuilding caches: %-6s %3d%% (%lld/%lld rows)", stage.c_str(), pct,
                   static_cast<long long>(done), static_cast<long long>(total));
      if (done == total) std::fputc('\n', stderr);
    } else if (stage != stage_ || pct / 25 != last_quarter_) {
      std::fprintf(stderr, "building caches: %s %d%% (%lld/%lld rows)\n", stage.c_str(), pct,
                   static_cast<long long>(done), static_cast<long long>(total));
      last_quarter_ = pct / 25;
    }
    stage_ = stage;
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::string stage_;
  int last_quarter_ = -1;
};

// ---- Device copies (CUDA backend) ----

// Elements spanned by a strided view (non-negative strides), 0 when empty.
int64_t span_elements(const TensorView& t) {
  int64_t span = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return 0;
    span += (t.shape[d] - 1) * t.strides[d];
  }
  return span;
}

#if SPARSE_MLA_WITH_CUDA
Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::DeviceError(what + ": " + cudaGetErrorString(err));
}

// Owns device copies of host tensors and caches; views keep the host strides.
class DeviceMirror {
 public:
  explicit DeviceMirror(int device) : device_(device) {}
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() {
    for (void* p : allocations_) cudaFree(p);
  }

  Status alloc(size_t bytes, void** ptr, const char* what) {
    SPARSE_MLA_RETURN_IF_ERROR(
        cuda_status(cudaMalloc(ptr, std::max<size_t>(bytes, 16)),
                    std::string("cudaMalloc(") + what + ", " + std::to_string(bytes) + " bytes)"));
    allocations_.push_back(*ptr);
    return Status::Ok();
  }

  Status upload(const TensorView& host, const char* what, TensorView* dev) {
    const size_t bytes = static_cast<size_t>(span_elements(host)) * dtype_size(host.dtype);
    *dev = host;
    SPARSE_MLA_RETURN_IF_ERROR(alloc(bytes, &dev->data, what));
    dev->device = Device{DeviceType::kCUDA, device_};
    return cuda_status(cudaMemcpy(dev->data, host.data, bytes, cudaMemcpyHostToDevice),
                       std::string("copying ") + what + " to the GPU");
  }

  Status upload(const KVCache& host, const char* what, KVCache* dev) {
    const size_t bytes = static_cast<size_t>(host.num_pages * host.page_stride);
    *dev = host;
    SPARSE_MLA_RETURN_IF_ERROR(alloc(bytes, &dev->data, what));
    dev->device = Device{DeviceType::kCUDA, device_};
    return cuda_status(cudaMemcpy(dev->data, host.data, bytes, cudaMemcpyHostToDevice),
                       std::string("copying ") + what + " to the GPU");
  }

  static Status download(const TensorView& dev, const TensorView& host, const char* what) {
    const size_t bytes = static_cast<size_t>(span_elements(host)) * dtype_size(host.dtype);
    return cuda_status(cudaMemcpy(host.data, dev.data, bytes, cudaMemcpyDeviceToHost),
                       std::string("copying ") + what + " back from the GPU");
  }

 private:
  int device_;
  std::vector<void*> allocations_;
};
#endif

// ---- The simulated step ----

// One paged cache with each request's pages scattered over the pool in random order, as an
// engine's allocator leaves them. The last page is never named by a table: it stays NaN.
struct PagedCache {
  ref::HostCache cache;
  std::vector<std::vector<int32_t>> pages;  // pages[i][logical page] = physical page, -1 if none
  int32_t poison_page = 0;
  int64_t page_size = 0;

  int32_t slot(int64_t request, int64_t position) const {
    const int32_t page = pages[request][position / page_size];
    return static_cast<int32_t>(page * page_size + position % page_size);
  }
};

// needed[i] = the logical pages request i holds (true = allocated).
PagedCache make_paged_cache(int64_t page_size, const std::vector<std::vector<bool>>& needed,
                            ref::Rng& rng) {
  PagedCache pc;
  pc.page_size = page_size;
  int64_t total = 0;
  for (const auto& n : needed) total += std::count(n.begin(), n.end(), true);
  std::vector<int32_t> physical(total);
  std::iota(physical.begin(), physical.end(), 0);
  for (int64_t k = total - 1; k > 0; --k) std::swap(physical[k], physical[rng.below(k + 1)]);
  size_t next = 0;
  pc.pages.resize(needed.size());
  for (size_t i = 0; i < needed.size(); ++i) {
    pc.pages[i].assign(needed[i].size(), -1);
    for (size_t p = 0; p < needed[i].size(); ++p) {
      if (needed[i][p]) pc.pages[i][p] = physical[next++];
    }
  }
  pc.poison_page = static_cast<int32_t>(total);
  ref::CacheConfig cfg;
  cfg.format = KVFormat::kModel1;
  cfg.num_pages = total + 1;
  cfg.page_size = page_size;
  pc.cache = ref::HostCache(cfg);  // every byte 0xFF (NaN) until written
  return pc;
}

struct Step {
  int64_t b = 0, s_q = 1, h_q = 0, c4_topk = 0, c128_topk = 1;
  std::vector<int64_t> lens;  // tokens per request; query token s sits at lens[i] - s_q + s
  PagedCache window, c4, c128;
  ref::HostTensor window_idx, c4_idx, c128_idx, c128_len;

  int64_t position(int64_t i, int64_t s) const { return lens[i] - s_q + s; }
};

// Bytes of host memory the step takes (the caches, the index tensors, a layer's q and its two
// output copies), to refuse runs this machine cannot hold.
double estimate_bytes(const Config& cfg) {
  const double b = static_cast<double>(cfg.batch);
  const double l = static_cast<double>(cfg.context) * 1.25;
  const double window_pages = b * 2 + 1;
  const double c4_pages = b * (std::ceil(l / 4 / kC4Page) + 1) + 1;
  const double c128_pages = b * (std::ceil(l / 128 / kC128Page) + 1) + 1;
  const double rows = b * (cfg.mtp ? 2 : 1);  // query tokens
  const double index_bytes = rows * (kWindow + static_cast<double>(cfg.c4_topk) + l / 128) * 4;
  const double row_bytes = rows * static_cast<double>(cfg.h_q) * (3 * kDV * 2 + 2 * 4);
  return window_pages * ref::default_page_stride(KVFormat::kModel1, kWindowPage) +
         c4_pages * ref::default_page_stride(KVFormat::kModel1, kC4Page) +
         c128_pages * ref::default_page_stride(KVFormat::kModel1, kC128Page) + index_bytes +
         row_bytes;
}

// Quantize-stores random latent rows into `slots` of a cache through the library (CPU backend),
// kStoreChunk rows per call; with a device cache, the CUDA backend stores the same rows there.
Status store_rows(const std::string& stage, const std::vector<int32_t>& slots, uint64_t seed,
                  PagedCache& pc, Progress& progress, const KVCache* device_cache,
                  void* device_rows, void* device_slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  ref::HostTensor rows = ref::make_tensor(DType::kBFloat16, {kStoreChunk, kDV});
  std::vector<int32_t> chunk_slots(kStoreChunk);
  progress.update(stage, 0, n);
  for (int64_t start = 0; start < n; start += kStoreChunk) {
    const int64_t count = std::min(kStoreChunk, n - start);
    auto* dst = static_cast<uint16_t*>(rows.data());
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < count; ++r) {
      // One generator per row: deterministic for a seed whatever the thread count.
      ref::Rng rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(start + r));
      float values[kDV];
      ref::random_row(rng, kDV, values);
      for (int d = 0; d < kDV; ++d) dst[r * kDV + d] = ref::ref_float_to_bf16(values[d]);
    }
    std::copy_n(slots.begin() + start, count, chunk_slots.begin());
    QuantizeStoreArgs args;
    args.src = TensorView::contiguous(rows.data(), DType::kBFloat16, Device{}, {count, kDV});
    args.slots = TensorView::contiguous(chunk_slots.data(), DType::kInt32, Device{}, {count});
    args.kv = pc.cache.desc();
    Status st = quantize_store(args, Options{Backend::kCPU, nullptr});
    if (!st.ok()) return Status(st.code(), "quantize_store (cpu): " + st.message());
#if SPARSE_MLA_WITH_CUDA
    if (device_cache != nullptr) {
      const size_t row_bytes = static_cast<size_t>(count * kDV * 2);
      SPARSE_MLA_RETURN_IF_ERROR(cuda_status(
          cudaMemcpy(device_rows, rows.data(), row_bytes, cudaMemcpyHostToDevice), "rows"));
      SPARSE_MLA_RETURN_IF_ERROR(cuda_status(
          cudaMemcpy(device_slots, chunk_slots.data(), count * 4, cudaMemcpyHostToDevice),
          "slots"));
      Device gpu{DeviceType::kCUDA, device_cache->device.index};
      args.src = TensorView::contiguous(device_rows, DType::kBFloat16, gpu, {count, kDV});
      args.slots = TensorView::contiguous(device_slots, DType::kInt32, gpu, {count});
      args.kv = *device_cache;
      st = quantize_store(args, Options{Backend::kCUDA, nullptr});
      if (!st.ok()) return Status(st.code(), "quantize_store (cuda): " + st.message());
    }
#else
    (void)device_cache, (void)device_rows, (void)device_slots;
#endif
    progress.update(stage, start + count, n);
  }
  return Status::Ok();
}

// Lays out the step: request lengths, page tables, index tensors (no cache data yet).
void plan_step(const Config& cfg, Step* st) {
  ref::Rng rng(cfg.seed);
  st->b = cfg.batch;
  st->s_q = cfg.mtp ? 2 : 1;
  st->h_q = cfg.h_q;
  st->c4_topk = cfg.c4_topk;
  st->lens.resize(cfg.batch);
  for (auto& len : st->lens) {
    const double f = rng.uniform(0.75, 1.25);
    len = std::max<int64_t>(st->s_q, std::llround(static_cast<double>(cfg.context) * f));
  }
  const int64_t b = st->b, s_q = st->s_q;

  // Window: each request holds only the pages covering its last 128 + s_q - 1 positions.
  std::vector<std::vector<bool>> need(b), need4(b), need128(b);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t lo = std::max<int64_t>(0, st->lens[i] - s_q - (kWindow - 1));
    need[i].assign((st->lens[i] - 1) / kWindowPage + 1, false);
    for (int64_t p = lo / kWindowPage; p <= (st->lens[i] - 1) / kWindowPage; ++p) need[i][p] = true;
    const int64_t n4 = st->lens[i] / 4, n128 = st->lens[i] / 128;
    need4[i].assign((n4 + kC4Page - 1) / kC4Page, true);
    need128[i].assign((n128 + kC128Page - 1) / kC128Page, true);
    st->c128_topk = std::max(st->c128_topk, n128);
  }
  st->window = make_paged_cache(kWindowPage, need, rng);
  st->c4 = make_paged_cache(kC4Page, need4, rng);
  st->c128 = make_paged_cache(kC128Page, need128, rng);

  // Window indices: the 128 positions up to and including the query's own, -1 before the start.
  st->window_idx = ref::make_tensor(DType::kInt32, {b, s_q, kWindow});
  auto* wi = static_cast<int32_t*>(st->window_idx.data());
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t j = 0; j < kWindow; ++j) {
        const int64_t p = st->position(i, s) - (kWindow - 1) + j;
        wi[(i * s_q + s) * kWindow + j] = p < 0 ? -1 : st->window.slot(i, p);
      }
    }
  }

  // C4: the indexer's top-k, here a random choice among the entries complete at the query's
  // position, in random order; -1 where fewer entries exist than top-k.
  const int64_t k4 = st->c4_topk;
  st->c4_idx = ref::make_tensor(DType::kInt32, {b, s_q, k4});
  auto* ci = static_cast<int32_t*>(st->c4_idx.data());
  std::vector<int32_t> pool;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      const int64_t avail = (st->position(i, s) + 1) / 4;
      const int64_t k = std::min(k4, avail);
      pool.resize(avail);
      std::iota(pool.begin(), pool.end(), 0);
      for (int64_t j = 0; j < k; ++j) std::swap(pool[j], pool[j + rng.below(avail - j)]);
      int32_t* row = ci + (i * s_q + s) * k4;
      for (int64_t j = 0; j < k4; ++j) row[j] = j < k ? st->c4.slot(i, pool[j]) : -1;
    }
  }

  // C128: every entry in order, with per-request lengths; entries past a request's length point
  // at the never-written (NaN) page, so reading them would show.
  const int64_t k128 = st->c128_topk;
  st->c128_idx = ref::make_tensor(DType::kInt32, {b, s_q, k128});
  auto* xi = static_cast<int32_t*>(st->c128_idx.data());
  std::vector<int32_t> lengths(b);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n128 = st->lens[i] / 128;
    lengths[i] = static_cast<int32_t>(n128);
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t j = 0; j < k128; ++j) {
        xi[(i * s_q + s) * k128 + j] =
            j < n128 ? st->c128.slot(i, j)
                     : static_cast<int32_t>(st->c128.poison_page * kC128Page + j % kC128Page);
      }
    }
  }
  st->c128_len = ref::make_int_tensor(lengths);
}

// The slots whose rows an engine holds: window positions, every C4 and C128 entry.
std::vector<int32_t> window_slots(const Step& st) {
  std::vector<int32_t> slots;
  for (int64_t i = 0; i < st.b; ++i) {
    const int64_t lo = std::max<int64_t>(0, st.lens[i] - st.s_q - (kWindow - 1));
    for (int64_t p = lo; p < st.lens[i]; ++p) slots.push_back(st.window.slot(i, p));
  }
  return slots;
}

std::vector<int32_t> entry_slots(const Step& st, const PagedCache& pc, int64_t divisor) {
  std::vector<int32_t> slots;
  for (int64_t i = 0; i < st.b; ++i) {
    for (int64_t e = 0; e < st.lens[i] / divisor; ++e) slots.push_back(pc.slot(i, e));
  }
  return slots;
}

// ---- One layer ----

struct Layer {
  const char* name;
  const PagedCache* extra = nullptr;
  const ref::HostTensor* extra_idx = nullptr;
  const ref::HostTensor* extra_len = nullptr;
};

struct LayerResult {
  std::string name;
  int64_t attended = 0;
  TimingStats time;
  double gflops = 0;
  ref::CompareResult cmp;
  std::string verified;  // "4/4 requests"
  std::string error;     // set when the layer did not run
  bool ok() const { return error.empty() && cmp.ok; }
};

// Valid entries (inside the cache, within the length) of an index tensor, over all query tokens.
int64_t count_attended(const ref::HostTensor& idx, const ref::HostTensor* len, int64_t num_slots) {
  const int64_t b = idx.shape()[0], s_q = idx.shape()[1], k = idx.shape()[2];
  const auto* v = static_cast<const int32_t*>(idx.data());
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) {
    int64_t n = k;
    if (len) n = std::clamp<int64_t>(static_cast<const int32_t*>(len->data())[i], 0, k);
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t j = 0; j < n; ++j) {
        const int32_t slot = v[(i * s_q + s) * k + j];
        total += slot >= 0 && slot < num_slots;
      }
    }
  }
  return total;
}

// Every k-th request of a [b, ...] view.
TensorView every_kth(TensorView t, int64_t k) {
  t.shape[0] = (t.shape[0] + k - 1) / k;
  t.strides[0] *= k;
  return t;
}

struct Runner {
  const Config& cfg;
  const Step& st;
  Backend backend;  // kCPU, kCUDA or kSM90 after resolution
#if SPARSE_MLA_WITH_CUDA
  DeviceMirror* mirror = nullptr;
  cudaStream_t stream = nullptr;
  KVCache dev_window{}, dev_c4{}, dev_c128{};
#endif

  LayerResult run(const Layer& layer, uint64_t layer_seed) {
    LayerResult res;
    res.name = layer.name;
    ref::Rng rng(layer_seed);
    const int64_t b = st.b, s_q = st.s_q, h_q = st.h_q;
    ref::HostTensor q = ref::random_tensor(rng, DType::kBFloat16, {b, s_q, h_q, kDV}, -1.0, 1.0);
    std::vector<float> sink_values(h_q);
    for (float& v : sink_values) v = static_cast<float>(rng.normal());
    ref::HostTensor sink = ref::make_float_tensor(sink_values);
    ref::HostTensor out = ref::make_out(DType::kBFloat16, b, s_q, h_q);
    ref::HostTensor lse = ref::make_lse(b, h_q, s_q, /*flash_sparse_layout=*/true);

    SparseDecodeArgs host;
    host.q = q.view();
    host.kv = st.window.cache.desc();
    host.indices = st.window_idx.view();
    if (layer.extra) {
      host.extra_kv = layer.extra->cache.desc();
      host.extra_indices = layer.extra_idx->view();
      if (layer.extra_len) host.extra_topk_length = layer.extra_len->view();
    }
    host.attn_sink = sink.view();
    host.out = out.view();
    host.lse = lse.view();

    res.attended = count_attended(st.window_idx, nullptr, st.window.cache.num_slots());
    if (layer.extra) {
      res.attended +=
          count_attended(*layer.extra_idx, layer.extra_len, layer.extra->cache.num_slots());
    }

    Status status = execute(host, layer, &res.time);
    if (!status.ok()) {
      res.error = status.to_string();
      return res;
    }
    res.gflops = 2.0 * static_cast<double>(h_q) * static_cast<double>(res.attended) * (kDV + kDV) /
                 (res.time.median_us * 1e3);
    verify(host, &res);
    return res;
  }

  // Plans, runs once for verification (outputs poisoned), then times. Leaves the verified output
  // in host.out / host.lse.
  Status execute(const SparseDecodeArgs& host, const Layer& layer, TimingStats* time) {
    TimingPlan plan;
    std::vector<double> us;
    if (backend == Backend::kCPU) {
      const Options opts{Backend::kCPU, nullptr};
      SPARSE_MLA_RETURN_IF_ERROR(sparse_decode_plan(host, Workspace{}, opts));
      SPARSE_MLA_RETURN_IF_ERROR(sparse_decode(host, Workspace{}, opts));
      // Timed runs write a scratch copy so the verified output stays as the first run left it.
      ref::HostTensor out2 = ref::make_out(DType::kBFloat16, st.b, st.s_q, st.h_q);
      ref::HostTensor lse2 = ref::make_lse(st.b, st.h_q, st.s_q, true);
      SparseDecodeArgs timed = host;
      timed.out = out2.view();
      timed.lse = lse2.view();
      plan.warmup = 0;
      plan.runs = cfg.runs > 0 ? cfg.runs : 3;
      plan.min_runs = plan.runs;
      SPARSE_MLA_RETURN_IF_ERROR(
          time_cpu([&] { return sparse_decode(timed, Workspace{}, opts); }, plan, &us));
      *time = summarize(us);
      return Status::Ok();
    }
#if SPARSE_MLA_WITH_CUDA
    if (mirror == nullptr) {
      return Status::Internal(std::string("sparse-mla run: no device caches for backend ") +
                              backend_name(backend));
    }
    const int dev = 0;
    SparseDecodeArgs d = host;
    SPARSE_MLA_RETURN_IF_ERROR(mirror->upload(host.q, "q", &d.q));
    SPARSE_MLA_RETURN_IF_ERROR(mirror->upload(host.indices, "indices", &d.indices));
    d.kv = dev_window;
    if (layer.extra) {
      d.extra_kv = layer.extra == &st.c4 ? dev_c4 : dev_c128;
      SPARSE_MLA_RETURN_IF_ERROR(
          mirror->upload(*host.extra_indices, "extra_indices", &*d.extra_indices));
      if (host.extra_topk_length) {
        SPARSE_MLA_RETURN_IF_ERROR(
            mirror->upload(*host.extra_topk_length, "extra_topk_length", &*d.extra_topk_length));
      }
    }
    SPARSE_MLA_RETURN_IF_ERROR(mirror->upload(*host.attn_sink, "attn_sink", &*d.attn_sink));
    SPARSE_MLA_RETURN_IF_ERROR(mirror->upload(host.out, "out", &d.out));  // NaN-poisoned
    SPARSE_MLA_RETURN_IF_ERROR(mirror->upload(host.lse, "lse", &d.lse));
    const Options opts{backend, stream};
    WorkspaceSizes sizes;
    SPARSE_MLA_RETURN_IF_ERROR(sparse_decode_workspace_size(d, opts, &sizes));
    Workspace ws;
    SPARSE_MLA_RETURN_IF_ERROR(mirror->alloc(sizes.plan_bytes, &ws.plan, "workspace.plan"));
    SPARSE_MLA_RETURN_IF_ERROR(
        mirror->alloc(sizes.scratch_bytes, &ws.scratch, "workspace.scratch"));
    ws.plan_bytes = sizes.plan_bytes;
    ws.scratch_bytes = sizes.scratch_bytes;
    SPARSE_MLA_RETURN_IF_ERROR(sparse_decode_plan(d, ws, opts));
    SPARSE_MLA_RETURN_IF_ERROR(sparse_decode(d, ws, opts));
    SPARSE_MLA_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream), "sparse_decode"));
    SPARSE_MLA_RETURN_IF_ERROR(DeviceMirror::download(d.out, host.out, "out"));
    SPARSE_MLA_RETURN_IF_ERROR(DeviceMirror::download(d.lse, host.lse, "lse"));
    GpuTimer timer;
    SPARSE_MLA_RETURN_IF_ERROR(timer.init(dev, stream));
    plan.warmup = 3;
    plan.runs = cfg.runs > 0 ? cfg.runs : 20;
    plan.min_runs = plan.runs;
    SPARSE_MLA_RETURN_IF_ERROR(
        timer.time([&] { return sparse_decode(d, ws, opts); }, plan, false, &us));
    *time = summarize(us);
    return Status::Ok();
#else
    (void)layer;
    return Status::Unsupported("this build has no CUDA backend");
#endif
  }

  // Every output finite (poisoned elements left unwritten show as NaN), then the reference on
  // all requests, or on every k-th when the reference would take too long.
  void verify(const SparseDecodeArgs& host, LayerResult* res) {
    int64_t rows = kWindow * st.s_q;
    if (host.extra_indices) rows += host.extra_indices->shape[2] * st.s_q;
    const double per_request = static_cast<double>(rows * st.h_q * kDV);
    int64_t k = 1;
    if (!cfg.verify_all) {
      k = std::max<int64_t>(1,
                            static_cast<int64_t>(std::ceil(per_request * st.b / kReferenceBudget)));
    }
    SparseDecodeArgs sub = host;
    sub.q = every_kth(host.q, k);
    sub.indices = every_kth(host.indices, k);
    if (host.topk_length) sub.topk_length = every_kth(*host.topk_length, k);
    if (host.extra_indices) sub.extra_indices = every_kth(*host.extra_indices, k);
    if (host.extra_topk_length) sub.extra_topk_length = every_kth(*host.extra_topk_length, k);
    sub.out = every_kth(host.out, k);
    sub.lse = every_kth(host.lse, k);
    const ref::RefOutput expected = ref::sparse_decode_reference(sub);
    res->cmp = ref::compare_outputs(sub.out, sub.lse, expected, ref::Tolerance::sparse());
    res->verified = std::to_string(sub.q.shape[0]) + "/" + std::to_string(st.b) + " requests";

    int64_t non_finite = 0;
    for (int64_t i = 0; i < st.b; ++i) {
      for (int64_t s = 0; s < st.s_q; ++s) {
        for (int64_t h = 0; h < st.h_q; ++h) {
          non_finite += !std::isfinite(ref::load(host.lse, {i, h, s}));
          for (int64_t dv = 0; dv < kDV; ++dv) {
            non_finite += !std::isfinite(ref::load(host.out, {i, s, h, dv}));
          }
        }
      }
    }
    if (non_finite > 0) {
      res->cmp.ok = false;
      res->cmp.message = std::to_string(non_finite) +
                         " output elements are not finite (unwritten or NaN leaked)" +
                         (res->cmp.message.empty() ? "" : "; " + res->cmp.message);
    }
  }
};

// Picks the backend: --backend, else SPARSE_MLA_BACKEND, else CUDA when usable, else CPU.
Status resolve_backend(const Config& cfg, Backend* chosen, std::string* device_desc) {
  Backend want = cfg.backend;
  if (want == Backend::kAuto) {
    if (const char* env = std::getenv("SPARSE_MLA_BACKEND"); env && *env) {
      Status s = parse_backend(env, &want);
      if (!s.ok())
        return Status::InvalidArgument("environment variable SPARSE_MLA_BACKEND: " + s.message());
    }
  }
  const std::vector<Backend> have = available_backends();
  const bool cuda_ok = std::find(have.begin(), have.end(), Backend::kCUDA) != have.end();
  const bool sm90_ok = std::find(have.begin(), have.end(), Backend::kSM90) != have.end();
  if (want == Backend::kAuto) want = sm90_ok ? Backend::kSM90 : (cuda_ok ? Backend::kCUDA : Backend::kCPU);
  if (want == Backend::kSM90 && !sm90_ok) {
    return Status::Unsupported(
        "backend sm90: needs an sm_90 (Hopper) GPU and a build with 90a in SPARSE_MLA_CUDA_ARCHS");
  }
  if (want == Backend::kCUDA && !cuda_ok) {
#if SPARSE_MLA_WITH_CUDA
    std::string why;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
      why = "no usable CUDA device";
    else
      why = "the GPU is not usable by this build (needs sm_80 or newer)";
    return Status::Unsupported("backend cuda: " + why);
#else
    return Status::Unsupported("backend cuda: this build has no CUDA backend (built without nvcc)");
#endif
  }
  *chosen = want;
  *device_desc = "the host, " + std::to_string(omp_get_max_threads()) + " OpenMP threads";
#if SPARSE_MLA_WITH_CUDA
  if (want != Backend::kCPU) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      *device_desc = std::string(prop.name) + " (sm_" +
                     std::to_string(prop.major * 10 + prop.minor) + ", " +
                     std::to_string(prop.multiProcessorCount) + " SMs)";
    }
  }
#endif
  return Status::Ok();
}

std::string fmt_double(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

int run_command(int argc, char** argv) {
  Config cfg;
  if (int rc = parse_args(argc, argv, &cfg); rc >= 0) return rc;

  const double need = estimate_bytes(cfg);
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > 0.6 * have) {
    return usage_error("--batch " + std::to_string(cfg.batch) + " --context " +
                       std::to_string(cfg.context) + ": the step needs about " +
                       fmt_double("%.1f", need / (1 << 30)) + " GiB, expected at most " +
                       fmt_double("%.1f", 0.6 * have / (1 << 30)) +
                       " GiB (60% of this machine's memory)");
  }

  Backend backend = Backend::kCPU;
  std::string device_desc;
  if (Status s = resolve_backend(cfg, &backend, &device_desc); !s.ok()) {
    std::fprintf(stderr, "sparse-mla run: %s\n", s.to_string().c_str());
    return 1;
  }

  Step st;
  plan_step(cfg, &st);
  const auto [min_len, max_len] = std::minmax_element(st.lens.begin(), st.lens.end());
  std::printf(
      "sparse-mla run: %s decode step: %lld query heads, batch %lld, context %lld "
      "(per request %lld..%lld), s_q %lld%s, seed %llu\n",
      cfg.model.c_str(), static_cast<long long>(st.h_q), static_cast<long long>(st.b),
      static_cast<long long>(cfg.context), static_cast<long long>(*min_len),
      static_cast<long long>(*max_len), static_cast<long long>(st.s_q), cfg.mtp ? " (MTP)" : "",
      static_cast<unsigned long long>(cfg.seed));
  std::printf("backend: %s on %s\n", backend_name(backend), device_desc.c_str());
  std::fflush(stdout);

  bool all_ok = true;
  Progress progress;
  const std::vector<int32_t> wslots = window_slots(st);
  const std::vector<int32_t> c4slots = entry_slots(st, st.c4, 4);
  const std::vector<int32_t> c128slots = entry_slots(st, st.c128, 128);

  Runner runner{cfg, st, backend};
  Status build = Status::Ok();
#if SPARSE_MLA_WITH_CUDA
  std::unique_ptr<DeviceMirror> mirror;
  cudaStream_t stream = nullptr;
  std::string store_check;
  if (backend != Backend::kCPU) {  // cuda or sm90: caches on the GPU
    mirror = std::make_unique<DeviceMirror>(0);
    build = cuda_status(cudaSetDevice(0), "cudaSetDevice");
    if (build.ok()) build = cuda_status(cudaStreamCreate(&stream), "cudaStreamCreate");
    void *rows = nullptr, *slots = nullptr;
    if (build.ok()) build = mirror->alloc(kStoreChunk * kDV * 2, &rows, "quantize rows");
    if (build.ok()) build = mirror->alloc(kStoreChunk * 4, &slots, "quantize slots");
    // The caches are written on both sides from the same rows; the device copy must come out
    // byte-identical to the CPU one.
    struct Item {
      const char* stage;
      PagedCache* pc;
      const std::vector<int32_t>* slots;
      KVCache* dev;
    } items[] = {{"window", &st.window, &wslots, &runner.dev_window},
                 {"C4", &st.c4, &c4slots, &runner.dev_c4},
                 {"C128", &st.c128, &c128slots, &runner.dev_c128}};
    uint64_t salt = 1;
    for (Item& it : items) {
      if (!build.ok()) break;
      build = mirror->upload(it.pc->cache.desc(), it.stage, it.dev);  // all 0xFF, like the host
      if (build.ok()) {
        build = store_rows(it.stage, *it.slots, cfg.seed * 31 + salt++, *it.pc, progress, it.dev,
                           rows, slots);
      }
    }
    if (build.ok()) {
      int64_t mismatched = 0, compared = 0;
      for (Item& it : items) {
        std::vector<uint8_t> back(it.pc->cache.bytes());
        build =
            cuda_status(cudaMemcpy(back.data(), it.dev->data, back.size(), cudaMemcpyDeviceToHost),
                        "copying a cache back");
        if (!build.ok()) break;
        const auto* host = static_cast<const uint8_t*>(it.pc->cache.desc().data);
        for (size_t k = 0; k < back.size(); ++k) mismatched += back[k] != host[k];
        compared += static_cast<int64_t>(back.size());
        // Decode reads the CPU-written bytes, so its check does not depend on this one.
        if (build.ok()) {
          build = cuda_status(cudaMemcpy(it.dev->data, host, back.size(), cudaMemcpyHostToDevice),
                              "copying a cache to the GPU");
        }
      }
      if (build.ok()) {
        store_check = "quantize_store: cuda and cpu caches " +
                      std::string(mismatched ? "DIFFER in " + std::to_string(mismatched) + " of "
                                             : "identical, ") +
                      std::to_string(compared) + " bytes: " + (mismatched ? "FAIL" : "PASS");
        all_ok = all_ok && mismatched == 0;
      }
    }
    runner.mirror = mirror.get();
    runner.stream = stream;
  } else
#endif
  {
    uint64_t salt = 1;
    for (auto [stage, pc, slots] :
         {std::tuple{"window", &st.window, &wslots}, std::tuple{"C4", &st.c4, &c4slots},
          std::tuple{"C128", &st.c128, &c128slots}}) {
      build = store_rows(stage, *slots, cfg.seed * 31 + salt++, *pc, progress, nullptr, nullptr,
                         nullptr);
      if (!build.ok()) break;
    }
  }
  if (!build.ok()) {
    std::fprintf(stderr, "sparse-mla run: building the caches failed: %s\n",
                 build.to_string().c_str());
#if SPARSE_MLA_WITH_CUDA
    if (stream) cudaStreamDestroy(stream);
#endif
    return 1;
  }

  auto mib = [](const PagedCache& pc) { return static_cast<double>(pc.cache.bytes()) / (1 << 20); };
  std::printf(
      "caches (MODEL1): window %lld pages x %lld tokens (%.1f MiB), C4 %lld x %lld "
      "(%.1f MiB), C128 %lld x %lld (%.1f MiB); %zu + %zu + %zu rows stored\n",
      static_cast<long long>(st.window.cache.config().num_pages),
      static_cast<long long>(kWindowPage), mib(st.window),
      static_cast<long long>(st.c4.cache.config().num_pages), static_cast<long long>(kC4Page),
      mib(st.c4), static_cast<long long>(st.c128.cache.config().num_pages),
      static_cast<long long>(kC128Page), mib(st.c128), wslots.size(), c4slots.size(),
      c128slots.size());
#if SPARSE_MLA_WITH_CUDA
  if (!store_check.empty()) std::printf("%s\n", store_check.c_str());
#endif

  const Layer layers[] = {
      {"window", nullptr, nullptr, nullptr},
      {"C4", &st.c4, &st.c4_idx, nullptr},
      {"C128", &st.c128, &st.c128_idx, &st.c128_len},
  };
  std::printf("\n%-7s %-7s %10s %5s %7s %12s %10s %9s %9s %9s %-16s %s\n", "layer", "backend",
              "attended", "win_k", "extra_k", "time_us", "GFLOP/s", "max_err", "cos_diff",
              "lse_err", "verified", "result");
  std::fflush(stdout);
  uint64_t layer_seed = cfg.seed * 1000003 + 17;
  for (const Layer& layer : layers) {
    LayerResult r = runner.run(layer, layer_seed++);
    const int64_t extra_topk = layer.extra_idx ? layer.extra_idx->shape()[2] : 0;
    if (!r.error.empty()) {
      std::printf("%-7s %-7s %10lld %5lld %7lld %12s %10s %9s %9s %9s %-16s FAIL: %s\n",
                  r.name.c_str(), backend_name(backend), static_cast<long long>(r.attended),
                  static_cast<long long>(kWindow), static_cast<long long>(extra_topk), "-", "-",
                  "-", "-", "-", "-", r.error.c_str());
    } else {
      std::printf("%-7s %-7s %10lld %5lld %7lld %12.1f %10.1f %9.2e %9.2e %9.2e %-16s %s%s\n",
                  r.name.c_str(), backend_name(backend), static_cast<long long>(r.attended),
                  static_cast<long long>(kWindow), static_cast<long long>(extra_topk),
                  r.time.median_us, r.gflops, r.cmp.max_abs_err, r.cmp.cos_diff, r.cmp.max_lse_err,
                  r.verified.c_str(),
                  r.ok() ? "PASS" : "FAIL: ", r.ok() ? "" : r.cmp.message.c_str());
    }
    std::fflush(stdout);
    all_ok = all_ok && r.ok();
  }
#if SPARSE_MLA_WITH_CUDA
  runner.mirror = nullptr;
  mirror.reset();
  if (stream) cudaStreamDestroy(stream);
#endif
  std::printf("\n%s\n", all_ok ? "PASS: every layer type matches the fp64 reference"
                               : "FAIL: see the rows above");
  return all_ok ? 0 : 1;
}

}  // namespace sparse_mla::tools
