// sparse_mla._ext: the C++ API over DLPack. Every array argument is anything nanobind can import
// (objects with __dlpack__, e.g. torch/cupy/jax, or the buffer protocol, e.g. numpy); arrays are
// viewed in place, never copied. The Python layer (__init__.py) allocates outputs and picks the
// stream; this module only converts, calls and turns a failed Status into an exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sparse_mla/sparse_mla.h"

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace nb = nanobind;
using namespace nb::literals;
using namespace sparse_mla;

namespace {

// Python class for StatusCode::kUnsupported (a NotImplementedError, hence a RuntimeError).
PyObject* g_unsupported_error = nullptr;
// The last field of a torch tensor descriptor (_arrays.native): an object of its own, so that no
// other tuple a caller passes is read as a raw pointer.
PyObject* g_descriptor_tag = nullptr;

struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return status.message().c_str(); }
  Status status;
};

void check(Status s) {
  if (!s.ok()) throw StatusError(std::move(s));
}

void translate_status_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const StatusError& e) {
    const std::string& msg = e.status.message();
    PyObject* type = PyExc_RuntimeError;
    switch (e.status.code()) {
      case StatusCode::kInvalidArgument:
        // Wrong dtypes are TypeErrors; everything else (shapes, strides, values) ValueErrors.
        type = msg.find(": dtype ") != std::string::npos ? PyExc_TypeError : PyExc_ValueError;
        break;
      case StatusCode::kUnsupported:
        type = g_unsupported_error;
        break;
      default:
        type = PyExc_RuntimeError;
        break;
    }
    PyErr_SetString(type, msg.c_str());
  }
}

