#include "tools/bench_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

#include "reference/compare.h"
#include "reference/reference.h"
#include "src/kv/format.h"

namespace sparse_mla::tools::bench {

namespace {

using ref::HostCache;
using ref::HostTensor;
using ref::Rng;

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A latent row: N(0, 0.1^2) clipped to [-1, 1] (spec section 7), like ref::random_row but with
// both Box-Muller outputs used, in float: building inputs of the large cases is dominated by it.
void latent_row(Rng& rng, int d, float* v) {
  for (int i = 0; i < d; i += 2) {
    const float u = static_cast<float>(1.0 - rng.uniform());  // (0, 1]: the log stays finite
    const float r = 0.1f * std::sqrt(-2.0f * std::log(u));
    const float a = static_cast<float>(6.283185307179586 * rng.uniform());
    v[i] = std::clamp(r * std::cos(a), -1.0f, 1.0f);
    if (i + 1 < d) v[i + 1] = std::clamp(r * std::sin(a), -1.0f, 1.0f);
  }
}

// Writes a random latent row into each listed slot with the reference quantizer. Each slot's
// values depend only on (seed, slot), so the parallel fill is deterministic.
void fill_slots(HostCache& cache, const std::vector<int64_t>& slots, uint64_t seed,
                const std::function<void(double)>& progress, double p0, double p1) {
  const int d = cache.d_qk();
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t heads = cache.config().num_heads;
  const int64_t chunk = 4096;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = std::min(n, start + chunk);
#pragma omp parallel for schedule(static)
    for (int64_t i = start; i < end; ++i) {
      std::vector<float> row(static_cast<size_t>(d));
      for (int64_t h = 0; h < heads; ++h) {
        Rng rng(mix(seed, static_cast<uint64_t>(slots[static_cast<size_t>(i)]) * 131 + h));
        latent_row(rng, d, row.data());
        ref::write_row(cache, slots[static_cast<size_t>(i)], h, row.data());
      }
    }
    if (progress) progress(p0 + (p1 - p0) * static_cast<double>(end) / static_cast<double>(n));
  }
}

std::vector<int64_t> marked(const std::vector<bool>& which) {
  std::vector<int64_t> out;
  for (size_t s = 0; s < which.size(); ++s) {
    if (which[s]) out.push_back(static_cast<int64_t>(s));
  }
  return out;
}

// bf16 values uniform in [-1, 1), filled in parallel, deterministic per element block.
void fill_uniform_bf16(HostTensor& t, uint64_t seed) {
  auto* p = static_cast<uint16_t*>(t.data());
  const int64_t n = t.numel();  // contiguous tensors only
  const int64_t block = 1 << 14;
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    Rng rng(mix(seed, static_cast<uint64_t>(b0)));
    const int64_t e = std::min(n, b0 + block);
    for (int64_t i = b0; i < e; ++i) {
      p[i] = fmt::float_to_bf16(static_cast<float>(rng.uniform(-1.0, 1.0)));
    }
  }
}

// Distinct random values in [lo, lo + n), k of them (k <= n), in random order.
void distinct_sample(Rng& rng, int64_t lo, int64_t n, int64_t k, int32_t* out,
                     std::vector<int64_t>& scratch) {
  if (k * 32 >= n) {  // dense draw: partial Fisher-Yates over the whole range
    scratch.resize(static_cast<size_t>(n));
    std::iota(scratch.begin(), scratch.end(), 0);
    for (int64_t i = 0; i < k; ++i) {
      std::swap(scratch[static_cast<size_t>(i)],
                scratch[static_cast<size_t>(rng.between(i, n - 1))]);
      out[i] = static_cast<int32_t>(lo + scratch[static_cast<size_t>(i)]);
    }
    return;
  }
  scratch.clear();  // sparse draw: rejection against the values taken so far
  for (int64_t i = 0; i < k;) {
    int64_t v = rng.below(n);
    if (std::find(scratch.begin(), scratch.end(), v) != scratch.end()) continue;
    scratch.push_back(v);
    out[i++] = static_cast<int32_t>(lo + v);
  }
}

