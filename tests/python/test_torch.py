"""torch CPU tensors: the native API, the flash_mla drop-in and the torch.library ops
(torch.compile). Skipped when torch is not installed."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_mla as sm  # noqa: E402
import sparse_mla.flash_mla as flash_mla  # noqa: E402
from reference import (BF16, MODEL1, V32, D_QK, assert_close, bf16_bits_to_f64,  # noqa: E402
                       dense_decode_ref, merge_ref, new_cache, random_q, random_rows, sm_scale,
                       store)
from torch_util import reference_of, sparse_problem, t, t_bf16, t_cache, torch_kwargs  # noqa: E402


# ------------------------------------------------------------------------- native API

@pytest.mark.parametrize("fp8_dtype", [False, True])
def test_native_sparse_decode_on_cpu_tensors(fp8_dtype):
    p = sparse_problem(10, extra=(33, 2, 40))
    kw = torch_kwargs(p, fp8_dtype=fp8_dtype)
    out, lse = sm.sparse_decode(kw.pop("q"), kw.pop("k_cache"), kw.pop("indices"), **kw,
                                softmax_scale=sm_scale(512))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert lse.stride() == (2 * 8, 1, 8)
    assert_close(out, lse, *reference_of(p, sm_scale(512)))


def test_native_dense_decode_and_merge_on_cpu_tensors():
    rng = np.random.default_rng(11)
    cache = new_cache(BF16, 6, 64)
    cache.buf.view(np.uint16)[...] = random_q(rng, cache.buf.shape)  # every token written
    bt = np.array([[3, 1, 0], [5, 2, 4]], np.int32)
    seqlens = np.array([150, 64], np.int32)
    q = random_q(rng, (2, 1, 4, 576))
    out, lse = sm.dense_decode(t_bf16(q), t_cache(cache), t(bt), t(seqlens))
    assert out.is_contiguous() and lse.is_contiguous() and lse.shape == (2, 4, 1)
    assert_close(out, lse, *dense_decode_ref(bf16_bits_to_f64(q), cache, bt, seqlens),
                 dense=True)
    parts = torch.stack([out.float(), out.float()])
    lses = torch.stack([lse.transpose(1, 2), lse.transpose(1, 2)])
    merged, merged_lse = sm.merge_attention(parts, lses)
    ref_out, ref_lse = merge_ref(parts.numpy(), lses.numpy())
    np.testing.assert_allclose(merged.numpy(), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(merged_lse.numpy(), ref_lse, rtol=1e-6, atol=1e-6)


def test_native_kv_tools_on_cpu_tensors():
    rng = np.random.default_rng(12)
    cache = new_cache(MODEL1, 2, 16)
    kc = t_cache(cache)
    rows = torch.from_numpy(random_rows(rng, 5, 512))
    slots = torch.tensor([3, 17, -1, 0, 31], dtype=torch.int32)
    sm.quantize_store(rows, slots, kc)
    deq = sm.dequantize(kc, slots)
    assert deq.dtype == torch.float32 and deq.shape == (5, 512)
    assert torch.all(deq[2] == 0)
    assert torch.allclose(deq[[0, 1, 3, 4]], rows[[0, 1, 3, 4]], atol=0.07, rtol=0.07)
    # dtype options by name or as the torch dtype, alike eagerly and under torch.compile
    deq_bf16 = sm.dequantize(kc, slots, dtype=torch.bfloat16)
    assert deq_bf16.dtype == torch.bfloat16
    assert torch.equal(deq_bf16, sm.dequantize(kc, slots, dtype="bfloat16"))
    parts, lses = torch.stack([deq, deq])[:, None, None], torch.zeros(2, 1, 1, 5)
    merged, _ = sm.merge_attention(parts, lses, out_dtype=torch.bfloat16)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged[0, 0], deq.bfloat16())


# ------------------------------------------------------------------- flash_mla drop-in

@pytest.mark.parametrize("fmt,extra", [(MODEL1, (40, 2, 30)), (MODEL1, None), (V32, (20, 64, 2))])
@pytest.mark.parametrize("s_q", [1, 2])
def test_flash_mla_sparse(fmt, extra, s_q):
    p = sparse_problem(20 + s_q, fmt=fmt, s_q=s_q, h_q=16, extra=extra)
    kw = torch_kwargs(p)
    meta, none = flash_mla.get_mla_metadata()
    assert none is None and not meta.have_initialized
    out, lse = flash_mla.flash_mla_with_kvcache(
        kw["q"], kw["k_cache"], None, None, 512, meta, None, None, False, True,
        indices=kw["indices"], attn_sink=kw["attn_sink"], extra_k_cache=kw.get("extra_k_cache"),
        extra_indices_in_kvcache=kw.get("extra_indices"), topk_length=kw["topk_length"],
        extra_topk_length=kw.get("extra_topk_length"))
    b, h_q = 2, 16
    assert out.shape == (b, s_q, h_q, 512) and out.is_contiguous()
    assert lse.shape == (b, h_q, s_q) and lse.stride() == (s_q * h_q, 1, h_q)
    assert meta.have_initialized and meta.config.h_q == h_q and meta.config.topk == 50
    assert_close(out, lse, *reference_of(p))
    # reuse across "layers": same plan, another layer's q
    q2 = t_bf16(random_q(np.random.default_rng(99), (b, s_q, h_q, D_QK[fmt])))
    out2, lse2 = flash_mla.flash_mla_with_kvcache(
        q2, kw["k_cache"], None, None, 512, meta, is_fp8_kvcache=True, indices=kw["indices"],
        attn_sink=kw["attn_sink"], extra_k_cache=kw.get("extra_k_cache"),
        extra_indices_in_kvcache=kw.get("extra_indices"), topk_length=kw["topk_length"],
        extra_topk_length=kw.get("extra_topk_length"))
    p2 = dict(p, q=q2.view(torch.int16).numpy().view(np.uint16))
    assert_close(out2, lse2, *reference_of(p2))


def test_flash_mla_config_mismatch_is_a_clear_error():
    p = sparse_problem(30, lengths=False, sink=False)
    kw = torch_kwargs(p)
    meta, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                     is_fp8_kvcache=True, indices=kw["indices"])
    with pytest.raises(flash_mla.FlashMLAConfigError, match="planned for topk=50, called with "
                       "topk=20"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=kw["indices"][..., :20])
    with pytest.raises(AssertionError, match="h_q=8"):  # FlashMLA raised AssertionError
        flash_mla.flash_mla_with_kvcache(kw["q"][:, :, :4], kw["k_cache"], None, None, 512,
                                         meta, is_fp8_kvcache=True, indices=kw["indices"])


def test_flash_mla_argument_checks():
    p = sparse_problem(31, lengths=False, sink=False)
    kw = torch_kwargs(p)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match="head_dim_v: 576"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 576, meta,
                                         is_fp8_kvcache=True, indices=kw["indices"])
    with pytest.raises(ValueError, match="causal"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                         causal=True, is_fp8_kvcache=True, indices=kw["indices"])
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                         indices=kw["indices"])
    with pytest.raises(ValueError, match="block_table and cache_seqlens"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                         is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="attn_sink"):
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], torch.zeros(2, 1, dtype=torch.int32),
                                         torch.zeros(2, dtype=torch.int32), 512, meta,
                                         is_fp8_kvcache=True, attn_sink=torch.zeros(8))
    # What the drop-in reads itself is checked before it is read, by name.
    q, kc, idx = kw["q"], kw["k_cache"], kw["indices"]
    with pytest.raises(ValueError, match=r"q: rank 2 \(shape \(8, 512\)\), expected 4"):
        flash_mla.flash_mla_with_kvcache(q[0, 0], kc, None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=idx)
    with pytest.raises(ValueError, match="k_cache: rank 3"):
        flash_mla.flash_mla_with_kvcache(q, kc[:, :, 0], None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=idx)
    with pytest.raises(TypeError, match="q: ndarray, expected a torch.Tensor"):
        flash_mla.flash_mla_with_kvcache(q.float().numpy(), kc, None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=idx)
    with pytest.raises(TypeError, match="softmax_scale: Tensor, expected a float or None"):
        flash_mla.flash_mla_with_kvcache(q, kc, None, None, 512, meta,
                                         softmax_scale=torch.tensor(0.05), is_fp8_kvcache=True,
                                         indices=idx)
    # 512-wide bf16 dense caches (FlashMLA's head_size_k 512) are refused by name.
    with pytest.raises(ValueError, match="k_cache: last dim 512"):
        flash_mla.flash_mla_with_kvcache(
            torch.zeros(2, 1, 8, 512, dtype=torch.bfloat16),
            torch.zeros(4, 64, 1, 512, dtype=torch.bfloat16),
            torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 512, meta)
    assert not meta.have_initialized  # failed calls leave the metadata fresh
    with pytest.raises(NotImplementedError):
        flash_mla.flash_mla_sparse_fwd(kw["q"][0], kw["q"][0], kw["indices"][0], 0.1)


def test_flash_mla_takes_int8_fp8_pages():
    # FlashMLA takes FP8 pages as float8_e4m3fn, uint8 or int8 tensors: the same bytes.
    p = sparse_problem(32, extra=(30, 2, 20))
    kw = torch_kwargs(p)
    results = []
    for dtype in (torch.uint8, torch.int8):
        meta, _ = flash_mla.get_mla_metadata()
        results.append(flash_mla.flash_mla_with_kvcache(
            kw["q"], kw["k_cache"].view(dtype), None, None, 512, meta, is_fp8_kvcache=True,
            indices=kw["indices"], attn_sink=kw["attn_sink"],
            extra_k_cache=kw["extra_k_cache"].view(dtype),
            extra_indices_in_kvcache=kw["extra_indices"], topk_length=kw["topk_length"],
            extra_topk_length=kw["extra_topk_length"]))
    (out_u8, lse_u8), (out_i8, lse_i8) = results
    assert torch.equal(out_u8, out_i8) and torch.equal(lse_u8, lse_i8)
    assert_close(out_i8, lse_i8, *reference_of(p))


def test_flash_mla_first_call_failing_in_the_library_leaves_the_metadata_fresh():
    p = sparse_problem(32, lengths=False, sink=False)
    kw = torch_kwargs(p)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(TypeError, match="indices"):  # rejected by the library, not the wrapper
        flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, None, 512, meta,
                                         is_fp8_kvcache=True, indices=kw["indices"].long())
    assert not meta.have_initialized and meta.tile_scheduler_metadata is None
    out, lse = flash_mla.flash_mla_with_kvcache(kw["q"][:, :1], kw["k_cache"], None, None, 512,
                                                meta, is_fp8_kvcache=True,
                                                indices=kw["indices"][:, :1])
    assert meta.config.s_q == 1
    p1 = dict(p, q=p["q"][:, :1], indices=p["indices"][:, :1])
    assert_close(out, lse, *reference_of(p1))


def test_flash_mla_registers_the_torch_ops_whatever_the_import_order():
    # The docs import sparse_mla.flash_mla before torch; torch.compile needs the ops registered.
    code = ("import sparse_mla.flash_mla, sparse_mla, torch; "
            "assert hasattr(torch.ops.sparse_mla, 'sparse_decode'); "
            "assert sparse_mla._ops is not None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_mla_dense(causal):
    rng = np.random.default_rng(40)
    cache = new_cache(BF16, 5, 64)
    cache.buf.view(np.uint16)[...] = random_q(rng, cache.buf.shape)
    bt = np.array([[4, 0], [1, 3]], np.int32)
    seqlens = np.array([100, 7], np.int32)
    q = random_q(rng, (2, 2, 16, 576))
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(t_bf16(q), t_cache(cache), t(bt), t(seqlens),
                                                512, meta, causal=causal)
    assert lse.is_contiguous() and lse.shape == (2, 16, 2)
    assert_close(out, lse, *dense_decode_ref(bf16_bits_to_f64(q), cache, bt, seqlens,
                                             causal=causal), dense=True)


def test_flash_mla_reused_metadata_still_checks_the_arguments():
    rng = np.random.default_rng(41)
    cache = new_cache(BF16, 3, 64)
    cache.buf.view(np.uint16)[...] = random_q(rng, cache.buf.shape)
    bt, seqlens = t(np.array([[2], [0]], np.int32)), t(np.array([50, 9], np.int32))
    q = t_bf16(random_q(rng, (2, 1, 8, 576)))
    meta, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, t_cache(cache), bt, seqlens, 512, meta)
    assert meta.have_initialized
    # Neither argument is part of the plan's config; dense decode must not drop the sink silently.
    with pytest.raises(ValueError, match="attn_sink: given without indices"):
        flash_mla.flash_mla_with_kvcache(q, t_cache(cache), bt, seqlens, 512, meta,
                                         attn_sink=torch.zeros(8))
    with pytest.raises(ValueError, match="head_dim_v: 576"):
        flash_mla.flash_mla_with_kvcache(q, t_cache(cache), bt, seqlens, 576, meta)


def test_torch_subclasses_and_lazily_negated_tensors():
    p = sparse_problem(43, h_q=16)
    kw = torch_kwargs(p)

    class Sub(torch.Tensor):
        pass

    out, lse = sm.sparse_decode(kw["q"].as_subclass(Sub), kw["k_cache"], kw["indices"],
                                topk_length=kw["topk_length"], attn_sink=kw["attn_sink"])
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)  # torch, not DLPack
    assert_close(out, lse, *reference_of(p))
    # A negated view whose memory holds the un-negated values is refused, not read as stored.
    sink = torch.complex(torch.zeros(16), kw["attn_sink"].float()).conj().imag
    assert sink.is_neg()
    with pytest.raises(ValueError, match="attn_sink: a torch tensor with the negative bit"):
        sm.sparse_decode(kw["q"], kw["k_cache"], kw["indices"], attn_sink=sink)


def test_flash_mla_explicit_metadata_form():
    p = sparse_problem(41, lengths=False, sink=False)
    kw = torch_kwargs(p)
    cache_seqlens = torch.tensor([100, 50], dtype=torch.int32)
    tile, num_splits = flash_mla.get_mla_metadata(cache_seqlens, 2 * 8, 1, 8, True, 50)
    assert tile.dtype == torch.int32 and tile.dim() == 2 and tile.shape[1] == 8
    assert num_splits.shape == (3,) and num_splits.dtype == torch.int32
    out, lse = flash_mla.flash_mla_with_kvcache(kw["q"], kw["k_cache"], None, cache_seqlens, 512,
                                                tile, num_splits, is_fp8_kvcache=True,
                                                indices=kw["indices"])
    assert_close(out, lse, *reference_of(p))
    meta, _ = flash_mla.get_mla_metadata(cache_seqlens=None)
    assert isinstance(meta, flash_mla.FlashMLASchedMeta)
    tile_kw, _ = flash_mla.get_mla_metadata(cache_seqlens=cache_seqlens, num_heads_per_head_k=16,
                                            num_heads_k=1)  # FlashMLA's first keyword names
    assert tile_kw.shape == tile.shape
    with pytest.raises(ValueError, match="num_heads_k: 0"):
        flash_mla.get_mla_metadata(cache_seqlens, 16, 0)
    with pytest.raises(ValueError, match="num_q_tokens_per_head_k: None"):
        flash_mla.get_mla_metadata(cache_seqlens)


# ------------------------------------------------------------------ torch.library ops

def test_ops_are_registered_with_mutation_annotations():
    schema = str(torch.ops.sparse_mla.sparse_decode_out.default._schema)
    assert "Tensor(a!) out" in schema and "Tensor(b!) lse" in schema
    assert "Tensor(a!) k_cache" in str(torch.ops.sparse_mla.quantize_store.default._schema)
    assert "Tensor(a!) dst" in str(torch.ops.sparse_mla.repack_pages.default._schema)


def test_opcheck_sparse_decode():
    # opcheck clones inputs contiguously: page sizes whose unpadded stride is 16-byte aligned
    p = sparse_problem(50, ps=64, extra=(9, 2, 12))
    kw = torch_kwargs(p)
    args = (kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["extra_k_cache"],
            kw["extra_indices"], kw["extra_topk_length"], kw["attn_sink"], 0.05)
    torch.library.opcheck(torch.ops.sparse_mla.sparse_decode.default, args)
    out = torch.empty(2, 2, 8, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 8, 2)
    torch.library.opcheck(torch.ops.sparse_mla.sparse_decode_out.default, args,
                          dict(out=out, lse=lse))


def test_opcheck_dense_merge_and_kv_tools():
    rng = np.random.default_rng(51)
    cache = new_cache(MODEL1, 3, 16)
    store(cache, np.arange(48), random_rows(rng, 48, 512))
    q = t_bf16(random_q(rng, (2, 1, 4, 512)))
    bt = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    seqlens = torch.tensor([20, 31], dtype=torch.int32)
    ops = torch.ops.sparse_mla
    torch.library.opcheck(ops.dense_decode.default, (q, t_cache(cache), bt, seqlens, True))
    parts = torch.randn(2, 2, 1, 4, 64)
    lses = torch.randn(2, 2, 1, 4)
    torch.library.opcheck(ops.merge_attention.default, (parts, lses, torch.randn(4)))
    rows = torch.from_numpy(random_rows(rng, 3, 512))
    slots = torch.tensor([1, 5, 40], dtype=torch.int32)
    torch.library.opcheck(ops.quantize_store.default, (rows, slots, t_cache(cache).clone()))
    torch.library.opcheck(ops.dequantize.default, (t_cache(cache), slots))
    dst = t_cache(new_cache(MODEL1, 4, 16))
    torch.library.opcheck(ops.repack_pages.default,
                          (t_cache(cache), dst, bt, torch.tensor([[3, 2], [1, 0]], dtype=torch.int32),
                           seqlens))


def test_torch_compile_traces_without_graph_breaks():
    p = sparse_problem(60, ps=64, extra=(9, 2, 12))
    kw = torch_kwargs(p)
    rng = np.random.default_rng(61)
    rows = torch.from_numpy(random_rows(rng, 4, 512))
    slots = torch.tensor([0, 3, 7, -1], dtype=torch.int32)

    def step(q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length,
             attn_sink, rows, slots):
        sm.quantize_store(rows, slots, extra_k_cache)
        out, lse = sm.sparse_decode(q, k_cache, indices, topk_length=topk_length,
                                    extra_k_cache=extra_k_cache, extra_indices=extra_indices,
                                    extra_topk_length=extra_topk_length, attn_sink=attn_sink)
        merged, merged_lse = sm.merge_attention(out.float()[None], lse.transpose(1, 2)[None])
        return merged * 2, merged_lse

    args = (kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["extra_k_cache"],
            kw["extra_indices"], kw["extra_topk_length"], kw["attn_sink"], rows, slots)
    eager_args = [a.clone() for a in args]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, got_lse = compiled(*args)
    want, want_lse = step(*eager_args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    torch.testing.assert_close(args[4], eager_args[4], rtol=0, atol=0)  # the in-place store


def test_torch_compile_flash_mla():
    p = sparse_problem(62)
    kw = torch_kwargs(p)

    def layer(q, k_cache, indices, topk_length, attn_sink):
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta,
                                                is_fp8_kvcache=True, indices=indices,
                                                topk_length=topk_length, attn_sink=attn_sink)

    args = (kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"])
    out, lse = torch.compile(layer, backend="aot_eager")(*args)
    assert_close(out, lse, *reference_of(p))


def test_tensors_that_require_grad_are_accepted():
    p = sparse_problem(70, lengths=False, sink=False)
    kw = torch_kwargs(p)
    q = kw["q"].float().requires_grad_().bfloat16()
    out, lse = sm.sparse_decode(q, kw["k_cache"], kw["indices"])
    assert not out.requires_grad
    assert_close(out, lse, *reference_of(p))


def test_torch_errors_name_the_argument():
    p = sparse_problem(71, lengths=False, sink=False)
    kw = torch_kwargs(p)
    with pytest.raises(TypeError, match="indices: dtype int64"):
        sm.sparse_decode(kw["q"], kw["k_cache"], kw["indices"].long())
    with pytest.raises(TypeError, match="q: dtype float32, expected bfloat16"):
        sm.sparse_decode(kw["q"].float(), kw["k_cache"], kw["indices"])
    with pytest.raises(ValueError, match="q: last dim stride 2"):
        sm.sparse_decode(torch.cat([kw["q"], kw["q"]], -1)[..., ::2], kw["k_cache"],
                         kw["indices"])
