#include "tools/bench_env.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sparse_mla::tools::bench {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Twelve independent FMA chains per thread: enough to cover the FMA latency on two ports.
constexpr int kChains = 12;

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iters) {
  __m256 acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = _mm256_set1_ps(1.0f + 0.001f * static_cast<float>(k));
  const __m256 m = _mm256_set1_ps(0.9999999f), a = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < kChains; ++k) acc[k] = _mm256_fmadd_ps(acc[k], m, a);
  }
  __m256 sum = acc[0];
  for (int k = 1; k < kChains; ++k) sum = _mm256_add_ps(sum, acc[k]);
  float out[8];
  _mm256_storeu_ps(out, sum);
  return out[0];
}

__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iters) {
  __m512 acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = _mm512_set1_ps(1.0f + 0.001f * static_cast<float>(k));
  const __m512 m = _mm512_set1_ps(0.9999999f), a = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < kChains; ++k) acc[k] = _mm512_fmadd_ps(acc[k], m, a);
  }
  __m512 sum = acc[0];
  for (int k = 1; k < kChains; ++k) sum = _mm512_add_ps(sum, acc[k]);
  float out[16];
  _mm512_storeu_ps(out, sum);
  return out[0];
}
#endif

float fma_loop_scalar(int64_t iters, int lanes) {
  std::vector<float> acc(static_cast<size_t>(kChains * lanes), 1.0f);
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& v : acc) v = v * 0.9999999f + 1e-7f;
  }
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

double measure_gflops() {
#if defined(__x86_64__)
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool avx512 = false, avx2 = false;
#endif
  // The widest FMA this CPU has: the CPU backend dispatches to AVX-512 or AVX2 the same way.
  const int lanes = avx512 ? 16 : 8;
  const int64_t iters = avx512 || avx2 ? 4'000'000 : 400'000;
  double best = 0;
  float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    int threads = 1;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
    {
#pragma omp single
      threads = omp_get_num_threads();
#if defined(__x86_64__)
      float r = avx512 ? fma_loop_avx512(iters)
                : avx2 ? fma_loop_avx2(iters)
                       : fma_loop_scalar(iters, lanes);
#else
      float r = fma_loop_scalar(iters, lanes);
#endif
#pragma omp atomic
      sink += r;
    }
    const double s = seconds_since(t0);
    const double flops = 2.0 * kChains * lanes * static_cast<double>(iters) * threads;
    best = std::max(best, flops / s * 1e-9);
  }
  volatile float keep = sink;  // the loops' results must look used
  (void)keep;
  return best;
}

double measure_copy_gbps() {
  const size_t n = size_t{1} << 26;  // 64 Mi floats = 256 MiB per buffer, far beyond any L3
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
    a[i] = static_cast<float>(i & 1023);
    b[i] = 0;
  }
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) b[i] = a[i];
    const double s = seconds_since(t0);
    best = std::max(best, 2.0 * static_cast<double>(n) * sizeof(float) / s * 1e-9);
  }
  return best;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && s[i] == ' ') ++i;
  return s.substr(i);
}

// Output of a shell command (stderr dropped), "" when it fails.
std::string command_output(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return "";
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  if (pclose(p) != 0) return "";
  return trim(out);
}

}  // namespace

Ceilings measure_cpu_ceilings() {
  Ceilings c;
  c.bf16_tflops = measure_gflops() * 1e-3;  // the CPU backend computes in fp32
  c.gbps = measure_copy_gbps();
  c.source = "measured at the start of this run (fp32 FMA, parallel copy)";
  return c;
}

DeviceInfo cpu_info() {
  DeviceInfo d;
  d.kind = "cpu";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      d.name = trim(line.substr(line.find(':') + 1));
      break;
    }
  }
  if (d.name.empty()) d.name = "cpu";
  d.detail = std::to_string(omp_get_max_threads()) + " OpenMP threads";
  return d;
}

#if SPARSE_MLA_WITH_CUDA
DeviceInfo gpu_info(int device) {
  DeviceInfo d;
  d.kind = "cuda";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    d.name = "unknown CUDA device";
    return d;
  }
  d.name = prop.name;
  int clock_khz = 0, mem_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  d.detail = "sm_" + std::to_string(prop.major * 10 + prop.minor) + ", " +
             std::to_string(prop.multiProcessorCount) + " SMs, " +
             std::to_string(prop.l2CacheSize >> 20) + " MiB L2, " +
             std::to_string(prop.totalGlobalMem >> 30) + " GiB";
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  std::string nv = command_output(
      "nvidia-smi --query-gpu=driver_version --format=csv,noheader -i " + std::to_string(device));
  d.driver = (nv.empty() ? std::string() : nv + ", ") + "CUDA driver API " +
             std::to_string(drv / 1000) + "." + std::to_string(drv % 1000 / 10);
  d.runtime = "CUDA runtime " + std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10);
  std::string clocks = command_output(
      "nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.limit "
      "--format=csv,noheader -i " +
      std::to_string(device));
  d.clocks = clocks.empty() ? "" : "sm, mem, max sm, power limit: " + clocks + "; ";
  d.clocks += "peak sm " + std::to_string(clock_khz / 1000) + " MHz, memory " +
              std::to_string(mem_khz / 1000) + " MHz";
  if (d.name.find("H200") != std::string::npos) {
    // Source: targets.md, "measured ceilings" on the project's H200.
    d.ceilings = {790, 1270, 4300, "targets.md (measured on H200)"};
  } else if (mem_khz > 0 && bus_bits > 0) {
    d.ceilings.gbps = 2.0 * mem_khz * 1e3 * bus_bits / 8 * 1e-9;
    d.ceilings.source =
        "memory: theoretical from clocks and bus width; compute: unknown "
        "(give --gpu-peak)";
  }
  return d;
}
#endif

std::string git_commit() {
  if (const char* env = std::getenv("SPARSE_MLA_COMMIT"); env && *env) return env;
  std::string head = command_output("git rev-parse --short=10 HEAD");
  if (head.empty()) return "unknown";
  // Tracked files that differ from HEAD make the numbers not reproducible from the commit alone.
  if (std::system("git diff --quiet HEAD -- >/dev/null 2>&1") != 0) head += "-dirty";
  return head;
}

std::string utc_now(bool for_file) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, for_file ? "%Y%m%d-%H%M" : "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::string slug(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) {
      out += c;
    } else if (!out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "x" : out;
}

}  // namespace sparse_mla::tools::bench
