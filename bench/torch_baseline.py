#!/usr/bin/env python3
"""PyTorch baseline of `sparse-mla bench --torch`: what a user writes without sparse-mla.

Gather the referenced cache rows, dequantize them (FP8 * power-of-two or fp32 scales), then
matmul, softmax, matmul in float32, on the same inputs as the library (the bench writes them to
files). Timing: CUDA events around the whole function, L2 flushed before each run (a write of 2x
the L2 size), median over the runs; on the CPU time.perf_counter.

Modes:
  --serve --device DEV     the bench's child process: reads "RUN <manifest>" lines on stdin,
                           answers "OK\\t<times in us, comma-separated>" or "ERROR\\t<why>" on
                           stdout and writes the outputs the manifest names.
  --case MANIFEST          runs one case written by the bench and prints the median time.
Manifest: one "key value" per line (shapes, page layout, paths of raw little-endian arrays);
see tools/bench_torch.cpp, which writes it.
"""

import argparse
import statistics
import sys
import time
import traceback

import numpy as np
import torch

MODEL1_ROW, MODEL1_NOPE, MODEL1_TILE = 576, 448, 64
V32_ROW, V32_NOPE, V32_TILE = 656, 512, 128
D_V = 512


def read_manifest(path):
    m = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.strip().partition(" ")
            if key:
                m[key] = value
    return m


def load(path, dtype, shape, device):
    """A raw file as a tensor; bf16 travels as int16 bits."""
    np_dtype = {torch.int32: np.int32, torch.float32: np.float32, torch.uint8: np.uint8,
                torch.bfloat16: np.int16}[dtype]
    arr = np.fromfile(path, dtype=np_dtype)
    t = torch.from_numpy(arr)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(shape).to(device)


class Cache:
    """A paged cache as a flat byte tensor plus its page geometry."""

    def __init__(self, m, key, device):
        self.pages = int(m[key + "_pages"])
        self.page_size = int(m[key + "_page_size"])
        self.page_stride = int(m[key + "_page_stride"])
        self.heads = int(m[key + "_heads"])
        self.bytes = load(m[key], torch.uint8, (self.pages * self.page_stride,), device)

    def rows(self, width, offset=0, row_bytes=None):
        """[pages, page_size, width] byte view of the rows (row_bytes apart) starting at offset."""
        return self.bytes.as_strided((self.pages, self.page_size, width),
                                     (self.page_stride, row_bytes or width, 1), offset)


def e4m3_to_float(codes):
    """e4m3 bytes to float32: the native dtype where torch has it (2.1+), else a 256-entry table."""
    if hasattr(torch, "float8_e4m3fn"):
        return codes.contiguous().view(torch.float8_e4m3fn).float()
    c = torch.arange(256, dtype=torch.float64)
    sign = torch.where(c >= 128, -1.0, 1.0)
    exp, man = (c.long() >> 3) & 15, c.long() & 7
    val = torch.where(exp == 0, man * 2.0 ** -9, (1 + man / 8.0) * torch.pow(2.0, exp - 7.0))
    val = torch.where((exp == 15) & (man == 7), torch.tensor(float("nan"), dtype=torch.float64), val)
    table = (sign * val).float().to(codes.device)
    return table[codes.long()]