// k distinct values in [lo, lo + n): first[0, k) with k - shared of its places, chosen at random,
// given new values, so that every prefix of the list (what a length limit leaves attended)
// shares ~shared / k of first's prefix of the same length. The new values avoid all of first
// where the range leaves room, else only the values kept.
void shared_sample(Rng& rng, int64_t lo, int64_t n, int64_t k, const int32_t* first, int64_t shared,
                   int32_t* out, std::vector<int64_t>& places, std::vector<char>& taken) {
  std::copy(first, first + k, out);
  places.resize(static_cast<size_t>(k));
  std::iota(places.begin(), places.end(), 0);
  const int64_t fresh = k - shared;
  for (int64_t i = 0; i < fresh; ++i) {
    std::swap(places[static_cast<size_t>(i)], places[static_cast<size_t>(rng.between(i, k - 1))]);
  }
  taken.assign(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < k; ++i) taken[static_cast<size_t>(first[i] - lo)] = 1;
  if (n - k < fresh) {  // too few slots outside first: only the kept values are off limits
    for (int64_t i = 0; i < fresh; ++i) {
      taken[static_cast<size_t>(first[places[static_cast<size_t>(i)]] - lo)] = 0;
    }
  }
  for (int64_t i = 0; i < fresh;) {
    const int64_t v = rng.below(n);
    if (taken[static_cast<size_t>(v)]) continue;
    taken[static_cast<size_t>(v)] = 1;
    out[places[static_cast<size_t>(i++)]] = static_cast<int32_t>(lo + v);
  }
}

