"""numpy reference for the Python tests: the cache byte formats (spec section 2) decoded and
encoded independently of the library, fp64 sparse/dense decode and merge (spec sections 3-5),
the spec section 7 comparison, and builders of random test data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import as_strided

MODEL1, V32, BF16, FP16 = "MODEL1", "V32", "BF16", "FP16"
BYTES_PER_TOKEN = {MODEL1: 584, V32: 656}
D_QK = {MODEL1: 512, V32: 576, BF16: 576, FP16: 576}
D_V = 512


# ---------------------------------------------------------------------------- scalar formats

def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8.0) * 2.0 ** (exp - 7))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return sign * mag


E4M3 = _e4m3_table()
_E4M3_POS = E4M3[:127]  # codes 0..126: every finite non-negative value, ascending


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Round to nearest even e4m3 code (inputs finite and within +-448)."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(_E4M3_POS, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_hi, d_lo = _E4M3_POS[hi] - a, a - _E4M3_POS[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi).astype(np.uint8)
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def bf16_bits_to_f64(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Values of x rounded to bf16 (as float64)."""
    return bf16_bits_to_f64(f32_to_bf16_bits(x))


def scale_exponent(amax: np.ndarray) -> np.ndarray:
    """log2 of the recipe's scale: s = max(amax / 448, 1e-4) in fp32, scale = 2^ceil(log2 s)."""
    s = np.maximum(amax.astype(np.float32) / np.float32(448), np.float32(1e-4))
    mant, exp = np.frexp(s.astype(np.float64))  # s = mant * 2^exp, mant in [0.5, 1)
    return np.where(mant == 0.5, exp - 1, exp).astype(np.int64)


# ----------------------------------------------------------------------------- paged caches

@dataclass
class Cache:
    """A paged cache: `buf` holds the bytes ([num_pages, page_stride] uint8 for FP8 formats),
    `view` is what callers pass ([num_pages, page_size, h_kv, 584|656|576])."""

    fmt: str
    num_pages: int
    page_size: int
    page_stride: int  # bytes
    buf: np.ndarray
    view: np.ndarray
    h_kv: int = 1

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


