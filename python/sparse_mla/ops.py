"""torch.library registration of the sparse-mla operations, so torch.compile traces them without
graph breaks (schemas carry the mutation annotations; fake impls give output metadata).

Importing this module registers ``torch.ops.sparse_mla.*``; ``import sparse_mla`` does it
automatically when torch is already imported. Inside ``torch.compile`` the functions of
``sparse_mla`` route here by themselves; outside it they call the extension directly (the fast
path). Decode ops called without a workspace plan inside the call.
"""

from __future__ import annotations

from typing import Optional

import torch

import sparse_mla as _sm

from . import _arrays

_LIB = "sparse_mla"

_SPARSE_IN = ("Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length=None, "
              "Tensor? extra_k_cache=None, Tensor? extra_indices=None, "
              "Tensor? extra_topk_length=None, Tensor? attn_sink=None, float? softmax_scale=None")
_DENSE_IN = ("Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, "
             "bool causal=False, float? softmax_scale=None")
_WS = "Tensor? plan=None, Tensor(c!)? scratch=None"

_SCHEMAS = {
    # Functional forms: allocate out/lse.
    "sparse_decode": f"({_SPARSE_IN}, {_WS}, str backend='auto') -> (Tensor, Tensor)",
    "dense_decode": f"({_DENSE_IN}, {_WS}, str backend='auto') -> (Tensor, Tensor)",
    # Out forms: write caller-provided out/lse.
    "sparse_decode_out": (f"({_SPARSE_IN}, *, Tensor(a!) out, Tensor(b!) lse, {_WS}, "
                          "str backend='auto') -> ()"),
    "dense_decode_out": (f"({_DENSE_IN}, *, Tensor(a!) out, Tensor(b!) lse, {_WS}, "
                         "str backend='auto') -> ()"),
    "sparse_decode_plan": (f"({_SPARSE_IN}, *, Tensor(a!) plan, Tensor(b!) scratch, "
                           "str backend='auto') -> ()"),
    "dense_decode_plan": (f"({_DENSE_IN}, *, Tensor(a!) plan, Tensor(b!) scratch, "
                          "str backend='auto') -> ()"),
    "merge_attention": ("(Tensor out_parts, Tensor lse_parts, Tensor? attn_sink=None, "
                        "ScalarType? out_dtype=None, str backend='auto') -> (Tensor, Tensor)"),
    "merge_attention_out": ("(Tensor out_parts, Tensor lse_parts, Tensor? attn_sink=None, *, "
                            "Tensor(a!) out, Tensor(b!) lse, str backend='auto') -> ()"),
    "quantize_store": ("(Tensor src, Tensor slots, Tensor(a!) k_cache, str backend='auto') "
                       "-> ()"),
    "dequantize": ("(Tensor k_cache, Tensor slots, ScalarType? dtype=None, str backend='auto') "
                   "-> Tensor"),
    "repack_pages": ("(Tensor src, Tensor(a!) dst, Tensor src_block_table, "
                     "Tensor dst_block_table, Tensor seqlens, str backend='auto') -> ()"),
}

_DEVICES = ("cpu", "cuda")


def _define_all() -> None:
    existing = set(dir(getattr(torch.ops, _LIB)))
    for name, schema in _SCHEMAS.items():
        if name not in existing:
            torch.library.define(f"{_LIB}::{name}", schema)


_define_all()


def _ws(plan, scratch) -> Optional[_sm.Workspace]:
    if plan is None and scratch is None:
        return None
    return _sm.Workspace(plan, scratch)


def _sparse_lse(q: torch.Tensor) -> torch.Tensor:
    b, s_q, h_q = q.shape[:3]
    return torch.empty_strided((b, h_q, s_q), (s_q * h_q, 1, h_q), dtype=torch.float32,
                               device=q.device)