// Indices of request i's query tokens into `list` (s_q lists of k): token 0 draws k distinct slots
// of [lo, lo + n); later tokens share c.mtp_shared of token 0's, if any.
void sample_request(const Case& c, Rng& rng, int64_t lo, int64_t n, int64_t k, int64_t s_q,
                    int32_t* list, std::vector<int64_t>& scratch, std::vector<char>& taken) {
  const auto shared = static_cast<int64_t>(std::llround(c.mtp_shared * static_cast<double>(k)));
  for (int64_t s = 0; s < s_q; ++s) {
    if (s > 0 && shared > 0) {
      shared_sample(rng, lo, n, k, list, shared, list + s * k, scratch, taken);
    } else {
      distinct_sample(rng, lo, n, k, list + s * k, scratch);
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

double cache_row_bytes(KVFormat f, int64_t h_kv) {
  switch (f) {
    case KVFormat::kModel1:
      return 576;  // targets.md counts the row, not the 8-byte footer
    case KVFormat::kV32:
      return 656;
    default:
      return 2.0 * 576 * static_cast<double>(h_kv);
  }
}

// ---- Sparse decode ----
Status build_sparse(const Case& c, Inputs* in, const std::function<void(double)>& progress) {
  Rng rng(c.seed);
  const int64_t b = c.b, s_q = c.s_q;
  std::vector<int64_t> ctx(static_cast<size_t>(b));
  for (auto& v : ctx) {
    const double f = 1.0 + c.context_jitter * rng.uniform(-1.0, 1.0);
    v = std::max<int64_t>(c.topk, static_cast<int64_t>(std::llround(c.context * f)));
  }
  // Main cache: request i owns pages [page0[i], page0[i] + ceil(ctx_i / page_size)).
  std::vector<int64_t> page0(static_cast<size_t>(b) + 1, 0);
  for (int64_t i = 0; i < b; ++i) page0[i + 1] = page0[i] + ceil_div(ctx[i], c.page_size);
  ref::CacheConfig cc;
  cc.format = c.format;
  cc.page_size = c.page_size;
  cc.num_pages = page0[b];
  in->kv = HostCache(cc);

  in->indices = ref::make_tensor(DType::kInt32, {b, s_q, c.topk});
  auto* idx = static_cast<int32_t*>(in->indices.data());
  std::vector<int64_t> scratch;
  std::vector<char> taken;
  for (int64_t i = 0; i < b; ++i) {
    sample_request(c, rng, page0[i] * c.page_size, ctx[i], c.topk, s_q, idx + i * s_q * c.topk,
                   scratch, taken);
  }
  std::vector<int64_t> extra_entries;
  if (c.extra_topk > 0) {
    std::vector<int64_t> epage0(static_cast<size_t>(b) + 1, 0);
    extra_entries.resize(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      extra_entries[i] = std::max(ctx[i] / c.extra_ratio, c.extra_topk);
      epage0[i + 1] = epage0[i] + ceil_div(extra_entries[i], c.extra_page_size);
    }
    ref::CacheConfig ec = cc;
    ec.page_size = c.extra_page_size;
    ec.num_pages = epage0[b];
    in->extra_kv = HostCache(ec);
    in->extra_indices = ref::make_tensor(DType::kInt32, {b, s_q, c.extra_topk});
    auto* eidx = static_cast<int32_t*>(in->extra_indices.data());
    for (int64_t i = 0; i < b; ++i) {
      sample_request(c, rng, epage0[i] * c.extra_page_size, extra_entries[i], c.extra_topk, s_q,
                     eidx + i * s_q * c.extra_topk, scratch, taken);
    }
    if (c.extra_random_length) {
      in->extra_topk_length = ref::make_tensor(DType::kInt32, {b});
      auto* len = static_cast<int32_t*>(in->extra_topk_length.data());
      // Stratified over [1, extra_topk], then shuffled: uniform lengths whose mean does not drift
      // with the seed, so the FLOP count matches the shape's nominal work at every batch size.
      for (int64_t i = 0; i < b; ++i) {
        const double u = (static_cast<double>(i) + rng.uniform()) / static_cast<double>(b);
        len[i] = static_cast<int32_t>(
            1 + std::min<int64_t>(c.extra_topk - 1, static_cast<int64_t>(u * c.extra_topk)));
      }
      for (int64_t i = b - 1; i > 0; --i) std::swap(len[i], len[rng.between(0, i)]);
    }
  }
  if (c.sink) {
    in->attn_sink = ref::make_tensor(DType::kFloat32, {c.h_q});
    auto* sink = static_cast<float*>(in->attn_sink.data());
    for (int64_t h = 0; h < c.h_q; ++h) sink[h] = static_cast<float>(rng.normal());
  }
  const int d_qk = kv_format_d_qk(c.format);
  in->q = ref::make_tensor(DType::kBFloat16, {b, s_q, c.h_q, d_qk});
  fill_uniform_bf16(in->q, mix(c.seed, 7));
  in->softmax_scale = static_cast<float>(std::pow(static_cast<double>(d_qk), -0.55));
  if (progress) progress(0.1);

  // Only referenced slots get data; every other byte stays NaN (0xFF), as in the tests.
  auto main_ref =
      ref::sparse_referenced_slots(in->indices.view(), std::nullopt, in->kv.num_slots());
  const double p_mid = c.extra_topk > 0 ? 0.6 : 1.0;
  fill_slots(in->kv, marked(main_ref), mix(c.seed, 11), progress, 0.1, p_mid);
  std::vector<bool> extra_ref;
  if (c.extra_topk > 0) {
    extra_ref = ref::sparse_referenced_slots(
        in->extra_indices.view(), in->extra_topk_length.opt_view(), in->extra_kv.num_slots());
    fill_slots(in->extra_kv, marked(extra_ref), mix(c.seed, 13), progress, p_mid, 1.0);
  }

  // Work: attended tokens per (request, query token) and distinct slots per request.
  double attended = 0, distinct = 0;
  const auto* eidx =
      c.extra_topk > 0 ? static_cast<const int32_t*>(in->extra_indices.data()) : nullptr;
  const auto* elen = in->extra_topk_length.defined()
                         ? static_cast<const int32_t*>(in->extra_topk_length.data())
                         : nullptr;
  std::vector<int32_t> seen;
  for (int64_t i = 0; i < b; ++i) {
    seen.assign(idx + i * s_q * c.topk, idx + (i + 1) * s_q * c.topk);
    std::sort(seen.begin(), seen.end());
    distinct += static_cast<double>(std::unique(seen.begin(), seen.end()) - seen.begin());
    attended += static_cast<double>(s_q * c.topk);
    if (eidx) {
      const int64_t len = elen ? std::clamp<int64_t>(elen[i], 0, c.extra_topk) : c.extra_topk;
      seen.clear();
      for (int64_t s = 0; s < s_q; ++s) {
        const int32_t* row = eidx + (i * s_q + s) * c.extra_topk;
        seen.insert(seen.end(), row, row + len);
      }
      std::sort(seen.begin(), seen.end());
      distinct += static_cast<double>(std::unique(seen.begin(), seen.end()) - seen.begin());
      attended += static_cast<double>(s_q * len);
    }
  }
  const double qo = static_cast<double>(b * s_q * c.h_q) * (d_qk + kDV) * 2.0;
  in->work.flops = 2.0 * static_cast<double>(c.h_q) * attended * (d_qk + kDV);
  in->work.bytes = qo + distinct * cache_row_bytes(c.format, 1);
  in->work.attended_per_query = attended / static_cast<double>(b * s_q);
  return Status::Ok();
}

// ---- Dense decode ----
Status build_dense(const Case& c, Inputs* in, const std::function<void(double)>& progress) {
  Rng rng(c.seed);
  const int64_t b = c.b, s_q = c.s_q;
  std::vector<int32_t> lens(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    lens[i] = static_cast<int32_t>(c.seqlens.empty() ? c.context : c.seqlens[i % c.seqlens.size()]);
  }
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const int64_t max_pages = std::max<int64_t>(1, ceil_div(max_len, c.page_size));
  ref::CacheConfig cc;
  cc.format = c.format;
  cc.page_size = c.page_size;
  cc.num_heads = kv_format_is_fp8(c.format) ? 1 : c.h_kv;
  cc.num_pages = b * max_pages;
  in->kv = HostCache(cc);
  in->block_table = ref::random_block_table(rng, b, max_pages, cc.num_pages);
  in->cache_seqlens = ref::make_int_tensor(lens);
  const int d_qk = kv_format_d_qk(c.format);
  in->q = ref::make_tensor(DType::kBFloat16, {b, s_q, c.h_q, d_qk});
  fill_uniform_bf16(in->q, mix(c.seed, 7));
  in->softmax_scale = static_cast<float>(std::pow(static_cast<double>(d_qk), -0.55));
  if (progress) progress(0.05);
  auto referenced = ref::dense_referenced_slots(in->block_table.view(), in->cache_seqlens.view(),
                                                c.page_size, cc.num_pages);
  fill_slots(in->kv, marked(referenced), mix(c.seed, 11), progress, 0.05, 1.0);

  double attended = 0, distinct = 0;
  for (int64_t i = 0; i < b; ++i) {
    distinct += lens[i];
    for (int64_t s = 0; s < s_q; ++s) {
      attended += c.causal ? std::max<int64_t>(0, lens[i] - s_q + s + 1) : lens[i];
    }
  }
  const double qo = static_cast<double>(b * s_q * c.h_q) * (d_qk + kDV) * 2.0;
  in->work.flops = 2.0 * static_cast<double>(c.h_q) * attended * (d_qk + kDV);
  in->work.bytes = qo + distinct * cache_row_bytes(c.format, cc.num_heads);
  in->work.attended_per_query = attended / static_cast<double>(b * s_q);
  return Status::Ok();
}

// ---- KV kernels ----
Status build_store(const Case& c, Inputs* in) {
  Rng rng(c.seed);
  const int64_t n = c.tokens;
  const int d_qk = kv_format_d_qk(c.format);
  ref::CacheConfig cc;
  cc.format = c.format;
  cc.page_size = c.page_size;
  cc.num_pages = ceil_div(c.consecutive_slots ? n : 2 * n, c.page_size);
  in->dst_config = cc;
  in->slots = ref::make_tensor(DType::kInt32, {n});
  auto* slots = static_cast<int32_t*>(in->slots.data());
  if (c.consecutive_slots) {
    std::iota(slots, slots + n, 0);
  } else {
    std::vector<int64_t> scratch;
    distinct_sample(rng, 0, cc.num_pages * c.page_size, n, slots, scratch);
  }
  in->src = ref::make_tensor(DType::kBFloat16, {n, d_qk});
  auto* src = static_cast<uint16_t*>(in->src.data());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    std::vector<float> row(static_cast<size_t>(d_qk));
    Rng rr(mix(c.seed, static_cast<uint64_t>(r)));
    latent_row(rr, d_qk, row.data());
    for (int j = 0; j < d_qk; ++j) src[r * d_qk + j] = fmt::float_to_bf16(row[j]);
  }
  in->work.bytes = static_cast<double>(n) *
                   (d_qk * 2.0 + 4.0 + static_cast<double>(kv_format_bytes_per_token(c.format)));
  return Status::Ok();
}

Status build_repack(const Case& c, Inputs* in) {
  Rng rng(c.seed);
  const int64_t b = c.b;
  std::vector<int32_t> lens(static_cast<size_t>(b));
  for (auto& v : lens) {
    v = static_cast<int32_t>(
        std::llround(c.context * (1.0 + c.context_jitter * rng.uniform(-1, 1))));
  }
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  ref::CacheConfig sc;
  sc.format = c.format;
  sc.page_size = c.page_size;
  const int64_t src_pages = ceil_div(max_len, c.page_size);
  sc.num_pages = b * src_pages;
  ref::CacheConfig dc = sc;
  dc.page_size = c.extra_page_size;
  const int64_t dst_pages = ceil_div(max_len, c.extra_page_size);
  dc.num_pages = b * dst_pages;
  in->kv = HostCache(sc);
  in->dst_config = dc;
  in->block_table = ref::random_block_table(rng, b, src_pages, sc.num_pages);
  in->dst_block_table = ref::random_block_table(rng, b, dst_pages, dc.num_pages);
  in->cache_seqlens = ref::make_int_tensor(lens);
  // A repack copies bytes: random bytes are as good as quantized rows and much faster to make.
  auto* bytes = static_cast<uint8_t*>(in->kv.desc().data);
  const int64_t total = sc.num_pages * in->kv.desc().page_stride;
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < total; o += 8) {
    uint64_t v = mix(c.seed, static_cast<uint64_t>(o));
    std::memcpy(bytes + o, &v, static_cast<size_t>(std::min<int64_t>(8, total - o)));
  }
  double tokens = 0;
  for (int32_t l : lens) tokens += l;
  in->work.bytes = 2.0 * tokens * kv_format_bytes_per_token(c.format);
  return Status::Ok();
}

}  // namespace