def gather_fp8(cache, fmt, slots):
    """Dequantized float32 rows [*, d_qk] of the slots (invalid slots give zero rows) and the
    validity mask."""
    valid = (slots >= 0) & (slots < cache.pages * cache.page_size)
    s = torch.where(valid, slots, torch.zeros_like(slots)).long()
    page, off = s // cache.page_size, s % cache.page_size
    if fmt == "MODEL1":
        row = cache.rows(MODEL1_ROW)[page, off]
        scale_bytes = cache.rows(8, cache.page_size * MODEL1_ROW)[page, off][..., :7]
        nope = e4m3_to_float(row[..., :MODEL1_NOPE])
        scales = torch.exp2(scale_bytes.float() - 127.0)
        nope = (nope.unflatten(-1, (7, MODEL1_TILE)) * scales.unsqueeze(-1)).flatten(-2)
        rope = row[..., MODEL1_NOPE:].contiguous().view(torch.bfloat16).float()
    else:
        row = cache.rows(V32_ROW)[page, off]
        nope = e4m3_to_float(row[..., :V32_NOPE])
        scales = row[..., V32_NOPE:V32_NOPE + 16].contiguous().view(torch.float32)
        nope = (nope.unflatten(-1, (4, V32_TILE)) * scales.unsqueeze(-1)).flatten(-2)
        rope = row[..., V32_NOPE + 16:].contiguous().view(torch.bfloat16).float()
    k = torch.cat([nope, rope], dim=-1)
    return torch.where(valid.unsqueeze(-1), k, torch.zeros_like(k)), valid


def gather_dense(cache, fmt, slots):
    """Rows [*, h_kv, 576] as float32 for bf16 pages; FP8 pages through gather_fp8 (h_kv = 1)."""
    if fmt in ("MODEL1", "V32"):
        k, valid = gather_fp8(cache, fmt, slots)
        return k.unsqueeze(-2), valid
    valid = (slots >= 0) & (slots < cache.pages * cache.page_size)
    s = torch.where(valid, slots, torch.zeros_like(slots)).long()
    page, off = s // cache.page_size, s % cache.page_size
    width = cache.heads * 576
    rows = cache.rows(width * 2)[page, off].contiguous()
    k = rows.view(torch.bfloat16 if fmt == "BF16" else torch.float16).float()
    k = k.unflatten(-1, (cache.heads, 576))
    return torch.where(valid[..., None, None], k, torch.zeros_like(k)), valid


