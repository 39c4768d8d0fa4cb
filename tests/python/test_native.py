"""The native API on numpy arrays (CPU backend) against the numpy fp64 reference."""

import numpy as np
import pytest

import sparse_mla as sm
from reference import (BF16, FP16, MODEL1, V32, D_QK, assert_close, bf16_bits_to_f64,
                       dense_decode_ref, dequant, e4m3_encode, E4M3, f32_to_bf16_bits,
                       filled_cache, merge_ref, new_cache, random_indices, random_q, random_rows,
                       sm_scale, sparse_decode_ref, store, to_f64)

try:
    import ml_dtypes
except ImportError:  # the uint16 convention is tested either way
    ml_dtypes = None


def as_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns as the caller would pass them: ml_dtypes.bfloat16 when available."""
    return bits.view(ml_dtypes.bfloat16) if ml_dtypes is not None else bits


def poison(shape, dtype) -> np.ndarray:
    """An output buffer full of NaN, so any element the library does not write is caught."""
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = 0xFF
    return a


# ------------------------------------------------------------------- reference self-checks

def test_reference_e4m3_round_trip_and_rounding():
    finite = np.arange(256)[~np.isnan(E4M3)]
    assert np.array_equal(e4m3_encode(E4M3[finite]), finite.astype(np.uint8))
    # halfway between 1.0 (code 0x38) and 1.125 (0x39): ties to the even code
    assert e4m3_encode(np.array([1.0625]))[0] == 0x38
    assert e4m3_encode(np.array([1.1875]))[0] == 0x3A


# ------------------------------------------------------------------------- sparse decode

SPARSE_CASES = [
    # fmt, b, s_q, h_q, topk, page_size, num_pages, extra (topk, page_size, pages) or None
    (MODEL1, 1, 1, 1, 37, 2, 40, None),
    (MODEL1, 3, 2, 16, 100, 53, 4, None),
    (MODEL1, 2, 1, 8, 130, 61, 3, (45, 2, 30)),
    (MODEL1, 1, 2, 64, 70, 64, 2, (65, 69, 2)),
    (V32, 2, 1, 8, 77, 53, 3, None),
    (V32, 1, 2, 16, 64, 64, 2, (33, 2, 20)),
]


@pytest.mark.parametrize("fmt,b,s_q,h_q,topk,ps,pages,extra", SPARSE_CASES)
@pytest.mark.parametrize("with_lengths", [False, True])
def test_sparse_decode_matches_reference(fmt, b, s_q, h_q, topk, ps, pages, extra,
                                         with_lengths):
    rng = np.random.default_rng(hash((fmt, b, s_q, h_q, topk, ps, with_lengths)) % 2**32)
    cache, filled = filled_cache(rng, fmt, pages, ps)
    q = random_q(rng, (b, s_q, h_q, D_QK[fmt]))
    idx = random_indices(rng, filled, (b, s_q, topk), num_slots=cache.num_slots)
    kw = {}
    ref_kw = {}
    if with_lengths:
        tl = rng.integers(0, topk + 1, size=b).astype(np.int32)
        tl[0] = topk + 5  # clamped to topk
        kw["topk_length"] = ref_kw["topk_length"] = tl
        # entries past topk_length point at never-written (NaN) slots
        for i in range(b):
            idx[i, :, max(tl[i], 0):] = np.setdiff1d(np.arange(cache.num_slots), filled)[0] \
                if len(filled) < cache.num_slots else -1
        sink = rng.normal(0, 1, h_q).astype(np.float32)
        kw["attn_sink"] = ref_kw["attn_sink"] = sink
    if extra is not None:
        etopk, eps, epages = extra
        ecache, efilled = filled_cache(rng, fmt, epages, eps)
        eidx = random_indices(rng, efilled, (b, s_q, etopk), num_slots=ecache.num_slots)
        kw.update(extra_k_cache=ecache.view, extra_indices=eidx)
        ref_kw.update(extra=ecache, extra_indices=eidx)
        if with_lengths:
            etl = rng.integers(0, etopk + 1, size=b).astype(np.int32)
            kw["extra_topk_length"] = ref_kw["extra_topk_length"] = etl
    scale = sm_scale(D_QK[fmt])
    out, lse = sm.sparse_decode(as_bf16(q), cache.view, idx, softmax_scale=scale, **kw)
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    assert lse.strides == (s_q * h_q * 4, 4, h_q * 4)  # FlashMLA's sparse lse layout
    out_ref, lse_ref = sparse_decode_ref(q, cache, idx, softmax_scale=scale, **ref_kw)
    assert_close(out, lse, out_ref, lse_ref)


def test_sparse_decode_uint16_bits_and_preallocated_outputs():
    rng = np.random.default_rng(1)
    cache, filled = filled_cache(rng, MODEL1, 3, 61)
    b, s_q, h_q = 2, 2, 5
    # non-contiguous q: every other head of a larger array
    q_big = random_q(rng, (b, s_q, 2 * h_q, 512))
    q = q_big[:, :, ::2, :]
    idx_big = random_indices(rng, filled, (b, s_q, 2 * 50))
    idx = idx_big[:, :, ::2]
    out = poison((b, s_q, h_q, 512), np.uint16)
    lse = poison((b, h_q, s_q), np.float32)
    got_out, got_lse = sm.sparse_decode(q, cache.view, idx, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    out_ref, lse_ref = sparse_decode_ref(np.ascontiguousarray(q), cache, idx)
    assert_close(out, lse, out_ref, lse_ref)


def test_sparse_decode_corner_cases():
    rng = np.random.default_rng(2)
    cache, filled = filled_cache(rng, MODEL1, 2, 64)
    b, s_q, h_q, topk = 3, 1, 4, 20
    q = random_q(rng, (b, s_q, h_q, 512))
    idx = random_indices(rng, filled, (b, s_q, topk), invalid_fraction=0)
    idx[0] = -1                                    # request 0: no token at all
    idx[1, :, : topk // 2] = cache.num_slots + 7   # out of range: skipped, never read
    sink = np.array([np.inf, -np.inf, 0.5, -2.0], np.float32)
    tl = np.array([topk, topk, 0], np.int32)       # request 2: zero length
    out, lse = sm.sparse_decode(as_bf16(q), cache.view, idx, topk_length=tl, attn_sink=sink)
    out_ref, lse_ref = sparse_decode_ref(q, cache, idx, topk_length=tl, attn_sink=sink)
    assert_close(out, lse, out_ref, lse_ref)
    o, l = to_f64(out), to_f64(lse)
    assert np.all(o[0] == 0) and np.all(np.isposinf(l[0]))
    assert np.all(o[2] == 0) and np.all(np.isposinf(l[2]))
    assert np.all(o[1, :, 0] == 0)                 # sink +inf zeroes head 0
    assert np.all(np.isfinite(l[1]))


def test_sparse_decode_padded_page_stride():
    rng = np.random.default_rng(3)
    cache, filled = filled_cache(rng, V32, 3, 53, extra_stride=48)
    q = random_q(rng, (1, 1, 3, 576))
    idx = random_indices(rng, filled, (1, 1, 90))
    out, lse = sm.sparse_decode(as_bf16(q), cache.view, idx)
    assert_close(out, lse, *sparse_decode_ref(q, cache, idx))


# -------------------------------------------------------------------------- dense decode

DENSE_CASES = [
    # fmt, b, s_q, h_q, h_kv, page_size, max_pages, causal
    (BF16, 2, 1, 8, 1, 64, 3, False),
    (BF16, 3, 2, 6, 2, 53, 2, True),
    (FP16, 1, 3, 4, 1, 61, 2, True),
    (MODEL1, 2, 2, 16, 1, 2, 40, True),
    (V32, 2, 1, 3, 1, 69, 2, False),
]


@pytest.mark.parametrize("fmt,b,s_q,h_q,h_kv,ps,max_pages,causal", DENSE_CASES)
def test_dense_decode_matches_reference(fmt, b, s_q, h_q, h_kv, ps, max_pages, causal):
    rng = np.random.default_rng(hash((fmt, b, s_q, h_q, ps)) % 2**32)
    num_pages = b * max_pages + 2
    cache = new_cache(fmt, num_pages, ps, h_kv=h_kv)
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = perm[: b * max_pages].reshape(b, max_pages).copy()
    seqlens = rng.integers(1, max_pages * ps + 1, size=b).astype(np.int32)
    seqlens[0] = 0 if b > 2 else seqlens[0]   # an empty request
    if b > 1:
        bt[1, -1] = num_pages + 3             # out-of-range page: its tokens are absent
    # write only the tokens the requests own; the rest stays NaN
    for i in range(b):
        t = np.arange(seqlens[i])
        slots = bt[i, t // ps] * ps + t % ps
        slots = slots[bt[i, t // ps] < num_pages]
        for hk in range(h_kv):
            rows = random_rows(rng, len(slots), D_QK[fmt])
            if fmt in (BF16, FP16):
                dtype_bits = f32_to_bf16_bits(rows) if fmt == BF16 else rows.astype(
                    np.float16).view(np.uint16)
                pages, toks = slots // ps, slots % ps
                cache.buf.view(np.uint16)[pages, toks, hk] = dtype_bits
            else:
                store(cache, slots, rows)
    d = D_QK[fmt]
    if fmt == FP16:
        q = rng.uniform(-1, 1, (b, s_q, h_q, d)).astype(np.float16)
        q_arg, q_vals = q, q.astype(np.float64)
    else:
        bits = random_q(rng, (b, s_q, h_q, d))
        q_arg, q_vals = as_bf16(bits), bf16_bits_to_f64(bits)
    scale = sm_scale(d)
    out, lse = sm.dense_decode(q_arg, cache.view, bt, seqlens, causal=causal,
                               softmax_scale=scale)
    assert lse.flags["C_CONTIGUOUS"] and lse.shape == (b, h_q, s_q)
    if fmt == FP16:
        assert out.dtype == np.float16
    out_ref, lse_ref = dense_decode_ref(q_vals, cache, bt, seqlens, causal=causal,
                                        softmax_scale=scale)
    assert_close(out, lse, out_ref, lse_ref, dense=True)


# --------------------------------------------------------------------------------- merge

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_attention(dtype):
    rng = np.random.default_rng(4)
    n, b, s_q, h_q, d_v = 3, 2, 2, 5, 64
    parts = rng.normal(0, 1, (n, b, s_q, h_q, d_v)).astype(np.float32)
    lses = rng.normal(2, 1, (n, b, s_q, h_q)).astype(np.float32)
    lses[0, 0] = np.inf    # empty part
    lses[1, 0] = -np.inf   # empty part
    lses[:, 1, 0, 0] = np.inf  # every part empty
    sink = rng.normal(0, 1, h_q).astype(np.float32)
    arg = parts if dtype == "float32" else as_bf16(f32_to_bf16_bits(parts))
    vals = parts if dtype == "float32" else bf16_bits_to_f64(f32_to_bf16_bits(parts))
    out, lse = sm.merge_attention(arg, lses, attn_sink=sink, out_dtype="float32")
    out_ref, lse_ref = merge_ref(vals, lses, sink)
    np.testing.assert_allclose(to_f64(out), out_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_f64(lse), lse_ref, rtol=1e-6, atol=1e-6)
    # a list of parts works the same
    out2, lse2 = sm.merge_attention(list(arg), list(lses), attn_sink=sink, out_dtype="float32")
    np.testing.assert_array_equal(to_f64(out2), to_f64(out))


# ------------------------------------------------------------------------------ KV tools

@pytest.mark.parametrize("fmt", [MODEL1, V32])
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_quantize_store_is_bit_exact(fmt, src_dtype):
    rng = np.random.default_rng(5)
    ours, theirs = new_cache(fmt, 3, 53), new_cache(fmt, 3, 53)
    n = 40
    rows = random_rows(rng, n, D_QK[fmt]) * rng.choice([1e-3, 1, 30], size=(n, 1))
    rows = rows.astype(np.float32)
    if src_dtype == "bfloat16":
        bits = f32_to_bf16_bits(rows)
        src, rows = as_bf16(bits), bf16_bits_to_f64(bits).astype(np.float32)
    else:
        src = rows
    slots = rng.choice(ours.num_slots, size=n, replace=False).astype(np.int32)
    slots[3] = -1
    assert sm.quantize_store(src, slots, ours.view) is ours.view
    store(theirs, slots, rows)
    np.testing.assert_array_equal(ours.buf, theirs.buf)


@pytest.mark.parametrize("fmt", [MODEL1, V32, BF16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize(fmt, dtype):
    rng = np.random.default_rng(6)
    cache, filled = filled_cache(rng, fmt, 2, 61, fill_fraction=1.0) if fmt != BF16 else (
        None, None)
    if fmt == BF16:
        cache = new_cache(BF16, 2, 61)
        cache.buf.view(np.uint16)[...] = random_q(rng, cache.buf.shape)
    slots = rng.choice(cache.num_slots, 10).astype(np.int32)
    slots[0] = -1
    out = sm.dequantize(cache.view, slots, dtype=dtype)
    assert out.shape == (10, D_QK[fmt])
    ref = np.concatenate([np.zeros((1, D_QK[fmt])), dequant(cache, slots[1:])])
    if dtype == "bfloat16":
        ref = bf16_bits_to_f64(f32_to_bf16_bits(ref.astype(np.float32)))
    np.testing.assert_array_equal(to_f64(out), ref)


def test_repack_pages_moves_tokens_with_their_footers():
    rng = np.random.default_rng(7)
    src, filled = filled_cache(rng, MODEL1, 4, 61, fill_fraction=1.0)
    dst = new_cache(MODEL1, 10, 16)
    seqlens = np.array([100, 37], np.int32)
    src_bt = np.array([[2, 0], [1, 3]], np.int32)
    dst_bt = np.array([[0, 1, 2, 3, 4, 5, 6], [8, 9, 7, -1, -1, -1, -1]], np.int32)
    assert sm.repack_pages(src.view, dst.view, src_bt, dst_bt, seqlens) is dst.view
    for i in range(2):
        t = np.arange(seqlens[i])
        s_slots = src_bt[i, t // 61] * 61 + t % 61
        d_slots = dst_bt[i, t // 16] * 16 + t % 16
        np.testing.assert_array_equal(dequant(dst, d_slots), dequant(src, s_slots))


# ----------------------------------------------------------------- queries and errors

def _small_sparse(rng=None):
    rng = rng or np.random.default_rng(8)
    cache, filled = filled_cache(rng, MODEL1, 2, 16)
    q = as_bf16(random_q(rng, (1, 1, 2, 512)))
    idx = random_indices(rng, filled, (1, 1, 8))
    return q, cache, idx


def test_zero_size_numpy_arrays():
    # numpy 2 gives zero-size arrays all-zero strides; they address nothing and are accepted.
    q, cache, idx = _small_sparse()
    q0, idx0 = np.zeros((0, 1, 2, 512), q.dtype), np.zeros((0, 1, 8), np.int32)
    out, lse = sm.sparse_decode(q0, cache.view, idx0)
    assert out.shape == (0, 1, 2, 512) and lse.shape == (0, 2, 1)
    empty_ws = sm.Workspace(np.empty(0, np.uint8), np.empty(0, np.uint8))
    out, lse = sm.sparse_decode(q, cache.view, idx, workspace=empty_ws)
    assert_close(out, lse, *sparse_decode_ref(q.view(np.uint16), cache, idx))
    assert sm.dequantize(cache.view, np.zeros(0, np.int32)).shape == (0, 512)
    assert sm.dequantize(np.zeros((0, 16, 1, 584), np.uint8), np.array([3, -1], np.int32)).shape == (2, 512)


def test_size_one_dims_with_negative_strides():
    # A dim of extent 1 only ever has index 0: its stride is never used, negative or not.
    q, cache, idx = _small_sparse()
    out_ref, lse_ref = sparse_decode_ref(q.view(np.uint16), cache, idx)
    assert q.shape[1] == 1 and idx.shape[1] == 1
    out, lse = sm.sparse_decode(q[:, ::-1], cache.view, idx[:, ::-1])
    assert_close(out, lse, out_ref, lse_ref)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_other_one_byte_ml_dtypes_are_not_caches():
    # Only float8_e4m3fn travels as the cache's raw bytes: int4 or float8_e4m3b11fnuz values read
    # as e4m3 bits would be wrong numbers, and numpy cannot export float8_e5m2 at all.
    q, cache, idx = _small_sparse()
    for other in ("int4", "float8_e4m3b11fnuz", "float8_e5m2"):
        with pytest.raises(TypeError, match=f"k_cache: dtype {other}, expected one the library"):
            sm.sparse_decode(q, cache.view.view(getattr(ml_dtypes, other)), idx)
    out, lse = sm.sparse_decode(q, cache.view.view(ml_dtypes.float8_e4m3fn), idx)
    assert_close(out, lse, *sparse_decode_ref(q.view(np.uint16), cache, idx))


def test_queries_on_the_cpu():
    q, cache, idx = _small_sparse()
    assert "cpu" in sm.available_backends()
    assert sm.sparse_decode_workspace_size(q, cache.view, idx) == (0, 0)
    s = sm.is_supported("sparse_decode", q, cache.view, idx)
    assert s and s.backend == "cpu" and s.reason == ""
    ws = sm.sparse_decode_plan(q, cache.view, idx)
    out, lse = sm.sparse_decode(q, cache.view, idx, workspace=ws)
    assert_close(out, lse, *sparse_decode_ref(q.view(np.uint16), cache, idx))
    bad = sm.sparse_decode_supported(q, cache.view, idx[..., :0])
    assert not bad and bad.backend is None and "indices" in bad.reason
    bad = sm.is_supported("sparse_decode", q, cache.view, idx.astype(np.int64))
    assert not bad and "indices: dtype int64" in bad.reason
    bt = np.zeros((1, 1), np.int32)
    d = sm.dense_decode_supported(q, cache.view, bt, np.zeros(1, np.int32))
    assert d and d.backend == "cpu"
    assert sm.dense_decode_workspace_size(q, cache.view, bt, np.zeros(1, np.int32)) == (0, 0)
    with pytest.raises(ValueError, match="op: 'nope'"):
        sm.is_supported("nope")


def test_errors_name_the_argument():
    q, cache, idx = _small_sparse()
    with pytest.raises(TypeError, match="indices: dtype int64"):
        sm.sparse_decode(q, cache.view, idx.astype(np.int64))
    with pytest.raises(TypeError, match="k_cache: expected an array"):
        sm.sparse_decode(q, [1, 2, 3], idx)
    with pytest.raises(ValueError, match="k_cache: last dim 580, expected 584"):
        sm.sparse_decode(q, cache.view[..., :580], idx)
    with pytest.raises(ValueError, match=r"indices: shape \[1, 1, 8, 1\]|indices: rank 4"):
        sm.sparse_decode(q, cache.view, idx[..., None])
    with pytest.raises(TypeError, match="out: dtype float32, expected bfloat16"):
        sm.sparse_decode(q, cache.view, idx, out=np.zeros((1, 1, 2, 512), np.float32))
    with pytest.raises(ValueError, match="softmax_scale"):
        sm.sparse_decode(q, cache.view, idx, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="backend: 'gpu'"):
        sm.sparse_decode(q, cache.view, idx, backend="gpu")
    with pytest.raises(ValueError, match="backend 'cuda' runs on CUDA tensors"):
        sm.sparse_decode(q, cache.view, idx, backend="cuda")
    ro = np.zeros((1, 1, 2, 512), np.uint16)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="out: expected a writable array"):
        sm.sparse_decode(q, cache.view, idx, out=ro)
    with pytest.raises(ValueError, match="extra_indices: missing"):
        sm.sparse_decode(q, cache.view, idx, extra_k_cache=cache.view)
    # A plain tuple is not an array, even one shaped like the torch descriptors (it used to be
    # read as a raw pointer: a crash).
    for bad in [(16, 1, (1,), (1,), -1), (100, 60)]:
        with pytest.raises(TypeError, match="topk_length: expected an array"):
            sm.sparse_decode(q, cache.view, idx, topk_length=bad)
    # Parts of different dtypes are not stacked as raw bits.
    parts = np.zeros((2, 1, 1, 2, 512), np.float32)
    lses = np.zeros((2, 1, 1, 2), np.float32)
    with pytest.raises(TypeError, match="out_parts: the parts have dtypes"):
        sm.merge_attention([parts[0], as_bf16(f32_to_bf16_bits(parts[1]))], list(lses))
    with pytest.raises(TypeError, match="lse_parts: the parts have dtypes"):
        sm.merge_attention(parts, [lses[0], lses[1].astype(np.float16)])


def test_python_layer_errors_name_the_argument():
    q, cache, idx = _small_sparse()
    with pytest.raises(TypeError, match="q: expected an array, got list"):
        sm.sparse_decode([1, 2], cache.view, idx)
    with pytest.raises(ValueError, match=r"q: rank 2 \(shape \[2, 512\]\), expected 4"):
        sm.sparse_decode(q[0, 0], cache.view, idx)
    with pytest.raises(TypeError, match="q: dtype float64, expected bfloat16 or float16"):
        sm.dense_decode(np.zeros((1, 1, 2, 576)), cache.view, np.zeros((1, 1), np.int32),
                        np.ones(1, np.int32))
    parts, lses = np.zeros((2, 1, 1, 2, 64)), np.zeros((2, 1, 1, 2), np.float32)
    with pytest.raises(TypeError, match="out_parts: dtype float64, expected float32 or bfloat16"):
        sm.merge_attention(parts, lses)
    with pytest.raises(ValueError, match="out_dtype: 'f64'"):
        sm.merge_attention(parts.astype(np.float32), lses, out_dtype="f64")
    with pytest.raises(ValueError, match="out_parts: an empty sequence"):
        sm.merge_attention([], [])
    with pytest.raises(ValueError, match="slots: rank 0"):
        sm.dequantize(cache.view, np.int32(3))
    with pytest.raises(ValueError, match="dtype: 'bf16', expected 'float32' or 'bfloat16'"):
        sm.dequantize(cache.view, idx[0, 0], dtype="bf16")


def test_unsupported_error_is_a_runtime_error():
    assert issubclass(sm.UnsupportedError, NotImplementedError)
    assert issubclass(sm.UnsupportedError, RuntimeError)
    q, cache, idx = _small_sparse()
    if "cuda" in sm.available_backends():
        pytest.skip("a CUDA build routes host tensors to the CPU backend either way")
    with pytest.raises(ValueError, match="backend 'sm90' runs on CUDA"):
        sm.sparse_decode(q, cache.view, idx, backend="sm90")


def test_extension_stub_lists_every_function():
    import pathlib

    stub = (pathlib.Path(sm.__file__).parent / "_ext.pyi").read_text()
    names = [n for n in dir(sm._ext) if not n.startswith("_")]
    missing = [n for n in names if f"def {n}(" not in stub and f"{n}:" not in stub
               and f"class {n}(" not in stub]
    assert not missing, f"_ext.pyi lacks {missing}"


# ------------------------------------------------------------- other DLPack producers

class DLPackOnly:
    """An array object that speaks only DLPack (like an unknown framework)."""

    def __init__(self, a):
        self._a = a
        self.shape = a.shape
        self.dtype = a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer():
    rng = np.random.default_rng(9)
    cache, filled = filled_cache(rng, MODEL1, 2, 16)
    q = random_q(rng, (1, 2, 3, 512))
    idx = random_indices(rng, filled, (1, 2, 8))
    out_ref, lse_ref = sparse_decode_ref(q, cache, idx)
    # results allocated by the library come back as DLPack-capable arrays
    out, lse = sm.sparse_decode(DLPackOnly(q), DLPackOnly(cache.view), DLPackOnly(idx))
    assert out.__dlpack_device__() == (1, 0) and hasattr(out, "__dlpack__")
    lse_np = np.from_dlpack(lse)
    assert lse_np.shape == (1, 3, 2)
    np.testing.assert_allclose(lse_np, lse_ref, rtol=8.01 / 65536, atol=1e-6)
    # and caller-provided outputs of such producers are written in place
    out_np = poison((1, 2, 3, 512), np.uint16)
    sm.sparse_decode(DLPackOnly(q), DLPackOnly(cache.view), DLPackOnly(idx),
                     out=DLPackOnly(out_np), lse=DLPackOnly(lse_np))
    assert_close(out_np, lse_np, out_ref, lse_ref)
