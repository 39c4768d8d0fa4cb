// Shared helpers of the CUDA decode tests: device copies of reference test cases, caller-owned
// workspaces, one plan + run on a stream, and comparisons against the fp64 reference and against
// the CPU backend (same spec section 7 tolerances).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/cuda/gpu_util.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla::decode_test {

using gpu_test::DeviceBuffer;
using gpu_test::DeviceKV;
using gpu_test::DeviceTensor;
using gpu_test::Stream;

using test_support::test_seed;

// Forces a tile configuration of the CUDA decode kernels for the scope (test hook of launch.cu).
class ScopedTiles {
 public:
  explicit ScopedTiles(const char* tiles) {
    if (tiles != nullptr) setenv("SPARSE_MLA_DECODE_TILES", tiles, 1);
  }
  ~ScopedTiles() { unsetenv("SPARSE_MLA_DECODE_TILES"); }
  ScopedTiles(const ScopedTiles&) = delete;
  ScopedTiles& operator=(const ScopedTiles&) = delete;
};

inline std::optional<DeviceTensor> to_device_opt(const std::optional<TensorView>& t) {
  if (!t) return std::nullopt;
  return gpu_test::to_device(*t);
}

// Device copies of every input of a sparse case; outputs poisoned with NaN.
struct DeviceSparse {
  DeviceTensor q, indices, out, lse;
  std::optional<DeviceTensor> topk_length, extra_indices, extra_topk_length, sink;
  DeviceKV kv;
  std::optional<DeviceKV> extra_kv;
  SparseDecodeArgs args;

  explicit DeviceSparse(const ref::SparseCase& c) {
    const SparseDecodeArgs h = c.args();
    q = gpu_test::to_device(h.q);
    indices = gpu_test::to_device(h.indices);
    out = gpu_test::poisoned_like(h.out);
    lse = gpu_test::poisoned_like(h.lse);
    topk_length = to_device_opt(h.topk_length);
    extra_indices = to_device_opt(h.extra_indices);
    extra_topk_length = to_device_opt(h.extra_topk_length);
    sink = to_device_opt(h.attn_sink);
    kv = gpu_test::to_device(h.kv);
    if (h.extra_kv) extra_kv = gpu_test::to_device(*h.extra_kv);
    args = h;
    args.q = q.view;
    args.indices = indices.view;
    args.out = out.view;
    args.lse = lse.view;
    args.kv = kv.kv;
    if (topk_length) args.topk_length = topk_length->view;
    if (extra_indices) args.extra_indices = extra_indices->view;
    if (extra_topk_length) args.extra_topk_length = extra_topk_length->view;
    if (sink) args.attn_sink = sink->view;
    if (extra_kv) args.extra_kv = extra_kv->kv;
  }
  void poison_outputs() {
    out.buffer.fill(0xff);
    lse.buffer.fill(0xff);
  }
  // Copies the device outputs into the host case's out / lse (same layouts).
  void download(ref::SparseCase& c) const {
    gpu_test::copy_to_host(out, c.out.view());
    gpu_test::copy_to_host(lse, c.lse.view());
  }
};

struct DeviceDense {
  DeviceTensor q, block_table, cache_seqlens, out, lse;
  DeviceKV kv;
  DenseDecodeArgs args;

  explicit DeviceDense(const ref::DenseCase& c) {
    const DenseDecodeArgs h = c.args();
    q = gpu_test::to_device(h.q);
    block_table = gpu_test::to_device(h.block_table);
    cache_seqlens = gpu_test::to_device(h.cache_seqlens);
    out = gpu_test::poisoned_like(h.out);
    lse = gpu_test::poisoned_like(h.lse);
    kv = gpu_test::to_device(h.kv);
    args = h;
    args.q = q.view;
    args.block_table = block_table.view;
    args.cache_seqlens = cache_seqlens.view;
    args.out = out.view;
    args.lse = lse.view;
    args.kv = kv.kv;
  }
  void poison_outputs() {
    out.buffer.fill(0xff);
    lse.buffer.fill(0xff);
  }
  void download(ref::DenseCase& c) const {
    gpu_test::copy_to_host(out, c.out.view());
    gpu_test::copy_to_host(lse, c.lse.view());
  }
};

// Caller-owned plan + scratch memory of the sizes the query returned. Both start as NaN bytes,
// so that a partial row or lse that the combine reads before a kernel wrote it shows.
struct DeviceWorkspace {
  DeviceBuffer plan, scratch;
  Workspace ws;
  explicit DeviceWorkspace(const WorkspaceSizes& s)
      : plan(s.plan_bytes), scratch(s.scratch_bytes) {
    plan.fill(0xff);
    scratch.fill(0xff);
    ws.plan = s.plan_bytes ? plan.data() : nullptr;
    ws.plan_bytes = s.plan_bytes;
    ws.scratch = s.scratch_bytes ? scratch.data() : nullptr;
    ws.scratch_bytes = s.scratch_bytes;
  }
};

// `args` with its out / lse pointed at the first half of `outer`'s (twice as many requests), whose
// second half a test then expects to stay poisoned (expect_second_half_poisoned).
template <typename Args>
Args into_first_half(Args args, const Args& outer) {
  args.out = outer.out;
  args.out.shape[0] = outer.out.shape[0] / 2;
  args.lse = outer.lse;
  args.lse.shape[0] = outer.lse.shape[0] / 2;
  return args;
}

