"""Array plumbing shared by the native API: which library an array comes from, how to allocate a
result like it, and which CUDA stream to run on. No framework is imported unless the caller's
arrays already come from it."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, ContextManager, Optional, Sequence, Tuple

import numpy as np

try:  # numpy has no bfloat16 of its own; ml_dtypes provides one when installed.
    import ml_dtypes as _ml_dtypes

    NUMPY_BF16: Any = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    NUMPY_BF16 = np.dtype(np.uint16)

_NUMPY_DTYPES = {
    "bfloat16": NUMPY_BF16,
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "uint8": np.dtype(np.uint8),
}
_RAW_VIEW = {1: np.uint8, 2: np.uint16}


_FRAMEWORK_OF_TYPE: dict = {np.ndarray: "numpy"}
# torch dtype name -> the library's DType code (include/sparse_mla/tensor.h); uint16 = bf16 bits
_TORCH_DTYPE_CODES = {"uint8": 0, "int32": 1, "float32": 2, "bfloat16": 3, "float16": 4,
                      "float8_e4m3fn": 5, "uint16": 3}
_torch_codes: dict = {}


def _framework_of_type(t: type) -> str:
    torch = sys.modules.get("torch")  # no torch tensor exists unless torch was imported
    if torch is not None and issubclass(t, torch.Tensor):  # subclasses from any module too
        return "torch"
    module = t.__module__
    if module.startswith("cupy"):
        return "cupy"
    if issubclass(t, np.ndarray):
        return "numpy"
    return "other"


def framework(x: Any) -> str:
    """'numpy', 'torch', 'cupy' or 'other' (anything else that speaks DLPack)."""
    t = type(x)
    fw = _FRAMEWORK_OF_TYPE.get(t)
    if fw is None:
        fw = _FRAMEWORK_OF_TYPE[t] = _framework_of_type(t)
    return fw


def _torch_code(dtype: Any) -> Optional[int]:
    code = _torch_codes.get(dtype, -1)
    if code == -1:
        code = _torch_codes[dtype] = _TORCH_DTYPE_CODES.get(str(dtype).replace("torch.", ""))
    return code


def native(x: Any, name: str) -> Any:
    """The object handed to the extension for argument `name`. numpy arrays of the ml_dtypes
    types the library takes (bfloat16, float8_e4m3fn) travel as raw uint16/uint8 bits, since numpy
    cannot export them; other ml_dtypes types are refused by name (as raw bits some would pass for
    uint8 caches, and numpy cannot export the others). torch tensors travel as (data_ptr, dtype
    code, shape, strides, device) descriptors: reading those is several times cheaper than a
    DLPack export, and works for tensors that require grad."""
    fw = framework(x)
    if fw == "numpy":
        if x.dtype.type.__module__ != "ml_dtypes":
            return x
        if x.dtype.name in ("bfloat16", "float8_e4m3fn"):
            return x.view(_RAW_VIEW[x.dtype.itemsize])
        raise TypeError(f"{name}: dtype {x.dtype.name}, expected one the library takes: "
                        "bfloat16, float16, float32, int32, uint8 or float8_e4m3fn")
    if fw == "torch":
        if x.is_neg():  # its memory holds the values un-negated, DLPack exports them as such
            raise ValueError(f"{name}: a torch tensor with the negative bit set (a lazy negation, "
                             "e.g. from .conj().imag): pass tensor.resolve_neg()")
        code = _torch_code(x.dtype)
        if code is not None and x.layout is _torch_strided() and (x.is_cuda or x.is_cpu):
            return (x.data_ptr(), code, x.shape, x.stride(), x.get_device(), _descriptor_tag())
    return x


def natives(**arrays: Any) -> dict:
    """native() of each keyword argument, by its name."""
    return {name: native(x, name) for name, x in arrays.items()}


_tag = None


def _descriptor_tag() -> Any:
    """The extension's marker that makes a tuple a tensor descriptor (no other tuple is one)."""
    global _tag
    if _tag is None:
        from . import _ext

        _tag = _ext._DESCRIPTOR_TAG
    return _tag


_strided = None


def _torch_strided():
    global _strided
    if _strided is None:
        _strided = sys.modules["torch"].strided
    return _strided


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def dtype_name(x: Any) -> str:
    """Library dtype name of an array ('bfloat16', 'float16', 'float32', ...)."""
    if framework(x) == "torch":
        return str(x.dtype).replace("torch.", "")
    name = np.dtype(x.dtype).name if framework(x) in ("numpy", "cupy") else str(x.dtype)
    return "bfloat16" if name == "uint16" else name


