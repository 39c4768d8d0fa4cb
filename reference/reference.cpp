#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "reference/testdata.h"

namespace sparse_mla::ref {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Row {
  std::vector<double> k;  // d_qk dequantized values; V is the first d_v of them
};

// Softmax of one (request, query token, head) over rows; writes out/lse with the sink applied.
void attend(const double* q, int d_qk, const std::vector<Row>& rows,
            const std::vector<bool>* visible, double scale, const double* sink, RefOutput& r,
            int64_t i, int64_t s, int64_t h) {
  std::vector<double> logits;
  std::vector<const Row*> used;
  for (size_t j = 0; j < rows.size(); ++j) {
    if (visible && !(*visible)[j]) continue;
    double dot = 0;
    for (int d = 0; d < d_qk; ++d) dot += q[d] * rows[j].k[d];
    logits.push_back(scale * dot);
    used.push_back(&rows[j]);
  }
  if (logits.empty()) {
    for (int64_t d = 0; d < r.d_v; ++d) r.out_at(i, s, h, d) = 0;
    r.lse_at(i, s, h) = kInf;
    return;
  }
  // Every logit -inf: the sum is 0 and lse is +inf, as with no valid slot (FlashMLA's rule for a
  // zero sum); out then follows the formula, sum_j 0 * V_j: 0, NaN where a V_j holds an infinity.
  double lse = kInf;
  if (!std::all_of(logits.begin(), logits.end(), [](double l) { return l == -kInf; })) {
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - m);
    lse = m + std::log(sum);
  }
  double factor = 1;
  if (sink && lse != kInf) factor = 1.0 / (1.0 + std::exp(*sink - lse));
  std::vector<double> acc(r.d_v, 0.0);
  for (size_t j = 0; j < used.size(); ++j) {
    const double w = std::exp(logits[j] - lse);
    for (int64_t d = 0; d < r.d_v; ++d) acc[d] += w * used[j]->k[d];
  }
  for (int64_t d = 0; d < r.d_v; ++d) r.out_at(i, s, h, d) = acc[d] * factor;
  r.lse_at(i, s, h) = lse;
}

RefOutput make_output(int64_t b, int64_t s_q, int64_t h_q, int64_t d_v) {
  RefOutput r;
  r.b = b;
  r.s_q = s_q;
  r.h_q = h_q;
  r.d_v = d_v;
  r.out.assign(b * s_q * h_q * d_v, 0.0);
  r.lse.assign(b * s_q * h_q, 0.0);
  return r;
}

std::vector<double> load_q(const TensorView& q, int64_t i, int64_t s, int64_t h) {
  std::vector<double> v(q.shape[3]);
  for (int64_t d = 0; d < q.shape[3]; ++d) v[d] = load(q, {i, s, h, d});
  return v;
}

// Appends the rows a sparse index row refers to (first `len` entries, valid slots only).
void gather_sparse(const KVCache& kv, const TensorView& indices, int64_t i, int64_t s, int64_t len,
                   int d_qk, std::vector<Row>& rows) {
  for (int64_t k = 0; k < len; ++k) {
    const int64_t slot = static_cast<int64_t>(load(indices, {i, s, k}));
    if (slot < 0 || slot >= kv.num_slots()) continue;
    Row row;
    row.k.resize(d_qk);
    read_row(kv, slot, 0, row.k.data());
    rows.push_back(std::move(row));
  }
}

int64_t clamped_length(const std::optional<TensorView>& lengths, int64_t i, int64_t topk) {
  if (!lengths) return topk;
  return std::clamp<int64_t>(static_cast<int64_t>(load(*lengths, {i})), 0, topk);
}

}  // namespace

RefOutput sparse_decode_reference(const SparseDecodeArgs& a) {
  const int64_t b = a.q.shape[0], s_q = a.q.shape[1], h_q = a.q.shape[2];
  const int d_qk = static_cast<int>(a.q.shape[3]);
  const double scale = a.softmax_scale ? *a.softmax_scale : std::pow(d_qk, -0.5);
  RefOutput r = make_output(b, s_q, h_q, kDV);
  const int64_t topk = a.indices.shape[2];
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      std::vector<Row> rows;
      gather_sparse(a.kv, a.indices, i, s, clamped_length(a.topk_length, i, topk), d_qk, rows);
      if (a.extra_kv && a.extra_indices) {
        const int64_t etopk = a.extra_indices->shape[2];
        gather_sparse(*a.extra_kv, *a.extra_indices, i, s,
                      clamped_length(a.extra_topk_length, i, etopk), d_qk, rows);
      }
      for (int64_t h = 0; h < h_q; ++h) {
        const std::vector<double> q = load_q(a.q, i, s, h);
        double sink = 0;
        if (a.attn_sink) sink = load(*a.attn_sink, {h});
        attend(q.data(), d_qk, rows, nullptr, scale, a.attn_sink ? &sink : nullptr, r, i, s, h);
      }
    }
  }
  return r;
}