Status build_inputs(const Case& c, Inputs* in, const std::function<void(double)>& progress) {
  *in = Inputs{};
  switch (c.op) {
    case OpKind::kSparseDecode:
      return build_sparse(c, in, progress);
    case OpKind::kDenseDecode:
      return build_dense(c, in, progress);
    case OpKind::kQuantizeStore:
      return build_store(c, in);
    case OpKind::kRepack:
      return build_repack(c, in);
  }
  return Status::Internal("unknown op");
}

HostOutputs make_outputs(const Case& c, const Inputs& in) {
  HostOutputs o;
  if (c.op == OpKind::kSparseDecode || c.op == OpKind::kDenseDecode) {
    o.out = ref::make_out(DType::kBFloat16, c.b, c.s_q, c.h_q);
    o.lse = ref::make_lse(c.b, c.h_q, c.s_q);
  } else {
    o.dst = ref::HostCache(in.dst_config);  // all NaN: nothing written yet
  }
  return o;
}

Status make_args(const Case& c, const Inputs& in, const HostOutputs& outs, Placer& placer,
                 OpArgs* a) {
  auto put = [&](const HostTensor& t, TensorView* v) { return placer.place(t.view(), v); };
  auto put_opt = [&](const HostTensor& t, std::optional<TensorView>* v) -> Status {
    if (!t.defined()) {
      v->reset();
      return Status::Ok();
    }
    TensorView placed;
    SPARSE_MLA_RETURN_IF_ERROR(placer.place(t.view(), &placed));
    *v = placed;
    return Status::Ok();
  };
  switch (c.op) {
    case OpKind::kSparseDecode: {
      SparseDecodeArgs& s = a->sparse;
      SPARSE_MLA_RETURN_IF_ERROR(put(in.q, &s.q));
      SPARSE_MLA_RETURN_IF_ERROR(placer.place(in.kv.desc(), &s.kv));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.indices, &s.indices));
      if (in.extra_kv.defined()) {
        KVCache e;
        SPARSE_MLA_RETURN_IF_ERROR(placer.place(in.extra_kv.desc(), &e));
        s.extra_kv = e;
        SPARSE_MLA_RETURN_IF_ERROR(put_opt(in.extra_indices, &s.extra_indices));
        SPARSE_MLA_RETURN_IF_ERROR(put_opt(in.extra_topk_length, &s.extra_topk_length));
      }
      SPARSE_MLA_RETURN_IF_ERROR(put_opt(in.attn_sink, &s.attn_sink));
      s.softmax_scale = in.softmax_scale;
      SPARSE_MLA_RETURN_IF_ERROR(put(outs.out, &s.out));
      return put(outs.lse, &s.lse);
    }
    case OpKind::kDenseDecode: {
      DenseDecodeArgs& d = a->dense;
      SPARSE_MLA_RETURN_IF_ERROR(put(in.q, &d.q));
      SPARSE_MLA_RETURN_IF_ERROR(placer.place(in.kv.desc(), &d.kv));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.block_table, &d.block_table));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.cache_seqlens, &d.cache_seqlens));
      d.causal = c.causal;
      d.softmax_scale = in.softmax_scale;
      SPARSE_MLA_RETURN_IF_ERROR(put(outs.out, &d.out));
      return put(outs.lse, &d.lse);
    }
    case OpKind::kQuantizeStore: {
      SPARSE_MLA_RETURN_IF_ERROR(put(in.src, &a->store.src));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.slots, &a->store.slots));
      return placer.place(outs.dst.desc(), &a->store.kv);
    }
    case OpKind::kRepack: {
      SPARSE_MLA_RETURN_IF_ERROR(placer.place(in.kv.desc(), &a->repack.src));
      SPARSE_MLA_RETURN_IF_ERROR(placer.place(outs.dst.desc(), &a->repack.dst));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.block_table, &a->repack.src_block_table));
      SPARSE_MLA_RETURN_IF_ERROR(put(in.dst_block_table, &a->repack.dst_block_table));
      return put(in.cache_seqlens, &a->repack.seqlens);
    }
  }
  return Status::Internal("unknown op");
}

