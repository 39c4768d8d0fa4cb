"""Drop-in for FlashMLA's ``flash_mla`` Python module (its 2026-04 Hopper release, spec section 6).

    import sparse_mla.flash_mla as flash_mla

    sched_meta, _ = flash_mla.get_mla_metadata()
    for layer in layers:
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, k_cache, None, None, 512, sched_meta, is_fp8_kvcache=True, indices=indices, ...)

Same arguments, defaults, output shapes and strides and lse conventions as FlashMLA, and more
shapes: any h_q, any topk, any page size, CPU tensors (CPU backend), every feature for V3.2 pages
as well as MODEL1. FP8 pages may come as float8_e4m3fn, uint8 or int8 tensors, as FlashMLA takes
them. Not taken: dense decode over 512-wide bf16/fp16 caches (FlashMLA's head_size_k 512; the
16-bit dense pages here are 576 wide), and FlashMLA's other functions (flash_attn_varlen_*).
The plan is built on the device by the first call with a fresh ``FlashMLASchedMeta`` (inside a
CUDA graph too) and reused by later calls, which must keep the same configuration (a mismatch
raises :class:`FlashMLAConfigError`).

The older explicit-metadata form (``get_mla_metadata(cache_seqlens, ...)`` returning tensors, as
sgl-kernel's wrapper accepts) works too: those tensors keep FlashMLA's shapes so engines can copy
them into captured buffers; calls given them plan inside every call, which is graph-safe.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any, Optional, Tuple, Union

import torch

import sparse_mla as _sm

from . import _ext
from . import ops as _ops  # noqa: F401  registers torch.ops.sparse_mla, which torch.compile traces

__all__ = ["FlashMLAConfigError", "FlashMLASchedMeta", "flash_mla_sparse_fwd",
           "flash_mla_with_kvcache", "get_mla_metadata"]


class FlashMLAConfigError(ValueError, AssertionError):
    """A FlashMLASchedMeta reused with a different configuration than it was planned for.
    (An AssertionError too, as FlashMLA raises one.)"""


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Scheduler metadata: empty until the first flash_mla_with_kvcache call plans into it."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int

        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]

        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # the plan (uint8 bytes)
    num_splits: Optional[torch.Tensor] = None  # the scratch the decode reuses (uint8 bytes)


def get_mla_metadata(*args, **kwargs) -> Tuple[Any, Any]:
    """``(FlashMLASchedMeta(), None)``; the plan is built by the first flash_mla_with_kvcache call.

    The older form ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k,
    num_heads_q=None, is_fp8_kvcache=False, topk=None)`` (the second argument also by its first
    name, ``num_heads_per_head_k``) with a tensor `cache_seqlens` returns
    ``(tile_scheduler_metadata [num_sm_parts, 8] int32, num_splits [b + 1] int32)`` on its device,
    with FlashMLA's ``num_sm_parts = max(SMs // num_heads_k // ceil(num_q_tokens_per_head_k / 64),
    1)`` (1 on the CPU); pass them to flash_mla_with_kvcache as before (the plan is then rebuilt
    in each call).
    """
    names = ("cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k")
    given = dict(zip(names, args))
    given.update({name: kwargs[name] for name in names if name in kwargs})
    if "num_heads_per_head_k" in kwargs:  # the original FlashMLA's name of the second argument
        given.setdefault("num_q_tokens_per_head_k", kwargs["num_heads_per_head_k"])
    cache_seqlens = given.get("cache_seqlens")
    if cache_seqlens is None:
        return FlashMLASchedMeta(), None
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
        raise ValueError("cache_seqlens: expected a [b] int32 tensor")
    counts = {}
    for name in names[1:]:
        try:
            counts[name] = operator.index(given.get(name))
        except TypeError:
            counts[name] = 0
        if counts[name] < 1:
            raise ValueError(f"{name}: {given.get(name)!r}, expected a positive int with "
                             "cache_seqlens")
    device = cache_seqlens.device
    parts = 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        q_blocks = -(-counts["num_q_tokens_per_head_k"] // 64)
        parts = max(sms // counts["num_heads_k"] // q_blocks, 1)
    tile_scheduler_metadata = torch.zeros((parts, 8), dtype=torch.int32, device=device)
    num_splits = torch.zeros((cache_seqlens.shape[0] + 1,), dtype=torch.int32, device=device)
    return tile_scheduler_metadata, num_splits


def _config_of(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache,
               extra_indices) -> FlashMLASchedMeta.Config:
    return FlashMLASchedMeta.Config(
        b=q.shape[0], s_q=q.shape[1], h_q=q.shape[2], page_block_size=k_cache.shape[1],
        h_k=k_cache.shape[2], causal=causal, is_fp8_kvcache=is_fp8_kvcache,
        topk=None if indices is None else indices.shape[-1],
        extra_page_block_size=None if extra_k_cache is None else extra_k_cache.shape[1],
        extra_topk=None if extra_indices is None else extra_indices.shape[-1])


def _check_config(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config) -> None:
    planned = meta.config
    for field in dataclasses.fields(config):
        want, got = getattr(planned, field.name), getattr(config, field.name)
        if want != got:
            raise FlashMLAConfigError(
                f"tile_scheduler_metadata: planned for {field.name}={want!r}, called with "
                f"{field.name}={got!r}. A FlashMLASchedMeta may only be reused with the same "
                "shapes and settings (and the same cache_seqlens / topk_length / "
                "extra_topk_length values); get a fresh one from get_mla_metadata() for this call.")


def _is_fp8_cache(k_cache: torch.Tensor) -> bool:
    return k_cache.element_size() == 1


def _check_arrays(q, k_cache, indices, extra_k_cache, extra_indices, softmax_scale) -> None:
    """What _config_of reads, checked first so that a wrong argument is named."""
    for name, x, rank in (("q", q, 4), ("k_cache", k_cache, 4), ("indices", indices, 3),
                          ("extra_k_cache", extra_k_cache, 4),
                          ("extra_indices_in_kvcache", extra_indices, 3)):
        if x is None and name not in ("q", "k_cache"):
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {type(x).__name__}, expected a torch.Tensor")
        if x.dim() != rank:
            raise ValueError(f"{name}: rank {x.dim()} (shape {tuple(x.shape)}), expected {rank}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"softmax_scale: {type(softmax_scale).__name__}, expected a float or None")


def _cache_bytes(cache: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """FlashMLA takes FP8 pages as float8_e4m3fn, uint8 or int8 tensors; int8 ones are read as
    the same bytes."""
    return cache.view(torch.uint8) if cache is not None and cache.dtype == torch.int8 else cache


def _check_request(k_cache, head_dim_v, causal, is_fp8_kvcache, block_table, cache_seqlens,
                   indices, attn_sink, extra_k_cache, extra_indices, topk_length,
                   extra_topk_length) -> None:
    if head_dim_v != _sm.D_V:
        raise ValueError(f"head_dim_v: {head_dim_v}, expected 512")
    if bool(is_fp8_kvcache) != _is_fp8_cache(k_cache):
        raise ValueError(f"is_fp8_kvcache: {is_fp8_kvcache}, but k_cache has dtype "
                         f"{k_cache.dtype} ({'FP8 pages' if _is_fp8_cache(k_cache) else 'bf16/fp16'})")
    if indices is not None:
        if causal:
            raise ValueError("causal: True, expected False with indices (sparse decode)")
        if not is_fp8_kvcache:
            raise ValueError("is_fp8_kvcache: False, expected True with indices (sparse decode)")
        return
    extras = dict(attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                  extra_indices_in_kvcache=extra_indices, topk_length=topk_length,
                  extra_topk_length=extra_topk_length)
    given = [name for name, value in extras.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: given without indices; dense decode takes none of "
                         "attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, "
                         "extra_topk_length")
    if block_table is None or cache_seqlens is None:
        raise ValueError("block_table and cache_seqlens: required for dense decode (indices is "
                         "None)")


def _sparse_lse(q: torch.Tensor) -> torch.Tensor:
    b, s_q, h_q = q.shape[:3]
    return torch.empty((b, s_q, h_q), dtype=torch.float32, device=q.device).transpose(1, 2)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Union[FlashMLASchedMeta, torch.Tensor],
    num_splits: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's decode: sparse when `indices` is given, dense through block_table otherwise.

    q ``[b, s_q, h_q, d_qk]``; k_cache ``[num_blocks, page_block_size, h_k, d]`` (its last dim
    and dtype select the format: 584 MODEL1, 656 V3.2 FP8 pages; bf16/fp16 576). Returns out
    ``[b, s_q, h_q, 512]`` (contiguous, q's dtype) and lse ``[b, h_q, s_q]`` float32: for sparse
    decode a view of a contiguous ``[b, s_q, h_q]`` buffer (strides ``(s_q*h_q, 1, h_q)``), for
    dense decode contiguous. With attn_sink, out is scaled by exp(lse) / (exp(lse) +
    exp(attn_sink)); lse excludes the sink.
    """
    if descale_q is not None or descale_k is not None:
        raise NotImplementedError("descale_q/descale_k: FP8 queries are not supported; pass bf16 q")
    _check_arrays(q, k_cache, indices, extra_k_cache, extra_indices_in_kvcache, softmax_scale)
    k_cache, extra_k_cache = _cache_bytes(k_cache), _cache_bytes(extra_k_cache)
    meta = tile_scheduler_metadata
    uses_meta = isinstance(meta, FlashMLASchedMeta)
    if not uses_meta and not isinstance(meta, torch.Tensor):
        raise TypeError("tile_scheduler_metadata: expected a FlashMLASchedMeta from "
                        f"get_mla_metadata(), got {type(meta).__name__}")
    if uses_meta and num_splits is not None:
        raise ValueError("num_splits: must be None with a FlashMLASchedMeta")
    first = uses_meta and not meta.have_initialized
    if uses_meta:
        config = _config_of(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache,
                            extra_indices_in_kvcache)
        if not first:
            _check_config(meta, config)
    # Every call, a reused plan's too: the config leaves out arguments (attn_sink, head_dim_v)
    # that dense decode would otherwise drop or take silently.
    _check_request(k_cache, head_dim_v, causal, is_fp8_kvcache, block_table, cache_seqlens,
                   indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                   extra_topk_length)
    result = _decode(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, indices,
                     attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                     extra_topk_length, meta if uses_meta else None)
    if first:  # only a call that ran binds the meta: a failed first call leaves it fresh
        meta.have_initialized = True
        meta.config = config
    return result


