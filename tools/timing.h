// Timing helpers shared by the command-line tools: run statistics, a steady-clock CPU timer and,
// in CUDA builds, a GPU timer that flushes L2 before each run and times with CUDA events
// (optionally replaying a CUDA graph). The method is documented in docs/benchmarking.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "sparse_mla/status.h"

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sparse_mla::tools {

struct TimingStats {
  int runs = 0;
  double median_us = 0, mean_us = 0, min_us = 0, max_us = 0;
  double p10_us = 0, p90_us = 0;  // nearest-rank percentiles: the spread without the outliers
  double stdev_us = 0;
};

inline TimingStats summarize(std::vector<double> us) {
  TimingStats s;
  s.runs = static_cast<int>(us.size());
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  s.min_us = us.front();
  s.max_us = us.back();
  s.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  auto rank = [&](double p) {
    size_t k = static_cast<size_t>(std::ceil(p * static_cast<double>(n)));
    return us[std::min(n - 1, k == 0 ? 0 : k - 1)];
  };
  s.p10_us = rank(0.10);
  s.p90_us = rank(0.90);
  double sum = 0;
  for (double v : us) sum += v;
  s.mean_us = sum / static_cast<double>(n);
  double var = 0;
  for (double v : us) var += (v - s.mean_us) * (v - s.mean_us);
  s.stdev_us = n > 1 ? std::sqrt(var / static_cast<double>(n - 1)) : 0.0;
  return s;
}

// How many runs to time and how long to keep going. A slow backend stops after `budget_s` of timed
// runs once it has `min_runs`; the number actually taken is reported with the result.
struct TimingPlan {
  int warmup = 3;
  int runs = 20;
  int min_runs = 3;
  double budget_s = 1e30;
};

// Times fn() with std::chrono::steady_clock. fn returns a Status; the first failure stops timing.
inline Status time_cpu(const std::function<Status()>& fn, const TimingPlan& plan,
                       std::vector<double>* us) {
  us->clear();
  for (int i = 0; i < plan.warmup; ++i) SPARSE_MLA_RETURN_IF_ERROR(fn());
  double spent_s = 0;
  for (int i = 0; i < plan.runs; ++i) {
    if (i >= plan.min_runs && spent_s >= plan.budget_s) break;
    auto t0 = std::chrono::steady_clock::now();
    SPARSE_MLA_RETURN_IF_ERROR(fn());
    auto t1 = std::chrono::steady_clock::now();
    double s = std::chrono::duration<double>(t1 - t0).count();
    spent_s += s;
    us->push_back(s * 1e6);
  }
  return Status::Ok();
}

#if SPARSE_MLA_WITH_CUDA

inline Status cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::DeviceError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

// GPU timer. Each timed run is: a memset of a buffer of >= 2x the L2 size (evicts everything the
// previous run left in L2), a start event, the operation (all kernels of one call), a stop event.
// The host enqueues the operation while the memset runs, so host-side launch overhead is hidden
// unless it exceeds the memset's duration, as it is in an engine that keeps the GPU busy.
class GpuTimer {
 public:
  GpuTimer() = default;
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  ~GpuTimer() { release(); }

  // flush_bytes 0: 2x the device's L2 size.
  Status init(int device, cudaStream_t stream, size_t flush_bytes = 0) {
    release();
    stream_ = stream;
    SPARSE_MLA_RETURN_IF_ERROR(cuda_check(cudaSetDevice(device), "cudaSetDevice"));
    int l2 = 0;
    SPARSE_MLA_RETURN_IF_ERROR(
        cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size"));
    l2_bytes_ = static_cast<size_t>(l2);
    flush_bytes_ = flush_bytes ? flush_bytes : std::max<size_t>(2 * l2_bytes_, 8u << 20);
    return cuda_check(cudaMalloc(&flush_, flush_bytes_), "cudaMalloc(L2 flush buffer)");
  }

  size_t l2_bytes() const { return l2_bytes_; }
  size_t flush_bytes() const { return flush_bytes_; }

  Status flush() {
    flush_value_ = (flush_value_ + 1) & 0xff;
    return cuda_check(cudaMemsetAsync(flush_, flush_value_, flush_bytes_, stream_), "L2 flush");
  }

  // `launch` enqueues the whole operation on the timer's stream without synchronizing. With
  // use_graph it is captured once into a CUDA graph, and each run replays the graph.
  Status time(const std::function<Status()>& launch, const TimingPlan& plan, bool use_graph,
              std::vector<double>* us) {
    us->clear();
    cudaGraphExec_t exec = nullptr;
    if (use_graph) SPARSE_MLA_RETURN_IF_ERROR(capture(launch, &exec));
    auto run_once = [&]() -> Status {
      if (exec) return cuda_check(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
      return launch();
    };
    Status st = time_runs(run_once, plan, us);
    if (exec) cudaGraphExecDestroy(exec);
    return st;
  }

 private:
  Status capture(const std::function<Status()>& launch, cudaGraphExec_t* exec) {
    SPARSE_MLA_RETURN_IF_ERROR(cuda_check(
        cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture"));
    Status inner = launch();
    cudaGraph_t graph = nullptr;
    Status end = cuda_check(cudaStreamEndCapture(stream_, &graph), "end capture");
    if (!inner.ok()) {
      if (graph) cudaGraphDestroy(graph);
      return Status(inner.code(), "while capturing a CUDA graph: " + inner.message());
    }
    SPARSE_MLA_RETURN_IF_ERROR(end);
    Status inst = cuda_check(cudaGraphInstantiate(exec, graph, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
    return inst;
  }

  Status time_runs(const std::function<Status()>& run_once, const TimingPlan& plan,
                   std::vector<double>* us) {
    for (int i = 0; i < plan.warmup; ++i) {
      SPARSE_MLA_RETURN_IF_ERROR(flush());
      SPARSE_MLA_RETURN_IF_ERROR(run_once());
    }
    SPARSE_MLA_RETURN_IF_ERROR(cuda_check(cudaStreamSynchronize(stream_), "warm-up"));
    // Runs go in batches so one slow case cannot queue thousands of events; the budget is checked
    // between batches against the GPU time measured so far.
    const int batch = 10;
    std::vector<cudaEvent_t> ev(2 * batch, nullptr);
    Status st;
    for (auto& e : ev) {
      st = cuda_check(cudaEventCreate(&e), "cudaEventCreate");
      if (!st.ok()) break;
    }
    double spent_s = 0;
    int done = 0;
    while (st.ok() && done < plan.runs && (done < plan.min_runs || spent_s < plan.budget_s)) {
      const int n = std::min(batch, plan.runs - done);
      for (int i = 0; i < n && st.ok(); ++i) {
        st = flush();
        if (st.ok()) st = cuda_check(cudaEventRecord(ev[2 * i], stream_), "cudaEventRecord");
        if (st.ok()) st = run_once();
        if (st.ok()) st = cuda_check(cudaEventRecord(ev[2 * i + 1], stream_), "cudaEventRecord");
      }
      if (st.ok()) st = cuda_check(cudaStreamSynchronize(stream_), "timed runs");
      for (int i = 0; i < n && st.ok(); ++i) {
        float ms = 0;
        st =
            cuda_check(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
        us->push_back(static_cast<double>(ms) * 1e3);
        spent_s += static_cast<double>(ms) * 1e-3;
      }
      done += n;
    }
    for (auto e : ev) {
      if (e) cudaEventDestroy(e);
    }
    return st;
  }

  void release() {
    if (flush_) cudaFree(flush_);
    flush_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
  void* flush_ = nullptr;
  size_t flush_bytes_ = 0;
  size_t l2_bytes_ = 0;
  int flush_value_ = 0;
};

#endif  // SPARSE_MLA_WITH_CUDA

}  // namespace sparse_mla::tools