Status workspace_size(const Case& c, const OpArgs& a, const Options& o, WorkspaceSizes* sizes) {
  *sizes = WorkspaceSizes{};
  if (c.op == OpKind::kSparseDecode) return sparse_decode_workspace_size(a.sparse, o, sizes);
  if (c.op == OpKind::kDenseDecode) return dense_decode_workspace_size(a.dense, o, sizes);
  return Status::Ok();
}

Status plan_op(const Case& c, const OpArgs& a, const Workspace& ws, const Options& o) {
  if (c.op == OpKind::kSparseDecode) return sparse_decode_plan(a.sparse, ws, o);
  if (c.op == OpKind::kDenseDecode) return dense_decode_plan(a.dense, ws, o);
  return Status::Ok();
}

Status run_op(const Case& c, const OpArgs& a, const Workspace& ws, const Options& o) {
  switch (c.op) {
    case OpKind::kSparseDecode:
      return sparse_decode(a.sparse, ws, o);
    case OpKind::kDenseDecode:
      return dense_decode(a.dense, ws, o);
    case OpKind::kQuantizeStore:
      return quantize_store(a.store, o);
    case OpKind::kRepack:
      return repack_pages(a.repack, o);
  }
  return Status::Internal("unknown op");
}

}  // namespace sparse_mla::tools::bench

