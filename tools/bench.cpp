// `sparse-mla bench`: times every selected case on every selected backend after checking its
// result against the fp64 reference, and writes a table, JSON and CSV. See docs/benchmarking.md.
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "sparse_mla/sparse_mla.h"
#include "tools/bench_cases.h"
#include "tools/bench_data.h"
#include "tools/bench_env.h"
#include "tools/bench_report.h"
#include "tools/bench_torch.h"
#include "tools/commands.h"
#include "tools/kernel_span.h"
#include "tools/timing.h"

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sparse_mla::tools {

namespace {

using namespace bench;

struct Config {
  bool list = false, quick = false, graph = false, torch = false, save = true, progress = true;
  std::string filter;
  std::vector<std::string> backends;  // empty: default
  std::string python = "python3";
  int runs = 20, warmup = -1;
  double cpu_budget_s = 2.0;
  double cpu_max_call_s = -1;  // < 0: 1 s when GPU backends run too, else no limit
  VerifyMode verify = VerifyMode::kSample;
  double verify_gflop = 2.0;
  int device = 0;
  std::vector<double> gpu_peak, cpu_peak;
  std::string out_dir, out_prefix;
};

void usage(FILE* to) {
  std::fprintf(
      to,
      "usage: sparse-mla bench [options]\n"
      "Times the selected cases on the selected backends; each result is first checked against\n"
      "the fp64 reference (a wrong result is reported as FAIL, never timed).\n"
      "  --list               print the selected cases and exit\n"
      "  --quick              the short subset of the suite\n"
      "  -f, --filter TERMS   comma-separated: suite names (model1 model1_mtp tp model1_peak\n"
      "                       v32 dense dense_tp dense_imb dense_any dense_small kv), name\n"
      "                       substrings or globs ('sparse/C1/*'); '-TERM' removes matches\n"
      "  --backends LIST      cpu,cuda,sm90 (default: every backend usable here)\n"
      "  --torch              also run the PyTorch baseline (bench/torch_baseline.py)\n"
      "  --python EXE         interpreter for --torch (default python3)\n"
      "  --runs N             timed runs per case and backend (default 20)\n"
      "  --warmup N           untimed runs first (default 5 on a GPU, 1 on the CPU)\n"
      "  --cpu-budget S       stop timing a CPU case after S seconds once 3 runs are done (2)\n"
      "  --cpu-max-call S     skip the CPU on cases whose estimated call time (twice the CPU\n"
      "                       roofline time) exceeds S seconds (default: 1 when GPU backends run\n"
      "                       too, else no limit)\n"
      "  --graph              also time CUDA graph replay of the call\n"
      "  --verify MODE        sample (default): a spread of requests and heads per case;\n"
      "                       full: every row; off: only the finite check\n"
      "  --verify-gflop G     reference work per case in sample mode (default 2)\n"
      "  --device N           CUDA device (default 0)\n"
      "  --gpu-peak B,F,G     GPU ceilings: bf16 TFLOP/s, fp8 TFLOP/s, GB/s\n"
      "  --cpu-peak T,G       CPU ceilings: fp32 TFLOP/s, GB/s (default: measured)\n"
      "  --out-dir DIR        where results go (default bench/results if it exists, else .)\n"
      "  --out PREFIX         exact output path without .json/.csv\n"
      "  --no-save            write no files\n"
      "  --no-progress        no progress bar on stderr\n");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// The filter as a file-name tag: a removed term ("-dense_any") reads "not-dense-any", so that the
// name does not list suites the run left out.
std::string filter_tag(const std::string& filter) {
  std::string tag;
  for (const std::string& term : split(filter, ',')) {
    tag += (tag.empty() ? "" : "-") + (term[0] == '-' ? "not-" + slug(term.substr(1)) : slug(term));
  }
  return tag.empty() ? "x" : tag;
}

bool parse_number(const char* s, double* v) {
  char* end = nullptr;
  *v = std::strtod(s, &end);
  return end != s && *end == '\0' && std::isfinite(*v);
}

// 0: parsed; 1: exit 0 (help); 2: bad arguments (message printed).
int parse_args(int argc, char** argv, Config* cfg) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* what) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "sparse-mla bench: %s needs a value (%s)\n", a.c_str(), what);
        return nullptr;
      }
      return argv[++i];
    };
    auto bad = [&](const char* v, const char* expected) {
      std::fprintf(stderr, "sparse-mla bench: %s: '%s', expected %s\n", a.c_str(), v, expected);
      return 2;
    };
    auto number_list = [&](const char* v, size_t n, std::vector<double>* out) {
      out->clear();
      for (const auto& part : split(v, ',')) {
        double x;
        if (!parse_number(part.c_str(), &x) || x <= 0) return false;
        out->push_back(x);
      }
      return out->size() == n;
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
      return 1;
    } else if (a == "--list") {
      cfg->list = true;
    } else if (a == "--quick") {
      cfg->quick = true;
    } else if (a == "--graph") {
      cfg->graph = true;
    } else if (a == "--torch") {
      cfg->torch = true;
    } else if (a == "--no-save") {
      cfg->save = false;
    } else if (a == "--no-progress") {
      cfg->progress = false;
    } else if (a == "-f" || a == "--filter") {
      const char* v = value("comma-separated terms");
      if (!v) return 2;
      cfg->filter = v;
    } else if (a == "--backends") {
      const char* v = value("e.g. cpu,cuda");
      if (!v) return 2;
      cfg->backends = split(v, ',');
      for (const auto& b : cfg->backends) {
        Backend parsed;
        if (b == "torch" || b == "auto" || !parse_backend(b, &parsed).ok()) {
          return bad(v,
                     "a comma-separated list of cpu, cuda, sm90 (the PyTorch baseline is --torch)");
        }
      }
    } else if (a == "--python") {
      const char* v = value("an interpreter");
      if (!v) return 2;
      cfg->python = v;
    } else if (a == "--runs" || a == "--warmup" || a == "--device") {
      const char* v = value("an integer");
      if (!v) return 2;
      double x;
      const double lo = a == "--runs" ? 1 : 0;
      if (!parse_number(v, &x) || x != std::floor(x) || x < lo || x > 100000) {
        return bad(v, a == "--runs" ? "an integer >= 1" : "an integer >= 0");
      }
      (a == "--runs"     ? cfg->runs
       : a == "--warmup" ? cfg->warmup
                         : cfg->device) = static_cast<int>(x);
    } else if (a == "--cpu-budget" || a == "--verify-gflop" || a == "--cpu-max-call") {
      const char* v = value("a number");
      if (!v) return 2;
      double x;
      if (!parse_number(v, &x) || x <= 0) return bad(v, "a number > 0");
      (a == "--cpu-budget"     ? cfg->cpu_budget_s
       : a == "--cpu-max-call" ? cfg->cpu_max_call_s
                               : cfg->verify_gflop) = x;
    } else if (a == "--verify") {
      const char* v = value("sample|full|off");
      if (!v) return 2;
      const std::string m = v;
      if (m == "sample")
        cfg->verify = VerifyMode::kSample;
      else if (m == "full")
        cfg->verify = VerifyMode::kFull;
      else if (m == "off")
        cfg->verify = VerifyMode::kOff;
      else
        return bad(v, "sample, full or off");
    } else if (a == "--gpu-peak") {
      const char* v = value("bf16 TFLOP/s,fp8 TFLOP/s,GB/s");
      if (!v) return 2;
      if (!number_list(v, 3, &cfg->gpu_peak)) return bad(v, "three positive numbers B,F,G");
    } else if (a == "--cpu-peak") {
      const char* v = value("TFLOP/s,GB/s");
      if (!v) return 2;
      if (!number_list(v, 2, &cfg->cpu_peak)) return bad(v, "two positive numbers T,G");
    } else if (a == "--out-dir") {
      const char* v = value("a directory");
      if (!v) return 2;
      cfg->out_dir = v;
    } else if (a == "--out") {
      const char* v = value("a path prefix");
      if (!v) return 2;
      cfg->out_prefix = v;
    } else {
      std::fprintf(stderr, "sparse-mla bench: unknown option '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  return 0;
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  return static_cast<bool>(f);
}

// 64-byte aligned host scratch for CPU workspaces.
struct HostBuffer {
  std::unique_ptr<uint8_t[]> raw;
  void* ptr = nullptr;
  explicit HostBuffer(size_t bytes) : raw(new uint8_t[bytes + 64]) {
    ptr = raw.get() + (64 - reinterpret_cast<uintptr_t>(raw.get()) % 64) % 64;
  }
};

Result run_cpu(const Case& c, const Inputs& in, const Expected& expected, const Config& cfg,
               const Ceilings* ceilings) {
  Result res;
  res.backend = "cpu";
  res.ceilings = ceilings;
  auto fail = [&](const Status& s) {
    res.status = "error";
    res.message = s.to_string();
    return res;
  };
  HostOutputs outs = make_outputs(c, in);
  HostPlacer placer;
  OpArgs args;
  Status s = make_args(c, in, outs, placer, &args);
  if (!s.ok()) return fail(s);
  const Options opt{Backend::kCPU, nullptr};
  WorkspaceSizes sizes;
  s = workspace_size(c, args, opt, &sizes);
  if (!s.ok()) return fail(s);
  HostBuffer plan(sizes.plan_bytes), scratch(sizes.scratch_bytes);
  const Workspace ws{plan.ptr, sizes.plan_bytes, scratch.ptr, sizes.scratch_bytes};
  s = plan_op(c, args, ws, opt);
  if (s.ok()) s = run_op(c, args, ws, opt);
  if (!s.ok()) return fail(s);
  res.verdict = verify(c, in, expected, outs);
  if (!res.verdict.ok) {
    res.status = "failed";
    res.message = res.verdict.message;
    return res;
  }
  TimingPlan tp;
  tp.runs = cfg.runs;
  tp.warmup = cfg.warmup >= 0 ? cfg.warmup : 1;
  tp.budget_s = cfg.cpu_budget_s;
  std::vector<double> us;
  s = time_cpu([&] { return run_op(c, args, ws, opt); }, tp, &us);
  if (!s.ok()) return fail(s);
  res.time = summarize(us);
  res.status = "ok";
  return res;
}

#if SPARSE_MLA_WITH_CUDA

size_t span_bytes(const TensorView& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.strides[d];
  return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
}

// Device copies of host buffers, freed with the placer. Each upload waits until it has landed: the
// calls run on a non-blocking stream, which does not order after a pageable cudaMemcpy's DMA.
class DevicePlacer final : public Placer {
 public:
  explicit DevicePlacer(int device) : device_(device) {}
  ~DevicePlacer() override {
    for (void* p : allocs_) cudaFree(p);
  }
  Status alloc(size_t bytes, void** p) {
    *p = nullptr;
    if (bytes == 0) return Status::Ok();
    SPARSE_MLA_RETURN_IF_ERROR(
        cuda_check(cudaMalloc(p, bytes), ("cudaMalloc(" + std::to_string(bytes) + " B)").c_str()));
    allocs_.push_back(*p);
    return Status::Ok();
  }
  Status place(const TensorView& host, TensorView* placed) override {
    return upload(host, span_bytes(host), placed);
  }
  Status place(const KVCache& host, KVCache* placed) override {
    return upload(host, static_cast<size_t>(host.num_pages * host.page_stride), placed);
  }

 private:
  int device_;
  std::vector<void*> allocs_;

  // A tensor or cache (both name their bytes `data` and their place `device`) copied to the device.
  template <typename Placed>
  Status upload(const Placed& host, size_t bytes, Placed* placed) {
    void* d = nullptr;
    SPARSE_MLA_RETURN_IF_ERROR(alloc(bytes, &d));
    SPARSE_MLA_RETURN_IF_ERROR(
        cuda_check(cudaMemcpy(d, host.data, bytes, cudaMemcpyHostToDevice), "upload"));
    SPARSE_MLA_RETURN_IF_ERROR(cuda_check(cudaDeviceSynchronize(), "upload landed"));
    *placed = host;
    placed->data = d;
    placed->device = Device{DeviceType::kCUDA, device_};
    return Status::Ok();
  }
};

Status download(const TensorView& dev, void* host) {
  return cuda_check(cudaMemcpy(host, dev.data, span_bytes(dev), cudaMemcpyDeviceToHost),
                    "download");
}

Result run_gpu(const Case& c, const Inputs& in, const Expected& expected, Backend backend,
               const Config& cfg, GpuTimer& timer, cudaStream_t stream, const Ceilings* ceilings) {
  Result res;
  res.backend = backend_name(backend);
  res.ceilings = ceilings;
  res.on_gpu = true;
  auto fail = [&](const Status& s) {
    res.status = "error";
    res.message = s.to_string();
    return res;
  };
  HostOutputs outs = make_outputs(c, in);
  DevicePlacer placer(cfg.device);
  OpArgs args;
  Status s = make_args(c, in, outs, placer, &args);
  if (!s.ok()) return fail(s);
  const Options opt{backend, stream};
  WorkspaceSizes sizes;
  s = workspace_size(c, args, opt, &sizes);
  if (!s.ok()) return fail(s);
  Workspace ws{nullptr, sizes.plan_bytes, nullptr, sizes.scratch_bytes};
  s = placer.alloc(sizes.plan_bytes, &ws.plan);
  if (s.ok()) s = placer.alloc(sizes.scratch_bytes, &ws.scratch);
  if (s.ok()) s = plan_op(c, args, ws, opt);
  if (s.ok()) s = run_op(c, args, ws, opt);
  if (s.ok()) s = cuda_check(cudaStreamSynchronize(stream), "first run");
  if (!s.ok()) return fail(s);
  // Copy the results back into the (poisoned) host outputs and check them.
  if (c.op == OpKind::kSparseDecode || c.op == OpKind::kDenseDecode) {
    const TensorView& out = c.op == OpKind::kSparseDecode ? args.sparse.out : args.dense.out;
    const TensorView& lse = c.op == OpKind::kSparseDecode ? args.sparse.lse : args.dense.lse;
    s = download(out, outs.out.data());
    if (s.ok()) s = download(lse, outs.lse.data());
  } else {
    const KVCache& dst = c.op == OpKind::kQuantizeStore ? args.store.kv : args.repack.dst;
    s = cuda_check(
        cudaMemcpy(outs.dst.desc().data, dst.data,
                   static_cast<size_t>(dst.num_pages * dst.page_stride), cudaMemcpyDeviceToHost),
        "download cache");
  }
  if (!s.ok()) return fail(s);
  res.verdict = verify(c, in, expected, outs);
  if (!res.verdict.ok) {
    res.status = "failed";
    res.message = res.verdict.message;
    return res;
  }
  TimingPlan tp;
  tp.runs = cfg.runs;
  tp.warmup = cfg.warmup >= 0 ? cfg.warmup : 5;
  tp.min_runs = cfg.runs;
  std::vector<double> us, span_us, part_us;
  auto launch = [&] { return run_op(c, args, ws, opt); };
  // Event-timed and traced (kernel span) batches of runs alternate in the order events, traced,
  // traced, events, ..., so that both see the GPU at the same average point of the case: on
  // calls of a millisecond or more later batches run slower, by up to 13% over a case, as the
  // GPU reaches its power limit (bench/results/20261202-0626_*_span_order_probe.txt and
  // 20261202-0635_*_clocks_under_load.txt).
  Status span_status = kernel_spans_supported() ? Status::Ok() : Status::Unsupported("no CUPTI");
  const int batch = 10;
  for (int done = 0, pair = 0; done < tp.runs; done += batch, ++pair) {
    TimingPlan part = tp;
    part.runs = part.min_runs = std::min(batch, tp.runs - done);
    part.warmup = done ? 0 : tp.warmup;
    auto traced_batch = [&] {
      if (!span_status.ok()) return;
      span_status = time_kernel_spans(timer, stream, launch, part, &part_us, &res.span_kernels);
      span_us.insert(span_us.end(), part_us.begin(), part_us.end());
    };
    const bool traced_first = pair % 2 == 1;
    if (traced_first) traced_batch();
    s = timer.time(launch, part, false, &part_us);
    if (!s.ok()) return fail(s);
    us.insert(us.end(), part_us.begin(), part_us.end());
    if (!traced_first) traced_batch();
  }
  res.time = summarize(us);
  res.status = "ok";
  if (span_status.ok()) {
    res.span_time = summarize(span_us);
  } else if (kernel_spans_supported()) {
    res.message = "kernel span: " + span_status.to_string();
  }
  if (cfg.graph) {
    s = timer.time(launch, tp, true, &us);
    if (s.ok()) {
      res.graph_time = summarize(us);
    } else {
      res.message += (res.message.empty() ? "graph: " : "; graph: ") + s.to_string();
    }
  }
  return res;
}

#endif  // SPARSE_MLA_WITH_CUDA

// A CPU call's time, guessed as twice its roofline time on the measured ceilings.
double cpu_estimate_s(const Work& w, const Ceilings& c) {
  double t = 0;
  if (c.bf16_tflops > 0) t = std::max(t, w.flops / (c.bf16_tflops * 1e12));
  if (c.gbps > 0) t = std::max(t, w.bytes / (c.gbps * 1e9));
  return 2 * t;
}

std::string command_line(int argc, char** argv) {
  std::string cmd = "sparse-mla bench";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.find_first_of(" \t'\"*") != std::string::npos) a = "'" + a + "'";
    cmd += " " + a;
  }
  return cmd;
}

}  // namespace

