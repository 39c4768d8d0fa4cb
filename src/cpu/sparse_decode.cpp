// CPU sparse decode (spec section 3): per (request, query token) the valid slots of both caches
// are gathered and dequantized once into fp32 tiles and attended to by all heads.
#include <omp.h>

#include <algorithm>

#include "src/cpu/attention_common.h"
#include "src/cpu/cpu_backend.h"

namespace sparse_mla::cpu {

namespace {

using detail::Kernels;
using detail::kTileTokens;

// One cache with its index tensor, as the gather loop sees it.
struct Source {
  const uint8_t* data;
  int64_t page_size;
  int64_t page_stride;
  int64_t num_slots;
  detail::DequantFn dequant;
  const TensorView* indices;
  const TensorView* lengths;  // may be null
  int64_t topk;
};

Source make_source(const KVCache& kv, const TensorView& indices,
                   const std::optional<TensorView>& lengths, int64_t topk, const Kernels& k) {
  return Source{static_cast<const uint8_t*>(kv.data),
                kv.page_size,
                kv.page_stride,
                kv.num_slots(),
                k.dequant[static_cast<int>(kv.format)],
                &indices,
                lengths ? &*lengths : nullptr,
                topk};
}

int64_t clamped_length(const Source& src, int64_t i) {
  if (src.lengths == nullptr) return src.topk;
  return std::clamp<int64_t>(*detail::element<const int32_t>(*src.lengths, i), 0, src.topk);
}

// A slot's cache lines (its row, and its footer scales for MODEL1) are fetched a few entries
// ahead: the gather is a chain of independent random reads.
void prefetch_slot(const Source& src, int64_t slot, KVFormat format) {
  const int64_t page = slot / src.page_size;
  const int64_t t = slot - page * src.page_size;
  const uint8_t* base = src.data + page * src.page_stride;
  if (format == KVFormat::kModel1) {
    const uint8_t* row = base + fmt::model1_row_offset(t);
    for (int off = 0; off < kModel1RowBytes; off += 64) __builtin_prefetch(row + off);
    __builtin_prefetch(base + fmt::model1_scale_offset(src.page_size, t));
  } else {
    const uint8_t* row = base + t * kV32BytesPerToken;
    for (int off = 0; off < kV32BytesPerToken; off += 64) __builtin_prefetch(row + off);
  }
}

}  // namespace

Status sparse_decode(const SparseDecodeArgs& args, const SparseDecodeProblem& p) {
  const Kernels& k = detail::kernels();
  const int64_t rows_bs = p.b * p.s_q;
  if (rows_bs == 0 || p.h_q == 0) return Status::Ok();

  Source sources[2];
  int num_sources = 0;
  sources[num_sources++] = make_source(args.kv, args.indices, args.topk_length, p.topk, k);
  if (p.has_extra && args.extra_kv && args.extra_indices) {
    sources[num_sources++] =
        make_source(*args.extra_kv, *args.extra_indices, args.extra_topk_length, p.extra_topk, k);
  }

  // With fewer (request, token) pairs than threads, heads are split too. This costs repeated
  // gathers but leaves results bitwise unchanged (rows are independent).
  const int64_t threads = omp_get_max_threads();
  int64_t groups = 1;
  if (rows_bs < threads) {
    groups = std::min<int64_t>((threads + rows_bs - 1) / rows_bs, (p.h_q + 7) / 8);
  }
  groups = std::max(groups, (p.h_q + detail::kMaxRowsPerUnit - 1) / detail::kMaxRowsPerUnit);
  const int64_t heads_per_group = (p.h_q + groups - 1) / groups;
  groups = (p.h_q + heads_per_group - 1) / heads_per_group;
  const int64_t units = rows_bs * groups;
  const float q_scale = p.softmax_scale * detail::kLog2e;

#pragma omp parallel
  {
    detail::SoftmaxState st;
    detail::RowTile tile;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t g = u % groups;
      const int64_t i = u / groups / p.s_q;
      const int64_t s = u / groups % p.s_q;
      const int64_t h0 = g * heads_per_group;
      const int M = static_cast<int>(std::min(p.h_q, h0 + heads_per_group) - h0);
      st.begin(M, p.d_qk, p.d_v);
      for (int m = 0; m < M; ++m) {
        const uint16_t* q = detail::element<const uint16_t>(args.q, i, s, h0 + m);
        float* dst = st.q_row(m);
        k.load_row(q, DType::kBFloat16, q_scale, dst, p.d_qk);
      }
      tile.count = 0;
      for (int c = 0; c < num_sources; ++c) {
        const Source& src = sources[c];
        const int64_t len = clamped_length(src, i);
        constexpr int kAhead = 4;
        for (int64_t e = 0; e < std::min<int64_t>(kAhead, len); ++e) {
          const int64_t slot = *detail::element<const int32_t>(*src.indices, i, s, e);
          if (slot >= 0 && slot < src.num_slots) prefetch_slot(src, slot, args.kv.format);
        }
        for (int64_t e = 0; e < len; ++e) {
          if (e + kAhead < len) {
            const int64_t ahead = *detail::element<const int32_t>(*src.indices, i, s, e + kAhead);
            if (ahead >= 0 && ahead < src.num_slots) prefetch_slot(src, ahead, args.kv.format);
          }
          const int64_t slot = *detail::element<const int32_t>(*src.indices, i, s, e);
          if (slot < 0 || slot >= src.num_slots) continue;  // -1 or out of range: skipped
          const int64_t page = slot / src.page_size;
          src.dequant(src.data + page * src.page_stride, src.page_size, 1,
                      slot - page * src.page_size, 0, tile.next());
          if (++tile.count == kTileTokens) {
            st.tile(k, tile.rows.data(), kTileTokens);
            tile.count = 0;
          }
        }
      }
      st.tile(k, tile.rows.data(), tile.count);
      for (int m = 0; m < M; ++m) {
        const int64_t h = h0 + m;
        const float* sink =
            args.attn_sink ? detail::element<const float>(*args.attn_sink, h) : nullptr;
        detail::finish_row(k, st.o_row(m), st.max(m), st.sum(m), p.d_v, sink,
                           detail::element<uint16_t>(args.out, i, s, h), args.out.strides[3],
                           DType::kBFloat16, detail::element<float>(args.lse, i, h, s));
      }
    }
  }
  return Status::Ok();
}

}  // namespace sparse_mla::cpu