namespace sparse_mla::tools::bench {

namespace {

// A view of t narrowed to [start, start + len) along dim.
TensorView slice(const TensorView& t, int dim, int64_t start, int64_t len) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) +
           start * t.strides[dim] * static_cast<int64_t>(dtype_size(t.dtype));
  s.shape[dim] = len;
  return s;
}

std::optional<TensorView> slice_opt(const ref::HostTensor& t, int dim, int64_t start, int64_t len) {
  if (!t.defined()) return std::nullopt;
  return slice(t.view(), dim, start, len);
}

// The reference of one (request, head window) slice of the case.
ref::RefOutput reference_slice(const Case& c, const Inputs& in, const HostOutputs& dummy, int64_t i,
                               int64_t h0, int64_t hw) {
  if (c.op == OpKind::kSparseDecode) {
    SparseDecodeArgs a;
    a.q = slice(slice(in.q.view(), 0, i, 1), 2, h0, hw);
    a.kv = in.kv.desc();
    a.indices = slice(in.indices.view(), 0, i, 1);
    if (in.extra_kv.defined()) {
      a.extra_kv = in.extra_kv.desc();
      a.extra_indices = slice(in.extra_indices.view(), 0, i, 1);
      a.extra_topk_length = slice_opt(in.extra_topk_length, 0, i, 1);
    }
    a.attn_sink = slice_opt(in.attn_sink, 0, h0, hw);
    a.softmax_scale = in.softmax_scale;
    a.out = slice(slice(dummy.out.view(), 0, i, 1), 2, h0, hw);
    a.lse = slice(slice(dummy.lse.view(), 0, i, 1), 1, h0, hw);
    return ref::sparse_decode_reference(a);
  }
  DenseDecodeArgs a;
  a.q = slice(slice(in.q.view(), 0, i, 1), 2, h0, hw);
  a.kv = in.kv.desc();
  a.block_table = slice(in.block_table.view(), 0, i, 1);
  a.cache_seqlens = slice(in.cache_seqlens.view(), 0, i, 1);
  a.causal = c.causal;
  a.softmax_scale = in.softmax_scale;
  a.out = slice(slice(dummy.out.view(), 0, i, 1), 2, h0, hw);
  a.lse = slice(slice(dummy.lse.view(), 0, i, 1), 1, h0, hw);
  return ref::dense_decode_reference(a, ref::HeadWindow{h0, c.h_q});
}