def on_stream(like: Any, stream: Optional[int]) -> ContextManager[Any]:
    """Makes `stream` (the cudaStream_t of an explicit ``stream=``) the current stream of the
    library of `like` (torch, cupy), so that what it allocates or launches meanwhile belongs to
    that stream: the caching allocators then reuse the memory only after that stream's work.
    A no-op for ``stream=None``, host arrays and other libraries."""
    fw = framework(like)
    if stream is None or fw not in ("torch", "cupy"):
        return contextlib.nullcontext()
    if fw == "torch":
        import torch

        if like.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.default_stream(like.device) if stream == 0 else
                                 torch.cuda.ExternalStream(stream, device=like.device))
    import cupy

    return cupy.cuda.Stream.null if stream == 0 else cupy.cuda.ExternalStream(stream)


def empty(like: Any, shape: Sequence[int], dtype: str, stream: Optional[int] = None) -> Any:
    """Uninitialised array of the library of `like`, on its device (on `stream`: `on_stream`)."""
    fw = framework(like)
    shape = tuple(int(s) for s in shape)
    if fw == "torch":
        import torch

        with on_stream(like, stream):
            return torch.empty(shape, dtype=_torch_dtype(dtype), device=like.device)
    if fw == "numpy":
        return np.empty(shape, dtype=_NUMPY_DTYPES[dtype])
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id), on_stream(like, stream):
            return cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else dtype)
    from . import _ext

    device_type, device_id = like.__dlpack_device__()
    return _ext.empty(list(shape), dtype, cuda=int(device_type) in (2, 13), device=int(device_id))


def finish(like: Any, result: Any) -> Any:
    """Hands a result allocated by `empty` to the caller: arrays of other libraries come back
    through their namespace's from_dlpack when they have one."""
    if framework(like) != "other" or framework(result) != "other":
        return result
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is None:
        return result
    return namespace().from_dlpack(result)


def transposed_12(x: Any) -> Any:
    """A view of a 3-D array with dims 1 and 2 swapped (lse [b, s_q, h_q] -> [b, h_q, s_q])."""
    fw = framework(x)
    if fw == "torch":
        return x.transpose(1, 2)
    if fw in ("numpy", "cupy"):
        return x.transpose(0, 2, 1)
    return None


def lse_like(like: Any, b: int, s_q: int, h_q: int, stream: Optional[int] = None) -> Any:
    """lse [b, h_q, s_q] float32 as a view of a contiguous [b, s_q, h_q] buffer (FlashMLA's sparse
    layout, strides (s_q*h_q, 1, h_q)); arrays of other libraries get a contiguous one."""
    if framework(like) == "other":
        return empty(like, (b, h_q, s_q), "float32", stream)
    return transposed_12(empty(like, (b, s_q, h_q), "float32", stream))


def stack(parts: Sequence[Any], name: str, stream: Optional[int] = None) -> Any:
    """The arrays of argument `name` (a list) stacked into one [n, ...] array."""
    first = parts[0]
    fw = framework(first)
    if fw == "torch":
        import torch

        with on_stream(first, stream):
            return torch.stack(list(parts))
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(first.device.id), on_stream(first, stream):
            return cupy.stack(list(parts))
    if fw == "numpy":
        if any(np.dtype(p.dtype) != first.dtype for p in parts):  # raw bits must not be mixed
            raise TypeError(f"{name}: the parts have dtypes "
                            f"{sorted({np.dtype(p.dtype).name for p in parts})}, expected one")
        return np.stack([native(p, name) for p in parts]).view(first.dtype)
    raise TypeError(f"{name}: a sequence of arrays must hold numpy, torch or cupy arrays; "
                    f"got {type(first).__name__} (stack them into one [n, ...] array first)")


def _torch_stream(device_index: int) -> int:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def stream_for(x: Any, stream: Optional[Any]) -> int:
    """The cudaStream_t (as an int) to run on: an explicit `stream` (an int, a torch.cuda.Stream or
    a cupy stream), else the current stream of the array's library; 0 (the default stream)
    otherwise and for host arrays."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):
            handle = getattr(stream, attr, None)
            if handle is not None:
                return int(handle)
        raise TypeError(f"stream: expected an int, a torch.cuda.Stream or a cupy stream, got "
                        f"{type(stream).__name__}")
    fw = framework(x)
    if fw == "torch":
        if x.device.type == "cuda":
            return _torch_stream(x.device.index)
        return 0
    if fw == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def torch_loaded() -> bool:
    return "torch" in sys.modules


def shape_of(x: Any) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)
