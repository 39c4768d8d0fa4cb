"""torch helpers shared by the torch and GPU tests: numpy test data as torch tensors."""

import numpy as np
import torch

from reference import (MODEL1, V32, D_QK, filled_cache, random_indices, random_q,
                       sparse_decode_ref)


def t_bf16(bits: np.ndarray, device="cpu") -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(
        device)


def t_cache(cache, device="cpu") -> torch.Tensor:
    """The cache as an engine holds it: a [num_pages, page_size, h_kv, bytes] view of padded
    pages (page_stride = stride(0))."""
    if cache.fmt in (MODEL1, V32):
        flat = torch.from_numpy(cache.buf).to(device)
        return flat.as_strided(tuple(cache.view.shape), (cache.page_stride, cache.view.shape[3],
                                                         cache.view.shape[3], 1))
    return t_bf16(cache.buf.view(np.uint16), device)


def t(a: np.ndarray, device="cpu") -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def sparse_problem(seed, fmt=MODEL1, b=2, s_q=2, h_q=8, topk=50, ps=61, pages=3, extra=None,
                   lengths=True, sink=True):
    rng = np.random.default_rng(seed)
    cache, filled = filled_cache(rng, fmt, pages, ps)
    p = dict(q=random_q(rng, (b, s_q, h_q, D_QK[fmt])), cache=cache,
             indices=random_indices(rng, filled, (b, s_q, topk), num_slots=cache.num_slots))
    if lengths:
        p["topk_length"] = rng.integers(0, topk + 1, b).astype(np.int32)
    if sink:
        p["attn_sink"] = rng.normal(0, 1, h_q).astype(np.float32)
    if extra is not None:
        etopk, eps, epages = extra
        ecache, efilled = filled_cache(rng, fmt, epages, eps)
        p["extra"] = ecache
        p["extra_indices"] = random_indices(rng, efilled, (b, s_q, etopk))
        if lengths:
            p["extra_topk_length"] = rng.integers(0, etopk + 1, b).astype(np.int32)
    return p


def reference_of(p, scale=None):
    return sparse_decode_ref(p["q"], p["cache"], p["indices"],
                             topk_length=p.get("topk_length"), extra=p.get("extra"),
                             extra_indices=p.get("extra_indices"),
                             extra_topk_length=p.get("extra_topk_length"),
                             attn_sink=p.get("attn_sink"), softmax_scale=scale)


def torch_kwargs(p, device="cpu", fp8_dtype=False):
    cache = t_cache(p["cache"], device)
    if fp8_dtype:
        cache = cache.view(torch.float8_e4m3fn)
    kw = dict(q=t_bf16(p["q"], device), k_cache=cache, indices=t(p["indices"], device))
    for name in ("topk_length", "attn_sink", "extra_indices", "extra_topk_length"):
        if name in p:
            kw[name] = t(p[name], device)
    if "extra" in p:
        kw["extra_k_cache"] = t_cache(p["extra"], device)
    return kw