bool all_finite_bf16(const ref::HostTensor& t) {
  const auto* p = static_cast<const uint16_t*>(t.data());
  const int64_t n = t.numel();
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad)
  for (int64_t k = 0; k < n; ++k) bad += (p[k] & 0x7f80u) == 0x7f80u;
  return bad == 0;
}

bool all_finite_f32(const ref::HostTensor& t) {
  const auto* p = static_cast<const float*>(t.data());
  const int64_t n = t.numel();
  int64_t bad = 0;
  for (int64_t k = 0; k < n; ++k) bad += !std::isfinite(p[k]);
  return bad == 0;
}

// The meaningful bytes of one token of an FP8 cache: the row, and MODEL1's 7 scale bytes.
bool same_token_bytes(const KVCache& a, int64_t slot_a, const KVCache& b, int64_t slot_b) {
  auto row = [](const KVCache& k, int64_t slot) {
    const auto* page = static_cast<const uint8_t*>(k.data) + (slot / k.page_size) * k.page_stride;
    const int64_t t = slot % k.page_size;
    return k.format == KVFormat::kModel1 ? page + fmt::model1_row_offset(t)
                                         : page + t * kV32BytesPerToken;
  };
  auto scales = [](const KVCache& k, int64_t slot) {
    const auto* page = static_cast<const uint8_t*>(k.data) + (slot / k.page_size) * k.page_stride;
    return page + fmt::model1_scale_offset(k.page_size, slot % k.page_size);
  };
  if (a.format == KVFormat::kV32)
    return !std::memcmp(row(a, slot_a), row(b, slot_b), kV32BytesPerToken);
  return !std::memcmp(row(a, slot_a), row(b, slot_b), kModel1RowBytes) &&
         !std::memcmp(scales(a, slot_a), scales(b, slot_b), 7);
}

Verdict verify_store(const Case& c, const Inputs& in, const ref::HostCache& dst) {
  ref::HostCache expect(in.dst_config);
  const int d = kv_format_d_qk(c.format);
  const auto* src = static_cast<const uint16_t*>(in.src.data());
  const auto* slots = static_cast<const int32_t*>(in.slots.data());
  std::vector<float> row(static_cast<size_t>(d));
  Verdict v;
  for (int64_t r = 0; r < c.tokens; ++r) {
    for (int j = 0; j < d; ++j) row[j] = fmt::bf16_to_float(src[r * d + j]);
    ref::write_row(expect, slots[r], 0, row.data());
    if (!same_token_bytes(expect.desc(), slots[r], dst.desc(), slots[r])) {
      v.ok = false;
      v.message = "row " + std::to_string(r) + " (slot " + std::to_string(slots[r]) +
                  "): stored bytes differ from the reference quantizer";
      return v;
    }
  }
  v.message = std::to_string(c.tokens) + " rows byte-exact";
  return v;
}

Verdict verify_repack(const Case& c, const Inputs& in, const ref::HostCache& dst) {
  const auto* lens = static_cast<const int32_t*>(in.cache_seqlens.data());
  const auto* sbt = static_cast<const int32_t*>(in.block_table.data());
  const auto* dbt = static_cast<const int32_t*>(in.dst_block_table.data());
  const int64_t sp = in.block_table.shape()[1], dp = in.dst_block_table.shape()[1];
  const int64_t sps = c.page_size, dps = c.extra_page_size;
  Verdict v;
  int64_t checked = 0;
  for (int64_t i = 0; i < c.b; ++i) {
    for (int64_t t = 0; t < lens[i]; ++t, ++checked) {
      const int64_t s_slot = sbt[i * sp + t / sps] * sps + t % sps;
      const int64_t d_slot = dbt[i * dp + t / dps] * dps + t % dps;
      if (!same_token_bytes(in.kv.desc(), s_slot, dst.desc(), d_slot)) {
        v.ok = false;
        v.message = "request " + std::to_string(i) + " token " + std::to_string(t) +
                    ": destination bytes differ from the source";
        return v;
      }
    }
  }
  v.message = std::to_string(checked) + " tokens byte-exact";
  return v;
}

}  // namespace

