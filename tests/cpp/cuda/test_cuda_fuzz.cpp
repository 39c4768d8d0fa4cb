// The decode and kv_ops fuzz targets (fuzz/decode_target.h, fuzz/kv_ops_target.h) on the GPU
// backend under test. Decode: its committed seeds
// and reproducers and a batch of fresh random inputs, on the target's wide shapes (up to 128 heads,
// lists cut into several parts, the combine). Each request gets the target's checks: two runs with
// the unreferenced cache bytes and the index entries past the lengths rewritten in between, the
// outputs poisoned differently each time, which must agree bit for bit (unwritten outputs, reads
// of unreferenced data, nondeterminism); rows without a token give 0 and +inf; moderate inputs
// match the fp64 reference. Every tensor and cache is copied to a device allocation of exactly the
// bytes its view spans, so that under compute-sanitizer (scripts/gpu_check.sh) memcheck reports
// the first byte read or written past it; the workspace is filled with a different byte on every
// call, so that a kernel reading workspace it did not write makes the two runs differ. kv_ops:
// its seeds, reproducers and fresh random inputs, each op on device copies of the target's
// exact-size host buffers (caches included), whose bytes come back for the target's checks
// against its model of the formats and of the bytes each op may write.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/decode_target.h"
#include "fuzz/kv_ops_target.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/cuda/gpu_util.h"
#include "tests/cpp/fuzz_inputs.h"

namespace sparse_mla {
namespace {

using gpu_test::DeviceBuffer;
using gpu_test::Stream;

// Device copies of a host request's buffers; released with the object.
class Mirror {
 public:
  TensorView up(const TensorView& host) {
    TensorView d = host;
    d.data = copy_up(host.data, gpu_test::span_bytes(host));
    d.device = gpu_test::cuda_device();
    return d;
  }
  std::optional<TensorView> up(const std::optional<TensorView>& host) {
    if (!host) return std::nullopt;
    return up(*host);
  }
  KVCache up(const KVCache& host) {
    KVCache d = host;
    d.data = copy_up(host.data, fuzz::exact_cache_bytes(host));
    d.device = gpu_test::cuda_device();
    return d;
  }
  std::optional<KVCache> up(const std::optional<KVCache>& host) {
    if (!host) return std::nullopt;
    return up(*host);
  }
  // The whole span back, so that bytes between the elements (strided outputs) come back too.
  static void down(const TensorView& dev, const TensorView& host) {
    copy_down(host.data, dev.data, gpu_test::span_bytes(host));
  }
  static void down(const KVCache& dev, const KVCache& host) {
    copy_down(host.data, dev.data, fuzz::exact_cache_bytes(host));
  }

