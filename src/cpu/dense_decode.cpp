// CPU dense decode (spec section 4): per (request, KV head) the tokens named by the block table
// are dequantized once into fp32 tiles and attended to by every query token and head of the
// group (causal masking per row). Small batches split the KV range into chunks merged in order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/attention_common.h"
#include "src/cpu/cpu_backend.h"

namespace sparse_mla::cpu {

namespace {

using detail::Kernels;
using detail::kTileTokens;

// KV chunking (split-KV) depends on shapes only, so results never depend on the thread count.
constexpr int64_t kChunkTokens = 2048;
constexpr int64_t kMaxChunks = 8;
constexpr int64_t kSplitBelowUnits = 4;
// Chunk partials take rows * chunks * d_v floats: chunked only up to this many rows a request.
constexpr int64_t kMaxChunkRows = 4096;

}  // namespace

Status dense_decode(const DenseDecodeArgs& args, const DenseDecodeProblem& p) {
  const Kernels& k = detail::kernels();
  if (p.b == 0 || p.h_q == 0) return Status::Ok();
  const KVCache& kv = args.kv;
  const int64_t ps = kv.page_size;
  const int64_t group = p.h_q / p.h_kv;
  const int64_t rows_total = p.s_q * group;  // row r: query token r / group, head r % group
  const int64_t max_tokens = p.max_pages * ps;
  const detail::DequantFn dequant = k.dequant[static_cast<int>(kv.format)];
  const uint8_t* cache = static_cast<const uint8_t*>(kv.data);
  const DType qt = args.q.dtype;

  int64_t chunks = 1;
  int64_t chunk_tokens = std::max<int64_t>(max_tokens, 1);
  if (p.b * p.h_kv < kSplitBelowUnits && max_tokens > 2 * kChunkTokens &&
      rows_total <= kMaxChunkRows) {
    chunks = std::min(kMaxChunks, (max_tokens + kChunkTokens - 1) / kChunkTokens);
    chunk_tokens =
        ((max_tokens + chunks - 1) / chunks + kTileTokens - 1) / kTileTokens * kTileTokens;
  }
  // Row groups (bitwise neutral) keep every thread busy when there are few (request, head) units.
  const int64_t base_units = p.b * p.h_kv * chunks;
  const int64_t threads = omp_get_max_threads();
  int64_t rgroups = 1;
  if (base_units < threads) {
    rgroups = std::min<int64_t>((threads + base_units - 1) / base_units, (rows_total + 7) / 8);
  }
  rgroups = std::max(rgroups, (rows_total + detail::kMaxRowsPerUnit - 1) / detail::kMaxRowsPerUnit);
  const int64_t rows_per = (rows_total + rgroups - 1) / rgroups;
  rgroups = (rows_total + rows_per - 1) / rows_per;
  const int64_t units = base_units * rgroups;
  const float q_scale = p.softmax_scale * detail::kLog2e;

  // Chunk partials: unnormalized o, running max (base 2) and sum per row.
  std::vector<float> part_o, part_m, part_l;
  if (chunks > 1) {
    part_o.resize(static_cast<size_t>(units * rows_per * p.d_v));
    part_m.resize(static_cast<size_t>(units * rows_per));
    part_l.resize(static_cast<size_t>(units * rows_per));
  }

  auto row_token = [&](int64_t r) { return r / group; };
  auto row_head = [&](int64_t hk, int64_t r) { return hk * group + r % group; };

#pragma omp parallel
  {
    detail::SoftmaxState st;
    detail::RowTile tile;
    std::vector<int64_t> visible_until(rows_per);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t c = u % chunks;
      const int64_t rg = u / chunks % rgroups;
      const int64_t hk = u / chunks / rgroups % p.h_kv;
      const int64_t i = u / chunks / rgroups / p.h_kv;
      const int64_t r0 = rg * rows_per;
      const int M = static_cast<int>(std::min(rows_total, r0 + rows_per) - r0);
      const int64_t seqlen = std::clamp<int64_t>(
          *detail::element<const int32_t>(args.cache_seqlens, i), 0, max_tokens);

      st.begin(M, p.d_qk, p.d_v);
      int64_t min_visible = std::numeric_limits<int64_t>::max();
      int64_t max_visible = -1;
      for (int m = 0; m < M; ++m) {
        const int64_t r = r0 + m;
        const int64_t s = row_token(r);
        visible_until[m] = p.causal ? seqlen - p.s_q + s : seqlen - 1;
        min_visible = std::min(min_visible, visible_until[m]);
        max_visible = std::max(max_visible, visible_until[m]);
        const uint16_t* q = detail::element<const uint16_t>(args.q, i, s, row_head(hk, r));
        float* dst = st.q_row(m);
        k.load_row(q, qt, q_scale, dst, p.d_qk);
      }
      auto flush = [&] {
        const bool mask = tile.count > 0 && tile.pos[tile.count - 1] > min_visible;
        st.tile(k, tile.rows.data(), tile.count, tile.pos, mask ? visible_until.data() : nullptr);
        tile.count = 0;
      };

      tile.count = 0;
      const int64_t t_stop = std::min({seqlen, max_visible + 1, (c + 1) * chunk_tokens});
      int64_t t = c * chunk_tokens;
      while (t < t_stop) {
        const int64_t page_index = t / ps;
        const int64_t page_end = std::min(t_stop, (page_index + 1) * ps);
        const int64_t page = *detail::element<const int32_t>(args.block_table, i, page_index);
        if (page < 0 || page >= kv.num_pages) {  // never dereferenced
          t = page_end;
          continue;
        }
        const uint8_t* base = cache + page * kv.page_stride;
        for (; t < page_end; ++t) {
          dequant(base, ps, p.h_kv, t - page_index * ps, hk, tile.next());
          tile.pos[tile.count] = t;
          if (++tile.count == kTileTokens) flush();
        }
      }
      flush();

      if (chunks == 1) {
        for (int m = 0; m < M; ++m) {
          const int64_t r = r0 + m;
          const int64_t s = row_token(r), h = row_head(hk, r);
          detail::finish_row(k, st.o_row(m), st.max(m), st.sum(m), p.d_v, nullptr,
                             detail::element<uint16_t>(args.out, i, s, h), args.out.strides[3], qt,
                             detail::element<float>(args.lse, i, h, s));
        }
      } else {
        for (int m = 0; m < M; ++m) {
          const size_t at = static_cast<size_t>(u * rows_per + m);
          std::copy(st.o_row(m), st.o_row(m) + p.d_v, part_o.begin() + at * p.d_v);
          part_m[at] = st.max(m);
          part_l[at] = st.sum(m);
        }
      }
    }
  }
  if (chunks == 1) return Status::Ok();