Status compute_expected(const Case& c, const Inputs& in, VerifyMode mode, double budget_flops,
                        Expected* expected) {
  *expected = Expected{};
  if (mode == VerifyMode::kOff || (c.op != OpKind::kSparseDecode && c.op != OpKind::kDenseDecode)) {
    return Status::Ok();
  }
  const double per_request_head = in.work.flops / static_cast<double>(c.b * c.h_q);
  int64_t n_req = c.b, hw = c.h_q;
  if (mode == VerifyMode::kSample) {
    // All heads of up to 8 requests when that fits the budget, else a window of 16 heads.
    n_req = std::min<int64_t>(c.b, 8);
    if (per_request_head * static_cast<double>(hw * n_req) > budget_flops) {
      hw = std::min<int64_t>(c.h_q, 16);
    }
    while (n_req > 2 && per_request_head * static_cast<double>(hw * n_req) > budget_flops) --n_req;
    while (hw > 2 && per_request_head * static_cast<double>(hw * n_req) > budget_flops) hw /= 2;
  }
  expected->rows.resize(static_cast<size_t>(n_req));
  for (int64_t j = 0; j < n_req; ++j) {
    auto& row = expected->rows[static_cast<size_t>(j)];
    // Spread over the batch and the heads: the first and last request and heads are always in.
    row.request = n_req > 1 ? j * (c.b - 1) / (n_req - 1) : 0;
    row.h0 = n_req > 1 ? ((c.h_q - hw) * j / (n_req - 1)) : 0;
    row.heads = hw;
  }
  const HostOutputs dummy = make_outputs(c, in);
  std::vector<ref::RefOutput> refs(expected->rows.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t j = 0; j < n_req; ++j) {
    const auto& row = expected->rows[static_cast<size_t>(j)];
    refs[static_cast<size_t>(j)] = reference_slice(c, in, dummy, row.request, row.h0, row.heads);
  }
  for (size_t j = 0; j < refs.size(); ++j) {
    expected->rows[j].out = std::move(refs[j].out);
    expected->rows[j].lse = std::move(refs[j].lse);
  }
  expected->what = n_req == c.b && hw == c.h_q
                       ? "all " + std::to_string(c.b) + " requests, all heads"
                       : std::to_string(n_req) + " of " + std::to_string(c.b) + " requests x " +
                             std::to_string(hw) + " of " + std::to_string(c.h_q) + " heads";
  return Status::Ok();
}

Verdict verify(const Case& c, const Inputs& in, const Expected& expected, const HostOutputs& got) {
  if (c.op == OpKind::kQuantizeStore) return verify_store(c, in, got.dst);
  if (c.op == OpKind::kRepack) return verify_repack(c, in, got.dst);
  Verdict v;
  if (!all_finite_bf16(got.out) || !all_finite_f32(got.lse)) {
    v.ok = false;
    v.message =
        "non-finite values in out/lse (unwritten or NaN leaked; every row of the case has "
        "valid tokens)";
    return v;
  }
  const ref::Tolerance tol =
      c.op == OpKind::kSparseDecode ? ref::Tolerance::sparse() : ref::Tolerance::dense();
  for (const auto& row : expected.rows) {
    ref::RefOutput r;
    r.b = 1;
    r.s_q = c.s_q;
    r.h_q = row.heads;
    r.d_v = kDV;
    r.out = row.out;
    r.lse = row.lse;
    const TensorView out = slice(slice(got.out.view(), 0, row.request, 1), 2, row.h0, row.heads);
    const TensorView lse = slice(slice(got.lse.view(), 0, row.request, 1), 1, row.h0, row.heads);
    const ref::CompareResult cr = ref::compare_outputs(out, lse, r, tol);
    v.max_abs_err = std::max(v.max_abs_err, cr.max_abs_err);
    v.max_cos_diff = std::max(v.max_cos_diff, cr.cos_diff);
    v.max_lse_err = std::max(v.max_lse_err, cr.max_lse_err);
    if (!cr.ok && v.ok) {
      v.ok = false;
      v.message = "request " + std::to_string(row.request) + " heads " + std::to_string(row.h0) +
                  ".." + std::to_string(row.h0 + row.heads - 1) + ": " + cr.message;
    }
  }
  v.compared = !expected.rows.empty();
  if (v.ok) v.message = v.compared ? expected.what : "finite only (reference check off)";
  return v;
}

}  // namespace sparse_mla::tools::bench