 private:
  static void copy_down(void* host, const void* dev, size_t bytes) {
    if (bytes == 0) return;
    const cudaError_t err = cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
    EXPECT_EQ(err, cudaSuccess) << "cudaMemcpy D2H: " << cudaGetErrorString(err);
  }
  void* copy_up(const void* host, size_t bytes) {
    buffers_.emplace_back(bytes);
    if (bytes > 0) buffers_.back().upload(host, bytes);
    return buffers_.back().data();
  }
  std::vector<DeviceBuffer> buffers_;
};

// Runs a workspace-free op (merge, the kv ops) on device copies of `host`'s buffers: `up` makes
// them (d starts as a copy of host), `down` copies back what the op may have written.
template <typename Args, typename Up, typename Down>
Status run_op(const Args& host, Backend backend, Status (*op)(const Args&, const Options&), Up up,
              Down down) {
  Mirror m;
  Args d = host;
  up(m, d);
  Stream stream;
  const Status st = op(d, stream.options(backend));
  EXPECT_TRUE(stream.sync());
  down(d);
  return st;
}

// Plans and runs a decode op (Args: SparseDecodeArgs or DenseDecodeArgs) on device copies of
// `host`'s buffers, with a workspace of exactly the queried sizes filled with `fill`, and copies
// out and lse back.
template <typename Args, typename Sizes, typename Plan, typename Run>
Status run_decode(const Args& host, const Args& dev, Backend backend, uint8_t fill, Sizes sizes_fn,
                  Plan plan_fn, Run run_fn) {
  Stream stream;
  const Options o = stream.options(backend);
  WorkspaceSizes sizes;
  Status st = sizes_fn(dev, o, &sizes);
  if (!st.ok()) return st;
  DeviceBuffer plan(sizes.plan_bytes), scratch(sizes.scratch_bytes);
  plan.fill(fill);
  scratch.fill(fill);
  const Workspace ws{plan.data(), sizes.plan_bytes, scratch.data(), sizes.scratch_bytes};
  st = plan_fn(dev, ws, o);
  if (st.ok()) st = run_fn(dev, ws, o);
  EXPECT_TRUE(stream.sync());
  Mirror::down(dev.out, host.out);
  Mirror::down(dev.lse, host.lse);
  return st;
}

// What the GPU ran, so that the test can tell that the wide shapes reached it.
struct Reached {
  int sparse = 0, dense = 0, merge = 0;
  int sparse_64_heads = 0;  // sparse calls with 64 query heads or more (the Hopper kernel's rows)
  int long_lists = 0;       // calls with room for more than 64 tokens a list (several tiles)
};

fuzz::DecodeRunner gpu_runner(Backend backend, std::shared_ptr<Reached> reached) {
  // The workspace fill changes with every call, so runs A and B of a request see different bytes.
  auto calls = std::make_shared<uint8_t>(0);
  auto next_fill = [calls] { return static_cast<uint8_t>(0x11 * (1 + (*calls)++ % 15)); };
  fuzz::DecodeRunner r;
  r.wide = true;
  r.sparse = [=](const SparseDecodeArgs& host) {
    if (host.q.shape[0] > 0) {
      ++reached->sparse;
      reached->sparse_64_heads += host.q.shape[2] >= 64;
      const int64_t extra = host.extra_indices ? host.extra_indices->shape[2] : 0;
      reached->long_lists += host.indices.shape[2] + extra > 64;
    }
    Mirror m;
    SparseDecodeArgs d = host;
    d.q = m.up(host.q);
    d.kv = m.up(host.kv);
    d.indices = m.up(host.indices);
    d.topk_length = m.up(host.topk_length);
    d.extra_kv = m.up(host.extra_kv);
    d.extra_indices = m.up(host.extra_indices);
    d.extra_topk_length = m.up(host.extra_topk_length);
    d.attn_sink = m.up(host.attn_sink);
    d.out = m.up(host.out);
    d.lse = m.up(host.lse);
    return run_decode(host, d, backend, next_fill(), sparse_decode_workspace_size,
                      sparse_decode_plan, sparse_decode);
  };
  r.dense = [=](const DenseDecodeArgs& host) {
    if (host.q.shape[0] > 0) {
      ++reached->dense;
      reached->long_lists += host.block_table.shape[1] * host.kv.page_size > 64;
    }
    Mirror m;
    DenseDecodeArgs d = host;
    d.q = m.up(host.q);
    d.kv = m.up(host.kv);
    d.block_table = m.up(host.block_table);
    d.cache_seqlens = m.up(host.cache_seqlens);
    d.out = m.up(host.out);
    d.lse = m.up(host.lse);
    return run_decode(host, d, backend, next_fill(), dense_decode_workspace_size, dense_decode_plan,
                      dense_decode);
  };
  r.merge = [=](const MergeArgs& host) {
    reached->merge += host.out.shape[0] > 0;
    return run_op(
        host, backend, merge_attention,
        [&](Mirror& m, MergeArgs& d) {
          d.out_parts = m.up(host.out_parts);
          d.lse_parts = m.up(host.lse_parts);
          d.attn_sink = m.up(host.attn_sink);
          d.out = m.up(host.out);
          d.lse = m.up(host.lse);
        },
        [&](const MergeArgs& d) {
          Mirror::down(d.out, host.out);
          Mirror::down(d.lse, host.lse);
        });
  };
  return r;
}

// SPARSE_MLA_TEST_SEED replays the random inputs of a failing run (its seed is in the failure).
TEST(CudaFuzzDecode, CorpusReproducersAndRandomInputs) {
  SKIP_WITHOUT_GPU();
  const Backend backend = gpu_test::gpu_backend_under_test();
  auto reached = std::make_shared<Reached>();
  const fuzz::DecodeRunner run = gpu_runner(backend, reached);
  const uint64_t seed = test_support::test_seed();
  const std::vector<fuzz_inputs::Input> inputs = fuzz_inputs::target_inputs("decode", seed, 200);
  ASSERT_GT(inputs.size(), 200u) << "no seed corpus under fuzz/corpus/decode";
  for (const fuzz_inputs::Input& in : inputs) {
    const std::string finding = fuzz::fuzz_decode_on(in.bytes.data(), in.bytes.size(), run);
    ASSERT_EQ(finding, "") << backend_name(backend) << ", " << in.name
                           << ", SPARSE_MLA_TEST_SEED=" << seed;
  }
  // Each request runs twice, so these count twice each.
  std::printf(
      "GPU calls: %d sparse (%d with >= 64 heads), %d dense, %d merge; %d with room for > 64 "
      "tokens\n",
      reached->sparse, reached->sparse_64_heads, reached->dense, reached->merge,
      reached->long_lists);
  EXPECT_GT(reached->sparse_64_heads, 0);
  EXPECT_GT(reached->dense, 0);
  EXPECT_GT(reached->merge, 0);
  EXPECT_GT(reached->long_lists, 0);
}

// The kv ops on device copies of the target's host buffers; every buffer an op may write comes
// back, and the source buffers too, so that the target sees a write where none was allowed.
fuzz::KvOpsRunner gpu_kv_runner(Backend backend, std::shared_ptr<int> calls) {
  fuzz::KvOpsRunner r;
  r.quantize_store = [=](const QuantizeStoreArgs& host) {
    ++*calls;
    return run_op(
        host, backend, quantize_store,
        [&](Mirror& m, QuantizeStoreArgs& d) {
          d.src = m.up(host.src);
          d.slots = m.up(host.slots);
          d.kv = m.up(host.kv);
        },
        [&](const QuantizeStoreArgs& d) {
          Mirror::down(d.src, host.src);
          Mirror::down(d.kv, host.kv);
        });
  };
  r.dequantize = [=](const DequantizeArgs& host) {
    ++*calls;
    return run_op(
        host, backend, dequantize,
        [&](Mirror& m, DequantizeArgs& d) {
          d.kv = m.up(host.kv);
          d.slots = m.up(host.slots);
          d.out = m.up(host.out);
        },
        [&](const DequantizeArgs& d) {
          Mirror::down(d.kv, host.kv);
          Mirror::down(d.out, host.out);
        });
  };
  r.repack = [=](const RepackArgs& host) {
    ++*calls;
    return run_op(
        host, backend, repack_pages,
        [&](Mirror& m, RepackArgs& d) {
          d.src = m.up(host.src);
          d.dst = m.up(host.dst);
          d.src_block_table = m.up(host.src_block_table);
          d.dst_block_table = m.up(host.dst_block_table);
          d.seqlens = m.up(host.seqlens);
        },
        [&](const RepackArgs& d) {
          Mirror::down(d.src, host.src);
          Mirror::down(d.dst, host.dst);
        });
  };
  return r;
}

TEST(CudaFuzzKvOps, CorpusReproducersAndRandomInputs) {
  SKIP_WITHOUT_GPU();
  const Backend backend = gpu_test::gpu_backend_under_test();
  auto calls = std::make_shared<int>(0);
  const fuzz::KvOpsRunner run = gpu_kv_runner(backend, calls);
  const uint64_t seed = test_support::test_seed();
  const std::vector<fuzz_inputs::Input> inputs = fuzz_inputs::target_inputs("kv_ops", seed, 300);
  ASSERT_GT(inputs.size(), 300u) << "no seed corpus under fuzz/corpus/kv_ops";
  for (const fuzz_inputs::Input& in : inputs) {
    const std::string finding = fuzz::fuzz_kv_ops_on(in.bytes.data(), in.bytes.size(), run);
    ASSERT_EQ(finding, "") << backend_name(backend) << ", " << in.name
                           << ", SPARSE_MLA_TEST_SEED=" << seed;
  }
  std::printf("GPU kv op calls: %d\n", *calls);
  EXPECT_GT(*calls, 300);
}

}  // namespace
}  // namespace sparse_mla
