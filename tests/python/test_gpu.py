"""GPU tests: torch CUDA tensors through the native API and the flash_mla drop-in, streams,
CUDA graphs and torch.compile. Skipped without torch, a GPU or a CUDA build of the extension."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_mla as sm  # noqa: E402
import sparse_mla.flash_mla as flash_mla  # noqa: E402
from reference import (BF16, MODEL1, V32, assert_close, bf16_bits_to_f64,  # noqa: E402
                       dense_decode_ref, f32_to_bf16_bits, merge_ref, new_cache, random_q,
                       random_rows, sm_scale)
from torch_util import reference_of, sparse_problem, t, t_bf16, t_cache, torch_kwargs  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in sm.available_backends(),
    reason="needs a CUDA GPU and an extension built with CUDA")

DEV = "cuda"


def gpu_kwargs(p):
    return torch_kwargs(p, device=DEV)


@pytest.mark.parametrize("fmt", [MODEL1, V32])
@pytest.mark.parametrize("h_q", [16, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_flash_mla_sparse_on_gpu(fmt, h_q, s_q):
    # main cache: 64-token pages, topk 128; extra cache: 2-token pages (a C128-like layer)
    p = sparse_problem(100 + h_q + s_q, fmt=fmt, b=3, s_q=s_q, h_q=h_q, topk=128, ps=64,
                       pages=6, extra=(96, 2, 80))
    kw = gpu_kwargs(p)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        kw["q"], kw["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
        indices=kw["indices"], attn_sink=kw["attn_sink"], extra_k_cache=kw["extra_k_cache"],
        extra_indices_in_kvcache=kw["extra_indices"], topk_length=kw["topk_length"],
        extra_topk_length=kw["extra_topk_length"])
    assert out.device.type == "cuda" and out.is_contiguous()
    assert lse.stride() == (s_q * h_q, 1, h_q)
    torch.cuda.synchronize()
    assert_close(out, lse, *reference_of(p))


@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_native_sparse_decode_on_gpu_without_extra(h_q):
    p = sparse_problem(200 + h_q, b=2, s_q=2, h_q=h_q, topk=200, ps=61, pages=4, lengths=False,
                       sink=False)
    kw = gpu_kwargs(p)
    out, lse = sm.sparse_decode(kw.pop("q"), kw.pop("k_cache"), kw.pop("indices"), **kw)
    assert out.device.type == "cuda"
    assert_close(out, lse, *reference_of(p))


@pytest.mark.parametrize("h_q", [16, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_mla_dense_on_gpu(h_q, causal):
    rng = np.random.default_rng(300 + h_q)
    cache = new_cache(BF16, 8, 64)
    # Spec section 7 conditions: cache values ~N(0, 0.1^2) clipped, softmax scale d_qk^-0.55.
    rows = random_rows(rng, cache.buf.size // 576, 576)
    cache.buf.view(np.uint16)[...] = f32_to_bf16_bits(rows).reshape(cache.buf.shape)
    bt = np.array([[7, 0, 3], [1, 5, 2]], np.int32)
    seqlens = np.array([150, 9], np.int32)
    q = random_q(rng, (2, 2, h_q, 576))
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(t_bf16(q, DEV), t_cache(cache, DEV),
                                                t(bt, DEV), t(seqlens, DEV), 512, meta,
                                                softmax_scale=sm_scale(576), causal=causal)
    assert lse.is_contiguous()
    assert_close(out, lse, *dense_decode_ref(bf16_bits_to_f64(q), cache, bt, seqlens,
                                             causal=causal, softmax_scale=sm_scale(576)),
                 dense=True)


def test_runs_on_the_current_torch_stream():
    p = sparse_problem(400, b=2, s_q=1, h_q=16, topk=64, ps=64, pages=3)
    kw = gpu_kwargs(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = kw.pop("q")
        out, lse = sm.sparse_decode(q, kw.pop("k_cache"), kw.pop("indices"), **kw)
    side.synchronize()
    assert_close(out, lse, *reference_of(p))


def test_explicit_stream_allocates_the_calls_arrays_on_it(monkeypatch):
    # What a call with stream= allocates (results, its own plan and scratch, a merge's stacked
    # parts) belongs to that stream, so torch's caching allocator reuses a freed temporary only
    # after the call's kernels there, not for work on the current stream meanwhile.
    p = sparse_problem(410, b=2, s_q=2, h_q=64, topk=128, ps=64, pages=4, extra=(64, 2, 60))
    kw = gpu_kwargs(p)
    q, k_cache, indices = kw.pop("q"), kw.pop("k_cache"), kw.pop("indices")
    rng = np.random.default_rng(411)
    parts = [torch.tensor(rng.normal(size=(2, 2, 8, 512)), dtype=torch.float32, device=DEV)
             for _ in range(3)]
    lses = [torch.tensor(rng.normal(size=(2, 2, 8)), dtype=torch.float32, device=DEV)
            for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen = []

    def recording(real):
        def call(*args, **kwargs):
            seen.append(torch.cuda.current_stream().cuda_stream)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "empty", recording(torch.empty))
    monkeypatch.setattr(torch, "stack", recording(torch.stack))
    out, lse = sm.sparse_decode(q, k_cache, indices, **kw, stream=side)
    merged, merged_lse = sm.merge_attention(parts, lses, stream=side)
    monkeypatch.undo()
    side.synchronize()
    assert len(seen) >= 7  # out, lse, plan, scratch; two stacks, merged out and lse
    assert set(seen) == {side.cuda_stream}
    assert_close(out, lse, *reference_of(p))
    ref_out, ref_lse = merge_ref(torch.stack(parts).cpu().numpy(),
                                 torch.stack(lses).cpu().numpy())
    np.testing.assert_allclose(merged.cpu().numpy(), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(merged_lse.cpu().numpy(), ref_lse, rtol=1e-5, atol=1e-6)


def test_cuda_graph_captures_planning_and_layers():
    layers = 3
    p = sparse_problem(500, b=2, s_q=2, h_q=64, topk=96, ps=64, pages=4, extra=(40, 2, 60))
    kw = gpu_kwargs(p)
    rng = np.random.default_rng(501)
    qs = [t_bf16(random_q(rng, (2, 2, 64, 512)), DEV) for _ in range(layers)]

    def step():
        meta, _ = flash_mla.get_mla_metadata()  # one plan per step, reused by every layer
        results = []
        for q in qs:
            results.append(flash_mla.flash_mla_with_kvcache(
                q, kw["k_cache"], None, None, 512, meta, is_fp8_kvcache=True,
                indices=kw["indices"], attn_sink=kw["attn_sink"],
                extra_k_cache=kw["extra_k_cache"], extra_indices_in_kvcache=kw["extra_indices"],
                topk_length=kw["topk_length"], extra_topk_length=kw["extra_topk_length"]))
        return results

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()

    for trial in range(2):
        # new lengths and indices, written in place into the captured inputs
        fresh = sparse_problem(510 + trial, b=2, s_q=2, h_q=64, topk=96, ps=64, pages=4,
                               extra=(40, 2, 60))
        p["topk_length"] = fresh["topk_length"]
        p["extra_topk_length"] = fresh["extra_topk_length"]
        p["indices"] = np.where(rng.random(p["indices"].shape) < 0.5, p["indices"], -1).astype(
            np.int32)
        kw["topk_length"].copy_(t(p["topk_length"], DEV))
        kw["extra_topk_length"].copy_(t(p["extra_topk_length"], DEV))
        kw["indices"].copy_(t(p["indices"], DEV))
        graph.replay()
        torch.cuda.synchronize()
        for q, (out, lse) in zip(qs, results):
            p_layer = dict(p, q=q.cpu().view(torch.int16).numpy().view(np.uint16))
            assert_close(out, lse, *reference_of(p_layer))


def test_cuda_graph_with_the_native_plan_run_split():
    p = sparse_problem(600, b=3, s_q=1, h_q=16, topk=64, ps=64, pages=4)
    kw = gpu_kwargs(p)
    q, cache, idx = kw.pop("q"), kw.pop("k_cache"), kw.pop("indices")
    sizes = sm.sparse_decode_workspace_size(q, cache, idx, **kw)
    ws = sm.Workspace(torch.empty(sizes.plan_bytes, dtype=torch.uint8, device=DEV),
                      torch.empty(sizes.scratch_bytes, dtype=torch.uint8, device=DEV))
    out = torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(3, 16, 1, device=DEV)
    sm.sparse_decode_plan(q, cache, idx, workspace=ws, **kw)  # warm-up outside the graph
    sm.sparse_decode(q, cache, idx, workspace=ws, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm.sparse_decode_plan(q, cache, idx, workspace=ws, **kw)
        sm.sparse_decode(q, cache, idx, workspace=ws, out=out, lse=lse, **kw)
    new_lengths = np.array([64, 0, 17], np.int32)
    kw["topk_length"].copy_(t(new_lengths, DEV))
    p["topk_length"] = new_lengths
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, lse, *reference_of(p))


def test_workspace_on_another_device_is_refused():
    # The library sees only the workspace's pointers: a host buffer with CUDA arrays would fault
    # in the kernels, so the extension checks where the buffers live.
    p = sparse_problem(610, b=2, s_q=1, h_q=16, topk=64, ps=64, pages=4)
    kw = gpu_kwargs(p)
    q, cache, idx = kw.pop("q"), kw.pop("k_cache"), kw.pop("indices")
    sizes = sm.sparse_decode_workspace_size(q, cache, idx, **kw)
    on_device = torch.empty(sizes.scratch_bytes, dtype=torch.uint8, device=DEV)
    refused = r"plan: on cpu, expected cuda:0 \(the device of q\)"
    for host_plan in (torch.empty(sizes.plan_bytes, dtype=torch.uint8),
                      np.empty(sizes.plan_bytes, np.uint8)):
        ws = sm.Workspace(host_plan, on_device)
        for call in (sm.sparse_decode_plan, sm.sparse_decode):
            with pytest.raises(ValueError, match=refused):
                call(q, cache, idx, workspace=ws, **kw)


def test_torch_compile_on_gpu():
    p = sparse_problem(700, b=2, s_q=2, h_q=16, topk=64, ps=64, pages=3)
    kw = gpu_kwargs(p)

    def f(q, k_cache, indices, topk_length, attn_sink):
        out, lse = sm.sparse_decode(q, k_cache, indices, topk_length=topk_length,
                                    attn_sink=attn_sink)
        return out, lse

    out, lse = torch.compile(f, fullgraph=True)(kw["q"], kw["k_cache"], kw["indices"],
                                                kw["topk_length"], kw["attn_sink"])
    assert_close(out, lse, *reference_of(p))


def test_gpu_kv_tools_match_the_cpu():
    rng = np.random.default_rng(800)
    rows = torch.from_numpy(np.clip(rng.normal(0, 0.1, (50, 512)), -1, 1).astype(np.float32))
    slots = torch.from_numpy(rng.choice(4 * 64, 50, replace=False).astype(np.int32))
    stride = 64 * 584 + 64  # padded pages
    cpu_pages = torch.zeros(4, stride, dtype=torch.uint8)
    gpu_pages = cpu_pages.to(DEV)
    cpu_cache = cpu_pages.as_strided((4, 64, 1, 584), (stride, 584, 584, 1))
    gpu_cache = gpu_pages.as_strided((4, 64, 1, 584), (stride, 584, 584, 1))
    sm.quantize_store(rows, slots, cpu_cache)
    sm.quantize_store(rows.to(DEV), slots.to(DEV), gpu_cache)
    torch.cuda.synchronize()
    assert torch.equal(gpu_pages.cpu(), cpu_pages)
    assert torch.equal(sm.dequantize(gpu_cache, slots.to(DEV)).cpu(),
                       sm.dequantize(cpu_cache, slots))