std::string type_name_of(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// kDLFloat8_e4m3fn of DLPack 1.1 (spelled out: older nanobind releases do not name it).
constexpr uint8_t kDLPackFloat8E4M3FN = 10;

// DLPack dtype -> library dtype. uint16 is the raw-bits convention for bfloat16 (numpy has no
// bfloat16); float8_e4m3fn and uint8 both describe FP8 cache bytes.
std::optional<DType> to_dtype(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  if (d.lanes != 1) return std::nullopt;
  const auto code = static_cast<C>(d.code);
  if (code == C::UInt && d.bits == 8) return DType::kUInt8;
  if (code == C::UInt && d.bits == 16) return DType::kBFloat16;
  if (code == C::Int && d.bits == 32) return DType::kInt32;
  if (code == C::Float && d.bits == 32) return DType::kFloat32;
  if (code == C::Float && d.bits == 16) return DType::kFloat16;
  if (code == C::Bfloat && d.bits == 16) return DType::kBFloat16;
  if (d.code == kDLPackFloat8E4M3FN && d.bits == 8) return DType::kFloat8E4M3;
  return std::nullopt;
}

std::string dlpack_dtype_string(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const char* kind = "";
  switch (static_cast<C>(d.code)) {
    case C::Int:
      kind = "int";
      break;
    case C::UInt:
      kind = "uint";
      break;
    case C::Float:
      kind = "float";
      break;
    case C::Bfloat:
      kind = "bfloat";
      break;
    case C::Complex:
      kind = "complex";
      break;
    case C::Bool:
      kind = "bool";
      break;
    default:
      return "dlpack code " + std::to_string(d.code) + " bits " + std::to_string(d.bits);
  }
  return std::string(kind) + std::to_string(d.bits);
}

// Imports the arrays of one call and keeps them alive until the call returns.
class Arrays {
 public:
  TensorView input(nb::handle obj, const char* name) {
    if (is_descriptor(obj)) return descriptor(obj, name);
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(obj, a, false)) not_an_array(obj, name, false);
    TensorView t = view(a, name);
    inputs_.push_back(std::move(a));
    return t;
  }

  TensorView output(nb::handle obj, const char* name) {
    if (is_descriptor(obj)) return descriptor(obj, name);
    nb::ndarray<> a;
    if (!nb::try_cast(obj, a, false)) not_an_array(obj, name, true);
    TensorView t = view(a, name);
    outputs_.push_back(std::move(a));
    return t;
  }

  std::optional<TensorView> optional_input(nb::handle obj, const char* name) {
    if (obj.is_none()) return std::nullopt;
    return input(obj, name);
  }

  // A paged cache: [num_pages, page_size, h_kv, bytes or 576], or 3-D without the h_kv dim.
  KVCache cache(nb::handle obj, const char* name, bool writable) {
    TensorView t = writable ? output(obj, name) : input(obj, name);
    if (t.ndim == 3) {
      t.ndim = 4;
      t.shape[3] = t.shape[2];
      t.strides[3] = t.strides[2];
      t.shape[2] = 1;
      t.strides[2] = t.shape[3] * t.strides[3];
    }
    KVCache kv;
    check(kv_cache_from_tensor(t, name, &kv));
    return kv;
  }

  std::optional<KVCache> optional_cache(nb::handle obj, const char* name) {
    if (obj.is_none()) return std::nullopt;
    return cache(obj, name, false);
  }

  // Pointer and size in bytes of a workspace buffer (any dtype, contiguous) on `device` (the
  // library sees only the pointer), or none.
  std::pair<void*, size_t> buffer(nb::handle obj, const char* name, Device device) {
    if (obj.is_none()) return {nullptr, 0};
    if (is_descriptor(obj)) {
      TensorView t = descriptor(obj, name);
      if (!t.is_contiguous())
        throw nb::value_error((std::string(name) + ": not contiguous").c_str());
      check_buffer_device(t.device, device, name);
      return {t.data, static_cast<size_t>(t.numel()) * dtype_size(t.dtype)};
    }
    nb::ndarray<> a;
    if (!nb::try_cast(obj, a, false)) not_an_array(obj, name, true);
    if (!is_contiguous(a)) throw nb::value_error((std::string(name) + ": not contiguous").c_str());
    check_buffer_device(device_of(a, name), device, name);
    std::pair<void*, size_t> r{a.data(), a.nbytes()};
    outputs_.push_back(std::move(a));
    return r;
  }

 private:
  [[noreturn]] static void not_an_array(nb::handle obj, const char* name, bool writable) {
    std::string msg = std::string(name) + ": expected " +
                      (writable ? "a writable array" : "an array") +
                      " (DLPack or buffer protocol), got " + type_name_of(obj);
    throw nb::type_error(msg.c_str());
  }

  // (data_ptr, dtype code, shape, strides, device, _DESCRIPTOR_TAG): how the Python layer
  // describes a torch tensor, several times cheaper than a DLPack export. The dtype code is a
  // DType value; device -1 is the CPU, else a CUDA ordinal. The caller keeps the tensor alive
  // during the call. Any other tuple is not an array.
  static bool is_descriptor(nb::handle obj) {
    return PyTuple_CheckExact(obj.ptr()) && PyTuple_GET_SIZE(obj.ptr()) == 6 &&
           PyTuple_GET_ITEM(obj.ptr(), 5) == g_descriptor_tag;
  }

  static TensorView descriptor(nb::handle obj, const char* name) {
    nb::tuple d = nb::borrow<nb::tuple>(obj);
    TensorView t;
    t.data = reinterpret_cast<void*>(nb::cast<uintptr_t>(d[0]));
    const int code = nb::cast<int>(d[1]);
    if (code < 0 || code > static_cast<int>(DType::kFloat8E4M3)) {
      throw nb::type_error(
          (std::string(name) + ": unknown dtype code " + std::to_string(code)).c_str());
    }
    t.dtype = static_cast<DType>(code);
    const int device = nb::cast<int>(d[4]);
    t.device = device < 0 ? Device{DeviceType::kCPU, 0} : Device{DeviceType::kCUDA, device};
    nb::sequence shape = nb::borrow<nb::sequence>(d[2]);
    nb::sequence strides = nb::borrow<nb::sequence>(d[3]);
    const size_t ndim = nb::len(shape);
    if (ndim > static_cast<size_t>(kMaxDims) || nb::len(strides) != ndim) {
      throw nb::value_error((std::string(name) + ": rank " + std::to_string(ndim) +
                             ", expected at most " + std::to_string(kMaxDims))
                                .c_str());
    }
    t.ndim = static_cast<int>(ndim);
    for (size_t i = 0; i < ndim; ++i) {
      t.shape[i] = nb::cast<int64_t>(shape[i]);
      t.strides[i] = nb::cast<int64_t>(strides[i]);
    }
    return t;
  }

  static void check_buffer_device(Device actual, Device expected, const char* name) {
    if (actual == expected) return;
    throw nb::value_error((std::string(name) + ": on " + device_name(actual) + ", expected " +
                           device_name(expected) + " (the device of q)")
                              .c_str());
  }

  template <typename A>
  static Device device_of(const A& a, const char* name) {
    switch (a.device_type()) {
      case nb::device::cpu::value:
      case nb::device::cuda_host::value:
        return {DeviceType::kCPU, 0};
      case nb::device::cuda::value:
      case nb::device::cuda_managed::value:
        return {DeviceType::kCUDA, static_cast<int>(a.device_id())};
      default:
        throw nb::type_error((std::string(name) + ": DLPack device type " +
                              std::to_string(a.device_type()) + ", expected CPU or CUDA memory")
                                 .c_str());
    }
  }

  template <typename A>
  static bool is_contiguous(const A& a) {
    if (a.size() == 0) return true;  // nothing addressed (numpy 2 gives such arrays 0 strides)
    int64_t stride = 1;
    for (int d = static_cast<int>(a.ndim()) - 1; d >= 0; --d) {
      if (a.shape(d) != 1 && a.stride(d) != stride) return false;
      stride *= static_cast<int64_t>(a.shape(d));
    }
    return true;
  }

  template <typename A>
  static TensorView view(const A& a, const char* name) {
    TensorView t;
    if (a.ndim() > static_cast<size_t>(kMaxDims)) {
      throw nb::value_error((std::string(name) + ": rank " + std::to_string(a.ndim()) +
                             ", expected at most " + std::to_string(kMaxDims))
                                .c_str());
    }
    std::optional<DType> dtype = to_dtype(a.dtype());
    if (!dtype) {
      throw nb::type_error((std::string(name) + ": dtype " + dlpack_dtype_string(a.dtype()) +
                            ", expected one the library takes: bfloat16, float16, float32, "
                            "int32, uint8 or float8_e4m3fn (uint16 = bfloat16 bits)")
                               .c_str());
    }
    t.device = device_of(a, name);
    t.data = const_cast<void*>(static_cast<const void*>(a.data()));
    t.dtype = *dtype;
    t.ndim = static_cast<int>(a.ndim());
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = static_cast<int64_t>(a.shape(d));
      t.strides[d] = static_cast<int64_t>(a.stride(d));
    }
    return t;
  }

  std::vector<nb::ndarray<nb::ro>> inputs_;
  std::vector<nb::ndarray<>> outputs_;
};

