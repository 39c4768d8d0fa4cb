// CUDA graphs: one decode step captured as "plan once, run every layer" (what an engine does),
// replayed after lengths, indices, block tables and cache contents change in place; every layer
// must still match the fp64 reference, which proves that the plan is recomputed on the device and
// nothing was baked in at capture time. Each test captures in both modes: thread-local, and
// global (torch.cuda.graph's default), where any capture-unsafe CUDA call would end the capture.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tests/cpp/cuda/decode_util.h"

namespace sparse_mla {
namespace {

using decode_test::DeviceDense;
using decode_test::DeviceSparse;
using decode_test::DeviceWorkspace;
using decode_test::test_seed;
using gpu_test::Stream;

// Owns an instantiated graph captured from `stream` while `body` runs.
class Graph {
 public:
  template <typename F>
  ::testing::AssertionResult capture(const Stream& stream, cudaStreamCaptureMode mode, F&& body) {
    cudaError_t err = cudaStreamBeginCapture(stream.get(), mode);
    if (err != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(err);
    const Status st = body();
    cudaGraph_t graph = nullptr;
    err = cudaStreamEndCapture(stream.get(), &graph);
    if (!st.ok()) return ::testing::AssertionFailure() << "during capture: " << st.to_string();
    if (err != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(err);
    graph_ = graph;
    err = cudaGraphInstantiate(&exec_, graph_, 0);
    if (err != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(err);
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult replay(const Stream& stream) const {
    const cudaError_t err = cudaGraphLaunch(exec_, stream.get());
    if (err != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(err);
    return stream.sync();
  }
  ~Graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

void upload(gpu_test::DeviceTensor& dst, const ref::HostTensor& src) {
  dst.buffer.upload(src.data(), gpu_test::span_bytes(src.view()));
}

void upload_cache(gpu_test::DeviceKV& dst, const ref::HostCache& src) {
  dst.buffer.upload(src.desc().data, gpu_test::kv_bytes(src.desc()));
}

// Captures the step as an engine does: the plan once from the first layer's arguments (the
// layers share the step's lengths), then every layer's decode. *ws must outlive the graph.
template <typename Dev, typename SizeFn, typename PlanFn, typename RunFn>
::testing::AssertionResult capture_step(const Stream& stream,
                                        const std::vector<std::unique_ptr<Dev>>& dev,
                                        SizeFn size_fn, PlanFn plan_fn, RunFn run_fn,
                                        std::unique_ptr<DeviceWorkspace>* ws,
                                        cudaStreamCaptureMode mode, Graph* graph) {
  const Options o = stream.options();
  WorkspaceSizes sizes;
  const Status st = size_fn(dev[0]->args, o, &sizes);
  if (!st.ok()) return ::testing::AssertionFailure() << st.to_string();
  *ws = std::make_unique<DeviceWorkspace>(sizes);
  return graph->capture(stream, mode, [&]() -> Status {
    SPARSE_MLA_RETURN_IF_ERROR(plan_fn(dev[0]->args, (*ws)->ws, o));
    for (const auto& d : dev) SPARSE_MLA_RETURN_IF_ERROR(run_fn(d->args, (*ws)->ws, o));
    return Status::Ok();
  });
}

// Downloads every layer's outputs (host copies poisoned first) and compares them with the fp64
// reference.
template <typename Case, typename Dev, typename RefFn>
void check_layers(std::vector<Case>& layers, const std::vector<std::unique_ptr<Dev>>& dev,
                  RefFn reference, const ref::Tolerance& tol, const std::string& what) {
  for (size_t l = 0; l < layers.size(); ++l) {
    SCOPED_TRACE(what + ", layer " + std::to_string(l));
    layers[l].poison_outputs();
    dev[l]->download(layers[l]);
    const ref::RefOutput r = reference(layers[l].args());
    const ref::CompareResult res =
        ref::compare_outputs(layers[l].out.view(), layers[l].lse.view(), r, tol);
    EXPECT_TRUE(res.ok) << res.summary();
  }
}

void set_lengths(ref::SparseCase& c, const std::vector<int32_t>& main,
                 const std::vector<int32_t>& extra) {
  for (size_t i = 0; i < main.size(); ++i) c.topk_length.set({static_cast<int64_t>(i)}, main[i]);
  for (size_t i = 0; i < extra.size(); ++i) {
    c.extra_topk_length.set({static_cast<int64_t>(i)}, extra[i]);
  }
}

void sparse_step_replays(cudaStreamCaptureMode mode) {
  constexpr int kLayers = 3;
  ref::SparseCaseConfig cfg;
  cfg.format = KVFormat::kModel1;
  cfg.b = 3;
  cfg.s_q = 2;
  cfg.h_q = 64;
  cfg.topk = 1200;
  cfg.page_size = 64;
  cfg.use_extra = true;
  cfg.extra_topk = 300;
  cfg.extra_page_size = 2;
  cfg.use_topk_length = cfg.use_extra_topk_length = true;
  cfg.use_sink = true;
  const uint64_t seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(seed));

  // Layers share indices and lengths (one step), each has its own q, caches, sink and outputs.
  std::vector<ref::SparseCase> layers;
  for (int l = 0; l < kLayers; ++l) {
    cfg.seed = seed + l;
    layers.push_back(ref::make_sparse_case(cfg));
  }
  auto share_step = [&](const std::vector<int32_t>& main, const std::vector<int32_t>& extra,
                        uint64_t s) {
    set_lengths(layers[0], main, extra);
    ref::Rng rng(s);
    for (int l = 0; l < kLayers; ++l) {
      if (l > 0) {
        layers[l].indices = layers[0].indices;
        layers[l].extra_indices = layers[0].extra_indices;
        layers[l].topk_length = layers[0].topk_length;
        layers[l].extra_topk_length = layers[0].extra_topk_length;
      }
      layers[l].refresh_cache(rng);
    }
  };
  share_step({5, 1200, 0}, {300, 0, 17}, seed + 100);

  std::vector<std::unique_ptr<DeviceSparse>> dev;
  for (int l = 0; l < kLayers; ++l) dev.push_back(std::make_unique<DeviceSparse>(layers[l]));
  for (int l = 1; l < kLayers; ++l) {  // one device copy of the step's indices and lengths
    dev[l]->args.indices = dev[0]->args.indices;
    dev[l]->args.extra_indices = dev[0]->args.extra_indices;
    dev[l]->args.topk_length = dev[0]->args.topk_length;
    dev[l]->args.extra_topk_length = dev[0]->args.extra_topk_length;
  }

  Stream stream;
  std::unique_ptr<DeviceWorkspace> ws;
  Graph graph;
  ASSERT_TRUE(capture_step(stream, dev, sparse_decode_workspace_size, sparse_decode_plan,
                           sparse_decode, &ws, mode, &graph));
  auto check_all = [&](const char* what) {
    check_layers(layers, dev, ref::sparse_decode_reference, ref::Tolerance::sparse(), what);
  };

  for (auto& d : dev) d->poison_outputs();
  ASSERT_TRUE(graph.replay(stream));
  check_all("first replay");

  // A new step: other lengths (other splits), indices and cache contents, written in place.
  ref::Rng rng(seed + 7);
  layers[0].indices = ref::random_indices(rng, cfg.b, cfg.s_q, cfg.topk, layers[0].kv.num_slots());
  share_step({1200, 30, 700}, {0, 300, 300}, seed + 200);
  upload(dev[0]->indices, layers[0].indices);
  upload(*dev[0]->topk_length, layers[0].topk_length);
  upload(*dev[0]->extra_topk_length, layers[0].extra_topk_length);
  for (int l = 0; l < kLayers; ++l) {
    upload_cache(dev[l]->kv, layers[l].kv);
    upload_cache(*dev[l]->extra_kv, layers[l].extra_kv);
    dev[l]->poison_outputs();
  }
  ASSERT_TRUE(graph.replay(stream));
  check_all("after in-place update");
}

void dense_step_replays(cudaStreamCaptureMode mode) {
  constexpr int kLayers = 2;
  ref::DenseCaseConfig cfg;
  cfg.format = KVFormat::kBF16;
  cfg.b = 3;
  cfg.s_q = 2;
  cfg.h_q = 32;
  cfg.h_kv = 2;
  cfg.page_size = 64;
  cfg.seqlens = {100, 2500, 1};
  cfg.max_pages = 48;
  cfg.causal = true;
  const uint64_t seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(seed));
  std::vector<ref::DenseCase> layers;
  for (int l = 0; l < kLayers; ++l) {
    cfg.seed = seed + l;
    layers.push_back(ref::make_dense_case(cfg));
    if (l > 0) {
      layers[l].block_table = layers[0].block_table;
      layers[l].cache_seqlens = layers[0].cache_seqlens;
      ref::Rng rng(seed + 50 + l);
      layers[l].refresh_cache(rng);
    }
  }
  std::vector<std::unique_ptr<DeviceDense>> dev;
  for (int l = 0; l < kLayers; ++l) dev.push_back(std::make_unique<DeviceDense>(layers[l]));
  for (int l = 1; l < kLayers; ++l) {
    dev[l]->args.block_table = dev[0]->args.block_table;
    dev[l]->args.cache_seqlens = dev[0]->args.cache_seqlens;
  }
  Stream stream;
  std::unique_ptr<DeviceWorkspace> ws;
  Graph graph;
  ASSERT_TRUE(capture_step(stream, dev, dense_decode_workspace_size, dense_decode_plan,
                           dense_decode, &ws, mode, &graph));
  auto check_all = [&](const char* what) {
    const auto reference = [](const DenseDecodeArgs& a) { return ref::dense_decode_reference(a); };
    check_layers(layers, dev, reference, ref::Tolerance::dense(), what);
  };
  for (auto& d : dev) d->poison_outputs();
  ASSERT_TRUE(graph.replay(stream));
  check_all("first replay");

  // Next step: every request grows or shrinks, pages are reshuffled, caches rewritten.
  ref::Rng rng(seed + 9);
  const int64_t num_pages = layers[0].kv.config().num_pages;
  layers[0].block_table = ref::random_block_table(rng, cfg.b, 48, num_pages);
  const int32_t next[3] = {3000, 0, 777};
  for (int64_t i = 0; i < 3; ++i) layers[0].cache_seqlens.set({i}, next[i]);
  for (int l = 0; l < kLayers; ++l) {
    if (l > 0) {
      layers[l].block_table = layers[0].block_table;
      layers[l].cache_seqlens = layers[0].cache_seqlens;
    }
    layers[l].refresh_cache(rng);
    upload_cache(dev[l]->kv, layers[l].kv);
    dev[l]->poison_outputs();
  }
  upload(dev[0]->block_table, layers[0].block_table);
  upload(dev[0]->cache_seqlens, layers[0].cache_seqlens);
  ASSERT_TRUE(graph.replay(stream));
  check_all("after in-place update");
}

TEST(CudaGraph, SparsePlanAndLayersReplayAfterInPlaceUpdates) {
  SKIP_WITHOUT_GPU();
  sparse_step_replays(cudaStreamCaptureModeThreadLocal);
}

TEST(CudaGraph, SparsePlanAndLayersReplayAfterInPlaceUpdatesGlobalCapture) {
  SKIP_WITHOUT_GPU();
  sparse_step_replays(cudaStreamCaptureModeGlobal);
}

TEST(CudaGraph, DensePlanAndLayersReplayAfterInPlaceUpdates) {
  SKIP_WITHOUT_GPU();
  dense_step_replays(cudaStreamCaptureModeThreadLocal);
}

TEST(CudaGraph, DensePlanAndLayersReplayAfterInPlaceUpdatesGlobalCapture) {
  SKIP_WITHOUT_GPU();
  dense_step_replays(cudaStreamCaptureModeGlobal);
}

}  // namespace
}  // namespace sparse_mla