  // Merge the chunks of each (request, KV head, row group) in chunk order.
  const int64_t merge_units = units / chunks;
#pragma omp parallel
  {
    std::vector<float> o(p.d_v);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < merge_units; ++w) {
      const int64_t rg = w % rgroups;
      const int64_t hk = w / rgroups % p.h_kv;
      const int64_t i = w / rgroups / p.h_kv;
      const int64_t r0 = rg * rows_per;
      const int M = static_cast<int>(std::min(rows_total, r0 + rows_per) - r0);
      for (int m = 0; m < M; ++m) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) {
          const size_t at = static_cast<size_t>((w * chunks + c) * rows_per + m);
          if (part_l[at] != 0.f) mx = std::max(mx, part_m[at]);
        }
        std::fill(o.begin(), o.end(), 0.f);
        float l = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          const size_t at = static_cast<size_t>((w * chunks + c) * rows_per + m);
          // A chunk of -inf logits only (l 0) weighs 0 but keeps the NaN of its 0 * inf V values.
          const float a = part_l[at] == 0.f ? 0.f : std::exp2(part_m[at] - mx);
          const float* po = part_o.data() + at * p.d_v;
          for (int n = 0; n < p.d_v; ++n) o[n] += a * po[n];
          l += a * part_l[at];
        }
        const int64_t r = r0 + m;
        const int64_t s = row_token(r), h = row_head(hk, r);
        detail::finish_row(k, o.data(), mx, l, p.d_v, nullptr,
                           detail::element<uint16_t>(args.out, i, s, h), args.out.strides[3], qt,
                           detail::element<float>(args.lse, i, h, s));
      }
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