Options make_options(const std::string& backend, uintptr_t stream) {
  Options o;
  check(parse_backend(backend, &o.backend));
  o.stream = reinterpret_cast<void*>(stream);
  return o;
}

// Output views for queries that only validate (workspace size, support, plan): shapes derived
// from q, data borrowed from q. The library checks them but never reads or writes through them.
void stand_in_outputs(const TensorView& q, DType out_dtype, TensorView* out, TensorView* lse) {
  if (q.ndim != 4) return;  // q's own check reports the problem
  const int64_t b = q.shape[0], s_q = q.shape[1], h_q = q.shape[2];
  *out = TensorView::contiguous(q.data, out_dtype, q.device, {b, s_q, h_q, kDV});
  *lse = TensorView::contiguous(q.data, DType::kFloat32, q.device, {b, h_q, s_q});
}

// ---- sparse decode ----

// A call's arrays and arguments, and the library functions for its kind of decode (the
// decode_* templates below serve sparse and dense alike).
struct SparseCall {
  Arrays arrays;
  SparseDecodeArgs args;
  static constexpr auto workspace_size = &sparse_mla::sparse_decode_workspace_size;
  static constexpr auto supported = &sparse_mla::sparse_decode_supported;
  static constexpr auto plan = &sparse_mla::sparse_decode_plan;
  static constexpr auto run = &sparse_mla::sparse_decode;
};

void build_sparse(SparseCall& c, nb::handle q, nb::handle k_cache, nb::handle indices,
                  nb::handle topk_length, nb::handle extra_k_cache, nb::handle extra_indices,
                  nb::handle extra_topk_length, nb::handle attn_sink,
                  std::optional<double> softmax_scale, nb::handle out, nb::handle lse,
                  bool outputs_required) {
  auto& a = c.args;
  auto& arr = c.arrays;
  a.q = arr.input(q, "q");
  a.kv = arr.cache(k_cache, "k_cache", false);
  a.indices = arr.input(indices, "indices");
  a.topk_length = arr.optional_input(topk_length, "topk_length");
  a.extra_kv = arr.optional_cache(extra_k_cache, "extra_k_cache");
  a.extra_indices = arr.optional_input(extra_indices, "extra_indices");
  a.extra_topk_length = arr.optional_input(extra_topk_length, "extra_topk_length");
  a.attn_sink = arr.optional_input(attn_sink, "attn_sink");
  if (softmax_scale) a.softmax_scale = static_cast<float>(*softmax_scale);
  if (outputs_required || !out.is_none() || !lse.is_none()) {
    a.out = arr.output(out, "out");
    a.lse = arr.output(lse, "lse");
  } else {
    stand_in_outputs(a.q, DType::kBFloat16, &a.out, &a.lse);
  }
}