def _decode_out(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, s_q, h_q = q.shape[:3]
    return q.new_empty((b, s_q, h_q, _sm.D_V), dtype=dtype)


def _dense_lse(q: torch.Tensor) -> torch.Tensor:
    b, s_q, h_q = q.shape[:3]
    return q.new_empty((b, h_q, s_q), dtype=torch.float32)


# ---- sparse decode ----

def _sparse_kwargs(topk_length, extra_k_cache, extra_indices, extra_topk_length, attn_sink,
                   softmax_scale):
    return dict(topk_length=topk_length, extra_k_cache=extra_k_cache,
                extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                attn_sink=attn_sink, softmax_scale=softmax_scale)


@torch.library.impl(f"{_LIB}::sparse_decode", _DEVICES)
def _sparse_decode_impl(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                        extra_indices=None, extra_topk_length=None, attn_sink=None,
                        softmax_scale=None, plan=None, scratch=None, backend="auto"):
    out, lse = _decode_out(q, torch.bfloat16), _sparse_lse(q)
    _eager_sparse(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                  extra_topk_length, attn_sink, softmax_scale, out, lse, plan, scratch, backend)
    return out, lse


@torch.library.register_fake(f"{_LIB}::sparse_decode")
def _sparse_decode_fake(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                        extra_indices=None, extra_topk_length=None, attn_sink=None,
                        softmax_scale=None, plan=None, scratch=None, backend="auto"):
    return _decode_out(q, torch.bfloat16), _sparse_lse(q)


@torch.library.impl(f"{_LIB}::sparse_decode_out", _DEVICES)
def _sparse_decode_out_impl(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                            extra_indices=None, extra_topk_length=None, attn_sink=None,
                            softmax_scale=None, *, out, lse, plan=None, scratch=None,
                            backend="auto"):
    _eager_sparse(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                  extra_topk_length, attn_sink, softmax_scale, out, lse, plan, scratch, backend)


@torch.library.register_fake(f"{_LIB}::sparse_decode_out")
def _sparse_decode_out_fake(*args, **kwargs):
    return None


def _eager_sparse(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                  extra_topk_length, attn_sink, softmax_scale, out, lse, plan, scratch, backend):
    _sm._ext.sparse_decode(
        **_arrays.natives(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                          extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                          extra_topk_length=extra_topk_length, attn_sink=attn_sink, out=out,
                          lse=lse, plan=plan, scratch=scratch),
        softmax_scale=softmax_scale,
        allocate=None if (plan is not None or scratch is not None) else _sm._allocator(q),
        backend=backend, stream=_arrays.stream_for(q, None))


@torch.library.impl(f"{_LIB}::sparse_decode_plan", _DEVICES)
def _sparse_decode_plan_impl(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                             extra_indices=None, extra_topk_length=None, attn_sink=None,
                             softmax_scale=None, *, plan, scratch, backend="auto"):
    _sm._ext.sparse_decode_plan(
        q, k_cache, indices, **_sparse_kwargs(topk_length, extra_k_cache, extra_indices,
                                              extra_topk_length, attn_sink, softmax_scale),
        plan=plan, scratch=scratch, backend=backend, stream=_arrays.stream_for(q, None))


@torch.library.register_fake(f"{_LIB}::sparse_decode_plan")
def _sparse_decode_plan_fake(*args, **kwargs):
    return None


# ---- dense decode ----

def _eager_dense(q, k_cache, block_table, cache_seqlens, causal, softmax_scale, out, lse, plan,
                 scratch, backend):
    _sm._ext.dense_decode(
        **_arrays.natives(q=q, k_cache=k_cache, block_table=block_table,
                          cache_seqlens=cache_seqlens, out=out, lse=lse, plan=plan,
                          scratch=scratch),
        causal=causal, softmax_scale=softmax_scale,
        allocate=None if (plan is not None or scratch is not None) else _sm._allocator(q),
        backend=backend, stream=_arrays.stream_for(q, None))


@torch.library.impl(f"{_LIB}::dense_decode", _DEVICES)
def _dense_decode_impl(q, k_cache, block_table, cache_seqlens, causal=False, softmax_scale=None,
                       plan=None, scratch=None, backend="auto"):
    out, lse = _decode_out(q, q.dtype), _dense_lse(q)
    _eager_dense(q, k_cache, block_table, cache_seqlens, causal, softmax_scale, out, lse, plan,
                 scratch, backend)
    return out, lse


@torch.library.register_fake(f"{_LIB}::dense_decode")
def _dense_decode_fake(q, k_cache, block_table, cache_seqlens, causal=False, softmax_scale=None,
                       plan=None, scratch=None, backend="auto"):
    return _decode_out(q, q.dtype), _dense_lse(q)


@torch.library.impl(f"{_LIB}::dense_decode_out", _DEVICES)
def _dense_decode_out_impl(q, k_cache, block_table, cache_seqlens, causal=False,
                           softmax_scale=None, *, out, lse, plan=None, scratch=None,
                           backend="auto"):
    _eager_dense(q, k_cache, block_table, cache_seqlens, causal, softmax_scale, out, lse, plan,
                 scratch, backend)


@torch.library.register_fake(f"{_LIB}::dense_decode_out")
def _dense_decode_out_fake(*args, **kwargs):
    return None


@torch.library.impl(f"{_LIB}::dense_decode_plan", _DEVICES)
def _dense_decode_plan_impl(q, k_cache, block_table, cache_seqlens, causal=False,
                            softmax_scale=None, *, plan, scratch, backend="auto"):
    _sm._ext.dense_decode_plan(q, k_cache, block_table, cache_seqlens, causal=causal,
                               softmax_scale=softmax_scale, plan=plan, scratch=scratch,
                               backend=backend, stream=_arrays.stream_for(q, None))


@torch.library.register_fake(f"{_LIB}::dense_decode_plan")
def _dense_decode_plan_fake(*args, **kwargs):
    return None


# ---- merge and KV tools ----

def _merge_outputs(out_parts, out_dtype):
    _, b, s_q, h_q, d_v = out_parts.shape
    out = out_parts.new_empty((b, s_q, h_q, d_v), dtype=out_dtype or out_parts.dtype)
    lse = torch.empty_strided((b, h_q, s_q), (s_q * h_q, 1, h_q), dtype=torch.float32,
                              device=out_parts.device)
    return out, lse


@torch.library.impl(f"{_LIB}::merge_attention", _DEVICES)
def _merge_impl(out_parts, lse_parts, attn_sink=None, out_dtype=None, backend="auto"):
    out, lse = _merge_outputs(out_parts, out_dtype)
    _sm._ext.merge_attention(out_parts, lse_parts, attn_sink=attn_sink, out=out, lse=lse,
                             backend=backend, stream=_arrays.stream_for(out_parts, None))
    return out, lse


@torch.library.register_fake(f"{_LIB}::merge_attention")
def _merge_fake(out_parts, lse_parts, attn_sink=None, out_dtype=None, backend="auto"):
    return _merge_outputs(out_parts, out_dtype)


@torch.library.impl(f"{_LIB}::merge_attention_out", _DEVICES)
def _merge_out_impl(out_parts, lse_parts, attn_sink=None, *, out, lse, backend="auto"):
    _sm._ext.merge_attention(out_parts, lse_parts, attn_sink=attn_sink, out=out, lse=lse,
                             backend=backend, stream=_arrays.stream_for(out_parts, None))


@torch.library.register_fake(f"{_LIB}::merge_attention_out")
def _merge_out_fake(*args, **kwargs):
    return None


@torch.library.impl(f"{_LIB}::quantize_store", _DEVICES)
def _quantize_store_impl(src, slots, k_cache, backend="auto"):
    _sm._ext.quantize_store(src, slots, k_cache, backend=backend,
                            stream=_arrays.stream_for(src, None))


@torch.library.register_fake(f"{_LIB}::quantize_store")
def _quantize_store_fake(src, slots, k_cache, backend="auto"):
    return None


def _dequantize_out(k_cache, slots, dtype):
    return k_cache.new_empty((slots.shape[0], _sm._cache_d_qk(k_cache)),
                             dtype=dtype or torch.float32)


@torch.library.impl(f"{_LIB}::dequantize", _DEVICES)
def _dequantize_impl(k_cache, slots, dtype=None, backend="auto"):
    out = _dequantize_out(k_cache, slots, dtype)
    _sm._ext.dequantize(k_cache, slots, out, backend=backend,
                        stream=_arrays.stream_for(k_cache, None))
    return out


@torch.library.register_fake(f"{_LIB}::dequantize")
def _dequantize_fake(k_cache, slots, dtype=None, backend="auto"):
    return _dequantize_out(k_cache, slots, dtype)


@torch.library.impl(f"{_LIB}::repack_pages", _DEVICES)
def _repack_impl(src, dst, src_block_table, dst_block_table, seqlens, backend="auto"):
    _sm._ext.repack_pages(src, dst, src_block_table, dst_block_table, seqlens, backend=backend,
                          stream=_arrays.stream_for(src, None))


@torch.library.register_fake(f"{_LIB}::repack_pages")
def _repack_fake(src, dst, src_block_table, dst_block_table, seqlens, backend="auto"):
    return None


# ---- the functions sparse_mla routes to under torch.compile (same signatures) ----

_OPS = torch.ops.sparse_mla


def sparse_decode(q, k_cache, indices, *, topk_length=None, extra_k_cache=None,
                  extra_indices=None, extra_topk_length=None, attn_sink=None,
                  softmax_scale=None, out=None, lse=None, workspace=None, backend=None):
    plan, scratch = (None, None) if workspace is None else tuple(workspace)
    backend = backend or "auto"
    if out is None and lse is None:
        return _OPS.sparse_decode(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                                  extra_topk_length, attn_sink, softmax_scale, plan, scratch,
                                  backend)
    out = _decode_out(q, torch.bfloat16) if out is None else out
    lse = _sparse_lse(q) if lse is None else lse
    _OPS.sparse_decode_out(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                           extra_topk_length, attn_sink, softmax_scale, out=out, lse=lse,
                           plan=plan, scratch=scratch, backend=backend)
    return out, lse


def dense_decode(q, k_cache, block_table, cache_seqlens, *, causal=False, softmax_scale=None,
                 out=None, lse=None, workspace=None, backend=None):
    plan, scratch = (None, None) if workspace is None else tuple(workspace)
    backend = backend or "auto"
    if out is None and lse is None:
        return _OPS.dense_decode(q, k_cache, block_table, cache_seqlens, causal, softmax_scale,
                                 plan, scratch, backend)
    out = _decode_out(q, q.dtype) if out is None else out
    lse = _dense_lse(q) if lse is None else lse
    _OPS.dense_decode_out(q, k_cache, block_table, cache_seqlens, causal, softmax_scale, out=out,
                          lse=lse, plan=plan, scratch=scratch, backend=backend)
    return out, lse


def merge_attention(out_parts, lse_parts, *, attn_sink=None, out=None, lse=None, out_dtype=None,
                    backend=None):
    if isinstance(out_dtype, str):
        out_dtype = getattr(torch, out_dtype)
    backend = backend or "auto"
    if out is None and lse is None:
        return _OPS.merge_attention(out_parts, lse_parts, attn_sink, out_dtype, backend)
    default_out, default_lse = _merge_outputs(out_parts, out_dtype)
    out = default_out if out is None else out
    lse = default_lse if lse is None else lse
    _OPS.merge_attention_out(out_parts, lse_parts, attn_sink, out=out, lse=lse, backend=backend)
    return out, lse


def quantize_store(src, slots, k_cache, *, backend=None):
    _OPS.quantize_store(src, slots, k_cache, backend or "auto")


def dequantize(k_cache, slots, *, out=None, dtype="float32", backend=None):
    result = _OPS.dequantize(k_cache, slots, getattr(torch, dtype) if isinstance(dtype, str)
                             else dtype, backend or "auto")
    if out is None:
        return result
    out.copy_(result)
    return out


def repack_pages(src, dst, src_block_table, dst_block_table, seqlens, *, backend=None):
    _OPS.repack_pages(src, dst, src_block_table, dst_block_table, seqlens, backend or "auto")


def _register_with_package() -> None:
    import sys

    _sm._ops = sys.modules[__name__]
    _sm._is_compiling = torch.compiler.is_compiling


_register_with_package()

__all__ = ["sparse_decode", "dense_decode", "merge_attention", "quantize_store", "dequantize",
           "repack_pages"]