RefOutput dense_decode_reference(const DenseDecodeArgs& a, HeadWindow window) {
  const int64_t b = a.q.shape[0], s_q = a.q.shape[1], h_q = a.q.shape[2];
  const int d_qk = static_cast<int>(a.q.shape[3]);
  const double scale = a.softmax_scale ? *a.softmax_scale : std::pow(d_qk, -0.5);
  const int64_t h_kv = a.kv.num_heads;
  if (window.total != 0 && (window.first < 0 || window.first + h_q > window.total ||
                            window.total % h_kv != 0)) {
    throw std::invalid_argument(
        "dense_decode_reference: head window [" + std::to_string(window.first) + ", " +
        std::to_string(window.first + h_q) + ") must lie in [0, " + std::to_string(window.total) +
        ") and total must be a multiple of h_kv " + std::to_string(h_kv));
  }
  const int64_t group = (window.total > 0 ? window.total : h_q) / h_kv;
  const int64_t max_pages = a.block_table.shape[1];
  const int64_t ps = a.kv.page_size;
  RefOutput r = make_output(b, s_q, h_q, kDV);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t hk = 0; hk < h_kv; ++hk) {
      // Heads of q (numbered within the window) that read KV head hk.
      const int64_t h_begin = std::max<int64_t>(hk * group - window.first, 0);
      const int64_t h_end = std::min<int64_t>((hk + 1) * group - window.first, h_q);
      if (h_begin >= h_end) continue;
      const int64_t seqlen =
          std::clamp<int64_t>(static_cast<int64_t>(load(a.cache_seqlens, {i})), 0, max_pages * ps);
      // Rows in token order; position[j] is the token index of rows[j].
      std::vector<Row> rows;
      std::vector<int64_t> position;
      for (int64_t t = 0; t < seqlen; ++t) {
        const int64_t page = static_cast<int64_t>(load(a.block_table, {i, t / ps}));
        if (page < 0 || page >= a.kv.num_pages) continue;
        Row row;
        row.k.resize(d_qk);
        read_row(a.kv, page * ps + t % ps, hk, row.k.data());
        rows.push_back(std::move(row));
        position.push_back(t);
      }
      for (int64_t s = 0; s < s_q; ++s) {
        std::vector<bool> visible(rows.size(), true);
        if (a.causal) {
          const int64_t last = seqlen - s_q + s;  // query token s sees t <= last
          for (size_t j = 0; j < rows.size(); ++j) visible[j] = position[j] <= last;
        }
        for (int64_t h = h_begin; h < h_end; ++h) {
          const std::vector<double> q = load_q(a.q, i, s, h);
          attend(q.data(), d_qk, rows, &visible, scale, nullptr, r, i, s, h);
        }
      }
    }
  }
  return r;
}

RefOutput merge_reference(const MergeArgs& a) {
  const int64_t n = a.out_parts.shape[0], b = a.out_parts.shape[1], s_q = a.out_parts.shape[2],
                h_q = a.out_parts.shape[3], d_v = a.out_parts.shape[4];
  RefOutput r = make_output(b, s_q, h_q, d_v);
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t s = 0; s < s_q; ++s) {
      for (int64_t h = 0; h < h_q; ++h) {
        std::vector<int64_t> parts;
        std::vector<double> lses;
        bool nan = false;
        for (int64_t p = 0; p < n; ++p) {
          const double l = load(a.lse_parts, {p, i, s, h});
          if (std::isnan(l)) nan = true;
          if (std::isinf(l)) continue;
          parts.push_back(p);
          lses.push_back(l);
        }
        if (nan) {
          for (int64_t d = 0; d < d_v; ++d) r.out_at(i, s, h, d) = std::nan("");
          r.lse_at(i, s, h) = std::nan("");
          continue;
        }
        if (parts.empty()) {
          r.lse_at(i, s, h) = kInf;  // out stays 0
          continue;
        }
        const double m = *std::max_element(lses.begin(), lses.end());
        double sum = 0;
        for (double l : lses) sum += std::exp(l - m);
        const double lse = m + std::log(sum);
        double factor = 1;
        if (a.attn_sink) factor = 1.0 / (1.0 + std::exp(load(*a.attn_sink, {h}) - lse));
        for (int64_t d = 0; d < d_v; ++d) {
          double acc = 0;
          for (size_t j = 0; j < parts.size(); ++j) {
            acc += std::exp(lses[j] - lse) * load(a.out_parts, {parts[j], i, s, h, d});
          }
          r.out_at(i, s, h, d) = acc * factor;
        }
        r.lse_at(i, s, h) = lse;
      }
    }
  }
  return r;
}

}  // namespace sparse_mla::ref
