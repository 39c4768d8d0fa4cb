"""sparse-mla: multi-head latent attention (MLA) decode for DeepSeek-V4-class models.

Sparse top-k decode and dense decode over paged FP8 (MODEL1, V32) or bf16/fp16 KV caches, a merge
of partial results, and KV-cache tools, on the CPU or on CUDA GPUs.

Arrays: anything that speaks DLPack (torch, cupy, jax, ...) or numpy arrays. Results are allocated
with the library of the first array argument, on its device, and work runs on that library's
current CUDA stream (torch's current stream for torch tensors) unless ``stream=`` says otherwise.
numpy has no bfloat16: pass ``ml_dtypes.bfloat16`` arrays or uint16 arrays holding bf16 bit
patterns; bf16 results come back as ``ml_dtypes.bfloat16`` when ml_dtypes is installed, else as
uint16 bits. FP8 caches are uint8 (or float8_e4m3fn) ``[num_pages, page_size, 1, 584|656]``.

Errors: ValueError (bad shapes, strides, values), TypeError (wrong dtypes or non-arrays),
UnsupportedError (a NotImplementedError: no backend can run the request here) and RuntimeError
(device failures), each with the library's message.

The ``sparse_mla.flash_mla`` module is a drop-in for FlashMLA's ``flash_mla``; ``sparse_mla.ops``
registers the operations with torch.library (imported automatically when torch is loaded).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _arrays, _ext
from ._ext import UnsupportedError

__version__ = "0.1.0"
__all__ = [
    "D_V",
    "Support",
    "UnsupportedError",
    "Workspace",
    "WorkspaceSizes",
    "available_backends",
    "dense_decode",
    "dense_decode_plan",
    "dense_decode_supported",
    "dense_decode_workspace_size",
    "dequantize",
    "is_supported",
    "merge_attention",
    "quantize_store",
    "repack_pages",
    "sparse_decode",
    "sparse_decode_plan",
    "sparse_decode_supported",
    "sparse_decode_workspace_size",
]

D_V = 512  # value width of every cache format
_D_QK_OF_LAST_DIM = {584: 512, 656: 576, 576: 576}


class WorkspaceSizes(NamedTuple):
    """Bytes of device memory a decode needs: the plan (per decode step) and the scratch."""

    plan_bytes: int
    scratch_bytes: int


class Workspace(NamedTuple):
    """Caller-owned decode workspace: `plan` (filled by *_plan, read by every layer's decode)
    and `scratch`. Either may be None when the backend needs none (the CPU)."""

    plan: Any
    scratch: Any


class Support(NamedTuple):
    """Whether a request can run (truthy when it can), on which backend, and why not."""

    ok: bool
    backend: Optional[str]
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _is_compiling() -> bool:
    return False


_ops: Any = None  # sparse_mla.ops once imported; the torch.compile path goes through it


def _backend(backend: Optional[str]) -> str:
    return "auto" if backend is None else backend


def _explicit_stream(like: Any, stream: Any) -> Optional[int]:
    """The cudaStream_t of an explicit `stream=`; None when the call runs on the current stream.
    What a call allocates is allocated on the stream that writes it (_arrays.empty)."""
    return None if stream is None else _arrays.stream_for(like, stream)


def _first(parts: Any) -> Any:
    """The first array of a sequence of parts, else the array itself."""
    if not isinstance(parts, (list, tuple)):
        return parts
    if not parts:
        raise ValueError("out_parts: an empty sequence, expected at least one part")
    return parts[0]


def _array_shape(x: Any, name: str, ndim: int) -> Tuple[int, ...]:
    """Shape of `x`, which sizes the outputs this layer allocates: checked here so that a wrong
    one is reported by name before the library sees the call (it checks everything else)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if len(shape) != ndim:
        raise ValueError(f"{name}: rank {len(shape)} (shape {list(shape)}), expected {ndim}")
    return tuple(int(s) for s in shape)


def _output_dtype(x: Any, name: str, allowed: Tuple[str, ...]) -> str:
    """The dtype of array `x`, which an output this layer allocates takes; one the library cannot
    write is reported by the argument's name."""
    dtype = _arrays.dtype_name(x)
    if dtype not in allowed:
        raise TypeError(f"{name}: dtype {dtype}, expected {' or '.join(allowed)}")
    return dtype


def _dtype_option(value: Any, name: str, allowed: Tuple[str, ...]) -> str:
    """A dtype option given by name or as a torch / numpy dtype, as its name."""
    text = value if isinstance(value, str) else str(value).replace("torch.", "")
    if text not in allowed:
        raise ValueError(f"{name}: {value!r}, expected " + " or ".join(f"'{a}'" for a in allowed)
                         + " (or the torch / numpy dtype)")
    return text


def _allocator(like: Any, stream: Optional[int] = None):
    return lambda nbytes: _arrays.empty(like, (nbytes,), "uint8", stream)


def available_backends() -> List[str]:
    """Backends compiled in and usable here, e.g. ['cuda', 'cpu'] ('cpu' is always there)."""
    return list(_ext.available_backends())


# ---------------------------------------------------------------------------- sparse decode


def _sparse_inputs(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                   extra_topk_length, attn_sink, softmax_scale):
    return dict(_arrays.natives(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                                extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                                extra_topk_length=extra_topk_length, attn_sink=attn_sink),
                softmax_scale=softmax_scale)


def _decode_outputs(q, out, lse, out_dtype: str, sparse_lse_layout: bool,
                    stream: Optional[int]):
    b, s_q, h_q = _array_shape(q, "q", 4)[:3]
    if out is None:
        out = _arrays.empty(q, (b, s_q, h_q, D_V), out_dtype, stream)
    if lse is None:
        if sparse_lse_layout:
            lse = _arrays.lse_like(q, b, s_q, h_q, stream)
        else:
            lse = _arrays.empty(q, (b, h_q, s_q), "float32", stream)
    return out, lse


def _workspace_args(workspace: Optional[Workspace]):
    if workspace is None:
        return None, None
    return workspace.plan, workspace.scratch


def sparse_decode(q, k_cache, indices, *, topk_length=None, extra_k_cache=None,
                  extra_indices=None, extra_topk_length=None, attn_sink=None,
                  softmax_scale: Optional[float] = None, out=None, lse=None,
                  workspace: Optional[Workspace] = None, backend: Optional[str] = None,
                  stream: Any = None):
    """Sparse MLA decode (spec section 3). Returns ``(out, lse)``.

    q ``[b, s_q, h_q, d_qk]`` bf16; k_cache MODEL1/V32 pages; indices ``[b, s_q, topk]`` int32
    slots (-1 = none); optional topk_length ``[b]``, an extra cache with extra_indices
    ``[b, s_q, extra_topk]`` and extra_topk_length ``[b]``, attn_sink ``[h_q]`` float32,
    softmax_scale (default d_qk**-0.5). out ``[b, s_q, h_q, 512]`` bf16 and lse ``[b, h_q, s_q]``
    float32 (natural log, sink excluded; by default a view of a contiguous [b, s_q, h_q] buffer)
    are written in place when given. With a `workspace` from :func:`sparse_decode_plan` the call
    only runs; without one it sizes, allocates and plans first.
    """
    if _is_compiling():
        return _ops.sparse_decode(q, k_cache, indices, topk_length=topk_length,
                                  extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                                  extra_topk_length=extra_topk_length, attn_sink=attn_sink,
                                  softmax_scale=softmax_scale, out=out, lse=lse,
                                  workspace=workspace, backend=backend)
    on = _explicit_stream(q, stream)
    out, lse = _decode_outputs(q, out, lse, "bfloat16", True, on)
    plan, scratch = _workspace_args(workspace)
    _ext.sparse_decode(**_sparse_inputs(q, k_cache, indices, topk_length, extra_k_cache,
                                        extra_indices, extra_topk_length, attn_sink,
                                        softmax_scale),
                       **_arrays.natives(out=out, lse=lse, plan=plan, scratch=scratch),
                       allocate=None if workspace is not None else _allocator(q, on),
                       backend=_backend(backend), stream=_arrays.stream_for(q, stream))
    return _arrays.finish(q, out), _arrays.finish(q, lse)


def sparse_decode_workspace_size(q, k_cache, indices, *, topk_length=None, extra_k_cache=None,
                                 extra_indices=None, extra_topk_length=None, attn_sink=None,
                                 softmax_scale: Optional[float] = None,
                                 backend: Optional[str] = None) -> WorkspaceSizes:
    """Bytes of plan and scratch a sparse decode of these shapes needs (validates the request)."""
    sizes = _ext.sparse_decode_workspace_size(
        **_sparse_inputs(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                         extra_topk_length, attn_sink, softmax_scale),
        backend=_backend(backend))
    return WorkspaceSizes(*sizes)


def sparse_decode_plan(q, k_cache, indices, *, topk_length=None, extra_k_cache=None,
                       extra_indices=None, extra_topk_length=None, attn_sink=None,
                       softmax_scale: Optional[float] = None,
                       workspace: Optional[Workspace] = None, backend: Optional[str] = None,
                       stream: Any = None) -> Workspace:
    """Plans a sparse decode into `workspace` (allocated on q's device when None) and returns it.

    The plan depends only on shapes and on topk_length / extra_topk_length, so plan once per
    decode step and pass the workspace to every layer's :func:`sparse_decode`. Planning runs on
    the device without a host sync, so it can be captured in a CUDA graph.
    """
    inputs = _sparse_inputs(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                            extra_topk_length, attn_sink, softmax_scale)
    if workspace is None:
        sizes = _ext.sparse_decode_workspace_size(**inputs, backend=_backend(backend))
        workspace = _new_workspace(q, WorkspaceSizes(*sizes), _explicit_stream(q, stream))
    _ext.sparse_decode_plan(**inputs,
                            **_arrays.natives(plan=workspace.plan, scratch=workspace.scratch),
                            backend=_backend(backend), stream=_arrays.stream_for(q, stream))
    return workspace


def sparse_decode_supported(q, k_cache, indices, *, topk_length=None, extra_k_cache=None,
                            extra_indices=None, extra_topk_length=None, attn_sink=None,
                            softmax_scale: Optional[float] = None,
                            backend: Optional[str] = None) -> Support:
    """Whether this sparse decode can run, on which backend, and if not, why."""
    ok, chosen, reason = _ext.sparse_decode_supported(
        **_sparse_inputs(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                         extra_topk_length, attn_sink, softmax_scale),
        backend=_backend(backend))
    return Support(ok, chosen or None, reason)


def _new_workspace(like, sizes: WorkspaceSizes, stream: Optional[int]) -> Workspace:
    if sizes.plan_bytes == 0 and sizes.scratch_bytes == 0:
        return Workspace(None, None)
    return Workspace(_arrays.empty(like, (sizes.plan_bytes,), "uint8", stream),
                     _arrays.empty(like, (sizes.scratch_bytes,), "uint8", stream))


# ----------------------------------------------------------------------------- dense decode


def _dense_inputs(q, k_cache, block_table, cache_seqlens, causal, softmax_scale):
    return dict(_arrays.natives(q=q, k_cache=k_cache, block_table=block_table,
                                cache_seqlens=cache_seqlens),
                causal=bool(causal), softmax_scale=softmax_scale)


def dense_decode(q, k_cache, block_table, cache_seqlens, *, causal: bool = False,
                 softmax_scale: Optional[float] = None, out=None, lse=None,
                 workspace: Optional[Workspace] = None, backend: Optional[str] = None,
                 stream: Any = None):
    """Dense MLA decode through a block table (spec section 4). Returns ``(out, lse)``.

    q ``[b, s_q, h_q, d_qk]`` (bf16; fp16 with an fp16 cache); k_cache bf16/fp16
    ``[num_pages, page_size, h_kv, 576]`` or MODEL1/V32 pages; block_table ``[b, max_pages]`` and
    cache_seqlens ``[b]`` int32. out ``[b, s_q, h_q, 512]`` in q's dtype, lse ``[b, h_q, s_q]``
    float32 (contiguous by default).
    """
    if _is_compiling():
        return _ops.dense_decode(q, k_cache, block_table, cache_seqlens, causal=causal,
                                 softmax_scale=softmax_scale, out=out, lse=lse,
                                 workspace=workspace, backend=backend)
    on = _explicit_stream(q, stream)
    out_dtype = _output_dtype(q, "q", ("bfloat16", "float16"))
    out, lse = _decode_outputs(q, out, lse, out_dtype, False, on)
    plan, scratch = _workspace_args(workspace)
    _ext.dense_decode(**_dense_inputs(q, k_cache, block_table, cache_seqlens, causal,
                                      softmax_scale),
                      **_arrays.natives(out=out, lse=lse, plan=plan, scratch=scratch),
                      allocate=None if workspace is not None else _allocator(q, on),
                      backend=_backend(backend), stream=_arrays.stream_for(q, stream))
    return _arrays.finish(q, out), _arrays.finish(q, lse)


def dense_decode_workspace_size(q, k_cache, block_table, cache_seqlens, *, causal: bool = False,
                                softmax_scale: Optional[float] = None,
                                backend: Optional[str] = None) -> WorkspaceSizes:
    """Bytes of plan and scratch a dense decode of these shapes needs (validates the request)."""
    sizes = _ext.dense_decode_workspace_size(
        **_dense_inputs(q, k_cache, block_table, cache_seqlens, causal, softmax_scale),
        backend=_backend(backend))
    return WorkspaceSizes(*sizes)


def dense_decode_plan(q, k_cache, block_table, cache_seqlens, *, causal: bool = False,
                      softmax_scale: Optional[float] = None,
                      workspace: Optional[Workspace] = None, backend: Optional[str] = None,
                      stream: Any = None) -> Workspace:
    """Plans a dense decode (depends on shapes and cache_seqlens) into `workspace`, allocated on
    q's device when None, and returns it."""
    inputs = _dense_inputs(q, k_cache, block_table, cache_seqlens, causal, softmax_scale)
    if workspace is None:
        sizes = _ext.dense_decode_workspace_size(**inputs, backend=_backend(backend))
        workspace = _new_workspace(q, WorkspaceSizes(*sizes), _explicit_stream(q, stream))
    _ext.dense_decode_plan(**inputs,
                           **_arrays.natives(plan=workspace.plan, scratch=workspace.scratch),
                           backend=_backend(backend), stream=_arrays.stream_for(q, stream))
    return workspace


def dense_decode_supported(q, k_cache, block_table, cache_seqlens, *, causal: bool = False,
                           softmax_scale: Optional[float] = None,
                           backend: Optional[str] = None) -> Support:
    """Whether this dense decode can run, on which backend, and if not, why."""
    ok, chosen, reason = _ext.dense_decode_supported(
        **_dense_inputs(q, k_cache, block_table, cache_seqlens, causal, softmax_scale),
        backend=_backend(backend))
    return Support(ok, chosen or None, reason)


def is_supported(op: str, *args, **kwargs) -> Support:
    """``is_supported("sparse_decode" | "dense_decode", <that function's arguments>)``."""
    queries = {"sparse_decode": sparse_decode_supported, "dense_decode": dense_decode_supported}
    if op not in queries:
        raise ValueError(f"op: '{op}', expected one of {', '.join(sorted(queries))}")
    return queries[op](*args, **kwargs)


# ------------------------------------------------------------------------- merge, KV tools


def merge_attention(out_parts: Union[Any, Sequence[Any]], lse_parts: Union[Any, Sequence[Any]],
                    *, attn_sink=None, out=None, lse=None, out_dtype: Any = None,
                    backend: Optional[str] = None, stream: Any = None):
    """Merges partial attention results of disjoint key sets. Returns ``(out, lse)``.

    out_parts ``[n, b, s_q, h_q, d_v]`` float32 or bf16 (or a sequence of n ``[b, s_q, h_q, d_v]``
    arrays), lse_parts ``[n, b, s_q, h_q]`` float32 natural-log (or a sequence). A part with lse
    +-inf is empty. The sink, if given, is applied once to the merged result. out
    ``[b, s_q, h_q, d_v]`` in `out_dtype` ('float32' or 'bfloat16', or the torch / numpy dtype;
    default: the dtype of out_parts), lse ``[b, h_q, s_q]``.
    """
    on = _explicit_stream(_first(out_parts), stream)
    if isinstance(out_parts, (list, tuple)):
        out_parts = _arrays.stack(out_parts, "out_parts", on)
    if isinstance(lse_parts, (list, tuple)):
        lse_parts = _arrays.stack(lse_parts, "lse_parts", on)
    if _is_compiling():
        return _ops.merge_attention(out_parts, lse_parts, attn_sink=attn_sink, out=out, lse=lse,
                                    out_dtype=out_dtype, backend=backend)
    _, b, s_q, h_q, d_v = _array_shape(out_parts, "out_parts", 5)
    if out is None:
        dtype = (_dtype_option(out_dtype, "out_dtype", ("float32", "bfloat16")) if out_dtype
                 else _output_dtype(out_parts, "out_parts", ("float32", "bfloat16")))
        out = _arrays.empty(out_parts, (b, s_q, h_q, d_v), dtype, on)
    if lse is None:
        lse = _arrays.lse_like(out_parts, b, s_q, h_q, on)
    _ext.merge_attention(_arrays.native(out_parts, "out_parts"),
                         _arrays.native(lse_parts, "lse_parts"),
                         **_arrays.natives(attn_sink=attn_sink, out=out, lse=lse),
                         backend=_backend(backend),
                         stream=_arrays.stream_for(out_parts, stream))
    return _arrays.finish(out_parts, out), _arrays.finish(out_parts, lse)


def quantize_store(src, slots, k_cache, *, backend: Optional[str] = None, stream: Any = None):
    """Quantizes rows of src ``[n, d_qk]`` (bf16 or float32; 512 for MODEL1, 576 for V32) with
    the engines' recipe and stores them into `slots` ``[n]`` int32 of the FP8 cache (in place;
    slot -1 skips the row). Returns k_cache."""
    if _is_compiling():
        _ops.quantize_store(src, slots, k_cache, backend=backend)
        return k_cache
    _ext.quantize_store(_arrays.native(src, "src"), _arrays.native(slots, "slots"),
                        _arrays.native(k_cache, "k_cache"),
                        backend=_backend(backend), stream=_arrays.stream_for(src, stream))
    return k_cache


def _cache_d_qk(k_cache) -> int:
    last = _arrays.shape_of(k_cache)[-1]
    if last not in _D_QK_OF_LAST_DIM:
        raise ValueError(f"k_cache: last dim {last}, expected 584 (MODEL1), 656 (V32) or 576 "
                         "(bf16/fp16)")
    return _D_QK_OF_LAST_DIM[last]


def dequantize(k_cache, slots, *, out=None, dtype: Any = "float32",
               backend: Optional[str] = None, stream: Any = None):
    """Reads `slots` ``[n]`` of a cache back as ``[n, d_qk]`` rows (FP8 dequantized exactly; head
    0 of dense caches; slot -1 gives zeros), in `dtype` 'float32' or 'bfloat16' (or the torch /
    numpy dtype)."""
    if _is_compiling():
        return _ops.dequantize(k_cache, slots, out=out, dtype=dtype, backend=backend)
    if out is None:
        n = _array_shape(slots, "slots", 1)[0]
        dtype = _dtype_option(dtype, "dtype", ("float32", "bfloat16"))
        out = _arrays.empty(k_cache, (n, _cache_d_qk(k_cache)), dtype,
                            _explicit_stream(k_cache, stream))
    _ext.dequantize(_arrays.native(k_cache, "k_cache"), _arrays.native(slots, "slots"),
                    _arrays.native(out, "out"),
                    backend=_backend(backend), stream=_arrays.stream_for(k_cache, stream))
    return _arrays.finish(k_cache, out)


def repack_pages(src, dst, src_block_table, dst_block_table, seqlens, *,
                 backend: Optional[str] = None, stream: Any = None):
    """Copies each request's first ``seqlens[i]`` tokens from its `src` pages to its `dst` pages
    (same format, any page sizes and strides; in place). Returns dst."""
    if _is_compiling():
        _ops.repack_pages(src, dst, src_block_table, dst_block_table, seqlens, backend=backend)
        return dst
    n = _arrays.native
    _ext.repack_pages(n(src, "src"), n(dst, "dst"), n(src_block_table, "src_block_table"),
                      n(dst_block_table, "dst_block_table"), n(seqlens, "seqlens"),
                      backend=_backend(backend), stream=_arrays.stream_for(src, stream))
    return dst


# torch integration: register the torch.library ops when torch is already loaded (importing
# sparse_mla.ops later registers them too).
if _arrays.torch_loaded():
    import importlib

    importlib.import_module(".ops", __name__)  # sets _ops and _is_compiling

