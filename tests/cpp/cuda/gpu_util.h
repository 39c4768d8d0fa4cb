// Helpers for GPU tests: RAII device memory and streams, host<->device copies of strided tensors
// and KV caches, and SKIP_WITHOUT_GPU(). Tests use these instead of raw CUDA calls so that a
// failing copy or launch reports itself as a test failure instead of crashing.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "sparse_mla/backend.h"
#include "sparse_mla/kv_cache.h"
#include "sparse_mla/tensor.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla::gpu_test {

// Whether CUDA device 0 can run our kernels (sm_80+); why not in *why_not otherwise.
inline bool gpu_available(std::string* why_not) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    *why_not = std::string("no CUDA device: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    *why_not = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major < 8) {
    cudaGetLastError();
    *why_not = "CUDA device 0 is older than sm_80";
    return false;
  }
  return true;
}

inline Device cuda_device() { return Device{DeviceType::kCUDA, 0}; }

using test_support::test_seed;

// Device memory owned by the test; freed when it goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    // A zero-byte tensor still gets a valid pointer so that views are never null.
    cudaError_t err = cudaMalloc(&data_, bytes == 0 ? 16 : bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      data_ = nullptr;
      ADD_FAILURE() << "cudaMalloc(" << bytes << "): " << cudaGetErrorString(err);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  bool ok() const { return data_ != nullptr; }

  // Fills every byte (e.g. 0xff as a NaN poison for float/bf16 outputs). Waits for the fill:
  // tests run on non-blocking streams, which do not order after the default stream.
  void fill(uint8_t byte) {
    if (!data_) return;
    expect_ok(cudaMemset(data_, byte, bytes_), "cudaMemset");
    expect_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemset");
  }
  // Waits for the copy too: from pageable memory cudaMemcpy may return before its DMA lands, and
  // a kernel on a non-blocking stream could then run first (a fuzz replay saw its output's
  // 0xa5 fill land over a dequantized row).
  void upload(const void* host, size_t bytes) {
    EXPECT_LE(bytes, bytes_) << "upload larger than the buffer";
    if (data_ && bytes <= bytes_) {
      expect_ok(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
      expect_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemcpy H2D");
    }
  }
  void download(void* host, size_t bytes) const {
    EXPECT_LE(bytes, bytes_) << "download larger than the buffer";
    if (data_ && bytes <= bytes_) {
      expect_ok(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    }
  }
  template <typename T>
  std::vector<T> to_vector() const {
    std::vector<T> v(bytes_ / sizeof(T));
    download(v.data(), v.size() * sizeof(T));
    return v;
  }

 private:
  static void expect_ok(cudaError_t err, const char* what) {
    EXPECT_EQ(err, cudaSuccess) << what << ": " << cudaGetErrorString(err);
  }
  void release() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buf(host.size() * sizeof(T));
  buf.upload(host.data(), host.size() * sizeof(T));
  return buf;
}

// A non-blocking stream, destroyed with the object.
inline Backend gpu_backend_under_test() {
  const char* env = std::getenv("SPARSE_MLA_TEST_BACKEND");
  return env != nullptr && std::string(env) == "sm90" ? Backend::kSM90 : Backend::kCUDA;
}

class Stream {
 public:
  Stream() {
    cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    EXPECT_EQ(err, cudaSuccess) << "cudaStreamCreate: " << cudaGetErrorString(err);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t get() const { return stream_; }
  void* handle() const { return static_cast<void*>(stream_); }
  // Waits for the stream and reports any asynchronous error of the work on it.
  ::testing::AssertionResult sync() const {
    cudaError_t err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(err);
    return ::testing::AssertionSuccess();
  }
  // Options that run a call on this stream with the GPU backend under test: `cuda` (portable
  // kernels), or `sm90` when SPARSE_MLA_TEST_BACKEND=sm90 (scripts/gpu_check.sh runs the GPU
  // tests once per backend).
  Options options(Backend backend = gpu_backend_under_test()) const {
    Options o;
    o.backend = backend;
    o.stream = handle();
    return o;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

// Elements a strided view spans from its data pointer (strides must be >= 0).
inline int64_t span_elements(const TensorView& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return 0;
    last += (t.shape[d] - 1) * t.strides[d];
  }
  return last + 1;
}

inline size_t span_bytes(const TensorView& t) {
  return static_cast<size_t>(span_elements(t)) * dtype_size(t.dtype);
}

// A device copy of a host tensor: same dtype, shape and strides, memory owned by `buffer`.
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

// Copies the whole span of `host` (padding included, so strided views keep their gaps' bytes).
// offset_bytes > 0 places the view that far past the allocation's start, e.g. to test data
// pointers that are only element-aligned.
inline DeviceTensor to_device(const TensorView& host, size_t offset_bytes = 0) {
  DeviceTensor t{DeviceBuffer(span_bytes(host) + offset_bytes), host};
  t.view.data = static_cast<uint8_t*>(t.buffer.data()) + offset_bytes;
  t.view.device = cuda_device();
  if (t.buffer.ok()) {
    const cudaError_t err =
        cudaMemcpy(t.view.data, host.data, span_bytes(host), cudaMemcpyHostToDevice);
    EXPECT_EQ(err, cudaSuccess) << "cudaMemcpy H2D: " << cudaGetErrorString(err);
  }
  return t;
}

// A device tensor shaped like `like` whose every byte is `poison` (0xff: NaN in float/bf16).
// offset_bytes as in to_device.
inline DeviceTensor poisoned_like(const TensorView& like, uint8_t poison = 0xff,
                                  size_t offset_bytes = 0) {
  DeviceTensor t{DeviceBuffer(span_bytes(like) + offset_bytes), like};
  t.buffer.fill(poison);
  t.view.data = static_cast<uint8_t*>(t.buffer.data()) + offset_bytes;
  t.view.device = cuda_device();
  return t;
}

// Copies a device tensor's span back into host memory laid out like `host`.
inline void copy_to_host(const DeviceTensor& dev, const TensorView& host) {
  EXPECT_EQ(span_bytes(dev.view), span_bytes(host)) << "copy_to_host: spans differ";
  if (!dev.buffer.ok() || span_bytes(dev.view) != span_bytes(host)) return;
  const cudaError_t err =
      cudaMemcpy(host.data, dev.view.data, span_bytes(host), cudaMemcpyDeviceToHost);
  EXPECT_EQ(err, cudaSuccess) << "cudaMemcpy D2H: " << cudaGetErrorString(err);
}

// Bytes a KV cache occupies: num_pages pages of page_stride bytes.
inline size_t kv_bytes(const KVCache& kv) {
  return static_cast<size_t>(kv.num_pages) * static_cast<size_t>(kv.page_stride);
}

struct DeviceKV {
  DeviceBuffer buffer;
  KVCache kv;
};

// A device copy of a host cache (every byte, page padding included).
inline DeviceKV to_device(const KVCache& host) {
  DeviceKV d{DeviceBuffer(kv_bytes(host)), host};
  d.buffer.upload(host.data, kv_bytes(host));
  d.kv.data = d.buffer.data();
  d.kv.device = cuda_device();
  return d;
}

// Every byte of a device cache, for bitwise comparison with a host cache.
inline std::vector<uint8_t> to_host_bytes(const DeviceKV& d) {
  std::vector<uint8_t> bytes(kv_bytes(d.kv));
  d.buffer.download(bytes.data(), bytes.size());
  return bytes;
}

}  // namespace sparse_mla::gpu_test

// Skips the current test, with the reason, when no usable CUDA device is present.
#define SKIP_WITHOUT_GPU()                                              \
  do {                                                                  \
    std::string sparse_mla_why_not_;                                    \
    if (!::sparse_mla::gpu_test::gpu_available(&sparse_mla_why_not_)) { \
      GTEST_SKIP() << "needs a CUDA device: " << sparse_mla_why_not_;   \
    }                                                                   \
  } while (0)