// ---- dense decode ----

struct DenseCall {
  Arrays arrays;
  DenseDecodeArgs args;
  static constexpr auto workspace_size = &sparse_mla::dense_decode_workspace_size;
  static constexpr auto supported = &sparse_mla::dense_decode_supported;
  static constexpr auto plan = &sparse_mla::dense_decode_plan;
  static constexpr auto run = &sparse_mla::dense_decode;
};

void build_dense(DenseCall& c, nb::handle q, nb::handle k_cache, nb::handle block_table,
                 nb::handle cache_seqlens, bool causal, std::optional<double> softmax_scale,
                 nb::handle out, nb::handle lse, bool outputs_required) {
  auto& a = c.args;
  auto& arr = c.arrays;
  a.q = arr.input(q, "q");
  a.kv = arr.cache(k_cache, "k_cache", false);
  a.block_table = arr.input(block_table, "block_table");
  a.cache_seqlens = arr.input(cache_seqlens, "cache_seqlens");
  a.causal = causal;
  if (softmax_scale) a.softmax_scale = static_cast<float>(*softmax_scale);
  if (outputs_required || !out.is_none() || !lse.is_none()) {
    a.out = arr.output(out, "out");
    a.lse = arr.output(lse, "lse");
  } else {
    stand_in_outputs(a.q, a.q.dtype, &a.out, &a.lse);
  }
}

Workspace make_workspace(Arrays& arr, nb::handle plan, nb::handle scratch, Device device) {
  Workspace ws;
  std::tie(ws.plan, ws.plan_bytes) = arr.buffer(plan, "plan", device);
  std::tie(ws.scratch, ws.scratch_bytes) = arr.buffer(scratch, "scratch", device);
  return ws;
}

// (ok, backend, reason): a request that fails validation is "not supported", with the reason.
std::tuple<bool, std::string, std::string> support_result(const Status& s, Backend chosen) {
  if (s.ok()) return {true, backend_name(chosen), ""};
  return {false, "", s.to_string()};
}

template <typename Call>
std::tuple<size_t, size_t> decode_workspace_size(const Call& c, const std::string& backend) {
  WorkspaceSizes sizes;
  check(Call::workspace_size(c.args, make_options(backend, 0), &sizes));
  return {sizes.plan_bytes, sizes.scratch_bytes};
}

// build(call) imports the arrays; arrays it rejects make the request "not supported".
template <typename Call, typename Build>
std::tuple<bool, std::string, std::string> decode_supported(Build&& build,
                                                            const std::string& backend) {
  Call c;
  try {
    build(c);
  } catch (const StatusError& e) {
    return support_result(e.status, Backend::kAuto);
  } catch (const nb::builtin_exception& e) {
    return support_result(Status::InvalidArgument(e.what()), Backend::kAuto);
  }
  Backend chosen = Backend::kAuto;
  Options o;
  Status s = parse_backend(backend, &o.backend);
  if (s.ok()) s = Call::supported(c.args, o, &chosen);
  return support_result(s, chosen);
}

template <typename Call>
void decode_plan(Call& c, nb::handle plan, nb::handle scratch, const std::string& backend,
                 uintptr_t stream) {
  Workspace ws = make_workspace(c.arrays, plan, scratch, c.args.q.device);
  Options o = make_options(backend, stream);
  nb::gil_scoped_release release;
  check(Call::plan(c.args, ws, o));
}