int bench_command(int argc, char** argv) {
  Config cfg;
  if (int rc = parse_args(argc, argv, &cfg)) return rc == 1 ? 0 : 2;

  const std::vector<Case> cases = select_cases(all_cases(), cfg.filter, cfg.quick);
  if (cases.empty()) {
    std::fprintf(stderr, "sparse-mla bench: no case matches filter '%s'%s (see --list)\n",
                 cfg.filter.c_str(), cfg.quick ? " in --quick" : "");
    return 2;
  }
  if (cfg.save && !cfg.list) {  // checked now, not after a long run whose files would be lost
    const size_t slash = cfg.out_prefix.rfind('/');
    const std::string dir = !cfg.out_dir.empty()      ? cfg.out_dir
                            : !cfg.out_prefix.empty() ? (slash == std::string::npos ? "."
                                                         : cfg.out_prefix.substr(0, slash + 1))
                                                      : "";
    if (!dir.empty() && (!is_dir(dir) || access(dir.c_str(), W_OK) != 0)) {
      std::fprintf(stderr, "sparse-mla bench: %s %s: not a writable directory\n",
                   cfg.out_dir.empty() ? "--out" : "--out-dir",
                   (cfg.out_dir.empty() ? cfg.out_prefix : cfg.out_dir).c_str());
      return 2;
    }
  }
  if (cfg.list) {
    for (const Case& c : cases) {
      std::printf("%-34s %-12s %-22s", c.name.c_str(), c.suite.c_str(), c.config.c_str());
      if (c.flashmla_us) std::printf(" FlashMLA %.1f us", *c.flashmla_us);
      std::printf("\n");
    }
    return 0;
  }

  // Backends: explicit, or every one this build can use here (GPU ones first).
  std::vector<Backend> backends;
  if (!cfg.backends.empty()) {
    for (const auto& name : cfg.backends) {
      Backend b;
      (void)parse_backend(name, &b);
      backends.push_back(b);
    }
  } else {
    backends = available_backends();
  }
  bool use_cpu = false, use_gpu = false;
  for (Backend b : backends) (b == Backend::kCPU ? use_cpu : use_gpu) = true;

  RunInfo info;
  info.date = utc_now(false);
  info.commit = git_commit();
  info.command = command_line(argc, argv);
  info.host = host_name();
  info.suite = cfg.quick ? (cfg.filter.empty() ? "quick" : "quick-" + filter_tag(cfg.filter))
                         : (cfg.filter.empty() ? "full" : filter_tag(cfg.filter));
  info.verify = cfg.verify == VerifyMode::kSample ? "sample"
                : cfg.verify == VerifyMode::kFull ? "full"
                                                  : "off";
  info.runs = cfg.runs;
  info.graph = cfg.graph;

  std::fprintf(stderr, "sparse-mla bench: %zu cases, commit %s\n", cases.size(),
               info.commit.c_str());
  DeviceInfo cpu = cpu_info();
  if (use_cpu || cfg.torch) {
    if (cfg.cpu_peak.size() == 2) {
      cpu.ceilings = {cfg.cpu_peak[0], 0, cfg.cpu_peak[1], "command line"};
    } else {
      std::fprintf(stderr, "measuring CPU ceilings...\n");
      cpu.ceilings = measure_cpu_ceilings();
    }
  }
  info.devices.push_back(cpu);

#if SPARSE_MLA_WITH_CUDA
  cudaStream_t stream = nullptr;
  GpuTimer timer;
  if (use_gpu) {
    Status s = cuda_check(cudaSetDevice(cfg.device), "cudaSetDevice");
    if (s.ok()) s = cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    if (s.ok()) s = timer.init(cfg.device, stream);
    if (!s.ok()) {
      std::fprintf(stderr, "sparse-mla bench: GPU setup failed: %s\n", s.to_string().c_str());
      return 1;
    }
    DeviceInfo gpu = gpu_info(cfg.device);
    if (cfg.gpu_peak.size() == 3) {
      gpu.ceilings = {cfg.gpu_peak[0], cfg.gpu_peak[1], cfg.gpu_peak[2], "command line"};
    }
    gpu.detail += ", L2 flush " + std::to_string(timer.flush_bytes() >> 20) + " MiB";
    info.devices.push_back(gpu);
    if (!kernel_spans_supported()) {
      std::fprintf(stderr,
                   "sparse-mla bench: no CUPTI in this build: kernel spans are not "
                   "measured, every speedup uses the event-timed median\n");
    }
  }
#else
  if (use_gpu) {
    std::fprintf(stderr, "sparse-mla bench: this build has no CUDA backend; use --backends cpu\n");
    return 2;
  }
#endif
  // info.devices no longer grows: pointers into it stay valid.
  const Ceilings* cpu_ceilings = &info.devices.front().ceilings;
  const Ceilings* gpu_ceilings = use_gpu ? &info.devices.back().ceilings : nullptr;
  info.warmup = cfg.warmup >= 0 ? cfg.warmup : (use_gpu ? 5 : 1);
  const double cpu_max_call_s = cfg.cpu_max_call_s > 0 ? cfg.cpu_max_call_s : (use_gpu ? 1.0 : 0.0);

  std::unique_ptr<TorchBaseline> torch;
  if (cfg.torch) {
    torch = std::make_unique<TorchBaseline>();
    Status s = torch->start(cfg.python, use_gpu ? "cuda" : "cpu", cfg.device);
    if (!s.ok()) {
      std::fprintf(stderr, "sparse-mla bench: PyTorch baseline unavailable: %s\n",
                   s.to_string().c_str());
      torch.reset();
    } else {
      info.torch = torch->description();
    }
  }

  Progress progress(cases.size(), cfg.progress);
  std::vector<Record> records;
  for (const auto& d : info.devices) {
    std::printf("%s: %s (%s)", d.kind.c_str(), d.name.c_str(), d.detail.c_str());
    if (d.ceilings.gbps > 0) {
      std::printf("; ceilings %.3g TFLOP/s, %.4g GB/s [%s]", d.ceilings.bf16_tflops,
                  d.ceilings.gbps, d.ceilings.source.c_str());
    }
    std::printf("\n");
  }
  print_header(stdout);
  std::fflush(stdout);
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    Record rec;
    rec.c = c;
    auto t0 = std::chrono::steady_clock::now();
    Inputs in;
    progress.update(ci, c.name + ": inputs", 0);
    Status s = build_inputs(c, &in, [&](double f) { progress.update(ci, c.name + ": inputs", f); });
    Expected expected;
    if (s.ok()) {
      progress.update(ci, c.name + ": reference");
      s = compute_expected(c, in, cfg.verify, cfg.verify_gflop * 1e9, &expected);
    }
    rec.work = in.work;
    rec.verified = expected.what;
    rec.build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (Backend b : backends) {
      Result res;
      if (!s.ok()) {
        res.backend = backend_name(b);
        res.status = "error";
        res.message = "inputs: " + s.to_string();
      } else if (b == Backend::kCPU && cpu_max_call_s > 0 &&
                 cpu_estimate_s(in.work, *cpu_ceilings) > cpu_max_call_s) {
        res.backend = "cpu";
        res.status = "skipped";
        char why[160];
        std::snprintf(why, sizeof why, "estimated %.2g s per call on the CPU (--cpu-max-call %g)",
                      cpu_estimate_s(in.work, *cpu_ceilings), cpu_max_call_s);
        res.message = why;
      } else if (b == Backend::kCPU) {
        progress.update(ci, c.name + ": cpu");
        res = run_cpu(c, in, expected, cfg, cpu_ceilings);
      } else {
#if SPARSE_MLA_WITH_CUDA
        progress.update(ci, c.name + ": " + backend_name(b));
        res = run_gpu(c, in, expected, b, cfg, timer, stream, gpu_ceilings);
#endif
      }
      progress.clear();
      print_result(stdout, rec, res);
      std::fflush(stdout);
      rec.results.push_back(std::move(res));
    }
    if (torch && s.ok()) {
      progress.update(ci, c.name + ": torch");
      Result res = torch->run(c, in, expected, cfg.runs, info.warmup);
      res.ceilings = torch->on_gpu() ? gpu_ceilings : cpu_ceilings;
      res.on_gpu = torch->on_gpu();
      progress.clear();
      print_result(stdout, rec, res);
      std::fflush(stdout);
      rec.results.push_back(std::move(res));
    }
    records.push_back(std::move(rec));
  }
  progress.update(cases.size(), "done");
  progress.clear();
  print_summary(stdout, records);

#if SPARSE_MLA_WITH_CUDA
  if (stream) cudaStreamDestroy(stream);
#endif

  if (cfg.save) {
    std::string prefix = cfg.out_prefix;
    if (prefix.empty()) {
      std::string dir = !cfg.out_dir.empty()      ? cfg.out_dir
                        : is_dir("bench/results") ? "bench/results"
                                                  : ".";
      const std::string device = slug(info.devices.back().name);
      prefix = dir + "/" + utc_now(true) + "_" + (use_gpu ? device : "cpu") + "_" + info.commit +
               "_" + info.suite;
    }
    const bool ok = write_file(prefix + ".json", to_json(info, records)) &&
                    write_file(prefix + ".csv", to_csv(info, records));
    if (!ok) {
      std::fprintf(stderr, "sparse-mla bench: cannot write %s.json/.csv\n", prefix.c_str());
      return 1;
    }
    std::printf("results: %s.json, %s.csv\n", prefix.c_str(), prefix.c_str());
  }
  for (const auto& r : records) {
    for (const auto& res : r.results) {
      if (res.status == "failed" || res.status == "error") return 1;
    }
  }
  return 0;
}

}  // namespace sparse_mla::tools
