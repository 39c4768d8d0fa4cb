// What a benchmark run records (machine, ceilings, per-case results) and how it is written:
// a terminal table, JSON and CSV. Field meanings are documented in docs/benchmarking.md.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "tools/bench_cases.h"
#include "tools/bench_data.h"
#include "tools/timing.h"

namespace sparse_mla::tools::bench {

// Roofline ceilings of one device: measured, known for the device, or given on the command line.
struct Ceilings {
  double bf16_tflops = 0;  // 0: unknown
  double fp8_tflops = 0;
  double gbps = 0;
  std::string source;  // e.g. "targets.md (measured on H200)", "measured here", "command line"
};

struct DeviceInfo {
  std::string kind;  // "cuda" or "cpu"
  std::string name;
  std::string detail;  // compute capability and SMs / threads
  std::string driver;  // NVIDIA driver and CUDA driver API version
  std::string runtime;
  std::string clocks;  // SM / memory clocks at the start of the run, where readable
  Ceilings ceilings;
};

struct RunInfo {
  std::string date;     // ISO 8601, UTC
  std::string commit;   // git, "-dirty" when tracked files differ
  std::string command;  // the exact command line
  std::string host;
  std::string suite;   // "quick", "full" or the filter
  std::string verify;  // verification mode
  int runs = 0, warmup = 0;
  bool graph = false;
  std::vector<DeviceInfo> devices;  // the CPU always, the GPU when one is used
  std::string torch;                // torch version and device, "" without the baseline
};

struct Result {
  std::string backend;  // cpu, cuda, sm90, torch
  std::string status;   // ok, failed (wrong result), error (did not run), skipped
  std::string message;
  TimingStats time;
  std::optional<TimingStats> graph_time;  // CUDA graph replay, with --graph
  std::optional<TimingStats> span_time;   // kernel spans (GPU backends, builds with CUPTI)
  int span_kernels = 0;                   // kernels a call launched, from the same trace
  Verdict verdict;
  const Ceilings* ceilings = nullptr;
  bool on_gpu = false;  // FlashMLA's times are H200 figures: a ratio only means something on a GPU
};

struct Record {
  Case c;
  Work work;
  double build_s = 0;    // host time to build inputs and the reference
  std::string verified;  // what the reference check covered
  std::vector<Result> results;
};

// Derived metrics of a result (NaN when not applicable). us is the event-timed median; the
// speedup divides FlashMLA's time by ours taken as targets.md took FlashMLA's (speedup_basis:
// "events" or "kernel span"; events where no span was measured).
struct Metrics {
  double us, tflops, gbps, roofline_pct, speedup_vs_flashmla;
  const char* speedup_basis;
};
Metrics metrics(const Record& r, const Result& res);

void print_header(FILE* to);
void print_result(FILE* to, const Record& r, const Result& res);
void print_summary(FILE* to, const std::vector<Record>& records);

std::string to_json(const RunInfo& info, const std::vector<Record>& records);
std::string to_csv(const RunInfo& info, const std::vector<Record>& records);

// Progress on stderr: a bar redrawn in place on a terminal, plain lines otherwise.
class Progress {
 public:
  Progress(size_t total, bool enabled);
  void update(size_t done, const std::string& what, double fraction = -1);
  void clear();  // before printing a table row

 private:
  size_t total_;
  bool enabled_, tty_;
  size_t last_len_ = 0;
  std::string last_plain_;
};

}  // namespace sparse_mla::tools::bench