template <typename Call>
void decode_run(Call& c, nb::handle plan, nb::handle scratch, nb::handle allocate,
                const std::string& backend, uintptr_t stream) {
  Options o = make_options(backend, stream);
  Workspace ws = make_workspace(c.arrays, plan, scratch, c.args.q.device);
  if (plan.is_none() && scratch.is_none() && !allocate.is_none()) {
    // One call does size, allocate, plan and run (one import of the arrays).
    WorkspaceSizes sizes;
    check(Call::workspace_size(c.args, o, &sizes));
    if (sizes.plan_bytes != 0 || sizes.scratch_bytes != 0) {
      ws = make_workspace(c.arrays, allocate(sizes.plan_bytes), allocate(sizes.scratch_bytes),
                          c.args.q.device);
      nb::gil_scoped_release release;
      check(Call::plan(c.args, ws, o));
    }
  }
  nb::gil_scoped_release release;
  check(Call::run(c.args, ws, o));
}

#if SPARSE_MLA_WITH_CUDA
void cuda_free(void* p) noexcept { cudaFree(p); }
#endif

// Fresh uninitialised memory as a DLPack-capable array, for callers whose array library we do
// not know how to allocate with (the array is handed to its from_dlpack).
// nb::array_api (nanobind >= 2.2) returns an object with __dlpack__; older ones a capsule.
#if NB_VERSION_MAJOR > 2 || (NB_VERSION_MAJOR == 2 && NB_VERSION_MINOR >= 2)
using DLPackArray = nb::ndarray<nb::array_api>;
#else
using DLPackArray = nb::ndarray<>;
#endif

DLPackArray empty(std::vector<size_t> shape, const std::string& dtype, bool cuda, int device) {
  using C = nb::dlpack::dtype_code;
  nb::dlpack::dtype dt{};
  dt.lanes = 1;
  if (dtype == "bfloat16") {
    dt.code = static_cast<uint8_t>(C::Bfloat), dt.bits = 16;
  } else if (dtype == "float16") {
    dt.code = static_cast<uint8_t>(C::Float), dt.bits = 16;
  } else if (dtype == "float32") {
    dt.code = static_cast<uint8_t>(C::Float), dt.bits = 32;
  } else if (dtype == "int32") {
    dt.code = static_cast<uint8_t>(C::Int), dt.bits = 32;
  } else if (dtype == "uint8") {
    dt.code = static_cast<uint8_t>(C::UInt), dt.bits = 8;
  } else {
    throw nb::value_error(
        ("dtype: '" + dtype + "', expected bfloat16, float16, float32, int32 or uint8").c_str());
  }
  const size_t elem = dt.bits / 8;
  size_t bytes = elem;
  for (size_t s : shape) bytes *= s;
  if (bytes == 0) bytes = 16;
  void* p = nullptr;
  nb::capsule owner;
  if (cuda) {
#if SPARSE_MLA_WITH_CUDA
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaError_t err = cudaMalloc(&p, bytes);
    cudaSetDevice(previous);
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("cudaMalloc of ") + std::to_string(bytes) +
                               " bytes failed: " + cudaGetErrorString(err));
    }
    owner = nb::capsule(p, [](void* q) noexcept { cuda_free(q); });
#else
    throw nb::value_error("device: cuda requested, but this build has no CUDA backend");
#endif
  } else {
    p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    owner = nb::capsule(p, [](void* q) noexcept { std::free(q); });
  }
  const int device_type = cuda ? nb::device::cuda::value : nb::device::cpu::value;
  return DLPackArray(p, shape.size(), shape.data(), owner, nullptr, dt, device_type,
                     cuda ? device : 0);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "sparse-mla C++ API over DLPack (use the sparse_mla package, not this module)";

  g_unsupported_error =
      PyErr_NewException("sparse_mla.UnsupportedError", PyExc_NotImplementedError, nullptr);
  m.attr("UnsupportedError") = nb::handle(g_unsupported_error);
  g_descriptor_tag = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
  m.attr("_DESCRIPTOR_TAG") = nb::handle(g_descriptor_tag);
  nb::register_exception_translator(translate_status_error);

#if SPARSE_MLA_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif

  m.def(
      "available_backends",
      [] {
        std::vector<std::string> names;
        for (Backend b : available_backends()) names.emplace_back(backend_name(b));
        return names;
      },
      "Backends compiled in and usable on this machine ('cpu' always).");

  m.def("empty", &empty, "shape"_a, "dtype"_a, "cuda"_a = false, "device"_a = 0,
        "Uninitialised memory as a DLPack-capable array (CPU or CUDA).");

  // ---- sparse decode ----
