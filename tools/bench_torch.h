// The PyTorch baseline of `sparse-mla bench --torch`: bench/torch_baseline.py runs as a child
// process for the whole run (torch is imported once); for each attention case the bench writes
// the case's inputs to a temporary directory, the script times its gather / dequantize / matmul /
// softmax implementation on them and writes its outputs back, and the bench checks those outputs
// against the same reference as every backend.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <string>

#include "tools/bench_data.h"
#include "tools/bench_report.h"

namespace sparse_mla::tools::bench {

class TorchBaseline {
 public:
  TorchBaseline() = default;
  TorchBaseline(const TorchBaseline&) = delete;
  TorchBaseline& operator=(const TorchBaseline&) = delete;
  ~TorchBaseline();

  // device_kind: "cuda" or "cpu". Fails when the script or torch cannot be started.
  Status start(const std::string& python, const std::string& device_kind, int device_index);
  const std::string& description() const { return description_; }
  bool on_gpu() const { return on_gpu_; }

  Result run(const Case& c, const Inputs& in, const Expected& expected, int runs, int warmup);

 private:
  Status request(const std::string& line, std::string* reply);
  void stop();

  pid_t pid_ = -1;
  FILE* to_child_ = nullptr;
  FILE* from_child_ = nullptr;
  std::string dir_;
  std::string description_;
  bool on_gpu_ = false;
};

}  // namespace sparse_mla::tools::bench