def model1_stride(page_size: int) -> int:
    return -(-page_size * 584 // 576) * 576


def new_cache(fmt: str, num_pages: int, page_size: int, *, extra_stride: int = 0,
              h_kv: int = 1) -> Cache:
    """A cache whose every byte is NaN (0xff): unwritten slots must never leak into results."""
    if fmt in (MODEL1, V32):
        bpt = BYTES_PER_TOKEN[fmt]
        stride = (model1_stride(page_size) if fmt == MODEL1 else -(-page_size * bpt // 16) * 16)
        stride += extra_stride
        buf = np.full((num_pages, stride), 0xFF, np.uint8)
        view = as_strided(buf, shape=(num_pages, page_size, 1, bpt),
                          strides=(stride, bpt, bpt, 1))
        return Cache(fmt, num_pages, page_size, stride, buf, view)
    dtype = np.uint16 if fmt == BF16 else np.float16
    buf = np.full((num_pages, page_size, h_kv, 576), 0xFFFF, np.uint16).view(dtype)
    return Cache(fmt, num_pages, page_size, page_size * h_kv * 576 * 2, buf, buf, h_kv)


def store(cache: Cache, slots: np.ndarray, rows: np.ndarray) -> None:
    """Writes rows [n, d_qk] (float) into slots with the engines' quantization recipe."""
    rows = np.asarray(rows, dtype=np.float32)
    for slot, x in zip(slots.tolist(), rows):
        if slot < 0 or slot >= cache.num_slots:
            continue
        p, t = divmod(slot, cache.page_size)
        page = cache.buf[p]
        if cache.fmt == MODEL1:
            nope = x[:448].reshape(7, 64)
            e = scale_exponent(np.abs(nope).max(axis=1))
            codes = e4m3_encode(nope / (2.0 ** e)[:, None]).reshape(-1)
            page[t * 576:t * 576 + 448] = codes
            page[t * 576 + 448:t * 576 + 576] = f32_to_bf16_bits(x[448:512]).view(np.uint8)
            so = cache.page_size * 576 + t * 8
            page[so:so + 7] = (e + 127).astype(np.uint8)
            page[so + 7] = 0
        elif cache.fmt == V32:
            nope = x[:512].reshape(4, 128)
            e = scale_exponent(np.abs(nope).max(axis=1))
            codes = e4m3_encode(nope / (2.0 ** e)[:, None]).reshape(-1)
            r = t * 656
            page[r:r + 512] = codes
            page[r + 512:r + 528] = (2.0 ** e).astype(np.float32).view(np.uint8)
            page[r + 528:r + 656] = f32_to_bf16_bits(x[512:576]).view(np.uint8)
        else:
            bits = f32_to_bf16_bits(x) if cache.fmt == BF16 else x.astype(np.float16).view(
                np.uint16)
            cache.buf.view(np.uint16)[p, t, :, :] = bits[None, :]


def dequant(cache: Cache, slots: np.ndarray, head: int = 0) -> np.ndarray:
    """Rows [n, d_qk] float64 of the given slots (slots must be valid)."""
    out = np.zeros((len(slots), D_QK[cache.fmt]))
    for i, slot in enumerate(np.asarray(slots).tolist()):
        p, t = divmod(slot, cache.page_size)
        page = cache.buf[p]
        if cache.fmt == MODEL1:
            so = cache.page_size * 576 + t * 8
            scales = 2.0 ** (page[so:so + 7].astype(np.float64) - 127)
            scales = np.where(page[so:so + 7] == 0xFF, np.nan, scales)
            out[i, :448] = E4M3[page[t * 576:t * 576 + 448]] * np.repeat(scales, 64)
            out[i, 448:] = bf16_bits_to_f64(page[t * 576 + 448:t * 576 + 576].view(np.uint16))
        elif cache.fmt == V32:
            r = t * 656
            scales = page[r + 512:r + 528].view(np.float32).astype(np.float64)
            out[i, :512] = E4M3[page[r:r + 512]] * np.repeat(scales, 128)
            out[i, 512:] = bf16_bits_to_f64(page[r + 528:r + 656].view(np.uint16))
        elif cache.fmt == BF16:
            out[i] = bf16_bits_to_f64(cache.buf.view(np.uint16)[p, t, head])
        else:
            out[i] = cache.buf[p, t, head].astype(np.float64)
    return out


def random_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """Cache values ~N(0, 0.1^2) clipped to [-1, 1] (spec section 7)."""
    return np.clip(rng.normal(0.0, 0.1, (n, d)), -1, 1).astype(np.float32)


def random_q(rng: np.random.Generator, shape) -> np.ndarray:
    """q uniform in [-1, 1], as bf16 bit patterns (uint16)."""
    return f32_to_bf16_bits(rng.uniform(-1, 1, shape).astype(np.float32))


def filled_cache(rng, fmt, num_pages, page_size, fill_fraction=0.7, **kw):
    """A NaN cache with a random subset of slots written; returns (cache, filled slots)."""
    cache = new_cache(fmt, num_pages, page_size, **kw)
    n = cache.num_slots
    filled = np.sort(rng.choice(n, size=max(1, int(n * fill_fraction)), replace=False))
    store(cache, filled, random_rows(rng, len(filled), D_QK[fmt]))
    return cache, filled.astype(np.int32)


# --------------------------------------------------------------------------------- decode

def _attend(qv: np.ndarray, K: np.ndarray, scale: float, d_v: int = D_V):
    """qv [h, d_qk], K [n, d_qk] -> out [h, d_v], lse [h] (fp64)."""
    h = qv.shape[0]
    if K.shape[0] == 0:
        return np.zeros((h, d_v)), np.full(h, np.inf)
    logits = scale * (qv @ K.T)
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    s = p.sum(axis=1, keepdims=True)
    return (p / s) @ K[:, :d_v], (np.log(s) + m)[:, 0]


def _apply_sink(out, lse, sink):
    if sink is None:
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        factor = np.where(np.isposinf(lse), 1.0, 1.0 / (1.0 + np.exp(sink - lse)))
    return out * factor[:, None]


def _valid(slots, length, num_slots):
    s = slots[:max(0, min(length, len(slots)))]
    return s[(s >= 0) & (s < num_slots)]


def sparse_decode_ref(q_bits, cache, indices, *, topk_length=None, extra=None,
                      extra_indices=None, extra_topk_length=None, attn_sink=None,
                      softmax_scale=None):
    """q_bits [b, s_q, h_q, d_qk] bf16 bits -> out [b, s_q, h_q, 512], lse [b, h_q, s_q] fp64."""
    q = bf16_bits_to_f64(q_bits)
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale
    out = np.zeros((b, s_q, h_q, D_V))
    lse = np.zeros((b, h_q, s_q))
    for i in range(b):
        for s in range(s_q):
            tl = indices.shape[2] if topk_length is None else int(topk_length[i])
            rows = [dequant(cache, _valid(indices[i, s], tl, cache.num_slots))]
            if extra is not None:
                etl = (extra_indices.shape[2] if extra_topk_length is None
                       else int(extra_topk_length[i]))
                rows.append(dequant(extra, _valid(extra_indices[i, s], etl, extra.num_slots)))
            o, l = _attend(q[i, s], np.concatenate(rows), scale)
            out[i, s] = _apply_sink(o, l, attn_sink)
            lse[i, :, s] = l
    return out, lse


def dense_decode_ref(q_vals, cache, block_table, cache_seqlens, *, causal=False,
                     softmax_scale=None):
    """q_vals [b, s_q, h_q, d] float -> out [b, s_q, h_q, 512], lse [b, h_q, s_q] fp64."""
    b, s_q, h_q, d_qk = q_vals.shape
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale
    group = h_q // cache.h_kv
    out = np.zeros((b, s_q, h_q, D_V))
    lse = np.zeros((b, h_q, s_q))
    max_tokens = block_table.shape[1] * cache.page_size
    for i in range(b):
        seqlen = min(max(int(cache_seqlens[i]), 0), max_tokens)
        for s in range(s_q):
            visible = seqlen - s_q + s + 1 if causal else seqlen
            tokens = np.arange(max(0, min(visible, seqlen)))
            pages = block_table[i, tokens // cache.page_size]
            ok = (pages >= 0) & (pages < cache.num_pages)
            slots = (pages * cache.page_size + tokens % cache.page_size)[ok]
            for hk in range(cache.h_kv):
                K = dequant(cache, slots, head=hk)
                heads = slice(hk * group, (hk + 1) * group)
                o, l = _attend(q_vals[i, s, heads].astype(np.float64), K, scale)
                out[i, s, heads] = o
                lse[i, heads, s] = l
    return out, lse


def merge_ref(out_parts, lse_parts, attn_sink=None):
    """out_parts [n, b, s_q, h_q, d_v], lse_parts [n, b, s_q, h_q] -> out, lse [b, h_q, s_q]."""
    o = out_parts.astype(np.float64)
    l = lse_parts.astype(np.float64)
    finite = np.isfinite(l)
    lm = np.where(finite, l, -np.inf)
    m = lm.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(finite, np.exp(lm - m_safe), 0.0)
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total > 0, np.log(total) + m_safe, np.inf)
        out = np.where(total[..., None] > 0,
                       (w[..., None] * np.where(finite[..., None], o, 0)).sum(axis=0)
                       / np.where(total > 0, total, 1)[..., None], 0.0)
    if attn_sink is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            factor = np.where(np.isinf(lse), 1.0,
                              1.0 / (1.0 + np.exp(attn_sink[None, None, :] - lse)))
        out = out * factor[..., None]
    return out, lse.transpose(0, 2, 1)


# ----------------------------------------------------------------------------- comparison

def to_f64(x) -> np.ndarray:
    """float64 values of a result: numpy (ml_dtypes bf16 / uint16 bits / float) or torch."""
    if type(x).__module__.startswith("torch"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return bf16_bits_to_f64(x.view(torch.int16).numpy().view(np.uint16))
        return x.double().numpy()
    x = np.asarray(x)
    if x.dtype.kind == "V" or x.dtype == np.uint16:
        return bf16_bits_to_f64(x.view(np.uint16))
    return x.astype(np.float64)


def assert_close(out, lse, out_ref, lse_ref, *, dense: bool = False) -> None:
    """Spec section 7: per-element abs/rel bounds, cosine difference, lse bounds, inf/NaN
    positions equal."""
    out, lse = to_f64(out), to_f64(lse)
    assert out.shape == out_ref.shape, (out.shape, out_ref.shape)
    assert lse.shape == lse_ref.shape, (lse.shape, lse_ref.shape)
    for got, ref, name in ((out, out_ref, "out"), (lse, lse_ref, "lse")):
        assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{name}: NaN positions differ"
        assert np.array_equal(np.isposinf(got), np.isposinf(ref)), f"{name}: +inf differs"
        assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{name}: -inf differs"
    fin = np.isfinite(out_ref)
    abs_tol = 8e-4 if dense else 1e-3
    err = np.abs(out[fin] - out_ref[fin])
    bad = (err > abs_tol) & (err > 2.01 / 128 * np.abs(out_ref[fin]))
    assert not bad.any(), f"out: {bad.sum()} elements out of tolerance, max err {err.max()}"
    a, r = out[fin], out_ref[fin]
    denom = (a * a).sum() + (r * r).sum()
    if denom > 0:
        cos_diff = 1 - 2 * (a * r).sum() / denom
        assert cos_diff <= 5e-6, f"out: cosine difference {cos_diff}"
    fin = np.isfinite(lse_ref)
    err = np.abs(lse[fin] - lse_ref[fin])
    bad = (err > 1e-6) & (err > 8.01 / 65536 * np.abs(lse_ref[fin]))
    assert not bad.any(), f"lse: {bad.sum()} elements out of tolerance, max err {err.max()}"


def sm_scale(d_qk: int) -> float:
    return d_qk ** -0.55


def random_indices(rng, filled: np.ndarray, shape, *, invalid_fraction: float = 0.1,
                   num_slots: Optional[int] = None) -> np.ndarray:
    """Indices drawn from filled slots, with some -1 and (if num_slots) some out-of-range."""
    idx = rng.choice(filled, size=shape).astype(np.int32)
    r = rng.random(shape)
    idx[r < invalid_fraction] = -1
    if num_slots is not None:
        oob = (r >= invalid_fraction) & (r < invalid_fraction * 1.5)
        idx[oob] = num_slots + rng.integers(0, 1000, size=int(oob.sum()))
    return idx