#define SPARSE_PARAMS                                                                   \
  nb::handle q, nb::handle k_cache, nb::handle indices, nb::handle topk_length,         \
      nb::handle extra_k_cache, nb::handle extra_indices, nb::handle extra_topk_length, \
      nb::handle attn_sink, std::optional<double> softmax_scale, nb::handle out, nb::handle lse
#define SPARSE_ARGS                                                                             \
  q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, attn_sink, \
      softmax_scale, out, lse
#define SPARSE_NAMES                                                                               \
  "q"_a, "k_cache"_a, "indices"_a, "topk_length"_a = nb::none(), "extra_k_cache"_a = nb::none(),   \
                                   "extra_indices"_a = nb::none(),                                 \
                                   "extra_topk_length"_a = nb::none(), "attn_sink"_a = nb::none(), \
                                   "softmax_scale"_a = nb::none(), "out"_a = nb::none(),           \
                                   "lse"_a = nb::none()

  m.def(
      "sparse_decode_workspace_size",
      [](SPARSE_PARAMS, const std::string& backend) {
        SparseCall c;
        build_sparse(c, SPARSE_ARGS, false);
        return decode_workspace_size(c, backend);
      },
      SPARSE_NAMES, "backend"_a = "auto", "(plan_bytes, scratch_bytes) for a sparse decode.");

  m.def(
      "sparse_decode_supported",
      [](SPARSE_PARAMS, const std::string& backend) {
        return decode_supported<SparseCall>(
            [&](SparseCall& c) { build_sparse(c, SPARSE_ARGS, false); }, backend);
      },
      SPARSE_NAMES, "backend"_a = "auto",
      "(ok, backend, reason): whether and where a sparse decode can run.");

  m.def(
      "sparse_decode_plan",
      [](SPARSE_PARAMS, nb::handle plan, nb::handle scratch, const std::string& backend,
         uintptr_t stream) {
        SparseCall c;
        build_sparse(c, SPARSE_ARGS, false);
        decode_plan(c, plan, scratch, backend, stream);
      },
      SPARSE_NAMES, "plan"_a = nb::none(), "scratch"_a = nb::none(), "backend"_a = "auto",
      "stream"_a = 0, "Fills the plan buffer for a sparse decode (on the device, graph-safe).");

  m.def(
      "sparse_decode",
      [](SPARSE_PARAMS, nb::handle plan, nb::handle scratch, nb::handle allocate,
         const std::string& backend, uintptr_t stream) {
        SparseCall c;
        build_sparse(c, SPARSE_ARGS, true);
        decode_run(c, plan, scratch, allocate, backend, stream);
      },
      SPARSE_NAMES, "plan"_a = nb::none(), "scratch"_a = nb::none(), "allocate"_a = nb::none(),
      "backend"_a = "auto", "stream"_a = 0,
      "Sparse decode into out/lse. Without plan/scratch, allocate(nbytes) supplies the "
      "workspace and the call plans first.");

  // ---- dense decode ----
#define DENSE_PARAMS                                                                               \
  nb::handle q, nb::handle k_cache, nb::handle block_table, nb::handle cache_seqlens, bool causal, \
      std::optional<double> softmax_scale, nb::handle out, nb::handle lse
