// Inputs of one benchmark case (host copies built with reference/testdata.h), the views of an
// operation over host or device buffers, the work counts of targets.md, and the check of a result.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reference/testdata.h"
#include "sparse_mla/ops.h"
#include "tools/bench_cases.h"

namespace sparse_mla::tools::bench {

struct Inputs {
  // Attention: caches, queries, indices / block tables. KV kernels: `kv` is the source cache of a
  // repack; `dst_config` describes the written cache (each backend's outputs get a fresh one).
  ref::HostCache kv, extra_kv;
  ref::CacheConfig dst_config;
  ref::HostTensor q, indices, extra_indices, extra_topk_length, attn_sink;
  ref::HostTensor block_table, cache_seqlens, dst_block_table;
  ref::HostTensor src, slots;
  float softmax_scale = 0;
  Work work;
};

// Builds the host inputs of a case (deterministic in c.seed). `progress` gets a fraction in [0, 1].
Status build_inputs(const Case& c, Inputs* in, const std::function<void(double)>& progress);

// Maps host buffers to where a backend reads them: identity for the CPU, device copies for CUDA.
class Placer {
 public:
  virtual ~Placer() = default;
  virtual Status place(const TensorView& host, TensorView* placed) = 0;
  virtual Status place(const KVCache& host, KVCache* placed) = 0;
};

class HostPlacer final : public Placer {
 public:
  Status place(const TensorView& host, TensorView* placed) override {
    *placed = host;
    return Status::Ok();
  }
  Status place(const KVCache& host, KVCache* placed) override {
    *placed = host;
    return Status::Ok();
  }
};

// The arguments of one call; outputs are fresh buffers poisoned with NaN (0xFF bytes).
struct OpArgs {
  SparseDecodeArgs sparse;
  DenseDecodeArgs dense;
  QuantizeStoreArgs store;
  RepackArgs repack;
};

// Host output buffers of a case, poisoned: attention out [b, s_q, h_q, 512] bf16 and lse
// [b, h_q, s_q] float32 (NaN); KV kernels: the written cache (every byte 0xFF).
struct HostOutputs {
  ref::HostTensor out, lse;
  ref::HostCache dst;
};
HostOutputs make_outputs(const Case& c, const Inputs& in);

Status make_args(const Case& c, const Inputs& in, const HostOutputs& outs, Placer& placer,
                 OpArgs* args);

Status workspace_size(const Case& c, const OpArgs& a, const Options& o, WorkspaceSizes* sizes);
// Plan (outside the timed region, as an engine does once per step) and run.
Status plan_op(const Case& c, const OpArgs& a, const Workspace& ws, const Options& o);
Status run_op(const Case& c, const OpArgs& a, const Workspace& ws, const Options& o);

// What a backend's result is checked against: the fp64 reference on a sample of (request, head)
// rows (or all of them), computed once per case.
enum class VerifyMode { kOff, kSample, kFull };

struct Expected {
  struct Row {
    int64_t request = 0, h0 = 0, heads = 0;
    std::vector<double> out, lse;  // reference of the slice [1, s_q, heads, 512] / [1, heads, s_q]
  };
  std::vector<Row> rows;
  std::string what;  // "4 requests x 16 heads", for the report
};
Status compute_expected(const Case& c, const Inputs& in, VerifyMode mode, double budget_flops,
                        Expected* expected);

struct Verdict {
  bool ok = true;
  bool compared = true;  // false: the outputs were only checked to be finite (--verify off)
  std::string message;   // first failure, or what was checked
  double max_abs_err = 0, max_cos_diff = 0, max_lse_err = 0;
};
// Attention: every element finite (catches unwritten NaN-poisoned outputs), then the sample
// against the reference with spec section 7 tolerances. KV kernels: the written bytes against
// the reference quantizer (store) or the source rows (repack); `got` holds host copies.
Verdict verify(const Case& c, const Inputs& in, const Expected& expected, const HostOutputs& got);

}  // namespace sparse_mla::tools::bench