def attend(q, k, mask, scale, sink=None, shared=False):
    """q [b, s, h, d]; k [b, s, t, g, d] per query token, or [b, t, g, d] shared by the query
    tokens (dense decode), g kv heads; mask [b, s, t]. Returns out [b, s, h, 512] float32 and
    lse [b, s, h] (natural log, +inf when nothing is attended)."""
    b, s, h, d = q.shape
    g = k.shape[-2]
    qg = q.float().reshape(b, s, g, h // g, d)
    kt = "btgd" if shared else "bstgd"
    logits = torch.einsum(f"bsgqd,{kt}->bsgqt", qg, k[..., :d]) * scale
    logits = logits.masked_fill(~mask[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    vt = "btgv" if shared else "bstgv"
    out = torch.einsum(f"bsgqt,{vt}->bsgqv", p, k[..., :D_V]).reshape(b, s, h, D_V)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse).reshape(b, s, h)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)  # 1 / (1 + exp(sink - lse))
    return out, lse


def sparse_fn(m, device):
    b, s_q, h_q, d_qk = (int(m[k]) for k in ("b", "s_q", "h_q", "d_qk"))
    fmt, scale = m["format"], float(m["scale"])
    q = load(m["q"], torch.bfloat16, (b, s_q, h_q, d_qk), device)
    kv = Cache(m, "kv", device)
    idx = load(m["indices"], torch.int32, (b, s_q, int(m["topk"])), device)
    extra = None
    if "extra_kv" in m:
        etopk = int(m["extra_topk"])
        ekv = Cache(m, "extra_kv", device)
        eidx = load(m["extra_indices"], torch.int32, (b, s_q, etopk), device)
        elen = (load(m["extra_topk_length"], torch.int32, (b,), device)
                if "extra_topk_length" in m else None)
        extra = (ekv, eidx, elen, etopk)
    sink = load(m["attn_sink"], torch.float32, (h_q,), device) if "attn_sink" in m else None

    def run():
        k, valid = gather_fp8(kv, fmt, idx)
        if extra is not None:
            ekv, eidx, elen, etopk = extra
            ek, evalid = gather_fp8(ekv, fmt, eidx)
            if elen is not None:
                pos = torch.arange(etopk, device=eidx.device)
                evalid = evalid & (pos[None, None, :] < elen.clamp(0, etopk)[:, None, None])
            k, valid = torch.cat([k, ek], dim=2), torch.cat([valid, evalid], dim=2)
            # Rows past the lengths may hold NaN: zero them, or 0 * NaN poisons P @ V.
            k = torch.where(valid.unsqueeze(-1), k, torch.zeros_like(k))
        out, lse = attend(q, k.unsqueeze(3), valid, scale, sink)
        return out.to(torch.bfloat16), lse.permute(0, 2, 1).contiguous()

    return run


def dense_fn(m, device):
    b, s_q, h_q, d_qk = (int(m[k]) for k in ("b", "s_q", "h_q", "d_qk"))
    fmt, scale, causal = m["format"], float(m["scale"]), m["causal"] == "1"
    q = load(m["q"], torch.bfloat16, (b, s_q, h_q, d_qk), device)
    kv = Cache(m, "kv", device)
    table = load(m["block_table"], torch.int32, (b, int(m["max_pages"])), device).long()
    seqlens = load(m["cache_seqlens"], torch.int32, (b,), device).long()
    limit = table.shape[1] * kv.page_size
    seqlens = seqlens.clamp(0, limit)
    length = max(int(seqlens.max().item()), 1)
    t = torch.arange(length, device=q.device)
    page = table[:, (t // kv.page_size).clamp(max=table.shape[1] - 1)]
    page_ok = (page >= 0) & (page < kv.pages)
    # Tokens past a request's length read as -1 (zero rows): their slots may hold NaN.
    used = page_ok & (t[None, :] < seqlens[:, None])
    slots = torch.where(used, page * kv.page_size + t % kv.page_size, torch.full_like(page, -1))
    s = torch.arange(s_q, device=q.device)
    # Causal: query token s sees t <= seqlen - s_q + s.
    end = seqlens[:, None] - s_q + s[None, :] + 1 if causal else seqlens[:, None].expand(b, s_q)
    mask = (t[None, None, :] < end[:, :, None]) & (t[None, None, :] < seqlens[:, None, None])
    mask = mask & page_ok[:, None, :]

    def run():
        k, _ = gather_dense(kv, fmt, slots)  # [b, t, g, d]
        out, lse = attend(q, k, mask, scale, shared=True)
        return out.to(torch.bfloat16), lse.permute(0, 2, 1).contiguous()

    return run


def time_fn(fn, runs, warmup, device):
    times = []
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
        flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        for _ in range(warmup):
            flush.zero_()
            fn()
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(runs)]
        for start, stop in events:
            flush.zero_()
            start.record()
            fn()
            stop.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(stop) * 1e3 for start, stop in events]
    else:
        for _ in range(warmup):
            fn()
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def run_case(path, device):
    m = read_manifest(path)
    fn = (sparse_fn if m["op"] == "sparse" else dense_fn)(m, device)
    with torch.no_grad():
        out, lse = fn()  # the result the bench checks
        out.view(torch.int16).cpu().numpy().tofile(m["out"])
        lse.float().cpu().numpy().tofile(m["lse"])
        times = time_fn(fn, int(m["runs"]), int(m["warmup"]), device)
    return times


def describe(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"torch {torch.__version__} on {device} ({name}), float32 math"


def serve(device):
    print("OK\t" + describe(device), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "QUIT":
            break
        try:
            times = run_case(arg, device)
            print("OK\t" + ",".join(f"{t:.3f}" for t in times), flush=True)
        except Exception as e:  # report and keep serving: one case may not fit in memory
            traceback.print_exc(file=sys.stderr)
            print(f"ERROR\t{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--case")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        if args.serve:
            print("ERROR\tno CUDA device visible to torch", flush=True)
            return 1
        sys.exit("no CUDA device visible to torch")
    if args.serve:
        serve(device)
        return 0
    if not args.case:
        ap.error("give --serve or --case MANIFEST")
    times = run_case(args.case, device)
    print(f"{describe(device)}: median {statistics.median(times):.1f} us over {len(times)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