// Expects the second half of out's and lse's device buffers to still hold the 0xff poison.
template <typename DeviceCase>
void expect_second_half_poisoned(const DeviceCase& d, const std::string& what) {
  for (const gpu_test::DeviceTensor* t : {&d.out, &d.lse}) {
    const std::vector<uint8_t> v = t->buffer.to_vector<uint8_t>();
    const bool poisoned = std::all_of(v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2),
                                      v.end(), [](uint8_t x) { return x == 0xff; });
    EXPECT_TRUE(poisoned) << what << ": " << (t == &d.out ? "out" : "lse")
                          << " written past the call's requests";
  }
}

// Plans and runs on `stream`, waits, and reports any failing status or asynchronous error.
inline ::testing::AssertionResult run_sparse(const SparseDecodeArgs& args, const Stream& stream) {
  const Options o = stream.options();
  WorkspaceSizes sizes;
  Status st = sparse_decode_workspace_size(args, o, &sizes);
  if (!st.ok()) return ::testing::AssertionFailure() << "workspace_size: " << st.to_string();
  DeviceWorkspace ws(sizes);
  st = sparse_decode_plan(args, ws.ws, o);
  if (st.ok()) st = sparse_decode(args, ws.ws, o);
  ::testing::AssertionResult synced = stream.sync();
  if (!st.ok()) return ::testing::AssertionFailure() << st.to_string();
  return synced;
}

inline ::testing::AssertionResult run_dense(const DenseDecodeArgs& args, const Stream& stream) {
  const Options o = stream.options();
  WorkspaceSizes sizes;
  Status st = dense_decode_workspace_size(args, o, &sizes);
  if (!st.ok()) return ::testing::AssertionFailure() << "workspace_size: " << st.to_string();
  DeviceWorkspace ws(sizes);
  st = dense_decode_plan(args, ws.ws, o);
  if (st.ok()) st = dense_decode(args, ws.ws, o);
  ::testing::AssertionResult synced = stream.sync();
  if (!st.ok()) return ::testing::AssertionFailure() << st.to_string();
  return synced;
}

// A library output (host tensors) read back as a RefOutput, to compare two backends with the same
// tolerances as against the reference.
inline ref::RefOutput as_ref(const ref::HostTensor& out, const ref::HostTensor& lse) {
  ref::RefOutput r;
  r.b = out.shape()[0];
  r.s_q = out.shape()[1];
  r.h_q = out.shape()[2];
  r.d_v = out.shape()[3];
  r.out.resize(r.b * r.s_q * r.h_q * r.d_v);
  r.lse.resize(r.b * r.h_q * r.s_q);
  for (int64_t i = 0; i < r.b; ++i) {
    for (int64_t s = 0; s < r.s_q; ++s) {
      for (int64_t h = 0; h < r.h_q; ++h) {
        r.lse_at(i, s, h) = lse.get({i, h, s});
        for (int64_t d = 0; d < r.d_v; ++d) r.out_at(i, s, h, d) = out.get({i, s, h, d});
      }
    }
  }
  return r;
}

// Expects the outputs in c.out / c.lse (a ref::SparseCase or ref::DenseCase run on the GPU) to
// match `reference` within `tol`, and the CPU backend's outputs on the same case, which
// run_cpu(args) computes, within twice its lse bounds: both sides carry their own error against
// the reference.
template <typename Case, typename RunCpu>
void expect_reference_and_cpu(const Case& c, const ref::RefOutput& reference, ref::Tolerance tol,
                              RunCpu run_cpu) {
  const ref::CompareResult res = ref::compare_outputs(c.out.view(), c.lse.view(), reference, tol);
  EXPECT_TRUE(res.ok) << "vs reference: " << res.summary();
  Case cpu = c;
  cpu.poison_outputs();
  const Status st = run_cpu(cpu.args());
  ASSERT_TRUE(st.ok()) << st.to_string();
  tol.lse_abs *= 2;
  tol.lse_rel *= 2;
  const ref::CompareResult res_cpu =
      ref::compare_outputs(c.out.view(), c.lse.view(), as_ref(cpu.out, cpu.lse), tol);
  EXPECT_TRUE(res_cpu.ok) << "vs CPU backend: " << res_cpu.summary();
}

// The support query, the workspace query and the run (sparse_* or dense_* entries) each refuse
// `args` on the backend under test with a message containing `needle`: a limit of the kernels
// must not pass the queries and then fail the run.
template <typename Args>
void expect_refused_by_every_query(const Args& args, const std::string& needle,
                                   Status (*supported)(const Args&, const Options&, Backend*),
                                   Status (*workspace_size)(const Args&, const Options&,
                                                            WorkspaceSizes*),
                                   Status (*run)(const Args&, const Workspace&, const Options&)) {
  const Options options{gpu_test::gpu_backend_under_test()};
  Backend chosen;
  WorkspaceSizes sizes;
  const Status statuses[] = {supported(args, options, &chosen),
                             workspace_size(args, options, &sizes),
                             run(args, Workspace{}, options)};
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
  }
}

}  // namespace sparse_mla::decode_test