#define DENSE_ARGS q, k_cache, block_table, cache_seqlens, causal, softmax_scale, out, lse
#define DENSE_NAMES                                                             \
  "q"_a, "k_cache"_a, "block_table"_a, "cache_seqlens"_a,                       \
      "causal"_a = false, "softmax_scale"_a = nb::none(), "out"_a = nb::none(), \
      "lse"_a = nb::none()

  m.def(
      "dense_decode_workspace_size",
      [](DENSE_PARAMS, const std::string& backend) {
        DenseCall c;
        build_dense(c, DENSE_ARGS, false);
        return decode_workspace_size(c, backend);
      },
      DENSE_NAMES, "backend"_a = "auto", "(plan_bytes, scratch_bytes) for a dense decode.");

  m.def(
      "dense_decode_supported",
      [](DENSE_PARAMS, const std::string& backend) {
        return decode_supported<DenseCall>(
            [&](DenseCall& c) { build_dense(c, DENSE_ARGS, false); }, backend);
      },
      DENSE_NAMES, "backend"_a = "auto",
      "(ok, backend, reason): whether and where a dense decode can run.");

  m.def(
      "dense_decode_plan",
      [](DENSE_PARAMS, nb::handle plan, nb::handle scratch, const std::string& backend,
         uintptr_t stream) {
        DenseCall c;
        build_dense(c, DENSE_ARGS, false);
        decode_plan(c, plan, scratch, backend, stream);
      },
      DENSE_NAMES, "plan"_a = nb::none(), "scratch"_a = nb::none(), "backend"_a = "auto",
      "stream"_a = 0, "Fills the plan buffer for a dense decode (on the device, graph-safe).");

  m.def(
      "dense_decode",
      [](DENSE_PARAMS, nb::handle plan, nb::handle scratch, nb::handle allocate,
         const std::string& backend, uintptr_t stream) {
        DenseCall c;
        build_dense(c, DENSE_ARGS, true);
        decode_run(c, plan, scratch, allocate, backend, stream);
      },
      DENSE_NAMES, "plan"_a = nb::none(), "scratch"_a = nb::none(), "allocate"_a = nb::none(),
      "backend"_a = "auto", "stream"_a = 0,
      "Dense decode into out/lse. Without plan/scratch, allocate(nbytes) supplies the "
      "workspace and the call plans first.");

  // ---- merge and KV tools ----
  m.def(
      "merge_attention",
      [](nb::handle out_parts, nb::handle lse_parts, nb::handle attn_sink, nb::handle out,
         nb::handle lse, const std::string& backend, uintptr_t stream) {
        Arrays arr;
        MergeArgs a;
        a.out_parts = arr.input(out_parts, "out_parts");
        a.lse_parts = arr.input(lse_parts, "lse_parts");
        a.attn_sink = arr.optional_input(attn_sink, "attn_sink");
        a.out = arr.output(out, "out");
        a.lse = arr.output(lse, "lse");
        Options o = make_options(backend, stream);
        nb::gil_scoped_release release;
        check(merge_attention(a, o));
      },
      "out_parts"_a, "lse_parts"_a, "attn_sink"_a = nb::none(), "out"_a, "lse"_a,
      "backend"_a = "auto", "stream"_a = 0, "Merges partial (out, lse) results into out/lse.");

  m.def(
      "quantize_store",
      [](nb::handle src, nb::handle slots, nb::handle k_cache, const std::string& backend,
         uintptr_t stream) {
        Arrays arr;
        QuantizeStoreArgs a;
        a.src = arr.input(src, "src");
        a.slots = arr.input(slots, "slots");
        a.kv = arr.cache(k_cache, "k_cache", true);
        Options o = make_options(backend, stream);
        nb::gil_scoped_release release;
        check(quantize_store(a, o));
      },
      "src"_a, "slots"_a, "k_cache"_a, "backend"_a = "auto", "stream"_a = 0,
      "Quantizes rows of src and stores them into the cache slots.");

  m.def(
      "dequantize",
      [](nb::handle k_cache, nb::handle slots, nb::handle out, const std::string& backend,
         uintptr_t stream) {
        Arrays arr;
        DequantizeArgs a;
        a.kv = arr.cache(k_cache, "k_cache", false);
        a.slots = arr.input(slots, "slots");
        a.out = arr.output(out, "out");
        Options o = make_options(backend, stream);
        nb::gil_scoped_release release;
        check(dequantize(a, o));
      },
      "k_cache"_a, "slots"_a, "out"_a, "backend"_a = "auto", "stream"_a = 0,
      "Reads cache slots back as rows of d_qk values into out.");

  m.def(
      "repack_pages",
      [](nb::handle src, nb::handle dst, nb::handle src_block_table, nb::handle dst_block_table,
         nb::handle seqlens, const std::string& backend, uintptr_t stream) {
        Arrays arr;
        RepackArgs a;
        a.src = arr.cache(src, "src", false);
        a.dst = arr.cache(dst, "dst", true);
        a.src_block_table = arr.input(src_block_table, "src_block_table");
        a.dst_block_table = arr.input(dst_block_table, "dst_block_table");
        a.seqlens = arr.input(seqlens, "seqlens");
        Options o = make_options(backend, stream);
        nb::gil_scoped_release release;
        check(repack_pages(a, o));
      },
      "src"_a, "dst"_a, "src_block_table"_a, "dst_block_table"_a, "seqlens"_a, "backend"_a = "auto",
      "stream"_a = 0, "Copies each request's first seqlens[i] tokens from src pages to dst pages.");
}