def _decode(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, indices, attn_sink,
            extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
            meta: Optional[FlashMLASchedMeta]) -> Tuple[torch.Tensor, torch.Tensor]:
    sparse = indices is not None
    if _sm._is_compiling() or meta is None:
        # Plans inside the call (graph-safe); under torch.compile this is the traced op.
        if sparse:
            return _sm.sparse_decode(q, k_cache, indices, topk_length=topk_length,
                                     extra_k_cache=extra_k_cache,
                                     extra_indices=extra_indices_in_kvcache,
                                     extra_topk_length=extra_topk_length, attn_sink=attn_sink,
                                     softmax_scale=softmax_scale)
        return _sm.dense_decode(q, k_cache, block_table, cache_seqlens, causal=causal,
                                softmax_scale=softmax_scale)

    b, s_q, h_q = q.shape[:3]
    out = torch.empty((b, s_q, h_q, _sm.D_V), dtype=q.dtype, device=q.device)
    stream = _sm._arrays.stream_for(q, None)
    if sparse:
        lse = _sparse_lse(q)
        inputs = dict(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                      extra_k_cache=extra_k_cache, extra_indices=extra_indices_in_kvcache,
                      extra_topk_length=extra_topk_length, attn_sink=attn_sink,
                      softmax_scale=softmax_scale)
        size, plan, run = (_ext.sparse_decode_workspace_size, _ext.sparse_decode_plan,
                           _ext.sparse_decode)
    else:
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
        inputs = dict(q=q, k_cache=k_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens, causal=bool(causal),
                      softmax_scale=softmax_scale)
        size, plan, run = (_ext.dense_decode_workspace_size, _ext.dense_decode_plan,
                           _ext.dense_decode)
    natives = _sm._arrays.natives
    inputs = natives(**inputs)
    plan_buf, scratch_buf = meta.tile_scheduler_metadata, meta.num_splits
    if plan_buf is None:
        plan_bytes, scratch_bytes = size(**inputs)
        plan_buf = torch.empty(plan_bytes, dtype=torch.uint8, device=q.device)
        scratch_buf = torch.empty(scratch_bytes, dtype=torch.uint8, device=q.device)
        plan(**inputs, **natives(plan=plan_buf, scratch=scratch_buf), stream=stream)
    run(**inputs, **natives(out=out, lse=lse, plan=plan_buf, scratch=scratch_buf), stream=stream)
    meta.tile_scheduler_metadata, meta.num_splits = plan_buf, scratch_buf
    return out, lse


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = 512, attn_sink: Optional[torch.Tensor] = None,
                         topk_length: Optional[torch.Tensor] = None):
    """FlashMLA's sparse prefill over a bf16 kv. Not implemented yet (planned after decode)."""
    raise NotImplementedError(
        "flash_mla_sparse_fwd (sparse prefill over a bf16 kv) is not implemented by sparse-mla "
        "yet; decode (flash_mla_with_kvcache) is")
